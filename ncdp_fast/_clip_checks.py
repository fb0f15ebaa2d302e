"""The argument checks the clip ops (``_clip.py``, ``_clip_layers.py``) share."""
from __future__ import annotations

import numpy as np

from ._validate import check_choice, check_nonneg, check_positive


# Arguments of plain Python types that passed the checks, with their result:
# a training loop passes the same ones every step, and their checks were some
# 50 of a linear layer's 600 Python calls in a step (issue 36's host time).
# Only exact float/int/str/None values are kept (a tensor or an array could
# change in place under one key), no zero (0.0 and -0.0 are one key but not
# one result), and at most _PASSED_MAX of them.
_PASSED: dict = {}
_PASSED_MAX = 64
_PLAIN = frozenset((float, int, str, type(None)))


def _plain(key) -> bool:
    for v in key:
        if type(v) not in _PLAIN or v == 0:
            return False
    return True


def _check_common(max_norm, noise_multiplier, reduction, expected_batch_size, nan_policy):
    key = (max_norm, noise_multiplier, reduction, expected_batch_size, nan_policy)
    plain = _plain(key)
    if plain:
        types = tuple(map(type, key))
        got = _PASSED.get(key)
        # Equal keys of other types (1 and 1.0) are checked, and kept, anew.
        if got is not None and got[0] == types:
            return got[1]
    checked = _checked_common(*key)
    if plain:
        if len(_PASSED) >= _PASSED_MAX:
            _PASSED.clear()
        _PASSED[key] = (types, checked)
    return checked


def _checked_common(max_norm, noise_multiplier, reduction, expected_batch_size, nan_policy):
    max_norm = check_positive(max_norm, "max_norm")
    noise_multiplier = check_nonneg(noise_multiplier, "noise_multiplier")
    check_choice(reduction, "reduction", ("sum", "mean"))
    if reduction == "mean":
        if expected_batch_size is None:
            raise ValueError("expected_batch_size: reduction='mean' needs the expected batch size "
                             "(sample_rate * dataset size); dividing by the realized batch size "
                             "would leak it, so it is never used")
        inv_denom = 1.0 / check_positive(expected_batch_size, "expected_batch_size")
    else:
        # Not used by a sum, but a bad value is still a bad argument (0, -1, NaN
        # and True went through unseen: the sixth audit).
        if expected_batch_size is not None:
            check_positive(expected_batch_size, "expected_batch_size")
        inv_denom = 1.0
    check_choice(nan_policy, "nan_policy", ("raise", "zero"))
    return max_norm, noise_multiplier * max_norm, inv_denom


def _check_noise_range(noise_std, inv_denom, dtype):
    # Normals are bounded by 6.7 (32-bit uniforms): past this the output would be inf.
    if noise_std * 6.7 * inv_denom > float(np.finfo(dtype).max):
        raise ValueError(f"noise_multiplier: noise std {noise_std!r} (noise_multiplier * "
                         f"max_norm) overflows {np.dtype(dtype).name}; expected a finite result")
