"""Populations that learn from each other: PBT and early stopping inside one stack.

A stack already holds N experiments side by side. Here members copy each other and stop:

- ``copy_members(stack, source, target, optimizer=, loader=)``: targets become exact copies
  of their sources (weights, buffers, optimizer state and step counts, hyperparameters, and
  the data stream if the loader is given), also across ranks with ``shard=``;
- ``keep_members(stack, members, optimizer=, loader=)``: a smaller stack of those members,
  with the optimizer and loader compacted to follow it;
- ``PBT``: population-based training (exploit the top quantile, explore hyperparameters);
- ``SuccessiveHalving`` with ASHA's ``rungs``: stop the worse half at each milestone;
- ``TrainStep`` (``PBT.train_step``, ``SuccessiveHalving.train_step``): the training step
  that follows the driver's stack, captured (``compile_step``) or eager by ``step=``;
- ``lineage``: where a member's weights came from, following the PBT log back;
- ``plot_population``: each member's hyperparameter schedule and the metric with exploits.

Example:
    >>> X, Y = torch.randn(64, 4), torch.randn(64, 1)
    >>> stack = phalanx.stack(lambda: nn.Linear(4, 1), num_members=8)
    >>> opt = phalanx.optim.SGD(stack.parameters(), lr=torch.logspace(-3, 0, 8))  # (N,) rates
    >>> lr = phalanx.population.LogUniform(1e-3, 1.0)
    >>> pbt = phalanx.population.PBT(stack, opt, {"lr": lr}, interval=10, mode="min")
    >>> for step in range(1, 41):
    ...     opt.zero_grad()
    ...     phalanx.member_losses(F.mse_loss, stack(X), Y).sum().backward()
    ...     opt.step()
    ...     if pbt.ready(step):  # the worst quarter copies the best quarter, then explores
    ...         _ = pbt.exploit(phalanx.metrics.loss(F.mse_loss, stack(X), Y), step=step)
    >>> len(pbt.log)  # exploits: 2 of the 8 members at each of steps 10, 20, 30, 40
    8
"""

from phalanx.population._halving import SuccessiveHalving, rungs
from phalanx.population._mutations import Factors, LogUniform, Uniform
from phalanx.population._pbt import PBT
from phalanx.population._plot import lineage, plot_population
from phalanx.population._step import TrainStep
from phalanx.population._surgery import copy_members, keep_members

__all__ = [
    "PBT",
    "Factors",
    "LogUniform",
    "SuccessiveHalving",
    "TrainStep",
    "Uniform",
    "copy_members",
    "keep_members",
    "lineage",
    "plot_population",
    "rungs",
]


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
