"""Op 1 of DESIGN.md, factored: the clip of a linear layer and the joint clip of
several parameter blocks (dense, linear pairs, ghost blocks), one factor per
sample from the total norm.

Layer 2 code, like the dense op in ``_clip.py`` (which re-exports this
module's names): validates, converts arrays, picks the backend once per call,
allocates outputs and calls the kernels of the chosen backend.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from . import _arrays, _backend, _balance, _stream
from ._clip_checks import _check_common, _check_noise_range
from ._clip_results import GhostBlock, LayersClipResult, LinearClipResult, _accounting
from ._validate import check_bool, check_choice, check_positive

__all__ = ["clip_and_noise_linear", "clip_and_noise_layers"]

_F64 = np.dtype(np.float64)


def _as_pair(activations, backprops, where=""):
    # The names joined only for an error (host time a layer, issue 36).
    sa = _arrays.shape(activations, "activations", where)
    sg = _arrays.shape(backprops, "backprops", where)
    if len(sa) not in (2, 3) or len(sg) != len(sa):
        raise ValueError(f"activations{where}, backprops{where}: expected shapes (B, d) and (B, K), "
                         f"or (B, T, d) and (B, T, K); got {sa} and {sg}")
    if sa[0] != sg[0]:
        raise ValueError(f"backprops{where}: batch size {sg[0]} does not match activations{where} "
                         f"batch size {sa[0]}")
    if len(sa) == 3 and sa[1] != sg[1]:
        raise ValueError(f"backprops{where}: sequence length {sg[1]} does not match "
                         f"activations{where} sequence length {sa[1]}")
    return sa, sg


def _as_3d(x, B, T):
    """x (B, T, n) as it is, or (B, n) as (B, 1, n): a reshape only where one
    is needed (each is an op of host time on a device, issue 36)."""
    return x if len(x.shape) == 3 else x.reshape(B, T, x.shape[-1])


def _check_dtype(be, x, dtype, name, where, whose=" of the other inputs"):
    """Refuse ``x`` (named ``name + where``) unless a float of ``dtype``; the
    name is formatted only for the error."""
    try:
        if be.io.dtype_of(x) == dtype:      # dtype is a float dtype: so is x's
            return
    except (TypeError, KeyError):           # no NumPy twin (half): check_float says so
        pass
    be.check_float(x, f"{name}{where}")
    raise TypeError(f"{name}{where}: dtype {be.io.dtype_of(x)} differs from {dtype}{whose}")


class _Layer:
    """One parameter block of a layered clip: a dense (B, ...) per-sample gradient,
    or a linear layer given by (activations, backprops[, bias])."""

    def __init__(self, spec, index, be, dtype):
        where = f"[{index}]"
        self.kind, self.members = "dense", None
        if isinstance(spec, GhostBlock):
            s = _arrays.shape(spec.sq_norms, f"layers{where}.sq_norms")
            if len(s) != 1:
                raise ValueError(f"layers{where}.sq_norms: expected shape (B,), got {s}")
            if be.io.dtype_of(spec.sq_norms) != _F64:
                raise TypeError(f"layers{where}.sq_norms: expected float64, got "
                                f"{be.io.dtype_of(spec.sq_norms)}")
            if not callable(spec.clipped_sum):
                raise TypeError(f"layers{where}.clipped_sum: expected a callable, got "
                                f"{type(spec.clipped_sum).__name__}")
            self.kind, self.dense, self.spec = "ghost", False, spec
            self.sq = be.io.to_kernel(spec.sq_norms)
            self.param_shape = tuple(int(n) for n in spec.shape)
            self.B, self.T = s[0], int(spec.seq_len)
            self.spread = None
            if spec.spread is not None:
                # Each sample's own rounding margin: a (1,) spread would be
                # broadcast over the batch, sample 0's for all (the eighth audit).
                got = _arrays.shape(spec.spread, f"layers{where}.spread")
                if got != (self.B,) or be.io.dtype_of(spec.spread) != _F64:
                    raise ValueError(f"layers{where}.spread: expected a ({self.B},) float64 "
                                     f"array (each sample's), got {got} "
                                     f"{be.io.dtype_of(spec.spread)}")
                self.spread = be.io.to_kernel(spec.spread)
            self.draws = math.prod(self.param_shape)
            self.terms = int(spec.terms)
            self.gemm = None
            if spec.gemm_sizes is not None:
                sizes, T, d, K = spec.gemm_sizes
                if tuple(_arrays.shape(sizes, f"layers{where}.gemm_sizes[0]")) != (self.B, 2) \
                        or be.io.dtype_of(sizes) != _F64:
                    raise ValueError(f"layers{where}.gemm_sizes[0]: expected a ({self.B}, 2) "
                                     f"float64 array, got {tuple(_arrays.shape(sizes, ''))} "
                                     f"{be.io.dtype_of(sizes)}")
                self.gemm = (be.io.to_kernel(sizes), int(T), int(d), int(K))
            return
        if isinstance(spec, (tuple, list)):
            self.kind = "pair"
            if len(spec) not in (2, 3):
                raise ValueError(f"layers{where}: expected a (B, ...) array or a tuple "
                                 f"(activations, backprops[, bias]), got a tuple of {len(spec)}")
            a, g = spec[0], spec[1]
            self.bias = check_bool(spec[2], f"layers{where}[2] (bias)") if len(spec) == 3 else True
            sa, sg = _as_pair(a, g, where)
            for name, x in (("activations", a), ("backprops", g)):
                _check_dtype(be, x, dtype, name, where)
            B, T = sa[0], (sa[1] if len(sa) == 3 else 1)
            # Operands of the library's own operations (GEMMs, reductions; no
            # launcher of ours reads them): any strides on a torch device.
            self.a = _as_3d(be.io.to_operand(a), B, T)
            self.g = _as_3d(be.io.to_operand(g), B, T)
            self.dense = False
            self.K, self.d, self.T = sg[-1], sa[-1], T
            # float64 multiply-adds in the sample's norm (reference.linear_terms)
            self.terms = self.d + self.K + T * T + T + (self.K if self.bias else 0)
            self.draws = self.K * self.d + (self.K if self.bias else 0)
        else:
            s = _arrays.shape(spec, "layers", where)
            if len(s) < 2:
                raise ValueError(f"layers{where}: expected a per-sample gradient of shape (B, ...), "
                                 f"got {s}")
            _check_dtype(be, spec, dtype, "layers", where, "")
            B = s[0]
            # Row-major only where the block stays a unit of its own
            # (_clip_layers): a joined unit's copy reads any strides.
            g = be.io.to_operand(spec)
            self._be_dense(g if len(s) == 2 else g.reshape(B, math.prod(s[1:])), s[1:])
            return
        self.B = B

    def _be_dense(self, g, param_shape):
        """This block as a dense one: g (B, p) its per-sample gradients, p =
        prod(param_shape) draws, a float64 multiply-add per value in the norm."""
        self.kind, self.dense, self.g, self.param_shape = "dense", True, g, tuple(param_shape)
        self.members = None
        self.B, self.T = g.shape[0], 1
        self.draws = self.terms = math.prod(self.param_shape)

    @classmethod
    def joined(cls, members):
        """One dense unit of dense ``members`` side by side (a copy; the members
        let go of theirs): one norm and one sum for all, each member's noise
        finished at its own offset (:meth:`reduce`)."""
        unit = cls.__new__(cls)
        unit._be_dense(_arrays.cat_columns([m.g for m in members]),
                       (sum(m.draws for m in members),))
        # The members carry their own noise offsets (reduce): the unit's is 0.
        unit.members, unit.start = members, 0
        for m in members:
            m.g = None
        return unit

    def held(self) -> int:
        """Values of the block's own arrays (0 for a ghost block: its closure's)."""
        if self.kind == "ghost":
            return 0
        # Kernel views are NumPy arrays on the CPU and torch/CuPy arrays on a
        # GPU, whose .size is a method in torch: count through the shape.
        return math.prod(self.g.shape) + (0 if self.dense else math.prod(self.a.shape))

    def add_sq_norms(self, kernels, sq, spread, io, float64=False, accumulate=True):
        """sq += the block's squared norms (= without ``accumulate``: the step's
        first, into a buffer not zeroed, one kernel fewer on a device); spread
        (None when no block has T > 1) += the rounding scale of a ghost block's
        sums over positions.  Dense
        and ghost blocks only: linear pairs form theirs by shape group
        (``linear_sq_norms_group``, in :func:`_clip_layers`).  ``float64``: a
        ghost block's float64 norms where its own are float32 Grams' bounds."""
        if self.kind == "ghost":
            own, own_spread = self.sq, self.spread
            if float64 and self.spec.float64_norms is not None:
                own, own_spread = (None if x is None else io.to_kernel(x)
                                   for x in self.spec.float64_norms())
            if accumulate:
                sq += own
            else:
                _arrays.assign(sq, own)
            if spread is not None and own_spread is not None:
                spread += own_spread
        else:
            kernels.row_sq_norms(self.g, sq, accumulate)

    def float32_grams(self) -> bool:
        """Whether the block's norms are float32 Grams' bounds (a ghost block
        with float64 norms on request)."""
        return self.kind == "ghost" and self.spec.float64_norms is not None

    def drop_rows(self, io, rows):
        """Zero the given samples (a copy, never the caller's data): 0 * NaN would
        still be NaN inside the GEMM.  A ghost block drops them itself (factor 0)."""
        rows = list(int(r) for r in rows)
        if self.kind == "ghost":
            return
        if self.dense:
            self.g = io.copy(self.g)
            self.g[rows] = 0
        else:
            self.a, self.g = io.copy(self.a), io.copy(self.g)
            self.a[rows] = 0
            self.g[rows] = 0

    def reduce(self, be, dtype, factors, noise_std, inv_denom, seed, offset, balance, finish,
               kept_all=False, bias_gemv=None):
        """The block's clipped sum (a joined unit's: its members' list); the
        noise of a ghost block, a linear pair and a joined unit's members is
        not added here but appended to ``finish`` (segments of
        ``finish_gaussian_segments``, which the op runs once for all of them);
        a dense block's alone is fused into its sum."""
        if self.kind == "ghost":
            # kept_all: no row of the step was dropped (the host read every factor).
            clipped_sum = self.spec.clipped_sum
            if kept_all and self.spec.unmasked_sum is not None:
                clipped_sum = self.spec.unmasked_sum
            if self.gemm is None:
                out = clipped_sum(be.io.to_user(factors))
            else:       # its GEMM's rebalancing decided from its sizes (the op's transfer)
                out = clipped_sum(be.io.to_user(factors), balance=balance)
            if tuple(_arrays.shape(out, "clipped_sum()")) != self.param_shape:
                raise ValueError(f"clipped_sum(): expected shape {self.param_shape}, got "
                                 f"{tuple(_arrays.shape(out, 'clipped_sum()'))}")
            if be.io.dtype_of(out) != dtype:
                raise TypeError(f"clipped_sum(): expected dtype {dtype}, got {be.io.dtype_of(out)}")
            if not _arrays.is_torch(out) and not out.flags.writeable:
                raise ValueError("clipped_sum(): expected a freshly allocated, writable array "
                                 "(the op adds the noise into it in place), got a read-only one")
            flat = be.io.to_kernel(out).reshape(-1)
            finish.append((flat, flat, offset))
            self.finished = flat
            return be.io.to_user(flat.reshape(self.param_shape))
        if self.members is not None:
            # The float64 sum of every member at once, then each member's own
            # finish (noise at its offset, the division, one rounding): what
            # the fused kernel gives a member alone, bit for bit.  Members
            # whose noise ranges follow one another (a norm layer's weight and
            # bias, blocks between no others) are finished as one segment,
            # all into one array of which each member's output is a view: the
            # same draws at the same offsets, and a few splits a unit instead
            # of an allocation, a slice and a segment a member (EfficientNet-
            # Lite0 joins 117 blocks, issue 36's host time).
            sums = be.io.empty((self.draws,), _F64)
            be.kernels.weighted_row_sum_noise(self.g, factors, 0.0, 1.0, seed, offset, sums)
            out = be.io.empty((self.draws,), dtype)
            runs = _runs(self.members)
            if len(runs) == 1:
                finish.append((out, sums, offset + runs[0][0].start))
            else:
                sizes = [sum(m.draws for m in run) for run in runs]
                finish += [(dst, src, offset + run[0].start) for run, dst, src in
                           zip(runs, _arrays.split_sizes(out, sizes),
                               _arrays.split_sizes(sums, sizes))]
            views = _arrays.split_sizes(out, [m.draws for m in self.members])
            return [be.io.to_user(v if len(m.param_shape) == 1 else v.reshape(m.param_shape))
                    for m, v in zip(self.members, views)]
        if self.dense:
            out = be.io.empty((self.draws,), dtype)
            be.kernels.weighted_row_sum_noise(self.g, factors, noise_std, inv_denom, seed, offset,
                                              out)
            return be.io.to_user(out.reshape(self.param_shape))
        K, d = self.K, self.d
        flat = None
        if be.name == "cuda" and self.bias:
            # The weight's and the bias's sums in one allocation, the bias
            # after the weight as their noise ranges lie: where both are
            # finished in place, one finish segment (each an allocation and a
            # segment's host time a layer on a device, issue 36).
            flat = be.io.empty((K * d + K,), dtype)
            gw, gb = _arrays.split_sizes(flat, (K * d, K))
            gw = gw.reshape(K, d)
        else:
            gw = be.io.empty((K, d), dtype)
            gb = be.io.empty((K,), dtype) if self.bias else None
        n = len(finish)
        be.kernels.clipped_linear_sum(self.a, self.g, factors, noise_std, inv_denom, seed, offset,
                                      gw, gb, matmul=be.io.matmul, balance=balance, finish=finish,
                                      bias_gemv=bias_gemv)
        if flat is not None and _in_place_pair(finish[n:], gw, gb, offset, K * d):
            finish[n:] = [(flat, flat, offset)]
        return be.io.to_user(gw), (None if gb is None else be.io.to_user(gb))


def _in_place_pair(added, gw, gb, offset, weight_draws) -> bool:
    """Whether the finish segments a pair's sum ``added`` are its weight's and
    its bias's, each finished in place at the offsets that make them one
    range: the same draws, divisions and roundings as one segment over both."""
    return (len(added) == 2 and added[0][0] is gw and added[0][1] is gw
            and added[0][2] == offset and added[1][0] is gb and added[1][1] is gb
            and added[1][2] == offset + weight_draws)


def _runs(members):
    """Joined members in runs whose noise ranges follow one another (each
    member's start the previous one's end)."""
    runs = [[members[0]]]
    for m in members[1:]:
        last = runs[-1][-1]
        if m.start == last.start + last.draws:
            runs[-1].append(m)
        else:
            runs.append([m])
    return runs


def _ghost_dtype(specs) -> np.dtype:
    dt = specs[0].dtype
    if dt is None:
        raise ValueError("layers[0].dtype: expected the parameter's dtype when every block is a "
                         "GhostBlock, got None")
    dt = _arrays.as_numpy_dtype(dt)
    if dt not in _backend.FLOAT_DTYPES:
        raise TypeError(f"layers[0].dtype: expected float32 or float64, got {dt}")
    return dt


class _Group:
    """The units that one factor a sample covers: every block of the op
    (flat clipping) or one parameter's (per-layer clipping, ``bounds``).  Its
    norms, factors and operand sizes lie in its region of the op's buffer."""

    def __init__(self, units, max_norm, noise_std, start):
        self.units, self.max_norm, self.noise_std = units, max_norm, noise_std
        self.draws = sum(unit.draws for unit in units)
        self.start = start          # its first draw's place in the op's range
        self.t_max = max(unit.T for unit in units)
        # Linear pairs of one shape form their norms together (on a device,
        # one batched GEMM for several layers: launches saved); their operand
        # sizes, read with the counts (one transfer), tell each clipped sum
        # whether its rebalancing scan can be skipped.
        self.shape_groups = {}
        for i, unit in enumerate(units):
            if unit.kind == "pair":
                self.shape_groups.setdefault((unit.T, unit.d, unit.K, unit.bias), []).append(i)
        self.pairs = [i for members in self.shape_groups.values() for i in members]
        # Ghost blocks whose sum is one clipped GEMM (a tied head) decide its
        # rebalancing from their operand sizes as the pairs do, after them.
        self.gemms = [i for i, unit in enumerate(units)
                      if unit.kind == "ghost" and unit.gemm is not None]
        self.balanced = self.pairs + self.gemms
        self.slot = {i: j for j, i in enumerate(self.balanced)}

    def pair_key(self):
        """(T, d, K, bias) of a group that is one linear pair (per-layer
        clipping's weight), else None: such groups of one key form their norms
        together, a row each (``linear_sq_norms_group(rows=True)``)."""
        if len(self.units) != 1 or self.units[0].kind != "pair":
            return None
        unit = self.units[0]
        return (unit.T, unit.d, unit.K, unit.bias)

    def place(self, region, sizes, B, sq, spread, weights, grad_terms):
        """Its factors and norms as views of ``region``, its operand sizes
        ``sizes`` ((len(balanced), B, 2), None without balanced units); ``sq``
        its (B,) norm sums (not zeroed: the first block's norms are written,
        the others' added), ``spread`` its (B,) zeros (None when no block has
        T > 1), ``weights`` its (B,) sample weights (None: the factors)."""
        self.region, self.factors, self.norms = region, region[:B], region[B:2 * B]
        self.sizes = sizes
        self.normed = False         # its norms formed with other groups' (form_norms)
        for i in self.gemms:
            _arrays.assign(self.sizes[self.slot[i]], self.units[i].gemm[0])
        self.terms = sum(unit.terms for unit in self.units) + grad_terms
        self.rule = (self.max_norm, self.terms, self.t_max)
        self.sq = sq
        self.spread = spread if self.t_max > 1 else None
        self.weights = self.factors if weights is None else weights

    def form_norms(self, be, gram32, again=False):
        """Its norm sums (and spreads) into its rows; whether a float32 Gram
        formed any.  The factors are formed from them for every group at
        once (``clip_factor_groups``)."""
        sq, spread, units = self.sq, self.spread, self.units
        if self.normed and not again:
            return self.gram32
        if again and spread is not None:        # a second pass: start from nothing
            spread[...] = 0.0
        used, first = False, True
        for unit in units:
            if unit.kind != "pair":
                unit.add_sq_norms(be.kernels, sq, spread, be.io, float64=again,
                                  accumulate=not first)
                used |= unit.float32_grams() and not again
                first = False
        for (T, _, _, bias), members in self.shape_groups.items():
            j = self.slot[members[0]]
            used |= bool(be.kernels.linear_sq_norms_group(
                [units[i].a for i in members], [units[i].g for i in members], bias, sq,
                spread if T > 1 else None, self.sizes[j:j + len(members)], gram32,
                accumulate=not first))
            first = False
        return used

    def shapes(self):
        """Each balanced operand pair's values per sample (T d, T K) and whether
        the factor goes to g (K <= d): _balance.layers_needing_balancing's.
        The pairs' shapes only: a list of the units themselves would keep every
        pair's operands alive through the sums, which free each unit's once its
        own sum is formed (release)."""
        if not self.balanced:
            return [], [], []
        units = self.units
        shapes = ([(units[i].T, units[i].d, units[i].K) for i in self.pairs]
                  + [units[i].gemm[1:] for i in self.gemms])
        return ([T * d for T, d, _ in shapes], [T * K for T, _, K in shapes],
                [K <= d for _, d, K in shapes])


def _clip_layers(layer_specs, arrays, max_norm, noise_multiplier, seed, offset,
                 reduction, expected_batch_size, nan_policy, grad_scale=1.0,
                 release=False, checks=(), gram_precision="float64", bounds=None):
    """The joint clip: the factors, norms and operand sizes into one buffer,
    read in the step's one transfer with the caller's ``checks``; the counts
    judged (raising where the step is refused) before the noise range is
    claimed; then the sums and the noise.  Returns ``(grads, acc)``.

    ``bounds`` (per-layer clipping): one bound a block, each block clipped on
    its own factor from its own norm at its bound, with the noise of a
    one-block op of that bound and ``noise_multiplier * max_norm / bound``
    (std ``noise_multiplier * max_norm`` up to its rounding); returns
    ``(grads, [acc of each block])``: the ranges, factors and sums of one such
    op a block run in turn, with one buffer, one transfer, one claim and one
    noise finish a distinct std."""
    max_norm, noise_std, inv_denom = _check_common(
        max_norm, noise_multiplier, reduction, expected_batch_size, nan_policy)
    be = _backend.select("clip", **arrays)
    _backend.refuse_graph_capture(be, next(x for x in arrays.values() if x is not None),
                                  "clip_and_noise_layers")
    plain = [k for k in arrays if not k.endswith(".sq_norms")]
    if plain:
        dtype = be.check_float(arrays[plain[0]], plain[0])
    else:           # ghost blocks only: their sq_norms are float64 whatever the data
        dtype = _ghost_dtype(layer_specs)
    _check_noise_range(noise_std, inv_denom, dtype)
    layers = [_Layer(spec, i, be, dtype) for i, spec in enumerate(layer_specs)]
    if release:
        arrays.clear()
        layer_specs[:] = [None] * len(layer_specs)
    B = layers[0].B
    for i, layer in enumerate(layers):
        if layer.B != B:
            raise ValueError(f"layers[{i}]: batch size {layer.B} differs from layers[0] batch size {B}")
    # Each block's draws start where the previous block's end, in the order
    # given, on every backend (Python ints: offsets reach 2^64).
    start = 0
    for i, layer in enumerate(layers):
        layer.index, layer.start = i, start
        start += layer.draws
    n_given = len(layers)
    if bounds is None:
        parts = [(layers, max_norm, noise_std, 0)]
    else:
        if len(bounds) != n_given:
            raise ValueError(f"bounds: expected one per block ({n_given}), got {len(bounds)}")
        parts = []
        for layer, c in zip(layers, bounds):
            # A one-block op of bound c: its std noise_multiplier * max_norm,
            # formed as that op forms it.
            c, std, _ = _check_common(c, noise_multiplier * max_norm / c, reduction,
                                      expected_batch_size, nan_policy)
            _check_noise_range(std, inv_denom, dtype)
            parts.append(([layer], c, std, layer.start))
    # The setup loops' name held their last layer, and with it its operands,
    # until the op returned (release: the op holds the only references).
    del layer, layers
    # From here on the op works on units: the layers, with the small dense
    # blocks of a group on a device joined into one (each keeps its own noise
    # range).
    if be.name == "cuda":
        parts = [(_join_dense(units), *rest) for units, *rest in parts]
        for units, *_ in parts:
            for unit in units:
                if unit.kind == "dense":    # the kernels read rows one after another
                    unit.g = be.io.to_kernel(unit.g)
    groups = [_Group(*part) for part in parts]
    del parts
    draws = sum(group.draws for group in groups)
    # Every group's factors and norms (a region of L values a group, the
    # checks' flags in the first group's: _clip_results.step_buffer's layout),
    # then every group's operand sizes: the step's one transfer reads them
    # all, and one launch forms every group's factors into their regions.
    # The groups' rows (their regions, norm sums and sizes) put the one-pair
    # groups of one shape side by side, which form their norms together
    # (per-layer clipping's weights); the first group keeps the first row.
    n_checks = len(checks)
    L = 2 * B + n_checks
    G = len(groups)
    runs = {}
    for group in groups:
        key = group.pair_key()
        runs.setdefault(id(group) if key is None else key, []).append(group)
    rows = [group for run in runs.values() for group in run]
    n_sizes = 2 * B * sum(len(group.balanced) for group in groups)
    buf = be.io.empty((G * L + n_sizes,), _F64)
    # The groups' norm sums, spreads and weights: one allocation each, a row
    # a group.  The blocks hold gradients / s: the sample's norm is s times
    # theirs and its weight in the sums s times its factor (two more float64
    # roundings, s^2 sq and f s, formed inside the factors' kernel).
    sqs = be.io.empty((G, B), _F64)
    spreads = (be.io.zeros((G, B), _F64) if any(group.t_max > 1 for group in groups)
               else None)
    weights = be.io.empty((G, B), _F64) if grad_scale != 1.0 else None
    grad_terms = 2 if grad_scale != 1.0 else 0
    at = G * L
    for k, group in enumerate(rows):
        n = 2 * B * len(group.balanced)
        group.place(buf[k * L:(k + 1) * L],
                    buf[at:at + n].reshape(len(group.balanced), B, 2) if group.balanced
                    else None, B,
                    sqs[k], None if spreads is None else spreads[k],
                    None if weights is None else weights[k], grad_terms)
        # Its row, and its places in the buffer (in the op's one host copy too).
        group.k, group.span, group.sizes_span = k, slice(k * L, (k + 1) * L), slice(at, at + n)
        at += n
    gram = gram_precision == "float32" and dtype == np.float32
    for run in runs.values():
        if len(run) > 1:
            # One-pair groups of one shape: one stacked call, a norm row each.
            T, bias = run[0].units[0].T, run[0].units[0].bias
            mine = slice(run[0].k, run[-1].k + 1)
            used = bool(be.kernels.linear_sq_norms_group(
                [group.units[0].a for group in run], [group.units[0].g for group in run], bias,
                sqs[mine], None if spreads is None or T == 1 else spreads[mine],
                buf[run[0].sizes_span.start:run[-1].sizes_span.stop].reshape(len(run), B, 2),
                gram, accumulate=False, rows=True))
            for group in run:
                group.gram32, group.normed = used, True
    for group in groups:
        group.gram32 = group.form_norms(be, gram)
    unit = float(np.finfo(dtype).eps) / 2
    be.kernels.clip_factor_groups(sqs, spreads, [group.rule for group in rows], unit, buf, L,
                                  grad_scale, weights)
    # What the sums need that the transfer does not bring, formed while the
    # device still works towards it: after the transfer the device waits for
    # the host until the first sum is launched (72 layers' order and shapes:
    # some 0.15 ms of a BERT-base step on the 2-core VM).
    dims = [group.shapes() for group in groups]
    order = [(group, i) for group in groups for i in range(len(group.units))]
    if release:
        # Most memory freed first: a unit's sum allocates `draws` values and
        # dropping it frees its (B, T, d) and (B, T, K) arrays (drop_rows below
        # copies them, at their shapes).
        order.sort(key=lambda gi: gi[0].units[gi[1]].draws - gi[0].units[gi[1]].held())
    accs = []
    for k, group in enumerate(groups):
        # The first group's judgement reads the whole buffer (the op's one
        # transfer), its checks first; the others judge their regions of it.
        policy = "zero" if group.gram32 else nan_policy
        if k == 0:
            acc, host = _accounting(be, buf, B, group.max_norm, policy, None, None, group.draws,
                                    by_factors=True, checks=checks)
        else:
            acc, _ = _accounting(be, group.region, B, group.max_norm, policy, None, None,
                                 group.draws, by_factors=True, host=host[group.span])
        g_host = host[group.span]
        if group.gram32 and acc["num_nonfinite"]:
            # A float32 Gram overflows (|a_t|^2 past 3.4e38) where the float64
            # one does not: a dropped row is judged, and dropped, on the
            # float64 norms (one more host wait, only in a step that drops a row).
            group.gram32 = group.form_norms(be, False, again=True)
            one = slice(group.k, group.k + 1)
            be.kernels.clip_factor_groups(sqs[one], None if spreads is None else spreads[one],
                                          [group.rule], unit, group.region, L, grad_scale,
                                          None if weights is None else weights[one])
            host = be.io.to_numpy(buf)
            acc, _ = _accounting(be, group.region, B, group.max_norm, nan_policy, None,
                                 None, group.draws, by_factors=True, host=host[group.span])
            g_host = host[group.span]
        group.host_factors = g_host[:B]
        group.balance = [True] * len(group.units)
        group.bias_gemv = None
        if group.balanced:
            # The weights as the device formed them (one IEEE product each).
            host_weights = (group.host_factors * grad_scale if grad_scale != 1.0
                            else group.host_factors)
            need = _balance.layers_needing_balancing(
                host_weights,
                host[group.sizes_span].reshape(len(group.balanced), B, 2),
                *dims[k],
                # A float32 Gram's zero trace may be an underflow, not a zero operand.
                dtype == np.float32 and not group.gram32)
            for i, flag in zip(group.balanced, need):
                group.balance[i] = bool(flag)
            # The step's repeated weights, shared by its layers' GEMV biases.
            group.bias_gemv = {} if _balance.weights_in_range(host_weights) else None
        group.kept_all = not acc["num_nonfinite"]
        accs.append(acc)
    # Claimed once nothing can refuse any more: a refused step takes no range.
    seed, offset = _stream.claim(seed, offset, draws)
    for group, acc in zip(groups, accs):
        acc.update(seed=seed, offset=offset + group.start)
        if not group.kept_all:
            bad = np.flatnonzero(group.host_factors == 0)
            for unit in group.units:    # the sums' own name: rebound (let go) by their loop
                unit.drop_rows(be.io, bad)
    grads = [None] * n_given
    # Noise finishes by std: one for flat clipping, one a distinct bound's std
    # under per-layer clipping (one when the bounds are equal, the default).
    finishes = {}
    for group in groups:
        group.finish = finishes.setdefault(group.noise_std, [])
    ghosts = []
    with be.kernels.float32_gemm_scope(groups[0].sq):
        for group, i in order:
            unit = group.units[i]
            got = unit.reduce(be, dtype, group.weights, group.noise_std, inv_denom, seed,
                              offset + unit.start, group.balance[i], group.finish,
                              kept_all=group.kept_all, bias_gemv=group.bias_gemv)
            if unit.members:
                for m, g in zip(unit.members, got):
                    grads[m.index] = g
            else:
                grads[unit.index] = got
            if unit.kind == "ghost":
                ghosts.append((unit.finished, unit.index))
            if release:
                group.units[i] = None
    _refuse_shared_ghost_outputs(ghosts)
    # Every ghost block's, linear pair's and joined dense block's noise at once
    # (on a device one launch for 48 of them, not one or two a layer): the
    # same draws at the same offsets as a finish of each in turn.
    for std, finish in finishes.items():
        be.kernels.finish_gaussian_segments(finish, np.uint64(seed), float(std),
                                            float(inv_denom))
    return grads, (accs if bounds is not None else accs[0])


def _refuse_shared_ghost_outputs(ghosts) -> None:
    """``ghosts``: (flat output, block index) of the ghost blocks.  Each block's noise is added in place to what its clipped_sum returned,
    once all sums are formed: two blocks returning one array (or overlapping
    ones) would have it noised and divided twice, silently.  Refused by name."""
    if len(ghosts) < 2:
        return
    spans = sorted((*_arrays.byte_range(out), i) for out, i in ghosts if math.prod(out.shape))
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            first, second = sorted((i, j))
            raise ValueError(
                f"layers[{first}].clipped_sum(), layers[{second}].clipped_sum(): expected "
                "arrays of their own, got overlapping ones (the op adds each block's noise "
                "in place to what its clipped_sum returns); return a new array from each")


# Dense blocks are joined while a unit holds at most this many bytes: the
# launches saved matter for small blocks (a LayerNorm's weight and bias, a
# GPT-2 Conv1D's bias: two launches, a workspace and their host time each),
# and the join's copy stays small.
JOIN_DENSE_BYTES = 16 << 20


def _join_dense(layers):
    """The units of ``layers``: the dense blocks that fit JOIN_DENSE_BYTES
    joined, in order, into as few dense units as that bound allows (at least
    two blocks a unit; a block alone stays itself), placed where their first
    block was; every other block its own unit.  Exact: a joined unit's sum is
    its blocks' own, column for column, each finished with its own noise range
    (``_Layer.reduce``); its norm adds the same squares in one float64 sum (the
    rule's ``terms`` are the blocks' total)."""
    groups, size = [[]], 0
    for layer in layers:
        if layer.kind != "dense":
            continue
        nbytes = layer.held() * layer.g.dtype.itemsize
        if nbytes > JOIN_DENSE_BYTES:
            continue
        if size + nbytes > JOIN_DENSE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(layer)
        size += nbytes
    first = {id(g[0]): g for g in groups if len(g) > 1}
    joined = {id(m) for g in first.values() for m in g}
    units = []
    for layer in layers:
        if id(layer) in first:
            units.append(_Layer.joined(first[id(layer)]))
        elif id(layer) not in joined:
            units.append(layer)
    return units


def clip_and_noise_linear(activations, backprops, *, max_norm, noise_multiplier, bias=True,
                          seed=None, offset=None, reduction="sum", expected_batch_size=None,
                          nan_policy="raise") -> LinearClipResult:
    """Clipped, noised gradient of a linear layer without per-sample gradients.

    The per-sample weight gradient of ``y = x W^T + b`` is ``G_i = sum_t g_it a_it^T``;
    its norm comes from the factored identities of DESIGN.md kernel 1
    (``||g_i|| ||a_i||`` for 2-D inputs; the Gram form
    ``sum_ts (a_it.a_is)(g_it.g_is)`` or the formed K x d matrix for sequences,
    whichever 2T^2 <= K d picks), plus ``||sum_t g_it||^2`` for the bias; the
    clipped sum is one GEMM ``(c * g)^T a``.

    Args:
        activations: (B, d) or (B, T, d) layer inputs.
        backprops: (B, K) or (B, T, K) gradients of each sample's *own* loss with
            respect to the layer output (with a mean-reduced loss, multiply by the
            realized batch size first, as Opacus does).
        bias: whether the layer has a (trainable) bias; its gradient shares the
            sample's clip factor.
        Other arguments as :func:`clip_and_noise`.  Noise: weight entry (k, j) is
        draw ``offset + k*d + j``, bias entry k is draw ``offset + K*d + k``.

    Returns a :class:`LinearClipResult` with ``grad_weight`` (K, d) and
    ``grad_bias`` (K,) or None.
    """
    _as_pair(activations, backprops)
    bias = check_bool(bias, "bias")
    grads, acc = _clip_layers([(activations, backprops, bias)],
                              dict(activations=activations, backprops=backprops), max_norm,
                              noise_multiplier, seed, offset, reduction, expected_batch_size,
                              nan_policy)
    gw, gb = grads[0]
    return LinearClipResult(grad_weight=gw, grad_bias=gb, **acc)


def clip_and_noise_layers(layers: Sequence, *, max_norm, noise_multiplier, seed=None, offset=None,
                          reduction="sum", expected_batch_size=None, nan_policy="raise",
                          grad_scale=1.0, release_blocks=False, gram_precision="float64",
                          _checks=(), _bounds=None) -> LayersClipResult:
    """Clip several parameter blocks jointly: one factor per sample from the total norm.

    Each element of ``layers`` is a dense per-sample gradient (B, ...)
    (e.g. Opacus's ``p.grad_sample``), a linear layer ``(activations,
    backprops)`` / ``(activations, backprops, bias)`` as in
    :func:`clip_and_noise_linear`, or a :class:`GhostBlock` (per-sample squared
    norms and a clipped-sum function; prod(shape) draws).  ``grad_scale`` s > 0:
    the blocks hold the per-sample gradients divided by s (the output gradients
    of a batch-mean loss, s = the realized batch size): norms, factors and sums
    are those of s times the blocks, the multiplication folded into the (B,)
    norms and factors instead of a pass over every block.  The sample's norm is
    ``sqrt(sum over blocks of its squared block norms)``; every block gets its
    own disjoint range of the noise stream, in order (dense: prod(shape[1:])
    draws; linear: K*d, then K for the bias).  Other arguments as
    :func:`clip_and_noise`.

    ``release_blocks=True`` hands the list ``layers`` over to the op: it is
    emptied (every entry set to None) as the blocks are taken, and the op drops
    each block once its sum is formed, forming first the blocks that free more
    than their sum allocates (each still takes its own noise range).  A caller
    that keeps no other reference to the blocks' arrays (GhostClipper) then
    frees a layer's activations and backprops before later sums are allocated,
    instead of holding all of them until the last sum exists.

    ``gram_precision``: ``"float64"`` (default) or ``"float32"``.  On a CUDA
    device the norms of float32 linear pairs on the Gram route (2 T^2 <= K d)
    come from their Grams A_i A_i^T, G_i G_i^T; "float64" forms those in
    float64 (exact copies, FP64 GEMMs: the norms within the rule's float64
    rounding); "float32" as float32 GEMMs (TF32 off), without the float64
    copies, each layer's norm then raised by the largest effect the GEMMs'
    rounding can have (docs/privacy.md, "Norms from float32 Grams"), so a
    contribution still never exceeds C, but clipping is tighter by that bound:
    a median 1.8e-4 of the norm on BERT-base and 1.1% on GPT-2 (random
    models at the benchmarks' GPU shapes).  A step in which a row is dropped forms
    its norms again in float64 before judging it.  Elsewhere (the CPU, float64
    data, T = 1, the direct route) nothing changes.

    ``_bounds`` (internal, GhostClipper's per-layer step): one bound a block,
    each block clipped on its own (``_clip_layers._clip_layers``); returns a list of
    one :class:`LayersClipResult` a block.

    ``_checks`` (internal, for GhostClipper): ``(0-d device tensor, refuse,
    passes)`` triples whose values are read with the step's counts in its one
    transfer; ``refuse()`` of a value failing ``passes`` raises before any
    noise range is taken.

    Returns a :class:`LayersClipResult`; ``grads[l]`` is an array of shape
    ``shape[1:]`` for a dense block, ``(grad_weight, grad_bias)`` for a pair, an
    array of ``shape`` for a ghost block.
    """
    # A list first: typing's Sequence check runs the ABC machinery (host time
    # a step, issue 36).
    if not (type(layers) is list or (not isinstance(layers, (str, bytes))
                                     and isinstance(layers, Sequence))) or not layers:
        raise TypeError(f"layers: expected a non-empty list of arrays or (activations, backprops) "
                        f"tuples, got {type(layers).__name__}")
    arrays = {}
    for i, spec in enumerate(layers):
        if isinstance(spec, GhostBlock):
            arrays[f"layers[{i}].sq_norms"] = spec.sq_norms
        elif isinstance(spec, (tuple, list)):
            arrays[f"layers[{i}][0]"] = spec[0] if len(spec) else None
            arrays[f"layers[{i}][1]"] = spec[1] if len(spec) > 1 else None
        else:
            arrays[f"layers[{i}]"] = spec
    del spec                    # with release_blocks, the op holds the only references
    if type(grad_scale) is not float or not 0.0 < grad_scale < math.inf:
        grad_scale = check_positive(grad_scale, "grad_scale")   # finite, > 0
    check_choice(gram_precision, "gram_precision", ("float64", "float32"))
    grads, acc = _clip_layers(layers, arrays, max_norm, noise_multiplier, seed, offset,
                              reduction, expected_batch_size, nan_policy, grad_scale,
                              release=check_bool(release_blocks, "release_blocks"),
                              checks=_checks,
                              gram_precision=gram_precision, bounds=_bounds)
    if _bounds is None:
        return LayersClipResult(grads=grads, **acc)
    return [LayersClipResult(grads=[g], **one) for g, one in zip(grads, acc)]
