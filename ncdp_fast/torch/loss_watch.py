"""Where the loss check runs: every recorded layer's output is noted with its
batch dimension, and after each recorded forward of the model the first
backward that reaches them is caught by
a torch-function mode (``loss.backward()``, ``torch.autograd.backward``,
``torch.autograd.grad``, whoever calls them: a GradScaler, accelerate, the
Trainer) and checked (:mod:`.loss_graph`) before autograd runs.  A layer's
gradient arriving through a backward the check did not see is refused, so a
loss is never trusted by default.

The mode sits at the bottom of the thread's torch-function-mode stack from
the end of the forward to the backward (modes a user enters and leaves in
between stay in their own order) and only passes calls through; it is
removed at the next forward, or at the step once the backward was caught.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .loss_graph import FIX, LossRefused, ValueCheck, analyse, on_host

__all__ = ["LossWatch"]

_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
# A Python number multiplying or dividing a tensor reaches autograd as a 0-d
# tensor, as a count computed from the batch does; these calls, seen with
# the number, mark their node as scaling by a constant.
_SCALINGS = (torch.Tensor.mul, torch.Tensor.div, torch.Tensor.mul_, torch.Tensor.div_,
             torch.mul, torch.div, torch.true_divide, torch.Tensor.true_divide,
             torch.Tensor.true_divide_)


def _as_list(x):
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _roots(func, args, kwargs):
    """(tensor, gradient or None) pairs a backward call starts from."""
    if func is torch.Tensor.backward:
        grad = args[1] if len(args) > 1 else kwargs.get("gradient")
        return [(args[0], grad)]
    if func is torch.autograd.backward:
        tensors = _as_list(args[0] if args else kwargs.get("tensors"))
        grads = _as_list(args[1] if len(args) > 1 else kwargs.get("grad_tensors"))
    else:
        tensors = _as_list(args[0] if args else kwargs.get("outputs"))
        grads = _as_list(args[2] if len(args) > 2 else kwargs.get("grad_outputs"))
    return list(zip(tensors, grads + [None] * (len(tensors) - len(grads))))


class _Catch(TorchFunctionMode):
    def __init__(self, watch):
        super().__init__()
        self.watch = watch
        self.active = False
        self.running = 0        # backward calls under way through this mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and func in _BACKWARDS:
            self.watch.on_backward(_roots(func, args, kwargs))
            # A backward called inside this one (a reentrant checkpoint's
            # recomputation) is part of it, not a later one.
            self.running += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.running -= 1
        out = func(*args, **kwargs)
        if self.active and not self.watch.checked and func in _SCALINGS and len(args) == 2 and \
                isinstance(args[1], (int, float)) and isinstance(out, torch.Tensor) and \
                out.grad_fn is not None:
            self.watch.constants.add(out.grad_fn)
        return out


def _restack(keep):
    """Pop the thread's torch-function modes, drop ours, push the others back in
    their order, with ours at the bottom when ``keep``."""
    above = []
    while torch._C._len_torch_function_stack():
        m = torch._C._pop_torch_function_stack()
        if not isinstance(m, _Catch):
            above.append(m)
    if keep is not None:
        torch._C._push_on_torch_function_stack(keep)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


class LossWatch:
    """The clipper's loss check.  ``enabled`` False (``check_loss=False``) is
    the documented opt-out: nothing is recorded or checked."""

    def __init__(self, anchor: torch.Tensor, enabled: bool, on_refuse):
        self.enabled = enabled
        self.anchor = anchor
        self.on_refuse = on_refuse
        self.sources: dict = {}         # grad_fn node -> {output_nr: batch dim}
        self.batch = 0
        self.checked = False
        self.pending: list = []
        self.constants: set = set()     # nodes scaling by a Python number
        # The clipper's loss_reduction: a loss whose graph shows the other warns.
        self.reduction: str | None = None
        # A backward after the checked one (the same forward's): unread, so a
        # layer gradient it delivers is refused (require).
        self.later = False
        self._catch = _Catch(self)

    def source(self, t: torch.Tensor, dim: int, batch: int | None) -> None:
        """A recorded layer's output, whose batch dimension ``dim`` its layout
        gives (layout.batch_dim): the graph is read from the loss down to
        these.  An output that is 0-d or whose rows are not the ``batch``
        samples is left to the layer's own refusal in backward."""
        # Kept with the check off too: the layers' layouts are read from them.
        if t.grad_fn is not None:
            rows = t.ndim and (batch is None or t.shape[dim] == batch)
            self.sources.setdefault(t.grad_fn, {})[t.output_nr] = dim if rows else None

    def arm(self, batch: int) -> None:
        """At the end of a recorded forward of the model: the next backward is
        checked."""
        if not self.enabled:
            return
        self.batch, self.checked, self.later = batch, False, False
        self._catch.active = True
        _restack(self._catch)

    def on_backward(self, roots) -> None:
        if self.checked:
            # The mode stays armed after the checked backward until the step
            # or the next forward: any later backward is seen, and a layer
            # gradient it delivers refused (only the first was read); one
            # inside the checked one is its own (reentrant checkpointing).
            self.later = self.later or not self._catch.running
            return
        try:
            if self.batch == 0:
                reached, pending = True, []
            else:
                reached, pending = analyse(roots, self.sources, self.batch, self.anchor,
                                           self.constants, self.reduction)
        except LossRefused:
            self.on_refuse()
            raise
        if reached:
            self.checked = True
            self.pending += pending
            # The check is done with the forward's graph: let go of its nodes,
            # so that the graph dies with the caller's loss, as it does without
            # the clipper (held until the step, freeing it cost the step's
            # clear() 0.2 ms on EfficientNet-Lite0's 99 layers: issue 36's host
            # time, and the issue-35 checks' share of a step).
            self.sources, self.constants = {}, set()

    def require(self, model_ran: bool) -> None:
        """Inside backward, at a layer's gradient: refuse a backward the check
        did not see (a layer run outside the model's forward is refused by
        its own check)."""
        if (self.later or not self.checked) and self.enabled and model_ran:
            self._refuse_unread()

    def _refuse_unread(self) -> None:
        if self.later:
            raise RuntimeError(
                "GhostClipper: a layer's gradient arrived from a second backward after the one "
                "the loss check read (one forward, two backward calls): only the first "
                "backward's loss was checked to be a sum of per-sample terms, so this one is "
                "refused. Sum the losses and call backward once, or run a forward for each "
                "(docs/torch.md, 'The loss contract')")
        if not self.checked:
            raise RuntimeError(
                "GhostClipper: a gradient reached the model through a backward the loss check "
                "did not see (the model's forward ran without gradients, as in a reentrant "
                "checkpoint of the whole model, or backward ran on another thread, or a "
                "torch-function mode was removed): the loss could not be checked to be a sum "
                "of per-sample terms. Call loss.backward() (or torch.autograd.backward/grad) "
                "on the thread that ran the model, checkpoint blocks inside the model, or pass "
                "check_loss=False taking responsibility for the loss (docs/torch.md, 'The loss "
                "contract')")

    def settle(self, defer: bool = False) -> list:
        """At the step, before anything is written: refuse the first value check
        that failed.  Host values are read as they are.  Device values (a flag,
        or a :class:`~.loss_graph.ValueCheck`'s scalar) are read in one
        transfer, or with ``defer`` returned as ``(value, refuse, passes)``
        triples for the clip op to read with its counts
        (``clip_and_noise_layers``'s ``_checks``: one host wait a step instead
        of two, issue 36); a value on a device other than the first's is moved
        to it."""
        if self.checked or not self._catch.active:
            # The backward was caught: the mode would only pass the step's
            # calls through (a Python frame each, a parameter's .grad read
            # included: 100 a step on the 4-layer transformer).
            self.unstack()
        pending, self.pending = self.pending, []
        deferred = []
        for ok, why in pending:
            value, passes = ok if isinstance(ok, ValueCheck) else (ok, bool)
            if isinstance(value, torch.Tensor) and not on_host(value):
                deferred.append((value, self._refusal(why), passes))
            elif not passes(value.item() if isinstance(value, torch.Tensor) else value):
                self._refusal(why)()
        if defer or not deferred:
            return deferred
        dev = deferred[0][0].device
        # float64: each value exactly, whatever its dtype (a stack would
        # promote an integer count with a float32 one to float32).
        values = torch.stack([v.reshape(()).to(torch.float64) if v.device == dev else
                              v.reshape(()).to(dev, torch.float64)
                              for v, _, _ in deferred]).tolist()
        for v, (_, refuse, passes) in zip(values, deferred):
            if not passes(v):
                refuse()
        return []

    def _refusal(self, why: str):
        def refuse():
            self.on_refuse()
            raise LossRefused(f"GhostClipper: the loss is not a sum of per-sample terms: "
                              f"{why}; {FIX}")
        return refuse

    def unstack(self) -> None:
        """Take the mode off the stack (before a forward: the model never runs
        under it)."""
        self._catch.active = False
        if torch._C._len_torch_function_stack():
            _restack(None)

    def clear(self) -> None:
        self.sources.clear()
        self.constants.clear()
        self.pending = []
        self.checked = self.later = False
        self.unstack()
