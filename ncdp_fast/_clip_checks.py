"""The argument checks the clip ops (``_clip.py``, ``_clip_layers.py``) share."""
from __future__ import annotations

import numpy as np

from ._validate import check_choice, check_nonneg, check_positive


def _check_common(max_norm, noise_multiplier, reduction, expected_batch_size, nan_policy):
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
        inv_denom = 1.0
    check_choice(nan_policy, "nan_policy", ("raise", "zero"))
    return max_norm, noise_multiplier * max_norm, inv_denom


def _check_noise_range(noise_std, inv_denom, dtype):
    # Normals are bounded by 6.7 (32-bit uniforms): past this the output would be inf.
    if noise_std * 6.7 * inv_denom > float(np.finfo(dtype).max):
        raise ValueError(f"noise_multiplier: noise std {noise_std!r} (noise_multiplier * "
                         f"max_norm) overflows {np.dtype(dtype).name}; expected a finite result")
