"""Privacy-specific argument checks and imports, on top of :mod:`ncdp_fast._validate`
(which holds every generic check; same conventions)."""

from __future__ import annotations

from .._validate import check_positive

__all__ = ["check_epsilon_rtol", "check_discretization_interval", "import_dp_accounting"]


def check_epsilon_rtol(epsilon_rtol) -> float:
    """Calibration tolerance in epsilon must lie in (0, 0.5]."""
    rtol = check_positive(epsilon_rtol, "epsilon_rtol")
    if rtol > 0.5:
        raise ValueError(f"epsilon_rtol: expected a number in (0, 0.5], got {epsilon_rtol!r}")
    return rtol


def check_discretization_interval(value_discretization_interval) -> float:
    """PLD value discretization interval (nats of privacy loss) must lie in (0, 1]."""
    v = check_positive(value_discretization_interval, "value_discretization_interval")
    if v > 1.0:
        raise ValueError(f"value_discretization_interval: expected a number in (0, 1] (nats "
                         f"of privacy loss), got {value_discretization_interval!r}")
    return v


def import_dp_accounting():
    """Import dp-accounting lazily, with an actionable message when it is absent."""
    try:
        import dp_accounting  # noqa: F401
        from dp_accounting import pld, rdp  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "ncdp_fast.privacy needs Google's dp-accounting for PLD and RDP accounting: "
            "pip install dp-accounting  (or pip install 'ncdp_fast[privacy]')"
        ) from exc
    return dp_accounting
