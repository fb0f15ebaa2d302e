r"""Full-batch DP-GD on a linear-in-parameters model (random features or raw
features), lecture notes 004_f44587b9249a6ca9.txt, "Deep learning with
differential privacy" / "Privacy for free in the overparameterized regime".

Loss (y - phi.theta)^2; one step releases theta - (eta/n) sum_i clip_C(g_i) plus
N(0, s^2 I_p), s = sqrt(eta) (2C/n) sigma.  Under replace-one (n public) the
sensitivity is 2 C eta / n, so each step is (eta/(2 sigma^2))-zCDP and T steps
compose to rho = T eta/(2 sigma^2); the exact PLD epsilon and the slides'
moments-accountant bound are reported too.  Derivation: docs/theory.md, section 2.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from . import _stream
from ._validate import as_matrix, as_targets, check_delta, check_nonneg, check_pos_int, check_positive
from ._clip import clip_and_noise_linear
from .ntk.regress import activation_derivatives, draw_rf_weights
from .privacy import dp_to_zcdp, epsilon_poisson_gaussian
from .privacy.truncation import ideal_delta, zcdp_epsilon

__all__ = ["DPGDRegressor"]


def _rf_seed(key: int, offset: int) -> int:
    """The random features' seed from the noise key and the first draw: a
    one-way function (recovering the key from it is a 2^64 search)."""
    digest = hashlib.sha256(b"ncdp_fast rf weights" + key.to_bytes(8, "little")
                            + offset.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little")


class DPGDRegressor:
    """Full-batch DP-GD on f(x) = phi(x).theta (slides, "Differentially-private
    gradient descent"), loss (y - f)^2, theta_0 = 0:

        theta <- theta - eta (1/n) sum_i clip_C(grad l_i) + sqrt(eta) (2C/n) sigma N(0, I_p)

    implemented with the fused factored kernel :func:`ncdp_fast.clip_and_noise_linear`
    (per-sample gradient 2 r_i phi_i never formed) at noise multiplier
    2 sigma/sqrt(eta), then scaled by eta/n -- the same noise as the slides.

    Args:
        features: "rf" (random features phi(V x), V (p, d) ~ N(0, scale/d), drawn
            from public randomness at fit) or "raw" (phi(x) = x).
        num_features, activation, scale: of the random features.
        clip: C > 0, per-sample gradient norm bound (privacy: the sensitivity of
            one step is 2 C eta / n under replace-one).
        lr: eta > 0;  steps: T >= 1.
        sigma: the slides' sigma >= 0 (0 = non-private GD with clipping), or
        epsilon, delta: target (eps, delta)-DP; sigma is then calibrated through
            zCDP: sigma = sqrt(eta T / (2 rho)), rho = dp_to_zcdp(eps, delta).
        seed: the noise key -- None (OS), an int or a :class:`ncdp_fast.NoiseStream`;
            never stored.  The feature weights V (public randomness) use their own
            seed, ``rf_seed_``, derived one-way from the key and the first draw
            position (SHA-256: a published ``rf_seed_`` must not give the key away,
            which NumPy's SeedSequence mixing, invertible word by word, does not
            promise).
        offset: first draw (None: the next unused draw of ``seed``'s stream).

    After ``fit``: theta_ (p,), privacy_ (dict: rho_zcdp, epsilon_zcdp, epsilon_pld,
    epsilon_moments (the slides' bound), delta, noise_multiplier_per_step
    sigma/sqrt(eta)), num_clipped_ (per step; the private data's, unnoised: in the
    fitting process only), offset_/next_offset_, rf_seed_.
    """

    def __init__(self, *, features="rf", num_features=None, activation="tanh", scale=1.0,
                 clip, lr, steps, sigma=None, epsilon=None, delta=None, seed=None, offset=None):
        if features not in ("rf", "raw"):
            raise ValueError(f"features: expected 'rf' or 'raw', got {features!r}")
        if features == "rf":
            num_features = check_pos_int(num_features, "num_features")
        self.features, self.num_features, self.activation = features, num_features, activation
        self.scale = check_positive(scale, "scale")
        self.clip = check_positive(clip, "clip")
        self.lr = check_positive(lr, "lr")
        self.steps = check_pos_int(steps, "steps")
        if delta is not None:
            delta = check_delta(delta)
        if (sigma is None) == (epsilon is None):
            raise ValueError("DPGDRegressor: give either sigma or (epsilon, delta)")
        if epsilon is not None:
            if delta is None:
                raise ValueError("delta: required with epsilon")
            epsilon = check_positive(epsilon, "epsilon")
            # The zCDP budget leaves room for the sampler's truncated tails.
            sigma = math.sqrt(self.lr * self.steps /
                              (2.0 * dp_to_zcdp(epsilon, ideal_delta(delta, epsilon))))
        self.sigma = check_nonneg(sigma, "sigma")
        self.epsilon, self.delta = epsilon, delta
        self.seed, self.offset = seed, offset

    # The rows each step clipped: the private data's, without noise.
    num_clipped_ = _stream.Unreleased(
        "rows clipped at each step, without noise: readable in the fitting process, never "
        "in the estimator's pickle, copy or vars() (it is the private data's)")

    def __getstate__(self):
        state = dict(self.__dict__)
        state["seed"] = None         # the noise key is never pickled
        return state

    def transform(self, x):
        """phi(x): (m, p) float64 with the fitted feature weights."""
        x = as_matrix(x, "x")
        if self.features == "raw":
            return x
        if x.shape[1] != self.V_.shape[1]:
            raise ValueError(f"x: expected {self.V_.shape[1]} columns, got {x.shape}")
        return activation_derivatives(self.activation, x @ self.V_.T)[0]

    def _step_gradient(self, Phi, y, theta, noise_multiplier, stream):
        """sum_i clip_C(2 r_i phi_i) + noise_multiplier C N(0, I): the fused kernel."""
        r = Phi @ theta - y
        res = clip_and_noise_linear(Phi, (2.0 * r)[:, None], max_norm=self.clip,
                                    noise_multiplier=noise_multiplier, bias=False,
                                    seed=stream)
        return res.grad_weight[0], res

    def per_sample_contributions(self, x, y, theta):
        """clip_C(grad l_i) for every sample, (n, p), each computed by the fused
        kernel on that sample alone with zero noise (a check of the kernel's
        clipping, not used in training)."""
        Phi = self.transform(x)
        y = as_targets(y, Phi.shape[0])
        r = Phi @ np.asarray(theta, np.float64) - y
        out = np.empty_like(Phi)
        for i in range(Phi.shape[0]):
            out[i] = clip_and_noise_linear(Phi[i:i + 1], (2.0 * r[i:i + 1])[:, None],
                                           max_norm=self.clip, noise_multiplier=0.0,
                                           bias=False).grad_weight[0]
        return out

    def fit(self, x, y, *, callback=None):
        """Run T steps from theta_0 = 0.  callback(t, theta) after each step (e.g.
        to record a test risk; it sees only the private iterate)."""
        x = as_matrix(x, "x", min_rows=1)
        y = as_targets(y, x.shape[0])
        n = x.shape[0]
        stream = _stream.resolve(self.seed, self.offset)
        self.offset_ = stream.position
        if self.features == "rf":
            # V is public randomness, independent of the noise and of the data.
            self.rf_seed_ = _rf_seed(stream.seed, self.offset_)
            self.V_, _ = draw_rf_weights(self.num_features, x.shape[1], self.scale,
                                          self.rf_seed_)
        Phi = self.transform(x)
        p = Phi.shape[1]
        theta = np.zeros(p)
        nm = 2.0 * self.sigma / math.sqrt(self.lr)
        self.num_clipped_ = []
        for t in range(self.steps):
            g, res = self._step_gradient(Phi, y, theta, nm, stream)   # the next draws
            theta = theta - (self.lr / n) * g
            self.num_clipped_.append(res.num_clipped)
            if callback is not None:
                callback(t, theta)
        self.theta_ = theta
        self.next_offset_ = stream.position
        self.privacy_ = self.privacy(self.delta if self.delta is not None else 1.0 / n ** 2)
        return self

    def privacy(self, delta):
        """The guarantee of a fit with this sigma, eta, T (replace-one, sensitivity
        2 C eta / n per step): zCDP rho = T eta/(2 sigma^2) and its epsilon, the
        exact PLD epsilon of T Gaussian mechanisms of noise multiplier
        sigma/sqrt(eta), and the slides' moments-accountant epsilon
        sqrt(8 eta T log(1/delta))/sigma (valid while < 8 log(1/delta))."""
        delta = check_delta(delta)
        if self.sigma == 0:
            return dict(rho_zcdp=math.inf, epsilon_zcdp=math.inf, epsilon_pld=math.inf,
                        epsilon_moments=math.inf, delta=delta, noise_multiplier_per_step=0.0)
        rho = self.steps * self.lr / (2.0 * self.sigma ** 2)
        z = self.sigma / math.sqrt(self.lr)
        eps_ma = math.sqrt(8.0 * self.lr * self.steps * math.log(1.0 / delta)) / self.sigma
        return dict(rho_zcdp=rho, epsilon_zcdp=zcdp_epsilon(rho, delta),
                    epsilon_pld=epsilon_poisson_gaussian(z, 1.0, self.steps, delta),
                    epsilon_moments=eps_ma if eps_ma < 8.0 * math.log(1.0 / delta) else math.inf,
                    delta=delta, noise_multiplier_per_step=z)

    def predict(self, x):
        if not hasattr(self, "theta_"):
            raise RuntimeError("DPGDRegressor: call fit(x, y) first")
        return self.transform(x) @ self.theta_
