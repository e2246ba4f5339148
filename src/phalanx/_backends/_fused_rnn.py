"""Batched nn.RNN, nn.LSTM and nn.GRU for the fused backend: all N members in one recurrence.

Per layer and direction, the input projection of every timestep of every member is one
batched GEMM ``(N, G * H, in) x (N, in, T * B)``, with the biases folded in; then each
timestep is one batched GEMM of the hidden state ``(N, G * H, H) x (N, H, B)`` and the gate
arithmetic of torch's own cells (``aten/src/ATen/native/RNN.cpp``), elementwise over
``(N, G * H, B)``. Member by member, torch runs the same operations on tensors N times
smaller; at the sizes of small forecasters their cost is mostly per operation, so one
recurrence for all members saves most of it.

The recurrence is one autograd node with a hand-written backward through time: per step a
dozen elementwise operations and two batched GEMMs (the hidden state's gradient and the
accumulated ``W_hh`` gradient), on contiguous blocks.

Second derivatives are exact: when the backward itself is differentiated
(``create_graph=True``), it recomputes the recurrence with ordinary operations from the
saved inputs and differentiates that (as ``_fused_mlp`` does). Under torch.compile or a
torch.func transform the ordinary operations run directly.

torch's own LSTM on CPU is oneDNN's fused kernel, which the batched LSTM does not always
beat (the elementwise arithmetic is a dozen passes over memory here, one there): each layer
times both paths once per input shape and grad mode and keeps the faster.

What is not batched (a PackedSequence, ``proj_size > 0``, an unbatched 2-D input, dropout
between layers in training, dtypes other than float32 and float64, autocast, an empty
sequence, initial states of another shape) runs member by member through ``BatchedRNN``,
with torch's own kernels.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from phalanx._backends._fused_layers import BatchedRNN, _pick, fold_sizes

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


def _transformed() -> bool:
    """True under a torch.func transform (vmap, grad), which custom Functions need rules for."""
    return torch._C._functorch.peek_interpreter_stack() is not None


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
    if torch.compiler.is_compiling() or _transformed():
        # torch.compile fuses the ordinary operations itself, and a torch.func transform
        # cannot see through the hand-written backward.
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


class BatchedRecurrent(BatchedRNN):
    """nn.RNN (tanh, relu), nn.LSTM, nn.GRU: one recurrence for all members.

    Uni- and bidirectional, any number of layers, with or without biases, batch_first or
    not, with or without initial states. Anything else runs member by member
    (``BatchedRNN``).
    """

    def __init__(self, src: torch.nn.Module, n: int) -> None:
        super().__init__(src, n)
        self.paths: dict[tuple, str] = {}  # input case -> the faster path

    def forward(self, x: Any, hx: Any = None) -> Any:
        if self.unbatched(x, hx) is not None or self.choose(x, hx) == "per_member":
            return super().forward(x, hx)
        return self.batched(x, hx)

    def choose(self, x: torch.Tensor, hx: Any) -> str:
        """The path for this call, "batched" or "per_member": whichever ran its shapes
        faster (forward and backward where grad is enabled), timed once and cached, as the
        batched convolutions choose their strategy (``_pick``)."""
        if self.n == 1 or _transformed():
            return "batched"
        key = (tuple(x.shape), torch.is_grad_enabled(), hx is None, x.dtype, x.device.type)
        paths = {
            "batched": partial(self.batched, x, hx),
            "per_member": partial(BatchedRNN.forward, self, x, hx),
        }
        return _pick(self.paths, key, paths, list(self.src.parameters()))

    def batched(self, x: torch.Tensor, hx: Any = None) -> Any:
        """All members in one recurrence per layer and direction."""
        src, n = self.src, self.n
        mode = src.mode
        hidden, layers = src.hidden_size, src.num_layers
        dirs = 2 if src.bidirectional else 1
        b = x.shape[0 if src.batch_first else 1] // n
        # (T, N, in, B); the projection copies it, small beside the gates.
        if src.batch_first:
            seq = x.unflatten(0, (n, b)).permute(2, 0, 3, 1)
        else:
            seq = x.unflatten(1, (n, b)).permute(0, 1, 3, 2)
        if hx is None:
            h0 = x.new_zeros(layers * dirs, n, hidden, b)
            c0 = h0 if mode == "LSTM" else None
        else:  # (L * D, N * B, H) -> (L * D, N, H, B), a view
            states = hx if mode == "LSTM" else (hx,)
            h0, *rest = (t.unflatten(1, (n, b)).transpose(2, 3) for t in states)
            c0 = rest[0] if rest else None
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
                outs.append(got[0])  # (T, N, H, B)
                h_n.append(got[1])
                if mode == "LSTM":
                    c_n.append(got[2])
            seq = outs[0] if dirs == 1 else torch.cat(outs, 2)
        if src.batch_first:  # (N * B, T, D * H)
            out = seq.permute(1, 3, 0, 2).reshape(n * b, -1, seq.shape[2])
        else:  # (T, N * B, D * H)
            out = seq.transpose(2, 3).reshape(-1, n * b, seq.shape[2])

        def fold(states: list[torch.Tensor]) -> torch.Tensor:  # (L * D, N * B, H)
            return torch.stack(states).transpose(2, 3).reshape(len(states), n * b, hidden)

        return (out, (fold(h_n), fold(c_n))) if mode == "LSTM" else (out, fold(h_n))

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
