"""What a member may return: tensors in a structure torch's pytree sees into.

A member returning an object pytree does not know (an unregistered dataclass, a class holding
tensors in its attributes) would have its tensors pass through the stack as one member's:
every backend, the routed calls and ``member_losses`` refuse it, naming the registration. A
registered dataclass is stacked field by field, equal to the loop member by member.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import phalanx
from phalanx.testing import assert_equal_to_loop

BACKENDS = ["loop", "vmap", "fused", "auto"]


@dataclasses.dataclass
class Hidden:
    mean: torch.Tensor
    logvar: torch.Tensor


@dataclasses.dataclass
class Shown:
    mean: torch.Tensor
    logvar: torch.Tensor


torch.export.register_dataclass(Shown)


class Box:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Head(nn.Module):
    def __init__(self, wrap) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.wrap = wrap

    def forward(self, x: torch.Tensor):
        h = self.lin(x)
        return self.wrap(h)


def _members(wrap, n: int = 3, dtype=torch.float32) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Head(wrap).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("wrap", "match"),
    [
        (
            lambda h: Hidden(h, 2 * h),
            r"instance of Hidden, a dataclass.*register_dataclass\(Hidden\)",
        ),
        (lambda h: (h, Hidden(h, h)), r"instance of Hidden.*register_dataclass\(Hidden\)"),
        (lambda h: {"box": Box(h)}, r"instance of Box holding tensors.*register_pytree_node"),
    ],
    ids=["dataclass", "dataclass-in-tuple", "object"],
)
def test_an_output_hiding_tensors_is_refused(backend, wrap, match):
    stack = phalanx.stack(_members(wrap), backend=backend)
    with pytest.raises(TypeError, match=r"Stack.forward\(\): a member returned an " + match):
        stack(torch.randn(5, 3))


def test_a_routed_call_refuses_an_output_hiding_tensors():
    stack = phalanx.stack(_members(lambda h: Hidden(h, h)))
    with pytest.raises(TypeError, match=r"register_dataclass\(Hidden\)"):
        stack(torch.randn(4, 3), members=torch.tensor([0, 2, 1, 0]))


def test_member_losses_refuses_an_output_hiding_tensors():
    out = Hidden(torch.zeros(3, 5, 4), torch.zeros(3, 5, 4))
    with pytest.raises(TypeError, match=r"member_losses.*register_dataclass\(Hidden\)"):
        phalanx.member_losses(lambda o, t: o.mean.sum(), out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_registered_dataclass_is_stacked_field_by_field(backend):
    members = _members(lambda h: Shown(h, h.exp()))
    stack = phalanx.stack(copy.deepcopy(members), backend=backend)
    x = torch.randn(5, 3)
    out = stack(x)
    assert isinstance(out, Shown)
    reference = [m.double()(x.double()) for m in copy.deepcopy(members)]
    loop = [m(x) for m in members]
    for field in ("mean", "logvar"):
        got = getattr(out, field)
        assert got.shape == (3, 5, 4)
        assert_equal_to_loop(
            got,
            torch.stack([getattr(o, field) for o in loop]),
            torch.stack([getattr(r, field) for r in reference]),
            what=field,
            per_member=True,
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_non_tensor_leaves_pass_through(backend):
    stack = phalanx.stack(_members(lambda h: (h, None, "tag", 3)), backend=backend)
    out, none, tag, three = stack(torch.randn(5, 3))
    assert out.shape == (3, 5, 4)
    assert (none, tag, three) == (None, "tag", 3)
