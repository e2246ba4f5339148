"""Eight MLPs with eight learning rates trained by `pytorch_lightning.Trainer` as one stack:
each member clipped by its own norm, logged, and early-stopped on its own. With
`StackModule(step="auto")` phalanx runs the whole step (`member_step`), captured by
`phalanx.compile_step` where that measures faster.
Needs `pip install 'phalanx[lightning]'`. Run: python docs/guides/lightning_sweep.py
"""

import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.integrations.lightning import MemberEarlyStopping, StackModule

warnings.filterwarnings("ignore", module="pytorch_lightning|lightning_fabric")  # CPU notes


class Sweep(StackModule):
    def __init__(self, lrs: list[float]) -> None:
        super().__init__(step="auto")  # phalanx's step (manual optimization), captured if faster
        self.lrs = lrs
        self.stack = phalanx.stack(
            lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)),
            num_members=len(lrs),
            seed=0,
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        # zero_grad, forward, member_losses, backward, each member clipped by its own norm,
        # the optimizer step (stopped members masked): one call, (N,) losses
        losses = self.member_step(F.cross_entropy, x, y, max_norm=1.0)
        self.log_members("train_loss", losses)  # train_loss/member_0, ...

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log_members("val_loss", phalanx.member_losses(F.cross_entropy, self.stack(x), y))

    def configure_optimizers(self):
        return phalanx.optim.SGD(self.stack.parameters(), lr=self.lrs)


torch.manual_seed(0)
x = torch.randn(512, 10)
y = (x[:, :3] + 0.3 * torch.randn(512, 3)).argmax(1)
train = DataLoader(TensorDataset(x[:384], y[:384]), batch_size=32, shuffle=True)
val = DataLoader(TensorDataset(x[384:], y[384:]), batch_size=128)

stopper = MemberEarlyStopping("val_loss", patience=2)  # each member on its own val_loss
trainer = pl.Trainer(
    max_epochs=6, callbacks=[stopper], accelerator="cpu",
    logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)  # fmt: skip
model = Sweep(torch.logspace(-3, 1, 8).tolist())
trainer.fit(model, train, val)
print("members still training:", model.member_mask.int().tolist())
print("stopped at epoch (-1: never):", stopper.stopped_epoch.tolist())
print("step:", model.step_choice)  # "captured" where it measured faster
