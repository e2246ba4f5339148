"""phalanx.distributed: 2 gloo ranks on loopback against one process, member by member.

The reference is the same code in this (plain) process, holding every member. Ranks are
spawned with a file store (no port to pick or clash on) and a collective timeout, and each
launch has a deadline, so a broken test fails instead of hanging. Functions that ranks run
live at module level: spawned ranks import them by name.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.distributed as pdist
from helpers import assert_close
from phalanx.checkpoint._single import CheckpointError
from phalanx.distributed import DistributedError, Shard
from phalanx_tools.bench.sharded import bench_sharded

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
TIMEOUT = 20.0  # seconds a collective waits in these tests


def _member() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(48, 6, generator=g, dtype=F64), torch.randint(0, 3, (48,), generator=g)


def _step(stack, opt, xb, yb, in_dims) -> torch.Tensor:
    out = stack(xb, in_dims=in_dims)
    losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, in_dims))
    opt.zero_grad()
    losses.sum().backward()
    opt.step()
    return losses.detach()


def _train(n: int, save_dir: str | None) -> dict:
    """Adam steps on shared then per-member data; all N members' results, gathered."""
    stack, shard = pdist.shard(_member, num_members=n, seed=0, backend="vmap")
    lrs = torch.linspace(1e-3, 3e-2, n, dtype=F64)  # per-member hyperparameters, global
    opt = phalanx.optim.Adam(stack.parameters(), lr=shard.local(lrs))
    x, y = _data()
    for k in range(3):  # shared minibatches, read by rank 0 and broadcast
        xb, yb = shard.broadcast((x[16 * k : 16 * k + 16], y[16 * k : 16 * k + 16]))
        _step(stack, opt, xb, yb, None)
    for xb, yb in shard.loader(x, y, batch_size=12, seed=5, bootstrap=True):  # per-member
        losses = _step(stack, opt, xb, yb, 0)
    if save_dir is not None:
        pdist.save(save_dir, stack, optimizer=opt)
    with torch.no_grad():
        out = stack(x[:5])  # (n_local, 5, 3)
    first = stack.parameters().__next__()
    return {
        "indices": list(shard.global_indices),
        "weights": shard.gather(dict(stack.state_dict())),  # a pytree of (N, ...) tensors
        "outputs": shard.gather(out),
        "losses": shard.gather(losses),
        "exp_avg": shard.gather(opt.state[first]["exp_avg"]),
        "is_uneven": shard.gather(torch.full((shard.num_local,), shard.num_local)),
    }


def _resume(n: int, load_dir: str) -> dict:
    """Loads a checkpoint into freshly (differently) initialised members and trains on."""
    stack, shard = pdist.shard(_member, num_members=n, seed=1000, backend="vmap")
    opt = phalanx.optim.Adam(stack.parameters(), lr=shard.local(torch.ones(n, dtype=F64)))
    pdist.load(load_dir, stack, optimizer=opt)
    loaded = shard.gather(dict(stack.state_dict()))
    x, y = _data()
    for _ in range(2):
        _step(stack, opt, x[:16], y[:16], None)
    return {"loaded": loaded, "resumed": shard.gather(dict(stack.state_dict()))}


def _ranks_main(tmp: str) -> dict:
    out: dict = {n: (_train(n, f"{tmp}/k2-n{n}"), _resume(n, f"{tmp}/k1-n{n}")) for n in (8, 7)}
    _, shard = pdist.shard(_member, num_members=4)
    try:  # rank 1 passes another trailing shape: every rank must raise, none may hang
        shard.gather(torch.zeros(2, 3 + shard.rank))
    except ValueError as e:
        out["mismatch"] = str(e)
    out["after"] = shard.gather(torch.full((2,), shard.rank))  # the group still works
    return out


def test_two_ranks_train_save_and_load_like_one_process(tmp_path):
    reference = {n: _train(n, f"{tmp_path}/k1-n{n}") for n in (8, 7)}
    resumed = {n: _resume(n, f"{tmp_path}/k1-n{n}") for n in (8, 7)}

    per_rank = pdist.launch(_ranks_main, 2, str(tmp_path), timeout=TIMEOUT)

    for n in (8, 7):
        ref = reference[n]
        members_0, members_1 = (per_rank[r][n][0]["indices"] for r in (0, 1))
        assert (members_0, members_1) == ((list(range(4)), list(range(4, n))))
        for rank in (0, 1):
            trained, from_one = per_rank[rank][n]
            for key in ("weights", "outputs", "losses", "exp_avg"):
                assert_close(trained[key], ref[key], dtype=F64, trajectory=True, msg=f"{key} N={n}")
            # Saved by one process, loaded and trained on by two ranks.
            assert_close(from_one["resumed"], resumed[n]["resumed"], dtype=F64, trajectory=True)
        assert per_rank[0][n][0]["is_uneven"].tolist() == [4] * 4 + [n - 4] * (n - 4)
        # Members differ, so a lost or duplicated shard would show.
        assert not torch.allclose(
            ref["weights"]["module.0.weight"][0], ref["weights"]["module.0.weight"][-1]
        )

        # Saved by two ranks, loaded by this plain process: every member, and the optimizer.
        index = json.loads((tmp_path / f"k2-n{n}" / "index.json").read_text())
        assert [(s["start"], s["stop"]) for s in index["shards"]] == [(0, 4), (4, n)]
        from_two = _resume(n, f"{tmp_path}/k2-n{n}")
        assert_close(from_two["loaded"], ref["weights"], dtype=F64, trajectory=True)
        assert_close(from_two["resumed"], resumed[n]["resumed"], dtype=F64, trajectory=True)

    for rank in (0, 1):
        assert "different dtypes or shapes" in per_rank[rank]["mismatch"]
        assert "rank 1: N=4 over 2 ranks: [('torch.float32', (2, 4))]" in per_rank[rank]["mismatch"]
        assert per_rank[rank]["after"].tolist() == [0, 0, 1, 1]


def _raises_on_rank_1() -> None:
    stack, shard = pdist.shard(_member, num_members=4)
    if shard.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    shard.gather(stack(torch.randn(2, 6, dtype=F64)))  # rank 0 waits here for rank 1


def test_a_rank_that_raises_fails_the_run_quickly():
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank \d failed(.|\n)*fails on purpose"):
        pdist.launch(_raises_on_rank_1, 2, timeout=60.0)
    assert time.monotonic() - start < 30  # well before the 60 s collective timeout


def _hangs_on_rank_1() -> None:
    stack, shard = pdist.shard(_member, num_members=4)
    if shard.rank == 1:
        time.sleep(60)  # alive but not calling the collective
    shard.gather(stack(torch.randn(2, 6, dtype=F64)))


def test_a_rank_that_hangs_fails_the_others_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(
        DistributedError,
        # The rank that hangs is named, not the one that waited for it.
        match=r"gather\(\): rank 0 of 2 waited in the all_gather[a-z ]* until the timeout "
        r"\(3 s(.|\n)*rank 1 \(.*\) did not arrive: it is alive",
    ):
        pdist.launch(_hangs_on_rank_1, 2, timeout=3.0)
    assert time.monotonic() - start < 40


def test_example_under_torchrun_matches_a_plain_process(tmp_path, monkeypatch, capsys):
    script = str(ROOT / "examples" / "distributed_train.py")
    args = ["--members", "5", "--epochs", "1"]
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(script, run_name="__main__")  # this plain process: all 5 members
    plain = capsys.readouterr().out
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    ranks = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *(script, *args, "--checkpoint", str(tmp_path / "ckpt")),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert ranks.returncode == 0, ranks.stderr
    assert "members per rank: [3, 2]" in ranks.stdout
    losses = [line for line in plain.splitlines() if line.startswith("validation")]
    assert losses and losses[0] in ranks.stdout
    ckpt = tmp_path / "ckpt"
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == [
        "gen-000001",
        "gen-000001/members-000000-000003.safetensors",
        "gen-000001/members-000003-000005.safetensors",
        "index.json",
    ]


# ------------------------------------------------------------------ one process, no launch


@pytest.mark.parametrize("n", [1, 2, 5, 7, 8, 13])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_member_range_is_dtensors_shard_0_layout(n, k):
    """Blocks are torch.chunk's, which DTensor's Shard(0) uses: ceil(N/K) members per rank."""
    from torch.distributed.tensor import Shard as DShard

    expected = [DShard.local_shard_size_and_offset(n, k, r) for r in range(k)]
    if any(size == 0 for size, _ in expected):  # N=5 on 4 ranks: 2, 2, 1, 0
        with pytest.raises(ValueError, match=f"{n} members cannot be shared by {k} ranks"):
            Shard(n, 0, k)
        return
    blocks = [Shard(n, r, k).global_indices for r in range(k)]
    assert [(len(b), b.start) for b in blocks] == [tuple(e) for e in expected]
    assert [i for b in blocks for i in b] == list(range(n))


def test_shard_in_a_plain_process_holds_every_member_seeded_by_global_index():
    stack, shard = pdist.shard(lambda i: nn.Linear(3, 2 + 0 * i), num_members=4, seed=7)
    assert (shard.rank, shard.world_size, shard.global_indices) == (0, 1, range(4))
    for i, member in enumerate(stack.unstack()):
        torch.manual_seed(7 + i)
        expected = nn.Linear(3, 2)
        assert torch.equal(member.weight, expected.weight)
    x = torch.randn(4, 5, requires_grad=True)
    gathered = shard.gather(x)
    assert torch.equal(gathered, x) and not gathered.requires_grad
    assert gathered.data_ptr() != x.data_ptr()  # a copy, as with several ranks
    assert shard.broadcast(x) is x
    assert torch.equal(Shard(7, 1, 2).local(torch.arange(7)), torch.arange(4, 7))


def test_shard_leaves_the_callers_random_state_alone():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    pdist.shard(lambda: nn.Linear(2, 2), num_members=3)
    assert torch.equal(torch.rand(3), expected)


def test_shard_of_modules_keeps_this_ranks_block():
    members = [nn.Linear(2, 2) for _ in range(3)]
    stack, _ = pdist.shard(members)
    assert torch.equal(stack.module.weight[2], members[2].weight)


def test_errors_name_what_is_wrong_and_the_fix():
    with pytest.raises(ValueError, match=r"with a factory, pass num_members=N"):
        pdist.shard(lambda: nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"got one Linear; pass a factory"):
        pdist.shard(nn.Linear(2, 2), num_members=2)
    with pytest.raises(ValueError, match=r"num_members=3 but 2 modules were given"):
        pdist.shard([nn.Linear(2, 2), nn.Linear(2, 2)], num_members=3)
    with pytest.raises(ValueError, match=r"global number of members, 7, along dim 0; got \(6,\)"):
        Shard(7, 1, 2).local(torch.zeros(6))
    with pytest.raises(ValueError, match=r"rank 1 holds 3 members .* got \(4, 2\) at"):
        pdist.gather({"a": torch.zeros(4, 2)}, Shard(7, 1, 2))
    with pytest.raises(ValueError, match=r"nprocs must be a positive int; got 0"):
        pdist.launch(print, 0)
    with pytest.raises(TypeError, match=r"pass a module-level function, not a lambda"):
        pdist.launch(lambda: None, 2)
    with pytest.raises(ValueError, match=r"unknown workloads \[.W9.\]; choose from"):
        bench_sharded(["W9"], 2, True, "cpu")
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds"):
        pdist.init(timeout=-1)


def _trained_stack(n: int, seed: int = 0):
    stack, _ = pdist.shard(_member, num_members=n, seed=seed, backend="vmap")
    opt = phalanx.optim.Adam(stack.parameters(), lr=torch.linspace(1e-3, 1e-2, n, dtype=F64))
    x, y = _data()
    _step(stack, opt, x, y, None)
    return stack, opt


def _assert_holds(part, opt, shard: Shard, full, full_opt) -> None:
    """``part`` and ``opt`` hold exactly ``shard``'s rows of the full stack and optimizer."""
    weights = full.state_dict()
    for name, value in part.state_dict().items():
        assert torch.equal(value, shard.local(weights[name])), (shard, name)
    got = opt.state[part.module[0].weight]
    want = full_opt.state[full.module[0].weight]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(got[key], shard.local(want[key])), (shard, key)
    member_lr = full_opt.param_groups[0]["member_lr"]
    assert torch.equal(opt.param_groups[0]["member_lr"], shard.local(member_lr))


def _play_ranks_in_turn(monkeypatch) -> None:
    """Lets this process play the ranks of a save in turn, rank 0 last: the collectives of
    the save become a shared generation and a list that collects every rank's file entry."""
    from phalanx.distributed import _checkpoint

    entries: list = []
    monkeypatch.setattr(_checkpoint, "_preflight", lambda directory, shard, facts, where, rows: 1)
    monkeypatch.setattr(_checkpoint, "_outcome", lambda problem, shard, where: problem)

    def all_entries(entry, shard, where):
        entries.append(entry)
        return sorted(entries, key=lambda e: e["start"]) if shard.rank == 0 else []

    monkeypatch.setattr(_checkpoint, "_all_entries", all_entries)


def test_checkpoint_written_by_3_ranks_loads_on_1_2_and_4(tmp_path, monkeypatch):
    """Resharding, with the ranks played in turn by this process."""
    _play_ranks_in_turn(monkeypatch)
    full, full_opt = _trained_stack(8)
    for rank in (2, 1, 0):  # rank 0 last: it writes the index once every file exists
        shard = Shard(8, rank, 3)
        part = phalanx.stack(full.unstack()[shard.start : shard.stop], backend="vmap")
        opt = phalanx.optim.Adam(part.parameters(), lr=shard.local(torch.ones(8, dtype=F64)))
        opt.load_state_dict(_sliced_state(full_opt.state_dict(), shard))
        pdist.save(tmp_path, part, optimizer=opt, shard=shard)
    assert len(list(tmp_path.glob("gen-000001/members-*.safetensors"))) == 3
    for k in (1, 2, 4):
        for rank in range(k):
            shard = Shard(8, rank, k)
            part, opt = _trained_stack(shard.num_local, seed=99)
            pdist.load(tmp_path, part, optimizer=opt, shard=shard)
            _assert_holds(part, opt, shard, full, full_opt)


def test_a_file_from_phalanx_save_loads_on_any_number_of_ranks(tmp_path):
    full, full_opt = _trained_stack(7)
    phalanx.save(tmp_path / "run.safetensors", full, optimizer=full_opt)
    for k in (1, 2, 3):
        for rank in range(k):
            shard = Shard(7, rank, k)
            part, opt = _trained_stack(shard.num_local, seed=99)
            pdist.load(tmp_path / "run.safetensors", part, optimizer=opt, shard=shard)
            _assert_holds(part, opt, shard, full, full_opt)


def test_torch_optim_state_with_a_0d_step_reshards(tmp_path, monkeypatch):
    _play_ranks_in_turn(monkeypatch)
    full = phalanx.stack([_member() for _ in range(5)], backend="vmap")
    full_opt = torch.optim.Adam(full.parameters(), lr=0.1, foreach=True)
    full(_data()[0]).sum().backward()
    full_opt.step()
    for rank in (1, 0):
        shard = Shard(5, rank, 2)
        part = phalanx.stack(full.unstack()[shard.start : shard.stop], backend="vmap")
        opt = torch.optim.Adam(part.parameters(), lr=0.1, foreach=True)
        opt.load_state_dict(_sliced_state(full_opt.state_dict(), shard))
        pdist.save(tmp_path, part, optimizer=opt, shard=shard)
    stack = phalanx.stack([_member() for _ in range(5)], backend="vmap")
    opt = torch.optim.Adam(stack.parameters(), lr=0.1, foreach=True)
    pdist.load(tmp_path, stack, optimizer=opt)
    got, want = opt.state_dict()["state"], full_opt.state_dict()["state"]
    assert torch.equal(got[0]["step"], want[0]["step"]) and got[0]["step"].dim() == 0
    assert torch.equal(got[0]["exp_avg"], want[0]["exp_avg"])
    assert torch.equal(stack.module[0].weight, full.module[0].weight)


def _sliced_state(state: dict, shard: Shard) -> dict:
    from torch.utils import _pytree as pytree

    def cut(t):
        return shard.local(t) if isinstance(t, torch.Tensor) and t.dim() else t

    return pytree.tree_map(cut, state)


def test_load_errors_name_what_is_wrong_and_the_fix(tmp_path):
    stack, opt = _trained_stack(4)
    with pytest.raises(FileNotFoundError, match=r"index.json does not exist"):
        pdist.load(tmp_path / "nothing", stack)
    safetensors.torch.save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"other.safetensors is not a phalanx checkpoint"):
        pdist.load(tmp_path / "other.safetensors", stack)
    pdist.save(tmp_path, stack)
    with pytest.raises(ValueError, match=r"holds 4 members but this run has 5"):
        pdist.load(tmp_path, stack, shard=Shard(5))
    with pytest.raises(ValueError, match=r"holds no optimizer state"):
        pdist.load(tmp_path, stack, optimizer=opt)
    wider = phalanx.stack([nn.Linear(6, 9).to(F64) for _ in range(4)])
    with pytest.raises(ValueError, match=r"missing from the checkpoint \['module.bias'"):
        pdist.load(tmp_path, wider)
    other = phalanx.stack(
        [nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3)) for _ in range(4)]
    )
    with pytest.raises(
        CheckpointError,
        match=r"'module.0.weight': checkpoint \(4, 8, 6\) torch.float64, stack \(4, 9, 6\) "
        r"torch.float32",
    ):
        pdist.load(tmp_path, other)
    with pytest.raises(ValueError, match=r"the stack holds 4 members but rank 0 of 1 holds 5"):
        pdist.save(tmp_path, stack, shard=Shard(5))


def test_bench_sharded_times_a_workload_on_2_ranks_against_one_process():
    rows = bench_sharded(["W2"], procs=2, quick=True, device="cpu")
    assert [(r["workload"], r["phase"], r["procs"]) for r in rows] == [
        ("W2", "forward", 2),
        ("W2", "train", 2),
    ]
    for r in rows:
        assert r["time_1proc_ms"] > 0 and r["time_kprocs_ms"] > 0
        assert r["ratio"] == pytest.approx(r["time_1proc_ms"] / r["time_kprocs_ms"])
        assert r["same_outputs"] is True
        assert r["threads_1proc"] == torch.get_num_threads()


# ------------------------------------------------- ranks that die or hang, checkpoints that break


def _rank_1_killed_while_saving(tmp: str) -> None:
    import signal

    from phalanx.distributed import _checkpoint

    stack, shard = pdist.shard(_member, num_members=8)
    with torch.no_grad():
        for p in stack.parameters():
            p.fill_(1.0)
    pdist.save(tmp, stack)
    with torch.no_grad():
        for p in stack.parameters():
            p.fill_(2.0)
    if shard.rank == 1:  # dies before its file of the new generation is complete
        monkey = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        _checkpoint.save_atomic = monkey
    pdist.save(tmp, stack)


def test_a_rank_killed_while_saving_is_named_and_the_previous_checkpoint_loads(tmp_path):
    with pytest.raises(
        DistributedError,
        match=r"launch\(\): rank 1 was killed by SIGKILL without raising an exception(.|\n)*"
        r"Ranks \[0\] then failed too \(after rank 1\)",
    ):
        pdist.launch(_rank_1_killed_while_saving, 2, str(tmp_path), timeout=TIMEOUT)
    stack = phalanx.stack([_member() for _ in range(8)])
    pdist.load(tmp_path, stack)
    for name, value in stack.state_dict().items():  # every member from the same, old save
        assert bool((value == 1.0).all()), name


def _rank_1_exits(code: int) -> None:
    stack, shard = pdist.shard(_member, num_members=4)
    if shard.rank == 1:
        os._exit(code)
    shard.gather(stack(torch.randn(2, 6, dtype=F64)))  # rank 0 fails here, second


def test_a_rank_that_exits_hard_is_named_not_the_survivor():
    with pytest.raises(
        DistributedError,
        match=r"rank 1 exited with code 3 without raising an exception \(os._exit, (.|\n)*"
        r"Ranks \[0\] then failed too",
    ):
        pdist.launch(_rank_1_exits, 2, 3, timeout=TIMEOUT)


def _hangs_after_its_last_collective() -> int:
    stack, shard = pdist.shard(_member, num_members=4)
    shard.gather(stack(torch.randn(2, 6, dtype=F64)))
    if shard.rank == 1:
        time.sleep(120)
    return shard.rank


def test_a_rank_that_hangs_after_its_last_collective_is_stopped_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(
        DistributedError,
        match=r"rank 1 had not finished 3 s after rank 0 finished; it was terminated",
    ):
        pdist.launch(_hangs_after_its_last_collective, 2, timeout=3.0)
    assert time.monotonic() - start < 40  # not 3 x timeout + 60 s


def _damage(directory: Path, how: str) -> None:
    index = json.loads((directory / "index.json").read_text())
    shard = directory / index["shards"][0]["file"]
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif how == "flipped":
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "missing":
        shard.unlink()
    else:
        (directory / "index.json").write_text(how)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (
            "truncated",
            r"is damaged: .*members-000000-000008.safetensors has \d+ bytes, the index says",
        ),
        ("flipped", r"is damaged: .*does not match the SHA-256 the index recorded"),
        ("missing", r"is damaged: .*members-000000-000008.safetensors is missing"),
        ("{not json", r"index.json' is corrupt: its metadata is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, r"index.json' is corrupt: its metadata nests too deeply"),
        ("[1, 2]", r"index.json' is corrupt: its metadata is a JSON list, expected an object"),
        (
            '{"format": "phalanx.distributed.checkpoint", "version": 1}',
            r"not a phalanx.distributed checkpoint index of this version",
        ),
    ],
)
def test_a_damaged_sharded_checkpoint_is_refused_and_nothing_changes(tmp_path, how, message):
    pdist.save(tmp_path, phalanx.stack([_member() for _ in range(8)]))
    _damage(tmp_path, how)
    stack = phalanx.stack([_member() for _ in range(8)])
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        pdist.load(tmp_path, stack)
    assert all(torch.equal(v, before[k]) for k, v in stack.state_dict().items())


def test_an_index_naming_files_outside_the_checkpoint_is_refused(tmp_path):
    pdist.save(tmp_path, phalanx.stack([_member() for _ in range(8)]))
    index = json.loads((tmp_path / "index.json").read_text())
    index["shards"][0]["file"] = "../../etc/passwd"
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"is corrupt: shard 0 is not \{file: 'gen-NNNNNN/"):
        pdist.load(tmp_path, phalanx.stack([_member() for _ in range(8)]))


def test_an_optimizer_of_another_type_is_refused_with_both_types_named(tmp_path):
    stack, opt = _trained_stack(4)
    pdist.save(tmp_path, stack, optimizer=opt)
    for other in (phalanx.optim.SGD(stack.parameters()), torch.optim.Adam(stack.parameters())):
        with pytest.raises(
            CheckpointError,
            match=r"holds the state of a phalanx.optim.Adam optimizer, but a "
            r"(phalanx.optim.SGD|torch.optim.Adam) was given",
        ):
            pdist.load(tmp_path, stack, optimizer=other)
