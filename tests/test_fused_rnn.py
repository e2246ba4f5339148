"""The fused backend's nn.RNN / nn.LSTM / nn.GRU against the loop of the originals.

Every supported variant (mode, layers, bias, batch_first, bidirectional, initial states
given or not, shared or per-member input, train or eval) is compared member by member with
the N original modules run one by one: outputs, final states, and the gradients of the
input, of the initial states and of every parameter, and second derivatives (a gradient
penalty). The criterion is float rounding: no further from a float64 run of the loop than
a small factor over the float32 loop's own distance from it, plus a few ulps.

torch.func has no batching rule for these layers; the fused backend's rule runs torch's own
kernel member by member inside the vmapped forward (``rules._recurrent``), and these tests
check that every argument layout of ``torch.lstm`` / ``gru`` / ``rnn_*`` reaches it intact.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import phalanx
from phalanx.testing import assert_equal_to_loop

IN, HIDDEN, B, T, N = 3, 5, 4, 6, 3

CELLS = {
    "LSTM": lambda **kw: nn.LSTM(IN, HIDDEN, **kw),
    "GRU": lambda **kw: nn.GRU(IN, HIDDEN, **kw),
    "RNN_TANH": lambda **kw: nn.RNN(IN, HIDDEN, nonlinearity="tanh", **kw),
    "RNN_RELU": lambda **kw: nn.RNN(IN, HIDDEN, nonlinearity="relu", **kw),
}


class Recurrent(nn.Module):
    """One recurrent layer; input ``(B, T, IN)`` and initial states ``(B, L * D, H)`` batch
    first whatever the layer's own layout (the stack folds the members into dim 0)."""

    def __init__(self, mode: str, **kw) -> None:
        super().__init__()
        self.rnn = CELLS[mode](**kw)
        self.batch_first = kw.get("batch_first", False)

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None, c0=None):
        if not self.batch_first:
            x = x.transpose(0, 1)
        hx = None
        if h0 is not None:
            h0 = h0.transpose(0, 1).contiguous()
            hx = (h0, c0.transpose(0, 1).contiguous()) if c0 is not None else h0
        out, states = self.rnn(x, hx)
        if not self.batch_first:
            out = out.transpose(0, 1)
        h_n, c_n = states if isinstance(states, tuple) else (states, None)
        # Batch first again, so that the stack unfolds every output at dim 0.
        outs = (out, h_n.transpose(0, 1))
        return outs if c_n is None else (*outs, c_n.transpose(0, 1))


def _loss(outs) -> torch.Tensor:
    """Touches every output, never mixes members (a sum over them)."""
    return sum((o.square() + o).sum() for o in outs)


def _run(members, args, per_member, penalty):
    """Outputs, and the gradients of the inputs and parameters of ``_loss`` (plus, with
    ``penalty``, the squared input gradient: a second derivative)."""
    outs = [m(*[a[i] if per_member else a for a in args]) for i, m in enumerate(members)]
    stacked = [torch.stack(o) for o in zip(*outs)]
    return stacked, _grads(stacked, args, [m.parameters() for m in members], penalty)


def _grads(outs, args, params, penalty):
    loss = _loss(outs)
    leaves = [a for a in args if a.requires_grad]
    if penalty:
        gx = torch.autograd.grad(loss, leaves[0], create_graph=True)[0]
        loss = loss + gx.square().sum()
    flat = [p for ps in params for p in ps]
    return torch.autograd.grad(loss, leaves + flat)


def _loop(members, args, per_member, penalty, dtype):
    members = [copy.deepcopy(m).to(dtype) for m in members]
    args = [a.detach().to(dtype).requires_grad_() for a in args]
    outs, grads = _run(members, args, per_member, penalty)
    n_in = len(args)
    params = grads[n_in:]
    k = len(list(members[0].parameters()))
    # Per parameter, the members' gradients stacked: (N, *shape).
    per_param = [torch.stack(params[i::k]) for i in range(k)]
    return outs, list(grads[:n_in]), per_param


def _as_close_as_the_loop(got, loop32, loop64, what: str) -> None:
    # Recurrent states are O(1) (tanh, sigmoid): a gradient may cancel from O(1) terms.
    floor_scale = 1 + loop64.abs().max().item()
    assert_equal_to_loop(got, loop32, loop64, what=what, floor_scale=floor_scale)


def check(mode, kw, *, per_member, states, train=True, penalty=False, n=N):
    torch.manual_seed(0)
    members = [Recurrent(mode, **kw).train(train) for _ in range(n)]
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    lead = (n,) if per_member else ()
    args = [torch.randn(*lead, B, T, IN)]
    if states:
        args += [torch.randn(*lead, B, layers, HIDDEN) * 0.5]
        if mode == "LSTM":
            args += [torch.randn(*lead, B, layers, HIDDEN) * 0.5]
    args = [a.requires_grad_() for a in args]

    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    in_dims = 0 if per_member else None
    outs = stack(*args, in_dims=in_dims)
    names = [name for name, _ in members[0].named_parameters()]
    params = [stack.module.get_parameter(name) for name in names]
    grads = _grads(list(outs), args, [params], penalty)

    out32, in32, p32 = _loop(members, args, per_member, penalty, torch.float32)
    out64, in64, p64 = _loop(members, args, per_member, penalty, torch.float64)
    for k, (o, o32, o64) in enumerate(zip(outs, out32, out64)):
        assert o.shape == o32.shape, f"output {k}: {o.shape} against {o32.shape}"
        _as_close_as_the_loop(o, o32, o64, f"output {k}")
    for k in range(len(args)):
        _as_close_as_the_loop(grads[k], in32[k], in64[k], f"gradient of input {k}")
    for name, g, g32, g64 in zip(names, grads[len(args) :], p32, p64):
        _as_close_as_the_loop(g, g32, g64, f"gradient of {name}")


VARIANTS = [
    dict(num_layers=layers, bias=bias, batch_first=bf, bidirectional=bi)
    for layers, bias, bf, bi in itertools.product(
        [1, 2], [True, False], [True, False], [False, True]
    )
]


def _id(kw) -> str:
    return "L{num_layers}-bias{bias}-bf{batch_first}-bi{bidirectional}".format(**kw)


@pytest.mark.parametrize("kw", VARIANTS, ids=_id)
@pytest.mark.parametrize("mode", list(CELLS))
def test_every_variant_matches_the_loop(mode, kw):
    check(mode, kw, per_member=False, states=False)


@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per_member"])
@pytest.mark.parametrize("states", [False, True], ids=["no_hx", "hx"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", list(CELLS))
def test_inputs_states_and_modes_match_the_loop(mode, train, states, per_member):
    kw = dict(num_layers=2, batch_first=True, bidirectional=mode == "GRU")
    check(mode, kw, per_member=per_member, states=states, train=train)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("mode", list(CELLS))
def test_second_derivatives_match_the_loop(mode, bidirectional):
    kw = dict(num_layers=2, batch_first=True, bidirectional=bidirectional)
    check(mode, kw, per_member=True, states=True, penalty=True)


def test_dropout_zero_in_training_and_dropout_in_eval_run_batched():
    check("GRU", dict(num_layers=2, batch_first=True, dropout=0.0), per_member=False, states=False)
    check("LSTM", dict(num_layers=2, batch_first=True, dropout=0.5), per_member=False,
          states=False, train=False)  # fmt: skip


def test_one_member():
    check("LSTM", dict(num_layers=2, batch_first=True), per_member=True, states=True, n=1)


@pytest.mark.parametrize("mode", list(CELLS))
def test_no_grad_forward_matches_the_loop(mode):
    torch.manual_seed(0)
    members = [Recurrent(mode, num_layers=2, batch_first=True) for _ in range(N)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    x = torch.randn(N, B, T, IN)
    stack(x, in_dims=0)  # the first call is checked against the reference, with grad
    with torch.no_grad():
        got = stack(x, in_dims=0)
        expected = [torch.stack(o) for o in zip(*(m(x[i]) for i, m in enumerate(members)))]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the other argument layouts


def test_packed_sequences_match_the_loop():
    torch.manual_seed(0)
    members = [nn.GRU(IN, HIDDEN, batch_first=True) for _ in range(N)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    x = torch.randn(B, T, IN)

    class Packed(nn.Module):
        def __init__(self, rnn: nn.Module) -> None:
            super().__init__()
            self.rnn = rnn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            packed = nn.utils.rnn.pack_padded_sequence(x, [T, T - 1, 3, 2], batch_first=True)
            out, h = self.rnn(packed)
            return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0] + h.sum()

    wrapped = [Packed(m) for m in members]
    stack = phalanx.stack(copy.deepcopy(wrapped), backend="fused")
    torch.testing.assert_close(stack(x), torch.stack([m(x) for m in wrapped]))


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_proj_size_matches_the_loop():
    torch.manual_seed(0)
    members = [nn.LSTM(IN, HIDDEN, proj_size=2, batch_first=True) for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(members), backend="fused")
    x = torch.randn(B, T, IN)
    out, (h, c) = stack(x)
    for i, m in enumerate(members):
        o, (hi, ci) = m(x)
        torch.testing.assert_close((out[i], h[i], c[i]), (o, hi, ci))


def test_dropout_between_layers_draws_per_member():
    torch.manual_seed(0)
    base = nn.LSTM(IN, HIDDEN, 2, dropout=0.5, batch_first=True)
    stack = phalanx.stack([copy.deepcopy(base) for _ in range(2)], backend="fused")
    out, _ = stack(torch.randn(B, T, IN))
    assert not torch.equal(out[0], out[1]), "identical members drew one dropout mask"


@pytest.mark.parametrize("mode", ["GRU", "RNN_TANH", "RNN_RELU"])
def test_gru_and_rnn_run_as_one_recurrence_for_all_members(mode, monkeypatch):
    from phalanx.backends.rules import _recurrent

    taken = []
    recurrence = _recurrent._recurrence
    monkeypatch.setattr(_recurrent, "_recurrence", lambda *a: taken.append(1) or recurrence(*a))
    check(mode, dict(num_layers=2, batch_first=True, bidirectional=True), per_member=True,
          states=True, penalty=True)  # fmt: skip
    assert taken, "the batched recurrence did not run"


@pytest.fixture
def lstm_as_one_recurrence(monkeypatch):
    """LSTMs run eagerly through the one recurrence for all members (as they do traced)."""
    from phalanx.backends.rules import _recurrent

    monkeypatch.setattr(_recurrent, "ONE_RECURRENCE", _recurrent.ONE_RECURRENCE | {"lstm"})
    taken = []
    recurrence = _recurrent._recurrence
    monkeypatch.setattr(_recurrent, "_recurrence", lambda *a: taken.append(1) or recurrence(*a))
    return taken


@pytest.mark.parametrize("kw", VARIANTS, ids=_id)
def test_lstm_as_one_recurrence_matches_the_loop(kw, lstm_as_one_recurrence):
    check("LSTM", kw, per_member=False, states=False)
    assert lstm_as_one_recurrence, "the batched recurrence did not run"


@pytest.mark.parametrize("per_member", [False, True], ids=["shared", "per_member"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_lstm_as_one_recurrence_with_states_and_second_derivatives(
    per_member, train, lstm_as_one_recurrence
):
    kw = dict(num_layers=2, batch_first=True, bidirectional=True)
    check("LSTM", kw, per_member=per_member, states=True, train=train, penalty=train)
    assert lstm_as_one_recurrence, "the batched recurrence did not run"


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_lstm_with_projections_stays_member_by_member(lstm_as_one_recurrence):
    """proj_size adds a fifth weight per layer the recurrence does not take: torch's kernel."""
    test_proj_size_matches_the_loop()
    assert not lstm_as_one_recurrence
