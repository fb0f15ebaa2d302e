"""ncdp_fast.distributed._group and the spawn helper of tests/_distributed.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch.distributed")

from _distributed import RankFailure, spawn, spawn_outcomes  # noqa: E402

from ncdp_fast.distributed import check_same_config, rank_world, resolve_group, shard_bounds


def test_shard_bounds_tile_in_order():
    for n in (0, 1, 2, 5, 17):
        for world in (1, 2, 3, 7):
            b = [shard_bounds(n, r, world) for r in range(world)]
            assert b[0][0] == 0 and b[-1][1] == n
            assert all(b[i][1] == b[i + 1][0] for i in range(world - 1))
            sizes = [hi - lo for lo, hi in b]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="rank: expected an integer in"):
        shard_bounds(4, 2, 2)
    with pytest.raises(TypeError, match="n: expected"):
        shard_bounds(4.0, 0, 2)


def test_one_process_without_init():
    assert resolve_group(None) is None
    assert rank_world(None) == (0, 1)
    check_same_config({"a": 1}, None, "x")       # nothing to compare against
    with pytest.raises(TypeError, match="group: expected a torch.distributed"):
        resolve_group("world")


def _same(rank, world):
    g = resolve_group(None)
    check_same_config({"n": 10, "eps": 1.5}, g, "op")
    return rank_world(g)


def _differ(rank, world):
    cfg = {"n": 10, "eps": 1.0 if rank == 0 else 2.0}
    if rank == world - 1:
        cfg["extra"] = 1
    try:
        check_same_config(cfg, resolve_group(None), "op")
    except ValueError as e:
        return str(e)
    return "no error"


def _raise(rank, world):
    if rank == 1:
        raise KeyError("boom on rank 1")
    return rank


def _die(rank, world):
    import torch
    import torch.distributed as dist
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.zeros(1))      # waits on the dead rank: must error, not hang
    return rank


def test_spawn_returns_and_configs_agree():
    assert spawn(_same, 3) == [(0, 3), (1, 3), (2, 3)]


def test_differing_config_named_on_every_rank():
    msgs = spawn(_differ, 3)
    for m in msgs:
        assert "op: expected the same configuration on all 3 ranks" in m
        assert "eps (rank 0: 1.0, rank 1: 2.0, rank 2: 2.0)" in m
        assert "extra (rank 0: <missing>" in m
        assert "n (" not in m


def test_child_exception_and_death_surface_in_parent():
    with pytest.raises(RankFailure, match="boom on rank 1"):
        spawn(_raise, 2)
    t0 = time.monotonic()
    outs = spawn_outcomes(_die, 2, timeout=40, pg_timeout=10)
    assert time.monotonic() - t0 < 40
    assert outs[1].status == "died" and outs[1].exitcode == 3
    assert outs[0].status == "error"        # gloo reports the lost peer or times out


def test_usable_without_torch():
    """The package, _group and a one-process sharded release import and run with
    torch made unimportable (torch is an optional dependency)."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch")
sys.meta_path.insert(0, Block())
import numpy as np
import ncdp_fast.distributed as D
from ncdp_fast.release import NeuroMixGDP
assert D.resolve_group(None) is None and D.shard_bounds(5, 1, 2) == (3, 5)
m = NeuroMixGDP(epsilon=2, delta=1e-5, mixup_degree=4, accountant="clt", seed=1)
m.value_discretization_interval = 1e-2
r = D.release_sharded(m, np.ones((20, 3), np.float32), np.arange(20) % 2, num_classes=2)
assert r.gather().x.shape == (20, 3) and "torch" not in sys.modules
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
