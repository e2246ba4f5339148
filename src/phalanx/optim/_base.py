"""The base class of phalanx optimizers: per-member hyperparameters, masks and isolation.

Every parameter is a stacked tensor of shape (N, *shape) whose dim 0 is the member axis.
A hyperparameter is a Python number shared by all members or a tensor of shape (N,), one
value per member, broadcast as (N, 1, ...) over each stacked tensor. Updates touch whole
stacked tensors with `torch._foreach_*` ops: the Python loops here run over parameters,
never over members.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, overload

import torch
from torch import Tensor

from phalanx import _torch_compat as compat
from phalanx._warnings import warn

from ._surgery import MemberSurgery

__all__ = ["MemberOptimizer", "NonFiniteWarning"]

# A hyperparameter as the update rules see it: a Python number shared by all members, or
# one tensor per stacked tensor, shaped (N, 1, ..., 1) in that tensor's dtype.
Hyper: TypeAlias = float | list[Tensor]

_EXPECTED = {"nonneg": ">= 0", "unit": "in [0, 1)", "bool": "a bool"}


class NonFiniteWarning(UserWarning):
    """Members were skipped (or frozen) because their loss or gradients were not finite."""


def math_dtype(device: torch.device) -> torch.dtype:
    """The dtype of per-member hyperparameter arithmetic (bias corrections, step sizes).

    float64, as torch.optim computes these in Python floats, so that each member matches
    torch.optim to the last bit; float32 where the device has no float64.
    """
    return torch.float32 if device.type == "mps" else torch.float64


@overload
def views(h: Tensor, like: Sequence[Tensor]) -> list[Tensor]: ...
@overload
def views(h: float, like: Sequence[Tensor]) -> float: ...
@overload
def views(h: float | Tensor, like: Sequence[Tensor]) -> Hyper: ...
def views(h: float | Tensor, like: Sequence[Tensor]) -> Hyper:
    """`h` as the update rules want it: a number, or (N,) -> per-tensor (N, 1, ..., 1) views.

    The (N,) tensor is cast to each tensor's dtype once, exactly as torch casts a Python
    number when it meets a tensor, so `x.mul_(views(h)[i])` rounds like `x.mul_(float(h))`.
    A bool `h` stays bool, for `torch.where`.
    """
    if not isinstance(h, Tensor):
        return h
    cache: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}
    out = []
    for t in like:
        dtype = torch.bool if h.dtype == torch.bool else t.dtype
        key = (t.device, dtype, t.dim())
        if key not in cache:
            cache[key] = h.to(device=t.device, dtype=dtype).view(-1, *([1] * (t.dim() - 1)))
        out.append(cache[key])
    return out


def per_member(h: Any, like: Tensor) -> Any:
    """A number as it is; an (N,) tensor as (N, 1, ..., 1) in ``like``'s dtype and device (bool
    stays bool): how a per-member hyperparameter meets a stacked tensor (``views`` for lists)."""
    if not isinstance(h, Tensor):
        return h
    dtype = torch.bool if h.dtype == torch.bool else like.dtype
    return h.to(device=like.device, dtype=dtype).view(-1, *([1] * (like.dim() - 1)))


def rows(values: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Row j of the (P, N) tensor `values` as (N, 1, ..., 1) in the dtype of `like[j]`.

    One cast per dtype for all P rows: a step costs a few launches, not a few per parameter.
    """
    cast: dict[torch.dtype, Tensor] = {}
    out = []
    for j, t in enumerate(like):
        if t.dtype not in cast:
            cast[t.dtype] = values.to(t.dtype)
        out.append(cast[t.dtype][j].view(-1, *([1] * (t.dim() - 1))))
    return out


def axpy(ys: list[Tensor], xs: list[Tensor], a: Hyper) -> list[Tensor]:
    """`ys + a * xs`, rounded as torch's `y.add(x, alpha=a)` (one fused multiply-add)."""
    if isinstance(a, list):
        return list(compat.foreach_addcmul(ys, xs, a))
    return list(compat.foreach_add(ys, xs, alpha=a))


def _hypers_to(group: dict[str, Any], device: torch.device) -> None:
    """Moves a group's hyperparameter tensors to its parameters' device, once."""
    for key, value in group.items():
        if isinstance(value, Tensor):
            group[key] = value.to(device)
        elif isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value):
            group[key] = tuple(v.to(device) if isinstance(v, Tensor) else v for v in value)


def signed(grads: list[Tensor], maximize: float | Tensor) -> list[Tensor]:
    """The gradients, negated for the members that maximize."""
    if isinstance(maximize, Tensor):
        sign = torch.where(maximize, -1.0, 1.0)  # g * -1 is exactly -g
        return list(compat.foreach_mul(grads, views(sign, grads)))
    return list(compat.foreach_neg(grads)) if maximize else grads


def finite_members(tensors: Sequence[Tensor], n: int, device: torch.device) -> Tensor:
    """(N,) bool: True for members all of whose elements in the (N, ...) tensors are finite."""
    finite = torch.ones(n, dtype=torch.bool, device=device)
    for t in tensors:
        if t.numel():
            # one read of t: min and max are finite iff every element is (NaN propagates)
            low, high = torch.aminmax(t.reshape(n, -1), dim=1)
            finite &= (low.isfinite() & high.isfinite()).to(device)
    return finite


def isolate(
    finite: Tensor, mask: Tensor | None, frozen: Tensor, bad_steps: Tensor, freeze_after: int | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Non-finite isolation, the one rule: which members step, which are skipped, which freeze.

    ``finite`` (N,) bool: members whose loss and gradients are finite; ``mask``: the members
    asked to step (None: all). Counts each skipped member in ``bad_steps`` and, with
    ``freeze_after``, freezes a member after that many, both in place. Returns
    ``(active, skipped, newly_frozen)``, ``newly_frozen`` None without ``freeze_after``.
    """
    considered = ~frozen if mask is None else mask & ~frozen
    skipped = considered & ~finite
    bad_steps += skipped
    newly_frozen = None
    if freeze_after is not None:
        newly_frozen = ~frozen & (bad_steps >= freeze_after)
        frozen |= newly_frozen
    return considered & finite, skipped, newly_frozen


class _Group(dict[str, Any]):
    """A param group that refuses a torch LR scheduler whose values are rates, not factors.

    With per-member learning rates `group["lr"]` is a factor (1.0 at the start) on each
    member's rate, which is what StepLR, ExponentialLR, LambdaLR and the like compute. A
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
                    f"learning rates, so group['lr'] is a factor on each member's rate (1.0 at "
                    f"the start), and {why} is a rate, not a factor: member i would get it "
                    f"times its own rate. Use phalanx.optim.MemberScheduler(opt, lambda o: "
                    f"{type(owner).__module__}.{name}(o, ...)), which runs the scheduler for "
                    f"each member exactly as torch does for that member alone. Schedulers of "
                    f"factors (StepLR, ExponentialLR, LambdaLR, eta_min=0, ...) work as they are."
                )
            return
        frame = frame.f_back


def _absolute_rates(scheduler: Any) -> str | None:
    """What in `scheduler` is an absolute learning rate, or None for a scheduler of factors."""
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


class MemberOptimizer(MemberSurgery, torch.optim.Optimizer):
    """A torch optimizer over stacked parameters whose members are independent experiments.

    Subclasses list their hyperparameters in `_HYPER` and implement `_init_state` and
    `_update`; this class validates hyperparameters, keeps per-member learning rates, applies
    step masks and skips members whose loss or gradients are not finite.

    Learning rates: `group["lr"]` is always a number, so that torch LR schedulers, which
    multiply it or `fill_` it, work unchanged. A per-member learning rate passed as an (N,)
    tensor is kept in `group["member_lr"]` and `group["lr"]` starts at 1.0: member i's rate is
    `group["lr"] * group["member_lr"][i]`. A torch scheduler therefore scales every member's
    rate by one factor; `phalanx.optim.MemberLambdaLR`, or a write to `group["member_lr"]`,
    schedules members separately.

    Member surgery, between steps (see `phalanx.population`): `copy_members(source, target)`
    copies members' optimizer state and hyperparameters, `set_hyperparameters(members, ...)`
    changes some members' hyperparameters, `keep_members(members, params)` drops the others.

    Attributes:
        num_members: N, the size of dim 0 of every parameter.
        last_skipped: (N,) bool, members the last `step` skipped because their loss or
            gradients were not finite (all False unless `skip_nonfinite=True`).
        bad_steps: (N,) int64, how many steps of each member were skipped as non-finite.
        frozen: (N,) bool, members frozen after `freeze_after` non-finite steps; they are not
            updated again until you clear their flag (`opt.frozen[i] = False`).
    """

    # (name, kind) of each hyperparameter besides lr; kind is a key of _EXPECTED.
    _HYPER: tuple[tuple[str, str], ...] = ()
    _NAME = "phalanx.optim.MemberOptimizer"

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        skip_nonfinite: bool = False,
        freeze_after: int | None = None,
        warn_skipped: bool = True,
    ) -> None:
        if freeze_after is not None and not skip_nonfinite:
            raise ValueError(
                f"{self._NAME}(): freeze_after={freeze_after} needs skip_nonfinite=True; "
                "pass skip_nonfinite=True to skip and count non-finite steps."
            )
        if freeze_after is not None and (isinstance(freeze_after, bool) or freeze_after < 1):
            raise ValueError(
                f"{self._NAME}(): freeze_after must be a positive int, the number of "
                f"non-finite steps after which a member is frozen; got {freeze_after!r}."
            )
        self.num_members = -1
        self.skip_nonfinite = skip_nonfinite
        self.freeze_after = freeze_after
        self.warn_skipped = warn_skipped
        super().__init__(params, defaults)
        device = self.param_groups[0]["params"][0].device
        n = self.num_members
        self.last_skipped = torch.zeros(n, dtype=torch.bool, device=device)
        self.bad_steps = torch.zeros(n, dtype=torch.int64, device=device)
        self.frozen = torch.zeros(n, dtype=torch.bool, device=device)

    # What torch's Optimizer.__getstate__ leaves out (it keeps defaults, state and groups):
    # without them a deepcopy or pickle of the optimizer could not step.
    _MEMBER_ATTRS = (
        "num_members",
        "skip_nonfinite",
        "freeze_after",
        "warn_skipped",
        "fused",
        "last_skipped",
        "bad_steps",
        "frozen",
    )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._MEMBER_ATTRS if k in self.__dict__})
        return state

    # ----------------------------------------------------------------------------------------
    # Parameter groups and hyperparameters

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group after checking its member axis and hyperparameters."""
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
        for key in ("lr", *(name for name, _ in self._HYPER)):
            if key in param_group:
                param_group[key] = self._as_hyper(param_group[key], key)
            elif key in self.defaults:
                self.defaults[key] = self._as_hyper(self.defaults[key], key)
        lr = param_group.get("lr", self.defaults.get("lr"))
        if isinstance(lr, Tensor) and lr.dim() > 0:
            param_group["member_lr"] = lr
            param_group["lr"] = 1.0
        super().add_param_group(_Group(param_group))
        group = self.param_groups[-1]
        group.setdefault("member_lr", None)
        if group["member_lr"] is not None:
            group["member_lr"] = self._check_hyper(group["member_lr"], "lr", "nonneg")
        group["lr"] = self._check_hyper(group["lr"], "lr", "nonneg")
        for name, kind in self._HYPER:
            value = group[name]
            if isinstance(value, tuple | list):  # betas
                group[name] = tuple(
                    self._check_hyper(v, f"{name}[{k}]", kind) for k, v in enumerate(value)
                )
            else:
                group[name] = self._check_hyper(value, name, kind)
        if params:
            _hypers_to(group, params[0].device)
        self._check_group(group)

    def _as_hyper(self, value: Any, name: str) -> Any:
        """A hyperparameter given as a list, tuple or numpy array of per-member values as an
        (N,) tensor (float64, or bool for flags); betas' pair keeps its tuple."""
        if name == "betas" and isinstance(value, tuple | list) and len(value) == 2:
            return tuple(self._as_hyper(v, f"{name}[{k}]") for k, v in enumerate(value))
        if isinstance(value, Tensor | bool | int | float) or value is None:
            return value
        if isinstance(value, list | tuple) or type(value).__module__ == "numpy":
            try:
                tensor = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(
                    f"{self._NAME}(): {name} must be a number or one value per member (a "
                    f"tensor, list or numpy array of shape (N,)); got {value!r} ({e})."
                ) from None
            if tensor.dtype == torch.bool:
                return tensor
            if isinstance(value, list | tuple):  # Python floats keep their double values
                tensor = torch.tensor(value, dtype=torch.float64)
            if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
                raise TypeError(
                    f"{self._NAME}(): {name} must hold numbers; got a {tensor.dtype} array."
                )
            return tensor.to(torch.float64) if tensor.dim() else float(tensor)
        return value

    def _check_hyper(self, value: Any, name: str, kind: str) -> Any:
        """Checks one hyperparameter: a number (or bool), or a tensor of shape (N,)."""
        n = self.num_members
        if isinstance(value, Tensor):
            value = value.detach()
            if value.shape not in {(), (n,)}:
                raise ValueError(
                    f"{self._NAME}(): {name} has shape {tuple(value.shape)}; expected a number "
                    f"or a tensor of shape ({n},), one value per member."
                )
            values = value.reshape(-1)
            if kind == "bool":
                if value.dtype != torch.bool:
                    raise ValueError(
                        f"{self._NAME}(): {name} has dtype {value.dtype}; expected a bool or "
                        f"a bool tensor of shape ({n},)."
                    )
                return value
            if not value.is_floating_point():
                value = values = value.double()
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{self._NAME}(): {name} must be a bool; got {value!r}.")
            return value
        else:
            values = torch.tensor([float(value)], dtype=torch.float64)
        bad = ~((values >= 0) & ((values < 1) if kind == "unit" else values.isfinite()))
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            who = f"member {k}" if values.numel() > 1 else "every member"
            raise ValueError(
                f"{self._NAME}(): {name} is {values[k].item()} for {who}; expected "
                f"{_EXPECTED[kind]}."
            )
        return value

    def _values(self, value: Any, device: torch.device) -> float | Tensor:
        """A group's hyperparameter as a number or an (N,) tensor in the math dtype."""
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
        return self._values(group["member_lr"], device) * lr

    # ----------------------------------------------------------------------------------------
    # Stepping

    def _init_state(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> None:
        """Updates `params` and their state in place, every member as if it were alone."""
        raise NotImplementedError

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        mask: Tensor | Sequence[bool] | None = None,
        loss: Tensor | None = None,
    ) -> Any:
        """Takes one optimization step for the members selected by `mask`.

        Args:
            closure: re-evaluates the model and returns the loss, as in torch.optim. If it
                returns an (N,) tensor of per-member losses, `skip_nonfinite` checks them.
            mask: (N,) bool. Members whose flag is False keep their weights and optimizer
                state (step count, moments) bit for bit. None updates every member.
            loss: (N,) per-member losses of this step, checked for non-finite values when
                `skip_nonfinite` is on; gradients are always checked then.

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: `mask` or `loss` is not of shape (N,), or `mask` is not bool.
        """
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        if loss is None and isinstance(result, Tensor) and result.shape == (self.num_members,):
            loss = result
        device = self.frozen.device
        active = None
        if mask is not None:
            active = torch.as_tensor(mask, device=device)
            if active.dtype != torch.bool or active.shape != (self.num_members,):
                raise ValueError(
                    f"{self._NAME}.step(): mask must be a bool tensor of shape "
                    f"({self.num_members},), one flag per member (True: update it); got "
                    f"dtype {active.dtype} and shape {tuple(active.shape)}."
                )
        if self.skip_nonfinite:
            active = self._isolate(active, loss, device)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self._NAME}.step(): sparse gradients are not supported.")
                if not self.state[p]:
                    self._init_state(group, p, self.state[p])
            grads = [p.grad for p in params]
            if active is None:
                self._update(group, params, grads)
                continue
            # Update every member with the same kernels as an unmasked step, so active members
            # match it bit for bit, then put back the masked members' weights and state.
            # Updates are elementwise, so a masked member's NaNs never reach the others.
            guarded = params + [
                t for p in params for t in self.state[p].values() if isinstance(t, Tensor)
            ]
            saved = [t.clone() for t in guarded]
            self._update(group, params, grads)
            for t, s in zip(guarded, saved, strict=True):
                keep = active.to(t.device).view(-1, *([1] * (t.dim() - 1)))
                torch.where(keep, t, s, out=t)
        return result

    def _isolate(
        self, mask: Tensor | None, loss: Tensor | None, device: torch.device
    ) -> Tensor | None:
        """Counts non-finite members and warns; returns the members to update (None: all)."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        finite = finite_members(grads, self.num_members, device)
        if loss is not None:
            if loss.shape != (self.num_members,):
                raise ValueError(
                    f"{self._NAME}.step(): loss must hold one value per member, shape "
                    f"({self.num_members},); got shape {tuple(loss.shape)}. Pass the "
                    "per-member losses, before summing them."
                )
            finite &= torch.isfinite(loss.detach()).to(device)
        active, skipped, newly_frozen = isolate(
            finite, mask, self.frozen, self.bad_steps, self.freeze_after
        )
        self.last_skipped = skipped
        if not self.warn_skipped:
            return active  # no host sync: always the masked path
        if bool(active.all()):
            return None  # the one host sync of a clean step; take the unmasked path
        self.warn_if_skipped(skipped, newly_frozen)
        return active

    def warn_if_skipped(self, skipped: Tensor, newly_frozen: Tensor | None) -> None:
        """Warns which members a step skipped (and froze): the eager and the captured step."""
        if not bool(skipped.any()):
            return
        message = (
            f"{self._NAME}.step(): skipped members {skipped.nonzero().flatten().tolist()}: "
            "their loss or gradients are not finite, so their weights and optimizer state "
            "are unchanged this step (see opt.last_skipped and opt.bad_steps)."
        )
        if newly_frozen is not None and bool(newly_frozen.any()):
            message += (
                f" Members {newly_frozen.nonzero().flatten().tolist()} are now frozen "
                f"after {self.freeze_after} non-finite steps (see opt.frozen)."
            )
        warn(message, NonFiniteWarning)

    # ----------------------------------------------------------------------------------------
    # State

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus the isolation counters under "members"."""
        out = super().state_dict()
        out["members"] = {
            "last_skipped": self.last_skipped.clone(),
            "bad_steps": self.bad_steps.clone(),
            "frozen": self.frozen.clone(),
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a `state_dict`; step counts and counters move to the parameters' device."""
        state_dict = dict(state_dict)
        members = state_dict.pop("members", None)
        super().load_state_dict(state_dict)
        self.param_groups = [_Group(group) for group in self.param_groups]
        for group in self.param_groups:
            _hypers_to(group, group["params"][0].device)
        for p, state in self.state.items():
            if isinstance(state.get("step"), Tensor):
                state["step"] = state["step"].to(p.device, math_dtype(p.device))
        if members is not None:
            device = self.frozen.device
            self.last_skipped = members["last_skipped"].to(device, torch.bool)
            self.bad_steps = members["bad_steps"].to(device, torch.int64)
            self.frozen = members["frozen"].to(device, torch.bool)
