"""Which dimension of a layer's input holds the samples, followed through the
autograd graph (issue 35, item 1).

A layer's layout rule (layout.py: its own ``batch_first``, the clipper's, or
one leading dimension) says which dimension is the batch; its size is then
checked against the step's samples, which cannot tell a (T, B, d) input from a
(B, T, d) one when T == B.  Where the input descends, through operations the
graph reader knows (loss_graph.py), from the output of a layer recorded
earlier in the same forward, the dimension that carries that layer's samples
is known by structure: a disagreement with the rule is refused at the forward,
before the layer runs.  An input that does not descend from one (the model's
raw inputs, index tensors built from ``arange``), or reaches an operation the
reader does not know, is left to the rule and the size check.

The answer depends only on the operations and the shapes, so it is kept per
layer call and input shape: each new shape pays one graph walk.
"""
from __future__ import annotations

import torch

from .loss_graph import CompiledRegion, LossRefused, Out, SamplesMixed, Summed, walker

__all__ = ["LayoutByGraph"]


class LayoutByGraph:
    def __init__(self):
        # False (check_exact's clipper, which measures instead of refusing):
        # samples proven combined below a layer are left to the measurement.
        self.strict = True
        self.pending: list = []     # value conditions for the step's checks (take_pending)
        self._seen: dict = {}       # (layer, call, input shape, batch) -> sample dim or None
        self._walk = None
        self._calls: dict = {}      # layer name -> calls in this forward

    def take_pending(self) -> list:
        """The value conditions the walks since the last call found (the loss
        watch's form: ``(condition, why)``), handed over once."""
        pending, self.pending = self.pending, []
        return pending

    def new_forward(self) -> None:
        """At the model's forward: a fresh walk (its memo holds this forward's nodes)."""
        self._walk = None
        self._calls = {}

    def end_forward(self) -> None:
        """At the end of the model's forward: the walk's memo (this forward's
        graph nodes) let go, so that the graph dies with the caller's loss."""
        self._walk = None

    def sample_dim(self, name: str, x, sources: dict, batch: int | None, anchor):
        """The dimension of ``x`` (a layer's input) that carries the samples by
        structure, or None where the graph does not tell."""
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        if not isinstance(x, torch.Tensor) or x.grad_fn is None or not batch:
            return None
        key = (name, call, tuple(x.shape), batch)
        if key not in self._seen:
            if self._walk is None:
                self._walk = walker(sources, batch, anchor)
            held = len(self._walk.pending)
            try:
                v = self._walk.value(x.grad_fn, x.output_nr)
            except CompiledRegion as e:
                raise ValueError(
                    f"GhostClipper: layer {name!r} gets an input (shape {tuple(x.shape)}) "
                    f"computed by a torch.compile'd function ({e.why})") from None
            except SamplesMixed as e:
                if self.strict:
                    raise self.mixed(name, x, e.why) from None
                v = None
            except LossRefused:
                v = None
            if isinstance(v, Summed) and self.strict:
                raise self.mixed(name, x, "it is a value summed over the batch")
            if self.strict and isinstance(v, Out):
                # Conditions on values (an index along the batch must be 0..B-1)
                # of a walk that placed the samples (one that met an operation it
                # does not know -- a PackedSequence's sort and unsort -- left
                # the layer to its checks, conditions and all),
                # judged with the step's checks in its one transfer (before, never
                # judged below a layer: h[perm] was accepted, the fifth audit).
                conditions = self._walk.pending[held:]
                if conditions:
                    # Values, not shapes: judged again at every forward (no cache).
                    self.pending += [(ok, f"layer {name!r}'s input: {why}")
                                     for ok, why in conditions]
                    return v.dim if v.k == 1 else None
            self._seen[key] = v.dim if isinstance(v, Out) and v.k == 1 else None
        return self._seen[key]

    @staticmethod
    def mixed(name: str, x, why: str) -> ValueError:
        return ValueError(
            f"GhostClipper: layer {name!r} gets an input (shape {tuple(x.shape)}) that combines "
            f"the samples, followed through the graph from the layers before it ({why}): its "
            "rows' gradients would not be each sample's own. Statistics over the batch "
            "between layers (a batch norm written by hand, x - x.mean(0)) are refused; so is "
            "a layer whose rows are not the samples (a position table looked up with a 1-D "
            "arange(T), broadcast over the batch) where its row count equals the batch size: "
            "look positions up per sample, with ids of shape (B, T) or (1, T)")

    @staticmethod
    def error(name: str, module, x, found: int, rule: int, batch_first: bool) -> ValueError:
        return ValueError(
            f"GhostClipper: layer {name!r} ({type(module).__name__}) gets its input (shape "
            f"{tuple(x.shape)}) with the samples along dimension {found}, followed through the "
            f"graph from the layers before it, but its layout (batch_first={batch_first}) "
            f"reads dimension {rule} as the batch: its rows would be clipped as samples. "
            "Keep the samples in the dimension the layout reads (transpose back before the "
            "layer), or state the layout: batch_first=False for a sequence-first model")
