"""Dynamic shapes: workloads whose input shape changes from step to step.

Text with dynamic padding (W8 of DESIGN.md: a new sequence length every step), a recurrent
forecaster on windows of varying length, and an epoch whose last batch is short. Each is
trained for two epochs by the default path (``phalanx.stack(models)``, ``auto``, with
``phalanx.optim.Adam``) and by the loop it replaces (one ``torch.optim.Adam(fused=True)`` per
member), side by side in one process on identical weights and batches, epochs interleaved.
Reported: each epoch's time for both and their ratio (the first epoch includes every first
call), the first step's time, and the peak memory of the first step measured in a fresh
child process for each (the peak resident set, reset right before the step). After training both, the members' weights are
compared: the run is only reported if they agree to float rounding.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import phalanx


class TextMember(nn.Module):
    """W8: Embedding(1000, 64) - TransformerEncoderLayer(64, 4 heads, 128) - mean - Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.encoder = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))


class Forecaster(nn.Module):
    """A GRU over a window of any length, the last state to one value."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


@dataclass(frozen=True)
class Dynamic:
    id: str
    what: str
    num_members: int
    make: Callable[[], nn.Module]
    batches: Callable[[random.Random], list[tuple[torch.Tensor, torch.Tensor]]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _text(rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(40):
        length = rng.randint(20, 60)
        out.append((torch.randint(0, 1000, (16, length)), torch.randint(0, 2, (16,))))
    return out


def _windows(rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(32, rng.randint(10, 50), 8), torch.randn(32, 1)) for _ in range(40)]


def _short_last(rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sizes = [128] * 9 + [37]
    return [(torch.randn(b, 784), torch.randint(0, 10, (b,))) for b in sizes]


DYNAMIC = {
    d.id: d
    for d in [
        Dynamic("W8", "text ensemble, a new sequence length (20-60) each step", 8, TextMember,
                _text, F.cross_entropy),
        Dynamic("D2", "GRU forecasters, windows of 10-50 steps", 8, Forecaster, _windows,
                F.mse_loss),
        Dynamic("D3", "MLP ensemble 784-256-10, 9 batches of 128 and a last one of 37", 16,
                _mlp, _short_last, F.cross_entropy),
    ]
}  # fmt: skip


def _members(d: Dynamic, seed: int) -> list[nn.Module]:
    members = []
    for i in range(d.num_members):
        torch.manual_seed(seed * 1000 + i)
        members.append(d.make())
    return members


class _Loop:
    name = "loop (fused Adam)"

    def __init__(self, d: Dynamic, members: list[nn.Module]) -> None:
        self.d, self.members = d, members
        self.opts = [torch.optim.Adam(m.parameters(), lr=1e-3, fused=True) for m in members]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for m, o in zip(self.members, self.opts):
            o.zero_grad()
            self.d.loss(m(x), y).backward()
            o.step()

    def weights(self) -> list[torch.Tensor]:
        return [torch.stack(ps) for ps in zip(*(m.parameters() for m in self.members))]


class _Phalanx:
    """The default path; with ``fused_adam``, ``phalanx.optim.Adam(fused=True)``: each member
    bit for bit ``torch.optim.Adam(fused=True)``, the loop's own arithmetic."""

    name = "phalanx (default)"

    def __init__(
        self, d: Dynamic, members: list[nn.Module], backend: str = "auto", fused_adam: bool = False
    ) -> None:
        self.d = d
        self.stack = phalanx.stack(members, backend=backend)
        self.opt = phalanx.optim.Adam(self.stack.parameters(), lr=1e-3, fused=fused_adam)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        phalanx.member_losses(self.d.loss, self.stack(x), y).sum().backward()
        self.opt.step()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.stack.parameters()]


def _epoch(runner: _Loop | _Phalanx, batches: list) -> tuple[float, float]:
    """Seconds for the epoch, and for its first step."""
    start = time.perf_counter()
    first = 0.0
    for k, (x, y) in enumerate(batches):
        runner.step(x, y)
        if k == 0:
            first = time.perf_counter() - start
    return time.perf_counter() - start, first


def run_one(d: Dynamic, seed: int = 0, epochs: int = 2) -> dict:
    """Both contenders on ``d``, epochs interleaved; times, ratios and the weights' agreement."""
    rng = random.Random(seed)
    data = [d.batches(rng) for _ in range(epochs)]
    members = _members(d, seed)
    loop, ph = _Loop(d, copy.deepcopy(members)), _Phalanx(d, copy.deepcopy(members))
    fused = _Phalanx(d, copy.deepcopy(members), fused_adam=True)
    result: dict = {"id": d.id, "what": d.what, "epochs": []}
    for e in range(epochs):
        t_loop, first_loop = _epoch(loop, data[e])
        t_ph, first_ph = _epoch(ph, data[e])
        t_fused, first_fused = _epoch(fused, data[e])
        result["epochs"].append(
            {"loop_s": t_loop, "phalanx_s": t_ph, "speedup": t_loop / t_ph,
             "first_step_loop_s": first_loop, "first_step_phalanx_s": first_ph,
             "phalanx_fused_adam_s": t_fused, "fused_adam_speedup": t_loop / t_fused,
             "first_step_phalanx_fused_adam_s": first_fused}
        )  # fmt: skip
    result["backend"] = ph.stack.backend
    # After the same updates the members must agree to float rounding (Adam amplifies the
    # last bits over many steps, hence a tolerance on the weights, not on single steps).
    diffs = [(a - b).abs().max().item() for a, b in zip(loop.weights(), ph.weights())]
    result["max_weight_difference"] = max(diffs)
    diffs = [(a - b).abs().max().item() for a, b in zip(loop.weights(), fused.weights())]
    result["fused_adam_max_weight_difference"] = max(diffs)
    # Rounding growth or a difference? The same run in float64 (untimed): the float32 loop's
    # own distance from it is what rounding alone does over these steps.
    loop64 = _Loop(d, [copy.deepcopy(m).double() for m in members])
    for e in range(epochs):
        for x, y in data[e]:
            loop64.step(_double(x), _double(y))
    ref = loop64.weights()
    result["loop_from_float64"] = _distance(loop.weights(), ref)
    result["phalanx_from_float64"] = _distance(ph.weights(), ref)
    result["phalanx_fused_adam_from_float64"] = _distance(fused.weights(), ref)
    return result


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def _distance(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest weight difference from the float64 run."""
    return max((a.double() - b).abs().max().item() for a, b in zip(got, ref))


def _peak_child(did: str, which: str, seed: int) -> float:
    """MiB the first step adds to the resident set at its peak, in a fresh process (Linux:
    the peak, VmHWM, is reset through /proc/self/clear_refs right before the step)."""
    code = (
        "import random, torch\n"
        "from phalanx_tools.bench import dynamic as D\n"
        "def status(key):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(key):\n"
        "            return int(line.split()[1])\n"
        f"d = D.DYNAMIC[{did!r}]\n"
        f"x, y = d.batches(random.Random({seed}))[0]\n"
        f"members = D._members(d, {seed})\n"
        f"runner = D._Loop(d, members) if {which!r} == 'loop' else D._Phalanx(d, members, "
        f"backend={'loop' if which == 'loop backend' else 'auto'!r})\n"
        "base = status('VmRSS:')\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "runner.step(x, y)\n"
        "print((status('VmHWM:') - base) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phalanx bench --dynamic")
    parser.add_argument("--workloads", default=",".join(DYNAMIC))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--memory", action="store_true", help="also the first step's peak memory")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ids = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in ids if w not in DYNAMIC]
    if unknown:
        print(f"phalanx bench --dynamic: unknown workloads {unknown}; choose from "
              f"{', '.join(DYNAMIC)}", file=sys.stderr)  # fmt: skip
        return 2
    print(f"dynamic shapes, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"loop = one torch.optim.Adam(fused=True) per member")  # fmt: skip
    results = []
    for did in ids:
        r = run_one(DYNAMIC[did])
        if args.memory:
            ways = ("loop", "loop backend", "phalanx")
            r["first_step_peak_mib"] = {w: _peak_child(did, w, 0) for w in ways}
        results.append(r)
        e1, e2 = r["epochs"][0], r["epochs"][-1]
        line = (
            f"{did} {r['what']} (N={DYNAMIC[did].num_members}, backend {r['backend']}): "
            f"first epoch {e1['speedup']:.2f}x the loop ({e1['phalanx_s']:.2f} s vs "
            f"{e1['loop_s']:.2f} s), steady {e2['speedup']:.2f}x; first step "
            f"{e1['first_step_phalanx_s'] * 1e3:.0f} ms vs {e1['first_step_loop_s'] * 1e3:.0f} ms"
        )
        if "first_step_peak_mib" in r:
            m = r["first_step_peak_mib"]
            line += (
                f"; first-step peak +{m['phalanx']:.0f} MiB, the loop backend's "
                f"+{m['loop backend']:.0f} MiB, the loop's +{m['loop']:.0f} MiB"
            )
        line += (
            f"; weights agree to {r['max_weight_difference']:.1e}; from a float64 loop on "
            f"the same run: the float32 loop {r['loop_from_float64']:.1e}, phalanx "
            f"{r['phalanx_from_float64']:.1e}"
        )
        line += (
            f"\n    with phalanx.optim.Adam(fused=True) (the loop's fused kernel, member by "
            f"member): first epoch {e1['fused_adam_speedup']:.2f}x the loop "
            f"({e1['phalanx_fused_adam_s']:.2f} s), steady {e2['fused_adam_speedup']:.2f}x; "
            f"first step {e1['first_step_phalanx_fused_adam_s'] * 1e3:.0f} ms; weights agree "
            f"to {r['fused_adam_max_weight_difference']:.1e}, from float64 "
            f"{r['phalanx_fused_adam_from_float64']:.1e}"
        )
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
