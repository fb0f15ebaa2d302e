"""NoisySGDClassifier: DP-SGD with Poisson batches, noise calibrated by PLD/RDP/GDP."""
from __future__ import annotations

import functools
import math

from scipy.optimize import brentq

from .. import _stream
from .._mix import poisson_batches
from ..privacy import Accountant, calibrate_noise_multiplier, epsilon_poisson_gaussian
from .._validate import check_choice, check_delta, check_positive, check_probability
from .base import LinearClassifierBase, prior_rho
from .steps import linear_steps

__all__ = ["NoisySGDClassifier"]


@functools.lru_cache(maxsize=64)
def _calibrated(eps, delta, q, T, accountant):
    """calibrate_noise_multiplier, memoised: a pure function of public arguments (a sweep
    refits the same budget many times; a PLD calibration costs seconds)."""
    return calibrate_noise_multiplier(eps, delta, q, T, accountant=accountant)


@functools.lru_cache(maxsize=64)
def _poisson_epsilon(z, q, T, delta, accountant):
    """epsilon of T Poisson(q)-subsampled Gaussian steps, memoised (pure function)."""
    return epsilon_poisson_gaussian(z, q, T, delta, accountant=accountant)


class NoisySGDClassifier(LinearClassifierBase):
    r"""DP-SGD (NoisySGD) linear classifier with Poisson batches, from zero.

    Step t draws a Poisson batch (every record independently with probability
    ``sample_rate``, :func:`ncdp_fast.poisson_batches`; empty batches kept), adds
    :math:`N(0, (zC)^2 I)` to the sum of the batch's clipped per-sample gradients and
    steps by ``lr * g / expected_batch_size``; ``steps = round(epochs /
    sample_rate)``.  The noise multiplier z is the smallest meeting (epsilon, delta)
    for T compositions of the Poisson-subsampled Gaussian
    (:func:`ncdp_fast.privacy.calibrate_noise_multiplier`, PLD by default); with
    private preprocessing, z is calibrated so that the RDP composition of its zCDP
    events and the T steps meets the target.

    Args:
        epsilon, delta: target (epsilon, delta)-DP of everything fitted on the data.
        sample_rate: Poisson rate q in (0, 1].
        epochs: passes (> 0); steps = max(1, round(epochs / q)).
        lr: step size on the clipped noisy batch mean.
        loss, max_grad_norm, projection_radius, fit_intercept, num_classes, seed:
            as :class:`NoisyGDClassifier`.
        expected_batch_size: divisor of the noisy sum (default ``sample_rate * n``:
            the dataset size is treated as public, the DP-SGD/Opacus convention;
            pass a number to keep n out of the computation).  Never the realized
            batch size.
        accountant: "pld" (default), "rdp", or "gdp" (opt-in: calibrates by the
            CLT, an approximation; ``epsilon_`` is still the PLD value of the
            resulting noise and the CLT figure is ``epsilon_gdp_``).
        offset: first draw (None: the next unused draw of ``seed``'s stream).

    Fitted attributes: ``coef_``, ``intercept_``, ``noise_multiplier_``,
    ``accountant_`` (preprocessing zCDP events + T Gaussian steps of rate q),
    ``epsilon_`` (the accountant's epsilon at ``delta_`` -- "rdp" when private
    preprocessing is present; PLD when "gdp" was asked for), ``epsilon_gdp_`` (CLT
    approximation, "gdp" only), ``delta_``, ``steps_``, ``offset_``/``next_offset_``,
    ``num_clipped_`` (the private data's, without noise: read it in the fitting
    process; no pickle or copy carries it).
    """

    def __init__(self, *, epsilon, delta, sample_rate, epochs, lr=1.0, loss="ce",
                 max_grad_norm=1.0, projection_radius=None, fit_intercept=False,
                 expected_batch_size=None, accountant="pld", num_classes=None, seed=None,
                 offset=None):
        self.epsilon, self.delta = epsilon, delta
        self.offset = offset
        self.sample_rate, self.epochs = sample_rate, epochs
        self.lr, self.loss = lr, loss
        self.max_grad_norm, self.projection_radius = max_grad_norm, projection_radius
        self.fit_intercept, self.expected_batch_size = fit_intercept, expected_batch_size
        self.accountant, self.num_classes, self.seed = accountant, num_classes, seed

    def _calibrate(self, eps, delta, q, T, spent):
        if not spent:
            return _calibrated(eps, delta, q, T, self.accountant), self.accountant

        def excess(log_z):
            acc = Accountant()
            for r in spent:
                acc.add_zcdp(r)
            acc.step(noise_multiplier=math.exp(log_z), sample_rate=q, steps=T)
            return math.log(acc.epsilon(delta, accountant="rdp")) - math.log(eps)

        lo, hi = math.log(0.05), math.log(1e4)
        if excess(hi) > 0:
            raise ValueError(f"epsilon: the budget left after private preprocessing "
                             f"(rho={sum(spent)!r}) cannot be met by any noise multiplier")
        if excess(lo) <= 0:
            return math.exp(lo), "rdp"
        log_z = brentq(excess, lo, hi, xtol=1e-6)
        z = math.exp(log_z)
        while excess(math.log(z)) > 0:       # land on the feasible side of the root
            z *= 1.0 + 1e-6
        return z, "rdp"

    def fit(self, X, y, *, preprocessing=()):
        """Train on private features X (n, p) NumPy/torch CPU/CUDA and labels y.
        ``preprocessing`` as in :meth:`NoisyGDClassifier.fit`."""
        self._validate_common()
        eps = check_positive(self.epsilon, "epsilon")
        delta = check_delta(self.delta)
        q = check_probability(self.sample_rate, "sample_rate")
        epochs = check_positive(self.epochs, "epochs")
        check_choice(self.accountant, "accountant", ("pld", "rdp", "gdp"))
        spent = prior_rho(preprocessing)
        X, labels, n, p, K = self._prepare(X, y)
        T = max(1, int(round(epochs / q)))
        ebs = q * n if self.expected_batch_size is None else \
            check_positive(self.expected_batch_size, "expected_batch_size")
        stream = _stream.resolve(self.seed, self.offset)
        self._check_draws(stream, T, K, p)
        self.offset_ = stream.position
        z, acc_name = self._calibrate(eps, delta, q, T, spent)
        plan = poisson_batches(n, sample_rate=q, steps=T, seed=stream)
        C = float(self.max_grad_norm)
        W, b, info = linear_steps(X, labels, num_classes=K, steps=T, lr=float(self.lr),
                                  loss=self.loss, max_grad_norm=C, noise_multiplier=z,
                                  projection_radius=self.projection_radius,
                                  fit_intercept=bool(self.fit_intercept), seed=stream,
                                  batches=plan, expected_batch_size=ebs)
        acc = Accountant()
        for r in spent:
            acc.add_zcdp(r)
        acc.step(noise_multiplier=z, sample_rate=q, steps=T)
        self._set_fitted(W, b, K, p)
        self.next_offset_ = stream.position
        self.noise_multiplier_, self.steps_ = z, T
        # The CLT is an approximation: "gdp" calibrates by it on request, but the
        # reported epsilon is a rigorous (PLD) bound of the noise actually used.
        report = "pld" if acc_name == "gdp" else acc_name
        self.accountant_, self.accountant_name_, self.delta_ = acc, report, delta
        self.epsilon_ = (_poisson_epsilon(z, q, T, delta, report) if not spent else
                         acc.epsilon(delta, accountant=report))
        self.epsilon_gdp_ = _poisson_epsilon(z, q, T, delta, "gdp") if acc_name == "gdp" \
            else None
        self.expected_batch_size_ = ebs
        self.num_clipped_ = info["num_clipped"]
        return self
