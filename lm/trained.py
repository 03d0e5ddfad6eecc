"""A trained run loaded back: the config its checkpoint holds, the model and the dataset.

For ``sample.py`` and the studies of a trained model (``experiments/plot_mileage.py``). The
dataset is rebuilt from the run's config, for its tokenizer, vocabulary and lengths:
relative data paths resolve against the directory the run was launched from (the run's
``run.json`` records it; for older runs, Hydra's ``.hydra/hydra.yaml``, which a refused launch
into the directory rewrites), as they did in training, and hub corpora load from the local
cache.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from lm.attention import check_attention_config
from lm.checkpoint import checkpoint_path, load_checkpoint
from lm.config import ATTENTION_SCHEMAS, ModelConfig
from lm.data import build_dataset
from lm.data.base import LMDataset
from lm.model import GPT


def run_record(run_dir: Path) -> dict:
    """The run's ``run.json`` (``lm.training``: its config, overrides and launch directory);
    empty for a run older than it, or a record that does not read."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict) or not isinstance(record.get("config", {}), dict):
        return {}  # not what lm.training writes
    return record


def checkpoint_file(path: str | Path) -> Path:
    """The checkpoint of ``path``: a run directory's (at its ``train.ckpt_path``, which its
    ``run.json`` records; default ``checkpoint.pt``) or the file."""
    path = Path(path)
    ckpt = path
    if path.is_dir():
        recorded = OmegaConf.select(OmegaConf.create(run_record(path)), "config.train.ckpt_path")
        ckpt = checkpoint_path(recorded, path)
    if not ckpt.is_file():
        raise FileNotFoundError(f"no checkpoint at {ckpt} (pass a train.py run directory)")
    return ckpt


def run_config(ckpt: Path, state: dict) -> DictConfig:
    """The config the checkpoint ``ckpt`` (loaded as ``state``) was trained with: the resolved
    config it stores, else (older checkpoints) Hydra's ``.hydra/config.yaml`` beside it, which
    a later launch into the same directory may have rewritten."""
    if "config" in state:
        return OmegaConf.create(state["config"])
    config = ckpt.parent / ".hydra" / "config.yaml"
    if not config.exists():
        raise FileNotFoundError(f"{ckpt} stores no config and there is no Hydra config at {config}")
    return OmegaConf.load(config)


def launch_dir(run_dir: Path, state: dict) -> Path | None:
    """The directory ``train.py`` was started in for the checkpoint ``state`` of the run in
    ``run_dir``: the checkpoint's own record, else (older checkpoints) the run's ``run.json``'s,
    which a later launch (a resume from elsewhere) rewrites before it saves a checkpoint, else
    Hydra's record (None without any)."""
    cwd = state.get("launch_dir") or run_record(run_dir).get("launch_dir")
    record = run_dir / ".hydra" / "hydra.yaml"
    if cwd is None and record.is_file():
        cwd = OmegaConf.select(OmegaConf.load(record), "hydra.runtime.cwd")
    return Path(cwd) if isinstance(cwd, str) and Path(cwd).is_dir() else None


def run_directory(path: Path, ckpt: Path) -> Path:
    """The run directory of ``path``: itself, or for a checkpoint file the nearest directory
    above it with the run's records (``run.json``, ``.hydra/``): a ``train.ckpt_path`` of
    ``ck/m.pt`` puts the file a level below them. The file's own directory without either."""
    if path.is_dir():
        return path
    for directory in ckpt.resolve().parents:
        if (directory / "run.json").is_file() or (directory / ".hydra").is_dir():
            return directory
    return ckpt.parent


def build_run_dataset(cfg: DictConfig, run_dir: Path, state: dict) -> LMDataset:
    """``build_dataset(cfg.data)`` with relative paths taken from the launch directory of the
    checkpoint ``state`` (``launch_dir``)."""
    start = launch_dir(run_dir, state)
    if start is None:
        return build_dataset(cfg.data)
    here = os.getcwd()
    os.chdir(start)
    try:
        return build_dataset(cfg.data)
    finally:
        os.chdir(here)


def load_run(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    impl: str | None = None,
) -> tuple[DictConfig, GPT, LMDataset]:
    """The config, the model (eval mode, on ``device`` in ``dtype``) and the dataset of the
    run at ``path`` (a run directory or its checkpoint file). ``impl`` overrides
    ``attention.impl`` (rope, corope); a saved ``triton`` becomes ``auto`` off CUDA, where the
    kernels cannot run."""
    ckpt = checkpoint_file(path)
    state = load_checkpoint(ckpt)
    cfg = run_config(ckpt, state)
    name = cfg.attention.name
    if name not in ATTENTION_SCHEMAS:
        raise ValueError(
            f"{ckpt}: unknown attention.name {name!r}; known: {sorted(ATTENTION_SCHEMAS)}"
        )
    # The schemas fill in the fields added since the run, with their defaults
    cfg.model = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model)
    cfg.attention = OmegaConf.merge(OmegaConf.structured(ATTENTION_SCHEMAS[name]), cfg.attention)
    if "impl" in cfg.attention:
        if impl is not None:
            cfg.attention.impl = impl
        elif cfg.attention.impl == "triton" and torch.device(device).type != "cuda":
            cfg.attention.impl = "auto"
    elif impl is not None:
        warnings.warn(f"impl={impl!r} ignored: attention {name!r} has no impl option", stacklevel=2)
    check_attention_config(cfg.attention, cfg.model, torch.device(device))
    dataset = build_run_dataset(cfg, run_directory(Path(path), ckpt), state)
    # The tokens the run trained on (lm.training checks the same on resume): a changed data
    # file can keep the vocabulary's size and renumber its words, which the weights would
    # then read silently
    saved = state.get("data_fingerprint")  # absent from older checkpoints
    if saved is not None and saved != (now := dataset.fingerprint()):
        raise ValueError(
            f"{ckpt} was trained on data of fingerprint {saved}, but its config's data now "
            f"gives {now}: a data file changed since the run (or the Python stdlib, for "
            "data=stdlib); restore it"
        )
    model = GPT(cfg.model, cfg.attention, dataset.vocab_size, dataset.max_len)
    model.load_state_dict(state["model"])
    return cfg, model.to(device, dtype).eval(), dataset
