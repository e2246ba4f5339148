"""Batching rules of phalanx's own: the layers whose cost or correctness torch.func gets wrong.

The ``fused`` and ``vmap`` backends run the member's own ``forward`` under
``torch.func.vmap`` over the member axis, so everything a forward does is per member by
construction: a mean over the batch is each member's mean, ``x[0]`` is each member's first
sample, and turning a member's data into a Python value (``bool``, ``.item()``) raises where
it happens instead of deciding once for all members. On top of that, :class:`BatchedOps`
routes a few functions to batching rules of phalanx's own (``_registry``: what a rule is, the
shell that runs it, the tables), one file per family, each rule registered beside its
definition:

- correctness (both backends): convolutions (``_conv``); dropout with a rate per member
  (``_dropout``); embeddings, embedding bags and
  ``one_hot``, every id checked per member (``_embedding``); BatchNorm with a member's
  arithmetic independent of N (``_norm``); ``grid_sample`` (``_sampling``).
- speed (``fused`` only): Linear (small weights with a per-member input left to torch.func's
  own batching eagerly, measured faster) and bilinear (``_linear``), attention (``_attention``),
  recurrent layers (``_recurrent``), GroupNorm (``_norm``), 2-D max-pooling in the
  channels-last layout (``_pool``).

Every rule hands its outputs back member-first with each member's output laid out as the
function's own (``member_first``): a member's code that branches on ``is_contiguous()`` or
calls ``view`` sees what it sees alone. Where a rule's one flat call would skip a check the
function makes on a member's inputs (ids, offsets, classes, dtypes), it runs member by member
instead, so the member raises its own error.
- export (while ``torch.export`` traces): sizes and reshapes (``_export``).

To add a rule: write it in its family's file (or a new one imported here) as a
:class:`BatchRule` decorated with ``batch_rule(func, names, defaults, table=...)``.
"""

from __future__ import annotations

from phalanx.backends.rules import (  # noqa: F401  (each registers its rules)
    _attention,
    _conv,
    _dropout,
    _embedding,
    _export,
    _index,
    _linear,
    _norm,
    _pool,
    _recurrent,
    _sampling,
)
from phalanx.backends.rules._registry import (
    CORRECTNESS,
    EXPORT,
    SPEED,
    BatchedOps,
    BatchRule,
    Route,
    deferred,
)

__all__ = ["CORRECTNESS", "EXPORT", "SPEED", "BatchRule", "BatchedOps", "Route", "deferred"]
