"""Runs several ``train.py`` jobs at once on one machine, as separate processes.

    python experiments/run_parallel.py --root runs/synth -j 10 \\
        "experiment=synth_counting attention=rope,corope seed=0,1,2" \\
        "experiment=synth_counting attention=corope attention.detach_mileage=true seed=0,1,2"

Each positional argument is a sweep spec: space-separated overrides, where ``key=a,b`` takes
every value (Hydra's multirun syntax; commas inside ``[...]``, ``{...}`` or quotes do not
split). A spec expands to the product of its values; the jobs are the specs' expansions in
order, ``--common`` overrides appended to each. Small models do not fill a GPU, so
``-j/--max-parallel`` jobs share it (``--gpus 0,1`` deals them round-robin to several).

Job ``i`` runs ``python train.py <overrides> hydra.run.dir=<root>/<i>-<overrides>`` in the
repository root, its stdout and stderr going to ``stdout.log`` in that directory. The root
gets ``jobs.tsv`` (index, status, seconds, directory, command), rewritten as jobs finish.
``experiments/collect.py <root>`` tables the finished runs. The exit status is 0 when every
job succeeded and 1 otherwise; SIGTERM or Ctrl-C (an outer ``timeout``) stops the running
jobs before exiting.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train.py"
_OPENERS, _CLOSERS = "[{(", "]})"


def _split(text: str, separators: str) -> list[str]:
    """``text`` cut at the ``separators`` that stand outside brackets and quotes (quotes kept:
    Hydra reads them, e.g. ``a='p,q'`` is the one string ``p,q``)."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth -= 1
        elif ch in separators and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def overrides(text: str) -> list[str]:
    """Space-separated overrides, quotes and brackets kept whole (unlike ``shlex.split``,
    which drops the quotes Hydra needs)."""
    return [o for o in _split(text, " \t\n") if o]


def split_values(value: str) -> list[str]:
    """``"a,b,[1,2]"`` -> ``["a", "b", "[1,2]"]``: commas outside brackets and quotes."""
    parts = _split(value, ",")
    if any(p == "" for p in parts):
        raise ValueError(f"empty value in sweep {value!r}")
    return parts


def expand(spec: str) -> list[list[str]]:
    """The jobs of one sweep spec: ``"a=1,2 b=x"`` -> ``[["a=1", "b=x"], ["a=2", "b=x"]]``."""
    choices = []
    for override in overrides(spec):
        if "=" not in override:
            raise ValueError(f"sweep spec {spec!r}: {override!r} is not key=value")
        key, value = override.split("=", 1)
        choices.append([f"{key}={v}" for v in split_values(value)])
    if not choices:
        raise ValueError("empty sweep spec")
    return [list(job) for job in itertools.product(*choices)]


def slug(overrides: list[str], limit: int = 80) -> str:
    """A directory-name-safe summary of the overrides (``experiment=a seed=1`` -> ``a_seed1``)."""
    words = []
    for o in overrides:
        key, value = o.split("=", 1)
        short = key.rsplit(".", 1)[-1].lstrip("+~")
        words.append(value if short in ("experiment", "attention") else f"{short}{value}")
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "_".join(words))[:limit]


@dataclass
class Job:
    index: int
    overrides: list[str]
    run_dir: Path
    gpu: str | None = None
    status: str = "pending"
    seconds: float = 0.0
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started: float = 0.0

    @property
    def command(self) -> list[str]:
        return [sys.executable, str(TRAIN), *self.overrides, f"hydra.run.dir={self.run_dir}"]


def plan(specs: list[str], common: list[str], root: Path, gpus: list[str]) -> list[Job]:
    """The jobs of ``specs`` (each with ``common`` appended), numbered in order."""
    jobs = []
    for spec in specs:
        for job in expand(spec):
            i = len(jobs)
            run_dir = root / f"{i:03d}-{slug(job)}"
            gpu = gpus[i % len(gpus)] if gpus else None
            jobs.append(Job(i, [*job, *common], run_dir, gpu))
    return jobs


def _write_table(root: Path, jobs: list[Job]) -> None:
    lines = ["index\tstatus\tseconds\tdir\tcommand"]
    for j in jobs:
        cmd = shlex.join(j.command)
        lines.append(f"{j.index}\t{j.status}\t{j.seconds:.0f}\t{j.run_dir.name}\t{cmd}")
    (root / "jobs.tsv").write_text("\n".join(lines) + "\n")


def _start(job: Job, threads: int) -> None:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if job.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = job.gpu
    log = (job.run_dir / "stdout.log").open("w")
    log.write("$ " + shlex.join(job.command) + "\n")
    log.flush()
    # A new session: stopping a job stops its workers too (compile pools, data loaders).
    job.proc = subprocess.Popen(
        job.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    job.started = time.monotonic()
    job.status = "running"


def _stop(jobs: list[Job], status: str) -> None:
    """SIGTERM to each job's process group, SIGKILL to those still alive 10 s later."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = [j for j in jobs if j.proc is not None and j.proc.poll() is None]
        for job in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.proc.pid, sig)
        deadline = time.monotonic() + grace
        for job in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.proc.wait(max(0.0, deadline - time.monotonic()))
    for job in jobs:
        job.status, job.seconds = status, time.monotonic() - job.started


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped(signal.Signals(signum).name)


def run(jobs: list[Job], root: Path, max_parallel: int, job_timeout: float | None) -> int:
    """Runs ``jobs``, at most ``max_parallel`` at a time; returns the number that failed."""
    root.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // max_parallel)
    pending, running = list(jobs), []
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        while pending or running:
            while pending and len(running) < max_parallel:
                job = pending.pop(0)
                running.append(job)  # first, so that a stop in the middle of the start sees it
                _start(job, threads)
                print(f"[{job.index}] started: {' '.join(job.overrides)}", flush=True)
            _write_table(root, jobs)
            time.sleep(0.5)
            for job in list(running):
                rc = job.proc.poll()
                elapsed = time.monotonic() - job.started
                if rc is None and job_timeout is not None and elapsed > job_timeout:
                    _stop([job], "timeout")
                elif rc is None:
                    continue
                else:
                    job.status, job.seconds = ("ok" if rc == 0 else f"failed rc={rc}"), elapsed
                running.remove(job)
                print(
                    f"[{job.index}] {job.status} after {job.seconds:.0f} s: {job.run_dir}",
                    flush=True,
                )
    except (KeyboardInterrupt, _Stopped) as e:
        print(f"stopping {len(running)} running jobs ({type(e).__name__} {e})", flush=True)
        _stop(running, "stopped")
        for job in pending:
            job.status = "not started"
    except BaseException:  # e.g. an OSError starting a job: leave no job running behind us
        _stop(running, "stopped")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        _write_table(root, jobs)
    failed = [j for j in jobs if j.status != "ok"]
    print(f"{len(jobs) - len(failed)}/{len(jobs)} jobs ok; table: {root / 'jobs.tsv'}")
    for j in failed:
        print(f"  [{j.index}] {j.status}: {j.run_dir / 'stdout.log'}")
    return len(failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "specs", nargs="+", help='sweep specs, e.g. "attention=rope,corope seed=0,1"'
    )
    parser.add_argument("--root", type=Path, required=True, help="one directory per job under it")
    parser.add_argument("-j", "--max-parallel", type=int, default=4, help="jobs at once (4)")
    parser.add_argument("--common", default="", help="overrides appended to every job")
    parser.add_argument("--gpus", default="", help="comma-separated GPU ids, dealt round-robin")
    parser.add_argument(
        "--job-timeout",
        type=float,
        help="seconds after which a job is stopped (its "
        "metrics.jsonl keeps the evaluations done so far; collect.py marks it partial). "
        "train.max_minutes in --common stops jobs gracefully, with a final evaluation",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    if args.max_parallel < 1:
        parser.error(f"--max-parallel must be >= 1, got {args.max_parallel}")
    gpus = [g for g in args.gpus.split(",") if g]
    try:
        jobs = plan(args.specs, overrides(args.common), args.root.resolve(), gpus)
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        for job in jobs:
            print(shlex.join(job.command))
        return 0
    return 1 if run(jobs, args.root.resolve(), args.max_parallel, args.job_timeout) else 0


if __name__ == "__main__":
    sys.exit(main())
