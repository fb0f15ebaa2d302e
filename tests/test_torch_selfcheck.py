"""check_exact: the clipper's step on a batch against per-sample clipping of
gradients computed one sample at a time, on models that are exact, models that
mix samples where the clipper cannot see it, and bad arguments."""
import os

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ncdp_fast.torch import check_exact, causal_lm_loss  # noqa: E402

F64 = torch.float64


def _mlp(extra=None):
    torch.manual_seed(0)
    layers = [nn.Linear(5, 8)] + ([extra] if extra is not None else []) + [nn.Tanh(),
                                                                            nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def _batch(n=6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _ce_sum(m, x, y):
    return nn.functional.cross_entropy(m(x), y, reduction="sum")


class _Center(nn.Module):
    """Subtracts the batch mean: every sample's output depends on the others."""

    def forward(self, x):
        return x - x.mean(0)


@pytest.mark.parametrize("n", [1, 2, 6])
def test_an_exact_model_passes_and_is_left_unchanged(n):
    model = _mlp()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    report = check_exact(model, _batch(n), _ce_sum)
    assert report.passed and report.samples == n
    # float64 rounding of both sides (measured ~1e-14), far below the default rtol
    assert report.max_rel_error <= 1e-12 and report.norms_rel_error <= 1e-12
    assert report.max_grad_norm > 0
    assert all(p.dtype == torch.float32 and torch.equal(p, before[k])
               for k, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_shared_arguments_go_to_every_call():
    """A 0-d tensor and a non-tensor are passed whole to the batch's and each
    sample's call."""
    seen = []

    def loss(m, x, y, temperature, tag):
        seen.append((temperature.dim(), tag, x.shape[0]))
        return nn.functional.cross_entropy(m(x) / temperature, y, reduction="sum")
    x, y = _batch(3)
    report = check_exact(_mlp(), (x, y, torch.tensor(2.0), "t"), loss)
    assert report.passed and report.samples == 3
    assert {(d, t) for d, t, _ in seen} == {(0, "t")} and {n for *_, n in seen} == {1, 3}


def test_samples_mixed_inside_a_forward_fail():
    """x - x.mean(0) in a forward: the clipper refuses it where the graph
    between two recorded layers shows it (docs/torch.md, 'The loss
    contract'); the check, which measures instead, finds it at the
    gradient's own order."""
    report = check_exact(_mlp(_Center()), _batch(), _ce_sum)
    assert not report.passed and report.max_rel_error > 0.1


def test_a_loss_divided_by_a_whole_batch_count_fails():
    """Token cross entropy averaged over the valid tokens of the whole batch
    (padding differs between samples): one sample's padding rescales the
    others' terms."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 3:] = 0
    mask[3, 1:] = 0

    def whole_batch_mean(m, ids, mask):
        logits = m(ids)
        tok = nn.functional.cross_entropy(logits.reshape(-1, 11), ids.reshape(-1),
                                          reduction="none").reshape(ids.shape)
        # sum over samples of (token sum / the batch's valid tokens * samples)
        return (tok * mask).sum() / mask.sum() * ids.shape[0]
    assert not check_exact(model, (ids, mask), whole_batch_mean).passed

    def per_sample_mean(m, ids, mask):
        logits = m(ids)
        tok = nn.functional.cross_entropy(logits.reshape(-1, 11), ids.reshape(-1),
                                          reduction="none").reshape(ids.shape)
        return ((tok * mask).sum(1) / mask.sum(1)).sum()
    assert check_exact(model, (ids, mask), per_sample_mean).passed


def test_a_sequence_first_model():
    """batch_first=False: the samples are dimension 1 of (T, B, d) inputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(3))
    report = check_exact(model, (x,), lambda m, x: m(x).square().sum(), batch_first=False)
    assert report.passed and report.samples == 3


def test_a_transformers_causal_lm_with_the_per_sample_token_loss():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=31, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 31, (3, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[2, 4:] = 0

    def loss(m, ids, mask):
        return causal_lm_loss(m(input_ids=ids, attention_mask=mask).logits, ids,
                              attention_mask=mask, reduction="sum")
    report = check_exact(model, (ids, mask), loss)
    assert report.passed and report.max_rel_error <= 1e-9, report


def test_a_random_forward_is_refused():
    with pytest.raises(ValueError, match="deterministic forward: set dropout"):
        check_exact(_mlp(nn.Dropout(0.5)), _batch(), _ce_sum)


def test_a_model_the_clipper_refuses_raises_its_error():
    with pytest.raises(ValueError, match="BatchNorm1d"):
        check_exact(_mlp(nn.BatchNorm1d(8)), _batch(), _ce_sum)


@pytest.mark.parametrize("kw, err, match", [
    (dict(inputs=[torch.zeros(2, 5)]), TypeError, "inputs: expected a tuple of tensors"),
    (dict(inputs=(torch.zeros(2, 5), torch.zeros(3))), ValueError,
     r"inputs: expected tensors sharing one number of samples >= 1 along dimension 0, "
     r"got \[2, 3\]"),
    (dict(inputs=(torch.zeros(0, 5),)), ValueError, "sharing one number of samples >= 1"),
    (dict(rtol=0.0), ValueError, "rtol"),
    (dict(dtype=torch.int64), TypeError, "dtype: expected a floating torch dtype"),
    (dict(loss_fn=3), TypeError, "loss_fn: expected a callable"),
    (dict(model="m"), TypeError, "model: expected an nn.Module, got str"),
    (dict(loss_fn=lambda m, x, y: m(x).sum(1)), ValueError, "loss_fn: expected a scalar"),
])
def test_bad_arguments_name_themselves(kw, err, match):
    args = dict(model=_mlp(), inputs=_batch(2), loss_fn=_ce_sum)
    args.update(kw)
    with pytest.raises(err, match=match):
        check_exact(args.pop("model"), args.pop("inputs"), args.pop("loss_fn"), **args)
