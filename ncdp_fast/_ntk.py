"""Op 3 of DESIGN.md: empirical NTK Gram matrices as sums of Hadamard products.

For f(x) = W_L phi(... phi(W_1 x + b_1) ...) + b_L (weights out x in, as
torch.nn.Linear), with F_0 = x, z_l = s_l W_l F_{l-1} + b_l, F_l = phi(z_l),
B_L = I, B_l = phi'(z_l) o (s_{l+1} W_{l+1}^T B_{l+1}) (s_l = 1, or
1/sqrt(fan_in) for the NTK parameterization):

    K(x, x') = sum_l s_l^2 <F_{l-1}(x), F_{l-1}(x')> <B_l(x), B_l(x')>_F / K_out
               + sum_l <B_l(x), B_l(x')>_F / K_out          (biases)

which is J J^T averaged over the K_out outputs (neural-tangents' trace over the
output axis) -- 004_f44587b9249a6ca9.txt, "Bounding the smallest eigenvalue of
the NTK".  The factors F, B are computed here with the caller's array library
(one forward and one backward pass, O(n * width * K_out) memory); the Gram
itself -- the n x n x depth part -- is the kernel.  J (n x #params) is never
formed.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from . import _backend
from ._clip import _shape

__all__ = ["ACTIVATIONS", "ntk_gram", "ntk_factors"]

ACTIVATIONS = ("relu", "tanh", "erf", "gelu", "softplus", "identity")


def _namespace(lib):
    """Elementwise functions of one array library, so the activations below are
    written once for NumPy and torch."""
    if lib == "torch":
        import torch
        return SimpleNamespace(erf=torch.erf, exp=torch.exp, tanh=torch.tanh,
                               sigmoid=torch.sigmoid, relu=torch.relu,
                               softplus=lambda z: torch.nn.functional.softplus(z, threshold=1e9),
                               positive=lambda z: (z > 0).to(z.dtype),
                               with_ones=lambda a: torch.cat([a, a.new_ones((a.shape[0], 1))], 1),
                               lib="torch")
    from scipy.special import erf, expit
    return SimpleNamespace(erf=erf, exp=np.exp, tanh=np.tanh, sigmoid=expit,
                           relu=lambda z: np.maximum(z, 0), softplus=lambda z: np.logaddexp(0, z),
                           positive=lambda z: (z > 0).astype(z.dtype),
                           with_ones=lambda a: np.concatenate([a, np.ones((a.shape[0], 1), a.dtype)],
                                                              axis=1),
                           lib="numpy")


_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def activation(name, z, ns):
    """(phi(z), phi'(z)) for the supported activations."""
    if name == "relu":
        return ns.relu(z), ns.positive(z)
    if name == "tanh":
        t = ns.tanh(z)
        return t, 1 - t * t
    if name == "erf":
        return ns.erf(z), (2.0 / math.sqrt(math.pi)) * ns.exp(-z * z)
    if name == "gelu":       # exact form: z Phi(z)
        cdf = 0.5 * (1 + ns.erf(z / _SQRT2))
        return z * cdf, cdf + z * _INV_SQRT_2PI * ns.exp(-0.5 * z * z)
    if name == "softplus":
        return ns.softplus(z), ns.sigmoid(z)
    if name == "identity":
        return z, z * 0 + 1
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")


def _check_network(x_shape, weights, biases, activation_name, parameterization, be, dtype,
                   x2_shape=None):
    if activation_name not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation_name!r}")
    if parameterization not in ("standard", "ntk"):
        raise ValueError(f"parameterization: expected 'standard' or 'ntk', got "
                         f"{parameterization!r}")
    if not isinstance(weights, (list, tuple)) or not weights:
        raise TypeError("weights: expected a non-empty list of (out, in) matrices")
    if len(x_shape) != 2:
        raise ValueError(f"x: expected shape (n, d), got {x_shape}")
    width = x_shape[1]
    for l, w in enumerate(weights):
        s = _shape(w, f"weights[{l}]")
        if len(s) != 2:
            raise ValueError(f"weights[{l}]: expected an (out, in) matrix, got shape {s}")
        if s[1] != width:
            what = "x has" if l == 0 else f"weights[{l - 1}] outputs"
            raise ValueError(f"weights[{l}]: expects inputs of width {s[1]} but {what} {width} "
                             "(weights are out x in, as torch.nn.Linear)")
        if be.check_float(w, f"weights[{l}]") != dtype:
            raise TypeError(f"weights[{l}]: dtype {be.io.dtype_of(w)} differs from x's {dtype}")
        width = s[0]
    if x2_shape is not None and (len(x2_shape) != 2 or x2_shape[1] != x_shape[1]):
        raise ValueError(f"x2: expected shape (n2, {x_shape[1]}), got {x2_shape}")
    if biases is not None:
        if not isinstance(biases, (list, tuple)) or len(biases) != len(weights):
            raise ValueError(f"biases: expected None or a list of {len(weights)} entries "
                             "(None for a layer without bias)")
        for l, b in enumerate(biases):
            if b is not None and _shape(b, f"biases[{l}]") != (_shape(weights[l], "w")[0],):
                raise ValueError(f"biases[{l}]: expected shape ({_shape(weights[l], 'w')[0]},), "
                                 f"got {_shape(b, f'biases[{l}]')}")


def ntk_factors(x, weights, biases, activation_name, parameterization, ns, matmul):
    """The Gram's terms as a list of (f, b) factor pairs, f None for a constant
    1: K = sum (f f'^T) o (b b'^T), one term per layer.  Arrays of x's library;
    B is flattened over (width, output) and scaled by 1/sqrt(K_out) so that the
    Frobenius inner product averages the per-output kernels; f carries a ones
    column when the layer has a bias."""
    L = len(weights)
    scale = [1.0 / math.sqrt(w.shape[1]) if parameterization == "ntk" else 1.0 for w in weights]
    K_out = weights[-1].shape[0]
    F = [x]
    dphi = []
    for l in range(L - 1):
        z = matmul(F[-1], weights[l].T) * scale[l]
        if biases is not None and biases[l] is not None:
            z = z + biases[l]
        act, der = activation(activation_name, z, ns)
        F.append(act)
        dphi.append(der)
    n = x.shape[0]
    inv = 1.0 / math.sqrt(K_out)

    def has_bias(l):
        return biases is not None and biases[l] is not None

    def input_factor(l):
        # A bias is a weight on a constant-1 input: appending a ones column to
        # the layer input folds the bias term into the weight term, one GEMM
        # pair per layer instead of two.
        f = F[l] * scale[l]
        return ns.with_ones(f) if has_bias(l) else f

    # Last layer: B_L = I, so <B_L, B_L'>_F / K_out = 1 and the term is one factor.
    terms = [(None, input_factor(L - 1))]
    # Backward: Bm holds B_l as (n, width_l, K_out).
    Bm = None
    for l in range(L - 2, -1, -1):
        Wt = weights[l + 1].T * scale[l + 1]                     # (width_l, width_{l+1})
        if Bm is None:                                            # B_{L-1} = phi' o W_L^T
            Bm = dphi[l][:, :, None] * Wt[None, :, :]
        else:
            Bm = dphi[l][:, :, None] * _batched_left(Wt, Bm, matmul, ns)
        terms.append((input_factor(l), Bm.reshape(n, -1) * inv))
    return terms


def _batched_left(Wt, Bm, matmul, ns):
    """Wt @ Bm[i] for every i, as one GEMM: (n, w_{l+1}, K) -> (n, w_l, K)."""
    n, w1, K = Bm.shape
    swap = (lambda a: a.permute(1, 0, 2)) if ns.lib == "torch" else (lambda a: a.transpose(1, 0, 2))
    out = matmul(Wt, swap(Bm).reshape(w1, n * K))
    return swap(out.reshape(Wt.shape[0], n, K))


def ntk_gram(x, weights, *, biases=None, activation="relu", x2=None, parameterization="standard",
             diagonal=False, output="trace", accumulate_f64=False):
    """Empirical NTK Gram matrix of an MLP, without forming the Jacobian.

    Args:
        x: (n, d) inputs; float32 or float64; NumPy, torch CPU or torch CUDA.
        weights: [W_1, ..., W_L], W_l of shape (out_l, in_l) as torch.nn.Linear.
        biases: None, or a list of L entries (an (out_l,) array or None).
        activation: one of relu, tanh, erf, gelu (exact erf form), softplus, identity.
        x2: (n2, d) second inputs for the cross-Gram K(x, x2); None for K(x, x).
        parameterization: "standard", or "ntk" (each layer scaled by
            1/sqrt(fan_in) in the forward pass, gradients w.r.t. the unscaled
            weights, as neural-tangents defines it).
        diagonal: return only K(x_i, x_i) (or K(x_i, x2_i)), shape (n,).
        output: "trace" -- the mean over the K_out outputs of each output's
            kernel (neural-tangents' default trace_axes=(-1,)).
        accumulate_f64: CUDA only: float64 accumulation for float32 inputs
            (result float64).

    Returns K of shape (n, n2) (exactly symmetric when x2 is None), or (n,),
    in x's dtype and array type.  Extra memory beyond the layer factors
    (n x width x K_out) is O(block^2).
    """
    if output != "trace":
        raise ValueError(f"output: only 'trace' (mean over outputs) is supported, got {output!r}")
    arrays = {"x": x, "x2": x2}
    arrays.update({f"weights[{l}]": w for l, w in enumerate(weights)} if isinstance(
        weights, (list, tuple)) else {})
    arrays.update({f"biases[{l}]": b for l, b in enumerate(biases)} if isinstance(
        biases, (list, tuple)) else {})
    be = _backend.select("ntk", **arrays)
    dtype = be.check_float(x, "x")
    xs = _shape(x, "x")
    x2s = None if x2 is None else _shape(x2, "x2")
    if x2 is not None and be.check_float(x2, "x2") != dtype:
        raise TypeError(f"x2: dtype {be.io.dtype_of(x2)} differs from x's {dtype}")
    _check_network(xs, weights, biases, activation, parameterization, be, dtype, x2s)
    if be.name == "cuda" and be.io.lib != "torch":
        raise TypeError("x: on the GPU ntk_gram takes torch CUDA tensors")
    # Factors are computed by the caller's own library: torch tensors (CPU or
    # CUDA) with torch ops -- no copies for transposed views, no second BLAS
    # pool -- and NumPy arrays with NumPy.
    use_torch = be.io.lib == "torch"
    if use_torch:
        conv = lambda a: a.detach()                      # noqa: E731
        ns, matmul = _namespace("torch"), _torch_matmul()
    else:
        conv = be.io.to_kernel
        ns, matmul = _namespace("numpy"), np.matmul
    xw = [conv(w) for w in weights]
    xb = None if biases is None else [None if b is None else conv(b) for b in biases]
    t1 = ntk_factors(conv(x), xw, xb, activation, parameterization, ns, matmul)
    t2 = t1 if x2 is None else ntk_factors(conv(x2), xw, xb, activation, parameterization, ns,
                                           matmul)
    if use_torch and be.name == "cpu":                    # the CPU kernel takes NumPy views
        t1 = [(None if f is None else f.contiguous().numpy(), b.contiguous().numpy())
              for f, b in t1]
        t2 = t1 if x2 is None else [(None if f is None else f.contiguous().numpy(),
                                     b.contiguous().numpy()) for f, b in t2]
    n = xs[0]
    n2 = n if x2 is None else x2s[0]
    if diagonal:
        if n2 != n:
            raise ValueError(f"diagonal: needs as many rows in x2 as in x ({n2} != {n})")
        return be.io.to_user(_diagonal(t1, t2, be, dtype, n))
    out_dtype = np.dtype(np.float64) if accumulate_f64 and be.name == "cuda" else dtype
    out = be.io.empty((n, n2), out_dtype)
    f = [None if fl is None else _contig(fl) for fl, _ in t1]
    b = [_contig(bl) for _, bl in t1]
    f2 = f if x2 is None else [None if fl is None else _contig(fl) for fl, _ in t2]
    b2 = b if x2 is None else [_contig(bl) for _, bl in t2]
    be.kernels.hadamard_gram(f, b, f2, b2, out, x2 is None,
                             matmul=getattr(be.io, "matmul", None), accumulate_f64=accumulate_f64)
    return be.io.to_user(out)


def _contig(a):
    return a.contiguous() if hasattr(a, "contiguous") else np.ascontiguousarray(a)


def _torch_matmul():
    import torch
    return torch.matmul


def _diagonal(t1, t2, be, dtype, n):
    out = None
    for (fa, ba), (fb, bb) in zip(t1, t2):
        q = (ba * bb).sum(1)
        term = q if fa is None else (fa * fb).sum(1) * q
        out = term if out is None else out + term
    if isinstance(out, np.ndarray):
        return np.ascontiguousarray(out, dtype=dtype)
    return out.contiguous()
