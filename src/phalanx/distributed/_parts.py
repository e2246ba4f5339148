"""The parts of a run beside the stack (optimizer, scheduler, loader, extras), split by member.

Each part's ``state_dict()`` is encoded as in a single-file checkpoint (JSON with tensors
replaced by ``{"__tensor__": key}``, see :mod:`phalanx.checkpoint._single`), and its tensors are
sorted in two: a tensor whose dim 0 is this rank's number of members holds one row per member
and is stored as this rank's rows (``member/KEY``), so a load on any number of ranks reads
the rows of its own members; any other tensor is the same on every rank and is stored whole
(``replica/KEY``). The ranks compare a digest of everything that is not per-member before a
save commits, so a rank that stepped its scheduler once more is refused, not saved.

A :class:`phalanx.data.MemberLoader`'s position is saved in its global form: the stream of
each member as a per-member tensor, N and first member 0, so it loads into the loader of any
rank of any world size (:func:`localize_loader`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import Tensor

from phalanx.checkpoint._fit import type_name
from phalanx.checkpoint._single import _encode

__all__ = ["MEMBER", "PARTS", "REPLICA", "Part", "encode_part", "localize_loader"]

PARTS = ("optimizer", "scheduler", "loader", "extra")
MEMBER, REPLICA = "member/", "replica/"


class Part:
    """One part, encoded: its index entry and its tensors, by kind."""

    def __init__(self, name: str, kind: str | None, tree: Any, tensors: dict[str, Tensor], n: int):
        self.name = name
        self.members = {k: t for k, t in tensors.items() if t.dim() and t.shape[0] == n}
        self.replicas = {k: t for k, t in tensors.items() if k not in self.members}
        self.entry = {
            "type": kind,
            "state": tree,
            "members": sorted(self.members),
            "replicas": sorted(self.replicas),
        }

    def files(self) -> dict[str, Tensor]:
        """The tensors for this rank's file, under their stored keys."""
        out = {MEMBER + k: t for k, t in self.members.items()}
        out.update({REPLICA + k: t for k, t in self.replicas.items()})
        return out

    def facts(self) -> dict[str, str]:
        """What every rank must hold alike: the type, the per-member tensors' trailing
        shapes and dtypes, and a digest of everything else (values included)."""
        digest = hashlib.sha256(json.dumps(self.entry["state"], sort_keys=True).encode())
        for key in sorted(self.replicas):
            t = self.replicas[key].detach().to("cpu").contiguous()
            digest.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        members = {k: f"{tuple(t.shape[1:])} {t.dtype}" for k, t in sorted(self.members.items())}
        return {
            f"{self.name} type": str(self.entry["type"]),
            f"{self.name} per-member tensors": json.dumps(members),
            f"{self.name} state other than per-member tensors (digest)": digest.hexdigest()[:16],
        }


def _globalize_loader(state: dict[str, Any], num_members: int) -> dict[str, Any]:
    """A rank's MemberLoader state in the form of one loader over all N members."""
    out = dict(state)
    if "streams" in out:
        out["streams"] = torch.as_tensor(out["streams"], dtype=torch.int64)
    out["num_members"], out["first_member"] = num_members, 0
    return out


def localize_loader(state: dict[str, Any], start: int, stop: int, n: int) -> dict[str, Any]:
    """A saved global loader state as the state of the loader of members ``start..stop-1``.

    ``streams`` is this block's rows (a tensor, from a sharded checkpoint) or all N streams
    (a list, from a single file); ``num_members`` and ``first_member`` become the block's.
    """
    out = dict(state)
    if out.get("num_members") != n or out.get("first_member", 0) != 0:
        return out  # not a global state: the loader's own check will say what differs
    streams = out.get("streams")
    if isinstance(streams, Tensor):
        out["streams"] = [int(s) for s in streams.tolist()]
    elif isinstance(streams, list) and len(streams) == n:
        out["streams"] = streams[start:stop]
    out["num_members"], out["first_member"] = stop - start, start
    return out


def encode_part(name: str, obj: Any, n_local: int, num_members: int) -> Part:
    """``obj``'s state (or, for ``extra``, the dict of extras itself), encoded and split."""
    if name == "extra":
        state, kind = obj, None
    else:
        state, kind = obj.state_dict(), type_name(obj)
        if name == "loader" and type_name(obj) == "phalanx.data.MemberLoader":
            state = _globalize_loader(state, num_members)
    tensors: dict[str, Tensor] = {}
    try:
        tree = _encode(state, name, tensors)
    except TypeError as e:
        raise TypeError(str(e).replace("phalanx.save()", "phalanx.distributed.save()")) from None
    return Part(name, kind, tree, tensors, n_local)
