"""The interface every data source implements, and the stateless sampling it rests on.

Sampling is stateless: row ``i`` of the global batch of step ``s`` is a pure function of
(``seed``, ``s``, ``i``), drawn from a NumPy generator seeded with those numbers and a
per-split stream id (jsonl walks seeded per-epoch permutations instead). Resuming at
step ``s`` therefore reproduces batch ``s`` exactly, whatever the global RNG state, and
data-parallel ranks draw only their own rows.

Data parallelism: the global batch of a step has ``batch_size * world_size`` rows and
rank ``r`` gets rows ``r, r + world_size, r + 2 * world_size, ...`` (``r::world_size``).
"""

import hashlib
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

import numpy as np
import torch

IGNORE_INDEX = -100  # the target of a position without loss (torch cross_entropy's default)

Batch = tuple[torch.Tensor, torch.Tensor]


def split_rng(seed: int, split: str, *keys: int) -> np.random.Generator:
    """A generator determined by (seed, split name, keys) alone: the split's stream id is a
    CRC of its name, so adding a split never changes another split's data."""
    return np.random.default_rng([zlib.crc32(split.encode()), seed, *keys])


def digest(parts: Iterable[bytes | np.ndarray]) -> str:
    """A hex digest of ``parts`` in order (bytes, or arrays hashed in place, not copied), each
    one's length in bytes included (so that moving bytes from one part to the next changes it)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, np.ndarray):
            part = np.ascontiguousarray(part)
        view = memoryview(part).cast("B")
        h.update(view.nbytes.to_bytes(8, "little"))
        h.update(view)
    return h.hexdigest()


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high]; ValueError/TypeError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return int(value)


def check_fraction(name: str, value: object, low: float, high: float) -> float:
    """``value`` as a float in [low, high]; ValueError/TypeError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return float(value)


class LMDataset(ABC):
    """A data source for next-token training and evaluation.

    Attributes:
        kind: "task" (loss and accuracy on answer tokens only) or "lm" (every token).
        vocab_size: number of token ids; every id is in [0, vocab_size).
        pad_id: the id of the padding token (its targets are IGNORE_INDEX).
        eos_id: the id of the token that ends a document or an answer, where generation
            stops (``sample.py``); None where the data has none (the synthetic tasks).
        seq_len: training context length; train batches are [batch_size, seq_len].
        max_len: the longest input any split yields (train and every eval split, the
            length-extrapolation ones included): learned position tables need it.
        seed: the data generation seed.
    """

    kind: str
    vocab_size: int
    pad_id: int
    eos_id: int | None = None
    seq_len: int
    max_len: int
    seed: int

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> Batch:
        """This rank's share of the global training batch of ``step``.

        Returns (x, y): int64 CPU tensors [batch_size, seq_len]; y[b, t] is the target of
        x[b, t] (the next token) or IGNORE_INDEX where there is no loss. The global batch
        has batch_size * world_size rows; rank r gets rows r::world_size.
        """
        check_int("step", step, 0)
        check_int("batch_size", batch_size, 1)
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0, world_size - 1)
        rows = range(rank, batch_size * world_size, world_size)
        return self._train_rows(step, rows, batch_size * world_size)

    @abstractmethod
    def _train_rows(self, step: int, rows: range, global_batch: int) -> Batch:
        """Rows ``rows`` of the global batch (``global_batch`` rows) of ``step``."""

    @abstractmethod
    def eval_splits(self) -> list[str]:
        """Names of the evaluation splits, the in-distribution one first."""

    @abstractmethod
    def eval_batches(self, split: str, batch_size: int) -> Iterator[Batch]:
        """The fixed examples of ``split`` as (x, y) int64 tensors [<= batch_size, L]
        (L is fixed per split); the same data on every call."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of token ids [L]."""

    def fingerprint(self) -> str | None:
        """A digest of the tokens this source serves that its config does not determine (a
        file's content, the installed Python's stdlib, a Hub dataset's current revision), or
        None where the config and seed determine them (the synthetic tasks). A checkpoint
        records it and a resume must find the same (``lm.training``)."""
        return None

    def _check_split(self, split: str) -> None:
        if split not in self.eval_splits():
            raise ValueError(f"split must be one of {self.eval_splits()}, got {split!r}")
