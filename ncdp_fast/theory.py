"""The DP-GD / DP-SGD theory tools of the lecture notes 004_f44587b9249a6ca9.txt,
under the names the README documents (``theory.DPGDRegressor``, ...).

They live in modules named for what they hold:

* :mod:`ncdp_fast.dpgd_rf` -- :class:`DPGDRegressor`, full-batch DP-GD on random
  (or raw) features;
* :mod:`ncdp_fast.dpsgd_linreg` -- :func:`dpsgd_linear_regression`, one-pass DP-SGD
  with clipping for linear regression, and its schedules (:func:`schedule_lr`,
  :func:`noise_schedule`, :func:`realized_rho`);
* :mod:`ncdp_fast.dpsgd_ode` -- :func:`dpsgd_risk_ode`, the deterministic risk ODE,
  and the clip factors (mu_c, nu_c) of :func:`clip_factors`.

Derivations and privacy proofs: docs/theory.md.
"""
from __future__ import annotations

from .dpgd_rf import DPGDRegressor
from .dpsgd_linreg import (SCHEDULES, DPSGDResult, dpsgd_linear_regression, noise_schedule,
                           realized_rho, schedule_lr)
from .dpsgd_ode import ODEResult, clip_factors, dpsgd_risk_ode

__all__ = ["SCHEDULES", "clip_factors", "schedule_lr", "noise_schedule", "realized_rho",
           "DPGDRegressor", "DPSGDResult", "dpsgd_linear_regression", "ODEResult",
           "dpsgd_risk_ode"]
