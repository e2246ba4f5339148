"""The eager step's executors against each other: ``update_`` on in-place blocks against the
pure ``update`` (derived from it, what ``phalanx.compile_step`` traces) on blocks written back.

Every rule phalanx.optim exports is drawn, with settings drawn from its own ``SETTINGS``
table (a number, or one value per member, for each), masks and block cuts: the two must
give the same bits (tests/test_optim.py checks each member against torch.optim).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import phalanx
from phalanx.optim import MemberOptimizer

N = 5
SHAPES = [(7, 3), (4,), (2, 9)]  # rows that are no multiple of a vector or of a block

#: Every rule phalanx.optim exports (LBFGS is no MemberOptimizer: it has no elementwise rule).
RULES = sorted(
    name
    for name in phalanx.optim.__all__
    if isinstance(cls := getattr(phalanx.optim, name), type)
    and issubclass(cls, MemberOptimizer)
    and cls is not MemberOptimizer
)
#: The range each kind of setting is drawn from.
RANGES = {"rate": (1e-4, 1e-1), "nonneg": (0.0, 0.2), "unit": (0.5, 0.95)}


def _value(draw: Any, low: float, high: float, per_member: bool) -> Any:
    if per_member:
        values = [draw(st.floats(low, high)) for _ in range(N)]
        return torch.tensor(values, dtype=torch.float64)
    return draw(st.floats(low, high))


def _setting(draw: Any, kind: str) -> Any:
    each = draw(st.booleans())
    if kind == "option":
        return draw(st.booleans())
    if kind == "flag":
        return (
            torch.tensor([draw(st.booleans()) for _ in range(N)]) if each else draw(st.booleans())
        )
    return _value(draw, *RANGES[kind], each)


@st.composite
def configs(draw: Any) -> tuple[str, dict[str, Any]]:
    name = draw(st.sampled_from(RULES))
    kwargs: dict[str, Any] = {}
    for s in getattr(phalanx.optim, name).SETTINGS:
        if s.kind != "rate" and not draw(st.booleans()):
            continue  # the rule's default
        if s.parts:
            kwargs[s.name] = tuple(_setting(draw, s.kind) for _ in s.parts)
        else:
            kwargs[s.name] = _setting(draw, s.kind)
    return name, kwargs


def test_the_rules_under_test_are_every_exported_rule() -> None:
    assert {"Adagrad", "Adam", "AdamW", "Lion", "SGD"} <= set(RULES)


@settings(max_examples=60, deadline=None)
@given(
    config=configs(),
    block=st.sampled_from([8, 21, 64, 1 << 16]),
    masks=st.lists(
        st.lists(st.booleans(), min_size=N, max_size=N) | st.none(), min_size=3, max_size=3
    ),
)
def test_in_place_rule_is_the_pure_rule_bit_for_bit(config, block, masks) -> None:
    cls, kwargs = config
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(N, *s, generator=g)) for s in SHAPES]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    try:
        fast = getattr(phalanx.optim, cls)(params, **copy.deepcopy(kwargs), mode="torch")
    except ValueError:  # settings the rule refuses together (SGD's Nesterov without momentum)
        assume(False)
    pure = getattr(phalanx.optim, cls)(twins, **copy.deepcopy(kwargs), mode="torch")
    pure._BLOCKED = True  # the derived pure rule on blocks, written back
    fast.BLOCK = pure.BLOCK = block
    for mask in masks:
        grads = [torch.randn(N, *s, generator=g) for s in SHAPES]
        for p, q, gr in zip(params, twins, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        m = None if mask is None else torch.tensor(mask)
        fast.step(mask=m)
        pure.step(mask=m)
    for j, (p, q) in enumerate(zip(params, twins, strict=True)):
        assert torch.equal(p, q), f"{cls} {kwargs}: parameter {j}"
        for key, value in pure.state[q].items():
            assert torch.equal(fast.state[p][key], value), f"{cls}: state {key} of parameter {j}"


def test_in_place_step_allocates_no_block_sized_temporaries() -> None:
    """The scratch buffers are made once and reused: a second step allocates none of them."""
    p = nn.Parameter(torch.randn(4, 300))
    p.grad = torch.randn(4, 300)
    opt = phalanx.optim.Adam([p], lr=1e-2, mode="torch")
    opt.step()
    first = [t.data_ptr() for t in opt._scratch(p, 2, opt.BLOCK)]
    opt.step(mask=torch.tensor([True, False, True, True]))  # a mask keeps rows in more scratch
    opt.step()
    assert [t.data_ptr() for t in opt._scratch(p, 2, opt.BLOCK)] == first
    assert "_scratch_buffers" not in opt.state_dict()
    # A copy of the optimizer (checkpoint, deepcopy) does not share the scratch of the original.
    twin = copy.deepcopy(opt)
    assert [t.data_ptr() for t in twin._scratch(p, 2, opt.BLOCK)] != first


def test_strided_parameter_takes_the_pure_rule_and_keeps_torchs_bits() -> None:
    """A parameter that cannot be viewed as (N, M) (a transposed stack) runs ``update`` on
    the whole tensor: still torch.optim per member."""
    p = nn.Parameter(torch.randn(3, 4, 6).transpose(1, 2))  # (N, 6, 4), not viewable as (N, M)
    assert not p.is_contiguous()
    refs = [nn.Parameter(p[i].detach().clone()) for i in range(3)]
    opt = phalanx.optim.Adam([p], lr=1e-2)
    ref_opts = [torch.optim.Adam([r], lr=1e-2) for r in refs]
    for _ in range(3):
        grad = torch.randn(3, 4, 6).transpose(1, 2)
        p.grad = grad
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts, strict=True)):
            r.grad = grad[i].clone()
            o.step()
            assert torch.equal(p[i], r)


@pytest.mark.parametrize("threads", [1, 2])
def test_member_bits_hold_on_two_threads(threads: int) -> None:
    """ATen splits a kernel over threads at its own grain; each operation is elementwise and
    rounds the same in its vectorised body and its tail, so a member's bits do not depend on
    where a thread's chunk or a block starts."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, shape = 3, (70001,)
        g = torch.Generator().manual_seed(1)
        p = nn.Parameter(torch.randn(n, *shape, generator=g))
        refs = [nn.Parameter(p[i].detach().clone()) for i in range(n)]
        opt = phalanx.optim.Adam([p], lr=1e-2, weight_decay=0.01, mode="torch")
        ref_opts = [torch.optim.Adam([r], lr=1e-2, weight_decay=0.01) for r in refs]
        for _ in range(2):
            grad = torch.randn(n, *shape, generator=g)
            p.grad = grad
            opt.step()
            for i, (r, o) in enumerate(zip(refs, ref_opts, strict=True)):
                r.grad = grad[i].clone()
                o.step()
        for i in range(n):
            assert torch.equal(p[i], refs[i]), f"member {i}"
    finally:
        torch.set_num_threads(old)


class _CountingLion(phalanx.optim.Lion):
    """A rule that keeps state of its own on ``self`` (a public attribute)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.steps_taken = torch.zeros(self.num_members, dtype=torch.int64)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self.steps_taken += 1
        return super().step(*args, **kwargs)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_rules_own_attributes_survive_copies_without_being_listed(how: str) -> None:
    import pickle

    p = nn.Parameter(torch.randn(3, 4))
    opt = _CountingLion([p], lr=torch.tensor([0.1, 0.2, 0.3]))
    p.grad = torch.randn(3, 4)
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert twin.steps_taken.tolist() == [1, 1, 1] and twin.num_members == 3
    assert "_scratch_buffers" not in twin.__dict__  # caches are made again, not copied


def test_a_tuple_setting_saved_as_a_list_loads_back_as_its_tuple() -> None:
    """A checkpoint written as JSON (or by another tool) holds Adam's betas as a list; the
    table says betas is a tuple setting, so it loads as one."""
    p = nn.Parameter(torch.randn(3, 4))
    opt = phalanx.optim.Adam([p], betas=(torch.tensor([0.9, 0.8, 0.7], dtype=torch.float64), 0.99))
    saved = opt.state_dict()
    saved["param_groups"][0]["betas"] = list(saved["param_groups"][0]["betas"])
    twin = phalanx.optim.Adam([nn.Parameter(p.detach().clone())])
    twin.load_state_dict(saved)
    assert isinstance(twin.param_groups[0]["betas"], tuple)
    assert twin.hyperparameters()["betas"][0].tolist() == [0.9, 0.8, 0.7]
