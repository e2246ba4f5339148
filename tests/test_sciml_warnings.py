"""Warnings for a fed-back output (an ODE solver's state) and a shared input requiring grad
(a PINN's x), and none for the ordinary inputs that look alike."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

import phalanx
from helpers import assert_close

N, B = 4, 6


class Dynamics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y) * torch.cos(t)


def _rk4(f, y, steps=3, dt=0.1):
    """A fixed-step solver, as torchdiffeq's rk4 calls its dynamics."""
    t = torch.tensor(0.0)
    for _ in range(steps):
        k1 = f(t, y)
        k2 = f(t + dt / 2, y + dt / 2 * k1)
        k3 = f(t + dt / 2, y + dt / 2 * k2)
        k4 = f(t + dt, y + dt * k3)
        y, t = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4), t + dt
    return y


def _members() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Dynamics() for _ in range(N)]


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_a_fed_back_output_is_warned_once_naming_in_dims():
    stack = phalanx.stack(_members())
    y0 = torch.randn(N, B, 2)
    match = r"(?s)shape of an output of this stack.*in_dims=0"
    # the state grows a member axis per call, until _stop()
    with pytest.warns(UserWarning, match=match) as w, pytest.raises(RuntimeError):
        _rk4(lambda t, y: stack(t, y) if y.dim() < 5 else _stop(), y0)
    assert sum("shape of an output" in str(m.message) for m in w) == 1


def _stop():
    raise RuntimeError("the state kept growing")


def test_the_fix_integrates_each_member_exactly_and_quietly():
    members = _members()
    reference = copy.deepcopy(members)
    stack = phalanx.stack(members)
    y0 = torch.randn(N, B, 2)
    with _quiet():
        got = _rk4(lambda t, y: stack(t, y, in_dims=(None, 0)), y0)
    expected = torch.stack([_rk4(m, y0[i]) for i, m in enumerate(reference)])
    assert_close(got, expected, msg="states")


def test_a_batch_of_n_samples_is_not_mistaken_for_a_fed_back_output():
    stack = phalanx.stack([nn.Linear(3, 3) for _ in range(N)])
    with _quiet():
        for _ in range(3):
            stack(torch.randn(N, 3))  # B == N: (N, 3) in, (N, N, 3) out


def test_a_shared_input_requiring_grad_is_warned_once_naming_the_fix():
    stack = phalanx.stack([nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
                           for _ in range(N)])  # fmt: skip
    x = torch.rand(B, 2, requires_grad=True)
    with pytest.warns(UserWarning, match=r"(?s)sum of the 4 members' derivatives.*in_dims=0"):
        u = stack(x)
    g = torch.autograd.grad(u.sum(), x)[0]
    assert g.shape == x.shape  # what the warning is about: one (B, 2), the members' sum
    with _quiet():
        stack(torch.rand(B, 2, requires_grad=True))  # once per stack
        xs = x.detach().expand(N, B, 2).requires_grad_()  # the fix: silent, per member
        gs = torch.autograd.grad(stack(xs, in_dims=0).sum(), xs)[0]
    members = stack.unstack()
    for i, m in enumerate(members):
        xi = x.detach().clone().requires_grad_()
        assert_close(gs[i], torch.autograd.grad(m(xi).sum(), xi)[0], msg=f"member {i} u_x")


def test_a_shared_input_from_a_trainable_encoder_is_not_warned():
    encoder = nn.Linear(5, 2)
    stack = phalanx.stack([nn.Linear(2, 1) for _ in range(N)])
    with _quiet():
        stack(encoder(torch.randn(B, 5))).sum().backward()  # the heads' sum is intended
        with torch.no_grad():
            stack(torch.rand(B, 2, requires_grad=True))
