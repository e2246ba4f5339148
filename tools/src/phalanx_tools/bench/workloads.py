"""The benchmark workloads W1 to W7 of DESIGN.md, as data, and the functions that build them.

A :class:`Workload` says what the members are, how many, the batch size and how the input
reaches them (shared, per-member or sliced). :func:`build` turns one into N members with
different weights plus inputs and targets, all from one seed, so that every contender sees
identical weights and data. :func:`cost` counts the FLOPs and bytes of one forward pass from
the layers themselves, for the GFLOP/s, fraction-of-peak and floor columns.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

InputMode = Literal["shared", "per-member", "sliced"]
LossKind = Literal["cross_entropy", "mse"]

#: Bytes per element: every workload runs in float32.
FLOAT_BYTES = 4


@dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    Attributes:
        id: "W1" to "W7".
        what: what the workload stands for, as in DESIGN.md.
        num_members: N.
        member: one-line description of a member's architecture.
        make_member: builds one member; called once per member under its own seed.
        batch: B, the batch size each member sees.
        input_mode: "shared" (x is (B, ...)), "per-member" (x is (N, B, ...)) or "sliced"
            (x is (B, N * d), member i reads columns d*i .. d*i + d).
        input_shape: one sample's shape as a member sees it, e.g. (10,) or (1, 28, 28).
        loss: "cross_entropy" on class indices or "mse" against a real target.
        out_features: the member's output width (number of classes for cross-entropy).
    """

    id: str
    what: str
    num_members: int
    member: str
    make_member: Callable[[], nn.Module]
    batch: int
    input_mode: InputMode
    input_shape: tuple[int, ...]
    loss: LossKind
    out_features: int

    def describe(self) -> str:
        """One line: id, what, N, member, B and input mode."""
        return (
            f"{self.id} {self.what}: N={self.num_members}, {self.member}, B={self.batch}, "
            f"{self.input_mode} input"
        )


def _mlp(sizes: tuple[int, ...], *, relu: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        layers: list[nn.Module] = []
        for k, (a, b) in enumerate(itertools.pairwise(sizes)):
            if k and relu:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(a, b))
        return nn.Sequential(*layers)

    return make


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(800, 10),
    )


WORKLOADS: dict[str, Workload] = {
    w.id: w
    for w in (
        Workload(
            "W1", "per-feature networks (question 1)", 400, "20-10-1, no activation",
            _mlp((20, 10, 1), relu=False), 32, "sliced", (20,), "mse", 1,
        ),
        Workload(
            "W2", "small ensemble, same batch (question 2a)", 8, "10-20-2, ReLU",
            _mlp((10, 20, 2), relu=True), 32, "shared", (10,), "cross_entropy", 2,
        ),
        Workload(
            "W3", "small ensemble, own batches (question 2b)", 8, "10-20-2, ReLU",
            _mlp((10, 20, 2), relu=True), 4, "per-member", (10,), "cross_entropy", 2,
        ),
        Workload(
            "W4", "MNIST-size MLP ensemble", 32, "784-256-256-10, ReLU",
            _mlp((784, 256, 256, 10), relu=True), 128, "shared", (784,), "cross_entropy", 10,
        ),
        Workload(
            "W5", "Q-function ensemble", 10, "64-256-256-1, ReLU",
            _mlp((64, 256, 256, 1), relu=True), 256, "per-member", (64,), "mse", 1,
        ),
        Workload(
            "W6", "hyperparameter sweep of tiny nets", 2048, "8-64-64-1, ReLU",
            _mlp((8, 64, 64, 1), relu=True), 64, "shared", (8,), "mse", 1,
        ),
        Workload(
            "W7", "CNN ensemble with BatchNorm", 16,
            "conv(1-16,3)-BN-ReLU-pool-conv(16-32,3)-BN-ReLU-pool-Linear(800-10)",
            _cnn, 64, "shared", (1, 28, 28), "cross_entropy", 10,
        ),
    )
}  # fmt: skip


@dataclass
class Data:
    """A workload's inputs and targets, in the layout its input mode prescribes.

    Attributes:
        x: (B, ...) shared, (N, B, ...) per-member, or (B, N * d) sliced.
        target: matches ``x``'s mode: (B,) or (B, out) shared; (N, B) or (N, B, out)
            per-member; (B, N * out) sliced.
    """

    x: torch.Tensor
    target: torch.Tensor


def build(
    workload: Workload, *, device: torch.device | str, seed: int = 0
) -> tuple[list[nn.Module], Data]:
    """Builds the workload's N members and its data, reproducibly.

    Member i is initialised under seed ``seed + i``; BatchNorm running statistics are made to
    differ between members, so that a backend mixing members cannot pass the checks.

    Args:
        workload: the workload.
        device: where the members and the data live.
        seed: the base seed.

    Returns:
        The N members (in train mode) and the data.
    """
    members = []
    for i in range(workload.num_members):
        torch.manual_seed(seed + i)
        member = workload.make_member()
        with torch.no_grad():
            for buffer in member.buffers():
                if buffer.is_floating_point():
                    buffer.add_(torch.rand_like(buffer) * 0.1 * (1 + i % 7))
        members.append(member.to(device))

    generator = torch.Generator().manual_seed(seed + 10_000)
    n, b, out = workload.num_members, workload.batch, workload.out_features
    lead: tuple[int, ...] = (n, b) if workload.input_mode == "per-member" else (b,)
    if workload.input_mode == "sliced":
        (width,) = workload.input_shape
        x = torch.randn(b, n * width, generator=generator)
        target = torch.randn(b, n * out, generator=generator)
    else:
        x = torch.randn(*lead, *workload.input_shape, generator=generator)
        if workload.loss == "cross_entropy":
            target = torch.randint(0, out, lead, generator=generator)
        else:
            target = torch.randn(*lead, out, generator=generator)
    return members, Data(x.to(device), target.to(device))


@dataclass(frozen=True)
class Cost:
    """Analytic cost of one forward pass of all N members.

    Conventions: a Linear or Conv layer costs 2 * (multiply-adds) FLOPs, biases, norms,
    activations and pooling are not counted; a training step counts 3x the forward FLOPs
    (forward, then the input and the weight gradient). Bytes are a lower bound on memory
    traffic: a forward reads the parameters and the input and writes every layer's output
    once; a training step moves 3x that, plus Adam's 7 passes over the parameters (read
    parameter, gradient and both moments; write parameter and both moments).

    Attributes:
        flops: FLOPs of one forward pass of all members.
        bytes: bytes moved by one forward pass of all members (lower bound).
        params: parameters of all members together.
    """

    flops: int
    bytes: int
    params: int

    def for_phase(self, phase: str) -> tuple[int, int]:
        """(FLOPs, bytes) of one call of ``phase``: "forward" or "train"."""
        if phase == "forward":
            return self.flops, self.bytes
        return 3 * self.flops, 3 * self.bytes + 7 * FLOAT_BYTES * self.params


def cost(workload: Workload) -> Cost:
    """Counts a forward pass's FLOPs and bytes by running one member on meta tensors.

    Args:
        workload: the workload.

    Returns:
        The cost of one forward pass of all N members together.
    """
    member = workload.make_member().to("meta")
    flops = 0
    activations = 0

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal flops, activations
        if isinstance(module, nn.Linear):
            flops += 2 * module.in_features * output.numel()
        elif isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            flops += 2 * (module.in_channels // module.groups) * kh * kw * output.numel()
        activations += output.numel()

    handles = [m.register_forward_hook(hook) for m in member.modules() if not list(m.children())]
    member(torch.empty(workload.batch, *workload.input_shape, device="meta"))
    for h in handles:
        h.remove()
    n = workload.num_members
    params = n * sum(p.numel() for p in member.parameters())
    inputs = workload.batch * torch.Size(workload.input_shape).numel()
    inputs *= 1 if workload.input_mode == "shared" else n
    moved = FLOAT_BYTES * (params + inputs + n * activations)
    return Cost(flops=n * flops, bytes=moved, params=params)
