"""split / merge: property tests against explicit slicing."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import phalanx


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    d=st.integers(1, 4),
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    tail=st.lists(st.integers(1, 3), max_size=1),
    data=st.data(),
)
def test_split_matches_slicing_and_merge_inverts(n, d, lead, tail, data):
    shape = [*lead, n * d, *tail]
    dim = len(lead)
    x = torch.randn(shape)
    signed_dim = data.draw(st.sampled_from([dim, dim - len(shape)]))
    xs = phalanx.split(x, n, dim=signed_dim)
    assert xs.shape == (n, *lead, d, *tail)
    assert xs.data_ptr() == x.data_ptr(), "split of a contiguous tensor must be a view"
    for i in range(n):
        torch.testing.assert_close(xs[i], x.narrow(dim, i * d, d), rtol=0, atol=0)
    torch.testing.assert_close(phalanx.merge(xs, dim=dim), x, rtol=0, atol=0)
