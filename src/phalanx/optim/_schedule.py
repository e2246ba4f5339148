"""Learning-rate schedules per member: a lambda of factors, or any torch scheduler run for
each member as torch runs it on that member alone."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._base import MemberOptimizer

__all__ = ["MemberLambdaLR", "MemberScheduler"]


class MemberLambdaLR:
    """Sets each member's learning rate to its initial rate times ``lr_lambda(epoch)[i]``.

    It writes ``group["member_lr"]`` and never ``group["lr"]``, so it composes with any torch LR
    scheduler on the same optimizer: member i's rate is then
    ``torch_schedule_factor * initial_member_lr[i] * lr_lambda(epoch)[i]``.

    Args:
        optimizer: a phalanx optimizer.
        lr_lambda: maps the epoch (an int, counted by ``step()``) to an (N,) tensor of factors,
            or to a number for all members.
        last_epoch: the index of the last epoch, -1 to start.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(3, 2))
        >>> opt = phalanx.optim.SGD([w], lr=0.1)
        >>> warmup = torch.tensor([1.0, 2.0, 4.0])  # epochs of linear warm-up, per member
        >>> sched = MemberLambdaLR(opt, lambda e: torch.clamp((e + 1) / warmup, max=1.0))
        >>> opt.param_groups[0]["member_lr"]
        tensor([1.0000, 0.5000, 0.2500], dtype=torch.float64)
    """

    def __init__(
        self,
        optimizer: MemberOptimizer,
        lr_lambda: Callable[[int], Tensor | float],
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(optimizer, MemberOptimizer):
            raise TypeError(
                "phalanx.optim.MemberLambdaLR(): expected a phalanx optimizer "
                f"(a phalanx.optim.MemberOptimizer); got {type(optimizer).__name__}."
            )
        self.optimizer = optimizer
        self.lr_lambda = lr_lambda
        self.last_epoch = last_epoch
        n = optimizer.num_members
        device = optimizer.frozen.device
        self.base_member_lrs = [
            torch.ones(n, dtype=torch.float64, device=device)
            if group["member_lr"] is None
            else group["member_lr"].detach().to(device, torch.float64).expand(n).clone()
            for group in optimizer.param_groups
        ]
        optimizer._attach_schedule(self)  # member surgery moves base_member_lrs' rows
        self.step()

    def _keep_members(self, index: Tensor) -> None:
        """Follows ``optimizer.keep_members``: each group's base rates keep rows ``index``."""
        self.base_member_lrs = [base[index.to(base.device)] for base in self.base_member_lrs]

    def _copy_members(self, src: Tensor, dst: Tensor) -> None:
        """Follows ``optimizer.copy_members``: each target takes its source's base rate."""
        for base in self.base_member_lrs:
            base[dst.to(base.device)] = base[src.to(base.device)]

    def step(self) -> None:
        """Advances one epoch and writes every group's ``member_lr``."""
        self.last_epoch += 1
        factor = torch.as_tensor(self.lr_lambda(self.last_epoch), dtype=torch.float64)
        n = self.optimizer.num_members
        if factor.shape not in {(), (n,)}:
            raise ValueError(
                f"phalanx.optim.MemberLambdaLR.step(): lr_lambda({self.last_epoch}) returned "
                f"shape {tuple(factor.shape)}; expected a number or shape ({n},)."
            )
        for group, base in zip(self.optimizer.param_groups, self.base_member_lrs, strict=True):
            group["member_lr"] = base * factor.to(base.device)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and initial rates; ``lr_lambda`` is code, so it is not saved."""
        return {"last_epoch": self.last_epoch, "base_member_lrs": list(self.base_member_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the epoch and initial rates saved by ``state_dict``."""
        self.last_epoch = int(state_dict["last_epoch"])
        device = self.optimizer.frozen.device
        self.base_member_lrs = [t.to(device, torch.float64) for t in state_dict["base_member_lrs"]]


class _Shadow(torch.optim.Optimizer):
    """A stand-in optimizer with one param group per (group, member): what a torch LR
    scheduler built on it computes for group g*N + i is what it computes for member i alone.
    Its "parameters" are 0-d placeholders that are never stepped."""

    def __init__(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        super().__init__([{**g, "params": [torch.zeros(())]} for g in groups], defaults)
        # torch warns when its scheduler steps before the optimizer has; this one never steps
        self._opt_called = True

    def step(self, closure: Any = None) -> Any:  # steps nothing
        return None


class MemberScheduler:
    """Runs a torch LR scheduler for every member exactly as torch runs it on that member alone.

    ``make(optimizer)`` builds the scheduler; it is called on a stand-in optimizer with one
    param group per member (per param group of ``optimizer``, member-major within it), each
    holding that member's rate as a Python float, so every schedule value (CosineAnnealingLR's
    ``eta_min``, OneCycleLR's ``max_lr``, ReduceLROnPlateau's ``min_lr``) means what it means in
    torch for each member, bit for bit. Arguments torch takes per param group (OneCycleLR's
    or CyclicLR's ``max_lr``, ReduceLROnPlateau's ``min_lr``) may then be given per member, as a
    list of N values. After each ``step`` member i's rate is written to ``member_lr[i]``; a
    scheduler that cycles momentum writes each member's value of the rule's momentum-like
    setting too (its ``SETTINGS`` entry with ``momentum=True``: SGD's momentum, the first of
    Adam's betas), and is refused, as torch refuses it, for a rule without one (Adagrad).
    ``group["lr"]`` (1.0) is left to a torch scheduler of factors, which then scales every
    member's scheduled rate.

    ReduceLROnPlateau watches a metric: here each member has its own scheduler and
    ``step(metrics)`` takes (N,) per-member metrics (a number is every member's).

    Args:
        optimizer: a phalanx optimizer.
        make: builds the torch scheduler from an optimizer, e.g.
            ``lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=100)``.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 1) for _ in range(2)])
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=torch.tensor([0.1, 0.01]))
        >>> sched = phalanx.optim.MemberScheduler(
        ...     opt, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10, eta_min=1e-3))
        >>> for epoch in range(5):
        ...     opt.step()  # after an epoch of training
        ...     sched.step()
        >>> opt.hyperparameters()["lr"]  # halfway down each member's cosine to eta_min
        tensor([0.0505, 0.0055], dtype=torch.float64)
    """

    def __init__(self, optimizer: MemberOptimizer, make: Callable[[Any], Any]) -> None:
        where = "phalanx.optim.MemberScheduler()"
        if not isinstance(optimizer, MemberOptimizer):
            raise TypeError(
                f"{where}: expected a phalanx optimizer (a phalanx.optim.MemberOptimizer); got "
                f"{type(optimizer).__name__}. A torch optimizer takes the torch scheduler as it is."
            )
        self.optimizer = optimizer
        self.make = make
        rates = optimizer.hyperparameters  # (N,) per group: member_lr * lr
        n, groups = optimizer.num_members, len(optimizer.param_groups)
        # the rule's setting torch's cyclic schedulers cycle, from its table (None: it has none)
        self._momentum = next((s for s in optimizer.SETTINGS if s.momentum), None)
        per_member = [[self._shadow_group(rates(g), i) for i in range(n)] for g in range(groups)]
        flat = [per_member[g][i] for g in range(groups) for i in range(n)]
        self.shadows = [_Shadow(flat, self._shadow_defaults())]
        try:
            self.schedulers = [make(self.shadows[0])]
        except ValueError as e:
            if self._momentum is not None or "cycle_momentum" not in str(e):
                raise
            settings = ", ".join(s.name for s in optimizer.SETTINGS)
            raise ValueError(
                f"{where}: the scheduler cycles momentum (cycle_momentum=True, its default), "
                f"and {optimizer._NAME} has no momentum-like setting (its settings: "
                f"{settings}); torch refuses it for torch.optim's {type(optimizer).__name__} "
                f"too ({e}). Pass cycle_momentum=False to schedule the learning rate alone."
            ) from None
        self._plateau = isinstance(self.schedulers[0], torch.optim.lr_scheduler.ReduceLROnPlateau)
        if self._plateau:
            # its state (best, bad epochs) follows one metric: one scheduler per member
            # built once on the stand-in of every (group, member), so a min_lr given per
            # member (a list of N) is read there, then split: member i's scheduler is that one
            # over member i's groups with member i's min_lrs (make() on a one-member stand-in
            # would refuse N min_lrs for its one group)
            self.shadows = [
                _Shadow([row[i] for row in per_member], self._shadow_defaults()) for i in range(n)
            ]
            self.schedulers = [self._plateau_of(shadow, i) for i, shadow in enumerate(self.shadows)]
        for group in optimizer.param_groups:
            if group["member_lr"] is None:  # one rate for all: from now on, one per member
                group["member_lr"] = torch.ones(n, dtype=torch.float64)
                dict.__setitem__(group, "lr", 1.0)
        optimizer._attach_schedule(self)
        self._write()

    def _plateau_of(self, shadow: _Shadow, i: int) -> Any:
        """Member i's ReduceLROnPlateau: the one built over every member's stand-in groups,
        copied onto member i's stand-in with member i's min_lrs."""
        built = self.schedulers[0]
        n = self.optimizer.num_members
        scheduler = copy.copy(built)
        scheduler.optimizer = shadow
        scheduler.min_lrs = [built.min_lrs[g * n + i] for g in range(len(shadow.param_groups))]
        scheduler._last_lr = [float(g["lr"]) for g in shadow.param_groups]
        return scheduler

    def _shadow_key(self) -> str | None:
        """The key torch's cyclic schedulers cycle in the stand-ins: "betas" (its first value)
        for a tuple setting, "momentum" for one value; None for a rule with neither."""
        if self._momentum is None:
            return None
        return "betas" if self._momentum.parts else "momentum"

    def _shadow_defaults(self) -> dict[str, Any]:
        # OneCycleLR and CyclicLR look for momentum or betas here to cycle them
        key = self._shadow_key()
        if key is None:
            return {"lr": 1.0}
        return {"lr": 1.0, key: (0.9, 0.999) if key == "betas" else 0.9}

    def _shadow_group(self, rates: dict[str, Any], i: int) -> dict[str, Any]:
        group: dict[str, Any] = {"lr": float(rates["lr"][i])}
        key, setting = self._shadow_key(), self._momentum
        if key is not None and setting is not None:
            value = rates[setting.name]
            group[key] = tuple(float(b[i]) for b in value) if setting.parts else float(value[i])
        return group

    @property
    def per_member(self) -> bool:
        """True when each member has its own scheduler (ReduceLROnPlateau)."""
        return self._plateau

    def _shadow_groups(self) -> list[list[dict[str, Any]]]:
        """[g][i]: member i's stand-in group in param group g."""
        n, groups = self.optimizer.num_members, len(self.optimizer.param_groups)
        if self.per_member:
            return [[self.shadows[i].param_groups[g] for i in range(n)] for g in range(groups)]
        flat = self.shadows[0].param_groups
        return [flat[g * n : (g + 1) * n] for g in range(groups)]

    def _write(self) -> None:
        """Each member's rate (and cycled momentum) from the stand-ins into the optimizer."""
        cycled = any(getattr(s, "cycle_momentum", False) for s in self.schedulers)
        for group, shadow in zip(self.optimizer.param_groups, self._shadow_groups(), strict=True):
            device = group["params"][0].device
            rates = torch.tensor([float(s["lr"]) for s in shadow], dtype=torch.float64)
            group["member_lr"] = rates.to(device)
            setting, key = self._momentum, self._shadow_key()
            if not cycled or setting is None or key is None:
                continue
            if setting.parts:  # torch cycles the first value of the pair
                first = torch.tensor([float(s[key][0]) for s in shadow], dtype=torch.float64)
                group[setting.name] = (first.to(device), *group[setting.name][1:])
            else:
                value = torch.tensor([float(s[key]) for s in shadow], dtype=torch.float64)
                group[setting.name] = value.to(device)

    def step(self, metrics: Any = None) -> None:
        """Steps every member's schedule; ReduceLROnPlateau takes (N,) per-member metrics."""
        if self.per_member:
            values = torch.as_tensor(metrics, dtype=torch.float64).expand(len(self.schedulers))
            for scheduler, value in zip(self.schedulers, values.tolist(), strict=True):
                scheduler.step(value)
        elif metrics is not None:
            raise ValueError(
                f"phalanx.optim.MemberScheduler.step(): {type(self.schedulers[0]).__name__} "
                "takes no metrics."
            )
        else:
            self.schedulers[0].step()
        self._write()

    def get_last_lr(self) -> list[Tensor]:
        """Per param group, each member's rate after the last step, (N,) float64."""
        return [g["member_lr"].detach().cpu().clone() for g in self.optimizer.param_groups]

    # -------------------------------------------------------------------- member surgery

    def _rows(self, values: list[Any], index: list[int]) -> list[Any]:
        """Reindexes a per-(group, member) list by member ``index``."""
        n = len(values) // len(self.optimizer.param_groups)
        return [copy.deepcopy(values[g * n + i]) for g in range(len(values) // n) for i in index]

    def _per_group_lists(self, scheduler: Any, length: int) -> list[tuple[Any, str]]:
        """(object, attribute) of every per-param-group list of a torch scheduler and of the
        schedulers it chains (SequentialLR, ChainedScheduler)."""
        out = [
            (scheduler, k)
            for k in _PER_GROUP
            if isinstance(getattr(scheduler, k, None), list)
            and len(getattr(scheduler, k)) == length
        ]
        for child in getattr(scheduler, "_schedulers", ()):
            out += self._per_group_lists(child, length)
        return out

    def _keep_members(self, index: Tensor) -> None:
        """Follows ``optimizer.keep_members``: only members ``index`` keep their schedules."""
        keep = index.tolist()
        if self.per_member:
            self.shadows = [self.shadows[i] for i in keep]
            self.schedulers = [self.schedulers[i] for i in keep]
            return
        (shadow,), (scheduler,) = self.shadows, self.schedulers
        old = len(shadow.param_groups)
        for owner, key in self._per_group_lists(scheduler, old):
            setattr(owner, key, self._rows(getattr(owner, key), keep))
        shadow.param_groups = self._rows(shadow.param_groups, keep)

    def _copy_members(self, src: Tensor, dst: Tensor) -> None:
        """Follows ``optimizer.copy_members``: each target takes its source's schedule."""
        pairs = list(zip(src.tolist(), dst.tolist(), strict=True))
        if self.per_member:
            states = {s: copy.deepcopy(self.schedulers[s].state_dict()) for s, _ in pairs}
            groups = {s: copy.deepcopy(self.shadows[s].param_groups) for s, _ in pairs}
            for s, d in pairs:
                self.schedulers[d].load_state_dict(states[s])
                for mine, theirs in zip(self.shadows[d].param_groups, groups[s], strict=True):
                    mine.update({k: v for k, v in theirs.items() if k != "params"})
            return
        (shadow,), (scheduler,) = self.shadows, self.schedulers
        n = self.optimizer.num_members
        length = len(shadow.param_groups)
        lists = [getattr(o, k) for o, k in self._per_group_lists(scheduler, length)]
        lists.append(shadow.param_groups)
        for values in lists:
            before = list(values)
            for g in range(len(values) // n):
                for s, d in pairs:
                    if values is shadow.param_groups:
                        values[g * n + d].update(
                            {
                                k: copy.deepcopy(v)
                                for k, v in before[g * n + s].items()
                                if k != "params"
                            }
                        )
                    else:
                        values[g * n + d] = copy.deepcopy(before[g * n + s])

    # ---------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Every scheduler's state and every member's stand-in rates; ``make`` is code, so it is
        not saved: build the MemberScheduler with it again, then load."""
        return {
            "schedulers": [_plain(s.state_dict()) for s in self.schedulers],
            "shadows": [
                [{k: v for k, v in g.items() if k != "params"} for g in s.param_groups]
                for s in self.shadows
            ],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what ``state_dict`` saved."""
        if len(state_dict["schedulers"]) != len(self.schedulers):
            raise ValueError(
                "phalanx.optim.MemberScheduler.load_state_dict(): the state holds "
                f"{len(state_dict['schedulers'])} schedulers, this one {len(self.schedulers)}; "
                "build it over an optimizer of the same members."
            )
        for scheduler, state in zip(self.schedulers, state_dict["schedulers"], strict=True):
            scheduler.load_state_dict(dict(state))
        for shadow, groups in zip(self.shadows, state_dict["shadows"], strict=True):
            for mine, saved in zip(shadow.param_groups, groups, strict=True):
                mine.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        self._write()


# The per-param-group lists of torch's schedulers (LambdaLR's functions included).
_PER_GROUP = (
    "base_lrs",
    "_last_lr",
    "max_lrs",
    "min_lrs",
    "base_momentums",
    "max_momentums",
    "lr_lambdas",
)


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """A torch scheduler's state without what a checkpoint cannot hold (its functions)."""
    return {k: v for k, v in state.items() if not callable(v) and k != "_scale_fn_ref"}
