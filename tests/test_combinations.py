"""The combination table: every way to run a stack (a row) against everything a member may do
(a column), each cell run against the loop over the members alone, member by member, or an
expected refusal.

Rows: the backends (loop, vmap, fused, auto) on a shared and on a per-member input;
``backward_in_chunks``; routed ``members=`` and ``subset=`` calls; a stack of padded widths;
``compile_step``; ``torch.compile``; ``phalanx.export``. Columns (``KINDS``): a plain member,
its own ``torch.Generator``, a forward that seeds a generator of its own, dropout, an in-place
write of its input, of a buffer (a step counter and an EMA) and of a weight, BatchNorm, a
recurrence (GRU), a branch on a value, a keyword input, a tuple output holding None.

A cell compares what the loop compares: the outputs, each member's parameter gradients, the
input's gradient, and the state after the call (buffers, the members' generators, the
input a forward wrote into). The loop reference runs deep copies of the members one by one
(``reference``). Randomness the loop draws from the global generator (dropout) is the loop's
own draws on the loop backend; on the batched backends each member draws its own mask, so
the cell takes the mask from the output and runs the loop with it (``_dropout_masks``).

A cell expects "exact" (equal to the loop) or a refusal (``Refuse``: the exception type and
a pattern its message must match). A cell that another engineer's open item covers is a
strict xfail naming the item (``GAPS``), so it flips when the fix merges; a cell marked
"exact_or_refusal" passes on either, as the issue allows ("the members' answer or a clear
refusal"), and fails on a silent wrong answer.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils import _pytree as pytree

import phalanx
from phalanx.testing import assert_close

N, B, D, H, T = 3, 4, 4, 5, 3

KINDS = [
    "plain",
    "own_generator",
    "reseed",
    "dropout",
    "inplace_input",
    "buffer_write",
    "weight_write",
    "batchnorm",
    "recurrent",
    "value_branch",
    "dropout_branch",
    "keyword",
    "tuple_none",
]


def has(kind: str, name: str) -> bool:
    """Whether the member ``kind`` does ``name`` (a kind joins several with "+")."""
    return name in kind.split("+")


class Member(nn.Module):
    """One member doing what ``kind`` names (``KINDS``, or several joined with "+") besides a
    Linear-Tanh-Linear body."""

    def __init__(self, kind: str, seed: int, width: int = H) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        if has(kind, "recurrent"):
            self.rnn = nn.GRU(D, width, batch_first=True)
        else:
            self.inp = nn.Linear(D, width)
        self.out = nn.Linear(width, 2)
        if has(kind, "own_generator"):
            self.g = torch.Generator().manual_seed(100 + seed)
        if has(kind, "dropout") or has(kind, "dropout_branch"):
            self.drop = nn.Dropout(0.5)
        if has(kind, "buffer_write"):
            self.register_buffer("calls", torch.zeros(()))
            self.register_buffer("ema", torch.zeros(()))
        if has(kind, "batchnorm"):
            self.bn = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor | None = None) -> Any:
        kind = self.kind
        if has(kind, "inplace_input"):
            x /= 2
        if has(kind, "own_generator"):
            x = x + 0.1 * torch.randn(x.shape, generator=self.g)
        if has(kind, "reseed"):
            g = torch.Generator().manual_seed(7)
            x = x + 0.1 * torch.randn(x.shape, generator=g)
        if has(kind, "weight_write"):
            with torch.no_grad():
                self.inp.weight.clamp_(-0.3, 0.3)
        h = self.rnn(x)[0][:, -1] if has(kind, "recurrent") else self.inp(x)
        if has(kind, "batchnorm"):
            h = self.bn(h)
        h = torch.tanh(h)
        if has(kind, "buffer_write"):
            self.calls += 1
            self.ema.mul_(0.5).add_(0.5 * self.calls)
            h = h * self.calls + self.ema
        if has(kind, "value_branch") and h.sum() > 0:
            h = h * 2
        if has(kind, "dropout_branch"):  # draws from the global generator, then branches
            h = self.drop(h)
            if h.sum() > 0:
                h = h * 2
        if has(kind, "keyword"):
            assert scale is not None
            h = h * scale
        y = self.out(h)
        if has(kind, "dropout"):
            y = self.drop(y)
        if has(kind, "tuple_none"):
            return y, None, h.sum(-1)
        return y


# ----------------------------------------------------------------------------- the loop


def members_for(kind: str, widths: list[int] | None = None) -> list[nn.Module]:
    return [Member(kind, i, H if widths is None else widths[i]) for i in range(N)]


def input_for(kind: str, per_member: bool, rows: int = B) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    shape = (rows, T, D) if has(kind, "recurrent") else (rows, D)
    return torch.randn((N, *shape) if per_member else shape, generator=g)


def kwargs_for(kind: str, widths: list[int] | None = None) -> dict[str, Any]:
    if not has(kind, "keyword"):
        return {}
    return {"scale": torch.linspace(0.5, 1.5, max(widths or [H]))}


def _scale_for(kwargs: dict[str, Any], width: int) -> dict[str, Any]:
    return {k: v[:width] for k, v in kwargs.items()}


def loss_of(out: Any) -> torch.Tensor:
    """Each member's loss, (N,) from stacked outputs: sums of squares, never mixing members."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return sum(t.pow(2).flatten(1).sum(1) for t in leaves)  # type: ignore[return-value]


@dataclass
class Result:
    """What a cell compares: outputs (N, ...), per-member losses, per-member parameter grads
    by name (N, ...), the input's gradient, buffers by name (N, ...), each member's generator
    states, and the input after the call."""

    out: Any
    losses: torch.Tensor
    grads: dict[str, torch.Tensor]
    x_grad: torch.Tensor | None
    buffers: dict[str, torch.Tensor]
    generators: list[torch.Tensor]
    x_after: torch.Tensor


def _leaf_input(x: torch.Tensor, kind: str) -> torch.Tensor:
    x = x.clone()
    # A leaf that requires grad cannot be written in place: that member's input carries none.
    return x if has(kind, "inplace_input") else x.requires_grad_(True)


def reference(
    members: list[nn.Module],
    kind: str,
    x: torch.Tensor,
    per_member: bool,
    kwargs: dict[str, Any],
    chosen: list[int] | None = None,
    masks: torch.Tensor | None = None,
) -> Result:
    """The members alone, one after another, on deep copies: member i on its own copy of a
    shared input (the stack writes a shared input once: every member sees x / 2)."""
    models = copy.deepcopy(members)
    chosen = list(range(len(models))) if chosen is None else chosen
    xs = _leaf_input(x, kind)
    outs, losses, x_grads = [], [], []
    x_after = x.clone()
    for j, i in enumerate(chosen):
        m = models[i]
        own = (xs[i] if per_member else xs).clone()
        if not has(kind, "inplace_input"):
            own = own.detach().requires_grad_(True)
        width = m.out.in_features
        if masks is not None:  # the batched backend's own dropout draw, given to the loop
            m.eval()
            out = m(own, **_scale_for(kwargs, width)) * masks[j] * 2
        else:
            out = m(own, **_scale_for(kwargs, width))
        loss = loss_of(_unsqueeze(out))[0]
        loss.backward()
        outs.append(out)
        losses.append(loss.detach())
        x_grads.append((i, own.grad))
        if has(kind, "inplace_input"):
            if per_member:
                x_after[i] = own.detach()
            else:
                x_after = own.detach().clone()
    grads = {
        name: _pad_stack([dict(models[i].named_parameters())[name].grad for i in chosen])
        for name, _ in models[0].named_parameters()
    }
    buffers = {
        name: _pad_stack([dict(models[i].named_buffers())[name] for i in chosen])
        for name, _ in models[0].named_buffers()
    }
    x_grad = None
    if not has(kind, "inplace_input"):
        if per_member:
            x_grad = torch.zeros_like(x)
            for i, g in x_grads:
                x_grad[i] = g
        else:
            x_grad = sum(g for _, g in x_grads)
    gens = [models[i].g.get_state() for i in chosen] if has(kind, "own_generator") else []
    stacked = _stack_outputs(outs)
    return Result(stacked, torch.stack(losses), grads, x_grad, buffers, gens, x_after)


def _pad_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The members' tensors zero-padded to the widest one's shape and stacked (N, ...)."""
    shape = [max(s) for s in zip(*(t.shape for t in tensors))]
    padded = []
    for t in tensors:
        full = t.new_zeros(shape)
        full[tuple(slice(0, s) for s in t.shape)] = t
        padded.append(full)
    return torch.stack(padded)


def _unsqueeze(out: Any) -> Any:
    return pytree.tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, out)


def _stack_outputs(outs: list[Any]) -> Any:
    flat = [pytree.tree_flatten(o) for o in outs]
    spec = flat[0][1]
    cols = zip(*(f[0] for f in flat))
    return pytree.tree_unflatten(
        [torch.stack([t.detach() for t in c]) if isinstance(c[0], torch.Tensor) else c[0]
         for c in cols],
        spec,
    )  # fmt: skip


# ----------------------------------------------------------------------------- the rows


def _stack(members: list[nn.Module], backend: str, **kw: Any) -> phalanx.Stack:
    return phalanx.stack(copy.deepcopy(members), backend=backend, **kw)


def _collect(
    stack: phalanx.Stack,
    out: Any,
    losses: torch.Tensor,
    xs: torch.Tensor,
    kind: str,
    chosen: list[int] | None = None,
) -> Result:
    rows = list(range(N)) if chosen is None else chosen
    grads = {}
    for name, p in stack.module.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        grads[name] = g[rows]
    buffers = {name: b[rows].clone() for name, b in stack.module.named_buffers()}
    gens = (
        [stack.member_generators(i)[0].get_state() for i in rows]
        if has(kind, "own_generator")
        else []
    )
    x_grad = xs.grad if not has(kind, "inplace_input") else None
    detached = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    return Result(detached, losses.detach(), grads, x_grad, buffers, gens, xs.detach().clone())


def run_eager(kind: str, backend: str, per_member: bool) -> tuple[Result, Result]:
    return _run_once(kind, backend, per_member)


def _run_once(
    kind: str, backend: str, per_member: bool, widths: list[int] | None = None
) -> tuple[Result, Result]:
    """One forward and backward of the stack (of members of ``widths``, padded), and the loop."""
    members = members_for(kind, widths)
    x, kwargs = input_for(kind, per_member), kwargs_for(kind, widths)
    stack = _stack(members, backend, **({} if widths is None else {"pad_widths": True}))
    xs = _leaf_input(x, kind)
    torch.manual_seed(123)
    out = stack(xs, in_dims=0 if per_member else None, **kwargs)
    losses = loss_of(out)
    losses.sum().backward()
    got = _collect(stack, out, losses, xs, kind)
    torch.manual_seed(123)
    masks = _dropout_masks(kind, backend, out)
    return got, reference(members, kind, x, per_member, kwargs, masks=masks)


def _dropout_masks(kind: str, backend: str, out: Any) -> torch.Tensor | None:
    """On the batched backends each member draws its own dropout mask: read it from the
    output (dropout comes last: an entry is 0 or twice the member's value) for the loop."""
    if not has(kind, "dropout") or backend == "loop":
        return None
    masks = (out.detach() != 0).to(out.dtype)
    assert not all(torch.equal(masks[0], masks[i]) for i in range(1, N)), "one mask for all"
    return masks


def run_chunks(kind: str, backend: str, per_member: bool) -> tuple[Result, Result]:
    members = members_for(kind)
    x, kwargs = input_for(kind, per_member), kwargs_for(kind)
    stack = _stack(members, backend)
    xs = _leaf_input(x, kind)
    torch.manual_seed(123)
    losses = stack.backward_in_chunks(
        lambda out, rows: loss_of(out), xs, chunk_members=2,
        in_dims=0 if per_member else None, **kwargs,
    )  # fmt: skip
    got = _collect(stack, None, losses, xs, kind)
    torch.manual_seed(123)
    want = reference(members, kind, x, per_member, kwargs)
    want.out = None
    want.x_grad = None  # the input's gradient: test_chunks_input_gradient
    return got, want


ROUTE = torch.tensor([2, 0, 2, 0])  # member 1 gets no rows


def run_routed(kind: str, backend: str, per_member: bool) -> tuple[Result, Result]:
    assert not per_member
    members = members_for(kind)
    x, kwargs = input_for(kind, False), kwargs_for(kind)
    stack = _stack(members, backend)
    xs = _leaf_input(x, kind)
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fused says it runs the general path
        out = stack(xs, members=ROUTE, **kwargs)
    total = loss_of(_unsqueeze(out))[0]
    total.backward()
    got = _collect(stack, out, total.reshape(1), xs, kind)
    # the loop: each member on its own rows (x[rows] is a copy: x itself is never written)
    models = copy.deepcopy(members)
    xr = _leaf_input(x, kind)
    torch.manual_seed(123)
    outs: list[Any] = [None] * N
    for i, m in enumerate(models):
        rows = torch.eq(ROUTE, i).nonzero().flatten()
        if len(rows):
            outs[i] = (rows, m(xr[rows], **kwargs))
    flat_spec = None
    pieces: dict[int, list[Any]] = {}
    for item in outs:
        if item is None:
            continue
        rows, o = item
        leaves, flat_spec = pytree.tree_flatten(o)
        for k, leaf in enumerate(leaves):
            pieces.setdefault(k, []).append((rows, leaf))
    merged = []
    for k in sorted(pieces):
        first = pieces[k][0][1]
        if not isinstance(first, torch.Tensor):
            merged.append(first)
            continue
        full = first.new_zeros((B, *first.shape[1:]))
        for rows, leaf in pieces[k]:
            full = full.index_copy(0, rows, leaf)
        merged.append(full)
    ref_out = pytree.tree_unflatten(merged, flat_spec)
    ref_total = loss_of(_unsqueeze(ref_out))[0]
    ref_total.backward()
    grads = {
        name: torch.stack([
            p.grad if (p := dict(m.named_parameters())[name]).grad is not None
            else torch.zeros_like(p)
            for m in models
        ])
        for name, _ in models[0].named_parameters()
    }  # fmt: skip
    buffers = {
        name: torch.stack([dict(m.named_buffers())[name] for m in models])
        for name, _ in models[0].named_buffers()
    }
    gens = [m.g.get_state() for m in models] if has(kind, "own_generator") else []
    detached = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, ref_out)
    x_grad = xr.grad if not has(kind, "inplace_input") else None
    want = Result(detached, ref_total.detach().reshape(1), grads, x_grad, buffers, gens,
                  x.clone())  # fmt: skip
    return got, want


SUBSET = [2, 0]


def run_subset(kind: str, backend: str, per_member: bool) -> tuple[Result, Result]:
    members = members_for(kind)
    x, kwargs = input_for(kind, per_member), kwargs_for(kind)
    stack = _stack(members, backend)
    # a per-member input holds the chosen members' rows, in the subset's order
    xs = _leaf_input(x[SUBSET] if per_member else x, kind)
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = stack(xs, subset=SUBSET, in_dims=0 if per_member else None, **kwargs)
    losses = loss_of(out)
    losses.sum().backward()
    got = _collect(stack, out, losses, xs, kind, chosen=SUBSET)
    torch.manual_seed(123)
    masks = _dropout_masks_subset(kind, backend, out)
    want = reference(members, kind, x, per_member, kwargs, chosen=SUBSET, masks=masks)
    if per_member:
        want.x_after = want.x_after[SUBSET]
        if want.x_grad is not None:
            want.x_grad = want.x_grad[SUBSET]
    return got, want


def _dropout_masks_subset(kind: str, backend: str, out: Any) -> torch.Tensor | None:
    if not has(kind, "dropout") or backend == "loop":
        return None
    return (out.detach() != 0).to(out.dtype)


WIDTHS = [3, 4, 5]


def run_padded(kind: str, backend: str, per_member: bool) -> tuple[Result, Result]:
    return _run_once(kind, backend, per_member, WIDTHS)


RUNNERS = {
    "eager": run_eager,
    "chunks": run_chunks,
    "routed": run_routed,
    "subset": run_subset,
    "padded": run_padded,
}


# ------------------------------------------------------------------------ expectations


@dataclass(frozen=True)
class Refuse:
    """The cell expects this refusal: the exception type and a pattern of its message."""

    error: type[BaseException]
    match: str


EXACT = "exact"
EITHER = "exact_or_refusal"

BRANCH = Refuse(RuntimeError, r"turns its data into a Python value \(a branch on a tensor")
GENERATOR = Refuse(RuntimeError, r"(?i)generator")
NO_GRU = Refuse(RuntimeError, r"backend 'vmap' cannot run this architecture under torch.func.vmap")


def _unpadded(reason: str) -> Refuse:
    return Refuse(ValueError, r"(?s)cannot be padded to one stack exactly:.*" + reason)


# Cells whose expectation is not EXACT; everything else must equal the loop.
EXPECT: dict[tuple[str, str, str], Any] = {}
_BATCHED_ROWS = ("eager-shared", "eager-per_member", "subset-shared", "subset-per_member",
                 "padded-shared", "chunks-shared", "chunks-per_member")  # fmt: skip
for _row in _BATCHED_ROWS:
    for _backend in ("vmap", "fused"):
        EXPECT[(_row, _backend, "value_branch")] = BRANCH
        EXPECT[(_row, _backend, "dropout_branch")] = BRANCH
        EXPECT[(_row, _backend, "own_generator")] = GENERATOR
        EXPECT[(_row, _backend, "reseed")] = EITHER
    EXPECT[(_row, "vmap", "recurrent")] = NO_GRU
# pad_widths=True refuses at phalanx.stack() what it cannot prove keeps padded units out
for _backend in ("loop", "vmap", "fused", "auto"):
    for _kind, _reason in [
        ("buffer_write", "combines a padded tensor with one padded otherwise"),
        ("keyword", "combines a padded tensor with one padded otherwise"),
        ("weight_write", "reads a padded parameter directly"),
        ("recurrent", "cannot check that a GRU keeps the padded units out"),
        ("value_branch", "torch.fx cannot trace the member's forward"),
        ("dropout_branch", "torch.fx cannot trace the member's forward"),
        ("tuple_none", "cannot check that it keeps the padded units out of the result"),
    ]:
        EXPECT[("padded-shared", _backend, _kind)] = _unpadded(_reason)

# A known gap is a strict xfail naming what is missing (GAPS); none is open. Cells whose fix
# may end either way (exact, or a refusal naming the generator) accept both (EITHER).
GAPS: dict[tuple[str, str, str], str] = {}
for _backend in ("loop", "vmap", "fused", "auto"):
    for _inp in ("shared", "per_member"):
        EXPECT[(f"chunks-{_inp}", _backend, "own_generator")] = EITHER
for _row in ("eager-shared", "eager-per_member", "subset-shared", "subset-per_member",
             "padded-shared", "chunks-shared", "chunks-per_member"):  # fmt: skip
    for _backend in ("vmap", "fused", "auto"):
        EXPECT[(_row, _backend, "reseed")] = EITHER


def _row_cases() -> list[Any]:
    cases = []
    rows = [
        ("eager", "shared"), ("eager", "per_member"), ("chunks", "shared"),
        ("chunks", "per_member"), ("routed", "shared"), ("subset", "shared"),
        ("subset", "per_member"), ("padded", "shared"),
    ]  # fmt: skip
    for mode, inp in rows:
        for backend in ("loop", "vmap", "fused", "auto"):
            if mode == "routed" and backend == "vmap":
                continue  # vmap runs routed calls on the general path, as the loop does
            for kind in KINDS:
                row = f"{mode}-{inp}"
                marks = []
                gap = GAPS.get((row, backend, kind))
                if gap is not None:
                    marks.append(pytest.mark.xfail(strict=True, reason=gap))
                cases.append(pytest.param(mode, inp, backend, kind, marks=marks,
                                          id=f"{row}-{backend}-{kind}"))  # fmt: skip
    return cases


def compare(got: Result, want: Result, cell: str) -> None:
    if want.out is not None:
        assert_close(got.out, want.out, msg=f"{cell}: outputs")
    assert_close(got.losses, want.losses, msg=f"{cell}: losses")
    assert got.grads.keys() == want.grads.keys(), cell
    for name in want.grads:
        assert_close(got.grads[name], want.grads[name], msg=f"{cell}: grad of {name}")
    if want.x_grad is not None:
        assert got.x_grad is not None, f"{cell}: the input has no gradient"
        assert_close(got.x_grad, want.x_grad, msg=f"{cell}: input gradient")
    assert got.buffers.keys() == want.buffers.keys(), cell
    for name in want.buffers:
        assert_close(got.buffers[name], want.buffers[name], msg=f"{cell}: buffer {name}")
    assert len(got.generators) == len(want.generators), cell
    for i, (a, b) in enumerate(zip(got.generators, want.generators)):
        assert torch.equal(a, b), f"{cell}: member {i}'s generator is out of step with the loop"
    assert_close(got.x_after, want.x_after, msg=f"{cell}: the input after the call")


@pytest.mark.parametrize(("mode", "inp", "backend", "kind"), _row_cases())
def test_cell(mode: str, inp: str, backend: str, kind: str) -> None:
    cell = f"{mode}-{inp}-{backend}-{kind}"
    expect = EXPECT.get((f"{mode}-{inp}", backend, kind), EXACT)
    run = RUNNERS[mode]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(expect, Refuse):
            with pytest.raises(expect.error, match=expect.match):
                run(kind, backend, inp == "per_member")
            return
        try:
            got, want = run(kind, backend, inp == "per_member")
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            if expect == EITHER and "generator" in str(e).lower():
                return  # refused, naming what it cannot do
            raise
    compare(got, want, cell)


# ------------------------------------------------- the captured step, torch.compile, export
# Rows whose cells compile, so few cells each ("aot_eager": traced, no code generated).


@pytest.mark.parametrize(
    "kind",
    [
        "plain",
        "batchnorm",
        "buffer_write",
        pytest.param("inplace_input"),
        pytest.param("own_generator"),
        pytest.param("reseed"),
    ],
)
def test_compile_step_cell(kind: str) -> None:
    """Three steps (eager, capture, captured) against each member trained alone with SGD:
    weights, buffers, generators and the input after; or a refusal naming the generator."""
    members = members_for(kind)
    x, y = input_for(kind, False), torch.randn(B, 2, generator=torch.Generator().manual_seed(9))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).sum()

    stack = _stack(members, "auto")
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = phalanx.compile_step(stack, loss_fn, opt, backend="aot_eager",
                                    prefer="captured", warmup_steps=1)  # fmt: skip
        xs = x.clone()
        got_losses = [step(xs, y) for _ in range(3)]
    models = copy.deepcopy(members)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x_after = x.clone()
    for t in range(3):
        losses = []
        for m, o in zip(models, opts):
            o.zero_grad()
            loss = loss_fn(m(x_after.clone()), y)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        if has(kind, "inplace_input"):
            x_after = x_after / 2  # the step writes the shared input once
        assert_close(got_losses[t], torch.stack(losses), msg=f"step {t}: losses")
    for name, p in stack.module.named_parameters():
        want = torch.stack([dict(m.named_parameters())[name] for m in models])
        assert_close(p.detach(), want.detach(), msg=f"weights {name} after 3 steps")
    for name, b in stack.module.named_buffers():
        assert_close(b, torch.stack([dict(m.named_buffers())[name] for m in models]), msg=name)
    if has(kind, "own_generator"):
        for i, m in enumerate(models):
            assert torch.equal(stack.member_generators(i)[0].get_state(), m.g.get_state())
    assert_close(xs, x_after, msg="the input after 3 steps")


@pytest.mark.parametrize("kind", ["plain", "batchnorm", "buffer_write", "keyword", "tuple_none"])
def test_torch_compile_cell(kind: str) -> None:
    """``torch.compile(stack)`` on the auto backend: one call and its backward, as eager."""
    members = members_for(kind)
    x, kwargs = input_for(kind, False), kwargs_for(kind)
    stack = _stack(members, "auto")
    compiled = torch.compile(stack, backend="aot_eager", fullgraph=False)
    xs = _leaf_input(x, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compiled(xs, **kwargs)
    losses = loss_of(out)
    losses.sum().backward()
    compare(_collect(stack, out, losses, xs, kind), reference(members, kind, x, False, kwargs),
            f"torch.compile-{kind}")  # fmt: skip


@pytest.mark.parametrize("kind", ["plain", "batchnorm", "recurrent", "keyword", "tuple_none"])
def test_export_cell(kind: str) -> None:
    """``phalanx.export`` of the stack in eval mode: the program's outputs are the members'."""
    members = members_for(kind)
    x, kwargs = input_for(kind, False), kwargs_for(kind)
    stack = _stack(members, "auto").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = phalanx.export(stack, (x,), kwargs)
    got = program.module()(x.clone(), **kwargs)
    models = [copy.deepcopy(m).eval() for m in members]
    with torch.no_grad():
        want = _stack_outputs([m(x.clone(), **kwargs) for m in models])
    assert_close(pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, got),
                 want, msg=f"export-{kind}")  # fmt: skip


@pytest.mark.parametrize("backend", ["loop", "fused"])
def test_chunks_input_gradient(backend: str) -> None:
    """A shared input that requires grad gets the summed gradient of every member, as from
    one call's backward."""
    members = members_for("plain")
    x = input_for("plain", False)
    stack = _stack(members, backend)
    xs = x.clone().requires_grad_(True)
    stack.backward_in_chunks(lambda out, rows: loss_of(out), xs, chunk_members=2)
    want = reference(members, "plain", x, False, {})
    assert xs.grad is not None
    assert_close(xs.grad, want.x_grad, msg="x.grad")


# ------------------------------------------------------------- two behaviours in one member
COMBINABLE = ["inplace_input", "buffer_write", "weight_write", "batchnorm", "keyword",
              "tuple_none"]  # fmt: skip
PAIR_ROWS = [("eager", "shared"), ("eager", "per_member"), ("chunks", "per_member"),
             ("routed", "shared"), ("subset", "shared"), ("subset", "per_member")]  # fmt: skip


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    pair=st.lists(st.sampled_from(COMBINABLE), min_size=2, max_size=2, unique=True),
    row=st.sampled_from(PAIR_ROWS),
    backend=st.sampled_from(["loop", "vmap", "fused", "auto"]),
)
def test_two_behaviours_in_one_member(pair: list[str], row: tuple[str, str], backend: str):
    """Members doing two things of the table at once, on a row drawn from the table's (the
    cells above pair each row with one behaviour): equal to the loop."""
    mode, inp = row
    if mode == "routed" and backend == "vmap":
        backend = "loop"
    kind = "+".join(pair)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = RUNNERS[mode](kind, backend, inp == "per_member")
    compare(got, want, f"{mode}-{inp}-{backend}-{kind}")
