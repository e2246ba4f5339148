"""The captured step's traced graph made runnable: inductor directly, or through torch.compile.

The backend compiles the traced graph directly, called without TorchDynamo's frame evaluation,
guards and pytree flattening, which were half of a tiny step; ``CompiledStep``'s own signature
is the guard (one graph per signature). On CUDA with ``mode="reduce-overhead"`` (CUDA graphs),
or with a mode for another backend, it goes through ``torch.compile``, which knows which
inputs are static.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from phalanx import _torch_compat as compat

__all__ = ["compile_graph"]


def compile_graph(
    graph: Any,
    copies: list[Tensor],
    real: dict[str, Any],
    backend: Any,
    mode_asked: str | None,
    kept: int | None = None,
) -> Callable[[list[Tensor]], tuple[Tensor, ...]]:
    """``graph`` (traced on ``copies``) compiled by ``backend``: a function of the flat list
    of the step's tensors (``real`` holds them by kind, for CUDA graphs' static addresses).
    ``kept``: how many leading outputs outlive the call (the rest, gradients a fused
    optimizer applies at once, are read before the next replay); None: all."""
    cuda = real["params"][0].is_cuda
    mode = mode_asked if mode_asked is not None else ("reduce-overhead" if cuda else None)
    options: dict[str, Any] = {}
    if backend == "inductor":
        # Inductor's own random numbers differ from eager's: dropout would not match.
        options = {
            **(compat.inductor_mode_options(mode) if mode else {}),
            "fallback_random": True,
        }
        if not cuda:
            # Split a CPU kernel over threads only when each gets >= 64K elements (inductor's
            # default is 512): tiny members' kernels are microseconds, less than OpenMP's
            # fork and join. W1 on 2 threads: captured step 1.78 -> 1.02 ms (it had lost
            # to the eager step); W6, whose kernels are large, 95.9 -> 109 ms, still the
            # faster path (one bench run each, --quick).
            options["cpp.min_chunk_size"] = 65536
    if (cuda and mode == "reduce-overhead") or (mode is not None and backend != "inductor"):
        run = _through_dynamo(graph, real, backend, mode, options, kept)
    else:
        compiled: Any  # compiled directly (see the module's docstring)
        with torch.no_grad():  # an inference graph: the step takes its own gradients
            if backend == "inductor":
                compiled = compat.inductor_compile(graph, copies, options)
            else:
                compiled = compat.dynamo_backend(backend)(graph, copies)

        def run(flat: list[Tensor]) -> tuple[Tensor, ...]:
            return tuple(compiled(*flat))

    return run


def _through_dynamo(
    graph: Callable,
    real: dict[str, Any],
    backend: Any,
    mode: str | None,
    options: dict[str, Any],
    kept: int | None = None,
) -> Callable[[list[Tensor]], tuple[Tensor, ...]]:
    """The graph compiled by ``torch.compile``: CUDA graphs need its static inputs."""
    static = static_inputs(real) if mode == "reduce-overhead" else []
    for x in static:
        compat.mark_static_address(x)
    if backend == "inductor":
        mode = None  # torch.compile takes a mode or options, not both: it is in options
    compiled = torch.compile(
        graph,
        backend=backend,
        mode=mode,
        options=options or None,
        fullgraph=True,
        dynamic=False,
    )
    calls = 0
    marked = {id(x) for x in static}
    where: list[int] = []  # the positions of the static inputs in the flat list

    def run(flat: list[Tensor]) -> tuple[Tensor, ...]:
        nonlocal calls
        if calls == 0:
            where[:] = [i for i, x in enumerate(flat) if id(x) in marked]
        # A static tensor replaced since the capture (opt.load_state_dict() replaces the
        # optimizer's state and counters): marked in its turn, and the guards evaluated on
        # this call; CUDA graph trees re-record on the new address rather than replay on
        # the stale one.
        moved = [flat[i] for i in where if not compat.is_static_address(flat[i])]
        for x in moved:
            compat.mark_static_address(x)
        with _guards_skipped(calls > 0 and not moved):
            out = compiled(*flat)
        calls += 1
        # CUDA graphs overwrite their outputs at the next replay: the kept ones are cloned
        # out of the graph's pool, the gradients a fused optimizer applies now are not
        return tuple(x.clone() if kept is None or i < kept else x for i, x in enumerate(out))

    return run


def static_inputs(real: dict[str, Any]) -> list[Tensor]:
    """The step's inputs whose address must not change for CUDA graphs: every tensor the
    graph writes in place (parameters, buffers, optimizer state, and with
    ``skip_nonfinite`` the optimizer's ``bad_steps`` and ``frozen`` counters).

    Inductor's CUDA graph trees skip CUDA graphs for a whole graph that mutates an input
    not in its static inputs (``check_for_mutation`` in ``torch/_inductor/cudagraph_utils.py``:
    "skipping cudagraphs due to mutated inputs").
    """
    static = [*real["params"], *real["buffers"]]
    static += [x for state in real["state"] for x in state.values()]
    static += [real[k] for k in ("bad_steps", "frozen") if real.get(k) is not None]
    return static


def _guards_skipped(skip: bool) -> Any:
    """Skips torch.compile's guards around a graph that has already run once.

    Each signature (``CompiledStep._signature``: shapes, strides, dtypes and devices of the
    inputs, the parameters' identities, train/eval and autocast modes) has its own compiled
    graph, so the guards could only say what the signature already said; evaluating them
    costs about a third of W2's captured step on a CPU.
    """
    if not skip:
        return contextlib.nullcontext()
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
