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

from . import _arrays, _backend
from ._cuda.ntk import ieee_float32_matmul
from ._validate import check_bool, check_choice

__all__ = ["ACTIVATIONS", "ntk_gram", "ntk_factors", "namespace", "activation", "accumulate_gram"]

ACTIVATIONS = ("relu", "tanh", "erf", "gelu", "softplus", "identity")


def namespace(lib):
    """The functions of one array library ("torch" or "numpy") that the factors
    need, so the activations and passes below are written once for both.
    ``as_input`` takes a caller's array as the factor code reads it: detached
    from autograd (torch, no copy), C-contiguous (NumPy)."""
    if lib == "torch":
        import torch
        return SimpleNamespace(erf=torch.erf, exp=torch.exp, tanh=torch.tanh,
                               sigmoid=torch.sigmoid, relu=torch.relu,
                               softplus=lambda z: torch.nn.functional.softplus(z, threshold=1e9),
                               positive=lambda z: (z > 0).to(z.dtype),
                               with_ones=lambda a: torch.cat([a, a.new_ones((a.shape[0], 1))], 1),
                               swap01=lambda a: a.permute(1, 0, 2), matmul=torch.matmul,
                               as_input=lambda a: a.detach(), lib="torch")
    from scipy.special import erf, expit
    return SimpleNamespace(erf=erf, exp=np.exp, tanh=np.tanh, sigmoid=expit,
                           relu=lambda z: np.maximum(z, 0), softplus=lambda z: np.logaddexp(0, z),
                           positive=lambda z: (z > 0).astype(z.dtype),
                           with_ones=lambda a: np.concatenate([a, np.ones((a.shape[0], 1), a.dtype)],
                                                              axis=1),
                           swap01=lambda a: a.transpose(1, 0, 2), matmul=np.matmul,
                           as_input=np.ascontiguousarray, lib="numpy")


_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_derivative(z, ns):
    cdf = 0.5 * (1 + ns.erf(z / _SQRT2))
    return cdf + z * _INV_SQRT_2PI * ns.exp(-0.5 * z * z)


def _tanh_derivative(z, ns):
    t = ns.tanh(z)
    return 1 - t * t


# name -> (phi, phi'), each (z, ns) -> array; gelu is the exact form z Phi(z).
_ACT = {
    "relu": (lambda z, ns: ns.relu(z), lambda z, ns: ns.positive(z)),
    "tanh": (lambda z, ns: ns.tanh(z), _tanh_derivative),
    "erf": (lambda z, ns: ns.erf(z), lambda z, ns: (2.0 / math.sqrt(math.pi)) * ns.exp(-z * z)),
    "gelu": (lambda z, ns: z * (0.5 * (1 + ns.erf(z / _SQRT2))), _gelu_derivative),
    "softplus": (lambda z, ns: ns.softplus(z), lambda z, ns: ns.sigmoid(z)),
    "identity": (lambda z, ns: z, lambda z, ns: z * 0 + 1),
}



def activation(name, z, ns, part="both"):
    """(phi(z), phi'(z)) for the supported activations; ``part`` "value" or
    "derivative" computes only that one (no temporary for the other)."""
    if name not in _ACT:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")
    phi, dphi = _ACT[name]
    if part == "value":
        return phi(z, ns)
    if part == "derivative":
        return dphi(z, ns)
    return phi(z, ns), dphi(z, ns)


def _check_network(x_shape, weights, biases, activation_name, parameterization, be, dtype,
                   x2_shape=None):
    check_choice(activation_name, "activation", ACTIVATIONS)
    check_choice(parameterization, "parameterization", ("standard", "ntk"))
    if not isinstance(weights, (list, tuple)) or not weights:
        raise TypeError("weights: expected a non-empty list of (out, in) matrices")
    if len(x_shape) != 2:
        raise ValueError(f"x: expected shape (n, d), got {x_shape}")
    width = x_shape[1]
    for l, w in enumerate(weights):
        s = _arrays.shape(w, f"weights[{l}]")
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
            if b is None:
                continue
            want, got = (_arrays.shape(weights[l], "w")[0],), _arrays.shape(b, f"biases[{l}]")
            if got != want:
                raise ValueError(f"biases[{l}]: expected shape {want}, got {got}")
            if be.check_float(b, f"biases[{l}]") != dtype:
                raise TypeError(f"biases[{l}]: dtype {be.io.dtype_of(b)} differs from x's {dtype}")


def check_finite_network(named) -> None:
    """Refuse NaN or Inf in the network's arrays ``named`` [(name, array or
    None)]: the Gram would come out NaN without a word (the sixth audit: an
    input row of NaN made all 144 entries NaN).  One read of each array."""
    for name, a in named:
        if a is not None and not _arrays.all_finite(a):
            raise ValueError(f"{name}: expected finite values, got NaN or Inf")


def iter_ntk_factors(x, weights, biases, activation_name, parameterization, ns, matmul):
    """The Gram's terms as (f, b) factor pairs, last layer first, f None for a
    constant 1: K = sum (f f'^T) o (b b'^T), one term per layer.  Arrays of x's
    library; B is flattened over (width, output) and scaled by 1/sqrt(K_out) so
    that the Frobenius inner product averages the per-output kernels; f carries
    a ones column when the layer has a bias.

    A generator, so that a caller accumulating term by term holds one layer's
    factors at a time: the forward pass keeps only the pre-activations z_l,
    and phi(z_l), phi'(z_l) are recomputed when the backward sweep reaches
    layer l (an elementwise pass, against the n x n x width Gram work).  Peak
    memory is then sum_l |z_l| plus two layers' factors instead of every F, B
    and phi' at once (at (n, N, L) = (8192, 2048, 4): 0.34 GB instead of 0.6 GB).
    """
    L = len(weights)
    scale = [1.0 / math.sqrt(w.shape[1]) if parameterization == "ntk" else 1.0 for w in weights]
    K_out = weights[-1].shape[0]
    n = x.shape[0]
    inv = 1.0 / math.sqrt(K_out)

    def has_bias(l):
        return biases is not None and biases[l] is not None

    def input_factor(l, f):
        # A bias is a weight on a constant-1 input: appending a ones column to
        # the layer input folds the bias term into the weight term, one GEMM
        # pair per layer instead of two.
        if scale[l] != 1.0:
            f = f * scale[l]
        return ns.with_ones(f) if has_bias(l) else f

    Z = []                                                        # pre-activations z_0..z_{L-2}
    f = x
    for l in range(L - 1):
        z = matmul(f, weights[l].T)
        if scale[l] != 1.0:
            z = z * scale[l]
        if has_bias(l):
            z = z + biases[l]
        Z.append(z)
        f = activation(activation_name, z, ns, "value")
    # Last layer: B_L = I, so <B_L, B_L'>_F / K_out = 1 and the term is one factor.
    yield (None, input_factor(L - 1, f))
    del f
    Bm = None                                                     # B_l as (n, width_l, K_out)
    for l in range(L - 2, -1, -1):
        z = Z.pop()
        dphi = activation(activation_name, z, ns, "derivative")
        del z
        Wt = weights[l + 1].T
        if scale[l + 1] != 1.0:
            Wt = Wt * scale[l + 1]                                # (width_l, width_{l+1})
        if Bm is None:                                            # B_{L-1} = phi' o W_L^T
            Bm = dphi[:, :, None] * Wt[None, :, :]
        else:
            Bm = dphi[:, :, None] * _batched_left(Wt, Bm, matmul, ns)
        del dphi
        f = x if l == 0 else activation(activation_name, Z[-1], ns, "value")
        b = Bm.reshape(n, -1)
        yield (input_factor(l, f), b * inv if inv != 1.0 else b)
        del f, b


def ntk_factors(x, weights, biases, activation_name, parameterization, ns, matmul):
    """All terms of :func:`iter_ntk_factors` at once (a list)."""
    return list(iter_ntk_factors(x, weights, biases, activation_name, parameterization, ns,
                                 matmul))


def _batched_left(Wt, Bm, matmul, ns):
    """Wt @ Bm[i] for every i, as one GEMM: (n, w_{l+1}, K) -> (n, w_l, K)."""
    n, w1, K = Bm.shape
    out = matmul(Wt, ns.swap01(Bm).reshape(w1, n * K))
    return ns.swap01(out.reshape(Wt.shape[0], n, K))


def ntk_gram(x, weights, *, biases=None, activation="relu", x2=None, parameterization="standard",
             diagonal=False, accumulate_f64=False):
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
        accumulate_f64: CUDA only: float64 products and accumulation for
            float32 inputs (upcast exactly; result float64).

    Returns K of shape (n, n2) (exactly symmetric when x2 is None), or (n,),
    in x's dtype and array type: the mean over the K_out outputs of each
    output's kernel (neural-tangents' default trace_axes=(-1,)).  Extra memory
    beyond the layer factors (n x width x K_out) is O(block^2) on the CPU and
    two product temporaries of at most 1024 x n2 cells (256 MiB at most) on a
    GPU, where the products are the vendor's GEMMs with TF32 off for the call.
    """
    arrays = {"x": x, "x2": x2}
    arrays.update({f"weights[{l}]": w for l, w in enumerate(weights)} if isinstance(
        weights, (list, tuple)) else {})
    arrays.update({f"biases[{l}]": b for l, b in enumerate(biases)} if isinstance(
        biases, (list, tuple)) else {})
    be = _backend.select("ntk", **arrays)
    dtype = be.check_float(x, "x")
    xs = _arrays.shape(x, "x")
    x2s = None if x2 is None else _arrays.shape(x2, "x2")
    if x2 is not None and be.check_float(x2, "x2") != dtype:
        raise TypeError(f"x2: dtype {be.io.dtype_of(x2)} differs from x's {dtype}")
    for nm, sh in (("x", xs), ("x2", x2s)):
        if sh is not None and (len(sh) != 2 or sh[0] == 0):
            raise ValueError(f"{nm}: expected shape (n, d) with n >= 1 rows, got {sh}")
    _check_network(xs, weights, biases, activation, parameterization, be, dtype, x2s)
    check_finite_network(arrays.items())
    if be.name == "cuda" and be.io.lib != "torch":
        raise TypeError("x: on the GPU ntk_gram takes torch CUDA tensors")
    # Factors are computed by the caller's own library: torch tensors (CPU or
    # CUDA) with torch ops -- no copies for transposed views, no second BLAS
    # pool -- and NumPy arrays with NumPy.
    ns = namespace(be.io.lib)
    xw = [ns.as_input(w) for w in weights]
    xb = None if biases is None else [None if b is None else ns.as_input(b) for b in biases]

    def terms(inputs):
        return iter_ntk_factors(ns.as_input(inputs), xw, xb, activation, parameterization, ns,
                                ns.matmul)

    def view(a):                                          # a factor as the kernels take it
        return None if a is None else be.io.to_kernel(a)

    diagonal = check_bool(diagonal, "diagonal")
    accumulate_f64 = check_bool(accumulate_f64, "accumulate_f64")
    n = xs[0]
    n2 = n if x2 is None else x2s[0]
    if diagonal and n2 != n:
        raise ValueError(f"diagonal: needs as many rows in x2 as in x ({n2} != {n})")
    # Terms are paired layer by layer; on the CPU each pair is consumed before
    # the next is computed, so only one layer's factors exist at a time.
    pairs = ((t, t) for t in terms(x)) if x2 is None else zip(terms(x), terms(x2))
    if diagonal:                                          # in the caller's library already
        return _diagonal(pairs, dtype)
    if be.name == "cpu":
        out = be.io.zeros((n, n2), dtype)
        accumulate_gram(be, pairs, out, x2 is None)
        return be.io.to_user(out)
    # CUDA: every term in one call (the lower triangle is mirrored once), on the
    # vendor's GEMMs, TF32 off for the factors' products too: the result's
    # accuracy is IEEE float32's whatever the caller set.
    out_dtype = np.dtype(np.float64) if accumulate_f64 else dtype
    out = be.io.empty((n, n2), out_dtype)
    with ieee_float32_matmul():
        pairs = list(pairs)
        f = [view(t[0]) for t, _ in pairs]
        b = [view(t[1]) for t, _ in pairs]
        f2 = f if x2 is None else [view(t[0]) for _, t in pairs]
        b2 = b if x2 is None else [view(t[1]) for _, t in pairs]
        be.kernels.hadamard_gram(f, b, f2, b2, out, x2 is None, accumulate_f64=accumulate_f64)
    return be.io.to_user(out)


def accumulate_gram(be, pairs, out, symmetric):
    """CPU: ``out += sum (fa fb^T) o (ba bb^T)`` over the factor pairs ``((fa, ba), (fb,
    bb))`` (an iterable, consumed one layer at a time; ``fa is None``: a constant-1
    factor), by the kernel of ``be`` (a CPU backend of :func:`_backend.select`).

    out: (n, n2) NumPy array of the factors' dtype (a view into a larger array is
    fine: the kernel writes it block by block); fa (n, a), ba (n, c), fb (n2, a),
    bb (n2, c) arrays of ``be``'s library.  ``symmetric``: the pairs are (t, t), so
    only blocks on and above the diagonal are computed and mirrored (out square).
    :func:`ntk_gram` and the row-sharded Gram of ``ncdp_fast.distributed`` (one
    block of rows against another rank's factors) both call it."""
    def view(a):
        return None if a is None else be.io.to_kernel(a)
    for (fa, ba), (fb, bb) in pairs:
        be.kernels.hadamard_gram([view(fa)], [view(ba)], [view(fb)], [view(bb)], out,
                                 symmetric, matmul=be.io.matmul, accumulate=True)


def _diagonal(pairs, dtype):
    """K(x_i, x2_i) = sum over layers of <f_i, f2_i> <b_i, b2_i>."""
    out = None
    for (fa, ba), (fb, bb) in pairs:
        q = (ba * bb).sum(1)
        term = q if fa is None else (fa * fb).sum(1) * q
        out = term if out is None else out + term
    if _arrays.kind(out) == "numpy":
        return np.ascontiguousarray(out, dtype=dtype)
    return out.contiguous()
