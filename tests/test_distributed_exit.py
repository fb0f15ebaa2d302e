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


def _group_after_destroy(tmp_path, before_init: str, after_init: str) -> str:
    """Run one process (a file store: no launcher needed to see the reference):
    ``before_init``, init_process_group, ``after_init``, an optimizer built,
    destroy_process_group; 'alive' if the default group outlived it, else
    'freed'."""
    import subprocess
    import sys
    script = tmp_path / "pin.py"
    script.write_text(
        "import gc, weakref\n" + before_init +
        "import torch, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', "
        "rank=0, world_size=1)\n" + after_init +
        "ref = weakref.ref(dist.group.WORLD)\n"
        "torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)\n"
        "dist.destroy_process_group()\n"
        "gc.collect()\n"
        "print('alive' if ref() is not None else 'freed')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_an_optimizer_built_after_init_does_not_pin_the_group(tmp_path):
    """The group that torch itself kept alive: torch.distributed.nn.functional binds
    group.WORLD as default arguments when first imported, and the first torch.optim
    optimizer imports it.  With ncdp_fast.torch imported before init_process_group
    (as scripts do), the group is freed by destroy_process_group even though an
    optimizer is built after init."""
    assert _group_after_destroy(tmp_path, "import ncdp_fast.torch  # noqa: F401\n", "") == \
        "freed"


LATE = Path(__file__).with_name("_late_import_script.py")


def test_a_late_import_of_the_library_exits_cleanly():
    """ncdp_fast.torch imported after init_process_group, inside main() (issue
    37): torch.distributed.nn.functional, first imported then, bound the
    group into its default arguments, and two-rank runs aborted at exit (the
    issue: 5 of 6; here, on the loaded 2-core machine, 1 of 6 with the fix
    switched off, 0 of 8 with it).  The abort is a race: the one-process test
    below is the deterministic one."""
    for _ in range(4):
        proc = torchrun([LATE], 2, timeout=120)
        _clean(proc)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.parametrize("unpinned", [True, False])
def test_a_late_import_does_not_pin_the_group(tmp_path, unpinned):
    """The reference itself, in one process: with the library imported after
    init, the group outlives destroy_process_group unless the defaults are
    unpinned (the second case switches the fix off, and must see it alive)."""
    off = "" if unpinned else (
        "import ncdp_fast.distributed._group as g; g.unpin_world_defaults = lambda: None\n")
    late = off + (
        "from ncdp_fast.torch import GhostClipper\n"
        "GhostClipper(torch.nn.Linear(3, 2), max_grad_norm=1.0, noise_multiplier=1.0, "
        "expected_batch_size=4.0, group=dist.group.WORLD)\n")
    assert _group_after_destroy(tmp_path, "", late) == ("freed" if unpinned else "alive")
