"""phalanx.data.MemberDataLoader: per-member pipelines on torch's DataLoader, exact and resumable."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset, get_worker_info

import phalanx
from phalanx.data import MemberDataLoader, MemberLoader
from phalanx.testing import assert_equal_to_loop

_g = torch.Generator().manual_seed(0)
X = torch.randn(40, 2, 3, generator=_g)
Y = torch.arange(40)


class Lazy(Dataset):
    """Reads each sample on access (a file-backed data set stands in)."""

    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        return X[i].clone(), int(Y[i])


def crop_flip(item, g):
    """A random shift and flip, drawn from the member's own generator."""
    x, y = item
    x = torch.roll(x, int(torch.randint(-1, 2, (), generator=g)), dims=1)
    if torch.rand((), generator=g) < 0.5:
        x = x.flip(1)
    return x + 0.01 * torch.randn(x.shape, generator=g), y


def _take(loader, k):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == k:
            break
    return out


def test_without_transform_it_gives_member_loader_batches():
    a = MemberDataLoader(TensorDataset(X, Y), num_members=3, batch_size=16, bootstrap=True, seed=4)
    b = MemberLoader(X, Y, num_members=3, batch_size=16, bootstrap=True, seed=4)
    for _ in range(2):  # two epochs, the last batch partial
        got, want = list(a), list(b)
        assert len(got) == len(want) == 3
        for g, w in zip(got, want):
            assert all(torch.equal(s, t) for s, t in zip(g, w))


@pytest.mark.parametrize("sizes", [[8, 8, 8], [4, 8, 16]])
def test_each_members_batches_are_what_a_one_member_loader_with_its_seed_gives(sizes):
    loader = MemberDataLoader(
        Lazy(), num_members=3, batch_size=sizes, transform=crop_flip, seed=1, bootstrap=True
    )
    steps = 2 * len(loader)  # two epochs of the loader: more than two for small batches
    batches = _take(_forever(loader), steps)
    for i, b in enumerate(sizes):
        alone = MemberDataLoader(
            Lazy(), num_members=1, batch_size=[b], transform=crop_flip, seed=1, bootstrap=True,
            first_member=i,
        )  # fmt: skip
        for k, (want, got) in enumerate(zip(_take(_forever(alone), steps), batches)):
            n = int((got[2][i] > 0).sum())
            assert n == int((want[2][0] > 0).sum()), f"member {i} step {k}"
            assert torch.equal(got[0][i, :n], want[0][0, :n]), f"member {i} step {k}"
            assert torch.equal(got[1][i, :n], want[1][0, :n])
            assert torch.equal(got[2][i, :n], torch.full((n,), 1.0 / n))
            assert not got[0][i, n:].any() and not got[2][i, n:].any(), "padding is zero"
    # the members' augmentations differ: each its own stream
    assert not torch.equal(batches[0][0][0, :4], batches[0][0][1, :4])


def _forever(loader):
    while True:
        yield from loader


def test_workers_give_the_batches_of_the_main_process():
    kw = dict(num_members=3, batch_size=[5, 7, 7], transform=crop_flip, seed=2)
    main = list(MemberDataLoader(Lazy(), **kw))
    workers = list(MemberDataLoader(Lazy(), num_workers=2, pin_memory=False, **kw))
    assert len(main) == len(workers) == 8
    for a, b in zip(main, workers):
        assert all(torch.equal(s, t) for s, t in zip(a, b))


def test_resume_mid_epoch_is_bit_exact_also_through_phalanx_save(tmp_path):
    kw = dict(num_members=4, batch_size=[3, 6, 6, 9], transform=crop_flip, seed=5)
    run = MemberDataLoader(Lazy(), **kw)
    it = iter(_forever(run))
    for _ in range(len(run) + 3):  # into the second epoch
        next(it)
    state = copy.deepcopy(run.state_dict())
    stack = phalanx.stack([nn.Linear(3, 2) for _ in range(4)])
    phalanx.save(tmp_path / "run.safetensors", stack, loader=run)
    rest = [next(it) for _ in range(len(run))]
    for restore in ("state_dict", "phalanx.load"):
        resumed = MemberDataLoader(Lazy(), **kw)
        if restore == "state_dict":
            resumed.load_state_dict(state)
        else:
            phalanx.load(tmp_path / "run.safetensors", stack, loader=resumed)
        again = _take(_forever(resumed), len(rest))
        for a, b in zip(rest, again):
            assert all(torch.equal(s, t) for s, t in zip(a, b)), restore
    with pytest.raises(
        ValueError, match=r"batch_sizes is \[3, 6, 6, 9\] in this loader but \[3, 6, 6, 8\]"
    ):
        MemberDataLoader(Lazy(), **kw).load_state_dict({**state, "batch_sizes": [3, 6, 6, 8]})


def test_per_member_batch_sizes_train_each_member_as_alone():
    sizes, steps = [4, 8, 13], 7
    data = TensorDataset(X.flatten(1), Y % 3)
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)) for _ in sizes]
    lrs = [0.1, 0.3, 0.2]

    def alone(i, dtype):
        net = copy.deepcopy(nets[i]).to(dtype)
        opt = torch.optim.SGD(net.parameters(), lr=lrs[i], momentum=0.9)
        loader = MemberDataLoader(data, num_members=1, batch_size=sizes[i], seed=3, first_member=i)
        for xb, yb in _take(_forever(loader), steps):
            loss = F.cross_entropy(net(xb[0].to(dtype)), yb[0])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in net.parameters()])

    stack = phalanx.stack(copy.deepcopy(nets))
    opt = phalanx.optim.SGD(stack.parameters(), lr=lrs, momentum=0.9)
    loader = MemberDataLoader(data, num_members=3, batch_size=sizes, seed=3)
    for xb, yb, w in _take(_forever(loader), steps):
        out = stack(xb, in_dims=0)  # (N, B, 3), B = 13
        per_sample = F.cross_entropy(out.flatten(0, 1), yb.flatten(), reduction="none")
        losses = (per_sample.view(w.shape) * w).sum(1)  # each member's own mean
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
    got = torch.stack(
        [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in stack.unstack()]
    )
    loop32 = torch.stack([alone(i, torch.float32) for i in range(3)])
    loop64 = torch.stack([alone(i, torch.float64) for i in range(3)])
    assert_equal_to_loop(got, loop32, loop64, what="parameters", per_member=True)


class Stream(IterableDataset):
    """A stream that shards itself over the DataLoader's workers (torch's rule)."""

    def __iter__(self):
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(w, len(X), k):
            yield X[i].clone(), int(Y[i])

    def __len__(self):
        return len(X)


def test_a_stream_feeds_every_member_with_its_own_augmentation_and_resumes():
    kw = dict(num_members=3, batch_size=12, transform=crop_flip, seed=6)
    loader = MemberDataLoader(Stream(), **kw)
    batches = list(loader)
    assert [b[0].shape[:2] for b in batches] == [(3, 12)] * 3 + [(3, 4)]
    assert all(torch.equal(b[1][0], b[1][i]) for b in batches for i in range(3)), "one order"
    assert not torch.equal(batches[0][0][0], batches[0][0][1]), "each member its own augmentation"
    # member i is what a one-member loader of stream i gives
    alone = list(
        MemberDataLoader(
            Stream(), num_members=1, batch_size=12, transform=crop_flip, seed=6, first_member=2
        )
    )
    assert all(torch.equal(a[0][0], b[0][2]) for a, b in zip(alone, batches))
    # workers (the stream shards itself) give the same batches
    workers = list(MemberDataLoader(Stream(), num_workers=2, **kw))
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(workers, batches)
    )
    # resume mid-epoch: the stream is re-read to the saved position
    second = list(loader)  # epoch 1: new augmentations, same samples
    assert torch.equal(second[0][1], batches[0][1]) and not torch.equal(second[0][0], batches[0][0])
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = list(it)
    resumed = MemberDataLoader(Stream(), **kw)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(rest) == 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rest, again))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"one positive int per member \(3\); got \[4, 8\]"):
        MemberDataLoader(Lazy(), num_members=3, batch_size=[4, 8])
    with pytest.raises(ValueError, match="per-member batch sizes need a map-style Dataset"):
        MemberDataLoader(Stream(), num_members=2, batch_size=[4, 8])
    with pytest.raises(TypeError, match="sampler= is this loader's own argument"):
        MemberDataLoader(Lazy(), num_members=2, batch_size=4, sampler=None)


class Unsized(IterableDataset):
    """A generator stream without ``__len__``, as most streams are."""

    def __iter__(self):
        for k in range(9):
            yield torch.full((3,), float(k)), k


class DictItems(Dataset):
    """Hugging Face style samples: a dict of a tensor, an int and a string."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "y": i, "name": f"s{i}"}


def test_a_stream_without_len_is_read_as_dataloader_reads_it():
    from torch.utils.data import DataLoader

    want = [b[1] for b in DataLoader(Unsized(), batch_size=4)]
    loader = MemberDataLoader(Unsized(), num_members=2, batch_size=4, seed=0)
    for _ in range(2):  # two epochs, each the whole stream
        got = list(loader)
        assert [b[1].shape for b in got] == [(2, 4), (2, 4), (2, 1)]
        assert all(torch.equal(g[1], torch.stack([w, w])) for g, w in zip(got, want))
    it = iter(loader)
    next(it)
    resumed = MemberDataLoader(Unsized(), num_members=2, batch_size=4, seed=0)
    resumed.load_state_dict(loader.state_dict())
    assert all(torch.equal(a[1], b[1]) for a, b in zip(it, resumed))
    with pytest.raises(TypeError, match="Unsized has no __len__, so the loader has no length"):
        len(loader)


@pytest.mark.parametrize("sizes", [3, [3, 4]])
def test_dict_samples_give_dict_batches_of_each_members_own_samples(sizes):
    from torch.utils.data import default_collate

    loader = MemberDataLoader(DictItems(), num_members=2, batch_size=sizes, seed=0)
    orders = MemberLoader(torch.arange(10), num_members=2, batch_size=1, seed=0).order(0)
    b = next(iter(loader))
    width = 3 if sizes == 3 else 4
    assert set(b) == {"x", "y", "name"} | ({"weights"} if sizes != 3 else set())
    assert b["x"].shape == (2, width, 2) and b["y"].shape == (2, width)
    for i, n in enumerate([3, 3] if sizes == 3 else sizes):
        own = default_collate([DictItems()[int(k)] for k in orders[i, :n]])
        assert torch.equal(b["x"][i, :n], own["x"]) and torch.equal(b["y"][i, :n], own["y"])
        assert b["name"][i] == own["name"]
        assert not b["x"][i, n:].any()  # padding
    if sizes != 3:
        assert b["weights"].sum(1).tolist() == [1.0, 1.0]
