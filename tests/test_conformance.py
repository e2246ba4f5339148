"""The conformance table: every backend against the loop of independent copies.

backends x architectures x input modes x N x train/eval: outputs, input gradients, parameter
gradients, buffers, and the parameters after 20 Adam steps, member by member.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import (
    ARCHS,
    assert_close,
    check_forward_and_gradients,
    inputs_for,
    kwargs_for,
    member_loss,
    prepare,
    stacked_loss,
)

BACKENDS = ["loop", "vmap", "fused", "auto"]

# Known gaps: strict xfails, so that a gap that closes (or opens elsewhere) is noticed. None
# today: every backend runs the member's own forward under vmap or member by member.
GAPS: dict[tuple[str, str], pytest.MarkDecorator] = {}

CASES = [
    pytest.param(
        backend,
        arch,
        mode,
        n,
        id=f"{backend}-{arch.name}-{mode}-N{n}",
        marks=[GAPS[backend, arch.name]] if (backend, arch.name) in GAPS else [],
    )
    for backend, arch, mode, n in itertools.product(
        BACKENDS, ARCHS, ["shared", "per_member", "sliced"], [1, 3, 8]
    )
    if mode != "sliced" or arch.sliceable
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("backend", "arch", "mode", "n"), CASES)
def test_forward_and_gradients_match_loop(backend, arch, mode, n, train):
    check_forward_and_gradients(backend, arch, mode, n, train)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("backend", "arch", "mode", "n"), CASES)
def test_twenty_adam_steps_match_loop(backend, arch, mode, n, train):
    torch.manual_seed(0)
    _, reference, stack = prepare(arch, n, train, backend)
    kwargs = kwargs_for(arch)
    opt = torch.optim.Adam(stack.parameters(), lr=1e-2)
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in reference]

    for _ in range(20):
        args, in_dims, ref_args, _ = inputs_for(arch, mode, n)
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

    params, buffers = stack.stacked_state()
    for name, p in itertools.chain(params.items(), buffers.items()):
        for i, m in enumerate(reference):
            assert_close(
                p[i], m.state_dict()[name], msg=f"member {i} {name} after 20 steps", trajectory=True
            )
