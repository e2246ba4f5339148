"""Shared test helpers: the architectures of the conformance table and the loop reference.

Imported by the test files as ``from helpers import ...`` (pytest puts ``tests/`` on the path);
``conftest.py`` is for pytest's own hooks and fixtures only.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

import phalanx

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

# What "equal" means is defined once, in phalanx.testing: assert_equal_to_loop against a
# float64 loop, and this fixed-tolerance screen for two results of one precision.
assert_close = phalanx.testing.assert_close


# --------------------------------------------------------------------------------- architectures


class ViewCatIndex(nn.Module):
    """A member whose own forward reshapes, concatenates and indexes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 8)
        self.head = nn.Linear(8 + 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        h = self.fc(x.view(b, -1))  # (B, 3, 4) -> (B, 12)
        h = torch.cat([h, x[:, 0, :]], dim=-1)  # indexing along a feature dim
        return self.head(torch.tanh(h))[..., :2] * 2


class TwoInTupleOut(nn.Module):
    """Two positional inputs, a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x) + self.b(z))
        return h, h.sum(-1)


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
        h = self.fc(x) * scale
        return {"mean": h, "logits": h.log_softmax(-1)}


@dataclass(frozen=True)
class Arch:
    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[torch.Tensor, ...]]  # shared inputs for batch size B
    sliceable: bool = False  # one flat input: also testable as a sliced input


def _q1() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 1))


def _q2() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2))


def _mlp_ln() -> nn.Module:
    return nn.Sequential(
        nn.Linear(7, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 3)
    )


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(
            2, 4, 3, padding=1, bias=False
        ),  # a bias before BN gets a zero gradient: Adam on rounding noise
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )


ARCHS = [
    Arch("question1", _q1, lambda b: (torch.randn(b, 20),), sliceable=True),
    Arch("question2", _q2, lambda b: (torch.randn(b, 10),), sliceable=True),
    Arch("mlp_layernorm_gelu_dropout", _mlp_ln, lambda b: (torch.randn(b, 7),), sliceable=True),
    Arch("cnn_batchnorm_pool", _cnn, lambda b: (torch.randn(b, 2, 8, 8),)),
    Arch("view_cat_index", ViewCatIndex, lambda b: (torch.randn(b, 3, 4),)),
    Arch(
        "two_inputs_tuple_output", TwoInTupleOut, lambda b: (torch.randn(b, 5), torch.randn(b, 3))
    ),
    Arch("dict_output", DictOut, lambda b: (torch.randn(b, 6),)),
]
ARCH_IDS = [a.name for a in ARCHS]


def make_members(arch: Arch, n: int, seed: int = 0, dtype=torch.float32) -> list[nn.Module]:
    """N members with different weights; member i is initialised from seed + i."""
    members = []
    for i in range(n):
        torch.manual_seed(seed + i)
        m = arch.make().to(dtype)
        # BatchNorm starts with identical statistics; make them differ so mixing would show.
        for b in m.buffers():
            if b.is_floating_point():
                b.add_(torch.rand_like(b) * 0.1 * (i + 1))
        members.append(m)
    return members


def member_loss(out: Any) -> torch.Tensor:
    """A loss on one member's output that touches every output leaf."""
    return sum((leaf.float() ** 2).mean() + leaf.float().mean() for leaf in pytree.tree_leaves(out))


def stacked_loss(out: Any, n: int) -> torch.Tensor:
    """The sum of the N members' losses: never mixes members."""
    return sum(member_loss(pytree.tree_map(lambda t, i=i: t[i], out)) for i in range(n))


def reference_outputs(members: list[nn.Module], args: tuple, in_dims: tuple, kwargs=None) -> Any:
    """The loop of independent copies: the truth."""
    kwargs = kwargs or {}
    outs = []
    for i, m in enumerate(members):
        member_args = tuple(a[i] if d == 0 else a for a, d in zip(args, in_dims))
        outs.append(m(*member_args, **kwargs))
    return pytree.tree_map(lambda *leaves: torch.stack(leaves), *outs)


def set_dropout_eval(module: nn.Module) -> None:
    """Dropout masks are random per backend; conformance compares with dropout off."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.eval()


def clone_members(members: list[nn.Module]) -> list[nn.Module]:
    return [copy.deepcopy(m) for m in members]


B = 5


def _float_requires_grad(t: torch.Tensor) -> torch.Tensor:
    return t.requires_grad_() if t.is_floating_point() else t


def _grad_leaves(args: tuple) -> tuple:
    return tuple(a for a in args if a.requires_grad)


def inputs_for(arch: Arch, mode: str, n: int):
    """(stack_args, in_dims, reference_args, leaves_with_grad) for one input mode."""
    if mode == "shared":
        args = tuple(_float_requires_grad(a) for a in arch.inputs(B))
        return args, (None,) * len(args), args, _grad_leaves(args)
    if mode == "per_member":
        per = [arch.inputs(B) for _ in range(n)]
        args = tuple(_float_requires_grad(torch.stack(col)) for col in zip(*per))
        return args, (0,) * len(args), args, _grad_leaves(args)
    (x,) = arch.inputs(B)
    wide = torch.randn(B, n * x.shape[1], requires_grad=True)
    xs = phalanx.split(wide, n, dim=1)
    return (xs,), (0,), (xs,), (wide,)


def kwargs_for(arch: Arch) -> dict:
    return {"scale": 0.5} if arch.name == "dict_output" else {}


def prepare(arch: Arch, n: int, train: bool, backend: str):
    members = make_members(arch, n)
    for m in members:
        m.train(train)
        set_dropout_eval(m)
    reference = clone_members(members)
    stack = phalanx.stack(members, backend=backend)
    return members, reference, stack


def assert_members_match(stack: phalanx.Stack, reference: list[nn.Module]) -> None:
    """Member by member: the stack's parameter gradients and buffers equal the reference
    modules' own."""
    params, buffers = stack.stacked_state()
    for name, p in params.items():
        for i, m in enumerate(reference):
            assert_close(p.grad[i], m.get_parameter(name).grad, msg=f"member {i} grad {name}")
    for name, b in buffers.items():
        for i, m in enumerate(reference):
            assert_close(b[i], m.get_buffer(name), msg=f"member {i} buffer {name}")


def check_forward_and_gradients(backend, arch, mode, n, train):
    """Outputs, input and parameter gradients and buffers against independent copies."""
    torch.manual_seed(0)
    members, reference, stack = prepare(arch, n, train, backend)
    args, in_dims, ref_args, grad_leaves = inputs_for(arch, mode, n)
    kwargs = kwargs_for(arch)

    out = stack(*args, in_dims=in_dims, **kwargs)
    expected = reference_outputs(reference, ref_args, in_dims, kwargs)
    assert_close(out, expected, msg="outputs")

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
    if grad_leaves:  # integer inputs (embedding indices) take no gradient
        grads = torch.autograd.grad(stacked_loss(out, n), grad_leaves, retain_graph=True)
        ref_grads = torch.autograd.grad(ref_loss, grad_leaves, retain_graph=True)
        assert_close(grads, ref_grads, msg="input gradients")

    stacked_loss(out, n).backward()
    ref_loss.backward()
    assert_members_match(stack, reference)
    # The originals are untouched: the stack copied their tensors.
    for m, r in zip(members, reference):
        for (name, p), (_, q) in zip(m.named_parameters(), r.named_parameters()):
            assert p.grad is None, f"original parameter {name} got a gradient"
            torch.testing.assert_close(p, q, rtol=0, atol=0)


class Terminal(io.StringIO):
    """A standard error that says it is a terminal (where progress bars show by default)."""

    def isatty(self) -> bool:
        return True


PROGRESS_CASES = [
    (False, None, False),
    (True, None, True),
    (True, False, False),
    (False, True, True),
]
"""(stderr is a terminal, ``progress=``, a bar is shown): the default follows the terminal."""
