"""The data sources of ``lm.data``: sampling, masks, answers, splits, files, errors."""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lm.config import register_configs
from lm.data import DATA_SCHEMAS, IGNORE_INDEX, build_dataset
from lm.data.base import digest, split_rng
from lm.data.corpus import EOS_ID
from lm.data.counting import VAR_NAMES
from lm.data.hub import load_hub_streams
from lm.data.vocab import Vocab

REPO = Path(__file__).resolve().parents[2]
SMALL = {
    "counting": {"name": "counting", "seq_len": 40, "max_statements": 9, "eval_samples": 64},
    "selective_copy": {"name": "selective_copy", "seq_len": 30, "body_len": 22, "num_copy": 6,
                       "ood_dense_body_len": 60, "ood_sparse_body_len": 8, "eval_samples": 64},
    "flipflop": {"name": "flipflop", "seq_len": 63, "num_instructions": 32, "eval_samples": 64},
    "stdlib": {"name": "stdlib", "seq_len": 32, "max_bytes": 300_000, "eval_samples": 8,
               "valid_fraction": 0.2, "test_fraction": 0.2},
}  # fmt: skip
TASKS = ["counting", "selective_copy", "flipflop"]


def answers(y: torch.Tensor) -> list[list[int]]:
    """The target tokens of each row (the positions with a loss)."""
    return [row[row != IGNORE_INDEX].tolist() for row in y]


def words(ds, row: torch.Tensor) -> list[str]:
    return ds.decode(row[row != ds.pad_id]).split()


def all_eval(ds, split: str, batch_size: int = 25) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    xs, ys = [], []
    for x, y in ds.eval_batches(split, batch_size):
        xs += list(x)
        ys += list(y)
    return xs, ys


@pytest.fixture
def jsonl_dir(tmp_path: Path) -> Path:
    rows = {
        "train": [
            ("the cat sat on the mat", "where did the cat sit ?", "on the mat"),
            ("bob has two red apples", "how many apples ?", "two"),
            ("alice is seven", "how old is alice ?", "seven"),
            ("the sky is blue", "what color is the sky ?", "blue"),
            ("ten plus one is eleven", "what is ten plus one ?", "eleven"),
        ],
        "valid": [("the dog sat on the rug", "where did the dog sit ?", "on the rug")],
        "test": [("carol is nine", "how old is carol ?", "nine"), ("a b", "c ?", "")],
    }
    for split, records in rows.items():
        lines = [
            json.dumps(dict(zip(("context", "question", "answer"), r, strict=True)))
            for r in records
        ]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n\n")
    return tmp_path


@pytest.fixture
def text_files(tmp_path: Path) -> list[str]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    b.write_text("Pack my box with five dozen liquor jugs! Ünïcödé. " * 20)
    return [str(a), str(b)]


OFFLINE = ["counting", "selective_copy", "flipflop", "stdlib", "jsonl", "text"]


@pytest.fixture
def configs(jsonl_dir, text_files) -> dict[str, dict]:
    """Small configs of every source that needs no network."""
    local = {
        "jsonl": {"name": "jsonl", "dir": str(jsonl_dir), "seq_len": 24},
        "text": {"name": "text", "files": text_files, "seq_len": 48},
    }
    return {**SMALL, **local}


@pytest.fixture(params=OFFLINE)
def source(request, configs) -> dict:
    return configs[request.param]


@pytest.fixture
def dataset(source):
    return build_dataset(source)


# --- the interface, for every source that needs no network ---------------------------


def test_batches_shapes_dtypes_and_vocab(dataset):
    x, y = dataset.train_batch(step=3, batch_size=5)
    assert x.shape == y.shape == (5, dataset.seq_len)
    assert x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
    assert dataset.kind in ("task", "lm")
    for xs, ys in [(x, y), *(next(dataset.eval_batches(s, 4)) for s in dataset.eval_splits())]:
        assert xs.shape == ys.shape and xs.shape[1] <= dataset.max_len
        assert 0 <= xs.min() and xs.max() < dataset.vocab_size
        targets = ys[ys != IGNORE_INDEX]
        assert len(targets) > 0 and 0 <= targets.min() and targets.max() < dataset.vocab_size
        assert (targets != dataset.pad_id).all()
        assert (ys[xs == dataset.pad_id] == IGNORE_INDEX).all()
        if dataset.kind == "lm":  # every token scored, y = x shifted by one
            assert (ys != IGNORE_INDEX).all() and torch.equal(xs[:, 1:], ys[:, :-1])


def test_train_batches_are_deterministic_and_stateless(dataset, source):
    x, y = dataset.train_batch(7, 4)
    resumed = build_dataset(source).train_batch(7, 4)  # a fresh process resuming at step 7
    assert torch.equal(x, resumed[0]) and torch.equal(y, resumed[1])
    torch.manual_seed(123)
    np.random.seed(123)  # noqa: NPY002 (the legacy global state must not matter either)
    random.seed(123)
    for _ in range(3):  # other steps in between change no hidden state
        dataset.train_batch(2, 4)
    x2, y2 = dataset.train_batch(7, 4)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, dataset.train_batch(8, 4)[0])


def test_seed_changes_the_data(dataset, source):
    other = build_dataset({**source, "seed": 1})
    assert not torch.equal(dataset.train_batch(0, 4)[0], other.train_batch(0, 4)[0])


def test_fingerprint_is_the_tokens_digest(dataset, source):
    """Sources read from files or the stdlib carry a digest of the tokens they serve (what a
    resume compares): the same for another build and another sampling seed. The synthetic
    tasks, which their config and seed determine, have none."""
    again = build_dataset({**source, "seed": 1})
    if source["name"] in ("counting", "selective_copy", "flipflop"):
        assert dataset.fingerprint() is None and again.fingerprint() is None
    else:
        assert len(dataset.fingerprint()) == 32 and dataset.fingerprint() == again.fingerprint()


def test_digest_hashes_arrays_as_their_bytes():
    """digest() hashes arrays in place, as the bytes .tobytes() gives (a strided array as its
    elements in order), each part's length first: the format checkpoints' digests were made in."""
    parts = [b"name", np.arange(10, dtype=np.uint16)[::3], np.array([True, False]), b""]
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        raw = part.tobytes() if isinstance(part, np.ndarray) else part
        h.update(len(raw).to_bytes(8, "little") + raw)
    assert digest(parts) == h.hexdigest() == "3e43fd8e42eec48950df637bae6f6c68"
    assert digest([b"ab", b"c"]) != digest([b"a", b"bc"])


@pytest.mark.parametrize("name", ["text", "jsonl"])
def test_fingerprint_changes_with_a_files_content(name, configs, jsonl_dir, text_files):
    before = build_dataset(configs[name]).fingerprint()
    path = Path(text_files[1]) if name == "text" else jsonl_dir / "train.jsonl"
    path.write_text(path.read_text().replace("dozen" if name == "text" else "cat", "dog", 1))
    assert build_dataset(configs[name]).fingerprint() != before


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_ranks_partition_the_global_batch(dataset, world_size):
    gx, gy = dataset.train_batch(5, 2 * world_size)
    for rank in range(world_size):
        x, y = dataset.train_batch(5, 2, rank=rank, world_size=world_size)
        assert torch.equal(x, gx[rank::world_size]) and torch.equal(y, gy[rank::world_size])


def test_eval_batches_are_fixed(dataset):
    for split in dataset.eval_splits():
        first, second = list(dataset.eval_batches(split, 3)), list(dataset.eval_batches(split, 3))
        assert len(first) == len(second) > 0
        for (x1, y1), (x2, y2) in zip(first, second, strict=True):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert len({x.shape[1] for x, _ in first}) == 1  # one length per split
    with pytest.raises(ValueError, match="split must be one of"):
        next(dataset.eval_batches("nope", 3))


def test_call_arguments_are_validated(dataset):
    with pytest.raises(ValueError, match="rank"):
        dataset.train_batch(0, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        dataset.train_batch(0, 0)
    with pytest.raises(TypeError, match="step"):
        dataset.train_batch(1.5, 2)


# --- synthetic tasks ------------------------------------------------------------------


def run_program(statements: list[str], max_value: int) -> dict[str, int]:
    """Executes the program as Python (``v ++`` is ``v += 1``), checking the value cap."""
    env = {v: 0 for v in VAR_NAMES}
    for statement in statements:
        exec(statement.replace("++", "+= 1"), {}, env)
        assert max(env.values()) <= max_value
    return env


def counting_program(ds, x_row: torch.Tensor, y_row: torch.Tensor) -> tuple[list[str], str, int]:
    """(statements, printed variable, target answer) of one counting example."""
    w = words(ds, x_row)
    assert w[-2] == "print" and w.count("print") == 1
    statements = [s.strip() for s in " ".join(w[:-2]).split(";")]
    assert statements[-1] == ""
    (target,) = answers(y_row[None])[0]
    return statements[:-1], w[-1], int(ds.vocab.tokens[target])


def test_counting_answers_are_the_program_values():
    ds = build_dataset(SMALL["counting"])
    x, y = ds.train_batch(0, 64)
    xs, ys = all_eval(ds, "test")
    for x_row, y_row in [*zip(x, y, strict=True), *zip(xs, ys, strict=True)]:
        statements, var, answer = counting_program(ds, x_row, y_row)
        assert answer == run_program(statements, ds.max_value)[var]
        assert 3 <= len(statements) <= 9
        assert set(statements) <= {
            "pass",
            *(f"{v} = 0" for v in "xyz"),
            *(f"{v} ++" for v in "xyz"),
        }
    answers_seen = {counting_program(ds, a, b)[2] for a, b in zip(xs, ys, strict=True)}
    assert len(answers_seen) >= 4  # the answers vary


def test_counting_never_exceeds_the_cap_and_ood_is_longer():
    ds = build_dataset({"name": "counting", "num_vars": 1, "p_reset": 0.0, "p_pass": 0.0,
                        "max_statements": 30, "seq_len": 122, "eval_samples": 32})  # fmt: skip
    lengths = {}
    for split in ds.eval_splits():
        xs, ys = all_eval(ds, split)
        progs = [counting_program(ds, a, b) for a, b in zip(xs, ys, strict=True)]
        for statements, var, answer in progs:
            assert answer == run_program(statements, 10)[var] <= 10
        lengths[split] = [len(p[0]) for p in progs]
    assert max(lengths["test"]) <= 30 < min(lengths["ood_long"]) and max(lengths["ood_long"]) <= 60
    assert ds.max_len >= 4 * 60 + 2


def test_counting_statement_ranges_follow_the_config_exactly():
    """Training, valid and test programs have min_statements .. max_statements statements,
    ood_long's max_statements + 1 .. ood_length_factor * max_statements (both ends drawn):
    no OOD program is as short as a training one (the sampled check above would rarely see
    an ood_long range starting one statement early)."""
    ds = build_dataset({**SMALL["counting"], "min_statements": 4, "max_statements": 9,
                        "ood_length_factor": 3, "seq_len": 38})  # fmt: skip
    ranges = {s: ds.statement_range(ds.distribution(s)) for s in ["train", *ds.eval_splits()]}
    assert ranges == {"train": (4, 9), "valid": (4, 9), "test": (4, 9), "ood_long": (10, 27)}
    assert ds.max_len == 4 * 27 + 2
    semicolon = ds.vocab[";"]
    for distribution, expected in (("train", (4, 9)), ("ood_long", (10, 27))):
        drawn = {
            int((ds._example(np.random.default_rng(i), distribution).tokens == semicolon).sum())
            for i in range(400)
        }
        assert (min(drawn), max(drawn)) == expected, distribution


def test_selective_copy_answer_is_the_symbols_in_order():
    ds = build_dataset(SMALL["selective_copy"])
    blank_fraction = {}
    for split in ds.eval_splits():
        xs, ys = all_eval(ds, split)
        fractions = []
        for x_row, y_row in zip(xs, ys, strict=True):
            w = words(ds, x_row)
            body = w[: w.index("|")]
            symbols = [t for t in body if t != "_"]
            assert len(symbols) == 6
            assert ds.decode(answers(y_row[None])[0]).split() == symbols
            assert w[w.index("|") + 1 :] == symbols[:-1]  # the last one is only a target
            fractions.append(body.count("_") / len(body))
        blank_fraction[split] = np.mean(fractions)
    assert blank_fraction["ood_sparse_blanks"] < blank_fraction["test"]
    assert blank_fraction["test"] < blank_fraction["ood_dense_blanks"]


def test_flipflop_reads_return_the_last_written_bit():
    """Reads return the last written bit; ignored bits are random (about half differ from it:
    bits that always matched would give the model a second copy of the answer)."""
    ds = build_dataset(SMALL["flipflop"])
    ignore_fraction, ignored_differ = {}, []
    for split in ds.eval_splits():
        xs, ys = all_eval(ds, split)
        fractions = []
        for x_row, y_row in zip(xs, ys, strict=True):
            tokens = ds.decode(x_row).split() + [ds.vocab.tokens[int(y_row[-1])]]
            instructions, bits = tokens[0::2], tokens[1::2]
            assert instructions[0] == "w" and instructions[-1] == "r" and len(bits) == 32
            expected, last = [], None
            for instruction, bit in zip(instructions, bits, strict=True):
                if instruction == "w":
                    last = bit
                elif instruction == "r":
                    assert bit == last
                    expected.append(bit)
                else:  # an ignored bit: random, not a copy of the answer
                    ignored_differ.append(bit != last)
            assert ds.decode(answers(y_row[None])[0]).split() == expected
            fractions.append(instructions.count("i") / len(instructions))
        ignore_fraction[split] = np.mean(fractions)
    assert ignore_fraction["ood_dense"] < ignore_fraction["test"] < ignore_fraction["ood_sparse"]
    assert 0.35 < np.mean(ignored_differ) < 0.65, np.mean(ignored_differ)
    assert ignore_fraction["ood_sparse"] > 0.85


@pytest.mark.parametrize("key", TASKS)
def test_tasks_select_on_valid_and_report_on_test(key):
    """A task's first eval split (best_val_loss, a sweep's selection) is "valid", not "test":
    both from the training distribution, each from its own stream, so the examples differ and
    test's are what they were before the valid split existed."""
    ds = build_dataset(SMALL[key])
    assert ds.eval_splits()[:2] == ["valid", "test"]
    assert all(s.startswith("ood_") for s in ds.eval_splits()[2:])
    valid, test = (ds.eval_examples(s) for s in ("valid", "test"))
    differ = [a.tokens.tolist() != b.tokens.tolist() for a, b in zip(valid, test, strict=True)]
    assert sum(differ) > len(test) // 2
    for i in (0, len(test) - 1):
        drawn = ds._example(split_rng(ds.seed, "test", i), "train")
        assert drawn.tokens.tolist() == test[i].tokens.tolist()
    # The same distribution: the lengths' ranges of the two in-distribution splits agree.
    lengths = {s: sorted(len(e.tokens) for e in ds.eval_examples(s)) for s in ("valid", "test")}
    assert abs(np.median(lengths["valid"]) - np.median(lengths["test"])) <= 0.25 * np.median(
        lengths["test"]
    )


def test_task_answers_are_the_only_targets():
    for key, per_row in [("counting", 1), ("selective_copy", 6)]:
        _, y = build_dataset(SMALL[key]).train_batch(0, 16)
        assert ((y != IGNORE_INDEX).sum(1) == per_row).all()


@pytest.mark.parametrize(
    "override, match",
    [
        ({"num_vars": 6}, "data.num_vars"),
        ({"seq_len": 20}, "data.seq_len"),
        ({"p_reset": 0.8, "p_pass": 0.5}, r"data.p_reset \+ data.p_pass"),
        ({"min_statements": 10}, "data.max_statements"),
        ({"eval_samples": 0}, "data.eval_samples"),
        ({"seed": -1}, "data.seed"),
    ],
)
def test_task_config_errors_name_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        build_dataset({**SMALL["counting"], **override})


def test_probabilities_may_sum_to_one():
    ds = build_dataset({**SMALL["counting"], "p_reset": 0.9, "p_pass": 0.1})  # no increments
    x, y = ds.train_batch(0, 8)
    for x_row, y_row in zip(x, y, strict=True):
        statements, _, answer = counting_program(ds, x_row, y_row)
        assert answer == 0 and not any("++" in s for s in statements)


def test_synthetic_config_errors_name_the_field():
    with pytest.raises(ValueError, match="data.ood_sparse_body_len"):
        build_dataset({**SMALL["selective_copy"], "ood_sparse_body_len": 3})
    with pytest.raises(ValueError, match="data.p_ignore"):
        build_dataset({**SMALL["flipflop"], "p_ignore": 1.5})


# --- jsonl -----------------------------------------------------------------------------


def test_jsonl_round_trip(configs):
    ds = build_dataset(configs["jsonl"])
    assert ds.kind == "task" and ds.eval_splits() == ["valid", "test"]
    assert ds.vocab.tokens[:4] == ["<pad>", "<unk>", "<sep>", "<eos>"]
    x, y = ds.train_batch(0, 5)  # one epoch: every training example once
    seen = set()
    for x_row, y_row in zip(x, y, strict=True):
        context, question, rest = " ".join(words(ds, x_row)).split(" <sep> ")
        target = ds.decode(answers(y_row[None])[0])
        assert target == f"{rest} <eos>"  # x ends with the answer, y adds the <eos>
        seen.add(context)
    assert len(seen) == 5
    vx, vy = next(ds.eval_batches("valid", 8))
    assert ds.decode(answers(vy)[0]) == "on the <unk> <eos>"  # "rug" is not in train
    assert " ".join(words(ds, vx[0])).startswith("the <unk> sat on the <unk> <sep>")
    tx, ty = next(ds.eval_batches("test", 8))
    assert answers(ty)[1] == [ds.vocab["<eos>"]]  # an empty answer: only the end is scored
    assert ds.eos_id == ds.vocab["<eos>"]  # where sample.py stops an answer
    assert ds.encode("the cat zebra") == [ds.vocab["the"], ds.vocab["cat"], ds.vocab["<unk>"]]


def test_jsonl_epochs_are_permutations(configs):
    ds = build_dataset(configs["jsonl"])
    epoch = [tuple(r.tolist()) for s in range(5) for r in ds.train_batch(s, 1)[0]]
    assert len(set(epoch)) == 5
    assert epoch != [tuple(r.tolist()) for s in range(5, 10) for r in ds.train_batch(s, 1)[0]]
    # batches of 2: steps 0 and 1 read 4 different examples (step * batch on, not step on)
    rows = [tuple(r.tolist()) for s in range(2) for r in ds.train_batch(s, 2)[0]]
    assert len(set(rows)) == 4


def test_jsonl_errors_name_the_path(configs, jsonl_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*train.jsonl"):
        build_dataset({"name": "jsonl", "dir": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="data.dir"):
        build_dataset({"name": "jsonl", "dir": "???"})
    (jsonl_dir / "valid.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="valid.jsonl"):
        build_dataset(configs["jsonl"])
    (jsonl_dir / "valid.jsonl").write_text('{"context": "a", "question": "b"}\n')
    with pytest.raises(ValueError, match=r"valid.jsonl:1.*answer"):
        build_dataset(configs["jsonl"])
    (jsonl_dir / "valid.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"valid.jsonl:1 is not JSON"):
        build_dataset(configs["jsonl"])
    with pytest.raises(ValueError, match=r"train.jsonl:\d+ is \d+ tokens long.*data.seq_len"):
        build_dataset({"name": "jsonl", "dir": str(jsonl_dir), "seq_len": 8})


# --- byte corpora ----------------------------------------------------------------------


def test_text_splits_the_end_of_the_stream(configs, text_files):
    ds = build_dataset(configs["text"])
    assert ds.kind == "lm" and ds.eval_splits() == ["valid@1x", "valid@2x", "valid@4x"]
    assert ds.max_len == 4 * 48
    stream = b"".join(Path(f).read_bytes() + b"\0" for f in text_files)
    valid = stream[len(stream) - round(0.1 * len(stream)) :]
    x, y = next(ds.eval_batches("valid@4x", 64))
    assert x.shape[1] == 4 * 48
    for row, target in zip(x, y, strict=True):
        window = bytes(0 if t == EOS_ID else t for t in [*row.tolist(), int(target[-1])])
        assert window in valid
    assert "Ünïcödé" in ds.decode(ds.train.tolist())
    assert ds.decode(ds.encode("é<x>")) == "é<x>"
    assert ds.decode([104, 105, EOS_ID, 0xC3]) == "hi<eos>\ufffd"
    assert ds.eos_id == EOS_ID


def test_text_windows_stay_inside_the_shortest_stream(tmp_path):
    """A train stream of exactly seq_len + 1 tokens has one window, which every row gets."""
    (tmp_path / "t.txt").write_text("abcdefghijklmnopq")  # 17 bytes + <eos>: 9 train, 9 valid
    ds = build_dataset({"name": "text", "files": [str(tmp_path / "t.txt")], "seq_len": 8,
                        "valid_fraction": 0.5})  # fmt: skip
    x, y = ds.train_batch(0, 64)
    assert ds.decode(x[0]) == "abcdefgh" and ds.decode(y[0]) == "bcdefghi"
    assert (x == x[0]).all() and ds.eval_splits() == ["valid@1x"]
    assert ds.decode(next(ds.eval_batches("valid@1x", 4))[1][0]) == "klmnopq<eos>"


def test_text_errors(tmp_path, text_files):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        build_dataset({"name": "text", "files": [str(tmp_path / "missing.txt")]})
    with pytest.raises(ValueError, match="data.files"):
        build_dataset({"name": "text"})
    with pytest.raises(ValueError, match="data.seq_len"):
        build_dataset({"name": "text", "files": text_files, "seq_len": 10_000})


def test_text_relative_paths_resolve_against_the_cwd(text_files, monkeypatch):
    monkeypatch.chdir(Path(text_files[0]).parent)
    ds = build_dataset({"name": "text", "files": ["a.txt"], "seq_len": 16})
    assert ds.decode(ds.train[:9].tolist()) == "The quick"


def test_stdlib_is_split_by_file():
    ds = build_dataset(SMALL["stdlib"])
    files = {k: set(v) for k, v in ds.files.items()}
    assert all(files.values())
    assert not files["train"] & files["valid"] and not files["train"] & files["test"]
    assert not files["valid"] & files["test"]
    assert not any("site-packages" in f for f in set().union(*files.values()))
    assert ds.eval_splits() == ["valid@1x", "valid@2x", "valid@4x", "test@1x"]
    root = Path(sysconfig.get_paths()["stdlib"])
    assert sum((root / f).stat().st_size for f in set().union(*files.values())) <= 300_000
    first = (root / ds.files["train"][0]).read_bytes()
    assert bytes(ds.train[: len(first)].tolist()) == first and ds.train[len(first)] == EOS_ID
    with pytest.raises(ValueError, match=r"data.valid_fraction \+ data.test_fraction"):
        build_dataset({**SMALL["stdlib"], "valid_fraction": 0.5, "test_fraction": 0.5})
    # The split of a file depends on its path only, not on the cap.
    bigger = build_dataset({**SMALL["stdlib"], "max_bytes": 600_000}).files
    for split, names in files.items():
        others = set().union(*(set(v) for k, v in bigger.items() if k != split))
        assert not names & others


def test_stdlib_too_small_a_budget_names_the_options_that_fix_it():
    """Files are drawn whole: a small data.max_bytes can leave the valid split one empty file."""
    cfg = {"name": "stdlib", "max_bytes": 20_000, "seq_len": 64}  # the default fractions
    with pytest.raises(ValueError, match=r"data.max_bytes=20000 gives the valid split .* raise "
                       r"data.max_bytes or data.valid_fraction"):  # fmt: skip
        build_dataset(cfg)


def test_stdlib_fractions_set_each_files_split():
    """With unequal fractions (valid 0.1, test 0.3), a file whose path hashes to bucket b in
    [0, 1) is test below 0.3, valid in [0.3, 0.4), train above."""
    from lm.data.stdlib import _order_and_bucket

    ds = build_dataset({**SMALL["stdlib"], "valid_fraction": 0.1, "test_fraction": 0.3})
    bounds = {"test": (0.0, 0.3), "valid": (0.3, 0.4), "train": (0.4, 1.0)}
    for split, names in ds.files.items():
        low, high = bounds[split]
        assert names and all(low <= _order_and_bucket(f)[1] < high for f in names), split


# --- Hub datasets ------------------------------------------------------------------------


@pytest.fixture
def fresh_hub_cache():
    load_hub_streams.cache_clear()
    yield
    load_hub_streams.cache_clear()


def test_hub_error_without_network(monkeypatch, fresh_hub_cache):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"Salesforce/wikitext.*data=stdlib.*data=text.*jsonl"):
        build_dataset({"name": "wikitext103"})


def test_hub_error_in_offline_mode(tmp_path):
    """The real ``load_dataset`` with the Hub's offline switches and an empty cache."""
    # The repository first on the path, the rest kept (an install may live on PYTHONPATH)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path), "PYTHONPATH": path}  # fmt: skip
    code = "from lm.data import build_dataset; build_dataset({'name': 'tinystories'})"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "RuntimeError: data=tinystories" in result.stderr
    assert "roneneldan/TinyStories" in result.stderr and "data=stdlib" in result.stderr


def test_hub_success_with_a_local_dataset(monkeypatch, fresh_hub_cache):
    import datasets

    calls = []

    def fake(path, name=None, split=None):
        calls.append((path, name, split))
        rows = [f"{split} story {i} about a cat.\n" for i in range(400)]
        return datasets.Dataset.from_dict({"text": rows})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    ds = build_dataset({"name": "tinystories", "seq_len": 32, "eval_samples": 4})
    assert calls == [("roneneldan/TinyStories", None, s) for s in ("train", "validation")]
    assert ds.eval_splits() == ["valid@1x", "valid@2x", "valid@4x"]
    assert ds.decode(ds.train[:60].tolist()).startswith(
        "train story 0 about a cat.\n<eos>train story 1 about a cat.\n<eos>"
    )
    assert "validation story" in ds.decode(next(ds.eval_batches("valid@2x", 4))[0][0])

    calls.clear()
    wiki = build_dataset({"name": "wikitext103", "seq_len": 32, "max_bytes": 1000})
    assert [c[2] for c in calls] == ["train", "validation", "test"]
    assert (wiki.train == EOS_ID).sum() == 1  # lines of one text, one <eos> at its end
    assert 1000 <= len(wiki.train) - 1 < 1000 + len("train story 0 about a cat.\n")
    # The evaluation splits whole, whatever max_bytes: a sweep over it scored each run on
    # other text (a review's find)
    load_hub_streams.cache_clear()
    whole = build_dataset({"name": "wikitext103", "seq_len": 32})
    for split in wiki.eval_splits():
        got, expected = (next(d.eval_batches(split, 4))[0] for d in (wiki, whole))
        assert torch.equal(got, expected), split
    assert wiki.eval_splits()[-1] == "test@1x"


# --- configs --------------------------------------------------------------------------


def test_schemas():
    assert set(DATA_SCHEMAS) == {"counting", "selective_copy", "flipflop", "stdlib", "jsonl",
                                 "text", "wikitext103", "tinystories"}  # fmt: skip
    for key, schema in DATA_SCHEMAS.items():
        node = OmegaConf.structured(schema)
        assert node.name == key
        assert {"seq_len", "eval_samples", "seed"} <= set(node)


def test_misspelled_yaml_key_fails_at_composition(data_configs):
    with initialize_config_dir(config_dir=str(data_configs), version_base=None):
        with pytest.raises(ConfigCompositionException, match="num_var"):
            compose("main", overrides=["data=misspelled"])


def test_build_errors():
    with pytest.raises(ValueError, match=r"data.name must be one of \['counting'"):
        build_dataset({"name": "countin"})
    with pytest.raises(ValueError, match=r"unknown keys \['num_var'\]"):
        build_dataset({"name": "counting", "num_var": 2})


@pytest.fixture(scope="module")
def data_configs(tmp_path_factory):
    """A config tree with the repository's ``data/`` group under a minimal primary config."""
    root = tmp_path_factory.mktemp("configs")
    shutil.copytree(REPO / "configs" / "data", root / "data")
    (root / "data" / "misspelled.yaml").write_text(
        "defaults:\n  - /schema/data/counting@_here_\n  - _self_\n\nnum_var: 2\n"
    )
    (root / "main.yaml").write_text("defaults:\n  - data: counting\n  - _self_\n")
    register_configs()
    return root


@pytest.mark.parametrize("key", sorted(DATA_SCHEMAS))
def test_yaml_composes_onto_its_schema(data_configs, key, jsonl_dir):
    with initialize_config_dir(config_dir=str(data_configs), version_base=None):
        cfg = compose("main", overrides=[f"data={key}"])
        yaml = OmegaConf.to_container(OmegaConf.load(data_configs / "data" / f"{key}.yaml"))
        assert yaml.pop("defaults") == [f"/schema/data/{key}@_here_", "_self_"]
        schema = OmegaConf.to_container(OmegaConf.structured(DATA_SCHEMAS[key]))
        assert set(yaml) == set(schema)  # the yaml sets every field
        assert OmegaConf.to_container(cfg.data) == yaml
        with pytest.raises(ConfigCompositionException, match="data.seq_lne"):
            compose("main", overrides=[f"data={key}", "data.seq_lne=3"])
        with pytest.raises(ConfigCompositionException, match="data.seq_len"):
            compose("main", overrides=[f"data={key}", "data.seq_len=long"])
        if key in TASKS:
            assert build_dataset(cfg.data).seq_len == cfg.data.seq_len
        if key == "jsonl":
            cfg = compose("main", overrides=["data=jsonl", f"data.dir={jsonl_dir}"])
            assert build_dataset(cfg.data).kind == "task"


# --- audit: gaps found by mutation testing ----------------------------------------------


def test_int_checks_refuse_bools():
    """A bool is not an int here (``True`` would silently be 1): a config value or a call
    argument given as a bool fails with TypeError naming it."""
    with pytest.raises(TypeError, match="data.seed"):
        build_dataset({**SMALL["counting"], "seed": True})
    with pytest.raises(TypeError, match="batch_size"):
        build_dataset(SMALL["counting"]).train_batch(0, True)


def test_corpus_eval_windows_tile_the_stream_whatever_the_batch_size(tmp_path):
    """A 20-token valid stream at seq_len 4 holds 20 // 5 = 4 disjoint 1x windows (not
    20 // 4 = 5 overlapping ones), evenly spaced: together they are the stream itself, and
    every batch size yields all of them. A stream of exactly seq_len tokens holds no window."""
    (tmp_path / "t.txt").write_text("".join(chr(ord("a") + i % 26) for i in range(39)))
    ds = build_dataset({"name": "text", "files": [str(tmp_path / "t.txt")], "seq_len": 4,
                        "valid_fraction": 0.5, "eval_samples": 64})  # fmt: skip
    valid = ds._streams["valid"].tolist()
    assert len(valid) == 20
    for split, count in (("valid@1x", 4), ("valid@2x", 2), ("valid@4x", 1)):
        for batch_size in (1, 3, 64):
            xs, ys = all_eval(ds, split, batch_size)
            assert len(xs) == count, (split, batch_size)
        if split == "valid@1x":
            assert [t for x, y in zip(xs, ys, strict=True) for t in [*x.tolist(), y[-1]]] == valid
    (tmp_path / "t.txt").write_text("abcdefghijklmnop")  # 17 tokens: 9 train, 8 valid
    with pytest.raises(ValueError, match="valid stream has 8 tokens"):
        build_dataset({"name": "text", "files": [str(tmp_path / "t.txt")], "seq_len": 8,
                       "valid_fraction": 0.5})  # fmt: skip


def test_counting_queries_every_variable_and_follows_the_probabilities():
    """The printed variable is any of them (the last one too); p_pass and p_reset are the
    probabilities of ``pass ;`` and ``v = 0 ;`` respectively."""
    ds = build_dataset(SMALL["counting"])
    xs, ys = all_eval(ds, "test")
    programs = [counting_program(ds, a, b) for a, b in zip(xs, ys, strict=True)]
    assert {var for _, var, _ in programs} == set("xyz")
    # drawn independently of the program: the last statement's variable about a third of the time
    x, y = ds.train_batch(0, 256)
    programs += [counting_program(ds, a, b) for a, b in zip(x, y, strict=True)]
    last = [(stmts[-1][0], var) for stmts, var, _ in programs if stmts[-1] != "pass"]
    assert len(last) > 100 and np.mean([a == b for a, b in last]) < 0.5
    for override, allowed in (({"p_pass": 1.0, "p_reset": 0.0}, {"pass"}),
                              ({"p_pass": 0.0, "p_reset": 1.0}, {"x = 0", "y = 0", "z = 0"})):  # fmt: skip
        ds = build_dataset({**SMALL["counting"], **override})
        x, y = ds.train_batch(0, 16)
        for x_row, y_row in zip(x, y, strict=True):
            assert set(counting_program(ds, x_row, y_row)[0]) <= allowed, override


def test_selective_copy_lengths_are_exact():
    """An example has body + separator + symbols tokens, so its input is body_len + num_copy
    tokens: seq_len may be exactly that, and max_len is the longest split's input."""
    ds = build_dataset({**SMALL["selective_copy"], "seq_len": 22 + 6})
    assert ds.max_len == 60 + 6
    x, _ = next(ds.eval_batches("ood_dense_blanks", 4))
    assert x.shape[1] == 60 + 6 and (x != ds.pad_id).all()
    with pytest.raises(ValueError, match="data.seq_len=27"):
        build_dataset({**SMALL["selective_copy"], "seq_len": 27})


def test_jsonl_limits_and_boundaries(configs, jsonl_dir):
    """eval_samples caps each eval split's examples; a training example may be exactly seq_len
    + 1 tokens; words of the training data that spell a special token are that token."""
    ds = build_dataset({**configs["jsonl"], "eval_samples": 1})
    assert len(ds.eval_examples("valid")) == len(ds.eval_examples("test")) == 1
    longest = max(ex.input_len for ex in ds.train)
    assert build_dataset({**configs["jsonl"], "seq_len": longest}).seq_len == longest
    with pytest.raises(ValueError, match="raise data.seq_len"):
        build_dataset({**configs["jsonl"], "seq_len": longest - 1})
    with (jsonl_dir / "train.jsonl").open("a") as f:
        f.write(json.dumps({"context": "a <sep> b", "question": "<eos> ?", "answer": "<pad>"}))
    ds = build_dataset(configs["jsonl"])
    assert ds.vocab.tokens[:4] == ["<pad>", "<unk>", "<sep>", "<eos>"]
    assert len(set(ds.vocab.tokens)) == len(ds.vocab)


def test_stdlib_cap_and_an_empty_test_split():
    """A file over the remaining budget is skipped, not the end of the reading: no file left
    out would still fit under max_bytes. test_fraction=0 gives no test split."""
    from lm.data.stdlib import stdlib_files

    ds = build_dataset(SMALL["stdlib"])
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen = set().union(*ds.files.values())
    left = 300_000 - sum((root / f).stat().st_size for f in chosen)
    assert all(p.stat().st_size > left for r, p in stdlib_files(root) if r not in chosen)
    ds = build_dataset({**SMALL["stdlib"], "test_fraction": 0.0})
    assert ds.files["test"] == [] and ds.eval_splits() == ["valid@1x", "valid@2x", "valid@4x"]


def test_decode_refuses_ids_past_the_vocabulary():
    ds = build_dataset(SMALL["flipflop"])
    with pytest.raises(ValueError, match="ids must be in"):
        ds.decode([len(ds.vocab)])


def test_a_train_stream_shorter_than_one_window_is_refused(tmp_path):
    """16 bytes + <eos> = 17 tokens, the last 9 valid: 8 train tokens, one short of a window
    of seq_len + 1 = 9 (the valid stream holds one): refused when the dataset is built."""
    (tmp_path / "t.txt").write_text("abcdefghijklmnop")
    with pytest.raises(ValueError, match="training stream has 8 tokens.*data.seq_len"):
        build_dataset({"name": "text", "files": [str(tmp_path / "t.txt")], "seq_len": 8,
                       "valid_fraction": 0.53})  # fmt: skip


def test_vocab_tokens_must_be_distinct():
    with pytest.raises(ValueError, match="tokens must be distinct"):
        Vocab(["<pad>", "a", "a"])
