"""Row-sharded NTK Gram matrices and their smallest eigenvalue across ranks.

The empirical NTK of an MLP is a sum of Hadamard products of layer factors
(004_f44587b9249a6ca9.txt, "Bounding the smallest eigenvalue of the NTK"):

    K = sum_l (F_l F_l^T) o (B_l B_l^T),        K[i, j] = sum_l <F_l,i, F_l,j> <B_l,i, B_l,j>

(``ncdp_fast._ntk``: F_l the layer inputs, B_l the backpropagated matrices,
trace-averaged over the outputs).  Row i of every factor depends on the input
x_i alone, so a rank that owns rows ``R_r`` of K computes the factors of its own
inputs, and ``K[R_r, R_s] = sum_l (F_l[R_r] F_l[R_s]^T) o (B_l[R_r] B_l[R_s]^T)``
needs only rank s's factor rows: each rank broadcasts its factors, one layer at
a time.  The diagonal block is the symmetric kernel's; the tile K[R_lo, R_hi] of
two ranks is computed once, half by each (lo: its rows against the first half of
hi's; hi: the second half of its rows against all of lo's), and the halves are
swapped at the end, so the ranks together do the one-process n^2 / 2 entries and
the stacked rows are exactly symmetric.  K's n x n never exists on one rank (a
rank holds its n_r x n rows), nor do all n rows of the factors (one layer's
factors of one peer at a time).

:func:`lambda_min` finds the smallest eigenvalue of the sharded K by block
Lanczos with full re-orthogonalisation whose vectors are sharded like K's rows:
a product ``K Q`` is each rank's rows times the all-gathered block, and every
inner product is a local partial summed over the ranks.  Reductions are an
all-gather followed by a sum in rank order, so every rank sees the same bits
whatever gloo's algorithms do; the stop decision and the result are rank 0's,
broadcast (docs/architecture.md, "Across ranks: row-sharded NTK Grams").

One process (``group=None`` and no initialised ``torch.distributed``) is the
case world = 1 of the same code; torch is imported only for a real group.
"""
from __future__ import annotations

import hashlib
import math
import warnings

import numpy as np

from .. import _arrays, _backend
from .._ntk import _check_network, accumulate_gram, iter_ntk_factors, namespace
from .._validate import check_pos_int, check_positive, check_uint64
from ._group import check_same_config, rank_world, resolve_group, shard_bounds

__all__ = ["ntk_gram", "lambda_min", "factor_widths"]


# ------------------------------------------------------------------ collectives

class _Comm:
    """The collectives of one call: counted (payload bytes) and with errors that say
    which step failed.  ``group=None`` is one process (every method is local).

    Payload model: a broadcast root sends its buffer to each of the W - 1 others
    and each of them receives it once; an all-gather sends a rank's (padded) part
    to W - 1 ranks and receives W - 1 parts; a send/recv counts its buffer once.
    These are the bytes handed to and taken from ``torch.distributed``, not what
    gloo's algorithms put on the wire.
    """

    def __init__(self, group, what):
        self.group, self.what = group, what
        self.rank, self.world = rank_world(group)
        self.sent = self.received = self.calls = 0
        if group is not None:
            import torch
            import torch.distributed as dist
            self.torch, self.dist = torch, dist

    def _run(self, step, fn):
        self.calls += 1
        try:
            return fn()
        except RuntimeError as e:     # gloo: a peer closed its connection, or the timeout
            raise RuntimeError(
                f"{self.what}: the collective '{step}' failed on rank {self.rank} of "
                f"{self.world}: another rank died, raised, or did not reach it within the "
                f"process group's timeout ({type(e).__name__}: {e})") from e

    def _tensor(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a))

    def bcast(self, a, src, step):
        """``a`` (NumPy) of rank ``src`` into ``a`` on every rank (in place; returned)."""
        if self.world == 1:
            return a
        t = self.torch.from_numpy(a)          # a is C-contiguous: written in place
        self._run(step, lambda: self.dist.broadcast(t, src=self.dist.get_global_rank(
            self.group, src), group=self.group))
        if self.rank == src:
            self.sent += a.nbytes * (self.world - 1)
        else:
            self.received += a.nbytes
        return a

    def send(self, a, dst, step):
        """Blocking point-to-point send of the C-contiguous ``a`` to group rank ``dst``."""
        t = self.torch.from_numpy(a)
        self._run(step, lambda: self.dist.send(t, dst=self.dist.get_global_rank(
            self.group, dst), group=self.group))
        self.sent += a.nbytes

    def recv(self, a, src, step):
        """Blocking receive into ``a`` from group rank ``src``; returns ``a``."""
        t = self.torch.from_numpy(a)
        self._run(step, lambda: self.dist.recv(t, src=self.dist.get_global_rank(
            self.group, src), group=self.group))
        self.received += a.nbytes
        return a

    def allgather(self, a, step):
        """The list of every rank's ``a`` (same shape and dtype on every rank)."""
        if self.world == 1:
            return [a]
        t = self._tensor(a)
        parts = [self.torch.empty_like(t) for _ in range(self.world)]
        self._run(step, lambda: self.dist.all_gather(parts, t, group=self.group))
        self.sent += t.numel() * t.element_size() * (self.world - 1)
        self.received += t.numel() * t.element_size() * (self.world - 1)
        return [p.numpy() for p in parts]

    def allsum(self, a, step):
        """sum over ranks of ``a``, added in rank order: the same bits on every rank."""
        if self.world == 1:
            return a
        parts = self.allgather(np.asarray(a, dtype=np.float64), step)
        out = parts[0].copy()
        for p in parts[1:]:
            out += p
        return out

    def allgather_rows(self, local, counts, step):
        """Rows of every rank stacked in rank order: (sum counts, ...) from (counts[rank], ...)."""
        if self.world == 1:
            return local
        pad = max(counts)
        buf = np.zeros((pad,) + local.shape[1:], dtype=local.dtype)
        buf[:local.shape[0]] = local
        parts = self.allgather(buf, step)
        return np.concatenate([p[:c] for p, c in zip(parts, counts)])

    def agree(self, flag, step):
        """Rank 0's boolean, on every rank."""
        if self.world == 1:
            return bool(flag)
        return bool(self.bcast(np.array([1 if flag else 0], dtype=np.int64), 0, step)[0])

    def stats(self):
        return dict(bytes_sent=self.sent, bytes_received=self.received, collectives=self.calls)


def _sha256(a):
    a = np.ascontiguousarray(_arrays.to_numpy(a))
    return hashlib.sha256(str((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()[:20]


def _agree_on_arguments(comm, config, error, what, secret=None):
    """Every rank exchanges its configuration (and its own argument error, if any)
    before any other collective: a difference raises on every rank, the rank whose
    arguments were wrong raises its own error; identical errors raise everywhere."""
    # Errors first, on their own: a rank whose arguments are wrong has no config to
    # compare, and the others should read its message, not a list of missing keys.
    try:
        check_same_config({"argument_error": None if error is None else
                           f"{type(error).__name__}: {error}"}, comm.group, what)
    except ValueError as mismatch:
        if error is not None:
            raise error from mismatch
        raise
    if error is not None:
        raise error
    check_same_config(config, comm.group, what, secret=secret)


def _row_counts(comm, n_local):
    counts = comm.allgather(np.array([n_local], dtype=np.int64), "row counts")
    return [int(c[0]) for c in counts]


# ------------------------------------------------------------------------ the Gram

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
    _agree_on_arguments(comm, config, error, what, secret)

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


# --------------------------------------------------------------- the eigenvalue

def _orthonormal_block(Z, V, comm, fresh, step, first_pass=None):
    """Z (n_r, c) made orthonormal over all ranks and orthogonal to V (n_r, k):
    two passes of classical Gram-Schmidt against V (the first with the summed
    coefficients ``first_pass`` = V^T Z when the caller has them already), then
    Z (Z^T Z)^(-1/2) on the kept directions (eigenvalues of the Gram above
    (1e-10 |Z|)^2), twice; directions lost (an invariant subspace) are replaced by
    ``fresh(m)`` rows of new random vectors, treated the same way."""
    c = Z.shape[1]
    kept = np.empty((Z.shape[0], 0))
    for _ in range(4):
        scale = math.sqrt(max(float(np.max(np.diag(comm.allsum(Z.T @ Z, step)))), 0.0))
        basis = np.hstack([V, kept]) if kept.shape[1] else V
        for p in range(2):
            if basis.shape[1]:
                coeffs = first_pass if p == 0 and first_pass is not None else \
                    comm.allsum(basis.T @ Z, step)
                Z = Z - basis @ coeffs
        first_pass = None
        for rep in range(2):
            if Z.shape[1] == 0:
                break
            w, U = np.linalg.eigh(comm.allsum(Z.T @ Z, step))
            keep = w > (1e-10 * scale) ** 2 if rep == 0 else w > 0
            Z = Z @ (U[:, keep] / np.sqrt(w[keep]))
        kept = np.hstack([kept, Z])
        if kept.shape[1] >= c:
            return kept[:, :c]
        Z = fresh(c - kept.shape[1])
    raise np.linalg.LinAlgError(f"{comm.what}: could not extend the Krylov basis "
                                "(random vectors kept falling into it)")


def _smallest_ritz_pair(ab):
    """Smallest eigenpair of the symmetric band matrix in LAPACK's lower band storage
    ``ab`` (ab[d, j] = H[j + d, j]; O(k^2 band) instead of O(k^3) for a dense H).
    With full re-orthogonalisation H = V^T K V is block tridiagonal (bandwidth
    2 block - 1) up to rounding and to the deficiency tolerance of a restarted block,
    so its band gives the Ritz pair up to that; the residual that stops the iteration
    is computed from K V itself, whatever the truncation did."""
    from scipy.linalg import LinAlgError, eig_banded, solveh_banded
    k = ab.shape[1]
    ab = ab[:min(ab.shape[0], k)]
    theta = float(eig_banded(ab, lower=True, eigvals_only=True, select="i",
                             select_range=(0, 0), check_finite=False)[0])
    # The vector by inverse iteration on the band, shifted just below theta so that
    # H - shift I is positive definite (banded Cholesky, O(k band^2)); LAPACK's
    # vectors of a band matrix cost O(k^3) (the reduction's Q is formed).
    scale = max(float(np.abs(ab).max()), np.finfo(np.float64).tiny)
    delta = 1e-12 * scale
    y = np.ones(k) / math.sqrt(k)
    for _ in range(8):
        shifted = ab.copy()
        shifted[0] -= theta - delta
        try:
            for _ in range(3):
                y = solveh_banded(shifted, y, lower=True, check_finite=False)
                y /= np.linalg.norm(y)
            return theta, y
        except LinAlgError:
            delta *= 100.0
    w, S = eig_banded(ab, lower=True, select="i", select_range=(0, 0), check_finite=False)
    return float(w[0]), S[:, 0]


def _block_lanczos(apply_rows, comm, counts, *, block, tol, max_blocks, seed):
    """Smallest eigenpair of the symmetric K whose rows are sharded by ``counts``;
    ``apply_rows(Q)`` = this rank's rows of K times Q (n, c), float64.

    Block Lanczos on K with full re-orthogonalisation.  Every vector is sharded like
    K's rows; the start block is the rows [lo, hi) of an (n, block) standard normal
    matrix drawn from ``numpy.random.default_rng(seed)`` (the same matrix on every
    rank: a public start, linear algebra, not a privacy draw).  After each block the
    smallest Ritz pair (theta, u) of the projected matrix H = V^T K V is computed
    from its band (kept in band storage, (2 block) x k numbers, never k x k;
    identical on every rank: H is reduced in rank order) and the iteration stops
    when ||K u - theta u|| <= tol * knorm, knorm the largest Ritz value of K seen so
    far (<= ||K||_2), or when |theta| <= n eps knorm (K singular to working
    precision); the check runs after every block at first, then every ~steps/8
    blocks.  Rank 0's decision is broadcast.

    Returns (theta_rq, residual, u_rows, steps, converged): the Rayleigh quotient
    u^T K u of the unit Ritz vector, ||K u - theta_rq u||, this rank's rows of u.
    """
    rank, n = comm.rank, sum(counts)
    lo = sum(counts[:rank])
    n_r = counts[rank]
    b = min(block, n)
    rng = np.random.default_rng(seed)

    def fresh(m):
        return rng.standard_normal((n, m))[lo:lo + n_r]

    cap = min(n, max_blocks * b)
    band = 2 * b - 1
    V = np.empty((n_r, cap))
    AV = np.empty((n_r, cap))
    ab = np.zeros((band + 1, cap))        # H = V^T K V in lower band storage
    Q = _orthonormal_block(fresh(b), V[:, :0], comm, fresh, "start block")
    k, knorm, steps, converged, next_check = 0, 0.0, 0, False, 1
    eps = np.finfo(np.float64).eps
    while True:
        steps += 1
        c = Q.shape[1]
        V[:, k:k + c] = Q
        AQ = apply_rows(comm.allgather_rows(Q, counts, "Lanczos block"))
        AV[:, k:k + c] = AQ
        C = comm.allsum(V[:, :k + c].T @ AQ, "projection")   # H[:k + c, k:k + c]
        D = 0.5 * (C[k:] + C[k:].T)                          # the new diagonal block
        for p in range(c):                                   # row k + p of H, in the band
            row = k + p
            j0 = max(0, row - band)
            js = np.arange(j0, row + 1)
            ab[row - js, js] = np.concatenate([C[j0:k, p], D[max(0, j0 - k):p + 1, p]])
        knorm = max(knorm, float(np.linalg.eigvalsh(D)[-1]))
        k += c
        if steps >= next_check or k >= cap:
            # The Ritz pair and its residual every step at first, then every ~steps/8
            # steps (each check costs O(k^2 block) + O(n_r k) against O(n_r k block)
            # for the step itself): at most ~12 % more steps than checking always.
            next_check = steps + max(1, steps // 8)
            theta, y = _smallest_ritz_pair(ab[:, :k])
            R = AV[:, :k] @ y - theta * (V[:, :k] @ y)
            r = math.sqrt(float(comm.allsum(np.array([R @ R]), "residual")[0]))
            done = r <= tol * knorm or abs(theta) <= n * eps * knorm
            if comm.agree(done, "stop decision"):
                converged = True
                break
        if k >= cap:
            break
        c_next = min(b, cap - k)
        # C = V[:, :k]^T AQ (summed over ranks) is the first Gram-Schmidt pass's
        # coefficients for the next block.
        Q = _orthonormal_block(AQ[:, :c_next], V[:, :k], comm, fresh, "re-orthogonalisation",
                               first_pass=C[:, :c_next])
    u = V[:, :k] @ y
    u /= math.sqrt(float(comm.allsum(np.array([u @ u]), "norm")[0]))
    Ku = apply_rows(comm.allgather_rows(u[:, None], counts, "Rayleigh quotient")[:, 0:1])[:, 0]
    value = float(comm.allsum(np.array([u @ Ku]), "Rayleigh quotient")[0])
    res = Ku - value * u
    residual = math.sqrt(float(comm.allsum(np.array([res @ res]), "residual")[0]))
    # Rank 0's numbers, on every rank (identical already when every rank runs the
    # same LAPACK; this makes it so on heterogeneous machines too).
    value, residual = comm.bcast(np.array([value, residual]), 0, "result")
    return float(value), float(residual), u, steps, converged


def _row_product(K_rows):
    """Q (n, c) float64 -> K_rows @ Q in float64; float32 rows are promoted in chunks
    of about 2^22 entries, so no float64 copy of the rows is kept."""
    if K_rows.dtype == np.float64:
        return lambda Q: K_rows @ Q
    step = max(1, (1 << 22) // max(1, K_rows.shape[1]))

    def apply(Q):
        out = np.empty((K_rows.shape[0], Q.shape[1]))
        for i in range(0, K_rows.shape[0], step):
            out[i:i + step] = K_rows[i:i + step].astype(np.float64) @ Q
        return out
    return apply


def lambda_min(K_rows=None, *, x=None, weights=None, group=None, tol=1e-10, block=16,
               maxiter=None, seed=0, stats=None, **network):
    """Smallest eigenvalue of a row-sharded NTK Gram, in float64, the same on every rank.

    Either ``K_rows`` -- this rank's rows of a symmetric K, (n_r, n) float32/float64
    NumPy or torch CPU, the ranks' rows stacking in rank order to the n x n matrix
    (as :func:`ntk_gram` returns them) -- or ``x`` and ``weights`` (plus the keyword
    arguments of :func:`ntk_gram`: biases, activation, parameterization, replicated),
    whose sharded Gram is formed in float64 first, as ``ncdp_fast.ntk.lambda_min``
    does in one process.

    Solver: block Lanczos on K with full re-orthogonalisation (``block`` vectors per
    step, at most ``maxiter`` steps, default ceil(n / block): the whole space, where
    the Ritz value is exact); each step multiplies the rows by the all-gathered block
    (n x block numbers per rank) and sums (k x block) projections over the ranks.
    NTK spectra are dense at the bottom, so the Krylov dimension k it needs is a large
    fraction of n (measured: 1632 of 2000, 2592 of 4000 for a two-layer ReLU NTK, d =
    64, width 1024, x on the sphere); memory per rank is then 2 n_r k float64 (the
    basis and K times it, at most twice the float64 rows) and work O(n_r n k + n_r k^2)
    per rank.  Stopping rule: the Ritz residual ||K u - theta u|| <= tol * knorm
    (knorm: the largest Ritz value seen, a lower bound of ||K||_2), or |theta| <=
    n eps knorm (K singular to working precision).  Then some eigenvalue of K lies
    within ``residual`` of the returned value and lambda_min <= value (a Rayleigh
    quotient); with a gap delta to the next eigenvalue the error is at most
    residual^2 / delta.  Without convergence
    a RuntimeWarning says so and the value is an upper bound.  The start block is
    drawn from ``numpy.random.default_rng(seed)`` (public: linear algebra, not a
    privacy draw), identical on every rank; every reduction sums the ranks' parts
    in rank order and rank 0's result is broadcast, so all ranks return the same
    bits.  With W = 1 (no group) this is the same solver in one process.

    Returns ``ncdp_fast.ntk.EigResult`` (value, residual) with ``.vector`` this
    rank's rows of the unit eigenvector (float64, (n_r,)) and ``.method``
    "block-lanczos (W ranks)"; ``stats`` (a dict, optional) gets ``steps``,
    ``converged``, ``krylov_dim`` and the communication counts of the solver.
    """
    from ..ntk import EigResult
    group = resolve_group(group)
    what = "ncdp_fast.distributed.lambda_min"
    comm = _Comm(group, what)
    if (K_rows is None) == (x is None):
        raise ValueError("lambda_min: give either K_rows or x (with weights), not both or "
                         "neither")
    gram_stats = None
    if x is not None:
        if weights is None:
            raise ValueError("weights: required with x")
        # In float64, as the one-process lambda_min; what cannot be converted goes to
        # ntk_gram as it came, whose checks agree with the other ranks before raising.
        try:
            x = np.asarray(_arrays.to_host(x, "x"), dtype=np.float64)
            weights = [np.asarray(_arrays.to_host(w, f"weights[{l}]"), dtype=np.float64)
                       for l, w in enumerate(weights)]
            if network.get("biases") is not None:
                network["biases"] = [None if b is None else
                                     np.asarray(_arrays.to_host(b, "biases"), np.float64)
                                     for b in network["biases"]]
        except (TypeError, ValueError):
            pass
        gram_stats = {}
        K_rows = ntk_gram(x, weights, group=group, stats=gram_stats, **network)
    elif network:
        raise TypeError(f"lambda_min: {sorted(network)} only go with x and weights")
    error, config = None, {}
    try:
        if stats is not None and not isinstance(stats, dict):
            raise TypeError(f"stats: expected None or a dict, got {type(stats).__name__}")
        tol = check_positive(tol, "tol")
        block = check_pos_int(block, "block")
        seed = check_uint64(seed, "seed")
        if maxiter is not None:
            maxiter = check_pos_int(maxiter, "maxiter")
        K_rows = _arrays.to_host(K_rows, "K_rows")
        if K_rows.ndim != 2 or K_rows.dtype not in (np.float32, np.float64):
            raise ValueError(f"K_rows: expected a float32/float64 (n_r, n) block of rows, got "
                             f"shape {K_rows.shape} dtype {K_rows.dtype}")
        config = dict(n=K_rows.shape[1], dtype=K_rows.dtype.name, tol=tol, block=block,
                      maxiter=maxiter, seed=seed)
    except (TypeError, ValueError) as e:
        error = e
    _agree_on_arguments(comm, config, error, what)
    n = K_rows.shape[1]
    counts = _row_counts(comm, K_rows.shape[0])
    if sum(counts) != n:
        raise ValueError(f"K_rows: expected the ranks' rows to stack to a square matrix: "
                         f"{n} columns but rows {counts} (sum {sum(counts)}) on the "
                         f"{comm.world} ranks")
    if n == 0:
        raise ValueError("K_rows: expected n >= 1")
    b = min(block, n)
    max_blocks = maxiter or -(-n // b)
    K_rows = np.ascontiguousarray(K_rows)
    value, residual, u, steps, converged = _block_lanczos(
        _row_product(K_rows), comm, counts, block=b, tol=tol, max_blocks=max_blocks,
        seed=seed)
    if not converged:
        warnings.warn(f"{what}: block Lanczos stopped after {steps} blocks of {b} without "
                      f"reaching tol={tol:g}; the value is an upper bound (see the residual)",
                      RuntimeWarning, stacklevel=2)
    if stats is not None:
        stats.update(comm.stats(), steps=steps, converged=converged,
                     krylov_dim=min(steps * b, n))
        if gram_stats is not None:
            stats["gram"] = gram_stats
    return EigResult(value, residual, u, f"block-lanczos ({comm.world} ranks)")
