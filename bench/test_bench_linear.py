"""Benchmark of a linear layer's parts of a private step (op 1, factored), at
the layer shapes of BERT-base and GPT-2's head.

1. ``test_linear_norms`` (report ``bench_linear_norms``): the per-sample
   squared norms of a linear layer's gradients (the Gram form of ghost
   clipping), float64: the package's route for the device (numba on the CPU; on
   a GPU the float64 Gram kernel, issue 36) vs the hand-written CUDA kernel it
   replaced and the float64 copies' route (GPU only), the device route on CPU
   tensors, and Opacus's float32 einsum Gram; on a GPU also 12 layers of the
   shape in one grouped call, as the clip op forms them
   (``linear_sq_norms_group``), reported per layer.
2. ``test_linear_sum`` (report ``bench_linear_sum``): the clipped sum plus noise
   of the same layers (sum_i f_i g_i^T a_i, noise, / B): the package's route
   (numba and BLAS on the CPU; on a GPU one GEMM in the data dtype, issue 36)
   as a step runs it when the norms rule the rebalancing scan out, and with
   the scan ("ncdp_balanced"); the non-private weight-gradient GEMM of the same
   layer (what the private sum stands in for: its floor); the hand-written
   CUDA kernel (GPU only), the device route on the CPU, and Opacus's float32
   einsum plus torch.normal.

Diagnostics of a step's parts, not rows of issue 36's goals: ``make
gpu-check`` runs them after the goal rows and Nsight Compute's counters
(test_bench_clip.py held them until 2026-12-01, ahead of the counters, which
then never had time).
"""
from __future__ import annotations

import contextlib

from _common import cases, measure, workload_input

# (B, T, d, K): BERT-base's attention/output, intermediate and output-dense
# layers (B 32, T 128), GPT-2's tied head (B 16, V 50257).
NORM_SHAPES = {"full": [(32, 128, 768, 768), (32, 128, 768, 3072), (32, 128, 3072, 768),
                        (16, 128, 768, 50257)],
               "quick": [(8, 32, 64, 64), (8, 64, 256, 1024)], "smallest": [(2, 3, 4, 5)]}
SUM_METHODS = ["ncdp", "ncdp_balanced", "torch_mm_f32", "torch_einsum_f32"]
GROUP = 12      # layers of one shape a grouped-norms call takes (BERT-base: 12 of each)


def CASES(size, device):
    layers = [(f"({B}, {T}, {d}, {K})", dict(B=B, T=T, d=d, K=K))
              for B, T, d, K in NORM_SHAPES[size]]
    layer_methods = ["ncdp", "torch_einsum_f32"] + (["native_kernel"] if device == "cuda"
                                                    else ["gemm_f64"])
    # The clip op's grouped norms and the float64 copies' route the Gram
    # kernel replaced (GPU only: on the CPU the group is a loop, and the
    # emulated device's kernel times say nothing)
    norm_methods = layer_methods + ([f"ncdp_group{GROUP}", "ncdp_copies"] if device == "cuda"
                                    else [])
    sum_methods = SUM_METHODS + (["native_kernel"] if device == "cuda" else ["device_route"])
    return {"test_linear_norms": cases("bench_linear_norms", layers, norm_methods),
            "test_linear_sum": cases("bench_linear_sum", layers, sum_methods)}


def _layer_data(case, device):
    """((B, T, d, K), activations (B, T, d), output gradients (B, T, K), the
    generator, as drawing them left it), float32 on the bench device; drawn
    once a workload (bench/_common.workload_input)."""
    import torch
    B, T, d, K = (case.params[k] for k in ("B", "T", "d", "K"))

    def draw():
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(B, T, d, generator=gen)
        g = torch.randn(B, T, K, generator=gen) * 1e-3
        if device == "cuda":
            a, g = a.cuda(), g.cuda()
        return a, g, gen.get_state()
    a, g, state = workload_input(("bench_linear", B, T, d, K, device), draw)
    gen = torch.Generator()
    gen.set_state(state)
    return (B, T, d, K), a, g, gen


def test_linear_sum(benchmark, case, bench_device):
    import numpy as np
    import torch

    import ncdp_fast._backend as be
    from ncdp_fast import _native
    from ncdp_fast._cuda import clip as device_clip
    from ncdp_fast._cuda._common import (dtype_code, ieee_float32_matmul, opt_ptr, ptr, stream,
                                         workspace)
    from ncdp_fast._numba import clip as numba_clip
    (B, T, d, K), a, g, gen = _layer_data(case, bench_device)
    method, device = case.method, bench_device
    f = torch.rand(B, generator=gen, dtype=torch.float64).to(a.device)
    gw = torch.empty(K, d, device=a.device)
    gb = torch.empty(K, device=a.device)
    sigma, inv = 1.0, 1.0 / max(B, 1)
    balance = method == "ncdp_balanced"
    if method in ("ncdp", "ncdp_balanced") and device == "cpu":
        an, gn, fn_, gwn, gbn = a.numpy(), g.numpy(), f.numpy(), gw.numpy(), gb.numpy()
        io = be.select("clip", a=an).io

        def fn():
            numba_clip.clipped_linear_sum(an, gn, fn_, sigma, inv, np.uint64(1), np.uint64(0),
                                          gwn, gbn, matmul=io.matmul, balance=balance)
            return gwn
    elif method in ("ncdp", "ncdp_balanced", "device_route"):
        # On a GPU as the clip op runs it; "device_route": the same code on CPU
        # tensors (the emulated device), for the CPU table only.
        ctx = be.emulated_cuda if device == "cpu" else contextlib.nullcontext

        def fn():
            # As a step's op calls it: with the scan off, weights in range
            # (f uniform in [0, 1)), so an unscaled g's bias is the GEMV (a
            # new dict a call: the weights repeated each time, as a step does once).
            with ctx():
                device_clip.clipped_linear_sum(a, g, f, sigma, inv, 1, 0, gw, gb,
                                               balance=balance,
                                               bias_gemv=None if balance else {})
            return gw
    elif method == "torch_mm_f32":
        # The non-private backward's weight gradient of the same layer, IEEE
        # float32 (TF32 off, as the private sum runs): the floor of the sum.
        def fn():
            with ieee_float32_matmul():
                torch.matmul(g.reshape(-1, K).T, a.reshape(-1, d), out=gw)
                torch.sum(g.reshape(-1, K), 0, out=gb)
            return gw
    elif method == "native_kernel":
        native = _native.for_array(a)
        nbytes = native.clipped_linear_sum_workspace_bytes(B, T, d, K, dtype_code(a))
        ws, ws_ptr = workspace(a, nbytes)

        def fn():
            native.launch_clipped_linear_sum(ptr(a), ptr(g), ptr(f), B, T, d, K, dtype_code(a),
                                             sigma, inv, 1, 0, ptr(gw), opt_ptr(gb), stream(a),
                                             ws_ptr, nbytes)
            return gw
    else:           # Opacus's clipped sum: float32 einsum of the scaled output gradients
        def fn():
            gs = g * f.to(g.dtype).view(-1, 1, 1)
            w = torch.einsum("btk,btd->kd", gs, a)
            return (w + torch.normal(0.0, sigma, w.shape, device=w.device)) * inv
    measure(benchmark, case, fn, device=device, repeats=5, min_time=0.2,
            flops=2.0 * B * T * d * K, bytes=4 * B * T * (d + K))


def norm_flops(B, T, d, K) -> float:
    """Multiply-adds x 2 of the Gram route (A A^T, G G^T, their product) or of
    the direct one (G^T A and its squares), as the route rule picks."""
    if 2 * T * T <= K * d:
        return 2.0 * B * T * T * (d + K) + 2.0 * B * T * T
    return 2.0 * B * T * d * K + 2.0 * B * d * K


def test_linear_norms(benchmark, case, bench_device):
    import numpy as np
    import torch

    import ncdp_fast._backend as be
    from ncdp_fast import _native
    from ncdp_fast._cuda import clip as device_clip
    from ncdp_fast._cuda._common import dtype_code, ptr, stream
    from ncdp_fast._numba import clip as numba_clip
    (B, T, d, K), a, g, _ = _layer_data(case, bench_device)
    method, device = case.method, bench_device
    sq = torch.zeros(B, dtype=torch.float64, device=a.device)
    # What the clip op computes: the norms and, from the same pass, the spread
    # of a sequence block's rounding (T > 1) and the operands' squared norms
    # that decide the clipped sum's rebalancing scan.
    spread = torch.zeros(B, dtype=torch.float64, device=a.device) if T > 1 else None
    sizes = torch.empty(B, 2, dtype=torch.float64, device=a.device)
    if method == "ncdp" and device == "cpu":
        an, gn, sqn, szn = a.numpy(), g.numpy(), sq.numpy(), sizes.numpy()
        spn = None if spread is None else spread.numpy()

        def fn():
            numba_clip.linear_sq_norms(an, gn, True, sqn, False, spn, szn)
            return sqn
    elif method in ("ncdp", "gemm_f64"):
        # "gemm_f64": the device route on CPU tensors (the emulated device, whose
        # kernels of ours run on the CPU), for the CPU table only.
        ctx = be.emulated_cuda if device == "cpu" else contextlib.nullcontext

        def fn():
            with ctx():
                device_clip.linear_sq_norms(a, g, True, sq, False, spread, sizes)
            return sq
    elif method == "ncdp_copies":
        from ncdp_fast._cuda import gram

        def fn():
            with gram.copies_route():
                device_clip.linear_sq_norms(a, g, True, sq, False, spread, sizes)
            return sq
    elif method == f"ncdp_group{GROUP}":
        # GROUP layers of this shape (the same arrays) as the clip op forms
        # them; the report divides the time by GROUP.  Not checked against the
        # one-layer norms below: it sums GROUP of them.
        group_sizes = torch.empty(GROUP, B, 2, dtype=torch.float64, device=a.device)

        def fn():
            device_clip.linear_sq_norms_group([a] * GROUP, [g] * GROUP, True, sq, spread,
                                              group_sizes)
            return sq
    elif method == "native_kernel":
        native = _native.for_array(a)

        def fn():
            native.launch_linear_sq_norms(ptr(a), ptr(g), B, T, d, K, dtype_code(a), True,
                                          ptr(sq), False, stream(a))
            return sq
    else:           # Opacus's ghost norm: float32 Grams by einsum (TF32 as torch is set)
        def fn():
            ga = torch.einsum("bti,bsi->bts", a, a) + 1.0
            gg = torch.einsum("bti,bsi->bts", g, g)
            return (ga * gg).sum(dim=(1, 2))
    out = measure(benchmark, case, fn, device=device, repeats=5, min_time=0.2,
                  flops=norm_flops(B, T, d, K), bytes=4 * B * T * (d + K))
    if not benchmark.disabled and method in ("ncdp", "gemm_f64", "native_kernel", "ncdp_copies"):
        ref = (torch.einsum("bti,bsi->bts", a.double(), a.double()) + 1.0) * \
            torch.einsum("bti,bsi->bts", g.double(), g.double())
        expected = ref.sum(dim=(1, 2)).cpu().numpy()
        got = out.cpu().numpy() if hasattr(out, "cpu") else np.asarray(out)
        assert np.allclose(got, expected, rtol=1e-9, atol=0), method
