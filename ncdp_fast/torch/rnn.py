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
its batch is dimension 0 whatever ``batch_first`` says.

Parameters are torch's (the same shapes, initialisation U(-1/sqrt(H),
1/sqrt(H)), gate order i, f, g, o / r, z, n), named ``l{k}.ih.weight``,
``l{k}.hh.bias``, ``l{k}_reverse...`` as modules (``named_parameters``, the
clipper's names); ``state_dict`` and ``load_state_dict`` use torch's names
(``weight_ih_l0``...), so ``DPLSTM.load_state_dict(lstm.state_dict())``
copies an ``nn.LSTM`` and the reverse works too.  :func:`from_torch` builds the counterpart of a torch
module with its weights.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .._validate import check_bool, check_choice, check_int, check_pos_int, check_probability

__all__ = ["DPLSTM", "DPGRU", "DPRNN", "from_torch", "replacement", "torch_rnn_error"]


def _dp_name(torch_name: str) -> str | None:
    """``weight_ih_l0_reverse`` -> ``l0_reverse.ih.weight``; None for another name."""
    parts = torch_name.split("_")
    if len(parts) in (3, 4) and parts[0] in ("weight", "bias") and parts[1] in ("ih", "hh") \
            and parts[2][:1] == "l" and parts[2][1:].isdigit() \
            and (len(parts) == 3 or parts[3] == "reverse"):
        cell = parts[2] + ("_reverse" if len(parts) == 4 else "")
        return f"{cell}.{parts[1]}.{parts[0]}"
    return None


def _torch_name(dp_name: str) -> str | None:
    """``l0_reverse.ih.weight`` -> ``weight_ih_l0_reverse``; None for another name."""
    parts = dp_name.split(".")
    if len(parts) != 3:
        return None
    name = f"{parts[2]}_{parts[1]}_{parts[0]}"
    return name if _dp_name(name) == dp_name else None


def _to_torch_names(module, state_dict, prefix, local_metadata) -> None:
    # Re-inserted in torch's order (per layer and direction: weight_ih,
    # weight_hh, bias_ih, bias_hh); this module's keys are the last ones
    # written, so the order of the rest is kept.
    renamed = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = _torch_name(key[len(prefix):])
        if new is not None:
            renamed[new] = state_dict.pop(key)
    for cell in dict.fromkeys(n.split("_", 2)[2] for n in renamed):
        for n in (f"weight_ih_{cell}", f"weight_hh_{cell}", f"bias_ih_{cell}",
                  f"bias_hh_{cell}"):
            if n in renamed:
                state_dict[prefix + n] = renamed[n]


def _to_dp_names(module, state_dict, prefix, *args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = _dp_name(key[len(prefix):])
        if new is not None:
            state_dict[prefix + new] = state_dict.pop(key)


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
        self.reset_parameters()
        # Checkpoints use torch's names, both ways (as Opacus's DPLSTM): a
        # state_dict of nn.LSTM (or of Opacus's DPLSTM) loads, and this one's
        # loads into them.
        self.register_state_dict_post_hook(_to_torch_names)
        self.register_load_state_dict_pre_hook(_to_dp_names)

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
        if isinstance(x, nn.utils.rnn.PackedSequence):
            raise TypeError(
                f"{name}: expected a padded tensor, got a PackedSequence: packed sequences are "
                "not supported here. Pass the padded batch (nn.utils.rnn.pad_packed_sequence) "
                "and read each sample's output at its own last position")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name}: expected a batched 3-D input ({'B, T' if self.batch_first else 'T, B'}"
                f", {self.input_size}), got {shape}; an unbatched sequence has no per-sample "
                "gradient: add a batch dimension of 1")
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

    def forward(self, x, state=None):
        """``x`` (T, B, input_size), or (B, T, input_size) with ``batch_first``;
        ``state`` None (zeros) or h0 (``DPLSTM``: (h0, c0)), each (num_layers *
        num_directions, B, hidden_size).  Returns ``(output, state)`` as torch's
        module: output (T, B, D * hidden_size) (batch first if so built), the
        state at the last step in the shape of the initial one."""
        self._check_input(x)
        seq = x if self.batch_first else x.transpose(0, 1)        # (B, T, in)
        B, T = seq.shape[0], seq.shape[1]
        h0, c0 = self._initial(state, B, seq)
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
                    h, c = self._step(cell, steps[t], h, c)
                    out[t] = h
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            steps = [torch.cat([o[t] for o in outs], 1) if len(outs) > 1 else outs[0][t]
                     for t in range(T)]
            if self.dropout and self.training and layer < self.num_layers - 1:
                steps = [F.dropout(s, self.dropout, True) for s in steps]
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
        mine[_dp_name(n)].requires_grad_(q.requires_grad)      # a frozen one stays frozen
    dp.train(module.training)
    return dp
