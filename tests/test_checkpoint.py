"""phalanx.save / load: safetensors only, atomic, bit-identical resume, clear mismatches."""

from __future__ import annotations

import json
import os

import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from conftest import ARCHS, make_members

N = 6


def build(seed: int, n: int = N, hidden: int = 20):
    """A stack, Adam with per-member lrs and isolation, a StepLR and a bootstrap loader."""
    torch.manual_seed(seed)
    members = [
        nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 2)) for _ in range(n)
    ]
    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters(), lr=torch.logspace(-3, -1, n), skip_nonfinite=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(40, 10, generator=g), torch.randint(0, 2, (40,), generator=g)
    loader = phalanx.data.MemberLoader(X, Y, num_members=n, batch_size=8, bootstrap=True, seed=seed)
    return stack, opt, sched, loader


def train(stack, opt, sched, loader, steps: int) -> list[list[torch.Tensor]]:
    history = []
    batches = (b for _ in range(100) for b in loader)
    for _ in range(steps):
        xb, yb = next(batches)  # (N, B, 10), (N, B)
        losses = phalanx.member_losses(F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0))
        opt.zero_grad()
        losses.sum().backward()
        opt.step(mask=torch.arange(len(stack)) != 1)  # member 1 is paused: its own step count
        sched.step()
        history.append([p.detach().clone() for p in stack.parameters()])
    return history


def test_resume_gives_bit_identical_next_steps(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=7)  # mid-epoch: 5 batches per epoch
    phalanx.save(
        path, stack, optimizer=opt, scheduler=sched, loader=loader, epoch=1, best=torch.arange(3)
    )
    expected = train(stack, opt, sched, loader, steps=6)

    stack2, opt2, sched2, loader2 = build(seed=1)  # other weights, other data seed
    extra = phalanx.load(path, stack2, optimizer=opt2, scheduler=sched2, loader=loader2)
    assert extra["epoch"] == 1 and torch.equal(extra["best"], torch.arange(3))
    got = train(stack2, opt2, sched2, loader2, steps=6)
    for t, (a, b) in enumerate(zip(expected, got, strict=True)):
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p, q), f"step {t} after resuming differs"
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_the_file_is_plain_safetensors_with_json_metadata(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=2)
    phalanx.save(path, stack, optimizer=opt, scheduler=sched, loader=loader, note="lr sweep")
    with safetensors.safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["phalanx"])
    assert "stack/module.0.weight" in keys
    assert "optimizer.state.0.exp_avg" in keys and "optimizer.members.frozen" in keys
    assert meta["num_members"] == N and meta["extra"] == {"note": "lr sweep"}
    assert meta["loader"]["batch"] == 2 and meta["scheduler"]["last_epoch"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["run.safetensors"]  # no temporary left


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path, monkeypatch) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, *_ = build(seed=0)
    phalanx.save(path, stack, optimizer=opt)
    good = path.read_bytes()

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with torch.no_grad():
        next(iter(stack.parameters())).add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        phalanx.save(path, stack, optimizer=opt)
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["run.safetensors"]


def test_loading_into_another_n_names_keys_expected_and_got(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, *_ = build(seed=0)
    phalanx.save(path, stack, optimizer=opt)
    other, other_opt, *_ = build(seed=0, n=4)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(
        ValueError,
        match=r"phalanx.load\(\): checkpoint '.*run.safetensors' does not fit this stack: key "
        r"'module.0.weight' expected shape \(4, 20, 10\) \(this stack\), got \(6, 20, 10\) "
        r"\(checkpoint\);.* The checkpoint holds 6 members, this stack 4",
    ):
        phalanx.load(path, other, optimizer=other_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))


def test_loading_into_another_architecture_fails_clearly(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, *_ = build(seed=0)
    phalanx.save(path, stack)
    wider, *_ = build(seed=0, hidden=30)
    with pytest.raises(
        ValueError,
        match=r"key 'module.2.weight' expected shape \(6, 2, 30\) \(this stack\), got \(6, 2, 20\)",
    ):
        phalanx.load(path, wider)
    deeper = phalanx.stack(
        [
            nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2), nn.Linear(2, 2))
            for _ in range(N)
        ]
    )
    with pytest.raises(ValueError, match=r"key 'module.3.weight' is missing from the checkpoint"):
        phalanx.load(path, deeper)


def test_optimizer_mismatch_and_missing_parts_are_named(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, sched, loader = build(seed=0)
    train(stack, opt, sched, loader, steps=1)
    phalanx.save(path, stack, optimizer=opt)
    params = list(stack.parameters())
    split = phalanx.optim.Adam([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(
        ValueError,
        match=r"the optimizer state in .* does not fit this optimizer: 1 param groups saved, 2 in the optimizer",
    ):
        phalanx.load(path, stack, optimizer=split)
    with pytest.raises(
        ValueError, match=r"holds no loader state; save it with phalanx.save\(..., loader=loader\)"
    ):
        phalanx.load(path, stack, loader=loader)
    plain = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(1)}, str(plain))
    with pytest.raises(ValueError, match=r"is not a phalanx checkpoint"):
        phalanx.load(plain, stack)
    with pytest.raises(
        TypeError,
        match=r"phalanx.save\(\): 'extra.fn' is a function, which a checkpoint cannot hold without pickle",
    ):
        phalanx.save(path, stack, fn=lambda: 0)


def test_member_lambda_lr_state_round_trips(tmp_path) -> None:
    path = tmp_path / "run.safetensors"
    stack, opt, *_ = build(seed=0)
    sched = phalanx.optim.MemberLambdaLR(opt, lambda e: torch.linspace(1, 2, N) ** e)
    sched.step()
    phalanx.save(path, stack, optimizer=opt, scheduler=sched)
    stack2, opt2, *_ = build(seed=1)
    sched2 = phalanx.optim.MemberLambdaLR(opt2, lambda e: torch.linspace(1, 2, N) ** e)
    phalanx.load(path, stack2, optimizer=opt2, scheduler=sched2)
    sched.step()
    sched2.step()
    assert torch.equal(opt.param_groups[0]["member_lr"], opt2.param_groups[0]["member_lr"])


def test_export_members_gives_ordinary_state_dicts() -> None:
    members = make_members(ARCHS[1], N)
    stack = phalanx.stack(members)
    x = torch.randn(5, 10)
    out = stack(x)
    best = torch.tensor([4, 0, 2])
    states = phalanx.export_members(stack, best)
    assert len(states) == 3 and set(states[0]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for k, state in zip(best.tolist(), states, strict=True):
        model = ARCHS[1].make()
        model.load_state_dict(state)
        torch.testing.assert_close(model(x), out[k], rtol=1e-5, atol=1e-6)
    states[0]["0.weight"].zero_()  # copies: the stack is untouched
    assert not bool((stack.state_dict()["module.0.weight"][4] == 0).all())
    mask = torch.tensor([True, False, False, False, False, True])
    assert [s["0.bias"].tolist() for s in phalanx.export_members(stack, mask)] == [
        members[0][0].bias.tolist(),
        members[5][0].bias.tolist(),
    ]
    with pytest.raises(
        IndexError,
        match=r"export_members\(\): member indices \[6\] are out of range for a stack of 6 members",
    ):
        phalanx.export_members(stack, [6])
