"""experiments/eval_query_scale.py on tiny runs trained here."""

import csv

import pytest

from experiments.eval_query_scale import main, variant_names
from lm.training import train
from tests.lm.harness import TINY, compose_cfg

RUN = [*TINY, "data=counting", "data.max_statements=8", "data.seq_len=40", "data.eval_samples=16",
       "train.steps=2", "train.eval_every=0"]  # fmt: skip


def test_rows_per_run_and_beta_and_variants_split_by_setting(tmp_path, capsys):
    runs = []
    for name, extra in [("a", ["seed=0"]), ("b", ["seed=1"]), ("c", ["attention.theta=100.0"])]:
        train(compose_cfg(*RUN, *extra), output_dir=str(tmp_path / name))
        runs.append(str(tmp_path / name))
    main([*runs, "--betas", "0,2", "--out", str(tmp_path / "out"), "--device", "cpu"])
    with open(tmp_path / "out" / "query_scale.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"][-1], r["beta"], r["length"]) for r in rows] == [
        (run, beta, "" if beta == "trained" else "40")
        for run in "abc"
        for beta in ("trained", "0.0", "2.0")
    ]
    # a and b differ in the seed alone: one variant, named by what sets it apart from c
    assert [r["variant"] for r in rows[::3]] == [
        "rope attention.theta=10000.0",
        "rope attention.theta=10000.0",
        "rope attention.theta=100.0",
    ]
    by = {(r["run"][-1], r["beta"]): r for r in rows}
    # beta 0 is the run as trained; beta 2 moves only the split longer than data.seq_len
    for run in "abc":
        assert by[run, "0.0"]["ood_long/loss"] == by[run, "trained"]["ood_long/loss"]
        assert by[run, "2.0"]["test/loss"] == by[run, "trained"]["test/loss"]
        assert by[run, "2.0"]["ood_long/loss"] != by[run, "trained"]["ood_long/loss"]
    table = (tmp_path / "out" / "query_scale.md").read_text()
    assert "| rope attention.theta=10000.0 | trained |  | 2 |" in table
    assert table in capsys.readouterr().out + "\n"


def test_layers_nope_scales_only_the_layers_without_rotation(tmp_path):
    from experiments.eval_query_scale import set_query_scale
    from lm.trained import load_run

    train(compose_cfg(*RUN, "model.n_layer=2", "attention.nope_interval=2"), str(tmp_path))
    _, model, _ = load_run(tmp_path)
    set_query_scale(model, 0.5, 8, "nope", offset=1)
    assert [b.attn.query_scale for b in model.blocks] == [None, (0.5, 8, 1)]
    set_query_scale(model, 0.5, 8, "all")
    assert [b.attn.query_scale for b in model.blocks] == [(0.5, 8, 0), (0.5, 8, 0)]
    main([str(tmp_path), "--layers", "nope", "--betas", "1", "--out", str(tmp_path / "out")])
    with open(tmp_path / "out" / "query_scale.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["beta"], r["layers"], r["offset"]) for r in rows] == [
        ("trained", "", ""),
        ("1.0", "nope", "0"),
    ]
    assert rows[0]["ood_long/loss"] != rows[1]["ood_long/loss"]


def test_layers_nope_is_refused_for_a_run_whose_every_layer_rotates(tmp_path):
    train(compose_cfg(*RUN), str(tmp_path))
    with pytest.raises(ValueError, match="every layer of this run rotates"):
        main([str(tmp_path), "--layers", "nope", "--out", str(tmp_path / "out")])


def test_variant_names_leave_the_seed_out():
    configs = [
        {"attention": {"name": "rope", "theta": 1.0}, "model": {}, "data": {}, "seed": s}
        for s in (0, 1)
    ]
    assert variant_names(configs) == ["rope", "rope"]


@pytest.mark.parametrize("args", [["--betas", "-1"], ["--betas", "x"], ["--length", "0"]])
def test_bad_flags_fail_before_any_run_loads(tmp_path, args):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "no_such_run"), *args, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
