"""phalanx.compile_step: the captured training step against the eager step and the loop.

The capture logic is tested with torch.compile's "aot_eager" backend (the traced graph run
through AOTAutograd without generating code: seconds to build); one small test compiles
with inductor. Each captured run is compared member by member with

- the eager phalanx step (stack, member_losses, backward, clip, optimizer.step(mask=...)),
  which it must equal to float rounding, and
- the loop of independent modules with torch.optim, in float32 and float64: the captured
  float32 step must be no further from the float64 loop than the float32 loop itself is,
  within a factor of 4 (summation order differs between batched and per-member kernels).
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from helpers import ARCHS, assert_close, make_members
from phalanx.optim._base import NonFiniteWarning
from phalanx.step._api import ROUNDS, CompiledStep, agree, compile_step, decide
from phalanx.testing import assert_equal_to_loop

N = 4
STEPS = 5
LR = torch.tensor([1e-3, 1e-2, 3e-2, 1e-1], dtype=torch.float64)
ARCH = {a.name: a for a in ARCHS}
# How much further from the float64 loop than the float32 loop the captured step may be.
# Adam's eps in the comparison with the loop. With eps=1e-8 Adam divides a near-zero
# gradient's rounding noise by its own magnitude (the first step is lr * sign(gradient)), so
# any change of summation order, which batching makes, moves such an element by up to lr in
# any precision. eps=1 is far above every gradient here: the update stays Adam's, but its
# error is proportional to the gradient's, so the comparison measures rounding honestly.
# (The mask, schedule and fallback tests compare with the eager step at eps=1e-8.)
EPS = 1.0


def _loop(members, data, *, loss_fn, in_dim, decoupled, max_norm, dtype):
    """The reference: each member alone, torch.optim, torch's clip_grad_norm_."""
    models = [copy.deepcopy(m).to(dtype) for m in members]
    opt_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    wd = 0.05 if decoupled else 0.0
    opts = [
        opt_cls(m.parameters(), lr=float(LR[i]), eps=EPS, weight_decay=wd)
        for i, m in enumerate(models)
    ]
    for x, y in data:
        for i, (m, o) in enumerate(zip(models, opts)):
            xi = x[i] if in_dim == 0 else x
            yi = y[i] if in_dim == 0 else y
            o.zero_grad()
            loss_fn(m(xi.to(dtype)), yi if not yi.is_floating_point() else yi.to(dtype)).backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            o.step()
    return models


def _phalanx(members, data, *, loss_fn, in_dim, decoupled, max_norm, backend):
    stack = phalanx.stack(copy.deepcopy(members))
    opt_cls = phalanx.optim.AdamW if decoupled else phalanx.optim.Adam
    opt = opt_cls(stack.parameters(), lr=LR, eps=EPS, weight_decay=0.05 if decoupled else 0.0)
    step = compile_step(
        stack,
        loss_fn,
        opt,
        in_dims=in_dim,
        max_norm=max_norm,
        backend=backend,
        prefer="captured",
        warmup_steps=1,
    )
    losses = [step(x, y) for x, y in data]
    return stack, opt, step, losses


def _eager(members, data, *, loss_fn, in_dim, decoupled, max_norm):
    """The eager phalanx step, written out as a user writes it."""
    stack = phalanx.stack(copy.deepcopy(members))
    opt_cls = phalanx.optim.AdamW if decoupled else phalanx.optim.Adam
    opt = opt_cls(stack.parameters(), lr=LR, eps=EPS, weight_decay=0.05 if decoupled else 0.0)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = phalanx.member_losses(loss_fn, stack(x, in_dims=in_dim), y, in_dims=(0, in_dim))
        loss.sum().backward()
        if max_norm is not None:
            phalanx.clip_grad_norm_(stack.parameters(), max_norm)
        opt.step()
        losses.append(loss.detach())
    return stack, opt, losses


def _assert_rounding_close(stack, loop32, loop64):
    """Member by member and tensor by tensor, equal to the loop to float rounding
    (phalanx.testing's rule) after the steps."""
    params, buffers = stack.stacked_state()
    state = {k: v for k, v in {**params, **buffers}.items() if v.is_floating_point()}
    for k, ours in state.items():
        assert_equal_to_loop(
            ours,
            torch.stack([m.state_dict()[k] for m in loop32]),
            torch.stack([m.state_dict()[k] for m in loop64]),
            what=k,
            per_member=True,
        )


CASES = {
    # question 2a: shared batch, cross-entropy, per-member lr, per-member clipping
    "shared_cross_entropy_clip": ("question2", None, False, 0.5),
    # question 1: sliced input, MSE, AdamW with decoupled decay
    "sliced_mse_adamw": ("question1", 0, True, None),
    # per-member batches through a CNN whose BatchNorm buffers the step must update
    "per_member_cnn_batchnorm": ("cnn_batchnorm_pool", 0, False, None),
}


def _data(arch_name: str, in_dim, steps: int = STEPS, rows: int = 6):
    arch = ARCH[arch_name]
    torch.manual_seed(7)
    data = []
    for _ in range(steps):
        if arch_name == "question1":  # sliced: (B, N * 20) -> (N, B, 20), regression
            x = phalanx.split(torch.randn(rows, N * 20), N, dim=1)
            y = torch.randn(N, rows, 1)
        elif in_dim == 0:
            x = torch.stack([arch.inputs(6)[0] for _ in range(N)])
            y = torch.randint(0, 3, (N, 6))
        else:
            x = arch.inputs(6)[0]
            y = torch.randint(0, 2, (6,))
        data.append((x, y))
    return data


@pytest.mark.parametrize("case", list(CASES))
def test_captured_step_equals_eager_step_and_loop(case):
    arch_name, in_dim, decoupled, max_norm = CASES[case]
    members = make_members(ARCH[arch_name], N)
    loss_fn = F.mse_loss if arch_name == "question1" else F.cross_entropy
    data = _data(arch_name, in_dim)
    kw = {"loss_fn": loss_fn, "in_dim": in_dim, "decoupled": decoupled, "max_norm": max_norm}

    stack, opt, step, losses = _phalanx(members, data, backend="aot_eager", **kw)
    assert step.choice == "captured"
    assert step.compile_seconds is not None and step.compile_seconds > 0
    assert "compile" in step.report
    eager_stack, eager_opt, eager_losses = _eager(members, data, **kw)
    assert_close(torch.stack(losses), torch.stack(eager_losses), trajectory=True, msg="losses")
    assert_close(
        stack.state_dict(), eager_stack.state_dict(), trajectory=True, msg="weights and buffers"
    )
    for p, q in zip(stack.parameters(), eager_stack.parameters()):
        for key, value in eager_opt.state[q].items():
            assert_close(opt.state[p][key], value, trajectory=True, msg=f"optimizer {key}")
    loop32 = _loop(members, data, dtype=torch.float32, **kw)
    loop64 = _loop(members, data, dtype=torch.float64, **kw)
    _assert_rounding_close(stack, loop32, loop64)
    if max_norm is not None:
        assert step.last_norms is not None and step.last_norms.shape == (N,)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_captured_step_with_narrow_products_equals_the_loop(backend):
    """W1's shapes (32 rows, 20 -> 10 -> 1, sliced): the traced step's narrow products run
    transposed (``simplify``); against the float32 and float64 loops, member by member."""
    members = make_members(ARCH["question1"], N)
    data = _data("question1", 0, steps=3, rows=32)
    kw = {"loss_fn": F.mse_loss, "in_dim": 0, "decoupled": False, "max_norm": None}
    _assert_captured_equals_the_loop(members, data, backend, kw)


def _assert_captured_equals_the_loop(members, data, backend, kw):
    """The captured step chosen, its stack after the steps member by member against the
    float32 and float64 loops."""
    stack, _, step, _ = _phalanx(members, data, backend=backend, **kw)
    assert step.choice == "captured"
    loop32 = _loop(members, data, dtype=torch.float32, **kw)
    loop64 = _loop(members, data, dtype=torch.float64, **kw)
    _assert_rounding_close(stack, loop32, loop64)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_captured_adam_on_large_tensors_equals_the_loop(backend):
    """A (4, 64, 64) weight reaches KEEP_ELEMENTS: the traced Adam keeps its per-member bias
    corrections in buffers (``compat.realized``); member by member against the loops."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
        for _ in range(N)
    ]
    data = [(torch.randn(N, 6, 16), torch.randint(0, 3, (N, 6))) for _ in range(3)]
    kw = {"loss_fn": F.cross_entropy, "in_dim": 0, "decoupled": True, "max_norm": None}
    _assert_captured_equals_the_loop(members, data, backend, kw)


@pytest.mark.parametrize(("shape", "kept"), [((4, 64, 64), 2), ((4, 10, 20), 0)])
def test_a_traced_adam_update_keeps_the_bias_corrections_of_large_tensors(shape, kept):
    """Under a trace, a parameter of at least KEEP_ELEMENTS marks its two per-member values
    (the bias correction and the step size) to be computed once; a smaller one does not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from phalanx.optim._adam import KEEP_ELEMENTS, adam_update

    assert (torch.Size(shape).numel() >= KEEP_ELEMENTS) == bool(kept)
    hyper = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "maximize": False}

    def update(p, g, step, m, v, beta1):
        return adam_update(p, g, step, m, v, None, beta1=beta1, beta2=0.999, decoupled=False,
                           **hyper)  # fmt: skip

    p, g, m, v = torch.randn(shape), torch.randn(shape), torch.zeros(shape), torch.zeros(shape)
    step, beta1 = torch.full((4,), 3.0, dtype=torch.float64), torch.full((4,), 0.9).double()
    graph = make_fx(update)(p, g, step, m, v, beta1)
    marks = [n for n in graph.graph.nodes if "inductor_force_stride_order" in str(n.target)]
    assert len(marks) == kept, graph.code
    got, eager = graph(p, g, step, m, v, beta1), update(p, g, step, m, v, beta1)
    assert all(torch.equal(got[k], eager[k]) for k in eager)  # the mark changes no value


def _diverging_member():
    """Members, five per-member batches in which member 2 diverges from step 2 on, and the
    masks of the five steps (member 1 masked out of step 1)."""
    members = make_members(ARCH["question2"], N)
    torch.manual_seed(3)
    data = []
    for k in range(5):
        x = torch.randn(N, 6, 10)
        if k >= 2:
            x[2, 0, 0] = float("nan")  # member 2 diverges from step 2 on
        data.append((x, torch.randint(0, 2, (N, 6))))
    return members, data, [None, torch.tensor([True, False, True, True]), None, None, None]


def _assert_same_training(stack, opt, eager_stack, eager_opt):
    """Weights, optimizer state, counters and step counts after ``_diverging_member``'s
    five steps: the captured run equals the eager one, member 2 skipped twice and frozen."""
    assert_close(stack.state_dict(), eager_stack.state_dict(), trajectory=True, msg="weights")
    for p, q in zip(stack.parameters(), eager_stack.parameters()):
        for key, value in eager_opt.state[q].items():
            assert_close(opt.state[p][key], value, trajectory=True, msg=f"optimizer {key}")
    assert opt.bad_steps.tolist() == eager_opt.bad_steps.tolist() == [0, 0, 2, 0]
    assert opt.frozen.tolist() == eager_opt.frozen.tolist() == [False, False, True, False]
    # The masked-out member 1 of step 1 took one step fewer than the others.
    assert opt.state[next(iter(stack.parameters()))]["step"].tolist() == [5, 4, 2, 5]


def test_mask_isolation_and_freezing_match_the_eager_step():
    """Masked members keep everything; a NaN member is skipped, counted, warned and frozen."""
    members, data, masks = _diverging_member()

    def build():
        stack = phalanx.stack(copy.deepcopy(members))
        opt = phalanx.optim.Adam(stack.parameters(), lr=LR, skip_nonfinite=True, freeze_after=2)
        return stack, opt

    stack, opt = build()
    step = compile_step(
        stack, F.cross_entropy, opt, in_dims=0, max_norm=1.0, backend="aot_eager",
        prefer="captured", warmup_steps=1,
    )  # fmt: skip
    eager_stack, eager_opt = build()
    # Member 2 is skipped in steps 2 and 3, frozen by step 3, and no longer tried in step 4.
    expected_warning = {2: r"skipped members \[2\]", 3: r"Members \[2\] are now frozen after 2"}
    for k, ((x, y), mask) in enumerate(zip(data, masks)):
        if k in expected_warning:
            with pytest.warns(NonFiniteWarning, match=expected_warning[k]):
                step(x, y, mask=mask)
        else:
            step(x, y, mask=mask)
        eager_opt.zero_grad()
        losses = phalanx.member_losses(
            F.cross_entropy, eager_stack(x, in_dims=0), y, in_dims=(0, 0)
        )
        losses.sum().backward()
        phalanx.clip_grad_norm_(eager_stack.parameters(), 1.0)
        with pytest.warns(NonFiniteWarning) if k in expected_warning else _no_warning():
            eager_opt.step(mask=mask, loss=losses.detach())
    assert step.choice == "captured"
    _assert_same_training(stack, opt, eager_stack, eager_opt)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_scheduler_changes_reach_the_captured_step():
    members = make_members(ARCH["question2"], N)
    data = _data("question2", None, steps=4)
    results = []
    for captured in (True, False):
        stack = phalanx.stack(copy.deepcopy(members))
        opt = phalanx.optim.Adam(stack.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
        step = compile_step(
            stack, F.cross_entropy, opt, backend="aot_eager", prefer="captured", warmup_steps=1
        )
        for x, y in data:
            if captured:
                step(x, y)
            else:
                step._eager((x,), y, None)
            sched.step()
        results.append(stack.state_dict())
    assert_close(results[0], results[1], trajectory=True, msg="after a learning-rate schedule")


def test_prefer_fastest_decides_and_reports():
    members = make_members(ARCH["question2"], N)
    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters())
    step = compile_step(stack, F.cross_entropy, opt, backend="aot_eager", warmup_steps=2)
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    for _ in range(2 + 1 + 2 * ROUNDS - 1):
        step(x, y)
        assert step.choice is None  # still measuring
    step(x, y)
    assert step.choice in ("eager", "captured")
    assert step.report.startswith(step.choice)
    assert "eager step" in step.report and "captured step" in step.report


def test_decide_keeps_the_captured_step_unless_it_is_clearly_slower():
    assert decide([2.0, 2.5, 2.2], [1.0, 1.5, 1.2]) == "captured"
    assert decide([1.0, 1.0, 1.0], [1.04, 1.04, 1.04]) == "captured"  # within the margin
    assert decide([1.0, 1.0, 1.0], [1.2, 1.2, 1.2]) == "eager"
    # one spike (another process took the core) moves a median nowhere
    assert decide([1.0, 1.0, 1.0], [38.0, 0.5, 0.5]) == "captured"
    assert decide([38.0, 1.0, 1.0], [1.2, 1.2, 1.2]) == "eager"
    # one median per rank: the slowest rank counts on both sides
    assert agree([(1.0, 0.5), (3.0, 3.5)]) == "eager"
    assert agree([(1.0, 2.0), (3.0, 2.9)]) == "captured"


class _Clock:
    """A fake clock: each timed step lasts what ``cost`` says for the path it ran."""

    def __init__(self, step, eager_s, captured_s):
        self.now, self.step, self.costs = 0.0, step, {"eager": eager_s, "captured": captured_s}
        self.started = False

    def __call__(self):
        if self.started:  # the end of a timed call: advance by the path that ran
            self.now += self.costs[self.step._last_path]
        self.started = not self.started
        return self.now


def _timed_step(eager_s, captured_s, exchange=None):
    members = make_members(ARCH["question2"], N)
    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters())
    step = compile_step(stack, F.cross_entropy, opt, backend="aot_eager", warmup_steps=2)
    step._clock = _Clock(step, eager_s, captured_s)
    original_eager, original_captured = step._eager, step._captured

    def eager(*a):
        step._last_path = "eager"
        return original_eager(*a)

    def captured(*a):
        step._last_path = "captured"
        return original_captured(*a)

    step._eager, step._captured = eager, captured
    if exchange is not None:
        step._exchange = exchange
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    for _ in range(2 + 1 + 2 * ROUNDS):
        step(x, y)
    return step


@pytest.mark.parametrize(
    ("eager_s", "captured_s", "expected"),
    [(1e-3, 5e-4, "captured"), (1e-3, 1.2e-3, "eager"), (1e-3, 1.03e-3, "captured")],
)
def test_the_decision_is_made_on_alternating_timed_steps(eager_s, captured_s, expected):
    """The timer injected: the choice follows the timings and nothing else, and the medians
    it was made on are the step's attributes."""
    step = _timed_step(eager_s, captured_s)
    assert step.choice == expected, step.report
    (entry,) = step._entries.values()
    assert len(entry.captured_s) == ROUNDS and len(entry.eager_s) == ROUNDS
    assert step.eager_seconds == pytest.approx(eager_s)
    assert step.captured_seconds == pytest.approx(captured_s)
    assert f"eager step {eager_s * 1e3:.3g} ms, captured step {captured_s * 1e3:.3g} ms" in (
        step.report
    )


def test_the_warm_up_steps_do_not_count():
    """The eager steps before the capture run with cold caches (the first one also settles
    the stack's backend): a slow warm-up does not make the captured step look faster."""
    members = make_members(ARCH["question2"], N)
    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters())
    step = compile_step(stack, F.cross_entropy, opt, backend="aot_eager", warmup_steps=3)
    costs = iter([1.0, 1.0, 1.0] + [1.2e-3, 1e-3] * ROUNDS)  # warm-up, then captured/eager
    now = [0.0]

    def clock():
        now[0] += next(costs) if clock.started else 0.0
        clock.started = not clock.started
        return now[0]

    clock.started = False
    step._clock = clock
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    for _ in range(3 + 1 + 2 * ROUNDS):
        step(x, y)
    assert step.choice == "eager", step.report
    assert step.eager_seconds == pytest.approx(1e-3)


def _recording_step(tmp_path, clock_costs):
    from phalanx.step._choice import Records

    members = make_members(ARCH["question2"], N)
    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters())
    step = compile_step(stack, F.cross_entropy, opt, backend="aot_eager")
    step._records = Records(str(tmp_path))
    costs = iter(clock_costs)
    now = [0.0]

    def clock():
        now[0] += next(costs) if clock.started else 0.0
        clock.started = not clock.started
        return now[0]

    clock.started = False
    step._clock = clock
    return step


def test_a_later_run_takes_the_recorded_choice_without_timing(tmp_path):
    """The choice is written beside the compile caches, keyed by the graph; a second step of
    the same graph (a later run) reads it at its capture and times nothing."""
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    first = _recording_step(tmp_path, [1.0] + [2e-3, 1e-3] * ROUNDS)  # captured is slower
    for _ in range(1 + 1 + 2 * ROUNDS):
        first(x, y)
    assert first.choice == "eager"
    assert len(list(tmp_path.iterdir())) == 1  # one record, for the one graph
    second = _recording_step(tmp_path, [1.0])  # one warm-up timing, and no more
    second(x, y)
    assert second.choice is None
    second(x, y)  # the capture: the record is read
    assert second.choice == "eager", second.report
    assert "recorded by an earlier run" in second.report
    assert second.eager_seconds == pytest.approx(1e-3)
    assert second.captured_seconds == pytest.approx(2e-3)
    (entry,) = second._entries.values()
    assert entry.run is None  # the compiled graph is dropped with the eager choice
    # another graph (another width) is another record
    third = _recording_step(tmp_path, [1.0] + [1e-3, 2e-3] * ROUNDS)
    x3 = torch.randn(9, 10)
    y3 = torch.randint(0, 2, (9,))
    for _ in range(1 + 1 + 2 * ROUNDS):
        third(x3, y3)
    assert third.choice == "captured" and "recorded" not in third.report
    assert len(list(tmp_path.iterdir())) == 2


def test_every_rank_makes_the_same_choice_from_the_exchanged_medians():
    """Under torch.distributed the medians of every rank are exchanged: here this rank's
    captured step is faster, another rank's is much slower, and both keep the eager one."""
    seen = []

    def exchange(obj):
        seen.append(obj)
        if obj is None or isinstance(obj, str):  # the capture's outcome on every rank
            return [obj, None]
        return [obj, (1e-3, 5e-3)]  # rank 1: eager 1 ms, captured 5 ms

    step = _timed_step(1e-3, 5e-4, exchange)
    assert step.choice == "eager", step.report
    assert seen[0] is None and seen[1] == pytest.approx((1e-3, 5e-4))


def test_a_capture_failing_on_another_rank_makes_every_rank_eager():
    def exchange(obj):
        if obj is None or isinstance(obj, str):
            return [obj, "capturing the step failed (RuntimeError: no compiler)"]
        raise AssertionError("no timings are exchanged once the ranks run eager")

    members = make_members(ARCH["question2"], N)
    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters())
    step = compile_step(stack, F.cross_entropy, opt, backend="aot_eager", warmup_steps=1)
    step._exchange = exchange
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    step(x, y)
    with pytest.warns(UserWarning, match=r"another rank's capturing the step failed"):
        step(x, y)
    for _ in range(3):
        step(x, y)
    assert step.choice == "eager"


def test_optimizer_without_capture_falls_back_with_a_warning():
    members = make_members(ARCH["question2"], N)
    stack = phalanx.stack(copy.deepcopy(members))
    opt = torch.optim.Adam(stack.parameters(), lr=1e-2)
    with pytest.warns(
        UserWarning,
        match=r"compile_step\(\).*a phalanx.optim.MemberOptimizer defining update_.*eager",
    ):
        step = compile_step(stack, F.cross_entropy, opt, backend="aot_eager")
    assert step.choice == "eager" and "eager step" in step.report
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    for _ in range(5):
        losses = step(x, y)
    assert losses.shape == (N,)
    # The eager step with the same torch.optim.Adam on the stacked tensors.
    reference = phalanx.stack(copy.deepcopy(members))
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(5):
        ref_opt.zero_grad()
        phalanx.member_losses(F.cross_entropy, reference(x), y).sum().backward()
        ref_opt.step()
    assert_close(stack.state_dict(), reference.state_dict(), trajectory=True, msg="fallback")
    with pytest.raises(ValueError, match=r"a mask needs a phalanx optimizer"):
        step(x, y, mask=torch.ones(N, dtype=torch.bool))


def test_a_failing_compiler_falls_back_with_a_warning():
    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler here")

    members = make_members(ARCH["question2"], N)
    stack = phalanx.stack(copy.deepcopy(members))
    opt = phalanx.optim.Adam(stack.parameters(), lr=LR, eps=EPS)
    step = compile_step(stack, F.cross_entropy, opt, backend=broken, warmup_steps=1)
    data = _data("question2", None, steps=3)
    step(*data[0])
    with pytest.warns(UserWarning, match=r"capturing the step failed .*no C\+\+ compiler"):
        step(*data[1])
    step(*data[2])
    assert step.choice == "eager"
    eager_stack, _, _ = _eager(
        members, data, loss_fn=F.cross_entropy, in_dim=None, decoupled=False, max_norm=None
    )
    assert_close(stack.state_dict(), eager_stack.state_dict(), trajectory=True, msg="fallback")


def test_bad_arguments_are_named():
    members = make_members(ARCH["question2"], N)
    stack = phalanx.stack(members)
    opt = phalanx.optim.Adam(stack.parameters())
    with pytest.raises(TypeError, match=r"compile_step\(\): stack must be a phalanx.Stack; got "):
        compile_step(nn.Linear(2, 2), F.mse_loss, opt)
    other = phalanx.optim.Adam(phalanx.stack(make_members(ARCH["question2"], N)).parameters())
    with pytest.raises(ValueError, match=r"must hold exactly the stack's parameters; the stack's"):
        compile_step(stack, F.mse_loss, other)
    with pytest.raises(ValueError, match=r"prefer must be 'fastest' or 'captured'; got 'fast'"):
        compile_step(stack, F.mse_loss, opt, prefer="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"warmup_steps must be an int >= 1 .* got 0"):
        compile_step(stack, F.mse_loss, opt, warmup_steps=0)
    with pytest.raises(ValueError, match=r"several inputs .* target_in_dims=None"):
        compile_step(stack, F.mse_loss, opt, in_dims=(None, 0))
    step = compile_step(stack, F.cross_entropy, opt, backend="aot_eager")
    with pytest.raises(ValueError, match=r"mask must be a bool tensor of shape \(4,\).* got dtype"):
        step(torch.randn(3, 10), torch.zeros(3, dtype=torch.long), mask=torch.ones(3))


def test_inductor_compiles_the_step():
    """One real compilation (C++ code generated by inductor): seconds on two cores."""
    members = make_members(ARCH["question2"], 2)
    data = _data("question2", None, steps=3)
    stack = phalanx.stack(copy.deepcopy(members))
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    step = compile_step(stack, F.cross_entropy, opt, prefer="captured", warmup_steps=1)
    for x, y in data:
        step(x, y)
    assert isinstance(step, CompiledStep) and step.choice == "captured"
    eager = phalanx.stack(copy.deepcopy(members))
    eager_opt = phalanx.optim.Adam(eager.parameters(), lr=1e-2)
    for x, y in data:
        eager_opt.zero_grad()
        phalanx.member_losses(F.cross_entropy, eager(x), y).sum().backward()
        eager_opt.step()
    assert_close(stack.state_dict(), eager.state_dict(), trajectory=True, msg="inductor")


def test_layout_flattens_and_unflattens_every_kind_of_input():
    """The flat list the compiled graph takes holds each tensor once, in a fixed order."""
    from phalanx.optim import Adam
    from phalanx.step._graph import INPUT, flatten, layout_of, unflatten

    ADAM_HYPERS = Adam.HYPERPARAMETERS

    def t():
        return torch.randn(3)

    hypers = {k: t() for k in ADAM_HYPERS}
    tensors = {
        "params": [t(), t()],
        "buffers": [t()],
        "state": [{"step": t(), "exp_avg_sq": t(), "exp_avg": t()}, {}],
        "hypers": [hypers, {}],
        "args": [t(), 2.5, None],
        "target": t(),
        "mask": t(),
        "max_norm": t(),
        "bad_steps": t(),
        "frozen": t(),
    }
    layout = layout_of(tensors)
    assert layout.state_keys == (("exp_avg", "exp_avg_sq", "step"), ())
    assert layout.args == (INPUT, 2.5, None) and layout.target[1] == (INPUT,)
    flat = flatten(layout, tensors)
    assert len(flat) == 2 + 1 + 3 + len(ADAM_HYPERS) + 1 + 1 + 1 + 1 + 2
    assert all(isinstance(x, torch.Tensor) for x in flat)
    back = unflatten(layout, flat)
    assert back.keys() == tensors.keys()
    for key in tensors:
        assert pytree_ids(back[key]) == pytree_ids(tensors[key]), key
    bare = {**tensors, "mask": None, "max_norm": None, "bad_steps": None, "frozen": None}
    bare_layout = layout_of(bare)
    assert unflatten(bare_layout, flatten(bare_layout, bare))["frozen"] is None
    with pytest.raises(AssertionError, match="beyond the layout"):
        unflatten(bare_layout, [*flatten(bare_layout, bare), t()])


def test_a_tuple_target_is_captured_and_no_call_keeps_its_data_alive():
    """A target such as (y, mask), built fresh each step, is one signature (its structure,
    shapes and dtypes), not one per call: the step compiles, and holds no past targets."""
    import gc
    import weakref

    stack = phalanx.stack(make_members(ARCH["question2"], N), backend="loop")
    opt = phalanx.optim.Adam(stack.parameters(), lr=LR)
    eager_stack = copy.deepcopy(stack)
    eager_opt = phalanx.optim.Adam(eager_stack.parameters(), lr=LR)

    def loss_fn(q, t):
        return ((q - t[0]) ** 2 * t[1]).mean()

    kwargs = {"target_in_dims": 0, "backend": "aot_eager", "prefer": "captured"}
    step = compile_step(stack, loss_fn, opt, warmup_steps=1, **kwargs)
    eager = compile_step(eager_stack, loss_fn, eager_opt, warmup_steps=10**9, **kwargs)
    g = torch.Generator().manual_seed(0)
    refs = []
    for _ in range(6):
        x = torch.randn(8, 10, generator=g)
        y, m = torch.randn(N, 8, 2, generator=g), (torch.rand(N, 8, 1, generator=g) > 0.3) * 1.0
        refs.append(weakref.ref(y))
        step(x, (y, m))
        eager(x, (y, m))
        del y, m
    gc.collect()
    assert len(step._entries) == 1 and step.choice == "captured"
    assert sum(r() is not None for r in refs) == 0
    assert_close(stack.state_dict(), eager_stack.state_dict(), trajectory=True)


def test_a_target_holding_an_object_runs_eager_with_one_warning():
    """A value that cannot be a graph constant (here an object in the target) is no
    signature: that call runs the eager step, said once, and nothing is kept."""

    class Weights:
        def __init__(self, w):
            self.w = w

    stack = phalanx.stack(make_members(ARCH["question2"], N), backend="loop")
    opt = phalanx.optim.Adam(stack.parameters(), lr=LR)

    def loss_fn(q, t):
        return ((q - t[0]) ** 2 * t[1].w).mean()

    step = compile_step(stack, loss_fn, opt, target_in_dims=None, backend="aot_eager",
                        prefer="captured", warmup_steps=1)  # fmt: skip
    x, y = torch.randn(8, 10), torch.randn(8, 2)
    with pytest.warns(UserWarning, match=r"holds a Weights, which the captured step cannot"):
        step(x, (y, Weights(2.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x, (y, Weights(3.0)))  # said once
    assert step._entries == {}


def test_hyperparameter_cache_never_mistakes_a_new_tensor_for_an_old_one():
    """The cache key holds its tensors: a tensor freed and replaced by one that happens to
    get the same id (a scheduler stepped twice between steps) is a change."""
    from phalanx.step._signature import value_key as _value_key

    old = torch.full((N,), 0.1, dtype=torch.float64)
    key = _value_key((old, 0.9))
    assert key == _value_key((old, 0.9))
    old.mul_(2)  # in place: a new version
    assert key != _value_key((old, 0.9))
    key = _value_key(old)
    address = id(old)
    del old  # the key keeps the tensor, so no new tensor can take its id
    fresh = [torch.full((N,), 0.1, dtype=torch.float64) for _ in range(50)]
    assert all(id(t) != address for t in fresh)
    assert all(key != _value_key(t) for t in fresh)


def pytree_ids(tree):
    """The tree with each tensor replaced by its id (dicts compare without their order)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: id(x) if isinstance(x, torch.Tensor) else x, tree)


def test_a_checkpoint_loaded_between_captured_steps_is_what_the_next_step_reads():
    """The graph's inputs are read afresh each call: a loaded optimizer state replaces the
    state tensors, and the captured step must update those, as the eager step does."""
    members = make_members(ARCH["question2"], N)
    data = _data("question2", None, steps=6)
    results = []
    for captured in (True, False):
        stack = phalanx.stack(copy.deepcopy(members))
        opt = phalanx.optim.Adam(stack.parameters(), lr=LR)
        step = compile_step(
            stack, F.cross_entropy, opt, backend="aot_eager", prefer="captured", warmup_steps=1
        )
        run = step if captured else functools.partial(_eager_step, step)
        for x, y in data[:3]:
            run(x, y)
        saved = copy.deepcopy(opt.state_dict())
        for x, y in data[3:5]:
            run(x, y)
        opt.load_state_dict(saved)  # new state tensors, two steps back
        run(*data[5])
        state = [dict(opt.state[p]) for p in stack.parameters()]
        results.append((stack.state_dict(), state))
    assert_close(results[0][0], results[1][0], trajectory=True, msg="weights after a reload")
    for got, expected in zip(results[0][1], results[1][1]):
        for key, value in expected.items():
            assert_close(got[key], value, trajectory=True, msg=f"optimizer {key} after a reload")


def test_simplify_keeps_every_value_and_never_aliases_a_written_input():
    """baddbmm -> bmm + add, value for value; every copy of the traced step is kept (a copy
    dropped could alias an input that a later operation writes into)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from phalanx.step._graph import simplify

    def fold(x, w, b):
        h = x.reshape(-1, 20).view(N, -1, 20)
        return torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))

    def written(x, w, b):
        h = x.reshape(-1, 20).view(N, -1, 20)
        h.mul_(2)  # would write into x were the copy dropped
        return torch.bmm(h, w.transpose(1, 2))

    torch.manual_seed(0)
    x = torch.randn(6, N * 20).view(6, N, 20).transpose(0, 1)  # sliced: a strided view
    w, b = torch.randn(N, 3, 20), torch.randn(N, 3)
    for fn in (fold, written):
        expected = fn(x.clone(), w, b)
        traced = make_fx(fn)(x, w, b)
        copies = [n.target for n in traced.graph.nodes].count(torch.ops.aten.clone.default)
        graph = simplify(traced)
        targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
        assert torch.ops.aten.baddbmm.default not in targets
        assert targets.count(torch.ops.aten.clone.default) == copies, graph.code
        before = x.clone()
        assert_close(graph(x, w, b), expected, msg=fn.__name__)
        assert torch.equal(x, before), "the input was written"


def test_simplify_runs_narrow_products_transposed_to_rounding():
    """W1's (32, 20) x (20, 10) products become ``bmm(b^T, a^T)^T``, copied back to the
    product's own layout (the ``view`` that follows still works); each member's product to
    float rounding against its own matrix product, float32 and float64."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from phalanx.step._graph import simplify

    def fn(x, w):
        return torch.bmm(x, w.transpose(1, 2)).view(x.shape[0], -1)

    torch.manual_seed(0)
    x, w = torch.randn(5, 32, 20), torch.randn(5, 10, 20)
    graph = simplify(make_fx(fn)(x, w))
    (bmm,) = [n for n in graph.graph.nodes if n.target is torch.ops.aten.bmm.default]
    assert [a.target for a in bmm.args] == [torch.ops.aten.transpose.int] * 2, graph.code
    got = graph(x, w)
    assert got.is_contiguous()
    assert_equal_to_loop(
        got,
        torch.stack([(x[i] @ w[i].T).view(-1) for i in range(5)]),
        torch.stack([(x[i].double() @ w[i].double().T).view(-1) for i in range(5)]),
        what="narrow product",
        per_member=True,
    )


@pytest.mark.parametrize(
    ("a", "b", "narrow"),
    [
        ((400, 32, 20), (400, 20, 10), True),  # W1's first layer
        ((16, 128, 64), (16, 64, 1), True),  # a one-column head
        ((16, 8, 20), (16, 20, 32), False),  # few rows: the transposed product is slower
        ((16, 32, 256), (16, 256, 10), False),  # a long contraction: not measured faster
        ((16, 32, 20), (16, 20, 16), False),  # 16 columns fill a SIMD register
        ((400, 512, 64), (400, 64, 4), False),  # 52 MB: from memory, not faster transposed
    ],
)
def test_narrow_product_rule(a, b, narrow):
    from phalanx.step._graph import narrow_product

    assert narrow_product(torch.empty(a), torch.empty(b)) is narrow
    if narrow:  # only float32 on a CPU was measured
        assert not narrow_product(torch.empty(a, dtype=torch.float64), torch.empty(b))
        assert not narrow_product(torch.empty(a, device="meta"), torch.empty(b, device="meta"))


def _eager_step(step, x, y):
    return step._eager((x,), y, None)


def test_the_step_compiled_through_torch_compile_equals_the_direct_one():
    """With a mode for a backend other than inductor (and CUDA graphs on a GPU) the graph is
    compiled by torch.compile, guards and all; it must give the same step."""
    members = make_members(ARCH["question2"], N)
    data = _data("question2", None, steps=4)
    states = []
    for mode in ("default", None):
        stack = phalanx.stack(copy.deepcopy(members))
        opt = phalanx.optim.Adam(stack.parameters(), lr=LR)
        step = compile_step(
            stack, F.cross_entropy, opt, backend="aot_eager", mode=mode, prefer="captured",
            warmup_steps=1, max_norm=0.5,
        )  # fmt: skip
        losses = [step(x, y) for x, y in data]
        assert step.choice == "captured"
        states.append((stack.state_dict(), torch.stack(losses), step.last_norms))
    assert_close(states[0][0], states[1][0], trajectory=True, msg="weights")
    assert_close(states[0][1], states[1][1], trajectory=True, msg="losses")
    assert_close(states[0][2], states[1][2], msg="norms")


# ------------------------------------------------------ member_losses, the loss of every step

LOSS_CASES = {
    "cross_entropy_shared": (F.cross_entropy, {}, lambda: torch.randint(0, 5, (6,)), None),
    "cross_entropy_per_member": (
        F.cross_entropy, {"label_smoothing": 0.1}, lambda: torch.randint(0, 5, (N, 6)), 0
    ),
    # reduction="mean" leaves ignored samples out of the denominator
    "cross_entropy_ignore_index": (
        F.cross_entropy, {}, lambda: torch.tensor([[-100, 1, 2, -100, 4, 0]] * N), 0
    ),
    "cross_entropy_probabilities": (
        F.cross_entropy, {}, lambda: torch.rand(N, 6, 5).softmax(-1), 0
    ),
    "nll_shared": (F.nll_loss, {}, lambda: torch.randint(0, 5, (6,)), None),
    "mse_shared": (F.mse_loss, {}, lambda: torch.randn(6, 5), None),
    "huber_per_member": (F.huber_loss, {"delta": 0.5}, lambda: torch.randn(N, 6, 5), 0),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_member_losses_equal_each_members_own_loss(case):
    loss_fn, kwargs, make_target, target_dim = LOSS_CASES[case]
    torch.manual_seed(0)
    # A strided output, as the fused backend's shared-input path returns: (B, N, C) viewed
    # as (N, B, C).
    base = torch.randn(6, N, 5, dtype=torch.float64, requires_grad=True)
    output = base.transpose(0, 1)
    if loss_fn is F.nll_loss:
        output = output.log_softmax(-1)
    target = make_target()
    target = target.double() if target.is_floating_point() else target
    losses = phalanx.member_losses(loss_fn, output, target, in_dims=(0, target_dim), **kwargs)
    (grad,) = torch.autograd.grad(losses.sum(), base, retain_graph=True)
    expected = torch.stack(
        [
            loss_fn(output[i], target if target_dim is None else target[i], **kwargs)
            for i in range(N)
        ]
    )
    (expected_grad,) = torch.autograd.grad(expected.sum(), base)
    assert_close(losses, expected, dtype=torch.float64, msg=f"{case} losses")
    assert_close(grad, expected_grad, dtype=torch.float64, msg=f"{case} gradients")


def test_a_fused_optimizer_applies_its_kernel_to_the_captured_gradients(monkeypatch):
    """Adam(fused=True): the graph ends at the clipped gradients and torch's fused kernel
    applies them outside it (its bits, once per step), with masks, isolation and freezing as
    the eager fused step has them; each member to rounding torch's fused Adam alone."""
    from phalanx import _torch_compat as compat

    members, data, masks = _diverging_member()

    def build():
        stack = phalanx.stack(copy.deepcopy(members))
        opt = phalanx.optim.Adam(
            stack.parameters(), lr=LR, skip_nonfinite=True, freeze_after=2, fused=True
        )
        return stack, opt

    calls = []
    kernel = compat.fused_adam_
    monkeypatch.setattr(compat, "fused_adam_", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    stack, opt = build()
    step = compile_step(
        stack, F.cross_entropy, opt, in_dims=0, max_norm=1.0, backend="aot_eager",
        prefer="captured", warmup_steps=1,
    )  # fmt: skip
    eager_stack, eager_opt = build()
    for k, ((x, y), mask) in enumerate(zip(data, masks)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteWarning)
            before = len(calls)
            step(x, y, mask=mask)
            assert len(calls) > before, f"step {k}: torch's fused kernel did not run"
            eager_opt.zero_grad()
            losses = phalanx.member_losses(
                F.cross_entropy, eager_stack(x, in_dims=0), y, in_dims=(0, 0)
            )
            losses.sum().backward()
            phalanx.clip_grad_norm_(eager_stack.parameters(), 1.0)
            eager_opt.step(mask=mask, loss=losses.detach())
    assert step.choice == "captured" and step.last_norms is not None
    assert all(p.grad is None for p in stack.parameters())  # it keeps no gradients
    _assert_same_training(stack, opt, eager_stack, eager_opt)


def test_a_fused_optimizer_captured_step_equals_the_fused_loop():
    """Member by member against torch.optim.Adam(fused=True) on each member alone."""
    members = make_members(ARCH["question2"], N)
    data = _data("question2", None)
    stack = phalanx.stack(copy.deepcopy(members))
    opt = phalanx.optim.Adam(stack.parameters(), lr=LR, eps=EPS, fused=True)
    step = compile_step(
        stack, F.cross_entropy, opt, backend="aot_eager", prefer="captured", warmup_steps=1
    )
    for x, y in data:
        step(x, y)
    assert step.choice == "captured"
    loops = {}
    for dtype in (torch.float32, torch.float64):
        models = [copy.deepcopy(m).to(dtype) for m in members]
        opts = [
            torch.optim.Adam(m.parameters(), lr=float(LR[i]), eps=EPS, fused=True)
            for i, m in enumerate(models)
        ]
        for x, y in data:
            for m, o in zip(models, opts):
                o.zero_grad()
                F.cross_entropy(m(x.to(dtype)), y).backward()
                o.step()
        loops[dtype] = models
    _assert_rounding_close(stack, loops[torch.float32], loops[torch.float64])


def test_an_unreadable_record_is_no_record(tmp_path):
    """A damaged record file (a crash, another tool) is ignored: the step times itself."""
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    first = _recording_step(tmp_path, [1.0] + [2e-3, 1e-3] * ROUNDS)
    for _ in range(1 + 1 + 2 * ROUNDS):
        first(x, y)
    (record,) = tmp_path.iterdir()
    record.write_text('{"choice": "eager", "eager_s": "fast"}')
    second = _recording_step(tmp_path, [1.0] + [1e-3, 2e-3] * ROUNDS)
    for _ in range(1 + 1 + 2 * ROUNDS):
        second(x, y)
    assert second.choice == "captured" and "recorded" not in second.report


def test_a_timing_that_does_not_decide_clearly_is_not_recorded(tmp_path):
    """The pairs' ratios straddle the margin (another process took the cores during the
    timing, or a near tie): the run keeps its choice, the report says so, and no later run
    inherits it."""
    x, y = torch.randn(8, 10), torch.randint(0, 2, (8,))
    ratios = [0.5, 0.9, 1.2, 0.9, 1.3]  # captured over eager, pair by pair: median 0.9
    first = _recording_step(tmp_path, [1.0, *(t for r in ratios for t in (r * 1e-3, 1e-3))])
    for _ in range(1 + 1 + 2 * ROUNDS):
        first(x, y)
    assert first.choice == "captured" and "not clear, not recorded" in first.report
    assert list(tmp_path.iterdir()) == []
    # one outlier pair out of five is no reason not to record
    second = _recording_step(tmp_path, [1.0, *[5e-3, 1e-3] + [0.5e-3, 1e-3] * (ROUNDS - 1)])
    for _ in range(1 + 1 + 2 * ROUNDS):
        second(x, y)
    assert second.choice == "captured" and "recorded" not in second.report
    assert len(list(tmp_path.iterdir())) == 1


def test_alternate_samples_are_compared_pair_by_pair():
    """The load rose during the timing: each pair (a captured step, then an eager one) ran
    under one load, and the pairs' ratios say the captured step is 10% slower."""
    eager = [1.0, 1.0, 4.0, 4.0, 4.0]
    captured = [1.1, 1.1, 4.4, 4.4, 4.4]
    assert decide(eager, captured) == "eager"
    assert decide([1.0] * 5, [1.04] * 5) == "captured"  # within the margin
