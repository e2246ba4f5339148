"""What every rank must agree on, compared in one exchange before anything irreversible.

Ranks that disagree (another N, other member shapes, another optimizer) must fail together
with one message that names every difference and which ranks hold which value. Comparing
fixed-size tensors would abort inside gloo when the sizes differ (SIGABRT, no traceback), so
the facts travel as objects (``all_gather_object``, which exchanges sizes first) and every
rank judges the same table, so every rank reaches the same verdict without another round.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.distributed._errors import DistributedError
from phalanx.distributed._mesh import Shard, collective, control_group

__all__ = ["describe_members", "differences", "exchange"]


def exchange(obj: Any, shard: Shard, where: str, what: str) -> list[Any]:
    """Every rank's ``obj``, by global rank; ``[obj]`` in a plain process.

    Each rank's row says which call it comes from (``where`` and ``what``): ranks that are
    in different phalanx calls (one re-running ``shard`` while the others ``save``) all
    raise one :class:`DistributedError` naming each rank's call, instead of reading one
    call's row as another's.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    call = f"{where}: {what}"
    table: list[Any] = [None] * dist.get_world_size()
    with collective(where, shard, f"all_gather of {what}"):
        dist.all_gather_object(table, {"call": call, "value": obj}, group=control_group(None))
    calls = [row.get("call") if isinstance(row, dict) else repr(row) for row in table]
    if any(c != call for c in calls):
        raise DistributedError(
            f"{where}: the ranks are not making the same phalanx call: {_by_value(calls)}. "
            f"Every rank must call the same phalanx.distributed functions in the same order "
            f"(a rank that re-runs phalanx.distributed.shard() or skips a save falls out of "
            f"step with the others)."
        )
    return [row["value"] for row in table]


def describe_members(module: nn.Module) -> dict[str, str]:
    """Each stacked tensor's per-member shape and dtype: ``{'module.0.weight': '(8, 6) float64'}``."""
    return {
        k: f"{tuple(v.shape[1:])} {str(v.dtype).removeprefix('torch.')}"
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor)
    }


def _by_value(values: list[Any]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value) if not isinstance(value, str) else value, []).append(rank)
    return "; ".join(f"{value} on ranks {ranks}" for value, ranks in groups.items())


def differences(table: list[dict[str, Any]]) -> list[str]:
    """One line per fact on which the ranks disagree, naming the ranks that hold each value.

    A fact whose value is a dict (such as :func:`describe_members`) is compared entry by
    entry, so a line names the parameter that differs, not the whole structure.
    """
    lines = []
    for fact in table[0]:
        values = [row.get(fact) for row in table]
        if all(v == values[0] for v in values):
            continue
        dicts = [v for v in values if isinstance(v, dict)]
        if len(dicts) == len(values):
            for key in sorted(set().union(*dicts)):
                entry = [v.get(key, "absent") for v in dicts]
                if any(e != entry[0] for e in entry):
                    lines.append(f"{fact} {key!r}: {_by_value(entry)}")
        else:
            lines.append(f"{fact}: {_by_value(values)}")
    return lines
