"""The row-sharded NTK Gram (:func:`ntk_gram`): each rank's rows of
K = sum_l (F_l F_l^T) o (B_l B_l^T), the half tiles swapped between ranks
(the method: :mod:`ncdp_fast.distributed.ntk`)."""
from __future__ import annotations

import numpy as np

from .. import _arrays, _backend
from .._ntk import _check_network, accumulate_gram, iter_ntk_factors, namespace
from ._group import resolve_group, shard_bounds
from ._ntk_comm import _Comm, _agree_on_arguments, _row_counts, _sha256

def factor_widths(weights, biases):
    """Widths (a, c) of the Gram's factor pairs in the order ``iter_ntk_factors``
    yields them (last layer first): a = None for the constant-1 factor of the last
    layer, else in_l (+1 with a bias); c = in_{L-1} (+1) for the last layer, else
    out_l * K_out.  Every rank knows them from the weights alone, so a receive
    buffer needs no shape exchange."""
    L = len(weights)
    shapes = [tuple(_arrays.shape(w, f"weights[{l}]")) for l, w in enumerate(weights)]
    bias = [biases is not None and biases[l] is not None for l in range(L)]
    k_out = shapes[-1][0]
    widths = [(None, shapes[-1][1] + bias[-1])]
    for l in range(L - 2, -1, -1):
        widths.append((shapes[l][1] + bias[l], shapes[l][0] * k_out))
    return widths


def _empty_terms(widths, dtype):
    for a, c in widths:
        yield (None if a is None else np.empty((0, a), dtype), np.empty((0, c), dtype))


def ntk_gram(x, weights, *, biases=None, activation="relu", parameterization="standard",
             group=None, replicated=False, stats=None):
    """This rank's rows of the empirical NTK Gram K = sum_l (F_l F_l^T) o (B_l B_l^T)
    over a ``torch.distributed`` process group, without K or J on any rank.

    Args:
        x: this rank's inputs, (n_r, d) float32 or float64, NumPy or torch CPU.  The
            n global inputs are the ranks' ``x`` stacked in rank order (any
            contiguous split; a rank may hold 0 rows, as long as n >= 1).  With
            ``replicated=True`` every rank passes all (n, d) inputs (the same on every
            rank, which is checked) and works on its ``shard_bounds(n, rank, world)``
            rows.
        weights, biases, activation, parameterization: as :func:`ncdp_fast.ntk_gram`;
            the same on every rank (checked by digest before any other collective).
        group: a ``torch.distributed`` process group; None: the default group if
            ``torch.distributed`` is initialised, else one process.
        stats: an optional dict, filled with ``row_start``, ``rows``, ``n``,
            ``bytes_sent``, ``bytes_received`` (payload; see ``_Comm``) and
            ``collectives`` of this rank.

    Returns K[row_start : row_start + n_r, :], shape (n_r, n), in x's dtype and array
    library (row_start = the rows of the lower ranks).  It equals the one-process
    ``ntk_gram`` of the stacked inputs row for row, to the rounding of the factors and
    of the kernel's dot products (the arithmetic per entry is the same; only BLAS's
    blocking differs); the stacked rows are exactly symmetric (each off-diagonal
    entry is computed by one rank and copied to the other).

    Work per rank: the forward/backward pass of its n_r rows and about n_r n / 2
    entries per layer term (n_r^2 / 2 for its diagonal block, half of each tile it
    shares with a peer; one process: n^2 / 2); memory: the n_r x n rows plus one
    layer's factors of this rank and of one peer, and one half tile in flight;
    communication: each rank receives n - n_r rows of every layer's factors
    (sum_l (a_l + c_l) numbers per row), sends its own n_r rows to each peer, and
    swaps half of each shared tile (n_r n_s / 2 entries each way, pair by pair in
    lexicographic order with blocking send/recv).  A rank that dies or stalls makes
    the others raise after the group's timeout (or at once, when its sockets close).
    """
    group = resolve_group(group)
    what = "ncdp_fast.distributed.ntk_gram"
    comm = _Comm(group, what)
    rank, world = comm.rank, comm.world
    error, config, secret = None, {}, {}
    try:
        if not isinstance(replicated, bool):
            raise TypeError(f"replicated: expected True or False, got {replicated!r}")
        if stats is not None and not isinstance(stats, dict):
            raise TypeError(f"stats: expected None or a dict, got {type(stats).__name__}")
        arrays = {"x": x}
        if isinstance(weights, (list, tuple)):
            arrays.update({f"weights[{l}]": w for l, w in enumerate(weights)})
        if isinstance(biases, (list, tuple)):
            arrays.update({f"biases[{l}]": b for l, b in enumerate(biases)})
        be = _backend.select("ntk", **arrays)
        if be.name != "cpu":
            raise TypeError(f"x: the row-sharded Gram takes CPU arrays (NumPy or torch CPU; "
                            f"gloo), got {_arrays.describe(x)}")
        dtype = be.check_float(x, "x")
        xs = _arrays.shape(x, "x")
        if len(xs) != 2:
            raise ValueError(f"x: expected shape (n_r, d), got {xs}")
        _check_network(xs, weights, biases, activation, parameterization, be, dtype)
        config = dict(dtype=dtype.name, d=xs[1], activation=activation,
                      parameterization=parameterization, replicated=replicated,
                      weights=[tuple(_arrays.shape(w, "w")) for w in weights],
                      weights_sha256=[_sha256(w) for w in weights],
                      biases=None if biases is None else
                      [None if b is None else _sha256(b) for b in biases])
        if replicated:
            config["n"] = xs[0]
            secret["x"] = np.ascontiguousarray(_arrays.to_numpy(x))   # private: never shown
    except (TypeError, ValueError) as e:
        error = e
    try:
        _agree_on_arguments(comm, config, error, what, secret)
    finally:
        # A raised error's traceback holds this frame, which would hold the error:
        # a cycle keeping the group alive past destroy_process_group (GroupRef).
        error = None

    if replicated:
        n = xs[0]
        lo, hi = shard_bounds(n, rank, world)
        counts = [b - a for a, b in (shard_bounds(n, r, world) for r in range(world))]
        x = x[lo:hi]
    else:
        counts = _row_counts(comm, xs[0])
        n = sum(counts)
        lo = sum(counts[:rank])
    if n == 0:
        raise ValueError(f"x: expected n >= 1 rows over the {world} rank(s), got 0 on every "
                         "rank")
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    n_r = counts[rank]
    widths = factor_widths(weights, biases)
    out = np.zeros((n_r, n), dtype=dtype)
    ns = namespace(be.io.lib)
    if n_r:
        xw = [ns.as_input(w) for w in weights]
        xb = None if biases is None else [None if b is None else ns.as_input(b) for b in biases]
        terms = iter_ntk_factors(ns.as_input(x), xw, xb, activation, parameterization, ns,
                                 ns.matmul)
    else:
        terms = _empty_terms(widths, dtype)
    if be.io.lib == "torch":            # the kernel's GEMMs run in the caller's library
        import torch

        def lib(a):
            return None if a is None else torch.from_numpy(a)
    else:
        def lib(a):
            return a
    for t, ((f, b), (a, c)) in enumerate(zip(terms, widths)):
        # NumPy views of this rank's factors (torch CPU tensors: no copy), sent as is.
        f = None if f is None else np.ascontiguousarray(be.io.to_kernel(f))
        b = np.ascontiguousarray(be.io.to_kernel(b))
        if b.shape != (n_r, c) or (f is None) != (a is None) or (f is not None and
                                                                 f.shape != (n_r, a)):
            raise AssertionError(f"{what}: factor term {t} has shapes "
                                 f"{None if f is None else f.shape}, {b.shape}; expected "
                                 f"({n_r}, {a}), ({n_r}, {c})")
        for s in range(world):
            if counts[s] == 0:
                continue
            step = f"layer term {t} of rank {s}"
            if s == rank:
                if f is not None:
                    comm.bcast(f, s, step)
                comm.bcast(b, s, step)
                accumulate_gram(be, [((lib(f), lib(b)), (lib(f), lib(b)))],
                                out[:, lo:lo + n_r], True)
                continue
            fs = None if a is None else comm.bcast(np.empty((counts[s], a), dtype), s, step)
            bs = comm.bcast(np.empty((counts[s], c), dtype), s, step)
            # The tile K[R_lo, R_hi] of a pair of ranks lo < hi is computed once, half by
            # each: lo its rows against the first half H1 of hi's rows, hi the second
            # half H2 of its rows against all of lo's; the halves are swapped below.
            if rank < s:
                h = counts[s] // 2
                if n_r and h:
                    accumulate_gram(be, [((lib(f), lib(b)), (lib(_head(fs, h)), lib(bs[:h])))],
                                    out[:, offsets[s]:offsets[s] + h], False)
            else:
                h = n_r // 2
                if n_r > h:
                    accumulate_gram(be, [((lib(_tail(f, h)), lib(b[h:])), (lib(fs), lib(bs)))],
                                    out[h:, offsets[s]:offsets[s + 1]], False)
    _swap_half_tiles(comm, out, counts, offsets)
    if stats is not None:
        stats.update(comm.stats(), row_start=lo, rows=n_r, n=n)
    return be.io.to_user(out)


def _head(a, h):
    return None if a is None else a[:h]


def _tail(a, h):
    return None if a is None else a[h:]


def _swap_half_tiles(comm, out, counts, offsets):
    """Complete the rows after the half tiles of :func:`ntk_gram`: for each pair of
    ranks lo < hi (in lexicographic order, so that blocking sends and receives
    cannot wait in a cycle), lo sends K[R_lo, H1] (n_lo x |H1|) and hi sends
    K[H2, R_lo] (|H2| x n_lo); each writes the transpose of what it receives into
    its rows.  Every
    off-diagonal entry is then computed once and the stacked rows are exactly
    symmetric."""
    if comm.world == 1:
        return
    rank = comm.rank
    for lo in range(comm.world):
        for hi in range(lo + 1, comm.world):
            if rank not in (lo, hi) or counts[lo] == 0 or counts[hi] == 0:
                continue
            h = counts[hi] // 2
            c_lo, c_hi = slice(offsets[lo], offsets[lo + 1]), offsets[hi]
            step = f"half tiles of ranks {lo} and {hi}"
            # Each block travels as its sender holds it and is transposed on arrival.
            if rank == lo:
                if h:
                    comm.send(np.ascontiguousarray(out[:, c_hi:c_hi + h]), hi, step)
                got = comm.recv(np.empty((counts[hi] - h, counts[lo]), out.dtype), hi, step)
                out[:, c_hi + h:c_hi + counts[hi]] = got.T
            else:
                if h:
                    out[:h, c_lo] = comm.recv(np.empty((counts[lo], h), out.dtype), lo, step).T
                comm.send(np.ascontiguousarray(out[h:, c_lo]), lo, step)
