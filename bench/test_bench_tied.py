"""Benchmark of a tied language model's private step: the tied weight in ghost
form against its dense form (report ``bench_tied``; issue 26).

Workload (``--bench-size full``; float32): ``nn.Embedding(V, D)`` ->
``nn.Linear(D, D)`` + tanh -> ``nn.Linear(D, V)`` whose weight is the
embedding's, tokens (B, T), ``causal_lm_loss`` (mean), plain SGD:
V = 16000, D = 256, T = 32, B = 16.

Methods, interleaved in one process (bench/README.md):

* ``nonprivate``: zero_grad, forward, loss, backward, SGD step.
* ``ncdp_tied_ghost``: :class:`ncdp_fast.torch.GhostClipper`; its cost rule
  picks the ghost form of the tied weight at these shapes (ncdp_fast/torch/tied.py).
* ``ncdp_tied_dense``: the same with the dense form forced (each sample's
  (V, D) gradient formed per use and summed: the only form before issue 26).
* ``ncdp_untied``: the head with its own weight (an untied model of the same
  shapes), for reference.

Noise multiplier 1, max_grad_norm 1, flat clipping, expected batch size B.
Peak memory as bench_finetune: the sampled resident-set growth of one step from
a state without gradients (``malloc_trim`` first).
"""
from __future__ import annotations

import contextlib

from _common import cases, measure, record_step_memory

SHAPES = {"full": dict(V=16000, D=256, T=32, B=16),
          "quick": dict(V=4000, D=128, T=32, B=8),
          "smallest": dict(V=50, D=8, T=4, B=2)}
METHODS = ["nonprivate", "ncdp_tied_ghost", "ncdp_tied_dense", "ncdp_untied"]
C, SIGMA, LR = 1.0, 1.0, 0.01


def CASES(size, device):
    s = SHAPES[size]
    label = f"tied LM (V, D, T, B) = ({s['V']}, {s['D']}, {s['T']}, {s['B']})"
    return {"test_tied_step": cases("bench_tied", [(label, s)], METHODS)}


def _model(p, tied, torch, nn):
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(p["V"], p["D"])
            self.mid = nn.Linear(p["D"], p["D"])
            self.head = nn.Linear(p["D"], p["V"], bias=False)
            if tied:
                self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(torch.tanh(self.mid(self.emb(idx))))
    torch.manual_seed(0)
    return TiedLM()


@contextlib.contextmanager
def _dense_form():
    from ncdp_fast.torch import tied
    real = tied.ghost_cheaper
    tied.ghost_cheaper = lambda uses, shape: False
    try:
        yield
    finally:
        tied.ghost_cheaper = real


def build_step(p, method, device="cpu"):
    """(step, release): one training step of ``method``; ``release`` frees the
    gradients a step leaves."""
    import torch
    from torch import nn

    from ncdp_fast.torch import GhostClipper, causal_lm_loss
    model = _model(p, method != "ncdp_untied", torch, nn).to(device)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, p["V"], (p["B"], p["T"]), generator=g).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    clipper = None
    if method != "nonprivate":
        clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=SIGMA,
                               expected_batch_size=float(p["B"]), seed=None)
    form = _dense_form if method == "ncdp_tied_dense" else contextlib.nullcontext

    def step():
        opt.zero_grad(set_to_none=True)
        causal_lm_loss(model(idx), idx).backward()
        if clipper is not None:
            with form():
                clipper.privatize_()
        opt.step()

    def release():
        opt.zero_grad(set_to_none=True)
    return step, release


def test_tied_step(benchmark, case, bench_device, bench_size):
    step, release = build_step(case.params, case.method, bench_device)
    if not benchmark.disabled:
        record_step_memory(benchmark, step, release, bench_device)
    measure(benchmark, case, step, device=bench_device, repeats=3, warmup=0, memory=False,
            first_call=False, **{k: case.params[k] for k in ("V", "D", "T", "B")})
