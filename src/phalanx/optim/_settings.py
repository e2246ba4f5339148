"""A rule's settings: the one table a rule declares, and what reads it.

A rule lists each of its per-member settings once, as ``Setting(name, kind)`` in its
``SETTINGS``: the constructor's checks, the values its update reads, member surgery,
schedulers (which setting torch's cyclic schedulers cycle) and checkpoints all read that
table; nothing guesses a rule's settings from key names.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import torch
from torch import Tensor

from ._arith import math_dtype

__all__ = [
    "MODES",
    "MemberSettings",
    "PerMember",
    "PerMemberFlag",
    "Setting",
    "lr_factor",
    "resolve_mode",
]

#: A hyperparameter as a user passes it: one number for all members, or one per member (an
#: (N,) tensor, a list or tuple of N numbers, a numpy array).
PerMember: TypeAlias = float | Tensor | Sequence[float]
#: A flag as a user passes it: one bool for all members, or an (N,) bool tensor.
PerMemberFlag: TypeAlias = bool | Tensor | Sequence[bool]

#: What each kind of setting must be, as the checks' messages say it.
KINDS = {
    "rate": ">= 0",
    "nonneg": ">= 0",
    "unit": "in [0, 1)",
    "flag": "a bool",
    "option": "one bool for all members",
}


@dataclass(frozen=True)
class Setting:
    """One setting of an update rule, as its ``SETTINGS`` table declares it.

    Attributes:
        name: the param group key and constructor argument (``"betas"``, ``"eps"``).
        kind: what its values must be: ``"rate"`` (the learning rate, >= 0, kept per member
            in ``group["member_lr"]``), ``"nonneg"`` (>= 0, finite), ``"unit"`` (in [0, 1)),
            ``"flag"`` (a bool or an (N,) bool tensor) or ``"option"`` (one bool for all
            members, that the update branches on: Adam's ``amsgrad``; never per member).
        parts: for a tuple of values (Adam's ``betas``), the names the update reads them
            under (``("beta1", "beta2")``), each value of the tuple of ``kind``.
        momentum: the setting torch's cyclic schedulers (OneCycleLR, CyclicLR with
            ``cycle_momentum=True``) cycle: SGD's ``momentum``; the first of ``betas``. A rule
            with none refuses them, as torch does.
    """

    name: str
    kind: str
    parts: tuple[str, ...] = ()
    momentum: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"Setting({self.name!r}): kind {self.kind!r} is not one of {tuple(KINDS)}."
            )

    @property
    def per_member(self) -> bool:
        """Whether each member may have its own value (all but an ``"option"``)."""
        return self.kind != "option"

    @property
    def reads(self) -> tuple[str, ...]:
        """The names the update reads this setting's values under."""
        return self.parts or (self.name,)


#: The optimizer modes: what each member's bits are (docs/concepts/optimizers.md).
#: "fast" (the default): equal to float rounding of the float64 update, at torch's fused speed;
#: "torch": torch.optim's single-tensor arithmetic on member i alone, bit for bit;
#: "fused": torch.optim's fused=True on member i alone, bit for bit.
MODES = ("fast", "torch", "fused")


def resolve_mode(name: str, mode: str | None, fused: bool, *, kernel: bool = True) -> str:
    """The mode an optimizer runs in, from its ``mode=`` and the older ``fused=`` keyword."""
    if mode is not None and mode not in MODES:
        raise ValueError(
            f"{name}(): mode={mode!r} is not one of {MODES}: 'fast' (the default, equal to "
            "float rounding at torch's fused speed), 'torch' (torch.optim's single-tensor "
            "arithmetic per member, bit for bit) or 'fused' (torch.optim's fused=True per member)."
        )
    if fused and mode not in (None, "fused"):
        raise ValueError(
            f"{name}(): fused=True asks for mode='fused', but mode={mode!r} was passed; pass one."
        )
    chosen = "fused" if fused else (mode or "fast")
    if chosen == "fused" and not kernel:
        raise ValueError(
            f"{name}(): mode='fused' needs torch's fused kernel for this rule, which it does "
            "not run (it defines no fused_update); use mode='fast' (the default) or "
            "mode='torch'."
        )
    return chosen


def _hypers_to(group: dict[str, Any], device: torch.device) -> None:
    """Moves a group's hyperparameter tensors to its parameters' device, once."""
    for key, value in group.items():
        if isinstance(value, Tensor):
            group[key] = value.to(device)
        elif isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value):
            group[key] = tuple(v.to(device) if isinstance(v, Tensor) else v for v in value)


def lr_factor(group: dict[str, Any]) -> float:
    """The factor a torch scheduler put on every member's rate in a per-member group:
    ``group["lr"] / group["lr_reference"]``, exactly 1.0 until a scheduler moves ``lr``."""
    return float(group["lr"]) / float(group.get("lr_reference") or 1.0)


def _refer(group: dict[str, Any], largest: float) -> None:
    """Makes ``group["lr"]`` the largest member's rate (a true rate for tools that log it)."""
    reference = largest if largest > 0 else 1.0
    dict.__setitem__(group, "lr", reference)
    dict.__setitem__(group, "lr_reference", reference)


class _Group(dict[str, Any]):
    """A param group that refuses a torch LR scheduler whose values are rates, not factors.

    With per-member learning rates ``group["lr"] / group["lr_reference"]`` is a factor (1.0 at
    the start) on each member's rate, which is what StepLR, ExponentialLR, LambdaLR and the
    like compute. A
    scheduler with an absolute rate in it (CosineAnnealingLR's eta_min, OneCycleLR's max_lr,
    ...) would give member i that rate times its own: refused at its first write, which for
    most schedulers is in their constructor, before the write lands.
    """

    # what torch's schedulers write: OneCycleLR writes initial_lr and momentum first
    _WATCHED = frozenset({"lr", "initial_lr", "max_lr", "min_lr", "momentum", "betas"})

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self._WATCHED and self.get("member_lr") is not None:
            _refuse_absolute_scheduler(self)
        super().__setitem__(key, value)


def _refuse_absolute_scheduler(group: dict[str, Any]) -> None:
    """Raises if a torch LR scheduler with absolute rates is writing into a per-member group."""
    frame: Any = sys._getframe(2)
    for _ in range(8):  # the scheduler's step, get_lr or _update_lr, a few frames up
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if owner is not None and not isinstance(owner, torch.optim.lr_scheduler.LRScheduler):
            return  # the first method up the stack is not a scheduler's: ours or the user's
        if owner is not None:
            why = _absolute_rates(owner)
            if why is not None:
                name = type(owner).__name__
                if getattr(owner, "_is_initial", False):  # its constructor set this one
                    group.pop("initial_lr", None)
                raise ValueError(
                    f"{type(owner).__module__}.{name}(): this phalanx optimizer has per-member "
                    f"learning rates, so group['lr'] / group['lr_reference'] is a factor on "
                    f"each member's rate (1.0 at the start), and {why} is a rate, not a factor: "
                    f"member i would get it times its own rate over the reference. Use phalanx.optim.MemberScheduler(opt, lambda o: "
                    f"{type(owner).__module__}.{name}(o, ...)), which runs the scheduler for "
                    f"each member exactly as torch does for that member alone. Schedulers of "
                    f"factors (StepLR, ExponentialLR, LambdaLR, eta_min=0, ...) work as they are."
                )
            return
        frame = frame.f_back


def _absolute_rates(scheduler: Any) -> str | None:
    """What in ``scheduler`` is an absolute learning rate, or None for a scheduler of factors."""
    lr_scheduler = torch.optim.lr_scheduler
    if isinstance(scheduler, lr_scheduler.OneCycleLR):
        return "max_lr"
    if isinstance(scheduler, lr_scheduler.CyclicLR):
        return "base_lr / max_lr"
    if isinstance(scheduler, torch.optim.swa_utils.SWALR):
        return "swa_lr"
    cosine = (lr_scheduler.CosineAnnealingLR, lr_scheduler.CosineAnnealingWarmRestarts)
    if isinstance(scheduler, cosine) and scheduler.eta_min != 0:
        return f"eta_min={scheduler.eta_min}"
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        if any(scheduler.min_lrs):
            return f"min_lr={scheduler.min_lrs}"
        if scheduler.eps:
            return f"eps={scheduler.eps} (the smallest change of a rate it makes)"
    return None


def as_values(value: Any, name: str, pair: bool, where: str) -> Any:
    """A setting given as a list, tuple or numpy array of per-member values as an (N,) tensor
    (float64, or bool for flags); a tuple setting (``pair``) keeps its tuple."""
    if pair and isinstance(value, tuple | list):
        return tuple(as_values(v, f"{name}[{k}]", False, where) for k, v in enumerate(value))
    if isinstance(value, Tensor | bool | int | float) or value is None:
        return value
    if isinstance(value, list | tuple) or type(value).__module__ == "numpy":
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(
                f"{where}: {name} must be a number or one value per member (a tensor, list or "
                f"numpy array of shape (N,)); got {value!r} ({e})."
            ) from None
        if tensor.dtype == torch.bool:
            return tensor
        if isinstance(value, list | tuple):  # Python floats keep their double values
            tensor = torch.tensor(value, dtype=torch.float64)
        if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"{where}: {name} must hold numbers; got a {tensor.dtype} array.")
        return tensor.to(torch.float64) if tensor.dim() else float(tensor)
    return value


def check_value(value: Any, name: str, kind: str, n: int, where: str) -> Any:
    """Checks one value of a setting of ``kind``: a number (or bool), or a tensor of shape
    (N,); returns it (a tensor detached, an integer tensor as float64)."""
    if kind == "option":
        if isinstance(value, Tensor):
            raise ValueError(f"{where}: {name} must be one bool for all members; got a tensor.")
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be a bool; got {value!r}.")
        return value
    if isinstance(value, Tensor):
        value = value.detach()
        if value.shape not in {(), (n,)}:
            raise ValueError(
                f"{where}: {name} has shape {tuple(value.shape)}; expected a number or a tensor "
                f"of shape ({n},), one value per member."
            )
        values = value.reshape(-1)
        if kind == "flag":
            if value.dtype != torch.bool:
                raise ValueError(
                    f"{where}: {name} has dtype {value.dtype}; expected a bool or a bool "
                    f"tensor of shape ({n},)."
                )
            return value
        if not value.is_floating_point():
            value = values = value.double()
    elif kind == "flag":
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be a bool; got {value!r}.")
        return value
    else:
        values = torch.tensor([float(value)], dtype=torch.float64)
    bad = ~((values >= 0) & ((values < 1) if kind == "unit" else values.isfinite()))
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        who = f"member {k}" if values.numel() > 1 else "every member"
        raise ValueError(
            f"{where}: {name} is {values[k].item()} for {who}; expected {KINDS[kind]}."
        )
    return value


class MemberSettings(torch.optim.Optimizer):
    """A rule's settings in its param groups: checked against the ``SETTINGS`` table when a
    group is added, and read per member for the update (a base of ``MemberOptimizer``)."""

    #: The rule's settings, ``lr`` first: one table for checks, surgery and schedulers.
    SETTINGS: ClassVar[tuple[Setting, ...]] = (Setting("lr", "rate"),)
    #: The optimizer's name in messages (derived from the class by ``MemberOptimizer``).
    _NAME: ClassVar[str] = "phalanx.optim.MemberOptimizer"
    num_members: int

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group after checking its member axis and settings."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for j, p in enumerate(params):
            if not isinstance(p, Tensor):
                continue  # torch's own check gives the message
            if p.dim() == 0 or (self.num_members >= 0 and p.shape[0] != self.num_members):
                raise ValueError(
                    f"{self._NAME}(): parameter {j} of group {len(self.param_groups)} has shape "
                    f"{tuple(p.shape)}, expected (N, *shape) with N = "
                    f"{self.num_members if self.num_members >= 0 else 'the number of members'}"
                    ". Every parameter must be stacked with the member axis first, as "
                    "phalanx.stack(models).parameters() are."
                )
            self.num_members = p.shape[0]
        param_group["params"] = params
        where = f"{self._NAME}()"
        for s in self.SETTINGS:
            pair = bool(s.parts)
            if s.name in param_group:
                param_group[s.name] = as_values(param_group[s.name], s.name, pair, where)
            elif s.name in self.defaults:
                self.defaults[s.name] = as_values(self.defaults[s.name], s.name, pair, where)
        lr = param_group.get("lr", self.defaults.get("lr"))
        if isinstance(lr, Tensor) and lr.dim() > 0:
            param_group["member_lr"] = lr
            param_group["lr"] = 1.0
        super().add_param_group(_Group(param_group))
        group = self.param_groups[-1]
        group.setdefault("member_lr", None)
        if group["member_lr"] is not None:
            group["member_lr"] = self._check_hyper(group["member_lr"], "lr", "rate")
            _refer(group, float(torch.as_tensor(group["member_lr"]).max()))
        group.setdefault("lr_reference", None)
        for s in self.SETTINGS:
            value = group[s.name]
            if s.parts and isinstance(value, tuple | list):
                group[s.name] = tuple(
                    self._check_hyper(v, f"{s.name}[{k}]", s.kind) for k, v in enumerate(value)
                )
            else:
                group[s.name] = self._check_hyper(value, s.name, s.kind)
        if params:
            _hypers_to(group, params[0].device)
        self._check_group(group)

    def _check_hyper(self, value: Any, name: str, kind: str) -> Any:
        """Checks one value of a setting of ``kind``: a number (or bool), or (N,)."""
        return check_value(value, name, kind, self.num_members, f"{self._NAME}()")

    def setting(self, name: str) -> Setting | None:
        """The rule's setting ``name`` in its ``SETTINGS``, or None."""
        return next((s for s in self.SETTINGS if s.name == name), None)

    def _values(self, value: Any, device: torch.device) -> float | Tensor:
        """A group's setting as a number or an (N,) tensor in the math dtype."""
        if isinstance(value, bool):
            return value
        if not isinstance(value, Tensor):
            return float(value)
        if value.shape not in {(), (self.num_members,)}:
            raise ValueError(
                f"{self._NAME}.step(): a param group holds a hyperparameter of shape "
                f"{tuple(value.shape)}; expected a number or shape ({self.num_members},)."
            )
        dtype = torch.bool if value.dtype == torch.bool else math_dtype(device)
        return value.to(device=device, dtype=dtype).expand(self.num_members)

    def _lr(self, group: dict[str, Any], device: torch.device) -> float | Tensor:
        """The learning rate of a group: one number, or (N,) in the math dtype."""
        lr = self._values(group["lr"], device)
        if group["member_lr"] is None:
            return lr
        return self._values(group["member_lr"], device) * lr_factor(group)

    def member_rates(
        self, group: dict[str, Any], device: torch.device
    ) -> dict[torch.dtype, Tensor]:
        """A per-member group's (N,) rates, cast once to each of its parameters' dtypes."""
        rates = self._lr(group, device)
        assert isinstance(rates, Tensor)
        return {p.dtype: rates.to(p.dtype) for p in group["params"]}

    def update_hyperparameters(self, group: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """A group's per-member settings as ``values`` reads them, by ``HYPERPARAMETERS``
        name: each a number shared by all members or an (N,) tensor in the math dtype (bool
        for flags). "lr" is the member's rate (``group["lr"]`` times ``member_lr``); a tuple
        setting gives each value under its part's name (Adam's "beta1" from ``betas``)."""
        out: dict[str, Any] = {}
        for s in self.SETTINGS:
            if s.kind == "rate":
                out[s.name] = self._lr(group, device)
            elif s.parts:
                for part, value in zip(s.parts, group[s.name], strict=True):
                    out[part] = self._values(value, device)
            elif s.per_member:
                out[s.name] = self._values(group[s.name], device)
        return out

    def options(self, group: dict[str, Any]) -> dict[str, Any]:
        """The Python values the update branches on for this group: its ``"option"``
        settings (Adam's ``amsgrad``). The captured graph is specialised on them."""
        return {s.name: bool(group[s.name]) for s in self.SETTINGS if s.kind == "option"}

    def member_hyperparameters(
        self, group: dict[str, Any], device: torch.device
    ) -> dict[str, Tensor]:
        """``update_hyperparameters`` with every value an (N,) tensor (bool for flags): the
        captured step's graph inputs, so that a new value changes an input, not the graph."""
        n = self.num_members
        out = {}
        for name, value in self.update_hyperparameters(group, device).items():
            if isinstance(value, Tensor):
                out[name] = value.contiguous()
            elif isinstance(value, bool):
                out[name] = torch.full((n,), value, device=device)
            else:
                out[name] = torch.full((n,), value, dtype=math_dtype(device), device=device)
        return out

    def _check_group(self, group: dict[str, Any], where: str | None = None) -> None:
        """Checks constraints between a group's settings (SGD's Nesterov rule); ``where``
        names the caller in the error (default: the constructor)."""
