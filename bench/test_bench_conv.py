"""Per-sample weight gradients of convolutions (report ``bench_conv_grads``;
issue 36): EfficientNet-Lite0's instantiated layers at bench_finetune's shapes
(96 x 96 images, B = 64), where its private step on the H200 took 70 ms
against 17 ms non-private.

Methods, interleaved in one process (bench/README.md), float32:

* ``ncdp``: the convolution rule's route (``layer_rules._conv_per_sample``):
  a plain 1x1 convolution as one batched GEMM, a grouped one with at most
  ``FORWARD_GRAD_MAX_POSITIONS`` output positions as a forward convolution of
  the input by the gradient, the rest by the weight-gradient kernel with the
  batch folded into the groups.
* ``folded``: every layer by the weight-gradient kernel with the batch folded
  into the groups (the rule's only route before 2026-11-29), with TF32 off as
  the rule runs it (``ieee_float32_products``; ``unfold_bmm`` likewise): the
  H200 run of 2026-11-30 ran it in cuDNN's default TF32, outside the accuracy
  check's float32 bound at the (144, 24) 1x1 layer.
* ``summed``: the non-private backward's weight gradient of the same layer (the
  batch summed; what the private step does not run), under the process's TF32
  settings as non-private training runs it: the floor.
* ``opacus``: Opacus's conv grad sampler (unfold, then einsum), what a user of
  Opacus's per-sample modes gets.
* ``unfold_bmm``: im2col columns and one batched GEMM per (sample, group),
  (B G, C_out / G, L) x (B G, L, C_in / G k^2): the vendor-GEMM form of every
  layer (a batched matrix-vector product for a depthwise one), timed so that a
  GPU run can tell where it beats the rule's route.

Each row is one layer: (C_in, C_out, kernel, stride, groups, input size); the
input is the layer's padded input as the network feeds it (SAME padding
applied for the stride-2 layers, as ZeroPad2d does).
"""
from __future__ import annotations

from _common import cases, measure

# (C_in, C_out, k, stride, padding, groups, input size): EfficientNet-Lite0 at
# 96 x 96, the layers whose per-sample gradient is instantiated (the mixed rule:
# 2 L^2 > C_out C_in k^2, or grouped): the stem, 1x1 expansions and projections
# at 48, 24 and 12 pixels, and depthwise layers from 48 pixels down to 3.
LAYERS = [(3, 32, 3, 2, 0, 1, 97), (16, 96, 1, 1, 0, 1, 48), (144, 24, 1, 1, 0, 1, 24),
          (40, 240, 1, 1, 0, 1, 12), (32, 32, 3, 1, 1, 32, 48), (96, 96, 3, 2, 0, 96, 49),
          (144, 144, 5, 2, 0, 144, 27), (240, 240, 5, 1, 2, 240, 12),
          (672, 672, 5, 1, 2, 672, 6), (1152, 1152, 5, 1, 2, 1152, 3)]
SHAPES = {"full": dict(B=64, layers=LAYERS), "quick": dict(B=16, layers=LAYERS),
          "smallest": dict(B=2, layers=[(3, 4, 3, 2, 0, 1, 9), (4, 6, 1, 1, 0, 1, 5),
                                        (6, 6, 5, 1, 2, 6, 4), (6, 6, 3, 1, 1, 6, 17)])}
METHODS = ["ncdp", "folded", "summed", "opacus", "unfold_bmm"]


def layer_label(B, layer) -> str:
    cin, cout, k, s, p, G, size = layer
    return f"B={B} ({cin}, {cout}, {k}x{k}, s{s}, p{p}, g{G}, {size}x{size})"


def CASES(size, device):
    s = SHAPES[size]
    work = [(layer_label(s["B"], layer), dict(B=s["B"], layer=layer)) for layer in s["layers"]]
    return {"test_conv_grads": cases("bench_conv_grads", work, METHODS)}


def out_size(layer) -> int:
    cin, cout, k, s, p, G, size = layer
    return (size + 2 * p - k) // s + 1


def grad_flops(B, layer) -> float:
    """Multiply-adds x 2 of the per-sample weight gradients: each of the
    B C_out (C_in / G) k^2 values sums L products."""
    cin, cout, k, s, p, G, size = layer
    return 2.0 * B * cout * (cin // G) * k * k * out_size(layer) ** 2


def test_conv_grads(benchmark, case, bench_device):
    import pytest
    import torch
    from torch import nn

    from ncdp_fast._cuda._common import ieee_float32_products
    from ncdp_fast.torch import layer_rules
    B, layer = case.params["B"], case.params["layer"]
    cin, cout, k, s, p, G, size = layer
    device = "cuda" if bench_device == "cuda" else "cpu"
    gen = torch.Generator().manual_seed(0)
    module = nn.Conv2d(cin, cout, k, stride=s, padding=p, groups=G, bias=False).to(device)
    x = torch.randn(B, cin, size, size, generator=gen).to(device)
    L = out_size(layer)
    g = (torch.randn(B, cout, L, L, generator=gen) * 1e-3).to(device)
    method = case.method
    if method == "ncdp":
        def fn():
            return layer_rules._conv_per_sample(module, x, g)
    elif method == "folded":
        def fn():
            with ieee_float32_products(x):
                gw = torch.nn.grad.conv2d_weight(
                    x.reshape(1, B * cin, size, size), (B * cout, cin // G, k, k),
                    g.reshape(1, B * cout, L, L), stride=s, padding=p, groups=B * G)
            return gw.reshape(B, *module.weight.shape)
    elif method == "summed":
        def fn():
            return torch.nn.grad.conv2d_weight(x, module.weight.shape, g, stride=s, padding=p,
                                               groups=G)
    elif method == "unfold_bmm":
        def fn():
            cols = torch.nn.functional.unfold(x, k, padding=p, stride=s)    # (B, C_in k^2, L^2)
            cols = cols.reshape(B * G, (cin // G) * k * k, L * L)
            with ieee_float32_products(x):
                gw = torch.bmm(g.reshape(B * G, cout // G, L * L), cols.transpose(1, 2))
            return gw.reshape(B, *module.weight.shape)
    else:
        conv_sampler = pytest.importorskip("opacus.grad_sample.conv")

        def fn():
            return conv_sampler.compute_conv_grad_sample(module, [x], g)[module.weight]
    with torch.no_grad():
        out = measure(benchmark, case, fn, device=bench_device, repeats=5, min_time=0.1,
                      flops=grad_flops(B, layer), bytes=4 * (x.numel() + g.numel()),
                      positions=L * L, layer=list(layer), batch=B,
                      route=layer_rules.per_sample_route(G, (k, k), (p, p), L * L))
    if method != "summed" and not benchmark.disabled:
        # Every route sums the same L^2 products per value: within gamma_n of
        # the products' magnitudes (n = L^2 terms, float32) of the float64 sum.
        n, u = L * L, 2.0 ** -24
        with torch.no_grad():
            ref = layer_rules._conv_per_sample(module, x.double(), g.double())
            mag = layer_rules._conv_per_sample(module, x.double().abs(), g.double().abs())
        bound = (n * u / (1 - n * u)) * mag + u * ref.abs()
        assert bool(((out.double() - ref).abs() <= bound).all()), method
