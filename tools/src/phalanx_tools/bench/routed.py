"""``phalanx bench --routed``: routed members against the loops people write for them.

Four workloads, each timed side by side in one process on identical weights and inputs,
contenders interleaved round by round (``timing.interleaved``), for a forward under
``torch.no_grad`` and a training step (forward, a fixed weighted sum as the loss, backward):

- ``moe``: a Mixtral-style sparse MoE layer: E=8 SwiGLU experts (H=256, I=512), top-2 of a
  linear router, 4096 tokens. Against transformers v4's ``MixtralSparseMoeBlock`` loop over an
  ``nn.ModuleList`` (written out here, unchanged in substance), and against transformers 5's
  ``MixtralExperts`` with its ``grouped_mm`` implementation when transformers is installed.
- ``pets``: PETS trajectory sampling (TS1): 7 Gaussian dynamics members (mbrl-lib's
  GaussianMLP, SiLU 4x200), 20 particles x 500 states, each particle a random member. Against
  the loop over the members (select, forward, scatter).
- ``kilonerf``: 512 tiny fields (positional encoding, 27-32-32-4) evaluating 32768 points,
  each point by the field of its 8x8x8 grid cell. Against the loop over the cells.
- ``redq``: REDQ's target, 2 of 10 critics (CleanRL's SoftQNetwork, 256-256-1), B=256.
  Against the loop over the 2 chosen modules.

Each workload also runs torch.func's ensembling recipe written for the routed call
(``TorchFuncRouted``: every member on every row then picked, each row's member's parameters
gathered, or the chosen members indexed).

Every contender is first checked against the loop (outputs and gradients to float
tolerance); a contender that disagrees is reported as wrong and not timed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx_tools.bench.timing import interleaved
from phalanx_tools.threads import intra_op_threads

GOALS = {"moe": 1.5, "pets": 1.5, "kilonerf": 2.0, "redq": 1.5}  # issue 26


# ------------------------------------------------------------------------------------ members


class SwiGLUExpert(nn.Module):
    """transformers v4's MixtralBlockSparseTop2MLP: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class V4MoE(nn.Module):
    """transformers v4's MixtralSparseMoeBlock forward (no jitter): the loop over experts."""

    def __init__(self, gate: nn.Linear, experts: list[nn.Module], top_k: int) -> None:
        super().__init__()
        self.gate, self.experts, self.top_k = gate, nn.ModuleList(experts), top_k
        self.num_experts = len(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(x.dtype)
        final = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            idx, top_x = torch.where(mask[e].squeeze(0))
            current = self.experts[e](x[None, top_x].reshape(-1, x.shape[-1]))
            final.index_add_(0, top_x, (current * routing_weights[top_x, idx, None]).to(x.dtype))
        return final


class PhalanxMoE(nn.Module):
    """The same layer with the experts as one stack: route, then one routed call."""

    def __init__(self, gate: nn.Linear, experts: list[nn.Module], top_k: int) -> None:
        super().__init__()
        self.gate, self.top_k = gate, top_k
        self.experts = phalanx.stack(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weights = phalanx.routing.top_k(self.gate(x), self.top_k)
        return self.experts(x, members=index, weights=weights)


class V5MoE(nn.Module):
    """transformers 5's MixtralExperts (3-D weights) with one of its implementations."""

    def __init__(self, gate: nn.Linear, experts: list[Any], top_k: int, impl: str):
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        w1 = experts[0].w1
        config = MixtralConfig(hidden_size=w1.in_features, intermediate_size=w1.out_features,
                               num_local_experts=len(experts), num_experts_per_tok=top_k,
                               hidden_act="silu")  # fmt: skip
        config._experts_implementation = impl
        self.gate, self.top_k = gate, top_k
        self.experts = MixtralExperts(config)
        with torch.no_grad():
            self.experts.gate_up_proj.copy_(
                torch.stack([torch.cat([m.w1.weight, m.w3.weight]) for m in experts])
            )
            self.experts.down_proj.copy_(torch.stack([m.w2.weight for m in experts]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights = F.softmax(logits, dim=1, dtype=torch.float)
        weights, index = torch.topk(weights, self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return self.experts(x, index, weights.to(x.dtype))


class GaussianMLP(nn.Module):
    """mbrl-lib's GaussianMLP for one member: SiLU MLP -> mean and a bounded log-variance."""

    def __init__(self, in_size: int, out_size: int, hidden: int = 200, layers: int = 4) -> None:
        super().__init__()
        body: list[nn.Module] = [nn.Linear(in_size, hidden), nn.SiLU()]
        for _ in range(layers - 1):
            body += [nn.Linear(hidden, hidden), nn.SiLU()]
        self.hidden_layers = nn.Sequential(*body)
        self.mean_and_logvar = nn.Linear(hidden, 2 * out_size)
        self.out_size = out_size
        self.min_logvar = nn.Parameter(-10 * torch.ones(1, out_size))
        self.max_logvar = nn.Parameter(0.5 * torch.ones(1, out_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.mean_and_logvar(self.hidden_layers(x))
        mean, logvar = h[..., : self.out_size], h[..., self.out_size :]
        logvar = self.max_logvar - F.softplus(self.max_logvar - logvar)
        logvar = self.min_logvar + F.softplus(logvar - self.min_logvar)
        return mean, logvar


class TinyNeRF(nn.Module):
    """KiloNeRF's per-cell field: a positional encoding (4 bands) and a 27-32-32-4 MLP."""

    def __init__(self, bands: int = 4) -> None:
        super().__init__()
        self.bands = bands
        self.mlp = nn.Sequential(nn.Linear(3 + 6 * bands, 32), nn.ReLU(), nn.Linear(32, 32),
                                 nn.ReLU(), nn.Linear(32, 4))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = (2.0 ** torch.arange(self.bands, device=x.device, dtype=x.dtype)) * math.pi
        xf = (x[..., None] * freqs).flatten(-2)
        return self.mlp(torch.cat([x, torch.sin(xf), torch.cos(xf)], -1))


class SoftQNetwork(nn.Module):
    """CleanRL's SAC critic: cat(obs, act) inside forward, 256-256-1."""

    def __init__(self, obs: int, act: int, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs + act, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, a], 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class TorchFuncRouted(nn.Module):
    """torch.func's ensembling recipe (``stack_module_state`` + ``functional_call`` +
    ``vmap``) written for a routed call, as its users write it, since torch.func has no
    routing of its own:

    - ``"dense"``: every member on every row, then each row's output picked (and, with k
      members a row, their weighted sum): N times the arithmetic, one batched call;
    - ``"rows"``: each row's member's parameters gathered, ``(B, *shape)``, and the forward
      vmapped over the rows (a row a batch of one): for tiny members, where N copies of
      every row would not fit;
    - ``"subset"``: the chosen members' parameters indexed and vmapped on the shared input.

    The stacked tensors are leaves that train (``parameters()``)."""

    def __init__(self, members: Sequence[nn.Module], how: str) -> None:
        super().__init__()
        params, buffers = torch.func.stack_module_state(list(members))
        self.names = list(params)
        self.stacked = nn.ParameterList(nn.Parameter(v.detach()) for v in params.values())
        self.buffers_ = buffers
        self.base = copy.deepcopy(members[0]).to("meta")
        self.how = how

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.stacked))

    def _member(self, params: dict, buffers: dict, *args: torch.Tensor) -> Any:
        return torch.func.functional_call(self.base, (params, buffers), args)

    def forward(self, *args: torch.Tensor, index: Any, weights: torch.Tensor | None = None) -> Any:
        params, buffers = self._params(), self.buffers_
        shared = (None,) * len(args)
        if self.how == "subset":
            chosen = torch.as_tensor(index)
            sub = {k: v.index_select(0, chosen) for k, v in params.items()}
            subb = {k: v.index_select(0, chosen) for k, v in buffers.items()}
            return torch.func.vmap(self._member, in_dims=(0, 0, *shared))(sub, subb, *args)
        if self.how == "rows":
            rowp = {k: v.index_select(0, index) for k, v in params.items()}
            rowb = {k: v.index_select(0, index) for k, v in buffers.items()}
            ones = tuple(a.unsqueeze(1) for a in args)  # each row a batch of one
            out = torch.func.vmap(self._member, in_dims=(0, 0, *(0,) * len(args)))(
                rowp, rowb, *ones
            )
            return tuple(o.squeeze(1) for o in out) if isinstance(out, tuple) else out.squeeze(1)
        out = torch.func.vmap(self._member, in_dims=(0, 0, *shared))(params, buffers, *args)
        b = args[0].shape[0]
        rows = torch.arange(b, device=args[0].device)

        def pick(o: torch.Tensor) -> torch.Tensor:  # (N, B, ...) -> (B, ...)
            if index.dim() == 1:
                return o[index, rows]
            picked = o[index, rows[:, None]]  # (B, k, ...)
            assert weights is not None, "k members a row need their weights"
            w = weights.to(o.dtype).view(*weights.shape, *(1,) * (o.dim() - 2))
            return (picked * w).sum(1)

        return tuple(pick(o) for o in out) if isinstance(out, tuple) else pick(out)


class TorchFuncMoE(nn.Module):
    """The MoE layer with torch.func's recipe: the gate, then every expert on every token."""

    def __init__(self, gate: nn.Linear, experts: list[nn.Module], top_k: int) -> None:
        super().__init__()
        self.gate, self.top_k = gate, top_k
        self.experts = TorchFuncRouted(experts, "dense")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weights = phalanx.routing.top_k(self.gate(x), self.top_k)
        return self.experts(x, index=index, weights=weights)


# ---------------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """Contenders: name -> (the module whose parameters train, one forward call)."""

    id: str
    what: str
    contenders: dict[str, tuple[nn.Module, Callable[[], Any]]]
    baseline: str
    notes: list[str] = field(default_factory=list)


def _moe(tokens: int) -> Workload:
    hidden, inner, experts, k = 256, 512, 8, 2
    torch.manual_seed(0)
    gate = nn.Linear(hidden, experts, bias=False)
    members: list[nn.Module] = [SwiGLUExpert(hidden, inner) for _ in range(experts)]
    x = torch.randn(tokens, hidden)
    v4 = V4MoE(copy.deepcopy(gate), copy.deepcopy(members), k)
    ours = PhalanxMoE(copy.deepcopy(gate), copy.deepcopy(members), k)
    recipe = TorchFuncMoE(copy.deepcopy(gate), copy.deepcopy(members), k)
    contenders: dict[str, tuple[nn.Module, Callable[[], Any]]] = {
        "v4 loop (ModuleList)": (v4, lambda: v4(x)),
        "phalanx members=": (ours, lambda: ours(x)),
        "torch.func (dense)": (recipe, lambda: recipe(x)),
    }
    notes = []
    try:
        import transformers

        v5 = V5MoE(copy.deepcopy(gate), copy.deepcopy(members), k, "grouped_mm")
        contenders["transformers 5 grouped_mm"] = (v5, lambda: v5(x))
        notes.append(f"transformers {transformers.__version__}")
    except Exception as e:  # not installed, or a version without MixtralExperts
        notes.append(
            f"transformers' grouped_mm experts skipped: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        )
    return Workload(
        "moe",
        f"Mixtral MoE layer: E={experts} SwiGLU experts H={hidden} I={inner}, top-{k}, "
        f"{tokens} tokens",
        contenders,
        "v4 loop (ModuleList)",
        notes,
    )


def _pets(particles: int, states: int) -> Workload:
    obs, act, n = 11, 3, 7
    torch.manual_seed(0)
    members = [GaussianMLP(obs + act, obs + 1) for _ in range(n)]
    rows = particles * states
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, obs + act, generator=gen)
    # TS1: each particle a random member; a particle's states all go to its member
    member_of_particle = torch.randint(0, n, (particles,), generator=gen)
    index = member_of_particle.repeat_interleave(states)
    loop_models = nn.ModuleList(copy.deepcopy(members))
    stack = phalanx.stack(copy.deepcopy(members))
    recipe = TorchFuncRouted(copy.deepcopy(members), "dense")

    def loop() -> tuple[torch.Tensor, torch.Tensor]:
        mean = x.new_empty(rows, obs + 1)
        logvar = x.new_empty(rows, obs + 1)
        for e, m in enumerate(loop_models):
            sel = (index == e).nonzero().squeeze(1)
            if sel.numel():
                mu, lv = m(x[sel])
                mean[sel], logvar[sel] = mu, lv
        return mean, logvar

    return Workload(
        "pets",
        f"PETS TS1: {n} GaussianMLP members (SiLU 4x200), {particles} particles x {states} "
        f"states, each particle a random member",
        {
            "loop over members": (loop_models, loop),
            "phalanx members=": (stack, lambda: stack(x, members=index)),
            "torch.func (dense)": (recipe, lambda: recipe(x, index=index)),
        },
        "loop over members",
    )


def _kilonerf(points: int) -> Workload:
    grid = 8
    n = grid**3
    torch.manual_seed(0)
    members = [TinyNeRF() for _ in range(n)]
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(points, 3, generator=gen)
    cell3 = (p * grid).long()
    cell = (cell3[:, 0] * grid + cell3[:, 1]) * grid + cell3[:, 2]
    local = p * grid - torch.floor(p * grid)
    loop_models = nn.ModuleList(copy.deepcopy(members))
    stack = phalanx.stack(copy.deepcopy(members))
    recipe = TorchFuncRouted(copy.deepcopy(members), "rows")

    def loop() -> torch.Tensor:
        out = local.new_empty(points, 4)
        for i, m in enumerate(loop_models):
            sel = (cell == i).nonzero().squeeze(1)
            if sel.numel():
                out[sel] = m(local[sel])
        return out

    return Workload(
        "kilonerf",
        f"KiloNeRF: {n} fields (encoding + 27-32-32-4), {points} points routed by grid cell",
        {
            "loop over cells": (loop_models, loop),
            "phalanx members=": (stack, lambda: stack(local, members=cell)),
            "torch.func (rows)": (recipe, lambda: recipe(local, index=cell)),
        },
        "loop over cells",
    )


def _redq(batch: int) -> Workload:
    obs_dim, act_dim, n = 17, 6, 10
    torch.manual_seed(0)
    critics = [SoftQNetwork(obs_dim, act_dim) for _ in range(n)]
    gen = torch.Generator().manual_seed(0)
    obs, act = torch.randn(batch, obs_dim, generator=gen), torch.rand(batch, act_dim, generator=gen)
    chosen = torch.randperm(n, generator=gen)[:2].tolist()
    loop_models = nn.ModuleList(copy.deepcopy(critics))
    stack = phalanx.stack(copy.deepcopy(critics))
    recipe = TorchFuncRouted(copy.deepcopy(critics), "subset")
    return Workload(
        "redq",
        f"REDQ target: 2 of {n} critics (SoftQNetwork 256-256-1), B={batch}",
        {
            "loop over the 2": (
                loop_models,
                lambda: torch.stack([loop_models[i](obs, act) for i in chosen]),
            ),
            "phalanx subset=": (stack, lambda: stack(obs, act, subset=chosen)),
            "torch.func (subset)": (recipe, lambda: recipe(obs, act, index=chosen)),
        },
        "loop over the 2",
    )


def workloads(quick: bool) -> dict[str, Callable[[], Workload]]:
    return {
        "moe": lambda: _moe(1024 if quick else 4096),
        "pets": lambda: _pets(20, 100 if quick else 500),
        "kilonerf": lambda: _kilonerf(8192 if quick else 32768),
        "redq": lambda: _redq(256),
    }


# ------------------------------------------------------------------------------------ running


def _leaves(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _probes(out: Any) -> list[torch.Tensor]:
    """Fixed weights for the loss: the same for every contender."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in _leaves(out)]


def _grads(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The members' gradients stacked by parameter name, ``(N, *shape)``: from a stack, or
    from an ``nn.ModuleList`` of the members; None for other modules."""
    if isinstance(module, phalanx.Stack):
        return {
            name: p.grad if p.grad is not None else torch.zeros_like(p)
            for name, p in module.module.named_parameters()
        }
    if isinstance(module, nn.ModuleList):
        names = [n for n, _ in module[0].named_parameters()]
        return {n: torch.stack([_grad(m.get_parameter(n)) for m in module]) for n in names}
    return None


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _loss(out: list[torch.Tensor], probes: list[torch.Tensor]) -> torch.Tensor:
    total = (out[0] * probes[0]).sum()
    for o, p in zip(out[1:], probes[1:]):
        total = total + (o * p).sum()
    return total


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / (b.abs().max() + 1e-6)) if b.numel() else 0.0


def _check(w: Workload) -> dict[str, str]:
    """Each contender's outputs and gradients against the baseline's; a problem per name."""
    base_module, base_call = w.contenders[w.baseline]
    base_module.zero_grad(set_to_none=True)
    ref = _leaves(base_call())
    probes = _probes(ref)
    _loss(ref, probes).backward()
    ref_grads = _grads(base_module)
    problems = {}
    for name, (module, call) in w.contenders.items():
        if name == w.baseline:
            continue
        module.zero_grad(set_to_none=True)
        out = _leaves(call())
        _loss(out, probes).backward()
        worst = max(_relative(a, b) for a, b in zip(out, ref))
        grads = _grads(module)
        if ref_grads is not None and grads is not None:
            # Relative to the largest gradient: a parameter whose gradient sums terms that
            # cancel (PETS's min_logvar) is only as exact as the loop's own float32 sums.
            scale = max(float(g.abs().max()) for g in ref_grads.values()) + 1e-6
            worst = max([worst, *(float((grads[n] - g).abs().max()) / scale
                                  for n, g in ref_grads.items())])  # fmt: skip
        if not worst <= 1e-4:
            problems[name] = f"differs from {w.baseline} by {worst:.2g} (relative)"
    return problems


def _forward_step(call: Callable[[], Any]) -> Callable[[], None]:
    def step() -> None:
        with torch.no_grad():
            call()

    return step


def _train_step(
    module: nn.Module, call: Callable[[], Any], probes: list[torch.Tensor]
) -> Callable[[], None]:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        _loss(_leaves(call()), probes).backward()

    return step


def _time(w: Workload, phase: str, quick: bool, skip: set[str]) -> dict[str, float]:
    fns: dict[str, Callable[[], object]] = {}
    for name, (module, call) in w.contenders.items():
        if name in skip:
            continue
        if phase == "forward":
            fns[name] = _forward_step(call)
        else:
            fns[name] = _train_step(module, call, _probes(call()))
    timings = interleaved(
        fns,
        device=torch.device("cpu"),
        rounds=5 if quick else 15,
        min_rounds=3 if quick else 7,
        warmup=1 if quick else 3,
        target_s=0.02 if quick else 0.1,
        budget_s=5 if quick else 40,
    )
    return {name: t.median for name, t in timings.items()}


def run(names: list[str], quick: bool) -> list[dict[str, Any]]:
    results = []
    builders = workloads(quick)
    for key in names:
        w = builders[key]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problems = _check(w)
            row: dict[str, Any] = {"id": w.id, "what": w.what, "baseline": w.baseline,
                                   "notes": w.notes, "wrong": problems, "goal": GOALS[w.id]}  # fmt: skip
            for phase in ("forward", "train"):
                times = _time(w, phase, quick, set(problems))
                row[phase] = {
                    name: {"ms": 1e3 * t, "speedup": times[w.baseline] / t}
                    for name, t in times.items()
                }
        stack = next((m for m, _ in w.contenders.values() if isinstance(m, phalanx.Stack)), None)
        if stack is None:
            stack = next(
                (
                    m
                    for m, _ in w.contenders.values()
                    for m in m.modules()
                    if isinstance(m, phalanx.Stack)
                ),
                None,
            )
        if stack is not None:
            row["path"] = stack.routed_path or "general"
        results.append(row)
    return results


def format_results(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r['id']}: {r['what']}")
        if r.get("path"):
            lines.append(f"  phalanx ran the {r['path']} path")
        for note in r["notes"]:
            lines.append(f"  note: {note}")
        for name, why in r["wrong"].items():
            lines.append(f"  WRONG {name}: {why} (not timed)")
        for phase in ("forward", "train"):
            label = "forward (no_grad)" if phase == "forward" else "train step (fwd+bwd)"
            cells = ", ".join(
                f"{name} {v['ms']:.2f} ms ({v['speedup']:.2f}x)" for name, v in r[phase].items()
            )
            lines.append(f"  {label:22s} {cells}")
        ours = [n for n in r["forward"] if n.startswith("phalanx")]
        if ours:
            f, t = r["forward"][ours[0]]["speedup"], r["train"][ours[0]]["speedup"]
            met = "met" if min(f, t) >= r["goal"] else "NOT met"
            lines.append(f"  goal >= {r['goal']}x the {r['baseline']}: {met} "
                         f"(forward {f:.2f}x, train {t:.2f}x)")  # fmt: skip
            recipe = [n for n in r["forward"] if n.startswith("torch.func")]
            if recipe:
                ratios = [
                    r[ph][recipe[0]]["ms"] / r[ph][ours[0]]["ms"] for ph in ("forward", "train")
                ]
                lines.append(f"  phalanx against {recipe[0]}: forward {ratios[0]:.2f}x, "
                             f"train {ratios[1]:.2f}x")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phalanx bench --routed")
    parser.add_argument("--workloads", default="moe,pets,kilonerf,redq")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.workloads.split(",") if s.strip()]
    unknown = [n for n in names if n not in GOALS]
    if unknown or not names:
        print(f"phalanx bench --routed: unknown workloads {unknown}; choose from "
              f"{', '.join(GOALS)}", file=sys.stderr)  # fmt: skip
        return 2
    command = "phalanx bench --routed" + (
        f" --workloads {args.workloads}" if names != list(GOALS) else ""
    )
    command += (f" --threads {args.threads}" if args.threads else "") + (
        " --quick" if args.quick else ""
    )
    with intra_op_threads(args.threads):
        header = (f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads")  # fmt: skip
        print(f"$ {command}\n{header}\n", flush=True)
        results = run(names, args.quick)
    print(format_results(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": header, "results": results}, f, indent=1)
    return 1 if any(r["wrong"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
