"""A counter of the calls that make the host wait for a GPU, run on CPU tensors.

Within ``counting()``, a ``TorchFunctionMode`` and a ``TorchDispatchMode`` record every call
that would, with the tensors on a GPU, stall the host:

- syncs: Python reads of a tensor's value (``bool()``, ``float()``, ``int()``, ``__index__``,
  ``.item()``, ``.tolist()``, ``.numpy()``, ``torch.equal``, ``.nonzero()``, printing) and,
  when not inside one of those, the aten ops whose output shape or value the host needs
  (``_local_scalar_dense``, ``is_nonzero``, ``equal``, ``nonzero``, ``masked_select``,
  ``unique``, ``bincount``, ``repeat_interleave(Tensor)``, indexing with a bool mask);
- blocking copies: a tensor made from Python data straight onto a device
  (``torch.tensor(data, device=...)``, ``torch.as_tensor(data, device=...)``: on CUDA a copy
  from pageable memory that waits for the stream) and ``.cpu()``.

A read of a tensor that lives on the host on a GPU (a pinned copy that has arrived) counts
too: on the CPU the counter cannot tell the two apart, so such a read is budgeted as one.
Each event is recorded with the innermost frame in ``src/phalanx`` (else the test's), so a
failing budget says where the sync is. Derived from ``shared/repro/gpu/sync_count.py``.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_PY_SYNC = {
    "TensorBase.__bool__": "bool()",
    "TensorBase.__float__": "float()",
    "TensorBase.__int__": "int()",
    "TensorBase.__index__": "index()",
    "TensorBase.item": ".item()",
    "TensorBase.tolist": ".tolist()",
    "TensorBase.numpy": ".numpy()",
    "_VariableFunctionsClass.equal": "torch.equal",
    "TensorBase.equal": "torch.equal",
    "TensorBase.nonzero": "nonzero",
    "_VariableFunctionsClass.nonzero": "nonzero",
    "Tensor.__repr__": "print",
    "Tensor.__format__": "print",
    "Tensor.__str__": "print",
}
_PY_COPY = {"_VariableFunctionsClass.tensor", "_VariableFunctionsClass.as_tensor"}
_ATEN_SYNC = (
    "aten._local_scalar_dense",
    "aten.item",
    "aten.is_nonzero",
    "aten.equal",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique",
    "aten.unique",
    "aten.bincount",
    "aten.repeat_interleave.Tensor",
)
_SRC = os.sep + "src" + os.sep + "phalanx" + os.sep


def _where() -> str:
    """The innermost frame in src/phalanx as ``phalanx/...:line``, else the innermost test's."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        i = f.filename.rfind(_SRC)
        if i >= 0:
            return f"{f.filename[i + len(os.sep + 'src' + os.sep) :]}:{f.lineno}"
    for f in reversed(frames):
        if os.sep + "tests" + os.sep in f.filename and "sync_counter" not in f.filename:
            return f"{os.path.basename(f.filename)}:{f.lineno}"
    return "?"


class Counts:
    """What ``counting`` saw: ``syncs`` and ``copies`` as Counters of ``(kind, where)``."""

    def __init__(self) -> None:
        self.syncs: Counter[tuple[str, str]] = Counter()
        self.copies: Counter[tuple[str, str]] = Counter()
        self._depth = 0

    def total(self, what: str = "syncs", *, outside: str | None = None) -> int:
        """How many syncs (or copies), optionally only those not attributed under ``outside``
        (a path prefix such as ``phalanx/optim/``)."""
        events = self.syncs if what == "syncs" else self.copies
        return sum(n for (_, at), n in events.items() if outside is None or outside not in at)

    def describe(self) -> str:
        rows = [f"sync {n}x {k} @ {at}" for (k, at), n in sorted(self.syncs.items())]
        rows += [f"copy {n}x {k} @ {at}" for (k, at), n in sorted(self.copies.items())]
        return "; ".join(rows) or "none"


class _Counting:
    """A mode that writes what it sees into one :class:`Counts`."""

    def __init__(self, c: Counts) -> None:
        super().__init__()
        self.c = c


class _Functions(_Counting, TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__qualname__", str(func))
        c = self.c
        if c._depth == 0:
            if name in _PY_SYNC:
                c.syncs[(_PY_SYNC[name], _where())] += 1
                c._depth += 1
                try:
                    return func(*args, **kwargs)
                finally:
                    c._depth -= 1
            if name in _PY_COPY and args and not isinstance(args[0], torch.Tensor):
                if kwargs.get("device") is not None:
                    c.copies[(f"{name.split('.')[-1]}(data, device=)", _where())] += 1
            elif name == "TensorBase.cpu":
                c.copies[(".cpu()", _where())] += 1
        return func(*args, **kwargs)


class _Dispatch(_Counting, TorchDispatchMode):
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        c = self.c
        if c._depth == 0:
            name = str(func)
            hit = None
            if name.startswith(_ATEN_SYNC):
                hit = name
            elif name.startswith(("aten.index.Tensor", "aten.index_put")):
                index = args[1] if len(args) > 1 else ()
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index or ()):
                    hit = name + "(bool mask)"
            if hit is not None:
                c.syncs[(hit, _where())] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    """Counts host syncs and blocking copies of the code run inside it."""
    c = Counts()
    with _Functions(c), _Dispatch(c):
        yield c
