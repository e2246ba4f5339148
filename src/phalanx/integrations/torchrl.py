"""TorchRL / tensordict: a stack as a TensorDict module, and inside TorchRL's ensemble losses.

A stack returns ``(N, B, ...)``; a ``[B]``-batched ``TensorDict`` cannot hold that ("batch
dimension mismatch"). Two ways in, both keeping the member axis where TorchRL keeps it (dim 0,
as its losses' vmapped Q-ensembles return ``[num_qvalue_nets, B]``):

- :class:`TensorDictStack`, a ``tensordict.nn.TensorDictModuleBase``: reads ``in_keys`` from a
  ``[B]`` TensorDict and returns a ``[N, B]`` TensorDict whose dim 0 is named ``"member"``
  (the inputs expanded without copies, the outputs the stack's). A TensorDict that already
  has a leading ``"member"`` dim of size N gives each member its own inputs.
- :func:`loss_members` and :func:`loss_stack`: TorchRL's ensemble losses (``SACLoss``,
  ``REDQLoss``, ``TD3Loss``, ``CrossQLoss``) take their value network as a list of N modules
  and stack the members' parameters themselves (``TensorDict.from_modules``) into
  ``loss.qvalue_network_params``. :func:`loss_members` gives a stack's members as that list;
  :func:`loss_stack` then gives back a :class:`phalanx.Stack` over the loss's own tensors (no
  copy), so phalanx's per-member optimizers, clipping, metrics and exports act on exactly what
  the loss trains. A loss does not accept a stack as one module: it would vmap over the stack's
  member axis again.

Needs ``pip install phalanx[torchrl]`` (``torchrl`` and ``tensordict``).

Example:
    >>> from tensordict import TensorDict
    >>> from phalanx.integrations.torchrl import TensorDictStack
    >>> critics = phalanx.stack(lambda: nn.Linear(6, 1), num_members=5, seed=0)
    >>> module = TensorDictStack(critics, in_keys=["obs_act"], out_keys=["q"])
    >>> out = module(TensorDict({"obs_act": torch.randn(32, 6)}, batch_size=[32]))
    >>> out.batch_size, out.names[0], tuple(out["q"].shape)
    (torch.Size([5, 32]), 'member', (5, 32, 1))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torch import Tensor, nn

from phalanx.core._stack import Stack

__all__ = ["MEMBER_DIM", "TensorDictStack", "loss_members", "loss_stack"]

MEMBER_DIM = "member"
"""The name of the member dim of the TensorDicts that :class:`TensorDictStack` returns."""


class TensorDictStack(TensorDictModuleBase):
    """A stack as a TensorDict module: ``[B]`` in, ``[N, B]`` out, dim 0 named ``"member"``.

    Args:
        stack: the stack, N members; called as ``stack(*inputs)``.
        in_keys: the keys of its inputs, in the order of its forward's arguments.
        out_keys: the keys of its outputs (one per output of the members' forward).

    Shapes:
        A TensorDict of batch ``[*B]`` gives every member the same inputs; one of batch
        ``[N, *B]`` whose dim 0 is named ``"member"`` gives member i the entries ``[i]``. The
        result has batch ``[N, *B]``, names ``["member", ...]``, the outputs ``(N, *B, ...)``
        and the inputs (expanded, not copied, when shared).
    """

    def __init__(self, stack: Stack, in_keys: Sequence[Any], out_keys: Sequence[Any]) -> None:
        super().__init__()
        if not isinstance(stack, Stack):
            raise TypeError(
                f"TensorDictStack: expected a phalanx.Stack, got {type(stack).__name__}; build "
                f"one with phalanx.stack(...), or use tensordict.nn.TensorDictModule for one "
                f"module."
            )
        self.stack = stack
        self.in_keys = list(in_keys)
        self.out_keys = list(out_keys)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        n = self.stack.num_members
        names = list(tensordict.names)
        per_member = bool(names) and names[0] == MEMBER_DIM
        if per_member and tensordict.batch_size[0] != n:
            raise ValueError(
                f"TensorDictStack: the TensorDict's {MEMBER_DIM!r} dim has "
                f"{tensordict.batch_size[0]} entries but the stack has {n} members."
            )
        args = [tensordict.get(k) for k in self.in_keys]
        outs: Any
        if per_member:
            outs = self.stack(*args, in_dims=0)
            result = tensordict
        else:
            outs = self.stack(*args)
            # an expanded TensorDict is read-only: a shallow copy holds the expanded inputs
            result = tensordict.expand(n, *tensordict.batch_size).clone(recurse=False)
            result.names = [MEMBER_DIM, *names]
        if isinstance(outs, Tensor):
            outs = (outs,)
        if len(outs) != len(self.out_keys):
            raise ValueError(
                f"TensorDictStack: the stack returned {len(outs)} outputs for out_keys "
                f"{self.out_keys}; give one key per output."
            )
        for k, v in zip(self.out_keys, outs):
            result.set(k, v)
        return result


def loss_members(
    stack: Stack, in_keys: Sequence[Any], out_keys: Sequence[Any]
) -> list[TensorDictModule]:
    """The stack's N members as TensorDict modules, the list TorchRL's ensemble losses take.

    Pass it as ``qvalue_network=`` with ``num_qvalue_nets=N`` (SACLoss, REDQLoss, TD3Loss,
    CrossQLoss); then :func:`loss_stack` gives the stack over the loss's own parameters.

    Args:
        stack: the stack of critics, N members.
        in_keys, out_keys: as for ``tensordict.nn.TensorDictModule``.

    Returns:
        N ``TensorDictModule``s, member i's a copy of the stack's member i.
    """
    return [
        TensorDictModule(m, in_keys=list(in_keys), out_keys=list(out_keys)) for m in stack.unstack()
    ]


def loss_stack(loss: nn.Module, network: str = "qvalue_network", *, backend: str = "auto") -> Stack:
    """A stack over an ensemble loss's own stacked parameters, sharing them (no copy).

    Args:
        loss: a TorchRL loss module built with a list of N value networks (see
            :func:`loss_members`).
        network: the loss's attribute of the network, e.g. ``"qvalue_network"``; its
            parameters are ``loss.<network>_params``.
        backend: the stack's backend.

    Returns:
        A :class:`phalanx.Stack` of N members whose parameters are the loss's tensors: a
        phalanx optimizer on ``stack.parameters()`` steps what the loss differentiates, and
        ``stack(*inputs)`` is the loss's vmapped network.

    Raises:
        TypeError: the loss has no such network or its parameters carry no member dim.
    """
    where = f"phalanx.integrations.torchrl.loss_stack({type(loss).__name__}, {network!r})"
    module = loss.__dict__.get(network)
    params = getattr(loss, f"{network}_params", None)
    if not isinstance(module, TensorDictModule) or params is None:
        raise TypeError(
            f"{where}: the loss has no TensorDictModule {network!r} with stacked parameters "
            f"{network}_params. Build the loss with a list of N networks (qvalue_network="
            f"loss_members(stack, in_keys, out_keys), num_qvalue_nets=N)."
        )
    if params.batch_dims < 1:
        raise TypeError(
            f"{where}: {network}_params has batch size {tuple(params.batch_size)}, no member "
            f"dim: the loss holds one network, not an ensemble. Pass num_qvalue_nets=N and a "
            f"list of N networks."
        )
    n = params.batch_size[0]
    stacked_params: dict[str, Tensor] = {}
    stacked_buffers: dict[str, Tensor] = {}
    for key, value in params.items(include_nested=True, leaves_only=True):
        name = ".".join(key) if isinstance(key, tuple) else key
        if not name.startswith("module."):
            raise TypeError(f"{where}: unexpected parameter {name!r} outside the network's module.")
        into = stacked_params if isinstance(value, nn.Parameter) else stacked_buffers
        into[name.removeprefix("module.")] = value
    stack = Stack.from_stacked(module.module, stacked_params, stacked_buffers, n, backend=backend)
    # from_stacked wraps each tensor in a new nn.Parameter (same storage, but its own .grad):
    # put the loss's Parameter objects in their place, so both accumulate into one gradient.
    for name, p in stacked_params.items():
        owner, _, leaf = name.rpartition(".")
        setattr(stack.module.get_submodule(owner), leaf, p)
    return stack


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
