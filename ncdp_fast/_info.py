"""``ncdp_fast.info()``: what this installation can do."""
from __future__ import annotations

from . import _backend


def info(print_it: bool = True) -> dict:
    """Version, CUDA build (and architectures), visible GPUs, numba version and threads.

    Returns the report as a dict and, unless ``print_it=False``, prints it.
    """
    import numba

    from . import __version__
    devices = _backend.cuda_devices()
    report = {
        "version": __version__,
        "native_module": _backend._C is not None,
        # Which build was loaded (NCDP_NATIVE_MODULE may name one outside the install).
        "native_file": getattr(_backend._C, "__file__", None),
        "cuda_compiled": _backend.CUDA_COMPILED,
        "cuda_archs": [a for a in _backend.CUDA_ARCHS.split(";") if a],
        "cuda_runtime": None,
        "cuda_driver": None,
        "cuda_devices": list(devices),
        # NCDP_CUDA_EMULATION=1: CPU torch tensors run the CUDA path on ncdp_fast._C_emu.
        "cuda_emulation": _backend.EMULATION,
        "numba_version": numba.__version__,
        "numba_threads": numba.get_num_threads(),
    }
    if _backend.CUDA_COMPILED:
        report["cuda_runtime"], report["cuda_driver"] = _backend._C.cuda_versions()
    elif _backend._C is None:
        report["cpu_only"] = f"the native module did not import ({_backend._C_ERROR})"
    else:
        # Modules built before build_note existed: the reason is unknown, not absent.
        note = getattr(_backend._C, "build_note", lambda: "")()
        report["cpu_only"] = note or "ncdp_fast._C was built without CUDA kernels"
    if print_it:
        width = max(len(k) for k in report)
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
    return report
