r"""The directory layout of a release (what ``ncdp-fast release --out DIR`` writes):
:class:`DirectoryWriter` writes it, :func:`read_directory` reads and verifies it.

Layout of ``DIR``::

    x.npy          (T, d) released features, the input's dtype
    y.npy          (T, K) released noisy soft labels, the same dtype
    report.json    Released.metadata() (format version, sigmas, privacy report, ...)
    manifest.json  {"format": ..., "format_version": 1,
                    "files": {name: {"bytes": int, "sha256": hex}} for the three above,
                    "hmac": hex (optional)}

``manifest.json`` is written last: a directory without it is an incomplete (or
interrupted) write and is refused.  Its per-file SHA-256 is a *corruption* check
that names the file at fault; anyone can recompute it after editing a file.  The
optional ``hmac`` (HMAC-SHA256 with the publisher's secret key) is the ``.npz``
format's, over the same bytes (``report.json``'s text and both arrays' dtype, shape
and data; ``released._mac``): it is the authenticity check.

Writing is exclusive and leaves nothing half-written under a final name: the
writer holds ``DIR/.ncdp-release.lock`` (pid, host, process start time) from
:meth:`DirectoryWriter.open` until it is done, writes ``<name>.part`` files and
renames them when all are complete (manifest last; an overwrite removes the old
manifest first).  Any failure removes the ``.part`` files and the lock
(:meth:`DirectoryWriter.abort`, also what :func:`abort_all` calls on SIGTERM).  A
process killed outright leaves them; the next :meth:`~DirectoryWriter.open` finds
the lock of a process that no longer runs, removes its leftovers and says so, and
refuses a lock whose process is alive (or on another host: it cannot tell).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import socket
from pathlib import Path

import numpy as np

from .._validate import check_bool

__all__ = ["DirectoryWriter", "read_directory", "abort_all", "FILES", "MANIFEST", "LOCK"]

FILES = ("x.npy", "y.npy", "report.json")
MANIFEST = "manifest.json"
LOCK = ".ncdp-release.lock"
FORMAT = "ncdp_fast NeuroMixGDP release directory"
DIR_FORMAT_VERSION = 1
PART = ".part"

_ACTIVE: set = set()       # open writers, for abort_all (signal handlers)


def _error(text):
    from .released import ReleaseFileError      # released.py imports this module
    return ReleaseFileError(text)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), which
    tells a live process from a later one given the same pid; None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Field 22; the command name (field 2) may hold spaces: count after ')'.
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's process: it exists
        pass
    now = _start_time(pid)
    return start is None or now is None or now == start


def _file_entry(path: Path) -> dict:
    with open(path, "rb") as f:
        return dict(bytes=os.fstat(f.fileno()).st_size,
                    sha256=hashlib.file_digest(f, "sha256").hexdigest())


class DirectoryWriter:
    """Rank 0's writing of one release directory (see the module docstring).

    ``open()`` checks ``out`` and takes the lock: it raises ``FileExistsError`` when
    ``out`` holds a release and ``overwrite`` is false, or another live process
    holds the lock; ``NotADirectoryError`` when ``out`` is a file.  Leftovers of a
    dead writer are removed and described in :attr:`notes` (lines for the user).
    Then ``array(name, dtype, shape)`` / ``text(name, s)`` create the ``.part``
    files, ``commit(meta_s, key)`` hashes them, writes the manifest and renames
    everything into place; ``abort()`` (idempotent) removes what is partial.
    ``key``: the publisher's HMAC secret (bytes, at least 16), or None.  ``name``
    and ``overwrite_hint``: how messages call the directory and the fix.
    """

    def __init__(self, out, *, overwrite: bool = False, name: str = "out_dir",
                 overwrite_hint: str = "overwrite=True (ncdp-fast release: --overwrite)"):
        self.out = Path(out)
        self.overwrite = check_bool(overwrite, "overwrite")     # 'no' was true
        self.name, self.hint = name, overwrite_hint       # for messages
        self.notes: list[str] = []
        self._parts: list[Path] = []
        self._maps: dict = {}
        self._locked = False
        self._created = False

    # ------------------------------------------------------------------ open
    def open(self) -> "DirectoryWriter":
        out = self.out
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"{self.name}: {out} exists and is not a directory; expected a "
                                     "directory (created if absent)")
        self._created = not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"{self.name}: cannot create the directory {out} "
                          f"({e.strerror})") from None
        self._clear_leftovers()
        clash = [n for n in (*FILES, MANIFEST) if (out / n).exists()]
        if clash and not self.overwrite:
            raise FileExistsError(f"{self.name}: {out} already holds a release "
                                  f"({', '.join(clash)}); pass {self.hint} to replace it, or "
                                  "choose another directory")
        me = dict(pid=os.getpid(), host=socket.gethostname(), start=_start_time(os.getpid()))
        try:
            fd = os.open(out / LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise FileExistsError(f"{self.name}: {out} is being written by another run (it took "
                                  f"{out / LOCK} a moment ago); wait for it, or choose another "
                                  "directory") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        self._locked = True
        _ACTIVE.add(self)
        return self

    def _clear_leftovers(self):
        """Remove the ``.part`` files and lock of a writer that no longer runs (noted in
        :attr:`notes`); refuse a lock that a live process, or another host, may hold."""
        out, lock = self.out, self.out / LOCK
        who = ""
        if lock.exists():
            try:
                held = json.loads(lock.read_text())
                pid, host, start = int(held["pid"]), str(held["host"]), held.get("start")
            except (OSError, ValueError, KeyError, TypeError):
                raise FileExistsError(f"{self.name}: {lock} is unreadable; if no ncdp-fast "
                                      "release is writing this directory, delete it") from None
            if host != socket.gethostname() or _alive(pid, start):
                raise FileExistsError(
                    f"{self.name}: {out} is being written by pid {pid} on host {host} ({lock}); "
                    "wait for it to finish, or if that process no longer exists delete the lock")
            who = f" (pid {pid} on this host, no longer running)"
        parts = sorted(p.name for p in out.glob("*" + PART)
                       if p.name[:-len(PART)] in (*FILES, MANIFEST))
        for name in parts:
            (out / name).unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
        if parts or who:
            self.notes.append(f"removed {', '.join(parts) or 'nothing but its lock'} left in "
                              f"{out} by an interrupted run{who}")

    # ------------------------------------------------------------------ write
    def _part(self, name: str) -> Path:
        if name not in FILES:
            raise ValueError(f"name: expected one of {FILES}, got {name!r}")
        if not self._locked:
            raise RuntimeError("DirectoryWriter: open() it first")
        p = self.out / (name + PART)
        self._parts.append(p)
        return p

    def array(self, name: str, dtype, shape) -> np.memmap:
        """A writable (shape) memory map of ``<name>.part`` (an .npy file)."""
        mm = np.lib.format.open_memmap(str(self._part(name)), mode="w+", dtype=dtype,
                                       shape=tuple(shape))
        self._maps[name] = mm
        return mm

    def text(self, name: str, s: str):
        self._part(name).write_text(s, encoding="utf-8")

    def commit(self, meta_s: str, key: bytes | None = None) -> Path:
        """Flush, hash, write the manifest, rename into place, release the lock.
        ``meta_s`` must be the text given to ``text("report.json", ...)``."""
        from .released import _check_key, _mac
        missing = [n for n in FILES if self.out / (n + PART) not in self._parts]
        if missing:
            raise RuntimeError(f"DirectoryWriter.commit: {missing} not written")
        for mm in self._maps.values():
            mm.flush()
        manifest = dict(format=FORMAT, format_version=DIR_FORMAT_VERSION,
                        files={n: _file_entry(self.out / (n + PART)) for n in FILES})
        if key is not None:
            manifest["hmac"] = _mac(_check_key(key), meta_s, self._maps["x.npy"],
                                    self._maps["y.npy"])
        self._maps.clear()
        mp = self.out / (MANIFEST + PART)
        self._parts.append(mp)
        mp.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
        # No manifest while the data files are being swapped: an interruption here
        # leaves a directory that read_directory calls incomplete, never a mix.
        (self.out / MANIFEST).unlink(missing_ok=True)
        for n in (*FILES, MANIFEST):
            os.replace(self.out / (n + PART), self.out / n)
        self._parts.clear()
        self._unlock()
        return self.out

    # ------------------------------------------------------------------ failure
    def abort(self):
        """Remove this writer's ``.part`` files and its lock (idempotent; called on
        any failure, and from a SIGTERM handler through :func:`abort_all`)."""
        self._maps.clear()
        for p in list(self._parts):
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass
        self._parts.clear()
        if self._unlock() and self._created:
            try:
                self.out.rmdir()        # made by open() and still empty: leave no trace
            except OSError:
                pass

    def _unlock(self) -> bool:
        """Release the lock; True if this call did."""
        held, self._locked = self._locked, False
        if held:
            try:
                (self.out / LOCK).unlink(missing_ok=True)
            except OSError:
                pass
        _ACTIVE.discard(self)
        return held


def abort_all():
    """Abort every open :class:`DirectoryWriter` of this process."""
    for w in list(_ACTIVE):
        w.abort()


# ---------------------------------------------------------------------- reading

def _read_checked(path: Path, entry: dict) -> bytearray:
    """The bytes of ``path``, its size and SHA-256 checked against ``entry`` (one
    read: the bytes hashed are the bytes returned)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise _error(f"{path}: missing (listed in {MANIFEST})") from None
    if size != entry["bytes"]:
        raise _error(f"{path}: {size} bytes, but {MANIFEST} records {entry['bytes']}: "
                     f"truncated or altered")
    buf = bytearray(size)
    with open(path, "rb") as f:
        if f.readinto(buf) != size:
            raise _error(f"{path}: shorter than its {size} bytes while being read")
    if hashlib.sha256(buf).hexdigest() != entry["sha256"]:
        raise _error(f"{path}: SHA-256 mismatch with {MANIFEST}: altered or corrupted "
                     "after it was written")
    return buf


_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0}


def _parse_npy(path: Path, buf: bytearray) -> np.ndarray:
    """The array an .npy file's bytes hold, over ``buf`` itself (no copy)."""
    try:
        head = io.BytesIO(memoryview(buf)[:min(len(buf), 1 << 16)])
        version = np.lib.format.read_magic(head)
        if version not in _HEADERS:
            raise ValueError(f"format version {version}, expected 1.0 or 2.0")
        shape, fortran, dtype = _HEADERS[version](head)
        if dtype.hasobject:
            raise ValueError("an object array")
        count = int(np.prod(shape))
        if head.tell() + count * dtype.itemsize != len(buf):
            raise ValueError(f"its header says {shape} {dtype}, but it holds "
                             f"{len(buf) - head.tell()} data bytes")
        a = np.frombuffer(buf, dtype=dtype, count=count, offset=head.tell())
    except ValueError as exc:
        raise _error(f"{path}: not a valid .npy ({exc})") from exc
    return a.reshape(shape, order="F" if fortran else "C")


def read_directory(path) -> tuple[np.ndarray, np.ndarray, str, str | None]:
    """``(x, y, report.json's text, hmac or None)`` of a release directory, every
    file's size and SHA-256 verified against the manifest.  A problem is a
    ``ReleaseFileError`` naming the file."""
    path = Path(path)
    mpath = path / MANIFEST
    try:
        text = mpath.read_text(encoding="utf-8")
    except FileNotFoundError:
        lock = " (a write was interrupted: its lock is still there)" \
            if (path / LOCK).exists() else ""
        raise _error(f"{mpath}: missing; {path} is not a complete release directory{lock} "
                     f"(ncdp-fast release writes {MANIFEST} last)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _error(f"{mpath}: unreadable ({exc})") from exc
    try:
        man = json.loads(text)
        if not isinstance(man, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise _error(f"{mpath}: not a manifest ({exc})") from exc
    if man.get("format") != FORMAT or man.get("format_version") != DIR_FORMAT_VERSION:
        raise _error(f"{mpath}: format {man.get('format')!r} version "
                     f"{man.get('format_version')!r}, expected {FORMAT!r} version "
                     f"{DIR_FORMAT_VERSION}")
    files = man.get("files")
    ok = isinstance(files, dict) and set(files) == set(FILES) and all(
        isinstance(e, dict) and set(e) == {"bytes", "sha256"} and isinstance(e["bytes"], int)
        and isinstance(e["sha256"], str) for e in files.values())
    if not ok or set(man) - {"format", "format_version", "files", "hmac"}:
        raise _error(f"{mpath}: expected entries format, format_version, files (bytes and "
                     f"sha256 of each of {', '.join(FILES)}) and optionally hmac")
    mac = man.get("hmac")
    if mac is not None and not isinstance(mac, str):
        raise _error(f"{mpath}: hmac is not a string")
    x, y = (_parse_npy(path / n, _read_checked(path / n, files[n])) for n in ("x.npy", "y.npy"))
    raw = _read_checked(path / "report.json", files["report.json"])
    try:
        meta_s = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _error(f"{path / 'report.json'}: not UTF-8 text ({exc})") from exc
    return x, y, meta_s, mac
