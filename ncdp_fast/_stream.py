"""One noise budget per Philox key: who may draw which range of the stream.

Every noisy op and object draws from Philox ``(seed, offset)``.  Reusing a
range of draws reuses noise: two releases whose noise is equal cancel in their
difference.  This module is the allocator shared by everything that draws in a
process (ops, estimators, preprocessing, the release, the torch drop-ins):

* ``seed=None``: a fresh 64-bit key from the OS; nothing to share or record.
* ``seed=S`` (an int) with no offset: the process-wide stream of S; each call
  takes the next unused range, so two components given the same S draw
  disjoint noise, and so does a refit.
* ``seed=S, offset=o``: exactly the range starting at o (reproducing a run);
  a :class:`NoiseReuseWarning` is raised if it overlaps a range this process
  already drew from S.
* ``seed=NoiseStream(...)``: that stream's next range.

The seed is the secret that turns a release back into its private data
(docs/privacy.md): a :class:`NoiseStream` refuses to be pickled, and the
artifacts meant for publication never store it.  This ledger ends with the
process; ``ncdp-fast release --seed`` continues across runs in
:mod:`ncdp_fast._key_ledger`, which reuses :class:`_Ledger`'s interval arithmetic.
"""
from __future__ import annotations

import bisect
import os
import secrets
import threading
import warnings
import weakref
from typing import Any

import numpy as np

from . import _validate

__all__ = ["NoiseStream", "NoiseReuseWarning", "claim", "resolve", "SecretSlot", "Unreleased"]


class SecretSlot:
    """A secret (a noise key) attached to an object but kept out of its
    ``__dict__``: ``vars(result)``, a logger or JSON dump of ``__dict__``, pickle
    and copy never see it (the issue-35 audit found a result's key in
    ``vars()``). Held while the owner lives, dropped when it is collected."""

    def __init__(self):
        self._held: dict[int, Any] = {}

    def put(self, owner, value) -> None:
        if value is None:
            return
        key = id(owner)
        self._held[key] = value
        weakref.finalize(owner, self._held.pop, key, None)

    def get(self, owner):
        return self._held.get(id(owner))


class Unreleased:
    """An attribute computed from the private data without noise (how many
    rows a step clipped, each sample's norm): the data holder reads it on the
    object in the process that computed it, but it is not part of what the
    object releases.  Held in a :class:`SecretSlot`, so that the pickle, copy,
    ``vars()``, ``repr`` and ``dataclasses.asdict`` of an object documented as
    publishable never carry it (the sixth audit: a pickled NoisyGD estimator's
    exact per-step clip counts revealed a record's presence at any epsilon)."""

    # One dict an object for all its such attributes: one finalizer an
    # object (a clip result is made every step).
    _values = SecretSlot()

    def __init__(self, doc: str = ""):
        self.__doc__ = doc

    def __set_name__(self, owner, name):
        self._name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        held = self._values.get(obj)
        return None if held is None else held.get(self._name)

    def __set__(self, obj, value):
        self.hold(obj, value)

    @classmethod
    def install(cls, owner, docs: dict) -> None:
        """Put one on dataclass ``owner`` per ``{name: doc}``, after the class is
        made (a descriptor named like an ``InitVar`` would be its default)."""
        for name, doc in docs.items():
            attr = cls(doc)
            attr.__set_name__(owner, name)
            setattr(owner, name, attr)

    @classmethod
    def hold_all(cls, obj, values: dict) -> None:
        """Set several on a new ``obj`` at once (a frozen dataclass's
        ``__post_init__``: one entry, not one a value)."""
        cls._values.put(obj, values)

    def hold(self, obj, value) -> None:
        """Set it on ``obj``."""
        held = self._values.get(obj)
        if held is None:
            held = {}
            self._values.put(obj, held)
        held[self._name] = value

_END = 2 ** 64


class NoiseReuseWarning(UserWarning):
    """An explicit (seed, offset) overlaps draws already used in this process."""


class _Ledger:
    """Draw ranges used per key: sorted, merged, disjoint [start, end) intervals,
    and the end of the highest one.  Keys are the explicit seeds of this process
    (``_LEDGER``), or the salted tags of the across-runs ledger (``_key_ledger``)."""

    def __init__(self, used: dict | None = None):
        self._lock = threading.Lock()
        self._used: dict = {} if used is None else used
        # Explicit keys whose across-runs ledger was read in this process
        # (NoiseStream.take: once a key, at its process-wide stream's first draw).
        self.disk_checked: set = set()
        # In a forked child: the keys the parent had drawn from, whose
        # process-wide streams the child continues from the parent's position.
        self.forked: set = set()

    def clear(self):
        """Forget every recorded range (the test suite: each test is its own run,
        and an oracle inside a test redraws a key's noise).  The keys whose
        across-runs ledger was read stay read (``disk_checked``: a new process
        starts with none)."""
        with self._lock:
            self._used.clear()

    def next_free(self, seed: int) -> int:
        with self._lock:
            used = self._used.get(seed)
            return used[-1][1] if used else 0

    def take_next(self, seed: int, draws: int) -> int:
        with self._lock:
            used = self._used.get(seed)
            start = used[-1][1] if used else 0
            self._add(seed, start, start + draws)
            return start

    def overlaps(self, seed, start: int, draws: int) -> bool:
        """Whether [start, start+draws) meets a recorded range (never for draws = 0)."""
        with self._lock:
            return self._overlaps(seed, start, draws)

    def record(self, seed, start: int, draws: int) -> bool:
        """Mark [start, start+draws) used; True if it overlapped an earlier range."""
        with self._lock:
            overlap = self._overlaps(seed, start, draws)
            self._add(seed, start, start + draws)
            return overlap

    def _overlaps(self, seed, start, draws):
        end = start + draws
        used = self._used.get(seed, [])
        i = bisect.bisect_right(used, [start, _END + 1])
        hit = (i > 0 and used[i - 1][1] > start) or (i < len(used) and used[i][0] < end)
        return hit and draws > 0

    def ranges(self, seed) -> list:
        """The recorded [start, end) ranges of ``seed`` (a copy)."""
        with self._lock:
            return [list(iv) for iv in self._used.get(seed, [])]

    def _add(self, seed, start, end):
        if end <= start:
            return
        used = self._used.setdefault(seed, [])
        i = bisect.bisect_left(used, [start, start])
        used.insert(i, [start, end])
        # Merge neighbours that touch or overlap (keeps a training loop at one interval).
        j = max(i - 1, 0)
        while j + 1 < len(used):
            if used[j][1] >= used[j + 1][0]:
                used[j][1] = max(used[j][1], used[j + 1][1])
                del used[j + 1]
            elif j >= i:
                break
            else:
                j += 1


_LEDGER = _Ledger()


class NoiseStream:
    """A Philox key and a position: hand it to every noisy component of a
    workflow (``seed=stream``) and each takes its own disjoint range.

    Args:
        seed: 64-bit key, or None for one from the OS.  The key is secret:
            whoever holds it can subtract the noise from a release.
        offset: first draw to use.  None continues the process-wide stream of
            ``seed`` (0 for a fresh one); an explicit offset reproduces an
            earlier run, and overlapping a range already drawn in this process
            warns with :class:`NoiseReuseWarning`.

    ``position`` is the next unused draw.  ``state()``/``NoiseStream.restore``
    carry (seed, position) into a *private* checkpoint; the object itself
    refuses to be pickled so that it never ends up in a published file.
    """

    def __init__(self, seed: int | None = None, offset: int | None = None):
        self._explicit = seed is not None
        self._seed = secrets.randbits(64) if seed is None else _validate.check_uint64(seed, "seed")
        # A view of the process-wide stream of an explicit seed has no position of its own.
        self._pos = None if (self._explicit and offset is None) else \
            (0 if offset is None else _validate.check_uint64(offset, "offset"))
        self._lock = threading.Lock()
        # Copied into a forked child with an explicit key: its next use warns.
        self._inherited = False
        # Its state handed out (state()): its later draws are recorded (take).
        self._exported = False
        _LIVE.add(self)

    def _forked(self) -> None:
        """In a forked child (os.register_at_fork): the parent and every child
        hold this key at this position, and each would draw the same noise
        (the fifth audit: a NeuroMixGDP made before a multiprocessing Pool
        released two neighbouring data sets whose difference gave record 0 to
        1.6e-15).  An OS key was never promised to be reproducible: the child
        draws its own.  An explicit key is the caller's: its first use in the
        child warns (NoiseReuseWarning)."""
        self._lock = threading.Lock()      # a copy of one held at the fork would never open
        if self._explicit:
            self._inherited = True
        else:
            self._seed = secrets.randbits(64)

    def _check_inherited(self) -> None:
        if self._inherited:
            self._inherited = False
            _warn_forked("a stream with an explicit key was copied into this forked process")

    @property
    def seed(self) -> int:
        self._check_inherited()
        return self._seed

    @property
    def position(self) -> int:
        return _LEDGER.next_free(self._seed) if self._pos is None else self._pos

    def take(self, draws: int) -> int:
        """Reserve the next ``draws`` draws; returns the first one."""
        draws = _validate.check_uint64(draws, "draws")
        self._check_inherited()
        if self._pos is None:
            if draws and self._seed in _LEDGER.forked:
                _LEDGER.forked.discard(self._seed)
                _warn_forked("an explicit seed the parent had drawn from continues its "
                             "stream in this forked process")
            if draws and self._seed not in _LEDGER.disk_checked:
                _check_earlier_runs(self._seed, draws)
            start = _LEDGER.take_next(self._seed, draws)
            _validate.check_draw_range(start, draws)
            return start
        with self._lock:
            start = self._pos
            _validate.check_draw_range(start, draws)
            self._pos = start + draws
        # A position of the caller's (an explicit offset, a restored
        # checkpoint: load_noise_state asks the ledger itself): this process
        # continues the key from here on, its later process-wide draws too.
        _LEDGER.disk_checked.add(self._seed)
        # An explicit key's draws are recorded, and an OS key's once its state
        # left the object (noise_state, state_dict): a checkpoint restores it
        # as an explicit key, and a second continuation in this process -- a
        # rollback, or a load while the first run goes on -- must meet what
        # the first drew (the fifth audit: repeated silently under OS keys).
        # A one-shot op's OS key is never recorded: no entry a call.
        if (self._explicit or self._exported) and _LEDGER.record(self._seed, start, draws):
            _warn_reuse(self._seed, start, draws)
        return start

    def state(self) -> dict:
        """``{"seed", "offset"}`` for a private checkpoint (never publish it)."""
        self._exported = True
        return {"seed": self._seed, "offset": self.position}

    @classmethod
    def restore(cls, state: dict) -> "NoiseStream":
        if not isinstance(state, dict) or not {"seed", "offset"} <= set(state):
            # A KeyError 'seed' named neither the argument nor the format (the
            # sixth audit); the values themselves are checked by the constructor.
            raise ValueError("state: expected NoiseStream.state()'s dict {'seed', 'offset'}, "
                             f"got {type(state).__name__}"
                             + (f" with keys {sorted(map(str, state))}"
                                if isinstance(state, dict) else ""))
        return cls(state["seed"], state["offset"])

    def __repr__(self):
        return f"NoiseStream(seed=<secret>, position={self.position})"

    def __reduce__(self):
        raise TypeError("NoiseStream holds the secret noise key and is never pickled; "
                        "keep NoiseStream.state() in a private checkpoint instead")


# Every live stream, so that a forked child can tell them apart from its parent's.
_LIVE: "weakref.WeakSet[NoiseStream]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for stream in list(_LIVE):
        stream._forked()
    # An int seed's stream lives in the ledger, not in an object: the parent's
    # draws before the fork put parent and child at one position (the seventh
    # audit: clip_and_noise(seed=S) drew identical noise in both, unwarned).
    _LEDGER._lock = threading.Lock()
    _LEDGER.forked = set(_LEDGER._used)


def _warn_forked(what: str) -> None:
    warnings.warn(
        f"NoiseStream: {what} (os.fork / a multiprocessing Pool with the fork start "
        "method): the parent and every child draw the same noise from here, and outputs "
        "released by two of them cancel it in their difference. Create the key in each "
        "process (seed=None), or give each process its own offset range",
        NoiseReuseWarning, stacklevel=5)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _warn_reuse(seed, start, draws):
    warnings.warn(f"seed/offset: draws [{start}, {start + draws}) of this key were already "
                  "used in this process (an explicit seed and offset given again, or a "
                  "checkpoint's stream continued twice: a rollback, or a second load while "
                  "the first run went on); the noise repeats, and two outputs drawn with it "
                  "cancel it in their difference (pass no offset to continue the stream, a "
                  "NoiseStream, or seed=None)", NoiseReuseWarning, stacklevel=4)


def _check_earlier_runs(seed, draws) -> None:
    """The first draw of an explicit key's process-wide stream in this
    process starts at 0 (or where this process left it): where the key
    ledger holds ranges of that key that a checkpointed run recorded (an
    earlier process), the noise repeats that run's -- a run redone with
    ``seed=S``, or resumed Opacus-style from state dicts without the noise
    state (the fifth audit: the accountant then reported 6 steps whose last
    3 reused the first 3's noise).  Warned, not refused: reproducing a run
    with its seed is legitimate as long as only one of the two is released.
    Read only where the ledger has a file (one scrypt tag a key a process)."""
    from . import _key_ledger
    _LEDGER.disk_checked.add(seed)
    start = _LEDGER.next_free(seed)
    try:
        found = _key_ledger.recorded_overlap(seed, start, draws)
    except (OSError, ValueError):
        # An unreadable or damaged ledger: a checkpoint refuses it by name;
        # a run that writes none is not stopped by it.
        return
    if found:
        warnings.warn(
            f"seed: draws [{start}, {start + draws}) of this explicit seed were used by an "
            f"earlier run that wrote a private checkpoint (the key ledger "
            f"{_key_ledger.ledger_dir()}): this run repeats that run's noise, and outputs of "
            "both cancel it in their difference. Resume a run with its checkpoint "
            "(load_checkpoint / load_state_dict continue the stream), or use a new key "
            "(seed=None)", NoiseReuseWarning, stacklevel=5)


def resolve(seed: Any = None, offset: Any = None) -> NoiseStream:
    """The stream a component draws from, from its ``seed``/``offset`` arguments."""
    if isinstance(seed, NoiseStream):
        if offset is not None:
            raise ValueError("offset: must be None when seed is a NoiseStream (the stream "
                             f"has its own position), got {offset!r}")
        return seed
    return NoiseStream(seed, offset)


def claim(seed: Any, offset: Any, draws: int) -> tuple[int, int]:
    """``(seed, offset)`` of an op that consumes ``draws`` draws (see the module)."""
    stream = resolve(seed, offset)
    return stream.seed, stream.take(draws)
