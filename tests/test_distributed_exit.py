"""No rank aborts at exit under the real torchrun launcher (issue 27).

A process group kept alive past ``destroy_process_group`` (held by a clipper that
its hooks keep in a reference cycle, or by an exception's traceback) kept gloo's
worker threads running into interpreter shutdown, where a worker releasing the last
collective's tensors needs the GIL and the process died with "terminate called
without an active exception" (SIGABRT): before the fix, 6 of 10 torchrun runs of
the first script below aborted (and the error path aborted in the run tried).
Each run here either passes or names the rank that aborted.  With a per-run abort
rate of 0.6, four clean runs happen by chance with probability 0.4^4 = 2.6 %: the
test misses a full regression that rarely; the 50-run counts are in the report
of issue 27.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

from _distributed import torchrun  # noqa: E402

SCRIPT = Path(__file__).with_name("_ranks_script.py")


def _clean(proc):
    text = proc.stdout + proc.stderr
    assert "terminate called" not in text and "exitcode  : -6" not in text, text[-3000:]
    return text


def test_clipper_with_group_then_destroy_exits_cleanly():
    for _ in range(4):
        proc = torchrun([SCRIPT, "exit"], 2, timeout=120)
        _clean(proc)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_release_command_error_path_exits_with_its_code(tmp_path):
    """A bad argument found after the ranks' first collectives (labels outside
    --num-classes): every rank prints its one line and exits 2, none aborts."""
    g = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", g.standard_normal((16, 4)).astype(np.float32))
    np.save(tmp_path / "y.npy", g.integers(0, 3, 16))
    for i in range(2):
        proc = torchrun(["-m", "ncdp_fast.cli", "release", "--features", tmp_path / "x.npy",
                         "--labels", tmp_path / "y.npy", "--num-classes", "2", "--epsilon", "2",
                         "--delta", "1e-5", "--out", tmp_path / f"out{i}", "--quiet"], 2,
                        timeout=120, env={"NCDP_FAST_LEDGER_DIR": str(tmp_path / "ledger")})
        text = _clean(proc)
        assert proc.returncode != 0
        assert text.count("error: NeuroMixGDP.release") == 2, text[-3000:]
        assert "exitcode  : 2" in text, text[-3000:]


def test_an_optimizer_built_after_init_does_not_pin_the_group(tmp_path):
    """The group that torch itself kept alive: torch.distributed.nn.functional binds
    group.WORLD as default arguments when first imported, and the first torch.optim
    optimizer imports it.  With ncdp_fast.torch imported before init_process_group
    (as scripts do), the group is freed by destroy_process_group even though an
    optimizer is built after init.  One process, a file store: no launcher needed
    to see the reference itself."""
    import subprocess
    import sys
    script = tmp_path / "pin.py"
    script.write_text(
        "import gc, sys, weakref\n"
        "import ncdp_fast.torch  # noqa: F401\n"
        "import torch, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', "
        "rank=0, world_size=1)\n"
        "ref = weakref.ref(dist.group.WORLD)\n"
        "torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)\n"
        "dist.destroy_process_group()\n"
        "gc.collect()\n"
        "print('alive' if ref() is not None else 'freed')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "freed", proc.stdout + proc.stderr[-2000:]
