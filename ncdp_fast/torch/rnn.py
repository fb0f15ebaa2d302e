"""Recurrent layers with exact per-sample gradients: :class:`DPLSTM`,
:class:`DPGRU`, :class:`DPRNN` (Opacus's ``opacus.layers`` names and
constructor arguments).

torch's ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` run their recurrence in one
fused kernel, so no hook sees a time step's input.  These compute the same
function from ``nn.Linear`` cells: per layer and direction an input projection
``ih`` (W_ih, b_ih) and a hidden projection ``hh`` (W_hh, b_hh), each called
once per time step on a (B, features) tensor.  The clipper's Linear rule sums
a layer's calls sample by sample, so the per-sample gradient of each weight is
the sum over the time steps, exactly; each call has one leading dimension, so
its batch is dimension 0 whatever ``batch_first`` says.  A ``PackedSequence``
input runs padded, with each finished sequence's state held
(:mod:`ncdp_fast.torch.rnn_packed`).

Parameters are torch's (the same shapes, initialisation U(-1/sqrt(H),
1/sqrt(H)), gate order i, f, g, o / r, z, n).  Names, as Opacus's DPLSTM
gives them: ``named_parameters()`` / ``parameters()`` list torch's names,
``weight_ih_l0``, ``bias_ih_l0``, ``weight_hh_l0``, ``bias_hh_l0``,
``weight_ih_l0_reverse``... (per layer and direction in that order, Opacus's),
registered on this module as aliases of the cells' parameters ``l0.ih.weight``
... (the same Parameter objects), so name-based code written for Opacus or
torch (weight-decay filters, per-parameter groups, ``model.get_parameter``)
finds them.  The cells' own names are what the clipper reports
(``param_names``, per-layer bounds, error messages): each cell's ``nn.Linear``
is the layer it clips.  ``state_dict`` holds the torch names only and
``load_state_dict`` takes them (or the cells' names), so
``DPLSTM.load_state_dict(lstm.state_dict())`` copies an ``nn.LSTM`` and the
reverse works too.  :func:`from_torch` builds the counterpart of a torch
module with its weights.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence

from .._validate import check_bool, check_choice, check_int, check_pos_int, check_probability
from .rnn_packed import repack, step_masks, unpack

__all__ = ["DPLSTM", "DPGRU", "DPRNN", "from_torch", "replacement", "torch_rnn_error"]


def _aliases(num_layers: int, num_directions: int, bias: bool) -> list:
    """[(torch name, cell name)] in Opacus's order: per layer and direction
    weight_ih, bias_ih, weight_hh, bias_hh (``weight_ih_l0``, ``l0.ih.weight``)."""
    table = []
    for layer in range(num_layers):
        for d in range(num_directions):
            cell = f"l{layer}" + ("_reverse" if d else "")
            for proj in ("ih", "hh"):
                for attr in ("weight", "bias") if bias else ("weight",):
                    table.append((f"{attr}_{proj}_{cell}", f"{cell}.{proj}.{attr}"))
    return table


def _drop_cell_names(module, state_dict, prefix, local_metadata) -> None:
    # The cells' entries are the torch-named ones again (the same tensors).
    for _, cell_name in module._alias_table:
        state_dict.pop(prefix + cell_name, None)


def _fill_both_names(module, state_dict, prefix, *args) -> None:
    # torch's module loads its own names and each cell its own: a checkpoint
    # in either naming gives both the values (the same Parameter is written
    # twice).  Two different values under the two names are refused.
    for torch_name, cell_name in module._alias_table:
        t, c = prefix + torch_name, prefix + cell_name
        if t in state_dict and c in state_dict:
            if state_dict[t] is not state_dict[c] and not torch.equal(state_dict[t],
                                                                        state_dict[c]):
                raise RuntimeError(
                    f"{type(module).__name__}.load_state_dict: {t!r} and {c!r} name the same "
                    "parameter but hold different values; expected one of the two names")
        elif t in state_dict:
            state_dict[c] = state_dict[t]
        elif c in state_dict:
            state_dict[t] = state_dict[c]


def _retie(module, incompatible_keys) -> None:
    # load_state_dict(assign=True) gives each name a new Parameter: point the
    # torch names back at the cells' (the ones the forward uses).
    for torch_name, _ in module._alias_table:
        module._parameters[torch_name] = module._cell_param(torch_name)


class _Cell(nn.Module):
    """One layer and direction: ``ih`` (input -> gates) and ``hh`` (hidden -> gates)."""

    def __init__(self, input_size, hidden_size, gates, bias, factory):
        super().__init__()
        self.ih = nn.Linear(input_size, gates * hidden_size, bias=bias, **factory)
        self.hh = nn.Linear(hidden_size, gates * hidden_size, bias=bias, **factory)


class _DPRNNBase(nn.Module):
    """The shared recurrence; subclasses give ``_gates`` and ``_step``."""

    _gates = 1
    _has_cell = False

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, device=None, dtype=None):
        super().__init__()
        self.input_size = check_pos_int(input_size, "input_size")
        self.hidden_size = check_pos_int(hidden_size, "hidden_size")
        self.num_layers = check_pos_int(num_layers, "num_layers")
        self.bias = check_bool(bias, "bias")
        self.batch_first = check_bool(batch_first, "batch_first")
        self.dropout = check_probability(dropout, "dropout", zero=True)
        self.bidirectional = check_bool(bidirectional, "bidirectional")
        self.num_directions = 2 if bidirectional else 1
        factory = {"device": device, "dtype": dtype}
        for layer in range(num_layers):
            size = input_size if layer == 0 else hidden_size * self.num_directions
            for d in range(self.num_directions):
                self.add_module(self._cell_name(layer, d),
                                _Cell(size, hidden_size, self._gates, bias, factory))
        self._alias_table = _aliases(num_layers, self.num_directions, bias)
        for torch_name, _ in self._alias_table:
            self.register_parameter(torch_name, self._cell_param(torch_name))
        self.reset_parameters()
        # Checkpoints use torch's names, both ways (as Opacus's DPLSTM): a
        # state_dict of nn.LSTM (or of Opacus's DPLSTM) loads, and this one's
        # loads into them.
        self.register_state_dict_post_hook(_drop_cell_names)
        self.register_load_state_dict_pre_hook(_fill_both_names)
        self.register_load_state_dict_post_hook(_retie)

    def _cell_param(self, torch_name: str) -> nn.Parameter:
        attr, proj, cell = torch_name.split("_", 2)
        return getattr(getattr(getattr(self, cell), proj), attr)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """torch's: the torch names (``weight_ih_l0``...) first, so the cells'
        names of the same parameters are left out unless
        ``remove_duplicate=False``.  With ``recurse=False``, none: the torch
        names are aliases, this module owns no parameter of its own (its cells'
        ``nn.Linear`` do, and are what the clipper finds as layers)."""
        if not recurse:
            return iter(())
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def _check_aliases(self) -> None:
        for torch_name, cell_name in self._alias_table:
            if self._parameters.get(torch_name) is not self._cell_param(torch_name):
                raise RuntimeError(
                    f"{type(self).__name__}: parameter {torch_name!r} is no longer the "
                    f"Parameter of {cell_name!r}, which the forward uses (one of the two was "
                    "replaced by another Parameter); expected the same object: change "
                    "values in place (p.data.copy_(...), nn.init) or with load_state_dict")

    @staticmethod
    def _cell_name(layer, direction):
        return f"l{layer}" + ("_reverse" if direction else "")

    def reset_parameters(self) -> None:
        """torch's initialisation: every weight and bias U(-1/sqrt(H), 1/sqrt(H))."""
        k = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -k, k)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"bias={self.bias}, batch_first={self.batch_first}, dropout={self.dropout}, "
                f"bidirectional={self.bidirectional}")

    def _check_input(self, x):
        name = type(self).__name__
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name}: expected a batched 3-D input ({'B, T' if self.batch_first else 'T, B'}"
                f", {self.input_size}) or a PackedSequence, got {shape}; an unbatched sequence "
                "has no per-sample gradient: add a batch dimension of 1")
        if x.shape[2] != self.input_size:
            raise ValueError(f"{name}: expected input features {self.input_size}, got "
                             f"{x.shape[2]} (input shape {tuple(x.shape)})")

    def _initial(self, state, B, like):
        """(h0, c0) as lists over layer*directions of (B, H); zeros for None."""
        L, H = self.num_layers * self.num_directions, self.hidden_size
        name = type(self).__name__
        if state is None:
            zero = like.new_zeros(L, B, H)
            return zero, (zero if self._has_cell else None)
        if self._has_cell:
            if not (isinstance(state, (tuple, list)) and len(state) == 2):
                raise TypeError(f"{name}: expected the state as a pair (h0, c0), got "
                                f"{type(state).__name__}")
            h0, c0 = state
        else:
            h0, c0 = state, None
        for t, what in ((h0, "h0"), (c0, "c0")):
            if what == "c0" and not self._has_cell:
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (L, B, H):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected {what} of shape (num_layers * num_directions"
                                 f", B, hidden_size) = {(L, B, H)}, got {shape}")
        return h0, c0

    def forward(self, x, state=None, *, hx=None, state_init=None):
        """``x`` (T, B, input_size), or (B, T, input_size) with ``batch_first``,
        or a ``PackedSequence`` of (sum of lengths, input_size) data; ``state``
        None (zeros) or h0 (``DPLSTM``: (h0, c0)), each (num_layers *
        num_directions, B, hidden_size), B in the caller's order (the order
        before packing); also taken by torch's keyword ``hx`` or Opacus's
        ``state_init``.  Returns ``(output, state)`` as torch's module:
        output (T, B, D * hidden_size) (batch first if so built), or a
        ``PackedSequence`` packed as ``x``; the state at each sequence's own
        last step (the reverse direction's at its first), in the shape and
        order of the initial one."""
        given = [(n, v) for n, v in (("state", state), ("hx", hx), ("state_init", state_init))
                 if v is not None]
        if len(given) > 1:
            raise TypeError(f"{type(self).__name__}: the initial state given twice, as "
                            f"{' and '.join(n for n, _ in given)}; expected one of state, hx "
                            "(torch's name) or state_init (Opacus's name)")
        state = given[0][1] if given else None
        self._check_aliases()
        packed = isinstance(x, PackedSequence)
        if packed:
            seq, lengths = unpack(x, type(self).__name__, self.input_size)  # (B, T, in)
        else:
            self._check_input(x)
            seq = x if self.batch_first else x.transpose(0, 1)        # (B, T, in)
        B, T = seq.shape[0], seq.shape[1]
        h0, c0 = self._initial(state, B, seq)
        masks = step_masks(lengths, T) if packed else None
        steps = [seq[:, t] for t in range(T)]
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outs = []
            for d in range(self.num_directions):
                k = layer * self.num_directions + d
                cell = getattr(self, self._cell_name(layer, d))
                order = range(T - 1, -1, -1) if d else range(T)
                h, c = h0[k], (c0[k] if c0 is not None else None)
                out = [None] * T
                for t in order:
                    h_t, c_t = self._step(cell, steps[t], h, c)
                    if masks is None:
                        h, c = h_t, c_t
                    else:
                        # A finished (or, in reverse, not yet started) sequence
                        # keeps its state; the discarded rows get zero gradient.
                        h = torch.where(masks[t], h_t, h)
                        c = torch.where(masks[t], c_t, c) if c is not None else None
                    out[t] = h
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            steps = [torch.cat([o[t] for o in outs], 1) if len(outs) > 1 else outs[0][t]
                     for t in range(T)]
            if self.dropout and self.training and layer < self.num_layers - 1:
                steps = [F.dropout(s, self.dropout, True) for s in steps]
        if packed:
            output = repack(torch.stack(steps, 1), x, lengths)
        else:
            output = torch.stack(steps, 1 if self.batch_first else 0)
        h_n = torch.stack(h_n)
        return output, ((h_n, torch.stack(c_n)) if self._has_cell else h_n)


class DPLSTM(_DPRNNBase):
    """``nn.LSTM``'s function from ``nn.Linear`` cells (exact per-sample gradients).

    Args (torch's / Opacus's): input_size, hidden_size, num_layers, bias,
    batch_first, dropout (between layers, training mode only), bidirectional;
    ``proj_size`` must be 0 (a projected LSTM is refused).  ``forward(x,
    state=None)`` -> ``(output, (h_n, c_n))``.  Privacy: each weight's
    per-sample gradient is the sample's sum over its time steps, clipped
    with the model's other parameters."""

    _gates = 4
    _has_cell = True

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None):
        if check_int(proj_size, "proj_size", 0) != 0:
            raise ValueError(f"DPLSTM: expected proj_size=0, got {proj_size}; a projected LSTM "
                             "is not supported (project with an nn.Linear after it)")
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device, dtype)

    @staticmethod
    def _step(cell, x, h, c):
        i, f, g, o = (cell.ih(x) + cell.hh(h)).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class DPGRU(_DPRNNBase):
    """``nn.GRU``'s function from ``nn.Linear`` cells (exact per-sample gradients);
    arguments as :class:`DPLSTM` without ``proj_size``; ``forward(x, h0=None)``
    -> ``(output, h_n)``."""

    _gates = 3

    @staticmethod
    def _step(cell, x, h, c):
        xr, xz, xn = cell.ih(x).chunk(3, 1)
        hr, hz, hn = cell.hh(h).chunk(3, 1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h, None


class DPRNN(_DPRNNBase):
    """``nn.RNN``'s function (``nonlinearity`` "tanh" or "relu") from ``nn.Linear``
    cells (exact per-sample gradients); ``forward(x, h0=None)`` -> ``(output, h_n)``."""

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True,
                 batch_first=False, dropout=0.0, bidirectional=False, device=None, dtype=None):
        self.nonlinearity = check_choice(nonlinearity, "nonlinearity", ("tanh", "relu"))
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, device, dtype)

    def _step(self, cell, x, h, c):
        pre = cell.ih(x) + cell.hh(h)
        return (torch.tanh(pre) if self.nonlinearity == "tanh" else torch.relu(pre)), None


def replacement(module: nn.Module) -> str | None:
    """The name of the DP counterpart of a torch recurrent module, else None."""
    if isinstance(module, nn.LSTM):
        return "DPLSTM"
    if isinstance(module, nn.GRU):
        return "DPGRU"
    if isinstance(module, nn.RNN):
        return "DPRNN"
    return None


def torch_rnn_error(name: str, module: nn.Module) -> ValueError:
    """The refusal of a trainable torch recurrent layer, naming its replacement."""
    dp = replacement(module)
    shown = ", ".join(repr(f"{name}.{n}" if name else n)
                      for n, p in module.named_parameters() if p.requires_grad)
    return ValueError(
        f"GhostClipper: trainable parameter(s) {shown} belong to {type(module).__name__}, "
        f"whose fused recurrence has no per-sample gradient rule; expected "
        f"ncdp_fast.torch.{dp} (the same function and parameters from nn.Linear cells): "
        f"ModuleValidator.fix(model) replaces it copying its weights, or build {dp} with the "
        "same arguments; or freeze them, or register a rule with "
        "ncdp_fast.torch.register_layer")


def from_torch(module: nn.Module) -> _DPRNNBase:
    """The DP counterpart of an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` with its
    weights, device, dtype and training flag.  Refuses what has no counterpart
    (``proj_size`` > 0)."""
    if module.proj_size if isinstance(module, nn.LSTM) else False:
        raise ValueError(f"ModuleValidator.fix: {type(module).__name__} with proj_size="
                         f"{module.proj_size} has no DP counterpart here; expected proj_size=0")
    p = next(module.parameters())
    args = dict(input_size=module.input_size, hidden_size=module.hidden_size,
                num_layers=module.num_layers, bias=module.bias, batch_first=module.batch_first,
                dropout=float(module.dropout), bidirectional=module.bidirectional,
                device=p.device, dtype=p.dtype)
    if isinstance(module, nn.LSTM):
        dp = DPLSTM(**args)
    elif isinstance(module, nn.GRU):
        dp = DPGRU(**args)
    elif isinstance(module, nn.RNN):
        dp = DPRNN(nonlinearity=module.nonlinearity, **args)
    else:
        raise TypeError(f"module: expected nn.LSTM, nn.GRU or nn.RNN, got "
                        f"{type(module).__name__}")
    dp.load_state_dict(module.state_dict())
    mine = dict(dp.named_parameters())
    for n, q in module.named_parameters():
        mine[n].requires_grad_(q.requires_grad)      # a frozen one stays frozen
    dp.train(module.training)
    return dp
