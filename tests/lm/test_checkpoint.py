"""lm/checkpoint.py's pieces that the resume tests reach only indirectly."""

import argparse
import pickle

import pytest
import torch

from lm.checkpoint import (
    load_checkpoint,
    read_jsonl,
    replace_atomically,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def test_rng_state_round_trips():
    """A resumed run draws what the uninterrupted one would have: the restored generator
    repeats the draws after the saved state (the training steps reseed each step, so the
    resume tests pass without this; anything that draws before the reseed would not)."""
    state = rng_state()
    drawn = torch.rand(4)
    torch.rand(7)  # the generator moves on
    set_rng_state(state)
    assert torch.equal(torch.rand(4), drawn)


def test_read_jsonl_skips_blank_lines_and_names_a_bad_one(tmp_path):
    """Blank lines (an editor's trailing newline, a concatenation) are not records; a bad line
    before the last is refused with its number, a cut last line left out with a warning."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n   \n{"step": 2}\n\n')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n\n{"st\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3: not a JSON record"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n{"st\n\n')
    with pytest.warns(UserWarning, match="left out its last line"):
        assert read_jsonl(path) == [{"step": 1}]


def test_load_checkpoint_refuses_pickled_objects(tmp_path):
    """Tensors and primitive containers load; an arbitrary object does not (``weights_only``:
    loading a checkpoint runs no code from it)."""
    state = {"step": 3, "model": {"w": torch.arange(4.0)}, "rng": [torch.ones(2)]}
    save_checkpoint(tmp_path / "ok.pt", state)
    loaded = load_checkpoint(tmp_path / "ok.pt")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(4.0))
    save_checkpoint(tmp_path / "object.pt", {"step": 3, "args": argparse.Namespace(lr=1.0)})
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(tmp_path / "object.pt")


def test_each_write_takes_a_temporary_file_of_its_own(tmp_path):
    """Two writes of one path go through different temporary files beside it (two writers of
    one results file must not share one), and leave none behind, a failed write included."""
    path = tmp_path / "rows.json"
    temporaries = []

    def write(tmp):
        temporaries.append(tmp)
        tmp.write_text("{}")

    replace_atomically(path, write)
    replace_atomically(path, write, sync=False)
    assert len(set(temporaries)) == 2 and all(t.parent == tmp_path for t in temporaries)

    def fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_atomically(path, fail)
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"] and path.read_text() == "{}"
