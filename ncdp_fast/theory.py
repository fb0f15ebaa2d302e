r"""Dynamics of private gradient methods from the lecture notes 004_f44587b9249a6ca9.txt.

* :class:`DPGDRegressor` -- full-batch DP-GD on a linear-in-parameters model
  (random features or raw features), slides "Deep learning with differential
  privacy" / "Privacy for free in the overparameterized regime".
* :func:`dpsgd_linear_regression` -- one-pass DP-SGD with clipping for linear
  regression and the three schedules of "Optimal rates & benefit of clipping".
* :func:`dpsgd_risk_ode` -- the deterministic ODEs of "DP-SGD with clipping:
  sharp analysis", with :func:`clip_factors` (mu_c, nu_c) in closed form.

Derivations (docs/theory.md has them in full):

DP-GD sensitivity.  Loss l(y, yhat) = (y - yhat)^2 (the slides' square loss of
"Privacy for free"), per-sample gradient g_i = 2 (phi_i.theta - y_i) phi_i.  One
step releases mu(D) = theta - (eta/n) sum_i clip_C(g_i) plus N(0, s^2 I_p) with
s = sqrt(eta) (2C/n) sigma.  Neighbouring datasets differ by *replacing* one
record (the slides' "differ by only one sample", n fixed and public), so
mu(D) - mu(D') = (eta/n)(clip_C(g) - clip_C(g')) has norm <= 2 C eta / n.  The
step is a Gaussian mechanism with sensitivity/std = (2C eta/n)/s = sqrt(eta)/sigma,
i.e. (eta/(2 sigma^2))-zCDP (Bun & Steinke 2016, Prop. 1.6); T adaptive steps
compose to rho = T eta/(2 sigma^2) and, exactly, to a Gaussian mechanism with
noise multiplier sigma/sqrt(eta T) (what the PLD accountant reports).  The
slides' moments-accountant bound: (eps, delta)-DP when
sigma >= sqrt(eta T) sqrt(8 log(1/delta))/eps, eps < 8 log(1/delta), i.e.
eps_MA = sqrt(8 eta T log(1/delta))/sigma.

DP-SGD privacy (amplification by iteration, Feldman et al. 2018; slides'
Proposition).  Step k (k = 0..n-1) uses sample k once:
theta_{k+1} = theta_k - eta_k clip_C(g_k) + 2 C sigma_k xi_k, C = c sqrt(d).  With
theta -> theta - eta clip_C((x.theta - y) x) = theta - eta psi(x.theta - y) x, psi
the Huber derivative clipped at C/||x|| (monotone, 1-Lipschitz), the map is
contractive iff eta ||x||^2 <= 2.  Replacing sample k moves step k by at most
2 C eta_k and the noise of steps k..n-1 hides it: Renyi divergence of order a
<= a eta_k^2 / (2 sum_{j>=k} sigma_j^2), i.e. (rho^2/2)-zCDP with
rho = max_k eta_k / sqrt(sum_{j>=k} sigma_j^2).  The schedule
rho^2 sigma_k^2 = eta_k^2 - eta_{k+1}^2 (k < n-1), rho^2 sigma_{n-1}^2 = eta_{n-1}^2
makes every ratio equal to rho (telescoping).  Only the last iterate is released.

Clip factors for Gaussian residuals.  x ~ N(0, Sigma), z ~ N(0, tau^2) give
r = x.(theta - theta*) - z ~ N(0, s^2), s^2 = 2 R_exc + tau^2.  Stein's lemma for
the jointly Gaussian (x, r): E[g(r) x] = E[g'(r)] E[r x], so with
g = clip at c: mu_c = ||E[r_c x]|| / ||E[r x]|| = P(|r| < c) = erf(u/sqrt 2),
u = c/s; and E[min(r^2, c^2)] = s^2 [erf(u/sqrt2) - 2 u phi(u)] + c^2 erfc(u/sqrt2),
so nu_c = erf(u/sqrt2) - 2 u phi(u) + u^2 erfc(u/sqrt2) (phi the N(0,1) density).

ODE.  Eigenbasis of Sigma (eigenvalues lambda_i, Tr Sigma = d), e = theta - theta*,
D_i = d e_i^2 / 2, R = (1/d) sum lambda_i D_i = R_exc.  One step in expectation,
with E[clip(g)] ~ mu_c Sigma e and E[clip(g) clip(g)^T] ~ nu_c s^2 Sigma
(||x|| ~ sqrt d, the rank-one 2 Sigma e e^T Sigma term dropped):
E dD_i = -2 eta_k mu_c lambda_i D_i + (d/2) eta_k^2 nu_c s^2 lambda_i + 2 d C^2 sigma_k^2.
With eta_k = eta~(k/n)/n, dt = 1/n, rho^2 sigma~^2 = -(eta~^2)' (so sigma_k^2 =
sigma~^2(k/n)/n^3) and gamma = d/n:
dD_i/dt = -2 lambda_i eta~ mu_c(R) D_i + lambda_i eta~^2 nu_c(R)(R + tau^2/2) gamma
          + 2 c^2 sigma~^2 gamma^2,                                  (slides (*))
D_i(0) = d (theta*.u_i)^2 / 2.  The last step's noise (sigma_{n-1} = eta_{n-1}/rho)
adds the jump 2 c^2 gamma^2 eta~(1)^2 / rho^2 to R at t = 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import _backend, _stream
from .ntk.regress import _as_matrix as _matrix
from .ntk.regress import _as_targets as _targets
from .ntk.regress import _check_pos_int as _pos_int

__all__ = ["SCHEDULES", "clip_factors", "schedule_lr", "noise_schedule", "DPGDRegressor",
           "DPSGDResult", "dpsgd_linear_regression", "ODEResult", "dpsgd_risk_ode"]

SCHEDULES = ("output", "constant", "optimal")
_SQRT2 = math.sqrt(2.0)


# ------------------------------------------------------------------- validation

def _finite(v, name, *, positive=False, nonneg=False):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {type(v).__name__} {v!r}")
    v = float(v)
    if not math.isfinite(v) or (positive and v <= 0) or (nonneg and v < 0):
        what = "> 0" if positive else (">= 0" if nonneg else "finite")
        raise ValueError(f"{name}: expected a finite number {what}, got {v!r}")
    return v


# ---------------------------------------------------------------- clip factors

def clip_factors(c, excess_risk, noise_std):
    """(mu_c, nu_c) for Gaussian residuals r ~ N(0, 2 R_exc + tau^2) (module docstring).

    mu_c = P(|r| < c) = erf(u/sqrt2) (descent reduction), nu_c = E[r_c^2]/E[r^2] =
    erf(u/sqrt2) - 2u phi(u) + u^2 erfc(u/sqrt2) (variance reduction), u = c/s.
    c: residual clipping level (> 0, or inf for no clipping); excess_risk:
    scalar or array >= 0; noise_std: tau >= 0.  Returns arrays shaped like
    excess_risk.
    """
    from scipy.special import erf, erfc
    c = float(c)
    if not c > 0:
        raise ValueError(f"c: expected > 0 (inf for no clipping), got {c!r}")
    R = np.asarray(excess_risk, dtype=np.float64)
    s = np.sqrt(np.maximum(2.0 * R + float(noise_std) ** 2, 1e-300))
    if math.isinf(c):
        return np.ones_like(s), np.ones_like(s)
    u = c / s
    mu = erf(u / _SQRT2)
    nu = mu - 2.0 * u * np.exp(-0.5 * u * u) / math.sqrt(2 * math.pi) + u * u * erfc(u / _SQRT2)
    return mu, np.clip(nu, 0.0, 1.0)


# ------------------------------------------------------------------- schedules

def _optimal_offset(gamma, rho, c2, c3):
    return gamma * max(c2, c3 / rho)


def schedule_lr(t, schedule, *, lr0=None, gamma=None, rho=None, c1=2.0, c2=4.0, c3=4.0):
    """Continuous learning rate eta~(t), t in [0, 1] (slides "Optimal rates & benefit
    of clipping"): "output" eta~(0); "constant" eta~(0) sqrt(1 - t); "optimal"
    c1 / (t + gamma max(c2, c3/rho)).  The slides leave c1, c2, c3 unspecified
    ("explicit constants independent of gamma, rho"); the defaults are ours:
    c1 = 2 makes 2 c1 mu_c > 2 for the mu_c >= 0.5 of the experiments (so the DP
    term integrates to O(gamma^2/rho^2)), c2 = 2 c1 keeps eta~(0) gamma <= 1/2
    inside the stability region eta~ < 2/gamma."""
    t = np.asarray(t, dtype=np.float64)
    if schedule == "output":
        return np.full_like(t, lr0)
    if schedule == "constant":
        return lr0 * np.sqrt(np.maximum(1.0 - t, 0.0))
    if schedule == "optimal":
        return c1 / (t + _optimal_offset(gamma, rho, c2, c3))
    raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")


def _sigma_tilde_sq(t, schedule, lr0, gamma, rho, c1, c2, c3):
    """sigma~^2(t) = -(eta~^2)'(t) / rho^2 on [0, 1) (zero for output perturbation)."""
    t = np.asarray(t, dtype=np.float64)
    if schedule == "output":
        return np.zeros_like(t)
    if schedule == "constant":
        return np.full_like(t, lr0 * lr0 / rho ** 2)
    a = _optimal_offset(gamma, rho, c2, c3)
    return 2.0 * c1 * c1 / (t + a) ** 3 / rho ** 2


def noise_schedule(eta, rho):
    """sigma_k from rho^2 sigma_k^2 = eta_k^2 - eta_{k+1}^2 (k < n-1) and
    rho^2 sigma_{n-1}^2 = eta_{n-1}^2 (slides' Proposition); eta must be
    non-increasing and > 0.  Returns (n,) float64."""
    rho = _finite(rho, "rho", positive=True)
    eta = np.asarray(eta, dtype=np.float64)
    if eta.ndim != 1 or eta.size == 0 or np.any(eta <= 0) or not np.all(np.isfinite(eta)):
        raise ValueError("eta: expected a non-empty 1-D array of finite step sizes > 0")
    diff = np.empty_like(eta)
    diff[:-1] = eta[:-1] ** 2 - eta[1:] ** 2
    diff[-1] = eta[-1] ** 2
    if np.any(diff < -1e-12 * eta[:-1].max() ** 2 if eta.size > 1 else False):
        raise ValueError("eta: the noise schedule needs non-increasing step sizes")
    return np.sqrt(np.maximum(diff, 0.0)) / rho


def realized_rho(eta, sigma):
    """rho = max_k eta_k / sqrt(sum_{j>=k} sigma_j^2): the output is (rho^2/2)-zCDP
    (amplification by iteration; requires eta_k ||x_k||^2 <= 2)."""
    eta = np.asarray(eta, np.float64)
    tail = np.cumsum((np.asarray(sigma, np.float64) ** 2)[::-1])[::-1]
    with np.errstate(divide="ignore"):
        return float(np.max(np.where(tail > 0, eta / np.sqrt(tail), np.inf)))


# ------------------------------------------------------------------ DP-GD

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
            seed, ``rf_seed_``, derived one-way from the key's first draw position
            and the key (SeedSequence hashing).
        offset: first draw (None: the next unused draw of ``seed``'s stream).

    After ``fit``: theta_ (p,), privacy_ (dict: rho_zcdp, epsilon_zcdp, epsilon_pld,
    epsilon_moments (the slides' bound), delta, noise_multiplier_per_step
    sigma/sqrt(eta)), num_clipped_ (per step), offset_/next_offset_, rf_seed_.
    """

    def __init__(self, *, features="rf", num_features=None, activation="tanh", scale=1.0,
                 clip, lr, steps, sigma=None, epsilon=None, delta=None, seed=None, offset=None):
        if features not in ("rf", "raw"):
            raise ValueError(f"features: expected 'rf' or 'raw', got {features!r}")
        if features == "rf":
            num_features = _pos_int(num_features, "num_features")
        self.features, self.num_features, self.activation = features, num_features, activation
        self.scale = _finite(scale, "scale", positive=True)
        self.clip = _finite(clip, "clip", positive=True)
        self.lr = _finite(lr, "lr", positive=True)
        self.steps = _pos_int(steps, "steps")
        if delta is not None:
            delta = _finite(delta, "delta", positive=True)
            if delta >= 1:
                raise ValueError(f"delta: expected a number in (0, 1), got {delta!r}")
        if (sigma is None) == (epsilon is None):
            raise ValueError("DPGDRegressor: give either sigma or (epsilon, delta)")
        if epsilon is not None:
            from .privacy import dp_to_zcdp
            if delta is None:
                raise ValueError("delta: required with epsilon")
            epsilon = _finite(epsilon, "epsilon", positive=True)
            sigma = math.sqrt(self.lr * self.steps / (2.0 * dp_to_zcdp(epsilon, delta)))
        self.sigma = _finite(sigma, "sigma", nonneg=True)
        self.epsilon, self.delta = epsilon, delta
        self.seed, self.offset = seed, offset

    def __getstate__(self):
        state = dict(self.__dict__)
        state["seed"] = None         # the noise key is never pickled
        return state

    def transform(self, x):
        """phi(x): (m, p) float64 with the fitted feature weights."""
        x = _matrix(x, "x")
        if self.features == "raw":
            return x
        from .ntk.regress import _act3
        if x.shape[1] != self.V_.shape[1]:
            raise ValueError(f"x: expected {self.V_.shape[1]} columns, got {x.shape}")
        return _act3(self.activation, x @ self.V_.T)[0]

    def _step_gradient(self, Phi, y, theta, noise_multiplier, stream):
        """sum_i clip_C(2 r_i phi_i) + noise_multiplier C N(0, I): the fused kernel."""
        from . import clip_and_noise_linear
        r = Phi @ theta - y
        res = clip_and_noise_linear(Phi, (2.0 * r)[:, None], max_norm=self.clip,
                                    noise_multiplier=noise_multiplier, bias=False,
                                    seed=stream)
        return res.grad_weight[0], res

    def per_sample_contributions(self, x, y, theta):
        """clip_C(grad l_i) for every sample, (n, p), each computed by the fused
        kernel on that sample alone with zero noise (a check of the kernel's
        clipping, not used in training)."""
        from . import clip_and_noise_linear
        Phi = self.transform(x)
        y = _targets(y, Phi.shape[0])
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
        x = _matrix(x, "x")
        y = _targets(y, x.shape[0])
        n = x.shape[0]
        stream = _stream.resolve(self.seed, self.offset)
        self.offset_ = stream.position
        if self.features == "rf":
            # V is public randomness, independent of the noise and of the data.
            self.rf_seed_ = int(np.random.SeedSequence([stream.seed, self.offset_, 1])
                                .generate_state(1, np.uint64)[0])
            from .ntk.regress import _draw_rf_weights
            self.V_, _ = _draw_rf_weights(self.num_features, x.shape[1], self.scale,
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
        from .privacy import epsilon_poisson_gaussian, zcdp_to_dp
        if self.sigma == 0:
            return dict(rho_zcdp=math.inf, epsilon_zcdp=math.inf, epsilon_pld=math.inf,
                        epsilon_moments=math.inf, delta=delta, noise_multiplier_per_step=0.0)
        rho = self.steps * self.lr / (2.0 * self.sigma ** 2)
        z = self.sigma / math.sqrt(self.lr)
        eps_ma = math.sqrt(8.0 * self.lr * self.steps * math.log(1.0 / delta)) / self.sigma
        return dict(rho_zcdp=rho, epsilon_zcdp=zcdp_to_dp(rho, delta),
                    epsilon_pld=epsilon_poisson_gaussian(z, 1.0, self.steps, delta),
                    epsilon_moments=eps_ma if eps_ma < 8.0 * math.log(1.0 / delta) else math.inf,
                    delta=delta, noise_multiplier_per_step=z)

    def predict(self, x):
        if not hasattr(self, "theta_"):
            raise RuntimeError("DPGDRegressor: call fit(x, y) first")
        return self.transform(x) @ self.theta_


# ------------------------------------------------------------------ DP-SGD

@dataclass
class DPSGDResult:
    """Output of :func:`dpsgd_linear_regression`.

    theta: (d,) the released last iterate; eta, sigma: (n,) the schedules (step k
    adds 2 C sigma_k N(0, I)); rho: the realized max_k eta_k/sqrt(sum_{j>=k}
    sigma_j^2) (zCDP rho^2/2); contractive: max_k eta_k ||x_k||^2 <= 2 (the
    condition of amplification by iteration -- a property of the data that the
    caller must guarantee by a public norm bound; it is reported, not enforced);
    times, excess_risk: the path 1/2 (theta-theta*)^T Sigma (theta-theta*) at
    t = k/n (when theta_star was given), the last entry after the final noise;
    clip_fraction: fraction of steps whose gradient was clipped; seed.
    """
    theta: np.ndarray
    eta: np.ndarray
    sigma: np.ndarray
    rho: float
    contractive: bool
    clip_norm: float
    seed: int
    clip_fraction: float
    times: np.ndarray = field(default_factory=lambda: np.empty(0))
    excess_risk: np.ndarray = field(default_factory=lambda: np.empty(0))


def _schedule_args(clip, rho, schedule, lr0):
    """Checked (clip, rho, lr0) shared by the simulation and its ODE."""
    c = _finite(clip, "clip", positive=True)
    rho = _finite(rho, "rho", positive=True)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if schedule != "optimal":
        if lr0 is None:
            raise ValueError(f"lr0: required for schedule {schedule!r}")
        lr0 = _finite(lr0, "lr0", positive=True)
    return c, rho, lr0


def _schedule_eta(n, d, schedule, lr0, rho, c1, c2, c3):
    t = np.arange(n) / n                                    # step k at time k/n
    return schedule_lr(t, schedule, lr0=lr0, gamma=d / n, rho=rho, c1=c1, c2=c2, c3=c3) / n


def dpsgd_linear_regression(x, y, *, clip, schedule, rho, seed=None, lr0=None, c1=2.0, c2=4.0,
                            c3=4.0, theta_star=None, cov=None, record_every=None):
    """One-pass DP-SGD with per-sample clipping for linear regression (slides "DP-SGD
    with clipping: settings"), square loss 1/2 (y - x.theta)^2, theta_0 = 0:

        theta_{k+1} = theta_k - eta_k clip_C((x_k.theta_k - y_k) x_k) + 2 C sigma_k N(0, I_d)

    C = clip * sqrt(d) (the slides' C_clip = c sqrt(d): with ||x|| ~ sqrt(d) this
    clips the residual at ~c); eta_k = eta~(k/n)/n from :func:`schedule_lr`; sigma_k
    from :func:`noise_schedule` so that the output is (rho^2/2)-zCDP (replace-one).

    Args:
        x: (n, d) float64, each row used once, in order (n = number of steps).
        y: (n,).
        clip: c > 0.   schedule: "output", "constant" or "optimal".
        rho: target rho > 0 (the slides' rho: (rho^2/2)-zCDP).
        seed: noise seed (None: 64 bits from the OS; kept in the result).
        lr0: eta~(0) of "output"/"constant" (required for them).
        c1, c2, c3: the optimal schedule's constants (see :func:`schedule_lr`).
        theta_star, cov: (d,), (d, d) (None: identity) to record the excess risk
            every ``record_every`` steps (default n // 100); evaluation only.
    Returns a :class:`DPSGDResult`.
    """
    x = _matrix(x, "x")
    n, d = x.shape
    y = _targets(y, n)
    c, rho, lr0 = _schedule_args(clip, rho, schedule, lr0)
    eta = _schedule_eta(n, d, schedule, lr0, rho, c1, c2, c3)
    sigma = noise_schedule(eta, rho)
    C = c * math.sqrt(d)
    seed = _backend.resolve_seed(seed)
    rng = np.random.default_rng(seed)
    sq = np.einsum("ij,ij->i", x, x)
    contractive = bool(np.max(eta * sq) <= 2.0)
    track = theta_star is not None
    if track:
        theta_star = np.asarray(theta_star, np.float64)
        if theta_star.shape != (d,):
            raise ValueError(f"theta_star: expected shape ({d},), got {theta_star.shape}")
        S = np.eye(d) if cov is None else np.asarray(cov, np.float64)
        if S.shape != (d, d):
            raise ValueError(f"cov: expected shape ({d}, {d}), got {S.shape}")
        every = max(1, n // 100) if record_every is None else _pos_int(record_every, "record_every")

        def risk(th):
            e = th - theta_star
            return 0.5 * float(e @ (S @ e))
        times, risks = [0.0], [risk(np.zeros(d))]
    theta = np.zeros(d)
    norms = np.sqrt(sq)
    clipped = 0
    block = 2048
    noise_buf, buf_start = None, -1
    for k in range(n):
        r = float(x[k] @ theta) - y[k]
        gn = abs(r) * norms[k]
        scale = r if gn <= C else r * (C / gn)
        clipped += gn > C
        theta -= (eta[k] * scale) * x[k]
        if sigma[k] > 0:
            # Fresh Gaussian noise, drawn in blocks of the steps that need it.
            if noise_buf is None or k >= buf_start + block:
                buf_start = k
                noise_buf = rng.standard_normal((min(block, n - k), d))
            theta += (2.0 * C * sigma[k]) * noise_buf[k - buf_start]
        if track and ((k + 1) % every == 0 or k == n - 1):
            times.append((k + 1) / n)
            risks.append(risk(theta))
    out = DPSGDResult(theta=theta, eta=eta, sigma=sigma, rho=realized_rho(eta, sigma),
                      contractive=contractive, clip_norm=C, seed=seed, clip_fraction=clipped / n)
    if track:
        out.times, out.excess_risk = np.array(times), np.array(risks)
    return out


# --------------------------------------------------------------------- ODE

@dataclass
class ODEResult:
    """times (m,) in [0, 1]; risk (m,) the ODE's excess risk R(t) (for mode
    "bounds": the upper bound); lower, upper (m,) (equal to risk when Sigma = I);
    final: R at t = 1 including the last-step noise jump; final_lower/upper."""
    times: np.ndarray
    risk: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    final: float
    final_lower: float
    final_upper: float
    jump: float


def dpsgd_risk_ode(*, d, n, clip, schedule, rho, noise_std, theta_star=None, cov=None,
                   initial_risk=None, lr0=None, c1=2.0, c2=4.0, c3=4.0, mode="auto",
                   t_eval=None, rtol=1e-8, atol=1e-12):
    """Deterministic equivalent of the DP-SGD excess risk (slides "DP-SGD with
    clipping: sharp analysis"), solved with ``scipy.integrate.solve_ivp`` (LSODA).

    mode: "coupled" -- the d ODEs (*) for D_i in Sigma's eigenbasis (needs
    theta_star; eigenvalues with multiplicity are grouped); "bounds" -- the two
    decoupled ODEs for R_upper (-2 lambda_min, +lambda_max) and R_lower (-2 lambda_max,
    coefficient 1 >= ... since (1/d) sum lambda_i^2 >= 1 by Jensen); "isotropic" -- one ODE
    (Sigma = I); "auto": isotropic when cov is None else coupled.
    Args: d, n (gamma = d/n); clip c > 0; schedule, rho, lr0,
    c1..c3 as :func:`dpsgd_linear_regression`; noise_std tau (label noise);
    theta_star (d,) or initial_risk R(0) = 1/2 theta*^T Sigma theta* (isotropic,
    bounds); cov (d, d) with trace d (the slides' normalisation).
    Returns an :class:`ODEResult`.
    """
    from scipy.integrate import solve_ivp
    d, n = _pos_int(d, "d"), _pos_int(n, "n")
    c, rho, lr0 = _schedule_args(clip, rho, schedule, lr0)
    tau = _finite(noise_std, "noise_std", nonneg=True)
    gamma = d / n
    if cov is None:
        lam = np.ones(1)
    else:
        S = np.asarray(cov, np.float64)
        if S.shape != (d, d):
            raise ValueError(f"cov: expected shape ({d}, {d}), got {S.shape}")
        if abs(np.trace(S) - d) > 1e-6 * d:
            raise ValueError(f"cov: the ODE assumes Tr(Sigma) = d = {d}, got {np.trace(S):.6g}")
        lam, U = np.linalg.eigh(S)
    if mode == "auto":
        mode = "isotropic" if cov is None else "coupled"
    if mode not in ("coupled", "bounds", "isotropic"):
        raise ValueError(f"mode: expected 'auto', 'coupled', 'bounds' or 'isotropic', got {mode!r}")
    if theta_star is not None:
        theta_star = np.asarray(theta_star, np.float64)
        if theta_star.shape != (d,):
            raise ValueError(f"theta_star: expected shape ({d},), got {theta_star.shape}")
    if mode == "coupled" and (theta_star is None or cov is None):
        raise ValueError("mode='coupled': needs theta_star and cov")
    if initial_risk is None:
        if theta_star is None:
            raise ValueError("initial_risk: give initial_risk or theta_star")
        initial_risk = 0.5 * float(theta_star @ theta_star) if cov is None else \
            0.5 * float(theta_star @ (S @ theta_star))
    R0 = _finite(initial_risk, "initial_risk", nonneg=True)
    kw = dict(lr0=lr0, gamma=gamma, rho=rho, c1=c1, c2=c2, c3=c3)

    def coeffs(t, R):
        et = float(schedule_lr(t, schedule, **kw))
        s2 = float(_sigma_tilde_sq(t, schedule, lr0, gamma, rho, c1, c2, c3))
        mu, nu = clip_factors(c, max(R, 0.0), tau)
        return et, s2, float(mu), float(nu)

    def scalar_rhs(lam_descent, lam_var):
        def f(t, R):
            et, s2, mu, nu = coeffs(t, R[0])
            return [-2.0 * lam_descent * et * mu * R[0]
                    + lam_var * et * et * nu * (R[0] + tau * tau / 2.0) * gamma
                    + 2.0 * c * c * s2 * gamma * gamma]
        return f

    grid = np.linspace(0.0, 1.0, 201) if t_eval is None else np.asarray(t_eval, np.float64)
    opts = dict(method="LSODA", t_eval=grid, rtol=rtol, atol=atol)
    if mode == "coupled":
        # Group equal eigenvalues: D_i with the same lambda_i obey the same ODE
        # up to the initial value, and only their sum enters R.
        proj = (U.T @ theta_star) ** 2 * d / 2.0
        lv, inv = np.unique(np.round(lam, 12), return_inverse=True)
        D0 = np.bincount(inv, weights=proj)
        mult = np.bincount(inv).astype(np.float64)

        def f(t, D):
            R = float(lv @ D) / d
            et, s2, mu, nu = coeffs(t, R)
            dp = 2.0 * c * c * s2 * gamma * gamma
            return (-2.0 * lv * et * mu * D + mult * lv * et * et * nu * (R + tau * tau / 2.0)
                    * gamma + mult * dp)
        sol = solve_ivp(f, (0.0, 1.0), D0, **opts)
        risk = lv @ sol.y / d
        lower = upper = risk
    else:
        lmin, lmax = (1.0, 1.0) if (cov is None or mode == "isotropic") else (lam[0], lam[-1])
        if mode == "isotropic" and cov is not None and lmax - lmin > 1e-9:
            raise ValueError("mode='isotropic': cov must be the identity")
        up = solve_ivp(scalar_rhs(lmin, lmax), (0.0, 1.0), [R0], **opts).y[0]
        lo = up if lmin == lmax else solve_ivp(scalar_rhs(lmax, 1.0), (0.0, 1.0), [R0],
                                               **opts).y[0]
        risk, lower, upper = up, lo, up
    eta1 = float(schedule_lr(1.0, schedule, **kw))
    jump = 2.0 * c * c * gamma * gamma * eta1 * eta1 / rho ** 2
    return ODEResult(times=grid, risk=risk, lower=lower, upper=upper, final=float(risk[-1]) + jump,
                     final_lower=float(lower[-1]) + jump, final_upper=float(upper[-1]) + jump,
                     jump=jump)
