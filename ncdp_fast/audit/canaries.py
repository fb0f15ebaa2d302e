"""Audit your own training loop in one run: :class:`CanaryDataset` wraps your
Dataset and adds m canary samples, each included independently with
probability 1/2 (the draw is kept inside the object, out of its repr);
:func:`model_loss_scores` scores every canary by minus its loss under your
trained model (a black-box observation: only the final model's outputs), and
:meth:`CanaryDataset.audit` turns the scores into both lower bounds.

    from ncdp_fast.audit import CanaryDataset, model_loss_scores
    data = CanaryDataset(train_set, canaries)          # canaries: m (x, y) samples
    loader = DataLoader(data, batch_size=256)
    model, optimizer, loader = PrivacyEngine().make_private(..., data_loader=loader, ...)
    ...                                                # your loop, unchanged
    scores = model_loss_scores(model, canaries, nn.CrossEntropyLoss(reduction="none"))
    result = data.audit(scores, delta=1e-5, epsilon_claimed=engine.get_epsilon(1e-5))

Canaries that are easy to tell apart from the data (mislabelled or
out-of-distribution samples) give the strongest black-box audit; ordinary
samples give a bound near 0 even for a leaky run.  The canaries are training
data like the rest: the run's accountant covers them.
"""
from __future__ import annotations

import numpy as np

from .._arrays import require_torch
from .._validate import check_int
from .guess import AuditResult, bound_from_scores

__all__ = ["CanaryDataset", "model_loss_scores"]


def _torch():
    return require_torch("ncdp_fast.audit.model_loss_scores")


class CanaryDataset:
    """Your ``dataset`` followed by the included ``canaries`` (a torch-style
    map dataset: ``len`` and integer indexing).

    Args:
        dataset: your training set (anything with ``__len__`` and ``__getitem__``).
        canaries: the m candidate canaries (a sequence or dataset of samples in
            your dataset's format), m >= 2.
        seed: None (membership drawn from the OS) or an int (reproducible).

    Indices ``0 .. len(dataset)-1`` are your samples, the rest the included
    canaries in canary order.  The membership is private: not in the repr,
    exposed only through :meth:`audit` (and :attr:`included_count`, the number
    of included canaries, which your loader's length reveals anyway).
    """

    def __init__(self, dataset, canaries, *, seed=None):
        self.dataset = dataset
        self.canaries = canaries
        m = check_int(len(canaries), "canaries", 2)
        rng = np.random.default_rng(np.random.SeedSequence(seed))
        self.__membership = rng.random(m) < 0.5
        self.__included = np.flatnonzero(self.__membership)
        self.m = m

    @property
    def included_count(self) -> int:
        return int(self.__included.size)

    def __len__(self) -> int:
        return len(self.dataset) + self.__included.size

    def __getitem__(self, index):
        index = int(index)
        n = len(self.dataset)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index: expected 0 <= index < {len(self)}, got {index}")
        if index < n:
            return self.dataset[index]
        return self.canaries[int(self.__included[index - n])]

    def __repr__(self) -> str:
        return f"CanaryDataset(samples={len(self.dataset)}, canaries={self.m})"

    def audit(self, scores, *, delta, epsilon_claimed=None, confidence=0.95, k=None
              ) -> AuditResult:
        """Both one-run lower bounds from ``scores`` (m,) -- higher says IN, one
        per canary in canary order (e.g. :func:`model_loss_scores`).

        Args:
            delta: the delta of the claim audited, in (0, 1).
            epsilon_claimed: your accountant's eps at ``delta`` (recorded in the
                result for comparison).
            confidence, k: as :func:`ncdp_fast.audit.bound_from_scores`.
        """
        s = np.asarray(scores, dtype=np.float64)
        if s.shape != (self.m,):
            raise ValueError(f"scores: expected one score per canary, shape ({self.m},), got "
                             f"{s.shape}")
        return bound_from_scores(s, self.__membership, delta=delta, confidence=confidence, k=k,
                                 epsilon_claimed=epsilon_claimed,
                                 details=dict(audit="user", observe="scores"))


def model_loss_scores(model, canaries, loss_fn, *, batch_size: int = 256) -> np.ndarray:
    """Minus each canary's loss under ``model`` (m,) float64 (higher says IN).

    Args:
        model: the trained torch model (a ``make_private`` module works; it is
            run in eval mode under ``torch.no_grad()``, and its training mode
            restored).
        canaries: the m (input, target) samples given to :class:`CanaryDataset`.
        loss_fn: ``loss_fn(output, target) -> (B,)`` per-sample losses (a torch
            loss with ``reduction="none"``).
        batch_size: canaries per forward.
    """
    torch = _torch()
    batch_size = check_int(batch_size, "batch_size", 1)
    m = len(canaries)
    was_training = model.training
    model.eval()
    out = []
    try:
        with torch.no_grad():
            for start in range(0, m, batch_size):
                items = [canaries[i] for i in range(start, min(m, start + batch_size))]
                x = torch.stack([torch.as_tensor(it[0]) for it in items])
                y = torch.stack([torch.as_tensor(it[1]) for it in items])
                loss = loss_fn(model(x), y)
                if loss.shape != (len(items),):
                    raise ValueError(f"loss_fn: expected per-sample losses of shape "
                                     f"({len(items)},) (reduction='none'), got "
                                     f"{tuple(loss.shape)}")
                out.append(loss.double().cpu().numpy())
    finally:
        model.train(was_training)
    return -np.concatenate(out)
