"""Saves killed by a real SIGKILL: the previous checkpoint always loads, and litter is tidied.

Kills hit forked children (fast: torch is already imported) at random instants of
``phalanx.save``, and at each step of ``phalanx.distributed.save``'s transaction; ranks of a
real 2-rank gloo group are killed in test_distributed.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx
import phalanx.distributed as pdist
from phalanx.checkpoint import _files
from phalanx.distributed import _checkpoint as dckpt

N = 4

# The lock that savers of run.safetensors take turns on; kept, it is no temporary.
LOCK = ".run.safetensors.lock"


def _stack(value: float, width: int = 8) -> phalanx.Stack:
    stack = phalanx.stack([nn.Linear(width, width) for _ in range(N)], backend="loop")
    with torch.no_grad():
        for p in stack.parameters():
            p.fill_(value)
    return stack


def _value(path: Path, width: int = 8, sharded: bool = False) -> float:
    """The one value every weight of the checkpoint holds (it must be one value)."""
    stack = _stack(-1.0, width)
    (pdist.load if sharded else phalanx.load)(path, stack)
    values = torch.cat([p.detach().flatten() for p in stack.parameters()]).unique()
    assert values.numel() == 1, f"a checkpoint mixing generations: {values.tolist()}"
    return float(values[0])


def _in_child(target, *args) -> None:
    # A forked child must not use the parent's intra-op thread pool: torch.stack hangs there.
    torch.set_num_threads(1)
    target(*args)


def _fork(target, *args) -> mp.Process:
    process = mp.get_context("fork").Process(target=_in_child, args=(target, *args), daemon=True)
    process.start()
    return process


def _save_forever(path: str, ready) -> None:
    stack = _stack(0.0, width=1024)  # 4 members x 4 MiB: a save takes a while
    ready.set()
    k = 0
    while True:
        k += 1
        with torch.no_grad():
            for p in stack.parameters():
                p.fill_(float(k))
        phalanx.save(path, stack, step=k)


def test_sigkill_at_random_instants_of_save_keeps_a_whole_checkpoint_and_litter_is_tidied(
    tmp_path,
) -> None:
    path = tmp_path / "run.safetensors"
    phalanx.save(path, _stack(0.0, width=1024))
    others = [tmp_path / ".other.safetensors.abcdefgh.tmp", tmp_path / ".tmpab12CD"]
    for other in others:  # temporaries that do not belong to this checkpoint
        other.write_bytes(b"not ours")
    rng = random.Random(0)
    litter_seen = 0
    for _ in range(6):
        ready = mp.get_context("fork").Event()
        child = _fork(_save_forever, str(path), ready)
        assert ready.wait(30)
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        litter_seen += len(
            [p for p in tmp_path.iterdir() if p.name.startswith(".run.") and p.name != LOCK]
        )
        value = _value(path, width=1024)  # whole, whichever save it is
        assert value == int(value) >= 0
    assert litter_seen > 0, "no kill landed inside a save: the test did not test anything"
    phalanx.save(path, _stack(7.0, width=1024))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run.safetensors", LOCK, *(o.name for o in others)]
    )
    assert _value(path, width=1024) == 7.0


# --------------------------------------------------- the sharded save's transaction, step by step

STEPS = {
    # where the saving process is killed -> the value the checkpoint then holds
    "while writing its file": ("save_atomic", 1.0),
    "after writing, before the commit": ("_all_entries", 1.0),
    "while committing the index": ("atomic_write_text", 1.0),
    "after the commit, before removing the old generation": ("_remove_superseded", 2.0),
}


def _killed_save(path: str, step: str) -> None:
    name, _ = STEPS[step]
    original = getattr(dckpt, name)

    def die(*args, **kwargs):
        if name in {"save_atomic", "atomic_write_text"}:  # half-way: a partial temporary
            file = Path(args[0] if name == "atomic_write_text" else args[1])
            file.parent.mkdir(parents=True, exist_ok=True)
            (file.parent / f".{file.name}.killed00.tmp").write_bytes(b"half")
        else:
            original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(dckpt, name, die)
    pdist.save(path, _stack(2.0))


@pytest.mark.parametrize("step", list(STEPS))
def test_a_sharded_save_killed_at_any_step_leaves_a_whole_generation(tmp_path, step) -> None:
    pdist.save(tmp_path, _stack(1.0))
    child = _fork(_killed_save, str(tmp_path), step)
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert _value(tmp_path, sharded=True) == STEPS[step][1]
    pdist.save(tmp_path, _stack(3.0))  # the next save tidies everything up
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert files == [
        "gen-000003",
        "gen-000003/members-000000-000004.safetensors",
        "index.json",
    ] or files == [
        "gen-000004",
        "gen-000004/members-000000-000004.safetensors",
        "index.json",
    ]
    assert _value(tmp_path, sharded=True) == 3.0


def test_litter_names_prove_what_they_belong_to(tmp_path) -> None:
    mine = [".run.safetensors.abcdefgh.tmp", ".run.safetensors.0123_xyz.tmp"]
    not_mine = [
        ".run.safetensors.abc.tmp",  # not tempfile's 8 characters
        ".run.safetensors.abcdefgh.tmp.keep",
        ".other.safetensors.abcdefgh.tmp",
        "run.safetensors",
        ".tmpAbC123",  # safetensors' own: says nothing about whose it is
    ]
    for name in mine + not_mine:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".run.safetensors.dirdirdi.tmp").mkdir()
    (tmp_path / ".run.safetensors.dirdirdi.tmp" / ".tmpXYZ123").write_bytes(b"x")
    removed = _files.remove_litter(tmp_path, "run.safetensors")
    assert sorted(removed) == sorted([*mine, ".run.safetensors.dirdirdi.tmp"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(not_mine)


# --------------------------------------------------- concurrent savers and readers, real processes


def _save_many(path: str, value: float, count: int, errors) -> None:
    stack = _stack(value, width=64)
    opt = phalanx.optim.SGD(stack.parameters(), lr=value)
    for _ in range(count):
        try:
            phalanx.save(path, stack, optimizer=opt, value=value)
        except Exception as e:  # reported to the parent, which fails the test
            errors.put(f"{type(e).__name__}: {e}")


def _load_many(path: str, count: int, errors, seen) -> None:
    stack = _stack(-1.0, width=64)
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.5)
    for _ in range(count):
        try:
            extra = phalanx.load(path, stack, optimizer=opt)
        except Exception as e:
            errors.put(f"{type(e).__name__}: {e}")
            continue
        values = torch.cat([p.detach().flatten() for p in stack.parameters()]).unique().tolist()
        lr = opt.param_groups[0]["lr"]
        if (
            values != [extra["value"]] or lr != extra["value"]
        ):  # one file's metadata, another's tensors
            errors.put(f"mixed checkpoint: weights {values}, lr {lr}, extra {extra['value']}")
        seen.put(extra["value"])


def test_two_savers_and_a_reader_of_one_path_each_see_whole_checkpoints(tmp_path) -> None:
    """Two processes save different checkpoints to one path while a third loads it in a loop:
    no save fails (they took turns on the path's lock instead of deleting each other's
    temporaries), and every load is one whole checkpoint (metadata and tensors of one file,
    read from one open)."""
    path = tmp_path / "run.safetensors"
    phalanx.save(path, _stack(1.0, width=64), optimizer=phalanx.optim.SGD(
        _stack(1.0, width=64).parameters(), lr=1.0), value=1.0)  # fmt: skip
    ctx = mp.get_context("fork")
    errors, seen = ctx.Queue(), ctx.Queue()
    children = [
        _fork(_save_many, str(path), 1.0, 150, errors),
        _fork(_save_many, str(path), 2.0, 150, errors),
        _fork(_load_many, str(path), 300, errors, seen),
    ]
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found[:3]
    values = set()
    while not seen.empty():
        values.add(seen.get())
    assert values <= {1.0, 2.0} and values
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "run.safetensors"]


def test_a_load_reads_metadata_and_tensors_from_one_open(tmp_path, monkeypatch) -> None:
    """A save that lands while a load reads must not mix two files: the reader takes header
    and tensors from one open file, which a rename over the path leaves as it was.
    (safetensors' safe_open opens the file again, by name, for each tensor.)"""
    from phalanx.checkpoint import _files

    path = tmp_path / "run.safetensors"
    a, b = _stack(1.0), _stack(2.0)
    phalanx.save(path, a, optimizer=phalanx.optim.SGD(a.parameters(), lr=1.0), value=1.0)
    real = _files._tensor
    landed = []

    def save_lands_mid_read(*args, **kwargs):
        if not landed:  # another process's save lands after the header was read
            landed.append(1)
            phalanx.save(path, b, optimizer=phalanx.optim.SGD(b.parameters(), lr=2.0), value=2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(_files, "_tensor", save_lands_mid_read)
    stack = _stack(-1.0)
    opt = phalanx.optim.SGD(stack.parameters(), lr=0.5)
    extra = phalanx.load(path, stack, optimizer=opt)
    assert landed and extra["value"] == 1.0 and opt.param_groups[0]["lr"] == 1.0
    assert torch.cat([p.detach().flatten() for p in stack.parameters()]).unique().tolist() == [1.0]
