"""Hugging Face Hub text datasets through ``datasets.load_dataset``, byte-level.

``data=wikitext103`` (Salesforce/wikitext, wikitext-103-raw-v1: rows are lines of one
text) and ``data=tinystories`` (roneneldan/TinyStories: rows are stories, each
followed by <eos>). The training split is read from its first row until ``max_bytes``; the
evaluation splits whole, so that runs of any ``max_bytes`` are scored on the same text.
Without a network (or without the dataset in the local cache) loading fails with a
RuntimeError that names the dataset and points to the local and built-in sources.

Splits: "valid@1x", "valid@2x", "valid@4x", and "test@1x" where the dataset has a test
split.
"""

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm.data.base import check_int
from lm.data.config import HubConfig
from lm.data.corpus import ByteCorpus, byte_stream

ROWS_PER_READ = 4096


@dataclass(frozen=True)
class HubSource:
    path: str
    config: str | None
    splits: tuple[tuple[str, str], ...]  # (our stream name, the Hub's split name)
    rows_are_documents: bool  # else rows are lines of one document


HUB_SOURCES = {
    "wikitext103": HubSource(
        "Salesforce/wikitext",
        "wikitext-103-raw-v1",
        (("train", "train"), ("valid", "validation"), ("test", "test")),
        rows_are_documents=False,
    ),
    "tinystories": HubSource(
        "roneneldan/TinyStories",
        None,
        (("train", "train"), ("valid", "validation")),
        rows_are_documents=True,
    ),
}


def _texts(rows: Any) -> Iterator[bytes]:
    """The UTF-8 text of each row of a ``datasets.Dataset``, read in batches."""
    for batch in rows.iter(batch_size=ROWS_PER_READ):
        for text in batch["text"]:
            yield text.encode("utf-8")


def _load_split(key: str, source: HubSource, split: str, max_bytes: int | None) -> np.ndarray:
    import datasets  # slow to import; only the Hub sources need it

    try:
        rows = datasets.load_dataset(source.path, source.config, split=split)
    except OSError as e:  # ConnectionError, offline mode, not found: all OSErrors
        name = source.path + (f" ({source.config})" if source.config else "")
        raise RuntimeError(
            f"data={key}: could not load the Hub dataset {name}, split {split!r}: "
            f"{type(e).__name__}: {e}. It needs a network (or the dataset in the local "
            f"Hugging Face cache). Without one, use a built-in or local source instead: "
            f"data=stdlib, data=text data.files=[a.txt], or data=jsonl data.dir=PATH."
        ) from e
    texts, total = [], 0
    for text in _texts(rows):
        if max_bytes is not None and total >= max_bytes:
            break
        texts.append(text)
        total += len(text)
    return byte_stream(texts if source.rows_are_documents else [b"".join(texts)])


@functools.lru_cache(maxsize=2)
def load_hub_streams(key: str, max_bytes: int | None) -> dict[str, np.ndarray]:
    """{stream name: tokens} of a Hub source, the training text cut at ``max_bytes``; cached
    in memory for the process."""
    source = HUB_SOURCES[key]
    return {
        name: _load_split(key, source, split, max_bytes if name == "train" else None)
        for name, split in source.splits
    }


class HubCorpus(ByteCorpus):
    def __init__(self, cfg: HubConfig):
        max_bytes = None if cfg.max_bytes is None else check_int("data.max_bytes", cfg.max_bytes, 1)
        streams = dict(load_hub_streams(cfg.name, max_bytes))
        train = streams.pop("train")
        super().__init__(
            train, streams, cfg.seq_len, cfg.eval_samples, cfg.seed, multiples={"test": (1,)}
        )
