"""PyTorch Lightning: ``Trainer.fit`` trains a LightningModule privately.

:class:`DPLightningCallback` calls :meth:`PrivacyEngine.make_private` once
Lightning has built the optimizer (``on_fit_start``): the network, the
optimizer ``configure_optimizers`` returned and the train DataLoader become
the private network, the :class:`DPOptimizer` Lightning steps, and the
Poisson loader Lightning iterates.  ``training_step`` is unchanged: the loss
it returns (a mean, or sum, of per-sample terms) is clipped per sample and
noised by the ``optimizer.step()`` Lightning calls for every batch.

Needs ``lightning`` (``pip install lightning``); imported by this module only,
never by :mod:`ncdp_fast.torch`.  docs/lightning.md has the example and what
is refused and why.
"""
from __future__ import annotations

import io
import warnings

import torch
from lightning.pytorch.callbacks import (BatchSizeFinder, Callback,
                                         GradientAccumulationScheduler, LearningRateFinder)
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader

from .._validate import (check_bool, check_choice, check_delta, check_nonneg, check_pos_int,
                         check_positive)
from .checkpoint import OPTIMIZER_LEFT_OUT as _OPTIMIZER_LEFT_OUT
from .engine import PrivacyEngine

__all__ = ["DPLightningCallback"]

# The engine's checkpoint entry that Lightning stores on its own (the weights).
_MODULE = "module_state_dict"


class DPLightningCallback(Callback):
    """Make ``Trainer.fit`` a DP-SGD run (one Poisson-subsampled Gaussian
    mechanism per optimizer step), accounted by :attr:`engine`.

    Args:
        noise_multiplier: sigma >= 0; each step's noise has std
            ``noise_multiplier * max_grad_norm`` (0: no privacy, epsilon inf).
        max_grad_norm: C > 0, the bound on each sample's gradient (flat
            clipping); with ``clipping="per_layer"`` one bound per trainable
            parameter.  It is the sensitivity of each step's clipped sum.
        delta: the delta at which epsilon is logged (``log_name``) at the end
            of every training epoch, and :attr:`epsilon` answers.
        module: the name of the LightningModule's attribute holding the
            network that ``training_step`` calls with the batch (``"net"``
            for ``self.net(x)``), or None: the LightningModule itself, whose
            ``forward`` ``training_step`` calls (``self(x)``).  Dimension 0 of
            its first tensor argument is the batch; every trainable parameter
            must be in it.
        loss_reduction: "mean" or "sum", as ``training_step``'s loss over the
            batch ("mean": the private gradient is divided by the expected
            batch size, never the realized one).
        clipping: "flat" or "per_layer" (:meth:`PrivacyEngine.make_private`'s).
        batch_first, check_loss, forwards_per_step: :meth:`PrivacyEngine.make_private`'s.
        accountant: the engine's ("prv", "pld", "rdp", "gdp").
        seed: the key of the one stream the batches and the noise are drawn
            from (default: the OS).  A fixed seed is for tests; a resumed run
            takes the checkpoint's.
        log_name: the name epsilon is logged under.

    The sample rate is q = 1 / len(train DataLoader), the expected batch size
    q * len(dataset): the loader's batch size sets the expected size, its
    sampler is replaced by Poisson sampling (empty batches included:
    ``training_step`` must return the loss of an empty batch too, which is a
    noise-only step).  Lightning checkpoints carry the engine's state
    (:meth:`state_dict`): ``Trainer.fit(ckpt_path=...)`` with a new callback
    continues the accountant and the noise stream.  Such a checkpoint holds the
    secret noise key; keep it as private as the data.
    """

    def __init__(self, *, noise_multiplier, max_grad_norm, delta, module: str | None = None,
                 loss_reduction: str = "mean", clipping: str = "flat", batch_first: bool = True,
                 check_loss: bool = True, accountant: str = "prv", seed=None,
                 log_name: str = "epsilon", forwards_per_step: int = 1):
        if module is not None and not isinstance(module, str):
            raise TypeError(f"module: expected None or the name of the LightningModule's "
                            f"attribute holding the network, got {type(module).__name__}")
        if not isinstance(log_name, str) or not log_name:
            raise TypeError(f"log_name: expected a non-empty str, got {log_name!r}")
        # Checked here, not first at on_fit_start, once Lightning has started.
        check_nonneg(noise_multiplier, "noise_multiplier")
        check_choice(clipping, "clipping", ("flat", "per_layer"))
        if clipping == "flat":
            check_positive(max_grad_norm, "max_grad_norm")
        check_choice(loss_reduction, "loss_reduction", ("mean", "sum"))
        self.delta = check_delta(delta)
        self.module = module
        self.log_name = log_name
        self._args = dict(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                          loss_reduction=loss_reduction, clipping=clipping,
                          batch_first=check_bool(batch_first, "batch_first"),
                          check_loss=check_bool(check_loss, "check_loss"), seed=seed,
                          forwards_per_step=check_pos_int(forwards_per_step,
                                                          "forwards_per_step"))
        self.engine = PrivacyEngine(accountant=accountant)
        self.optimizer = self.loader = self._net = None
        # The engine state of the checkpoint Lightning resumes from, restored
        # once make_private has built what it restores into.
        self._restore = None

    @property
    def epsilon(self) -> float:
        """epsilon at :attr:`delta` of the private steps taken so far."""
        return self.engine.get_epsilon(self.delta)

    # ------------------------------------------------------------- refusals
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if self.optimizer is not None:
            # A second make_private on the same network would stack hooks, and a
            # fixed seed would draw the first run's noise again.
            raise RuntimeError("DPLightningCallback: expected a new callback for each "
                               "Trainer.fit, got one that already trained; resume with a new "
                               "callback and Trainer.fit(ckpt_path=...)")
        if pl_module.automatic_optimization is not True:
            raise ValueError("automatic_optimization: expected True (Lightning then calls "
                             "optimizer.step once per batch, the private step), got "
                             f"{pl_module.automatic_optimization!r}; manual optimization is "
                             "not supported")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches: expected 1, got {trainer.accumulate_grad_batches}; "
                "several Poisson batches summed into one step are not a Poisson batch of the "
                "accounted rate (raise the DataLoader's batch_size instead)")
        scheduled = [c.scheduling for c in trainer.callbacks
                     if isinstance(c, GradientAccumulationScheduler)
                     and any(v != 1 for v in c.scheduling.values())]
        if scheduled:
            # It sets accumulate_grad_batches at an epoch's start: a later epoch
            # would sum Poisson batches into one step (the sixth audit met the
            # clipper's second-forward refusal there, naming neither).
            raise ValueError(
                f"callbacks: expected no GradientAccumulationScheduler accumulating batches, "
                f"got scheduling {scheduled[0]!r}: accumulate_grad_batches must stay 1 (several "
                "Poisson batches summed into one step are not a Poisson batch of the accounted "
                "rate); raise the DataLoader's batch_size instead")
        if trainer.gradient_clip_val not in (None, 0):
            raise ValueError(
                f"gradient_clip_val: expected None, got {trainer.gradient_clip_val!r}; "
                "Lightning clips p.grad before optimizer.step(), where the private gradient "
                "is not written yet: it would clip nothing. max_grad_norm is the per-sample "
                "bound")
        if trainer.precision != "32-true":
            raise ValueError(f"precision: expected '32-true', got {trainer.precision!r}; "
                             "mixed and half precision plugins (GradScaler, autocast) are not "
                             "supported here")
        if type(trainer.strategy) is not SingleDeviceStrategy:
            raise ValueError(
                f"strategy: expected a single device (devices=1, num_nodes=1, strategy='auto'), "
                f"got {type(trainer.strategy).__name__} on {trainer.num_devices} device(s) x "
                f"{trainer.num_nodes} node(s); DDP would average unnoised gradients across "
                "ranks (ncdp_fast's group= is not wired to Lightning)")
        tuners = [type(c).__name__ for c in trainer.callbacks
                  if isinstance(c, (BatchSizeFinder, LearningRateFinder))]
        if tuners:
            # They run training steps of their own on the private data inside
            # fit, before the private loop is wired (the fifth audit: a
            # LearningRateFinder took 4 unclipped, unnoised steps before the
            # loader check refused), and pick a setting from it.
            raise ValueError(
                f"callbacks: expected no tuner, got {tuners}: it trains on the private data "
                "inside fit with ordinary gradients (no clipping, no noise, not accounted) and "
                "picks a setting from them. Tune on public or synthetic data, then fit with "
                "the chosen setting")
        if trainer.overfit_batches not in (0, 0.0):
            raise ValueError(f"overfit_batches: expected 0, got {trainer.overfit_batches!r}; "
                             "it replaces the sampler, so the batches would not be Poisson")

    # ---------------------------------------------------------------- wiring
    def on_fit_start(self, trainer, pl_module) -> None:
        net = pl_module if self.module is None else getattr(pl_module, self.module, None)
        if not isinstance(net, nn.Module):
            raise TypeError(f"module: expected the name of an nn.Module attribute of "
                            f"{type(pl_module).__name__}, got {self.module!r} holding "
                            f"{type(net).__name__}")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"configure_optimizers: expected one optimizer, got "
                             f"{len(trainer.optimizers)}")
        # Lightning's own record of where the train loader comes from (a loader
        # passed to fit, a LightningModule or a LightningDataModule); what Opacus's
        # Lightning example reads too.  Pointed at the Poisson loader below.
        source = getattr(trainer.fit_loop, "_data_source", None)
        if source is None or not hasattr(source, "instance"):
            raise RuntimeError("DPLightningCallback: this Lightning version has no "
                               "fit_loop._data_source; tested with lightning 2.6")
        loader = source.dataloader()
        if not isinstance(loader, DataLoader):
            raise TypeError(f"train_dataloaders: expected one torch.utils.data.DataLoader, "
                            f"got {type(loader).__name__}")
        limit = trainer.limit_train_batches
        cut = limit != 1.0 if isinstance(limit, float) else limit < len(loader)
        if cut:
            raise ValueError(f"limit_train_batches: expected 1.0 (every batch of a pass), got "
                             f"{limit!r} for {len(loader)} batches; a pass cut short leaves "
                             "its drawn batches unused and a resumed run would not match")
        net, optimizer, loader = self.engine.make_private(
            module=net, optimizer=trainer.optimizers[0], data_loader=loader,
            wrap_model=False, **self._args)
        self._net, self.optimizer, self.loader = net, optimizer, loader
        # An LR scheduler built on the wrapped optimizer still sets the learning
        # rate the DPOptimizer steps with: the param_groups are the same list.
        trainer.strategy.optimizers = [optimizer]
        source.instance = loader
        if self._restore is not None:
            self._load(self._restore)
            self._restore = None

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.train_dataloader is not self.loader:
            raise RuntimeError("DPLightningCallback: Lightning iterates another loader than "
                               "the Poisson loader make_private built (a DataLoader replaced "
                               "after on_fit_start?); its batches would not be accounted")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # batch_size=1: one value per epoch (Lightning would weigh it by the last
        # batch's size, 0 for an empty Poisson batch).
        # float64: a Python float would be logged as float32, rounded.
        pl_module.log(self.log_name, torch.tensor(self.epsilon, dtype=torch.float64),
                      on_step=False, on_epoch=True, batch_size=1)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._detach()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._detach()

    def _detach(self) -> None:
        # The network trains or evaluates as an ordinary module afterwards.
        if self.optimizer is not None:
            self.optimizer.clipper.remove()

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The engine's checkpoint (:meth:`PrivacyEngine.save_checkpoint`)
        without the weights, which Lightning stores: the accountant's history,
        the noise stream's key and position, the loader's pass.  Its optimizer
        entry carries the stream again (``DPOptimizer.state_dict``)."""
        if self.optimizer is None:
            return {}
        buf = io.BytesIO()
        with warnings.catch_warnings():
            # Lightning stores the optimizer's state itself.
            warnings.filterwarnings("ignore", message=_OPTIMIZER_LEFT_OUT)
            self.engine.save_checkpoint(path=buf, module=self._net)
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        del state[_MODULE]
        return {"engine": state}

    def load_state_dict(self, state_dict: dict) -> None:
        # Lightning restores callbacks before configure_optimizers: kept until
        # on_fit_start, and applied before Lightning loads the optimizer's state
        # (whose stream is checked against the restored accountant).
        self._restore = state_dict.get("engine")

    def _load(self, state: dict) -> None:
        # load_checkpoint checks the file as a whole (integrity tag, noise
        # configuration, accountant kind) and reloads the weights: Lightning's
        # own, restored already.
        state = dict(state)
        state[_MODULE] = self._net.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        self.engine.load_checkpoint(path=buf, module=self._net)
