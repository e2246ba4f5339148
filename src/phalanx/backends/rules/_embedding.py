"""Embeddings (both vmap backends): every id checked against the member's own table.

torch.func's rule offsets ids into one flattened table, so an id ``V`` of member 0 would
silently read member 1's row 0; these rules check every id against the member's own table and
raise ``IndexError`` as the module does, and keep ``padding_idx`` rows out of the gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx import _torch_compat as compat
from phalanx.backends.rules._registry import Dims, batch_rule, first, per_member

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


def _embedding_func(ids, w, padding_idx, max_norm, norm_type, scale, sparse):
    return F.embedding(ids, w, padding_idx, max_norm, norm_type, scale, sparse)


def _check_ids(ids: torch.Tensor, rows: int) -> None:
    """Raises as ``nn.Embedding`` does when an id is outside ``[0, rows)``: an id outside a
    member's table must never read another member's rows."""
    if ids.numel() == 0:
        return
    low, high = torch.aminmax(ids)
    if ids.device.type == "cpu" and not compat.tracing():  # make_fx: no values to read
        if bool(low < 0) or bool(high >= rows):
            raise IndexError(
                f"index out of range in self: an embedding of {rows} rows got ids from "
                f"{int(low)} to {int(high)}"
            )
        return
    compat.assert_async((low >= 0) & (high < rows), "index out of range in self")


@batch_rule(F.embedding, _EMB_NAMES, _EMB_DEFAULTS, table="correctness", computes=_embedding_func)
def _embedding(n: int, dims: Dims, ids, w, padding_idx, max_norm, norm_type, scale, sparse):
    idd, wd = dims[0], dims[1]
    if wd is None:
        y = F.embedding(ids, w, padding_idx, max_norm, norm_type, scale, sparse)
        return y, idd
    if sparse or scale:  # sparse gradients, or gradients scaled by counts in the flat table
        return per_member(
            n, dims, _embedding_func, ids, w, padding_idx, max_norm, norm_type, scale, sparse
        )
    w = w.movedim(wd, 0)  # (N, V, D)
    v, d = w.shape[1], w.shape[2]
    _check_ids(ids, v)
    ids = first(ids, idd, n)
    if max_norm is not None:  # as F.embedding: the rows looked up are renormalised in place
        with torch.no_grad():
            for i in range(n):
                torch.embedding_renorm_(w[i], ids[i], max_norm, norm_type)
    offsets = torch.arange(n, device=ids.device).mul_(v).view(n, *([1] * (ids.dim() - 1)))
    y = F.embedding(ids + offsets, w.reshape(n * v, d), scale_grad_by_freq=scale)
    if padding_idx is not None:  # rows at padding_idx take no gradient, as in nn.Embedding
        y = torch.where((ids == padding_idx).unsqueeze(-1), y.detach(), y)
    return y, 0


_EMBEDDING_BAG = (
    "input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode",
    "sparse", "per_sample_weights", "include_last_offset", "padding_idx",
)  # fmt: skip


@batch_rule(F.embedding_bag, _EMBEDDING_BAG, _EB_DEFAULTS, table="correctness")
def _embedding_bag(n: int, dims: Dims, *args):
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
    _check_ids(ids, v)
    ids = first(ids, d["input"], n)
    base = torch.arange(n, device=ids.device).mul_(v)
    psw = a["per_sample_weights"]
    psw = None if psw is None else first(psw, d["per_sample_weights"], n).reshape(-1)
    if ids.dim() == 3 and offsets is None:  # (N, B, L): fixed-length bags
        flat, flat_offsets = (ids + base.view(n, 1, 1)).reshape(-1, ids.shape[-1]), None
        psw = None if psw is None else psw.view(flat.shape)
    elif ids.dim() == 2 and offsets is not None:  # (N, L) with (N, B) offsets
        length = ids.shape[1]
        flat = (ids + base.view(n, 1)).reshape(-1)
        offs = first(offsets, d["offsets"], n)
        flat_offsets = offs + torch.arange(n, device=ids.device).mul_(length).view(n, 1)
        flat_offsets = flat_offsets.reshape(-1)
    else:
        return per_member(n, dims, F.embedding_bag, *args)
    y = F.embedding_bag(
        flat, w.reshape(n * v, dim), flat_offsets, scale_grad_by_freq=a["scale_grad_by_freq"],
        mode=a["mode"], sparse=a["sparse"], per_sample_weights=psw,
    )  # fmt: skip
    return y.unflatten(0, (n, -1)), 0
