"""Checkpoints that resume a run exactly and load with ``torch.load(weights_only=True)``.

A checkpoint holds only tensors and primitive containers: the model, optimizer and
scheduler state dicts, the step, the RNG states and the trainer's own small state. The
data is a function of (data seed, step), so it needs no state. Writes go to a temporary
file in the same directory, then ``os.replace``: a crash mid-write leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Atomically writes ``state`` (tensors and primitive containers only) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state saved by ``save_checkpoint``, on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)
