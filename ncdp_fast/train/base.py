"""What both private linear classifiers share: argument checks, the budget spent
by private preprocessing, and fit-time preparation / predict / score."""
from __future__ import annotations

import numpy as np

from .. import _arrays, _stream
from .._validate import check_bool, check_choice, check_features, check_int, check_labels, check_positive
from .steps import ArrayOps, float_features, to_lib

__all__ = ["LOSSES", "prior_rho", "LinearClassifierBase"]

LOSSES = ("ce", "square")


def prior_rho(preprocessing):
    """zCDP already spent on the private data by fitted preprocessors."""
    spent = []
    for i, pre in enumerate(preprocessing or ()):
        on = getattr(pre, "fitted_on_", None)
        if on not in ("public", "private"):
            raise ValueError(f"preprocessing[{i}]: expected a fitted Centering/PCAProjector "
                             f"(fit(X, public=True) or fit_private), got {pre!r}")
        if on == "private":
            spent.append(float(pre.rho_))
    return spent


class LinearClassifierBase:
    """fit / predict / score / decision_function shared by both estimators."""

    # How many rows each step clipped: the private data's, without noise.
    num_clipped_ = _stream.Unreleased(
        "rows clipped over the fit, without noise: readable in the fitting process, never "
        "in the estimator's pickle, copy or vars() (it is the private data's)")

    def _validate_common(self):
        check_choice(self.loss, "loss", LOSSES)
        check_positive(self.lr, "lr")
        check_positive(self.max_grad_norm, "max_grad_norm")
        if self.projection_radius is not None:
            check_positive(self.projection_radius, "projection_radius")
        if self.num_classes is None:
            raise ValueError("num_classes: required (an integer >= 2): reading K from the "
                             "private labels as max(y) + 1 would reveal whether a record of "
                             "the largest class is present")
        check_int(self.num_classes, "num_classes", 2)
        check_bool(self.fit_intercept, "fit_intercept")

    def __getstate__(self):
        # The noise key is secret: a pickled estimator (a model one may publish)
        # never carries it, whether given as an int or a NoiseStream.
        state = dict(self.__dict__)
        state["seed"] = None
        return state

    def _prepare(self, X, y):
        X = float_features(X)
        n, p = check_features(X)
        if n == 0:
            raise ValueError("X: expected at least one row, got 0")
        labels, K = check_labels(y, n, self.num_classes)
        return X, labels, n, p, K

    def _check_draws(self, stream, steps: int, K: int, p: int) -> None:
        """The fit's noise must fit in the key's 2**64 draws: checked before the
        first step (steps=10**30 ran for minutes before the stream refused: the
        sixth audit)."""
        draws = K * p + (K if self.fit_intercept else 0)
        if stream.position + steps * draws > 2**64:
            raise ValueError(f"steps: expected steps x {draws} draws a step to fit in the noise "
                             f"stream's 2**64 draws from offset {stream.position}, got "
                             f"{steps} steps")

    def _set_fitted(self, W, b, K, p):
        self.coef_, self.intercept_ = W, b
        self.classes_ = np.arange(K)
        self.n_features_in_ = p

    def decision_function(self, X):
        """Scores ``X W^T (+ b)``: (n, K) in X's library and device."""
        if not hasattr(self, "coef_"):
            raise RuntimeError(f"{type(self).__name__}: call fit first")
        X = float_features(X)
        n, p = check_features(X)
        if p != self.n_features_in_:
            raise ValueError(f"X: expected {self.n_features_in_} features, got {p}")
        ops = ArrayOps(X)
        z = X @ to_lib(self.coef_, ops).T
        if self.intercept_ is not None:
            z = z + to_lib(self.intercept_, ops)
        return z

    def predict(self, X):
        """Predicted labels argmax_k (W x)_k: (n,) int64 in X's library and device."""
        X = float_features(X)
        return ArrayOps(X).argmax(self.decision_function(X))

    def score(self, X, y):
        """Accuracy on (X, y), a Python float."""
        pred = self.predict(X)
        pred = _arrays.to_numpy(pred)
        labels, _ = check_labels(y, pred.shape[0], len(self.classes_))
        return float(np.mean(pred == labels))
