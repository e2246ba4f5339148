"""A dropout rate per member: ``p`` of a Dropout module is a per-member value, as a learning
rate is, so members that differ only in it stack into one stack.

The stack keeps, for each Dropout module whose rate differs between members, an ``(N,)``
float64 tensor of the members' rates (:class:`MemberRates`); a module whose rate every member
shares keeps it as its own ``p``, as before. The loop sets ``module.p`` to member i's rate
(a Python float) while member i runs, so it draws its mask exactly as the member alone. One
vmapped call (``vmap``, ``fused``) puts each member's rate on the module as a 0-d tensor
batched over the members; ``rules._dropout`` routes ``F.dropout`` (and ``dropout1d/2d/3d``)
with a tensor rate to a dropout that keeps each entry with probability ``1 - p_i`` and scales
the kept ones by ``1 / (1 - p_i)``, as ATen does, with the members' masks drawn in one call
(``randomness="different"``: independent per member, not the loop's numbers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from phalanx import _torch_compat as compat

PER_MEMBER_P: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
"""The modules whose ``p`` is a per-member value (exact classes: a subclass may read ``p``
in code of its own)."""


def has_member_p(module: nn.Module) -> bool:
    return type(module) in PER_MEMBER_P


def check_rate(p: Any, where: str, what: str) -> float:
    """``p`` as a float in [0, 1], or a ValueError naming ``what``."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(
            f"{where}: {what} has dropout rate p={p!r}; a dropout rate must be a float in "
            f"[0, 1] (as nn.Dropout requires)."
        )
    return float(p)


def collect_rates(
    members: Sequence[nn.Module], where: str, reference: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The ``(N,)`` float64 rates of each per-member-p module (by its path in ``reference``,
    member 0 by default) whose rate is not the same for every member."""
    reference = members[0] if reference is None else reference
    rates: dict[str, torch.Tensor] = {}
    for path, sub in reference.named_modules(remove_duplicate=False):
        if not has_member_p(sub):
            continue
        ps = [
            check_rate(m.get_submodule(path).p, where, f"member {i} submodule {path!r}")
            for i, m in enumerate(members)
        ]
        if any(p != ps[0] for p in ps):
            rates[path] = torch.tensor(ps, dtype=torch.float64)
    return rates


class MemberRates:
    """The members' dropout rates, put on the stack's module while members run.

    Attributes:
        module: the stack's module (member 0's architecture holding the stacked tensors).
        rates: module path -> ``(N,)`` float64 CPU tensor of the members' rates.
    """

    def __init__(self, module: nn.Module, rates: dict[str, torch.Tensor]) -> None:
        self.module = module
        self.rates = rates
        self._on_device: tuple[Any, dict[str, torch.Tensor]] | None = None

    def subset(self, chosen: Sequence[int] | slice) -> MemberRates:
        index = chosen if isinstance(chosen, slice) else torch.as_tensor(list(chosen))
        return MemberRates(self.module, {k: v[index] for k, v in self.rates.items()})

    def of(self, i: int) -> dict[str, float]:
        return {path: float(v[i]) for path, v in self.rates.items()}

    def run(self, i: int, call: Callable[[], Any]) -> Any:
        """Runs ``call`` with member i's rates as the modules' ``p`` (floats, as alone)."""
        with self.put(self.of(i)):
            return call()

    def device_rates(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The rates on ``device``, to be mapped over by one vmapped call: copied there once
        per change, not on every call."""
        if device.type == "cpu":
            return self.rates
        key = (device, tuple((k, id(v), compat.version(v)) for k, v in self.rates.items()))
        cached = self._on_device
        if cached is None or cached[0] != key:
            dtype = torch.float32 if device.type == "mps" else torch.float64  # mps: no float64
            moved = {k: v.to(device=device, dtype=dtype) for k, v in self.rates.items()}
            cached = self._on_device = (key, moved)
        return cached[1]

    @contextlib.contextmanager
    def put(self, values: dict[str, Any]) -> Iterator[None]:
        """``values`` (a float, or a batched 0-d tensor under vmap) as each module's ``p``
        for the duration, the module's own put back afterwards."""
        owners = [vars(self.module.get_submodule(path)) for path in values]
        own = [d["p"] for d in owners]
        for d, value in zip(owners, values.values()):
            d["p"] = value
        try:
            yield
        finally:
            for d, value in zip(owners, own):
                d["p"] = value
