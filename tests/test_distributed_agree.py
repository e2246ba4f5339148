"""Ranks that disagree, and directories that are not shared: refused on every rank at once.

Issue 19, findings 1 and 3. Each case runs on 2 real gloo ranks (``pdist.launch``: a file
store, no port, a collective timeout), and each refusal must leave the previous checkpoint
loadable: nothing may be committed and no generation deleted.
"""

from __future__ import annotations

import torch
from torch import nn

import phalanx
import phalanx.distributed as pdist
from phalanx.checkpoint._single import CheckpointError

TIMEOUT = 20.0


def _member(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3))


def _factory() -> nn.Module:
    return _member()


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _disagreeing_ranks(tmp: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict = {}
    # Another N on rank 1 (a config read differently): refused in shard(), not a gloo abort.
    out["n"] = _error(lambda: pdist.shard(_factory, num_members=8 + rank))
    # Another member width on rank 1, given straight to phalanx.stack with a Shard.
    stack, shard = pdist.shard(_factory, num_members=4, seed=0)
    good = f"{tmp}/ckpt"
    pdist.save(good, stack)  # generation 1, which every refusal below must keep
    wide = phalanx.stack([_member(8 + 8 * rank) for _ in range(2)])
    out["width"] = _error(lambda: pdist.save(good, wide, shard=shard))
    # Another optimizer on rank 1.
    opt_type = torch.optim.SGD if rank else torch.optim.Adam
    opt = opt_type(stack.parameters(), lr=0.1)
    stack(torch.randn(2, 6)).sum().backward()
    opt.step()
    out["optimizer"] = _error(lambda: pdist.save(good, stack, optimizer=opt))
    # Another step count on rank 1: an extra that must be the same everywhere.
    out["extra"] = _error(lambda: pdist.save(good, stack, step=10 + rank))
    # Another directory on rank 1, or no shared file system: rank 1 cannot see rank 0's marker.
    out["directory"] = _error(lambda: pdist.save(f"{tmp}/node{rank}", stack))
    # A Shard of another N handed to gather: a ValueError on both ranks, not SIGABRT.
    other = pdist.Shard(4 + 2 * rank, rank, 2)
    out["gather"] = _error(lambda: other.gather(torch.zeros(other.num_local)))
    out["after"] = shard.gather(torch.full((2,), float(rank))).tolist()  # the group still works
    return out


def test_ranks_that_disagree_are_refused_on_every_rank_and_the_previous_checkpoint_kept(tmp_path):
    per_rank = pdist.launch(_disagreeing_ranks, 2, str(tmp_path), timeout=TIMEOUT)
    for rank, out in enumerate(per_rank):
        assert "num_members: 8 on ranks [0]; 9 on ranks [1]" in out["n"], (rank, out["n"])
        assert out["width"].startswith("CheckpointError: phalanx.distributed.save(): the ranks")
        assert (
            "'module.0.weight': (8, 6) float32 on ranks [0]; (16, 6) float32 on ranks [1]"
            in (out["width"])
        )
        assert "nothing was written and the previous checkpoint" in out["width"]
        assert (
            "optimizer type: torch.optim.Adam on ranks [0]; torch.optim.SGD on ranks [1]"
            in out["optimizer"]
        )
        assert "extra state other than per-member tensors (digest): " in out["extra"]
        assert "on ranks [0]; " in out["extra"] and " on ranks [1]" in out["extra"]
        assert "ranks [1] cannot see the file rank 0 just wrote" in out["directory"]
        assert (
            f"rank 1 on {__import__('socket').gethostname()}: {tmp_path}/node1"
            in (out["directory"])
        )
        assert "hold shards of another N" in out["gather"]
        assert "rank 1: N=6 over 2 ranks" in out["gather"]
        assert out["after"] == [0.0, 0.0, 1.0, 1.0]
    # Every refusal kept generation 1, whole: it loads, and nothing else was left behind.
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["gen-000001", "index.json"]
    reference, _ = pdist.shard(_factory, num_members=4, seed=0)
    stack, _ = pdist.shard(_factory, num_members=4, seed=9)
    pdist.load(ckpt, stack)
    for key, value in reference.state_dict().items():
        assert torch.equal(stack.state_dict()[key], value), key
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == []  # marker removed
    assert not (tmp_path / "node1").exists()


def _different_calls(tmp: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    stack, shard = pdist.shard(_factory, num_members=4, seed=0)
    out: dict = {}
    try:
        if rank == 0:
            pdist.save(f"{tmp}/ckpt", stack)
        else:  # rank 1 re-runs shard() with other members while rank 0 saves
            pdist.shard(lambda: _member(16), num_members=4, seed=1)
        out["error"] = "no error"
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["after"] = shard.gather(torch.full((2,), float(rank))).tolist()  # still in step
    return out


def test_ranks_in_different_phalanx_calls_raise_one_error_naming_each_call(tmp_path):
    per_rank = pdist.launch(_different_calls, 2, str(tmp_path), timeout=TIMEOUT)
    for rank, out in enumerate(per_rank):
        error = out["error"]
        assert error.startswith("DistributedError: "), (rank, error)
        assert "the ranks are not making the same phalanx call" in error, (rank, error)
        assert "phalanx.distributed.save(): the save's plan on ranks [0]" in error, (rank, error)
        assert "phalanx.distributed.shard(): the members' description on ranks [1]" in error
        assert out["after"] == [0.0, 0.0, 1.0, 1.0]
