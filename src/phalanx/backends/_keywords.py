"""Per-member keyword inputs: which keyword tensors carry the member axis.

Models are called with keywords (Hugging Face: ``attention_mask=``, ``labels=``,
``token_type_ids=``). A keyword input is shared by every member unless ``kw_in_dims`` says it
is per-member, as ``in_dims`` says it of positional inputs: ``kw_in_dims={"attention_mask":
0}`` gives member i ``attention_mask[i]``; a single ``0`` marks every keyword tensor
per-member. ``torch.func.vmap`` takes no in_dims for keywords (they are always shared there);
the backends receive the names of the per-member keywords and map them like positional ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from phalanx._warnings import HintWarning, warn

KwInDims = int | None | Mapping[str, int | None]

_WHERE = "Stack.forward()"


def keyword_dims(
    kw_in_dims: KwInDims,
    kwargs: dict[str, Any],
    n: int,
    args: tuple[Any, ...] = (),
    in_dims: tuple[int | None, ...] = (),
) -> frozenset[str]:
    """The names of the per-member keyword inputs, checked; warns where one looks per-member
    but was not declared: ``(N, B, ...)``, with N members and the batch B of the positional
    inputs (``(B, ...)`` shared or ``(N, B, ...)`` per-member).

    Args:
        kw_in_dims: None (every keyword shared), 0 (every keyword tensor per-member), or a
            mapping of keyword name to None or 0; keywords it does not name are shared.
        kwargs: the call's keyword inputs.
        n: the number of members.
    """
    if not kwargs and kw_in_dims is None:
        return frozenset()  # the common call: nothing to check
    if kw_in_dims is None or isinstance(kw_in_dims, int):
        _check_dim(kw_in_dims, "kw_in_dims")
        declared: dict[str, int | None] = {}
        if kw_in_dims == 0:
            declared = {k: 0 for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        explicit = kw_in_dims is not None
    elif isinstance(kw_in_dims, Mapping):
        declared = dict(kw_in_dims)
        unknown = sorted(set(declared) - set(kwargs))
        if unknown:
            raise ValueError(
                f"{_WHERE}: kw_in_dims names {unknown}, which this call does not pass as keyword "
                f"inputs (it passes {sorted(kwargs)}); name only keywords given to the call."
            )
        explicit = False
        for k, d in declared.items():
            _check_dim(d, f"kw_in_dims[{k!r}]")
    else:
        raise TypeError(
            f"{_WHERE}: kw_in_dims must be None, 0 or a dict of keyword name to None or 0; got "
            f"a {type(kw_in_dims).__name__}."
        )
    per_member = frozenset(k for k, d in declared.items() if d == 0)
    for k in sorted(per_member):
        v = kwargs[k]
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                f"{_WHERE}: keyword input {k!r} is marked per-member (kw_in_dims) but is a "
                f"{type(v).__name__}, not a tensor; mark it None to share it."
            )
        if v.dim() == 0 or v.shape[0] != n:
            raise ValueError(
                f"{_WHERE}: keyword input {k!r} is marked per-member, so its first dimension "
                f"must be the number of members, {n}; got a tensor of shape {tuple(v.shape)}. "
                f"For a keyword shared by every member, mark it None."
            )
    candidates = [v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dim() > 1]
    # Under a trace (torch.compile, torch.export) sizes may be symbolic: the warning is for
    # eager calls, where a user reads it.
    if not explicit and candidates and not torch.compiler.is_compiling():
        batches = [
            a.shape[0 if d is None else 1]
            for a, d in zip(args, in_dims)
            if isinstance(a, torch.Tensor) and a.dim() > (0 if d is None else 1)
        ]
        looks = [
            k
            for k, v in kwargs.items()
            if k not in declared
            and isinstance(v, torch.Tensor)
            and v.dim() > 1
            and v.shape[0] == n
            and v.shape[1] in batches
        ]
        if looks:
            k = looks[0]
            warn(
                f"{_WHERE}: keyword input {k!r} has shape {tuple(kwargs[k].shape)}, whose first "
                f"dimensions are the number of members, {n}, and the batch, but keyword inputs are shared by "
                f"every member unless declared: pass kw_in_dims={{{k!r}: 0}} if it is "
                f"per-member (member i reads {k}[i]), or kw_in_dims={{{k!r}: None}} if it is "
                f"shared and its first dimension happens to be {n}.",
                HintWarning,
            )
    return per_member


def _check_dim(d: Any, what: str) -> None:
    if d is not None and (isinstance(d, bool) or d != 0):
        raise ValueError(
            f"{_WHERE}: {what} must be None (shared) or 0 (per-member); got {d!r}. Move the "
            f"member axis first with x.movedim({d}, 0)."
        )


def member_kwargs(kwargs: dict[str, Any], per_member: frozenset[str], i: int) -> dict[str, Any]:
    """Member ``i``'s keyword inputs: its slice of the per-member ones, the shared as given."""
    if not per_member:
        return kwargs
    return {k: v[i] if k in per_member else v for k, v in kwargs.items()}
