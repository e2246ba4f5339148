"""The contenders: the same workload written as a loop, with torch.func, and with phalanx.

Each contender builds a :class:`Runner` from the members and the data. A runner owns its own
copy of the members' weights and its own optimizer, and exposes the two timed phases in
pieces, so that the suite can check a contender before timing it:

- ``forward()``: the members' outputs, in the workload's layout ((N, B, out), or (B, N * out)
  for a sliced input); the suite calls it under ``torch.no_grad()``.
- ``backward()``: zero the gradients, forward, per-member losses, backward of their sum;
  returns the (N,) losses. ``step()``: one Adam step. A training step is both.
- ``grads()`` and ``state()``: the gradients and the parameters and buffers, stacked
  ``(N, *shape)`` under the member's own names, to compare with the loop's.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

import phalanx
from phalanx import BACKENDS, compile_step
from phalanx_tools.bench.workloads import Data, Workload

#: Learning rate of every contender's Adam.
LR = 1e-3

OptimizerFactory = Callable[..., torch.optim.Optimizer]


class Runner(Protocol):
    """One contender, ready to run one workload. See the module docstring."""

    def forward(self) -> torch.Tensor: ...

    def backward(self) -> torch.Tensor: ...

    def step(self) -> None: ...

    def grads(self) -> dict[str, torch.Tensor | None]: ...

    def state(self) -> dict[str, torch.Tensor]: ...

    def note(self) -> str: ...


@dataclass(frozen=True)
class Contender:
    """A named way of running a workload.

    Attributes:
        name: shown in the table, e.g. "loop", "torch.func", "phalanx:vmap".
        kind: "baseline" (loop, torch.func) or "phalanx" (counted in phalanx's speed-ups).
        build: makes a runner from the members (not modified) and the data.
        train_only: runs only in the training phase (a captured training step).
    """

    name: str
    kind: Literal["baseline", "phalanx"]
    build: Callable[[list[nn.Module], Data, Workload], Runner]
    train_only: bool = False


def loss_function(workload: Workload) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The workload's per-member loss on one member's (B, out) output: mean over the batch."""
    return F.cross_entropy if workload.loss == "cross_entropy" else F.mse_loss


def phalanx_adam() -> tuple[OptimizerFactory, str]:
    """The Adam that phalanx contenders use, and a line that says which one it is.

    ``phalanx.optim.Adam`` when it can be imported; otherwise ``torch.optim.Adam`` with
    ``foreach=True``, which steps each stacked tensor once.
    """
    try:
        from phalanx.optim import Adam
    except Exception as e:  # an optimizer package being written may fail in any way
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        fallback = functools.partial(torch.optim.Adam, foreach=True)
        return fallback, f"torch.optim.Adam(foreach=True) (phalanx.optim.Adam: {reason})"
    return Adam, "phalanx.optim.Adam"


def _stacked(tensors_per_member: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([t[k] for t in tensors_per_member]) for k in tensors_per_member[0]}


class LoopRunner:
    """A Python loop over an ``nn.ModuleList``, one Adam over all members' parameters.

    This is the reference every other contender is checked against. Its Adam is
    ``torch.optim.Adam`` with its defaults, as a user writes it today (on a CPU that is the
    per-tensor implementation; on CUDA torch picks foreach by itself); with ``fused=True``
    (the "loop+fused" baseline) it is ``torch.optim.Adam(fused=True)``.
    """

    def __init__(
        self, members: list[nn.Module], data: Data, workload: Workload, *, fused: bool = False
    ):
        self.models = nn.ModuleList(copy.deepcopy(m) for m in members)
        self.data = data
        self.workload = workload
        self.loss_fn = loss_function(workload)
        # fused=True: torch's fused Adam kernel, one call over every member's tensors; the
        # loop+fused baseline separates the gain from batching from the gain of that kernel.
        self.optimizer = torch.optim.Adam(
            self.models.parameters(), lr=LR, fused=True if fused else None
        )
        n = workload.num_members
        x, t = data.x, data.target
        if workload.input_mode == "shared":
            self.inputs = [x] * n
            self.targets = [t] * n
        elif workload.input_mode == "per-member":
            self.inputs = list(x.unbind(0))
            self.targets = list(t.unbind(0))
        else:
            d, o = x.shape[1] // n, t.shape[1] // n
            self.inputs = [x[:, d * i : d * (i + 1)] for i in range(n)]
            self.targets = [t[:, o * i : o * (i + 1)] for i in range(n)]

    def forward(self) -> torch.Tensor:
        outs = [m(x) for m, x in zip(self.models, self.inputs)]
        return torch.cat(outs, 1) if self.workload.input_mode == "sliced" else torch.stack(outs)

    def backward(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        losses = torch.stack(
            [self.loss_fn(m(x), t) for m, x, t in zip(self.models, self.inputs, self.targets)]
        )
        losses.sum().backward()
        return losses.detach()

    def step(self) -> None:
        self.optimizer.step()

    def grads(self) -> dict[str, torch.Tensor | None]:
        # An unused parameter has no gradient: as a stacked tensor, its gradient is zero.
        grads = [
            {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in m.named_parameters()}
            for m in self.models
        ]
        return dict(_stacked(grads))

    def state(self) -> dict[str, torch.Tensor]:
        return _stacked([m.state_dict() for m in self.models])

    def note(self) -> str:
        return ""


class CompiledLoopRunner(LoopRunner):
    """The loop a user after speed writes: each member ``torch.compile``'d (one graph serves
    every member of one architecture: it is compiled once), ``torch.optim.Adam(fused=True)``."""

    def __init__(
        self,
        members: list[nn.Module],
        data: Data,
        workload: Workload,
        *,
        compile_backend: str = "inductor",
    ):
        super().__init__(members, data, workload, fused=True)
        self.calls = [torch.compile(m, backend=compile_backend) for m in self.models]

    def forward(self) -> torch.Tensor:
        outs = [m(x) for m, x in zip(self.calls, self.inputs)]
        return torch.cat(outs, 1) if self.workload.input_mode == "sliced" else torch.stack(outs)

    def backward(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        losses = torch.stack(
            [self.loss_fn(m(x), t) for m, x, t in zip(self.calls, self.inputs, self.targets)]
        )
        losses.sum().backward()
        return losses.detach()


class TorchFuncRunner:
    """PyTorch's ensembling recipe: ``stack_module_state`` + ``functional_call`` + ``vmap``.

    The stacked parameters are leaf tensors; a meta-device copy of member 0 supplies the
    architecture; ``torch.optim.Adam`` with its defaults steps the stacked tensors; gradients
    come from autograd on the sum of the per-member losses computed under ``vmap``.
    """

    def __init__(self, members: list[nn.Module], data: Data, workload: Workload):
        self.params, self.buffers = stack_module_state(members)
        self.base = copy.deepcopy(members[0]).to("meta")
        self.loss_fn = loss_function(workload)
        self.optimizer = torch.optim.Adam(self.params.values(), lr=LR)
        n, x, t = workload.num_members, data.x, data.target
        self.sliced = workload.input_mode == "sliced"
        self.x_dim: int | None
        self.t_dim: int | None
        if self.sliced:  # (B, N * d) -> (B, N, d), mapped over dim 1: a view, no copy
            self.x, self.x_dim = x.view(x.shape[0], n, -1), 1
            self.t, self.t_dim = t.view(t.shape[0], n, -1), 1
        else:
            shared = workload.input_mode == "shared"
            self.x, self.x_dim = x, None if shared else 0
            self.t, self.t_dim = t, None if shared else 0

    def _member(self, params: dict, buffers: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.base, (params, buffers), (x,))

    def _member_loss(self, params: dict, buffers: dict, x: torch.Tensor, t: torch.Tensor) -> Any:
        return self.loss_fn(self._member(params, buffers, x), t)

    def forward(self) -> torch.Tensor:
        out = vmap(self._member, in_dims=(0, 0, self.x_dim))(self.params, self.buffers, self.x)
        return out.movedim(0, 1).flatten(1) if self.sliced else out

    def backward(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        losses = vmap(self._member_loss, in_dims=(0, 0, self.x_dim, self.t_dim))(
            self.params, self.buffers, self.x, self.t
        )
        losses.sum().backward()
        return losses.detach()

    def step(self) -> None:
        self.optimizer.step()

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {k: p.grad for k, p in self.params.items()}

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in {**self.params, **self.buffers}.items()}

    def note(self) -> str:
        return ""


class PhalanxRunner:
    """``phalanx.stack(members, backend=...)`` trained with :func:`phalanx_adam`."""

    def __init__(
        self,
        members: list[nn.Module],
        data: Data,
        workload: Workload,
        *,
        backend: str,
        optimizer: OptimizerFactory,
    ):
        self.stack = phalanx.stack([copy.deepcopy(m) for m in members], backend=backend)
        self.requested = backend
        self.loss_fn = loss_function(workload)
        self.optimizer = optimizer(self.stack.parameters(), lr=LR)
        self.mode = workload.input_mode
        n, x, t = workload.num_members, data.x, data.target
        if self.mode == "sliced":
            self.x, self.t = phalanx.split(x, n, dim=1), phalanx.split(t, n, dim=1)
        else:
            self.x, self.t = x, t
        self.in_dims = None if self.mode == "shared" else 0

    def _outputs(self) -> torch.Tensor:
        return self.stack(self.x, in_dims=self.in_dims)

    def forward(self) -> torch.Tensor:
        out = self._outputs()
        return phalanx.merge(out, dim=1) if self.mode == "sliced" else out

    def backward(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        losses = phalanx.member_losses(
            self.loss_fn, self._outputs(), self.t, in_dims=(0, self.in_dims)
        )
        losses.sum().backward()
        return losses.detach()

    def step(self) -> None:
        self.optimizer.step()

    def grads(self) -> dict[str, torch.Tensor | None]:
        named = self.stack.named_parameters()
        return {k.removeprefix("module."): p.grad for k, p in named}

    def state(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("module."): v for k, v in self.stack.state_dict().items()}

    def note(self) -> str:
        return f"picked {self.stack.backend}" if self.requested == "auto" else ""


def _warm_up(
    compiled: Any, stack: nn.Module, optimizer: Any, x: torch.Tensor, t: torch.Tensor
) -> None:
    """Runs ``compile_step``'s warm-up (eager steps, the compilation, the timed steps) until it
    has chosen, then puts the weights back and zeroes the optimizer state: the check sees a
    step from the same state as every other contender's."""
    start = {k: v.clone() for k, v in stack.state_dict().items()}
    while compiled.choice is None:
        compiled(x, t)
    with torch.no_grad():
        for k, v in stack.state_dict().items():
            v.copy_(start[k])
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v.zero_()


class _WholeStep:
    """A contender whose ``backward()`` runs the whole training step (forward, loss,
    backward, update) and keeps no gradients: the check compares losses and the state after
    the step."""

    whole_step = True

    def step(self) -> None:
        pass  # backward() ran the whole step

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {}


class CompiledRunner(_WholeStep, PhalanxRunner):
    """``phalanx.compile_step``: the whole training step captured and compiled.

    The step decides by timing whether its captured graph beats the eager step, so it is
    warmed up when built (eager steps, the compilation, timed captured steps), and the weights
    and optimizer state are then put back, in place, to where they started: the check sees a
    step from the same state as every other contender's. The captured step keeps no
    gradients, so ``grads()`` is None and the check compares losses and the state after the
    step. Training only: its forward is the stack's.
    """

    def __init__(
        self,
        members: list[nn.Module],
        data: Data,
        workload: Workload,
        *,
        optimizer: OptimizerFactory,
        compile_backend: str = "inductor",
    ):
        super().__init__(members, data, workload, backend="auto", optimizer=optimizer)
        self.compiled = compile_step(
            self.stack, self.loss_fn, self.optimizer, in_dims=self.in_dims,
            backend=compile_backend,
        )  # fmt: skip
        _warm_up(self.compiled, self.stack, self.optimizer, self.x, self.t)

    def forward(self) -> torch.Tensor:
        raise NotImplementedError("compile_step captures the training step, not a forward pass")

    def backward(self) -> torch.Tensor:
        return self.compiled(self.x, self.t)

    def compile_seconds(self) -> float | None:
        return self.compiled.compile_seconds

    def note(self) -> str:
        return self.compiled.report


class TaughtRunner(_WholeStep):
    """The training step exactly as the README's tour writes it, and nothing more:
    ``phalanx.stack(members)``, ``phalanx.optim.Adam``, ``phalanx.member_losses`` of the
    workload's own torch loss, and ``phalanx.compile_step`` (``captured=True``) or the eager
    step a user writes from the same lines (``captured=False``). No backend, optimizer mode
    or compile option is chosen for it: what a user who follows the tour runs."""

    def __init__(
        self,
        members: list[nn.Module],
        data: Data,
        workload: Workload,
        *,
        captured: bool,
        compile_backend: str = "inductor",
    ):
        self.stack = phalanx.stack([copy.deepcopy(m) for m in members])
        self.optimizer = phalanx.optim.Adam(self.stack.parameters(), lr=LR)
        self.loss_fn = loss_function(workload)
        self.mode = workload.input_mode
        n, x, t = workload.num_members, data.x, data.target
        if self.mode == "sliced":
            self.x, self.t = phalanx.split(x, n, dim=1), phalanx.split(t, n, dim=1)
        else:
            self.x, self.t = x, t
        self.in_dims = None if self.mode == "shared" else 0
        self.captured = captured
        self.compiled = None
        if captured:
            kwargs: dict[str, Any] = (
                {} if compile_backend == "inductor" else {"backend": compile_backend}
            )
            self.compiled = phalanx.compile_step(
                self.stack, self.loss_fn, self.optimizer, in_dims=self.in_dims, **kwargs
            )
            _warm_up(self.compiled, self.stack, self.optimizer, self.x, self.t)

    def forward(self) -> torch.Tensor:
        raise NotImplementedError("the taught path is timed as a training step")

    def backward(self) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled(self.x, self.t)
        # the tour's eager step, as written there
        losses = phalanx.member_losses(
            self.loss_fn,
            self.stack(self.x, in_dims=self.in_dims),
            self.t,
            in_dims=(0, self.in_dims),
        )
        self.optimizer.zero_grad()
        losses.sum().backward()
        self.optimizer.step()
        return losses.detach()

    def state(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("module."): v for k, v in self.stack.state_dict().items()}

    def compile_seconds(self) -> float | None:
        return None if self.compiled is None else self.compiled.compile_seconds

    def note(self) -> str:
        if self.compiled is None:
            return f"eager step, backend {self.stack.backend}"
        return self.compiled.report


def default_contenders(
    optimizer: OptimizerFactory | None = None, *, compile_backend: str = "inductor"
) -> list[Contender]:
    """loop (the reference, first), loop+fused, loop+compile (training only), torch.func,
    every phalanx backend, phalanx auto, phalanx:compiled (the captured training step), taught
    and taught:eager (the README tour's step, captured and eager: :class:`TaughtRunner`) and,
    where jax and optax are installed, jax (``jax.jit(jax.vmap(step))`` with optax's Adam,
    training only: :mod:`phalanx_tools.bench.jax_contender`).

    Args:
        optimizer: the phalanx contenders' optimizer factory; :func:`phalanx_adam` by default.
        compile_backend: ``torch.compile``'s backend for phalanx:compiled and loop+compile
            ("aot_eager" checks the capture without generating code).

    Returns:
        The contenders, the loop first.
    """
    from phalanx_tools.bench import jax_contender  # it imports this module's LR

    factory = optimizer or phalanx_adam()[0]
    with_jax = jax_contender.missing() is None

    def phalanx_contender(backend: str) -> Contender:
        build = functools.partial(PhalanxRunner, backend=backend, optimizer=factory)
        return Contender(f"phalanx:{backend}", "phalanx", build)

    compiled = functools.partial(CompiledRunner, optimizer=factory, compile_backend=compile_backend)
    return [
        Contender("loop", "baseline", LoopRunner),
        Contender("loop+fused", "baseline", functools.partial(LoopRunner, fused=True)),
        Contender(
            "loop+compile",
            "baseline",
            functools.partial(CompiledLoopRunner, compile_backend=compile_backend),
            train_only=True,
        ),
        Contender("torch.func", "baseline", TorchFuncRunner),
        *(phalanx_contender(b) for b in (*BACKENDS, "auto")),
        Contender("phalanx:compiled", "phalanx", compiled, train_only=True),
        Contender(
            "taught",
            "phalanx",
            functools.partial(TaughtRunner, captured=True, compile_backend=compile_backend),
            train_only=True,
        ),
        Contender(
            "taught:eager",
            "phalanx",
            functools.partial(TaughtRunner, captured=False),
            train_only=True,
        ),
        *[Contender("jax", "baseline", jax_contender.JaxRunner, train_only=True)] * with_jax,
    ]
