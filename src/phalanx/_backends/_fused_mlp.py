"""The fused backend's fast path for MLPs: a ``Sequential`` of Linear layers and activations.

Small MLPs are launch-bound: layer by layer, autograd records about a dozen nodes per layer
(views, transposes, the bias broadcast, the activation) and runs each as its own kernel. Here
the whole chain is one autograd node with a hand-written backward: per layer one batched GEMM
with the bias folded in and the activation applied in place on its output forward; and
backward, one GEMM for the weight gradient, one for the input gradient and one reduction for
the bias. With a shared input the first layer is one GEMM against every member's weights
concatenated along the output dimension, and its input gradient one GEMM that sums over the
members.

Under ``torch.no_grad`` the members are processed in chunks whose activations fit in cache,
which the loop over members gets for free and one huge batched call does not.

Second derivatives are exact: when the backward itself is differentiated (``create_graph=True``:
gradient penalties, Hessian-vector products, MAML inner steps), the backward recomputes the
chain with ordinary differentiable operations from the saved inputs and differentiates that,
so the returned gradients carry their graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx._backends import BackendRefusal
from phalanx._backends._bmm import linear_ops
from phalanx._backends._fused_layers import (
    Batched,
    BatchedLinear,
    broadcast,
    folding,
    has_hooks,
    is_folded,
)

_ACTIVATIONS = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.LeakyReLU)
_CHUNK_BYTES = 1 << 20  # activations per chunk under no_grad: about an L2 cache


def mlp_layers(seq: nn.Module) -> list[nn.Module] | None:
    """The layers of ``seq`` when it is a plain Sequential MLP the fast path runs, else None."""
    if type(seq) is not nn.Sequential or any(has_hooks(m) for m in seq.modules()):
        return None
    layers = list(seq)
    if not layers or not any(type(m) is nn.Linear for m in layers):
        return None
    for m in layers:
        if type(m) is nn.Linear:
            continue
        if type(m) not in _ACTIVATIONS:
            return None
        if isinstance(m, nn.LeakyReLU) and m.negative_slope < 0:
            return None  # the gradient is read off the output's sign
    return layers


def _activate(h: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    """The activation, out of place: what autograd differentiates twice."""
    if kind == "ReLU":
        return F.relu(h)
    if kind == "Tanh":
        return torch.tanh(h)
    if kind == "Sigmoid":
        return torch.sigmoid(h)
    if kind == "LeakyReLU":
        return F.leaky_relu(h, slope)
    return h


def _differentiable(h: torch.Tensor, shared: bool, spec: tuple, params: tuple) -> torch.Tensor:
    """The chain with ordinary autograd operations, for second derivatives."""
    k = 0
    for kind, slope in spec:
        if kind == "Linear":
            h = _linear(h, params[k], params[k + 1], shared and k == 0)
            k += 2
        else:
            h = _activate(h, kind, slope)
    return h


def _activate_(h: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    if kind == "ReLU":
        return h.relu_()
    if kind == "Tanh":
        return h.tanh_()
    if kind == "Sigmoid":
        return h.sigmoid_()
    if kind == "LeakyReLU":
        return F.leaky_relu_(h, slope)
    return h


def _activation_grad(g: torch.Tensor, out: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    """The gradient through an activation, from its output (which is all that is kept)."""
    if kind == "ReLU":
        return torch.ops.aten.threshold_backward(g, out, 0)
    if kind == "Tanh":
        return g * (1 - out * out)
    if kind == "Sigmoid":
        return g * out * (1 - out)
    if kind == "LeakyReLU":
        return torch.where(out > 0, g, g * slope)
    return g


def _linear(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, shared: bool) -> torch.Tensor:
    """One Linear for all members: h (N, M, in) or, shared, (M, in) -> (N, M, out)."""
    n, out_f, in_f = w.shape
    if shared:
        flat_b = None if b is None else b.reshape(-1)
        y = F.linear(h, w.reshape(n * out_f, in_f), flat_b)  # (M, N * out)
        return y.view(h.shape[0], n, out_f).transpose(0, 1)
    return linear_ops(h, w, b)


def _forward(
    h: torch.Tensor, shared: bool, spec: tuple, params: tuple, keep: list | None = None
) -> torch.Tensor:
    """The chain without autograd: activations in place on each Linear's fresh output.

    With ``keep``, every Linear's output is appended to it; as the activations that follow
    work in place, each kept tensor ends up holding its layer's activated output.
    """
    k = 0
    for kind, slope in spec:
        if kind == "Linear":
            h = _linear(h, params[k], params[k + 1], shared and k == 0)
            k += 2
            if keep is not None:
                keep.append(h)
        else:
            h = _activate_(h, kind, slope)
    return h


class _MLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shared: bool, spec: tuple, *params: torch.Tensor):
        outs: list[torch.Tensor] = []  # each layer's output, after its activations
        h = _forward(x, shared, spec, params, keep=outs)
        ctx.shared, ctx.spec = shared, spec
        ctx.has_bias = [params[i + 1] is not None for i in range(0, len(params), 2)]
        ctx.save_for_backward(x, *outs, *params)
        return h

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        spec, shared = ctx.spec, ctx.shared
        saved = ctx.saved_tensors
        n_lin = len(ctx.has_bias)
        outs, params = saved[1 : n_lin + 1], saved[n_lin + 1 :]
        if torch.is_grad_enabled():
            return tuple(_double_differentiable(ctx, grad, saved[0], params))
        weights = params[::2]
        inputs = (saved[0], *outs[:-1])  # a layer's input is the previous layer's output
        # Group the spec by Linear: each Linear with the activations that follow it.
        acts: list[list[tuple[str, float]]] = []
        for kind, slope in spec:
            if kind == "Linear":
                acts.append([])
            elif acts:
                acts[-1].append((kind, slope))
        grads: list[torch.Tensor | None] = [None] * (2 * n_lin)
        g = grad
        grad_x = None
        for layer in reversed(range(n_lin)):
            for kind, slope in reversed(acts[layer]):
                g = _activation_grad(g, outs[layer], kind, slope)
            a, w = inputs[layer], weights[layer]
            n, out_f, in_f = w.shape
            if ctx.has_bias[layer] and ctx.needs_input_grad[3 + 2 * layer + 1]:
                grads[2 * layer + 1] = g.sum(1)
            first_shared = shared and layer == 0
            if ctx.needs_input_grad[3 + 2 * layer]:
                if first_shared:
                    grads[2 * layer] = torch.bmm(g.transpose(1, 2), a.expand(n, *a.shape))
                else:
                    grads[2 * layer] = torch.bmm(g.transpose(1, 2), a)
            if layer > 0 or ctx.needs_input_grad[0]:
                if first_shared:
                    flat = g.transpose(0, 1).reshape(g.shape[1], n * out_f)  # (M, N * out)
                    g = flat @ w.reshape(n * out_f, in_f)  # sums over the members
                else:
                    g = torch.bmm(g, w)
                if layer == 0:
                    grad_x = g
        # Leading activations (before the first Linear) are not part of the fast path.
        return (grad_x, None, None, *grads)


def _double_differentiable(ctx: Any, grad: torch.Tensor, x: torch.Tensor, params: tuple) -> list:
    """The backward under ``create_graph=True``: recompute with autograd, differentiate that."""
    inputs = [x, *params]
    needs = [ctx.needs_input_grad[0], *ctx.needs_input_grad[3:]]
    wanted = [i for i, t in enumerate(inputs) if t is not None and needs[i]]
    with torch.enable_grad():
        y = _differentiable(x, ctx.shared, ctx.spec, params)
        got = torch.autograd.grad(
            y, [inputs[i] for i in wanted], grad, create_graph=True, allow_unused=True
        )
    grads: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, got):
        grads[i] = g
    return [grads[0], None, None, *grads[1:]]


class BatchedMLP(Batched):
    """A whole ``Sequential`` MLP for all members as one autograd node."""

    layers: list[nn.Module]
    linears: list[nn.Module]
    per_layer: list[nn.Module]

    def __init__(self, src: nn.Module, n: int) -> None:
        super().__init__(src, n)
        layers = mlp_layers(src)
        if layers is None:
            raise BackendRefusal(f"{type(src).__name__} is not a plain MLP")
        self.layers = layers
        self.spec = tuple(
            (type(m).__name__, float(getattr(m, "negative_slope", 0.0))) for m in layers
        )
        self.lead = 0  # activations before the first Linear run as ordinary ops
        while self.spec[self.lead][0] != "Linear":
            self.lead += 1
        object.__setattr__(self, "linears", [m for m in layers if type(m) is nn.Linear])
        # Under autocast the hand-written backward would meet tensors of two dtypes: run the
        # layers one by one there, as batched layers that autocast sees op by op.
        self.per_layer = [BatchedLinear(m, n) if type(m) is nn.Linear else m for m in layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A folded input ``(N * B, ..., in)`` -> ``(N * B, ..., out)``."""
        if not is_folded(x):
            return broadcast(self.forward_shared(x))
        n = self.n
        if torch.is_autocast_enabled(x.device.type):
            for m in self.per_layer:
                x = m(x)
            return x
        for m in self.layers[: self.lead]:
            x = m(x)
        y = self._chain(x.reshape(n, -1, x.shape[-1]), shared=False)
        return y.view(*x.shape[:-1], y.shape[-1])

    def forward_shared(self, x: torch.Tensor) -> torch.Tensor:
        """A shared input ``(B, ..., in)`` -> ``(N, B, ..., out)``: the first layer is one GEMM."""
        n = self.n
        for m in self.layers[: self.lead]:
            x = m(x)
        if torch.is_autocast_enabled(x.device.type):
            first, *rest = self.per_layer[self.lead :]
            y = first.forward_shared(x).flatten(0, 1)  # type: ignore[operator]
            with folding(n, [x.shape[0]]):
                for m in rest:
                    y = m(y)
            return y.view(n, *x.shape[:-1], y.shape[-1])
        y = self._chain(x.reshape(-1, x.shape[-1]), shared=True)
        return y.view(n, *x.shape[:-1], y.shape[-1])

    def _chain(self, h: torch.Tensor, shared: bool) -> torch.Tensor:
        spec = self.spec[self.lead :]
        params: list[Any] = []
        for m in self.linears:
            params += [m.weight, m.bias]
        if torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in params)):
            return _MLPFunction.apply(h, shared, spec, *params)
        return self._no_grad(h, shared, spec, params)

    def _no_grad(self, h: torch.Tensor, shared: bool, spec: tuple, params: list) -> torch.Tensor:
        """Forward in member chunks whose activations stay in cache."""
        n = self.n
        widest = max(p.shape[1] for p in params[::2])
        rows = h.shape[-2]
        chunk = max(1, min(n, _CHUNK_BYTES // max(1, rows * widest * h.element_size())))
        if chunk >= n:
            return _forward(h, shared, spec, tuple(params))
        outs = []
        for start in range(0, n, chunk):
            part = tuple(None if p is None else p[start : start + chunk] for p in params)
            xs = h if shared else h[start : start + chunk]
            outs.append(_forward(xs, shared, spec, part))
        return torch.cat(outs)
