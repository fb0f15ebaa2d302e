"""torch.compile and the clipper: refused, loudly, whichever way it comes.

The clipper records each layer's call, inputs and output gradient with Python
hooks and checks the loss on the autograd graph.  torch.compile traces those
hooks into its graph: its guards replay their side effects, in-place buffers
of inductor look like the user's in-place ops, and whether the recorded
inputs are the ones the layer read is no longer something the clipper can
check.  An exactness we cannot check is refused, naming compile:

* at construction, a model already compiled (``torch.compile(model)``'s
  ``OptimizedModule``, or ``model.compile()`` on any sub-module);
* a model compiled after construction is seen while dynamo traces the hooks
  (``torch.compiler.is_compiling()`` is True only then): the hook marks the
  clipper and the first gradient or step that follows refuses, before
  anything is written.  The mark is a side effect dynamo replays on every
  later call of the compiled code, so a cached graph is refused too.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["compiling", "check_not_compiled", "compiled_error"]

_WHY = ("the clipper records each layer's inputs and output gradient with Python hooks, "
        "which torch.compile traces into its graph, so the private step can no longer be "
        "checked to be exact")
_FIX = ("train the model eagerly: drop torch.compile(...) / model.compile() (the private "
        "step's own work is the clip op and the per-layer rules, which compile would not "
        "reach anyway)")


# torch >= 2.3 has torch.compiler.is_compiling; earlier, dynamo's own.  Looked
# up once: every hook of every recorded layer asks.
_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None) or \
    torch._dynamo.is_compiling


def compiling() -> bool:
    """True while dynamo traces the calling code."""
    return bool(_IS_COMPILING())


def _compiled_part(model: nn.Module) -> str | None:
    """The name of the first compiled part of ``model`` ('' for itself), or None."""
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(optimized, "OptimizedModule", ())
    for name, m in model.named_modules():
        if (optimized and isinstance(m, optimized)) or \
                getattr(m, "_compiled_call_impl", None) is not None:
            return name
    return None


def check_not_compiled(model: nn.Module, what: str) -> None:
    """Refuse a model (or sub-module) compiled by torch.compile; ``what`` names
    the refusing call."""
    name = _compiled_part(model)
    if name is None:
        return
    got = "a compiled model" if not name else f"a model whose sub-module {name!r} is compiled"
    raise ValueError(
        f"{what}: module: expected an eager model, got {got} (torch.compile / "
        f"nn.Module.compile): {_WHY}. Refused; {_FIX}, and pass the "
        "uncompiled model (torch.compile(model)._orig_mod)")


def compiled_error() -> RuntimeError:
    """The refusal of a step whose forward ran under torch.compile."""
    return RuntimeError(
        f"GhostClipper: the model ran forward under torch.compile (compiled after the "
        f"clipper or make_private was set up): {_WHY}. The step is refused, nothing was "
        f"written and no noise drawn; {_FIX}, then build the clipper (or call make_private) "
        "again on the eager model")
