"""Benchmark of one private fine-tuning step of Hugging Face models against the
non-private step and Opacus (report ``bench_hf``; issue 26).

Workloads (``--bench-size full``; float32, random-config ``transformers``
models built here, nothing downloaded; fixed synthetic token ids: a step's time
does not depend on their values; dropout at the configs' default 0.1):

1. ``GPT-2``: ``GPT2LMHeadModel`` with d = 768, 12 heads, vocabulary 50257,
   ``lm_head`` tied to ``wte`` (the default), 2 layers (the CPU time of the
   shared 2-core machine allows no more: the tied 50257 x 768 head is most of a
   step), T = 128, B = 4.  Loss: causal-LM next-token cross entropy, each
   sample's mean over its own tokens, mean over samples
   (:class:`ncdp_fast.torch.TokenCrossEntropyLoss` on ``logits[:, :-1]`` against
   ``ids[:, 1:]``; no padding, so it equals transformers' own loss).
2. ``BERT``: ``BertForSequenceClassification``, BERT-base's shape (d = 768, 12
   heads, feed-forward 3072, vocabulary 30522, 512 positions) with 2 layers,
   2 classes, T = 128, B = 8; cross entropy, mean over samples.
3. ``BERT ..., bfloat16 autocast`` (on a GPU at each size, on the CPU at the
   ``smallest`` size only): the BERT workload with the forward and the loss of every method under
   ``torch.autocast(dtype=torch.bfloat16)``, float32 weights, no GradScaler (the
   usual GPU fine-tuning mode; issue 36's goals are the float32 rows, this one is
   measured with no target); cross entropy summed over samples and
   ``loss_reduction="sum"`` for every method (a mean's 1/B rounded into the
   bfloat16 gradients is refused by ncdp_fast: docs/torch.md, "Half precision").

On a GPU (``--bench-device cuda``, which ``make gpu-check`` runs when
``transformers`` is installed there) ``full`` is the models' own depth, 12
layers (GPT-2 small, BERT-base), with B = 16 and 32; ``quick``, gpu-check's
default, is the CPU's ``full`` above.  The issue's GPU target is 1.15x the
non-private time.

Methods, interleaved in one process (bench/README.md), the same model (same
weights), the same batch, the same loss:

* ``nonprivate``: zero_grad, forward, loss, backward, SGD step.
* ``ncdp_engine``: ``ncdp_fast.torch.PrivacyEngine.make_private`` (GhostClipper
  book-keeping clipping, one backward; its DPOptimizer adds the noise and
  records the step with the accountant).
* ``opacus_ghost``: Opacus 1.6 ``make_private(grad_sample_mode="ghost")`` with
  the same criterion (Opacus calls it with ``reduction="none"`` and gets the
  per-sample losses).
* ``opacus_hooks``: Opacus ``make_private(grad_sample_mode="hooks")``
  (per-sample gradients); timed in round 1 only.

Opacus on the models as they are fails in the first backward: the position
ids (1, T), broadcast over the batch, give the position embedding a per-sample
gradient of batch size 1 (hooks: "stack expects each tensor to be equal size,
but got [B] at entry 0 and [1] at entry 1"; ghost on BERT: "view size is not
compatible with input tensor's size and stride").  So the Opacus methods get
``position_ids`` as a (B, T) tensor (``torch.arange(T).repeat(B, 1)``, the same
values; BERT's token-type ids are already (B, T)), as an Opacus user would pass
them; the other methods run the models' default.  Where Opacus still refuses a
model or fails in its first step, the exception is recorded as the method's
``peer_refused`` (the table shows it; no time is recorded).  It is the peer's
result, not a failure of this benchmark: ``error`` is kept for methods of ours
that give no result, which fail ``make gpu-check``.

Noise multiplier 1, max_grad_norm 1, expected batch size B, flat clipping.

Peak memory, two numbers, each the median over three steps of its growth
during the step, sampled every millisecond (bench/_common.py ``peak_memory``):
``peak_alloc_mb``, the bytes malloc has handed out and not taken back (the
CPU's counterpart of the CUDA allocator's peak), and ``peak_extra_mb``, the
resident set, which adds what glibc keeps of freed memory (up to about twice
the first on these steps).  Both are measured from a clean
state: the previous step's gradients (and Opacus's ``grad_sample``) released
and glibc's free memory returned to the system (``malloc_trim``), so it counts
what one step allocates (activations, logits, gradients, per-sample gradients
or norms, noise) beyond the model, the optimizer and the batch.  torch's CPU
allocator does not cache (allocations are malloc/free), so both see them;
tracemalloc would not.  ``weights_mb`` is recorded next to it.

Targets (issue 26): ``ncdp_engine`` at most 1.25x the non-private time on the
CPU (1.15x on a GPU) and 1.1x its peak memory; bench/report.py judges the
memory target on each number.
"""
from __future__ import annotations

import os
import warnings

from _common import (Issue35Timer, cases, exception_text, measure, record_memory,
                     whole_batch_draw)

SHAPES = {
    "full": dict(gpt2=dict(B=4, T=128, d=768, heads=12, layers=2, vocab=50257),
                 bert=dict(B=8, T=128, d=768, heads=12, layers=2, ff=3072, vocab=30522, K=2)),
    "quick": dict(gpt2=dict(B=4, T=64, d=256, heads=4, layers=1, vocab=8192),
                  bert=dict(B=8, T=64, d=256, heads=4, layers=1, ff=1024, vocab=8192, K=2)),
    "smallest": dict(gpt2=dict(B=3, T=8, d=16, heads=2, layers=1, vocab=50),
                     bert=dict(B=3, T=8, d=16, heads=2, layers=1, ff=32, vocab=50, K=2)),
}
# On a GPU: --bench-size full is the models' own depth (GPT-2 small and BERT-base,
# 12 layers) at larger batches; quick (make gpu-check's default) the CPU's full shapes.
GPU_SHAPES = {
    "full": dict(gpt2=dict(SHAPES["full"]["gpt2"], layers=12, B=16),
                 bert=dict(SHAPES["full"]["bert"], layers=12, B=32)),
    "quick": SHAPES["full"],
    "smallest": SHAPES["smallest"],
}
# The common GPU fine-tuning mode, measured beside issue 36's float32 rows (no
# target of its own): BERT-base's full shape with its forward and loss under
# torch.autocast(dtype=torch.bfloat16), float32 weights, every method (the
# non-private step included) the same way; at each GPU size, and at the smallest
# size also on the CPU, so that the CI's run of every benchmark reaches it.
AUTOCAST = "bfloat16"
GPU_SHAPES["quick"] = dict(GPU_SHAPES["quick"])     # not the CPU's own full shapes
for _size in ("full", "quick"):
    GPU_SHAPES[_size]["bert_autocast"] = dict(GPU_SHAPES[_size]["bert"], kind="bert",
                                              autocast=AUTOCAST)
SHAPES["smallest"]["bert_autocast"] = dict(SHAPES["smallest"]["bert"], kind="bert",
                                           autocast=AUTOCAST)


def shapes(size, device):
    return (GPU_SHAPES if device == "cuda" else SHAPES)[size]
METHODS = ["nonprivate", "ncdp_engine", "opacus_ghost", "opacus_hooks"]
# On a GPU also the engine with gram_precision="float32" (its norms' Grams as
# float32 GEMMs with their rounding bound, docs/privacy.md); on the CPU it is
# ncdp_engine itself (the CPU's norms never form Grams).
GPU_METHODS = ["ncdp_engine_gram32"]
ONCE = ("opacus_hooks",)
OPACUS = ("opacus_ghost", "opacus_hooks")
C, SIGMA, LR = 1.0, 1.0, 0.01
REPEATS = 2                         # timed steps a round, after an untimed one and the memory one


def workload_label(kind, s):
    if kind == "gpt2":
        return (f"GPT-2 LM {s['layers']}x(d={s['d']}, heads={s['heads']}), V={s['vocab']} "
                f"tied, T={s['T']}, B={s['B']}")
    return (f"BERT cls {s['layers']}x(d={s['d']}, heads={s['heads']}, ff={s['ff']}), "
            f"V={s['vocab']}, K={s['K']}, T={s['T']}, B={s['B']}" +
            (f", {s['autocast']} autocast" if s.get("autocast") else ""))


def CASES(size, device):
    work = [(workload_label(s.get("kind", k), s), dict(s, kind=s.get("kind", k)))
            for k, s in shapes(size, device).items()]
    methods = METHODS + (GPU_METHODS if device == "cuda" else [])
    return {"test_hf_step": cases("bench_hf", work, methods, once=ONCE)}


def _model(p, per_row_positions=False, device="cpu"):
    """(model, ids, target, criterion, loss(model, criterion) -> scalar), seeded:
    every method gets the same weights and batch, on ``device``.
    ``per_row_positions``: pass ``position_ids`` as a (B, T) tensor (what Opacus
    needs, see the docstring) instead of the models' default (1, T)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from ncdp_fast.torch import TokenCrossEntropyLoss
    torch.manual_seed(0)
    B, T = p["B"], p["T"]
    ids = torch.randint(0, p["vocab"], (B, T))
    kw = dict(input_ids=ids.to(device))
    if per_row_positions:
        kw["position_ids"] = torch.arange(T).repeat(B, 1).to(device)
    if p["kind"] == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=p["layers"], n_embd=p["d"], n_head=p["heads"], vocab_size=p["vocab"],
            n_positions=max(1024, T), tie_word_embeddings=True))
        crit = TokenCrossEntropyLoss()
        # target (B, T): token t+1 at position t; the last position, with no next
        # token, ignored: same shape as the logits' first two dimensions.
        target = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
        on = target.to(device)
        return model.to(device), ids, target, crit, lambda m, c: c(m(**kw).logits, on)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=p["vocab"], hidden_size=p["d"], num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"], intermediate_size=p["ff"], num_labels=p["K"],
        max_position_embeddings=max(512, T)))
    target = torch.randint(0, p["K"], (B,))
    crit = torch.nn.CrossEntropyLoss(reduction=_reduction(p))
    on = target.to(device)
    return model.to(device), ids, target, crit, lambda m, c: c(m(**kw).logits, on)


def _reduction(p) -> str:
    """The loss's reduction over samples: a sum under autocast (module docstring)."""
    return "sum" if p.get("autocast") else "mean"


def build_step(p, method, device="cpu"):
    """(step, release, weights_mb): one training step of ``method`` on workload
    ``p`` on ``device``; ``release`` frees what a step leaves behind for the
    memory measurement."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    model, ids, target, crit, loss = _model(p, per_row_positions=method in OPACUS,
                                            device=device)
    model.train()
    weights_mb = sum(q.numel() * q.element_size() for q in model.parameters()
                     if q.requires_grad) / 2**20
    # make_private wants a loader: len() 1 gives sample rate 1 (expected batch B);
    # the step itself runs on the fixed batch, which at rate 1 is the Poisson
    # batch (whole_batch_draw), so every method sees exactly B rows.
    loader = DataLoader(TensorDataset(ids, target), batch_size=ids.shape[0])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    draw = None
    if method in ("ncdp_engine", "ncdp_engine_gram32"):
        from ncdp_fast.torch import PrivacyEngine
        model, opt, ploader = PrivacyEngine(accountant="prv").make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=SIGMA,
            max_grad_norm=C, seed=1, clipping=p.get("clipping", "flat"),    # host_step.py
            gram_precision="float32" if method == "ncdp_engine_gram32" else "float64",
            loss_reduction=_reduction(p))
        draw = whole_batch_draw(ploader, ids.shape[0])
    elif method in OPACUS:
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator
        errors = ModuleValidator.validate(model, strict=False)
        if errors:
            raise RuntimeError(f"ModuleValidator.validate: {errors}")
        kw = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=SIGMA,
                  max_grad_norm=C, loss_reduction=_reduction(p))
        if method == "opacus_hooks":
            model, opt, _ = PrivacyEngine(accountant="prv").make_private(
                **kw, grad_sample_mode="hooks")
        else:
            model, opt, crit, _ = PrivacyEngine(accountant="prv").make_private(
                **kw, criterion=crit, grad_sample_mode="ghost")
    elif method != "nonprivate":
        raise ValueError(method)

    autocast = p.get("autocast")

    def step():
        if draw is not None:
            draw()
        opt.zero_grad(set_to_none=True)
        if autocast:
            with torch.autocast(device_type=device, dtype=getattr(torch, autocast)):
                value = loss(model, crit)
        else:
            value = loss(model, crit)
        value.backward()
        opt.step()

    def release():
        opt.zero_grad(set_to_none=True)
    return step, release, weights_mb


def _opacus_error(case, device):
    """Build and run one step of an Opacus method; (step, release, weights_mb, None),
    or (None, None, None, "ExceptionType: message") where Opacus does not run it."""
    try:
        step, release, weights_mb = build_step(case.params, case.method, device)
        step()
        return step, release, weights_mb, None
    except Exception as exc:  # noqa: BLE001  -- the peer's failure is the result
        return None, None, None, exception_text(exc)


def test_hf_step(benchmark, case, bench_device, bench_size):
    import pytest
    pytest.importorskip("transformers")
    warnings.filterwarnings("ignore")
    first_done = False
    if case.method in OPACUS:
        pytest.importorskip("opacus")
        step, release, weights_mb, error = _opacus_error(case, bench_device)
        if error is not None:
            benchmark.group = f"{case.family} {case.workload} {bench_device}"
            benchmark.extra_info.update(family=case.family, workload=case.workload,
                                        method=case.method, round=case.round,
                                        device=bench_device, peer_refused=error)
            # pytest-benchmark writes only benchmarks that ran: one empty call,
            # its time ignored by bench/report.py wherever "peer_refused" is set.
            benchmark.pedantic(lambda: None, rounds=1, iterations=1)
            return
        first_done = True
    else:
        step, release, weights_mb = build_step(case.params, case.method, bench_device)
    # The per-step checks of issue 35, timed where they run (bench/_common.py).
    timer = Issue35Timer().install() if case.method == "ncdp_engine" else None
    try:
        if timer is not None:
            step = timer.counted(step)
        if not benchmark.disabled:
            if not first_done:
                step()                  # first call: lazy initialisation outside the numbers
            release()
            record_memory(benchmark, step, bench_device, reset=release, calls=3)
        measure(benchmark, case, step, device=bench_device, repeats=REPEATS, warmup=0,
                memory=False, first_call=False, weights_mb=weights_mb,
                batch=case.params["B"], kind=case.params["kind"],
                **({"autocast": case.params["autocast"]} if case.params.get("autocast")
                   else {}))
        if timer is not None and not benchmark.disabled:
            benchmark.extra_info["checks35_ms"] = timer.ms_per_step()
    finally:
        if timer is not None:
            timer.remove()
