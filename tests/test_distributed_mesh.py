"""Members x data replicas on a 2-D DeviceMesh (issue 19, finding 6).

4 gloo ranks as 2 member shards x 2 data replicas (DDP over the replica group) train like one
process on the whole batch, gather over the member axis, and save one file per member block;
replicas that diverge are refused. DCP over DTensor blocks (finding 7) is tested in
test_distributed_resume.py, inside its 2- and 3-rank runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.distributed as pdist
from helpers import assert_close
from phalanx.checkpoint._single import CheckpointError

F64 = torch.float64
N, STEPS, B = 4, 3, 8


def _member() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def _batches():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, N, B, 6, generator=g, dtype=F64)
    return x, torch.randint(0, 3, (STEPS, N, B), generator=g)


def _train(model, params, x, y, lr) -> None:
    opt = phalanx.optim.SGD(params, lr=lr)
    for k in range(STEPS):
        losses = phalanx.member_losses(
            F.cross_entropy, model(x[k], in_dims=0), y[k], in_dims=(0, 0)
        )
        opt.zero_grad()
        losses.sum().backward()  # members never mix; DDP averages the replicas' halves
        opt.step()


def _members_x_replicas(tmp: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    stack, shard = pdist.shard(_member, num_members=N, seed=0, backend="vmap", replicas=2)
    x, y = _batches()
    half = slice(shard.replica * B // 2, (shard.replica + 1) * B // 2)  # each replica's half
    mine = slice(shard.start, shard.stop)
    ddp = DDP(stack, process_group=shard.replica_group)
    _train(ddp, stack.parameters(), x[:, mine, half], y[:, mine, half], 0.5)
    out = {
        "coords": (shard.rank, shard.world_size, shard.replica, shard.num_replicas),
        "weights": shard.gather(dict(stack.state_dict())),  # over the member axis only
    }
    pdist.save(f"{tmp}/ckpt", stack)
    if shard.rank == 0 and shard.replica == 1:  # this block's replicas now disagree
        with torch.no_grad():
            next(iter(stack.parameters())).add_(1.0)
    try:
        pdist.save(f"{tmp}/ckpt", stack)
    except CheckpointError as e:
        out["diverged"] = str(e)
    return out


def test_two_member_shards_x_two_replicas_train_gather_and_save_like_one_process(tmp_path):
    reference, _ = pdist.shard(_member, num_members=N, seed=0, backend="vmap")
    x, y = _batches()
    # One process, every member on the whole batch: the mean of the two replicas' half-batch
    # gradients is the whole batch's gradient.
    _train(reference, reference.parameters(), x, y, 0.5)
    per_rank = pdist.launch(_members_x_replicas, 4, str(tmp_path), timeout=30.0)
    assert [r["coords"] for r in per_rank] == [
        (0, 2, 0, 2),
        (0, 2, 1, 2),
        (1, 2, 0, 2),
        (1, 2, 1, 2),
    ]
    for r in per_rank:
        assert_close(r["weights"], dict(reference.state_dict()), dtype=F64, trajectory=True)
        assert "data replicas of members 0..1 hold different weights" in r["diverged"]
        assert "ranks grouped by what they hold: [[0], [1]]" in r["diverged"]
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("gen-*/*.safetensors"))
    assert files == ["members-000000-000002.safetensors", "members-000002-000004.safetensors"]
    loaded, _ = pdist.shard(_member, num_members=N, seed=5, backend="vmap")
    pdist.load(tmp_path / "ckpt", loaded)  # the first save, kept whole by the refused one
    assert_close(dict(loaded.state_dict()), per_rank[0]["weights"], dtype=F64)
