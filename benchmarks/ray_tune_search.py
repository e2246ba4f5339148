"""A Ray Tune search on scikit-learn's digits: Tune's own Tuner (one Tune trial per
configuration, one CPU) against `phalanx.integrations.ray_tune.optimize` (the same searcher
driven ask/tell, all configurations one stack, no Ray runtime), side by side in one process.

Each configuration: an MLP 64-H-10 trained with SGD (lr, momentum from the searcher) for E
epochs of batch 32. The searcher is OptunaSearch with a seeded RandomSampler, so both runs
train the same configurations; the script prints both wall times (Tune's includes starting
Ray, as a user's run does), their ratio and the largest difference of the two runs' values.

    flock /tmp/bench.lock env OMP_NUM_THREADS=1 python benchmarks/ray_tune_search.py

``--compare-step``: the one-stack search only, its steps through ``train_step`` at
``step="captured"`` (compile_step, inductor, the compile included) against ``step="eager"``.
``--quick``: 16 configurations, 2 epochs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

import optuna
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.integrations.ray_tune import optimize, train_step
from phalanx_tools.demo import load_digits

warnings.filterwarnings("ignore")
optuna.logging.set_verbosity(optuna.logging.WARNING)
SEED = 0


def _net(hidden: int, number: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + number)
        return nn.Sequential(nn.Linear(64, hidden), nn.LeakyReLU(), nn.Linear(hidden, 10))


def train_one(config: dict, epochs: int, hidden: int) -> float:
    """One configuration alone: what each Tune trial runs (nn.Module + torch.optim)."""
    torch.set_num_threads(1)
    data = load_digits(0)
    net = _net(hidden, config["number"])
    opt = torch.optim.SGD(net.parameters(), lr=config["lr"], momentum=config["momentum"])
    loader = phalanx.data.MemberLoader(
        data.x_train, data.y_train, num_members=1, batch_size=32, drop_last=True, seed=SEED,
        first_member=config["number"],
    )  # fmt: skip
    for _ in range(epochs):
        for xb, yb in loader:
            loss = F.cross_entropy(net(xb[0]), yb[0])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return float(F.cross_entropy(net(data.x_val), data.y_val))


def _numbered(base: type) -> type:
    class Numbered(base):  # type: ignore[misc, valid-type]
        """Numbers the configurations in the order asked, as the stack's members are."""

        asked = 0

        def suggest(self, trial_id):  # type: ignore[no-untyped-def]
            config = super().suggest(trial_id)
            if config is None:
                return None
            self.asked += 1
            return {**config, "number": self.asked - 1}

    return Numbered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--compare-step", action="store_true", help="captured vs eager step")
    parser.add_argument("--quick", action="store_true", help="16 configurations, 2 epochs")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.epochs = 16, 2
    torch.set_num_threads(1)
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    space = {"lr": tune.loguniform(1e-3, 0.3), "momentum": tune.uniform(0.0, 0.95)}
    converted = OptunaSearch.convert_search_space(space)

    def searcher() -> OptunaSearch:
        sampler = optuna.samplers.RandomSampler(seed=1)
        return OptunaSearch(converted, metric="loss", mode="min", sampler=sampler)

    data = load_digits(0)
    numbers: dict[str, int] = {}
    steady: dict[str, list[float]] = {"captured": [], "eager": [], "auto": []}

    def train_stack(configs: list[dict]) -> torch.Tensor:
        base = len(numbers)
        for k in range(len(configs)):
            numbers[str(base + k)] = base + k
        nets = [_net(args.hidden, base + k) for k in range(len(configs))]
        stack = phalanx.stack(nets)
        opt = phalanx.optim.SGD(
            stack.parameters(),
            lr=[c["lr"] for c in configs],
            momentum=[c["momentum"] for c in configs],
        )
        loader = phalanx.data.MemberLoader(
            data.x_train, data.y_train, num_members=len(configs), batch_size=32,
            drop_last=True, seed=SEED, first_member=base,
        )  # fmt: skip
        step = train_step(stack, F.cross_entropy, opt, in_dims=0) if args.compare_step else None
        calls = 0
        for _ in range(args.epochs):
            for xb, yb in loader:
                if step is not None:  # optimize(step=...)'s choice
                    t0 = time.perf_counter()
                    step(xb, yb)
                    calls += 1
                    if calls > 10:  # after the warm-up, the capture and the timing
                        steady[step.mode].append(time.perf_counter() - t0)
                    continue
                losses = phalanx.member_losses(
                    F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0)
                )
                opt.zero_grad()
                losses.sum().backward()
                opt.step()
        with torch.no_grad():
            return phalanx.metrics.loss(F.cross_entropy, stack(data.x_val), data.y_val)

    if args.compare_step:
        times: dict[str, float] = {}
        values = {}
        for step_mode in ("captured", "eager"):
            numbers.clear()
            t0 = time.perf_counter()
            values[step_mode] = optimize(
                searcher(), train_stack, n_trials=args.trials, step=step_mode
            )
            times[step_mode] = time.perf_counter() - t0
        diffs = [abs(a[2] - b[2]) for a, b in zip(values["captured"], values["eager"])]
        cap_ms, eag_ms = (statistics.median(steady[k]) * 1e3 for k in ("captured", "eager"))
        print(
            f"{args.trials} configurations, {args.epochs} epochs of MLP 64-{args.hidden}-10 on "
            f"digits, one stack, one thread:\n"
            f"  optimize(step='captured'): {times['captured']:.2f} s (compile included)\n"
            f"  optimize(step='eager'):    {times['eager']:.2f} s\n"
            f"  a step after the capture (median): captured {cap_ms:.3f} ms, eager {eag_ms:.3f} "
            f"ms, eager / captured {eag_ms / cap_ms:.2f}x\n"
            f"  whole search eager / captured {times['eager'] / times['captured']:.2f}x; "
            f"max |value difference| {max(diffs):.1e}"
        )
        return

    t0 = time.perf_counter()
    runs = optimize(searcher(), train_stack, n_trials=args.trials)
    stacked_s = time.perf_counter() - t0

    import ray

    epochs, hidden = args.epochs, args.hidden
    Numbered = _numbered(OptunaSearch)

    def trainable(config: dict) -> None:
        tune.report({"loss": train_one(config, epochs, hidden)})

    t0 = time.perf_counter()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="ray"))  # fmt: skip
    sampler = optuna.samplers.RandomSampler(seed=1)
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=Numbered(converted, metric="loss", mode="min", sampler=sampler),
            num_samples=args.trials,
            max_concurrent_trials=1,
        ),
        run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(), verbose=0),
    )
    results = tuner.fit()
    tune_s = time.perf_counter() - t0
    ray.shutdown()
    tune_values = sorted((r.config["number"], r.metrics["loss"], r.config["lr"]) for r in results)
    same = [abs(c["lr"] - lr) < 1e-12 for (_, c, _), (_, _, lr) in zip(runs, tune_values)]
    diffs = [abs(v - tv) for (_, _, v), (_, tv, _) in zip(runs, tune_values)]
    figures = {
        "trials": args.trials,
        "epochs": args.epochs,
        "tune_tuner_s": tune_s,
        "phalanx_searcher_one_stack_s": stacked_s,
        "speedup": tune_s / stacked_s,
        "same_configs": all(same),
        "max_abs_value_diff": max(diffs),
    }
    print(
        f"{args.trials} configurations, {args.epochs} epochs of MLP 64-{args.hidden}-10 on "
        f"digits, one thread:\n"
        f"  Tune's Tuner, one trial per configuration (incl. ray.init): {tune_s:.1f} s\n"
        f"  the same searcher ask/tell, one stack (no Ray runtime):      {stacked_s:.1f} s\n"
        f"  speed-up {tune_s / stacked_s:.1f}x; same configurations: {all(same)}; "
        f"max |value difference| {max(diffs):.1e}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
