"""``phalanx bench``: the benchmark table, against the loop, torch.func and the machine."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence

import torch

from phalanx_tools.bench import jax_contender
from phalanx_tools.bench.contenders import default_contenders, phalanx_adam
from phalanx_tools.bench.machine import BUSY, measure
from phalanx_tools.bench.report import format_text, plot, problems, text_table, write_json
from phalanx_tools.bench.suite import FULL, PHASES, QUICK, run_suite
from phalanx_tools.bench.workloads import WORKLOADS
from phalanx_tools.threads import intra_op_threads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``phalanx bench``'s options to ``parser``."""
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated workload ids, e.g. W1,W4 (default: all of "
        + ", ".join(f"{w.id} {w.what}" for w in WORKLOADS.values())
        + ")",
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="comma-separated phases: forward (no grad) and/or train (forward, per-member "
        "loss, backward, Adam step); default: both",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where to run (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="few rounds and short samples: minutes become seconds"
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="also draw the speed-ups over the loop to FILE.png"
    )
    parser.add_argument(
        "--procs",
        type=int,
        metavar="K",
        help="shard the members over K processes (the sharded benchmark, phalanx_tools.bench.sharded)",
    )
    parser.add_argument(
        "--threads",
        type=_thread_counts,
        metavar="T",
        help="torch intra-op threads (default: torch's choice). On a machine that other "
        "processes share, --threads 1 avoids threads waiting for each other's cores. "
        "Several counts, --threads 1,2, run the whole benchmark once per count, one table "
        "each (batched kernels spread over cores where the loop's small GEMMs do not)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument(
        "--real",
        action="store_true",
        help="time the real-model suite instead (the model classes of tests/zoo, copied from "
        "public code, and Hugging Face's BERT, GPT-2 and T5 when transformers is installed; "
        "each checked against the loop first); with --members N (default 16), --threads, "
        "--quick, --json and --workloads td3_critic,vae,... (a subset of the models)",
    )
    parser.add_argument("--members", type=int, default=16, help="N for --real")
    parser.add_argument(
        "--dynamic",
        action="store_true",
        help="time the dynamic-shape workloads instead (W8 text with a new length each step, "
        "GRU windows of varying length, a short last batch): the default path against the "
        "fused-Adam loop over the first epoch and in steady state; with --threads, --json, "
        "--memory (the first step's peak memory, each in a fresh process)",
    )
    parser.add_argument("--memory", action="store_true", help="with --dynamic: peak memory too")
    parser.add_argument(
        "--routed",
        action="store_true",
        help="time the routed-member workloads instead (a Mixtral MoE layer, PETS trajectory "
        "sampling, KiloNeRF, REDQ's target subset) against the loops they replace; with "
        "--threads, --quick, --json and --workloads moe,pets,kilonerf,redq",
    )
    parser.add_argument(
        "--optimizer",
        action="store_true",
        help="time one optimizer step instead (phalanx_tools.bench.optimizer): a 16-member "
        "embedding table, W4's MLP and N tiny members, Adam and SGD, against torch's fused "
        "kernel over the loop's tensors and on the stacked tensors; with --threads, --quick "
        "and --json",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        metavar="NAME",
        help="torch.compile backend of the phalanx:compiled contender (default: inductor; "
        "aot_eager checks the captured step without generating code, in seconds)",
    )


def _parse_list(text: str, allowed: Sequence[str], option: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in items if s not in allowed]
    if unknown or not items:
        raise ValueError(
            f"{option} {text!r}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
            f"choose from {', '.join(allowed)}, comma-separated."
        )
    return list(dict.fromkeys(items))


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device cuda, but no CUDA GPU is usable here: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}). Run "
            f"on a machine with a GPU and a CUDA build of torch, or use --device cpu."
        )
    return torch.device(name)


@contextlib.contextmanager
def _exact_fp32() -> Iterator[None]:
    """TF32 off: the checks compare float32 results and the peak is the fp32 GEMM's."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _thread_counts(text: str) -> int | list[int]:
    """``--threads``: one count, or several (``1,2``), each a run of its own."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of threads, or several separated by commas (1,2)"
        ) from None
    return counts[0] if len(counts) == 1 else counts


def _each_thread_count(args: argparse.Namespace) -> int:
    """``run`` once per ``--threads`` count, the JSON file suffixed with the count."""
    rc = 0
    for count in args.threads:
        one = argparse.Namespace(**vars(args))
        one.threads = count
        if args.json:
            stem, dot, ext = str(args.json).rpartition(".")
            one.json = f"{stem}.threads{count}.{ext}" if dot else f"{args.json}.threads{count}"
        if args.plot:
            stem, dot, ext = str(args.plot).rpartition(".")
            one.plot = f"{stem}.threads{count}.{ext}" if dot else f"{args.plot}.threads{count}"
        print(f"=== --threads {count}", flush=True)
        rc = max(rc, run(one))
    return rc


def _command(args: argparse.Namespace, workloads: list[str], phases: list[str]) -> str:
    parts = ["phalanx bench"]
    if workloads != list(WORKLOADS):
        parts.append(f"--workloads {','.join(workloads)}")
    if phases != list(PHASES):
        parts.append(f"--phases {','.join(phases)}")
    parts += [f"--device {args.device}"] if args.device else []
    parts += ["--quick"] if args.quick else []
    parts += [f"--threads {args.threads}"] if args.threads else []
    parts += [f"--seed {args.seed}"] if args.seed else []
    if args.compile_backend != "inductor":
        parts.append(f"--compile-backend {args.compile_backend}")
    parts += [f"--json {args.json}"] if args.json else []
    parts += [f"--plot {args.plot}"] if args.plot else []
    return " ".join(parts)


def _sharded(args: argparse.Namespace, workloads: list[str], device: torch.device) -> int:
    try:
        from phalanx_tools.bench.sharded import bench_sharded
    except ImportError as e:
        print(
            f"phalanx bench: --procs needs phalanx_tools.bench.sharded, which this "
            f"installation does not provide ({e}). Run without --procs.",
            file=sys.stderr,
        )
        return 2
    try:
        rows = bench_sharded(
            workloads=workloads, procs=args.procs, quick=args.quick, device=device.type
        )
    except ValueError as e:  # e.g. a workload without a sharded definition
        print(f"phalanx bench --procs: {e}", file=sys.stderr)
        return 2
    if rows:
        cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
        print(text_table(list(rows[0]), cells))
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark with parsed options.

    Returns:
        0 on success, 1 when a contender gave a wrong answer, 2 on a usage error (an unknown
        workload or phase, ``--device cuda`` without a GPU, ``--procs`` unavailable).
    """
    if isinstance(args.threads, list):
        return _each_thread_count(args)
    if args.dynamic:
        from phalanx_tools.bench.dynamic import main as dynamic_main

        argv = ["--threads", str(args.threads)] if args.threads else []
        argv += ["--json", args.json] if args.json else []
        argv += ["--memory"] if args.memory else []
        if args.workloads != ",".join(WORKLOADS):  # named by the user: dynamic ones
            argv += ["--workloads", args.workloads]
        return dynamic_main(argv)
    if args.optimizer:
        from phalanx_tools.bench.optimizer import main as optimizer_main

        argv = ["--threads", str(args.threads)] if args.threads else []
        if args.workloads != ",".join(WORKLOADS):  # named by the user: the optimizer's own
            argv += ["--workloads", args.workloads]
        return optimizer_main(argv + (["--quick"] if args.quick else []) + (
            ["--json", args.json] if args.json else []))  # fmt: skip
    if args.routed:
        from phalanx_tools.bench.routed import main as routed_main

        argv = ["--threads", str(args.threads)] if args.threads else []
        argv += ["--quick"] if args.quick else []
        argv += ["--json", args.json] if args.json else []
        if args.workloads != ",".join(WORKLOADS):  # named by the user: routed ones
            argv += ["--workloads", args.workloads]
        return routed_main(argv)
    if args.real:
        from phalanx_tools.bench.real_suite import main as real_main

        argv = ["--members", str(args.members)]
        argv += ["--threads", str(args.threads)] if args.threads else []
        argv += ["--quick"] if args.quick else []
        argv += ["--json", args.json] if args.json else []
        if args.workloads != ",".join(WORKLOADS):  # named by the user: real models
            argv += ["--models", args.workloads]
        return real_main(argv)
    try:
        workloads = _parse_list(args.workloads, list(WORKLOADS), "--workloads")
        phases = _parse_list(args.phases, PHASES, "--phases")
        device = _device(args.device)
        if args.procs is not None and args.procs < 1:
            raise ValueError(f"--procs {args.procs}: give a number of processes >= 1.")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads {args.threads}: give a number of threads >= 1.")
    except ValueError as e:
        print(f"phalanx bench: {e}", file=sys.stderr)
        return 2
    if args.procs is not None:
        return _sharded(args, workloads, device)

    from tqdm import tqdm

    settings = QUICK if args.quick else FULL
    command = _command(args, workloads, phases)
    jax_line = ""  # the JAX contender (training only), or the line saying it is skipped
    if "train" in phases:
        jax_contender.use_threads(args.threads)  # before JAX's first computation sizes its pool
        jax_line = "\n" + (jax_contender.missing() or jax_contender.describe())
    with _exact_fp32(), intra_op_threads(args.threads):
        machine = measure(device, quick=args.quick)
        optimizer, optimizer_line = phalanx_adam()
        header = f"{machine.describe()}\noptimizer  phalanx contenders: {optimizer_line}"
        header += jax_line
        print(f"$ {command}\n{header}\n", flush=True)
        total = len(workloads) * len(phases) * settings.rounds
        with tqdm(total=total, file=sys.stderr, unit="round", dynamic_ncols=True) as bar:
            results = run_suite(
                workloads,
                phases,
                device=device,
                settings=settings,
                machine=machine,
                contenders=default_contenders(optimizer, compile_backend=args.compile_backend),
                progress=bar,
                seed=args.seed,
            )
    print(format_text(results), flush=True)
    if args.json:
        write_json(
            args.json,
            results,
            command=command,
            machine=machine.to_dict(),
            machine_text=header,
            optimizer=optimizer_line,
            settings=vars(settings),
        )
    if args.plot:
        plot(args.plot, results, title=f"phalanx bench on {machine.device_name} ({device.type})")
    if machine.busy():
        print(f"phalanx bench: {BUSY} (load average {machine.load_average:.2f}).", file=sys.stderr)
    wrong = problems(results)
    for line in wrong:
        print(f"phalanx bench: {line}", file=sys.stderr)
    return 1 if wrong else 0
