"""Argument checks shared by ``ncdp_fast.privacy``.

Every check raises instead of clamping: a privacy claim computed from a silently
corrected argument is a wrong claim. Messages name the argument, the expected
range and the value received.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "as_real",
    "check_delta",
    "check_positive",
    "check_nonnegative",
    "check_sample_rate",
    "check_steps",
    "check_int_at_least",
    "check_choice",
    "check_epsilon_rtol",
]


def as_real(name: str, value) -> float:
    """Return ``value`` as a Python float; TypeError for non-real input, ValueError for NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        # numpy scalars are registered as numbers.Real; 0-d arrays are not.
        try:
            import numpy as np  # numpy is a hard dependency of the package

            if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
                value = value.item()
            else:
                raise TypeError
        except TypeError:
            raise TypeError(
                f"{name} must be a real number, got {value!r} of type {type(value).__name__}"
            ) from None
    x = float(value)
    if math.isnan(x):
        raise ValueError(f"{name} must be a real number, got nan")
    return x


def check_delta(delta, name: str = "delta") -> float:
    """delta must lie in the open interval (0, 1)."""
    d = as_real(name, delta)
    if not (0.0 < d < 1.0):
        raise ValueError(f"{name} must be in the open interval (0, 1), got {delta!r}")
    return d


def check_positive(name: str, value, *, finite: bool = True) -> float:
    """value must be > 0 (and finite unless ``finite=False``)."""
    x = as_real(name, value)
    if finite and not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not x > 0.0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return x


def check_nonnegative(name: str, value) -> float:
    """value must be finite and >= 0."""
    x = as_real(name, value)
    if not math.isfinite(x) or x < 0.0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return x


def check_sample_rate(sample_rate, name: str = "sample_rate") -> float:
    """Poisson sampling probability q must lie in (0, 1]."""
    q = as_real(name, sample_rate)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"{name} must be in the half-open interval (0, 1], got {sample_rate!r}")
    return q


def check_int_at_least(name: str, value, minimum: int) -> int:
    """value must be an integer (Python or NumPy; not bool, not float) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer >= {minimum}, got {value!r} of type {type(value).__name__}"
        )
    v = int(value)
    if v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


def check_steps(steps, name: str = "steps") -> int:
    """Number of compositions T must be an integer >= 1."""
    return check_int_at_least(name, steps, 1)


def check_choice(name: str, value, choices) -> str:
    """value must be one of ``choices`` (strings)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)!r}, got {value!r}")
    return value


def check_epsilon_rtol(epsilon_rtol) -> float:
    """Calibration tolerance in epsilon must lie in (0, 0.5]."""
    rtol = check_positive("epsilon_rtol", epsilon_rtol)
    if rtol > 0.5:
        raise ValueError(f"epsilon_rtol must be in (0, 0.5], got {epsilon_rtol!r}")
    return rtol


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
