"""Issue 24: nvcc contracts ``a*b+c`` into one FMA by default, which rounds once
where the reference rounds twice; the clip rule and the sampler's log promise
bit-for-bit agreement with ncdp_fast/reference, and the normals' log, sin, cos
and finish with the numba twin, so their device code must hold no contracted
FMA. The emulation tier cannot see this (g++ on x86-64 never
fuses): this test reads the PTX nvcc emits for sm_90. It needs nvcc, not a GPU."""
import re
import struct
import subprocess
from pathlib import Path

import pytest

from ncdp_fast._gpu_check_env import nvcc_path
from ncdp_fast._numba import rng as M

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "ptx_probe" / "fma_probe.cu"
ENTRIES = ("probe_clip_bound", "probe_clip_factor", "probe_sampler_log", "probe_sampler_log1p",
           "probe_log_normal", "probe_cos_sin_2pi", "probe_finish_normal")
FMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?(fma|mad)\.[\w.]*f(32|64)\b", re.M)


def entry_bodies(ptx: str) -> dict:
    """Body text of each ``.entry`` (kernel) of a PTX module, by name."""
    bodies = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):
        start = ptx.index("{", m.end())
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(ptx[i], 0)
            if depth == 0:
                break
            i += 1
        bodies[m[1]] = ptx[start:i + 1]
    return bodies


def test_entry_bodies_finds_a_contracted_fma():
    # The parser itself: a body with an FMA, one without, and a nested block.
    ptx = (".visible .entry a(\n.param .u64 x\n)\n{\n{\n.reg .f64 %fd<2>;\n}\n"
           "fma.rn.f64 %fd1, %fd2, %fd3, %fd4;\nret;\n}\n"
           ".visible .entry b(\n)\n{\nmul.rn.f64 %fd1, %fd2, %fd3;\n"
           "@%p1 add.rn.f64 %fd1, %fd1, %fd3;\nret;\n}\n")
    bodies = entry_bodies(ptx)
    assert set(bodies) == {"a", "b"}
    assert FMA.search(bodies["a"]) and not FMA.search(bodies["b"])


NO_NVCC = pytest.mark.skipif(
    nvcc_path() is None, reason="nvcc not found (CUDACXX, PATH, /usr/local/cuda/bin): "
    "the PTX of the clip rule and the sampler log cannot be compiled")


@pytest.fixture(scope="module")
def probe_ptx(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("ptx") / "fma_probe.ptx"
    # The flags of the extension's build (CMakeLists.txt) that change code generation.
    subprocess.run([nvcc_path(), "-arch=sm_90", "-ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr",
                    f"-I{ROOT / 'csrc'}", str(PROBE), "-o", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    return out.read_text()


@NO_NVCC
def test_clip_rule_and_sampler_log_hold_no_contracted_fma(probe_ptx):
    bodies = entry_bodies(probe_ptx)
    assert set(ENTRIES) <= set(bodies), sorted(bodies)
    for name in ENTRIES:
        # The probe must have compiled the arithmetic, not folded it away.
        assert re.search(r"\b(mul|add|sub|div|fma)(\.\w+)*\.f64\b", bodies[name]), name
        fused = [m.group(0).strip() for m in FMA.finditer(bodies[name])]
        assert not fused, f"{name}: {len(fused)} contracted FMA(s) in the PTX, e.g. {fused[:3]}"


def _const_doubles(ptx: str, name: str) -> list:
    """The float64 values of a ``.const .b8`` array's initializer (little-endian bytes)."""
    m = re.search(r"\.const\s+\.align\s+8\s+\.b8\s+\w*" + name + r"\w*\[(\d+)\]\s*=\s*\{([^}]*)\}", ptx)
    assert m, f"no initialised .const array {name} in the PTX"
    raw = bytes(int(b) for b in m[2].split(","))
    assert len(raw) == int(m[1]) and len(raw) % 8 == 0
    return list(struct.unpack(f"<{len(raw) // 8}d", raw))


@NO_NVCC
def test_the_devices_constant_table_holds_the_twins_constants(probe_ptx):
    """On the device the normals' and the sampler log's float64 constants come
    from a __constant__ table (philox.cuh, RoundedConstants), the host and the
    emulated device read the constexpr literals: the table nvcc emits must hold
    the numba twin's values, bit for bit, in the struct's order, or the
    device's normals leave the twin's stream where no CPU test can see it."""
    want = [M._LN2_HI, M._LN2_LO, M._LG1, M._LG2, M._LG3, M._LG4, M._LG5, M._LG6, M._LG7,
            M._TWO_PI, M._INVPIO2, M._PIO2_1, M._PIO2_1T,
            M._S1, M._S2, M._S3, M._S4, M._S5, M._S6, M._C1, M._C2, M._C3, M._C4, M._C5, M._C6]
    got = _const_doubles(probe_ptx, "kDeviceRoundedConstants")
    assert [struct.pack("<d", x) for x in got] == [struct.pack("<d", x) for x in want]
    # And the normals' code reads it (not literals folded in by the compiler).
    body = entry_bodies(probe_ptx)["probe_cos_sin_2pi"]
    assert "ld.const.f64" in body and "kDeviceRoundedConstants" in body
