"""Op 1 of DESIGN.md: fused per-sample clipping with noise (dense and factored).

Layer 2 code: validates, converts arrays, picks the backend once per call,
allocates outputs and calls the kernels of the chosen backend.  This module
holds the dense op; the factored ops live in ``_clip_layers.py``, the result
classes and the accounting in ``_clip_results.py``, the shared argument checks
in ``_clip_checks.py``.  Every public name of the family is importable from
here (the package and ``ncdp_fast.torch`` import them from this module).
"""
from __future__ import annotations

import numpy as np

from . import _arrays, _backend, _stream
from ._clip_checks import _check_common, _check_noise_range
from ._clip_layers import clip_and_noise_layers, clip_and_noise_linear
from ._clip_results import (ClipResult, GhostBlock, LayersClipResult, LinearClipResult, _accounting,
                            step_buffer)

__all__ = ["ClipResult", "LinearClipResult", "LayersClipResult", "GhostBlock", "clip_and_noise",
           "clip_and_noise_linear", "clip_and_noise_layers"]

_F64 = np.dtype(np.float64)


# ------------------------------------------------------------------- dense op

def clip_and_noise(grads, *, max_norm, noise_multiplier, seed=None, offset=None, reduction="sum",
                   expected_batch_size=None, nan_policy="raise") -> ClipResult:
    """Clip each per-sample gradient to norm ``max_norm``, sum, add Gaussian noise.

    ``grad = (sum_i g_i * min(1, C/||g_i||) + sigma*C*xi) / D`` (DESIGN.md kernel 1;
    the Gaussian mechanism of DP-SGD, Abadi et al. 2016, and the noisy step of
    NoisyGD, eq. 2.1 of 000_82fe6240ae4b04be.txt).

    Args:
        grads: (B, p) float32/float64 per-sample gradients; NumPy, torch (CPU or
            CUDA) or CuPy.  B = 0 is valid and yields pure noise.  A
            non-contiguous array is copied once (cost B*p).
        max_norm: C > 0, the per-sample L2 sensitivity bound.
        noise_multiplier: sigma >= 0; the noise standard deviation is sigma*C.
        seed: 64-bit Philox key, a :class:`NoiseStream`, or None for a key from
            the OS (returned in the result).
        offset: first draw to use; None takes the next unused range of the
            seed's stream in this process (``ncdp_fast._stream``), so repeated
            calls never reuse noise.  The call consumes ``p`` draws.
        reduction: "sum", or "mean" to divide by ``expected_batch_size`` -- never by
            the realized B, which would reveal it without accounting.
        nan_policy: "raise" (ValueError naming the rows) or "zero" (drop them;
            counted in ``num_nonfinite``).

    Returns a :class:`ClipResult` whose ``grad`` (p,) has the input's dtype and
    array type; ``norms`` are float64.  Norms accumulate in float64; the
    weighted sum accumulates in the input dtype over at most 8 slabs combined in
    float64 on the CPU (see ``_numba.clip``), in float64 throughout on CUDA
    (``csrc/clip/clip_noise.cu``).  The factor is ``reference.clip_factors``:
    ``min(1, C/||g_i||)`` with the norm raised by a rounding margin (about
    3e-7 relative in float32, 1e-15 in float64 plus ``p`` float64 roundings),
    so that a sample's contribution *as computed* never exceeds C
    (docs/privacy.md).
    """
    max_norm, noise_std, inv_denom = _check_common(
        max_norm, noise_multiplier, reduction, expected_batch_size, nan_policy)
    shape = _arrays.shape(grads, "grads")
    if len(shape) != 2:
        raise ValueError(f"grads: expected shape (B, p), got {shape}")
    be = _backend.select("clip", grads=grads)
    _backend.refuse_graph_capture(be, grads, "clip_and_noise")
    dtype = be.check_float(grads, "grads")
    _check_noise_range(noise_std, inv_denom, dtype)
    B, p = shape
    seed, offset = _stream.claim(seed, offset, p)
    g = be.io.to_kernel(grads)
    out = be.io.empty((p,), dtype)
    buf, factors, norms, _ = step_buffer(be.io, B)
    be.kernels.clip_noise_rows(g, max_norm, noise_std, inv_denom, seed, offset, out, norms, factors)
    acc, _ = _accounting(be, buf, B, max_norm, nan_policy, seed, offset, p, by_factors=False)
    return ClipResult(grad=be.io.to_user(out), **acc)
