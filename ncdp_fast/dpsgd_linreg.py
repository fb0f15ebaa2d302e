r"""One-pass DP-SGD with clipping for linear regression and its three schedules
(lecture notes 004_f44587b9249a6ca9.txt, "DP-SGD with clipping: settings" and
"Optimal rates & benefit of clipping").

Step k (k = 0..n-1) uses sample k once:
theta_{k+1} = theta_k - eta_k clip_C(g_k) + 2 C sigma_k xi_k, C = c sqrt(d), with
eta_k = eta~(k/n)/n from :func:`schedule_lr` and sigma_k from
:func:`noise_schedule` (rho^2 sigma_k^2 = eta_k^2 - eta_{k+1}^2), which makes the
released last iterate (rho^2/2)-zCDP under replace-one by amplification by
iteration, provided eta_k ||x_k||^2 <= 2.  The proof and the schedules'
constants are in docs/theory.md, section 3.
"""
from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field

import numpy as np

from . import _stream
from ._rng import gaussian
from ._validate import (as_matrix, as_targets, check_choice, check_nonneg, check_pos_int,
                        check_positive, check_square_sums)

__all__ = ["SCHEDULES", "schedule_lr", "sigma_tilde_sq", "noise_schedule", "realized_rho",
           "check_schedule_args", "DPSGDResult", "dpsgd_linear_regression"]

SCHEDULES = ("output", "constant", "optimal")


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
    check_choice(schedule, "schedule", SCHEDULES)
    t = np.asarray(t, dtype=np.float64)
    if t.size and not (np.all(np.isfinite(t)) and t.min() >= 0.0 and t.max() <= 1.0):
        raise ValueError("t: expected times in [0, 1]")
    if schedule != "optimal":
        # The sixth audit: lr0 of -1 or NaN gave negative or NaN rates.
        lr0 = check_positive(lr0, "lr0")
        return np.full_like(t, lr0) if schedule == "output" else \
            lr0 * np.sqrt(np.maximum(1.0 - t, 0.0))
    for name, value in (("gamma", gamma), ("rho", rho), ("c1", c1), ("c2", c2), ("c3", c3)):
        check_positive(value, name)
    return c1 / (t + _optimal_offset(gamma, rho, c2, c3))


def sigma_tilde_sq(t, schedule, lr0, gamma, rho, c1, c2, c3):
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
    rho = check_positive(rho, "rho")
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
    sigma = np.asarray(sigma, np.float64)
    if eta.ndim != 1 or eta.shape != sigma.shape or not eta.size:
        raise ValueError(f"eta, sigma: expected two non-empty 1-D arrays of one length, got "
                         f"shapes {eta.shape} and {sigma.shape}")
    if not (np.all(np.isfinite(eta)) and np.all(eta > 0) and np.all(np.isfinite(sigma))
            and np.all(sigma >= 0)):
        raise ValueError("eta, sigma: expected finite step sizes > 0 and noise stds >= 0")
    tail = np.cumsum((sigma ** 2)[::-1])[::-1]
    with np.errstate(divide="ignore"):
        return float(np.max(np.where(tail > 0, eta / np.sqrt(tail), np.inf)))


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
    clip_fraction: fraction of steps whose gradient was clipped; offset,
    next_offset: the noise stream's draws used, [offset, next_offset).  The key
    is not kept: whoever holds it subtracts the noise from ``theta``.

    ``contractive``, ``clip_fraction`` and ``excess_risk`` are the private
    data's without noise (the excess risk of the intermediate iterates, which
    carry no noise under ``schedule="output"``): readable on the result in the
    process that ran it, held off it (:class:`ncdp_fast._stream.Unreleased`),
    so that its repr, ``asdict``, pickle and copies carry only the released
    ``theta``, the public schedules and the draw range.
    """
    theta: np.ndarray
    eta: np.ndarray
    sigma: np.ndarray
    rho: float
    clip_norm: float
    offset: int
    next_offset: int
    times: np.ndarray = field(default_factory=lambda: np.empty(0))
    contractive: InitVar[bool] = None
    clip_fraction: InitVar[float] = None
    excess_risk: InitVar[np.ndarray] = None

    def __post_init__(self, contractive, clip_fraction, excess_risk):
        self.contractive, self.clip_fraction = contractive, clip_fraction
        self.excess_risk = np.empty(0) if excess_risk is None else excess_risk


_stream.Unreleased.install(DPSGDResult, {
    name: f"{name}: the private data's, without noise (None on a copy)"
    for name in ("contractive", "clip_fraction", "excess_risk")})


def check_schedule_args(clip, rho, schedule, lr0):
    """Checked (clip, rho, lr0) shared by the simulation and its ODE."""
    c = check_positive(clip, "clip")
    rho = check_positive(rho, "rho")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if schedule != "optimal":
        if lr0 is None:
            raise ValueError(f"lr0: required for schedule {schedule!r}")
        lr0 = check_positive(lr0, "lr0")
    return c, rho, lr0


def _schedule_eta(n, d, schedule, lr0, rho, c1, c2, c3):
    """Step sizes eta_k = eta~(k/n)/n of the n steps, (n,) float64."""
    t = np.arange(n) / n                                    # step k at time k/n
    return schedule_lr(t, schedule, lr0=lr0, gamma=d / n, rho=rho, c1=c1, c2=c2, c3=c3) / n


def dpsgd_linear_regression(x, y, *, clip, schedule, rho, seed=None, offset=None, lr0=None,
                            c1=2.0, c2=4.0, c3=4.0, theta_star=None, cov=None,
                            record_every=None):
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
        seed: the noise key (None: 64 bits from the OS), or a
            :class:`ncdp_fast.NoiseStream`; secret, never in the result.
        offset: first draw (None: the next unused draw of ``seed``'s stream,
            so two calls with one int seed never share noise; an explicit
            offset overlapping a range drawn in this process warns with
            NoiseReuseWarning).
        lr0: eta~(0) of "output"/"constant" (required for them).
        c1, c2, c3: the optimal schedule's constants (see :func:`schedule_lr`).
        theta_star, cov: (d,), (d, d) (None: identity) to record the excess risk
            every ``record_every`` steps (default n // 100); evaluation only.
    Returns a :class:`DPSGDResult`.
    """
    x = as_matrix(x, "x", min_rows=1)
    n, d = x.shape
    y = as_targets(y, n)
    c, rho, lr0 = check_schedule_args(clip, rho, schedule, lr0)
    eta = _schedule_eta(n, d, schedule, lr0, rho, c1, c2, c3)
    sigma = noise_schedule(eta, rho)
    C = c * math.sqrt(d)
    stream = _stream.resolve(seed, offset)
    first = stream.position
    sq = np.einsum("ij,ij->i", x, x)
    check_square_sums(sq, "x")
    contractive = bool(np.max(eta * sq) <= 2.0)
    track = theta_star is not None
    if record_every is not None:
        record_every = check_pos_int(record_every, "record_every")
    if track:
        theta_star = np.asarray(theta_star, np.float64)
        if theta_star.shape != (d,):
            raise ValueError(f"theta_star: expected shape ({d},), got {theta_star.shape}")
        S = np.eye(d) if cov is None else np.asarray(cov, np.float64)
        if S.shape != (d, d):
            raise ValueError(f"cov: expected shape ({d}, {d}), got {S.shape}")
        if not (np.all(np.isfinite(S)) and np.allclose(S, S.T)
                and np.linalg.eigvalsh(S).min() >= -1e-12 * max(1.0, np.abs(S).max())):
            # The sixth audit: -I or NaN gave a negative or NaN excess risk.
            raise ValueError("cov: expected a finite symmetric positive semi-definite matrix")
        every = max(1, n // 100) if record_every is None else record_every

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
                buf_start, rows = k, min(block, n - k)
                noise_buf = gaussian(rows * d, seed=stream.seed, offset=stream.take(rows * d),
                                     dtype=np.float64).reshape(rows, d)
            theta += (2.0 * C * sigma[k]) * noise_buf[k - buf_start]
        if track and ((k + 1) % every == 0 or k == n - 1):
            times.append((k + 1) / n)
            risks.append(risk(theta))
    out = DPSGDResult(theta=theta, eta=eta, sigma=sigma, rho=realized_rho(eta, sigma),
                      contractive=contractive, clip_norm=C, offset=first,
                      next_offset=stream.position, clip_fraction=clipped / n)
    if track:
        out.times, out.excess_risk = np.array(times), np.array(risks)
    return out
