"""Selective copy: copy the symbols scattered among blanks, in order, after a separator.

An example is a body of ``body_len`` tokens holding ``num_copy`` symbols (drawn with
replacement from ``num_symbols`` letters) at random positions and blanks ``_``
elsewhere, then ``|``, then the symbols in order (the answer tokens):

    _ C _ _ A _ C _ | C A C

Splits: "valid" and "test" have the training body length; "ood_dense_blanks" a longer body
(``ood_dense_body_len``: more blanks between symbols, and a longer input) and
"ood_sparse_blanks" a shorter one (``ood_sparse_body_len``: fewer blanks). The number
of symbols, hence the answer, has the same length in every split.
"""

import string

import numpy as np

from lm.data.base import check_int
from lm.data.config import SelectiveCopyConfig
from lm.data.examples import Example
from lm.data.synthetic import SyntheticTask
from lm.data.vocab import Vocab

BLANK, SEPARATOR = "_", "|"


class SelectiveCopyTask(SyntheticTask):
    def __init__(self, cfg: SelectiveCopyConfig):
        letters = string.ascii_uppercase
        self.num_symbols = check_int("data.num_symbols", cfg.num_symbols, 2, len(letters))
        self.num_copy = check_int("data.num_copy", cfg.num_copy, 1)
        self.body_lens = {
            "train": check_int("data.body_len", cfg.body_len, self.num_copy),
            "ood_dense_blanks": check_int(
                "data.ood_dense_body_len", cfg.ood_dense_body_len, self.num_copy
            ),
            "ood_sparse_blanks": check_int(
                "data.ood_sparse_body_len", cfg.ood_sparse_body_len, self.num_copy
            ),
        }
        self.symbols = list(letters[: self.num_symbols])
        vocab = Vocab(["<pad>", BLANK, SEPARATOR, *self.symbols])
        super().__init__(vocab, "<pad>", cfg.seq_len, cfg.eval_samples, cfg.seed)
        self._set_lengths()

    def ood_splits(self) -> list[str]:
        return ["ood_dense_blanks", "ood_sparse_blanks"]

    def _max_input_len(self, distribution: str) -> int:
        return self.body_lens[distribution] + 1 + self.num_copy - 1

    def _example(self, rng: np.random.Generator, distribution: str) -> Example:
        body = [BLANK] * self.body_lens[distribution]
        places = np.sort(rng.choice(len(body), size=self.num_copy, replace=False))
        symbols = [self.symbols[s] for s in rng.integers(0, self.num_symbols, size=self.num_copy)]
        for place, symbol in zip(places.tolist(), symbols, strict=True):
            body[place] = symbol
        return self._make([*body, SEPARATOR, *symbols], num_answer=self.num_copy)
