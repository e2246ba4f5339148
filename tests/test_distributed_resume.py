"""A sharded checkpoint holds the whole run: resumed on another world size, it continues
exactly like the uninterrupted run (issue 19, finding 2).

The run: per-member learning rates, a per-member schedule (``MemberLambdaLR``), bootstrap
batches from ``shard.loader`` and a step count, stopped in the middle of an epoch. Saved on
2 ranks, resumed on 3 ranks and in this plain process; a single-file ``phalanx.save`` of the
same point resumed on 3 ranks. Every resumed run must end where the uninterrupted one does.
The 2-rank save also writes the members with torch.distributed.checkpoint (DTensor Shard(0)
blocks, finding 7); the 3-rank and plain resumes load them with DCP and must get the same.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import phalanx
import phalanx.distributed as pdist
from helpers import assert_close

N, STEPS, STOP_AT = 7, 11, 5  # 6 batches an epoch: the stop falls inside epoch 0
F64 = torch.float64


def _member() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def _run():
    """This rank's stack, optimizer, scheduler and loader, built as a fresh run builds them."""
    stack, shard = pdist.shard(_member, num_members=N, seed=0, backend="vmap")
    lrs = torch.linspace(1e-3, 3e-2, N, dtype=F64)
    # bit for bit across rank counts is mode="torch"'s promise: the default runs torch's fused
    # kernel on the stacked tensors, whose rounding of a member can depend on its neighbours
    opt = phalanx.optim.Adam(stack.parameters(), lr=shard.local(lrs), mode="torch")
    decay = 1.0 - 0.05 * torch.arange(N, dtype=F64)  # member i decays by its own factor
    sched = phalanx.optim.MemberLambdaLR(opt, lambda epoch: shard.local(decay) ** epoch)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 6, generator=g, dtype=F64), torch.randint(0, 3, (48,), generator=g)
    loader = shard.loader(x, y, batch_size=8, seed=3, bootstrap=True)
    return stack, shard, opt, sched, loader


def _train(stack, opt, sched, loader, step: int, until: int) -> int:
    while step < until:
        for xb, yb in loader:
            out = stack(xb, in_dims=0)
            losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, 0))
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            sched.step()
            step += 1
            if step == until:
                return step
    return step


def _final(stack, shard, opt) -> dict:
    first = next(iter(stack.parameters()))
    return {
        "weights": shard.gather(dict(stack.state_dict())),
        "exp_avg": shard.gather(opt.state[first]["exp_avg"]),
        "member_lr": shard.gather(opt.param_groups[0]["member_lr"]),
    }


def _first_half(path: str) -> None:
    stack, _shard, opt, sched, loader = _run()
    step = _train(stack, opt, sched, loader, 0, STOP_AT)
    pdist.save(path, stack, opt, sched, loader, step=step, note="halfway")
    # The same members through torch.distributed.checkpoint: N = 7 on 2 ranks is 4 + 3.
    dcp.save(pdist.to_dtensors(stack), checkpoint_id=f"{path}-dcp")


def _second_half(path: str, dcp_path: str | None = None, one_file: str | None = None) -> dict:
    stack, shard, opt, sched, loader = _run()
    extra = pdist.load(path, stack, opt, sched, loader)
    same_through_dcp = None
    if dcp_path is not None:  # DTensor's blocks are phalanx's: DCP reshards them (3, 3, 1)
        other, *_ = _run()
        with warnings.catch_warnings():  # DCP says so when it runs in a plain process
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(pdist.to_dtensors(other), checkpoint_id=dcp_path)  # in place
        own = stack.state_dict()
        same_through_dcp = all(torch.equal(v, own[k]) for k, v in other.state_dict().items())
    step = _train(stack, opt, sched, loader, extra["step"], STEPS)
    out = {**_final(stack, shard, opt), "step": step, "note": extra["note"]}
    out["dcp"] = same_through_dcp
    if one_file is not None:  # the same point from phalanx.save's one file, in the same ranks
        out["from one file"] = _second_half(one_file)
    return out


def test_a_run_saved_on_2_ranks_resumes_on_3_and_on_1_exactly_like_the_uninterrupted_run(
    tmp_path,
):
    stack, shard, opt, sched, loader = _run()
    _train(stack, opt, sched, loader, 0, STEPS)
    uninterrupted = _final(stack, shard, opt)
    # The same point saved in one file by one process, as phalanx.save writes it.
    stack, shard, opt, sched, loader = _run()
    step = _train(stack, opt, sched, loader, 0, STOP_AT)
    phalanx.save(tmp_path / "one.safetensors", stack, opt, sched, loader, step=step, note="halfway")

    pdist.launch(_first_half, 2, str(tmp_path / "ckpt"), timeout=30.0)
    ckpt, via_dcp = str(tmp_path / "ckpt"), str(tmp_path / "ckpt-dcp")
    one_file = str(tmp_path / "one.safetensors")
    on_3 = pdist.launch(_second_half, 3, ckpt, via_dcp, one_file, timeout=30.0)
    assert [r["dcp"] for r in on_3] == [True, True, True]
    resumed = {
        "3 ranks from 2": on_3[0],
        "3 ranks from one file": on_3[0]["from one file"],
        "1 process from 2": _second_half(ckpt, via_dcp),
    }
    for how, got in resumed.items():
        assert (got["step"], got["note"]) == (STEPS, "halfway"), how
        assert got["dcp"] in (True, None), how
        for key in ("weights", "exp_avg", "member_lr"):
            # Bit for bit: vmap and phalanx's Adam with per-member rates do not depend on how
            # many members a rank holds (see docs/DISTRIBUTED.md for what does).
            got_leaves, want_leaves = (
                pytree.tree_leaves(got[key]),
                pytree.tree_leaves(uninterrupted[key]),
            )
            assert len(got_leaves) == len(want_leaves), (how, key)
            assert all(torch.equal(a, b) for a, b in zip(got_leaves, want_leaves)), (how, key)


def test_a_resume_without_the_loader_would_replay_the_data(tmp_path):
    """The check above can fail: resuming without the loader's position ends elsewhere."""
    stack, shard, opt, sched, loader = _run()
    _train(stack, opt, sched, loader, 0, STEPS)
    uninterrupted = _final(stack, shard, opt)
    stack, shard, opt, sched, loader = _run()
    _train(stack, opt, sched, loader, 0, STOP_AT)
    pdist.save(tmp_path / "ckpt", stack, opt, sched)
    stack, shard, opt, sched, loader = _run()
    pdist.load(tmp_path / "ckpt", stack, opt, sched)
    _train(stack, opt, sched, loader, STOP_AT, STEPS)
    with pytest.raises(AssertionError):
        assert_close(_final(stack, shard, opt)["weights"], uninterrupted["weights"], dtype=F64)


def test_a_part_that_was_not_saved_or_differs_is_refused_before_anything_changes(tmp_path):
    stack, _shard, opt, sched, loader = _run()
    _train(stack, opt, sched, loader, 0, 2)
    pdist.save(tmp_path / "ckpt", stack, opt, loader=loader, step=2)
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    fresh, _, fresh_opt, fresh_sched, fresh_loader = _run()
    with pytest.raises(phalanx.CheckpointError, match=r"holds no scheduler state; load without"):
        pdist.load(tmp_path / "ckpt", fresh, fresh_opt, fresh_sched, fresh_loader)
    other = phalanx.data.MemberLoader(
        torch.zeros(48, 6), torch.zeros(48), num_members=N, batch_size=4, seed=3
    )
    with pytest.raises(phalanx.CheckpointError, match=r"batch_size is 4 in this loader but 8"):
        pdist.load(tmp_path / "ckpt", fresh, fresh_opt, loader=other)
    assert all(torch.equal(v, before[k]) for k, v in stack.state_dict().items())
    with pytest.raises(TypeError, match=r"phalanx.distributed.save\(\): 'extra.fn' is a builtin"):
        pdist.save(tmp_path / "ckpt", stack, fn=print)
