"""Adaptive clipping (Andrew et al., NeurIPS 2021, "Differentially Private
Learning with Adaptive Clipping"): the bound C follows a private estimate of
the ``target_unclipped_quantile`` of the per-sample gradient norms.

Each logical step releases, besides the noised gradient sum, one noised count

    s = sum_i (1[norm_i <= C] - 1/2) + N(0, unclipped_num_std^2)

whose sensitivity is 1/2 under adding or removing one sample (each term is
+-1/2; centering by the realized batch size, not the expected one, is what
makes this exact under Poisson sampling), and sets

    C <- clamp(C * exp(-clipbound_learning_rate * (s / E + 1/2 - target)),
               min_clipbound, max_clipbound)

with E the expected batch size.  The gradient is noised at multiplier
``z_grad = (z^-2 - (2 unclipped_num_std)^-2)^(-1/2)``, so that the pair
(gradient sum / C, count / (1/2)) is one Gaussian mechanism of multiplier z,
the user's ``noise_multiplier`` (the paper's Theorem 1): the accountant
records z per step.
"""
from __future__ import annotations

import math

import numpy as np

from .._rng import gaussian
from .._validate import check_nonneg, check_positive, check_probability

__all__ = ["AdaptiveClip", "check_adaptive"]


class AdaptiveClip:
    """Opacus's ``AdaClipDPOptimizer`` arguments, checked: ``target_unclipped_quantile``
    in [0, 1], ``clipbound_learning_rate`` > 0, 0 < ``min_clipbound`` <=
    ``max_clipbound``, ``unclipped_num_std`` > 0 (the count noise std)."""

    def __init__(self, *, target_unclipped_quantile, clipbound_learning_rate, max_clipbound,
                 min_clipbound, unclipped_num_std):
        self.target_unclipped_quantile = check_probability(
            target_unclipped_quantile, "target_unclipped_quantile", zero=True)
        self.clipbound_learning_rate = check_positive(clipbound_learning_rate,
                                                      "clipbound_learning_rate")
        self.min_clipbound = check_positive(min_clipbound, "min_clipbound")
        self.max_clipbound = check_positive(max_clipbound, "max_clipbound")
        if self.max_clipbound < self.min_clipbound:
            raise ValueError(f"max_clipbound: expected >= min_clipbound {min_clipbound!r}, "
                             f"got {max_clipbound!r}")
        self.unclipped_num_std = check_positive(unclipped_num_std, "unclipped_num_std")

    ARGS = ("target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound",
            "min_clipbound", "unclipped_num_std")

    def arguments(self) -> dict:
        """The five arguments by name (floats): what a checkpoint stores, and a
        resumed run must have been built with."""
        return {k: float(getattr(self, k)) for k in self.ARGS}

    def grad_multiplier(self, noise_multiplier: float) -> float:
        """z_grad for the user's z: the gradient's noise multiplier that leaves
        the count's share of the budget (Theorem 1 of Andrew et al. 2021).
        Refuses z >= 2 * unclipped_num_std (the count alone would spend it all)."""
        z = noise_multiplier
        if z == 0:
            return 0.0
        if not 2 * self.unclipped_num_std > z:
            raise ValueError(
                f"unclipped_num_std: expected > noise_multiplier / 2 = {z / 2!r} (the count's "
                f"noise takes a share (2 * unclipped_num_std)^-2 of the budget z^-2), got "
                f"{self.unclipped_num_std!r}; raise unclipped_num_std or lower noise_multiplier")
        rest = z ** -2 - (2 * self.unclipped_num_std) ** -2
        return 1.0 / math.sqrt(rest)

    def centered_count(self, result) -> float:
        """sum_i (1[norm_i <= bound] - 1/2) over a batch's per-sample norms, from
        a clip op's ``result`` at that bound: B less its counts of clipped rows
        (norm > bound) and of dropped ones (a non-finite norm counts as
        clipped), which the op formed on the host from its one transfer.
        Reading the (B,) norms again would make the host wait for a device
        twice more a step (issue 36)."""
        B = result.norms.shape[0]
        return float(B - result.num_clipped - result.num_nonfinite) - 0.5 * B

    def next_bound(self, centered: float, bound: float, expected_batch_size: float,
                   stream) -> float:
        """The bound of the next step, from this step's centered count; draws
        the count's one normal from the next unused draw of ``stream``."""
        start = stream.take(1)
        z = float(gaussian(1, seed=stream.seed, offset=start, dtype=np.float64)[0])
        unclipped = (centered + self.unclipped_num_std * z) / expected_batch_size + 0.5
        x = -self.clipbound_learning_rate * (unclipped - self.target_unclipped_quantile)
        # math.exp raises past 709 (unclipped_num_std 1e6 did, after the draw:
        # the seventh audit); the bound is max_clipbound there either way.
        c = bound * math.exp(min(x, 709.0))
        return min(max(c, self.min_clipbound), self.max_clipbound)


def check_adaptive(clipping, adaptive, noise_multiplier, expected_batch_size, group):
    """The clipper's ``adaptive`` argument checked against its others: an
    :class:`AdaptiveClip` with ``clipping="adaptive"`` (one process, an expected
    batch size, a ``noise_multiplier`` that leaves the count its share), None
    otherwise.  Returns it."""
    if clipping != "adaptive":
        if adaptive is not None:
            raise ValueError(f"adaptive: expected None with clipping={clipping!r}, got "
                             f"{adaptive!r}; pass clipping='adaptive' to use it")
        return None
    if not isinstance(adaptive, AdaptiveClip):
        raise TypeError("adaptive: expected an AdaptiveClip (its five arguments) with "
                        f"clipping='adaptive', got {type(adaptive).__name__}")
    if group is not None:
        raise ValueError(
            "clipping: expected 'flat' or 'per_layer' with group=, got 'adaptive': each "
            "rank would count its own shard's unclipped samples; the count is not "
            "reduced across ranks here. Train on one process, or use clipping='flat'")
    if expected_batch_size is None:
        raise ValueError("expected_batch_size: required with clipping='adaptive' (the "
                         "unclipped count is divided by it), got None")
    adaptive.grad_multiplier(check_nonneg(noise_multiplier, "noise_multiplier"))
    return adaptive
