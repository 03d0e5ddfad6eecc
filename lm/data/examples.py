"""Sources made of separate examples with an answer: the synthetic tasks and jsonl.

An example is a token sequence and a mask of its answer tokens. The model reads
tokens[:-1] and is scored on predicting the answer tokens only; sequences are padded on
the right (causal attention never looks at the padding of a real position).
"""

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lm.data.base import IGNORE_INDEX, Batch, LMDataset, check_int
from lm.data.vocab import Vocab


@dataclass(frozen=True)
class Example:
    """tokens: int64 [T]; answer: bool [T], True at the answer tokens (they get the loss)."""

    tokens: np.ndarray
    answer: np.ndarray

    @property
    def input_len(self) -> int:
        return len(self.tokens) - 1


def collate(examples: Sequence[Example], length: int, pad_id: int) -> Batch:
    """(x, y): int64 [len(examples), length]; y = next token at answer tokens, else ignored."""
    x = np.full((len(examples), length), pad_id, dtype=np.int64)
    y = np.full((len(examples), length), IGNORE_INDEX, dtype=np.int64)
    for b, ex in enumerate(examples):
        n = ex.input_len
        x[b, :n] = ex.tokens[:-1]
        y[b, :n] = np.where(ex.answer[1:], ex.tokens[1:], IGNORE_INDEX)
    return torch.from_numpy(x), torch.from_numpy(y)


class ExampleDataset(LMDataset):
    """Train batches are padded to seq_len; each eval split to its longest example."""

    kind = "task"

    def __init__(self, vocab: Vocab, pad_token: str, seq_len: int, eval_samples: int, seed: int):
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self.pad_id = vocab[pad_token]
        self.eos_id = vocab.ids.get("<eos>")  # answers of the jsonl tasks end with it
        self.seq_len = check_int("data.seq_len", seq_len, 1)
        self.eval_samples = check_int("data.eval_samples", eval_samples, 1)
        self.seed = check_int("data.seed", seed, 0)
        self._eval_cache: dict[str, list[Example]] = {}

    @abstractmethod
    def _train_example(self, step: int, row: int, global_batch: int) -> Example:
        """Row ``row`` of the global training batch of ``step``."""

    @abstractmethod
    def _make_eval_examples(self, split: str) -> list[Example]:
        """The fixed examples of an eval split."""

    def eval_examples(self, split: str) -> list[Example]:
        self._check_split(split)
        if split not in self._eval_cache:
            self._eval_cache[split] = self._make_eval_examples(split)
        return self._eval_cache[split]

    def _train_rows(self, step: int, rows: range, global_batch: int) -> Batch:
        examples = [self._train_example(step, row, global_batch) for row in rows]
        return collate(examples, self.seq_len, self.pad_id)

    def eval_batches(self, split: str, batch_size: int) -> Iterator[Batch]:
        check_int("batch_size", batch_size, 1)
        examples = self.eval_examples(split)
        length = max(ex.input_len for ex in examples)
        for start in range(0, len(examples), batch_size):
            yield collate(examples[start : start + batch_size], length, self.pad_id)

    def encode(self, text: str) -> list[int]:
        return self.vocab.encode(text)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        return self.vocab.decode(ids)
