"""``phalanx bench --optimizer``: one optimizer step, phalanx against torch over the loop's tensors.

Two workloads, each a stack of N members and the N members' own tensors (the loop's), with
the same values and the same gradients:

- ``embedding``: 16 members of a (95812, 64) embedding table (an optimizer-bound step: 392 MB
  per stacked tensor).
- ``W4``: W4's MLP (784-256-256-10), 32 members.
- ``W2``: W2's MLP (10-20-2), 8 members (a step of launches; ``--workloads W2``).
- ``tiny-N``: N tiny members (8-64-64-1 MLPs, 4,801 elements each), N = 16, 256, 4096, and
  16384 without ``--quick``: where a step over the loop's tensors pays per tensor.

For Adam and SGD (momentum 0.9), side by side in one process, contenders interleaved round
by round (``timing.interleaved``): torch's fused kernel over the loop's tensors (one
``torch.optim`` optimizer holding every member's tensors, ``fused=True``), torch's default
single-tensor arithmetic over them (``foreach=False``; not for tiny members, where it is
Python per tensor), torch's fused kernel on the stacked tensors (the torch.func recipe's
step), ``phalanx.optim`` on the stacked tensors, and ``phalanx.optim`` with ``fused=True``;
below a stack of 2**26 elements also the default mode with per-member learning rates and with
per-member betas (Adam) or momentum (SGD), against the same torch steps with shared values.
Each time is given over torch's fused kernel on the loop's tensors and on the stacked tensors.
Before the timing, one step of each phalanx mode is compared with its torch reference member
by member (``bits``: "equal" when every member is bit for bit torch's).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

import phalanx
from phalanx_tools.bench.report import fmt_time, text_table
from phalanx_tools.bench.timing import interleaved

WORKLOADS: dict[str, tuple[int, list[tuple[int, ...]]]] = {
    "embedding": (16, [(95812, 64)]),
    "W4": (32, [(256, 784), (256,), (256, 256), (256,), (10, 256), (10,)]),
    "W2": (8, [(20, 10), (20,), (2, 20), (2,)]),  # tiny: Python per tensor, not arithmetic
}
TINY = [(64, 8), (64,), (64, 64), (64,), (1, 64), (1,)]  # an 8-64-64-1 MLP
for _n in (16, 256, 4096, 16384):
    WORKLOADS[f"tiny-{_n}"] = (_n, TINY)
QUICK_TINY = "tiny-16,tiny-256,tiny-4096"
#: the per-member variants' values: (N,) tensors spread around the shared ones
PER_MEMBER: dict[str, dict[str, str]] = {
    "Adam": {"lr per member": "lr", "betas per member": "betas"},
    "SGD": {"lr per member": "lr", "momentum per member": "momentum"},
}
LABELS = ("torch fused", "torch default", "torch fused stacked", "phalanx", "phalanx fused=True")
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Adam": {"lr": 1e-3},
    "SGD": {"lr": 1e-2, "momentum": 0.9},
}


def _contenders(
    n: int, shapes: list[tuple[int, ...]], name: str, kwargs: dict[str, Any]
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """The four steps of one workload and optimizer, and each phalanx mode's bits."""
    g = torch.Generator().manual_seed(0)
    stacked = [torch.nn.Parameter(torch.randn(n, *s, generator=g)) for s in shapes]
    stacked_grads = [torch.randn(p.shape, generator=g) for p in stacked]
    for p, gr in zip(stacked, stacked_grads, strict=True):
        p.grad = gr
    fns: dict[str, Callable[[], object]] = {}
    loops = {}
    references: tuple[tuple[str, dict[str, bool]], ...] = (("torch fused", {"fused": True}),)
    if shapes != TINY:  # Python per tensor over 6 N tensors: minutes a step at 16384
        references += (("torch default", {"foreach": False}),)
    for label, extra in references:
        tensors = [torch.nn.Parameter(p[i].detach().clone()) for p in stacked for i in range(n)]
        grads = [gr[i] for gr in stacked_grads for i in range(n)]
        for t, gr in zip(tensors, grads, strict=True):
            t.grad = gr.clone()
        opt = getattr(torch.optim, name)(tensors, **kwargs, **extra)
        fns[label] = opt.step
        loops[label] = tensors
    bits = {}
    for label, fused, ref in (
        ("phalanx", False, "torch default"),
        ("phalanx fused=True", True, "torch fused"),
    ):
        params = [torch.nn.Parameter(p.detach().clone()) for p in stacked]
        for p, gr in zip(params, stacked_grads, strict=True):
            p.grad = gr.clone()
        try:
            opt = getattr(phalanx.optim, name)(params, **kwargs, fused=fused)
        except TypeError as e:  # an older phalanx without fused= for this optimizer
            bits[label] = f"n/a ({e})"
            continue
        if ref not in fns:  # tiny members: no single-tensor loop to compare with
            bits[label], fns[label] = "-", opt.step
            continue
        # One step of each, from the same values: every member's bits against the reference.
        opt.step()
        fns[ref]()
        loop = iter(loops[ref])
        same = all(torch.equal(p[i], next(loop)) for p in params for i in range(n))
        bits[label] = "equal" if same else "differ"
        fns[label] = opt.step
    whole = [torch.nn.Parameter(p.detach().clone()) for p in stacked]
    for p, gr in zip(whole, stacked_grads, strict=True):
        p.grad = gr.clone()
    fns["torch fused stacked"] = getattr(torch.optim, name)(whole, **kwargs, fused=True).step
    if sum(p.numel() for p in stacked) < 1 << 26:
        params = [torch.nn.Parameter(p.detach().clone()) for p in stacked]
        for p, gr in zip(params, stacked_grads, strict=True):
            p.grad = gr.clone()
        for label, key in PER_MEMBER.get(name, {}).items():
            spread = 1 + torch.linspace(0, 1, n, dtype=torch.float64)
            ours = dict(kwargs)
            if key == "lr":
                ours["lr"] = kwargs["lr"] * spread
            elif key == "betas":
                ours["betas"] = (0.9 - 0.05 * (spread - 1), 0.999 - 0.0005 * (spread - 1))
            else:
                ours[key] = kwargs[key] * (1 - 0.05 * (spread - 1))
            fns[f"phalanx {label}"] = getattr(phalanx.optim, name)(params, **ours).step
    return fns, bits


def run(names: list[str], optimizers: list[str], quick: bool) -> list[dict[str, Any]]:
    """Times every contender; one row per workload, optimizer and contender."""
    rows = []
    for workload in names:
        n, shapes = WORKLOADS[workload]
        for name in optimizers:
            fns, bits = _contenders(n, shapes, name, OPTIMIZERS[name])
            timings = interleaved(
                fns,
                device=torch.device("cpu"),
                rounds=5 if quick else 15,
                min_rounds=3 if quick else 7,
                warmup=1 if quick else 2,
                target_s=0.05 if quick else 0.2,
                budget_s=10.0 if quick else 60.0,
            )
            base = timings["torch fused"].median
            stacked = timings["torch fused stacked"].median
            labels = [*LABELS, *(f"phalanx {k}" for k in PER_MEMBER.get(name, {}))]
            for label in labels:
                t = timings.get(label)
                if t is None and label == "torch default" and workload.startswith("tiny"):
                    continue
                rows.append(
                    {
                        "workload": f"{workload} ({n} x {' + '.join(map(str, shapes))})"
                        if label == "torch fused"
                        else "",
                        "optimizer": name,
                        "contender": label,
                        "median_s": None if t is None else t.median,
                        "vs_torch_fused": None if t is None else t.median / base,
                        "vs_torch_fused_stacked": None if t is None else t.median / stacked,
                        "bits": bits.get(label, ""),
                    }
                )
            del fns
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    headers = [
        "workload",
        "optimizer",
        "contender",
        "time",
        "x torch fused (loop's tensors)",
        "x torch fused (stacked)",
        "bits",
    ]
    cells = [
        [
            r["workload"],
            r["optimizer"],
            r["contender"],
            fmt_time(r["median_s"]),
            "-" if r["vs_torch_fused"] is None else f"{r['vs_torch_fused']:.2f}x",
            "-" if r["vs_torch_fused_stacked"] is None else f"{r['vs_torch_fused_stacked']:.2f}x",
            r["bits"],
        ]
        for r in rows
    ]
    return text_table(headers, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phalanx bench --optimizer")
    parser.add_argument("--workloads", help="default: embedding, W4 and the tiny-N rows")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--threads", type=int)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tiny = QUICK_TINY if args.quick else QUICK_TINY + ",tiny-16384"
    names = [w for w in (args.workloads or f"embedding,W4,{tiny}").split(",") if w]
    optimizers = [o for o in args.optimizers.split(",") if o]
    unknown = [w for w in names if w not in WORKLOADS] + [
        o for o in optimizers if o not in OPTIMIZERS
    ]
    if unknown:
        print(
            f"phalanx bench --optimizer: unknown {unknown}; workloads {list(WORKLOADS)}, "
            f"optimizers {list(OPTIMIZERS)}",
            file=sys.stderr,
        )
        return 2
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s); "
        "median seconds per step, contenders interleaved round by round"
    )
    rows = run(names, optimizers, args.quick)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
