"""One writer for every benchmark: rows upserted into ``experiments/results/benchmarks.csv``.

Fixed schema (as Liger-Kernel's ``all_benchmark_data.csv``): a row is identified by
(op, provider, mode, shape, dtype, gpu); rerunning a benchmark replaces its rows and
keeps everyone else's. ``markdown_table`` renders rows for the results markdown files.
"""

from __future__ import annotations

import csv
import datetime
import os
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CSV_PATH = RESULTS / "benchmarks.csv"
FIELDS = [
    "op",
    "provider",
    "mode",
    "shape",
    "dtype",
    "ms",
    "ms_p20",
    "ms_p80",
    "tflops",
    "gbps",
    "peak_mem_mib",
    "gpu",
    "torch",
    "triton",
    "commit",
    "date",
    "note",
]
KEY = ("op", "provider", "mode", "shape", "dtype", "gpu")


def environment() -> dict[str, str]:
    """gpu, torch, triton, commit and date fields for the rows of this run."""
    import torch
    import triton

    commit = os.environ.get("GIT_COMMIT")  # set by runs on machines that get no .git
    try:
        commit = (
            commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
    }


def upsert_rows(rows: list[dict], path: Path = CSV_PATH) -> None:
    """Writes ``rows`` (dicts with FIELDS keys; missing ones left empty) into the CSV,
    replacing rows with the same key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    existing: list[dict] = []
    if path.exists():
        with path.open(newline="") as f:
            existing = list(csv.DictReader(f))
    new_keys = {tuple(str(r.get(k, "")) for k in KEY) for r in rows}
    kept = [r for r in existing if tuple(r.get(k, "") for k in KEY) not in new_keys]
    # Written beside the CSV and moved over it: a run killed mid-write (a time limit) leaves
    # the previous file whole, not a truncated one.
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in kept + rows:
            writer.writerow({k: _fmt(r.get(k, "")) for k in FIELDS})
    os.replace(tmp, path)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub markdown table of ``columns`` for ``rows``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def print_report(text: str, out: Path | None) -> None:
    """Prints a markdown report and, where ``out`` is given, writes it there too."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
