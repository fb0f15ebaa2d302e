"""A trainable layer as the clipper sees it: its rule (:func:`layer_rule`), its
trainable parameters, the forward calls recorded since the last step, and
the blocks the step hands to the clip op (:func:`step_entries`).

:class:`Tap` and :class:`Record` hold only this step's tensors (dropped once
the layer's rule has run); :class:`CaptureGrad` puts a layer's output into the
graph when nothing trainable below it would."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter, itemgetter

import torch
from torch import nn

from .._clip import GhostBlock
from . import tied
from .layers import HALF, accumulation_dtype, rule_for
from .rnn import replacement, torch_rnn_error

__all__ = ["CaptureGrad", "Record", "Tap", "layer_rule", "step_entries", "ignore",
           "per_parameter", "switch_off", "switch_back", "trainable_now"]


class CaptureGrad(torch.autograd.Function):
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
class Record:
    """One recorded forward call (or marked point) of a layer; its tensors are
    dropped once the layer's rule has run."""
    inputs: tuple | None
    slot: str | None
    versions: tuple
    grad: torch.Tensor | None = None
    got: bool = False
    twice: bool = False


@dataclass
class Tap:
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
        return trainable_now(self)

    def clear(self):
        self.records.clear()
        self.blocks, self.batch, self.active = None, None, None
        self.calls, self.replays, self.replaying = 0, 0, False


_VERSION = attrgetter("_version")


def refuse_changed(kept) -> None:
    """Refuse a step whose layers' inputs, read by their blocks at the step
    (``kept``: (tensor, its _version at the backward, layer name)), were
    changed in place since (a loader's buffer refilled with the next batch):
    the step would clip and sum other values than those whose gradients the
    backward gave (the fourth audit: relative error 0.45, no error)."""
    if not kept or list(map(_VERSION, map(itemgetter(0), kept))) == \
            list(map(itemgetter(1), kept)):
        return
    name = next(n for t, v, n in kept if t._version != v)
    raise RuntimeError(
        f"GhostClipper: the input of layer {name!r} was modified in place after the backward "
        "(an in-place op, or a buffer refilled with the next batch, before the step); the "
        "step reads it, so its per-sample gradients would be wrong. Refill input buffers "
        "after optimizer.step(), or call clear() to discard this step")


def overridden(module: nn.Module, base: type) -> list[str]:
    """The methods of ``base`` (the class whose rule ``module`` takes) that a
    class between them replaces; a convolution's forward may be (it is recorded
    at _conv_forward)."""
    safe = {"forward"} if isinstance(module, nn.modules.conv._ConvNd) else set()
    replaced = set()
    for cls in type(module).__mro__:
        if cls is base:
            break
        replaced.update(k for k, v in vars(cls).items()
                        if callable(v) and not k.startswith("__") and k not in safe
                        and not _inert(k) and callable(getattr(base, k, None)))
    return sorted(replaced)


def _inert(name: str) -> bool:
    """Methods whose override does not change what a layer computes: nn.Module's
    own machinery (state dicts, hooks, train/eval, ...) and initialisation."""
    return (name != "forward" and hasattr(nn.Module, name)) or name in (
        "reset_parameters", "_reset_parameters", "extra_repr")


def _pruned_originals(module: nn.Module, params: dict) -> list[str]:
    """The tensors of ``module`` that torch.nn.utils.prune recomputes before each
    forward (its pre-hooks) from an original among ``params``, the layer's
    trainable parameters by name."""
    from torch.nn.utils import prune
    return [hook._tensor_name for hook in module._forward_pre_hooks.values()
            if isinstance(hook, prune.BasePruningMethod)
            and f"{hook._tensor_name}_orig" in params]


def _reparametrized(module: nn.Module, params: dict) -> tuple[str, str] | None:
    """``(function, tensor)`` where the old hook-based ``torch.nn.utils.weight_norm``
    or ``spectral_norm`` recomputes a tensor of ``module`` before each forward
    from trainable parameters among ``params`` (weight_g/weight_v, weight_orig)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm) and f"{hook.name}_v" in params:
            return "weight_norm", hook.name
        if isinstance(hook, SpectralNorm) and f"{hook.name}_orig" in params:
            return "spectral_norm", hook.name
    return None


def layer_rule(name: str, module: nn.Module, params: dict):
    """The per-sample gradient rule of layer ``name`` (``params``: its trainable
    parameters), refusing a layer without one and a subclass whose forward
    the rule of its base may not describe."""
    rule, base = rule_for(module)
    if rule is not None:
        replaced = overridden(module, base)
        if replaced:
            # The hooks mark a convolution at _conv_forward (so a subclass that
            # pads in its own forward first is exact); any other method of the
            # base replaced (weight standardisation at _conv_forward, a helper
            # such as GemmaRMSNorm's _norm, a forward that scales its output)
            # computes something the base's rule does not describe.
            what = "the forward" if replaced == ["forward"] else ", ".join(replaced)
            raise ValueError(
                f"GhostClipper: layer {name!r} ({type(module).__name__}) overrides {what} "
                f"of {base.__name__}, so {base.__name__}'s rule may not describe what it "
                "computes; register a rule for its own type with "
                "ncdp_fast.torch.register_layer")
        pruned = _pruned_originals(module, params)
        if pruned:
            # Refused here, by name: at the step the rule's blocks (named for
            # the tensor the forward reads) and the trainable originals would
            # disagree, and the refusal said only that.
            t = pruned[0]
            raise ValueError(
                f"GhostClipper: layer {name!r} ({type(module).__name__}) is pruned with "
                f"torch.nn.utils.prune: its {t!r} is recomputed from {t}_orig * {t}_mask "
                f"before each forward, so {base.__name__}'s rule gives per-sample gradients "
                f"of {t!r}, not of the trainable {t}_orig; make the pruning permanent before "
                f"make_private with torch.nn.utils.prune.remove(module, {t!r}) (the pruned "
                "entries are then trained too unless the mask is applied again after each "
                f"step), or freeze {t}_orig")
        lazy = [n for n, p in params.items() if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            # Its shape is not known yet: no rule can be laid out for it (torch's
            # own error then names neither the layer nor the fix).
            raise ValueError(
                f"GhostClipper: layer {name!r} ({type(module).__name__}) has uninitialized "
                f"lazy parameter(s) {lazy}: expected materialized parameters; run one "
                "forward of the model on a batch of public or dummy data before "
                "make_private / GhostClipper")
        hooked = _reparametrized(module, params)
        if hooked is not None:
            # The same disagreement, refused here rather than at the step
            # (whose message named neither, the fifth audit).
            fn, t = hooked
            raise ValueError(
                f"GhostClipper: layer {name!r} ({type(module).__name__}) uses "
                f"torch.nn.utils.{fn}: its {t!r} is recomputed from other trainable "
                f"parameters before each forward, so {base.__name__}'s rule gives per-sample "
                f"gradients of {t!r}, not of the parameters trained; remove it before "
                f"make_private (torch.nn.utils.remove_{fn}), or freeze the layer")
    if rule is None and replacement(module):
        raise torch_rnn_error(name, module)
    if rule is None:
        shown = ", ".join(repr(f"{name}.{n}" if name else n) for n in params)
        raise ValueError(
            f"GhostClipper: trainable parameter(s) {shown} belong to "
            f"{type(module).__name__}, which has no per-sample gradient rule; freeze "
            "them, or register one with ncdp_fast.torch.register_layer")
    return rule


def step_entries(taps, tied_ids: set, batch: int, gram32: bool = False) -> list:
    """[(tap, names, block)] in layer order; a layer unused this step adds pure
    noise.  A shared weight (its id in ``tied_ids``) has one entry, at its first
    layer: the sum of its uses' per-sample gradients (B, *shape), its ghost
    form's Grams float32 with ``gram32`` (tied.combine)."""
    uses = tied.uses_by_weight(taps, tied_ids)
    entries = []
    for tap in taps:
        if tap.blocks is None:
            trainable = tap.trainable()
            for n, p in tap.params.items():
                if n in tap.alias or (n not in trainable and id(p) not in uses):
                    continue
                if id(p) in uses:
                    entries.append((tap, (n,), tied.combined(uses, p, batch, gram32)))
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
                if id(p) not in tied_ids:
                    entries.append((tap, names, block))
                elif names[0] not in tap.alias:
                    entries.append((tap, names, tied.combined(uses, p, batch, gram32)))
    return entries


def per_parameter(entries, grads):
    """``(tap, name, grad)`` for each parameter of the step's ``entries`` and the
    clip op's ``grads`` (a pair block's grad is a (weight, bias) tuple), each
    grad in its parameter's shape."""
    for (tap, names, _), grad in zip(entries, grads):
        for n, g in zip(names, grad if isinstance(grad, tuple) else (grad,)):
            shape = tap.params[n].shape
            # Most blocks come in their parameter's shape: no view to make
            # (an op of host time each, some 50 a step of a small transformer).
            yield tap, n, (g if g.shape == shape else g.view(shape))


def ignore(grad):
    pass


_REQUIRES_GRAD = attrgetter("requires_grad")


def trainable_now(tap: Tap) -> frozenset:
    """The names of the layer's parameters that require grad now (C-level
    maps: each recorded forward asks, issue 36's host time)."""
    params = tap.params
    return frozenset(compress(params, map(_REQUIRES_GRAD, params.values())))


def switch_off(tap: Tap) -> tuple:
    """Switch the layer's parameters' requires_grad off; returns the previous flags."""
    values = tap.params.values()
    saved = tuple(map(_REQUIRES_GRAD, values))
    for p in values:
        p.requires_grad_(False)
    return saved


def switch_back(tap: Tap, saved: tuple) -> None:
    # The state the user left, not True: a parameter frozen after attach
    # stays frozen.
    for p, r in zip(tap.params.values(), saved):
        p.requires_grad_(r)
