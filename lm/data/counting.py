"""Counting (the CoPE paper's task, arXiv 2405.18719): track a variable through a program.

A program is ``n`` statements over ``num_vars`` variables, each one of

    v = 0 ;      (reset, probability p_reset)
    pass ;       (no-op, probability p_pass)
    v ++ ;       (increment, the rest)

followed by ``print v A`` where ``A`` (one token, "0" .. str(max_value)) is the value of
``v`` and the only answer token. Every variable starts at 0. Values stay <= max_value
because an increment that would pass it is written as a reset instead: the program
means what it says, and running it gives the answer. The answer is the number of
increments of one variable since its last reset, among statements about the others: a
count of tokens of a kind rather than a distance, which is what CoPE was designed for.

Splits: "valid" and "test" have the training distribution (``min_statements`` .. ``max_statements``
statements); "ood_long" has ``max_statements + 1`` .. ``ood_length_factor *
max_statements`` statements.
"""

import numpy as np

from lm.data.base import check_fraction, check_int
from lm.data.config import CountingConfig
from lm.data.examples import Example
from lm.data.synthetic import SyntheticTask
from lm.data.vocab import Vocab

VAR_NAMES = ("x", "y", "z", "u", "v")
RESET, PASS, INCREMENT = 0, 1, 2
RESET_LEN = 4  # the longest statement, "v = 0 ;"
PRINT_LEN = 3  # "print v A"


class CountingTask(SyntheticTask):
    def __init__(self, cfg: CountingConfig):
        self.num_vars = check_int("data.num_vars", cfg.num_vars, 1, len(VAR_NAMES))
        self.min_statements = check_int("data.min_statements", cfg.min_statements, 1)
        self.max_statements = check_int(
            "data.max_statements", cfg.max_statements, self.min_statements
        )
        self.ood_length_factor = check_int("data.ood_length_factor", cfg.ood_length_factor, 2)
        self.max_value = check_int("data.max_value", cfg.max_value, 1)
        p_reset = check_fraction("data.p_reset", cfg.p_reset, 0.0, 1.0)
        p_pass = check_fraction("data.p_pass", cfg.p_pass, 0.0, 1.0)
        if p_reset + p_pass > 1.0 + 1e-9:
            raise ValueError(f"data.p_reset + data.p_pass must be <= 1, got {p_reset} + {p_pass}")
        self.probs = np.array([p_reset, p_pass, max(0.0, 1.0 - p_reset - p_pass)])
        self.probs /= self.probs.sum()
        self.vars = VAR_NAMES[: self.num_vars]
        values = [str(v) for v in range(self.max_value + 1)]
        vocab = Vocab(["<pad>", "=", "++", ";", "pass", "print", *self.vars, *values])
        super().__init__(vocab, "<pad>", cfg.seq_len, cfg.eval_samples, cfg.seed)
        self._set_lengths()

    def ood_splits(self) -> list[str]:
        return ["ood_long"]

    def statement_range(self, split: str) -> tuple[int, int]:
        """(min, max) number of statements of the programs of ``split`` (a split's name or
        "train")."""
        if split == "ood_long":
            return self.max_statements + 1, self.ood_length_factor * self.max_statements
        return self.min_statements, self.max_statements

    def _max_input_len(self, distribution: str) -> int:
        return RESET_LEN * self.statement_range(distribution)[1] + PRINT_LEN - 1

    def _example(self, rng: np.random.Generator, distribution: str) -> Example:
        low, high = self.statement_range(distribution)
        n = int(rng.integers(low, high + 1))
        kinds = rng.choice(3, size=n, p=self.probs)
        targets = rng.integers(0, self.num_vars, size=n)
        values = [0] * self.num_vars
        words: list[str] = []
        for kind, var in zip(kinds.tolist(), targets.tolist(), strict=True):
            name = self.vars[var]
            if kind == PASS:
                words += ["pass", ";"]
            elif kind == INCREMENT and values[var] < self.max_value:
                words += [name, "++", ";"]
                values[var] += 1
            else:
                words += [name, "=", "0", ";"]
                values[var] = 0
        query = int(rng.integers(0, self.num_vars))
        words += ["print", self.vars[query], str(values[query])]
        return self._make(words, num_answer=1)
