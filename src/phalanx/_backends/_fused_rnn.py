"""Batched nn.RNN, nn.LSTM and nn.GRU for the fused backend: all N members in one recurrence.

Per layer and direction, the input projection of every timestep of every member is one
batched GEMM ``(N, B * T, in) x (N, in, G * H)``, with the biases folded in; then each
timestep is one batched GEMM of the hidden state ``(N, B, H) x (N, H, G * H)`` and the gate
arithmetic of torch's own cells (``aten/src/ATen/native/RNN.cpp``), elementwise over
``(N, B, G * H)``. Member by member, torch runs the same operations N times as large as
needed; at the sizes of small forecasters the cost is the count of operations, not their
size, so one recurrence for all members is about N times fewer operations.

The recurrence is one autograd node with a hand-written backward through time: per step a
few elementwise operations and one batched GEMM for the hidden state's gradient; the weight
gradient is one GEMM over all timesteps at the end. The factors each step multiplies by
(the gates' derivatives) are computed for all timesteps at once before the loop.

Second derivatives are exact: when the backward itself is differentiated
(``create_graph=True``), it recomputes the recurrence with ordinary operations from the
saved inputs and differentiates that (as ``_fused_mlp`` does). Under torch.compile or a
torch.func transform the ordinary operations run directly.

What is not batched here (a PackedSequence, ``proj_size > 0``, an unbatched 2-D input,
dropout between layers in training, dtypes other than float32 and float64, autocast) runs
member by member through ``BatchedRNN``, with torch's own kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx._backends._fused_layers import BatchedRNN, fold_sizes

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
_DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------------------- the recurrence
#
# Layouts. The input projection ``gi`` is ``(N, T, B, G * H)``: the output of one batched GEMM
# over rows ``(t, b)``, so that its gradient feeds the weight gradients as one GEMM too. Step by
# step the recurrence reads ``gi[:, t]`` and writes to buffers ``(T, N, B, X)`` indexed by the
# step ``s`` in the order the steps run (``t = s``, or ``T - 1 - s`` in the reverse direction):
# each step's slice is contiguous, which batched GEMMs writing their output need to be fast.


def _time(s: int, steps: int, reverse: bool) -> int:
    return steps - 1 - s if reverse else s


def _hidden_bias(b_hn: torch.Tensor | None) -> torch.Tensor | None:
    return None if b_hn is None else b_hn.unsqueeze(1)  # (N, 1, H)


def _steps(
    mode: str,
    gi: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_hh: torch.Tensor,
    b_hn: torch.Tensor | None,
    reverse: bool,
) -> tuple[torch.Tensor, ...]:
    """The recurrence with ordinary differentiable operations: the specification of the fast
    path, and what second derivatives differentiate.

    Args:
        gi: the input projection with the biases torch adds outside GRU's reset gate,
            ``(N, T, B, G * H)``.
        h0, c0: the initial states ``(N, B, H)``; c0 only for LSTM.
        w_hh: ``(N, G * H, H)``. b_hn: GRU's hidden bias of the n gate ``(N, H)``, or None.
        reverse: run from the last timestep to the first.

    Returns:
        ``(hs, h_n)``, and ``c_n`` for LSTM: hs ``(T, N, B, H)`` in the order the steps ran.
    """
    hidden, steps = w_hh.shape[-1], gi.shape[1]
    w_t = w_hh.transpose(1, 2)
    h, c = h0, c0
    hs = []
    for s in range(steps):
        g_in = gi[:, _time(s, steps, reverse)]
        if mode == "LSTM":
            gates = torch.baddbmm(g_in, h, w_t)
            i, f, _, o = torch.sigmoid(gates).chunk(4, -1)
            g = torch.tanh(gates[..., 2 * hidden : 3 * hidden])
            c = f * c + i * g
            h = o * torch.tanh(c)
        elif mode == "GRU":
            gh = torch.bmm(h, w_t)
            gh_n = gh[..., 2 * hidden :]
            if b_hn is not None:
                gh_n = gh_n + b_hn.unsqueeze(1)
            r, z = torch.sigmoid(g_in[..., : 2 * hidden] + gh[..., : 2 * hidden]).chunk(2, -1)
            n = torch.tanh(g_in[..., 2 * hidden :] + r * gh_n)
            h = (h - n) * z + n
        else:
            pre = torch.baddbmm(g_in, h, w_t)
            h = torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)
        hs.append(h)
    return (torch.stack(hs), h, c) if mode == "LSTM" else (torch.stack(hs), h)


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
        ``(hs, h_n, c_n, saved)``: with ``keep``, saved holds what the backward reads (the
        activated gates; LSTM's cell states and their tanh; GRU's ``W_hn h + b_hn``).
    """
    hidden, steps = w_hh.shape[-1], gi.shape[1]
    n_, b_ = h0.shape[:2]
    w_t = w_hh.transpose(1, 2).contiguous()  # (N, H, G * H): a faster GEMM operand
    hs = gi.new_empty(steps, n_, b_, hidden)
    h, c = h0, c0
    saved: tuple[torch.Tensor, ...] = ()
    if mode == "LSTM":
        gates = gi.new_empty(steps, n_, b_, gi.shape[-1])
        cells, tanh_c = torch.empty_like(hs), torch.empty_like(hs)
        for s in range(steps):
            g = gates[s]
            torch.bmm(h, w_t, out=g)
            g.add_(gi[:, _time(s, steps, reverse)])
            g[..., : 2 * hidden].sigmoid_()
            g[..., 2 * hidden : 3 * hidden].tanh_()
            g[..., 3 * hidden :].sigmoid_()
            i, f, g_, o = g.chunk(4, -1)
            c = torch.mul(f, c, out=cells[s])
            c.addcmul_(i, g_)
            h = torch.mul(o, torch.tanh(c, out=tanh_c[s]), out=hs[s])
        saved = (gates, cells, tanh_c)
    elif mode == "GRU":
        gates = gi.new_empty(steps, n_, b_, gi.shape[-1])
        gh_all = gi.new_empty(steps, n_, b_, gi.shape[-1])  # W_hh h + (0, 0, b_hn)
        bias = _hidden_bias(b_hn)
        for s in range(steps):
            g_in, g, gh = gi[:, _time(s, steps, reverse)], gates[s], gh_all[s]
            torch.bmm(h, w_t, out=gh)
            gh_n = gh[..., 2 * hidden :]
            if bias is not None:
                gh_n.add_(bias)
            rz = torch.add(g_in[..., : 2 * hidden], gh[..., : 2 * hidden], out=g[..., : 2 * hidden])
            rz.sigmoid_()
            n = torch.mul(g[..., :hidden], gh_n, out=g[..., 2 * hidden :])
            n.add_(g_in[..., 2 * hidden :]).tanh_()
            h = torch.sub(h, n, out=hs[s]).mul_(g[..., hidden : 2 * hidden]).add_(n)
        saved = (gates, gh_all)
    else:
        for s in range(steps):
            h = torch.bmm(h, w_t, out=hs[s]).add_(gi[:, _time(s, steps, reverse)])
            h.tanh_() if mode == "RNN_TANH" else h.relu_()
    c_n = c.clone() if c is not None else None
    return hs, h.clone(), c_n, saved if keep else ()


def _backward(
    mode: str,
    grads: tuple[torch.Tensor, ...],
    inputs: tuple[Any, ...],
    hs: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    reverse: bool,
    needs: tuple[bool, ...],
) -> list[torch.Tensor | None]:
    """Backward through time; the gradients of ``(gi, h0, c0, w_hh, b_hn)``."""
    dhs, dh_n = grads[0], grads[1]
    gi, h0, c0, w_hh, b_hn = inputs
    hidden, steps = w_hh.shape[-1], gi.shape[1]
    one = gi.new_ones(())
    dgi = torch.empty_like(gi, memory_format=torch.contiguous_format)  # (N, T, B, G * H)
    dgh = dgi  # the gradient of W_hh h (+ b_hn): gi's but for GRU's n gate
    if mode == "GRU":
        dgh = torch.empty_like(dgi)
    dc = grads[2].clone() if mode == "LSTM" else None
    dh = dh_n + dhs[steps - 1]
    for s in range(steps - 1, -1, -1):
        x = dgi[:, _time(s, steps, reverse)]
        h_prev = hs[s - 1] if s else h0
        direct = None  # what reaches h_{s-1} other than through W_hh
        if mode == "LSTM":
            assert dc is not None
            i, f, g, o = saved[0][s].chunk(4, -1)
            tanh_c = saved[2][s]
            c_prev = saved[1][s - 1] if s else c0
            dc.addcmul_(dh * o, torch.addcmul(one, tanh_c, tanh_c, value=-1))
            torch.mul(dc, g, out=x[..., :hidden])
            torch.mul(dc, c_prev, out=x[..., hidden : 2 * hidden])
            torch.mul(dc, i, out=x[..., 2 * hidden : 3 * hidden])
            torch.mul(dh, tanh_c, out=x[..., 3 * hidden :])
            gates = saved[0][s]
            deriv = gates * (1 - gates)  # sigmoid's derivative
            torch.addcmul(one, g, g, value=-1, out=deriv[..., 2 * hidden : 3 * hidden])
            x.mul_(deriv)
            if s or needs[2]:
                dc.mul_(f)
        elif mode == "GRU":
            gates, gh = saved[0][s], saved[1][s]
            rz = gates[..., : 2 * hidden]
            r, z, n = gates.chunk(3, -1)
            y = dgh[:, _time(s, steps, reverse)]
            direct = dh * z  # h' = (h - n) * z + n
            x_n = torch.sub(dh, direct, out=x[..., 2 * hidden :])
            x_n.mul_(torch.addcmul(one, n, n, value=-1))
            torch.mul(x_n, r, out=y[..., 2 * hidden :])
            torch.mul(x_n, gh[..., 2 * hidden :], out=x[..., :hidden])
            torch.sub(h_prev, n, out=x[..., hidden : 2 * hidden]).mul_(dh)
            x[..., : 2 * hidden].mul_(rz * (1 - rz))
            y[..., : 2 * hidden].copy_(x[..., : 2 * hidden])
        elif mode == "RNN_TANH":
            h = hs[s]
            torch.mul(dh, torch.addcmul(one, h, h, value=-1), out=x)
        else:
            x.copy_(torch.ops.aten.threshold_backward(dh, hs[s], 0))
        if s:
            direct = dhs[s - 1] if direct is None else direct.add_(dhs[s - 1])
        if s or needs[1]:
            step = dgh[:, _time(s, steps, reverse)]
            dh = torch.bmm(step, w_hh) if direct is None else torch.baddbmm(direct, step, w_hh)

    d_w = d_b = None
    if needs[3] or (b_hn is not None and needs[4]):
        rows = dgh.flatten(1, 2)  # (N, T * B, G * H)
        if needs[3]:
            # The state each step started from, in gi's (t, b) order.
            before = torch.cat([h0.unsqueeze(0), hs[:-1]])
            if reverse:
                before = before.flip(0)
            d_w = torch.bmm(rows.transpose(1, 2), before.transpose(0, 1).flatten(1, 2))
        if b_hn is not None and needs[4]:
            d_b = rows[..., 2 * hidden :].sum(1)
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
        hs, h_n, c_n, saved = _forward(mode, gi, h0, c0, w_hh, b_hn, reverse, keep=True)
        ctx.mode, ctx.reverse = mode, reverse
        ctx.save_for_backward(gi, h0, c0, w_hh, b_hn, hs, *saved)
        return (hs, h_n, c_n) if mode == "LSTM" else (hs, h_n)

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
        ys = _steps(ctx.mode, *inputs, ctx.reverse)
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
    """``(hs, h_n)`` and LSTM's ``c_n``, by the fastest path that is exact here."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
        # torch.compile fuses the ordinary operations itself, and a torch.func transform
        # cannot see through the hand-written backward.
        return _steps(mode, gi, h0, c0, w_hh, b_hn, reverse)
    inputs = (gi, h0, c0, w_hh, b_hn)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _Recurrence.apply(mode, reverse, *inputs)
    hs, h_n, c_n, _ = _forward(mode, gi, h0, c0, w_hh, b_hn, reverse, keep=False)
    return (hs, h_n, c_n) if mode == "LSTM" else (hs, h_n)


# ------------------------------------------------------------------------------- the layer


def _project(seq: torch.Tensor, w_ih: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Every timestep's input projection: ``seq (T, N, B, in) -> (N, T, B, G * H)``."""
    steps, n, b, in_f = seq.shape
    rows = seq.transpose(0, 1).reshape(n, steps * b, in_f)
    w_t = w_ih.transpose(1, 2)
    y = torch.bmm(rows, w_t) if bias is None else torch.baddbmm(bias.unsqueeze(1), rows, w_t)
    return y.view(n, steps, b, -1)


class BatchedRecurrent(BatchedRNN):
    """nn.RNN (tanh, relu), nn.LSTM, nn.GRU: one recurrence for all members.

    Uni- and bidirectional, any number of layers, with or without biases, batch_first or
    not, with or without initial states. Anything else runs member by member
    (``BatchedRNN``).
    """

    def forward(self, x: Any, hx: Any = None) -> Any:
        reason = self.unbatched(x, hx)
        if reason is not None:
            return super().forward(x, hx)
        src, n = self.src, self.n
        mode = src.mode
        hidden, layers = src.hidden_size, src.num_layers
        dirs = 2 if src.bidirectional else 1
        b = x.shape[0 if src.batch_first else 1] // n
        # The sequence time-major, (T, N, B, in): a copy of x, small beside the activations.
        seq = x.transpose(0, 1) if src.batch_first else x
        seq = seq.unflatten(1, (n, b))
        if hx is None:
            h0 = x.new_zeros(layers * dirs, n, b, hidden)
            c0 = h0 if mode == "LSTM" else None
        elif mode == "LSTM":
            h0, c0 = (s.view(layers * dirs, n, b, hidden) for s in hx)
        else:
            h0, c0 = hx.view(layers * dirs, n, b, hidden), None
        h_n: list[torch.Tensor] = []
        c_n: list[torch.Tensor] = []
        for layer in range(layers):
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                gi, w_hh, b_hn = self._projected(seq, layer, d)
                got = _recurrence(
                    mode, gi, h0[k], None if c0 is None else c0[k], w_hh, b_hn, d == 1
                )
                outs.append(got[0].flip(0) if d == 1 else got[0])  # (T, N, B, H)
                h_n.append(got[1])
                if mode == "LSTM":
                    c_n.append(got[2])
            seq = outs[0] if dirs == 1 else torch.cat(outs, -1)
        out = seq.flatten(1, 2)  # (T, N * B, D * H)
        if src.batch_first:
            out = out.transpose(0, 1).contiguous()
        h = torch.stack(h_n).flatten(1, 2)
        return (out, (h, torch.stack(c_n).flatten(1, 2))) if mode == "LSTM" else (out, h)

    def _projected(
        self, seq: torch.Tensor, layer: int, direction: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """gi (the input projection with the biases outside the reset gate), W_hh, b_hn."""
        src = self.src
        name = f"l{layer}" + ("_reverse" if direction else "")
        w_ih = getattr(src, "weight_ih_" + name)  # (N, G * H, in)
        w_hh = getattr(src, "weight_hh_" + name)  # (N, G * H, H)
        bias = b_hn = None
        if src.bias:
            b_ih = getattr(src, "bias_ih_" + name)  # (N, G * H)
            b_hh = getattr(src, "bias_hh_" + name)  # (N, G * H)
            if src.mode == "GRU":
                two = 2 * src.hidden_size
                bias = torch.cat([b_ih[:, :two] + b_hh[:, :two], b_ih[:, two:]], 1)
                b_hn = b_hh[:, two:]
            else:
                bias = b_ih + b_hh
        return _project(seq, w_ih, bias), w_hh, b_hn

    def unbatched(self, x: Any, hx: Any) -> str | None:
        """Why this call runs member by member, or None when it runs batched."""
        src = self.src
        if not isinstance(x, torch.Tensor):
            return "a PackedSequence"
        bdim, tdim = (0, 1) if src.batch_first else (1, 0)
        if x.dim() != 3 or x.shape[bdim] not in fold_sizes() or x.shape[tdim] == 0:
            return "an input without a folded batch, or an empty sequence"
        if src.mode not in _GATES or getattr(src, "proj_size", 0) > 0:
            return f"mode {src.mode} with proj_size {getattr(src, 'proj_size', 0)}"
        if src.training and src.dropout > 0 and src.num_layers > 1:
            return "dropout between layers in training"
        if torch.is_autocast_enabled(x.device.type):
            return "autocast"
        params = list(src.parameters())
        if x.dtype not in _DTYPES or any(
            p.dtype != x.dtype or p.device != x.device for p in params
        ):
            return "a dtype other than float32 and float64, or mixed dtypes or devices"
        states = [] if hx is None else list(hx) if src.mode == "LSTM" else [hx]
        expected = (
            src.num_layers * (2 if src.bidirectional else 1),
            x.shape[bdim],
            src.hidden_size,
        )
        if src.mode == "LSTM" and hx is not None and len(states) != 2:
            return "LSTM states that are not a pair"
        for s in states:
            if not isinstance(s, torch.Tensor) or tuple(s.shape) != expected or s.dtype != x.dtype:
                return "initial states of another shape or dtype"
        return None
