"""Turns a multirun's ``summary.json`` files into a markdown table and a PNG plot.

    python experiments/collect.py multirun/2026-01-01/12-00-00 [--metrics test/err,best_val_loss]

A cell is one setting of the overrides that vary between runs (``seed`` aside; the shared
ones head the table); each metric is shown as
``mean ± std`` over the cell's seeds (sample standard deviation; ``±`` omitted for one
seed). Writes ``results.md`` and ``results.png`` into the multirun directory (or
``--out``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

# Run as a script (`python experiments/collect.py`): the repository root is not on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.results_io import markdown_table  # noqa: E402

SEED_KEYS = ("seed",)
# Metrics shown when --metrics is not given, if the summaries have them.
DEFAULT_SUFFIXES = ("/err", "/ppl")
DEFAULT_KEYS = ("best_val_loss", "tokens_per_s")


def load_summaries(root: Path) -> list[dict]:
    paths = sorted(root.rglob("summary.json"))
    if not paths:
        raise FileNotFoundError(f"no summary.json under {root} (is it a multirun directory?)")
    return [json.loads(p.read_text()) for p in paths]


def overrides_of(summary: dict) -> dict[str, str]:
    """The run's command-line overrides as ``{key: value}``, without the seed."""
    pairs = (o.split("=", 1) for o in summary.get("overrides", []) if "=" in o)
    return {k.lstrip("+~"): v for k, v in pairs if k.lstrip("+~") not in SEED_KEYS}


def cells(summaries: list[dict]) -> tuple[list[str], dict[str, str]]:
    """Each run's cell (the overrides that vary between runs, e.g. ``attention=rope``) and the
    overrides every run shares."""
    runs = [overrides_of(s) for s in summaries]
    keys = sorted({k for r in runs for k in r})
    varying = [k for k in keys if len({r.get(k) for r in runs}) > 1]
    common = {k: runs[0][k] for k in keys if k not in varying}
    labels = [" ".join(f"{k}={r.get(k, '-')}" for k in varying) or "(all runs)" for r in runs]
    return labels, common


def default_metrics(summaries: list[dict]) -> list[str]:
    keys = [k for k in summaries[0] if k.endswith(DEFAULT_SUFFIXES)]
    return keys + [k for k in DEFAULT_KEYS if k in summaries[0]]


def aggregate(summaries: list[dict], metrics: list[str]) -> list[dict]:
    """One row per cell: ``cell``, ``seeds`` and per metric ``(mean, std)`` (std NaN for one
    seed; metrics a run lacks or has as null are skipped for that run)."""
    by_cell: dict[str, list[dict]] = {}
    for label, s in zip(cells(summaries)[0], summaries, strict=True):
        by_cell.setdefault(label, []).append(s)
    rows = []
    for cell, runs in sorted(by_cell.items()):
        row: dict = {"cell": cell, "seeds": len(runs)}
        for m in metrics:
            values = [r[m] for r in runs if isinstance(r.get(m), (int, float))]
            mean = statistics.fmean(values) if values else math.nan
            std = statistics.stdev(values) if len(values) > 1 else math.nan
            row[m] = (mean, std)
        rows.append(row)
    return rows


def _fmt(mean: float, std: float) -> str:
    if math.isnan(mean):
        return "-"
    digits = ".4g"
    return f"{mean:{digits}}" if math.isnan(std) else f"{mean:{digits}} ± {std:{digits}}"


def markdown(rows: list[dict], metrics: list[str]) -> str:
    cells = [
        {"cell": r["cell"], "seeds": r["seeds"], **{m: _fmt(*r[m]) for m in metrics}} for r in rows
    ]
    return markdown_table(cells, ["cell", "seeds", *metrics])


def plot(rows: list[dict], metrics: list[str], path: Path) -> None:
    """One bar chart per metric: a bar per cell, error bars = std over seeds."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5), squeeze=False)
    labels = [r["cell"].replace(" ", "\n") for r in rows]
    for ax, m in zip(axes[0], metrics, strict=True):
        means = [r[m][0] for r in rows]
        stds = [0.0 if math.isnan(r[m][1]) else r[m][1] for r in rows]
        ax.bar(range(len(rows)), means, yerr=stds, capsize=3, color="tab:blue")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(m)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun_dir", type=Path)
    parser.add_argument(
        "--metrics",
        help="comma-separated summary keys (default: error rates "
        "or perplexities per split, best_val_loss, tokens_per_s)",
    )
    parser.add_argument("--out", type=Path, help="output directory (default: multirun_dir)")
    args = parser.parse_args(argv)
    summaries = load_summaries(args.multirun_dir)
    metrics = args.metrics.split(",") if args.metrics else default_metrics(summaries)
    missing = [m for m in metrics if not any(m in s for s in summaries)]
    if missing:
        raise SystemExit(f"--metrics: {missing} in no summary; keys: {sorted(summaries[0])}")
    rows = aggregate(summaries, metrics)
    out = args.out or args.multirun_dir
    out.mkdir(parents=True, exist_ok=True)
    common = " ".join(f"{k}={v}" for k, v in cells(summaries)[1].items())
    table = (f"Every run: {common}\n\n" if common else "") + markdown(rows, metrics)
    (out / "results.md").write_text(table)
    plot(rows, metrics, out / "results.png")
    print(table, end="")
    print(f"wrote {out / 'results.md'} and {out / 'results.png'}")
    return table


if __name__ == "__main__":
    main()
