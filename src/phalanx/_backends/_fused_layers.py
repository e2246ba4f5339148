"""Batched layers of the fused backend: each runs one layer of all N members in one call.

The fused backend runs the member's own ``forward`` on a *folded* batch: every tensor that
carries the batch has shape ``(N * B, ...)``, member i's samples in rows ``i * B .. i * B + B``.
Per-sample code (``x.flatten(1)``, ``x.view(x.size(0), -1)``, ``torch.cat([s, a], 1)``,
``F.max_pool2d``, attention's ``view(B, T, heads, d)``) is then correct as written, and only
the layers that hold stacked tensors are swapped for the classes below, which unfold
``(N * B, ...)`` to ``(N, B, ...)`` (a view) and run all members in one batched call.

A batched layer reads the stacked tensors of the stack's own submodule at call time (so
``.to()``, ``load_state_dict`` and optimizer steps are seen at once) and never owns weights.
A tensor created inside the forward that does not carry the batch (nanoGPT's positions
``arange(T)``) is shared by the members: a layer's per-member result on it is broadcast over
each member's batch, as the member's own broadcasting would. Anything else a forward does
across the batch is caught by the fused backend's check against the reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap
from torch.utils import _pytree as pytree

from phalanx._backends import BackendRefusal
from phalanx._backends._bmm import linear_bmm
from phalanx._backends._preserve import seconds

# The folding of the call under way: N and the batch sizes of the inputs (a stack of them,
# should a forward call another stack).
_folds: list[tuple[int, frozenset[int], int]] = []


@contextlib.contextmanager
def folding(n: int, batches: list[int]) -> Iterator[None]:
    """Tells the batched layers that tensors with ``N * b`` rows (b in ``batches``) are folded."""
    _folds.append((n, frozenset(n * b for b in batches), batches[0] if batches else 1))
    try:
        yield
    finally:
        _folds.pop()


def fold_sizes() -> frozenset[int]:
    """The sizes ``N * B`` of the folded batches of the call under way."""
    return _folds[-1][1] if _folds else frozenset()


def is_folded(x: torch.Tensor) -> bool:
    """True when ``x`` carries the folded batch ``(N * B, ...)``."""
    return bool(_folds) and x.dim() > 0 and x.shape[0] in _folds[-1][1]


def unfold(x: torch.Tensor, n: int) -> torch.Tensor:
    """``(N * B, ...)`` -> ``(N, B, ...)``, a view when possible."""
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


def broadcast(y: torch.Tensor) -> torch.Tensor:
    """Per-member results ``(N, *s)`` of a shared tensor, broadcast over each member's batch.

    Returns ``(N * B, *s)``: what member code gets when it adds a ``(s)`` tensor to its
    ``(B, *s)`` activations.
    """
    b = _folds[-1][2] if _folds else 1
    return y.unsqueeze(1).expand(y.shape[0], b, *y.shape[1:]).reshape(-1, *y.shape[1:])


class Batched(nn.Module):
    """Base class: holds the stack's submodule ``src`` (not registered) and N."""

    src: Any  # the stack's own layer, holding the stacked tensors (N, *shape)

    def __init__(self, src: nn.Module, n: int) -> None:
        super().__init__()
        object.__setattr__(self, "src", src)
        self.n = n

    def extra_repr(self) -> str:
        return f"{type(self.src).__name__}, members={self.n}"


def _member_view(t: torch.Tensor | None, n: int, ndim: int, dim: int = 1) -> torch.Tensor | None:
    """A stacked ``(N, C)`` tensor viewed to broadcast against ``(N, B, C, *sp)`` at ``dim``."""
    if t is None:
        return None
    shape = [n] + [1] * (ndim - 1)
    shape[dim + 1] = t.shape[1]
    return t.reshape(shape)


# ------------------------------------------------------------------------------------- linear


class BatchedLinear(Batched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.src.weight, self.src.bias  # (N, out, in), (N, out)
        n, out_f, in_f = w.shape
        if not is_folded(x):
            return broadcast(self.forward_shared(x))
        y = linear_bmm(x.reshape(n, -1, in_f), w, b)
        return y.view(*x.shape[:-1], out_f)

    def forward_shared(self, x: torch.Tensor) -> torch.Tensor:
        """A shared input ``(*, in)`` -> ``(N, *, out)``: one GEMM against every member."""
        w, b = self.src.weight, self.src.bias
        n, out_f, in_f = w.shape
        y = F.linear(x, w.reshape(n * out_f, in_f), None if b is None else b.reshape(-1))
        return y.unflatten(-1, (n, out_f)).movedim(-2, 0)


class BatchedBilinear(Batched):
    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        if not (is_folded(x1) and is_folded(x2)):
            raise BackendRefusal("Bilinear on inputs that do not carry the batch")
        w, b = self.src.weight, self.src.bias  # (N, out, in1, in2), (N, out)
        n = w.shape[0]
        a = x1.reshape(n, -1, x1.shape[-1])
        c = x2.reshape(n, -1, x2.shape[-1])
        y = torch.einsum("nbi,noij,nbj->nbo", a, w, c)
        if b is not None:
            y = y + b.unsqueeze(1)
        return y.view(*x1.shape[:-1], w.shape[1])


class BatchedEmbedding(Batched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src = self.src
        if src.max_norm is not None:
            raise BackendRefusal("Embedding with max_norm renormalises weights in place")
        w = src.weight  # (N, V, D)
        n, v, d = w.shape
        folded = is_folded(x)
        idx = unfold(x, n) if folded else x.expand(n, *x.shape)
        offsets = torch.arange(n, device=x.device).mul_(v).view(n, *([1] * (idx.dim() - 1)))
        y = F.embedding(
            idx + offsets, w.reshape(n * v, d), scale_grad_by_freq=src.scale_grad_by_freq
        )
        if src.padding_idx is not None:
            # Rows at padding_idx take no gradient, as in nn.Embedding.
            y = torch.where((idx == src.padding_idx).unsqueeze(-1), y.detach(), y)
        return y.reshape(*x.shape, d) if folded else broadcast(y)


class BatchedEmbeddingBag(Batched):
    """EmbeddingBag on 2-D input ``(N * B, L)``, or 1-D input with offsets (one bag list each)."""

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        src = self.src
        if src.max_norm is not None:
            raise BackendRefusal("EmbeddingBag with max_norm renormalises weights in place")
        w = src.weight  # (N, V, D)
        n, v, d = w.shape
        if x.dim() == 2 and offsets is None and is_folded(x):
            idx = unfold(x, n) + torch.arange(n, device=x.device).mul_(v).view(n, 1, 1)
            flat_idx, flat_offsets = idx.reshape(-1, x.shape[1]), None
        elif x.dim() == 1 and offsets is not None and x.shape[0] % n == 0 and is_folded(offsets):
            length = x.shape[0] // n
            idx = x.view(n, length) + torch.arange(n, device=x.device).mul_(v).view(n, 1)
            starts = torch.arange(n, device=x.device).mul_(length).view(n, 1)
            flat_idx = idx.reshape(-1)
            flat_offsets = (unfold(offsets, n) + starts).reshape(-1)
            if src.include_last_offset:
                raise BackendRefusal("EmbeddingBag with include_last_offset=True")
        else:
            raise BackendRefusal("EmbeddingBag on an input that does not carry the batch")
        return F.embedding_bag(
            flat_idx,
            w.reshape(n * v, d),
            flat_offsets,
            scale_grad_by_freq=src.scale_grad_by_freq,
            mode=src.mode,
            sparse=src.sparse,
            per_sample_weights=per_sample_weights,
            padding_idx=None if src.padding_idx is None else src.padding_idx,
        )


# ------------------------------------------------------------------------------- convolutions


def _pick(
    cache: dict[tuple, str],
    key: tuple,
    strategies: Mapping[str, Callable[[], Any]],
    leaves: list[torch.Tensor],
) -> str:
    """The name of the fastest of ``strategies`` (equal results, different kernels) for ``key``.

    As cuDNN's benchmark mode does, the choice is measured once per input case and kept in
    the layer's own ``cache`` (keyed by the layer object, not by an ``id`` that a later layer
    may reuse). Each strategy is timed best of 3; when gradients will be taken (grad mode on
    and one of ``leaves`` requires grad) the backward to ``leaves`` is timed too, without
    touching any ``.grad``: on a CPU a grouped convolution can win the forward and lose the
    step. Under compilation, or with one strategy, the first is taken untimed.
    """
    choice = cache.get(key)
    if choice is None:
        if len(strategies) == 1 or torch.compiler.is_compiling():
            choice = next(iter(strategies))
        else:
            device = torch.device(key[-1])
            wrt = [t for t in leaves if t.requires_grad] if torch.is_grad_enabled() else []

            def step(run: Callable[[], Any]) -> Callable[[], Any]:
                def go() -> None:
                    out = [t for t in pytree.tree_leaves(run()) if isinstance(t, torch.Tensor)]
                    total = [t.sum() for t in out if t.requires_grad]
                    if wrt and total:
                        torch.autograd.grad(total, wrt, allow_unused=True)

                return go

            timings = {k: seconds(step(run), device, repeats=3) for k, run in strategies.items()}
            choice = min(timings, key=timings.__getitem__)
        cache[key] = choice
    return choice


def _autotune(
    cache: dict[tuple, str],
    key: tuple,
    strategies: dict[str, Callable[[], torch.Tensor]],
    leaves: list[torch.Tensor],
) -> torch.Tensor:
    """Runs the fastest of ``strategies`` for ``key`` (:func:`_pick`)."""
    return strategies[_pick(cache, key, strategies, leaves)]()


def to_channels(x: torch.Tensor, n: int) -> torch.Tensor:
    """``(N * B, C, *sp)`` -> ``(B, N * C, *sp)``: members side by side as channels."""
    xs = unfold(x, n)
    return xs.transpose(0, 1).reshape(xs.shape[1], n * xs.shape[2], *xs.shape[3:])


def from_channels(y: torch.Tensor, n: int) -> torch.Tensor:
    """``(B, N * C, *sp)`` -> ``(N * B, C, *sp)``."""
    return y.unflatten(1, (n, -1)).transpose(0, 1).reshape(-1, y.shape[1] // n, *y.shape[2:])


class BatchedConv(Batched):
    """Conv1d/2d/3d: one grouped convolution over N * C channels, or one call per member."""

    def __init__(self, src: nn.Module, n: int, dims: int) -> None:
        super().__init__(src, n)
        self.dims = dims
        self.conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
        self._strategies: dict[tuple, str] = {}  # input case -> the faster strategy

    def _pad(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        src = self.src
        if src.padding_mode != "zeros":
            return F.pad(x, src._reversed_padding_repeated_twice, mode=src.padding_mode), 0
        return x, src.padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, n = self.src, self.n
        if not is_folded(x) or x.dim() != self.dims + 2:
            raise BackendRefusal(f"{type(src).__name__} on an input without a batch dimension")
        w, b = src.weight, src.bias  # (N, out, in / groups, *k), (N, out)

        def grouped() -> torch.Tensor:
            inp, pad = self._pad(to_channels(x, n))
            bias = None if b is None else b.flatten()
            y = self.conv(inp, w.flatten(0, 1), bias, src.stride, pad, src.dilation, src.groups * n)
            return from_channels(y, n)

        def per_member() -> torch.Tensor:
            # unbind, not indexing: the backward of x[i] writes a full-size zero tensor per member
            xs, ws = unfold(x, n).unbind(0), w.unbind(0)
            bs = [None] * n if b is None else b.unbind(0)
            outs = []
            for i in range(n):
                xi, pad = self._pad(xs[i])
                outs.append(self.conv(xi, ws[i], bs[i], src.stride, pad, src.dilation, src.groups))
            return torch.cat(outs)

        # Not channels-last: oneDNN's grouped kernels are up to 2x faster so (LeNet's 3->6 and
        # 6->16), but their backward rounds differently enough that ResNet's BatchNorm statistics
        # after three Adam steps drifted up to 12x further from the float64 loop than the
        # float32 loop's, depending on which layers the timing gave it to.
        strategies = {"grouped": grouped, "per_member": per_member}
        key = (tuple(x.shape), torch.is_grad_enabled(), x.dtype, x.device.type)
        return _autotune(self._strategies, key, strategies, [x, w] if b is None else [x, w, b])


class BatchedConvTranspose(Batched):
    def __init__(self, src: nn.Module, n: int, dims: int) -> None:
        super().__init__(src, n)
        self.conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[dims]

    def forward(self, x: torch.Tensor, output_size: Any = None) -> torch.Tensor:
        src, n = self.src, self.n
        if src.padding_mode != "zeros" or output_size is not None:
            raise BackendRefusal("ConvTranspose supports only zero padding and no output_size")
        if not is_folded(x):
            raise BackendRefusal(f"{type(src).__name__} on an input without a batch dimension")
        w, b = src.weight, src.bias  # (N, in, out / groups, *k)
        y = self.conv(
            to_channels(x, n),
            w.flatten(0, 1),
            None if b is None else b.flatten(),
            src.stride,
            src.padding,
            src.output_padding,
            src.groups * n,
            src.dilation,
        )
        return from_channels(y, n)


# -------------------------------------------------------------------------------- normalisation


class BatchedBatchNorm(Batched):
    """BatchNorm1d/2d/3d: one call over N * C channels with per-member running statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, n = self.src, self.n
        if not is_folded(x) or x.dim() < 2:
            raise BackendRefusal("BatchNorm on an input without a batch dimension")
        use_batch_stats = src.training or not src.track_running_stats
        factor = 0.0
        if src.training and src.track_running_stats:
            if src.momentum is None:
                raise BackendRefusal("BatchNorm with momentum=None (a cumulative average)")
            src.num_batches_tracked.add_(1)
            factor = src.momentum
        mean, var = src.running_mean, src.running_var
        w, b = src.weight, src.bias
        y = F.batch_norm(
            to_channels(x, n),
            None if mean is None else mean.view(-1),
            None if var is None else var.view(-1),
            None if w is None else w.reshape(-1),
            None if b is None else b.reshape(-1),
            use_batch_stats,
            factor,
            src.eps,
        )
        return from_channels(y, n)


class BatchedGroupNorm(Batched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, n = self.src, self.n
        if not is_folded(x):
            raise BackendRefusal("GroupNorm on an input without a batch dimension")
        y = unfold(F.group_norm(x, src.num_groups, None, None, src.eps), n)
        weight, bias = _member_view(src.weight, n, y.dim()), _member_view(src.bias, n, y.dim())
        if weight is not None and bias is not None:
            y = y * weight + bias
        return y.reshape(x.shape)


class BatchedLayerNorm(Batched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, n = self.src, self.n
        shape = tuple(src.normalized_shape)
        y = F.layer_norm(x, shape, None, None, src.eps)
        if src.weight is None and getattr(src, "bias", None) is None:
            return y
        folded = is_folded(x)
        ys = unfold(y, n) if folded else y.expand(n, *y.shape)
        view = (n,) + (1,) * (ys.dim() - 1 - len(shape)) + shape
        if src.weight is not None:
            ys = ys * src.weight.view(view)
        if getattr(src, "bias", None) is not None:
            ys = ys + src.bias.view(view)
        return ys.reshape(x.shape) if folded else broadcast(ys)


class BatchedPReLU(Batched):
    """PReLU: one slope per member, or one per channel (dim 1 of the member's input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_folded(x):
            raise BackendRefusal("PReLU on an input without a batch dimension")
        w = self.src.weight  # (N, num_parameters)
        n, k = w.shape
        xs = unfold(x, n)
        if k == 1:
            slope = w.view(n, *([1] * (xs.dim() - 1)))
        elif xs.dim() >= 3 and xs.shape[2] == k:
            slope = w.view(n, 1, k, *([1] * (xs.dim() - 3)))
        else:
            raise BackendRefusal(f"PReLU with {k} parameters on input of shape {tuple(x.shape)}")
        return torch.where(xs >= 0, xs, slope * xs).reshape(x.shape)


# ------------------------------------------------------------------- recurrent and everything else


class PerMember(Batched):
    """Any layer the others do not cover: ``vmap`` over the members, or an honest loop.

    The folded inputs are unfolded to ``(N, B, ...)``; the layer runs on each member's views
    of the stacked tensors, as ``torch.func.functional_call`` under ``vmap`` where torch.func
    can batch it, else member by member (recurrent layers, which have no batching rule);
    the outputs are folded back. The choice is made once per layer.
    """

    def __init__(self, src: nn.Module, n: int) -> None:
        super().__init__(src, n)
        self.strategy = "vmap"

    def _state(self) -> dict[str, torch.Tensor]:
        state = dict(self.src.named_parameters())
        state.update(self.src.named_buffers())
        return state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        n = self.n
        flat, spec = pytree.tree_flatten((args, kwargs))
        # Where each input carries the folded batch: dim 0 as a rule, a later dim for a layer
        # that keeps its own ensemble axis in front (CORL's VectorizedLinear).
        dims = [_batch_dim(a) if isinstance(a, torch.Tensor) else None for a in flat]
        found = [d for d in dims if d is not None]
        if not found:
            raise BackendRefusal(f"{type(self.src).__name__} on inputs that carry no batch")
        where = found[0]
        flat = [
            a if d is None else a.unflatten(d, (n, -1)).movedim(d, 0) for a, d in zip(flat, dims)
        ]
        vmap_dims = [None if d is None else 0 for d in dims]
        state = self._state()
        out = None
        if self.strategy == "vmap":
            try:
                out = self._vmap(state, flat, vmap_dims, spec)
            except Exception:
                self.strategy = "loop"
        if out is None:
            out = self._loop(state, flat, vmap_dims, spec)
        return pytree.tree_map(lambda t: _fold_at(t, where), out)

    def _vmap(self, state: dict, flat: list, dims: list, spec: Any) -> Any:
        def member(state: dict, *leaves: Any) -> Any:
            margs, mkwargs = pytree.tree_unflatten(list(leaves), spec)
            return functional_call(self.src, state, margs, mkwargs)

        return vmap(member, in_dims=(0, *dims), randomness="different")(state, *flat)

    def _loop(self, state: dict, flat: list, dims: list, spec: Any) -> Any:
        views = {k: v.unbind(0) for k, v in state.items()}
        outs = []
        for i in range(self.n):
            leaves = [a[i] if d == 0 else a for a, d in zip(flat, dims)]
            margs, mkwargs = pytree.tree_unflatten(leaves, spec)
            member_state = {k: v[i] for k, v in views.items()}
            outs.append(functional_call(self.src, member_state, margs, mkwargs))
        return pytree.tree_map(lambda *ts: None if ts[0] is None else torch.stack(ts), *outs)


def _batch_dim(x: torch.Tensor) -> int | None:
    """The first dim of ``x`` that holds a folded batch, or None."""
    if not _folds:
        return None
    return next((d for d, size in enumerate(x.shape) if size in _folds[-1][1]), None)


def _fold_at(t: Any, dim: int) -> Any:
    """A per-member result ``(N, *out)`` folded back into ``out``'s dim ``dim``."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return t
    dim = min(dim, t.dim() - 2)
    return t.movedim(0, dim).flatten(dim, dim + 1)


class BatchedRNN(PerMember):
    """nn.RNN, nn.LSTM, nn.GRU: member by member (torch's fused kernels), batch dims honoured.

    The batch is dim 0 of the input with ``batch_first=True``, else dim 1, and always dim 1 of
    the hidden states; torch.func has no batching rule for these layers.
    """

    def forward(self, x: torch.Tensor, hx: Any = None) -> Any:
        src, n = self.src, self.n
        if not isinstance(x, torch.Tensor):
            raise BackendRefusal(f"{type(src).__name__} on a PackedSequence")
        bdim = 0 if src.batch_first else 1
        if x.dim() != 3 or x.shape[bdim] not in _folds[-1][1]:
            raise BackendRefusal(f"{type(src).__name__} on an input without a folded batch")
        xs = x.unflatten(bdim, (n, -1)).movedim(bdim, 0)
        hs = pytree.tree_map(
            lambda h: None if h is None else h.unflatten(1, (n, -1)).movedim(1, 0), hx
        )
        views = {k: v.unbind(0) for k, v in self._state().items()}
        outs, states = [], []
        for i in range(n):
            h_i = pytree.tree_map(lambda h, i=i: None if h is None else h[i], hs)
            out, h_n = functional_call(src, {k: v[i] for k, v in views.items()}, (xs[i], h_i))
            outs.append(out)
            states.append(h_n)
        out = torch.cat(outs, dim=bdim)
        h_n = pytree.tree_map(lambda *hs: torch.cat(hs, dim=1), *states)
        return out, h_n


# ------------------------------------------------------------------------------------ registry


def _batched_recurrent(src: nn.Module, n: int) -> nn.Module:
    from phalanx._backends._fused_rnn import BatchedRecurrent  # it imports this module

    return BatchedRecurrent(src, n)


_BATCHED: dict[type, Callable[[nn.Module, int], nn.Module]] = {
    nn.Linear: BatchedLinear,
    nn.Bilinear: BatchedBilinear,
    nn.Embedding: BatchedEmbedding,
    nn.EmbeddingBag: BatchedEmbeddingBag,
    nn.Conv1d: lambda m, n: BatchedConv(m, n, 1),
    nn.Conv2d: lambda m, n: BatchedConv(m, n, 2),
    nn.Conv3d: lambda m, n: BatchedConv(m, n, 3),
    nn.ConvTranspose1d: lambda m, n: BatchedConvTranspose(m, n, 1),
    nn.ConvTranspose2d: lambda m, n: BatchedConvTranspose(m, n, 2),
    nn.BatchNorm1d: BatchedBatchNorm,
    nn.BatchNorm2d: BatchedBatchNorm,
    nn.BatchNorm3d: BatchedBatchNorm,
    nn.GroupNorm: BatchedGroupNorm,
    nn.PReLU: BatchedPReLU,
    nn.LayerNorm: BatchedLayerNorm,
    nn.RNN: _batched_recurrent,
    nn.LSTM: _batched_recurrent,
    nn.GRU: _batched_recurrent,
}


def _own_forward(module: nn.Module, cls: type) -> bool:
    """True when ``module`` is a ``cls`` (or a subclass) that keeps ``cls``'s forward."""
    return isinstance(module, cls) and type(module).forward is getattr(cls, "forward", None)


def has_hooks(module: nn.Module) -> bool:
    return any(
        getattr(module, h)
        for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    )


def _holds_tensors(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None for b in module._buffers.values()
    )


def classify(module: nn.Module) -> tuple[str, Callable[[nn.Module, int], nn.Module] | None]:
    """How the fused backend treats one submodule.

    Returns:
        ("batched", factory) for a layer with a batched version, or a module holding tensors
        of its own that none covers (it runs per member under vmap, or in a loop);
        ("as_is", None) for a module without tensors of its own, whose forward runs unchanged
        on the folded batch (its children may be swapped).
    """
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(module) or has_hooks(module):
        # A parametrization or a hook must see one member's tensors, and a swapped layer
        # would not run the hooks at all.
        return "batched", PerMember
    for cls, factory in _BATCHED.items():
        if _own_forward(module, cls):
            return "batched", factory
    if _holds_tensors(module):
        return "batched", PerMember
    return "as_is", None
