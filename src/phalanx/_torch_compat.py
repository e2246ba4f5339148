"""Every private torch API phalanx uses, behind one seam, with the torch it was checked on.

Each function here reads something torch does not expose publicly. They were written against
torch 2.13; where a name is missing in another release the function degrades to the safe
answer (the one that keeps phalanx on its exact general path) rather than failing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# torch's pytree has no public module in 2.13 (torch.utils._pytree is what torch.func and
# torch.compile use themselves).
from torch.autograd import forward_ad as _forward_ad
from torch.nn.modules import module as _nn_module
from torch.utils import _pytree as pytree

__all__ = ["CHECKED_ON", "pytree"]  # and every function below

CHECKED_ON = "2.13"
"""The torch release these functions were read from."""


def transforms_active() -> bool:
    """True inside a ``torch.func`` transform (vmap, grad, jacrev, jvp...).

    ``torch._C._functorch.maybe_current_level`` is None outside every transform.
    """
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return True if level is None else level() is not None


def forward_ad_active() -> bool:
    """True inside ``torch.autograd.forward_ad.dual_level()``."""
    return getattr(_forward_ad, "_current_level", -1) >= 0


def has_tangents(tensors: Iterable[torch.Tensor]) -> bool:
    """True when forward-mode AD is on and one of ``tensors`` carries a tangent."""
    from torch.autograd import forward_ad

    if not forward_ad_active():
        return False
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def global_module_hooks() -> bool:
    """True when a global module hook (``register_module_forward_hook`` ...) is registered."""
    return any(getattr(_nn_module, name, None) for name in _GLOBAL_HOOKS)


def assert_async(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async``: raises on the device (no host sync), traceable."""
    torch._assert_async(condition, message)


def version(t: torch.Tensor) -> int:
    """``Tensor._version``: how often ``t`` was written in place."""
    return t._version


def memory_stamp(t: torch.Tensor) -> tuple[Any, ...]:
    """What a view of ``t`` made now depends on: its memory (data pointer, offset), shape,
    strides, dtype and device. A view kept across calls views what ``t`` holds while ``t`` is
    the same object with the same stamp; ``.data = ...``, ``Module.to``, ``set_`` or a resize
    change it. Values written in place (an optimizer step, ``copy_``) do not."""
    return (t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device)


def is_wrapped(t: torch.Tensor) -> bool:
    """True for a torch.func wrapper (a batched or grad-tracking tensor), False for a plain one."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return True if check is None else bool(check(t))


# ------------------------------------------------------------------------------ module internals
# nn.Module keeps a module's own parameters, buffers and hooks in private dicts; reading them
# is the only way to see a module's own (not its children's) entries including None slots,
# and to swap a tensor in without re-registering it.


def own_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """``module._parameters``: the module's own parameter slots (values may be None)."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """``module._buffers``: the module's own buffer slots (values may be None)."""
    return module._buffers


def own_children(module: torch.nn.Module) -> dict[str, Any]:
    """``module._modules``: the module's own child slots, by name (values may be None)."""
    return module._modules


HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
"""The per-module hook dicts of ``nn.Module`` (register_forward_hook and its siblings)."""


def has_hooks(module: torch.nn.Module) -> bool:
    """True when the module itself holds a hook (checked on every call: no dict is built)."""
    return any(getattr(module, name, None) for name in HOOK_DICTS)


def module_hooks(module: torch.nn.Module) -> dict[str, dict[Any, Any]]:
    """The module's own hooks, by the name of their dict in :data:`HOOK_DICTS`."""
    return {name: getattr(module, name, {}) for name in HOOK_DICTS}


# ------------------------------------------------------------------------------ optimizer ops
# The multi-tensor ("foreach") operations torch.optim is built on, and its fused Adam kernel.
foreach_add = torch._foreach_add
foreach_add_ = torch._foreach_add_
foreach_addcdiv_ = torch._foreach_addcdiv_
foreach_addcmul = torch._foreach_addcmul
foreach_addcmul_ = torch._foreach_addcmul_
foreach_div_ = torch._foreach_div_
foreach_lerp_ = torch._foreach_lerp_
foreach_maximum_ = torch._foreach_maximum_
foreach_mul = torch._foreach_mul
foreach_mul_ = torch._foreach_mul_
foreach_neg = torch._foreach_neg
foreach_sqrt = torch._foreach_sqrt
fused_adam_ = torch._fused_adam_
fused_adamw_ = torch._fused_adamw_
fused_sgd_ = torch._fused_sgd_


# --------------------------------------------------------------------------- the captured step


def make_fx(fn: Any, *, fake: bool = False) -> Any:
    """``torch.fx.experimental.proxy_tensor.make_fx``: traces ``fn`` into one aten graph.

    With ``fake``, on fake tensors (shapes without values), as ``torch.compile`` traces: code
    that reads a value only when it is not traced (Hugging Face's ``is_tracing()`` checks,
    e.g. GPT-2's search for packed sequences) takes its traceable path, where a trace with
    real tensors fails on the value. Tensors the step holds as constants stay real
    (``_allow_non_fake_inputs``). Without it, on the real tensors: the graph inductor then
    compiles was measured faster (W1's captured step 1.34 ms against 3.33 ms fake).
    """
    from torch.fx.experimental.proxy_tensor import make_fx as trace

    if fake:
        return trace(fn, tracing_mode="fake", _allow_non_fake_inputs=True)
    return trace(fn)


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """``torch._inductor.list_mode_options``: the inductor options a torch.compile mode sets."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def inductor_compile(graph: Any, example_inputs: Any, options: dict[str, Any]) -> Any:
    """``torch._inductor.compile_fx.compile_fx``: compiles a traced aten graph directly, without
    TorchDynamo's frame evaluation and guards (half of a tiny step's time)."""
    import warnings

    with warnings.catch_warnings():
        # Importing it imports torch.utils.mkldnn, which uses the deprecated
        # torch.jit.script_method: torch's own warning, not the user's concern.
        warnings.filterwarnings("ignore", "`torch.jit.script_method`")
        from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # Inductor's on-disk caches (the FX graph cache, AOTAutograd's) key a graph with the
    # tracing context's ShapeEnv and bypass it without one ("No shape env"): compile_fx
    # called alone makes a fake mode without one, so every run compiled afresh (a minute on
    # a small CPU). A ShapeEnv of our own, with no symbols (the graph's shapes are static),
    # makes a second run of the same step a cache hit.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    if _vec_isa_probed():
        options = {**options, "cpp.vec_isa_ok": True}
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        return compile_fx(graph, example_inputs, config_patches=options)


def _vec_isa_probed() -> bool:
    """Whether this machine's CPU vector ISAs are known to build and load, so inductor may
    skip its probe (``cpp.vec_isa_ok``).

    Inductor probes each ISA the CPU reports once per process, compiling a test library
    and loading it in a child Python (``torch._inductor.cpu_vec_isa.VecISA.check_build``):
    seconds on a loaded machine, paid even when every kernel comes from the on-disk cache.
    The first process probes and, where every ISA the CPU reports passed, records that in
    inductor's cache folder (keyed by torch's version, the compiler and the CPU's flags); later
    processes skip the probe. The option is part of inductor's cache key, so it is set in the
    first process too, once its probe has passed. False (probe as torch does) off x86 and
    wherever an ISA the CPU reports failed."""
    import os
    import platform

    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        if platform.machine() not in ("x86_64", "AMD64") or os.getenv("TORCHINDUCTOR_VEC_ISA_OK"):
            return False
        flags = cpu_vec_isa.x86_isa_checker()
        reported = [
            str(isa)
            for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())
        ]
        key = f"torch {torch.__version__}; {get_cpp_compiler()}; {' '.join(sorted(flags))}; {reported}"
        marker = os.path.join(cache_dir(), "phalanx_vec_isa_ok")
        if os.path.exists(marker):
            with open(marker) as f:
                if f.read() == key:
                    return True
        if [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] != reported:  # the probe
            return False
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        temporary = f"{marker}.{os.getpid()}"
        with open(temporary, "w") as f:
            f.write(key)
        os.replace(temporary, marker)
        return True
    except Exception:  # a torch without these internals: probe as torch does
        return False


def inductor_cache_dir() -> str | None:
    """``torch._inductor.runtime.cache_dir_utils.cache_dir``: inductor's on-disk cache folder
    (``TORCHINDUCTOR_CACHE_DIR``), or None in a torch without it."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return None
    return str(cache_dir())


def dynamo_backend(name: Any) -> Any:
    """``torch._dynamo.lookup_backend``: the compiler torch.compile(backend=name) would use."""
    from torch._dynamo import lookup_backend

    return lookup_backend(name)


def mark_static_address(t: torch.Tensor) -> None:
    """``torch._dynamo.mark_static_address``: tells CUDA graphs ``t`` never moves."""
    torch._dynamo.mark_static_address(t)


def is_static_address(t: torch.Tensor) -> bool:
    """Whether ``mark_static_address`` marked ``t`` (the attribute it sets on the tensor)."""
    return hasattr(t, "_dynamo_static_input_type")


# ------------------------------------------------------------------------------ distributed


def default_store() -> Any:
    """``torch.distributed.distributed_c10d._get_default_store()``: the default process
    group's key-value store, or None where this torch has none to give."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def tracing() -> bool:
    """True while ``torch.compile`` or ``make_fx`` traces (tensors have no values to read).

    ``proxy_tensor.get_proxy_mode()`` is the mode ``make_fx`` installs (``phalanx.compile_step``
    traces with it); where it is missing, False: the caller then reads values, as eagerly.
    """
    if torch.compiler.is_compiling():
        return True
    from torch.fx.experimental import proxy_tensor

    get = getattr(proxy_tensor, "get_proxy_mode", None)
    return get is not None and get() is not None


def realized(t: torch.Tensor) -> torch.Tensor:
    """``t``; under a trace of CPU tensors, marked so that inductor computes it into a buffer
    once rather than into every element of its consumers.

    Inductor inlines a pointwise producer that looks cheap into each consumer: a per-member
    ``beta ** step`` broadcast over a member's rows was computed again for every 16 elements
    (an Adam step on (400, 200): 318 us inlined, 73 us with the value kept). The mark is
    ``prims.inductor_force_stride_order`` with ``t``'s own strides: the same values, and an
    identity for other backends (``aot_eager`` runs the prim's eager form)."""
    if t.device.type != "cpu" or not tracing():
        return t
    try:
        import torch._inductor.inductor_prims  # registers the prim

        force = torch.ops.prims.inductor_force_stride_order
    except (ImportError, AttributeError):
        return t
    return force(t, t.stride())


def checkpoint_site(frame: Any) -> tuple[str, Any] | None:
    """Where a saved-tensor pack hook was called from, if ``torch.utils.checkpoint`` saved.

    Returns ``("frame", _CheckpointFrame)`` when the non-reentrant checkpoint saves its
    inputs (``_CheckpointFrame.save_inputs``, from a list comprehension: its frame or the one
    above), ``("reentrant", None)`` when ``CheckpointFunction`` saves them through
    ``Function.apply``, else None. Without these names (another torch) it returns None.
    """
    from torch.autograd.function import Function
    from torch.utils import checkpoint as cp

    save = getattr(getattr(cp, "_CheckpointFrame", None), "save_inputs", None)
    code = getattr(save, "__code__", None)
    for f in (frame, frame.f_back):
        if f is not None and f.f_code is code:
            return "frame", f.f_locals["self"]
    apply = getattr(Function.apply, "__func__", None)
    if (
        apply is not None
        and frame.f_code is apply.__code__
        and frame.f_locals.get("cls") is getattr(cp, "CheckpointFunction", None)
    ):
        return "reentrant", None
    return None


def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """The context ``torch.func.functional_call`` runs a module in: ``tensors`` swapped in
    by name (ties kept), put back on exit. ``torch.nn.utils.stateless._reparametrize_module``."""
    from torch.nn.utils import stateless

    return stateless._reparametrize_module(module, tensors, tie_weights=True)


def vmap_rule_inline(func: Any, rule: Any, args: tuple) -> Any:
    """Runs a batching rule where an ``autograd.Function``'s vmap staticmethod would run,
    without the Function: what ``torch._functorch.autograd_function``'s vmap helper does.

    For ``torch.export`` only: in torch 2.13 its pre-dispatch tracer has no rule for the
    ``custom_function_call`` operator that a Function becomes under vmap ("Current active
    mode ProxyTorchDispatchMode not registered"). ``rule(batch_size, in_dims, *args)``
    returns ``(outputs, out_dims)`` on the unwrapped tensors, like the staticmethod; ``func``
    runs where nothing is batched at this level. Returns None outside a vmap level.
    """
    from torch._C._functorch import TransformType, is_batchedtensor, maybe_get_level
    from torch._functorch import predispatch  # the forms torch.export traces
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    if torch._C._functorch.maybe_current_level() is None:
        return None
    interpreter = retrieve_current_functorch_interpreter()
    if interpreter.key() != TransformType.Vmap:
        return None
    level, n = interpreter.level(), interpreter.batch_size()  # type: ignore[attr-defined]
    # The traced values are the batched tensors themselves: unwrap through the traced
    # _remove_batch_dim (the batch moved to dim 0), not torch._C's untraced unwrap.
    batched = [
        isinstance(a, torch.Tensor) and is_batchedtensor(a) and maybe_get_level(a) == level
        for a in args
    ]
    unwrapped = tuple(
        predispatch._remove_batch_dim(a, level, n, 0) if b else a for a, b in zip(args, batched)
    )
    in_dims = tuple(0 if b else None for b in batched)
    with interpreter.lower():
        if all(d is None for d in in_dims):
            return func(*args)
        out, out_dims = rule(n, in_dims, *unwrapped)

    def wrap(o: Any, d: int | None) -> Any:  # batch first: relu of a bdim-1 wrapper leaks
        # an untraced tensor into the exported graph (torch 2.13)
        if d is None or not isinstance(o, torch.Tensor):
            return o
        return predispatch._add_batch_dim(o.movedim(d, 0), 0, level)

    if isinstance(out, torch.Tensor):
        return wrap(out, out_dims)
    return tuple(wrap(o, d) for o, d in zip(out, out_dims))


def unwrapped_member_first(t: Any) -> torch.Tensor | None:
    """Under ``torch.export``: a tensor batched at the current vmap level, unwrapped with its
    member axis first through the traced ``_remove_batch_dim``; None for any other value."""
    from torch._C._functorch import is_batchedtensor, maybe_get_level
    from torch._functorch import predispatch
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    if torch._C._functorch.maybe_current_level() is None:
        return None
    interpreter = retrieve_current_functorch_interpreter()
    if (
        not isinstance(t, torch.Tensor)
        or not is_batchedtensor(t)
        or maybe_get_level(t) != interpreter.level()
    ):
        return None
    n = interpreter.batch_size()  # type: ignore[attr-defined]
    return predispatch._remove_batch_dim(t, interpreter.level(), n, 0)


def seed_token() -> tuple[Any, ...]:
    """Something that changes whenever the global generators are reseeded.

    ``torch.initial_seed()`` changes when ``torch.manual_seed(k)`` sets another seed; a seed
    equal to the one in force shows in torch's queue of lazy CUDA seeds instead: while CUDA
    is not initialised, each ``torch.manual_seed`` queues a new callback
    (``torch.cuda._lazy_seed_tracker``). With CUDA initialised, the current device's initial
    seed is read instead (a reseed to the same seed is then not seen).
    """
    cuda = torch.cuda
    if cuda.is_initialized():
        return (torch.initial_seed(), cuda.initial_seed())
    tracker = getattr(cuda, "_lazy_seed_tracker", None)
    return (torch.initial_seed(), getattr(tracker, "manual_seed_all_cb", None))


# --------------------------------------------------------------------------- host to device


def from_host(data: Any, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """A tensor on ``device`` made from Python data without making the host wait.

    ``torch.tensor(data, device="cuda")`` copies from pageable memory, a blocking copy that
    waits for the stream; here the data goes through pinned memory and an asynchronous copy
    (torch's caching host allocator keeps the pinned block alive until the copy has run).
    On the CPU (or ``device`` None) it is ``torch.tensor(data, dtype=dtype)``.
    """
    if device is None or device.type != "cuda":
        return torch.tensor(data, dtype=dtype).to(device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
