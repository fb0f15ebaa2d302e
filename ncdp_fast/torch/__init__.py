"""Drop-ins for torch training loops (needs torch; the rest of ncdp_fast does not).

* :class:`FusedDPOptimizer` replaces Opacus's ``DPOptimizer``: it reads the
  per-sample gradients Opacus's ``GradSampleModule`` leaves in ``p.grad_sample``
  and clips, sums and noises all parameters in one fused op.
* :class:`GhostClipper` needs no per-sample gradients at all for models whose
  trainable parameters all sit in ``nn.Linear`` layers (a linear probe, an MLP
  head): hooks keep each layer's inputs and output gradients during one
  ordinary ``loss.backward()``, and :meth:`GhostClipper.privatize_` replaces
  every ``p.grad`` by the clipped, noised, reduced gradient.

Both follow Opacus's conventions for ``loss_reduction`` ("mean": the loss is the
batch mean, gradients are divided by the *expected* batch size) and keep the
Philox stream position (``seed``, ``offset``) so that no noise is ever reused.
:class:`PoissonBatchSampler` and :func:`collate_with_empty` give a DataLoader
true Poisson batches.

Modules: ``optimizer`` (FusedDPOptimizer), ``clipper`` (GhostClipper and its
hooks), ``data`` (the sampler and collate function), ``mechanism`` (the noise
stream, argument checks and clip-and-noise call the drop-ins share).
"""
from __future__ import annotations

try:
    import torch  # noqa: F401  (the submodules need it; say so once, clearly)
except ImportError as exc:  # pragma: no cover - torch is an optional extra
    raise ImportError("ncdp_fast.torch needs PyTorch: pip install 'ncdp_fast[torch]'") from exc

from .clipper import GhostClipper
from .data import PoissonBatchSampler, collate_with_empty
from .optimizer import FusedDPOptimizer

__all__ = ["FusedDPOptimizer", "GhostClipper", "PoissonBatchSampler", "collate_with_empty"]
