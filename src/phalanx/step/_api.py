"""``phalanx.compile_step``: the whole training step captured as one compiled computation.

Tiny members are launch-bound: a training step of 8 networks 10-20-2 is microseconds of
arithmetic under Python, the dispatcher, the autograd engine and the optimizer's bookkeeping.
Here the step (forward through the stack, per-member losses, backward, clipping, isolation
and the optimizer update) is traced once with ``make_fx`` into one graph of aten operations,
backward included, and that graph, taking one flat list of tensors, is handed straight to
the compiler (inductor's ``compile_fx`` by default): called without TorchDynamo's frame
evaluation, guards and pytree flattening, which cost as much as W2's whole compiled step.
Our own input signature is the guard. On CUDA with ``mode="reduce-overhead"`` (CUDA graphs)
it goes through ``torch.compile``, which knows which inputs are static.

The update is the optimizer's own rule (``MemberOptimizer.update``, the pure form of the
``update_`` its eager step runs), so every phalanx optimizer with an update rule is
captured, a rule added later included. An optimizer built with ``fused=True`` promises torch's fused kernel's
bits, which a trace cannot hold (the kernel is one opaque call): there the graph ends at the
clipped gradients and the optimizer's own step applies them, as in the eager step.

Capture does not pay everywhere (inductor's code for some shapes is slower than the eager
kernels), so by default the step times itself: after the warm-up it alternates captured and
eager steps, compares their medians and keeps the captured step unless it is slower by more
than a margin (``decide``), saying which in ``CompiledStep.report`` and in the ``phalanx``
logger. Alternating and medians make one slow sample (another process taking the core)
harmless; under ``torch.distributed`` every rank's medians are exchanged and every rank
reaches the same choice. Where capture is not possible
(an optimizer it cannot express, a forward it cannot trace, no compiler) it runs the eager
step and says so with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from phalanx import _torch_compat as compat
from phalanx._errors import summary
from phalanx._torch_compat import pytree
from phalanx._warnings import FallbackWarning, warn
from phalanx.core._stack import Stack
from phalanx.optim._base import MemberOptimizer
from phalanx.step._compile import compile_graph
from phalanx.step._graph import (
    OUTPUTS,
    Layout,
    Plan,
    flatten,
    layout_of,
    simplify,
    split_keywords,
    step_function,
    unflatten,
)
from phalanx.step._signature import NoSignature, value_key
from phalanx.step._watch import RandomWatch, generator_states, put_back
from phalanx.train._clip import clip_grad_norm_
from phalanx.train._losses import member_losses

logger = logging.getLogger("phalanx")

__all__ = ["CompiledStep", "compile_step"]

_WHERE = "phalanx.compile_step()"
Prefer = Literal["fastest", "captured"]
Choice = Literal["eager", "captured"]

#: Captured and eager steps timed alternately after the capture, each this many times.
ROUNDS = 3
#: The captured step is kept unless its median is slower than the eager one's by more.
MARGIN = 0.05


@dataclass
class _Entry:
    """One input signature: its timings, its compiled graph and the choice made."""

    eager_s: list[float] = field(default_factory=list)  # the warm-up's, then alternating
    captured_s: list[float] = field(default_factory=list)
    run: Callable[[list[Tensor]], tuple[Tensor, ...]] | None = None
    layout: Layout | None = None
    choice: Literal["eager", "captured"] | None = None
    compile_s: float | None = None
    calls: int = 0


class CompiledStep:
    """A training step of every member, captured and compiled. Build it with :func:`compile_step`.

    Attributes:
        choice: "captured" or "eager" once the step has decided for the latest call's input
            signature, else None (still warming up and measuring).
        compile_seconds: seconds spent tracing and compiling the latest signature's graph (None
            before the capture).
        last_norms: (N,) the members' gradient norms before clipping, when ``max_norm`` is set.
    """

    def __init__(
        self,
        stack: Any,
        loss_fn: Callable[..., Tensor] | None,
        optimizer: torch.optim.Optimizer,
        *,
        in_dims: int | Sequence[int | None] | None,
        target_in_dims: int | None,
        kw_in_dims: Any = None,
        max_norm: float | Tensor | None,
        norm_type: float,
        backend: str | Callable[..., Any],
        mode: str | None,
        prefer: Prefer,
        warmup_steps: int,
    ) -> None:
        self.stack, self.loss_fn, self.optimizer = stack, loss_fn, optimizer
        self.in_dims = in_dims
        self.target_in_dims = target_in_dims
        self.kw_in_dims = kw_in_dims
        self._keywords: tuple[str, ...] = ()  # the latest call's keyword inputs, after args
        self.max_norm, self.norm_type = max_norm, float(norm_type)
        self.backend, self.mode, self.prefer = backend, mode, prefer
        self.warmup_steps = warmup_steps
        self.choice: str | None = None
        self.compile_seconds: float | None = None
        self.last_norms: Tensor | None = None
        self._entries: dict[tuple, _Entry] = {}
        self._params: list[Tensor] = []  # the optimizer's parameters the entries were built for
        self._eager_reasons: set[str] = set()
        self._hypers: tuple[list, list[dict[str, Tensor]]] | None = None
        self._max_norm: tuple[Any, Tensor] | None = None
        self._mode_modules = list(stack.modules())  # whose train/eval modes the signature reads
        self._groups: dict[int, dict[str, Any]] = {}  # id(param) -> its optimizer group
        # CUDA: a step's skipped/frozen flags on their way to the host (see _after_isolation)
        self._flags_in_flight: tuple[Tensor, Any, bool] | None = None
        # Injected by tests: the clock of the timings, and the exchange of every rank's
        # medians (a list with this rank's object alone outside torch.distributed).
        self._clock: Callable[[], float] = time.perf_counter
        self._exchange: Callable[[Any], list[Any]] = _exchange
        # fused=True: torch's fused kernel applies the graph's gradients (its bits, its speed)
        self._outside = bool(getattr(optimizer, "fused", False)) and isinstance(
            optimizer, MemberOptimizer
        )
        self._why_not = _unsupported_optimizer(optimizer)
        if self._why_not is not None:
            self._fall_back(self._why_not)

    # ------------------------------------------------------------------------------- calling

    def __call__(
        self,
        inputs: Tensor | tuple[Any, ...],
        target: Any = None,
        *,
        mask: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """Runs one training step of every member and returns their losses.

        Args:
            inputs: the members' input, ``(B, ...)`` shared or ``(N, B, ...)`` per-member as
                ``in_dims`` says; a tuple for a member with several positional inputs.
            target: ``(B, ...)`` shared or ``(N, B, ...)`` per-member, as ``target_in_dims``.
            mask: (N,) bool: members whose flag is False keep their weights and optimizer
                state, as with ``optimizer.step(mask=...)``.
            **kwargs: keyword inputs of the members' forward (``attention_mask=``,
                ``labels=``), shared or per-member as ``kw_in_dims`` says.

        Returns:
            (N,) the members' losses before the update, detached.
        """
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        # Keyword inputs travel after the positional ones, named by self._keywords.
        self._keywords = tuple(kwargs)
        args = (*args, *kwargs.values())
        n = len(self.stack)
        if mask is not None:
            mask = torch.as_tensor(mask, device=next(self.stack.parameters()).device)
            if mask.dtype != torch.bool or mask.shape != (n,):
                raise ValueError(
                    f"CompiledStep(): mask must be a bool tensor of shape ({n},), one flag per "
                    f"member (True: update it); got dtype {mask.dtype} and shape "
                    f"{tuple(mask.shape)}."
                )
        if self._why_not is not None:
            return self._eager(args, target, mask)
        key = self._signature(args, target, mask)
        if key is None:
            return self._eager(args, target, mask)
        entry = self._entries.get(key) or self._entries.setdefault(key, _Entry())
        self.choice = entry.choice
        if entry.choice == "eager":
            return self._eager(args, target, mask)
        if entry.choice == "captured":
            return self._captured(entry, args, target, mask)
        if entry.run is None:
            if len(entry.eager_s) < self.warmup_steps:
                return self._timed(entry.eager_s, self._eager, args, target, mask)
            failure = None
            try:
                captured = self._capture(args, target, mask)
                entry.run, entry.layout = captured.run, captured.layout
                start = time.perf_counter()
                # The first call may compile; a compiler's failure is raised before the graph
                # runs, so nothing has been written when the eager step takes over.
                loss = self._captured(entry, args, target, mask)
            except Exception as e:
                failure = f"capturing the step failed ({_reason(e)})"
            # Every rank captures at the same call: if one failed, all run eager.
            failed = [f for f in self._exchange(failure) if f is not None]
            if failed:
                entry.run, entry.choice = None, "eager"
                self._fall_back(failure or f"another rank's {failed[0]}")
                return self._eager(args, target, mask) if failure else loss
            entry.compile_s = self.compile_seconds = self._trace_s + time.perf_counter() - start
            if self.prefer == "captured":
                self._decide(entry, "captured")
            return loss
        # Alternate captured and eager steps, ROUNDS each, then decide on the medians.
        if len(entry.captured_s) <= len(entry.eager_s) - self.warmup_steps:
            loss = self._timed(entry.captured_s, self._captured, entry, args, target, mask)
        else:
            loss = self._timed(entry.eager_s, self._eager, args, target, mask)
        if len(entry.eager_s) - self.warmup_steps >= ROUNDS:
            self._decide(entry, self._agreed(entry))
        return loss

    def _agreed(self, entry: _Entry) -> Choice:
        """``decide`` on the medians of every rank (the same table, so the same choice)."""
        eager = entry.eager_s[1:]  # the first eager step settled the stack's backend
        mine = (statistics.median(eager), statistics.median(entry.captured_s))
        return agree(self._exchange(mine))

    @property
    def report(self) -> str:
        """One line: what runs, and the timings and compile seconds it was decided on."""
        if self._why_not is not None:
            return f"eager step: {self._why_not}"
        lines = []
        for entry in self._entries.values():
            eager = _median(entry.eager_s[1:] or entry.eager_s)
            captured = _median(entry.captured_s)
            compile_s = "-" if entry.compile_s is None else f"{entry.compile_s:.1f} s"
            lines.append(
                f"{entry.choice or 'deciding'}: eager step {_ms(eager)}, captured step "
                f"{_ms(captured)} (medians), compile {compile_s}"
            )
        return "; ".join(lines) or "no step run yet"

    def _timed(self, into: list[float], fn: Callable[..., Tensor], *args: Any) -> Tensor:
        sync = _synchronizer(self.stack)
        sync()
        start = self._clock()
        loss = fn(*args)
        sync()
        into.append(self._clock() - start)
        return loss

    def _decide(self, entry: _Entry, choice: Choice) -> None:
        entry.choice = choice
        self.choice = choice
        if choice == "eager":
            entry.run = None  # the compiled graph and its buffers are not needed any more
        logger.info("phalanx.compile_step(): runs the %s step (%s)", choice, self.report)

    def _fall_back(self, reason: str) -> None:
        self.choice = "eager"
        warn(
            f"{_WHERE}: {reason}; running the eager step (forward, backward, "
            f"optimizer.step()) instead. It gives the same results, without the capture's "
            f"speed.",
            FallbackWarning,
        )

    # -------------------------------------------------------------------------------- eager

    def _eager(self, args: tuple, target: Any, mask: Tensor | None) -> Tensor:
        """The step as a user writes it with phalanx: the reference of the captured one."""
        opt: Any = self.optimizer
        opt.zero_grad(set_to_none=True)
        args, keywords = split_keywords(args, self._keywords)
        out = self.stack(*args, in_dims=self.in_dims, kw_in_dims=self.kw_in_dims, **keywords)
        losses = member_losses(self.loss_fn, out, target, in_dims=(0, self.target_in_dims))
        losses.sum().backward()
        losses = losses.detach()
        if self.max_norm is not None:
            self.last_norms = clip_grad_norm_(
                self.stack.parameters(), self.max_norm, self.norm_type
            )
        if isinstance(opt, MemberOptimizer):
            opt.step(mask=mask, loss=losses)
        else:
            if mask is not None:
                raise ValueError(
                    f"CompiledStep(): a mask needs a phalanx optimizer; "
                    f"{type(opt).__name__} updates every member. Use a phalanx optimizer "
                    f"(a phalanx.optim.MemberOptimizer)."
                )
            opt.step()
        return losses

    # ------------------------------------------------------------------------------ capture

    def _signature(self, args: tuple, target: Any, mask: Tensor | None) -> tuple | None:
        """What a graph is specialised on; None where a value cannot be a graph constant.

        Tensors enter as shape, strides, dtype and device, never as objects (a key holding
        them would keep every call's data alive); a target may be a tuple, list or dict of
        tensors. The optimizer's parameters are compared by identity with the ones the
        entries were traced for, held here, and a change (``keep_members``) drops them all.
        """

        def sig(a: Any) -> Any:
            if isinstance(a, Tensor):
                return (a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
            if a is None or isinstance(a, bool | int | float | str | torch.dtype):
                return (type(a), a)
            raise NoSignature(type(a).__name__)

        try:
            leaves, spec = pytree.tree_flatten(target)
            key = (*map(sig, args), spec, *map(sig, leaves))
        except NoSignature as e:
            self._warn_eager_once(
                f"an input or the target holds a {e}, which the captured step cannot take as "
                "a constant; pass tensors (or a tuple, list or dict of them) and numbers"
            )
            return None
        modes = (*(m.training for m in self._mode_modules), torch.is_autocast_enabled())
        opt: Any = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        if len(params) != len(self._params) or any(
            p is not q for p, q in zip(params, self._params, strict=False)
        ):
            self._entries.clear()
            self._params = params
            self._groups = {id(p): g for g in opt.param_groups for p in g["params"]}
        # What the rule's update branches on, and the state it reads (SGD's buffer starts
        # when its momentum does): each is part of the graph.
        rule = (
            *(tuple(sorted(opt.options(g).items())) for g in opt.param_groups),
            *(tuple(opt.ensure_state(self._groups[id(p)], p)) for p in params if p.requires_grad),
        )
        # The members' dropout rates are constants of the graph (a rate set by stack[i] =
        # module or a checkpoint load is a new graph); empty where the members share them.
        rates = getattr(self.stack, "dropout_rates", {})
        rates = tuple((k, tuple(v.tolist())) for k, v in rates.items()) if rates else ()
        # The stack's backend is not part of it: every backend is exact, and the graph keeps
        # the one the stack ran when it was traced.
        return (*key, mask is None, modes, self._keywords, rule, rates)

    def _warn_eager_once(self, reason: str) -> None:
        if reason not in self._eager_reasons:
            self._eager_reasons.add(reason)
            warn(f"{_WHERE}: {reason}; this call runs the eager step.", FallbackWarning)

    def _plan(self, args: tuple, tensors: dict[str, Any]) -> Plan:
        """What the graph computes, read from the step's settings and its input tensors
        (:meth:`_tensors`: a mask or a skip record there is one the graph applies)."""
        stack, opt = self.stack, self.optimizer
        assert isinstance(opt, MemberOptimizer)  # _unsupported_optimizer let no other through
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

    def _capture(self, args: tuple, target: Any, mask: Tensor | None) -> _Entry:
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
        run = compile_graph(graph, copies, real, self.backend, self.mode, kept=len(layout.outputs))
        self._trace_s = time.perf_counter() - start
        return _Entry(run=run, layout=layout)

    def _captured(self, entry: _Entry, args: tuple, target: Any, mask: Tensor | None) -> Tensor:
        assert entry.run is not None and entry.layout is not None
        t = self._tensors(args, target, mask)
        for p in t["params"]:
            p.grad = None  # the captured step keeps no gradients; stale ones would mislead
        if t["params"][0].is_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            flat = entry.run(flatten(entry.layout, t))
        out = dict(zip(entry.layout.outputs, flat))
        if self._outside:  # the optimizer's own step (torch's fused kernel) applies them
            for k, g in zip(entry.layout.grads, flat[len(entry.layout.outputs) :], strict=True):
                t["params"][k].grad = g
            opt: Any = self.optimizer
            opt.step(mask=mask, loss=out["losses"])
            for p in t["params"]:
                p.grad = None
        entry.calls += 1
        if "norms" in out:
            self.last_norms = out["norms"]
        if entry.layout.isolated:
            self._after_isolation(out["skipped"], out.get("frozen"))
        return out["losses"]

    def _after_isolation(self, skipped: Tensor | None, newly_frozen: Tensor | None) -> None:
        """Records skipped members on the optimizer and warns, as its own step does.

        On CUDA the flags travel to the host by an asynchronous copy and the warning comes
        when they have arrived, at the latest after the next step is queued: reading them
        at once would make the host wait for the step after every replay.
        """
        opt: Any = self.optimizer
        assert skipped is not None
        opt.last_skipped = skipped
        if not opt.warn_skipped:
            return
        if not skipped.is_cuda:
            opt.warn_if_skipped(skipped, newly_frozen)
            return
        previous = self._flags_in_flight
        frozen = torch.zeros_like(skipped) if newly_frozen is None else newly_frozen
        flags = torch.stack([skipped, frozen])  # (2, N) bool
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._flags_in_flight = (host, done, newly_frozen is not None)
        if previous is not None:  # the step before this one: finished or nearly
            previous[1].synchronize()
            self._warn_from_host(previous)
        if done.query():
            self._warn_from_host(self._flags_in_flight)
            self._flags_in_flight = None

    def _warn_from_host(self, flags: tuple[Tensor, Any, bool]) -> None:
        host, _, frozen = flags
        opt: Any = self.optimizer
        if bool(host.any()):  # a host tensor: no device sync
            opt.warn_if_skipped(host[0], host[1] if frozen else None)

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


def decide(eager_s: list[float], captured_s: list[float], margin: float = MARGIN) -> Choice:
    """The captured step unless its median is slower than the eager step's by more than
    ``margin`` (its compilation is paid, and a near tie is noise).

    Args:
        eager_s: seconds of eager steps (samples, or one median per rank: see ``agree``).
        captured_s: seconds of captured steps, likewise.
        margin: how much slower than the eager step the captured one may be and be kept.

    Returns:
        "captured" or "eager".
    """
    eager, captured = statistics.median(eager_s), statistics.median(captured_s)
    return "captured" if captured <= eager * (1 + margin) else "eager"


def agree(table: list[tuple[float, float]], margin: float = MARGIN) -> Choice:
    """One choice for every rank from every rank's ``(eager, captured)`` medians: ranks step
    together, so the slowest rank's time counts on each side. Every rank judges the same
    table, so every rank reaches the same choice."""
    return decide([max(e for e, _ in table)], [max(c for _, c in table)], margin)


def _exchange(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (``all_gather_object`` on the default group); ``[obj]`` alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, obj)
    return table


def _clone(v: Any) -> Any:
    # Detached: a clone of a parameter would be a non-leaf, whose .grad the fake tensor of
    # the trace reads, with torch's warning about non-leaf gradients.
    return v.detach().clone() if isinstance(v, Tensor) else v


def _reason(error: BaseException) -> str:
    """``Type: first line`` of the innermost cause (torch.compile wraps a backend's error)."""
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    return summary(error)


def _median(times: list[float]) -> float | None:
    return statistics.median(times) if times else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g} ms"


def _synchronizer(stack: Any) -> Callable[[], None]:
    p = next(stack.parameters(), None)
    if p is not None and p.is_cuda:
        return torch.cuda.synchronize
    return lambda: None


def _rng_state() -> tuple[Tensor, list[Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, list[Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def _unsupported_optimizer(optimizer: Any) -> str | None:
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


def compile_step(
    stack: Any,
    loss_fn: Callable[..., Tensor] | None,
    optimizer: torch.optim.Optimizer,
    *,
    in_dims: int | Sequence[int | None] | None = None,
    target_in_dims: int | Literal["same"] | None = "same",
    kw_in_dims: Any = None,
    max_norm: float | Tensor | None = None,
    norm_type: float = 2.0,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    prefer: Prefer = "fastest",
    warmup_steps: int = 3,
) -> CompiledStep:
    """Captures a whole training step of every member as one compiled computation.

    ``step = phalanx.compile_step(stack, loss_fn, opt)`` then ``losses = step(x, y)`` does what
    the eager loop body does (zero the gradients, forward, ``member_losses``, backward, clip,
    ``opt.step(mask=...)``), with forward, backward and update traced into one graph and
    compiled (by inductor, or the backend named). It equals the eager step to float rounding,
    and reads and writes the same tensors: the stack's parameters and buffers and the
    optimizer's state, so eager steps, checkpoints and schedulers mix freely with it. It
    keeps no ``.grad``.

    The first ``warmup_steps`` calls with a new input signature (shapes, dtypes, devices,
    in_dims, train/eval mode) run the eager step, timed; the next call traces and compiles the
    step (the cost, in seconds, is ``step.compile_seconds``) and runs it; the next six
    alternate captured and eager steps, timed. With ``prefer="fastest"`` the step then keeps
    the captured step unless its median time is more than 5% over the eager step's
    (:func:`decide`; under ``torch.distributed`` on every rank's medians, the slowest rank
    counting, so every rank makes the same choice) and says which in ``step.report`` and the
    ``phalanx`` logger. Where capture is impossible it warns and runs the eager step.

    Args:
        stack: the :class:`phalanx.Stack` to train.
        loss_fn: a loss on one member's ``(B, ...)`` output and target returning a scalar,
            such as ``torch.nn.functional.cross_entropy`` (see :func:`phalanx.member_losses`);
            the loop's own loss on a member's whole output where that is a tuple, dict,
            registered dataclass or Hugging Face ``ModelOutput`` (``lambda q, y:
            F.mse_loss(q[0], y) + F.mse_loss(q[1], y)``, ``lambda out, y:
            F.cross_entropy(out.logits, y)``); or None for the loss each member computes
            itself (its output's ``.loss``, e.g. a Hugging Face model given ``labels=``):
            call ``step(inputs, labels=y, ...)``.
        optimizer: a phalanx optimizer (``Adam``, ``AdamW``, ``SGD``, ``Lion``, any
            ``MemberOptimizer`` with an update rule) over ``stack.parameters()``, with any
            per-member hyperparameters, ``skip_nonfinite`` and ``freeze_after``; its own
            ``update`` is what the graph runs. Other optimizers run the eager step, with a
            warning.
        in_dims: as in ``Stack.forward``: None (shared input) or 0 (per-member), one per input.
        target_in_dims: None (a target shared by every member) or 0 (per-member); "same"
            (the default) follows ``in_dims`` of a single input.
        kw_in_dims: how the keyword inputs of ``step(...)`` map over the members, as in
            ``Stack.forward``: a dict of name to None or 0, or one value for all.
        max_norm: clip each member's gradient norm to this, a number or (N,), as
            :func:`phalanx.clip_grad_norm_`; the norms are ``step.last_norms``.
        norm_type: the p of the clipping norm.
        backend: ``torch.compile``'s backend; "eager" and "aot_eager" capture without
            generating code (quick to build, for tests and debugging).
        mode: ``torch.compile``'s mode; None gives "reduce-overhead" (CUDA graphs) on CUDA and
            the default on CPU.
        prefer: "fastest" (time both, alternately, and keep the captured step unless it is
            slower) or "captured" (always capture).
        warmup_steps: eager steps before the capture, >= 1 (the first settles the stack's
            backend choice, which must be fixed before tracing).

    Returns:
        The step, a callable ``step(inputs, target=None, *, mask=None, **kwargs) -> (N,)
        losses``.

    Raises:
        TypeError: ``stack`` is not a :class:`phalanx.Stack`.
        ValueError: an argument out of range; the optimizer does not hold the stack's
            parameters.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 3) for _ in range(5)])
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        >>> step = phalanx.compile_step(stack, F.cross_entropy, opt, backend="eager")  # or inductor
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> for _ in range(10):  # 3 eager steps, the capture, 3 captured and 3 eager alternating
        ...     losses = step(x, y)
        >>> losses.shape
        torch.Size([5])
        >>> step.report  # the step it kept ("captured" or "eager"), and why
        '...: eager step ... ms, captured step ... ms (medians), compile ... s'
    """
    if not isinstance(stack, Stack):
        raise TypeError(
            f"{_WHERE}: stack must be a phalanx.Stack; got {type(stack).__name__}. Build one "
            f"with phalanx.stack(models)."
        )
    if prefer not in ("fastest", "captured"):
        raise ValueError(f"{_WHERE}: prefer must be 'fastest' or 'captured'; got {prefer!r}.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(
            f"{_WHERE}: warmup_steps must be an int >= 1 (the first eager step settles the "
            f"stack's backend before tracing); got {warmup_steps!r}."
        )
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    foreign = [k for k, g in enumerate(optimizer.param_groups) for p in g["params"]
               if id(p) not in {id(q) for q in stack.parameters()}]  # fmt: skip
    missing = [n for n, p in stack.named_parameters() if p.requires_grad and id(p) not in held]
    if foreign or missing:
        raise ValueError(
            f"{_WHERE}: the optimizer must hold exactly the stack's parameters; "
            + (f"the stack's {missing} are missing" if missing else "")
            + ("; " if foreign and missing else "")
            + (f"group(s) {sorted(set(foreign))} hold tensors of another module" if foreign else "")
            + ". Build it with optimizer(stack.parameters())."
        )
    if target_in_dims == "same":
        if in_dims is not None and not isinstance(in_dims, int):
            raise ValueError(
                f"{_WHERE}: with several inputs (in_dims={in_dims!r}) say how the target maps "
                f"over the members: target_in_dims=None (shared) or 0 (per-member)."
            )
        target_in_dims = in_dims
    if target_in_dims not in (None, 0):
        raise ValueError(
            f"{_WHERE}: target_in_dims must be None (shared) or 0 (per-member); got "
            f"{target_in_dims!r}."
        )
    return CompiledStep(
        stack,
        loss_fn,
        optimizer,
        in_dims=in_dims,
        target_in_dims=target_in_dims,
        kw_in_dims=kw_in_dims,
        max_norm=max_norm,
        norm_type=norm_type,
        backend=backend,
        mode=mode,
        prefer=prefer,
        warmup_steps=warmup_steps,
    )
