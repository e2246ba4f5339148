"""Isolation: a member with a non-finite loss or gradient is skipped; the others never notice."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import phalanx
from helpers import ARCHS, make_members
from phalanx.optim import NonFiniteWarning

N = 8
STEPS = 12
BAD = 3


def run(
    opt_cls: type,
    *,
    inject_at: set[int] = frozenset(),  # type: ignore[assignment]
    how: str = "nan_loss",
    shared_lr: bool = False,
    **opt_kwargs: object,
) -> tuple[list[list[torch.Tensor]], phalanx.optim.MemberOptimizer]:
    """Trains N Linear-ReLU-Linear members; returns the weights after every step."""
    # Linear(10, 20) -> ReLU -> Linear(20, 2). One backend for every run compared bit for bit:
    # under auto each stack races on its own, and backends agree to float rounding only.
    stack = phalanx.stack(make_members(ARCHS[1], N), backend="fused")
    lr = 1e-2 if shared_lr else torch.logspace(-3, -1, N)
    opt = opt_cls(stack.parameters(), lr=lr, **opt_kwargs)
    g = torch.Generator().manual_seed(0)
    history = []
    for t in range(STEPS):
        x = torch.randn(16, 10, generator=g)
        y = torch.randint(0, 2, (16,), generator=g)
        losses = phalanx.member_losses(F.cross_entropy, stack(x), y)  # (N,)
        if t in inject_at:
            bad = torch.zeros(N)
            if how == "nan_loss":  # NaN loss and NaN gradients, for member BAD only
                bad[BAD] = math.nan
                losses = losses * (1 + bad)
            else:  # an infinite loss whose gradients stay finite: only the loss check sees it
                bad[BAD] = math.inf
                losses = losses + bad
        opt.zero_grad()
        losses.sum().backward()
        if t in inject_at:
            grads_finite = all(bool(p.grad[BAD].isfinite().all()) for p in stack.parameters())
            assert grads_finite == (how != "nan_loss")
        phalanx.clip_grad_norm_(stack.parameters(), max_norm=1.0)
        opt.step(loss=losses.detach())
        history.append([p.detach().clone() for p in stack.parameters()])
    return history, opt


def others(t: torch.Tensor) -> torch.Tensor:
    return t[torch.arange(N) != BAD]


@pytest.mark.parametrize("shared_lr", [False, True], ids=["member_lr", "shared_lr"])
@pytest.mark.parametrize(
    "opt_cls",
    [phalanx.optim.Adam, phalanx.optim.AdamW, phalanx.optim.SGD],
    ids=["adam", "adamw", "sgd"],
)
@pytest.mark.parametrize("how", ["nan_loss", "inf_loss_finite_grads"])
def test_other_members_are_bit_identical_to_a_run_without_the_injection(
    opt_cls: type, how: str, shared_lr: bool
) -> None:
    """Also with one shared lr: a skipped member once moved every member off torch's fused
    Adam kernel, and the others then differed from the clean run in the last bits. Bit for
    bit is mode="torch"'s promise; the default mode's is float rounding (a skipped member
    lags in its count, so from then on the step takes the blocked arithmetic, not the one
    fused call on the stacked tensors: tests/test_optim_modes.py)."""
    clean, clean_opt = run(opt_cls, skip_nonfinite=True, shared_lr=shared_lr, mode="torch")
    inject_at = {2, 3, 7}
    with pytest.warns(NonFiniteWarning, match=rf"step\(\): skipped members \[{BAD}\]") as caught:
        dirty, opt = run(
            opt_cls,
            inject_at=inject_at,
            how=how,
            skip_nonfinite=True,
            shared_lr=shared_lr,
            mode="torch",
        )
    assert len(caught) == len(inject_at)
    for t, (a, b) in enumerate(zip(clean, dirty, strict=True)):
        for j, (p, q) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(others(p), others(q)), f"step {t}: another member changed"
            assert bool(torch.isfinite(q).all()), f"step {t}: a NaN reached the weights"
            if t in inject_at:  # the bad member kept its weights that step
                assert torch.equal(q[BAD], dirty[t - 1][j][BAD])
            else:  # and moved on the others
                assert not torch.equal(q[BAD], dirty[t - 1][j][BAD]) or t == 0
    assert opt.bad_steps.tolist() == [3 if i == BAD else 0 for i in range(N)]
    assert not bool(opt.last_skipped.any())  # the last step was clean
    assert not bool(clean_opt.bad_steps.any())
    # the bad member's own step count lags by the skipped steps; Adam's bias correction is its own
    steps = opt.state[next(iter(opt.state))]["step"]
    assert steps.tolist() == [STEPS - 3 if i == BAD else STEPS for i in range(N)]


def test_freeze_after_k_bad_steps() -> None:
    # bit for bit is mode="torch"'s promise (the default's is float rounding)
    clean, _ = run(phalanx.optim.Adam, skip_nonfinite=True, mode="torch")
    with pytest.warns(NonFiniteWarning) as caught:
        dirty, opt = run(
            phalanx.optim.Adam, inject_at={2, 4}, skip_nonfinite=True, freeze_after=2, mode="torch"
        )
    assert "Members [3] are now frozen after 2 non-finite steps" in str(caught[-1].message)
    assert opt.frozen.tolist() == [i == BAD for i in range(N)]
    for t in range(4, STEPS):  # frozen from step 4 on, although its later losses are finite
        for p, q in zip(dirty[t], dirty[3], strict=True):
            assert torch.equal(p[BAD], q[BAD])
        for p, q in zip(clean[t], dirty[t], strict=True):
            assert torch.equal(others(p), others(q))
    assert opt.bad_steps[BAD] == 2  # frozen steps are not counted as bad


def test_without_warnings_no_sync_path_gives_the_same_bits() -> None:
    """warn_skipped=False always takes the masked path: still identical to the clean run."""
    clean, _ = run(phalanx.optim.Adam, skip_nonfinite=True, mode="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may warn
        dirty, opt = run(
            phalanx.optim.Adam, inject_at={5}, skip_nonfinite=True, warn_skipped=False, mode="torch"
        )
    for a, b in zip(clean, dirty, strict=True):
        for p, q in zip(a, b, strict=True):
            assert torch.equal(others(p), others(q))
    assert opt.bad_steps.tolist() == [int(i == BAD) for i in range(N)]


def test_without_isolation_a_nan_member_goes_nan_but_stays_alone() -> None:
    dirty, _ = run(phalanx.optim.Adam, inject_at={2})
    clean, _ = run(phalanx.optim.Adam)
    last_dirty, last_clean = dirty[-1], clean[-1]
    assert any(bool(p[BAD].isnan().any()) for p in last_dirty)
    for p, q in zip(last_clean, last_dirty, strict=True):
        assert torch.equal(others(p), others(q))


def test_loss_shape_is_checked() -> None:
    w = torch.nn.Parameter(torch.zeros(4, 2))
    w.grad = torch.zeros(4, 2)
    opt = phalanx.optim.SGD([w], lr=0.1, skip_nonfinite=True)
    with pytest.raises(
        ValueError,
        match=r"SGD.step\(\): loss must hold one value per member, shape \(4,\); got shape \(\)",
    ):
        opt.step(loss=torch.tensor(1.0))


def test_the_default_mode_keeps_the_other_members_to_float_rounding() -> None:
    """The default mode promises float rounding: a skipped member moves the others from torch's
    fused kernel to the blocked arithmetic, which rounds alike up to a few ulps of the update."""
    clean, _ = run(phalanx.optim.Adam, skip_nonfinite=True)
    with pytest.warns(NonFiniteWarning):
        dirty, opt = run(phalanx.optim.Adam, inject_at={2}, skip_nonfinite=True)
    assert opt.bad_steps.tolist() == [int(i == BAD) for i in range(N)]
    for a, b in zip(clean, dirty, strict=True):
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(others(p), others(q), rtol=1e-6, atol=1e-7)
    for p, q in zip(dirty[2], dirty[1], strict=True):  # the bad step left member BAD as it was
        assert torch.equal(p[BAD], q[BAD])
