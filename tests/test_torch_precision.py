"""Issue 25 (layers): LayerNorm over several dimensions, and half-precision
parameters, in GhostClipper.

LayerNorm((4, 6)) crashed inside backward (its rule flattened only the last
dimension as features).  Must be exact: the private gradient equals the
clipped sum of torch.func's per-sample gradients in float64, relative 1e-10
(test_torch_layers.py's tolerance: the clip factor's rounding is 1e-15
relative), batch-first and sequence-first.

A model cast to bfloat16/float16 failed at privatize_ (the clip op takes
float32/float64 only).  Now supported: each half layer's recorded tensors are
upcast to float32 (exact), norms (float64), clipped sums and noise computed in
float32, and the result rounded to the parameter's dtype once.  Oracle: the
same model in float32 (parameters upcast exactly) on the same inputs, with
the same noise; every layer of the test model reads the model's input and its
output gradient is the loss's fixed coefficients, so both see the same
float32 values and the half result must be the float32 one rounded once,
bit for bit.
"""
import copy
import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ncdp_fast import GhostBlock  # noqa: E402
from ncdp_fast._stream import NoiseReuseWarning  # noqa: E402
from ncdp_fast.torch import GhostClipper, register_layer  # noqa: E402
from ncdp_fast.torch.layers import RULES  # noqa: E402

from test_attacks_batch import _check_exact  # noqa: E402
from test_torch_layers import Scale  # noqa: E402

F64 = torch.float64


# ---------------------------------------------------- LayerNorm over k dims

class NormNet(nn.Module):
    """(B, P, *shape) (or (P, B, *shape) sequence-first) -> Linear on the last
    dimension -> LayerNorm(shape) -> head over the flattened features, mean
    over the P positions."""

    def __init__(self, shape, batch_first=True, **ln_kw):
        super().__init__()
        self.shape, self.batch_first = shape, batch_first
        self.inp = nn.Linear(shape[-1], shape[-1])
        self.ln = nn.LayerNorm(shape, **ln_kw)
        self.head = nn.Linear(math.prod(shape), 3)

    def forward(self, x):
        h = self.ln(torch.tanh(self.inp(x))).flatten(-len(self.shape))
        return self.head(h).mean(1 if self.batch_first else 0)


LN_CASES = {
    "2d_affine": ((4, 6), {}),
    "2d_no_bias": ((4, 6), dict(bias=False)),
    "3d_affine": ((2, 3, 4), {}),
    # No parameter in the norm: its output layout still passes through.
    "2d_no_affine": ((4, 6), dict(elementwise_affine=False)),
}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", sorted(LN_CASES))
def test_multi_dim_layer_norm_is_exact(case, batch_first):
    shape, kw = LN_CASES[case]
    torch.manual_seed(11)
    model = NormNet(shape, batch_first, **kw).double()
    with torch.no_grad():           # affine parameters away from their 1 / 0 start
        for p in model.ln.parameters():
            p.add_(0.3 * torch.randn_like(p))
    B, P = 5, 3
    g = torch.Generator().manual_seed(12)
    lead = (B, P) if batch_first else (P, B)
    x = torch.randn(*lead, *shape, generator=g, dtype=F64)
    y = torch.randint(0, 3, (B,), generator=g)
    _check_exact(model, x, y, 0 if batch_first else 1, batch_first=batch_first)


# ------------------------------------------------------ half-precision params

class Branches(nn.Module):
    """One trainable layer of each rule kind, each on a model input: a linear
    layer on (B, T, 6), a LayerNorm((4, 6)), an embedding (B, T), a
    convolution (B, 2, L).  Output (B, N)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.ln = nn.LayerNorm((4, 6))
        self.emb = nn.Embedding(7, 3)
        self.conv = nn.Conv1d(2, 3, 3)

    def forward(self, x, z, tok, c):
        parts = (self.lin(x), self.ln(z), self.emb(tok), self.conv(c))
        return torch.cat([p.flatten(1) for p in parts], 1)


def _branch_inputs(dtype, B=6, T=4):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(B, T, 6, generator=g)
    z = 2 * torch.randn(B, 4, 6, generator=g) + 1
    tok = torch.randint(0, 7, (B, T), generator=g)
    c = torch.randn(B, 2, 5, generator=g)
    # Every input and coefficient exact in the half dtype, so that the
    # float32 twin sees the same values.
    return [t.to(dtype) if t.is_floating_point() else t for t in (x, z, tok, c)]


def _step(model, inputs, coef, *, C, sigma, seed, clipping="flat"):
    """One step of a sum-reduced linear loss sum(out * coef): each layer's
    output gradient is a slice of coef, exactly, in any dtype."""
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=4,
                           loss_reduction="sum", clipping=clipping, seed=seed, offset=0)
    try:
        (model(*inputs) * coef).sum().backward()
        res = clipper.privatize_()
    finally:
        clipper.remove()
    return res


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_parameters_are_the_float32_step_rounded_once(dtype, clipping):
    torch.manual_seed(22)
    half = Branches().to(dtype)
    f32 = copy.deepcopy(half).float()                   # exact: every half is a float32
    inputs = _branch_inputs(dtype)
    coef = torch.randn(6, 5 * 4 + 24 + 3 * 4 + 3 * 3, generator=torch.Generator().manual_seed(23))
    coef = coef.to(dtype)
    # C between the two smallest per-sample norms: all samples but one clipped.
    probe = _step(copy.deepcopy(f32), [t.float() if t.is_floating_point() else t for t in inputs],
                  coef.float(), C=1e9, sigma=0.0, seed=1)
    norms = probe.norms.sort().values
    C = float(norms[0] + norms[1]) / 2

    res32 = _step(f32, [t.float() if t.is_floating_point() else t for t in inputs], coef.float(),
                  C=C, sigma=0.5, seed=24, clipping=clipping)
    # The same noise on purpose: the twin redraws the float32 step's range.
    with pytest.warns(NoiseReuseWarning):
        res = _step(half, inputs, coef, C=C, sigma=0.5, seed=24, clipping=clipping)
    if clipping == "flat":
        assert 1 <= res.num_clipped < 6
    assert torch.equal(res.norms, res32.norms)
    for (name, p), q in zip(half.named_parameters(), f32.parameters()):
        assert p.grad.dtype == dtype, name
        assert torch.equal(p.grad, q.grad.to(dtype)), name
        # The rounding to the half dtype is real (not a float32 value kept).
        assert not torch.equal(p.grad.float(), q.grad), name


def test_half_parameter_unused_in_a_step_gets_float32_noise_rounded_once():
    torch.manual_seed(25)

    class Spare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.spare = nn.Linear(3, 2)        # not used by the forward

        def forward(self, x):
            return self.used(x)
    half = Spare().to(torch.bfloat16)
    f32 = copy.deepcopy(half).float()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(26)).to(torch.bfloat16)
    coef = torch.randn(3, 2, generator=torch.Generator().manual_seed(27)).to(torch.bfloat16)
    _step(f32, [x.float()], coef.float(), C=1.0, sigma=1.0, seed=28)
    with pytest.warns(NoiseReuseWarning):
        _step(half, [x], coef, C=1.0, sigma=1.0, seed=28)
    for p, q in zip(half.parameters(), f32.parameters()):
        assert p.grad.dtype == torch.bfloat16
        assert torch.equal(p.grad, q.grad.to(torch.bfloat16))


def test_float16_gradient_overflowing_on_rounding_is_refused_and_nothing_written():
    """Noise std 1e6: an entry stays within float16's 65504 with probability
    P(|N(0,1)| < 0.0655) = 0.052, so some entry of the 10 overflows with
    probability 1 - 0.052^10 (fixed seed: a false alarm rate of 1.4e-13 when
    the seed is changed).  Rounding gives inf, which would step the weights to
    inf.  Refused, naming the parameter, its dtype and the alternatives."""
    torch.manual_seed(29)
    model = nn.Sequential(nn.Linear(4, 2)).to(torch.float16)
    x = torch.randn(3, 4).to(torch.float16)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1e6,
                           expected_batch_size=1, loss_reduction="sum", seed=31)
    model(x).sum().backward()
    with pytest.raises(ValueError, match=r"parameter '0\.(weight|bias)' overflows torch\.float16 .*"
                                         r"float32 and run the forward under torch\.autocast"):
        clipper.privatize_()
    assert all(p.grad is None for p in model.parameters())
    # The step is discarded: a retry cannot release the same batch again.
    with pytest.raises(RuntimeError, match="no forward/backward was recorded"):
        clipper.privatize_()
    clipper.remove()


@pytest.fixture
def half_ghost_rule():
    """Scale (y = x * w per feature) given a rule that returns a GhostBlock."""
    @register_layer(Scale)
    def rule(module, calls, trainable):
        x, g = calls[0].inputs[0], calls[0].grad
        per = (x * g).to(F64)
        return [(("w",), GhostBlock(per.square().sum(1), lambda f: (per * f[:, None]).sum(0)
                                    .to(module.w.dtype), tuple(module.w.shape), 2,
                                    dtype=module.w.dtype))]
    yield
    RULES.pop(Scale)


def test_user_ghost_block_in_half_dtype_is_refused_naming_the_layer(half_ghost_rule):
    model = nn.Sequential(Scale(3)).to(torch.bfloat16)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=2, seed=30)
    x = torch.randn(2, 3).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"rule of Scale \('0'\) returned a GhostBlock for "
                                        r"\['w'\] of dtype torch\.bfloat16, expected "
                                        r"torch\.float32"):
        model(x).sum().backward()
    assert model[0].w.grad is None
    clipper.remove()


def test_autocast_half_gradients_of_float32_layers_are_taken_in_float32():
    """Under torch.autocast(bfloat16) a float32 layer records its float32
    input and receives a bfloat16 output gradient; the rules get both in
    float32 (the recorder's upcast, exact), where a sequence linear layer's
    instantiated per-sample gradient (2 T^2 > K d: one batched GEMM) and a
    LayerNorm's product failed on the mixed dtypes.  With nothing clipped and
    no noise, each parameter's private gradient of a summed loss is the float32
    sum of its per-sample gradients from the recorded input and the bfloat16
    gradient: within gamma_n of their float64 sum."""
    import numpy as np

    from conftest import assert_within_sum_bound
    B, T = 3, 20
    torch.manual_seed(11)
    lin, norm = nn.Linear(4, 3), nn.LayerNorm(3)
    head = nn.Linear(3 * T, 2)
    head.requires_grad_(False)
    model = nn.Sequential(lin, norm, nn.Flatten(), head)
    seen = {}

    def keep(name):
        def hook(module, inputs, output):
            seen[name + ".x"] = inputs[0].detach()
            output.register_hook(lambda g: seen.update({name + ".g": g}))
        return hook
    clipper = GhostClipper(model, max_grad_norm=1e6, noise_multiplier=0.0,
                           expected_batch_size=float(B), loss_reduction="sum", seed=5)
    # After the clipper's own hooks: its output is the one the gradient reaches.
    lin.register_forward_hook(keep("lin"))
    norm.register_forward_hook(keep("norm"))
    x = torch.randn(B, T, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    nn.functional.cross_entropy(out.float(), torch.tensor([0, 1, 0]), reduction="sum").backward()
    clipper.privatize_()
    assert seen["lin.g"].dtype == torch.bfloat16 and seen["lin.x"].dtype == torch.float32
    a, g = seen["lin.x"].double(), seen["lin.g"].double()
    xhat = nn.functional.layer_norm(seen["norm.x"].double(), (3,), eps=norm.eps)
    gn = seen["norm.g"].double()
    n = B * T + 4       # float32 sums over B T products, the scaling and the noise's add
    for got, expected, magnitude in [
            (lin.weight.grad, torch.einsum("btk,btd->kd", g, a),
             torch.einsum("btk,btd->kd", g.abs(), a.abs())),
            (lin.bias.grad, g.sum((0, 1)), g.abs().sum((0, 1))),
            (norm.weight.grad, (gn * xhat).sum((0, 1)), (gn * xhat).abs().sum((0, 1)))]:
        assert got.dtype == torch.float32
        assert_within_sum_bound(got.double().numpy(), expected.numpy(), magnitude.numpy(), n,
                                np.float32)


@pytest.mark.parametrize("clipping, C", [("flat", 1.0), ("per_layer", [0.5] * 4)])
def test_float32_and_float64_layers_in_one_model_are_refused_naming_them(clipping, C):
    """One clip op takes one dtype: its refusal named an internal block index
    ("activations[1]", "activations[2]" under per_layer), not the layers (the
    sixth audit).  Now the step names them by dtype; nothing written or drawn,
    and a bfloat16 layer beside float32 ones still steps (its dtype is float32's)."""
    class Mixed(nn.Module):
        def __init__(self, other):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3).to(other)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)).to(self.b.weight.dtype))

    model = Mixed(torch.float64)
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=3,
                           clipping=clipping)
    model(torch.randn(3, 4)).sum().backward()
    offset = clipper.offset
    with pytest.raises(TypeError, match=r"different dtypes \(float32: \['a\.weight'\]; "
                                        r"float64: \['b\.weight'\]\)"):
        clipper.privatize_()
    assert clipper.offset == offset and model.a.weight.grad is None
    model = Mixed(torch.bfloat16)
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=3,
                           clipping=clipping, loss_reduction="sum")
    model(torch.randn(3, 4)).float().sum().backward()
    clipper.privatize_()
    assert model.b.weight.grad.dtype == torch.bfloat16


def _clipped_sum_of_copies(B, dtype, reduction, model_half):
    """The clipped sum (sigma 0, C = 0.05: every sample clipped) of B copies
    of one sample through a linear layer, its forward in ``dtype`` (autocast,
    or the model converted), times the expected batch size for a mean."""
    torch.manual_seed(1)
    model = nn.Linear(8, 4)
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(3)).repeat(B, 1) * 0.5
    if model_half:
        model, x = model.to(dtype), x.to(dtype)
    clipper = GhostClipper(model, max_grad_norm=0.05, noise_multiplier=0.0,
                           expected_batch_size=64.0, loss_reduction=reduction, seed=None)
    with torch.autocast("cpu", dtype=dtype, enabled=not model_half):
        out = model(x)
    nn.functional.cross_entropy(out.float(), torch.full((B,), 2), reduction=reduction).backward()
    try:
        clipper.privatize_()
    finally:
        clipper.remove()
    return torch.cat([p.grad.double().flatten() for p in model.parameters()]) * (
        64.0 if reduction == "mean" else 1.0)


@pytest.mark.parametrize("model_half", [False, True], ids=["autocast", "half-model"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_batch_mean_with_half_gradients_is_refused_a_sum_is_exact(dtype, model_half):
    """A mean loss's 1/B was rounded into each sample's half gradient, to a
    value that depends on B: removing one of B = 999 copies of a sample moved
    the clipped sum by 1.42 C under bfloat16 autocast (1.65 C at B = 4096
    under float16; the eighth audit).  Refused at the step, before any draw;
    the summed loss's half gradients do not depend on B: under autocast
    (float32 parameters) removing one copy moves the clipped sum by C (every
    copy clipped), within float32 rounding of the 999-term sum; a half model's
    sum is then rounded to its dtype, post-processing whose error (up to
    2^-8 of a 50 C sum in bfloat16) hides that C, so the sum is run there only
    to show it is not refused."""
    with pytest.raises(ValueError, match=rf"layer '<model>''s output gradient arrived in "
                                         rf"{dtype} .* loss_reduction='mean'.* Use a summed loss"):
        _clipped_sum_of_copies(999, dtype, "mean", model_half)
    moved = (_clipped_sum_of_copies(999, dtype, "sum", model_half)
             - _clipped_sum_of_copies(998, dtype, "sum", model_half)).norm() / 0.05
    if not model_half:
        assert abs(float(moved) - 1.0) < 999 * 2.0 ** -23


def test_float16_overflow_in_the_engine_is_accounted_and_its_batch_consumed():
    """A step refused for a float16 overflow has drawn its noise (the refusal
    reads the noised gradient): the engine accounted nothing (epsilon 0 after
    it, and a checkpoint then refused as 'released 1 step, history 0') and
    the next batch was refused as one left without its step (the eighth
    audit).  Now the step is accounted, its batch consumed, and the run goes
    on.  Noise std 1e6 at sigma 1e6: an entry of the 15 overflows 65504 but
    with probability 0.052^15 (fixed seed)."""
    from torch.utils.data import DataLoader, TensorDataset

    from ncdp_fast.torch import PrivacyEngine
    from ncdp_fast.torch.precision import SpentStepError
    torch.manual_seed(0)
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    model = nn.Linear(4, 3).half()
    engine = PrivacyEngine()
    pm, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-9),
        data_loader=DataLoader(TensorDataset(x.half(), y), batch_size=10),
        noise_multiplier=1e6, max_grad_norm=1.0, loss_reduction="sum", seed=7)
    batches = iter(loader)
    xb, yb = next(batches)
    nn.functional.cross_entropy(pm(xb).float(), yb, reduction="sum").backward()
    with pytest.raises(SpentStepError, match="overflows torch.float16.*accounts the step"):
        opt.step()
    assert engine.accountant.total_steps == 1 == pm.clipper.steps
    assert model.weight.grad is None
    opt.noise_multiplier = 1.0
    opt.zero_grad()
    xb, yb = next(batches)
    nn.functional.cross_entropy(pm(xb).float(), yb, reduction="sum").backward()
    opt.step()
    assert engine.accountant.total_steps == 2 == pm.clipper.steps
