"""grid_sample (both vmap backends): the members merged into the batch of samples.

torch.func's own rule hands the batch back in the wrong place when the input's batch dim is
not its first (torch 2.13: an input batched at dim 1, as after a transposed layout, comes back
``(B, N, ...)`` marked as ``(N, B, ...)``). Sampling is per sample anyway, so every member's
samples go through one call, each sample computed as alone.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from phalanx.backends.rules._registry import Dims, batch_rule, first, per_member

_NAMES = ("input", "grid", "mode", "padding_mode", "align_corners")
_DEFAULTS = {"mode": "bilinear", "padding_mode": "zeros", "align_corners": None}


@batch_rule(F.grid_sample, _NAMES, _DEFAULTS, table="correctness")
def _grid_sample(
    n: int, dims: Dims, x: Any, grid: Any, mode: Any, padding_mode: Any, align_corners: Any
) -> Any:
    xs, gs = first(x, dims[0], n), first(grid, dims[1], n)  # (N, B, C, *sp), (N, B, *out, k)
    if xs.dim() != gs.dim() or xs.dim() not in (5, 6) or xs.shape[1] != gs.shape[1]:
        return per_member(n, dims, F.grid_sample, x, grid, mode, padding_mode, align_corners)
    y = F.grid_sample(
        xs.flatten(0, 1), gs.flatten(0, 1), mode, padding_mode, align_corners
    )  # fmt: skip
    return y.unflatten(0, (n, -1)), 0
