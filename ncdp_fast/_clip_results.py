"""The results of the clip ops (``_clip.py``, ``_clip_layers.py``) and the
accounting they share: what a private step did (norms, counts, the noise range
it drew and its secret key), and :class:`GhostBlock`, the parameter block a
caller gives by its squared norms and clipped sum.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any

import numpy as np

from . import _stream

__all__ = ["ClipResult", "LinearClipResult", "LayersClipResult", "GhostBlock"]


@dataclass(frozen=True)
class _Accounting:
    """What a private step did.  ``seed``, the Philox key used (drawn from the OS
    when the caller gave none), is secret: with it and the output anyone can
    subtract the noise.  It is an init-only argument kept on the object alone:
    not a field, so not in ``repr``/``str``, ``==``, ``dataclasses.asdict``/
    ``astuple``, and dropped by ``pickle`` and ``copy`` (a copy's ``seed`` is
    None).  ``offset``/``draws`` are public: they reveal nothing without it.

    ``norms``, ``num_clipped`` and ``num_nonfinite`` are the private data's,
    without noise: readable on the result in the process that made it, held
    off the object the same way (:class:`ncdp_fast._stream.Unreleased`), so a
    result that is logged, pickled or copied carries only the released
    gradient and the draw range (a copy's are None)."""
    norms: InitVar[Any]          # (B,) float64 pre-clip per-sample norms, caller's array type/device
    num_clipped: InitVar[int]    # samples whose norm exceeded max_norm (scaled down)
    num_nonfinite: InitVar[int]  # samples dropped under nan_policy="zero"
    offset: int          # first draw of the stream this call used
    draws: int           # draws consumed: the next call should start at offset + draws
    seed: InitVar[Any] = None

    def __post_init__(self, norms, num_clipped, num_nonfinite, seed):
        # Not in __dict__: a pickled, copied or logged result may be shared,
        # never with the key or the data's own values.
        _SEED.put(self, seed)
        _stream.Unreleased.hold_all(self, {"norms": norms, "num_clipped": num_clipped,
                                           "num_nonfinite": num_nonfinite})

    @property
    def next_offset(self) -> int:
        return self.offset + self.draws


# Added after the class is made: a property named like the InitVar would be its default.
_SEED = _stream.SecretSlot()
_Accounting.seed = property(lambda self: _SEED.get(self),
                            doc="The secret Philox key of this call (None on a copy).")
_stream.Unreleased.install(_Accounting, {
    "norms": "(B,) float64 pre-clip per-sample norms (private; None on a copy)",
    "num_clipped": "samples whose norm exceeded the bound (private; None on a copy)",
    "num_nonfinite": "samples dropped under nan_policy='zero' (private; None on a copy)"})


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
        noise into it in place, once every block's sum is formed (blocks
        returning one array, or overlapping ones, are refused by name).
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
    float64_norms: None, or, where ``sq_norms`` (and ``spread``) are upper
        bounds from float32 Grams (``gram_precision="float32"``), a callable
        returning the block's ``(sq_norms, spread)`` formed in float64: the op
        calls it only in a step whose rows it would drop, where a float32 Gram
        may have overflowed (docs/privacy.md, "Norms from float32 Grams").
    unmasked_sum: None, or a callable like ``clipped_sum`` that the op calls
        instead when no row of the step is dropped (every factor above 0, all
        data finite): it may skip masking dropped rows.
    reads: the tensors ``clipped_sum`` reads at the step that are a layer's
        inputs (an embedding's indices): the torch drop-in refuses a step in
        which one was changed in place after its backward (the norms would be
        one batch's, the sums another's).
    gemm_sizes: None, or, where ``clipped_sum`` forms its sum as one clipped
        GEMM of a (B, T, d) and g (B, T, K) (a tied weight's head,
        ``torch/tied.py``), ``(sizes, T, d, K)``: sizes (B, 2) float64, each
        sample's ||a_i||^2 and ||g_i||^2 summed in float64 from the data
        dtype's values.  The op then decides that GEMM's exponent rebalancing
        from them, as a linear pair's (``_balance``, read in the step's one
        transfer), and calls ``clipped_sum(factors, balance=flag)`` (and
        ``unmasked_sum`` so): False only where no sample could need a power
        of two moved.
    """
    sq_norms: Any
    clipped_sum: Any
    shape: tuple
    terms: int
    dtype: Any = None
    spread: Any = None
    seq_len: int = 1
    float64_norms: Any = None
    unmasked_sum: Any = None
    reads: tuple = ()
    gemm_sizes: Any = None


# ------------------------------------------------------------------ accounting

def step_buffer(io, B, n_checks=0, n_extra=0):
    """(buf, factors, norms, extra): one float64 device array that a step's
    kernels write their per-sample outputs into and that the host reads in one
    transfer (on a GPU each transfer makes the host wait for the device, issue
    36): factors at [0, B), norms at [B, 2B), the checks' flags at [2B, 2B +
    n_checks), then ``n_extra`` values of the caller's (``extra``)."""
    buf = io.empty((2 * B + n_checks + n_extra,), np.float64)
    return buf, buf[:B], buf[B:2 * B], buf[2 * B + n_checks:]


def _accounting(be, buf, B, max_norm, nan_policy, seed, offset, draws, by_factors, checks=(),
                host=None):
    """The step's counts from ``buf`` (:func:`step_buffer`, its factors and
    norms written), read in one transfer with the caller's extra values;
    returns (acc, host), host the NumPy copy of ``buf``.

    ``by_factors``: the dropped rows are those of factor 0 -- the rule's factor
    is 0 exactly where its bound is not finite: for every non-finite norm (the
    bound is formed from the same sum) and for a finite norm whose rounding
    bound overflowed -- else those of a non-finite norm (the dense op).
    ``checks``: a caller's own device checks, ``(0-d tensor, refuse,
    passes)`` triples, their values read in the same transfer (as float64:
    exact for every float dtype, integers up to 2^53, a flag as 0 or 1);
    ``refuse()`` of the first value that fails ``passes`` raises, before the
    counts are judged (GhostClipper's loss checks: one host wait a step, not
    two).  The counts are formed on the host from the transferred values: no
    device reduction a step (issue 36's host time).  ``host``: ``buf`` already
    read, without checks (a per-layer group's region of the op's one
    transfer); None: read here."""
    if host is None:
        if checks:
            # GhostClipper's values are torch tensors, as its step buffer is;
            # one on another device than the buffer's is moved to it.  The cat
            # writes each value into the float64 buffer as it is (no promotion
            # among them).
            dev = buf.device
            import torch
            torch.cat([(v if v.device == dev else v.to(dev)).reshape(1) for v, _, _ in checks],
                      out=buf[2 * B:2 * B + len(checks)])
        host = be.io.to_numpy(buf)
    for v, (_, refuse, passes) in zip(host[2 * B:2 * B + len(checks)], checks):
        if not passes(float(v)):
            refuse()
    factors, norms = host[:B], host[B:2 * B]
    dropped = factors == 0 if by_factors else ~np.isfinite(norms)
    num_bad = int(dropped.sum())
    clipped = int(((norms > max_norm) & ~dropped).sum())
    if num_bad and nan_policy == "raise":
        bad = np.flatnonzero(dropped)
        shown = ", ".join(str(i) for i in bad[:10]) + (", ..." if bad.size > 10 else "")
        raise ValueError(f"per-sample gradients of rows [{shown}] ({bad.size} of {B}) are not "
                         "finite (NaN/Inf, or a norm overflowing float64); fix the model or pass "
                         "nan_policy='zero' to drop those samples")
    acc = dict(norms=be.io.to_user(buf[B:2 * B]), num_clipped=clipped,
               num_nonfinite=num_bad, seed=seed, offset=offset, draws=draws)
    return acc, host
