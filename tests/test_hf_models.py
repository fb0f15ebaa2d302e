"""Hugging Face models privatized as they are (issue 26): tiny random-config
GPT-2, BERT, RoBERTa, DistilBERT, ViT and LLaMA (rotary embeddings, SwiGLU,
grouped-query attention: 4 query heads on 2 key/value heads), and the
LLaMA-family models whose layers are copies of registered ones (Mistral,
Qwen3, Phi-3, OLMo-2, Gemma), Falcon and DeiT, nothing downloaded.

Oracle.  Each sample's gradient from its own loss on the model run on that
sample alone (its row of input ids and attention mask, padding included;
``torch.autograd.grad``, no clipper attached); expected private gradient
``sum_i min(1, C/||g_i||) g_i / D`` (D = B for a batch-mean loss, 1 for a
sum), the norm over all trainable parameters.  C lies between the two smallest
per-sample norms (one sample unclipped, the rest clipped) and the factor is
checked to move the result by far more than the tolerance.

Losses are per-sample terms computed here from the logits: cross entropy for
classification; for the causal LMs each sample's mean over its own valid
(unpadded, shifted) tokens.  Dropout probabilities are 0 in the configs.

Tolerances.  float64: relative 1e-10 on the whole gradient and on each
parameter (the batched and one-sample computations differ only in the
order of float64 sums, ~1e-15 relative through these depths).  float32: the
clipper's float32 result against the float64 oracle, within 10 times the
relative error E32 of an independent float32 computation of the same
quantity (the one-sample oracle run in float32) -- the rounding scale of
this network in float32, measured, not tuned -- and never below 10 * 2^-23;
the float32 clip factors' own rounding margin is read back and bounded
separately (test_float32_private_gradient_within_its_rounding).
"""
import copy
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ncdp_fast.torch import GhostClipper, PrivacyEngine  # noqa: E402

from test_torch_layers import Scale, clipped_mean, flat_norms, low_bound  # noqa: E402

F32, F64 = torch.float32, torch.float64
V, T, B, LABELS = 97, 8, 4, 3
IMG = 16


# ------------------------------------------------------------------ models

def _gpt2(tie=True):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=tie))


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, num_labels=LABELS,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _roberta():
    return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=40, num_labels=LABELS,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1))


def _distilbert():
    return transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32,
        num_labels=LABELS, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0))


def _vit(**kw):
    cfg = dict(image_size=IMG, patch_size=4, num_channels=3, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg.update(kw)
    return transformers.ViTForImageClassification(transformers.ViTConfig(**cfg))


def _llama(tie=False):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tie))


def _decoder(arch, **kw):
    """A tiny LLaMA-family causal LM of transformers' ``arch`` (Mistral, Qwen3,
    Phi-3, OLMo-2, Gemma): their RMS norms are copies of LLaMA's, T5's or
    Gemma's, matched by their code (hf_layers.source_twin)."""
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg.update(kw)
    return getattr(transformers, f"{arch}ForCausalLM")(
        getattr(transformers, f"{arch}Config")(**cfg))


# name -> (builder, kind): "lm" causal LM, "cls" text classification, "img" images
MODELS = {"gpt2": (_gpt2, "lm"), "bert": (_bert, "cls"), "roberta": (_roberta, "cls"),
          "distilbert": (_distilbert, "cls"), "vit": (_vit, "img"), "llama": (_llama, "lm"),
          "llama_tied": (lambda: _llama(tie=True), "lm"),
          "mistral": (lambda: _decoder("Mistral"), "lm"),
          # per-head q/k norms: an RMS norm over (B, T, heads, head_dim)
          "qwen3": (lambda: _decoder("Qwen3", head_dim=8), "lm"),
          "phi3": (lambda: _decoder("Phi3", resid_pdrop=0.0, embd_pdrop=0.0), "lm"),
          "olmo2": (lambda: _decoder("Olmo2"), "lm"),
          # a distillation token after the class token
          "deit": (lambda: transformers.DeiTForImageClassification(transformers.DeiTConfig(
              image_size=IMG, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=64, num_labels=LABELS,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), "img"),
          # FalconLinear (nn.Linear's forward, rewritten), multi-query attention
          "falcon": (lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
              vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)),
              "lm")}
# Gemma computes its RMS norms in float32 whatever the model's dtype; its own
# test (test_gemma_...) compares against an oracle that rounds alike.
GEMMA = (lambda: _decoder("Gemma", head_dim=8), "lm")


def build(name, dtype=F64, seed=0):
    torch.manual_seed(seed)
    model = MODELS[name][0]().to(dtype)
    return model.train()


def batch(name, n=B, seed=1):
    """A batch of ``n`` samples as tensors with the batch first: text (ids,
    attention mask with right padding on some samples, labels), images
    (pixels, labels)."""
    g = torch.Generator().manual_seed(seed)
    kind = MODELS[name][1]
    y = torch.randint(0, LABELS, (n,), generator=g)
    if kind == "img":
        return torch.randn(n, 3, IMG, IMG, generator=g, dtype=F64), y
    ids = torch.randint(2, V, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    for i in range(1, n, 2):              # every other sample padded on the right
        mask[i, T - 1 - i % (T - 2):] = 0
    return ids, mask, y


def per_sample_loss(model, name, *sample):
    """(n,) per-sample losses from the logits: cross entropy for classification;
    for a causal LM each sample's mean token loss over its own valid tokens."""
    kind = MODELS[name][1]
    if kind == "img":
        x, y = sample
        logits = model(pixel_values=x.to(next(model.parameters()).dtype)).logits
        return nn.functional.cross_entropy(logits, y, reduction="none")
    ids, mask, y = sample
    logits = model(input_ids=ids, attention_mask=mask).logits
    if kind == "cls":
        return nn.functional.cross_entropy(logits, y, reduction="none")
    labels = ids.masked_fill(mask == 0, -100)[:, 1:]
    tok = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), labels.reshape(-1),
                                      reduction="none", ignore_index=-100).view(labels.shape)
    return tok.sum(1) / (labels != -100).sum(1)


def reduce(losses, reduction):
    return losses.mean() if reduction == "mean" else losses.sum()


# ----------------------------------------------------------------- oracles

def one_at_a_time(model, name, data):
    """{name: (n, *shape)}: each sample's gradient from the model run on it alone."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(data[0].shape[0]):
        loss = per_sample_loss(model, name, *(x[i:i + 1] for x in data)).sum()
        rows.append(torch.autograd.grad(loss, list(params.values())))
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def clipped(ps, C, denom):
    """The expected private gradient, in float64 (``ps`` of any float dtype)."""
    return clipped_mean({k: g.to(F64) for k, g in ps.items()}, C, denom)


def rel_err(got, expected, names=None):
    names = sorted(expected) if names is None else names
    g = torch.cat([got[k].to(F64).reshape(-1) for k in names])
    e = torch.cat([expected[k].to(F64).reshape(-1) for k in names])
    return float((g - e).norm() / e.norm())


def private_step(model, name, data, C, reduction, sigma=0.0):
    """One GhostClipper step on the whole batch; {name: p.grad} and the result."""
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=sigma,
                           expected_batch_size=data[0].shape[0], loss_reduction=reduction,
                           seed=0)
    try:
        reduce(per_sample_loss(model, name, *data), reduction).backward()
        res = clipper.privatize_()
    finally:
        clipper.remove()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    return grads, res, clipper


def cast(data, dtype):
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in data)


# ------------------------------------------------------------------- tests

@pytest.mark.parametrize("name, reduction", [(n, "mean") for n in sorted(MODELS)] +
                         [(n, "sum") for n in ("bert", "gpt2", "vit")])
def test_float64_private_gradient_equals_per_sample_clipping(name, reduction):
    model = build(name)
    data = batch(name)
    ps = one_at_a_time(model, name, data)
    C = low_bound(ps)
    denom = B if reduction == "mean" else 1
    expected = clipped(ps, C, denom)
    plain = {k: g.sum(0) / denom for k, g in ps.items()}
    assert rel_err(plain, expected) > 1e3 * 1e-10          # the factor matters
    got, res, clipper = private_step(copy.deepcopy(model), name, data, C, reduction)
    assert 1 <= res.num_clipped < B
    assert torch.allclose(torch.as_tensor(res.norms, dtype=F64), flat_norms(ps), rtol=1e-10,
                          atol=0)
    assert rel_err(got, expected) <= 1e-10
    whole = float(torch.cat([e.reshape(-1) for e in expected.values()]).norm())
    for k, e in expected.items():
        # Attention key biases have gradient 0 exactly (softmax is invariant
        # to them): both sides are rounding noise, bounded against the whole.
        err = float((got[k].to(F64) - e).norm())
        assert err <= 1e-10 * max(float(e.norm()), 1e-3 * whole), k
    # Every trainable parameter is privatized; a tied head is one parameter.
    assert len(clipper.param_names) == len(expected)


@pytest.mark.parametrize("name", ["gpt2", "bert", "roberta", "distilbert", "vit", "llama",
                                  "qwen3"])
def test_float32_private_gradient_within_its_rounding(name):
    """In float32 the clip op tightens each clipped factor by its rounding
    margin (docs/privacy.md, "The clip bound in floating point"), so the
    result is read back as factors: the least-squares combination of the
    float64 per-sample gradients that it is.  Its residual is float32
    rounding (<= 10 E32, E32 the error of the independent float32 oracle);
    no factor exceeds min(1, C/||g_i||) by more than that rounding (the
    privacy direction); a clipped factor is below it by at most 1e-4 (the
    margin, measured up to 7e-6 on these models)."""
    model64 = build(name)
    data = batch(name)
    ps = one_at_a_time(model64, name, data)
    C = low_bound(ps)
    model32 = copy.deepcopy(model64).to(F32)
    data32 = cast(data, F32)
    e32 = max(rel_err(clipped(one_at_a_time(model32, name, data32), C, B),
                      clipped(ps, C, B)), 2.0 ** -23)
    got, res, _ = private_step(model32, name, data32, C, "mean")
    assert all(g.dtype == F32 for g in got.values())
    assert 1 <= res.num_clipped < B
    names = sorted(ps)
    G = torch.cat([ps[k].reshape(B, -1) for k in names], 1).T                 # (P, B)
    y = torch.cat([got[k].to(F64).reshape(-1) for k in names]) * B
    f = torch.linalg.lstsq(G, y.unsqueeze(1)).solution.squeeze(1)
    assert float((G @ f - y).norm() / y.norm()) <= 10 * e32
    ratio = f / (C / flat_norms(ps)).clamp(max=1.0) - 1
    assert float(ratio.max()) <= 10 * e32, ratio
    assert float(ratio.min()) >= -1e-4, ratio


def test_tied_heads_go_through_the_tied_path():
    """GPT-2's lm_head and LLaMA's with tie_word_embeddings share the input
    embedding's weight: one privatized parameter, listed under the embedding;
    untied LLaMA has two."""
    for name, emb, head in [("gpt2", "transformer.wte.weight", "lm_head.weight"),
                            ("llama_tied", "model.embed_tokens.weight", "lm_head.weight")]:
        model = build(name)
        assert model.lm_head.weight is model.get_input_embeddings().weight
        with GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                          expected_batch_size=B) as c:
            assert emb in c.param_names and head not in c.param_names
    with GhostClipper(build("llama"), max_grad_norm=1.0, noise_multiplier=0.0,
                      expected_batch_size=B) as c:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(c.param_names)


def test_the_llama_under_test_has_rotary_swiglu_and_grouped_query_attention():
    """What the LLaMA exactness tests cover: rotary embeddings (a module with
    no parameter), SwiGLU (gate/up/down Linears, SiLU) and 4 query heads
    sharing 2 key/value heads (k/v projections half the width of q's)."""
    model = build("llama")
    layer = model.model.layers[0]
    assert not list(model.model.rotary_emb.parameters())
    assert layer.self_attn.q_proj.out_features == 2 * layer.self_attn.k_proj.out_features
    assert layer.self_attn.v_proj.out_features == layer.self_attn.k_proj.out_features
    act = layer.mlp.act_fn
    assert type(act).__name__ == "SiLUActivation" and not list(act.parameters())
    assert isinstance(layer.mlp.gate_proj, nn.Linear)


@pytest.mark.parametrize("name", ["gpt2", "bert", "roberta", "distilbert", "vit", "llama",
                                  "qwen3", "gemma"])
def test_privacy_engine_trains_each_model_one_poisson_epoch(name, monkeypatch):
    monkeypatch.setitem(MODELS, "gemma", GEMMA)
    n = 8
    model = build(name, dtype=F32)
    data = cast(batch(name, n=n, seed=3), F32)
    loader = DataLoader(TensorDataset(*data), batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    engine = PrivacyEngine(accountant="rdp")
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=1.0, max_grad_norm=1.0, seed=7)
    steps, losses = 0, []
    for sample in ploader:
        popt.zero_grad()
        if sample[0].shape[0]:
            loss = per_sample_loss(pm, name, *sample).mean()
            loss.backward()
            losses.append(loss.item())
        popt.step()
        steps += 1
    assert steps == len(loader) == 2 and losses
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(before[k], p) for k, p in model.named_parameters())
    eps = engine.get_epsilon(1e-5)
    assert 0 < eps < float("inf")


_GPT2 = []


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 16), C=st.floats(1e-3, 10.0))
def test_one_sample_private_gradient_has_norm_at_most_C(seed, C):
    """A batch of one sample with noise 0 and a sum loss releases that sample's
    clipped contribution: its norm over all parameters is <= C (to float64
    rounding), and equals C, less the clip bound's float64 margin (~1e-11
    here), whenever the sample was clipped."""
    if not _GPT2:
        _GPT2.append(build("gpt2"))
    model = copy.deepcopy(_GPT2[0])
    data = batch("gpt2", n=1, seed=seed)
    got, res, _ = private_step(model, "gpt2", data, C, "sum")
    norm = float(torch.cat([g.reshape(-1) for g in got.values()]).norm())
    assert norm <= C * (1 + 1e-12)
    if res.num_clipped:
        assert norm == pytest.approx(C, rel=1e-9)


# ------------------------------------------------------ single layers

class _Tagger(nn.Module):
    """Tokens + position embeddings (positions (1, T), or (T, 1) sequence-first,
    broadcast over the batch) -> a norm -> a Conv1D-free linear head."""

    def __init__(self, norm, batch_first=True):
        super().__init__()
        self.tok = nn.Embedding(V, 16)
        self.pos = nn.Embedding(T, 16)
        self.norm = norm
        self.head = nn.Linear(16, LABELS)
        self.batch_first = batch_first

    def forward(self, ids):
        t = ids.shape[1] if self.batch_first else ids.shape[0]
        pos = torch.arange(t).unsqueeze(0 if self.batch_first else 1)
        h = self.norm(self.tok(ids) + self.pos(pos))
        return self.head(h).mean(1 if self.batch_first else 0)


def _tagger_exact(norm, batch_first=True):
    torch.manual_seed(0)
    model = _Tagger(norm, batch_first).to(F64).train()
    g = torch.Generator().manual_seed(2)
    ids, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, LABELS, (B,), generator=g)
    rows = []
    params = [p for p in model.parameters()]
    for i in range(B):
        x = ids[i:i + 1] if batch_first else ids[i:i + 1].T
        loss = nn.functional.cross_entropy(model(x), y[i:i + 1])
        rows.append(torch.autograd.grad(loss, params))
    ps = {k: torch.stack([r[j] for r in rows]) for j, (k, _) in enumerate(model.named_parameters())}
    C = low_bound(ps)
    work = copy.deepcopy(model)
    with GhostClipper(work, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B,
                      loss_reduction="sum", batch_first=batch_first, seed=0) as clipper:
        x = ids if batch_first else ids.T
        nn.functional.cross_entropy(work(x), y, reduction="sum").backward()
        res = clipper.privatize_()
    got = {k: p.grad for k, p in work.named_parameters()}
    assert 1 <= res.num_clipped < B
    for k in ps:                      # the position table and the norm's scale included
        assert rel_err(got, clipped(ps, C, 1), [k]) <= 1e-10, k


@pytest.mark.parametrize("batch_first", [True, False])
def test_broadcast_position_ids_and_torch_rms_norm_are_exact(batch_first):
    """Position ids (1, T) -- (T, 1) sequence-first -- looked up once for the
    batch: each sample's gradient of the position table is its own rows."""
    _tagger_exact(nn.RMSNorm(16, eps=1e-6), batch_first)


def test_t5_layer_norm_is_exact():
    from transformers.models.t5.modeling_t5 import T5LayerNorm
    norm = T5LayerNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    _tagger_exact(norm)


@pytest.mark.parametrize("seq", [1, 6])
def test_conv1d_is_exact_as_a_pair_and_instantiated(seq):
    """Conv1D(nf=5, nx=4): T = 1 takes the (swapped) pair, T = 6 the
    instantiated per-sample gradient (2 T^2 = 72 > 5 * 4)."""
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(5, 4), nn.Tanh(), Conv1D(2, 5)).to(F64).train()
    x = torch.randn(B, seq, 4, dtype=F64, generator=torch.Generator().manual_seed(4))
    params = list(model.parameters())
    rows = [torch.autograd.grad(model(x[i:i + 1]).square().sum(), params) for i in range(B)]
    ps = {k: torch.stack([r[j] for r in rows]) for j, (k, _) in enumerate(model.named_parameters())}
    C = low_bound(ps)
    with GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B,
                      loss_reduction="sum", seed=0) as clipper:
        model(x).square().sum().backward()
        res = clipper.privatize_()
    assert 1 <= res.num_clipped < B
    got = {k: p.grad for k, p in model.named_parameters()}
    for k in ps:
        assert got[k].shape == ps[k].shape[1:]
        assert rel_err(got, clipped(ps, C, 1), [k]) <= 1e-10, k


def test_dinov2_layer_scale_is_exact():
    """A LayerScale gain (a bare Parameter multiplying the activations) with a
    rule: the norm slot of the tagger holds LayerNorm then the gain."""
    from transformers.models.dinov2.modeling_dinov2 import Dinov2LayerScale
    gain = Dinov2LayerScale(transformers.Dinov2Config(hidden_size=16, layerscale_value=0.7))
    with torch.no_grad():
        gain.lambda1.uniform_(0.5, 1.5)
    _tagger_exact(nn.Sequential(nn.LayerNorm(16), gain))


def _batched_oracle(model, name, data):
    """{name: (n, *shape)}: each sample's gradient of its own loss on the graph of
    the whole batch (``autograd.grad`` once per sample): the same forward
    arithmetic as the private step, so float32 steps inside a float64 model
    (Gemma's norms) round alike on both sides."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    losses = per_sample_loss(model, name, *data)
    rows = [torch.autograd.grad(losses[i], list(params.values()), retain_graph=True)
            for i in range(losses.shape[0])]
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def test_gemma_norms_scaled_tied_embedding_are_exact(monkeypatch):
    """Gemma: RMS norms of the form (1 + w) * z (GemmaRMSNorm's rule, unit 0),
    a word embedding scaled by sqrt(d) and tied to the head (an index use of
    the tied weight, never the dense per-sample form).  Its norms compute in
    float32 even in a float64 model (``x.float()``), and autograd forms their
    weights' per-sample gradients in float32 (the product g * z and its sum
    over positions): those are compared within 10 * 2^-23 (measured 6.7e-8),
    the rest within 1e-10 of the batched-graph oracle."""
    monkeypatch.setitem(MODELS, "gemma", GEMMA)
    from ncdp_fast.torch import tied
    from ncdp_fast.torch.hf_layers import scale_rule, scaled_embedding_rule  # noqa: F401
    model = build("gemma")
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert type(model.model.embed_tokens).__name__ == "GemmaTextScaledWordEmbedding"
    data = batch("gemma")
    ps = _batched_oracle(model, "gemma", data)
    C = low_bound(ps)
    expected = clipped(ps, C, B)
    uses = []
    real = tied.as_use

    def spy(*a, **k):
        uses.append(real(*a, **k))
        return uses[-1]
    monkeypatch.setattr(tied, "as_use", spy)
    got, res, clipper = private_step(copy.deepcopy(model), "gemma", data, C, "mean")
    assert 1 <= res.num_clipped < B
    assert any(isinstance(u, tied.IndexUse) for u in uses)
    assert not any(isinstance(u, torch.Tensor) for u in uses)
    norms = [k for k in expected if k.endswith("norm.weight")]
    rest = [k for k in expected if k not in norms]
    assert norms and len(clipper.param_names) == len(expected)
    assert rel_err(got, expected, rest) <= 1e-10
    assert rel_err(got, expected, norms) <= 10 * 2.0 ** -23


def _fake_transformers_module(tmp_path, monkeypatch, source):
    """A module named under ``transformers.`` with ``source``, imported from a
    file (so that inspect reads its classes' code), as a model file is."""
    import importlib.util
    name = "transformers.models.ncdp_test_copies.modeling_ncdp_test_copies"
    path = tmp_path / "modeling_ncdp_test_copies.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_a_copy_of_a_registered_norm_takes_its_rule_and_a_changed_copy_is_refused(
        tmp_path, monkeypatch):
    """transformers copies LlamaRMSNorm into each model's file under the model's
    name: a copy (renamed, other comments, docstring and annotations) takes
    its rule and is exact; one whose forward changed (an offset on the
    weight) has no rule and is refused by name."""
    import inspect
    import re

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ncdp_fast.torch import hf_layers
    original = inspect.getsource(LlamaRMSNorm)
    copy_src = original.replace("LlamaRMSNorm", "CopyRMSNorm")
    copy_src = re.sub(r'"""[^"]*"""', '"""Another docstring."""', copy_src, count=1)
    copy_src = copy_src.replace("hidden_states: torch.Tensor) -> torch.Tensor:",
                                "hidden_states):  # a comment")
    assert copy_src.count("a comment") == 1 and "Another docstring" in copy_src
    changed = original.replace("LlamaRMSNorm", "ShiftedRMSNorm").replace(
        "return self.weight * hidden_states", "return (self.weight + 0.5) * hidden_states")
    assert changed != original.replace("LlamaRMSNorm", "ShiftedRMSNorm")
    header = ("import torch\nfrom torch import nn\n"
              "from transformers.integrations import use_kernel_forward_from_hub\n\n")
    mod = _fake_transformers_module(tmp_path, monkeypatch, header + copy_src + "\n\n" + changed)
    assert hf_layers.source_twin(mod.CopyRMSNorm) == \
        "transformers.models.llama.modeling_llama.LlamaRMSNorm"
    assert hf_layers.source_twin(mod.ShiftedRMSNorm) is None
    norm = mod.CopyRMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    _tagger_exact(norm)
    with pytest.raises(ValueError, match=r"ShiftedRMSNorm, which has no per-sample gradient rule"):
        GhostClipper(nn.Sequential(nn.Linear(16, 16), mod.ShiftedRMSNorm(16)).to(F64),
                     max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=B)


def test_a_conv1d_subclass_with_its_own_forward_is_refused():
    from transformers.pytorch_utils import Conv1D

    class Scaled(Conv1D):
        def forward(self, x):
            return 2 * super().forward(x)
    with pytest.raises(ValueError, match=r"'0' \(Scaled\) overrides the forward of Conv1D"):
        _clip(nn.Sequential(Scaled(4, 3)))


# --------------------------------------------------------------- refusals

def _clip(model):
    return GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=B)


def test_vit_dropout_on_the_embeddings_is_refused_naming_it():
    model = build("vit").__class__(transformers.ViTConfig(
        **{**build("vit").config.to_dict(), "hidden_dropout_prob": 0.1}))
    with pytest.raises(ValueError, match=r"'vit\.embeddings' \(ViTEmbeddings\).*p=0\.1.*"
                                         r"hidden_dropout_prob=0\.0"):
        _clip(model)


def test_vit_trainable_mask_token_is_refused_and_a_frozen_one_accepted():
    model = build("vit")
    model.vit.embeddings.mask_token = nn.Parameter(torch.zeros(1, 1, 32, dtype=F64))
    with pytest.raises(ValueError, match=r"'vit\.embeddings'.*mask_token.*requires_grad_"):
        _clip(model)
    model.vit.embeddings.mask_token.requires_grad_(False)
    _clip(model).remove()


def test_vit_interpolated_position_embeddings_are_refused():
    model = build("vit")
    clipper = _clip(model)
    x = torch.randn(B, 3, 2 * IMG, 2 * IMG, dtype=F64)
    out = model(pixel_values=x, interpolate_pos_encoding=True).logits
    with pytest.raises(ValueError, match=r"ViTEmbeddings: got images of size \(32, 32\) and 65 "
                                         r"positions; expected .*\(16, 16\) and 17 positions"):
        out.sum().backward()
    clipper.remove()


def test_a_bare_parameter_without_a_rule_is_refused_naming_it():
    model = build("bert")
    model.bert.encoder.layer[0].output.dense = nn.Sequential(
        model.bert.encoder.layer[0].output.dense, Scale(32).to(F64))
    with pytest.raises(ValueError, match=r"'bert\.encoder\.layer\.0\.output\.dense\.1\.w' "
                                         r"belong to Scale, which has no per-sample gradient "
                                         r"rule.*register_layer"):
        _clip(model)


def test_a_transformers_layer_called_with_a_keyword_input_is_refused():
    from transformers.pytorch_utils import Conv1D

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = Conv1D(3, 4)

        def forward(self, h):
            return self.c(x=h)
    model = Net().to(F64).train()
    with _clip(model):
        out = model(torch.randn(B, 4, dtype=F64))
        with pytest.raises(ValueError, match=r"Conv1D was called without a positional tensor "
                                             r"input.*first positional argument"):
            out.sum().backward()


def test_importing_ncdp_fast_torch_does_not_import_transformers():
    code = ("import sys, ncdp_fast.torch; "
            "sys.exit(1 if 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_transformers_own_whole_batch_token_mean_is_refused_at_the_forward():
    """``model(..., labels=...)`` with -100 among the labels: transformers' loss
    divides by the valid tokens of the whole batch (one sample's padding
    rescales the others' gradients), refused before the forward, as is
    ``num_items_in_batch``; for a peft model too.  Labels without -100 give
    every sample the same count: accepted, and the private gradient equals the
    one from the per-sample token loss to float32 rounding (transformers'
    loss casts the logits to float32: measured 3.7e-8)."""
    model = build("gpt2")
    ids, mask, _ = batch("gpt2")
    padded = ids.masked_fill(mask == 0, -100)
    assert (padded == -100).any()
    with GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                      expected_batch_size=B) as clipper:
        with pytest.raises(ValueError, match=r"labels containing -100.*whole batch.*"
                                             r"causal_lm_loss"):
            model(input_ids=ids, attention_mask=mask, labels=padded)
        with pytest.raises(ValueError, match="num_items_in_batch"):
            model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(28))
        assert all(not t.records for t in clipper.taps)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(build("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with GhostClipper(lora, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=B):
        with pytest.raises(ValueError, match="labels containing -100"):
            lora(input_ids=ids, labels=padded)

    from ncdp_fast.torch import causal_lm_loss
    C = 1e-3                                    # every sample clipped: the scale matters
    grads = []
    for own in (True, False):
        work = copy.deepcopy(model)
        with GhostClipper(work, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B,
                          seed=0) as clipper:
            if own:
                work(input_ids=ids, labels=ids).loss.backward()
            else:
                causal_lm_loss(work(input_ids=ids).logits, ids).backward()
            clipper.privatize_()
        grads.append({k: p.grad for k, p in work.named_parameters()})
    assert rel_err(grads[0], grads[1]) <= 10 * 2.0 ** -23
