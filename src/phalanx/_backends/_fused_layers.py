"""Batched layers of the fused backend: each runs all N members of one layer on ``(N, B, ...)``.

A batched layer reads the stacked tensors of the stack's own submodule at call time (so
``.to()``, ``load_state_dict`` and optimizer steps are seen at once) and never owns weights.

Per-channel layers (convolutions, BatchNorm, GroupNorm, pooling) treat the N members as N
times the channels of one ordinary call: ``(N, B, C, ...)`` is laid out as ``(B, N * C, ...)``,
which is free when the tensor is already "batch-major" (physically ``(B, N, C, ...)``), the
layout those layers produce. A shared input (a tensor expanded over the member axis, stride 0)
takes a fast path where one exists: the first Linear is one GEMM against all members' weights
concatenated along the output dimension.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class FusedUnsupported(RuntimeError):
    """The fused backend cannot run this layer or input exactly."""


def is_shared(x: torch.Tensor) -> bool:
    """True for an input broadcast over the member axis (``x.expand(N, ...)``)."""
    return x.dim() > 1 and x.stride(0) == 0 and x.shape[0] > 1


def to_channels(x: torch.Tensor) -> torch.Tensor:
    """``(N, B, C, *sp)`` -> ``(B, N * C, *sp)``: a view for batch-major tensors."""
    return x.transpose(0, 1).flatten(1, 2)


def is_batch_major(x: torch.Tensor) -> bool:
    """True when ``(N, B, ...)`` is laid out as ``(B, N, ...)``, which to_channels views."""
    return x.dim() > 2 and x.transpose(0, 1).is_contiguous()


def from_channels(y: torch.Tensor, n: int) -> torch.Tensor:
    """``(B, N * C, *sp)`` -> ``(N, B, C, *sp)``, a view (batch-major layout)."""
    return y.unflatten(1, (n, -1)).transpose(0, 1)


def _shift(dim: int) -> int:
    """A member's dim index in the fused tensor, which has the member axis in front."""
    return dim + 1 if dim >= 0 else dim


class Batched(nn.Module):
    """Base class: holds the stack's submodule ``src`` (not registered) and N."""

    src: Any  # the stack's own layer, holding the stacked tensors (N, *shape)

    def __init__(self, src: nn.Module, n: int) -> None:
        super().__init__()
        object.__setattr__(self, "src", src)
        self.n = n

    def extra_repr(self) -> str:
        return f"{type(self.src).__name__}, members={self.n}"


# ------------------------------------------------------------------------------------- linear


class BatchedLinear(Batched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.src.weight, self.src.bias  # (N, out, in), (N, out)
        n, out_f, in_f = w.shape
        if is_shared(x):
            # One GEMM: (*, in) @ (in, N * out); the result is viewed as (N, *, out).
            y = F.linear(x[0], w.reshape(n * out_f, in_f), None if b is None else b.reshape(-1))
            return y.unflatten(-1, (n, out_f)).movedim(-2, 0)
        x3 = x.reshape(n, -1, in_f)
        if b is None:
            y = torch.bmm(x3, w.transpose(1, 2))
        else:
            y = torch.baddbmm(b.unsqueeze(1), x3, w.transpose(1, 2))
        return y.view(*x.shape[:-1], out_f)


class BatchedBilinear(Batched):
    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
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
            raise FusedUnsupported("Embedding with max_norm renormalises weights in place")
        w = src.weight  # (N, V, D)
        n, v, d = w.shape
        offsets = torch.arange(n, device=x.device).mul_(v).view(n, *([1] * (x.dim() - 1)))
        y = F.embedding(x + offsets, w.reshape(n * v, d), scale_grad_by_freq=src.scale_grad_by_freq)
        if src.padding_idx is not None:
            # Rows at padding_idx take no gradient, as in nn.Embedding.
            y = torch.where((x == src.padding_idx).unsqueeze(-1), y.detach(), y)
        return y


# ------------------------------------------------------------------------------- convolutions

# Which strategy runs fastest for a (layer, input shape, grad mode): measured once, then cached,
# as cuDNN's benchmark mode does. Every strategy computes the same function exactly.
_strategy_cache: dict[tuple, str] = {}


def _autotune(key: tuple, strategies: dict[str, Callable[[], torch.Tensor]]) -> torch.Tensor:
    choice = _strategy_cache.get(key)
    if choice is not None:
        return strategies[choice]()
    if len(strategies) == 1:
        (choice,) = strategies
        _strategy_cache[key] = choice
        return strategies[choice]()
    timings = {}
    for name, run in strategies.items():
        best = float("inf")
        for _ in range(3):
            with torch.no_grad():
                start = time.perf_counter()
                run()
                if torch.cuda.is_available() and key[-1] == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
        timings[name] = best
    choice = min(timings, key=timings.__getitem__)
    _strategy_cache[key] = choice
    return strategies[choice]()


class BatchedConv(Batched):
    """Conv1d/2d/3d: one grouped convolution over N * C channels, or one call per member."""

    def __init__(self, src: nn.Module, n: int, dims: int) -> None:
        super().__init__(src, n)
        self.dims = dims
        self.conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]

    def _pad(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        src = self.src
        if src.padding_mode != "zeros":
            return F.pad(x, src._reversed_padding_repeated_twice, mode=src.padding_mode), 0
        return x, src.padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, n = self.src, self.n
        w, b = src.weight, src.bias  # (N, out, in / groups, *k), (N, out)
        shared = is_shared(x)

        def grouped() -> torch.Tensor:
            # A shared input meets all members' filters in one ordinary convolution; otherwise
            # the members' channels side by side make one grouped convolution.
            if shared and src.groups == 1:
                inp, groups = x[0], 1
            else:
                inp, groups = to_channels(x), src.groups * n
            y, pad = self._pad(inp)
            bias = None if b is None else b.flatten()
            y = self.conv(y, w.flatten(0, 1), bias, src.stride, pad, src.dilation, groups)
            return from_channels(y, n)

        def per_member() -> torch.Tensor:
            outs = []
            for i in range(n):
                xi, pad = self._pad(x[i])
                bias = None if b is None else b[i]
                outs.append(self.conv(xi, w[i], bias, src.stride, pad, src.dilation, src.groups))
            return torch.stack(outs)

        key = (
            id(src),
            tuple(x.shape),
            x.stride(),
            shared,
            torch.is_grad_enabled(),
            x.dtype,
            x.device.type,
        )
        return _autotune(key, {"grouped": grouped, "per_member": per_member})


class BatchedConvTranspose(Batched):
    def __init__(self, src: nn.Module, n: int, dims: int) -> None:
        super().__init__(src, n)
        self.conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[dims]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, n = self.src, self.n
        if src.padding_mode != "zeros":
            raise FusedUnsupported("ConvTranspose supports only zero padding")
        w, b = src.weight, src.bias  # (N, in, out / groups, *k)
        y = self.conv(
            to_channels(x),
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
        if x.dim() < 3:
            raise FusedUnsupported("BatchNorm needs a batch dimension")
        use_batch_stats = src.training or not src.track_running_stats
        factor = 0.0
        if src.training and src.track_running_stats:
            if src.momentum is None:
                raise FusedUnsupported("BatchNorm with momentum=None (a cumulative average)")
            src.num_batches_tracked.add_(1)
            factor = src.momentum
        mean, var = src.running_mean, src.running_var
        w, b = src.weight, src.bias
        y = F.batch_norm(
            to_channels(x),
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
        w, b = src.weight, src.bias
        y = F.group_norm(
            to_channels(x),
            src.num_groups * n,
            None if w is None else w.reshape(-1),
            None if b is None else b.reshape(-1),
            src.eps,
        )
        return from_channels(y, n)


class BatchedLayerNorm(Batched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src = self.src
        shape = tuple(src.normalized_shape)
        y = F.layer_norm(x, shape, None, None, src.eps)
        view = (self.n,) + (1,) * (x.dim() - 1 - len(shape)) + shape
        if src.weight is not None:
            y = y * src.weight.view(view)
        if getattr(src, "bias", None) is not None:
            y = y + src.bias.view(view)
        return y


# ------------------------------------------------------------------------- dropout and shapes


class BatchedChannelDropout(Batched):
    """Dropout1d/2d/3d: whole channels, drawn independently per member and sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src = self.src
        fn = {nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d, nn.Dropout3d: F.dropout3d}[
            type(src)
        ]
        return fn(x.flatten(0, 1), src.p, src.training).unflatten(0, x.shape[:2])


class PerChannel(Batched):
    """Pooling and other per-channel, per-sample layers: ``(B, N * C, ...)`` in one call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.src, "return_indices", False):
            raise FusedUnsupported(f"{type(self.src).__name__} with return_indices=True")
        if x.is_contiguous() and not is_batch_major(x):  # member-major: (N * B, C, ...) is a view
            return self.src(x.flatten(0, 1)).unflatten(0, x.shape[:2])
        return from_channels(self.src(to_channels(x)), self.n)


class ShiftedDims(Batched):
    """Flatten, Unflatten, Softmax and friends: the member's dims move one to the right."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src = self.src
        if isinstance(src, nn.Flatten):
            return x.flatten(_shift(src.start_dim), _shift(src.end_dim))
        if isinstance(src, nn.Unflatten):
            return x.unflatten(_shift(src.dim), src.unflattened_size)
        dim = src.dim
        if dim is None:
            raise FusedUnsupported(f"{type(src).__name__} with dim=None")
        fn = {
            nn.Softmax: F.softmax,
            nn.LogSoftmax: F.log_softmax,
            nn.Softmin: F.softmin,
            nn.GLU: F.glu,
        }[type(src)]
        return fn(x, _shift(dim))


class BatchedPReLU(Batched):
    """PReLU: one slope per member, or one per channel (the member's dim 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.src.weight  # (N, num_parameters)
        n, k = w.shape
        if k == 1:
            slope = w.view(n, *([1] * (x.dim() - 1)))
        elif x.dim() >= 3 and x.shape[2] == k:
            slope = w.view(n, 1, k, *([1] * (x.dim() - 3)))
        else:
            raise FusedUnsupported(f"PReLU with {k} parameters on input of shape {tuple(x.shape)}")
        return torch.where(x >= 0, x, slope * x)


# ------------------------------------------------------------------------------------ registry

_ELEMENTWISE = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
    nn.Softsign, nn.Tanhshrink, nn.Softshrink, nn.Hardshrink, nn.LogSigmoid, nn.Threshold,
    nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU,
)  # fmt: skip
"""Parameter-free layers that act elementwise (dropout draws per element, hence per member):
they run unchanged on ``(N, B, ...)``."""

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

_POOLING = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.LPPool1d, nn.LPPool2d, nn.Upsample,
    nn.ZeroPad1d, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ReflectionPad1d,
    nn.ReflectionPad2d, nn.ReplicationPad1d, nn.ReplicationPad2d, nn.PixelShuffle,
    nn.PixelUnshuffle, nn.ChannelShuffle,
)  # fmt: skip

_BATCHED: dict[type, Callable[[nn.Module, int], nn.Module]] = {
    nn.Linear: BatchedLinear,
    nn.Bilinear: BatchedBilinear,
    nn.Embedding: BatchedEmbedding,
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
    nn.Dropout1d: BatchedChannelDropout,
    nn.Dropout2d: BatchedChannelDropout,
    nn.Dropout3d: BatchedChannelDropout,
    nn.Flatten: ShiftedDims,
    nn.Unflatten: ShiftedDims,
    nn.Softmax: ShiftedDims,
    nn.LogSoftmax: ShiftedDims,
    nn.Softmin: ShiftedDims,
    nn.GLU: ShiftedDims,
    **{t: PerChannel for t in _POOLING},
}


def _own_forward(module: nn.Module, cls: type) -> bool:
    """True when ``module`` is a ``cls`` (or a subclass) that keeps ``cls``'s forward."""
    return isinstance(module, cls) and type(module).forward is getattr(cls, "forward", None)


def classify(module: nn.Module) -> tuple[str, Callable[[nn.Module, int], nn.Module] | None]:
    """How the fused backend treats one submodule.

    Returns:
        ("batched", factory) for a layer with a batched version; ("as_is", None) for
        elementwise layers and containers, which run unchanged; ("custom", None) for a module
        without tensors of its own whose forward runs unchanged and is checked by the probe;
        ("unsupported", None) for a module holding parameters or buffers phalanx has no
        batched version of.
    """
    for cls, factory in _BATCHED.items():
        if _own_forward(module, cls):
            return "batched", factory
    if any(_own_forward(module, cls) for cls in _ELEMENTWISE + _CONTAINERS):
        return "as_is", None
    has_tensors = any(p is not None for p in module._parameters.values()) or any(
        b is not None for b in module._buffers.values()
    )
    return ("unsupported", None) if has_tensors else ("custom", None)
