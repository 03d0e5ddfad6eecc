"""experiments/run_parallel.py (concurrent train.py jobs) and experiments/collect.py over its
root: finished, stopped and failed jobs, tables, CSV and figures."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.run_parallel import expand, main, split_values
from tests.lm.harness import TINY

ROOT = Path(__file__).resolve().parents[2]
SMALL = [*TINY, "data=counting", "data.max_statements=8", "data.seq_len=40", "data.eval_samples=16"]


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
    assert "no summary and no evaluation yet; left out" in collect.stderr
    table = (runs / "results.md").read_text()
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
