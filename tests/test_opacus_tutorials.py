"""Opacus's tutorials, written as an Opacus user writes them, run once with
Opacus's imports and once with ncdp_fast.torch's: the script body is the same
function, only the imported names differ (issue 25: "Opacus users migrate by
changing imports").

Shapes of the tutorials, shrunk to a few steps on synthetic data:
* CNN (Opacus's CIFAR-10 tutorial): ModuleValidator.fix on a net with batch
  norm, make_private_with_epsilon, BatchMemoryManager with a physical batch
  smaller than the logical one, get_epsilon.
* text classifier: Opacus's tutorials use BERT or a DPLSTM; the nearest model
  both libraries train unmodified is Embedding -> mean over tokens -> MLP
  (an LSTM is refused here, and Opacus needs DPMultiheadAttention for attention).
* MLP with its first layer frozen, make_private(noise_multiplier=...).
* bag classifier: PyTorch's text-classification tutorial (nn.EmbeddingBag over
  flat tokens with offsets, its collate_batch and loop, clip_grad_norm_
  included), made private with make_private.

The two accountants ("prv" both; ncdp_fast's is dp-accounting's PLD) must give
the same epsilon within 1%, and make_private_with_epsilon the same sigma within
1% (each library calibrates by its own search, so the two may differ by their
search tolerances, well inside 1% here).
"""
from __future__ import annotations

import functools
import math
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def _opacus():
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from opacus.validators import ModuleValidator
    return types.SimpleNamespace(PrivacyEngine=PrivacyEngine,
                                 BatchMemoryManager=BatchMemoryManager,
                                 ModuleValidator=ModuleValidator)


def _ncdp():
    from ncdp_fast.torch import BatchMemoryManager, ModuleValidator, PrivacyEngine
    return types.SimpleNamespace(PrivacyEngine=PrivacyEngine,
                                 BatchMemoryManager=BatchMemoryManager,
                                 ModuleValidator=ModuleValidator)


FRAMEWORKS = {"opacus": _opacus, "ncdp_fast": _ncdp}
DELTA = 1e-5


# ------------------------------------------------------------------ the scripts
def train(model, optimizer, train_loader, criterion, losses):
    """One epoch, the loop of Opacus's tutorials."""
    model.train()
    for inputs, target in train_loader:
        optimizer.zero_grad()
        loss = criterion(model(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())


def cnn_tutorial(lib):
    PrivacyEngine, BatchMemoryManager, ModuleValidator = (
        lib.PrivacyEngine, lib.BatchMemoryManager, lib.ModuleValidator)
    x = torch.randn(96, 3, 8, 8)
    y = (x[:, 0].mean((1, 2)) > 0).long()
    train_loader = DataLoader(TensorDataset(x, y), batch_size=24)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 2))
    model = ModuleValidator.fix(model)
    assert not ModuleValidator.validate(model, strict=False)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=train_loader,
        epochs=2, target_epsilon=8.0, target_delta=DELTA, max_grad_norm=1.0)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(2):
        with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=8,
                                optimizer=optimizer) as memory_safe_data_loader:
            train(model, optimizer, memory_safe_data_loader, criterion, losses)
    return optimizer.noise_multiplier, privacy_engine.get_epsilon(DELTA), losses


def text_tutorial(lib):
    PrivacyEngine = lib.PrivacyEngine

    class TextClassifier(nn.Module):
        def __init__(self, vocab=50, dim=16, classes=3):
            super().__init__()
            self.embedding = nn.Embedding(vocab, dim)
            self.fc1 = nn.Linear(dim, 16)
            self.fc2 = nn.Linear(16, classes)

        def forward(self, tokens):
            h = self.embedding(tokens).mean(dim=1)
            return self.fc2(torch.relu(self.fc1(h)))

    tokens = torch.randint(0, 50, (80, 12))
    labels = tokens[:, 0] % 3
    train_loader = DataLoader(TensorDataset(tokens, labels), batch_size=16)
    model = TextClassifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader,
        noise_multiplier=1.1, max_grad_norm=1.0)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(2):
        train(model, optimizer, train_loader, criterion, losses)
    return optimizer.noise_multiplier, privacy_engine.get_epsilon(DELTA), losses


def mlp_frozen_tutorial(lib):
    PrivacyEngine = lib.PrivacyEngine
    x = torch.randn(64, 20)
    y = (x[:, 0] > 0).long()
    train_loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))
    for p in model[0].parameters():
        p.requires_grad = False
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader,
        noise_multiplier=0.8, max_grad_norm=1.0)
    criterion = nn.CrossEntropyLoss()
    frozen = [p.detach().clone() for p in model.parameters() if not p.requires_grad]
    losses = []
    for _ in range(3):
        train(model, optimizer, train_loader, criterion, losses)
    still = [p for p in model.parameters() if not p.requires_grad]
    assert len(still) == 2 and all(torch.equal(a, b) for a, b in zip(frozen, still))
    return optimizer.noise_multiplier, privacy_engine.get_epsilon(DELTA), losses


def bag_tutorial(lib):
    """PyTorch's text-classification tutorial (EmbeddingBag over flat tokens
    with offsets, its collate_batch, its loop with clip_grad_norm_) made
    private the Opacus way."""
    PrivacyEngine = lib.PrivacyEngine

    class TextClassificationModel(nn.Module):
        def __init__(self, vocab_size=50, embed_dim=16, num_class=4):
            super().__init__()
            self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, sparse=False)
            self.fc = nn.Linear(embed_dim, num_class)
            initrange = 0.5
            self.embedding.weight.data.uniform_(-initrange, initrange)
            self.fc.weight.data.uniform_(-initrange, initrange)
            self.fc.bias.data.zero_()

        def forward(self, text, offsets):
            embedded = self.embedding(text, offsets)
            return self.fc(embedded)

    def collate_batch(batch):
        label_list, text_list, offsets = [], [], [0]
        for _label, _text in batch:
            label_list.append(_label)
            processed_text = torch.tensor(_text, dtype=torch.int64)
            text_list.append(processed_text)
            offsets.append(processed_text.size(0))
        label_list = torch.tensor(label_list, dtype=torch.int64)
        offsets = torch.tensor(offsets[:-1]).cumsum(dim=0)
        text_list = torch.cat(text_list)
        return label_list, text_list, offsets

    lengths = torch.randint(3, 11, (80,)).tolist()
    dataset = [(int(t[0]) % 4, t.tolist()) for t in (torch.randint(0, 50, (n,)) for n in lengths)]
    train_loader = DataLoader(dataset, batch_size=16, collate_fn=collate_batch)
    model = TextClassificationModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader,
        noise_multiplier=1.0, max_grad_norm=1.0)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(2):
        model.train()
        for label, text, offsets in train_loader:
            optimizer.zero_grad()
            predicted_label = model(text, offsets)
            loss = criterion(predicted_label, label)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            losses.append(loss.item())
    return optimizer.noise_multiplier, privacy_engine.get_epsilon(DELTA), losses


TUTORIALS = {"cnn": cnn_tutorial, "text": text_tutorial, "mlp_frozen": mlp_frozen_tutorial,
             "bag": bag_tutorial}


@functools.lru_cache(maxsize=None)
def _run(tutorial, framework):
    torch.manual_seed(0)        # the data and the initial weights; the noise's seed is the OS's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Opacus's secure-RNG and hook-mode warnings
        return TUTORIALS[tutorial](FRAMEWORKS[framework]())


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
@pytest.mark.parametrize("tutorial", sorted(TUTORIALS))
def test_tutorial_runs(tutorial, framework):
    sigma, eps, losses = _run(tutorial, framework)
    assert losses and all(math.isfinite(v) for v in losses)
    assert sigma > 0 and math.isfinite(eps) and eps > 0


@pytest.mark.parametrize("tutorial", sorted(TUTORIALS))
def test_tutorial_matches_opacus_privacy(tutorial):
    sigma_o, eps_o, _ = _run(tutorial, "opacus")
    sigma_n, eps_n, _ = _run(tutorial, "ncdp_fast")
    assert sigma_n == pytest.approx(sigma_o, rel=0.01)
    assert eps_n == pytest.approx(eps_o, rel=0.01)
