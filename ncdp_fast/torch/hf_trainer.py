"""``DPTrainer``: Hugging Face's ``transformers.Trainer`` training privately
through :class:`~ncdp_fast.torch.PrivacyEngine` (what dp-transformers does for
Opacus).  Swap ``Trainer`` for ``DPTrainer`` and add the privacy arguments; the
rest of the script stays.  Importing this module imports ``transformers``;
``import ncdp_fast.torch`` does not.  docs/hf_trainer.md is the user's view.
"""
from __future__ import annotations

import inspect
import math
import os
import warnings

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

import transformers
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import privacy
from .._validate import check_delta, check_nonneg, check_positive
from .accounting import dp_accounting_name
from .checkpoint import OPTIMIZER_LEFT_OUT as _OPTIMIZER_LEFT_OUT
from .data import loader_settings
from .engine import PrivacyEngine
from .losses import causal_lm_loss

__all__ = ["DPTrainer", "ENGINE_FILE", "sequence_classification_loss"]

# The engine's checkpoint inside each Trainer checkpoint folder.  It holds the
# secret noise key (so does the Trainer's optimizer.pt): keep folders private.
ENGINE_FILE = "ncdp_engine.pt"
_CAUSAL = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
_SEQ_CLS = set(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values())

# TrainingArguments the private run cannot honour exactly: (field, refused when, expected).
_REFUSED = (
    ("gradient_accumulation_steps", lambda a: a.gradient_accumulation_steps != 1,
     "1: the Poisson batch is the logical batch (a second forward before the step is "
     "refused); raise per_device_train_batch_size instead"),
    # None is refused too: transformers' own step compares it with 0 and fails
    # there, with a TypeError that names neither (the fifth audit).
    ("max_grad_norm", lambda a: a.max_grad_norm != 0,
     "0: the Trainer clips before optimizer.step(), where no gradient exists yet, "
     "and clipping the noised one would shrink every update by the noise's norm; the "
     "per-sample bound is DPTrainer(max_grad_norm=...)"),
    ("fp16", lambda a: a.fp16, "False: the GradScaler needs gradients before the step"),
    ("bf16", lambda a: a.bf16,
     "False: DPTrainer's loss is a batch mean, and under bfloat16 autocast its 1/B is rounded "
     "into each sample's gradient to a value that depends on the batch size (removing one "
     "sample moved the clipped sum by 1.42 C at B = 999; docs/torch.md, 'Half precision')"),
    ("torch_compile", lambda a: a.torch_compile, "False: the clipper's hooks run eagerly"),
    ("label_smoothing_factor", lambda a: a.label_smoothing_factor != 0,
     "0: the LabelSmoother averages over the whole batch's tokens"),
    ("neftune_noise_alpha", lambda a: a.neftune_noise_alpha is not None,
     "None: NEFTune scales each sample's noise by the batch's padded length"),
    ("use_liger_kernel", lambda a: a.use_liger_kernel, "False: its fused loss is a batch mean"),
    ("dataloader_drop_last", lambda a: a.dataloader_drop_last,
     "False: a Poisson pass has no last batch to drop (it would change the sample rate)"),
    ("train_sampling_strategy", lambda a: a.train_sampling_strategy != "random",
     "'random': the batches are Poisson-sampled from the noise stream"),
    ("data_seed", lambda a: a.data_seed is not None,
     "None: the batches come from the noise stream, keyed by DPTrainer(noise_seed=...)"),
    ("optim", lambda a: any(w in str(getattr(a.optim, "value", a.optim))
                            for w in ("lomo", "layerwise")),
     "an optimizer stepped by optimizer.step(): LOMO/AdaLomo and the layer-wise GaLore/APOLLO "
     "update each parameter from its gradient hook inside backward, where no private "
     "gradient exists yet"),
    ("auto_find_batch_size", lambda a: a.auto_find_batch_size,
     "False: a smaller batch mid-run changes the sample rate of an accounted run"),
    ("ignore_data_skip", lambda a: a.ignore_data_skip,
     "False: a resumed run would train the checkpointed pass's first batches twice"),
    ("deepspeed", lambda a: bool(a.deepspeed), "None: one process only"),
    ("fsdp", lambda a: bool(a.fsdp), "no FSDP: one process only"),
    ("n_gpu", lambda a: a.n_gpu > 1, "at most 1 (DataParallel splits the batch over replicas "
     "the clipper does not see); make one GPU visible"),
    ("world_size", lambda a: a.world_size > 1, "1 process (the engine refuses DDP)"),
    ("hub_strategy", lambda a: a.push_to_hub and str(
        getattr(a.hub_strategy, "value", a.hub_strategy)) in ("checkpoint", "all_checkpoints"),
     "'every_save' or 'end' with push_to_hub: checkpoint folders hold the secret noise key"),
)


def _batch_size(inputs) -> int | None:
    """Rows of the batch's first tensor (the clipper's batch too)."""
    return next((v.shape[0] for v in inputs.values()
                 if isinstance(v, torch.Tensor) and v.ndim), None)


class _CollateWithEmpty:
    """The Trainer's collator; an empty batch is the collated first sample cut
    to zero rows (keys and shapes only).  A class: workers may be spawned."""

    def __init__(self, dataset, collate):
        self.dataset, self.collate, self.template = dataset, collate, None

    def __call__(self, batch):
        if len(batch):
            return self.collate(batch)
        if self.template is None:
            with torch.random.fork_rng(devices=[]):     # a random collator's draws untouched
                full = self.collate([self.dataset[0]])
            self.template = {k: v[:0] if isinstance(v, (torch.Tensor, list)) else v
                             for k, v in full.items()}
        return dict(self.template)


class DPTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose every step is a DP-SGD step.

    Privacy arguments (keyword only; all others are the Trainer's own):
        max_grad_norm: C > 0: each sample's gradient over all trainable
            parameters is clipped to norm C, each step's sensitivity (not
            ``TrainingArguments.max_grad_norm``, which must be 0).
        noise_multiplier: sigma >= 0: noise of std sigma * C is added to the
            clipped sum (0: no privacy, epsilon inf); or ``target_epsilon``:
            the smallest sigma whose epsilon after the run's steps
            (``max_steps``, else ceil(num_train_epochs * batches per pass))
            is at most it, at ``target_delta``, under ``accountant``.
        target_delta: delta in (0, 1): the calibration's and the logs'.
        accountant: "prv" (default), "pld", "rdp" or "gdp" (PrivacyEngine's).
        noise_seed: key of the Philox stream the Poisson batches and the noise
            are drawn from (default: from the OS).  Secret: it lets one
            subtract the noise.  Not ``TrainingArguments.seed``.

    Each of the ceil(n / per_device_train_batch_size) batches of a pass holds
    every sample independently with probability q = 1 / that number (empty
    batches: noise-only steps).  Logs carry ``epsilon`` at ``target_delta``;
    each checkpoint folder gets ``ncdp_engine.pt``, from which
    ``train(resume_from_checkpoint=...)`` resumes the accountant, the noise
    stream and the pass.  One ``train()`` per DPTrainer.
    """

    def __init__(self, *args, max_grad_norm, target_delta, noise_multiplier=None,
                 target_epsilon=None, accountant: str = "prv", noise_seed=None, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None:
            raise ValueError("args: expected TrainingArguments (with max_grad_norm=0), got None")
        for name, refused, why in _REFUSED:    # before the Trainer acts on them (hub)
            if refused(training_args):
                raise ValueError(f"TrainingArguments.{name}: expected {why}; got "
                                 f"{getattr(training_args, name)!r}")
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("noise_multiplier, target_epsilon: expected exactly one, got "
                             f"{noise_multiplier!r} and {target_epsilon!r}")
        self.dp_max_grad_norm = check_positive(max_grad_norm, "max_grad_norm")
        self.target_delta = check_delta(target_delta, "target_delta")
        self.target_epsilon = None if target_epsilon is None else \
            check_positive(target_epsilon, "target_epsilon")
        self.noise_multiplier = None if noise_multiplier is None else \
            check_nonneg(noise_multiplier, "noise_multiplier")
        self.noise_seed = noise_seed
        self.privacy_engine = PrivacyEngine(accountant=accountant)
        self._private_loader, self._eps_cache, self._ran = None, (None, None), False
        super().__init__(*args, **kwargs)
        # Refused now, not at the first step.
        self._kind = None if self.compute_loss_func is not None else _loss_kind(self.model)

    def get_train_dataloader(self) -> DataLoader:
        """The engine's Poisson loader, built once by make_private (one process:
        not prepared by accelerate; training_step moves each batch)."""
        if self._private_loader is not None:
            return self._private_loader
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError("train_dataset: expected a map-style dataset with len() (Poisson "
                             "sampling draws indices), got an IterableDataset")
        # The Trainer's own loader (columns removed, collator, workers) is the
        # template make_private reads: its length fixes q, its dataset is sampled.
        plain, a = super().get_train_dataloader(), self.args
        if self.optimizer is None:
            super().create_optimizer()
        if self.target_epsilon is not None:
            steps = a.max_steps if a.max_steps > 0 else \
                math.ceil(a.num_train_epochs * len(plain))
            self.noise_multiplier = privacy.calibrate_noise_multiplier(
                self.target_epsilon, self.target_delta, 1.0 / len(plain), steps,
                accountant=dp_accounting_name(self.privacy_engine.accountant_name))
        # wrap_model=False: the clipper's hooks sit on the model itself, which
        # the Trainer keeps saving with save_pretrained.
        _, self.optimizer, poisson = self.privacy_engine.make_private(
            module=self.model, optimizer=self.optimizer, data_loader=plain,
            noise_multiplier=self.noise_multiplier, max_grad_norm=self.dp_max_grad_norm,
            loss_reduction="mean", seed=self.noise_seed, wrap_model=False)
        self._private_loader = DataLoader(
            poisson.dataset, batch_sampler=poisson.batch_sampler,
            collate_fn=_CollateWithEmpty(poisson.dataset, plain.collate_fn),
            **loader_settings(poisson))
        return self._private_loader

    def train(self, *args, **kwargs):
        if self._ran:
            raise RuntimeError("DPTrainer.train: expected one train() per DPTrainer (its engine "
                               "accounts that run), got a second; build a new DPTrainer and "
                               "train(resume_from_checkpoint=...) to continue")
        self._ran = True
        return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if _batch_size(inputs) == 0:
            # Empty Poisson batch (transformers' models cannot run zero rows): the
            # step that follows is pure noise, accounted as any.
            model.train()
            self.privacy_engine._run.clipper.declare_batch_size(0)
            return torch.zeros((), device=self.args.device)
        return super().training_step(model, inputs, num_items_in_batch)

    def _get_grad_norm(self, model, grad_norm=None):
        return None    # no gradient exists before the private step: it would log 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The batch mean of per-sample losses (loss_reduction "mean": the engine
        divides the clipped sum by the expected batch size), from the logits of
        the model called without labels (its own token loss divides by the
        whole batch's tokens): a causal LM's :func:`causal_lm_loss` (each
        sample's mean over its own shifted labels not -100); a sequence
        classifier's own loss per sample (a -100 label gives 0); or
        ``compute_loss_func(outputs, labels, num_items_in_batch=None)``, which
        must return such a mean (the engine checks it on the autograd graph)."""
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError("inputs: expected 'labels' in the batch (DPTrainer computes the "
                             f"per-sample loss from them), got keys {sorted(inputs)}")
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=None)
        elif self._kind == "causal":
            loss = causal_lm_loss(outputs.logits, labels, reduction="mean")
        else:
            loss = sequence_classification_loss(self.model.config, outputs.logits, labels)
        return (loss, outputs) if return_outputs else loss

    def epsilon(self) -> float:
        """epsilon at ``target_delta`` of the private steps taken so far."""
        steps = self.privacy_engine.accountant.total_steps
        if self._eps_cache[0] != steps:
            self._eps_cache = (steps, self.privacy_engine.get_epsilon(self.target_delta))
        return self._eps_cache[1]

    def floating_point_ops(self, inputs) -> int:
        """0: the Trainer's count, 6 x parameters x the batch's tokens summed over
        the run into ``total_flos`` (logs, metrics, trainer_state.json), would
        release the realized Poisson batch sizes (and, with dynamic padding,
        each batch's longest sample) without noise (the sixth audit)."""
        return 0

    def log(self, logs, *args, **kwargs):
        if self._private_loader is not None:
            logs["epsilon"] = self.epsilon()
        return super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        # Written first: a folder the Trainer completed always holds it.
        if self._private_loader is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            with warnings.catch_warnings():
                # The Trainer stores the optimizer's state itself.
                warnings.filterwarnings("ignore", message=_OPTIMIZER_LEFT_OUT)
                self.privacy_engine.save_checkpoint(
                    path=os.path.join(folder, ENGINE_FILE), module=self.model,
                    checkpoint_dict={"global_step": self.state.global_step})
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Runs after make_private and before optimizer.pt is loaded, whose noise
        # state the optimizer checks against the accountant restored here.
        if checkpoint is not None:
            self._restore_engine(checkpoint)
        super()._load_optimizer_and_scheduler(checkpoint)

    def _restore_engine(self, checkpoint) -> None:
        path = os.path.join(checkpoint, ENGINE_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"resume_from_checkpoint: expected a DPTrainer checkpoint holding "
                             f"{ENGINE_FILE} (accountant history, noise stream), got "
                             f"{checkpoint!r} without it; resuming would restart epsilon at 0")
        extra = self.privacy_engine.load_checkpoint(path=path, module=self.model)
        step = self.state.global_step
        if extra.get("global_step") != step:
            raise ValueError(f"resume_from_checkpoint: {ENGINE_FILE} was saved at step "
                             f"{extra.get('global_step')!r}, the Trainer state at step {step}")
        # The Trainer skips the pass's first global_step % len batches itself: the
        # sampler restarts the pass at 0, not after the batches it handed out.
        sampler = self._private_loader.batch_sampler
        saved, skip = sampler._resume, step % len(sampler)
        if (saved is None and skip) or (saved is not None and saved[1] < skip):
            raise ValueError(f"resume_from_checkpoint: the loader's pass in {ENGINE_FILE} "
                             f"({saved!r}) does not reach the Trainer's step {step}"
                             + (": with dataloader_num_workers the workers had drawn the "
                                "pass to its end when the checkpoint was saved (a checkpoint "
                                "in a pass's last workers x prefetch_factor steps cannot be "
                                "resumed); save with dataloader_num_workers=0, or at other "
                                "steps" if self.args.dataloader_num_workers else ""))
        if saved is not None:
            sampler.resume_pass({"plan_offset": saved[0], "done": 0})
            # Stepped on and accounted before the checkpoint: the optimizer's
            # step must not expect them.
            sampler._replayed = skip


def _shifts_labels(cls) -> bool:
    """Whether a causal-LM class's own loss is transformers' ForCausalLMLoss
    (labels shifted by one inside the loss, as ``causal_lm_loss`` does): its
    forward calls ``self.loss_function`` and sets no other loss type.
    Marian, Pegasus, XLM, Bart, Whisper and others in the causal-LM mapping
    compute a cross-entropy on the labels as given (the caller shifts them):
    trained with the shifted loss, the objective was another one, silently
    (the fifth audit: relative errors 0.58 to 1.28 against the model's own)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in source and \
        getattr(cls, "loss_type", None) in (None, "ForCausalLM") and \
        "_loss_function" not in vars(cls)


def _loss_kind(model) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model    # peft
    name = type(base).__name__
    if name in _CAUSAL and not _shifts_labels(type(base)):
        raise ValueError(
            f"model: {name} computes its own language-modelling loss on the labels as given "
            "(not shifted by one inside the loss, as transformers' ForCausalLMLoss and "
            "DPTrainer's causal_lm_loss do); training it with the shifted loss would optimise "
            "another objective. Pass compute_loss_func=f(outputs, labels, "
            "num_items_in_batch=None) returning the batch mean of per-sample losses, e.g. "
            "per_sample_token_loss(outputs.logits, labels) for labels aligned with the "
            "logits")
    if name in _CAUSAL or name in _SEQ_CLS:
        return "causal" if name in _CAUSAL else "sequence_classification"
    raise ValueError(f"model: DPTrainer has no per-sample loss for {name} (causal language "
                     "models and sequence classifiers only); pass compute_loss_func="
                     "f(outputs, labels, num_items_in_batch=None) returning the batch mean of "
                     "per-sample losses, e.g. per_sample_token_loss(outputs.logits, labels)")


def sequence_classification_loss(config, logits, labels):
    """transformers' sequence-classification loss (problem_type inferred as its
    models do), as each sample's term over the realized batch size (0 if empty)."""
    n, k = max(logits.shape[0], 1), logits.shape[-1]
    problem = config.problem_type or (
        "regression" if config.num_labels == 1 else
        "single_label_classification" if labels.dtype in (torch.long, torch.int) else
        "multi_label_classification")
    if problem == "regression":
        out = logits.squeeze(-1) if k == 1 else logits
        return F.mse_loss(out, labels.to(out.dtype).view_as(out), reduction="sum") / (n * k)
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, k), labels.view(-1), reduction="sum") / n
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype),
                                              reduction="sum") / (n * k)
