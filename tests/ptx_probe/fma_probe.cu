// tests/test_ptx_fma.py compiles this to PTX and looks for contracted FMAs in
// each entry: one kernel per function whose arithmetic must round as written
// (the clip rule of clip/clip_rule.cuh, the sampler's log and the normals'
// log, sin, cos and finish of common/philox.cuh), each doing nothing but load, call, store, so any fma in
// an entry's body comes from the function under test.
#include "clip/clip_rule.cuh"
#include "common/philox.cuh"

extern "C" __global__ void probe_clip_bound(const double* in, double* out, ncdp::ClipRule rule) {
  out[0] = ncdp::clip_bound(in[0], in[1], rule);
}

extern "C" __global__ void probe_clip_factor(const double* in, double* out, ncdp::ClipRule rule) {
  out[0] = ncdp::clip_factor(in[0], in[1], rule);
}

extern "C" __global__ void probe_sampler_log(const double* in, double* out) {
  out[0] = ncdp::philox::sampler_log(in[0]);
}

extern "C" __global__ void probe_sampler_log1p(const double* in, double* out) {
  out[0] = ncdp::philox::sampler_log1p(in[0]);
}

// The normals' functions (philox.cuh, "The normals"): the numba twin's bits.
extern "C" __global__ void probe_log_normal(const double* in, double* out) {
  out[0] = ncdp::philox::log_normal(in[0]);
}

extern "C" __global__ void probe_cos_sin_2pi(const double* in, double* out) {
  ncdp::philox::cos_sin_2pi(in[0], &out[0], &out[1]);
}

extern "C" __global__ void probe_finish_normal(const double* in, double* out) {
  out[0] = ncdp::philox::finish_normal(in[0], in[1], in[2], in[3]);
  out[1] = ncdp::philox::fill_normal(in[1], in[2], in[3]);
}
