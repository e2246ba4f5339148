"""The benchmark's outputs: text and Markdown tables, JSON, and a speed-up plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from phalanx_tools.bench.suite import Result, Row

CONVENTIONS = (
    "Times are per call: median over interleaved rounds, spread = interquartile range "
    "relative to the median. FLOPs: 2 per multiply-add of Linear and Conv layers (biases, "
    "norms, activations and pooling not counted); a training step counts 3x the forward. "
    "Bytes: a lower bound (parameters and input read, each layer's output written once; a "
    "training step 3x that plus Adam's 7 passes over the parameters). floor = max(FLOPs / "
    "measured GEMM peak, bytes / measured copy bandwidth); x floor = time / floor. "
    "Speed-ups: the loop's (or torch.func's) median time over this contender's; above 1 is "
    "faster. 'best phalanx' is the fastest phalanx contender that passed the check, auto "
    "aside. loop+fused: the loop with torch.optim.Adam(fused=True); loop+compile: that loop "
    "with each member torch.compile'd (training only). compile: seconds spent "
    "tracing and compiling the captured step (phalanx:compiled), which times itself against "
    "the eager step and keeps the faster (its note says which). "
    "Forward runs under torch.no_grad() in eval mode; the training step in train mode. "
    "jax (where jax and optax are installed): jax.jit(jax.vmap(step)) with optax.adam at "
    "torch's defaults, from the same weights and data, each step waited for with "
    "block_until_ready; 'captured / jax' is phalanx:compiled's time over jax's (below 1: "
    "phalanx is faster)."
)

DETAIL_HEADERS = [
    "phase", "contender", "status", "time/call", "IQR", "GFLOP/s", "% peak", "x floor",
    "peak mem", "compile", "vs loop", "vs torch.func", "note",
]  # fmt: skip
SUMMARY_HEADERS = [
    "workload", "phase", "loop", "loop+fused", "loop+compile", "torch.func", "best phalanx",
    "vs loop", "vs loop+fused", "vs loop+compile", "vs torch.func", "auto", "vs loop",
    "vs torch.func",
]  # fmt: skip


def fmt_time(seconds: float | None) -> str:
    """3 significant digits in ns, us, ms or s."""
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            return f"{seconds / scale:.3g} {unit}"
    raise AssertionError("unreachable")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:  # 41,100x reads better than 4.11e+04x
        return f"{x:,.0f}{suffix}"
    return f"{x:{spec}}{suffix}"


def _detail(r: Result, row: Row, *, width: int | None) -> list[str]:
    note = row.reason if row.status != "ok" else row.note
    if width is not None and len(note) > width:
        note = note[: width - 3] + "..."
    spread = None
    if row.median_s and row.q1_s is not None and row.q3_s is not None:
        spread = (row.q3_s - row.q1_s) / row.median_s
    return [
        r.phase,
        row.name,
        row.status,
        fmt_time(row.median_s),
        _fmt(spread and 100 * spread, ".0f", "%") if spread is not None else "-",
        _fmt(row.gflops, ".3g"),
        _fmt(row.fraction_of_peak and 100 * row.fraction_of_peak, ".2g", "%"),
        _fmt(row.times_floor, ".3g", "x"),
        fmt_bytes(row.peak_memory_bytes) if row.status == "ok" else "-",
        "-" if row.compile_s is None else f"{row.compile_s:.1f} s",
        _fmt(row.vs_loop, ".2f", "x"),
        _fmt(row.vs_torch_func, ".2f", "x"),
        note,
    ]


def _summary(r: Result) -> list[str]:
    loop, fused, compiled, tf, auto, best = (
        r.row("loop"),
        r.row("loop+fused"),
        r.row("loop+compile"),
        r.row("torch.func"),
        r.row("phalanx:auto"),
        r.best_phalanx(),
    )

    def best_over(baseline: Row | None) -> float | None:
        if best and best.median_s and baseline is not None and baseline.median_s:
            return baseline.median_s / best.median_s
        return None

    def time_of(row: Row | None) -> str:
        if row is None:
            return "-"
        return fmt_time(row.median_s) if row.status == "ok" else row.status

    auto_name = time_of(auto)
    if auto is not None and auto.status == "ok" and auto.note.startswith("picked "):
        auto_name += f" ({auto.note.split()[1]})"
    return [
        r.workload,
        r.phase,
        time_of(loop),
        time_of(fused),
        time_of(compiled),
        time_of(tf),
        f"{time_of(best)} ({best.name.removeprefix('phalanx:')})" if best else "none passed",
        _fmt(best.vs_loop if best else None, ".2f", "x"),
        _fmt(best_over(fused), ".2f", "x"),
        _fmt(best_over(compiled), ".2f", "x"),
        _fmt(best.vs_torch_func if best else None, ".2f", "x"),
        auto_name,
        _fmt(auto.vs_loop if auto else None, ".2f", "x"),
        _fmt(auto.vs_torch_func if auto else None, ".2f", "x"),
    ]


TAUGHT_HEADERS = ["workload", "taught", "vs torch.func", "taught:eager", "vs torch.func",
                  "compile", "captured step chose"]  # fmt: skip


def _taught_rows(results: list[Result]) -> list[list[str]]:
    """The README tour's step (captured, and eager) against the torch.func recipe."""
    rows = []
    for r in results:
        taught, eager = r.row("taught"), r.row("taught:eager")
        if r.phase != "train" or (taught is None and eager is None):
            continue

        def time_of(row: Row | None) -> str:
            if row is None:
                return "-"
            return fmt_time(row.median_s) if row.status == "ok" else row.status

        def vs(row: Row | None) -> str:
            return _fmt(row.vs_torch_func if row is not None else None, ".2f", "x")

        chose = "-"
        if taught is not None and taught.status == "ok":
            chose = taught.note.split(":")[0] or "-"
        compile_s = taught.compile_s if taught is not None else None
        rows.append([
            r.workload, time_of(taught), vs(taught), time_of(eager), vs(eager),
            "-" if compile_s is None else f"{compile_s:.1f} s", chose,
        ])  # fmt: skip
    return rows


JAX_HEADERS = ["workload", "phalanx:compiled", "jax", "captured / jax", "jax compile"]


def _jax_rows(results: list[Result]) -> list[list[str]]:
    """Per training result with a jax row: the captured step's time over JAX's."""

    def time_of(row: Row | None) -> str:
        if row is None:
            return "-"
        return fmt_time(row.median_s) if row.status == "ok" else f"{row.status}: {row.reason}"

    rows = []
    for r in results:
        compiled, jax = r.row("phalanx:compiled"), r.row("jax")
        if r.phase != "train" or jax is None:
            continue
        ratio = None
        if compiled is not None and compiled.median_s and jax.median_s:
            ratio = compiled.median_s / jax.median_s
        compile_s = "-" if jax.compile_s is None else f"{jax.compile_s:.1f} s"
        rows.append(
            [r.workload, time_of(compiled), time_of(jax), _fmt(ratio, ".2f", "x"), compile_s]
        )
    return rows


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)])


def _by_workload(results: list[Result]) -> dict[str, list[Result]]:
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.workload, []).append(r)
    return groups


def _cost_line(results: list[Result]) -> str:
    parts = [
        f"{r.phase}: {r.flops / 1e6:.4g} MFLOP, {fmt_bytes(r.bytes)} moved, "
        f"floor {fmt_time(r.floor_s)}"
        for r in results
    ]
    return "; ".join(parts) + f"; peak mem = {results[0].memory_method}"


def format_text(results: list[Result]) -> str:
    """The tables printed by ``phalanx bench``: one per workload, then the summary."""
    blocks = []
    for group in _by_workload(results).values():
        rows = [_detail(r, row, width=60) for r in group for row in r.rows]
        title = f"{group[0].description}\n{_cost_line(group)}"
        blocks.append(f"{title}\n{text_table(DETAIL_HEADERS, rows)}")
    summary = text_table(SUMMARY_HEADERS, [_summary(r) for r in results])
    blocks.append(f"Summary (time per call, speed-ups)\n{summary}")
    taught_rows = _taught_rows(results)
    if taught_rows:
        title = (
            "The taught path (the README tour's step: stack, member_losses, phalanx Adam, "
            "compile_step; and its eager form) against the torch.func recipe"
        )
        blocks.append(f"{title}\n{text_table(TAUGHT_HEADERS, taught_rows)}")
    jax_rows = _jax_rows(results)
    if jax_rows:
        title = "The captured step against JAX's jit(vmap(step)) (training step, time per call)"
        blocks.append(f"{title}\n{text_table(JAX_HEADERS, jax_rows)}")
    return "\n\n".join(blocks)


def format_markdown(results: list[Result]) -> str:
    """The same tables in Markdown: the summary first, then one per workload."""
    parts = ["### Summary", "", _markdown_table(SUMMARY_HEADERS, [_summary(r) for r in results])]
    taught_rows = _taught_rows(results)
    if taught_rows:
        parts += ["", "### The taught path against the torch.func recipe", ""]
        parts.append(_markdown_table(TAUGHT_HEADERS, taught_rows))
    jax_rows = _jax_rows(results)
    if jax_rows:
        parts += ["", "### The captured step against JAX's jit(vmap(step))", ""]
        parts.append(_markdown_table(JAX_HEADERS, jax_rows))
    for group in _by_workload(results).values():
        rows = [_detail(r, row, width=None) for r in group for row in r.rows]
        parts += ["", f"### {group[0].description}", "", _cost_line(group) + ".", ""]
        parts.append(_markdown_table(DETAIL_HEADERS, rows))
    return "\n".join(parts)


def problems(results: list[Result]) -> list[str]:
    """One line per WRONG contender."""
    return [
        f"{r.workload} {r.phase}: {row.name} is WRONG: {row.reason}"
        for r in results
        for row in r.rows
        if row.status == "WRONG"
    ]


def write_json(path: str | Path, results: list[Result], **header: Any) -> None:
    """Writes the run as JSON: ``header`` entries (command, machine...), then the results."""
    doc = {**header, "conventions": CONVENTIONS, "results": [asdict(r) for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def read_results(doc: dict[str, Any]) -> list[Result]:
    """The results of a JSON document written by :func:`write_json`."""
    results = []
    for r in doc["results"]:
        rows = [Row(**row) for row in r["rows"]]
        results.append(Result(**{**r, "rows": rows}))
    return results


def plot(path: str | Path, results: list[Result], *, title: str) -> None:
    """Speed-up over the loop per workload, one panel per phase, bars on a log axis.

    Args:
        path: the PNG to write.
        results: the run's results.
        title: the figure's title (the machine, typically).
    """
    import matplotlib  # lazily: matplotlib is optional and slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    phases = list(dict.fromkeys(r.phase for r in results))
    names = [n for n in dict.fromkeys(row.name for r in results for row in r.rows) if n != "loop"]
    workloads = list(dict.fromkeys(r.workload for r in results))
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(
        len(phases), 1, figsize=(max(7.0, 1.6 * len(workloads) + 3), 3.8 * len(phases)),
        squeeze=False,
    )  # fmt: skip
    width = 0.8 / max(1, len(names))
    values = [row.vs_loop for r in results for row in r.rows if row.vs_loop]
    low, high = min([*values, 1.0]), max([*values, 1.0])
    for ax, phase in zip(axes[:, 0], phases):
        by_workload = {r.workload: r for r in results if r.phase == phase}
        for k, name in enumerate(names):
            for i, wid in enumerate(workloads):
                result = by_workload.get(wid)
                row = result.row(name) if result else None
                if row is None:
                    continue
                x = i + (k - (len(names) - 1) / 2) * width
                if row.vs_loop is None:
                    ax.text(x, 1.0, row.status, rotation=90, ha="center", va="bottom", fontsize=7)
                    continue
                v = row.vs_loop  # bars grow from the loop's line: up is faster, down slower
                ax.bar(
                    x, v - 1, width, bottom=1, color=colors(k), edgecolor="white",
                    hatch="//" if name == "phalanx:auto" else None,
                )  # fmt: skip
                ax.text(
                    x, v * (1.05 if v >= 1 else 0.95), f"{v:.2g}x", ha="center",
                    va="bottom" if v >= 1 else "top", fontsize=7, rotation=90,
                )  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_yscale("log")
        ax.set_ylim(low / 2, high * 3)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("speed-up over the loop")
        ax.set_title(
            "forward, no grad"
            if phase == "forward"
            else "training step: forward, loss, backward, Adam step"
        )
        ax.grid(axis="y", which="both", alpha=0.3)
    patches = [
        Patch(facecolor=colors(k), hatch="//" if name == "phalanx:auto" else None, label=name)
        for k, name in enumerate(names)
    ]
    axes[0, 0].legend(handles=patches, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"{title}\n(higher is better; black line = the Python loop)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
