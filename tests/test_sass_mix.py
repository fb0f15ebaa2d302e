"""Issue 36: the normals' common-path instruction mix from the sm_90 SASS
(bench/sass_mix.py). The parser and the model run on fixed text; the real
compile (nvcc, and cuobjdump and nvdisasm from the wheels the Makefile
installs) checks that the device reads the float64 constants from the
__constant__ table and that the working tree issues fewer instructions for
four normals than 12eb27d, whose time the GPU measured."""
import math
import subprocess

import pytest
from conftest import bench_script

sm = bench_script("sass_mix")

# A kernel's shape: a guard exit, a rare region skipped by a predicated branch,
# a slow-path call skipped the same way, the exit, then the subroutine.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x0000 */
        /*0010*/                   ISETP.GE.AND P0, PT, R0, UR4, PT ;      /* 0x0000 */
        /*0020*/               @P0 EXIT ;                                  /* 0x0000 */
        /*0030*/                   UMOV UR6, 0x1 ;                         /* 0x0000 */
        /*0040*/               @P1 BRA 0x70 ;                              /* 0x0000 */
        /*0050*/                   I2F.F64.U32 R2, R3 ;                    /* 0x0000 */
        /*0060*/                   DADD R2, R2, 0.5 ;                      /* 0x0000 */
        /*0070*/                   DMUL R4, R2, UR6 ;                      /* 0x0000 */
        /*0080*/                   ULDC.64 UR8, c[0x3][0x8] ;              /* 0x0000 */
        /*0090*/                   DFMA R4, R4, UR8, R2 ;                  /* 0x0000 */
        /*00a0*/              @!P2 BRA P3, 0xc0 ;                          /* 0x0000 */
        /*00b0*/                   CALL.REL.NOINC 0x100 ;                  /* 0x0000 */
        /*00c0*/                   F2I.S64.F64.FLOOR R6, R4 ;              /* 0x0000 */
        /*00d0*/                   FSEL R7, R6, R5, !P0 ;                  /* 0x0000 */
        /*00e0*/                   STG.E.64 desc[UR4][R8.64], R4 ;         /* 0x0000 */
        /*00f0*/                   EXIT ;                                  /* 0x0000 */
        /*0100*/                   DFMA R4, R4, R4, R4 ;                   /* 0x0000 */
        /*0110*/                   RET.REL.NODEC R2 0x0 ;                  /* 0x0000 */
"""


def test_common_path_skips_the_branched_over_ranges_and_the_subroutine():
    assert sm.common_path(SASS) == [
        "MOV", "ISETP.GE.AND", "EXIT", "UMOV", "BRA", "DMUL", "ULDC.64", "DFMA", "BRA",
        "F2I.S64.F64.FLOOR", "FSEL", "STG.E.64", "EXIT"]


def test_mix_counts_each_class():
    m = sm.mix(sm.common_path(SASS))
    assert m == dict(instructions=13, fp64=2, conversions=1, uniform=2, umov=1, uldc=1, mufu=0,
                     integer=0, selects=1)


def test_common_path_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="no unpredicated EXIT"):
        sm.common_path(SASS.replace("                   EXIT ;", "               @P4 EXIT ;"))
    with pytest.raises(ValueError, match="not a forward jump"):
        sm.common_path(SASS.replace("@P1 BRA 0x70", "@P1 BRA 0x30"))


def test_model_bounds_are_the_pipe_cycles_over_the_sub_partitions():
    m = dict(instructions=604, fp64=210, conversions=20)
    out = sm.model(m)
    warps = 2 ** 22 / 32 / (132 * 4)          # per sub-partition, 248.2
    assert math.isclose(out["issue_bound_us"], warps * 604 / 1.98e9 * 1e6)
    assert math.isclose(out["fp64_bound_us"], warps * 2 * 210 / 1.98e9 * 1e6)
    assert math.isclose(out["conversion_bound_us"], warps * 8 * 20 / 1.98e9 * 1e6)
    assert out["bound_by"] == "issue"
    assert sm.model(dict(instructions=100, fp64=60, conversions=0))["bound_by"] == "fp64"


needs_tools = pytest.mark.skipif(
    sm.nvcc_path() is None or sm.find_cuobjdump() is None,
    reason="nvcc or cuobjdump not found (make installs nvidia-cuda-cuobjdump and -nvdisasm)")


@needs_tools
def test_the_normals_common_path_is_shorter_than_the_measured_trees(tmp_path):
    try:
        rows = sm.rows_for(sm.nvcc_path(), sm.find_cuobjdump(), sm.MEASURED["commit"])
    except subprocess.CalledProcessError as e:
        pytest.fail(f"{e.cmd[0]} failed: {e.stderr}")
    base, work = rows
    # The constants come from the table: one uniform load each, not two moves.
    assert work["umov"] < base["umov"] / 4 and work["uldc"] > base["uldc"], (base, work)
    # The quadrant's selects and the exponent trick took conversions and float64 ops out.
    assert work["conversions"] < base["conversions"] and work["fp64"] < base["fp64"], work
    assert work["instructions"] < base["instructions"], (base, work)
    assert work["predicted_us"] < base["measured_us"]
    path = sm.write(rows, str(tmp_path), sm.nvcc_path())
    text = path.with_suffix(".md").read_text()
    assert "| working tree |" in text and f"| {sm.MEASURED['commit']} |" in text
