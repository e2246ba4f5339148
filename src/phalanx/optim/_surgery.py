"""Member surgery on an optimizer: copy member i into member j, set hyperparameters, keep some.

These are what population-based training and early stopping do between steps. Every
operation indexes whole stacked tensors along the member axis: no Python loop over members.
Hyperparameter tensors are replaced, never written in place, since they may share memory
with the tensors the caller passed to the constructor.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from phalanx._members import member_index, pairs

from ._settings import MemberSettings, Setting, lr_factor

__all__ = ["MemberSurgery"]


def _hyper_slots(
    group: dict[str, Any], settings: Iterable[Setting]
) -> list[tuple[str, int | None]]:
    """(key, position) of every setting of a group besides the rate, read from the rule's
    ``SETTINGS``; position indexes a tuple setting (betas)."""
    slots: list[tuple[str, int | None]] = [("member_lr", None)]
    for s in settings:
        if s.kind == "rate":
            continue
        if s.parts:
            slots += [(s.name, k) for k in range(len(s.parts))]
        else:
            slots.append((s.name, None))
    return slots


def _get(group: dict[str, Any], slot: tuple[str, int | None]) -> Any:
    key, k = slot
    return group[key] if k is None else group[key][k]


def _put(group: dict[str, Any], slot: tuple[str, int | None], value: Any) -> None:
    key, k = slot
    if k is None:
        group[key] = value
    else:
        items = list(group[key])
        items[k] = value
        group[key] = tuple(items)


class MemberSurgery(MemberSettings):
    """The member surgery methods of ``MemberOptimizer`` (a base of it; see that class)."""

    # Provided by MemberOptimizer.
    last_skipped: Tensor
    bad_steps: Tensor
    frozen: Tensor

    def member_tensors(self) -> list[Tensor]:
        """Every tensor of the optimizer's state whose dim 0 is the member axis.

        Row i of each is member i's: step counts (N,), moments and momentum buffers
        (N, *shape), and the isolation counters ``last_skipped``, ``bad_steps``, ``frozen`` (N,).
        Hyperparameters are not included (see ``hyperparameters``).
        """
        n = self.num_members
        out = [
            t
            for group in self.param_groups
            for p in group["params"]
            for t in self.state[p].values()
            if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == n
        ]
        return [*out, self.last_skipped, self.bad_steps, self.frozen]

    def hyperparameters(self, group: int = 0) -> dict[str, Tensor | tuple[Tensor, ...]]:
        """Each member's hyperparameters in param group ``group``, as (N,) tensors.

        "lr" is the rate member i steps with, ``member_lr[i] * lr / lr_reference``; tuples
        such as Adam's betas come back as tuples of (N,) tensors. Values are copies.

        Example:
            >>> stack = phalanx.stack([nn.Linear(4, 1) for _ in range(2)])
            >>> opt = phalanx.optim.SGD(stack.parameters(), lr=torch.tensor([0.1, 0.2]))
            >>> opt.hyperparameters()["lr"]
            tensor([0.1000, 0.2000], dtype=torch.float64)
        """
        g = self.param_groups[group]
        n = self.num_members

        def full(value: Any) -> Tensor:
            if isinstance(value, Tensor):
                dtype = torch.bool if value.dtype == torch.bool else torch.float64
                return value.detach().to("cpu", dtype).expand(n).clone()
            if isinstance(value, bool):
                return torch.full((n,), value, dtype=torch.bool)
            return torch.full((n,), float(value), dtype=torch.float64)

        lr = full(g["lr"]) if g["member_lr"] is None else full(g["member_lr"]) * lr_factor(g)
        out: dict[str, Tensor | tuple[Tensor, ...]] = {"lr": lr}
        for s in self.SETTINGS:
            if s.kind != "rate":
                value = g[s.name]
                out[s.name] = tuple(map(full, value)) if s.parts else full(value)
        return out

    @torch.no_grad()
    def set_hyperparameters(self, members: Any = None, **values: Any) -> None:
        """Sets hyperparameters of some members in place, in every param group.

        The next ``step`` uses them; nothing else changes. ``lr`` sets member i's rate to
        ``group["lr"] * value``, which is ``value`` itself unless a torch LR scheduler scales
        ``group["lr"]``.

        Args:
            members: member indices, an (N,) bool mask, or None for every member.
            **values: hyperparameter name (``lr``, ``momentum``, ``betas``, ``eps``, ``weight_decay``,
                ...) to a number for all chosen members or a tensor with one value per chosen
                member; ``betas`` takes a pair of them.

        Raises:
            ValueError: an unknown name, a value of the wrong shape or out of range (the
                message names the member), or ``lr`` of a group whose one rate a torch
                scheduler drives.

        Example:
            >>> stack = phalanx.stack([nn.Linear(4, 1) for _ in range(6)])
            >>> opt = phalanx.optim.SGD(stack.parameters(), lr=0.01)
            >>> opt.set_hyperparameters([3, 5], lr=torch.tensor([0.1, 0.02]), momentum=0.9)
            >>> opt.hyperparameters()["lr"]
            tensor([0.0100, 0.0100, 0.0100, 0.1000, 0.0100, 0.0200], dtype=torch.float64)
        """
        trial = self._trial(members, values, None)
        for group, new in zip(self.param_groups, trial, strict=True):
            group.update(new)

    def check_hyperparameters(
        self, members: Any = None, *, copied_from: Any = None, **values: Any
    ) -> None:
        """Raises what ``set_hyperparameters(members, **values)`` would raise, changing nothing.

        With ``copied_from``, the check is of the state after `copy_members(copied_from,
        members)`: how PBT checks an explore before its exploit copies anything.
        """
        self._trial(members, values, copied_from)

    def _trial(self, members: Any, values: dict[str, Any], copied_from: Any) -> list[dict]:
        """Copies of the param groups with ``values`` written: check first, then write.

        The copies are shallow (hyperparameter tensors are replaced, never written in place),
        so the groups themselves change only when the caller commits the copies.
        """
        where = f"{self._NAME}.set_hyperparameters()"
        names = [s.name for s in self.SETTINGS if s.per_member]
        unknown = [k for k in values if k not in names]
        if unknown:
            raise ValueError(
                f"{where}: {', '.join(map(repr, unknown))} is not a per-member hyperparameter "
                f"of {self._NAME}; choose from {', '.join(names)}."
            )
        index = member_index(members, self.num_members, where)
        trial = [dict(group) for group in self.param_groups]
        if copied_from is not None:
            src, dst = pairs(copied_from, index, self.num_members, where)
            self._copy_hyperparameters(src, dst, trial)
        self._set_in(trial, index, values, where)
        return trial

    def _set_in(
        self, groups: list[dict[str, Any]], index: Tensor, values: dict[str, Any], where: str
    ) -> None:
        settings = {s.name: s for s in self.SETTINGS}
        for g, group in enumerate(groups):
            for name, value in values.items():
                kind = settings[name].kind
                if kind == "rate":
                    self._lr_to_members(group, g, where)
                    self._write(group, ("member_lr", None), index, value, "lr", kind, where)
                elif settings[name].parts:
                    if not isinstance(value, tuple | list) or len(value) != len(group[name]):
                        raise ValueError(
                            f"{where}: {name} takes a tuple of {len(group[name])} values, each "
                            f"a number or a tensor with one value per chosen member; got "
                            f"{value!r}."
                        )
                    for k, v in enumerate(value):
                        self._write(group, (name, k), index, v, f"{name}[{k}]", kind, where)
                else:
                    self._write(group, (name, None), index, value, name, kind, where)
            self._check_group(group, where)

    def _lr_to_members(self, group: dict[str, Any], g: int, where: str) -> None:
        """Moves a group's one learning rate into per-member rates, where that is exact."""
        if group["member_lr"] is not None:
            return
        if "initial_lr" in group:  # a torch LR scheduler owns group["lr"]
            raise ValueError(
                f"{where}: param group {g} has one learning rate for all members, driven by a "
                f"torch LR scheduler; build the optimizer with lr=torch.full((N,), lr) so each "
                f"member has its own rate (the scheduler then scales all of them)."
            )
        rate = float(group["lr"])
        group["member_lr"] = torch.full((self.num_members,), rate, dtype=torch.float64)
        group["lr_reference"] = rate if rate > 0 else 1.0  # group["lr"] stays the true rate
        group["lr"] = group["lr_reference"]

    def _write(
        self,
        group: dict[str, Any],
        slot: tuple[str, int | None],
        index: Tensor,
        value: Any,
        label: str,
        kind: str,
        where: str,
    ) -> None:
        """Writes ``value`` into rows ``index`` of one hyperparameter, made (N,) if it was not."""
        n = self.num_members
        current = _get(group, slot)
        boolean = kind == "flag"
        dtype = torch.bool if boolean else torch.float64
        if isinstance(current, Tensor):
            device = current.device
            full = current.detach().to(dtype=dtype).expand(n).clone()
        else:
            device = group["params"][0].device
            full = torch.full((n,), bool(current) if boolean else float(current), dtype=dtype)
        if isinstance(value, Tensor):
            new = value.detach().cpu()
        else:  # a Python number keeps its double value, as torch.optim would use it
            new = torch.tensor(value, dtype=dtype)
        if new.shape not in {(), (len(index),)}:
            raise ValueError(
                f"{where}: {label} has shape {tuple(new.shape)}; expected a number or one value "
                f"per chosen member, shape ({len(index)},)."
            )
        if boolean and new.dtype != torch.bool:
            raise ValueError(f"{where}: {label} must be a bool or a bool tensor; got {new.dtype}.")
        full[index.to(full.device)] = new.to(full.device, dtype)
        _put(group, slot, self._check_hyper(full, label, kind).to(device))

    @torch.no_grad()
    def copy_members(self, source: Any, target: Any, *, hyperparameters: bool = True) -> None:
        """Makes each target member's optimizer state a copy of its source member's.

        Copies step counts, moments, momentum buffers and isolation counters (a frozen
        target takes its source's flags, so copying a good member over a frozen one revives
        it), and with ``hyperparameters`` every per-member hyperparameter. Copy the weights too
        (``phalanx.population.copy_members`` does both): the target then steps exactly as its
        source would on the same data. Sources are read before any target is written.

        Args:
            source: member indices to copy from.
            target: member indices to copy into, one per source.
            hyperparameters: also copy the per-member hyperparameters.

        Raises:
            ValueError: source and target differ in length, or a target appears twice.
            IndexError: an index is out of range.
        """
        where = f"{self._NAME}.copy_members()"
        src, dst = pairs(source, target, self.num_members, where)
        for t in self.member_tensors():
            t[dst.to(t.device)] = t[src.to(t.device)]
        self.__dict__["_counts"] = None  # counts written: the host's are unknown now
        if hyperparameters:
            self._copy_hyperparameters(src, dst)
            for schedule in self.member_schedules():
                schedule._copy_members(src, dst)

    def _copy_hyperparameters(
        self, src: Tensor, dst: Tensor, groups: list[dict[str, Any]] | None = None
    ) -> None:
        """Each target's per-member hyperparameters become its source's (new tensors)."""
        for group in self.param_groups if groups is None else groups:
            for slot in _hyper_slots(group, self.SETTINGS):
                value = _get(group, slot)
                if isinstance(value, Tensor) and value.shape == (self.num_members,):
                    new = value.clone()
                    new[dst.to(new.device)] = value[src.to(new.device)]
                    _put(group, slot, new)

    def member_rows(self, member: int, *, hyperparameters: bool = True) -> list[Tensor]:
        """Copies of member ``member``'s rows of ``member_tensors()`` and, with
        ``hyperparameters``, of every per-member hyperparameter tensor; see ``set_member_rows``.

        The list's layout depends only on the optimizer's structure, so two optimizers built
        alike (on two ranks) agree on it: what moving one member between processes needs.
        """
        rows = [t[member].clone() for t in self.member_tensors()]
        if hyperparameters:
            rows += [t[member].clone() for t in self._hyper_tensors()]
        return rows

    @torch.no_grad()
    def set_member_rows(
        self, member: int, rows: list[Tensor], *, hyperparameters: bool = True
    ) -> None:
        """Writes rows taken by ``member_rows`` (of any member, any alike optimizer) into
        member ``member``: its optimizer state, counters and, with ``hyperparameters``, its
        hyperparameters."""
        self.__dict__["_counts"] = None  # counts written: the host's are unknown now
        tensors = self.member_tensors()
        if len(rows) != len(tensors) + (len(self._hyper_tensors()) if hyperparameters else 0):
            raise ValueError(
                f"{self._NAME}.set_member_rows(): got {len(rows)} rows, which do not fit this "
                "optimizer; take them with member_rows() from an optimizer built alike, at the "
                "same point (before or after the first step)."
            )
        for t, row in zip(tensors, rows):
            t[member] = row.to(t.device, t.dtype)
        if not hyperparameters:
            return
        hyper_rows = iter(rows[len(tensors) :])
        for group in self.param_groups:
            for slot in _hyper_slots(group, self.SETTINGS):
                value = _get(group, slot)
                if isinstance(value, Tensor) and value.shape == (self.num_members,):
                    new = value.clone()  # never in place: it may be the caller's tensor
                    new[member] = next(hyper_rows).to(new.device, new.dtype)
                    _put(group, slot, new)

    def _hyper_tensors(self) -> list[Tensor]:
        """The per-member (N,) hyperparameter tensors of every group, in a fixed order."""
        return [
            value
            for group in self.param_groups
            for slot in _hyper_slots(group, self.SETTINGS)
            if isinstance(value := _get(group, slot), Tensor) and value.shape == (self.num_members,)
        ]

    @torch.no_grad()
    def keep_members(self, members: Any, params: Iterable[Tensor]) -> None:
        """Keeps only ``members``, in that order, now stepping the smaller stacked ``params``.

        The optimizer changes in place (so a scheduler attached to it keeps working): every
        state tensor, per-member hyperparameter and counter keeps the rows of ``members``, and
        the parameters become ``params``, e.g. those of the stack that
        ``phalanx.population.keep_members`` returns. The kept members then step exactly as
        they would have in the full optimizer.

        Args:
            members: member indices (or an (N,) bool mask) to keep, each at most once.
            params: the new parameters, in the order of the optimizer's parameters over all
                groups, each of shape (len(members), *shape).

        Raises:
            ValueError: a member listed twice, or ``params`` that do not match in number,
                shape, dtype or device.
        """
        self.__dict__["_counts"] = None  # counts written: the host's are unknown now
        where = f"{self._NAME}.keep_members()"
        index = member_index(members, self.num_members, where)
        if len(index.unique()) != len(index):
            raise ValueError(
                f"{where}: members {index.tolist()} lists a member more than once; keep each "
                f"member once (copy_members duplicates a member)."
            )
        if not len(index):
            raise ValueError(f"{where}: keep at least one member.")
        old = [p for group in self.param_groups for p in group["params"]]
        new = list(params)
        k = len(index)
        problems = [] if len(new) == len(old) else [f"{len(new)} parameters given, {len(old)} held"]
        for j, (o, p) in enumerate(zip(old, new)):
            want = (k, *o.shape[1:])
            if tuple(p.shape) != want or p.dtype != o.dtype or p.device != o.device:
                problems.append(
                    f"parameter {j} expected shape {want}, {o.dtype} on {o.device}; got "
                    f"{tuple(p.shape)}, {p.dtype} on {p.device}"
                )
        if problems:
            raise ValueError(
                f"{where}: the new parameters do not fit: " + "; ".join(problems) + ". Pass the "
                "parameters of the kept members' stack in the optimizer's order."
            )
        n = self.num_members
        swap = {id(o): p for o, p in zip(old, new)}
        state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for o in old:
            if o in self.state:
                state[swap[id(o)]] = {key: _rows(v, index, n) for key, v in self.state[o].items()}
        for group in self.param_groups:
            group["params"] = [swap[id(p)] for p in group["params"]]
            for slot in _hyper_slots(group, self.SETTINGS):
                _put(group, slot, _rows(_get(group, slot), index, n))
        self.state = state
        self.num_members = k
        self.last_skipped = self.last_skipped[index.to(self.frozen.device)]
        self.bad_steps = self.bad_steps[index.to(self.frozen.device)]
        self.frozen = self.frozen[index.to(self.frozen.device)]
        for schedule in self.member_schedules():
            schedule._keep_members(index)

    def member_schedules(self) -> list[Any]:
        """The per-member schedules attached to this optimizer (``MemberLambdaLR``,
        ``MemberScheduler``): member surgery moves their per-member state with the members."""
        return list(self.__dict__.get("_member_schedules", ()))

    def _attach_schedule(self, schedule: Any) -> None:
        if "_member_schedules" not in self.__dict__:
            self._member_schedules: weakref.WeakSet[Any] = weakref.WeakSet()
        self._member_schedules.add(schedule)


def _rows(value: Any, index: Tensor, n: int) -> Any:
    """Rows ``index`` of a per-member tensor (dim 0 of size N); anything else as it is."""
    if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
        return value[index.to(value.device)]
    return value
