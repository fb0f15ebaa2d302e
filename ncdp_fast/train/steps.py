"""The (Noisy)(S)GD loop on a linear model, run in the caller's array library.

The per-sample gradient of a linear model is the outer product r_i x_i^T of the
residual and the feature, so the loop never forms an (n, K p) tensor: each step
is one call of :func:`ncdp_fast.clip_and_noise_linear` (norms ||r_i|| ||x_i||,
the clipped sum one GEMM) on NumPy or torch (CPU or CUDA) arrays.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays, _backend
from .._clip import clip_and_noise_linear
from .._numba.clip import clip_factors as _clip_factors

__all__ = ["ArrayOps", "float_features", "to_lib", "check_counts", "linear_steps"]


class ArrayOps:
    """The few array operations the training loop needs, in the caller's library."""

    def __init__(self, X):
        self.torch = _arrays.is_torch(X)
        if self.torch:
            import torch
            self.t = torch
            self.device, self.dtype = X.device, X.dtype
        else:
            self.dtype = np.asarray(X).dtype

    def asarray(self, a, dtype=None):
        if self.torch:
            return self.t.as_tensor(a if _arrays.is_torch(a) else np.asarray(a),
                                    dtype=dtype or self.dtype, device=self.device)
        return np.asarray(a, dtype=dtype or self.dtype)

    def zeros(self, shape):
        if self.torch:
            return self.t.zeros(shape, dtype=self.dtype, device=self.device)
        return np.zeros(shape, dtype=self.dtype)

    def softmax(self, z):
        if self.torch:
            return self.t.softmax(z, dim=1)
        z = z - z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        return z

    def sq_norm(self, a, axis=None):
        if self.torch:
            return (a.double() ** 2).sum() if axis is None else (a.double() ** 2).sum(dim=axis)
        a64 = a.astype(np.float64, copy=False)
        with np.errstate(over="ignore"):      # an overflow becomes inf, checked by the caller
            return (a64 * a64).sum() if axis is None else (a64 * a64).sum(axis=axis)

    def take(self, X, idx):
        if self.torch:
            return X.index_select(0, self.t.as_tensor(idx, device=X.device))
        return X[idx]

    def argmax(self, z):
        return z.argmax(dim=1) if self.torch else z.argmax(axis=1)


def float_features(X, name="X"):
    """NumPy/torch float features (integer NumPy arrays become float64)."""
    k = _arrays.kind(X)
    if k == "torch":
        return X
    if k != "numpy":
        raise TypeError(f"{name}: CuPy/other CUDA arrays are not supported by the estimators; "
                        "pass a torch CUDA tensor")
    a = np.asarray(X)
    if a.dtype.kind in "iub":
        a = a.astype(np.float64)
    if a.dtype not in _backend.FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32 or float64 features, got {a.dtype}")
    return np.ascontiguousarray(a)


def to_lib(a, like_ops: ArrayOps):
    """Move an array fitted in one library/device to the library of ``like_ops``."""
    if like_ops.torch:
        t = like_ops.t
        if _arrays.is_torch(a):
            return a.to(device=like_ops.device, dtype=like_ops.dtype)
        return t.as_tensor(np.asarray(a), dtype=like_ops.dtype, device=like_ops.device)
    return np.asarray(_arrays.to_numpy(a), dtype=like_ops.dtype)


def check_counts(counts, n):
    if counts is None:
        return None
    c = _arrays.to_numpy(counts)
    if c.shape != (n,) or c.dtype.kind not in "iu" or (c.size and c.min() < 1):
        raise ValueError(f"counts: expected ({n},) integers >= 1 (row i stands for counts[i] "
                         f"identical records), got shape {c.shape} dtype {c.dtype}")
    return c.astype(np.int64)


def linear_steps(X, y, *, num_classes, steps, lr, loss, max_grad_norm, noise_multiplier,
                 projection_radius, fit_intercept, seed, counts=None, batches=None,
                 expected_batch_size=None, init=None):
    r"""T steps of (Noisy)(S)GD on a linear model from zero; no validation, no accounting.

    The estimators validate and account; tests, benchmarks and the reproductions
    call it directly (``noise_multiplier=0``: plain clipped GD to compare with).
    Step t: ``g = sum_i clip_C(r_i x_i^T) + noise_multiplier*C*xi_t`` (xi_t = the next D
    draws of ``seed``, a NoiseStream, int or None), over all rows (``batches=None``) or over
    ``batches[t]``; ``theta -= lr * g`` (divided by ``expected_batch_size`` when given);
    then the projection of eq. 3.2.  ``counts[i]`` makes row i stand for that many
    identical records (their clipped gradients are equal, so the sum is exact).
    ``init=(W, b)`` starts elsewhere than zero (benchmarks time a step from a trained W).

    Returns ``(W (K, p), b (K,) or None, info)`` in X's library.
    """
    ops = ArrayOps(X)
    n, p = X.shape
    K = num_classes
    W = ops.zeros((K, p)) if init is None else init[0]
    b = (ops.zeros((K,)) if init is None else init[1]) if fit_intercept else None
    Y = ops.asarray(np.eye(K)[y])
    cnt = None if counts is None else ops.asarray(counts)
    draws = K * p + (K if fit_intercept else 0)
    scale = lr / expected_batch_size if expected_batch_size else lr
    clipped = 0
    for t in range(steps):
        if batches is None:
            Xb, Yb, cb = X, Y, cnt
        else:
            idx = batches[t]
            Xb, Yb = ops.take(X, idx), ops.take(Y, idx)
            cb = None if cnt is None else ops.take(cnt, idx)
        z = Xb @ W.T
        if b is not None:
            z = z + b
        R = ops.softmax(z) - Yb if loss == "ce" else z - Yb
        if cb is None:
            res = clip_and_noise_linear(Xb, R, max_norm=max_grad_norm,
                                        noise_multiplier=noise_multiplier, bias=fit_intercept,
                                        seed=seed)
            gW, gb = res.grad_weight, res.grad_bias
            clipped += res.num_clipped
        else:
            # Identical records have identical clipped gradients: weight the clipped
            # distinct rows by their multiplicity; the noise comes from the same op
            # on an empty batch (same draws, same layout as the unweighted path).
            sq = ops.sq_norm(R, 1) * (ops.sq_norm(Xb, 1) + (1.0 if fit_intercept else 0.0))
            norm = sq ** 0.5
            if not bool((norm == norm).all() and (norm != float("inf")).all()):
                raise ValueError("per-sample gradients are not finite (NaN/Inf, e.g. a square "
                                 "loss diverging under a large lr); lower lr or use loss='ce'")
            # The clip rule of every op (reference.clip_factors), in float64 on the host.
            sq_h = np.ascontiguousarray(_arrays.to_numpy(sq),
                                        dtype=np.float64)
            f_h, _ = np.empty_like(sq_h), np.empty_like(sq_h)
            _clip_factors(sq_h, None, max_grad_norm, K + p + (K if fit_intercept else 0) + 2, 1,
                          float(np.finfo(np.float32 if str(ops.dtype).endswith("32")
                                         else np.float64).eps) / 2, f_h, _)
            f = ops.asarray(f_h, dtype=ops.t.float64 if ops.torch else np.float64)
            clipped += int(round(float((cb * (norm > max_grad_norm)).sum())))
            # float64 product, rounded once: a float32 factor may be a denormal.
            Rw = ops.asarray(R * (f * cb)[:, None])
            noise = clip_and_noise_linear(Xb[:0], R[:0], max_norm=max_grad_norm,
                                          noise_multiplier=noise_multiplier, bias=fit_intercept,
                                          seed=seed)
            gW = Rw.T @ Xb + noise.grad_weight
            gb = (Rw.sum(0) + noise.grad_bias) if fit_intercept else None
        W = W - scale * gW
        if b is not None:
            b = b - scale * gb
        if projection_radius is not None:
            nrm = float(ops.sq_norm(W) + (ops.sq_norm(b) if b is not None else 0.0)) ** 0.5
            if nrm > projection_radius:
                W = W * (projection_radius / nrm)
                if b is not None:
                    b = b * (projection_radius / nrm)
    return W, b, dict(num_clipped=clipped, draws=steps * draws)
