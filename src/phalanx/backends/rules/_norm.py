"""BatchNorm (``fused``): every member's channels in one call."""

from __future__ import annotations

import torch.nn.functional as F

from phalanx.backends.rules._registry import Dims, batch_rule, first, per_member

_BN_NAMES = (
    "input",
    "running_mean",
    "running_var",
    "weight",
    "bias",
    "training",
    "momentum",
    "eps",
)
_BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


@batch_rule(F.batch_norm, _BN_NAMES, _BN_DEFAULTS, table="speed")
def _batch_norm(n: int, dims: Dims, x, mean, var, w, b, training, momentum, eps):
    xd = dims[0]
    if all(d is None for d in dims[1:5]):
        xs = x.movedim(xd, 0)
        y = F.batch_norm(xs.flatten(0, 1), mean, var, w, b, training, momentum, eps)
        return y.unflatten(0, (n, -1)), 0
    xs = first(x, xd, n)  # (N, B, C, *sp)
    stats = [first(t, d, n) for t, d in zip((mean, var), dims[1:3])]
    if (
        any(d is None for d, t in zip(dims[1:5], (mean, var, w, b)) if t is not None)
        or xs.dim() < 3
        # the running statistics are updated in place through a flat view of them
        or any(t is not None and not t.is_contiguous() for t in stats)
    ):
        return per_member(n, dims, F.batch_norm, x, mean, var, w, b, training, momentum, eps)
    channels = xs.transpose(0, 1).flatten(1, 2)  # (B, N * C, *sp)
    y = F.batch_norm(
        channels,
        None if stats[0] is None else stats[0].view(-1),
        None if stats[1] is None else stats[1].view(-1),
        None if w is None else first(w, dims[3], n).reshape(-1),
        None if b is None else first(b, dims[4], n).reshape(-1),
        training,
        momentum,
        eps,
    )
    return y.unflatten(1, (n, -1)).transpose(0, 1), 0
