"""PyTorch Lightning trains privately (issue 37): DPLightningCallback makes
``Trainer.fit`` the loop ``make_private`` gives -- the same Poisson batches,
the same clipped and noised steps, the same accountant -- logs epsilon,
resumes from Lightning's checkpoints, and refuses what it cannot keep exact.

Lightning is installed by ``make`` (the Makefile's dependency list): these
tests run in CI, they are not skipped."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ncdp_fast import _stream, privacy
from ncdp_fast.torch import PoissonBatchSampler, PrivacyEngine
from ncdp_fast.torch.lightning import DPLightningCallback

SEED = 5077        # the tests' own key, so that a run can be redone by hand
DELTA = 1e-5
N, BATCH = 64, 16  # q = 1/4: four Poisson batches per epoch
# The accountant is the engine's business, not Lightning's: "gdp" answers in
# microseconds where "prv" (the default) takes seconds per epsilon on this CPU.
ACCOUNTANT = "gdp"


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g))


def _net(init=0):
    torch.manual_seed(init)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


class Classifier(L.LightningModule):
    """A tiny MLP. ``via``: "forward" calls self(x) (the callback's default,
    module=None), "net" calls self.net(x) (module="net")."""

    def __init__(self, init=0, via="forward", lr=0.1, momentum=0.9):
        super().__init__()
        self.net, self.via, self.lr, self.momentum = _net(init), via, lr, momentum
        self.batches = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        return F.cross_entropy(self(x) if self.via == "forward" else self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.seen_grads = [p.grad for p in self.parameters()]

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def _callback(**kwargs):
    kwargs = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": DELTA,
              "accountant": ACCOUNTANT, **kwargs}
    return DPLightningCallback(**kwargs)


def _trainer(callbacks, logger=False, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    return L.Trainer(accelerator="cpu", devices=1, callbacks=callbacks, logger=logger,
                     enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                     **kwargs)


def _manual(steps, seed=SEED, init=0, lr=0.1, momentum=0.9, sigma=1.0, clip=1.0):
    """The same training as Opacus's loop over make_private's returns."""
    net = _net(init)
    engine = PrivacyEngine(accountant=ACCOUNTANT)
    pm, opt, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum),
        data_loader=DataLoader(_data(), batch_size=BATCH), noise_multiplier=sigma,
        max_grad_norm=clip, seed=seed)
    taken = 0
    while taken < steps:
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(pm(x), y).backward()
            opt.step()
            taken += 1
            if taken == steps:
                break
    return engine, net


def _eps(steps, sigma=1.0):
    """epsilon of ``steps`` Poisson steps at q = BATCH / N, by the accountant
    directly."""
    return privacy.Accountant().step(noise_multiplier=sigma, sample_rate=BATCH / N,
                                     steps=steps).epsilon(DELTA, ACCOUNTANT)


def test_fit_is_the_private_loop_and_logs_epsilon(tmp_path):
    """Two epochs of Trainer.fit (with validation) reach the parameters of the
    same two epochs of make_private's loop with the same key: the same Poisson
    batches, the same clipped, noised steps. Epsilon is logged at each epoch
    end and is the accountant's for the steps taken."""
    model = Classifier()
    cb = _callback(seed=SEED)
    trainer = _trainer([cb], logger=CSVLogger(tmp_path, name="run"))
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    trainer.fit(model, loader, DataLoader(_data(), batch_size=32))
    assert isinstance(cb.loader.batch_sampler, PoissonBatchSampler)
    sizes = [len(x) for x, _ in model.batches]
    assert len(sizes) == trainer.global_step == 8 and len(set(sizes)) > 1   # Poisson, not 16s
    assert cb.engine.accountant.total_steps == 8
    assert cb.engine.accountant.history == [(1.0, BATCH / N, 8)]
    # What runs before the step (gradient-norm logging, Lightning's clipping)
    # sees no gradient: the private one is written inside optimizer.step().
    assert model.seen_grads == [None] * 4

    rows = list(csv.DictReader(next(tmp_path.glob("run/*/metrics.csv")).read_text()
                               .splitlines()))
    logged = [float(r["epsilon"]) for r in rows if r.get("epsilon")]
    assert logged == [_eps(4), _eps(8)]
    assert logged[-1] == cb.epsilon == cb.engine.get_epsilon(DELTA)
    assert float(trainer.callback_metrics["epsilon"]) == cb.epsilon

    _stream._LEDGER.clear()              # the manual run, as its own process would
    engine, net = _manual(steps=8)
    assert engine.get_epsilon(DELTA) == cb.epsilon
    for a, b, a0 in zip(model.net.parameters(), net.parameters(), _net(0).parameters()):
        assert torch.equal(a, b) and not torch.equal(a, a0)


def test_one_step_is_the_clipped_sum_over_the_expected_batch_size():
    """sigma = 0: the step Lightning takes is SGD on sum_i clip_C(g_i) / (q n),
    each sample's gradient computed alone in float64 (module="net"; the loader
    from a LightningDataModule)."""
    model = Classifier(via="net", momentum=0.0)
    init = [p.detach().clone() for p in model.net.parameters()]
    cb = _callback(noise_multiplier=0.0, max_grad_norm=1.5, module="net", seed=SEED)
    data = L.LightningDataModule.from_datasets(train_dataset=_data(), batch_size=BATCH)
    _trainer([cb], max_steps=1).fit(model, datamodule=data)
    assert isinstance(cb.loader.batch_sampler, PoissonBatchSampler)
    x, y = model.batches[0]
    assert len(x) > 0 and cb.epsilon == float("inf")
    ref = _net(0).double()
    total = [torch.zeros_like(p, dtype=torch.float64) for p in init]
    norms = []
    for i in range(len(x)):
        ref.zero_grad()
        F.cross_entropy(ref(x[i:i + 1].double()), y[i:i + 1]).backward()
        g = [p.grad for p in ref.parameters()]
        norm = torch.sqrt(sum((t * t).sum() for t in g))
        norms.append(float(norm))
        for s, t in zip(total, g):
            s += t * min(1.0, 1.5 / float(norm))
    assert min(norms) < 1.5 < max(norms)             # some samples clipped, some not
    for p0, p, s in zip(init, model.net.parameters(), total):
        expected = p0.double() - 0.1 * s / (BATCH / N * N)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
        assert not torch.equal(p.detach(), p0)
    # After fit the hooks are gone: a backward gives the ordinary gradients
    # (under the clipper the parameters get none, the private one being written
    # at the step).
    model.zero_grad()
    F.cross_entropy(model.net(x), y).backward()
    assert all(p.grad is not None for p in model.net.parameters())


@pytest.mark.parametrize("where", ["epoch_end", "mid_epoch"])
def test_resume_from_a_lightning_checkpoint_keeps_epsilon_and_the_stream(tmp_path, where):
    """Lightning's checkpoint after two epochs (or mid-pass, after step 6 of
    the 4-batch passes), then Trainer.fit(ckpt_path=...) with a new callback (an
    OS key, replaced by the checkpoint's) and a model of other weights, to four
    epochs: the accountant, the parameters (momentum included) and epsilon are
    bit for bit those of four uninterrupted epochs. The resumed run continues
    the stream in the process that drew its first half: a range drawn twice
    would raise NoiseReuseWarning (an error here)."""
    first = _callback(seed=SEED)
    if where == "epoch_end":
        ckpt, stop, path = ModelCheckpoint(dirpath=tmp_path, save_last=True), {}, "last.ckpt"
    else:
        ckpt = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=6)
        stop, path = {"max_steps": 6}, "mid.ckpt"
    _trainer([first, ckpt], **stop).fit(Classifier(), DataLoader(_data(), batch_size=BATCH))
    taken = first.engine.accountant.total_steps
    assert taken == (8 if where == "epoch_end" else 6)
    state = torch.load(tmp_path / path, weights_only=True)
    assert "ncdp_noise" in state["optimizer_states"][0]          # the key: a private file

    resumed, model = _callback(), Classifier(init=1)
    trainer = _trainer([resumed], max_epochs=4)
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH), ckpt_path=tmp_path / path)
    assert trainer.global_step == 16 and len(model.batches) == 16 - taken
    assert resumed.engine.accountant.history == [(1.0, BATCH / N, 16)]
    assert resumed.epsilon == _eps(16) > first.epsilon

    _stream._LEDGER.clear()
    engine, net = _manual(steps=16)
    assert engine.get_epsilon(DELTA) == resumed.epsilon
    for a, b in zip(model.net.parameters(), net.parameters()):
        assert torch.equal(a, b)

    # Another noise multiplier: its epsilon would not be this history's.
    _stream._LEDGER.clear()
    other = _callback(noise_multiplier=2.0)
    with pytest.raises(ValueError, match=r"noise_multiplier: the checkpoint was taken with "
                                         r"noise_multiplier=1.0, this run has 2.0"):
        _trainer([other], max_epochs=4).fit(Classifier(), DataLoader(_data(), batch_size=BATCH),
                                            ckpt_path=tmp_path / path)
    assert other.engine.accountant.total_steps == 0


class _Manual(Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _SkipsSteps(Classifier):
    def training_step(self, batch, batch_idx):
        return None      # Lightning's way to skip a batch; a Poisson step cannot be skipped


@pytest.mark.parametrize("trainer_kwargs, model_cls, error, match", [
    ({"accumulate_grad_batches": 2}, Classifier, ValueError,
     r"accumulate_grad_batches: expected 1, got 2"),
    ({"gradient_clip_val": 1.0}, Classifier, ValueError,
     r"gradient_clip_val: expected None, got 1.0"),
    ({"precision": "bf16-mixed"}, Classifier, ValueError,
     r"precision: expected '32-true', got 'bf16-mixed'"),
    ({"precision": "64-true"}, Classifier, ValueError,
     r"precision: expected '32-true', got '64-true'"),
    ({"overfit_batches": 2}, Classifier, ValueError, r"overfit_batches: expected 0, got 2"),
    ({"limit_train_batches": 0.5}, Classifier, ValueError,
     r"limit_train_batches: expected 1.0 .* got 0.5 for 4 batches"),
    ({"limit_train_batches": 2}, Classifier, ValueError,
     r"limit_train_batches: expected 1.0 .* got 2 for 4 batches"),
    ({}, _Manual, ValueError, r"automatic_optimization: expected True .* got False"),
], ids=["accumulate", "clip", "bf16", "float64", "overfit", "limit-fraction", "limit-count",
        "manual"])
def test_settings_that_change_the_mechanism_are_refused(trainer_kwargs, model_cls, error, match):
    cb = _callback()
    model = model_cls()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        _trainer([cb], **trainer_kwargs).fit(model, DataLoader(_data(), batch_size=BATCH))
    assert cb.engine.accountant.total_steps == 0 and not model.batches
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_loss_reduction_that_does_not_match_the_loss_warns_through_lightning():
    """The audit of 2026-12-02: Lightning divides each training_step's loss by
    accumulate_grad_batches (1), which the loss check took as a factor that
    may turn a mean into a sum, so loss_reduction="sum" with a mean loss gave
    no LossReductionWarning (the update 0.51 off the declared sum's); a plain
    GhostClipper loop warned.  A factor of exactly 1 is no scaling now."""
    from ncdp_fast.torch import LossReductionWarning
    with pytest.warns(LossReductionWarning, match="loss_reduction='sum', but the loss is the "
                                                  "mean"):
        _trainer([_callback(loss_reduction="sum")], max_steps=1).fit(
            Classifier(), DataLoader(_data(), batch_size=BATCH))


def test_a_gradient_accumulation_schedule_is_refused_before_any_step():
    """The sixth audit: GradientAccumulationScheduler({1: 2}) left epoch 0 at
    accumulate_grad_batches 1, so setup's check passed, and epoch 1 met the
    clipper's second-forward refusal, which named neither.  Refused at setup."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    model = Classifier()
    cb = _callback()
    with pytest.raises(ValueError, match=r"callbacks: expected no GradientAccumulationScheduler "
                                         r"accumulating batches, got scheduling \{1: 2"):
        _trainer([GradientAccumulationScheduler({1: 2}), cb], max_epochs=3).fit(
            model, DataLoader(_data(), batch_size=BATCH))
    assert cb.engine.accountant.total_steps == 0


@pytest.mark.parametrize("tuner", ["LearningRateFinder", "BatchSizeFinder"])
def test_a_tuner_callback_is_refused_before_any_step(tuner):
    """The audit of 2026-12-02: a LearningRateFinder next to the callback ran 4
    training steps on the private data with ordinary gradients (no clipping,
    no noise, nothing accounted) before the loader check refused at
    on_train_start.  Tuners are refused at setup now, before any step."""
    from lightning.pytorch import callbacks

    class Tuned(Classifier):            # the batch-size finder tunes the module's own loader
        batch_size = BATCH

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=self.batch_size)

    finder = getattr(callbacks, tuner)()
    model = Tuned()
    before = [p.detach().clone() for p in model.parameters()]
    cb = _callback()
    with pytest.raises(ValueError, match=rf"callbacks: expected no tuner, got \['{tuner}'\]"):
        _trainer([finder, cb]).fit(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert cb.engine.accountant.total_steps == 0


def test_other_refusals():
    # Several devices: checked in setup, before Lightning would launch ranks.
    cb = _callback()
    trainer = L.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"strategy: expected a single device .* got "
                                         r"DDPStrategy on 2 device"):
        cb.setup(trainer, Classifier(), "fit")
    loader = DataLoader(_data(), batch_size=BATCH)
    with pytest.raises(TypeError, match=r"train_dataloaders: expected one torch.utils.data."
                                        r"DataLoader, got list"):
        _trainer([cb]).fit(Classifier(), [loader, loader])
    cb = _callback(module="body")
    with pytest.raises(TypeError, match=r"module: expected the name of an nn.Module attribute "
                                        r"of Classifier, got 'body' holding NoneType"):
        _trainer([cb]).fit(Classifier(), loader)
    with pytest.raises(ValueError, match=r"delta: expected a number in \(0, 1\), got 0"):
        _callback(delta=0)
    with pytest.raises(ValueError, match=r"noise_multiplier: expected a finite number >= 0, "
                                         r"got -1"):
        _callback(noise_multiplier=-1)
    with pytest.raises(ValueError, match=r"max_grad_norm: expected a finite number > 0, got 0"):
        _callback(max_grad_norm=0)
    with pytest.raises(ValueError, match=r"clipping: expected one of \['flat', 'per_layer'\], "
                                         r"got 'adaptive'"):
        _callback(clipping="adaptive")
    with pytest.raises(ValueError, match=r"forwards_per_step: expected an integer >= 1, got 0"):
        _callback(forwards_per_step=0)
    # A second forward of the network in one training_step (two batches under
    # one step) is refused by make_private's default; the number passes through.
    assert _callback(forwards_per_step=3)._args["forwards_per_step"] == 3
    # A batch skipped (training_step returns None, as one might for an empty
    # batch): the step would release nothing yet draw the next batch's noise.
    cb = _callback()
    with pytest.raises(RuntimeError, match=r"no forward/backward was recorded since the last "
                                           r"step"):
        _trainer([cb]).fit(_SkipsSteps(), loader)
    assert cb.engine.accountant.total_steps == 0
    # One callback, one fit: a second would stack hooks (and with a fixed seed
    # draw the first fit's noise again).
    cb = _callback()
    model = Classifier()
    _trainer([cb], max_steps=1).fit(model, loader)
    with pytest.raises(RuntimeError, match=r"expected a new callback for each Trainer.fit"):
        _trainer([cb], max_steps=1).fit(model, loader)
    assert cb.engine.accountant.total_steps == 1


def test_ncdp_fast_torch_does_not_import_lightning():
    code = ("import sys, ncdp_fast.torch; "
            "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') "
            "for m in sys.modules), sorted(m for m in sys.modules if 'lightning' in m)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_documented_examples_run(tmp_path, monkeypatch):
    """docs/lightning.md's two examples, as written (their own data, an OS key,
    the default accountant): three epochs, then two and a resume to four."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "lightning.md").read_text()
    blocks = [b.split("```", 1)[0] for b in doc.split("```python\n")[1:]]
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "lightning_example"}
    exec(compile(blocks[0], "docs/lightning.md", "exec"), scope)
    dp, trainer = scope["dp"], scope["trainer"]
    assert trainer.global_step == 3 * 8 == dp.engine.accountant.total_steps
    assert 0 < dp.epsilon < float("inf")
    assert float(trainer.callback_metrics["epsilon"]) == dp.epsilon
    exec(compile(blocks[1], "docs/lightning.md", "exec"), scope)
    dp, trainer = scope["dp"], scope["trainer"]
    assert trainer.global_step == 4 * 8 == dp.engine.accountant.total_steps
    assert dp.engine.accountant.history == [(1.0, 1 / 8, 32)]
