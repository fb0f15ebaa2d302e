"""Activation checkpointing (``torch.utils.checkpoint``) under the clipper.

Non-reentrant checkpointing (``use_reentrant=False``) runs a region's forward
once with gradients on -- the clipper records it as any forward -- and runs it
again inside backward, when autograd first needs a tensor the region did not
keep.  That second run is the same use of each layer, not a new one: its
outputs are not in the graph the loss's backward walks, so a record of it
would never get a gradient.  The clipper lets it through without recording,
with the parameters switched off exactly as in the first run (the checkpoint
compares the tensors the two runs save), and counts it against the layer's
recorded calls.

The signal: a module's forward that starts while autograd's engine executes a
backward graph task on this thread.  torch exposes that only through
``torch._C._current_graph_task_id()`` (-1 outside backward; the checkpoint
module itself keys its recomputations by it).  It is private: when it is
absent a forward inside backward cannot be told apart, so a recomputation is
recorded as a use and the step is refused later (its record never gets a
gradient), never computed wrongly.

Reentrant checkpointing (``use_reentrant=True``) runs the region's forward
under ``torch.no_grad()`` and the recorded one inside backward, where a
nested backward gives the parameters their ordinary gradients: refused, at
the recomputation, naming the layer (:func:`refuse_reentrant`).  It is told
apart by the autograd node being executed, its ``CheckpointFunction``'s
backward (``torch._C._current_autograd_node()``, private too: where it is
absent every recomputation is refused, see :func:`reentrant_recompute`); the
clipper also refuses a layer run under no_grad and recorded in the same model
forward, and more recomputations of a layer than recorded calls.
"""
from __future__ import annotations

import torch

__all__ = ["in_backward", "reentrant_recompute", "refuse_reentrant", "refuse_unmatched",
           "count_call"]

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_autograd_node = getattr(torch._C, "_current_autograd_node", None)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward
    now is a checkpoint's recomputation); False where torch does not say."""
    return _graph_task_id is not None and _graph_task_id() != -1


def reentrant_recompute(name: str, module) -> bool:
    """Whether the forward now running inside backward is a reentrant
    checkpoint's recomputation: autograd is executing ``CheckpointFunction``'s
    backward.  Raises where torch does not say which node runs."""
    if _autograd_node is None:
        raise RuntimeError(
            f"GhostClipper: layer {name!r} ({type(module).__name__}) ran forward inside "
            "backward (a torch.utils.checkpoint recomputation), and this torch has no "
            "torch._C._current_autograd_node to tell a use_reentrant=False checkpoint (exact "
            "here) from a use_reentrant=True one (refused); expected a torch that has it, or "
            "train without activation checkpointing; call clear() to discard this step")
    node = _autograd_node()
    return node is not None and node.name() == "CheckpointFunctionBackward"


def refuse_reentrant(name: str, module) -> RuntimeError:
    """A layer running forward inside a reentrant checkpoint's backward."""
    return RuntimeError(
        f"GhostClipper: layer {name!r} ({type(module).__name__}) ran forward inside backward "
        "in a torch.utils.checkpoint with use_reentrant=True (the region ran under "
        "torch.no_grad() in the forward), whose recomputation gives the parameters "
        "ordinary, unclipped gradients. Expected use_reentrant=False (torch's "
        "recommended form; Hugging Face: gradient_checkpointing_enable("
        "gradient_checkpointing_kwargs={'use_reentrant': False})), which is exact here; "
        "call clear() to discard this step")


def refuse_unmatched(name: str, module, recorded: int) -> RuntimeError:
    """A forward inside backward beyond the layer's recorded calls."""
    return RuntimeError(
        f"GhostClipper: layer {name!r} ({type(module).__name__}) ran forward inside backward "
        f"more often than this step's training forward ran it ({recorded} recorded call(s)); "
        "expected only a use_reentrant=False checkpoint's recomputation of recorded calls. "
        "A use_reentrant=True checkpoint (use use_reentrant=False), a forward inside a "
        "backward hook, or a second backward through a checkpointed forward would give "
        "gradients the clipper does not see; call clear() to discard this step")


def count_call(tap, module) -> None:
    """Count a recorded forward call of ``tap``'s layer (a :class:`.taps.Tap`
    whose ``recording`` is set): a use, or, inside backward, a
    ``use_reentrant=False`` checkpoint's recomputation of one, which is let
    through unrecorded (``tap.replaying``); any other forward inside backward
    is refused."""
    if in_backward():
        # A checkpoint's recomputation: switched off as the recorded
        # call was, so that the tensors it saves are the same.
        tap.recording = False            # until it is known to be one
        if tap.nograd == tap.recorded_in or reentrant_recompute(tap.name, module):
            raise refuse_reentrant(tap.name, module)
        if tap.replays >= tap.calls:
            raise refuse_unmatched(tap.name, module, tap.calls)
        tap.recording = tap.replaying = True
        tap.replays += 1
    else:
        tap.calls += 1
