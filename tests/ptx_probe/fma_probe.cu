// tests/test_ptx_fma.py compiles this to PTX and looks for contracted FMAs in
// each entry: one kernel per function whose arithmetic must round as written
// (the clip rule of clip/clip_rule.cuh, the sampler's log of
// common/philox.cuh), each doing nothing but load, call, store, so any fma in
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
