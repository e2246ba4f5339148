"""stack_from_factory: N members built one at a time into the stack, each as its own seed makes it."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import phalanx
import phalanx.distributed as pdist
from helpers import assert_close
from phalanx.core._build import stack_from_factory


class Tied(nn.Module):
    """Linear, BatchNorm (buffers), Dropout, and a weight used twice (a tie)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.0)
        self.out = nn.Linear(width, width)
        self.back = nn.Linear(width, width)
        self.back.weight = self.out.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(torch.tanh(self.out(self.drop(self.norm(self.inp(x))))))


def _reference(factory, n: int, seed: int) -> list[nn.Module]:
    members = []
    for i in range(n):
        torch.manual_seed(seed + i)
        members.append(factory(i))
    return members


def test_each_member_is_bit_identical_to_its_own_seeded_factory_call() -> None:
    def factory(i: int) -> nn.Module:
        model = Tied()
        with torch.no_grad():  # buffers that differ per member, from the member's own RNG
            model.norm.running_mean.normal_()
        return model

    stack = stack_from_factory(factory, num_members=5, seed=11, backend="loop")
    members = _reference(factory, 5, seed=11)
    params, buffers = stack.stacked_state()
    assert set(params) == {n for n, _ in members[0].named_parameters()}
    for i, member in enumerate(members):
        for name, p in member.named_parameters():
            assert torch.equal(params[name][i], p), (i, name)
        for name, b in member.named_buffers():
            assert torch.equal(buffers[name][i], b), (i, name)
    assert stack.module.back.weight is stack.module.out.weight  # the tie survives
    x = torch.randn(3, 5)
    for m in members:
        m.eval()
    stack.eval()
    expected = torch.stack([m(x) for m in members])
    assert_close(stack(x), expected, dtype=torch.float32)


def test_the_callers_random_state_is_left_alone_and_seed_none_leaves_seeding_to_the_factory():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    stack_from_factory(lambda: nn.Linear(2, 2), num_members=3)
    assert torch.equal(torch.rand(3), expected)

    def seeds_itself(i: int) -> nn.Module:
        torch.manual_seed(100 * i)
        return nn.Linear(2, 2)

    stack = stack_from_factory(seeds_itself, num_members=2, seed=None)
    torch.manual_seed(100)
    assert torch.equal(stack.module.weight[1], nn.Linear(2, 2).weight)


def test_only_one_member_is_alive_at_a_time() -> None:
    alive: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    counts = []

    def factory(i: int) -> nn.Module:
        counts.append(len(alive))  # members still alive when member i is about to be built
        model = nn.Linear(4, 4)
        alive.add(model)
        return model

    stack_from_factory(factory, num_members=6)
    assert counts == [0] * 6
    assert len(alive) == 0  # the stack keeps none of them (member 0 included)


def test_pdist_shard_builds_the_same_stack() -> None:
    stack, _ = pdist.shard(lambda i: Tied(), num_members=4, seed=2)
    built = stack_from_factory(lambda i: Tied(), num_members=4, seed=2)
    for a, b in zip(stack.state_dict().values(), built.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_errors_name_the_member_what_differs_and_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"phalanx.stack\(\): the factory built members of different architectures; member "
        r"0 is the reference:\n  - member 3 parameter 'bias' (.|\n)*member 3 parameter 'weight' has shape \(3, 2\), member 0 "
        r"has \(2, 2\)(.|\n)*build one architecture for every index",
    ):
        stack_from_factory(lambda i: nn.Linear(2, 3 if i == 3 else 2), num_members=5)
    with pytest.raises(ValueError, match=r"member 0 holds 'weight' on the meta device"):
        stack_from_factory(lambda: nn.Linear(2, 2, device="meta"), num_members=2)
    with pytest.raises(TypeError, match=r"the factory returned a int for member 0"):
        stack_from_factory(lambda i: i, num_members=2)
    with pytest.raises(TypeError, match=r"expected a factory that builds one member"):
        stack_from_factory(nn.Linear(2, 2), num_members=2)
    with pytest.raises(ValueError, match=r"num_members must be a positive int.*got 0"):
        stack_from_factory(lambda: nn.Linear(2, 2), num_members=0)
    with pytest.raises(ValueError, match=r"unknown backend 'fast'"):
        stack_from_factory(lambda: nn.Linear(2, 2), num_members=2, backend="fast")


def test_a_stack_built_from_a_factory_trains_like_one_built_from_modules() -> None:
    built = stack_from_factory(lambda i: nn.Linear(4, 3), num_members=3, seed=0)
    plain = phalanx.stack(_reference(lambda i: nn.Linear(4, 3), 3, seed=0))
    x = torch.randn(6, 4)
    for s in (built, plain):
        opt = torch.optim.SGD(s.parameters(), lr=0.1)
        s(x).square().sum().backward()
        opt.step()
    for a, b in zip(built.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_phalanx_stack_takes_a_factory():
    stack = phalanx.stack(lambda i: nn.Linear(4, 3), num_members=5, seed=7)
    torch.manual_seed(7 + 3)
    assert torch.equal(stack.module.weight[3], nn.Linear(4, 3).weight)
    with pytest.raises(TypeError, match=r"a factory needs num_members=N"):
        phalanx.stack(lambda i: nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"num_members=3 but 2 modules were given"):
        phalanx.stack([nn.Linear(4, 3), nn.Linear(4, 3)], num_members=3)


def test_a_factory_whose_members_differ_in_settings_is_refused():
    with pytest.raises(
        ValueError, match=r"member 1 submodule '1' is LeakyReLU\(negative_slope=0.5\), member 0 has"
    ):
        phalanx.stack(
            lambda i: nn.Sequential(nn.Linear(2, 2), nn.LeakyReLU(0.1 if i == 0 else 0.5)),
            num_members=2,
        )
