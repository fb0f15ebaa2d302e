"""Slow, obviously correct NumPy versions of every kernel.

These are the specification the numba and CUDA kernels are tested against; they
favour clarity over speed (plain loops, float64 everywhere) and must never be
used on a hot path.  One module per kernel family, every name re-exported here
(tests and docs use ``reference.X``):

* ``rng``  -- Philox4x32-10, the stream's words and normals (the random-number
  contract, DESIGN.md "Random numbers");
* ``clip`` -- kernel 1: the rounding-aware clip rule and fused clipping with noise;
* ``mix``  -- kernel 2: sub-streams, the sampler's logarithm, Poisson /
  hierarchical memberships and the averaged noisy rows;
* ``ntk``  -- kernel 3: the NTK Gram through an explicit Jacobian.
"""
from __future__ import annotations

from .clip import (U64, clip_and_noise, clip_and_noise_layers, clip_and_noise_linear, clip_bound,
                   clip_factor_groups, clip_factors, gram32_error, gram32_root_bound,
                   gram32_rounding, gram_rows_f64, linear_norms_from_grams, linear_spread, linear_terms,
                   norm_affine_grads, per_sample_linear_grads, unit_roundoff)
from .mix import (TWO_POW_53, Uniforms, mix_from_groups, sample_groups, sampler_log,
                  sampler_log1p, substream_words)
from .ntk import ntk_gram, ntk_jacobian
from .rng import (COMPANION_BLOCK, DEEP_BELOW, DEEP_BLOCK, GAUSSIAN_TAIL_BOUND,
                  GAUSSIAN_TRUNCATION_MASS, MASK32, PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1,
                  TWO_POW_32, check_seed_offset, finish_gaussian_segments, gaussian,
                  pair_uniforms, philox4x32_10,
                  philox_words, uniforms_of_words)

# The name tests/test_sampler_log.py reads the sub-stream uniforms by.
_Uniforms = Uniforms

__all__ = ["MASK32", "PHILOX_M0", "PHILOX_M1", "PHILOX_W0", "PHILOX_W1", "TWO_POW_32",
           "philox4x32_10", "check_seed_offset", "philox_words", "gaussian",
           "finish_gaussian_segments", "pair_uniforms", "uniforms_of_words",
           "COMPANION_BLOCK", "DEEP_BLOCK", "DEEP_BELOW",
           "GAUSSIAN_TAIL_BOUND", "GAUSSIAN_TRUNCATION_MASS",
           "U64", "unit_roundoff", "clip_bound", "clip_factors", "clip_factor_groups",
           "linear_norms_from_grams",
           "gram32_rounding", "gram32_root_bound", "gram32_error",
           "gram_rows_f64", "linear_spread", "linear_terms", "norm_affine_grads",
           "clip_and_noise", "per_sample_linear_grads", "clip_and_noise_linear",
           "clip_and_noise_layers",
           "TWO_POW_53", "substream_words", "Uniforms", "sampler_log", "sampler_log1p",
           "sample_groups", "mix_from_groups",
           "ntk_jacobian", "ntk_gram"]
