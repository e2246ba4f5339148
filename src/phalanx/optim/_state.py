"""The optimizer's state dict: torch's, with per-member rates saved as factors and the
isolation counters, checked against the rule's state names before anything is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ._settings import _Group, _hypers_to, _refer

if TYPE_CHECKING:
    from ._base import MemberOptimizer

__all__ = ["load_state_dict", "state_dict"]


def state_dict(opt: MemberOptimizer) -> dict[str, Any]:
    """torch's optimizer state dict plus the isolation counters under "members".

    A per-member group is saved with ``lr`` as the factor on the members' rates
    (``lr / lr_reference``, 1.0 until a scheduler moves it): the same on every rank of a
    sharded run, whose ranks hold different members (and so different largest rates)."""
    out = torch.optim.Optimizer.state_dict(opt)
    for group in out["param_groups"]:
        reference = group.pop("lr_reference", None)
        if group.get("member_lr") is not None and reference is not None:
            group["lr"] = float(group["lr"]) / reference
            if "initial_lr" in group:
                group["initial_lr"] = float(group["initial_lr"]) / reference
    out["members"] = {
        "last_skipped": opt.last_skipped.clone(),
        "bad_steps": opt.bad_steps.clone(),
        "frozen": opt.frozen.clone(),
    }
    return out


def load_state_dict(opt: MemberOptimizer, state_dict: dict[str, Any]) -> None:
    """Loads a ``state_dict``; step counts and counters move to the parameters' device."""
    state_dict = dict(state_dict)
    members = state_dict.pop("members", None)
    _check_state_names(opt, state_dict)
    torch.optim.Optimizer.load_state_dict(opt, state_dict)
    opt.param_groups = [_Group(group) for group in opt.param_groups]
    for group in opt.param_groups:  # the saved factor back on the largest member's rate
        if group.get("member_lr") is not None and "lr_reference" not in group:
            factor, initial = float(group["lr"]), group.get("initial_lr")
            _refer(group, float(torch.as_tensor(group["member_lr"]).max()))
            reference = group["lr_reference"]
            dict.__setitem__(group, "lr", factor * reference)
            if initial is not None:
                dict.__setitem__(group, "initial_lr", float(initial) * reference)
        group.setdefault("lr_reference", None)
    pairs = [s.name for s in opt.SETTINGS if s.parts]  # a tuple setting, from the table
    for group in opt.param_groups:
        for name in pairs:  # a checkpoint written as JSON or by another tool holds a list
            if isinstance(group.get(name), list):
                dict.__setitem__(group, name, tuple(group[name]))
        _hypers_to(group, group["params"][0].device)
    for p, state in opt.state.items():
        if isinstance(state.get("step"), Tensor):
            state["step"] = state["step"].to(p.device, opt.step_dtype(p.device))
    opt.__dict__["_counts"] = None  # written from outside a step: unknown now
    if members is not None:
        device = opt.frozen.device
        opt.last_skipped = members["last_skipped"].to(device, torch.bool)
        opt.bad_steps = members["bad_steps"].to(device, torch.int64)
        opt.frozen = members["frozen"].to(device, torch.bool)


def _check_state_names(opt: MemberOptimizer, state_dict: dict[str, Any]) -> None:
    """Refuses, before anything is loaded, a state dict whose per-parameter state is not the
    rule's (Adam's ``exp_avg`` in SGD): torch.optim loads it silently and then steps with
    state it never reads, or fails at the first step. The names expected are the rule's
    ``init_state`` under the saved group's hyperparameters, plus "step"."""
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        return  # torch's own load says what is wrong
    if len(groups) != len(opt.param_groups):
        return
    where = f"phalanx.optim.{type(opt).__name__}.load_state_dict()"
    found = []
    for mine, saved in zip(opt.param_groups, groups):
        if not isinstance(saved, dict) or len(saved.get("params", ())) != len(mine["params"]):
            return
        merged = {**mine, **{k: v for k, v in saved.items() if k != "params"}}
        for p, key in zip(mine["params"], saved["params"]):
            entry = state.get(key)
            if not isinstance(entry, dict) or not entry:
                continue
            try:
                want = {"step", *opt.init_state(merged, torch.empty_like(p, device="meta"))}
            except (KeyError, TypeError) as e:
                found.append(f"its param group lacks {e} that {type(opt).__name__} needs")
                break
            have = set(entry)
            if have != want and have - {"step"} != want - {"step"}:
                found.append(
                    f"parameter {key}: state {sorted(have)}, where {type(opt).__name__} keeps "
                    f"{sorted(want)}"
                )
    if found:
        raise ValueError(
            f"{where}: the state dict is not one of this optimizer's (saved by another "
            f"optimizer type?):\n  - "
            + "\n  - ".join(found[:5])
            + "\nLoad it into the optimizer type that saved it, or start this one fresh."
        )
