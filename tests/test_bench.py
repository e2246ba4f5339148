"""`phalanx bench`: the command runs with its options and its correctness checks bite.

Nothing here asserts a speed: the machine is shared and the figures are noise at --quick.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx import BACKENDS
from phalanx_tools.bench import jax_contender, report
from phalanx_tools.bench.contenders import (
    Contender,
    LoopRunner,
    TorchFuncRunner,
    default_contenders,
)
from phalanx_tools.bench.machine import Machine
from phalanx_tools.bench.suite import Settings, run_phase
from phalanx_tools.bench.timing import interleaved
from phalanx_tools.bench.workloads import WORKLOADS, build, cost
from phalanx_tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
HAS_JAX = jax_contender.missing() is None
CONTENDERS = [
    "loop", "loop+fused", "loop+compile", "torch.func", *(f"phalanx:{b}" for b in BACKENDS),
    "phalanx:auto", "phalanx:compiled", "taught", "taught:eager", *["jax"] * HAS_JAX,
]  # fmt: skip
TRAIN_ONLY = ("loop+compile", "phalanx:compiled", "taught", "taught:eager", "jax")
# The contenders that run W2 and W3 today; "fused" is checked too, but may still be n/a.
WORKING = ["loop", "loop+fused", "loop+compile", "torch.func", "phalanx:vmap", "phalanx:loop",
           "phalanx:auto", "taught", "taught:eager", "jax"]  # fmt: skip
FAKE_MACHINE = Machine("cpu", "cpu", "cpu", 1, "", "", "", 1, 1, 10.0, 1, 10.0)
ONE_ROUND = Settings(rounds=2, min_rounds=2, warmup=0, target_s=0.0, budget_s=0.0)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads mostly wait for each other."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path, str]:
    """One `phalanx bench --quick` on W2 and W3 through the real entry point."""
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = out / "bench.json", out / "bench.png"
    argv = ["bench", "--quick", "--workloads", "W2,W3", "--device", "cpu", "--threads", "1"]
    argv += ["--compile-backend", "aot_eager"]  # the captured step without inductor's minutes
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        rc = main([*argv, "--json", str(json_path), "--plot", str(plot_path)])
    return rc, json.loads(json_path.read_text()), plot_path, stdout.getvalue()


def test_quick_run_checks_and_times_every_contender(quick_run):
    rc, doc, plot_path, printed = quick_run
    wrong = [
        (r["workload"], r["phase"], row["name"])
        for r in doc["results"]
        for row in r["rows"]
        if row["status"] == "WRONG"
    ]
    assert rc == (1 if wrong else 0)
    assert [(r["workload"], r["phase"]) for r in doc["results"]] == [
        ("W2", "forward"),
        ("W2", "train"),
        ("W3", "forward"),
        ("W3", "train"),
    ]
    for result in doc["results"]:
        assert result["flops"] > 0 and result["floor_s"] > 0
        rows = {row["name"]: row for row in result["rows"]}
        train = result["phase"] == "train"
        assert list(rows) == [c for c in CONTENDERS if train or c not in TRAIN_ONLY]
        for name, row in rows.items():
            assert row["status"] in ("ok", "WRONG", "n/a"), name
            if name in WORKING:
                assert row["status"] == "ok", (name, row["reason"])
            if row["status"] == "ok":
                assert row["median_s"] > 0 and row["min_s"] > 0 and row["rounds"] >= 3
                assert row["q1_s"] <= row["median_s"] <= row["q3_s"]
                assert row["gflops"] > 0 and row["vs_loop"] > 0 and row["vs_torch_func"] > 0
            else:
                assert row["median_s"] is None and row["rounds"] == 0 and row["reason"]
        assert rows["loop"]["vs_loop"] == 1.0
        assert rows["phalanx:auto"]["note"].startswith("picked ")
        if train:  # the captured step: checked against the loop, timed, its choice said
            compiled = rows["phalanx:compiled"]
            assert compiled["status"] == "ok", compiled["reason"]
            assert compiled["compile_s"] > 0
            assert compiled["note"].startswith(("eager: eager step", "captured: eager step"))
            # the README tour's step, captured and eager, with the compile seconds
            assert rows["taught"]["compile_s"] > 0 and rows["taught"]["vs_torch_func"] > 0
            assert rows["taught:eager"]["note"].startswith("eager step, backend ")
        if train and HAS_JAX:  # JAX's jit(vmap(step)): checked against the loop, timed
            assert rows["jax"]["compile_s"] > 0 and rows["jax"]["vs_loop"] > 0
    assert doc["machine"]["gemm_gflops"] > 0 and doc["machine"]["bandwidth_gbs"] > 0
    jax_line = "captured / jax" if HAS_JAX else "jax        contender skipped: "
    assert jax_line in printed
    assert plot_path.stat().st_size > 10_000
    assert printed.startswith("$ phalanx bench --workloads W2,W3 --device cpu --quick --threads 1")
    assert "torch 2" in printed and "1 intra-op thread\n" in printed
    assert "GFLOP/s" in printed and "Summary" in printed
    assert "The taught path (the README tour" in printed


def test_benchmarks_page_renders_from_a_run(quick_run):
    spec = importlib.util.spec_from_file_location(
        "write_benchmarks_md", ROOT / "benchmarks" / "write_benchmarks_md.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, doc, _, printed = quick_run
    page = module.render(doc, printed=printed, plot_name="b.png", revision="abc", date="today")
    assert "$ phalanx bench --workloads W2,W3" in page and "measured   fp32 GEMM" in page
    assert "| W3 | train |" in page and "![Speed-ups over the Python loop](b.png)" in page


class _ScaledOutput(LoopRunner):
    """Off by 1% in the forward pass."""

    def forward(self) -> torch.Tensor:
        return super().forward() * 1.01


class _MeanOverMembers(TorchFuncRunner):
    """The classic bug: mean over members, so every gradient is N times too small."""

    def backward(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        losses = torch.func.vmap(self._member_loss, in_dims=(0, 0, self.x_dim, self.t_dim))(
            self.params, self.buffers, self.x, self.t
        )
        losses.mean().backward()
        return losses.detach()


class _TwoSteps(LoopRunner):
    """A whole-step contender (no gradients to compare) that steps twice."""

    whole_step = True

    def backward(self) -> torch.Tensor:
        losses = super().backward()
        self.optimizer.step()
        super().backward()
        return losses


class _Raises(LoopRunner):
    def forward(self) -> torch.Tensor:
        raise NotImplementedError("this architecture is not supported")

    def backward(self) -> torch.Tensor:
        raise NotImplementedError("this architecture is not supported")


@pytest.mark.parametrize(
    ("phase", "wrong", "reason"),
    [
        ("forward", _ScaledOutput, "forward output"),
        ("train", _MeanOverMembers, "gradient of '0.weight'"),
        ("train", _TwoSteps, "'0.weight' after one Adam step"),
    ],
)
def test_wrong_contender_is_flagged_and_not_timed(phase, wrong, reason):
    workload = WORKLOADS["W2"]
    members, data = build(workload, device="cpu")
    contenders = [
        Contender("loop", "baseline", LoopRunner),
        Contender("wrong", "phalanx", wrong),
        Contender("raises", "phalanx", _Raises),
        Contender("torch.func", "baseline", TorchFuncRunner),
    ]
    result = run_phase(
        workload,
        phase,
        members,
        data,
        contenders,
        device=torch.device("cpu"),
        settings=ONE_ROUND,
        machine=FAKE_MACHINE,
    )
    rows = {row.name: row for row in result.rows}
    assert rows["wrong"].status == "WRONG"
    assert rows["wrong"].reason.startswith(reason)
    assert rows["raises"].status == "n/a"
    assert rows["raises"].reason == "NotImplementedError: this architecture is not supported"
    for name in ("wrong", "raises"):
        assert rows[name].median_s is None and rows[name].rounds == 0
    assert rows["torch.func"].status == "ok" and rows["torch.func"].rounds == 2
    assert report.problems([result]) == [f"W2 {phase}: wrong is WRONG: {rows['wrong'].reason}"]
    assert "WRONG" in report.format_text([result])


def test_rounds_interleave_every_contender():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = interleaved(
        fns,
        device=torch.device("cpu"),
        rounds=4,
        min_rounds=4,
        warmup=1,
        target_s=0.0,
        budget_s=0.0,
    )
    timed = calls[6:]  # after one warm-up and one calibration call each
    rounds = [timed[i : i + 3] for i in range(0, 12, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert [r[0] for r in rounds] == ["a", "b", "c", "a"]  # the order rotates
    assert all(len(t.samples) == 4 and t.median > 0 for t in timings.values())


def test_flops_are_counted_from_the_layers():
    assert cost(WORKLOADS["W1"]).flops == 2 * (20 * 10 + 10 * 1) * 32 * 400
    conv = 2 * 1 * 9 * 16 * 26 * 26 + 2 * 16 * 9 * 32 * 11 * 11
    assert cost(WORKLOADS["W7"]).flops == (conv + 2 * 800 * 10) * 64 * 16
    w4 = cost(WORKLOADS["W4"])
    assert w4.params == 32 * (784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10)
    assert w4.for_phase("train")[0] == 3 * w4.flops


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_cuda_without_gpu_fails_clearly(capsys):
    assert main(["bench", "--device", "cuda", "--quick", "--workloads", "W2"]) == 2
    assert "--device cuda, but no CUDA GPU is usable here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workloads", "W2,W9"], "--workloads 'W2,W9': unknown 'W9'; choose from W1, W2"),
        (["--phases", "backward"], "--phases 'backward': unknown 'backward'; choose from forward"),
        (["--procs", "0"], "--procs 0: give a number of processes >= 1"),
    ],
)
def test_bad_options_fail_clearly(capsys, argv, message):
    assert main(["bench", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_procs_hands_over_to_the_sharded_bench(capsys, monkeypatch):
    from phalanx_tools.bench import sharded

    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return [{"workload": "W1", "phase": "forward", "procs": 2, "ratio": 1.5}]

    monkeypatch.setattr(sharded, "bench_sharded", fake, raising=False)
    assert main(["bench", "--procs", "2", "--device", "cpu", "--workloads", "W1", "--quick"]) == 0
    assert seen == {"workloads": ["W1"], "procs": 2, "quick": True, "device": "cpu"}
    assert "W1        forward  2      1.5" in capsys.readouterr().out

    monkeypatch.delattr(sharded, "bench_sharded")
    assert main(["bench", "--procs", "2", "--device", "cpu", "--workloads", "W1"]) == 2
    assert "--procs needs phalanx_tools.bench.sharded" in capsys.readouterr().err


def test_a_failing_reference_stops_the_bench():
    workload = WORKLOADS["W2"]
    members, data = build(workload, device="cpu")
    contenders = [
        Contender("loop", "baseline", _Raises),
        Contender("torch.func", "baseline", TorchFuncRunner),
    ]
    with pytest.raises(RuntimeError, match="the reference 'loop' failed: NotImplementedError"):
        run_phase(
            workload,
            "forward",
            members,
            data,
            contenders,
            device=torch.device("cpu"),
            settings=ONE_ROUND,
            machine=FAKE_MACHINE,
        )


def test_dynamic_measures_the_float32_loops_own_distance_from_float64():
    """W8-style agreement: the stack's weights after the run are no further from a float64
    loop on the same run than the float32 loop is (rounding growth, not a difference)."""
    from phalanx_tools.bench import dynamic

    r = dynamic.run_one(dynamic.DYNAMIC["D3"], epochs=1)
    assert 0 < r["loop_from_float64"] < 1e-3
    assert r["phalanx_from_float64"] <= phalanx.testing.FACTOR * r["loop_from_float64"]
    # phalanx.optim.Adam(fused=True), the loop's own fused kernel: as close as the loop
    assert r["phalanx_fused_adam_from_float64"] <= phalanx.testing.FACTOR * r["loop_from_float64"]
    assert r["epochs"][0]["fused_adam_speedup"] > 0


class _JaxTwoSteps(jax_contender.JaxRunner):
    """JAX's step run twice per call: the weights after "one step" are two steps on."""

    def backward(self) -> torch.Tensor:
        losses = super().backward()
        super().backward()
        return losses


@pytest.mark.skipif(not HAS_JAX, reason="jax and optax are not installed")
@pytest.mark.parametrize("workload_id", ["W1", "W3"])  # sliced and per-member inputs
def test_jax_contender_is_checked_against_the_loop(workload_id):
    workload = WORKLOADS[workload_id]
    members, data = build(workload, device="cpu")
    contenders = [
        Contender("loop", "baseline", LoopRunner),
        Contender("jax", "baseline", jax_contender.JaxRunner, train_only=True),
        Contender("jax twice", "baseline", _JaxTwoSteps, train_only=True),
    ]
    result = run_phase(
        workload, "train", members, data, contenders, device=torch.device("cpu"),
        settings=ONE_ROUND, machine=FAKE_MACHINE,
    )  # fmt: skip
    rows = {row.name: row for row in result.rows}
    assert rows["jax"].status == "ok", rows["jax"].reason
    assert rows["jax"].rounds == 2 and rows["jax"].compile_s > 0
    assert rows["jax twice"].status == "WRONG"
    assert rows["jax twice"].reason.startswith("'0.weight' after one Adam step")
    (line,) = report._jax_rows([result])  # no phalanx:compiled row here: no ratio
    assert line[0] == workload_id and line[1] == "-" and line[3] == "-"
    assert "captured / jax" in report.format_text([result])
    assert "| jax |" in report.format_markdown([result])


@pytest.mark.skipif(not HAS_JAX, reason="jax and optax are not installed")
def test_jax_contender_names_the_layer_it_cannot_translate():
    workload = WORKLOADS["W7"]
    members, data = build(workload, device="cpu")
    with pytest.raises(NotImplementedError, match="no translation of Conv2d \\(layer '0'\\)"):
        jax_contender.JaxRunner(members[:2], data, workload)


def test_without_jax_the_contender_is_skipped_and_says_so(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a)
    )
    assert jax_contender.missing() == (
        "jax        contender skipped: jax not installed "
        "(pip install 'phalanx[bench]' or pip install jax optax)"
    )
    assert "jax" not in [c.name for c in default_contenders()]


@pytest.mark.skipif(not HAS_JAX, reason="jax and optax are not installed")
def test_a_jax_that_does_not_start_is_said_in_the_header(monkeypatch):
    import jax

    def broken() -> str:
        raise RuntimeError("Unable to initialize backend 'cpu'\nmore")

    monkeypatch.setattr(jax, "default_backend", broken)
    assert jax_contender.describe() == (
        "jax        jax is installed but does not start (Unable to initialize backend 'cpu'): "
        "its rows are n/a"
    )


def test_several_thread_counts_run_the_bench_once_each(monkeypatch, capsys):
    import argparse

    from phalanx_tools.bench import cli as bench_cli

    assert bench_cli._thread_counts("2") == 2 and bench_cli._thread_counts("1,2") == [1, 2]
    with pytest.raises(argparse.ArgumentTypeError, match="several separated by commas"):
        bench_cli._thread_counts("one")
    seen = []
    monkeypatch.setattr(bench_cli, "run", lambda a: seen.append((a.threads, a.json)) or len(seen))
    args = argparse.Namespace(threads=[1, 2], json="out/bench.json", plot=None)
    assert bench_cli._each_thread_count(args) == 2
    assert seen == [(1, "out/bench.threads1.json"), (2, "out/bench.threads2.json")]
    assert "=== --threads 2" in capsys.readouterr().out
