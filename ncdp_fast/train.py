r"""Private last-layer fine-tuning: NoisyGD and NoisySGD linear classifiers.

Paper ``000_82fe6240ae4b04be``: a linear model :math:`f_W(x) = Wx`, :math:`W \in
\mathbb R^{K\times p}`, trained from zero initialisation by NoisyGD (eq. 2.1)

.. math:: \theta_{t+1} = \theta_t - \eta\Big(\sum_{i=1}^n \mathrm{clip}_C\nabla\ell(\theta_t, z_i)
          + \mathcal N(0, \sigma^2 I)\Big),

optionally projected onto the L2 ball of radius R (eq. 3.2), or by NoisySGD (DP-SGD:
Poisson batches, the same clipped noisy sum divided by the expected batch size).

The per-sample gradient of a linear model is the outer product
:math:`r_i x_i^T` of the residual :math:`r_i = \partial\ell/\partial(Wx_i)` and the
feature, so clipping never forms an (n, K p) tensor: the norms are
:math:`\|r_i\|\,\|x_i\|` and the clipped sum is one GEMM
(:func:`ncdp_fast.clip_and_noise_linear`, CPU or CUDA).

Privacy: add/remove one record; per-sample L2 sensitivity ``max_grad_norm`` (C).

* :class:`NoisyGDClassifier`: zCDP.  A budget ``rho`` (or (epsilon, delta)
  converted by :func:`ncdp_fast.privacy.dp_to_zcdp`) minus what private
  preprocessing spent is spread over the T steps: noise std
  :math:`\sigma = C\sqrt{T/(2\rho_{train})}` (:func:`ncdp_fast.privacy.noisygd_sigma`).
* :class:`NoisySGDClassifier`: Poisson-subsampled Gaussian, noise multiplier from
  :func:`ncdp_fast.privacy.calibrate_noise_multiplier` (PLD by default).

Both record their claim on the fitted estimator: ``accountant_`` (an
:class:`ncdp_fast.privacy.Accountant` holding every event, preprocessing included),
``epsilon_``, ``delta_``, ``noise_multiplier_``.  Noise comes from a
:class:`ncdp_fast.NoiseStream` (``seed``: None, an int or a stream; ``offset``):
NoisySGD first takes T draws for its Poisson batches (sub-streams), then each step
takes D = K p (+ K with an intercept) draws; ``offset_``/``next_offset_`` record
the range.  The key itself is never stored on the fitted estimator nor pickled
(docs/privacy.md): a pickled model does not carry its noise.
"""
from __future__ import annotations

import functools
import math
from numbers import Integral, Real

import numpy as np

from . import _backend, _stream
from ._clip import clip_and_noise_linear
from ._numba.clip import clip_factors as _clip_factors
from .nc import check_features as _check_features, check_labels

__all__ = ["NoisyGDClassifier", "NoisySGDClassifier"]

_LOSSES = ("ce", "square")


# ------------------------------------------------------------ array helpers

class _Ops:
    """The few array operations the training loop needs, in the caller's library."""

    def __init__(self, X):
        self.torch = _backend.is_torch(X)
        if self.torch:
            import torch
            self.t = torch
            self.device, self.dtype = X.device, X.dtype
        else:
            self.dtype = np.asarray(X).dtype

    def asarray(self, a, dtype=None):
        if self.torch:
            return self.t.as_tensor(np.asarray(a) if not self.t.is_tensor(a) else a,
                                    dtype=dtype or self.dtype, device=self.device)
        return np.asarray(a, dtype=dtype or self.dtype)

    def zeros(self, shape):
        if self.torch:
            return self.t.zeros(shape, dtype=self.dtype, device=self.device)
        return np.zeros(shape, dtype=self.dtype)

    def softmax(self, z):
        if self.torch:
            return self.t.softmax(z, dim=1)
        z = z - z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        return z

    def sq_norm(self, a, axis=None):
        if self.torch:
            return (a.double() ** 2).sum() if axis is None else (a.double() ** 2).sum(dim=axis)
        a64 = a.astype(np.float64, copy=False)
        with np.errstate(over="ignore"):      # an overflow becomes inf, checked by the caller
            return (a64 * a64).sum() if axis is None else (a64 * a64).sum(axis=axis)

    def take(self, X, idx):
        if self.torch:
            return X.index_select(0, self.t.as_tensor(idx, device=X.device))
        return X[idx]

    def argmax(self, z):
        return z.argmax(dim=1) if self.torch else z.argmax(axis=1)


def _float_features(X, name="X"):
    """NumPy/torch float features (integer NumPy arrays become float64)."""
    if _backend.is_torch(X):
        return X
    if hasattr(X, "__cuda_array_interface__"):
        raise TypeError(f"{name}: CuPy/other CUDA arrays are not supported by the estimators; "
                        "pass a torch CUDA tensor")
    a = np.asarray(X)
    if a.dtype.kind in "iub":
        a = a.astype(np.float64)
    if a.dtype not in _backend.FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32 or float64 features, got {a.dtype}")
    return np.ascontiguousarray(a)


def _to_lib(a, like_ops: _Ops):
    """Move an array fitted in one library/device to the library of ``like_ops``."""
    if like_ops.torch:
        t = like_ops.t
        if t.is_tensor(a):
            return a.to(device=like_ops.device, dtype=like_ops.dtype)
        return t.as_tensor(np.asarray(a), dtype=like_ops.dtype, device=like_ops.device)
    if _backend.is_torch(a):
        a = a.detach().cpu().numpy()
    return np.asarray(a, dtype=like_ops.dtype)


# --------------------------------------------------------------- core loop

def _check_counts(counts, n):
    if counts is None:
        return None
    c = np.asarray(counts.detach().cpu().numpy() if _backend.is_torch(counts) else counts)
    if c.shape != (n,) or c.dtype.kind not in "iu" or (c.size and c.min() < 1):
        raise ValueError(f"counts: expected ({n},) integers >= 1 (row i stands for counts[i] "
                         f"identical records), got shape {c.shape} dtype {c.dtype}")
    return c.astype(np.int64)


def _linear_steps(X, y, *, num_classes, steps, lr, loss, max_grad_norm, noise_multiplier,
                  projection_radius, fit_intercept, seed, counts=None, batches=None,
                  expected_batch_size=None, init=None):
    r"""T steps of (Noisy)(S)GD on a linear model from zero; no validation, no accounting.

    Internal: the estimators validate and account; tests call it with
    ``noise_multiplier=0`` to compare with plain GD.  Step t:
    ``g = sum_i clip_C(r_i x_i^T) + noise_multiplier*C*xi_t`` (xi_t = the next D
    draws of ``seed``, a NoiseStream, int or None), over all rows (``batches=None``) or over
    ``batches[t]``; ``theta -= lr * g`` (divided by ``expected_batch_size`` when given);
    then the projection of eq. 3.2.  ``counts[i]`` makes row i stand for that many
    identical records (their clipped gradients are equal, so the sum is exact).
    ``init=(W, b)`` starts elsewhere than zero (benchmarks time a step from a trained W).

    Returns ``(W (K, p), b (K,) or None, info)`` in X's library.
    """
    ops = _Ops(X)
    n, p = X.shape
    K = num_classes
    W = ops.zeros((K, p)) if init is None else init[0]
    b = (ops.zeros((K,)) if init is None else init[1]) if fit_intercept else None
    Y = ops.asarray(np.eye(K)[y])
    cnt = None if counts is None else ops.asarray(counts)
    draws = K * p + (K if fit_intercept else 0)
    scale = lr / expected_batch_size if expected_batch_size else lr
    clipped = 0
    for t in range(steps):
        if batches is None:
            Xb, Yb, cb = X, Y, cnt
        else:
            idx = batches[t]
            Xb, Yb = ops.take(X, idx), ops.take(Y, idx)
            cb = None if cnt is None else ops.take(cnt, idx)
        z = Xb @ W.T
        if b is not None:
            z = z + b
        R = ops.softmax(z) - Yb if loss == "ce" else z - Yb
        if cb is None:
            res = clip_and_noise_linear(Xb, R, max_norm=max_grad_norm,
                                        noise_multiplier=noise_multiplier, bias=fit_intercept,
                                        seed=seed)
            gW, gb = res.grad_weight, res.grad_bias
            clipped += res.num_clipped
        else:
            # Identical records have identical clipped gradients: weight the clipped
            # distinct rows by their multiplicity; the noise comes from the same op
            # on an empty batch (same draws, same layout as the unweighted path).
            sq = ops.sq_norm(R, 1) * (ops.sq_norm(Xb, 1) + (1.0 if fit_intercept else 0.0))
            norm = sq ** 0.5
            if not bool((norm == norm).all() and (norm != float("inf")).all()):
                raise ValueError("per-sample gradients are not finite (NaN/Inf, e.g. a square "
                                 "loss diverging under a large lr); lower lr or use loss='ce'")
            # The clip rule of every op (reference.clip_factors), in float64 on the host.
            sq_h = np.ascontiguousarray(sq.detach().cpu().numpy() if ops.torch else sq,
                                        dtype=np.float64)
            f_h, _ = np.empty_like(sq_h), np.empty_like(sq_h)
            _clip_factors(sq_h, None, max_grad_norm, K + p + (K if fit_intercept else 0) + 2, 1,
                          float(np.finfo(np.float32 if str(ops.dtype).endswith("32")
                                         else np.float64).eps) / 2, f_h, _)
            f = ops.asarray(f_h, dtype=ops.t.float64 if ops.torch else np.float64)
            clipped += int(round(float((cb * (norm > max_grad_norm)).sum())))
            # float64 product, rounded once: a float32 factor may be a denormal.
            Rw = ops.asarray(R * (f * cb)[:, None])
            noise = clip_and_noise_linear(Xb[:0], R[:0], max_norm=max_grad_norm,
                                          noise_multiplier=noise_multiplier, bias=fit_intercept,
                                          seed=seed)
            gW = Rw.T @ Xb + noise.grad_weight
            gb = (Rw.sum(0) + noise.grad_bias) if fit_intercept else None
        W = W - scale * gW
        if b is not None:
            b = b - scale * gb
        if projection_radius is not None:
            nrm = float(ops.sq_norm(W) + (ops.sq_norm(b) if b is not None else 0.0)) ** 0.5
            if nrm > projection_radius:
                W = W * (projection_radius / nrm)
                if b is not None:
                    b = b * (projection_radius / nrm)
    return W, b, dict(num_clipped=clipped, draws=steps * draws)


# ----------------------------------------------------------- validation

def _check_real(value, name, *, positive=True, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or \
            (positive and value <= 0):
        raise ValueError(f"{name}: expected a finite number{' > 0' if positive else ''}, got "
                         f"{value!r}")
    return float(value)


def _check_int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def _prior_rho(preprocessing):
    """zCDP already spent on the private data by fitted preprocessors."""
    spent = []
    for i, pre in enumerate(preprocessing or ()):
        on = getattr(pre, "fitted_on_", None)
        if on not in ("public", "private"):
            raise ValueError(f"preprocessing[{i}]: expected a fitted Centering/PCAProjector "
                             f"(fit(X, public=True) or fit_private), got {pre!r}")
        if on == "private":
            spent.append(float(pre.rho_))
    return spent


@functools.lru_cache(maxsize=64)
def _calibrated(eps, delta, q, T, accountant):
    """calibrate_noise_multiplier, memoised: a pure function of public arguments (a sweep
    refits the same budget many times; a PLD calibration costs seconds)."""
    from .privacy import calibrate_noise_multiplier
    return calibrate_noise_multiplier(eps, delta, q, T, accountant=accountant)


@functools.lru_cache(maxsize=64)
def _poisson_epsilon(z, q, T, delta, accountant):
    """epsilon of T Poisson(q)-subsampled Gaussian steps, memoised (pure function)."""
    from .privacy import epsilon_poisson_gaussian
    return epsilon_poisson_gaussian(z, q, T, delta, accountant=accountant)


class _LinearBase:
    """fit / predict / score / decision_function shared by both estimators."""

    def _validate_common(self):
        if self.loss not in _LOSSES:
            raise ValueError(f"loss: expected one of {list(_LOSSES)}, got {self.loss!r}")
        _check_real(self.lr, "lr")
        _check_real(self.max_grad_norm, "max_grad_norm")
        _check_real(self.projection_radius, "projection_radius", allow_none=True)
        if self.num_classes is None:
            raise ValueError("num_classes: required (an integer >= 2): reading K from the "
                             "private labels as max(y) + 1 would reveal whether a record of "
                             "the largest class is present")
        _check_int(self.num_classes, "num_classes", 2)

    def __getstate__(self):
        # The noise key is secret: a pickled estimator (a model one may publish)
        # never carries it, whether given as an int or a NoiseStream.
        state = dict(self.__dict__)
        state["seed"] = None
        return state

    def _prepare(self, X, y):
        X = _float_features(X)
        n, p = _check_features(X)
        if n == 0:
            raise ValueError("X: expected at least one row, got 0")
        labels, K = check_labels(y, n, self.num_classes)
        return X, labels, n, p, K

    def _set_fitted(self, W, b, K, p):
        self.coef_, self.intercept_ = W, b
        self.classes_ = np.arange(K)
        self.n_features_in_ = p

    def decision_function(self, X):
        """Scores ``X W^T (+ b)``: (n, K) in X's library and device."""
        if not hasattr(self, "coef_"):
            raise RuntimeError(f"{type(self).__name__}: call fit first")
        X = _float_features(X)
        n, p = _check_features(X)
        if p != self.n_features_in_:
            raise ValueError(f"X: expected {self.n_features_in_} features, got {p}")
        ops = _Ops(X)
        z = X @ _to_lib(self.coef_, ops).T
        if self.intercept_ is not None:
            z = z + _to_lib(self.intercept_, ops)
        return z

    def predict(self, X):
        """Predicted labels argmax_k (W x)_k: (n,) int64 in X's library and device."""
        X = _float_features(X)
        return _Ops(X).argmax(self.decision_function(X))

    def score(self, X, y):
        """Accuracy on (X, y), a Python float."""
        pred = self.predict(X)
        pred = pred.detach().cpu().numpy() if _backend.is_torch(pred) else np.asarray(pred)
        labels, _ = check_labels(y, pred.shape[0], len(self.classes_))
        return float(np.mean(pred == labels))


class NoisyGDClassifier(_LinearBase):
    r"""Full-batch NoisyGD linear classifier from zero initialisation (eq. 2.1, eq. 3.2).

    Args:
        epsilon, delta: target (epsilon, delta)-DP of everything fitted on the private
            data (this fit plus private preprocessing), converted to a zCDP budget by
            :func:`ncdp_fast.privacy.dp_to_zcdp` (tight CKS conversion).  epsilon > 0,
            delta in (0, 1).
        rho: alternatively the zCDP budget itself (> 0, finite); give either rho or
            (epsilon, delta).  With ``rho`` a ``delta`` may still be given to report
            ``epsilon_``.
        steps: T >= 1 full-batch steps; each is a Gaussian mechanism of zCDP
            :math:`\rho_{train}/T`.
        lr: step size eta on the *sum* of clipped gradients (eq. 2.1).  With one step
            from zero, any lr gives the same predictions (Section 3.1).
        loss: "ce" (softmax cross entropy) or "square" (:math:`\frac12\|Wx-y\|^2`).
        max_grad_norm: C, the per-sample L2 clipping bound = sensitivity of the sum.
        projection_radius: R of eq. 3.2 (None: no projection); applied to
            (W, b) jointly after every step.  Post-processing, no privacy cost.
        fit_intercept: learn a bias (its gradient shares the sample's clip factor).
        num_classes: K >= 2, required: it is public, never read from the labels.
        seed: the noise key: None (from the OS), a 64-bit int, or a
            :class:`ncdp_fast.NoiseStream` shared with the rest of the workflow.
            Not stored on the fitted estimator, never pickled.
        offset: first draw (None: the next unused draw of ``seed``'s stream).

    Fitted attributes: ``coef_`` (K, p) and ``intercept_`` (K,) or None in the
    training data's library/device; ``rho_`` (total zCDP spent, preprocessing
    included), ``rho_train_``, ``sigma_`` (noise std), ``noise_multiplier_``
    (sigma / C), ``accountant_`` (:class:`~ncdp_fast.privacy.Accountant` with the
    preprocessing zCDP events and T Gaussian steps of sample rate 1),
    ``epsilon_``/``delta_`` (the accountant's epsilon at delta under zCDP; None when
    only rho was given), ``offset_``/``next_offset_`` (the draws used),
    ``num_clipped_``.
    """

    def __init__(self, *, epsilon=None, delta=None, rho=None, steps=1, lr=1.0, loss="ce",
                 max_grad_norm=1.0, projection_radius=None, fit_intercept=False,
                 num_classes=None, seed=None, offset=None):
        self.epsilon, self.delta, self.rho = epsilon, delta, rho
        self.offset = offset
        self.steps, self.lr, self.loss = steps, lr, loss
        self.max_grad_norm, self.projection_radius = max_grad_norm, projection_radius
        self.fit_intercept, self.num_classes, self.seed = fit_intercept, num_classes, seed

    def _budget(self):
        from .privacy import dp_to_zcdp
        from .privacy._validate import check_delta, check_positive
        if self.rho is not None:
            if self.epsilon is not None:
                raise ValueError("rho: give either rho or (epsilon, delta), got both")
            rho = check_positive("rho", self.rho)
            delta = None if self.delta is None else check_delta(self.delta)
            return rho, delta
        if self.epsilon is None or self.delta is None:
            raise ValueError("epsilon, delta: a privacy budget is required: (epsilon, delta) or "
                             f"rho; got epsilon={self.epsilon!r}, delta={self.delta!r}")
        eps = check_positive("epsilon", self.epsilon)
        delta = check_delta(self.delta)
        return dp_to_zcdp(eps, delta), delta

    def fit(self, X, y, *, counts=None, preprocessing=()):
        r"""Train on private features.

        Args:
            X: (n, p) float32/float64 features, NumPy or torch (CPU or CUDA); the
                computation stays in that library and device.
            y: (n,) integer labels in [0, K).
            counts: optional (n,) integers >= 1: row i stands for ``counts[i]``
                identical private records (exactly the same estimator, privacy and
                noise as fitting on ``np.repeat(X, counts, 0)``; used for synthetic
                NC data whose rows are K distinct vectors).
            preprocessing: fitted :class:`~ncdp_fast.nc.Centering` /
                :class:`~ncdp_fast.nc.PCAProjector` objects applied to X; those fitted
                on private data (``fit_private``) have their ``rho_`` subtracted from
                the budget and recorded in ``accountant_``.
        """
        from .privacy import Accountant, noisygd_sigma, zcdp_to_dp
        self._validate_common()
        T = _check_int(self.steps, "steps", 1)
        rho, delta = self._budget()
        spent = _prior_rho(preprocessing)
        rho_train = rho - sum(spent)
        if not rho_train > 0:
            raise ValueError(f"preprocessing: private preprocessing spent rho={sum(spent)!r}, "
                             f"the whole budget rho={rho!r}; nothing is left for training")
        X, labels, n, p, K = self._prepare(X, y)
        cnt = _check_counts(counts, n)
        stream = _stream.resolve(self.seed, self.offset)
        self.offset_ = stream.position
        C = float(self.max_grad_norm)
        sigma = noisygd_sigma(rho_train, T, sensitivity=C)
        z = sigma / C
        W, b, info = _linear_steps(X, labels, num_classes=K, steps=T, lr=float(self.lr),
                                   loss=self.loss, max_grad_norm=C, noise_multiplier=z,
                                   projection_radius=self.projection_radius,
                                   fit_intercept=bool(self.fit_intercept), seed=stream,
                                   counts=cnt)
        acc = Accountant()
        for r in spent:
            acc.add_zcdp(r)
        acc.step(noise_multiplier=z, sample_rate=1.0, steps=T)
        self._set_fitted(W, b, K, p)
        self.next_offset_ = stream.position
        self.sigma_, self.noise_multiplier_ = sigma, z
        self.rho_train_, self.rho_ = rho_train, acc.zcdp_rho()
        self.accountant_, self.delta_ = acc, delta
        self.epsilon_ = None if delta is None else zcdp_to_dp(self.rho_, delta)
        self.num_clipped_ = info["num_clipped"]
        self.n_steps_ = T
        return self


class NoisySGDClassifier(_LinearBase):
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
    ``num_clipped_``.
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
        from .privacy import Accountant
        if not spent:
            return _calibrated(eps, delta, q, T, self.accountant), self.accountant
        from scipy.optimize import brentq

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
        from ._mix import poisson_batches
        from .privacy import Accountant
        from .privacy._validate import check_choice, check_delta, check_positive, \
            check_sample_rate
        self._validate_common()
        eps = check_positive("epsilon", self.epsilon)
        delta = check_delta(self.delta)
        q = check_sample_rate(self.sample_rate)
        epochs = check_positive("epochs", self.epochs)
        check_choice("accountant", self.accountant, ("pld", "rdp", "gdp"))
        spent = _prior_rho(preprocessing)
        X, labels, n, p, K = self._prepare(X, y)
        T = max(1, int(round(epochs / q)))
        ebs = _check_real(self.expected_batch_size, "expected_batch_size", allow_none=True) \
            or q * n
        stream = _stream.resolve(self.seed, self.offset)
        self.offset_ = stream.position
        z, acc_name = self._calibrate(eps, delta, q, T, spent)
        plan = poisson_batches(n, sample_rate=q, steps=T, seed=stream)
        C = float(self.max_grad_norm)
        W, b, info = _linear_steps(X, labels, num_classes=K, steps=T, lr=float(self.lr),
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
