// The Python face of the native core: m.def lines only. Every kernel takes raw
// device pointers (as integers from __cuda_array_interface__), sizes, scalars
// and the caller's stream; validation and allocation live in Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/capabilities.h"
#ifdef NCDP_WITH_CUDA
#include "clip/clip_noise.h"
#include "common/cuda_check.h"
#include "common/device_info.h"
#include "common/launcher_probe.h"
#include "mix/mix.h"
#include "ntk/hadamard_gram.h"
#include "rng/gaussian.h"
#endif

namespace py = pybind11;

// _C; the emulated device's build (CMakeLists.txt) names it _C_emu.
#ifndef NCDP_MODULE_NAME
#define NCDP_MODULE_NAME _C
#endif

PYBIND11_MODULE(NCDP_MODULE_NAME, m) {
  m.doc() = "ncdp_fast native kernels";
  m.def("cuda_compiled", &ncdp::cuda_compiled, "Whether the CUDA kernels were compiled in.");
  m.def("cuda_archs", &ncdp::cuda_archs, "CMAKE_CUDA_ARCHITECTURES of this build ('' without CUDA).");
  m.def("build_note", &ncdp::build_note, "Why the CUDA kernels are missing ('' with CUDA).");
#ifdef NCDP_WITH_CUDA
  m.def("cuda_device_count", &ncdp::cuda_device_count, "Visible CUDA devices (0 without driver).");
  m.def("cuda_device_name", &ncdp::cuda_device_name, py::arg("device"));
  m.def("cuda_versions", &ncdp::cuda_versions, "(runtime, driver) versions.");
  m.def("cuda_l2_cache_bytes", &ncdp::l2_cache_bytes, "L2 bytes of a device (0 if unknown).",
        py::arg("device"));
  m.def("cuda_stream_capturing", &ncdp::stream_capturing,
        "Whether the stream (a handle) is capturing a CUDA graph.", py::arg("stream"));
  m.def("launch_fill_gaussian", &ncdp::launch_fill_gaussian,
        "out[j] = post * ([out[j] +] scale * normal(seed, offset + j)), j < count.",
        py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("seed"), py::arg("offset"),
        py::arg("scale"), py::arg("accumulate"), py::arg("post"), py::arg("stream"));
  m.def("launch_finish_gaussian_segments", &ncdp::launch_finish_gaussian_segments,
        "dst[s][j] = post * (src[s][j] + scale * normal(seed, offset[s] + j)), j < count[s], "
        "for every segment s, in one launch a 48 segments.",
        py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("offset"),
        py::arg("src_dtype"), py::arg("dst_dtype"), py::arg("seed"), py::arg("scale"),
        py::arg("post"), py::arg("stream"));
  m.def("launch_row_sq_norms", &ncdp::launch_row_sq_norms,
        "sq[i] (=, or +=) sum_j g[i, j]^2 in float64; g [B, p], sq [B] float64.", py::arg("g"),
        py::arg("B"), py::arg("p"), py::arg("dtype"), py::arg("sq"), py::arg("accumulate"),
        py::arg("stream"));
  m.def("launch_scale_rows", &ncdp::launch_scale_rows,
        "out[i, j] = x[i, j] * factors[i] in float64, rounded once; x, out [B, m], factors [B] "
        "float64.", py::arg("x"), py::arg("B"), py::arg("m"), py::arg("dtype"),
        py::arg("factors"), py::arg("out"), py::arg("stream"));
  m.def("linear_norms_from_grams_workspace_bytes",
        &ncdp::linear_norms_from_grams_workspace_bytes,
        "Workspace bytes of launch_linear_norms_from_grams.", py::arg("B"), py::arg("layers"),
        py::arg("T"));
  m.def("launch_linear_norms_from_grams", &ncdp::launch_linear_norms_from_grams,
        "sq[b] (=, or +=) sum_l sum (W_i + bias) o V_i, spread[b] += sum_l sum_t "
        "sqrt(V_i[t,t]) (sqrt(W_i[t,t]) + bias), sizes[i] = (tr W_i, tr V_i); i = l B + b, "
        "W_i = W[b] with shared_w; float64 sums; float32 Grams (gram_dtype 0, dot lengths "
        "w_length, v_length) give upper bounds of the exact norms and spreads.",
        py::arg("w"), py::arg("v"), py::arg("B"), py::arg("layers"), py::arg("T"),
        py::arg("bias"), py::arg("shared_w"), py::arg("gram_dtype"), py::arg("w_length"),
        py::arg("v_length"), py::arg("sq"), py::arg("accumulate"),
        py::arg("spread"), py::arg("sizes"), py::arg("workspace"), py::arg("workspace_bytes"),
        py::arg("stream"));
  m.def("launch_clip_factor_groups", &ncdp::launch_clip_factor_groups,
        "For group g, sample i: out[g stride + B + i] = sqrt(scale^2 sq[g, i]), out[g stride + "
        "i] its factor by the rounding-aware rule of reference.clip_factors with group g's "
        "(max_norm, terms, seq_len) on scale^2 sq and scale spread (float64 [groups, B]; spread "
        "0 for E = 0); weights = factors scale where given (0: not formed).",
        py::arg("sq"), py::arg("spread"), py::arg("groups"), py::arg("B"), py::arg("max_norm"),
        py::arg("terms"), py::arg("seq_len"), py::arg("unit"), py::arg("out"),
        py::arg("stride"), py::arg("stream"), py::arg("scale") = 1.0, py::arg("weights") = 0);
  m.def("weighted_row_sum_workspace_bytes", &ncdp::weighted_row_sum_workspace_bytes,
        "Workspace bytes of launch_weighted_row_sum_noise.", py::arg("B"), py::arg("p"),
        py::arg("dtype"));
  m.def("launch_weighted_row_sum_noise", &ncdp::launch_weighted_row_sum_noise,
        "out = inv_denom * (sum_i factors[i] g[i] + noise_std * normals(seed, offset)); "
        "deterministic.",
        py::arg("g"), py::arg("B"), py::arg("p"), py::arg("dtype"), py::arg("factors"),
        py::arg("noise_std"), py::arg("inv_denom"), py::arg("seed"), py::arg("offset"),
        py::arg("out"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"),
        py::arg("out_dtype") = -1);
  m.def("clip_noise_rows_workspace_bytes", &ncdp::clip_noise_rows_workspace_bytes,
        "Workspace bytes of launch_clip_noise_rows.", py::arg("B"), py::arg("p"),
        py::arg("dtype"));
  m.def("clip_noise_rows_one_pass_plan", &ncdp::clip_noise_rows_one_pass_plan,
        "The one-pass form's split: (blocks, columns, rows, row_blocks, segments, items, "
        "flags_offset).",
        py::arg("B"), py::arg("p"), py::arg("dtype"), py::arg("l2_bytes") = -1,
        py::arg("one_pass_blocks") = -1);
  m.def("launch_clip_noise_rows", &ncdp::launch_clip_noise_rows,
        "Fused per-sample clipping with noise: norms [B] float64, out [p].", py::arg("g"),
        py::arg("B"), py::arg("p"), py::arg("dtype"), py::arg("max_norm"), py::arg("noise_std"),
        py::arg("inv_denom"), py::arg("seed"), py::arg("offset"), py::arg("out"),
        py::arg("norms"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"),
        py::arg("l2_bytes") = -1, py::arg("one_pass_blocks") = 0);
  m.def("launch_linear_sq_norms", &ncdp::launch_linear_sq_norms,
        "sq[i] (=, or +=) squared norm of the per-sample linear-layer gradient (+ bias); "
        "at T = 1 also sizes[i] = (||a_i||^2, ||g_i||^2) where sizes is given ([B, 2] float64).",
        py::arg("a"), py::arg("g"), py::arg("B"), py::arg("T"), py::arg("d"), py::arg("K"),
        py::arg("dtype"), py::arg("bias"), py::arg("sq"), py::arg("accumulate"),
        py::arg("stream"), py::arg("sizes") = 0);
  m.def("norm_affine_workspace_bytes", &ncdp::norm_affine_workspace_bytes,
        "Workspace bytes of launch_norm_affine_grads.", py::arg("B"), py::arg("rows"));
  m.def("launch_norm_affine_grads", &ncdp::launch_norm_affine_grads,
        "Per-sample affine gradients of a normalisation layer: w[i, c] = sum g xhat, "
        "b[i, c] = sum g over channel c (run 0: the row's columns, summed over rows; run > 0: "
        "runs of `run` values), rows normalised in float64; w or b 0: not formed.",
        py::arg("x"), py::arg("g"), py::arg("B"), py::arg("rows"), py::arg("n"), py::arg("run"),
        py::arg("dtype"), py::arg("eps"), py::arg("w"), py::arg("b"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("stream"));
  m.def("gram_rows_f64_workspace_bytes", &ncdp::gram_rows_f64_workspace_bytes,
        "Workspace bytes of launch_gram_rows_f64 (its k-ranges' partial Grams; 0: one range).",
        py::arg("count"), py::arg("n"), py::arg("T"), py::arg("d"));
  m.def("launch_gram_rows_f64", &ncdp::launch_gram_rows_f64,
        "out[s n + i] = X X^T in float64 of sample i of float32 source s (T rows of d values "
        "at the given element strides), on the FP64 tensor cores; up to 8 sources.",
        py::arg("x"), py::arg("sample_strides"), py::arg("row_strides"), py::arg("n"),
        py::arg("T"), py::arg("d"), py::arg("out"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("stream"));
  m.def("clipped_linear_sum_workspace_bytes", &ncdp::clipped_linear_sum_workspace_bytes,
        "Workspace bytes that let launch_clipped_linear_sum split the B*T reduction.",
        py::arg("B"), py::arg("T"), py::arg("d"), py::arg("K"), py::arg("dtype"));
  m.def("launch_clipped_linear_sum", &ncdp::launch_clipped_linear_sum,
        "gw = inv_denom * ((factors (.) g)^T a + noise_std * xi); gb likewise (gb = 0: no bias).",
        py::arg("a"), py::arg("g"), py::arg("factors"), py::arg("B"), py::arg("T"), py::arg("d"),
        py::arg("K"), py::arg("dtype"), py::arg("noise_std"), py::arg("inv_denom"),
        py::arg("seed"), py::arg("offset"), py::arg("gw"), py::arg("gb"), py::arg("stream"),
        py::arg("workspace") = 0, py::arg("workspace_bytes") = 0);
  m.def("launch_sample_counts", &ncdp::launch_sample_counts,
        "counts[r] = number of ids row r selects (sub-stream 1 + offset + r * row_stride).",
        py::arg("group_ptr"), py::arg("members"), py::arg("G"), py::arg("select_rate"),
        py::arg("walk_rate"), py::arg("rows"), py::arg("row_stride"), py::arg("seed"),
        py::arg("offset"), py::arg("counts"), py::arg("stream"));
  m.def("launch_sample_fill", &ncdp::launch_sample_fill,
        "indices[indptr[r]:indptr[r+1]] = the ids row r selects, in sampler order.",
        py::arg("group_ptr"), py::arg("members"), py::arg("G"), py::arg("select_rate"),
        py::arg("walk_rate"), py::arg("rows"), py::arg("row_stride"), py::arg("seed"),
        py::arg("offset"), py::arg("indptr"), py::arg("indices"), py::arg("stream"));
  m.def("launch_mix_rows", &ncdp::launch_mix_rows,
        "Subsample-and-average rows: out_x [rows, d], out_y [rows, K], counts [rows] int64.",
        py::arg("features"), py::arg("dtype"), py::arg("n"), py::arg("d"), py::arg("labels"),
        py::arg("soft_labels"), py::arg("K"), py::arg("group_ptr"), py::arg("members"),
        py::arg("G"), py::arg("select_rate"), py::arg("walk_rate"), py::arg("rows"),
        py::arg("seed"), py::arg("offset"), py::arg("inv_m"), py::arg("clip_x"),
        py::arg("noise_std_x"), py::arg("noise_std_y"), py::arg("out_x"), py::arg("out_y"),
        py::arg("counts"), py::arg("stream"));
  m.def("launch_hadamard_gram", &ncdp::launch_hadamard_gram,
        "K [n, n2] (out_dtype) = sum_l (f[l] f2[l]^T) o (b[l] b2[l]^T); constant_one[l]: "
        "f[l] f2[l]^T = 1 (a bias term; f[l] = f2[l] = a[l] = 0); symmetric: one triangle, "
        "mirrored.",
        py::arg("f"), py::arg("a"), py::arg("constant_one"), py::arg("b_ptrs"), py::arg("b"),
        py::arg("f2"), py::arg("b2_ptrs"), py::arg("n"), py::arg("n2"), py::arg("dtype"),
        py::arg("symmetric"), py::arg("accumulate_f64"), py::arg("out"), py::arg("out_dtype"),
        py::arg("stream"));
  m.def("typed_launcher_names", &ncdp::typed_launcher_names,
        "Names of the typed launchers probe_typed_launcher covers (one per instantiation).");
  m.def("probe_typed_launcher", &ncdp::probe_typed_launcher,
        "Diagnostic: runs one typed launcher on tiny sizes, stream 0 (zeroed buffers with a "
        "device, null pointers without); RuntimeError naming the CUDA error if a launch fails.",
        py::arg("name"));
#endif
}
