"""The ranges of noise drawn under each user-given key, across runs of the command line.

The in-process ledger of :mod:`ncdp_fast._stream` ends with the process: two
``ncdp-fast release --seed S`` runs would both start at draw 0, and two releases
with equal noise and groups cancel in their difference (the issue-23 audit
recovered a changed record to 1.8e-15).  This ledger lives in a directory of the
user's (``NCDP_FAST_LEDGER_DIR``; else ``$XDG_CACHE_HOME/ncdp_fast/key-ledger``;
else ``~/.cache/ncdp_fast/key-ledger``) and holds, per key, only the used
``[start, end)`` ranges:

* ``salt``: 32 random bytes, made once per directory (mode 0600);
* ``ranges.json``: ``{"version": 1, "salt": id, "keys": {tag: [[start, end], ...]}}``
  where ``tag = scrypt(seed, salt)`` -- the seed is never stored -- and ``id``
  the SHA-256 of the salt, so that a salt replaced (deleted, then made anew)
  is noticed instead of making every recorded tag unreachable.  Written,
  empty, before the salt is made: a salt without it, or recorded ranges
  without their salt, is a ledger that lost a file, and is refused.  The salt makes
  tags of one directory useless elsewhere (no precomputed table); scrypt
  (2**14 x 8 x 128 bytes = 16 MiB; 0.04-0.07 s a tag, docs/privacy.md) makes
  each guess of a seed costly for whoever reads the directory.  A low-entropy
  seed (42) is still found in a few guesses: use seeds drawn from the OS.
* ``lock``: ``fcntl.flock`` serialises concurrent runs (read, check, write).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path

from . import _stream, _validate

__all__ = ["ENV", "ledger_dir", "claim_range", "record_used", "claim_resume",
           "recorded_overlap"]

ENV = "NCDP_FAST_LEDGER_DIR"
_VERSION = 1


def ledger_dir() -> Path:
    """The directory of the key ledger (see the module)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "ncdp_fast" / "key-ledger"


@contextmanager
def _locked(directory: Path):
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)         # closing releases the lock


def _salt(directory: Path) -> bytes:
    path = directory / "salt"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        if e.errno != errno.EEXIST:
            raise
        salt = path.read_bytes()
        if len(salt) != 32:
            raise ValueError(f"key ledger: expected 32 bytes in {path}, got {len(salt)}; the "
                             "ledger is damaged (remove the directory only if no earlier run's "
                             "key will ever be used again)")
        return salt
    salt = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(salt)
        f.flush()
        os.fsync(f.fileno())
    return salt


def _tag(seed: int, salt: bytes) -> str:
    return hashlib.scrypt(seed.to_bytes(8, "little"), salt=salt, n=2 ** 14, r=8, p=1,
                          dklen=32).hex()


def _salt_id(salt: bytes) -> str:
    return hashlib.sha256(salt).hexdigest()


def _load(path: Path) -> tuple[dict, str | None]:
    """The recorded ranges by tag, and the id of the salt they were made with."""
    try:
        data = json.loads(path.read_text())
        keys, salt_id = data["keys"], data.get("salt")
        ok = data["version"] == _VERSION and isinstance(keys, dict) and \
            (salt_id is None or isinstance(salt_id, str)) and all(
            isinstance(r, list) and all(isinstance(iv, list) and len(iv) == 2 and
                                        all(type(v) is int for v in iv) for iv in r)
            and all(0 <= a < b <= 2 ** 64 for a, b in r)
            and all(r[i][1] < r[i + 1][0] for i in range(len(r) - 1))   # sorted, merged
            for r in keys.values())
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        # Starting afresh would let the next run reuse every recorded range.
        raise ValueError(f"key ledger: expected a version-{_VERSION} ledger in {path}, got an "
                         "unreadable file; refusing rather than forgetting the used ranges "
                         "(repair or remove it only if no earlier run's key will be used again)")
    return keys, salt_id


def _write(path: Path, keys: dict, salt_id: str | None) -> None:
    tmp = path.with_name(f"ranges.json.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"version": _VERSION, "salt": salt_id, "keys": keys}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _open_ledger(directory: Path) -> tuple[bytes, dict]:
    """The salt and the recorded ranges of ``directory`` (made empty when it is
    new); a ValueError for a ledger that lost one of its files. Deleting
    ``ranges.json`` or ``salt`` restarted every key at draw 0 before (the
    issue-35 audit then recovered a changed record to 1.4e-15)."""
    path, salt_path = directory / "ranges.json", directory / "salt"
    damaged = ("key ledger: {what} in {directory}; the record of the ranges earlier runs "
               "used is lost, and starting afresh would let this run reuse their noise. "
               "Refused: restore the file, or remove the directory only if no earlier run's "
               "key will ever be used again")
    if not path.exists():
        if salt_path.exists():
            raise ValueError(damaged.format(what="a salt without its ranges.json",
                                            directory=directory))
        _write(path, {}, None)          # before the salt: see the module
    keys, salt_id = _load(path)
    if not salt_path.exists() and keys:
        raise ValueError(damaged.format(what="recorded ranges without their salt",
                                        directory=directory))
    salt = _salt(directory)
    if salt_id is not None and salt_id != _salt_id(salt):
        raise ValueError(damaged.format(what="a salt other than the one its ranges were "
                                        "recorded with", directory=directory))
    return salt, keys


@contextmanager
def _key_ranges(seed: int, directory: Path | None):
    """``(ranges, tag, directory)`` of ``seed`` under the ledger's lock: the
    key's recorded ranges as a :class:`_stream._Ledger` (its interval
    arithmetic serves here too), written back when the block ends without an
    exception (a refusal records nothing)."""
    directory = ledger_dir() if directory is None else Path(directory)
    with _locked(directory):
        salt, keys = _open_ledger(directory)
        tag = _tag(seed, salt)
        used = _stream._Ledger({tag: keys.get(tag, [])})
        yield used, tag, directory
        keys[tag] = used.ranges(tag)
        _write(directory / "ranges.json", keys, _salt_id(salt))


def claim_range(seed: int, draws: int, offset: int | None = None, *,
                directory: Path | None = None) -> int:
    """Reserve ``draws`` draws of ``seed``'s stream for this run; returns the first.

    ``offset=None``: the end of the highest range any earlier run recorded (0 for
    a new key).  An explicit ``offset`` overlapping a recorded range is a
    ``ValueError`` naming ``--offset`` and the next free draw; nothing is recorded
    then.  The range is recorded before the caller draws, so a run that fails later
    still counts as having used it."""
    seed = _validate.check_uint64(seed, "--seed")
    draws = _validate.check_uint64(draws, "draws")
    if offset is not None:
        offset = _validate.check_uint64(offset, "--offset")
    with _key_ranges(seed, directory) as (used, tag, directory):
        if offset is None:
            start = used.next_free(tag)
        elif used.overlaps(tag, offset, draws):
            raise ValueError(
                f"--offset: expected a range of --seed's stream that no earlier run used, got "
                f"draws [{offset}, {offset + draws}), which overlap a range recorded in the key "
                f"ledger {directory}; the noise would repeat and the two outputs together reveal "
                f"the private data.  Pass no --offset to continue at draw "
                f"{used.next_free(tag)}, or a new --seed")
        else:
            start = offset
        _validate.check_draw_range(start, draws, "--offset")
        used.record(tag, start, draws)
    return start


def _update(seed: int, start: int, end: int, directory: Path | None) -> bool:
    """Record [start, end) of ``seed``'s stream as used (merged with what is
    there); True if it overlapped a recorded range."""
    with _key_ranges(seed, directory) as (used, tag, _):
        return used.record(tag, start, end - start)


def record_used(seed: int, start: int, end: int, *, directory: Path | None = None) -> None:
    """A private training checkpoint at draw ``end`` of ``seed``'s stream: the
    draws [start, end) its run used since its last checkpoint (or its start,
    or its resume) are recorded, so that a later resume from an earlier
    checkpoint of the same key is seen (:func:`claim_resume`)."""
    if end > start:
        _update(seed, start, end, directory)


def claim_resume(seed: int, position: int, *, directory: Path | None = None) -> bool:
    """A run resumes ``seed``'s stream at draw ``position`` (a checkpoint
    loaded): records the draw there as used and returns True if it already
    was -- the same checkpoint resumed before, or a later checkpoint of the
    key recorded (:func:`record_used`): the noise from ``position`` on was
    drawn by another continuation of the run."""
    return _update(seed, position, position + 1, directory)


def recorded_overlap(seed: int, start: int, draws: int, *,
                     directory: Path | None = None) -> bool:
    """Whether [start, start+draws) of ``seed``'s stream meets a range the
    ledger holds; read only, and False without a ledger file (nothing was
    ever recorded there: no salt is made, no tag computed)."""
    directory = ledger_dir() if directory is None else Path(directory)
    if not (directory / "ranges.json").exists():
        return False
    with _locked(directory):
        salt, keys = _open_ledger(directory)
        if not keys:
            return False
        tag = _tag(seed, salt)
        if tag not in keys:
            return False
        return _stream._Ledger({tag: keys[tag]}).overlaps(tag, start, max(draws, 1))
