"""Benchmark: noise calibration for the Poisson-subsampled Gaussian (issue #5;
report ``privacy``, CPU only).

Times ``ncdp_fast.privacy.calibrate_noise_multiplier`` with its "pld" (dp-accounting
engine), "rdp" and "gdp" accountants for a target (epsilon, delta) over T steps at
sampling rate q, and the peer a user would otherwise call -- Opacus's
``get_noise_multiplier`` with its "rdp" and "prv" accountants (prv in the first
round only) -- on the same target.  Outside the timing, the epsilon every returned
sigma really has is measured with the default PLD grid and a finer one
(``value_discretization_interval`` 1e-5); ours ("pld") also records, in its first
round, its first call in this process, its accountant evaluations, its peak traced
memory and the fine-grid calibration it approximates.
"""
from __future__ import annotations

import logging
import time
import tracemalloc
import warnings

import pytest

from _common import cases, measure

TARGET = {"full": dict(epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=100_000),
          "smallest": dict(epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=1000)}
TARGET["quick"] = TARGET["full"]
FINE_INTERVAL = {"full": 1e-5, "quick": 1e-5, "smallest": 1e-3}   # 10x finer than the default
REPEATS = {"full": 3, "quick": 1, "smallest": 1}
METHODS = ["ncdp_pld", "ncdp_rdp", "ncdp_gdp", "opacus_rdp", "opacus_prv"]


def CASES(size, device):
    t = TARGET[size]
    label = (f"epsilon={t['epsilon']}, delta={t['delta']}, q={t['sample_rate']}, "
             f"T={t['steps']}")
    return {"test_calibrate": cases("privacy", [(label, t)], METHODS, once=("opacus_prv",))
            if device == "cpu" else []}


def _calibrator(method, t):
    import ncdp_fast.privacy as P
    eps, delta, q, T = t["epsilon"], t["delta"], t["sample_rate"], t["steps"]
    tool, acc = method.split("_")
    if tool == "ncdp":
        return lambda: P.calibrate_noise_multiplier(eps, delta, q, T, acc)
    pytest.importorskip("opacus")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from opacus.accountants.utils import get_noise_multiplier

    def peer():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(get_noise_multiplier(target_epsilon=eps, target_delta=delta,
                                              sample_rate=q, steps=T, accountant=acc))
    return peer


def _ours_once(t, fine):
    """What the first round of ours records besides its time (see the docstring)."""
    import ncdp_fast.privacy as P
    import ncdp_fast.privacy.subsampled as S
    eps, delta, q, T = t["epsilon"], t["delta"], t["sample_rate"], t["steps"]
    t0 = time.perf_counter()
    P.calibrate_noise_multiplier(eps, delta, q, T, "pld")
    out = dict(first_call_s=time.perf_counter() - t0)
    calls = {"n": 0}
    orig = S._epsilon

    def counting(*a):
        calls["n"] += 1
        return orig(*a)
    S._epsilon = counting
    try:
        P.calibrate_noise_multiplier(eps, delta, q, T, "pld")
    finally:
        S._epsilon = orig
    tracemalloc.start()
    P.calibrate_noise_multiplier(eps, delta, q, T, "pld")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    t0 = time.perf_counter()
    sigma_fine = P.calibrate_noise_multiplier(eps, delta, q, T, "pld",
                                              value_discretization_interval=fine,
                                              epsilon_rtol=1e-4)
    return dict(out, accountant_evaluations=calls["n"], peak_traced_mib=peak / 2**20,
                sigma_fine_grid_calibration=sigma_fine,
                fine_grid_calibration_s=time.perf_counter() - t0,
                epsilon_rtol=P.DEFAULT_EPSILON_RTOL)


def test_calibrate(benchmark, case, bench_size):
    import ncdp_fast.privacy as P
    logging.getLogger("absl").setLevel(logging.ERROR)
    t, fine = case.params, FINE_INTERVAL[bench_size]
    tool, acc = case.method.split("_")
    if case.method == "ncdp_pld" and case.round == 1:
        benchmark.extra_info.update(_ours_once(t, fine))
    fn = _calibrator(case.method, t)
    sigma = float(measure(benchmark, case, fn, device="cpu",
                          repeats=REPEATS[bench_size] if case.method != "opacus_prv"
                          else min(REPEATS[bench_size], 2), warmup=0, memory=False))

    def pld_eps(interval):
        return P.epsilon_poisson_gaussian(sigma, t["sample_rate"], t["steps"], t["delta"], "pld",
                                          value_discretization_interval=interval)
    benchmark.extra_info.update(
        sigma=sigma, accountant=acc,
        epsilon_own_accountant=(P.epsilon_poisson_gaussian(sigma, t["sample_rate"], t["steps"],
                                                           t["delta"], acc)
                                if tool == "ncdp" else None),
        epsilon_pld_default_grid=pld_eps(P.DEFAULT_VALUE_DISCRETIZATION_INTERVAL),
        epsilon_pld_fine_grid=pld_eps(fine), fine_interval=fine,
        default_interval=P.DEFAULT_VALUE_DISCRETIZATION_INTERVAL)
