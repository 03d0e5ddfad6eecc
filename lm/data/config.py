"""Structured-config schemas of the data sources: one dataclass per source.

Each schema is registered (by ``lm.config``) as ConfigStore group ``schema/data``, name
``<key>``; ``configs/data/<key>.yaml`` extends it, so a misspelled key fails at
start-up. Every schema has ``name`` (its key), ``seq_len`` (training context length in
tokens), ``eval_samples`` (sequences per evaluation split) and ``seed`` (the data
generation seed, independent of the model seed). The defaults are CPU-cheap.
"""

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class DataConfig:
    name: str = MISSING
    seq_len: int = 128
    eval_samples: int = 256
    seed: int = 0


@dataclass
class CountingConfig(DataConfig):
    """Counting (CoPE paper): programs of ``v = 0 ;``, ``pass ;``, ``v ++ ;`` then ``print v A``.

    Variables start at 0. A program never lets a value exceed ``max_value``: an increment
    that would is emitted as a reset ``v = 0 ;`` instead, so running the program as
    written gives the answer. Split ``ood_long`` has ``max_statements + 1`` to
    ``ood_length_factor * max_statements`` statements.
    """

    name: str = "counting"
    seq_len: int = 128
    num_vars: int = 3
    min_statements: int = 3
    max_statements: int = 31
    ood_length_factor: int = 2
    max_value: int = 10
    p_reset: float = 0.1
    p_pass: float = 0.3


@dataclass
class SelectiveCopyConfig(DataConfig):
    """Selective copy: ``num_copy`` symbols scattered among blanks in a body of ``body_len``
    tokens, a separator, then the symbols in order (the answer).

    ``ood_dense_blanks`` / ``ood_sparse_blanks`` keep ``num_copy`` and change the body
    length, hence the fraction of blanks (more / fewer blanks per symbol).
    """

    name: str = "selective_copy"
    seq_len: int = 64
    num_symbols: int = 8
    num_copy: int = 8
    body_len: int = 48
    ood_dense_body_len: int = 192
    ood_sparse_body_len: int = 12


@dataclass
class FlipFlopConfig(DataConfig):
    """Flip-flop language (Liu et al. 2023): ``num_instructions`` pairs ``w|i|r`` + bit.

    The first instruction is a write and the last a read; every read's bit is the last
    written bit (the answer). Ignores have probability ``p_ignore`` (writes and reads
    share the rest); ``ood_sparse`` / ``ood_dense`` use ``ood_sparse_p_ignore`` /
    ``ood_dense_p_ignore`` (the paper's FFL(0.98) and FFL(0.1)).
    """

    name: str = "flipflop"
    seq_len: int = 128
    num_instructions: int = 64
    p_ignore: float = 0.8
    ood_sparse_p_ignore: float = 0.98
    ood_dense_p_ignore: float = 0.1


@dataclass
class StdlibConfig(DataConfig):
    """The Python standard library's ``*.py`` files as a byte-level corpus, split by file.

    Files are taken in the order of a hash of their relative path while they fit in
    ``max_bytes`` (one that does not is skipped, smaller ones after it still taken);
    the same hash assigns each file to train, valid (``valid_fraction``) or test
    (``test_fraction``).
    """

    name: str = "stdlib"
    seq_len: int = 256
    eval_samples: int = 64
    max_bytes: int = 4_000_000
    valid_fraction: float = 0.05
    test_fraction: float = 0.05


@dataclass
class JsonlConfig(DataConfig):
    """``dir``/{train,valid,test}.jsonl with one {"context", "question", "answer"} per line.

    Whitespace tokens, vocabulary from the training split; ``eval_samples`` caps the
    number of examples read from each of valid and test (the first lines).
    """

    name: str = "jsonl"
    seq_len: int = 256
    dir: str = MISSING


@dataclass
class TextConfig(DataConfig):
    """Plain-text ``files``, byte-level; the last ``valid_fraction`` of the stream is valid."""

    name: str = "text"
    seq_len: int = 256
    eval_samples: int = 64
    files: list[str] = field(default_factory=list)
    valid_fraction: float = 0.1


@dataclass
class HubConfig(DataConfig):
    """A Hugging Face Hub text dataset, byte-level; ``max_bytes`` caps the training text
    read (None: all of it); the evaluation splits are read whole."""

    seq_len: int = 256
    eval_samples: int = 64
    max_bytes: int | None = 200_000_000


@dataclass
class WikiText103Config(HubConfig):
    name: str = "wikitext103"


@dataclass
class TinyStoriesConfig(HubConfig):
    name: str = "tinystories"


DATA_SCHEMAS: dict[str, type] = {
    "counting": CountingConfig,
    "selective_copy": SelectiveCopyConfig,
    "flipflop": FlipFlopConfig,
    "stdlib": StdlibConfig,
    "jsonl": JsonlConfig,
    "text": TextConfig,
    "wikitext103": WikiText103Config,
    "tinystories": TinyStoriesConfig,
}
