"""``CompiledStep``: one training step of every member, captured or eager, as it chose.

Each input signature (:meth:`CompiledStep._signature`: shapes, dtypes, devices, in_dims,
train/eval modes, the optimizer's options) has its own graph (``Entry``). Its first
``warmup_steps`` calls run the eager step (the first settles the stack's backend); the next
traces and compiles the step (``_capture.Capture``) and runs it; then captured and eager
steps alternate until the choice is made (``_choice``), or an earlier run's record of the
choice for the same graph on this machine is read and the timing skipped.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from phalanx._errors import summary
from phalanx._warnings import FallbackWarning, warn
from phalanx.optim._base import MemberOptimizer
from phalanx.step._capture import Capture, Entry, unsupported_optimizer
from phalanx.step._choice import (
    ROUNDS,
    Choice,
    Prefer,
    Records,
    agree,
    clear,
    exchange,
    median,
    ms,
    ratio,
    synchronizer,
)
from phalanx.step._graph import flatten, split_keywords
from phalanx.step._signature import NoSignature, data_key, graph_constants
from phalanx.train._clip import clip_grad_norm_
from phalanx.train._losses import member_losses

logger = logging.getLogger("phalanx")

__all__ = ["CompiledStep"]

_WHERE = "phalanx.compile_step()"


class CompiledStep(Capture):
    """A training step of every member, captured and compiled. Build it with :func:`compile_step`.

    Attributes:
        choice: "captured" or "eager" once the step has decided for the latest call's input
            signature, else None (still warming up and measuring).
        compile_seconds: seconds spent tracing and compiling the latest signature's graph (None
            before the capture).
        last_norms: (N,) the members' gradient norms before clipping, when ``max_norm`` is set.
        report: one line per input signature: the step chosen, the two medians it was chosen
            on, whether the choice was read from an earlier run's record, the compile seconds.
        eager_seconds, captured_seconds: the medians the latest signature's choice was made on
            (None until it is made).
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
        self._entries: dict[tuple, Entry] = {}
        self._entry: Entry | None = None  # the latest call's
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
        self._exchange: Callable[[Any], list[Any]] = exchange
        # Where choices are recorded for later runs (inductor's cache folder), found at the
        # first decision; tests inject their own. Only inductor's graphs are recorded: the
        # other backends are for tests and debugging, and quick to time.
        self._records: Records | Literal[False] | None = None if backend == "inductor" else False
        # fused=True: torch's fused kernel applies the graph's gradients (its bits, its speed)
        self._outside = bool(getattr(optimizer, "fused", False)) and isinstance(
            optimizer, MemberOptimizer
        )
        self._why_not = unsupported_optimizer(optimizer)
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
        entry = self._entries.get(key) or self._entries.setdefault(key, Entry())
        self._entry = entry
        self.choice = entry.choice
        if entry.choice == "eager":
            return self._eager(args, target, mask)
        if entry.choice == "captured":
            return self._captured(entry, args, target, mask)
        if entry.run is None:
            if len(entry.warm_s) < self.warmup_steps:
                return self._timed(entry.warm_s, self._eager, args, target, mask)
            return self._first_captured(entry, args, target, mask)
        # Alternate captured and eager steps, ROUNDS each, then decide on the medians.
        if len(entry.captured_s) <= len(entry.eager_s):
            loss = self._timed(entry.captured_s, self._captured, entry, args, target, mask)
        else:
            loss = self._timed(entry.eager_s, self._eager, args, target, mask)
        if len(entry.eager_s) >= ROUNDS:
            choice = self._agreed(entry)
            records = self._records_here()
            if records is not None and entry.key is not None:
                entry.noisy = not clear(entry.eager_s, entry.captured_s)
                if not entry.noisy:
                    records.write(entry.key, choice, *self._medians(entry))
            self._decide(entry, choice)
        return loss

    def _first_captured(
        self, entry: Entry, args: tuple, target: Any, mask: Tensor | None
    ) -> Tensor:
        """Captures the step, runs it, and takes a recorded choice where there is one."""
        failure = None
        try:
            captured = self._capture(args, target, mask)
            entry.run, entry.layout, entry.key = captured.run, captured.layout, captured.key
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
        records = self._records_here()
        record = None if records is None or entry.key is None else records.read(entry.key)
        if record is not None:  # an earlier run timed this graph on this machine
            entry.eager_s, entry.captured_s = [record["eager_s"]], [record["captured_s"]]
            entry.recorded = True
            self._decide(entry, record["choice"])
        return loss

    def _records_here(self) -> Records | None:
        if self._records is None:
            self._records = Records.here() or False
        return self._records or None

    def _agreed(self, entry: Entry) -> Choice:
        """``decide`` on the medians of every rank (the same table, so the same choice)."""
        return agree(self._exchange(self._medians(entry)))

    @staticmethod
    def _medians(entry: Entry) -> tuple[float, float]:
        """The eager step's median, and the captured step's as the eager median times the
        pairs' ratio (``_choice.ratio``): what this rank's choice was made on."""
        eager = statistics.median(entry.eager_s)
        return eager, eager * ratio(entry.eager_s, entry.captured_s)

    @property
    def eager_seconds(self) -> float | None:
        """The eager step's median time the latest signature's choice was made on."""
        e = self._entry
        return None if e is None or e.choice is None else median(e.eager_s)

    @property
    def captured_seconds(self) -> float | None:
        """The captured step's median time the latest signature's choice was made on."""
        e = self._entry
        return None if e is None or e.choice is None or not e.captured_s else self._medians(e)[1]

    @property
    def report(self) -> str:
        """What runs, and the timings and compile seconds it was decided on."""
        if self._why_not is not None:
            return f"eager step: {self._why_not}"
        lines = []
        for entry in self._entries.values():
            eager = median(entry.eager_s)
            captured = self._medians(entry)[1] if entry.eager_s and entry.captured_s else None
            compile_s = "-" if entry.compile_s is None else f"{entry.compile_s:.1f} s"
            how = "medians recorded by an earlier run" if entry.recorded else "medians"
            if entry.noisy:
                how += "; not clear, not recorded"
            lines.append(
                f"{entry.choice or 'deciding'}: eager step {ms(eager)}, captured step "
                f"{ms(captured)} ({how}), compile {compile_s}"
            )
        return "; ".join(lines) or "no step run yet"

    def _timed(self, into: list[float], fn: Callable[..., Tensor], *args: Any) -> Tensor:
        sync = synchronizer(self.stack)
        sync()
        start = self._clock()
        loss = fn(*args)
        sync()
        into.append(self._clock() - start)
        return loss

    def _decide(self, entry: Entry, choice: Choice) -> None:
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
        """What a graph is specialised on (``_signature``); None where a value cannot be a
        graph constant. The optimizer's parameters are compared by identity with the ones the
        entries were traced for, held here, and a change (``keep_members``) drops them all.
        """
        try:
            key = data_key(args, target)
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
        constants = graph_constants(self.stack, opt, params, self._groups)
        return (*key, mask is None, modes, self._keywords, *constants)

    def _warn_eager_once(self, reason: str) -> None:
        if reason not in self._eager_reasons:
            self._eager_reasons.add(reason)
            warn(f"{_WHERE}: {reason}; this call runs the eager step.", FallbackWarning)

    def _captured(self, entry: Entry, args: tuple, target: Any, mask: Tensor | None) -> Tensor:
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


def _reason(error: BaseException) -> str:
    """``Type: first line`` of the innermost cause (torch.compile wraps a backend's error)."""
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    return summary(error)
