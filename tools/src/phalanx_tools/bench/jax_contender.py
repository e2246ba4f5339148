"""The JAX contender: ``jax.jit(jax.vmap(step))`` with optax's Adam, where jax is installed.

What a JAX user writes to train N models of one architecture at once: one member's step
(forward, loss, ``jax.value_and_grad``, ``optax.adam``'s update) mapped over the members with
``jax.vmap`` and compiled with ``jax.jit``. The members' weights are copied from the same
torch members every other contender starts from, the data is the same, the loss is the
workload's (mean over the batch), and ``optax.adam`` gets torch's defaults (lr 1e-3, betas
(0.9, 0.999), eps 1e-8), so the suite checks it against the loop like the other contenders:
the per-member losses and the weights after one step.

Each call is one step, waited for with ``block_until_ready``: the torch contenders run
synchronously on the CPU, and a step left running while the next contender is timed would
borrow that contender's time. XLA's CPU thread pool is sized when the backend starts, from the
``PJRT_NPROC`` environment variable; :func:`use_threads` sets it, so ``--threads 1`` gives
JAX one thread as it gives torch one.

The members are translated layer by layer: ``nn.Sequential`` of ``nn.Linear``, ``nn.ReLU``,
``nn.Tanh`` and ``nn.Flatten`` (the MLP workloads W1-W6); any other module raises
``NotImplementedError`` naming it, which the suite shows as "n/a".
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from phalanx_tools.bench.contenders import LR
from phalanx_tools.bench.workloads import Data, Workload

#: The translated layers: torch module type -> the name of the JAX operation.
_LAYERS: dict[type[nn.Module], str] = {
    nn.Linear: "linear",
    nn.ReLU: "relu",
    nn.Tanh: "tanh",
    nn.Flatten: "flatten",
}


def missing() -> str | None:
    """None when jax and optax can be imported, else the line saying the contender is skipped."""
    absent = [name for name in ("jax", "optax") if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    return (
        f"jax        contender skipped: {' and '.join(absent)} not installed "
        f"(pip install 'phalanx[bench]' or pip install jax optax)"
    )


def use_threads(count: int | None) -> None:
    """Sizes XLA's CPU thread pool: ``PJRT_NPROC`` = ``count``, read when JAX's CPU backend
    starts (the first JAX computation in the process); None leaves JAX's default (one thread
    per core). Call it before any JAX computation."""
    if count is not None:
        os.environ["PJRT_NPROC"] = str(count)


def describe() -> str:
    """One line for the bench's header: the versions and the threads JAX runs on."""
    try:
        import jax
        import optax

        backend = jax.default_backend()
    except Exception as e:  # installed but broken (a jaxlib that does not load): say so
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"jax        jax is installed but does not start ({reason}): its rows are n/a"
    threads = os.environ.get("PJRT_NPROC")
    pool = f"PJRT_NPROC={threads}" if threads else "one thread per core"
    return (
        f"jax        jax {jax.__version__}, optax {optax.__version__}, {backend} "
        f"({pool}): jax.jit(jax.vmap(step)) with optax.adam, blocked on every step"
    )


def torch_adam_defaults() -> dict[str, float]:
    """optax.adam's b1, b2 and eps set to ``torch.optim.Adam``'s defaults, read from torch.

    Raises:
        NotImplementedError: torch's Adam defaults to a weight decay, which optax.adam lacks.
    """
    defaults = torch.optim.Adam([torch.zeros(1)]).defaults
    if defaults["weight_decay"] or defaults["amsgrad"]:
        raise NotImplementedError(f"optax.adam has no counterpart of torch's Adam {defaults}")
    b1, b2 = defaults["betas"]
    return {"b1": b1, "b2": b2, "eps": defaults["eps"]}


def _translate(member: nn.Module) -> list[tuple[str, str]]:
    """(operation, parameter prefix) per layer of ``member``, or NotImplementedError."""
    if not isinstance(member, nn.Sequential):
        raise NotImplementedError(
            f"the JAX contender translates nn.Sequential members only, got {type(member).__name__}"
        )
    layers = []
    for name, layer in member.named_children():
        op = _LAYERS.get(type(layer))
        if op is None:
            raise NotImplementedError(
                f"the JAX contender has no translation of {type(layer).__name__} (layer "
                f"{name!r}); it translates {', '.join(t.__name__ for t in _LAYERS)}"
            )
        if isinstance(layer, nn.Flatten) and (layer.start_dim, layer.end_dim) != (1, -1):
            raise NotImplementedError(f"layer {name!r}: only nn.Flatten() with its defaults")
        layers.append((op, f"{name}."))
    return layers


class JaxRunner:
    """``jax.jit(jax.vmap(member_step))`` over the members, optax's Adam: see the module.

    A whole step per call, like the captured phalanx step: ``backward()`` runs it and returns
    the (N,) losses of the weights before it, ``step()`` does nothing, ``grads()`` is empty
    (the check compares the losses and the weights after the step), and ``state()`` is the
    stacked weights under the members' own names.
    """

    whole_step = True

    def __init__(self, members: list[nn.Module], data: Data, workload: Workload):
        import jax
        import jax.numpy as jnp
        import optax

        layers = _translate(members[0])
        if any(next(m.buffers(), None) is not None for m in members):
            raise NotImplementedError("the JAX contender translates members without buffers")
        states = [m.state_dict() for m in members]
        params = {
            k: jnp.asarray(torch.stack([s[k] for s in states]).detach().cpu().numpy())
            for k in states[0]
        }

        def forward(p: dict[str, Any], x: Any) -> Any:
            for op, prefix in layers:
                if op == "linear":
                    x = x @ p[prefix + "weight"].T
                    if prefix + "bias" in p:
                        x = x + p[prefix + "bias"]
                elif op == "relu":
                    x = jax.nn.relu(x)
                elif op == "tanh":
                    x = jnp.tanh(x)
                else:
                    x = x.reshape(x.shape[0], -1)
            return x

        classes = workload.loss == "cross_entropy"

        def loss(p: dict[str, Any], x: Any, t: Any) -> Any:
            out = forward(p, x)
            if classes:
                return optax.softmax_cross_entropy_with_integer_labels(out, t).mean()
            return jnp.mean((out - t) ** 2)

        adam = optax.adam(learning_rate=LR, **torch_adam_defaults())

        def member_step(p: dict[str, Any], state: Any, x: Any, t: Any) -> tuple[Any, Any, Any]:
            value, grads = jax.value_and_grad(loss)(p, x, t)
            updates, state = adam.update(grads, state, p)
            return optax.apply_updates(p, updates), state, value

        n, x, t = workload.num_members, data.x.cpu().numpy(), data.target.cpu().numpy()
        if classes:
            t = t.astype(np.int32)  # jax's default integers are 32-bit
        axis: int | None = {"shared": None, "per-member": 0, "sliced": 1}[workload.input_mode]
        if workload.input_mode == "sliced":  # (B, N * d) -> (B, N, d), mapped over dim 1
            x, t = x.reshape(x.shape[0], n, -1), t.reshape(t.shape[0], n, -1)
        self.x, self.t = jnp.asarray(x), jnp.asarray(t)
        self.params, self.opt_state = params, jax.vmap(adam.init)(params)
        mapped = jax.vmap(member_step, in_axes=(0, 0, axis, axis))
        start = time.perf_counter()
        step = jax.jit(mapped, donate_argnums=(0, 1))  # weights and moments updated in place
        self._step: Callable[..., tuple[Any, Any, Any]] = step.lower(
            self.params, self.opt_state, self.x, self.t
        ).compile()
        self._compile_s = time.perf_counter() - start

    def forward(self) -> torch.Tensor:
        raise NotImplementedError("the JAX contender times the training step only")

    def backward(self) -> torch.Tensor:
        self.params, self.opt_state, losses = self._step(
            self.params, self.opt_state, self.x, self.t
        )
        losses.block_until_ready()
        return torch.from_numpy(np.array(losses))  # (N,) floats: a copy costs nothing

    def step(self) -> None:
        pass  # backward() ran the whole step

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {}

    def state(self) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.array(v)) for k, v in self.params.items()}

    def compile_seconds(self) -> float:
        return self._compile_s

    def note(self) -> str:
        return ""
