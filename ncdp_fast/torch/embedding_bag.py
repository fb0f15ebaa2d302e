"""The book-keeping rule of ``nn.EmbeddingBag`` (``mode`` ``'sum'``, ``'mean'``
or ``'max'``; ``per_sample_weights``, ``padding_idx``, 2-D indices or flat
indices with ``offsets``, ``include_last_offset``), registered when this module
is imported (``ncdp_fast.torch`` imports it).  The options that couple the
samples are refused by name (``layers._embedding_problem``).

Each bag is a sample: its output row is ``y_b = sum_{j in b} w_j W[idx_j]``
(``w_j`` = 1, the per-sample weight, or 1/(the bag's non-padding count); 0 for
padding entries), so its gradient has the row ``c_bv g_b`` at each row v it
used, ``c_bv = sum_{j in b: idx_j = v} w_j``.  With K calls of the layer in one
forward (gradients ``g_kb``) the row is ``sum_k c_kbv g_kb`` and

    ||grad_b||^2 = sum_{k,k'} <g_kb, g_k'b> sum_v c_kbv c_k'bv

(K = 1: ``||g_b||^2 sum_v c_bv^2``): a (K, K) Gram of the output gradients
and one of the coefficients, O(N log N + B K^2 D) for N looked-up entries,
nothing of size V*D or N*D for the norms.  The coefficients come from one
sort of the (bag, row) keys, not from ``unique``, whose value-shaped result
would make a device wait for the host (issue 36).  The clipped sum adds one
row ``fl(f_b sum_k c_kbv g_kb)`` (formed in float64, rounded once) per
distinct (bag, row), so a sample's contribution to each weight entry is one
rounding of the value its squared norm was formed from.

``mode='max'``: feature d of bag b is ``W[m_bd, d]``, m_bd the row holding the
bag's maximum, so the gradient is ``g_bd`` at (m_bd, d) (nothing for a bag
with no entry but padding) and ``||grad_b||^2 = sum_d g_bd^2`` (K calls:
``sum_{k,k'} sum_d g_kbd g_k'bd [m_kbd = m_k'bd]``).  The rows m are the
forward's own op's choice, taken at the forward (``bag_call``: the same kernel
on the same weight, before any update could change the maxima).

Opacus 1.6's grad sampler covers flat indices with offsets only, and writes
``g_b`` (or ``g_b / n``) once into a row a bag uses twice; here a repeated
row counts as often as the bag uses it (the tests compare with per-sample
gradients of each bag alone).
"""
from __future__ import annotations

import torch
from torch import nn

from .._clip import GhostBlock
from .layer_rules import scaled_rows
from .layers import accumulation_dtype, check_embedding_options, register_layer

__all__ = ["embedding_bag_rule", "bag_call"]

_ARGUMENTS = ("input", "offsets", "per_sample_weights")
_MAX = 2        # torch.embedding_bag's code of mode='max'


def bag_call(module: nn.EmbeddingBag, args: tuple, kwargs: dict) -> tuple:
    """What the rule reads of one ``EmbeddingBag.forward`` call: (input,
    offsets, per_sample_weights), None where not given (a script may pass the
    last two by keyword, which a forward hook sees only with ``with_kwargs``;
    an unknown keyword is left to the forward, which raises on it), and in
    ``mode='max'`` also (B, D) int64 the row of each bag's maximum of each
    feature and (B,) int64 the bag's non-padding count, from the forward's own
    op on the same weight (a bag with none gets no gradient)."""
    out = list(args[:3]) + [None] * (3 - len(args[:3]))
    for k, v in kwargs.items():
        if k in _ARGUMENTS:
            out[_ARGUMENTS.index(k)] = v
    if module.mode != "max":
        return tuple(out)
    idx, offsets, _ = out
    if idx.dim() == 2:          # as F.embedding_bag: rows of L, no last offset
        L = idx.shape[1]
        offsets = torch.arange(idx.shape[0], device=idx.device, dtype=idx.dtype) * L
        idx, last = idx.reshape(-1), False
    else:
        last = module.include_last_offset
    with torch.no_grad():
        _, _, size, rows = torch.embedding_bag(module.weight, idx, offsets, False, _MAX, False,
                                               None, last, module.padding_idx)
    return (*out, rows, size)


def _entries(module: nn.EmbeddingBag, inputs: tuple, B: int):
    """One call's looked-up entries: (bag (n,) int64, row (n,) int64, w (n,)
    float64), w_j the entry's coefficient in its bag's output (0 for a
    padding entry and for entries after the last bag)."""
    idx, offsets, psw = (tuple(inputs) + (None, None, None))[:3]
    dev = idx.device
    if B == 0:      # no bag: no entry (the flat form's bag ids would index nothing)
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return none, none, torch.zeros(0, dtype=torch.float64, device=dev)
    if idx.dim() == 2:
        # (B, L): each row a bag; torch refuses offsets with 2-D input.
        L = idx.shape[1]
        row = idx.reshape(-1)
        bag = torch.arange(B, device=dev).unsqueeze(1).expand(B, L).reshape(-1)
        keep = torch.ones(row.shape, dtype=torch.bool, device=dev)
    else:
        # Flat indices: entry j is in bag b when offsets[b] <= j < offsets[b + 1]
        # (the last bag runs to the end, or to the extra last offset).  Past the
        # last offset searchsorted gives B: such entries are in no bag.
        row = idx
        bounds = offsets.to(torch.int64)
        bag = torch.searchsorted(bounds, torch.arange(row.numel(), device=dev),
                                 right=True) - 1
        keep = (bag >= 0) & (bag < B)
        bag = bag.clamp(0, max(B - 1, 0))
    row = row.to(torch.int64)
    if module.padding_idx is not None:          # excluded from the bag (and its count)
        keep = keep & (row != module.padding_idx)
    kept = keep.to(torch.float64)
    if module.mode == "mean":
        count = torch.zeros(B, dtype=torch.float64, device=dev).index_add_(0, bag, kept)
        w = kept / count.clamp(min=1.0)[bag]
    elif psw is not None:
        w = psw.reshape(-1).to(torch.float64) * kept
    else:
        w = kept
    return bag, row, w


@register_layer(nn.EmbeddingBag)
def embedding_bag_rule(module: nn.EmbeddingBag, calls, trainable):
    """Bags, one a sample (module docstring): in ``mode='sum'``/``'mean'``
    norms from the (K, K) Grams of the output gradients and of each (bag,
    row)'s coefficients, float64, clipped sum one index_add of one row per
    distinct (bag, row); in ``mode='max'`` :func:`_max_block`."""
    if "weight" not in trainable:
        return []
    check_embedding_options(module)
    V, D = module.weight.shape
    dtype = accumulation_dtype(module.weight.dtype)
    B, K = calls[0].grad.shape[0], len(calls)
    dev = calls[0].grad.device
    if any((len(c.inputs) == 5) != (module.mode == "max") for c in calls):
        # The forward's own op ran in another mode than the rule would read.
        raise ValueError(f"nn.EmbeddingBag: mode={module.mode!r} now, but the layer ran "
                         "forward in another mode in this step; change the mode between steps")
    # The indices, offsets and weights the sums read at the step (a change in
    # place after the backward is refused, GhostBlock.reads).
    reads = tuple(x for c in calls for x in c.inputs[:3] if isinstance(x, torch.Tensor))
    if module.mode == "max":
        return [(("weight",), _max_block(calls, B, K, V, D, dtype, reads))]
    if K == 1:      # one call (the usual case): no call index, no (K, K) Grams
        bag, row, w = _entries(module, calls[0].inputs, B)
        key = bag * V + row
    else:
        keys, weights, which = [], [], []
        for k, c in enumerate(calls):
            bag, row, w = _entries(module, c.inputs, B)
            keys.append(bag * V + row)
            weights.append(w)
            which.append(torch.full_like(bag, k))
        key, w, which = torch.cat(keys), torch.cat(weights), torch.cat(which)
    N = key.numel()
    # Runs of equal (bag, row) keys after one sort; run r's coefficients
    # coef[r, k] (K = 1: coef[r]) and key; the N - (number of runs) unused
    # slots keep coefficient 0 (and key 0), so every shape is static (no host
    # wait).
    sk, perm = torch.sort(key)
    start = torch.ones(N, dtype=torch.int64, device=dev)
    start[1:] = (sk[1:] != sk[:-1]).to(torch.int64)
    run = torch.cumsum(start, 0) - 1
    run_key = torch.zeros(N, dtype=torch.int64, device=dev).scatter_(0, run, sk)
    run_bag = torch.div(run_key, V, rounding_mode="floor")
    run_row = run_key - run_bag * V
    # Roundings in one sample's squared norm: D in each Gram entry of g, up to
    # N in a coefficient and in its Gram, the K^2 products' sum, the mean's
    # division.  With K = 1 every term is >= 0 (a relative error); with K > 1
    # terms may cancel, so the spread E = sum_{runs, k} |c| ||g_k|| of the
    # terms bounds the absolute error, and the float64 sum of K terms a row.
    terms = D + 2 * N + K * K + 2
    spread = None
    if K == 1:
        # ||g_b||^2 sum_v c_bv^2: no call index, stack, outer products or
        # batched GEMM (a mean bag and a linear head's step: 75 aten operators
        # against 87 with the K-call form)
        coef = torch.zeros(N, dtype=torch.float64, device=dev).index_add_(0, run, w[perm])
        g1 = calls[0].grad.reshape(B, D)
        c2 = torch.zeros(B, dtype=torch.float64, device=dev).index_add_(0, run_bag, coef * coef)
        sq = g1.to(torch.float64).square().sum(1) * c2
    else:
        coef = torch.zeros((N, K), dtype=torch.float64, device=dev)
        coef.index_put_((run, which[perm]), w[perm], accumulate=True)
        gs = torch.stack([c.grad.reshape(B, D) for c in calls], 1)      # (B, K, D)
        g64 = gs.to(torch.float64)
        M = torch.zeros((B, K, K), dtype=torch.float64, device=dev)
        M.index_add_(0, run_bag, coef.unsqueeze(2) * coef.unsqueeze(1))
        sq = (torch.bmm(g64, g64.transpose(1, 2)) * M).sum((1, 2))
        A = torch.zeros((B, K), dtype=torch.float64, device=dev).index_add_(0, run_bag, coef.abs())
        spread = (A * torch.linalg.vector_norm(g64, dim=2)).sum(1)

    def clipped_sum(factors, masked=True):
        out = torch.zeros((V, D), dtype=dtype, device=dev)
        if N == 0 or B == 0:
            return out
        if K == 1:
            scale = coef * factors[run_bag]                             # (N,) float64
            rows = scaled_rows(g1[run_bag].unsqueeze(1), scale, dtype, masked).reshape(N, D)
        else:
            scale = coef * factors[run_bag].unsqueeze(1)               # (N, K) float64
            rows = torch.einsum("nk,nkd->nd", scale, g64[run_bag]).to(dtype)
            if masked:      # 0 * NaN of a dropped sample is NaN: exact zeros
                rows.masked_fill_((scale == 0).all(1).unsqueeze(1), 0.0)
        # Unused slots (key 0: row 0) add rows of exact zeros.
        return out.index_add_(0, run_row, rows)
    return [(("weight",), GhostBlock(sq, clipped_sum, (V, D), terms, dtype=dtype,
                                     spread=spread, seq_len=K, reads=reads,
                                     unmasked_sum=lambda f: clipped_sum(f, masked=False)))]


def _max_block(calls, B: int, K: int, V: int, D: int, dtype, reads: tuple) -> GhostBlock:
    """``mode='max'``: each call's gradient row g_kb lands feature by feature
    at the rows of the bag's maxima (``bag_call``); squared norms in float64
    (K > 1: features of two calls landing in one weight entry add first),
    clipped sum one index_add of fl(f_b g_kbd) into the flattened weight."""
    rows = torch.stack([c.inputs[3].to(torch.int64) for c in calls], 1)          # (B, K, D)
    empty = torch.stack([c.inputs[4] == 0 for c in calls], 1).unsqueeze(2)       # (B, K, 1)
    gs = torch.stack([c.grad.reshape(B, D) for c in calls], 1)                  # (B, K, D)
    g64 = gs.to(torch.float64).masked_fill(empty, 0.0)
    if K == 1:
        sq = g64.square().sum((1, 2))
        spread = None
    else:
        same = rows.unsqueeze(2) == rows.unsqueeze(1)                            # (B, K, K, D)
        sq = (g64.unsqueeze(2) * g64.unsqueeze(1) * same).sum((1, 2, 3))
        # Terms that may cancel, and up to K adds into one entry in the data
        # dtype: the spread E = sum_k ||g_k|| bounds both.
        spread = torch.linalg.vector_norm(g64, dim=2).sum(1)
    cells = (rows * D + torch.arange(D, device=rows.device)).reshape(-1)       # into (V*D,)

    def clipped_sum(factors, masked=True):
        vals = scaled_rows(gs, factors, dtype, masked)                          # (B, K, D)
        # A bag with no entry but padding adds nothing, dropped rows or not
        # (its maxima's rows are 0, not rows it used).
        vals.masked_fill_(empty, 0.0)
        out = torch.zeros(V * D, dtype=dtype, device=gs.device)
        return out.index_add_(0, cells, vals.reshape(-1)).reshape(V, D)
    return GhostBlock(sq, clipped_sum, (V, D), D * K * K + 2, dtype=dtype, spread=spread,
                      seq_len=K, reads=reads, unmasked_sum=lambda f: clipped_sum(f, masked=False))
