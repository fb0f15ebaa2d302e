"""Op 1 of DESIGN.md: fused per-sample clipping with noise (dense and factored).

Layer 2 code: validates, converts arrays, picks the backend once per call,
allocates outputs and calls the kernels of the chosen backend.
"""
from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import Any, Sequence

import numpy as np

from . import _arrays, _backend, _stream
from ._validate import check_choice, check_nonneg, check_positive

__all__ = ["ClipResult", "LinearClipResult", "LayersClipResult", "GhostBlock", "clip_and_noise",
           "clip_and_noise_linear", "clip_and_noise_layers"]

_F64 = np.dtype(np.float64)


@dataclass(frozen=True)
class _Accounting:
    """What a private step did.  ``seed``, the Philox key used (drawn from the OS
    when the caller gave none), is secret: with it and the output anyone can
    subtract the noise.  It is an init-only argument kept on the object alone:
    not a field, so not in ``repr``/``str``, ``==``, ``dataclasses.asdict``/
    ``astuple``, and dropped by ``pickle`` and ``copy`` (a copy's ``seed`` is
    None).  ``offset``/``draws`` are public: they reveal nothing without it."""
    norms: Any           # (B,) float64 pre-clip per-sample norms, caller's array type/device
    num_clipped: int     # samples whose norm exceeded max_norm (their gradient was scaled down)
    num_nonfinite: int   # samples dropped under nan_policy="zero"
    offset: int          # first draw of the stream this call used
    draws: int           # draws consumed: the next call should start at offset + draws
    seed: InitVar[Any] = None

    def __post_init__(self, seed):
        # Not in __dict__: a pickled, copied or logged result may be shared,
        # never with the key.
        _SEED.put(self, seed)

    @property
    def next_offset(self) -> int:
        return self.offset + self.draws


# Added after the class is made: a property named like the InitVar would be its default.
_SEED = _stream.SecretSlot()
_Accounting.seed = property(lambda self: _SEED.get(self),
                            doc="The secret Philox key of this call (None on a copy).")


@dataclass(frozen=True)
class ClipResult(_Accounting):
    grad: Any = None     # (p,) noisy clipped sum (or mean), dtype of the gradients


@dataclass(frozen=True)
class LinearClipResult(_Accounting):
    grad_weight: Any = None  # (K, d)
    grad_bias: Any = None    # (K,) or None


@dataclass(frozen=True)
class LayersClipResult(_Accounting):
    grads: list = None   # per layer: an array shaped like the per-sample block without B,
                         # or (grad_weight, grad_bias) for an (activations, backprops) pair


@dataclass(frozen=True)
class GhostBlock:
    """A parameter block given by its per-sample squared norms and its clipped sum,
    for layers whose per-sample gradient is neither worth forming nor a linear
    pair (an embedding's sparse rows, a user's own layer).

    sq_norms: (B,) float64, same library and device as the other blocks: sample
        i's squared gradient norm for this block, accumulated in float64.
    clipped_sum: ``clipped_sum(factors) -> array``: given the (B,) float64 clip
        factors (0 marks a dropped sample, whose data may be NaN: it must add
        nothing), returns ``sum_i factors[i] * g_i`` without noise, C-contiguous,
        of ``shape`` and the blocks' dtype, freshly allocated: the op adds the
        noise into it in place.
    shape: the parameter's shape; ``prod(shape)`` noise draws.
    terms: float64 roundings in one sample's squared norm (the clip rule's
        rounding margin, reference.clip_bound); e.g. T*D + D for a sum of T
        rows of width D followed by its squared norm.
    dtype: the parameter's dtype (NumPy's or torch's); needed only when every
        block of the call is a ghost block (else the other blocks' dtype rules).
    spread, seq_len: when ``clipped_sum`` adds T = ``seq_len`` terms per sample
        in the data dtype, ``spread`` (B,) float64 is the sum of their norms
        (``reference.clip_bound``'s E), so that the factor leaves room for that
        rounding; None when the sum is exact or formed in float64.
    """
    sq_norms: Any
    clipped_sum: Any
    shape: tuple
    terms: int
    dtype: Any = None
    spread: Any = None
    seq_len: int = 1


# ------------------------------------------------------------------ validation

def _check_common(max_norm, noise_multiplier, reduction, expected_batch_size, nan_policy):
    max_norm = check_positive(max_norm, "max_norm")
    noise_multiplier = check_nonneg(noise_multiplier, "noise_multiplier")
    check_choice(reduction, "reduction", ("sum", "mean"))
    if reduction == "mean":
        if expected_batch_size is None:
            raise ValueError("expected_batch_size: reduction='mean' needs the expected batch size "
                             "(sample_rate * dataset size); dividing by the realized batch size "
                             "would leak it, so it is never used")
        inv_denom = 1.0 / check_positive(expected_batch_size, "expected_batch_size")
    else:
        inv_denom = 1.0
    check_choice(nan_policy, "nan_policy", ("raise", "zero"))
    return max_norm, noise_multiplier * max_norm, inv_denom


def _check_noise_range(noise_std, inv_denom, dtype):
    # Normals are bounded by 6.7 (32-bit uniforms): past this the output would be inf.
    if noise_std * 6.7 * inv_denom > float(np.finfo(dtype).max):
        raise ValueError(f"noise_multiplier: noise std {noise_std!r} (noise_multiplier * "
                         f"max_norm) overflows {np.dtype(dtype).name}; expected a finite result")


def _accounting(be, norms, max_norm, nan_policy, seed, offset, draws, factors=None):
    host = be.io.to_numpy(norms)
    # A zero factor also marks a finite norm whose rounding bound overflowed.
    dropped = ~np.isfinite(host)
    if factors is not None:
        dropped |= be.io.to_numpy(factors) == 0
    bad = np.flatnonzero(dropped)
    if bad.size and nan_policy == "raise":
        shown = ", ".join(str(i) for i in bad[:10]) + (", ..." if bad.size > 10 else "")
        raise ValueError(f"per-sample gradients of rows [{shown}] ({bad.size} of {host.size}) are not "
                         "finite (NaN/Inf, or a norm overflowing float64); fix the model or pass "
                         "nan_policy='zero' to drop those samples")
    clipped = np.count_nonzero(~dropped & (host > max_norm))
    return dict(norms=be.io.to_user(norms), num_clipped=int(clipped),
                num_nonfinite=int(bad.size), seed=seed, offset=offset, draws=draws)


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
    dtype = be.check_float(grads, "grads")
    _check_noise_range(noise_std, inv_denom, dtype)
    B, p = shape
    seed, offset = _stream.claim(seed, offset, p)
    g = be.io.to_kernel(grads)
    out = be.io.empty((p,), dtype)
    norms = be.io.empty((B,), _F64)
    factors = be.io.empty((B,), _F64)
    be.kernels.clip_noise_rows(g, max_norm, noise_std, inv_denom, seed, offset, out, norms, factors)
    acc = _accounting(be, norms, max_norm, nan_policy, seed, offset, p)
    return ClipResult(grad=be.io.to_user(out), **acc)


# --------------------------------------------------------------- factored ops

def _as_pair(activations, backprops, where=""):
    sa = _arrays.shape(activations, f"activations{where}")
    sg = _arrays.shape(backprops, f"backprops{where}")
    if len(sa) not in (2, 3) or len(sg) != len(sa):
        raise ValueError(f"activations{where}, backprops{where}: expected shapes (B, d) and (B, K), "
                         f"or (B, T, d) and (B, T, K); got {sa} and {sg}")
    if sa[0] != sg[0]:
        raise ValueError(f"backprops{where}: batch size {sg[0]} does not match activations{where} "
                         f"batch size {sa[0]}")
    if len(sa) == 3 and sa[1] != sg[1]:
        raise ValueError(f"backprops{where}: sequence length {sg[1]} does not match "
                         f"activations{where} sequence length {sa[1]}")
    return sa, sg


class _Layer:
    """One parameter block of a layered clip: a dense (B, ...) per-sample gradient,
    or a linear layer given by (activations, backprops[, bias])."""

    def __init__(self, spec, index, be, dtype):
        where = f"[{index}]"
        self.kind = "dense"
        if isinstance(spec, GhostBlock):
            s = _arrays.shape(spec.sq_norms, f"layers{where}.sq_norms")
            if len(s) != 1:
                raise ValueError(f"layers{where}.sq_norms: expected shape (B,), got {s}")
            if be.io.dtype_of(spec.sq_norms) != _F64:
                raise TypeError(f"layers{where}.sq_norms: expected float64, got "
                                f"{be.io.dtype_of(spec.sq_norms)}")
            if not callable(spec.clipped_sum):
                raise TypeError(f"layers{where}.clipped_sum: expected a callable, got "
                                f"{type(spec.clipped_sum).__name__}")
            self.kind, self.dense, self.spec = "ghost", False, spec
            self.sq = be.io.to_kernel(spec.sq_norms)
            self.param_shape = tuple(int(n) for n in spec.shape)
            self.B, self.T = s[0], int(spec.seq_len)
            self.spread = None if spec.spread is None else be.io.to_kernel(spec.spread)
            self.draws = int(np.prod(self.param_shape))
            self.terms = int(spec.terms)
            return
        if isinstance(spec, (tuple, list)):
            self.kind = "pair"
            if len(spec) not in (2, 3):
                raise ValueError(f"layers{where}: expected a (B, ...) array or a tuple "
                                 f"(activations, backprops[, bias]), got a tuple of {len(spec)}")
            a, g = spec[0], spec[1]
            self.bias = bool(spec[2]) if len(spec) == 3 else True
            sa, sg = _as_pair(a, g, where)
            for name, x in (("activations", a), ("backprops", g)):
                if be.check_float(x, f"{name}{where}") != dtype:
                    raise TypeError(f"{name}{where}: dtype {be.io.dtype_of(x)} differs from {dtype} "
                                    "of the other inputs")
            B, T = sa[0], (sa[1] if len(sa) == 3 else 1)
            self.a = be.io.to_kernel(a).reshape(B, T, sa[-1])
            self.g = be.io.to_kernel(g).reshape(B, T, sg[-1])
            self.dense = False
            self.K, self.d, self.T = sg[-1], sa[-1], T
            # float64 multiply-adds in the sample's norm (reference.linear_terms)
            self.terms = self.d + self.K + T * T + T + (self.K if self.bias else 0)
            self.draws = self.K * self.d + (self.K if self.bias else 0)
        else:
            s = _arrays.shape(spec, f"layers{where}")
            if len(s) < 2:
                raise ValueError(f"layers{where}: expected a per-sample gradient of shape (B, ...), "
                                 f"got {s}")
            if be.check_float(spec, f"layers{where}") != dtype:
                raise TypeError(f"layers{where}: dtype {be.io.dtype_of(spec)} differs from {dtype}")
            B = s[0]
            self.param_shape = s[1:]
            self.g = be.io.to_kernel(spec).reshape(B, -1) if B else be.io.to_kernel(spec).reshape(
                0, int(np.prod(s[1:])))
            self.dense = True
            self.draws = int(np.prod(s[1:]))
            self.terms, self.T = self.draws, 1
        self.B = B

    def held(self) -> int:
        """Values of the block's own arrays (0 for a ghost block: its closure's)."""
        if self.kind == "ghost":
            return 0
        # Kernel views are NumPy arrays on the CPU and torch/CuPy arrays on a
        # GPU, whose .size is a method in torch: count through the shape.
        return math.prod(_arrays.shape(self.g, "g")) + (
            0 if self.dense else math.prod(_arrays.shape(self.a, "a")))

    def add_sq_norms(self, kernels, sq):
        if self.kind == "ghost":
            sq += self.sq
        elif self.dense:
            kernels.row_sq_norms(self.g, sq, True)
        else:
            kernels.linear_sq_norms(self.a, self.g, self.bias, sq, True)

    def add_spread(self, kernels, spread):
        """The rounding scale of a sum over positions (sequence blocks only)."""
        if self.kind == "ghost":
            if self.spread is not None:
                spread += self.spread
        elif not self.dense and self.T > 1:
            kernels.linear_spread(self.a, self.g, self.bias, spread, True)

    def drop_rows(self, io, rows):
        """Zero the given samples (a copy, never the caller's data): 0 * NaN would
        still be NaN inside the GEMM.  A ghost block drops them itself (factor 0)."""
        rows = list(int(r) for r in rows)
        if self.kind == "ghost":
            return
        if self.dense:
            self.g = io.copy(self.g)
            self.g[rows] = 0
        else:
            self.a, self.g = io.copy(self.a), io.copy(self.g)
            self.a[rows] = 0
            self.g[rows] = 0

    def reduce(self, be, dtype, factors, noise_std, inv_denom, seed, offset):
        if self.kind == "ghost":
            out = self.spec.clipped_sum(be.io.to_user(factors))
            if tuple(_arrays.shape(out, "clipped_sum()")) != self.param_shape:
                raise ValueError(f"clipped_sum(): expected shape {self.param_shape}, got "
                                 f"{tuple(_arrays.shape(out, 'clipped_sum()'))}")
            if be.io.dtype_of(out) != dtype:
                raise TypeError(f"clipped_sum(): expected dtype {dtype}, got {be.io.dtype_of(out)}")
            flat = be.io.to_kernel(out).reshape(-1)
            be.kernels.add_gaussian(flat, np.uint64(seed), np.uint64(offset), float(noise_std),
                                    True, float(inv_denom))
            return be.io.to_user(flat.reshape(self.param_shape))
        if self.dense:
            out = be.io.empty((self.draws,), dtype)
            be.kernels.weighted_row_sum_noise(self.g, factors, noise_std, inv_denom, seed, offset,
                                              out)
            return be.io.to_user(out.reshape(self.param_shape))
        gw = be.io.empty((self.K, self.d), dtype)
        gb = be.io.empty((self.K,), dtype) if self.bias else None
        be.kernels.clipped_linear_sum(self.a, self.g, factors, noise_std, inv_denom, seed, offset,
                                      gw, gb, matmul=be.io.matmul)
        return be.io.to_user(gw), (None if gb is None else be.io.to_user(gb))


def _ghost_dtype(specs) -> np.dtype:
    dt = specs[0].dtype
    if dt is None:
        raise ValueError("layers[0].dtype: expected the parameter's dtype when every block is a "
                         "GhostBlock, got None")
    dt = _arrays.as_numpy_dtype(dt)
    if dt not in _backend.FLOAT_DTYPES:
        raise TypeError(f"layers[0].dtype: expected float32 or float64, got {dt}")
    return dt


def _clip_layers(layer_specs, arrays, max_norm, noise_multiplier, seed, offset, reduction,
                 expected_batch_size, nan_policy, grad_scale=1.0, release=False):
    max_norm, noise_std, inv_denom = _check_common(
        max_norm, noise_multiplier, reduction, expected_batch_size, nan_policy)
    be = _backend.select("clip", **arrays)
    plain = [k for k in arrays if not k.endswith(".sq_norms")]
    if plain:
        dtype = be.check_float(arrays[plain[0]], plain[0])
    else:           # ghost blocks only: their sq_norms are float64 whatever the data
        dtype = _ghost_dtype(layer_specs)
    _check_noise_range(noise_std, inv_denom, dtype)
    layers = [_Layer(spec, i, be, dtype) for i, spec in enumerate(layer_specs)]
    if release:
        arrays.clear()
        layer_specs[:] = [None] * len(layer_specs)
    B = layers[0].B
    for i, layer in enumerate(layers):
        if layer.B != B:
            raise ValueError(f"layers[{i}]: batch size {layer.B} differs from layers[0] batch size {B}")
    draws = sum(layer.draws for layer in layers)
    seed, offset = _stream.claim(seed, offset, draws)
    sq = be.io.zeros((B,), _F64)
    for layer in layers:
        layer.add_sq_norms(be.kernels, sq)
    t_max = max(layer.T for layer in layers)
    spread = be.io.zeros((B,), _F64) if t_max > 1 else None
    for layer in layers:
        if spread is not None:
            layer.add_spread(be.kernels, spread)
    terms = sum(layer.terms for layer in layers)
    if grad_scale != 1.0:
        # The blocks hold gradients / s: the sample's norm is s times theirs (two
        # more float64 roundings: s^2 * sq here, f * s below).
        sq *= grad_scale * grad_scale
        if spread is not None:
            spread *= grad_scale
        terms += 2
    factors, norms = be.io.empty((B,), _F64), be.io.empty((B,), _F64)
    be.kernels.clip_factors(sq, spread, max_norm, terms, t_max,
                            float(np.finfo(dtype).eps) / 2, factors, norms)
    acc = _accounting(be, norms, max_norm, nan_policy, seed, offset, draws, factors)
    if acc["num_nonfinite"]:
        bad = np.flatnonzero(be.io.to_numpy(factors) == 0)
        for layer in layers:
            layer.drop_rows(be.io, bad)
    weights = factors * grad_scale if grad_scale != 1.0 else factors
    starts = [offset]                       # Python ints: offsets reach 2^64
    for layer in layers[:-1]:
        starts.append(starts[-1] + layer.draws)
    order = range(len(layers))
    if release:
        # Most memory freed first: a layer's sum allocates `draws` values and
        # dropping it frees its (B, T, d) and (B, T, K) arrays.
        order = sorted(order, key=lambda i: layers[i].draws - layers[i].held())
    grads = [None] * len(layers)
    for i in order:
        grads[i] = layers[i].reduce(be, dtype, weights, noise_std, inv_denom, seed, starts[i])
        if release:
            layers[i] = None
    return grads, acc


def clip_and_noise_linear(activations, backprops, *, max_norm, noise_multiplier, bias=True,
                          seed=None, offset=None, reduction="sum", expected_batch_size=None,
                          nan_policy="raise") -> LinearClipResult:
    """Clipped, noised gradient of a linear layer without per-sample gradients.

    The per-sample weight gradient of ``y = x W^T + b`` is ``G_i = sum_t g_it a_it^T``;
    its norm comes from the factored identities of DESIGN.md kernel 1
    (``||g_i|| ||a_i||`` for 2-D inputs; the Gram form
    ``sum_ts (a_it.a_is)(g_it.g_is)`` or the formed K x d matrix for sequences,
    whichever 2T^2 <= K d picks), plus ``||sum_t g_it||^2`` for the bias; the
    clipped sum is one GEMM ``(c * g)^T a``.

    Args:
        activations: (B, d) or (B, T, d) layer inputs.
        backprops: (B, K) or (B, T, K) gradients of each sample's *own* loss with
            respect to the layer output (with a mean-reduced loss, multiply by the
            realized batch size first, as Opacus does).
        bias: whether the layer has a (trainable) bias; its gradient shares the
            sample's clip factor.
        Other arguments as :func:`clip_and_noise`.  Noise: weight entry (k, j) is
        draw ``offset + k*d + j``, bias entry k is draw ``offset + K*d + k``.

    Returns a :class:`LinearClipResult` with ``grad_weight`` (K, d) and
    ``grad_bias`` (K,) or None.
    """
    _as_pair(activations, backprops)
    grads, acc = _clip_layers([(activations, backprops, bias)],
                              dict(activations=activations, backprops=backprops), max_norm,
                              noise_multiplier, seed, offset, reduction, expected_batch_size,
                              nan_policy)
    gw, gb = grads[0]
    return LinearClipResult(grad_weight=gw, grad_bias=gb, **acc)


def clip_and_noise_layers(layers: Sequence, *, max_norm, noise_multiplier, seed=None, offset=None,
                          reduction="sum", expected_batch_size=None, nan_policy="raise",
                          grad_scale=1.0, release_blocks=False) -> LayersClipResult:
    """Clip several parameter blocks jointly: one factor per sample from the total norm.

    Each element of ``layers`` is a dense per-sample gradient (B, ...)
    (e.g. Opacus's ``p.grad_sample``), a linear layer ``(activations,
    backprops)`` / ``(activations, backprops, bias)`` as in
    :func:`clip_and_noise_linear`, or a :class:`GhostBlock` (per-sample squared
    norms and a clipped-sum function; prod(shape) draws).  ``grad_scale`` s > 0:
    the blocks hold the per-sample gradients divided by s (the output gradients
    of a batch-mean loss, s = the realized batch size): norms, factors and sums
    are those of s times the blocks, the multiplication folded into the (B,)
    norms and factors instead of a pass over every block.  The sample's norm is
    ``sqrt(sum over blocks of its squared block norms)``; every block gets its
    own disjoint range of the noise stream, in order (dense: prod(shape[1:])
    draws; linear: K*d, then K for the bias).  Other arguments as
    :func:`clip_and_noise`.

    ``release_blocks=True`` hands the list ``layers`` over to the op: it is
    emptied (every entry set to None) as the blocks are taken, and the op drops
    each block once its sum is formed, forming first the blocks that free more
    than their sum allocates (each still takes its own noise range).  A caller
    that keeps no other reference to the blocks' arrays (GhostClipper) then
    frees a layer's activations and backprops before later sums are allocated,
    instead of holding all of them until the last sum exists.

    Returns a :class:`LayersClipResult`; ``grads[l]`` is an array of shape
    ``shape[1:]`` for a dense block, ``(grad_weight, grad_bias)`` for a pair, an
    array of ``shape`` for a ghost block.
    """
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise TypeError(f"layers: expected a non-empty list of arrays or (activations, backprops) "
                        f"tuples, got {type(layers).__name__}")
    arrays = {}
    for i, spec in enumerate(layers):
        if isinstance(spec, GhostBlock):
            arrays[f"layers[{i}].sq_norms"] = spec.sq_norms
        elif isinstance(spec, (tuple, list)):
            arrays[f"layers[{i}][0]"] = spec[0] if len(spec) else None
            arrays[f"layers[{i}][1]"] = spec[1] if len(spec) > 1 else None
        else:
            arrays[f"layers[{i}]"] = spec
    del spec                    # with release_blocks, the op holds the only references
    grad_scale = check_positive(grad_scale, "grad_scale")
    if not np.isfinite(grad_scale):
        raise ValueError(f"grad_scale: expected a finite number > 0, got {grad_scale!r}")
    grads, acc = _clip_layers(layers, arrays, max_norm, noise_multiplier, seed, offset, reduction,
                              expected_batch_size, nan_policy, grad_scale,
                              release=bool(release_blocks))
    return LayersClipResult(grads=grads, **acc)
