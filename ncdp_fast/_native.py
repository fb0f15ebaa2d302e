"""The compiled modules: ``ncdp_fast._C`` (the native kernels) and, on request,
``ncdp_fast._C_emu`` (the same sources on the CPU emulation of CUDA: the
emulated device, docs/architecture.md "The emulated CUDA device").

Loaded here and nowhere else; ``_backend`` decides what runs where, the CUDA
adaptors ask :func:`for_array` which module launches for an array.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

from . import _arrays

# NATIVE_ENV names a built ncdp_fast._C file to load instead of the installed
# one: `make gpu-check PYTHON=...` builds the CUDA module under the checkout and
# must run it without installing anything into that interpreter. A path that
# does not load is an error, never a quiet fall-back to another build.
NATIVE_ENV = "NCDP_NATIVE_MODULE"
# "1": CPU torch tensors go to the emulated device for the whole process.
EMULATION_ENV = "NCDP_CUDA_EMULATION"


def load() -> ModuleType:
    """ncdp_fast._C (or the file NATIVE_ENV names); ImportError when it is not built."""
    path = os.environ.get(NATIVE_ENV)
    if not path:
        return importlib.import_module(f"{__package__}._C")
    spec = importlib.util.spec_from_file_location(f"{__package__}._C", path)
    if spec is None or spec.loader is None or not os.path.isfile(path):
        raise RuntimeError(f"{NATIVE_ENV}: expected the path of a built ncdp_fast._C "
                           f"extension module, got {path!r}; unset it to use the installed one")
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    sys.modules[spec.name] = native
    return native


_EMULATED: ModuleType | None = None


def emulated() -> ModuleType:
    """ncdp_fast._C_emu, loaded on first use; a RuntimeError saying how to build it."""
    global _EMULATED
    if _EMULATED is None:
        try:
            _EMULATED = importlib.import_module(f"{__package__}._C_emu")
        except ImportError as exc:
            raise RuntimeError(
                f"the emulated CUDA device ({EMULATION_ENV}=1) needs ncdp_fast._C_emu, which "
                f"this install lacks ({exc}): build it with `make build` in the checkout, or "
                "`pip install --no-build-isolation -e . -C cmake.define.NCDP_EMULATED_DEVICE=ON`"
            ) from None
    return _EMULATED


def for_array(x) -> ModuleType:
    """The module whose launchers take x's pointer: _C_emu for an array of the
    emulated device, else _C (imported by the package, never reloaded here)."""
    if _arrays.is_emulated(x):
        return emulated()
    return sys.modules[f"{__package__}._C"]
