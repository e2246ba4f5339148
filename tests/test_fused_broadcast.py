"""Fused on what Hugging Face decoders and seq2seq models do: a shared ``(1, T)`` tensor (HF's
``position_ids``) broadcast against the batch, and a root module holding a buffer (BART).
Both used to be refused by fused with a message that blamed the member's code; they run
fused now, checked here against the members one by one (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from helpers import assert_close

N, B, T = 4, 5, 12


class Positions(nn.Module):
    """GPT-2's pattern: ``position_ids = arange(T).unsqueeze(0)``, (1, T), added to (B, T, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(50, 16), nn.Embedding(T, 16), nn.Linear(16, 3)
        self.register_buffer("scale", torch.rand(16) + 0.5)  # a buffer on the root, as BART's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # (1, T)
        return self.head((self.wte(ids) + self.wpe(pos)) * self.scale)


def _check(members: list[nn.Module], call) -> None:
    stack = phalanx.stack(members, backend="fused")
    out = call(stack)
    refs = [call(m) for m in members]
    assert_close(out, torch.stack(refs))
    (out**2).sum().backward()
    sum((r**2).sum() for r in refs).backward()
    for name, p in stack.module.named_parameters():
        ref = torch.stack([m.get_parameter(name).grad for m in members])
        assert_close(p.grad, ref, msg=name)
    assert stack.backend == "fused"


def test_a_shared_1_by_t_tensor_and_a_root_buffer_run_fused():
    torch.manual_seed(0)
    members = [Positions() for _ in range(N)]
    ids = torch.randint(0, 50, (B, T))
    _check(members, lambda m: m(ids))


def test_bart_runs_fused():
    tf = pytest.importorskip("transformers")
    config = tf.BartConfig(
        vocab_size=100, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=1,
        decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    members = [tf.BartForConditionalGeneration(config).eval() for _ in range(2)]
    assert list(dict(members[0].named_buffers()))  # BART holds a buffer (final_logits_bias)
    ids = torch.randint(3, 100, (3, 7))
    _check(members, lambda m: m(ids, decoder_input_ids=ids[:, :5]).logits)
