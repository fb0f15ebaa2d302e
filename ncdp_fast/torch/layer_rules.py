"""The book-keeping rules of torch's own layers (linear, convolution, embedding,
layer/RMS/group/instance norm), registered with :func:`.layers.register_layer`
when this module is imported (``ncdp_fast.torch`` imports it), and the shared
pieces other rules build on (:mod:`.attention`, :mod:`.hf_layers`, :mod:`.tied`).
The rule contract and the blocks a rule returns: :mod:`.layers`.

Between a pair and an instantiated gradient a rule takes the cheaper
(:func:`factored_or_instantiated`, the mixed rule of Bu et al. 2023): the ghost
norm costs B*T^2*(d+K) and no memory of size K*d; the instantiated gradient
costs B*T*K*d and B*K*d memory.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import _arrays
from .._cuda._common import ieee_float32_products
from .._cuda.clip import scale_rows
from .._cuda.gram import grams_f64
from .._norm_affine import device_grads
from .._clip import GhostBlock
from .layers import accumulation_dtype, check_embedding_options, register_layer

__all__ = ["factored_or_instantiated", "linear_rule", "conv_rule", "embedding_rule",
           "layer_norm_rule", "rms_norm_rule", "group_norm_rule", "instance_norm_rule"]


# ---------------------------------------------------------------- shared pieces

def _flat_positions(x: torch.Tensor, width: int, features: int = 1) -> torch.Tensor:
    """(B, ..., f_1, ..., f_k) -> (B, T, width), the last ``features`` = k dimensions
    (``width`` = their product) the features and the rest positions; explicit T
    so that B = 0 reshapes too."""
    shape = x.shape
    if features == 1 and len(shape) == 3 and shape[2] == width:
        return x        # already (B, T, width): no view op (host time a layer)
    T = 1
    for s in shape[1:len(shape) - features]:
        T *= s
    if len(shape) == 3 and shape[1] == T and shape[2] == width:
        return x
    return x.reshape(shape[0], T, width)


def _lead(x: torch.Tensor, k: int) -> torch.Tensor:
    """x with its dimensions after the first k flattened into one (B = 0 safe)."""
    n = 1
    for s in x.shape[k:]:
        n *= s
    return x.reshape(*x.shape[:k], n)


def _positions(x: torch.Tensor) -> int:
    """The positions of a channels-first input (B, C, *spatial): a channel's
    values a sample (0 for an empty spatial shape)."""
    return math.prod(x.shape[2:])


def _cat(parts: list, dim: int = 1):
    """Several calls of a layer are one longer sequence (a single call: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def factored_or_instantiated(a: torch.Tensor, g: torch.Tensor, names: tuple, bias: bool):
    """The weight (and bias) of ``y_t = W a_t (+ b)`` summed over T positions:
    ``a`` (B, T, d), ``g`` (B, T, K).  Returns the cheaper block(s) (mixed rule):
    the pair when the ghost norm is cheaper (2 T^2 <= K d), else the per-sample
    weight gradient (B, K, d) formed by one batched GEMM (and the bias's (B, K))."""
    B, T, d = a.shape
    K = g.shape[2]
    if 2 * T * T <= K * d or T == 1:
        return [(names, (a, g, bias))]
    with ieee_float32_products(a):
        out = [((names[0],), torch.bmm(g.transpose(1, 2), a))]
    if bias:
        out.append(((names[1],), g.sum(1)))
    return out


_FUSED_DTYPES = (torch.float32, torch.float64)


def _fused_affine(calls, rows_of, run_of, eps, trainable):
    """A normalisation layer's per-sample (w, b) blocks from the clip family's
    kernel (``_norm_affine``: one launch a call, no xhat formed) where every
    call's input and output gradient are non-empty float32/float64 arrays of
    the device (CUDA, or the emulated one) with one dtype; None elsewhere (the
    torch composition then runs: on the CPU, in half precision, for empty
    inputs).  ``rows_of(x)``: the (B, rows, n) the kernel reads x (and its
    gradient, of x's shape) as, values in x's row-major order (the kernel
    takes the dimensions, not a view: an op each, issue 36's host time);
    ``run_of(x)``: the kernel's ``run`` (0: the layer normalises each row of
    features, LayerNorm)."""
    for c in calls:
        x, g = c.inputs[0], c.grad
        if not (x.dtype == g.dtype and x.dtype in _FUSED_DTYPES and x.numel()
                and x.shape == g.shape and _arrays.is_cuda_array(x)):
            return None
    weight, bias = "weight" in trainable, "bias" in trainable
    w = b = None
    for c in calls:
        x = c.inputs[0]
        cw, cb = device_grads(x, c.grad, rows_of(x), run_of(x), eps, weight, bias)
        w = cw if w is None else w + cw
        b = cb if b is None else b + cb
    out = []
    if weight:
        out.append((("weight",), w))
    if bias:
        out.append((("bias",), b))
    return out


def _affine_rule(xhat: torch.Tensor, g: torch.Tensor, trainable, dim: int):
    """Elementwise affine ``y = w * xhat + b``: per-sample gradients of w and b are
    sums of g * xhat and g over the positions ``dim`` (instantiated: they are
    small).  The product is formed and summed: the einsum that avoided it ran
    as a batched GEMM of width 1, 12x slower on a (8, 128, 768) float32 input."""
    out = []
    if "weight" in trainable:
        out.append((("weight",), torch.mul(g, xhat).sum(dim)))
    if "bias" in trainable:
        out.append((("bias",), g.sum(dim)))
    return out


# ---------------------------------------------------------------- built-in rules

@register_layer(nn.Linear)
def linear_rule(module: nn.Linear, calls, trainable):
    """y = x W^T + b on inputs (B, ..., d): every position adds to the sample's gradient."""
    d, K = module.in_features, module.out_features
    a = _cat([_flat_positions(c.inputs[0], d) for c in calls])
    g = _cat([_flat_positions(c.grad, K) for c in calls])
    if "weight" in trainable:
        names = ("weight", "bias") if "bias" in trainable else ("weight",)
        return factored_or_instantiated(a, g, names, "bias" in trainable)
    return [(("bias",), g.sum(1))] if "bias" in trainable else []


def _conv_input(module, x: torch.Tensor):
    """(input as the convolution reads it, 2-D form, padding still to apply): a
    Conv1d becomes a Conv2d of height 1 (a Conv3d stays 3-D); non-zero padding
    modes and string paddings are applied here, as the module's own
    _conv_forward does."""
    nd = len(module.kernel_size)
    two = (lambda v: (1,) + tuple(v)) if nd == 1 else tuple
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        # Pad before adding Conv1d's dummy height: F.pad's non-constant modes
        # take a 3-D input with 2 pads, not a 4-D one.
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * max(nd, 2)
    else:
        padding = (0,) + tuple(module.padding) if nd == 1 else tuple(module.padding)
    if nd == 1:
        x = x.unsqueeze(-2)
    return x, padding, two


def _conv_columns(module, x: torch.Tensor) -> torch.Tensor:
    """The im2col matrix of a convolution's input: (B, C_in*k, L), L output positions;
    a plain 1x1 convolution needs no copy (its columns are the input's pixels)."""
    x, padding, two = _conv_input(module, x)
    k, stride, dil = two(module.kernel_size), two(module.stride), two(module.dilation)
    if k == (1, 1) and padding == (0, 0):
        x = x[:, :, ::stride[0], ::stride[1]]
        return _lead(x, 2)
    return F.unfold(x, k, dilation=dil, padding=padding, stride=stride)


# A grouped convolution's per-sample weight gradient as a forward convolution
# (the gradient's positions as the filter) where a sample has at most this many
# output positions; above it, the convolution's own weight-gradient kernel with
# the batch folded into the groups.  torch's depthwise weight-gradient kernel
# (the folded form on a GPU: one warp a weight value, a block reduction each)
# leaves most lanes idle at a few positions, and on this CPU it took 17-29 ms
# against the forward form's 0.8-3.7 ms at EfficientNet-Lite0's 5x5 layers of
# 9-144 positions (B 64); at 576 and 2304 positions the two were within 15%.
FORWARD_GRAD_MAX_POSITIONS = 256


def per_sample_route(groups: int, kernel: tuple, padding: tuple, positions: int) -> str:
    """Which form :func:`_conv_per_sample` takes for a 2-D (or 1-D as height 1)
    convolution of ``groups``, ``kernel`` and zero ``padding`` with
    ``positions`` output positions: "gemm", "forward" or "folded"."""
    if groups == 1 and kernel == (1, 1) and padding == (0, 0):
        return "gemm"
    return "forward" if groups > 1 and positions <= FORWARD_GRAD_MAX_POSITIONS else "folded"


def _conv_per_sample(module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients (B, *weight.shape) of one call, ``x`` its
    input (B, C_in, *spatial), ``g`` its output's gradient (B, C_out, *out):

    - a plain 1x1 convolution (one group, no padding): one batched GEMM of g
      and the input's pixels, (B, C_out, L) x (B, L, C_in), no copy of either;
    - grouped (depthwise included) with at most FORWARD_GRAD_MAX_POSITIONS
      output positions: a forward convolution of the input by g, each sample
      and group a channel of its own (stride and dilation swap roles);
    - otherwise the convolution's weight-gradient kernel with the batch folded
      into the groups.

    Each value is one sum over the sample's output positions, in the data
    dtype (IEEE: TF32 off for cuDNN and cuBLAS on a device)."""
    with ieee_float32_products(x):
        return _conv_per_sample_routes(module, x, g)


def _conv_per_sample_routes(module, x, g):
    x, padding, two = _conv_input(module, x)
    B = x.shape[0]
    w = module.weight
    if B == 0:
        return w.new_zeros((0, *w.shape))
    k, stride, dil = two(module.kernel_size), two(module.stride), two(module.dilation)
    G = module.groups
    if len(module.kernel_size) == 1:
        g = g.unsqueeze(-2)
    L = _positions(g)
    # A Conv3d takes the folded route: the other two are written for 2-D.
    route = "folded" if len(k) == 3 else per_sample_route(G, k, padding, L)
    if route == "gemm":
        if stride != (1, 1):
            x = x[:, :, ::stride[0], ::stride[1]]
        cols = x.reshape(B, x.shape[1], L)
        return torch.bmm(g.reshape(B, g.shape[1], L), cols.transpose(1, 2)).reshape(B, *w.shape)
    if route == "forward":
        return _conv_per_sample_forward(x, g, w, padding, k, stride, dil, G)
    shape = (B * w.shape[0], x.shape[1] // G, *k)
    weight_grad = torch.nn.grad.conv3d_weight if len(k) == 3 else torch.nn.grad.conv2d_weight
    gw = weight_grad(
        x.reshape(1, B * x.shape[1], *x.shape[2:]), shape,
        g.reshape(1, B * g.shape[1], *g.shape[2:]), stride=stride, padding=padding,
        dilation=dil, groups=B * G)
    return gw.reshape(B, *w.shape)


def _conv_per_sample_forward(x, g, w, padding, k, stride, dil, G):
    """dW[b, o, i, q] = sum_p g[b, o, p] x_pad[b, c(o, i), p * stride + q * dil]
    as one forward convolution: the input's channels (sample, group) each read
    by that sample's C_out / G gradient images as filters, the C_in / G channels
    of a group as its batch; stride and dilation trade places.  Its output
    covers k, and a row or column more where the strides do not divide the
    padded input: those are cut.  At one output position, the products
    themselves."""
    B, C_in = x.shape[:2]
    cin_g = C_in // G
    if g.shape[2] == g.shape[3] == 1:
        # One output position: each value is one product, of g and the padded
        # input at the filter's taps (a 1x1-filter convolution with padding
        # took 5 ms on this CPU against 0.1 ms for these products).
        xp = F.pad(x, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else x
        taps = xp[:, :, :(k[0] - 1) * dil[0] + 1:dil[0], :(k[1] - 1) * dil[1] + 1:dil[1]]
        out = taps.reshape(B, G, 1, cin_g, *k) * g.reshape(B, G, -1, 1, 1, 1)
        return out.reshape(B, *w.shape)
    xs = x.reshape(B * G, cin_g, *x.shape[2:]).transpose(0, 1)        # (C_in/G, B G, H, W)
    filters = g.reshape(B * g.shape[1], 1, *g.shape[2:])              # (B C_out, 1, Ho, Wo)
    out = F.conv2d(xs, filters, stride=dil, padding=padding, dilation=stride, groups=B * G)
    if tuple(out.shape[2:]) != k:
        out = out[:, :, :k[0], :k[1]]                                # (C_in/G, B C_out, kh, kw)
    return out.transpose(0, 1).reshape(B, *w.shape)


@register_layer(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_rule(module, calls, trainable):
    """Convolution as a linear layer on its im2col columns: weight (C_out, C_in*k)
    against columns (B, L, C_in*k).  Mixed rule over all calls' L positions:
    one group and 2 L^2 <= C_out C_in k: the pair (ghost norm; the columns
    formed, free for a plain 1x1 convolution); otherwise (depthwise and other
    grouped convolutions, large L) the per-sample gradient (B, *weight.shape)
    (:func:`_conv_per_sample`), whose size is that of the kernel, small.  A
    Conv3d always takes the per-sample gradient (torch has no 3-D im2col)."""
    C_out = module.out_channels
    L = sum(math.prod(c.grad.shape[2:]) for c in calls)            # output positions
    B = calls[0].grad.shape[0]

    def gs():
        # (B, C_out, L) per call, formed only where read (a view each: host
        # time, issue 36; a depthwise layer without bias reads none)
        return _cat([_lead(c.grad, 2) for c in calls], 2)
    out = []
    if "weight" in trainable:
        bias = "bias" in trainable
        names = ("weight", "bias") if bias else ("weight",)
        if len(module.kernel_size) < 3 and module.groups == 1 \
                and 2 * L * L <= module.weight.numel():
            cols = _cat([_conv_columns(module, c.inputs[0]) for c in calls], dim=2)
            return [(names, (cols.transpose(1, 2), gs().transpose(1, 2), bias))]
        gw = None
        for c in calls:
            part = _conv_per_sample(module, c.inputs[0], c.grad)
            gw = part if gw is None else gw + part
        out.append((("weight",), gw))
    if "bias" in trainable:
        out.append((("bias",), gs().sum(2) if B else calls[0].grad.new_zeros((0, C_out))))
    return out


# float64 temporaries of one chunk of the device route of _rows_sq, in bytes.
_ROWS_CHUNK_BYTES = _arrays.CHUNK_BYTES


def rows_sq_terms(T: int, D: int, device_route: bool) -> int:
    """``terms`` of the clip rule for :func:`_rows_sq` plus the clipped sum's T
    rows of D: the device route sums T^2 dot products of length D."""
    return T * D + D + (T * T if device_route else 0)


def _rows_sq(idx: torch.Tensor, h: torch.Tensor, V: int) -> torch.Tensor:
    """Squared norm per sample of a row-scatter gradient: sample i's gradient has
    rows ``sum_{t: idx[i, t] = v} h[i, t]`` at the rows v it used, of a (V, D)
    weight.  ``idx`` (B, T) int64 row indices, ``h`` (B, T, D) any float dtype;
    returns (B,) float64.  On the CPU: one scatter into each sample's distinct
    (sample, row) keys, summed in float64, O(B T D), nothing of size V*D per
    sample.  On a device, where ``unique`` would make the host wait (issue
    36): sum_{t,s} [idx_t == idx_s] (h_t . h_s) from the float64 Grams of
    ``_cuda.gram.grams_f64`` (float32 h read as it is, no float64 copy), O(B
    T^2 D) on the FP64 tensor cores, in chunks of samples.  Shared by the
    Embedding rule and a tied weight's embedding uses (tied.py), so both round
    alike."""
    B, T = idx.shape
    D = h.shape[2]
    # On a device (or the emulated one) a value-shaped result (unique) would
    # make the host wait.
    if _arrays.is_cuda_array(idx):
        sq = torch.zeros(B, dtype=torch.float64, device=h.device)
        for lo, hi in _arrays.sample_chunks(B, 8 * (T * D + 2 * T * T), _ROWS_CHUNK_BYTES):
            # The Gram route's entry: float32 rows straight to the float64
            # kernel (no float64 copy of h), float64 rows to the GEMM.
            same = idx[lo:hi].unsqueeze(2) == idx[lo:hi].unsqueeze(1)           # (b, T, T)
            sq[lo:hi] = grams_f64([h[lo:hi]]).mul_(same).sum((1, 2))
        return sq
    sample = torch.arange(B, device=idx.device).unsqueeze(1).expand(B, T)
    keys, inverse = torch.unique(sample * V + idx, return_inverse=True)
    rows = torch.zeros((keys.numel(), D), dtype=torch.float64, device=h.device)
    rows.index_add_(0, inverse.reshape(-1), h.reshape(-1, D).to(torch.float64))
    sq = torch.zeros(B, dtype=torch.float64, device=h.device)
    sq.index_add_(0, torch.div(keys, V, rounding_mode="floor"), rows.square().sum(1))
    return sq


@register_layer(nn.Embedding)
def embedding_rule(module: nn.Embedding, calls, trainable):
    """Row lookup: sample i's gradient has rows ``sum_{t: idx_t = v} g_t`` at the
    rows v it used.  Norms from the rows each sample touched (one scatter into
    its distinct (sample, row) keys, float64), clipped sum one index_add: O(B T D),
    nothing of size V*D per sample."""
    if "weight" not in trainable:
        return []
    check_embedding_options(module)
    V, D = module.weight.shape
    idx = _cat([_lead(c.inputs[0], 1) for c in calls])                 # (B, T)
    g = _cat([_flat_positions(c.grad, D) for c in calls])              # (B, T, D)
    if module.padding_idx is not None:       # the padding row never gets a gradient
        g = g.masked_fill((idx == module.padding_idx).unsqueeze(-1), 0)
    T = idx.shape[1]
    sq = _rows_sq(idx, g, V)
    dtype = accumulation_dtype(module.weight.dtype)

    def clipped_sum(factors, masked=True):
        # A factor of 0 (a dropped sample, whose data may be NaN: 0 * NaN is
        # NaN) adds exact zeros; masked rather than selected, so no
        # value-shaped index makes a device wait for the host.  Unmasked when
        # the op says no row was dropped (unmasked_sum).
        out = torch.zeros((V, D), dtype=dtype, device=g.device)
        out.index_add_(0, idx.reshape(-1), scaled_rows(g, factors, dtype, masked).reshape(-1, D))
        return out
    # clipped_sum adds up to T rows per sample in the data dtype: their norms
    # are the scale of its rounding (reference.clip_bound's E).
    spread = torch.linalg.vector_norm(g.to(torch.float64), dim=2).sum(1)
    terms = rows_sq_terms(T, D, _arrays.is_cuda_array(idx))
    return [(("weight",), GhostBlock(sq, clipped_sum, (V, D), terms, dtype=dtype,
                                     spread=spread, seq_len=T, reads=(idx,),
                                     unmasked_sum=lambda f: clipped_sum(f, masked=False)))]


def scaled_rows(h: torch.Tensor, factors: torch.Tensor, dtype: torch.dtype,
                masked: bool) -> torch.Tensor:
    """fl(f_i h_it) in ``dtype`` for h (B, T, D) and factors (B,) float64: each
    product formed in float64 and rounded once, by one element-wise kernel
    where h is in ``dtype`` (``_cuda.clip.scale_rows``; the float64 copy, product,
    mask and cast it replaces were four passes over a BERT embedding's
    gradient); with ``masked``, a dropped sample's rows (factor 0, its data
    possibly NaN) are exact zeros.  Shared by the Embedding rule and a tied
    weight's embedding uses (tied.py), so both round alike."""
    if h.dtype == dtype:
        out = scale_rows(h, factors)
    else:
        out = (h.to(torch.float64) * factors.view(-1, 1, 1)).to(dtype)
    if masked:
        out.masked_fill_((factors == 0).view(-1, 1, 1), 0.0)
    return out


@register_layer(nn.LayerNorm)
def layer_norm_rule(module: nn.LayerNorm, calls, trainable):
    """y = w * xhat + b over the trailing ``normalized_shape`` (k >= 1 dimensions,
    flattened into one feature axis: every other dimension is a position);
    xhat recomputed with the forward's own normalisation (F.layer_norm
    without affine)."""
    width = math.prod(module.normalized_shape)
    k = len(module.normalized_shape)
    shape = tuple(module.normalized_shape)
    blocks = _fused_affine(calls, lambda x: (x.shape[0], x.numel() // (x.shape[0] * width), width),
                           lambda x: 0, module.eps, trainable)
    if blocks is None:
        xs, gs = [], []
        for c in calls:
            xhat = F.layer_norm(c.inputs[0], module.normalized_shape, None, None, module.eps)
            xs.append(_flat_positions(xhat, width, k))
            gs.append(_flat_positions(c.grad, width, k))
        blocks = _affine_rule(_cat(xs), _cat(gs), trainable, 1)
    # A one-dimensional shape is the sums' already: no view (an op each).
    return [(n, b if tuple(b.shape[1:]) == shape else b.reshape(b.shape[0], *shape))
            for n, b in blocks]


@register_layer(nn.RMSNorm)
def rms_norm_rule(module: nn.RMSNorm, calls, trainable):
    """y = w * xhat over the trailing ``normalized_shape``, xhat = x / rms(x) (no
    bias): w's per-sample gradient is sum over positions of g * xhat."""
    if "weight" not in trainable:
        return []
    width = math.prod(module.normalized_shape)
    k = len(module.normalized_shape)
    xs, gs = [], []
    for c in calls:
        xhat = F.rms_norm(c.inputs[0], module.normalized_shape, None, module.eps)
        xs.append(_flat_positions(xhat, width, k))
        gs.append(_flat_positions(c.grad, width, k))
    with ieee_float32_products(xs[0]):
        w = torch.einsum("btw,btw->bw", _cat(gs), _cat(xs))
    return [(("weight",), w.reshape(w.shape[0], *module.normalized_shape))]


@register_layer(nn.GroupNorm)
def group_norm_rule(module: nn.GroupNorm, calls, trainable):
    """y = w_c * xhat + b_c per channel c, xhat normalised over (group, positions)."""
    groups = module.num_groups
    blocks = _fused_affine(calls, lambda x: (x.shape[0], groups,
                                             x.numel() // (x.shape[0] * groups)),
                           _positions, module.eps, trainable)
    if blocks is not None:
        return blocks
    xs, gs = [], []
    for c in calls:
        x = c.inputs[0]
        xhat = F.group_norm(x, module.num_groups, None, None, module.eps)
        xs.append(_lead(xhat, 2))
        gs.append(_lead(c.grad, 2))
    return _affine_rule(_cat(xs, 2), _cat(gs, 2), trainable, 2)


@register_layer(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm_rule(module, calls, trainable):
    """Affine instance norm (no running statistics): a group norm with one channel
    per group, per sample."""
    if module.track_running_stats and module.training:
        raise ValueError(f"{type(module).__name__} with track_running_stats=True mixes samples "
                         "through its running statistics; use track_running_stats=False")
    blocks = _fused_affine(calls, lambda x: (x.shape[0], x.shape[1],
                                             x.numel() // (x.shape[0] * x.shape[1])),
                           _positions, module.eps, trainable)
    if blocks is not None:
        return blocks
    xs, gs = [], []
    for c in calls:
        x = c.inputs[0]
        xhat = F.instance_norm(x, eps=module.eps)
        xs.append(_lead(xhat, 2))
        gs.append(_lead(c.grad, 2))
    return _affine_rule(_cat(xs, 2), _cat(gs, 2), trainable, 2)
