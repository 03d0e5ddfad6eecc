"""Inverse frequencies and rotation angles: the one thing every RoPE kernel consumes."""

from __future__ import annotations

import torch


def rope_frequencies(rope_dim: int, theta: float = 10000.0, scaling: dict | None = None):
    """``(inv_freq [rope_dim // 2] fp32, attention_factor)`` for the plain schedule."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    return inv_freq.float(), 1.0


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """positions ``[N]`` or ``[B, N]`` -> fp32 angles ``[..., N, R/2]`` (elementwise, no TF32)."""
    return positions.float()[..., None] * inv_freq.float().to(positions.device)
