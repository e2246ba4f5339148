"""MemberLoader: per-member orders and bootstrap resamples, deterministic and resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from phalanx.data import MemberLoader


def indices_seen(loader: MemberLoader) -> torch.Tensor:
    """(N, samples per epoch): the sample indices each member got, in order, for one epoch."""
    return torch.cat([batch[0] for batch in loader], dim=1)


def make(n: int = 10, **kwargs) -> MemberLoader:
    kwargs = {"num_members": 4, "batch_size": 3, "seed": 0, **kwargs}
    return MemberLoader(torch.arange(n), **kwargs)


def test_batches_have_member_axis_and_len() -> None:
    X, Y = torch.randn(10, 3, 2), torch.arange(10)
    loader = MemberLoader(X, Y, num_members=4, batch_size=3, seed=0)
    batches = list(loader)
    assert len(loader) == len(batches) == 4
    assert [b[0].shape for b in batches] == [(4, 3, 3, 2)] * 3 + [(4, 1, 3, 2)]
    assert [b[1].shape for b in batches] == [(4, 3)] * 3 + [(4, 1)]
    for xb, yb in batches:  # inputs and targets stay paired
        assert torch.equal(xb, X[yb])
    dropped = MemberLoader(X, Y, num_members=4, batch_size=3, drop_last=True, seed=0)
    assert len(dropped) == 3 and [b[0].shape[1] for b in dropped] == [3, 3, 3]


def test_each_member_sees_every_sample_once_in_its_own_order() -> None:
    loader = make(n=50, num_members=6, batch_size=7)
    first = indices_seen(loader)
    assert torch.equal(first.sort(dim=1).values, torch.arange(50).expand(6, 50))
    assert len({tuple(row.tolist()) for row in first}) == 6  # six different orders
    second = indices_seen(loader)
    assert torch.equal(second.sort(dim=1).values, torch.arange(50).expand(6, 50))
    assert not torch.equal(first, second)  # a fresh order each epoch
    assert loader.epoch == 2


def test_no_shuffle_walks_the_data_in_order() -> None:
    assert torch.equal(indices_seen(make(shuffle=False)), torch.arange(10).expand(4, 10))


def test_bootstrap_is_one_resample_per_member_kept_across_epochs() -> None:
    loader = make(n=1000, num_members=5, batch_size=100, bootstrap=True)
    first, second = indices_seen(loader), indices_seen(loader)
    assert first.shape == (5, 1000)
    # the same multiset each epoch, in a new order
    assert torch.equal(first.sort(dim=1).values, second.sort(dim=1).values)
    assert not torch.equal(first, second)
    # with replacement: about 1 - 1/e of the samples appear
    unique = torch.tensor([row.unique().numel() for row in first], dtype=torch.float)
    assert bool(((unique / 1000 - (1 - np.exp(-1))).abs() < 0.04).all()), unique
    assert len({tuple(row.sort().values.tolist()) for row in first}) == 5
    fixed = indices_seen(make(n=1000, num_members=5, batch_size=100, bootstrap=True, shuffle=False))
    assert torch.equal(fixed.sort(dim=1).values, first.sort(dim=1).values)


def test_orders_look_uniform_and_independent_across_members() -> None:
    order = make(n=10, num_members=4000).order(0)  # (4000, 10)
    counts = torch.bincount(order[:, 0], minlength=10).float()  # expected 400 each
    assert bool(((counts - 400).abs() < 80).all()), counts
    # neighbouring members' positions of each sample are uncorrelated
    ranks = order.argsort(dim=1).float()
    a, b = ranks[0::2] - 4.5, ranks[1::2] - 4.5
    corr = (a * b).sum() / (a.norm() * b.norm())
    assert abs(float(corr)) < 0.05


@pytest.mark.parametrize("bootstrap", [False, True])
def test_members_are_keyed_by_global_index(bootstrap: bool) -> None:
    """A shard of members 3..5 sees what members 3..5 of the whole population see."""
    whole = make(n=20, num_members=8, bootstrap=bootstrap)
    shard = make(n=20, num_members=3, first_member=3, bootstrap=bootstrap)
    for _ in range(2):
        assert torch.equal(indices_seen(shard), indices_seen(whole)[3:6])


def test_deterministic_under_a_seed_and_under_torch_manual_seed() -> None:
    assert torch.equal(indices_seen(make(seed=5)), indices_seen(make(seed=5)))
    assert not torch.equal(indices_seen(make(seed=5)), indices_seen(make(seed=6)))
    torch.manual_seed(3)
    a = indices_seen(make(seed=None))
    torch.manual_seed(3)
    b = indices_seen(make(seed=None))
    g = torch.Generator().manual_seed(3)
    c = indices_seen(make(seed=None, generator=g))
    assert torch.equal(a, b) and c.shape == a.shape


@pytest.mark.parametrize("consumed", [0, 2, 4, 5, 9])
def test_state_dict_resumes_at_the_same_batch(consumed: int) -> None:
    """Save after `consumed` batches (crossing epoch ends), resume in a new loader."""
    loader = make(n=10, bootstrap=True)  # 4 batches per epoch
    stream = (b for _ in range(10) for b in loader)
    for _ in range(consumed):
        next(stream)
    state = loader.state_dict()
    expected = [next(stream)[0] for _ in range(6)]
    resumed = make(n=10, bootstrap=True, seed=123)  # the seed comes from the state
    resumed.load_state_dict(state)
    stream2 = (b for _ in range(10) for b in resumed)
    got = [next(stream2)[0] for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_load_state_dict_rejects_another_loader() -> None:
    state = make(num_members=4).state_dict()
    with pytest.raises(
        ValueError,
        match=r"load_state_dict\(\): num_members is 5 in this loader but 4 in the saved state",
    ):
        make(num_members=5).load_state_dict(state)


class Pairs(Dataset):
    def __init__(self) -> None:
        self.x = np.arange(24, dtype=np.float32).reshape(12, 2)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return self.x[i], i % 3


def test_from_dataset_matches_the_tensors() -> None:
    X, Y = torch.arange(24.0).reshape(12, 2), torch.arange(12) % 3
    for dataset in (Pairs(), TensorDataset(X, Y)):
        ref = MemberLoader(X, Y, num_members=3, batch_size=5, seed=1)
        loader = MemberLoader.from_dataset(dataset, num_members=3, batch_size=5, seed=1)
        for (x1, y1), (x2, y2) in zip(ref, loader, strict=True):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


class Dicts(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        return {"x": torch.zeros(2)}


def test_errors_are_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"MemberLoader\(\): tensor 1 has shape \(9,\); every tensor must have the same first dimension \(samples\) as tensor 0, 10",
    ):
        MemberLoader(torch.zeros(10, 2), torch.zeros(9), num_members=2, batch_size=2)
    with pytest.raises(
        ValueError, match=r"drop_last=True with batch_size=20 larger than the 10 samples"
    ):
        MemberLoader(torch.zeros(10), num_members=2, batch_size=20, drop_last=True)
    with pytest.raises(ValueError, match=r"num_members must be a positive int; got 0"):
        MemberLoader(torch.zeros(10), num_members=0, batch_size=2)
    with pytest.raises(
        TypeError,
        match=r"from_dataset\(\): items must be tensors, numbers or tuples of them; they collate to dict",
    ):
        MemberLoader.from_dataset(Dicts(), num_members=2, batch_size=1)


# ---------------------------------------------------------------------------- member surgery


def test_copy_members_gives_the_target_its_sources_batches_from_the_next_batch() -> None:
    loader = make(n=30, num_members=4, batch_size=4, bootstrap=True)
    reference = make(n=30, num_members=4, batch_size=4, bootstrap=True)
    batches, expected = iter(loader), iter(reference)
    for _ in range(2):
        assert torch.equal(next(batches)[0], next(expected)[0])
    loader.copy_members([2], [0])  # mid-epoch
    assert loader.streams.tolist() == [2, 1, 2, 3]
    for (got,), (want,) in zip(batches, expected):  # the rest of the epoch
        assert torch.equal(got[0], want[2]) and torch.equal(got[1:], want[1:])
    (got,), (want,) = next(iter(loader)), next(iter(reference))  # and the next epoch
    assert torch.equal(got[0], want[2]) and torch.equal(got[1:], want[1:])


def test_keep_members_keeps_each_members_stream_and_resumes() -> None:
    loader = make(n=30, num_members=5, batch_size=4, bootstrap=True)
    reference = make(n=30, num_members=5, batch_size=4, bootstrap=True)
    next(iter(loader)), next(iter(reference))
    loader.keep_members([4, 1])
    assert loader.num_members == 2 and loader.streams.tolist() == [4, 1]
    state = loader.state_dict()
    resumed = make(n=30, num_members=5, batch_size=4, bootstrap=True)
    resumed.keep_members([0, 1])  # the saved streams, not these, are restored
    resumed.load_state_dict(state)
    for (a,), (b,), (c,) in zip(loader, reference, resumed):
        assert torch.equal(a, b[[4, 1]]) and torch.equal(c, a)


def test_surgery_errors_are_named() -> None:
    loader = make()
    with pytest.raises(ValueError, match=r"copy_members\(\): 1 source members but 2 target"):
        loader.copy_members([0], [1, 2])
    with pytest.raises(IndexError, match=r"keep_members\(\): members \[4\] out of range"):
        loader.keep_members([4])
    with pytest.raises(ValueError, match=r"set_streams\(\): expected one non-negative stream"):
        loader.set_streams([0, 1], [3])
