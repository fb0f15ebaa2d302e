"""The torch drop-in's GPU paths against its CPU path (marked gpu: on a GPU, or on
the emulated device under NCDP_CUDA_EMULATION=1, as `make test` runs them).

Each scenario trains the same float64 model from the same seed twice: once on
the CPU path (numba kernels) and once on require_cuda's device (the CUDA
adaptors, the launchers and the kernels' own source); the parameters after the
run and the privacy spent must agree. The two backends sum in different orders
(slabs, tiles, chunks), so the parameters agree to float64 rounding of sums of
a few hundred terms, not bit for bit: rtol 1e-9 and atol 1e-12, as
test_gpu.py's clipper test, against the measured differences of about 1e-15.
The host-synchronisation count of a step is held here too (tests/host_sync.py).
"""
from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from conftest import loader_batches, on_host  # noqa: E402
from host_sync import HostSyncCounter  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::ncdp_fast.NoiseReuseWarning")]

ADAPTIVE = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
                min_clipbound=0.01, unclipped_num_std=2.0)


def _data(n=24, vocab=None, T=None):
    g = torch.Generator().manual_seed(1)
    if vocab is not None:
        x = torch.randint(0, vocab, (n, T), generator=g)
    elif T is not None:
        x = torch.randn(n, T, 3, generator=g, dtype=torch.float64)
    else:
        x = torch.randn(n, 5, generator=g, dtype=torch.float64) * \
            torch.linspace(0.1, 3.0, n, dtype=torch.float64)[:, None]
    return x, torch.randint(0, 3, (n,), generator=g)


def _mlp():
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


class _Tied(nn.Module):
    """A language-model shape: the output head shares the embedding's weight."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx)))).mean(1)[:, :3]


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        from ncdp_fast.torch import DPLSTM
        self.lstm = DPLSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class _Normalised(nn.Module):
    """Every normalisation layer with a per-sample affine rule: a GroupNorm (two
    channels a group), an affine InstanceNorm2d and a LayerNorm over three
    dimensions, on a small image made from the features."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 32)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.ln = nn.LayerNorm((4, 4, 4))
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        h = self.conv(self.inp(x).reshape(-1, 2, 4, 4))
        h = torch.tanh(self.ln(self.inorm(self.gn(h))))
        return self.head(h.flatten(1))


class _Bags(nn.Module):
    """Each sample's tokens in a sum bag (padding row 0) and in a max bag:
    both bag rules in one step."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.sum = nn.EmbeddingBag(vocab, dim, mode="sum", padding_idx=0)
        self.max = nn.EmbeddingBag(vocab, dim, mode="max")
        self.head = nn.Linear(2 * dim, 3)

    def forward(self, idx):
        return self.head(torch.tanh(torch.cat([self.sum(idx), self.max(idx)], 1)))


SCENARIOS = {
    # name: (model, data, make_private keyword arguments, physical batch of BatchMemoryManager)
    "embedding_bags": (_Bags, dict(vocab=11, T=4), {}, None),
    "flat": (_mlp, {}, {}, None),
    "per_layer": (_mlp, {}, dict(clipping="per_layer", max_grad_norm=[0.5, 0.2, 0.3, 0.1,
                                                                      0.4, 0.2]), None),
    "adaptive": (_mlp, {}, dict(clipping="adaptive", **ADAPTIVE), None),
    "batch_memory_manager": (_mlp, {}, {}, 2),
    "tied_weights": (_Tied, dict(vocab=11, T=4), {}, None),
    "dplstm": (_Recurrent, dict(T=5), {}, None),
    "norm_layers": (_Normalised, {}, {}, None),
}


def _train(device, name, epochs=2, checkpoint_at=None, tmp_path=None):
    """Parameters (on the CPU) and epsilon after `epochs` of private SGD in
    scenario `name` on `device` (seed fixed); with checkpoint_at, the run is
    saved after that epoch and resumed into fresh objects from the file."""
    from ncdp_fast.torch import BatchMemoryManager, PrivacyEngine
    build, data_kw, kw, physical = SCENARIOS[name]
    x, y = (t.to(device) for t in _data(**data_kw))

    def fresh():
        torch.manual_seed(0)
        model = build().double().to(device)
        engine = PrivacyEngine(accountant="rdp")
        args = dict(dict(max_grad_norm=0.5), **kw)
        pm, popt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=6),
            noise_multiplier=0.7, seed=2024, **args)
        return engine, pm, popt, loader

    engine, pm, popt, loader = fresh()
    for epoch in range(epochs):
        with (BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical,
                                 optimizer=popt) if physical else contextlib.nullcontext(loader)
              ) as batches:
            for xb, yb in batches:
                popt.zero_grad()
                F.cross_entropy(pm(xb), yb).backward()
                popt.step()
        if checkpoint_at == epoch + 1:
            path = tmp_path / f"{name}.pt"
            engine.save_checkpoint(path=path, module=pm, optimizer=popt)
            engine, pm, popt, loader = fresh()
            engine.load_checkpoint(path=path, module=pm, optimizer=popt)
    params = torch.cat([p.detach().reshape(-1) for p in pm.parameters()])
    return params.cpu(), engine.get_epsilon(1e-5)


def _both(require_cuda, run):
    """run(device) on the CPU path, then on require_cuda's device, each from the
    stream's start: the process-wide record of drawn ranges would otherwise
    start the second run (its batches and its noise) where the first stopped."""
    from ncdp_fast import _stream
    with on_host(require_cuda), _launches() as launched:
        host = run(torch.device("cpu"))
    assert launched == [], f"the CPU path launched {launched[:3]}"
    _stream._LEDGER.clear()
    with _launches() as launched:
        device = run(require_cuda)
    assert launched, "the device run launched no kernel: it did not take the CUDA path"
    return host, device


@contextlib.contextmanager
def _launches():
    """The names of the native launches made in the block (through the CUDA
    adaptors, whichever module serves them)."""
    from ncdp_fast._cuda import clip, mix, ntk, rng
    names = []
    saved = {m: m.native for m in (clip, mix, ntk, rng)}

    def counting(native):
        def for_array(x):
            module = native(x)

            class Counted:
                def __getattr__(self, name):
                    if name.startswith("launch_"):
                        names.append(name)
                    return getattr(module, name)
            return Counted()
        return for_array
    for m, native in saved.items():
        m.native = counting(native)
    try:
        yield names
    finally:
        for m, native in saved.items():
            m.native = native


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_private_training_on_the_device_equals_the_cpu_path(require_cuda, name):
    (p_host, eps_host), (p_dev, eps_dev) = _both(require_cuda, lambda dev: _train(dev, name))
    assert eps_dev == eps_host
    torch.testing.assert_close(p_dev, p_host, rtol=1e-9, atol=1e-12)
    assert not torch.equal(p_host, _train_plain(name)), "the run did not train privately"


def test_normalisation_layers_take_one_launch_each_on_the_device(require_cuda):
    """The GroupNorm, InstanceNorm and LayerNorm rules run the clip family's
    kernel on the device (one launch a layer a step, where the torch
    composition was four kernels), and the run equals the CPU path's (which
    keeps that composition): test_private_training_on_the_device_equals_the_cpu_path
    ["norm_layers"] compares the parameters."""
    with _launches() as launched:
        _train(require_cuda, "norm_layers", epochs=1)
    steps = 24 // 6
    assert launched.count("launch_norm_affine_grads") == 3 * steps, launched


def _train_plain(name):
    build = SCENARIOS[name][0]
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in build().double().parameters()])


def test_checkpoint_resume_on_the_device_equals_the_cpu_path(require_cuda, tmp_path):
    (p_host, eps_host), (p_dev, eps_dev) = _both(
        require_cuda, lambda dev: _train(dev, "flat", epochs=2, checkpoint_at=1,
                                         tmp_path=tmp_path))
    assert eps_dev == eps_host
    torch.testing.assert_close(p_dev, p_host, rtol=1e-9, atol=1e-12)
    # Resuming continues the one run: the same as never stopping.
    from ncdp_fast import _stream
    _stream._LEDGER.clear()
    with on_host(require_cuda):
        p_through, eps_through = _train(torch.device("cpu"), "flat", epochs=2)
    torch.testing.assert_close(p_host, p_through, rtol=1e-12, atol=1e-15)
    assert eps_host == pytest.approx(eps_through, rel=1e-12)


def test_ghost_clipper_per_layer_on_the_device_equals_the_cpu_path(require_cuda):
    from ncdp_fast.torch import GhostClipper
    def run(device):
        x, y = (t.to(device) for t in _data())
        torch.manual_seed(0)
        model = _mlp().double().to(device)
        bounds = [0.1 * (i + 1) for i, _ in enumerate(model.parameters())]
        clipper = GhostClipper(model, max_grad_norm=bounds, noise_multiplier=0.5,
                               expected_batch_size=24, clipping="per_layer", seed=5, offset=0)
        F.cross_entropy(model(x), y).backward()
        res = clipper.privatize_()
        return torch.cat([p.grad.reshape(-1).cpu() for p in model.parameters()]), res.num_clipped
    (g_host, clipped_host), (g_dev, clipped_dev) = _both(require_cuda, run)
    assert clipped_dev == clipped_host > 0
    torch.testing.assert_close(g_dev, g_host, rtol=1e-9, atol=1e-12)



@pytest.mark.parametrize("case", ["equal bounds, mean", "mixed bounds, float32 Grams",
                                  "a dropped row", "many blocks", "pairs of one shape",
                                  "pairs of one shape, float32 Grams, mean"])
def test_per_layer_op_is_one_op_a_block_run_in_turn(require_cuda, case, monkeypatch):
    """Per-layer clipping's one op (``clip_and_noise_layers(..., _bounds=)``,
    one buffer, one factors call, one transfer, one claim, one noise finish a
    distinct std) gives each block what a one-block op of its bound gives,
    run in turn from the same stream position: the same factors, counts,
    ranges and sums, bit for bit, on the CPU path and on the device; on the
    device its noise is one finish launch where the bounds are equal.  "many
    blocks": 131 blocks of five widths (five rules), past the 128 groups of
    one factors launch.  "pairs of one shape": linear pairs of one shape
    (three reading one input, on the Gram route; two on the direct route),
    whose norms one stacked call forms, a row each."""
    from ncdp_fast import _stream, clip_and_noise_layers
    from ncdp_fast._cuda import clip as device_clip
    finishes, factor_calls = [], []
    real = device_clip.finish_gaussian_segments
    monkeypatch.setattr(device_clip, "finish_gaussian_segments",
                        lambda *a, **k: (finishes.append(len(a[0])), real(*a, **k)))
    real_factors = device_clip.clip_factor_groups
    monkeypatch.setattr(device_clip, "clip_factor_groups",
                        lambda *a, **k: (factor_calls.append(a[0].shape[0]),
                                         real_factors(*a, **k)))
    # The device's norm calls of the joint op: stacked runs (their layers,
    # a row each) and layers alone.
    norm_calls = []
    real_group, real_alone = device_clip.linear_sq_norms_group, device_clip.linear_sq_norms
    monkeypatch.setattr(device_clip, "linear_sq_norms_group",
                        lambda *a, **k: (norm_calls.append((len(a[0]), k.get("rows", False))),
                                         real_group(*a, **k))[1])
    monkeypatch.setattr(device_clip, "linear_sq_norms",
                        lambda *a, **k: (norm_calls.append("alone"), real_alone(*a, **k))[1])
    dtype = torch.float32 if "float32" in case else torch.float64
    reduction = "mean" if "mean" in case else "sum"

    def blocks(device):
        g = torch.Generator().manual_seed(3)
        a3 = torch.randn(6, 4, 5, generator=g, dtype=dtype)
        g3 = torch.randn(6, 4, 7, generator=g, dtype=dtype)
        a2 = torch.randn(6, 7, generator=g, dtype=dtype) * 3
        g2 = torch.randn(6, 2, generator=g, dtype=dtype)
        dense = torch.randn(6, 3, 2, generator=g, dtype=dtype)
        if "dropped" in case:
            dense[4, 0, 1] = float("nan")
        if "many" in case:
            return [torch.randn(6, 1 + k % 5, generator=g, dtype=dtype) * (0.05 * (k % 7) + 0.01)
                    for k in range(131)]
        if "one shape" in case:
            gram = [(a3, torch.randn(6, 4, 7, generator=g, dtype=dtype) * (k + 1), False)
                    for k in range(3)]
            gram.append((torch.randn(6, 4, 5, generator=g, dtype=dtype),
                         torch.randn(6, 4, 7, generator=g, dtype=dtype), False))
            direct = [(torch.randn(6, 6, 3, generator=g, dtype=dtype),
                       torch.randn(6, 6, 2, generator=g, dtype=dtype) * 2, False)
                      for _ in range(2)]
            return gram[:2] + [g3.sum(1)] + direct[:1] + gram[2:] + direct[1:] + [dense]
        return [t.to(device) if isinstance(t, torch.Tensor) else t for t in
                ((a3, g3, False), g3.sum(1), (a2, g2, True), dense, dense[:, 0] * 2)]

    def as_device(block, device):
        if isinstance(block, tuple):
            return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in block)
        return block.to(device)

    # Mixed: 0.8 * 1.3 / 2.05 * 2.05 rounds to another std than the others'
    # 1.04, so the op finishes the noise in two launches.
    bounds = ([0.7] * 5 if "equal" in case else [0.09] * 131 if "many" in case
              else [0.6] * 8 if "one shape" in case else [0.2, 2.05, 0.4, 1.3, 0.05])
    kw = dict(noise_multiplier=0.8, reduction=reduction, expected_batch_size=5.0,
              nan_policy="zero", grad_scale=6.0 if reduction == "mean" else 1.0,
              gram_precision="float32" if "float32" in case else "float64")

    def run(device):
        total = 1.3
        _stream._LEDGER.clear()
        joint = clip_and_noise_layers([as_device(b, device) for b in blocks("cpu")],
                                      max_norm=total, seed=7, offset=11, _bounds=bounds, **kw)
        launches, factors, norms = list(finishes), list(factor_calls), list(norm_calls)
        finishes.clear()
        factor_calls.clear()
        _stream._LEDGER.clear()
        alone, offset = [], 11
        for block, c in zip(blocks("cpu"), bounds):
            one = clip_and_noise_layers([as_device(block, device)], max_norm=c, seed=7,
                                        offset=offset, **dict(kw, noise_multiplier=0.8 * total / c))
            alone.append(one)
            offset = one.next_offset
        finishes.clear()
        factor_calls.clear()
        norm_calls.clear()
        return joint, alone, launches, factors, norms

    with on_host(require_cuda):
        host = run(torch.device("cpu"))
    dev = run(require_cuda)
    for joint, alone, *_ in (host, dev):
        assert len(joint) == len(alone) == len(bounds)
        for j, a in zip(joint, alone):
            assert (j.seed, j.offset, j.draws, j.num_clipped, j.num_nonfinite) == \
                (a.seed, a.offset, a.draws, a.num_clipped, a.num_nonfinite)
            assert torch.equal(torch.as_tensor(j.norms).nan_to_num(-1.0),
                               torch.as_tensor(a.norms).nan_to_num(-1.0))
            for x, y in zip(_flat_grads(j.grads[0]), _flat_grads(a.grads[0])):
                assert torch.equal(x, y)
        assert sum(j.num_clipped for j in joint) > 0
    if "dropped" in case:
        assert host[0][3].num_nonfinite == 1
    # The device's noise finishes: one launch a distinct std (each block's
    # formed as its own op forms it), one for equal bounds; the CPU path
    # launches none.
    assert host[2] == []
    stds = {0.8 * 1.3 / c * c for c in bounds}
    assert len(dev[2]) == len(stds) == (2 if "mixed" in case or "dropped" in case else 1)
    # One factors call for every block's rule on the device (one launch a 128
    # groups); the CPU path forms them with the numba twin.
    assert host[3] == [] and dev[3] == [len(bounds)]
    if "one shape" in case:
        # The Gram route's four pairs in one stacked call, the direct route's
        # two in another, their norms a row each; no pair alone.
        assert dev[4] == [(4, True), (2, True)]


def _flat_grads(g):
    return [t.reshape(-1) for t in (g if isinstance(g, tuple) else (g,)) if t is not None]

# ------------------------------------------------------------ host synchronisation

# What one private step asks of the device that makes the host wait, by
# (kind, file of ncdp_fast, function), with the count per step:
# - the clip op copies two counts to the host, the clipped and the dropped
#   (non-finite) rows of its result (the norms and the factors, two copies of
#   B values, until issue 36).
# Each is a host-device round trip per step; the GPU speed issue (36) takes
# them out. A new one fails this test; one taken out must be struck here.
# Struck (issue 36): an embedding's clipped sum kept the rows of non-zero
# factor with nonzero(), and its norms (and a tied weight's) found each
# sample's distinct rows with unique(): both sizes the host had to read (three
# per BERT step, one per embedding); a tied weight's clipped sum read whether
# any sample was dropped.
# The loss check (torch/loss_watch.py) has value conditions on the device (a
# cross-entropy mean is a mean of per-sample terms only if every sample has as
# many valid targets as the others, issue 35, item 2): since issue 36 they ride
# in the clip op's one transfer (clip_and_noise_layers' _checks) instead of a
# read of their own at the step.
# Since 2026-12-02 the counter also sees the rules in backward (host_sync.py);
# the training scenarios' steps joined the list then.  Adaptive clipping read
# the (B,) norms again for its count (two more waits: .cpu() and the array);
# it now forms the count from the op's own host counts.  Per-layer clipping
# ran one clip op a parameter, each reading its own buffer (6 waits on the
# MLP, one per parameter); its parameters are now one op's blocks, each on its
# own bound (_clip_layers._Group), with the op's one read.
ONE = {("copy to the host", "_clip_results.py", "_accounting"): 1}
STEP_SYNCS = {
    "mlp": ONE, "transformer": ONE, "embedding bag": ONE, "adaptive": ONE,
    "tied_weights": ONE, "dplstm": ONE, "norm_layers": ONE, "embedding_bags": ONE,
    "per_layer": ONE,
}
# Hugging Face models through PrivacyEngine (3 embeddings in BERT, GPT-2's head
# tied to its token embedding).  On the emulated device one more: GPT-2's own
# forward moves its position embeddings .to(inputs_embeds.device), the host's
# there (a no-op on a GPU); the counter names PrivateModule.forward, the
# innermost frame of ncdp_fast.
HF_STEP_SYNCS = {
    "bert": {("copy to the host", "_clip_results.py", "_accounting"): 1},
    "gpt2": {("copy to the host", "_clip_results.py", "_accounting"): 1},
}
HF_EMULATED_ONLY = {"gpt2": {("copy to the host", "torch/dp_optimizer.py", "forward"): 1}}


def _sync_sites(events):
    return dict(Counter((kind, where.split(":")[0], where.split()[-1])
                        for kind, _, where in events))


def _engine_step(require_cuda, scenario="flat"):
    """One PrivacyEngine step of a training scenario's model and options (the
    MLP with flat clipping by default), ready to run."""
    from ncdp_fast.torch import PrivacyEngine
    build, data_kw, kw, _ = SCENARIOS[scenario]
    x, y = (t.to(require_cuda) for t in _data(**data_kw))
    torch.manual_seed(0)
    model = build().double().to(require_cuda)
    engine = PrivacyEngine(accountant="rdp")
    pm, popt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=0.7,
        seed=7, **dict(dict(max_grad_norm=0.5), **kw))
    xb, yb = next(iter(loader))       # the loader's own work is not the step's

    def step():
        popt.zero_grad()
        F.cross_entropy(pm(xb), yb).backward()
        popt.step()
    return step


def _clipper_step(require_cuda):
    """One GhostClipper step of an embedding + transformer + conv net."""
    from ncdp_fast.torch import GhostClipper
    from test_gpu import _bookkeeping_model
    model = _bookkeeping_model().double().to(require_cuda)
    clipper = GhostClipper(model, max_grad_norm=0.3, noise_multiplier=0.5,
                           expected_batch_size=6.0, seed=8)
    idx = torch.randint(0, 40, (6, 9), generator=torch.Generator().manual_seed(1))
    idx, y = idx.to(require_cuda), (torch.arange(6) % 3).to(require_cuda)

    def step():
        model.zero_grad()
        F.cross_entropy(model(idx), y).backward()
        clipper.privatize_()
    return step


def _bag_step(require_cuda):
    """One GhostClipper step of a bag classifier called twice a forward: flat
    tokens with offsets (an empty bag), per-sample weights, a padding row."""
    from ncdp_fast.torch import GhostClipper
    from test_embedding_bag import BagNet, _batch
    torch.manual_seed(0)
    model = BagNet(twice=True, mode="sum", padding_idx=0).double().to(require_cuda)
    idx, offsets, psw, y, _ = _batch("flat", 6, 3, psw=True, empty=True)
    idx, offsets, psw, y = (t.to(require_cuda) for t in (idx, offsets, psw, y))
    clipper = GhostClipper(model, max_grad_norm=0.3, noise_multiplier=0.5,
                           expected_batch_size=6.0, seed=8)

    def step():
        model.zero_grad()
        F.cross_entropy(model(idx, offsets, psw), y).backward()
        clipper.privatize_()
    return step


def _hf_step(require_cuda, name):
    """One PrivacyEngine step of a tiny random BERT classifier or GPT-2 LM."""
    transformers = pytest.importorskip("transformers")
    from ncdp_fast.torch import PrivacyEngine, causal_lm_loss
    torch.manual_seed(0)
    if name == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            max_position_embeddings=32))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    model = model.to(require_cuda)
    ids = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(2))
    data = TensorDataset(ids.to(require_cuda), (torch.arange(64) % 2).to(require_cuda))
    pm, opt, loader = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        seed=3)
    # Each step on the loader's next batch (the optimizer expects it), drawn
    # by the caller: the loader's own work is not the step's.
    batches = loader_batches(loader)

    def step(batch):
        xb, yb = batch
        assert len(xb), "seed 3 should not give an empty batch (P = (7/8)^64 per step)"
        opt.zero_grad()
        logits = pm(input_ids=xb).logits
        loss = F.cross_entropy(logits, yb) if name == "bert" else causal_lm_loss(logits, xb)
        loss.backward()
        opt.step()
    step(next(batches))     # the first step's one-time work (layouts, caches) is not counted
    return step, batches


@pytest.mark.parametrize("name", sorted(HF_STEP_SYNCS))
def test_a_hugging_face_step_synchronises_the_host_only_where_documented(require_cuda, name):
    from conftest import emulated
    step, batches = _hf_step(require_cuda, name)
    batch = next(batches)
    with HostSyncCounter() as counter:
        step(batch)
    expected = dict(HF_STEP_SYNCS[name])
    if emulated(require_cuda):
        expected.update(HF_EMULATED_ONLY.get(name, {}))
    assert _sync_sites(counter.in_library()) == expected


@pytest.mark.parametrize("name", sorted(STEP_SYNCS))
def test_a_private_step_synchronises_the_host_only_where_documented(require_cuda, name):
    builders = {"mlp": _engine_step, "transformer": _clipper_step, "embedding bag": _bag_step}
    step = (builders[name](require_cuda) if name in builders
            else _engine_step(require_cuda, name))
    with HostSyncCounter() as counter:
        step()
    assert _sync_sites(counter.in_library()) == STEP_SYNCS[name]


@pytest.mark.parametrize("mode", ["flat", "per_layer", "accumulate"])
def test_a_device_loss_check_refuses_within_the_clip_ops_one_read(require_cuda, mode):
    """A token mean over the whole batch (uneven valid targets: a loss value
    check on the device, issue 35) is still refused at the step with nothing
    written and no noise range taken, now from the clip op's one transfer
    (issue 36) instead of a read of its own -- in a flat step, in a per-layer
    step (its first clip op carries the flags) and in accumulate_ (no noise);
    the same loop with even targets goes through with that one transfer."""
    from ncdp_fast.torch import GhostClipper
    from ncdp_fast.torch.loss_graph import LossRefused
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(24, 8), nn.Linear(8, 5)).to(require_cuda)
    ids = torch.randint(0, 24, (6, 4), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 5, (6, 4), generator=torch.Generator().manual_seed(2))
    uneven = labels.clone()
    uneven[0, 1:] = -100
    clipper = GhostClipper(model, max_grad_norm=[0.5, 0.3, 0.4] if mode == "per_layer" else 1.0,
                           noise_multiplier=1.0, expected_batch_size=6, loss_reduction="mean",
                           clipping="per_layer" if mode == "per_layer" else "flat")
    step = clipper.accumulate_ if mode == "accumulate" else clipper.privatize_
    # One transfer a step: the clip op's (flat, per-layer and accumulate_).
    site = ("copy to the host", "_clip_results.py", "_accounting")
    for target, refused in ((uneven, True), (labels, False)):
        logits = model(ids.to(require_cuda))
        F.cross_entropy(logits.reshape(-1, 5), target.to(require_cuda).reshape(-1),
                        ignore_index=-100).backward()
        before = clipper.offset
        with HostSyncCounter() as counter:
            if refused:
                with pytest.raises(LossRefused, match="not a sum of per-sample terms"):
                    step()
            else:
                step()
        assert _sync_sites(counter.in_library()) == {site: 1}
        assert all(p.grad is None for p in model.parameters()) == (refused or
                                                                   mode == "accumulate")
        assert clipper.offset == before if refused or mode == "accumulate" else \
            clipper.offset > before
        if mode == "accumulate":
            assert bool(clipper._accumulated) != refused
    clipper.remove()


@pytest.mark.parametrize("name, loss, accepted", [
    ("mean", lambda o, y, n, dev: F.cross_entropy(o, y), True),
    ("sum / B", lambda o, y, n, dev: F.cross_entropy(o, y, reduction="sum")
     / torch.tensor(n, device=dev), True),
    ("sum / B (int)", lambda o, y, n, dev: F.cross_entropy(o, y, reduction="sum")
     / torch.tensor(n, dtype=torch.int64, device=dev), True),
    ("mean * 2^16", lambda o, y, n, dev: F.cross_entropy(o, y)
     * torch.tensor(2.0 ** 16, device=dev), False),
    ("mean * 1", lambda o, y, n, dev: F.cross_entropy(o, y) * torch.tensor(1.0, device=dev),
     True),
    ("sum / (B - 2)", lambda o, y, n, dev: F.cross_entropy(o, y, reduction="sum")
     / torch.tensor(n - 2, device=dev), False),
    ("mean * 0.3", lambda o, y, n, dev: F.cross_entropy(o, y) * torch.tensor(0.3, device=dev),
     False),
    ("mean * 3", lambda o, y, n, dev: F.cross_entropy(o, y) * torch.tensor(3.0, device=dev),
     False),
    ("mean, one target ignored", lambda o, y, n, dev: F.cross_entropy(
        o, torch.where(torch.arange(n, device=dev) == 0, -100, y), ignore_index=-100), False),
])
def test_a_device_scalar_in_the_loss_is_judged_from_the_one_transfer(require_cuda, name, loss,
                                                                     accepted):
    """A divisor or scale held in a device tensor (a GradScaler's scale, a
    batch count) and a mean's count of valid targets are judged on the host
    from the value that travels with the clip op's one transfer: the step
    launches no comparison of its own, accepts the batch size, the number of
    terms and a scale of 1, and refuses anything else (a GradScaler's power of
    two among them) before writing."""
    from ncdp_fast.torch import GhostClipper
    from ncdp_fast.torch.loss_graph import LossRefused
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5)).to(require_cuda)
    n = 6
    x = torch.randn(n, 4).to(require_cuda)
    y = torch.randint(0, 5, (n,)).to(require_cuda)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=n, seed=1)
    loss(model(x), y, n, require_cuda).backward()
    with HostSyncCounter() as counter:
        if accepted:
            clipper.privatize_()
        else:
            with pytest.raises(LossRefused, match="not a sum of per-sample terms"):
                clipper.privatize_()
    assert _sync_sites(counter.in_library()) == {
        ("copy to the host", "_clip_results.py", "_accounting"): 1}
    assert all((p.grad is not None) == accepted for p in model.parameters()), name
    clipper.remove()


def test_the_sync_counter_sees_each_kind_of_host_wait(require_cuda):
    # The counter itself: each kind it claims to count is counted, and
    # device-side work is not.
    t = torch.arange(6.0, device=require_cuda)
    with HostSyncCounter() as counter:
        t.sum().item()
        bool(t[0] > 1)
        t.cpu()
        t.tolist()
        t.nonzero()
        t[t > 2]
        t.to("cpu")
        t * 2 + 1
        t.to(torch.float32)
    kinds = [kind for kind, _, _ in counter.events]
    assert Counter(kinds) == {"scalar read": 2, "copy to the host": 3,
                              "data-dependent shape": 1, "boolean-mask index": 1}, kinds
    assert np.all(np.isfinite(t.cpu().numpy()))


def test_the_sync_counter_sees_a_wait_inside_a_rule_in_backward(require_cuda):
    """The rules run inside backward, where the autograd engine carries no
    torch function mode: the counter enters itself there too.  A rule that
    reads a scalar is counted (at the clipper's rule call, the innermost
    frame of ncdp_fast); the same step with the plain rule counts only the
    clip op's one transfer.  Before, such a read went unseen."""
    from ncdp_fast.torch import GhostClipper
    from ncdp_fast.torch import register_layer
    from ncdp_fast.torch.layer_rules import linear_rule
    from ncdp_fast.torch.layers import RULES

    class Reading(nn.Linear):
        pass

    def reading_rule(module, calls, trainable):
        float(calls[0].grad.abs().max())        # a wait the counter must see
        return linear_rule(module, calls, trainable)
    model = nn.Sequential(Reading(4, 3), nn.Linear(3, 2)).to(require_cuda)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)).to(require_cuda)
    y = torch.tensor([0, 1, 1, 0, 1], device=require_cuda)
    counts = {}
    for rule in (linear_rule, reading_rule):
        register_layer(Reading)(rule)
        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                               expected_batch_size=5, seed=1)
        try:
            with HostSyncCounter() as counter:
                F.cross_entropy(model(x), y).backward()
                clipper.privatize_()
        finally:
            clipper.remove()
            RULES.pop(Reading, None)
        counts[rule.__name__] = Counter(kind for kind, _, _ in counter.in_library())
    assert counts == {"linear_rule": {"copy to the host": 1},
                      "reading_rule": {"copy to the host": 1, "scalar read": 1}}


def test_settle_reads_device_value_checks_in_one_transfer_when_not_deferred(require_cuda):
    """The loss check's own read of its device values (a step across ranks,
    where the clip op cannot carry them: ``settle(defer=False)``): a count in
    int64 beside a float32 total and a flag, each judged exactly as float64 --
    2^25 + 1 in int64 would round to 2^25 if stacked with the float32 value --
    in one transfer; a failing value refuses with its reason."""
    from ncdp_fast.torch.loss_graph import LossRefused, ValueCheck, _one_of
    from ncdp_fast.torch.loss_watch import LossWatch
    refused = []
    watch = LossWatch(torch.zeros((), device=require_cuda), True, lambda: refused.append(1))
    big = 2 ** 25 + 1

    def pending(count):
        return [(ValueCheck(torch.tensor(count, device=require_cuda), _one_of((big,))), "count"),
                (ValueCheck(torch.tensor(6.0, device=require_cuda), _one_of((6, 0))), "total"),
                (torch.tensor(True, device=require_cuda), "flag")]
    watch.pending = pending(big)
    with HostSyncCounter() as counter:
        assert watch.settle(defer=False) == []
    assert _sync_sites(counter.in_library()) == {
        ("copy to the host", "torch/loss_watch.py", "settle"): 1}
    watch.pending = pending(big - 1)
    with pytest.raises(LossRefused, match="count"):
        watch.settle(defer=False)
    assert refused == [1]
