"""Per-member keyword inputs (``kw_in_dims``) on every backend, against the N original modules
run one by one; the warning for an undeclared keyword that looks per-member; caches refused."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import phalanx
from helpers import assert_close

N, B, T, D = 3, 4, 5, 6
BACKENDS = ["loop", "vmap", "fused", "auto"]


class Masked(nn.Module):
    """A member driven by keywords: a mask and a scale, as Hugging Face models are called."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, x, *, pad=None, scale=None, label=None):
        h = torch.tanh(self.proj(x))  # (B, T, D)
        if pad is not None:
            h = h * pad.unsqueeze(-1)
        if scale is not None:
            h = h * scale
        out = self.head(h.mean(1))
        if label is None:
            return out
        return {"loss": nn.functional.cross_entropy(out, label), "logits": out}


def _members() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Masked() for _ in range(N)]


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, B, T, D, generator=g)
    mask = (torch.rand(N, B, T, generator=g) > 0.3).float()
    scale = torch.rand(B, 1, D, generator=g) + 0.5  # shared
    label = torch.randint(0, 2, (N, B), generator=g)
    return x, mask, scale, label


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_member_keywords_match_the_members_one_by_one(backend):
    members = _members()
    x, mask, scale, label = _data()
    x_ref = x.clone().requires_grad_()
    mask_ref = mask.clone().requires_grad_()
    refs = [
        m(x_ref[i], pad=mask_ref[i], scale=scale, label=label[i]) for i, m in enumerate(members)
    ]
    torch.stack([r["loss"] for r in refs]).sum().backward()

    stack = phalanx.stack(members, backend=backend)
    x_s, mask_s = x.clone().requires_grad_(), mask.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = stack(
            x_s, in_dims=0, pad=mask_s, scale=scale, label=label,
            kw_in_dims={"pad": 0, "label": 0, "scale": None},
        )  # fmt: skip
    losses = phalanx.member_losses(None, out)  # the members' own losses, (N,)
    losses.sum().backward()
    assert stack.backend == ("loop" if backend == "loop" else backend.replace("auto", "fused"))
    assert_close(out["logits"], torch.stack([r["logits"] for r in refs]))
    assert_close(losses, torch.stack([r["loss"] for r in refs]))
    assert_close(x_s.grad, x_ref.grad)
    assert_close(mask_s.grad, mask_ref.grad)  # a per-member keyword's own gradient
    for name, p in stack.module.named_parameters():
        assert_close(p.grad, torch.stack([m.get_parameter(name).grad for m in members]), msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_single_zero_marks_every_keyword_tensor(backend):
    members = _members()
    x, mask, _, _ = _data()
    ref = torch.stack([m(x[i], pad=mask[i]) for i, m in enumerate(members)])
    stack = phalanx.stack(members, backend=backend)
    assert_close(stack(x, in_dims=0, pad=mask, kw_in_dims=0), ref)
    # shared keywords stay shared: one mask for every member
    shared = torch.stack([m(x[i], pad=mask[0]) for i, m in enumerate(members)])
    assert_close(stack(x, in_dims=0, pad=mask[0]), shared)


def test_an_undeclared_keyword_that_looks_per_member_warns_with_the_fix():
    stack = phalanx.stack(_members())
    x, mask, _, _ = _data()
    with pytest.warns(UserWarning, match=r"keyword input 'pad' has shape \(3, 4, 5\).*"
                      r"kw_in_dims=\{'pad': 0\}"):  # fmt: skip
        stack(x, in_dims=0, pad=mask)  # each member reads (N, B, T): broadcasts, silently wrong
    # a shared (B, T) mask whose B and T happen to be N: declared shared, it gives no warning
    x = torch.randn(N, N, N, D)
    with pytest.warns(UserWarning, match="kw_in_dims"):
        stack(x, in_dims=0, pad=torch.ones(N, N))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stack(x, in_dims=0, pad=torch.ones(N, N), kw_in_dims={"pad": None})


def test_bad_keyword_dims_are_refused_with_the_fix():
    stack = phalanx.stack(_members())
    x, mask, _, _ = _data()
    with pytest.raises(ValueError, match=r"'pad' is marked per-member.*number of members, 3"):
        stack(x, in_dims=0, pad=mask[0], kw_in_dims={"pad": 0})
    with pytest.raises(ValueError, match=r"kw_in_dims names \['mask_'\]"):
        stack(x, in_dims=0, pad=mask, kw_in_dims={"mask_": 0})
    with pytest.raises(ValueError, match=r"must be None \(shared\) or 0 \(per-member\); got 1"):
        stack(x, in_dims=0, pad=mask, kw_in_dims={"pad": 1})
    with pytest.raises(TypeError, match=r"'scale' is marked per-member .* is a float"):
        stack(x, in_dims=0, pad=mask, scale=2.0, kw_in_dims={"pad": 0, "scale": 0})


def test_member_losses_on_a_structured_output_says_what_to_do():
    stack = phalanx.stack(_members())
    x, mask, _, label = _data()
    out = stack(x, in_dims=0, pad=mask, label=label, kw_in_dims=0)
    with pytest.raises(
        TypeError, match=r"could not read a member.s output.*or loss_fn=None to use the loss"
    ):
        phalanx.member_losses(nn.functional.cross_entropy, out, label, in_dims=(0, 0))
    plain = stack(x, in_dims=0, pad=mask, kw_in_dims=0)
    with pytest.raises(TypeError, match="loss_fn=None uses the loss the model computes itself"):
        phalanx.member_losses(None, plain)


def test_gpt2_use_cache_is_refused_up_front_naming_use_cache_false():
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    torch.manual_seed(0)
    stack = phalanx.stack([tf.GPT2LMHeadModel(config) for _ in range(2)], backend="loop")
    ids = torch.randint(0, 50, (2, 6))
    with pytest.raises(ValueError, match=r"use_cache=True.*Pass use_cache=False to the call"):
        stack(ids, labels=ids)
    assert phalanx.member_losses(None, stack(ids, labels=ids, use_cache=False)).shape == (2,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_call_time_use_cache_true_is_refused_though_the_config_says_false(backend):
    # it ran and returned one DynamicCache of vmap BatchedTensors that failed later
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    config.use_cache = False
    torch.manual_seed(0)
    stack = phalanx.stack([tf.GPT2LMHeadModel(config) for _ in range(2)], backend=backend)
    ids = torch.randint(0, 50, (2, 6))
    with pytest.raises(ValueError, match=r"the call passes use_cache=True.*Pass use_cache=False"):
        stack(ids, use_cache=True)
    assert stack(ids, use_cache=False).past_key_values is None
    assert stack(ids).past_key_values is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plain_bert_encoder_runs_equal_to_its_members(backend):
    # an encoder never returns a cache (its forward sets use_cache=False when not a decoder),
    # though its config says use_cache=True: it was refused on every backend
    tf = pytest.importorskip("transformers")
    config = tf.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    assert config.use_cache is True and config.is_decoder is False
    torch.manual_seed(0)
    members = [tf.BertModel(config) for _ in range(2)]
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        expected = [m(ids).last_hidden_state for m in members]
        stack = phalanx.stack(copy.deepcopy(members), backend=backend)
        out = stack(ids)
    assert out.past_key_values is None
    for i in range(2):
        assert_close(out.last_hidden_state[i], expected[i])


def test_save_pretrained_of_the_stacked_module_is_refused_with_the_fix(tmp_path):
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    torch.manual_seed(0)
    stack = phalanx.stack([tf.GPT2LMHeadModel(config) for _ in range(2)])
    with pytest.raises(TypeError, match=r"stacked, \(N, \*shape\).*unstack\(\)\[i\]"):
        stack.module.save_pretrained(tmp_path)
    assert not list(tmp_path.iterdir())
    stack.unstack()[1].save_pretrained(tmp_path)  # a member saves as usual
    assert (tmp_path / "config.json").exists()
