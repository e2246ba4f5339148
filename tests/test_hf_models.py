"""The Hugging Face models of the real-model suite (BERT, GPT-2, T5, tiny configs) against the
loop over the N original models: outputs, losses, gradients, parameters after Adam steps; and
fused runs them (shared (1, T) position ids, T5's relative-position buckets)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from phalanx_tools.bench import hf_models
from phalanx_tools.bench.real_suite import check_against_loop, row_order_problems

MODELS = {m.name: m for m in hf_models.hf_models()}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(("backend", "mode"), [("auto", "shared"), ("fused", "per-member")])
def test_hugging_face_model_matches_loop(backend, name, mode):
    report = check_against_loop(MODELS[name], backend, 3, mode, steps=2)
    assert not report.problems, "\n".join(report.problems)
    assert report.backend == "fused"  # runs fused: nothing in these models refuses


@pytest.mark.parametrize("name", sorted(MODELS))
def test_row_order_changes_only_rounding(name):
    """The float32 loop's permuted runs (the yardstick) are sound for these models too."""
    problems = row_order_problems(MODELS[name], 3, "shared", steps=2)
    assert not problems, "\n".join(problems)
