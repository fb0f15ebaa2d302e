"""Empirical privacy lower bounds from one run (issue 28; docs/privacy.md,
"Auditing a run").

* :mod:`.bounds`: the statistics -- :func:`one_run_bound` (Steinke, Nasr &
  Jagielski 2023) and :func:`one_run_bound_gdp` (Mahloujifar, Melis &
  Chaudhuri, f-DP in one run, for the Gaussian curve).
* :mod:`.guess`: scores to guesses to both bounds (:class:`AuditResult`).
* :mod:`.dpsgd`: :func:`audit_dpsgd`, the white-box audit of DP-SGD through
  :class:`ncdp_fast.torch.PrivacyEngine` (needs torch; imported on use).
* :mod:`.release`: :func:`audit_release`, the audit of a NeuroMixGDP release.
* :mod:`.canaries`: :class:`CanaryDataset` and :func:`model_loss_scores`, the
  audit of a user's own training loop (black box: the trained model's losses).
* :mod:`.membership`: the loss-based membership attack (:func:`loss_scores`,
  :func:`membership_auc`; also importable from ``ncdp_fast.release``).

An audit gives a lower bound: a bound above the claimed eps proves the claim
false (at the stated confidence); a bound below it proves nothing.
"""
from .._lazy import lazy_attributes
from .bounds import GDPBound, gdp_rejects, one_run_bound, one_run_bound_gdp, one_run_p_value
from .guess import (AuditResult, bound_from_scores, guess_grid, plan_k,
                    subsampled_gaussian_score)
from .canaries import CanaryDataset, model_loss_scores
from .membership import loss_scores, membership_auc, membership_losses

__all__ = ["one_run_bound", "one_run_bound_gdp", "GDPBound", "gdp_rejects", "one_run_p_value",
           "AuditResult", "bound_from_scores", "guess_grid", "plan_k", "subsampled_gaussian_score",
           "CanaryDataset", "model_loss_scores", "loss_scores", "membership_auc",
           "membership_losses", "audit_dpsgd", "audit_release"]


# torch is an optional extra: the white-box audits are loaded on first use.
__getattr__ = lazy_attributes(__name__, {"audit_dpsgd": ".dpsgd", "audit_release": ".release"})
