"""The results of the clip ops (``_clip.py``, ``_clip_layers.py``) and the
accounting they share: what a private step did (norms, counts, the noise range
it drew and its secret key), and :class:`GhostBlock`, the parameter block a
caller gives by its squared norms and clipped sum.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any

import numpy as np

from . import _arrays, _stream

__all__ = ["ClipResult", "LinearClipResult", "LayersClipResult", "GhostBlock"]


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


# ------------------------------------------------------------------ accounting

def _accounting(be, norms, max_norm, nan_policy, seed, offset, draws, factors=None, checks=(),
                extra=()):
    """The step's counts, read in one transfer.  ``checks``: a caller's own
    device flags, ``(0-d boolean tensor, refuse)`` pairs, read in the same
    transfer; ``refuse()`` of the first false flag raises, before the counts
    are judged (GhostClipper's loss checks: one host wait a step, not two).
    ``extra``: device arrays the caller needs on the host, read in the same
    transfer and returned flat, in float64, as the result's ``"extra"``."""
    # Counted where the norms are: one transfer of two counts per step (on a
    # GPU each transfer makes the host wait for the device, issue 36); the
    # rows are read only to name them in the error.
    xp = _arrays.module_of(norms)
    if factors is not None:
        # The rule's factor is 0 exactly where its bound is not finite: for
        # every non-finite norm (the bound is formed from the same sum) and
        # for a finite norm whose rounding bound overflowed.  So the zero
        # factors alone are the dropped rows (fewer device ops a step than
        # testing the norms too: issue 36's host time).
        dropped = factors == 0
        values = [dropped.sum(), ((norms > max_norm) & (factors != 0)).sum()]
    else:
        dropped = ~xp.isfinite(norms)
        values = [dropped.sum(), (~dropped & (norms > max_norm)).sum()]
    dev = getattr(values[0], "device", None)
    values += [(flag if flag.device == dev else flag.to(dev)).reshape(()).to(values[0].dtype)
               for flag, _ in checks]
    head = xp.stack(values)
    if extra:
        host = be.io.to_numpy(_arrays.cat_float64([p.reshape(-1) for p in (head, *extra)]))
        counts, rest = host[:len(values)], host[len(values):]
    else:
        counts, rest = be.io.to_numpy(head), None
    for ok, (_, refuse) in zip(counts[2:], checks):
        if not ok:
            refuse()
    num_bad, clipped = int(counts[0]), int(counts[1])
    if num_bad and nan_policy == "raise":
        bad = np.flatnonzero(be.io.to_numpy(dropped))
        shown = ", ".join(str(i) for i in bad[:10]) + (", ..." if bad.size > 10 else "")
        raise ValueError(f"per-sample gradients of rows [{shown}] ({bad.size} of "
                         f"{_arrays.shape(norms, 'norms')[0]}) are not "
                         "finite (NaN/Inf, or a norm overflowing float64); fix the model or pass "
                         "nan_policy='zero' to drop those samples")
    acc = dict(norms=be.io.to_user(norms), num_clipped=clipped,
               num_nonfinite=num_bad, seed=seed, offset=offset, draws=draws)
    if extra:
        acc["extra"] = rest
    return acc
