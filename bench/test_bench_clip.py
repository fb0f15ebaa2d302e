"""Benchmark of op 1 (fused per-sample clipping with noise) against its peers.

1. ``test_clip_dense`` (report ``bench_clip_dense``): the dense op
   ``clip_and_noise`` on (B, p) float32 per-sample gradients vs the same
   computation in eager torch (norms, factors, einsum, torch.normal; float64 and
   float32 norms) and vs a measured read-bandwidth limit (summing the same array:
   numba's parallel sum on the CPU and torch.sum, whichever is faster).
2. ``test_clip_step`` (report ``bench_clip_step``): one DP training step of a
   linear layer (forward, backward, privatize, SGD) with ``GhostClipper`` vs the
   non-private step, Opacus hooks mode (GradSampleModule + DPOptimizer), Opacus
   ghost clipping, and our FusedDPOptimizer on Opacus's per-sample gradients
   (the per-sample peers are timed in the first round only).
"""
from __future__ import annotations

import warnings

from _common import cases, dense_rows_launch, dense_torch_eager, measure, workload_input

DENSE_SHAPES = {"full": [(512, 7680), (1024, 409600)], "quick": [(512, 7680), (256, 65536)],
                "smallest": [(8, 64)]}
STEP_SHAPES = {"full": [(512, None, 768, 10), (1024, None, 4096, 100), (256, 64, 768, 768)],
               "quick": [(512, None, 768, 10), (64, 16, 256, 256)],
               "smallest": [(8, None, 16, 3), (4, 2, 8, 8)]}
STEP_METHODS = ["nonprivate", "ncdp_ghost", "ncdp_fused", "opacus_hooks", "opacus_ghost"]
STEP_ONCE = ("ncdp_fused", "opacus_hooks", "opacus_ghost")


def CASES(size, device):
    dense = [(f"({B}, {p}) float32", dict(B=B, p=p)) for B, p in DENSE_SHAPES[size]]
    steps = [(f"({B}, {d}, {K})" if T is None else f"({B}, {T}, {d}, {K})",
              dict(B=B, T=T, d=d, K=K)) for B, T, d, K in STEP_SHAPES[size]]
    return {"test_clip_dense": cases(
                "bench_clip_dense", dense, ["ncdp", "torch_eager", "torch_eager_f32norm",
                                            "read_torch_sum"]
                + (["read_numba_sum"] if device == "cpu"
                   else ["ncdp_chunked", "ncdp_one_pass", "ncdp_one_pass_rows8",
                         "l2_torch_sum"])),
            "test_clip_step": cases("bench_clip_step", steps, STEP_METHODS, once=STEP_ONCE)}


def test_clip_dense(benchmark, case, bench_device):
    import torch
    from numba import njit, prange

    import ncdp_fast as nf
    B, p, method, device = case.params["B"], case.params["p"], case.method, bench_device
    def draw():
        x = torch.randn(B, p, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        return x.cuda() if device == "cuda" else x
    g = workload_input(("bench_clip_dense", B, p, device), draw)
    arr = g if device == "cuda" else g.numpy()
    C, sigma = 1.0, 1.0

    if method == "ncdp":
        def fn():
            return nf.clip_and_noise(arr, max_norm=C, noise_multiplier=sigma, seed=1).grad
    elif method in ("ncdp_chunked", "ncdp_one_pass", "ncdp_one_pass_rows8"):
        # The same CUDA op in its other forms, so that a GPU run decides
        # between them (bench/dense_traffic.py predicts each; the op's
        # defaults in ncdp_fast/_cuda/clip.py, DENSE_L2_BYTES and
        # DENSE_ONE_PASS_BLOCKS, are one chunk, two passes over DRAM and 4
        # launches): chunked, rows in chunks of half the device's L2 (a pass
        # from DRAM, one from L2, 3 launches a chunk); one pass (one launch
        # reads each row from DRAM once, on as many blocks as the device holds);
        # with 8-row blocks, where bench/dense_traffic.py's two readings of its
        # measured time part (a chain of round trips a row block: faster; the
        # L2's read rate: no change).
        fn = dense_rows_launch(g, C, sigma, one_pass=method != "ncdp_chunked",
                               rows=8 if method == "ncdp_one_pass_rows8" else None)
    elif method == "l2_torch_sum":
        # The L2's read rate, which the one-pass prediction assumes: a 16 MB
        # slice read 64 times by one torch.sum (stride 0: no copy), so every
        # read after the first hits the L2 (50 MB on an H100/H200).
        part = g.reshape(-1)[:min(g.numel(), 4 << 20)]
        rep = part.expand(64, part.numel())

        def fn():
            return rep.sum()
    elif method == "torch_eager":
        fn = dense_torch_eager(g, C, sigma)
    elif method == "torch_eager_f32norm":
        def fn():
            f = (C / g.norm(dim=1)).clamp(max=1.0)
            return torch.einsum("i,ij->j", f, g) + torch.normal(0.0, sigma * C, (p,),
                                                                  device=g.device)
    elif method == "read_torch_sum":
        def fn():
            return g.sum()
    elif method == "read_numba_sum":
        @njit(parallel=True, fastmath=True, cache=True)
        def psum(x):
            s = 0.0
            for i in prange(x.shape[0]):
                s += x[i]
            return s
        flat = arr.reshape(-1)

        def fn():
            return psum(flat)
    else:
        raise ValueError(method)
    nbytes = 64 * min(g.numel(), 4 << 20) * 4 if method == "l2_torch_sum" else g.numel() * 4
    measure(benchmark, case, fn, device=device, repeats=5 if B * p > 1e8 else 20, warmup=2,
            min_time=0.5, bytes=nbytes)


def _build_step(params, method, device, torch, nn):
    B, T, d, K = params["B"], params["T"], params["d"], params["K"]
    torch.manual_seed(0)
    x = torch.randn((B, d) if T is None else (B, T, d))
    y = torch.randint(0, K, (B,) if T is None else (B, T))
    model = nn.Linear(d, K)
    if device == "cuda":
        x, y, model = x.cuda(), y.cuda(), model.cuda()
    E, C, sigma = float(B), 1.0, 1.0
    criterion = nn.CrossEntropyLoss()

    def loss_of(out):
        return criterion(out.reshape(-1, K), y.reshape(-1))

    if method == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_of(model(x)).backward()
            opt.step()
    elif method == "ncdp_ghost":
        from ncdp_fast.torch import GhostClipper
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=sigma,
                               expected_batch_size=E, seed=1)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_of(model(x)).backward()
            clipper.privatize_()
            opt.step()
    elif method in ("ncdp_fused", "opacus_hooks"):
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        from ncdp_fast.torch import FusedDPOptimizer
        gsm = GradSampleModule(model)
        base = torch.optim.SGD(gsm.parameters(), lr=0.01)
        if method == "ncdp_fused":
            opt = FusedDPOptimizer(base, noise_multiplier=sigma, max_grad_norm=C,
                                   expected_batch_size=E, seed=1)
        else:
            opt = DPOptimizer(base, noise_multiplier=sigma, max_grad_norm=C,
                              expected_batch_size=E)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_of(gsm(x)).backward()
            opt.step()
    elif method == "opacus_ghost":
        from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import \
            GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=C,
                                                   use_ghost_clipping=True)
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.01),
                                              noise_multiplier=sigma, max_grad_norm=C,
                                              expected_batch_size=E)
        crit = nn.CrossEntropyLoss(reduction="mean")
        dploss = DPLossFastGradientClipping(gsm, opt, crit, "mean")

        def step():
            opt.zero_grad(set_to_none=True)
            out = gsm(x)
            if T is None:
                loss = dploss(out, y)
            else:
                loss = dploss(out.reshape(-1, K), y.reshape(-1), shape=(B, T))
            loss.backward()
            opt.step()
    else:
        raise ValueError(method)
    return step


def test_clip_step(benchmark, case, bench_device):
    import pytest
    import torch
    from torch import nn
    if case.method in ("ncdp_fused", "opacus_hooks", "opacus_ghost"):
        pytest.importorskip("opacus")
    warnings.filterwarnings("ignore")
    step = _build_step(case.params, case.method, bench_device, torch, nn)
    measure(benchmark, case, step, device=bench_device,
            repeats=3 if case.method in STEP_ONCE else 10, warmup=1, min_time=1.0)
