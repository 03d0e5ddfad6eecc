"""Gradients of RoPE's angles, positions and frequencies, from the gradients of what it rotated.

A rotary pair ``y = s R(theta) x`` (any scale ``s``) has ``dy/dtheta = J y`` with ``J`` the
quarter turn, and ``dx = s R(theta)^T g`` for the pair's cotangent ``g``. Since ``J`` commutes
with rotations, ``dL/dtheta = <g, J y> = <dx, J x> = x1 dx2 - x2 dx1``: the 2-D cross
product of the input and its gradient. Every backward here already computes ``dx`` (the RoPE
kernel's conjugate rotation, the fused attention's dQ and dK), so the angles' gradient costs
one elementwise pass over ``x`` and ``dx`` and a sum over the heads that share the angles,
with no kernel change. Positions and frequencies follow by the chain rule through
``theta = fp32(position) * inv_freq`` (``rope_angles``).
"""

from __future__ import annotations

import torch


def pair_cross(x: torch.Tensor, dx: torch.Tensor, layout: str, rope_dim: int) -> torch.Tensor:
    """``sum_heads (x1 dx2 - x2 dx1)``: the gradient of the angles that rotated ``x``.

    Args:
        x, dx: ``[B, H, N, D]``, the rotation's input and the loss's gradient w.r.t. it.
        layout: ``"half"`` (pairs ``d, d + R/2``) or ``"interleaved"`` (``2d, 2d + 1``).
        rope_dim: ``R``, the rotated channels.

    Returns:
        fp32 ``[B, N, R/2]`` (fp64 for fp64 inputs).
    """
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, dx = x[..., :rope_dim].to(dtype), dx[..., :rope_dim].to(dtype)
    if layout == "half":
        half = rope_dim // 2
        x1, x2, dx1, dx2 = x[..., :half], x[..., half:], dx[..., :half], dx[..., half:]
    else:
        x1, x2, dx1, dx2 = x[..., 0::2], x[..., 1::2], dx[..., 0::2], dx[..., 1::2]
    return (x1 * dx2 - x2 * dx1).sum(1)


def rows_grad(grad: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``grad`` ``[B, N, ...]`` summed to the shape of ``rows`` (``[N, ...]`` or ``[1, N, ...]``
    shared by the batch, or ``[B, N, ...]``), in ``rows``' dtype."""
    if rows.dim() < grad.dim() or rows.shape[0] < grad.shape[0]:
        grad = grad.sum(0, keepdim=rows.dim() == grad.dim())
    return grad.to(rows.dtype)


def chain_positions(
    grad: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, want: tuple[bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``positions`` and ``inv_freq`` from ``grad``, that of their angles
    ``fp32(positions)[..., None] * inv_freq`` ``[B | 1, N, R/2]``; ``want``: which of the two
    to form (None for the other). ``positions``: ``[N]``, ``[1 | B, N]``."""
    d_pos = d_freq = None
    if want[0]:
        d_pos = rows_grad((grad * inv_freq.to(grad.dtype)).sum(-1), positions)
    if want[1]:
        # summed in fp64: B * N terms of position times angle gradient, which cancel (fp32
        # took the largest error of (2, 8/1, 33, 32)'s fp32 frequency gradients from 5.5e-4
        # to 6.1e-4, 2.2 times PyTorch's autograd through rope_angles)
        pos = positions.to(torch.float64)
        pos = (pos if pos.dim() > 1 else pos[None])[..., None]  # [1 | B, N, 1], N = 0 too
        d_freq = (grad.double() * pos).sum((0, 1)).to(inv_freq.dtype)
    return d_pos, d_freq
