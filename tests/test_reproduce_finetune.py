"""The dp-finetune reproduction (ncdp_fast/reproduce/finetune.py): the network it
fine-tunes computes what the package's EfficientNet-Lite0 computes, both arms are
accounted at the same (epsilon, delta), and a tiny synthetic run goes end to end
(no data, no weights, seconds)."""
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ncdp_fast.reproduce import REPRODUCTIONS, finetune  # noqa: E402


def test_registered():
    assert REPRODUCTIONS["dp-finetune"][:2] == ("ncdp_fast.reproduce.finetune", "main")


@pytest.mark.parametrize("res", [28, 32, 33])
def test_plain_convs_compute_the_same_network(res):
    """SameConv2d -> Conv2d / ZeroPad2d + Conv2d: same outputs (odd sizes too)."""
    from torch import nn

    from ncdp_fast.datasets._efficientnet import efficientnet_lite0
    torch.manual_seed(0)
    ref = efficientnet_lite0(pretrained=False).eval()
    for m in ref.modules():                          # non-trivial BN statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    import copy
    plain = finetune.plain_convs(copy.deepcopy(ref), res).eval()
    assert not any(type(m).__name__ == "SameConv2d" for m in plain.modules())
    x = torch.randn(2, 3, res, res)
    with torch.no_grad():
        torch.testing.assert_close(plain.features(x), ref.features(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("batchnorm", ["fold", "groupnorm"])
def test_finetune_model_trains_privately_every_weight(batchnorm):
    from ncdp_fast.torch import GhostClipper
    model = finetune.finetune_model(num_classes=3, resolution=32, pretrained=False, blocks=2,
                                    batchnorm=batchnorm)
    assert all(p.requires_grad for p in model.parameters())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=4, seed=1)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    res = clipper.privatize_()
    assert res.norms.shape == (4,) and torch.isfinite(res.norms).all()
    assert all(p.grad is not None for p in model.parameters())


def test_both_arms_are_accounted_at_the_same_epsilon():
    """The engine's "prv" and NoisySGDClassifier's "pld" calibrate the same sigma for
    the same (epsilon, delta, q, steps)."""
    from torch.utils.data import DataLoader, TensorDataset

    from ncdp_fast.torch import PrivacyEngine
    from ncdp_fast.train import NoisySGDClassifier
    n, batch, epochs, eps, delta = 200, 20, 2, 4.0, 1e-5
    engine = PrivacyEngine(accountant="prv")
    model = torch.nn.Linear(5, 3)
    loader = DataLoader(TensorDataset(torch.randn(n, 5), torch.zeros(n, dtype=torch.long)),
                        batch_size=batch)
    _, opt, _ = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, target_epsilon=eps, target_delta=delta, epochs=epochs,
        max_grad_norm=1.0, seed=1)
    X = np.random.default_rng(0).standard_normal((n, 5)).astype(np.float32)
    clf = NoisySGDClassifier(epsilon=eps, delta=delta, sample_rate=batch / n, epochs=epochs,
                             accountant="pld", num_classes=3, seed=2).fit(X, np.arange(n) % 3)
    assert clf.steps_ == epochs * len(loader)
    assert opt.noise_multiplier == pytest.approx(clf.noise_multiplier_, rel=1e-6)


def test_synthetic_smoke_run(tmp_path, capsys):
    rc = finetune.main(["--synthetic", "--no-pretrained", "--blocks", "1", "--train-size", "40",
                        "--test-size", "20", "--resolution", "32", "--batch", "10",
                        "--epochs", "1", "--eps", "8", "--ll-epochs", "1", "--seed", "7",
                        "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "full fine-tuning: step 4/4" in out           # progress is shown
    (jp,) = tmp_path.glob("dp_finetune-cpu-*.json")
    assert list(tmp_path.glob("dp_finetune-cpu-*.png")) and list(tmp_path.glob("*.md"))
    doc = json.loads(jp.read_text())
    assert doc["meta"]["synthetic"] is True and doc["meta"]["seed"] == 7
    rows = doc["rows"]
    arms = [(r["epsilon"], r["arm"]) for r in rows]
    assert arms == [(None, "last layer, non-private"),
                    (8.0, "last layer (same images)"), (8.0, "full fine-tuning")]
    for r in rows[1:]:
        # Each arm spends its budget, no more (its own accountant after training).
        assert r["epsilon"] * 0.9 <= r["epsilon_spent"] <= r["epsilon"] * (1 + 1e-6)
        assert 0.0 <= r["accuracy"] <= 100.0 and r["n_train"] == 40
    (ft,) = [r for r in rows if r["arm"] == "full fine-tuning"]
    assert ft["steps"] == 4 and ft["sigma"] > 0
    assert math.isinf(rows[0]["epsilon_spent"])
    assert "SYNTHETIC" in (tmp_path / jp.name.replace(".json", ".md")).read_text()
