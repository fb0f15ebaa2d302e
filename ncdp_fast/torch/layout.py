"""Which dimension of a tensor is the batch: of the model's input, and of each
layer's recorded input and output gradient.

The layout is never read from sizes (when T == B two dimensions could be the
batch): it comes from the torch module that encloses a layer (a transformer
or attention module with its own ``batch_first``) or, for everything else,
from the ``batch_first`` the user states for the model (Opacus's argument).
Layers whose input layout torch itself fixes (convolutions, group and
instance norms) always have the batch at dimension 0, and a layer with one
leading dimension has no choice to make.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["module_batch_first", "enclosing_batch_first", "input_batch", "batch_dim",
           "to_batch_first"]

# torch's layers whose input is (N, C, ...) whatever the model's layout; the
# attention forward (attention.py) marks its projections batch-first itself.
_BATCH_FIRST_ALWAYS = (nn.modules.conv._ConvNd, nn.GroupNorm,
                       nn.modules.instancenorm._InstanceNorm, nn.MultiheadAttention)


def module_batch_first(module: nn.Module) -> bool | None:
    """``batch_first`` of a torch transformer or attention module, as its forward
    uses it (the layers and stacks take it from their self-attention); None
    for any other module."""
    if isinstance(module, (nn.MultiheadAttention, nn.Transformer)):
        return bool(module.batch_first)
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return bool(module.self_attn.batch_first)
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(module.layers):
        return module_batch_first(module.layers[0])
    return None


def enclosing_batch_first(model: nn.Module) -> dict[str, bool]:
    """{qualified name: batch_first} of every module of ``model`` with its own layout."""
    out = {}
    for name, module in model.named_modules(remove_duplicate=False):
        bf = module_batch_first(module)
        if bf is not None:
            out[name] = bf
    return out


def layer_batch_first(name: str, module: nn.Module, layouts: dict, batch_first: bool):
    """(batch_first, source) of a layer: True for torch's (N, C, ...) layers and
    attention; else the nearest enclosing module's own; else the model's."""
    if isinstance(module, _BATCH_FIRST_ALWAYS):
        return True, type(module).__name__
    parts = name.split(".") if name else []
    for k in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:k])
        if prefix in layouts:
            return layouts[prefix], f"enclosing {prefix or 'model'!r}"
    return batch_first, "batch_first argument"


def _first_tensor(obj):
    """The first tensor of nested tuples/lists/mappings (in argument order), or None."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):        # a dict, or HF's BatchEncoding
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        for x in obj:
            t = _first_tensor(x)
            if t is not None:
                return t
    return None


def input_batch(args: tuple, kwargs: dict, batch_first: bool):
    """(batch size, shape of the tensor it was read from) of a model call: dim 0
    (dim 1 when not batch_first) of the first tensor among the positional
    arguments, then the keyword ones (``input_ids=`` of HF-style models).
    (None, None) when the call has no tensor; raises when that tensor has no
    such dimension."""
    t = _first_tensor((args, kwargs))
    if t is None:
        return None, None
    dim = 0 if batch_first else 1
    if t.dim() <= dim:
        raise ValueError(
            f"GhostClipper: the model's first input tensor has shape {tuple(t.shape)}, expected "
            f"its batch at dimension {dim} (batch_first={batch_first}); pass the batch "
            "first among the model's tensor arguments, or declare each step's batch size "
            "with clipper.declare_batch_size(n)")
    return int(t.shape[dim]), tuple(t.shape)


def feature_dims(module: nn.Module) -> int | None:
    """How many trailing dimensions of the output are features (never the batch)
    for torch's layers that take any leading shape; None when unknown."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return 1
    if isinstance(module, nn.LayerNorm):
        return len(module.normalized_shape)
    return None


def batch_dim(module: nn.Module, batch_first: bool, grad: torch.Tensor) -> int:
    """The batch dimension of one recorded call, from its output gradient: 0 when
    batch_first or when the layer has a single leading dimension (a pooled
    (B, d) head of a sequence-first model: no other dimension could be the
    batch); else 1."""
    if batch_first:
        return 0
    feats = feature_dims(module)
    leading = grad.dim() - (feats if feats is not None else 0)
    return 1 if leading >= 2 else 0


def to_batch_first(inputs: tuple, grad: torch.Tensor, dim: int):
    """The call with dimension ``dim`` moved to 0 in the gradient and in every
    tensor input that has it (the rules read dimension 0 as the batch)."""
    if dim == 0:
        return inputs, grad
    moved = tuple(x.movedim(dim, 0) if isinstance(x, torch.Tensor) and x.dim() > dim else x
                  for x in inputs)
    return moved, grad.movedim(dim, 0)


def fold_factor(rows: int, batch: int) -> str:
    """The reading of a row count that is a multiple of the batch, for the error."""
    if batch and rows % batch == 0 and rows != batch:
        return f" ({rows // batch} rows per sample: samples folded into the batch dimension)"
    return ""

