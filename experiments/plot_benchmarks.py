"""Draws one PNG per op from ``experiments/results/benchmarks.csv``.

One panel per (mode, dtype); shapes along x; one bar per provider. The metric defaults to GB/s
when the op's rows have it (memory-bound ops, drawn with the measured copy bandwidth of the
"copy" row as a dashed line), else TFLOPS, else milliseconds. Rows without a timing (e.g. a
provider that is not installed) are skipped. Rows of one GPU only: ``--gpu`` or the latest.

    python experiments/plot_benchmarks.py rope_qk                       # -> results/rope_qk.png
    python experiments/plot_benchmarks.py rope_attention --metric ms --out /tmp/a.png
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.results_io import CSV_PATH, RESULTS  # noqa: E402

METRICS = {"gbps": "GB/s (higher is better)", "tflops": "TFLOPS (higher is better)",
           "ms": "ms (lower is better)"}  # fmt: skip


def _read(csv_path: Path) -> list[dict]:
    with Path(csv_path).open(newline="") as f:
        return list(csv.DictReader(f))


def _rows(op: str, csv_path: Path, gpu: str | None) -> tuple[list[dict], str]:
    rows = [r for r in _read(csv_path) if r["op"] == op and r["ms"]]
    if not rows:
        raise ValueError(f"no timed rows for op {op!r} in {csv_path}")
    if gpu is None:  # the GPU of the most recent run of this op
        gpu = max(rows, key=lambda r: r["date"])["gpu"]
    rows = [r for r in rows if r["gpu"] == gpu]
    if not rows:
        raise ValueError(f"no rows for op {op!r} on gpu {gpu!r} in {csv_path}")
    return rows, gpu


def plot_op(
    op: str,
    csv_path: Path = CSV_PATH,
    out: Path | None = None,
    metric: str | None = None,
    gpu: str | None = None,
) -> Path:
    """Writes the figure of ``op`` (rows of one GPU: ``gpu`` or the latest) and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, gpu = _rows(op, csv_path, gpu)
    if metric is None:
        metric = next(m for m in METRICS if m == "ms" or any(r[m] for r in rows))
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
    panels = sorted({(r["mode"], r["dtype"]) for r in rows})
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False, sharey=True
    )
    width = 0.8 / len(providers)
    for ax, (mode, dtype) in zip(axes[0], panels, strict=True):
        panel = [r for r in rows if (r["mode"], r["dtype"]) == (mode, dtype)]
        shapes = list(dict.fromkeys(r["shape"] for r in panel))
        for i, provider in enumerate(providers):
            value = {r["shape"]: float(r[metric]) for r in panel if r["provider"] == provider}
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, [value.get(s, 0.0) for s in shapes], width, label=provider)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=20, ha="right", fontsize=7)
        ax.set_title(f"{mode}, {dtype}")
        ax.grid(axis="y", alpha=0.3)
    # Memory-bound ops are read against the device's copy bandwidth (bench_rope's "copy" row).
    copy = [r for r in _read(csv_path) if r["op"] == "copy" and r["gpu"] == gpu and r["gbps"]]
    if metric == "gbps" and copy:
        for ax in axes[0]:
            ax.axhline(float(copy[-1]["gbps"]), color="k", ls="--", lw=1, label="copy bandwidth")
    axes[0][0].set_ylabel(METRICS[metric])
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{op} on {gpu}")
    fig.tight_layout()
    out = Path(out) if out is not None else RESULTS / f"{op}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("op", help="the op column of the CSV, e.g. rope_qk")
    parser.add_argument("--csv", type=Path, default=CSV_PATH)
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default results/OP.png)")
    parser.add_argument("--metric", choices=list(METRICS), default=None)
    parser.add_argument("--gpu", default=None, help="gpu column to plot (default: latest run)")
    args = parser.parse_args()
    print(plot_op(args.op, args.csv, args.out, args.metric, args.gpu))


if __name__ == "__main__":
    main()
