"""Position-dependent query scales: attention temperature tuning (Llama 4, Mistral).

Not a frequency schedule: the queries (all their channels, rotated or not) are multiplied by a
factor that grows with the query's position, which sharpens the softmax of far queries over
their many keys. Ministral 3 and Mistral 4 checkpoints carry it as ``llama_4_scaling_beta``
in their ``rope_parameters``, beside a YaRN schedule.
"""

from __future__ import annotations

import numbers

import torch

from fused_rope._validation import check_position_tensor, is_finite


def llama4_attn_scale(
    positions: torch.Tensor, beta: float, original_max_position_embeddings: int
) -> torch.Tensor:
    """``1 + beta * ln(1 + floor(positions / L0))`` in fp32: the queries' scale per position.

    1 below ``L0 = original_max_position_embeddings`` (the model is unchanged over the context
    it was trained to), then one step up each ``L0`` positions. Multiply the queries by it
    (``q * scale[..., :, None]`` for ``q [B, H, N, D]``) before or after their rotation (a
    scalar per row commutes with it), as transformers' Ministral 3 and Mistral 4 do with
    ``beta = rope_parameters["llama_4_scaling_beta"]`` and ``L0 =
    rope_parameters["original_max_position_embeddings"]`` (``get_llama_4_attn_scale``, which
    casts the scale to the queries' dtype first). Llama 4's own temperature tuning, on its
    layers without RoPE, is ``llama4_attn_scale(positions + 1, attn_scale, floor_scale)``.

    Args:
        positions: the queries' positions, integer or fp32/fp64, any shape; at least 0
            (checked for CPU tensors outside ``torch.compile``; a GPU tensor is not read back:
            a negative position gives a non-finite scale). Integers are divided exactly; floats in fp64.
        beta: the scale's slope, a real number >= 0 (0: no scaling).
        original_max_position_embeddings: ``L0``, a positive int.

    Returns:
        fp32 tensor of ``positions``' shape and device.
    """
    check_position_tensor(positions, "positions")
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not is_finite(beta):
        raise TypeError(f"beta must be a finite real number, got {beta!r}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0 (the scale would fall below 1), got {beta}")
    length = original_max_position_embeddings
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1:
        raise ValueError(f"original_max_position_embeddings must be a positive int, got {length!r}")
    eager_cpu = positions.device.type == "cpu" and not torch.compiler.is_compiling()
    if eager_cpu and positions.numel() and bool((positions < 0).any()):
        raise ValueError(f"positions must be >= 0, got a minimum of {positions.min().item()}")
    if positions.is_floating_point():
        steps = torch.floor(positions.double() / int(length))
    else:
        steps = torch.div(positions, int(length), rounding_mode="floor").double()
    return (1.0 + float(beta) * torch.log1p(steps)).float()
