"""More tiny random-config transformers models through ``check_exact``: the
clipper's step (noise 0) against per-sample clipping of gradients computed one
sample at a time, float64, with right padding on every other sample; and the
architectures the clipper refuses, each naming the layer (docs/torch.md,
"Hugging Face models").  tests/test_hf_models.py holds the issue's models and
their own oracle; this file widens the list.  Dropout 0 everywhere (the check
needs a deterministic forward)."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402

from ncdp_fast.torch import causal_lm_loss, check_exact  # noqa: E402

from test_hf_models import B, LABELS, V, batch  # noqa: E402  (text: ids, padded mask, labels)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _lm(cls, **kw):
    cfg = dict(vocab_size=V, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
               pad_token_id=0)
    cfg.update(kw)
    return lambda: getattr(transformers, f"{cls}ForCausalLM")(
        getattr(transformers, f"{cls}Config")(**cfg))


def _cls(cls, config, **kw):
    cfg = dict(vocab_size=V, max_position_embeddings=40, num_labels=LABELS, pad_token_id=1)
    cfg.update(kw)
    return lambda: getattr(transformers, f"{cls}ForSequenceClassification")(
        getattr(transformers, config)(**cfg))


EXACT = {
    "phi": (_lm("Phi", **SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0), "lm"),
    "olmo": (_lm("Olmo", **SMALL, num_key_value_heads=2), "lm"),
    "gpt_neo": (_lm("GPTNeo", hidden_size=32, num_layers=2, num_heads=4,
                    attention_types=[[["global", "local"], 1]], embed_dropout=0.0,
                    attention_dropout=0.0, resid_dropout=0.0), "lm"),
    "gptj": (_lm("GPTJ", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "lm"),
    "gpt_neox": (_lm("GPTNeoX", **SMALL, hidden_dropout=0.0, attention_dropout=0.0), "lm"),
    "bloom": (_lm("Bloom", hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                  attention_dropout=0.0), "lm"),
    "stablelm": (_lm("StableLm", **SMALL, num_key_value_heads=2, hidden_dropout=0.0,
                     attention_dropout=0.0), "lm"),
    "starcoder2": (_lm("Starcoder2", **SMALL, num_key_value_heads=2, residual_dropout=0.0,
                       embedding_dropout=0.0, attention_dropout=0.0), "lm"),
    "qwen2": (_lm("Qwen2", **SMALL, num_key_value_heads=2), "lm"),
    "gemma2": (_lm("Gemma2", **SMALL, num_key_value_heads=2, head_dim=8), "lm"),
    "albert": (_cls("Albert", "AlbertConfig", embedding_size=16, **SMALL, **NO_DROP,
                    classifier_dropout_prob=0.0), "cls"),
    "electra": (_cls("Electra", "ElectraConfig", embedding_size=16, **SMALL, **NO_DROP), "cls"),
    "deberta_v2": (_cls("DebertaV2", "DebertaV2Config", **SMALL, **NO_DROP), "cls"),
    "xlm_roberta": (_cls("XLMRoberta", "XLMRobertaConfig", **SMALL, **NO_DROP), "cls"),
    "modernbert": (_cls("ModernBert", "ModernBertConfig", **SMALL, embedding_dropout=0.0,
                        attention_dropout=0.0, mlp_dropout=0.0, bos_token_id=0, eos_token_id=0,
                        cls_token_id=0, sep_token_id=0), "cls"),
    "gpt2_cls": (_cls("GPT2", "GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=32,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0), "cls"),
    "llama_cls": (_cls("Llama", "LlamaConfig", **SMALL, num_key_value_heads=2,
                       pad_token_id=0), "cls"),
}
# Gemma 2's norms compute in float32 inside a float64 model (x.float()):
# autograd's per-sample gradients of their weights round at ~1e-7.
RTOL = {"gemma2": 1e-6}

REFUSED = {
    "opt": (_lm("OPT", hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, pad_token_id=1),
            "OPTLearnedPositionalEmbedding"),
    "deberta": (_cls("Deberta", "DebertaConfig", **SMALL, **NO_DROP), "Deberta"),
    "mpnet": (_cls("MPNet", "MPNetConfig", **SMALL, **NO_DROP), "relative_attention_bias"),
    "beit": (lambda: transformers.BeitForImageClassification(transformers.BeitConfig(
        image_size=16, patch_size=4, num_channels=3, **SMALL, num_labels=LABELS, **NO_DROP)),
        "BeitEmbeddings"),
    "swin": (lambda: transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1],
        num_heads=[2, 2], window_size=4, num_labels=LABELS, **NO_DROP, drop_path_rate=0.0)),
        "SwinRelativePositionBias"),
}


def _lm_loss(m, ids, mask, y):
    return causal_lm_loss(m(input_ids=ids, attention_mask=mask).logits, ids,
                          attention_mask=mask, reduction="sum")


def _cls_loss(m, ids, mask, y):
    return nn.functional.cross_entropy(m(input_ids=ids, attention_mask=mask).logits, y,
                                       reduction="sum")


@pytest.mark.parametrize("name", sorted(EXACT))
def test_more_models_are_exact(name):
    build, kind = EXACT[name]
    torch.manual_seed(0)
    model = build()
    report = check_exact(model, batch("bert"), _lm_loss if kind == "lm" else _cls_loss,
                         rtol=RTOL.get(name, 1e-9))
    assert report.passed, report


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_architectures_without_a_rule_are_refused_by_name(name):
    from ncdp_fast.torch import GhostClipper
    build, layer = REFUSED[name]
    torch.manual_seed(0)
    model = build().double().train()
    if name in ("beit", "swin"):
        x = torch.randn(B, 3, 16, 16, dtype=torch.float64)
        y = torch.randint(0, LABELS, (B,))

        def run(m):
            return nn.functional.cross_entropy(m(pixel_values=x).logits, y)
    else:
        ids, mask, y = batch("bert")

        def run(m):
            out = m(input_ids=ids, attention_mask=mask).logits
            return out.sum() if out.dim() == 3 else nn.functional.cross_entropy(out, y)
    # Refused when the clipper is built, or (a layer whose rows are not the
    # batch's) at the step: never a gradient.
    with pytest.raises(ValueError, match=layer):
        with GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                          expected_batch_size=B) as clipper:
            run(model).backward()
            clipper.privatize_()


@pytest.mark.parametrize("family", ["t5", "mpnet"])
def test_relative_position_bias_tables_are_refused_at_construction_whatever_the_sizes(family):
    """Issue 35, item 1 (attack): T5's and MPNet's relative-attention-bias
    embedding is looked up with a (T, T) index shared by the batch. At B == T
    its rows passed the "rows are the samples" check and were clipped as
    samples (the audit: 2.40 C, 7.58 C with only the tables trainable); at
    B != T the step was refused. Now refused by name when the clipper is
    built, whatever B and T; frozen, the model trains (B == T == 8 here)."""
    from ncdp_fast.torch import GhostClipper
    torch.manual_seed(0)
    if family == "t5":
        model = transformers.T5EncoderModel(transformers.T5Config(
            vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
            dropout_rate=0.0)).double()
    else:
        model = transformers.MPNetModel(transformers.MPNetConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0), add_pooling_layer=False).double()
    tables = [n for n, _ in model.named_modules() if n.endswith("relative_attention_bias")]
    assert tables
    with pytest.raises(ValueError, match=r"relative-position bias table.*requires_grad_\(False\)"):
        GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=8)
    for n in tables:
        model.get_submodule(n).requires_grad_(False)
    ids = torch.randint(1, 50, (8, 8))

    def loss(m, ids, mask, y):
        return m(input_ids=ids).last_hidden_state.square().sum()
    report = check_exact(model, (ids, None, None), loss, rtol=1e-9)
    assert report.passed, report
