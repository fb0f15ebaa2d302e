"""How far the sharded release's features are from one process's: a measurement of
rounding, not a timing (nothing here depends on the machine's load).

For the shapes of tests/test_distributed_release.py (and the n = T = 3000, d = 256
case docs/architecture.md quotes), the release on W = 2 and 3 gloo ranks on
127.0.0.1 against the one-process release with the same key and offset:

* ``ulp``: |x_W - x_1| in float32 ulps of the one-process entry (``np.spacing``),
  over all entries and over the entries with |x_1| in [0.5, 1);
* ``bound``: |x_W - x_1| over the documented bound, per entry
  2 gamma_{c+W} sum_i |f_i x_i| / m + 2 u |x_1| (c = |I_t|, u = 2^-24, gamma_k = k u /
  (1 - k u); docs/release.md "Across processes"; tests/test_distributed_release.py
  ``_within_rounding``);
* the share of entries bitwise equal, and whether y and the report are equal.

    .venv/bin/python bench/release_rounding.py [--out bench/results]

writes ``release_rounding-cpu-<date>.{json,md}`` naming the commit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SEED = 20261123
U = 2.0 ** -24

# (name, (n, d, K, onehot), mechanism keywords): the tests' shapes, and the docs'.
CASES = [
    ("tests W2 #1", (60, 5, 3, False), dict(epsilon=2.0, delta=1e-5, mixup_degree=6,
                                            num_samples=41, accountant="pld")),
    ("tests W2 #2", (60, 5, 3, False), dict(epsilon=2.0, delta=1e-5, mixup_degree=6,
                                            num_samples=41, hierarchical_classes=2)),
    ("tests W3 #1", (61, 6, 4, False), dict(epsilon=2.0, delta=1e-5, mixup_degree=7,
                                            num_samples=50, hierarchical_classes=3)),
    ("tests W3 #3", (50, 3, 2, False), dict(epsilon=1.0, delta=1e-5, mixup_degree=4,
                                            num_samples=5, clip_y=0.5)),
    ("tests command", (80, 6, 3, False), dict(epsilon=2.0, delta=1e-5, mixup_degree=5,
                                              hierarchical_classes=2)),
    ("docs n=T=3000 d=256", (3000, 256, 10, False), dict(epsilon=2.0, delta=1e-5,
                                                         mixup_degree=64)),
]


def _data(n, d, K, onehot):
    rng = np.random.default_rng(7)
    X = np.eye(n, dtype=np.float32) if onehot else \
        (rng.standard_normal((n, d)) * rng.uniform(0.2, 2.0, (n, 1))).astype(np.float32)
    return X, rng.integers(0, K, n).astype(np.int64)


def _mech(kw):
    from ncdp_fast.release import NeuroMixGDP
    mech = NeuroMixGDP(seed=SEED, offset=0, **{"accountant": "clt", **kw})
    mech.value_discretization_interval = 1e-2
    return mech


def _ranks(rank, world, cases):
    """Child: each case's release on balanced shards, gathered on rank 0."""
    import torch.distributed as dist

    from ncdp_fast import _stream
    from ncdp_fast.distributed import shard_bounds
    out = []
    for _, data, kw in cases:
        _stream._LEDGER.clear()         # each case a new run on the same key, as one process
        X, y = _data(*data)
        lo, hi = shard_bounds(X.shape[0], rank, world)
        g = _mech(kw).release(X[lo:hi], y, num_classes=data[2], group=dist.group.WORLD).gather()
        out.append(None if g is None else (g.x, g.y, g.report))
    return out


def measure():
    from _distributed import spawn

    from ncdp_fast import _stream
    rows = []
    got = {W: spawn(_ranks, W, CASES, timeout=600)[0] for W in (2, 3)}
    for i, (name, data, kw) in enumerate(CASES):
        _stream._LEDGER.clear()
        X, y = _data(*data)
        one, groups = _mech(kw)._release(X, y, num_classes=data[2], return_groups=True)
        m = one.mixup_degree
        abs_terms = np.stack([np.abs(X[g].astype(np.float64)).sum(axis=0) for g in groups])
        sizes = np.array([len(g) for g in groups])
        for W in (2, 3):
            x, yy, report = got[W][i]
            k = (sizes + W)[:, None] * U
            bound = 2 * k / (1 - k) * abs_terms / m + 2 * U * np.abs(one.x.astype(np.float64))
            err = np.abs(x.astype(np.float64) - one.x.astype(np.float64))
            ulps = err / np.spacing(np.abs(one.x)).astype(np.float64)
            mid = (np.abs(one.x) >= 0.5) & (np.abs(one.x) < 1)
            rows.append(dict(case=name, n=data[0], d=data[1], K=data[2], T=one.num_samples,
                             m=m, W=W, entries=int(x.size),
                             bitwise_equal=float(np.mean(x == one.x)),
                             max_abs_err=float(err.max()), max_ulp=float(ulps.max()),
                             max_ulp_in_half_one=float(ulps[mid].max()) if mid.any() else None,
                             max_err_over_bound=float((err / bound).max()),
                             y_equal=bool(np.array_equal(yy, one.y)),
                             report_equal=report == one.report))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    rows = measure()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(what="sharded release features vs one process (float32 rounding)",
                device="cpu (gloo ranks on 127.0.0.1)", commit=commit,
                date=date.strftime("%Y-%m-%dT%H:%M:%SZ"), seed=SEED)
    out = Path(args.out)
    stem = out / f"release_rounding-cpu-{date:%Y%m%d}"
    stem.with_suffix(".json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    head = ["case", "n", "d", "K", "T", "m", "W", "bitwise equal", "max |dx|", "max ulp",
            "max ulp, |x| in [0.5,1)", "max |dx| / bound", "y equal", "report equal"]
    lines = [f"# {meta['what']}", "", f"commit {commit}, {meta['date']}, {meta['device']}, "
             f"seed {SEED}; bound = 2 gamma_(c+W) sum|f x| / m + 2 u |x_1| per entry "
             "(bench/release_rounding.py).", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        mid = "-" if r["max_ulp_in_half_one"] is None else f"{r['max_ulp_in_half_one']:.2f}"
        lines.append(f"| {r['case']} | {r['n']} | {r['d']} | {r['K']} | {r['T']} | {r['m']:g} "
                     f"| {r['W']} | {100 * r['bitwise_equal']:.0f} % | {r['max_abs_err']:.2g} | "
                     f"{r['max_ulp']:.3g} | {mid} | {r['max_err_over_bound']:.3f} | "
                     f"{r['y_equal']} | {r['report_equal']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
