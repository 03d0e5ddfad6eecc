"""Turns a directory of training runs into tables (markdown, CSV) and PNG figures.

    python experiments/collect.py multirun/2026-01-01/12-00-00 [--metrics test/err,best_val_loss]
    python experiments/collect.py runs/synth        # the root of experiments/run_parallel.py

Every run directory under the root counts (a Hydra multirun's ``0/``, ``1/``, ...,
``run_parallel.py``'s ``000-.../``): finished runs by their ``summary.json``; runs stopped
early (``run_parallel.py --job-timeout``, a killed job) by the last evaluation in their
``metrics.jsonl`` and their ``run.json`` (``.hydra/`` for runs older than it), marked
partial (``*`` on their steps), as are runs that ``train.max_minutes`` stopped
(``stopped_early`` in their summary). Runs that ended with an error (``failed.json``) are left
out of the means and listed, with the error, under the tables and on stderr; where they record
what they were (``run.json`` or ``.hydra/``) they still count in their cells: a ``failed``
column, and a row with no values for a cell whose every seed failed.

A cell is one setting of the overrides that vary between runs (their values as Hydra reads them:
``optim.lr=1e-3`` is ``optim.lr=0.001``; ``seed`` aside, as are the keys of how a run is carried
out, ``lm.config.RUN_CONDUCT_KEYS`` such as ``train.resume`` or ``train.max_minutes`` but for those
that change its speed (``SPEED_KEYS``: ``attention.impl``, ``attention.chunk_size``,
``train.device``, ``train.cpu_threads``, ``train.compile``, ``train.compile_mode``,
``train.activation_checkpointing``, ``train.grad_accum_steps``, ``train.deterministic``), and those
of ``--ignore``; each with the keys under it: runs of two launches that differ only in those share a
cell; the shared overrides head the table). What a run ran on counts as overrides too:
``world_size`` (torchrun's processes, each taking ``train.batch_size`` rows) and ``device_name``
(the GPU's name, or ``cpu``), from runs that record them. A seed run twice in a cell (a subset
re-run into the same root) counts once: the run with the most steps, then the newest; the others are
listed like failed runs. The task of a cell is its varying ``experiment`` / ``data`` / ``data.*``
overrides (or ``summary["data"]``; a run that sets none of them beside runs that do:
``data=<summary["data"]>``), its variant the rest (``attention=...``). Each metric is ``mean
± std`` over the cell's seeds (sample standard deviation; ``±`` omitted for one seed); with several
tasks, one table per task.

Writes into the root (or ``--out``): ``results.md`` (the tables and the command that made
them), ``results.csv`` (one row per cell: mean and std per metric), ``runs.csv`` (one row
per run), ``results.png`` (a bar per cell for each metric), ``curves.png`` (training loss
against step, one line per run, a colour per variant, a panel per task) and, where the runs
have them, ``errors.png`` / ``ppl.png`` (per task, a group of bars per eval split, a bar
per variant: mean, std as the error bar, each seed a dot). Prints the tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shlex
import statistics
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import yaml  # noqa: E402
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from hydra.errors import HydraException  # noqa: E402

# Run as a script (`python experiments/collect.py`): the repository root is not on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.results_io import markdown_table  # noqa: E402
from lm.checkpoint import read_jsonl  # noqa: E402
from lm.config import RUN_CONDUCT_KEYS, is_under  # noqa: E402

SEED_KEYS = ("seed",)
TASK_KEYS = ("experiment", "data")  # and every data.* key
# Metrics shown when --metrics is not given, if the summaries have them.
DEFAULT_SUFFIXES = ("/err", "/ppl")
DEFAULT_KEYS = ("best_val_loss", "tokens_per_s")
ALL_RUNS = "(all runs)"  # the cell when no override varies between the runs
DEFAULTS = "(defaults)"  # a run that sets none of the overrides that vary between the others
# Of RUN_CONDUCT_KEYS, those that change the speed a summary reports (tokens_per_s, step_ms,
# mfu): the same model, but a speed comparison of them needs a cell each (--ignore merges them).
SPEED_KEYS = (
    "attention.impl",
    "attention.chunk_size",
    "train.device",
    "train.cpu_threads",
    "train.compile",
    "train.compile_mode",
    "train.activation_checkpointing",
    "train.grad_accum_steps",
    "train.deterministic",
)
NO_CELL_KEYS = tuple(k for k in RUN_CONDUCT_KEYS if k not in SPEED_KEYS)
# What a run ran on (its summary's and run.json's), taken as overrides: runs of another number
# of processes (another global batch) or on another device are other cells (--ignore merges).
RUN_FACTS = ("world_size", "device_name")
_OVERRIDES_PARSER = OverridesParser.create()


@dataclass
class Run:
    """One run directory: its summary (for a partial run, the last evaluation's metrics with
    ``steps``, ``overrides``, ``attention``, ``data`` and ``seed`` from ``run.json``)."""

    path: Path
    summary: dict
    partial: bool = False
    failed: bool = False  # failed.json: its cell only (overrides, seed), no metric

    def losses(self) -> list[tuple[int, float]]:
        """``(step, train/loss)`` of every training log line of ``metrics.jsonl``."""
        return [(r["step"], r["train/loss"]) for r in _records(self.path) if "train/loss" in r]


@dataclass
class LeftOut:
    """A run directory that counts in no cell, and why (it failed, or repeats a seed)."""

    path: Path
    reason: str


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    try:
        return read_jsonl(path)  # a last line cut short is left out, with a warning
    except ValueError as error:  # a bad line within: this run only is left out
        print(f"collect: {error}; its records are left out", file=sys.stderr)
        return []


def _run_record(run_dir: Path) -> tuple[dict, list[str], dict] | None:
    """``(resolved config, overrides, RUN_FACTS it records)`` of the run in ``run_dir``: its
    ``run.json``, which only a run that started writes, or for runs older than it, ``.hydra/``
    (which a refused launch into the directory rewrites, and which records no facts); None
    without either."""
    record = run_dir / "run.json"
    if record.exists():
        try:
            data = json.loads(record.read_text())
            facts = {k: data[k] for k in RUN_FACTS if data.get(k) is not None}
            return data["config"], data["overrides"], facts
        except (json.JSONDecodeError, KeyError, TypeError) as error:  # written by hand, or cut
            print(f"collect: {record} unreadable ({error!r}); reading .hydra/", file=sys.stderr)
    hydra = run_dir / ".hydra"
    if not (hydra / "overrides.yaml").exists():
        return None
    config = yaml.safe_load((hydra / "config.yaml").read_text())
    return config, yaml.safe_load((hydra / "overrides.yaml").read_text()) or [], {}


def _partial_summary(run_dir: Path) -> dict | None:
    """A stopped run's last evaluation (and last logged speed) as a summary, or None without
    one (or without the record that says what the run was: ``_run_record``)."""
    records = _records(run_dir)
    evals = [r for r in records if any(k.endswith("/loss") and k != "train/loss" for k in r)]
    speed = next((r for r in reversed(records) if "tokens_per_s" in r), {})
    record = _run_record(run_dir)
    if not evals or record is None:
        return None
    config, overrides, facts = record
    last = evals[-1]
    first_loss = next(k for k in last if k.endswith("/loss"))
    return {
        **{k: v for k, v in speed.items() if k not in ("step", "train/loss", "lr")},
        **{k: v for k, v in last.items() if k != "step"},
        "val_loss": last[first_loss],
        "best_val_loss": min(r[first_loss] for r in evals if first_loss in r),
        "steps": last["step"],
        **_identity(config),
        "overrides": overrides,
        **facts,
    }


def _identity(config: dict) -> dict:
    """What a run was, as its summary names it (``lm.training``): attention, data and seed."""
    return {
        "attention": config["attention"]["name"],
        "data": config["data"]["name"],
        "seed": config["seed"],
    }


def _failure(run_dir: Path) -> str | None:
    """Why the run failed (its ``failed.json``, written by a training loop that raised), or
    None."""
    path = run_dir / "failed.json"
    if not path.exists():
        return None
    failed = json.loads(path.read_text())
    return f"failed after step {failed['step']}: {failed['error']}: {failed['message']}"


def _add_run_facts(runs: list[Run]) -> None:
    """Appends each of ``RUN_FACTS`` to the runs' overrides where every run records it; where
    only some do (runs from before run.json held them, stopped runs read from ``.hydra/``), to
    none, saying so: absent would read as another value and split cells."""
    for fact in RUN_FACTS:
        having = sum(r.summary.get(fact) is not None for r in runs)
        if having == len(runs):
            for r in runs:
                r.summary["overrides"] = [
                    *r.summary.get("overrides", []),
                    f"{fact}={r.summary[fact]}",
                ]
        elif having:
            print(
                f"collect: {fact} left out of the cells: {len(runs) - having} of {len(runs)} "
                "runs do not record it (older runs)",
                file=sys.stderr,
            )


def load_runs(root: Path) -> tuple[list[Run], list[LeftOut], list[Run]]:
    """Every run under ``root``: finished ones (``summary.json``) and stopped ones that
    evaluated at least once (``metrics.jsonl``), then those left out: the failed ones
    (``failed.json``) and the others (failed at start-up, stopped or still running before the
    first evaluation); and the failed ones that record what they were, as runs with no
    metric (``failed``), for their cells."""
    # .hydra, stdout.log (run_parallel.py's): a run that failed early
    markers = ("summary.json", "metrics.jsonl", "failed.json", ".hydra", "stdout.log")
    dirs = sorted({p.parent for name in markers for p in root.rglob(name)})
    runs, failed, failed_runs = [], [], []
    for d in dirs:
        if (reason := _failure(d)) is not None:
            failed.append(LeftOut(d, reason))
            if (record := _run_record(d)) is not None:
                config, overrides, facts = record
                # its task and attention as a finished run's summary has them: without its
                # data a failed run formed a task table of its own (a review's find)
                summary = {"overrides": overrides, **_identity(config), **facts}
                failed_runs.append(Run(d, summary, failed=True))
        elif (d / "summary.json").exists():
            summary = json.loads((d / "summary.json").read_text())
            runs.append(Run(d, summary, partial=bool(summary.get("stopped_early"))))
        elif (summary := _partial_summary(d)) is not None:
            runs.append(Run(d, summary, partial=True))
        else:  # listed under the tables too: a cell's seed count drops without it
            failed.append(LeftOut(d, "has no summary and no evaluation yet"))
    _add_run_facts(runs + failed_runs)
    if not runs:
        raise FileNotFoundError(
            f"no summary.json or metrics.jsonl of a run that did not fail under {root} "
            f"({len(failed)} left out; is it a run root?)"
        )
    return runs, failed, failed_runs


def drop_overrides(runs: list[Run], keys: list[str]) -> None:
    """Removes the overrides of ``keys`` and of the keys under them (``logger.mode`` under
    ``logger``) from every run's summary: they define no cell."""
    for run in runs:
        run.summary["overrides"] = [
            o
            for o in run.summary.get("overrides", [])
            if not is_under(o.split("=", 1)[0].lstrip("+~"), keys)
        ]


def overrides_of(summary: dict) -> dict[str, str]:
    """The run's command-line overrides as ``{key: value}``, without the seed; a value as
    Hydra reads it (``optim.lr=1e-3`` and ``optim.lr=0.001`` are one cell, ``0.001``)."""
    pairs = (o.split("=", 1) for o in summary.get("overrides", []) if "=" in o)
    return {k.lstrip("+~"): _canonical(k, v) for k, v in pairs if k.lstrip("+~") not in SEED_KEYS}


def _canonical(key: str, value: str) -> str:
    """An override's value as text that is equal where Hydra's values are: a number or a
    boolean written either way (a whole number as an int: ``0.0`` and ``0``, ``1e4`` and
    ``10000``), a string quoted or not; other values (lists) as written."""
    try:
        parsed = _OVERRIDES_PARSER.parse_override(f"{key}={value}").value()
    except HydraException:  # not an override Hydra would take; as written
        return value
    if isinstance(parsed, bool) or parsed is None:
        return {True: "true", False: "false", None: "null"}[parsed]
    if isinstance(parsed, str):
        return parsed
    if isinstance(parsed, int | float):  # 0 and 0.0, 1e4 and 10000: one float to Hydra's schema
        return repr(int(parsed)) if float(parsed).is_integer() else repr(float(parsed))
    return value


def _is_task_key(key: str) -> bool:
    return key in TASK_KEYS or key.startswith("data.")


def _varying(summaries: list[dict]) -> tuple[list[str], dict[str, str]]:
    runs = [overrides_of(s) for s in summaries]
    keys = sorted({k for r in runs for k in r})
    varying = [k for k in keys if len({r.get(k) for r in runs}) > 1]
    common = {k: runs[0][k] for k in keys if k not in varying}
    return varying, common


def _label(overrides: dict[str, str], keys: list[str]) -> str:
    """``k=v`` for the keys the run sets (a key another run sets and this one does not, such as
    ``attention.detach_mileage``, is left out); ``(defaults)`` when it sets none of them."""
    if not keys:
        return ALL_RUNS
    return " ".join(f"{k}={overrides[k]}" for k in keys if k in overrides) or DEFAULTS


def cells(summaries: list[dict]) -> tuple[list[str], dict[str, str]]:
    """Each run's cell (the overrides that vary between runs, e.g. ``attention=rope``) and the
    overrides every run shares."""
    varying, common = _varying(summaries)
    return [_label(overrides_of(s), varying) for s in summaries], common


def tasks_and_variants(summaries: list[dict]) -> list[tuple[str, str]]:
    """Each run's ``(task, variant)``: its cell split into the task overrides and the rest."""
    varying, _ = _varying(summaries)
    # experiment, then data, then data.*: the most telling first
    task_keys = sorted(
        (k for k in varying if _is_task_key(k)), key=lambda k: (k != "experiment", k)
    )
    other = [k for k in varying if not _is_task_key(k)]
    out = []
    for s in summaries:
        o = overrides_of(s)
        task = _label(o, task_keys) if task_keys else str(s.get("data", ALL_RUNS))
        if task == DEFAULTS and "data" in s:  # no task override: the default data, by name
            task = f"data={s['data']}"
        out.append((task, _label(o, other)))
    return out


def default_metrics(summaries: list[dict]) -> list[str]:
    """Every error rate / perplexity any run has (first-seen order), then DEFAULT_KEYS."""
    keys: dict[str, None] = {}
    for s in summaries:
        keys.update({k: None for k in s if k.endswith(DEFAULT_SUFFIXES)})
    return list(keys) + [k for k in DEFAULT_KEYS if any(k in s for s in summaries)]


def _steps(runs: list[Run]) -> str:
    steps = sorted({r.summary.get("steps") for r in runs if r.summary.get("steps") is not None})
    text = "-" if not steps else str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    return text + ("*" if any(r.partial for r in runs) else "")


def _cell_keys(runs: list[Run]) -> list[tuple[str, str, str]]:
    """Each run's ``(task, variant, cell)``."""
    summaries = [r.summary for r in runs]
    labels = cells(summaries)[0]
    return [(*tv, label) for tv, label in zip(tasks_and_variants(summaries), labels, strict=True)]


def _recency(run: Run) -> float:
    """When the run last wrote its summary, metrics or failure (the newest mtime)."""
    files = [run.path / name for name in ("summary.json", "metrics.jsonl", "failed.json")]
    return max((f.stat().st_mtime for f in files if f.exists()), default=0.0)


def drop_repeats(
    runs: list[Run], failed_runs: list[Run]
) -> tuple[list[Run], list[Run], list[LeftOut]]:
    """One run per cell and seed: where a seed ran more than once in a cell (a subset re-run
    into the same root gets new directories), a run that did not fail counts over the failed
    ones (a seed re-run after a crash), then the one with the most steps, then the newest; the
    others are left out. Returns the kept runs and failed runs (in their lists' order) and
    those left out."""
    everyone = runs + failed_runs
    by_seed: dict[tuple, list[Run]] = {}
    for key, run in zip(_cell_keys(everyone), everyone, strict=True):
        by_seed.setdefault((*key, run.summary.get("seed")), []).append(run)
    kept_ids, left_out = set(), []
    for (*_, cell, seed), members in by_seed.items():
        best = max(members, key=lambda r: (not r.failed, r.summary.get("steps") or 0, _recency(r)))
        kept_ids.add(id(best))
        reason = f"repeats seed {seed} of cell {cell}; {best.path} counts"
        left_out += [LeftOut(r.path, reason) for r in members if r is not best]
    kept = [r for r in runs if id(r) in kept_ids]
    return kept, [r for r in failed_runs if id(r) in kept_ids], left_out


def aggregate(runs: list[Run], metrics: list[str]) -> list[dict]:
    """One row per cell: ``cell``, ``task``, ``variant``, ``seeds`` (the runs that did not
    fail), ``failed`` (those that did: ``Run.failed``, in no mean), ``steps`` (``*``: some
    runs stopped early) and per metric ``(mean, std)`` over the runs that have it as a finite
    number (std NaN for one such run), with that count as ``<metric>:n``: a run that lacks a
    metric, has it as null, or diverged to NaN or inf is skipped for it, and the tables say
    how many of the cell's seeds a value covers. A cell whose every run failed has a row of
    no values. Sorted by task, then variant."""
    by_cell: dict[tuple[str, str, str], list[Run]] = {}
    for key, run in zip(_cell_keys(runs), runs, strict=True):
        by_cell.setdefault(key, []).append(run)
    rows = []
    for (task, variant, cell), everyone in sorted(
        by_cell.items(), key=lambda item: tuple(map(_natural, item[0]))
    ):
        members = [r for r in everyone if not r.failed]
        row: dict = {
            "cell": cell,
            "task": task,
            "variant": variant,
            "seeds": len(members),
            "failed": len(everyone) - len(members),
            "steps": _steps(members),
        }
        for m in metrics:
            values = [
                r.summary[m]
                for r in members
                if isinstance(r.summary.get(m), (int, float))
                and not isinstance(r.summary[m], bool)
                and math.isfinite(r.summary[m])
            ]
            row[f"{m}:values"] = values
            row[f"{m}:n"] = len(values)
            mean = statistics.fmean(values) if values else math.nan
            std = statistics.stdev(values) if len(values) > 1 else math.nan
            row[m] = (mean, std)
        rows.append(row)
    return rows


def _natural(text: str) -> tuple:
    """A sort key that orders the numbers inside ``text`` by value (``d_model=64`` before
    ``d_model=128``): its text and numbers alternate, so equal places hold equal types."""
    parts = re.split(r"(\d+(?:\.\d+)?)", text)
    return tuple(float(p) if i % 2 else p for i, p in enumerate(parts))


def _fmt(mean: float, std: float, n: int, seeds: int) -> str:
    """``mean ± std``, with ``(n/seeds)`` when fewer of the cell's runs have the metric."""
    if math.isnan(mean):
        return "-"
    digits = ".4g"
    text = f"{mean:{digits}}" if math.isnan(std) else f"{mean:{digits}} ± {std:{digits}}"
    return text if n == seeds else f"{text} ({n}/{seeds})"


def markdown(rows: list[dict], metrics: list[str], label: str = "cell") -> str:
    """A table of ``rows``: the ``label`` column (``cell`` or ``variant``), seeds, the metrics
    any row has, and steps where they differ or some run stopped early."""
    shown = [m for m in metrics if any(not math.isnan(r[m][0]) for r in rows)]
    ran = [r for r in rows if r["seeds"]]  # a cell whose every run failed has no steps ("-")
    steps = len({r["steps"] for r in ran}) > 1 or any(r["steps"].endswith("*") for r in ran)
    failed = any(r["failed"] for r in rows)
    table = [
        {
            label: r[label],
            "seeds": r["seeds"],
            "failed": r["failed"],
            "steps": r["steps"],
            **{m: _fmt(*r[m], r[f"{m}:n"], r["seeds"]) for m in shown},
        }
        for r in rows
    ]
    columns = [
        label,
        "seeds",
        *shown,
        *(["steps"] if steps else []),
        *(["failed"] if failed else []),
    ]
    return markdown_table(table, columns)


def report(
    rows: list[dict],
    metrics: list[str],
    common: dict[str, str],
    command: str,
    left_out: list[LeftOut],
) -> str:
    """``results.md``: the shared overrides, one table (or one per task), the runs left out
    (failed, repeated seeds) and the command."""
    parts = [f"Every run: {' '.join(f'{k}={v}' for k, v in common.items())}\n"] if common else []
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    if len(tasks) == 1:
        parts.append(markdown(rows, metrics))
    else:
        for task in tasks:
            parts.append(
                f"### {task}\n\n"
                + markdown([r for r in rows if r["task"] == task], metrics, "variant")
            )
    if any(r["steps"].endswith("*") for r in rows):
        parts.append("`*`: some runs stopped early; their last evaluation is counted.\n")
    if left_out:
        parts.append(
            "Left out:\n\n" + "".join(f"- `{run.path}`: {run.reason}\n" for run in left_out)
        )
    parts.append(f"Made by `{command}`.\n")
    return "\n".join(parts)


def write_csvs(
    runs: list[Run], rows: list[dict], metrics: list[str], out: Path, root: Path
) -> None:
    """``results.csv`` (a row per cell, ``<metric>_mean`` / ``<metric>_std`` / ``<metric>_n``,
    the runs the two cover) and ``runs.csv`` (a row per run that did not fail; ``runs`` may
    hold failed ones, which place the cells)."""
    head = ["task", "variant", "cell", "seeds", "failed", "steps"]
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(head + [f"{m}_{s}" for m in metrics for s in ("mean", "std", "n")])
        for r in rows:
            writer.writerow(
                [r[k] for k in head] + [v for m in metrics for v in (*map(_num, r[m]), r[f"{m}:n"])]
            )
    summaries = [r.summary for r in runs]
    labelled = zip(runs, cells(summaries)[0], tasks_and_variants(summaries), strict=True)
    with (out / "runs.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["dir", "task", "variant", "cell", "seed", "steps", "partial", *metrics])
        for run, label, (task, variant) in labelled:
            if run.failed:  # listed under the tables, with their errors
                continue
            s = run.summary
            values = [_num(s.get(m)) for m in metrics]
            writer.writerow(
                [
                    run.path.relative_to(root).as_posix(),  # nested roots: names repeat
                    task,
                    variant,
                    label,
                    s.get("seed"),
                    s.get("steps"),
                    run.partial,
                    *values,
                ]
            )


def _num(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


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


def _colours(variants: list[str]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {v: cycle[i % len(cycle)] for i, v in enumerate(variants)}


def _save_with_legend(fig, path: Path) -> None:
    """One legend for every panel, below them (the variants' colours are shared)."""
    labelled = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    fig.tight_layout()
    if labelled:  # matplotlib cannot lay out a legend of no entries
        fig.legend(
            labelled.values(),
            labelled.keys(),
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=min(3, len(labelled)),
            fontsize=8,
            frameon=False,
        )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_curves(runs: list[Run], path: Path) -> None:
    """Training loss against step: a panel per task, a line per run, a colour per variant."""
    tv = tasks_and_variants([r.summary for r in runs])
    tasks = sorted({t for t, _ in tv})
    colours = _colours(sorted({v for _, v in tv}))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        labelled = set()
        for run, (t, variant) in zip(runs, tv, strict=True):
            losses = run.losses()
            if t != task or not losses:
                continue
            steps, values = zip(*losses, strict=True)
            label = None if variant in labelled else variant
            labelled.add(variant)
            ax.plot(steps, values, ".-", color=colours[variant], lw=1, ms=2, alpha=0.8, label=label)
        if all(v > 0 for line in ax.get_lines() for v in line.get_ydata()) and ax.get_lines():
            ax.set_yscale("log")
        ax.set_title(textwrap.fill(task, 60), fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
    _save_with_legend(fig, path)


def plot_by_split(rows: list[dict], metrics: list[str], suffix: str, path: Path) -> bool:
    """Per task, a group of bars per metric of ``metrics`` ending in ``suffix`` (one per eval
    split, in the order of ``metrics``) and a
    bar per variant: the mean, the std as error bar, each seed a dot. Error rates in %.
    Returns False (no file) when no row has such a metric."""
    metrics = [m for m in metrics if m.endswith(suffix)]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    tasks = [
        t
        for t in tasks
        if any(not math.isnan(r[m][0]) for r in rows if r["task"] == t for m in metrics)
    ]
    if not tasks:
        return False
    scale = 100.0 if suffix == "/err" else 1.0
    colours = _colours(sorted({r["variant"] for r in rows}))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        members = [r for r in rows if r["task"] == task]
        splits = [m for m in metrics if any(not math.isnan(r[m][0]) for r in members)]
        width = 0.8 / len(members)
        for i, r in enumerate(members):
            xs = [s + (i - (len(members) - 1) / 2) * width for s in range(len(splits))]
            means = [scale * r[m][0] for m in splits]
            stds = [0.0 if math.isnan(r[m][1]) else scale * r[m][1] for m in splits]
            c = colours[r["variant"]]
            ax.bar(xs, means, width, yerr=stds, capsize=2, color=c, alpha=0.7, label=r["variant"])
            for x, m in zip(xs, splits, strict=True):
                values = r[f"{m}:values"]
                ax.scatter([x] * len(values), [scale * v for v in values], s=8, color="k", zorder=3)
        ax.set_xticks(range(len(splits)), [m.removesuffix(suffix) for m in splits], fontsize=8)
        ax.set_ylabel("error rate (%)" if suffix == "/err" else suffix.strip("/"))
        if suffix == "/err":
            ax.set_ylim(0, 105)
        ax.set_title(textwrap.fill(task, 60), fontsize=8)
    _save_with_legend(fig, path)
    return True


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun_dir", type=Path, help="a multirun or run_parallel.py root")
    parser.add_argument(
        "--metrics",
        help="comma-separated summary keys (default: error rates "
        "or perplexities per split, best_val_loss, tokens_per_s)",
    )
    parser.add_argument(
        "--ignore",
        default="",
        help="comma-separated override keys that define no cell, with the keys under them "
        "(e.g. data.eval_samples). How a run was carried out (lm.config.RUN_CONDUCT_KEYS) "
        f"never forms a cell, except the keys that change its speed ({', '.join(SPEED_KEYS)}): "
        "name those here to merge them",
    )
    parser.add_argument("--out", type=Path, help="output directory (default: multirun_dir)")
    args = parser.parse_args(argv)
    if not args.multirun_dir.is_dir():
        parser.error(f"multirun_dir {str(args.multirun_dir)!r} is not a directory")
    runs, failed, failed_runs = load_runs(args.multirun_dir)
    ignored = [k for k in args.ignore.split(",") if k]
    set_keys = {
        o.split("=", 1)[0].lstrip("+~") for r in runs for o in r.summary.get("overrides", [])
    }
    for key in ignored:
        if not any(is_under(k, [key]) for k in set_keys):
            print(f"collect: --ignore {key}: no run sets it (a typo?)", file=sys.stderr)
    drop_overrides(runs + failed_runs, [*NO_CELL_KEYS, *ignored])
    runs, failed_runs, repeats = drop_repeats(runs, failed_runs)
    repeated = {r.path for r in repeats}
    left_out = [r for r in failed if r.path not in repeated] + repeats
    for run in left_out:
        print(f"collect: {run.path} left out: {run.reason}", file=sys.stderr)
    summaries = [r.summary for r in runs]
    metrics = args.metrics.split(",") if args.metrics else default_metrics(summaries)
    missing = [m for m in metrics if not any(m in s for s in summaries)]
    if missing:
        raise SystemExit(f"--metrics: {missing} in no summary; keys: {sorted(summaries[0])}")
    # the failed runs place their cells (a cell whose every seed failed has a row) and the
    # overrides every run shares
    everyone = runs + failed_runs
    rows = aggregate(everyone, metrics)
    out = args.out or args.multirun_dir
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(
        ["python", "experiments/collect.py", *(sys.argv[1:] if argv is None else argv)]
    )
    table = report(rows, metrics, cells([r.summary for r in everyone])[1], command, left_out)
    (out / "results.md").write_text(table)
    write_csvs(everyone, rows, metrics, out, args.multirun_dir)
    plot(rows, metrics, out / "results.png")
    plot_curves(runs, out / "curves.png")
    written = ["results.md", "results.csv", "runs.csv", "results.png", "curves.png"]
    for suffix, name in (("/err", "errors.png"), ("/ppl", "ppl.png")):
        if plot_by_split(rows, metrics, suffix, out / name):
            written.append(name)
    print(table, end="")
    print(f"wrote {', '.join(written)} into {out}")
    return table


if __name__ == "__main__":
    main()
