"""sample.py as a user runs it: a trained run's checkpoint -> text, greedy or sampled."""

import pytest
import torch

import sample
from lm.generation import generate
from lm.training import train
from tests.lm.harness import TINY, compose_cfg
from tests.test_train import run_cli

SMALL = TINY + ["data=counting", "data.max_statements=8", "data.seq_len=40", "data.eval_samples=16"]


@pytest.fixture(scope="module", params=["rope", "corope"])
def trained_run(request, tmp_path_factory):
    """A run of 3 steps on counting with this attention: its output directory."""
    out = tmp_path_factory.mktemp(f"run_{request.param}")
    cfg = compose_cfg(*SMALL, f"attention={request.param}", "train.steps=3", "train.device=cpu")
    train(cfg, output_dir=str(out))
    return out


def test_greedy_sample_of_the_first_example_is_generate(trained_run, capsys):
    """Without --prompt: the first valid example up to its answer, the expected answer, and
    the greedy continuation, which is ``generate`` of the checkpoint's model."""
    sample.main([str(trained_run), "--tokens", "4", "--temperature", "0", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["prompt", "expected", "generated"]
    model, dataset = sample.load_model(trained_run / "checkpoint.pt", torch.device("cpu"))
    ids, expected = sample.default_prompt(dataset)
    assert lines[0] == f"prompt:    {dataset.decode(ids)}"
    assert lines[1] == f"expected:  {dataset.decode(expected)}"
    out = generate(model, torch.tensor([ids]), 4, temperature=0)
    assert lines[2] == f"generated: {dataset.decode(out[0, len(ids) :])}"


def test_prompt_samples_and_seed(trained_run, capsys):
    args = [str(trained_run / "checkpoint.pt"), "--prompt", "x = 1 ;", "--tokens", "5"]
    sample.main([*args, "--samples", "3", "--seed", "1", "--top-k", "4", "--device", "cpu"])
    first = capsys.readouterr().out.splitlines()
    assert first[0] == "prompt:    x = 1 ;" and len(first) == 4
    assert all(len(line.split()) == 6 for line in first[1:])  # "generated:" + 5 tokens
    sample.main([*args, "--samples", "3", "--seed", "1", "--top-k", "4", "--device", "cpu"])
    assert capsys.readouterr().out.splitlines() == first


def test_tokens_past_max_len_are_cut_with_a_notice(trained_run, capsys):
    model, _ = sample.load_model(trained_run, torch.device("cpu"))
    sample.main([str(trained_run), "--prompt", "x = 1 ;", "--tokens", "10000", "--device", "cpu"])
    captured = capsys.readouterr()
    assert f"the model's max_len is {model.max_len}" in captured.err
    assert len(captured.out.splitlines()[1].split()) == 1 + model.max_len - 4


def test_missing_checkpoint_and_bad_arguments_fail_by_name(tmp_path, trained_run):
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path}/checkpoint.pt"):
        sample.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="--samples must be >= 1, got 0"):
        sample.main([str(trained_run), "--samples", "0"])
    with pytest.raises(ValueError, match="unknown tokens"):
        sample.main([str(trained_run), "--prompt", "zebra", "--device", "cpu"])


@pytest.mark.slow
def test_sample_py_runs_from_the_command_line(trained_run):
    """Without --tokens, a task's example is answered with as many tokens as its answer."""
    run = run_cli("sample.py", str(trained_run), "--temperature", "0")
    assert run.returncode == 0, run.stderr[-3000:]
    prompt, expected, generated = run.stdout.splitlines()
    assert prompt.startswith("prompt: ") and expected.startswith("expected: ")
    assert len(generated.split()) == len(expected.split())
    missing = run_cli("sample.py", str(trained_run / "nothing.pt"))
    assert missing.returncode == 1 and missing.stderr.startswith("sample.py: no checkpoint at")
