"""Everyday training code the private step cannot take exactly is refused by
name, or warned about where torch's own call would mislead (issue 37):
torch.compile, AMP's GradScaler, clip_grad_norm_ before the step, models that
fold each sample into several rows (HF's *ForMultipleChoice); and the shapes
that crashed inside the model (T5 / MPNet at T = 1) are exact."""
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ncdp_fast.torch import GhostClipper, PrivacyEngine, check_exact  # noqa: E402
from ncdp_fast.torch.grad_norm import GradientNotFormedWarning  # noqa: E402
from ncdp_fast.torch.loss_graph import LossRefused  # noqa: E402


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _private(model, **kw):
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    engine = PrivacyEngine()
    pm, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0,
        seed=1, **kw)
    return engine, pm, opt, loader


def _batch(loader):
    for x, y in loader:
        if len(y):
            return x, y
    raise AssertionError("every Poisson batch was empty")


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model, before):
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ------------------------------------------------------------------- compile
@pytest.mark.parametrize("how", ["torch.compile", "Module.compile", "sub-module"])
def test_a_compiled_model_is_refused_at_make_private(how):
    """Before: torch's internal AssertionError ("... is already tracked for
    mutation") at the first forward, or a silent run with Module.compile()."""
    model = _model()
    if how == "torch.compile":
        model = torch.compile(model, backend="eager")
    elif how == "Module.compile":
        model.compile(backend="eager")
    else:
        model[3].compile(backend="eager")
    with pytest.raises(ValueError, match=r"make_private: module: expected an eager model.*"
                                         r"torch\.compile"):
        _private(model)
    with pytest.raises(ValueError, match=r"GhostClipper: module: expected an eager model"):
        GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_compiling_after_make_private_is_refused_before_anything_is_written(how, backend):
    """Before: a step went through under "eager"/"aot_eager" with hooks traced
    by dynamo (exactness unchecked), and inductor was refused with "input of
    layer 'ln' was modified in place" (inductor's own op, not the user's)."""
    torch._dynamo.reset()
    model = _model()
    engine, pm, opt, loader = _private(model)
    run = torch.compile(pm, backend=backend) if how == "torch.compile" else pm
    if how == "Module.compile":
        pm.compile(backend=backend)
    before = _snapshot(model)
    x, y = _batch(loader)
    with pytest.raises(RuntimeError, match=r"ran forward under torch\.compile.*nothing was "
                                           r"written"):
        nn.functional.cross_entropy(run(x), y).backward()
        opt.step()
    assert _unchanged(model, before)
    assert engine.accountant.history == []
    # The compiled graph is cached now: still refused at the next call.
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"torch\.compile"):
        nn.functional.cross_entropy(run(x), y).backward()
        opt.step()
    assert _unchanged(model, before)


@pytest.mark.parametrize("where", ["between layers", "the loss"])
def test_a_compiled_function_in_the_forward_or_the_loss_is_refused(where):
    """The audit of 2026-12-02: torch.compile of a plain function (not a
    module) called between two layers hid its graph from the check --
    ``h - h.mean(0)`` compiled with aot_eager was accepted (relative error
    0.29).  Its node is now refused by name, wherever it sits, before
    anything is written; the same function run eagerly is judged as before."""
    torch._dynamo.reset()
    center = torch.compile(lambda h: torch.tanh(h) - 0.5, backend="aot_eager")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x):
            h = self.a(x)
            return self.b(center(h) if where == "between layers" else h)

    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    loss = torch.compile(lambda o, y: nn.functional.cross_entropy(o, y), backend="aot_eager") \
        if where == "the loss" else nn.functional.cross_entropy
    with GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                      expected_batch_size=5) as clipper:
        with pytest.raises(ValueError, match=r"torch\.compile'd function"):
            loss(model(x), y).backward()
            clipper.privatize_()
        assert all(p.grad is None for p in model.parameters())


def test_an_eager_model_is_not_marked_compiled():
    """The guard itself: an uncompiled model steps, and its weights change."""
    model = _model()
    _, pm, opt, loader = _private(model)
    before = _snapshot(model)
    x, y = _batch(loader)
    nn.functional.cross_entropy(pm(x), y).backward()
    opt.step()
    assert not _unchanged(model, before)


# ---------------------------------------------------------------- GradScaler
def test_grad_scaler_is_refused_by_name_and_the_scaled_backward_never_steps():
    """Before: torch's "No inf checks were recorded for this optimizer" from
    scaler.step (the private gradient does not exist before the step).  Then
    the step refused naming the GradScaler -- but a plain step on the same
    scaled backward went through, every sample clipped at C as if its
    gradient were S times larger (the audit of 2026-12-02).  Now the scaled
    loss itself is refused by the loss check at that step, nothing written,
    nothing drawn, nothing accounted; an unscaled backward then steps."""
    model = _model()
    engine, pm, opt, loader = _private(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = _snapshot(model)
    x, y = _batch(loader)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(pm(x), y)
    scaler.scale(loss).backward()
    offset = opt.clipper.offset
    with pytest.raises(TypeError, match=r"GradScaler.*bfloat16.*no GradScaler"):
        scaler.step(opt)
    assert _unchanged(model, before)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    with pytest.raises(LossRefused, match=r"scalar tensor other than 1: a GradScaler's scale"):
        opt.step()
    assert _unchanged(model, before)
    assert opt.clipper.offset == offset and len(engine.accountant) == 0
    opt.zero_grad()
    nn.functional.cross_entropy(pm(x), y).backward()
    opt.step()
    assert not _unchanged(model, before)
    assert len(engine.accountant) == 1


def test_a_scaled_loss_is_refused_on_every_path_and_fused_under_a_scaler():
    """The audit of 2026-12-02: scaler.scale(loss).backward() then a step
    that no scaler refuses -- GhostClipper with a plain torch optimizer
    (scaler.step unscales what the clipper released: clipped at C / S), or
    make_private's optimizer stepped directly -- and FusedDPOptimizer under
    scaler.step (it clipped the scaled grad_sample, never unscaled).  Each is
    refused by name before a draw; a tensor scale of exactly 1
    (backward(gradient=tensor(1.))) is not a scale and still steps."""
    from ncdp_fast.torch import FusedDPOptimizer, GhostClipper
    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    ce = nn.functional.cross_entropy
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    clipper = GhostClipper(model, max_grad_norm=0.5, noise_multiplier=1.0,
                           expected_batch_size=6, seed=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(ce(model(x), y)).backward()
    with pytest.raises(LossRefused, match=r"GradScaler's scale \(scaler.scale\(loss\)\)"):
        clipper.privatize_()
    assert clipper.offset == 0 and all(p.grad is None for p in model.parameters())
    clipper.clear()
    ce(model(x), y).backward(torch.tensor(1.0))
    clipper.privatize_()
    assert clipper.offset > 0
    clipper.remove()

    _, pm, opt, loader = _private(_model())
    xb, yb = _batch(loader)
    scaler.scale(ce(pm(xb), yb)).backward()
    offset = opt.clipper.offset         # the Poisson sampler's draws share the stream
    with pytest.raises(LossRefused, match="GradScaler"):
        opt.step()
    assert opt.clipper.offset == offset

    opacus = pytest.importorskip("opacus")
    inner = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    gsm = opacus.GradSampleModule(inner, loss_reduction="sum")
    fused = FusedDPOptimizer(torch.optim.SGD(inner.parameters(), lr=1.0), noise_multiplier=1.0,
                             max_grad_norm=0.5, expected_batch_size=6, loss_reduction="sum",
                             seed=3)
    before = [p.detach().clone() for p in inner.parameters()]
    scaler.scale(ce(gsm(x), y, reduction="sum")).backward()
    with pytest.raises(TypeError, match=r"FusedDPOptimizer.step: called through a torch "
                                        r"GradScaler"):
        scaler.step(fused)
    assert all(torch.equal(a, b) for a, b in zip(before, inner.parameters()))
    assert fused.offset == 0


def test_step_with_a_closure_returns_its_loss():
    """torch's contract: optimizer.step(closure) returns the closure's loss
    (the audit of 2026-12-02 found None)."""
    model = _model()
    _, pm, opt, loader = _private(model)
    x, y = _batch(loader)

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(pm(x), y)
        loss.backward()
        return loss
    out = opt.step(closure)
    assert isinstance(out, torch.Tensor) and out.dim() == 0


def test_grad_scaler_after_unscale_is_refused_too():
    """The AMP recipe that unscales first (to clip) reaches the step with
    found_inf set and no scale: refused as well, not stepped at the scale."""
    model = _model()
    _, pm, opt, loader = _private(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = _snapshot(model)
    x, y = _batch(loader)
    scaler.scale(nn.functional.cross_entropy(pm(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(TypeError, match=r"GradScaler"):
        scaler.step(opt)
    assert _unchanged(model, before)


# ----------------------------------------------------------- clip_grad_norm_
def test_clip_grad_norm_before_the_step_warns_and_after_it_reads_the_private_gradient():
    """Before: clip_grad_norm_ after backward silently returned 0.0 (p.grad is
    None until the step).  Now it warns saying why; after the step it sees the
    private gradient, whose norm it returns."""
    model = _model()
    _, pm, opt, loader = _private(model)
    x, y = _batch(loader)
    nn.functional.cross_entropy(pm(x), y).backward()
    with pytest.warns(GradientNotFormedWarning, match=r"formed at optimizer\.step\(\).*"
                                                      r"max_grad_norm=1"):
        got = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1e9)
    assert float(got) == 0.0
    opt.step()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientNotFormedWarning)
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert float(got) > 0


def test_clip_grad_norm_of_other_parameters_does_not_warn():
    model = _model()
    _private(model)
    other = nn.Linear(2, 2)
    other(torch.randn(3, 2)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientNotFormedWarning)
        assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9)) > 0


# ------------------------------------------------------- shapes of HF models
transformers = pytest.importorskip("transformers")


def test_multiple_choice_is_refused_at_the_forward_by_name():
    """Before: a shape error inside BERT's embeddings (the one-row position
    table expanded to B rows where the model had folded B * C).  Now the first
    layer that sees the folded rows refuses, naming the fold."""
    torch.manual_seed(0)
    model = transformers.BertForMultipleChoice(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32))
    B, C, T = 4, 3, 6
    before = _snapshot(model)
    with GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                      expected_batch_size=B) as clipper:
        with pytest.raises(ValueError, match=r"has 12 rows.*step has 4 samples.*"
                                             r"ForMultipleChoice"):
            model(input_ids=torch.randint(0, 50, (B, C, T)),
                  labels=torch.randint(0, C, (B,)))
        clipper.clear()
    assert _unchanged(model, before)


@pytest.mark.parametrize("family", ["t5", "mpnet"])
def test_one_token_sequences_are_exact(family):
    """Before: T5 / MPNet crashed inside the model at T = 1.  With their
    relative-position tables frozen (trainable ones are refused by name,
    test_hf_more_models), a one-token batch is exact against per-sample
    gradients computed one sample at a time."""
    torch.manual_seed(0)
    B = 5
    if family == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0)).double()

        def loss(m, ids, dec, y):
            logits = m(input_ids=ids, decoder_input_ids=dec).logits
            return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                               reduction="sum")
        inputs = (torch.randint(1, 50, (B, 1)), torch.randint(1, 50, (B, 1)),
                  torch.randint(1, 50, (B, 1)))
    else:
        model = transformers.MPNetForSequenceClassification(transformers.MPNetConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            num_labels=3)).double()

        def loss(m, ids, y):
            return nn.functional.cross_entropy(m(input_ids=ids).logits, y, reduction="sum")
        inputs = (torch.randint(3, 50, (B, 1)), torch.randint(0, 3, (B,)))
    for n, m in model.named_modules():
        if n.endswith("relative_attention_bias"):
            m.requires_grad_(False)
    report = check_exact(model, inputs, loss, rtol=1e-9)
    assert report.passed, report


def _replica(module: nn.Module) -> nn.Module:
    """A copy of ``module`` made as torch.nn.parallel.replicate makes one a
    GPU (``_replicate_for_data_parallel``: the hooks' dicts shared, children
    replaced by their own replicas), its parameters the original tensors (the
    broadcast copies need CUDA devices)."""
    replica = module._replicate_for_data_parallel()
    replica._parameters = dict(module._parameters)
    for name, child in module._modules.items():
        replica._modules[name] = _replica(child)
    return replica


@pytest.mark.parametrize("wrapped", ["after", "before"])
def test_data_parallel_replicas_are_refused_before_anything_is_recorded(wrapped):
    """nn.DataParallel on several GPUs runs a replica of the model a GPU, each in
    its own thread, with the recorded modules' hooks: the model wrapped after the
    clipper (its replica's model hook refuses) or the wrapper given to the
    clipper (a replica layer's hook refuses), in either case before any record;
    the original model then steps as if the replica had not run."""
    model = _model()
    root = nn.DataParallel(model) if wrapped == "before" else model
    clipper = GhostClipper(root, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=16, seed=1)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    replica = _replica(model)
    where = "the model" if wrapped == "after" else "layer 'module.0'"
    with pytest.raises(RuntimeError, match=f"GhostClipper: {where} ran forward as a copy .*"
                                           "nn.DataParallel"):
        replica(x[:8])
    nn.functional.cross_entropy(root(x), y).backward()
    clipper.privatize_()
    got = [p.grad.clone() for p in model.parameters()]
    fresh = _model()
    other = GhostClipper(fresh, max_grad_norm=1.0, noise_multiplier=0.0,
                         expected_batch_size=16, seed=1)
    nn.functional.cross_entropy(fresh(x), y).backward()
    other.privatize_()
    for a, b in zip(got, fresh.parameters()):
        assert torch.equal(a, b.grad)


def test_data_parallel_on_one_device_or_none_passes_through():
    """Without several GPUs nn.DataParallel calls the model itself (no replica):
    a clipper of the wrapper steps as one of the plain model does."""
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    grads = []
    for wrap in (False, True):
        model = _model()
        root = nn.DataParallel(model) if wrap else model
        clipper = GhostClipper(root, max_grad_norm=1.0, noise_multiplier=0.0,
                               expected_batch_size=16, seed=1)
        nn.functional.cross_entropy(root(x), y).backward()
        clipper.privatize_()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_copying_or_saving_a_model_with_a_clipper_attached_is_refused_by_name():
    """copy.deepcopy (an EMA or teacher copy) and torch.save of the module reach
    the clipper through its hooks: refused naming the clipper and the ways out;
    after clipper.remove() both work."""
    import copy
    import io
    model = _model()
    engine, pm, opt, loader = _private(model)
    for call in (lambda: copy.deepcopy(model), lambda: copy.deepcopy(pm),
                 lambda: torch.save(model, io.BytesIO())):
        with pytest.raises(TypeError, match="GhostClipper: the clipper is not deep-copied or "
                                            "pickled, nor is what holds it"):
            call()
    bare = _model()
    clipper = GhostClipper(bare, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=16)
    clipper.remove()
    torch.save(copy.deepcopy(bare), io.BytesIO())
