"""The sync budget: host synchronisations and blocking copies per steady-state training step.

On a GPU each sync (a read of a tensor's value: ``bool()``, ``.tolist()``, ``torch.equal``...)
makes the host wait until the device has run everything queued, and each blocking copy
(Python data straight onto the device) waits for the stream: the launch-bound steps phalanx
is for lose their overlap. ``sync_counter`` counts both on the CPU, where the suite runs, one
step after warm-up steps, on each main path. The budget: none on the default eager and
captured steps, with and without clipping and masks; at most one where a warning needs a
value (``skip_nonfinite``), read as late as it can be; at most one for a routed call (its
counts become shapes). A new path comes with its budget here.

``test_outside_the_optimizer`` holds every path to its budget for the syncs made outside
``phalanx/optim/``; a path whose optimizer still makes a sync it should not is marked in the
table's last column ("s" syncs, "c" copies) and runs as a strict xfail until fixed.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.step._api import compile_step
from sync_counter import Counts, counting

N = 4
OPTIMIZER = "the optimizer still makes a sync or a blocking copy on this path"


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )  # fmt: skip


def _setup(kind: str, b: int = 8) -> tuple[phalanx.Stack, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    stack = phalanx.stack([_mlp() if kind == "mlp" else _cnn() for _ in range(N)])
    x = torch.randn(b, 6) if kind == "mlp" else torch.randn(b, 2, 6, 6)
    return stack, x, torch.randint(0, 3, (b,))


def _optimizer(stack: phalanx.Stack, name: str, member_lr: bool, **kw):
    lr = torch.logspace(-4, -2, N) if member_lr else 1e-3
    if name == "SGD":
        return phalanx.optim.SGD(stack.parameters(), lr=lr, momentum=0.9, **kw)
    if name == "Lion":
        return phalanx.optim.Lion(stack.parameters(), lr=lr, **kw)
    return phalanx.optim.Adam(stack.parameters(), lr=lr, **kw)


def eager(kind="mlp", opt="Adam", *, clip=False, mask=False, scaler=False, overflow=False,
          member_lr=False, warm=2, **kw) -> Counts:  # fmt: skip
    """One eager step (forward, losses, backward, clipping, step), counted after ``warm``."""
    stack, x, y = _setup(kind)
    optimizer = _optimizer(stack, opt, member_lr, **kw)
    sc = phalanx.MemberGradScaler(N, device="cpu") if scaler else None
    m = torch.tensor([True, False] * (N // 2)) if mask else None
    counts = Counts()
    for k in range(warm + 1):
        with counting() if k == warm else _nothing() as c:
            optimizer.zero_grad(set_to_none=True)
            losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
            (sc.scale(losses) if sc is not None else losses.sum()).backward()
            if overflow:
                with torch.no_grad():
                    next(iter(stack.parameters())).grad[1].fill_(float("inf"))
            if clip:
                if sc is not None:
                    sc.unscale_(optimizer)
                phalanx.clip_grad_norm_(stack.parameters(), 1.0)
            if sc is not None:
                sc.step(optimizer, mask=m)
                sc.update()
            else:
                skip = kw.get("skip_nonfinite", False)
                optimizer.step(mask=m, loss=losses.detach() if skip else None)
        counts = c if c is not None else counts
    return counts


def captured(kind="mlp", *, clip=False, mask=False, member_lr=False, **kw) -> Counts:
    """One captured step (``compile_step``, aot_eager) in its steady state."""
    stack, x, y = _setup(kind)
    optimizer = _optimizer(stack, "Adam", member_lr, **kw)
    step = compile_step(
        stack, F.cross_entropy, optimizer, max_norm=1.0 if clip else None,
        backend="aot_eager", prefer="captured", warmup_steps=1,
    )  # fmt: skip
    m = torch.tensor([True, False] * (N // 2)) if mask else None
    for _ in range(3):  # an eager warm-up, the capture, one captured step
        step(x, y, mask=m)
    assert step.choice == "captured", step.report
    with counting() as c:
        step(x, y, mask=m)
    return c


def routed(kind="mlp", how="members", warm=2) -> Counts:
    """One routed forward and backward."""
    stack, x, _ = _setup(kind, 16)
    index = torch.randint(0, N, (16,), generator=torch.Generator().manual_seed(1))
    if how in ("members", "kept"):
        kw = {"members": index}
    else:
        kw = {"subset": [0, 2] if how == "scattered" else [1, 2]}
    counts = Counts()
    for k in range(warm + 1):
        with counting() if k == warm else _nothing() as c:
            stack.zero_grad(set_to_none=True)
            if how == "members":  # a new index tensor each call: sorted, its one host read
                kw = {"members": index.clone()}
            stack(x, **kw).square().mean().backward()
        counts = c if c is not None else counts
    return counts


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


# name: (what runs, syncs allowed, blocking copies allowed, the optimizer's own in the way)
# The last column marks the optimizer's known remaining syncs ("s") and copies ("c"): none now.
BUDGET: dict[str, tuple[Callable[[], Counts], int, int, str]] = {
    "eager default (mlp)": (lambda: eager("mlp"), 0, 0, ""),
    "eager default (cnn, BatchNorm)": (lambda: eager("cnn"), 0, 0, ""),
    "eager per-member lr": (lambda: eager(member_lr=True), 0, 0, ""),
    "eager fused=True": (lambda: eager(fused=True), 0, 0, ""),
    "eager fused=True, per-member lr": (lambda: eager(fused=True, member_lr=True), 0, 0, ""),
    "eager + clip_grad_norm_": (lambda: eager(clip=True, member_lr=True), 0, 0, ""),
    "eager mask=": (lambda: eager(mask=True, member_lr=True), 0, 0, ""),
    # fused=True runs torch's kernel on the active members' views, which the host must know:
    # one read of the mask (the opt-in per-view mode; the default step reads none)
    "eager fused=True, mask=": (lambda: eager(fused=True, mask=True), 1, 0, ""),
    "eager skip_nonfinite (warning)": (lambda: eager(skip_nonfinite=True), 1, 0, ""),
    "eager fused=True, skip_nonfinite": (lambda: eager(fused=True, skip_nonfinite=True), 1, 0, ""),
    "eager skip_nonfinite + clip + mask": (
        lambda: eager(skip_nonfinite=True, clip=True, mask=True, member_lr=True),
        1,
        0,
        "",
    ),
    "eager SGD momentum": (lambda: eager(opt="SGD"), 0, 0, ""),
    "eager SGD fused=True": (lambda: eager(opt="SGD", fused=True, member_lr=True), 0, 0, ""),
    "eager Lion": (lambda: eager(opt="Lion"), 0, 0, ""),
    "MemberGradScaler": (lambda: eager(scaler=True, member_lr=True), 0, 0, ""),
    "MemberGradScaler + unscale_ + clip": (
        lambda: eager(scaler=True, clip=True, member_lr=True),
        0,
        0,
        "",
    ),
    "MemberGradScaler, a member overflowed": (
        lambda: eager(scaler=True, overflow=True, member_lr=True),
        0,
        0,
        "",
    ),
    "captured": (lambda: captured(), 0, 0, ""),
    "captured + clip": (lambda: captured(clip=True), 0, 0, ""),
    "captured + mask": (lambda: captured(mask=True), 0, 0, ""),
    "captured + clip + mask": (lambda: captured(clip=True, mask=True), 0, 0, ""),
    "captured skip_nonfinite + clip (warning)": (
        lambda: captured(skip_nonfinite=True, clip=True),
        1,
        0,
        "",
    ),
    "captured fused=True": (lambda: captured(fused=True), 0, 0, ""),
    "captured fused=True, per-member lr": (
        lambda: captured(fused=True, member_lr=True),
        0,
        0,
        "",
    ),
    "routed members=": (lambda: routed("mlp", "members"), 1, 0, ""),
    "routed members= (cnn)": (lambda: routed("cnn", "members"), 1, 0, ""),
    # the same index tensor again: its sort is kept, nothing read
    "routed members=, the index kept": (lambda: routed("mlp", "kept"), 0, 0, ""),
    "routed subset= consecutive": (lambda: routed("cnn", "consecutive"), 0, 0, ""),
    "routed subset= scattered (BatchNorm buffers)": (lambda: routed("cnn", "scattered"), 1, 0, ""),
}


@functools.cache
def _counted(name: str) -> Counts:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BUDGET[name][0]()


def _params(kind: str) -> list:
    mark = pytest.mark.xfail(strict=True, reason=OPTIMIZER)
    return [
        pytest.param(name, marks=mark) if kind in blocked else name
        for name, (_, _, _, blocked) in BUDGET.items()
    ]


def _within_budget(name: str, what: str) -> None:
    c = _counted(name)
    column, label = {"syncs": (1, "host syncs"), "copies": (2, "blocking copies")}[what]
    allowed = BUDGET[name][column]
    assert c.total(what) <= allowed, (
        f"{name}: {c.total(what)} {label} per step, budget {allowed}: {c.describe()}"
    )


@pytest.mark.parametrize("name", _params("s"))
def test_syncs(name):
    _within_budget(name, "syncs")


@pytest.mark.parametrize("name", _params("c"))
def test_blocking_copies(name):
    _within_budget(name, "copies")


@pytest.mark.parametrize("name", list(BUDGET))
def test_outside_the_optimizer(name):
    """Every path within budget for what phalanx does outside ``phalanx/optim/``."""
    c = _counted(name)
    _, syncs, copies, _ = BUDGET[name]
    outside = "phalanx/optim/"
    assert c.total("syncs", outside=outside) <= syncs, f"{name}: {c.describe()}"
    assert c.total("copies", outside=outside) <= copies, f"{name}: {c.describe()}"


def test_the_counter_sees_a_sync_and_a_blocking_copy():
    """The counter is not blind: a value read and a copy from Python data are counted."""
    t = torch.ones(3)
    with counting() as c:
        bool(t.any())
        torch.tensor([1.0, 2.0], device=t.device)
        t.tolist()
    assert c.total("syncs") == 2 and c.total("copies") == 1, c.describe()


def test_auto_saves_buffers_and_inputs_only_until_fused_ran_their_shapes(monkeypatch):
    """Backend ``auto`` copies the buffers and inputs before a call only while fused has not
    run calls of those shapes (in that grad mode and train/eval mode): on a GPU each copy is
    a kernel launch on every call."""
    from phalanx.backends import _auto

    saved: list[bool] = []
    init = _auto._Undo.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        saved.append(self.saved is not None)

    monkeypatch.setattr(_auto._Undo, "__init__", spy)
    stack, x, _ = _setup("cnn")
    for b in (8, 8, 8, 4, 4):
        stack(x[:b])
    stack.eval()
    stack(x[:4])
    assert saved == [True, False, False, True, False, True]
