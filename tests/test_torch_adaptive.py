"""Issue 25: clipping="adaptive" (Andrew et al. 2021 quantile clipping) with
Opacus's arguments. Each step's gradient noise is z_grad * C_t with z_grad =
(z^-2 - (2 sigma_b)^-2)^-1/2, the centered count's noise sigma_b, both from the
clipper's stream in disjoint ranges; the bound follows the geometric update;
the accountant records the user's z per step."""
import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast.torch import GhostClipper, PrivacyEngine  # noqa: E402
from ncdp_fast.torch.adaptive import AdaptiveClip  # noqa: E402
from conftest import loader_batches  # noqa: E402
from test_torch_schedulers import _per_sample_grads  # noqa: E402

EPS64 = 2.0 ** -53
Z, SIGMA_B = 1.0, 2.0
ADA = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
           min_clipbound=0.01, unclipped_num_std=SIGMA_B)


def _setup(n=24, batch=6, clipping="adaptive", max_grad_norm=1.0, seed=None,
           noise_multiplier=Z, **kw):
    """(engine, model, optimizer, the private loader's batches pass after pass,
    the dataset's x and y): each step is on the loader's next batch."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64) * \
        torch.linspace(0.1, 3.0, n, dtype=torch.float64)[:, None]
    y = torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    _setup.plain = copy.deepcopy(model)
    engine = PrivacyEngine(accountant="rdp")
    args = dict(ADA, **kw) if clipping == "adaptive" else kw
    pm, popt, ploader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, clipping=clipping,
        seed=seed, **args)
    return engine, pm, popt, loader_batches(ploader), x, y


def _step(pm, popt, batches):
    """One step on the private loader's next batch (possibly empty: a noise-only
    step), which it returns."""
    xb, yb = next(batches)
    popt.zero_grad()
    F.cross_entropy(pm(xb), yb).backward()
    popt.step()
    return xb, yb


def test_gradient_and_count_noise_are_the_streams_draws_and_the_bound_follows_the_update():
    """Each step on the private loader's next Poisson batch (q = 6/24, E = 6; its
    realized size varies, an empty batch has no per-sample gradients): lr 0, so
    the plain copy gives each batch's per-sample gradients."""
    engine, pm, popt, batches, _, _ = _setup()
    P = sum(p.numel() for p in _setup.plain.parameters())
    E = popt.expected_batch_size
    z_grad = 1.0 / math.sqrt(Z ** -2 - (2 * SIGMA_B) ** -2)
    moved = set()
    for _ in range(5):
        c = popt.max_grad_norm
        xb, yb = _step(pm, popt, batches)
        G = _per_sample_grads(_setup.plain, xb, yb) if len(xb) else \
            torch.zeros(0, P, dtype=torch.float64)
        norms = G.norm(dim=1)
        res = pm.clipper.last_result
        noisy = torch.cat([p.grad.reshape(-1) for p in pm.parameters()])
        scale = torch.clamp(c / norms, max=1.0)
        draws = torch.from_numpy(nf.gaussian(noisy.numel() + 1, seed=pm.clipper.seed,
                                             offset=res.offset, dtype=np.float64))
        noise = z_grad * c / E * draws[:-1]
        tol = 64 * EPS64 * ((G.abs() * scale[:, None]).sum(0) / E + noise.abs() + noisy.abs())
        assert ((noisy - (G * scale[:, None]).sum(0) / E - noise).abs() <= tol).all()
        # The count's one normal is the draw right after the gradient's range.
        centered = float((norms <= c).sum()) - 0.5 * len(norms)
        b = (centered + SIGMA_B * float(draws[-1])) / E + 0.5
        expect = min(max(c * math.exp(-0.2 * (b - 0.5)), 0.01), 10.0)
        assert popt.max_grad_norm == pytest.approx(expect, rel=8 * EPS64)
        moved.add(popt.max_grad_norm)
    assert len(moved) == 5
    # Accounted at the user's z, not z_grad.
    assert engine.accountant.history == [(Z, 6 / 24, 5)]


def test_epsilon_equals_a_fixed_bound_run_at_the_same_z():
    runs = []
    for clipping in ("adaptive", "flat"):
        engine, pm, popt, batches, _, _ = _setup(clipping=clipping)
        for _ in range(3):
            _step(pm, popt, batches)
        runs.append(engine.get_epsilon(1e-5))
    assert runs[0] == runs[1]


def test_bound_moves_to_the_target_quantile():
    """64 samples, the full batch each step (q = 1, E = 64), target 0.5: from a
    bound 4x the largest norm, after 100 steps the fraction of norms <= C is
    within [0.3, 0.7]. The count noise's std over E is 2/64; with the key
    fixed the run is deterministic. Each batch of the private loader (of length
    1) is the whole dataset in index order."""
    engine, pm, popt, batches, x, y = _setup(n=64, batch=64, seed=8231, max_grad_norm=1.0,
                                             max_clipbound=1e3)
    norms = _per_sample_grads(_setup.plain, x, y).norm(dim=1)
    popt.max_grad_norm = 4 * float(norms.max())
    for _ in range(100):
        xb, yb = _step(pm, popt, batches)
        assert torch.equal(xb, x) and torch.equal(yb, y)
    frac = float((norms <= popt.max_grad_norm).double().mean())
    assert 0.3 <= frac <= 0.7, (frac, popt.max_grad_norm)


@pytest.mark.filterwarnings("ignore::ncdp_fast._stream.NoiseReuseWarning")
def test_accumulated_physical_batches_count_in_the_logical_step():
    """accumulate_ (BatchMemoryManager) then privatize_ releases the count of
    the whole logical batch: the same new bound as one call over its union
    (the second run redraws the first's noise on purpose, to compare)."""
    bounds = []
    for split in (False, True):
        torch.manual_seed(3)
        lin = nn.Linear(4, 2).double()
        cl = GhostClipper(lin, max_grad_norm=1.0, noise_multiplier=Z, expected_batch_size=12,
                          loss_reduction="sum", clipping="adaptive", seed=77, offset=0,
                          adaptive=AdaptiveClip(**ADA))
        x = torch.randn(12, 4, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64) * 2
        parts = (x[:5], x[5:]) if split else (x,)
        for i, part in enumerate(parts):
            lin.zero_grad()
            lin(part).pow(2).sum().backward()
            (cl.accumulate_ if i < len(parts) - 1 else cl.privatize_)()
        bounds.append(cl.max_grad_norm)
    assert bounds[0] == bounds[1] != 1.0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=6))
def test_clipped_contribution_within_the_current_bound(scales):
    """z = 0 (no noise), one sample per step: the released gradient is that
    sample's clipped contribution, of norm <= C_t, whatever C_t has become."""
    lin = nn.Linear(3, 2).double()
    cl = GhostClipper(lin, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=1,
                      loss_reduction="sum", clipping="adaptive", adaptive=AdaptiveClip(**ADA))
    for s in scales:
        c = cl.max_grad_norm
        lin.zero_grad()
        (lin(torch.full((1, 3), s, dtype=torch.float64)).sum() * s).backward()
        cl.privatize_()
        g = torch.cat([p.grad.reshape(-1) for p in lin.parameters()])
        assert float(g.norm()) <= c * (1 + 16 * EPS64)
        assert 0.01 <= cl.max_grad_norm <= 10.0


@pytest.mark.parametrize("kw, error, match", [
    (dict(target_unclipped_quantile=1.5), ValueError,
     r"target_unclipped_quantile: expected a number in \[0, 1\], got 1.5"),
    (dict(clipbound_learning_rate=0.0), ValueError, r"clipbound_learning_rate: expected"),
    (dict(min_clipbound=-1.0), ValueError, r"min_clipbound: expected"),
    (dict(max_clipbound=0.001), ValueError, r"max_clipbound: expected >= min_clipbound"),
    (dict(unclipped_num_std=0.5), ValueError,
     r"unclipped_num_std: expected > noise_multiplier / 2 = 0.5"),
    (dict(unclipped_num_std="2"), TypeError, r"unclipped_num_std: expected"),
    (dict(noise_multiplier=math.nan), ValueError, r"noise_multiplier: expected"),
])
def test_invalid_arguments_are_refused_naming_them(kw, error, match):
    with pytest.raises(error, match=match):
        _setup(**kw)


def test_missing_or_misplaced_arguments_and_groups_are_refused():
    with pytest.raises(TypeError, match=r"clipping='adaptive' requires \['unclipped_num_std'\]"):
        _setup_missing()
    with pytest.raises(TypeError, match=r"need clipping='adaptive'"):
        _setup(clipping="flat", target_unclipped_quantile=0.5)
    with pytest.raises(ValueError, match=r"clipping: expected 'flat' or 'per_layer' with group="):
        GhostClipper._check_adaptive("adaptive", AdaptiveClip(**ADA), Z, 6.0, object())
    with pytest.raises(ValueError, match=r"adaptive: expected None with clipping='flat'"):
        GhostClipper(nn.Linear(2, 1), max_grad_norm=1.0, noise_multiplier=Z,
                     expected_batch_size=4, adaptive=AdaptiveClip(**ADA))


def _setup_missing():
    lin = nn.Linear(2, 1)
    x = torch.zeros(4, 2)
    PrivacyEngine().make_private(
        module=lin, optimizer=torch.optim.SGD(lin.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, x), batch_size=2), noise_multiplier=Z,
        max_grad_norm=1.0, clipping="adaptive",
        **{k: v for k, v in ADA.items() if k != "unclipped_num_std"})


def test_noise_multiplier_that_leaves_the_count_nothing_is_refused_unchanged():
    _, _, popt, *_ = _setup()
    with pytest.raises(ValueError, match=r"unclipped_num_std: expected > noise_multiplier / 2"):
        popt.noise_multiplier = 4.0
    assert popt.noise_multiplier == Z
    popt.noise_multiplier = 3.0
    assert popt.noise_multiplier == 3.0



def test_a_failing_bound_update_writes_no_gradient_and_records_no_step(monkeypatch):
    """The bound update (its normal drawn from the stream; on a GPU any call
    can fail, e.g. out of memory): if it raises, the step has written no
    gradient, so the accountant, never called, misses no release; the next
    step goes through."""
    engine, pm, popt, batches, _, _ = _setup(n=24, batch=24)
    before = popt.max_grad_norm

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (simulated)")

    with monkeypatch.context() as m:
        m.setattr(AdaptiveClip, "next_bound", fail)
        with pytest.raises(RuntimeError, match="simulated"):
            _step(pm, popt, batches)
    assert all(p.grad is None for p in pm.parameters())
    assert engine.accountant.history == []
    assert popt.max_grad_norm == before
    _step(pm, popt, batches)
    assert all(p.grad is not None for p in pm.parameters())
    assert engine.accountant.history == [(Z, 1.0, 1)]
    assert popt.max_grad_norm != before


def test_a_count_noise_that_overflows_the_update_gives_the_clamped_bound():
    """The seventh audit: unclipped_num_std=1e6 made math.exp overflow in the
    bound's update, after the count's normal was drawn (the step raised
    OverflowError).  Past exp's range the bound is the clamp either way."""
    ada = AdaptiveClip(**dict(ADA, unclipped_num_std=1e6))
    stream = nf.NoiseStream(None)
    got = set()
    for _ in range(40):     # both clamps unseen: probability 2 * 0.51^40 < 1e-11
        z = float(nf.gaussian(1, seed=stream.seed, offset=stream.position, dtype=np.float64)[0])
        c = ada.next_bound(0.0, 1.0, 6.0, stream)
        # x = -0.2 * 1e6 z / 6: past +-709 for |z| > 0.0213.
        if abs(z) > 0.03:
            assert c == (ADA["max_clipbound"] if z < 0 else ADA["min_clipbound"])
            got.add(c)
    assert got == {ADA["max_clipbound"], ADA["min_clipbound"]}
