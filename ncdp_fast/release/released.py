r"""The published output of a NeuroMixGDP release and its file: :class:`Released`,
``save`` / ``load`` of the ``.npz`` layout (SHA-256 corruption check, optional
HMAC-SHA256 authenticity), ``load`` of the directory that ``ncdp-fast release``
writes (its layout: :mod:`._directory`; the same HMAC), and :class:`ReleaseFileError` for every file that cannot
be trusted.  No noise key is ever written or pickled (docs/privacy.md)."""
from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import io
import json
import math
import os
import zipfile
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._arrays import to_numpy
from .._stream import SecretSlot
from .report import PrivacyReport, privacy_report

__all__ = ["Released", "ReleaseFileError", "FORMAT_VERSION", "load"]

#: Version of the ``.npz`` layout written by :meth:`Released.save`.
FORMAT_VERSION = 1


@dataclass(frozen=True, eq=False)   # holds arrays: identity comparison only
class Released:
    r"""The output of :meth:`NeuroMixGDP.release`: what may be published, plus the
    metadata needed to check the privacy claim later.

    Attributes:
        x: (T, d) released features, the input's dtype and array type/device.
        y: (T, K) released noisy soft labels (entries can be negative or > 1).
        sigma_x, sigma_y: noise multipliers; the noise stds are ``noise_std_x =
            sigma_x * clip_x / m`` and ``noise_std_y = sigma_y * clip_y / m``.
        report: :class:`PrivacyReport` (epsilon under CLT and PLD, delta, mu, ...).
        mixup_degree: m (float).  num_samples: T.  num_classes: K.
        clip_x, clip_y: C_x, C_y (test features must be clipped with the same C_x).

    The noise key (Philox seed and offset) is *not* part of a release: from it
    and the file anyone could regenerate the noise and the groups and solve
    for every private row (docs/privacy.md).  It is kept only on the object
    returned by :meth:`NeuroMixGDP.release`, never pickled or saved with it;
    :meth:`save_audit_key` writes it to a separate, private file on request.
    """
    x: Any
    y: Any
    sigma_x: float
    sigma_y: float
    report: PrivacyReport
    mixup_degree: float
    num_samples: int
    num_classes: int
    clip_x: float
    clip_y: float
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc)
                         .strftime("%Y-%m-%dT%H:%M:%SZ"))
    # Init-only and kept off the instance's __dict__ (_stream.SecretSlot): not a
    # field, so never in repr, ==, dataclasses.asdict/astuple, vars(), pickles
    # (a pickled release is a published release) or copies.
    _noise_key: InitVar[Any] = None

    def __post_init__(self, _noise_key):
        _NOISE_KEY.put(self, _noise_key)

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def save_audit_key(self, path, *, overwrite: bool = False) -> Path:
        """Write ``{"seed", "offset", "draws"}`` of this release's noise to a JSON
        file -- a PRIVATE audit copy: whoever holds it and the release can
        reconstruct the private rows.  Never publish it."""
        if self._noise_key is None:
            raise ValueError("this release carries no noise key (loaded or unpickled "
                             "releases never do)")
        path = Path(path)
        if path.exists() and not overwrite:
            raise FileExistsError(f"path: {path} exists; pass overwrite=True to replace it")
        path.write_text(json.dumps(dict(self._noise_key, warning="PRIVATE: this key and the "
                                        "release reveal the private data"), indent=1))
        return path

    @property
    def noise_std_x(self) -> float:
        return self.sigma_x * self.clip_x / self.mixup_degree

    @property
    def noise_std_y(self) -> float:
        return self.sigma_y * self.clip_y / self.mixup_degree

    @property
    def epsilon(self) -> float:
        """PLD epsilon (rigorous upper bound) of this release."""
        return self.report.epsilon_pld

    @property
    def delta(self) -> float:
        return self.report.delta

    def metadata(self) -> dict:
        """JSON-serialisable description (everything but x and y)."""
        return dict(format_version=FORMAT_VERSION, sigma_x=self.sigma_x, sigma_y=self.sigma_y,
                    report=self.report.as_dict(), mixup_degree=self.mixup_degree,
                    num_samples=self.num_samples, num_classes=self.num_classes,
                    clip_x=self.clip_x, clip_y=self.clip_y, created=self.created)

    def recompute_report(self) -> PrivacyReport:
        """Recompute epsilon (CLT and PLD) from the stored noise and sampling parameters
        alone -- the check a reader of a saved release can run."""
        r = self.report
        return privacy_report(sigma=r.noise_multiplier, epsilon=r.epsilon_target,
                              delta=r.delta, accountant=r.accountant,
                              class_rates=None if r.class_rates is None
                              else np.array(r.class_rates),
                              n=r.n, m=r.mixup_degree, T=r.num_samples, lam=r.lam,
                              clip_x=r.clip_x, clip_y=r.clip_y,
                              interval=r.value_discretization_interval)

    # ------------------------------------------------------------------ persistence
    def save(self, path, *, overwrite: bool = False, key: bytes | None = None) -> Path:
        """Write an ``.npz``: arrays ``x``, ``y``, ``metadata`` (JSON), ``sha256``
        and, with ``key``, ``hmac``.  No noise key is written.

        ``sha256`` (over the metadata and both arrays' dtype, shape and bytes) is a
        *corruption* check only: anyone can recompute it after editing the file.
        For authenticity pass ``key`` (bytes, kept secret by the publisher): an
        HMAC-SHA256 that :meth:`load` verifies with the same key.  Refuses to
        replace an existing file unless ``overwrite=True`` (written to a temporary
        file and renamed, so a crash never leaves half a file under ``path``).
        """
        path = Path(path)
        if path.exists() and not overwrite:
            raise FileExistsError(f"path: {path} exists; pass overwrite=True to replace it")
        x, y = to_numpy(self.x), to_numpy(self.y)
        meta = json.dumps(self.metadata(), sort_keys=True)
        entries = dict(x=x, y=y, metadata=np.frombuffer(meta.encode(), dtype=np.uint8),
                       sha256=np.frombuffer(_digest(meta, x, y).encode(), dtype=np.uint8))
        if key is not None:
            entries["hmac"] = np.frombuffer(_mac(_check_key(key), meta, x, y).encode(),
                                            dtype=np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **entries)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
        if not overwrite and path.exists():
            tmp.unlink()
            raise FileExistsError(f"path: {path} appeared while writing; not replaced")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path, *, key: bytes | None = None) -> "Released":
        """Read a release written by :meth:`save` (an ``.npz``) or by ``ncdp-fast
        release --out DIR`` / :meth:`ShardedRelease.save` (a directory: x.npy, y.npy,
        report.json, manifest.json); NumPy arrays.

        Every problem is a :class:`ReleaseFileError` (a ValueError) naming it: a
        truncated or corrupt file, missing or extra entries or metadata fields, an
        unknown format version, a checksum mismatch (in a directory: the file at
        fault, from the manifest's per-file SHA-256), a directory without its
        manifest (an interrupted write), arrays whose shapes disagree with the
        metadata, a stated epsilon that the stored noise and sampling parameters do
        not give (the report is recomputed), and -- with ``key`` (the publisher's
        secret, bytes) -- a missing or wrong HMAC.
        """
        path = Path(path)
        if path.is_dir():
            from ._directory import read_directory
            x, y, meta_s, mac = read_directory(path)
        else:
            x, y, meta_s, mac = _read_npz(path)
        if key is not None:
            if mac is None:
                raise ReleaseFileError(f"{path}: no HMAC in the release, but a key was given: "
                                       "it was not signed (or the signature was removed)")
            if not hmac.compare_digest(mac, _mac(_check_key(key), meta_s, x, y)):
                raise ReleaseFileError(f"{path}: HMAC mismatch: not signed with this key, or "
                                       "altered after signing")
        return _from_metadata(path, meta_s, x, y)


def load(path, *, key: bytes | None = None) -> Released:
    """:meth:`Released.load`: a release ``.npz`` or ``ncdp-fast release`` directory."""
    return Released.load(path, key=key)


def _read_npz(path: Path):
    """``(x, y, metadata text, hmac or None)`` of an ``.npz`` release, its SHA-256
    over the metadata and both arrays verified."""
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):     # a lone .npy gives an array
            raise ReleaseFileError(f"{path}: a single array, not a release (an .npz written "
                                   "by Released.save, or a directory written by ncdp-fast "
                                   "release)")
        with z:
            files = set(z.files)
            missing = {"x", "y", "metadata", "sha256"} - files
            extra = files - {"x", "y", "metadata", "sha256", "hmac"}
            if missing or extra:
                raise ReleaseFileError(f"{path}: not a NeuroMixGDP release (missing "
                                       f"{sorted(missing)}, unexpected {sorted(extra)})")
            x, y = z["x"], z["y"]
            meta_s = z["metadata"].tobytes().decode()
            digest = z["sha256"].tobytes().decode()
            mac = z["hmac"].tobytes().decode() if "hmac" in files else None
    except (zipfile.BadZipFile, EOFError, OSError, KeyError, ValueError) as exc:
        if isinstance(exc, (FileNotFoundError, ReleaseFileError)):
            raise
        raise ReleaseFileError(f"{path}: truncated or corrupt release file ({exc})") from exc
    if _digest(meta_s, x, y) != digest:
        raise ReleaseFileError(f"{path}: SHA-256 mismatch: the arrays or the metadata "
                               "were altered or corrupted")
    return x, y, meta_s, mac


class ReleaseFileError(ValueError):
    """A release file that cannot be trusted or read (see :meth:`Released.load`)."""


# Added after the class is made: a property named like the InitVar would be its default.
_NOISE_KEY = SecretSlot()
Released._noise_key = property(lambda self: _NOISE_KEY.get(self),
                               doc="The secret noise key of this release (None when loaded).")

_META_FIELDS = {"format_version", "sigma_x", "sigma_y", "report", "mixup_degree",
                "num_samples", "num_classes", "clip_x", "clip_y", "created"}


def _from_metadata(path, meta_s, x, y) -> Released:
    try:
        meta = json.loads(meta_s)
    except json.JSONDecodeError as exc:
        raise ReleaseFileError(f"{path}: metadata is not JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise ReleaseFileError(f"{path}: metadata is not a JSON object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ReleaseFileError(f"{path}: format_version {meta.get('format_version')!r}, "
                               f"expected {FORMAT_VERSION}")
    if set(meta) != _META_FIELDS:
        raise ReleaseFileError(f"{path}: metadata fields missing {sorted(_META_FIELDS - set(meta))}"
                               f", unexpected {sorted(set(meta) - _META_FIELDS)}")
    rep = meta["report"]
    fields = {f for f in PrivacyReport.__dataclass_fields__}
    if not isinstance(rep, dict) or set(rep) != fields:
        got = set(rep) if isinstance(rep, dict) else set()
        raise ReleaseFileError(f"{path}: report fields missing {sorted(fields - got)}, "
                               f"unexpected {sorted(got - fields)}")
    rep = dict(rep)
    if rep["class_rates"] is not None:
        rep["class_rates"] = tuple(rep["class_rates"])
    try:
        rel = Released(x=x, y=y, sigma_x=float(meta["sigma_x"]), sigma_y=float(meta["sigma_y"]),
                       report=PrivacyReport(**rep), mixup_degree=float(meta["mixup_degree"]),
                       num_samples=int(meta["num_samples"]),
                       num_classes=int(meta["num_classes"]), clip_x=float(meta["clip_x"]),
                       clip_y=float(meta["clip_y"]), created=str(meta["created"]))
    except (TypeError, ValueError) as exc:
        raise ReleaseFileError(f"{path}: malformed metadata value ({exc})") from exc
    r, T, K = rel.report, rel.num_samples, rel.num_classes
    if x.ndim != 2 or x.shape[0] != T or y.shape != (T, K):
        raise ReleaseFileError(f"{path}: arrays x {x.shape}, y {y.shape} do not match the "
                               f"metadata (num_samples {T}, num_classes {K})")
    if (r.num_samples, r.mixup_degree, r.clip_x, r.clip_y) != \
            (T, rel.mixup_degree, rel.clip_x, rel.clip_y):
        raise ReleaseFileError(f"{path}: the report's num_samples/mixup_degree/clip do not "
                               "match the release's")
    if r.accountant == "none" or not math.isfinite(r.noise_multiplier):
        raise ReleaseFileError(f"{path}: the release is not private (no noise)")
    if not math.isclose(1 / rel.sigma_x ** 2 + 1 / rel.sigma_y ** 2,
                        1 / r.noise_multiplier ** 2, rel_tol=1e-9):
        raise ReleaseFileError(f"{path}: sigma_x, sigma_y do not give the report's noise "
                               "multiplier")
    try:
        again = rel.recompute_report()
    except (TypeError, ValueError) as exc:
        raise ReleaseFileError(f"{path}: the report's parameters are invalid ({exc})") from exc
    for name in ("epsilon_pld", "epsilon_clt", "epsilon_paper"):
        a, b = getattr(r, name), getattr(again, name)
        if (a is None) != (b is None) or (a is not None and not math.isclose(a, b,
                                                                            rel_tol=1e-6)):
            raise ReleaseFileError(f"{path}: stated {name} = {a!r}, but the stored noise and "
                                   f"sampling parameters give {b!r}: refused")
    return rel


def _check_key(key) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise TypeError(f"key: expected a secret of at least 16 bytes, got "
                        f"{type(key).__name__}" + (f" of {len(key)} bytes"
                                                   if isinstance(key, (bytes, bytearray)) else ""))
    return bytes(key)


def _mac(key: bytes, meta: str, x: np.ndarray, y: np.ndarray) -> str:
    h = hmac.new(key, digestmod=hashlib.sha256)
    _feed(h, meta, x, y)
    return h.hexdigest()


def _feed(h, meta: str, x: np.ndarray, y: np.ndarray):
    h.update(meta.encode())
    for a in (x, y):
        h.update(f"|{a.dtype.str}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).data)


def _digest(meta: str, x: np.ndarray, y: np.ndarray) -> str:
    h = hashlib.sha256()
    _feed(h, meta, x, y)
    return h.hexdigest()

