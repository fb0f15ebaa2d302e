"""CUDA kernels behind the same signatures as the numba ones (``_numba.*``).

Pure adaptors: take the caller's CUDA arrays (torch or CuPy, already validated
and contiguous), pass their device pointers and the current stream to
``ncdp_fast._C``, allocate the workspace the launchers ask for in the caller's
library (so it comes from the library's caching allocator).  No dispatch
decisions are made here; ``_backend.select`` made them.
"""
from __future__ import annotations

import numpy as np

from . import _C


def _ptr(x) -> int:
    if hasattr(x, "data_ptr"):
        return int(x.data_ptr())
    return int(x.__cuda_array_interface__["data"][0])


def _dtype_code(x) -> int:
    name = str(x.dtype).replace("torch.", "")
    return {"float32": 0, "float64": 1}[name]


def _stream(x) -> int:
    if hasattr(x, "data_ptr"):
        import torch
        return int(torch.cuda.current_stream(x.device).cuda_stream)
    import cupy
    # CuPy's current stream is per device; the launch runs on the array's
    # device (the native device guard), so read that device's stream.
    with x.device:
        return int(cupy.cuda.get_current_stream().ptr)


def _workspace(like, nbytes: int):
    if nbytes == 0:
        return None, 0
    if hasattr(like, "data_ptr"):
        import torch
        buf = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    else:
        import cupy
        with cupy.cuda.Device(like.device.id):
            buf = cupy.empty(nbytes, dtype=np.uint8)
    return buf, _ptr(buf)


def _opt_ptr(x) -> int:
    return 0 if x is None else _ptr(x)


# ----------------------------------------------------------------------- rng

def add_gaussian(out, seed, offset, scale, accumulate, post):
    if post != 1.0:
        raise NotImplementedError("post-scaling is applied by the fused CUDA kernels")
    _C.launch_fill_gaussian(_ptr(out), out.numel() if hasattr(out, "numel") else out.size,
                            _dtype_code(out), int(seed), int(offset), float(scale),
                            bool(accumulate), _stream(out))


# ---------------------------------------------------------------------- clip

def row_sq_norms(g, sq, accumulate):
    B, p = g.shape
    _C.launch_row_sq_norms(_ptr(g), B, p, _dtype_code(g), _ptr(sq), bool(accumulate), _stream(g))


def _xp(x):
    if hasattr(x, "data_ptr"):
        import torch
        return torch
    import cupy
    return cupy


def clip_factors(sq, spread, max_norm, terms, t_max, unit, factors, norms):
    # The rule of reference.clip_factors, in the kernel (clip/clip_rule.cuh).
    _C.launch_clip_factors(_ptr(sq), _opt_ptr(spread), sq.shape[0], float(max_norm), int(terms),
                           int(t_max), float(unit), _ptr(factors), _ptr(norms), _stream(sq))


def linear_spread(a, g, bias, spread, accumulate):
    """spread[i] (=|+=) sum_t ||g_it|| (||a_it|| + [bias]) in float64 (reference.linear_spread)."""
    xp = _xp(a)
    if xp.__name__ == "torch":
        na = xp.linalg.norm(a.double(), dim=2)
        ng = xp.linalg.norm(g.double(), dim=2)
        e = (ng * (na + (1.0 if bias else 0.0))).sum(dim=1)
    else:
        na = xp.linalg.norm(a.astype(xp.float64), axis=2)
        ng = xp.linalg.norm(g.astype(xp.float64), axis=2)
        e = (ng * (na + (1.0 if bias else 0.0))).sum(axis=1)
    if accumulate:
        spread += e
    else:
        spread[:] = e


def clip_noise_rows(g, max_norm, noise_std, inv_denom, seed, offset, out, norms, factors):
    # ``factors`` is unused: the fused launcher keeps them in its workspace.
    B, p = g.shape
    dt = _dtype_code(g)
    nbytes = _C.clip_noise_rows_workspace_bytes(B, p, dt)
    ws, ws_ptr = _workspace(g, nbytes)
    _C.launch_clip_noise_rows(_ptr(g), B, p, dt, float(max_norm), float(noise_std),
                              float(inv_denom), int(seed), int(offset), _ptr(out), _ptr(norms),
                              ws_ptr, nbytes, _stream(g))


def weighted_row_sum_noise(g, factors, noise_std, inv_denom, seed, offset, out):
    B, p = g.shape
    dt = _dtype_code(g)
    nbytes = _C.weighted_row_sum_workspace_bytes(B, p, dt)
    ws, ws_ptr = _workspace(g, nbytes)
    _C.launch_weighted_row_sum_noise(_ptr(g), B, p, dt, _ptr(factors), float(noise_std),
                                     float(inv_denom), int(seed), int(offset), _ptr(out),
                                     ws_ptr, nbytes, _stream(g))


def linear_sq_norms(a, g, bias, sq, accumulate):
    B, T, d = a.shape
    K = g.shape[2]
    _C.launch_linear_sq_norms(_ptr(a), _ptr(g), B, T, d, K, _dtype_code(a), bool(bias), _ptr(sq),
                              bool(accumulate), _stream(a))


def clipped_linear_sum(a, g, factors, noise_std, inv_denom, seed, offset, gw, gb, matmul=None):
    # ``matmul`` is the CPU path's BLAS hook; the CUDA launcher has its own GEMM.
    B, T, d = a.shape
    K = g.shape[2]
    dt = _dtype_code(a)
    # The workspace lets the GEMM split the B*T reduction over many blocks
    # (slab partials, no atomics): a K x d output alone would fill few SMs.
    nbytes = _C.clipped_linear_sum_workspace_bytes(B, T, d, K, dt)
    ws, ws_ptr = _workspace(a, nbytes)
    _C.launch_clipped_linear_sum(_ptr(a), _ptr(g), _ptr(factors), B, T, d, K, dt,
                                 float(noise_std), float(inv_denom), int(seed), int(offset),
                                 _ptr(gw), _opt_ptr(gb), _stream(a), ws_ptr, nbytes)


# ----------------------------------------------------------------------- mix

def _upload(like, host, dtype=None):
    """A small host array (population description) on the device of ``like``."""
    if host is None:
        return None
    host = np.ascontiguousarray(host if dtype is None else host.astype(dtype))
    if hasattr(like, "data_ptr"):
        import torch
        return torch.from_numpy(host).to(like.device)
    import cupy
    with cupy.cuda.Device(like.device.id):
        return cupy.asarray(host)


def mix_rows(features, labels, soft, group_ptr, members, select_rate, walk_rate, seed, offset,
             inv_m, clip_x, noise_std_x, noise_std_y, out_x, out_y, counts):
    n, d = features.shape
    K = out_y.shape[1]
    T = out_x.shape[0]
    dev = [_upload(features, a) for a in (labels, group_ptr, members, select_rate, walk_rate)]
    lab_d, ptr_d, mem_d, sel_d, walk_d = dev
    _C.launch_mix_rows(_ptr(features), _dtype_code(features), n, d, _ptr(lab_d), _opt_ptr(soft),
                       K, _ptr(ptr_d), _opt_ptr(mem_d), group_ptr.shape[0] - 1, _opt_ptr(sel_d),
                       _ptr(walk_d), T, int(seed), int(offset), float(inv_m), float(clip_x),
                       float(noise_std_x), float(noise_std_y), _ptr(out_x), _ptr(out_y),
                       _ptr(counts), _stream(features))


# ----------------------------------------------------------------------- ntk

def gram_term_args(f, b, f2, b2) -> dict:
    """The per-term keyword arguments of ``_C.launch_hadamard_gram``.

    Term l: ``f[l]`` (n, a_l) or None for the constant-1 factor of a bias term,
    ``f2[l]`` (n2, a_l), None exactly where ``f[l]`` is, ``b[l]`` (n, b_l),
    ``b2[l]`` (n2, b_l); C-contiguous CUDA arrays of one float dtype.
    Returns lists of L entries: ``f``, ``f2``, ``b_ptrs``, ``b2_ptrs`` (device
    pointers, int), ``a``, ``b`` (widths, int) and ``constant_one`` (bool).
    """
    for l, (x, y) in enumerate(zip(f, f2)):
        if (x is None) != (y is None):
            raise ValueError(f"f2[{l}]: expected None exactly where f[{l}] is None (the "
                             f"constant-1 factor), got {'None' if y is None else 'an array'} "
                             f"with f[{l}] {'None' if x is None else 'an array'}")
    # The constant-1 factor is flagged, not inferred from a null pointer: torch
    # also gives a real F of width 0 (a term that adds zero) data pointer 0.
    return {"f": [_opt_ptr(x) for x in f],
            "a": [0 if x is None else int(x.shape[1]) for x in f],
            "constant_one": [x is None for x in f],
            "b_ptrs": [_ptr(x) for x in b],
            "b": [int(x.shape[1]) for x in b],
            "f2": [_opt_ptr(x) for x in f2],
            "b2_ptrs": [_ptr(x) for x in b2]}


def hadamard_gram(f, b, f2, b2, out, symmetric, matmul=None, accumulate_f64=False):
    # ``matmul`` is the CPU path's BLAS hook; the CUDA kernel tiles its own products.
    n, n2 = out.shape
    _C.launch_hadamard_gram(**gram_term_args(f, b, f2, b2), n=n, n2=n2,
                            dtype=_dtype_code(b[0]), symmetric=bool(symmetric),
                            accumulate_f64=bool(accumulate_f64), out=_ptr(out),
                            out_dtype=_dtype_code(out), stream=_stream(out))


def sample_plan(group_ptr, members, select_rate, walk_rate, seed, offset, row_stride, rows,
                like=None):
    """Memberships as CSR on the host, sampled by the GPU's own sampler (the one
    mix_rows uses), so they match its output exactly."""
    ptr_d, mem_d, sel_d, walk_d = (_upload(like, a) for a in (group_ptr, members, select_rate,
                                                                walk_rate))
    G = group_ptr.shape[0] - 1
    counts = _upload(like, np.zeros(rows, dtype=np.int64))
    args = (_ptr(ptr_d), _opt_ptr(mem_d), G, _opt_ptr(sel_d), _ptr(walk_d), rows, int(row_stride),
            int(seed), int(offset))
    _C.launch_sample_counts(*args, _ptr(counts), _stream(like))
    host_counts = counts.cpu().numpy() if hasattr(counts, "cpu") else counts.get()
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(host_counts, out=indptr[1:])
    indices = _upload(like, np.empty(max(1, int(indptr[-1])), dtype=np.int64))
    _C.launch_sample_fill(*args, _ptr(_upload(like, indptr)), _ptr(indices), _stream(like))
    host = indices.cpu().numpy() if hasattr(indices, "cpu") else indices.get()
    return indptr, host[:int(indptr[-1])].copy()
