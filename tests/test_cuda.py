"""The same checks on a GPU: every backend, optimizer, scaler, autocast, routed call and the
captured step against the loop of independent copies (or torch's own optimizer per member).

They run where CUDA is available (``benchmarks/gpu_check.sh`` runs them; the CI machine has
no GPU). ``PHALANX_TEST_DEVICE=cpu`` runs them on the CPU instead (the check's dry mode),
all but the CUDA graph checks, which need CUDA.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import phalanx
from helpers import ARCHS, assert_close, make_members

DEVICE = torch.device(os.environ.get("PHALANX_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)
cuda_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need CUDA")

CUDA_ARCHS = [a for a in ARCHS if a.name in ("question2", "cnn_batchnorm_pool", "dict_output")]


@pytest.mark.parametrize("backend", ["loop", "vmap", "fused", "auto"])
@pytest.mark.parametrize("arch", CUDA_ARCHS, ids=[a.name for a in CUDA_ARCHS])
def test_backends_match_loop_on_cuda(backend, arch):
    torch.manual_seed(0)
    members = [m.to(DEVICE) for m in make_members(arch, 4)]
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members, backend=backend)
    p0 = stack.module.get_parameter(next(iter(dict(stack.module.named_parameters()))))
    assert p0.device.type == DEVICE.type
    kwargs = {"scale": 0.5} if arch.name == "dict_output" else {}
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in reference]
    for _ in range(5):
        args = tuple(a.to(DEVICE) for a in arch.inputs(6))
        out = stack(*args, **kwargs)
        # one forward of each member per step, as the stack's (BatchNorm's running stats)
        ref_outs = [m(*args, **kwargs) for m in reference]
        assert_close(out, torch.utils._pytree.tree_map(lambda *t: torch.stack(t), *ref_outs))
        leaves = torch.utils._pytree.tree_leaves(out)
        opt.zero_grad()
        sum(leaf.square().mean(dim=tuple(range(1, leaf.dim()))).sum() for leaf in leaves).backward()
        opt.step()
        for o in ref_opts:
            o.zero_grad()
        sum(
            leaf.square().mean() for o in ref_outs for leaf in torch.utils._pytree.tree_leaves(o)
        ).backward()
        for o in ref_opts:
            o.step()
    params, buffers = stack.stacked_state()
    for name, p in {**params, **buffers}.items():
        for i, m in enumerate(reference):
            assert_close(p[i], m.state_dict()[name], msg=f"member {i} {name}", trajectory=True)


def test_member_losses_and_clipping_on_cuda():
    stack = phalanx.stack([m.to(DEVICE) for m in make_members(ARCHS[1], 3)])
    x, y = torch.randn(8, 10, device=DEVICE), torch.randint(0, 2, (8,), device=DEVICE)
    losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
    losses.sum().backward()
    norms = phalanx.clip_grad_norm_(stack.parameters(), max_norm=0.1)
    assert losses.shape == norms.shape == (3,)
    assert losses.device.type == norms.device.type == DEVICE.type


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_captured_step_matches_eager_step_on_cuda(backend):
    """compile_step on CUDA (inductor: CUDA graphs through mode="reduce-overhead"), with a
    step mask, clipping and isolation, against the eager phalanx step, member by member."""
    from phalanx.step._api import compile_step

    n = 4
    members = [m.to(DEVICE) for m in make_members(ARCHS[1], n)]
    lr = torch.tensor([1e-3, 1e-2, 3e-2, 1e-1], device=DEVICE)

    def build():
        stack = phalanx.stack(copy.deepcopy(members))
        return stack, phalanx.optim.Adam(stack.parameters(), lr=lr, skip_nonfinite=True)

    stack, opt = build()
    step = compile_step(
        stack, F.cross_entropy, opt, max_norm=1.0, backend=backend, prefer="captured",
        warmup_steps=1,
    )  # fmt: skip
    eager, eager_opt = build()
    torch.manual_seed(0)
    for k in range(6):
        _step_both(step, eager, eager_opt, k)
    assert step.choice == "captured" and step.compile_seconds is not None
    _assert_same_members(stack, eager)


def _step_both(step, eager, eager_opt, k: int) -> None:
    """Step k of the captured step and of the eager step it stands for (member 1 masked on
    odd steps, clipping at 1): the same losses."""
    x = torch.randn(16, 10, device=DEVICE)
    y = torch.randint(0, 2, (16,), device=DEVICE)
    mask = torch.tensor([True, k % 2 == 0, True, True], device=DEVICE)
    losses = step(x, y, mask=mask)
    eager_opt.zero_grad()
    expected = phalanx.member_losses(F.cross_entropy, eager(x), y)
    expected.sum().backward()
    phalanx.clip_grad_norm_(eager.parameters(), 1.0)
    eager_opt.step(mask=mask, loss=expected.detach())
    assert_close(losses, expected.detach(), trajectory=True, msg=f"losses of step {k}")


def _assert_same_members(stack, eager) -> None:
    for (name, p), q in zip(stack.named_parameters(), eager.parameters()):
        for i in range(len(stack)):
            assert_close(p[i], q[i], msg=f"member {i} {name}", trajectory=True)


def test_bench_runs_on_cuda(tmp_path):
    from phalanx_tools.cli import main

    out = tmp_path / "bench.json"
    assert (
        main(["bench", "--quick", "--device", DEVICE.type, "--workloads", "W2", "--json", str(out)])
        == 0
    )
    assert out.exists()


# ------------------------------------------------------------------ optimizers against torch


def _members_and_data(n: int = 3, steps: int = 4):
    torch.manual_seed(0)
    members = [m.to(DEVICE) for m in make_members(ARCHS[1], n)]
    data = [
        (torch.randn(8, 10, device=DEVICE), torch.randint(0, 2, (8,), device=DEVICE))
        for _ in range(steps)
    ]
    return members, data


def _train_like_the_loop(members, data, make_opt, make_ref_opt, what):
    """Trains a stack with ``make_opt`` and each member alone with ``make_ref_opt`` (a torch
    optimizer) on the same batches; asserts each member's parameters match after each step."""
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members)
    opt = make_opt(stack.parameters())
    ref_opts = [make_ref_opt(m.parameters()) for m in reference]
    for k, (x, y) in enumerate(data):
        opt.zero_grad()
        phalanx.member_losses(F.cross_entropy, stack(x), y).sum().backward()
        opt.step()
        for m, o in zip(reference, ref_opts):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        params, _ = stack.stacked_state()
        for name, p in params.items():
            assert p.isfinite().all(), f"{what}: non-finite weights after step {k}"
            for i, m in enumerate(reference):
                assert_close(
                    p[i], m.state_dict()[name], trajectory=True,
                    msg=f"{what}: member {i} {name} after step {k}",
                )  # fmt: skip


FUSED = {
    "Adam": (phalanx.optim.Adam, torch.optim.Adam, {"lr": 1e-2}),
    "AdamW": (phalanx.optim.AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD": (phalanx.optim.SGD, torch.optim.SGD, {"lr": 1e-1, "momentum": 0.9}),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_steps_match_torchs_fused_step_per_member(name):
    """``fused=True``: torch's fused kernel over the stacked tensors, each member as torch's
    own fused optimizer alone (on CUDA the kernel reads the step count as float32)."""
    ours, theirs, kw = FUSED[name]
    members, data = _members_and_data()
    _train_like_the_loop(
        members, data, lambda ps: ours(ps, fused=True, **kw),
        lambda ps: theirs(ps, fused=True, **kw), f"{name}(fused=True)",
    )  # fmt: skip


def test_sgd_matches_torch_per_member():
    members, data = _members_and_data()
    kw = {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}
    _train_like_the_loop(
        members, data, lambda ps: phalanx.optim.SGD(ps, **kw),
        lambda ps: torch.optim.SGD(ps, **kw), "SGD",
    )  # fmt: skip


def test_lion_matches_the_reference_per_member():
    from test_lion import lion_alone

    members, data = _members_and_data()
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members)
    kw = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    opt = phalanx.optim.Lion(stack.parameters(), **kw)
    moments = [[torch.zeros_like(p) for p in m.parameters()] for m in reference]
    for x, y in data:
        opt.zero_grad()
        phalanx.member_losses(F.cross_entropy, stack(x), y).sum().backward()
        opt.step()
        for m, ms in zip(reference, moments):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
            with torch.no_grad():
                for p, mom in zip(m.parameters(), ms):
                    lion_alone(p, p.grad, mom, lr=1e-3, beta1=0.9, beta2=0.99,
                               weight_decay=0.1, maximize=False)  # fmt: skip
    params, _ = stack.stacked_state()
    for name, p in params.items():
        for i, m in enumerate(reference):
            assert_close(p[i], m.state_dict()[name], trajectory=True, msg=f"member {i} {name}")


# --------------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", [ARCHS[1], ARCHS[3]], ids=["mlp", "cnn_batchnorm"])
def test_autocast_forward_equals_the_loop_to_its_rounding(dtype, arch):
    """Under autocast, each member's output is no further from the float64 loop than the
    loop under the same autocast is."""
    from phalanx.testing import assert_equal_to_loop

    torch.manual_seed(0)
    members = [m.to(DEVICE) for m in make_members(arch, 4)]
    x = arch.inputs(16)[0].to(DEVICE)
    stack = phalanx.stack(copy.deepcopy(members))
    with torch.autocast(DEVICE.type, dtype=dtype):
        got = stack(x)
        loop = [m(x) for m in copy.deepcopy(members)]
    reference = torch.stack([m.double()(x.double()) for m in copy.deepcopy(members)])
    assert_equal_to_loop(
        got.float(), torch.stack(loop).float(), reference, what=f"autocast {dtype}",
        per_member=True,
    )  # fmt: skip


def test_member_grad_scaler_matches_one_torch_grad_scaler_per_member():
    """float16 autocast with ``MemberGradScaler``: each member's scale, skipped step and
    weights as a ``torch.amp.GradScaler`` of its own gives it; member 1 overflows once."""
    members, data = _members_and_data(n=3, steps=4)
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members)
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
    scaler = phalanx.MemberGradScaler(3, device=DEVICE, init_scale=2.0**10, growth_interval=2)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in reference]
    ref_scalers = [
        torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10, growth_interval=2) for _ in reference
    ]
    for k, (x, y) in enumerate(data):
        boost = torch.ones(3, device=DEVICE)
        if k == 1:
            boost[1] = float("inf")  # member 1's gradients overflow this step
        opt.zero_grad()
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
        scaler.scale(losses * boost).backward()
        scaler.step(opt)
        scaler.update()
        for i, (m, o, s) in enumerate(zip(reference, ref_opts, ref_scalers)):
            o.zero_grad()
            with torch.autocast(DEVICE.type, dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            s.scale(loss * boost[i]).backward()
            s.step(o)
            s.update()
        expected = torch.stack([s.get_scale() * torch.ones((), device=DEVICE) for s in ref_scalers])
        assert_close(scaler.get_scale(), expected.float(), msg=f"scales after step {k}")
    params, _ = stack.stacked_state()
    for name, p in params.items():
        for i, m in enumerate(reference):
            # gradients computed in float16: a few of its ulps (2^-10) apart, not float32's
            torch.testing.assert_close(
                p[i], m.state_dict()[name], rtol=1e-2, atol=1e-3,
                msg=lambda e, i=i, name=name: f"member {i} {name}: {e}",
            )  # fmt: skip


# ------------------------------------------------------------------------------ routed


def test_routed_members_match_each_rows_member():
    """``stack(x, members=index)``: row r through member index[r] alone, and the gradients."""
    torch.manual_seed(0)
    members = [m.to(DEVICE) for m in make_members(ARCHS[1], 4)]
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members)
    x = torch.randn(32, 10, device=DEVICE)
    index = torch.randint(0, 4, (32,), device=DEVICE)
    out = stack(x, members=index)
    expected = torch.cat([reference[int(i)](x[r : r + 1]) for r, i in enumerate(index.tolist())])
    assert_close(out, expected, msg="routed outputs")
    out.square().sum().backward()
    expected.square().sum().backward()
    for name, p in stack.named_parameters():
        key = name.removeprefix("module.")
        for i, m in enumerate(reference):
            assert_close(p.grad[i], m.get_parameter(key).grad, msg=f"member {i} {key} grad")


# ---------------------------------------------------------------------------- CUDA graphs


@cuda_only
def test_the_captured_step_runs_as_cuda_graphs_and_survives_a_reloaded_optimizer():
    """compile_step on CUDA with skip_nonfinite, clipping and a mask: inductor's CUDA graph
    trees skip nothing (``cudagraph_skips == 0``), and after ``opt.load_state_dict`` (new
    state tensors, new addresses) the step still matches the eager step."""
    from torch._dynamo.utils import counters

    from phalanx.step._api import compile_step

    n = 4
    members = [m.to(DEVICE) for m in make_members(ARCHS[1], n)]

    def build():
        stack = phalanx.stack(copy.deepcopy(members))
        return stack, phalanx.optim.Adam(stack.parameters(), lr=1e-2, skip_nonfinite=True)

    counters.clear()
    stack, opt = build()
    step = compile_step(
        stack, F.cross_entropy, opt, max_norm=1.0, backend="inductor", prefer="captured",
        warmup_steps=1,
    )  # fmt: skip
    eager, eager_opt = build()
    torch.manual_seed(0)
    for k in range(8):
        if k == 4:  # a checkpoint reloaded: every state tensor replaced
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            eager_opt.load_state_dict(copy.deepcopy(eager_opt.state_dict()))
        _step_both(step, eager, eager_opt, k)
    assert step.choice == "captured"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    _assert_same_members(stack, eager)
