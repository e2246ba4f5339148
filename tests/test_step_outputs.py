"""phalanx.compile_step with the loss the loop uses on a structured output.

A model's authors often train it with a loss that reads its whole output: TD3's critic loss
reads both Q heads of a tuple, a Gaussian model's NLL the mean and log-variance, a VAE's loss
the reconstruction, mean and log-variance, a Hugging Face model's loss ``out.logits`` or its
own ``out.loss``. The user hands ``compile_step`` that same loss; here the captured step
(``aot_eager``, one inductor case) is compared, step by step, with the eager phalanx step
(equal to float rounding) and with the loop of independent modules with ``torch.optim.Adam``
in float32 and float64 (``phalanx.testing``'s rule, member by member). Bad input gets an
error naming the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from helpers import DictOut, assert_close
from phalanx.testing import assert_equal_to_loop

N, B, STEPS, LR = 3, 8, 4, 1e-2
# Adam's eps far above every gradient: the update stays Adam's, but its rounding error stays
# proportional to the gradient's (see tests/test_step.py's EPS).
EPS = 1.0


class TwinQ(nn.Module):
    """sfujim/TD3's Critic in small: two Q heads on (state, action), a tuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.q1 = nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 1))
        self.q2 = nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sa = torch.cat([state, action], 1)
        return self.q1(sa), self.q2(sa)


def twin_q_loss(q: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(q[0], target) + F.mse_loss(q[1], target)


def dict_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(out["logits"], y) + 0.1 * out["mean"].pow(2).mean()


@dataclasses.dataclass
class Gaussian:
    """A dataclass as a model's output, registered as a pytree node (as the stack needs)."""

    mean: torch.Tensor
    logvar: torch.Tensor


torch.export.register_dataclass(Gaussian)


@dataclasses.dataclass
class Unregistered:
    mean: torch.Tensor


class GaussianMLP(nn.Module):
    """mbrl-lib's GaussianMLP in small: a mean and a log-variance."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.SiLU())
        self.mean, self.logvar = nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> Gaussian:
        h = self.body(x)
        return Gaussian(self.mean(h), self.logvar(h).clamp(-5, 2))


def gaussian_nll(out: Gaussian, target: torch.Tensor) -> torch.Tensor:
    losses = F.mse_loss(out.mean, target, reduction="none") * (-out.logvar).exp() + out.logvar
    return losses.sum(dim=1).mean() * 0.5


def _data(kind: str, in_dim: int | None) -> list[tuple[tuple[torch.Tensor, ...], Any]]:
    g = torch.Generator().manual_seed(3)
    lead = (N,) if in_dim == 0 else ()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*lead, *shape, generator=g)

    data = []
    for _ in range(STEPS):
        if kind == "tuple":
            data.append(((randn(B, 5), randn(B, 2)), randn(B, 1)))
        elif kind == "sequence":
            data.append(((randn(B, 6, 3),), randn(B, 1)))
        elif kind == "dict":
            data.append(((randn(B, 6),), torch.randint(0, 4, (*lead, B), generator=g)))
        else:
            data.append(((randn(B, 5),), randn(B, 3)))
    return data


CASES = {
    # per-member batches (TD3's critics each on their own replay sample), a tuple out
    "tuple_twin_q": (TwinQ, twin_q_loss, "tuple", 0),
    # one shared batch, a dict out
    "dict": (DictOut, dict_loss, "dict", None),
    # a (registered) dataclass out, per-member batches
    "dataclass_gaussian": (GaussianMLP, gaussian_nll, "dataclass", 0),
}


def _members(make: Any, seed: int = 0) -> list[nn.Module]:
    members = []
    for i in range(N):
        torch.manual_seed(seed + i)
        members.append(make())
    return members


def _pick(x: Any, i: int, dim: int | None) -> Any:
    return x if dim is None else x[i]


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() else x


def _loop(members, loss_fn, data, in_dim, dtype, call=None):
    """Each member alone with torch.optim.Adam: the reference."""
    models = [copy.deepcopy(m).to(dtype) for m in members]
    opts = [torch.optim.Adam(m.parameters(), lr=LR, eps=EPS) for m in models]
    losses = []
    for args, y in data:
        row = []
        for i, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            xi = [_cast(_pick(a, i, in_dim), dtype) for a in args]
            yi = _cast(_pick(y, i, in_dim), dtype)
            out = m(*xi) if call is None else call(m, xi, yi)
            loss = loss_fn(out, yi)
            loss.backward()
            o.step()
            row.append(loss.detach())
        losses.append(torch.stack(row))
    return models, torch.stack(losses)


def _eager(members, loss_fn, data, in_dim):
    """The eager phalanx step, as a user writes it with the same loss."""
    stack = phalanx.stack(copy.deepcopy(members))
    opt = phalanx.optim.Adam(stack.parameters(), lr=LR, eps=EPS)
    losses = []
    for args, y in data:
        opt.zero_grad()
        out = stack(*args, in_dims=in_dim)
        loss = phalanx.member_losses(loss_fn, out, y, in_dims=(0, in_dim))
        loss.sum().backward()
        opt.step()
        losses.append(loss.detach())
    return stack, torch.stack(losses)


def _captured(members, loss_fn, data, in_dim, backend="aot_eager", **kw):
    stack = phalanx.stack(copy.deepcopy(members))
    opt = phalanx.optim.Adam(stack.parameters(), lr=LR, eps=EPS)
    step = phalanx.compile_step(
        stack, loss_fn, opt, in_dims=in_dim, target_in_dims=in_dim, backend=backend,
        prefer="captured", warmup_steps=1, **kw,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = torch.stack([step(args, y) for args, y in data])
    said = [str(w.message) for w in caught if "phalanx" in str(w.message)]
    assert not said, said  # a fallback to the eager step would say so
    assert step.choice == "captured", step.report
    return stack, losses


def _assert_like_the_loop(stack, losses, members, loss_fn, data, in_dim, call=None):
    loop32, losses32 = _loop(members, loss_fn, data, in_dim, torch.float32, call)
    loop64, losses64 = _loop(members, loss_fn, data, in_dim, torch.float64, call)
    assert_equal_to_loop(losses, losses32, losses64, what="losses", per_member=False)
    for name, ours in stack.stacked_state()[0].items():
        assert_equal_to_loop(
            ours.detach(),
            torch.stack([m.get_parameter(name).detach() for m in loop32]),
            torch.stack([m.get_parameter(name).detach() for m in loop64]),
            what=name,
            per_member=True,
        )


@pytest.mark.parametrize("case", list(CASES))
def test_captured_step_on_a_structured_output_equals_eager_step_and_loop(case):
    make, loss_fn, kind, in_dim = CASES[case]
    members = _members(make)
    data = _data(kind, in_dim)
    stack, losses = _captured(members, loss_fn, data, in_dim)
    eager, eager_losses = _eager(members, loss_fn, data, in_dim)
    assert_close(losses, eager_losses, trajectory=True, msg="losses")
    assert_close(stack.state_dict(), eager.state_dict(), trajectory=True, msg="weights")
    _assert_like_the_loop(stack, losses, members, loss_fn, data, in_dim)


def test_inductor_captures_a_tuple_output():
    """One real compilation (C++ by inductor) of the twin-Q critic's step."""
    members = _members(TwinQ)
    data = _data("tuple", 0)[:3]
    stack, losses = _captured(members, twin_q_loss, data, 0, backend="inductor")
    eager, eager_losses = _eager(members, twin_q_loss, data, 0)
    assert_close(losses, eager_losses, trajectory=True, msg="losses")
    assert_close(stack.state_dict(), eager.state_dict(), trajectory=True, msg="weights")


# ------------------------------------------------------------------ Hugging Face ModelOutput


def _hf_members(tf: Any) -> list[nn.Module]:
    config = tf.GPT2Config(
        vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=16, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _members(lambda: tf.GPT2LMHeadModel(config))


def _tokens() -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(STEPS - 1):
        idx = torch.randint(40, (4, 9), generator=g)
        data.append(((idx[:, :-1].contiguous(),), idx[:, 1:].contiguous()))
    return data


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def test_gpt2_is_captured_with_a_loss_on_its_model_output():
    """GPT-2 reads a value (its search for packed sequences) unless it is traced with fake
    tensors: the step is captured, not refused, and equals the eager step and the loop."""
    tf = pytest.importorskip("transformers")
    members = _hf_members(tf)
    data = _tokens()
    stack, losses = _captured(members, lm_loss, data, None)
    eager, eager_losses = _eager(members, lm_loss, data, None)
    assert_close(losses, eager_losses, trajectory=True, msg="losses")
    assert_close(stack.state_dict(), eager.state_dict(), trajectory=True, msg="weights")
    _assert_like_the_loop(stack, losses, members, lm_loss, data, None)


def test_a_loss_reading_the_models_own_loss_field():
    """``labels=`` makes each member compute its own loss; a loss_fn reading ``out.loss``
    (as nanoGPT's ``(logits, loss)`` is read) gives the same step as ``loss_fn=None``."""
    tf = pytest.importorskip("transformers")
    members = _hf_members(tf)
    data = _tokens()

    def own(out: Any, _: Any) -> torch.Tensor:
        return out.loss

    runs = []
    for loss_fn in (own, None):
        stack = phalanx.stack(copy.deepcopy(members))
        opt = phalanx.optim.Adam(stack.parameters(), lr=LR, eps=EPS)
        step = phalanx.compile_step(
            stack, loss_fn, opt, backend="aot_eager", prefer="captured", warmup_steps=1
        )
        losses = torch.stack([step(args[0], labels=args[0]) for args, _ in data])
        assert step.choice == "captured", step.report
        runs.append((stack, losses))
    assert_close(runs[0][1], runs[1][1], msg="losses")
    assert_close(runs[0][0].state_dict(), runs[1][0].state_dict(), msg="weights")
    labelled = [(args, args[0]) for args, _ in data]  # the loop: member(ids, labels=ids).loss

    def call(m: nn.Module, x: list[torch.Tensor], y: torch.Tensor) -> Any:
        return m(*x, labels=y)

    _assert_like_the_loop(runs[0][0], runs[0][1], members, own, labelled, None, call)


# ------------------------------------------------------------------------------ bad input


def test_a_loss_that_cannot_read_the_output_is_named_with_the_fix():
    members = _members(TwinQ)
    (args, y), *_ = _data("tuple", 0)
    stack = phalanx.stack(copy.deepcopy(members))
    step = phalanx.compile_step(
        stack, F.mse_loss, phalanx.optim.Adam(stack.parameters()), in_dims=0, backend="aot_eager"
    )
    with pytest.raises(
        TypeError,
        match=r"loss_fn could not read a member's output, a tuple of tensors \(8, 1\), \(8, 1\)"
        r".*read the part the loss needs, e.g. lambda out, y: F.mse_loss\(out\[0\], y\)",
    ):
        step(args, y)
    out = stack(*args, in_dims=0)
    with pytest.raises(
        TypeError, match=r"with fields \['logits', 'mean'\].*KeyError: 'logit'.*out\['logits'\]"
    ):
        phalanx.member_losses(lambda o, t: o["logit"].sum(), {"logits": out[0], "mean": out[1]})
    with pytest.raises(
        TypeError,
        match=r"Gaussian with fields \['mean', 'logvar'\].*'logits'.*F.mse_loss\(out.mean, y\)",
    ):
        phalanx.member_losses(
            lambda o, t: o.logits.sum(), Gaussian(out[0], out[1]), y, in_dims=(0, 0)
        )
    with pytest.raises(TypeError, match=r"torch.export.register_dataclass\(Unregistered\)"):
        phalanx.member_losses(lambda o, t: o.mean.sum(), Unregistered(out[0]), y, in_dims=(0, 0))


def test_a_loss_of_the_wrong_shape_is_named():
    members = _members(TwinQ)
    (args, y), *_ = _data("tuple", 0)
    stack = phalanx.stack(copy.deepcopy(members))

    def per_sample(q: Any, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(q[0], t, reduction="none")

    step = phalanx.compile_step(
        stack, per_sample, phalanx.optim.Adam(stack.parameters()), in_dims=0, backend="aot_eager"
    )
    with pytest.raises(ValueError, match=r"one scalar per member, giving shape \(3,\); "
                       r"got \(3, 8, 1\).*reduction='mean'"):  # fmt: skip
        step(args, y)
    out = stack(*args, in_dims=0)
    with pytest.raises(ValueError, match=r"giving shape \(3,\); got tuple.*return the loss alone"):
        phalanx.member_losses(lambda q, t: (twin_q_loss(q, t), q[0]), out, y, in_dims=(0, 0))
    with pytest.raises(
        ValueError, match=r"tensors \(3, 8, 1\), \(2,\)\) must carry the member axis first"
    ):
        phalanx.member_losses(twin_q_loss, (out[0], torch.zeros(2)), y, in_dims=(0, 0))


class Forecaster(nn.Module):
    """The zoo's LSTM forecaster, small: the last timestep's output, through a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, 2, batch_first=True)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def test_compile_step_captures_an_lstm_as_one_recurrence(monkeypatch):
    """Traced, an LSTM is the one recurrence for all members (oneDNN's kernel, which inductor
    cannot compile, is not in the graph); the captured step equals the loop's to float
    rounding, member by member."""
    from phalanx.backends.rules import _recurrent

    taken: list[str] = []
    batched = _recurrent.batched
    monkeypatch.setattr(_recurrent, "batched", lambda *a: taken.append(a[0]) or batched(*a))
    members = _members(Forecaster)
    data = _data("sequence", 0)
    stack, losses = _captured(members, F.mse_loss, data, 0)
    assert "lstm" in taken
    _assert_like_the_loop(stack, losses, members, F.mse_loss, data, 0)
