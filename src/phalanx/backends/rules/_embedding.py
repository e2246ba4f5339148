"""Embeddings (both vmap backends): every id checked against the member's own table.

torch.func's rule offsets ids into one flattened table, so an id ``V`` of member 0 would
silently read member 1's row 0; these rules check every id against the member's own table and
raise ``IndexError`` as the module does, and keep ``padding_idx`` rows out of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx.backends.rules._registry import (
    Dims,
    batch_rule,
    first,
    holds,
    member_first,
    per_member,
)

_EMB_NAMES = (
    "input",
    "weight",
    "padding_idx",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "sparse",
)
_EMB_DEFAULTS = {
    "padding_idx": None,
    "max_norm": None,
    "norm_type": 2.0,
    "scale_grad_by_freq": False,
    "sparse": False,
}
_EB_DEFAULTS = {
    "offsets": None, "max_norm": None, "norm_type": 2, "scale_grad_by_freq": False, "mode": "mean",
    "sparse": False, "per_sample_weights": None, "include_last_offset": False, "padding_idx": None,
}  # fmt: skip


def _embedding_func(
    ids: Any, w: Any, padding_idx: Any, max_norm: Any, norm_type: Any, scale: Any, sparse: Any
) -> Any:
    return F.embedding(ids, w, padding_idx, max_norm, norm_type, scale, sparse)


_IDS = (torch.int32, torch.int64)


def _ids_in_range(ids: torch.Tensor, rows: int) -> bool:
    """Whether every id is in ``[0, rows)``, as the member's own table requires: where one is
    not, the rule runs member by member and the member raises its own error (an id outside a
    member's table must never read another member's rows)."""
    if ids.numel() == 0:
        return True
    low, high = torch.aminmax(ids)
    return holds((low >= 0) & (high < rows), "index out of range in self")


def _clamped(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Under ``torch.export`` the range check raises after the vmapped call (``deferred``):
    until then no id may index past the flat table."""
    return ids.clamp(0, rows - 1) if torch.compiler.is_exporting() else ids


@batch_rule(F.embedding, _EMB_NAMES, _EMB_DEFAULTS, table="correctness", computes=_embedding_func)
def _embedding(
    n: int,
    dims: Dims,
    ids: Any,
    w: Any,
    padding_idx: Any,
    max_norm: Any,
    norm_type: Any,
    scale: Any,
    sparse: Any,
) -> Any:
    idd, wd = dims[0], dims[1]
    if wd is None:
        y = F.embedding(ids, w, padding_idx, max_norm, norm_type, scale, sparse)
        return member_first(y, idd, n), 0
    v = w.movedim(wd, 0).shape[1]
    if (
        sparse
        or scale  # sparse gradients, or gradients scaled by counts in the flat table
        or ids.dtype not in _IDS
        or (padding_idx is not None and not -v <= padding_idx < v)  # F.embedding's error
        or not _ids_in_range(ids, v)
    ):
        return per_member(
            n, dims, _embedding_func, ids, w, padding_idx, max_norm, norm_type, scale, sparse
        )
    w = w.movedim(wd, 0)  # (N, V, D)
    d = w.shape[2]
    ids = _clamped(first(ids, idd, n), v)
    if max_norm is not None:  # as F.embedding: the rows looked up are renormalised in place
        with torch.no_grad():
            for i in range(n):
                torch.embedding_renorm_(w[i], ids[i], max_norm, norm_type)
    offsets = torch.arange(n, device=ids.device).mul_(v).view(n, *([1] * (ids.dim() - 1)))
    y = F.embedding(ids + offsets, w.reshape(n * v, d), scale_grad_by_freq=scale)
    if padding_idx is not None:  # rows at padding_idx take no gradient, as in nn.Embedding
        padding_idx = padding_idx % v  # a negative one counts from the end, as F.embedding's
        y = torch.where((ids == padding_idx).unsqueeze(-1), y.detach(), y)
    return y, 0


_EMBEDDING_BAG = (
    "input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode",
    "sparse", "per_sample_weights", "include_last_offset", "padding_idx",
)  # fmt: skip


@batch_rule(F.embedding_bag, _EMBEDDING_BAG, _EB_DEFAULTS, table="correctness")
def _embedding_bag(n: int, dims: Dims, *args: Any) -> Any:
    """Every member's bags in one call: ids offset into the members' tables side by side,
    after every id is checked against the member's own table (as the module raises)."""
    a, d = dict(zip(_EMBEDDING_BAG, args)), dict(zip(_EMBEDDING_BAG, dims))
    ids, w, offsets = a["input"], a["weight"], a["offsets"]
    if (
        d["weight"] is None
        or a["max_norm"] is not None
        or a["padding_idx"] is not None  # one padding id per member: not one in the flat table
        or a["include_last_offset"]
        or a["scale_grad_by_freq"]  # counts in the flat table's backward differ (measured)
        or (a["per_sample_weights"] is not None and d["per_sample_weights"] is None)
    ):
        return per_member(n, dims, F.embedding_bag, *args)
    w = w.movedim(d["weight"], 0)  # (N, V, D)
    v, dim = w.shape[1], w.shape[2]
    ids = first(ids, d["input"], n)
    psw = a["per_sample_weights"]
    psw = None if psw is None else first(psw, d["per_sample_weights"], n)
    offs = None if offsets is None else first(offsets, d["offsets"], n)  # (N, B)
    if not (
        ids.dtype in _IDS
        and (psw is None or psw.shape == ids.shape)
        and (
            (ids.dim() == 3 and offs is None)  # (N, B, L): fixed-length bags
            or (ids.dim() == 2 and offs is not None and _bags_ok(offs, ids.shape[1]))
        )
        and _ids_in_range(ids, v)
    ):
        # Each member's own checks and errors (and its answer for offsets that decrease).
        return per_member(n, dims, F.embedding_bag, *args)
    ids = _clamped(ids, v)
    base = torch.arange(n, device=ids.device).mul_(v)
    psw = None if psw is None else psw.reshape(-1)
    if offs is None:
        flat, flat_offsets = (ids + base.view(n, 1, 1)).reshape(-1, ids.shape[-1]), None
        psw = None if psw is None else psw.view(flat.shape)
    else:  # (N, L) with (N, B) offsets
        length = ids.shape[1]
        flat = (ids + base.view(n, 1)).reshape(-1)
        flat_offsets = offs + torch.arange(n, device=ids.device).mul_(length).view(n, 1)
        flat_offsets = flat_offsets.reshape(-1)
    y = F.embedding_bag(
        flat, w.reshape(n * v, dim), flat_offsets, scale_grad_by_freq=a["scale_grad_by_freq"],
        mode=a["mode"], sparse=a["sparse"], per_sample_weights=psw,
    )  # fmt: skip
    return y.unflatten(0, (n, -1)), 0


def _bags_ok(offs: torch.Tensor, length: int) -> bool:
    """Whether every member's offsets ``(N, B)`` are what one flat call computes as the member
    alone does: B >= 1 of the ids' dtypes, starting at 0, never decreasing, the last at most
    the member's ``length`` ids (torch raises on the first and last; its answer for offsets
    that decrease is its own)."""
    if offs.dtype not in _IDS or offs.shape[1] == 0:
        return False
    ok = (offs[:, 0] == 0).all() & (offs[:, -1] <= length).all() & (offs.diff(dim=1) >= 0).all()
    return holds(
        ok,
        "embedding_bag: a member's offsets must start at 0, never decrease and end at most at "
        "its input's length",
    )


@batch_rule(F.one_hot, ("input", "num_classes"), {"num_classes": -1}, table="correctness")
def _one_hot(n: int, dims: Dims, x: Any, num_classes: Any) -> Any:
    """Every member's classes checked against ``num_classes`` (torch.func's rule writes an
    all-zero row for a class out of range, where the member alone raises)."""
    ok = x.dtype == torch.int64 and num_classes >= 0
    if ok and x.numel():
        low, high = torch.aminmax(x)
        ok = holds(
            (low >= 0) & (high < num_classes), "Class values must be smaller than num_classes."
        )
    if not ok:  # the member's own error, or num_classes=-1 (each member's own count)
        return per_member(n, dims, F.one_hot, x, num_classes)
    return member_first(F.one_hot(x, num_classes), dims[0], n), 0
