"""What a step asks of torch that would make the host wait for a GPU.

On a GPU the host queues work and goes on; it waits (cudaStreamSynchronize,
a blocking copy) when it needs a value the device computes: a scalar
(``.item()``, ``bool(t)``, ``float(t)``), a copy to the host (``.cpu()``,
``.numpy()``, ``.tolist()``, ``.to("cpu")``), or a result whose shape depends
on the data (``nonzero``, boolean-mask indexing, ``unique``,
``masked_select``). :class:`HostSyncCounter` records each such call made
while it is active, with the line of ncdp_fast that made it, so a test can
hold a step's count on the emulated device (or on a GPU), where no timing
would show it.
"""
from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

_SCALAR = {"item", "__bool__", "__float__", "__int__", "__index__", "__complex__"}
_TO_HOST = {"cpu", "numpy", "tolist", "__array__"}
_DATA_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


def _mode_stack() -> list:
    """The torch function modes active in this thread, innermost last."""
    from torch.overrides import _get_current_function_mode_stack
    return _get_current_function_mode_stack()


def _is_bool_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _mask_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(_is_bool_tensor(i) for i in items)


def _to_host(args, kwargs) -> bool:
    """Tensor.to(...) / copy targets that name the CPU."""
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


def _on_device(x) -> bool:
    """A tensor of the device: a CUDA tensor, or a CPU tensor while the emulated
    device is on (ncdp_fast._arrays.is_emulated)."""
    from ncdp_fast import _arrays
    return isinstance(x, torch.Tensor) and (x.is_cuda or _arrays.is_emulated(x))


def sync_kind(name: str, args, kwargs) -> str | None:
    """Why calling ``name`` with these arguments would wait for the device, or None.
    Only calls on a device tensor count: a CPU tensor's .numpy() (after .cpu())
    or .item() waits for nothing."""
    if not args or not _on_device(args[0]):
        return None
    if name in _SCALAR:
        return "scalar read"
    if name in _TO_HOST:
        return "copy to the host"
    if name in _DATA_SHAPED:
        return "data-dependent shape"
    if name in ("__getitem__", "__setitem__") and len(args) > 1 and _mask_index(args[1]):
        return "boolean-mask index"
    if name == "to" and _to_host(args, kwargs):
        return "copy to the host"
    return None


def _caller() -> str:
    """The innermost frame of ncdp_fast that led to the call ('file:line function'),
    past the array-interop helpers (_arrays.py), which copy where they are told to."""
    for frame in reversed(traceback.extract_stack()):
        if "/ncdp_fast/" in frame.filename and not frame.filename.endswith("/_arrays.py"):
            return f"{frame.filename.split('/ncdp_fast/')[-1]}:{frame.lineno} {frame.name}"
    return "outside ncdp_fast"


class HostSyncCounter(TorchFunctionMode):
    """Context manager: ``events`` lists (kind, torch function, where) of every
    call that would synchronise a GPU with the host while it is active.

    The autograd engine does not carry torch function modes into backward
    (a tensor hook's calls reach no mode), and the clipper's rules run
    there: while active, the counter also enters itself around the
    clipper's one backward entry point (``LayerRecorder._on_grad``, which
    evaluates every rule), so a rule's waits are counted too."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str, str]] = []

    def __enter__(self):
        from ncdp_fast.torch.recorder import LayerRecorder
        self._plain = plain = LayerRecorder.__dict__["_on_grad"]
        counter = self

        def on_grad(recorder, *args, **kwargs):
            if any(m is counter for m in _mode_stack()):
                return plain(recorder, *args, **kwargs)
            TorchFunctionMode.__enter__(counter)
            try:
                return plain(recorder, *args, **kwargs)
            finally:
                TorchFunctionMode.__exit__(counter, None, None, None)
        LayerRecorder._on_grad = on_grad
        return super().__enter__()

    def __exit__(self, *exc):
        from ncdp_fast.torch.recorder import LayerRecorder
        LayerRecorder._on_grad = self._plain
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        why = sync_kind(name, args, kwargs)
        if why is not None:
            self.events.append((why, name, _caller()))
        return func(*args, **kwargs)

    def in_library(self) -> list[tuple[str, str, str]]:
        """The events that ncdp_fast's own code caused."""
        return [e for e in self.events if e[2] != "outside ncdp_fast"]
