"""``ncdp-fast audit``: one-run audits of the package's own DP-SGD path and of
the NeuroMixGDP release, at a stated size, as a table (``--json``: the rows as
JSON; ``--out DIR``: ``audit-cpu-<date>.{json,md}`` there, with device, commit
and date)."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from .._validate import check_delta, check_pos_int, check_positive, check_uint64, cli_type

# (name, audit, keyword arguments): each row of the table.
CONFIGS = [
    ("dpsgd dirac, q=1, each step", "dpsgd", dict(canary="dirac", batches=1, epochs=5)),
    ("dpsgd dirac, q=1/4, each step", "dpsgd", dict(canary="dirac", batches=4, epochs=2,
                                                    real_samples=1024)),
    ("dpsgd dirac, q=1/4, final model", "dpsgd", dict(canary="dirac", batches=4, epochs=2,
                                                      real_samples=1024, observe="final")),
    ("dpsgd input-space, q=1, each step", "dpsgd", dict(canary="input", batches=1, epochs=5)),
    ("release dirac, rows", "release", dict(observe="rows")),
]


def add_audit_parser(sub) -> None:
    p = sub.add_parser("audit", help="one-run empirical epsilon lower bounds of the package's "
                       "DP-SGD path and NeuroMixGDP release (ncdp_fast.audit)",
                       description=__doc__)
    p.add_argument("--canaries", type=cli_type(int, check_pos_int), default=1000,
                   help="m canaries per run (1000)")
    p.add_argument("--epsilon", type=cli_type(float, check_positive), default=4.0,
                   help="claimed epsilon (4)")
    p.add_argument("--delta", type=cli_type(float, check_delta), default=1e-5,
                   help="delta (1e-5)")
    p.add_argument("--seeds", type=cli_type(int, check_pos_int), default=3,
                   help="runs per configuration (3)")
    p.add_argument("--seed", type=cli_type(int, check_uint64), default=None,
                   help="first seed (run i uses seed + i); default: each run from the OS")
    p.add_argument("--only", choices=["dpsgd", "release"], default=None,
                   help="one audit only (default: both)")
    p.add_argument("--confidence", type=cli_type(float, check_delta), default=0.95)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--out", default=None, help="write audit-cpu-<date>.{json,md} into this "
                   "directory (e.g. bench/results)")
    p.set_defaults(fn=run)


def _span(values) -> str:
    v = np.asarray(values, dtype=float)
    return f"{np.median(v):.2f} [{v.min():.2f}, {v.max():.2f}]"


def run(args) -> int:
    from pathlib import Path

    from . import audit_dpsgd, audit_release
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        # Checked before the runs (minutes), not at the write after them.
        print(f"ncdp-fast audit: error: --out: expected a directory, got the file "
              f"{args.out!r}", file=sys.stderr)
        return 2
    rows = []
    for name, kind, kw in CONFIGS:
        if args.only and kind != args.only:
            continue
        fn = audit_dpsgd if kind == "dpsgd" else audit_release
        runs = []
        for i in range(args.seeds):
            seed = None if args.seed is None else args.seed + i
            start = time.perf_counter()
            res = fn(canaries=args.canaries, epsilon=args.epsilon, delta=args.delta,
                     confidence=args.confidence, seed=seed, **kw)
            runs.append((res, time.perf_counter() - start))
        lb = [r.epsilon_lower_bound for r, _ in runs]
        gdp = [r.epsilon_lower_bound_gdp for r, _ in runs]
        claimed = [r.epsilon_claimed for r, _ in runs]
        rows.append(dict(
            config=name, canaries=args.canaries, seeds=args.seeds,
            epsilon_claimed=float(np.max(claimed)), lower_bound=_span(lb),
            lower_bound_gdp=_span(gdp), lower_bound_runs=lb, lower_bound_gdp_runs=gdp,
            mu_lower_bound_runs=[r.mu_lower_bound for r, _ in runs],
            # The largest bound each analysis could reach: below the claim, it
            # cannot detect a violation of it, whatever the run.
            reachable=f"{min(r.epsilon_reachable for r, _ in runs):.2f} / "
                      f"{min(r.epsilon_reachable_gdp for r, _ in runs):.2f}",
            correct_of_guesses=[f"{r.correct}/{r.guesses}" for r, _ in runs],
            steps=runs[0][0].details["steps"], sample_rate=runs[0][0].details["sample_rate"],
            noise_multiplier=runs[0][0].details["noise_multiplier"],
            wall_s=float(np.mean([t for _, t in runs]))))
    if args.json:
        print(json.dumps(rows, indent=2))
    cols = [("config", "configuration", None), ("canaries", "m", None),
            ("seeds", "seeds", None), ("epsilon_claimed", "eps claimed", "{:.3f}"),
            ("lower_bound", "eps lower bound (eps,delta) median [min, max]", None),
            ("lower_bound_gdp", "eps lower bound mu-GDP median [min, max]", None),
            ("reachable", "largest reachable (eps,delta) / mu-GDP", None),
            ("steps", "steps", None), ("sample_rate", "q", "{:.4g}"),
            ("wall_s", "wall s / run", "{:.1f}")]
    notes = [f"claimed eps {args.epsilon} at delta {args.delta}; each bound at confidence "
             f"{args.confidence}, with the k planned before each run (plan_k)",
             "(eps,delta): Steinke, Nasr & Jagielski 2023; mu-GDP: Mahloujifar, Melis & "
             "Chaudhuri (its eps assumes a Gaussian trade-off curve: exact at q = 1)",
             "largest reachable: each analysis's bound with all its guesses right; an "
             "analysis whose reachable bound is below the claim cannot detect a violation",
             "seeds: " + ("from the OS" if args.seed is None else f"{args.seed} + i"),
             "machine shared with other jobs while measured: wall times are noisy"]
    if args.out:
        import torch
        from .._report import machine, write_report
        meta = dict(device="cpu: " + machine(torch)["cpu"], machine=machine(torch),
                    command=" ".join(sys.argv))
        write_report("audit", args.out, meta, rows, cols, notes, quiet=args.json)
    elif not args.json:
        header = " | ".join(h for _, h, _ in cols)
        print(header)
        for r in rows:
            print(" | ".join("" if r.get(k) is None else (f.format(r[k]) if f else str(r[k]))
                             for k, _, f in cols))
    return 0
