"""Routed members (``members=``/``weights=``), subsets (``subset=``), ``polyak_`` and the
routing helpers, against the loop over the members on their own rows."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import phalanx
from phalanx.routed import _direct as _direct_mod
from phalanx.routed import _rowwise, _segments, _subsets

BACKENDS = ["loop", "vmap", "fused", "auto"]


# ----------------------------------------------------------------------------- architectures


class SwiGLU(nn.Module):
    """Mixtral's expert (transformers v4's MixtralBlockSparseTop2MLP)."""

    def __init__(self, h: int = 8, i: int = 12) -> None:
        super().__init__()
        self.w1 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gaussian(nn.Module):
    """mbrl-lib's GaussianMLP: raw parameters bound the log-variance; a tuple output."""

    def __init__(self, d: int = 8, out: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 16), nn.SiLU(), nn.Linear(16, 16), nn.SiLU())
        self.head = nn.Linear(16, 2 * out)
        self.out = out
        self.min_logvar = nn.Parameter(-2 * torch.ones(1, out))
        self.max_logvar = nn.Parameter(0.5 * torch.ones(1, out))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.head(self.body(x))
        mean, logvar = h[..., : self.out], h[..., self.out :]
        logvar = self.max_logvar - F.softplus(self.max_logvar - logvar)
        logvar = self.min_logvar + F.softplus(logvar - self.min_logvar)
        return mean, logvar


class TwoInputs(nn.Module):
    """A SAC critic: obs and action concatenated inside forward."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d + 2, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(torch.cat([obs, act], 1))))


class Encoded(nn.Module):
    """KiloNeRF's tiny field: a positional encoding built in forward, then a small MLP."""

    def __init__(self, d: int = 8, bands: int = 2) -> None:
        super().__init__()
        self.bands = bands
        self.mlp = nn.Sequential(nn.Linear(d * (1 + 2 * bands), 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = (2.0 ** torch.arange(self.bands, device=x.device, dtype=x.dtype)) * math.pi
        xf = (x[..., None] * freqs).flatten(-2)
        return self.mlp(torch.cat([x, torch.sin(xf), torch.cos(xf)], -1))


class BatchStats(nn.Module):
    """Not row-wise: the batch mean (a member's own rows in the loop) and a BatchNorm."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.bn(h - h.mean(0)) if h.shape[0] > 1 else h


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5))


ROWWISE = {"mlp": mlp, "swiglu": SwiGLU, "gaussian": Gaussian, "two_inputs": TwoInputs,
           "encoded": Encoded}  # fmt: skip
ARCHS = {**ROWWISE, "batch_stats": BatchStats}


def inputs(arch: str, rows: int, gen: torch.Generator, dtype=torch.float32) -> tuple:
    x = torch.randn(rows, 8, generator=gen, dtype=dtype)
    if arch == "two_inputs":
        return x, torch.randn(rows, 2, generator=gen, dtype=dtype)
    return (x,)


def leaves(out):
    return list(out) if isinstance(out, tuple) else [out]


# ----------------------------------------------------------------------------- the reference


def loop_reference(models, args, index, weights, dtype):
    """Each member on its own rows (in the input's order), outputs put back per row,
    weighted sums over the k choices: what a user's loop over the members computes."""
    models = [copy.deepcopy(m).to(dtype) for m in models]
    args = [a.detach().to(dtype).requires_grad_(True) for a in args]
    w = None if weights is None else weights.detach().to(dtype).requires_grad_(True)
    two_d = index.dim() == 2
    idx = index if two_d else index.unsqueeze(1)
    rows, k = idx.shape
    flat = idx.reshape(-1)
    outs: dict[int, list] = {}
    for i, m in enumerate(models):
        entries = (flat == i).nonzero().squeeze(1)
        if entries.numel():
            out = m(*[a[entries // k] for a in args])
            for e, *vals in zip(entries.tolist(), *[o.unbind(0) for o in leaves(out)]):
                outs[e] = vals
    if not outs:  # no rows: the shapes of member 0 on an empty input
        empty = leaves(models[0](*[a[:0] for a in args]))
        per_leaf = [e.new_zeros(rows, k, *e.shape[1:]) for e in empty]
    else:
        sample = next(iter(outs.values()))
        per_leaf = []
        for j, s in enumerate(sample):
            per_leaf.append(
                torch.stack([outs[e][j] for e in range(rows * k)]).view(rows, k, *s.shape)
                if rows
                else s.new_zeros(0, k, *s.shape)
            )
    results = []
    for y in per_leaf:
        if w is not None:
            ww = w if two_d else w.unsqueeze(1)
            y = (y * ww.view(rows, k, *(1,) * (y.dim() - 2))).sum(1)
        elif not two_d:
            y = y.squeeze(1)
        results.append(y)
    return results, models, args, w


def check_against_loop(models, stack, args, index, weights, *, second=False):
    """Outputs, input/weight/parameter gradients (and a gradient penalty's) of the stack
    against the float32 and float64 loops: no further from float64 than float32 is."""
    xs = [a.clone().requires_grad_(True) for a in args]
    w = None if weights is None else weights.clone().requires_grad_(True)
    out = leaves(stack(*xs, members=index, weights=w))

    def loss_of(outs, ins):
        total = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum()
                    for o in outs)  # fmt: skip
        if second:
            grads = torch.autograd.grad(total, ins, create_graph=True)
            total = total + sum(g.square().sum() for g in grads)
        return total

    if not index.shape[0]:  # no rows: the shapes alone
        ref, *_ = loop_reference(models, args, index, weights, torch.float32)
        assert [o.shape for o in out] == [r.shape for r in ref]
        return
    got_params = dict(stack.module.named_parameters())
    loss_of(out, xs).backward()
    got = {
        "out": out,
        "dx": [x.grad for x in xs],
        "dw": [w.grad] if w is not None else [],
        "params": {n: p.grad for n, p in got_params.items()},
    }
    refs = {}
    for dtype in (torch.float32, torch.float64):
        outs, ms, ins, rw = loop_reference(models, args, index, weights, dtype)
        loss_of(outs, ins).backward()
        grads = {}
        for n, _ in models[0].named_parameters():
            grads[n] = torch.stack([
                m.get_parameter(n).grad if m.get_parameter(n).grad is not None
                else torch.zeros_like(m.get_parameter(n)) for m in ms
            ])  # fmt: skip
        refs[dtype] = {
            "out": outs,
            "dx": [x.grad for x in ins],
            "dw": [rw.grad] if rw is not None else [],
            "params": grads,
        }
    r32, r64 = refs[torch.float32], refs[torch.float64]
    for key in ("out", "dx", "dw"):
        for j, (a, b, c) in enumerate(zip(got[key], r32[key], r64[key])):
            close(a, b, c, f"{key}[{j}]")
    for n, g in got["params"].items():
        close(torch.zeros_like(r64["params"][n]) if g is None else g, r32["params"][n],
              r64["params"][n], f"grad {n}")  # fmt: skip


def close(got, loop32, loop64, what, factor=4.0):
    assert got.shape == loop64.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(loop64.shape)}"
    if not got.numel():
        return
    got, loop32, loop64 = got.detach().double(), loop32.detach().double(), loop64.detach()
    ulps = 8 * torch.finfo(torch.float32).eps * (1 + loop64.abs().max())
    err = (got - loop64).abs().max()
    own = (loop32 - loop64).abs().max()
    assert err <= factor * own + ulps, f"{what}: {err:.3g} from the float64 loop, float32 {own:.3g}"


def build(arch, n, backend, seed=0):
    torch.manual_seed(seed)
    models = [ARCHS[arch]() for _ in range(n)]
    with torch.no_grad():  # members differ in every parameter, the raw ones included
        for m in models:
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return models, phalanx.stack(copy.deepcopy(models), backend=backend)


# --------------------------------------------------------------------------------- hypothesis


@settings(max_examples=60, deadline=None)
@given(
    arch=st.sampled_from(sorted(ARCHS)),
    n=st.integers(1, 5),
    rows=st.integers(0, 12),
    k=st.sampled_from([None, 1, 2, 3]),
    weighted=st.booleans(),
    skew=st.sampled_from(["random", "one", "empty_first"]),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_random_routings_match_the_loop(arch, n, rows, k, weighted, skew, backend, seed):
    if arch == "batch_stats":
        rows = max(rows, 2)  # a BatchNorm in train mode needs two rows on a member
    gen = torch.Generator().manual_seed(seed)
    models, stack = build(arch, n, backend, seed)
    shape = (rows,) if k is None else (rows, k)
    index = torch.randint(0, n, shape, generator=gen)
    if skew == "one" or arch == "batch_stats":
        index.fill_(n - 1)  # all rows to one member, the others empty
    elif skew == "empty_first" and n > 1:
        index = index.clamp(min=1)
    weights = torch.rand(index.shape, generator=gen) if weighted else None
    args = inputs(arch, rows, gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fused announces the general path for batch_stats
        check_against_loop(models, stack, args, index, weights, second=arch != "batch_stats")
    if rows and backend in ("fused", "auto"):
        path = stack.routed_path
        assert path == ("segment" if arch in ROWWISE else "general"), (arch, path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_arch_and_backend_with_top2(arch, backend):
    gen = torch.Generator().manual_seed(1)
    models, stack = build(arch, 4, backend)
    rows = 24
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=gen)
    if arch == "batch_stats":
        index[:, 0], index[:, 1] = 1, 2  # two rows or more on each member that gets any
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_against_loop(models, stack, inputs(arch, rows, gen), index, weights,
                           second=arch != "batch_stats")  # fmt: skip


@pytest.mark.parametrize("grouped_rows", [0, 10**9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_both_segment_kernels_match_the_loop(monkeypatch, grouped_rows, dtype):
    """grouped_mm (float32, few rows per member) and one GEMM per segment (the others)."""
    monkeypatch.setattr(_segments, "GROUPED_ROWS", grouped_rows)
    monkeypatch.setattr(_segments, "GROUPED_SEGMENTS", 1)
    monkeypatch.setattr(_segments, "PER_SEGMENT_FEW", 1)  # all rows at once, grouped
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(6)]
    stack = phalanx.stack(copy.deepcopy(models)).to(dtype)
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, 5, (40,), generator=gen)  # member 5 empty
    x = torch.randn(40, 8, generator=gen, dtype=dtype)
    check_against_loop([m.to(dtype) for m in models], stack, (x,), index, None, second=True)
    assert stack.routed_path == "segment"


def _count_plan_runs(monkeypatch, module) -> list[int]:
    """Counts the traced forward's runs (one per segment on the per-segment path)."""
    runs: list[int] = []
    real = _rowwise.run_plan

    def counted(*a, **k):
        runs.append(1)
        return real(*a, **k)

    monkeypatch.setattr(module, "run_plan", counted)
    return runs


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("arch", sorted(ROWWISE))
def test_per_segment_runs_match_the_loop(monkeypatch, arch, grad):
    """The cost rule's per-segment runs (few large segments): each member's own operations
    on its rows, its tensors as views, one backward stack of the members' gradients."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)
    runs = _count_plan_runs(monkeypatch, _rowwise)
    models, stack = build(arch, 4, "auto")
    gen = torch.Generator().manual_seed(5)
    rows = 30
    index = torch.randint(0, 3, (rows, 2), generator=gen)  # member 3 empty
    weights = torch.rand(rows, 2, generator=gen)
    args = inputs(arch, rows, gen)
    if grad:
        check_against_loop(models, stack, args, index, weights, second=True)
    else:
        with torch.no_grad():
            got = leaves(stack(*args, members=index, weights=weights))
            ref, *_ = loop_reference(models, args, index, weights, torch.float32)
            ref64, *_ = loop_reference(models, args, index, weights, torch.float64)
        for g, r, r64 in zip(got, ref, ref64):
            phalanx.testing.assert_equal_to_loop(g, r, r64)
    assert stack.routed_path == "segment"
    assert len(runs) >= len(index.unique())  # once per member with rows
    assert _segments.per_segment(3, rows * 2) and not _segments.per_segment(40, rows * 2)


def test_few_small_segments_run_the_loops_own_path():
    """A PETS call (5 members, 400 rows, 80 a member) ran once over all rows, with per-row
    gathers, at 0.6-0.7x the loop; a few segments run once each, whatever their size."""
    assert _segments.per_segment(5, 400) and _segments.per_segment(8, 16)
    assert not _segments.per_segment(12, 120) and _segments.per_segment(12, 128 * 12)
    assert not _segments.per_segment(1, 400) and not _segments.per_segment(40, 10**6)


def test_output_shapes():
    _models, stack = build("gaussian", 3, "auto")
    x = torch.randn(7, 8)
    mean, logvar = stack(x, members=torch.tensor([0, 1, 2, 0, 1, 2, 0]))
    assert mean.shape == (7, 3) and logvar.shape == (7, 3)
    idx = torch.randint(0, 3, (7, 2))
    assert stack(x, members=idx)[0].shape == (7, 2, 3)  # (B, k, ...) without weights
    assert stack(x, members=idx, weights=torch.rand(7, 2))[0].shape == (7, 3)
    assert stack(x[:0], members=idx[:0], weights=torch.rand(0, 2))[0].shape == (0, 3)


def test_errors_name_the_fix():
    _, stack = build("mlp", 3, "auto")
    x = torch.randn(4, 8)
    with pytest.raises(IndexError, match="member index 3"):
        stack(x, members=torch.tensor([0, 1, 3, 0]))
    with pytest.raises(IndexError, match="member index -1"):
        stack(x, members=torch.tensor([0, -1, 2, 0]))
    with pytest.raises(TypeError, match=r"index.long\(\)"):
        stack(x, members=torch.tensor([0.0, 1.0, 2.0, 0.0]))
    with pytest.raises(TypeError, match="subset="):
        stack(x, members=[0, 1, 2, 0])
    with pytest.raises(ValueError, match="the inputs have 4"):
        stack(x, members=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"\(B,\) \(one member per row\)"):
        stack(x, members=torch.zeros(4, 1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="index's shape"):
        stack(x, members=torch.tensor([0, 1, 2, 0]), weights=torch.rand(4, 2))
    with pytest.raises(TypeError, match="floating-point"):
        stack(x, members=torch.tensor([0, 1, 2, 0]), weights=torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="in_dims does not apply"):
        stack(x, members=torch.tensor([0, 1, 2, 0]), in_dims=0)
    with pytest.raises(ValueError, match="exclude each other"):
        stack(x, members=torch.tensor([0, 1, 2, 0]), subset=[0])
    _, two = build("two_inputs", 3, "auto")
    with pytest.raises(ValueError, match="same first dimension"):
        two(torch.randn(4, 8), torch.randn(5, 2), members=torch.tensor([0, 1, 2, 0]))


def test_fused_announces_the_general_path_once():
    _models, stack = build("batch_stats", 3, "fused")
    x = torch.randn(6, 8)
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    with pytest.warns(UserWarning, match="member by member"):
        stack(x, members=index)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stack(x, members=index)  # once only
    _, auto = build("batch_stats", 3, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto(x, members=index)  # auto takes the general path silently


def test_rows_of_the_general_path_keep_per_member_buffers():
    """BatchNorm running statistics: member i's from its own rows, as in the loop."""
    models, stack = build("batch_stats", 3, "auto")
    x = torch.randn(9, 8)
    index = torch.tensor([2, 0, 2, 0, 2, 0, 1, 1, 1])
    stack(x, members=index)
    for i, m in enumerate(models):
        m(x[index == i])
        torch.testing.assert_close(stack.module.bn.running_mean[i], m.bn.running_mean)


def test_a_setting_changed_after_the_first_call_is_seen():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.1), nn.Linear(8, 2)) for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(models))
    x, index = torch.randn(10, 8), torch.randint(0, 3, (10,))
    stack(x, members=index)
    stack.module[1].negative_slope = 0.5
    for m in models:
        m[1].negative_slope = 0.5
    out = stack(x, members=index)
    ref = torch.stack([models[int(i)](x[r]) for r, i in enumerate(index)])
    torch.testing.assert_close(out, ref)
    assert stack.routed_path == "segment"


def test_hooks_and_transforms_take_the_general_path():
    models, stack = build("mlp", 3, "auto")
    x, index = torch.randn(10, 8), torch.randint(0, 3, (10,))
    handle = stack.module[0].register_forward_hook(lambda m, i, o: o * 2)
    for m in models:
        m[0].register_forward_hook(lambda m, i, o: o * 2)
    out = stack(x, members=index)
    assert stack.routed_path == "general"
    torch.testing.assert_close(
        out, torch.stack([models[int(i)](x[r]) for r, i in enumerate(index)])
    )
    handle.remove()
    stack(x, members=index)
    assert stack.routed_path == "segment"


# ------------------------------------------------------------------------------------ subsets


@pytest.mark.parametrize("per_segment_rows", [1, 10**9])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chosen", [[3, 7], [7, 3], [2, 3, 4], [5]])
def test_subset_matches_those_members_alone(monkeypatch, backend, chosen, per_segment_rows):
    """Both subset paths of the cost rule: each chosen member on the whole input (views,
    nothing gathered) and one run over the repeated input."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", per_segment_rows)
    monkeypatch.setattr(_segments, "PER_SEGMENT_FEW", 1)  # the rows decide, even for few
    runs = _count_plan_runs(monkeypatch, _subsets)
    torch.manual_seed(0)
    models = [TwoInputs() for _ in range(10)]
    stack = phalanx.stack(copy.deepcopy(models), backend=backend)
    obs, act = torch.randn(6, 8), torch.randn(6, 2)
    out = stack(obs, act, subset=chosen)
    ref = torch.stack([models[i](obs, act) for i in chosen])
    torch.testing.assert_close(out, ref)
    path = stack.routed_path
    assert path == ("segment" if backend in ("fused", "auto") else "general")
    if backend in ("fused", "auto"):
        per_segment = per_segment_rows == 1 and len(chosen) > 1
        assert len(runs) == (len(chosen) if per_segment else 1)
    out.sum().backward()
    for p_name, p in stack.module.named_parameters():
        for i in range(10):
            g = p.grad[i]
            if i in chosen:
                ref_g = torch.autograd.grad(
                    models[i](obs, act).sum(), models[i].get_parameter(p_name)
                )[0]
                torch.testing.assert_close(g, ref_g)
            else:
                assert torch.count_nonzero(g) == 0, (p_name, i)
    torch.testing.assert_close(stack(obs, act, subset=torch.tensor(chosen)), ref)


def test_subset_per_member_inputs_and_buffers():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6)) for _ in range(5)]
    stack = phalanx.stack(copy.deepcopy(models))
    xs = torch.randn(2, 7, 8)
    out = stack(xs, subset=[4, 1], in_dims=0)
    ref = torch.stack([models[4](xs[0]), models[1](xs[1])])
    torch.testing.assert_close(out, ref)
    for i in range(5):
        torch.testing.assert_close(stack.module[1].running_mean[i], models[i][1].running_mean)
    with pytest.raises(ValueError, match="the subset's size"):
        stack(torch.randn(5, 7, 8), subset=[4, 1], in_dims=0)


@pytest.mark.parametrize("per_segment_rows", [1, 10**9])
def test_subset_per_member_inputs_on_the_segment_path(monkeypatch, per_segment_rows):
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", per_segment_rows)
    monkeypatch.setattr(_segments, "PER_SEGMENT_FEW", 1)  # the rows decide, even for few
    torch.manual_seed(0)
    models = [Gaussian() for _ in range(5)]
    stack = phalanx.stack(copy.deepcopy(models), backend="auto")
    xs = torch.randn(3, 7, 8)
    out = stack(xs, subset=[4, 0, 2], in_dims=0)
    assert stack.routed_path == "segment"
    for j, i in enumerate([4, 0, 2]):
        for got, ref in zip(out, models[i](xs[j])):
            torch.testing.assert_close(got[j], ref)


def test_subset_errors():
    _, stack = build("mlp", 4, "auto")
    x = torch.randn(3, 8)
    with pytest.raises(IndexError, match="member index 4"):
        stack(x, subset=[0, 4])
    with pytest.raises(ValueError, match="twice"):
        stack(x, subset=[1, 1])
    with pytest.raises(ValueError, match="empty"):
        stack(x, subset=[])
    with pytest.raises(TypeError, match="members=index"):
        stack(x, subset=torch.zeros(3, 2, dtype=torch.long))


# ------------------------------------------------------------------------------------- polyak


def _stacked(models, name):
    return torch.stack([m.get_parameter(name) for m in models])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_member", [False, True])
def test_polyak_equals_the_per_module_update_bit_for_bit(dtype, per_member):
    torch.manual_seed(0)
    online = [nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7)).to(dtype) for _ in range(4)]
    targets = [copy.deepcopy(m) for m in online]
    with torch.no_grad():
        for m in online:
            for p in m.parameters():
                p.add_(torch.randn_like(p))
            m[1].running_mean.add_(1.0)
            m[1].num_batches_tracked += 3
    q = phalanx.stack(copy.deepcopy(online))
    t = phalanx.stack(copy.deepcopy(targets)).requires_grad_(False)
    tau = [0.005, 0.5, 0.9, 1.0] if per_member else 0.005
    phalanx.polyak_(t, q, tau)
    with torch.no_grad():
        for i, (tm, om) in enumerate(zip(targets, online)):
            step = tau[i] if per_member else tau
            torch._foreach_lerp_(list(tm.parameters()), list(om.parameters()), step)
            tm[1].running_mean.lerp_(om[1].running_mean, step)
            tm[1].running_var.lerp_(om[1].running_var, step)
            tm[1].num_batches_tracked.copy_(om[1].num_batches_tracked)
    for name, _ in targets[0].named_parameters():
        assert torch.equal(t.module.get_parameter(name), _stacked(targets, name)), name
    for name, _ in targets[0].named_buffers():
        ref = torch.stack([m.get_buffer(name) for m in targets])
        assert torch.equal(t.module.get_buffer(name), ref), name


def test_polyak_buffers_and_errors():
    torch.manual_seed(0)
    a = phalanx.stack([nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)) for _ in range(2)])
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.module[1].running_mean.add_(2.0)
    before = a.module[1].running_mean.clone()
    phalanx.polyak_(a, b, 0.5, buffers="keep")
    assert torch.equal(a.module[1].running_mean, before)
    phalanx.polyak_(a, b, 0.5, buffers="copy")
    assert torch.equal(a.module[1].running_mean, b.module[1].running_mean)
    assert a.module[0].weight.requires_grad  # parameters that require grad: fine
    other = phalanx.stack([nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5)) for _ in range(2)])
    with pytest.raises(ValueError, match="same architecture"):
        phalanx.polyak_(a, other, 0.5)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        phalanx.polyak_(a, b, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        phalanx.polyak_(a, b, 1.5)
    m1, m2 = nn.Linear(3, 3), nn.Linear(3, 3)
    phalanx.polyak_(m1, m2, 1.0)  # plain modules too
    assert torch.equal(m1.weight, m2.weight)


# ---------------------------------------------------------------------------- routing helpers


def test_top_k_is_mixtrals_router():
    logits = torch.randn(10, 8)
    index, weights = phalanx.routing.top_k(logits, 2)
    rw = F.softmax(logits, dim=1, dtype=torch.float)
    rw, sel = torch.topk(rw, 2, dim=-1)
    rw /= rw.sum(dim=-1, keepdim=True)
    assert torch.equal(index, sel) and torch.equal(weights, rw)


def test_dispatch_capacity_drops_and_counts():
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [0, 2]])
    d = phalanx.routing.dispatch(index, 3, weights=torch.ones(5, 2), capacity=2)
    # member 0: first choices of rows 0, 1, 2, 4 (only rows 0 and 1 fit), then row 3's second;
    # member 1: row 3's first choice, then the second choices of rows 0 and 2 (row 0 fits)
    assert d.counts.tolist() == [5, 3, 2]
    assert d.load.tolist() == [2, 2, 2] and d.overflow.tolist() == [3, 1, 0]
    assert d.dropped == 4 and d.dropped_rows == 1  # row 2 lost both
    assert d.keep.tolist() == [[True, True], [True, True], [False, False], [True, False],
                               [False, True]]  # fmt: skip
    torch.manual_seed(0)
    models = [nn.Linear(4, 3) for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(models))
    x = torch.randn(5, 4)
    out = stack(x, members=d)
    ref = torch.zeros(5, 3)
    for r in range(5):
        for j in range(2):
            if d.keep[r, j]:
                ref[r] += models[int(index[r, j])](x[r])
    torch.testing.assert_close(out, ref)
    assert phalanx.routing.dispatch(index, 3).dropped == 0


def test_load_balancing_loss_is_one_when_balanced():
    logits = torch.zeros(8, 4)
    index = torch.arange(8) % 4
    torch.testing.assert_close(
        phalanx.routing.load_balancing_loss(logits, index), torch.tensor(1.0)
    )


# -------------------------------------------------------------------------------------- bench


def test_routed_bench_runs_checks_and_writes_json(tmp_path, capsys):
    import json

    from phalanx_tools.cli import main

    path = tmp_path / "routed.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["bench", "--routed", "--quick", "--workloads", "redq", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "redq" in out and "goal >= 1.5x" in out
    (row,) = json.loads(path.read_text())["results"]
    assert row["wrong"] == {}
    assert set(row["forward"]) == {"loop over the 2", "phalanx subset=", "torch.func (subset)"}


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("arch", sorted(ROWWISE))
def test_no_grad_calls_match_the_loop(monkeypatch, arch, grouped):
    """Under no_grad a Linear's activation runs inside its segment loop, in place."""
    if grouped:
        monkeypatch.setattr(_segments, "GROUPED_SEGMENTS", 1)
        monkeypatch.setattr(_segments, "PER_SEGMENT_FEW", 1)
    monkeypatch.setattr(_segments, "PER_SEGMENT_FEW", 1)  # all rows at once, grouped
    models, stack = build(arch, 4, "auto")
    gen = torch.Generator().manual_seed(3)
    args = inputs(arch, 30, gen)
    index = torch.randint(0, 4, (30,), generator=gen)
    with torch.no_grad():
        got = leaves(stack(*args, members=index))
        ref, *_ = loop_reference(models, args, index, None, torch.float32)
        ref64, *_ = loop_reference(models, args, index, None, torch.float64)
    assert stack.routed_path == "segment"
    for j, (a, b, c) in enumerate(zip(got, ref, ref64)):
        close(a, b, c, f"out[{j}]")
    torch.manual_seed(0)  # a LeakyReLU's slope is read on every call
    lrelu = [nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 3)) for _ in range(3)]
    st = phalanx.stack(copy.deepcopy(lrelu))
    st.module[1].negative_slope = 0.7
    for m in lrelu:
        m[1].negative_slope = 0.7
    x, idx = torch.randn(9, 8), torch.tensor([0, 1, 2] * 3)
    with torch.no_grad():
        torch.testing.assert_close(
            st(x, members=idx), torch.stack([lrelu[int(i)](x[r]) for r, i in enumerate(idx)])
        )


def test_a_dispatch_that_drops_everything_gives_zeros():
    _, stack = build("mlp", 3, "auto")
    index = torch.tensor([[0, 1], [1, 2]])
    d = phalanx.routing.dispatch(index, 3, weights=torch.ones(2, 2), capacity=0)
    assert d.dropped == 4 and d.dropped_rows == 2
    assert torch.equal(stack(torch.randn(2, 8), members=d), torch.zeros(2, 5))


# ------------------------------------------------- the member's forward as one generated function


def _direct(stack):
    return stack.routed_plan.direct


ROUTINGS = {  # (index, weighted) on 4 members, 40 rows
    "top2 weighted": (lambda g: torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(40)]), True),
    "top2 unweighted": (lambda g: torch.randint(0, 3, (40, 2), generator=g), False),
    "one each, unsorted": (lambda g: torch.randint(0, 4, (40,), generator=g), False),
    "one each, weighted": (lambda g: torch.randint(0, 4, (40,), generator=g), True),
    "sorted, member 1 empty": (lambda g: torch.tensor([0] * 9 + [2] * 20 + [3] * 11), False),
    "sorted, weighted": (lambda g: torch.tensor([0] * 9 + [1] * 20 + [3] * 11), True),
    "all rows to one member": (lambda g: torch.full((40,), 2), False),
}  # fmt: skip


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("arch", sorted(ROWWISE))
def test_direct_segments_match_the_loop(monkeypatch, arch, routing):
    """From the second call on (the first proves the trace row-wise), the per-segment runs
    are the member's forward as one generated function: outputs, input, weight and
    parameter gradients and second derivatives against the loop, member by member."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)
    runs = _count_plan_runs(monkeypatch, _rowwise)
    models, stack = build(arch, 4, "auto")
    gen = torch.Generator().manual_seed(7)
    make, weighted = ROUTINGS[routing]
    index = make(gen)
    weights = torch.rand(index.shape, generator=gen) if weighted else None
    args = inputs(arch, 40, gen)
    stack(*args, members=index, weights=weights)  # proves the trace
    stack(*args, members=index, weights=weights)  # compiles the direct function
    assert isinstance(_direct(stack), _direct_mod.Direct)
    runs.clear()
    check_against_loop(models, stack, args, index, weights, second=True)
    with torch.no_grad():
        got = leaves(stack(*args, members=index, weights=weights))
        ref, *_ = loop_reference(models, args, index, weights, torch.float32)
        ref64, *_ = loop_reference(models, args, index, weights, torch.float64)
    for j, (a, b, c) in enumerate(zip(got, ref, ref64)):
        close(a, b, c, f"no_grad out[{j}]")
    assert runs == [] and stack.routed_path == "segment"  # no run_plan: the direct function


@pytest.mark.parametrize("arch", sorted(ROWWISE))
def test_direct_segments_are_the_members_own_forward_bit_for_bit(monkeypatch, arch):
    """One member per row, no weights: each row is bit for bit its member's own forward on
    the member's rows (the same operations on the same rows), with or without a graph, the
    in-place variants included; the caller's inputs are left as they were."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)
    models, stack = build(arch, 4, "auto")
    gen = torch.Generator().manual_seed(3)
    for index in (torch.randint(0, 3, (40,), generator=gen), torch.arange(40) // 10):
        args = inputs(arch, 40, gen)
        kept = [a.clone() for a in args]
        stack(*args, members=index)  # proves the trace
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                got = leaves(stack(*args, members=index))
                for i, m in enumerate(models):
                    rows = (index == i).nonzero().squeeze(1)
                    if rows.numel():
                        own = leaves(m(*[a[rows] for a in args]))
                        for g, o in zip(got, own):
                            assert torch.equal(g[rows], o), (arch, i, grad)
        assert all(torch.equal(a, k) for a, k in zip(args, kept))
    with torch.no_grad():  # outputs are never the reused buffers of the in-place variant
        first = leaves(stack(*args, members=index))
        kept_out = [o.clone() for o in first]
        bigger = inputs(arch, 80, gen)
        stack(*bigger, members=torch.randint(0, 4, (80,), generator=gen))
        stack(*[a[:5] for a in bigger], members=torch.tensor([0, 1, 2, 3, 0]))
    assert all(torch.equal(o, k) for o, k in zip(first, kept_out))


class WritesItsInput(nn.Module):
    """A forward that writes its input in place (as it may in the loop, on ``x[index == i]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(x, inplace=True))


def test_a_forward_that_writes_its_input_gets_copies(monkeypatch):
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)
    torch.manual_seed(0)
    models = [WritesItsInput() for _ in range(3)]
    stack = phalanx.stack(copy.deepcopy(models), backend="auto")
    x, index = torch.randn(12, 8), torch.arange(12) // 4  # sorted: the rows could be views
    with torch.no_grad():
        stack(x.clone(), members=index)
        stack(x.clone(), members=index)
        assert _direct(stack).writes
        before = x.clone()
        out = stack(x, members=index)
    assert torch.equal(x, before)  # the caller's rows were copied, not written
    ref = torch.cat([models[i](x[index == i].clone()) for i in range(3)])
    assert torch.equal(out, ref)


def test_direct_errors_and_edges_after_compiling(monkeypatch):
    """Bad ids, a routing with empty members and B = 0 after the direct function exists."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)
    models, stack = build("gaussian", 4, "auto")
    x = torch.randn(6, 8)
    stack(x, members=torch.tensor([0, 1, 2, 3, 0, 1]))
    stack(x, members=torch.tensor([0, 1, 2, 3, 0, 1]))
    assert isinstance(_direct(stack), _direct_mod.Direct)
    with pytest.raises(IndexError, match="member index 4"):
        stack(x, members=torch.tensor([0, 1, 4, 3, 0, 1]))
    with pytest.raises(IndexError, match="member index -2"):
        stack(x, members=torch.tensor([0, 1, -2, 3, 0, 1]))
    mean, logvar = stack(x[:0], members=torch.zeros(0, dtype=torch.long))
    assert mean.shape == (0, 3) and logvar.shape == (0, 3)
    index = torch.tensor([[3, 1], [1, 3], [3, 1], [1, 3], [3, 1], [1, 3]])  # 0 and 2 empty
    check_against_loop(models, stack, (x,), index, torch.rand(6, 2), second=True)
    d = phalanx.routing.dispatch(index, 4, weights=torch.rand(6, 2), capacity=2)  # drops
    got = stack(x, members=d)
    ref = torch.zeros(6, 3)
    for r in range(6):
        for j in range(2):
            if d.keep[r, j]:
                ref[r] += d.weights[r, j] * models[int(index[r, j])](x[r : r + 1])[0][0]
    torch.testing.assert_close(got[0], ref)


@pytest.mark.parametrize("chosen", [[3, 7], [7, 3], [2, 3, 4], list(range(10))])
def test_direct_subsets_match_those_members_alone(monkeypatch, chosen):
    """From the second call on, each chosen member runs its generated forward on the input;
    gradients reach those members' slices alone (one zero-filled gradient per tensor),
    second derivatives too."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)
    torch.manual_seed(0)
    models = [TwoInputs() for _ in range(10)]
    stack = phalanx.stack(copy.deepcopy(models), backend="auto")
    obs, act = torch.randn(6, 8), torch.randn(6, 2)
    stack(obs, act, subset=chosen)
    stack(obs, act, subset=chosen)
    assert isinstance(_direct(stack), _direct_mod.Direct)
    runs = _count_plan_runs(monkeypatch, _subsets)
    o, a = obs.clone().requires_grad_(True), act.clone().requires_grad_(True)
    out = stack(o, a, subset=chosen)
    assert runs == [] and stack.routed_path == "segment"
    with torch.no_grad():
        assert torch.equal(stack(obs, act, subset=chosen), out)  # in place: the same bits
    refs = [models[i](obs, act) for i in chosen]
    for got, ref in zip(out, refs):
        assert torch.equal(got, ref)
    (g_obs,) = torch.autograd.grad(out.square().sum(), o, create_graph=True)
    g_obs.square().sum().backward()
    for p_name, p in stack.module.named_parameters():
        for i in range(10):
            if i not in chosen:
                assert torch.count_nonzero(p.grad[i]) == 0, (p_name, i)
    oi = obs.clone().requires_grad_(True)  # the same gradient penalty on the loop
    loop_out = torch.stack([models[i](oi, act) for i in chosen])
    (gi,) = torch.autograd.grad(loop_out.square().sum(), oi, create_graph=True)
    torch.testing.assert_close(g_obs, gi)
    gi.square().sum().backward()
    for i in chosen:
        for p_name, p in models[i].named_parameters():
            torch.testing.assert_close(stack.module.get_parameter(p_name).grad[i], p.grad)


def test_compile_direct_refuses_a_module_it_does_not_know():
    """A leaf module with parameters other than nn.Linear has no direct function."""
    module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    traced = torch.fx.symbolic_trace(module)
    assert _direct_mod.compile_direct(traced.graph, module, traced) is None
    ok = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Identity(), nn.Linear(4, 2))
    traced = torch.fx.symbolic_trace(ok)
    direct = _direct_mod.compile_direct(traced.graph, ok, traced)
    assert direct is not None and not direct.writes


# --------------------------------------------------- per-segment outputs put back with a graph


def _graph_nodes(out) -> set[str]:
    """The names of the autograd nodes behind the tensors ``out``."""
    seen, names, todo = set(), set(), [o.grad_fn for o in out]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


def _own_rows(models, args, index):
    """The loop's ``out[rows] = y``: each member's forward on its own entries, flat
    ``(B * k, ...)`` outputs in entry order (a graph into each member's parameters)."""
    k = 1 if index.dim() == 1 else index.shape[1]
    flat = index.reshape(-1)
    outs = None
    for i, m in enumerate(models):
        entries = (flat == i).nonzero().squeeze(1)
        if entries.numel():
            own = leaves(m(*[a[entries // k] for a in args]))
            if outs is None:
                outs = [o.new_empty(flat.numel(), *o.shape[1:]) for o in own]
            for out, o in zip(outs, own):
                out[entries] = o
    return [o.view(*index.shape, *o.shape[1:]) for o in outs]


ONE_NODE_ROUTINGS = {  # on 4 members, 30 rows; none weighted, nothing dropped
    "one each, member 1 empty": lambda g: torch.tensor([0, 2, 3])[torch.randint(0, 3, (30,), generator=g)],
    "top2, member 3 empty": lambda g: torch.randint(0, 3, (30, 2), generator=g),
    "top2, all to member 2": lambda g: torch.full((30, 2), 2),
}  # fmt: skip


@pytest.mark.parametrize("routing", sorted(ONE_NODE_ROUTINGS))
@pytest.mark.parametrize("arch", ["gaussian", "mlp", "two_inputs"])
def test_unweighted_per_segment_outputs_go_back_in_one_node(monkeypatch, arch, routing):
    """An unweighted routing with a graph puts every segment's rows back through one autograd
    node per output (no chain of in-place index_copy_ nodes, whose backward cloned the
    whole output gradient once per segment): outputs, parameter and input gradients bit for
    bit the loop's ``out[rows] = y`` member by member; then a no-grad call, and a second
    call with another routing."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)
    models, stack = build(arch, 4, "auto")
    gen = torch.Generator().manual_seed(11)
    index = ONE_NODE_ROUTINGS[routing](gen)
    args = inputs(arch, 30, gen)
    stack(*args, members=index)  # proves the trace
    for call in range(2):
        xs = [a.clone().requires_grad_(True) for a in args]
        out = leaves(stack(*xs, members=index))
        assert stack.routed_path == "segment"
        nodes = _graph_nodes(out)
        assert "_PutRowsBackward" in nodes and "IndexCopyBackward0" not in nodes, nodes
        ref_xs = [a.clone().requires_grad_(True) for a in args]
        for m in models:
            m.zero_grad(set_to_none=True)
        ref = _own_rows(models, ref_xs, index)
        probes = [torch.randn(o.shape, generator=gen) for o in out]
        sum((o * p).sum() for o, p in zip(out, probes)).backward()
        sum((o * p).sum() for o, p in zip(ref, probes)).backward()
        for o, r in zip(out, ref):
            assert torch.equal(o, r), (arch, routing, call)
        for x, rx in zip(xs, ref_xs):
            assert torch.equal(x.grad, rx.grad), (arch, routing, call)
        for name, p in stack.module.named_parameters():
            for i, m in enumerate(models):
                own = m.get_parameter(name).grad
                expected = torch.zeros_like(p[i]) if own is None else own
                assert torch.equal(p.grad[i], expected), (name, i, call)
        stack.zero_grad(set_to_none=True)
        with torch.no_grad():  # no graph after graph calls: the same bits
            assert all(torch.equal(a, b) for a, b in zip(leaves(stack(*args, members=index)), out))
        index = torch.randint(0, 4, index.shape, generator=gen)  # the second call: another routing
    check_against_loop(models, stack, args, index, None, second=True)  # second derivatives


@pytest.mark.parametrize("chosen", [[3, 7], [7, 3], [0, 9], [4, 5], [9], list(range(10))])
def test_subset_stacked_gradients_match_the_loop(monkeypatch, chosen):
    """A subset's stacked gradients (one autograd node's backward for all the stacked
    tensors): bit for bit each chosen member's own gradient, exact zeros elsewhere, the
    first and last members and adjacent ones included; differentiated again
    (``create_graph=True`` on the parameters) equal to the loop to float rounding; a no-grad
    call after it gives the graph call's bits."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)
    torch.manual_seed(0)
    models = [TwoInputs() for _ in range(10)]
    stack = phalanx.stack(copy.deepcopy(models), backend="auto")
    obs, act = torch.randn(6, 8), torch.randn(6, 2)
    stack(obs, act, subset=chosen)  # proves the trace
    out = stack(obs, act, subset=chosen)
    assert stack.routed_path == "segment"
    out.square().sum().backward()
    for i, m in enumerate(models):
        own = torch.autograd.grad(m(obs, act).square().sum(), list(m.parameters()))
        for (name, p), g in zip(m.named_parameters(), own):
            got = stack.module.get_parameter(name).grad[i]
            assert torch.equal(got, g if i in chosen else torch.zeros_like(p)), (name, i)
    with torch.no_grad():
        assert torch.equal(stack(obs, act, subset=chosen), out)
    params = list(stack.parameters())
    grads = torch.autograd.grad(stack(obs, act, subset=chosen).square().sum(), params,
                                create_graph=True)  # fmt: skip
    stack.zero_grad(set_to_none=True)
    sum(g.square().sum() for g in grads).backward()
    refs = {}
    for dtype in (torch.float32, torch.float64):
        ms = [copy.deepcopy(m).to(dtype) for m in models]
        for i in chosen:
            own = torch.autograd.grad(ms[i](obs.to(dtype), act.to(dtype)).square().sum(),
                                      list(ms[i].parameters()), create_graph=True)  # fmt: skip
            sum(g.square().sum() for g in own).backward()
        refs[dtype] = {n: torch.stack([_grad_or_zero(m.get_parameter(n)) for m in ms])
                       for n, _ in ms[0].named_parameters()}  # fmt: skip
    for name, p in stack.module.named_parameters():
        phalanx.testing.assert_equal_to_loop(
            p.grad, refs[torch.float32][name], refs[torch.float64][name], what=name
        )
        left_out = [i for i in range(10) if i not in chosen]
        assert torch.count_nonzero(p.grad[left_out]) == 0, name


@pytest.mark.parametrize("masked", [True, False])
def test_training_a_subset_steps_only_its_members_with_mask(masked):
    """A subset's backward leaves zero gradient rows for the members left out. The loop over
    the chosen modules gives those no gradient and torch.optim no step; ``opt.step(mask=...)``
    does the same: the members left out keep their weights and Adam state bit for bit, the
    chosen equal the loop's to float rounding. Without the mask Adam steps them on zeros, and
    a member with moments moves (what the guide warns of)."""
    torch.manual_seed(0)
    models = [TwoInputs() for _ in range(6)]
    stack = phalanx.stack(copy.deepcopy(models), backend="auto")
    opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
    loop_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    gen = torch.Generator().manual_seed(1)
    for step, chosen in enumerate([list(range(6)), [1, 4], [4, 0], [2, 3], [1, 4]]):
        obs, act = torch.randn(5, 8, generator=gen), torch.randn(5, 2, generator=gen)
        opt.zero_grad(set_to_none=True)
        stack(obs, act, subset=chosen).square().sum().backward()
        before = {n: p.detach().clone() for n, p in stack.module.named_parameters()}
        mask = torch.zeros(6, dtype=torch.bool)
        mask[chosen] = True
        opt.step(mask=mask if masked else None)
        for i in chosen:
            loop_opts[i].zero_grad(set_to_none=True)
            models[i](obs, act).square().sum().backward()
            loop_opts[i].step()
        left_out = [i for i in range(6) if i not in chosen]
        for name, p in stack.module.named_parameters():
            own = torch.stack([m.get_parameter(name).detach() for m in models])
            if masked:
                torch.testing.assert_close(p.detach(), own, rtol=1e-5, atol=1e-6)
                assert torch.equal(p.detach()[left_out], before[name][left_out]), (step, name)
            elif step > 0 and left_out:
                assert not torch.equal(p.detach()[left_out], before[name][left_out]), name
        if masked:
            for p, (name, _) in zip(stack.parameters(), stack.module.named_parameters()):
                state = opt.state[p]
                for i in range(6):
                    own = loop_opts[i].state.get(models[i].get_parameter(name), {})
                    if own:
                        torch.testing.assert_close(state["exp_avg"][i], own["exp_avg"])
                        assert int(state["step"][i]) == int(own["step"]), (name, i)


def _grad_or_zero(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def test_the_in_place_check_agrees_with_broadcast_shapes():
    """The generated forward's in-place product, sum, difference or quotient writes into its
    first operand only where the other broadcasts to it: the same answer as
    ``torch.broadcast_shapes`` on every pair of a table of shapes (empty dims included)."""
    shapes = [(), (0,), (1,), (3,), (2, 3), (1, 3), (2, 1), (3, 1), (0, 3), (1, 0), (2, 0),
              (4, 2, 3), (1, 1, 1)]  # fmt: skip
    for big in map(torch.Size, shapes):
        for small in map(torch.Size, shapes):
            try:
                expected = len(small) <= len(big) and torch.broadcast_shapes(big, small) == big
            except RuntimeError:  # the shapes do not broadcast at all
                expected = False
            assert _direct_mod._broadcasts_to(small, big) == expected, (small, big)


class WritesItsBuffer(nn.Module):
    """A step counter and an EMA written in place by the forward, read into the output. The
    writes that read no input run on torch.fx's traced copy and are left out of its graph."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(6, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.kind == "ema":
            self.ema.mul_(0.5).add_(1.0)
        elif self.kind == "ema_of_weight":
            self.ema.lerp_(self.a.weight.detach().sum(1), 0.5)
        return self.a(x) * self.calls + self.ema


@pytest.mark.parametrize("kind", ["counter", "ema", "ema_of_weight"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_routed_and_subset_calls_keep_the_members_buffer_writes(backend, kind):
    torch.manual_seed(0)
    members = [WritesItsBuffer(kind) for _ in range(4)]
    x = torch.randn(7, 6)
    idx = torch.tensor([0, 2, 2, 3, 0, 2, 2])
    alone = copy.deepcopy(members)
    st = phalanx.stack(copy.deepcopy(members), backend=backend)
    for _ in range(2):  # the second call reads the first's writes (and the cached plan)
        ref = torch.zeros(7, 3)
        for i, m in enumerate(alone):
            rows = (idx == i).nonzero().flatten()
            if len(rows):
                ref[rows] = m(x[rows]).detach()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = st(x, members=idx)
        torch.testing.assert_close(y.detach(), ref)
        for name in ("calls", "ema"):
            got = dict(st.module.named_buffers())[name]
            torch.testing.assert_close(got, torch.stack([getattr(m, name) for m in alone]))
    alone = copy.deepcopy(members)
    st = phalanx.stack(copy.deepcopy(members), backend=backend)
    ref = torch.stack([alone[2](x), alone[0](x)]).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = st(x, subset=[2, 0])
    torch.testing.assert_close(y.detach(), ref)
    torch.testing.assert_close(st.module.calls, torch.stack([m.calls for m in alone]))
    torch.testing.assert_close(st.module.ema, torch.stack([m.ema for m in alone]))
