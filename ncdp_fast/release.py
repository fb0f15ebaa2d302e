r"""NeuroMixGDP: private release of mixed-up features, a classifier for the released
data, and a membership-inference audit.

Paper: ``shared/seeds/002_1ce43e1ce6039d97.txt`` (Li, Cao & Yao, "NeuroMixGDP") --
Algorithm 1 with Procedures 1-2, Theorem 3.1, Section 3.2, Appendix C (training on
noisy mixed labels), Appendix E.2 (hierarchical sampling), Section 5 (membership
inference).  See ``docs/release.md``.

Mechanism (Algorithm 1).  Features are clipped, ``x_i <- x_i / max(1, ||x_i||/C_x)``,
labels are one-hot ``e_{y_i}`` scaled to norm ``min(1, C_y)``.  Each of the T released
rows averages a random group I_t, divided by the *nominal* mixup degree m, and adds
Gaussian noise:

.. math::
    \tilde x_t = \frac1m\sum_{i\in I_t} x_i + N\big(0, (C_x\sigma_x/m)^2 I_d\big),\qquad
    \tilde y_t = \frac1m\sum_{i\in I_t} y_i + N\big(0, (C_y\sigma_y/m)^2 I_K\big).

Poisson sampling (Procedure 1): every example joins I_t with probability m/n.
Hierarchical sampling (HS, Procedure 2): class k is kept with probability p_k, then
each example of a kept class joins with probability q_k = m/(n p_k).  The mixing and
the noise are :func:`ncdp_fast.mix` (one pass, no T x n mask).

Privacy accounting (add/remove-one neighbours).  One row, conditioned on the record
being in I_t, is a Gaussian mechanism with noise multiplier sigma,
:math:`1/\sigma^2 = 1/\sigma_x^2 + 1/\sigma_y^2` (proof of Theorem E.1; the row's
sensitivities are C_x/m and min(1, C_y)/m <= C_y/m).

* Poisson: T compositions of the Poisson(m/n)-subsampled Gaussian; calibrated and
  reported by :func:`ncdp_fast.privacy.neuromix_noise` (CLT of Theorem 3.1 and PLD).
* HS: the paper's Proposition E.3 bounds one row by the Poisson rate
  :math:`\max_k p_k q_k = m/n`.  Its proof writes the row on S' as a mixture in which
  the new record's inclusion is independent of the other selections; under HS it is
  not -- the record of class k can only be chosen in rows that keep class k, and
  whether a row kept class k shows in its label mean (about 1/(K p_k) on coordinate
  k, far above the label noise at the paper's settings).  We account for the release
  with the class selection ``a`` *revealed*: a row is, with probability p_k, a
  Poisson(q_k)-subsampled Gaussian, and otherwise independent of the record.
  Revealing a only adds information, so this is a rigorous bound on HS, and it is
  nearly tight whenever a can be read off the output.  Per row the privacy loss
  distribution is the mixture :math:`(1-p_k)\,\delta_0 + p_k\,\mathrm{PLD}_{q_k}`
  (hockey-stick divergences are linear in a revealed mixture), composed T times and
  maximised over classes (smallest p_k is worst).  Its CLT analogue is
  :math:`\mu = q_k\sqrt{T p_k (e^{1/\sigma^2}-1)} = (m/n)\sqrt{T/p_k}\,
  \sqrt{e^{1/\sigma^2}-1}`, i.e. Theorem 3.1 with :math:`\mu^2` replaced by
  :math:`\mu^2 p_{\min}`; at p = 3/10 HS needs noticeably more noise than the paper
  uses.  The report also carries ``epsilon_paper``, the (CLT) epsilon that
  Proposition E.3 would claim for the same noise, so the two can be compared.

The dataset size n.  Theorem 3.1 uses n in the sampling rate m/n and in sigma; like
the paper (and DP-SGD practice, q = B/n), n is treated as public: the report is a
guarantee for neighbours of the given size n, the realised group sizes are never
released, and T defaults to n.  Publishing n (or a bound) is the data holder's
decision; see docs/release.md.

Layer 3 code (algorithms): validates, calibrates, calls the op ``mix``.
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import hmac
import io
import json
import math
import os
import zipfile
from dataclasses import asdict, dataclass, field
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np

from . import _backend, _stream
from ._mix import mix
from .privacy import (DEFAULT_VALUE_DISCRETIZATION_INTERVAL, dp_to_gdp, epsilon_poisson_gaussian,
                      gdp_to_dp, neuromix_noise, optimal_mixup_degree, poisson_gdp_mu)
from .privacy._validate import (check_choice, check_delta, check_positive,
                                import_dp_accounting)

__all__ = ["NeuroMixGDP", "Released", "PrivacyReport", "SoftLabelClassifier",
           "membership_auc", "membership_losses", "hs_epsilon", "hs_noise_multiplier",
           "FORMAT_VERSION", "ReleaseFileError"]

#: Version of the ``.npz`` layout written by :meth:`Released.save`.
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- accounting

def _lam_split(sigma: float, lam: float) -> tuple[float, float]:
    # 1/sigma_x^2 + 1/sigma_y^2 = 1/sigma^2 with lam = sigma_y / sigma_x (Theorem 3.1).
    s = math.sqrt(lam * lam + 1.0)
    return sigma * s / lam, sigma * s


def _hs_rates(class_rates, m: float, n: int) -> tuple[float, float]:
    """(p_min, q at p_min): the worst class (smallest p_k has the largest q_k)."""
    rates = np.asarray(class_rates, dtype=np.float64)
    if rates.ndim != 1 or rates.size == 0 or not np.all((rates > 0) & (rates <= 1)):
        raise ValueError(f"class_rates: expected a non-empty list of class keep probabilities "
                         f"in (0, 1], got {np.asarray(class_rates).tolist()!r}")
    p = float(np.min(rates))
    return p, m / (n * p)


@functools.lru_cache(maxsize=256)
def _hs_pld_epsilon(sigma: float, p: float, q: float, steps: int, delta: float,
                    interval: float) -> float:
    dpa = import_dp_accounting()
    pld_mod = dpa.pld.privacy_loss_distribution
    one = pld_mod.from_gaussian_mechanism(sigma, value_discretization_interval=interval,
                                          sampling_prob=q, pessimistic_estimate=True)
    if p < 1.0:
        # Revealed class selection: with probability 1 - p the row is independent of
        # the record (privacy loss exactly 0).
        one = one.compute_mixture(pld_mod.identity(interval, pessimistic_estimate=True), p)
    return float(one.self_compose(steps).get_epsilon_for_delta(delta))


def hs_epsilon(noise_multiplier, *, mixup_degree, n, num_samples, class_rates, delta,
               accountant="pld",
               value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION_INTERVAL) -> float:
    r"""epsilon of NeuroMixGDP-HS (hierarchical sampling) with noise multiplier sigma.

    Accountant: ``"pld"`` -- per row the mixture :math:`(1-p)\delta_0 + p\,
    \mathrm{PLD}(\text{Poisson}(q)\text{-subsampled Gaussian}(\sigma))` with the worst
    class p = min p_k, q = m/(n p), composed T times (dp-accounting, pessimistic
    connect-the-dots; an upper bound for the release with the class selection
    revealed, hence for HS).  ``"clt"`` -- its GDP central-limit analogue
    :math:`\mu = q\sqrt{T p (e^{1/\sigma^2}-1)}` converted by Lemma D.3 (an
    approximation).  With all p_k = 1 both reduce to Poisson sampling at rate m/n.
    Neighbouring relation: add/remove one record; n public.

    Args:
        noise_multiplier: sigma > 0 with 1/sigma^2 = 1/sigma_x^2 + 1/sigma_y^2.
        mixup_degree: m > 0.  n: dataset size.  num_samples: T rows.
        class_rates: (K,) class keep probabilities p_k in (0, 1] with m/(n p_k) <= 1.
        delta: in (0, 1).
    """
    s = check_positive("noise_multiplier", noise_multiplier)
    d = check_delta(delta)
    check_choice("accountant", accountant, ("pld", "clt"))
    p, q = _hs_rates(np.asarray(class_rates, dtype=np.float64), float(mixup_degree), int(n))
    if not (0 < q <= 1):
        raise ValueError(f"class_rates: q = m/(n p_min) = {q!r} must be in (0, 1]")
    T = int(num_samples)
    if accountant == "clt":
        mu = q * math.sqrt(T * p * math.expm1(1.0 / (s * s)))
        return gdp_to_dp(mu, d) if math.isfinite(mu) else math.inf
    return _hs_pld_epsilon(s, p, q, T, d, float(value_discretization_interval))


def hs_noise_multiplier(epsilon, delta, *, mixup_degree, n, num_samples, class_rates,
                        accountant="clt", epsilon_rtol=1e-3,
                        value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION_INTERVAL
                        ) -> float:
    r"""Smallest sigma (to tolerance) with :func:`hs_epsilon` <= epsilon.

    ``"clt"``: closed form :math:`\sigma = 1/\sqrt{\ln(1 + \mu^2 p\, n^2/(m^2 T))}`,
    :math:`\mu` = ``dp_to_gdp(epsilon, delta)``, p = min p_k (Theorem 3.1 with
    :math:`\mu^2 \to \mu^2 p`).  ``"pld"``: starts there, brackets geometrically and
    bisects on log sigma until ``(1 - epsilon_rtol) * epsilon <= eps(sigma) <= epsilon``
    under the PLD accountant; the returned sigma always meets the target.
    """
    e = check_positive("epsilon", epsilon)
    d = check_delta(delta)
    check_choice("accountant", accountant, ("pld", "clt"))
    m, n, T = float(mixup_degree), int(n), int(num_samples)
    p, _ = _hs_rates(np.asarray(class_rates, dtype=np.float64), m, n)
    mu = dp_to_gdp(e, d)
    sigma = 1.0 / math.sqrt(math.log1p(mu * mu * p * n * n / (m * m * T)))
    if accountant == "clt":
        while hs_epsilon(sigma, mixup_degree=m, n=n, num_samples=T, class_rates=[p], delta=d,
                         accountant="clt") > e:      # rounding: nudge up
            sigma *= 1.0 + 1e-12
        return sigma

    def eps(s):
        return hs_epsilon(s, mixup_degree=m, n=n, num_samples=T, class_rates=[p], delta=d,
                          value_discretization_interval=value_discretization_interval)
    lo, hi = sigma, sigma
    while eps(hi) > e:
        lo, hi = hi, hi * 1.25
        if hi > 1e6:
            raise ValueError(f"epsilon={e!r}: needs a noise multiplier above 1e6")
    if lo == hi:
        while eps(lo) <= e:
            hi, lo = lo, lo / 1.25
            if lo < 1e-2:
                return hi
    for _ in range(60):
        if eps(hi) >= e * (1.0 - epsilon_rtol):
            break
        mid = math.sqrt(lo * hi)
        if eps(mid) <= e:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class PrivacyReport:
    r"""What one :meth:`NeuroMixGDP.release` call guarantees (add/remove-one neighbours,
    n public), and the inputs needed to recompute it.

    Attributes:
        epsilon_target, delta: the requested (epsilon, delta).
        mu: ``dp_to_gdp(epsilon_target, delta)``, the GDP target of Theorem 3.1.
        epsilon_clt: epsilon by the GDP CLT (Theorem 3.1 / E.2; HS: corrected, see the
            module docstring).  An approximation that can *underestimate*.
        epsilon_pld: epsilon by the PLD accountant (pessimistic; a rigorous upper
            bound).  Quote this one for a claim you must defend.
        epsilon_paper: HS only -- the CLT epsilon that the paper's Proposition E.3
            (Poisson rate m/n) would claim for the same noise; ``None`` for Poisson.
        noise_multiplier: sigma, 1/sigma^2 = 1/sigma_x^2 + 1/sigma_y^2.
        accountant: ``"clt"`` or ``"pld"``, the accountant that calibrated sigma
            (``"fixed"`` when the noise was given, not calibrated).
        sampling: ``"poisson"`` or ``"hierarchical"``; class_rates: the p_k (HS).
        n, mixup_degree, num_samples, lam, clip_x, clip_y: the inputs.
        value_discretization_interval: PLD grid step (nats).
    """
    epsilon_target: float | None
    delta: float
    mu: float | None
    epsilon_clt: float
    epsilon_pld: float
    epsilon_paper: float | None
    noise_multiplier: float
    accountant: str
    sampling: str
    class_rates: tuple | None
    n: int
    mixup_degree: float
    num_samples: int
    lam: float
    clip_x: float
    clip_y: float
    value_discretization_interval: float
    neighbouring: str = "add/remove one record; dataset size n public"

    @property
    def epsilon(self) -> float:
        """The defensible epsilon: ``epsilon_pld`` (a rigorous upper bound)."""
        return self.epsilon_pld

    def as_dict(self) -> dict:
        d = asdict(self)
        d["class_rates"] = None if self.class_rates is None else list(self.class_rates)
        return d


def _report(*, sigma, epsilon, delta, accountant, class_rates, n, m, T, lam, clip_x, clip_y,
            interval, known=None) -> PrivacyReport:
    q = m / n
    if class_rates is None and known is not None:
        # neuromix_noise already accounted for exactly this sigma, q, T, delta and grid.
        eps_clt, eps_pld, eps_paper = known.epsilon_clt, known.epsilon_pld, None
    elif class_rates is None:
        mu_clt = poisson_gdp_mu(sigma, q, T)
        eps_clt = gdp_to_dp(mu_clt, delta) if math.isfinite(mu_clt) else math.inf
        eps_pld = epsilon_poisson_gaussian(sigma, q, T, delta, "pld",
                                           value_discretization_interval=interval)
        eps_paper = None
    else:
        kw = dict(mixup_degree=m, n=n, num_samples=T, class_rates=class_rates, delta=delta,
                  value_discretization_interval=interval)
        eps_clt = hs_epsilon(sigma, accountant="clt", **kw)
        eps_pld = hs_epsilon(sigma, accountant="pld", **kw)
        mu_paper = poisson_gdp_mu(sigma, q, T)
        eps_paper = gdp_to_dp(mu_paper, delta) if math.isfinite(mu_paper) else math.inf
    return PrivacyReport(
        epsilon_target=epsilon, delta=delta,
        mu=None if epsilon is None else dp_to_gdp(epsilon, delta),
        epsilon_clt=eps_clt, epsilon_pld=eps_pld, epsilon_paper=eps_paper,
        noise_multiplier=sigma, accountant=accountant,
        sampling="poisson" if class_rates is None else "hierarchical",
        class_rates=None if class_rates is None else tuple(float(v) for v in class_rates),
        n=n, mixup_degree=float(m), num_samples=T, lam=lam, clip_x=clip_x, clip_y=clip_y,
        value_discretization_interval=interval)


# --------------------------------------------------------------------------- release

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
    _noise_key: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self):
        # A pickled release is a published release: never with its noise key.
        state = {k: getattr(self, k) for k in self.__dataclass_fields__}
        state["_noise_key"] = None
        return state

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
        return _report(sigma=r.noise_multiplier, epsilon=r.epsilon_target, delta=r.delta,
                       accountant=r.accountant,
                       class_rates=None if r.class_rates is None else np.array(r.class_rates),
                       n=r.n, m=r.mixup_degree, T=r.num_samples, lam=r.lam, clip_x=r.clip_x,
                       clip_y=r.clip_y, interval=r.value_discretization_interval)

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
        x, y = _to_numpy(self.x), _to_numpy(self.y)
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
        """Read a file written by :meth:`save`; NumPy arrays.

        Every problem is a :class:`ReleaseFileError` (a ValueError) naming it: a
        truncated or corrupt file, missing or extra entries or metadata fields, an
        unknown format version, a checksum mismatch, arrays whose shapes disagree
        with the metadata, a stated epsilon that the stored noise and sampling
        parameters do not give (the report is recomputed), and -- with ``key`` --
        a missing or wrong HMAC.
        """
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
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
        if key is not None:
            if mac is None:
                raise ReleaseFileError(f"{path}: no HMAC in the file, but a key was given: "
                                       "it was not signed (or the signature was removed)")
            if not hmac.compare_digest(mac, _mac(_check_key(key), meta_s, x, y)):
                raise ReleaseFileError(f"{path}: HMAC mismatch: not signed with this key, or "
                                       "altered after signing")
        rel = _from_metadata(path, meta_s, x, y)
        return rel


class ReleaseFileError(ValueError):
    """A release file that cannot be trusted or read (see :meth:`Released.load`)."""


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


def _to_numpy(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    if _backend.is_torch(a):
        return a.detach().cpu().numpy()
    if hasattr(a, "get"):            # CuPy
        return a.get()
    return np.asarray(a)


def _all_finite(a) -> bool:
    if isinstance(a, np.ndarray):
        return bool(np.isfinite(a).all())
    if _backend.is_torch(a):
        import torch
        return bool(torch.isfinite(a).all())
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy
        return bool(cupy.isfinite(a).all())
    return bool(np.isfinite(np.asarray(a)).all())


def _labels_host(labels, n: int, K: int) -> np.ndarray:
    try:
        shape = tuple(int(s) for s in labels.shape)
    except AttributeError:
        raise TypeError(f"labels: expected an array (NumPy, torch or CuPy), got "
                        f"{type(labels).__name__}") from None
    if len(shape) != 1:
        raise ValueError(f"labels: expected integer class ids of shape (n,), got shape {shape}")
    if shape[0] != n:
        raise ValueError(f"labels: length {shape[0]} differs from features' {n} rows")
    lab = _to_numpy(labels)
    if lab.dtype.kind not in "iu":
        raise TypeError(f"labels: expected integer class ids, got dtype {lab.dtype}")
    if lab.size and (lab.min() < 0 or lab.max() >= K):
        raise ValueError(f"labels: expected integers in [0, {K}), got min {lab.min()} and max "
                         f"{lab.max()}")
    return lab


class NeuroMixGDP:
    r"""NeuroMixGDP(-HS) private feature release (Algorithm 1; Theorem 3.1).

    Args (all keyword-only):
        epsilon: target epsilon > 0 of one :meth:`release` call.
        delta: target delta in (0, 1) (the paper uses 1e-5 ~ 1/(2n) on MNIST).
        mixup_degree: m, a number in [1, n], or ``"auto"`` for the optimal degree of
            Section 3.2, :math:`m^* = \nu^* n/\sqrt T` with :math:`\nu^* = 0.505\,\mu`
            (:func:`ncdp_fast.privacy.optimal_mixup_degree`, rounded, at least 1; the
            rule is derived for Poisson sampling and is used unchanged for HS).
        num_samples: T released rows; ``None`` means T = n.  Privacy: T is part of the
            accounting (T compositions).
        lam: lambda = sigma_y / sigma_x > 0, the feature/label noise balance
            (paper: 0.2 to 4; 1 by default).
        clip_x: C_x > 0: features are rescaled to norm <= C_x before mixing (the
            feature sensitivity of a row is C_x / m).
        clip_y: C_y > 0: the label noise std is sigma_y * C_y / m; labels are one-hot
            (norm 1), scaled by min(1, C_y), so the label sensitivity min(1, C_y)/m
            never exceeds the C_y/m the noise is calibrated for (C_y > 1 only adds
            noise; C_y = 1 is the natural value).
        hierarchical_classes: ``None`` for Poisson sampling; a number c in (0, K] for
            HS with class rate p_k = c/K (c classes per row on average, the paper's
            experiments); or a (K,) array of rates p_k in (0, 1].  Needs
            q_k = m/(n p_k) <= 1.
        accountant: ``"pld"`` (default: calibrated so the rigorous PLD bound meets
            epsilon) or ``"clt"`` (opt-in: Theorem 3.1, the paper's calibration, an
            approximation that can underestimate epsilon -- at n = T = 1000 its
            epsilon = 1 is 1.50 by PLD).  Either way the report gives both.
        seed: the noise key: None (from the OS), a 64-bit int or a
            :class:`ncdp_fast.NoiseStream` shared with the rest of the workflow.
            Successive :meth:`release` calls take disjoint ranges, so no noise is
            ever reused; each call spends its own (epsilon, delta) -- calls compose.
        offset: first draw (None: the next unused draw of ``seed``'s stream).
    """

    def __init__(self, *, epsilon, delta, mixup_degree="auto", num_samples=None, lam=1.0,
                 clip_x=1.0, clip_y=1.0, hierarchical_classes=None, accountant="pld",
                 seed=None, offset=None):
        self.epsilon = check_positive("epsilon", epsilon)
        self.delta = check_delta(delta)
        if isinstance(mixup_degree, str):
            if mixup_degree != "auto":
                raise ValueError(f"mixup_degree: expected a number >= 1 or 'auto', got "
                                 f"{mixup_degree!r}")
        elif isinstance(mixup_degree, bool) or not isinstance(mixup_degree, Real) or \
                not (math.isfinite(mixup_degree) and mixup_degree >= 1):
            raise ValueError(f"mixup_degree: expected a number >= 1 or 'auto', got "
                             f"{mixup_degree!r}")
        self.mixup_degree = mixup_degree
        if num_samples is not None and (isinstance(num_samples, bool) or
                                        not isinstance(num_samples, Integral) or num_samples < 1):
            raise ValueError(f"num_samples: expected None or an integer >= 1, got {num_samples!r}")
        self.num_samples = None if num_samples is None else int(num_samples)
        self.lam = check_positive("lam", lam)
        self.clip_x = check_positive("clip_x", clip_x)
        self.clip_y = check_positive("clip_y", clip_y)
        if hierarchical_classes is not None and not isinstance(hierarchical_classes, Real):
            hc = np.asarray(hierarchical_classes, dtype=np.float64)
            if hc.ndim != 1:
                raise ValueError(f"hierarchical_classes: expected a number or a (K,) array of "
                                 f"class rates, got shape {hc.shape}")
            hierarchical_classes = hc
        elif isinstance(hierarchical_classes, bool):
            raise TypeError("hierarchical_classes: expected a number or an array, got a bool")
        self.hierarchical_classes = hierarchical_classes
        self.accountant = check_choice("accountant", accountant, ("clt", "pld"))
        self._stream = _stream.resolve(seed, offset)
        self.value_discretization_interval = DEFAULT_VALUE_DISCRETIZATION_INTERVAL

    # ------------------------------------------------------------------ helpers
    def _class_rates(self, K: int, m: float, n: int):
        hc = self.hierarchical_classes
        if hc is None:
            return None
        if isinstance(hc, np.ndarray):
            if hc.shape != (K,):
                raise ValueError(f"hierarchical_classes: expected {K} class rates, got shape "
                                 f"{hc.shape}")
            p = hc.copy()
            if not np.all((p > 0) & (p <= 1)):
                raise ValueError(f"hierarchical_classes: class rates must be in (0, 1], got "
                                 f"{p.tolist()}")
        else:
            c = float(hc)
            if not (0 < c <= K):
                raise ValueError(f"hierarchical_classes: expected a number of classes in (0, "
                                 f"{K}], got {hc!r}")
            p = np.full(K, c / K)
        q = m / (n * p)
        if np.any(q > 1):
            k = int(np.argmax(q))
            raise ValueError(f"hierarchical_classes: q_k = m/(n p_k) must be <= 1; class {k} has "
                             f"q = {m:g}/({n}*{p[k]:.4g}) = {q[k]:.4g} (raise p_k or lower m)")
        return p

    def resolve(self, n: int, num_classes: int) -> dict:
        """The (m, T, p_k) a release of n examples with ``num_classes`` classes would
        use (no data touched)."""
        T = n if self.num_samples is None else self.num_samples
        if self.mixup_degree == "auto":
            m = float(max(1, round(optimal_mixup_degree(dp_to_gdp(self.epsilon, self.delta),
                                                        n, T))))
        else:
            m = float(self.mixup_degree)
        if m > n:
            raise ValueError(f"mixup_degree: expected m <= n = {n}, got {m:g}")
        return dict(m=m, T=T, class_rates=self._class_rates(num_classes, m, n))

    def noise(self, n: int, num_classes: int) -> tuple[float, float, float]:
        """(sigma, sigma_x, sigma_y) calibrated for a release of n examples."""
        r = self.resolve(n, num_classes)
        return self._calibrate(n, r["m"], r["T"], r["class_rates"])[:3]

    def _calibrate(self, n, m, T, class_rates):
        if class_rates is None:
            if float(m).is_integer():
                nz = neuromix_noise(self.epsilon, self.delta, n=n, mixup_degree=int(m),
                                    num_samples=T, lam=self.lam, accountant=self.accountant,
                                    value_discretization_interval=self.
                                    value_discretization_interval)
                return nz.noise_multiplier, nz.sigma_x, nz.sigma_y, nz
            # non-integer m: the same accounting with q = m/n (HS code path, p = 1)
            class_rates = np.ones(1)
        sigma = hs_noise_multiplier(self.epsilon, self.delta, mixup_degree=m, n=n,
                                    num_samples=T, class_rates=class_rates,
                                    accountant=self.accountant,
                                    value_discretization_interval=self.
                                    value_discretization_interval)
        sx, sy = _lam_split(sigma, self.lam)
        return sigma, sx, sy, None

    # ------------------------------------------------------------------ release
    def release(self, features, labels, *, num_classes) -> Released:
        r"""Release T noisy mixed rows of (features, labels) (Algorithm 1).

        Args:
            features: (n, d) float32/float64, finite; NumPy, torch (CPU/CUDA) or CuPy.
                Private.  Clipped to norm C_x inside.
            labels: (n,) integer class ids in [0, num_classes).  Private.
            num_classes: K, the public label set size (required: inferring it from the
                private labels would leak).

        Returns:
            :class:`Released` -- x (T, d) and y (T, K) in the features' array type and
            device, the noise multipliers and the :class:`PrivacyReport`.
        """
        return self._release(features, labels, num_classes=num_classes)

    def _release(self, features, labels, *, num_classes, noise=True, sigma=None,
                 return_groups=False):
        # Internal hooks (tests and the reproduction only): noise=False releases the
        # noise-free mixture (NOT private; report epsilon = inf); sigma=s uses the given
        # noise multiplier instead of calibrating (the report gives its true epsilon);
        # return_groups also returns ncdp_fast.mix's BatchPlan of the groups.
        try:
            shape = tuple(int(s) for s in features.shape)
        except AttributeError:
            raise TypeError(f"features: expected an array (NumPy, torch or CuPy), got "
                            f"{type(features).__name__}") from None
        if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
            raise ValueError(f"features: expected shape (n, d) with n, d >= 1, got {shape}")
        n, d = shape
        if isinstance(num_classes, bool) or not isinstance(num_classes, Integral) or \
                num_classes < 1:
            raise ValueError(f"num_classes: expected an integer >= 1, got {num_classes!r}")
        K = int(num_classes)
        _labels_host(labels, n, K)
        if not _all_finite(features):
            raise ValueError("features: contains NaN or infinite values")
        r = self.resolve(n, K)
        m, T, rates = r["m"], r["T"], r["class_rates"]
        known = None
        if not noise:
            s, sx, sy = math.inf, 0.0, 0.0
            accountant = "none"
        elif sigma is not None:
            s = check_positive("sigma", sigma)
            sx, sy = _lam_split(s, self.lam)
            accountant = "fixed"
        else:
            s, sx, sy, known = self._calibrate(n, m, T, rates)
            accountant = self.accountant
        if noise:
            report = _report(sigma=s, epsilon=self.epsilon if sigma is None else None,
                             delta=self.delta, accountant=accountant, class_rates=rates, n=n,
                             m=m, T=T, lam=self.lam, clip_x=self.clip_x, clip_y=self.clip_y,
                             interval=self.value_discretization_interval, known=known)
        else:
            report = PrivacyReport(
                epsilon_target=None, delta=self.delta, mu=None, epsilon_clt=math.inf,
                epsilon_pld=math.inf, epsilon_paper=None if rates is None else math.inf,
                noise_multiplier=math.inf, accountant="none",
                sampling="poisson" if rates is None else "hierarchical",
                class_rates=None if rates is None else tuple(map(float, rates)), n=n,
                mixup_degree=m, num_samples=T, lam=self.lam, clip_x=self.clip_x,
                clip_y=self.clip_y,
                value_discretization_interval=self.value_discretization_interval,
                neighbouring="NOT PRIVATE: noise-free mixture (internal hook)")
        # Labels are scaled to norm s_y = min(1, C_y) after mixing; the kernel's noise
        # is divided by s_y so the released label noise std is sigma_y C_y / m.
        s_y = min(1.0, self.clip_y)
        std_x = sx * self.clip_x / m
        std_y = sy * self.clip_y / (m * s_y)
        res = mix(features, labels, num_samples=T, mixup_degree=m, noise_std_x=std_x,
                  noise_std_y=std_y, num_classes=K,
                  class_rate=None if rates is None else rates, clip_x=self.clip_x,
                  seed=self._stream, return_groups=return_groups)
        y = res.y if s_y == 1.0 else res.y * s_y
        rel = Released(x=res.x, y=y, sigma_x=sx, sigma_y=sy, report=report, mixup_degree=m,
                       num_samples=T, num_classes=K, clip_x=self.clip_x, clip_y=self.clip_y,
                       _noise_key=dict(seed=res.seed, offset=res.offset, draws=res.draws))
        return (rel, res.groups) if return_groups else rel


# --------------------------------------------------------------------------- classifier

def _torch():
    import torch
    return torch


def _as_tensor(a, dtype, device):
    torch = _torch()
    if isinstance(a, torch.Tensor):
        return a.detach().to(device=device, dtype=dtype)
    return torch.as_tensor(np.asarray(_to_numpy(a)), dtype=dtype, device=device)


class SoftLabelClassifier:
    r"""Linear (or one-hidden-layer) classifier trained on released (x, y) pairs.

    Loss (``loss="kl"``, the paper's Appendix C): the noisy mixed labels are clipped
    at 0, :math:`p = \max(\tilde y, 0)`, and the generalised KL divergence
    :math:`D(p\|q) = \sum_k p_k\log(p_k/q_k) - p_k + q_k` to the softmax output q is
    minimised (eq. 2).  Since :math:`\sum_k q_k = 1`, its gradient in the logits is that
    of the soft cross-entropy :math:`-\sum_k p_k \log q_k` with unnormalised targets,
    which is what is computed; negative label entries (pure noise around a zero
    mean) thus carry no weight.  ``loss="squared"``: least squares
    :math:`\|XW + b - \tilde y\|^2 + \alpha T\|W\|^2` in closed form (linear only); it
    uses the negative entries as they are -- the label noise is zero-mean, so the
    squared loss is unbiased for E[y | x].

    Training is post-processing of the released data (no privacy cost).  Solvers:
    ``"lbfgs"`` (full batch, torch L-BFGS with strong-Wolfe line search,
    ``max_iter`` iterations) or ``"adam"`` (mini-batches of ``batch_size``,
    ``epochs`` epochs, learning rate ``lr`` divided by 10 at 40/60/80 % of the epochs,
    the paper's schedule shape).  ``alpha`` is an L2 penalty on the weights (mean
    loss + alpha/2 ||W||^2).  ``standardize=True`` fits in coordinates standardised
    by the released rows' column means and standard deviations (public statistics of
    the release; the same model class, but a far better-conditioned problem for
    L-BFGS -- the ScatterNet columns share a large common mean); ``coef_`` and
    ``intercept_`` are always in the input coordinates.  Test features are clipped to norm ``clip_x`` as at
    release (set from the :class:`Released` given to :meth:`fit`, or here).

    scikit-learn conventions: :meth:`fit` returns self; :meth:`predict`,
    :meth:`predict_proba`, :meth:`decision_function`, :meth:`score` (accuracy on
    integer labels); ``classes_``, ``n_features_in_``, ``coef_`` (K, d),
    ``intercept_`` (K,).  Inputs: NumPy arrays or torch tensors (moved to ``device``);
    outputs are NumPy.
    """

    def __init__(self, *, loss="kl", hidden=None, solver="lbfgs", alpha=0.0, max_iter=100,
                 epochs=20, batch_size=1024, lr=1e-3, clip_x=None, standardize=False,
                 device="cpu", dtype="float32", seed=None):
        self.loss = check_choice("loss", loss, ("kl", "squared"))
        self.standardize = bool(standardize)
        if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, Integral)
                                   or hidden < 1):
            raise ValueError(f"hidden: expected None or an integer >= 1, got {hidden!r}")
        if hidden is not None and loss == "squared":
            raise ValueError("hidden: the squared loss is solved in closed form for a linear "
                             "model only; use loss='kl' with a hidden layer")
        self.hidden = hidden
        self.solver = check_choice("solver", solver, ("lbfgs", "adam"))
        if isinstance(alpha, bool) or not isinstance(alpha, Real) or not alpha >= 0:
            raise ValueError(f"alpha: expected a number >= 0, got {alpha!r}")
        self.alpha = float(alpha)
        for name, v in (("max_iter", max_iter), ("epochs", epochs), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, Integral) or v < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
        self.max_iter, self.epochs, self.batch_size = int(max_iter), int(epochs), int(batch_size)
        self.lr = check_positive("lr", lr)
        self.clip_x = None if clip_x is None else check_positive("clip_x", clip_x)
        self.device = device
        self.dtype = check_choice("dtype", dtype, ("float32", "float64"))
        self.seed = seed

    # ------------------------------------------------------------------ internals
    def _tdtype(self):
        torch = _torch()
        return torch.float32 if self.dtype == "float32" else torch.float64

    def _prep(self, X, clip=True):
        torch = _torch()
        X = _as_tensor(X, self._tdtype(), self.device)
        if X.ndim != 2:
            raise ValueError(f"X: expected shape (n, d), got {tuple(X.shape)}")
        if hasattr(self, "n_features_in_") and X.shape[1] != self.n_features_in_:
            raise ValueError(f"X: expected {self.n_features_in_} features, got {X.shape[1]}")
        if clip and self.clip_x is not None:
            # Same clipping as the release: x * min(1, C / ||x||).
            norms = torch.linalg.vector_norm(X, dim=1, keepdim=True)
            X = X * torch.clamp(self.clip_x / torch.clamp(norms, min=1e-30), max=1.0)
        return X

    def _forward(self, X):
        if self._mlp is not None:
            if self._shift is not None:
                X = (X - self._shift) * self._scale
            return self._mlp(X)
        if self._shift is None:
            return X @ self._W + self._b
        # Standardised coordinates z = (x - shift) * scale without a copy of X:
        # z W + b = x (scale W) + (b - (shift scale) W).
        return X @ (self._scale[:, None] * self._W) + (self._b - (self._shift * self._scale)
                                                       @ self._W)

    # ------------------------------------------------------------------ API
    def fit(self, X, Y=None):
        """Fit on released rows.  ``fit(released)`` takes x, y and clip_x from a
        :class:`Released`; ``fit(X, Y)`` takes X (T, d) and soft labels Y (T, K)
        (integer labels (T,) are one-hot encoded, for non-private baselines)."""
        torch = _torch()
        if isinstance(X, Released):
            if Y is not None:
                raise ValueError("Y: give either a Released or (X, Y), not both")
            if self.clip_x is None:
                self.clip_x = X.clip_x
            X, Y = X.x, X.y
        if Y is None:
            raise ValueError("Y: soft labels (T, K) are required")
        Xt = _as_tensor(X, self._tdtype(), self.device)
        if Xt.ndim != 2:
            raise ValueError(f"X: expected shape (T, d), got {tuple(Xt.shape)}")
        Yt = _as_tensor(Y, self._tdtype(), self.device) if _to_numpy_dtype_kind(Y) == "f" \
            else None
        if Yt is None:
            lab = _to_numpy(Y)
            if lab.ndim != 1:
                raise ValueError(f"Y: expected soft labels (T, K) or class ids (T,), got "
                                 f"shape {lab.shape}")
            K = int(lab.max()) + 1
            Yt = torch.nn.functional.one_hot(torch.as_tensor(lab.astype(np.int64)), K).to(
                device=self.device, dtype=self._tdtype())
        if Yt.ndim != 2 or Yt.shape[0] != Xt.shape[0]:
            raise ValueError(f"Y: expected shape ({Xt.shape[0]}, K), got {tuple(Yt.shape)}")
        if not (bool(torch.isfinite(Xt).all()) and bool(torch.isfinite(Yt).all())):
            raise ValueError("X, Y: contain NaN or infinite values")
        T, d = Xt.shape
        K = Yt.shape[1]
        self.n_features_in_ = int(d)
        self.classes_ = np.arange(K)
        # The released rows are mixtures plus noise: never clipped again (only raw test
        # features are, in predict / decision_function).
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_backend.resolve_seed(self.seed) % 2**63)
        self._mlp = None
        self._shift = self._scale = None
        if self.loss == "squared":
            self._fit_squared(Xt, Yt)
            return self
        if self.standardize:
            # Preconditioning from the released rows' own column means / stds (public;
            # post-processing): the same model class, a better-conditioned problem.
            f8 = torch.float64
            mean = Xt.mean(0, dtype=f8)
            sd = torch.sqrt(torch.clamp((Xt.to(f8) ** 2).mean(0) - mean ** 2, min=0.0)) \
                if Xt.shape[0] * Xt.shape[1] <= 2**24 else _column_std(Xt, mean)
            self._shift = mean.to(Xt.dtype)
            self._scale = (1.0 / torch.clamp(sd, min=1e-12)).to(Xt.dtype)
        if self.hidden is None:
            self._W = torch.zeros(d, K, dtype=Xt.dtype, device=self.device, requires_grad=True)
            self._b = torch.zeros(K, dtype=Xt.dtype, device=self.device, requires_grad=True)
            params = [self._W, self._b]
        else:
            lin1 = torch.nn.Linear(d, self.hidden)
            lin2 = torch.nn.Linear(self.hidden, K)
            for lin in (lin1, lin2):   # deterministic init from our generator
                bound = 1.0 / math.sqrt(lin.in_features)
                with torch.no_grad():
                    lin.weight.uniform_(-bound, bound, generator=gen)
                    lin.bias.uniform_(-bound, bound, generator=gen)
            self._mlp = torch.nn.Sequential(lin1, torch.nn.ReLU(), lin2).to(
                device=self.device, dtype=Xt.dtype)
            params = list(self._mlp.parameters())
        P = torch.clamp(Yt, min=0.0)      # Appendix C: negative noisy entries -> 0
        weights = [p for p in params if p.ndim == 2]

        def objective(xb, pb):
            logq = torch.log_softmax(self._forward(xb), dim=1)
            val = -(pb * logq).sum(dim=1).mean()
            if self.alpha:
                val = val + 0.5 * self.alpha * sum((w * w).sum() for w in weights)
            return val

        if self.solver == "lbfgs":
            opt = torch.optim.LBFGS(params, lr=1.0, max_iter=self.max_iter,
                                    history_size=20, line_search_fn="strong_wolfe",
                                    tolerance_grad=1e-9, tolerance_change=1e-12)

            def closure():
                opt.zero_grad()
                v = objective(Xt, P)
                v.backward()
                return v
            opt.step(closure)
        else:
            opt = torch.optim.Adam(params, lr=self.lr)
            milestones = [int(self.epochs * f) for f in (0.4, 0.6, 0.8)]
            sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.1)
            for _ in range(self.epochs):
                perm = torch.randperm(T, generator=gen).to(self.device)
                for i in range(0, T, self.batch_size):
                    idx = perm[i:i + self.batch_size]
                    opt.zero_grad()
                    objective(Xt[idx], P[idx]).backward()
                    opt.step()
                sched.step()
        for p in params:
            p.requires_grad_(False)
        return self

    def _fit_squared(self, X, Y):
        torch = _torch()
        T, d = X.shape
        # Centred normal equations without a centred copy of X (T x d can be GBs):
        # W = (X'X - T mx mx' + alpha T I)^-1 (X'Y - T mx my'), intercept unpenalised.
        # Products in X's dtype, the centring and the solve in float64.
        f8 = torch.float64
        mx, my = X.mean(0).to(f8), Y.mean(0).to(f8)
        G = (X.T @ X).to(f8) - T * torch.outer(mx, mx)
        R = (X.T @ Y).to(f8) - T * torch.outer(mx, my)
        # alpha = 0: a jitter of 1e-7 of the mean diagonal keeps G invertible.
        G.diagonal().add_(self.alpha * T if self.alpha else 1e-7 * float(G.diagonal().mean()))
        W = torch.linalg.solve(G, R)
        self._W = W.to(X.dtype)
        self._b = (my - mx @ W).to(X.dtype)

    @property
    def coef_(self) -> np.ndarray:
        """(K, d) weights of the linear model in the input coordinates (AttributeError
        with a hidden layer)."""
        self._check_fitted()
        if self._mlp is not None:
            raise AttributeError("coef_: not defined for the one-hidden-layer model")
        W = self._W if self._shift is None else self._scale[:, None] * self._W
        return W.detach().cpu().numpy().T.copy()

    @property
    def intercept_(self) -> np.ndarray:
        self._check_fitted()
        if self._mlp is not None:
            raise AttributeError("intercept_: not defined for the one-hidden-layer model")
        b = self._b if self._shift is None else \
            self._b - (self._shift * self._scale) @ self._W
        return b.detach().cpu().numpy().copy()

    def _check_fitted(self):
        if not hasattr(self, "classes_"):
            raise RuntimeError("SoftLabelClassifier: call fit() first")

    def decision_function(self, X) -> np.ndarray:
        """Scores (n, K): logits (``kl``) or fitted label means (``squared``)."""
        self._check_fitted()
        torch = _torch()
        with torch.no_grad():
            return self._forward(self._prep(X)).cpu().numpy()

    def predict_proba(self, X) -> np.ndarray:
        """(n, K) class probabilities: softmax of the logits (``kl``); for ``squared``
        the fitted label means clipped at 0 and normalised (uniform where all are 0)."""
        s = self.decision_function(X).astype(np.float64)
        if self.loss == "kl":
            s -= s.max(axis=1, keepdims=True)
            e = np.exp(s)
            return e / e.sum(axis=1, keepdims=True)
        s = np.maximum(s, 0.0)
        tot = s.sum(axis=1, keepdims=True)
        K = s.shape[1]
        return np.where(tot > 0, s / np.where(tot > 0, tot, 1.0), 1.0 / K)

    def predict(self, X) -> np.ndarray:
        self._check_fitted()
        return self.classes_[np.argmax(self.decision_function(X), axis=1)]

    def score(self, X, y) -> float:
        """Accuracy on integer labels y (n,)."""
        y = _to_numpy(y)
        return float(np.mean(self.predict(X) == y))


def _column_std(X, mean):
    # Column standard deviations in float64 by row blocks (no float64 copy of X).
    torch = _torch()
    acc = torch.zeros_like(mean)
    for i in range(0, X.shape[0], 4096):
        blk = X[i:i + 4096].to(torch.float64) - mean
        acc += (blk * blk).sum(0)
    return torch.sqrt(acc / X.shape[0])


def _to_numpy_dtype_kind(a) -> str:
    if _backend.is_torch(a):
        return "f" if a.is_floating_point() else "i"
    return np.asarray(a).dtype.kind if not hasattr(a, "dtype") else np.dtype(str(a.dtype)).kind


# --------------------------------------------------------------------------- audit

def membership_losses(model, features, labels) -> np.ndarray:
    """Per-example cross-entropy -log p_model(y | x) (n,), float64; probabilities are
    floored at 1e-300 so a confident mistake gives a large finite loss."""
    y = _to_numpy(labels)
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise ValueError(f"labels: expected integer class ids of shape (n,), got dtype "
                         f"{y.dtype} shape {y.shape}")
    P = np.asarray(model.predict_proba(features), dtype=np.float64)
    if P.shape[0] != y.shape[0]:
        raise ValueError(f"labels: length {y.shape[0]} differs from features' {P.shape[0]} rows")
    if y.size and (y.min() < 0 or y.max() >= P.shape[1]):
        raise ValueError(f"labels: expected integers in [0, {P.shape[1]}), got min {y.min()} "
                         f"and max {y.max()}")
    return -np.log(np.maximum(P[np.arange(y.shape[0]), y], 1e-300))


def membership_auc(model, members, nonmembers) -> float:
    r"""Loss-based membership-inference AUC (Yeom et al. 2018; paper Section 5).

    The attack scores each example by its loss under ``model`` (any object with
    ``predict_proba``); a lower loss says "member".  The AUC is the probability that
    a random member has a lower loss than a random non-member, ties counting 1/2 --
    computed from average ranks (Mann-Whitney U): with :math:`R` the rank sum of the
    members' losses in the pooled sample (ascending, ties averaged),
    :math:`\mathrm{AUC} = 1 - (R - n_1(n_1+1)/2)/(n_1 n_0)`.  0.5 is no leakage.

    Args:
        model: fitted classifier with ``predict_proba(X) -> (n, K)``.
        members, nonmembers: ``(features, labels)`` pairs (labels integer (n,)).
    """
    from scipy.stats import rankdata
    for name, pair in (("members", members), ("nonmembers", nonmembers)):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"{name}: expected a (features, labels) pair")
    lm = membership_losses(model, *members)
    ln = membership_losses(model, *nonmembers)
    if lm.size == 0 or ln.size == 0:
        raise ValueError(f"members, nonmembers: need at least one of each, got {lm.size} and "
                         f"{ln.size}")
    ranks = rankdata(np.concatenate([lm, ln]))        # ascending loss, ties averaged
    n1, n0 = lm.size, ln.size
    u_lower = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0  # pairs with member loss > non-member
    return float(1.0 - u_lower / (n1 * n0))
