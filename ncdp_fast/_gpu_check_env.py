"""The machine ``ncdp-fast gpu-check`` (``_gpu_check.py``) runs on: its GPUs
(nvidia-smi), the CUDA compiler, the environment of every process the check
starts, the torch it uses, and the check's own build of ncdp_fast; with what
every step shares (``ROOT``, :class:`CheckFailed`, its progress lines).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from ._backend import NATIVE_ENV as _NATIVE_ENV

ROOT = Path(__file__).resolve().parent.parent
# The check's own build, under the checkout: CMake's tree and pip's --target.
BUILD_DIR = ROOT / "build" / "gpu-check"


class CheckFailed(Exception):
    """A step of the check failed; the message says which and why."""


def _say(text: str) -> None:
    print(f"gpu-check: {text}", flush=True)


# ------------------------------------------------------------------ the device

def query_gpus(run=subprocess.run) -> list[tuple[str, str]]:
    """(name, compute capability "M.m") of every GPU nvidia-smi lists."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise CheckFailed("no NVIDIA GPU found: nvidia-smi is not installed (no NVIDIA driver)")
    try:
        proc = run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckFailed(f"no NVIDIA GPU found: nvidia-smi did not answer ({exc})") from None
    said = " ".join((proc.stdout + " " + proc.stderr).split())[-300:]
    if proc.returncode != 0:
        if "compute_cap" in said and "valid" in said:
            raise CheckFailed(f"nvidia-smi cannot report compute capabilities (driver too old?): "
                              f"{said}")
        raise CheckFailed(f"no NVIDIA GPU found: nvidia-smi exited with status "
                          f"{proc.returncode}: {said}")
    gpus = []
    for line in proc.stdout.splitlines():
        if line.strip():
            name, _, cap = line.rpartition(",")
            gpus.append((name.strip(), cap.strip()))
    if not gpus:
        raise CheckFailed("no NVIDIA GPU found: nvidia-smi lists none")
    return gpus


def cuda_arch(cap: str) -> str:
    """CMake's architecture for a compute capability: "9.0" -> "90-real"."""
    m = re.fullmatch(r"(\d+)\.(\d+)", cap)
    if m is None:
        raise CheckFailed(f"nvidia-smi reported compute capability {cap!r}; expected MAJOR.MINOR")
    return f"{m[1]}{m[2]}-real"


def nvcc_path() -> str | None:
    """The CUDA compiler CMake would find (CUDACXX, PATH, /usr/local/cuda), or None."""
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_nvcc() -> str:
    nvcc = nvcc_path()
    if nvcc is not None:
        return nvcc
    raise CheckFailed("nvcc not found (CUDACXX, PATH, /usr/local/cuda/bin): install the CUDA "
                      "toolkit to build the kernels")


def check_env(native: Path | None = None) -> dict:
    """The environment of every process the check starts: the checkout first
    on the path and, once built, the check's module.  ``python -m`` from ROOT
    puts the checkout on the path by itself, a script (bench/profile_step.py,
    bench/host_step.py) does not: the 2026-11-30 H200 run lost its profile to
    "No module named 'ncdp_fast'" where PYTHONPATH named other directories."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "")
                                                        .split(os.pathsep) if p])
    env.pop(_NATIVE_ENV, None)
    if native is not None:
        env[_NATIVE_ENV] = str(native)
    return env


_INFO = "import json, ncdp_fast; print(json.dumps(ncdp_fast.info(print_it=False)))"


def _python_json(python, code, env=None) -> dict | list:
    proc = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)
    if proc.returncode != 0:
        raise CheckFailed(f"{python} -c {code!r} failed: {proc.stderr.strip()[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def missing_modules(python, names, env=None) -> list[str]:
    """Those of ``names`` this interpreter cannot import."""
    return _python_json(python, "import importlib.util, json; print(json.dumps([m for m in "
                                f"{tuple(names)!r} if importlib.util.find_spec(m) is None]))",
                        env=env)


def check_torch(python) -> dict:
    t = _python_json(python, "import json, torch; print(json.dumps(dict(version=torch.__version__, "
                             "cuda=torch.version.cuda, available=torch.cuda.is_available(), "
                             "count=torch.cuda.device_count())))")
    if not t["available"]:
        what = "a CPU-only build" if t["cuda"] is None else f"built for CUDA {t['cuda']}"
        base = t["version"].split("+")[0]
        raise CheckFailed(
            f"torch {t['version']} ({what}) sees no GPU; the GPU tests and benchmarks take torch "
            "CUDA tensors. Run the check with an interpreter that has a CUDA build of torch "
            "(`make gpu-check PYTHON=/path/to/python`), or install one into this environment, "
            f"e.g. `{python} -m pip install --force-reinstall torch=={base}` from PyPI (its "
            "Linux x86-64 wheels are CUDA builds) or from a wheel file (/opt/wheels holds the "
            "CPU build), then run the check again")
    return t


# ------------------------------------------------------------------- the build

def rebuild(python, archs: list[str], nvcc: str, build_dir: Path = BUILD_DIR) -> tuple[Path, dict]:
    """Builds ncdp_fast for ``archs`` from scratch into ``build_dir`` (CMake's
    tree in ``cmake/``, pip's ``--target`` in ``site/``) without touching the
    interpreter's environment or any package index; returns the built
    ``_C`` module's path and ``ncdp_fast.info()`` of a fresh process using it."""
    shutil.rmtree(build_dir, ignore_errors=True)
    env = dict(check_env(), NCDP_CUDA_ARCH=";".join(archs), CUDACXX=nvcc)
    if env.pop("NCDP_DISABLE_CUDA", None) is not None:
        _say("ignoring NCDP_DISABLE_CUDA for this build")
    site = build_dir / "site"
    rc = subprocess.call([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "--no-build-isolation", "--no-deps", "--no-index", "--no-cache-dir",
                          "--target", str(site),
                          "--config-settings", f"build-dir={build_dir / 'cmake'}", str(ROOT)],
                         cwd=ROOT, env=env)
    if rc != 0:
        raise CheckFailed(f"building the extension failed (pip exit status {rc}; output above); "
                          "the interpreter needs scikit-build-core, pybind11, cmake and ninja "
                          "(nothing is downloaded)")
    built = sorted(site.glob("ncdp_fast/_C*.so"))
    if len(built) != 1:
        raise CheckFailed(f"the build left {len(built)} ncdp_fast/_C*.so under {site}; expected 1")
    info = _python_json(python, _INFO, env=check_env(built[0]))
    if info.get("native_file") != str(built[0]):
        raise CheckFailed(f"the tests would load ncdp_fast._C from {info.get('native_file')}, "
                          f"not the module just built ({built[0]})")
    if not info["cuda_compiled"]:
        raise CheckFailed("ncdp_fast._C was built without CUDA kernels: CMake found no CUDA "
                          f"compiler (nvcc: {nvcc})")
    missing = sorted(set(archs) - set(info["cuda_archs"]))
    if missing:
        raise CheckFailed(f"ncdp_fast._C has architectures {info['cuda_archs']}, not {missing}")
    if not info["cuda_devices"]:
        raise CheckFailed(f"ncdp_fast._C sees no GPU (CUDA runtime {info['cuda_runtime']}, "
                          f"driver {info['cuda_driver']}): the driver must support the CUDA "
                          "version nvcc built the kernels with")
    return built[0], info

