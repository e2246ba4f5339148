"""A stack as one exported graph (torch.export, ONNX in onnxruntime), its outputs the loop's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from helpers import assert_close

N = 3


class Head(nn.Module):
    """Conv, BatchNorm, the classifier head's ``view(x.size(0), -1)``, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.view(h.size(0), -1))


class Pooled(Head):
    """``avg_pool2d``, whose torch.func batching rule fixes the batch under export."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.repeat(1, 1, 2, 2)[:, :, :6, :6].flatten(1))


def _members(cls: type) -> list[nn.Module]:
    members = []
    for i in range(N):
        torch.manual_seed(i)
        m = cls()
        m.bn.running_mean.add_(0.1 * i)  # members differ in their statistics too
        members.append(m.eval())
    return members


def _convolutions(program: torch.export.ExportedProgram) -> int:
    nodes = program.graph.nodes
    return sum(n.op == "call_function" and "conv" in str(n.target) for n in nodes)


def _loop(members: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([m(x) for m in members])


@pytest.mark.parametrize("backend", ["auto", "vmap"])
def test_torch_export_of_a_stack_equals_the_loop(backend):
    members = _members(Head)
    stack = phalanx.stack(copy.deepcopy(members), backend=backend).eval()
    x = torch.randn(5, 1, 8, 8)
    program = torch.export.export(stack, (x,))  # as a user calls it: no phalanx helper
    assert_close(program.module()(x), _loop(members, x), msg="exported outputs")
    # one batched graph: the members' convolutions are one call, not N
    assert _convolutions(program) == 1


def test_export_with_a_dynamic_batch_is_batched_where_torch_allows():
    members = _members(Head)
    stack = phalanx.stack(copy.deepcopy(members)).eval()
    batch = torch.export.Dim("batch", min=2, max=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no hand-over to the loop
        program = phalanx.export(
            stack, (torch.randn(5, 1, 8, 8),), dynamic_shapes={"args": ({0: batch},)}
        )
    x = torch.randn(9, 1, 8, 8)
    assert_close(program.module()(x), _loop(members, x), msg="exported outputs, batch 9")
    assert _convolutions(program) == 1


def test_export_hands_a_dynamic_batch_over_to_the_loop_and_says_so():
    members = _members(Pooled)
    stack = phalanx.stack(copy.deepcopy(members)).eval()
    batch = torch.export.Dim("batch", min=2, max=64)
    with pytest.warns(UserWarning, match=r"loop backend's graph.*exact"):
        program = phalanx.export(
            stack, (torch.randn(5, 1, 8, 8),), dynamic_shapes={"args": ({0: batch},)}
        )
    x = torch.randn(9, 1, 8, 8)
    assert_close(program.module()(x), _loop(members, x), msg="exported outputs, batch 9")
    assert _convolutions(program) == N  # the loop's graph
    assert stack.backend == "fused", "the stack's own backend is kept"


def test_onnx_export_runs_in_onnxruntime_with_another_batch():
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the dev extra")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    members = _members(Head)
    stack = phalanx.stack(copy.deepcopy(members)).eval()
    batch = torch.export.Dim("batch", min=2, max=64)
    program = phalanx.export(
        stack, (torch.randn(5, 1, 8, 8),), dynamic_shapes={"args": ({0: batch},)}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.onnx's own notes
        onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    session = ort.InferenceSession(
        onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    x = torch.randn(7, 1, 8, 8)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert_close(torch.from_numpy(out), _loop(members, x), msg="onnxruntime outputs, batch 7")
