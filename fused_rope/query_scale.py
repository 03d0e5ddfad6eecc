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

    1 at the positions below ``L0 = original_max_position_embeddings`` (the context before any
    extension: Ministral 3's 16384, extended by YaRN to 256K), then one step up each ``L0``
    positions. Transformers' Ministral 3 multiplies its rotated queries by it, with ``beta =
    rope_parameters["llama_4_scaling_beta"]`` and ``L0 =
    rope_parameters["original_max_position_embeddings"]`` (``get_llama_4_attn_scale``, which
    casts the scale to the queries' dtype first), and Mistral 4 its whole queries, rotated
    part and not. Being one number per query row, it commutes with the rotation::

        q = q * scale.to(q.dtype)[:, None]           # q [B, H, N, D], positions [N]
        q = q * scale.to(q.dtype)[:, None, :, None]  # positions [B, N] (position_ids)

    Llama 4's own temperature tuning, on its layers without RoPE, is
    ``llama4_attn_scale(positions + 1, attn_scale, floor_scale)`` up to rounding (it
    multiplies in fp32, then casts).

    Args:
        positions: the queries' positions, integer or fp32/fp64, any shape; finite and at
            least 0 (checked for CPU tensors outside ``torch.compile``; a GPU tensor is not
            read back: a negative position gives a non-finite scale). Integers are divided
            exactly, floats in fp64; transformers divides in fp32, which rounds
            ``p / L0`` up to the next integer for some ``p`` just below a multiple of ``L0``
            once ``p`` passes 2**24 (where fp32 no longer holds every integer ``p``), where
            the two differ by one step. uint64 positions must be below 2**63 (divided as
            int64; checked on the CPU).
        beta: the scale's slope, a finite real number >= 0 (0: no scaling).
        original_max_position_embeddings: ``L0``, a positive int below 2**62.

    Returns:
        fp32 tensor of ``positions``' shape and device.
    """
    check_position_tensor(positions, "positions")
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
        raise TypeError(f"beta must be a real number, got {type(beta).__name__}")
    if not (is_finite(beta) and beta >= 0):
        raise ValueError(f"beta must be finite and >= 0 (the scale would fall below 1), got {beta}")
    length = original_max_position_embeddings
    if isinstance(length, bool) or not isinstance(length, numbers.Integral):
        raise TypeError(
            f"original_max_position_embeddings must be an int, got {type(length).__name__}"
        )
    if not 1 <= length < 2**62:
        raise ValueError(f"original_max_position_embeddings must be in [1, 2**62), got {length}")
    eager_cpu = positions.device.type == "cpu" and not torch.compiler.is_compiling()
    if eager_cpu and positions.numel():
        if positions.dtype == torch.uint64:  # .long() would wrap these to negative values
            big = positions.double() >= 2.0**63
            if bool(big.any()):
                raise ValueError(
                    f"uint64 positions must be below 2**63 (divided as int64), got "
                    f"{positions[big][0].item()}"
                )
        # int64: PyTorch compares no unsigned type wider than 8 bits
        values = positions if positions.is_floating_point() else positions.long()
        valid = values >= 0  # NaN fails too
        if positions.is_floating_point():
            valid &= positions.isfinite()
        if not bool(valid.all()):
            raise ValueError(f"positions must be finite and >= 0, got {values[~valid][0].item()}")
    return scale_unchecked(positions, float(beta), int(length))


def scale_unchecked(positions: torch.Tensor, beta: float, length: int) -> torch.Tensor:
    """``llama4_attn_scale`` without its checks, for callers that made them once (the harness,
    on every forward pass, with positions from ``arange``)."""
    if positions.is_floating_point():
        steps = torch.floor(positions.double() / length)
    else:  # in int64: in a narrower type, L0 itself would wrap (int16 and 32768: -32768)
        steps = torch.div(positions.long(), length, rounding_mode="floor").double()
    return (1.0 + beta * torch.log1p(steps)).float()
