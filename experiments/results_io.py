"""One writer for every benchmark: rows upserted into ``experiments/results/benchmarks.csv``.

Fixed schema (as Liger-Kernel's ``all_benchmark_data.csv``): a row is identified by
(op, provider, mode, shape, dtype, gpu); rerunning a benchmark replaces its rows and
keeps everyone else's. ``read_rows`` reads one op's rows back, so that a script's markdown covers
every run (split by ``--shapes``) and not only the last; ``markdown_table`` renders them.
``accuracy_note`` is the one error check of the RoPE benchmarks' rows.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lm.checkpoint import replace_atomically

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

RESULTS = Path(__file__).resolve().parent / "results"
CSV_PATH = RESULTS / "benchmarks.csv"


def output_dir(out: Path | None, quick: bool, script: str) -> Path:
    """Where a benchmark writes: ``out`` when given, else ``RESULTS`` for a full run and a
    temporary ``<script>_quick`` folder for a quick one (a smoke test, which a CPU forces):
    in ``RESULTS`` it would replace the committed GPU tables with its own."""
    if not isinstance(script, str) or not script or Path(script).name != script:
        raise ValueError(f"script must be a bare name (the temporary folder's), got {script!r}")
    if out is not None:
        return out
    return Path(tempfile.gettempdir()) / f"{script}_quick" if quick else RESULTS


def gpu_suffix(report: Path, gpu: str) -> str:
    """``""`` where ``report`` (a benchmark's markdown, whose third line starts with the GPU's
    name) is absent or of ``gpu``, else a name of ``gpu`` to put before the suffixes of this
    run's report and plots: its model (``"_h100"`` for ``NVIDIA H100 80GB HBM3``), or its
    whole name where the model's report is another GPU's (``"_nvidia_h100_pcie"`` beside an
    ``NVIDIA H100 80GB HBM3`` one). A run on one GPU does not replace another GPU's
    committed report (``bench_corope.md`` of an H100, ``bench_corope_h200.md``)."""

    def someone_elses(path: Path) -> bool:
        lines = path.read_text().splitlines() if path.exists() else []
        return bool(lines) and not (len(lines) > 2 and lines[2].startswith(f"{gpu},"))

    slug = lambda name: "_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    if not someone_elses(report):
        return ""
    model = re.search(r"\b[A-Z]+\d+[A-Za-z]*\b", gpu)
    short = slug(model.group(0) if model else gpu)
    taken = someone_elses(report.with_name(f"{report.stem}{short}{report.suffix}"))
    return slug(gpu) if taken else short


QUICK_IGNORES = "a quick run (which a CPU forces) times its fixed tiny cases"


def warn_ignored(parser: argparse.ArgumentParser, args, dests: list[str], why: str) -> None:
    """Says on stderr which of the options ``dests`` (argparse's names) were set away from
    their defaults although this run ignores them, ``why`` (a quick run times its fixed tiny
    cases; a report times nothing): accepted silently, they looked obeyed."""
    given = [d for d in dests if getattr(args, d) != parser.get_default(d)]
    if given:
        names = ", ".join("--" + d.replace("_", "-") for d in given)
        print(f"{names} ignored: {why}", file=sys.stderr, flush=True)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """A benchmark's ``--quick`` and ``--out`` options; ``quick_and_output`` reads them."""
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (CPU works)")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the csv, markdown and plots (default: experiments/results/; for a quick "
        "run, which a CPU forces, a temporary folder: never the committed results)",
    )


def quick_and_output(
    args: argparse.Namespace, device, script: str, *, times: bool = True
) -> tuple[bool, Path]:
    """(quick, the folder to write to) from ``add_output_arguments``' options, for every run
    of a benchmark, reports included: the folder is ``output_dir``'s, so a quick run writes
    into ``RESULTS`` only where ``--out`` names it; says where. A run that times (``times``)
    without CUDA is quick (the interpreter); one that times nothing (a report rebuilt from a
    folder's CSV) is quick with ``--quick`` only, so a CPU machine can rebuild the committed
    report, and a quick report is the quick runs' (their folder's CSV)."""
    quick = args.quick or (times and device.type != "cuda")
    out = output_dir(args.out, quick, script)
    print(f"results into {out}", flush=True)
    return quick, out


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
NUMERIC = ("ms", "ms_p20", "ms_p80", "tflops", "gbps", "peak_mem_mib")
# Max-abs error against an fp32 reference beyond which a row's output is wrong: two units in the
# last place of the dtype at magnitudes 4-8. The outputs (rotated randn q and k; attention's
# convex combinations of randn v rows) stay below 8, and a correct provider only rounds: the
# measured maxima (fused_rope/README.md and experiments/results/benchmarks.csv, H100/H200) are
# RoPE 1.9e-3 fp16 and 1.6e-2 bf16 (this kernel: half an ulp) and up to 4.9e-3 and 3.6e-2
# (eager, in the dtype), RoPE attention up to 2.0e-3 and 1.5e-2 (every provider).
ACC_TOL = {"fp16": 2 * 2.0**-8, "bf16": 2 * 2.0**-5}
ACC_FAIL = "ACC FAIL"  # the prefix of a failed row's note, as bench_corope.py's


def _git_commit() -> str:
    """HEAD's short hash, ``+dirty`` when tracked files differ from it (the rows measure code
    no commit holds); ``unknown`` without git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict[str, str]:
    """gpu, torch, triton, commit and date fields for the rows of this run."""
    import torch
    import triton

    # GIT_COMMIT: set by runs on machines whose copy of the tree has no (or a stale) .git
    commit = os.environ.get("GIT_COMMIT") or _git_commit()
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
    replacing rows with the same key (and of two given rows with one key, the later wins).
    Keys compare as written: a None field is the empty string the file holds. The read and
    the write hold a lock beside the file (``<csv>.lock``): two benchmarks writing at once
    each lost the other's rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        _upsert_rows_locked(rows, path)


@contextlib.contextmanager
def _locked(lock: Path):
    """An exclusive ``flock`` of ``lock`` (POSIX; elsewhere, no lock) for the block."""
    with lock.open("a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _upsert_rows_locked(rows: list[dict], path: Path) -> None:
    existing: list[dict] = []
    if path.exists():
        with path.open(newline="") as f:
            existing = list(csv.DictReader(f))

    def key(r: dict) -> tuple[str, ...]:
        return tuple(_fmt(r.get(k, "")) for k in KEY)

    rows = list({key(r): r for r in rows}.values())
    new_keys = {key(r) for r in rows}
    kept = [r for r in existing if key(r) not in new_keys]

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            writer.writeheader()
            for r in kept + rows:
                writer.writerow({k: _fmt(r.get(k, "")) for k in FIELDS})

    # A run killed mid-write (a time limit) leaves the previous file whole, not a truncated one
    replace_atomically(path, write)


def read_rows(path: Path, op: str, gpu: str, shape_order: Sequence[str] = ()) -> list[dict]:
    """The CSV's rows of ``op`` on ``gpu``, timings as floats (None where empty), sorted by
    their shape's place in ``shape_order`` (others last): the CSV holds rows in the order
    they were last written."""
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["op"] == op and r["gpu"] == gpu]
    for r in rows:
        for key in NUMERIC:
            r[key] = float(r[key]) if r[key] else None
    rank = {shape: i for i, shape in enumerate(shape_order)}
    return sorted(rows, key=lambda r: rank.get(r["shape"], len(rank)))


def merged_environment(rows: list[dict], keys) -> dict[str, str]:
    """Each of ``keys`` (gpu, torch, commit, ...) over ``rows``: their distinct values, joined
    (rows of runs split by ``--shapes`` may be of different commits or dates)."""
    return {key: ", ".join(sorted({r[key] for r in rows})) for key in keys}


def accuracy_note(err: float, dtype_name: str) -> str:
    """The note of a row whose max-abs error is ``err``: ``ACC FAIL`` first (NaN fails) when
    it is over ``ACC_TOL`` of the dtype."""
    tol = ACC_TOL[dtype_name]
    if err <= tol:
        return f"max err {err:.1e}"
    return f"{ACC_FAIL}: max err {err:.1e} > {tol:.1e}"


def leaf_gradients(fn, inputs, cotangent) -> list:
    """The gradients of ``fn(*inputs)`` under ``cotangent``, each input a leaf of its own (so
    no ``.grad`` of the caller's accumulates them)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    fn(*leaves).backward(cotangent)
    return [x.grad for x in leaves]


def gradient_note(got: list, ref: list, baseline: list, names=("dq", "dk", "dv")) -> str:
    """flash-attention's rule (``tests.helpers.check_against_baseline``) on each gradient:
    ``ACC FAIL`` first, naming the first that misses it, else that they passed."""
    from tests.helpers import check_against_baseline

    for name, g, r, b in zip(names, got, ref, baseline, strict=True):
        passed, msg = check_against_baseline(g, r, b)
        if not passed:
            return f"{ACC_FAIL} {name}: {msg}"
    return f"{', '.join(names)} within 2x the baseline's errors"


def sampled_rows_note(o, reference, baseline=None) -> str:
    """flash-attention's rule on three blocks of 8 query rows of ``o`` ``[B, H, N, D]`` (start,
    middle, end) for outputs too large for a whole reference: ``reference(i0, i1, dtype)``
    computes rows ``i0 .. i1 - 1`` in ``dtype``, the float64 rows the truth; the baseline is
    ``baseline(i0, i1)``, PyTorch in ``o``'s dtype, or by default the fp32 reference rounded
    to it. ``ACC FAIL`` first, naming the block, else "acc ok"."""
    import torch

    from tests.helpers import check_against_baseline

    N = o.shape[2]
    for i0 in sorted({0, N // 2, max(0, N - 8)}):
        i1 = min(N, i0 + 8)
        o64 = reference(i0, i1, torch.float64)
        base = (
            reference(i0, i1, torch.float32).to(o.dtype) if baseline is None else baseline(i0, i1)
        )
        passed, msg = check_against_baseline(o[:, :, i0:i1], o64, base)
        if not passed:
            return f"{ACC_FAIL} rows {i0}+: {msg}"
    return "acc ok"


def accuracy_failed(row: dict) -> bool:
    """Whether ``row``'s note says its output failed the accuracy check."""
    return str(row.get("note") or "").startswith(ACC_FAIL)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub markdown table of ``columns`` for ``rows`` (a ``|`` in a value escaped, so it
    does not split the cell)."""

    def cell(value) -> str:
        return _fmt(value).replace("|", "\\|")

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def print_report(text: str, out: Path | None) -> None:
    """Prints a markdown report and, where ``out`` is given, writes it there too."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
