"""Eight MLPs with eight learning rates trained by pytorch_lightning.Trainer as one stack:
each member clipped with its own norm, logged, early-stopped and checkpointed on its own.
phalanx runs each step (StackModule(step="auto")), captured by phalanx.compile_step where that
measures faster."""

import tempfile
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.integrations.lightning import MemberCheckpoint, MemberEarlyStopping, StackModule

warnings.filterwarnings("ignore", module="pytorch_lightning|lightning_fabric")
torch.set_num_threads(1)
N = 8
LRS = torch.logspace(-3, 1, N).tolist()  # each member stops when its own val_loss stalls


class Sweep(StackModule):
    def __init__(self, lrs=LRS):
        super().__init__(step="auto")  # member_step below; "eager" or "captured" to choose
        self.save_hyperparameters()
        self.stack = phalanx.stack(
            lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)),
            num_members=len(lrs),
            seed=0,
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        # zero_grad, forward, member_losses, backward, each member clipped by its own norm,
        # the step (stopped members masked): one call, the (N,) losses
        losses = self.member_step(F.cross_entropy, x, y, max_norm=1.0)
        self.log_members("train_loss", losses)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log_members("val_loss", phalanx.member_losses(F.cross_entropy, self.stack(x), y))

    def configure_optimizers(self):
        return phalanx.optim.SGD(self.stack.parameters(), lr=list(self.hparams.lrs))


torch.manual_seed(0)
x = torch.randn(512, 10)
y = (x[:, :3] + 0.3 * torch.randn(512, 3)).argmax(1)
train = DataLoader(TensorDataset(x[:384], y[:384]), batch_size=32, shuffle=True)
val = DataLoader(TensorDataset(x[384:], y[384:]), batch_size=128)
out = tempfile.mkdtemp()
members = MemberCheckpoint(out, monitor="val_loss")
stopper = MemberEarlyStopping("val_loss", patience=2)
trainer = pl.Trainer(
    max_epochs=8,
    accelerator="cpu",
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=out,
    callbacks=[stopper, members],
)
model = Sweep()
trainer.fit(model, train, val)
print("members still training:", model.member_mask.int().tolist())
print("stopped at epoch (-1: never):", stopper.stopped_epoch.tolist())
print("step:", model.step_choice)
print("best val_loss per member:", [round(float(v), 3) for v in members.best])
trainer.save_checkpoint(f"{out}/last.ckpt")
back = Sweep.load_from_checkpoint(f"{out}/last.ckpt")
print(
    "load_from_checkpoint: same weights and mask:",
    torch.equal(back.stack.module[0].weight, model.stack.module[0].weight)
    and torch.equal(back.member_mask, model.member_mask),
)
