"""experiments/run_parallel.py (concurrent train.py jobs) and experiments/collect.py over its
root: finished, stopped and failed jobs, tables, CSV and figures."""

import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import run_parallel
from experiments.run_parallel import expand, main, physical_gpus, plan, run, split_values
from tests.lm.harness import TINY

ROOT = Path(__file__).resolve().parents[2]
SMALL = [*TINY, "data=counting", "data.max_statements=8", "data.seq_len=40", "data.eval_samples=16"]

# A stand-in for train.py: prints its pid and GPU, sleeps `sleep=S` seconds, ignores SIGTERM
# under `ignore_term=true` (as a job stuck in a compile or a data loader may).
FAKE_TRAIN = """
import os, signal, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:])
print("pid", os.getpid(), "gpu", os.environ.get("CUDA_VISIBLE_DEVICES"), "cwd", os.getcwd(),
      flush=True)
if args.get("ignore_term") == "true":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(float(args.get("sleep", 0)))
"""


@pytest.fixture
def fake_train(tmp_path, monkeypatch) -> Path:
    """The path of a fake train.py, which run_parallel runs in this process."""
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    monkeypatch.setattr(run_parallel, "TRAIN", path)
    return path


def table(root: Path) -> list[dict]:
    with (root / "jobs.tsv").open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


def launch_lines(log: Path) -> list[str]:
    """The fake train.py's ``pid ... gpu ...`` lines in a job's ``stdout.log``."""
    return [line for line in log.read_text().splitlines() if line.startswith("pid ")]


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_sweep_specs_expand_like_hydra_multirun():
    assert split_values("a,b,[1,2],{x:1,y:2},'p,q'") == ["a", "b", "[1,2]", "{x:1,y:2}", "'p,q'"]
    assert expand("attention=rope,corope seed=0,1 data=counting") == [
        ["attention=rope", "seed=0", "data=counting"],
        ["attention=rope", "seed=1", "data=counting"],
        ["attention=corope", "seed=0", "data=counting"],
        ["attention=corope", "seed=1", "data=counting"],
    ]
    # quotes survive to Hydra, which reads a quoted value as one string
    assert expand("a='p,q' +tags=['x y'] b=1,2") == [
        ["a='p,q'", "+tags=['x y']", "b=1"],
        ["a='p,q'", "+tags=['x y']", "b=2"],
    ]
    with pytest.raises(ValueError, match="'seed' is not key=value"):
        expand("attention=rope seed")
    with pytest.raises(ValueError, match="empty value"):
        expand("seed=0,")
    with pytest.raises(ValueError, match="'seed=range\\(0,3\\)' is a Hydra sweep function"):
        expand("attention=rope seed=range(0,3)")
    assert expand("a=int(3),str(4)") == [["a=int(3)"], ["a=str(4)"]]  # casts are values
    # an open quote or bracket would swallow the rest of the spec into one override
    with pytest.raises(ValueError, match="leaves a ' quote open"):
        expand("name=it's seed=0,1")
    with pytest.raises(ValueError, match="leaves a bracket open"):
        expand("tags=[a,b seed=0")
    with pytest.raises(ValueError, match="closes a bracket"):
        expand("tags=a] seed=0")


def test_dry_run_prints_one_command_per_job(tmp_path, capsys):
    assert (
        main(["--root", str(tmp_path), "--dry-run", "--common", "logger=none", "a=1,2", "b=3"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith(f"train.py a=1 logger=none hydra.run.dir={tmp_path}/000-a1")
    assert lines[2].endswith(f"train.py b=3 logger=none hydra.run.dir={tmp_path}/002-b3")
    with pytest.raises(SystemExit):
        main(["--root", str(tmp_path), "-j", "0", "a=1"])


@pytest.mark.slow
def test_parallel_jobs_then_collect(tmp_path):
    """Two tiny jobs that finish, one stopped by --job-timeout after a few evaluations, one
    with a bad override: exit status 1, and collect tables the three that evaluated."""
    runs = tmp_path / "runs"
    common = " ".join([*SMALL, "train.eval_every=1", "train.log_every=1"])
    parallel = run_script(
        "experiments/run_parallel.py",
        "--root", str(runs),
        "-j", "2",
        "--job-timeout", "40",
        "--common", common,
        "attention=rope,corope train.steps=2",
        "attention=nope train.steps=100000",
        "attention=rope model.n_layers=2",
    )  # fmt: skip
    assert parallel.returncode == 1, parallel.stdout + parallel.stderr
    with (runs / "jobs.tsv").open() as f:
        jobs = list(csv.DictReader(f, delimiter="\t"))
    assert [j["status"] for j in jobs] == ["ok", "ok", "timeout", "failed rc=1"]
    assert jobs[2]["dir"] == "002-nope_steps100000"
    assert (
        "Key 'n_layers' not in 'ModelConfig'" in (runs / jobs[3]["dir"] / "stdout.log").read_text()
    )
    assert (
        "train.py attention=corope train.steps=2"
        in (runs / jobs[1]["dir"] / "stdout.log").read_text()
    )
    assert "2/4 jobs ok" in parallel.stdout

    collect = run_script("experiments/collect.py", str(runs))
    assert collect.returncode == 0, collect.stderr[-3000:]
    assert "left out: has no summary and no evaluation yet" in collect.stderr
    table = (runs / "results.md").read_text()
    assert f"{jobs[3]['dir']}`: has no summary and no evaluation yet" in table  # listed there
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| attention=")]
    assert [(r[0], r[1]) for r in rows] == [
        ("| attention=corope train.steps=2", "1"),
        ("| attention=nope train.steps=100000", "1"),
        ("| attention=rope train.steps=2", "1"),
    ]
    steps = [r[-1].rstrip(" |") for r in rows]
    assert steps[0] == steps[2] == "2" and steps[1].endswith("*") and int(steps[1][:-1]) >= 1
    assert "some runs stopped early" in table and "Made by `python experiments/collect.py" in table
    with (runs / "runs.csv").open() as f:
        by_variant = {r["variant"]: r for r in csv.DictReader(f)}
    assert by_variant["attention=nope train.steps=100000"]["partial"] == "True"
    assert 0.0 <= float(by_variant["attention=corope train.steps=2"]["test/err"]) <= 1.0
    with (runs / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 3
    for name in ("results.png", "curves.png", "errors.png"):
        assert (runs / name).stat().st_size > 10_000, name


def test_relaunch_keeps_the_records_and_starts_no_run_with_a_checkpoint(fake_train, tmp_path):
    """A relaunch into the same root starts no job over a checkpoint (train.py would refuse
    it after Hydra rewrote its records) unless its config resumes or overwrites it, read as
    train.py composes it (``yes`` is a bool there); logs and rows accumulate."""
    root = tmp_path / "runs"
    args = ["--root", str(root), "seed=0", "seed=1"]  # overrides that compose, as real ones
    assert main(args) == 0
    done = root / "000-seed0"
    (done / "checkpoint.pt").write_bytes(b"")  # as train.py leaves a run it trained
    first_log = (done / "stdout.log").read_text()

    assert main(args) == 1
    refused = "not started: checkpoint.pt exists; relaunch with --common train.resume=true"
    rows = table(root)
    assert [(r["dir"], r["status"][: len(refused)]) for r in rows] == [
        ("000-seed0", "ok"),
        ("001-seed1", "ok"),
        ("000-seed0", refused),
        ("001-seed1", "ok"),
    ]
    assert rows[0]["launch"] <= rows[2]["launch"]
    assert (done / "stdout.log").read_text() == first_log

    assert main([*args, "--common", "train.resume=yes"]) == 0
    log = (done / "stdout.log").read_text()
    assert log.startswith(first_log) and len(launch_lines(done / "stdout.log")) == 2
    assert log.splitlines()[-2].endswith(f"seed=0 train.resume=yes hydra.run.dir={done}")
    assert len(table(root)) == 6
    assert main([*args, "--common", "train.overwrite=true"]) == 0  # the other way to go on
    assert len(launch_lines(done / "stdout.log")) == 3


def test_a_checkpoint_at_train_ckpt_path_is_seen(fake_train, tmp_path):
    root = tmp_path / "runs"
    args = ["--root", str(root), "seed=0", "--common", "train.ckpt_path=ck/last.pt"]
    assert main(args) == 0
    (root / "000-seed0" / "ck").mkdir()
    (root / "000-seed0" / "ck" / "last.pt").write_bytes(b"")
    assert main(args) == 1
    assert table(root)[-1]["status"].startswith("not started: last.pt exists")


def test_jobs_run_in_the_callers_directory(fake_train, tmp_path, monkeypatch):
    """As --root, relative data paths in the overrides (data.dir=jd) resolve against the
    directory run_parallel is started in, not the repository's."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["--root", "runs", "seed=0"]) == 0
    (line,) = launch_lines(tmp_path / "here" / "runs" / "000-seed0" / "stdout.log")
    assert line.endswith(f" cwd {tmp_path / 'here'}")


def test_common_takes_single_values_and_no_key_a_spec_sets(tmp_path):
    """A sweep in --common would reach train.py unexpanded; a key set in both would run
    --common's value in a directory named after the spec's."""
    with pytest.raises(ValueError, match="sweeps several values"):
        plan(["seed=0"], ["train.steps=4,8"], tmp_path)
    with pytest.raises(ValueError, match=r"both set \['seed'\]"):
        plan(["attention=rope seed=0,1"], ["seed=2"], tmp_path)
    assert len(plan(["seed=0,1"], ["train.steps=4", "data.x=[1,2]"], tmp_path)) == 2


def test_a_job_that_cannot_start_fails_alone(fake_train, tmp_path):
    """A job whose directory cannot be made fails ("failed to start", 0 s); the others run."""
    root = tmp_path / "runs"
    blocker = tmp_path / "file"
    blocker.write_text("")
    jobs = plan(["seed=0,1"], [], root)
    jobs[1].run_dir = blocker / "x"  # under a file: mkdir raises an OSError
    assert run(jobs, root, 2, None) == 1
    rows = table(root)
    assert rows[0]["status"] == "ok" and rows[1]["status"].startswith("failed to start")
    assert float(rows[1]["seconds"]) == 0.0


def test_a_job_past_the_timeout_is_stopped_and_counts_as_failed(fake_train, tmp_path):
    root = tmp_path / "runs"
    assert main(["--root", str(root), "--job-timeout", "0.5", "sleep=0", "sleep=30"]) == 1
    assert [r["status"] for r in table(root)] == ["ok", "timeout"]
    assert float(table(root)[1]["seconds"]) < 15  # stopped, not slept out


def test_a_starting_job_gets_the_least_busy_gpu(fake_train, tmp_path):
    """Job 2 starts when job 1 (GPU 1) has finished and job 0 still runs on GPU 0."""
    root = tmp_path / "runs"
    assert main(["--root", str(root), "-j", "2", "--gpus", "0,1", "sleep=2", "sleep=0,0.1"]) == 0
    logs = [root / r["dir"] / "stdout.log" for r in table(root)]
    gpus = [launch_lines(log)[0].split()[3] for log in logs]
    assert gpus == ["0", "1", "1"]
    assert [r["gpu"] for r in table(root)] == gpus


def test_gpu_ids_number_the_gpus_an_inherited_mask_shows(fake_train, tmp_path, monkeypatch):
    """Under a scheduler's CUDA_VISIBLE_DEVICES=4,5, --gpus 0,1 are GPUs 4 and 5: replacing
    the mask put the jobs on GPUs 0 and 1, another allocation's (a review's find)."""
    assert physical_gpus(["0", "1"], None) == ["0", "1"]
    assert physical_gpus(["1", "0"], "4,5") == ["5", "4"]
    assert physical_gpus(["0"], "GPU-8f3a,GPU-77b1") == ["GPU-8f3a"]
    with pytest.raises(ValueError, match="--gpus 2: this process sees CUDA_VISIBLE_DEVICES=4,5"):
        physical_gpus(["0", "2"], "4,5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    root = tmp_path / "runs"
    assert main(["--root", str(root), "-j", "2", "--gpus", "0,1", "seed=0,1"]) == 0
    logs = [root / r["dir"] / "stdout.log" for r in table(root)]
    assert sorted(launch_lines(log)[0].split()[3] for log in logs) == ["4", "5"]


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_a_job_timeout_that_is_not_positive_is_refused(tmp_path, timeout, capsys):
    """It stopped every job at the first poll (a review's find)."""
    with pytest.raises(SystemExit):
        main(["--root", str(tmp_path), "--job-timeout", timeout, "seed=0"])
    assert "--job-timeout must be > 0 seconds" in capsys.readouterr().err


def test_a_stop_while_a_job_starts_stops_that_job(fake_train, tmp_path, monkeypatch):
    """SIGTERM right after the job's process is made, before run_parallel holds it: the stop
    waits for the start, then stops that job too. It found no process and the job ran on in
    its own session (a review's find)."""
    made = []

    def popen_then_sigterm(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        made.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode
        return proc

    real_popen = subprocess.Popen
    monkeypatch.setattr(run_parallel.subprocess, "Popen", popen_then_sigterm)
    root = tmp_path / "runs"
    assert run(plan(["sleep=60 seed=0,1"], [], root), root, 1, None) == 2
    (proc,) = made
    assert proc.wait(timeout=20) is not None  # stopped, not left running for 60 s
    assert [r["status"] for r in table(root)] == ["stopped", "not started"]


def test_a_job_that_ended_before_a_stop_keeps_its_status(fake_train, tmp_path):
    """A job that exited since the last poll is not "stopped" by a stop that finds it ended."""
    root = tmp_path / "runs"
    ended, running = plan(["sleep=0,60"], [], root)
    for job in (ended, running):
        run_parallel._start(job, 1)
    ended.proc.wait(timeout=20)
    run_parallel._stop([ended, running], "stopped")
    assert (ended.status, running.status) == ("ok", "stopped")


def test_a_second_sigterm_kills_jobs_that_ignore_the_first(fake_train, tmp_path):
    """Jobs run in their own sessions: if a second SIGTERM during the stop's 10 s grace
    period ended run_parallel without killing them, nothing would."""
    root = tmp_path / "runs"
    script = (
        "import sys; from pathlib import Path; from experiments import run_parallel as rp; "
        f"rp.TRAIN = Path({str(fake_train)!r}); sys.exit(rp.main(sys.argv[1:]))"
    )
    args = ["--root", str(root), "-j", "2", "ignore_term=true sleep=60 seed=0,1,2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    pids = []
    try:
        started = [proc.stdout.readline() for _ in range(2)]
        assert all("started" in line for line in started), started
        while len(pids) < 2:  # each job ignores SIGTERM once it has printed its pid
            time.sleep(0.05)
            lines = [launch_lines(log) for log in root.glob("*/stdout.log")]
            pids = [int(found[0].split()[1]) for found in lines if found]
        proc.send_signal(signal.SIGTERM)
        assert "stopping 2 running jobs" in proc.stdout.readline()
        time.sleep(0.5)
        begun = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=8) == 1
        assert time.monotonic() - begun < 5  # not the 10 s grace period
        assert [r["status"] for r in table(root)] == ["stopped", "stopped", "not started"]
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:  # without the fix, leave no job behind
        proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_slug_names_a_config_groups_choice_by_itself():
    """``data=selective_copy`` reads ``selective_copy``, not ``dataselective_copy``; a plain key
    keeps its last name part before its value."""
    overrides = ["experiment=synth_flipflop", "data=selective_copy", "model=tiny", "seed=0",
                 "data.seq_len=64", "+train.note=a/b"]  # fmt: skip
    assert (
        run_parallel.slug(overrides) == "synth_flipflop_selective_copy_tiny_seed0_seq_len64_notea-b"
    )
