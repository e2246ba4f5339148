"""The optimizer's steady step makes no host synchronisation and no blocking host->device copy.

Counted on the CPU with a TorchFunctionMode (value reads: ``bool``, ``.item()``, ``.tolist()``,
...; tensors made from Python data: ``torch.tensor``, ``torch.as_tensor``) and a
TorchDispatchMode (aten ops that read values: ``_local_scalar_dense``, ``nonzero``, ...): on a
GPU each one makes the host wait for the device. The budget of each optimizer path is asserted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import phalanx

_READS = {
    "TensorBase.__bool__",
    "TensorBase.__float__",
    "TensorBase.__int__",
    "TensorBase.__index__",
    "TensorBase.item",
    "TensorBase.tolist",
    "TensorBase.numpy",
    "TensorBase.nonzero",
    "_VariableFunctionsClass.nonzero",
    "_VariableFunctionsClass.equal",
    "TensorBase.equal",
}
_FROM_DATA = {"_VariableFunctionsClass.tensor", "_VariableFunctionsClass.as_tensor"}
_ATEN_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero")


class Syncs(TorchFunctionMode):
    """Counts host reads and tensors made from Python data (outermost calls only)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.depth = 0
        self.dispatch = _AtenReads(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__qualname__", str(func))
        if self.depth == 0 and name in _READS:
            self.events.append(name)
            self.depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.depth -= 1
        if (
            self.depth == 0
            and name in _FROM_DATA
            and args
            and not isinstance(args[0], torch.Tensor)
        ):
            self.events.append(name)
        return func(*args, **kwargs)

    def __enter__(self) -> Syncs:
        super().__enter__()
        self.dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.dispatch.__exit__(*exc)
        super().__exit__(*exc)


class _AtenReads(TorchDispatchMode):
    def __init__(self, outer: Syncs) -> None:
        super().__init__()
        self.outer = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.outer.depth == 0 and str(func).startswith(_ATEN_READS):
            self.outer.events.append(str(func))
        return func(*args, **(kwargs or {}))


N = 4
SHAPES = [(N, 6, 5), (N, 6), (N, 1, 7)]


def _steady(cls: str, *, mask: bool = False, skip: bool = False, warn: bool = True, **kwargs):
    """Syncs of one steady-state step (after three uncounted ones)."""
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]
    opt = getattr(phalanx.optim, cls)(params, **kwargs, skip_nonfinite=skip, warn_skipped=warn)
    flags = torch.tensor([True, False, True, True]) if mask else None
    for t in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if t < 3:
            opt.step(mask=flags)
            continue
        with Syncs() as counted:
            opt.step(mask=flags)
    return counted.events


MEMBER_LR = torch.tensor([1e-2, 2e-2, 3e-2, 4e-2], dtype=torch.float64)
RULES = [
    ("Adam", {"lr": 1e-2}),
    ("Adam", {"lr": MEMBER_LR, "weight_decay": 0.1}),
    ("AdamW", {"lr": 1e-2, "betas": (torch.full((N,), 0.9, dtype=torch.float64), 0.99)}),
    ("Adam", {"lr": 1e-2, "mode": "torch"}),
    ("SGD", {"lr": 1e-2, "momentum": 0.9}),
    ("SGD", {"lr": MEMBER_LR, "momentum": 0.9, "dampening": 0.1}),
    ("SGD", {"lr": 1e-2}),
    ("Lion", {"lr": 1e-3}),
    ("Lion", {"lr": MEMBER_LR}),
]


@pytest.mark.parametrize(("cls", "kwargs"), RULES, ids=lambda v: str(v)[:60])
@pytest.mark.parametrize("mask", [False, True], ids=["no_mask", "mask"])
def test_the_default_step_reads_nothing_from_the_device(cls, kwargs, mask) -> None:
    """0 on the default step, with and without a mask, with per-member hyperparameters."""
    assert _steady(cls, mask=mask, **kwargs) == []


@pytest.mark.parametrize(("cls", "kwargs"), RULES[:2] + RULES[4:5], ids=lambda v: str(v)[:60])
def test_skip_nonfinite_reads_one_value_for_its_warning(cls, kwargs) -> None:
    """skip_nonfinite: one read (whether any member was skipped, for the warning); none with
    warn_skipped=False. Before: one, two when a member was skipped, three with a mask."""
    assert len(_steady(cls, skip=True, **kwargs)) == 1
    assert len(_steady(cls, skip=True, mask=True, **kwargs)) == 1
    assert _steady(cls, skip=True, warn=False, mask=True, **kwargs) == []


@pytest.mark.parametrize(("cls", "kwargs"), [RULES[0], RULES[1], RULES[4], RULES[5]])
def test_fused_true_with_per_member_values_reads_them_once_not_every_step(cls, kwargs) -> None:
    """fused=True reads each member's values once (one kernel call per distinct value) and
    keeps them until the group changes; SGD's first-step flag comes from the host's count."""
    assert _steady(cls, fused=True, **kwargs) == []


def test_fused_true_reads_the_values_again_after_a_scheduler_writes_them() -> None:
    p = nn.Parameter(torch.randn(N, 3))
    opt = phalanx.optim.Adam([p], lr=MEMBER_LR.clone(), fused=True)
    ref = [nn.Parameter(p[i].detach().clone()) for i in range(N)]
    ref_opts = [
        torch.optim.Adam([r], lr=float(MEMBER_LR[i]), fused=True) for i, r in enumerate(ref)
    ]
    for t in range(3):
        if t == 2:
            opt.param_groups[0]["member_lr"].mul_(0.5)  # in place: the same tensor object
            for o in ref_opts:
                o.param_groups[0]["lr"] *= 0.5
        p.grad = torch.ones_like(p)
        opt.step()
        for r, o in zip(ref, ref_opts, strict=True):
            r.grad = torch.ones_like(r)
            o.step()
    for i in range(N):
        assert torch.equal(p[i], ref[i]), f"member {i}"
