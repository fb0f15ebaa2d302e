"""The release directory (``ncdp-fast release --out DIR``, ``ShardedRelease.save``) in one
process: what ``ncdp_fast.release.load(DIR)`` verifies and names, and the writer's
hygiene (partial files, the lock, leftovers of a killed writer).  The same under real
torchrun: tests/test_distributed_release.py."""
import hashlib
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ncdp_fast.release as R
from ncdp_fast.distributed import release_sharded
from ncdp_fast.release import NeuroMixGDP, Released, ReleaseFileError
from ncdp_fast.release import _directory as D

from _release_checks import check_key_refusals

KEY = b"publisher secret, 32 bytes long."


def _sharded(seed=3):
    rng = np.random.default_rng(1)
    X = (rng.standard_normal((40, 5)) * 2).astype(np.float32)
    y = rng.integers(0, 3, 40)
    mech = NeuroMixGDP(epsilon=2.0, delta=1e-5, mixup_degree=4, num_samples=30,
                       accountant="clt", seed=seed, offset=0)
    mech.value_discretization_interval = 1e-2       # fast accounting, same checks
    return release_sharded(mech, X, y, num_classes=3)


@pytest.fixture(scope="module")
def res():
    return _sharded()


@pytest.fixture
def saved(res, tmp_path):
    return res.save(tmp_path / "rel", key=KEY)


def test_round_trip_with_and_without_key(res, saved):
    assert sorted(os.listdir(saved)) == ["manifest.json", "report.json", "x.npy", "y.npy"]
    for back in (R.load(saved), R.load(saved, key=KEY), Released.load(str(saved))):
        np.testing.assert_array_equal(back.x, res.x)
        np.testing.assert_array_equal(back.y, res.y)
        assert back.x.dtype == np.float32 and back.report == res.report
        assert back._noise_key is None and back.recompute_report() == res.report
    # what the manifest records is the files' own size and SHA-256
    man = json.loads((saved / "manifest.json").read_text())
    for name in D.FILES:
        data = (saved / name).read_bytes()
        assert man["files"][name] == dict(bytes=len(data),
                                          sha256=hashlib.sha256(data).hexdigest())
    # no key on disk; the metadata is Released.metadata()
    assert "seed" not in (saved / "report.json").read_text()
    assert json.loads((saved / "report.json").read_text())["num_samples"] == 30


def test_wrong_or_missing_key(res, saved, tmp_path):
    check_key_refusals(res.save, R.load, saved, KEY, unsigned_path=tmp_path / "unsigned",
                       short_path=tmp_path / "short", short_key=b"short")


@pytest.mark.parametrize("name", D.FILES)
def test_missing_or_truncated_file_is_named(saved, name):
    p = saved / name
    data = p.read_bytes()
    p.write_bytes(data[:-1])
    with pytest.raises(ReleaseFileError, match=f"{p}: {len(data) - 1} bytes, but manifest.json "
                       f"records {len(data)}: truncated"):
        R.load(saved)
    p.unlink()
    with pytest.raises(ReleaseFileError, match=f"{p}: missing \\(listed in manifest.json\\)"):
        R.load(saved)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(D.FILES), where=st.floats(0, 1, exclude_max=True),
       flip=st.integers(1, 255))
def test_any_altered_byte_is_refused_naming_its_file(res, tmp_path_factory, name, where, flip):
    out = res.save(tmp_path_factory.mktemp("flip") / "rel")
    p = out / name
    data = bytearray(p.read_bytes())
    data[int(where * len(data))] ^= flip
    p.write_bytes(bytes(data))
    with pytest.raises(ReleaseFileError, match=f"{p}: SHA-256 mismatch with manifest.json"):
        R.load(out)


def test_consistent_forgery_meets_the_npz_checks(saved):
    """The per-file SHA-256 is a corruption check: an edit with a recomputed manifest
    passes it, and meets what follows, as in the .npz: the report is recomputed
    (a smaller epsilon claimed is refused) and the HMAC fails."""
    rep = saved / "report.json"
    meta = json.loads(rep.read_text())
    meta["report"]["epsilon_pld"] *= 0.5
    rep.write_text(json.dumps(meta))
    man = json.loads((saved / "manifest.json").read_text())
    data = rep.read_bytes()
    man["files"]["report.json"] = dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (saved / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ReleaseFileError, match="stated epsilon_pld"):
        R.load(saved)
    with pytest.raises(ReleaseFileError, match="HMAC mismatch"):
        R.load(saved, key=KEY)


def test_incomplete_or_foreign_directories(saved, tmp_path):
    (saved / "manifest.json").unlink()
    with pytest.raises(ReleaseFileError, match="manifest.json: missing; .* is not a complete "
                       "release directory"):
        R.load(saved)
    (saved / "manifest.json").write_text('{"format": "something else"}')
    with pytest.raises(ReleaseFileError, match="format 'something else'"):
        R.load(saved)
    (saved / "manifest.json").write_text("[1, 2")
    with pytest.raises(ReleaseFileError, match="not a manifest"):
        R.load(saved)
    np.save(tmp_path / "lone.npy", np.zeros(3))
    with pytest.raises(ReleaseFileError, match="a single array, not a release"):
        R.load(tmp_path / "lone.npy")


def test_existing_release_refused_and_overwritten(res, saved):
    before = {n: (saved / n).read_bytes() for n in D.FILES}
    with pytest.raises(FileExistsError, match="already holds a release .* pass overwrite=True"):
        res.save(saved)
    assert {n: (saved / n).read_bytes() for n in D.FILES} == before
    other = _sharded(seed=4)
    other.save(saved, overwrite=True)
    np.testing.assert_array_equal(R.load(saved).x, other.x)
    assert sorted(os.listdir(saved)) == ["manifest.json", "report.json", "x.npy", "y.npy"]


def test_failed_write_removes_partial_files_and_never_mixes(res, saved, monkeypatch):
    """An overwrite that fails half-way through its renames (x.npy replaced, y.npy not):
    the old manifest went first, so the mix is refused as incomplete; the remaining
    .part files and the lock are gone."""
    real = os.replace
    calls = []

    def replace(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise OSError("disk gone")
        real(a, b)
    monkeypatch.setattr(D.os, "replace", replace)
    with pytest.raises(OSError, match="disk gone"):
        _sharded(seed=4).save(saved, overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(saved)) == ["report.json", "x.npy", "y.npy"]
    with pytest.raises(ReleaseFileError, match="not a complete release directory"):
        R.load(saved)
    # a failure while rows arrive: nothing new, the directory made for it removed
    out = saved.parent / "fresh"

    def broken(self, dst, sink, chunk_rows):
        sink(0, self.x[:1], self.y[:1])
        raise RuntimeError("Connection closed by peer")
    monkeypatch.setattr(type(res), "_stream_rows", broken)
    with pytest.raises(RuntimeError, match="closed by peer"):
        res.save(out)
    assert not out.exists()


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_a_killed_writer(res, tmp_path):
    """A writer killed outright leaves its .part files and lock: the next writer removes
    them when the lock's process is gone (and says so), and refuses while it runs or
    when it is on another host."""
    out = tmp_path / "rel"
    out.mkdir()
    for name in ("x.npy.part", "y.npy.part"):
        (out / name).write_bytes(b"\0" * 100)
    (out / "notes.txt").write_text("the user's")           # not ours: kept
    lock = out / D.LOCK
    lock.write_text(json.dumps(dict(pid=os.getpid(), host=socket.gethostname(),
                                    start=D._start_time(os.getpid()))))
    with pytest.raises(FileExistsError, match=f"being written by pid {os.getpid()} on host"):
        res.save(out)
    lock.write_text(json.dumps(dict(pid=1, host="elsewhere", start=None)))
    with pytest.raises(FileExistsError, match="pid 1 on host elsewhere"):
        res.save(out)
    lock.write_text("{not json")
    with pytest.raises(FileExistsError, match="unreadable"):
        res.save(out)
    assert (out / "x.npy.part").exists()                   # refusals remove nothing
    pid = _dead_pid()
    lock.write_text(json.dumps(dict(pid=pid, host=socket.gethostname(), start="1")))
    w = D.DirectoryWriter(out).open()
    assert w.notes == [f"removed x.npy.part, y.npy.part left in {out} by an interrupted run "
                       f"(pid {pid} on this host, no longer running)"]
    w.abort()
    assert sorted(os.listdir(out)) == ["notes.txt"]
    res.save(out)
    assert R.load(out).num_samples == 30 and (out / "notes.txt").exists()
