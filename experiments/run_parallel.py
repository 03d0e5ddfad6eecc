"""Runs several ``train.py`` jobs at once on one machine, as separate processes.

    python experiments/run_parallel.py --root runs/synth -j 10 \\
        "experiment=synth_counting attention=rope,corope seed=0,1,2" \\
        "experiment=synth_counting attention=corope attention.detach_mileage=true seed=0,1,2"

Each positional argument is a sweep spec: space-separated overrides, where ``key=a,b`` takes
every value (Hydra's multirun syntax; commas inside ``[...]``, ``{...}`` or quotes do not
split). A spec expands to the product of its values; the jobs are the specs' expansions in
order, ``--common`` overrides appended to each. Hydra's sweep functions (``range(0,3)``,
``choice(a,b)``) are refused: list the values. Small models do not fill a GPU, so
``-j/--max-parallel`` jobs share it (``--gpus 0,1`` spreads them over several: a starting job
gets the GPU running the fewest jobs, the first listed on a tie).

Job ``i`` runs ``python <repository>/train.py <overrides> hydra.run.dir=<root>/<i>-<spec's
overrides>`` in the caller's directory, as ``--root`` is (relative data paths in the overrides
resolve against it; ``--common`` overrides are not in the directory name), its stdout and
stderr appended to ``stdout.log`` in that directory under a line per launch (time, command).
``jobs.tsv`` in the root has a row per job and launch (index, status, seconds, directory,
command, GPU, launch time): the rows earlier launches left, then this launch's, rewritten as
its jobs finish, so a directory's last row is its latest launch.
``experiments/collect.py <root>`` tables the finished runs. The exit status is 0 when every
job succeeded and 1 otherwise; SIGTERM or Ctrl-C (an outer ``timeout``) stops the running
jobs before exiting, and a second one during the stop's grace period kills them at once.

Relaunching into the same root: a job whose directory holds ``checkpoint.pt`` is not started
(``train.py`` would refuse it, after Hydra had rewritten its ``.hydra`` records) unless its
overrides set ``train.resume=true`` or ``train.overwrite=true``; its row says so and it counts
as failed. To resume stopped runs, relaunch the same specs with ``--common
"train.resume=true"`` (inside a spec it would change the directory name: a new run).
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

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lm.checkpoint import checkpoint_path  # noqa: E402
from lm.config import register_configs  # noqa: E402

TRAIN = ROOT / "train.py"
_OPENERS, _CLOSERS = "[{(", "]})"
# Hydra's sweep functions; its cast functions (int(...), str(...), ...) are single values.
_SWEEP_FUNCTION = re.compile(r"\s*(choice|range|interval|glob|sort|shuffle|tag)\s*\(")
TABLE_HEADER = "index\tstatus\tseconds\tdir\tcommand\tgpu\tlaunch"


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
            if depth < 0:
                raise ValueError(f"{text!r} closes a bracket it did not open")
        elif ch in separators and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if quote or depth:
        what = f"a {quote} quote" if quote else "a bracket"
        raise ValueError(f"{text!r} leaves {what} open (Hydra refuses it too)")
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
        if _SWEEP_FUNCTION.match(value):
            raise ValueError(
                f"sweep spec {spec!r}: {override!r} is a Hydra sweep function, which is not "
                "expanded here: list the values (key=a,b,c)"
            )
        choices.append([f"{key}={v}" for v in split_values(value)])
    if not choices:
        raise ValueError("empty sweep spec")
    return [list(job) for job in itertools.product(*choices)]


# Config groups (configs/<group>/): an override choosing one names the run by its choice.
GROUPS = frozenset(d.name for d in (ROOT / "configs").iterdir() if d.is_dir()) - {"hydra"}


def slug(overrides: list[str], limit: int = 80) -> str:
    """A directory-name-safe summary of the overrides (``experiment=a data=b seed=1`` ->
    ``a_b_seed1``: a config group's choice alone, any other key with its value)."""
    words = []
    for o in overrides:
        key, value = o.split("=", 1)
        key = key.lstrip("+~")
        words.append(value if key in GROUPS else f"{key.rsplit('.', 1)[-1]}{value}")
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


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def plan(specs: list[str], common: list[str], root: Path) -> list[Job]:
    """The jobs of ``specs`` (each with ``common`` appended), numbered in order.

    Raises:
        ValueError: a ``common`` override sweeps several values (it would reach train.py
            unexpanded), or sets a key a spec also sets (the later one wins in Hydra, so the
            run would not be what its directory, named after the spec, says).
    """
    for override in common:
        if "=" in override and len(split_values(override.split("=", 1)[1])) > 1:
            raise ValueError(f"--common {override!r} sweeps several values: put it in a spec")
    common_keys = {_key(o) for o in common}
    jobs = []
    for spec in specs:
        for job in expand(spec):
            both = sorted(common_keys & {_key(o) for o in job})
            if both:
                raise ValueError(f"--common and the spec {spec!r} both set {both}: set each once")
            i = len(jobs)
            jobs.append(Job(i, [*job, *common], root / f"{i:03d}-{slug(job)}"))
    return jobs


def _composed(overrides: list[str]) -> DictConfig | None:
    """The root config ``train.py`` composes from ``overrides`` (Hydra's own ``hydra.*`` left
    out), or None where they do not compose: train.py then fails on them before Hydra writes
    into the run directory."""
    register_configs()
    options = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            return compose("train", overrides=options)
    except HydraException:
        return None


def refusal(job: Job) -> str | None:
    """Why ``job`` must not start (its checkpoint, ``train.ckpt_path`` under its directory,
    exists and its config neither resumes nor overwrites it: train.py would refuse it after
    Hydra had rewritten the directory's ``.hydra``), or None. The config is composed as
    train.py composes it, so presets, ``train.resume=yes`` and the like count as they do
    there."""
    cfg = _composed(job.overrides)
    if cfg is None or cfg.train.resume or cfg.train.overwrite:
        return None
    path = checkpoint_path(cfg.train.ckpt_path, job.run_dir)
    if not path.exists():
        return None
    return (
        f"not started: {path.name} exists; relaunch with --common train.resume=true to "
        "resume it or train.overwrite=true to start afresh"
    )


def pick_gpu(gpus: list[str], running: list[Job]) -> str | None:
    """The GPU of ``gpus`` running the fewest of the ``running`` jobs, the first listed on a
    tie (None without GPUs): chosen when a job starts, as jobs finish in any order."""
    if not gpus:
        return None
    load = {gpu: sum(j.gpu == gpu for j in running) for gpu in gpus}
    return min(gpus, key=load.__getitem__)


def physical_gpus(gpus: list[str], inherited: str | None) -> list[str]:
    """``--gpus`` as the jobs' ``CUDA_VISIBLE_DEVICES`` entries: under an inherited mask (a
    scheduler's ``CUDA_VISIBLE_DEVICES=4,5``) the ids number the GPUs this process sees, 0 and
    1 there, so they go through the mask (replacing it sent jobs to GPUs 0 and 1, another
    allocation's); ValueError for an id the mask lacks."""
    if not inherited:
        return gpus
    mask = inherited.split(",")
    for gpu in gpus:
        if not (gpu.isdecimal() and int(gpu) < len(mask)):
            raise ValueError(
                f"--gpus {gpu}: this process sees CUDA_VISIBLE_DEVICES={inherited}, "
                f"{len(mask)} GPUs: give ids from 0 to {len(mask) - 1}"
            )
    return [mask[int(gpu)] for gpu in gpus]


def _previous_rows(root: Path) -> list[str]:
    """The rows of an earlier launch's ``jobs.tsv`` in ``root``, kept as they are (rows from
    before the gpu and launch columns have fewer fields: readers see those as missing)."""
    table = root / "jobs.tsv"
    return table.read_text().splitlines()[1:] if table.exists() else []


def _write_table(root: Path, previous: list[str], jobs: list[Job], launch: str) -> None:
    lines = [TABLE_HEADER, *previous]
    for j in jobs:
        cmd = shlex.join(j.command)
        lines.append(
            f"{j.index}\t{j.status}\t{j.seconds:.0f}\t{j.run_dir.name}\t{cmd}\t{j.gpu or ''}"
            f"\t{launch}"
        )
    (root / "jobs.tsv").write_text("\n".join(lines) + "\n")


def _start(job: Job, threads: int) -> None:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if job.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = job.gpu
    # Appended: a relaunch into the same directory keeps the earlier launches' output.
    log = (job.run_dir / "stdout.log").open("a")
    log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {shlex.join(job.command)}\n")
    log.flush()
    # A new session: stopping a job stops its workers too (compile pools, data loaders). In the
    # caller's directory, as --root: relative data paths in the overrides resolve against it.
    job.proc = subprocess.Popen(
        job.command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    job.started = time.monotonic()
    job.status = "running"


def _signal(jobs: list[Job], sig: signal.Signals) -> list[Job]:
    """Sends ``sig`` to the process group of each of ``jobs`` still alive; returns those."""
    alive = [j for j in jobs if j.proc is not None and j.proc.poll() is None]
    for job in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.proc.pid, sig)
    return alive


def _stop(jobs: list[Job], status: str) -> None:
    """SIGTERM to each job's process group, SIGKILL to those still alive 10 s later; those
    signalled get ``status``, a job that had ended before its own (its exit status's)."""
    ended = {id(j): j.proc.poll() for j in jobs if j.proc is not None and j.proc.poll() is not None}
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = _signal(jobs, sig)
        deadline = time.monotonic() + grace
        for job in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.proc.wait(max(0.0, deadline - time.monotonic()))
    for job in jobs:
        rc = ended.get(id(job))
        job.status = status if rc is None else _exit_status(rc)
        job.seconds = time.monotonic() - job.started


def _exit_status(rc: int) -> str:
    return "ok" if rc == 0 else f"failed rc={rc}"


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals_deferred():
    """SIGTERM and Ctrl-C wait for the block's end, then raise as they would have: between
    ``Popen``'s return and ``job.proc``'s assignment a stop found no process to stop, and the
    job ran on in its own session. (Blocking them would leave them blocked in the job too.)"""
    received = []
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in handlers:
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if received:
        if received[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Stopped(signal.Signals(received[0]).name)


def _shut_down(running: list[Job], pending: list[Job]) -> None:
    """Stops the ``running`` jobs and marks the ``pending`` ones not started. A further
    SIGTERM or Ctrl-C during the stop's grace period kills the jobs at once: they run in
    their own sessions, so nothing else would stop them once we exit."""

    def kill_now(signum, frame):
        _signal(running, signal.SIGKILL)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, kill_now)
    _stop(running, "stopped")
    for job in pending:
        job.status = "not started"


def _refuse(jobs: list[Job]) -> list[Job]:
    """The ``jobs`` that may start; the others get their refusal as status."""
    startable = []
    for job in jobs:
        why = refusal(job)
        if why is None:
            startable.append(job)
        else:
            job.status = why
            print(f"[{job.index}] {why}: {job.run_dir}", flush=True)
    return startable


def run(
    jobs: list[Job],
    root: Path,
    max_parallel: int,
    job_timeout: float | None,
    gpus: list[str] | None = None,
) -> int:
    """Runs ``jobs``, at most ``max_parallel`` at a time, each on the least busy of ``gpus``
    (if any) when it starts; returns the number that failed or were refused."""
    root.mkdir(parents=True, exist_ok=True)
    launch, previous_rows = time.strftime("%Y-%m-%dT%H:%M:%S"), _previous_rows(root)
    threads = max(1, (os.cpu_count() or 1) // max_parallel)
    pending, running = _refuse(jobs), []
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        while pending or running:
            while pending and len(running) < max_parallel:
                job = pending.pop(0)
                job.gpu = pick_gpu(gpus or [], running)
                running.append(job)  # first, so that a stop in the middle of the start sees it
                try:
                    with _signals_deferred():
                        _start(job, threads)
                except OSError as error:  # its directory or log cannot be made: this job fails
                    running.remove(job)
                    job.status = f"failed to start: {error}"
                    print(f"[{job.index}] {job.status}", flush=True)
                    continue
                print(f"[{job.index}] started: {' '.join(job.overrides)}", flush=True)
            _write_table(root, previous_rows, jobs, launch)
            time.sleep(0.5)
            for job in list(running):
                rc = job.proc.poll()
                elapsed = time.monotonic() - job.started
                if rc is None and job_timeout is not None and elapsed > job_timeout:
                    _stop([job], "timeout")
                elif rc is None:
                    continue
                else:
                    job.status, job.seconds = _exit_status(rc), elapsed
                running.remove(job)
                print(
                    f"[{job.index}] {job.status} after {job.seconds:.0f} s: {job.run_dir}",
                    flush=True,
                )
    except (KeyboardInterrupt, _Stopped) as e:
        print(f"stopping {len(running)} running jobs ({type(e).__name__} {e})", flush=True)
        _shut_down(running, pending)
    except BaseException:  # anything unforeseen: leave no job running behind us
        _shut_down(running, pending)
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        _write_table(root, previous_rows, jobs, launch)
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
    parser.add_argument(
        "--gpus",
        default="",
        help="comma-separated GPU ids as this process sees them (under CUDA_VISIBLE_DEVICES, "
        "its GPUs from 0); a job starts on the least busy",
    )
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
    if args.job_timeout is not None and not args.job_timeout > 0:
        parser.error(f"--job-timeout must be > 0 seconds, got {args.job_timeout}")
    try:
        gpus = physical_gpus(
            [g for g in args.gpus.split(",") if g], os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        jobs = plan(args.specs, overrides(args.common), args.root.resolve())
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        for job in jobs:
            print(shlex.join(job.command))
        return 0
    failed = run(jobs, args.root.resolve(), args.max_parallel, args.job_timeout, gpus)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
