"""Local question answering: ``data=jsonl data.dir=PATH``.

``PATH`` holds ``train.jsonl``, ``valid.jsonl`` and ``test.jsonl``, one JSON object
``{"context": str, "question": str, "answer": str}`` per line. Tokens are the
whitespace-separated words; the vocabulary is ``<pad> <unk> <sep> <eos>`` then the
training split's words, most frequent first (words seen only in valid/test become
``<unk>``). An example reads

    context <sep> question <sep> answer <eos>

and the answer words and the closing ``<eos>`` (so a model learns where its answer
ends) are the answer tokens: the loss and the accuracy are on them only.

Training rows go through the training set in a fresh seeded permutation per epoch;
"valid" and "test" hold the first ``eval_samples`` examples of their files. A training
example must fit in ``seq_len``; evaluation examples may be longer.
"""

import json
from collections import Counter
from pathlib import Path

import numpy as np
from omegaconf import MISSING

from lm.data.base import digest, split_rng
from lm.data.config import JsonlConfig
from lm.data.examples import Example, ExampleDataset
from lm.data.text import resolve_path
from lm.data.vocab import Vocab

FIELDS = ("context", "question", "answer")
FILES = ("train.jsonl", "valid.jsonl", "test.jsonl")
SPECIALS = ("<pad>", "<unk>", "<sep>", "<eos>")
EXPECTED = 'one {"context": ..., "question": ..., "answer": ...} JSON object per line'


def read_jsonl(path: Path, limit: int | None = None) -> list[tuple[int, dict[str, list[str]]]]:
    """(line number, {field: words}) of the first ``limit`` records of ``path``."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: data=jsonl expects {EXPECTED}")
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and len(records) == limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not JSON ({e}); expected {EXPECTED}") from e
            if not isinstance(record, dict) or any(
                not isinstance(record.get(k), str) for k in FIELDS
            ):
                got = line.strip()[:200]
                raise ValueError(f"{path}:{number}: got {got!r}; expected {EXPECTED}")
            records.append((number, {k: record[k].split() for k in FIELDS}))
    if not records:
        raise ValueError(f"{path} holds no records; expected {EXPECTED}")
    return records


class JsonlDataset(ExampleDataset):
    def __init__(self, cfg: JsonlConfig):
        if cfg.dir == MISSING or not cfg.dir:
            raise ValueError("data.dir is not set: use data=jsonl data.dir=PATH")
        root = resolve_path(cfg.dir)
        if not root.is_dir():
            raise FileNotFoundError(
                f"data.dir={root} is not a directory; data=jsonl expects it to hold "
                f"{', '.join(FILES)} with {EXPECTED}"
            )
        train = read_jsonl(root / "train.jsonl")
        counts = Counter(w for _, r in train for k in FIELDS for w in r[k])
        words = sorted(counts, key=lambda w: (-counts[w], w))
        vocab = Vocab([*SPECIALS, *(w for w in words if w not in SPECIALS)], unk="<unk>")
        super().__init__(vocab, "<pad>", cfg.seq_len, cfg.eval_samples, cfg.seed)
        self.train = [self._example(r) for _, r in train]
        for (number, _), ex in zip(train, self.train, strict=True):
            if ex.input_len > self.seq_len:
                raise ValueError(
                    f"{root / 'train.jsonl'}:{number} is {ex.input_len + 1} tokens long, more "
                    f"than data.seq_len + 1 = {self.seq_len + 1}: raise data.seq_len"
                )
        self.evals = {
            split: [
                self._example(r) for _, r in read_jsonl(root / f"{split}.jsonl", self.eval_samples)
            ]
            for split in self.eval_splits()
        }
        self.max_len = max(
            self.seq_len, *(ex.input_len for exs in self.evals.values() for ex in exs)
        )
        self._permutation: tuple[int, np.ndarray] | None = None

    def _example(self, record: dict[str, list[str]]) -> Example:
        prompt = [*record["context"], "<sep>", *record["question"], "<sep>"]
        answer = [*record["answer"], "<eos>"]
        tokens = np.asarray(self.vocab.encode_words(prompt + answer), dtype=np.int64)
        mask = np.zeros(len(tokens), dtype=bool)
        mask[len(prompt) :] = True
        return Example(tokens, mask)

    def eval_splits(self) -> list[str]:
        return ["valid", "test"]

    def fingerprint(self) -> str:
        # The vocabulary (built from train.jsonl's word counts), each split's size and every
        # example's tokens and answer mask.
        splits = [self.train, *(self.evals[split] for split in self.eval_splits())]
        sizes = [str(len(examples)).encode() for examples in splits]
        tokens = [part for examples in splits for ex in examples for part in (ex.tokens, ex.answer)]
        return digest(["\0".join(self.vocab.tokens).encode(), *sizes, *tokens])

    def _make_eval_examples(self, split: str) -> list[Example]:
        return self.evals[split]

    def _train_example(self, step: int, row: int, global_batch: int) -> Example:
        index = step * global_batch + row
        epoch, position = divmod(index, len(self.train))
        if self._permutation is None or self._permutation[0] != epoch:
            order = split_rng(self.seed, "train", epoch).permutation(len(self.train))
            self._permutation = (epoch, order)
        return self.train[int(self._permutation[1][position])]
