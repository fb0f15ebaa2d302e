"""Guards against native code that ends the process instead of raising (issue 14).

nvcc compiles a host template that calls a ``__device__``-only helper without a
diagnostic and gives it a body that calls ``exit(1)``: every call then ends the
Python process. These tests need no GPU (they are meant for CI):

- every typed launcher is run through ``_C.probe_typed_launcher`` in its own
  subprocess, which must end with a Python-level outcome;
- the host code of the built CUDA objects is searched for calls to
  ``exit``/``_exit``/``abort``/``__assert_fail``;
- the probe's list is compared with the launchers the objects define, so a new
  launcher cannot be left out of the probe.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import ncdp_fast

ROOT = Path(__file__).resolve().parent.parent
PROBE_TIMEOUT_S = 120

# Run in a fresh interpreter per launcher: argv[1] is the launcher's name. The
# last stdout line is the outcome as JSON; a process that ends inside the probe
# prints nothing. Whether a GPU is present is decided here, after the probe: a
# normal return must be confirmed by torch; after an error the driver's device
# count suffices (importing torch would cost seconds per launcher).
PROBE_CODE = r"""
import json, sys
from ncdp_fast import _C
try:
    _C.probe_typed_launcher(sys.argv[1])
    outcome, text = "returned", ""
except RuntimeError as exc:
    outcome, text = "RuntimeError", str(exc)
gpu = _C.cuda_device_count() > 0
if outcome == "returned":
    try:
        import torch
        gpu = bool(torch.cuda.is_available())
    except ImportError:
        pass
print(json.dumps({"outcome": outcome, "text": text, "gpu": gpu}))
"""

# Functions whose call ends the process without a Python exception.
FATAL_CALLEES = ("exit", "_exit", "_Exit", "quick_exit", "abort", "__assert_fail")
_FUNCTION = re.compile(r"^[0-9a-f]+ <(?P<name>.+)>:$")
# In a relocatable object a call to an external function targets a relocation
# ("R_X86_64_PLT32 exit-0x4"); in a linked one, a PLT entry ("<exit@plt>").
_FATAL_RELOCATION = re.compile(
    r"^\s+[0-9a-f]+:\s+R_\S+\s+(?P<callee>" + "|".join(map(re.escape, FATAL_CALLEES)) +
    r")(?:@\S*)?(?:[-+]0x[0-9a-f]+)?\s*$")
_FATAL_CALL = re.compile(
    r"\b(?:call|jmp)\w*\s.*<(?P<callee>" + "|".join(map(re.escape, FATAL_CALLEES)) + r")(?:@plt)?>")


def _cuda_compiled() -> bool:
    return bool(ncdp_fast.info(print_it=False)["cuda_compiled"])


def _require_cuda_build():
    if not _cuda_compiled():
        pytest.skip("ncdp_fast._C was built without CUDA (no launchers to probe)")


def _build_dirs() -> list[Path]:
    """CMake trees of this checkout: pyproject's build-dir with its {placeholders}
    as wildcards; those that built the loaded _C when one of them did."""
    pattern = "build/*"
    try:
        import tomllib
        config = tomllib.loads((ROOT / "pyproject.toml").read_text())
        pattern = re.sub(r"\{[^}]*\}", "*", config["tool"]["scikit-build"]["build-dir"])
    except (ImportError, KeyError, OSError):
        pass
    dirs = sorted(d for d in ROOT.glob(pattern) if (d / "CMakeFiles" / "_C.dir").is_dir())
    loaded = getattr(ncdp_fast._backend._C, "__file__", None)
    if loaded:
        same = [d for d in dirs if (d / Path(loaded).name).exists()]
        if same:
            return same
    return dirs


def _cuda_objects() -> list[Path]:
    return sorted(o for d in _build_dirs()
                  for o in (d / "CMakeFiles" / "_C.dir" / "csrc").rglob("*.cu.o"))


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (binutils)")
    return path


def _require_objects() -> list[Path]:
    objects = _cuda_objects()
    if not objects:
        pytest.skip(f"no CUDA objects (*.cu.o) under {ROOT / 'build'}: the module was not built "
                    "from this checkout with CUDA")
    return objects


def fatal_calls(disassembly: str) -> dict[str, set[str]]:
    """{function: {fatal callees}} of `objdump -dr --demangle` output."""
    found: dict[str, set[str]] = {}
    function = None
    for line in disassembly.splitlines():
        head = _FUNCTION.match(line)
        if head:
            function = head.group("name")
            continue
        hit = _FATAL_RELOCATION.match(line) or _FATAL_CALL.search(line)
        if hit and function is not None:
            found.setdefault(function, set()).add(hit.group("callee"))
    return found


def _probe(name: str) -> str | None:
    """None if launcher `name` behaved, else what went wrong."""
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE_CODE, name], capture_output=True,
                              text=True, cwd=ROOT, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{name}: did not finish in {PROBE_TIMEOUT_S} s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return (f"{name}: the process ended with exit status {proc.returncode} and no Python "
                f"exception (stderr: {proc.stderr.strip()[-500:]!r})")
    result = json.loads(lines[-1])
    if result["gpu"]:
        if result["outcome"] != "returned":
            return f"{name}: {result['outcome']} with a GPU present: {result['text']}"
        return None
    if result["outcome"] != "RuntimeError" or not re.search(r"\bcudaError\w+", result["text"]):
        return (f"{name}: without a GPU expected a RuntimeError naming a cudaError..., got "
                f"{result['outcome']}: {result['text']!r}")
    return None


def test_every_typed_launcher_raises_or_returns():
    _require_cuda_build()
    names = ncdp_fast._backend._C.typed_launcher_names()
    assert names, "typed_launcher_names() is empty"
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        problems = [p for p in pool.map(_probe, names) if p is not None]
    assert not problems, "launchers that misbehaved:\n" + "\n".join(problems)


def test_probe_rejects_an_unknown_name():
    _require_cuda_build()
    with pytest.raises(ValueError, match="typed_launcher_names"):
        ncdp_fast._backend._C.probe_typed_launcher("no_such_launcher<float>")


def test_no_host_function_of_the_cuda_objects_ends_the_process():
    objdump = _require_tool("objdump")
    offenders = []
    for obj in _require_objects():
        proc = subprocess.run([objdump, "-dr", "--no-show-raw-insn", "--demangle", str(obj)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"objdump failed on {obj}: {proc.stderr}"
        for function, callees in sorted(fatal_calls(proc.stdout).items()):
            offenders.append(f"{obj.relative_to(ROOT)}: {function} calls "
                             f"{', '.join(sorted(callees))}")
    assert not offenders, ("host functions that end the process (a __device__-only helper "
                           "called from host code?):\n" + "\n".join(offenders))


def test_fatal_call_parser_sees_relocations_and_plt_calls():
    # The shapes objdump prints for an unlinked and a linked call to exit.
    text = ("0000000000000000 <void ncdp::kernels::launch_x<float>(float const*)>:\n"
            "  35:\tcall   3a <void ncdp::kernels::launch_x<float>(float const*)+0x3a>\n"
            "\t\t\t36: R_X86_64_PLT32\texit-0x4\n"
            "0000000000000040 <ncdp::f()>:\n"
            "  48:\tcall   1030 <abort@plt>\n"
            "  4d:\tjmp    1040 <_exit@plt>\n"
            "0000000000000080 <ncdp::g()>:\n"
            "\t\t\t84: R_X86_64_PLT32\tatexit-0x4\n"
            "\t\t\t94: R_X86_64_PLT32\t__cxa_guard_abort-0x4\n")
    assert fatal_calls(text) == {"void ncdp::kernels::launch_x<float>(float const*)": {"exit"},
                                 "ncdp::f()": {"abort", "_exit"}}


_LAUNCHER = re.compile(r"\bncdp::kernels::launch_(?P<name>\w+)(?P<args><[^()]*>)?\(")


def test_probe_covers_every_launcher_the_objects_define():
    _require_cuda_build()
    nm = _require_tool("nm")
    defined = set()
    for obj in _require_objects():
        proc = subprocess.run([nm, "--defined-only", "--extern-only", "--demangle", str(obj)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"nm failed on {obj}: {proc.stderr}"
        for line in proc.stdout.splitlines():
            hit = _LAUNCHER.search(line)
            if hit:
                defined.add(hit.group("name") + (hit.group("args") or "").replace(" ", ""))
    probed = set(ncdp_fast._backend._C.typed_launcher_names())
    assert defined <= probed, f"launchers the probe does not cover: {sorted(defined - probed)}"
    assert probed <= defined, f"probe names that no object defines: {sorted(probed - defined)}"


def test_a_missing_native_module_is_no_import_warning_and_is_named_where_it_matters():
    """`make gpu-check` imports the package before it builds _C: the import must
    not warn (the first GPU run printed a misleading circular-import warning);
    a CUDA array is then refused naming the import error and the rebuild."""
    script = (
        "import sys, warnings\n"
        "sys.modules['ncdp_fast._C'] = None\n"      # as if it were not built
        "warnings.simplefilter('error')\n"
        "import ncdp_fast, ncdp_fast._backend as be\n"
        "assert be._C is None and not be.CUDA_COMPILED\n"
        "print(be._C_ERROR)\n"
        "print(ncdp_fast.info(print_it=False)['cpu_only'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert "ncdp_fast._C" in done.stdout and "did not import" in done.stdout
