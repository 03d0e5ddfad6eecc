"""Flip-flop language (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop
Language Modeling"): remember the last written bit across ignored instructions.

An example is ``num_instructions`` pairs (instruction, bit): ``w b`` writes b, ``i b``
is ignored, ``r b`` reads and b must equal the last written bit. The first
instruction is a write and the last a read; in between an instruction is an ignore
with probability ``p_ignore`` and otherwise a write or a read with equal odds. The
answer tokens are the bits of the reads:

    w 1 i 0 i 1 r 1 w 0 i 1 r 0

Splits: "valid" and "test" have the training ``p_ignore``; "ood_sparse" far more ignores
(the paper's FFL(0.98): writes far apart) and "ood_dense" far fewer (FFL(0.1)).
"""

import numpy as np

from lm.data.base import check_fraction, check_int
from lm.data.config import FlipFlopConfig
from lm.data.examples import Example
from lm.data.synthetic import SyntheticTask
from lm.data.vocab import Vocab

WRITE, IGNORE, READ = 0, 1, 2
INSTRUCTIONS = ("w", "i", "r")


class FlipFlopTask(SyntheticTask):
    def __init__(self, cfg: FlipFlopConfig):
        self.num_instructions = check_int("data.num_instructions", cfg.num_instructions, 2)
        train = check_fraction("data.p_ignore", cfg.p_ignore, 0.0, 1.0)
        self.p_ignore = {
            "train": train,
            "ood_sparse": check_fraction(
                "data.ood_sparse_p_ignore", cfg.ood_sparse_p_ignore, 0.0, 1.0
            ),
            "ood_dense": check_fraction(
                "data.ood_dense_p_ignore", cfg.ood_dense_p_ignore, 0.0, 1.0
            ),
        }
        vocab = Vocab(["<pad>", *INSTRUCTIONS, "0", "1"])
        self.instruction_ids = np.array([vocab[t] for t in INSTRUCTIONS])
        self.bit_ids = np.array([vocab["0"], vocab["1"]])
        super().__init__(vocab, "<pad>", cfg.seq_len, cfg.eval_samples, cfg.seed)
        self._set_lengths()

    def ood_splits(self) -> list[str]:
        return ["ood_sparse", "ood_dense"]

    def _max_input_len(self, distribution: str) -> int:
        return 2 * self.num_instructions - 1

    def _example(self, rng: np.random.Generator, distribution: str) -> Example:
        p_ignore = self.p_ignore[distribution]
        p_other = (1.0 - p_ignore) / 2
        kinds = rng.choice(3, size=self.num_instructions, p=[p_other, p_ignore, p_other])
        kinds[0], kinds[-1] = WRITE, READ
        bits = rng.integers(0, 2, size=self.num_instructions)
        # A read's bit is the bit of the latest write at or before it.
        writes = np.where(kinds == WRITE, np.arange(self.num_instructions), 0)
        last_write = np.maximum.accumulate(writes)
        bits = np.where(kinds == READ, bits[last_write], bits)
        tokens = np.zeros(2 * self.num_instructions, dtype=np.int64)
        tokens[0::2] = self.instruction_ids[kinds]
        tokens[1::2] = self.bit_ids[bits]
        answer = np.zeros(len(tokens), dtype=bool)
        answer[1::2] = kinds == READ
        return Example(tokens, answer)
