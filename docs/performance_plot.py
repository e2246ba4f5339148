"""Draws docs/performance.png from one run's figures (benchmarks/notes/benchmarks.json).

Each workload is labelled with what it is, not only its id. Run from the repository root:
python docs/performance_plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
NAMES = {
    "W1": "W1\nper-feature nets\n400 x 20-10-1",
    "W2": "W2 ensemble,\nshared batch\n8 x 10-20-2",
    "W3": "W3 ensemble,\nown batches\n8 x 10-20-2",
    "W4": "W4 MNIST-size\nMLPs, 32 x\n784-256-256-10",
    "W5": "W5\nQ-ensemble\n10 x 64-256-256-1",
    "W6": "W6\ntiny-net sweep\n2048 x 8-64-64-1",
    "W7": "W7 CNN\nensemble, BN\n16 CNNs",
}


def main() -> None:
    doc = json.loads((ROOT / "benchmarks" / "notes" / "benchmarks.json").read_text())
    speedups: dict[str, dict[str, float]] = {"forward": {}, "train": {}}
    for result in doc["results"]:
        rows = {row["name"]: row for row in result["rows"] if row["status"] == "ok"}
        if "loop" in rows and "phalanx:auto" in rows:
            ratio = rows["loop"]["median_s"] / rows["phalanx:auto"]["median_s"]
            speedups[result["phase"]][result["workload"]] = ratio
    workloads = [w for w in NAMES if w in speedups["train"]]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.38
    for k, phase in enumerate(("forward", "train")):
        xs = [i + (k - 0.5) * width for i in range(len(workloads))]
        ax.bar(xs, [speedups[phase].get(w, 0.0) for w in workloads], width, label=phase)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)), [NAMES[w] for w in workloads], fontsize=8)
    ax.set_ylabel("phalanx (auto) speed-up over the loop")
    ax.set_title("One run of `phalanx bench` on a 2-core CPU (above 1: faster than the loop)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "performance.png", dpi=110)


if __name__ == "__main__":
    main()
