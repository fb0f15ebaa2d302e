"""DESIGN.md kernel 3: Hadamard-product NTK Gram.

The slow, obviously correct version forms the Jacobian J (n x #params)
explicitly by hand-written backpropagation, one example and one output at a
time, and returns mean_o J_o J_o^T (neural-tangents' trace over the output axis).
"""
from __future__ import annotations

import numpy as np


def _activation(name):
    from scipy.special import erf, expit
    sqrt2, sqrtpi = np.sqrt(2.0), np.sqrt(np.pi)
    table = {
        "relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(float)),
        "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2),
        "erf": (erf, lambda z: 2.0 / sqrtpi * np.exp(-z * z)),
        "gelu": (lambda z: 0.5 * z * (1.0 + erf(z / sqrt2)),
                 lambda z: 0.5 * (1.0 + erf(z / sqrt2)) + z * np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)),
        "softplus": (lambda z: np.logaddexp(0.0, z), expit),
        "identity": (lambda z: z, lambda z: np.ones_like(z)),
    }
    return table[name]


def ntk_jacobian(x, weights, biases=None, activation="relu", parameterization="standard"):
    """J of shape (n, K_out, #params): d f_o(x_i) / d theta, theta = (W_1, b_1, ..., W_L, b_L)
    flattened layer by layer (weight row-major, then bias)."""
    phi, dphi = _activation(activation)
    X = np.asarray(x, dtype=np.float64)
    Ws = [np.asarray(w, dtype=np.float64) for w in weights]
    bs = [None if biases is None or biases[i] is None else np.asarray(biases[i], np.float64)
          for i in range(len(Ws))]
    L = len(Ws)
    scale = [1.0 / np.sqrt(W.shape[1]) if parameterization == "ntk" else 1.0 for W in Ws]
    K_out = Ws[-1].shape[0]
    rows = []
    for i in range(X.shape[0]):
        F = [X[i]]
        Z = []
        for l in range(L):
            z = scale[l] * Ws[l] @ F[-1] + (bs[l] if bs[l] is not None else 0.0)
            Z.append(z)
            if l < L - 1:
                F.append(phi(z))
        per_out = []
        for o in range(K_out):
            B = [None] * L
            B[L - 1] = np.eye(K_out)[o]
            for l in range(L - 2, -1, -1):
                B[l] = dphi(Z[l]) * (scale[l + 1] * Ws[l + 1].T @ B[l + 1])
            grads = []
            for l in range(L):
                grads.append(scale[l] * np.outer(B[l], F[l]).ravel())
                if bs[l] is not None:
                    grads.append(B[l])
            per_out.append(np.concatenate(grads))
        rows.append(per_out)
    return np.array(rows)


def ntk_gram(x, weights, biases=None, activation="relu", x2=None, parameterization="standard"):
    """K(x, x2) = mean over outputs of J_o(x) J_o(x2)^T, in float64."""
    J1 = ntk_jacobian(x, weights, biases, activation, parameterization)
    J2 = J1 if x2 is None else ntk_jacobian(x2, weights, biases, activation, parameterization)
    return np.einsum("iop,jop->ij", J1, J2) / J1.shape[1]
