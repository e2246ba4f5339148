"""Where two features meet (issue: exact where features meet), the engine's side: chunked
backward, the captured step, auto's hand-over and export's vmap levels, each against the
members run alone, member by member."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.testing import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:Stack.forward.*input 0 is shared")


class Seeded(nn.Module):
    """Member i: one ``Linear(d_in, d_out)`` initialised from seed i; subclasses add the
    forward under test."""

    def __init__(self, i: int, d_in: int = 6, d_out: int = 3) -> None:
        super().__init__()
        torch.manual_seed(i)
        self.a = nn.Linear(d_in, d_out)


class OwnGenerator(Seeded):
    """Draws from a torch.Generator of its own."""

    def __init__(self, i: int, d_in: int = 6, d_out: int = 3) -> None:
        super().__init__(i, d_in, d_out)
        self.gen = torch.Generator().manual_seed(50 + i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + torch.randn(x.shape[0], self.a.out_features, generator=self.gen)


class Halve(Seeded):
    """Writes its shared input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x /= 2.0
        return self.a(x)


def quiet(backend: str, members: list[nn.Module]) -> phalanx.Stack:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return phalanx.stack(copy.deepcopy(members), backend=backend)


def sq(out: torch.Tensor, rows: slice) -> torch.Tensor:
    return out.pow(2).sum(dim=(1, 2))


# ------------------------------------------------------------------- backward_in_chunks


@pytest.mark.parametrize("backend", ["loop", "auto"])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_chunks_draw_each_members_own_generator(backend: str, k: int) -> None:
    """Failed before the fix: the chunk's view carried no generators (losses off by 8.5)."""
    members = [OwnGenerator(i, 4, 4) for i in range(5)]
    x = torch.randn(3, 4)
    alone = copy.deepcopy(members)
    first = [m(x).pow(2).sum() for m in alone]
    second = [m(x) for m in alone]
    stack = quiet(backend, members)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = stack.backward_in_chunks(sq, x, chunk_members=k)
        nxt = stack(x)
    for i in range(5):
        torch.testing.assert_close(losses[i], first[i].detach(), rtol=0, atol=0)
        torch.testing.assert_close(nxt[i], second[i], rtol=0, atol=0)
        first[i].backward()
        assert_close(stack.module.a.weight.grad[i], alone[i].a.weight.grad)


@pytest.mark.parametrize("backend", ["loop", "fused", "auto", "vmap"])
def test_chunks_write_a_shared_input_once(backend: str) -> None:
    """Failed before the fix: every chunk wrote x again (chunk 2 saw x / 4)."""
    members = [Halve(i) for i in range(4)]
    x = torch.randn(5, 6)
    alone = copy.deepcopy(members)
    want = [m(x.clone()).pow(2).sum() for m in alone]
    stack = quiet(backend, members)
    xs = x.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = stack.backward_in_chunks(sq, xs, chunk_members=2)
    torch.testing.assert_close(xs, x / 2, rtol=0, atol=0)  # written once
    for i in range(4):
        assert_close(got[i], want[i].detach())
        want[i].backward()
        assert_close(stack.module.a.weight.grad[i], alone[i].a.weight.grad)


@pytest.mark.parametrize("backend", ["loop", "fused"])
@pytest.mark.parametrize("per_member", [False, True])
def test_chunks_give_an_input_that_requires_grad_its_gradient(
    backend: str, per_member: bool
) -> None:
    """Failed before the fix: x.grad stayed None (and a non-leaf input's graph got nothing)."""
    members = [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)) for _ in range(5)]
    raw = torch.randn(5, 4, 6) if per_member else torch.randn(4, 6)
    scale = torch.tensor(1.5, requires_grad=True)  # a non-leaf input: x = raw * scale
    leaf = raw.clone().requires_grad_()
    dims = 0 if per_member else None
    for m in members:
        for p in m.parameters():
            p.grad = None
    # the unchunked loop, the reference
    ref_stack = quiet("loop", members)
    ref_scale = scale.detach().clone().requires_grad_()
    ref_leaf = raw.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (sq(ref_stack(ref_leaf, in_dims=dims), slice(None)).sum()).backward()
        (sq(ref_stack(raw * ref_scale, in_dims=dims), slice(None)).sum()).backward()
        stack = quiet(backend, members)
        stack.backward_in_chunks(sq, leaf, chunk_members=2, in_dims=dims)
        stack.backward_in_chunks(sq, raw * scale, chunk_members=2, in_dims=dims)
    assert leaf.grad is not None and scale.grad is not None
    assert_close(leaf.grad, ref_leaf.grad)
    assert_close(scale.grad, ref_scale.grad)


def test_chunks_take_per_member_keyword_inputs() -> None:
    """Failed before the fix: kw_in_dims reached the member's forward (TypeError)."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.a(x) * mask

    torch.manual_seed(0)
    members = [Masked() for _ in range(4)]
    x, mask = torch.randn(5, 6), torch.rand(4, 5, 1)
    want = [m(x, mask=mask[i]).pow(2).sum() for i, m in enumerate(members)]
    stack = phalanx.stack(copy.deepcopy(members), backend="loop")
    got = stack.backward_in_chunks(sq, x, chunk_members=3, mask=mask, kw_in_dims={"mask": 0})
    for i in range(4):
        assert_close(got[i], want[i].detach())


# ---------------------------------------------------------------- export's vmap levels


class Gathers(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.w = nn.Parameter(torch.randn(10, 3))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.op == "gather":
            return torch.gather(self.w, 0, idx) * x
        if self.op == "index_select":
            return self.w.index_select(0, idx[:, 0]) * x
        if self.op == "getitem":
            return self.w[idx[:, 0]] * x + self.w[-1]
        if self.op == "scatter_add":
            return torch.zeros(10, 3).scatter_add(0, idx, x) @ self.w.t()
        return torch.take_along_dim(self.w, idx, 0) * x


def _process_is_whole() -> None:
    torch.rand(3).numpy()  # raised "Cannot access data pointer" with a vmap level left open
    torch.rand(4).bernoulli_(0.5)
    assert torch._C._functorch.maybe_current_level() is None


@pytest.mark.parametrize("backend", ["auto", "vmap"])
@pytest.mark.parametrize(
    "op", ["gather", "index_select", "scatter_add", "take_along_dim", "getitem"]
)
def test_an_exported_request_out_of_range_is_refused_and_leaves_no_level(
    backend: str, op: str
) -> None:
    """Failed before the fix (every op): the exported program raised inside its vmap level,
    and the process was broken afterwards."""
    torch.manual_seed(0)
    members = [Gathers(op) for _ in range(3)]
    stack = quiet(backend, members).eval()
    x, idx = torch.randn(4, 3), torch.randint(0, 10, (3, 4, 3))
    program = torch.export.export(stack, (x, idx), kwargs={"in_dims": (None, 0)})
    got = program.module()(x, idx, in_dims=(None, 0))
    for i, m in enumerate(members):
        assert_close(got[i], m(x, idx[i]))
    bad = idx.clone()
    bad[1, 0, 0] = 99
    with pytest.raises(RuntimeError, match=r"index out of range|out of bounds"):
        program.module()(x, bad, in_dims=(None, 0))
    _process_is_whole()


# --------------------------------------------------- refusals inside the caller's transform


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.r, self.o = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.r(x)[0][:, -1])


def test_jacrev_through_gru_members_on_vmap_is_the_documented_refusal() -> None:
    """Failed before the fix: the diagnosis of the member's own error called requires_grad_
    inside the caller's jacrev, a raw functorch error."""
    from phalanx.backends import BackendRefusal

    torch.manual_seed(0)
    members = [Recurrent() for _ in range(3)]
    x = torch.randn(2, 5, 3)
    stack = phalanx.stack(copy.deepcopy(members), backend="vmap")
    with pytest.raises(BackendRefusal, match=r"Batching rule not implemented for aten::gru"):
        torch.func.jacrev(stack)(x)
    loop = phalanx.stack(copy.deepcopy(members), backend="loop")
    got = torch.func.jacrev(loop)(x)
    for i, m in enumerate(members):
        assert_close(got[i], torch.func.jacrev(m)(x))


def test_a_members_own_error_inside_jacrev_is_the_members() -> None:
    stack = phalanx.stack([nn.Linear(4, 2) for _ in range(3)], backend="vmap")
    with pytest.raises(RuntimeError, match=r"member 0's own forward"):
        torch.func.jacrev(stack)(torch.randn(5, 3))


# ------------------------------------------------------------------------- compile_step


class Reseeds(Seeded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(123)
        return self.a(x) + torch.randn(x.shape[0], 3)


class MakesGenerator(Seeded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(7)
        return self.a(x) + torch.randn(x.shape[0], 3, generator=g)


def _trained_alone(members: list[nn.Module], x: torch.Tensor, y: torch.Tensor, steps: int):
    alone = copy.deepcopy(members)
    for m in alone:
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(steps):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    return alone


@pytest.mark.parametrize("cls", [OwnGenerator, Reseeds, MakesGenerator])
def test_compile_step_on_random_members_runs_eager_and_says_why(cls: type) -> None:
    """Failed before the fix (OwnGenerator, Reseeds): the captured graph trained with other
    noise, silently (weights off by 0.09 and 0.1 after 3 steps)."""
    members = [cls(i) for i in range(4)]
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    alone = _trained_alone(members, x, y, 3)
    stack = quiet("auto", members)
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
    step = phalanx.compile_step(stack, F.mse_loss, opt, warmup_steps=1)
    with (
        pytest.warns(UserWarning, match=r"compile_step\(\).*(torch.Generator|reseeds)"),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message="phalanx: backend 'fused'")
        for _ in range(3):
            step(x, y)
    for i in range(4):
        assert_close(stack.module.a.weight[i], alone[i].a.weight)
        assert_close(stack.module.a.bias[i], alone[i].a.bias)


@pytest.mark.parametrize("warmup", [1, 3])
def test_compile_step_writes_an_input_once_per_step(warmup: int) -> None:
    """Failed before the fix: the capture step's trace wrote x, then its graph again."""
    members = [Halve(i) for i in range(4)]
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    alone = copy.deepcopy(members)
    xa = x.clone()
    for _ in range(5):  # each member alone on the same, shrinking input
        for m in alone:
            o = torch.optim.SGD(m.parameters(), lr=0.1)
            o.zero_grad()
            F.mse_loss(m(xa.clone()), y).backward()
            o.step()
        xa /= 2
    stack = quiet("auto", members)
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.1)
    step = phalanx.compile_step(stack, F.mse_loss, opt, warmup_steps=warmup)
    xs = x.clone()
    for k in range(5):
        step(xs, y)
        torch.testing.assert_close(xs, x / 2 ** (k + 1), rtol=0, atol=0)
    for i in range(4):
        assert_close(stack.module.a.weight[i], alone[i].a.weight)


# ------------------------------------------------------- random streams: made, held, spent


class Dropping(Seeded):
    """Draws dropout, then turns its data into a Python value: fused refuses after drawing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.a(x), 0.5, training=True)
        return h * 2 if bool(h.sum() > 0) else h


class HoldsUnused(Seeded):
    def __init__(self, i: int) -> None:
        super().__init__(i)
        self.gen = torch.Generator().manual_seed(i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


@pytest.mark.parametrize("backend", ["fused", "vmap"])
def test_a_forward_that_makes_its_own_generator_is_refused_on_vmapped_backends(
    backend: str,
) -> None:
    """Failed before the fix: fused and vmap drew other numbers, silently (3.76 off)."""
    from phalanx.backends import BackendRefusal

    stack = phalanx.stack([MakesGenerator(i) for i in range(3)], backend=backend)
    with pytest.raises(BackendRefusal, match=r"draws from a torch.Generator object.*loop"):
        stack(torch.randn(5, 6))


def test_auto_hands_a_forward_that_makes_its_own_generator_to_the_loop() -> None:
    """Failed before the fix: auto ran fused, other draws than the members' (3.76 off)."""
    members = [MakesGenerator(i) for i in range(3)]
    x = torch.randn(5, 6)
    stack = phalanx.stack(copy.deepcopy(members))
    with pytest.warns(UserWarning, match=r"torch.Generator object.*runs 'loop'"):
        got = stack(x)
    for i, m in enumerate(members):
        torch.testing.assert_close(got[i], m(x), rtol=0, atol=0)


def test_auto_leaves_the_global_stream_as_the_loop_alone_would() -> None:
    """Failed before the fix: the refused fused attempt's dropout draws were spent, so the
    caller's next draw differed from the loop's."""
    members = [Dropping(i) for i in range(3)]
    x = torch.randn(5, 6)
    loop = phalanx.stack(copy.deepcopy(members), backend="loop")
    auto = phalanx.stack(copy.deepcopy(members), backend="auto")
    torch.manual_seed(1)
    want = loop(x)
    want_next = torch.rand(4)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match=r"runs 'loop'"):
        got = auto(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(4), want_next, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["fused", "vmap", "auto"])
def test_a_generator_held_but_never_drawn_from_costs_no_backend(backend: str) -> None:
    """Failed before the fix: refused on fused and vmap (saying the member draws from it);
    auto ran the loop."""
    members = [HoldsUnused(i) for i in range(3)]
    x = torch.randn(5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stack = phalanx.stack(copy.deepcopy(members), backend=backend)
        got = stack(x)
    for i, m in enumerate(members):
        assert_close(got[i], m(x))
    if backend == "auto":
        assert stack.backend == "fused"  # auto did not drop to the loop


@pytest.mark.parametrize("backend", ["fused", "vmap"])
def test_a_held_generator_drawn_from_is_still_refused(backend: str) -> None:
    from phalanx.backends import BackendRefusal

    stack = phalanx.stack([OwnGenerator(i, 4, 4) for i in range(3)], backend=backend)
    with pytest.raises(BackendRefusal, match=r"draws from a torch.Generator object"):
        stack(torch.randn(5, 4))


# ----------------------------------------------------------------------- padded widths


class PooledConv(nn.Module):
    def __init__(self, width: int, how: str) -> None:
        super().__init__()
        self.c, self.how = nn.Conv2d(1, width, 3), how
        self.l = nn.Linear(width * (1 if how in ("mean", "gap", "amax") else 9), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c(x))
        if self.how == "max":
            h = F.max_pool2d(h, 2)
        elif self.how == "avg":
            h = F.avg_pool2d(h, 2)
        elif self.how == "adaptive":
            h = F.adaptive_avg_pool2d(h, 3)
        elif self.how == "amax":
            h = F.adaptive_max_pool2d(h, 1)
        elif self.how == "mean":
            h = h.mean(dim=(2, 3))
        elif self.how == "gap":
            h = torch.mean(h, dim=(-2, -1), keepdim=True)
        return self.l(torch.flatten(h, 1))


@pytest.mark.parametrize("backend", ["loop", "fused"])
@pytest.mark.parametrize("how", ["max", "avg", "adaptive", "amax", "mean", "gap"])
def test_functional_pools_after_padded_conv_channels_are_exact(backend: str, how: str) -> None:
    """Failed before the fix: every functional pool and spatial mean was refused at
    phalanx.stack(pad_widths=True), though pooling over channels is accepted."""
    torch.manual_seed(0)
    members = [PooledConv(w, how) for w in (4, 6, 5)]
    x = torch.randn(2, 1, 8, 8)
    stack = phalanx.stack(copy.deepcopy(members), pad_widths=True, backend=backend)
    out = stack(x)
    out.pow(2).sum().backward()
    for i, m in enumerate(members):
        want = m(x)
        assert_close(out[i], want)
        want.pow(2).sum().backward()
        w = m.c.weight.shape[0]
        assert_close(stack.module.c.weight.grad[i, :w], m.c.weight.grad)
        assert torch.equal(
            stack.module.c.weight.grad[i, w:], torch.zeros_like(stack.module.c.weight.grad[i, w:])
        )


class ReducesChannels(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c, self.l = nn.Conv2d(1, width, 3), nn.Linear(36, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(torch.flatten(self.c(x).mean(dim=1), 1))


def test_a_reduction_over_padded_channels_is_still_refused() -> None:
    with pytest.raises(ValueError, match=r"reduces over more than the spatial dims"):
        phalanx.stack([ReducesChannels(w) for w in (4, 6)], pad_widths=True)


def test_routed_and_subset_calls_of_a_forward_that_makes_its_own_generator() -> None:
    """Failed before the fix: subset= on auto drew other numbers, silently (2.78 off): the
    row-wise trace kept the generator made while tracing."""
    members = [MakesGenerator(i) for i in range(3)]
    x, idx = torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])
    stack = quiet("auto", members)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        routed = stack(x, members=idx)
        sub = stack(x, subset=[2, 0])
    for j, m in enumerate(members):
        rows = (idx == j).nonzero()[:, 0]
        torch.testing.assert_close(routed[rows], m(x[rows]), rtol=0, atol=0)
    torch.testing.assert_close(sub[0], members[2](x), rtol=0, atol=0)
    torch.testing.assert_close(sub[1], members[0](x), rtol=0, atol=0)


def test_chunks_give_what_loss_fn_closes_over_its_gradient() -> None:
    """Failed before the change: a temperature loss_fn divides by got no gradient."""
    torch.manual_seed(0)
    members = [nn.Linear(6, 3) for _ in range(5)]
    x = torch.randn(4, 6)
    temps = []
    for chunked in (False, True):
        temp = torch.tensor(2.0, requires_grad=True)
        stack = phalanx.stack(copy.deepcopy(members), backend="loop")

        def loss(out: torch.Tensor, rows: slice, temp: torch.Tensor = temp) -> torch.Tensor:
            return (out / temp).pow(2).sum(dim=(1, 2))

        if chunked:
            stack.backward_in_chunks(loss, x, chunk_members=2)
        else:
            loss(stack(x), slice(None)).sum().backward()
        temps.append(temp.grad)
    assert temps[1] is not None
    assert_close(temps[1], temps[0])
