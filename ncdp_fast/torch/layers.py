"""The registry of book-keeping rules: each trainable layer's private-gradient
blocks from what one ordinary backward pass leaves behind (its inputs and its
output gradient).  The rules of torch's own layers are in :mod:`.layer_rules`.

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

Register a rule for your own layer type with :func:`register_layer`; the
built-ins of :mod:`.layer_rules` are its examples.  A class of an
optional package (``transformers``) is matched by its qualified name
(:func:`register_layer_by_name`, used by :mod:`.hf_layers`), so that its rule
needs no import of that package.  :func:`refuse_unsupported` refuses, at
construction, a layer whose options leave no exact per-sample gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["Call", "register_layer", "register_layer_by_name", "rule_for",
           "RULES", "RULES_BY_NAME", "RULE_FINDERS",
           "refuse_unsupported", "option_check", "refuse_options", "HALF",
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
        parameter, or a half ``grad`` (a float32 layer under torch.autocast),
        ``grad`` and every float16/bfloat16 tensor input arrive upcast to
        float32 (exactly: each half value is a float32 value), and a half
        parameter's blocks must be float32 (:func:`accumulation_dtype`).
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


def _embedding_problem(module: nn.Embedding | nn.EmbeddingBag) -> str | None:
    """Why an embedding's (or an embedding bag's) options leave no exact
    per-sample gradient, or None."""
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


def check_embedding_options(module: nn.Embedding | nn.EmbeddingBag) -> None:
    """An embedding rule's check at each step (the options are mutable):
    ValueError naming the class and the option :func:`_embedding_problem`
    finds."""
    problem = _embedding_problem(module)
    if problem is not None:
        raise ValueError(f"nn.{type(module).__name__}: {problem}")


# Embeddings that transformers looks up with an index shared by the batch (a
# relative-position bucket table of shape (T, T)), not one row per sample:
# refused by their attribute name until a rule sums each sample's positions.
_SHARED_INDEX_TABLES = ("relative_attention_bias",)


def refuse_unsupported(name: str, module: nn.Module) -> None:
    """Raise ValueError naming the layer when a trainable layer's options leave no
    exact per-sample gradient for its rule (checked at construction; the rule
    checks again at each step, the options being mutable)."""
    refuse_options(name, module, option_check(module))


def option_check(module: nn.Module):
    """The check of ``module``'s options registered with its rule's class
    (``register_layer_by_name``'s ``check``), or None."""
    _, base = rule_for(module)
    return CHECKS_BY_NAME.get(_qualified(base)) if base is not None else None


def refuse_options(name: str, module: nn.Module, check) -> None:
    """:func:`refuse_unsupported` with the layer's :func:`option_check` given:
    the model check before each forward passes the one found when the clipper
    was built (the classes cannot change while the module tree is unchanged),
    not a look-up a layer each forward (issue 36's host time)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        problem = _embedding_problem(module)
        if problem is not None:
            raise ValueError(
                f"GhostClipper: layer {name!r} (nn.{type(module).__name__}): {problem}")
        if isinstance(module, nn.Embedding) and name.rpartition(".")[2] in _SHARED_INDEX_TABLES:
            raise ValueError(
                f"GhostClipper: layer {name!r} (nn.Embedding) is a relative-position bias "
                "table (T5, UMT5, LongT5, MPNet): it is looked up with a (T, T) table of "
                "relative positions shared by every sample, not one row per sample, so its "
                "rows would be clipped as samples where the batch size equals the sequence "
                "length (the issue-35 audit: one sample moved the clipped sum by 2.40 C, 7.58 C "
                "with only the tables trainable). Freeze it: "
                f"model.get_submodule({name!r}).requires_grad_(False)")
    problem = check(module) if check is not None else None
    if problem is not None:
        raise ValueError(f"GhostClipper: layer {name!r} ({type(module).__name__}): {problem}")


# Names that moved to layer_rules.py (issue 37), still readable from here for
# code that imported them from here.  Looked up lazily: layer_rules imports
# this module, so importing it here would be a cycle.
_MOVED = frozenset({
    "factored_or_instantiated", "_flat_positions", "_lead", "_cat", "_affine_rule",
    "linear_rule", "_conv_input", "_conv_columns", "_conv_per_sample", "conv_rule",
    "_rows_sq", "embedding_rule", "layer_norm_rule", "rms_norm_rule", "group_norm_rule",
    "instance_norm_rule"})


def __getattr__(name: str):
    if name in _MOVED:
        from . import layer_rules
        return getattr(layer_rules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
