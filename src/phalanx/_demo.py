"""``phalanx demo``: a real training run of a population of networks on scikit-learn's digits."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import phalanx


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--members", type=int, default=8, help="number of networks (default 8)")
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)


def load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits (1,797 images, 64 inputs, 10 classes), split 75/25."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise SystemExit(
            "phalanx demo needs scikit-learn for its data set: pip install 'phalanx[demo]'"
        ) from e
    data = sk_load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.75 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def _members(n: int, hidden: int, seed: int) -> list[nn.Module]:
    members = []
    for i in range(n):
        torch.manual_seed(seed + i)
        members.append(nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10)))
    return members


def _train(
    stack: phalanx.Stack,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    per_member: bool,
    epochs: int,
    batch_size: int,
    seed: int,
    label: str,
) -> float:
    from tqdm.auto import tqdm

    n = len(stack)
    opt = torch.optim.Adam(stack.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    steps = len(x) // batch_size
    start = time.perf_counter()
    with tqdm(total=epochs * steps, desc=label, unit="step", leave=True) as bar:
        for _ in range(epochs):
            if per_member:  # every member its own order: (N, len(x)) indices
                order = torch.argsort(torch.rand(n, len(x), generator=g), dim=1)
            else:
                order = torch.randperm(len(x), generator=g)
            for s in range(steps):
                idx = order[..., s * batch_size : (s + 1) * batch_size]
                if per_member:
                    out = stack(x[idx], in_dims=0)  # (N, B, 64) -> (N, B, 10)
                    losses = phalanx.member_losses(F.cross_entropy, out, y[idx], in_dims=(0, 0))
                else:
                    out = stack(x[idx])  # (B, 64) -> (N, B, 10)
                    losses = phalanx.member_losses(F.cross_entropy, out, y[idx])
                opt.zero_grad()
                losses.sum().backward()
                opt.step()
                bar.update()
            bar.set_postfix(mean_loss=f"{losses.mean().item():.3f}")
    return time.perf_counter() - start


def _report(stack: phalanx.Stack, x: torch.Tensor, y: torch.Tensor, label: str) -> None:
    stack.eval()
    with torch.no_grad():
        logits = stack(x)  # (N, B, 10)
    accuracy = (logits.argmax(-1) == y).float().mean(dim=1)  # (N,)
    ensemble = (logits.softmax(-1).mean(0).argmax(-1) == y).float().mean()
    print(f"\n{label}: test accuracy per member")
    print("  " + "  ".join(f"#{i}: {a:.3f}" for i, a in enumerate(accuracy.tolist())))
    print(f"  mean member {accuracy.mean():.3f}   ensemble (mean of softmax) {ensemble:.3f}")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    x_train, y_train, x_test, y_test = load_digits()
    print(
        f"phalanx demo: {args.members} networks 64-{args.hidden}-10 on scikit-learn digits "
        f"({len(x_train)} train / {len(x_test)} test images), {args.epochs} epochs, "
        f"batch {args.batch_size}"
    )
    for per_member, label in [
        (False, "(a) shared minibatches"),
        (True, "(b) per-member minibatches"),
    ]:
        stack = phalanx.stack(_members(args.members, args.hidden, args.seed))
        seconds = _train(
            stack,
            x_train,
            y_train,
            per_member=per_member,
            epochs=args.epochs,
            batch_size=args.batch_size,
            seed=args.seed,
            label=label,
        )
        _report(stack, x_test, y_test, label)
        print(f"  trained in {seconds:.1f} s with backend {stack.backend!r}")
    return 0
