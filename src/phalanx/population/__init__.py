"""Populations that learn from each other: PBT and early stopping inside one stack.

A stack already holds N experiments side by side. Here members copy each other and stop:

- `copy_members(stack, source, target, optimizer=, loader=)`: targets become exact copies
  of their sources (weights, buffers, optimizer state and step counts, hyperparameters, and
  the data stream if the loader is given), also across ranks with `shard=`;
- `keep_members(stack, members, optimizer=, loader=)`: a smaller stack of those members,
  with the optimizer and loader compacted to follow it;
- `PBT`: population-based training (exploit the top quantile, explore hyperparameters);
- `SuccessiveHalving` with ASHA's `rungs`: stop the worse half at each milestone;
- `lineage`: where a member's weights came from, following the PBT log back;
- `plot_population`: each member's hyperparameter schedule and the metric with exploits.

Example:
    >>> pbt = phalanx.population.PBT(stack, opt, {"lr": LogUniform(1e-4, 1.0)}, interval=100, mode="max")
    >>> if pbt.ready(step):
    ...     pbt.exploit(val_acc, step=step)
"""

from phalanx.population._halving import SuccessiveHalving, rungs
from phalanx.population._mutations import Factors, LogUniform, Uniform
from phalanx.population._pbt import PBT
from phalanx.population._plot import lineage, plot_population
from phalanx.population._surgery import copy_members, keep_members

__all__ = [
    "PBT",
    "Factors",
    "LogUniform",
    "SuccessiveHalving",
    "Uniform",
    "copy_members",
    "keep_members",
    "lineage",
    "plot_population",
    "rungs",
]
