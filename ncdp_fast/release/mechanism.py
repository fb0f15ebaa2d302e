r"""The NeuroMixGDP(-HS) mechanism: :class:`NeuroMixGDP`.

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
* HS: accounted for with the class selection *revealed* (a rigorous bound; the
  paper's Proposition E.3, which bounds one row by the Poisson rate m/n, does not
  hold under HS): :func:`ncdp_fast.privacy.hs_epsilon` and
  :func:`ncdp_fast.privacy.hs_noise_multiplier`, whose module
  :mod:`ncdp_fast.privacy.hierarchical` gives the argument.  The report also carries
  ``epsilon_paper``, the (CLT) epsilon that Proposition E.3 would claim for the same
  noise, so the two can be compared.

The dataset size n.  Theorem 3.1 uses n in the sampling rate m/n and in sigma; like
the paper (and DP-SGD practice, q = B/n), n is treated as public: the report is a
guarantee for neighbours of the given size n, the realised group sizes are never
released, and T defaults to n.  Publishing n (or a bound) is the data holder's
decision; see docs/release.md.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .. import _arrays, _stream
from .._mix import mix
from ..privacy import (DEFAULT_VALUE_DISCRETIZATION_INTERVAL, dp_to_gdp, hs_noise_multiplier,
                       neuromix_noise, optimal_mixup_degree)
from .._validate import (as_real_array, check_choice, check_delta, check_pos_int, check_positive,
                         check_real)
from .._arrays import to_numpy
from .released import Released
from .report import PrivacyReport, privacy_report

__all__ = ["NeuroMixGDP"]


def _lam_split(sigma: float, lam: float) -> tuple[float, float]:
    # 1/sigma_x^2 + 1/sigma_y^2 = 1/sigma^2 with lam = sigma_y / sigma_x (Theorem 3.1).
    s = math.sqrt(lam * lam + 1.0)
    return sigma * s / lam, sigma * s


def _labels_host(labels, n: int, K: int) -> np.ndarray:
    shape = _arrays.shape(labels, "labels")
    if len(shape) != 1:
        raise ValueError(f"labels: expected integer class ids of shape (n,), got shape {shape}")
    if shape[0] != n:
        raise ValueError(f"labels: length {shape[0]} differs from features' {n} rows")
    lab = to_numpy(labels)
    if lab.dtype.kind not in "iu":
        raise TypeError(f"labels: expected integer class ids, got dtype {lab.dtype}")
    if lab.size and (lab.min() < 0 or lab.max() >= K):
        # The values are private (this message may reach every rank's log).
        raise ValueError(f"labels: expected integers in [0, {K}), got values outside it (not "
                         "shown: labels are private)")
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
        self.epsilon = check_positive(epsilon, "epsilon")
        self.delta = check_delta(delta)
        if isinstance(mixup_degree, str):
            if mixup_degree != "auto":
                raise ValueError(f"mixup_degree: expected a number >= 1 or 'auto', got "
                                 f"{mixup_degree!r}")
        elif not (math.isfinite(check_real(mixup_degree, "mixup_degree")) and mixup_degree >= 1):
            raise ValueError(f"mixup_degree: expected a number >= 1 or 'auto', got "
                             f"{mixup_degree!r}")
        self.mixup_degree = mixup_degree
        self.num_samples = None if num_samples is None else check_pos_int(num_samples,
                                                                          "num_samples")
        self.lam = check_positive(lam, "lam")
        self.clip_x = check_positive(clip_x, "clip_x")
        self.clip_y = check_positive(clip_y, "clip_y")
        if hierarchical_classes is not None and not isinstance(hierarchical_classes, numbers.Real):
            hc = as_real_array(hierarchical_classes, "hierarchical_classes",
                               "a number or an array of class rates")
            if hc.ndim != 1:
                raise ValueError(f"hierarchical_classes: expected a number or a (K,) array of "
                                 f"class rates, got shape {hc.shape}")
            hierarchical_classes = hc
        elif isinstance(hierarchical_classes, bool):
            raise TypeError("hierarchical_classes: expected a number or an array, got a bool")
        self.hierarchical_classes = hierarchical_classes
        self.accountant = check_choice(accountant, "accountant", ("clt", "pld"))
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
        # The sixth audit: num_classes 0, -1 or None and n = 2.5 were taken.
        n = check_pos_int(n, "n")
        check_pos_int(num_classes, "num_classes")
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
    def release(self, features, labels, *, num_classes, group=None):
        r"""Release T noisy mixed rows of (features, labels) (Algorithm 1).

        Args:
            features: (n, d) float32/float64, finite; NumPy, torch (CPU/CUDA) or CuPy.
                Private.  Clipped to norm C_x inside.
            labels: (n,) integer class ids in [0, num_classes).  Private.
            num_classes: K, the public label set size (required: inferring it from the
                private labels would leak).
            group: ``None`` (one process), or a ``torch.distributed`` process group: then
                ``features`` is this rank's contiguous shard (n_r, d) of the rows (host
                memory; n_r may be 0), ``labels`` all n labels, and the result is the
                one-process release over the concatenated rows, sharded by output rows
                (:func:`ncdp_fast.distributed.release_sharded`).

        Returns:
            :class:`Released` -- x (T, d) and y (T, K) in the features' array type and
            device, the noise multipliers and the :class:`PrivacyReport`; with a
            ``group``, a :class:`ncdp_fast.distributed.ShardedRelease` (this rank's rows;
            ``gather()`` / ``save()`` assemble the whole).
        """
        if group is not None:
            from ..distributed import release_sharded
            return release_sharded(self, features, labels, num_classes=num_classes,
                                   group=group)
        return self._release(features, labels, num_classes=num_classes)

    def _release(self, features, labels, *, num_classes, noise=True, sigma=None,
                 return_groups=False):
        # Internal hooks (tests and the reproduction only): noise=False releases the
        # noise-free mixture (NOT private; report epsilon = inf); sigma=s uses the given
        # noise multiplier instead of calibrating (the report gives its true epsilon);
        # return_groups also returns ncdp_fast.mix's BatchPlan of the groups.
        shape = _arrays.shape(features, "features")
        if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
            raise ValueError(f"features: expected shape (n, d) with n, d >= 1, got {shape}")
        n, d = shape
        K = check_pos_int(num_classes, "num_classes")
        _labels_host(labels, n, K)
        r = self.resolve(n, K)
        m, T, rates = r["m"], r["T"], r["class_rates"]
        known = None
        if not noise:
            s, sx, sy = math.inf, 0.0, 0.0
            accountant = "none"
        elif sigma is not None:
            s = check_positive(sigma, "sigma")
            sx, sy = _lam_split(s, self.lam)
            accountant = "fixed"
        else:
            s, sx, sy, known = self._calibrate(n, m, T, rates)
            accountant = self.accountant
        if noise:
            report = privacy_report(sigma=s, epsilon=self.epsilon if sigma is None else None,
                                    delta=self.delta, accountant=accountant, class_rates=rates,
                                    n=n, m=m, T=T, lam=self.lam, clip_x=self.clip_x,
                                    clip_y=self.clip_y,
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

