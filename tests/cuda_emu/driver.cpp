// Runs one typed launcher of csrc/ (compiled for the CPU emulation) on buffers
// given by tests/test_cuda_emulation.py, so that the test can compare the
// kernels' results with ncdp_fast/reference/.
//
//   emu-driver CASE_DIR
//   emu-driver --serve           one CASE_DIR per line of stdin (serve.h)
//
// CASE_DIR/args.txt has one item per line:
//   op NAME                      the launcher to run
//   i NAME VALUE | u NAME VALUE  int64 / uint64 scalar
//   f NAME VALUE                 double (strtod syntax; the test writes hex floats)
//   b NAME FILE MISALIGN         buffer: raw bytes of FILE (relative to CASE_DIR),
//                                placed MISALIGN bytes after a 16-byte boundary
// Every buffer is written back to FILE.out after the launch. The buffers are
// allocated at exactly their size (plus the misalignment), so AddressSanitizer
// reports any access past them.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "clip/clip_noise.h"
#include "mix/mix.h"
#include "ntk/hadamard_gram.h"
#include "rng/gaussian.h"
#include "serve.h"

namespace {

struct Buffer {
  std::string file;
  std::size_t bytes = 0;
  std::size_t misalign = 0;
  char* base = nullptr;
  char* data() const { return base + misalign; }
};

struct Case {
  std::string dir;
  std::string op;
  std::map<std::string, std::int64_t> ints;
  std::map<std::string, std::uint64_t> uints;
  std::map<std::string, double> floats;
  std::map<std::string, Buffer> buffers;

  std::int64_t i(const std::string& name) const { return lookup(ints, name); }
  std::uint64_t u(const std::string& name) const { return lookup(uints, name); }
  double f(const std::string& name) const { return lookup(floats, name); }
  bool has(const std::string& name) const { return buffers.count(name) != 0; }
  template <typename T>
  T* ptr(const std::string& name) const {
    auto it = buffers.find(name);
    return it == buffers.end() ? nullptr : reinterpret_cast<T*>(it->second.data());
  }

  template <typename Map>
  static typename Map::mapped_type lookup(const Map& map, const std::string& name) {
    auto it = map.find(name);
    if (it == map.end()) throw std::invalid_argument("missing argument " + name);
    return it->second;
  }
};

Case read_case(const std::string& dir) {
  Case c;
  c.dir = dir;
  std::ifstream args(dir + "/args.txt");
  if (!args) throw std::runtime_error("cannot open " + dir + "/args.txt");
  std::string line;
  while (std::getline(args, line)) {
    std::istringstream in(line);
    std::string kind, name;
    in >> kind >> name;
    if (kind.empty()) continue;
    if (kind == "op") {
      c.op = name;
    } else if (kind == "i") {
      std::string value;
      in >> value;
      c.ints[name] = std::stoll(value);
    } else if (kind == "u") {
      std::string value;
      in >> value;
      c.uints[name] = std::stoull(value);
    } else if (kind == "f") {
      std::string value;
      in >> value;
      c.floats[name] = std::strtod(value.c_str(), nullptr);
    } else if (kind == "b") {
      Buffer b;
      in >> b.file >> b.misalign;
      std::ifstream data(dir + "/" + b.file, std::ios::binary);
      if (!data) throw std::runtime_error("cannot open buffer file " + b.file);
      std::vector<char> bytes((std::istreambuf_iterator<char>(data)),
                              std::istreambuf_iterator<char>());
      b.bytes = bytes.size();
      // malloc's 16-byte alignment plus the requested offset; at least one byte
      // so that an empty buffer still has a distinct non-null address.
      b.base = static_cast<char*>(std::malloc(b.misalign + b.bytes + (b.bytes == 0 ? 1 : 0)));
      if (b.bytes != 0) std::memcpy(b.data(), bytes.data(), b.bytes);
      c.buffers[name] = b;
    } else {
      throw std::invalid_argument("unknown item " + kind);
    }
  }
  return c;
}

void write_back(const Case& c) {
  for (const auto& item : c.buffers) {
    std::ofstream out(c.dir + "/" + item.second.file + ".out", std::ios::binary);
    out.write(item.second.data(), static_cast<std::streamsize>(item.second.bytes));
  }
}

// Workspace of exactly `bytes` (the size the launcher's sizing function asks for).
struct Workspace {
  explicit Workspace(std::int64_t bytes) : data(bytes > 0 ? std::malloc(bytes) : nullptr) {}
  ~Workspace() { std::free(data); }
  void* data;
};

using namespace ncdp;

template <typename Real>
void run_typed(const Case& c) {
  const cudaStream_t stream = nullptr;
  if (c.op == "fill_gaussian") {
    kernels::launch_fill_gaussian<Real>(c.ptr<Real>("out"), c.i("count"), c.u("seed"),
                                        c.u("offset"), c.f("scale"), c.f("post"),
                                        c.i("accumulate") != 0, stream);
  } else if (c.op == "scale_rows") {
    kernels::launch_scale_rows<Real>(c.ptr<Real>("x"), c.ptr<double>("factors"), c.i("B"),
                                     c.i("m"), c.ptr<Real>("out"), stream);
  } else if (c.op == "row_sq_norms") {
    kernels::launch_row_sq_norms<Real>(c.ptr<Real>("grads"), c.i("B"), c.i("p"),
                                       c.ptr<double>("sq"), c.i("accumulate") != 0, stream);
  } else if (c.op == "weighted_row_sum_noise") {
    Workspace ws(kernels::weighted_row_sum_workspace_bytes(c.i("B"), c.i("p")));
    if (c.ints.count("out64") != 0 && c.i("out64") != 0) {   // the float64 sum
      kernels::launch_weighted_row_sum_noise<Real>(
          c.ptr<Real>("grads"), c.ptr<double>("factors"), c.i("B"), c.i("p"), c.f("noise_std"),
          c.f("inv_denom"), c.u("seed"), c.u("offset"), c.ptr<double>("out"), ws.data, stream);
    } else {
      kernels::launch_weighted_row_sum_noise<Real>(
          c.ptr<Real>("grads"), c.ptr<double>("factors"), c.i("B"), c.i("p"), c.f("noise_std"),
          c.f("inv_denom"), c.u("seed"), c.u("offset"), c.ptr<Real>("out"), ws.data, stream);
    }
  } else if (c.op == "clip_noise_rows") {
    Workspace ws(kernels::clip_noise_rows_layout(c.i("B"), c.i("p")).total_bytes);
    kernels::launch_clip_noise_rows<Real>(c.ptr<Real>("grads"), c.i("B"), c.i("p"),
                                          c.f("max_norm"), c.f("noise_std"), c.f("inv_denom"),
                                          c.u("seed"), c.u("offset"), c.ptr<Real>("out"),
                                          c.ptr<double>("norms"), ws.data, c.i("l2_bytes"),
                                          c.i("one_pass_blocks"), stream);
  } else if (c.op == "linear_sq_norms") {
    kernels::launch_linear_sq_norms<Real>(c.ptr<Real>("acts"), c.ptr<Real>("grads"), c.i("B"),
                                          c.i("T"), c.i("d"), c.i("K"), c.i("bias") != 0,
                                          c.ptr<double>("sq"), c.i("accumulate") != 0,
                                          c.ptr<double>("sizes"), stream);
  } else if (c.op == "norm_affine_grads") {
    const std::int64_t stats_bytes = 2 * c.i("B") * c.i("rows") * std::int64_t{sizeof(double)};
    Workspace ws(stats_bytes);
    kernels::launch_norm_affine_grads<Real>(c.ptr<Real>("x"), c.ptr<Real>("g"), c.i("B"),
                                            c.i("rows"), c.i("n"), c.i("run"), c.f("eps"),
                                            c.ptr<Real>("w"), c.ptr<Real>("b"),
                                            static_cast<double*>(ws.data), stream);
  } else if (c.op == "clipped_linear_sum") {
    const std::int64_t bytes = c.i("workspace_bytes");
    Workspace ws(bytes);
    kernels::launch_clipped_linear_sum<Real>(
        c.ptr<Real>("acts"), c.ptr<Real>("grads"), c.ptr<double>("factors"), c.i("B"), c.i("T"),
        c.i("d"), c.i("K"), c.f("noise_std"), c.f("inv_denom"), c.u("seed"), c.u("offset"),
        c.ptr<Real>("gw"), c.ptr<Real>("gb"), ws.data, bytes, stream);
  } else if (c.op == "mix_rows") {
    const kernels::GroupSampling sampling{c.ptr<std::int64_t>("group_ptr"),
                                          c.ptr<std::int64_t>("members"), c.i("G"),
                                          c.ptr<double>("select_rate"),
                                          c.ptr<double>("walk_rate")};
    kernels::launch_mix_rows<Real>(
        c.ptr<Real>("features"), c.i("n"), c.i("d"), c.ptr<std::int64_t>("labels"),
        c.ptr<Real>("soft_labels"), c.i("K"), sampling, c.i("rows"), c.u("seed"),
        c.u("offset"), c.f("inv_m"), c.f("clip_x"), c.f("noise_std_x"), c.f("noise_std_y"),
        c.ptr<Real>("out_x"), c.ptr<Real>("out_y"), c.ptr<std::int64_t>("counts"), stream);
  } else if (c.op == "hadamard_gram") {
    std::vector<kernels::GramTerm<Real>> terms;
    for (std::int64_t l = 0; l < c.i("L"); ++l) {
      const std::string s = std::to_string(l);
      terms.push_back(kernels::GramTerm<Real>{c.ptr<const Real>("f" + s),
                                              c.ptr<const Real>("f2_" + s),
                                              c.ptr<const Real>("b" + s),
                                              c.ptr<const Real>("b2_" + s), c.i("a" + s),
                                              c.i("bw" + s)});
    }
    const bool out64 = c.i("out64") != 0;
    const auto count = static_cast<std::int64_t>(terms.size());
    const std::int64_t n = c.i("n"), n2 = c.i("n2");
    const bool symmetric = c.i("symmetric") != 0;
    if constexpr (std::is_same<Real, float>::value) {
      if (c.i("acc64") == 0) {
        if (out64) {
          kernels::launch_hadamard_gram<float, float, double>(terms.data(), count, n, n2,
                                                              symmetric, c.ptr<double>("out"),
                                                              stream);
        } else {
          kernels::launch_hadamard_gram<float, float, float>(terms.data(), count, n, n2,
                                                             symmetric, c.ptr<float>("out"),
                                                             stream);
        }
        return;
      }
    }
    if (out64) {
      kernels::launch_hadamard_gram<Real, double, double>(terms.data(), count, n, n2, symmetric,
                                                          c.ptr<double>("out"), stream);
    } else {
      kernels::launch_hadamard_gram<Real, double, float>(terms.data(), count, n, n2, symmetric,
                                                         c.ptr<float>("out"), stream);
    }
  } else {
    throw std::invalid_argument("unknown op " + c.op);
  }
}

void run(const Case& c) {
  const cudaStream_t stream = nullptr;
  if (c.op == "finish_gaussian_segments") {
    // Segment s: buffer dst<s>, buffer src<s> (absent: in place), int types<s>,
    // int offset<s> (below 2^63 in these cases); empty segments are skipped,
    // as the host wrapper skips them.
    kernels::GaussianSegments table{};
    for (std::int64_t s = 0; s < c.i("S"); ++s) {
      const std::string k = std::to_string(s);
      const auto types = static_cast<kernels::GaussianSegmentTypes>(c.i("types" + k));
      const std::int64_t size = c.i("size" + k);
      if (size == 0) continue;
      void* dst = c.ptr<void>("dst" + k);
      const void* src = c.has("src" + k) ? c.ptr<const void>("src" + k) : dst;
      kernels::append_gaussian_segment(table, dst, src, size,
                                       static_cast<std::uint64_t>(c.i("offset" + k)), types);
    }
    kernels::launch_finish_gaussian_segments(table, c.u("seed"), c.f("scale"), c.f("post"),
                                             stream);
  } else if (c.op == "gram_rows_f64") {
    // Source s: float32 buffer x<s> of n samples at sample_stride<s>,
    // row_stride<s> (elements); out: [S n, T, T] float64.
    kernels::GramSources src{};
    src.count = static_cast<int>(c.i("S"));
    for (int s = 0; s < src.count; ++s) {
      const std::string k = std::to_string(s);
      src.x[s] = c.ptr<const float>("x" + k);
      src.sample_stride[s] = c.i("sample_stride" + k);
      src.row_stride[s] = c.i("row_stride" + k);
    }
    Workspace ws(kernels::gram_rows_f64_workspace_bytes(src.count, c.i("n"), c.i("T"), c.i("d")));
    kernels::launch_gram_rows_f64(src, c.i("n"), c.i("T"), c.i("d"), c.ptr<double>("out"),
                                  ws.data, stream);
  } else if (c.op == "clip_factors") {
    // Group g's rule from max_norm[g], terms[g], seq_len[g] (float64, int64,
    // int64 [groups]); its factors and norms at out[g stride], out[g stride + B].
    kernels::ClipRuleTable rules{};
    rules.count = static_cast<int>(c.i("groups"));
    rules.unit = c.f("unit");
    for (int g = 0; g < rules.count; ++g) {
      rules.max_norm[g] = c.ptr<double>("max_norm")[g];
      rules.terms[g] = c.ptr<std::int64_t>("terms")[g];
      rules.seq_len[g] = c.ptr<std::int64_t>("seq_len")[g];
    }
    double* out = c.ptr<double>("out");
    kernels::launch_clip_factors(c.ptr<double>("sq"), c.ptr<double>("spread"), c.i("B"), rules,
                                 c.floats.count("scale") ? c.f("scale") : 1.0, out,
                                 out + c.i("B"), c.i("stride"), c.ptr<double>("weights"), stream);
  } else if (c.op == "linear_norms_from_grams") {
    Workspace ws(kernels::linear_norms_from_grams_workspace_bytes(c.i("B"), c.i("layers"),
                                                                  c.i("T")));
    const bool shared_w = c.ints.count("shared_w") != 0 && c.i("shared_w") != 0;
    // w_length / v_length given: float32 Grams of those dot lengths.
    if (c.ints.count("w_length") != 0) {
      kernels::launch_linear_norms_from_grams(
          c.ptr<float>("w"), c.ptr<float>("v"), c.i("B"), c.i("layers"), c.i("T"),
          c.i("bias") != 0, shared_w, kernels::gram32_rounding(c.i("w_length"), c.i("v_length")),
          c.ptr<double>("sq"), c.i("accumulate") != 0, c.ptr<double>("spread"),
          c.ptr<double>("sizes"), ws.data, stream);
    } else {
      kernels::launch_linear_norms_from_grams(
          c.ptr<double>("w"), c.ptr<double>("v"), c.i("B"), c.i("layers"), c.i("T"),
          c.i("bias") != 0, shared_w, kernels::GramRounding{}, c.ptr<double>("sq"),
          c.i("accumulate") != 0, c.ptr<double>("spread"), c.ptr<double>("sizes"), ws.data,
          stream);
    }
  } else if (c.op == "sample_counts" || c.op == "sample_fill") {
    const kernels::GroupSampling sampling{c.ptr<std::int64_t>("group_ptr"),
                                          c.ptr<std::int64_t>("members"), c.i("G"),
                                          c.ptr<double>("select_rate"),
                                          c.ptr<double>("walk_rate")};
    if (c.op == "sample_counts") {
      kernels::launch_sample_counts(sampling, c.i("rows"), c.u("row_stride"), c.u("seed"),
                                    c.u("offset"), c.ptr<std::int64_t>("counts"), stream);
    } else {
      kernels::launch_sample_fill(sampling, c.i("rows"), c.u("row_stride"), c.u("seed"),
                                  c.u("offset"), c.ptr<std::int64_t>("indptr"),
                                  c.i("total") > 0 ? c.ptr<std::int64_t>("indices") : nullptr,
                                  stream);
    }
  } else if (c.op == "linear_sum_plan") {
    // The factored GEMM's slab plan: wanted, the workspace that holds it, and
    // what the launcher makes of exactly that workspace.
    const std::int64_t element = c.i("dtype") == 0 ? 4 : 8;
    std::int64_t* plan = c.ptr<std::int64_t>("plan");
    plan[0] = kernels::clipped_linear_sum_slabs(c.i("R"), c.i("d"), c.i("K"));
    plan[1] = kernels::clipped_linear_sum_layout_bytes(plan[0], c.i("d"), c.i("K"), element);
    plan[2] = kernels::clipped_linear_sum_slabs_within(c.i("R"), c.i("d"), c.i("K"), plan[1],
                                                       element);
  } else if (c.i("dtype") == 0) {
    run_typed<float>(c);
  } else {
    run_typed<double>(c);
  }
}

// One case: 0 when it ran and its buffers were written back.
int run_case(const std::string& dir) {
  try {
    const Case c = read_case(dir);
    run(c);
    write_back(c);
    for (const auto& item : c.buffers) std::free(item.second.base);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "emu-driver: %s\n", error.what());
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CASE_DIR | --serve (case directories on stdin)\n", argv[0]);
    return 2;
  }
  if (std::string(argv[1]) == "--serve") return ncdp_emu::serve(run_case);
  return run_case(argv[1]);
}
