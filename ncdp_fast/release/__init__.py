r"""NeuroMixGDP: private release of mixed-up features, a classifier for the released
data, and a membership-inference audit.

Paper: ``shared/seeds/002_1ce43e1ce6039d97.txt`` (Li, Cao & Yao, "NeuroMixGDP") --
Algorithm 1 with Procedures 1-2, Theorem 3.1, Section 3.2, Appendix C (training on
noisy mixed labels), Appendix E.2 (hierarchical sampling), Section 5 (membership
inference).  See ``docs/release.md``.

* :mod:`.mechanism` -- :class:`NeuroMixGDP`, the release itself (Algorithm 1), and
  how it is accounted for.
* :mod:`.report` -- :class:`PrivacyReport`, what one release guarantees.
* :mod:`.released` -- :class:`Released`, the publishable output, and its ``.npz``
  file (checksum, HMAC, refusal of files whose claim does not recompute);
  :func:`load` reads that file or the directory ``ncdp-fast release`` writes
  (:mod:`._directory`: per-file SHA-256 manifest, the same optional HMAC).
* :mod:`.classifier` -- :class:`SoftLabelClassifier`, trained on the release only.
* :mod:`.audit` -- :func:`membership_auc`, the loss-based membership-inference audit.
* Hierarchical-sampling accounting: :mod:`ncdp_fast.privacy.hierarchical`
  (:func:`hs_epsilon`, :func:`hs_noise_multiplier`, re-exported here).

Layer 3 code (algorithms): validates, calibrates, calls the op ``mix``.
"""
from __future__ import annotations

from ..privacy.hierarchical import hs_epsilon, hs_noise_multiplier
from .audit import membership_auc, membership_losses
from .classifier import SoftLabelClassifier
from .mechanism import NeuroMixGDP
from .released import FORMAT_VERSION, Released, ReleaseFileError, load
from .report import PrivacyReport

__all__ = ["NeuroMixGDP", "Released", "PrivacyReport", "SoftLabelClassifier",
           "membership_auc", "membership_losses", "hs_epsilon", "hs_noise_multiplier",
           "FORMAT_VERSION", "ReleaseFileError", "load"]
