"""The membership-inference attack moved to :mod:`ncdp_fast.audit.membership`
(issue 28: one implementation for every audit); this import path keeps working."""
from ..audit.membership import membership_auc, membership_losses

__all__ = ["membership_auc", "membership_losses"]
