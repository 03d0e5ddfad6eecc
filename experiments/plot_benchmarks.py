"""Draws one PNG per op from ``experiments/results/benchmarks.csv``.

One panel per (mode, dtype); shapes along x; one bar per provider. The metric defaults to GB/s
when the op's rows have it (memory-bound ops, drawn with the measured copy bandwidth of the
"copy" row as a dashed line), else TFLOPS, else milliseconds. ``--relative-to PROVIDER`` draws
each provider's time as a multiple of that provider's on the same shape instead (the ratio a
"within 1.10x of X" target is about), with the ``--target`` ratio as a dashed line. Rows without
a timing (e.g. a provider that is not installed) are skipped. Rows of one GPU only: ``--gpu`` or
the latest.

    python experiments/plot_benchmarks.py rope_qk                       # -> results/rope_qk.png
    python experiments/plot_benchmarks.py rope_attention --metric ms --out /tmp/a.png
    python experiments/plot_benchmarks.py rope_attention --relative-to sdpa_no_rope --target 1.1
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
    relative_to: str | None = None,
    target: float | None = None,
    shape_order: list[str] | None = None,
) -> Path:
    """Writes the figure of ``op`` (rows of one GPU: ``gpu`` or the latest) and returns its path.
    With ``relative_to`` (a provider) the bars are time / that provider's time on the shape,
    shapes without its row left out, and ``target`` (a ratio) is drawn as a dashed line.
    Shapes run along x in ``shape_order`` (others after them), else in the CSV's order, the same
    in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, gpu = _rows(op, csv_path, gpu)
    if metric is None:
        metric = next(m for m in METRICS if m == "ms" or any(r[m] for r in rows))
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
    if relative_to is not None:
        if relative_to not in {r["provider"] for r in rows}:
            raise ValueError(f"relative_to: no timed rows of provider {relative_to!r} for {op!r}")
        metric = "ms"
        base = {(r["mode"], r["dtype"], r["shape"]): float(r["ms"]) for r in rows
                if r["provider"] == relative_to}  # fmt: skip
        rows = [dict(r, ms=float(r["ms"]) / base[key]) for r in rows
                if (key := (r["mode"], r["dtype"], r["shape"])) in base]  # fmt: skip
    order = {shape: i for i, shape in enumerate(shape_order or [])}
    all_shapes = list(dict.fromkeys(r["shape"] for r in rows))
    all_shapes.sort(key=lambda shape: order.get(shape, len(order)))  # stable: CSV order after
    panels = sorted({(r["mode"], r["dtype"]) for r in rows})
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False, sharey=True
    )
    width = 0.8 / len(providers)
    for ax, (mode, dtype) in zip(axes[0], panels, strict=True):
        panel = [r for r in rows if (r["mode"], r["dtype"]) == (mode, dtype)]
        shapes = [shape for shape in all_shapes if any(r["shape"] == shape for r in panel)]
        for i, provider in enumerate(providers):
            # a row without this metric (eager rows have no gbps) draws no bar
            value = {r["shape"]: float(r[metric]) for r in panel
                     if r["provider"] == provider and r[metric] not in ("", None)}  # fmt: skip
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
    if target is not None:
        for ax in axes[0]:
            ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:g}x")
    ylabel = f"time / {relative_to} (lower is better)" if relative_to else METRICS[metric]
    axes[0][0].set_ylabel(ylabel)
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
    parser.add_argument("--relative-to", default=None, metavar="PROVIDER",
                        help="draw time / this provider's time on the same shape")  # fmt: skip
    parser.add_argument("--target", type=float, default=None, help="a ratio drawn as a line")
    args = parser.parse_args()
    print(
        plot_op(args.op, args.csv, args.out, args.metric, args.gpu, args.relative_to, args.target)
    )


if __name__ == "__main__":
    main()
