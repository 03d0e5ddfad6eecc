"""Common part of the synthetic tasks: examples drawn from a seeded generator per row."""

from abc import abstractmethod

import numpy as np

from lm.data.base import split_rng
from lm.data.examples import Example, ExampleDataset

TRAIN = "train"
# Eval splits drawn from the training distribution, each from its own stream: "valid" is the
# first split (the one best_val_loss, and so a sweep's selection, is measured on), "test" the
# one to report. Independent draws: where a task has few distinct short examples (counting
# with one variable) some occur in both, as they do in training.
IN_DISTRIBUTION = ("valid", "test")


class SyntheticTask(ExampleDataset):
    """A task defined by ``_example(rng, distribution)``: eval splits "valid" and "test" have
    the training distribution, the ``ood_splits()`` are out of distribution. Subclasses end
    their ``__init__`` with ``_set_lengths()``."""

    @abstractmethod
    def _example(self, rng: np.random.Generator, distribution: str) -> Example:
        """One example of ``distribution`` ("train" or an out-of-distribution split's name)
        drawn from ``rng``."""

    @abstractmethod
    def _max_input_len(self, distribution: str) -> int:
        """Upper bound of the input length (tokens - 1) of the examples of ``distribution``."""

    @abstractmethod
    def ood_splits(self) -> list[str]:
        """Names of the out-of-distribution eval splits."""

    def eval_splits(self) -> list[str]:
        return [*IN_DISTRIBUTION, *self.ood_splits()]

    @staticmethod
    def distribution(split: str) -> str:
        """The distribution an eval split (or "train") is drawn from: "train" for the
        in-distribution splits, else the split's own."""
        return TRAIN if split in IN_DISTRIBUTION else split

    def _set_lengths(self) -> None:
        needed = self._max_input_len(TRAIN)
        if needed > self.seq_len:
            raise ValueError(
                f"data.seq_len={self.seq_len} is too short for the training examples of "
                f"this configuration (up to {needed} input tokens): raise data.seq_len to "
                f"{needed} or shorten the examples"
            )
        self.max_len = max(
            self.seq_len,
            *(self._max_input_len(self.distribution(s)) for s in self.eval_splits()),
        )

    def _train_example(self, step: int, row: int, global_batch: int) -> Example:
        return self._example(split_rng(self.seed, TRAIN, step, row), TRAIN)

    def _make_eval_examples(self, split: str) -> list[Example]:
        rngs = (split_rng(self.seed, split, i) for i in range(self.eval_samples))
        return [self._example(rng, self.distribution(split)) for rng in rngs]

    def _make(self, words: list[str], num_answer: int) -> Example:
        """An example whose last ``num_answer`` tokens are the answer."""
        tokens = np.asarray(self.vocab.encode_words(words), dtype=np.int64)
        answer = np.zeros(len(tokens), dtype=bool)
        answer[len(tokens) - num_answer :] = True
        return Example(tokens, answer)
