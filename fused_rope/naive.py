"""PyTorch references every RoPE kernel of this package is tested against.

They compute in float32 (float64 when the input is float64) and return the
input's dtype. Run them on float64 inputs for the ground truth of a test. The angles
``positions * inv_freq`` are fp32 in every dtype (``rope_angles``), as the kernels and
transformers form them: that rounding is part of the definition, so a float64 gradcheck
with respect to positions or frequencies sees it (differentiate them in fp32 terms).
"""

from __future__ import annotations

import functools

import torch

from fused_rope._validation import (
    FREQ_DTYPES,
    check_angles,
    check_attention_factor,
    check_attention_shapes,
    check_bool,
    check_float_tensor,
    check_layout,
    check_rope_dim,
    check_rotation_inputs,
    check_scale,
    check_softmax_scale,
    check_window,
)
from fused_rope.frequencies import rope_angles, rope_frequencies


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def apply_rope_ref(
    x: torch.Tensor,
    angles: torch.Tensor,
    layout: str = "half",
    rope_dim: int | None = None,
    output_scale: float = 1.0,
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """Rotates the first ``rope_dim`` channels of ``x`` by ``angles``; the rest pass through.

    Args:
        x: ``[B, H, N, D]``.
        angles: ``[N, R/2]`` or ``[1 | B, N, R/2]`` with ``R = rope_dim`` (default ``D``).
        layout: ``"half"`` pairs channel ``d`` with ``d + R/2`` (GPT-NeoX, Llama);
            ``"interleaved"`` pairs ``2d`` with ``2d + 1`` (GPT-J, the RoFormer paper).
        output_scale: multiplies the whole output, rotated and pass-through channels alike
            (the attention scale folded into Q).
        attention_factor: ``a``, multiplies cos and sin, so the rotated channels alone (YaRN's
            and LongRoPE's factor, as Hugging Face's scaled cos/sin apply it).

    Returns:
        ``[B, H, N, D]`` in ``x``'s dtype:
        ``y1 = s a (x1 cos - x2 sin)``, ``y2 = s a (x2 cos + x1 sin)``, ``y_pass = s x_pass``.
    """
    check_float_tensor(x, "x", ndim=4)
    check_layout(layout)
    B, _, N, D = x.shape
    R = check_rope_dim(rope_dim, D)
    # fp32 or fp64, as the kernels': half-precision angles of far positions are whole radians off
    check_float_tensor(angles, "angles", dtypes=FREQ_DTYPES)
    check_angles(angles, B, N, R)
    output_scale = check_scale(output_scale, "output_scale")
    attention_factor = check_attention_factor(attention_factor)
    cd = _compute_dtype(x)
    xf = x.to(cd)
    a = angles.to(cd)
    a = a[:, None] if a.dim() == 3 else a  # broadcast over heads: [B|1, 1, N, R/2]
    cos, sin = a.cos() * attention_factor, a.sin() * attention_factor
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


def full_precision(reference):
    """``reference`` (a reference attention) computed in the precision it states even under
    ``torch.autocast``, which would run its matrix products in bf16 (the harness trains and
    generates under bf16 autocast on CUDA, where its torch path is this ground truth)."""

    @functools.wraps(reference)
    def wrapped(q, *args, **kwargs):
        # autocast's device types of this project (meta, for one, has none)
        if not isinstance(q, torch.Tensor) or q.device.type not in ("cpu", "cuda"):
            return reference(q, *args, **kwargs)
        with torch.autocast(q.device.type, enabled=False):
            return reference(q, *args, **kwargs)

    return wrapped


@full_precision
def rope_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    theta: float = 10000.0,
    inv_freq: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    layout: str = "half",
    rope_dim: int | None = None,
    angles: torch.Tensor | None = None,
    q_angles: torch.Tensor | None = None,
    attention_factor: float = 1.0,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k (``apply_rope_ref``), then attention in float32 (float64 for float64 input).

    Args:
        q: ``[B, HQ, NQ, D]``; k, v: ``[B, HKV, NK, D]`` with ``HQ`` a multiple of ``HKV``.
        theta: the base of the default frequencies.
        inv_freq: ``[R/2]``; default ``rope_frequencies(R, theta)``.
        positions: keys' positions ``[NK]`` or ``[1 | B, NK]`` (default ``0..NK-1``).
        q_positions: ``[NQ]`` or ``[1 | B, NQ]``; default the last NQ key positions
            (``NK-NQ..NK-1`` when NQ > NK and the positions are the default).
        causal: query ``i`` sees key ``j`` iff ``j <= i + NK - NQ`` (bottom-right).
        softmax_scale: the scores' scale; default ``1 / sqrt(D)``.
        layout: ``"half"`` (pairs ``(i, i + R/2)``) or ``"interleaved"`` (``(2i, 2i + 1)``).
        rope_dim: ``R``, the rotated leading channels (even, at most D); default D.
        angles: the keys' rotation angles ``[NK, R/2]`` or ``[1 | B, NK, R/2]`` in place of
            ``positions * inv_freq`` (M-RoPE, N-D RoPE: ``mrope_angles``, ``nd_rope_angles``);
            excludes theta's role, ``inv_freq``, ``positions`` and ``q_positions``.
        q_angles: the queries' ``[NQ, R/2]`` or ``[1 | B, NQ, R/2]``, with ``angles`` only;
            default the last NQ rows of ``angles`` (NQ > NK needs them).
        attention_factor: scales q's and k's rotated channels (``apply_rope_ref``).
        window: causal only: query ``i`` also needs ``j > i + NK - NQ - window`` (a sliding
            window of ``window`` keys, its own included); default none.

    Returns:
        ``o [B, HQ, NQ, D]`` in q's dtype (0 for a query that sees no key) and the
        natural-log ``lse [B, HQ, NQ]`` in the compute dtype (``-inf`` for such a query).
    """

    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(x, name, ndim=4)
    check_attention_shapes(q, k, v)
    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    R = check_rope_dim(rope_dim, D)
    check_bool(causal, "causal")
    scale = check_softmax_scale(softmax_scale, D)
    window = check_window(window, causal)
    if isinstance(inv_freq, torch.Tensor):  # rope_frequencies' CPU tensor for a CUDA q, say
        inv_freq = inv_freq.to(q.device)
    check_rotation_inputs(
        q, NK, R, inv_freq=inv_freq, positions=positions, q_positions=q_positions,
        angles=angles, q_angles=q_angles,
    )  # fmt: skip
    if angles is None:
        if inv_freq is None:
            inv_freq, _ = rope_frequencies(R, theta, device=q.device)
        if positions is None:
            positions = torch.arange(NK, device=q.device)
        if q_positions is None:
            q_positions = (
                positions[..., NK - NQ :]
                if NQ <= NK
                else torch.arange(NK - NQ, NK, device=q.device)
            )
        angles, q_angles = rope_angles(positions, inv_freq), rope_angles(q_positions, inv_freq)
    elif q_angles is None:
        q_angles = angles[..., NK - NQ :, :]
    cd = _compute_dtype(q)
    q_rot = apply_rope_ref(q.to(cd), q_angles, layout, R, attention_factor=attention_factor)
    k_rot = apply_rope_ref(k.to(cd), angles, layout, R, attention_factor=attention_factor)
    group = HQ // HKV
    k_rot = k_rot.repeat_interleave(group, dim=1)
    vf = v.to(cd).repeat_interleave(group, dim=1)
    s = scale * q_rot @ k_rot.transpose(-1, -2)
    if causal:
        i = torch.arange(NQ, device=q.device)[:, None]
        j = torch.arange(NK, device=q.device)[None, :]
        hidden = j > i + NK - NQ
        if window:
            hidden |= j <= i + NK - NQ - window
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # rows with no visible key: exp(-inf - -inf) would be NaN; they output 0
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    o = p @ vf
    return o.to(q.dtype), lse
