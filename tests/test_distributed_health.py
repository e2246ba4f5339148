"""The failure detector: a rank that dies while the others train without a collective is
named within the deadline, on every survivor, and the last checkpoint stays whole.

Issue 19, finding 5. Real processes (``pdist.launch``: 2 gloo ranks, a file store), a short
deadline (3 s) so the test stays fast, and every wait bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.distributed as pdist
from phalanx.distributed import DistributedError

DEADLINE = 3.0


def _member() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(stack, opt, loader, steps: int) -> None:
    done = 0
    while done < steps:
        for xb, yb in loader:
            out = stack(xb, in_dims=0)
            losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, 0))
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            done += 1
            if done == steps:
                return


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)


def _rank_1_dies_after_a_checkpoint(tmp: str, how: str) -> None:
    stack, shard = pdist.shard(_member, num_members=4, seed=0, backend="loop")
    opt = phalanx.optim.Adam(stack.parameters(), lr=shard.local(torch.full((4,), 0.01)))
    loader = shard.loader(*_data(), batch_size=8, seed=0)
    _train(stack, opt, loader, 5)
    pdist.save(f"{tmp}/ckpt", stack, optimizer=opt)  # the work to keep: 5 steps
    if shard.rank == 1:
        Path(f"{tmp}/died").write_text(str(time.time()))
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("rank 1 fails on purpose")
    start = time.monotonic()
    try:  # rank 0 trains on, no collective in sight, as a sweep between two saves does
        while time.monotonic() - start < 30:
            _train(stack, opt, loader, 1)
            time.sleep(0.01)
    except DistributedError as e:
        died = float(Path(f"{tmp}/died").read_text())
        result = {"message": str(e), "seconds": time.time() - died}
        Path(f"{tmp}/rank0.json").write_text(json.dumps(result))
        raise


@pytest.mark.parametrize("how", ["killed", "raised"])
def test_a_rank_that_dies_between_collectives_is_named_within_the_deadline(tmp_path, how):
    with pytest.raises(DistributedError, match=r"rank 1 (was killed by SIGKILL|failed)"):
        pdist.launch(
            _rank_1_dies_after_a_checkpoint,
            2,
            str(tmp_path),
            how,
            timeout=20.0,
            failure_timeout=DEADLINE,
        )
    survivor = json.loads((tmp_path / "rank0.json").read_text())
    message = survivor["message"]
    assert message.startswith("phalanx.distributed: rank 0 of 2: rank 1 (")
    if how == "killed":
        assert "stopped: its heartbeat has not moved for" in message
        # Silent for the deadline by the watcher's clock; its last beat came up to one
        # interval (0.2 s) before the kill.
        assert DEADLINE - 0.5 <= survivor["seconds"] < DEADLINE + 5, survivor
    else:
        assert "failed: ValueError: rank 1 fails on purpose" in message
        assert survivor["seconds"] < 3, survivor
    assert "The last checkpoint this rank committed" in message and "generation 1" in message
    # The work up to that checkpoint is kept: it loads, and equals 5 steps in one process.
    stack, _ = pdist.shard(_member, num_members=4, seed=0, backend="loop")
    opt = phalanx.optim.Adam(stack.parameters(), lr=torch.full((4,), 0.01))
    _train(stack, opt, phalanx.data.MemberLoader(*_data(), num_members=4, batch_size=8, seed=0), 5)
    resumed, _ = pdist.shard(_member, num_members=4, seed=7, backend="loop")
    pdist.load(tmp_path / "ckpt", resumed)
    for key, value in stack.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def _ranks_of_one_round_with_different_restart_counts(tmp: str) -> bool:
    """torchrun's agents count restarts each for itself: after node 1's worker restarted,
    node 0's is attempt 0 and node 1's attempt 1, in one group. The detector must not take
    that for silence."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pdist.shutdown()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)
    pdist.init(init_method=f"file://{tmp}/store2", rank=rank, world_size=2, failure_timeout=1.0)
    time.sleep(3.0)  # three deadlines without a collective
    _, shard = pdist.shard(_member, num_members=2)
    ok = bool(shard.gather(torch.ones(1)).sum() == 2)
    if rank == 0:
        time.sleep(3.0)  # rank 1 has left cleanly by now: that is no failure either
    return ok


def test_ranks_whose_restart_counts_differ_or_that_finish_early_are_not_reported(tmp_path):
    assert pdist.launch(_ranks_of_one_round_with_different_restart_counts, 2, str(tmp_path)) == [
        True,
        True,
    ]


def _rank_1_hangs_before_a_collective(tmp: str) -> dict:
    _, shard = pdist.shard(_member, num_members=4, seed=0, backend="loop")
    shard.gather(torch.zeros(2))  # both ranks arrive here
    if shard.rank == 1:
        time.sleep(6.0)  # past rank 0's collective timeout, alive, in no phalanx call
        return {"message": "rank 1 slept"}
    try:
        shard.gather(torch.zeros(2))
    except DistributedError as e:
        return {"message": str(e)}
    return {"message": "no error"}


def test_a_rank_that_hangs_is_named_by_the_rank_that_waited_for_it(tmp_path):
    per_rank = pdist.launch(_rank_1_hangs_before_a_collective, 2, str(tmp_path), timeout=3.0)
    message = per_rank[0]["message"]
    assert "rank 0 of 2 waited in the all_gather" in message, message
    found = re.search(
        r"rank 1 \(.*\) did not arrive: it is alive but has made (\d+) phalanx "
        r"collective call\(s\) to this rank's (\d+), the last '(.*)'",
        message,
    )
    assert found is not None, message
    assert int(found[1]) == int(found[2]) - 1, message
    assert "gather" in found[3], message
