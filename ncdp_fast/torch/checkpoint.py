"""Private training checkpoints of :class:`PrivacyEngine`: what a resumed run
needs to continue the uninterrupted one exactly -- the accountant's history,
the position of the one stream the loader and the noise draw from, the pass
the loader was in, and the module and optimizer states.

The file holds the secret noise key: whoever holds it can subtract the noise
from every released gradient. It is a private file, like the training data.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import warnings

import torch

from .._mix import poisson_batches
from .._stream import NoiseReuseWarning
from .._validate import check_positive
from ..distributed._group import check_same_config
from . import mechanism as _mechanism    # imports this module: used at call time
from .accounting import EngineAccountant

__all__ = ["ResumesPass", "save", "load"]

_FORMAT = "ncdp_fast.torch.PrivacyEngine checkpoint"
# 2: the engine entry carries an integrity tag over the privacy state (issue 35).
_VERSION = 2
_ENGINE = "ncdp_engine"
# Opacus's keys, so that a loop reading checkpoint["module_state_dict"] works.
_MODULE, _OPTIMIZER, _ACCOUNTANT = ("module_state_dict", "optimizer_state_dict",
                                    "privacy_accountant_state_dict")
# Opacus's keys for the schedulers' states.
_SCHEDULERS = {"noise_scheduler": ("noise_scheduler_state_dict", "noise_multiplier"),
               "grad_clip_scheduler": ("grad_clip_scheduler_state_dict", "max_grad_norm")}
_RESERVED = (_MODULE, _OPTIMIZER, _ACCOUNTANT, _ENGINE) + tuple(
    key for key, _ in _SCHEDULERS.values())


class ResumesPass:
    """A Poisson sampler whose pass can be resumed at a given batch.

    The plan of a pass is drawn from the stream at ``plan_offset`` when the
    pass starts; ``pass_done`` counts the batches handed out since.
    :meth:`resume_pass` makes the next pass redraw that same plan (the same
    draws give the same batches) and start after the ``done`` first ones.
    Handed out, not stepped on: with DataLoader workers prefetching, a resumed
    run skips the prefetched batches rather than use any batch twice."""

    plan_offset = None
    pass_done = 0
    _resume = None

    def _pass(self, n):
        """The batches of one pass, drawn at the first one asked for."""
        if self._resume is None:
            start, done = self._stream.position, 0
            plan = poisson_batches(n, sample_rate=self.sample_rate, steps=self.batches,
                                   seed=self._stream)
        else:
            (start, done), self._resume = self._resume, None
            # The range of the checkpointed pass, redrawn for that same pass (in
            # the process that drew it first, the ledger would call it reuse):
            # the stream itself is already past it and draws nothing twice.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NoiseReuseWarning)
                plan = poisson_batches(n, sample_rate=self.sample_rate, steps=self.batches,
                                       seed=self._stream.seed, offset=start)
        self.plan_offset, self.pass_done = start, done
        for i in range(done, len(plan)):
            self.pass_done = i + 1
            yield plan[i]

    def _begin_drawn(self, drawn) -> None:
        """Start a pass's record ``drawn`` of batches awaiting their step.  A pass
        handed out to its end with batches still awaiting theirs keeps them, so
        that the next step (on the new pass's first batch) is refused: its last
        batches were left without a step (``if len(x) == 0: continue`` on an
        empty last batch; the sixth audit found it released one step fewer
        than were drawn, and paired ranks' steps across passes).  A pass left
        early (``break``: the sampler not run to its end) is forgotten."""
        if not (drawn and self.plan_offset is not None and self.pass_done >= self.batches):
            drawn.clear()

    def pass_state(self) -> dict | None:
        """``{"plan_offset", "done"}`` of an unfinished pass, else None."""
        if self.plan_offset is None or self.pass_done >= self.batches:
            return None
        return {"plan_offset": self.plan_offset, "done": self.pass_done}

    def resume_pass(self, state: dict | None) -> None:
        """The next pass continues the one ``pass_state()`` described (None: a
        fresh pass)."""
        self._resume = None if state is None else (state["plan_offset"], state["done"])


class Run:
    """What make_private built and a checkpoint restores."""

    def __init__(self, module, optimizer, clipper, sampler):
        self.module, self.optimizer, self.clipper, self.sampler = \
            module, optimizer, clipper, sampler

    def config(self, engine) -> dict:
        """The noise configuration a checkpoint is valid for (all public)."""
        c = self.clipper
        adaptive = c.adaptive.arguments() if c.adaptive is not None else None
        # Adaptive clipping: max_grad_norm is only where the bound started (the
        # run's current one is stored on its own and restored); the arguments
        # that move it must be the checkpoint's.
        return {"noise_multiplier": c.noise_multiplier,
                "max_grad_norm": c.max_grad_norm if adaptive is None else None,
                "adaptive": adaptive,
                "clipping": c.clipping, "layer_norms": c.layer_norms,
                "loss_reduction": c.loss_reduction,
                "expected_batch_size": c.expected_batch_size,
                "sample_rate": engine.sample_rate, "batches_per_pass": self.sampler.batches,
                "parameters": list(c.param_names)}


def _privacy_tag(eng: dict, accountant_state) -> str:
    """HMAC-SHA256, keyed by the run's secret seed, of the engine entry (less the
    tag) and the accountant's history. A file whose history was emptied, whose
    stream position was rewound or whose configuration was edited after
    save_checkpoint wrote it no longer matches. Not a defence against whoever
    holds the file and this code (the key is in the file): against tools and
    hands that change a checkpoint's privacy state without recomputing it."""
    body = json.dumps({"engine": {k: v for k, v in eng.items() if k != "tag"},
                       "accountant": accountant_state}, sort_keys=True, allow_nan=True)
    key = int(eng["noise"]["seed"]).to_bytes(8, "little")
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def check_steps_accounted(stream_steps: int, accountant, unbounded: bool, what: str) -> None:
    """The noise stream's count of released steps must be the accountant's
    (a step at noise multiplier 0 makes the run unbounded and is not recorded):
    a stream ahead of the history would report less epsilon than was spent, one
    behind it would draw the same noise again."""
    recorded = accountant.total_steps
    if stream_steps == recorded or (unbounded and stream_steps > recorded):
        return
    raise ValueError(
        f"{what}: the noise stream has released {stream_steps} private step(s), the accountant's "
        f"history records {recorded}; resuming would "
        f"{'report less epsilon than was spent' if stream_steps > recorded else 'reuse noise'}. "
        "Resume a run with PrivacyEngine.save_checkpoint / load_checkpoint, which carry both")


def _run(engine, what) -> Run:
    run = getattr(engine, "_run", None)
    if run is None:
        raise RuntimeError(f"PrivacyEngine.{what}: expected an engine after make_private, got "
                           "one before it; call make_private first and pass the module and "
                           "optimizer it returned (a checkpoint restores the private run "
                           "into them, as Opacus's does)")
    return run


def _check_targets(run, module, optimizer, schedulers: dict):
    inner = getattr(run.module, "_module", run.module)
    if module is not run.module and module is not inner:
        raise ValueError(f"module: expected the module make_private returned (or the model it "
                         f"wraps), got another {type(module).__name__}")
    if optimizer is not None and optimizer is not run.optimizer:
        raise ValueError(f"optimizer: expected the DPOptimizer make_private returned or None, "
                         f"got {type(optimizer).__name__}")
    for name, value in schedulers.items():
        if value is None:
            continue
        if not (callable(getattr(value, "state_dict", None))
                and callable(getattr(value, "load_state_dict", None))):
            raise TypeError(f"{name}: expected a scheduler with state_dict() and "
                            f"load_state_dict() (opacus.schedulers), got {type(value).__name__}")
        if getattr(value, "optimizer", None) is not run.optimizer:
            raise ValueError(f"{name}: expected a scheduler of the DPOptimizer make_private "
                             f"returned, got a {type(value).__name__} of another optimizer; "
                             "its state would not be the schedule of this run")


def _scheduler_state(scheduler) -> dict:
    # A Lambda scheduler's function is code, like the model's: it is not stored
    # (weights_only loading could not read it back); the scheduler the resumed
    # run builds brings its own, and everything else is restored.
    return {k: v for k, v in scheduler.state_dict().items() if not callable(v)}


def _scheduled(run, ckpt, path, schedulers) -> set:
    """The config keys a restored scheduler sets: the checkpoint's value (the
    sigma or C of the next step) replaces make_private's. A scheduler passed
    without a stored state, or a stored state without its scheduler, is
    refused: either way the run would go on at a value its schedule did not
    give."""
    keys = set()
    for name, value in schedulers.items():
        key, attr = _SCHEDULERS[name]
        stored = isinstance(ckpt, dict) and key in ckpt
        if value is not None and not stored:
            raise ValueError(f"{name}: expected None, since {path!r} holds no {key!r} "
                             f"(save_checkpoint was given no {name}); the schedule's "
                             f"{attr} of the checkpoint is unknown")
        if value is None and stored:
            raise ValueError(f"{name}: expected the run's scheduler, since {path!r} holds its "
                             f"state {key!r}, got None; without it the run would go on at "
                             f"make_private's {attr} instead of the scheduled one. Build the "
                             "scheduler on the DPOptimizer make_private returned and pass it")
        if stored and not isinstance(ckpt[key], dict):
            raise ValueError(f"path: expected {key!r} as a dict in {path!r}, got "
                             f"{type(ckpt[key]).__name__}")
        # Only values the clipper lets change: a flat bound, one process.
        settable = run.clipper.group is None and (
            attr == "noise_multiplier" or run.clipper.clipping == "flat")
        if stored and settable:
            keys.add(attr)
    return keys


def _kwargs(value, name) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{name}: expected a dict or None, got {type(value).__name__}")
    return value


# The start of save()'s warning for a state left out (its callers that store
# the optimizer themselves, Lightning's and the HF Trainer's, filter it).
OPTIMIZER_LEFT_OUT = "optimizer: not passed to save_checkpoint"


def save(engine, *, path, module, optimizer=None, noise_scheduler=None,
         grad_clip_scheduler=None, checkpoint_dict=None, module_state_dict_kwargs=None,
         torch_save_kwargs=None) -> None:
    run = _run(engine, "save_checkpoint")
    schedulers = {"noise_scheduler": noise_scheduler, "grad_clip_scheduler": grad_clip_scheduler}
    _check_targets(run, module, optimizer, schedulers)
    if run.clipper._accumulated:
        # The clipped sums of the logical batch's earlier physical batches are
        # not in the file: a resumed run would noise that logical batch without them.
        raise ValueError("save_checkpoint: expected a checkpoint between logical steps, got one "
                         "inside a logical batch (BatchMemoryManager: physical batches "
                         "accumulated, its step not taken yet); save after a step that was not "
                         "skipped (optimizer._is_last_step_skipped is False)")
    extra = _kwargs(checkpoint_dict, "checkpoint_dict")
    clash = sorted(set(extra) & set(_RESERVED))
    if clash:
        raise ValueError(f"checkpoint_dict: expected no key the engine writes {list(_RESERVED)}, "
                         f"got {clash}")
    state = dict(extra)
    state[_MODULE] = module.state_dict(**_kwargs(module_state_dict_kwargs,
                                                 "module_state_dict_kwargs"))
    if optimizer is not None:
        # The stream goes once, under _ENGINE, whichever optimizer is passed.
        state[_OPTIMIZER] = optimizer.original_optimizer.state_dict()
    elif run.optimizer.original_optimizer.state:
        # The load's warning needs a stored state to see: without one a
        # momentum restarted with no word (the eighth audit).
        warnings.warn(OPTIMIZER_LEFT_OUT + ", so the optimizer's state "
                      "(momentum or moment buffers) is left out of the file and a resumed run "
                      "starts it afresh; pass optimizer= to continue it", UserWarning,
                      stacklevel=3)
    for name, value in schedulers.items():
        if value is not None:
            state[_SCHEDULERS[name][0]] = _scheduler_state(value)
    state[_ACCOUNTANT] = engine.accountant.state_dict()
    eng = {"format": _FORMAT, "version": _VERSION,
           "accountant": engine.accountant_name,
           "unbounded": bool(engine._unbounded),
           "config": run.config(engine),
           "noise": run.clipper.noise_state(),
           "clip_bound": float(run.clipper.max_grad_norm),
           "loader_pass": run.sampler.pass_state()}
    eng["tag"] = _privacy_tag(eng, state[_ACCOUNTANT])
    state[_ENGINE] = eng
    torch.save(state, path, **_kwargs(torch_save_kwargs, "torch_save_kwargs"))


def _engine_state(ckpt, path) -> dict:
    eng = ckpt.get(_ENGINE) if isinstance(ckpt, dict) else None
    if not isinstance(eng, dict) or eng.get("format") != _FORMAT:
        raise ValueError(f"path: expected a checkpoint written by PrivacyEngine.save_checkpoint, "
                         f"got {path!r} without its {_ENGINE!r} entry (an Opacus checkpoint has "
                         "no noise stream and cannot continue a private run here)")
    if eng.get("version") != _VERSION:
        raise ValueError(f"path: expected checkpoint version {_VERSION}, got "
                         f"{eng.get('version')!r}")
    _check_counts(eng.get("noise"), ("seed", "offset", "steps"), "the noise stream", path)
    if eng.get("loader_pass") is not None:
        _check_counts(eng["loader_pass"], ("plan_offset", "done"), "the loader's pass", path)
    return eng


def _clip_bound(run, eng, path) -> float | None:
    """Adaptive clipping: the bound the next step clips at (the arguments that
    move it were compared as config). Not checked against [min_clipbound,
    max_clipbound]: before the first update it is make_private's, which may
    lie outside."""
    if run.clipper.adaptive is None:
        return None
    c = eng.get("clip_bound")
    if not isinstance(c, float) or not math.isfinite(c) or c <= 0:
        raise ValueError(f"path: expected the adaptive clip bound as a finite float > 0 in "
                         f"{path!r}, got {c!r}")
    return c


def _check_counts(entry, keys, what, path) -> None:
    if not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), int) and entry[k] >= 0 for k in keys):
        raise ValueError(f"path: expected {what} as non-negative integers "
                         f"{', '.join(keys)} in {path!r}, got a damaged entry")


def _checked(engine, run, path, module, optimizer, schedulers, torch_load_kwargs):
    """The checks of :func:`load` (nothing written): the checkpoint and what
    its restore needs."""
    _check_targets(run, module, optimizer, schedulers)
    if len(engine.accountant) or engine._unbounded or run.clipper.steps:
        raise RuntimeError("PrivacyEngine.load_checkpoint: expected a fresh engine, got one that "
                           f"already took {run.clipper.steps} private step(s); their privacy "
                           "cost would be lost. Call make_private in a new engine and load "
                           "right after it")
    # weights_only: unpickling a full pickle runs whatever code the file names;
    # the checkpoint is plain types and tensors, so nothing else is allowed in.
    ckpt = torch.load(path, **{"weights_only": True,
                               **_kwargs(torch_load_kwargs, "torch_load_kwargs")})
    eng = _engine_state(ckpt, path)
    if eng.get("accountant") != engine.accountant_name:
        raise ValueError(f"accountant: the checkpoint was written by an engine with "
                         f"accountant={eng.get('accountant')!r}, this one has "
                         f"{engine.accountant_name!r}; create PrivacyEngine(accountant="
                         f"{eng.get('accountant')!r}) to resume it")
    saved, now = eng.get("config"), run.config(engine)
    scheduled = _scheduled(run, ckpt, path, schedulers)
    if scheduled and isinstance(saved, dict):
        # The scheduled values are checked as the setters check them, before any write.
        c = check_positive(saved.get("max_grad_norm"), "max_grad_norm") \
            if "max_grad_norm" in scheduled else run.clipper.max_grad_norm
        _mechanism.check_noise_multiplier(saved.get("noise_multiplier"), c)
    # The clipping mode first: adaptive clipping keeps no max_grad_norm in
    # the configuration, and a mode switched was reported as max_grad_norm
    # None against the 1.0 the user passed both times (the eighth audit).
    for key in sorted(now, key=lambda k: k not in ("clipping", "adaptive")):
        value = now[key]
        if key in scheduled:
            continue
        if not isinstance(saved, dict) or saved.get(key) != value:
            got = saved.get(key) if isinstance(saved, dict) else None
            raise ValueError(f"{key}: the checkpoint was taken with {key}={got!r}, this run "
                             f"has {value!r}; call make_private with the checkpoint's "
                             "configuration (and the same data loader) to resume it")
    bound = _clip_bound(run, eng, path)
    # Validated before use (a step without noise is the engine's accountant's).
    accountant = EngineAccountant(engine.accountant.mechanism())
    accountant.load_state_dict(ckpt.get(_ACCOUNTANT))
    check_steps_accounted(eng["noise"]["steps"], accountant, bool(eng.get("unbounded")), "path")
    tag = eng.get("tag")
    if not isinstance(tag, str) or not hmac.compare_digest(
            tag, _privacy_tag(eng, ckpt.get(_ACCOUNTANT))):
        raise ValueError(f"path: the privacy state of {path!r} (accountant history, noise stream "
                         "position, configuration) does not match the integrity tag "
                         "save_checkpoint wrote: it was changed since; resuming it could report "
                         "less epsilon than was spent or draw the same noise again")
    if optimizer is not None and _OPTIMIZER not in ckpt:
        raise ValueError(f"optimizer: expected None, since {path!r} holds no optimizer state "
                         "(save_checkpoint was given none)")
    if optimizer is None and _OPTIMIZER in ckpt:
        # Legitimate (a fresh optimizer by choice, as Opacus allows), but a run
        # resumed without its momentum or Adam moments no longer equals the
        # uninterrupted one: said, not silent.
        warnings.warn(f"optimizer: {path!r} holds an optimizer state that is not restored "
                      "(optimizer=None): the resumed run starts the optimizer afresh (momentum, "
                      "Adam moments, step counts); pass the DPOptimizer make_private returned "
                      "to continue it", UserWarning, stacklevel=4)
    return ckpt, eng, saved, scheduled, bound, accountant


def load(engine, *, path, module, optimizer=None, noise_scheduler=None,
         grad_clip_scheduler=None, module_load_dict_kwargs=None, torch_load_kwargs=None) -> dict:
    run = _run(engine, "load_checkpoint")
    schedulers = {"noise_scheduler": noise_scheduler, "grad_clip_scheduler": grad_clip_scheduler}
    group = run.clipper.group
    try:
        ckpt, eng, saved, scheduled, bound, accountant = _checked(
            engine, run, path, module, optimizer, schedulers, torch_load_kwargs)
        error = None
    except Exception as e:
        if group is None:
            raise
        error = e
    if group is not None:
        # Every rank must resume one state: a rank that failed its checks, or
        # read another checkpoint (a stale copy on one node), is refused on
        # every rank before anything is written (the sixth audit: two ranks
        # loading consecutive checkpoints went on apart, epsilon 11.62 on one
        # and 13.70 on the other).  Only an HMAC of each rank's tag crosses.
        check_same_config({}, group, "load_checkpoint", error=error,
                          secret={"checkpoint": "" if error else eng.get("tag")})
    # Everything checked: only now is anything written.  The optimizer's
    # state first, the module's after it, each put back as it was if the
    # other fails: an SGD checkpoint loaded into Adam failed with a bare
    # KeyError after the module's weights were written (the fifth audit).
    if optimizer is not None:
        inner = optimizer.original_optimizer
        kept = inner.state_dict()
        try:
            inner.load_state_dict(ckpt[_OPTIMIZER])
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            inner.load_state_dict(kept)
            raise ValueError(
                f"optimizer: the state in {path!r} does not load into this "
                f"{type(inner).__name__} ({type(e).__name__}: {e}); pass an optimizer of the "
                "kind and parameter groups the run was saved with. Nothing was written") from e
    try:
        module.load_state_dict(ckpt[_MODULE], **_kwargs(module_load_dict_kwargs,
                                                        "module_load_dict_kwargs"))
    except Exception:
        if optimizer is not None:
            inner.load_state_dict(kept)
        raise
    # The next step's sigma and C, as scheduled; checked together above (through
    # the setters one at a time, the first could meet the other's old value).
    if "noise_multiplier" in scheduled:
        run.clipper._noise_multiplier = float(saved["noise_multiplier"])
    if "max_grad_norm" in scheduled:
        run.clipper._max_grad_norm = float(saved["max_grad_norm"])
    if bound is not None:
        run.clipper._max_grad_norm = bound
    for name, value in schedulers.items():
        if value is not None:
            value.load_state_dict(ckpt[_SCHEDULERS[name][0]])
    engine.accountant.load_state_dict(accountant.state_dict())
    engine._unbounded = bool(eng.get("unbounded"))
    run.clipper.load_noise_state(eng["noise"])
    run.optimizer._noise_restored()
    run.sampler.resume_pass(eng.get("loader_pass"))
    # What the loop saved, without the key.
    return {k: v for k, v in ckpt.items() if k != _ENGINE}
