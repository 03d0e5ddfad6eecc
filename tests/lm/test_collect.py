"""experiments/collect.py on hand-written run directories (no training)."""

import json

from experiments.collect import main


def _run(root, name, overrides, err):
    d = root / name
    d.mkdir(parents=True)
    summary = {"overrides": overrides, "test/err": err, "steps": 10, "seed": 0}
    (d / "summary.json").write_text(json.dumps(summary))


def test_ignored_overrides_merge_two_launches_into_one_cell(tmp_path):
    # Two launches of the same cell that differ only in their time limit, and a second cell.
    _run(tmp_path, "a/000", ["attention=rope", "seed=0", "train.max_minutes=6.3"], 0.5)
    _run(tmp_path, "b/000", ["attention=rope", "seed=1", "train.max_minutes=6.5"], 0.25)
    _run(tmp_path, "b/001", ["attention=nope", "seed=0", "train.max_minutes=6.5"], 1.0)

    split = main([str(tmp_path), "--metrics", "test/err", "--out", str(tmp_path / "split")])
    assert "train.max_minutes=6.3" in split and "train.max_minutes=6.5" in split

    table = main([str(tmp_path), "--metrics", "test/err", "--ignore", "train.max_minutes",
                  "--out", str(tmp_path / "merged")])  # fmt: skip
    assert "max_minutes" not in table.split("Made by")[0]
    rope = next(line for line in table.splitlines() if line.startswith("| attention=rope"))
    assert "| 2 |" in rope and "0.375" in rope  # both seeds, their mean
    assert "| attention=nope | 1 | 1 |" in table
