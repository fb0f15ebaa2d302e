"""Tied weights: one Parameter used by several layers (a language model's
``nn.Embedding`` tied to its output ``nn.Linear``) is one parameter of the
private gradient, sample i's gradient the sum over the uses.

Each layer's use of the weight, W of shape (V, D), is kept from its backward to
the step in the form its rule gave:

* :class:`PairUse` ``(a, g)``: a linear map's ``sum_t g_t a_t^T`` over its
  positions, ``a`` (B, T, D), ``g`` (B, T, V);
* :class:`IndexUse` ``(idx, h)``: an embedding's rows, ``h_s`` added at row
  ``idx_s``, ``idx`` (B, T') int64, ``h`` (B, T', D) (padding rows zeroed);
* a dense (B, V, D) per-sample gradient (any other rule's block).

:func:`combine` turns a weight's uses into one block.  With pairs and index
uses only it may give the ghost form: all pairs concatenated along positions
(A (T, D), G (T, V)) and all index uses ((idx, H), S their scatter),

    ||G^T A + S||^2 = ||G^T A||^2 + ||S||^2 + 2 sum_{t,s} G[t, idx_s] (A_t . H_s),

with ``||G^T A||^2 = sum_{t,s} (A_t . A_s)(G_t . G_s)`` and ``||S||^2`` from the
rows each sample touched: O(T^2 (V + D) + T T' D) per sample, nothing of size
V*D per sample.  The clipped sum needs only the per-sample factors: one GEMM
and one ``index_add``.  The dense form instead forms each sample's V*D
gradient; :func:`combine` takes the cheaper by the same flop count as the
linear rule's mixed choice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import _arrays
from .._cuda import clip as clip_ops   # device-agnostic torch routes (CPU tensors too)
from .._cuda._common import ieee_float32_matmul, ieee_float32_products
from .._cuda.gram import grams_f64
from .._cuda.gram import sample_bytes as gram_sample_bytes
from .._clip import GhostBlock
from .layer_rules import (_cat, _flat_positions, _lead, _rows_sq, embedding_rule, linear_rule,
                          scaled_rows)
from .layers import accumulation_dtype, rule_for

__all__ = ["PairUse", "IndexUse", "as_use", "combine", "ghost_cheaper", "layer_params",
           "layer_uses", "uses_by_weight", "combined"]

# Bytes of float64 copies one chunk of samples may hold while the norms are formed.
_CHUNK_BYTES = _arrays.CHUNK_BYTES


@dataclass
class PairUse:
    """``sum_t g[i, t] a[i, t]^T`` per sample: a (B, T, D), g (B, T, V)."""
    a: torch.Tensor
    g: torch.Tensor


@dataclass
class IndexUse:
    """Row ``idx[i, s]`` of sample i's gradient gets ``h[i, s]``: idx (B, T'),
    h (B, T', D)."""
    idx: torch.Tensor
    h: torch.Tensor


def as_use(module: nn.Module, calls, block, shape: tuple, batch: int, dtype: torch.dtype):
    """One layer's use of a tied weight of ``shape`` (V, D) from its rule's
    ``block`` (already in ``dtype``): a pair stays a pair, an ``nn.Embedding``
    with the built-in rule becomes its rows (from ``calls``, as the rule reads
    them), any other block its dense (B, V, D) per-sample gradient."""
    if isinstance(block, tuple):
        a, g, _ = block
        return PairUse(a, g)
    if isinstance(module, nn.Linear) and rule_for(module)[0] is linear_rule:
        # The rule formed the per-sample gradient (2 T^2 > V D); the tie is
        # priced over all its uses, so keep the pair (the dense form rebuilds it).
        return PairUse(_cat([_flat_positions(c.inputs[0], shape[1]) for c in calls]).to(dtype),
                       _cat([_flat_positions(c.grad, shape[0]) for c in calls]).to(dtype))
    if isinstance(block, torch.Tensor):
        return block.reshape(batch, *shape)
    rule = rule_for(module)[0]
    scale = getattr(rule, "output_scale", None)
    if isinstance(module, nn.Embedding) and (rule is embedding_rule or scale is not None):
        # Indices broadcast over the batch (position ids (1, T)): every sample
        # read the same rows.  A scaled embedding (y = E[idx] * s) adds its
        # output gradients times s, as its own rule does.
        idx = _cat([_batch_rows(_lead(c.inputs[0], 1), c.grad.shape[0]) for c in calls])
        h = _cat([_flat_positions(c.grad if scale is None else c.grad * scale(module), shape[1])
                  for c in calls]).to(dtype)
        if idx.shape[:2] != h.shape[:2]:
            raise ValueError(
                f"GhostClipper: tied nn.Embedding got indices of shape {tuple(idx.shape)} for "
                f"output gradients of {tuple(h.shape)}; expected one index per output row "
                "(batch first, or broadcast over the batch from a leading 1)")
        if module.padding_idx is not None:       # the padding row never gets a gradient
            h = h.masked_fill((idx == module.padding_idx).unsqueeze(-1), 0)
        return IndexUse(idx, h)
    # Another rule's ghost block only gives sums over samples: sample i's rows
    # are its clipped sum with factor 1 for i and 0 for the rest, exact (each
    # row is multiplied by 1.0 or dropped).  B calls.
    one = torch.eye(batch, dtype=torch.float64, device=block.sq_norms.device)
    rows = [torch.as_tensor(block.clipped_sum(one[i])).reshape(shape) for i in range(batch)]
    return torch.stack(rows).to(dtype) if rows else torch.zeros((0, *shape), dtype=dtype)


def layer_params(name: str, module: nn.Module, owner: dict) -> tuple[dict, dict]:
    """A layer's trainable parameters ``{relative name: Parameter}`` and, of
    those an earlier layer already holds, ``{relative name: that use's full
    name}``; ``owner`` (id -> (full name, a direct weight of a plain layer)) is
    updated with the new ones.  Only a ``weight`` outside
    ``nn.MultiheadAttention`` may be shared: the uses of anything else are not
    combined."""
    params, alias = {}, {}
    composite_layer = isinstance(module, nn.MultiheadAttention)
    own = module.named_parameters(recurse=composite_layer)
    for pname, p in own:
        full = f"{name}.{pname}" if name else pname
        if not p.requires_grad:
            continue
        plain = pname == "weight" and not composite_layer
        if id(p) in owner:
            first, first_plain = owner[id(p)]
            if not (plain and first_plain):
                raise ValueError(
                    f"GhostClipper: parameter {full!r} is shared with {first!r}; "
                    "expected only the `weight` of layers outside "
                    "nn.MultiheadAttention to be shared (an embedding tied to the "
                    "output Linear), got a shared bias or attention parameter. Tie "
                    "the weights only, or give each layer its own parameter")
            alias[pname] = first
        else:
            owner[id(p)] = (full, plain)
        params[pname] = p
    return params, alias


def layer_uses(tap, calls, blocks: list, batch: int, tied: set) -> list:
    """A layer's ``blocks`` [(names, block)] with each weight whose id is in
    ``tied`` as this layer's use of it (:func:`as_use`), kept to the step,
    where the uses are combined sample by sample before any norm (a norm per
    use would leave out the cross terms)."""
    out = []
    for names, block in blocks:
        p = tap.params[names[0]]
        if id(p) not in tied:
            out.append((names, block))
            continue
        out.append(((names[0],), as_use(tap.module, calls, block, tuple(p.shape), batch,
                                        accumulation_dtype(p.dtype))))
        if isinstance(block, tuple) and block[2]:
            out.append(((names[1],), block[1].sum(1)))
    return out


def uses_by_weight(taps, tied: set) -> dict:
    """{id of a tied weight: its uses this step, in layer order}."""
    uses: dict[int, list] = {}
    for tap in taps:
        for names, block in tap.blocks or ():
            if id(tap.params[names[0]]) in tied:
                uses.setdefault(id(tap.params[names[0]]), []).append(block)
    return uses


def combined(uses: dict, p, batch: int, gram32: bool = False):
    """The one block of tied weight ``p`` (:func:`combine` of its uses)."""
    return combine(uses[id(p)], tuple(p.shape), accumulation_dtype(p.dtype), batch, gram32)


def _batch_rows(idx: torch.Tensor, batch: int) -> torch.Tensor:
    return idx.expand(batch, -1) if idx.shape[0] == 1 else idx


def _split(uses):
    pairs = [u for u in uses if isinstance(u, PairUse)]
    index = [u for u in uses if isinstance(u, IndexUse)]
    dense = [u for u in uses if isinstance(u, torch.Tensor)]
    return pairs, index, dense


def ghost_cheaper(uses, shape: tuple) -> bool:
    """Whether the ghost form costs fewer multiply-adds per sample than the
    dense one: T_L^2 (V + D) + T_L T_E D + T_E D (Gram matrices, cross terms,
    rows) against T_L V D + V D + T_E D (forming each sample's gradient, its
    rows added, and reading it),
    T_L the pairs' positions and T_E the rows'.  A dense use forces the dense
    form (its cross terms with the others cost as much as forming them)."""
    pairs, index, dense = _split(uses)
    if dense:
        return False
    V, D = shape
    tl = sum(u.a.shape[1] for u in pairs)
    te = sum(u.idx.shape[1] for u in index)
    return tl * tl * (V + D) + tl * te * D + te * D <= tl * V * D + V * D + te * D


def combine(uses, shape: tuple, dtype: torch.dtype, batch: int, gram32: bool = False):
    """The block of a tied weight of ``shape`` from its ``uses``: a
    :class:`GhostBlock` (ghost form) when :func:`ghost_cheaper`, else the
    dense (B, *shape) sum of the uses' per-sample gradients.  ``gram32``
    (the clipper's ``gram_precision="float32"``): on a device the ghost
    form's pair Grams are float32 GEMMs with their rounding bound, the block
    keeping its float64 norms on request (``GhostBlock.float64_norms``)."""
    if len(shape) == 2 and ghost_cheaper(uses, shape):
        return _ghost(uses, shape, dtype, batch, gram32)
    total = None
    for u in uses:
        dense = _dense(u, shape, batch)
        total = dense if total is None else total + dense      # no stacked copy of all uses
    return total


def _dense(use, shape, batch):
    if isinstance(use, PairUse):
        # A convolution's pair is on im2col columns: its (B, out, in*k*k)
        # product is laid out as the weight, (B, out, in, k, k).
        with ieee_float32_products(use.a):
            return torch.bmm(use.g.transpose(1, 2), use.a).reshape(batch, *shape)
    if isinstance(use, IndexUse):
        V, D = shape
        sample = torch.arange(batch, device=use.idx.device).unsqueeze(1)
        out = use.h.new_zeros((batch * V, D))
        out.index_add_(0, (sample * V + use.idx).reshape(-1), use.h.reshape(-1, D))
        return out.reshape(batch, V, D)
    return use


def _ghost(uses, shape, dtype, batch, gram32=False) -> GhostBlock:
    pairs, index, dense = _split(uses)
    if dense:
        raise RuntimeError("tied: a dense use of a tied weight has no ghost form; "
                           "expected pairs and embedding rows only")
    V, D = shape
    a = _cat([u.a for u in pairs]) if pairs else None          # (B, T_L, D)
    g = _cat([u.g for u in pairs]) if pairs else None          # (B, T_L, V)
    idx = _cat([u.idx for u in index]) if index else None      # (B, T_E)
    h = _cat([u.h for u in index]) if index else None          # (B, T_E, D)
    tl = 0 if a is None else a.shape[1]
    te = 0 if idx is None else idx.shape[1]
    device = (a if a is not None else h).device
    # On a device the pairs' part goes to the linear layers' kernel family
    # (their Hadamard sum and spread in one pass, float32 Grams where asked).
    on_device = a is not None and _arrays.is_cuda_array(a)
    gram32 = gram32 and on_device and tl > 1 and clip_ops.gram32_applies(a, tl, D, V)

    # Each sample's ||a_i||^2 and ||g_i||^2 (the float64 Grams' traces): the
    # op decides the clipped GEMM's rebalancing from them in its one transfer,
    # as a linear pair's, instead of a scan of a and g every step (GPT-2's g
    # is (16, 128, 50257): a 412 MB read and, scaled, a 412 MB write).
    gemm_sizes = None
    if a is not None and on_device and not gram32:
        gemm_sizes = (torch.empty((batch, 2), dtype=torch.float64, device=device), tl, D, V)

    def norms(float32_grams):
        """(sq, spread) of the block; float32_grams: the pairs' Grams as
        float32 GEMMs with their rounding bound (docs/privacy.md)."""
        sq = torch.zeros(batch, dtype=torch.float64, device=device)
        # Rounding scale of the clip rule (reference.clip_bound): E bounds the
        # square root of the sum of |terms| of the squared norm (cross terms
        # included: |G[t, idx_s] (A_t . H_s)| <= |G_t| |A_t| |H_s|), and the
        # clipped sum adds T_L + T_E terms per sample (plus the two parts' sum).
        spread = torch.zeros(batch, dtype=torch.float64, device=device)
        # float64 copies of one chunk of samples at a time: the norms accumulate in
        # float64 as every layer's, without a float64 copy of the whole batch.
        # On a device the pairs' Grams hold no copy where the Gram kernel reads
        # a and g as they lie: GPT-2's head then runs in one chunk, its 16
        # samples' Grams one launch (it was four of 4 samples, 12 blocks each:
        # 10.5 ms on the H200, 2026-11-30).
        pairs_bytes = 8 * tl * (V + D)
        if a is not None and on_device and not float32_grams:
            # (and the float64 copy of a the cross terms read, with embedding rows)
            pairs_bytes = sum(gram_sample_bytes([a, g])[0]) + (8 * tl * D if te else 0)
        per_sample = pairs_bytes + 8 * (te * D + (tl + te) * (tl + te))
        for lo, hi in _arrays.sample_chunks(batch, per_sample, _CHUNK_BYTES):
            A = None
            if a is not None and float32_grams:
                with ieee_float32_matmul():
                    w = a[lo:hi] @ a[lo:hi].transpose(1, 2)
                    v = g[lo:hi] @ g[lo:hi].transpose(1, 2)
                clip_ops.linear_norms_from_grams(w, v, False, sq[lo:hi], True, spread[lo:hi],
                                                 None, 1, lengths=(D, V))
            elif a is not None:
                if on_device:
                    # The float64 Grams from the data dtype's rows (the Gram
                    # kernel for float32: no float64 copy of the (B, T, V) head
                    # gradient, GPT-2's 823 MB).
                    clip_ops.linear_norms_from_grams(
                        grams_f64([a[lo:hi]]), grams_f64([g[lo:hi]]), False, sq[lo:hi], True,
                        spread[lo:hi], None if gemm_sizes is None else gemm_sizes[0][lo:hi], 1)
                else:
                    A, G = a[lo:hi].double(), g[lo:hi].double()
                    sq[lo:hi] += (A @ A.transpose(1, 2)).mul_(G @ G.transpose(1, 2)).sum((1, 2))
                    spread[lo:hi] += (torch.linalg.vector_norm(A, dim=2)
                                      * torch.linalg.vector_norm(G, dim=2)).sum(1)
            if idx is not None:
                H = h[lo:hi].double()
                sq[lo:hi] += _rows_sq(idx[lo:hi], H, V)
                spread[lo:hi] += torch.linalg.vector_norm(H, dim=2).sum(1)
                if a is not None:
                    # G[t, idx_s]: the head's output gradient at the rows the
                    # sample read, gathered in the data dtype and upcast (exact).
                    at = g[lo:hi].gather(2, idx[lo:hi].unsqueeze(1).expand(-1, tl, -1)).double()
                    A = a[lo:hi].double() if A is None else A
                    sq[lo:hi] += 2 * (A @ H.transpose(1, 2)).mul_(at).sum((1, 2))
        return sq, spread

    sq, spread = norms(gram32)

    def clipped_sum(factors, masked=True, balance=True):
        # A dropped sample's data may be NaN (0 * NaN is NaN): its rows are
        # masked, unless the op says no row was dropped (``unmasked_sum``: it
        # read the factors with its counts; a copy of the (B, T, V) gradient
        # less, GPT-2's 412 MB).
        drop = (factors == 0).view(-1, 1, 1) if masked else None
        out = (torch.zeros if a is None else torch.empty)(shape, dtype=dtype, device=device)
        if a is not None:
            # The linear layers' clipped GEMM: the factor rounded once into the
            # narrower operand, powers of two moved where an operand would near
            # the denormals, TF32 off (before: g * factor in float32 under the
            # caller's TF32 setting).  ``balance``: the op's decision from
            # gemm_sizes (False: no sample could need a power moved); without
            # them, True: the GEMM scans a and g itself.
            clip_ops.clipped_gemm(a.masked_fill(drop, 0) if masked else a,
                                  g.masked_fill(drop, 0) if masked else g, factors, out,
                                  balance=balance)
        if idx is not None:
            rows = scaled_rows(h, factors, dtype, masked)
            out.index_add_(0, idx.reshape(-1), rows.reshape(-1, D))
        return out

    terms = V + D + (tl + te) ** 2 + te * D + 2 * (tl + te) + 4
    return GhostBlock(sq, clipped_sum, tuple(shape), terms, dtype=dtype, spread=spread,
                      seq_len=tl + te + 1,
                      float64_norms=(lambda: norms(False)) if gram32 else None,
                      unmasked_sum=lambda factors, balance=True: clipped_sum(
                          factors, masked=False, balance=balance),
                      gemm_sizes=gemm_sizes)

