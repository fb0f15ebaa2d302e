"""CUDA graph capture and the private step: refused, loudly.

A CUDA graph replays the kernels it captured with the arguments they had when
they were captured.  The noise and subsampling kernels take their Philox seed
and offset by value, so every replay would draw the same numbers again (noise
reused), and no Python runs on a replay: no step would be accounted, no
per-sample record checked.  So capture is refused where it can come from:

* a recorded forward (the clipper's model pre-hook, training mode with grad
  on) while the current stream captures: ``torch.cuda.graph`` or
  ``make_graphed_callables`` around the model (an evaluation forward, which
  records nothing, may be captured);
* a step (``privatize_``, ``accumulate_``) while it captures: a captured
  ``optimizer.step()``;
* below both, every native launcher that draws from the Philox stream refuses
  a capturing stream (``csrc/common/cuda_check.h``), whoever calls it.
"""
from __future__ import annotations

import torch

from .. import _arrays, _native
from .._backend import GRAPH_CAPTURE_WHY

__all__ = ["graph_capturing", "refuse_graph_capture"]


def graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph; on the emulated
    device, whether the emulator reports a capture (its test switch,
    ``NCDP_EMU_STREAM_CAPTURING``)."""
    # CUDA never initialised: nothing can be capturing (and a CPU-only torch
    # has no capture query at all).
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return True
    return _arrays.emulation_on() and bool(_native.emulated().cuda_stream_capturing(0))


def refuse_graph_capture(what: str) -> None:
    """Raise RuntimeError, naming ``what``, while the current stream captures
    a CUDA graph."""
    if graph_capturing():
        raise RuntimeError(
            f"{what}: the current CUDA stream is capturing a CUDA graph (torch.cuda.graph, "
            f"make_graphed_callables, or a compiler's CUDA graphs): {GRAPH_CAPTURE_WHY}. "
            "Refused before anything was recorded, written or drawn; run the training step "
            "eagerly (a graph may still capture the model's evaluation forward)")
