"""DPLSTM / DPGRU / DPRNN (issue 25): torch's recurrent functions from nn.Linear
cells, so that the clipper's Linear rule (a layer called at every time step)
gives exact per-sample gradients; nn.LSTM/GRU/RNN stay refused, naming the
replacement, and ModuleValidator.fix replaces them with their weights.

Oracles: torch's own modules with the same weights (outputs and states,
float64; the two compute the same sums in different orders, so they agree to
a few units of float64 rounding: rtol 1e-12); per-sample clipping from
``torch.func`` per-sample gradients with tests/test_torch_layers.py's
``check_exact`` (relative 1e-10 in float64, 1e-5 in float32, derived there).
"""
import copy
import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ncdp_fast.torch import (DPGRU, DPLSTM, DPRNN, GhostClipper, ModuleValidator,  # noqa: E402
                             PrivacyEngine)
from ncdp_fast.torch.rnn import from_torch  # noqa: E402

from test_torch_layers import (F32, F64, assert_grads_close, ce, check_exact,  # noqa: E402,E501
                               clipped_mean, low_bound)

TORCH = {"lstm": (nn.LSTM, {}), "gru": (nn.GRU, {}), "rnn_tanh": (nn.RNN, {}),
         "rnn_relu": (nn.RNN, {"nonlinearity": "relu"})}
DP = {"lstm": (DPLSTM, {}), "gru": (DPGRU, {}), "rnn_tanh": (DPRNN, {}),
      "rnn_relu": (DPRNN, {"nonlinearity": "relu"})}


def _flat(out):
    y, state = out
    states = state if isinstance(state, tuple) else (state,)
    return torch.cat([t.reshape(-1) for t in (y, *states)])


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", sorted(TORCH))
def test_outputs_and_states_equal_torchs_module_with_the_same_weights(kind, batch_first,
                                                                        bidirectional):
    cls, kw = TORCH[kind]
    torch.manual_seed(0)
    ref = cls(3, 4, num_layers=2, batch_first=batch_first, bidirectional=bidirectional,
              **kw).double()
    dp = from_torch(ref)
    assert isinstance(dp, DP[kind][0])
    g = torch.Generator().manual_seed(1)
    B, T, L = 5, 7, 2 * (2 if bidirectional else 1)
    x = torch.randn((B, T, 3) if batch_first else (T, B, 3), generator=g, dtype=F64)
    h0 = torch.randn(L, B, 4, generator=g, dtype=F64)
    state = (h0, torch.randn(L, B, 4, generator=g, dtype=F64)) if kind == "lstm" else h0
    for args in ((x,), (x, state)):
        got, want = _flat(dp(*args)), _flat(ref(*args))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # torch's keyword hx and Opacus's state_init name the same argument.
    want = _flat(ref(x, hx=state))
    for kw in ({"hx": state}, {"state_init": state}):
        torch.testing.assert_close(_flat(dp(x, **kw)), want, rtol=1e-12, atol=1e-14)
    # Parameter gradients of an ordinary backward agree too (the same function).
    _flat(dp(x, state)).square().sum().backward()
    _flat(ref(x, state)).square().sum().backward()
    mine = dict(dp.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(mine[n].grad, p.grad, rtol=1e-11, atol=1e-13)


# Opacus's DPLSTM(3, 4, num_layers=2, bidirectional=True).named_parameters(),
# read from opacus 1.6: torch's names, per layer and direction ih then hh.
OPACUS_NAMES = [f"{a}_{m}_l{k}{r}" for k in range(2) for r in ("", "_reverse")
                for m in ("ih", "hh") for a in ("weight", "bias")]


def test_parameter_names_are_opacus_names_aliasing_the_cells():
    torch.manual_seed(0)
    dp = DPLSTM(3, 4, num_layers=2, bidirectional=True)
    ref = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    names = [n for n, _ in dp.named_parameters()]
    assert names == OPACUS_NAMES and list(dp.state_dict()) == OPACUS_NAMES
    assert {n: p.shape for n, p in dp.named_parameters()} == \
        {n: p.shape for n, p in ref.named_parameters()}
    assert dp.weight_hh_l1_reverse is dp.l1_reverse.hh.weight
    assert [id(p) for p in dp.parameters()] == [id(dp.get_parameter(n)) for n in names]
    both = [n for n, _ in dp.named_parameters(remove_duplicate=False)]
    assert both[:16] == OPACUS_NAMES and "l1_reverse.hh.bias" in both
    assert list(dp.named_parameters(recurse=False)) == []
    model = nn.Sequential(nn.Embedding(5, 3), DPGRU(3, 2, bias=False))
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "1.weight_ih_l0",
                                                          "1.weight_hh_l0"]
    try:
        from opacus.layers import DPLSTM as OpacusLSTM
    except ImportError:
        return
    theirs = OpacusLSTM(3, 4, num_layers=2, bidirectional=True)
    assert [n for n, _ in theirs.named_parameters()] == names
    assert list(theirs.state_dict()) == list(dp.state_dict())


def test_state_dict_loads_both_ways_and_the_names_stay_tied():
    torch.manual_seed(0)
    dp = DPLSTM(3, 4, num_layers=2, bidirectional=True)
    ref = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    ref.load_state_dict(dp.state_dict())
    for n, p in ref.named_parameters():
        assert torch.equal(p, dp.get_parameter(n))
    ref2 = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    dp.load_state_dict(ref2.state_dict())
    for n, p in ref2.named_parameters():
        assert torch.equal(p, dp.get_parameter(n))
    # The cells' names (what the cells' modules hold) load too.
    cells = {c: p.detach() + 1 for c, p in dp.named_parameters(remove_duplicate=False)
             if "." in c}
    dp.load_state_dict(cells)
    assert torch.equal(dp.bias_hh_l1_reverse, cells["l1_reverse.hh.bias"])
    with pytest.raises(RuntimeError, match=r"'weight_ih_l0' and 'l0.ih.weight' name the same "
                                           r"parameter but hold different values"):
        dp.load_state_dict({**ref2.state_dict(), "l0.ih.weight": cells["l0.ih.weight"]})
    # assign=True makes new Parameters: the torch names point at the cells' again.
    outer = nn.Sequential(dp)
    outer.load_state_dict(nn.Sequential(ref2).state_dict(), assign=True)
    assert dp.weight_ih_l0 is dp.l0.ih.weight
    assert torch.equal(dp.weight_ih_l0, ref2.weight_ih_l0)
    assert len(list(outer.parameters())) == 16
    # A name re-pointed at another Parameter would leave the forward on the old one.
    dp.weight_ih_l0 = nn.Parameter(torch.zeros(16, 3))
    with pytest.raises(RuntimeError, match=r"DPLSTM: parameter 'weight_ih_l0' is no longer the "
                                           r"Parameter of 'l0.ih.weight'"):
        dp(torch.randn(2, 1, 3))


class Tagger(nn.Module):
    """Embedding -> recurrent layer -> Linear on the last step's output."""

    def __init__(self, kind, batch_first=True, bidirectional=True, num_layers=2):
        super().__init__()
        cls, kw = DP[kind]
        self.batch_first = batch_first
        self.emb = nn.Embedding(9, 4)
        self.rnn = cls(4, 5, num_layers=num_layers, batch_first=batch_first,
                       bidirectional=bidirectional, **kw)
        self.head = nn.Linear(5 * (2 if bidirectional else 1), 3)

    def forward(self, idx):                    # idx (B, T) whatever the rnn's layout
        h = self.emb(idx)
        if not self.batch_first:
            h = h.transpose(0, 1)
        out, _ = self.rnn(h)
        return self.head(out[:, -1] if self.batch_first else out[-1])


def _tokens(B=6, T=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 9, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("kind", sorted(DP))
@pytest.mark.parametrize("dtype", [F32, F64])
def test_per_sample_clipping_is_exact(kind, dtype):
    torch.manual_seed(4)
    check_exact(Tagger(kind).double(), ce, _tokens(), dtype=dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sequence_first_single_direction_lstm_is_exact(reduction):
    torch.manual_seed(5)
    model = Tagger("lstm", batch_first=False, bidirectional=False, num_layers=1).double()
    check_exact(model, ce, _tokens(B=5, T=5), dtype=F64, reduction=reduction)


def test_torch_recurrent_layers_are_refused_naming_the_replacement():
    for cls, dp in ((nn.LSTM, "DPLSTM"), (nn.GRU, "DPGRU"), (nn.RNN, "DPRNN")):
        with pytest.raises(ValueError, match=rf"'1\.weight_ih_l0'.*{cls.__name__}.*"
                                             rf"ncdp_fast\.torch\.{dp}.*ModuleValidator\.fix"):
            GhostClipper(nn.Sequential(nn.Linear(3, 3), cls(3, 3)), max_grad_norm=1.0,
                         noise_multiplier=0.0, expected_batch_size=4)


def test_module_validator_fix_replaces_them_with_their_weights():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.GRU(4, 5, batch_first=True), )
    frozen = nn.LSTM(3, 4, batch_first=True)
    frozen.weight_hh_l0.requires_grad_(False)
    net = nn.ModuleDict({"a": nn.LSTM(3, 4, num_layers=2, batch_first=True), "b": frozen,
                         "c": nn.RNN(3, 2, nonlinearity="relu")})
    fixed = ModuleValidator.fix(net)
    assert isinstance(net["a"], nn.LSTM)                    # the argument is left as it was
    assert [type(m) for m in fixed.values()] == [DPLSTM, DPLSTM, DPRNN]
    assert fixed["c"].nonlinearity == "relu"
    assert not fixed["b"].l0.hh.weight.requires_grad and fixed["b"].l0.ih.weight.requires_grad
    x = torch.randn(2, 6, 3)
    for k in net:
        torch.testing.assert_close(_flat(fixed[k](x)), _flat(net[k](x)), rtol=1e-5, atol=1e-6)
    assert ModuleValidator.is_valid(fixed)
    fixed_seq = PrivacyEngine.get_compatible_module(copy.deepcopy(model))
    assert isinstance(fixed_seq[1], DPGRU) and fixed_seq[1].batch_first


def test_refusals():
    with pytest.raises(ValueError, match=r"DPLSTM: expected a PackedSequence of \(sum of "
                                         r"lengths, 3\) data, got data of shape \(6, 2\)"):
        DPLSTM(3, 4)(nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 2), [4, 2]))
    with pytest.raises(ValueError, match=r"DPGRU: expected a batched 3-D input"):
        DPGRU(3, 4)(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"DPLSTM: expected proj_size=0"):
        DPLSTM(3, 4, proj_size=2)
    with pytest.raises(ValueError, match=r"DPLSTM: expected h0 of shape .*\(1, 2, 4\)"):
        DPLSTM(3, 4)(torch.randn(5, 2, 3), (torch.zeros(1, 3, 4), torch.zeros(1, 2, 4)))
    with pytest.raises(TypeError, match=r"DPLSTM: expected the state as a pair"):
        DPLSTM(3, 4)(torch.randn(5, 2, 3), torch.zeros(1, 2, 4))
    with pytest.raises(TypeError, match=r"DPGRU: the initial state given twice, as state and "
                                        r"state_init"):
        DPGRU(3, 4)(torch.randn(5, 2, 3), torch.zeros(1, 2, 4), state_init=torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"nonlinearity"):
        DPRNN(3, 4, nonlinearity="gelu")


# ------------------------------------------------------ PackedSequence input
pack = nn.utils.rnn.pack_padded_sequence
LENGTHS = [4, 1, 6, 4, 2]          # unequal, a tie, a length-1 sequence, unsorted


def _packed_flat(out):
    y, state = out
    states = state if isinstance(state, tuple) else (state,)
    return torch.cat([y.data.reshape(-1)] + [t.reshape(-1) for t in states])


@pytest.mark.parametrize("enforce_sorted", [False, True])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_packed_input_equals_torchs_module_with_the_same_weights(kind, enforce_sorted):
    """Bidirectional, two layers, h0 in the caller's order: the packed output
    (data, batch sizes, indices), each sequence's own last state, and the
    parameters' gradients equal torch's (the input's: the next test)."""
    cls, kw = TORCH[kind]
    torch.manual_seed(7)
    ref = cls(3, 4, num_layers=2, bidirectional=True, **kw).double()
    dp = from_torch(ref)
    lengths = sorted(LENGTHS, reverse=True) if enforce_sorted else LENGTHS
    g = torch.Generator().manual_seed(8)
    x = torch.randn(max(lengths), len(lengths), 3, generator=g, dtype=F64)
    h0 = torch.randn(4, len(lengths), 4, generator=g, dtype=F64)
    state = (h0, torch.randn(h0.shape, generator=g, dtype=F64)) if kind == "lstm" else h0
    outs = {}
    for name, module in (("dp", dp), ("torch", ref)):
        xp = pack(x, lengths, enforce_sorted=enforce_sorted)
        out = module(xp, state)
        assert isinstance(out[0], nn.utils.rnn.PackedSequence)
        _packed_flat(out).sin().sum().backward()
        outs[name] = out
    mine, want = outs["dp"], outs["torch"]
    assert torch.equal(mine[0].batch_sizes, want[0].batch_sizes)
    for a, b in ((mine[0].sorted_indices, want[0].sorted_indices),
                 (mine[0].unsorted_indices, want[0].unsorted_indices)):
        assert (a is None and b is None) or torch.equal(a, b)
    torch.testing.assert_close(_packed_flat(mine), _packed_flat(want), rtol=1e-12, atol=1e-14)
    params = dict(dp.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(params[n].grad, p.grad, rtol=1e-11, atol=1e-13)


def test_packed_input_gradient_of_the_input_and_batch_first_module():
    """A batch_first module takes the packed input as torch's does (packing fixes
    the layout); the gradient reaching the padded input equals torch's, zero
    at the padded positions."""
    torch.manual_seed(9)
    ref = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True).double()
    dp = from_torch(ref)
    g = torch.Generator().manual_seed(10)
    grads = []
    for module in (dp, ref):
        x = torch.randn(5, 6, 3, generator=g.manual_seed(10), dtype=F64, requires_grad=True)
        out, (h, c) = module(pack(x, LENGTHS, batch_first=True, enforce_sorted=False))
        (out.data.square().sum() + h.sum() + c.sum()).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-11, atol=1e-13)
    pad = torch.arange(6)[None, :] >= torch.tensor(LENGTHS)[:, None]
    assert float(grads[0][pad].abs().max()) == 0.0


@settings(max_examples=30, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
       kind=st.sampled_from(["lstm", "gru", "rnn_relu"]), bidirectional=st.booleans(),
       num_layers=st.integers(1, 2), seed=st.integers(0, 2 ** 16))
def test_packed_output_and_states_equal_torchs_for_any_lengths(lengths, kind, bidirectional,
                                                               num_layers, seed):
    """For any batch of lengths (any order, ties), the packed output and each
    sequence's final states equal torch's module with the same weights."""
    cls, kw = TORCH[kind]
    torch.manual_seed(seed)
    ref = cls(2, 3, num_layers=num_layers, bidirectional=bidirectional, **kw).double()
    dp = from_torch(ref)
    x = torch.randn(max(lengths), len(lengths), 2, dtype=F64)
    xp = pack(x, lengths, enforce_sorted=False)
    torch.testing.assert_close(_packed_flat(dp(xp)), _packed_flat(ref(xp)), rtol=1e-12,
                               atol=1e-14)


class PackedTagger(nn.Module):
    """Padded token ids (B, T) and lengths -> Embedding -> packed (unsorted)
    -> recurrent layer -> Linear on the last layer's final states and on the
    summed outputs.  The model's input is the padded batch, so the clipper
    reads B from it."""

    def __init__(self, kind, bidirectional=True):
        super().__init__()
        cls, kw = DP[kind]
        D = 2 if bidirectional else 1
        self.D = D
        self.emb = nn.Embedding(9, 4)
        self.rnn = cls(4, 5, num_layers=2, batch_first=True, bidirectional=bidirectional, **kw)
        self.head = nn.Linear(2 * D * 5, 3)

    def forward(self, idx, lengths):
        out, state = self.rnn(pack(self.emb(idx), lengths.cpu(), batch_first=True,
                                   enforce_sorted=False))
        h = state[0] if isinstance(state, tuple) else state
        last = torch.cat(list(h[-self.D:]), 1)                          # (B, D * H)
        total = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0].sum(1)
        return self.head(torch.cat([last, total], 1))


def _packed_batch(B=6, T=5, seed=11):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 5, 1, 2, 5, 4][:B])
    idx = torch.randint(0, 9, (B, T), generator=g)
    return idx, lengths, torch.randint(0, 3, (B,), generator=g)


def packed_ce(call, idx, lengths, y, reduction="sum"):
    return nn.functional.cross_entropy(call(idx, lengths), y, reduction=reduction)


def one_at_a_time(model, idx, lengths, y):
    """{name: (B, *shape)}: each sample's gradient from a batch of that sample
    alone, cut at its own length (no padding, one sequence)."""
    rows = []
    for i in range(len(y)):
        model.zero_grad()
        L = int(lengths[i])
        packed_ce(model, idx[i:i + 1, :L], lengths[i:i + 1], y[i:i + 1]).backward()
        rows.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad()
    return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}


@pytest.mark.parametrize("kind,dtype", [("lstm", F64), ("lstm", F32), ("gru", F64),
                                        ("rnn_tanh", F64)])
def test_per_sample_clipping_of_a_packed_batch_is_exact(kind, dtype):
    torch.manual_seed(12)
    model = PackedTagger(kind).double()
    batch = _packed_batch()
    check_exact(model, packed_ce, batch, dtype=dtype, ps=one_at_a_time(model, *batch))


class PackedInputModel(nn.Module):
    """A model whose own input is the PackedSequence (of embedded features)."""

    def __init__(self):
        super().__init__()
        self.rnn = DPLSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, packed):
        return self.head(self.rnn(packed)[1][0][-1])


def test_a_packed_model_input_is_read_as_its_sequences():
    """A PackedSequence as the model's input is read as its sequences (the first
    step's batch), not its data's rows (the sum of the lengths): exact without
    a declaration, as with declare_batch_size(B)."""
    torch.manual_seed(13)
    model = PackedInputModel().double()
    g = torch.Generator().manual_seed(14)
    lengths = torch.tensor([2, 4, 1, 3])
    x = torch.randn(4, 4, 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (4,), generator=g)
    ps = {}
    for i in range(4):               # the oracle: each sample alone, unpadded
        model.zero_grad()
        xi = x[i:i + 1, :int(lengths[i])]
        nn.functional.cross_entropy(model(pack(xi, lengths[i:i + 1], batch_first=True)),
                                    y[i:i + 1], reduction="sum").backward()
        for n, p in model.named_parameters():
            ps.setdefault(n, []).append(p.grad.clone())
    ps = {n: torch.stack(v) for n, v in ps.items()}
    model.zero_grad()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=4, loss_reduction="sum")
    packed = pack(x, lengths, batch_first=True, enforce_sorted=False)
    C = low_bound(ps)
    clipper.max_grad_norm = C
    for declare in (False, True):
        model.zero_grad()
        if declare:
            clipper.declare_batch_size(4)
        nn.functional.cross_entropy(model(packed), y, reduction="sum").backward()
        clipper.privatize_()
        got = {n: p.grad for n, p in model.named_parameters()}
        assert_grads_close(got, clipped_mean(ps, C, 1.0), 1e-10)
    clipper.remove()


class TokenRowsModel(nn.Module):
    """A layer applied to a PackedSequence's data: one row per token, not per
    sequence (embedding after packing instead of before)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, packed):
        return self.proj(packed.data)


def test_a_layer_on_packed_tokens_is_refused_not_clipped_per_token():
    """The step's samples are the sequences (batch_sizes[0]); a layer whose rows
    are the packed tokens would clip each token as a sample (a sequence of n
    tokens counted n times): refused in backward, naming the layer and both
    counts, and nothing is written."""
    model = TokenRowsModel().double()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=3, loss_reduction="sum")
    x = torch.randn(3, 4, 4, dtype=F64)
    packed = pack(x, torch.tensor([4, 1, 2]), batch_first=True, enforce_sorted=False)
    with pytest.raises(ValueError, match=r"proj.*7 rows.*3 samples"):
        model(packed).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    clipper.remove()


def test_privacy_engine_step_on_a_packed_batch_with_name_based_param_groups():
    """Opacus users build parameter groups by name (no decay on biases): the
    torch names work; one make_private step (noise 0) on a packed batch equals
    the per-sample-clipped sum over the expected batch size."""
    torch.manual_seed(15)
    model = PackedTagger("lstm").double()
    idx, lengths, y = _packed_batch(B=6)
    named = list(model.named_parameters())
    assert "rnn.weight_hh_l1_reverse" in dict(named)
    decay = [p for n, p in named if not n.endswith(tuple(f"bias_{m}_l{k}{r}" for m in ("ih", "hh")
                                                          for k in (0, 1)
                                                          for r in ("", "_reverse")))]
    rest = [p for n, p in named if all(p is not q for q in decay)]
    assert len(rest) == 8
    opt = torch.optim.SGD([{"params": decay}, {"params": rest, "lr": 0.5}], lr=1.0)
    loader = DataLoader(TensorDataset(idx, lengths, y), batch_size=6)
    oracle = copy.deepcopy(model)           # the same weights, no hooks
    pm, popt, ploader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=1.0, seed=16)
    bi, bl, by = next(iter(ploader))
    assert len(by) >= 2
    ps = one_at_a_time(oracle, bi, bl, by)
    C = low_bound(ps)
    popt.max_grad_norm = C
    popt.zero_grad()
    packed_ce(pm, bi, bl, by, reduction="mean").backward()
    popt.step()
    expected = clipped_mean(ps, C, popt.expected_batch_size)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, expected, 1e-10)


# ------------------------------------------------- Opacus's char-LSTM tutorial
class CharNameClassifier(nn.Module):
    """The tutorial's model (names -> language): characters embedded, a DPLSTM
    over them, the last hidden state to the classes."""

    def __init__(self, lib_lstm, vocab=20, embed=8, hidden=16, classes=5):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = lib_lstm(embed, hidden, batch_first=True)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.embedding(x)
        x, _ = self.lstm(x)
        return self.out(x[:, -1, :])


def _char_lstm_tutorial(lib):
    if lib == "opacus":
        from opacus import PrivacyEngine as Engine
        from opacus.layers import DPLSTM as Lstm
    else:
        Engine, Lstm = PrivacyEngine, DPLSTM
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 20, (32, 10), generator=g)
    y = torch.randint(0, 5, (32,), generator=g)
    torch.manual_seed(0)
    model = CharNameClassifier(Lstm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = Engine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y),
                                                                  batch_size=16),
        noise_multiplier=1.1, max_grad_norm=1.0)
    criterion = nn.CrossEntropyLoss()
    for _ in range(3):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = criterion(model(xb), yb)
            loss.backward()
            optimizer.step()
            assert math.isfinite(loss.item())
    return engine.get_epsilon(1e-5), model


def test_char_lstm_tutorial_runs_with_the_import_changed_and_reports_opacus_epsilon():
    pytest.importorskip("opacus")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps_opacus, _ = _char_lstm_tutorial("opacus")
    eps, model = _char_lstm_tutorial("ncdp_fast")
    assert abs(eps - eps_opacus) <= 0.01 * eps_opacus, (eps, eps_opacus)
    # Opacus's DPLSTM checkpoint loads into ours (torch's parameter names).
    from opacus.layers import DPLSTM as OpacusLSTM
    theirs = OpacusLSTM(8, 16, batch_first=True)
    mine = model._module.lstm
    theirs.load_state_dict(mine.state_dict())
    xs = torch.randn(3, 10, 8)
    torch.testing.assert_close(_flat(theirs(xs)), _flat(mine(xs)), rtol=1e-5, atol=1e-6)
