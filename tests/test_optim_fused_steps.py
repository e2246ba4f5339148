"""The step counts phalanx hands torch's fused kernels are what torch.optim keeps with fused=True.

torch's CUDA kernels read each step count through a ``float*`` whatever the tensor's dtype: a
float64 count reads as 0 there (an infinite step size, NaN weights on the first step), while
the CPU kernel reads doubles correctly. So the dtype is checked here, on the CPU, against the
one torch.optim itself keeps, with the values: member i's counts equal torch's on member i.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import phalanx


class StepSpy(TorchDispatchMode):
    """Records the ``state_steps`` of every fused Adam/AdamW call (dtype and values)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if "_fused_adam" in str(func):
            steps = args[5] if len(args) > 5 else kwargs["state_steps"]
            self.steps.append([t.clone() for t in steps])
        return func(*args, **kwargs)


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
@pytest.mark.parametrize("member_lr", [False, True], ids=["shared_lr", "member_lr"])
def test_fused_steps_are_torchs_float32_counts_member_by_member(cls, member_lr) -> None:
    n = 3
    params = [nn.Parameter(torch.randn(n, 4, 3)), nn.Parameter(torch.randn(n, 5))]
    lr = torch.tensor([1e-2, 2e-2, 1e-2], dtype=torch.float64) if member_lr else 1e-2
    opt = getattr(phalanx.optim, cls)(params, lr=lr, fused=True)
    refs = [[nn.Parameter(p[i].detach().clone()) for p in params] for i in range(n)]
    ref_opts = [getattr(torch.optim, cls)(r, lr=1e-2, fused=True) for r in refs]
    for t in range(4):
        mask = torch.arange(n) != 1 if t == 2 else None  # member 1 a step behind
        for p in params:
            p.grad = torch.ones_like(p)
        with StepSpy() as spy:
            opt.step(mask=mask)
        for i in range(n):
            if mask is None or mask[i]:
                for r in refs[i]:
                    r.grad = torch.ones_like(r)
                ref_opts[i].step()
        handed = [s for call in spy.steps for s in call]
        assert handed, "the fused kernel was not called"
        theirs = {ref_opts[0].state[r]["step"].dtype for r in refs[0]}
        assert theirs == {torch.float32}  # what torch.optim keeps with fused=True
        assert {s.dtype for s in handed} == theirs, f"step {t}: {[s.dtype for s in handed]}"
        for p in params:  # the kept (N,) counts: torch's, member by member
            kept = opt.state[p]["step"]
            assert kept.dtype == torch.float32
            want = torch.stack([ref_opts[i].state[refs[i][0]]["step"] for i in range(n)])
            assert torch.equal(kept, want), f"step {t}: {kept} != {want}"


def test_fused_steps_stay_float32_through_a_state_dict_of_the_default_mode() -> None:
    """A checkpoint of mode "torch" (float64 counts) loaded into a fused optimizer, and back:
    the counts take the dtype each optimizer's arithmetic reads, with their values."""
    params = [nn.Parameter(torch.randn(2, 3))]
    plain = phalanx.optim.Adam(params, lr=1e-2, mode="torch")
    params[0].grad = torch.ones_like(params[0])
    plain.step()
    fused = phalanx.optim.Adam(params, lr=1e-2, fused=True)
    fused.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert fused.state[params[0]]["step"].dtype == torch.float32
    with StepSpy() as spy:
        fused.step()
    assert [s.dtype for s in spy.steps[0]] == [torch.float32, torch.float32]
    assert [float(s) for s in spy.steps[0]] == [2.0, 2.0]
    plain.load_state_dict(copy.deepcopy(fused.state_dict()))
    assert plain.state[params[0]]["step"].dtype == torch.float64
    assert plain.state[params[0]]["step"].tolist() == [2.0, 2.0]


def test_fused_true_on_a_strided_parameter_counts_in_float32_and_computes_in_float64() -> None:
    """fused=True's fallback (a strided parameter) keeps float32 counts and rounds its bias
    corrections from float64 counts, as mode "torch": the same bits as it."""
    w = nn.Parameter(torch.randn(4, 3, 2).transpose(1, 2))
    ref = nn.Parameter(w.detach().clone())
    opt = phalanx.optim.Adam([w], lr=1e-2, fused=True)
    ref_opt = phalanx.optim.Adam([ref], lr=1e-2, mode="torch")
    for t in range(3):
        w.grad, ref.grad = torch.ones_like(w), torch.ones_like(w)
        if t == 0:
            with pytest.warns(UserWarning, match="not contiguous"):
                opt.step()
        else:
            opt.step()
        ref_opt.step()
    assert opt.state[w]["step"].dtype == torch.float32
    assert torch.equal(w, ref)
