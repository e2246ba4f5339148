"""The captured step's graph passes inductor's CUDA graph check on its inputs, on the CPU.

Inductor's CUDA graph trees skip CUDA graphs for a whole graph that writes into an input
outside its static inputs ("skipping cudagraphs due to mutated inputs";
``check_for_mutation`` in ``torch/_inductor/cudagraph_utils.py``): every input the graph
mutates must be among ``fw_metadata.static_input_indices``, the indices inductor takes as its
``static_input_idxs``. The captured step compiles through ``torch.compile`` with
``mode="reduce-overhead"`` on CUDA; here the same path runs on the CPU with a backend that
records what AOTAutograd hands inductor, and the rule is applied to it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.step._api import compile_step

N = 4


def _recorder(seen: list[tuple[list[int], list[int]]]):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def forward(gm: torch.fx.GraphModule, inputs: list) -> object:
        meta = torch._guards.TracingContext.get().fw_metadata
        mutated = [
            i
            for i, info in enumerate(meta.input_info)
            if info.mutates_data or info.mutates_storage_metadata
        ]
        seen.append((mutated, sorted(meta.static_input_indices)))
        return make_boxed_func(gm.forward)

    inner = aot_autograd(fw_compiler=forward, keep_inference_input_mutations=True)

    def backend(gm: torch.fx.GraphModule, inputs: list, mode: str | None = None) -> object:
        return inner(gm, inputs)

    return backend


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"skip_nonfinite": True},
        {"skip_nonfinite": True, "freeze_after": 2},
        {"skip_nonfinite": True, "mask": True},
    ],
    ids=["plain", "skip_nonfinite", "freeze_after", "skip_nonfinite+mask"],
)
def test_every_input_the_captured_step_mutates_is_static(options):
    """With ``mode="reduce-overhead"`` (CUDA graphs), no input the graph writes is outside the
    static inputs: the optimizer's ``bad_steps`` and ``frozen`` counters included."""
    torch.manual_seed(0)
    options = dict(options)
    masked = options.pop("mask", False)
    stack = phalanx.stack(
        [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)) for _ in range(N)]
    )
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-3, **options)
    seen: list[tuple[list[int], list[int]]] = []
    step = compile_step(
        stack, F.cross_entropy, opt, max_norm=1.0, backend=_recorder(seen),
        mode="reduce-overhead", prefer="captured", warmup_steps=1,
    )  # fmt: skip
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    mask = torch.tensor([True, False, True, True]) if masked else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            step(x, y, mask=mask)
    assert step.choice == "captured", step.report
    assert seen, "the step was not compiled through torch.compile"
    for mutated, static in seen:
        assert mutated, "the graph mutates nothing: the check would not be checking"
        outside = sorted(set(mutated) - set(static))
        assert not outside, (
            f"inputs {outside} are mutated but not static: CUDA graph trees would skip the "
            f"whole step (static inputs: {static})"
        )


def test_state_replaced_by_load_state_dict_is_marked_static_and_guarded():
    """``opt.load_state_dict`` replaces the optimizer's state tensors: the next captured call
    marks the new ones static (CUDA graph trees then re-record on their addresses instead of
    replaying on the old ones) and evaluates torch.compile's guards on that call."""
    from phalanx import _torch_compat as compat
    from phalanx.step import _compile

    torch.manual_seed(0)
    stack = phalanx.stack([nn.Linear(6, 3) for _ in range(N)])
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-3, skip_nonfinite=True)
    step = compile_step(
        stack, F.cross_entropy, opt, backend=_recorder([]), mode="reduce-overhead",
        prefer="captured", warmup_steps=1,
    )  # fmt: skip
    guarded: list[bool] = []
    skipped = _compile._guards_skipped
    _compile._guards_skipped = lambda skip: guarded.append(not skip) or skipped(skip)
    try:
        x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
        for _ in range(3):
            step(x, y)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        step(x, y)
        step(x, y)
    finally:
        _compile._guards_skipped = skipped
    assert step.choice == "captured"
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and all(compat.is_static_address(t) for t in [*state, opt.bad_steps])
    assert guarded == [True, False, True, False], guarded
