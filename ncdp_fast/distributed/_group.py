"""Process groups for the sharded capabilities: which group, which rank, same config?

Shared by every module of :mod:`ncdp_fast.distributed` (the sharded release, the
row-sharded NTK Gram, ...).  torch is imported lazily: with ``group=None`` and no
initialised default group (or no torch at all) a call is a one-process call.

API (kept small and stable):

* :func:`resolve_group` -- ``None`` -> the default group if ``torch.distributed`` is
  initialised, else ``None`` (one process); a given group is returned as is.
* :func:`rank_world` -- ``(rank, world)`` of this process in the group (``(0, 1)`` for
  ``None``).
* :func:`check_same_config` -- all ranks exchange a small config dict first (plus,
  optionally, secret values compared by salted digest, a per-rank value and a local
  error); a difference or a failed rank raises the same ``ValueError`` on every
  rank, naming the keys and ranks (and the public values only).
* :func:`shard_bounds` -- the contiguous row range ``[start, stop)`` a rank holds.
* :class:`GroupRef` -- a group held by a long-lived object (a clipper, a sampler)
  without keeping it alive past ``destroy_process_group``.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import sys
import traceback
import weakref
from typing import Any

import numpy as np

from .. import _validate

__all__ = ["resolve_group", "rank_world", "check_same_config", "shard_bounds", "GroupRef"]


def _dist():
    """torch.distributed, or None when torch (or its distributed build) is absent."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


def unpin_world_defaults() -> None:
    """Replace the default group that ``torch.distributed.nn.functional``
    bound into its functions' default arguments by None (the same group to
    every call: the default one).  Imported after ``init_process_group`` (the
    first torch optimizer imports it, and so does ``ncdp_fast.torch`` imported
    late, inside a ``main()``), those defaults keep the group alive past
    ``destroy_process_group``; its gloo worker threads then run into the
    interpreter's shutdown and the rank dies by SIGABRT (issue 37)."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    dist = _dist()
    if functional is None or dist is None:
        return
    pg = dist.ProcessGroup
    for fn in list(vars(functional).values()):
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, pg) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, pg) else d for d in defaults)
        kw = getattr(fn, "__kwdefaults__", None)
        if kw and any(isinstance(d, pg) for d in kw.values()):
            fn.__kwdefaults__ = {k: None if isinstance(d, pg) else d for k, d in kw.items()}


def resolve_group(group: Any = None) -> Any:
    """The process group a sharded call runs on, or ``None`` for one process.

    ``group=None``: the default (WORLD) group when ``torch.distributed`` is
    initialised, else ``None``.  A given group needs an initialised
    ``torch.distributed`` (``TypeError``/``RuntimeError`` otherwise)."""
    if group is None and "torch.distributed" not in sys.modules:
        return None         # nothing initialised a group; no torch import (seconds) for that
    dist = _dist()
    unpin_world_defaults()
    if group is None:
        if dist is None or not dist.is_initialized():
            return None
        return dist.group.WORLD
    if dist is None:
        raise RuntimeError("group: expected a torch.distributed process group, but "
                           "torch.distributed is not available in this installation")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("group: expected an initialised torch.distributed "
                           "(init_process_group), got none")
    return group


class GroupRef:
    """A resolved process group (or ``None``: one process) held weakly.

    An object that outlives its collectives (a clipper, whose hooks put it in a
    reference cycle with the model; an exception's traceback) would otherwise keep
    the group alive after ``destroy_process_group`` until the interpreter's final
    garbage collection.  A live gloo group keeps its worker threads, and a worker
    that drops the last reference to a finished collective's tensors then needs
    the GIL while the interpreter shuts down: the thread is unwound through a
    C++ destructor and the process aborts ("terminate called without an active
    exception", SIGABRT, in 3-7 of 10 torchrun runs).  torch.distributed holds
    every live group itself (``_world``), so a weak reference is enough while the
    group exists, and ``destroy_process_group`` frees it (joining its threads).

    ``what``: the owner, named when it is used after its group was destroyed."""

    __slots__ = ("_ref", "_what")

    def __init__(self, group: Any, what: str):
        self._ref = None if group is None else weakref.ref(group)
        self._what = what

    def get(self) -> Any:
        """The group, ``None`` for one process; ``RuntimeError`` once it was destroyed."""
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise RuntimeError(
                f"{self._what}: group: expected the live process group it was built on, got "
                "one freed since (destroy_process_group); build a new "
                f"{self._what} on a live group")
        return group


def rank_world(group: Any) -> tuple[int, int]:
    """``(rank, world)`` of this process in ``group`` (already resolved; ``None`` -> (0, 1))."""
    if group is None:
        return 0, 1
    dist = _dist()
    return dist.get_rank(group), dist.get_world_size(group)


def _digest(value: Any) -> str:
    """A short stable text for one public config value (repr of floats is exact)."""
    text = repr(value)
    if len(text) <= 200:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _secret_digest(salt: bytes, value: Any) -> str:
    """HMAC-SHA256 of a secret value under this call's salt: equal values give equal
    digests within the call, and a digest says nothing about the value without the
    salt (a 64-bit seed cannot be looked up in a table of hashes)."""
    h = hmac.new(salt, digestmod=hashlib.sha256)
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        h.update(f"{a.dtype.str}|{a.shape}|".encode())
        h.update(a.data)
    else:
        h.update(repr(value).encode())
    return h.hexdigest()


def _call_salt(group) -> bytes:
    """Fresh random bytes from group rank 0, the same on every rank."""
    dist = _dist()
    box = [secrets.token_bytes(32) if rank_world(group)[0] == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _release_frames(error: BaseException | None) -> None:
    """Replace the tracebacks of ``error`` and its chain by their text (a note).

    The caller keeps ``error`` in a local while its traceback holds the caller's
    frame: a reference cycle that keeps every local of that frame (the process
    group among them) alive until the interpreter's final garbage collection,
    which aborts the process at exit (:class:`GroupRef`).  The text keeps where
    each error was raised; the frames are let go."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            error.add_note("raised at (frames released):\n" +
                           "".join(traceback.format_tb(error.__traceback__)).rstrip())
            error.__traceback__ = None
        error = error.__cause__ or error.__context__


def check_same_config(config: dict, group: Any, what: str, *, secret: dict | None = None,
                      local: Any = None, error: BaseException | None = None) -> list:
    """All ranks of ``group`` must hold the same ``config``; else ``ValueError`` on every rank.

    ``config``: a dict of str -> picklable *public* value (sizes, epsilon, ...); only
    a short text per value crosses the wire (``all_gather_object``, bounded by the
    group's timeout) and a differing value is shown in the message.
    ``secret``: a dict of str -> value that must agree but must never be shown (the
    noise key, private labels or features; NumPy arrays are compared by dtype, shape
    and bytes): only an HMAC under a salt drawn for this call on rank 0 crosses the
    wire, and a difference names the key and which ranks agree, never a value or
    a digest.  Pass it (``{}`` included) on every rank or on none: the salt is one
    more collective.  ``what``: the operation, named in the message.
    ``local``: an optional small picklable value that may differ by rank (a shard
    size); the list of every rank's ``local`` is returned, in rank order.
    ``error``: an exception this rank met while preparing (a bad argument): every
    rank then raises a ``ValueError`` naming the failing ranks and their messages,
    instead of the others waiting in a later collective for a rank that left.
    Every rank raises the same message, so no rank goes on to a collective that the
    others skip.  One process (``group=None``): ``error`` is raised as is, and the
    return value is ``[local]``."""
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict, got {type(config).__name__}")
    if secret is not None and not isinstance(secret, dict):
        raise TypeError(f"secret: expected a dict or None, got {type(secret).__name__}")
    clash = sorted(set(map(str, secret or ())) & set(map(str, config)))
    if clash and error is None:
        # Raised through the exchange below, so that no rank waits for this one.
        error = ValueError(f"secret: expected keys that config does not have, got {clash} "
                           "in both")
    if group is None:
        if error is not None:
            raise error
        return [local]
    dist = _dist()
    _, world = rank_world(group)
    mine = {str(k): _digest(v) for k, v in config.items()}
    if secret is not None:
        salt = _call_salt(group)
        mine.update({str(k): ("secret", _secret_digest(salt, v)) for k, v in secret.items()})
    why = None if error is None else f"{type(error).__name__}: {error}"
    _release_frames(error)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (mine, local, why), group=group)
    failed = [(r, g[2]) for r, g in enumerate(gathered) if g[2] is not None]
    if failed:
        text = "; ".join(f"rank {r}: {w}" for r, w in failed)
        raise ValueError(f"{what}: {len(failed)} of {world} ranks failed before starting: "
                         f"{text}") from error
    configs = [g[0] for g in gathered]
    keys = sorted(set().union(*(c.keys() for c in configs)))
    bad = []
    for k in keys:
        vals = [c.get(k, "<missing>") for c in configs]
        if len(set(vals)) <= 1:
            continue
        if any(isinstance(v, tuple) for v in vals):
            # Only which ranks agree: the values and their digests stay unknown.
            classes: dict = {}
            for r, v in enumerate(vals):
                classes.setdefault(v, []).append(r)
            shown = " | ".join(f"ranks {rs}" if vals[rs[0]] != "<missing>" else
                               f"ranks {rs}: <missing>" for rs in classes.values())
            bad.append(f"{k} (secret, values not shown; equal within each group: {shown})")
        else:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))
            bad.append(f"{k} ({per_rank})")
    if bad:
        raise ValueError(f"{what}: expected the same configuration on all {world} ranks, "
                         f"got differing " + "; ".join(bad))
    return [g[1] for g in gathered]


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of ``n`` that rank ``rank`` of ``world`` holds.

    Balanced: the first ``n % world`` ranks hold one row more; ranks past ``n`` hold
    an empty shard (``start == stop``).  The shards of ranks 0..world-1 tile [0, n)
    in order."""
    n = _validate.check_int(n, "n", 0)
    world = _validate.check_pos_int(world, "world")
    rank = _validate.check_int(rank, "rank", 0)
    if rank >= world:
        raise ValueError(f"rank: expected an integer in [0, {world}), got {rank}")
    q, r = divmod(n, world)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)
