"""GhostClipper: private gradients of a whole network from one ordinary backward
pass (book-keeping clipping, Bu et al. ICML 2023), no per-sample gradient formed
where the ghost norm is cheaper.

Hooks keep each trainable layer's inputs and output gradients
(:mod:`.recorder`); each layer's rule (:mod:`.layers`) turns them into blocks
of the fused clip op, which computes every sample's norm over all layers, its
clip factor, the clipped sums and the noise in one call (DESIGN.md kernel 1;
the step: :mod:`.private_step`).  This module builds the clipper: which layers
it taps, their hooks, and their removal.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .._validate import check_bool, check_choice, check_int, check_nonneg, check_pos_int
from . import tied
from .adaptive import AdaptiveClip, check_adaptive
from .attention import attention_forward
from .compiled import check_not_compiled
from .conv import conv_forward
from .coupling import batch_dim_hooks, refuse_batch_mixing
from .grad_norm import watch as watch_grad_norm
from .layers import refuse_unsupported
from .loss_watch import LossWatch
from .structure import LayoutByGraph
from .layout import StepBatch, set_layouts
from .mechanism import ClippedGaussianStep, ReleasedGrads, optimizer_params
from .private_step import PrivateStep
from .recorder import LayerRecorder
from .memory import check_bound_kept
from .per_layer import check_fixed_bound, layer_bounds
from .ranks import check_not_ddp
from .taps import Tap, layer_rule
from .tree import ModelSnapshot
from .unprivatized import foreign_error, refuse_outside_terms

__all__ = ["GhostClipper"]


class GhostClipper(LayerRecorder, PrivateStep, ClippedGaussianStep):
    """Private gradients for a network from one ordinary ``loss.backward()``.

    Usage::

        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.1,
                               expected_batch_size=256)
        loss = criterion(model(x), y)      # loss reduced by mean (or sum)
        loss.backward()                   # ordinary backward: hooks record a, g
        clipper.privatize_()              # p.grad <- clipped, noised, reduced
        optimizer.step()

    Layers: ``nn.Linear`` (inputs of any leading shape), ``nn.Conv1d/2d/3d``
    (groups, stride, padding, dilation, padding modes), ``nn.Embedding``,
    ``nn.EmbeddingBag`` (sum, mean, max), ``nn.LayerNorm``, ``nn.RMSNorm``,
    ``nn.GroupNorm``, affine instance norms,
    ``nn.MultiheadAttention`` (so ``nn.TransformerEncoderLayer`` works
    unmodified), the layers of Hugging Face models (:mod:`.hf_layers`: GPT-2,
    BERT, RoBERTa, DistilBERT, ViT, LLaMA), and any type given a rule with
    :func:`ncdp_fast.torch.register_layer`.  Frozen parameters cost nothing;
    a trainable parameter of another type, a batch norm anywhere (use
    :func:`fix_batchnorm`), a bias or attention parameter shared by two
    layers, or a module used twice under two names raises at construction.
    A layer may run several times in one forward.

    Tied weights: a ``weight`` shared by several supported layers (an
    embedding tied to the output ``nn.Linear`` of a language model) is one
    parameter: each sample's gradient of it is the sum over its uses, so its
    norm includes the cross terms between them.  Linear and embedding uses
    give it in ghost form (:mod:`.tied`: Gram and cross terms, no per-sample
    V*D tensor) when that costs fewer multiply-adds, else each use's per-sample
    gradient is formed, (B, *weight.shape), and summed; it is listed, bounded,
    noised and written once, under the name of its first layer.

    Precision: a float32/float64 parameter's private gradient is computed in
    its dtype; a float16/bfloat16 one's from its layer's tensors upcast to
    float32, its clipped sum and noise in float32, rounded to its dtype once
    (a float16 result that overflows on that rounding is refused, nothing
    written).  Per-sample norms accumulate in float64 in every case.

    What is privatized: each step, the parameters that required grad when
    their layer ran forward.  A parameter frozen after construction stays
    frozen and is left out (no gradient written, no noise drawn).
    :meth:`privatize_` refuses, before writing anything, a gradient it would
    not privatize: one autograd gave a privatized parameter from a use
    outside its layer's forward (a weight tied by ``F.linear(h, emb.weight)``,
    a penalty on the weights in the loss: put weight decay in the optimizer),
    and a ``.grad`` on any other parameter of the model or of the optimizer
    passed to it (unfrozen after construction, added by ``add_param_group``)
    unless it is a gradient the clipper released.  Nothing is recorded while
    the model is not in training mode (``model.eval()``: an evaluation forward
    with gradients on) or :attr:`enabled` is False (``disable_hooks()``), as
    in Opacus; a step over the ordinary gradients a backward then left is
    refused, naming that cause.

    Clipping: ``"flat"`` clips each sample's gradient over all parameters at
    ``max_grad_norm``; ``"per_layer"`` clips each parameter's per-sample
    gradient at its own bound (``max_grad_norm`` a list, one per trainable
    parameter in :attr:`param_names` order, or a float C split as C/sqrt(P))
    and adds noise of std ``noise_multiplier * sqrt(sum C_p^2)`` to each, as
    Opacus's per-layer optimizer.
    ``"adaptive"``: flat clipping at a bound that follows a quantile of the
    norms (``adaptive``, an :class:`~ncdp_fast.torch.adaptive.AdaptiveClip`;
    one process only): each :meth:`privatize_` also releases a noised
    unclipped count, then sets ``max_grad_norm`` for the next step
    (:mod:`ncdp_fast.torch.adaptive`).

    The batch: every layer's per-sample rows must be the samples of the batch
    of the model's input -- dimension 0 of the first tensor the model is called
    with (positional, then keyword), dimension 1 with ``batch_first=False`` --
    or of a size declared with :meth:`declare_batch_size`.  A layer whose rows
    are not (samples folded into the batch dimension, (B, k, d) -> (B*k, d),
    as Hugging Face's ``*ForMultipleChoice`` models do) raises at its forward,
    before anything is written.  Layout: layers inside
    ``nn.MultiheadAttention`` / ``nn.Transformer*`` take that module's own
    ``batch_first``; convolutions and group/instance norms are always
    batch-first; an ``nn.Linear``, ``nn.Embedding`` or ``nn.LayerNorm`` with
    one leading dimension ((B, d)) has its batch there; every other layer
    follows ``batch_first`` (Opacus's argument: with
    False, a layer's dimension 1 is the batch, (T, B, d)).  The layout is
    never inferred from sizes; where a layer's input descends from a layer
    recorded earlier in the forward, the dimension holding the samples is
    followed through the graph, and a layout that reads another one is
    refused at the forward (:mod:`.structure`).

    The loss: at the first backward after a recorded forward, the autograd
    graph from the loss down to the recorded layers' outputs is read
    (:mod:`.loss_graph`): only sums and means of per-sample terms are
    accepted (a token mean within each sample; a batch-wide mean only when
    every sample has as many valid targets); a whole-batch count, a value
    reduced over the batch combined with per-sample values, a nonlinear
    function of a batch sum, an operation along the batch or one the check
    does not know are refused, naming the graph node, at the backward or
    (conditions on values, read once) at the step, before anything is
    written.  ``check_loss=False`` is the opt-out for a loss you vouch for.

    Across ranks: with ``group`` (a torch.distributed process group; do not
    also wrap the model in DDP), each rank feeds its own samples (a
    :class:`DistributedPoissonBatchSampler` shard) and :meth:`privatize_`
    gives every rank the one-process private gradient of the union batch, to
    float rounding (:mod:`ncdp_fast.torch.ranks`); the model's whole state
    (parameters, frozen ones included, and buffers) is broadcast from rank 0 at
    construction, as DDP does; ``seed=None`` is drawn on rank 0; the group is
    held weakly (freed by ``destroy_process_group``).  A DDP-wrapped model is
    refused, with or without ``group``.

    Refused by name as well: a model compiled with ``torch.compile`` (at
    construction, or at the first gradient or step after compiling it), and
    a ``GradScaler`` stepping the optimizer (:mod:`.compiled`, :mod:`.amp`).
    ``torch.nn.utils.clip_grad_norm_`` called between backward and the step
    warns: the gradients do not exist yet (:mod:`.grad_norm`).

    ``forwards_per_step`` (default 1): the most forwards of the model one
    step may hold.  A step's forwards are summed row by row, row i of each
    taken as sample i's: right for several augmentations or views of each
    sample (pass K), wrong for different samples of one size (two loader
    batches under one step: each row of one clipped with the other's row of
    its index, up to 2C for one sample), which nothing can tell apart; a
    forward past the number is refused before anything is written.  A
    checkpoint's recomputation inside backward is not a forward.

    ``gram_precision``: ``"float64"`` (default) or ``"float32"``: how the
    per-sample norms of float32 linear layers on a CUDA device form their
    Grams (:func:`ncdp_fast.clip_and_noise_layers`): "float32" skips the
    float64 copies and GEMMs and raises each norm by the float32 GEMMs' largest
    possible rounding effect, so contributions stay within C but are clipped
    tighter by that bound (docs/privacy.md, "Norms from float32 Grams"); the
    CPU and a ``group`` across ranks keep float64 norms.

    Privacy meaning: each :meth:`privatize_` is one Gaussian mechanism
    (sensitivity ``max_grad_norm``, or sqrt(sum C_p^2) per layer; noise
    multiplier ``noise_multiplier``) over the batch; the realized batch size
    only undoes the mean of a mean-reduced loss, never normalises the output.
    Noise comes from the clipper's Philox stream, one disjoint range per
    parameter and step.
    """

    def __init__(self, model: nn.Module, *, max_grad_norm, noise_multiplier: float,
                 expected_batch_size: float | None, loss_reduction: str = "mean",
                 clipping: str = "flat", seed=None, offset: int | None = None,
                 nan_policy: str = "raise", group=None, batch_first: bool = True,
                 adaptive: AdaptiveClip | None = None, check_loss: bool = True,
                 gram_precision: str = "float64", forwards_per_step: int = 1):
        check_choice(clipping, "clipping", ("flat", "per_layer", "adaptive"))
        check_not_ddp(model, "GhostClipper")
        check_not_compiled(model, "GhostClipper")
        # Set while dynamo traces a hook (compiled.py): every later gradient
        # and step of this clipper is refused.
        self._compiled = False
        self.adaptive = check_adaptive(clipping, adaptive, noise_multiplier,
                                       expected_batch_size, group)
        # sum_i (1[norm_i <= C] - 1/2) of the logical batch's accumulated
        # physical batches (adaptive clipping), released with the step's count.
        self._centered = 0.0
        self.batch_first = check_bool(batch_first, "batch_first")
        self.model = model
        self.clipping = clipping
        self.taps = self._find_layers(model)
        set_layouts(model, self.taps, self.batch_first)
        self.param_names = [t.full(n) for t in self.taps for n in t.owned]
        # Parameters used by several layers: their uses combined at the step (tied.py).
        self._tied = {id(t.params[n]) for t in self.taps for n in t.alias}
        self.layer_norms = layer_bounds(max_grad_norm, clipping, self.param_names)
        total = max_grad_norm if clipping != "per_layer" else math.sqrt(
            sum(c * c for c in self.layer_norms))
        super().__init__(max_grad_norm=total, noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size,
                         loss_reduction=loss_reduction, seed=seed, offset=offset,
                         nan_policy=nan_policy, group=group,
                         params=[p for t in self.taps for p in t.owned.values()], module=model,
                         gram_precision=gram_precision,
                         config={"clipping": clipping, "parameters": self.param_names,
                                 "layer_norms": self.layer_norms})
        # A leaf that requires grad, so that a layer's output enters the graph
        # (and its gradient reaches us) even when nothing below it is trainable.
        self._anchor = torch.zeros((), requires_grad=True)
        # The loss, checked at its backward to be a sum of per-sample terms
        # (loss_graph.py); check_loss=False is the user's documented opt-out.
        self._loss = LossWatch(self._anchor, check_bool(check_loss, "check_loss"), self.clear)
        self._loss.reduction = self.loss_reduction
        # Each layer's batch dimension, where the graph from earlier layers shows it.
        self._layouts = LayoutByGraph()
        self._batch = StepBatch(self.batch_first,
                                check_pos_int(forwards_per_step, "forwards_per_step"))
        # False while PrivateModule.disable_hooks() holds: nothing is recorded.
        self.enabled = True
        # Why a forward under grad since the last step was not recorded
        # ("eval", "disabled"), and the parameters a backward then gave an
        # ordinary gradient: a step over those is refused, naming the cause.
        self._uncaptured: set[str] = set()
        # The first layer whose output gradient arrived in half precision, and
        # its dtype: a batch mean's 1/B rounded into it is refused at the step.
        self._half_grads: dict = {}
        self._uncaptured_grads: dict[str, str] = {}
        # (tensor, its _version at the backward, layer name) of the layers'
        # inputs their blocks read at the step (recorder._evaluate): one changed
        # in place since is refused there (taps.refuse_changed).
        self._kept: list = []
        # Set by a DPOptimizer for one step: called with the step's batch size
        # before anything is written (its logical-batch check); the size kept.
        self._step_check = None
        self._last_batch = 0
        # Registered before the layers' hooks: the batch is known before any
        # layer (the model itself may be one) records.
        self._handles = [model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True)]
        self._handles += batch_dim_hooks(model, self.batch_first)
        self._forwards = []
        # Counts the model's forwards outside backward: a layer recorded and run
        # under no_grad in the same one, then forward inside backward, is in a
        # reentrant checkpoint's region (recompute.py).
        self._pass = 0
        self._released = ReleasedGrads()
        # Parameter name -> clipped sum of the logical batch's earlier physical
        # batches (accumulate_), noised once by the next privatize_.
        self._accumulated: dict[str, torch.Tensor] = {}
        # All of the model's parameters, frozen ones included (one unfrozen later
        # must not step raw); listed once, a module traversal per step costs
        # more than the check itself.
        self._model_params = [(p, None) for p in model.parameters()]
        # Names of parameters autograd accumulated a gradient into since the last
        # step.  Inside a recorded forward a parameter does not require grad, so
        # any such gradient comes from a use outside the layer (a tied weight, a
        # penalty in the loss), a term the rule never sees.
        self._outside: dict[str, str] = {}
        for tap in self.taps:
            for n, p in tap.owned.items():
                self._handles.append(p.register_post_accumulate_grad_hook(
                    self._outside_hook(tap.full(n), tap)))
        captures = []       # (module, hook id): the captures that run as forward hooks
        for tap in self.taps:
            self._handles.append(tap.module.register_forward_pre_hook(self._pre_hook(tap)))
            if isinstance(tap.module, nn.MultiheadAttention):
                self._patch(tap.module, "forward", attention_forward(tap.module, self._marker(tap)))
            elif isinstance(tap.module, nn.modules.conv._ConvNd):
                # Marked at _conv_forward, where the input is what the convolution
                # sees: a subclass may pad in its own forward first (TF "SAME").
                self._patch(tap.module, "_conv_forward", conv_forward(tap, self._marker(tap)))
            else:
                # Its capture and its restore in one hook, the first of the
                # layer's (a hook registered earlier may change the output:
                # the capture must see the layer's own, tree.py holds it so).
                # An embedding bag's offsets and per-sample weights may come
                # by keyword: its hook sees the keywords (with_kwargs).
                bag = isinstance(tap.module, nn.EmbeddingBag)
                hook = self._bag_forward_hook(tap) if bag else self._forward_hook(tap)
                handle = tap.module.register_forward_hook(hook, always_call=True, prepend=True,
                                                          with_kwargs=bag)
                self._handles.append(handle)
                captures.append((tap.module, handle.id))
                continue
            self._handles.append(tap.module.register_forward_hook(
                self._restore_hook(tap), always_call=True))
        # The model as checked; every recorded forward is checked against it
        # first (tree.py), and so is the model now (an instance-level forward).
        # Last, so that it sees the output the layers' hooks left (the model
        # may itself be a layer).
        self._handles.append(model.register_forward_hook(self._model_hook))
        self._snapshot = ModelSnapshot(model, self.taps,
                                       {(id(m), attr) for m, attr in self._forwards}, captures)
        self._snapshot.check(model, self.taps)
        # A script's clip_grad_norm_ after backward sees no gradient: warned (grad_norm.py).
        watch_grad_norm(self, [p for t in self.taps for p in t.owned.values()])

    @ClippedGaussianStep.max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        check_fixed_bound(self.clipping, self.max_grad_norm, self.layer_norms, value)
        check_bound_kept(self._accumulated, self.max_grad_norm, value)
        ClippedGaussianStep.max_grad_norm.fset(self, value)

    def noise_state(self) -> dict:
        """:meth:`UsesNoiseStream.noise_state`, and with adaptive clipping the
        bound the next step clips at (``"clip_bound"``): a run resumed from
        the optimizer's ``state_dict`` (Opacus's way) went back to the first
        step's bound before (the fifth audit: 0.70 back to 5.0; the
        parameters diverged, epsilon did not)."""
        state = super().noise_state()
        if self.adaptive is not None:
            state["clip_bound"] = float(self.max_grad_norm)
        return state

    def load_noise_state(self, state: dict) -> None:
        bound = state.get("clip_bound") if isinstance(state, dict) else None
        if self.adaptive is not None and bound is not None and not (
                isinstance(bound, float) and math.isfinite(bound) and bound > 0):
            raise ValueError(f"state: expected clip_bound as a finite float > 0, got {bound!r}")
        super().load_noise_state(state)
        if self.adaptive is not None and bound is not None:
            self._max_grad_norm = bound

    # ------------------------------------------------------------ construction
    # Kept on the class, as the tests reach it (adaptive.py holds the check).
    _check_adaptive = staticmethod(check_adaptive)

    @ClippedGaussianStep.noise_multiplier.setter
    def noise_multiplier(self, value) -> None:
        # The new z must leave the count its share of the budget (a noise
        # scheduler lowering z past 2 * unclipped_num_std is refused here).
        if self.adaptive is not None:
            self.adaptive.grad_multiplier(check_nonneg(value, "noise_multiplier"))
        ClippedGaussianStep.noise_multiplier.fset(self, value)

    def _grad_noise_multiplier(self) -> float:
        if self.adaptive is None:
            return self.noise_multiplier
        return self.adaptive.grad_multiplier(self.noise_multiplier)

    @staticmethod
    def _find_layers(model: nn.Module) -> list[Tap]:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        owner: dict[int, tuple] = {}     # id -> (full name, a direct weight of a plain layer)
        taps, seen = [], set()
        composite = set()            # modules whose parameters a composite layer owns
        for name, module in model.named_modules(remove_duplicate=False):
            refuse_batch_mixing(name, module)
            if id(module) in composite:
                continue
            if id(module) in seen:
                raise ValueError(f"GhostClipper: layer {name!r} appears twice in the model "
                                 "(shared modules are not supported)")
            params, alias = tied.layer_params(name, module, owner)
            if isinstance(module, nn.MultiheadAttention):
                composite.update(id(m) for m in module.modules() if m is not module)
            if not params:
                continue
            rule = layer_rule(name, module, params)
            refuse_unsupported(name, module)
            seen.add(id(module))
            taps.append(Tap(name, module, rule, params, alias=alias))
        if not taps:
            raise ValueError("GhostClipper: the model has no trainable parameter")
        return taps

    @staticmethod
    def check_model(model: nn.Module) -> None:
        """Raise what construction would refuse about ``model``'s layers (the
        first refusal, naming the layer), attaching nothing."""
        GhostClipper._find_layers(model)

    def declare_batch_size(self, n: int) -> None:
        """State the number of samples of the current step (until the next
        :meth:`privatize_` or :meth:`clear`), for a model whose first input
        tensor does not carry the batch; every layer's rows are checked
        against it instead of the input's.  ``n = 0`` with no forward: the
        step of an empty Poisson batch that the model cannot run (transformers'
        models reshape zero rows with -1) is pure noise, as with a forward."""
        self._batch.declared = check_int(n, "n", 0)

    def _patch(self, module, attr, fn):
        """An instance attribute shadowing the class's method; remove() deletes it."""
        setattr(module, attr, fn)
        self._forwards.append((module, attr))

    # --------------------------------------------------------------- lifecycle
    def clear(self) -> None:
        """Forget recorded activations and gradients (e.g. after an aborted step)
        and the step's batch size."""
        for tap in self.taps:
            tap.clear()
        self._kept.clear()
        self._outside.clear()
        self._uncaptured.clear()
        self._uncaptured_grads.clear()
        self._half_grads.clear()
        self._batch.clear()
        self._loss.clear()

    def remove(self) -> None:
        """Detach the hooks and restore the modules' own forwards."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for module, attr in self._forwards:
            delattr(module, attr)
        self._forwards = []
        self.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    # -------------------------------------------------------------------- step
    # Kept on the class: tests patch _refuse_foreign, and
    # bench/test_bench_finetune.py times it and _refuse_outside_terms through
    # GhostClipper.__dict__.
    def _refuse_outside_terms(self) -> None:
        refuse_outside_terms(self._outside, self.param_names)

    def _refuse_foreign(self, privatized: set, optimizer) -> None:
        """Every parameter the model holds, and the optimizer updates, that has a
        gradient must be one privatized now (or carry a gradient this clipper
        released earlier): else the optimizer would apply a raw gradient."""
        params = self._model_params
        if optimizer is not None:
            params = params + optimizer_params(optimizer)
        found = self._released.first_foreign(params, privatized)
        if found is not None:
            raise foreign_error(self.model, self.taps, *found)
