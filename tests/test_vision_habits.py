"""Vision habits on a stack: channels_last, clipping with torch's clip_grad_norm_."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from helpers import assert_close

N = 3
CL = torch.channels_last


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Identity(),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 2),
    )  # fmt: skip


def _members() -> list[nn.Module]:
    out = []
    for i in range(N):
        torch.manual_seed(i)
        out.append(_net())
    return out


@pytest.mark.parametrize("backend", ["fused", "loop"])
def test_channels_last_lays_out_each_member_and_stays_exact(backend):
    members = _members()
    reference = [copy.deepcopy(m).to(memory_format=CL) for m in members]
    stack = phalanx.stack(members, backend=backend)
    before = list(stack.parameters())
    values = [p.detach().clone() for p in before]

    assert stack.to(memory_format=CL) is stack
    assert list(stack.parameters()) == before, "the optimizer's parameters stay the same objects"
    for p, v in zip(stack.parameters(), values):
        assert torch.equal(p, v)
    weight = stack.module[0].weight  # (N, out, in, kh, kw)
    for i in range(N):
        assert weight[i].is_contiguous(memory_format=CL), f"member {i} conv weight"
        assert weight[i].stride() == reference[i][0].weight.stride()

    x = torch.randn(5, 3, 8, 8).to(memory_format=CL).requires_grad_()
    out = stack(x)
    expected = torch.stack([m(x) for m in reference])
    assert_close(out, expected, msg="outputs")
    out.sum().backward()
    expected.sum().backward()
    for i, m in enumerate(reference):
        assert_close(weight.grad[i], m[0].weight.grad, msg=f"member {i} conv weight grad")


def test_channels_last_with_a_dtype_and_back():
    stack = phalanx.stack(_members())
    stack.to(torch.float64, memory_format=CL)
    weight = stack.module[0].weight
    assert weight.dtype == torch.float64 and weight[1].is_contiguous(memory_format=CL)
    stack.to(memory_format=torch.contiguous_format)
    assert weight.is_contiguous()
    assert stack.module[5].weight.is_contiguous(), "a Linear weight is left as it is"


def test_channels_last_on_a_conv3d_member_is_refused_as_torch_refuses_it():
    stack = phalanx.stack([nn.Conv3d(1, 2, 1) for _ in range(N)])
    with pytest.raises(RuntimeError, match="rank 4"):
        stack.to(memory_format=CL)
