"""PyTorch references every RoPE kernel of this package is tested against.

They compute in float32 (float64 when the input is float64) and return the
input's dtype. Run them on float64 inputs for the ground truth of a test.
"""

from __future__ import annotations

import torch

from fused_rope._validation import check_angles, check_float_tensor, check_layout, check_rope_dim


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def apply_rope_ref(
    x: torch.Tensor,
    angles: torch.Tensor,
    layout: str = "half",
    rope_dim: int | None = None,
    output_scale: float = 1.0,
) -> torch.Tensor:
    """Rotates the first ``rope_dim`` channels of ``x`` by ``angles``; the rest pass through.

    Args:
        x: ``[B, H, N, D]``.
        angles: ``[N, R/2]`` or ``[B, N, R/2]`` with ``R = rope_dim`` (default ``D``).
        layout: ``"half"`` pairs channel ``d`` with ``d + R/2`` (GPT-NeoX, Llama);
            ``"interleaved"`` pairs ``2d`` with ``2d + 1`` (GPT-J, the RoFormer paper).
        output_scale: multiplies the whole output, rotated and pass-through channels alike
            (the attention scale folded into Q).

    Returns:
        ``[B, H, N, D]`` in ``x``'s dtype:
        ``y1 = s (x1 cos - x2 sin)``, ``y2 = s (x2 cos + x1 sin)``, ``y_pass = s x_pass``.
    """
    check_float_tensor(x, "x", ndim=4)
    check_layout(layout)
    B, _, N, D = x.shape
    R = check_rope_dim(rope_dim, D)
    check_angles(angles, B, N, R)
    cd = _compute_dtype(x)
    xf = x.to(cd)
    a = angles.to(cd)
    a = a[:, None] if a.dim() == 3 else a  # broadcast over heads: [B|1, 1, N, R/2]
    cos, sin = a.cos(), a.sin()
    rot = xf[..., :R]
    if layout == "half":
        x1, x2 = rot[..., : R // 2], rot[..., R // 2 :]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if layout == "half":
        y = torch.cat([y1, y2], dim=-1)
    else:
        y = torch.stack([y1, y2], dim=-1).flatten(-2)
    out = torch.cat([y, xf[..., R:]], dim=-1) * output_scale
    return out.to(x.dtype)
