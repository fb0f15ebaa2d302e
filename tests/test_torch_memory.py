"""BatchMemoryManager and the skip-step protocol (issue 25): a Poisson logical
batch trained in physical batches is the one-batch private step (same batches,
same noise, the clipped sum up to float summation order), and the private loader
keeps the DataLoader's worker settings."""
import multiprocessing
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast.torch import BatchMemoryManager, PrivacyEngine  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")
# Two runs of one key and offset are compared: the replay is the point.
pytestmark = pytest.mark.filterwarnings("ignore::ncdp_fast.NoiseReuseWarning")

EPS = float(np.finfo(np.float64).eps)


def _private(n, batch_size, seed, *, sigma=1.0, clipping="flat", loader_kw=None,
             dtype=torch.float64, loss_reduction="mean"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, **(loader_kw or {}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.ReLU(),
                          nn.Linear(8, 3)).double().to(dtype)
    # lr 0: every logical step sees the same parameters in both runs, so the
    # gradients of all steps are comparable, not only the first's.
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = PrivacyEngine(accountant="rdp")
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=sigma, max_grad_norm=1.0,
                                            clipping=clipping, seed=nf.NoiseStream(seed, 0),
                                            loss_reduction=loss_reduction)
    return engine, pm, popt, ploader


def _train(pm, popt, loader, loss=nn.functional.cross_entropy):
    """Opacus's loop, unchanged; the gradient of every step that was taken."""
    grads, sizes = [], []
    for x, y in loader:
        sizes.append(len(y))
        popt.zero_grad()
        loss(pm(x), y).backward()
        out = popt.step()
        if not popt._is_last_step_skipped:
            grads.append([p.grad.clone() for p in pm.parameters()])
        else:
            assert out is None
    return grads, sizes


def _logical_run(seed, loss=nn.functional.cross_entropy, **kw):
    engine, pm, popt, ploader = _private(40, 10, seed, **kw)
    grads, sizes = _train(pm, popt, ploader, loss)
    return grads, sizes, engine.accountant.total_steps, pm.clipper.offset


def _SUM(logits, y):
    return nn.functional.cross_entropy(logits, y, reduction="sum")


def _assert_same_steps(ref, ref_sizes, grads, E=10.0):
    """Bound: each clipped per-sample term is at most C = 1 per coordinate, so a
    sum over B samples plus noise N rounds by at most (B + 3) eps (B C + |N|) in
    each run (B - 1 additions, the clip factor's and the division's roundings);
    the two runs differ by at most twice that, over E."""
    assert len(grads) == len(ref)
    for step, (g_ref, g) in enumerate(zip(ref, grads)):
        B = ref_sizes[step]
        for a, b in zip(g_ref, g):
            noise = a.abs().max().item() * E + B      # |N| <= |E a| + B C
            bound = 2 * (B + 3) * EPS * (B * 1.0 + noise) / E
            assert (a - b).abs().max().item() <= bound


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_physical_batches_give_the_logical_step(clipping):
    """k physical batches of at most 3 samples = one logical batch (E = 10):
    same batches, same noise, one accountant step per logical batch, and the
    gradient equal up to summation order (not bit for bit: the clipped sums
    are added in another order; measured, about 1 ulp)."""
    ref, ref_sizes, ref_steps, ref_offset = _logical_run(31, clipping=clipping)
    engine, pm, popt, ploader = _private(40, 10, 31, clipping=clipping)
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=3,
                            optimizer=popt) as physical:
        grads, sizes = _train(pm, popt, physical)
    assert max(sizes) <= 3 and sum(sizes) == sum(ref_sizes)
    assert len(sizes) > len(ref_sizes), "seed 31 should split some logical batch"
    assert engine.accountant.total_steps == ref_steps == len(ref_sizes) == len(grads)
    assert pm.clipper.offset == ref_offset          # the same noise draws, no more
    _assert_same_steps(ref, ref_sizes, grads)


def test_half_parameters_accumulate_in_float32_and_round_once():
    """bfloat16 parameters: the physical batches' clipped sums are held in
    float32 (the dtype the op sums and noises half parameters in) and each
    logical step writes bfloat16 once, with the one-batch run's steps and noise
    range.  A summed loss: a mean's 1/B rounded into bfloat16 gradients is
    refused (test_torch_precision).  (Values are not compared: the per-sample
    gradients themselves are computed in bfloat16, which no float64-style
    bound covers.)"""
    bf = torch.bfloat16
    _, ref_sizes, ref_steps, ref_offset = _logical_run(38, dtype=bf, loss_reduction="sum",
                                                       loss=_SUM)
    engine, pm, popt, ploader = _private(40, 10, 38, dtype=bf, loss_reduction="sum")
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=3,
                            optimizer=popt) as physical:
        grads, sizes = _train(pm, popt, physical, _SUM)
    assert all(g.dtype == bf for step in grads for g in step)
    assert len(grads) == engine.accountant.total_steps == ref_steps == len(ref_sizes)
    assert pm.clipper.offset == ref_offset and max(sizes) <= 3
    x, y = next(iter(ploader))
    popt.signal_skip_step(do_skip=True)
    _SUM(pm(x[:3]), y[:3]).backward()
    popt.step()
    assert {t.dtype for t in pm.clipper._accumulated.values()} == {torch.float32}


_REF = {}


@settings(max_examples=6, deadline=None)
@given(max_size=st.integers(1, 14))
def test_any_physical_size_is_one_step_per_logical_batch(max_size):
    """Whatever the physical size: chunks within it, one accountant step and
    one noise range per logical batch (the stream ends where the one-batch run's
    does), the same gradients within the rounding bound."""
    if not _REF:
        _REF["run"] = _logical_run(36)
    ref, ref_sizes, ref_steps, ref_offset = _REF["run"]
    engine, pm, popt, ploader = _private(40, 10, 36)
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=max_size,
                            optimizer=popt) as physical:
        grads, sizes = _train(pm, popt, physical)
    assert max(sizes) <= max_size and sum(sizes) == sum(ref_sizes)
    assert engine.accountant.total_steps == ref_steps and pm.clipper.offset == ref_offset
    _assert_same_steps(ref, ref_sizes, grads)


def test_opacus_batch_memory_manager_drives_our_optimizer():
    """Opacus's own manager on our optimizer (its skip-step protocol): the same
    chunks, so the same steps bit for bit as ours."""
    bmm = pytest.importorskip("opacus.utils.batch_memory_manager")
    engine, pm, popt, ploader = _private(40, 10, 32)
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=3,
                            optimizer=popt) as physical:
        ours, ours_sizes = _train(pm, popt, physical)
    engine2, pm2, popt2, ploader2 = _private(40, 10, 32)
    with bmm.BatchMemoryManager(data_loader=ploader2, max_physical_batch_size=3,
                                optimizer=popt2) as physical:
        theirs, theirs_sizes = _train(pm2, popt2, physical)
    assert ours_sizes == theirs_sizes and max(theirs_sizes) <= 3
    assert engine2.accountant.total_steps == engine.accountant.total_steps == 4 == len(theirs)
    for g, h in zip(ours, theirs):
        assert all(torch.equal(a, b) for a, b in zip(g, h))


def test_empty_logical_batch_is_one_noise_only_step():
    """q = 1/12, E = 1: seed 7 draws an empty logical batch; it is one empty
    physical batch and one step of pure noise, accounted like any other."""
    engine, pm, popt, ploader = _private(12, 1, 7, sigma=2.0)
    physical_sizes = []
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=1,
                            optimizer=popt) as physical:
        for x, y in physical:
            physical_sizes.append(len(y))
            popt.zero_grad()
            nn.functional.cross_entropy(pm(x), y).backward()
            popt.step()
            if len(y) == 0:
                assert not popt._is_last_step_skipped
                assert pm.clipper.last_result.norms.shape == (0,)
                assert all(p.grad.abs().max().item() > 0 for p in pm.parameters())
    assert 0 in physical_sizes, "seed 7 should draw an empty logical batch (0.92^12 a step)"
    assert max(physical_sizes) <= 1 and engine.accountant.total_steps == 12


def test_skip_protocol_refusals_leave_nothing_behind(tmp_path):
    engine, pm, popt, ploader = _private(40, 10, 33)
    x, y = next(iter(ploader))
    with pytest.raises(TypeError, match="do_skip: expected"):
        popt.signal_skip_step(do_skip="yes")
    popt.signal_skip_step(do_skip=True)
    # A skipped step with nothing recorded is refused; the decision stays queued.
    with pytest.raises(RuntimeError, match="no forward/backward"):
        popt.step()
    assert popt._step_skip_queue == [True]
    nn.functional.cross_entropy(pm(x), y).backward()
    assert popt.step() is None and popt._is_last_step_skipped
    assert engine.accountant.total_steps == 0 and pm.clipper._accumulated
    with pytest.raises(ValueError, match="inside a logical batch"):
        engine.save_checkpoint(path=tmp_path / "c.pt", module=pm, optimizer=popt)
    assert not (tmp_path / "c.pt").exists()
    # Opacus-style, likewise (its state was taken without the accumulated sums
    # until the eighth audit)
    with pytest.raises(ValueError, match="state_dict: expected a state between logical steps"):
        popt.state_dict()
    with pytest.raises(TypeError, match="optimizer: expected the DPOptimizer"):
        BatchMemoryManager(data_loader=ploader, max_physical_batch_size=2,
                           optimizer=popt.original_optimizer)
    plain = DataLoader(ploader.dataset, batch_size=10)
    with pytest.raises(ValueError, match="data_loader: expected the Poisson loader"):
        BatchMemoryManager(data_loader=plain, max_physical_batch_size=2, optimizer=popt)
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        BatchMemoryManager(data_loader=ploader, max_physical_batch_size=0, optimizer=popt)


def _leave_after_a_skipped_step(manager, pm, popt, ploader):
    with manager(data_loader=ploader, max_physical_batch_size=2, optimizer=popt) as physical:
        for x, y in physical:
            nn.functional.cross_entropy(pm(x), y).backward()
            popt.step()
            if popt._is_last_step_skipped:
                break


def test_leaving_the_context_early_discards_the_unfinished_logical_batch():
    engine, pm, popt, ploader = _private(40, 10, 34)
    _leave_after_a_skipped_step(BatchMemoryManager, pm, popt, ploader)
    assert not pm.clipper._accumulated and not popt._step_skip_queue
    assert engine.accountant.total_steps == 0
    # The next logical batch is stepped from scratch.
    x, y = next(iter(ploader))
    nn.functional.cross_entropy(pm(x), y).backward()
    popt.step()
    assert not popt._is_last_step_skipped and engine.accountant.total_steps == 1


def test_private_loader_keeps_worker_settings():
    """multiprocessing_context, prefetch_factor and timeout survive make_private
    and the manager (they were dropped); with workers prefetching, the skip
    decisions are queued ahead and the steps are those of the loader without
    workers."""
    ctx = multiprocessing.get_context("fork")
    kw = dict(num_workers=2, multiprocessing_context=ctx, prefetch_factor=3, timeout=60)
    engine, pm, popt, ploader = _private(40, 10, 35, loader_kw=kw)
    assert (ploader.num_workers, ploader.prefetch_factor, ploader.timeout) == (2, 3, 60)
    assert ploader.multiprocessing_context is ctx
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=3,
                            optimizer=popt) as physical:
        assert (physical.prefetch_factor, physical.timeout) == (3, 60)
        assert physical.multiprocessing_context is ctx
        grads, sizes = _train(pm, popt, physical)
    engine0, pm0, popt0, ploader0 = _private(40, 10, 35)
    assert ploader0.prefetch_factor is None and ploader0.timeout == 0
    with BatchMemoryManager(data_loader=ploader0, max_physical_batch_size=3,
                            optimizer=popt0) as physical:
        grads0, sizes0 = _train(pm0, popt0, physical)
    assert sizes == sizes0 and engine.accountant.total_steps == engine0.accountant.total_steps == 4
    for g, h in zip(grads, grads0):
        assert all(torch.equal(a, b) for a, b in zip(g, h))


def test_a_new_pass_ends_a_logical_batch_left_by_opacus_manager():
    """Opacus's manager has no exit to close a logical batch: left after a skipped
    step, its clipped sums would be noised with the next batch (a sample in both
    Poisson batches counted twice). The next pass discards them, saying so."""
    bmm = pytest.importorskip("opacus.utils.batch_memory_manager")
    engine, pm, popt, ploader = _private(40, 10, 37)
    _leave_after_a_skipped_step(bmm.BatchMemoryManager, pm, popt, ploader)
    assert pm.clipper._accumulated
    with pytest.warns(RuntimeWarning, match="began inside a logical batch"):
        x, y = next(iter(ploader))
    assert not pm.clipper._accumulated and not popt._step_skip_queue
    popt.zero_grad()
    nn.functional.cross_entropy(pm(x), y).backward()
    popt.step()
    assert not popt._is_last_step_skipped and engine.accountant.total_steps == 1


def _exact_private(seed):
    """A private MLP whose every per-sample gradient is a vector of small
    integers (integer weights, inputs and targets, ReLU, squared error summed):
    every sum of them is exact in float64, in any order.  The bound C is far
    above every per-sample norm, so each clip factor is exactly 1."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (40, 5), generator=g).double()
    y = torch.randint(-3, 4, (40, 2), generator=g).double()
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = PrivacyEngine(accountant="rdp")
    pm, popt, ploader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.5,
        max_grad_norm=1e6, loss_reduction="sum", seed=nf.NoiseStream(seed, 0))
    return pm, popt, ploader


def _sum_of_squares(out, y):
    return nn.functional.mse_loss(out, y, reduction="sum")


@pytest.mark.parametrize("max_size", [1, 3, 7])
def test_physical_batches_equal_the_logical_batch_bit_for_bit_when_sums_are_exact(max_size):
    """Where float64 addition is exact (integer per-sample gradients, factor 1),
    summation order is the only difference the split may make, so k physical
    batches must give the one-batch step's gradients bit for bit: the same
    samples, each counted once, the same noise draws and scaling.  A dropped,
    repeated or re-noised physical batch changes the bits (the integer sums are
    of order 10-100, the noise's ulp ~1e-10)."""
    pm, popt, ploader = _exact_private(41)
    ref, ref_sizes = _train(pm, popt, ploader, _sum_of_squares)
    pm, popt, ploader = _exact_private(41)
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=max_size,
                            optimizer=popt) as physical:
        grads, sizes = _train(pm, popt, physical, _sum_of_squares)
    assert sum(sizes) == sum(ref_sizes) and max(sizes) <= max_size
    assert len(grads) == len(ref) and len(sizes) > len(ref_sizes)
    for g_ref, g in zip(ref, grads):
        for a, b in zip(g_ref, g):
            assert torch.equal(a, b)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_released_gradients_are_freed_by_zero_grad(clipping):
    """After zero_grad(set_to_none=True) nothing of the drop-in holds the step's
    gradients (last_result keeps norms and counts only): they are not carried
    into the next step's memory."""
    import gc
    import weakref
    engine, pm, popt, ploader = _private(40, 10, 43, clipping=clipping)
    x, y = next(iter(ploader))
    nn.functional.cross_entropy(pm(x), y).backward()
    popt.step()
    refs = [weakref.ref(p.grad) for p in pm.parameters()]
    assert pm.clipper.last_result.grads is None and pm.clipper.last_result.norms.shape == (len(y),)
    popt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_every_clip_call_gets_the_only_references(clipping, monkeypatch):
    """Every clip call of a step -- privatize_ and accumulate_ (the physical
    batches of BatchMemoryManager), flat and per-layer clipping -- gets the
    only references to the recorded tensors: the layers' records are cleared
    before it, and it consumes its list (release_blocks), so that it frees
    each layer's inputs and output gradients once its sum is formed (the
    op's own test: tests/test_clip.py); per-layer clipping's one call holds a
    block and a bound a parameter."""
    from ncdp_fast.torch.mechanism import ClippedGaussianStep
    seen = []

    def spy(real):
        def call(self, blocks, grad_scale, **kw):
            held = [len(t.records) for t in self.taps]
            out = real(self, blocks, grad_scale, **kw)
            seen.append((real.__name__, held, kw.get("release"), list(blocks),
                         kw.get("bounds")))
            return out
        return call
    for name in ("_clip_only", "_clip_and_noise"):
        monkeypatch.setattr(ClippedGaussianStep, name, spy(getattr(ClippedGaussianStep, name)))
    _, pm, popt, ploader = _private(40, 10, 44, clipping=clipping)
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=4,
                            optimizer=popt) as physical:
        _train(pm, popt, physical)
    assert {name for name, *_ in seen} == {"_clip_only", "_clip_and_noise"}
    params = sum(1 for p in pm.parameters() if p.requires_grad)
    for name, held, release, left, bounds in seen:
        assert release is True and set(held) == {0}, name
        assert left and all(b is None for b in left), name
        if clipping == "per_layer":
            # one call for every parameter, each on its own bound
            assert len(left) == params and len(bounds) == params


def _guarded_loop(pm, popt, physical):
    """The common guard of an everyday loop: an empty batch is skipped."""
    for x, y in physical:
        if len(x) == 0:
            continue
        popt.zero_grad()
        nn.functional.cross_entropy(pm(x), y).backward()
        popt.step()


def _skip_empty_batches(pm, popt, physical, sizes, released):
    """The loop with the guard `if len(x) == 0: continue`: each physical
    batch's size into ``sizes``, 1 into ``released`` for each released step."""
    for x, y in physical:
        sizes.append(len(y))
        if len(x) == 0:
            continue
        popt.zero_grad()
        nn.functional.cross_entropy(pm(x), y).backward()
        popt.step()
        released.append(int(not popt._is_last_step_skipped))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loop_that_skips_an_empty_batch_is_refused_before_anything_is_released(workers):
    """Issue 35, item 3 (attack): `if len(x) == 0: continue` in a
    BatchMemoryManager loop left the skip decisions one step out of order, so
    steps released part of a logical batch, or two, one sample counted twice
    (2 C, charged C). Now the batch that reached the loop without its step is
    named at the next batch, before that one is trained: the accountant holds
    only the logical batches released whole. With loader workers sampling
    ahead of the loop as well."""
    engine, pm, popt, ploader = _private(12, 1, 7, sigma=2.0)        # seed 7: an empty batch
    ploader = DataLoader(ploader.dataset, batch_sampler=ploader.batch_sampler,
                         num_workers=workers, collate_fn=ploader.collate_fn)
    sizes, released = [], []
    with pytest.raises(RuntimeError, match=r"left without its optimizer.step\(\).*len\(x\) == 0"):
        with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=1,
                                optimizer=popt) as physical:
            _skip_empty_batches(pm, popt, physical, sizes, released)
    # Refused as the batch after the skipped (empty) one reached the loop.
    assert sizes[-1] == 0 and 0 not in sizes[:-1]
    # Only steps that ended a logical batch were released and accounted.
    assert engine.accountant.total_steps == sum(released) < len(sizes) - 1
    assert not pm.clipper._accumulated


def test_a_final_empty_batch_left_without_its_step_is_refused_at_exit():
    """The skipped batch is the pass's last: the manager's exit names it."""
    engine, pm, popt, ploader = _private(12, 1, 7, sigma=2.0)
    plan = [b for b in ploader.batch_sampler][:-1] + [[]]      # the last logical batch empty

    class Replay:
        sample_rate, n = ploader.batch_sampler.sample_rate, ploader.batch_sampler.n

        def __len__(self):
            return len(plan)

        def __iter__(self):
            yield from plan
    with pytest.raises(RuntimeError, match="left without its optimizer.step"):
        with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=1,
                                optimizer=popt) as physical:
            physical.batch_sampler.sampler = Replay()
            _guarded_loop(pm, popt, physical)


def test_one_step_per_physical_batch_and_no_skip_signals_inside_the_manager():
    engine, pm, popt, ploader = _private(40, 10, 31)
    with BatchMemoryManager(data_loader=ploader, max_physical_batch_size=3,
                            optimizer=popt) as physical:
        with pytest.raises(RuntimeError, match="signal_skip_step: inside"):
            popt.signal_skip_step(True)
        x, y = next(iter(physical))
        nn.functional.cross_entropy(pm(x), y).backward()
        popt.step()
        with pytest.raises(RuntimeError, match="no physical batch awaiting its step"):
            popt.step()


def test_each_layers_operands_are_let_go_once_its_sum_is_formed(monkeypatch):
    """The clip op drops a layer's activations and output gradients once its
    clipped sum is formed, before the next layer's sum allocates (the op's
    own test with the memory itself: tests/test_clip.py).  Two names kept
    every linear pair's operands until the op returned: a list of the pairs
    for the rebalancing check and a setup loop's variable (the last layer);
    BERT-base's step then held all its activations, output gradients and
    private gradients at once, 1.11x the non-private peak on the H200
    (bench/memory_model.py: 1.03x without them)."""
    import gc
    import weakref

    import ncdp_fast._clip_layers as cl
    from ncdp_fast.torch import GhostClipper
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3)).double()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=5.0, seed=nf.NoiseStream(3, 0))
    formed, alive_at = [], []
    real = cl._Layer.reduce

    def reduce(self, *args, **kwargs):
        gc.collect()
        alive_at.append(sum(w() is not None for w in formed))
        out = real(self, *args, **kwargs)
        if self.kind == "pair":
            formed.extend(weakref.ref(x) for x in (self.a, self.g))
        return out
    monkeypatch.setattr(cl._Layer, "reduce", reduce)
    x = torch.randn(5, 4, 6, dtype=torch.float64)          # (B, T, d): linear pairs
    model(x).sum().backward()
    clipper.privatize_()
    gc.collect()
    assert len(formed) == 6 and alive_at == [0, 0, 0]
    assert all(w() is None for w in formed)


@pytest.mark.parametrize("workers", [0, 2])
def test_opacus_manager_with_a_guard_that_skips_an_empty_batch_is_refused(workers):
    """The fourth audit: Opacus's manager on our optimizer with `if len(x) ==
    0: continue` left the empty batch's queued decision to the next step,
    which released one sample of the next logical batch alone and merged the
    other with the batch after (the refusal of issue 35 was only in our
    manager).  A released step must now be the loader's next Poisson batch
    whole, or the step is refused before anything is written."""
    bmm = pytest.importorskip("opacus.utils.batch_memory_manager")
    engine, pm, popt, ploader = _private(12, 1, 7, sigma=2.0)        # seed 7: an empty batch
    ploader = DataLoader(ploader.dataset, batch_sampler=ploader.batch_sampler,
                         num_workers=workers, collate_fn=ploader.collate_fn)
    sizes, released = [], []
    with pytest.raises(RuntimeError, match=r"released step covers \d+ sample\(s\).*next "
                                           r"Poisson batch has 0.*out of step"):
        with bmm.BatchMemoryManager(data_loader=ploader, max_physical_batch_size=1,
                                    optimizer=popt) as physical:
            _skip_empty_batches(pm, popt, physical, sizes, released)
    assert 0 in sizes
    assert engine.accountant.total_steps == sum(released)
    assert not pm.clipper._accumulated


def test_skips_signalled_across_poisson_batches_are_refused():
    """The fourth audit: signal_skip_step(True) by hand on every other batch
    of the private loader accumulated two Poisson batches into one released
    step, accounted as one step at the sampling rate (epsilon 5.97 reported
    where 9.40 at least was spent).  Refused at the first such release."""
    engine, pm, popt, ploader = _private(40, 10, 3)
    with pytest.raises(RuntimeError, match="the skip decisions .signal_skip_step. are out of "
                                           "step with the loader's batches"):
        for i, (x, y) in enumerate(ploader):
            popt.signal_skip_step(i % 2 == 0)
            popt.zero_grad()
            nn.functional.cross_entropy(pm(x), y).backward()
            popt.step()
    assert engine.accountant.total_steps == 0


def test_sums_accumulated_behind_the_optimizer_are_refused_at_its_step():
    """The fourth audit: the clipper's accumulate_ called directly between the
    engine optimizer's steps accumulated Poisson batches the optimizer never
    saw, released as one accounted step.  Refused at the release, the sums
    discarded."""
    engine, pm, popt, ploader = _private(40, 10, 3)
    batches = iter(ploader)
    x, y = next(batches)
    nn.functional.cross_entropy(pm(x), y).backward()
    pm.clipper.accumulate_()
    x, y = next(batches)
    nn.functional.cross_entropy(pm(x), y).backward()
    with pytest.raises(RuntimeError, match="accumulated by calling the clipper's accumulate_"):
        popt.step()
    assert engine.accountant.total_steps == 0 and not pm.clipper._accumulated
