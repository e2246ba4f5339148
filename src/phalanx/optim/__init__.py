"""Optimizers that treat the N members of a stack as N independent experiments.

Every hyperparameter is a number or an (N,) tensor, steps take a per-member ``mask``, and
``skip_nonfinite=True`` isolates members whose loss or gradients are not finite.
"""

from phalanx._warnings import NonFiniteWarning

from ._adagrad import Adagrad
from ._adam import Adam, AdamW, adam_update
from ._base import MemberOptimizer
from ._lbfgs import LBFGS
from ._lion import Lion
from ._schedule import MemberLambdaLR, MemberScheduler
from ._settings import Setting
from ._sgd import SGD

__all__ = [
    "LBFGS",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Lion",
    "MemberLambdaLR",
    "MemberOptimizer",
    "MemberScheduler",
    "NonFiniteWarning",
    "Setting",
    "adam_update",
]


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
