"""Token-level losses (issue 26): ``per_sample_token_loss`` / ``causal_lm_loss`` /
``TokenCrossEntropyLoss`` with an attention mask, ``ignore_index`` and the
causal shift.

Oracle: each sample's loss computed alone, one sample at a time, from the
tokens it scores picked out by hand (a Python loop over positions), and
transformers' own ``ForCausalLMLoss`` on a batch of one sample (the same
shift convention).  float64: the two sides add the same terms in possibly
different orders; relative 1e-12 (a mean of at most 7 terms of size ~3).
"""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from ncdp_fast.torch import (TokenCrossEntropyLoss, causal_lm_loss,  # noqa: E402
                             per_sample_token_loss)

N, L, V = 5, 7, 6
F64 = torch.float64


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, L, V, generator=g, dtype=F64)
    target = torch.randint(0, V, (N, L), generator=g)
    target[1, 2] = target[3, 5] = -100                  # ignored tokens
    mask = torch.ones(N, L, dtype=torch.long)
    mask[0, 4:] = 0                                     # right padding
    mask[2, :3] = 0                                     # left padding
    mask[4, :] = 0                                      # a sample with no token at all
    return logits, target, mask


def _one_sample(logits, target, mask, shift):
    """Sample-alone loss: positions scored picked by hand, mean of their terms."""
    terms = []
    for t in range(L):
        u = t + 1 if shift else t                       # the token position t is scored on
        if u >= L or mask[u] == 0 or target[u] == -100:
            continue
        terms.append(F.cross_entropy(logits[t:t + 1], target[u:u + 1]))
    return torch.stack(terms).mean() if terms else logits.new_zeros(())


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_equals_each_sample_computed_alone(shift, reduction):
    logits, target, mask = _batch()
    alone = torch.stack([_one_sample(logits[i], target[i], mask[i], shift) for i in range(N)])
    assert float(alone[4]) == 0.0 and bool((alone[:4] > 0).all())
    expected = {"none": alone, "sum": alone.sum(), "mean": alone.sum() / N}[reduction]
    got = per_sample_token_loss(logits, target, attention_mask=mask, shift=shift,
                                reduction=reduction)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    # Each sample's term is its own: alone in a batch of one, the same value.
    for i in range(N):
        one = per_sample_token_loss(logits[i:i + 1], target[i:i + 1],
                                    attention_mask=mask[i:i + 1], shift=shift, reduction="sum")
        torch.testing.assert_close(one, alone[i], rtol=1e-12, atol=0)


def test_the_criterion_and_causal_lm_loss_are_the_same_function():
    logits, target, mask = _batch(1)
    ref = per_sample_token_loss(logits, target, attention_mask=mask, shift=True, reduction="sum")
    assert torch.equal(causal_lm_loss(logits, target, attention_mask=mask, reduction="sum"), ref)
    crit = TokenCrossEntropyLoss(shift=True, reduction="sum")
    assert torch.equal(crit(logits, target, attention_mask=mask), ref)
    assert torch.equal(TokenCrossEntropyLoss()(logits, target),
                       per_sample_token_loss(logits, target))


def test_a_sample_without_tokens_contributes_zero_gradient():
    logits, target, mask = _batch(2)
    logits.requires_grad_(True)
    per_sample_token_loss(logits, target, attention_mask=mask, shift=True).backward()
    assert bool((logits.grad[4] == 0).all())
    assert bool((logits.grad[0, 3:] == 0).all())        # predicts padding from t = 3 on
    assert bool((logits.grad[:, L - 1] == 0).all())     # the last position predicts nothing


def test_equals_transformers_causal_lm_loss_for_one_sample_and_not_for_a_batch():
    """ForCausalLMLoss (transformers' default for *ForCausalLM) on one sample is
    ``causal_lm_loss``; on the batch it is the mean over all the batch's
    tokens, which differs as soon as the samples' token counts differ."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    logits, target, mask = _batch(3)
    labels = target.masked_fill(mask == 0, -100)        # how transformers marks padding
    for i in range(N - 1):
        hf = loss_utils.ForCausalLMLoss(logits[i:i + 1], labels[i:i + 1], vocab_size=V)
        ours = causal_lm_loss(logits[i:i + 1], labels[i:i + 1])
        torch.testing.assert_close(ours, hf.to(F64), rtol=1e-6, atol=0)   # HF upcasts to float32
    hf_batch = loss_utils.ForCausalLMLoss(logits.float(), labels, vocab_size=V)
    ours = causal_lm_loss(logits.float(), labels)
    assert abs(float(hf_batch) - float(ours)) > 1e-3


def test_refuses_mismatched_shapes_and_types():
    logits, target, mask = _batch()
    with pytest.raises(ValueError, match=r"target: expected a \(5, 7\) tensor.*got \(5, 6\)"):
        per_sample_token_loss(logits, target[:, 1:])
    with pytest.raises(ValueError, match=r"logits: expected a float \(N, L, V\) tensor.*\(35, 6\)"):
        per_sample_token_loss(logits.reshape(N * L, V), target)
    with pytest.raises(ValueError, match=r"attention_mask: expected a \(5, 7\) tensor.*\(5, 8\)"):
        causal_lm_loss(logits, target, attention_mask=torch.ones(N, L + 1))
    with pytest.raises(ValueError, match=r"attention_mask: expected only 0 \(padding\) and 1"):
        causal_lm_loss(logits, target, attention_mask=mask * 2)
    with pytest.raises(TypeError, match=r"target: expected an integer tensor.*float64"):
        per_sample_token_loss(logits, target.to(F64))
    with pytest.raises(TypeError, match="shift"):
        TokenCrossEntropyLoss(shift="yes")


def test_a_criterion_of_the_clipper_matches_per_sample_clipping():
    """A tiny LM under GhostClipper (noise 0, float64) with causal_lm_loss: its
    private gradient is the clipped mean of per-sample gradients, each sample's
    computed alone (its own backward), so padding in one sample leaves the
    others' terms unchanged."""
    from ncdp_fast.torch import GhostClipper
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 4), nn.Linear(4, V)).double()
    _, ids, mask = _batch(4)
    ids = ids.clamp(min=0)
    per = []
    for i in range(N):
        model.zero_grad()
        causal_lm_loss(model(ids[i:i + 1]), ids[i:i + 1], attention_mask=mask[i:i + 1],
                       reduction="sum").backward()
        per.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    per = torch.stack(per)
    norms = per.norm(dim=1)
    C = float(norms[:4].sort().values[1])
    expected = (per * (C / norms).clamp(max=1.0).nan_to_num(1.0).unsqueeze(1)).sum(0) / N
    model.zero_grad()
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=N,
                           seed=0)
    causal_lm_loss(model(ids), ids, attention_mask=mask).backward()
    clipper.privatize_()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
