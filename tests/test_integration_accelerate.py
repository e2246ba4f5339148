"""phalanx.integrations.accelerate against each member trained alone with plain accelerate:
one member's gradient exploding leaves the others' steps exactly as alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx

accelerate = pytest.importorskip("accelerate")
from phalanx.integrations.accelerate import PhalanxAccelerator  # noqa: E402

N, B = 4, 16
BLOWUP = torch.tensor([1.0, 1.0, 1.0, 1e4])  # member 3's gradient explodes


def _members():
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
    return out


def _own_losses(out, y):
    # each member's F.cross_entropy as it runs alone: member_losses' batched cross-entropy
    # rounds its mean in another order (a last-bit difference this test would see)
    return torch.stack([F.cross_entropy(out[i], y) for i in range(out.shape[0])])


def _batches(steps):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(B, 10, generator=g), torch.randint(0, 3, (B,), generator=g))
        for _ in range(steps)
    ]


OPTIMIZERS = {
    "SGD": (phalanx.optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adam": (phalanx.optim.Adam, torch.optim.Adam, {"lr": 1e-2}),
}


def _alone(member, make, kwargs, batches, i, mask_from=None, clip=True):
    accelerator = accelerate.Accelerator(cpu=True)
    opt = make(member.parameters(), **kwargs)
    member, opt = accelerator.prepare(member, opt)
    norms = []
    for t, (x, y) in enumerate(batches):
        if mask_from is not None and t >= mask_from:
            break  # stopped: the stack's mask must keep it here
        accelerator.backward(F.cross_entropy(member(x), y) * BLOWUP[i])
        if clip:
            norms.append(accelerator.clip_grad_norm_(member.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
    return member, norms


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_accelerate_loop_with_one_member_exploding_steps_the_others_exactly_as_alone(kind):
    ours, theirs, kwargs = OPTIMIZERS[kind]
    members, batches = _members(), _batches(4)
    alone = [_alone(copy.deepcopy(m), theirs, kwargs, batches, i) for i, m in enumerate(members)]
    batches64 = [(x.double(), y) for x, y in batches]
    alone64 = [
        _alone(copy.deepcopy(m).double(), theirs, kwargs, batches64, i)[0]
        for i, m in enumerate(members)
    ]
    accelerator = PhalanxAccelerator(cpu=True)
    stack = phalanx.stack(members, backend="loop")
    opt = ours(stack.parameters(), **kwargs)
    stack, opt = accelerator.prepare(stack, opt)
    for t, (x, y) in enumerate(batches):
        accelerator.backward(_own_losses(stack(x), y) * BLOWUP)
        norms = accelerator.clip_grad_norm_(stack.parameters(), 1.0)
        assert norms.shape == (N,) and norms[3] > 100 * norms[:3].max()
        for i in range(N):
            phalanx.testing.assert_equal_to_loop(
                norms[i], alone[i][1][t], alone[i][1][t].double(), what=f"member {i} norm"
            )
        opt.step()
        opt.zero_grad()
    # phalanx.clip_grad_norm_ sums each member's squares in another order than torch's
    # foreach norm, so the clipped steps agree to float rounding (the rule), not bit for bit
    for i, member in enumerate(stack.unstack()):
        pairs = zip(member.named_parameters(), alone[i][0].parameters(), alone64[i].parameters())
        for (name, p), q, q64 in pairs:
            phalanx.testing.assert_equal_to_loop(p, q, q64, what=f"member {i} {name}")


def _with_fp16_scaler(accelerator, **kwargs):
    # accelerate builds its GradScaler for fp16 on a GPU only; on the CPU, give the
    # accelerator the one it would build, which PhalanxAccelerator turns into per-member scales
    accelerator._torch_scaler = torch.amp.GradScaler("cpu", **kwargs)
    return accelerator


def test_fp16_scaling_through_the_accelerator_skips_only_the_overflowing_member():
    members, batches = _members(), _batches(4)
    settings = {"init_scale": 2.0**10, "growth_interval": 2}
    alone = copy.deepcopy(members)
    accelerator = _with_fp16_scaler(PhalanxAccelerator(cpu=True), **settings)
    stack = phalanx.stack(members, backend="loop")
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2, mode="torch")  # torch.optim's bits
    stack, opt = accelerator.prepare(stack, opt)
    assert isinstance(accelerator.scaler, phalanx.MemberGradScaler)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in alone]
    ref_scalers = [torch.amp.GradScaler("cpu", **settings) for _ in range(N)]
    for t, (x, y) in enumerate(batches):
        blowup = torch.tensor([1.0, 1.0, float("inf") if t == 1 else 1.0, 1.0])
        accelerator.backward(_own_losses(stack(x), y) * blowup)
        opt.step()
        opt.zero_grad()
        assert accelerator.optimizer_step_was_skipped is False  # three members stepped
        for i, (m, o, s) in enumerate(zip(alone, ref_opts, ref_scalers)):
            s.scale(F.cross_entropy(m(x), y) * blowup[i]).backward()
            s.step(o)
            s.update()
            o.zero_grad()
            assert accelerator.scaler.get_scale()[i].item() == s.get_scale()
    for i, member in enumerate(stack.unstack()):
        for (name, p), q in zip(member.named_parameters(), alone[i].parameters()):
            assert torch.equal(p, q), f"member {i} {name}"


def test_member_mask_keeps_stopped_members_and_errors_name_the_fix():
    members, batches = _members(), _batches(3)
    alone = [
        _alone(
            copy.deepcopy(m),
            torch.optim.Adam,
            {"lr": 1e-2},
            batches,
            i,
            1 if i == 1 else None,
            clip=False,
        )
        for i, m in enumerate(members)
    ]
    accelerator = PhalanxAccelerator(cpu=True)
    stack = phalanx.stack(members, backend="loop")
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    stack, opt = accelerator.prepare(stack, opt)
    for t, (x, y) in enumerate(batches):
        accelerator.member_mask = torch.tensor([True, t < 1, True, True])  # member 1 stops
        accelerator.backward(_own_losses(stack(x), y) * BLOWUP)
        opt.step()
        opt.zero_grad()
    for i, member in enumerate(stack.unstack()):  # member 1 as it was after its one step
        assert all(torch.equal(p, q) for p, q in zip(member.parameters(), alone[i][0].parameters()))
    assert opt.optimizer.state[next(iter(stack.parameters()))]["step"].tolist() == [3, 1, 3, 3]

    with pytest.raises(
        ValueError, match=r"clip_grad_norm_\(\): the parameters mix a phalanx stack's with 1 others"
    ):
        accelerator.clip_grad_norm_([*stack.parameters(), nn.Parameter(torch.zeros(2))], 1.0)
    fp16 = _with_fp16_scaler(PhalanxAccelerator(cpu=True))
    other = phalanx.stack(_members())
    with pytest.raises(
        ValueError, match=r"fp16.*needs a phalanx optimizer.*got Adam. Use phalanx.optim.Adam"
    ):
        fp16.prepare(other, torch.optim.Adam(other.parameters()))
    with pytest.raises(
        ValueError, match=r"backward\(\): mixed_precision='fp16'.*shape \(4,\); got shape \(\)"
    ):
        fp16.backward(
            phalanx.member_losses(F.cross_entropy, other(batches[0][0]), batches[0][1]).sum()
        )


def test_save_state_load_state_and_save_model_on_tied_weight_models(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, use_cache=False
    )

    def gpt2s():
        out = []
        for i in range(3):
            torch.manual_seed(i)
            out.append(transformers.GPT2LMHeadModel(config))
        return out

    accelerator = PhalanxAccelerator(cpu=True)
    stack = phalanx.stack(gpt2s())
    opt = phalanx.optim.AdamW(stack.parameters(), lr=1e-2)
    stack, opt = accelerator.prepare(stack, opt)
    ids = torch.randint(0, 50, (2, 8))
    accelerator.backward(stack(ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()
    accelerator.save_state(tmp_path / "state")  # safetensors refused the tied stack before
    accelerator.save_model(stack, tmp_path / "members")
    for i, member in enumerate(stack.unstack()):
        back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "members" / f"member_{i}")
        assert all(
            torch.equal(p, q)
            for p, q in zip(member.state_dict().values(), back.state_dict().values())
        )
    saved = [p.detach().clone() for p in stack.parameters()]
    accelerator.backward(stack(ids, labels=ids).loss)
    opt.step()
    after_one = [p.detach().clone() for p in stack.parameters()]
    opt.zero_grad()
    accelerator.load_state(tmp_path / "state")
    assert all(torch.equal(p, q) for p, q in zip(stack.parameters(), saved))
    accelerator.backward(stack(ids, labels=ids).loss)
    opt.step()  # the optimizer state came back too: the same step again
    assert all(torch.equal(p, q) for p, q in zip(stack.parameters(), after_one))


def test_clipping_a_stack_never_prepared_is_refused():
    accelerator = PhalanxAccelerator(cpu=True)
    stack = copy.deepcopy(phalanx.stack(_members()))  # a copy is found too
    opt = accelerator.prepare(torch.optim.SGD(stack.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    accelerator.backward(_own_losses(stack(x), y).sum())
    before = [p.grad.clone() for p in stack.parameters()]
    with pytest.raises(ValueError, match=r"belong to a phalanx stack that was not passed to "
                       r"accelerator.prepare\(\).*accelerator.prepare\(stack, optimizer\)"):  # fmt: skip
        accelerator.clip_grad_norm_(stack.parameters(), 1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(stack.parameters(), before))
    plain = nn.Linear(3, 2)  # a module that is no stack: accelerate's own clip
    plain(torch.randn(4, 3)).sum().backward()
    assert accelerator.clip_grad_norm_(plain.parameters(), 1.0).shape == ()
    del opt


def _run_step(step, dtype, steps=6, accumulate=1):
    accelerator = PhalanxAccelerator(cpu=True, gradient_accumulation_steps=accumulate)
    members = [m.to(dtype) for m in _members()]
    with torch.no_grad():
        members[1][0].weight[0, 0] = float("nan")  # member 1 diverged before training
    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    stack, opt = accelerator.prepare(stack, opt)
    accelerator.member_mask = torch.tensor([True, True, True, False])  # member 3 stopped
    train = accelerator.train_step(stack, F.cross_entropy, opt, step=step, max_norm=1.0,
                                   backend="aot_eager")  # fmt: skip
    for x, y in _batches(steps):
        losses = train(x.to(dtype), y)
    return stack, train, losses


def test_the_accelerators_train_step_captured_gives_the_eager_steps_members():
    eager, e_step, _ = _run_step("eager", torch.float32)
    eager64, _, _ = _run_step("eager", torch.float64)
    got, step, losses = _run_step("captured", torch.float32)
    assert step.choice == "captured" and e_step.choice == "eager"
    assert losses[1].isnan() and losses[[0, 2, 3]].isfinite().all()
    torch.testing.assert_close(step.last_norms[[0, 2, 3]], e_step.last_norms[[0, 2, 3]])
    fresh = phalanx.stack(_members())
    for (name, p), q, q64, p0 in zip(
        got.named_parameters(), eager.parameters(), eager64.parameters(), fresh.parameters()
    ):
        for i in (0, 2):
            phalanx.testing.assert_equal_to_loop(p[i], q[i], q64[i], what=f"member {i} {name}")
        assert torch.equal(p[3], p0[3])  # masked out of every step


def test_the_accelerators_train_step_says_why_it_runs_eager():
    _, step, _ = _run_step("auto", torch.float32, steps=2, accumulate=2)
    assert step.choice == "eager" and "gradient_accumulation_steps=2" in step.report
    with pytest.raises(ValueError, match=r"step='captured' cannot run here.*accumulation"):
        _run_step("captured", torch.float32, steps=1, accumulate=2)
    with pytest.raises(ValueError, match=r"step must be 'auto'.*got 'fast'"):
        _run_step("fast", torch.float32, steps=1)
