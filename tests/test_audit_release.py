"""One-run audit of the NeuroMixGDP release (ncdp_fast.audit.release) and the
membership attack folded into ncdp_fast.audit (one implementation, the old
import path kept).

False alarm of the honest test: at most 1 - confidence = 1 % per run (fixed seed)."""
from __future__ import annotations

import numpy as np
import pytest

from ncdp_fast.audit import audit_release

SMALL = dict(canaries=200, real_samples=100, num_samples=100, mixup_degree=20)


def test_honest_release_stays_below_its_claim():
    res = audit_release(epsilon=2.0, confidence=0.99, seed=31, **SMALL)
    assert res.epsilon_claimed == pytest.approx(2.0, rel=1e-3)
    assert res.epsilon_lower_bound < res.epsilon_claimed
    assert res.epsilon_lower_bound_gdp < res.epsilon_claimed
    assert res.details["audit"] == "release" and res.details["steps"] == 100


def test_catches_a_release_noised_ten_times_less_than_claimed(monkeypatch):
    # The fault: the mixing op draws noise of a tenth of the calibrated std, while
    # the report (computed from the calibrated sigma) claims eps = 1.
    import ncdp_fast.release.mechanism as mech
    mix = mech.mix

    def weak(*args, noise_std_x, noise_std_y, **kw):
        return mix(*args, noise_std_x=noise_std_x / 10, noise_std_y=noise_std_y / 10, **kw)
    monkeypatch.setattr(mech, "mix", weak)
    res = audit_release(epsilon=1.0, seed=32, **SMALL)
    assert res.epsilon_lower_bound > res.epsilon_claimed, res.summary()
    assert res.epsilon_lower_bound_gdp > res.epsilon_claimed, res.summary()


def test_classifier_observation_stays_below_its_claim():
    clf = audit_release(epsilon=2.0, seed=33, observe="classifier", **SMALL)
    assert clf.details["observe"] == "classifier"
    assert 0.0 <= clf.epsilon_lower_bound < clf.epsilon_claimed


def test_membership_attack_has_one_implementation_and_the_old_path():
    from ncdp_fast import release
    from ncdp_fast.audit import loss_scores, membership
    from ncdp_fast.release import audit as old
    assert old.membership_auc is membership.membership_auc
    assert release.membership_losses is membership.membership_losses

    class Fixed:
        def predict_proba(self, X):
            p = np.asarray(X, dtype=np.float64)[:, :1]
            return np.hstack([p, 1 - p])
    x = np.array([[0.9], [0.25], [1.0]])
    np.testing.assert_allclose(loss_scores(Fixed(), x, np.array([0, 1, 0])),
                               np.log([0.9, 0.75, 1.0]), rtol=1e-15)
    # Labels outside the model's classes are refused without their values (the
    # members' labels are private).
    with pytest.raises(ValueError, match=r"labels: expected integers in \[0, 2\)") as e:
        membership.membership_losses(Fixed(), x, np.array([0, 7, 0]))
    assert "7" not in str(e.value) and "not shown" in str(e.value)


@pytest.mark.parametrize("kw,name", [(dict(canaries=1), "canaries"),
                                     (dict(observe="x"), "observe"),
                                     (dict(num_classes=1), "num_classes")])
def test_argument_errors(kw, name):
    with pytest.raises((ValueError, TypeError)) as e:
        audit_release(**dict(SMALL, **kw))
    assert str(e.value).startswith(name + ":")
