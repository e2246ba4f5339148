"""``phalanx.stack_in_place``: a ModuleList inside a model replaced by a stack that still acts
as the list did (indexing, iteration, the list's state_dict keys), each checked against the
model before stacking."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import phalanx
from helpers import assert_close

N, D, H, B = 400, 20, 10, 32  # the seed question: 400 networks 20-10-1, x (32, 20 * 400)


class PerFeature(nn.Module):
    """A model holding one small network per input feature, as the seed question has it."""

    def __init__(self, n: int = N) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.heads = nn.ModuleList(
            [nn.Sequential(nn.Linear(D, H), nn.Linear(H, 1)) for _ in range(n)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the loop as users write it
        parts = x.split(D, dim=1)
        return self.scale * torch.cat([h(p) for h, p in zip(self.heads, parts)], dim=1)

    def parallel(self, x: torch.Tensor) -> torch.Tensor:  # the one call, after stacking
        return self.scale * phalanx.merge(
            self.heads(phalanx.split(x, len(self.heads), dim=1), in_dims=0), dim=1
        )


def _model(dtype=torch.float32) -> PerFeature:
    torch.manual_seed(0)
    return PerFeature().to(dtype)


def _within_rounding(got: torch.Tensor, loop32: torch.Tensor, loop64: torch.Tensor) -> None:
    """``got`` is no further from the float64 loop than 4x the float32 loop (+ 8 ulps)."""
    err = (got.double() - loop64).abs().max().item()
    own = (loop32.double() - loop64).abs().max().item()
    floor = 8 * torch.finfo(torch.float32).eps * loop64.abs().max().item()
    assert err <= 4 * own + floor, f"error {err:.3g} against float64, the float32 loop's {own:.3g}"


def test_the_models_own_forward_runs_unchanged_and_equals_the_list():
    model = _model()
    x = torch.randn(B, D * N)
    before = model(x)
    stacked = phalanx.stack_in_place(model, "heads")
    assert model.heads is stacked and isinstance(stacked, phalanx.Stack)
    # The surrounding forward iterates the list: each view runs its member alone, bit for bit.
    assert torch.equal(model(x), before)
    assert len(model.heads) == N
    assert model.heads[3][0].weight.shape == (H, D)
    assert model.heads[-1][1].bias.shape == (1,)


def test_one_call_equals_the_loop_with_gradients():
    loop32, loop64 = _model(), _model(torch.float64)
    model = _model()
    phalanx.stack_in_place(model, "heads")
    x = torch.randn(B, D * N)
    outs = []
    for m, xx in ((loop32, x), (loop64, x.double()), (model, x)):
        xx = xx.clone().requires_grad_()
        out = (m.parallel if m is model else m)(xx)
        (out**2).sum().backward()
        outs.append((out, xx.grad, m))
    (o32, g32, _), (o64, g64, _), (o, g, _) = outs
    _within_rounding(o, o32, o64)
    _within_rounding(g, g32, g64)
    _within_rounding(model.scale.grad, loop32.scale.grad, loop64.scale.grad)
    for name, p in model.heads.module.named_parameters():  # (N, *shape) against each member's
        ref32 = torch.stack([h.get_parameter(name).grad for h in loop32.heads])
        ref64 = torch.stack([h.get_parameter(name).grad for h in loop64.heads])
        _within_rounding(p.grad, ref32, ref64)


def test_the_loop_through_views_gives_the_lists_gradients():
    loop, model = _model(), _model()
    phalanx.stack_in_place(model, "heads")
    x = torch.randn(B, D * N)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (loop, model)]
    for step in range(3):  # two accumulated backward passes, then a step, then another pass
        loop(x).pow(2).sum().backward()
        model(x).pow(2).sum().backward()
        for name, p in model.heads.module.named_parameters():
            ref = torch.stack([h.get_parameter(name).grad for h in loop.heads])
            torch.testing.assert_close(p.grad, ref, rtol=0, atol=0, msg=f"step {step} {name}")
        if step == 1:
            for opt in opts:
                opt.step()
                opt.zero_grad()


def test_state_dict_keeps_the_lists_keys_and_an_old_checkpoint_loads():
    old = _model()
    checkpoint = copy.deepcopy(old.state_dict())  # written before stacking
    model = _model()
    phalanx.stack_in_place(model, "heads")
    saved = model.state_dict()
    assert list(saved) == list(checkpoint)
    assert all(torch.equal(saved[k], checkpoint[k]) for k in checkpoint)
    with torch.no_grad():
        model.heads.module[0].weight.zero_()
    result = model.load_state_dict(checkpoint)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(B, D * N)
    assert torch.equal(model(x), old(x))
    # and the stacked model's own state_dict loads into the model as it was before stacking
    fresh = PerFeature()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(x), old(x))


def test_a_missing_or_misshaped_member_is_named_by_its_list_key():
    checkpoint = _model().state_dict()
    del checkpoint["heads.5.1.bias"]
    model = _model()
    phalanx.stack_in_place(model, "heads")
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "heads\.5\.1\.bias"'):
        model.load_state_dict(checkpoint)
    assert model.load_state_dict(checkpoint, strict=False).missing_keys == ["heads.5.1.bias"]
    checkpoint["heads.5.1.bias"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"size mismatch for heads\.5\.1\.bias.*\(2,\).*\(1,\)"):
        model.load_state_dict(checkpoint)


def test_views_index_iterate_and_assign_like_the_list():
    model = _model()
    members = [copy.deepcopy(h) for h in model.heads]
    phalanx.stack_in_place(model, "heads")
    x = torch.randn(B, D)
    views = list(model.heads)
    assert len(views) == N and len(model.heads[2:5]) == 3
    assert torch.equal(views[7](x), members[7](x))
    assert torch.equal(model.heads[-1](x), members[-1](x))
    assert [n for n, _ in model.heads[0].named_parameters()] == [
        n for n, _ in members[0].named_parameters()
    ]
    replacement = nn.Sequential(nn.Linear(D, H), nn.Linear(H, 1))
    model.heads[7] = replacement
    assert torch.equal(model.heads[7](x), replacement(x))
    assert torch.equal(model.heads[6](x), members[6](x))
    with pytest.raises(IndexError, match="index 400 is out of range for 400 members"):
        model.heads[N]
    with pytest.raises(TypeError, match="number of members is fixed at 400"):
        model.heads.append(replacement)
    with pytest.raises(ValueError, match="does not match the members' architecture"):
        model.heads[0] = nn.Sequential(nn.Linear(D, H + 1), nn.Linear(H + 1, 1))


def test_unstack_in_place_gives_the_list_back():
    model = _model()
    x = torch.randn(B, D * N)
    before = model(x)
    phalanx.stack_in_place(model, "heads")
    back = phalanx.unstack_in_place(model, "heads")
    assert isinstance(back, nn.ModuleList) and type(back[0]) is nn.Sequential
    assert torch.equal(model(x), before)


def test_refuses_what_is_not_a_list():
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"'body' is a Sequential, not an nn.ModuleList"):
        phalanx.stack_in_place(model, "body")
    with pytest.raises(TypeError, match="has no submodule 'heads'"):
        phalanx.stack_in_place(model, "heads")


def test_hugging_face_musicgen_heads_and_embeddings_round_trip_save_pretrained(tmp_path):
    """MusicgenForCausalLM holds one lm_head and one embedding per codebook in ModuleLists;
    its forward indexes and iterates them (``[head(h) for head in self.lm_heads]``)."""
    tf = pytest.importorskip("transformers")
    config = tf.MusicgenDecoderConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
        num_codebooks=4, max_position_embeddings=64, pad_token_id=63, bos_token_id=63,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.MusicgenForCausalLM(config).eval()
    ids = torch.randint(0, 63, (2 * 4, 6))  # (batch * codebooks, T)
    before = model(input_ids=ids).logits
    heads = phalanx.stack_in_place(model, "lm_heads")
    phalanx.stack_in_place(model, "model.decoder.embed_tokens")
    assert torch.equal(model(input_ids=ids).logits, before)
    hidden = model.model(input_ids=ids).last_hidden_state
    # the one call: (codebooks, B, T, vocab), as the list's stacked outputs
    expected = torch.stack([head(hidden) for head in heads])
    assert_close(heads(hidden), expected)
    model.save_pretrained(tmp_path)
    back = tf.MusicgenForCausalLM.from_pretrained(tmp_path).eval()  # the unstacked class
    assert isinstance(back.lm_heads, nn.ModuleList)
    assert torch.equal(back(input_ids=ids).logits, before)


def test_copies_pickles_checkpoints_and_exports_members(tmp_path):
    import io

    model = _model()
    phalanx.stack_in_place(model, "heads")
    x = torch.randn(B, D * N)
    expected = model(x)
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copied, loaded):
        assert isinstance(other.heads, phalanx.StackedModuleList)
        assert torch.equal(other(x), expected)
        assert list(other.state_dict()) == list(model.state_dict())
    states = phalanx.export_members(model.heads, [2, 5])  # the members' own state dicts
    plain = nn.Sequential(nn.Linear(D, H), nn.Linear(H, 1))
    plain.load_state_dict(states[1])
    assert torch.equal(plain(x[:, :D]), model.heads[5](x[:, :D]))
    opt = phalanx.optim.Adam(model.heads.parameters())
    path = tmp_path / "heads.safetensors"
    phalanx.save(path, model.heads, optimizer=opt)
    with torch.no_grad():
        copied.heads.module[0].weight.zero_()
    assert not torch.equal(copied(x), expected)
    phalanx.load(path, copied.heads, optimizer=phalanx.optim.Adam(copied.heads.parameters()))
    assert torch.equal(copied(x), expected)
