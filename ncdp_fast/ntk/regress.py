r"""Random-features and NTK regression, and their sensitivity S_f(x) = ||x|| ||grad_x f(x)||.

Lecture notes 004_f44587b9249a6ca9.txt, "How many parameters to interpolate
robustly?" (sections "A sufficient condition for NTK features" and "Random
features (RF)").  Everything here is NumPy float64 on the CPU (the n x n solves
are small); torch is imported lazily and only for the deep-MLP sensitivity.

Models
------
* Random features (Rahimi & Recht 2007):  f_RF(x, theta) = phi(V x)^T theta,
  V in R^{p x d}, V_ij ~ N(0, scale/d).  The minimum-norm interpolator reached by
  GD from theta_0 = 0 is theta* = Phi^T (Phi Phi^T)^{-1} y with Phi = phi(X V^T)
  (n x p); with a ridge lambda > 0 it is Phi^T (Phi Phi^T + lambda I)^{-1} y,
  the minimiser of ||Phi theta - y||^2 + lambda ||theta||^2.
* NTK features of the slides' symmetric two-layer network
  f_NN(x, w) = sum_i phi(<w_i^(1), x>) - sum_i phi(<w_i^(2), x>), k neurons per
  half, W_0^(1) ~ N(0, 1/d) entrywise and W_0^(2) = W_0^(1), so f_NN(x, w_0) = 0.
  Its NTK feature map is Phi_NTK(x) = grad_w f_NN(x, w_0) = [phi'(W x) (x) x,
  -phi'(W x) (x) x] in R^{2kd} (p = 2kd), hence the kernel

      K(x, x') = <Phi_NTK(x), Phi_NTK(x')> = 2 <x, x'> sum_i phi'(w_i.x) phi'(w_i.x')
               = 2 [(phi'(X W^T) phi'(X' W^T)^T) o (X X'^T)]                     (1)

  and f_NTK(x, theta*) = K(x, X) K^{-1} y (the theta_0 term vanishes because
  f_NN(., w_0) = 0, as the slides note "by symmetry").  Equation (1) is the
  first-layer term of :func:`ncdp_fast.ntk_gram` for the 2k-neuron network
  with output weights (1, ..., 1, -1, ..., -1); the tests check it against
  ``ntk_gram`` minus that network's second-layer term 2 phi(XW^T) phi(X'W^T)^T.
  ``train="all"`` trains the output weights too and uses ``ntk_gram`` itself.
* Any MLP's empirical NTK (``weights=[W_1, ..., W_L]``): kernel regression with
  :func:`ncdp_fast.ntk_gram`.

Sensitivity (slides: S_f(x) = ||x|| ||grad_x f(x, theta)||)
----------------------------------------------------------
* RF:  grad_x f = V^T (phi'(V x) o theta*)                                     (2)
* two-layer NTK, from (1) with alpha = K^{-1} y:
  grad_x f = sum_j alpha_j grad_x K(x, x_j)
           = 2 W^T [phi''(W x) o (phi'(W X^T) (alpha o X x))]
             + 2 X^T [alpha o (phi'(X W^T) phi'(W x))]                          (3)
  (the first term differentiates phi'(w_i.x), the second <x, x_j>).
* deep MLP NTK: torch autograd through the Gram's factor form
  K(x, X) = sum_l (f_l(x) f_l(X)^T) o (b_l(x) b_l(X)^T) (ntk_factors).
All three are exact (no finite differences); tests compare them with central
differences.  Privacy: none of these estimators is private -- they are the
non-private references (and the attack surface) of the notes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _backend
from .._validate import as_matrix, as_targets, check_nonneg, check_pos_int
from .._ntk import ACTIVATIONS as _NTK_ACTIVATIONS
from .._ntk import namespace, ntk_factors, ntk_gram
from .._ntk import activation as _ntk_activation

__all__ = ["RF_ACTIVATIONS", "random_features", "RandomFeatures", "RFRegressor", "NTKRegressor",
           "sensitivity"]

# phi, phi', phi'' are needed: phi for RF, phi' for NTK features, phi'' for (3).
# "logcosh" is the even activation of the NTK robustness theorem (phi' = tanh is
# Lipschitz, phi is even and non-linear).
RF_ACTIVATIONS = _NTK_ACTIVATIONS + ("logcosh",)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def activation_derivatives(name, z):
    """(phi(z), phi'(z), phi''(z)) elementwise, NumPy float64; phi'' of relu is 0
    (a.e.)."""
    if name == "logcosh":
        a = np.abs(z)
        t = np.tanh(z)
        return a + np.log1p(np.exp(-2.0 * a)) - math.log(2.0), t, 1.0 - t * t
    if name not in _NTK_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {RF_ACTIVATIONS}, got {name!r}")
    f, df = _ntk_activation(name, z, namespace("numpy"))
    if name in ("relu", "identity"):
        d2 = np.zeros_like(z)
    elif name == "tanh":
        d2 = -2.0 * f * df
    elif name == "erf":
        d2 = -2.0 * z * df
    elif name == "gelu":
        d2 = _INV_SQRT_2PI * np.exp(-0.5 * z * z) * (2.0 - z * z)
    else:                                               # softplus: phi' = sigmoid
        d2 = df * (1.0 - df)
    return f, df, d2


def _solve_psd(K, y, ridge):
    """(K + ridge I)^{-1} y by Cholesky; a clear error when K is singular (fewer
    features than samples without a ridge)."""
    from scipy.linalg import LinAlgError, cho_factor, cho_solve
    A = K + ridge * np.eye(K.shape[0]) if ridge > 0 else K
    try:
        return cho_solve(cho_factor(A, lower=True), y)
    except LinAlgError:
        raise ValueError("the kernel matrix is singular (fewer parameters than samples, or "
                         "duplicate inputs): interpolation needs p >= n; pass ridge > 0") from None


@dataclass(frozen=True)
class RandomFeatures:
    """Phi = phi(X V^T) (n, p) float64, the weights V (p, d) and the seed that drew V."""
    features: np.ndarray
    weights: np.ndarray
    seed: int


def draw_rf_weights(p, d, scale, seed):
    """(V (p, d) float64 with V_ij ~ N(0, scale/d), the seed that drew it); seed
    None draws 64 bits from the OS.  Public randomness: it never touches the data."""
    seed = _backend.resolve_seed(seed)
    V = np.random.default_rng(seed).standard_normal((p, d)) * math.sqrt(scale / d)
    return V, seed


def random_features(x, num_features, *, activation="relu", scale=1.0, seed=None,
                    return_weights=False):
    """Random features Phi = phi(X V^T) with V_ij ~ N(0, scale/d) (slides, "Random features").

    Args:
        x: (n, d) inputs (NumPy or torch; converted to float64 NumPy).
        num_features: p >= 1.
        activation: one of :data:`RF_ACTIVATIONS`.
        scale: variance of V_ij times d (the slides' gamma in N(0, gamma/d)).
        seed: seed of V (public randomness, independent of the data); None draws
            64 bits from the OS.
        return_weights: also return V and the seed as a :class:`RandomFeatures`.

    Returns (n, p) float64, or a :class:`RandomFeatures`.
    """
    x = as_matrix(x, "x", min_cols=1)
    p = check_pos_int(num_features, "num_features")
    scale = check_nonneg(scale, "scale")
    if scale == 0:
        raise ValueError("scale: expected > 0, got 0")
    V, seed = draw_rf_weights(p, x.shape[1], scale, seed)
    Phi = activation_derivatives(activation, x @ V.T)[0]
    return RandomFeatures(Phi, V, seed) if return_weights else Phi


class RFRegressor:
    """Random-features regression: min-norm interpolator (ridge = 0) or ridge.

    ``fit(x, y)`` draws V (p, d) once (from ``seed``; None = OS entropy, the drawn
    seed is kept in ``seed_``) and keeps it, so ``predict`` uses the same
    features.  theta_ = Phi^T (Phi Phi^T + ridge I)^{-1} y when p >= n (kernel
    form; ridge = 0 is the GD-from-zero interpolator of the slides), else the
    primal (Phi^T Phi + ridge I)^{-1} Phi^T y (least squares when ridge = 0).
    Non-private.
    """

    def __init__(self, num_features, *, activation="relu", scale=1.0, ridge=0.0, seed=None):
        self.num_features = check_pos_int(num_features, "num_features")
        if activation not in RF_ACTIVATIONS:
            raise ValueError(f"activation: expected one of {RF_ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.scale = check_nonneg(scale, "scale")
        self.ridge = check_nonneg(ridge, "ridge")
        self.seed = seed

    def features(self, x):
        """phi(X V^T), (m, p) float64, with the fitted V."""
        self._check_fitted()
        x = as_matrix(x, "x", self.V_.shape[1])
        return activation_derivatives(self.activation, x @ self.V_.T)[0]

    def fit(self, x, y):
        x = as_matrix(x, "x")
        y = as_targets(y, x.shape[0])
        self.V_, self.seed_ = draw_rf_weights(self.num_features, x.shape[1], self.scale,
                                              self.seed)
        Phi = activation_derivatives(self.activation, x @ self.V_.T)[0]
        n, p = Phi.shape
        if p >= n:
            self.theta_ = Phi.T @ _solve_psd(Phi @ Phi.T, y, self.ridge)
        elif self.ridge > 0:
            self.theta_ = np.linalg.solve(Phi.T @ Phi + self.ridge * np.eye(p), Phi.T @ y)
        else:
            self.theta_ = np.linalg.lstsq(Phi, y, rcond=None)[0]
        return self

    def predict(self, x):
        return self.features(x) @ self.theta_

    def input_gradient(self, x):
        """grad_x f(x) = V^T (phi'(V x) o theta), eq. (2); (m, d)."""
        self._check_fitted()
        x = as_matrix(x, "x", self.V_.shape[1])
        dphi = activation_derivatives(self.activation, x @ self.V_.T)[1]
        return (dphi * self.theta_) @ self.V_

    def sensitivity(self, x):
        """S_f(x) = ||x|| ||grad_x f(x)|| per row, (m,)."""
        return sensitivity(self, x)

    def _check_fitted(self):
        if not hasattr(self, "theta_"):
            raise RuntimeError("RFRegressor: call fit(x, y) first")


class NTKRegressor:
    """Kernel regression with an empirical NTK; f(x) = K(x, X) (K + ridge I)^{-1} y.

    Two ways to give the network:

    * ``width=k`` (the slides' model): the symmetric two-layer network with
      W_0^(2) = W_0^(1) ~ N(0, 1/d) drawn at ``fit`` (seed kept in ``seed_``),
      f(x, w_0) = 0, p = 2kd trained first-layer parameters; kernel (1) of the
      module docstring in closed form (any of :data:`RF_ACTIVATIONS`, including
      the even "logcosh").  ``train="all"`` also trains the +-1 output weights
      (p = 2kd + 2k): the kernel is then :func:`ncdp_fast.ntk_gram` of the
      2k-neuron network (activations of ``ntk_gram`` only).
    * ``weights=[W_1, ..., W_L]`` (out x in, as nn.Linear; last layer one
      output): the empirical NTK of that MLP by :func:`ncdp_fast.ntk_gram`
      (with ``biases``, ``parameterization``); f(x, theta_0) is *not*
      subtracted -- the kernel predictor is the linearised model's increment.

    ridge = 0 gives the min-norm interpolator theta_0 + Phi^T (Phi Phi^T)^{-1} y of
    the slides (needs K positive definite, p >= n).  Non-private.
    """

    def __init__(self, width=None, *, weights=None, biases=None, activation="logcosh",
                 parameterization="standard", train="first", ridge=0.0, seed=None):
        if (width is None) == (weights is None):
            raise ValueError("NTKRegressor: give either width (the slides' two-layer model) or "
                             "weights (an MLP), not both or neither")
        self.width = None if width is None else check_pos_int(width, "width")
        if activation not in RF_ACTIVATIONS:
            raise ValueError(f"activation: expected one of {RF_ACTIVATIONS}, got {activation!r}")
        if train not in ("first", "all"):
            raise ValueError(f"train: expected 'first' or 'all', got {train!r}")
        if (train == "all" or weights is not None) and activation not in _NTK_ACTIVATIONS:
            raise ValueError(f"activation: ntk_gram supports {_NTK_ACTIVATIONS}, got "
                             f"{activation!r} (use width=..., train='first' for 'logcosh')")
        self.weights = None if weights is None else [np.asarray(w, np.float64) for w in weights]
        if self.weights is not None and self.weights[-1].shape[0] != 1:
            raise ValueError(f"weights: the last layer must have one output, got shape "
                             f"{self.weights[-1].shape}")
        self.biases = None if biases is None else [None if b is None else np.asarray(b, np.float64)
                                                   for b in biases]
        self.activation, self.parameterization, self.train = activation, parameterization, train
        self.ridge = check_nonneg(ridge, "ridge")
        self.seed = seed

    # -- the kernel -----------------------------------------------------------------------
    def _two_layer_net(self):
        W2 = np.concatenate([self.W_, self.W_], axis=0)
        a = np.concatenate([np.ones(self.width), -np.ones(self.width)])[None, :]
        return [W2, a]

    def kernel(self, x, x2=None):
        """K(x, x2) (m, m2) float64 for the fitted network."""
        self._check_init()
        x = as_matrix(x, "x", self.d_)
        x2 = x if x2 is None else as_matrix(x2, "x2", self.d_)
        if self.weights is not None:
            return ntk_gram(x, self.weights, biases=self.biases, activation=self.activation,
                            x2=x2, parameterization=self.parameterization)
        if self.train == "all":
            return ntk_gram(x, self._two_layer_net(), activation=self.activation, x2=x2)
        d1 = activation_derivatives(self.activation, x @ self.W_.T)[1]
        d2 = d1 if x2 is x else activation_derivatives(self.activation, x2 @ self.W_.T)[1]
        return 2.0 * (d1 @ d2.T) * (x @ x2.T)

    @property
    def num_params(self):
        if self.weights is not None:
            count = sum(w.size for w in self.weights)
            if self.biases is not None:
                count += sum(b.size for b in self.biases if b is not None)
            return int(count)
        self._check_init()
        return 2 * self.width * self.d_ + (2 * self.width if self.train == "all" else 0)

    def fit(self, x, y):
        x = as_matrix(x, "x")
        y = as_targets(y, x.shape[0])
        self.d_ = x.shape[1]
        if self.weights is None:
            self.seed_ = _backend.resolve_seed(self.seed)
            self.W_ = np.random.default_rng(self.seed_).standard_normal((self.width, self.d_)) \
                / math.sqrt(self.d_)
        elif self.weights[0].shape[1] != self.d_:
            raise ValueError(f"x: expected {self.weights[0].shape[1]} columns (weights[0] is "
                             f"{self.weights[0].shape}), got {x.shape}")
        if self.ridge == 0 and self.num_params < x.shape[0]:
            raise ValueError(f"NTKRegressor: {self.num_params} parameters < {x.shape[0]} samples: "
                             "the NTK is singular and cannot interpolate; pass ridge > 0")
        self.x_train_ = x
        self.alpha_ = _solve_psd(self.kernel(x), y, self.ridge)
        return self

    def predict(self, x):
        self._check_fitted()
        return self.kernel(x, self.x_train_) @ self.alpha_

    def input_gradient(self, x):
        """grad_x f(x) (m, d): eq. (3) (two-layer, train='first'), the same plus the
        output-weight term 2 W^T (phi'(Wx) o phi(W X^T) alpha) (train='all'), or
        torch autograd through the factor form (deep MLP)."""
        self._check_fitted()
        x = as_matrix(x, "x", self.d_)
        if self.weights is not None:
            return self._autograd_gradient(x)
        X, W, al = self.x_train_, self.W_, self.alpha_
        _, d1x, d2x = activation_derivatives(self.activation, x @ W.T)  # (m, k)
        fX, d1X, _ = activation_derivatives(self.activation, X @ W.T)   # (n, k)
        B = al[:, None] * (X @ x.T)                             # (n, m): alpha_j <x_j, x>
        g = 2.0 * ((d2x * (B.T @ d1X)) @ W)                     # phi'' term
        g += 2.0 * ((al[:, None] * (d1X @ d1x.T)).T @ X)        # <x, x_j> term
        if self.train == "all":
            # second-layer NTK term 2 phi(Wx).phi(Wx_j): grad 2 W^T (phi'(Wx) o phi(W x_j))
            g += 2.0 * ((d1x * (al @ fX)[None, :]) @ W)
        return g

    def _autograd_gradient(self, x):
        import torch
        ns = namespace("torch")
        W = [torch.from_numpy(w) for w in self.weights]
        b = None if self.biases is None else [None if v is None else torch.from_numpy(v)
                                              for v in self.biases]
        X = torch.from_numpy(self.x_train_)
        al = torch.from_numpy(self.alpha_)
        tX = ntk_factors(X, W, b, self.activation, self.parameterization, ns, torch.matmul)
        xt = torch.from_numpy(x.copy()).requires_grad_(True)
        tx = ntk_factors(xt, W, b, self.activation, self.parameterization, ns, torch.matmul)
        K = 0
        for (fx, bx), (fX, bX) in zip(tx, tX):
            term = bx @ bX.T
            K = K + (term if fx is None else (fx @ fX.T) * term)
        (K @ al).sum().backward()                # rows are independent: sum gives each row's grad
        return xt.grad.numpy()

    def sensitivity(self, x):
        """S_f(x) = ||x|| ||grad_x f(x)|| per row, (m,)."""
        return sensitivity(self, x)

    def _check_init(self):
        if not hasattr(self, "d_"):
            raise RuntimeError("NTKRegressor: call fit(x, y) first")

    def _check_fitted(self):
        if not hasattr(self, "alpha_"):
            raise RuntimeError("NTKRegressor: call fit(x, y) first")


def sensitivity(model, x):
    """S_f(x) = ||x||_2 ||grad_x f(x)||_2 for each row of x (slides, "A sufficient
    condition for NTK features": the first-order change of f under a perturbation
    of relative size delta is at most delta * S_f(x)).

    model: a fitted :class:`RFRegressor` or :class:`NTKRegressor`; x: (m, d).
    Returns (m,) float64.  Exact (closed form or autograd), no finite differences.
    """
    if not hasattr(model, "input_gradient"):
        raise TypeError(f"model: expected a fitted RFRegressor or NTKRegressor, "
                        f"got {type(model).__name__}")
    g = model.input_gradient(x)
    x = as_matrix(x, "x")
    return np.linalg.norm(x, axis=1) * np.linalg.norm(g, axis=1)
