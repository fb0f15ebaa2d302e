#!/usr/bin/env python
"""Benchmark: noise calibration for the Poisson-subsampled Gaussian (issue #5).

Times ``ncdp_fast.privacy.calibrate_noise_multiplier`` (PLD, dp-accounting engine)
for a target (epsilon, delta) over T steps at sampling rate q, checks the epsilon of
the returned sigma against a fine-grid PLD (smaller ``value_discretization_interval``),
and runs the peer a user would otherwise call -- Opacus's ``get_noise_multiplier``
with its "rdp" and "prv" accountants -- on the same target, in the same process.
The epsilon each peer's sigma really has is measured with the same fine-grid PLD.

Usage::

    python bench/bench_privacy.py [--out bench/results] [--repeats 3]
        [--steps 100000] [--sample-rate 0.01] [--epsilon 1.0] [--delta 1e-5] [--no-opacus]

Writes ``privacy-cpu-<YYYYMMDD>.json`` and ``.md`` into ``--out`` (the naming of the
other benchmarks), recording the device (CPU model), the commit (``git rev-parse
--short HEAD``, "-dirty" if ncdp_fast/ or bench/ differ from it, or "uncommitted")
and the date.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import statistics
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

from _common import ROOT, cpu_name, git_commit

FINE_INTERVAL = 1e-5  # reference grid: 10x finer than the default


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:  # noqa: BLE001 - reporting only
        return "n/a"


def _timed(fn, repeats: int):
    """Run fn `repeats` times; return (result of last run, list of wall times in s)."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return result, times


def run(args) -> dict:
    import ncdp_fast.privacy as P
    import ncdp_fast.privacy.subsampled as S

    logging.getLogger("absl").setLevel(logging.ERROR)
    eps_t, delta, q, T = args.epsilon, args.delta, args.sample_rate, args.steps
    default_iv = P.DEFAULT_VALUE_DISCRETIZATION_INTERVAL

    def pld_eps(sigma, interval):
        return P.epsilon_poisson_gaussian(
            sigma, q, T, delta, "pld", value_discretization_interval=interval
        )

    rows = []

    # Cold call: includes importing dp-accounting (what a script pays once).
    t0 = time.perf_counter()
    P.calibrate_noise_multiplier(eps_t, delta, q, T, "pld")
    cold_s = time.perf_counter() - t0

    # Count accountant evaluations in one calibration.
    calls = {"n": 0}
    orig = S._epsilon

    def counting(*a):
        calls["n"] += 1
        return orig(*a)

    S._epsilon = counting
    try:
        P.calibrate_noise_multiplier(eps_t, delta, q, T, "pld")
    finally:
        S._epsilon = orig
    n_evals = calls["n"]

    # Peak Python-heap memory of one calibration (numpy arrays included).
    tracemalloc.start()
    P.calibrate_noise_multiplier(eps_t, delta, q, T, "pld")
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    for acc in ("pld", "rdp", "gdp"):
        sigma, times = _timed(
            lambda acc=acc: P.calibrate_noise_multiplier(eps_t, delta, q, T, acc), args.repeats
        )
        eps_own = P.epsilon_poisson_gaussian(sigma, q, T, delta, acc)
        rows.append(
            {
                "tool": f"ncdp_fast calibrate_noise_multiplier({acc!r})",
                "accountant": acc,
                "sigma": sigma,
                "time_s_median": statistics.median(times),
                "time_s_all": times,
                "epsilon_own_accountant": eps_own,
            }
        )

    have_opacus = False
    if not args.no_opacus:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from opacus.accountants.utils import get_noise_multiplier
            have_opacus = True
        except ImportError:
            print("opacus not installed: peer rows skipped", file=sys.stderr)
    if have_opacus:
        for acc in ("rdp", "prv"):
            reps = args.repeats if acc == "rdp" else max(1, min(args.repeats, 2))

            def peer(acc=acc):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return get_noise_multiplier(
                        target_epsilon=eps_t,
                        target_delta=delta,
                        sample_rate=q,
                        steps=T,
                        accountant=acc,
                    )

            sigma, times = _timed(peer, reps)
            rows.append(
                {
                    "tool": f"opacus get_noise_multiplier(accountant={acc!r})",
                    "accountant": acc,
                    "sigma": float(sigma),
                    "time_s_median": statistics.median(times),
                    "time_s_all": times,
                    "epsilon_own_accountant": None,
                }
            )

    # Accuracy: the epsilon every sigma really has, by the default and a fine PLD grid.
    for r in rows:
        r["epsilon_pld_default_grid"] = pld_eps(r["sigma"], default_iv)
        r["epsilon_pld_fine_grid"] = pld_eps(r["sigma"], FINE_INTERVAL)
        r["sigma_over_ours_pld"] = r["sigma"] / rows[0]["sigma"]
        r["time_over_ours_pld"] = r["time_s_median"] / rows[0]["time_s_median"]

    ours = rows[0]
    # Smallest sigma by the fine grid itself (the reference answer), for context.
    t0 = time.perf_counter()
    sigma_fine = P.calibrate_noise_multiplier(
        eps_t, delta, q, T, "pld", value_discretization_interval=FINE_INTERVAL, epsilon_rtol=1e-4
    )
    fine_cal_s = time.perf_counter() - t0

    return {
        "benchmark": "privacy.calibrate_noise_multiplier",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": {
            "cpu": cpu_name(),
            "logical_cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "numpy": _version("numpy"),
            "scipy": _version("scipy"),
            "dp-accounting": _version("dp-accounting"),
            "opacus": _version("opacus") if have_opacus else "not run",
        },
        "target": {"epsilon": eps_t, "delta": delta, "sample_rate": q, "steps": T},
        "neighbouring_relation": "add/remove one (Poisson subsampling)",
        "ours": {
            "value_discretization_interval": default_iv,
            "fine_value_discretization_interval": FINE_INTERVAL,
            "epsilon_rtol": P.DEFAULT_EPSILON_RTOL,
            "cold_call_s_including_import": cold_s,
            "accountant_evaluations": n_evals,
            "peak_traced_memory_MiB": peak_bytes / 2**20,
            "epsilon_default_grid": ours["epsilon_pld_default_grid"],
            "epsilon_fine_grid": ours["epsilon_pld_fine_grid"],
            "relative_gap_default_vs_fine": ours["epsilon_pld_default_grid"]
            / ours["epsilon_pld_fine_grid"]
            - 1.0,
            "target_met_default_grid": ours["epsilon_pld_default_grid"] <= eps_t,
            "target_met_fine_grid": ours["epsilon_pld_fine_grid"] <= eps_t,
            "time_target_s": 2.0,
            "time_target_met": ours["time_s_median"] < 2.0,
            "sigma_fine_grid_calibration": sigma_fine,
            "sigma_excess_vs_fine_grid_calibration": ours["sigma"] / sigma_fine - 1.0,
            "fine_grid_calibration_s": fine_cal_s,
        },
        "rows": rows,
    }


def to_markdown(res: dict) -> str:
    t, o = res["target"], res["ours"]
    lines = [
        "# Privacy calibration benchmark",
        "",
        f"- date: {res['date']}",
        f"- commit: {res['commit']}",
        f"- device: {res['device']['cpu']} ({res['device']['logical_cpus']} logical CPUs)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()),
        f"- target: epsilon = {t['epsilon']}, delta = {t['delta']}, q = {t['sample_rate']}, "
        f"T = {t['steps']}; {res['neighbouring_relation']}",
        f"- ours: PLD grid {o['value_discretization_interval']:g}, epsilon_rtol "
        f"{o['epsilon_rtol']:g}, {o['accountant_evaluations']} accountant evaluations, "
        f"peak traced memory {o['peak_traced_memory_MiB']:.1f} MiB, cold call incl. import "
        f"{o['cold_call_s_including_import']:.2f} s",
        f"- accuracy: epsilon(sigma_ours) = {o['epsilon_default_grid']:.6f} (default grid), "
        f"{o['epsilon_fine_grid']:.6f} (grid {o['fine_value_discretization_interval']:g}); "
        f"relative gap {o['relative_gap_default_vs_fine']:+.2e}; sigma exceeds the fine-grid "
        f"calibration ({o['sigma_fine_grid_calibration']:.5f}, "
        f"{o['fine_grid_calibration_s']:.2f} s) by {o['sigma_excess_vs_fine_grid_calibration']:+.2e}",
        f"- time target (< {o['time_target_s']:g} s): "
        f"{'met' if o['time_target_met'] else 'NOT met'}",
        "",
        "| tool | sigma | sigma / ours(PLD) | time (median, s) | time / ours(PLD) "
        "| eps, own accountant | eps, PLD 1e-4 | eps, PLD 1e-5 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        own = r["epsilon_own_accountant"]
        lines.append(
            f"| {r['tool']} | {r['sigma']:.5f} | {r['sigma_over_ours_pld']:.4f} | "
            f"{r['time_s_median']:.3f} | {r['time_over_ours_pld']:.2f} | "
            f"{'' if own is None else f'{own:.5f}'} | {r['epsilon_pld_default_grid']:.5f} | "
            f"{r['epsilon_pld_fine_grid']:.5f} |"
        )
    lines += [
        "",
        "The 'gdp' rows are the central-limit approximation: not an upper bound; "
        "their PLD epsilon shows by how much they miss the target.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output directory")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--sample-rate", type=float, default=0.01)
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--no-opacus", action="store_true", help="skip the Opacus peer rows")
    ap.add_argument("--quick", action="store_true", help="one repeat (for smoke runs)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.quick:
        args.repeats = 1

    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Same naming as the other benchmarks (bench/_common.py): <name>-<device>-<date>.
    base = out / f"privacy-cpu-{res['date'][:10].replace('-', '')}"
    base.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    md = to_markdown(res)
    base.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {base.with_suffix('.json')} and {base.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
