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
from torch.nn.utils.rnn import PackedSequence

from .recompute import in_backward

__all__ = ["StepBatch", "module_batch_first", "enclosing_batch_first", "layer_batch_first",
           "set_layouts", "batch_dim", "to_batch_first", "rows_error", "broadcast_rows"]

ARGUMENT = "batch_first argument"    # a layer's layout when no module fixes it

# torch's layers whose input is (N, C, ...) whatever the model's layout; the
# attention forward (attention.py) marks its projections batch-first itself.
_BATCH_FIRST_ALWAYS = (nn.modules.conv._ConvNd, nn.GroupNorm,
                       nn.modules.instancenorm._InstanceNorm, nn.MultiheadAttention)


# Layers of optional packages laid out by their own ``batch_first``, whatever
# encloses them: Opacus's DPMultiheadAttention runs its SequenceBias modules
# (add_bias_kv) sequence-first, built with the default batch_first=False.
_OWN_LAYOUT_BY_NAME = frozenset({"opacus.layers.dp_multihead_attention.SequenceBias"})


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
    if f"{type(module).__module__}.{type(module).__qualname__}" in _OWN_LAYOUT_BY_NAME:
        return bool(module.batch_first), f"{type(module).__name__}.batch_first"
    parts = name.split(".") if name else []
    for k in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:k])
        if prefix in layouts:
            return layouts[prefix], f"enclosing {prefix or 'model'!r}"
    return batch_first, ARGUMENT


def set_layouts(model: nn.Module, taps, batch_first: bool) -> None:
    """Set each tap's ``batch_first`` and its source (:func:`layer_batch_first`),
    after checking the clipper's ``batch_first`` against the model's own."""
    own = module_batch_first(model)
    if own is not None and own != batch_first:
        raise ValueError(
            f"batch_first: expected {own}, as the model ({type(model).__name__}) was built "
            f"with batch_first={own} and its inputs are laid out so; got {batch_first}")
    layouts = enclosing_batch_first(model)
    for tap in taps:
        tap.batch_first, tap.layout = layer_batch_first(tap.name, tap.module, layouts,
                                                        batch_first)


def _first_tensor(obj):
    """The first tensor of nested tuples/lists/mappings (in argument order), or
    None; a PackedSequence (a tuple itself) is returned whole."""
    if isinstance(obj, (torch.Tensor, PackedSequence)):
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
    """(batch size, shape of the tensor it was read from, that tensor) of a
    model call: dim 0 (dim 1 when not batch_first) of the first tensor among
    the positional arguments, then the keyword ones (``input_ids=`` of
    HF-style models).
    (None, None, None) when the call has no tensor; raises when that tensor has no
    such dimension."""
    t = _first_tensor((args, kwargs))
    if t is None:
        return None, None, None
    if isinstance(t, PackedSequence):
        # Its data has one row per token; the samples are the sequences, as
        # many as the first step's batch (batch_first does not apply).
        return int(t.batch_sizes[0]), tuple(t.data.shape), t
    dim = 0 if batch_first else 1
    if t.dim() <= dim:
        raise ValueError(
            f"GhostClipper: the model's first input tensor has shape {tuple(t.shape)}, expected "
            f"its batch at dimension {dim} (batch_first={batch_first}); pass the batch "
            "first among the model's tensor arguments, or declare each step's batch size "
            "with clipper.declare_batch_size(n)")
    return int(t.shape[dim]), tuple(t.shape), t


def feature_dims(module: nn.Module) -> int | None:
    """How many trailing dimensions of the output are features (never the batch)
    for torch's layers that take any leading shape; None when unknown."""
    if isinstance(module, (nn.Linear, nn.Embedding, nn.EmbeddingBag)):
        return 1
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
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


def broadcast_rows(module: nn.Module, inputs: tuple, output, batch_first: bool,
                   batch: int | None):
    """An ``nn.Embedding`` looked up with one index row for the whole batch
    (position ids of shape (1, T), (T, 1) sequence-first) returns (1, T, D),
    which the model broadcasts over the samples; autograd would then give its
    output only the batch's summed gradient.  Returns the call with that row
    expanded to ``batch`` rows, index (B, T) and output (B, T, D): the same
    values wherever the model broadcasts the output, and each row's gradient
    is its own sample's, so the embedding's rule gives each sample the
    gradient of its own rows.  Any other call is returned as it is.

    The model must use the output by broadcasting it against per-sample
    tensors (adding it to the token embeddings, as Hugging Face models do);
    reading one row of it (``out[0]``) would give that row every sample's
    gradient."""
    if not isinstance(module, nn.Embedding) or batch is None or batch <= 1 or \
            not isinstance(output, torch.Tensor) or not inputs or \
            not isinstance(inputs[0], torch.Tensor):
        return inputs, output
    idx = inputs[0]
    dim = 0 if batch_first else 1
    # A 2-D index only: a (1,) index of one position has no batch dimension to
    # broadcast along (its output (1, D) would align with the features).
    if idx.dim() != 2 or output.dim() != 3 or idx.shape[dim] != 1:
        return inputs, output
    ishape, oshape = list(idx.shape), list(output.shape)
    ishape[dim] = oshape[dim] = batch
    return (idx.expand(ishape),) + tuple(inputs[1:]), output.expand(oshape)


class StepBatch:
    """The number of samples of the current step: read from each forward of the
    model (under grad) or declared; every layer's rows are checked against it.
    ``forwards``: the most forwards of the model a step may hold, each on the
    same samples row for row (GhostClipper's ``forwards_per_step``)."""

    def __init__(self, batch_first: bool, forwards: int = 1):
        self.batch_first = batch_first
        self.limit = forwards
        self.clear()

    def clear(self) -> None:
        self.size = self.shape = self.declared = None
        self.model_ran = False
        self.forwards = 0
        # The model's first input tensor and the size read from it; ``bags``:
        # the layer whose number of bags is the step's batch instead.
        self.first = self.read = self.bags = None

    def pre_hook(self, module, args, kwargs, taps=()):
        """The model's forward pre-hook (``with_kwargs=True``); ``taps``: the
        recorded layers, read only to name a refusal's cause."""
        if not torch.is_grad_enabled():
            return
        if not in_backward():           # a checkpoint's recomputation is no new forward
            self.forwards += 1
            if self.forwards > self.limit:
                self._refuse_forward(args, kwargs, taps)
        if self.declared is not None:
            return
        b, shape, first = input_batch(args, kwargs, self.batch_first)
        if self.model_ran and b != self.read:
            raise ValueError(
                f"GhostClipper: the model ran forward on a batch of {b} samples (input shape "
                f"{shape}) after one of {self.read} (input shape {self.shape}) in the same "
                "step; every forward of a step must see the same samples (call privatize_() "
                "or clear() between batches)")
        self.model_ran = True
        if self.bags is None:
            self.size = b
        self.read, self.shape, self.first = b, shape, first

    def _refuse_forward(self, args, kwargs, taps) -> None:
        # Rows are summed across a step's forwards, row i of each as sample
        # i's: right for views of the same samples (augmentations), but two
        # batches of one size under one step would clip each row of the
        # second with the first's row of its index as one sample, up to 2C
        # for one sample (the audit of 2026-12-02), and nothing can tell them
        # apart.  Hence a stated number, and a refusal past it.
        self.forwards = self.limit
        if any(r.got for tap in taps for r in tap.records):
            raise RuntimeError(
                "GhostClipper: the model runs forward again after a backward pass reached it; "
                "call privatize_() (optimizer.step()) before the next forward (batches are not "
                "accumulated: each step is one batch), or clear() to discard")
        if self.declared is not None:
            size = f"{self.declared} samples (declared)"
        else:
            size = f"{input_batch(args, kwargs, self.batch_first)[0]} samples"
        raise ValueError(
            f"GhostClipper: the model ran forward {self.limit + 1} times in one step (this "
            f"one on {size}), past forwards_per_step={self.limit}. The clipper sums each "
            "row's gradient over a step's forwards as one sample's: right when every forward "
            "sees the same samples row for row (several augmentations or views of each "
            "sample), wrong for different samples (two loader batches under one step: each "
            "row of one would be clipped with the other's row of its index, one sample's "
            "contribution up to 2 max_grad_norm), and the two cannot be told apart. "
            "Refused, nothing written: step once per batch (optimizer.step() or "
            "privatize_(), or clear(), between batches), or, when every forward of a step "
            "sees the same samples row for row, pass forwards_per_step=K to make_private / "
            "GhostClipper")

    def from_bags(self, name: str, x, bags: int, first_layer: bool) -> None:
        """An ``nn.EmbeddingBag`` called with flat indices and offsets: where
        those indices are the model's first input tensor itself (the text
        classification tutorial's ``model(text, offsets)``), its dimension 0
        counts every bag's tokens, and the step's batch is the layer's number
        of bags -- taken so only when the layer is the first recorded in the
        step (no layer's rows were checked against the tokens), batch-first,
        with no size declared.  Anything else is left to the rows check."""
        if (self.bags is None and self.declared is None and first_layer and self.batch_first
                and x is self.first and x.dim() == 1):
            self.size, self.bags = bags, name

    def of_step(self, taps) -> int:
        """The step's samples, from the layers the backward reached (each checked
        against this batch), or 0 when declared so with no forward; refuses a
        recorded forward that backward reached twice or not at all."""
        batch = None
        for tap in taps:
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
        if batch is None and self.declared == 0:
            # An empty Poisson batch of a model that cannot run on zero rows
            # (transformers' attention reshapes): the step is pure noise.
            return 0
        if batch is None:
            raise RuntimeError("GhostClipper: no forward/backward was recorded since the last "
                               "step (for an empty batch whose forward the model cannot run, "
                               "call declare_batch_size(0) before the step: pure noise)")
        return batch

    def known(self) -> int | None:
        """The step's samples if already read or declared, else None."""
        return self.declared if self.declared is not None else self.size

    def get(self, layer: str):
        """(samples in this step, where that number comes from)."""
        if self.declared is not None:
            return self.declared, "declared with declare_batch_size"
        if self.size is None:
            raise RuntimeError(
                f"GhostClipper: layer {layer!r} ran, but the batch size of the step is "
                "unknown: " + ("the model was called with no tensor argument"
                               if self.model_ran else
                               "the layer ran outside a forward of the model given to "
                               "GhostClipper") +
                ", so its rows cannot be checked against the samples. Call the model itself "
                "on the batch, or declare the step's batch with clipper.declare_batch_size(n) "
                "before backward (then clear() to discard this step)")
        return self.size, _FirstInput(self.shape, self.batch_first, self.bags)


class _FirstInput:
    """Where a measured batch size comes from, formatted only if an error
    names it (every layer asks at every step: formatting a torch.Size each
    time cost host time, issue 36)."""
    __slots__ = ("shape", "batch_first", "bags")

    def __init__(self, shape, batch_first, bags=None):
        self.shape, self.batch_first, self.bags = shape, batch_first, bags

    def __str__(self):
        if self.bags is not None:
            return (f"the number of bags of layer {self.bags!r}, whose flat indices are the "
                    f"model's first input tensor, shape {self.shape}")
        dim = 0 if self.batch_first else 1
        return (f"dimension {dim} of the model's first input tensor, shape {self.shape}, "
                f"batch_first={self.batch_first}")


def rows_error(name: str, module: nn.Module, shape, dim: int, batch_first: bool, layout: str,
               batch: int, source: str) -> ValueError:
    """The refusal of a layer whose rows (``shape[dim]``) are not the step's samples."""
    rows = shape[dim]
    fold = ""
    if batch and rows % batch == 0 and rows != batch:
        fold = (f" ({rows // batch} rows per sample: samples folded into the batch dimension)"
                "; Hugging Face's *ForMultipleChoice models fold each sample's choices so "
                "and are refused")
    hint = "keep each sample's rows in a dimension of their own (a layer takes (B, k, d) as it is)"
    if isinstance(module, nn.EmbeddingBag):
        # Flat indices with offsets: the model's first tensor holds every
        # bag's tokens, not one row a sample.
        hint = ("an nn.EmbeddingBag has one row per bag: its flat indices give the step's "
                "batch (the number of bags) only where they are the model's first input "
                "tensor itself and the bag is the first layer recorded; otherwise declare "
                "each step's number of bags with clipper.declare_batch_size(n) "
                "(model.clipper under make_private), or pass (B, L) indices")
    if layout == ARGUMENT and batch_first:
        hint += (", or, if the model's inputs and layers are sequence-first (T, B, ...), pass "
                 "batch_first=False")
    elif layout == ARGUMENT:
        hint += (", or, if the model's input is laid out unlike its layers, declare each "
                 "step's batch with clipper.declare_batch_size(n)")
    return ValueError(
        f"GhostClipper: layer {name!r} ({type(module).__name__}) has {rows} rows in its batch "
        f"dimension (dimension {dim} of its output, shape {tuple(shape)}; layout "
        f"batch_first={batch_first} from the {layout}), but the step has {batch} samples "
        f"({source}){fold}. Its rows are not the samples: clipping each row as a sample would "
        f"not bound one sample's gradient by max_grad_norm. Expected {batch} rows; {hint}. "
        "Call clear() before the next step")

