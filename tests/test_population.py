"""phalanx.population: member surgery, PBT and successive halving against uninterrupted runs.

The reference for a copy is the source itself: a cloned member given the same data and
hyperparameters must step bit for bit as its source, and every member not copied into must
follow its uninterrupted trajectory bit for bit. The reference for compaction is the full
stack run on: the kept members' rows must match it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.distributed as pdist
from helpers import assert_close
from phalanx.population import (
    PBT,
    Factors,
    LogUniform,
    SuccessiveHalving,
    copy_members,
    keep_members,
    lineage,
    plot_population,
    rungs,
)
from phalanx_tools.threads import intra_op_threads

F64 = torch.float64
HERE = Path(__file__).resolve().parent
# mode="torch": these tests compare runs bit for bit (kept members against the full run),
# which is that mode's promise; the default's is float rounding (tests/test_optim_modes.py).
OPTIMIZERS = {
    "sgd": lambda ps, lr: phalanx.optim.SGD(
        ps, lr=lr, momentum=0.9, weight_decay=1e-3, mode="torch"
    ),
    "adam": lambda ps, lr: phalanx.optim.Adam(ps, lr=lr, mode="torch"),
    "adamw": lambda ps, lr: phalanx.optim.AdamW(ps, lr=lr, betas=(0.8, 0.99), mode="torch"),
}


def _member(i: int = 0) -> nn.Module:
    torch.manual_seed(i)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(40, 5, generator=g, dtype=dtype), torch.randint(0, 3, (40,), generator=g)


def _run(n: int, optimizer: str = "adam", backend: str = "vmap", dtype=torch.float32):
    """A stack of n members, its optimizer (per-member lr) and per-member loader."""
    stack = phalanx.stack([_member(i).to(dtype) for i in range(n)], backend=backend)
    lrs = torch.linspace(1e-3, 5e-2, n, dtype=F64)
    opt = OPTIMIZERS[optimizer](stack.parameters(), lrs)
    x, y = _data(dtype)
    loader = phalanx.data.MemberLoader(x, y, num_members=n, batch_size=8, seed=3)
    return stack, opt, loader


def _train(stack, opt, loader, steps: int, mask=None) -> torch.Tensor:
    losses = torch.zeros(len(stack))
    batches = iter(())
    for _ in range(steps):
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(loader)
            xb, yb = next(batches)
        out = stack(xb, in_dims=0)
        losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, 0))
        opt.zero_grad()
        losses.sum().backward()
        opt.step(mask=mask)
    return losses.detach()


def _rows(stack, opt, member: int) -> list[torch.Tensor]:
    """Everything member `member` has: weights, buffers, optimizer rows and hyperparameters."""
    tensors = [
        t[member].detach().clone() for t in [*stack.module.parameters(), *stack.module.buffers()]
    ]
    return tensors + opt.member_rows(member)


def _assert_rows_equal(a: list[torch.Tensor], b: list[torch.Tensor], msg: str) -> None:
    assert len(a) == len(b), msg
    for k, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"{msg}: tensor {k} differs by {(u - v).abs().max()}"


# ------------------------------------------------------------------------------------ copy


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("backend", ["vmap", "fused", "loop"])
def test_a_clone_steps_bit_for_bit_as_its_source(optimizer, backend):
    n, source, target = 5, 1, 3
    stack, opt, loader = _run(n, optimizer, backend)
    full, full_opt, full_loader = _run(n, optimizer, backend)
    for s, o, ld in ((stack, opt, loader), (full, full_opt, full_loader)):
        _train(s, o, ld, 3)
        # A masked step makes the step counts differ per member: the copy must carry them.
        _train(s, o, ld, 1, mask=torch.tensor([True, False, True, True, False]))
    copy_members(stack, [source], [target], optimizer=opt, loader=loader)
    _assert_rows_equal(_rows(stack, opt, target), _rows(stack, opt, source), "right after")
    _train(stack, opt, loader, 6)
    _train(full, full_opt, full_loader, 6)  # the same run without the copy

    _assert_rows_equal(_rows(stack, opt, target), _rows(stack, opt, source), "clone vs source")
    for i in range(n):  # everyone else, the source included, is untouched by the copy
        expected = _rows(full, full_opt, source if i == target else i)
        _assert_rows_equal(_rows(stack, opt, i), expected, f"member {i} vs uninterrupted")


def test_copies_read_every_source_before_writing_any_target():
    stack, opt, loader = _run(4, "sgd")
    _train(stack, opt, loader, 2)
    before = [_rows(stack, opt, i) for i in range(4)]
    copy_members(stack, [1, 0], [0, 1], optimizer=opt, loader=loader)  # a swap
    _assert_rows_equal(_rows(stack, opt, 0), before[1], "member 0")
    _assert_rows_equal(_rows(stack, opt, 1), before[0], "member 1")
    assert loader.streams.tolist() == [1, 0, 2, 3]


def test_copy_without_loader_or_hyperparameters_keeps_them():
    stack, opt, loader = _run(4, "sgd")
    _train(stack, opt, loader, 2)
    lrs = opt.hyperparameters()["lr"]
    copy_members(stack, [0], [2], optimizer=opt, hyperparameters=False)
    assert torch.equal(opt.hyperparameters()["lr"], lrs)
    assert torch.equal(stack.module[0].weight[2], stack.module[0].weight[0])
    assert loader.streams.tolist() == [0, 1, 2, 3]


def test_copying_no_members_changes_nothing():
    stack, opt, loader = _run(3, "sgd")
    before = [_rows(stack, opt, i) for i in range(3)]
    copy_members(stack, [], [], optimizer=opt, loader=loader)
    opt.set_hyperparameters([], lr=0.5)
    for i in range(3):
        _assert_rows_equal(_rows(stack, opt, i), before[i], f"member {i}")


def test_copy_revives_a_frozen_member():
    stack, opt, _ = _run(3, "sgd")
    opt.frozen[2], opt.bad_steps[2] = True, 4
    copy_members(stack, [0], [2], optimizer=opt)
    assert opt.frozen.tolist() == [False, False, False] and opt.bad_steps.tolist() == [0, 0, 0]


def test_surgery_errors_name_what_is_wrong():
    stack, opt, _ = _run(4, "adam")
    with pytest.raises(ValueError, match=r"copy_members\(\): 2 source members but 1 target"):
        copy_members(stack, [0, 1], [2], optimizer=opt)
    with pytest.raises(ValueError, match=r"target members \[2, 2\] list a member more than once"):
        copy_members(stack, [0, 1], [2, 2])
    with pytest.raises(IndexError, match=r"target members \[7\] out of range; .* 4 members"):
        copy_members(stack, [0], [7])
    with pytest.raises(ValueError, match=r"the optimizer holds 3 members but the stack 4"):
        copy_members(stack, [0], [1], optimizer=_run(3)[1])
    with pytest.raises(TypeError, match=r"must be a phalanx optimizer .* got torch.optim.sgd.SGD"):
        copy_members(stack, [0], [1], optimizer=torch.optim.SGD(stack.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"keep_members\(\): members must list .* got \[1, 1\]"):
        keep_members(stack, [1, 1], optimizer=opt)
    wrong = phalanx.optim.Adam([nn.Parameter(torch.zeros(4, 2))])
    with pytest.raises(
        ValueError, match=r"optimizer parameters \[0\] \(of 1\) are not parameters of this stack"
    ):
        keep_members(stack, [0, 1], optimizer=wrong)


# ------------------------------------------------------------------------------ compaction


def _train_shared(stack, opt, loader, steps: int) -> None:
    """Steps on one fixed batch that every member sees (the fused backend's shared GEMM)."""
    x, y = loader.tensors
    for _ in range(steps):
        losses = phalanx.member_losses(F.cross_entropy, stack(x[:8]), y[:8])
        opt.zero_grad()
        losses.sum().backward()
        opt.step()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("backend", ["vmap", "fused"])
@pytest.mark.parametrize("inputs", ["per_member", "shared"])
def test_kept_members_continue_bit_for_bit(optimizer, backend, inputs):
    n, keep = 6, [4, 1, 2]  # out of order on purpose
    train = _train if inputs == "per_member" else _train_shared
    stack, opt, loader = _run(n, optimizer, backend)
    full, full_opt, full_loader = _run(n, optimizer, backend)
    for s, o, ld in ((stack, opt, loader), (full, full_opt, full_loader)):
        train(s, o, ld, 3)
    small = keep_members(stack, keep, optimizer=opt, loader=loader)
    assert len(small) == 3 and opt.num_members == 3 and loader.num_members == 3
    assert loader.streams.tolist() == keep
    train(small, opt, loader, 5)
    train(full, full_opt, full_loader, 5)
    for j, i in enumerate(keep):
        # The batched kernels now run over 3 members instead of 6; each member's rows are
        # computed as before, so the kept members follow the full run bit for bit.
        _assert_rows_equal(_rows(small, opt, j), _rows(full, full_opt, i), f"kept {j} (was {i})")


def test_keep_members_keeps_modes_and_a_scheduler_working():
    stack, opt, loader = _run(4, "sgd")
    stack.eval()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(stack, opt, loader, 1)
    scheduler.step()
    small = keep_members(stack, [3, 0], optimizer=opt, loader=loader)
    assert not small.training and not small.module[0].training
    _train(small, opt, loader, 1)
    scheduler.step()  # the same optimizer object: the scheduler never noticed
    group = opt.param_groups[0]  # lr: the largest member's rate; / lr_reference: the factor
    assert group["lr"] / group["lr_reference"] == pytest.approx(0.25)


# ------------------------------------------------------------------------------------- PBT


def _pbt(n=8, seed=0, **kwargs):
    stack, opt, loader = _run(n, "sgd", dtype=F64)
    mutations = {"lr": LogUniform(1e-4, 1.0), "momentum": [0.0, 0.5, 0.9, 0.99]}
    kwargs.setdefault("mode", "max")
    pbt = PBT(stack, opt, mutations, interval=2, loader=loader, seed=seed, **kwargs)
    return stack, opt, loader, pbt


def test_pbt_replaces_the_bottom_quantile_by_mutated_copies_of_the_top():
    stack, opt, loader, pbt = _pbt(resample_probability=0.0)
    _train(stack, opt, loader, 2)
    before = [_rows(stack, opt, i) for i in range(8)]
    hypers = opt.hyperparameters()
    metric = torch.tensor([0.5, 0.9, float("nan"), 0.1, 0.8, 0.3, 0.6, 0.7])
    assert not pbt.ready(1) and pbt.ready(2)
    events = pbt.exploit(metric, step=2)
    assert not pbt.ready(2)
    assert [e["member"] for e in events] == [2, 3]  # NaN ranks last; 8 * 0.25 = 2 members
    lr, momentum = opt.hyperparameters()["lr"], opt.hyperparameters()["momentum"]
    for e in events:
        j, i = e["member"], e["source"]
        assert i in (1, 4)  # the top quantile
        weights = len(list(stack.module.parameters()))
        _assert_rows_equal(_rows(stack, opt, j)[:weights], before[i][:weights], f"weights {j}")
        ratio = float(lr[j] / hypers["lr"][i])
        assert ratio == pytest.approx(1.2) or ratio == pytest.approx(0.8)
        neighbours = {0.5: {0.0, 0.9}, 0.9: {0.5, 0.99}}[float(hypers["momentum"][i])]
        assert float(momentum[j]) in neighbours
        assert e["hyperparameters"] == {"lr": float(lr[j]), "momentum": float(momentum[j])}
    for i in (0, 1, 4, 5, 6, 7):  # everyone else untouched
        _assert_rows_equal(_rows(stack, opt, i), before[i], f"member {i}")
    assert pbt.history[-1]["step"] == 2 and len(pbt.history) == 2


def test_pbt_mutations_factors_and_min_mode():
    stack, opt, _ = _run(4, "sgd")
    pbt = PBT(stack, opt, {"weight_decay": Factors(0.5, 2.0)}, interval=1, mode="min")
    wd = opt.hyperparameters()["weight_decay"]
    (event,) = pbt.exploit(torch.tensor([3.0, 1.0, 2.0, 0.5]), step=1)  # a loss: 0 is worst
    assert (event["member"], event["source"]) == (0, 3)
    assert event["hyperparameters"]["weight_decay"] in (float(wd[3]) * 0.5, float(wd[3]) * 2.0)


def test_pbt_errors_name_what_is_wrong():
    stack, opt, _ = _run(4, "adam")
    with pytest.raises(ValueError, match=r"no per-member number hyperparameter 'momentum'.*eps"):
        PBT(stack, opt, {"momentum": [0.9]}, interval=5, mode="max")
    with pytest.raises(ValueError, match=r"mutation of 'lr' is \[\]; give a non-empty list"):
        PBT(stack, opt, {"lr": []}, interval=5, mode="max")
    with pytest.raises(ValueError, match=r"mutation of 'lr' .* 0 < lo < hi"):
        PBT(stack, opt, {"lr": LogUniform(0.0, 1.0)}, interval=5, mode="max")
    with pytest.raises(ValueError, match=r"interval must be a positive int"):
        PBT(stack, opt, {"lr": Factors(2.0)}, interval=0, mode="max")
    with pytest.raises(ValueError, match=r"quantile must be in \(0, 0.5\]"):
        PBT(stack, opt, {"lr": Factors(2.0)}, interval=1, quantile=0.7, mode="max")
    pbt = PBT(stack, opt, {"lr": Factors(2.0)}, interval=1, mode="max")
    with pytest.raises(ValueError, match=r"exploit\(\): metric must hold one value per member"):
        pbt.exploit(torch.zeros(3), step=1)


def _pbt_job(path: str, steps: int, resume: bool, hold_at: int | None) -> None:
    """A PBT run that saves at every exploit; the test SIGKILLs it or resumes it.

    With `hold_at`, it writes `path + ".ready"` after the checkpoint of that step and keeps
    training slowly until killed.
    """
    with intra_op_threads(1):
        stack, opt, loader, pbt = _pbt(n=8, seed=11, copy_data=True)
        x_val, y_val = _data(F64)
        start = 0
        if resume:
            start = int(pbt.load(path)["step"])
        batches = iter(loader)
        for step in range(start + 1, steps + 1):
            try:
                xb, yb = next(batches)
            except StopIteration:
                batches = iter(loader)
                xb, yb = next(batches)
            losses = phalanx.member_losses(
                F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0)
            )
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            if pbt.ready(step):
                with torch.no_grad():
                    accuracy = phalanx.metrics.accuracy(stack(x_val[:20]), y_val[:20])
                pbt.exploit(accuracy, step=step)
                pbt.save(path, step=step)
                if step == hold_at:
                    Path(path + ".ready").write_text("saved")
                    while True:  # mid-population, until the test kills this process
                        time.sleep(0.05)


def test_pbt_resumes_exactly_after_a_sigkill(tmp_path):
    steps, killed_path, reference_path = (
        12,
        str(tmp_path / "pbt.safetensors"),
        str(tmp_path / "ref.safetensors"),
    )
    code = (
        f"import sys; sys.path[:0] = [{str(HERE)!r}]; import test_population as t; "
        f"t._pbt_job({killed_path!r}, {steps}, False, 6)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        deadline = time.monotonic() + 120
        while not Path(killed_path + ".ready").exists():
            assert child.poll() is None, "the child died before its checkpoint"
            assert time.monotonic() < deadline, "the child never reached its checkpoint"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    _pbt_job(killed_path, steps, resume=True, hold_at=None)  # resumed here, from step 6
    _pbt_job(reference_path, steps, resume=False, hold_at=None)  # never interrupted

    resumed, reference = (_pbt(n=8, seed=11, copy_data=True) for _ in range(2))
    extra = resumed[3].load(killed_path)
    reference[3].load(reference_path)
    assert extra["step"] == steps
    assert resumed[3].log == reference[3].log and len(reference[3].log) == 12  # 6 rounds x 2
    assert resumed[3].history == reference[3].history
    for i in range(8):
        _assert_rows_equal(
            _rows(resumed[0], resumed[1], i), _rows(reference[0], reference[1], i), f"member {i}"
        )
    assert torch.equal(resumed[2].streams, reference[2].streams)


# ---------------------------------------------------------------------- successive halving


def test_rungs_follow_asha():
    assert rungs(10, 2, 100) == [10, 20, 40, 80]
    assert rungs(5, 3, 50) == [5, 15, 45]


def test_successive_halving_keeps_the_best_and_resumes(tmp_path):
    stack, opt, loader = _run(8, "adam", dtype=F64)
    halving = SuccessiveHalving(stack, opt, [2, 4], loader=loader, mode="max")
    _train(stack, opt, loader, 2)
    metric = torch.tensor([0.1, 0.8, 0.3, float("nan"), 0.9, 0.2, 0.7, 0.6])
    small = halving.stop(metric, step=2)
    assert halving.members == [1, 4, 6, 7] and len(small) == 4 and halving.stack is small
    assert halving.log[0]["stopped"] == [0, 2, 3, 5]
    halving.save(str(tmp_path / "sh.safetensors"), note="x")
    _train(small, opt, loader, 2)
    halving.stop(torch.tensor([0.5, 0.4, 0.9, 0.1]), step=4)
    assert halving.members == [1, 6]

    fresh, fresh_opt, fresh_loader = _run(8, "adam", dtype=F64)
    resumed = SuccessiveHalving(fresh, fresh_opt, [2, 4], loader=fresh_loader, mode="max")
    assert resumed.load(str(tmp_path / "sh.safetensors")) == {"note": "x"}
    assert resumed.members == [1, 4, 6, 7] and not resumed.ready(2) and resumed.ready(4)
    _train(resumed.stack, fresh_opt, fresh_loader, 2)
    resumed.stop(torch.tensor([0.5, 0.4, 0.9, 0.1]), step=4)
    assert resumed.members == [1, 6]
    for j in range(2):
        _assert_rows_equal(
            _rows(resumed.stack, fresh_opt, j), _rows(halving.stack, opt, j), f"member {j}"
        )


def test_successive_halving_load_of_a_damaged_file_is_one_clear_error_changing_nothing(tmp_path):
    stack, opt, loader = _run(4, "adam", dtype=F64)
    halving = SuccessiveHalving(stack, opt, [2], loader=loader, mode="max")
    path = tmp_path / "sh.safetensors"
    halving.save(str(path))
    path.write_bytes(path.read_bytes()[:100])  # truncated
    before = [p.detach().clone() for p in stack.parameters()]
    with pytest.raises(phalanx.CheckpointError, match=r"SuccessiveHalving.load\(\): .* truncated"):
        halving.load(str(path))
    assert halving.stack is stack and halving.members == [0, 1, 2, 3]
    assert all(torch.equal(p, q) for p, q in zip(stack.parameters(), before, strict=True))


# ----------------------------------------------------------------------------------- plots


def test_plot_population_draws_schedules_and_exploits(tmp_path):
    stack, opt, loader, pbt = _pbt()
    for step in (2, 4):
        _train(stack, opt, loader, 2)
        pbt.exploit(torch.linspace(0, 1, 8), step=step)
    fig = plot_population(pbt.history, pbt.log, path=str(tmp_path / "pbt.png"))
    lr_axis, momentum_axis, metric_axis = fig.axes
    assert lr_axis.get_ylabel() == "lr" and momentum_axis.get_ylabel() == "momentum"
    assert len(lr_axis.lines) == 8 + 1  # one schedule per member, and the best's lineage
    assert len(metric_axis.lines) == 8 + 1 + len(pbt.log)  # and one segment per exploit
    best = 7  # the largest metric at the last round
    line = lineage(pbt.log, best)
    drawn = lr_axis.lines[8].get_ydata()
    for k, h in enumerate(pbt.history):  # the slot that held the lineage from that step on
        owner = [slot for start, slot in line if start <= h["step"]][-1]
        assert drawn[k] == h["hyperparameters"]["lr"][owner]
    assert (tmp_path / "pbt.png").stat().st_size > 0


# ----------------------------------------------------------------------------- two ranks


def _sharded_run(n: int, backend: str) -> tuple:
    """This rank's stack, shard, Adam (per-member lr), loader and the data, in float64."""
    stack, shard = pdist.shard(
        lambda i: _member(i).to(F64), num_members=n, seed=None, backend=backend
    )
    opt = phalanx.optim.Adam(
        stack.parameters(), lr=shard.local(torch.linspace(1e-3, 5e-2, n, dtype=F64))
    )
    x, y = _data(F64)
    return stack, shard, opt, shard.loader(x, y, batch_size=8, seed=3), x, y


def _sharded(n: int, seed: int) -> dict:
    """Adam on per-member data, a cross-rank copy, then PBT rounds; results gathered."""
    stack, shard, opt, loader, x, y = _sharded_run(n, "vmap")
    _train(stack, opt, loader, 3)
    # Sources on both ranks, targets on both, and target 0 is also a source: a rotation.
    copy_members(stack, [5, 0, 1], [0, 4, 2], optimizer=opt, loader=loader, shard=shard)
    _train(stack, opt, loader, 2)
    pbt = PBT(
        stack,
        opt,
        {"lr": LogUniform(1e-4, 1.0)},
        interval=2,
        loader=loader,
        copy_data=True,
        seed=seed,
        shard=shard,
        mode="max",
    )
    for step in (2, 4):
        _train(stack, opt, loader, 2)
        with torch.no_grad():
            accuracy = phalanx.metrics.accuracy(stack(x[:20]), y[:20])
        pbt.exploit(accuracy, step=step)
    _train(stack, opt, loader, 2)
    p = next(stack.parameters())
    return {
        "weights": shard.gather(dict(stack.state_dict())),
        "exp_avg": shard.gather(opt.state[p]["exp_avg"]),
        "step": shard.gather(opt.state[p]["step"]),
        "lr": shard.gather(opt.hyperparameters()["lr"]),
        "streams": shard.gather(loader.streams),
        "log": pbt.log,
    }


def test_exploits_across_two_ranks_match_one_process():
    reference = _sharded(6, 5)
    per_rank = pdist.launch(_sharded, 2, 6, 5, timeout=30.0)
    assert reference["log"] and any(e["member"] // 3 != e["source"] // 3 for e in reference["log"])
    for rank in (0, 1):
        got = per_rank[rank]
        assert got["log"] == reference["log"]
        for key in ("weights", "exp_avg", "step", "lr", "streams"):
            assert_close(
                got[key], reference[key], dtype=F64, trajectory=True, msg=f"rank {rank} {key}"
            )


def test_lineage_follows_the_log_back():
    log = [
        {"step": 2, "member": 5, "source": 1},
        {"step": 4, "member": 1, "source": 3},
        {"step": 6, "member": 0, "source": 5},
        {"step": 6, "member": 7, "source": 2},
    ]
    # 0's weights: copied from 5 at step 6; 5's from 1 at step 2 (1 was overwritten later,
    # at step 4, which is after the copy and so not in 0's past).
    assert lineage(log, 0) == [(0, 1), (2, 5), (6, 0)]
    assert lineage(log, 3) == [(0, 3)]


# ------------------------------------------------------------------------------------ demo


def test_demo_pbt_compares_the_three_at_equal_compute(capsys, tmp_path):
    from phalanx_tools.cli import main

    plot = tmp_path / "pbt.png"
    argv = ["demo", "--pbt", "--members", "8", "--seeds", "2", "--epochs", "1", "--hidden", "16"]
    argv += ["--pbt-interval", "1", "--threads", "1"]
    assert main([*argv, "--pbt-plot", str(plot)]) == 0
    out = capsys.readouterr().out
    steps = 1078 // 32  # one epoch of full batches of the training split
    budget = 8 * steps
    for name in ("grid \\(fixed lr\\)", "PBT", "successive halving, equal compute"):
        row = re.search(rf"\n  {name} +([0-9.]+) +([0-9.]+) +[0-9.e+-]+ +(\d+) ", out)
        assert row, f"no row for {name}: {out}"
        assert int(row[3]) == budget and 0.1 < float(row[1]) <= 1 and 0.1 < float(row[2]) <= 1
    assert re.search(r"stopped at the grid's steps .* (\d+) ", out)
    assert re.search(
        r"One PBT exploit \(2 of 8 members copied.*\n +[0-9.]+ ms \(median of 1\)", out
    )
    assert re.search(
        r"torch\.save \+ torch\.load.*\n +in memory [0-9.]+ ms, x 2 members.*\n +through a file",
        out,
    ), out
    assert re.search(r"8 members: +\d+ steps, +[0-9.]+ ms/step", out), out
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_buffers_follow_copies_and_compaction():
    members = []
    for i in range(4):
        torch.manual_seed(i)
        members.append(nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)))
    stack = phalanx.stack(members, backend="vmap")
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    loader = phalanx.data.MemberLoader(x, y, num_members=4, batch_size=8, seed=1)
    _train(stack, opt, loader, 3)  # train mode: running statistics move, per member
    running_mean = stack.module[1].running_mean
    assert not torch.equal(running_mean[0], running_mean[2])
    copy_members(stack, [0], [2], optimizer=opt, loader=loader)
    assert torch.equal(running_mean[2], running_mean[0])
    assert stack.module[1].num_batches_tracked.tolist() == [3, 3, 3, 3]
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    small = keep_members(stack, [3, 2], optimizer=opt, loader=loader)
    for key, value in small.state_dict().items():
        assert torch.equal(value, before[key][[3, 2]]), key
    _train(small, opt, loader, 2)  # and it trains on
    assert small.module[1].num_batches_tracked.tolist() == [5, 5]


def test_mutations_resample_perturb_and_stay_in_range():
    from phalanx.population._mutations import mutate

    g = torch.Generator().manual_seed(0)
    bounded = LogUniform(1e-3, 1e-1)
    perturbed = {
        mutate(0.09, bounded, resample_probability=0.0, factors=(1.2, 0.8), generator=g)
        for _ in range(40)
    }
    assert perturbed == {0.1, 0.09 * 0.8}  # 0.108 is clamped to the range's top
    drawn = [
        mutate(0.09, bounded, resample_probability=1.0, factors=(1.2,), generator=g)
        for _ in range(40)
    ]
    assert all(1e-3 <= v <= 1e-1 for v in drawn) and len(set(drawn)) == 40
    options = [1, 2, 3]
    moved = {
        mutate(3, options, resample_probability=0.0, factors=(), generator=g) for _ in range(40)
    }
    assert moved == {2, 3}  # a neighbour, clamped at the list's end
    assert {
        mutate(7, options, resample_probability=0.0, factors=(), generator=g) for _ in range(40)
    } <= set(options)
    assert {
        mutate(1.0, Factors(0.5, 4.0), resample_probability=1.0, factors=(), generator=g)
        for _ in range(40)
    } == {0.5, 4.0}


def test_successive_halving_errors_name_what_is_wrong(tmp_path):
    stack, opt, loader = _run(4, "sgd")
    with pytest.raises(
        ValueError, match=r"milestones must be increasing positive steps; got \[4, 2\]"
    ):
        SuccessiveHalving(stack, opt, [4, 2], mode="max")
    with pytest.raises(ValueError, match=r"reduction_factor must be > 1; got 1"):
        SuccessiveHalving(stack, opt, [2], reduction_factor=1, mode="max")
    halving = SuccessiveHalving(stack, opt, [2], loader=loader, mode="max")
    with pytest.raises(
        ValueError, match=r"stop\(\): metric must hold one value per current member, shape \(4,\)"
    ):
        halving.stop(torch.zeros(5), step=2)
    phalanx.save(tmp_path / "plain.safetensors", stack, optimizer=opt)
    with pytest.raises(
        ValueError, match=r"holds no successive halving state; write it with SuccessiveHalving.save"
    ):
        halving.load(str(tmp_path / "plain.safetensors"))


def _sharded_pbt_run(n: int, path: str | None, resume: bool) -> dict:
    """PBT over the ranks for 4 rounds; with ``path``, saved after round 2 (or, ``resume``,
    loaded there from ``path`` instead of running the first two rounds)."""
    stack, shard, opt, loader, x, y = _sharded_run(n, "loop")
    pbt = PBT(stack, opt, {"lr": LogUniform(1e-4, 1.0)}, interval=2, loader=loader,
              copy_data=True, seed=11, shard=shard, mode="max")  # fmt: skip
    first = 3
    if resume:
        assert path is not None
        extra = pbt.load(path)
        first = int(extra["round"]) + 1
    for step in range(first, 5) if resume else range(1, 5):
        _train(stack, opt, loader, 2)
        with torch.no_grad():
            accuracy = phalanx.metrics.accuracy(stack(x[:20]), y[:20])
        pbt.exploit(accuracy, step=2 * step)
        if path is not None and not resume and step == 2:
            pbt.save(path, round=step)
    return {"weights": shard.gather(dict(stack.state_dict())), "log": pbt.log}


def test_a_sharded_pbt_run_saves_its_driver_and_resumes_exactly(tmp_path):
    path = str(tmp_path / "pbt")
    whole = pdist.launch(_sharded_pbt_run, 2, 6, None, False, timeout=60.0)[0]
    pdist.launch(_sharded_pbt_run, 2, 6, path, False, timeout=60.0)
    resumed = pdist.launch(_sharded_pbt_run, 2, 6, path, True, timeout=60.0)
    for rank in (0, 1):
        assert resumed[rank]["log"] == whole["log"]
        for k, v in whole["weights"].items():
            assert torch.equal(resumed[rank]["weights"][k], v), k
