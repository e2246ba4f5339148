"""A 64-trial Optuna search on scikit-learn's digits: Optuna's trial-by-trial loop against
`phalanx.integrations.optuna.optimize` (all trials asked at once, one stack), side by side in
one process on identical data, seeds and sampler.

Each trial: an MLP 64-H-10 (LeakyReLU) trained with SGD with momentum (`make demo`'s optimizer;
`--optimizer adamw` for AdamW) for E epochs of batch 32; the trial
suggests lr, weight decay and momentum (per-member hyperparameters in the stack). The sampler is Optuna's
RandomSampler with one seed, so both runs see the same trials; the script prints both wall
times, their ratio, and how far apart the two runs' values are (float rounding).

    flock /tmp/bench.lock env OMP_NUM_THREADS=1 python benchmarks/optuna_search.py

``--compare-step`` times the one-stack search with ``group.train_step`` at ``step="captured"``
(compile_step, inductor; the compile included: it is what a search pays) against
``step="eager"``, alternating, and a step's median time after the capture, and checks that both give the same trials and values to float
rounding. ``--quick``: 16 trials, 2 epochs, one run of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import optuna
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.integrations.optuna as po
from phalanx_tools.demo import load_digits

optuna.logging.set_verbosity(optuna.logging.WARNING)
STEADY: dict[str, list[float]] = {"captured": [], "eager": [], "auto": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--repeats", type=int, default=2, help="alternating timed runs of each")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--compare-step", action="store_true", help="captured vs eager step")
    parser.add_argument("--quick", action="store_true", help="16 trials, 2 epochs, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.epochs, args.repeats = 16, 2, 1
    torch.set_num_threads(1)
    data = load_digits(0)
    seed = 0

    def model(trial: optuna.Trial) -> nn.Module:
        # AdamW's steps are larger: the same range would make its fastest trials diverge.
        high = 0.3 if args.optimizer == "sgd" else 0.03
        trial.suggest_float("lr", 1e-4 if args.optimizer == "adamw" else 1e-3, high, log=True)
        trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True)
        if args.optimizer == "sgd":
            trial.suggest_float("momentum", 0.0, 0.95)
        h = args.hidden
        return nn.Sequential(nn.Linear(64, h), nn.LeakyReLU(), nn.Linear(h, 10))

    def optimizer(group: po.TrialGroup) -> torch.optim.Optimizer:
        p = group.params
        if args.optimizer == "sgd":
            return phalanx.optim.SGD(
                group.stack.parameters(), lr=p["lr"], momentum=p["momentum"],
                weight_decay=p["weight_decay"],
            )  # fmt: skip
        return phalanx.optim.AdamW(
            group.stack.parameters(), lr=p["lr"], weight_decay=p["weight_decay"]
        )

    def train(group: po.TrialGroup) -> torch.Tensor:
        opt = optimizer(group)
        loader = group.loader(
            data.x_train, data.y_train, batch_size=args.batch_size, drop_last=True
        )
        for epoch in range(args.epochs):
            for xb, yb in loader:
                out = group.stack(xb, in_dims=0)
                losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, 0))
                opt.zero_grad()
                losses.sum().backward()
                opt.step(mask=group.mask)
            with torch.no_grad():
                val = phalanx.metrics.loss(F.cross_entropy, group.stack(data.x_val), data.y_val)
            group.report(val, epoch)
        return val

    def train_stepped(group: po.TrialGroup) -> torch.Tensor:
        """``train`` through ``group.train_step`` (the step ``optimize(step=)`` chooses)."""
        opt = optimizer(group)
        loader = group.loader(
            data.x_train, data.y_train, batch_size=args.batch_size, drop_last=True
        )
        step = group.train_step(F.cross_entropy, opt, in_dims=0)
        calls = 0
        for epoch in range(args.epochs):
            for xb, yb in loader:
                t0 = time.perf_counter()
                step(xb, yb, mask=group.mask)
                calls += 1
                if calls > 10:  # after the warm-up, the capture and compile_step's timing
                    STEADY[group.step].append(time.perf_counter() - t0)
            with torch.no_grad():
                val = phalanx.metrics.loss(F.cross_entropy, group.stack(data.x_val), data.y_val)
            group.report(val, epoch)
        return val

    def objective(trial: optuna.Trial) -> float:
        """Optuna's own loop: one nn.Module and one torch.optim optimizer per trial."""
        net = po.build_model(model, trial, seed)
        p = trial.params
        if args.optimizer == "sgd":
            opt = torch.optim.SGD(
                net.parameters(), lr=p["lr"], momentum=p["momentum"],
                weight_decay=p["weight_decay"],
            )  # fmt: skip
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
        loader = phalanx.data.MemberLoader(
            data.x_train, data.y_train, num_members=1, batch_size=args.batch_size,
            drop_last=True, seed=seed, first_member=trial.number,
        )  # fmt: skip
        for epoch in range(args.epochs):
            for xb, yb in loader:
                loss = F.cross_entropy(net(xb[0]), yb[0])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                val = float(F.cross_entropy(net(data.x_val), data.y_val))
            trial.report(val, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return val

    def study() -> optuna.Study:
        return optuna.create_study(
            sampler=optuna.samplers.RandomSampler(seed=1), pruner=optuna.pruners.NopPruner()
        )

    if args.compare_step:
        compare_step(args, study, model, train_stepped, seed)
        return
    times: dict[str, list[float]] = {"optuna": [], "phalanx": []}
    results = {}
    for _ in range(args.repeats):
        s = study()
        t0 = time.perf_counter()
        s.optimize(objective, n_trials=args.trials)
        times["optuna"].append(time.perf_counter() - t0)
        results["optuna"] = s
        s = study()
        t0 = time.perf_counter()
        po.optimize(s, model, train, n_trials=args.trials, seed=seed)
        times["phalanx"].append(time.perf_counter() - t0)
        results["phalanx"] = s
    a, b = results["optuna"].trials, results["phalanx"].trials
    same_params = [t.params for t in a] == [t.params for t in b]
    diffs = [abs(x.value - y.value) for x, y in zip(a, b)]
    best = min(times["optuna"]) / min(times["phalanx"])
    figures = {
        "trials": args.trials,
        "epochs": args.epochs,
        "hidden": args.hidden,
        "batch_size": args.batch_size,
        "optimizer": args.optimizer,
        "optuna_trial_by_trial_s": min(times["optuna"]),
        "phalanx_one_stack_s": min(times["phalanx"]),
        "speedup": best,
        "same_params": same_params,
        "max_abs_value_diff": max(diffs),
        "best_trial": [results["optuna"].best_trial.number, results["phalanx"].best_trial.number],
        "best_value": [results["optuna"].best_value, results["phalanx"].best_value],
    }
    print(
        f"{args.trials} trials, {args.epochs} epochs of MLP 64-{args.hidden}-10 on digits, "
        f"batch {args.batch_size}, {args.optimizer}, one thread (best of {args.repeats} alternating runs):\n"
        f"  Optuna trial by trial (nn.Module + torch.optim): {figures['optuna_trial_by_trial_s']:.2f} s\n"
        f"  phalanx.integrations.optuna (one stack):         {figures['phalanx_one_stack_s']:.2f} s\n"
        f"  speed-up {best:.1f}x; same trials: {same_params}; "
        f"max |value difference| {max(diffs):.1e}; best trial {figures['best_trial']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def compare_step(args, study, model, train, seed) -> None:  # type: ignore[no-untyped-def]
    times: dict[str, list[float]] = {"captured": [], "eager": []}
    studies = {}
    choices = {}
    for _ in range(args.repeats):
        for step in ("captured", "eager"):
            s = study()
            t0 = time.perf_counter()
            groups = po.optimize(s, model, train, n_trials=args.trials, seed=seed, step=step)
            times[step].append(time.perf_counter() - t0)
            studies[step] = s
            choices[step] = sorted({str(g.step_choice) for g in groups})
    a, b = studies["captured"].trials, studies["eager"].trials
    diffs = [abs(x.value - y.value) for x, y in zip(a, b)]
    cap, eag = min(times["captured"]), min(times["eager"])
    steady = {k: statistics.median(v) * 1e3 for k, v in STEADY.items() if v}
    print(
        f"{args.trials} trials, {args.epochs} epochs of MLP 64-{args.hidden}-10 on digits, batch "
        f"{args.batch_size}, {args.optimizer}, one stack, one thread (best of {args.repeats}):\n"
        f"  optimize(step='captured'): {cap:.2f} s (compile included; ran {choices['captured']})\n"
        f"  optimize(step='eager'):    {eag:.2f} s\n"
        f"  a step after the capture (median): captured {steady.get('captured', 0):.3f} ms, "
        f"eager {steady.get('eager', 0):.3f} ms, eager / captured "
        f"{steady.get('eager', 0) / max(steady.get('captured', 1), 1e-9):.2f}x\n"
        f"  whole search eager / captured {eag / cap:.2f}x; same trials: "
        f"{[t.params for t in a] == [t.params for t in b]}; max |value difference| {max(diffs):.1e}"
    )


if __name__ == "__main__":
    main()
