"""The package audits itself (issue 28): the white-box one-run audit of DP-SGD
through PrivacyEngine stays below the claimed epsilon on honest runs, and rises
above it for each break class the issue-23 audit of the torch path found.

The package now refuses those patterns, so each test reproduces the pre-fix
behaviour with monkeypatch (the package's own check switched off, or the fault
written in), and shows that the audit would have caught it.

False alarms: each honest run's bound exceeds the true epsilon with probability
at most 1 - confidence; the honest test runs S seeds at confidence 0.99, so a
valid audit fails it with probability at most S * 1 % (union bound).  The seeds
are fixed: the outcome is deterministic.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ncdp_fast.audit import audit_dpsgd  # noqa: E402
from ncdp_fast.audit import dpsgd as audit_dpsgd_module  # noqa: E402
from ncdp_fast.torch import GhostClipper  # noqa: E402
from ncdp_fast.torch import layout as torch_layout  # noqa: E402

CLAIM = 1.0          # the claimed eps of the broken runs: well inside what m canaries reach


@pytest.mark.parametrize("canary,batches,observe", [
    ("dirac", 1, "steps"), ("dirac", 4, "steps"), ("dirac", 1, "final"), ("input", 1, "steps")])
def test_honest_run_stays_below_its_claim(canary, batches, observe):
    for seed in (11, 12):
        res = audit_dpsgd(canaries=200, epsilon=2.0, delta=1e-5, epochs=2, batches=batches,
                          canary=canary, observe=observe, real_samples=128,
                          confidence=0.99, seed=seed)
        assert res.epsilon_claimed <= 2.0
        assert res.epsilon_lower_bound < res.epsilon_claimed, res.summary()
        if batches == 1:
            # Full batch: the run is exactly mu-GDP (mu = sqrt(T)/sigma), so the
            # f-DP bound is a bound on it too.  (Poisson-subsampled runs are GDP
            # only approximately: there the mu-GDP hypothesis may be false.)
            assert res.epsilon_lower_bound_gdp < res.epsilon_claimed, res.summary()


def test_dirac_audit_is_not_vacuous():
    # A claim of eps = 4 at m = 1000 is caught at more than a quarter of itself by
    # both analyses (the table in docs/privacy.md has the spread over seeds).
    res = audit_dpsgd(canaries=1000, epsilon=4.0, delta=1e-5, epochs=2, seed=5)
    assert res.epsilon_lower_bound > 1.0 and res.epsilon_lower_bound_gdp > 1.0
    assert res.epsilon_lower_bound_gdp < res.epsilon_claimed
    assert res.canaries == 1000 and res.confidence == 0.95
    assert res.details["noise_multiplier"] > 0 and res.details["steps"] == 2


def _assert_caught(res):
    assert res.epsilon_lower_bound > res.epsilon_claimed, res.summary()
    assert res.epsilon_lower_bound_gdp > res.epsilon_claimed, res.summary()


def test_catches_raw_gradients_on_a_parameter_the_mechanism_did_not_see(monkeypatch):
    # Pre-fix: a layer frozen when the clipper was built and unfrozen after was
    # stepped with autograd's raw gradient.  Reproduced: the canary layer is frozen
    # around GhostClipper's construction and the foreign-gradient check is off.
    init = GhostClipper.__init__

    def frozen_at_attach(self, model, **kw):
        model.canary.weight.requires_grad_(False)
        init(self, model, **kw)
        model.canary.weight.requires_grad_(True)
    monkeypatch.setattr(GhostClipper, "__init__", frozen_at_attach)
    monkeypatch.setattr(GhostClipper, "_refuse_foreign", lambda self, privatized, opt: None)
    _assert_caught(audit_dpsgd(canaries=200, epsilon=CLAIM, epochs=2, seed=21))


def test_catches_sigma_accidentally_zero(monkeypatch):
    # The gradient is released without noise while the accountant records the
    # calibrated sigma (the clipper's noise multiplier is untouched).
    monkeypatch.setattr(GhostClipper, "_grad_noise_multiplier", lambda self: 0.0)
    _assert_caught(audit_dpsgd(canaries=200, epsilon=CLAIM, epochs=2, seed=22))


def test_catches_a_view_folding_samples_into_the_batch(monkeypatch):
    # Pre-fix: a model that folds k views of each sample into the batch dimension,
    # (B, k, d) -> (B*k, d), had each row clipped as a sample: one sample moved
    # the sum by k C.  Reproduced: the model folds, and the rows check reads the
    # batch as B*k.
    views = 8
    make = audit_dpsgd_module.DiracModel

    def folding(d_real, m):
        model = make(d_real, m)
        base = type(model)

        class Folding(base):
            def forward(self, x):
                b = x.shape[0]
                rows = x.unsqueeze(1).expand(b, views, x.shape[1]).reshape(b * views, -1)
                return super().forward(rows).view(b, views).sum(1)
        model.__class__ = Folding
        return model
    monkeypatch.setattr(audit_dpsgd_module, "DiracModel", folding)
    get = torch_layout.StepBatch.get
    monkeypatch.setattr(torch_layout.StepBatch, "get",
                        lambda self, layer: (get(self, layer)[0] * views, "folded"))
    # The pre-fix engine had no check of the step's rows against the loader's
    # batch either (DPOptimizer._check_logical, the fifth audit), which would
    # refuse the folded rows before the auditor sees them.
    from ncdp_fast.torch.dp_optimizer import DPOptimizer
    monkeypatch.setattr(DPOptimizer, "_check_logical", lambda self, batch: None)
    _assert_caught(audit_dpsgd(canaries=300, epsilon=CLAIM, epochs=2, seed=23))


def test_catches_noise_reused_across_steps(monkeypatch):
    # Every step draws its noise from the same stream position.  The auditor
    # chose, before the run, a score for it: a canary's per-step observations
    # vary across Poisson steps only through its own inclusion when the noise
    # repeats, so their variance says IN (exactly 0 for an OUT canary).
    from ncdp_fast._stream import NoiseReuseWarning, NoiseStream
    clip = GhostClipper._clip_and_noise

    def same_noise(self, *args, **kw):
        first = self.__dict__.setdefault("_first_noise_state", self._stream.state())
        stream, self._stream = self._stream, NoiseStream.restore(first)
        try:
            return clip(self, *args, **kw)
        finally:
            self._stream = stream
    monkeypatch.setattr(GhostClipper, "_clip_and_noise", same_noise)
    with warnings.catch_warnings():
        # the package's own process-wide ledger flags the reuse; the audit must too
        warnings.simplefilter("ignore", NoiseReuseWarning)
        res = audit_dpsgd(canaries=400, epsilon=CLAIM, epochs=3, batches=4, real_samples=256,
                          score=lambda g: g.var(axis=0), seed=24)
    _assert_caught(res)
    # and the same score on an honest run does not claim a violation
    monkeypatch.undo()
    honest = audit_dpsgd(canaries=400, epsilon=CLAIM, epochs=3, batches=4, real_samples=256,
                         score=lambda g: g.var(axis=0), seed=25)
    assert honest.epsilon_lower_bound < honest.epsilon_claimed


@pytest.mark.parametrize("kw,name", [
    (dict(canaries=1), "canaries"), (dict(canary="pixel"), "canary"),
    (dict(observe="logits"), "observe"), (dict(score="max"), "score"),
    (dict(batches=0), "batches"), (dict(epsilon=0.0), "epsilon"),
    (dict(delta=1.0), "delta"), (dict(batches=10_000, canaries=10, real_samples=0), "batches"),
    (dict(canaries=10, score=lambda g: g[:, :3].sum(0)), "score"),
])
def test_argument_errors(kw, name):
    with pytest.raises((ValueError, TypeError)) as e:
        audit_dpsgd(**dict(dict(canaries=20, epochs=1, seed=1), **kw))
    assert str(e.value).startswith(name + ":")


def test_seeds_membership_and_noise_key_from_one_seed_or_the_os():
    # An int seed fixes the membership, data and noise key (a new process then
    # repeats the run; within one process the package's stream continues after
    # the ranges already drawn, so the noise is never reused); None: the OS.
    (r1, k1, _), (r2, k2, _) = audit_dpsgd_module._seeds(7), audit_dpsgd_module._seeds(7)
    assert k1 == k2 and np.array_equal(r1.random(50) < 0.5, r2.random(50) < 0.5)
    (_, k3, _), (_, k4, _) = audit_dpsgd_module._seeds(None), audit_dpsgd_module._seeds(None)
    assert len({k1, k3, k4}) == 3
