"""Per-sample gradients of normalisation layers' affine parameters (report
``bench_norm_affine``; issue 36): the LayerNorm of BERT-base and GPT-2 and
EfficientNet-Lite0's GroupNorms at the benchmarks' shapes.

Methods, interleaved in one process (bench/README.md):

* ``ncdp``: ``ncdp_fast._norm_affine.norm_affine_grads``, which the LayerNorm,
  GroupNorm and InstanceNorm rules call on a device: each row's statistics,
  then the per-sample sums, without forming xhat (two kernels; on the CPU its
  numba twin, which the CPU rules do not use).
* ``torch``: the rules' torch composition (what they run on the CPU and ran on
  a device before 2026-11-29): the normalisation again without affine, the
  product with the output gradient and two sums over the positions (four
  kernels on a GPU, xhat and the product written and read in full).

Each row is one layer: (B, rows, n, run) in the kernel's terms (run 0: a
LayerNorm, rows = positions, n = features; run > 0: a GroupNorm, rows =
groups, n = a group's values, run = positions), float32.
"""
from __future__ import annotations

from _common import cases, measure

# BERT-base's LayerNorm (B 32, T 128, d 768), GPT-2's (B 16), and
# EfficientNet-Lite0's GroupNorm(32, C) at 96 x 96, B 64: its stem's 32
# channels at 48 x 48 (one channel a group) and its last 1152 channels at
# 3 x 3 (36 a group).
LAYERS = {"full": [(32, 128, 768, 0), (16, 128, 768, 0), (64, 32, 2304, 2304),
                   (64, 32, 324, 9)],
          "quick": [(8, 64, 256, 0), (16, 32, 576, 576)],
          "smallest": [(2, 3, 8, 0), (2, 2, 12, 4)]}
METHODS = ["ncdp", "torch"]


def layer_label(B, rows, n, run) -> str:
    kind = "LayerNorm" if run == 0 else "GroupNorm"
    return f"{kind} ({B}, {rows}, {n}, {run})"


def CASES(size, device):
    work = [(layer_label(*s), dict(B=s[0], rows=s[1], n=s[2], run=s[3])) for s in LAYERS[size]]
    return {"test_norm_affine": cases("bench_norm_affine", work, METHODS)}


def test_norm_affine(benchmark, case, bench_device):
    import numpy as np
    import torch

    from ncdp_fast import reference as R
    from ncdp_fast._norm_affine import norm_affine_grads
    B, rows, n, run = (case.params[k] for k in ("B", "rows", "n", "run"))
    device = "cuda" if bench_device == "cuda" else "cpu"
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(B, rows, n, generator=gen) * 2 + 1).to(device)
    g = (torch.randn(B, rows, n, generator=gen) * 1e-3).to(device)
    eps = 1e-5
    if case.method == "ncdp":
        xa, ga = (x, g) if device == "cuda" else (x.numpy(), g.numpy())

        def fn():
            return norm_affine_grads(xa, ga, run=run, eps=eps)
    else:
        F = torch.nn.functional
        if run == 0:
            def fn():
                xhat = F.layer_norm(x, (n,), None, None, eps)
                return torch.mul(g, xhat).sum(1), g.sum(1)
        else:
            C, P = rows * (n // run), run
            xc, gc = x.reshape(B, C, P), g.reshape(B, C, P)

            def fn():
                xhat = F.group_norm(xc, rows, None, None, eps)
                return torch.mul(gc, xhat).sum(2), gc.sum(2)
    out = measure(benchmark, case, fn, device=bench_device, repeats=5, min_time=0.1,
                  bytes=4 * 2 * B * rows * n)
    if not benchmark.disabled:
        rw, rb = R.norm_affine_grads(x.double().cpu().numpy(), g.double().cpu().numpy(), run,
                                     eps)
        for got, want in zip(out, (rw, rb)):
            got = np.asarray(got.cpu() if hasattr(got, "cpu") else got, dtype=np.float64)
            # A check against a wrong formula, not a rounding bound (the tests
            # hold that: tests/test_gpu.py, tests/test_clip.py): torch sums in
            # float32, up to 2304 products a value here.
            assert np.allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max()), \
                case.method
