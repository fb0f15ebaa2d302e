"""Row-sharded NTK Gram and its lambda_min across gloo ranks (ncdp_fast.distributed.ntk),
against one process.

Tolerances.  The sharded rows and the one-process Gram apply the same arithmetic to
factors that BLAS computed on different row blocks, so both the factors and the
kernel's dot products may round differently.  K = sum_l (f f'^T) o (b b'^T) is
bilinear in each factor, so with the factors each side actually used (every rank
returns its own, the parent computes the one-process ones) the difference of the two
exact Grams is computed directly in float64, and each side's kernel rounding is
bounded by Higham's gamma_m * sum_l (|f| |f'|^T) o (|b| |b'|^T), m = a_l + c_l + L + 1
(two dot products of lengths a_l, c_l, their product, L terms summed: Higham lemma
3.3).  lambda_min: the solver's residual (some eigenvalue of the sharded K lies
within it), plus ||K_sharded - K_one||_F (Weyl), plus the dense solver's residual.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

from _distributed import spawn, spawn_outcomes  # noqa: E402
from conftest import gamma  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast import ntk  # noqa: E402
from ncdp_fast._ntk import namespace, ntk_factors  # noqa: E402
from ncdp_fast.distributed import ntk as dntk  # noqa: E402
from ncdp_fast.distributed import shard_bounds  # noqa: E402

TOL = 1e-10          # the solver's default


def _network(kind):
    rng = np.random.default_rng(11)
    if kind == "tanh-bias":        # 3 layers, biases on two, K_out = 3
        W = [rng.standard_normal((13, 5)) / 2, rng.standard_normal((9, 13)) / 3,
             rng.standard_normal((3, 9)) / 3]
        return dict(weights=W, biases=[rng.standard_normal(13), None, rng.standard_normal(3)],
                    activation="tanh", parameterization="standard")
    W = [rng.standard_normal((40, 5)), rng.standard_normal((1, 40))]     # relu, ntk scaling
    return dict(weights=W, biases=None, activation="relu", parameterization="ntk")


def _inputs(n):
    return np.random.default_rng(5).standard_normal((n, 5))


def _cast(net, dtype):
    net = dict(net, weights=[w.astype(dtype) for w in net["weights"]])
    if net["biases"] is not None:
        net["biases"] = [None if b is None else b.astype(dtype) for b in net["biases"]]
    return net


def _local_factors(x, net):
    if len(x) == 0:                        # a rank without rows: empty factors
        return [(None if a is None else np.empty((0, a), x.dtype), np.empty((0, c), x.dtype))
                for a, c in dntk.factor_widths(net["weights"], net["biases"])]
    return ntk_factors(x, net["weights"], net["biases"], net["activation"],
                       net["parameterization"], namespace("numpy"), np.matmul)


# ----------------------------------------------------------------- rank functions

def _rank_gram(rank, world, kind, counts, replicated):
    """This rank's rows (both dtypes), the factors it computed, lambda_min of the
    float64 rows and the payload counts."""
    x_all = _inputs(sum(counts))
    lo = sum(counts[:rank])
    out = {}
    for dtype in (np.float64, np.float32):
        net = _cast(_network(kind), dtype)
        x = x_all.astype(dtype)
        stats = {}
        if replicated:
            rows = dntk.ntk_gram(x, group=None, replicated=True, stats=stats, **net)
            lo, hi = shard_bounds(len(x), rank, world)
        else:
            rows = dntk.ntk_gram(x[lo:lo + counts[rank]], stats=stats, **net)
            hi = lo + counts[rank]
        out[np.dtype(dtype).name] = dict(rows=rows, factors=_local_factors(x[lo:hi], net),
                                         stats=stats)
        st = {}
        r = dntk.lambda_min(rows, tol=TOL, stats=st)       # float32 rows: promoted by chunks
        out["lambda" if dtype == np.float64 else "lambda32"] = dict(
            value=r.value, residual=r.residual, vector=r.vector, stats=st, method=r.method)
    return out


def _one_process_bound(parts, x, net, dtype):
    """|K_sharded - K_one| <= this, elementwise (see the module docstring)."""
    one = _local_factors(x, net)
    shard = [(None if t[0] is None else np.concatenate([p[i][0] for p in parts]),
              np.concatenate([p[i][1] for p in parts])) for i, t in enumerate(one)]

    def gram64(terms):
        K = 0.0
        for f, b in terms:
            b = b.astype(np.float64)
            K = K + (b @ b.T) * (1.0 if f is None else f.astype(np.float64) @
                                  f.astype(np.float64).T)
        return K
    absolute = [(None if f1 is None else np.maximum(abs(f1.astype(np.float64)),
                                                   abs(f2.astype(np.float64))),
                 np.maximum(abs(b1.astype(np.float64)), abs(b2.astype(np.float64))))
                for (f1, b1), (f2, b2) in zip(one, shard)]
    m = max((0 if f is None else f.shape[1]) + b.shape[1] for f, b in one) + len(one) + 1
    g = 2 * (gamma(m, dtype) + gamma(m, np.float64))
    return np.abs(gram64(shard) - gram64(one)) + g * gram64(absolute)


def _check_against_one_process(results, kind, counts, replicated):
    n = sum(counts)
    x_all = _inputs(n)
    for dtype in (np.float64, np.float32):
        name = np.dtype(dtype).name
        net = _cast(_network(kind), dtype)
        x = x_all.astype(dtype)
        K_one = nf.ntk_gram(x, **net)
        rows = [r[name]["rows"] for r in results]
        assert [r.shape for r in rows] == [(c, n) for c in counts]
        assert all(r.dtype == dtype for r in rows)
        K_sh = np.concatenate(rows)
        bound = _one_process_bound([r[name]["factors"] for r in results], x, net, dtype)
        err = np.abs(K_sh.astype(np.float64) - K_one)
        assert np.all(err <= bound), (name, float((err - bound).max()))
        # Every off-diagonal entry is computed once (half tiles swapped between the
        # ranks), diagonal blocks are mirrored: the stacked rows are exactly symmetric.
        assert np.array_equal(K_sh, K_sh.T)
        # What a rank sent and received: its factor rows to every peer, the other
        # ranks' factor rows, and half of each tile it shares with a peer (nothing n x n).
        item = np.dtype(dtype).itemsize
        per_row = sum(b.shape[1] + (0 if f is None else f.shape[1])
                      for f, b in _local_factors(x[:1], net)) * item
        peers = len(counts) - 1
        row_counts = 0 if replicated else 8 * peers         # the all-gather of the counts
        for rank, r in enumerate(results):
            st = r[name]["stats"]
            assert st["n"] == n and st["rows"] == counts[rank]
            assert st["row_start"] == sum(counts[:rank])
            mine = counts[rank]
            # tile halves: to a higher peer s, my rows x its first half; to a lower
            # peer, its rows x my second half.
            tiles_out = sum(mine * (counts[s] // 2) if s > rank else
                            counts[s] * (mine - mine // 2) for s in range(len(counts))
                            if s != rank and mine and counts[s]) * item
            tiles_in = sum(mine * (counts[s] - counts[s] // 2) if s > rank else
                           counts[s] * (mine // 2) for s in range(len(counts))
                           if s != rank and mine and counts[s]) * item
            assert st["bytes_received"] == (n - mine) * per_row + row_counts + tiles_in
            assert st["bytes_sent"] == mine * per_row * peers + row_counts + tiles_out
    # lambda_min: the same bits on every rank; one-process value to the solver's bound.
    K64 = np.concatenate([r["float64"]["rows"] for r in results])
    lams = [r["lambda"] for r in results]
    assert len({(l["value"], l["residual"]) for l in lams}) == 1
    lam = lams[0]
    dense = ntk.lambda_min(nf.ntk_gram(x_all, **_network(kind)), method="eigh")
    K_one = nf.ntk_gram(x_all, **_network(kind))
    knorm = np.linalg.norm(K_one, 2)
    assert lam["stats"]["converged"] and lam["residual"] <= 1.01 * TOL * knorm
    allowed = lam["residual"] + np.linalg.norm(K64 - K_one) + dense.residual + \
        n * np.finfo(np.float64).eps * knorm
    assert abs(lam["value"] - dense.value) <= allowed, (lam["value"], dense.value, allowed)
    u = np.concatenate([l["vector"] for l in lams])
    assert u.shape == (n,) and abs(np.linalg.norm(u) - 1) < 1e-12
    # float32 rows: the solver works in float64 on them; against eigh of the
    # one-process float32 Gram, to the same kind of bound.
    K32 = np.concatenate([r["float32"]["rows"] for r in results]).astype(np.float64)
    K32_one = nf.ntk_gram(x_all.astype(np.float32), **_cast(_network(kind), np.float32))
    dense32 = ntk.lambda_min(K32_one, method="eigh")
    lam32 = [r["lambda32"] for r in results]
    assert len({(l["value"], l["residual"]) for l in lam32}) == 1
    allowed = lam32[0]["residual"] + np.linalg.norm(K32 - K32_one) + dense32.residual + \
        n * np.finfo(np.float64).eps * knorm
    assert abs(lam32[0]["value"] - dense32.value) <= allowed
    return lam


# ----------------------------------------------------------------------- tests

def test_one_process_is_the_op():
    """group=None without torch.distributed initialised: world 1, the op's result."""
    net = _network("tanh-bias")
    x = _inputs(40)
    stats = {}
    rows = dntk.ntk_gram(x, stats=stats, **net)
    K = nf.ntk_gram(x, **net)
    bound = _one_process_bound([_local_factors(x, net)], x, net, np.float64)
    assert np.all(np.abs(rows - K) <= bound) and np.array_equal(rows, rows.T)
    assert stats == dict(bytes_sent=0, bytes_received=0, collectives=0, row_start=0, rows=40,
                         n=40)
    r = dntk.lambda_min(rows)
    dense = ntk.lambda_min(K, method="eigh")
    assert abs(r.value - dense.value) <= r.residual + dense.residual + 1e-12 * np.abs(K).max()
    via_x = dntk.lambda_min(x=x, **net)
    assert via_x.value == r.value and via_x.method == "block-lanczos (1 ranks)"
    torch = pytest.importorskip("torch")
    tnet = dict(net, weights=[torch.from_numpy(w) for w in net["weights"]],
                biases=[None if b is None else torch.from_numpy(b) for b in net["biases"]])
    rows_t = dntk.ntk_gram(torch.from_numpy(x), **tnet)
    # torch CPU in, torch out; factors by torch's BLAS (as the op does for torch)
    K_t = nf.ntk_gram(torch.from_numpy(x), **tnet)
    assert isinstance(rows_t, torch.Tensor) and rows_t.dtype == torch.float64
    assert float((rows_t - K_t).abs().max()) <= 1e-12 * float(K_t.abs().max())


def test_singular_ntk_is_zero_to_rounding():
    # 9 + 3 parameters < n rows: K is singular; the solver stops at once.
    rng = np.random.default_rng(1)
    W = [rng.standard_normal((3, 2)), rng.standard_normal((1, 3))]
    x = rng.standard_normal((200, 2))
    K = nf.ntk_gram(x, W, activation="tanh")
    st = {}
    r = dntk.lambda_min(K, stats=st)
    assert st["converged"] and st["steps"] == 1
    assert abs(r.value) <= 200 * np.finfo(np.float64).eps * np.linalg.norm(K, 2)


def test_a_block_inside_the_basis_is_replaced_by_fresh_directions():
    comm = dntk._Comm(None, "test")
    rng = np.random.default_rng(0)
    V, _ = np.linalg.qr(rng.standard_normal((50, 8)))
    Z = V[:, :3] @ rng.standard_normal((3, 4))          # rank 3 < 4 columns, all inside V
    Q = dntk._orthonormal_block(Z, V, comm, lambda m: rng.standard_normal((50, m)), "t")
    assert Q.shape == (50, 4)
    np.testing.assert_allclose(Q.T @ Q, np.eye(4), atol=1e-13)
    assert np.abs(V.T @ Q).max() < 1e-13


def test_arguments_are_checked_before_any_collective():
    net = _network("relu")
    with pytest.raises(ValueError, match="weights\\[0\\]: expects inputs of width 5"):
        dntk.ntk_gram(np.zeros((3, 4)), **net)
    with pytest.raises(TypeError, match="x: expected float32 or float64"):
        dntk.ntk_gram(np.zeros((3, 5), dtype=np.int64), **net)
    with pytest.raises(ValueError, match="expected n >= 1 rows"):
        dntk.ntk_gram(np.zeros((0, 5)), **net)
    with pytest.raises(ValueError, match="K_rows: expected the ranks' rows to stack"):
        dntk.lambda_min(np.eye(3)[:2])
    with pytest.raises(ValueError, match="tol: expected"):
        dntk.lambda_min(np.eye(3), tol=-1.0)
    with pytest.raises(ValueError, match="give either K_rows or x"):
        dntk.lambda_min()
    with pytest.raises(TypeError, match="stats: expected None or a dict, got list"):
        dntk.ntk_gram(np.zeros((3, 5)), stats=[], **net)
    with pytest.raises(TypeError, match="replicated: expected True or False"):
        dntk.ntk_gram(np.zeros((3, 5)), replicated=1, **net)


def test_two_ranks_replicated_inputs_equal_one_process():
    counts = [12, 11]                       # n = 23: shard_bounds, uneven
    t0 = time.monotonic()
    results = spawn(_rank_gram, 2, "tanh-bias", counts, True, timeout=90)
    _check_against_one_process(results, "tanh-bias", counts, True)
    assert results[0]["lambda"]["method"] == "block-lanczos (2 ranks)"
    assert time.monotonic() - t0 < 90


def test_three_ranks_uneven_shards_and_an_empty_rank_equal_one_process():
    # Sharded inputs; rank 1 holds no rows, rank 2 one (the half of its tile it
    # computes is all of it; nothing goes from rank 0 to rank 2).
    counts = [83, 0, 1]
    results = spawn(_rank_gram, 3, "relu", counts, False, timeout=90)
    lam = _check_against_one_process(results, "relu", counts, False)
    assert results[1]["lambda"]["vector"].shape == (0,)
    assert lam["stats"]["steps"] > 1        # a real iteration, not one exact block
    # The rank with no rows still receives every factor block: (n rows) x widths.
    st = results[1]["float64"]["stats"]
    assert st["rows"] == 0 and st["bytes_sent"] == 8 * 2 and st["bytes_received"] > 0


MISMATCHES = {"activation": "activation", "weights": "weights_sha256",
              "width": "argument_error", "solver": "tol"}


def _rank_mismatches(rank, world):
    """Each mismatch in turn on the same group (after an error on every rank the
    group is still in step); {case: the message this rank raised}."""
    got = {}
    for what in MISMATCHES:
        net = _network("relu")
        x = _inputs(9)[3 * rank:3 * rank + 3]
        kwargs = {}
        if what == "activation" and rank == 1:
            net["activation"] = "tanh"
        elif what == "weights" and rank == 2:
            net["weights"] = [net["weights"][0] * 1.0000001, net["weights"][1]]
        elif what == "width" and rank == 0:
            x = x[:, :4]                    # this rank's own argument error
        elif what == "solver" and rank == 2:
            kwargs = dict(tol=1e-6)
        try:
            if what == "solver":
                dntk.lambda_min(x=x, **kwargs, **net)
            else:
                dntk.ntk_gram(x, **net)
            got[what] = "no error"
        except (ValueError, TypeError) as e:
            got[what] = f"{type(e).__name__}: {e}"
    return got


def test_mismatched_configuration_raises_on_every_rank():
    t0 = time.monotonic()
    results = spawn(_rank_mismatches, 3, timeout=60, pg_timeout=20)
    assert time.monotonic() - t0 < 60
    for what, key in MISMATCHES.items():
        for rank, got in enumerate(results):
            m = got[what]
            if what == "width" and rank == 0:   # the rank with the wrong x: its own error
                assert m.startswith("ValueError: weights[0]: expects inputs of width 5"), m
            else:
                assert m.startswith("ValueError: ncdp_fast.distributed."), m
                assert "expected the same configuration on all 3 ranks" in m and key in m, m


def _rank_dies(rank, world):
    import ncdp_fast.distributed._ntk_gram as m
    if rank == 1:                           # dies after sending its first factor block
        def die(*args, **kwargs):
            os._exit(7)
        m.accumulate_gram = die
    return m.ntk_gram(_inputs(10)[5 * rank:5 * rank + 5], **_network("tanh-bias")).shape


def test_a_dying_rank_is_an_error_not_a_hang():
    t0 = time.monotonic()
    outs = spawn_outcomes(_rank_dies, 2, timeout=60, pg_timeout=15)
    assert time.monotonic() - t0 < 60
    assert outs[1].status == "died" and outs[1].exitcode == 7
    assert outs[0].status == "error", outs[0]
    assert "another rank died, raised, or did not reach it" in outs[0].error, outs[0].error
