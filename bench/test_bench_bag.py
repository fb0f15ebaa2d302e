"""Benchmark of a bag-of-tokens text classifier's private step (report
``bench_bag``): ``nn.EmbeddingBag``'s rule (ncdp_fast/torch/embedding_bag.py)
against the non-private step and Opacus.

Workload (``--bench-size full``; float32): the text-classification tutorial's
model, ``nn.EmbeddingBag(V, D, mode="mean")`` -> ``nn.Linear(D, 4)``, V =
95 811 (AG_NEWS's vocabulary), D = 64, B = 64 bags of 20-60 tokens (flat
tokens with offsets; synthetic, seeded), cross-entropy (mean), plain SGD.

Methods, interleaved in one process (bench/README.md):

* ``nonprivate``: zero_grad, forward, loss, backward, SGD step.
* ``ncdp``: :class:`ncdp_fast.torch.GhostClipper` (the flat tokens are the
  model's first input, so the step's batch is the number of bags), then SGD.
* ``opacus_hooks``: Opacus ``PrivacyEngine.make_private(grad_sample_mode=
  "hooks")``, its EmbeddingBag grad sampler (a dense (B, V, D) per-sample
  gradient, a Python loop over the bags).  It is the speed a user of Opacus
  gets, not the same result: Opacus 1.6.0 writes a row once where a bag
  repeats it (docs/torch.md, the layer table's EmbeddingBag row).

Noise multiplier 1, max_grad_norm 1, flat clipping, expected batch size B.
``ops``: the aten operators one step dispatches (a TorchDispatchMode count,
after the timing): on a GPU about one kernel launch each, the prediction's
input.  Peak memory as bench_tied.
"""
from __future__ import annotations

import warnings

from _common import cases, measure, record_step_memory

SHAPES = {"full": dict(V=95811, D=64, B=64, lo=20, hi=60),
          "quick": dict(V=20000, D=64, B=32, lo=20, hi=60),
          "smallest": dict(V=50, D=8, B=3, lo=1, hi=4)}
METHODS = ["nonprivate", "ncdp", "opacus_hooks"]
ONCE = ("opacus_hooks",)
C, SIGMA, LR, CLASSES = 1.0, 1.0, 0.1, 4


def CASES(size, device):
    s = SHAPES[size]
    label = (f"bag classifier (V, D, B, tokens) = ({s['V']}, {s['D']}, {s['B']}, "
             f"{s['lo']}-{s['hi']})")
    return {"test_bag_step": cases("bench_bag", [(label, s)], METHODS, once=ONCE)}


def _model(p, torch, nn):
    class TextClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.EmbeddingBag(p["V"], p["D"], mode="mean")
            self.fc = nn.Linear(p["D"], CLASSES)

        def forward(self, text, offsets):
            return self.fc(self.embedding(text, offsets))
    torch.manual_seed(0)
    return TextClassifier()


def _batch(p, torch, device):
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(p["lo"], p["hi"] + 1, (p["B"],), generator=g)
    text = torch.randint(0, p["V"], (int(sizes.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])
    y = torch.randint(0, CLASSES, (p["B"],), generator=g)
    return text.to(device), offsets.to(device), y.to(device)


def build_step(p, method, device="cpu"):
    """(step, release): one training step of ``method``; ``release`` frees the
    gradients a step leaves."""
    import torch
    from torch import nn
    model = _model(p, torch, nn).to(device)
    text, offsets, y = _batch(p, torch, device)
    B = p["B"]
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if method == "ncdp":
        from ncdp_fast.torch import GhostClipper
        clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=SIGMA,
                               expected_batch_size=float(B), seed=None)
    elif method == "opacus_hooks":
        from opacus import PrivacyEngine
        # Opacus needs a loader only for its sample rate: one batch of B.
        data = torch.utils.data.TensorDataset(torch.zeros(B, 1))
        model, opt, _ = PrivacyEngine(accountant="prv").make_private(
            module=model, optimizer=opt,
            data_loader=torch.utils.data.DataLoader(data, batch_size=B),
            noise_multiplier=SIGMA, max_grad_norm=C, poisson_sampling=False,
            grad_sample_mode="hooks")
    elif method != "nonprivate":
        raise ValueError(method)

    def step():
        opt.zero_grad(set_to_none=True)
        crit(model(text, offsets), y).backward()
        if method == "ncdp":
            clipper.privatize_()
        opt.step()

    def release():
        opt.zero_grad(set_to_none=True)
    return step, release


def count_ops(fn) -> int:
    """The aten operators one call of ``fn`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


def test_bag_step(benchmark, case, bench_device, bench_size):
    import pytest
    if case.method in ONCE:
        pytest.importorskip("opacus")
    warnings.filterwarnings("ignore")
    p = case.params
    step, release = build_step(p, case.method, bench_device)
    if not benchmark.disabled:
        record_step_memory(benchmark, step, release, bench_device)
    measure(benchmark, case, step, device=bench_device, repeats=3 if case.method in ONCE else 10,
            warmup=0, memory=False, first_call=False,
            **{k: p[k] for k in ("V", "D", "B", "lo", "hi")})
    if not benchmark.disabled:
        benchmark.extra_info["ops"] = count_ops(step)
    release()
