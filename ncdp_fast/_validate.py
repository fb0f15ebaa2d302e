"""The one set of argument checks of ncdp_fast (bottom layer: imports only ``_arrays``).

Convention, everywhere in the package:

* signature ``check_xxx(value, name, ...)``, returning the normalised value
  (a Python ``int`` / ``float`` / host NumPy array);
* ``TypeError`` for a value of the wrong type (a bool or a float where an integer
  is expected, a string where a number is, a non-array where an array is);
* ``ValueError`` for a value of the right type outside the allowed range;
* the message names the argument, the expectation and what came:
  ``"max_norm: expected a finite number > 0, got -1.0"``.

Every check raises instead of clamping: a privacy claim computed from a silently
corrected argument is a wrong claim.
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any

import numpy as np

from . import _arrays

__all__ = [
    "check_real", "check_finite", "check_positive", "check_nonneg", "check_int",
    "check_pos_int", "check_uint64", "check_draw_range", "check_probability", "check_delta",
    "check_choice", "check_bool", "cli_type",
    "as_matrix", "as_targets", "as_real_array", "check_features", "check_labels",
]


def cli_type(parse, check, *args):
    """A command-line option's argparse ``type``: the text parsed by ``parse``
    (int, float), then ``check(value, "value", *args)``, one of this module's;
    a failure is argparse's usage error naming the option (exit 2), not a
    traceback from deep inside the command (the sixth audit: --batch-size 0 was
    a ZeroDivisionError)."""
    import argparse

    def convert(text):
        try:
            return check(parse(text), "value", *args)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None
    convert.__name__ = parse.__name__
    return convert


def _type_error(value: Any, name: str, expected: str) -> TypeError:
    return TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")


# ---------------------------------------------------------------------- scalars

def check_real(value: Any, name: str) -> float:
    """A real number (Python, NumPy scalar or 0-d real array; not bool) as a float, not NaN."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise _type_error(value, name, "a real number")
    x = float(value)
    if math.isnan(x):
        raise ValueError(f"{name}: expected a real number, got nan")
    return x


def check_plain(x: Any, name: str) -> None:
    """Refuse arrays whose values are more than their elements, which the
    conversions would read as plain (the eighth audit): a NumPy masked array
    (np.asarray drops the mask: the masked entries would be used), a sparse
    or nested torch tensor.  Two attribute reads a tensor: a private step
    checks the first array of each op this way."""
    if type(x) is np.ndarray:
        return
    if _arrays.is_torch(x):
        if x.is_nested or x.layout is not sys.modules["torch"].strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got "
                            f"{'a nested tensor' if x.is_nested else f'layout {x.layout}'}; "
                            "pass x.to_dense()")
    elif isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name}: expected a plain array, got a NumPy masked array: its mask "
                        "would be ignored and the masked entries used; pass "
                        "np.ma.filled(x, value) or only the entries to use")


def as_real_array(value: Any, name: str, expected: str) -> np.ndarray:
    """``value`` as a float64 array when its values are real numbers (not bool,
    not strings, which NumPy would convert: '1' and True read as 1.0); else
    TypeError naming ``name`` and what was ``expected``."""
    check_plain(value, name)
    if _arrays.is_torch(value) and value.is_floating_point():
        # Any float dtype (bfloat16 has no NumPy twin), autograd's or not.
        import torch
        value = value.detach().to(device="cpu", dtype=torch.float64)
    raw = np.asarray(_arrays.to_numpy(value) if _arrays.is_torch(value) else value)
    if raw.dtype.kind not in "iuf":
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} of dtype "
                        f"{raw.dtype}")
    return raw.astype(np.float64)


def check_finite(value: Any, name: str) -> float:
    """A finite real number as a float."""
    x = check_real(value, name)
    if not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return x


def check_positive(value: Any, name: str, *, finite: bool = True) -> float:
    """A real number > 0 (and finite unless ``finite=False``) as a float."""
    x = check_real(value, name)
    if not (x > 0 and (math.isfinite(x) or not finite)):
        raise ValueError(f"{name}: expected a {'finite ' if finite else ''}number > 0, "
                         f"got {value!r}")
    return x


def check_nonneg(value: Any, name: str) -> float:
    """A finite real number >= 0 as a float."""
    x = check_real(value, name)
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return x


def check_int(value: Any, name: str, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """An integer (Python or NumPy; not bool, not float), optionally in
    [minimum, maximum], as an int."""
    what = "an integer" if minimum is None else f"an integer >= {minimum}"
    if maximum is not None:
        what += f" and <= {maximum}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise _type_error(value, name, what)
    v = int(value)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise ValueError(f"{name}: expected {what}, got {v}")
    return v


def check_pos_int(value: Any, name: str) -> int:
    """An integer >= 1."""
    return check_int(value, name, 1)


def check_uint64(value: Any, name: str) -> int:
    """An integer in [0, 2**64) (seeds, stream offsets, draw counts)."""
    what = "an integer in [0, 2**64)"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise _type_error(value, name, what)
    v = int(value)
    if not 0 <= v < 2**64:
        raise ValueError(f"{name}: expected {what}, got {v}")
    return v


def check_draw_range(offset: int, draws: int, name: str = "offset") -> int:
    """``draws`` draws from ``offset`` must fit in the 2**64 stream; returns offset."""
    if offset + draws > 2**64:
        raise ValueError(f"{name}: expected {name} + draws <= 2**64, got {offset} + {draws} "
                         "draws (runs past the end of the 2**64 stream)")
    return offset


def check_probability(value: Any, name: str, *, zero: bool = False, one: bool = True) -> float:
    """A probability as a float: in (0, 1] by default; ``zero``/``one`` include the ends."""
    x = check_real(value, name)
    lo_ok = x >= 0 if zero else x > 0
    hi_ok = x <= 1 if one else x < 1
    if not (lo_ok and hi_ok):
        interval = f"{'[' if zero else '('}0, 1{']' if one else ')'}"
        raise ValueError(f"{name}: expected a number in {interval}, got {value!r}")
    return x


def check_delta(value: Any, name: str = "delta") -> float:
    """A DP delta: a number in the open interval (0, 1)."""
    return check_probability(value, name, zero=False, one=False)


def check_choice(value: Any, name: str, choices) -> Any:
    """One of ``choices``; a non-string where the choices are strings is a TypeError."""
    if isinstance(value, str) and value in choices:
        # The common case, without forming the message (a clip op checks
        # its choices every step: issue 36's host time).
        return value
    expected = f"one of {sorted(choices)!r}"
    if all(isinstance(c, str) for c in choices) and not isinstance(value, str):
        raise _type_error(value, name, expected)
    if value not in choices:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return value


def check_bool(value: Any, name: str, *, none: bool = False) -> bool | None:
    """A bool (Python or NumPy); an integer 0/1 is a TypeError, not a guess.
    ``none``: None is accepted too (a default decided elsewhere)."""
    if none and value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise _type_error(value, name, "a bool (True or False)")
    return bool(value)


# ----------------------------------------------------------------------- arrays

def as_matrix(x: Any, name: str, d: int | None = None, min_rows: int = 0,
              min_cols: int = 0) -> np.ndarray:
    """x as a finite (n, d) float64 host NumPy array (``d``: the columns required, if
    given; at least ``min_rows`` rows: a fit's data; at least ``min_cols`` columns)."""
    check_plain(x, name)
    x = np.asarray(_arrays.to_numpy(x), dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array (n, d), got shape {x.shape}")
    if x.shape[0] < min_rows:
        raise ValueError(f"{name}: expected at least {min_rows} row(s), got {x.shape[0]}")
    if x.shape[1] < min_cols:
        raise ValueError(f"{name}: expected at least {min_cols} column(s), got shape {x.shape}")
    if d is not None and x.shape[1] != d:
        raise ValueError(f"{name}: expected {d} columns (the training dimension), "
                         f"got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: expected finite values, got NaN or Inf")
    return x


def check_square_sums(sq: np.ndarray, name: str) -> None:
    """Refuse rows whose float64 sum of squares overflowed (``sq`` (n,), each
    row's): a clip rule cannot bound such a row, and would silently scale it to
    nothing (or, times a zero residual, to NaN).  The rows' indices are the
    data holder's to see; their values are not shown."""
    bad = np.flatnonzero(~np.isfinite(sq))
    if bad.size:
        shown = ", ".join(str(i) for i in bad[:10]) + (", ..." if bad.size > 10 else "")
        raise ValueError(f"{name}: rows [{shown}] have squared norms beyond float64's range "
                         "(entries near sqrt(max_float64 / d) or above); no clip can bound "
                         "them: rescale the rows")


def as_targets(y: Any, n: int, name: str = "y") -> np.ndarray:
    """y as finite (n,) float64 host NumPy real labels."""
    check_plain(y, name)
    y = np.asarray(_arrays.to_numpy(y), dtype=np.float64)
    if y.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},) (one real label per row of x), "
                         f"got {y.shape}")
    if not np.all(np.isfinite(y)):
        raise ValueError(f"{name}: expected finite values, got NaN or Inf")
    return y


def check_features(X: Any, name: str = "X") -> tuple[int, ...]:
    """A (n, p) real feature array (NumPy, torch or CuPy) without NaN/Inf; returns (n, p)."""
    check_plain(X, name)
    shape = _arrays.shape(X, name)
    if len(shape) != 2:
        raise ValueError(f"{name}: expected shape (n, p), got {shape}")
    if _arrays.is_torch(X):
        if not X.is_floating_point():
            raise TypeError(f"{name}: expected a float32/float64 tensor, got {X.dtype}")
        dt = np.dtype(np.float64)     # any torch float (bfloat16 has no NumPy twin)
    else:
        dt = _arrays.numpy_dtype(X) if hasattr(X, "dtype") else np.asarray(X).dtype
    if dt.kind not in "fiu":
        raise TypeError(f"{name}: expected a real-valued array, got dtype {dt}")
    if dt.kind == "f" and not _arrays.all_finite(X):
        raise ValueError(f"{name}: expected finite features, got NaN or Inf")
    return shape


def check_labels(y: Any, n: int, num_classes: Any = None, name: str = "y"):
    """Class labels: n integers in [0, K).  Returns (labels as int64 NumPy, K).

    ``num_classes=None`` takes K = max(y) + 1: the label set is then treated as the
    task's public schema (pass ``num_classes`` to avoid reading it from the data)."""
    check_plain(y, name)
    a = _arrays.to_host(y, name)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},) matching the features, got {a.shape}")
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or np.any(a != np.round(a)):
            raise ValueError(f"{name}: expected integer class labels 0..K-1, got non-integer "
                             "values")
    elif a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer class labels, got dtype {a.dtype}")
    a = a.astype(np.int64)
    if num_classes is not None:
        K = check_int(num_classes, "num_classes", 2)
    else:
        K = int(a.max()) + 1 if a.size else 0
        if K < 2:
            raise ValueError(f"{name}: expected labels of at least 2 classes 0..K-1, got "
                             "fewer (values not shown: labels are private)")
    if a.size and (a.min() < 0 or a.max() >= K):
        # The values are private: the message may reach a log (the sixth
        # audit; the release's check already held them back).
        raise ValueError(f"{name}: expected integers in [0, {K}), got values outside it "
                         "(not shown: labels are private)")
    return a, K
