"""Shared test helpers: backends present on this machine and rounding bounds.

Tolerances are derived from the standard error bound of recursive summation
(Higham, "Accuracy and Stability of Numerical Algorithms", eq. 3.4): a sum of n
terms computed in precision u has error at most gamma_n * sum |terms| with
gamma_n = n u / (1 - n u).  Each comparison names the n it uses and why.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

# NCDP_CUDA_EMULATION=1 (make test, make test-gpu): the tests marked gpu run on
# the emulated CUDA device where no GPU is visible, each inside require_cuda,
# while every other test keeps plain CPU tensors. Taken out of the environment
# before ncdp_fast is imported, so that neither this process nor the processes
# the tests start (torchrun, gloo ranks) turn the emulation on for everything.
EMULATION = os.environ.pop("NCDP_CUDA_EMULATION", "") == "1"
if EMULATION:
    # pytest imported ncdp_fast before this file, with the variable set, to read
    # pyproject's filterwarnings (ncdp_fast.NoiseReuseWarning): the emulation is
    # on for the whole process there. Off, then: require_cuda turns it on.
    from ncdp_fast import _arrays
    _arrays.set_emulation(False)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist (make test runs 2 processes): each worker is told whether
    NCDP_CUDA_EMULATION was set, which this process took out of the
    environment before the workers were started."""
    node.workerinput["ncdp_cuda_emulation"] = EMULATION


def pytest_configure(config):
    global EMULATION
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    EMULATION = bool(worker.get("ncdp_cuda_emulation", False))
    # xdist gives its workers their ids in the environment: a pytest that a
    # test starts would read them and take itself for a worker
    # (pytest-benchmark then writes no --benchmark-json).
    for name in [k for k in os.environ if k.startswith("PYTEST_XDIST_")]:
        del os.environ[name]


def bench_script(name: str, as_name: str | None = None):
    """bench/<name>.py as a module, loaded by path, without leaving bench/ on
    this process's path: its conftest.py would shadow the tests' own in every
    process spawned later (the gloo ranks import "conftest" by name), and its
    modules the tests' imports."""
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(as_name or f"_{name}_under_test", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def run_bench_script(name: str, *args: str, timeout: float = 600):
    """``python bench/<name>.py *args`` from the repository root, its output
    captured (a CompletedProcess)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, str(root / "bench" / f"{name}.py"), *args], cwd=root,
                          capture_output=True, text=True, timeout=timeout)


def loader_batches(loader):
    """A private loader's batches, pass after pass, as a training loop reads
    them: ``DPOptimizer.step()`` expects each step on the next batch of the
    loader make_private returned (empty batches included)."""
    while True:
        yield from loader


def in_new_process(module: str, function: str, *args, timeout: float = 300) -> None:
    """``tests/<module>.py``'s ``function(*args)`` (strings) in a fresh
    interpreter, as a new process of a resumed run would run it; fails the
    calling test with its stderr if it fails."""
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as t; "
            f"t.{function}(*sys.argv[2:])")
    proc = subprocess.run([sys.executable, "-c", code, tests, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def unit_roundoff(dtype) -> float:
    return float(np.finfo(dtype).eps) / 2


def gamma(n: int, dtype) -> float:
    nu = n * unit_roundoff(dtype)
    assert nu < 0.5, "bound meaningless at this size"
    return nu / (1 - nu)


def assert_within_sum_bound(actual, expected, abs_terms, n, dtype, what=""):
    """|actual - expected| <= gamma_n(dtype) * abs_terms elementwise, plus one
    rounding of the result to dtype (|expected| * u), plus the float64
    reference's own error (negligible, but counted)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    bound = (gamma(n, dtype) + gamma(n, np.float64)) * np.asarray(abs_terms) \
        + unit_roundoff(dtype) * np.abs(expected)
    err = np.abs(actual - expected)
    worst = np.max(err - bound) if err.size else 0.0
    assert worst <= 0, (f"{what}: error exceeds the rounding bound by {worst:.3g} "
                        f"(max err {err.max():.3g}, n={n}, {np.dtype(dtype).name})")


def first_deep_pair(seed: int, parity: int) -> int:
    """The first Box-Muller pair of stream ``seed`` with index ``parity`` mod 2
    whose leading draw is below ``reference.DEEP_BELOW``: one that reads its
    deep block (probability 2^-11 a pair, so about 4096 pairs in)."""
    from ncdp_fast import reference as R
    chunk = 4096
    for start in range(0, 2**62, chunk):
        leading = R.philox_words(2 * chunk, seed=seed, offset=2 * start)[0::2]
        for i in np.flatnonzero(leading < R.DEEP_BELOW):
            if (start + i) % 2 == parity:
                return start + int(i)


@pytest.fixture(autouse=True)
def _fresh_noise_ledger():
    """Each test is its own run: the process-wide record of drawn noise ranges
    (``ncdp_fast._stream``) starts empty, so that reuse *within* a test is what
    raises NoiseReuseWarning (an error under pyproject's filterwarnings)."""
    from ncdp_fast import _stream
    _stream._LEDGER.clear()
    _stream._LEDGER.disk_checked.clear()    # as in a new process: each key's ledger read once
    yield


@pytest.fixture(autouse=True)
def _fresh_key_ledger(tmp_path_factory, monkeypatch):
    """The across-runs key ledger (``ncdp_fast._key_ledger``) of each test is its own
    empty directory: no test reads or writes the user's cache."""
    monkeypatch.setenv("NCDP_FAST_LEDGER_DIR", str(tmp_path_factory.mktemp("key-ledger")))


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    import ncdp_fast._backend as be
    return be.CUDA_COMPILED and torch.cuda.is_available()


@pytest.fixture
def require_cuda():
    """For tests marked gpu: the GPU where torch sees one and _C has CUDA kernels;
    else, under NCDP_CUDA_EMULATION=1, the emulated device (torch.device("cpu"),
    whose tensors go through the CUDA adaptors and ncdp_fast._C_emu for the
    test's duration); else a skip saying how to run the test without a GPU."""
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    import ncdp_fast._backend as be
    if torch.cuda.is_available() and be.CUDA_COMPILED:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        yield torch.device("cuda")
        return
    if not EMULATION:
        pytest.skip("no CUDA device visible (NCDP_CUDA_EMULATION=1 runs the gpu tests on the "
                    "emulated device)")
    with be.emulated_cuda():
        yield torch.device("cpu")


@pytest.fixture
def tf32_on_matmuls(monkeypatch):
    """TF32 switched on globally for the test (a caller's setting), and the
    list of ``allow_tf32`` values each ``torch.matmul`` call saw; the setting
    is restored afterwards (and checked still on: the op under test gives the
    caller's back)."""
    torch = pytest.importorskip("torch")
    seen, real = [], torch.matmul

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return real(*args, **kwargs)

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    monkeypatch.setattr(torch, "matmul", spy)
    try:
        yield seen
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def emulated(device) -> bool:
    """Whether require_cuda's device is the emulated one."""
    return device.type == "cpu"


def on_host(device):
    """A block whose CPU tensors are plain CPU tensors (the CPU path), also
    while the test runs on the emulated device."""
    if emulated(device):
        import ncdp_fast._backend as be
        return be.emulated_cuda(False)
    return contextlib.nullcontext()
