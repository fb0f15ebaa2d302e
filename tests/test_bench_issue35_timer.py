"""bench/_common.py's Issue35Timer (bench_hf's and bench_finetune's
"issue-35 checks" column): it times the checks where they run, charges the
torch-function mode's pass-through per call, and takes its own wrappers'
time out per call, both measured in the process."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# Appended, not prepended: bench/conftest.py must not shadow tests/conftest.py
# for the gloo ranks other tests spawn (they inherit this sys.path).
sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))
from _common import Issue35Timer  # noqa: E402

from ncdp_fast.torch import GhostClipper, loss_watch, tree  # noqa: E402


def test_the_timer_counts_the_checks_and_takes_its_own_time_out():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=6, seed=0)
    plain_check = tree.ModelSnapshot.__dict__["check"]
    timer = Issue35Timer().install()
    try:
        assert tree.ModelSnapshot.__dict__["check"] is not plain_check
        # The wrapper's own time a call: positive, and far below a check's.
        assert 0.0 < timer.per_timed_call < 50e-6
        assert timer.seconds == 0.0 and timer.timed_calls == 0    # the probe put back

        def step():
            torch.nn.functional.cross_entropy(model(x), y).backward()
            clipper.privatize_()
        counted = timer.counted(step)
        for _ in range(3):
            counted()
        assert timer.steps == 2                 # the first call left out
        # Per step: the tree check, two layouts and sources, their gradients'
        # requirements, and the loss check's arm, backward, settle and clears.
        assert timer.timed_calls >= 2 * 8
        got = timer.ms_per_step()
        raw = 1e3 * (timer.seconds + timer.calls * timer.per_call) / timer.steps
        assert 0.0 < got < raw
        assert raw - got == pytest.approx(1e3 * timer.timed_calls * timer.per_timed_call
                                          / timer.steps, rel=1e-9)
    finally:
        timer.remove()
        clipper.remove()
    assert tree.ModelSnapshot.__dict__["check"] is plain_check
    assert "counted" not in repr(loss_watch._Catch.__dict__["__torch_function__"])
