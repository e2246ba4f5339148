"""phalanx.MemberGradScaler against one torch.amp.GradScaler per member, each member alone:
one member overflowing skips only its own step and backs off only its own scale."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx

N, B = 4, 8
BAD = 2  # the member whose loss overflows
OVERFLOW_STEPS = {1, 3}


def _members():
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    return out


def _batches(steps):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g))
        for _ in range(steps)
    ]


def _blowup(t, member):
    return float("inf") if t in OVERFLOW_STEPS and member == BAD else 1.0


SCALER = {"init_scale": 2.0**10, "growth_interval": 2}


@pytest.mark.parametrize("backend", ["loop", "auto"])
@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_one_member_overflowing_skips_only_its_step_and_scale(kind, backend):
    members, steps = _members(), 6
    alone = copy.deepcopy(members)
    stack = phalanx.stack(members, backend=backend)
    ours = {
        "SGD": (phalanx.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        "Adam": (phalanx.optim.Adam, {"lr": 1e-2}),
    }
    theirs = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam}
    make, kwargs = ours[kind]
    opt = make(stack.parameters(), **kwargs, mode="torch")  # torch.optim's bits per member
    scaler = phalanx.MemberGradScaler(N, device="cpu", **SCALER)
    ref_opts = [theirs[kind](m.parameters(), **kwargs) for m in alone]
    ref_scalers = [torch.amp.GradScaler("cpu", **SCALER) for _ in range(N)]
    for t, (x, y) in enumerate(_batches(steps)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = stack(x)
        blowup = torch.tensor([_blowup(t, i) for i in range(N)])
        losses = phalanx.member_losses(F.cross_entropy, out.float(), y) * blowup
        scaler.scale(losses).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.last_skipped.tolist() == [i == BAD and t in OVERFLOW_STEPS for i in range(N)]
        for i, (m, o, s) in enumerate(zip(alone, ref_opts, ref_scalers)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                own = m(x)
            s.scale(F.cross_entropy(own.float(), y) * _blowup(t, i)).backward()
            s.step(o)
            s.update()
            assert scaler.get_scale()[i].item() == s.get_scale(), f"step {t} member {i} scale"
        for i, member in enumerate(stack.unstack()):
            for (name, p), q in zip(member.named_parameters(), alone[i].parameters()):
                assert torch.equal(p, q), f"step {t} member {i} {name}"
    assert scaler.get_scale().tolist() == [2.0**13, 2.0**13, 2.0**9, 2.0**13]


def test_unscale_then_clip_each_member_and_the_state_round_trips(tmp_path):
    stack = phalanx.stack(_members())
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
    scaler = phalanx.MemberGradScaler(N, device="cpu", init_scale=2.0**8)
    x, y = _batches(1)[0]
    losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
    scaler.scale(losses).backward()
    scaled = [p.grad.clone() for p in stack.parameters()]
    scaler.unscale_(opt)
    for g, p in zip(scaled, stack.parameters()):
        assert torch.equal(p.grad, g * (1.0 / 2.0**8))
    with pytest.raises(RuntimeError, match=r"unscale_\(\): already called"):
        scaler.unscale_(opt)
    phalanx.clip_grad_norm_(stack.parameters(), 1.0)
    scaler.step(opt, mask=torch.tensor([True, True, False, True]))  # a member stopped early
    scaler.update(torch.tensor([1.0, 2.0, 4.0, 8.0]))
    phalanx.save(tmp_path / "run.safetensors", stack, optimizer=opt, scaler=scaler.state_dict())
    fresh = phalanx.MemberGradScaler(N, device="cpu")
    fresh.load_state_dict(phalanx.load(tmp_path / "run.safetensors", stack)["scaler"])
    assert torch.equal(fresh.get_scale(), torch.tensor([1.0, 2.0, 4.0, 8.0]))
    assert torch.equal(fresh.get_growth_tracker(), scaler.get_growth_tracker())


def test_errors_name_the_fix():
    stack = phalanx.stack(_members())
    scaler = phalanx.MemberGradScaler(N, device="cpu")
    with pytest.raises(
        ValueError, match=r"scale\(\): expected the per-member losses, shape \(4,\)"
    ):
        scaler.scale(torch.tensor(1.0))
    torch_opt = torch.optim.SGD(stack.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"step\(\): expected a phalanx optimizer.*got SGD"):
        scaler.step(torch_opt)
    with pytest.raises(RuntimeError, match=r"update\(\): no inf checks were recorded"):
        scaler.update()
    with pytest.raises(ValueError, match=r"load_state_dict\(\): the state holds \(4,\) scales"):
        phalanx.MemberGradScaler(3, device="cpu").load_state_dict(scaler.state_dict())
    with pytest.raises(ValueError, match="backoff_factor in"):
        phalanx.MemberGradScaler(3, backoff_factor=2.0)
