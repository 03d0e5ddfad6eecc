"""The Python standard library's own source as a byte-level code corpus (no network).

The ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (site-packages excluded),
keyed by their path relative to that root. A SHA-256 of the relative path orders the
files (they are taken in that order while they fit in ``max_bytes``, a file that does not
fit skipped and smaller ones after it still taken, so a cap samples the whole library
rather than its first packages alphabetically) and, through other bytes of the
digest, puts each file in train, valid or test. The split depends only on the path, so
it is the same on every machine; the contents follow the Python version.

Splits: "valid@1x", "valid@2x", "valid@4x" and "test@1x".
"""

import functools
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

from lm.data.base import check_fraction, check_int
from lm.data.config import StdlibConfig
from lm.data.corpus import ByteCorpus, byte_stream

SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _order_and_bucket(relative: str) -> tuple[int, float]:
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:16], "big") / 2.0**64


def stdlib_files(root: Path) -> list[tuple[str, Path]]:
    """(relative path, path) of the library's ``*.py`` files, in hash order."""
    files = []
    for folder, dirs, names in os.walk(root):
        # Pruned in place so that the walk never enters site-packages (most of the tree).
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        for name in names:
            path = Path(folder, name)
            if name.endswith(".py") and path.is_file():
                files.append((path.relative_to(root).as_posix(), path))
    return sorted(files, key=lambda f: _order_and_bucket(f[0])[0])


@functools.lru_cache(maxsize=4)
def split_stdlib(
    root: str, max_bytes: int, valid_fraction: float, test_fraction: float
) -> dict[str, tuple[list[str], np.ndarray]]:
    """{split: (relative paths, token stream)} for train, valid, test; cached in memory."""
    chosen: dict[str, list[tuple[str, bytes]]] = {"train": [], "valid": [], "test": []}
    total = 0
    for relative, path in stdlib_files(Path(root)):
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        total += size
        content = path.read_bytes()
        bucket = _order_and_bucket(relative)[1]
        if bucket < test_fraction:
            chosen["test"].append((relative, content))
        elif bucket < test_fraction + valid_fraction:
            chosen["valid"].append((relative, content))
        else:
            chosen["train"].append((relative, content))
    return {
        split: ([r for r, _ in files], byte_stream(c for _, c in files))
        for split, files in chosen.items()
    }


class StdlibCorpus(ByteCorpus):
    """``files``: {"train"|"valid"|"test": relative paths of the files in that split}."""

    def __init__(self, cfg: StdlibConfig):
        max_bytes = check_int("data.max_bytes", cfg.max_bytes, 1)
        valid = check_fraction("data.valid_fraction", cfg.valid_fraction, 0.0, 1.0)
        test = check_fraction("data.test_fraction", cfg.test_fraction, 0.0, 1.0)
        if valid + test >= 1.0:
            raise ValueError(
                f"data.valid_fraction + data.test_fraction must be < 1 (the rest is train), "
                f"got {valid} + {test}"
            )
        splits = split_stdlib(sysconfig.get_paths()["stdlib"], max_bytes, valid, test)
        seq_len = check_int("data.seq_len", cfg.seq_len, 1)
        for split, fraction in (("train", None), ("valid", "data.valid_fraction")):
            paths, stream = splits[split]
            if len(stream) < seq_len + 1:  # files are drawn whole, so a small budget is lumpy
                more = "data.max_bytes" + (f" or {fraction}" if fraction else "")
                raise ValueError(
                    f"data.max_bytes={max_bytes} gives the {split} split {len(paths)} files, "
                    f"{len(stream)} tokens, fewer than one window of data.seq_len + 1 = "
                    f"{seq_len + 1}: raise {more}"
                )
        self.files = {split: paths for split, (paths, _) in splits.items()}
        evals = {"valid": splits["valid"][1]}
        if splits["test"][0]:
            evals["test"] = splits["test"][1]
        super().__init__(
            splits["train"][1],
            evals,
            cfg.seq_len,
            cfg.eval_samples,
            cfg.seed,
            multiples={"test": (1,)},
        )
