"""ncdp_fast.torch.PrivacyEngine (issue 16, item 2): Opacus's entry points on
book-keeping clipping, Poisson loaders and ncdp_fast's accountants."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast import privacy  # noqa: E402
from ncdp_fast.torch import (DPOptimizer, PoissonBatchSampler, PrivacyEngine,  # noqa: E402
                             PrivateModule, fix_batchnorm)
from conftest import loader_batches  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")

ACCOUNTANT = {"prv": "pld", "pld": "pld", "rdp": "rdp", "gdp": "gdp"}


def _setup(n=24, batch_size=6, seed=0, with_index=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    tensors = (x, y, torch.arange(n)) if with_index else (x, y)
    loader = DataLoader(TensorDataset(*tensors), batch_size=batch_size)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loader


def _replay(n, **kw):
    """The Poisson plan at a range the loader already drew: the process-wide
    ledger knows the range is used, and says so."""
    with pytest.warns(nf.NoiseReuseWarning):
        return nf.poisson_batches(n, **kw)


def _train(model, optimizer, loader, epochs=1, criterion=nn.CrossEntropyLoss()):
    """Opacus's tutorial loop, unchanged."""
    sizes = []
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            sizes.append(len(y))
    return sizes


def test_make_private_returns_opacus_shaped_objects_and_the_loop_runs():
    model, opt, loader = _setup()
    engine = PrivacyEngine(accountant="rdp")        # the cheapest rigorous accountant
    before = [p.detach().clone() for p in model.parameters()]
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=1.0, max_grad_norm=1.0, seed=5)
    assert isinstance(pm, PrivateModule) and isinstance(pm, nn.Module) and pm._module is model
    assert isinstance(popt, DPOptimizer) and popt.original_optimizer is opt
    assert isinstance(ploader, DataLoader) and isinstance(ploader.batch_sampler,
                                                          PoissonBatchSampler)
    assert len(ploader) == len(loader) == 4
    assert engine.sample_rate == 1 / 4 and popt.expected_batch_size == 24 / 4
    assert (popt.noise_multiplier, popt.max_grad_norm) == (1.0, 1.0)
    assert popt.param_groups is opt.param_groups
    sizes = _train(pm, popt, ploader, epochs=2)
    assert len(sizes) == 8 and pm.clipper.steps == 8
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    eps = engine.get_epsilon(1e-5)
    assert eps == privacy.epsilon_poisson_gaussian(1.0, 0.25, 8, 1e-5, "rdp")
    # grad_sample_mode="ghost": Opacus's fast-gradient-clipping 4-tuple.
    model, opt, loader = _setup()
    crit = nn.CrossEntropyLoss()
    out = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader,
                                       noise_multiplier=1.0, max_grad_norm=1.0, criterion=crit,
                                       grad_sample_mode="ghost", seed=6)
    assert len(out) == 4 and out[2].criterion is crit and isinstance(out[3], DataLoader)
    _train(out[0], out[1], out[3], criterion=out[2])
    pm.remove_hooks()


def test_poisson_loader_and_empty_batches():
    """Sample rate 1/len(loader); batches are the stream's Poisson draws; an
    empty batch comes out as empty tensors and its step is pure noise."""
    model, opt, loader = _setup(n=10, batch_size=1, with_index=True)
    engine = PrivacyEngine()
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=0.0, max_grad_norm=1.0, seed=11)
    q = engine.sample_rate
    assert q == 0.1
    start = pm.clipper.offset
    batches = [(x, y, i) for x, y, i in ploader]
    plan = _replay(10, sample_rate=q, steps=10, seed=11, offset=start)
    assert [b[2].tolist() for b in batches] == [list(r) for r in plan]
    empty = [k for k, b in enumerate(batches) if len(b[2]) == 0]
    assert empty, "seed 11 should give an empty batch (P = 0.9^10 per step)"
    x, y, _ = batches[empty[0]]
    assert x.shape == (0, 5) and x.dtype == torch.float32 and y.shape == (0,)
    # Each batch of the pass takes its step, in order (the optimizer expects
    # the loader's next batch): the empty one's step, noise 0, is zero.
    for k, (xb, yb, _) in enumerate(batches):
        popt.zero_grad()
        nn.functional.cross_entropy(pm(xb), yb).backward()
        popt.step()
        if k == empty[0]:
            assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())
            assert pm.clipper.last_result.num_clipped == 0
    # With noise: an empty step's gradient is the noise alone (std sigma C / E),
    # at the first empty batch of the second engine's loader.
    model, opt, loader = _setup(n=10, batch_size=1)
    pm, popt, ploader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=2.0,
        max_grad_norm=0.5, seed=12)
    for x, y in ploader:
        popt.zero_grad()
        nn.functional.cross_entropy(pm(x), y).backward()
        popt.step()
        if len(y) == 0:
            break
    assert len(y) == 0, "seed 12 should give an empty batch"
    res = pm.clipper.last_result
    noise = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    xi = nf.gaussian(res.draws, seed=12, offset=res.offset, dtype=np.float32)
    scale = 2.0 * 0.5 / 1.0          # E = 10 * q = 1
    np.testing.assert_allclose(noise.numpy(), scale * xi.astype(np.float64), rtol=2 ** -22,
                               atol=0)


def test_loader_draws_and_noise_share_one_stream_without_overlap():
    """Each epoch's Poisson plan takes the next ``steps`` positions of the
    engine's stream, each step's noise the next ``P`` draws: ranges are
    consecutive and disjoint, and the plan is ``poisson_batches`` at its range."""
    model, opt, loader = _setup(n=12, batch_size=4, with_index=True)
    pm, popt, ploader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, seed=21)
    P = sum(p.numel() for p in model.parameters())
    ranges = []
    for epoch in range(2):
        plan_start = pm.clipper.offset
        ranges.append(("plan", plan_start, 3))
        got = []
        for x, y, i in ploader:
            got.append(i.tolist())
            popt.zero_grad()
            nn.functional.cross_entropy(pm(x), y).backward()
            popt.step()
            res = pm.clipper.last_result
            ranges.append(("noise", res.offset, res.draws))
        plan = _replay(12, sample_rate=1 / 3, steps=3, seed=21, offset=plan_start)
        assert got == [list(r) for r in plan]
    assert [r[0] for r in ranges] == (["plan"] + ["noise"] * 3) * 2
    for (_, s0, n0), (_, s1, _) in zip(ranges, ranges[1:]):
        assert s1 == s0 + n0                     # consecutive, hence disjoint
    assert all(r[2] == P for r in ranges if r[0] == "noise")


@pytest.mark.parametrize("accountant", ["pld", "rdp", "gdp"])
def test_make_private_with_epsilon_meets_the_target(accountant):
    model, opt, loader = _setup(n=24, batch_size=6)
    engine = PrivacyEngine(accountant=accountant)
    target, delta, epochs = 3.0, 1e-5, 2
    pm, popt, ploader = engine.make_private_with_epsilon(
        module=model, optimizer=opt, data_loader=loader, target_epsilon=target,
        target_delta=delta, epochs=epochs, max_grad_norm=1.0, seed=31)
    assert engine.get_epsilon(delta) == 0.0          # no step yet
    sigma = popt.noise_multiplier
    assert sigma == privacy.calibrate_noise_multiplier(target, delta, 0.25, 8,
                                                       accountant=ACCOUNTANT[accountant])
    steps = len(_train(pm, popt, ploader, epochs=epochs))
    assert steps == 8
    eps = engine.get_epsilon(delta)
    assert eps <= target
    # calibrate_noise_multiplier's contract: epsilon >= (1 - 1e-3) target.
    assert eps >= (1 - 1e-3) * target
    assert eps == privacy.epsilon_poisson_gaussian(sigma, 0.25, steps, delta,
                                                   ACCOUNTANT[accountant])


def test_a_gdp_engine_says_at_get_epsilon_that_its_answer_is_an_approximation():
    """The seventh audit: PrivacyEngine(accountant='gdp') (Opacus's name) reported
    the CLT epsilon of Poisson-subsampled steps with no warning, 4.00 for 200
    steps whose PLD epsilon is 7.94; only the calibration warned."""
    model, opt, loader = _setup(n=24, batch_size=6)
    engine = PrivacyEngine(accountant="gdp")
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=1.0, max_grad_norm=1.0)
    _train(pm, popt, ploader, epochs=1)
    with pytest.warns(UserWarning, match=r"sample_rate=0.25 < 1 uses the central limit theorem"):
        eps = engine.get_epsilon(1e-5)
    assert eps == engine.accountant.epsilon(1e-5, "gdp")


def test_make_private_with_epsilon_on_an_engine_with_history_says_the_target_is_exceeded():
    """As Opacus, the target covers the new run's steps alone; the engine's
    epsilon composes both runs and ends above it.  Silent until 2026-12-02."""
    model, opt, loader = _setup(n=24, batch_size=6)
    engine = PrivacyEngine(accountant="rdp")
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=1.0, max_grad_norm=1.0)
    assert len(_train(pm, popt, ploader, epochs=1)) == 4
    spent = engine.get_epsilon(1e-5)
    model, opt, loader = _setup(n=24, batch_size=6)
    with pytest.warns(UserWarning, match=rf"accounted 4 step\(s\) already \(epsilon "
                                         rf"{spent:.4g} at delta 1e-05\).*above the target"):
        engine.make_private_with_epsilon(module=model, optimizer=opt, data_loader=loader,
                                         target_epsilon=3.0, target_delta=1e-5, epochs=1,
                                         max_grad_norm=1.0)


def test_get_epsilon_prv_is_the_pld_accountant_for_the_steps_taken():
    """Opacus's default accountant name "prv" is answered by the PLD accountant,
    for the steps actually taken (one epoch of a two-epoch plan)."""
    model, opt, loader = _setup(n=24, batch_size=6)
    engine = PrivacyEngine()
    assert engine.accountant_name == "prv"
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=1.3, max_grad_norm=1.0, seed=32)
    _train(pm, popt, ploader, epochs=1)
    assert engine.get_epsilon(1e-5) == privacy.epsilon_poisson_gaussian(1.3, 0.25, 4, 1e-5,
                                                                       "pld")


def test_noise_free_steps_report_infinite_epsilon():
    model, opt, loader = _setup()
    engine = PrivacyEngine()
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=0.0, max_grad_norm=1.0, seed=41)
    _train(pm, popt, ploader)
    assert engine.get_epsilon(1e-5) == float("inf")


def _make(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long)),
                        batch_size=2)
    args = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                max_grad_norm=1.0, seed=0)
    args.update(kw)
    return PrivacyEngine().make_private(**args)


def test_refusals_name_the_argument_or_module():
    lin = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="poisson_sampling: expected True"):
        _make(lin, poisson_sampling=False)
    with pytest.raises(ValueError, match="noise_generator: expected None"):
        _make(lin, noise_generator=torch.Generator())
    with pytest.raises(TypeError, match="batch_first: expected a bool"):
        _make(lin, batch_first=0)
    # A truthy string read as True for these two (the seventh audit's scan).
    for flag in ("poisson_sampling", "wrap_model"):
        with pytest.raises(TypeError, match=f"{flag}: expected a bool"):
            _make(lin, **{flag: "no"})
    with pytest.raises(ValueError, match="grad_sample_mode"):
        _make(lin, grad_sample_mode="magic")
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['foo'\]"):
        _make(lin, foo=1)
    with pytest.raises(TypeError, match="data_loader: expected a torch.utils.data.DataLoader"):
        _make(lin, data_loader=[(torch.zeros(2, 4), torch.zeros(2))])
    with pytest.raises(ValueError, match="accountant"):
        PrivacyEngine(accountant="moments")
    with pytest.raises(ValueError, match=r"'1' is BatchNorm1d.*fix_batchnorm"):
        _make(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    with pytest.raises(ValueError, match=r"'0\.1' is BatchNorm1d"):
        _make(nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))))
    fixed = fix_batchnorm(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)))
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_groups == 4
    with pytest.raises(ValueError, match=r"'1\.weight_ih_l0'.*LSTM.*register_layer"):
        _make(nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 3)))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].bias = tied[0].bias        # a tied weight is exact (test_torch_tied.py), a bias not
    with pytest.raises(ValueError, match=r"parameter '1\.bias' is shared with '0\.bias'"):
        _make(tied)
    with pytest.raises(ValueError, match=r"max_grad_norm: expected 2 bounds for "
                                         r"clipping='per_layer'.*\['0\.weight', '0\.bias'\].*got 3"):
        _make(nn.Sequential(nn.Linear(4, 3)), clipping="per_layer", max_grad_norm=[1.0] * 3)
    with pytest.raises(ValueError, match="clipping"):
        _make(nn.Sequential(nn.Linear(4, 3)), clipping="automatic")
    with pytest.raises(ValueError, match="target_epsilon"):
        PrivacyEngine().make_private_with_epsilon(
            module=lin, optimizer=torch.optim.SGD(lin.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.zeros(4, 4)), batch_size=2),
            target_epsilon=0.0, target_delta=1e-5, epochs=1, max_grad_norm=1.0)
    # A second forward before the step.
    pm, popt, _ = _make(nn.Sequential(nn.Linear(4, 3)))
    pm(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"runs forward again after a backward"):
        pm(torch.randn(2, 4))
    # per_layer with the right number of bounds works.
    pm, popt, loader = _make(nn.Sequential(nn.Linear(4, 3)), clipping="per_layer",
                             max_grad_norm=[1.0, 0.5])
    _train(pm, popt, loader)
    assert pm.clipper.max_grad_norm == pytest.approx(np.sqrt(1.25))


def test_fix_batchnorm_replaces_every_batch_norm():
    model = nn.Sequential(nn.BatchNorm1d(6), nn.Sequential(nn.Conv2d(1, 64, 1),
                                                           nn.BatchNorm2d(64, eps=1e-3)))
    fixed = fix_batchnorm(model)
    assert fixed is model
    assert isinstance(model[0], nn.GroupNorm) and model[0].num_groups == 2   # gcd(32, 6)
    gn = model[1][1]
    assert isinstance(gn, nn.GroupNorm) and (gn.num_groups, gn.num_channels, gn.eps) == \
        (32, 64, 1e-3)
    top = fix_batchnorm(nn.BatchNorm2d(3).double())
    assert isinstance(top, nn.GroupNorm) and top.weight.dtype == torch.float64
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        fix_batchnorm("resnet")


def _state_dict_run(seed=51):
    model, opt, loader = _setup(n=12, batch_size=4, seed=3)
    engine = PrivacyEngine()
    pm, popt, ploader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, seed=seed)
    return engine, model, pm, popt, ploader


def _state_dict_step(pm, popt, x, y):
    popt.zero_grad()
    nn.functional.cross_entropy(pm(x), y).backward()
    popt.step()
    return pm.clipper.last_result


def test_state_dict_round_trip_continues_the_noise_stream():
    """Two steps, a checkpoint, a fresh engine (as in a new process: the
    process-wide record of drawn ranges emptied) given the accountant's history
    and then the optimizer's state: the next step's noise is the next range of
    the same key, and so is the loader's next plan (one stream for both, as
    before the checkpoint), and epsilon is the run's."""
    from ncdp_fast import _stream
    engine, model, pm, popt, ploader = _state_dict_run()
    batches = loader_batches(ploader)
    first = [_state_dict_step(pm, popt, *next(batches)) for _ in range(2)]
    state, history = popt.state_dict(), engine.accountant.state_dict()
    assert set(state["ncdp_noise"]) == {"seed", "offset", "steps"}
    assert state["ncdp_noise"]["offset"] == first[-1].next_offset == pm.clipper.offset
    _stream._LEDGER.clear()                       # a new process
    engine2, model2, pm2, popt2, ploader2 = _state_dict_run()
    model2.load_state_dict(model.state_dict())
    engine2.accountant.load_state_dict(history)
    popt2.load_state_dict(state)
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    assert pm2.clipper.steps == 2 and pm2.clipper.offset == first[-1].next_offset
    start = pm2.clipper.offset
    batches = list(ploader2)                      # the resumed run's next epoch
    plan = _replay(12, sample_rate=1 / 3, steps=3, seed=51, offset=start)
    assert [len(b[1]) for b in batches] == [len(r) for r in plan]
    res = _state_dict_step(pm2, popt2, *batches[0])
    assert (res.seed, res.offset) == (first[0].seed, start + 3)
    assert pm2.clipper.steps == 3


def test_optimizer_state_without_the_accountant_is_refused_before_anything_is_loaded():
    """Issue 35, item 4 (attack): the optimizer's state_dict carries the noise
    stream, not the accountant's history. Loaded into a fresh engine, the stream
    continued at step 10 while the accountant restarted at 0: epsilon 2.85
    reported for 3.59 spent. Now refused, naming both counts, with the engine,
    the optimizer and the stream untouched."""
    from ncdp_fast import _stream
    engine, model, pm, popt, ploader = _state_dict_run()
    batches = loader_batches(ploader)
    for _ in range(3):
        _state_dict_step(pm, popt, *next(batches))
    state = popt.state_dict()
    _stream._LEDGER.clear()
    engine2, model2, pm2, popt2, ploader2 = _state_dict_run()
    before = (pm2.clipper.steps, pm2.clipper.offset, popt2.original_optimizer.state_dict())
    with pytest.raises(ValueError, match=r"optimizer.load_state_dict: the noise stream has "
                       r"released 3 private step\(s\), the accountant's history records 0; "
                       r"resuming would report less epsilon than was spent"):
        popt2.load_state_dict(state)
    assert (pm2.clipper.steps, pm2.clipper.offset) == before[:2]
    assert popt2.original_optimizer.state_dict() == before[2]
    assert engine2.get_epsilon(1e-5) == 0.0 or len(engine2.accountant) == 0
    # A history ahead of the stream (a rewound stream) is refused too: noise reused.
    engine3, _, _, popt3, _ = _state_dict_run()
    engine3.accountant.load_state_dict(engine.accountant.state_dict())
    engine3.accountant.step(noise_multiplier=1.0, sample_rate=1 / 3)
    with pytest.raises(ValueError, match="records 4; resuming would reuse noise"):
        popt3.load_state_dict(state)


def test_collate_with_empty_pickles_for_spawned_workers():
    """DataLoader workers started by spawn/forkserver receive the collate function
    pickled; a closure could not be (it was one before)."""
    import pickle
    from torch.utils.data import TensorDataset
    from ncdp_fast.torch import collate_with_empty
    ds = TensorDataset(torch.randn(4, 3), torch.arange(4))
    fn = pickle.loads(pickle.dumps(collate_with_empty(ds)))
    x, y = fn([])
    assert x.shape == (0, 3) and y.shape == (0,) and y.dtype == torch.int64


def test_a_step_without_noise_stays_in_the_history_and_the_state_dict():
    """The fourth audit: a step at noise_multiplier 0 (a noise scheduler that
    reached it) made get_epsilon inf but left no trace in the accountant's
    history or state_dict, so an accountant loaded from it (Opacus's resume:
    accountant.load_state_dict of the checkpoint's key) answered a finite
    epsilon.  It is recorded now, and a plain Accountant refuses the state."""
    def make():
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        data = TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
        engine = PrivacyEngine(accountant="rdp")
        pm, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=5), noise_multiplier=1.0,
            max_grad_norm=1.0, seed=1)
        return engine, pm, opt, loader

    engine, pm, opt, loader = make()
    for sigma, (x, y) in zip((1.0, 0.0, 1.0), loader):
        opt.noise_multiplier = sigma
        nn.functional.cross_entropy(pm(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert [e.noise_multiplier for e in engine.accountant.history] == [1.0, 0.0, 1.0]
    assert engine.get_epsilon(1e-5) == float("inf")
    state = engine.accountant.state_dict()
    other, *_ = make()
    other.accountant.load_state_dict(state)
    assert other.get_epsilon(1e-5) == float("inf")
    assert other.accountant.history == engine.accountant.history
    with pytest.raises(ValueError, match="unbounded: the history holds a step without noise"):
        privacy.Accountant.from_dict(state)
    with pytest.raises(ValueError, match=r"events\[1\].noise_multiplier: 0 .* not marked "
                                         "unbounded"):
        other.accountant.load_state_dict(dict(state, unbounded=False))


def test_an_optimizer_over_another_modules_parameters_is_refused():
    """make_private with an optimizer built over another module: the private
    gradients were written where it never reads them, the model never moved
    and epsilon was spent (4.21 after one pass; the eighth audit).  Refused
    before anything is built; an optimizer over part of the model is fine."""
    model, _, loader = _setup()
    other = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"optimizer: expected a torch optimizer over the "
                                         r"module's trainable parameters, got one holding "
                                         r"none of them \(2 parameter"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(
            other.parameters(), lr=0.1), data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0)
    assert not model._forward_hooks and not model._forward_pre_hooks
    first = next(iter(model.parameters()))
    PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD([first], lr=0.1),
                                 data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
