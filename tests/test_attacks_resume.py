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


# ------------------------------------- the fifth audit (2026-12-02): reuse unseen

def test_a_second_continuation_in_the_same_process_warns_under_an_os_key(tmp_path):
    """Run A (key from the OS) checkpoints at step 3 and goes on to step 4
    with no later checkpoint; run B, in the same process, loads that
    checkpoint and takes step 4 (one record changed): both drew step 4's
    noise at one offset, and the two releases differed by the changed
    record's clipped contributions alone (residual 3e-8 against a noise std
    of 0.2), with no warning -- the in-process ledger kept explicit keys
    only.  Every key's draws are recorded now: B's step warns."""
    engine, pm, popt, ploader = _training(seed=None)
    path = tmp_path / "ckpt.pt"
    for i, (x, y) in enumerate(ploader):      # one pass: steps 1-4, the checkpoint after 3
        popt.zero_grad()
        F.cross_entropy(pm(x), y).backward()
        popt.step()
        if i == 2:
            engine.save_checkpoint(path=path, module=pm, optimizer=popt)
    first = pm.clipper.last_result.offset
    engine2, pm2, popt2, ploader2 = _load(path)
    with pytest.warns(NoiseReuseWarning, match=r"already used in this process .*a checkpoint's "
                                               r"stream continued twice"):
        _train(pm2, popt2, ploader2, 1)
    assert pm2.clipper.last_result.offset == first


@pytest.mark.parametrize("how", ["a second optimizer", "a rollback"])
def test_a_fused_optimizer_state_continued_twice_warns_under_an_os_key(how):
    """FusedDPOptimizer with its key from the OS: its state_dict after 2 steps,
    2 more steps, then the state loaded into a second optimizer, or back into
    the same one, repeated the noise of steps 3-4 silently (with an explicit
    seed it warned).  Both warn now."""
    from ncdp_fast.torch import FusedDPOptimizer

    def make():
        p = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
        return p, FusedDPOptimizer(torch.optim.SGD([p], lr=1.0), noise_multiplier=1.0,
                                   max_grad_norm=1.0, expected_batch_size=None,
                                   loss_reduction="sum")

    def step(p, opt):
        p.grad_sample = torch.zeros(2, 5, dtype=torch.float64)    # p.grad: the noise alone
        opt.step()
        return p.grad.detach().clone()

    p, opt = make()
    for _ in range(2):
        step(p, opt)
    state = opt.state_dict()
    later = step(p, opt)
    if how == "a rollback":
        p2, opt2 = p, opt
        opt2.load_state_dict(state)
    else:
        p2, opt2 = make()
        opt2.load_state_dict(state)
    with pytest.warns(NoiseReuseWarning, match="already used in this process"):
        again = step(p2, opt2)
    assert torch.equal(again, later)        # what the warning is about


def test_a_new_run_with_the_seed_of_a_checkpointed_run_warns(tmp_path):
    """A run with an explicit seed writes a checkpoint (the key ledger records
    its draws); a new run with the same seed -- redone, or resumed
    Opacus-style from the model's and optimizer's state dicts without the
    noise state -- started at draw 0 again, silently, while the accountant
    counted its steps as new ones.  Its first draw now meets the ledger's
    record and warns, naming it; a resume through load_checkpoint does not."""
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 3)
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=pm, optimizer=popt)
    # A new process: nothing drawn, no key's ledger read yet.
    _stream._LEDGER.clear()
    _stream._LEDGER.disk_checked.clear()
    engine2, pm2, popt2, ploader2 = _training(SEED)
    with pytest.warns(NoiseReuseWarning, match=r"used by an earlier run that wrote a private "
                                               r"checkpoint \(the key ledger"):
        _train(pm2, popt2, ploader2, 1)
    # The run resumed through its checkpoint continues the stream: no warning.
    _stream._LEDGER.clear()
    _stream._LEDGER.disk_checked.clear()
    engine3, pm3, popt3, ploader3 = _load(tmp_path / "ckpt.pt")
    _train(pm3, popt3, ploader3, 1)


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_an_accountant_resumed_without_its_stream_is_refused_under_an_explicit_seed(
        with_optimizer):
    """Opacus-style resume of the model's and the accountant's states only, in
    a new process with the same explicit seed: the stream restarted at the
    first run's draws (offsets 4, 19, 34, 49 drawn again; nothing warned: the
    eighth audit).  The step is refused before it draws; with the optimizer's
    state loaded after the accountant's (it carries the stream) the run goes
    on; with seed=None the key is new and nothing repeats."""
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 4)
    model_state = {k: v.clone() for k, v in pm.state_dict().items()}
    states = engine.accountant.state_dict(), popt.state_dict()
    # (the optimizer's state carries SEED's stream: loaded once only)
    for seed in (SEED,) if with_optimizer else (SEED, None):
        _stream._LEDGER.clear()                 # as in a new process
        engine, pm, popt, ploader = _training(seed)
        pm.load_state_dict(model_state)
        engine.accountant.load_state_dict(states[0])
        if with_optimizer:
            popt.load_state_dict(states[1])
        x, y = next(iter(ploader))
        offset = pm.clipper.offset
        popt.zero_grad()
        F.cross_entropy(pm(x), y).backward()
        if seed is not None and not with_optimizer:
            with pytest.raises(RuntimeError, match=r"accountant's history was loaded with 4 "
                                                   r"step\(s\) but the noise stream, keyed by "
                                                   r"an explicit seed, has released 0"):
                popt.step()
            assert engine.accountant.total_steps == 4 and pm.clipper.offset == offset
        else:
            popt.step()
            assert engine.accountant.total_steps == 5
