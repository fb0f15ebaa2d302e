"""Issue 25: Opacus's schedulers on the torch drop-in. A grad-clip scheduler
sets ``optimizer.max_grad_norm``: later steps clip at the new C and draw noise
of std sigma * C (each step stays a Gaussian mechanism of multiplier sigma, the
accountant unchanged). save_checkpoint / load_checkpoint carry the schedulers'
states under Opacus's keys, and a resumed scheduled run equals the
uninterrupted one."""
import copy
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast import _stream  # noqa: E402
from ncdp_fast.torch import PrivacyEngine  # noqa: E402
from conftest import in_new_process, loader_batches  # noqa: E402
from test_torch_checkpoint import DELTA, SEED, _refused, _train, _training  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")

N, BATCH, SIGMA = 24, 6, 1.0
EPS64 = 2.0 ** -53


def _setup(clipping="flat", max_grad_norm=1.0):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    _setup.plain = copy.deepcopy(model)         # the same weights, without the clipper
    engine = PrivacyEngine(accountant="rdp")
    pm, popt, ploader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=BATCH),
        noise_multiplier=SIGMA, max_grad_norm=max_grad_norm, clipping=clipping)
    # A step is taken on the private loader's next batch only (DPOptimizer.step).
    return engine, pm, popt, loader_batches(ploader)


def _per_sample_grads(model, x, y):
    """(B, P) float64: each sample's gradient, one backward per sample, no clipper."""
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    if not rows:                                # an empty Poisson batch: (0, P)
        return torch.zeros(0, sum(p.numel() for p in model.parameters()),
                           dtype=torch.float64)
    return torch.stack(rows)


def test_set_max_grad_norm_clips_and_noises_at_the_new_bound():
    """After optimizer.max_grad_norm = C, the step's gradient equals the sum of
    the per-sample gradients each scaled to norm <= C, plus the stream's
    reference draws times sigma * C / E; the accountant records sigma only."""
    engine, pm, popt, batches = _setup()
    ref = _setup.plain                          # lr 0: the parameters never move
    E = popt.expected_batch_size
    seen = []
    for c in (1.0, 0.05, 0.3, 4.0):
        xb, yb = next(batches)
        G = _per_sample_grads(ref, xb, yb)
        norms = G.norm(dim=1)
        seen.append(norms)
        popt.max_grad_norm = c
        assert popt.max_grad_norm == pm.clipper.max_grad_norm == c
        popt.zero_grad()
        F.cross_entropy(pm(xb), yb).backward()
        popt.step()
        res = pm.clipper.last_result
        noisy = torch.cat([p.grad.reshape(-1) for p in pm.parameters()])
        scale = torch.clamp(c / norms, max=1.0)
        clipped = G * scale[:, None]
        # Each clipped contribution is within the new bound (up to its rounding).
        assert (clipped.norm(dim=1) <= c * (1 + 8 * EPS64)).all()
        noise = SIGMA * c / E * torch.from_numpy(
            nf.gaussian(noisy.numel(), seed=pm.clipper.seed, offset=res.offset,
                        dtype=np.float64))
        # The two sides compute each per-sample gradient by different float64
        # paths (ghost norms vs. one backward per sample): a few dozen roundings
        # of each term, bounded by 64 ulps of the sum of absolute terms.
        tol = 64 * EPS64 * ((G.abs() * scale[:, None]).sum(0) / E + noise.abs() + noisy.abs())
        assert ((noisy - clipped.sum(0) / E - noise).abs() <= tol).all()
    norms = torch.cat(seen)
    assert (norms > 0.05).all() and (norms < 4.0).all()    # the bounds were binding, then not
    assert engine.accountant.history == [(SIGMA, BATCH / N, 4)]


@pytest.mark.parametrize("value, error, match", [
    (-1.0, ValueError, r"max_grad_norm: expected a finite number > 0, got -1.0"),
    (0.0, ValueError, r"max_grad_norm: expected a finite number > 0, got 0.0"),
    (math.nan, ValueError, r"max_grad_norm: expected a real number, got nan"),
    (math.inf, ValueError, r"max_grad_norm: expected a finite number > 0, got inf"),
    (1e200, ValueError, r"noise_multiplier: 1.0 \* max_grad_norm 1e\+200 is too large"),
    ("2", TypeError, r"max_grad_norm: expected"),
])
def test_bad_max_grad_norm_is_refused_and_changes_nothing(value, error, match):
    _, pm, popt, _ = _setup()
    with pytest.raises(error, match=match):
        popt.max_grad_norm = value
    with pytest.raises(error, match=match):
        pm.clipper.max_grad_norm = value
    assert popt.max_grad_norm == 1.0


def test_fused_optimizer_max_grad_norm_is_checked_and_clips_at_the_new_bound():
    """FusedDPOptimizer shares the setter: checked (before, any value was
    stored), and the next step clips at it."""
    from ncdp_fast.torch import FusedDPOptimizer
    lin = nn.Linear(3, 1, bias=False).double()
    opt = FusedDPOptimizer(torch.optim.SGD(lin.parameters(), lr=0.0), noise_multiplier=0.0,
                           max_grad_norm=1.0, expected_batch_size=None, loss_reduction="sum")
    with pytest.raises(ValueError, match=r"max_grad_norm: expected a finite number > 0, "
                                         r"got -2.0"):
        opt.max_grad_norm = -2.0
    opt.max_grad_norm = 0.25
    lin.weight.grad_sample = torch.tensor([[[3.0, 0.0, 4.0]], [[0.0, 0.1, 0.0]]],
                                          dtype=torch.float64)
    opt.step()
    # Norms 5 and 0.1: the second kept whole, the first scaled to norm 0.25, never
    # above it (the factor's rounding margin: about 1e-15 relative plus a few
    # float64 roundings, under 64 ulps).
    first = lin.weight.grad[0] - torch.tensor([0.0, 0.1, 0.0], dtype=torch.float64)
    assert first[1] == 0 and 0.25 * (1 - 64 * EPS64) <= first.norm() <= 0.25
    assert abs(first[0] / first[2] - 0.75) <= 4 * EPS64


def test_max_grad_norm_change_with_per_layer_clipping_is_refused():
    _, pm, popt, _ = _setup(clipping="per_layer", max_grad_norm=[0.5, 0.5, 0.5, 0.5])
    before = pm.clipper.max_grad_norm
    popt.max_grad_norm = before             # unchanged: allowed (a scheduler's first step)
    with pytest.raises(ValueError, match=r"max_grad_norm: expected 1.0 \(fixed with "
                                         r"clipping='per_layer'.*needs clipping='flat'"):
        popt.max_grad_norm = 0.5
    assert pm.clipper.max_grad_norm == before and pm.clipper.layer_norms == [0.5] * 4
    # Across ranks (group=): tests/test_torch_api.py, with noise_multiplier's test.


def test_max_grad_norm_change_inside_a_logical_batch_is_refused():
    """A physical batch accumulated (BatchMemoryManager's skipped step) was
    clipped at the old bound; the logical step's noise must cover it."""
    _, pm, popt, batches = _setup()
    xb, yb = next(batches)
    F.cross_entropy(pm(xb), yb).backward()
    pm.clipper.accumulate_(popt.original_optimizer)
    popt.max_grad_norm = 1.0                # unchanged: allowed
    with pytest.raises(ValueError, match=r"max_grad_norm: expected 1.0 until the logical "
                                         r"batch's step .* got 0.5"):
        popt.max_grad_norm = 0.5
    assert popt.max_grad_norm == 1.0
    pm.clipper.discard_accumulated()
    popt.max_grad_norm = 0.5
    assert popt.max_grad_norm == 0.5


def test_opacus_grad_clip_schedulers_set_the_bound():
    schedulers = pytest.importorskip("opacus.schedulers")
    for make, expected in (
            (lambda o: schedulers.StepGradClip(o, step_size=2, gamma=0.5), [1.0, 0.5, 0.5]),
            (lambda o: schedulers.ExponentialGradClip(o, gamma=0.5), [0.5, 0.25, 0.125]),
            (lambda o: schedulers.LambdaGradClip(o, scheduler_function=lambda e: e + 1),
             [2.0, 3.0, 4.0])):
        _, pm, popt, _ = _setup()
        sched = make(popt)
        got = []
        for _ in expected:
            sched.step()
            got.append(pm.clipper.max_grad_norm)
        assert got == expected


# ------------------------------------------------------------------ checkpoints
def _noise_factor(epoch):
    """LambdaNoise's function (module level: the resumed process builds it too)."""
    return 0.5 ** epoch


def _schedulers(popt):
    schedulers = pytest.importorskip("opacus.schedulers")
    return (schedulers.LambdaNoise(popt, noise_lambda=_noise_factor),
            schedulers.StepGradClip(popt, step_size=1, gamma=0.5))


def _epochs(pm, popt, ploader, scheds, steps_each):
    """Opacus's loop: the schedulers step after each epoch (4 steps a pass)."""
    for steps in steps_each:
        _train(pm, popt, ploader, steps)
        for s in scheds:
            s.step()


def _resume_scheduled(path, out):
    engine, pm, popt, ploader = _training(seed=None)
    scheds = _schedulers(popt)
    engine.load_checkpoint(path=path, module=pm, optimizer=popt, noise_scheduler=scheds[0],
                           grad_clip_scheduler=scheds[1])
    _epochs(pm, popt, ploader, scheds, [2, 4])
    torch.save({"eps": engine.get_epsilon(DELTA), "history": [tuple(e) for e in engine.accountant.history],
                "bounds": [popt.noise_multiplier, popt.max_grad_norm],
                "params": [p.detach().clone() for p in pm.parameters()]}, out)


def test_resume_with_schedulers_in_a_new_process_matches_the_uninterrupted_run(tmp_path):
    """One epoch, the schedulers step (sigma 0.5, C 0.5: not make_private's),
    two more steps, checkpoint; a new process loads it with its schedulers and
    finishes three epochs: epsilon, history, sigma, C and parameters equal
    those of the uninterrupted run."""
    engine, pm, popt, ploader = _training(SEED)
    scheds = _schedulers(popt)
    _epochs(pm, popt, ploader, scheds, [4])
    _train(pm, popt, ploader, 2)
    assert (popt.noise_multiplier, popt.max_grad_norm) == (0.5, 0.5)
    path, out = tmp_path / "ckpt.pt", tmp_path / "out.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt, noise_scheduler=scheds[0],
                           grad_clip_scheduler=scheds[1])
    saved = torch.load(path, weights_only=True)
    assert saved["noise_scheduler_state_dict"] == {"base_noise_multiplier": 1.0,
                                                   "last_epoch": 1}
    assert saved["grad_clip_scheduler_state_dict"] == {"step_size": 1, "gamma": 0.5,
                                                       "last_epoch": 1}
    in_new_process("test_torch_schedulers", "_resume_scheduled", path, out)
    _stream._LEDGER.clear()                       # the uninterrupted run, as its own process
    engine_u, pm_u, popt_u, ploader_u = _training(SEED)
    _epochs(pm_u, popt_u, ploader_u, _schedulers(popt_u), [4, 4, 4])
    resumed = torch.load(out, weights_only=True)
    assert resumed["history"] == engine_u.accountant.history == [
        (1.0, 0.25, 4), (0.5, 0.25, 4), (0.25, 0.25, 4)]
    assert resumed["eps"] == engine_u.get_epsilon(DELTA)
    assert resumed["bounds"] == [popt_u.noise_multiplier, popt_u.max_grad_norm] == [0.125, 0.125]
    for a, b in zip(resumed["params"], pm_u.parameters()):
        assert torch.equal(a, b.detach())


def test_scheduler_without_its_state_or_state_without_its_scheduler_is_refused(tmp_path):
    engine, pm, popt, ploader = _training(SEED)
    scheds = _schedulers(popt)
    _epochs(pm, popt, ploader, scheds, [4])
    with_s, without = tmp_path / "s.pt", tmp_path / "n.pt"
    engine.save_checkpoint(path=with_s, module=pm, optimizer=popt, noise_scheduler=scheds[0],
                           grad_clip_scheduler=scheds[1])
    engine.save_checkpoint(path=without, module=pm, optimizer=popt)
    _stream._LEDGER.clear()
    # The schedule's sigma (0.5) would be replaced by make_private's (1.0), unseen.
    e, m, o, _ = _training(None)
    _refused(e, m, o, with_s, ValueError, r"noise_scheduler: expected the run's scheduler, "
             r"since .* holds its state 'noise_scheduler_state_dict', got None")
    assert o.noise_multiplier == 1.0
    # Without a stored state, neither the scheduler's position nor sigma is known.
    e, m, o, _ = _training(None)
    s = _schedulers(o)
    _refused(e, m, o, without, ValueError, r"noise_scheduler: expected None, since .* holds "
             r"no 'noise_scheduler_state_dict'", noise_scheduler=s[0])
    _refused(e, m, o, without, ValueError, r"noise_multiplier: the checkpoint was taken with "
             r"noise_multiplier=0.5, this run has 1.0")
    # A scheduler of another optimizer.
    e, m, o, _ = _training(None)
    other = _schedulers(_training(None)[2])
    _refused(e, m, o, with_s, ValueError, r"noise_scheduler: expected a scheduler of the "
             r"DPOptimizer make_private returned", noise_scheduler=other[0],
             grad_clip_scheduler=other[1])
    with pytest.raises(TypeError, match=r"grad_clip_scheduler: expected a scheduler with "
                                        r"state_dict\(\)"):
        engine.save_checkpoint(path=without, module=pm, grad_clip_scheduler=object())


def test_scheduled_sigma_and_bound_are_restored_together(tmp_path):
    """Scheduled to sigma 1 and C 1e60 from make_private's 1e100 and 1: set one
    at a time on load, C first would meet sigma 1e100 (a noise std of 1e160,
    refused) after the module was written; both are checked, then set."""
    engine, pm, popt, _ = _training(SEED, noise_multiplier=1e100)
    scheds = _schedulers(popt)
    popt.noise_multiplier = 1.0
    popt.max_grad_norm = 1e60
    path = tmp_path / "c.pt"
    engine.save_checkpoint(path=path, module=pm, optimizer=popt, noise_scheduler=scheds[0],
                           grad_clip_scheduler=scheds[1])
    _stream._LEDGER.clear()
    e, m, o, _ = _training(None, noise_multiplier=1e100)
    s = _schedulers(o)
    e.load_checkpoint(path=path, module=m, optimizer=o, noise_scheduler=s[0],
                      grad_clip_scheduler=s[1])
    assert (o.noise_multiplier, o.max_grad_norm) == (1.0, 1e60)
