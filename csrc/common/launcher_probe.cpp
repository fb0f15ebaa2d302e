// The launcher probe of launcher_probe.h. Host code only: it calls the typed
// launchers exactly as the *_host.cpp wrappers do, minus their validation and
// device guard (null pointers must reach the launch code on a machine without
// a device).
#include "common/launcher_probe.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "clip/clip_noise.h"
#include "common/cuda_check.h"
#include "mix/mix.h"
#include "ntk/hadamard_gram.h"
#include "rng/gaussian.h"

namespace ncdp {
namespace {

const cudaStream_t kLegacyStream = nullptr;  // stream 0

std::string sizes(std::initializer_list<std::pair<const char*, std::int64_t>> values) {
  std::string text;
  for (const auto& [name, value] : values) {
    if (!text.empty()) text += ", ";
    text += std::string(name) + " = " + std::to_string(value);
  }
  return text;
}

// One probe run: its buffers and the outcome of its cases.
class Probe {
 public:
  Probe(std::string name, bool device) : name_(std::move(name)), device_(device) {}
  ~Probe() {
    for (void* ptr : owned_) (void)cudaFree(ptr);
  }
  Probe(const Probe&) = delete;
  Probe& operator=(const Probe&) = delete;

  // `count` zeroed elements on the device, or nullptr without one (and for
  // count 0, as the wrappers pass for empty buffers).
  template <typename T>
  T* buffer(std::int64_t count) {
    if (!device_ || count <= 0) return nullptr;
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(T);
    void* ptr = nullptr;
    check_cuda(cudaMalloc(&ptr, bytes), where("cudaMalloc"));
    owned_.push_back(ptr);
    check_cuda(cudaMemset(ptr, 0, bytes), where("cudaMemset"));
    return static_cast<T*>(ptr);
  }
  void* bytes(std::int64_t count) { return buffer<unsigned char>(count); }

  // After each launcher call. With a device: its launches and their kernels
  // must succeed. Without one: it must have attempted a launch (else the case
  // proves nothing); the failure is kept and the remaining cases still run, so
  // that every launch path of the launcher is reached.
  void check(const std::string& what) {
    const cudaError_t launch = cudaGetLastError();
    if (device_) {
      if (launch != cudaSuccess) throw_cuda_error(launch, where(what));
      check_cuda(cudaDeviceSynchronize(), where(what));
      return;
    }
    if (launch == cudaSuccess) {
      throw std::runtime_error("ncdp_fast: " + where(what) +
                               " attempted no launch without a device: the case returns "
                               "before the launch code and tests nothing");
    }
    if (first_error_ == cudaSuccess) {
      first_error_ = launch;
      first_case_ = what;
    }
  }

  // After the last case: without a device, raises the first launch failure.
  void finish() {
    const cudaError_t sync = cudaDeviceSynchronize();
    if (first_error_ != cudaSuccess) throw_cuda_error(first_error_, where(first_case_));
    check_cuda(sync, where("cudaDeviceSynchronize"));
  }

 private:
  std::string where(const std::string& what) const {
    return "launcher probe " + name_ + " (" + what + ")";
  }

  std::string name_;
  bool device_;
  std::vector<void*> owned_;
  cudaError_t first_error_ = cudaSuccess;
  std::string first_case_;
};

constexpr std::uint64_t kSeed = 7;
constexpr std::uint64_t kOffset = 3;

// ---- clip

template <typename Real>
void probe_row_sq_norms(Probe& probe) {
  const std::int64_t B = 3, p = 5;
  kernels::launch_row_sq_norms<Real>(probe.buffer<Real>(B * p), B, p, probe.buffer<double>(B),
                                     /*accumulate=*/false, kLegacyStream);
  probe.check(sizes({{"B", B}, {"p", p}}));
}

// m % 4 == 0 takes the vector kernel, m = 5 the element one.
template <typename Real>
void probe_scale_rows(Probe& probe) {
  for (const std::int64_t m : {std::int64_t{8}, std::int64_t{5}}) {
    const std::int64_t B = 3;
    kernels::launch_scale_rows<Real>(probe.buffer<Real>(B * m), probe.buffer<double>(B), B, m,
                                     probe.buffer<Real>(B * m), kLegacyStream);
    probe.check(sizes({{"B", B}, {"m", m}}));
  }
}

// T = 3 with 2 layers and both optional outputs (both passes), with W per
// layer and shared, float64 and float32 Grams; T = 0 (no positions: the
// finish alone) too.
template <typename Gram>
void probe_linear_norms_from_grams(Probe& probe) {
  // Float32 Grams carry the float32 model's constants, float64 ones none.
  const kernels::GramRounding rounding =
      sizeof(Gram) == sizeof(float) ? kernels::gram32_rounding(5, 7) : kernels::GramRounding{};
  const std::int64_t B = 3, layers = 2;
  for (const std::int64_t T : {std::int64_t{3}, std::int64_t{0}}) {
    for (const bool shared : {false, true}) {
      kernels::launch_linear_norms_from_grams(
          probe.buffer<Gram>(layers * B * T * T), probe.buffer<Gram>(layers * B * T * T), B,
          layers, T, /*bias=*/true, shared, rounding, probe.buffer<double>(B),
          /*accumulate=*/true, probe.buffer<double>(B), probe.buffer<double>(layers * B * 2),
          probe.bytes(kernels::linear_norms_from_grams_workspace_bytes(B, layers, T)),
          kLegacyStream);
      probe.check(sizes({{"B", B}, {"layers", layers}, {"T", T}, {"shared_w", shared},
                         {"float32 Grams", rounding.enabled}}));
    }
  }
}

// LayerNorm (run 0) and GroupNorm (run 2) layouts, both outputs, and rows = 0
// (no positions: the column kernel alone).
template <typename Real>
void probe_norm_affine_grads(Probe& probe) {
  const std::int64_t B = 2, n = 4;
  for (const std::int64_t rows : {std::int64_t{3}, std::int64_t{0}}) {
    for (const std::int64_t run : {std::int64_t{0}, std::int64_t{2}}) {
      const std::int64_t C = run == 0 ? n : rows * (n / run);
      kernels::launch_norm_affine_grads<Real>(
          probe.buffer<Real>(B * rows * n), probe.buffer<Real>(B * rows * n), B, rows, n, run,
          1e-5, probe.buffer<Real>(B * C), probe.buffer<Real>(B * C),
          probe.buffer<double>(2 * B * rows), kLegacyStream);
      probe.check(sizes({{"B", B}, {"rows", rows}, {"n", n}, {"run", run}}));
    }
  }
}

// One tile (T 3) and a triangle of three (T 65, d past one staged step), two
// sources; d = 0 writes zeros; d = 600 splits into k-ranges (the ranges' sum
// kernel launched too).
void probe_gram_rows_f64(Probe& probe) {
  const std::int64_t n = 2;
  for (const std::int64_t T : {std::int64_t{3}, std::int64_t{65}}) {
    for (const std::int64_t d : {std::int64_t{0}, std::int64_t{17}, std::int64_t{600}}) {
      kernels::GramSources src{};
      src.count = 2;
      for (int s = 0; s < src.count; ++s) {
        src.x[s] = probe.buffer<float>(n * T * std::max<std::int64_t>(d, 1));
        src.sample_stride[s] = T * d;
        src.row_stride[s] = d;
      }
      const std::int64_t ws = kernels::gram_rows_f64_workspace_bytes(src.count, n, T, d);
      kernels::launch_gram_rows_f64(src, n, T, d, probe.buffer<double>(2 * n * T * T),
                                    probe.buffer<double>(ws / 8 + 1), kLegacyStream);
      probe.check(sizes({{"n", n}, {"T", T}, {"d", d}}));
    }
  }
}

void probe_clip_factors(Probe& probe) {
  const std::int64_t B = 3;
  // One group and a full table (the most a launch takes).
  for (const int groups : {1, kernels::kMaxClipGroups}) {
    kernels::ClipRuleTable rules{};
    rules.count = groups;
    rules.unit = 0x1p-24;
    for (int g = 0; g < groups; ++g) {
      rules.max_norm[g] = 1.0;
      rules.terms[g] = 4;
      rules.seq_len[g] = 2;
    }
    double* out = probe.buffer<double>(groups * 2 * B);
    kernels::launch_clip_factors(probe.buffer<double>(groups * B),
                                 probe.buffer<double>(groups * B), B, rules, /*scale=*/3.0, out,
                                 out + B, 2 * B, probe.buffer<double>(groups * B),
                                 kLegacyStream);
    probe.check(sizes({{"B", B}, {"groups", groups}}));
  }
}

// p % 4 != 0 and p % 4 == 0 take the scalar and the vector kernel; B = 0 the
// pure-noise finish alone.
constexpr std::pair<std::int64_t, std::int64_t> kRowSumShapes[] = {{3, 5}, {20, 8}, {0, 5}};

// Out: Real, or double (the float64 sum the clip op finishes later).
template <typename Real, typename Out>
void probe_weighted_row_sum_noise(Probe& probe) {
  for (const auto& [B, p] : kRowSumShapes) {
    const std::int64_t workspace = kernels::weighted_row_sum_workspace_bytes(B, p);
    kernels::launch_weighted_row_sum_noise<Real, Out>(
        probe.buffer<Real>(B * p), probe.buffer<double>(B), B, p, 1.0, 0.5, kSeed, kOffset,
        probe.buffer<Out>(p), probe.bytes(workspace), kLegacyStream);
    probe.check(sizes({{"B", B}, {"p", p}}));
  }
}

template <typename Real>
void probe_clip_noise_rows_one_pass(Probe& probe) {
  // Two blocks of columns (p = 2100), row blocks of one row; then one block.
  const std::int64_t cases[][3] = {{3, 2100, 2}, {2, 9, 1}};
  for (const auto& c : cases) {
    const std::int64_t B = c[0], p = c[1], blocks = c[2];
    const auto layout = kernels::clip_noise_rows_layout(B, p);
    const ClipRule rule{1.0, p, 1, unit_roundoff<Real>()};
    kernels::launch_clip_noise_rows_one_pass<Real>(
        probe.buffer<Real>(B * p), B, p, rule, 1.0, 0.5, kSeed, kOffset, probe.buffer<Real>(p),
        probe.buffer<double>(B), layout, probe.bytes(layout.total_bytes), /*l2_bytes=*/0, blocks,
        kLegacyStream);
    probe.check(sizes({{"B", B}, {"p", p}, {"blocks", blocks}}));
  }
}

template <typename Real>
void probe_clip_noise_rows(Probe& probe) {
  // l2_bytes = 0 is one chunk; room for 2 rows splits B = 3 into two chunks;
  // one_pass_blocks 2 takes the one-pass form (p = 2100: two blocks of columns).
  const std::int64_t l2_two_rows = 4 * 5 * static_cast<std::int64_t>(sizeof(Real));
  const std::int64_t cases[][4] = {
      {3, 5, 0, 0}, {20, 8, 0, 0}, {3, 5, l2_two_rows, 0}, {3, 2100, 0, 2}, {5, 7, 0, -1}};
  for (const auto& c : cases) {
    const std::int64_t B = c[0], p = c[1], l2 = c[2], one_pass = c[3];
    const auto layout = kernels::clip_noise_rows_layout(B, p);
    kernels::launch_clip_noise_rows<Real>(probe.buffer<Real>(B * p), B, p, 1.0, 1.0, 0.5, kSeed,
                                          kOffset, probe.buffer<Real>(p), probe.buffer<double>(B),
                                          probe.bytes(layout.total_bytes), l2, one_pass,
                                          kLegacyStream);
    probe.check(sizes({{"B", B}, {"p", p}, {"l2_bytes", l2}, {"one_pass_blocks", one_pass}}));
  }
}

template <typename Real>
void probe_linear_sq_norms(Probe& probe) {
  // T = 1: rank-1 kernel; 2 T^2 <= K d: Gram kernel; else the direct one.
  const std::int64_t cases[][5] = {{2, 1, 3, 2, 1}, {2, 2, 3, 4, 0}, {2, 5, 2, 2, 1}};
  for (const auto& c : cases) {
    const std::int64_t B = c[0], T = c[1], d = c[2], K = c[3];
    const bool bias = c[4] != 0;
    kernels::launch_linear_sq_norms<Real>(probe.buffer<Real>(B * T * d),
                                          probe.buffer<Real>(B * T * K), B, T, d, K, bias,
                                          probe.buffer<double>(B), /*accumulate=*/false,
                                          T == 1 ? probe.buffer<double>(2 * B) : nullptr,
                                          kLegacyStream);
    probe.check(sizes({{"B", B}, {"T", T}, {"d", d}, {"K", K}, {"bias", c[4]}}));
  }
}

template <typename Real>
void probe_clipped_linear_sum(Probe& probe) {
  // The last case has enough rows (B * T = 600) for 3 slabs of partials.
  const std::int64_t cases[][6] = {
      {2, 1, 3, 2, 1, 0}, {2, 1, 3, 2, 0, 0}, {300, 2, 3, 2, 1, 1}};
  for (const auto& c : cases) {
    const std::int64_t B = c[0], T = c[1], d = c[2], K = c[3];
    const bool bias = c[4] != 0;
    const std::int64_t workspace =
        c[5] != 0 ? kernels::clipped_linear_sum_layout_bytes(
                        kernels::clipped_linear_sum_slabs(B * T, d, K), d, K, sizeof(Real))
                  : 0;
    Real* gb = bias ? probe.buffer<Real>(K) : nullptr;
    kernels::launch_clipped_linear_sum<Real>(
        probe.buffer<Real>(B * T * d), probe.buffer<Real>(B * T * K), probe.buffer<double>(B), B,
        T, d, K, 1.0, 0.5, kSeed, kOffset, probe.buffer<Real>(K * d), gb,
        probe.bytes(workspace), workspace, kLegacyStream);
    probe.check(sizes({{"B", B}, {"T", T}, {"d", d}, {"K", K}, {"bias", c[4]},
                       {"workspace_bytes", workspace}}));
  }
}

// ---- rng

template <typename Partial, typename Real>
void probe_slab_sum_plus_gaussian(Probe& probe) {
  const std::int64_t p = 5;
  for (const std::int64_t slabs : {2, 0}) {
    kernels::launch_slab_sum_plus_gaussian<Partial, Real>(
        probe.buffer<Partial>(slabs * p), slabs, p, 1.0, 0.5, kSeed, kOffset,
        probe.buffer<Real>(p), kLegacyStream);
    probe.check(sizes({{"slabs", slabs}, {"p", p}}));
  }
}

template <typename Real>
void probe_fill_gaussian(Probe& probe) {
  const std::int64_t count = 7;
  for (const bool accumulate : {false, true}) {
    kernels::launch_fill_gaussian<Real>(probe.buffer<Real>(count), count, kSeed, kOffset, 2.0,
                                        0.5, accumulate, kLegacyStream);
    probe.check(sizes({{"count", count}, {"accumulate", accumulate}}));
  }
}

// One table of each segment kind (float32 in place, float64 in place, a
// float64 sum into float32), at offsets of two phases.
void probe_finish_gaussian_segments(Probe& probe) {
  kernels::GaussianSegments table{};
  const std::int64_t n = 5;
  float* f32 = probe.buffer<float>(n);
  double* f64 = probe.buffer<double>(n);
  kernels::append_gaussian_segment(table, f32, f32, n, kOffset, kernels::kSegmentFloat32);
  kernels::append_gaussian_segment(table, f64, f64, n, kOffset + n, kernels::kSegmentFloat64);
  kernels::append_gaussian_segment(table, probe.buffer<float>(n), probe.buffer<double>(n), n,
                                   kOffset + 2 * n, kernels::kSegmentFloat64ToFloat32);
  kernels::launch_finish_gaussian_segments(table, kSeed, 2.0, 0.5, kLegacyStream);
  probe.check(sizes({{"segments", table.count}, {"size", n}}));
}

// ---- mix

// G groups, all empty in zeroed buffers (group_ptr all 0), which is a valid
// population: rows select nothing and are pure noise.
kernels::GroupSampling sampling(Probe& probe, std::int64_t G, bool optional_arrays) {
  return kernels::GroupSampling{probe.buffer<std::int64_t>(G + 1),
                                optional_arrays ? probe.buffer<std::int64_t>(1) : nullptr, G,
                                optional_arrays ? probe.buffer<double>(G) : nullptr,
                                probe.buffer<double>(G)};
}

void probe_sample_counts(Probe& probe) {
  const std::int64_t G = 2, rows = 3;
  for (const bool optional_arrays : {true, false}) {
    kernels::launch_sample_counts(sampling(probe, G, optional_arrays), rows, /*row_stride=*/5,
                                  kSeed, kOffset, probe.buffer<std::int64_t>(rows),
                                  kLegacyStream);
    probe.check(sizes({{"G", G}, {"rows", rows}, {"members and select_rate", optional_arrays}}));
  }
}

void probe_sample_fill(Probe& probe) {
  const std::int64_t G = 2, rows = 3;
  for (const bool optional_arrays : {true, false}) {
    kernels::launch_sample_fill(sampling(probe, G, optional_arrays), rows, /*row_stride=*/5,
                                kSeed, kOffset, probe.buffer<std::int64_t>(rows + 1),
                                probe.buffer<std::int64_t>(1), kLegacyStream);
    probe.check(sizes({{"G", G}, {"rows", rows}, {"members and select_rate", optional_arrays}}));
  }
}

template <typename Real>
void probe_mix_rows(Probe& probe) {
  // Widths of 1, 2, 4 and 8 register slots per thread, and one past the fused
  // limit of either dtype (tiled kernel); hard labels, then soft ones.
  const std::int64_t n = 3, K = 2, G = 2, rows = 2;
  const std::int64_t cases[][2] = {{3, 0}, {1025, 0}, {3000, 0}, {5000, 0}, {9000, 0}, {3, 1}};
  for (const auto& c : cases) {
    const std::int64_t d = c[0];
    const bool soft = c[1] != 0;
    kernels::launch_mix_rows<Real>(
        probe.buffer<Real>(n * d), n, d, soft ? nullptr : probe.buffer<std::int64_t>(n),
        soft ? probe.buffer<Real>(n * K) : nullptr, K, sampling(probe, G, true), rows, kSeed,
        kOffset, 0.5, /*clip_x=*/1.0, 1.0, 1.0, probe.buffer<Real>(rows * d),
        probe.buffer<Real>(rows * K), probe.buffer<std::int64_t>(rows), kLegacyStream);
    probe.check(sizes({{"n", n}, {"d", d}, {"K", K}, {"rows", rows}, {"soft_labels", c[1]}}));
  }
}

// ---- ntk

template <typename Real, typename Acc, typename Out>
void probe_hadamard_gram(Probe& probe) {
  const std::int64_t n = 5, n2 = 3, a = 2, bw = 3;
  const Real* f = probe.buffer<Real>(n * a);
  const Real* f2 = probe.buffer<Real>(n2 * a);
  const Real* b = probe.buffer<Real>(n * bw);
  const Real* b2 = probe.buffer<Real>(n2 * bw);
  // A constant-1 (bias) term and a term with an F factor.
  const kernels::GramTerm<Real> cross[] = {{nullptr, nullptr, b, b2, 0, bw}, {f, f2, b, b2, a, bw}};
  kernels::launch_hadamard_gram<Real, Acc, Out>(cross, 2, n, n2, /*symmetric=*/false,
                                                probe.buffer<Out>(n * n2), kLegacyStream);
  probe.check(sizes({{"terms", 2}, {"n", n}, {"n2", n2}, {"symmetric", 0}}));

  const kernels::GramTerm<Real> self[] = {{nullptr, nullptr, b, b, 0, bw}, {f, f, b, b, a, bw}};
  kernels::launch_hadamard_gram<Real, Acc, Out>(self, 2, n, n, /*symmetric=*/true,
                                                probe.buffer<Out>(n * n), kLegacyStream);
  probe.check(sizes({{"terms", 2}, {"n", n}, {"symmetric", 1}}));

  // No terms (one launch writing zeros), and more terms than one launch holds.
  std::vector<kernels::GramTerm<Real>> many(kernels::kMaxGramTermsPerLaunch + 1, self[1]);
  for (const std::int64_t count : {std::int64_t{0}, static_cast<std::int64_t>(many.size())}) {
    kernels::launch_hadamard_gram<Real, Acc, Out>(many.data(), count, n, n, /*symmetric=*/true,
                                                  probe.buffer<Out>(n * n), kLegacyStream);
    probe.check(sizes({{"terms", count}, {"n", n}, {"symmetric", 1}}));
  }
}

struct Entry {
  const char* name;
  void (*run)(Probe&);
};

// Every instantiation declared in the kernels' headers; tests/test_native_guard.py
// compares this list with the launchers defined in the built objects.
const std::vector<Entry>& registry() {
  static const std::vector<Entry> entries = {
      {"row_sq_norms<float>", &probe_row_sq_norms<float>},
      {"row_sq_norms<double>", &probe_row_sq_norms<double>},
      {"scale_rows<float>", &probe_scale_rows<float>},
      {"scale_rows<double>", &probe_scale_rows<double>},
      {"clip_factors", &probe_clip_factors},
      {"gram_rows_f64", &probe_gram_rows_f64},
      {"linear_norms_from_grams<float>", &probe_linear_norms_from_grams<float>},
      {"linear_norms_from_grams<double>", &probe_linear_norms_from_grams<double>},
      {"weighted_row_sum_noise<float,float>", &probe_weighted_row_sum_noise<float, float>},
      {"weighted_row_sum_noise<double,double>", &probe_weighted_row_sum_noise<double, double>},
      {"weighted_row_sum_noise<float,double>", &probe_weighted_row_sum_noise<float, double>},
      {"clip_noise_rows<float>", &probe_clip_noise_rows<float>},
      {"clip_noise_rows<double>", &probe_clip_noise_rows<double>},
      {"clip_noise_rows_one_pass<float>", &probe_clip_noise_rows_one_pass<float>},
      {"clip_noise_rows_one_pass<double>", &probe_clip_noise_rows_one_pass<double>},
      {"norm_affine_grads<float>", &probe_norm_affine_grads<float>},
      {"norm_affine_grads<double>", &probe_norm_affine_grads<double>},
      {"linear_sq_norms<float>", &probe_linear_sq_norms<float>},
      {"linear_sq_norms<double>", &probe_linear_sq_norms<double>},
      {"clipped_linear_sum<float>", &probe_clipped_linear_sum<float>},
      {"clipped_linear_sum<double>", &probe_clipped_linear_sum<double>},
      {"slab_sum_plus_gaussian<float,float>", &probe_slab_sum_plus_gaussian<float, float>},
      {"slab_sum_plus_gaussian<double,double>", &probe_slab_sum_plus_gaussian<double, double>},
      {"slab_sum_plus_gaussian<double,float>", &probe_slab_sum_plus_gaussian<double, float>},
      {"fill_gaussian<float>", &probe_fill_gaussian<float>},
      {"fill_gaussian<double>", &probe_fill_gaussian<double>},
      {"finish_gaussian_segments", &probe_finish_gaussian_segments},
      {"sample_counts", &probe_sample_counts},
      {"sample_fill", &probe_sample_fill},
      {"mix_rows<float>", &probe_mix_rows<float>},
      {"mix_rows<double>", &probe_mix_rows<double>},
      {"hadamard_gram<float,float,float>", &probe_hadamard_gram<float, float, float>},
      {"hadamard_gram<float,float,double>", &probe_hadamard_gram<float, float, double>},
      {"hadamard_gram<float,double,float>", &probe_hadamard_gram<float, double, float>},
      {"hadamard_gram<float,double,double>", &probe_hadamard_gram<float, double, double>},
      {"hadamard_gram<double,double,float>", &probe_hadamard_gram<double, double, float>},
      {"hadamard_gram<double,double,double>", &probe_hadamard_gram<double, double, double>},
  };
  return entries;
}

}  // namespace

std::vector<std::string> typed_launcher_names() {
  std::vector<std::string> names;
  for (const Entry& entry : registry()) names.emplace_back(entry.name);
  return names;
}

void probe_typed_launcher(const std::string& name) {
  for (const Entry& entry : registry()) {
    if (name != entry.name) continue;
    int count = 0;
    const bool device = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    // No driver or no device leaves an error behind: the first case's check
    // must see its own launch's error, not this one.
    (void)cudaGetLastError();
    Probe probe(name, device);
    entry.run(probe);
    probe.finish();
    return;
  }
  throw std::invalid_argument("ncdp_fast: name must be one of typed_launcher_names(), got '" +
                              name + "'");
}

}  // namespace ncdp
