"""Checkpoints that resume a run exactly and load with ``torch.load(weights_only=True)``.

A checkpoint holds only tensors and primitive containers: the model, optimizer and
scheduler state dicts, the step, the RNG states, the trainer's own small state and the
resolved config of the run (``config_changes`` compares it with a resuming run's). The
data is a function of (data seed, step), so it needs no state. Writes go to a temporary
file in the same directory, then ``os.replace``: a crash mid-write leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import json
import os
import secrets
import warnings
from collections.abc import Callable
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


def checkpoint_path(ckpt_path: str | None, out_dir: Path) -> Path:
    """``train.ckpt_path``: a relative path is under ``out_dir``, the run's output directory
    (so every job of a sweep has its own); null is ``out_dir/checkpoint.pt``."""
    return out_dir / (ckpt_path or "checkpoint.pt")  # an absolute ckpt_path replaces out_dir


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file such as ``metrics.jsonl``, one object a line. A last
    line that does not parse is the tail of an append cut short (a killed process, a full
    disk): left out, with a warning. A bad line before the last raises ValueError naming the
    file and the line."""
    path = Path(path)
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if i < len(lines) - 1:
                raise ValueError(f"{path}, line {n}: not a JSON record ({error})") from None
            warnings.warn(f"{path}: left out its last line, cut short ({error})", stacklevel=2)
    return records


def replace_atomically(
    path: str | Path, write: Callable[[Path], None], *, sync: bool = True
) -> None:
    """``write`` to a file beside ``path``, flushed to disk (``sync``), then moved over it: a
    process killed mid-write (or, with ``sync``, a machine that loses power after the move)
    leaves the old file or the new one, never a truncated one; a write that raises leaves no
    temporary file. ``sync=False`` for small files written often (a record a step), whose
    loss to a power cut costs little."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own: two writers of one path (two benchmarks' rows) must not share it
    # (mkstemp's would make the file private to its owner, unlike the one it replaces)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        if sync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Atomically writes ``state`` (tensors and primitive containers only) to ``path``."""
    replace_atomically(path, lambda tmp: torch.save(state, tmp))


def write_json(path: str | Path, record: dict[str, Any]) -> None:
    """Atomically writes ``record`` to ``path`` as indented JSON (a run's ``run.json``,
    ``summary.json``, ``failed.json``), so that readers such as collect.py never see a
    truncated one."""
    replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(record, indent=2) + "\n"))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state saved by ``save_checkpoint``, on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


def config_changes(
    saved: dict, now: dict, compared: Callable[[str], bool], defaults: dict | None = None
) -> tuple[list[str], list[str]]:
    """How two resolved configs (nested dicts of primitives and lists) differ, as
    ``"key: saved -> now"`` lines sorted by dotted key: ``(changed, one_sided)``, the keys both
    have with different values, and the keys only one has (a field the code added or removed
    between the two runs: its value may well be the one the older run had implicitly). A key
    only one has whose value is null is neither: this code's optional fields default to null
    for the behaviour from before they existed (``model.head_dim``).

    Args:
        saved: the config stored in a checkpoint.
        now: the config of the run that would resume from it.
        compared: whether a dotted key (``"model.d_model"``) must be equal; the others may
            differ.
        defaults: nested like a config, the schema defaults of fields ``saved`` may lack
            (``lm.config.schema_defaults``): the values a run saved before a field existed had
            implicitly, so such a key is compared, not one-sided (``attention.query_scale.beta:
            None -> 0.3`` is a change).
    """
    saved, now = flatten_config(defaults or {}) | flatten_config(saved), flatten_config(now)
    keys = [key for key in sorted(saved.keys() | now.keys()) if compared(key)]
    line = lambda key: f"{key}: {_shown(saved, key)} -> {_shown(now, key)}"
    both = [key for key in keys if key in saved and key in now]
    return (
        [line(key) for key in both if saved[key] != now[key]],
        [line(key) for key in keys if key not in both and _value(saved, now, key) is not None],
    )


def _value(saved: dict[str, Any], now: dict[str, Any], key: str) -> Any:
    return saved[key] if key in saved else now[key]


def flatten_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"dotted.key": value}`` of a nested dict; lists are values."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown(flat: dict[str, Any], key: str) -> str:
    return repr(flat[key]) if key in flat else "(absent)"
