"""What routed calls keep between calls (issue 26): the module-tree witness that stands in for
the fingerprint, the no-grad member slices kept while the stacked tensors keep their memory,
and the reused Linear buffers. Each edge (ids, weights, settings, hooks, modes, devices and
dtypes changed between calls; copies of the stack; two threads) is checked against each
member's own forward, bit for bit (the generated forward runs the member's operations on its
rows: ``torch.equal``, one and two threads)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.routed import _checks, _direct, _rowwise, _segments


class Critic(nn.Module):
    """CleanRL's SoftQNetwork (REDQ's critics), small."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 1)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(torch.cat([obs, act], 1)))
        return self.fc3(F.relu(self.fc2(x)))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 24, bias=False)
        self.w2 = nn.Linear(24, 8, bias=False)
        self.w3 = nn.Linear(8, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Scaled(nn.Module):
    """A plain attribute the trace bakes in (``self.scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)) * self.scale)


class Shifted(Scaled):
    """A baked-in value inside a list (mutable: the witness does not stand in for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.shifts = [0.5]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)) + self.shifts[0])


def members(make, n=5, seed=0):
    torch.manual_seed(seed)
    models = [make() for _ in range(n)]
    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return models, phalanx.stack(copy.deepcopy(models), backend="auto")


def critic_inputs(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def own_subset(models, chosen, args):
    return torch.stack([models[i](*args) for i in chosen])


def own_routed(models, index, args):
    """Each row its member's own forward on that member's rows (one member per row)."""
    out = None
    for i, m in enumerate(models):
        rows = (index == i).nonzero().squeeze(1)
        if rows.numel():
            y = m(*[a[rows] for a in args])
            out = y.new_zeros(index.shape[0], *y.shape[1:]) if out is None else out
            out[rows] = y
    return out


@pytest.fixture(autouse=True)
def per_segment(monkeypatch):
    """Small segments run the generated forward too (the bench's sizes pick it on their own)."""
    monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 1)


def warm(stack, *args, **kw):
    """Two calls: the first proves the trace row-wise, the second compiles the direct function."""
    stack(*args, **kw)
    stack(*args, **kw)
    assert isinstance(stack.routed_plan.direct, _direct.Direct)


# ----------------------------------------------------------------------------- reused buffers


@pytest.mark.parametrize("grad", [False, True])
def test_results_kept_across_calls_never_change(grad):
    """Call twice (and more) with other inputs, keep every output: the first is unchanged and
    each is bit for bit its members' own forward (no output aliases a reused buffer)."""
    models, stack = members(Critic)
    subset_models = models
    moe_models, moe = members(SwiGLU, n=4, seed=1)
    warm(stack, *critic_inputs(40, 0), subset=[1, 3])
    idx = torch.randint(0, 4, (50,), generator=torch.Generator().manual_seed(2))
    warm(moe, torch.randn(50, 8), members=idx)
    with torch.set_grad_enabled(grad):
        kept = []
        for seed, rows in [(1, 40), (2, 40), (3, 64), (4, 7)]:
            args = critic_inputs(rows, seed)
            out = stack(*args, subset=[1, 3])
            kept.append((out, out.detach().clone(), own_subset(subset_models, [1, 3], args)))
            x = torch.randn(rows * 2, 8, generator=torch.Generator().manual_seed(seed))
            index = torch.randint(0, 4, (rows * 2,), generator=torch.Generator().manual_seed(seed))
            y = moe(x, members=index)
            kept.append((y, y.detach().clone(), own_routed(moe_models, index, (x,))))
            sorted_index = index.sort().values  # the in-order path: segments are views
            z = moe(x, members=sorted_index)
            kept.append((z, z.detach().clone(), own_routed(moe_models, sorted_index, (x,))))
        for out, snapshot, own in kept:
            assert torch.equal(out, snapshot)  # unchanged by the later calls
            assert torch.equal(out, own)
    assert stack.routed_path == "segment" and moe.routed_path == "segment"


def test_inference_mode_and_no_grad_alternate():
    """Buffers made in inference mode are inference tensors, which a no_grad call may not
    write: each mode keeps its own (this raised before)."""
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    warm(stack, *args, subset=[0, 4])
    for mode in [torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad]:
        with mode():
            assert torch.equal(stack(*args, subset=[0, 4]), own_subset(models, [0, 4], args))
    out = stack(*args, subset=[0, 4])  # and with a graph again
    assert torch.equal(out, own_subset(models, [0, 4], args))


def test_a_copy_of_the_stack_has_its_own_buffers_and_slices():
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    with torch.no_grad():
        warm(stack, *args, subset=[0, 2])
        stack(*args, subset=[0, 2])
    target = copy.deepcopy(stack)
    a, b = stack.routed_plan.direct, target.routed_plan.direct
    assert a.workspace is not b.workspace and not b.workspace.buffers
    with torch.no_grad():
        target.module.fc2.weight.mul_(0.5)  # the copy's weights only
        got_target = target(*args, subset=[0, 2])
        got = stack(*args, subset=[0, 2])
    halved = copy.deepcopy(models)
    with torch.no_grad():
        for m in halved:
            m.fc2.weight.mul_(0.5)
    assert torch.equal(got, own_subset(models, [0, 2], args))
    assert torch.equal(got_target, own_subset(halved, [0, 2], args))


def test_two_threads_at_once():
    """Two threads on one stack, and on a stack and its copy (own buffers, own lock), each
    call with its own inputs and members: every result is its members' own forward."""
    models, stack = members(Critic)
    warm(stack, *critic_inputs(30, 0), subset=[0, 1])
    with torch.no_grad():
        stack(*critic_inputs(30, 0), subset=[0, 1])
    target = copy.deepcopy(stack)
    errors: list[str] = []

    def work(s, seed):
        gen = torch.Generator().manual_seed(seed)
        for step in range(30):
            rows = 20 + 10 * (step % 3)
            args = critic_inputs(rows, seed * 100 + step)
            chosen = torch.randperm(5, generator=gen)[:2].tolist()
            with torch.no_grad() if step % 2 else torch.enable_grad():
                out = s(*args, subset=chosen)
            if not torch.equal(out, own_subset(models, chosen, args)):
                errors.append(f"thread {seed} step {step} {chosen}")

    threads = [threading.Thread(target=work, args=(s, seed))
               for seed, s in enumerate([stack, stack, target, target])]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ------------------------------------------------------------------ kept slices and the witness


def test_ids_changed_between_calls():
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    warm(stack, *args, subset=[1, 3])
    with torch.no_grad():
        for chosen in ([1, 3], [3, 1], [0, 4], [2], [4, 3, 2, 1, 0], [1, 3]):
            assert torch.equal(stack(*args, subset=chosen), own_subset(models, chosen, args))
    idx = torch.tensor([0, 1, 2, 3, 4] * 6)
    warm(stack, *args, members=idx)
    with torch.no_grad():
        for index in (idx, idx.flip(0), torch.full((30,), 2), idx.sort().values):
            assert torch.equal(stack(*args, members=index), own_routed(models, index, args))


class _Sorts:
    """Counts the routings sorted (``Routing`` built) while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        init = _checks.Routing.__init__

        def counted(routing, *a, **k):  # type: ignore[no-untyped-def]
            self.count += 1
            init(routing, *a, **k)

        monkeypatch.setattr(_checks.Routing, "__init__", counted)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_an_index_kept_between_calls_is_sorted_once(monkeypatch, grad, batched):
    """The same index tensor, unchanged, is sorted once; written in place (values, a bad id,
    members left without rows, ``.data``), replaced by an equal tensor, each call is still
    its members' own forward, and a changed index is sorted again; on the per-segment path
    and on the pass over all rows."""
    if batched:  # every call once over all rows (the cost rule's other side)
        monkeypatch.setattr(_segments, "PER_SEGMENT_FEW", 0)
        monkeypatch.setattr(_segments, "PER_SEGMENT_ROWS", 10**9)
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    idx = torch.tensor([3, 0, 1, 2, 4, 1] * 5)
    stack(*args, members=idx)
    stack(*args, members=idx)
    sorts = _Sorts(monkeypatch)
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            assert torch.equal(stack(*args, members=idx), own_routed(models, idx, args))
        assert sorts.count == 0  # kept from the warm-up
        idx[:4] = torch.tensor([4, 4, 0, 0])  # in place: the version counter moves
        assert torch.equal(stack(*args, members=idx), own_routed(models, idx, args))
        assert sorts.count == 1
        idx.data = idx.flip(0)  # new memory under the same object
        assert torch.equal(stack(*args, members=idx), own_routed(models, idx, args))
        same = idx.clone()  # equal values, another tensor
        assert torch.equal(stack(*args, members=same), own_routed(models, same, args))
        assert sorts.count == 3
        idx[0] = 5  # out of range: checked again, not served from the kept sort
        with pytest.raises(IndexError, match="member index 5"):
            stack(*args, members=idx)
        idx[0] = 2
        assert torch.equal(stack(*args, members=idx), own_routed(models, idx, args))
        idx.copy_(torch.tensor([4, 0, 4] * 10))  # members 1-3 without rows, repeated ids
        for _ in range(2):
            assert torch.equal(stack(*args, members=idx), own_routed(models, idx, args))
        narrow = idx.int()  # another dtype, another tensor
        assert torch.equal(stack(*args, members=narrow), own_routed(models, idx, args))


def test_a_kept_index_with_other_weights_and_gradients(monkeypatch):
    """Weights (and their gradients) are this call's, never the kept call's; input and
    parameter gradients through a kept routing equal the members' own."""
    moe_models, moe = members(SwiGLU, n=4, seed=1)
    x = torch.randn(24, 8)
    index = torch.randint(0, 4, (24, 2), generator=torch.Generator().manual_seed(3))
    warm(moe, x, members=index, weights=torch.rand(24, 2))
    sorts = _Sorts(monkeypatch)
    for seed in range(3):
        w = torch.rand(24, 2, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        xs = x.clone().requires_grad_(True)
        moe.zero_grad(set_to_none=True)
        out = moe(xs, members=index, weights=w)
        out.square().sum().backward()
        ref_w = w.detach().clone().requires_grad_(True)
        ref_x = x.clone().requires_grad_(True)
        ref = sum(
            own_routed(moe_models, index[:, j], (ref_x,)) * ref_w[:, j : j + 1] for j in range(2)
        )
        for m in moe_models:
            m.zero_grad(set_to_none=True)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(w.grad, ref_w.grad)
        torch.testing.assert_close(xs.grad, ref_x.grad)
        for name, p in moe.module.named_parameters():
            own = torch.stack([m.get_parameter(name).grad for m in moe_models])
            torch.testing.assert_close(p.grad, own)
    assert sorts.count == 0


def test_an_inference_index_is_sorted_every_call(monkeypatch):
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    with torch.inference_mode():
        idx = torch.tensor([3, 0, 1, 2, 4, 1] * 5)
    warm(stack, *args, members=idx.clone())
    sorts = _Sorts(monkeypatch)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            assert torch.equal(stack(*args, members=idx), own_routed(models, idx, args))
    assert sorts.count == 3
    kept = idx.clone()  # sorted in inference mode, then used where a graph is recorded
    with torch.inference_mode():
        stack(*args, members=kept)
    out = stack(*(a.requires_grad_(True) for a in args), members=kept)
    out.sum().backward()
    torch.testing.assert_close(out, own_routed(models, kept, args))


def test_two_threads_route_one_stack():
    """Two threads on one stack, each with its own index tensor reused and rewritten in
    place: every result is its members' own forward."""
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    warm(stack, *args, members=torch.arange(30) % 5)
    errors: list[str] = []

    def work(seed):
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, 5, (30,), generator=gen)
        for step in range(40):
            if step % 4 == 0:
                idx.copy_(torch.randint(0, 5, (30,), generator=gen))
            with torch.no_grad() if step % 2 else torch.enable_grad():
                out = stack(*args, members=idx)
            if not torch.equal(out, own_routed(models, idx, args)):
                errors.append(f"thread {seed} step {step}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_weights_changed_in_place_between_calls():
    """An optimizer step writes the stacked tensors in place: the kept slices see it."""
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    warm(stack, *args, subset=[1, 3])
    opt = torch.optim.SGD(stack.parameters(), lr=0.1)
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(stack(*args, subset=[1, 3]), own_subset(models, [1, 3], args))
        opt.zero_grad()
        stack(*args, subset=[1, 3]).pow(2).sum().backward()
        opt.step()  # in place: members 1 and 3 move
        with torch.no_grad():  # the members take the stack's new values
            for i, m in enumerate(models):
                for name, p in m.named_parameters():
                    p.copy_(stack.module.get_parameter(name)[i])
    with torch.no_grad():
        stack.module.fc2.weight[3].zero_()
        models[3].fc2.weight.zero_()
        assert torch.equal(stack(*args, subset=[1, 3]), own_subset(models, [1, 3], args))


def test_weights_replaced_or_given_new_memory_between_calls():
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    warm(stack, *args, subset=[1, 3])
    with torch.no_grad():
        stack(*args, subset=[1, 3])
        new = torch.randn_like(stack.module.fc2.weight)
        stack.module.fc2.weight.data = new.clone()  # same parameter, new memory
        for i, m in enumerate(models):
            m.fc2.weight.copy_(new[i])
        assert torch.equal(stack(*args, subset=[1, 3]), own_subset(models, [1, 3], args))
        newer = torch.randn_like(new)
        stack.module.fc2.weight = nn.Parameter(newer.clone())  # a new parameter
        for i, m in enumerate(models):
            m.fc2.weight.copy_(newer[i])
        assert torch.equal(stack(*args, subset=[1, 3]), own_subset(models, [1, 3], args))
    stack.to(torch.float64)
    models64 = [copy.deepcopy(m).double() for m in models]
    args64 = tuple(a.double() for a in args)
    for grad in (False, True, False):
        with torch.set_grad_enabled(grad):
            got = stack(*args64, subset=[1, 3])
        assert got.dtype == torch.float64
        assert torch.equal(got, own_subset(models64, [1, 3], args64))


def test_settings_modes_and_hooks_changed_between_calls():
    """A plain attribute the trace bakes in (set again), train/eval and hooks added or
    removed, each between calls, are seen on the next call."""
    models, stack = members(Scaled)
    x = torch.randn(30, 8)
    warm(stack, x, subset=[0, 2])

    def check():
        with torch.no_grad():
            assert torch.equal(stack(x, subset=[0, 2]), own_subset(models, [0, 2], (x,)))

    check()
    for m in (stack.module, *models):
        m.scale = 3.0  # set again: retraced
    check()
    stack.eval()
    for m in models:
        m.eval()
    check()
    assert stack.routed_path == "segment"
    seen = []
    handle = stack.module.fc.register_forward_hook(lambda *a: seen.append(1))
    check()
    assert stack.routed_path == "general" and seen  # hooks run once per member
    handle.remove()
    check()
    assert stack.routed_path == "segment"


def test_the_witness_stands_in_for_the_fingerprint(monkeypatch):
    """From the second call on the tree is compared by identity, not fingerprinted again;
    any change (a module replaced) takes the fingerprint and traces afresh."""
    models, stack = members(Critic)
    args = critic_inputs(30, 0)
    warm(stack, *args, subset=[1, 3])
    taken = []
    real = _rowwise._fingerprint
    monkeypatch.setattr(_rowwise, "_fingerprint", lambda m: taken.append(1) or real(m))
    with torch.no_grad():
        stack(*args, subset=[1, 3])
        assert taken == []
        plan = stack.routed_plan
        stack.module.fc3 = copy.deepcopy(stack.module.fc3)  # the same values, a new module
        assert torch.equal(stack(*args, subset=[1, 3]), own_subset(models, [1, 3], args))
    assert taken and stack.routed_plan is not plan


def test_a_list_changed_in_place_between_calls():
    models, stack = members(Shifted)
    x = torch.randn(30, 8)
    warm(stack, x, subset=[0, 2])
    assert stack.routed_plan.witness is None  # a list: every call takes the fingerprint
    for m in (stack.module, *models):
        m.shifts[0] = -1.0  # the same list, its contents changed: retraced
    with torch.no_grad():
        assert torch.equal(stack(x, subset=[0, 2]), own_subset(models, [0, 2], (x,)))


def test_a_stack_on_meta_runs_subsets_for_shapes():
    """A stack moved to ``meta`` traces shapes: its subset calls run the segment path (the
    autocast check asked torch about ``meta``, which raised), with and without a graph."""
    _, stack = members(Critic)
    stack.to("meta")
    args = tuple(a.to("meta") for a in critic_inputs(30, 0))
    for grad in (True, True, False, False):
        with torch.set_grad_enabled(grad):
            out = stack(*args, subset=[1, 3])
        assert out.shape == (2, 30, 1) and out.is_meta
    assert stack.routed_path == "segment"
