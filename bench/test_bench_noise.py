"""Benchmark of the Gaussian noise every private step adds (report ``bench_noise``).

A private step draws one normal per trainable weight (35 M on the BERT-shaped
step of bench_hf, 54 M on the GPT-2-shaped one), so the generator's rate is
part of every step's cost.  Workloads: n normals, float32.

Methods, interleaved in one process:

* ``ncdp_add``: what the drop-ins do: ``n`` normals of the Philox stream
  (0.5 Philox blocks a normal, radius uniform down to 2^-129, Box--Muller
  in float64, rounded once) added in
  place to an existing float32 array (``ncdp_fast._backend`` kernel
  ``add_gaussian``, accumulate, scale 1).
* ``ncdp_gaussian``: the public ``ncdp_fast.gaussian(n, like=...)`` into a
  freshly allocated array (first touch of new memory included).
* ``torch_randn``: ``torch.randn(n)``, the peer a user would write to noise a
  gradient (torch's CPU generator: mt19937, float32 Box--Muller), fresh array.
* ``torch_normal_``: ``x.normal_()`` in place (overwrites; no accumulation).
* ``numpy_pcg64``: NumPy's ``Generator(PCG64).standard_normal(out=x)``
  (ziggurat, float32), in place; CPU only.
* ``write_limit``: ``x.add_(1.0)`` on the same array, one read and one write
  of every value: the memory traffic ``ncdp_add`` needs at least, so the
  fraction ``write_limit time / ncdp_add time`` says how far from
  memory-bound it runs.

``bytes`` = 8 n (one float32 read and one write) gives ``ncdp_add``'s GB/s.
"""
from __future__ import annotations

from _common import cases, measure

SHAPES = {"full": [1 << 16, 1 << 20, 1 << 24], "quick": [1 << 16, 1 << 20],
          "smallest": [1000]}
METHODS = ["ncdp_add", "ncdp_gaussian", "torch_randn", "torch_normal_", "numpy_pcg64",
           "write_limit"]


def CASES(size, device):
    methods = [m for m in METHODS if device == "cpu" or m != "numpy_pcg64"]
    work = [(f"n={n} float32", dict(n=n)) for n in SHAPES[size]]
    return {"test_noise": cases("bench_noise", work, methods)}


def test_noise(benchmark, case, bench_device):
    import numpy as np
    import torch

    import ncdp_fast as nf
    from ncdp_fast import _backend
    n, method = case.params["n"], case.method
    x = torch.zeros(n, dtype=torch.float32, device=bench_device)
    offset = [0]

    def next_offset():
        # A new range each call: the benchmark must not replay a stream range
        # (the package warns on reuse, and a real step never does).
        offset[0] += n
        return offset[0]

    if method == "ncdp_add":
        be = _backend.select("rng", like=x)
        out = be.io.to_kernel(x)

        def fn():
            be.kernels.add_gaussian(out, np.uint64(1), np.uint64(next_offset()), 1.0, True, 1.0)
    elif method == "ncdp_gaussian":
        def fn():
            return nf.gaussian(n, seed=2, offset=next_offset(), like=x)
    elif method == "torch_randn":
        def fn():
            return torch.randn(n, device=bench_device)
    elif method == "torch_normal_":
        def fn():
            x.normal_()
    elif method == "numpy_pcg64":
        gen = np.random.Generator(np.random.PCG64(0))
        arr = x.numpy()

        def fn():
            gen.standard_normal(out=arr, dtype=np.float32)
    elif method == "write_limit":
        def fn():
            x.add_(1.0)
    else:
        raise ValueError(method)
    measure(benchmark, case, fn, device=bench_device, repeats=5 if n >= 1 << 24 else 20,
            warmup=1, min_time=0.5, bytes=8 * n, normals=n)
