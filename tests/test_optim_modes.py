"""What each optimizer mode promises, member by member.

- "fast" (the default): every member equal to float rounding of the float64 update (no
  further from torch.optim in float64 on that member alone than torch.optim in float32 is, by
  a small factor), with per-member hyperparameters, masks and skip_nonfinite. Where members
  share every hyperparameter and their step counts, it is one call of torch's fused kernel on
  the whole stacked tensors: bit for bit ``torch.optim.X(fused=True)`` on the stacked tensors.
- "torch": torch.optim's single-tensor arithmetic on member i alone, bit for bit
  (tests/test_optim.py, tests/test_optim_inplace.py).
- "fused": torch.optim's fused=True on member i alone, bit for bit (tests/test_optim.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import phalanx

N = 5
SHAPES = [(6, 7), (7,), (3, 1, 5)]
STEPS = 12
RATES = torch.tensor([1e-2, 3e-3, 2e-2, 5e-3, 1e-2], dtype=torch.float64)


class KernelSpy(TorchDispatchMode):
    """Counts calls of torch's fused optimizer kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func).startswith(("aten._fused_adam", "aten._fused_sgd")):
            self.calls += 1
        return func(*args, **(kwargs or {}))


CASES = [
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, False),
    ("Adam", {"lr": 1e-2, "amsgrad": True}, True),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}, True),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1}, False),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "nesterov": True}, True),
]


def _grads(t: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(N, *s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]


@pytest.mark.parametrize(("cls", "kwargs", "member_lr"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_default_mode_is_float_rounding_of_the_float64_update(cls, kwargs, member_lr, masked):
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(N, *s, generator=g, dtype=torch.float64) for s in SHAPES]
    params = [nn.Parameter(b.float()) for b in base]
    ours = {**kwargs, "lr": RATES.clone()} if member_lr else kwargs
    opt = getattr(phalanx.optim, cls)(params, **ours)
    rates = RATES.tolist() if member_lr else [kwargs["lr"]] * N

    def loop(dtype: torch.dtype) -> list[list[nn.Parameter]]:
        refs = [[nn.Parameter(b[i].to(dtype)) for b in base] for i in range(N)]
        opts = [
            getattr(torch.optim, cls)(r, **{**kwargs, "lr": rates[i]}) for i, r in enumerate(refs)
        ]
        for t in range(STEPS):
            for i in range(N):
                if masked and t % 4 == 1 and i == t % N:
                    continue
                for r, z in zip(refs[i], _grads(t, dtype), strict=True):
                    r.grad = z[i] + 0.5 * r.detach()
                opts[i].step()
        return refs

    for t in range(STEPS):
        for p, z in zip(params, _grads(t, torch.float32), strict=True):
            p.grad = z + 0.5 * p.detach()
        mask = torch.arange(N) != t % N if masked and t % 4 == 1 else None
        opt.step(mask=mask)
    exact, float32 = loop(torch.float64), loop(torch.float32)
    for i in range(N):
        for j, p in enumerate(params):
            ours_err = (p[i].double() - exact[i][j]).abs().max().item()
            loop_err = (float32[i][j].double() - exact[i][j]).abs().max().item()
            assert ours_err <= 4 * loop_err + 1e-7, f"member {i} param {j}: {ours_err} {loop_err}"


@pytest.mark.parametrize(("cls", "kwargs"), [(c, k) for c, k, _ in CASES], ids=lambda v: str(v))
def test_shared_values_take_one_fused_call_on_the_stacked_tensors_bit_for_bit(cls, kwargs):
    """One kernel call a step (at any N), bit for bit torch's fused optimizer on the stacked
    tensors. That is not torch's fused kernel on member i alone: the kernel's vector body and
    scalar tail round differently and a member's elements fall in either by its offset."""
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(N, *s, generator=g)) for s in SHAPES]
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    opt = getattr(phalanx.optim, cls)(params, **kwargs)
    ref = getattr(torch.optim, cls)(refs, **kwargs, fused=True)
    for t in range(6):
        for p, r, z in zip(params, refs, _grads(t, torch.float32), strict=True):
            p.grad, r.grad = z.clone(), z.clone()
        with KernelSpy() as spy:
            opt.step()
        ref.step()
        assert spy.calls == 1, f"step {t}: {spy.calls} kernel calls"
    for j, (p, r) in enumerate(zip(params, refs, strict=True)):
        assert torch.equal(p, r), f"param {j}"
        for key, value in ref.state[r].items():
            if key != "step":
                assert torch.equal(opt.state[p][key], value), f"param {j} {key}"


def test_a_mask_leaves_the_fast_kernel_and_a_load_of_shared_counts_returns_to_it() -> None:
    p = nn.Parameter(torch.randn(N, 4))
    opt = phalanx.optim.Adam([p], lr=1e-2)
    twin = phalanx.optim.Adam([nn.Parameter(p.detach().clone())], lr=1e-2, mode="torch")

    def step(mask: torch.Tensor | None = None) -> int:
        p.grad = torch.ones_like(p)
        with KernelSpy() as spy:
            opt.step(mask=mask)
        return spy.calls

    assert step() == 1
    assert step(torch.arange(N) != 2) == 0  # member 2 a step behind: blocked arithmetic
    assert step() == 0  # the counts may differ now: never one count for all
    assert opt.state[p]["step"].tolist() == [3, 3, 2, 3, 3]
    opt.state[p]["step"].fill_(3)  # shared again (a load reads them: one host read)
    state = copy.deepcopy(opt.state_dict())
    fresh = phalanx.optim.Adam([p], lr=1e-2)
    fresh.load_state_dict(state)
    twin.load_state_dict(state)
    assert fresh.state[p]["step"].dtype == torch.float32
    assert twin.state[twin.param_groups[0]["params"][0]]["step"].dtype == torch.float64
    p.grad = torch.ones_like(p)
    with KernelSpy() as spy:
        fresh.step()
    assert spy.calls == 1
    assert fresh.state[p]["step"].tolist() == [4.0] * N


def test_mode_keyword_is_checked() -> None:
    w = [nn.Parameter(torch.zeros(2, 3))]
    with pytest.raises(ValueError, match=r"mode='exact' is not one of"):
        phalanx.optim.Adam(w, mode="exact")
    with pytest.raises(ValueError, match=r"fused=True asks for mode='fused'"):
        phalanx.optim.SGD(w, fused=True, mode="torch")
    with pytest.raises(ValueError, match=r"Lion\(\): mode='fused' needs torch's fused kernel"):
        phalanx.optim.Lion(w, mode="fused")
    assert phalanx.optim.AdamW(w, fused=True).mode == "fused"
    assert phalanx.optim.AdamW(w).mode == "fast"


def test_group_lr_is_a_true_rate_for_tools_that_log_it() -> None:
    """group["lr"] is the largest member's rate (the one all members share, if they do), so a
    tool that logs param_groups[i]["lr"] (Lightning's LearningRateMonitor) logs a true rate;
    schedulers still scale every member by one factor."""
    w = [nn.Parameter(torch.zeros(3, 2))]
    opt = phalanx.optim.Adam(w, lr=[1e-3, 1e-2, 1e-4])
    group = opt.param_groups[0]
    assert group["lr"] == 1e-2 and "lr: 0.01" in repr(opt)
    assert opt.hyperparameters()["lr"].tolist() == [1e-3, 1e-2, 1e-4]  # exactly, no rounding
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    w[0].grad = torch.ones_like(w[0])
    opt.step()
    sched.step()
    assert group["lr"] == 5e-3
    assert opt.hyperparameters()["lr"].tolist() == [5e-4, 5e-3, 5e-5]
    assert phalanx.optim.SGD(w, lr=[0.1, 0.1, 0.1]).param_groups[0]["lr"] == 0.1
    assert phalanx.optim.SGD(w, lr=torch.zeros(3)).param_groups[0]["lr"] == 1.0  # all 0: 1.0


def test_a_checkpoint_keeps_the_factor_so_ranks_with_other_members_save_alike() -> None:
    """Saved, a per-member group's lr is the factor on the members' rates (1.0, then what a
    scheduler made it): the same on two ranks holding different members; loaded, group["lr"]
    is a true rate again, and every member's rate is as it was."""
    w1, w2 = [nn.Parameter(torch.zeros(2, 3))], [nn.Parameter(torch.zeros(2, 3))]
    a = phalanx.optim.SGD(w1, lr=[0.1, 0.2])
    b = phalanx.optim.SGD(w2, lr=[0.3, 0.4])
    for opt, w in ((a, w1), (b, w2)):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        w[0].grad = torch.zeros_like(w[0])
        opt.step()
        sched.step()
    saved = [o.state_dict()["param_groups"][0] for o in (a, b)]
    assert saved[0]["lr"] == saved[1]["lr"] == 0.5 and saved[0]["initial_lr"] == 1.0
    assert "lr_reference" not in saved[0]
    fresh = phalanx.optim.SGD(w1, lr=[0.1, 0.2])
    fresh.load_state_dict(copy.deepcopy(a.state_dict()))
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.1)
    torch.testing.assert_close(fresh.hyperparameters()["lr"], a.hyperparameters()["lr"])


@pytest.mark.parametrize(
    ("cls", "kwargs", "kernel"),
    [
        ("Adam", {}, True),
        ("AdamW", {"weight_decay": 0.1}, True),
        ("Adam", {"weight_decay": 0.1}, False),  # coupled decay reads the parameter: blocked
        ("SGD", {"momentum": 0.9}, False),
    ],
)
def test_per_member_rates_take_the_fused_kernel_where_the_step_is_linear_in_lr(
    cls, kwargs, kernel
) -> None:
    p = nn.Parameter(torch.randn(N, 4, 3))
    opt = getattr(phalanx.optim, cls)([p], lr=RATES.clone(), **kwargs)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        with KernelSpy() as spy:
            opt.step()
        assert (spy.calls > 0) == kernel
