"""ScatterNet features (Oyallon & Mallat 2015; Tramer & Boneh 2021,
"Differentially private learning needs better features") with kymatio's NumPy
frontend, followed by per-sample group normalisation.

The NeuroMixGDP paper (seed 002) uses "a Scattering Network of depth J=2 ...
wavelet filters rotated along eight angles ... group normalization with 27
groups": for 28x28 images that is 1 + J L + L^2 J (J-1) / 2 = 81 channels on a
7x7 grid, i.e. 3969 features.  The extractor is fixed (Morlet wavelets, no
training data), so it costs no privacy budget; group normalisation uses
only the sample's own values, so it adds no cross-sample dependence either.
"""
from __future__ import annotations

import functools

import numpy as np

from .._validate import check_pos_int, check_positive

GN_EPS = 1e-5   # torch.nn.GroupNorm's default, as in Tramer & Boneh's code
GN_GROUPS = 27


@functools.lru_cache(maxsize=8)
def _scattering(J: int, shape: tuple, L: int):
    # kymatio.numpy / kymatio.torch fail to import with SciPy 1.17 (they pull in a
    # removed scipy symbol through the torch frontend); the NumPy frontend module
    # itself is fine.
    from kymatio.scattering2d.frontend.numpy_frontend import ScatteringNumPy2D
    return ScatteringNumPy2D(J=J, shape=shape, L=L, max_order=2)


def group_normalize(features: np.ndarray, groups: int = GN_GROUPS, eps: float = GN_EPS,
                    out: np.ndarray | None = None) -> np.ndarray:
    """GroupNorm without affine parameters (Wu & He 2018, eq. 1 with S_i the
    sample's channels of one group and all their spatial positions):
    ``(x - mean_g) / sqrt(var_g + eps)``, ``var_g`` the biased (population)
    variance, as torch.nn.GroupNorm(groups, C, eps, affine=False).

    features: (n, C, *spatial) float32, C divisible by ``groups``.  Returns the
    same shape, float32 (written into ``out`` when given).  Computed in float64
    per group, so the result is the float32 rounding of the exact value.
    """
    x = np.asarray(features)
    if x.ndim < 2:
        raise ValueError(f"features: expected shape (n, C, ...), got {x.shape}")
    n, c = x.shape[:2]
    groups = check_pos_int(groups, "groups")
    # eps 0 on a constant group, or NaN / negative, made the output NaN.
    eps = check_positive(eps, "eps")
    if c % groups:
        raise ValueError(f"groups: expected a divisor of the {c} channels, got {groups}")
    g = x.reshape(n, groups, -1).astype(np.float64)
    g -= g.mean(axis=2, keepdims=True)
    g /= np.sqrt((g * g).mean(axis=2, keepdims=True) + eps)
    res = g.reshape(x.shape).astype(np.float32)
    if out is not None:
        out[...] = res
        return out
    return res


def _as_unit_images(images, name="images") -> np.ndarray:
    x = np.asarray(images)
    if x.ndim != 3:
        raise ValueError(f"{name}: expected shape (n, H, W), got {x.shape}")
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255.0)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{name}: expected uint8 in 0..255 or floats in [0, 1], got {x.dtype}")
    if x.size and (not np.isfinite(x).all() or x.min() < 0 or x.max() > 1):
        # The images are usually the private training set: their pixel range stays
        # out of a message that may reach a log.
        raise ValueError(f"{name}: expected floats in [0, 1], got "
                         + ("values outside it" if np.isfinite(x).all() else "non-finite values")
                         + " (not shown: images may be private)")
    return x.astype(np.float32, copy=False)


def scattering_features(images, J: int = 2, L: int = 8, groups: int | None = GN_GROUPS,
                        chunk: int = 256, out: np.ndarray | None = None,
                        progress=None) -> np.ndarray:
    """ScatterNet features of grayscale images, group normalised, flattened.

    images: (n, H, W) uint8 in 0..255 (scaled by 1/255 to [0, 1], as
        torchvision's ToTensor in Tramer & Boneh's code) or floats already in
        [0, 1]; H and W divisible by 2**J.  Public or private data alike: the
        map is fixed and per-sample, so it spends no privacy budget.
    J: scale depth (2 in the papers); L: number of angles (8).
    groups: GroupNorm groups over the K = 1 + J L + L^2 J (J-1)/2 channels
        (27 in the papers; None: no normalisation).
    chunk: images per kymatio call (bounds memory: ~chunk * K * H W / 4**J * 4 bytes).
    out: optional (n, K * H/2**J * W/2**J) float32 array (e.g. a np.memmap) to fill.
    progress: optional callable(done, n) called after each chunk.

    Returns (n, K * H/2**J * W/2**J) float32, C-contiguous: for 28x28 and J=2,
    (n, 81 * 7 * 7) = (n, 3969), channel-major (the flattening of (n, 81, 7, 7)).
    """
    x = _as_unit_images(images)
    n, h, w = x.shape
    J = check_pos_int(J, "J")
    L = check_pos_int(L, "L")
    if h % 2 ** J or w % 2 ** J:
        raise ValueError(f"images: expected H and W divisible by 2**J = {2 ** J}, got {h}x{w}")
    if chunk < 1:
        raise ValueError(f"chunk: expected a positive integer, got {chunk}")
    k = 1 + J * L + L * L * J * (J - 1) // 2
    d = k * (h // 2 ** J) * (w // 2 ** J)
    if out is None:
        out = np.empty((n, d), np.float32)
    elif out.shape != (n, d) or out.dtype != np.float32:
        raise ValueError(f"out: expected float32 of shape {(n, d)}, got {out.dtype} {out.shape}")
    S = _scattering(J, (h, w), L)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        z = S(np.ascontiguousarray(x[s:e]))            # (m, K, H/2^J, W/2^J)
        if groups:
            z = group_normalize(z, groups)
        out[s:e] = z.reshape(e - s, d)
        if progress is not None:
            progress(e, n)
    return out
