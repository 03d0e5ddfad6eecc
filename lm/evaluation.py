"""Held-out metrics of every eval split of a dataset.

Per split (``<split>/<metric>``): ``loss`` (mean cross-entropy over the target tokens,
natural log) and ``acc`` (argmax next-token accuracy over the target tokens); language
corpora (``kind == "lm"``) add ``ppl = exp(loss)``; tasks (``kind == "task"``, targets =
the answer tokens) add ``seq_acc`` (every answer token right) and ``err = 1 - seq_acc``,
the error rate the papers report.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.data.base import IGNORE_INDEX


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing elsewhere (the CPU trains in fp32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def metric_names(kind: str) -> tuple[str, ...]:
    """What ``evaluate_split`` reports for a dataset of ``kind`` ("lm" or "task")."""
    if kind not in ("lm", "task"):
        raise ValueError(f"kind must be 'lm' or 'task', got {kind!r}")
    return ("loss", "acc", "ppl") if kind == "lm" else ("loss", "acc", "seq_acc", "err")


@torch.no_grad()
def evaluate_split(model: nn.Module, batches, kind: str, device: torch.device) -> dict[str, float]:
    """Metrics of ``model`` over ``batches`` of ``(x, y)``, int64 ``(B, L)``; ``y ==
    IGNORE_INDEX`` (-100) marks a position without a target."""
    names = metric_names(kind)  # checks kind before the batches run
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = correct = seqs = seqs_right = 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(device):
            logits = model(x)  # (B, L, V)
        mask = y != IGNORE_INDEX
        loss_sum += F.cross_entropy(
            logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        hit = (logits.argmax(-1) == y) & mask
        tokens += int(mask.sum())
        correct += int(hit.sum())
        has_target = mask.any(1)
        seqs += int(has_target.sum())
        seqs_right += int(((hit | ~mask).all(1) & has_target).sum())
    if tokens == 0:
        raise ValueError("an eval split yielded no target tokens (every y is -100)")
    loss, seq_acc = loss_sum.item() / tokens, seqs_right / seqs
    values = {
        "loss": loss,
        "acc": correct / tokens,
        "ppl": math.exp(min(loss, 700.0)),
        "seq_acc": seq_acc,
        "err": 1.0 - seq_acc,
    }
    return {name: values[name] for name in names}


def evaluate(
    model: nn.Module, dataset: Any, batch_size: int, device: torch.device
) -> dict[str, float]:
    """``{"<split>/<metric>": value}`` over ``dataset.eval_splits()``; restores train mode."""
    was_training = model.training
    model.eval()
    metrics = {}
    try:
        for split in dataset.eval_splits():
            batches = dataset.eval_batches(split, batch_size)
            for name, value in evaluate_split(model, batches, dataset.kind, device).items():
                metrics[f"{split}/{name}"] = value
    finally:
        model.train(was_training)
    return metrics
