"""What the drop-ins share: their noise stream and, for the two that release
gradients, the checked DP arguments, the one fused clip-and-noise call and the
check that every gradient a step would apply is one they released."""
from __future__ import annotations

import warnings
import weakref

from .. import _key_ledger, _stream
from .._clip import LayersClipResult, clip_and_noise_layers
from .._stream import NoiseReuseWarning, NoiseStream
from .._validate import check_choice, check_nonneg, check_positive
from ..distributed._group import GroupRef, check_same_config, resolve_group
from .ranks import agree_stream, broadcast_state, reduce_clip_and_noise, state_tensors

__all__ = ["UsesNoiseStream", "ClippedGaussianStep", "CheckpointsNoise", "check_dp_args",
           "ReleasedGrads", "optimizer_params", "foreign_grad_error", "keep_result"]


class UsesNoiseStream:
    """The noise stream of a drop-in (a :class:`ncdp_fast.NoiseStream`): ``seed``
    (the secret key), ``offset`` (the next unused draw) and the private-step count.
    ``noise_state()`` / ``load_noise_state()`` carry them into a *private*
    training checkpoint so that a resumed run continues the stream."""

    def _init_stream(self, seed, offset):
        self._stream = _stream.resolve(seed, offset)
        self._steps = 0
        # The first draw since the last checkpoint written or read: the range a
        # checkpoint records in the key ledger (_key_ledger.record_used).
        self._checkpointed = self._stream.position

    @property
    def seed(self) -> int:
        return self._stream.seed

    @property
    def offset(self) -> int:
        """Next unused draw (or sub-stream) of the Philox stream."""
        return self._stream.position

    @property
    def steps(self) -> int:
        """Private steps taken (calls of privatize_, or passes over a sampler)."""
        return self._steps

    def noise_state(self) -> dict:
        """``{"seed", "offset", "steps"}``: secret, for private checkpoints only.

        The draws used since the last checkpoint are recorded in the key
        ledger (:mod:`ncdp_fast._key_ledger`; rank 0 only), so that resuming an
        earlier checkpoint of this run later is seen (:meth:`load_noise_state`)."""
        state = dict(self._stream.state(), steps=self._steps)
        if self._keeps_ledger():
            _ledger_call(_key_ledger.record_used, state["seed"], self._checkpointed,
                         state["offset"])
        self._checkpointed = state["offset"]
        return state

    def load_noise_state(self, state: dict) -> None:
        """Continue the stream of a checkpoint's ``noise_state()``.

        A checkpoint is continued once (docs/privacy.md): a second continuation
        draws the same noise for other steps, and the two runs' outputs
        together cancel it.  The key ledger sees a resume of a position that
        was resumed before, or of one a later checkpoint of the run has passed
        (in any process of this machine and user): a NoiseReuseWarning then
        says so.  Not refused: a run preempted before its next checkpoint is
        resumed from the same one again, its lost continuation never
        released."""
        if not isinstance(state, dict) or not {"seed", "offset", "steps"} <= set(state):
            raise ValueError(f"state: expected a dict with seed, offset and steps (from "
                             f"noise_state()), got {state!r}")
        stream = NoiseStream.restore(state)
        resume = (stream.seed, stream.position)
        # One resume loads the stream twice at most (the engine's checkpoint,
        # then the optimizer's state_dict, as the Hugging Face Trainer does).
        if getattr(self, "_resumed", None) != resume and self._keeps_ledger() and \
                _ledger_call(_key_ledger.claim_resume, *resume):
            warnings.warn(
                f"load_noise_state: this checkpoint's noise stream (draw {stream.position}) "
                "was continued before: resumed already, or passed by a later checkpoint of "
                "the same run (the key ledger). The noise of the steps from here repeats "
                "that continuation's; if the outputs of both are released (two runs resumed "
                "from one checkpoint, a rollback whose first branch was published, a record "
                "deleted and the run redone), their difference cancels the noise. Release "
                "at most one continuation, or start a new run (a fresh key) on the data",
                NoiseReuseWarning, stacklevel=3)
        self._resumed = resume
        self._stream = stream
        self._steps = int(state["steps"])
        self._checkpointed = stream.position

    def _keeps_ledger(self) -> bool:
        """One process writes a run's ledger entries: rank 0 of a group (every
        rank holds the same stream)."""
        group = getattr(self, "group", None)
        if group is None:
            return True
        import torch.distributed as dist
        return dist.get_rank(group) == 0


def _ledger_call(fn, *args):
    try:
        return fn(*args)
    except OSError as e:
        raise RuntimeError(
            f"the key ledger ({_key_ledger.ledger_dir()}) could not be written ({e}): it "
            "records the noise a checkpointed run used, so that a checkpoint resumed twice "
            f"is seen; point {_key_ledger.ENV} at a private directory this process can "
            "write") from e


class CheckpointsNoise:
    """``state_dict`` / ``load_state_dict`` of an optimizer wrapper: the wrapped
    ``original_optimizer``'s state plus ``"ncdp_noise"``, the noise stream of
    :meth:`_noise_source` -- a resumed run continues the stream where it stopped.
    It holds the secret key: keep such checkpoints private, never publish them."""

    def _noise_source(self) -> UsesNoiseStream:
        return self

    def _noise_restored(self) -> None:
        """Called after a checkpoint's stream was loaded."""

    def _check_noise_state(self, noise) -> None:
        """Called before anything of a state with a noise stream is loaded."""

    def state_dict(self):
        if getattr(self._noise_source(), "_accumulated", None):
            # As save_checkpoint: the logical batch's clipped sums so far are not
            # in the state, and a run resumed from it would noise the batch
            # without them (accepted, silently, until the eighth audit).
            raise ValueError(
                "state_dict: expected a state between logical steps, got one inside a logical "
                "batch (BatchMemoryManager: physical batches accumulated, its step not taken "
                "yet); take it after a step that was not skipped "
                "(optimizer._is_last_step_skipped is False)")
        state = self.original_optimizer.state_dict()
        state["ncdp_noise"] = self._noise_source().noise_state()
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        noise = state_dict.pop("ncdp_noise", None)
        if noise is not None:
            self._check_noise_state(noise)
        self.original_optimizer.load_state_dict(state_dict)
        if noise is not None:
            self._noise_source().load_noise_state(noise)
            self._noise_restored()


def check_dp_args(max_grad_norm, noise_multiplier, expected_batch_size, loss_reduction,
                  nan_policy):
    """The drop-ins' arguments, checked at construction under the user's names."""
    max_grad_norm = check_positive(max_grad_norm, "max_grad_norm")
    noise_multiplier = check_noise_multiplier(noise_multiplier, max_grad_norm)
    check_choice(loss_reduction, "loss_reduction", ("mean", "sum"))
    if expected_batch_size is not None:
        expected_batch_size = check_positive(expected_batch_size, "expected_batch_size")
    elif loss_reduction == "mean":
        raise ValueError("expected_batch_size: required with loss_reduction='mean'")
    check_choice(nan_policy, "nan_policy", ("raise", "zero"))
    return max_grad_norm, noise_multiplier, expected_batch_size


def check_noise_multiplier(noise_multiplier, max_grad_norm: float) -> float:
    """sigma >= 0, finite, with a noise std sigma * max_grad_norm that cannot overflow."""
    noise_multiplier = check_nonneg(noise_multiplier, "noise_multiplier")
    if noise_multiplier * max_grad_norm > 1e150:
        raise ValueError(f"noise_multiplier: {noise_multiplier!r} * max_grad_norm "
                         f"{max_grad_norm!r} is too large a noise std (the noise would "
                         "overflow)")
    return noise_multiplier


class ReleasedGrads:
    """The gradient tensors a drop-in wrote, so that a step can tell a released
    (private) gradient from one autograd produced outside the mechanism.

    Identity, not value: the optimizer would apply whatever ``p.grad`` holds,
    and the only gradients that may reach it are the ones the mechanism wrote
    (or those zeroed in place by ``zero_grad(set_to_none=False)``, the same
    tensors).  Weak references: a gradient the user dropped is not kept alive."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def wrote(self, p, grad) -> None:
        self._refs[id(p)] = weakref.ref(grad)

    def first_foreign(self, params, privatized: set):
        """The first parameter of ``params`` (iterable of ``(p, where)``) that has
        a ``.grad`` the optimizer would apply and that is neither privatized
        this step (``id(p)`` in ``privatized``) nor a gradient this drop-in
        released earlier: ``(p, where)``, or None.  O(len(params)), identity
        checks only."""
        for p, where in params:
            g = p.grad
            if g is None or id(p) in privatized:
                continue
            ref = self._refs.get(id(p))
            if ref is None or ref() is not g:
                return p, where
        return None


def keep_result(result: LayersClipResult) -> LayersClipResult:
    """What a drop-in keeps of a step's result as ``last_result``: norms, counts
    and stream range, not ``grads`` (they are the parameters' ``.grad``).  A kept
    ``grads`` held the previous step's gradients after the user's
    ``zero_grad(set_to_none=True)``, into the next step (147 MB on the
    BERT-shaped benchmark, freed only when the next result replaced it)."""
    return LayersClipResult(norms=result.norms, num_clipped=result.num_clipped,
                            num_nonfinite=result.num_nonfinite, offset=result.offset,
                            draws=result.draws, seed=result.seed, grads=None)


def optimizer_params(optimizer) -> list:
    """``[(p, (group index, index in group))]`` of a torch optimizer, for
    :meth:`ReleasedGrads.first_foreign`."""
    return [(p, (gi, i)) for gi, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])]


def foreign_grad_error(who: str, name: str, p, reason: str, fix: str) -> ValueError:
    """The refusal for a gradient the private step did not produce."""
    return ValueError(
        f"{who}: parameter {name} (shape {tuple(p.shape)}) has a gradient that the private "
        f"step did not produce ({reason}); the optimizer would apply it raw, unclipped and "
        f"unnoised, while the step is accounted as private. {fix}. Nothing was stepped")


class ClippedGaussianStep(UsesNoiseStream):
    """A drop-in whose every private step is one Gaussian mechanism over the
    batch: per-sample clipping at ``max_grad_norm``, noise std ``noise_multiplier
    * max_grad_norm``, division by the *expected* batch size for a mean-reduced
    loss.  Subclasses gather the per-sample blocks and hand them to
    :meth:`_clip_and_noise`, which draws the noise from the drop-in's stream.

    With ``group``, every rank starts from rank 0's state: ``module``'s parameters
    (frozen ones included) and buffers when given, else ``params``."""

    def __init__(self, *, max_grad_norm, noise_multiplier, expected_batch_size, loss_reduction,
                 seed, offset, nan_policy, group=None, params=(), config=None, module=None,
                 gram_precision="float64"):
        self._max_grad_norm, self._noise_multiplier, self.expected_batch_size = check_dp_args(
            max_grad_norm, noise_multiplier, expected_batch_size, loss_reduction, nan_policy)
        # The norms' Grams on a device (clip_and_noise_layers' gram_precision);
        # across ranks the norms stay float64.
        self.gram_precision = check_choice(gram_precision, "gram_precision",
                                           ("float64", "float32"))
        self.loss_reduction = loss_reduction
        self.nan_policy = nan_policy
        # Sharded steps only when asked for: a process group of its own is how a
        # user says the ranks hold pieces of one batch (ncdp_fast.torch.ranks).
        group = None if group is None else resolve_group(group)
        self._group = GroupRef(group, type(self).__name__)
        if group is None:
            self._init_stream(seed, offset)
        else:
            # The step's configuration and the shapes of the state every rank
            # starts from must agree (else the all-reduce and the broadcast would
            # pair different tensors), and so must the stream.
            what = type(self).__name__
            named = state_tensors(module, params)
            check_same_config(dict(config or {}, max_grad_norm=self.max_grad_norm,
                                   noise_multiplier=self.noise_multiplier,
                                   expected_batch_size=self.expected_batch_size,
                                   loss_reduction=loss_reduction, nan_policy=nan_policy,
                                   shapes=[(n, tuple(t.shape), str(t.dtype)) for n, t in named]),
                              group, what)
            self._stream = agree_stream(seed, offset, group, what)
            self._steps = 0
            self._checkpointed = self._stream.position
            broadcast_state([t for _, t in named], group)
        # The last step's result without its gradients (see keep_result).
        self.last_result: LayersClipResult | None = None
        # A subclass's device checks of this step, read by the next clip op with
        # its counts (clip_and_noise_layers' _checks; GhostClipper's loss checks).
        self._deferred_checks: list = []

    @property
    def group(self):
        """The process group of the sharded steps (``None``: one process); held
        weakly (:class:`ncdp_fast.distributed._group.GroupRef`)."""
        return self._group.get()

    @property
    def noise_multiplier(self) -> float:
        """sigma: each step's noise std divided by ``max_grad_norm``."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value) -> None:
        # Settable between steps, as Opacus's optimizer attribute (its noise
        # schedulers assign it): every later step draws, and is accounted, at
        # the new sigma. Checked here, since a negative or NaN sigma would
        # otherwise reach the noise draw unnoticed.
        sigma = check_noise_multiplier(value, self.max_grad_norm)
        self._refuse_rank_change("noise_multiplier", self._noise_multiplier, sigma, value)
        self._noise_multiplier = sigma

    @property
    def max_grad_norm(self) -> float:
        """C: the per-sample clip bound (the sensitivity) of each step."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        # Settable between steps (Opacus's grad-clip schedulers assign it): later
        # steps clip at the new C and draw noise of std noise_multiplier * C, so
        # each stays a Gaussian mechanism of multiplier noise_multiplier and the
        # accountant, which sees only sigma and q, needs nothing more.
        c = check_positive(value, "max_grad_norm")
        check_noise_multiplier(self._noise_multiplier, c)
        self._refuse_rank_change("max_grad_norm", self._max_grad_norm, c, value)
        self._max_grad_norm = c

    def _grad_noise_multiplier(self) -> float:
        """The gradient's noise std over ``max_grad_norm``: ``noise_multiplier``,
        unless part of the budget goes to another release of the same step."""
        return self.noise_multiplier

    def _refuse_rank_change(self, name, agreed, new, value) -> None:
        if self.group is not None and new != agreed:
            raise ValueError(
                f"{name}: expected {agreed!r}, the value the ranks agreed on at "
                f"construction, got {value!r}: across ranks (group=) each rank clips and "
                "adds its share of one noise draw, and a rank left at another value would "
                "diverge unseen. Build the clipper (make_private) again with the new value")

    def _clip_only(self, blocks, grad_scale, max_norm=None, count=False,
                   release=False, bounds=None) -> LayersClipResult:
        """Clipped sum of ``blocks`` without noise and without the mean's division:
        the share of one physical batch in a logical step.  Noise std 0 adds
        exactly 0, so a throwaway key from the OS serves (seed=None: no ledger
        entry); the clipper's own stream is left for the step's single noise.
        ``release``: the op consumes the list ``blocks`` (its ``release_blocks``);
        ``bounds``: one bound a block (per-layer clipping; a result a block)."""
        return clip_and_noise_layers(
            blocks, max_norm=self.max_grad_norm if max_norm is None else max_norm,
            noise_multiplier=0.0, seed=None, reduction="sum",
            nan_policy=self.nan_policy, grad_scale=grad_scale, release_blocks=release,
            gram_precision=self.gram_precision, _checks=self._take_checks(), _bounds=bounds)

    def _take_checks(self) -> list:
        """The deferred checks, for the first clip op of the step only."""
        checks, self._deferred_checks = self._deferred_checks, []
        return checks

    def _clip_and_noise(self, blocks, grad_scale=1.0, max_norm=None,
                        count=True, release=False, bounds=None) -> LayersClipResult:
        """One private step over ``blocks`` (:func:`ncdp_fast.clip_and_noise_layers`),
        optionally with its own bound ``max_norm`` (per-layer clipping: the noise
        std stays ``noise_multiplier * max_grad_norm``).  ``release``: the op
        consumes the list ``blocks`` (its ``release_blocks``; one process);
        ``bounds`` (one process, not counted):
        one bound a block, each block clipped on its own in one op (per-layer
        clipping; a result a block), the std that of a one-block op of each."""
        c = self.max_grad_norm if max_norm is None else max_norm
        if self.group is not None:
            if bounds is not None:      # the reduction has no groups: never ignored
                raise RuntimeError("_clip_and_noise: bounds are one process's (per_layer.py "
                                   "runs an op a parameter across ranks)")
            result = reduce_clip_and_noise(
                blocks, group=self.group, stream=self._stream, max_norm=c,
                noise_multiplier=self._grad_noise_multiplier() * self.max_grad_norm / c,
                reduction=self.loss_reduction, expected_batch_size=self.expected_batch_size,
                nan_policy=self.nan_policy, grad_scale=grad_scale)
        else:
            # With bounds the op forms each block's multiplier as the line
            # above forms one op's, from the total bound and the multiplier.
            sigma = self._grad_noise_multiplier()
            result = clip_and_noise_layers(
                blocks, max_norm=c,
                noise_multiplier=sigma if bounds is not None else sigma * self.max_grad_norm / c,
                seed=self._stream, reduction=self.loss_reduction,
                expected_batch_size=self.expected_batch_size, nan_policy=self.nan_policy,
                grad_scale=grad_scale, release_blocks=release,
                gram_precision=self.gram_precision, _checks=self._take_checks(),
                _bounds=bounds)
        if not count or bounds is not None:
            return result
        self._steps += 1
        self.last_result = keep_result(result)
        return result
