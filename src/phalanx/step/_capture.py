"""The capture: the step's tensors read off the stack and the optimizer, traced, compiled.

``Capture`` is the part of ``CompiledStep`` that builds a graph: :meth:`Capture._tensors`
collects the live tensors the graph reads and writes (parameters, buffers, optimizer state,
per-member hyperparameters, the data), :meth:`Capture._plan` what the graph computes, and
:meth:`Capture._capture` traces the step (``make_fx``, on copies, with the random streams
put back) and hands the graph to the compiler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from phalanx import _torch_compat as compat
from phalanx._torch_compat import pytree
from phalanx.optim._base import MemberOptimizer
from phalanx.step._choice import choice_key
from phalanx.step._compile import compile_graph
from phalanx.step._graph import (
    OUTPUTS,
    Layout,
    Plan,
    flatten,
    layout_of,
    simplify,
    step_function,
    unflatten,
)
from phalanx.step._signature import value_key
from phalanx.step._watch import RandomWatch, generator_states, put_back

logger = logging.getLogger("phalanx")

__all__ = ["Capture", "Entry", "unsupported_optimizer"]


@dataclass
class Entry:
    """One input signature: its compiled graph, its timings and the choice made.

    ``key`` names the choice's record on disk (``_choice.choice_key``); ``recorded`` says
    the choice was read there rather than timed in this process.
    """

    warm_s: list[float] = field(default_factory=list)  # eager steps before the capture
    eager_s: list[float] = field(default_factory=list)  # alternating with captured_s
    captured_s: list[float] = field(default_factory=list)
    run: Callable[[list[Tensor]], tuple[Tensor, ...]] | None = None
    layout: Layout | None = None
    key: str | None = None
    choice: Literal["eager", "captured"] | None = None
    recorded: bool = False
    noisy: bool = False  # the timings did not decide clearly: not recorded
    compile_s: float | None = None
    calls: int = 0


class Capture:
    """The graph-building half of ``CompiledStep`` (a mixin: it reads the step's settings)."""

    stack: Any
    loss_fn: Callable[..., Tensor] | None
    optimizer: Any
    in_dims: Any
    target_in_dims: int | None
    kw_in_dims: Any
    max_norm: float | Tensor | None
    norm_type: float
    backend: Any
    mode: str | None
    _keywords: tuple[str, ...]
    _groups: dict[int, dict[str, Any]]
    _outside: bool
    _max_norm: tuple[Any, Tensor] | None
    _hypers: tuple[list, list[dict[str, Tensor]]] | None
    _trace_s: float

    def _plan(self, args: tuple, tensors: dict[str, Any]) -> Plan:
        """What the graph computes, read from the step's settings and its input tensors
        (:meth:`_tensors`: a mask or a skip record there is one the graph applies)."""
        stack, opt = self.stack, self.optimizer
        assert isinstance(opt, MemberOptimizer)  # unsupported_optimizer let no other through
        named = list(stack.named_parameters())
        in_groups = {id(p) for g in opt.param_groups for p in g["params"]}
        missing = [name for name, p in named if p.requires_grad and id(p) not in in_groups]
        if missing:
            raise ValueError(
                f"the optimizer does not hold the stack's parameter(s) {missing}; build it "
                f"with optimizer(stack.parameters())"
            )
        dims = self.in_dims
        positional = len(args) - len(self._keywords)
        dims = tuple(dims) if isinstance(dims, Sequence) else (dims,) * positional
        return Plan(
            stack=stack,
            loss_fn=self.loss_fn,
            param_names=tuple(name for name, _ in named),
            trainable=tuple(p.requires_grad for _, p in named),
            buffer_names=tuple(name for name, _ in stack.named_buffers()),
            in_dims=dims,
            target_dim=self.target_in_dims,
            update=None if self._outside else type(opt).update,
            options=tuple(
                opt.options(self._groups[id(p)]) if id(p) in self._groups else {} for _, p in named
            ),
            max_norm=self.max_norm is not None,
            norm_type=self.norm_type,
            masked=tensors["mask"] is not None,
            isolate=tensors["bad_steps"] is not None,
            freeze_after=opt.freeze_after,
            keywords=self._keywords,
            kw_in_dims=self.kw_in_dims,
        )

    def _capture(self, args: tuple, target: Any, mask: Tensor | None) -> Entry:
        """Traces the step into one aten graph and compiles it: the entry's ``run``."""
        logger.info("phalanx.compile_step(): tracing and compiling the training step")
        start = time.perf_counter()
        real = self._tensors(args, target, mask)
        plan = self._plan(args, real)
        layout = layout_of(real)
        # Traced on copies and with the RNG put back: a backend may run its example inputs,
        # and tracing must leave no trace in the weights, the buffers or the random stream.
        # On the real copies first (the faster graph), then, where that fails on a value the
        # trace cannot read (GPT-2's packed-sequence check), on fake tensors.
        # The inputs and the target too: a forward that writes its input in place
        # (x /= 255) writes it once per step, and the captured call right after writes it.
        mutable = ("params", "buffers", "state", "bad_steps", "frozen", "args", "target")

        def fresh_copies() -> list[Tensor]:
            return flatten(
                layout, {**real, **{k: pytree.tree_map(_clone, real[k]) for k in mutable}}
            )

        copies = fresh_copies()
        step = step_function(plan)
        returned: list[str] = []

        grads: list[int] = []

        def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
            out = step(unflatten(layout, flat))
            returned[:] = [k for k in OUTPUTS if out[k] is not None]
            pairs = out.get("grads", ())
            grads[:] = [k for k, _ in pairs]
            return (*(out[k] for k in returned), *(g for _, g in pairs))

        rng, generators = _rng_state(), generator_states(self.stack)
        watch = RandomWatch()
        try:
            with watch:
                try:
                    graph = compat.make_fx(flat_step)(*copies)
                except Exception as on_values:
                    _set_rng_state(rng)
                    copies = fresh_copies()
                    try:
                        graph = compat.make_fx(flat_step, fake=True)(*copies)
                    except Exception:
                        raise on_values from None
        finally:
            _set_rng_state(rng)
            put_back(generators)
        if watch.reason is not None:  # the step runs eager, the members' own streams
            raise RuntimeError(watch.reason)
        layout = dataclasses.replace(layout, outputs=tuple(returned), grads=tuple(grads))
        graph = simplify(graph)
        key = choice_key(graph, copies, self.backend, self.mode)
        run = compile_graph(graph, copies, real, self.backend, self.mode, kept=len(layout.outputs))
        self._trace_s = time.perf_counter() - start
        return Entry(run=run, layout=layout, key=key)

    def _tensors(self, args: tuple, target: Any, mask: Tensor | None) -> dict[str, Any]:
        """The graph's inputs: the live tensors of the stack and the optimizer, and the data.

        Read afresh on every call (a checkpoint loaded into the optimizer replaces its state
        tensors), and cheaply: this runs around every captured step.
        """
        opt: Any = self.optimizer
        stacked, buffers = self.stack.stacked_state()
        params = list(stacked.values())
        data = {
            "params": params,
            "buffers": list(buffers.values()),
            "args": list(args),
            "target": target,
            "max_norm": self._max_norm_tensor(params[0].device),
        }
        if self._outside:  # the graph ends at the gradients: it reads no optimizer tensor
            return {**data, "state": [{} for _ in params], "hypers": [{} for _ in params],
                    "mask": None, "bad_steps": None, "frozen": None}  # fmt: skip
        states = [
            opt.ensure_state(self._groups[id(p)], p) if p.requires_grad else {} for p in params
        ]
        isolate = bool(opt.skip_nonfinite)
        return {
            **data,
            "state": states,
            "hypers": self._hyper_tensors(params),
            "mask": mask,
            "bad_steps": opt.bad_steps if isolate else None,
            "frozen": opt.frozen if isolate else None,
        }

    def _max_norm_tensor(self, device: torch.device) -> Tensor | None:
        """``max_norm`` as an (N,) tensor, rebuilt only when it changes."""
        if self.max_norm is None:
            return None
        key = value_key(self.max_norm)
        if self._max_norm is None or self._max_norm[0] != key:
            value = torch.as_tensor(self.max_norm, device=device).expand(len(self.stack))
            self._max_norm = (key, value)
        return self._max_norm[1]

    def _hyper_tensors(self, params: list[Tensor]) -> list[dict[str, Tensor]]:
        """Per parameter, its group's hyperparameters as (N,) tensors; rebuilt on change."""
        opt: Any = self.optimizer
        key = [value_key(v) for g in opt.param_groups for k, v in g.items() if k != "params"]
        if self._hypers is not None and self._hypers[0] == key:
            return self._hypers[1]
        device = params[0].device
        by_param: dict[int, dict[str, Tensor]] = {}
        for group in opt.param_groups:
            h = opt.member_hyperparameters(group, device)
            for p in group["params"]:
                by_param[id(p)] = h
        hypers = [by_param.get(id(p), {}) if p.requires_grad else {} for p in params]
        self._hypers = (key, hypers)
        return hypers


def _clone(v: Any) -> Any:
    # Detached: a clone of a parameter would be a non-leaf, whose .grad the fake tensor of
    # the trace reads, with torch's warning about non-leaf gradients.
    return v.detach().clone() if isinstance(v, Tensor) else v


def _rng_state() -> tuple[Tensor, list[Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, list[Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def unsupported_optimizer(optimizer: Any) -> str | None:
    """Why the captured step cannot express this optimizer's update, or None."""
    if not isinstance(optimizer, MemberOptimizer) or (
        type(optimizer).update_ is MemberOptimizer.update_
    ):
        return (
            f"the captured step takes a phalanx optimizer with an update rule (a "
            f"phalanx.optim.MemberOptimizer defining update_, as every phalanx.optim rule but "
            f"LBFGS does); got {type(optimizer).__module__}.{type(optimizer).__name__}"
        )
    return None
