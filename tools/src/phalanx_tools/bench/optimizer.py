"""``phalanx bench --optimizer``: one optimizer step, phalanx against torch over the loop's tensors.

Two workloads, each a stack of N members and the N members' own tensors (the loop's), with
the same values and the same gradients:

- ``embedding``: 16 members of a (95812, 64) embedding table (an optimizer-bound step: 392 MB
  per stacked tensor).
- ``W4``: W4's MLP (784-256-256-10), 32 members.
- ``W2``: W2's MLP (10-20-2), 8 members (a step of launches; ``--workloads W2``).

For Adam and SGD (momentum 0.9), side by side in one process, contenders interleaved round
by round (``timing.interleaved``): torch's fused kernel over the loop's tensors (one
``torch.optim`` optimizer holding every member's tensors, ``fused=True``), torch's default
single-tensor arithmetic over them (``foreach=False``), ``phalanx.optim`` on the stacked
tensors, and ``phalanx.optim`` with ``fused=True``. Before the timing, one step of each
phalanx mode is compared with its torch reference member by member (``bits``: "equal" when
every member is bit for bit torch's).
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
    for label, extra in (("torch fused", {"fused": True}), ("torch default", {"foreach": False})):
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
        # One step of each, from the same values: every member's bits against the reference.
        opt.step()
        fns[ref]()
        loop = iter(loops[ref])
        same = all(torch.equal(p[i], next(loop)) for p in params for i in range(n))
        bits[label] = "equal" if same else "differ"
        fns[label] = opt.step
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
            for label in ("torch fused", "torch default", "phalanx", "phalanx fused=True"):
                t = timings.get(label)
                rows.append(
                    {
                        "workload": f"{workload} ({n} x {' + '.join(map(str, shapes))})"
                        if label == "torch fused"
                        else "",
                        "optimizer": name,
                        "contender": label,
                        "median_s": None if t is None else t.median,
                        "vs_torch_fused": None if t is None else t.median / base,
                        "bits": bits.get(label, ""),
                    }
                )
            del fns
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    headers = ["workload", "optimizer", "contender", "time", "x torch fused", "bits"]
    cells = [
        [
            r["workload"],
            r["optimizer"],
            r["contender"],
            fmt_time(r["median_s"]),
            "-" if r["vs_torch_fused"] is None else f"{r['vs_torch_fused']:.2f}x",
            r["bits"],
        ]
        for r in rows
    ]
    return text_table(headers, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phalanx bench --optimizer")
    parser.add_argument("--workloads", default="embedding,W4")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--threads", type=int)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [w for w in args.workloads.split(",") if w]
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
