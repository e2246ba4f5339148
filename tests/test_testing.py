"""phalanx.testing: the one definition of "equal to the loop", shown to pass and to fail.

Every exactness test of the suite rests on this rule, so the rule itself is tested against
cases whose answer is known: a result as far from the float64 loop as the float32 loop passes,
one a few ulps further passes, one well beyond fails, NaN fails, a wrong shape fails, and the
per-member form names the member that is off.
"""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.testing import (
    FACTOR,
    FLOOR_ULPS,
    assert_close,
    assert_equal_to_loop,
    rounding_problems,
)

EPS = torch.finfo(torch.float32).eps


def _loop_and_reference(n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 loop result and its float64 reference: a sum whose order rounds."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, 256, dtype=torch.float64, generator=g)
    reference = x.sum(-1)
    loop = x.float().sum(-1)
    return loop, reference


def test_the_loop_itself_is_equal_to_the_loop():
    loop, reference = _loop_and_reference()
    assert rounding_problems(loop, loop, reference) == []
    assert rounding_problems(reference, loop, reference) == []  # float64 itself is closer


def test_a_result_within_the_factor_passes_and_one_beyond_it_fails():
    loop, reference = _loop_and_reference()
    own = (loop.double() - reference).abs().max().item()
    scale = reference.abs().max().item()
    floor = FLOOR_ULPS * EPS * scale
    inside = reference + 0.9 * (FACTOR * own + floor)
    outside = reference + 1.1 * (FACTOR * own + floor)
    assert rounding_problems(inside, loop, reference) == []
    (problem,) = rounding_problems(outside, loop, reference, what="outputs")
    assert problem.startswith("outputs: max error")
    with pytest.raises(AssertionError, match="outputs: max error"):
        assert_equal_to_loop(outside, loop, reference, what="outputs")


def test_nan_and_a_wrong_shape_fail():
    loop, reference = _loop_and_reference()
    bad = reference.clone()
    bad[1, 3] = float("nan")
    assert rounding_problems(bad, loop, reference) != []
    (problem,) = rounding_problems(reference[:, :10], loop, reference, what="grad")
    assert "grad: shape (3, 10)" in problem


def test_per_member_names_the_member_that_is_off():
    loop, reference = _loop_and_reference(n=4)
    bad = reference.clone()
    bad[2] += 1e-2 * reference.abs().max()
    problems = rounding_problems(bad, loop, reference, what="weight", per_member=True)
    assert len(problems) == 1 and problems[0].startswith("member 2 weight")


def test_several_loop_runs_take_the_largest_distance_as_the_yardstick():
    loop, reference = _loop_and_reference()
    own = (loop.double() - reference).abs().max().item()
    further = reference + 3 * FACTOR * own
    lucky, unlucky = reference.float(), reference + 4 * own  # two runs of a float32 loop
    assert rounding_problems(further, lucky, reference) != []
    assert rounding_problems(further, [lucky, unlucky], reference) == []


def test_floor_scale_allows_for_the_terms_of_a_cancelling_sum():
    reference = torch.tensor([1e-7], dtype=torch.float64)  # a gradient summed to nearly zero
    loop = reference.float()
    got = reference + 5e-7  # 4 ulps of terms of size ~1, far more than the result's own ulps
    assert rounding_problems(got, loop, reference) != []
    assert rounding_problems(got, loop, reference, floor_scale=1.0) == []


def test_assert_close_compares_pytrees_and_their_structure():
    a = {"w": torch.ones(2), "b": (torch.zeros(1),)}
    assert_close(a, {"w": torch.ones(2), "b": (torch.zeros(1),)})
    with pytest.raises(AssertionError, match="structures differ"):
        assert_close(a, {"w": torch.ones(2)}, msg="state")
    with pytest.raises(AssertionError, match="state"):
        assert_close(a, {"w": torch.ones(2) + 1e-3, "b": (torch.zeros(1),)}, msg="state")


def test_the_rule_holds_for_a_stack_and_fails_for_a_stack_off_by_a_member():
    """The rule as users apply it: a stack against its members; a stack whose member 1 was
    nudged after stacking is caught, member by member."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(16, 4) for _ in range(3)]
    stack = phalanx.stack(models)
    x = torch.randn(8, 16)
    loop = torch.stack([m(x) for m in models]).detach()
    reference = torch.stack([m.double()(x.double()) for m in models]).detach()
    out = stack(x).detach()
    assert_equal_to_loop(out, loop, reference, what="outputs", per_member=True)
    with torch.no_grad():
        stack.module.bias[1] += 1e-3
    problems = rounding_problems(stack(x).detach(), loop, reference, per_member=True)
    assert len(problems) == 1 and problems[0].startswith("member 1 ")
