"""The real-model suite: models as people publish them, checked against the loop, then timed.

Each :class:`RealModel` wraps one class of :mod:`zoo` with what a
training step needs: a member factory, a batch builder (one batch shared by every member, or
one batch per member), the loss its authors train it with, and the mode ``phalanx bench``
times it in.

- :func:`check_against_loop` runs a phalanx stack (any backend) and the loop over the N
  original modules side by side, and compares, member by member: outputs, per-member losses,
  parameter gradients, input gradients (float inputs), optionally the gradient of an
  input-gradient penalty (second derivatives), and the parameters and buffers after several
  Adam steps (``phalanx.optim.Adam`` on the stack, ``torch.optim.Adam`` per member).
  Tolerances are earned, not tuned: the same loop is also run in float64, and the stack's
  error against it may be at most :data:`FACTOR` times the float32 loop's own error (plus a
  few ulps of the tensor's scale, for results the float32 loop happens to get exactly),
  the largest over runs with each member's samples in several orders
  (``phalanx.testing.row_orders``; :func:`row_order_problems` checks, in float64, that the
  order changes nothing but rounding).
- :func:`time_model` times one training step (forward, loss, backward, Adam step) of the
  stack (``auto``) against the loop with ``torch.optim.Adam()``, the loop with
  ``torch.optim.Adam(fused=True)`` (which isolates the gain from batching) and torch.func's
  ensembling recipe, interleaved, in one process, on identical inputs.

Run it with ``python -m phalanx_tools.bench.real_suite --members 16 --threads 1``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import phalanx
from phalanx_tools._zoo import load as _load_zoo

rm = _load_zoo()

Mode = Literal["shared", "per-member"]

#: The stack's error against the float64 loop: phalanx.testing's rule.
FACTOR, FLOOR_ULPS = phalanx.testing.FACTOR, phalanx.testing.FLOOR_ULPS
#: Learning rate of every Adam.
LR = 1e-3
#: Adam moves an element by lr * g / (|g| + eps): where |g| comes near eps (1e-8), the
#: update's sensitivity to g, lr * eps / (|g| + eps)^2, magnifies the gradient's last-bit
#: rounding up to lr itself, so one float32 run is no yardstick for another there. The
#: parameters after Adam steps are compared where the float64 loop's gradient stayed above
#: 100 eps at every step, where that magnification is at most lr / (1e4 eps) = 10x (the same
#: cut as the W-workloads' check in suite.py). The gradients themselves are compared everywhere.
TINY_GRADIENT = 1e-6

Args = tuple[Any, ...]
Draw = Callable[[int, torch.Generator], tuple[Args, Any]]
Reorder = Callable[[Args, Any, torch.Tensor], tuple[Args, Any]]


def _rows(args: Args, target: Any, order: torch.Tensor) -> tuple[Args, Any]:
    """One member's batch with its rows (dim 0 of every input and of the target) in ``order``."""

    def take(t: Any) -> Any:
        return t[order] if isinstance(t, torch.Tensor) else t

    return tuple(take(a) for a in args), take(target)


@dataclass(frozen=True)
class RealModel:
    """One model class from public code and how it is trained.

    Attributes:
        name: short id, e.g. "td3_critic".
        source: where the class comes from, "owner/repo path".
        build: makes one member with the current RNG state (``make`` seeds it).
        draw: ``(batch size, generator) -> (inputs, target)`` for one member; the target is
            whatever ``loss`` takes (None when the output is the loss itself).
        loss: ``(one member's output, its target) -> scalar``, as the model's authors train it.
        batch: the batch size the suite times with.
        mode: the input mode the suite times with.
        second_order: an MLP-like model on which second derivatives are checked.
        flop_counted: a model whose step is mostly GEMMs and convolutions, so that its share
            of the measured GEMM peak means something.
        noisy: its forward draws random numbers (``torch.randn_like``); checks replace them
            by a fixed function of the input (see :func:`fixed_noise`).
        reorder: ``(inputs, target, order) -> (inputs, target)``, one member's batch with its
            samples in ``order`` (a permutation of the batch size): the float32 loop's other
            summation orders (``phalanx.testing.row_orders``). By default dim 0 of every
            tensor; :func:`row_order_problems` checks that it changes nothing but rounding.
    """

    name: str
    source: str
    build: Callable[[], nn.Module]
    draw: Draw
    loss: Callable[[Any, Any], torch.Tensor]
    batch: int
    mode: Mode = "shared"
    second_order: bool = False
    flop_counted: bool = True
    noisy: bool = False
    reorder: Reorder = _rows

    def make(self, i: int, seed: int = 0) -> nn.Module:
        """Member i, initialised from seed 1000 * seed + i."""
        torch.manual_seed(1000 * seed + i)
        member = self.build()
        # BatchNorm starts every member with the same statistics: make them differ, so
        # that a backend mixing members' buffers shows.
        with torch.no_grad():
            for b in member.buffers():
                if b.is_floating_point():
                    b.add_(0.1 * (i + 1))
        return member


# ----------------------------------------------------------------------------- inputs, losses


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _classes(g: torch.Generator, n: int, b: int) -> torch.Tensor:
    return torch.randint(n, (b,), generator=g)


def _image(c: int, side: int, classes: int = 10) -> Draw:
    return lambda b, g: ((_randn(g, b, c, side, side),), _classes(g, classes, b))


def _state_action(b: int, g: torch.Generator) -> tuple[Args, Any]:
    return (_randn(g, b, 17), _randn(g, b, 6)), _randn(g, b, 1)


def _sequence(b: int, g: torch.Generator) -> tuple[Args, Any]:
    return (_randn(g, b, 24, 4),), _randn(g, b, 1)


def _tokens(vocab: int, t: int) -> Draw:
    def draw(b: int, g: torch.Generator) -> tuple[Args, Any]:
        idx = torch.randint(vocab, (b, t + 1), generator=g)
        return (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()), None

    return draw


def _bags(vocab: int, length: int) -> Draw:
    """The text tutorial's collate_batch: B texts of ``length`` tokens, concatenated."""

    def draw(b: int, g: torch.Generator) -> tuple[Args, Any]:
        text = torch.randint(vocab, (b * length,), generator=g)
        offsets = torch.arange(0, b * length, length)
        return (text, offsets), _classes(g, 4, b)

    return draw


def _bag_rows(args: Args, target: Any, order: torch.Tensor) -> tuple[Args, Any]:
    """:func:`_bags`' batch with its texts in ``order`` (all of one length: same offsets)."""
    text, offsets = args
    return (text.view(len(offsets), -1)[order].reshape(-1), offsets), target[order]


def _td3_critic_loss(q: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    # sfujim/TD3 TD3.py: critic_loss = F.mse_loss(current_Q1, target_Q) + F.mse_loss(...)
    return F.mse_loss(q[0], target) + F.mse_loss(q[1], target)


def _gaussian_nll(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    # mbrl-lib mbrl/util/math.py gaussian_nll(reduce=True), as GaussianMLP._nll_loss uses it.
    mean, logvar = out
    losses = F.mse_loss(mean, target, reduction="none") * (-logvar).exp() + logvar
    return losses.sum(dim=1).mean() * 0.5


def _edac_critic_loss(q_values: torch.Tensor, q_target: torch.Tensor) -> torch.Tensor:
    # tinkoff-ai/CORL edac.py EDAC._critic_loss, the TD part.
    return ((q_values - q_target.view(1, -1)) ** 2).mean(dim=1).sum(dim=0)


def _vae_loss(out: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    # pytorch/examples vae/main.py loss_function: reconstruction + KL divergence.
    recon_x, mu, logvar = out
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def _gpt_loss(out: tuple[torch.Tensor, torch.Tensor], _: Any) -> torch.Tensor:
    return out[1]  # nanoGPT's forward(idx, targets) returns (logits, loss)


def _vae_draw(b: int, g: torch.Generator) -> tuple[Args, Any]:
    x = torch.rand(b, 1, 28, 28, generator=g)
    return (x,), x


def _transformer_draw(b: int, g: torch.Generator) -> tuple[Args, Any]:
    return (_randn(g, b, 16, 64),), _randn(g, b, 16, 64)


_GPT = rm.GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=64)
_TEXT_VOCAB = (
    10_000  # 2.6 MB per member: the stacked gradient at N=16 passes glibc's mmap threshold
)

MODELS: dict[str, RealModel] = {
    m.name: m
    for m in [
        RealModel(
            "simple_mlp",
            "pytorch/tutorials intermediate_source/ensembling.py",
            rm.SimpleMLP,
            _image(1, 28),
            F.cross_entropy,
            batch=64,
            second_order=True,
        ),
        RealModel(
            "simple_cnn",
            "pytorch/tutorials intermediate_source/per_sample_grads.py",
            rm.SimpleCNN,
            _image(1, 28),
            F.nll_loss,
            batch=8,
        ),
        RealModel(
            "lenet",
            "kuangliu/pytorch-cifar models/lenet.py",
            rm.LeNet,
            _image(3, 32),
            F.cross_entropy,
            batch=32,
        ),
        RealModel(
            "resnet_basicblock",
            "kuangliu/pytorch-cifar models/resnet.py (BasicBlock)",
            lambda: rm.SmallResNet(rm.BasicBlock, [1, 1], widths=(16, 32)),
            _image(3, 16),
            F.cross_entropy,
            batch=16,
        ),
        RealModel(
            "td3_critic",
            "sfujim/TD3 TD3.py (Critic)",
            lambda: rm.Critic(17, 6),
            _state_action,
            _td3_critic_loss,
            batch=256,
            mode="per-member",
            second_order=True,
        ),
        RealModel(
            "td3_actor",
            "sfujim/TD3 TD3.py (Actor)",
            lambda: rm.Actor(17, 6, 1.0),
            lambda b, g: ((_randn(g, b, 17),), torch.tanh(_randn(g, b, 6))),
            F.mse_loss,
            batch=256,
            mode="per-member",
            second_order=True,
        ),
        RealModel(
            "mbrl_gaussian_mlp",
            "facebookresearch/mbrl-lib mbrl/models/gaussian_mlp.py",
            lambda: rm.GaussianMLP(23, 18, hid_size=200),
            lambda b, g: ((_randn(g, b, 23),), _randn(g, b, 18)),
            _gaussian_nll,
            batch=256,
            mode="per-member",
            second_order=True,
        ),
        RealModel(
            "edac_critic",
            "tinkoff-ai/CORL algorithms/offline/edac.py (VectorizedCritic)",
            lambda: rm.VectorizedCritic(17, 6, 256, num_critics=2),
            _state_action,
            _edac_critic_loss,
            batch=128,
            second_order=True,
        ),
        RealModel(
            "nanogpt",
            "karpathy/nanoGPT model.py (GPT, tied lm_head)",
            lambda: rm.GPT(_GPT),
            _tokens(_GPT.vocab_size, _GPT.block_size),
            _gpt_loss,
            batch=8,
            flop_counted=False,
        ),
        RealModel(
            "transformer_encoder_layer",
            "pytorch/pytorch torch/nn/modules/transformer.py (nn.TransformerEncoderLayer)",
            lambda: nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
            _transformer_draw,
            F.mse_loss,
            batch=16,
            flop_counted=False,
        ),
        RealModel(
            "lstm_forecaster",
            "yunjey/pytorch-tutorial tutorials/02-intermediate/recurrent_neural_network/main.py",
            lambda: rm.RNN(4, 32, 2, 1),
            _sequence,
            F.mse_loss,
            batch=32,
            flop_counted=False,
        ),
        RealModel(
            "gru_forecaster",
            "GRU forecaster (ours, in the form of public time-series posts)",
            lambda: rm.GRUModel(4, 32, 2, 1, 0.0),
            _sequence,
            F.mse_loss,
            batch=32,
            flop_counted=False,
        ),
        RealModel(
            "text_embeddingbag",
            "pytorch/tutorials beginner_source/text_sentiment_ngrams_tutorial.py",
            lambda: rm.TextClassificationModel(_TEXT_VOCAB, 64, 4),
            _bags(_TEXT_VOCAB, 16),
            F.cross_entropy,
            batch=64,
            flop_counted=False,
            reorder=_bag_rows,
        ),
        RealModel(
            "vae",
            "pytorch/examples vae/main.py",
            rm.VAE,
            _vae_draw,
            _vae_loss,
            batch=64,
            second_order=True,
            noisy=True,
        ),
    ]
}


@dataclass
class Batch:
    """Inputs and targets for N members in one input mode.

    ``args`` are the stack's positional inputs, ``in_dims`` says which carry the member axis;
    ``member_args(i)`` and ``member_target(i)`` are what member i sees in the loop.
    """

    args: Args
    in_dims: tuple[int | None, ...]
    target: Any
    target_dim: int | None

    def member_args(self, i: int) -> Args:
        return tuple(a if d is None else a[i] for a, d in zip(self.args, self.in_dims))

    def member_target(self, i: int) -> Any:
        if self.target is None or self.target_dim is None:
            return self.target
        return self.target[i]

    def to(self, dtype: torch.dtype) -> Batch:
        def cast(t: Any) -> Any:
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return Batch(tuple(cast(a) for a in self.args), self.in_dims, cast(self.target),
                     self.target_dim)  # fmt: skip


def make_batch(model: RealModel, n: int, mode: Mode, *, batch: int, seed: int = 0) -> Batch:
    """One batch shared by the N members, or N batches stacked on a new dim 0."""
    g = torch.Generator().manual_seed(10_000 + seed)
    if mode == "shared":
        args, target = model.draw(batch, g)
        return Batch(args, (None,) * len(args), target, None)
    draws = [model.draw(batch, g) for _ in range(n)]
    args = tuple(torch.stack(col) for col in zip(*(d[0] for d in draws)))
    target = None if draws[0][1] is None else torch.stack([d[1] for d in draws])
    return Batch(args, (0,) * len(args), target, None if target is None else 0)


class _FixedNoise(TorchFunctionMode):
    """``torch.randn_like(x)`` becomes ``cos(5 x)``: elementwise, so every backend and the
    loop draw the same "noise" whatever the batch layout, and the run is exact-comparable."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.randn_like:
            return torch.cos(5.0 * args[0].detach())
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fixed_noise(active: bool) -> Iterator[None]:
    """Replaces ``torch.randn_like`` by a fixed function of its input while ``active``."""
    if not active:
        yield
        return
    with _FixedNoise():
        yield


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Forecasters build h0 with torch.zeros(...) in the default dtype: the float64 loop needs it.
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def stack_losses(model: RealModel, out: Any, batch: Batch) -> torch.Tensor:
    """The (N,) per-member losses of the stack's output (a tensor, or a tuple or
    ``ModelOutput`` the authors' loss reads whole), never mixing members."""
    return phalanx.member_losses(model.loss, out, batch.target, in_dims=(0, batch.target_dim))


# ------------------------------------------------------------------------- the check


@dataclass
class CheckReport:
    """What :func:`check_against_loop` found.

    Attributes:
        backend: the backend the stack ran (what ``auto`` chose).
        problems: one line per tensor that is further from the float64 loop than the float32
            loop is, member by member; empty when the stack is exact.
        warnings: warnings raised while the stack ran (``auto`` says when it falls back).
    """

    backend: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _float_inputs(batch: Batch) -> tuple[Batch, list[torch.Tensor]]:
    """A copy of the batch whose float inputs are fresh leaves that require grad."""
    leaves: list[torch.Tensor] = []
    args = []
    for a in batch.args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.detach().clone().requires_grad_()
            leaves.append(a)
        args.append(a)
    return Batch(tuple(args), batch.in_dims, batch.target, batch.target_dim), leaves


def _loop_forward(members: Sequence[Callable[..., Any]], model: RealModel, batch: Batch,
                  order: torch.Tensor | None = None) -> Any:  # fmt: skip
    """The loop's outputs and (N,) losses; with ``order``, each member's samples in that order
    (outputs then in that order too; input gradients come back in the batch's own)."""
    outs, losses = [], []
    for i, m in enumerate(members):
        args, target = batch.member_args(i), batch.member_target(i)
        if order is not None:
            args, target = model.reorder(args, target, order)
        outs.append(m(*args))
        losses.append(model.loss(outs[-1], target))
    return pytree.tree_map(lambda *leaves: torch.stack(leaves), *outs), torch.stack(losses)


def _stack_forward(stack: phalanx.Stack, model: RealModel, batch: Batch) -> Any:
    out = stack(*batch.args, in_dims=batch.in_dims)
    return out, stack_losses(model, out, batch)


def _param_names(member: nn.Module) -> list[str]:
    return [name for name, p in member.named_parameters() if p.requires_grad]


def _loop_grads(members: list[nn.Module], names: list[str]) -> dict[str, torch.Tensor]:
    def grad(m: nn.Module, name: str) -> torch.Tensor:
        p = m.get_parameter(name)
        return torch.zeros_like(p) if p.grad is None else p.grad

    return {name: torch.stack([grad(m, name) for m in members]) for name in names}


def _stack_state(stack: phalanx.Stack, what: str) -> dict[str, torch.Tensor]:
    items = stack.named_parameters() if what == "params" else stack.named_buffers()
    return {k.removeprefix("module."): v for k, v in items}


def _member_state(members: list[nn.Module], what: str) -> dict[str, torch.Tensor]:
    first = members[0].named_parameters() if what == "params" else members[0].named_buffers()
    get = nn.Module.get_parameter if what == "params" else nn.Module.get_buffer
    return {name: torch.stack([get(m, name).detach() for m in members]) for name, _ in first}


def _observe(forward: Callable[[Batch], tuple[Any, torch.Tensor]], batch: Batch,
             second_order: bool) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """Runs forward and backward; returns output leaves, losses and input gradients.

    With ``second_order`` the backward pass is that of the squared norm of the input
    gradient (taken with ``create_graph=True``), so parameter gradients are second
    derivatives; otherwise that of the sum of the per-member losses.
    """
    batch, leaves = _float_inputs(batch)
    out, losses = forward(batch)
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    input_grads: list[torch.Tensor] = []
    if leaves:
        input_grads = list(
            torch.autograd.grad(losses.sum(), leaves, retain_graph=True, create_graph=second_order)
        )
    if second_order:
        sum(g.pow(2).sum() for g in input_grads).backward()  # type: ignore[union-attr]
    else:
        losses.sum().backward()
    return [t.detach() for t in outputs], losses.detach(), [g.detach() for g in input_grads]


def _compare(what: str, got: torch.Tensor, loop: torch.Tensor | Sequence[torch.Tensor],
             ref: torch.Tensor, per_member: bool) -> list[str]:  # fmt: skip
    """Problems where ``got`` is further from ``ref`` (float64) than the float32 ``loop`` (or
    the furthest of several runs of it) is: ``phalanx.testing``'s rule, member by member where
    ``per_member``."""
    return phalanx.testing.rounding_problems(got, loop, ref, what=what, per_member=per_member)


@dataclass
class _Run:
    """One run of :func:`check_against_loop`: what the stack or one loop gave."""

    first: tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]  # step 0: outputs,
    # losses, input gradients
    grads: dict[str, torch.Tensor]  # step 0: parameter gradients, zeros where None
    after: dict[str, dict[str, torch.Tensor]]  # "params" and "buffers" after the steps
    tiny: dict[str, torch.Tensor]  # where a gradient was below TINY_GRADIENT at some step


def _run(model: RealModel, forward: Callable[[Batch], Any], opt: Any, batches: list[Batch],
         grads: Callable[[], dict[str, torch.Tensor]],
         state: Callable[[str], dict[str, torch.Tensor]], second_order: bool) -> _Run:  # fmt: skip
    """``steps`` Adam steps of the stack or of one loop, one per batch."""
    first: Any = None
    step0: dict[str, torch.Tensor] = {}
    tiny: dict[str, torch.Tensor] = {}
    with fixed_noise(model.noisy):
        for step, data in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            seen = _observe(forward, data, second_order)
            g = grads()
            for name, t in g.items():
                small = t.abs() < TINY_GRADIENT
                tiny[name] = tiny[name] | small if name in tiny else small
            if step == 0:
                first, step0 = seen, {k: t.clone() for k, t in g.items()}
            opt.step()
    return _Run(first, step0, {w: state(w) for w in ("params", "buffers")}, tiny)


class _Opts:
    """One ``torch.optim.Adam`` per member of a loop, zeroed and stepped together."""

    def __init__(self, members: list[nn.Module]):
        self.opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in members]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def _loop_run(model: RealModel, members: list[nn.Module], batches: list[Batch],
              dtype: torch.dtype, order: torch.Tensor | None, second_order: bool) -> _Run:  # fmt: skip
    """The loop over copies of ``members`` in ``dtype``, each member's samples in ``order``."""
    loop = [copy.deepcopy(m).to(dtype) for m in members]
    names = _param_names(members[0])
    with _default_dtype(dtype):
        return _run(
            model, lambda b: _loop_forward(loop, model, b, order), _Opts(loop),
            [b.to(dtype) for b in batches], lambda: _loop_grads(loop, names),
            lambda what: _member_state(loop, what), second_order,
        )  # fmt: skip


def _batches(
    model: RealModel, n: int, mode: Mode, batch: int, steps: int, seed: int
) -> list[Batch]:
    return [make_batch(model, n, mode, batch=batch, seed=seed + step) for step in range(steps)]


def check_against_loop(model: RealModel, backend: str, n: int, mode: Mode, *, batch: int = 4,
                       steps: int = 3, second_order: bool = False, seed: int = 0) -> CheckReport:  # fmt: skip
    """A phalanx stack against the loop over the N original modules, member by member.

    Runs from the same weights on the same inputs: the stack (float32), the loop in float64
    (the reference), and the loop in float32 :data:`phalanx.testing.ORDERS` times, each
    member's samples as given and permuted (``phalanx.testing.row_orders``): one float32 run
    is one draw of its rounding, the yardstick is the largest. Compared: per-member losses,
    input gradients, parameter gradients (of the losses' sum; or, with ``second_order``, of
    the squared norm of the input gradient), then, after ``steps`` Adam steps on fresh batches
    (``phalanx.optim.Adam`` on the stack, one ``torch.optim.Adam`` per member in the loops),
    parameters and buffers; and the output leaves, against the float32 loop as given alone
    (their rows follow the order). See the module docstring for the tolerance.

    Args:
        model: the model.
        backend: any phalanx backend name ("auto", "fused", "vmap", "loop").
        n: the number of members.
        mode: "shared" or "per-member" input.
        batch: the batch size (per member with per-member input).
        steps: Adam steps before the parameters are compared (at least 1).
        second_order: check second derivatives instead of the plain gradients.
        seed: seeds weights, batches and the row orders.

    Returns:
        The report; its ``problems`` are empty when the stack is exact.

    Raises:
        Whatever the stack raises: a refusal or a crash is not a mismatch.
    """
    members = [model.make(i, seed) for i in range(n)]
    batches = _batches(model, n, mode, batch, steps, seed)
    names = _param_names(members[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stack = phalanx.stack([copy.deepcopy(m) for m in members], backend=backend)
        got = _run(
            model, lambda b: _stack_forward(stack, model, b),
            phalanx.optim.Adam(stack.parameters(), lr=LR), batches,
            lambda: {k: _grad(p) for k, p in _stack_state(stack, "params").items() if k in names},
            lambda what: {k: v.detach() for k, v in _stack_state(stack, what).items()},
            second_order,
        )  # fmt: skip
        ref = _loop_run(model, members, batches, torch.float64, None, second_order)
        runs = [
            _loop_run(model, members, batches, torch.float32, order, second_order)
            for order in phalanx.testing.row_orders(batch, seed=seed)
        ]
    problems = _first_step_problems(got.first, [r.first for r in runs], ref.first, batches[0])
    for name in names:
        problems += _compare(f"gradient of {name!r}", got.grads[name],
                             [r.grads[name] for r in runs], ref.grads[name], per_member=True)  # fmt: skip
    for what in ("params", "buffers"):
        for name, want in ref.after[what].items():
            tiny = ref.tiny.get(name)  # see TINY_GRADIENT
            problems += _compare(
                f"{what[:-1]} {name!r} after {steps} Adam steps",
                _untiny(got.after[what][name], want, tiny),
                [_untiny(r.after[what][name], want, tiny) for r in runs], want, per_member=True,
            )  # fmt: skip
    notes = list(dict.fromkeys(str(w.message).splitlines()[0] for w in caught))
    return CheckReport(stack.backend, problems, notes)


def _untiny(t: torch.Tensor, ref: torch.Tensor, tiny: torch.Tensor | None) -> torch.Tensor:
    """``t`` with the reference's values where a gradient was tiny (see TINY_GRADIENT)."""
    return t if tiny is None else torch.where(tiny, ref.to(t.dtype), t)


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def _first_step_problems(got: Any, runs: list[Any], f64: Any, data: Batch) -> list[str]:
    (out, losses, xg), (out64, losses64, xg64) = got, f64
    out32 = runs[0][0]  # the outputs' rows follow the order: the run as given alone
    problems = []
    if len(out) != len(out32):
        return [f"the output has {len(out)} tensors, the loop's {len(out32)}"]
    for k, (a, b, c) in enumerate(zip(out, out32, out64)):
        problems += _compare(f"output {k}", a, b, c, per_member=True)
    problems += _compare("loss", losses, [r[1] for r in runs], losses64, per_member=True)
    float_dims = [d for a, d in zip(data.args, data.in_dims) if a.is_floating_point()]
    for k, (c, d) in enumerate(zip(xg64, float_dims)):
        problems += _compare(f"input {k} gradient", xg[k], [r[2][k] for r in runs], c,
                             per_member=d == 0)  # fmt: skip
    return problems


def row_order_problems(model: RealModel, n: int, mode: Mode, *, batch: int = 4, steps: int = 3,
                       second_order: bool = False, seed: int = 0) -> list[str]:  # fmt: skip
    """Where the float64 loop depends on its samples' order by more than rounding.

    :func:`check_against_loop` takes the float32 loop in several row orders as its yardstick,
    which is sound only where the order changes nothing in exact arithmetic (mean and sum
    losses, BatchNorm statistics, per-sample layers: yes; dropout or other per-sample random
    draws: no). This runs the float64 loop as given and in the other orders and reports every
    compared tensor (losses, input and parameter gradients, parameters and buffers after the
    steps) that moved by more than 1% of a float32 ulp of its magnitude (at least 1): float64
    rounding stays far below that, a changed computation does not.
    """
    members = [model.make(i, seed) for i in range(n)]
    batches = _batches(model, n, mode, batch, steps, seed)
    orders = phalanx.testing.row_orders(batch, seed=seed)
    ref, *others = [
        _loop_run(model, members, batches, torch.float64, order, second_order) for order in orders
    ]
    eps = torch.finfo(torch.float32).eps
    problems = []
    for order, run in zip(orders[1:], others):
        pairs = [("loss", run.first[1], ref.first[1])]
        pairs += [(f"input {k} gradient", a, b) for k, (a, b) in
                  enumerate(zip(run.first[2], ref.first[2]))]  # fmt: skip
        pairs += [(f"gradient of {k!r}", run.grads[k], ref.grads[k]) for k in ref.grads]
        for what in ("params", "buffers"):
            pairs += [(f"{what[:-1]} {k!r} after {steps} Adam steps", run.after[what][k], t)
                      for k, t in ref.after[what].items() if t.is_floating_point()]  # fmt: skip
        for what, a, b in pairs:
            diff = (a - b).abs().max().item()
            allowed = 0.01 * eps * max(b.abs().max().item(), 1.0)
            if not diff <= allowed:
                problems.append(f"{what}: samples in order {order.tolist()} move it by "
                                f"{diff:.3g} in float64 (allowed {allowed:.2g})")  # fmt: skip
    return problems


# ------------------------------------------------------------------------------- the timing

#: phalanx with ``phalanx.optim.Adam(fused=True)``: the fused-Adam loop's optimizer arithmetic.
FUSED = "phalanx fused-Adam"

#: The contenders of :func:`time_model`, in the table's order.
CONTENDERS = (
    "loop",
    "loop fused-Adam",
    "loop+compile",
    "torch.func",
    "phalanx",
    "phalanx fused-Adam",
    "compile_step",
)
#: Contenders whose step keeps no ``.grad``: checked on their losses alone.
_WHOLE_STEP = ("compile_step",)


class _Step:
    """One contender's training step: forward, per-member losses, backward, Adam step."""

    def __init__(
        self,
        kind: str,
        members: list[nn.Module],
        model: RealModel,
        batch: Batch,
        compile_backend: str = "inductor",
    ):
        self.kind, self.model, self.batch = kind, model, batch
        members = [copy.deepcopy(m) for m in members]
        self.stack: phalanx.Stack | None = None
        self.opt: torch.optim.Optimizer
        self.compiled: Any = None
        if kind in ("loop", "loop fused-Adam", "loop+compile"):
            self.members = nn.ModuleList(members)
            fused = True if kind != "loop" else None
            self.opt = torch.optim.Adam(self.members.parameters(), lr=LR, fused=fused)
            # loop+compile: what a user after speed writes, each member torch.compile'd (one
            # graph, compiled once, serves every member of one architecture) with fused Adam
            self.calls = (
                [torch.compile(m, backend=compile_backend) for m in members]
                if kind == "loop+compile"
                else members
            )
        elif kind == "compile_step":
            from phalanx_tools.bench.contenders import phalanx_adam

            # fused=True, as the fused-Adam loop it is compared with: the graph ends at the
            # gradients and torch's fused kernel applies them (member i bit for bit its
            # Adam(fused=True) given the graph's gradients)
            self.stack = phalanx.stack(members, backend="auto")
            self.opt = phalanx_adam()[0](self.stack.parameters(), lr=LR, fused=True)
            self.compiled = phalanx.compile_step(
                self.stack, model.loss, self.opt, in_dims=batch.in_dims,
                target_in_dims=batch.target_dim, backend=compile_backend,
            )  # fmt: skip
            start = {k: v.clone() for k, v in self.stack.state_dict().items()}
            while self.compiled.choice is None:  # warm up until it chose captured or eager
                self.compiled(batch.args, batch.target)
            with torch.no_grad():  # then back to the start, as every other contender
                for k, v in self.stack.state_dict().items():
                    v.copy_(start[k])
                self.opt.state.clear()
        elif kind == "torch.func":
            self.params, self.buffers = torch.func.stack_module_state(members)
            self.base = copy.deepcopy(members[0]).to("meta")
            self.opt = torch.optim.Adam(self.params.values(), lr=LR)
        else:
            from phalanx_tools.bench.contenders import phalanx_adam

            # "phalanx": phalanx.optim.Adam's default, member i bit for bit torch's default
            # Adam (the "loop" row's optimizer); "phalanx fused-Adam": fused=True, member i bit
            # for bit torch.optim.Adam(fused=True) (the fused-Adam loop's and loop+compile's).
            self.stack = phalanx.stack(members, backend="auto")
            extra = {"fused": True} if kind == "phalanx fused-Adam" else {}
            self.opt = phalanx_adam()[0](self.stack.parameters(), lr=LR, **extra)

    def losses(self) -> torch.Tensor:
        """Zero the gradients, forward, backward; the (N,) losses."""
        b = self.batch
        if self.compiled is not None:  # the whole step: forward, backward and the update
            return self.compiled(b.args, b.target)
        self.opt.zero_grad(set_to_none=True)
        if self.stack is not None:
            losses = _stack_forward(self.stack, self.model, b)[1]
        elif self.kind == "torch.func":

            def member(params: dict, buffers: dict, target: Any, *args: Any) -> torch.Tensor:
                out = torch.func.functional_call(self.base, (params, buffers), args)
                return self.model.loss(out, target)

            dims = (0, 0, b.target_dim, *b.in_dims)
            losses = torch.func.vmap(member, in_dims=dims, randomness="different")(
                self.params, self.buffers, b.target, *b.args
            )
        else:
            losses = _loop_forward(self.calls, self.model, b)[1]
        losses.sum().backward()
        return losses.detach()

    def grads(self) -> dict[str, torch.Tensor]:
        if self.compiled is not None:
            return {}
        if self.stack is not None:
            return {k: v.grad for k, v in _stack_state(self.stack, "params").items()
                    if v.grad is not None}  # fmt: skip
        if self.kind == "torch.func":
            return {k: v.grad for k, v in self.params.items() if v.grad is not None}
        names = _param_names(self.members[0])
        return _loop_grads(list(self.members), names)

    def __call__(self) -> None:
        self.losses()
        if self.compiled is None:
            self.opt.step()


@dataclass
class ModelTiming:
    """One model's row of the real-model table. Times in seconds per training step.

    ``status`` per contender: "ok" (checked and timed), "n/a: reason" (raised) or
    "WRONG: reason" (disagrees with the loop). ``median_s`` and ``iqr_s`` (first and third
    quartiles) are over the interleaved rounds, per contender timed. ``gflop`` is the GEMM and convolution work of
    one step of all N members (torch's FlopCounterMode on one member's forward and backward,
    times N; None where the step is not mostly GEMMs).
    """

    name: str
    source: str
    mode: str
    members: int
    batch: int
    backend: str = "-"
    status: dict[str, str] = field(default_factory=dict)
    median_s: dict[str, float] = field(default_factory=dict)
    iqr_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    gflop: float | None = None
    outside: float | None = None  # share of phalanx's step spent outside the batched kernels
    params: int = 0  # trainable parameters of all N members
    compile_choice: str | None = None  # what compile_step chose: "captured" or "eager"

    def ceiling_s(self, gemm_gflops: float, bandwidth_gbs: float) -> float | None:
        """The loop's kernels at the machine's measured limits: the step's GEMM and convolution
        FLOPs at the GEMM rate plus the optimizer's traffic (Adam reads parameter, gradient
        and both moments and writes three of them: 28 bytes per float32 parameter) at the copy
        bandwidth. Elementwise activations, norms and launches are left out, so no contender
        doing the members' arithmetic can be faster; None where the step is not mostly GEMMs."""
        if self.gflop is None:
            return None
        return self.gflop / gemm_gflops + 28 * self.params / (bandwidth_gbs * 1e9)

    def speedup(self, baseline: str, contender: str = "phalanx") -> float | None:
        """The baseline's median time over the contender's: above 1, the contender is faster."""
        if contender not in self.median_s or baseline not in self.median_s:
            return None
        return self.median_s[baseline] / self.median_s[contender]

    def share_of_peak(self, contender: str, gemm_gflops: float) -> float | None:
        if self.gflop is None or contender not in self.median_s:
            return None
        return self.gflop / self.median_s[contender] / gemm_gflops


def step_gflop(model: RealModel, member: nn.Module, batch: Batch, n: int) -> float | None:
    """GEMM and convolution GFLOP of one training step (forward and backward) of N members."""
    if not model.flop_counted:
        return None
    from torch.utils.flop_counter import FlopCounterMode

    m = copy.deepcopy(member)
    counter = FlopCounterMode(display=False)
    with counter:
        model.loss(m(*batch.member_args(0)), batch.member_target(0)).backward()
    return counter.get_total_flops() * n / 1e9


# The kernels that do the members' arithmetic in one call for all of them: GEMMs,
# convolutions, embeddings, normalisations, recurrent layers, attention and the fused Adam.
_BATCHED_KERNELS = re.compile(
    r"aten::(b?mm|baddbmm|addmm|addbmm|_?convolution.*|mkldnn_convolution.*|.*conv.*d|"
    r"embedding.*|_embedding_bag.*|native_batch_norm.*|native_layer_norm.*|"
    r"native_group_norm.*|.*lstm.*|.*gru.*|.*rnn.*|_scaled_dot_product.*|_fused_adam.*|"
    r"_fused_adamw.*|bmm_backward.*|threshold_backward|tanh_backward|sigmoid_backward)$"
)


def outside_share(step: Callable[[], None], repeats: int = 5) -> float:
    """The share of a step's wall time spent outside the batched kernels.

    torch.profiler's self CPU time of the kernels that do the members' arithmetic, against
    the wall time of ``repeats`` steps under the profiler: what is left is Python, the
    dispatcher, autograd, small elementwise kernels and the profiler's own overhead (so the
    share is an upper bound).
    """
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        wall = time.perf_counter() - start
    inside = sum(
        e.self_cpu_time_total for e in prof.key_averages() if _BATCHED_KERNELS.match(e.key)
    )
    return max(0.0, 1.0 - inside / 1e6 / wall)


def _agree(got: Any, expected: Any) -> str | None:
    try:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    except AssertionError as e:
        return " ".join(str(e).split())[:200]
    return None


def time_model(
    model: RealModel, n: int, settings: Any, *, seed: int = 0, compile_backend: str = "inductor"
) -> ModelTiming:
    """Checks, then times, a training step of N members: phalanx (auto) against the baselines.

    Every contender starts from the same members and runs on the same batch. Before timing,
    each one's per-member losses and gradients of one step are compared with the loop's
    (float32, rtol 1e-4 / atol 1e-5: a guard that the timed code computes the right thing;
    :func:`check_against_loop` is the exactness test); one that raises is "n/a", one that
    disagrees "WRONG", and neither is timed. The rest are timed round by round, interleaved
    (:func:`phalanx_tools.bench.timing.interleaved`).

    Args:
        model: the model.
        n: the number of members.
        settings: rounds and budget, e.g. ``phalanx_tools.bench.suite.QUICK`` or ``FULL``.
        seed: seeds weights and data.
        compile_backend: ``torch.compile``'s backend for loop+compile and compile_step
            ("aot_eager" captures without generating code: quick, for tests).

    Returns:
        The row: auto's backend, each contender's status and median time, the step's GFLOP.
    """
    from phalanx_tools.bench.suite import reason_of
    from phalanx_tools.bench.timing import interleaved

    members = [model.make(i, seed) for i in range(n)]
    batch = make_batch(model, n, model.mode, batch=model.batch, seed=seed)
    row = ModelTiming(model.name, model.source, model.mode, n, model.batch)
    row.gflop = step_gflop(model, members[0], batch, n)
    row.params = n * sum(p.numel() for p in members[0].parameters() if p.requires_grad)
    steps: dict[str, _Step] = {}
    expected: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
    for kind in CONTENDERS:
        try:
            with warnings.catch_warnings(), fixed_noise(model.noisy):
                warnings.simplefilter("ignore")
                step = _Step(kind, members, model, batch, compile_backend)
                got = step.losses(), {k: g.clone() for k, g in step.grads().items()}
        except Exception as e:
            row.status[kind] = f"n/a: {reason_of(e)}"
            continue
        if expected is None:
            expected = got
        problem = _agree(got[0], expected[0]) if kind in _WHOLE_STEP else _agree(got, expected)
        row.status[kind] = f"WRONG: {problem}" if problem else "ok"
        if not problem:
            steps[kind] = step
        if step.compiled is not None:
            row.compile_choice = step.compiled.choice
    if "phalanx" in steps and steps["phalanx"].stack is not None:
        row.backend = steps["phalanx"].stack.backend
    s = settings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timings = interleaved(
            dict(steps.items()),
            device=torch.device("cpu"),
            rounds=s.rounds,
            min_rounds=s.min_rounds,
            warmup=s.warmup,
            target_s=s.target_s,
            budget_s=s.budget_s,
        )
    row.median_s = {k: t.median for k, t in timings.items()}
    row.iqr_s = {k: t.iqr for k, t in timings.items()}
    if "phalanx" in steps:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row.outside = outside_share(steps["phalanx"])
    return row


# ---------------------------------------------------------------------------- the command


def format_table(
    rows: list[ModelTiming], gemm_gflops: float, bandwidth_gbs: float | None = None
) -> str:
    """The real-model table: auto's backend, times, speed-ups, shares of the GEMM peak and
    the ceiling (``ModelTiming.ceiling_s``; with ``bandwidth_gbs``)."""
    from phalanx_tools.bench.report import fmt_time, text_table

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    def share(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.0f}%"

    headers = ["model", "input", "auto ran", "loop", "loop fused-Adam", "loop+compile",
               "torch.func", "phalanx", "phalanx fused-Adam", "compile_step", "vs loop",
               "vs fused-Adam loop", "fused-Adam vs fused-Adam loop",
               "fused-Adam vs loop+compile", "vs torch.func", "compile_step vs fused-Adam loop",
               "loop % peak", "phalanx % peak", "phalanx outside kernels", "ceiling",
               "fused-Adam / ceiling"]  # fmt: skip
    cells = []
    for r in rows:
        times = [fmt_time(r.median_s.get(k)) if r.status.get(k) == "ok" else
                 r.status.get(k, "-").split(":")[0] for k in CONTENDERS]  # fmt: skip
        if r.compile_choice and r.status.get("compile_step") == "ok":
            times[CONTENDERS.index("compile_step")] += f" ({r.compile_choice})"
        ceiling = None if bandwidth_gbs is None else r.ceiling_s(gemm_gflops, bandwidth_gbs)
        over = r.median_s.get(FUSED)  # the ceiling counts Adam as one pass, as the fused kernel
        step_vs = (
            r.median_s["loop fused-Adam"] / r.median_s["compile_step"]
            if "compile_step" in r.median_s and "loop fused-Adam" in r.median_s
            else None
        )
        cells.append(
            [
                r.name,
                f"{r.mode} B={r.batch}",
                r.backend,
                *times,
                ratio(r.speedup("loop")),
                ratio(r.speedup("loop fused-Adam")),
                ratio(r.speedup("loop fused-Adam", FUSED)),
                ratio(r.speedup("loop+compile", FUSED)),
                ratio(r.speedup("torch.func")),
                ratio(step_vs),
                share(r.share_of_peak("loop", gemm_gflops)),
                share(r.share_of_peak("phalanx", gemm_gflops)),
                share(r.outside),
                "n/a" if ceiling is None else fmt_time(ceiling),
                "n/a" if ceiling is None or over is None else f"{over / ceiling:.1f}x",
            ]
        )
    lines = [text_table(headers, cells)]
    for contender, baseline, what in (
        ("phalanx", "loop", "phalanx against the loop (both torch's default Adam)"),
        ("phalanx", "loop fused-Adam", "phalanx (default Adam) against the fused-Adam loop"),
        (FUSED, "loop fused-Adam", "phalanx fused-Adam against the fused-Adam loop (one "
         "optimizer arithmetic: each member bit for bit torch's fused Adam)"),
        (FUSED, "loop+compile", "phalanx fused-Adam against the loop+compile"),
        ("compile_step", "loop fused-Adam", "compile_step against the fused-Adam loop"),
        ("compile_step", "loop+compile", "compile_step against the loop+compile"),
    ):  # fmt: skip
        known = [x for x in (r.speedup(baseline, contender) for r in rows) if x is not None]
        if known:
            mean = math.exp(sum(map(math.log, known)) / len(known))
            lines.append(
                f"geometric mean, {what}: {ratio(mean)} over {len(known)} models; "
                f"slowest {ratio(min(known))}; below 1.0x: {sum(x < 1 for x in known)}"
            )
    lines.append(
        f"fast path (fused) chosen for {sum(r.backend == 'fused' for r in rows)} of {len(rows)}"
    )
    for r in rows:
        for k in CONTENDERS:
            if r.status.get(k, "ok") != "ok":
                lines.append(f"{r.name} / {k}: {r.status[k]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m phalanx_tools.bench.real_suite``: check and time the real models."""
    import argparse
    import json
    from dataclasses import asdict

    from phalanx_tools.bench import hf_models
    from phalanx_tools.bench.machine import measure
    from phalanx_tools.bench.suite import FULL, QUICK
    from phalanx_tools.threads import intra_op_threads

    catalogue = {**MODELS, **{m.name: m for m in hf_models.hf_models()}}
    if hf_models.NOTE:
        print(hf_models.NOTE, flush=True)
    parser = argparse.ArgumentParser(prog="python -m phalanx_tools.bench.real_suite")
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--models", default=",".join(catalogue))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = [name for name in names if name not in catalogue]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(catalogue)}")
    with intra_op_threads(args.threads):
        machine = measure(torch.device("cpu"), quick=args.quick)
        print(machine.describe(), flush=True)
        rows = []
        for name in names:
            rows.append(time_model(catalogue[name], args.members, QUICK if args.quick else FULL))
            print(f"  {name}: done", flush=True)
    print(format_table(rows, machine.gemm_gflops, machine.bandwidth_gbs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.to_dict(), "rows": [asdict(r) for r in rows]}, f,
                      indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
