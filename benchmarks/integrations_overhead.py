"""Per-step overhead of phalanx's integrations against each tool's plain loop, in one process.

Each pair runs the same stack on the same inputs, interleaved (A B A B ...), one thread; a
step's time is the median over steps. The plain loops are what a user writes without the
integration (and which couple the members: one joint clip, one shared scale):

- Trainer: PhalanxTrainer against transformers.Trainer on a wrapper returning the summed loss
  (max_grad_norm=1.0 both, phalanx AdamW both), GPT-2s of 2 layers, 8 members;
- accelerate: PhalanxAccelerator against accelerate.Accelerator, backward + clip_grad_norm_ +
  step of an 8-member MLP stack;
- scaler: phalanx.MemberGradScaler against torch.amp.GradScaler (scale, step, update), the
  same MLP stack under CPU bfloat16 autocast.

Then the step each integration can run, captured (``step="captured"``: compile_step with
inductor) against eager (``step="eager"``), after the capture, same interleaving:

- Trainer: PhalanxTrainer(step="captured") against PhalanxTrainer(step="eager");
- accelerate: PhalanxAccelerator.train_step(step="captured") against its eager step (backward,
  clip_grad_norm_, the prepared optimizer's step).

Run: flock /tmp/bench.lock env OMP_NUM_THREADS=1 python benchmarks/integrations_overhead.py
(``--quick``: one round, fewer steps; ``--steps-only``: the captured-against-eager rows only)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import accelerate
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import Dataset

import phalanx
from phalanx.integrations.accelerate import PhalanxAccelerator
from phalanx.integrations.transformers import PhalanxTrainer

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
transformers.utils.logging.set_verbosity_error()
N, ROUNDS = 8, 3


class Tokens(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Summed(nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.stack = stack

    def forward(self, input_ids, labels):
        return {"loss": self.stack(input_ids, labels=labels, use_cache=False).loss.sum()}


class Clock(transformers.TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def trainer_step(kind, stack, steps=12, skip=2):
    clock = Clock()
    args = transformers.TrainingArguments(
        tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=8, report_to=[],
        use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=4,
    )  # fmt: skip
    opt = phalanx.optim.AdamW(stack.parameters(), lr=1e-4)
    if kind in ("phalanx", "captured", "eager"):
        step = "eager" if kind == "phalanx" else kind
        trainer = PhalanxTrainer(
            model=stack, args=args, train_dataset=Tokens(), optimizers=(opt, None), step=step
        )
    else:
        trainer = transformers.Trainer(
            model=Summed(stack), args=args, train_dataset=Tokens(), optimizers=(opt, None)
        )
    trainer.add_callback(clock)
    trainer.train()
    diffs = [b - a for a, b in zip(clock.times[skip:], clock.times[skip + 1 :])]  # after warm-up
    return statistics.median(diffs)


def accelerate_step(kind, stack, x, y, steps=60):
    acc = PhalanxAccelerator(cpu=True) if kind == "phalanx" else accelerate.Accelerator(cpu=True)
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-3)
    model, opt = acc.prepare(stack, opt)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses = phalanx.member_losses(F.cross_entropy, model(x), y)
        acc.backward(losses if kind == "phalanx" else losses.sum())
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def accelerate_train_step(kind, stack, x, y, steps=60):
    """PhalanxAccelerator.train_step, captured or eager; the capture (step 4) left out."""
    acc = PhalanxAccelerator(cpu=True)
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-3)
    model, opt = acc.prepare(stack, opt)
    train = acc.train_step(model, F.cross_entropy, opt, step=kind, max_norm=1.0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times[8:])


def scaler_step(kind, stack, x, y, steps=60):
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-3)
    if kind == "phalanx":
        scaler = phalanx.MemberGradScaler(N, device="cpu")
    else:
        scaler = torch.amp.GradScaler("cpu")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = stack(x)
        losses = phalanx.member_losses(F.cross_entropy, out.float(), y)
        scaler.scale(losses if kind == "phalanx" else losses.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def ratio(run, kinds=("phalanx", "plain")):
    ours, plain = [], []
    for _ in range(ROUNDS):
        ours.append(run(kinds[0]))
        plain.append(run(kinds[1]))
    return statistics.median(ours), statistics.median(plain)


def main():
    global ROUNDS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, fewer steps")
    parser.add_argument("--steps-only", action="store_true", help="captured vs eager rows only")
    args = parser.parse_args()
    if args.quick:
        ROUNDS = 1
    config = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32, use_cache=False
    )
    torch.manual_seed(0)
    gpt2 = phalanx.stack([transformers.GPT2LMHeadModel(config) for _ in range(N)])
    mlp = phalanx.stack(
        lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)),
        num_members=N,
        seed=0,
    )
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    captured = ("captured", "eager")
    trainer_steps = 16 if args.quick else 24
    steps = [
        (
            "Trainer step='captured' vs 'eager' (GPT-2s)",
            ratio(lambda k: trainer_step(k, gpt2, steps=trainer_steps, skip=6), captured),
        ),
        (
            "accelerate train_step captured vs eager (MLPs)",
            ratio(
                lambda k: accelerate_train_step(k, mlp, x, y, 30 if args.quick else 60), captured
            ),
        ),
    ]
    print(f"{'integration: the captured step':46} {'captured':>10} {'eager':>9} {'ratio':>6}")
    for name, (ours, plain) in steps:
        print(f"{name:46} {ours * 1e3:10.2f} {plain * 1e3:9.2f} {ours / plain:6.3f}")
    if args.steps_only:
        return
    rows = [
        ("Trainer (8 GPT-2s, 2 layers, batch 8x32)", ratio(lambda k: trainer_step(k, gpt2))),
        (
            "accelerate (8 MLPs 64-256-10, batch 128)",
            ratio(lambda k: accelerate_step(k, mlp, x, y)),
        ),
        ("MemberGradScaler vs GradScaler (same, bf16)", ratio(lambda k: scaler_step(k, mlp, x, y))),
    ]
    print(f"{'integration':46} {'phalanx ms':>10} {'plain ms':>9} {'ratio':>6}")
    for name, (ours, plain) in rows:
        print(f"{name:46} {ours * 1e3:10.2f} {plain * 1e3:9.2f} {ours / plain:6.3f}")


if __name__ == "__main__":
    main()
