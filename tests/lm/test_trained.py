"""lm/trained.py: a run's checkpoint loaded back, from wherever the caller stands."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from lm.checkpoint import load_checkpoint, save_checkpoint
from lm.trained import load_run
from lm.training import train
from tests.lm.harness import TINY, compose_cfg

TEXT = [
    *TINY,
    "data=text",
    "data.files=[corpus.txt]",  # relative: to the directory the run starts in
    "data.seq_len=32",
    "data.eval_samples=4",
    "train.steps=2",
    "train.device=cpu",
]


@pytest.fixture
def text_run(tmp_path, monkeypatch):
    """A 2-step run on a relative text file, started in ``tmp_path/launch``, with Hydra's
    record of that directory; returns the run directory. The test then stands elsewhere."""
    launch, run_dir = tmp_path / "launch", tmp_path / "run"
    launch.mkdir()
    (launch / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    monkeypatch.chdir(launch)
    train(compose_cfg(*TEXT), output_dir=str(run_dir))
    record = {"hydra": {"runtime": {"cwd": str(launch)}}}
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(record), run_dir / ".hydra" / "hydra.yaml")
    monkeypatch.chdir(tmp_path)
    return run_dir


def test_relative_data_paths_resolve_from_the_runs_launch_directory(text_run):
    cfg, model, dataset = load_run(text_run)
    assert cfg.data.files == ["corpus.txt"] and dataset.decode(dataset.encode("fox")) == "fox"
    state = load_checkpoint(text_run / "checkpoint.pt")["model"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert not model.training
    # A resume started elsewhere rewrites run.json before it saves a checkpoint (killed
    # then, a review's find: its data was looked for there): the checkpoint's own record wins
    run_json = json.loads((text_run / "run.json").read_text())
    (text_run / "run.json").write_text(json.dumps({**run_json, "launch_dir": str(text_run)}))
    assert load_run(text_run)[2].decode(dataset.encode("fox")) == "fox"
    # Checkpoints older than that record: run.json's, then Hydra's record
    (text_run / "run.json").write_text(json.dumps(run_json))
    ckpt = load_checkpoint(text_run / "checkpoint.pt")
    del ckpt["launch_dir"]
    save_checkpoint(text_run / "checkpoint.pt", ckpt)
    # A refused launch from elsewhere rewrites .hydra/; run.json, written by runs that start,
    # still names the launch directory.
    record = {"hydra": {"runtime": {"cwd": str(text_run.parent)}}}
    OmegaConf.save(OmegaConf.create(record), text_run / ".hydra" / "hydra.yaml")
    assert load_run(text_run)[2].decode(dataset.encode("fox")) == "fox"
    run_json = json.loads((text_run / "run.json").read_text())
    del run_json["launch_dir"]  # a run older than the record: Hydra's is used
    (text_run / "run.json").write_text(json.dumps(run_json))
    with pytest.raises(FileNotFoundError, match="corpus.txt is not a file"):
        load_run(text_run)
    (text_run / ".hydra" / "hydra.yaml").unlink()  # no record: the current directory
    with pytest.raises(FileNotFoundError, match="corpus.txt is not a file"):
        load_run(text_run)


def test_a_run_with_its_own_ckpt_path_loads_from_its_directory(tmp_path, monkeypatch):
    """train.ckpt_path moves the checkpoint; the run directory still names the run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    train(compose_cfg(*TEXT, "train.ckpt_path=ck/m.pt"), output_dir=str(tmp_path / "run"))
    monkeypatch.chdir(tmp_path / "run")  # relative data: from run.json's launch directory
    cfg, _, dataset = load_run(tmp_path / "run")
    assert cfg.train.ckpt_path == "ck/m.pt" and dataset.decode(dataset.encode("dog")) == "dog"
    # The file itself: its run's records are a level up (a review's find: the relative data
    # path resolved from here, not from the launch directory)
    assert load_run(tmp_path / "run" / "ck" / "m.pt")[2].decode(dataset.encode("fox")) == "fox"


def test_a_run_whose_data_changed_is_refused(text_run):
    """Data that changed since training can keep the vocabulary's size and renumber it; the
    weights would read the new ids silently (a review's find). The checkpoint's fingerprint
    of the data is checked, as a resume checks it."""
    corpus = text_run.parent / "launch" / "corpus.txt"
    corpus.write_text("the lazy dog jumps over the quick brown fox. " * 40)
    with pytest.raises(ValueError, match="was trained on data of fingerprint"):
        load_run(text_run)


def test_a_triton_run_loads_on_the_cpu_through_its_pytorch_path(text_run):
    """``attention.impl=triton`` cannot run off CUDA: it becomes ``auto``; ``impl`` overrides
    it; fields a newer schema has and the saved config lacks take their defaults."""
    ckpt = load_checkpoint(text_run / "checkpoint.pt")
    ckpt["config"]["attention"]["impl"] = "triton"
    del ckpt["config"]["attention"]["layout"]
    save_checkpoint(text_run / "checkpoint.pt", ckpt)
    cfg, model, _ = load_run(text_run)
    assert cfg.attention.impl == "auto" and model.blocks[0].attn.impl == "auto"
    assert cfg.attention.layout == "half"
    assert load_run(text_run, impl="torch")[0].attention.impl == "torch"
    if torch.cuda.is_available():
        assert load_run(text_run, device="cuda")[0].attention.impl == "triton"


def test_unknown_attention_and_missing_checkpoint_fail_by_name(text_run, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_run(tmp_path / "nowhere")
    ckpt = load_checkpoint(text_run / "checkpoint.pt")
    ckpt["config"]["attention"]["name"] = "alibi"
    save_checkpoint(text_run / "checkpoint.pt", ckpt)
    with pytest.raises(ValueError, match="unknown attention.name 'alibi'; known: .*corope"):
        load_run(text_run)


def test_load_run_checks_the_attention_for_the_device_before_the_data(text_run, monkeypatch):
    """``impl=triton`` on the CPU without the interpreter is refused by name before the data and
    weights load (it failed at the first forward pass); an ``impl`` for an attention that has
    none (nope) is named as ignored."""
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        m.setattr("lm.trained.build_run_dataset", lambda *a: pytest.fail("data loaded"))
        with pytest.raises(ValueError, match="attention.impl=triton needs a CUDA device"):
            load_run(text_run, impl="triton")
    ckpt = load_checkpoint(text_run / "checkpoint.pt")
    ckpt["config"]["attention"] = {"name": "nope"}
    save_checkpoint(text_run / "checkpoint.pt", ckpt)
    with pytest.warns(UserWarning, match="impl='torch' ignored: attention 'nope' has no impl"):
        assert load_run(text_run, impl="torch")[0].attention.name == "nope"
