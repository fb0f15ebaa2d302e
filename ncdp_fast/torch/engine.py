"""PrivacyEngine: Opacus's entry point, on book-keeping clipping and ncdp_fast's
accountants.  Swapping ``from opacus import PrivacyEngine`` for ``from
ncdp_fast.torch import PrivacyEngine`` is the whole migration of a training loop."""
from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import _stream, privacy
from . import checkpoint as _checkpoint
from .._validate import check_bool, check_choice, check_pos_int, check_positive
from .accounting import EngineAccountant, dp_accounting_name
from .adaptive import AdaptiveClip
from .clipper import GhostClipper
from .fix import fix_batchnorm, fix_recurrent
from .compiled import check_not_compiled
from .coupling import CheckedCriterion
from .dp_optimizer import DPOptimizer, PrivateModule
from ..distributed._group import check_same_config, resolve_group
from .data import PoissonBatchSampler, collate_with_empty, loader_settings
from .ranks import DistributedPoissonBatchSampler, agree_stream, check_not_ddp

__all__ = ["PrivacyEngine", "DPOptimizer", "PrivateModule"]   # the last two from dp_optimizer

_ACCOUNTANTS = ("prv", "rdp", "gdp", "pld")
_GRAD_SAMPLE_MODES = ("hooks", "ghost", "functorch", "ew")
# Opacus's make_private keyword arguments of clipping="adaptive".
_ADAPTIVE_ARGS = ("target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound",
                  "min_clipbound", "unclipped_num_std")


def _check_optimizer_trains(module, optimizer) -> None:
    """Refuse an optimizer holding none of the module's trainable parameters
    (one built over another module's): every step would write the private
    gradients where the optimizer never reads them, spending epsilon on a
    model that never changes (the eighth audit: 4.21 spent, no weight moved)."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    held = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    if trainable and not any(id(p) in trainable for p in held):
        raise ValueError(
            "optimizer: expected a torch optimizer over the module's trainable parameters, "
            f"got one holding none of them ({len(held)} parameter(s) of something else): the "
            "private gradients would be written where it never reads them and every step's "
            "privacy spent on a model that does not change. Build it from "
            "module.parameters() (the module passed to make_private)")


class PrivacyEngine:
    """Opacus's ``PrivacyEngine``: ``make_private`` / ``make_private_with_epsilon``
    return (module, optimizer, data_loader) for an unchanged training loop, and
    :meth:`get_epsilon` answers for the steps taken.

    Differences, all on the side of privacy or speed: gradients come from
    :class:`GhostClipper` (one backward pass, every common layer, no
    ``grad_sample``); the loader is always a true Poisson loader (empty batches
    yielded, never skipped; ``poisson_sampling=False`` is refused, since no
    accountant here covers shuffled fixed-size batches); noise comes from a
    Philox stream keyed by the OS (``seed=`` to fix it, ``noise_generator`` is
    refused); the accountant is :class:`ncdp_fast.privacy.Accountant`
    ("prv" and "pld": dp-accounting's PLD accountant; "rdp"; "gdp": the CLT,
    an approximation).  ``secure_mode=True`` is refused: the noise is a
    Philox4x32-10 stream keyed by 64 bits from the OS (``secrets``), not a
    cryptographically secure generator, and its float64 Box--Muller output is
    not hardened against the floating-point attack (Mironov 2012); see
    docs/privacy.md, "Noise tails and floating point".
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False):
        check_choice(accountant, "accountant", _ACCOUNTANTS)
        self.accountant_name = accountant
        self.accountant = EngineAccountant(accountant)
        if not isinstance(secure_mode, bool):
            raise TypeError(f"secure_mode: expected a bool, got {type(secure_mode).__name__}")
        if secure_mode:
            raise ValueError(
                "secure_mode: expected False, got True. ncdp_fast has no secure mode: its noise "
                "is a Philox4x32-10 stream keyed by 64 bits from the OS (secrets.randbits), "
                "not a cryptographically secure generator, and the float64 Box-Muller values "
                "rounded to the parameters' dtype are not hardened against the floating-point "
                "attack of Mironov (2012). Use PrivacyEngine() (secure_mode=False) knowing this, "
                "or Opacus with secure_mode=True; docs/privacy.md, 'Noise tails and floating "
                "point', states what the stream guarantees and the residual risk")
        self.secure_mode = False
        self.sample_rate: float | None = None

    # ------------------------------------------------------------ compatibility
    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """``module`` with its batch norms replaced by group norms
        (:func:`fix_batchnorm`) and its ``nn.LSTM/GRU/RNN`` by ``DPLSTM/DPGRU/DPRNN``
        with their weights (:func:`~ncdp_fast.torch.fix.fix_recurrent`), in
        place, then checked; returns it. The fixes there are: any other refusal
        raises here, naming the layer."""
        module = fix_recurrent(fix_batchnorm(module))
        GhostClipper.check_model(module)
        return module

    def is_compatible(self, *, module: nn.Module, optimizer=None, data_loader=None) -> bool:
        """Whether :meth:`validate` passes."""
        try:
            self.validate(module=module, optimizer=optimizer, data_loader=data_loader)
        except (TypeError, ValueError):
            return False
        return True

    def validate(self, *, module: nn.Module, optimizer=None, data_loader=None) -> None:
        """Raise what :meth:`make_private` would refuse before a step: the
        model's layers as :class:`GhostClipper` checks them at construction
        (the first refusal, naming the layer), the optimizer's type and the
        loader's type and length.  Attaches nothing; refusals that depend on
        the data (a layer's rows, the loss) come at the step."""
        GhostClipper.check_model(module)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if data_loader is not None:
            self._poisson_loader(data_loader, None)      # raises the clear error

    # ------------------------------------------------------------------ wiring
    def _poisson_loader(self, data_loader, seed, group=None):
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader: expected a torch.utils.data.DataLoader, got "
                            f"{type(data_loader).__name__}")
        steps = len(data_loader)
        if steps == 0:
            raise ValueError("data_loader: expected at least one batch per epoch, got 0")
        dataset = data_loader.dataset
        n = len(dataset)
        sample_rate = 1.0 / steps
        if group is None:
            sampler = PoissonBatchSampler(n, sample_rate=sample_rate, steps=steps, seed=seed)
        else:
            sampler = DistributedPoissonBatchSampler(n, sample_rate=sample_rate, steps=steps,
                                                     seed=seed, group=group)
        loader = DataLoader(dataset, batch_sampler=sampler,
                            collate_fn=collate_with_empty(dataset, data_loader.collate_fn),
                            **loader_settings(data_loader))
        # Opacus's DPDataLoader attribute, read by its scripts (public: q).
        loader.sample_rate = sample_rate
        return loader, sample_rate, n

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                     data_loader: DataLoader, noise_multiplier: float, max_grad_norm,
                     criterion=None, batch_first: bool = True, loss_reduction: str = "mean",
                     poisson_sampling: bool = True, clipping: str = "flat",
                     noise_generator=None, grad_sample_mode: str = "hooks",
                     wrap_model: bool = True, seed=None, group=None,
                     check_loss: bool = True, gram_precision: str = "float64",
                     forwards_per_step: int = 1, **kwargs):
        """Make a model, optimizer and loader private (Opacus's signature).

        Args:
            module: the model; its trainable layers must have rules
                (:class:`GhostClipper`); batch norms are refused (use
                :func:`ncdp_fast.torch.fix_batchnorm`).
            optimizer: any torch optimizer over the model's parameters.
            data_loader: the DataLoader whose ``len()`` fixes the sample rate
                q = 1 / len(data_loader) and the expected batch size q * n.
            noise_multiplier: sigma >= 0; noise std sigma * max_grad_norm.
            max_grad_norm: C > 0 per sample ("flat"; "adaptive": the first
                step's bound), or one bound per trainable parameter ("per_layer").
            clipping: "flat", "per_layer" or "adaptive" (Andrew et al. 2021,
                :mod:`ncdp_fast.torch.adaptive`; then Opacus's keyword arguments
                target_unclipped_quantile, clipbound_learning_rate,
                max_clipbound, min_clipbound, unclipped_num_std are required;
                the accountant records noise_multiplier per step, the gradient
                is noised at the larger multiplier that leaves the count its
                share).
            criterion: with grad_sample_mode "ghost", returned in the 4-tuple
                (Opacus's fast-gradient-clipping shape) wrapped in a
                :class:`~ncdp_fast.torch.coupling.CheckedCriterion`: a torch loss
                whose ``reduction`` is ``loss_reduction``; means over a
                whole-batch count (class weights, ``ignore_index`` targets) are
                refused.  Whatever the mode, the loss must be a sum or mean of
                per-sample terms (docs/torch.md, "The loss contract"; token
                losses: :class:`~ncdp_fast.torch.TokenCrossEntropyLoss`).
            batch_first: the layout of the model's inputs and of its layers that are
                not inside a torch module with its own ``batch_first``: True, the
                batch is dimension 0; False, dimension 1 ((T, B, ...), Opacus's
                meaning).  :class:`GhostClipper`'s argument.
            loss_reduction: "mean" or "sum", as the loss the loop computes.
            seed: the key of the stream the batches and the noise are drawn
                from, in disjoint ranges (default: from the OS; or a
                :class:`ncdp_fast.NoiseStream`).
            group: a torch.distributed process group to train across ranks
                (instead of wrapping the model in DDP): every rank passes the
                full dataset's loader, draws the one-process Poisson batch
                and keeps its shard of it (DistributedPoissonBatchSampler);
                the step equals the one-process step (GhostClipper(group=)).
                The sample rate, and so the accountant, is the global one.
            check_loss: True (default): every backward through the model is
                checked, on its autograd graph, to be a sum or mean of
                per-sample terms (a token mean only within each sample);
                others are refused before anything is written
                (docs/torch.md, "The loss, checked on the graph").  False is
                the documented opt-out for a loss you vouch for.
            gram_precision: "float64" (default) or "float32": the Grams of the
                per-sample norms of float32 linear layers on a CUDA device
                (:class:`GhostClipper`'s argument; float32 trades clipping
                tighter by the float32 GEMMs' rounding bound for the float64
                copies and GEMMs, docs/privacy.md).
            forwards_per_step: the most forwards of the model one step may
                hold, each on the same samples row for row (K augmentations
                of each sample: K); a forward past it is refused
                (:class:`GhostClipper`'s argument).  Default 1: two loader
                batches forwarded before one step would otherwise be clipped
                row by row as one batch of paired samples.

        Returns ``(module, optimizer, data_loader)`` (``(module, optimizer,
        criterion, data_loader)`` with ``grad_sample_mode="ghost"``).
        """
        # A truthy string passed for any flag here read as True (the seventh audit's scan).
        if not check_bool(poisson_sampling, "poisson_sampling"):
            raise ValueError("poisson_sampling: expected True; a shuffled fixed-size batch has "
                             "no accountant here (Opacus accounts it as Poisson, which it is not)")
        if noise_generator is not None:
            raise ValueError("noise_generator: expected None; noise comes from a Philox stream "
                             "keyed by the OS (pass seed= to fix the key)")
        batch_first = check_bool(batch_first, "batch_first")
        wrap_model = check_bool(wrap_model, "wrap_model")
        check_choice(grad_sample_mode, "grad_sample_mode", _GRAD_SAMPLE_MODES)
        check_not_ddp(module, "make_private")
        check_not_compiled(module, "make_private")
        _check_optimizer_trains(module, optimizer)
        adaptive = None
        if clipping == "adaptive":
            missing = [k for k in _ADAPTIVE_ARGS if k not in kwargs]
            if missing:
                raise TypeError(f"make_private: clipping='adaptive' requires {missing} "
                                "(Opacus's AdaClipDPOptimizer arguments)")
            adaptive = AdaptiveClip(**{k: kwargs.pop(k) for k in _ADAPTIVE_ARGS})
        if kwargs:
            raise TypeError(f"make_private: unexpected argument(s) {sorted(kwargs)}"
                            + (" (adaptive clipping's arguments need clipping='adaptive')"
                               if set(kwargs) & set(_ADAPTIVE_ARGS) else ""))
        # Checked before anything is built: a refused criterion leaves no hooks behind.
        if grad_sample_mode == "ghost" and criterion is not None:
            criterion = CheckedCriterion(criterion, loss_reduction)
        if group is not None:
            # What each rank keeps to itself must agree too: an accountant or a
            # learning rate of its own reports another epsilon or steps the
            # parameters apart, silently (the sixth audit).
            ranks = resolve_group(group)
            check_same_config({"accountant": self.accountant_name,
                               "optimizer": type(optimizer).__name__,
                               "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                for g in optimizer.param_groups]},
                              ranks, "make_private")
        # One stream for the batches and the noise: each takes the next disjoint
        # range as it goes, so neither ever reuses the other's draws.
        stream = _stream.resolve(seed) if group is None else \
            agree_stream(seed, None, ranks, "PrivacyEngine")
        loader, sample_rate, n = self._poisson_loader(data_loader, stream, group)
        clipper = GhostClipper(module, max_grad_norm=max_grad_norm,
                               noise_multiplier=noise_multiplier,
                               expected_batch_size=sample_rate * n,
                               loss_reduction=loss_reduction, clipping=clipping, seed=stream,
                               group=group, batch_first=batch_first, adaptive=adaptive,
                               check_loss=check_loss, gram_precision=gram_precision,
                               forwards_per_step=forwards_per_step)
        self.sample_rate = sample_rate

        def on_step():
            # noise_multiplier 0 is recorded too (and sets unbounded).
            self.accountant.step(noise_multiplier=clipper.noise_multiplier,
                                 sample_rate=sample_rate)
        private = PrivateModule(module, clipper) if wrap_model else module
        dp_opt = DPOptimizer(optimizer, clipper, on_step, samplers=[loader.batch_sampler],
                             engine=self)
        self._run = _checkpoint.Run(private, dp_opt, clipper, loader.batch_sampler)
        if grad_sample_mode == "ghost":
            return private, dp_opt, criterion, loader
        return private, dp_opt, loader

    def make_private_with_epsilon(self, *, module, optimizer, data_loader, target_epsilon,
                                  target_delta, epochs, max_grad_norm, **kwargs):
        """:meth:`make_private` with the smallest noise multiplier whose epsilon
        after ``epochs`` epochs (``epochs * len(data_loader)`` Poisson steps of
        rate 1/len(data_loader)) is at most ``target_epsilon`` at ``target_delta``
        under the engine's accountant."""
        check_positive(target_epsilon, "target_epsilon")
        epochs = check_pos_int(epochs, "epochs")
        if not isinstance(data_loader, DataLoader) or len(data_loader) == 0:
            self._poisson_loader(data_loader, None)      # raises the clear error
        q = 1.0 / len(data_loader)
        if len(self.accountant):
            # As Opacus: the target is this run's alone.  The engine's epsilon
            # composes every run it accounted, so it will end above the target.
            spent = self.accountant.get_epsilon(target_delta)
            steps = sum(h[2] for h in self.accountant.history)
            warnings.warn(
                f"make_private_with_epsilon: this engine has accounted {steps} step(s) "
                f"already (epsilon {spent:.4g} at delta {target_delta:g}); the noise "
                f"multiplier is calibrated for target_epsilon={target_epsilon:g} over the new "
                "run's steps alone, and get_epsilon will report the composition of both, above "
                "the target. Use a new PrivacyEngine for an independent run, or lower the "
                "target by what was spent", UserWarning, stacklevel=2)
        sigma = privacy.calibrate_noise_multiplier(
            target_epsilon, target_delta, q, epochs * len(data_loader),
            accountant=dp_accounting_name(self.accountant_name))
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                 noise_multiplier=sigma, max_grad_norm=max_grad_norm, **kwargs)

    def save_checkpoint(self, *, path, module, optimizer=None, noise_scheduler=None,
                        grad_clip_scheduler=None, checkpoint_dict=None,
                        module_state_dict_kwargs=None, torch_save_kwargs=None) -> None:
        """Write a private training checkpoint (Opacus's signature) with
        ``torch.save``: ``module_state_dict``, ``optimizer_state_dict`` (of the
        wrapped optimizer, when ``optimizer`` is given),
        ``privacy_accountant_state_dict`` (the accountant's history) and
        ``ncdp_engine``: the noise configuration, the position of the stream
        the loader and the noise share, and how far the loader's current pass
        went. :meth:`load_checkpoint` in a new process then continues the run:
        same epsilon, same batches, same noise as the uninterrupted run.

        The file holds the secret noise key (whoever has it can subtract the
        noise from the released gradients): keep it as private as the data.

        Args:
            path: a file name or file object for ``torch.save``.
            module, optimizer: the module and DPOptimizer :meth:`make_private`
                returned (optimizer optional).
            noise_scheduler, grad_clip_scheduler: Opacus's schedulers of this
                optimizer (or None): their ``state_dict()`` is stored under
                ``noise_scheduler_state_dict`` / ``grad_clip_scheduler_state_dict``
                (a Lambda scheduler's function is code and is not stored).
            checkpoint_dict: more entries to store (plain types and tensors, so that
                :meth:`load_checkpoint` can read them with ``weights_only``).
        """
        _checkpoint.save(self, path=path, module=module, optimizer=optimizer,
                         noise_scheduler=noise_scheduler,
                         grad_clip_scheduler=grad_clip_scheduler,
                         checkpoint_dict=checkpoint_dict,
                         module_state_dict_kwargs=module_state_dict_kwargs,
                         torch_save_kwargs=torch_save_kwargs)

    def load_checkpoint(self, *, path, module, optimizer=None, noise_scheduler=None,
                        grad_clip_scheduler=None, module_load_dict_kwargs=None,
                        torch_load_kwargs=None) -> dict:
        """Resume a run from :meth:`save_checkpoint` (Opacus's signature).

        Call it right after :meth:`make_private` (with the checkpoint's
        noise_multiplier, max_grad_norm, clipping, loss_reduction and a loader
        of the same length and dataset size), passing the module and optimizer it
        returned, as with Opacus. It restores their states, the accountant's
        history (``get_epsilon`` continues from the checkpoint's), the noise
        stream and the loader's pass. Refused, before anything is written: an
        engine that has taken steps, another accountant or noise configuration,
        a file not written by save_checkpoint.

        Schedulers: pass the ones save_checkpoint was given, built on the
        optimizer make_private returned; their states are restored, and the
        checkpoint's noise_multiplier (and, with ``clipping="flat"`` on one
        process, max_grad_norm) -- the value the schedule set for the next
        step -- replaces make_private's. A scheduler without a stored state,
        or a stored state without its scheduler, is refused; without a
        scheduler every value must match make_private's.

        ``torch.load`` runs with ``weights_only=True`` (a full unpickle would run
        code named in the file); ``torch_load_kwargs`` may override it.

        Returns the checkpoint's entries (``checkpoint_dict``'s included), without
        the engine's own (the key).
        """
        return _checkpoint.load(self, path=path, module=module, optimizer=optimizer,
                                noise_scheduler=noise_scheduler,
                                grad_clip_scheduler=grad_clip_scheduler,
                                module_load_dict_kwargs=module_load_dict_kwargs,
                                torch_load_kwargs=torch_load_kwargs)

    @property
    def noise_multiplier(self) -> float | None:
        """sigma of the next step of the run :meth:`make_private` built last, read
        from its optimizer (so a noise scheduler's change shows here); None before
        make_private.  Setting it sets the optimizer's (checked, and every later
        step is noised and accounted at it)."""
        run = getattr(self, "_run", None)
        return None if run is None else run.clipper.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value) -> None:
        run = getattr(self, "_run", None)
        if run is None:
            raise RuntimeError("PrivacyEngine.noise_multiplier: expected an engine after "
                               "make_private (it is the private optimizer's), got one before "
                               "it; pass noise_multiplier= to make_private")
        run.clipper.noise_multiplier = value

    # A step at noise_multiplier 0 is recorded on the accountant, so that
    # accountant.get_epsilon answers as the engine does (inf).
    _unbounded = property(lambda self: self.accountant.unbounded,
                          lambda self, value: setattr(self.accountant, "unbounded", value))

    def get_epsilon(self, delta) -> float:
        """epsilon at ``delta`` for the private steps taken so far (0 before the
        first; inf if any step had noise_multiplier 0); the same as
        ``accountant.get_epsilon(delta)``."""
        return self.accountant.get_epsilon(delta)

