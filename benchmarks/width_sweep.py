"""A sweep over 8 widths x 4 learning rates (32 members, MLP 64-w-w-10 on scikit-learn's digits)
trained three ways side by side in one process, on identical inputs:

- loop: 32 ``nn.Module`` s, each with its own ``torch.optim.Adam``, one after another;
- 8 stacks: one ``phalanx.stack`` per width (4 members each, per-member lr), one after another;
- one stack: ``phalanx.stack(models, pad_widths=True)``, all 32 members padded to the widest.

Each way runs ``--steps`` Adam steps on minibatches of ``--batch``; the ways take turns, one
step each, for ``--repeats`` rounds, and the median time of a step per way is reported, with
the ratios. The first rounds are warm-up. The padded stack's weights are then checked against
the loop's member by member (same init, same batches: they train the same models).

Usage::

    OMP_NUM_THREADS=1 flock /tmp/bench.lock python benchmarks/width_sweep.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import phalanx

WIDTHS = [16, 32, 48, 64, 96, 128, 192, 256]
LRS = [3e-4, 1e-3, 3e-3, 1e-2]


def member(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--widths", type=int, nargs=8, default=WIDTHS)
    args = parser.parse_args()
    widths = args.widths
    torch.set_num_threads(1)
    digits = load_digits()
    X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    Y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, len(X), (args.batch,), generator=g) for _ in range(args.repeats)]

    torch.manual_seed(0)
    configs = [(w, lr) for w in widths for lr in LRS]  # member i: width w, learning rate lr
    models = [member(w) for w, _ in configs]
    n = len(models)

    loop_models = [copy.deepcopy(m) for m in models]
    loop_opts = [
        torch.optim.Adam(m.parameters(), lr=lr) for m, (_, lr) in zip(loop_models, configs)
    ]

    def loop_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        for m, o in zip(loop_models, loop_opts):
            o.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            o.step()

    groups = [[i for i, (w, _) in enumerate(configs) if w == width] for width in widths]
    per_width = [phalanx.stack([models[i] for i in g], backend=args.backend) for g in groups]
    per_width_opts = [
        phalanx.optim.Adam(s.parameters(), lr=torch.tensor([configs[i][1] for i in g]))
        for s, g in zip(per_width, groups)
    ]

    def stacks_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        for s, o in zip(per_width, per_width_opts):
            o.zero_grad()
            phalanx.member_losses(F.cross_entropy, s(xb), yb).sum().backward()
            o.step()

    padded = phalanx.stack(models, pad_widths=True, backend=args.backend)
    padded_opt = phalanx.optim.Adam(padded.parameters(), lr=torch.tensor(LRS * len(widths)))

    def padded_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        padded_opt.zero_grad()
        phalanx.member_losses(F.cross_entropy, padded(xb), yb).sum().backward()
        padded_opt.step()

    # The cost of padding itself: 32 members all at the widest width, one plain stack.
    widest = phalanx.stack([member(max(widths)) for _ in range(n)], backend=args.backend)
    widest_opt = phalanx.optim.Adam(widest.parameters(), lr=torch.tensor(LRS * len(widths)))

    def widest_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        widest_opt.zero_grad()
        phalanx.member_losses(F.cross_entropy, widest(xb), yb).sum().backward()
        widest_opt.step()

    ways = {
        "loop": loop_step,
        "8 stacks": stacks_step,
        "one padded stack": padded_step,
        "32 at the widest": widest_step,
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r, index in enumerate(batches):
        xb, yb = X[index], Y[index]
        for name, step in ways.items():
            start = time.perf_counter()
            step(xb, yb)
            if r >= args.warmup:
                times[name].append(time.perf_counter() - start)

    worst = 0.0
    yardstick = 0.0  # the 8 unpadded stacks' own distance from the loop: float rounding
    assert padded.padding is not None
    for i, m in enumerate(loop_models):
        g = next(j for j, group in enumerate(groups) if i in group)
        row = groups[g].index(i)
        for name, p in m.named_parameters():
            got = padded.module.get_parameter(name)[i][padded.padding.corner(name, i)]
            worst = max(worst, (got - p).abs().max().item())
            own = per_width[g].module.get_parameter(name)[row]
            yardstick = max(yardstick, (own - p).abs().max().item())
    loop_ms = statistics.median(times["loop"]) * 1e3
    print(
        f"{n} members: widths {widths} x lrs {LRS}, batch {args.batch}, "
        f"{len(times['loop'])} timed steps each, one thread, backend={args.backend!r} "
        f"(padded stack runs {padded.backend!r})"
    )
    print(f"{'way':>18} {'ms/step':>9} {'speed-up vs loop':>17}")
    for name, t in times.items():
        ms = statistics.median(t) * 1e3
        print(f"{name:>18} {ms:>9.2f} {loop_ms / ms:>16.2f}x")
    print(
        f"largest |padded stack - loop| over all weights after {args.repeats} steps: "
        f"{worst:.2e} (the 8 stacks': {yardstick:.2e})"
    )


if __name__ == "__main__":
    main()
