"""The model and the optimizer as ``make_private`` returns them:
:class:`PrivateModule` (Opacus's ``GradSampleModule`` shape) and
:class:`DPOptimizer` (a ``torch.optim.Optimizer`` whose ``step()`` is the
private step, recorded by the engine's accountant; Opacus's skip-step
protocol for large logical batches)."""
from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from torch import nn

from .._validate import check_bool
from .amp import refuse_grad_scaler
from .clipper import GhostClipper
from .mechanism import CheckpointsNoise
from .precision import SpentStepError

__all__ = ["PrivateModule", "DPOptimizer"]


class PrivateModule(nn.Module):
    """The model as ``make_private`` returns it (Opacus's ``GradSampleModule``
    shape): calls go to ``_module``, whose layers carry the clipper's hooks."""

    def __init__(self, module: nn.Module, clipper: GhostClipper):
        super().__init__()
        self._module = module
        self.clipper = clipper

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def remove_hooks(self) -> None:
        """Detach the clipper: the module computes ordinary gradients again."""
        self.clipper.remove()

    def disable_hooks(self) -> None:
        """Stop recording (Opacus's ``disable_hooks``): forward and backward
        compute ordinary, non-private gradients until :meth:`enable_hooks`.
        A DPOptimizer step over such gradients is refused (they were never
        clipped or noised); discard them with ``zero_grad()`` and
        ``clipper.clear()``."""
        self.clipper.enabled = False

    def enable_hooks(self) -> None:
        """Record again after :meth:`disable_hooks` (the default state)."""
        self.clipper.enabled = True


# The registries torch.optim.Optimizer.__init__ creates, which its hook
# methods (register_step_pre_hook, ...) and profile_hook_step read.
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")


class DPOptimizer(CheckpointsNoise, torch.optim.Optimizer):
    """The optimizer as ``make_private`` returns it: ``step()`` replaces every
    gradient by the clipper's private one (one Gaussian mechanism over the
    batch), records the step with the engine's accountant, then steps the
    wrapped optimizer.  Attributes as Opacus's DPOptimizer: ``noise_multiplier``,
    ``max_grad_norm``, ``expected_batch_size``, ``original_optimizer``.

    Opacus's skip-step protocol (what its ``BatchMemoryManager`` and ours
    drive): each :meth:`signal_skip_step` queues one decision for one future
    ``step()``; a skipped step clips its physical batch's samples and adds
    their clipped sum to the logical batch's (``GhostClipper.accumulate_``),
    writes no gradient, draws no noise, records nothing, and returns None; the
    next step that is not skipped noises the whole logical batch once and is
    the one step the accountant records."""

    def __init__(self, optimizer: torch.optim.Optimizer, clipper: GhostClipper = None,
                 on_step=None, samplers=(), engine=None, **opacus_kwargs):
        if opacus_kwargs or not isinstance(clipper, GhostClipper):
            # Opacus's DPOptimizer(optimizer, noise_multiplier=, max_grad_norm=,
            # expected_batch_size=, ...) clips the grad_sample its hooks wrote;
            # here the clipper is what holds the per-sample state (the sixth
            # audit met torch's bare TypeError at that call).
            given = sorted(opacus_kwargs) or [f"clipper={type(clipper).__name__}"]
            raise TypeError(
                f"DPOptimizer: expected (optimizer, clipper: GhostClipper, on_step), as "
                f"PrivacyEngine.make_private builds it, got {given}: Opacus's DPOptimizer(optimizer, "
                "noise_multiplier=..., max_grad_norm=..., expected_batch_size=...) over a "
                "GradSampleModule has no counterpart; use make_private (or, without an "
                "engine, ncdp_fast.torch.FusedDPOptimizer / GhostClipper)")
        # A torch Optimizer to whatever checks (LR schedulers, isinstance), as
        # Opacus's: Optimizer.__init__ is not run -- the parameter groups, state
        # and defaults are the wrapped optimizer's (properties below); only the
        # hook registries Optimizer's own methods read are set up.
        for name in _OPTIMIZER_HOOKS:
            setattr(self, name, OrderedDict())
        # GradScaler then hands the step its scale as attributes instead of
        # unscaling gradients that do not exist yet: refused by name (amp.py).
        self._step_supports_amp_scaling = True
        self.original_optimizer = optimizer
        self.clipper = clipper
        self._on_step = on_step
        # The engine whose accountant records this optimizer's steps.
        self._engine = engine
        # Samplers that share the clipper's stream (make_private's Poisson loader).
        self._samplers = list(samplers)
        # A queue, not a flag: a loader with workers runs its batch sampler ahead
        # of the loop, signalling for batches not yet trained on.
        self._step_skip_queue: list[bool] = []
        self._is_last_step_skipped = False
        # Under ncdp_fast's BatchMemoryManager: whether the physical batch the
        # loop received last ends its logical batch (None: no batch awaits its
        # step); the manager's tags replace the queue there.
        self._managed = False
        self._awaiting: bool | None = None
        # Under the skip-step queue (signal_skip_step seen this pass): samples
        # accumulated by skipped steps since the last release, which with the
        # released step's must be one Poisson batch whole (_check_logical).
        self._queued = False
        self._pending = 0
        for sampler in self._samplers:
            hooks = getattr(sampler, "_pass_hooks", None)
            if hooks is not None:
                hooks.append(self._new_pass)

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Queue whether the next unqueued ``step()`` only accumulates (Opacus's
        protocol: True for every physical batch of a logical batch but its last)."""
        do_skip = check_bool(do_skip, "do_skip")
        if self._managed:
            raise RuntimeError("signal_skip_step: inside ncdp_fast's BatchMemoryManager, which "
                               "decides each step from the physical batch the loop received; "
                               "expected no skip signals there")
        self._step_skip_queue.append(do_skip)
        self._queued = True

    def _drawn(self):
        """The sizes of the private loader's batches not yet released (None
        without a Poisson sampler of ours)."""
        for sampler in self._samplers:
            drawn = getattr(sampler, "_drawn", None)
            if drawn is not None:
                return drawn
        return None

    def _check_logical(self, batch: int) -> None:
        """A released step (``batch`` its physical batch's samples) with the
        skipped ones before it must be the private loader's next Poisson
        batch whole, or the accountant's record (one step at the loader's
        sampling rate) is wrong:

        * batches from another loader (the original shuffled one, or a fixed
          batch stepped on again and again) are not Poisson batches at that
          rate (the fifth audit: sigma 1, 10 epochs of 10 batches reported
          epsilon 7.90 where a shuffled pass spends 19.05);
        * under the skip-step queue, decisions out of step with the batches
          (a guard skipping an empty batch's step under Opacus's
          BatchMemoryManager, whose queued decision the next step then takes;
          or skips signalled by hand across batches) release one step for
          several Poisson batches, or part of one (the fourth audit: epsilon
          5.97 reported where 9.40 at least was spent);
        * a batch of the loader left without its step (``if len(x) == 0:
          continue``): the number of releases would depend on the realized
          batch sizes, which the accountant does not model."""
        drawn = self._drawn()
        total = self._pending + batch
        want = drawn[0] if drawn else None
        if want == total:
            return
        logical = self._queued or self._managed
        self._end_logical_batches()
        if logical:
            raise RuntimeError(
                f"DPOptimizer.step: the released step covers {total} sample(s) (its physical "
                f"batch and the skipped steps' before it), but the private loader's next "
                f"Poisson batch has {want if want is not None else 'none drawn'}: the skip "
                "decisions (signal_skip_step) are out of step with the loader's batches (a "
                "guard such as `if len(x) == 0: continue` "
                "under Opacus's BatchMemoryManager, or skips signalled across batches), so one "
                "release would not be one Poisson batch and the accountant's record would be "
                "wrong. Step every physical batch, or use ncdp_fast.torch.BatchMemoryManager "
                "(same arguments), which refuses such a loop by name; the logical batch was "
                "discarded, nothing of it released")
        awaits = f"its next batch has {want} sample(s)" if want is not None else \
            "none of its batches awaits a step"
        raise RuntimeError(
            f"DPOptimizer.step: expected a step on the next batch of the Poisson loader "
            f"make_private returned ({awaits}), got a batch of {total}: the accountant "
            "records each step as one Poisson batch drawn at the loader's sampling rate, so "
            "a batch from another loader (the original one, or a batch stepped on again) or "
            "a loader batch left without its step (`if len(x) == 0: continue`; an empty "
            "Poisson batch takes its noise-only step) would make the reported epsilon wrong. "
            "Iterate make_private's data_loader and step once per batch; nothing was written "
            "or drawn")

    def _manage_physical(self, on: bool) -> bool:
        """BatchMemoryManager's context starts (on) or ends; returns whether a
        received physical batch was left without its step."""
        unstepped = self._awaiting is not None
        self._managed, self._awaiting = on, None
        return unstepped

    def _receive_physical(self, last: bool) -> None:
        """A physical batch reaches the loop; ``last``: it ends its logical batch."""
        if self._awaiting is not None:
            self._end_logical_batches()
            from .memory import _UNSTEPPED
            raise RuntimeError(_UNSTEPPED)
        self._awaiting = last

    def _consume_decision(self) -> None:
        if self._managed:
            self._awaiting = None
        else:
            self._check_skip_next_step()

    def _check_skip_next_step(self, pop_next: bool = True) -> bool:
        """Whether the next ``step()`` is skipped (False when nothing is queued);
        ``pop_next`` consumes the decision."""
        if not self._step_skip_queue:
            return False
        return self._step_skip_queue.pop(0) if pop_next else self._step_skip_queue[0]

    def _new_pass(self) -> None:
        """A pass of the Poisson loader begins: a logical batch still open was
        left (Opacus's BatchMemoryManager loop ended early has no exit to
        close it).  Its clipped sums would be noised with a batch of this pass,
        one step for two Poisson batches (a sample in both counted twice)."""
        if self._step_skip_queue or self.clipper._accumulated:
            warnings.warn(
                "DPOptimizer: a pass of the private loader began inside a logical batch (a "
                "BatchMemoryManager loop left early?); its clipped sums and "
                f"{len(self._step_skip_queue)} queued skip decision(s) are discarded: never "
                "released, not accounted", RuntimeWarning, stacklevel=3)
            self._end_logical_batches()

    def _end_logical_batches(self) -> None:
        """Forget queued decisions and any unfinished logical batch (a loop left
        early): nothing of it was released, so nothing is accounted."""
        self._step_skip_queue.clear()
        self._queued, self._pending = False, 0
        self._awaiting = None
        self._is_last_step_skipped = False
        self.clipper.discard_accumulated()

    # Settable (Opacus's noise schedulers assign it); the clipper checks the
    # value, and each later step is noised and accounted at it.
    noise_multiplier = property(lambda self: self.clipper.noise_multiplier,
                                lambda self, value: setattr(self.clipper, "noise_multiplier",
                                                            value))
    # Settable too (Opacus's grad-clip schedulers): later steps clip at the new
    # C with noise std noise_multiplier * C, so the accounting is unchanged.
    max_grad_norm = property(lambda self: self.clipper.max_grad_norm,
                             lambda self, value: setattr(self.clipper, "max_grad_norm", value))
    expected_batch_size = property(lambda self: self.clipper.expected_batch_size)
    # Opacus's attribute ("mean" or "sum"), read by its scripts' logging.
    loss_reduction = property(lambda self: self.clipper.loss_reduction)
    param_groups = property(lambda self: self.original_optimizer.param_groups)
    state = property(lambda self: self.original_optimizer.state)
    defaults = property(lambda self: self.original_optimizer.defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Added to the wrapped optimizer.  A parameter outside the model gets
        no private gradient: a step over a ``.grad`` it holds is refused
        (GhostClipper.privatize_); one of the model's is privatized as any."""
        self.original_optimizer.add_param_group(param_group)

    # Optimizer pickles only its groups and state; this wrapper is all of itself.
    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure=None):
        refuse_grad_scaler(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._managed and self._awaiting is None:
            raise RuntimeError(
                "step(): inside BatchMemoryManager with no physical batch awaiting its step "
                "(a second step() for one batch?); expected one step() per physical batch")
        # The decision is consumed only once the step went through: a refused
        # step leaves it as it was.
        skip = (not self._awaiting) if self._managed else \
            self._check_skip_next_step(pop_next=False)
        if skip:
            self.clipper.accumulate_(self.original_optimizer)
            self._consume_decision()
            self._pending += self.clipper._last_batch
            self._is_last_step_skipped = True
            return loss
        # The wrapped optimizer's parameters are checked too: one added by
        # add_param_group, or never in the model, would otherwise step raw.
        queued = self._queued and not self._managed
        drawn = self._drawn()
        if self.clipper._accumulated and not (queued or self._managed) and drawn is not None:
            # Physical batches accumulated behind the optimizer's back (the
            # clipper's accumulate_ called directly): its steps would not know
            # how many Poisson batches this release holds.
            self._end_logical_batches()
            raise RuntimeError(
                "DPOptimizer.step: clipped sums were accumulated by calling the clipper's "
                "accumulate_() directly, not through the optimizer's skip-step protocol or "
                "BatchMemoryManager: the release could hold several Poisson batches while "
                "the accountant records one step. Use ncdp_fast.torch.BatchMemoryManager for "
                "physical batches; the accumulated sums were discarded, nothing released")
        self._check_stream_resumed()
        self.clipper._step_check = None if drawn is None else self._check_logical
        try:
            self.clipper.privatize_(self.original_optimizer)
        except SpentStepError:
            # Refused after the noise was drawn (the refusal reads the noised
            # gradient): the step is accounted and its batch consumed, as a
            # step; nothing is written and the wrapped optimizer does not step.
            # (Before the eighth audit neither: epsilon stayed 0 after such a
            # step, and the next batch was refused as one left without a step.)
            self._finish_step(drawn)
            raise
        finally:
            self.clipper._step_check = None
        self._finish_step(drawn)
        # torch's contract: step(closure) returns the closure's loss.
        out = self.original_optimizer.step()
        return loss if closure is not None else out

    def _check_stream_resumed(self) -> None:
        """Refuse a step of a run resumed Opacus-style with only the
        accountant's state: under an explicit seed the noise stream restarts
        at the first run's draws (the eighth audit: offsets 4, 19, 34, 49
        drawn again in a new process, nothing warned).  The optimizer's state
        dict carries the stream; with seed=None the key is new and nothing
        repeats."""
        loaded = getattr(self._engine.accountant, "loaded_steps", 0) if self._engine else 0
        if loaded and self.clipper.steps < loaded and self.clipper._stream._explicit:
            raise RuntimeError(
                f"DPOptimizer.step: the accountant's history was loaded with {loaded} step(s) "
                f"but the noise stream, keyed by an explicit seed, has released "
                f"{self.clipper.steps}: it would draw the first run's noise again. Load the "
                "optimizer's state_dict() too (it carries the stream; after the accountant's), "
                "resume with PrivacyEngine.save_checkpoint / load_checkpoint, or pass seed=None "
                "(a new key) to make_private")

    def _finish_step(self, drawn) -> None:
        """The step's book-keeping once its noise is drawn: its Poisson batch
        consumed, the logical batch closed, the accountant told."""
        if drawn:
            drawn.popleft()
        self._pending = 0
        self._consume_decision()
        self._is_last_step_skipped = False
        self._on_step()

    def _noise_source(self):
        return self.clipper

    def _check_noise_state(self, noise) -> None:
        # optimizer.state_dict() carries the noise stream, not the accountant's
        # history: loaded into a new engine, the stream would continue while the
        # accountant restarted at zero (the issue-35 audit: epsilon 2.85 reported
        # for 3.59 spent).
        if self._engine is not None and isinstance(noise, dict):
            from .checkpoint import check_steps_accounted
            steps = noise.get("steps")
            check_steps_accounted(steps if isinstance(steps, int) else -1,
                                  self._engine.accountant, bool(self._engine._unbounded),
                                  "optimizer.load_state_dict")

    def _noise_restored(self) -> None:
        # The loader drew its batches from the same stream: it continues from the
        # restored position too (else a resumed run would redraw the first
        # epoch's batches from the start of the key's stream).
        for sampler in self._samplers:
            sampler._stream = self.clipper._stream

    def __repr__(self):
        return (f"DPOptimizer(noise_multiplier={self.noise_multiplier}, max_grad_norm="
                f"{self.max_grad_norm}, expected_batch_size={self.expected_batch_size}, "
                f"{self.original_optimizer!r})")
