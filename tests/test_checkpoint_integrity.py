"""A checkpoint loads whole and as saved, or raises CheckpointError naming the file.

A single file records the SHA-256 of its metadata and tensors (checked on load, by
``phalanx.load`` and ``phalanx.distributed.load``); files saved before it load as before. A
sharded load that a committing save overtakes reads the new generation.
"""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from torch import nn

import phalanx
import phalanx.distributed as pdist
from phalanx.checkpoint._single import DIGEST
from phalanx.distributed import _sources


def _saved(path, epoch=1):
    torch.manual_seed(0)
    stack = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
    opt = torch.optim.Adam(stack.parameters(), lr=0.1)
    stack(torch.randn(5, 4)).sum().backward()
    opt.step()
    phalanx.save(path, stack, optimizer=opt, epoch=epoch)
    return stack, opt


def _flip(path, where: str) -> None:
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    if where == "metadata":  # a digit of the epoch inside the JSON metadata
        at = data.index(b'"epoch\\": 1', 8) + len(b'"epoch\\": ')
        data[at] ^= 0x01  # 1 -> 0
    else:
        key = next(k for k in header if k != "__metadata__" and where in k)
        start, end = header[key]["data_offsets"]
        data[8 + length + (start + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["module.weight", "module.bias", "optimizer", "metadata"])
def test_one_flipped_bit_anywhere_is_refused_naming_the_file(tmp_path, where):
    path = tmp_path / "run.safetensors"
    _saved(path)
    _flip(path, where)
    other = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
    opt = torch.optim.Adam(other.parameters(), lr=0.1)
    before = other.module.weight.detach().clone()
    with pytest.raises(phalanx.CheckpointError, match=r"run\.safetensors' is corrupt: .*SHA-256"):
        phalanx.load(path, other, optimizer=opt)
    assert torch.equal(other.module.weight, before), "nothing was loaded"
    with pytest.raises(phalanx.CheckpointError, match=r"run\.safetensors is corrupt: .*SHA-256"):
        pdist.load(path, other)


def test_an_intact_file_loads_and_a_file_saved_without_a_checksum_still_loads(tmp_path):
    path = tmp_path / "run.safetensors"
    stack, _ = _saved(path)
    other = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
    assert phalanx.load(path, other)["epoch"] == 1
    assert torch.equal(other.module.weight, stack.module.weight)
    # As phalanx wrote it before checksums: the same file without the digest entry.
    metadata, tensors = {}, safetensors.torch.load_file(path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
    assert DIGEST in metadata
    del metadata[DIGEST]
    old = tmp_path / "old.safetensors"
    safetensors.torch.save_file(tensors, str(old), metadata=metadata)
    fresh = phalanx.stack([nn.Linear(4, 2) for _ in range(3)])
    assert phalanx.load(old, fresh)["epoch"] == 1
    assert torch.equal(fresh.module.weight, stack.module.weight)
    pdist.load(old, fresh)


def _sharded(directory, value: float):
    stack = phalanx.stack([nn.Linear(4, 2) for _ in range(2)])
    with torch.no_grad():
        stack.module.weight.fill_(value)
    pdist.save(directory, stack, step=int(value))
    return stack


def test_a_sharded_load_overtaken_by_a_save_reads_the_new_generation(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    _sharded(directory, 1.0)
    select = _sources.Sharded.select
    overtaken = []

    def save_meanwhile(self, block):
        if not overtaken:  # after this load read the index, a save commits generation 2
            overtaken.append(self.generation)
            _sharded(directory, 2.0)
        return select(self, block)

    monkeypatch.setattr(_sources.Sharded, "select", save_meanwhile)
    into = phalanx.stack([nn.Linear(4, 2) for _ in range(2)])
    extra = pdist.load(directory, into)
    assert overtaken == ["gen-000001"]
    assert extra["step"] == 2
    assert torch.equal(into.module.weight, torch.full_like(into.module.weight, 2.0))


def test_a_sharded_load_overtaken_every_time_raises_checkpoint_error(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    _sharded(directory, 1.0)
    select = _sources.Sharded.select

    def save_meanwhile(self, block):
        _sharded(directory, 3.0)
        return select(self, block)

    monkeypatch.setattr(_sources.Sharded, "select", save_meanwhile)
    into = phalanx.stack([nn.Linear(4, 2) for _ in range(2)])
    before = into.module.weight.detach().clone()
    with pytest.raises(phalanx.CheckpointError, match="replaced by a newer save each of the 5"):
        pdist.load(directory, into)
    assert torch.equal(into.module.weight, before)


@pytest.mark.parametrize("at", ["checksum", "safe_open"])
def test_a_save_at_any_point_of_a_sharded_load_reads_the_new_generation(tmp_path, monkeypatch, at):
    """A save that commits (and removes the generation being read) between the load's looks
    at one file: after its stat and checksum, or before it is opened; never 'damaged'."""
    directory = tmp_path / "ckpt"
    _sharded(directory, 1.0)
    original = getattr(_sources, at)
    overtaken = []

    def save_meanwhile(*args, **kwargs):
        out = original(*args, **kwargs) if at == "checksum" else None
        if not overtaken:
            overtaken.append(at)
            _sharded(directory, 2.0)
        return out if at == "checksum" else original(*args, **kwargs)

    monkeypatch.setattr(_sources, at, save_meanwhile)
    into = phalanx.stack([nn.Linear(4, 2) for _ in range(2)])
    extra = pdist.load(directory, into)
    assert overtaken == [at] and extra["step"] == 2
    assert torch.equal(into.module.weight, torch.full_like(into.module.weight, 2.0))
