"""The conformance table: every backend against the loop of independent copies.

backends x architectures x input modes x N x train/eval: outputs, input gradients, parameter
gradients, buffers, and the parameters after 20 Adam steps, member by member.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import phalanx
from conftest import (
    ARCHS,
    Arch,
    assert_close,
    clone_members,
    make_members,
    member_loss,
    reference_outputs,
    set_dropout_eval,
    stacked_loss,
)

BACKENDS = ["loop", "vmap", "auto"]
B = 5

CASES = [
    pytest.param(backend, arch, mode, n, id=f"{backend}-{arch.name}-{mode}-N{n}")
    for backend, arch, mode, n in itertools.product(
        BACKENDS, ARCHS, ["shared", "per_member", "sliced"], [1, 3, 8]
    )
    if mode != "sliced" or arch.sliceable
]


def _inputs(arch: Arch, mode: str, n: int):
    """(stack_args, in_dims, reference_args, leaves_with_grad) for one input mode."""
    if mode == "shared":
        args = tuple(a.requires_grad_() for a in arch.inputs(B))
        return args, (None,) * len(args), args, args
    if mode == "per_member":
        per = [arch.inputs(B) for _ in range(n)]
        args = tuple(torch.stack(col).requires_grad_() for col in zip(*per))
        return args, (0,) * len(args), args, args
    (x,) = arch.inputs(B)
    wide = torch.randn(B, n * x.shape[1], requires_grad=True)
    xs = phalanx.split(wide, n, dim=1)
    return (xs,), (0,), (xs,), (wide,)


def _kwargs(arch: Arch) -> dict:
    return {"scale": 0.5} if arch.name == "dict_output" else {}


def _prepare(arch: Arch, n: int, train: bool, backend: str):
    members = make_members(arch, n)
    for m in members:
        m.train(train)
        set_dropout_eval(m)
    reference = clone_members(members)
    stack = phalanx.stack(members, backend=backend)
    return members, reference, stack


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("backend", "arch", "mode", "n"), CASES)
def test_forward_and_gradients_match_loop(backend, arch, mode, n, train):
    torch.manual_seed(0)
    members, reference, stack = _prepare(arch, n, train, backend)
    args, in_dims, ref_args, grad_leaves = _inputs(arch, mode, n)
    kwargs = _kwargs(arch)

    out = stack(*args, in_dims=in_dims, **kwargs)
    expected = reference_outputs(reference, ref_args, in_dims, kwargs)
    assert_close(out, expected, msg="outputs")

    grads = torch.autograd.grad(stacked_loss(out, n), grad_leaves, retain_graph=True)
    ref_loss = sum(
        member_loss(
            {k: v[i] for k, v in expected.items()}
            if isinstance(expected, dict)
            else tuple(t[i] for t in expected)
            if isinstance(expected, tuple)
            else expected[i]
        )
        for i in range(n)
    )
    ref_grads = torch.autograd.grad(ref_loss, grad_leaves, retain_graph=True)
    assert_close(grads, ref_grads, msg="input gradients")

    stacked_loss(out, n).backward()
    ref_loss.backward()
    params, buffers = stack._stacked_state()
    for name, p in params.items():
        for i, m in enumerate(reference):
            assert_close(p.grad[i], m.get_parameter(name).grad, msg=f"member {i} grad {name}")
    for name, b in buffers.items():
        for i, m in enumerate(reference):
            assert_close(b[i], m.get_buffer(name), msg=f"member {i} buffer {name}")
    # The originals are untouched: the stack copied their tensors.
    for m, r in zip(members, reference):
        for (name, p), (_, q) in zip(m.named_parameters(), r.named_parameters()):
            assert p.grad is None, f"original parameter {name} got a gradient"
            torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("backend", "arch", "mode", "n"), CASES)
def test_twenty_adam_steps_match_loop(backend, arch, mode, n, train):
    torch.manual_seed(0)
    _, reference, stack = _prepare(arch, n, train, backend)
    kwargs = _kwargs(arch)
    opt = torch.optim.Adam(stack.parameters(), lr=1e-2)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in reference]

    for _ in range(20):
        args, in_dims, ref_args, _ = _inputs(arch, mode, n)
        args = tuple(a.detach() for a in args)
        ref_args = tuple(a.detach() for a in ref_args)
        opt.zero_grad()
        stacked_loss(stack(*args, in_dims=in_dims, **kwargs), n).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(reference, ref_opts)):
            member_args = tuple(a[i] if d == 0 else a for a, d in zip(ref_args, in_dims))
            o.zero_grad()
            member_loss(m(*member_args, **kwargs)).backward()
            o.step()

    params, buffers = stack._stacked_state()
    for name, p in itertools.chain(params.items(), buffers.items()):
        for i, m in enumerate(reference):
            assert_close(
                p[i], m.state_dict()[name], msg=f"member {i} {name} after 20 steps", trajectory=True
            )
