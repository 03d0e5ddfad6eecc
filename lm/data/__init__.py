"""Data sources of the training harness: ``build_dataset(cfg)`` turns the ``data`` config
group into an ``LMDataset``.

Synthetic tasks (kind "task", loss on answer tokens): counting, selective_copy,
flipflop. Corpora (kind "lm", byte-level, every token scored): stdlib, text,
wikitext103, tinystories. Local question answering (kind "task"): jsonl.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lm.data.base import IGNORE_INDEX, LMDataset
from lm.data.config import DATA_SCHEMAS
from lm.data.counting import CountingTask
from lm.data.flipflop import FlipFlopTask
from lm.data.hub import HubCorpus
from lm.data.jsonl import JsonlDataset
from lm.data.selective_copy import SelectiveCopyTask
from lm.data.stdlib import StdlibCorpus
from lm.data.text import TextCorpus

BUILDERS: dict[str, Callable[[Any], LMDataset]] = {
    "counting": CountingTask,
    "selective_copy": SelectiveCopyTask,
    "flipflop": FlipFlopTask,
    "stdlib": StdlibCorpus,
    "jsonl": JsonlDataset,
    "text": TextCorpus,
    "wikitext103": HubCorpus,
    "tinystories": HubCorpus,
}

__all__ = ["DATA_SCHEMAS", "IGNORE_INDEX", "LMDataset", "build_dataset", "to_schema"]


def to_schema(cfg: Any) -> Any:
    """``cfg`` (a DictConfig, a mapping or a schema dataclass) as its schema dataclass.

    Raises ValueError for an unknown ``name`` (listing the known ones) or unknown keys.
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    elif dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = dataclasses.asdict(cfg)
    if not isinstance(cfg, Mapping):
        raise TypeError(f"cfg must be a DictConfig, mapping or dataclass, got {type(cfg).__name__}")
    name = cfg.get("name")
    if name not in DATA_SCHEMAS:
        raise ValueError(f"data.name must be one of {sorted(DATA_SCHEMAS)}, got {name!r}")
    schema = DATA_SCHEMAS[name]
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown} for data={name}; its keys are {sorted(known)}")
    return schema(**cfg)


def build_dataset(cfg: Any) -> LMDataset:
    """The data source ``cfg.name`` configured by ``cfg`` (the ``data`` config group)."""
    schema = to_schema(cfg)
    return BUILDERS[schema.name](schema)
