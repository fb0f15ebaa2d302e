"""Audit of a user's own make_private loop (ncdp_fast.audit.canaries): the
canary-wrapping dataset and the black-box loss scorer, on a small model.

False alarm of the honest test: at most 1 - confidence = 1 % (fixed seed)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ncdp_fast.audit import CanaryDataset, model_loss_scores  # noqa: E402
from ncdp_fast.torch import PrivacyEngine  # noqa: E402

D, K = 40, 5


def _train(noise_multiplier, seed, *, max_grad_norm=1.0, lr=0.5, epochs=20):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(100, D, generator=g, dtype=torch.float64)
    y = (x[:, :K].argmax(1))
    train = torch.utils.data.TensorDataset(x, y)
    # canaries: random inputs with random labels, which only memorisation fits
    cx = 2.0 * torch.randn(100, D, generator=g, dtype=torch.float64)
    cy = torch.randint(0, K, (100,), generator=g)
    canaries = torch.utils.data.TensorDataset(cx, cy)
    data = CanaryDataset(train, canaries, seed=seed)
    loader = torch.utils.data.DataLoader(data, batch_size=len(data))       # q = 1
    model = torch.nn.Linear(D, K, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, seed=seed)
    crit = torch.nn.CrossEntropyLoss()
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            crit(model(xb), yb).backward()
            opt.step()
    scores = model_loss_scores(model, canaries, torch.nn.CrossEntropyLoss(reduction="none"))
    return data, scores, engine.get_epsilon(1e-5)


def test_wrapper_appends_the_included_canaries_only():
    base = [(i, 0) for i in range(5)]
    can = [(100 + i, 1) for i in range(40)]
    data = CanaryDataset(base, can, seed=3)
    assert len(data) == 5 + data.included_count and 0 < data.included_count < 40
    got = [data[i] for i in range(len(data))]
    assert got[:5] == base and set(got[5:]) < set(can) and len(set(got[5:])) == len(got) - 5
    assert data[-1] == got[-1]
    assert "membership" not in repr(data) and repr(data) == \
        "CanaryDataset(samples=5, canaries=40)"
    # the guesses made from the canaries' presence are all right
    present = np.array([c in got for c in can])
    res = data.audit(present.astype(float), delta=1e-5, k=data.included_count // 2)
    assert res.correct == res.guesses
    with pytest.raises(IndexError):
        data[len(data)]
    with pytest.raises(ValueError, match="^scores:"):
        data.audit(np.zeros(3), delta=1e-5)


def test_memorising_run_is_caught_and_dp_run_is_not():
    # sigma = 0 and a bound no gradient reaches: plain SGD, reported as eps = inf
    leaky, scores, eps = _train(noise_multiplier=0.0, seed=41, max_grad_norm=1e3, lr=5.0)
    assert eps == float("inf")
    res = leaky.audit(scores, delta=1e-5, epsilon_claimed=eps)
    assert res.epsilon_lower_bound > 0.5 and res.epsilon_lower_bound_gdp > 0.5, res.summary()
    honest, scores, eps = _train(noise_multiplier=2.0, seed=42)
    res = honest.audit(scores, delta=1e-5, epsilon_claimed=eps, confidence=0.99)
    assert res.epsilon_lower_bound < eps and res.epsilon_lower_bound_gdp < eps


def test_scorer_checks_per_sample_losses_and_restores_mode():
    model = torch.nn.Linear(3, 2)
    can = [(torch.zeros(3), torch.tensor(0)) for _ in range(4)]
    model.train()
    s = model_loss_scores(model, can, torch.nn.CrossEntropyLoss(reduction="none"))
    assert s.shape == (4,) and model.training and np.all(s <= 0)
    with pytest.raises(ValueError, match="^loss_fn:"):
        model_loss_scores(model, can, torch.nn.CrossEntropyLoss())
