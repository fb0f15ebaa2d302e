"""Fused per-sample clipping with noise on CUDA: the signatures of ``_numba.clip``."""
from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from .. import _arrays, _balance
from ..reference.clip import GRAM32_MAX_LENGTH
from ._common import (dtype_code, ieee_float32_matmul, ieee_float32_matmul_held, native,
                      opt_ptr, ptr, stream, torch_dtype_code, workspace)
from .gram import grams_f64
from .gram import plan as gram_plan
from .gram import sample_bytes as gram_sample_bytes
# The finishing step of the layered clip's sums (ghost blocks, linear pairs, joined dense
# blocks), as _numba.clip.
from .rng import finish_gaussian_segments

_F64 = np.dtype(np.float64)


def row_sq_norms(g, sq, accumulate):
    B, p = g.shape
    native(g).launch_row_sq_norms(ptr(g), B, p, dtype_code(g), ptr(sq), bool(accumulate), stream(g))


def linear_norms_from_grams(w, v, bias, sq, accumulate, spread, sizes, layers,
                            shared_w=False, lengths=None):
    # sq[b] (=|+=) sum_l sum (W_i + bias) o V_i, spread[b] += the diagonals'
    # sum_t sqrt(V_tt) (sqrt(W_tt) + bias), sizes[i] = (tr W_i, tr V_i) for
    # i = l * B + b; w (B or layers * B, T, T: shared_w), v (layers * B, T, T)
    # C-contiguous, float64, or float32 GEMMs of dot lengths ``lengths`` = (d,
    # K), whose norms and spreads are then upper bounds; sizes rows contiguous
    # (layers * B, 2) (csrc/clip/clip_noise.h).
    B, T = sq.shape[0], v.shape[1]
    C = native(sq)
    nbytes = C.linear_norms_from_grams_workspace_bytes(B, int(layers), T)
    ws, ws_ptr = workspace(sq, nbytes)
    w_length, v_length = (0, 0) if lengths is None else (int(lengths[0]), int(lengths[1]))
    C.launch_linear_norms_from_grams(ptr(w), ptr(v), B, int(layers), T, bool(bias),
                                     bool(shared_w), dtype_code(v), w_length, v_length, ptr(sq),
                                     bool(accumulate), opt_ptr(spread), opt_ptr(sizes), ws_ptr,
                                     nbytes, stream(sq))


def clip_factor_groups(sq, spread, rules, unit, out, stride, scale=1.0, weights=None):
    # The rule of reference.clip_factors, in the kernel (clip/clip_rule.cuh),
    # on scale^2 sq and scale spread, each group g of rows (sq[g]) on its own
    # rule, rules[g] = (max_norm, terms, t_max), its factors at out[g stride:
    # g stride + B] and norms after them; weights = factors scale where given.
    # sq, spread (or None), weights (or None): (G, B) float64 C-contiguous;
    # out: float64 contiguous.  One launch a 128 groups (the launcher's table).
    G, B = sq.shape
    native(sq).launch_clip_factor_groups(
        ptr(sq), opt_ptr(spread), G, B, [float(c) for c, _, _ in rules],
        [int(t) for _, t, _ in rules], [int(T) for _, _, T in rules], float(unit), ptr(out),
        int(stride), stream(sq), scale=float(scale), weights=opt_ptr(weights))


# The dense op's rows in one chunk (0), not in chunks of half the L2 (-1): the
# chunked form reads the gradients from DRAM once but launches 3 kernels a
# chunk, and bench/dense_traffic.py predicts it slower wherever it chunks (1.39
# against 0.88 ms at (1024, 409600) float32 at 5 us a launch; about even at
# 2 us).  bench_clip_dense times both on a GPU ("ncdp_chunked"), which decides.
DENSE_L2_BYTES = 0
# The dense op's one-pass form (csrc/clip/dense_one_pass.cu: one launch, each
# row read from DRAM once, its second read from the L2) is off (0): the H200
# measured it at 1.662 ms against 0.995 ms for the two-pass form at (1024,
# 409600) float32 (2026-11-30).  bench_clip_dense keeps timing it
# ("ncdp_one_pass", -1: as many blocks as the device holds).
DENSE_ONE_PASS_BLOCKS = 0


def clip_noise_rows(g, max_norm, noise_std, inv_denom, seed, offset, out, norms, factors):
    # ``factors`` is unused: the fused launcher keeps them in its workspace.
    B, p = g.shape
    dt = dtype_code(g)
    C = native(g)
    nbytes = C.clip_noise_rows_workspace_bytes(B, p, dt)
    ws, ws_ptr = workspace(g, nbytes)
    # The one-pass form sizes its row blocks by the device's L2 (-1); the
    # two-pass form's 0 is "one chunk", which would give it rows of one.
    C.launch_clip_noise_rows(ptr(g), B, p, dt, float(max_norm), float(noise_std),
                              float(inv_denom), int(seed), int(offset), ptr(out), ptr(norms),
                              ws_ptr, nbytes, stream(g),
                              l2_bytes=-1 if DENSE_ONE_PASS_BLOCKS else DENSE_L2_BYTES,
                              one_pass_blocks=DENSE_ONE_PASS_BLOCKS)


def weighted_row_sum_noise(g, factors, noise_std, inv_denom, seed, offset, out):
    # out in g's dtype, or float64 (the sum before its finish: the clip op's
    # joined dense blocks, finished with the other blocks' in one launch).
    B, p = g.shape
    dt = dtype_code(g)
    C = native(g)
    nbytes = C.weighted_row_sum_workspace_bytes(B, p, dt)
    ws, ws_ptr = workspace(g, nbytes)
    C.launch_weighted_row_sum_noise(ptr(g), B, p, dt, ptr(factors), float(noise_std),
                                     float(inv_denom), int(seed), int(offset), ptr(out),
                                     ws_ptr, nbytes, stream(g), dtype_code(out))


# Float64 temporaries of one GEMM chunk, in bytes: bounds the extra memory of
# the norms whatever the batch (a GPT-2 head's (B, T, 50257) gradient would
# otherwise be copied to float64 whole).
GEMM_CHUNK_BYTES = _arrays.CHUNK_BYTES
# Layers of one shape stack their float64 copies while these fit in this many
# bytes: fewer launches, bounded memory.  128 MiB: at BERT-base's shapes (B 32,
# T 128) two (768, 768) layers (59 MB each) stack, under the 134 MB a (768,
# 3072) layer holds alone, so the norm phase's largest temporary does not grow
# (the memory goal is 1.1x the non-private peak, 2486 MB on the H200).
GROUP_CHUNK_BYTES = 128 << 20
# On the Gram kernel's route (no float64 copies) a layer holds its Grams, 8 MB
# at BERT-base's shapes, and a transposed part's row-major copy (its key
# gradient, 12.6 MB): 32 MiB keep the norm phase's largest temporary within
# 4 MiB of where it was when each layer ran alone (an attention block's
# shared run, 28 MiB), for BERT-base's peak is in that phase by our count
# (1.11x the non-private peak on the H200, 2026-11-30), while its (768, 3072)
# layers stack four a launch.
GRAM_GROUP_CHUNK_BYTES = 32 << 20


def linear_sq_norms(a, g, bias, sq, accumulate, spread=None, sizes=None, gram32=False):
    """sq[i] (=|+=) ||g_i^T a_i||_F^2 (+ ||sum_t g_it||^2 with a bias), float64;
    with ``spread``, also spread[i] += sum_t ||g_it|| (||a_it|| + [bias]), the
    scale of a sequence block's rounding (reference.linear_spread; 0 at T = 1);
    with ``sizes``, also sizes[i] = (||a_i||_F^2, ||g_i||_F^2), from which the
    clip op decides whether the clipped sum must rebalance (``_balance``).

    a: (B, T, d), g: (B, T, K) device arrays (torch or CuPy); sq, spread: (B,)
    float64; sizes: (B, 2) float64.
    The work is matrix products, so it goes to the vendor's batched GEMM
    (issue 36: the hand-written kernel, one block a sample on CUDA cores, was
    76% of a BERT step on the H200): the Gram route sums (a_t.a_s + [bias])
    (g_t.g_s) over t, s from A_i A_i^T and G_i G_i^T; the direct route forms
    G_i^T A_i (K x d).  The route is the numba twin's (Gram when 2 T^2 <= K d).
    Both in float64 -- a and g upcast exactly, FP64 GEMMs (FP64 tensor cores
    on Hopper; TF32 never applies to float64) -- so the norms stay within the
    rounding the clip rule's ``terms`` allows for either route
    (reference.linear_terms).  The spread and the sizes come from the same
    float64 copies (the Gram route's diagonals are the positions' squared
    norms): a separate pass would upcast a and g again (0.56 against 0.15 ms a
    BERT-base layer for the spread by the GPU model of bench/report.py).

    ``gram32`` (the clip ops' ``gram_precision="float32"``): float32 data on
    the Gram route forms its Grams as float32 GEMMs (TF32 off) instead, with
    no float64 copies; sq and spread are then the upper bounds of
    reference.linear_norms_from_grams(lengths=(d, K)) (docs/privacy.md), and
    a zero size no longer proves a zero operand.  Returns whether it did.
    """
    B, T, d = a.shape
    K = g.shape[2]
    if T == 1:      # one position: nothing to spread (reference.linear_spread is 0)
        _rank1_sq_norms(a, g, bias, sq, accumulate, sizes)
        return False
    if gram32 and gram32_applies(a, T, d, K):
        for lo, hi in _arrays.sample_chunks(B, 2 * 4 * T * T, GEMM_CHUNK_BYTES):
            _gram32_rows([a[lo:hi]], [g[lo:hi]], False, bias, sq[lo:hi],
                         None if spread is None else spread[lo:hi],
                         None if sizes is None else sizes[lo:hi], accumulate)
        return True
    gram = 2 * T * T <= K * d
    per_sample = (sum(gram_sample_bytes([a, g])[0]) if gram
                  else _norm_bytes(T, d, K, spread is not None or sizes is not None))
    for lo, hi in _arrays.sample_chunks(B, per_sample, GEMM_CHUNK_BYTES):
        spread_c = None if spread is None else spread[lo:hi]
        sizes_c = None if sizes is None else sizes[lo:hi]
        if gram:
            linear_norms_from_grams(grams_f64([a[lo:hi]]), grams_f64([g[lo:hi]]), bias,
                                    sq[lo:hi], accumulate, spread_c, sizes_c, 1)
        else:
            _norm_rows(_arrays.as_float64(a[lo:hi]), _arrays.as_float64(g[lo:hi]), bias,
                       sq[lo:hi], accumulate, spread_c, sizes_c, 1)
    return False


def gram32_applies(a, T, d, K):
    """Whether ``gram32`` changes this layer's route: float32 data on the Gram
    route, dot lengths within the float32 model's (reference.gram32_rounding)."""
    return (_arrays.numpy_dtype(a) == np.float32 and 2 * T * T <= K * d
            and max(d, K) <= GRAM32_MAX_LENGTH)


def linear_sq_norms_group(a_list, g_list, bias, sq, spread, sizes, gram32=False,
                          accumulate=True, rows=False):
    """linear_sq_norms for L layers of one shape: sq (+= with ``accumulate``,
    else =: the step's first norms, no zeroed buffer) the sum of the layers'
    squared norms, spread += each one's (T > 1, where given), sizes[l] =
    layer l's operands' squared norms.  ``rows`` (per-layer clipping, each
    layer its own factor): sq and spread (L, B) C-contiguous, layer l's norms
    into row l (=, ``accumulate`` ignored) and its spread added to row l; no
    input's Gram is shared (the stacked samples are the layers' rows).

    a_list: L arrays (B, T, d), g_list: L arrays (B, T, K) (torch or CuPy, one
    device); sq, spread: (B,) float64; sizes: (L, B, 2) float64, contiguous.
    The layers' float64 copies are stacked along the batch, as many as fit
    GROUP_CHUNK_BYTES (else each layer runs alone), so one batched GEMM and
    one reduction serve several: a BERT-base step's 72 linear layers are three
    shapes, and each layer's own call costs some 17 launches (bench/report.py's
    model charges 5 us a launch).  The values are each layer's own call's, up
    to the order of float64 additions across layers.  ``gram32``: as
    linear_sq_norms (the layers stacked in float32, twice as many a chunk);
    returns whether the float32 route ran."""
    L = len(a_list)
    B, T, d = a_list[0].shape
    K = g_list[0].shape[2]
    gram32 = gram32 and gram32_applies(a_list[0], T, d, K)
    alone = T == 1 or L == 1 or B == 0
    if not alone:
        # The chunks' sizes only where layers may share a chunk (a lone
        # layer's plan is its own call's: host time, issue 36).
        a_bytes, g_bytes, stack, budget, (a_route, g_route) = _layer_bytes(a_list, g_list, gram32)
        alone = 2 * min(a_bytes[l] + g_bytes[l] for l in range(L)) > budget
    if alone:
        used = False
        for l in range(L):
            used |= linear_sq_norms(a_list[l], g_list[l], bias, sq[l] if rows else sq,
                                    (accumulate or l > 0) and not rows,
                                    None if T == 1 or spread is None else
                                    spread[l] if rows else spread, sizes[l], gram32)
        return used
    # Rows: a chunk's stacked samples are its layers' rows, one layer of n B
    # samples whose norms land in the chunk's rows of sq as they lie.
    for l0, l1, shared in _group_chunks(a_list, a_bytes, g_bytes, stack and not rows, budget):
        n = l1 - l0
        acc, layers = (False, 1) if rows else (accumulate or l0 > 0, n)
        sq_c = sq[l0:l1].reshape(n * B) if rows else sq
        spread_c = spread[l0:l1].reshape(n * B) if rows and spread is not None else spread
        if gram32:
            _gram32_rows(a_list[l0:l1], g_list[l0:l1], shared, bias, sq_c, spread_c,
                         sizes[l0:l1].reshape(n * B, 2), acc, layers)
        elif 2 * T * T <= K * d:
            # A shared run (only on the Gram route: q, k and v of an attention
            # block) forms its one input's Gram once: n - 1 products fewer.
            a_to = l0 + 1 if shared else l1
            linear_norms_from_grams(grams_f64(a_list[l0:a_to], _part(a_route, l0, a_to)),
                                    grams_f64(g_list[l0:l1], _part(g_route, l0, l1)), bias,
                                    sq_c, acc, spread_c, sizes[l0:l1].reshape(n * B, 2), layers,
                                    shared_w=shared)
        else:
            _norm_rows(_arrays.cat_float64(a_list[l0:l1]), _arrays.cat_float64(g_list[l0:l1]),
                       bias, sq_c, acc, spread_c, sizes[l0:l1].reshape(n * B, 2), layers)
    return gram32


def _gram32_rows(a_list, g_list, shared, bias, sq, spread, sizes, accumulate=True, layers=None):
    """The float32 route of a run of layers, as the float64 one without its
    upcasts: the layers' operands stacked along the batch in float32 (the
    input once when they share it), two batched GEMMs, then
    linear_norms_from_grams' upper bounds; sq (=|+=) and spread (+=) summed
    over the layers (``layers`` None), or over 1: a norm a stacked sample."""
    n, (B, T, d), K = len(a_list), a_list[0].shape, g_list[0].shape[2]
    _refuse_cupy_tf32(a_list[0])
    a = a_list[0] if shared or n == 1 else _arrays.cat_rows(a_list)
    g = g_list[0] if n == 1 else _arrays.cat_rows(g_list)
    with ieee_float32_matmul():
        w = _arrays.bmm(a, a.swapaxes(1, 2))
        v = _arrays.bmm(g, g.swapaxes(1, 2))
    linear_norms_from_grams(w, v, bias, sq, accumulate, spread, sizes,
                            n if layers is None else layers, shared_w=shared and n > 1,
                            lengths=(d, K))


def _part(route, lo, hi):
    """The Gram plan (gram.plan) of parts lo..hi from the plan of them all."""
    return None if route is None else route[lo:hi]


def _layer_bytes(a_list, g_list, gram32):
    """(a_bytes, g_bytes, stack, budget, routes): each layer's temporaries in bytes, its
    input's and its output gradient's (a whole layer's in a_bytes, g_bytes 0,
    off the Gram route), whether layers of one input may share its Gram (the
    Gram route only), and the bytes a chunk may hold.  The float64 Gram route
    holds each Gram (8 T^2 a sample) and, where the kernel does not read a
    part as it lies, that part's copy (gram.sample_bytes: a float64 one, or a
    row-major float32 one of a transposed part for the kernel; the kernel's
    route has its own budget, GRAM_GROUP_CHUNK_BYTES); the float32 route its
    stacked float32 operands and Grams; the direct route its float64 copies
    and K x d matrices (_norm_bytes); routes: the Gram route's plans of the
    inputs and of the output gradients (gram.plan; (None, None) elsewhere),
    for grams_f64 to take as they are."""
    B, T, d = a_list[0].shape
    K = g_list[0].shape[2]
    L = len(a_list)
    if 2 * T * T > K * d:
        return [B * _norm_bytes(T, d, K, True)] * L, [0] * L, False, GROUP_CHUNK_BYTES, \
            (None, None)
    if gram32:
        return ([4 * B * (T * d + T * T)] * L, [4 * B * (T * K + T * T)] * L, True,
                GROUP_CHUNK_BYTES, (None, None))
    routes = gram_plan(a_list), gram_plan(g_list)
    a_sizes, kernel = gram_sample_bytes(a_list, routes[0])
    g_sizes, _ = gram_sample_bytes(g_list, routes[1])
    return ([B * n for n in a_sizes], [B * n for n in g_sizes], True,
            GRAM_GROUP_CHUNK_BYTES if kernel else GROUP_CHUNK_BYTES, routes)


def _group_chunks(a_list, a_bytes, g_bytes, stack, budget):
    """(l0, l1, shared) runs of consecutive layers whose temporaries (each
    layer's a_bytes + g_bytes, a shared run's input once: _layer_bytes) fit
    ``budget``: on the Gram route (``stack``), layers that read one
    input (the same elements in the same layout) share its copy and Grams
    (shared); other layers stack along the batch, each with its own."""
    L = len(a_list)

    def shares(m, l):
        return stack and _arrays.same_view(a_list[m], a_list[l])

    chunks, l = [], 0
    while l < L:
        m, held = l + 1, a_bytes[l] + g_bytes[l]
        while m < L and shares(m, l) and held + g_bytes[m] <= budget:
            held += g_bytes[m]
            m += 1
        if m - l > 1:
            chunks.append((l, m, True))
            l = m
            continue
        while (m < L and held + a_bytes[m] + g_bytes[m] <= budget
               and not (m + 1 < L and shares(m + 1, m))):
            held += a_bytes[m] + g_bytes[m]
            m += 1
        chunks.append((l, m, False))
        l = m
    return chunks


def _norm_bytes(T, d, K, extras):
    """Float64 bytes a sample's norms hold at once on the direct route (2 T^2 >
    K d: copies, the K x d matrix, and the squares when a spread or sizes are
    formed); the Gram route's are gram.sample_bytes'."""
    return 8 * (T * (d + K) + K * d) + (8 * T * max(d, K) if extras else 0)


def _norm_rows(a64, g64, bias, sq, accumulate, spread, sizes, layers):
    """The direct route's norms (2 T^2 > K d) of ``layers`` layers' samples
    stacked along the batch, from float64 (layers * B, T, d) and (layers * B,
    T, K) copies: per sample b of sq (B,), over the layers in order, sq[b]
    (=|+=) ||g_i^T a_i||_F^2 (+ the bias's), spread[b] += sum_t ||g_it||
    (||a_it|| + [bias]) (where spread is given), sizes[i] (layers * B, 2) =
    (||a_i||^2, ||g_i||^2) where given; i = l * B + b.  (The Gram route is
    grams_f64 and linear_norms_from_grams.)"""
    B = sq.shape[0]
    if spread is not None or sizes is not None:
        sp = _spread_sizes((a64 * a64).sum(axis=2), (g64 * g64).sum(axis=2), bias,
                           spread is not None, sizes)
        if sp is not None:
            spread += sp.reshape(layers, B).sum(axis=0)
    w = _arrays.bmm(g64.swapaxes(1, 2), a64)
    w *= w
    e = w.sum(axis=(1, 2))
    if bias:
        s = g64.sum(axis=1)
        e += (s * s).sum(axis=1)
    e = e.reshape(layers, B).sum(axis=0)
    if accumulate:
        sq += e
    else:
        sq[...] = e


def _spread_sizes(sa, sg, bias, want_spread, sizes):
    """sum_t sqrt(sg_t) (sqrt(sa_t) + [bias]) per row (None unless
    ``want_spread``), and sizes (n, 2) = (sum_t sa_t, sum_t sg_t) where given,
    from the positions' float64 squared norms sa, sg: (n, T)."""
    if sizes is not None:       # reduced into the strided columns: no temporaries, no copies
        xp = _arrays.module_of(sizes)
        xp.sum(sa, 1, out=sizes[:, 0])
        xp.sum(sg, 1, out=sizes[:, 1])
    if not want_spread:
        return None
    return (sg ** 0.5 * (sa ** 0.5 + (1.0 if bias else 0.0))).sum(axis=1)


def _rank1_sq_norms(a, g, bias, sq, accumulate, sizes):
    """linear_sq_norms at T = 1, the numba twin's rank-1 case: ||g_i a_i^T||_F^2
    = ||a_i||^2 ||g_i||^2, plus ||g_i||^2 with a bias, and sizes[i] =
    (||a_i||^2, ||g_i||^2): one launch of the rank-1 kernel (float64 sums of
    the data dtype's squares, exact products, no float64 copy; the product
    and the bias term rounded one at a time).  Before, two row-norm launches
    and the element-wise ops that combined them were seven kernels a layer
    (issue 36: a linear head's private step is host time, and the host's
    time grows with the kernels it launches), and before that the Gram
    route's batched 1 x 1 GEMMs ran slower on the H200 than this kernel."""
    B, _, d = a.shape
    K = g.shape[2]
    io = _arrays.io_for(sq)
    # The kernel reads rows of d and K values one after another (the operands
    # may come with any strides: the clip op's to_operand); a row-major (B, 1,
    # d) array is such rows as it is (no (B, d) view: an op each).
    a2, g2 = io.to_kernel(a), io.to_kernel(g)
    out = sizes
    if sizes is not None and not _arrays.is_c_contiguous(sizes):
        out = io.empty((B, 2), _F64)
    native(sq).launch_linear_sq_norms(ptr(a2), ptr(g2), B, 1, d, K, dtype_code(a2), bool(bias),
                                      ptr(sq), bool(accumulate), stream(sq),
                                      sizes=opt_ptr(out))
    if out is not sizes:
        _arrays.assign(sizes, out)


def clipped_linear_sum(a, g, factors, noise_std, inv_denom, seed, offset, gw, gb, matmul=None,
                       balance=True, finish=None, bias_gemv=None):
    """gw [K, d] = inv_denom (sum_{i,t} f_i g_it a_it^T + noise_std xi_w), and
    gb [K] likewise from sum_{i,t} f_i g_it (skipped when gb is None).

    a: (B, T, d), g: (B, T, K) device arrays (torch or CuPy), float32 or
    float64; factors: (B,) float64, each sample's weight (its clip factor);
    gw (K, d), gb (K,): outputs in the data dtype.  The numba twin's
    algorithm on the vendor's GEMM: the factor multiplies the narrower operand
    in float64 and the product is rounded once to the data dtype, then one
    GEMM over the B*T rows in the data dtype -- the GEMM the non-private
    backward runs for the weight's gradient (issue 36: in float64 it cost 31
    ms of an 84 ms BERT step on the H200).  TF32 is off for it: the clip
    rule's (1 + 4u) margin is for IEEE rounding.  When some factor is below 1
    and ``balance`` holds, an exact power of two is moved between a sample's
    operands where either would leave [2^-40, 2^40] (``_balance.exponents``,
    from the maxima: a pass over both operands), so no product loses bits to
    denormals; the clip ops pass ``balance=False`` when the norms already show
    every such power would be 1 (``_balance.layers_needing_balancing``).
    Noise: the weight's draws offset + k*d + j, added to gw in float64 with
    the division by the expected batch and rounded once (``add_gaussian``),
    then the bias's.  Where the GEMM's scaled operand is g with no power
    moved, the bias is those products (each rounded once) summed over the B T
    rows in the data dtype, like the weight's GEMM (the numba twin sums them
    in float64; both within the GEMM's bound); else each sample's T rows in
    float64, then their factor-weighted sum with the true factors.
    ``matmul`` is the CPU path's BLAS hook, unused.  ``finish``: a list, or
    None; given, the noise is not added here: the weight's and the bias's
    finishes are appended to it as ``finish_gaussian_segments`` segments (the
    bias's in place, or from its float64 sum), for the caller to run with its
    other layers' in one launch.

    ``bias_gemv``: None, or a dict a step's layers share, given by a caller
    that read every weight on the host and found each 0 or within [2^-40,
    2^40] (``_balance.weights_in_range``).  Given, with ``balance`` off, the
    bias of an unscaled g (the factor went into a) is one GEMV in the data
    dtype, g's B T rows against the weights rounded to it, each repeated T
    times (kept in the dict by T): the same rounding as a column of ones in
    a's scaled operand, which the rule's spread E already counts (its
    ``+ bias``), instead of g copied whole to float64 (a BERT-base FF1
    layer's 50 MB read, 100 MB written and read again, 12 a step).  In range,
    a weight's float32 rounding is relative (u); where some weight is below 1
    the norms prove g within [2^-40, 2^40] (``balance`` off), so no product
    is lost to denormals, and where none is, each product is at least as
    large as g's value (as in the scaled rows of the K <= d case).
    """
    B, T, d = a.shape
    K = g.shape[2]
    scaled = clipped_gemm(a, g, factors, gw, balance)
    segments = [] if finish is None else finish
    segments.append((gw, gw, offset))               # contiguous: no flat view
    if gb is not None:
        if scaled is not None:
            # The GEMM's own f_i g_it, each rounded once, summed over the B T
            # rows in the data dtype into gb like the weight's GEMM (one
            # reduction, no (B T, K) view), finished in place.  No partial sum
            # overflows: the factor bounds f_i sum_t ||g_it|| through the clip
            # rule's spread E.  (torch's sum(dtype=float64) copies its float32
            # operand whole to float64 first: the H200 run of 2026-11-30 had 84
            # such copies, 1.6 ms, and 73 float64 reductions, 1.2 ms, in a
            # BERT-base step.)
            _arrays.sum_into(scaled, (0, 1), gb)
            segments.append((gb, gb, offset + K * d))
        elif bias_gemv is not None and not balance:
            rows = bias_gemv.get(T)
            if rows is None:
                rows = bias_gemv[T] = _arrays.repeat_each(factors, T, g)
            _ieee_matmul(g.reshape(B * T, K).T, rows, gb)
            segments.append((gb, gb, offset + K * d))
        else:
            # Unscaled g (the factor went into a, or a power of two moved):
            # its rows may be near the data dtype's largest and cancel, so
            # each sample's T rows are summed in float64, then weighted by the
            # true factors, and finished from that float64 sum.
            accb = _arrays.sum_float64(g, 1).T @ factors
            segments.append((gb, accb, offset + K * d))
    if finish is None:
        finish_gaussian_segments(segments, seed, noise_std, inv_denom)


def scale_rows(x, f):
    """``_arrays.scale_rows`` (x[i] * f[i], each product formed in float64 and
    rounded once to x's dtype) by the clip family's kernel where x is a
    row-major device array: one read of x and one write, 16-byte accesses,
    where torch's mixed-dtype multiply ran at 1.8 TB/s on the H200
    (2026-11-30); else by the library's multiply (a host array, a strided
    view).  x: (B, ...) float32/float64; f: (B,) float64, contiguous."""
    if _arrays.is_torch(x):
        # The step's common case, read from the tensor directly (issue 36's
        # host time: a launch a linear layer).
        if not ((x.is_cuda or _arrays.is_emulated(x)) and x.is_contiguous()
                and f.is_contiguous() and not x.is_neg()):
            return _arrays.scale_rows(x, f)
        # empty_like: x is row-major here, and it is the cheapest allocation
        # (1.2 us against new_empty's 4.0 on the 2-core VM).
        import torch
        out, code = torch.empty_like(x), torch_dtype_code(x.dtype)
        pointers = x.data_ptr(), f.data_ptr(), out.data_ptr()
    else:
        if not (_arrays.is_cuda_array(x) and _arrays.is_c_contiguous(x)
                and _arrays.is_c_contiguous(f)):
            return _arrays.scale_rows(x, f)
        out, code = _arrays.io_for(x).empty(tuple(x.shape), _arrays.numpy_dtype(x)), dtype_code(x)
        pointers = ptr(x), ptr(f), ptr(out)
    B = x.shape[0]
    native(x).launch_scale_rows(pointers[0], B, math.prod(x.shape[1:]) if B else 0, code,
                                pointers[1], pointers[2], stream(x))
    return out


def clipped_gemm(a, g, factors, out, balance=True):
    """out [K, d] = sum_{i,t} f_i g_it a_it^T, rounded as one GEMM in the data
    dtype: clipped_linear_sum's weight without its noise (also a tied
    weight's output-embedding part, ``torch/tied.py``).  a: (B, T, d), g:
    (B, T, K) torch tensors (any device) or CuPy arrays; factors: (B,)
    float64; out: (K, d), contiguous, the data dtype.  Returns the scaled
    g, fl(f_i g_it) (B, T, K), where the factor went into g with no power
    moved (``balance`` off), else None."""
    B, T, d = a.shape
    K = g.shape[2]
    if not _arrays.is_torch(a):
        _refuse_cupy_tf32(a)
    into_g = K <= d      # the factor goes to the narrower operand
    f = factors
    if balance and B:
        a, g, f = _rebalanced(a, g, f, into_g)
    if into_g:
        x, y = scale_rows(g, f), a
    else:
        x, y = g, scale_rows(a, f)
    _ieee_matmul(x.reshape(B * T, K).T, y.reshape(B * T, d), out)
    return x if into_g and f is factors else None


def _ieee_matmul(x, y, out):
    """out = x @ y by the library's GEMM with TF32 off (CuPy's TF32 is refused
    by the callers' _refuse_cupy_tf32).  Inside an entry of
    :func:`ieee_float32_matmul` this thread holds (the clip op's one entry
    around its sums) torch's GEMM is called directly: no context or dispatch
    a layer (issue 36's host time)."""
    if not _arrays.is_torch(out):
        _arrays.module_of(out).matmul(x, y, out=out)
        return
    import torch
    if ieee_float32_matmul_held():
        torch.matmul(x, y, out=out)
        return
    with ieee_float32_matmul():
        torch.matmul(x, y, out=out)


def _rebalanced(a, g, f, into_g):
    """(a, g, f) with 2^k_i moved from the other operand to the factor of
    sample i (``_balance.exponents`` of the maxima), as the numba twin's
    ``_balance_exponents``; k_i = 0 unless some factor is below 1."""
    xp = _arrays.module_of(f)
    ma, mg = _arrays.row_max_abs(a), _arrays.row_max_abs(g)
    k = _balance.exponents(xp, f * (mg if into_g else ma), ma if into_g else mg)
    k = xp.where(f.min() < 1.0, k, xp.zeros_like(k))
    f = _arrays.times_pow2(f, k)
    if into_g:
        return scale_rows(a, _arrays.times_pow2(xp.ones_like(k), -k)), g, f
    return a, scale_rows(g, _arrays.times_pow2(xp.ones_like(k), -k)), f


def _float32_gemm(x):
    """TF32 off around a torch GEMM (CuPy's is refused by _refuse_cupy_tf32)."""
    return ieee_float32_matmul() if _arrays.is_torch(x) else contextlib.nullcontext()


# The clip op enters it once around a step's sums: each layer's own entry is
# then a nested one, a count (2 against 6 us of host time a layer on the
# 2-core VM, issue 36).
float32_gemm_scope = _float32_gemm


def _refuse_cupy_tf32(x):
    if _arrays.kind(x) == "cupy" and os.environ.get("CUPY_TF32", "0") not in ("", "0"):
        raise RuntimeError(
            "CUPY_TF32: expected unset or 0 for the clipped sums and float32 Grams (the clip "
            "bound holds for IEEE float32 products; TF32 keeps 10 mantissa bits), got "
            f"{os.environ['CUPY_TF32']!r}; "
            "unset it, or pass torch tensors (TF32 is turned off for the call there)")


def norm_affine_grads(x, g, run, eps, w, b, dims=None):
    # x, g (B, rows, n) contiguous, one dtype, or of any shape with ``dims``
    # (B, rows, n), their row-major values read as that; w, b (B, C) in it,
    # or None (csrc/clip/clip_noise.h: each row normalised in float64,
    # float64 sums, one rounding).
    B, rows, n = x.shape if dims is None else dims
    C = native(x)
    nbytes = C.norm_affine_workspace_bytes(B, rows)
    ws, ws_ptr = workspace(x, nbytes)
    C.launch_norm_affine_grads(ptr(x), ptr(g), B, rows, n, int(run), dtype_code(x), float(eps),
                               opt_ptr(w), opt_ptr(b), ws_ptr, nbytes, stream(x))
