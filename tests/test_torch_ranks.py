"""DP-SGD across gloo ranks (ncdp_fast.torch.ranks) equals the one-process run."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from _distributed import spawn, spawn_outcomes  # noqa: E402
from torch import nn  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast.distributed import shard_bounds  # noqa: E402
from ncdp_fast.torch import (DistributedPoissonBatchSampler, FusedDPOptimizer,  # noqa: E402
                             GhostClipper, PoissonBatchSampler)

N, Q, STEPS = 23, 0.06, 10
# Explicit keys and offsets, one pair per reduction, so that no other test's use of
# the process-wide stream of a key can shift these runs.
SEEDS = {"mean": (0x5EED0005, 0x5EED0099), "sum": (0x5EED0006, 0x5EED0100)}
C, SIGMA = 0.5, 0.8


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    return x, y


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).double()


def _train(sampler, reduction, group=None):
    """STEPS SGD steps; returns the final parameters and the batch sizes seen."""
    x, y = _data()
    model = _model()
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=SIGMA,
                           expected_batch_size=Q * N, seed=SEEDS[reduction][1], offset=0,
                           group=group, loss_reduction=reduction)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sizes, offsets = [], []
    for idx in sampler:
        idx = torch.as_tensor(idx, dtype=torch.long)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx], reduction=reduction)
        loss.backward()
        res = clipper.privatize_()
        offsets.append((res.offset, res.draws))
        opt.step()
        opt.zero_grad()
        sizes.append(len(idx))
    return [p.detach().numpy().copy() for p in model.parameters()], sizes, offsets


def _one_process(reduction="mean"):
    sampler = PoissonBatchSampler(N, sample_rate=Q, steps=STEPS, seed=SEEDS[reduction][0],
                                  offset=0)
    return _train(sampler, reduction)


def _rank_run(rank, world, reduction):
    import torch.distributed as dist
    sampler = DistributedPoissonBatchSampler(N, sample_rate=Q, steps=STEPS,
                                             seed=SEEDS[reduction][0], offset=0,
                                             group=dist.group.WORLD)
    params, sizes, offsets = _train(sampler, reduction, group=dist.group.WORLD)
    return params, sizes, offsets, (sampler.lo, sampler.hi)


def _both_reductions(rank, world):
    return _rank_run(rank, world, "mean"), _rank_run(rank, world, "sum")


@pytest.mark.parametrize("world", [2, 3])
def test_ten_steps_equal_one_process(world):
    """Ten Poisson steps (one of them empty) of a small MLP: every rank ends with the
    one-process parameters.  Tolerance: float64, the all-reduce changes only the
    order of the sums of clipped gradients (norm <= C) per step: _rounding_bound
    (3.1e-13 for "mean", 4.2e-13 for "sum"; measured: at most 2.2e-16)."""
    ref, sizes, offsets = _one_process()
    ref_sum, _, _ = _one_process("sum")
    assert 0 in sizes, "the seeds were chosen so that one batch is empty"
    both = spawn(_both_reductions, world, timeout=90)
    for params, *_ in (b[1] for b in both):       # loss_reduction="sum"
        for a, b in zip(params, ref_sum):
            np.testing.assert_allclose(a, b, rtol=0, atol=_rounding_bound(STEPS, N, C, 0.5, 1.0))
    outs = [b[0] for b in both]
    for rank, (params, local_sizes, local_offsets, bounds) in enumerate(outs):
        assert bounds == shard_bounds(N, rank, world)
        assert local_offsets == offsets          # the same noise draws as one process
        for a, b in zip(params, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=_rounding_bound(STEPS, N, C, 0.5, Q * N))
    # the ranks' batches tile the one-process batches exactly
    assert [sum(o[1][s] for o in outs) for s in range(STEPS)] == sizes


def _checks(rank, world):
    """Several small properties in one gloo run (each spawn costs seconds)."""
    import torch.distributed as dist
    w = dist.group.WORLD
    s = DistributedPoissonBatchSampler(40, sample_rate=0.2, steps=6, seed=7, group=w)
    union = [list(b) for b in s] + [list(b) for b in s]     # two passes (epochs)
    os_seed = DistributedPoissonBatchSampler(40, sample_rate=0.3, steps=3, group=w)._stream.seed
    try:
        GhostClipper(_model(), max_grad_norm=C * (1 + rank), noise_multiplier=SIGMA,
                     expected_batch_size=4.0, seed=1, group=w)
        mismatch = "no error"
    except ValueError as exc:
        mismatch = str(exc)
    lin = nn.Linear(3, 2).double()
    clipper = GhostClipper(lin, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=4.0,
                           seed=321, offset=0, group=w)
    (lin(torch.zeros(2, 3, dtype=torch.float64)) * 0).sum().backward()
    clipper.privatize_()
    noise = torch.cat([lin.weight.grad.reshape(-1), lin.bias.grad]).numpy()
    return union, os_seed, mismatch, noise, _engine_epoch(w)


def _engine_epoch(group=None):
    """One epoch of an Opacus-style loop through PrivacyEngine (with group: each rank
    passes the full dataset's loader and trains on its shard of every batch)."""
    from torch.utils.data import DataLoader, TensorDataset
    from ncdp_fast import NoiseStream
    from ncdp_fast.torch import PrivacyEngine
    x, y = _data()
    model = _model()
    engine = PrivacyEngine(accountant="rdp")
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
        noise_multiplier=SIGMA, max_grad_norm=C, seed=NoiseStream(0x5EED0008, 0), group=group)
    sizes = []
    for xb, yb in loader:
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        sizes.append(len(xb))
    return [p.detach().numpy().copy() for p in model.parameters()], sizes, engine.get_epsilon(1e-5)


@pytest.fixture(scope="module")
def checks():
    return spawn(_checks, 3, timeout=90)


def test_sampler_union_is_the_one_process_plan(checks):
    ref = PoissonBatchSampler(40, sample_rate=0.2, steps=6, seed=7)
    expected = [list(b) for b in ref] + [list(b) for b in ref]
    for s in range(len(expected)):
        assert sorted(i for c in checks for i in c[0][s]) == expected[s]
        for r, c in enumerate(checks):
            lo, hi = shard_bounds(40, r, 3)
            assert all(lo <= i < hi for i in c[0][s])


def test_sampler_seed_from_rank0_is_shared(checks):
    assert len({c[1] for c in checks}) == 1


def test_mismatched_configuration_raises_on_every_rank(checks):
    for c in checks:
        assert "max_grad_norm" in c[2] and "rank 0" in c[2] and "rank 1" in c[2], c[2]


def test_privacy_engine_across_ranks_equals_one_process(checks):
    ref, sizes, eps = _engine_epoch()
    assert [sum(c[4][1][s] for c in checks) for s in range(len(sizes))] == sizes
    for c in checks:
        params, _, eps_rank = c[4]
        assert eps_rank == eps
        for a, b in zip(params, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_noise_slices_are_the_one_process_draws(checks):
    """A zero-gradient step is pure noise: every rank holds the one-process draws
    offset 0.. of the key, each entry drawn by the rank owning its slice."""
    ref = checks[0][3]
    for c in checks[1:]:
        np.testing.assert_array_equal(c[3], ref)
    expected = SIGMA * C / 4.0 * nf.gaussian(ref.size, seed=321, offset=0, dtype=np.float64)
    np.testing.assert_allclose(ref, expected, rtol=1e-15, atol=0)


def _fused_run(rank, world):
    """FusedDPOptimizer with per-sample gradients computed by torch.func on each
    rank's shard of one fixed batch."""
    import torch.distributed as dist
    from torch.func import functional_call, grad, vmap
    x, y = _data()
    group = dist.group.WORLD if world > 1 else None
    lo, hi = shard_bounds(N, rank, world)
    model = _model()
    opt = FusedDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.3), noise_multiplier=SIGMA,
                           max_grad_norm=C, expected_batch_size=N, seed=0x5EED0007, offset=0,
                           group=group)
    names = [n for n, _ in model.named_parameters()]

    def loss(params, xi, yi):
        out = functional_call(model, dict(zip(names, params)), (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))
    for _ in range(3):
        ps = tuple(p.detach() for p in model.parameters())
        gs = vmap(grad(loss), in_dims=(None, 0, 0))(ps, x[lo:hi], y[lo:hi])
        for p, g in zip(model.parameters(), gs):
            p.grad_sample = g
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_fused_optimizer_across_ranks_equals_one_process():
    ref = _fused_run(0, 1)
    for params in spawn(_fused_run, 2, timeout=90):
        for a, b in zip(params, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def _dies(rank, world):
    import torch.distributed as dist
    model = _model()
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=SIGMA,
                           expected_batch_size=4.0, seed=1, group=dist.group.WORLD)
    x, y = _data()
    if rank == 1:
        os._exit(3)                       # a rank that dies before the step
    nn.functional.cross_entropy(model(x[:4]), y[:4]).backward()
    clipper.privatize_()                  # waits on the dead rank: must raise, not hang
    return "stepped"


def test_dead_rank_gives_an_error_not_a_hang():
    outs = spawn_outcomes(_dies, 2, timeout=60, pg_timeout=10)
    assert outs[1].status == "died"
    assert outs[0].status == "error", outs[0]




def _rounding_bound(steps, n, c, lr, expected_batch):
    """A bound on the distance to one process after ``steps`` float64 SGD steps
    (round-off, not statistics): a step's all-reduce reorders a sum of at most n
    clipped entries of size <= c, which moves it by at most (n - 1) u n c
    (u = 2^-53); the step scales it by lr / expected_batch.  Times 3 for what
    training amplifies in 10 steps (measured at this file's shape: 2.2e-16 after
    10 steps, 5.3e-15 after 400 on 2 and 3 ranks; docs/architecture.md)."""
    return 3 * steps * (n - 1) * n * c * 2.0 ** -53 * lr / expected_batch


def test_frozen_state_is_broadcast_under_torchrun(tmp_path):
    """The real launcher, 2 ranks: the trainable layers, a frozen layer and a buffer
    are initialised differently per rank; GhostClipper(group=) starts every rank
    from rank 0's whole state (as DDP does), so the frozen layer and the buffer end
    equal to one process's bit for bit and DP-SGD matches one process.  A model
    wrapped in DDP is refused by GhostClipper and make_private alike, with or
    without group=.  A make_private step with rank 1 on a batch its loader did
    not draw is refused on both ranks together (each would otherwise be
    accounted as the Poisson batch), before any noise is drawn; so is rank 1's
    step over an L2 penalty in its loss, and ranks resuming different
    checkpoints of one run are refused together (the sixth audit)."""
    import _ranks_script as S
    from _distributed import torchrun
    assert not torch.equal(S.model(100)[1].weight, S.model(101)[1].weight)  # differ per rank
    proc = torchrun([S.__file__, "frozen", tmp_path], 2, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ref = S.train(S.model(100), PoissonBatchSampler(S.N, sample_rate=S.Q, steps=S.STEPS,
                                                    seed=S.SEED[0], offset=0))
    tol = _rounding_bound(S.STEPS, S.N, S.C, 0.5, S.Q * S.N)
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        for k, v in ref.items():
            if k.startswith("1.") or k == "0.b":       # frozen layer, buffer: copied bits
                np.testing.assert_array_equal(got[k], v, err_msg=k)
            else:
                np.testing.assert_allclose(got[k], v, rtol=0, atol=tol, err_msg=k)
        assert bool(got["wrong_batch_unmoved"]) and int(got["wrong_batch_accounted"]) == 0
        wrong = str(got["wrong_batch"])
        if rank == 1:
            assert wrong.startswith("DPOptimizer.step: expected a step on the next batch of the "
                                    "Poisson loader make_private returned"), wrong
            assert f"got a batch of {S.N}" in wrong, wrong
        else:
            assert wrong.startswith("GhostClipper: the step was refused on 1 other rank(s) of the "
                                    "2"), wrong
        penalty, resumed = str(got["penalty"]), str(got["resumed"])
        if rank == 1:
            assert "got a gradient from outside the layer's forward" in penalty, penalty
        else:
            assert penalty.startswith("GhostClipper: the step was refused on 1 other rank(s)"), \
                penalty
        assert resumed.startswith("load_checkpoint: expected the same configuration on all 2 "
                                  "ranks, got differing checkpoint"), resumed
        refusals = {k.split(":", 1)[1]: str(got[k]) for k in got.files if k.startswith("refusal:")}
        assert len(refusals) == 4, refusals
        for key, msg in refusals.items():
            who = "GhostClipper" if key.startswith("clipper") else "make_private"
            assert msg.startswith(f"{who}: module: expected the plain model, got a "
                                  "DistributedDataParallel wrapper"), (key, msg)
            assert "model.module" in msg, msg


def test_per_layer_clipping_across_ranks_under_torchrun(tmp_path):
    """The real launcher, 2 ranks, clipping="per_layer" (each parameter on its
    own bound, one clip call per parameter, each freeing its recorded tensors
    on one process): every rank exits 0 and ends where one process does,
    within the same rounding bound as the flat step."""
    import _ranks_script as S
    from _distributed import torchrun
    proc = torchrun([S.__file__, "per_layer", tmp_path], 2, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ref = S.train(S.model(100), PoissonBatchSampler(S.N, sample_rate=S.Q, steps=S.STEPS,
                                                    seed=S.SEED[0], offset=0),
                  clipping="per_layer")
    tol = _rounding_bound(S.STEPS, S.N, S.C, 0.5, S.Q * S.N)
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert sorted(got.files) == sorted(ref)
        for k, v in ref.items():
            np.testing.assert_allclose(got[k], v, rtol=0, atol=tol, err_msg=f"rank {rank} {k}")


def _one_rank_refuses(rank, world, case):
    """Each rank steps on its shard; one rank's step is refused ("outside": an
    L2 penalty on rank 1; "accumulate": rank 0 skips its step, accumulating,
    while rank 1 steps; "mixed": rank 1's layer is float64).  Returns every
    rank's message, then the parameters after a clean step taken together."""
    import torch.distributed as dist
    x, y = _data()
    model = _model()
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=6,
                           seed=0x5EED0200, offset=0, group=dist.group.WORLD)
    shard = slice(3 * rank, 3 * rank + 3)
    loss = nn.functional.cross_entropy(model(x[shard]), y[shard])
    if case == "outside" and rank == 1:
        loss = loss + 1e-3 * model[0].weight.square().sum()
    loss.backward()
    try:
        if case == "accumulate" and rank == 0:
            clipper.accumulate_()
        else:
            clipper.privatize_()
        said = None
    except Exception as e:            # noqa: BLE001 -- the test reads every rank's message
        said = f"{type(e).__name__}: {e}"
    clipper.clear()
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
    clipper.privatize_()
    return said, [p.grad.numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("case, refusing, named", [
    ("outside", 1, r"got a gradient from outside the layer's forward"),
    ("accumulate", 0, r"accumulate_ \(a skipped step, BatchMemoryManager\) with group="),
])
def test_a_step_refused_on_one_rank_is_raised_on_every_rank(case, refusing, named):
    """The sixth audit: refusals checked before the step's reduction (a
    gradient from outside a layer, a loss refused on one rank's data, an
    accumulation across ranks under Opacus's BatchMemoryManager) were raised
    on one rank only: the other waited in the reduction until the group's
    timeout, or got a raw gloo error when the first exited.  Now each rank
    raises within the test's bound, the refusing one its own reason, the others
    the count; nothing drawn, so the next step taken together goes through and
    the ranks stay equal."""
    import re
    outs = spawn_outcomes(_one_rank_refuses, 2, case, timeout=90, pg_timeout=30)
    assert all(o.status == "ok" for o in outs), [(o.status, o.error) for o in outs]
    for o in outs:
        said, grads = o.value
        if o.rank == refusing:
            assert said is not None and re.search(named, said), said
        else:
            assert said.startswith("RuntimeError: GhostClipper: the step was refused on 1 "
                                   "other rank(s) of the 2"), said
    for a, b in zip(outs[0].value[1], outs[1].value[1]):
        np.testing.assert_array_equal(a, b)


def _engine_run(group=None, seed=None):
    """A make_private run on 16 samples, 4 Poisson batches a pass."""
    from torch.utils.data import DataLoader, TensorDataset
    from ncdp_fast.torch import PrivacyEngine
    x, y = _data()
    model = _model()
    engine = PrivacyEngine(accountant="rdp")
    pm, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x[:16], y[:16]), batch_size=4),
        noise_multiplier=SIGMA, max_grad_norm=C, seed=seed, group=group)
    return engine, pm, opt, loader


def _load_on_ranks(rank, world, paths):
    import torch.distributed as dist
    engine, pm, opt, _ = _engine_run(group=dist.group.WORLD)
    try:
        engine.load_checkpoint(path=paths[rank], module=pm, optimizer=opt)
    except ValueError as e:
        return str(e), len(engine.accountant)
    return None, len(engine.accountant)


def test_ranks_loading_different_checkpoints_are_refused_together(tmp_path):
    """The sixth audit: rank 0 resumed a run's first checkpoint and rank 1 its
    second (a stale copy on one node); both went on, apart, with epsilon 11.62
    and 13.70.  Now the ranks compare an HMAC of the checkpoints' integrity
    tags before anything is written, and every rank refuses; one checkpoint
    (written by one process) loads on both."""
    engine, pm, opt, loader = _engine_run(seed=nf.NoiseStream(0x5EED0300, 0))
    for k, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        nn.functional.cross_entropy(pm(xb), yb).backward()
        opt.step()
        if k in (1, 3):
            engine.save_checkpoint(path=tmp_path / f"c{k}.pt", module=pm, optimizer=opt)
    paths = [tmp_path / "c1.pt", tmp_path / "c3.pt"]
    outs = spawn_outcomes(_load_on_ranks, 2, paths, timeout=90, pg_timeout=30)
    assert all(o.status == "ok" for o in outs), [(o.status, o.error) for o in outs]
    for o in outs:
        said, accounted = o.value
        assert said is not None and said.startswith(
            "load_checkpoint: expected the same configuration on all 2 ranks, got differing "
            "checkpoint (secret, values not shown"), said
        assert accounted == 0                                  # nothing restored
    outs = spawn_outcomes(_load_on_ranks, 2, [paths[1], paths[1]], timeout=90, pg_timeout=30)
    assert [o.value for o in outs] == [(None, 1), (None, 1)], [(o.status, o.error) for o in outs]


def _make_private_apart(rank, world, what):
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    from ncdp_fast.torch import PrivacyEngine
    x, y = _data()
    model = _model()
    lr = 0.5 + 0.1 * rank if what == "lr" else 0.5
    engine = PrivacyEngine(accountant=("rdp", "prv")[rank] if what == "accountant" else "rdp")
    try:
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
                            noise_multiplier=SIGMA, max_grad_norm=C, group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what, shown", [("lr", r"param_groups \(rank 0: \[\{'lr': 0\.5"),
                                         ("accountant", r"accountant \(rank 0: 'rdp', "
                                                        r"rank 1: 'prv'\)")])
def test_ranks_with_their_own_learning_rate_or_accountant_are_refused(what, shown):
    """The sixth audit: a learning rate of one rank's own stepped the ranks
    apart, and an accountant of its own reported another epsilon, silently."""
    import re
    outs = spawn_outcomes(_make_private_apart, 2, what, timeout=90, pg_timeout=30)
    for o in outs:
        assert o.status == "ok" and o.value is not None, (o.status, o.error)
        assert o.value.startswith("make_private: expected the same configuration on all 2 "
                                  "ranks") and re.search(shown, o.value), o.value
