"""Resume of a private run (issue 23, item 6): PrivacyEngine.save_checkpoint /
load_checkpoint carry the accountant's history, the one stream the loader and
the noise draw from, the loader's pass and the states, so that a run resumed
in a new process reports the epsilon of the uninterrupted run and reaches its
parameters.  Before: epsilon restarted from zero (2.85 reported for 3.59)."""
import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from conftest import in_new_process  # noqa: E402
from ncdp_fast import _stream, privacy  # noqa: E402
from ncdp_fast.torch import PrivacyEngine  # noqa: E402

SEED = 8231     # the tests' own key, so that the uninterrupted run can be redone
DELTA = 1e-5


def _training(seed, accountant="prv", noise_multiplier=1.0):
    """20 samples in passes of 4 Poisson batches (q = 1/4), a linear model,
    SGD with momentum (optimizer state that must be restored too)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 4, generator=g), torch.randint(0, 3, (20,), generator=g)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = PrivacyEngine(accountant=accountant)
    pm, popt, ploader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=5),
        noise_multiplier=noise_multiplier, max_grad_norm=1.0, seed=seed)
    return engine, pm, popt, ploader


def _train(pm, popt, ploader, steps):
    """Opacus's loop, over passes, stopping after ``steps`` private steps
    (mid-pass when steps is not a multiple of 4)."""
    taken = 0
    while taken < steps:
        for x, y in ploader:
            popt.zero_grad()
            F.cross_entropy(pm(x), y).backward()
            popt.step()
            taken += 1
            if taken == steps:
                return


def _resume(path, out, steps):
    """The resumed run, as a new process runs it: a fresh engine with an OS key
    (the checkpoint's key replaces it), load, train on."""
    engine, pm, popt, ploader = _training(seed=None)
    extra = engine.load_checkpoint(path=path, module=pm, optimizer=popt)
    _train(pm, popt, ploader, int(steps))
    torch.save({"eps": engine.get_epsilon(DELTA), "epoch": extra["epoch"],
                "params": [p.detach().clone() for p in pm.parameters()]}, out)


def test_resume_in_a_new_process_matches_the_uninterrupted_run(tmp_path):
    """6 steps, checkpoint, a new process loads it and takes 5 more: epsilon
    and parameters equal those of 11 uninterrupted steps (both checkpoint and
    end fall mid-pass, so the loader's pass is resumed too)."""
    k, n = 6, 11
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, k)
    path, out = tmp_path / "ckpt.pt", tmp_path / "out.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt, checkpoint_dict={"epoch": 1})
    in_new_process("test_torch_checkpoint", "_resume", path, out, n - k)
    _stream._LEDGER.clear()                       # the uninterrupted run, as its own process
    engine_u, pm_u, popt_u, ploader_u = _training(SEED)
    _train(pm_u, popt_u, ploader_u, n)
    resumed = torch.load(out, weights_only=True)
    assert resumed["epoch"] == 1
    assert engine_u.accountant.total_steps == n
    assert resumed["eps"] == engine_u.get_epsilon(DELTA) > engine.get_epsilon(DELTA) > 0
    for a, b in zip(resumed["params"], pm_u.parameters()):
        assert torch.equal(a, b.detach())


def test_resume_at_a_pass_boundary_draws_the_next_pass_fresh(tmp_path):
    """A checkpoint after a whole pass: the resumed loader draws the next pass
    from the stream's position, as the uninterrupted loader does (same process:
    the ledger then knows the range, and must not see it drawn twice)."""
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 4)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=pm, optimizer=popt)
    ref = [b.tolist() for b in [*ploader.batch_sampler._pass(20)]]     # the next pass
    _stream._LEDGER.clear()
    engine2, pm2, popt2, ploader2 = _training(None)
    engine2.load_checkpoint(path=tmp_path / "c.pt", module=pm2, optimizer=popt2)
    assert list(ploader2.batch_sampler) == ref


def _refused(engine, pm, popt, path, error, match, **kw):
    """The refusal is raised, and nothing was written: parameters, accountant
    and stream are those of before the call."""
    before = [p.detach().clone() for p in pm.parameters()]
    offset, events = pm.clipper.offset, engine.accountant.history
    with pytest.raises(error, match=match):
        engine.load_checkpoint(path=path, module=pm, optimizer=popt, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, pm.parameters()))
    assert (pm.clipper.offset, engine.accountant.history) == (offset, events)


def test_mismatched_or_misplaced_loads_are_refused_and_write_nothing(tmp_path):
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 2)
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt)
    _stream._LEDGER.clear()
    # Another accountant kind: epsilon would be answered by another method.
    _refused(*_training(None, accountant="rdp")[:3], path, ValueError,
             r"accountant: the checkpoint was written by an engine with accountant='prv'")
    # Another noise: the history's sigma would not be this run's.
    _refused(*_training(None, noise_multiplier=2.0)[:3], path, ValueError,
             r"noise_multiplier: the checkpoint was taken with noise_multiplier=1.0, this run "
             r"has 2.0")
    # An engine that already stepped: its steps would vanish from the accountant.
    e, m, o, loader = _training(None)
    _train(m, o, loader, 1)
    _refused(e, m, o, path, RuntimeError, r"already took 1 private step")
    # A file without the engine's entry (an Opacus-style checkpoint).
    torch.save({"module_state_dict": pm.state_dict()}, tmp_path / "opacus.pt")
    _refused(*_training(None)[:3], tmp_path / "opacus.pt", ValueError,
             r"path: expected a checkpoint written by PrivacyEngine.save_checkpoint")
    _refused(*_training(None)[:3], path, TypeError, r"noise_scheduler: expected a scheduler with",
             noise_scheduler=object())
    # Another kind of optimizer (the fifth audit: a bare KeyError after the
    # module's weights were written): refused by name, nothing written.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 4, generator=g), torch.randint(0, 3, (20,), generator=g)
    torch.manual_seed(0)
    other = torch.nn.Linear(4, 3)
    e = PrivacyEngine()
    m, o, _ = e.make_private(module=other, optimizer=torch.optim.Adam(other.parameters()),
                             data_loader=DataLoader(TensorDataset(x, y), batch_size=5),
                             noise_multiplier=1.0, max_grad_norm=1.0)
    _refused(e, m, o, path, ValueError, r"optimizer: the state in .* does not load into this "
                                        r"Adam .*Nothing was written")
    assert o.original_optimizer.state_dict()["state"] == {}
    with pytest.raises(RuntimeError, match=r"load_checkpoint: expected an engine after "
                                           r"make_private"):
        PrivacyEngine().load_checkpoint(path=path, module=pm._module)
    e, m, o, _ = _training(None)
    with pytest.raises(ValueError, match=r"optimizer: expected the DPOptimizer make_private "
                                         r"returned or None, got SGD"):
        e.save_checkpoint(path=path, module=m, optimizer=o.original_optimizer)


def test_a_stored_optimizer_state_left_unrestored_is_said(tmp_path):
    """load_checkpoint(optimizer=None) on a checkpoint with an optimizer state
    starts the optimizer afresh (momentum here): allowed, as Opacus, but it
    was silent until 2026-12-02; now a UserWarning naming the argument."""
    engine, pm, popt, ploader = _training(seed=None)
    _train(pm, popt, ploader, 2)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=pm, optimizer=popt)
    engine, pm, popt, ploader = _training(seed=None)
    with pytest.warns(UserWarning, match=r"optimizer: .* holds an optimizer state that is not "
                                         r"restored \(optimizer=None\)"):
        engine.load_checkpoint(path=tmp_path / "c.pt", module=pm)
    assert len(engine.accountant) == 1


def test_an_optimizer_state_left_out_at_save_is_said(tmp_path):
    """save_checkpoint(optimizer=None) of a run whose optimizer holds state
    (momentum): the load had nothing to warn about, and the resumed momentum
    restarted with no word (the eighth audit: parameters 0.44 apart)."""
    engine, pm, popt, ploader = _training(seed=None)
    _train(pm, popt, ploader, 2)
    with pytest.warns(UserWarning, match=r"optimizer: not passed to save_checkpoint, so the "
                                         r"optimizer's state \(momentum"):
        engine.save_checkpoint(path=tmp_path / "c.pt", module=pm)
    engine, pm, popt, ploader = _training(seed=None)      # before any step: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine.save_checkpoint(path=tmp_path / "d.pt", module=pm)


def test_returned_entries_carry_no_key(tmp_path):
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 1)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=pm, optimizer=popt)
    _stream._LEDGER.clear()
    e, m, o, _ = _training(None)
    got = e.load_checkpoint(path=tmp_path / "c.pt", module=m, optimizer=o)
    assert str(SEED) not in repr(got) and "ncdp_engine" not in got
    assert set(got) == {"module_state_dict", "optimizer_state_dict",
                        "privacy_accountant_state_dict"}


_events = st.lists(st.one_of(
    st.tuples(st.just("g"), st.floats(0.3, 5.0), st.floats(1e-4, 1.0), st.integers(1, 50)),
    st.tuples(st.just("z"), st.floats(1e-3, 2.0), st.integers(1, 5))), max_size=6)


@settings(max_examples=40, deadline=None)
@given(_events)
def test_accountant_state_dict_round_trips_through_json(events):
    acc = privacy.Accountant()
    for e in events:
        if e[0] == "g":
            acc.step(noise_multiplier=e[1], sample_rate=e[2], steps=e[3])
        else:
            acc.add_zcdp(e[1], e[2])
    back = privacy.Accountant()
    back.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert back == acc and back.history == acc.history


def test_accountant_load_state_dict_refuses_damage_and_keeps_its_history():
    acc = privacy.Accountant().step(noise_multiplier=1.0, sample_rate=0.1, steps=3)
    state = acc.state_dict()
    state["events"][0]["steps"] = -1
    with pytest.raises(ValueError, match=r"events\[0\]\.steps"):
        acc.load_state_dict(state)
    assert acc.total_steps == 3


def test_a_resumed_pass_never_hands_out_a_batch_twice():
    """Loader workers prefetch: the sampler has handed out more batches than the
    loop stepped on.  The resumed pass starts after every batch handed out (the
    prefetched ones are skipped), so no batch is used for two steps."""
    from ncdp_fast.torch import PoissonBatchSampler
    s = PoissonBatchSampler(20, sample_rate=0.25, steps=4, seed=SEED)
    it = iter(s)
    handed = [next(it) for _ in range(3)]          # prefetched; one step taken, say
    state = s.pass_state()
    assert state["done"] == 3
    whole = handed + list(it)
    _stream._LEDGER.clear()
    resumed = PoissonBatchSampler(20, sample_rate=0.25, steps=4, seed=None)
    resumed._stream = _stream.NoiseStream(SEED, s.offset)
    resumed.resume_pass(state)
    assert list(resumed) == whole[3:]
    assert resumed.pass_state() is None            # the pass is over: the next is fresh


# Adaptive clipping (issue 25): the five arguments are stored and must match;
# the bound C_t is restored in place of make_private's C_0.
ADA = dict(target_unclipped_quantile=0.3, clipbound_learning_rate=0.5, max_clipbound=10.0,
           min_clipbound=0.01, unclipped_num_std=2.0)


def _adaptive(seed, **changes):
    """24 float64 samples in passes of 4 Poisson batches, a two-layer network,
    SGD with momentum, clipping="adaptive" starting at C_0 = 5."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (24,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine = PrivacyEngine(accountant="rdp")
    pm, popt, ploader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=6),
        noise_multiplier=1.0, max_grad_norm=5.0, clipping="adaptive", seed=seed,
        **dict(ADA, **changes))
    return engine, pm, popt, ploader


def test_adaptive_resume_continues_the_uninterrupted_run_exactly(tmp_path):
    """5 steps, checkpoint, a fresh engine (OS key, C_0 again) loads it and takes
    4 more: the bound, parameters and epsilon equal 9 uninterrupted steps."""
    k, n = 5, 9
    engine, pm, popt, ploader = _adaptive(SEED)
    _train(pm, popt, ploader, k)
    bound = popt.max_grad_norm
    assert bound != 5.0            # the bound moved: restoring it is what is tested
    path = tmp_path / "ada.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt)
    _stream._LEDGER.clear()
    engine_r, pm_r, popt_r, ploader_r = _adaptive(None)
    engine_r.load_checkpoint(path=path, module=pm_r, optimizer=popt_r)
    assert popt_r.max_grad_norm == bound
    _train(pm_r, popt_r, ploader_r, n - k)
    _stream._LEDGER.clear()
    engine_u, pm_u, popt_u, ploader_u = _adaptive(SEED)
    _train(pm_u, popt_u, ploader_u, n)
    assert popt_r.max_grad_norm == popt_u.max_grad_norm
    assert engine_r.get_epsilon(DELTA) == engine_u.get_epsilon(DELTA)
    for a, b in zip(pm_r.parameters(), pm_u.parameters()):
        assert torch.equal(a.detach(), b.detach())


def test_adaptive_resume_through_state_dicts_keeps_the_bound():
    """Opacus's way -- the model's, optimizer's (which carries the noise
    stream) and accountant's state dicts, a whole pass taken -- went back to
    the first step's bound C_0 (the fifth audit: 0.70 back to 5.0, the
    parameters diverged; epsilon did not).  The optimizer's state now holds
    the bound, and the resumed run equals the uninterrupted one."""
    engine, pm, popt, ploader = _adaptive(SEED)
    _train(pm, popt, ploader, 4)                  # one whole pass
    saved = {"m": pm._module.state_dict(), "o": popt.state_dict(),
             "a": engine.accountant.state_dict()}
    bound = popt.max_grad_norm
    assert bound != 5.0 and saved["o"]["ncdp_noise"]["clip_bound"] == bound
    _stream._LEDGER.clear()
    engine_r, pm_r, popt_r, ploader_r = _adaptive(None)
    pm_r._module.load_state_dict(saved["m"])
    engine_r.accountant.load_state_dict(saved["a"])
    popt_r.load_state_dict(saved["o"])
    assert popt_r.max_grad_norm == bound
    _train(pm_r, popt_r, ploader_r, 4)
    _stream._LEDGER.clear()
    engine_u, pm_u, popt_u, ploader_u = _adaptive(SEED)
    _train(pm_u, popt_u, ploader_u, 8)
    assert popt_r.max_grad_norm == popt_u.max_grad_norm
    assert engine_r.get_epsilon(DELTA) == engine_u.get_epsilon(DELTA)
    for a, b in zip(pm_r.parameters(), pm_u.parameters()):
        assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("name", sorted(ADA))
def test_adaptive_resume_with_other_arguments_is_refused(tmp_path, name):
    engine, pm, popt, ploader = _adaptive(SEED)
    _train(pm, popt, ploader, 2)
    path = tmp_path / "ada.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt)
    _stream._LEDGER.clear()
    other = {name: ADA[name] * 0.5 if name != "max_clipbound" else 20.0}
    _refused(*_adaptive(None, **other)[:3], path, ValueError,
             rf"adaptive: the checkpoint was taken with adaptive=.*'{name}': {ADA[name]!r}")


def test_adaptive_checkpoint_resumed_with_flat_clipping_names_the_mode(tmp_path):
    """The mode switched was reported as 'max_grad_norm ... None, this run has
    5.0' though 5.0 was passed both times (the eighth audit)."""
    engine, pm, popt, ploader = _adaptive(SEED)
    _train(pm, popt, ploader, 1)
    path = tmp_path / "ada.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt)
    _stream._LEDGER.clear()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (24,), generator=g)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    flat = PrivacyEngine(accountant="rdp")
    fm, fopt, _ = flat.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=1.0,
        max_grad_norm=5.0, seed=None)
    _refused(flat, fm, fopt, path, ValueError,
             r"adaptive: the checkpoint was taken with adaptive=\{.*\}, this run has None")


def test_adaptive_checkpoint_with_a_damaged_bound_is_refused(tmp_path):
    engine, pm, popt, ploader = _adaptive(SEED)
    _train(pm, popt, ploader, 1)
    path = tmp_path / "ada.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt)
    ckpt = torch.load(path, weights_only=True)
    ckpt["ncdp_engine"]["clip_bound"] = -1.0
    torch.save(ckpt, path)
    _stream._LEDGER.clear()
    _refused(*_adaptive(None)[:3], path, ValueError,
             r"expected the adaptive clip bound as a finite float > 0")


def _tampered(tmp_path, edit):
    """A checkpoint of 6 steps whose file is edited by ``edit(state)``."""
    engine, pm, popt, ploader = _training(SEED)
    _train(pm, popt, ploader, 6)
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt)
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    _stream._LEDGER.clear()
    return path


def _emptied_history(state):
    state["privacy_accountant_state_dict"] = privacy.Accountant().state_dict()


def _rewound_stream(state):
    state["ncdp_engine"]["noise"]["offset"] = 0


def _both_rewound(state):
    # History emptied and the stream's step count with it: the counts agree,
    # and only the integrity tag tells.
    _emptied_history(state)
    state["ncdp_engine"]["noise"]["steps"] = 0


@pytest.mark.parametrize("edit,match", [
    (_emptied_history, "the noise stream has released 6 private step.s., the accountant's "
                       "history records 0"),
    (_rewound_stream, "does not match the integrity tag"),
    (_both_rewound, "does not match the integrity tag")])
def test_a_checkpoint_whose_privacy_state_was_edited_is_refused(tmp_path, edit, match):
    """Issue 35, item 4 (attack): a checkpoint whose accountant history was
    emptied (epsilon 1.92 reported for 2.35) or whose stream position was
    rewound to 0 (noise reused) was accepted. Now refused before anything is
    written: the stream's step count is checked against the history, and an
    HMAC keyed by the run's seed covers the whole privacy state."""
    path = _tampered(tmp_path, edit)
    engine, pm, popt, ploader = _training(seed=None)
    weights = [p.detach().clone() for p in pm.parameters()]
    with pytest.raises(ValueError, match=match):
        engine.load_checkpoint(path=path, module=pm, optimizer=popt)
    assert len(engine.accountant) == 0 and pm.clipper.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, pm.parameters()))


def test_an_unedited_checkpoint_passes_its_integrity_check(tmp_path):
    path = _tampered(tmp_path, lambda state: None)
    engine, pm, popt, ploader = _training(seed=None)
    engine.load_checkpoint(path=path, module=pm, optimizer=popt)
    assert engine.accountant.total_steps == pm.clipper.steps == 6
