"""The sharded NeuroMixGDP release on 2 and 3 gloo ranks (127.0.0.1) against one process.

What is compared, and why it may differ:

* memberships: exactly.  Shown with one-hot features (d = n, row i = e_i): every
  sum is then a float sum of zeros and ones, exact in any order, so the sharded x
  must equal the one-process x bit for bit, and a single different membership
  would move an entry by 1/m.
* labels y: bit for bit (label counts are exact integers; the owner finishes its
  rows with the one-process expression on the same noise draws).
* features x: to float rounding.  One process sums the c = |I_t| clipped rows of a
  group sequentially in float32; a rank sums its members in the same order and the
  reduce adds W partials, i.e. the same c terms re-associated, c + W - 1 additions.
  Each result is within gamma_{c+W} * sum|f_i x_i| of the exact sum (Higham,
  eq. 3.4; gamma below, as conftest's), so they differ by at most twice that, divided by m,
  plus one float32 rounding of each output.
* the privacy report: equal (it is computed once, on rank 0, for the total n).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

from _distributed import spawn, spawn_outcomes  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from ncdp_fast import _stream  # noqa: E402
from ncdp_fast.release import NeuroMixGDP  # noqa: E402

SEED = 20261123


# conftest.py's rounding helpers, repeated: the ranks import this module by name, and
# "conftest" there may resolve to bench/conftest.py (tests/test_bench_suite.py puts
# bench/ first on sys.path).
def unit_roundoff(dtype) -> float:
    return float(np.finfo(dtype).eps) / 2


def gamma(n: int, dtype) -> float:
    nu = n * unit_roundoff(dtype)
    assert nu < 0.5, "bound meaningless at this size"
    return nu / (1 - nu)


def _data(n, d, K, onehot=False):
    rng = np.random.default_rng(7)
    X = np.eye(n, dtype=np.float32) if onehot else \
        (rng.standard_normal((n, d)) * rng.uniform(0.2, 2.0, (n, 1))).astype(np.float32)
    return X, rng.integers(0, K, n).astype(np.int64)


def _mech(kw):
    """The mechanism of a case; a coarse PLD grid (1e-2 nats instead of 1e-4) keeps the
    accounting at ~40 ms instead of seconds per release (the comparison is the same)."""
    mech = NeuroMixGDP(seed=SEED, offset=0, **{"accountant": "clt", **kw})
    mech.value_discretization_interval = 1e-2
    return mech


def _one(case):
    """The one-process release and its memberships (a fresh ledger: a new run)."""
    _stream._LEDGER.clear()
    X, y = _data(*case["data"])
    rel, groups = _mech(case["kw"])._release(X, y, num_classes=case["data"][2],
                                             return_groups=True)
    return X, rel, groups


def _ranks(rank, world, cases):
    """Child: every case's sharded release, gathered on rank 0."""
    import torch.distributed as dist
    out = []
    for case in cases:
        X, y = _data(*case["data"])
        cuts = [0, *case["cuts"], X.shape[0]]
        mech = _mech(case["kw"])
        res = mech.release(X[cuts[rank]:cuts[rank + 1]], y, num_classes=case["data"][2],
                           group=dist.group.WORLD)
        g = res.gather()
        out.append(None if g is None else (g.x, g.y, g.report, res.row_start, res.row_stop))
    return out


def _compare(case, got):
    X, one, groups = _one(case)
    x, y, report, *_ = got
    assert report == one.report
    np.testing.assert_array_equal(y, one.y)
    if case["data"][3:] == (True,):
        np.testing.assert_array_equal(x, one.x)          # memberships exactly
        return
    _within_rounding(x, X, one, groups, len(case["cuts"]) + 1)


def _within_rounding(x, X, one, groups, W):
    """|x - one.x| within the bound of the module docstring, per entry."""
    m = one.mixup_degree
    abs_terms = np.stack([np.abs(X[g]).sum(axis=0) for g in groups])   # f_i <= 1
    sizes = np.array([len(g) for g in groups])
    u = unit_roundoff(np.float32)
    g_c = np.array([gamma(int(c) + W, np.float32) for c in sizes])[:, None]
    bound = 2 * g_c * abs_terms / m + 2 * u * np.abs(one.x)
    err = np.abs(x.astype(np.float64) - one.x)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound):.3g}"


CASES_2 = [
    dict(data=(60, 5, 3), cuts=[23], kw=dict(epsilon=2.0, delta=1e-5, mixup_degree=6,
                                             num_samples=41, accountant="pld")),
    dict(data=(60, 5, 3), cuts=[60], kw=dict(epsilon=2.0, delta=1e-5, mixup_degree=6,
                                             num_samples=41, hierarchical_classes=2)),
    dict(data=(40, 40, 4, True), cuts=[0], kw=dict(epsilon=3.0, delta=1e-5, mixup_degree=5,
                                                   num_samples=37, clip_x=2.0)),
]
CASES_3 = [
    dict(data=(61, 6, 4), cuts=[10, 10], kw=dict(epsilon=2.0, delta=1e-5, mixup_degree=7,
                                                 num_samples=50, hierarchical_classes=3)),
    dict(data=(40, 40, 4, True), cuts=[13, 27], kw=dict(epsilon=3.0, delta=1e-5,
                                                        mixup_degree=5, num_samples=44,
                                                        clip_x=2.0,
                                                        hierarchical_classes=2)),
    dict(data=(50, 3, 2), cuts=[1, 49], kw=dict(epsilon=1.0, delta=1e-5, mixup_degree=4,
                                                num_samples=5, clip_y=0.5)),
]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (3, CASES_3)], ids=["W2", "W3"])
def test_sharded_release_equals_one_process(world, cases):
    got = spawn(_ranks, world, cases, timeout=90)
    assert all(r is None for rank in got[1:] for r in rank)
    for case, res in zip(cases, got[0]):
        _compare(case, res)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(cuts=st.lists(st.integers(0, 30), min_size=2, max_size=2).map(sorted),
       hs=st.booleans())
def test_any_shard_boundaries(cuts, hs):
    case = dict(data=(30, 4, 3), cuts=cuts,
                kw=dict(epsilon=2.0, delta=1e-5, mixup_degree=4, num_samples=17,
                        hierarchical_classes=2 if hs else None))
    got = spawn(_ranks, 3, [case], timeout=60)
    _compare(case, got[0][0])


def _mismatch(rank, world, what):
    import torch.distributed as dist
    X, y = _data(30, 4, 3)
    kw = dict(epsilon=2.0, delta=1e-5, mixup_degree=4, num_samples=10)
    seed = SEED
    if what == "epsilon" and rank == 1:
        kw["epsilon"] = 3.0
    if what == "seed" and rank == 2:
        seed += 1
    if what == "n" and rank == 0:
        y = y[:-1]
    if what == "nan" and rank == 1:
        X = X.copy()
        X[12, 0] = np.nan
    try:
        mech = NeuroMixGDP(seed=seed, accountant="clt", **kw)
        mech.value_discretization_interval = 1e-2
        mech.release(X[rank * 10:(rank + 1) * 10], y, num_classes=3,
                                             group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def _dies(rank, world):
    X, y = _data(30, 4, 3)

    def progress(done, total):
        if rank == 1:
            os._exit(5)             # a rank lost in the middle of the reduce-scatter rounds
    from ncdp_fast.distributed import release_sharded
    release_sharded(_mech(dict(epsilon=2.0, delta=1e-5, mixup_degree=4, num_samples=30)),
                    X[rank * 15:(rank + 1) * 15], y,
                    num_classes=3, chunk_bytes=1, progress=progress)


def test_mismatched_configuration_is_an_error_on_every_rank():
    seen = []
    for what, key in [("epsilon", "epsilon (rank 0: 2.0, rank 1: 3.0, rank 2: 2.0)"),
                      ("seed", "seed ("), ("n", "n (rank 0: 29, rank 1: 30, rank 2: 30)")]:
        msgs = spawn(_mismatch, 3, what, timeout=60)
        for m in msgs:
            assert m.startswith("NeuroMixGDP.release: expected the same configuration") \
                and key in m, m
        seen += msgs
    assert str(SEED) not in "".join(seen)          # the secret seed is never shown
    # a bad shard on one rank: every rank says which, none waits for it
    for m in spawn(_mismatch, 3, "nan", timeout=60):
        assert m.startswith("NeuroMixGDP.release: 1 of 3 ranks failed before starting: rank "
                            "1: ValueError: features: expected finite values"), m


def test_a_rank_that_dies_is_an_error_not_a_hang():
    t0 = time.monotonic()
    outs = spawn_outcomes(_dies, 2, timeout=60, pg_timeout=15)
    assert time.monotonic() - t0 < 60
    assert outs[1].status == "died" and outs[1].exitcode == 5
    assert outs[0].status == "error" and "Error" in outs[0].error


# ---------------------------------------------------------------------- the command

def _argv(tmp: Path, world: int, extra=()):
    return ["release", "--features", str(tmp / "X.npy"), "--labels", str(tmp / "y.npy"),
            "--num-classes", "3", "--epsilon", "2", "--delta", "1e-5", "--mixup-degree", "5",
            "--seed", "11", "--out", str(tmp / f"out{world}"), "--timeout", "30",
            "--accountant", "clt", "--pld-interval", "1e-2", "--hierarchical-classes", "2",
            *extra]


def _cli_child(rank, world, argv):
    """Child with torchrun's environment: the command's own main()."""
    import contextlib
    import io
    from ncdp_fast.cli import main
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _cli_processes(tmp: Path, world: int, timeout=120):
    """``python -m ncdp_fast.cli release`` as ``world`` fresh interpreters with the
    environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, ...)."""
    from _distributed import free_port
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", NUMBA_NUM_THREADS="1",
                   RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "ncdp_fast.cli",
                                       *_argv(tmp, world)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    res = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            res.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return res


def test_cli_same_release_with_1_2_3_processes(tmp_path, capsys, monkeypatch):
    """1 process: main() here; 2: two fresh ``python -m ncdp_fast.cli`` processes with
    torchrun's environment; 3: three forked children with that environment (cheaper
    than three more interpreters; the same code path from main() on)."""
    import json
    from ncdp_fast.cli import main
    X, y = _data(80, 6, 3)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    runs = {}
    for world, run in [(1, lambda: [(main(_argv(tmp_path, 1)), *capsys.readouterr())]),
                       (2, lambda: _cli_processes(tmp_path, 2)),
                       (3, lambda: spawn(_cli_child, 3, _argv(tmp_path, 3), timeout=90,
                                         torchrun_env=True))]:
        # The same key and data on purpose: each run on a key ledger of its own
        # (one ledger would give each later run a fresh range of --seed's stream).
        monkeypatch.setenv("NCDP_FAST_LEDGER_DIR", str(tmp_path / f"ledger{world}"))
        runs[world] = run()
    arrays = {}
    for world, res in runs.items():
        assert all(rc == 0 for rc, _, _ in res), res
        assert "ncdp-fast release: rank 0 rows" in res[0][2]        # progress on stderr
        assert "released T = 80" in res[0][1]
        out = tmp_path / f"out{world}"
        arrays[world] = (np.load(out / "x.npy"), np.load(out / "y.npy"),
                         json.loads((out / "report.json").read_text())["report"])
    _stream._LEDGER.clear()
    mech = NeuroMixGDP(seed=11, epsilon=2, delta=1e-5, mixup_degree=5.0, accountant="clt",
                       hierarchical_classes=2.0)
    mech.value_discretization_interval = 1e-2
    one, groups = mech._release(X, y, num_classes=3, return_groups=True)
    np.testing.assert_array_equal(arrays[1][0], one.x)      # 1 process: bit for bit
    for world in (1, 2, 3):
        np.testing.assert_array_equal(arrays[world][1], one.y)
        assert arrays[world][2] == one.report.as_dict()
        _within_rounding(arrays[world][0], X, one, groups, world)
    # a bad argument is a clear error on every rank, not a hang
    bad = spawn(_cli_child, 2, _argv(tmp_path, 9, ["--hierarchical-classes", "9"]),
                timeout=60, torchrun_env=True)
    assert all(rc == 2 and "hierarchical_classes: expected" in e for rc, _, e in bad), bad


def _torchrun(tmp: Path, world: int, out: str, extra=(), timeout=180):
    """``torchrun --standalone --nproc-per-node world -m ncdp_fast.cli release``: the real
    launcher (its exit status is 0 only when every rank exited 0)."""
    argv = _argv(tmp, world, extra)
    argv[argv.index("--out") + 1] = str(tmp / out)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", NUMBA_NUM_THREADS="1",
               OMP_NUM_THREADS="1", NCDP_FAST_LEDGER_DIR=str(tmp / "ledger"))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world}", "-m", "ncdp_fast.cli", *argv],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_key_ledger_under_real_torchrun(tmp_path):
    """Issue 23 item 7 across ranks, through torchrun itself: two runs with one --seed
    on one ledger both exit 0 on every rank and the second draws a fresh range (rank 0
    reserves it and broadcasts it, so the ranks agree); --offset at a used range is
    refused on every rank, before anything is written."""
    X, y = _data(40, 5, 3)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    first = _torchrun(tmp_path, 2, "a")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _torchrun(tmp_path, 2, "b")
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = np.load(tmp_path / "a" / "x.npy"), np.load(tmp_path / "b" / "x.npy")
    assert a.shape == b.shape and not np.any(np.all(a == b, axis=1))   # no row repeats
    reused = _torchrun(tmp_path, 2, "c", ["--offset", "0"])
    assert reused.returncode != 0
    assert reused.stderr.count("--offset") >= 2, reused.stderr[-3000:]  # said by each rank
    assert not (tmp_path / "c" / "x.npy").exists()


# ------------------------------------------------- the command's output, its failures

def _release_argv(tmp: Path, out: Path, extra=(), **change):
    """The command's arguments; ``change``: options replaced (``chunk_mb="0"``)."""
    opts = dict(features=tmp / "X.npy", labels=tmp / "y.npy", num_classes=3, epsilon=2,
                delta=1e-5, mixup_degree=5, accountant="clt", pld_interval=1e-2, timeout=30,
                chunk_mb=0.001, out=out)
    opts.update(change)
    return ["release", *(a for k, v in opts.items() for a in ("--" + k.replace("_", "-"),
                                                              str(v))), *extra]


def _launch(tmp: Path, argv, *, kill_rank=None, ledger="ledger", world=2, timeout=180):
    """The real launcher, ``torchrun --standalone --nproc-per-node world``, on the
    command (``-m ncdp_fast.cli``) or, with ``kill_rank``, on tests/_release_victim.py
    (the same command, that rank killed by SIGKILL while the release is written)."""
    target = ["-m", "ncdp_fast.cli"] if kill_rank is None else \
        [str(Path(__file__).with_name("_release_victim.py"))]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", NUMBA_NUM_THREADS="1",
               OMP_NUM_THREADS="1", NCDP_FAST_LEDGER_DIR=str(tmp / ledger),
               NCDP_TEST_KILL_RANK=str(-1 if kill_rank is None else kill_rank))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world}", *target, *argv],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_killed_ranks_leave_no_partial_output_and_the_output_loads_under_real_torchrun(
        tmp_path):
    """Through torchrun itself, into one --out: (1) rank 1 killed while rank 0 writes:
    rank 0 removes its .part files, its lock and the directory it made; (2) rank 0
    killed while writing: its .part files and lock stay (nothing can run in a
    SIGKILLed process); (3) the next run removes them, says so in one line, and
    writes a directory that ncdp_fast.release.load verifies (HMAC included) and that
    holds the one-process release (y and the report bit for bit, x within the
    rounding bound of _within_rounding)."""
    from ncdp_fast.release import _directory, load
    X, y = _data(80, 6, 3)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    out = tmp_path / "rel"
    first = _launch(tmp_path, _release_argv(tmp_path, out), kill_rank=1)
    assert first.returncode != 0, first.stderr[-3000:]
    assert "rank 0 of 2: error:" in first.stderr or "stopped by SIGTERM" in first.stderr, \
        first.stderr[-3000:]
    assert not out.exists(), sorted(os.listdir(out))      # no .part, no lock, no directory
    second = _launch(tmp_path, _release_argv(tmp_path, out), kill_rank=0)
    assert second.returncode != 0
    assert sorted(os.listdir(out)) == [_directory.LOCK, "x.npy.part", "y.npy.part"]
    pid = json.loads((out / _directory.LOCK).read_text())["pid"]
    key_file = tmp_path / "hmac.key"
    key_file.write_bytes(b"0123456789abcdef-publisher")
    third = _launch(tmp_path, _release_argv(tmp_path, out, ["--seed", "11", "--hmac-key-file",
                                                      str(key_file), "--quiet"]),
                    ledger="ledger3")
    assert third.returncode == 0, third.stderr[-3000:]
    assert third.stderr.count(f"ncdp-fast release: removed x.npy.part, y.npy.part left in "
                              f"{out} by an interrupted run (pid {pid} on this host, no longer "
                              "running)") == 1, third.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["manifest.json", "report.json", "x.npy", "y.npy"]
    rel = load(out, key=key_file.read_bytes())
    _stream._LEDGER.clear()
    mech = NeuroMixGDP(seed=11, offset=0, epsilon=2, delta=1e-5, mixup_degree=5.0,
                       accountant="clt")
    mech.value_discretization_interval = 1e-2
    one, groups = mech._release(X, y, num_classes=3, return_groups=True)
    np.testing.assert_array_equal(rel.y, one.y)
    assert rel.report == one.report
    _within_rounding(rel.x, X, one, groups, 2)


def test_existing_out_refused_on_every_rank_before_any_work_under_real_torchrun(tmp_path):
    """An --out holding a release, without --overwrite: every rank stops with one line
    naming it, before the key ledger, the sampling or any collective of the release
    (no gloo 'Connection reset' on the other rank); the release there is untouched."""
    X, y = _data(40, 4, 3)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    out = tmp_path / "rel"
    mech = NeuroMixGDP(epsilon=2, delta=1e-5, mixup_degree=4, accountant="clt")
    mech.value_discretization_interval = 1e-2
    from ncdp_fast.distributed import release_sharded
    release_sharded(mech, X, y, num_classes=3).save(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    run = _launch(tmp_path, _release_argv(tmp_path, out, ["--seed", "5"]))
    assert run.returncode != 0
    lines = [s for s in run.stderr.splitlines() if s.startswith("ncdp-fast release:")]
    assert sorted(lines) == [f"ncdp-fast release: rank {r} of 2: error: 1 of 2 ranks failed "
                             f"before starting: rank 0: FileExistsError: --out: {out} already "
                             "holds a release (x.npy, y.npy, report.json, manifest.json); pass "
                             "--overwrite to replace it, or choose another directory"
                             for r in range(2)], run.stderr[-3000:]
    assert "Connection reset" not in run.stderr
    assert not (tmp_path / "ledger").exists()            # no draw of --seed reserved
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("change,expected", [
    (dict(timeout="0"), "--timeout: expected a finite number > 0, got 0.0"),
    (dict(timeout="-5"), "--timeout: expected a finite number > 0, got -5.0"),
    (dict(timeout="nan"), "--timeout: expected a real number, got nan"),
    (dict(chunk_mb="0"), "--chunk-mb: expected a finite number > 0, got 0.0"),
    (dict(features="{tmp}/X.npz"), "--features: expected a .npy file holding one array, got "
     "an .npz archive (X) in {tmp}/X.npz; write that array alone with numpy.save"),
    (dict(labels="{tmp}/X.npz"), "--labels: expected a .npy file holding one array, got "
     "an .npz archive (X) in {tmp}/X.npz; write that array alone with numpy.save"),
    (dict(features="{tmp}/none.npy"), "--features: {tmp}/none.npy: no such file"),
    (dict(hmac_key_file="{tmp}/short.key"), "--hmac-key-file: expected a secret of at least "
     "16 bytes, got 5 bytes in {tmp}/short.key"),
], ids=["timeout0", "timeout-5", "timeout-nan", "chunk0", "features-npz", "labels-npz",
        "no-features", "short-key"])
def test_bad_command_inputs_one_line_exit_2(tmp_path, capsys, change, expected):
    """One process: each refusal is one stderr line and exit status 2, and nothing is
    written (no --out directory).  Under torchrun each rank runs the same checks, the
    argument checks before the group starts and the file checks in the pre-flight
    exchange (test above), so every rank stops."""
    from ncdp_fast.cli import main
    X, y = _data(30, 4, 3)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "X.npz", X=X)
    (tmp_path / "short.key").write_bytes(b"short")
    rc = main(_release_argv(tmp_path, tmp_path / "out",
                            **{k: v.format(tmp=tmp_path) for k, v in change.items()}))
    err = capsys.readouterr().err
    assert rc == 2 and err == f"ncdp-fast release: rank 0 of 1: error: " \
        f"{expected.format(tmp=tmp_path)}\n", err
    assert not (tmp_path / "out").exists()


def test_sigterm_while_writing_removes_partial_output(tmp_path):
    """One process that receives SIGTERM (torchrun's signal to the surviving ranks)
    right after the first rows reached its .part files: it removes them, its lock and
    the directory it made, says so in one line and exits 143."""
    X, y = _data(40, 4, 3)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    out = tmp_path / "rel"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("_release_victim.py")),
                          *_release_argv(tmp_path, out, ["--quiet"])],
                         env=dict(env, NCDP_TEST_KILL_RANK="0", NCDP_TEST_SIGNAL="TERM",
                                  NCDP_FAST_LEDGER_DIR=str(tmp_path / "ledger")),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 143, run.stderr[-3000:]
    assert run.stderr == ("ncdp-fast release: rank 0 of 1: stopped by SIGTERM (torchrun stops "
                          "the other ranks when one fails); partial output removed\n")
    assert not out.exists()
