"""pytest-benchmark set-up of bench/ (bench/README.md).

Options: ``--bench-size smallest|quick|full`` (the shapes), ``--bench-device
cpu|cuda``, ``--bench-rounds N`` (interleaved rounds).

Interleaving: every test function of bench/ takes a ``case`` (bench/_common.py
``Case``: a method on a workload) from its module's ``CASES(size, device)``;
this file parametrizes it once per round and reorders the collected items so
that, per workload, round 1 runs every method, then round 2 every method, ...
(A B C A B C), all in this one process, as a user runs them one after the
other.  The speed of a shared machine drifts by tens of percent over minutes;
the report (bench/report.py) keeps per method the round with the median time,
which makes the ratios between methods robust to that drift."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Case, cuda_missing  # noqa: E402

SIZES = ("smallest", "quick", "full")


def pytest_addoption(parser):
    g = parser.getgroup("ncdp_fast benchmarks")
    g.addoption("--bench-size", choices=SIZES, default="full",
                help="full: the stated shapes; quick: smaller; smallest: tiny (the CI smoke run)")
    g.addoption("--bench-device", choices=("cpu", "cuda"), default="cpu",
                help="cuda without a usable GPU is an error, a skip only at --bench-size "
                "smallest")
    g.addoption("--bench-rounds", type=int, default=None,
                help="interleaved rounds of the compared methods (fewer: faster, noisier; "
                "default 3, 1 at --bench-size smallest)")


def pytest_configure(config):
    rounds = config.getoption("bench_rounds", None)
    if rounds is not None and rounds < 1:
        raise pytest.UsageError("--bench-rounds must be >= 1")
    if config.getoption("bench_device", "cpu") == "cuda":
        why = cuda_missing()
        if why and config.getoption("bench_size") != "smallest":
            raise pytest.UsageError(f"--bench-device cuda: {why}")
        config._bench_cuda_skip = why


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    cfg = metafunc.config
    size, device = cfg.getoption("bench_size"), cfg.getoption("bench_device")
    rounds = bench_rounds(cfg)
    found = metafunc.module.CASES(size, device)[metafunc.function.__name__]
    params = [replace(c, round=r) for c in found for r in range(1, rounds + 1)
              if r == 1 or not c.once]
    metafunc.parametrize("case", params, ids=[c.id for c in params])


def bench_rounds(config) -> int:
    rounds = config.getoption("bench_rounds")
    return rounds or (1 if config.getoption("bench_size") == "smallest" else 3)


def _case(item) -> Case | None:
    case = getattr(item, "callspec", None) and item.callspec.params.get("case")
    return case if isinstance(case, Case) else None


def pytest_collection_modifyitems(config, items):
    """Per workload: round 1 of every method, then round 2, ... (see the module
    docstring).  Files, test functions and workloads keep their order."""
    first = {}
    workloads = {}
    for i, item in enumerate(items):
        case = _case(item)
        if case is None:
            continue
        first.setdefault((item.path, item.originalname), i)
        workloads.setdefault((item.path, item.originalname, case.workload), i)

    def key(pair):
        i, item = pair
        case = _case(item)
        if case is None:                # an empty parameter set (pytest skips it)
            return (i, 0, 0, i)
        fn = (item.path, item.originalname)
        return (first[fn], workloads[fn + (case.workload,)], case.round, i)
    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
    why = getattr(config, "_bench_cuda_skip", None)
    if why:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=f"--bench-device cuda: {why}"))


@pytest.fixture(scope="session")
def bench_device(pytestconfig):
    return pytestconfig.getoption("bench_device")


@pytest.fixture(scope="session")
def bench_size(pytestconfig):
    return pytestconfig.getoption("bench_size")


def pytest_sessionstart(session):
    """The run's metadata for the report (device, commit, sizes), taken before
    the first benchmark: the commit is that of the code measured."""
    from report import run_meta
    config = session.config
    config._ncdp_meta = run_meta(config.getoption("bench_device"),
                                 config.getoption("bench_size"), bench_rounds(config))


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """The run's metadata and, in every benchmark's extra_info, its time relative
    to every method of its group."""
    from report import add_ratios
    output_json["ncdp"] = config._ncdp_meta
    add_ratios(output_json["benchmarks"])
