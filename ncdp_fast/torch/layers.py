"""Book-keeping rules: each trainable layer's private-gradient blocks from what one
ordinary backward pass leaves behind (its inputs and its output gradient).

A rule is one function per layer type, ``rule(module, calls, trainable) ->
[(names, block), ...]``: ``calls`` holds every forward call of the module in the
step (:class:`Call`: its inputs and the loss gradient with respect to its
output), ``trainable`` the names of its direct parameters that
require grad.  Each block is handed to the fused clip op
(:func:`ncdp_fast.clip_and_noise_layers`) and says how the per-sample gradient of
the parameters ``names`` is given:

* a pair ``(a, g, bias)``, ``a`` (B, T, d), ``g`` (B, T, K): the weight gradient
  ``sum_t g_t a_t^T`` (and the bias ``sum_t g_t``), never formed: norm from the
  ghost identity, clipped sum one GEMM; ``names`` = (weight,) or (weight, bias);
* a dense (B, *shape) per-sample gradient (instantiated); ``names`` = (name,);
* a :class:`ncdp_fast.GhostBlock` (squared norms + clipped-sum function).

Between a pair and an instantiated gradient the rule takes the cheaper
(:func:`factored_or_instantiated`, the mixed rule of Bu et al. 2023): the ghost
norm costs B*T^2*(d+K) and no memory of size K*d; the instantiated gradient
costs B*T*K*d and B*K*d memory.  Register a rule for your own layer type with
:func:`register_layer`; the built-ins below are its examples.  A class of an
optional package (``transformers``) is matched by its qualified name
(:func:`register_layer_by_name`, used by :mod:`.hf_layers`), so that its rule
needs no import of that package.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._clip import GhostBlock

__all__ = ["Call", "register_layer", "register_layer_by_name", "rule_for",
           "factored_or_instantiated", "RULES", "RULES_BY_NAME", "RULE_FINDERS",
           "refuse_unsupported", "HALF",
           "accumulation_dtype"]

HALF = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter's private gradient is computed in: float32 for a
    float16/bfloat16 parameter (its 8 or 11 significant bits cannot hold a sum
    over the batch; the clip op takes float32/float64 only), else its own."""
    return torch.float32 if dtype in HALF else dtype


@dataclass
class Call:
    """One forward call of a layer during the recorded step.

    inputs: the positional inputs of the call, detached (as the module got them).
    grad: (B, *output.shape[1:]) gradient of the loss with respect to the
        call's output, as backward produced it: row i is sample i's own loss
        gradient, divided by the batch size when the loss is a batch mean (the
        clip op multiplies back on its (B,) norms and factors, so every block
        a rule returns must be linear in ``grad`` -- any parameter gradient is).
        A sequence-first call ((T, B, ...), GhostClipper's ``batch_first``)
        arrives with its batch moved to dimension 0, here and in every tensor
        input that has a dimension 1.  For a layer with a float16/bfloat16
        parameter, ``grad`` and every float16/bfloat16 tensor input arrive
        upcast to float32 (exactly: each half value is a float32 value), and
        its blocks must be float32 (:func:`accumulation_dtype`).
    slot: None for a plain layer; a composite layer's own label for the
        point it marked (attention: "in", "q", "k", "v", "out").
    """
    inputs: tuple
    grad: torch.Tensor
    slot: str | None = None    # which marked point of a composite layer (attention)


Rule = Callable[[nn.Module, "list[Call]", "frozenset[str]"], list]
RULES: dict[type, Rule] = {}
# Rules for classes of packages ncdp_fast does not import (transformers), keyed
# by "module.QualName": matching by name needs no import of that package.
RULES_BY_NAME: dict[str, Rule] = {}
# Construction-time refusals of such classes: fn(module) -> problem or None.
CHECKS_BY_NAME: dict[str, Callable[[nn.Module], "str | None"]] = {}
# fn(cls) -> the "module.QualName" of a class in RULES_BY_NAME whose code ``cls``
# repeats, or None: how a copy of a registered class (transformers copies its
# layers into each model's file) finds that class's rule (hf_layers.py).
RULE_FINDERS: list[Callable[[type], "str | None"]] = []


def register_layer(*module_types: type):
    """Decorator: ``fn(module, calls, trainable) -> [(names, block), ...]`` becomes
    the rule of ``module_types`` (and their subclasses, unless a subclass has its
    own).  ``names`` are names of the module's *direct* parameters; every name in
    ``trainable`` must appear in exactly one entry.  See the module docstring for
    the blocks; the per-sample gradient of a sample is the sum over its calls."""
    for t in module_types:
        if not isinstance(t, type) or not issubclass(t, nn.Module):
            raise TypeError(f"register_layer: expected nn.Module subclasses, got {t!r}")

    def deco(fn: Rule) -> Rule:
        if not callable(fn):
            raise TypeError(f"register_layer: expected a function, got {type(fn).__name__}")
        for t in module_types:
            RULES[t] = fn
        return fn
    return deco


def register_layer_by_name(*qualified_names: str, check=None):
    """Decorator: as :func:`register_layer`, for classes named
    ``"package.module.QualName"`` (``type.__module__`` and ``__qualname__``), so
    that the rule of a class from an optional package (``transformers``) is
    registered without importing it.  ``check(module) -> str | None``, if
    given, names an option of the module its rule cannot handle exactly; the
    clipper refuses such a layer at construction."""
    for n in qualified_names:
        if not isinstance(n, str) or "." not in n:
            raise TypeError(f"register_layer_by_name: expected 'package.module.Class' strings, "
                            f"got {n!r}")

    def deco(fn: Rule) -> Rule:
        if not callable(fn):
            raise TypeError(f"register_layer_by_name: expected a function, got "
                            f"{type(fn).__name__}")
        for n in qualified_names:
            RULES_BY_NAME[n] = fn
            if check is not None:
                CHECKS_BY_NAME[n] = check
        return fn
    return deco


def _qualified(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def rule_for(module: nn.Module) -> tuple[Rule | None, type | None]:
    """(rule, the class it is registered for): ``module``'s class, or its nearest
    registered base class (by type, or by qualified name for classes of
    optional packages); (None, None) when there is none."""
    for t in type(module).__mro__:
        if t in RULES:
            return RULES[t], t
        rule = RULES_BY_NAME.get(_qualified(t)) or _twin_rule(t)
        if rule is not None:
            _refuse_redefined(t)
            return rule, t
    return None, None


# The first class seen under each qualified name that took a rule by name.
_FIRST_BY_NAME: dict[str, type] = {}


def _same_code(a: type, b: type) -> bool:
    """Whether two classes define the same functions with the same code
    (code objects compare their bytecode, constants, names and lines)."""
    fa = {k: v.__code__ for k, v in vars(a).items() if hasattr(v, "__code__")}
    fb = {k: v.__code__ for k, v in vars(b).items() if hasattr(v, "__code__")}
    return fa == fb


def _refuse_redefined(t: type) -> None:
    """A rule found by name is the rule of the code first seen under that name:
    a class defined again under it (a module reloaded, a notebook cell run
    again) with other code is refused, not given the cached rule (issue 35)."""
    q = _qualified(t)
    first = _FIRST_BY_NAME.setdefault(q, t)
    if first is not t and not _same_code(first, t):
        raise ValueError(
            f"GhostClipper: {q} was defined again (a module reloaded?) with other code than the "
            f"{q} whose rule this process chose; the rule's gradient would be the old code's. "
            "Restart the process after changing the layer, or register a rule for the new class")


def _twin_rule(t: type) -> Rule | None:
    """The rule of the registered class whose code ``t`` repeats (RULE_FINDERS),
    registered under ``t``'s own name from then on, with its check."""
    for find in RULE_FINDERS:
        template = find(t)
        if template is not None and template in RULES_BY_NAME:
            q = _qualified(t)
            RULES_BY_NAME[q] = RULES_BY_NAME[template]
            if template in CHECKS_BY_NAME:
                CHECKS_BY_NAME[q] = CHECKS_BY_NAME[template]
            return RULES_BY_NAME[q]
    return None


# ---------------------------------------------------------------- shared pieces

def _flat_positions(x: torch.Tensor, width: int, features: int = 1) -> torch.Tensor:
    """(B, ..., f_1, ..., f_k) -> (B, T, width), the last ``features`` = k dimensions
    (``width`` = their product) the features and the rest positions; explicit T
    so that B = 0 reshapes too."""
    T = 1
    for s in x.shape[1:x.dim() - features]:
        T *= s
    return x.reshape(x.shape[0], T, width)


def _lead(x: torch.Tensor, k: int) -> torch.Tensor:
    """x with its dimensions after the first k flattened into one (B = 0 safe)."""
    n = 1
    for s in x.shape[k:]:
        n *= s
    return x.reshape(*x.shape[:k], n)


def _cat(parts: list, dim: int = 1):
    """Several calls of a layer are one longer sequence (a single call: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def factored_or_instantiated(a: torch.Tensor, g: torch.Tensor, names: tuple, bias: bool):
    """The weight (and bias) of ``y_t = W a_t (+ b)`` summed over T positions:
    ``a`` (B, T, d), ``g`` (B, T, K).  Returns the cheaper block(s) (mixed rule):
    the pair when the ghost norm is cheaper (2 T^2 <= K d), else the per-sample
    weight gradient (B, K, d) formed by one batched GEMM (and the bias's (B, K))."""
    B, T, d = a.shape
    K = g.shape[2]
    if 2 * T * T <= K * d or T == 1:
        return [(names, (a, g, bias))]
    out = [((names[0],), torch.bmm(g.transpose(1, 2), a))]
    if bias:
        out.append(((names[1],), g.sum(1)))
    return out


def _affine_rule(xhat: torch.Tensor, g: torch.Tensor, trainable, dim: int):
    """Elementwise affine ``y = w * xhat + b``: per-sample gradients of w and b are
    sums of g * xhat and g over the positions ``dim`` (instantiated: they are
    small).  The product is formed and summed: the einsum that avoided it ran
    as a batched GEMM of width 1, 12x slower on a (8, 128, 768) float32 input."""
    out = []
    if "weight" in trainable:
        out.append((("weight",), torch.mul(g, xhat).sum(dim)))
    if "bias" in trainable:
        out.append((("bias",), g.sum(dim)))
    return out


# ---------------------------------------------------------------- built-in rules

@register_layer(nn.Linear)
def linear_rule(module: nn.Linear, calls, trainable):
    """y = x W^T + b on inputs (B, ..., d): every position adds to the sample's gradient."""
    d, K = module.in_features, module.out_features
    a = _cat([_flat_positions(c.inputs[0], d) for c in calls])
    g = _cat([_flat_positions(c.grad, K) for c in calls])
    if "weight" in trainable:
        names = ("weight", "bias") if "bias" in trainable else ("weight",)
        return factored_or_instantiated(a, g, names, "bias" in trainable)
    return [(("bias",), g.sum(1))] if "bias" in trainable else []


def _conv_input(module, x: torch.Tensor):
    """(input as the convolution reads it, 2-D form, padding still to apply): a
    Conv1d becomes a Conv2d of height 1; non-zero padding modes and string
    paddings are applied here, as the module's own _conv_forward does."""
    nd = len(module.kernel_size)
    two = (lambda v: (1,) + tuple(v)) if nd == 1 else tuple
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        # Pad before adding Conv1d's dummy height: F.pad's non-constant modes
        # take a 3-D input with 2 pads, not a 4-D one.
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0, 0)
    else:
        padding = (0,) + tuple(module.padding) if nd == 1 else tuple(module.padding)
    if nd == 1:
        x = x.unsqueeze(-2)
    return x, padding, two


def _conv_columns(module, x: torch.Tensor) -> torch.Tensor:
    """The im2col matrix of a convolution's input: (B, C_in*k, L), L output positions;
    a plain 1x1 convolution needs no copy (its columns are the input's pixels)."""
    x, padding, two = _conv_input(module, x)
    k, stride, dil = two(module.kernel_size), two(module.stride), two(module.dilation)
    if k == (1, 1) and padding == (0, 0):
        x = x[:, :, ::stride[0], ::stride[1]]
        return _lead(x, 2)
    return F.unfold(x, k, dilation=dil, padding=padding, stride=stride)


def _conv_per_sample(module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients (B, *weight.shape) by the convolution's own
    weight-gradient kernel, the batch folded into the groups: no im2col."""
    x, padding, two = _conv_input(module, x)
    B = x.shape[0]
    w = module.weight
    if B == 0:
        return w.new_zeros((0, *w.shape))
    shape = (B * w.shape[0], *w.shape[1:])
    if len(module.kernel_size) == 1:
        shape = (shape[0], shape[1], 1, shape[2])
        g = g.unsqueeze(-2)
    gw = torch.nn.grad.conv2d_weight(
        x.reshape(1, B * x.shape[1], *x.shape[2:]), shape,
        g.reshape(1, B * g.shape[1], *g.shape[2:]), stride=two(module.stride), padding=padding,
        dilation=two(module.dilation), groups=B * module.groups)
    return gw.reshape(B, *w.shape)


@register_layer(nn.Conv1d, nn.Conv2d)
def conv_rule(module, calls, trainable):
    """Convolution as a linear layer on its im2col columns: weight (C_out, C_in*k)
    against columns (B, L, C_in*k).  Mixed rule over all calls' L positions:
    one group and 2 L^2 <= C_out C_in k: the pair (ghost norm; the columns
    formed, free for a plain 1x1 convolution); otherwise (depthwise and other
    grouped convolutions, large L) the per-sample gradient (B, *weight.shape)
    from the convolution's own weight-gradient kernel, whose size is that of
    the kernel, small."""
    C_out = module.out_channels
    gs = [_lead(c.grad, 2) for c in calls]                         # (B, C_out, L) per call
    L = sum(g.shape[2] for g in gs)
    B = gs[0].shape[0]
    out = []
    if "weight" in trainable:
        bias = "bias" in trainable
        names = ("weight", "bias") if bias else ("weight",)
        if module.groups == 1 and 2 * L * L <= module.weight[0].numel() * C_out:
            cols = _cat([_conv_columns(module, c.inputs[0]) for c in calls], dim=2)
            return [(names, (cols.transpose(1, 2), _cat(gs, 2).transpose(1, 2), bias))]
        gw = None
        for c in calls:
            part = _conv_per_sample(module, c.inputs[0], c.grad)
            gw = part if gw is None else gw + part
        out.append((("weight",), gw))
    if "bias" in trainable:
        out.append((("bias",), _cat(gs, 2).sum(2) if B else gs[0].new_zeros((0, C_out))))
    return out


def _embedding_problem(module: nn.Embedding) -> str | None:
    """Why an embedding's options leave no exact per-sample gradient, or None."""
    if module.max_norm is not None:
        return ("max_norm renormalises rows in place during the forward; not supported for "
                "private training (set max_norm=None)")
    if module.scale_grad_by_freq:
        return ("scale_grad_by_freq=True scales each row's gradient by its count over the "
                "whole batch, which couples the samples (no per-sample gradient exists); "
                "set scale_grad_by_freq=False")
    if module.sparse:
        return ("sparse=True asks for a sparse gradient, but the private gradient is dense: "
                "noise is added to every row (a sparse one would reveal which rows the batch "
                "used); set sparse=False and use a dense optimizer")
    return None


# Embeddings that transformers looks up with an index shared by the batch (a
# relative-position bucket table of shape (T, T)), not one row per sample:
# refused by their attribute name until a rule sums each sample's positions.
_SHARED_INDEX_TABLES = ("relative_attention_bias",)


def refuse_unsupported(name: str, module: nn.Module) -> None:
    """Raise ValueError naming the layer when a trainable layer's options leave no
    exact per-sample gradient for its rule (checked at construction; the rule
    checks again at each step, the options being mutable)."""
    if isinstance(module, nn.Embedding):
        problem = _embedding_problem(module)
        if problem is not None:
            raise ValueError(f"GhostClipper: layer {name!r} (nn.Embedding): {problem}")
        if name.rpartition(".")[2] in _SHARED_INDEX_TABLES:
            raise ValueError(
                f"GhostClipper: layer {name!r} (nn.Embedding) is a relative-position bias "
                "table (T5, UMT5, LongT5, MPNet): it is looked up with a (T, T) table of "
                "relative positions shared by every sample, not one row per sample, so its "
                "rows would be clipped as samples where the batch size equals the sequence "
                "length (the issue-35 audit: one sample moved the clipped sum by 2.40 C, 7.58 C "
                "with only the tables trainable). Freeze it: "
                f"model.get_submodule({name!r}).requires_grad_(False)")
    _, base = rule_for(module)
    check = CHECKS_BY_NAME.get(_qualified(base)) if base is not None else None
    problem = check(module) if check is not None else None
    if problem is not None:
        raise ValueError(f"GhostClipper: layer {name!r} ({type(module).__name__}): {problem}")


def _rows_sq(idx: torch.Tensor, h: torch.Tensor, V: int) -> torch.Tensor:
    """Squared norm per sample of a row-scatter gradient: sample i's gradient has
    rows ``sum_{t: idx[i, t] = v} h[i, t]`` at the rows v it used, of a (V, D)
    weight.  ``idx`` (B, T) int64 row indices, ``h`` (B, T, D) any float dtype;
    returns (B,) float64.  One scatter into each sample's distinct (sample, row)
    keys, summed in float64: O(B T D), nothing of size V*D per sample.  Shared by
    the Embedding rule and a tied weight's embedding uses (tied.py), so both
    round alike."""
    B, T = idx.shape
    D = h.shape[2]
    sample = torch.arange(B, device=idx.device).unsqueeze(1).expand(B, T)
    keys, inverse = torch.unique(sample * V + idx, return_inverse=True)
    rows = torch.zeros((keys.numel(), D), dtype=torch.float64, device=h.device)
    rows.index_add_(0, inverse.reshape(-1), h.reshape(-1, D).to(torch.float64))
    sq = torch.zeros(B, dtype=torch.float64, device=h.device)
    sq.index_add_(0, torch.div(keys, V, rounding_mode="floor"), rows.square().sum(1))
    return sq


@register_layer(nn.Embedding)
def embedding_rule(module: nn.Embedding, calls, trainable):
    """Row lookup: sample i's gradient has rows ``sum_{t: idx_t = v} g_t`` at the
    rows v it used.  Norms from the rows each sample touched (one scatter into
    its distinct (sample, row) keys, float64), clipped sum one index_add: O(B T D),
    nothing of size V*D per sample."""
    if "weight" not in trainable:
        return []
    problem = _embedding_problem(module)
    if problem is not None:
        raise ValueError(f"nn.Embedding: {problem}")
    V, D = module.weight.shape
    idx = _cat([_lead(c.inputs[0], 1) for c in calls])                 # (B, T)
    g = _cat([_flat_positions(c.grad, D) for c in calls])              # (B, T, D)
    if module.padding_idx is not None:       # the padding row never gets a gradient
        g = g.masked_fill((idx == module.padding_idx).unsqueeze(-1), 0)
    T = idx.shape[1]
    sq = _rows_sq(idx, g, V)
    dtype = accumulation_dtype(module.weight.dtype)

    def clipped_sum(factors):
        # Only the samples kept: a factor of 0 (a dropped or padded sample) adds
        # exact zeros, so skipping its rows changes nothing and saves their work.
        kept = (factors != 0).nonzero().flatten()
        f = factors.index_select(0, kept).view(-1, 1, 1)
        scaled = (g.index_select(0, kept).to(torch.float64) * f).to(dtype)
        out = torch.zeros((V, D), dtype=dtype, device=g.device)
        out.index_add_(0, idx.index_select(0, kept).reshape(-1), scaled.reshape(-1, D))
        return out
    # clipped_sum adds up to T rows per sample in the data dtype: their norms
    # are the scale of its rounding (reference.clip_bound's E).
    spread = torch.linalg.vector_norm(g.to(torch.float64), dim=2).sum(1)
    return [(("weight",), GhostBlock(sq, clipped_sum, (V, D), T * D + D, dtype=dtype,
                                     spread=spread, seq_len=T))]


@register_layer(nn.LayerNorm)
def layer_norm_rule(module: nn.LayerNorm, calls, trainable):
    """y = w * xhat + b over the trailing ``normalized_shape`` (k >= 1 dimensions,
    flattened into one feature axis: every other dimension is a position);
    xhat recomputed with the forward's own normalisation (F.layer_norm
    without affine)."""
    width = math.prod(module.normalized_shape)
    k = len(module.normalized_shape)
    xs, gs = [], []
    for c in calls:
        xhat = F.layer_norm(c.inputs[0], module.normalized_shape, None, None, module.eps)
        xs.append(_flat_positions(xhat, width, k))
        gs.append(_flat_positions(c.grad, width, k))
    return [(n, b.reshape(b.shape[0], *module.normalized_shape))
            for n, b in _affine_rule(_cat(xs), _cat(gs), trainable, 1)]


@register_layer(nn.RMSNorm)
def rms_norm_rule(module: nn.RMSNorm, calls, trainable):
    """y = w * xhat over the trailing ``normalized_shape``, xhat = x / rms(x) (no
    bias): w's per-sample gradient is sum over positions of g * xhat."""
    if "weight" not in trainable:
        return []
    width = math.prod(module.normalized_shape)
    k = len(module.normalized_shape)
    xs, gs = [], []
    for c in calls:
        xhat = F.rms_norm(c.inputs[0], module.normalized_shape, None, module.eps)
        xs.append(_flat_positions(xhat, width, k))
        gs.append(_flat_positions(c.grad, width, k))
    w = torch.einsum("btw,btw->bw", _cat(gs), _cat(xs))
    return [(("weight",), w.reshape(w.shape[0], *module.normalized_shape))]


@register_layer(nn.GroupNorm)
def group_norm_rule(module: nn.GroupNorm, calls, trainable):
    """y = w_c * xhat + b_c per channel c, xhat normalised over (group, positions)."""
    xs, gs = [], []
    for c in calls:
        x = c.inputs[0]
        xhat = F.group_norm(x, module.num_groups, None, None, module.eps)
        xs.append(_lead(xhat, 2))
        gs.append(_lead(c.grad, 2))
    return _affine_rule(_cat(xs, 2), _cat(gs, 2), trainable, 2)


@register_layer(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm_rule(module, calls, trainable):
    """Affine instance norm (no running statistics): a group norm with one channel
    per group, per sample."""
    if module.track_running_stats and module.training:
        raise ValueError(f"{type(module).__name__} with track_running_stats=True mixes samples "
                         "through its running statistics; use track_running_stats=False")
    xs, gs = [], []
    for c in calls:
        x = c.inputs[0]
        xhat = F.instance_norm(x, eps=module.eps)
        xs.append(_lead(xhat, 2))
        gs.append(_lead(c.grad, 2))
    return _affine_rule(_cat(xs, 2), _cat(gs, 2), trainable, 2)
