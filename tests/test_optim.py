"""phalanx.optim against torch.optim: member i of a stacked run equals torch.optim on member i.

Every case runs N members with per-member hyperparameters for 20 steps and compares each
member with torch.optim's single-tensor optimizer run on that member alone, with that member's
hyperparameters as Python numbers. The gradient is `0.5 * weight + noise`, computed
elementwise, so it depends on the trajectory and is bit-identical in both runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from helpers import assert_close, make_members

N = 4
STEPS = 20
# On this code path each member is in fact bit-identical to torch.optim (the same kernels,
# with (N, 1, ...) tensors where torch has Python floats); the tolerances leave room for
# CPUs whose kernels fuse multiply-adds differently.
TIGHT = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-7},
    torch.float64: {"rtol": 1e-13, "atol": 1e-15},
}
SHAPES = [(5, 3), (5,), ()]  # a matrix, a vector and a scalar per member


def per_member(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@dataclass
class Case:
    name: str
    ours: type
    theirs: type
    kwargs: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("sgd_plain", phalanx.optim.SGD, torch.optim.SGD, {"lr": 0.1}),
    Case(
        "sgd_member_lr_momentum_dampening_decay",
        phalanx.optim.SGD,
        torch.optim.SGD,
        {
            "lr": per_member([0.1, 0.05, 0.2, 0.01]),
            "momentum": per_member([0.0, 0.9, 0.5, 0.99]),
            "dampening": per_member([0.0, 0.1, 0.5, 0.0]),
            "weight_decay": per_member([0.0, 1e-2, 0.1, 1e-4]),
        },
    ),
    Case(
        "sgd_member_nesterov_maximize",
        phalanx.optim.SGD,
        torch.optim.SGD,
        {
            "lr": 0.05,
            "momentum": per_member([0.9, 0.5, 0.8, 0.7]),
            "nesterov": torch.tensor([True, False, True, False]),
            "maximize": torch.tensor([False, False, True, True]),
            "weight_decay": 1e-3,
        },
    ),
    Case(
        "sgd_nesterov_float",
        phalanx.optim.SGD,
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    ),
    Case("adam_defaults", phalanx.optim.Adam, torch.optim.Adam, {"lr": 1e-2}),
    Case(
        "adam_member_everything",
        phalanx.optim.Adam,
        torch.optim.Adam,
        {
            "lr": per_member([1e-1, 1e-2, 1e-3, 3e-2]),
            "betas": (per_member([0.9, 0.8, 0.0, 0.95]), per_member([0.999, 0.9, 0.99, 0.5])),
            "eps": per_member([1e-8, 1e-3, 1e-6, 1.0]),
            "weight_decay": per_member([0.0, 1e-2, 0.1, 1e-4]),
            "maximize": torch.tensor([False, True, False, True]),
        },
    ),
    Case(
        "adam_amsgrad_float32_lr",
        phalanx.optim.Adam,
        torch.optim.Adam,
        # a float32 tensor: member i's lr is the float32 value, as float(lr[i]) gives torch
        {"lr": torch.logspace(-3, -1, N), "amsgrad": True, "weight_decay": 1e-2},
    ),
    Case(
        "adamw_member_lr_decay",
        phalanx.optim.AdamW,
        torch.optim.AdamW,
        {"lr": per_member([1e-1, 1e-2, 1e-3, 3e-2]), "weight_decay": per_member([0, 1, 0.1, 1e-2])},
    ),
    Case(
        "adamw_amsgrad_member_betas",
        phalanx.optim.AdamW,
        torch.optim.AdamW,
        {"lr": 1e-2, "betas": (0.9, per_member([0.999, 0.9, 0.99, 0.5])), "amsgrad": True},
    ),
]


def member_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """Member i's hyperparameters as Python numbers, for torch.optim."""

    def pick(v: Any) -> Any:
        if isinstance(v, tuple):
            return tuple(pick(x) for x in v)
        if isinstance(v, torch.Tensor):
            return bool(v[i]) if v.dtype == torch.bool else float(v[i])
        return v

    return {k: pick(v) for k, v in kwargs.items()}


def make_params(dtype: torch.dtype, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(N, *s, generator=g, dtype=dtype)) for s in SHAPES]


def grads_from(params: list[torch.Tensor], noise: list[torch.Tensor]) -> list[torch.Tensor]:
    return [0.5 * p.detach() + z for p, z in zip(params, noise, strict=True)]


class Reference:
    """torch.optim on each member alone."""

    def __init__(self, case: Case, params: list[nn.Parameter], **extra: Any) -> None:
        self.members = [[nn.Parameter(p[i].detach().clone()) for p in params] for i in range(N)]
        self.opts = [
            case.theirs(self.members[i], **member_kwargs(case.kwargs, i), **extra) for i in range(N)
        ]

    def step(self, noise: list[torch.Tensor], mask: torch.Tensor | None = None) -> None:
        for i, (member, opt) in enumerate(zip(self.members, self.opts, strict=True)):
            if mask is not None and not mask[i]:
                continue
            for r, g in zip(member, grads_from(member, [z[i] for z in noise]), strict=True):
                r.grad = g
            opt.step()

    def assert_matches(self, params: list[torch.Tensor], dtype: torch.dtype) -> None:
        for i, member in enumerate(self.members):
            for j, (p, r) in enumerate(zip(params, member, strict=True)):
                torch.testing.assert_close(
                    p[i].detach(), r.detach(), **TIGHT[dtype], msg=f"member {i} param {j}"
                )


def noise_stream(params: list[torch.Tensor], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def train_alongside(opt, ref: Reference, params, steps: int, schedulers=()) -> None:
    """`steps` steps of `opt` and of the per-member reference on the same noise gradients,
    each followed by a step of every scheduler in `schedulers`."""
    noise = noise_stream(params)
    for _ in range(steps):
        z = next(noise)
        for p, g in zip(params, grads_from(params, z), strict=True):
            p.grad = g
        opt.step()
        ref.step(z)
        for s in schedulers:
            s.step()


# ---------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_member_matches_torch_optim_alone(case: Case, dtype: torch.dtype) -> None:
    params = make_params(dtype)
    opt = case.ours(params, **case.kwargs)
    ref = Reference(case, params)
    train_alongside(opt, ref, params, STEPS)
    ref.assert_matches(params, dtype)
    # the optimizer state too: per-member step counts and moments
    for p, j in zip(params, range(len(params)), strict=True):
        for i in range(N):
            theirs = ref.opts[i].state[ref.members[i][j]]
            for key, value in opt.state[p].items():
                expected = theirs.get(key)
                if key == "step":
                    assert float(value[i]) == STEPS  # torch's SGD keeps no count
                    assert expected is None or float(expected) == STEPS
                elif expected is not None:
                    torch.testing.assert_close(value[i], expected, **TIGHT[dtype])


def test_trains_a_stack_like_torch_optim_trains_each_model() -> None:
    """Through phalanx.stack: Adam with a per-member lr on real gradients of an MLP."""
    from helpers import ARCHS, member_loss

    arch = ARCHS[1]  # Linear(10, 20) -> ReLU -> Linear(20, 2)
    members = make_members(arch, N)
    stack = phalanx.stack([m for m in members])
    lrs = torch.logspace(-3, -1, N)
    opt = phalanx.optim.Adam(stack.parameters(), lr=lrs)
    refs = [torch.optim.Adam(m.parameters(), lr=float(lrs[i])) for i, m in enumerate(members)]
    torch.manual_seed(0)
    for _ in range(10):
        x = torch.randn(16, 10)
        out = stack(x)
        opt.zero_grad()
        sum(member_loss(out[i]) for i in range(N)).backward()
        opt.step()
        for m, r in zip(members, refs, strict=True):
            r.zero_grad()
            member_loss(m(x)).backward()
            r.step()
    for i, m in enumerate(stack.unstack()):
        assert_close(
            dict(m.named_parameters()),
            dict(members[i].named_parameters()),
            trajectory=True,
            msg=f"member {i}",
        )


# ---------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5], CASES[8]], ids=lambda c: c.name)
def test_masked_members_keep_weights_and_state(case: Case, dtype: torch.dtype) -> None:
    params = make_params(dtype)
    opt = case.ours(params, **case.kwargs)
    ref = Reference(case, params)
    noise = noise_stream(params)
    g = torch.Generator().manual_seed(7)
    taken = torch.zeros(N, dtype=torch.long)
    for t in range(STEPS):
        mask = torch.rand(N, generator=g) < 0.6
        if t == 0:
            mask[0] = False  # member 0 starts late: its first step (buffer init) comes later
        taken += mask
        z = next(noise)
        for p, grad in zip(params, grads_from(params, z), strict=True):
            p.grad = grad
            p.grad[~mask] = float("nan")  # a masked member's NaNs must not leak anywhere
        before = [p.detach().clone() for p in params]
        state_before = {
            (j, k): v.clone() for j, p in enumerate(params) for k, v in opt.state[p].items()
        }
        opt.step(mask=mask)
        ref.step(z, mask)
        for j, p in enumerate(params):
            assert torch.equal(p[~mask], before[j][~mask]), f"step {t}: masked weights moved"
            for k, v in opt.state[p].items():
                if (j, k) in state_before:
                    old = state_before[(j, k)]
                    assert torch.equal(v[~mask], old[~mask]), f"step {t}: masked {k} moved"
    ref.assert_matches(params, dtype)
    for p in params:
        assert torch.equal(opt.state[p]["step"].long(), taken)


def test_mask_must_be_bool_of_shape_n() -> None:
    params = make_params(torch.float32)
    opt = phalanx.optim.SGD(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(
        ValueError,
        match=r"SGD.step\(\): mask must be a bool tensor of shape \(4,\).*got dtype torch.bool and shape \(3,\)",
    ):
        opt.step(mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got dtype torch.int64"):
        opt.step(mask=torch.ones(4, dtype=torch.long))


# ----------------------------------------------------------------------------- schedulers


SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 / (1 + e)),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_torch_schedulers_scale_every_member_rate(name: str) -> None:
    dtype = torch.float64
    case = Case(
        "adam", phalanx.optim.Adam, torch.optim.Adam, {"lr": per_member([1e-1, 1e-2, 1e-3, 3e-2])}
    )
    params = make_params(dtype)
    opt = case.ours(params, **case.kwargs)
    sched = SCHEDULERS[name](opt)
    ref = Reference(case, params)
    ref_scheds = [SCHEDULERS[name](o) for o in ref.opts]
    train_alongside(opt, ref, params, 12, [sched, *ref_scheds])
    # lr * factor vs factor * lr rounds differently in the last bit: close, not identical
    for i, member in enumerate(ref.members):
        for p, r in zip(params, member, strict=True):
            torch.testing.assert_close(p[i].detach(), r.detach(), rtol=1e-12, atol=1e-14)
    # group["lr"] is a true rate: the largest member's (member 0 here), as tools log it
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_scheds[0].get_last_lr()[0])


def test_float_lr_with_scheduler_is_exact() -> None:
    case = Case("sgd", phalanx.optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    params = make_params(torch.float64)
    opt = case.ours(params, **case.kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    ref = Reference(case, params)
    ref_scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3) for o in ref.opts]
    train_alongside(opt, ref, params, 8, [sched, *ref_scheds])
    for i, member in enumerate(ref.members):
        for p, r in zip(params, member, strict=True):
            assert torch.equal(p[i].detach(), r.detach())


def test_member_lambda_lr_gives_each_member_its_own_schedule() -> None:
    """Per-member warm-up lengths, composed with a torch StepLR on the shared factor."""
    dtype = torch.float64
    warmup = torch.tensor([1.0, 2.0, 4.0, 8.0])
    base = per_member([1e-1, 1e-2, 1e-3, 3e-2])
    case = Case("sgd", phalanx.optim.SGD, torch.optim.SGD, {"lr": base, "momentum": 0.9})
    params = make_params(dtype)
    opt = case.ours(params, **case.kwargs)
    member_sched = phalanx.optim.MemberLambdaLR(opt, lambda e: torch.clamp((e + 1) / warmup, max=1))
    shared_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ref = Reference(case, params)
    ref_scheds = [
        torch.optim.lr_scheduler.LambdaLR(
            o, lambda e, w=float(warmup[i]): min((e + 1) / w, 1.0) * 0.5 ** (e // 5)
        )
        for i, o in enumerate(ref.opts)
    ]
    train_alongside(opt, ref, params, 12, [member_sched, shared_sched, *ref_scheds])
    for i, member in enumerate(ref.members):
        for p, r in zip(params, member, strict=True):
            torch.testing.assert_close(p[i].detach(), r.detach(), rtol=1e-12, atol=1e-14)
    group = opt.param_groups[0]
    lr_now = group["member_lr"] * (group["lr"] / group["lr_reference"])
    expected = torch.tensor([s.get_last_lr()[0] for s in ref_scheds], dtype=torch.float64)
    torch.testing.assert_close(lr_now, expected)
    assert member_sched.state_dict()["last_epoch"] == 12


def test_member_lambda_lr_needs_a_phalanx_optimizer() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match=r"MemberLambdaLR\(\): expected a phalanx optimizer"):
        phalanx.optim.MemberLambdaLR(opt, lambda e: 1.0)  # type: ignore[arg-type]


# -------------------------------------------------------------------- closure, state, errors


def test_step_with_closure_returns_its_loss() -> None:
    w = nn.Parameter(torch.ones(3, 2))
    opt = phalanx.optim.SGD([w], lr=per_member([0.1, 0.2, 0.3]))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss.detach()

    loss = opt.step(closure)
    assert loss.item() == 6.0
    torch.testing.assert_close(w[:, 0].detach(), torch.tensor([0.8, 0.6, 0.4]))


def test_state_dict_round_trip_continues_identically() -> None:
    case = CASES[5]
    params = make_params(torch.float32)
    opt = case.ours(params, **case.kwargs)
    noise = noise_stream(params)
    for _ in range(3):
        for p, g in zip(params, grads_from(params, next(noise)), strict=True):
            p.grad = g
        opt.step(mask=torch.tensor([True, False, True, True]))
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    opt2 = case.ours(copies, **case.kwargs)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # state_dict() aliases live state
    for _ in range(3):
        z = next(noise)
        for ps, o in ((params, opt), (copies, opt2)):
            for p, g in zip(ps, grads_from(ps, z), strict=True):
                p.grad = g
            o.step()
    for a, b in zip(params, copies, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda ps: phalanx.optim.Adam(ps, lr=torch.ones(3)),
            r"Adam\(\): lr has shape \(3,\); expected a number or a tensor of shape \(4,\)",
        ),
        (
            lambda ps: phalanx.optim.SGD(ps, lr=per_member([0.1, 0.1, -1.0, 0.1])),
            r"SGD\(\): lr is -1.0 for member 2; expected >= 0",
        ),
        (
            lambda ps: phalanx.optim.Adam(ps, betas=(0.9, per_member([0.9, 1.0, 0.9, 0.9]))),
            r"Adam\(\): betas\[1\] is 1.0 for member 1; expected in \[0, 1\)",
        ),
        (
            lambda ps: phalanx.optim.SGD(
                ps, lr=0.1, momentum=per_member([0.9, 0, 0.9, 0.9]), nesterov=True
            ),
            r"SGD\(\): member 1 uses Nesterov momentum with momentum=0.0 and dampening=0.0",
        ),
        (
            lambda ps: phalanx.optim.SGD(ps, lr=0.1, nesterov=torch.ones(4)),
            r"SGD\(\): nesterov has dtype torch.float32; expected a bool",
        ),
        (
            lambda ps: phalanx.optim.SGD([*ps, nn.Parameter(torch.zeros(5, 2))], lr=0.1),
            r"SGD\(\): parameter 3 of group 0 has shape \(5, 2\), expected \(N, \*shape\) with N = 4",
        ),
        (
            lambda ps: phalanx.optim.Adam(ps, freeze_after=3),
            r"Adam\(\): freeze_after=3 needs skip_nonfinite=True",
        ),
        (
            lambda ps: phalanx.optim.Adam(ps, amsgrad=torch.ones(4, dtype=torch.bool)),
            r"Adam\(\): amsgrad must be one bool for all members",
        ),
    ],
)
def test_bad_arguments_are_named(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(make_params(torch.float32))


BIT_CASES = [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2}),
    ("Adam", {"lr": 1e-2}),
    ("Adam", {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1, "amsgrad": True}),
    ("AdamW", {"lr": 1e-2}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    # Without amsgrad a shared-number step takes torch's own operations on whole tensors:
    ("Adam", {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1, "maximize": True}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(("cls", "kwargs"), BIT_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("shared_lr", [True, False], ids=["shared_lr", "member_lr"])
def test_member_bits_do_not_depend_on_n_masks_or_kernel(cls, kwargs, shared_lr, dtype) -> None:
    """mode="torch": each member equals torch.optim on that member alone bit for bit, whatever the number
    of members, a mask on another member, or one shared lr against an (N,) tensor of it.
    torch's fused Adam kernel (once taken for one shared lr) fails this: its vectorised body
    and scalar tail round differently, so a member's bits depended on its offset in the
    stack, i.e. on N, and a mask moved everyone off it. In float64 a shared lr also failed:
    `lr / tensor` is torch's reciprocal-then-multiply, not torch.optim's division."""
    shapes = [(16, 6), (16,), (3, 16), (3,), (7,)]  # sizes that are no multiple of a vector
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(8, *s, generator=g, dtype=dtype) for s in shapes]
    for n in (1, 2, 3, 5):
        for mask_at in (None, 3):
            params = [nn.Parameter(b[:n].clone()) for b in base]
            ours = dict(kwargs)
            if not shared_lr:
                ours["lr"] = torch.full((n,), kwargs["lr"], dtype=torch.float64)
            opt = getattr(phalanx.optim, cls)(params, **ours, mode="torch")
            refs = [[nn.Parameter(b[i].clone()) for b in base] for i in range(n)]
            ref_opts = [getattr(torch.optim, cls)(r, **kwargs) for r in refs]
            noise = torch.Generator().manual_seed(1)
            for t in range(8):
                z = [torch.randn(8, *s, generator=noise, dtype=dtype) for s in shapes]
                for p, zj in zip(params, z, strict=True):
                    p.grad = 0.5 * p.detach() + zj[:n]
                mask = torch.arange(n) != n - 1 if t == mask_at else None
                opt.step(mask=mask)
                for i in range(n):
                    if mask is not None and not mask[i]:
                        continue
                    for r, zj in zip(refs[i], z, strict=True):
                        r.grad = 0.5 * r.detach() + zj[i]
                    ref_opts[i].step()
            for i in range(n):
                for j, (p, r) in enumerate(zip(params, refs[i], strict=True)):
                    assert torch.equal(p[i], r), f"N={n} mask at {mask_at}: member {i} param {j}"


FUSED_CASES = [
    ("Adam", {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}),
    ("Adam", {"lr": 1e-2, "amsgrad": True, "maximize": True}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("SGD", {"lr": 0.1}),
]


@pytest.mark.parametrize(("cls", "kwargs"), FUSED_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("member_lr", [False, True], ids=["shared_lr", "member_lr"])
def test_fused_true_is_torchs_fused_kernel_on_each_member_alone_bit_for_bit(
    cls, kwargs, member_lr
) -> None:
    """fused=True promises torch.optim's fused=True on member i alone, bit for bit, whatever
    N, masks on other members and per-member rates (members that share every value share a
    kernel call; each member's view is its own tensor to the kernel, with its own vector
    body and tail). Sizes are no multiple of a vector, so the tail is exercised."""
    shapes = [(16, 6), (16,), (3, 16), (7,)]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(8, *s, generator=g) for s in shapes]
    for n in (1, 3, 5):
        params = [nn.Parameter(b[:n].clone()) for b in base]
        rates = [kwargs["lr"] * (1 + i % 2) if member_lr else kwargs["lr"] for i in range(n)]
        ours = {**kwargs, "lr": torch.tensor(rates, dtype=torch.float64)} if member_lr else kwargs
        opt = getattr(phalanx.optim, cls)(params, **ours, fused=True)
        refs = [[nn.Parameter(b[i].clone()) for b in base] for i in range(n)]
        ref_opts = [
            getattr(torch.optim, cls)(r, **{**kwargs, "lr": rates[i]}, fused=True)
            for i, r in enumerate(refs)
        ]
        noise = torch.Generator().manual_seed(1)
        for t in range(6):
            z = [torch.randn(8, *s, generator=noise) for s in shapes]
            for p, zj in zip(params, z, strict=True):
                p.grad = 0.5 * p.detach() + zj[:n]
            mask = torch.arange(n) != t % n if t >= 3 else None  # member t % n is a step behind
            opt.step(mask=mask)
            for i in range(n):
                if mask is not None and not mask[i]:
                    continue
                for r, zj in zip(refs[i], z, strict=True):
                    r.grad = 0.5 * r.detach() + zj[i]
                ref_opts[i].step()
        for i in range(n):
            for j, (p, r) in enumerate(zip(params, refs[i], strict=True)):
                assert torch.equal(p[i], r), f"{cls} N={n}: member {i} param {j}"


@pytest.mark.parametrize(("cls", "kwargs"), FUSED_CASES[::2], ids=lambda v: str(v))
def test_fused_true_writes_what_the_tensors_hold_now_after_they_change_between_steps(
    cls, kwargs
) -> None:
    """The members' views torch's kernel takes are kept across steps: a parameter given new
    memory (``.data`` assigned), a state loaded, a copy of the optimizer each step what they
    hold now, bit for bit torch's fused optimizer on each member alone."""
    n, shapes = 3, [(5, 7), (9,)]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, *s, generator=g) for s in shapes]
    params = [nn.Parameter(b.clone()) for b in base]
    opt = getattr(phalanx.optim, cls)(params, **kwargs, fused=True)
    refs = [[nn.Parameter(b[i].clone()) for b in base] for i in range(n)]
    ref_opts = [getattr(torch.optim, cls)(r, **kwargs, fused=True) for r in refs]
    noise = torch.Generator().manual_seed(1)

    def step(ps, o, rs, ros) -> None:
        z = [torch.randn(n, *s, generator=noise) for s in shapes]
        for p, zj in zip(ps, z, strict=True):
            p.grad = 0.5 * p.detach() + zj
        o.step()
        for i in range(n):
            for r, zj in zip(rs[i], z, strict=True):
                r.grad = 0.5 * r.detach() + zj[i]
            ros[i].step()

    for t in range(6):
        if t == 2:  # new memory for a parameter, and for a state loaded into the optimizer
            params[0].data = params[0].data.clone()
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        step(params, opt, refs, ref_opts)
    twin = copy.deepcopy({"params": params, "opt": opt})  # a copy steps its own tensors
    twin_refs = copy.deepcopy({"refs": refs, "opts": ref_opts})
    step(twin["params"], twin["opt"], twin_refs["refs"], twin_refs["opts"])
    step(params, opt, refs, ref_opts)
    for ps, rs in ((params, refs), (twin["params"], twin_refs["refs"])):
        for i in range(n):
            for j, (p, r) in enumerate(zip(ps, rs[i], strict=True)):
                assert torch.equal(p[i], r), f"{cls}: member {i} param {j}"
    assert not torch.equal(params[0], twin["params"][0])  # the two runs did part


def test_fused_true_on_a_strided_parameter_warns_and_runs_the_default_arithmetic() -> None:
    w = nn.Parameter(torch.randn(4, 3, 2).transpose(1, 2))  # members' views not contiguous
    ref = nn.Parameter(w.detach().clone())
    opt = phalanx.optim.Adam([w], lr=1e-2, fused=True)
    ref_opt = phalanx.optim.Adam([ref], lr=1e-2)
    w.grad, ref.grad = torch.ones_like(w), torch.ones_like(w)
    with pytest.warns(UserWarning, match=r"Adam\(fused=True\): .* not contiguous.*single-tensor"):
        opt.step()
    ref_opt.step()
    assert torch.equal(w, ref)


# ---------------------------------------------------------------------------- member surgery


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hyperparameters_set_in_place_equal_those_given_at_construction(case: Case) -> None:
    """An optimizer built with shared defaults, then given every member's hyperparameters by
    set_hyperparameters, steps bit for bit as one built with them: a number and an (N,)
    tensor of it take the same arithmetic (in float64 too)."""
    params, other = make_params(torch.float64), make_params(torch.float64)
    # mode="torch": one arithmetic whatever the form (the default runs torch's fused kernel on
    # shared numbers and the blocked arithmetic on tensors: equal to float rounding)
    built = case.ours(params, mode="torch", **case.kwargs)
    plain = {k: v for k, v in case.kwargs.items() if k == "amsgrad"}
    later = case.ours(other, mode="torch", **plain)
    later.set_hyperparameters(**{k: v for k, v in case.kwargs.items() if k != "amsgrad"})
    noise = [torch.randn_like(p) for p in params]
    for _ in range(3):
        for ps, opt in ((params, built), (other, later)):
            for p, g in zip(ps, grads_from(ps, noise)):
                p.grad = g
            opt.step()
    for p, q in zip(params, other):
        assert torch.equal(q, p)
    for name, value in built.hyperparameters().items():
        assert_close(later.hyperparameters()[name], value, dtype=torch.float64, msg=name)


def test_set_copy_keep_member_rows() -> None:
    params = make_params(torch.float32)
    opt = phalanx.optim.Adam(params, lr=1e-2, betas=(0.9, per_member([0.9, 0.99, 0.999, 0.5])))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step(mask=torch.tensor([True, True, False, True]))
    opt.set_hyperparameters([1, 3], lr=per_member([0.5, 0.25]), eps=1e-6)
    assert opt.hyperparameters()["lr"].tolist() == [1e-2, 0.5, 1e-2, 0.25]
    assert opt.hyperparameters()["eps"].tolist() == [1e-8, 1e-6, 1e-8, 1e-6]
    opt.copy_members([1], [2])
    assert opt.state[params[0]]["step"].tolist() == [1, 1, 1, 1]
    rows_1, rows_2 = opt.member_rows(1), opt.member_rows(2)
    assert len(rows_1) == len(rows_2) > 0
    assert all(torch.equal(a, b) for a, b in zip(rows_1, rows_2))
    new = [nn.Parameter(p.detach()[[2, 0]].clone()) for p in params]
    opt.keep_members([2, 0], new)
    assert opt.num_members == 2 and opt.hyperparameters()["lr"].tolist() == [0.5, 1e-2]
    assert opt.hyperparameters()["betas"][1].tolist() == pytest.approx([0.99, 0.9])
    assert opt.state[new[0]]["exp_avg"].shape == (2, 5, 3) and params[0] not in opt.state


def test_surgery_does_not_write_the_callers_tensors() -> None:
    lrs = per_member([0.1, 0.2, 0.3, 0.4])
    opt = phalanx.optim.SGD(make_params(torch.float32), lr=lrs)
    opt.set_hyperparameters([0], lr=1.0)
    opt.copy_members([0], [1])
    assert lrs.tolist() == [0.1, 0.2, 0.3, 0.4]


def test_surgery_errors_are_named() -> None:
    params = make_params(torch.float32)
    opt = phalanx.optim.SGD(params, lr=0.1, momentum=0.9)
    with pytest.raises(
        ValueError,
        match=r"SGD.set_hyperparameters\(\): 'betas' is not a per-member hyperparameter of phalanx.optim.SGD; choose from lr, momentum",
    ):
        opt.set_hyperparameters(betas=(0.9, 0.9))
    with pytest.raises(ValueError, match=r"lr is -1.0 for member 2; expected >= 0"):
        opt.set_hyperparameters([2], lr=-1.0)
    with pytest.raises(
        ValueError,
        match=r"lr has shape \(3,\); expected a number or one value per chosen member, shape \(2,\)",
    ):
        opt.set_hyperparameters([0, 1], lr=torch.ones(3))
    with pytest.raises(ValueError, match=r"member 1 uses Nesterov momentum with momentum=0.0"):
        opt.set_hyperparameters([1], nesterov=True, momentum=0.0)
    with pytest.raises(IndexError, match=r"copy_members\(\): source members \[9\] out of range"):
        opt.copy_members([9], [0])
    with pytest.raises(
        ValueError, match=r"keep_members\(\): members \[1, 1\] lists a member more than once"
    ):
        opt.keep_members([1, 1], params)
    with pytest.raises(
        ValueError, match=r"parameter 0 expected shape \(2, 5, 3\).*got \(4, 5, 3\)"
    ):
        opt.keep_members([0, 1], params)
    adam = phalanx.optim.Adam(make_params(torch.float32), lr=0.1)
    with pytest.raises(ValueError, match=r"'amsgrad' is not a per-member hyperparameter"):
        adam.set_hyperparameters(amsgrad=True)
    scheduled = phalanx.optim.SGD(make_params(torch.float32), lr=0.1)
    torch.optim.lr_scheduler.StepLR(scheduled, step_size=1)
    with pytest.raises(
        ValueError,
        match=r"param group 0 has one learning rate for all members, driven by a torch LR scheduler",
    ):
        scheduled.set_hyperparameters([0], lr=0.5)


# ---------------------------------------------------------------------------- copies


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_continues_exactly_as_the_original(how: str) -> None:
    """torch's Optimizer.__getstate__ keeps only defaults, state and groups; the member
    counters and flags must travel too, or the copy cannot step."""
    import pickle

    params = make_params(torch.float32)
    opt = phalanx.optim.Adam(params, lr=per_member([1e-1, 1e-2, 1e-3, 3e-2]), skip_nonfinite=True)
    noise = noise_stream(params)
    z = next(noise)
    for p, g in zip(params, grads_from(params, z)):
        p.grad = g
    opt.step(mask=torch.tensor([True, False, True, True]))
    opt.frozen[2] = True
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert (
        twin.num_members == N
        and twin.skip_nonfinite
        and twin.frozen.tolist() == opt.frozen.tolist()
    )
    for _ in range(3):
        z = next(noise)
        for ps, o in ((params, opt), (twin_params, twin)):
            for p, g in zip(ps, grads_from(ps, z)):
                p.grad = g
            o.step()
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)
    assert twin.state_dict()["members"]["frozen"].tolist() == [False, False, True, False]


@pytest.mark.parametrize("kind", ["list", "tuple", "numpy"])
def test_hyperparameters_as_lists_or_arrays_mean_per_member_values(kind: str) -> None:
    import numpy as np

    values = [1e-1, 1e-2, 1e-3, 3e-2]
    given = {"list": list, "tuple": tuple, "numpy": np.array}[kind](values)
    params, other = make_params(torch.float32), make_params(torch.float32)
    a = phalanx.optim.Adam(params, lr=given, betas=(given, 0.99))
    b = phalanx.optim.Adam(other, lr=per_member(values), betas=(per_member(values), 0.99))
    assert torch.equal(a.hyperparameters()["lr"], b.hyperparameters()["lr"])
    assert torch.equal(a.hyperparameters()["betas"][0], b.hyperparameters()["betas"][0])
    with pytest.raises(ValueError, match=r"lr has shape \(3,\); expected a number or a tensor"):
        phalanx.optim.SGD(make_params(torch.float32), lr=[0.1, 0.2, 0.3])
    with pytest.raises(TypeError, match=r"lr must be a number or one value per member"):
        phalanx.optim.SGD(make_params(torch.float32), lr=[0.1, "fast", 0.3, 0.1])


@pytest.mark.parametrize(("cls", "kwargs"), BIT_CASES[:5], ids=lambda v: str(v))
def test_blocks_and_sixteen_members_keep_each_members_bits(monkeypatch, cls, kwargs) -> None:
    """The eager step runs the rule on blocks (here 64 elements: a member's rows split, and
    several members' rows in one block) and 16 members (where torch's vectorised pow of the
    step counts rounded bias corrections differently from torch.optim's Python pow): each
    member is still torch.optim on that member alone, bit for bit, masks included (mode="torch",
    the mode that promises it)."""
    monkeypatch.setattr(getattr(phalanx.optim, cls), "BLOCK", 64)
    n, shapes = 16, [(10, 13), (5,)]
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, *s, generator=g)) for s in shapes]
    refs = [[nn.Parameter(p[i].detach().clone()) for p in params] for i in range(n)]
    lr = torch.linspace(1e-3, 1e-1, n, dtype=torch.float64)
    opt = getattr(phalanx.optim, cls)(params, **{**kwargs, "lr": lr}, mode="torch")
    ref_opts = [
        getattr(torch.optim, cls)(r, **{**kwargs, "lr": float(lr[i])}) for i, r in enumerate(refs)
    ]
    for t in range(12):
        z = [torch.randn(n, *s, generator=g) for s in shapes]
        for p, zj in zip(params, z, strict=True):
            p.grad = 0.5 * p.detach() + zj
        mask = torch.arange(n) % 3 != t % 3 if t % 4 == 3 else None
        opt.step(mask=mask)
        for i in range(n):
            if mask is not None and not mask[i]:
                continue
            for r, zj in zip(refs[i], z, strict=True):
                r.grad = 0.5 * r.detach() + zj[i]
            ref_opts[i].step()
    for i in range(n):
        for j, (p, r) in enumerate(zip(params, refs[i], strict=True)):
            assert torch.equal(p[i], r), f"member {i} param {j}"


def test_a_state_dict_of_another_optimizer_type_is_refused_before_loading():
    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(3)])
    stack(torch.randn(4, 3)).sum().backward()
    adam = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    adam.step()
    sgd = phalanx.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    before = copy.deepcopy(sgd.state_dict())
    with pytest.raises(ValueError, match=r"(?s)SGD.load_state_dict\(\): the state dict is not one of "
                       r"this optimizer's.*\['exp_avg', 'exp_avg_sq', 'step'\], where SGD keeps "
                       r"\['momentum_buffer', 'step'\]"):  # fmt: skip
        sgd.load_state_dict(adam.state_dict())
    after = sgd.state_dict()  # nothing was loaded
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][k]["momentum_buffer"], v["momentum_buffer"])
               for k, v in before["state"].items())  # fmt: skip
    with pytest.raises(ValueError, match=r"where Adam keeps \['exp_avg', 'exp_avg_sq', 'step'\]"):
        adam.load_state_dict(sgd.state_dict())
    torch_adam = torch.optim.Adam(stack.parameters(), lr=1e-2)  # the same rule's state loads
    torch_adam.step()
    adam.load_state_dict(torch_adam.state_dict())
