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

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx import _torch_compat as compat
from phalanx.backends._bmm import linear_ops, linear_shared

if TYPE_CHECKING:
    from phalanx.backends import StackView

_ACTIVATIONS = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.LeakyReLU)
_CHUNK_BYTES = 1 << 20  # activations per chunk under no_grad: about a CPU core's L2 cache


def mlp_layers(seq: nn.Module) -> list[nn.Module] | None:
    """The layers of ``seq`` when it is a plain Sequential MLP the fast path runs, else None."""
    if type(seq) is not nn.Sequential or any(compat.has_hooks(m) for m in seq.modules()):
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
    if shared:
        return linear_shared(h, w, b).transpose(0, 1)  # (M, N, out) -> (N, M, out)
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
    def forward(ctx: Any, x: torch.Tensor, shared: bool, spec: tuple, *params: torch.Tensor) -> Any:
        outs: list[torch.Tensor] = []  # each layer's output, after its activations
        h = _forward(x, shared, spec, params, keep=outs)
        ctx.shared, ctx.spec = shared, spec
        ctx.has_bias = [params[i + 1] is not None for i in range(0, len(params), 2)]
        ctx.save_for_backward(x, *outs, *params)
        return h

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
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


def run_mlp(view: StackView, x: torch.Tensor, shared: bool) -> torch.Tensor | None:
    """The whole member as one autograd node when it is a plain MLP, else None.

    ``x`` is ``(B, ..., in)`` when ``shared``, else ``(N, B, ..., in)``; the result is
    ``(N, B, ..., out)``. The stack's own modules are read on every call (a hook or an
    activation's setting changed since the last call is seen), and anything the node does not
    reproduce exactly leaves it to the vmap path: hooks, autocast (the hand-written backward
    would meet two dtypes), forward-mode AD and torch.func transforms around the stack.
    """
    layers = mlp_layers(view.module)
    if (
        layers is None
        or compat.global_module_hooks()
        or compat.transforms_active()
        or torch.is_autocast_enabled(x.device.type)
        or x.dim() < (1 if shared else 2)
    ):
        return None
    n = view.num_members
    spec = tuple((type(m).__name__, float(getattr(m, "negative_slope", 0.0))) for m in layers)
    lead = 0  # activations before the first Linear run as ordinary ops
    while spec[lead][0] != "Linear":
        x = layers[lead](x)
        lead += 1
    state = view.state()[0]  # by name: a view of some members holds only theirs
    params: list[Any] = []
    for i, m in enumerate(layers):
        if type(m) is nn.Linear:
            if f"{i}.weight" not in state or (m.bias is not None) != (f"{i}.bias" in state):
                return None  # a weight tied to another layer's: the vmap path keeps the tie
            params += [state[f"{i}.weight"], state.get(f"{i}.bias")]
    if compat.has_tangents([x, *(p for p in params if p is not None)]):
        return None
    batch = x.shape[:-1] if shared else x.shape[1:-1]
    h = x.reshape(-1, x.shape[-1]) if shared else x.reshape(n, -1, x.shape[-1])
    spec = spec[lead:]
    if torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in params)):
        y = _MLPFunction.apply(h, shared, spec, *params)
    else:
        y = _no_grad(n, h, shared, spec, params)
    return y.view(n, *batch, y.shape[-1])


def _no_grad(n: int, h: torch.Tensor, shared: bool, spec: tuple, params: list) -> torch.Tensor:
    """Forward in member chunks whose activations stay in cache (on the CPU).

    On other devices one chunk: each chunk costs a kernel launch per layer, and a GPU's
    caches are not what the chunks are sized for (unmeasured on a GPU).
    """
    widest = max(p.shape[1] for p in params[::2])
    rows = h.shape[-2]
    chunk = max(1, min(n, _CHUNK_BYTES // max(1, rows * widest * h.element_size())))
    if h.device.type != "cpu":
        chunk = n
    if chunk >= n:
        return _forward(h, shared, spec, tuple(params))
    outs = []
    for start in range(0, n, chunk):
        part = tuple(None if p is None else p[start : start + chunk] for p in params)
        xs = h if shared else h[start : start + chunk]
        outs.append(_forward(xs, shared, spec, part))
    return torch.cat(outs)
