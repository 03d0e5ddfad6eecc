"""sample.py as a user runs it: a trained run's checkpoint -> text, greedy or sampled."""

import pytest
import torch

import sample
from lm.data.base import IGNORE_INDEX
from lm.generation import generate
from lm.trained import load_run
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
    _, model, dataset = load_run(trained_run / "checkpoint.pt")
    ids, expected = sample.default_prompt(dataset)
    assert lines[0] == f"prompt:    {dataset.decode(ids)}"
    assert lines[1] == f"expected:  {dataset.decode(expected)}"
    out = generate(model, torch.tensor([ids]), 4, temperature=0)
    assert lines[2] == f"generated: {dataset.decode(out[0, len(ids) :])}"


def test_no_cache_reaches_generate(trained_run, capsys, monkeypatch):
    """``--no-cache`` runs ``generate`` with ``use_cache=False`` (the default keeps the cache),
    and its greedy text is the cached one's for these attentions."""
    calls = []
    real = sample.generate
    monkeypatch.setattr(
        sample, "generate", lambda *a, **kw: calls.append(kw["use_cache"]) or real(*a, **kw)
    )
    args = [str(trained_run), "--tokens", "4", "--temperature", "0", "--device", "cpu"]
    sample.main(args)
    cached = capsys.readouterr().out
    sample.main([*args, "--no-cache"])
    assert calls == [True, False] and capsys.readouterr().out == cached


def test_impl_overrides_the_runs_attention_impl(trained_run, capsys, monkeypatch):
    """``--impl torch`` reaches ``load_run``, whose model then runs the PyTorch path (a model
    the kernels do not take, trained on a CPU, samples on a GPU); without it the run's own."""
    impls = []
    real = sample.load_run
    monkeypatch.setattr(
        sample, "load_run", lambda *a, **kw: (impls.append(kw["impl"]), real(*a, **kw))[1]
    )
    args = [str(trained_run), "--tokens", "2", "--temperature", "0", "--device", "cpu"]
    sample.main([*args, "--impl", "torch"])
    sample.main(args)
    assert impls == ["torch", None]


def test_prompt_samples_and_seed(trained_run, capsys):
    args = [str(trained_run / "checkpoint.pt"), "--prompt", "x = 1 ;", "--tokens", "5"]
    sample.main([*args, "--samples", "3", "--seed", "1", "--top-k", "4", "--device", "cpu"])
    first = capsys.readouterr().out.splitlines()
    assert first[0] == "prompt:    x = 1 ;" and len(first) == 4
    assert all(len(line.split()) == 6 for line in first[1:])  # "generated:" + 5 tokens
    sample.main([*args, "--samples", "3", "--seed", "1", "--top-k", "4", "--device", "cpu"])
    assert capsys.readouterr().out.splitlines() == first


def test_a_continuation_ends_at_the_datas_end_token(trained_run, capsys, monkeypatch):
    """With an end-of-sequence id (counting has none: take one the greedy answer makes), the
    printed continuation stops after its first one; ``--stop none`` prints every token."""
    _, model, dataset = load_run(trained_run)
    ids = dataset.encode("x = 1 ;")
    new = generate(model, torch.tensor([ids]), 6, temperature=0)[0, len(ids) :].tolist()
    eos = new[2]
    first = new.index(eos)

    def load_with_eos(*args, **kwargs):
        run = load_run(*args, **kwargs)
        run[2].eos_id = eos
        return run

    monkeypatch.setattr(sample, "load_run", load_with_eos)
    args = [str(trained_run), "--prompt", "x = 1 ;", "--tokens", "6", "--temperature", "0"]
    sample.main([*args, "--device", "cpu"])
    assert capsys.readouterr().out.splitlines()[1] == (
        f"generated: {dataset.decode(new[: first + 1])}"
    )
    sample.main([*args, "--device", "cpu", "--stop", "none"])
    assert capsys.readouterr().out.splitlines()[1] == f"generated: {dataset.decode(new)}"


def test_tokens_past_max_len_are_cut_with_a_notice(trained_run, capsys):
    _, model, _ = load_run(trained_run)
    sample.main([str(trained_run), "--prompt", "x = 1 ;", "--tokens", "10000", "--device", "cpu"])
    captured = capsys.readouterr()
    assert f"the model's max_len is {model.max_len}" in captured.err
    assert len(captured.out.splitlines()[1].split()) == 1 + model.max_len - 4


def test_missing_checkpoint_and_bad_arguments_fail_by_name(tmp_path, trained_run):
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path}/checkpoint.pt"):
        sample.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="--samples must be >= 1, got 0"):
        sample.main([str(trained_run), "--samples", "0"])
    with pytest.raises(SystemExit, match="--tokens must be >= 0, got -2"):
        sample.main([str(trained_run), "--tokens", "-2"])
    with pytest.raises(SystemExit, match="--top-k must be >= 1, got 0"):
        sample.main([str(trained_run), "--top-k", "0"])
    with pytest.raises(SystemExit, match="--temperature must be finite and >= 0, got -1.0"):
        sample.main([str(trained_run), "--temperature", "-1"])
    with pytest.raises(ValueError, match="unknown tokens"):
        sample.main([str(trained_run), "--prompt", "zebra", "--device", "cpu"])
    _, model, _ = load_run(trained_run)
    with pytest.raises(SystemExit, match=f"max_len is {model.max_len}: no room for a new one"):
        long_prompt = " ".join(["x"] * model.max_len)
        sample.main([str(trained_run), "--prompt", long_prompt, "--device", "cpu"])
    with pytest.raises(SystemExit, match="--device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        sample.main([str(trained_run), "--device", "gpu"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: this torch has no CUDA device"):
            sample.main([str(trained_run), "--device", "cuda"])


class OneExample:
    """A dataset of one evaluation example, for ``default_prompt``."""

    def __init__(self, kind, x, y):
        self.kind, self.x, self.y = kind, torch.tensor([x]), torch.tensor([y])

    def eval_splits(self):
        return ["valid"]

    def eval_batches(self, split, batch_size):
        yield self.x, self.y


def test_default_prompt_ends_where_the_first_answer_is_predicted():
    """A task: x[t] predicts y[t], so the prompt is x[:t + 1] for the first target t, and the
    expected answer is the run of targets from t (not later answers); a corpus window: its
    first half, then the next 32 tokens."""
    no = IGNORE_INDEX
    x, y = [5, 6, 7, 8, 9, 10, 11, 12], [no, no, 3, 4, no, no, 1, no]
    assert sample.default_prompt(OneExample("task", x, y)) == ([5, 6, 7], [3, 4])
    window = list(range(100))
    prompt, expected = sample.default_prompt(OneExample("lm", window, window))
    assert (prompt, expected) == (window[:50], window[50:82])


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
