"""The fifth audit: one checkpoint continued twice.

A checkpoint holds the noise key and the stream position, so two runs resumed
from it draw the same noise for their steps: released together (two
processes resumed from one file, a rollback whose first branch was published,
a record deleted and the run redone from an earlier checkpoint) their
difference cancels the noise (the thirteenth session measured the changed
record's clipped gradient recovered exactly).  In one process the stream's
ledger warned; across processes nothing did.  Each checkpoint written now
records the draws its run used in the key ledger, each resume claims its
position there, and a position continued before gives a NoiseReuseWarning
(not a refusal: a run preempted before its next checkpoint is resumed from
the same one again, its lost continuation never released)."""
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch.nn import functional as F  # noqa: E402

from conftest import in_new_process  # noqa: E402
from ncdp_fast import NoiseReuseWarning, _stream  # noqa: E402
from test_torch_checkpoint import SEED, _train, _training  # noqa: E402

CONTINUED = "was continued before"


def _load(path):
    engine, pm, popt, ploader = _training(seed=None)
    engine.load_checkpoint(path=path, module=pm, optimizer=popt)
    return engine, pm, popt, ploader


def _resume_and_report(path, out):
    """A resumed run in a new process: the warnings the load gave, and the
    offset and gradient of the first step after it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, pm, popt, ploader = _load(path)
    x, y = next(iter(ploader))
    popt.zero_grad()
    F.cross_entropy(pm(x), y).backward()
    popt.step()
    torch.save({"warned": [str(w.message) for w in caught
                           if issubclass(w.category, NoiseReuseWarning)],
                "offset": pm.clipper.last_result.offset}, out)


def _in_new_process(path, out):
    in_new_process("test_attacks_resume", "_resume_and_report", path, out)
    return torch.load(out)


def test_one_checkpoint_resumed_in_two_processes_warns_the_second(tmp_path):
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 3)
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt)
    first = _in_new_process(path, tmp_path / "a.pt")
    second = _in_new_process(path, tmp_path / "b.pt")
    assert first["warned"] == []
    assert len(second["warned"]) == 1 and CONTINUED in second["warned"][0]
    # What the warning is about: both continuations noise their first step
    # with the same draws.
    assert first["offset"] == second["offset"]


def test_an_earlier_checkpoint_resumed_after_a_later_one_was_written_warns(tmp_path):
    """A rollback: the run went on past checkpoint a and wrote b."""
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 3)
    engine.save_checkpoint(path=tmp_path / "a.pt", module=pm, optimizer=popt)
    _train(pm, popt, ploader, 3)
    engine.save_checkpoint(path=tmp_path / "b.pt", module=pm, optimizer=popt)
    _stream._LEDGER.clear()         # as new processes: only the key ledger remains
    _load(tmp_path / "b.pt")        # the latest, continued once: no warning
    with pytest.warns(NoiseReuseWarning, match=CONTINUED):
        _load(tmp_path / "a.pt")


def test_a_preempted_run_resumed_from_its_latest_checkpoint_does_not_warn(tmp_path):
    """The run drew past its checkpoint and was lost before the next one: its
    continuation is recorded nowhere, and resuming is the ordinary case."""
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 3)
    engine.save_checkpoint(path=tmp_path / "a.pt", module=pm, optimizer=popt)
    _train(pm, popt, ploader, 2)                  # then preempted
    _stream._LEDGER.clear()
    engine2, pm2, popt2, ploader2 = _load(tmp_path / "a.pt")     # no warning (an error here)
    _train(pm2, popt2, ploader2, 2)
    # The resumed run's own later checkpoint and the optimizer's state_dict
    # record its draws without a warning to itself.
    engine2.save_checkpoint(path=tmp_path / "b.pt", module=pm2, optimizer=popt2)
    _load(tmp_path / "b.pt")


def test_an_unwritable_key_ledger_fails_the_checkpoint_by_name(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NCDP_FAST_LEDGER_DIR", str(blocker / "ledger"))
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 1)
    with pytest.raises(RuntimeError, match="key ledger .* could not be written.*"
                                           "NCDP_FAST_LEDGER_DIR"):
        engine.save_checkpoint(path=tmp_path / "a.pt", module=pm, optimizer=popt)
    assert not (tmp_path / "a.pt").exists()
