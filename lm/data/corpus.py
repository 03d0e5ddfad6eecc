"""Byte-level corpora: token streams cut into windows, every token scored.

Tokens are the 256 byte values plus ``<eos>`` (256, written after each document: a
file, a story) and ``<pad>`` (257, never in a batch; the model's interface needs one).
A training row is a window of ``seq_len + 1`` tokens at a random offset of the train
stream. Evaluation split ``<stream>@<k>x`` holds up to ``eval_samples`` windows of
``k * seq_len`` inputs (length extrapolation at k = 1, 2, 4), evenly spaced over the
stream without overlap; a multiple whose window does not fit in the stream is left
out, and the stream must hold one window at 1x.
"""

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from lm.data.base import Batch, LMDataset, check_int, digest, split_rng

EOS_ID, PAD_ID, BYTE_VOCAB_SIZE = 256, 257, 258
SPECIALS = {EOS_ID: "<eos>", PAD_ID: "<pad>"}
LENGTH_MULTIPLES = (1, 2, 4)


def byte_stream(documents: Iterable[bytes]) -> np.ndarray:
    """The token stream (uint16 [T], read-only) of ``documents``, each followed by <eos>."""
    docs = list(documents)
    text = np.frombuffer(b"".join(docs), dtype=np.uint8)
    ends = np.cumsum([len(d) for d in docs], dtype=np.int64)
    stream = np.insert(text.astype(np.uint16), ends, EOS_ID)
    stream.flags.writeable = False
    return stream


class ByteCorpus(LMDataset):
    """A corpus given as a train stream and named eval streams.

    Attributes:
        train: the training token stream, uint16 [T] (read-only).
    """

    kind = "lm"
    vocab_size = BYTE_VOCAB_SIZE
    pad_id = PAD_ID
    eos_id = EOS_ID

    def __init__(
        self,
        train: np.ndarray,
        evals: dict[str, np.ndarray],
        seq_len: int,
        eval_samples: int,
        seed: int,
        multiples: dict[str, tuple[int, ...]] | None = None,
    ):
        """``multiples``: the length multiples evaluated per eval stream (all by default)."""
        self.seq_len = check_int("data.seq_len", seq_len, 1)
        self.eval_samples = check_int("data.eval_samples", eval_samples, 1)
        self.seed = check_int("data.seed", seed, 0)
        if len(train) < self.seq_len + 1:
            raise ValueError(
                f"the training stream has {len(train)} tokens, fewer than one window of "
                f"data.seq_len + 1 = {self.seq_len + 1}: add data or lower data.seq_len"
            )
        self.train = train
        self._windows: dict[str, tuple[np.ndarray, int]] = {}
        for name, stream in evals.items():
            for k in (multiples or {}).get(name, LENGTH_MULTIPLES):
                length = k * self.seq_len
                count = min(self.eval_samples, len(stream) // (length + 1))
                if count == 0:
                    if k == 1:
                        raise ValueError(
                            f"the {name} stream has {len(stream)} tokens, fewer than one "
                            f"window of data.seq_len + 1 = {self.seq_len + 1}: add data or "
                            "lower data.seq_len"
                        )
                    continue
                offsets = np.linspace(0, len(stream) - (length + 1), count).astype(np.int64)
                self._windows[f"{name}@{k}x"] = (offsets, length)
        self._streams = evals
        self.max_len = max(length for _, length in self._windows.values())

    def fingerprint(self) -> str:
        # The streams as read (after data.max_bytes and the splits are cut), in name order.
        named = sorted(self._streams.items())
        return digest([self.train] + [part for name, s in named for part in (name.encode(), s)])

    def _train_rows(self, step: int, rows: range, global_batch: int) -> Batch:
        high = len(self.train) - self.seq_len
        offsets = [int(split_rng(self.seed, "train", step, row).integers(0, high)) for row in rows]
        return self._cut(self.train, offsets, self.seq_len)

    def eval_splits(self) -> list[str]:
        return list(self._windows)

    def eval_batches(self, split: str, batch_size: int) -> Iterator[Batch]:
        self._check_split(split)
        check_int("batch_size", batch_size, 1)
        offsets, length = self._windows[split]
        stream = self._streams[split.split("@")[0]]
        for start in range(0, len(offsets), batch_size):
            yield self._cut(stream, offsets[start : start + batch_size].tolist(), length)

    @staticmethod
    def _cut(stream: np.ndarray, offsets: list[int], length: int) -> Batch:
        """x = stream[o : o + length], y = stream[o + 1 : o + length + 1] for each offset o."""
        windows = np.stack([stream[o : o + length + 1] for o in offsets]).astype(np.int64)
        windows = torch.from_numpy(windows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        bad = [i for i in ids if not 0 <= i < BYTE_VOCAB_SIZE]
        if bad:
            raise ValueError(f"ids must be in [0, {BYTE_VOCAB_SIZE}), got {bad[:5]}")
        parts, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            parts.append(SPECIALS[i])
            run = bytearray()
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)
