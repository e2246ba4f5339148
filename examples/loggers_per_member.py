"""One TensorBoard run, one W&B run (offline) and one MLflow child run per member, each with
its member's learning rate, from a stack trained by hand."""

import os
import tempfile
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.integrations.loggers import MLflowMembers, TensorBoardMembers, WandbMembers

warnings.filterwarnings("ignore")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
torch.set_num_threads(1)
N = 4
out = tempfile.mkdtemp()
stack = phalanx.stack(lambda: nn.Linear(10, 3), num_members=N, seed=0)
opt = phalanx.optim.SGD(stack.parameters(), lr=[0.01, 0.03, 0.1, 0.3])
hparams = opt.hyperparameters()  # {"lr": (N,), ...}: each run gets its member's values
loggers = [
    TensorBoardMembers(os.path.join(out, "tb"), N, hparams={"lr": hparams["lr"]}),
    WandbMembers(N, group="sweep-0", hparams={"lr": hparams["lr"]}, project="phalanx", dir=out),
    MLflowMembers(N, "sweep", hparams={"lr": hparams["lr"]}, tracking_uri=f"file:{out}/mlruns"),
]
x, y = torch.randn(256, 10), torch.randint(0, 3, (256,))
for step in range(20):
    losses = phalanx.member_losses(F.cross_entropy, stack(x), y)  # (N,)
    opt.zero_grad()
    losses.sum().backward()
    opt.step()
    for log in loggers:
        log.log({"train/loss": losses}, step=step)
for log in loggers:
    log.close({"final_loss": losses})
print("TensorBoard runs:", sorted(os.listdir(os.path.join(out, "tb"))))
print(
    "W&B offline runs:",
    len([d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run")]),
)
client = loggers[2].client
children = [client.get_run(r) for r in loggers[2].run_ids]
print("MLflow child runs:", [(c.info.run_name, c.data.params["lr"]) for c in children])
