"""Population-based training (Jaderberg et al. 2017) inside one stack.

Every ``interval`` steps the members are ranked by a metric; each member of the bottom
quantile becomes a copy of a random member of the top quantile (weights, optimizer state,
hyperparameters: the exploit) and then changes its hyperparameters (the explore). Since all
members step together, every member is ready at once: this is synchronous PBT, with Ray
Tune's defaults (quantile 0.25, resample probability 0.25, perturbation factors 1.2 / 0.8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx.checkpoint import _single as checkpoint
from phalanx.data import MemberLoader
from phalanx.distributed import _checkpoint as sharded
from phalanx.optim import MemberOptimizer
from phalanx.population._mutations import Mutation, check_mutation, mutate
from phalanx.population._rows import check_run
from phalanx.population._step import StepMode, TrainStep
from phalanx.population._surgery import copy_members

if TYPE_CHECKING:
    from phalanx.core._stack import Stack
    from phalanx.distributed import Shard

__all__ = [
    "PBT",
    "check_flat_hyperparameters",
    "check_mode",
    "flat_hyperparameters",
    "ranking",
    "set_flat_hyperparameters",
]


def check_mode(mode: Any, where: str) -> None:
    """``mode`` must be said: a loss ranked as an accuracy would keep the worst members."""
    if mode not in ("max", "min"):
        raise ValueError(
            f"{where}: mode must be 'max' (a larger metric is better: accuracy) or 'min' (a "
            f"loss); got {mode!r}. It has no default, since the wrong one keeps the worst "
            "members."
        )


def flat_hyperparameters(optimizer: MemberOptimizer) -> dict[str, Tensor]:
    """``optimizer.hyperparameters()`` with each tuple setting split into its parts, as the
    rule's ``SETTINGS`` names them: Adam's betas as beta1, beta2."""
    parts = {s.name: s.parts for s in optimizer.SETTINGS if s.parts}
    out: dict[str, Tensor] = {}
    for name, value in optimizer.hyperparameters().items():
        if isinstance(value, tuple) and name in parts:
            out.update(zip(parts[name], value, strict=True))
        elif isinstance(value, Tensor):
            out[name] = value
    return out


def _unflat(
    optimizer: MemberOptimizer, members: Any, values: Mapping[str, Tensor]
) -> dict[str, Any]:
    """Parts back into their tuple setting (beta1 / beta2 into betas), the other parts as the
    members have them now."""
    out: dict[str, Any] = dict(values)
    for s in optimizer.SETTINGS:
        if s.parts and any(k in out for k in s.parts):
            index = torch.as_tensor(range(optimizer.num_members) if members is None else members)
            current = flat_hyperparameters(optimizer)
            out[s.name] = tuple(out.pop(k) if k in out else current[k][index] for k in s.parts)
    return out


def set_flat_hyperparameters(
    optimizer: MemberOptimizer, members: Any, values: Mapping[str, Tensor]
) -> None:
    optimizer.set_hyperparameters(members, **_unflat(optimizer, members, values))


def check_flat_hyperparameters(
    optimizer: MemberOptimizer, members: Any, values: Mapping[str, Tensor], copied_from: Any
) -> None:
    optimizer.check_hyperparameters(
        members, copied_from=copied_from, **_unflat(optimizer, members, values)
    )


def ranking(metric: Tensor, mode: str) -> Tensor:
    """Member indices from best to worst; NaN counts as worst, ties keep index order."""
    worst = -math.inf if mode == "max" else math.inf
    key = torch.nan_to_num(metric.detach().double().cpu(), nan=worst)
    return torch.sort(key, descending=mode == "max", stable=True).indices


class PBT:
    """Population-based training of the members of one stack.

    Args:
        stack: the stack, N members (this rank's block with ``shard``).
        optimizer: its phalanx optimizer; PBT reads and writes its per-member hyperparameters
            (those of param group 0 are read; writes go to every group).
        mutations: hyperparameter name (``"lr"``, ``"momentum"``, ``"weight_decay"``, Adam's
            ``"beta1"`` and ``"beta2"``, ...) to how
            it changes: a list of values, a sampler (``LogUniform``, ``Uniform``, or
            ``f(generator) -> float``) or ``Factors(...)``; see ``phalanx.population``.
        interval: steps between exploits (the ready interval).
        loader: the stack's MemberLoader; with ``copy_data``, a copied member also takes its
            source's data stream.
        copy_data: see ``loader``. Off by default: each member keeps its own data.
        quantile: the fraction of members replaced each time, and of members copied from
            (at most half the members).
        resample_probability: chance that explore draws a fresh value instead of perturbing.
        perturb: the factors a perturbation multiplies by, one chosen at random.
        mode: "max" if a larger metric is better (accuracy), "min" for a loss; required.
        seed: seeds the driver's own generator (the same seed on every rank).
        shard: with ``phalanx.distributed``, this rank's Shard; metrics are gathered and
            members copied across ranks.

    Attributes:
        log: one dict per exploit: step, member, source, their metrics, and the member's new
            hyperparameters.
        history: one dict per ready step (and one for step 0): step, every member's metric
            (None at step 0) and every member's hyperparameters from that step on.

    Example:
        >>> X, Y = torch.randn(64, 4), torch.randn(64, 1)
        >>> stack = phalanx.stack(lambda: nn.Linear(4, 1), num_members=8)
        >>> opt = phalanx.optim.SGD(stack.parameters(), lr=torch.logspace(-3, 0, 8))
        >>> pbt = phalanx.population.PBT(
        ...     stack, opt, {"lr": phalanx.population.LogUniform(1e-3, 1.0)}, interval=10,
        ...     mode="min")
        >>> for step in range(1, 41):
        ...     opt.zero_grad()
        ...     phalanx.member_losses(F.mse_loss, stack(X), Y).sum().backward()
        ...     opt.step()
        ...     if pbt.ready(step):
        ...         _ = pbt.exploit(phalanx.metrics.loss(F.mse_loss, stack(X), Y), step=step)
        >>> pbt.log[0]  # member 0 (worst quarter) copied member 6 (best quarter), then explored
        {'step': 10, 'member': 0, 'source': 6, 'metric': 1.39..., 'source_metric': 0.62...,
         'hyperparameters': {'lr': 0.0014...}}
    """

    def __init__(
        self,
        stack: Stack,
        optimizer: MemberOptimizer,
        mutations: Mapping[str, Mutation],
        *,
        interval: int,
        loader: MemberLoader | None = None,
        copy_data: bool = False,
        quantile: float = 0.25,
        resample_probability: float = 0.25,
        perturb: Sequence[float] = (1.2, 0.8),
        mode: str | None = None,
        seed: int = 0,
        shard: Shard | None = None,
    ) -> None:
        where = "phalanx.population.PBT()"
        if optimizer is None:
            raise TypeError(f"{where}: PBT needs the stack's phalanx optimizer; pass it.")
        check_run(stack, optimizer, loader, where)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{where}: interval must be a positive int (steps); got {interval!r}.")
        if not 0 < quantile <= 0.5:
            raise ValueError(f"{where}: quantile must be in (0, 0.5]; got {quantile!r}.")
        if not 0 <= resample_probability <= 1:
            raise ValueError(
                f"{where}: resample_probability must be in [0, 1]; got {resample_probability!r}."
            )
        check_mode(mode, where)
        if copy_data and loader is None:
            raise ValueError(f"{where}: copy_data=True needs the loader: pass loader=.")
        if not mutations:
            raise ValueError(f"{where}: give at least one hyperparameter to mutate.")
        current = flat_hyperparameters(optimizer)
        for name, mutation in mutations.items():
            value = current.get(name)
            if not isinstance(value, Tensor) or value.dtype == torch.bool:
                usable = [
                    k for k, v in current.items() if isinstance(v, Tensor) and v.is_floating_point()
                ]
                raise ValueError(
                    f"{where}: {type(optimizer).__name__} has no per-member number "
                    f"hyperparameter {name!r} to mutate; choose from {', '.join(usable)}."
                )
            check_mutation(name, mutation, where)
        if "lr" in mutations and any(
            g["member_lr"] is not None and g["lr"] != (g.get("lr_reference") or 1.0)
            for g in optimizer.param_groups
        ):
            raise ValueError(
                f"{where}: a torch LR scheduler scales group['lr'] of this optimizer, so PBT's "
                "learning rates would not be the rates members step with; drop the scheduler "
                "or leave 'lr' out of the mutations."
            )
        if "lr" in mutations and optimizer.member_schedules():
            raise ValueError(
                f"{where}: a per-member schedule ({type(optimizer.member_schedules()[0]).__name__})"
                " writes this optimizer's learning rates at each of its steps, so PBT's rates "
                "would be overwritten; drop the schedule or leave 'lr' out of the mutations."
            )
        self.stack = stack
        self.optimizer = optimizer
        self.mutations = dict(mutations)
        self.interval = interval
        self.loader = loader
        self.copy_data = copy_data
        self.quantile = quantile
        self.resample_probability = resample_probability
        self.perturb = tuple(float(f) for f in perturb)
        self.mode = mode
        self.shard = shard
        self.generator = torch.Generator().manual_seed(seed)
        # Every mutated hyperparameter becomes one value per member, exactly as it was.
        set_flat_hyperparameters(optimizer, None, {k: current[k] for k in self.mutations})
        self.log: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = [
            {"step": 0, "metric": None, "hyperparameters": self._lists(self._hypers())}
        ]
        self.last_step = 0

    @property
    def num_members(self) -> int:
        """N, over all ranks."""
        return self.shard.num_members if self.shard is not None else len(self.stack)

    def train_step(
        self, loss_fn: Callable[..., Tensor] | None, *, step: StepMode = "auto", **kwargs: Any
    ) -> TrainStep:
        """The stack's training step: captured where ``compile_step`` measures it faster.

        Exploits copy members in place and set their hyperparameters, which the step reads
        at every call, so one step serves the whole run.

        Args:
            loss_fn: as for :func:`phalanx.compile_step`.
            step: "auto" (the captured step where its timing keeps it), "captured" or
                "eager"; ``.choice`` says which runs, and the ``phalanx`` logger says it.
            **kwargs: ``compile_step``'s ``in_dims``, ``target_in_dims``, ``kw_in_dims``,
                ``max_norm``, ``norm_type``, ``backend``.
        """
        return TrainStep(self.stack, loss_fn, self.optimizer, step=step,
                         where="phalanx.population.PBT.train_step()", **kwargs)  # fmt: skip

    def ready(self, step: int) -> bool:
        """True when ``step`` is a multiple of the interval not exploited yet."""
        return step > self.last_step and step % self.interval == 0

    def _hypers(self) -> dict[str, Tensor]:
        """Every member's mutated hyperparameters, (N,) float64 each, over all ranks."""
        values = flat_hyperparameters(self.optimizer)
        out = {name: values[name] for name in self.mutations}
        if self.shard is not None:
            out = self.shard.gather(out)
        return out

    @staticmethod
    def _lists(values: Mapping[str, Tensor]) -> dict[str, list[float]]:
        return {name: v.tolist() for name, v in values.items()}

    @torch.no_grad()
    def exploit(self, metric: Tensor, *, step: int) -> list[dict[str, Any]]:
        """Replaces the bottom quantile by mutated copies of the top quantile.

        Args:
            metric: (N,) one value per member (this rank's members with ``shard``), e.g.
                validation accuracy; NaN ranks last.
            step: the training step, for the log.

        Returns:
            This round's entries of ``log``.

        Raises:
            ValueError: ``metric`` has another number of members.
        """
        where = "phalanx.population.PBT.exploit()"
        metric = torch.as_tensor(metric).detach()
        local = len(self.stack)
        if metric.shape != (local,):
            raise ValueError(
                f"{where}: metric must hold one value per member of this stack, shape "
                f"({local},); got {tuple(metric.shape)}."
            )
        check_run(self.stack, self.optimizer, self.loader, where)
        if self.shard is not None:
            metric = self.shard.gather(metric)
        metric = metric.double().cpu()
        state = self.generator.get_state()
        try:
            return self._exploit(metric, step)
        except Exception:
            self.generator.set_state(state)  # a refused exploit draws nothing either
            raise

    def _exploit(self, metric: Tensor, step: int) -> list[dict[str, Any]]:
        n = self.num_members
        count = math.ceil(n * self.quantile)
        if count > n / 2:
            count = n // 2
        order = ranking(metric, str(self.mode))
        top, bottom = order[:count].tolist(), sorted(order[n - count :].tolist())
        hypers = self._hypers()
        events, sources = [], []
        for target in bottom:
            source = top[int(torch.randint(len(top), (), generator=self.generator))]
            new = {
                name: float(
                    mutate(
                        float(hypers[name][source]),
                        mutation,
                        resample_probability=self.resample_probability,
                        factors=self.perturb,
                        generator=self.generator,
                    )
                )
                for name, mutation in self.mutations.items()
            }
            sources.append(source)
            events.append(
                {
                    "step": step,
                    "member": target,
                    "source": source,
                    "metric": float(metric[target]),
                    "source_metric": float(metric[source]),
                    "hyperparameters": new,
                }
            )
        if events:
            # Check the explore before the exploit copies anything: a refused value (SGD's
            # Nesterov rule) then changes nothing.
            self._set(bottom, [e["hyperparameters"] for e in events], sources, check=True)
            loader = self.loader if self.copy_data else None
            copy_members(
                self.stack, sources, bottom, optimizer=self.optimizer, loader=loader,
                shard=self.shard,
            )  # fmt: skip
            self._set(bottom, [e["hyperparameters"] for e in events])
        self.log += events
        self.history.append(
            {
                "step": step,
                "metric": metric.tolist(),
                "hyperparameters": self._lists(self._hypers()),
            }
        )
        self.last_step = step
        return events

    def _set(
        self,
        targets: list[int],
        values: list[dict[str, float]],
        sources: list[int] | None = None,
        *,
        check: bool = False,
    ) -> None:
        """Writes each target's new hyperparameters (targets are global indices); with
        ``check``, only checks them as they would be after copying from ``sources``."""
        start = self.shard.start if self.shard is not None else 0
        local = range(len(self.stack))
        mine = [
            (k, t - start, v) for k, (t, v) in enumerate(zip(targets, values)) if t - start in local
        ]
        if not mine:
            return
        members = [j for _, j, _ in mine]
        new = {
            name: torch.tensor([v[name] for _, _, v in mine], dtype=torch.float64)
            for name in self.mutations
        }
        if not check:
            set_flat_hyperparameters(self.optimizer, members, new)
            return
        copied = None
        if sources is not None and all(sources[k] - start in local for k, _, _ in mine):
            copied = [sources[k] - start for k, _, _ in mine]
        check_flat_hyperparameters(self.optimizer, members, new, copied)

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The driver's generator, log, history and last exploit step (no hyperparameters:
        they live in the optimizer's state)."""
        return {
            "generator": self.generator.get_state(),
            "log": self.log,
            "history": self.history,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` saved."""
        self.generator.set_state(state["generator"].to(torch.uint8))
        self.log = list(state["log"])
        self.history = list(state["history"])
        self.last_step = int(state["last_step"])

    def save(self, path: str, **extra: Any) -> None:
        """Saves the stack, optimizer, loader and this driver: one ``phalanx.save`` file, or,
        with a ``shard`` over several ranks, one ``phalanx.distributed.save`` directory (called
        on every rank; the driver's state is the same on every rank and is compared before
        the commit)."""
        if self.shard is not None and self.shard.world_size > 1:
            sharded.save(
                path, self.stack, optimizer=self.optimizer, loader=self.loader,
                shard=self.shard, population=self.state_dict(), **extra,
            )  # fmt: skip
            return
        checkpoint.save(
            path, self.stack, optimizer=self.optimizer, loader=self.loader,
            population=self.state_dict(), **extra,
        )  # fmt: skip

    def load(self, path: str) -> dict[str, Any]:
        """Restores a run saved by ``save`` into this driver's stack, optimizer and loader.

        Returns:
            The other ``extra`` values given to ``save``.
        """
        if self.shard is not None and self.shard.world_size > 1:
            extra = sharded.load(
                path, self.stack, optimizer=self.optimizer, loader=self.loader, shard=self.shard
            )
        else:
            extra = checkpoint.load(path, self.stack, optimizer=self.optimizer, loader=self.loader)
        self.load_state_dict(extra.pop("population"))
        return extra
