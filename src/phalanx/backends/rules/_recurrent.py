"""Recurrent layers (``fused``): one recurrence for all members for nn.GRU and nn.RNN, and
for nn.LSTM under a trace.

torch.func has no batching rule for ``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``;
their routes (the end of this file) run torch's own kernels member by member, or, on a tensor
input, the recurrence below (:data:`ONE_RECURRENCE`: GRU and RNN always, LSTM when traced).

Per layer and direction, the input projection of every timestep of every member is one
batched GEMM ``(N, G * H, in) x (N, in, T * B)``, with the biases folded in; then each
timestep is one batched GEMM of the hidden state ``(N, G * H, H) x (N, H, B)`` and the gate
arithmetic of torch's own cells (``aten/src/ATen/native/RNN.cpp``), elementwise over
``(N, G * H, B)``. Member by member, torch runs the same operations on tensors N times
smaller; at the sizes of small forecasters their cost is mostly per operation, so one
recurrence for all members saves most of it (the GRU forecaster of the real-model zoo: 4x).

The recurrence is one autograd node with a hand-written backward through time. Second
derivatives are exact: when the backward itself is differentiated (``create_graph=True``),
it recomputes the recurrence with ordinary operations from the saved inputs and
differentiates that. Under torch.compile or a torch.func transform of the user's the
ordinary operations run directly. Eagerly, LSTMs run member by member with torch's kernel
(oneDNN's fused LSTM on a CPU is faster than this recurrence at the zoo's sizes); traced, as
one recurrence, which inductor compiles where it cannot compile oneDNN's kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx import _torch_compat as compat
from phalanx.backends.rules._registry import Dims, Route, function, per_member, register

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------------------- the recurrence
#
# Layouts, time-major and feature-major: a sequence is ``(T, N, X, B)`` and a state
# ``(N, H, B)``, so that a step's gates ``W_hh h`` are ``(N, G * H, B)``: each gate of each
# member is one contiguous block of H * B numbers, and each timestep of a sequence is
# contiguous. The elementwise gate arithmetic then runs on long contiguous runs, and batched
# GEMMs write their output in place, which strided outputs would make slow.


def _time(s: int, steps: int, reverse: bool) -> int:
    """The timestep the s-th step processes."""
    return steps - 1 - s if reverse else s


def _steps(
    mode: str,
    gi: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_hh: torch.Tensor,
    b_hn: torch.Tensor | None,
    reverse: bool,
) -> tuple[Any, ...]:
    """The recurrence with ordinary differentiable operations: the specification of the fast
    path, and what second derivatives differentiate.

    Args:
        gi: the input projection with the biases torch adds outside GRU's reset gate,
            ``(T, N, G * H, B)``.
        h0, c0: the initial states ``(N, H, B)``; c0 only for LSTM.
        w_hh: ``(N, G * H, H)``. b_hn: GRU's hidden bias of the n gate ``(N, H)``, or None.
        reverse: run from the last timestep to the first.

    Returns:
        ``(out, h_n)``, and ``c_n`` for LSTM: out ``(T, N, H, B)``.
    """
    hidden, steps = w_hh.shape[-1], gi.shape[0]
    h, c = h0, c0
    outs: list[torch.Tensor] = [h0] * steps
    for s in range(steps):
        t = _time(s, steps, reverse)
        if mode == "LSTM":
            assert c is not None
            gates = torch.baddbmm(gi[t], w_hh, h)
            i, f, _, o = torch.sigmoid(gates).chunk(4, 1)
            g = torch.tanh(gates[:, 2 * hidden : 3 * hidden])
            c = f * c + i * g
            h = o * torch.tanh(c)
        elif mode == "GRU":
            gh = torch.bmm(w_hh, h)
            gh_n = gh[:, 2 * hidden :]
            if b_hn is not None:
                gh_n = gh_n + b_hn.unsqueeze(-1)
            r, z = torch.sigmoid(gi[t, :, : 2 * hidden] + gh[:, : 2 * hidden]).chunk(2, 1)
            n = torch.tanh(gi[t, :, 2 * hidden :] + r * gh_n)
            h = (h - n) * z + n
        else:
            pre = torch.baddbmm(gi[t], w_hh, h)
            h = torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)
        outs[t] = h
    out = torch.stack(outs)
    return (out, h, c) if mode == "LSTM" else (out, h)


def _forward(
    mode: str,
    gi: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_hh: torch.Tensor,
    b_hn: torch.Tensor | None,
    reverse: bool,
    keep: bool,
) -> tuple[Any, ...]:
    """The recurrence without autograd, into preallocated buffers, activations in place.

    Returns:
        ``(out, h_n, c_n, saved)``: with ``keep``, saved holds what the backward reads, by
        timestep (the activated gates; LSTM's cell states and their tanh; GRU's
        ``W_hh h + (0, 0, b_hn)``).
    """
    steps = gi.shape[0]
    hidden = w_hh.shape[-1]
    out = gi.new_empty(steps, *h0.shape)
    h, c = h0, c0
    saved: tuple[torch.Tensor, ...] = ()
    if mode == "LSTM":
        assert c is not None
        gates = torch.empty_like(gi)
        cells, tanh_c = torch.empty_like(out), torch.empty_like(out)
        for s in range(steps):
            t = _time(s, steps, reverse)
            g = torch.bmm(w_hh, h, out=gates[t]).add_(gi[t])
            g[:, : 2 * hidden].sigmoid_()
            g[:, 2 * hidden : 3 * hidden].tanh_()
            g[:, 3 * hidden :].sigmoid_()
            i, f, g_, o = g.chunk(4, 1)
            c = torch.mul(f, c, out=cells[t]).addcmul_(i, g_)
            h = torch.mul(o, torch.tanh(c, out=tanh_c[t]), out=out[t])
        saved = (gates, cells, tanh_c)
    elif mode == "GRU":
        gates, gh_all = torch.empty_like(gi), torch.empty_like(gi)
        bias = None if b_hn is None else b_hn.unsqueeze(-1)
        for s in range(steps):
            t = _time(s, steps, reverse)
            g_in, g = gi[t], gates[t]
            gh = torch.bmm(w_hh, h, out=gh_all[t])
            gh_n = gh[:, 2 * hidden :]
            if bias is not None:
                gh_n.add_(bias)
            rz = torch.add(g_in[:, : 2 * hidden], gh[:, : 2 * hidden], out=g[:, : 2 * hidden])
            rz.sigmoid_()
            n = torch.mul(g[:, :hidden], gh_n, out=g[:, 2 * hidden :])
            n.add_(g_in[:, 2 * hidden :]).tanh_()
            h = torch.sub(h, n, out=out[t]).mul_(g[:, hidden : 2 * hidden]).add_(n)
        saved = (gates, gh_all)
    else:
        for s in range(steps):
            t = _time(s, steps, reverse)
            h = torch.bmm(w_hh, h, out=out[t]).add_(gi[t])
            h.tanh_() if mode == "RNN_TANH" else h.relu_()
    c_n = c.clone() if c is not None else None
    return out, h.clone(), c_n, saved if keep else ()


def _backward(
    mode: str,
    grads: tuple[torch.Tensor, ...],
    inputs: tuple[Any, ...],
    out: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    reverse: bool,
    needs: tuple[bool, ...],
) -> list[torch.Tensor | None]:
    """Backward through time; the gradients of ``(gi, h0, c0, w_hh, b_hn)``."""
    d_out, dh_n = grads[0], grads[1]
    gi, h0, c0, w_hh, b_hn = inputs
    hidden, steps = w_hh.shape[-1], gi.shape[0]
    w_t = w_hh.transpose(1, 2).contiguous()  # (N, H, G * H)
    one = gi.new_ones(())
    dgi = torch.empty_like(gi)  # (T, N, G * H, B)
    d_w = torch.zeros_like(w_hh) if needs[3] else None
    d_bn = torch.zeros_like(h0) if b_hn is not None and needs[4] else None  # summed over B last
    dc = grads[2].clone() if mode == "LSTM" else None
    # One step's scratch, reused: fresh tensors this large each step would be mapped and
    # faulted in anew by the C allocator.
    scratch = torch.empty_like(gi[0])
    y = torch.empty_like(gi[0]) if mode == "GRU" else None  # the gradient of W_hh h + b_hn
    dh = dh_n + d_out[_time(steps - 1, steps, reverse)]
    for s in range(steps - 1, -1, -1):
        t = _time(s, steps, reverse)
        before = _time(s - 1, steps, reverse)
        h_prev = out[before] if s else h0
        x = dgi[t]
        step = x
        direct = None  # what reaches the state before this step other than through W_hh
        if mode == "LSTM":
            assert dc is not None
            gates, tanh_c = saved[0][t], saved[2][t]
            i, f, g, o = gates.chunk(4, 1)
            c_prev = saved[1][before] if s else c0
            dc.addcmul_(dh * o, torch.addcmul(one, tanh_c, tanh_c, value=-1))
            torch.mul(dc, g, out=x[:, :hidden])
            torch.mul(dc, c_prev, out=x[:, hidden : 2 * hidden])
            torch.mul(dc, i, out=x[:, 2 * hidden : 3 * hidden])
            torch.mul(dh, tanh_c, out=x[:, 3 * hidden :])
            deriv = torch.sub(one, gates, out=scratch).mul_(gates)  # sigmoid's derivative
            torch.addcmul(one, g, g, value=-1, out=deriv[:, 2 * hidden : 3 * hidden])  # tanh's
            x.mul_(deriv)
            if s or needs[2]:
                dc.mul_(f)
        elif mode == "GRU":
            assert y is not None
            gates, gh = saved[0][t], saved[1][t]
            r, z, n = gates.chunk(3, 1)
            rz = gates[:, : 2 * hidden]
            direct = dh * z  # h' = (h - n) * z + n
            x_n = torch.sub(dh, direct, out=x[:, 2 * hidden :])
            x_n.mul_(torch.addcmul(one, n, n, value=-1))
            torch.mul(x_n, r, out=y[:, 2 * hidden :])
            torch.mul(x_n, gh[:, 2 * hidden :], out=x[:, :hidden])
            torch.sub(h_prev, n, out=x[:, hidden : 2 * hidden]).mul_(dh)
            x[:, : 2 * hidden].mul_(torch.sub(one, rz, out=scratch[:, : 2 * hidden]).mul_(rz))
            y[:, : 2 * hidden].copy_(x[:, : 2 * hidden])
            step = y
            if d_bn is not None:
                d_bn.add_(y[:, 2 * hidden :])
        elif mode == "RNN_TANH":
            torch.mul(dh, torch.addcmul(one, out[t], out[t], value=-1), out=x)
        else:
            x.copy_(torch.ops.aten.threshold_backward(dh, out[t], 0))
        if d_w is not None:
            d_w.baddbmm_(step, h_prev.transpose(1, 2))
        if s:
            direct = d_out[before] if direct is None else direct.add_(d_out[before])
        if s or needs[1]:
            dh = torch.bmm(w_t, step) if direct is None else torch.baddbmm(direct, w_t, step)
    d_b = None if d_bn is None else d_bn.sum(-1)
    return [dgi, dh if needs[1] else None, dc if needs[2] else None, d_w, d_b]


class _Recurrence(torch.autograd.Function):
    """One layer and direction of the recurrence, for all members, as one autograd node."""

    @staticmethod
    def forward(
        ctx: Any,
        mode: str,
        reverse: bool,
        gi: torch.Tensor,
        h0: torch.Tensor,
        c0: torch.Tensor | None,
        w_hh: torch.Tensor,
        b_hn: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        out, h_n, c_n, saved = _forward(mode, gi, h0, c0, w_hh, b_hn, reverse, keep=True)
        ctx.mode, ctx.reverse = mode, reverse
        ctx.save_for_backward(gi, h0, c0, w_hh, b_hn, out, *saved)
        return (out, h_n, c_n) if mode == "LSTM" else (out, h_n)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        if torch.is_grad_enabled():
            got = _double_differentiable(ctx, grads, saved[:5], needs)
        else:
            got = _backward(ctx.mode, grads, saved[:5], saved[5], saved[6:], ctx.reverse, needs)
        return (None, None, *(g if need else None for g, need in zip(got, needs)))


def _double_differentiable(ctx: Any, grads: tuple, inputs: tuple, needs: tuple) -> list:
    """The backward under ``create_graph=True``: recompute with autograd, differentiate that."""
    wanted = [k for k, t in enumerate(inputs) if t is not None and needs[k]]
    with torch.enable_grad():
        gi, h0, c0, w_hh, b_hn = inputs
        ys = _steps(ctx.mode, gi, h0, c0, w_hh, b_hn, ctx.reverse)
        got = torch.autograd.grad(
            ys, [inputs[k] for k in wanted], grads, create_graph=True, allow_unused=True
        )
    result: list[torch.Tensor | None] = [None] * len(inputs)
    for k, g in zip(wanted, got):
        result[k] = g
    return result


def _recurrence(
    mode: str,
    gi: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_hh: torch.Tensor,
    b_hn: torch.Tensor | None,
    reverse: bool,
) -> tuple[torch.Tensor, ...]:
    """``(out, h_n)`` and LSTM's ``c_n``, by the fastest path that is exact here."""
    if compat.tracing() or compat.transforms_active() or compat.forward_ad_active():
        # torch.compile (and compile_step's make_fx trace) fuses the ordinary operations
        # itself, and a torch.func transform or forward-mode AD cannot see through the
        # hand-written backward.
        return _steps(mode, gi, h0, c0, w_hh, b_hn, reverse)
    inputs = (gi, h0, c0, w_hh, b_hn)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _Recurrence.apply(mode, reverse, *inputs)
    out, h_n, c_n, _ = _forward(mode, gi, h0, c0, w_hh, b_hn, reverse, keep=False)
    return (out, h_n, c_n) if mode == "LSTM" else (out, h_n)


# ------------------------------------------------------------------------------- the layer


def _project(seq: torch.Tensor, w_ih: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Every timestep's input projection: ``seq (T, N, in, B) -> gi (T, N, G * H, B)``, one
    GEMM over the columns ``(t, b)`` (its gradient, one GEMM for the weights too)."""
    steps, n, in_f, b = seq.shape
    cols = seq.permute(1, 2, 0, 3).reshape(n, in_f, steps * b)
    y = torch.bmm(w_ih, cols) if bias is None else torch.baddbmm(bias.unsqueeze(-1), w_ih, cols)
    return y.view(n, -1, steps, b).permute(2, 0, 1, 3).contiguous()


_MODES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN_TANH", "rnn_relu": "RNN_RELU"}

#: The layers that run as one recurrence for all members eagerly too. Under a trace every
#: layer does (torch.compile and compile_step's inductor fuse its operations, and inductor
#: cannot compile oneDNN's LSTM: compile_step would run eager). An LSTM runs eagerly with
#: oneDNN's kernel member by member, which is faster here (the zoo's lstm_forecaster, 16
#: members: a training step 51 ms against 64 ms as one recurrence, the loop's 49 ms).
ONE_RECURRENCE = frozenset({"gru", "rnn_tanh", "rnn_relu"})


def batched(
    name: str,
    n: int,
    dims: tuple,
    x: torch.Tensor,
    hx: list[torch.Tensor],
    weights: list[torch.Tensor],
    rest: tuple,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` of every member in one
    recurrence, or None where this path does not apply (then torch's kernels run member by
    member).

    ``x``, ``hx`` (the initial states: LSTM's h and c, the others' h) and ``weights`` are the
    physical tensors of a vmap rule, ``dims`` their batch dims (x, each state, then the
    weights); ``rest`` is (has_biases, num_layers, dropout, train, bidirectional,
    batch_first).
    """
    mode = _MODES.get(name)
    if mode is None or len(rest) != 6 or len(hx) != (2 if mode == "LSTM" else 1):
        return None
    has_biases, layers, dropout, train, bidirectional, batch_first = rest
    xd, hds, wds = dims[0], dims[1 : 1 + len(hx)], dims[1 + len(hx) :]
    dirs = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    if (
        len(weights) != layers * dirs * per  # LSTM's projections (proj_size) carry a fifth
        or any(d is None for d in wds)
        or x.dim() - (xd is not None) != 3
        or (train and dropout > 0 and layers > 1)
        or torch.is_autocast_enabled(x.device.type)
        or x.dtype not in _DTYPES
        or any(w.dtype != x.dtype for w in weights)
    ):
        return None
    xs = x.movedim(xd, 0) if xd is not None else x.expand(n, *x.shape)
    if xs.shape[2 if batch_first else 1] == 0:
        return None
    ws = [w.movedim(d, 0) for w, d in zip(weights, wds)]
    hidden = ws[1].shape[-1]
    # (T, N, in, B), and states (L * D, N, H, B): from (N, L * D, B, H)
    seq = xs.permute(2, 0, 3, 1) if batch_first else xs.permute(1, 0, 3, 2)
    h0, *cell = (  # cell: LSTM's c0 alone
        (s.movedim(d, 0) if d is not None else s.expand(n, *s.shape)).permute(1, 0, 3, 2)
        for s, d in zip(hx, hds)
    )
    h_n: list[torch.Tensor] = []
    c_n: list[torch.Tensor] = []
    for layer in range(layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            w_ih, w_hh = ws[per * k], ws[per * k + 1]
            bias = b_hn = None
            if has_biases:
                b_ih, b_hh = ws[per * k + 2], ws[per * k + 3]
                if mode == "GRU":
                    two = 2 * hidden
                    bias = torch.cat([b_ih[:, :two] + b_hh[:, :two], b_ih[:, two:]], 1)
                    b_hn = b_hh[:, two:]
                else:
                    bias = b_ih + b_hh
            c = cell[0][k] if cell else None
            got = _recurrence(mode, _project(seq, w_ih, bias), h0[k], c, w_hh, b_hn, d == 1)
            outs.append(got[0])  # (T, N, H, B)
            h_n.append(got[1])
            c_n.extend(got[2:])
        seq = outs[0] if dirs == 1 else torch.cat(outs, 2)
    out = seq.permute(1, 3, 0, 2) if batch_first else seq.permute(1, 0, 3, 2)
    states = [torch.stack(h).permute(1, 0, 3, 2) for h in (h_n, c_n) if h]  # (N, L * D, B, H)
    # each member's contiguous, as torch's own outputs are
    got = tuple(t.contiguous() for t in (out, *states))
    return got, (0,) * len(got)


# ------------------------------------------------------------------------------- the routes


def _recurrent(func: Callable[..., Any], pairs: bool) -> Route:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (the tensor and the
    PackedSequence forms), member by member with torch's own kernels: torch.func has no rule
    for them. Their states and weights come as lists, flattened here for the Function; one
    Function per layout (how many states and weights)."""
    made: dict[tuple[int, int, int, int], Any] = {}

    def route(args: tuple, kwargs: dict) -> Any:
        if kwargs:
            args = (*args, *kwargs.values())
        first = next(i for i, a in enumerate(args) if isinstance(a, (list, tuple)))
        at = first if pairs else first - 1  # where hx is: an LSTM's is the first list
        hx, weights, rest = args[at], args[at + 1], args[at + 2 :]
        states = list(hx) if pairs else [hx]
        layout = (at, len(states), len(weights), len(rest))
        if layout not in made:
            k, m = layout[1], layout[2]

            def call(*xs: Any) -> tuple:
                st, ws = xs[at : at + k], xs[at + k : at + k + m]
                out = func(*xs[:at], list(st) if pairs else st[0], list(ws), *xs[at + k + m :])
                return tuple(out)

            def rule(n: int, d: Dims, *xs: Any) -> Any:
                # a tensor input (not packed), eagerly or under a trace (``ONE_RECURRENCE``)
                if at == 1 and (func.__name__ in ONE_RECURRENCE or compat.tracing()):
                    fast = batched(
                        func.__name__, n, tuple(d[: 1 + k + m]), xs[0], list(xs[1 : 1 + k]),
                        list(xs[1 + k : 1 + k + m]), tuple(xs[1 + k + m :]),
                    )  # fmt: skip
                    if fast is not None:
                        return fast
                return per_member(n, d, call, *xs)

            made[layout] = function(f"{func.__name__}_members", call, rule)
        return made[layout].apply(*args[:at], *states, *weights, *rest)

    return route


register(torch.lstm, _recurrent(torch.lstm, pairs=True), table="speed")
register(torch.gru, _recurrent(torch.gru, pairs=False), table="speed")
register(torch.rnn_tanh, _recurrent(torch.rnn_tanh, pairs=False), table="speed")
register(torch.rnn_relu, _recurrent(torch.rnn_relu, pairs=False), table="speed")
