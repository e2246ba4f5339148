"""How population-based training changes a hyperparameter: lists, samplers and factors.

A mutation is one of

- a list (or tuple) of values: resampling picks one at random, perturbing moves to a
  neighbouring entry (Ray Tune's rule for categorical values);
- a sampler, ``LogUniform(lo, hi)``, ``Uniform(lo, hi)`` or any callable ``f(generator) -> float``:
  resampling draws a new value, perturbing multiplies by one of the driver's factors (1.2 or
  0.8 by default), kept in [lo, hi] for the two samplers given here;
- ``Factors(0.5, 2.0)``: perturbing multiplies by one of these factors; never resampled.

All randomness comes from the driver's ``torch.Generator``, saved in its checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

__all__ = ["Factors", "LogUniform", "Mutation", "Uniform", "check_mutation", "mutate"]


@dataclass(frozen=True)
class LogUniform:
    """Values whose logarithm is uniform in [log lo, log hi]; perturbations stay inside."""

    low: float
    high: float

    def __call__(self, generator: torch.Generator) -> float:
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        return math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))


@dataclass(frozen=True)
class Uniform:
    """Values uniform in [lo, hi]; perturbations stay inside."""

    low: float
    high: float

    def __call__(self, generator: torch.Generator) -> float:
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        return self.low + u * (self.high - self.low)


@dataclass(frozen=True)
class Factors:
    """Perturb only: multiply by one of ``factors``, chosen at random; never resample."""

    factors: tuple[float, ...]

    def __init__(self, *factors: float) -> None:
        object.__setattr__(self, "factors", tuple(float(f) for f in factors))


Mutation: TypeAlias = Sequence[Any] | Callable[[torch.Generator], float] | Factors


def check_mutation(name: str, mutation: Any, where: str) -> None:
    """Raises a ValueError naming the hyperparameter when ``mutation`` is none of the forms."""
    if isinstance(mutation, Factors):
        bad = not mutation.factors or any(f <= 0 for f in mutation.factors)
    elif isinstance(mutation, LogUniform | Uniform):
        bad = not mutation.low < mutation.high or (
            isinstance(mutation, LogUniform) and mutation.low <= 0
        )
    elif isinstance(mutation, list | tuple):
        bad = len(mutation) == 0
    else:
        bad = not callable(mutation)
    if bad:
        raise ValueError(
            f"{where}: the mutation of {name!r} is {mutation!r}; give a non-empty list of values, "
            "LogUniform(lo, hi) or Uniform(lo, hi) with 0 < lo < hi (lo < hi for Uniform), a "
            "callable f(generator) -> float, or Factors(f1, f2, ...) with positive factors."
        )


def _choice(options: Sequence[Any], generator: torch.Generator) -> Any:
    return options[int(torch.randint(len(options), (), generator=generator))]


def _entry(value: Any, options: list[Any]) -> int | None:
    """The index of ``value`` in ``options``: equal, or equal once both are rounded to float32.

    A hyperparameter held as a float32 tensor (torch's default dtype) is the float32 nearest
    its list entry, so 0.9 comes back as 0.8999999762; it is still that entry.
    """
    if value in options:
        return options.index(value)
    if not isinstance(value, int | float):
        return None
    rounded = torch.tensor(float(value), dtype=torch.float32)
    for k, option in enumerate(options):
        number = isinstance(option, int | float) and not isinstance(option, bool)
        if number and bool(torch.tensor(float(option), dtype=torch.float32) == rounded):
            return k
    return None


def mutate(
    value: Any,
    mutation: Mutation,
    *,
    resample_probability: float,
    factors: Sequence[float],
    generator: torch.Generator,
) -> Any:
    """The explored value of one hyperparameter (Ray Tune's PBT explore step)."""
    resample = float(torch.rand((), generator=generator, dtype=torch.float64))
    if isinstance(mutation, Factors):
        return value * _choice(mutation.factors, generator)
    if isinstance(mutation, list | tuple):
        options = list(mutation)
        at = _entry(value, options)
        if resample < resample_probability or at is None:
            return _choice(options, generator)
        k = at + _choice((-1, 1), generator)
        return options[min(max(k, 0), len(options) - 1)]
    if not callable(mutation):
        raise TypeError(f"phalanx.population: {mutation!r} is not a mutation.")
    if resample < resample_probability:
        return mutation(generator)
    new = value * _choice(list(factors), generator)
    if isinstance(mutation, LogUniform | Uniform):
        new = min(max(new, mutation.low), mutation.high)
    return new
