"""Rules for the layers Hugging Face ``transformers`` models are built from that
torch has no class for: GPT-2's ``Conv1D``, the RMS norms of LLaMA, T5, OLMo-2
and Gemma, Gemma's scaled word embedding, the LayerScale gains of DINOv2/v3,
and ViT's embeddings (a class token and position embeddings that are bare
Parameters); and :func:`source_twin`, which gives a class that repeats one of
these (transformers copies a layer into each model's file) its rule.

Registered by class name (:func:`~.layers.register_layer_by_name`): importing
ncdp_fast never imports ``transformers``; a model built from it matches these
rules at construction.  Everything else these models hold is torch's own
(``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.Conv2d``) or has no
parameter (rotary embeddings, activations such as SwiGLU's, attention
functions with grouped-query heads), and goes through the rules of
:mod:`.layers`.  Position ids of shape (1, T) broadcast over the batch are
handled where the clipper records an embedding (:func:`.layout.broadcast_rows`).

Each rule computes its layer's per-sample gradient from the recorded inputs
and output gradients exactly (to rounding); options a rule cannot follow are
refused by name, at construction where the module shows them.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import importlib
import inspect
import textwrap

import torch
from torch import nn

from .._cuda._common import ieee_float32_products
from .layer_rules import (_cat, _flat_positions, embedding_rule, factored_or_instantiated,
                          linear_rule)
from .layers import RULE_FINDERS, RULES_BY_NAME, accumulation_dtype, register_layer_by_name

__all__ = ["conv1d_rule", "scale_rule", "scaled_embedding_rule", "source_twin",
           "vit_embeddings_rule"]


def _input(module: nn.Module, call) -> torch.Tensor:
    """The call's first positional input: the rules below read the tensor the
    layer transforms, which a keyword-only call leaves unrecorded."""
    if not call.inputs or not isinstance(call.inputs[0], torch.Tensor):
        raise ValueError(
            f"GhostClipper: {type(module).__name__} was called without a positional tensor "
            "input; its rule reads the input the layer transforms from the positional "
            "arguments (forward hooks do not see keyword arguments). Call the layer with "
            "its input as the first positional argument")
    return call.inputs[0]


@register_layer_by_name("transformers.pytorch_utils.Conv1D")
def conv1d_rule(module: nn.Module, calls, trainable):
    """GPT-2's ``Conv1D``: ``y = x W + b`` with ``W`` of shape (in, out), a linear
    layer with its weight stored transposed.  Its weight gradient
    ``sum_t a_t g_t^T`` is the linear pair with the roles of inputs ``a`` (B,
    T, in) and output gradients ``g`` (B, T, out) swapped (same norm, the
    (in, out) layout); the bias, ``sum_t g_t``, is its own block."""
    nx, nf = module.weight.shape
    a = _cat([_flat_positions(_input(module, c), nx) for c in calls])
    g = _cat([_flat_positions(c.grad, nf) for c in calls])
    out = []
    if "weight" in trainable:
        out += factored_or_instantiated(g, a, ("weight",), False)
    if "bias" in trainable:
        out.append((("bias",), g.sum(1)))
    return out


def _unit_scale(module: nn.Module, name: str, x: torch.Tensor, unit: float) -> torch.Tensor:
    """``z`` of a layer computing ``y = (unit' + w) * z(x)``: its own forward run
    with ``w`` set to ``unit`` (1 * z and (1 + 0) * z are z exactly), on a
    shallow copy, so neither the parameter nor the hooks of the module are
    touched."""
    w = module._parameters[name]
    shadow = copy.copy(module)
    params = dict(module._parameters)
    params[name] = torch.full(w.shape, unit, dtype=accumulation_dtype(w.dtype), device=w.device)
    object.__setattr__(shadow, "_parameters", params)
    with torch.no_grad():
        return type(module).forward(shadow, x)


def scale_rule(name: str, unit: float = 1.0):
    """The rule of a layer computing ``y = p * z(x)`` (``unit`` 1) or
    ``y = (1 + p) * z(x)`` (``unit`` 0: Gemma's RMS norm), ``p`` its parameter
    ``name`` broadcast over the trailing dimensions of ``z`` and ``z`` not
    depending on ``p``: an RMS norm's scale, a LayerScale gain.  ``z`` is the
    module's own forward run with ``p`` set to ``unit`` (an RMS norm's float32
    variance included), so the per-sample gradient of ``p`` (shape (D,)) is
    ``sum_t g_t * z_t``, (B, D) -- the derivative of either form.  Exact only
    for these forms."""
    def rule(module: nn.Module, calls, trainable):
        if name not in trainable:
            return []
        p = module._parameters[name]
        zs, gs = [], []
        for c in calls:
            z = _unit_scale(module, name, _input(module, c), unit)
            zs.append(_flat_positions(z, p.numel(), p.dim()))
            gs.append(_flat_positions(c.grad, p.numel(), p.dim()))
        z, g = _cat(zs), _cat(gs)
        with ieee_float32_products(g):
            per_sample = torch.einsum("btw,btw->bw", g, z.to(g.dtype))
        return [((name,), per_sample.reshape(per_sample.shape[0], *p.shape))]
    rule.__name__ = rule.__qualname__ = f"scale_rule_{name}"
    return rule


# Each registered class's forward is ``self.<name> * z(x)`` (read in
# transformers 5.24.0); Gemma's is ``(1 + self.weight) * z(x)``.
register_layer_by_name("transformers.models.llama.modeling_llama.LlamaRMSNorm",
                       "transformers.models.t5.modeling_t5.T5LayerNorm",
                       "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm"
                       )(scale_rule("weight"))
register_layer_by_name("transformers.models.gemma.modeling_gemma.GemmaRMSNorm"
                       )(scale_rule("weight", unit=0.0))

# FalconLinear's forward is ``input @ self.weight.T (+ self.bias)``: nn.Linear's.
register_layer_by_name("transformers.models.falcon.modeling_falcon.FalconLinear")(linear_rule)

register_layer_by_name(
    "transformers.models.dinov2.modeling_dinov2.Dinov2LayerScale",
    "transformers.models.dinov2_with_registers.modeling_dinov2_with_registers."
    "Dinov2WithRegistersLayerScale",
    "transformers.models.dinov3_vit.modeling_dinov3_vit.DINOv3ViTLayerScale")(scale_rule("lambda1"))


def _vit_problem(module: nn.Module) -> str | None:
    mask = getattr(module, "mask_token", None)
    if mask is not None and mask.requires_grad:
        return ("its mask_token is trainable (use_mask_token=True): the patches it replaces "
                "(bool_masked_pos) are a keyword argument, which the clipper does not see. "
                "Freeze it (embeddings.mask_token.requires_grad_(False))")
    p = module.dropout.p
    if p > 0:
        return (f"its dropout has p={p} (hidden_dropout_prob), applied after the class token "
                "and position embeddings are added: the recorded output gradient is the one "
                "after dropout, so theirs is unknown. Build the model with "
                "hidden_dropout_prob=0.0 (ViT's default)")
    return None


@register_layer_by_name("transformers.models.vit.modeling_vit.ViTEmbeddings",
                        "transformers.models.deit.modeling_deit.DeiTEmbeddings",
                        check=_vit_problem)
def vit_embeddings_rule(module: nn.Module, calls, trainable):
    """ViT's embeddings: ``out = cat(cls_token, patches) + position_embeddings``
    (patches from its own ``Conv2d``, a layer of its own); DeiT's put a
    ``distillation_token`` after the class token (read in transformers
    5.24.0).  Each parameter is used once per sample, broadcast over the
    batch: sample i's gradient of the k-th prepended token (1, 1, D) is row k
    of its output gradient (B, N+k', D), that of ``position_embeddings``
    (1, N+k', D) the whole of it.  Exact only without interpolated position
    embeddings (same number of positions, the model's own square image size)
    and without dropout in training."""
    problem = _vit_problem(module)
    if problem is None and "mask_token" in trainable:
        problem = "its mask_token was trainable in this step's forward; freeze it"
    if problem is not None:
        raise ValueError(f"{type(module).__name__}: {problem}")
    positions = module.position_embeddings.shape[1]
    size = tuple(module.image_size)
    g = []
    for c in calls:
        shape = tuple(_input(module, c).shape[-2:])
        if shape != size or size[0] != size[1] or c.grad.shape[1] != positions:
            # interpolate_pos_encoding (a keyword the clipper does not see)
            # resamples the position embeddings bicubically: their gradient is
            # then not the output gradient.
            raise ValueError(
                f"{type(module).__name__}: got images of size {shape} and {c.grad.shape[1]} "
                "positions; "
                f"expected the model's own square image size {size} and {positions} positions "
                "(position embeddings used as they are). Interpolated position embeddings "
                "(interpolate_pos_encoding=True at another size, or a non-square image_size) "
                "are not supported: resize the images to the model's size")
        g.append(c.grad)
    out = []
    B = g[0].shape[0]
    prefix = [n for n in ("cls_token", "distillation_token")
              if getattr(module, n, None) is not None]
    for k, n in enumerate(prefix):
        if n in trainable:
            row = sum(x[:, k:k + 1] for x in g)
            out.append(((n,), row.reshape(B, *getattr(module, n).shape)))
    if "position_embeddings" in trainable:
        pos = sum(g[1:], g[0])
        out.append((("position_embeddings",), pos.reshape(B, *module.position_embeddings.shape)))
    return out


@register_layer_by_name("transformers.models.gemma.modeling_gemma.GemmaTextScaledWordEmbedding")
def scaled_embedding_rule(module: nn.Module, calls, trainable):
    """Gemma's word embedding: ``y = E[idx] * s``, ``s`` its ``embed_scale``
    buffer in the weight's dtype: the Embedding rule on the output gradients
    times ``s`` (the product autograd's own backward forms before its scatter)."""
    s = _embed_scale(module)
    return embedding_rule(module, [dataclasses.replace(c, grad=c.grad * s) for c in calls],
                          trainable)


def _embed_scale(module: nn.Module) -> torch.Tensor:
    return module.embed_scale.to(module.weight.dtype)


# A tied weight's use (tied.py) reads the rows and scales the output gradients.
scaled_embedding_rule.output_scale = _embed_scale


# ------------------------------------------------------------ copies of these

@functools.lru_cache(maxsize=None)
def _code_shape(cls: type) -> str | None:
    """``cls``'s code as a syntax tree with what does not change what it
    computes taken out: docstrings, comments, annotations and its own name
    (a copy in another model's file renames the class and its comments).
    None where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.ClassDef):
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(
                    body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                node.name = "_"
            if not isinstance(node, ast.ClassDef):
                node.returns = None
        elif isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, ast.Name) and node.id == cls.__name__:
            node.id = "_"
    return ast.dump(tree)


def _registered_class(qualified: str) -> type | None:
    module, _, name = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def source_twin(cls: type) -> str | None:
    """The name of the class registered here whose code ``cls`` repeats, or
    None.  transformers copies a layer into each model's file under the
    model's name ("Copied from LlamaRMSNorm with Llama->Mistral": 128 classes
    repeat LlamaRMSNorm in 5.24.0); such a copy computes what its original
    does, so it takes the original's rule -- checked on the code of the
    transformers installed, never assumed from the name, so that a copy that
    changed anything (an offset, a cast, a second parameter) finds no rule
    and is refused."""
    if not cls.__module__.startswith("transformers."):
        return None
    shape = _code_shape(cls)
    if shape is None:
        return None
    own = f"{cls.__module__}.{cls.__qualname__}"
    for qualified in _ORIGINALS:
        original = _registered_class(qualified)
        if qualified != own and original is not None and _code_shape(original) == shape:
            return qualified
    return None


# The originals a copy may repeat: the classes registered above, read in
# transformers 5.24.0 (their copies are never read, only compared with them).
_ORIGINALS = tuple(q for q in RULES_BY_NAME if q.startswith("transformers."))
RULE_FINDERS.append(source_twin)
