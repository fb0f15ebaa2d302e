r"""A classifier trained on released NeuroMixGDP rows only: :class:`SoftLabelClassifier`
(post-processing, no privacy cost).  torch is imported when a model is fitted, so
``import ncdp_fast.release`` works without it."""
from __future__ import annotations

import math

import numpy as np

from .. import _arrays, _backend
from .._validate import check_bool, check_choice, check_nonneg, check_pos_int, check_positive
from .._arrays import require_torch, to_numpy
from .released import Released

__all__ = ["SoftLabelClassifier"]


def _torch():
    return require_torch("ncdp_fast.release.SoftLabelClassifier")


def _as_tensor(a, dtype, device):
    torch = _torch()
    if isinstance(a, torch.Tensor):
        return a.detach().to(device=device, dtype=dtype)
    return torch.as_tensor(np.asarray(to_numpy(a)), dtype=dtype, device=device)


class SoftLabelClassifier:
    r"""Linear (or one-hidden-layer) classifier trained on released (x, y) pairs.

    Loss (``loss="kl"``, the paper's Appendix C): the noisy mixed labels are clipped
    at 0, :math:`p = \max(\tilde y, 0)`, and the generalised KL divergence
    :math:`D(p\|q) = \sum_k p_k\log(p_k/q_k) - p_k + q_k` to the softmax output q is
    minimised (eq. 2).  Since :math:`\sum_k q_k = 1`, its gradient in the logits is that
    of the soft cross-entropy :math:`-\sum_k p_k \log q_k` with unnormalised targets,
    which is what is computed; negative label entries (pure noise around a zero
    mean) thus carry no weight.  ``loss="squared"``: least squares
    :math:`\|XW + b - \tilde y\|^2 + \alpha T\|W\|^2` in closed form (linear only); it
    uses the negative entries as they are -- the label noise is zero-mean, so the
    squared loss is unbiased for E[y | x].

    Training is post-processing of the released data (no privacy cost).  Solvers:
    ``"lbfgs"`` (full batch, torch L-BFGS with strong-Wolfe line search,
    ``max_iter`` iterations) or ``"adam"`` (mini-batches of ``batch_size``,
    ``epochs`` epochs, learning rate ``lr`` divided by 10 at 40/60/80 % of the epochs,
    the paper's schedule shape).  ``alpha`` is an L2 penalty on the weights (mean
    loss + alpha/2 ||W||^2).  ``standardize=True`` fits in coordinates standardised
    by the released rows' column means and standard deviations (public statistics of
    the release; the same model class, but a far better-conditioned problem for
    L-BFGS -- the ScatterNet columns share a large common mean); ``coef_`` and
    ``intercept_`` are always in the input coordinates.  Test features are clipped to norm ``clip_x`` as at
    release (set from the :class:`Released` given to :meth:`fit`, or here).

    scikit-learn conventions: :meth:`fit` returns self; :meth:`predict`,
    :meth:`predict_proba`, :meth:`decision_function`, :meth:`score` (accuracy on
    integer labels); ``classes_``, ``n_features_in_``, ``coef_`` (K, d),
    ``intercept_`` (K,).  Inputs: NumPy arrays or torch tensors (moved to ``device``);
    outputs are NumPy.
    """

    def __init__(self, *, loss="kl", hidden=None, solver="lbfgs", alpha=0.0, max_iter=100,
                 epochs=20, batch_size=1024, lr=1e-3, clip_x=None, standardize=False,
                 device="cpu", dtype="float32", seed=None):
        self.loss = check_choice(loss, "loss", ("kl", "squared"))
        self.standardize = check_bool(standardize, "standardize")
        hidden = None if hidden is None else check_pos_int(hidden, "hidden")
        if hidden is not None and loss == "squared":
            raise ValueError("hidden: the squared loss is solved in closed form for a linear "
                             "model only; use loss='kl' with a hidden layer")
        self.hidden = hidden
        self.solver = check_choice(solver, "solver", ("lbfgs", "adam"))
        self.alpha = check_nonneg(alpha, "alpha")
        self.max_iter = check_pos_int(max_iter, "max_iter")
        self.epochs = check_pos_int(epochs, "epochs")
        self.batch_size = check_pos_int(batch_size, "batch_size")
        self.lr = check_positive(lr, "lr")
        self.clip_x = None if clip_x is None else check_positive(clip_x, "clip_x")
        self.device = device
        self.dtype = check_choice(dtype, "dtype", ("float32", "float64"))
        self.seed = seed

    # ------------------------------------------------------------------ internals
    def _tdtype(self):
        torch = _torch()
        return torch.float32 if self.dtype == "float32" else torch.float64

    def _prep(self, X, clip=True):
        torch = _torch()
        X = _as_tensor(X, self._tdtype(), self.device)
        if X.ndim != 2:
            raise ValueError(f"X: expected shape (n, d), got {tuple(X.shape)}")
        if hasattr(self, "n_features_in_") and X.shape[1] != self.n_features_in_:
            raise ValueError(f"X: expected {self.n_features_in_} features, got {X.shape[1]}")
        if not bool(torch.isfinite(X).all()):
            # NaN scores came out without a word (the sixth audit).
            raise ValueError("X: expected finite values, got NaN or Inf")
        if clip and self.clip_x is not None:
            # Same clipping as the release: x * min(1, C / ||x||).
            norms = torch.linalg.vector_norm(X, dim=1, keepdim=True)
            X = X * torch.clamp(self.clip_x / torch.clamp(norms, min=1e-30), max=1.0)
        return X

    def _forward(self, X):
        if self._mlp is not None:
            if self._shift is not None:
                X = (X - self._shift) * self._scale
            return self._mlp(X)
        if self._shift is None:
            return X @ self._W + self._b
        # Standardised coordinates z = (x - shift) * scale without a copy of X:
        # z W + b = x (scale W) + (b - (shift scale) W).
        return X @ (self._scale[:, None] * self._W) + (self._b - (self._shift * self._scale)
                                                       @ self._W)

    # ------------------------------------------------------------------ API
    def fit(self, X, Y=None):
        """Fit on released rows.  ``fit(released)`` takes x, y and clip_x from a
        :class:`Released`; ``fit(X, Y)`` takes X (T, d) and soft labels Y (T, K)
        (integer labels (T,) are one-hot encoded, for non-private baselines)."""
        torch = _torch()
        if isinstance(X, Released):
            if Y is not None:
                raise ValueError("Y: give either a Released or (X, Y), not both")
            if self.clip_x is None:
                self.clip_x = X.clip_x
            X, Y = X.x, X.y
        if Y is None:
            raise ValueError("Y: soft labels (T, K) are required")
        Xt = _as_tensor(X, self._tdtype(), self.device)
        if Xt.ndim != 2:
            raise ValueError(f"X: expected shape (T, d), got {tuple(Xt.shape)}")
        Yt = _as_tensor(Y, self._tdtype(), self.device) if _dtype_kind(Y) == "f" \
            else None
        if Yt is None:
            lab = to_numpy(Y)
            if lab.ndim != 1:
                raise ValueError(f"Y: expected soft labels (T, K) or class ids (T,), got "
                                 f"shape {lab.shape}")
            K = int(lab.max()) + 1
            Yt = torch.nn.functional.one_hot(torch.as_tensor(lab.astype(np.int64)), K).to(
                device=self.device, dtype=self._tdtype())
        if Yt.ndim != 2 or Yt.shape[0] != Xt.shape[0]:
            raise ValueError(f"Y: expected shape ({Xt.shape[0]}, K), got {tuple(Yt.shape)}")
        for name, a in (("X", Xt), ("Y", Yt)):
            if not _arrays.all_finite(a):
                raise ValueError(f"{name}: expected finite values, got NaN or Inf")
        T, d = Xt.shape
        K = Yt.shape[1]
        self.n_features_in_ = int(d)
        self.classes_ = np.arange(K)
        # The released rows are mixtures plus noise: never clipped again (only raw test
        # features are, in predict / decision_function).
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_backend.resolve_seed(self.seed) % 2**63)
        self._mlp = None
        self._shift = self._scale = None
        if self.loss == "squared":
            self._fit_squared(Xt, Yt)
            return self
        if self.standardize:
            # Preconditioning from the released rows' own column means / stds (public;
            # post-processing): the same model class, a better-conditioned problem.
            f8 = torch.float64
            mean = Xt.mean(0, dtype=f8)
            sd = torch.sqrt(torch.clamp((Xt.to(f8) ** 2).mean(0) - mean ** 2, min=0.0)) \
                if Xt.shape[0] * Xt.shape[1] <= 2**24 else _column_std(Xt, mean)
            self._shift = mean.to(Xt.dtype)
            self._scale = (1.0 / torch.clamp(sd, min=1e-12)).to(Xt.dtype)
        if self.hidden is None:
            self._W = torch.zeros(d, K, dtype=Xt.dtype, device=self.device, requires_grad=True)
            self._b = torch.zeros(K, dtype=Xt.dtype, device=self.device, requires_grad=True)
            params = [self._W, self._b]
        else:
            lin1 = torch.nn.Linear(d, self.hidden)
            lin2 = torch.nn.Linear(self.hidden, K)
            for lin in (lin1, lin2):   # deterministic init from our generator
                bound = 1.0 / math.sqrt(lin.in_features)
                with torch.no_grad():
                    lin.weight.uniform_(-bound, bound, generator=gen)
                    lin.bias.uniform_(-bound, bound, generator=gen)
            self._mlp = torch.nn.Sequential(lin1, torch.nn.ReLU(), lin2).to(
                device=self.device, dtype=Xt.dtype)
            params = list(self._mlp.parameters())
        P = torch.clamp(Yt, min=0.0)      # Appendix C: negative noisy entries -> 0
        weights = [p for p in params if p.ndim == 2]

        def objective(xb, pb):
            logq = torch.log_softmax(self._forward(xb), dim=1)
            val = -(pb * logq).sum(dim=1).mean()
            if self.alpha:
                val = val + 0.5 * self.alpha * sum((w * w).sum() for w in weights)
            return val

        if self.solver == "lbfgs":
            opt = torch.optim.LBFGS(params, lr=1.0, max_iter=self.max_iter,
                                    history_size=20, line_search_fn="strong_wolfe",
                                    tolerance_grad=1e-9, tolerance_change=1e-12)

            def closure():
                opt.zero_grad()
                v = objective(Xt, P)
                v.backward()
                return v
            opt.step(closure)
        else:
            opt = torch.optim.Adam(params, lr=self.lr)
            milestones = [int(self.epochs * f) for f in (0.4, 0.6, 0.8)]
            sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.1)
            for _ in range(self.epochs):
                perm = torch.randperm(T, generator=gen).to(self.device)
                for i in range(0, T, self.batch_size):
                    idx = perm[i:i + self.batch_size]
                    opt.zero_grad()
                    objective(Xt[idx], P[idx]).backward()
                    opt.step()
                sched.step()
        for p in params:
            p.requires_grad_(False)
        return self

    def _fit_squared(self, X, Y):
        torch = _torch()
        T, d = X.shape
        # Centred normal equations without a centred copy of X (T x d can be GBs):
        # W = (X'X - T mx mx' + alpha T I)^-1 (X'Y - T mx my'), intercept unpenalised.
        # Products in X's dtype, the centring and the solve in float64.
        f8 = torch.float64
        mx, my = X.mean(0).to(f8), Y.mean(0).to(f8)
        G = (X.T @ X).to(f8) - T * torch.outer(mx, mx)
        R = (X.T @ Y).to(f8) - T * torch.outer(mx, my)
        # alpha = 0: a jitter of 1e-7 of the mean diagonal keeps G invertible.
        G.diagonal().add_(self.alpha * T if self.alpha else 1e-7 * float(G.diagonal().mean()))
        W = torch.linalg.solve(G, R)
        self._W = W.to(X.dtype)
        self._b = (my - mx @ W).to(X.dtype)

    @property
    def coef_(self) -> np.ndarray:
        """(K, d) weights of the linear model in the input coordinates (AttributeError
        with a hidden layer)."""
        self._check_fitted()
        if self._mlp is not None:
            raise AttributeError("coef_: not defined for the one-hidden-layer model")
        W = self._W if self._shift is None else self._scale[:, None] * self._W
        return _arrays.to_numpy(W).T.copy()

    @property
    def intercept_(self) -> np.ndarray:
        self._check_fitted()
        if self._mlp is not None:
            raise AttributeError("intercept_: not defined for the one-hidden-layer model")
        b = self._b if self._shift is None else \
            self._b - (self._shift * self._scale) @ self._W
        return _arrays.to_numpy(b).copy()

    def _check_fitted(self):
        if not hasattr(self, "classes_"):
            raise RuntimeError("SoftLabelClassifier: call fit() first")

    def decision_function(self, X) -> np.ndarray:
        """Scores (n, K): logits (``kl``) or fitted label means (``squared``)."""
        self._check_fitted()
        torch = _torch()
        with torch.no_grad():
            return _arrays.to_numpy(self._forward(self._prep(X)))

    def predict_proba(self, X) -> np.ndarray:
        """(n, K) class probabilities: softmax of the logits (``kl``); for ``squared``
        the fitted label means clipped at 0 and normalised (uniform where all are 0)."""
        s = self.decision_function(X).astype(np.float64)
        if self.loss == "kl":
            s -= s.max(axis=1, keepdims=True)
            e = np.exp(s)
            return e / e.sum(axis=1, keepdims=True)
        s = np.maximum(s, 0.0)
        tot = s.sum(axis=1, keepdims=True)
        K = s.shape[1]
        return np.where(tot > 0, s / np.where(tot > 0, tot, 1.0), 1.0 / K)

    def predict(self, X) -> np.ndarray:
        self._check_fitted()
        return self.classes_[np.argmax(self.decision_function(X), axis=1)]

    def score(self, X, y) -> float:
        """Accuracy on integer labels y (n,)."""
        pred = self.predict(X)
        if y is None:
            raise TypeError("y: expected integer class labels (n,), got None")
        y = to_numpy(y)
        if y.shape != pred.shape or y.dtype.kind not in "iu":
            # Mismatched or string labels scored 0.0 without a word (the sixth audit).
            raise ValueError(f"y: expected integer class labels of shape {pred.shape}, got "
                             f"shape {y.shape} dtype {y.dtype}")
        return float(np.mean(pred == y))


def _column_std(X, mean):
    # Column standard deviations in float64 by row blocks (no float64 copy of X).
    torch = _torch()
    acc = torch.zeros_like(mean)
    for i in range(0, X.shape[0], 4096):
        blk = X[i:i + 4096].to(torch.float64) - mean
        acc += (blk * blk).sum(0)
    return torch.sqrt(acc / X.shape[0])


def _dtype_kind(a) -> str:
    if _arrays.is_torch(a):
        return "f" if a.is_floating_point() else "i"
    return _arrays.numpy_dtype(a).kind if hasattr(a, "dtype") else np.asarray(a).dtype.kind

