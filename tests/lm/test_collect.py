"""experiments/collect.py on hand-written run directories (no training)."""

import csv
import json
import math
import os

import pytest
import yaml

from experiments.collect import main


def _run(root, name, overrides, err, steps=10, **summary_keys):
    """A finished run: its ``summary.json`` (the seed that of ``overrides``)."""
    d = root / name
    d.mkdir(parents=True)
    seed = next(int(o.split("=")[1]) for o in overrides if o.startswith("seed="))
    summary = {"overrides": overrides, "test/err": err, "steps": steps, "seed": seed}
    summary.update(summary_keys)
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def _stopped_run(root, name, attention, seed, err):
    """A run without a summary: its ``.hydra/`` files and one evaluation at step 5."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    config = {"attention": {"name": attention}, "data": {"name": "counting"}, "seed": seed}
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    overrides = [f"attention={attention}", f"seed={seed}"]
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 5, "test/loss": 1.0, "test/err": err}))
    return d


def test_a_stopped_run_is_what_its_run_json_says_not_a_refused_launchs_hydra(tmp_path):
    """A launch refused in a stopped run's directory (another grid's job) has rewritten
    ``.hydra/`` before train() refused; ``run.json``, written only by runs that start, names
    the run."""
    d = _stopped_run(tmp_path, "000", "nope", 3, 0.25)  # the refused launch's .hydra
    config = {"attention": {"name": "rope"}, "data": {"name": "counting"}, "seed": 0}
    record = {"config": config, "overrides": ["attention=rope", "seed=0"]}
    (d / "run.json").write_text(json.dumps(record))
    _run(tmp_path, "001", ["attention=nope", "seed=0"], 1.0)
    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert "0.25" in _row(table, "attention=rope") and "0.25" not in _row(table, "attention=nope")


def test_an_unreadable_run_json_falls_back_to_hydra(tmp_path, capsys):
    d = _stopped_run(tmp_path, "000", "rope", 0, 0.25)
    (d / "run.json").write_text('{"config": {"attention"')  # cut short
    _run(tmp_path, "001", ["attention=nope", "seed=0"], 1.0)
    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert "0.25" in _row(table, "attention=rope")
    assert "run.json unreadable" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_diverged_or_missing_metric_is_left_out_and_counted(tmp_path, bad):
    """A NaN or inf (a diverged run) or an absent metric is skipped for that run, and the table
    says how many of the cell's seeds its value covers (a NaN used to stop collect altogether)."""
    for seed, err in enumerate([0.1, bad, 0.3]):
        _run(tmp_path, f"r{seed}", ["attention=rope", f"seed={seed}"], err)
    _run(tmp_path, "n0", ["attention=nope", "seed=0"], 1.0)
    table = main([str(tmp_path), "--metrics", "test/err", "--out", str(tmp_path / "o")])
    assert "| 0.2 ± 0.1414 (2/3) |" in _row(table.split("Made by")[0], "attention=rope")
    with (tmp_path / "o" / "results.csv").open() as f:
        rope = next(r for r in csv.DictReader(f) if r["cell"] == "attention=rope")
    assert rope["seeds"] == "3" and rope["test/err_n"] == "2"


def test_cells_sort_by_number_and_runs_csv_names_nested_runs_whole(tmp_path):
    """d_model=64 before 128; in a root of two multiruns, runs.csv tells their 0/ apart."""
    for stamp, width in (("12-00-00", 128), ("13-00-00", 64)):
        _run(tmp_path, f"{stamp}/0", [f"model.d_model={width}", "seed=0"], 0.5)
    table = main([str(tmp_path), "--metrics", "test/err", "--out", str(tmp_path / "o")])
    assert table.index("model.d_model=64") < table.index("model.d_model=128")
    with (tmp_path / "o" / "runs.csv").open() as f:
        assert sorted(r["dir"] for r in csv.DictReader(f)) == ["12-00-00/0", "13-00-00/0"]


def _row(table, cell):
    return next(line for line in table.splitlines() if line.startswith(f"| {cell} "))


def test_ignored_overrides_merge_two_launches_into_one_cell(tmp_path):
    # Two launches of the same cell that differ only in their eval set size, and a second cell.
    _run(tmp_path, "a/000", ["attention=rope", "seed=0", "data.eval_samples=16"], 0.5)
    _run(tmp_path, "b/000", ["attention=rope", "seed=1", "data.eval_samples=32"], 0.25)
    _run(tmp_path, "b/001", ["attention=nope", "seed=0", "data.eval_samples=32"], 1.0)

    split = main([str(tmp_path), "--metrics", "test/err", "--out", str(tmp_path / "split")])
    assert "data.eval_samples=16" in split and "data.eval_samples=32" in split

    table = main([str(tmp_path), "--metrics", "test/err", "--ignore", "data.eval_samples",
                  "--out", str(tmp_path / "merged")])  # fmt: skip
    assert "eval_samples" not in table.split("Made by")[0]
    rope = _row(table, "attention=rope")
    assert "| 2 |" in rope and "0.375" in rope  # both seeds, their mean
    assert "| attention=nope | 1 | 1 |" in table


def test_how_a_run_was_carried_out_defines_no_cell(tmp_path):
    # The keys of lm.config.RUN_CONDUCT_KEYS (and those under them) split no cell, speed aside.
    _run(tmp_path, "000", ["attention=rope", "seed=0", "train.max_minutes=6.3"], 0.5)
    _run(tmp_path, "001", ["attention=rope", "seed=1", "train.resume=true", "name=b",
                           "logger.mode=offline"], 0.25)  # fmt: skip
    _run(tmp_path, "002", ["attention=nope", "seed=0", "train.overwrite=true", "metric=x"], 1.0)

    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    for key in ("max_minutes", "resume", "overwrite", "name", "logger", "metric"):
        assert key not in table, key
    assert "| 2 |" in _row(table, "attention=rope") and "0.375" in _row(table, "attention=rope")
    assert "| attention=nope | 1 | 1 |" in table


def test_an_override_written_two_ways_is_one_cell(tmp_path):
    # What Hydra reads as one value (a float, a boolean, a quoted string) is one cell.
    # a whole number as an int or a float (0 and 0.0 split a cell: a review's find)
    a0 = ["attention=rope", "seed=0", "optim.lr=1e-3", "x.flag=True", "optim.weight_decay=0"]
    b0 = ["attention='rope'", "seed=1", "optim.lr=0.001", "x.flag=true", "optim.weight_decay=0.0"]
    b1 = ["attention=rope", "seed=0", "optim.lr=1e-2", "x.flag=true", "optim.weight_decay=0e0"]
    _run(tmp_path, "a/000", a0, 0.5)
    _run(tmp_path, "b/000", b0, 0.25)
    _run(tmp_path, "b/001", b1, 1.0)

    table = main([str(tmp_path), "--metrics", "test/err"])
    assert "| 2 |" in _row(table, "optim.lr=0.001") and "0.375" in _row(table, "optim.lr=0.001")
    assert "| optim.lr=0.01 | 1 | 1 |" in table
    assert (
        "1e-3" not in table
        and "True" not in table
        and "weight_decay" not in _row(table, "optim.lr=0.001")
    )  # one value: no cell


@pytest.mark.parametrize(
    "key, values",
    [("attention.impl", ("torch", "triton")), ("train.compile", ("false", "true")),
     ("train.grad_accum_steps", ("1", "4"))],
)  # fmt: skip
def test_the_keys_that_change_the_speed_split_cells(tmp_path, key, values):
    for i, value in enumerate(values):
        _run(tmp_path, f"00{i}", ["attention=rope", "seed=0", f"{key}={value}"], 0.5)

    table = main([str(tmp_path), "--metrics", "test/err"])
    assert all(f"| {key}={value} | 1 |" in table for value in values), table
    assert "Left out" not in table


@pytest.mark.parametrize(
    "fact, values", [("world_size", (1, 2)), ("device_name", ("NVIDIA H100", "NVIDIA H200"))]
)
def test_runs_on_other_hardware_are_other_cells(tmp_path, capsys, fact, values):
    """torchrun's process count (each process takes train.batch_size rows) and the device,
    from the summaries and a stopped run's run.json, split cells as overrides do (they were
    one cell, and a seed of one was left out as a repeat of the other's); --ignore merges."""
    _run(tmp_path, "000", ["attention=rope", "seed=0"], 0.5, data="counting", **{fact: values[0]})
    d = _stopped_run(tmp_path, "001", "rope", 0, 0.25)
    config = {"attention": {"name": "rope"}, "data": {"name": "counting"}, "seed": 0}
    record = {"config": config, "overrides": ["attention=rope", "seed=0"], fact: values[1]}
    (d / "run.json").write_text(json.dumps(record))
    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert all(f"| {fact}={value} | 1 |" in table for value in values), table
    assert "Left out" not in table and "repeats" not in capsys.readouterr().err
    merged = main([str(tmp_path), "--metrics", "test/err", "--ignore", fact, "--out",
                   str(tmp_path / "merged")]).split("Made by")[0]  # fmt: skip
    assert "repeats seed 0" in merged and fact not in merged.split("Left out")[0]


def test_a_fact_only_some_runs_record_forms_no_cell(tmp_path, capsys):
    """A finished run's summary records world_size (every harness version did), a stopped run
    read from .hydra/ (or an older run.json) records nothing: they share a cell, and stderr
    says the fact was left out (absent read as another value, and split them)."""
    _run(tmp_path, "000", ["attention=rope", "seed=0"], 0.5, data="counting", world_size=1)
    _stopped_run(tmp_path, "001", "rope", 1, 0.25)
    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert "| (all runs) | 2 |" in table and "world_size" not in table, table
    assert "world_size left out of the cells: 1 of 2 runs" in capsys.readouterr().err


def test_failed_runs_are_listed_not_averaged(tmp_path, capsys):
    _run(tmp_path, "000", ["attention=rope", "seed=0"], 0.5)
    _run(tmp_path, "001", ["attention=nope", "seed=0"], 1.0)
    crashed = _stopped_run(tmp_path, "002", "rope", 1, 0.0)  # evaluated, then a NaN loss
    failure = {"step": 7, "error": "FloatingPointError", "message": "loss is nan at step 8"}
    (crashed / "failed.json").write_text(json.dumps(failure))

    table = main([str(tmp_path), "--metrics", "test/err"])
    assert "| attention=rope | 1 | 0.5 |" in table
    note = f"- `{crashed}`: failed after step 7: FloatingPointError: loss is nan at step 8"
    assert note in table
    assert f"{crashed} left out: failed after step 7" in capsys.readouterr().err


def test_a_cell_whose_every_seed_failed_has_a_row(tmp_path):
    """A diverged learning rate fails every seed: its cell keeps a row (no values, its failed
    runs counted), and the overrides heading the table are those every run shares, the failed
    ones included (a review's find: the cell vanished and the table claimed every run had
    optim.lr=0.003)."""
    _run(tmp_path, "000", ["optim.lr=3e-3", "seed=0"], 0.5, data="counting")
    _run(tmp_path, "001", ["optim.lr=3e-3", "seed=1"], 0.25, data="counting")
    for i, seed in enumerate((0, 1)):
        d = tmp_path / f"00{2 + i}"
        d.mkdir()
        config = {"attention": {"name": "rope"}, "data": {"name": "counting"}, "seed": seed}
        record = {"config": config, "overrides": ["optim.lr=1e6", f"seed={seed}"]}
        (d / "run.json").write_text(json.dumps(record))
        failure = {"step": 3, "error": "FloatingPointError", "message": "loss is nan"}
        (d / "failed.json").write_text(json.dumps(failure))

    table = main([str(tmp_path), "--metrics", "test/err"])
    assert "Every run" not in table
    assert "| optim.lr=0.003 | 2 | 0.375 ± 0.1768 | 0 |" in table
    assert "| optim.lr=1000000 | 0 | - | 2 |" in table  # seeds, test/err, failed
    assert table.count("failed after step 3: FloatingPointError: loss is nan") == 2
    with (tmp_path / "results.csv").open() as f:
        rows = {r["cell"]: r for r in csv.DictReader(f)}
    assert rows["optim.lr=1000000"]["seeds"] == "0" and rows["optim.lr=1000000"]["failed"] == "2"
    with (tmp_path / "runs.csv").open() as f:
        assert [r["cell"] for r in csv.DictReader(f)] == ["optim.lr=0.003"] * 2


def test_a_seed_run_twice_in_a_cell_counts_once(tmp_path, capsys):
    _run(tmp_path, "000", ["attention=rope", "seed=0"], 0.5)
    _run(tmp_path, "001", ["attention=rope", "seed=1"], 0.25)
    shorter = _run(tmp_path, "002", ["attention=rope", "seed=0"], 0.9, steps=5)
    # Equal steps: the newer summary counts, whatever the directories' order.
    newer = _run(tmp_path, "003", ["attention=nope", "seed=0"], 1.0)
    older = _run(tmp_path, "004", ["attention=nope", "seed=0"], 0.0)
    os.utime(newer / "summary.json", (2000, 2000))
    os.utime(older / "summary.json", (1000, 1000))

    table = main([str(tmp_path), "--metrics", "test/err"])
    assert "| 2 |" in _row(table, "attention=rope") and "0.375" in _row(table, "attention=rope")
    assert "| attention=nope | 1 | 1 |" in table
    err = capsys.readouterr().err
    for dropped in (shorter, older):
        assert f"- `{dropped}`: repeats seed 0 of cell" in table
        assert f"{dropped} left out: repeats seed 0" in err


def test_a_cell_is_the_mean_and_sample_std_of_its_seeds(tmp_path):
    """0.1, 0.2, 0.9: the mean 0.4 (their median would be 0.2) and the sample standard
    deviation sqrt(0.38 / 2) = 0.43589 (the population one would be 0.35590), in the table
    and in results.csv."""
    for seed, err in enumerate([0.1, 0.2, 0.9]):
        _run(tmp_path, f"r{seed}", ["attention=rope", f"seed={seed}"], err)
    _run(tmp_path, "n0", ["attention=nope", "seed=0"], 1.0)
    table = main([str(tmp_path), "--metrics", "test/err", "--out", str(tmp_path / "o")])
    assert "| attention=rope | 3 | 0.4 ± 0.4359 |" in table.split("Made by")[0]
    with (tmp_path / "o" / "results.csv").open() as f:
        rope = next(r for r in csv.DictReader(f) if r["cell"] == "attention=rope")
    assert math.isclose(float(rope["test/err_mean"]), 0.4, abs_tol=1e-9)
    assert math.isclose(float(rope["test/err_std"]), math.sqrt(0.19), rel_tol=1e-5)
    assert rope["test/err_n"] == "3"


def test_a_stopped_runs_best_val_loss_is_its_best_evaluation_not_its_last(tmp_path):
    """A run without summary.json that evaluated to a loss of 2.0, then 3.0: best_val_loss
    2.0, val_loss (and its other metrics) the last evaluation's."""
    d = _stopped_run(tmp_path, "000", "rope", 0, 0.25)
    evals = [
        {"step": 5, "test/loss": 2.0, "test/err": 0.5},
        {"step": 10, "test/loss": 3.0, "test/err": 0.25},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    _run(tmp_path, "001", ["attention=nope", "seed=0"], 1.0)
    metrics = "best_val_loss,val_loss,test/err"
    table = main([str(tmp_path), "--metrics", metrics, "--out", str(tmp_path / "o")])
    assert "| attention=rope | 1 | 2 | 3 | 0.25 | 10* |" in table.split("Made by")[0]
    with (tmp_path / "o" / "runs.csv").open() as f:
        run = next(r for r in csv.DictReader(f) if r["dir"] == "000")
    assert run["partial"] == "True" and run["steps"] == "10"
    assert float(run["best_val_loss"]) == 2.0 and float(run["val_loss"]) == 3.0


def test_a_torn_metrics_line_does_not_stop_the_root(tmp_path, capsys):
    """A stopped run whose last metrics line was cut short still counts (that line left out,
    with a warning); one with a bad line within is left out, named; the root's table is made."""
    cut = _stopped_run(tmp_path, "000", "rope", 0, 0.25)
    with (cut / "metrics.jsonl").open("a") as f:
        f.write('\n{"step": 6, "test/lo')
    bad = _stopped_run(tmp_path, "001", "rope", 1, 0.5)
    (bad / "metrics.jsonl").write_text('{"step": 5, "te\n{"step": 6, "test/loss": 1.0}\n')
    _run(tmp_path, "002", ["attention=nope", "seed=0"], 1.0)
    with pytest.warns(UserWarning, match="left out its last line"):
        table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert "| attention=rope | 1 | 0.25" in table
    assert "001/metrics.jsonl, line 1: not a JSON record" in capsys.readouterr().err


def test_a_stopped_runs_speed_is_its_latest_logged(tmp_path):
    d = _stopped_run(tmp_path, "000", "rope", 0, 0.25)
    records = [
        {"step": 2, "train/loss": 1.0, "tokens_per_s": 100.0},
        {"step": 4, "train/loss": 1.0, "tokens_per_s": 200.0},
        {"step": 5, "test/loss": 1.0, "test/err": 0.25},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _run(tmp_path, "001", ["attention=nope", "seed=0"], 1.0)
    main([str(tmp_path), "--metrics", "tokens_per_s", "--out", str(tmp_path / "o")])
    with (tmp_path / "o" / "runs.csv").open() as f:
        run = next(r for r in csv.DictReader(f) if r["dir"] == "000")
    assert float(run["tokens_per_s"]) == 200.0


def test_a_cell_with_one_stopped_seed_is_marked(tmp_path):
    """One seed finished at step 10, the other stopped at 5: the steps read 5-10*."""
    _run(tmp_path, "a", ["attention=rope", "seed=0"], 0.1, data="counting")
    _run(tmp_path, "c", ["attention=nope", "seed=0"], 1.0, data="counting")
    _stopped_run(tmp_path, "b", "rope", 1, 0.2)  # on counting (its config), at step 5
    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert _row(table, "attention=rope").endswith("| 5-10* |")


def test_a_max_minutes_stop_is_marked_and_a_flag_is_not_averaged(tmp_path):
    """A run whose summary says stopped_early (train.max_minutes) counts as stopped: 5-10*,
    partial in runs.csv. A true/false summary key is no metric: no mean of booleans."""
    _run(tmp_path, "a", ["attention=rope", "seed=0"], 0.1, flag=True)
    _run(tmp_path, "b", ["attention=rope", "seed=1"], 0.2, steps=5, stopped_early=True, flag=False)
    _run(tmp_path, "c", ["attention=nope", "seed=0"], 1.0, flag=True)
    out = tmp_path / "o"
    table = main([str(tmp_path), "--metrics", "test/err,flag", "--out", str(out)])
    assert _row(table.split("Made by")[0], "attention=rope").endswith("| 5-10* |")
    assert "flag" not in table.splitlines()[0]  # the header: test/err only
    with (out / "runs.csv").open() as f:
        partial = {r["dir"]: r["partial"] for r in csv.DictReader(f)}
    assert partial == {"a": "False", "b": "True", "c": "False"}


def test_a_run_on_the_defaults_is_labelled_so_not_all_runs(tmp_path):
    """Among runs that vary an override, one that sets none of them is '(defaults)'; only when
    nothing varies is the cell '(all runs)'."""
    _run(tmp_path, "d", ["seed=0"], 0.5)
    _run(tmp_path, "c", ["attention=corope", "seed=0"], 0.25)
    table = main([str(tmp_path), "--metrics", "test/err", "--out", str(tmp_path / "o")])
    assert "| (defaults) | 1 | 0.5 |" in table and "(all runs)" not in table
    alone = tmp_path / "alone"
    _run(alone, "d", ["seed=0"], 0.5)
    assert "| (all runs) | 1 | 0.5 |" in main([str(alone), "--metrics", "test/err"])


def test_a_missing_root_and_an_ignored_key_no_run_sets_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope")])
    assert "is not a directory" in capsys.readouterr().err
    _run(tmp_path, "r", ["attention=rope", "seed=0"], 0.5)
    main(
        [
            str(tmp_path),
            "--metrics",
            "test/err",
            "--ignore",
            "atention",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert "--ignore atention: no run sets it" in capsys.readouterr().err


def _failed_run(root, name, attention, seed, data="flipflop", step=3):
    """A run that failed after ``step``: its ``run.json`` and ``failed.json``."""
    d = root / name
    d.mkdir(parents=True)
    config = {"attention": {"name": attention}, "data": {"name": data}, "seed": seed}
    record = {"config": config, "overrides": [f"attention={attention}", f"seed={seed}"]}
    (d / "run.json").write_text(json.dumps(record))
    failure = {"step": step, "error": "RuntimeError", "message": "CUDA out of memory"}
    (d / "failed.json").write_text(json.dumps(failure))
    return d


def test_a_failed_run_counts_in_its_cell_of_its_task(tmp_path):
    """A failed run's summary names its data as a finished run's does: it was filed under a
    task table of its own, "(all runs)", and its cell looked clean (a review's find)."""
    for attention, seed, err in (("rope", 0, 0.5), ("nope", 0, 1.0)):
        _run(tmp_path, f"{attention}{seed}", [f"attention={attention}", f"seed={seed}"], err,
             data="flipflop", attention=attention)  # fmt: skip
    _failed_run(tmp_path, "rope1", "rope", 1)
    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert "(all runs)" not in table
    assert "| attention=rope | 1 | 0.5 | 1 |" in table  # seeds, test/err, failed


def test_runs_on_the_default_data_are_headed_by_its_name(tmp_path):
    """Beside runs of data=counting, runs that leave the data at its default head a task table
    of their data's name, not '(defaults)' (a review's find)."""
    for data, overrides in (("counting", ["data=counting"]), ("flipflop", [])):
        for attention in ("rope", "nope"):
            _run(tmp_path, f"{data}-{attention}", [*overrides, f"attention={attention}", "seed=0"],
                 0.5, data=data, attention=attention)  # fmt: skip
    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert "### data=flipflop" in table and "### data=counting" in table
    assert "(defaults)" not in table


def test_a_seed_that_failed_then_ran_counts_once(tmp_path, capsys):
    """Seed 1 failed (out of memory), then ran again into the same root: its cell has two
    seeds and no failure, and the failed attempt is left out as a repeat; a seed that failed
    twice counts as one failure (a review's find: failed 1 beside the re-run)."""
    _run(tmp_path, "000", ["attention=rope", "seed=0"], 0.5, data="flipflop")
    crashed = _failed_run(tmp_path, "001", "rope", 1)
    _run(tmp_path, "002", ["attention=rope", "seed=1"], 0.25, data="flipflop")
    for name in ("003", "004"):
        _failed_run(tmp_path, name, "nope", 0)
    table = main([str(tmp_path), "--metrics", "test/err"]).split("Made by")[0]
    assert "| attention=rope | 2 | 0.375 ± 0.1768 | 0 |" in table
    assert "| attention=nope | 0 | - | 1 |" in table
    assert f"{crashed} left out: repeats seed 1 of cell" in capsys.readouterr().err
