"""What the clipper's hooks record as the model runs: each trainable layer's
inputs at its forward and its output gradient in backward, with the checks
made as they run (the model's batch, rows and layout of each layer, a model
changed since construction, torch.compile), and each layer's rule evaluated
inside backward once its last output gradient has arrived.

:class:`LayerRecorder` is a part of :class:`~ncdp_fast.torch.GhostClipper`
(its state is set up by the clipper's constructor); it holds no state of its
own.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.overrides import has_torch_function_unary as _has_torch_function_unary
from torch.utils.hooks import RemovableHandle

from . import tied
from .compiled import compiled_error, compiling
from .graphs import refuse_graph_capture
from .coupling import refuse_whole_batch_loss_kwargs
from .embedding_bag import bag_call
from .layers import HALF, Call
from .layout import batch_dim, broadcast_rows, rows_error, to_batch_first
from .precision import cast_block, upcast
from .recompute import count_call, in_backward
from .taps import CaptureGrad, Record, Tap, ignore, switch_back, switch_off, trainable_now

__all__ = ["LayerRecorder"]


def _detached(inputs: tuple) -> tuple[tuple, tuple]:
    """(the inputs with each tensor detached, their versions: a tensor's
    ``_version``, 0 for anything else), a layer's one input without a
    generator's frames (every recorded call asks, issue 36's host time)."""
    if len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
        x = inputs[0]
        return (x.detach(),), (x._version,)
    return (tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in inputs),
            _versions(inputs))


def _versions(inputs: tuple) -> tuple:
    """Each input's ``_version`` (a detached tensor shares its source's), 0
    for what is not a tensor."""
    if len(inputs) == 1:
        return (getattr(inputs[0], "_version", 0),)
    return tuple(getattr(x, "_version", 0) for x in inputs)


def _add_grad_hook(t: torch.Tensor, hook) -> None:
    """``t.register_hook(hook)`` for a plain tensor that requires grad, without
    its handle: the same entry in the same dict (``_backward_hooks``, keyed
    by the handles' one counter, so no later ``register_hook`` can take its
    key), tied to ``t``'s node as ``register_hook`` ties it.  Every recorded
    layer output takes one: 8.3 against 1.5 us on the 2-core VM (issue 36's
    host time of a forward).  Where torch would dispatch the call (a tensor
    subclass's or an active mode's ``__torch_function__``), ``register_hook``
    itself."""
    if _has_torch_function_unary(t):
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        if t.grad_fn is not None:
            t.grad_fn._register_hook_dict(t)
    key = RemovableHandle.next_id
    RemovableHandle.next_id = key + 1
    hooks[key] = hook


def replica_error(what: str) -> RuntimeError:
    """The refusal of a forward that ran on a copy of a recorded module sharing
    its hooks: nn.DataParallel's replicas (one a GPU, each run in its own
    thread), or any shallow copy."""
    return RuntimeError(
        f"GhostClipper: {what} ran forward as a copy of the module the clipper was built on "
        "(nn.DataParallel's replicas on several GPUs, or another copy sharing its hooks): "
        "the copy's inputs, a share of the batch on another device and thread, would be "
        "recorded as the module's own. Refused before anything was recorded; on several "
        "GPUs run one process a GPU and pass the clipper (or make_private) group=, as "
        "DistributedDataParallel would be used; on one GPU drop nn.DataParallel")


class LayerRecorder:
    """The forward and backward hooks of :class:`~ncdp_fast.torch.GhostClipper`."""

    def _refuse_copy(self, *_):
        # Reached through the model's hooks or the private optimizer:
        # copy.deepcopy or pickling either (torch.save of the module) comes
        # here, and the noise stream's own refusal would not say which call did.
        raise TypeError(
            "GhostClipper: the clipper is not deep-copied or pickled, nor is what holds it "
            "(a model it is attached to, through its hooks; the private optimizer): "
            "copy.deepcopy, torch.save of the module or optimizer. Its noise stream and "
            "records must not be duplicated. Copy or save the model before attaching, save "
            "state_dict()s (the clipper's state: save_checkpoint), or call clipper.remove() "
            "first")

    __deepcopy__ = __reduce_ex__ = _refuse_copy

    def _capturing(self) -> bool:
        # As Opacus: nothing is recorded outside training mode (an evaluation
        # forward with grad on), or while hooks are disabled; such a forward
        # computes ordinary gradients, which a step refuses.
        return torch.is_grad_enabled() and self.enabled and self.model.training

    def _model_pre_hook(self, module, args, kwargs):
        if compiling():
            self._compiled = True
            return None
        recording = self._capturing()
        if recording:
            # Before any state moves: the user may go on eagerly.
            if module is not self.model:
                raise replica_error("the model")
            refuse_graph_capture("GhostClipper: the model's recorded forward")
        if not in_backward():
            self._pass += 1
        if recording:
            if not in_backward():
                self._loss.unstack()
                self._layouts.new_forward()
            self._snapshot.check(self.model, self.taps)
            refuse_whole_batch_loss_kwargs(module, kwargs)
            return self._batch.pre_hook(module, args, kwargs, self.taps)
        if torch.is_grad_enabled():
            self._uncaptured.add("disabled" if not self.enabled else "eval")
        return None

    def _model_hook(self, module, args, output):
        if compiling():
            return
        if self._capturing() and not in_backward():
            self._layouts.end_forward()
            self._loss.arm(self._batch.known())

    def _pre_hook(self, tap: Tap):
        conv = isinstance(tap.module, nn.modules.conv._ConvNd)

        def hook(module, inputs):
            if compiling():
                self._compiled = True
                return
            tap.replaying = False
            tap.recording = self._capturing()
            if not tap.recording:
                if self.enabled and self.model.training:
                    tap.nograd = self._pass
                return
            if module is not tap.module:
                tap.recording = False
                raise replica_error(f"layer {tap.name!r}")
            active = trainable_now(tap)
            if not active and not tap.records:
                # Every parameter frozen since attach: an ordinary frozen layer.
                tap.recording = False
                return
            count_call(tap, module)
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
                tap.saved = switch_off(tap)
        return hook

    def _restore_hook(self, tap: Tap):
        def hook(module, inputs, output):
            if compiling():
                return
            self._restore(tap)
        return hook

    @staticmethod
    def _restore(tap: Tap) -> None:
        tap.recording = tap.replaying = False
        if tap.saved is not None:        # always_call=True: restored even on error
            switch_back(tap, tap.saved)
            tap.saved = None

    def _outside_hook(self, name: str, tap: Tap):
        def hook(p):
            # After an unrecorded forward, a gradient may be that forward's
            # ordinary one: refused under that cause (if still there at the step).
            found = self._uncaptured_grads if self._uncaptured else self._outside
            found.setdefault(name, type(tap.module).__name__)
        return hook

    def _capture(self, tap: Tap, slot, inputs: tuple, output):
        """Record ``inputs`` and arrange for the gradient of ``output``; returns the
        tensor the forward continues with."""
        if not tap.recording or output is None:
            # None: the forward raised (always_call hooks still run), or nothing
            # depends on the layer, whose gradient is then exactly zero.
            return output
        if tap.replaying:
            # The recorded call's output entered the graph the same way.
            if isinstance(output, torch.Tensor) and not output.requires_grad:
                return CaptureGrad.apply(output, self._anchor, ignore)
            return output
        if not isinstance(output, torch.Tensor):
            # Nothing to hook a gradient on: the layer would get pure noise.
            raise TypeError(
                f"GhostClipper: layer {tap.name!r} ({type(tap.module).__name__}) returned "
                f"{type(output).__name__}, expected one tensor (its rule is given the "
                "gradient of that output); return one tensor from the layer, or put the "
                "trainable parameters in a sub-module that does")
        if tap.records and any(r.got for r in tap.records):
            raise RuntimeError(
                f"GhostClipper: layer {tap.name!r} runs forward again after a backward pass "
                "reached it; call privatize_() (optimizer.step()) before the next forward "
                "(batches are not accumulated: each step is one batch), or clear() to discard")
        if isinstance(tap.module, nn.EmbeddingBag):
            # model(text, offsets): the samples are the bags (layout.StepBatch).
            self._batch.from_bags(tap.name, inputs[0], output.shape[0],
                                  not any(t.records for t in self.taps))
        dim = batch_dim(tap.module, tap.batch_first, output)
        # The layout first: where the graph shows the samples, it names the cause.
        self._check_layout(tap, inputs, output, dim)
        self._check_rows(tap, output, dim)
        inputs, versions = _detached(inputs)
        rec = Record(inputs, slot, versions)
        tap.records.append(rec)
        tap.recorded_in = self._pass
        def on_grad(grad):
            self._on_grad(tap, rec, grad)
        if output.requires_grad:
            # A tensor hook fires with the gradient of this value even if a later
            # in-place op (an inplace ReLU) modifies it: no copy needed.
            _add_grad_hook(output, on_grad)
        else:
            output = CaptureGrad.apply(output, self._anchor, on_grad)
        # Where the loss check's reading of the graph stops (loss_watch.py).
        self._loss.source(output, dim, self._batch.known())
        return output

    def _check_rows(self, tap: Tap, output, dim: int) -> None:
        """Refuse, at the forward, a layer whose rows are not the step's samples
        (the backward's check, earlier): a model that folds each sample's rows
        into the batch (HF's *ForMultipleChoice) would otherwise fail inside
        its own forward, where a one-row position table was given the
        samples' rows (layout.broadcast_rows)."""
        known = self._batch.known()
        if known is None or output.dim() == 0 or output.shape[dim] == known:
            return
        # The same reading of the step's batch as the backward's check (its
        # source is formatted only here, off the per-layer path).
        batch, source = self._batch.get(tap.name)
        if output.shape[dim] == batch:
            return
        tap.recording = False
        raise rows_error(tap.name, tap.module, tuple(output.shape), dim, tap.batch_first,
                         tap.layout, batch, source)

    def _check_layout(self, tap: Tap, inputs: tuple, output, rule: int) -> None:
        """Refuse a layer whose input is a parameter, combines the samples, or
        carries them, by the graph from the layers before it, in another
        dimension than its layout reads (structure.py); a layer that changes
        the rank is left to its rule."""
        x = inputs[0] if inputs else None
        if not isinstance(x, torch.Tensor):
            return
        base = x._base
        # issubclass, not isinstance: Parameter's metaclass checks instances in
        # Python (host time a layer, issue 36).
        if issubclass(type(x), nn.Parameter) or (base is not None and
                                                 issubclass(type(base), nn.Parameter)):
            # A parameter (or a view of one) as the input: the output is the
            # same for every sample, so its rows are not the samples (where
            # their count equals the batch, nothing else would tell).
            tap.recording = False
            raise ValueError(
                f"GhostClipper: layer {tap.name!r} ({type(tap.module).__name__}) runs on a "
                f"parameter (shape {tuple(x.shape)}), not on the samples: its output is shared "
                "by every sample, so its rows are not the samples and it has no per-sample "
                "gradient of the form the rules compute. Freeze the layer (and the table it "
                "reads), or compute the shared table outside a trainable layer")
        if x.ndim != output.ndim:
            return
        try:
            found = self._layouts.sample_dim(tap.name, x, self._loss.sources, self._batch.known(),
                                             self._anchor)
        except ValueError:
            # Samples combined, read with the layout's batch dimension: where
            # the layer's rows are not the batch, the layout is the likelier
            # cause, and the rows' refusal says how to state it.
            self._check_rows(tap, output, rule)
            tap.recording = False
            raise
        if self._layouts.pending:
            self._loss.pending += self._layouts.take_pending()
        if found is not None and found != rule:
            tap.recording = False
            raise self._layouts.error(tap.name, tap.module, x, found, rule, tap.batch_first)

    def _on_grad(self, tap: Tap, rec: Record, grad):
        if self._compiled:
            raise compiled_error()
        self._loss.require(self._batch.model_ran)
        if rec.got:
            rec.twice = True            # a second backward through the same forward
            return
        # Outside a double backward the gradient is already outside autograd.
        rec.grad, rec.got = (grad.detach() if grad.requires_grad else grad), True
        records = tap.records
        if (len(records) == 1 and records[0] is rec) or all(r.got for r in records):
            # The layer's last output gradient: run its rule now, inside backward,
            # and let go of its inputs and gradients (instantiated blocks are the
            # size of the parameters; the rest is freed as backward goes on).
            self._evaluate(tap)

    def _evaluate(self, tap: Tap) -> None:
        batch, source = self._batch.get(tap.name)
        for rec in tap.records:
            if _versions(rec.inputs) != rec.versions:
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
            if tap.half or rec.grad.dtype in HALF:
                if rec.grad.dtype in HALF and not self._half_grads:
                    self._half_grads[tap.name] = rec.grad.dtype    # refused at a mean's step
                # The rule computes in float32 from here on: the half values
                # are exact in float32, so nothing but the final rounding of
                # the private gradient to the parameter's dtype is in half.
                # A half gradient of a float32 layer (its forward under
                # torch.autocast) next to its float32 input likewise: the
                # rules' GEMMs and convolutions refuse mixed dtypes.
                rec.inputs = tuple(upcast(x) for x in rec.inputs)
                rec.grad = upcast(rec.grad)
        calls = [Call(r.inputs, r.grad, r.slot) for r in tap.records]
        trainable = tap.trainable()
        got = tap.rule(tap.module, calls, trainable)
        covered = [n for names, _ in got for n in names]
        if sorted(covered) != sorted(trainable):
            raise RuntimeError(f"GhostClipper: the rule of {type(tap.module).__name__} "
                               f"({tap.name!r}) returned blocks for {covered}, expected each "
                               f"of {sorted(trainable)} once")
        tap.blocks = tied.layer_uses(
            tap, calls, [(names, cast_block(tap, names, block)) for names, block in got], batch,
            self._tied)
        tap.batch = batch
        # The layer's inputs its blocks read at the step, and a caller could
        # still change in place: a pair's activations (the input, or a view of
        # it), a ghost block's reads; a dense block is the rule's own result.
        kept = self._kept
        for _, block in tap.blocks:
            kind = type(block)
            if kind is tuple:
                kept.append((block[0], block[0]._version, tap.name))
            elif kind is not torch.Tensor:
                kept += [(t, t._version, tap.name) for t in getattr(block, "reads", ())]
        for rec in tap.records:
            rec.inputs = rec.grad = None

    def _forward_hook(self, tap: Tap):
        """A plain layer's one forward hook (always_call: it runs when the
        forward raised too, output None): the capture, then the restore of
        :meth:`_restore_hook` whatever the capture did (one hook a layer, not
        two: torch's dispatch of each is host time, issue 36)."""
        def hook(module, inputs, output):
            if compiling():
                return None
            try:
                got = output
                if tap.recording:       # position ids (1, T): one row per sample
                    inputs, got = broadcast_rows(module, inputs, output, tap.batch_first,
                                                 self._batch.known())
                out = self._capture(tap, None, inputs, got)
            finally:
                self._restore(tap)
            return None if out is output else out
        return hook

    def _bag_forward_hook(self, tap: Tap):
        """:meth:`_forward_hook` of an ``nn.EmbeddingBag`` (``with_kwargs``):
        the call recorded as ``embedding_bag.bag_call`` gives it (offsets and
        weights given by keyword; in ``mode='max'`` the rows of the maxima)."""
        plain = self._forward_hook(tap)

        def hook(module, args, kwargs, output):
            if (kwargs or module.mode == "max") and tap.recording and output is not None:
                args = bag_call(module, args, kwargs)
            return plain(module, args, output)
        return hook

    def _marker(self, tap: Tap):
        return lambda slot, x, output: self._capture(tap, slot, (x,), output)
