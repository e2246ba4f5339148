"""The eager step's in-place rules (``update_``) against the pure rules (``update``).

The pure rule is what ``phalanx.compile_step`` traces and what the eager step ran before;
the in-place rule runs the same torch operations with ``out=`` into the parameter, its state
and two scratch buffers. The two must give the same bits for every rule, hyperparameter
kind (a number, or one value per member), mask and block cut, and each member must still be
torch.optim on that member alone (tests/test_optim.py checks that for the common cases).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import phalanx

N = 5
SHAPES = [(7, 3), (4,), (2, 9)]  # rows that are no multiple of a vector or of a block


def _value(draw: Any, low: float, high: float, per_member: bool) -> Any:
    if per_member:
        values = [draw(st.floats(low, high)) for _ in range(N)]
        return torch.tensor(values, dtype=torch.float64)
    return draw(st.floats(low, high))


@st.composite
def configs(draw: Any) -> tuple[str, dict[str, Any]]:
    cls = draw(st.sampled_from(["Adam", "AdamW", "SGD", "Lion"]))
    each = st.booleans()
    kwargs: dict[str, Any] = {"lr": _value(draw, 1e-4, 1e-1, draw(each))}
    if draw(st.booleans()):
        kwargs["weight_decay"] = _value(draw, 0.0, 0.2, draw(each))
    if draw(st.booleans()):
        per = draw(each)
        kwargs["maximize"] = torch.tensor([draw(st.booleans()) for _ in range(N)]) if per else True
    if cls in ("Adam", "AdamW", "Lion"):
        kwargs["betas"] = (
            _value(draw, 0.5, 0.95, draw(each)),
            _value(draw, 0.9, 0.999, draw(each)),
        )
    if cls in ("Adam", "AdamW"):
        kwargs["eps"] = _value(draw, 1e-8, 1e-3, draw(each))
        kwargs["amsgrad"] = draw(st.booleans())
    if cls == "SGD":
        kwargs["momentum"] = _value(draw, 0.0, 0.95, draw(each))
        kwargs["dampening"] = 0.0 if draw(st.booleans()) else _value(draw, 0.0, 0.5, False)
        if kwargs["dampening"] == 0.0 and draw(st.booleans()):
            m = kwargs["momentum"]
            positive = bool((torch.as_tensor(m) > 0).all())
            kwargs["nesterov"] = positive
    return cls, kwargs


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
    fast = getattr(phalanx.optim, cls)(params, **copy.deepcopy(kwargs), mode="torch")
    pure = getattr(phalanx.optim, cls)(twins, **copy.deepcopy(kwargs), mode="torch")
    assert fast.INPLACE
    pure.INPLACE = False  # the blocked pure rule, as before update_ existed
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
