"""Reproductions of the papers' experiments (``ncdp-fast reproduce NAME``).

Each entry names a module and a ``main(argv) -> int`` that parses its own
options (at least ``--out`` and ``--quick``) and writes its tables (JSON +
Markdown, through :func:`ncdp_fast._report.write_report`) and PNG plots to
``bench/results/``. Real-data reproductions read features cached by
``make data`` (:mod:`ncdp_fast.datasets`) and never download anything.
"""
from __future__ import annotations

import importlib

REPRODUCTIONS = {
    "nc-synthetic": ("ncdp_fast.reproduce.nc", "synthetic_main",
                     "000: NoisyGD under perfect/perturbed Neural Collapse vs dimension (Fig. 3a)"),
    "nc-real": ("ncdp_fast.reproduce.nc", "real_main",
                "000: NC metrics, beta, NoisySGD vs dimension (Fig. 3b), PCA protocols (Fig. 4)"),
    "neuromix-mnist": ("ncdp_fast.reproduce.neuromix", "main",
                       "002: NeuroMixGDP(-HS) on MNIST ScatterNet features (Table 2, Fig. 3, MIA)"),
    "dp-finetune": ("ncdp_fast.reproduce.finetune", "main",
                    "000: full private fine-tuning of EfficientNet-Lite0 vs last-layer NoisySGD "
                    "on Fashion-MNIST (is the last layer enough?)"),
    "dp-lm": ("ncdp_fast.reproduce.dp_lm", "main",
              "issue 26: a GPT-2-shaped byte-level LM trained privately (random start) on the "
              "State of the Union addresses at epsilon 3, 8 and non-private; held-out perplexity"),
    "theory": ("ncdp_fast.reproduce.theory", "main",
               "004: NTK lambda_min vs width, RF/NTK robustness, privacy for free, DP-SGD ODE"),
}


def run(name: str, argv: list[str]) -> int:
    """Run reproduction ``name`` with its own command-line options ``argv``."""
    if name not in REPRODUCTIONS:
        raise ValueError(f"reproduction: expected one of {sorted(REPRODUCTIONS)}, got {name!r}")
    module, fn, _ = REPRODUCTIONS[name]
    return int(getattr(importlib.import_module(module), fn)(list(argv)) or 0)
