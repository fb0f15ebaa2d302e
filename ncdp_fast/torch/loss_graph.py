"""Is the loss a sum of per-sample terms?  Decided on the autograd graph.

Per-sample clipping bounds one sample's contribution by C only when the loss
is ``c * sum_i f_i``, each ``f_i`` computed from sample i alone and ``c`` not
computed from the batch.  A reduction that divides by a count over the whole
batch (the valid tokens of every sample, ``num_items_in_batch``) couples the
samples however the loss was called, so the check reads what the graph
computes between the model's outputs and the scalar handed to backward.

Every graph node on that path is interpreted abstractly: a tensor whose
dimension ``dim`` runs over the samples (``Out``; a dimension merging each
sample's rows, (B, T, V) -> (B*T, V), is ``Out`` with a block ``k = T``, and a
sequence-first merge repeats the samples), a value summed over the batch
(``Summed``), one that does not depend on the outputs (``None``), or one that
reaches the model's interior other than through an output (``Interior``).
Node types not listed here, on that path, are refused: the check fails
closed.  Checks that need tensor values (ignored targets per sample, a
scalar divisor) are returned as device booleans, or as a device scalar with
the test its value must pass on the host (:class:`ValueCheck`), read once at
the step, so backward adds no host synchronisation.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, NamedTuple

import torch

from .._arrays import is_emulated

__all__ = ["LossRefused", "LossReductionWarning", "analyse", "walker"]

FIX = ("compute the loss as a sum or mean of per-sample terms: for tokens, "
        "ncdp_fast.torch.causal_lm_loss / per_sample_token_loss / TokenCrossEntropyLoss "
        "(each sample's mean over its own valid tokens); or, taking responsibility that "
        "the loss is one, pass check_loss=False (docs/torch.md, 'The loss contract')")


class LossRefused(ValueError):
    """The loss is not (provably) a sum of per-sample terms."""


class LossReductionWarning(RuntimeWarning):
    """The loss's graph shows a mean over the batch where the clipper was told
    "sum", or the reverse: private either way, not the step asked for."""


class SamplesMixed(LossRefused):
    """Proof, not doubt: the graph combines the samples (a value reduced over
    the batch, or two tensors whose samples lie along different dimensions).
    Read below a layer's input (structure.py), where a doubt leaves the
    layer to its own checks, this refuses the layer."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


class CompiledRegion(SamplesMixed):
    """A torch.compile'd function's node (``CompiledFunctionBackward``): its
    graph cannot be read, so whether it combines the samples cannot be
    told; torch.compile is refused (compiled.py), here too, whether the
    function sits in the loss or between two layers (the audit of
    2026-12-02: a compiled ``h - h.mean(0)`` between layers was accepted)."""


class Out(NamedTuple):
    dim: int        # the dimension running over samples
    k: int = 1      # index j of that dimension belongs to sample (j // k) % B


class Summed(NamedTuple):
    terms: int | None = None    # the number of summed terms, for a plain sum


class Interior(NamedTuple):
    node: str


# Depends on a layer output whose rows are not the step's samples (or that is
# 0-d): the layer's own check refuses the step in backward, with its own
# message, so the loss check leaves it to that.
DEFERRED = "deferred"


def _refuse(node, why: str):
    raise LossRefused(_message(node, why))


def _mixed(node, why: str):
    raise SamplesMixed(_message(node, why), f"{node.name()}: {why}")


def _message(node, why: str) -> str:
    return f"GhostClipper: the loss is not a sum of per-sample terms: {node.name()}: {why}; {FIX}"


class ValueCheck(NamedTuple):
    """A check of a 0-d tensor's value, judged on the host: ``passes(v)`` of
    its value as a float64 (exact for every float dtype and for integers up to
    2^53, as the device comparison it replaces).  On a device the value
    travels with the step's one transfer, so the check launches no kernel of
    its own (issue 36: a comparison was two or three kernels of host time in
    every step with a mean loss)."""
    value: torch.Tensor
    passes: Callable[[float], bool]


def _one_of(allowed) -> Callable[[float], bool]:
    allowed = tuple(float(a) for a in allowed)
    return lambda v: v in allowed


def _exactly_one(v: float) -> bool:
    return v == 1.0


def on_host(t: torch.Tensor) -> bool:
    """A tensor whose value Python reads without waiting for a device (the
    emulated CUDA device's CPU tensors count as a device's)."""
    return t.device.type == "cpu" and not is_emulated(t)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def _dims(node, ndim: int) -> tuple:
    d = node._saved_dim
    if d is None:
        return tuple(range(ndim))
    d = d if isinstance(d, tuple) else (d,)
    return tuple(_signed(x) % max(ndim, 1) for x in d)


def _shape(node, nr: int = 0) -> tuple:
    return tuple(node._input_metadata[nr].shape)


_LINEAR = {"NegBackward0", "CloneBackward0", "ToCopyBackward0", "AliasBackward0",
           "MulBackward1", "DivBackward1", "AddBackward1", "SubBackward1", "RsubBackward1",
           "ContiguousBackward0", "ConjBackward0"}
_ELEMENTWISE = {"AbsBackward0", "ExpBackward0", "Exp2Backward0", "Expm1Backward0",
                "LogBackward0", "Log2Backward0", "Log10Backward0", "Log1pBackward0",
                "SigmoidBackward0", "TanhBackward0", "ReluBackward0", "ThresholdBackward0",
                "LeakyReluBackward0", "EluBackward0", "GeluBackward0", "SiluBackward0",
                "MishBackward0", "HardtanhBackward0", "SoftplusBackward0",
                "LogSigmoidBackward0", "PowBackward0", "SqrtBackward0", "RsqrtBackward0",
                "ReciprocalBackward0", "ClampBackward1", "ClampMinBackward0",
                "ClampMaxBackward0", "ErfBackward0", "SinBackward0", "CosBackward0",
                "SgnBackward0", "SignBackward0", "FloorBackward0", "RoundBackward0",
                "MaskedFillBackward0", "NanToNumBackward0", "SquareBackward0",
                "XlogyBackward1", "NativeDropoutBackward0", "HardswishBackward0",
                "HardsigmoidBackward0", "LeakyReluBackward1", "EluBackward1", "CeluBackward0",
                "SeluBackward0", "Atan2Backward0",
                # More of torch's pointwise functions: an unknown one between two
                # layers hid the mixing after it (the fifth audit: atan(h), then
                # z - z.mean(0), accepted with relative error 0.43).
                "AtanBackward0", "AsinBackward0", "AcosBackward0", "TanBackward0",
                "SinhBackward0", "CoshBackward0", "AsinhBackward0", "AcoshBackward0",
                "AtanhBackward0", "ErfcBackward0", "ErfinvBackward0", "FracBackward0",
                "TruncBackward0", "CeilBackward0", "DigammaBackward0", "LgammaBackward0",
                "LogitBackward0", "SincBackward0", "SoftshrinkBackward0", "HardshrinkBackward0",
                "I0Backward0", "PolygammaBackward0", "MvlgammaBackward0",
                "FmodBackward0", "RemainderBackward0"}
_BINARY = {"AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0", "WhereBackward0",
           "MaximumBackward0", "MinimumBackward0", "PowBackward1", "XlogyBackward0",
           "RsubBackward0", "LerpBackward0", "LerpBackward1", "HypotBackward0",
           "FmaxBackward0", "FminBackward0", "CopysignBackward0", "FmodBackward1",
           "RemainderBackward1"}
_VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
          "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
          "SqueezeBackward3", "SqueezeBackward4"}
_ALONG = {"SoftmaxBackward0", "LogSoftmaxBackward0", "SafeSoftmaxBackward0",
          "FlipBackward0", "RollBackward0", "CumsumBackward0", "LogcumsumexpBackward0",
          "LinalgVectorNormBackward0", "NormBackward1", "LogsumexpBackward0", "AmaxBackward0",
          "AminBackward0", "MaxBackward0", "MinBackward0", "ProdBackward1", "StdBackward0",
          "VarBackward0", "MaxBackward1", "MinBackward1",
          # Orders and selections along a dimension (the audit of 2026-12-02
          # found h.sort(0) between layers accepted as an unknown operation).
          "SortBackward0", "TopkBackward0", "KthvalueBackward0", "MedianBackward0",
          "MedianBackward1", "NanmedianBackward0", "NanmedianBackward1", "ModeBackward0",
          "CummaxBackward0", "CumminBackward0", "CumprodBackward0"}
# Batch norms, whose training-mode statistics run over every dimension but
# the channels (1): between layers F.batch_norm(training=True) moved one
# sample's release by 3.15 C (the audit of 2026-12-02).
_BATCH_NORMS = {"NativeBatchNormBackward0", "CudnnBatchNormBackward0",
                "MiopenBatchNormBackward0", "NativeBatchNormLegitBackward0"}
# Operations on (N, C, *spatial) inputs that keep each of the N rows its own:
# the batch must be dimension 0.
_PER_ROW = {"ConvolutionBackward0", "NativeGroupNormBackward0", "AvgPool1DBackward0",
            "AvgPool2DBackward0", "AvgPool3DBackward0", "MaxPool2DWithIndicesBackward0",
            "MaxPool3DWithIndicesBackward0", "AdaptiveAvgPool2DBackward0",
            "AdaptiveAvgPool3DBackward0", "AdaptiveMaxPool2DBackward0",
            "UpsampleNearest2DBackward0", "UpsampleBilinear2DBackward0",
            "ReflectionPad1DBackward0", "ReflectionPad2DBackward0",
            "ReplicationPad1DBackward0", "ReplicationPad2DBackward0"}
# Attention over the last two dimensions of (..., L, E) inputs, per leading index.
_ATTENTION = {"ScaledDotProductFlashAttentionForCpuBackward0",
              "ScaledDotProductFlashAttentionBackward0",
              "ScaledDotProductEfficientAttentionBackward0",
              "ScaledDotProductCudnnAttentionBackward0",
              "ScaledDotProductFusedAttentionOverrideableBackward0"}
# Batched matrix products (b, n, m) x (b, m, p): per index of dimension 0.
_BATCHED = {"BmmBackward0", "BaddbmmBackward0"} | _ATTENTION
_SPLITS = {"SplitBackward0", "SplitWithSizesBackward0", "UnsafeSplitBackward0",
           "UnsafeSplitWithSizesBackward0", "UnbindBackward0"}
_ELEMENT_LOSSES = {"MseLossBackward0", "SmoothL1LossBackward0", "HuberLossBackward0",
                   "BinaryCrossEntropyWithLogitsBackward0", "BinaryCrossEntropyBackward0",
                   "SoftMarginLossBackward0", "L1LossBackward0", "KlDivBackward0"}


class _Walk:
    def __init__(self, outputs: dict, batch: int, anchor, constants):
        self.outputs = outputs          # layer output node -> {output_nr: batch dim}
        self.constants = constants      # Mul/Div nodes whose other operand is a number
        self.batch = batch
        self.anchor = anchor
        self.memo: dict = {}
        self.pending: list = []         # (device bool or ValueCheck, message), read at the step

    # ------------------------------------------------------------- traversal
    def value(self, node, nr: int = 0):
        if node is None:
            return None
        if node in self.outputs:
            dim = self.outputs[node].get(nr, -1)
            if dim is None:
                return DEFERRED
            return Out(dim) if dim >= 0 else Interior(node.name())
        if node not in self.memo:
            self._fill(node)
        got = self.memo[node]
        return got(nr) if callable(got) else got

    def _fill(self, root) -> None:
        # Iterative post-order: an interior walk may be as deep as the model.
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if node in self.memo:
                continue
            if ready:
                self.memo[node] = self._node_value(node)
                continue
            stack.append((node, True))
            for nf, _ in node.next_functions:
                if nf is not None and nf not in self.memo and nf not in self.outputs:
                    stack.append((nf, False))

    # ----------------------------------------------------------------- rules
    def _node_value(self, node):
        name = type(node).__name__
        if name.startswith("CompiledFunctionBackward"):
            raise CompiledRegion(
                _message(node, "a torch.compile'd function, whose graph cannot be read"),
                f"{name}: a torch.compile'd function, whose graph cannot be read (whether it "
                "combines the samples cannot be checked); torch.compile is refused: call the "
                "function eagerly")
        if name == "AccumulateGrad":
            return Interior(name) if node.variable is self.anchor else None
        edges = node.next_functions
        ins = [self.value(nf, nr) for nf, nr in edges]
        inner = next((v for v in ins if isinstance(v, Interior)), None)
        if inner is not None:
            return inner
        if DEFERRED in ins:
            return DEFERRED
        if all(v is None for v in ins):
            return None
        live = [(i, v) for i, v in enumerate(ins) if v is not None]
        i0, v0 = live[0]
        in_shape = _shape(*edges[i0]) if isinstance(v0, Out) else None
        if name in _LINEAR or (name in _ELEMENTWISE and isinstance(v0, Out)):
            return v0 if len(live) == 1 else self._binary(node, name, ins, edges)
        if name in _ELEMENTWISE:
            _mixed(node, "a nonlinear function is applied to a value summed over the batch")
        if name in _BINARY:
            return self._binary(node, name, ins, edges)
        if isinstance(v0, Summed):
            if name in ("SumBackward0", "SumBackward1", "MeanBackward0", "MeanBackward1",
                        "NansumBackward0", "ExpandBackward0") or name in _VIEWS:
                return Summed()
            _mixed(node, "a value summed over the batch goes through an operation that is not "
                          "linear")
        if len(live) > 1 and name not in ("CatBackward0", "StackBackward0", "MmBackward0",
                                          "AddmmBackward0", "CdistBackward0") and \
                name not in _ELEMENT_LOSSES and name not in _BATCHED:
            _refuse(node, "an operation of several per-sample tensors that the check does not "
                          "know")
        return self._on_samples(node, name, v0, in_shape, ins, edges)

    def _on_samples(self, node, name, v, in_shape, ins, edges):
        b, out_shape = v.dim, _shape(node)
        if name in ("SumBackward0", "MeanBackward0"):
            return Summed(math.prod(in_shape) if name == "SumBackward0" else None)
        if name in ("SumBackward1", "MeanBackward1", "NansumBackward0"):
            dims = _dims(node, len(in_shape)) or tuple(range(len(in_shape)))
            if b in dims:
                return Summed(math.prod(in_shape) if name == "SumBackward1" else None)
            return Out(b if node._saved_keepdim else b - sum(d < b for d in dims), v.k)
        if name == "CdistBackward0":
            # Distances between the rows of two (..., P, M) inputs: per sample
            # only where the samples index a leading (batch) dimension.
            if b >= len(in_shape) - 2:
                _mixed(node, "a pairwise distance between rows runs across the samples")
            return v
        if name == "IndexSelectBackward0" and _signed(node._saved_dim) % len(in_shape) == b:
            return self._rows_in_order(node, v, node._saved_index, in_shape, out_shape)
        if name in _VIEWS:
            return self._reshape(node, v, in_shape, out_shape)
        if name == "ExpandBackward0":
            return self._broadcast(node, v, in_shape, out_shape)
        if name == "PermuteBackward0":
            return Out([_signed(d) % len(in_shape) for d in node._saved_dims].index(b), v.k)
        if name in ("TransposeBackward0", "TransposeBackward1", "TBackward0"):
            d0, d1 = ((_signed(node._saved_dim0) % len(in_shape),
                       _signed(node._saved_dim1) % len(in_shape))
                      if name != "TBackward0" else (0, 1))
            return Out(d1 if b == d0 else d0 if b == d1 else b, v.k)
        if name == "SelectBackward0":
            d = _signed(node._saved_dim) % len(in_shape)
            if d == b:
                _refuse(node, "one index of the batch dimension is selected")
            return Out(b - (d < b), v.k)
        if name == "SliceBackward0":
            d = _signed(node._saved_dim) % len(in_shape)
            whole = (_signed(node._saved_start) in (0, -(1 << 63)) and node._saved_step == 1
                     and (_signed(node._saved_end) >= in_shape[d]
                          or _signed(node._saved_end) == (1 << 63) - 1))
            if d == b and not whole:
                _refuse(node, "the batch dimension is sliced")
            return v
        if name == "ConstantPadNdBackward0":
            pad = node._saved_pad
            at = len(in_shape) - 1 - b
            if 2 * at + 1 < len(pad) and (pad[2 * at] or pad[2 * at + 1]):
                _refuse(node, "the batch dimension is padded")
            return v
        if name == "GatherBackward0":
            d = _signed(node._saved_dim) % len(in_shape)
            if d == b or out_shape[b] != in_shape[b]:
                _refuse(node, "gathers along the batch dimension")
            return v
        if name == "IndexBackward0":
            return self._index(node, v, in_shape, out_shape)
        if name in _BATCH_NORMS:
            # Without the flag (another backend's node), taken as training.
            if getattr(node, "_saved_training", True) and b != 1:
                _mixed(node, "a batch norm in training mode normalises over the batch")
            return v
        if name == "NativeGroupNormBackward0" and b == 1:
            # The samples along the channels (a (B, C) batch reshaped to (1, B C)):
            # each group must lie within one sample's channels.
            size = node._saved_C // max(node._saved_group, 1)
            if v.k % size:
                _mixed(node, "a group norm's groups span several samples")
            return v
        if name == "RenormBackward0":
            # Each slice along the dimension is renormalised whole: every
            # sample's part of it, unless the slices are the samples.
            if _signed(node._saved_dim) % len(in_shape) != b:
                _mixed(node, "renorm rescales slices that hold several samples")
            return v
        if name in _PER_ROW:
            if b >= 2:
                # Samples along a spatial dimension: pooled, convolved or
                # padded across (the fifth audit: avg_pool1d over the batch).
                _mixed(node, "a pooling, convolution or padding runs across the samples")
            if b != 0 or v.k != 1:
                _refuse(node, "an operation that keeps rows of dimension 0 apart gets the "
                              "samples elsewhere")
            return v
        if name == "NativeLayerNormBackward0":
            if b >= len(in_shape) - len(node._saved_normalized_shape):
                _mixed(node, "a layer norm normalises over the batch dimension")
            return v
        if name in _BATCHED:
            lives = {(x.dim, x.k) for x in ins if isinstance(x, Out)}
            last = 2 if name in _ATTENTION else 1
            if len(lives) != 1 or any(isinstance(x, Summed) for x in ins) or \
                    b >= len(in_shape) - last:
                # Samples inside the matrices, or on different dimensions of
                # two operands: products across samples (an einsum of h with
                # h, the fifth audit).
                _mixed(node, "a batched matrix product or attention mixes the samples")
            if name not in _ATTENTION and b != 0:
                _refuse(node, "a batched matrix product gets the samples off dimension 0")
            return v
        if name in _SPLITS:
            d = _signed(node._saved_dim) % len(in_shape)
            if d == b:
                _refuse(node, "the batch dimension is split")
            return Out(b - (d < b), v.k) if name == "UnbindBackward0" else v
        if name == "IndexSelectBackward0":      # off the batch (along it: above)
            return v
        if name == "RepeatBackward0":
            reps = tuple(node._saved_repeats)
            lead = len(reps) - len(in_shape)
            if reps[lead + b] != 1:
                _refuse(node, "the batch dimension is repeated")
            return Out(b + lead, v.k)
        if name in _ALONG:
            if name == "RollBackward0" or name == "FlipBackward0":
                dims = tuple(_signed(d) % len(in_shape) for d in node._saved_dims)
            else:
                dims = _dims(node, len(in_shape)) if hasattr(node, "_saved_dim") else \
                    tuple(range(len(in_shape)))
            if b in dims:
                _mixed(node, "a nonlinear function runs along the batch dimension, mixing "
                              "samples")
            keep = len(out_shape) == len(in_shape)
            return Out(b if keep else b - sum(d < b for d in dims), v.k)
        if name in ("CatBackward0", "StackBackward0"):
            return self._join(node, name, ins)
        if name in ("MmBackward0", "AddmmBackward0"):
            return self._matmul(node, ins)
        if name in ("NllLossBackward0", "NllLoss2DBackward0"):
            return self._nll(node, v, in_shape)
        if name in _ELEMENT_LOSSES:
            if len([x for x in ins if x is not None]) > 1:
                self._aligned(node, ins, edges)
            return self._reduced(node, v, in_shape)
        _refuse(node, f"a {name} node, which the check does not know, acts on the model's "
                      "outputs")

    def _reduced(self, node, v, in_shape):
        red = node._saved_reduction
        if red == 0:
            return v
        return Summed(math.prod(in_shape) if red == 2 else None)

    def _nll(self, node, v, in_shape):
        if v.dim != 0 or len(in_shape) < 2:
            _refuse(node, "the class scores do not have the samples' rows first")
        red = node._saved_reduction
        if red == 0:
            return v
        if red == 2:
            # A plain sum of one term per target position, ignored ones included
            # (they add 0): the count is the shape's, so dividing by it is a
            # public constant (a (B*T, V) token sum over B*T was refused, the
            # seventh audit's emulated-device helper).
            return Summed(math.prod(in_shape) // in_shape[1] if in_shape[1] else None)
        if node._saved_weight is not None:
            _refuse(node, "a class-weighted mean divides by the summed weights of the whole "
                          "batch's targets")
        b = max(self.batch, 1)
        if v.k == 1 and in_shape[0] == b and len(in_shape) == 2:
            # One row per sample: equal counts are all valid or none.  On the
            # host the number is read at once; on a device it waits for the
            # step's one transfer.
            equal = ValueCheck(node._saved_total_weight, _one_of((b, 0)))
        else:
            valid = node._saved_target != _signed(node._saved_ignore_index)
            # Row j is sample (j // k) % B's: rows = (repeats, B, k), sample-major inside.
            counts = valid.reshape(-1, b, v.k, *valid.shape[1:]).sum(
                tuple(d for d in range(valid.ndim + 2) if d != 1))
            equal = (counts == counts[0]).all()
        self.pending.append((
            equal,
            f"{node.name()}: the mean over targets (reduction='mean') divides by the valid "
            "targets of the whole batch, and the samples have different numbers of them "
            f"(ignore_index={_signed(node._saved_ignore_index)}): one sample's padding "
            "rescales every other sample's gradient"))
        return Summed()

    # ------------------------------------------------------------- structure
    def _reshape(self, node, v, in_shape, out_shape):
        if not math.prod(in_shape):         # no element: nothing to mix
            return Out(0) if out_shape else Summed()
        unit = v.k * math.prod(in_shape[v.dim + 1:])
        period = max(self.batch, 1) * unit
        for d in range(len(out_shape)):
            inner = math.prod(out_shape[d + 1:])
            if unit % inner == 0 and math.prod(out_shape[d:]) % period == 0:
                return Out(d, unit // inner)
        _mixed(node, f"a reshape {in_shape} -> {out_shape} mixes the samples' elements")

    def _broadcast(self, node, v, in_shape, out_shape):
        d = v.dim + len(out_shape) - len(in_shape)
        if out_shape[d] != in_shape[v.dim]:
            _refuse(node, "the batch dimension is broadcast")
        return Out(d, v.k)

    def _index(self, node, v, in_shape, out_shape):
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            # Inside a checkpointed region (the layout's walk at a forward):
            # reading the indices would recompute it.
            _refuse(node, "an index inside a checkpointed region is not read")
        idx = list(node._saved_indices)
        at = [i for i, x in enumerate(idx) if x is not None]
        if not at or (at[0] > v.dim and at == list(range(at[0], at[-1] + 1))):
            return v
        rows = idx[v.dim] if v.dim < len(idx) else None
        if at[0] == v.dim and at == list(range(at[0], at[-1] + 1)):
            # x[arange(B), j]: one entry of each sample, in order (the pooled
            # logits of a decoder's sequence classifier), if the rows are arange.
            return self._rows_in_order(node, v, rows, in_shape, out_shape)
        _refuse(node, "an index (a mask or index tensor) selects along the batch "
                      "dimension: which rows remain depends on every sample")

    def _rows_in_order(self, node, v, rows, in_shape, out_shape):
        """An index along the batch dimension (``x[rows]``, ``index_select``):
        the samples as they were where ``rows`` is 0, 1, ..., B-1, a condition
        on the values read with the step's checks; a permutation or a
        repetition of samples otherwise (the fifth audit: ``h[perm]`` before
        a layer moved one sample's release by 2.05 C)."""
        if isinstance(rows, torch.Tensor) and rows.ndim == 1 and \
                not rows.is_floating_point() and rows.dtype != torch.bool and \
                rows.shape[0] == in_shape[v.dim] and out_shape[v.dim] == rows.shape[0]:
            self.pending.append((
                (rows == torch.arange(rows.shape[0], device=rows.device)).all(),
                f"{node.name()}: the index along the batch dimension is not 0, 1, ..., B-1: "
                "it moves or repeats samples, so a term would meet another sample's labels"))
            return Out(v.dim, v.k)
        _refuse(node, "an index (a mask or index tensor) selects along the batch "
                      "dimension: which rows remain depends on every sample")

    def _aligned(self, node, ins, edges):
        out_shape = _shape(node)
        seen = set()
        for (nf, nr), x in zip(edges, ins):
            if isinstance(x, Out):
                seen.add(self._broadcast(node, x, _shape(nf, nr), out_shape))
            elif isinstance(x, Summed):
                _mixed(node, "combines per-sample values with a value reduced over the "
                              "batch (as x - x.mean()): each sample's term depends on the "
                              "others")
        if len(seen) > 1:
            _mixed(node, "combines tensors whose samples lie along different dimensions")
        return seen.pop() if seen else None

    def _join(self, node, name, ins):
        d = _signed(node._saved_dim)
        lives = {(x.dim, x.k) for x in ins if isinstance(x, Out)}
        if len(lives) != 1 or any(isinstance(x, Summed) for x in ins):
            _mixed(node, "joins tensors whose samples lie along different dimensions")
        b, k = lives.pop()
        ndim = len(_shape(node))
        d %= ndim
        if name == "CatBackward0":
            if d == b:
                _refuse(node, "concatenates along the batch dimension")
            return Out(b, k)
        return Out(b + (d <= b), k)

    def _matmul(self, node, ins):
        a, w = ins[-2], ins[-1]
        if isinstance(a, Out) and a.dim == 0 and w is None and (len(ins) == 2 or ins[0] is None):
            return a
        if (isinstance(a, Out) and a.dim == 1) or (isinstance(w, Out) and w.dim == 0) or \
                (isinstance(a, Out) and isinstance(w, Out)):
            # The samples along the contracted dimension (ones(B, B) @ h, an
            # einsum over the others), or two per-sample operands (h @ h.T).
            _mixed(node, "a matrix product contracts over the batch dimension or multiplies "
                         "per-sample tensors together")
        _refuse(node, "a matrix product whose samples the check cannot place (a weight-first "
                      "W @ x.T keeps them apart)")

    # ---------------------------------------------------------------- binary
    def _binary(self, node, name, ins, edges):
        live = [x for x in ins if x is not None]
        summed = [x for x in live if isinstance(x, Summed)]
        data_side = [i for i, (nf, _) in enumerate(edges) if nf is None]
        if len(live) == 2:
            if len(summed) == 1:
                _mixed(node, "combines per-sample values with a value reduced over the batch "
                              "(as x - x.mean()): each sample's term depends on the others")
            if summed:
                if name in ("AddBackward0", "SubBackward0"):
                    return Summed()
                _mixed(node, "multiplies two values summed over the batch")
            return self._aligned(node, ins, edges)
        v = live[0]
        if name == "DivBackward0" and ins[0] is None and isinstance(v, Summed):
            _mixed(node, "divides by a value summed over the batch")
        # A per-sample value scaled by a shared scalar is taken as scaled by a
        # constant: Python numbers inside the model's forward (logit
        # soft-capping, Granite's logits_scaling) reach autograd as 0-d tensors
        # too.  A count over the batch bites at the reduction's divisor, checked
        # on the summed value -- the only place a saved operand is read (inside
        # a checkpointed region, reading one would recompute it).
        if isinstance(v, Summed) and name in ("MulBackward0", "DivBackward0") and \
                data_side and node not in self.constants:
            data = self._data_operand(node, ins)
            if isinstance(data, torch.Tensor) and data.numel() == 1:
                self._scalar_factor(node, name, data, v)
            elif data is None:
                _refuse(node, "scales a value summed over the batch by a tensor the check "
                              "cannot read")
        if isinstance(v, Summed):
            if name in ("MulBackward0", "DivBackward0"):
                return Summed(v.terms)
            # A constant added or subtracted moves no gradient; any other
            # function of the summed value and a constant (min(L, c), where,
            # L ** c, xlogy) weighs the samples' terms by the whole batch.
            if name in ("AddBackward0", "SubBackward0", "RsubBackward0"):
                return Summed()
            _mixed(node, "a nonlinear function is applied to a value summed over the batch")
        return self._aligned(node, ins, edges)

    @staticmethod
    def _data_operand(node, ins):
        attr = "_saved_other" if ins[0] is not None else "_saved_self"
        return getattr(node, attr, None)

    def _scalar_factor(self, node, name, data, v):
        x = data.detach().reshape(())
        if name == "MulBackward0":
            # A scale the user wrote is a Python number (a constant of the
            # loss).  A scalar tensor other than 1 is a GradScaler's scale
            # (scaler.scale(loss)) or one computed from the batch: with a
            # scaler, each sample would be clipped at max_grad_norm as if its
            # gradient were S times larger and the release later divided by S
            # (clipped at C / S: the audit of 2026-12-02), so it is refused
            # before anything is formed.  1 is backward(gradient=tensor(1.)).
            ok = ValueCheck(x, _exactly_one)
            why = ("scales by a scalar tensor other than 1: a GradScaler's scale "
                   "(scaler.scale(loss)), whose per-sample gradients would be clipped at "
                   "max_grad_norm as if S times larger, or one computed from the batch; "
                   "GradScaler is refused: use torch.autocast(..., dtype=torch.bfloat16) with "
                   "no GradScaler, and scale a loss by a Python number")
        else:
            allowed = [self.batch] + ([v.terms] if isinstance(v, Summed) and v.terms else [])
            ok = ValueCheck(x, _one_of(allowed))
            why = ("divides by a scalar tensor that is neither the batch size nor the number "
                   "of terms summed (a count over the whole batch, as num_items_in_batch or "
                   "the valid tokens of every sample, couples the samples)")
        self.pending.append((ok, f"{node.name()}: {why}"))


def walker(outputs: dict, batch: int, anchor) -> _Walk:
    """A reader of the graph down to ``outputs`` (as :func:`analyse`), whose
    ``value(node, output_nr)`` says where a tensor holds the samples (an
    ``Out``) or raises :class:`LossRefused`; its memo serves one forward."""
    return _Walk(outputs, batch, anchor, frozenset())


# Nodes that pass a scalar loss on unchanged (no scaling): what lies between a
# loss's reduction over the batch and the tensor handed to backward.
_UNSCALED = {"CloneBackward0", "ToCopyBackward0", "AliasBackward0", "ContiguousBackward0",
             "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
             "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
             "SqueezeBackward3", "SqueezeBackward4"}


_SCALING = {"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "DivBackward2",
            "DivBackward3"}


def _scales(node) -> bool:
    """A product or division that may turn a sum into a mean (or back); one by a
    number read on the host as exactly 1 does not (Lightning divides every
    training_step's loss by accumulate_grad_batches, 1: the fifth audit found
    the reduction's warning lost under DPLightningCallback)."""
    if type(node).__name__ not in _SCALING:
        return False
    other = getattr(node, "_saved_other", None)
    return not (isinstance(other, torch.Tensor) and other.numel() == 1 and on_host(other)
                and float(other) == 1.0)


def _reduction_of(walk, node) -> tuple[str, str] | None:
    """``("mean" or "sum", the node's name)``: how the loss at ``node`` reduces the
    per-sample terms over the batch, where the graph shows it with nothing
    scaling it afterwards; None where it does not (a constant factor, a sum of
    two losses, a division by a count: then the clipper's loss_reduction is
    taken on trust, as before).  :func:`analyse` also trusts it where any
    product or division (``_SCALING``) lies between the layers' outputs and
    the loss: ``(l / B).sum()`` is a mean written as a sum."""
    while type(node).__name__ in _UNSCALED or (type(node).__name__ in _SCALING and
                                               not _scales(node)):
        edges = [(nf, nr) for nf, nr in node.next_functions if nf is not None]
        if len(edges) != 1:
            return None
        node = edges[0][0]
    name = type(node).__name__
    edges = [(nf, nr) for nf, nr in node.next_functions if nf is not None]
    if not edges or not isinstance(walk.value(*edges[0]), Out):
        return None
    if name in ("MeanBackward0", "MeanBackward1", "SumBackward0", "SumBackward1"):
        return ("mean" if name.startswith("Mean") else "sum"), node.name()
    if name in ("NllLossBackward0", "NllLoss2DBackward0") or name in _ELEMENT_LOSSES:
        kind = {1: "mean", 2: "sum"}.get(node._saved_reduction)
        return None if kind is None else (kind, node.name())
    return None


def analyse(roots, outputs: dict, batch: int, anchor, constants=frozenset(),
            reduction: str | None = None):
    """Check the graph from each ``(tensor, gradient or None)`` root down to
    the recorded layers' outputs (``outputs``: grad_fn node -> {output_nr:
    batch dim}, None where the layer's own check refuses the step);
    ``anchor`` the clipper's leaf inside recorded forwards (a path to it
    bypasses the outputs).  Returns ``(reached, pending)``: whether some root
    depends on an output, and the value checks to read at the step
    ((device bool, message) pairs); ``constants`` the Mul/Div nodes known to
    scale by a Python number; ``reduction`` the clipper's loss_reduction (a
    loss whose graph shows the other one warns, :class:`LossReductionWarning`).
    Raises :class:`LossRefused`."""
    walk = _Walk(outputs, batch, anchor, constants)
    reached = False
    for t, grad in roots:
        node = getattr(t, "grad_fn", None)
        if node is None:
            continue
        v = walk.value(node, t.output_nr)
        if isinstance(v, Interior):
            raise LossRefused(
                f"GhostClipper: the loss depends on the model other than through its recorded "
                f"layers (through {v.node}: a module without a rule between a layer and the "
                f"loss?); its per-sample terms cannot be checked; {FIX}")
        if v is None:
            continue
        reached = True
        if v is DEFERRED:
            continue
        if isinstance(v, Out) and grad is None:
            _refuse(node, "backward starts from a tensor with a batch dimension and no "
                          "gradient")
        if isinstance(grad, torch.Tensor) and grad.numel() == 1 and isinstance(v, Summed):
            walk._scalar_factor(node, "MulBackward0", grad, v)
        if reduction is not None and grad is None and isinstance(v, Summed):
            found = _reduction_of(walk, node)
            # The graph's nodes are scanned for a factor only on a mismatch: the
            # common step, whose reduction agrees, pays for the walk up the root.
            if found is not None and found[0] != reduction and \
                    not any(_scales(n) for n in walk.memo):
                # Privacy holds either way (each clipped contribution stays <= C):
                # a warning, not a refusal -- but the step is not the one asked for.
                kind, at = found
                effect = ("1/B of what it is (too little clipped, the noise B times too strong "
                          "for it)" if kind == "mean" else
                          "B times what it is (every sample clipped)")
                warnings.warn(
                    f"GhostClipper: loss_reduction={reduction!r}, but the loss is the {kind} of "
                    f"per-sample terms over the batch ({at}): each sample's gradient is taken "
                    f"as {effect}; pass loss_reduction={kind!r} to make_private / GhostClipper",
                    LossReductionWarning, stacklevel=2)
    return reached, walk.pending
