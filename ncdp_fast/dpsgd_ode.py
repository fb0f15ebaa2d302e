r"""The deterministic risk ODE of one-pass DP-SGD with clipping (lecture notes
004_f44587b9249a6ca9.txt, "DP-SGD with clipping: sharp analysis").

:func:`clip_factors` gives (mu_c, nu_c) in closed form for Gaussian residuals
(Stein's lemma); :func:`dpsgd_risk_ode` integrates, in the eigenbasis of Sigma,

    dD_i/dt = -2 lambda_i eta~ mu_c(R) D_i + lambda_i eta~^2 nu_c(R) (R + tau^2/2) gamma
              + 2 c^2 sigma~^2 gamma^2,      R = (1/d) sum_i lambda_i D_i,   (*)

for the schedules of :mod:`ncdp_fast.dpsgd_linreg`, plus the last step's noise
jump at t = 1.  Derivation and the approximations it makes: docs/theory.md,
section 4.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._validate import check_nonneg, check_pos_int
from .dpsgd_linreg import check_schedule_args, schedule_lr, sigma_tilde_sq

__all__ = ["clip_factors", "ODEResult", "dpsgd_risk_ode"]

_SQRT2 = math.sqrt(2.0)


def clip_factors(c, excess_risk, noise_std):
    """(mu_c, nu_c) for Gaussian residuals r ~ N(0, 2 R_exc + tau^2) (docs/theory.md §4).

    mu_c = P(|r| < c) = erf(u/sqrt2) (descent reduction), nu_c = E[r_c^2]/E[r^2] =
    erf(u/sqrt2) - 2u phi(u) + u^2 erfc(u/sqrt2) (variance reduction), u = c/s.
    c: residual clipping level (> 0, or inf for no clipping); excess_risk:
    scalar or array >= 0; noise_std: tau >= 0.  Returns arrays shaped like
    excess_risk.
    """
    from scipy.special import erf, erfc
    if isinstance(c, (str, bool)) or c is None:
        raise TypeError(f"c: expected a number > 0 (inf for no clipping), got {c!r}")
    c = float(c)
    if not c > 0:
        raise ValueError(f"c: expected > 0 (inf for no clipping), got {c!r}")
    R = np.asarray(excess_risk, dtype=np.float64)
    if not (np.all(np.isfinite(R)) and np.all(R >= 0)):
        raise ValueError("excess_risk: expected finite values >= 0")
    tau = check_nonneg(noise_std, "noise_std")
    s = np.sqrt(np.maximum(2.0 * R + tau ** 2, 1e-300))
    if math.isinf(c):
        return np.ones_like(s), np.ones_like(s)
    u = c / s
    mu = erf(u / _SQRT2)
    nu = mu - 2.0 * u * np.exp(-0.5 * u * u) / math.sqrt(2 * math.pi) + u * u * erfc(u / _SQRT2)
    return mu, np.clip(nu, 0.0, 1.0)


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
    d, n = check_pos_int(d, "d"), check_pos_int(n, "n")
    c, rho, lr0 = check_schedule_args(clip, rho, schedule, lr0)
    tau = check_nonneg(noise_std, "noise_std")
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
    R0 = check_nonneg(initial_risk, "initial_risk")
    kw = dict(lr0=lr0, gamma=gamma, rho=rho, c1=c1, c2=c2, c3=c3)

    def coeffs(t, R):
        et = float(schedule_lr(t, schedule, **kw))
        s2 = float(sigma_tilde_sq(t, schedule, lr0, gamma, rho, c1, c2, c3))
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
