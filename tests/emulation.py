"""Runner of the CPU emulation tier (tests/cuda_emu): builds the sanitizer drivers
once per session and runs one typed CUDA launcher on NumPy buffers, each
variant's driver serving case after case in one process per test process
(:class:`Server`, tests/cuda_emu/serve.h).

The kernels' own ``.cu`` source, compiled by the host C++ compiler against
``tests/cuda_emu/cuda_emu.h``, runs under ThreadSanitizer ("tsan") or
AddressSanitizer + UndefinedBehaviorSanitizer ("asan"); any sanitizer report,
emulator abort (barrier mismatch, deadlock, invalid launch) or non-zero exit
fails the call with the driver's stderr.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emu"
BUILD = ROOT / "build" / "cuda_emu"
VARIANTS = ("asan", "tsan")
# Scalars passed as uint64 (everything else integral is int64).
_UNSIGNED = {"seed", "offset", "row_stride"}
_SANITIZER_ENV = {
    # Stop at the first report with a distinctive status.
    "TSAN_OPTIONS": "halt_on_error=1 exitcode=66 second_deadlock_stack=1",
    "ASAN_OPTIONS": "detect_leaks=1 abort_on_error=0 exitcode=67",
    "UBSAN_OPTIONS": "print_stacktrace=1 halt_on_error=1 exitcode=68",
}
_REPORT_MARKERS = ("ThreadSanitizer", "AddressSanitizer", "LeakSanitizer", "runtime error:",
                   "ncdp_emu: FATAL")


def build(targets=("tsan", "asan"), *, extra=()):
    """Builds the drivers (make keeps them up to date); returns the build dir."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None or shutil.which("make") is None:
        pytest.skip(f"the emulation tier needs a host C++ compiler ({cxx}) and make")
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    # One make at a time in the build directory: test processes run side by
    # side (pytest-xdist) and two makes writing one target corrupt it.
    BUILD.mkdir(parents=True, exist_ok=True)
    with open(BUILD / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Later OUT= arguments (in extra) override the default build directory.
        proc = subprocess.run(["make", "-C", str(EMU), f"OUT={BUILD}", *extra, "-j", jobs,
                               *targets], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise AssertionError(f"building the emulation tier failed:\n{proc.stdout}\n"
                             f"{proc.stderr}")
    return BUILD


def run_program(args, *, timeout=600):
    """Runs an emulation binary; returns (returncode, stderr)."""
    env = dict(os.environ, **_SANITIZER_ENV)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stderr


class Server:
    """``program --serve`` (tests/cuda_emu/serve.h): one process running case
    after case, so that the emulator's threads and fibers are created once, not
    per case (most of a ThreadSanitizer case's time). A case that fails ends the
    process; the next call starts a fresh one."""

    def __init__(self, program: pathlib.Path):
        self.program = program
        self.proc = None
        self.log = None

    def _start(self):
        # stderr goes to a file the process shares with us; read with pread, so
        # that our reads never move its write position.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(self.program), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log,
                                     env=dict(os.environ, **_SANITIZER_ENV))

    def _log_size(self):
        return os.fstat(self.log.fileno()).st_size

    def call(self, line: str, *, timeout=600):
        """Runs one case; returns (returncode, stderr) as :func:`run_program`
        does: 0 and the case's stderr when it ran; else the exit status (-9 past
        ``timeout``) and the stderr since the case began."""
        if self.proc is None:
            self._start()
        start = self._log_size()
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        printed = []   # anything on stdout but the answer (nothing, as written)
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
            while (answer := self.proc.stdout.readline()) not in (b"done\n", b""):
                printed.append(answer.decode(errors="replace"))
        except BrokenPipeError:
            answer = b""
        finally:
            timer.cancel()
        if answer == b"done\n":
            return 0, "".join(printed) + self._stderr(start)
        rc = self.proc.wait()
        stderr = (self._seed_line() if start else "") + "".join(printed) + self._stderr(start)
        self.close()
        # A served program that ended its input early without a status is a failure too.
        return (rc if rc != 0 else -1), stderr

    def _seed_line(self):
        """The process's block-order seed (printed at its first launch, maybe in
        an earlier case's stderr), for a failure's message: the blocks of a case
        ran in an order that also depends on the cases served before it."""
        for text in self._stderr(0).splitlines():
            if "block order seed" in text:
                return (f"{text} [printed at this served process's first launch; the "
                        "order of each case also depends on the cases before it]\n")
        return ""

    def _stderr(self, start):
        return os.pread(self.log.fileno(), self._log_size() - start, start).decode(
            errors="replace")

    def close(self):
        """Ends the process (end of input) and forgets it."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        self.proc = None


_SERVERS: dict[pathlib.Path, Server] = {}


def server(program: pathlib.Path) -> Server:
    """The process serving ``program`` in this test process (one per program)."""
    if program not in _SERVERS:
        _SERVERS[program] = Server(program)
    return _SERVERS[program]


@atexit.register
def _close_servers():
    for s in _SERVERS.values():
        s.close()


class Emulator:
    """One sanitizer variant's driver, served (:class:`Server`), with a fresh
    case directory per call."""

    def __init__(self, variant: str, workdir: pathlib.Path):
        self.variant = variant
        self.driver = BUILD / f"emu-driver-{variant}"
        self.workdir = workdir
        self.calls = 0

    def run(self, op: str, scalars: dict, buffers: dict, misalign: dict | None = None):
        """Runs ``op``; returns every buffer as it is after the launch.

        ``buffers`` maps names to arrays (None: a null pointer); ``misalign``
        maps names to a byte offset from a 16-byte boundary.
        """
        misalign = misalign or {}
        case = self.workdir / f"{self.variant}-{self.calls}-{op}"
        self.calls += 1
        case.mkdir(parents=True)
        lines = [f"op {op}"]
        for name, value in scalars.items():
            if isinstance(value, (bool, np.bool_)):
                lines.append(f"i {name} {int(value)}")
            elif isinstance(value, (int, np.integer)):
                lines.append(f"{'u' if name in _UNSIGNED else 'i'} {name} {int(value)}")
            else:
                lines.append(f"f {name} {float(value).hex()}")
        arrays = {}
        for name, array in buffers.items():
            if array is None:
                continue
            array = np.ascontiguousarray(array)
            arrays[name] = array
            array.tofile(case / f"{name}.bin")
            lines.append(f"b {name} {name}.bin {misalign.get(name, 0)}")
        (case / "args.txt").write_text("\n".join(lines) + "\n")
        rc, stderr = server(self.driver).call(str(case))
        problems = [m for m in _REPORT_MARKERS if m in stderr]
        if rc != 0 or problems:
            raise AssertionError(f"{op} under {self.variant}: exit status {rc}, "
                                 f"{problems or 'no report'}\n{stderr[-6000:]}")
        out = {name: np.fromfile(case / f"{name}.bin.out", dtype=a.dtype).reshape(a.shape)
               for name, a in arrays.items()}
        shutil.rmtree(case)
        return out
