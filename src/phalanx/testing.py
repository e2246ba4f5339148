"""What "equal to the loop to float rounding" means, defined once for phalanx and its users.

A stack is checked against the loop over its members, the N original modules run one by
one. Batched kernels may sum in another order than the loop, so float32 results may differ
in their last bits; how far is too far is not a tolerance tuned until a test passes but a
yardstick earned from the loop itself: run the loop a second time in float64 (the
reference) and allow the stack to be at most :data:`FACTOR` times as far from it as the
float32 loop is, plus :data:`FLOOR_ULPS` float32 ulps of the tensor's magnitude (for values
the float32 loop happens to get exactly, such as a sum of few terms).

One float32 run is one draw of its rounding, and a lucky one can be far below the typical
error (a gradient that cancels to nearly zero keeps only its last bits, which Adam then
magnifies). The yardstick is therefore the largest distance over several runs of the float32
loop that differ only in summation order: the batch as given and with its rows permuted
(:func:`row_orders`), where the result does not depend on the row order in exact arithmetic.

:func:`assert_equal_to_loop` applies that rule; phalanx's tests, its benchmark's exactness
check and the real-model suite all use it. :func:`assert_close` is the fixed-tolerance screen
for two results of one precision where no float64 reference exists (a trajectory of many
optimizer steps, or a quick guard of a timed run); it is not the definition of exact.

Example:
    >>> models = [nn.Linear(4, 2) for _ in range(3)]
    >>> stack = phalanx.stack(models)
    >>> x = torch.randn(5, 4)
    >>> loop = torch.stack([m(x) for m in models])
    >>> reference = torch.stack([m.double()(x.double()) for m in models])
    >>> phalanx.testing.assert_equal_to_loop(stack(x), loop, reference, what="outputs")
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from phalanx._torch_compat import pytree

__all__ = [
    "FACTOR",
    "FLOOR_ULPS",
    "ORDERS",
    "SAME_PRECISION",
    "TRAJECTORY",
    "assert_close",
    "assert_equal_to_loop",
    "assert_members_independent",
    "coupling_problems",
    "rounding_problems",
    "row_orders",
]

FACTOR = 4.0
"""The stack's error against the float64 loop may be this many times the float32 loop's own."""

FLOOR_ULPS = 8.0
"""... plus this many float32 ulps of the compared tensor's largest magnitude."""

ORDERS = 3
"""How many runs of the float32 loop make the yardstick: the batch as given, then permuted."""

SAME_PRECISION = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
}
"""Tolerances of :func:`assert_close` for two results of one forward/backward."""

TRAJECTORY = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-11},
    torch.float32: {"rtol": 1e-4, "atol": 2e-5},
}
"""... and after many optimizer steps: Adam divides by sqrt(v), which magnifies last-bit
differences of small gradients, so float32 trajectories drift by a few ulps per step."""


def row_orders(rows: int, *, runs: int = ORDERS, seed: int = 0) -> list[Tensor]:
    """Row orders for the float32 loop's runs: the identity, then ``runs - 1`` permutations.

    Run the float32 loop once per order on the batch's rows ``x[order]`` (targets alike) and
    pass every run to :func:`rounding_problems`: the yardstick becomes the largest rounding
    error over several summation orders instead of one draw. Valid only where the compared
    result does not depend on the row order in exact arithmetic: per-member losses that are
    means or sums over rows, parameter gradients, BatchNorm statistics, and the parameters
    after optimizer steps are; row-wise results (outputs, input gradients) are once put back
    with ``out[torch.argsort(order)]`` (autograd does it for the gradient of an input that
    was indexed). Dropout and other per-row random draws are not: a permutation moves each
    row's draw to another row, so run such a model as given only, or with the draws fixed.

    Args:
        rows: the batch size.
        runs: how many orders, the identity included.
        seed: seeds the permutations, so that a failing check repeats.

    Returns:
        ``runs`` index tensors of shape ``(rows,)``, the first ``torch.arange(rows)``.

    Example:
        >>> models = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)) for _ in range(3)]
        >>> x = torch.randn(6, 4)
        >>> stack = phalanx.stack(models)
        >>> got = stack(x).square().mean((1, 2))  # (N,) per-member losses: row order free
        >>> loss = lambda m, x: m(x).square().mean()
        >>> runs = [torch.stack([loss(m, x[o]) for m in models]) for o in row_orders(6)]
        >>> ref = torch.stack([loss(m.double(), x.double()) for m in models])
        >>> phalanx.testing.assert_equal_to_loop(got, runs, ref, what="losses", per_member=True)
    """
    gen = torch.Generator().manual_seed(seed)
    return [torch.arange(rows)] + [torch.randperm(rows, generator=gen) for _ in range(runs - 1)]


def rounding_problems(
    got: Tensor,
    loop: Tensor | Sequence[Tensor],
    reference: Tensor,
    *,
    what: str = "result",
    per_member: bool = False,
    factor: float = FACTOR,
    floor_scale: float | None = None,
) -> list[str]:
    """Where ``got`` is further from ``reference`` than the float32 ``loop`` allows: the rule.

    Args:
        got: the stack's result, any float dtype.
        loop: the float32 loop's result of the same shape, or several runs of it in different
            summation orders (see :func:`row_orders`; the largest distance of any run is the
            yardstick).
        reference: the loop run in float64.
        what: names the tensor in the messages.
        per_member: compare member by member along dim 0 (each member's error against the
            loop's largest over all members: members are alike, and one member's error is a
            single draw whose maximum may be lucky).
        factor: the allowed multiple of the loop's own error.
        floor_scale: the magnitude the ulps of the floor are taken of; by default the
            reference's largest magnitude (per member with ``per_member``). Give the size of
            the terms where the result cancels (a gradient summed from O(1) terms to nearly
            zero), whose rounding the result's own size does not show.

    Returns:
        One message per problem; empty when ``got`` is equal to the loop to float rounding.
    """
    runs = [loop] if isinstance(loop, Tensor) else list(loop)
    if any(r.shape != got.shape for r in runs) or reference.shape != got.shape:
        shapes = ", ".join(str(tuple(r.shape)) for r in runs)
        return [f"{what}: shape {tuple(got.shape)}, the loop's is {shapes}"]
    ref = reference.detach().double()
    diff = (got.detach().double() - ref).abs()
    loop_diffs = [(r.detach().double() - ref).abs() for r in runs]
    dims = tuple(range(1, got.dim()))
    if per_member and dims:
        errors, scales = diff.amax(dims), ref.abs().amax(dims)
        own = max(d.amax(dims).max().item() for d in loop_diffs)
    elif per_member:
        errors, scales = diff, ref.abs()
        own = max(d.max().item() for d in loop_diffs)
    else:
        errors, scales = diff.max()[None], ref.abs().max()[None]
        own = max(d.max().item() for d in loop_diffs)
    eps = torch.finfo(torch.float32).eps
    problems = []
    for i, (err, scale) in enumerate(zip(errors.tolist(), scales.tolist())):
        floor = FLOOR_ULPS * eps * (scale if floor_scale is None else max(scale, floor_scale))
        if not err <= factor * own + floor:  # NaN fails
            member = f"member {i} " if per_member else ""
            problems.append(
                f"{member}{what}: max error {err:.3g} against the float64 loop, the float32 "
                f"loop's is {own:.3g} (allowed {factor:g}x that + {floor:.2g})"
            )
    return problems


def assert_equal_to_loop(
    got: Tensor,
    loop: Tensor | Sequence[Tensor],
    reference: Tensor,
    *,
    what: str = "result",
    per_member: bool = False,
    factor: float = FACTOR,
    floor_scale: float | None = None,
) -> None:
    """Raises AssertionError unless ``got`` is equal to the loop to float rounding.

    See :func:`rounding_problems` for the arguments.
    """
    problems = rounding_problems(
        got, loop, reference, what=what, per_member=per_member, factor=factor,
        floor_scale=floor_scale,
    )  # fmt: skip
    if problems:
        raise AssertionError("; ".join(problems))


def coupling_problems(
    stack: torch.nn.Module,
    step: Callable[[], Any],
    optimizer: Any,
    *,
    member: int = 0,
    factor: float = 1e6,
) -> list[str]:
    """Members whose update depends on another member's gradients in one training step.

    Runs ``step()`` (one eager training step of your own on a fixed batch: forward, losses,
    backward, clipping, ``optimizer.step()``) twice from the same weights, optimizer state and
    random state: as it is, and with member ``member``'s gradients multiplied by ``factor`` as
    backward computes them (an exploding member). Every other member must take the same step
    both times, to a few float32 ulps. Whatever reads all members' gradients together fails:
    ``torch.nn.utils.clip_grad_norm_(stack.parameters(), ...)``, which clips every member by one
    joint norm (use ``phalanx.clip_grad_norm_``), or one loss scale for all members. The
    weights and the optimizer's state are put back afterwards. The step must not advance a
    learning-rate scheduler (both runs must see the same rates).

    Args:
        stack: the stack (any module whose parameters carry the member axis first).
        step: runs one training step; its return value is ignored.
        optimizer: the optimizer ``step`` steps (its state is saved and put back).
        member: the member whose gradients are blown up.
        factor: how much.

    Returns:
        One message per other member and parameter whose update changed; empty when the
        members are independent.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
        >>> opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
        >>> x, y = torch.randn(8, 4), torch.randn(8, 2)
        >>> def step():
        ...     opt.zero_grad()
        ...     phalanx.member_losses(F.mse_loss, stack(x), y).sum().backward()
        ...     torch.nn.utils.clip_grad_norm_(stack.parameters(), max_norm=1.0)  # the trap
        ...     opt.step()
        >>> print(coupling_problems(stack, step, opt)[0])  # doctest: +ELLIPSIS
        member 1 parameter 'weight': its update changed by ... when member 0's gradients were ...
    """
    params = dict(stack.named_parameters())
    start = {k: v.detach().clone() for k, v in stack.state_dict().items()}
    opt_start = copy.deepcopy(optimizer.state_dict())

    def run(scaled: bool) -> dict[str, Tensor]:
        hooks = []
        if scaled:
            for p in params.values():
                scale = torch.ones(
                    p.shape[0], *([1] * (p.dim() - 1)), dtype=p.dtype, device=p.device
                )
                scale[member] = factor
                hooks.append(p.register_hook(lambda g, s=scale: g * s))
        try:
            with torch.random.fork_rng():
                step()
        finally:
            for h in hooks:
                h.remove()
        after = {k: p.detach().clone() for k, p in params.items()}
        with torch.no_grad():
            for k, v in stack.state_dict().items():
                v.copy_(start[k])
        optimizer.load_state_dict(copy.deepcopy(opt_start))
        return after

    plain, blown = run(False), run(True)
    eps = torch.finfo(torch.float32).eps
    problems = []
    for name, after in plain.items():
        for i in range(after.shape[0]):
            if i == member:
                continue
            change = (blown[name][i] - after[i]).abs().max().item()
            allowed = FLOOR_ULPS * eps * after[i].abs().max().item()
            if not change <= allowed:
                problems.append(
                    f"member {i} parameter {name.removeprefix('module.')!r}: its update changed "
                    f"by {change:.3g} when member {member}'s gradients were multiplied by "
                    f"{factor:g} (allowed {allowed:.2g}): the step reads all members' gradients "
                    f"together, e.g. torch.nn.utils.clip_grad_norm_(stack.parameters()), which "
                    f"clips every member by one joint norm; clip with phalanx.clip_grad_norm_, "
                    f"one norm per member"
                )
    return problems


def assert_members_independent(
    stack: torch.nn.Module,
    step: Callable[[], Any],
    optimizer: Any,
    *,
    member: int = 0,
    factor: float = 1e6,
) -> None:
    """Raises AssertionError unless no member's step depends on another member's gradients.

    See :func:`coupling_problems` for the arguments.
    """
    problems = coupling_problems(stack, step, optimizer, member=member, factor=factor)
    if problems:
        raise AssertionError("; ".join(problems))


def assert_close(
    actual: Any,
    expected: Any,
    *,
    dtype: torch.dtype = torch.float32,
    msg: str = "",
    trajectory: bool = False,
) -> None:
    """``torch.testing.assert_close`` over pytrees of tensors with the tolerances above."""
    tol = (TRAJECTORY if trajectory else SAME_PRECISION)[dtype]
    a_flat, a_spec = pytree.tree_flatten(actual)
    e_flat, e_spec = pytree.tree_flatten(expected)
    if a_spec != e_spec:
        raise AssertionError(f"{msg}: structures differ: {a_spec} vs {e_spec}")
    for a, e in zip(a_flat, e_flat):
        torch.testing.assert_close(
            a, e, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{msg}: {m}"
        )


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
