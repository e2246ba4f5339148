"""Per-step overhead of phalanx.integrations.lightning against Lightning's plain loop, and of
phalanx.integrations.torchrl against the plain call / TorchRL's plain SAC step; each a ratio of
times measured in this one process, alternating, on identical inputs.
Then StackModule(step="captured") against StackModule(step="eager") (``member_step``, manual
optimization) and against the automatic-optimization StackModule, per-member clip in all three:
a step's time after the capture, the median of steps timed by a callback, alternating.
Run: flock /tmp/bench.lock env OMP_NUM_THREADS=1 python benchmarks/lightning_torchrl_overhead.py
(``--quick``: one round; ``--steps-only``: the captured-against-eager rows only)"""

import logging
import statistics
import sys
import time
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.integrations.lightning import StackModule

warnings.filterwarnings("ignore")
logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
torch.set_num_threads(1)
N = 16
X = torch.randn(64 * 50, 10)
Y = X[:, :3].argmax(1)
DL = DataLoader(TensorDataset(X, Y), batch_size=64)


def make():
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))


class Plain(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.stack = phalanx.stack(make, num_members=N, seed=0)

    def training_step(self, batch, _):
        x, y = batch
        return phalanx.member_losses(F.cross_entropy, self.stack(x), y).sum()

    def configure_optimizers(self):
        return phalanx.optim.Adam(self.stack.parameters(), lr=1e-3)


class Member(StackModule):
    def __init__(self):
        super().__init__()
        self.stack = phalanx.stack(make, num_members=N, seed=0)

    def training_step(self, batch, _):
        x, y = batch
        losses = phalanx.member_losses(F.cross_entropy, self.stack(x), y)
        self.log_members("train_loss", losses)
        return losses.sum()

    def configure_optimizers(self):
        return phalanx.optim.Adam(self.stack.parameters(), lr=1e-3)


class MemberNoLog(Member):
    def training_step(self, batch, _):
        x, y = batch
        return phalanx.member_losses(F.cross_entropy, self.stack(x), y).sum()


class PlainLogged(Plain):
    def training_step(self, batch, _):
        x, y = batch
        losses = phalanx.member_losses(F.cross_entropy, self.stack(x), y)
        self.log_dict({f"train_loss/member_{i}": losses[i].detach() for i in range(N)})
        return losses.sum()


class Masked(Member):
    def on_train_start(self):
        self.member_mask = torch.ones(N, dtype=torch.bool)
        self.member_mask[0] = False  # one member stopped: every step takes the masked path


def fit(cls, steps, **kw):
    t = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )
    m = cls()
    s = time.perf_counter()
    t.fit(m, DL)
    return time.perf_counter() - s


def per_step(cls, **kw):  # fit(250) - fit(50): the set-up cancels
    return (fit(cls, 250, **kw) - fit(cls, 50, **kw)) / 200 * 1e3


class Stepped(StackModule):
    """phalanx's step through member_step, captured or eager (manual optimization)."""

    def __init__(self, step):
        super().__init__(step=step)
        self.stack = phalanx.stack(make, num_members=N, seed=0)

    def training_step(self, batch, _):
        x, y = batch
        self.member_step(F.cross_entropy, x, y, max_norm=1.0)

    def configure_optimizers(self):
        return phalanx.optim.Adam(self.stack.parameters(), lr=1e-3)


class StepClock(pl.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter())


def steady_step(make_module, steps=120, **kw):
    """Median ms between batch ends after step 12 (the capture and the timing done)."""
    clock = StepClock()
    t = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock], **kw,
    )  # fmt: skip
    t.fit(make_module(), DL)
    return statistics.median(b - a for a, b in zip(clock.times[12:], clock.times[13:])) * 1e3


QUICK = "--quick" in sys.argv
step_cases = {
    "StackModule(step='captured'), member_step, max_norm=1": (lambda: Stepped("captured"), {}),
    "StackModule(step='eager'), member_step, max_norm=1": (lambda: Stepped("eager"), {}),
    "StackModule automatic, gradient_clip_val=1 (eager)": (MemberNoLog, {"gradient_clip_val": 1.0}),
}
step_times = {k: [] for k in step_cases}
for _ in range(1 if QUICK else 3):
    for k, (make_module, kw) in step_cases.items():
        step_times[k].append(steady_step(make_module, 60 if QUICK else 120, **kw))
eager_ms = min(step_times["StackModule(step='eager'), member_step, max_norm=1"])
print(f"Lightning, N={N} MLP 10-64-3, batch 64, Adam: the step, ms after the capture")
for k, v in step_times.items():
    print(f"  {k:60s} {min(v):7.3f} ms  {min(v) / eager_ms:5.2f}x the eager member_step")
if "--steps-only" in sys.argv:
    sys.exit(0)

cases = {
    "Lightning plain, no clip": (Plain, {}),
    "Lightning plain, gradient_clip_val=1 (joint, couples)": (Plain, {"gradient_clip_val": 1.0}),
    "StackModule, gradient_clip_val=1 per member": (MemberNoLog, {"gradient_clip_val": 1.0}),
    "Lightning plain + self.log_dict of 16 scalars by hand": (PlainLogged, {}),
    "StackModule, per-member clip + log_members (16 scalars)": (Member, {"gradient_clip_val": 1.0}),
    "  ... + one member masked (MemberEarlyStopping path)": (Masked, {"gradient_clip_val": 1.0}),
}
times = {k: [] for k in cases}
for _ in range(3):
    for k, (cls, kw) in cases.items():
        times[k].append(per_step(cls, **kw))
base = min(times["Lightning plain, no clip"])
print(f"Lightning, N={N} MLP 10-64-3, batch 64, ms per step (min of 3, machine shared, 1 thread)")
for k, v in times.items():
    print(f"  {k:60s} {min(v):7.3f} ms  {min(v) / base:5.2f}x")

# TorchRL / tensordict
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import NormalParamExtractor, TensorDictModule  # noqa: E402
from torchrl.modules import ProbabilisticActor, TanhNormal  # noqa: E402
from torchrl.objectives import SACLoss  # noqa: E402

from phalanx.integrations.torchrl import TensorDictStack, loss_members, loss_stack  # noqa: E402


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, obs, act):
        return self.net(torch.cat([obs, act], -1))


B = 256
critics = phalanx.stack(Critic, num_members=N, seed=0)
batch = TensorDict(
    {
        "observation": torch.randn(B, 4),
        "action": torch.rand(B, 2) * 2 - 1,
        ("next", "observation"): torch.randn(B, 4),
        ("next", "reward"): torch.randn(B, 1),
        ("next", "done"): torch.zeros(B, 1, dtype=torch.bool),
        ("next", "terminated"): torch.zeros(B, 1, dtype=torch.bool),
    },
    [B],
)
tdm = TensorDictStack(critics, ["observation", "action"], ["q"])


def timeit(fn, reps=300):
    fn()
    s = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - s) / reps * 1e3


with torch.no_grad():
    direct = [timeit(lambda: critics(batch["observation"], batch["action"])) for _ in range(3)]
    wrapped = [timeit(lambda: tdm(batch)) for _ in range(3)]
print(
    f"TensorDictStack(td) vs stack(obs, act), N={N}, B={B}: {min(direct):.3f} ms -> {min(wrapped):.3f} ms"
    f" ({min(wrapped) / min(direct):.2f}x)"
)


def sac_step(use_phalanx):
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(nn.Linear(4, 4), NormalParamExtractor()),
            in_keys=["observation"],
            out_keys=["loc", "scale"],
        ),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
    )
    loss = SACLoss(
        actor,
        loss_members(critics, ["observation", "action"], ["state_action_value"]),
        num_qvalue_nets=N,
        target_entropy=-2.0,
    )
    if use_phalanx:
        shared = loss_stack(loss, "qvalue_network")
        copt = phalanx.optim.Adam(shared.parameters(), lr=torch.logspace(-4, -2, N).tolist())
        aopt = torch.optim.Adam(
            [*list(loss.actor_network_params.values(True, True)), loss.log_alpha], lr=3e-4
        )
        opts = [copt, aopt]
        clip = lambda: phalanx.clip_grad_norm_(shared.parameters(), 1.0)  # noqa: E731
    else:
        opts = [torch.optim.Adam(loss.parameters(), lr=3e-4)]
        clip = lambda: None  # noqa: E731

    def step():
        out = loss(batch)
        for o in opts:
            o.zero_grad()
        (out["loss_qvalue"] + out["loss_actor"] + out["loss_alpha"]).backward()
        clip()
        for o in opts:
            o.step()

    return step


plain_s, ph_s = sac_step(False), sac_step(True)
plain_t = [timeit(plain_s, 50) for _ in range(3)]
ph_t = [timeit(ph_s, 50) for _ in range(3)]
print(
    f"SACLoss step, {N} critics, B={B}: torch Adam over loss.parameters() {min(plain_t):.2f} ms; "
    f"loss_stack + phalanx Adam (per-critic lr) + per-critic clip {min(ph_t):.2f} ms ({min(ph_t) / min(plain_t):.2f}x)"
)
