"""Hugging Face models in the real-model suite: BERT, GPT-2 and T5, tiny configs, random
weights, as ``transformers`` builds them (no download).

They join :data:`phalanx_tools.bench.real_suite.MODELS` when ``transformers`` is importable; when it
is not, :data:`NOTE` says why they are missing. Dropout is 0 (the suite compares the loop and
the stack, whose random streams differ by design) and ``use_cache`` is off (a key/value cache
per member cannot be stacked). BERT and GPT-2 are called as published, ``model(input_ids)``,
and return their ``ModelOutput``; T5 needs its decoder input by keyword, which the suite's
positional batches cannot give, so a three-line wrapper calls it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx_tools.bench.real_suite import Args, RealModel

VOCAB, T, T_DECODER = 1000, 16, 8

NOTE: str | None = None
"""Why the Hugging Face models are missing from the suite, or None."""


def _tokens(b: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(VOCAB, (b, T), generator=g)


def _classify(b: int, g: torch.Generator) -> tuple[Args, Any]:
    return (_tokens(b, g),), torch.randint(3, (b,), generator=g)


def _next_token(b: int, g: torch.Generator) -> tuple[Args, Any]:
    idx = torch.randint(VOCAB, (b, T + 1), generator=g)
    return (idx[:, :-1].contiguous(),), idx[:, 1:].contiguous()


def _translate(b: int, g: torch.Generator) -> tuple[Args, Any]:
    target = torch.randint(1, VOCAB, (b, T_DECODER), generator=g)
    decoder_in = torch.cat([torch.zeros(b, 1, dtype=torch.long), target[:, :-1]], dim=1)
    return (_tokens(b, g), decoder_in), target


def _sequence_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _class_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, target)


class Seq2Seq(nn.Module):
    """``T5ForConditionalGeneration`` called with its decoder input, returning the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits


def hf_models() -> list[RealModel]:
    """The Hugging Face models, or none (with :data:`NOTE` set) without ``transformers``."""
    global NOTE
    try:
        import transformers as tf
    except ImportError as e:
        NOTE = f"the Hugging Face models (BERT, GPT-2, T5) are skipped: {e}"
        return []
    bert = tf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    bert.num_labels = 3  # a PretrainedConfig keyword that the typed signature does not list
    gpt2 = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    t5 = tf.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.0, use_cache=False, pad_token_id=0,
    )  # fmt: skip
    source = "huggingface/transformers src/transformers/models/"
    return [
        RealModel(
            "hf_bert",
            source + "bert/modeling_bert.py (BertForSequenceClassification, tiny config)",
            lambda: tf.BertForSequenceClassification(bert),
            _classify,
            _class_loss,
            batch=16,
            flop_counted=False,
        ),
        RealModel(
            "hf_gpt2",
            source + "gpt2/modeling_gpt2.py (GPT2LMHeadModel, tied lm_head, tiny config)",
            lambda: tf.GPT2LMHeadModel(gpt2),
            _next_token,
            _sequence_loss,
            batch=8,
            flop_counted=False,
        ),
        RealModel(
            "hf_t5",
            source + "t5/modeling_t5.py (T5ForConditionalGeneration, tiny config)",
            lambda: Seq2Seq(tf.T5ForConditionalGeneration(t5)),
            _translate,
            _sequence_loss,
            batch=8,
            flop_counted=False,
        ),
    ]
