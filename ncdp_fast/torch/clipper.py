"""GhostClipper: private gradients of a whole network from one ordinary backward
pass (book-keeping clipping, Bu et al. ICML 2023), no per-sample gradient formed
where the ghost norm is cheaper.

Hooks keep each trainable layer's inputs and output gradients; each layer's rule
(:mod:`.layers`) turns them into blocks of the fused clip op, which computes
every sample's norm over all layers, its clip factor, the clipped sums and the
noise in one call (DESIGN.md kernel 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .._clip import GhostBlock, LayersClipResult, clip_and_noise_layers
from .._validate import check_bool, check_choice, check_int, check_nonneg, check_positive
from . import tied
from .adaptive import AdaptiveClip
from .attention import attention_forward, check_attention
from .coupling import batch_dim_hooks, refuse_batch_mixing
from .layers import HALF, Call, accumulation_dtype, refuse_unsupported, rule_for
from .layout import (StepBatch, batch_dim, broadcast_rows, enclosing_batch_first,
                     layer_batch_first, module_batch_first, rows_error, to_batch_first)
from .mechanism import (ClippedGaussianStep, ReleasedGrads, foreign_grad_error,
                        optimizer_params)
from .recompute import in_backward, reentrant_recompute, refuse_reentrant, refuse_unmatched
from .rnn import replacement, torch_rnn_error

__all__ = ["GhostClipper"]


class _CaptureGrad(torch.autograd.Function):
    """Identity whose backward hands the output gradient to ``store``: used only
    when a layer's output would not otherwise require grad (nothing trainable
    below it), the ``anchor`` leaf putting it into the graph.  Returns a copy: a
    view made in a custom Function may not be modified in place."""

    @staticmethod
    def forward(ctx, output, anchor, store):
        ctx.store = store
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.store(grad.detach())
        return grad, None, None


@dataclass
class _Record:
    """One recorded forward call (or marked point) of a layer; its tensors are
    dropped once the layer's rule has run."""
    inputs: tuple | None
    slot: str | None
    versions: tuple
    grad: torch.Tensor | None = None
    got: bool = False
    twice: bool = False


@dataclass
class _Tap:
    """A trainable layer: its rule, trainable parameters and this step's records."""
    name: str
    module: nn.Module
    rule: object
    params: dict                    # relative name -> Parameter (trainable only)
    records: list = field(default_factory=list)
    # A weight shared with an earlier layer: relative name -> the full name of
    # the use that owns it (its one entry, bound, noise range and .grad).
    alias: dict = field(default_factory=dict)
    recording: bool = False
    saved: tuple | None = None      # requires_grad as the user left it, during a forward
    active: frozenset | None = None  # names trainable at this step's forwards
    blocks: list | None = None      # the rule's [(names, block)] once backward is through
    batch: int | None = None
    batch_first: bool = True        # the layout of its inputs and output (layout.py)
    layout: str = ""                # where that layout comes from, for errors
    calls: int = 0                  # recorded forward calls (an attention call records several)
    replays: int = 0                # checkpoint recomputations of recorded calls (recompute.py)
    replaying: bool = False         # this call is one: let through, not recorded
    nograd: int = -1                # the model forward in which it last ran under no_grad
    recorded_in: int = -2           # the model forward in which it was last recorded

    def full(self, n: str) -> str:
        """The model-level name of its parameter ``n`` (as in ``param_names``)."""
        return f"{self.name}.{n}" if self.name else n

    @property
    def owned(self) -> dict:
        """Its parameters less the weights another layer owns."""
        return {n: p for n, p in self.params.items() if n not in self.alias}

    @property
    def half(self) -> bool:
        """A float16/bfloat16 parameter: the rule gets its tensors in float32."""
        return any(p.dtype in HALF for p in self.params.values())

    def trainable(self) -> frozenset:
        """The parameters this step privatizes: those that required grad when the
        layer ran forward (a parameter frozen after attach is left out, and the
        optimizer skips it); for a layer unused this step, those that do now."""
        if self.active is not None:
            return self.active
        return frozenset(n for n, p in self.params.items() if p.requires_grad)

    def clear(self):
        self.records.clear()
        self.blocks, self.batch, self.active = None, None, None
        self.calls, self.replays, self.replaying = 0, 0, False


def _per_parameter(entries, grads):
    """``(tap, name, grad)`` for each parameter of the step's ``entries`` and the
    clip op's ``grads`` (a pair block's grad is a (weight, bias) tuple), each
    grad in its parameter's shape."""
    for (tap, names, _), grad in zip(entries, grads):
        for n, g in zip(names, grad if isinstance(grad, tuple) else (grad,)):
            yield tap, n, g.view(tap.params[n].shape)


def _ignore(grad):
    pass


def _upcast(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in HALF else x


class GhostClipper(ClippedGaussianStep):
    """Private gradients for a network from one ordinary ``loss.backward()``.

    Usage::

        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.1,
                               expected_batch_size=256)
        loss = criterion(model(x), y)      # loss reduced by mean (or sum)
        loss.backward()                   # ordinary backward: hooks record a, g
        clipper.privatize_()              # p.grad <- clipped, noised, reduced
        optimizer.step()

    Layers: ``nn.Linear`` (inputs of any leading shape), ``nn.Conv1d/2d``
    (groups, stride, padding, dilation, padding modes), ``nn.Embedding``,
    ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, affine instance norms,
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
    are not (samples folded into the batch dimension, (B, k, d) -> (B*k, d))
    raises in backward, before anything is written.  Layout: layers inside
    ``nn.MultiheadAttention`` / ``nn.Transformer*`` take that module's own
    ``batch_first``; convolutions and group/instance norms are always
    batch-first; an ``nn.Linear``, ``nn.Embedding`` or ``nn.LayerNorm`` with
    one leading dimension ((B, d)) has its batch there; every other layer
    follows ``batch_first`` (Opacus's argument: with
    False, a layer's dimension 1 is the batch, (T, B, d)).  The layout is
    never inferred from sizes.

    Across ranks: with ``group`` (a torch.distributed process group; do not
    also wrap the model in DDP), each rank feeds its own samples (a
    :class:`DistributedPoissonBatchSampler` shard) and :meth:`privatize_`
    gives every rank the one-process private gradient of the union batch, to
    float rounding (:mod:`ncdp_fast.torch.ranks`); parameters are broadcast
    from rank 0 at construction; ``seed=None`` is drawn on rank 0.

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
                 adaptive: AdaptiveClip | None = None):
        check_choice(clipping, "clipping", ("flat", "per_layer", "adaptive"))
        self.adaptive = self._check_adaptive(clipping, adaptive, noise_multiplier,
                                             expected_batch_size, group)
        # sum_i (1[norm_i <= C] - 1/2) of the logical batch's accumulated
        # physical batches (adaptive clipping), released with the step's count.
        self._centered = 0.0
        self.batch_first = check_bool(batch_first, "batch_first")
        self.model = model
        self.clipping = clipping
        self.taps = self._find_layers(model)
        self._set_layouts(model)
        self.param_names = [t.full(n) for t in self.taps for n in t.owned]
        # Parameters used by several layers: their uses combined at the step (tied.py).
        self._tied = {id(t.params[n]) for t in self.taps for n in t.alias}
        self.layer_norms = self._layer_bounds(max_grad_norm, clipping)
        total = max_grad_norm if clipping != "per_layer" else math.sqrt(
            sum(c * c for c in self.layer_norms))
        super().__init__(max_grad_norm=total, noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size,
                         loss_reduction=loss_reduction, seed=seed, offset=offset,
                         nan_policy=nan_policy, group=group,
                         params=[p for t in self.taps for p in t.owned.values()],
                         config={"clipping": clipping, "parameters": self.param_names,
                                 "layer_norms": self.layer_norms})
        # A leaf that requires grad, so that a layer's output enters the graph
        # (and its gradient reaches us) even when nothing below it is trainable.
        self._anchor = torch.zeros((), requires_grad=True)
        self._batch = StepBatch(self.batch_first)
        # False while PrivateModule.disable_hooks() holds: nothing is recorded.
        self.enabled = True
        # Why a forward under grad since the last step was not recorded
        # ("eval", "disabled"), and the parameters a backward then gave an
        # ordinary gradient: a step over those is refused, naming the cause.
        self._uncaptured: set[str] = set()
        self._uncaptured_grads: dict[str, str] = {}
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
        for tap in self.taps:
            self._handles.append(tap.module.register_forward_pre_hook(self._pre_hook(tap)))
            if isinstance(tap.module, nn.MultiheadAttention):
                self._patch(tap.module, "forward", attention_forward(tap.module, self._marker(tap)))
            elif isinstance(tap.module, nn.modules.conv._ConvNd):
                # Marked at _conv_forward, where the input is what the convolution
                # sees: a subclass may pad in its own forward first (TF "SAME").
                self._patch(tap.module, "_conv_forward", self._conv_marker(tap))
            else:
                self._handles.append(tap.module.register_forward_hook(
                    self._forward_hook(tap), always_call=True))
            self._handles.append(tap.module.register_forward_hook(
                self._restore_hook(tap), always_call=True))

    @ClippedGaussianStep.max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        # Per-layer bounds are fixed: scaling them with a new total would be
        # one choice among many (Opacus's per-layer optimizer keeps clipping at
        # its old bounds while its noise follows the new total), so a change
        # is refused rather than guessed.
        if self.clipping == "per_layer" and check_positive(value, "max_grad_norm") != \
                self.max_grad_norm:
            raise ValueError(
                f"max_grad_norm: expected {self.max_grad_norm!r} (fixed with "
                f"clipping='per_layer', bounds {self.layer_norms}), got {value!r}; a "
                "grad-clip scheduler needs clipping='flat', or build again (make_private) "
                "with the new per-layer bounds")
        if self._accumulated and check_positive(value, "max_grad_norm") != self.max_grad_norm:
            # The logical batch's earlier physical batches were clipped at the old
            # bound: noise at a smaller new one would not cover their samples.
            raise ValueError(
                f"max_grad_norm: expected {self.max_grad_norm!r} until the logical batch's "
                f"step (physical batches accumulated at it: BatchMemoryManager), got "
                f"{value!r}; change it between logical steps (a grad-clip scheduler steps "
                "per epoch), or discard_accumulated() first")
        ClippedGaussianStep.max_grad_norm.fset(self, value)

    # ------------------------------------------------------------ construction
    @staticmethod
    def _check_adaptive(clipping, adaptive, noise_multiplier, expected_batch_size, group):
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

    def _layer_bounds(self, max_grad_norm, clipping):
        if clipping != "per_layer":
            check_positive(max_grad_norm, "max_grad_norm")
            return None
        P = len(self.param_names)
        if isinstance(max_grad_norm, (list, tuple)):
            if len(max_grad_norm) != P:
                raise ValueError(f"max_grad_norm: expected {P} bounds for clipping='per_layer' "
                                 f"(one per trainable parameter: {self.param_names}), got "
                                 f"{len(max_grad_norm)}")
            return [check_positive(c, f"max_grad_norm[{i}]") for i, c in enumerate(max_grad_norm)]
        c = check_positive(max_grad_norm, "max_grad_norm")
        return [c / math.sqrt(P)] * P

    def _set_layouts(self, model: nn.Module) -> None:
        own = module_batch_first(model)
        if own is not None and own != self.batch_first:
            raise ValueError(
                f"batch_first: expected {own}, as the model ({type(model).__name__}) was built "
                f"with batch_first={own} and its inputs are laid out so; got {self.batch_first}")
        layouts = enclosing_batch_first(model)
        for tap in self.taps:
            tap.batch_first, tap.layout = layer_batch_first(tap.name, tap.module, layouts,
                                                            self.batch_first)

    @staticmethod
    def _find_layers(model: nn.Module) -> list[_Tap]:
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
            params, alias = {}, {}
            composite_layer = isinstance(module, nn.MultiheadAttention)
            own = module.named_parameters(recurse=composite_layer)
            for pname, p in own:
                full = f"{name}.{pname}" if name else pname
                if not p.requires_grad:
                    continue
                plain = pname == "weight" and not composite_layer
                if id(p) in owner:
                    first, first_plain = owner[id(p)]
                    if not (plain and first_plain):
                        raise ValueError(
                            f"GhostClipper: parameter {full!r} is shared with {first!r}; "
                            "expected only the `weight` of layers outside "
                            "nn.MultiheadAttention to be shared (an embedding tied to the "
                            "output Linear), got a shared bias or attention parameter. Tie "
                            "the weights only, or give each layer its own parameter")
                    alias[pname] = first
                else:
                    owner[id(p)] = (full, plain)
                params[pname] = p
            if isinstance(module, nn.MultiheadAttention):
                composite.update(id(m) for m in module.modules() if m is not module)
                check_attention(name, module)
            if not params:
                continue
            rule, base = rule_for(module)
            conv = isinstance(module, nn.modules.conv._ConvNd)
            if rule is not None and conv and \
                    type(module)._conv_forward is not getattr(base, "_conv_forward", None):
                # The hooks mark the convolution at _conv_forward: an override
                # (weight standardisation, a reparametrisation) computes
                # something the convolution's rule does not describe.
                raise ValueError(
                    f"GhostClipper: layer {name!r} ({type(module).__name__}) overrides "
                    f"_conv_forward of {base.__name__}, so {base.__name__}'s rule may not "
                    "describe what it computes (weight standardisation: its gradient is "
                    "not the plain convolution's); register a rule for its own type with "
                    "ncdp_fast.torch.register_layer")
            if rule is not None and type(module).forward is not base.forward and not conv:
                raise ValueError(
                    f"GhostClipper: layer {name!r} ({type(module).__name__}) overrides the forward "
                    f"of {base.__name__}, so {base.__name__}'s rule may not describe what it "
                    "computes; register a rule for its own type with "
                    "ncdp_fast.torch.register_layer")
            if rule is None and replacement(module):
                raise torch_rnn_error(name, module)
            if rule is None:
                shown = ", ".join(repr(f"{name}.{n}" if name else n) for n in params)
                raise ValueError(
                    f"GhostClipper: trainable parameter(s) {shown} belong to "
                    f"{type(module).__name__}, which has no per-sample gradient rule; freeze "
                    "them, or register one with ncdp_fast.torch.register_layer")
            refuse_unsupported(name, module)
            seen.add(id(module))
            taps.append(_Tap(name, module, rule, params, alias=alias))
        if not taps:
            raise ValueError("GhostClipper: the model has no trainable parameter")
        return taps

    @staticmethod
    def check_model(model: nn.Module) -> None:
        """Raise what construction would refuse about ``model``'s layers (the
        first refusal, naming the layer), attaching nothing."""
        GhostClipper._find_layers(model)

    # ------------------------------------------------------------------- hooks
    def _capturing(self) -> bool:
        # As Opacus: nothing is recorded outside training mode (an evaluation
        # forward with grad on), or while hooks are disabled; such a forward
        # computes ordinary gradients, which a step refuses.
        return torch.is_grad_enabled() and self.enabled and self.model.training

    def _model_pre_hook(self, module, args, kwargs):
        if not in_backward():
            self._pass += 1
        if self._capturing():
            return self._batch.pre_hook(module, args, kwargs)
        if torch.is_grad_enabled():
            self._uncaptured.add("disabled" if not self.enabled else "eval")
        return None

    def declare_batch_size(self, n: int) -> None:
        """State the number of samples of the current step (until the next
        :meth:`privatize_` or :meth:`clear`), for a model whose first input
        tensor does not carry the batch; every layer's rows are checked
        against it instead of the input's.  ``n = 0`` with no forward: the
        step of an empty Poisson batch that the model cannot run (transformers'
        models reshape zero rows with -1) is pure noise, as with a forward."""
        self._batch.declared = check_int(n, "n", 0)

    def _pre_hook(self, tap: _Tap):
        conv = isinstance(tap.module, nn.modules.conv._ConvNd)

        def hook(module, inputs):
            tap.replaying = False
            tap.recording = self._capturing()
            if not tap.recording:
                if self.enabled and self.model.training:
                    tap.nograd = self._pass
                return
            active = frozenset(n for n, p in tap.params.items() if p.requires_grad)
            if not active and not tap.records:
                # Every parameter frozen since attach: an ordinary frozen layer.
                tap.recording = False
                return
            if in_backward():
                # A checkpoint's recomputation: switched off as the recorded
                # call was, so that the tensors it saves are the same.
                tap.recording = False            # until it is known to be one
                if tap.nograd == tap.recorded_in or reentrant_recompute(tap.name, module):
                    raise refuse_reentrant(tap.name, module)
                if tap.replays >= tap.calls:
                    raise refuse_unmatched(tap.name, module, tap.calls)
                tap.recording = tap.replaying = True
                tap.replays += 1
            else:
                tap.calls += 1
            if tap.records and active != tap.active:
                tap.recording = False
                raise RuntimeError(
                    f"GhostClipper: layer {tap.name!r} ran forward with trainable parameters "
                    f"{sorted(active)}, earlier in this step with {sorted(tap.active)}; "
                    "freeze or unfreeze parameters between steps, not within one (call clear() "
                    "to discard this step)")
            tap.active = active
            if not conv:
                # The parameter gradients of the ordinary backward would be
                # replaced by privatize_(); switching requires_grad off for the
                # duration of this forward keeps autograd from computing them at
                # all (the weight-gradient GEMM of every layer saved).  A
                # convolution does this around _conv_forward only, where its
                # rule applies: a subclass's own forward keeps its gradients.
                tap.saved = self._switch_off(tap)
        return hook

    @staticmethod
    def _switch_off(tap: _Tap) -> tuple:
        saved = tuple(p.requires_grad for p in tap.params.values())
        for p in tap.params.values():
            p.requires_grad_(False)
        return saved

    @staticmethod
    def _switch_back(tap: _Tap, saved: tuple) -> None:
        # The state the user left, not True: a parameter frozen after attach
        # stays frozen.
        for p, r in zip(tap.params.values(), saved):
            p.requires_grad_(r)

    def _restore_hook(self, tap: _Tap):
        def hook(module, inputs, output):
            tap.recording = tap.replaying = False
            if tap.saved is not None:        # always_call=True: restored even on error
                self._switch_back(tap, tap.saved)
                tap.saved = None
        return hook

    def _outside_hook(self, name: str, tap: _Tap):
        def hook(p):
            # After an unrecorded forward, a gradient may be that forward's
            # ordinary one: refused under that cause (if still there at the step).
            found = self._uncaptured_grads if self._uncaptured else self._outside
            found.setdefault(name, type(tap.module).__name__)
        return hook

    def _capture(self, tap: _Tap, slot, inputs: tuple, output):
        """Record ``inputs`` and arrange for the gradient of ``output``; returns the
        tensor the forward continues with."""
        if not tap.recording or output is None:
            # None: the forward raised (always_call hooks still run), or nothing
            # depends on the layer, whose gradient is then exactly zero.
            return output
        if tap.replaying:
            # The recorded call's output entered the graph the same way.
            if isinstance(output, torch.Tensor) and not output.requires_grad:
                return _CaptureGrad.apply(output, self._anchor, _ignore)
            return output
        if not isinstance(output, torch.Tensor):
            # Nothing to hook a gradient on: the layer would get pure noise.
            raise TypeError(
                f"GhostClipper: layer {tap.name!r} ({type(tap.module).__name__}) returned "
                f"{type(output).__name__}, expected one tensor (its rule is given the "
                "gradient of that output); return one tensor from the layer, or put the "
                "trainable parameters in a sub-module that does")
        if any(r.got for r in tap.records):
            raise RuntimeError(
                f"GhostClipper: layer {tap.name!r} runs forward again after a backward pass "
                "reached it; call privatize_() (optimizer.step()) before the next forward "
                "(batches are not accumulated: each step is one batch), or clear() to discard")
        inputs = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in inputs)
        rec = _Record(inputs, slot, tuple(getattr(x, "_version", 0) for x in inputs))
        tap.records.append(rec)
        tap.recorded_in = self._pass
        def on_grad(grad):
            self._on_grad(tap, rec, grad)
        if output.requires_grad:
            # A tensor hook fires with the gradient of this value even if a later
            # in-place op (an inplace ReLU) modifies it: no copy needed.
            output.register_hook(on_grad)
            return output
        return _CaptureGrad.apply(output, self._anchor, on_grad)

    def _on_grad(self, tap: _Tap, rec: _Record, grad):
        if rec.got:
            rec.twice = True            # a second backward through the same forward
            return
        rec.grad, rec.got = grad.detach(), True
        if all(r.got for r in tap.records):
            # The layer's last output gradient: run its rule now, inside backward,
            # and let go of its inputs and gradients (instantiated blocks are the
            # size of the parameters; the rest is freed as backward goes on).
            self._evaluate(tap)

    def _evaluate(self, tap: _Tap) -> None:
        batch, source = self._batch.get(tap.name)
        for rec in tap.records:
            if any(getattr(x, "_version", 0) != v for x, v in zip(rec.inputs, rec.versions)):
                raise RuntimeError(
                    f"GhostClipper: the input of layer {tap.name!r} was modified in place "
                    "after the layer ran (an inplace op on a tensor the layer read); its "
                    "per-sample gradient would be wrong. Make that op out of place")
            shape = rec.grad.shape
            if not shape:
                raise ValueError(f"GhostClipper: layer {tap.name!r} ({type(tap.module).__name__}) "
                                 "returned a 0-d output: it has no batch dimension, so no "
                                 "per-sample gradient; expected an output whose rows are the "
                                 f"step's {batch} samples")
            dim = batch_dim(tap.module, tap.batch_first, rec.grad)
            if shape[dim] != batch:
                raise rows_error(tap.name, tap.module, shape, dim, tap.batch_first, tap.layout,
                                 batch, source)
            # The rules read dimension 0 as the batch: a sequence-first call is
            # handed to them with its batch moved there.
            rec.inputs, rec.grad = to_batch_first(rec.inputs, rec.grad, dim)
            if tap.half:
                # The rule computes in float32 from here on: the half values
                # are exact in float32, so nothing but the final rounding of
                # the private gradient to the parameter's dtype is in half.
                rec.inputs = tuple(_upcast(x) for x in rec.inputs)
                rec.grad = _upcast(rec.grad)
        calls = [Call(r.inputs, r.grad, r.slot) for r in tap.records]
        trainable = tap.trainable()
        got = tap.rule(tap.module, calls, trainable)
        covered = [n for names, _ in got for n in names]
        if sorted(covered) != sorted(trainable):
            raise RuntimeError(f"GhostClipper: the rule of {type(tap.module).__name__} "
                               f"({tap.name!r}) returned blocks for {covered}, expected each "
                               f"of {sorted(trainable)} once")
        tap.blocks = self._instantiate_tied(
            tap, calls, [(names, self._cast(tap, names, block)) for names, block in got], batch)
        tap.batch = batch
        for rec in tap.records:
            rec.inputs = rec.grad = None

    def _instantiate_tied(self, tap: _Tap, calls, blocks: list, batch: int) -> list:
        """A shared weight's block as this layer's use of it (:mod:`.tied`),
        kept to the step, where the uses are combined sample by sample before
        any norm (a norm per use would leave out the cross terms)."""
        out = []
        for names, block in blocks:
            p = tap.params[names[0]]
            if id(p) not in self._tied:
                out.append((names, block))
                continue
            out.append(((names[0],), tied.as_use(tap.module, calls, block, tuple(p.shape), batch,
                                                 accumulation_dtype(p.dtype))))
            if isinstance(block, tuple) and block[2]:
                out.append(((names[1],), block[1].sum(1)))
        return out

    def _forward_hook(self, tap: _Tap):
        def hook(module, inputs, output):
            got = output
            if tap.recording:       # position ids (1, T): one row per sample
                inputs, got = broadcast_rows(module, inputs, output, tap.batch_first,
                                             self._batch.known())
            out = self._capture(tap, None, inputs, got)
            return None if out is output else out
        return hook

    def _marker(self, tap: _Tap):
        return lambda slot, x, output: self._capture(tap, slot, (x,), output)

    def _conv_marker(self, tap: _Tap):
        module = tap.module
        conv = type(module)._conv_forward.__get__(module)

        def forward(x, weight, bias):
            if not tap.recording:
                return conv(x, weight, bias)
            if weight is not module.weight or bias is not module.bias:
                # The rule differentiates with respect to the parameters
                # themselves, not a tensor computed from them.
                raise ValueError(
                    f"GhostClipper: layer {tap.name!r} ({type(module).__name__}) passes a "
                    "weight or bias to _conv_forward that is not its own parameter (computed "
                    "from it in its forward?); the convolution's rule would give the gradient "
                    "of the wrong tensor. Register a rule for its own type with "
                    "ncdp_fast.torch.register_layer")
            saved = self._switch_off(tap)
            try:
                return self._capture(tap, None, (x,), conv(x, weight, bias))
            finally:
                self._switch_back(tap, saved)
        return forward

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
        self._outside.clear()
        self._uncaptured.clear()
        self._uncaptured_grads.clear()
        self._batch.clear()

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
    def _batch_size(self) -> int:
        batch = None
        for tap in self.taps:
            if any(rec.twice for rec in tap.records):
                raise RuntimeError(
                    f"GhostClipper: backward reached layer {tap.name!r} twice through the "
                    "same recorded forward; run exactly one loss.backward() per forward (sum "
                    "the losses first), or call clear() to discard the step")
            if tap.records and tap.blocks is None:
                raise RuntimeError(
                    f"GhostClipper: layer {tap.name!r} ran forward but backward did not reach "
                    "it; run exactly one loss.backward() per recorded forward (call clear() "
                    "to discard a forward). Under torch.utils.checkpoint on a torch that does "
                    "not report a running backward (torch._C._current_graph_task_id), a "
                    "recomputation cannot be told from a use (ncdp_fast.torch.recompute)")
            if tap.batch is not None:
                batch = tap.batch        # each layer's was checked against the step's
        if batch is None and self._batch.declared == 0:
            # An empty Poisson batch of a model that cannot run on zero rows
            # (transformers' attention reshapes): the step is pure noise.
            return 0
        if batch is None:
            raise RuntimeError("GhostClipper: no forward/backward was recorded since the last "
                               "step (for an empty batch whose forward the model cannot run, "
                               "call declare_batch_size(0) before the step: pure noise)")
        return batch

    def _entries(self, batch: int):
        """[(tap, names, block)] in layer order; a layer unused this step adds pure
        noise.  A shared weight has one entry, at its first layer: the sum of
        its uses' per-sample gradients (B, *shape)."""
        uses: dict[int, list] = {}
        for tap in self.taps:
            for names, block in tap.blocks or ():
                if id(tap.params[names[0]]) in self._tied:
                    uses.setdefault(id(tap.params[names[0]]), []).append(block)

        def summed(p):
            return tied.combine(uses[id(p)], tuple(p.shape), accumulation_dtype(p.dtype), batch)
        entries = []
        for tap in self.taps:
            if tap.blocks is None:
                trainable = tap.trainable()
                for n, p in tap.params.items():
                    if n in tap.alias or (n not in trainable and id(p) not in uses):
                        continue
                    if id(p) in uses:
                        entries.append((tap, (n,), summed(p)))
                        continue
                    dtype = accumulation_dtype(p.dtype)
                    zeros = p.new_zeros(p.shape, dtype=dtype)
                    block = GhostBlock(torch.zeros(batch, dtype=torch.float64, device=p.device),
                                       lambda f, z=zeros: z.clone(), tuple(p.shape), 1,
                                       dtype=dtype)
                    entries.append((tap, (n,), block))
            else:
                for names, block in tap.blocks:
                    p = tap.params[names[0]]
                    if id(p) not in self._tied:
                        entries.append((tap, names, block))
                    elif names[0] not in tap.alias:
                        entries.append((tap, names, summed(p)))
        return entries

    @staticmethod
    def _cast(tap, names, block):
        """The block in its parameter's accumulation dtype (float32 for a half
        parameter; autocast's half activations of a float32 layer, float32)."""
        dtype = accumulation_dtype(tap.params[names[0]].dtype)
        if isinstance(block, tuple):
            a, g, bias = block
            return (a.to(dtype), g.to(dtype), bias)
        if isinstance(block, torch.Tensor):
            return block.to(dtype)
        if isinstance(block, GhostBlock) and block.dtype in HALF:
            raise TypeError(
                f"GhostClipper: the rule of {type(tap.module).__name__} ({tap.name!r}) returned "
                f"a GhostBlock for {list(names)} of dtype {block.dtype}, expected "
                f"{dtype}: the private gradient of a half-precision parameter is summed and "
                f"noised in {dtype} and rounded to {block.dtype} once; give the block "
                f"dtype={dtype} and a clipped_sum returning {dtype} (call clear() to discard "
                "this step)")
        return block

    def _per_layer(self, entries, grad_scale, noise=True):
        """Each parameter on its own bound; one clip call per parameter, each taking
        the next range of the stream (``noise=False``: clipped sums only, no
        draw, no step counted)."""
        split = []
        for tap, names, block in entries:
            if isinstance(block, tuple) and len(names) == 2:
                a, g, _ = block
                split += [(tap, names[:1], (a, g, False)), (tap, names[1:], g.sum(1))]
            else:
                split.append((tap, names, block))
        bounds = dict(zip(self.param_names, self.layer_norms))
        clip = self._clip_and_noise if noise else self._clip_only
        results = [clip([block], grad_scale, count=False,
                        max_norm=bounds[t.full(n[0])])
                   for t, n, block in split]
        if not noise:
            return results, split
        self._steps += 1
        first = results[0]
        sq = sum(torch.as_tensor(r.norms, dtype=torch.float64) ** 2 for r in results)
        result = LayersClipResult(
            norms=sq.sqrt(), num_clipped=max(r.num_clipped for r in results),
            num_nonfinite=max(r.num_nonfinite for r in results), seed=first.seed,
            offset=first.offset, draws=sum(r.draws for r in results),
            grads=[r.grads[0] for r in results])
        self.last_result = result
        return result, split

    def _refuse_outside_terms(self) -> None:
        if self._outside:
            # In the model's order (the hooks fired in backward's order).
            shown = ", ".join(f"{n!r} ({self._outside[n]})" for n in self.param_names
                              if n in self._outside)
            raise RuntimeError(
                f"GhostClipper: parameter(s) {shown} got a gradient from outside the layer's "
                "forward in this backward: a term that uses the parameter directly "
                "(a tied weight such as F.linear(h, emb.weight), a penalty on the weights "
                "in the loss, a subclass forward that uses the weight itself). Its private "
                "gradient comes from the layer's inputs and output gradients only, so that "
                "term would be dropped. Put weight decay in the optimizer (weight_decay=), "
                "tie weights by calling the layer itself, or register a rule for a layer "
                "that computes the whole use; call clear() to discard this step")

    def _refuse_uncaptured(self) -> None:
        if not self._uncaptured_grads:
            return
        params = {t.full(n): p for t in self.taps
                  for n, p in t.owned.items()}
        # A gradient zeroed since (zero_grad) is gone: only one still held counts.
        held = [n for n in self.param_names
                if n in self._uncaptured_grads and params[n].grad is not None]
        if not held:
            return
        causes = []
        if "eval" in self._uncaptured:
            causes.append("ran in eval mode (the model's training flag was False: model.eval())")
        if "disabled" in self._uncaptured:
            causes.append("ran while the hooks were disabled (disable_hooks())")
        raise RuntimeError(
            f"GhostClipper: parameter(s) {held} hold a gradient that was not privatized: a "
            f"forward since the last step {' and one '.join(causes)}, when the clipper records "
            "nothing (as Opacus), and a backward gave them its ordinary, unclipped and "
            "unnoised gradient (or a term outside the layer's forward, such as a tied weight, "
            "did). Evaluate under torch.no_grad(); call model.train() (and enable_hooks()) "
            "before a training forward; discard these gradients with zero_grad() and "
            "clipper.clear(). Nothing was written")

    def _refuse_foreign(self, privatized: set, optimizer) -> None:
        """Every parameter the model holds, and the optimizer updates, that has a
        gradient must be one privatized now (or carry a gradient this clipper
        released earlier): else the optimizer would apply a raw gradient."""
        params = self._model_params
        if optimizer is not None:
            params = params + optimizer_params(optimizer)
        found = self._released.first_foreign(params, privatized)
        if found is None:
            return
        p, where = found
        names = {id(q): n for n, q in self.model.named_parameters()}
        if id(p) in names:
            name = repr(names[id(p)])
            mine = {id(q) for t in self.taps for q in t.params.values()}
            reason = ("it was frozen when this step's forward ran" if id(p) in mine else
                      "it is not one of the clipper's parameters: it was frozen when the "
                      "clipper was built (make_private) and unfrozen since, or added since")
        else:
            name = f"optimizer.param_groups[{where[0]}]['params'][{where[1]}]"
            reason = ("it is not a parameter of the model the clipper wraps: an extra "
                      "parameter given to the optimizer, or an add_param_group")
        raise foreign_grad_error(
            "GhostClipper", name, p, reason,
            "Build the clipper (make_private) once the model and optimizer hold every "
            "parameter to train, unfrozen; to leave one untrained, freeze it "
            "(requires_grad_(False)) and set its .grad to None")

    def _clip_only(self, blocks, grad_scale, max_norm=None, count=False) -> LayersClipResult:
        """Clipped sum of ``blocks`` without noise and without the mean's division:
        the share of one physical batch in a logical step.  Noise std 0 adds
        exactly 0, so a throwaway key from the OS serves (seed=None: no ledger
        entry); the clipper's own stream is left for the step's single noise."""
        return clip_and_noise_layers(
            blocks, max_norm=self.max_grad_norm if max_norm is None else max_norm,
            noise_multiplier=0.0, seed=None, reduction="sum",
            nan_policy=self.nan_policy, grad_scale=grad_scale)

    def _step_entries(self, optimizer):
        """The checks before a step or an accumulation (nothing written or drawn
        if one fails): ``(entries, grad_scale)``."""
        if not any(p.requires_grad for t in self.taps for p in t.params.values()):
            raise RuntimeError(
                "GhostClipper: every parameter it privatizes has been frozen since it was "
                f"built ({self.param_names}); nothing would be trained. Unfreeze some, or "
                "skip the step")
        self._refuse_uncaptured()
        batch = self._batch_size()
        self._refuse_outside_terms()
        entries = self._entries(batch)
        self._refuse_foreign({id(tap.params[n]) for tap, names, _ in entries for n in names},
                             optimizer)
        if self._accumulated:
            now = {tap.full(n) for tap, names, _ in entries
                   for n in names}
            if now != set(self._accumulated):
                raise RuntimeError(
                    "GhostClipper: the trainable parameters changed within one logical batch "
                    f"(accumulated: {sorted(self._accumulated)}, now: {sorted(now)}); freeze "
                    "or unfreeze parameters between logical steps, or discard_accumulated()")
        # The output gradients of a batch-mean loss are each sample's own divided
        # by the batch size: the op multiplies back (on the (B,) norms and factors).
        scale = float(batch) if self.loss_reduction == "mean" and batch else 1.0
        return entries, scale

    def accumulate_(self, optimizer=None) -> None:
        """Clip this physical batch's samples and add their clipped sum to the
        logical batch's accumulator, without noise: the next :meth:`privatize_`
        adds it to its own batch's sum before noising once.  Same refusals as
        :meth:`privatize_` (nothing accumulated if one fails); no ``.grad`` is
        written, nothing drawn from the stream, no step counted.

        Privacy meaning: the physical batches of one logical (Poisson) batch
        hold disjoint samples, so each sample's whole gradient is clipped at
        ``max_grad_norm`` in exactly one of them and the logical step stays one
        Gaussian mechanism of sensitivity ``max_grad_norm``.  With a
        mean-reduced loss the physical batch's mean is undone by its realized
        size, and the step divides by ``expected_batch_size`` (the logical
        one) once."""
        if self.group is not None:
            raise ValueError(
                "GhostClipper: accumulate_ (a skipped step, BatchMemoryManager) with group=: "
                "expected one process; the ranks' shards of a logical batch split into "
                "different numbers of physical batches, so their steps would not pair. Train "
                "across ranks without BatchMemoryManager, or with a smaller logical batch")
        entries, scale = self._step_entries(optimizer)
        if self.clipping != "per_layer":
            only = self._clip_only([block for _, _, block in entries], scale)
            grads = only.grads
            if self.adaptive is not None:
                self._centered += self.adaptive.centered_count(only.norms, self.max_grad_norm)
        else:
            results, entries = self._per_layer(entries, scale, noise=False)
            grads = [r.grads[0] for r in results]
        for tap, n, g in _per_parameter(entries, grads):
            name = tap.full(n)
            held = self._accumulated.get(name)
            self._accumulated[name] = g if held is None else held.add_(g)
        self.clear()

    def discard_accumulated(self) -> None:
        """Drop the clipped sums accumulated since the last :meth:`privatize_`
        (a logical batch left unfinished: nothing of it is released)."""
        self._accumulated.clear()
        self._centered = 0.0

    def privatize_(self, optimizer=None) -> LayersClipResult:
        """Overwrite every trainable ``p.grad`` with its private gradient and forget
        the recorded tensors.  Returns the clip result (per-sample norms over
        all layers, clipped count, stream position; with per-layer clipping
        ``num_clipped`` is the largest count of any parameter).

        Refuses (RuntimeError / ValueError, nothing written, no noise drawn) a
        gradient the step would not privatize: autograd's gradient of a
        privatized parameter from a use outside its layer, or any ``.grad`` on
        another parameter of the model (as it was at construction) or of
        ``optimizer`` (the torch optimizer about to step: pass it, so that a
        parameter it holds outside the model is checked too; ``DPOptimizer``
        does) other than one this clipper released.

        After :meth:`accumulate_` calls, the accumulated clipped sums are added
        before the noise's division (one noise for the logical batch);
        ``last_result`` then describes this call's physical batch only."""
        entries, scale = self._step_entries(optimizer)
        if self.clipping != "per_layer":
            result = self._clip_and_noise([block for _, _, block in entries], scale)
        else:
            result, entries = self._per_layer(entries, scale)
        writes = []
        for tap, n, g in _per_parameter(entries, result.grads):
            p = tap.params[n]
            held = self._accumulated.get(tap.full(n))
            if held is not None:
                # The op returned inv * (S_last + noise); the earlier physical
                # batches' clipped sums take the same division.
                inv = 1.0 / self.expected_batch_size if self.loss_reduction == "mean" else 1.0
                g = g.add_(held, alpha=inv)
            # A half parameter's gradient was summed and noised in float32:
            # rounded here, once.
            writes.append((tap, n, p, g.to(p.dtype)))
        # Spent with this step's noise, whether it is written or refused.
        self._accumulated.clear()
        centered, self._centered = self._centered, 0.0
        self._refuse_overflow(writes)
        for _, _, p, g in writes:
            p.grad = g
            self._released.wrote(p, p.grad)
        self.clear()
        if self.adaptive is not None:
            # After the step's noise, at the logical step: the next logical
            # batch is clipped (and noised) at the new bound throughout.
            centered += self.adaptive.centered_count(result.norms, self.max_grad_norm)
            self.max_grad_norm = self.adaptive.next_bound(
                centered, self.max_grad_norm, self.expected_batch_size, self._stream)
        return result

    def _refuse_overflow(self, writes) -> None:
        """A finite float32 private gradient rounded to float16 (largest 65504) can
        become inf: writing it would step every weight it touches to inf."""
        for tap, n, p, g in writes:
            if p.dtype in HALF and not bool(torch.isfinite(g).all()):
                name = tap.full(n)
                self.clear()
                raise ValueError(
                    f"GhostClipper: the private gradient of parameter {name!r} overflows "
                    f"{p.dtype} (largest {torch.finfo(p.dtype).max:g}) when rounded from "
                    "float32; expected a gradient within its range (noise std "
                    f"{self._grad_noise_multiplier() * self.max_grad_norm:g} before the "
                    "division by the batch). Keep the parameters in float32 and run the "
                    "forward under torch.autocast, or use bfloat16. Nothing was written; this "
                    "step's noise is spent")
