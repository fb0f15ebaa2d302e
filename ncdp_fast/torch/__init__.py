"""Drop-ins for torch training loops (needs torch; the rest of ncdp_fast does not).

* :class:`PrivacyEngine` is Opacus's entry point (``make_private``,
  ``make_private_with_epsilon``, ``get_epsilon``): swapping the import is the
  whole migration of an Opacus training loop.
* :class:`GhostClipper` privatizes the gradients of a whole network from one
  ordinary ``loss.backward()`` (book-keeping clipping): linear layers on inputs
  of any shape, convolutions, embeddings, layer/group norms, multi-head
  attention, and any layer given a rule with :func:`register_layer`.
* :class:`FusedDPOptimizer` replaces Opacus's ``DPOptimizer`` for models kept in
  Opacus's ``GradSampleModule``: it clips, sums and noises the ``p.grad_sample``
  of all parameters in one fused op.
* :class:`BatchMemoryManager` trains each Poisson logical batch in physical
  batches of bounded size, one private step per logical batch (Opacus's).
* :func:`fix_batchnorm` replaces batch norms (which mix samples) by group norms;
  :class:`ModuleValidator` is Opacus's face over it (``fix``, ``validate``),
  which also replaces ``nn.LSTM/GRU/RNN`` by :class:`DPLSTM` / :class:`DPGRU` /
  :class:`DPRNN` (the same function from ``nn.Linear`` cells).
* :func:`check_exact` compares the clipper's step on a batch with per-sample
  clipping computed one sample at a time: what mixes samples unseen (inside a
  ``forward``, in a loss) shows as an error of the gradient's order.
* :class:`TokenCrossEntropyLoss` / :func:`per_sample_token_loss` /
  :func:`causal_lm_loss`: token cross-entropy whose terms are per sample (each
  sample's mean over its own valid tokens), as the loss contract requires.

All follow Opacus's conventions for ``loss_reduction`` ("mean": the loss is the
batch mean, gradients are divided by the *expected* batch size) and keep the
Philox stream position (``seed``, ``offset``) so that no noise is ever reused.
:class:`PoissonBatchSampler` and :func:`collate_with_empty` give a DataLoader
true Poisson batches.

Modules: ``engine`` (PrivacyEngine), ``dp_optimizer`` (the DPOptimizer and
PrivateModule it returns), ``clipper`` (GhostClipper: which layers, their
hooks), ``recorder`` (what the hooks record and check as the model runs),
``private_step`` (the clipper's step), ``compiled`` / ``amp`` / ``grad_norm``
(torch.compile and GradScaler refused, clip_grad_norm_ before the step warned),
``layers`` (the per-layer rules' registry), ``layer_rules`` (the rules of torch's
own layers), ``attention`` (multi-head
attention's step-by-step forward and rule), ``hf_layers`` (rules of Hugging Face
``transformers`` layers, registered by class name), ``optimizer`` (FusedDPOptimizer),
``fix`` (fix_batchnorm, fix_recurrent), ``rnn`` (DPLSTM, DPGRU, DPRNN),
``recompute`` (activation checkpointing's recomputation), ``validators``
(ModuleValidator), ``losses`` (per-sample token loss), ``coupling``
(what mixes samples: refused modules, the checked ghost criterion),
``checkpoint`` (save/resume of a private run), ``selfcheck`` (check_exact), ``memory``
(BatchMemoryManager), ``data`` (the sampler and collate function),
``ranks`` (DP-SGD across torch.distributed ranks: the sharded Poisson
sampler and the reduce-then-noise step), ``mechanism`` (the noise stream,
argument checks and clip-and-noise call the drop-ins share).
"""
from __future__ import annotations

try:
    import torch  # noqa: F401  (the submodules need it; say so once, clearly)
except ImportError as exc:  # pragma: no cover - torch is an optional extra
    raise ImportError("ncdp_fast.torch needs PyTorch: pip install 'ncdp_fast[torch]'") from exc

from . import attention as _attention  # noqa: F401  (registers the attention rule)
from . import hf_layers as _hf_layers  # noqa: F401  (rules of transformers' layers, by name)
from .clipper import GhostClipper
from .data import PoissonBatchSampler, collate_with_empty
from .engine import DPOptimizer, PrivacyEngine, PrivateModule
from .fix import fix_batchnorm
from .rnn import DPGRU, DPLSTM, DPRNN
from .losses import TokenCrossEntropyLoss, causal_lm_loss, per_sample_token_loss
from .loss_graph import LossReductionWarning
from .memory import BatchMemoryManager
from .layer_rules import factored_or_instantiated  # (and registers the rules of torch's layers)
from . import embedding_bag as _embedding_bag  # noqa: F401  (registers nn.EmbeddingBag's rule)
from .layers import Call, register_layer
from .optimizer import FusedDPOptimizer
from .validators import ModuleValidator
from .ranks import DistributedPoissonBatchSampler
from .selfcheck import ExactnessReport, check_exact

__all__ = ["PrivacyEngine", "DPOptimizer", "PrivateModule", "BatchMemoryManager",
           "GhostClipper", "FusedDPOptimizer",
           "register_layer", "Call", "factored_or_instantiated", "fix_batchnorm",
           "PoissonBatchSampler", "DistributedPoissonBatchSampler", "collate_with_empty",
           "TokenCrossEntropyLoss", "per_sample_token_loss", "causal_lm_loss", "ModuleValidator",
           "DPLSTM", "DPGRU", "DPRNN", "check_exact", "ExactnessReport",
           "LossReductionWarning"]
