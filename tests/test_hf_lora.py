"""LoRA through peft (issue 26): ``get_peft_model`` on tiny random-config
transformers models (nothing downloaded), only the adapters trainable,
privatized as they are.

peft's ``lora.Linear`` wraps the frozen base layer (an ``nn.Linear``, or
GPT-2's ``Conv1D``) and calls its ``lora_A`` / ``lora_B`` ``nn.Linear``s on the
(dropped-out) input, scaled: the adapters go through the Linear rule, and the
frozen base -- attention, MLP, norms, rotary embeddings, GPT-2's Conv1D, with a
rule or without one -- is neither refused nor recorded.

Oracle: each sample's gradient from its own backward (one sample at a time,
the same attention mask row), float64; the expected private gradient is
``sum_i min(1, C/||g_i||) g_i / B``, C between the two smallest norms.
Tolerance relative 1e-10 (float64; the clip factor's rounding margin is
~1e-15).  Dropout 0 in the exactness tests: with dropout the one-at-a-time
oracle would draw other masks.
"""
import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast.torch import GhostClipper, PrivacyEngine, causal_lm_loss  # noqa: E402
from ncdp_fast.torch.layers import RULES  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

V, B, T = 32, 4, 6
F64 = torch.float64


def _llama(dropout=0.0):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16)
    base = transformers.LlamaForCausalLM(cfg).to(F64)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=dropout,
        target_modules=["q_proj", "v_proj", "down_proj"]))
    # peft initialises lora_B to zero: every lora_A gradient would be 0.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return model


def _gpt2(dropout=0.0):
    torch.manual_seed(1)
    # GPT-2's own dropouts off (0.1 by default): the oracle draws other masks.
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=4, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    base = transformers.GPT2LMHeadModel(cfg).to(F64)
    return peft.get_peft_model(base, peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=dropout, target_modules=["c_attn", "c_fc"],
        fan_in_fan_out=True))


def _batch(seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0                       # left padding
    mask[2, 4:] = 0                       # right padding
    return ids, mask


def _loss(model, ids, mask, reduction="mean"):
    logits = model(input_ids=ids, attention_mask=mask).logits
    return causal_lm_loss(logits, ids, attention_mask=mask, reduction=reduction)


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _one_at_a_time(model, ids, mask):
    """(B, P) per-sample gradients of the trainable parameters, each sample's
    own backward."""
    rows = []
    for i in range(B):
        model.zero_grad()
        _loss(model, ids[i:i + 1], mask[i:i + 1], reduction="sum").backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in _trainable(model).values()]))
    return torch.stack(rows)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_lora_model_equals_per_sample_clipping_of_one_sample_at_a_time(make):
    model = make()
    assert all("lora_" in n for n in _trainable(model))
    ids, mask = _batch()
    per = _one_at_a_time(copy.deepcopy(model), ids, mask)
    norms = per.norm(dim=1)
    C = float(norms.sort().values[:2].mean())
    f = (C / norms).clamp(max=1.0)
    assert int((f < 1).sum()) == B - 1
    expected = (per * f.unsqueeze(1)).sum(0) / B
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B,
                           seed=0)
    _loss(model, ids, mask).backward()
    res = clipper.privatize_()
    got = torch.cat([p.grad.reshape(-1) for p in _trainable(model).values()])
    torch.testing.assert_close(torch.as_tensor(res.norms), norms, rtol=1e-10, atol=0)
    assert float((got - expected).norm() / expected.norm()) <= 1e-10
    # The clip moves the result far more than the tolerance.
    assert float((expected - per.sum(0) / B).norm() / expected.norm()) > 1e-3
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_the_frozen_base_is_neither_recorded_nor_clipped(monkeypatch):
    """Rule calls counted: exactly one per adapter Linear per step, none for a
    frozen layer; no hook on any frozen layer; the noise covers the adapters'
    entries only (the stream's offset moves by their count)."""
    calls = []
    linear = RULES[nn.Linear]

    def counting(module, c, trainable):
        calls.append(module)
        return linear(module, c, trainable)
    monkeypatch.setitem(RULES, nn.Linear, counting)
    model = _llama()
    adapters = {id(m) for n, m in model.named_modules() if ".lora_A." in n or ".lora_B." in n}
    assert len(adapters) == 2 * 2 * 3            # A and B, 2 layers, 3 targets
    frozen = [m for m in model.modules() if id(m) not in adapters and
              isinstance(m, (nn.Linear, nn.Embedding)) or type(m).__name__ == "LlamaRMSNorm"]
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in frozen]
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                           seed=0, offset=0)
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in frozen] == before
    assert {id(t.module) for t in clipper.taps} == adapters
    ids, mask = _batch()
    _loss(model, ids, mask).backward()
    clipper.privatize_()
    assert sorted(id(m) for m in calls) == sorted(adapters)
    assert clipper.offset == sum(p.numel() for p in _trainable(model).values())


def test_lora_dropout_runs_and_an_unsupported_adapter_is_refused_by_name():
    """Dropout > 0: the adapters' recorded inputs are the dropped-out ones (the
    private gradient is finite and written for the adapters only).  A LoRA on
    an embedding keeps its adapters as bare Parameters (lora_embedding_A/B):
    no rule, refused, naming them."""
    model = _gpt2(dropout=0.5)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=B,
                           seed=0)
    ids, mask = _batch()
    _loss(model, ids, mask).backward()
    clipper.privatize_()
    assert all(bool(torch.isfinite(p.grad).all()) for p in _trainable(model).values())
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=1, n_head=4, n_positions=16, bos_token_id=0,
        eos_token_id=0))
    emb = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["wte"]))
    with pytest.raises(ValueError, match=r"lora_embedding_A.*no per-sample gradient rule"):
        GhostClipper(emb, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B)


def test_privacy_engine_one_poisson_epoch_of_a_gpt2_lora_model():
    """One Poisson epoch through make_private, as is (dropout on).  An empty
    batch cannot run through transformers' forward (its attention reshapes
    zero rows with -1): ``declare_batch_size(0)`` and the step is pure noise,
    the stream's draws times sigma C / E (checked on the epoch's empty steps:
    a batch of one sample expected, q = 1/12, so that the loader draws empty
    batches; a step must be on the loader's next batch, none can be forced)."""
    model = _gpt2(dropout=0.1)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (12, T), generator=g)
    mask = torch.ones_like(ids)
    loader = DataLoader(TensorDataset(ids, mask), batch_size=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = PrivacyEngine()
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    steps, empty = 0, 0
    for x, m in ploader:
        popt.zero_grad()
        if x.shape[0]:
            _loss(pm, x, m).backward()
        else:
            pm.clipper.declare_batch_size(0)
        popt.step()
        steps += 1
        if not x.shape[0]:
            empty += 1
            res = pm.clipper.last_result
            draws = nf.gaussian(res.draws, seed=0, offset=res.offset, dtype=np.float64)
            noise = torch.cat([p.grad.reshape(-1) for p in _trainable(model).values()])
            assert res.draws == noise.numel()
            torch.testing.assert_close(noise, torch.as_tensor(draws) * 1.0 * 1.0
                                       / popt.expected_batch_size, rtol=1e-15, atol=0)
    assert empty, "seed 0 should give an empty batch (P = (11/12)^12 per step)"
    assert steps == len(loader) and 0 < engine.get_epsilon(1e-5) < float("inf")
    assert sum(h[2] for h in engine.accountant.history) == steps   # the empty steps counted
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != p.requires_grad, n   # only the adapters moved
