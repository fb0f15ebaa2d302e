"""Host (g++) builds of csrc headers for bitwise checks against the reference."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def build(source: str, directory: Path, *flags: str) -> Path:
    """Compile ``source`` (a C++17 program including csrc headers) in ``directory``
    with the default x86-64 target (no FMA instructions, like the extension's host
    code); skips the test when g++ is absent.  Returns the executable."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    (directory / "driver.cpp").write_text(source)
    exe = directory / "driver"
    subprocess.run([gxx, "-std=c++17", *flags, "-I", str(CSRC), str(directory / "driver.cpp"),
                    "-o", str(exe)], check=True, capture_output=True)
    return exe
