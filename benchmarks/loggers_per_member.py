"""Per-step cost of logging 16 members (phalanx.integrations.loggers) against logging the one
summed loss to one run, each tool in one process, side by side on identical values.
Run: flock /tmp/bench.lock env OMP_NUM_THREADS=1 MLFLOW_ALLOW_FILE_STORE=true python benchmarks/loggers_per_member.py"""

import os
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(1)
from phalanx.integrations.loggers import MLflowMembers, TensorBoardMembers, WandbMembers  # noqa: E402

N, STEPS, REPEATS = 16, 50, 3
LOSSES = [torch.rand(N) for _ in range(STEPS)]
LRS = torch.logspace(-4, -1, N)
tmp = tempfile.mkdtemp()


def per_step(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) / STEPS * 1e3


def best(make_and_run):
    return min(make_and_run(r) for r in range(REPEATS))


# TensorBoard
from torch.utils.tensorboard import SummaryWriter  # noqa: E402


def tb_one(r):
    w = SummaryWriter(os.path.join(tmp, f"tb1_{r}"))
    ms = per_step(
        lambda: [w.add_scalar("train/loss", float(loss.sum()), s) for s, loss in enumerate(LOSSES)]
    )
    w.close()
    return ms


def tb_members(r):
    log = TensorBoardMembers(os.path.join(tmp, f"tbN_{r}"), N, hparams={"lr": LRS})
    ms = per_step(lambda: [log.log({"train/loss": loss}, s) for s, loss in enumerate(LOSSES)])
    log.close({"hparam/final": LOSSES[-1]})
    return ms


# MLflow (file store and sqlite)
from mlflow.entities import Metric  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402


def ml_one(uri):
    def run(r):
        c = MlflowClient(tracking_uri=uri)
        exp = c.get_experiment_by_name("one") or None
        exp = exp.experiment_id if exp else c.create_experiment("one")
        rid = c.create_run(exp).info.run_id
        ms = per_step(
            lambda: [
                c.log_batch(rid, metrics=[Metric("train_loss", float(loss.sum()), 0, s)])
                for s, loss in enumerate(LOSSES)
            ]
        )
        c.set_terminated(rid)
        return ms

    return run


def ml_by_hand(uri):  # i4_loggers.py: one log_batch per member and step
    def run(r):
        log = MLflowMembers(
            N, "hand", hparams={"lr": LRS}, tracking_uri=uri, run_name=f"h{r}", flush_every=1
        )
        ms = per_step(lambda: [log.log({"train_loss": loss}, s) for s, loss in enumerate(LOSSES)])
        log.close()
        return ms

    return run


def ml_members(uri):
    def run(r):
        log = MLflowMembers(
            N, "members", hparams={"lr": LRS}, tracking_uri=uri, run_name=f"m{r}", flush_every=50
        )

        def steps():
            for s, loss in enumerate(LOSSES):
                log.log({"train_loss": loss}, s)
            log.flush()

        ms = per_step(steps)
        log.close()
        return ms

    return run


# W&B offline
import wandb  # noqa: E402


def wb_one(r):
    run = wandb.init(project="bench", name="one", mode="offline", dir=tmp, reinit="create_new")
    ms = per_step(
        lambda: [
            run.log({"train/loss": float(loss.sum())}, step=s) for s, loss in enumerate(LOSSES)
        ]
    )
    run.finish()
    return ms


def wb_members(r):
    t = time.perf_counter()
    log = WandbMembers(N, group=f"g{r}", hparams={"lr": LRS}, project="bench", dir=tmp)
    init_s.append(time.perf_counter() - t)
    ms = per_step(lambda: [log.log({"train/loss": loss}, s) for s, loss in enumerate(LOSSES)])
    t = time.perf_counter()
    log.close()
    init_s.append(time.perf_counter() - t)
    return ms


init_s: list[float] = []
rows = [("TensorBoard", best(tb_one), best(tb_members), None)]
for name, uri in (
    ("MLflow file store", f"file:{tmp}/mlruns"),
    ("MLflow sqlite", f"sqlite:///{tmp}/ml.db"),
):
    rows.append((name, best(ml_one(uri)), best(ml_members(uri)), best(ml_by_hand(uri))))
rows.append(("W&B offline", best(wb_one), best(wb_members), None))
print(f"N={N} members, {STEPS} steps, best of {REPEATS}; ms per step (machine shared, 1 thread)")
print(
    f"{'tool':20s} {'1 run, summed loss':>20s} {'16 member runs':>16s} {'ratio':>7s} {'by hand (i4)':>14s}"
)
for name, one, members, hand in rows:
    h = f"{hand:10.2f} ms" if hand is not None else ""
    print(f"{name:20s} {one:17.3f} ms {members:13.3f} ms {members / one:6.1f}x {h:>14s}")
print(
    f"W&B: 16 runs opened+closed in {sum(init_s) / REPEATS:.1f} s per repeat (wandb.init / finish, not per step)"
)
