"""Dropout with a rate per member (both vmap backends): ``F.dropout(x, p)`` where ``p`` is a
tensor, a 0-d one batched over the members (``_rates``: the stack puts each member's rate on
its Dropout modules for one vmapped call).

torch's own dropout takes the rate as a Python float and checks its range with a Python
comparison, which a batched rate cannot answer; this rule is routed in before that check.
Each entry (each channel, for ``dropout1d/2d/3d``) is kept with probability ``1 - p_i`` and
the kept ones are scaled by ``1 / (1 - p_i)``, the scale ATen computes (``1 - p`` in float64,
then in the input's dtype); a member with ``p = 0`` gets its input unchanged, one with
``p = 1`` zeros. The masks are drawn in one call for all members (``randomness="different"``):
independent per member and reproducible under a seed, not the loop's numbers. A float rate
goes to torch's own function unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx.backends.rules._registry import register

_NAMES = ("input", "p", "training", "inplace")
_DEFAULTS = {"p": 0.5, "training": True, "inplace": False}


def _values(args: tuple, kwargs: dict) -> list[Any]:
    values = dict(zip(_NAMES, args))
    values.update(kwargs)
    return [values.get(k, _DEFAULTS.get(k)) for k in _NAMES]


def member_dropout(
    x: torch.Tensor, p: torch.Tensor, training: bool, inplace: bool, kept: int | None
) -> torch.Tensor:
    """Dropout of ``x`` at rate ``p`` (a 0-d tensor); ``kept``: how many leading dims the
    mask spans (feature dropout, the rest broadcast), None for every entry."""
    if not training:
        return x
    draw = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    keep = (1 - p).to(x.dtype)  # (float)(1 - p), as ATen's scalar
    if kept is None:
        u = torch.rand_like(x, dtype=draw)
    else:
        shape = (*x.shape[:kept], *([1] * (x.dim() - kept)))
        u = torch.rand(shape, dtype=draw, device=x.device)
    mask = u < (1 - p).to(draw)
    noise = torch.where(mask, 1 / keep, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.mul_(noise) if inplace else x * noise


def _plain(args: tuple, kwargs: dict) -> Any:
    x, p, training, inplace = _values(args, kwargs)
    if not isinstance(p, torch.Tensor):
        return F.dropout(*args, **kwargs)
    return member_dropout(x, p, training, inplace, None)


def _feature(func: Any, unbatched_dim: int | None) -> Any:
    """The route of a channel-wise dropout; ``unbatched_dim``: the input rank that has no
    batch dim (its mask spans one leading dim, the channels), else two."""

    def route(args: tuple, kwargs: dict) -> Any:
        x, p, training, inplace = _values(args, kwargs)
        if not isinstance(p, torch.Tensor):
            return func(*args, **kwargs)
        func(x, 0.0, False, False)  # the member's own checks and warnings on the input's rank
        kept = 1 if x.dim() == unbatched_dim else 2
        return member_dropout(x, p, training, inplace, kept)

    return route


register(F.dropout, _plain, table="correctness")
register(F.dropout1d, _feature(F.dropout1d, 2), table="correctness")
register(F.dropout2d, _feature(F.dropout2d, None), table="correctness")
register(F.dropout3d, _feature(F.dropout3d, 4), table="correctness")
