"""What Hugging Face models need from a stack, found by duck typing (transformers is never
imported here): a key/value cache refused up front, and the model's own loss read from its
output (``ModelOutput.loss``, stacked ``(N,)`` by the backends like any other tensor field).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_TAKES_USE_CACHE: dict[type, bool] = {}


def _takes_use_cache(module: nn.Module) -> bool:
    kind = type(module)
    if kind not in _TAKES_USE_CACHE:
        try:
            _TAKES_USE_CACHE[kind] = "use_cache" in inspect.signature(kind.forward).parameters
        except (TypeError, ValueError):
            _TAKES_USE_CACHE[kind] = False
    return _TAKES_USE_CACHE[kind]


def _encoder_only(config: Any) -> bool:
    """True for a config of an encoder (BERT, RoBERTa, ... with ``is_decoder=False``), whose
    forward sets ``use_cache=False`` itself whatever it is given. Decoders' configs (GPT-2,
    Llama) have no ``is_decoder`` field; encoder-decoders set ``is_encoder_decoder``."""
    return getattr(config, "is_decoder", None) is False and not getattr(
        config, "is_encoder_decoder", False
    )


def check_call(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuses a call that would make each member return its own key/value cache.

    A Hugging Face decoder asked for a cache, by its config (``use_cache=True``, GPT-2's, T5's
    and BART's default) or by the call (``use_cache=True`` passed, which overrides the
    config), returns a ``DynamicCache`` per member: Python objects holding each member's keys
    and values, which no backend can stack (phalanx has no stacked KV cache, so no cached
    generation either). An encoder (BERT: ``config.is_decoder=False``) never returns one.
    """
    config = module.__dict__.get("config")  # a plain attribute on Hugging Face models
    if config is None or not _takes_use_cache(module):
        return
    asked = kwargs.get("use_cache")
    use_cache = getattr(config, "use_cache", None) if asked is None else asked
    if use_cache is not True or _encoder_only(config):
        return
    if asked is True:
        why = "the call passes use_cache=True"
        fix = "Pass use_cache=False (or leave it out: the members' config says False)"
        if getattr(config, "use_cache", None) is True:
            fix = "Pass use_cache=False to the call"
    else:
        why = "their config has use_cache=True"
        fix = (
            "Pass use_cache=False to the call, e.g. stack(input_ids, labels=labels, "
            "use_cache=False), or set member.config.use_cache = False on the members before "
            "stacking"
        )
    raise ValueError(
        f"Stack.forward(): the members are {type(module).__name__} models (decoders) and {why}, "
        f"so each would return its own key/value cache, which cannot be stacked (phalanx has "
        f"no stacked KV cache, hence no cached generation). {fix}."
    )


def _refuse_save_pretrained(*args: Any, **kwargs: Any) -> None:
    raise TypeError(
        "stack.module.save_pretrained(): stack.module holds every member's tensors stacked, "
        "(N, *shape), which from_pretrained cannot read. Save a member with "
        "stack.unstack()[i].save_pretrained(path); for a model whose ModuleList of members "
        "must keep its keys, stack the list in place with phalanx.stack_in_place(model, path)."
    )


def guard_stacked(module: nn.Module) -> None:
    """Makes ``save_pretrained`` of a module holding stacked tensors raise instead of writing
    a file of ``(N, ...)`` tensors that ``from_pretrained`` rejects."""
    if callable(getattr(module, "save_pretrained", None)):
        object.__setattr__(module, "save_pretrained", _refuse_save_pretrained)


def own_loss(output: Any, n: int | None, where: str) -> torch.Tensor:
    """The members' own losses, ``(N,)``, from a stacked output holding a ``loss`` field.

    A Hugging Face ``ModelOutput`` (or a dict) with ``loss``, or a tuple whose first element
    is the losses, as models return when given ``labels=``.
    """
    loss = None
    if isinstance(output, Mapping) or hasattr(output, "loss"):
        loss = output.get("loss") if isinstance(output, Mapping) else output.loss
        if loss is None:
            raise ValueError(
                f"{where}: loss_fn=None uses the loss the model computes itself, but its output "
                f"({type(output).__name__}) holds no loss: pass the targets to the model (for "
                f"Hugging Face models labels=...), or give a loss_fn."
            )
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0]
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{where}: loss_fn=None uses the loss the model computes itself, read from the "
            f"output's .loss (or a tuple's first element); the output is a "
            f"{type(output).__name__}. Give a loss_fn, e.g. F.cross_entropy."
        )
    if loss.dim() != 1 or (n is not None and loss.shape[0] != n):
        raise ValueError(
            f"{where}: the model's own loss must be one scalar per member, shape ({n},); got "
            f"{tuple(loss.shape)}. The model must reduce its loss to a scalar (reduction='mean' "
            f"or 'sum')."
        )
    return loss
