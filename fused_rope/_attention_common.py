"""Shared pieces of the fused RoPE attention kernels (``attention_forward.py``,
``attention_backward.py``): autotune config lists, the Triton helpers that compute sin/cos,
load and rotate tiles and form the scores, and the launchers' argument helpers.


The kernels never write rotated Q or K to memory. Each program rotates its Q tile once
and each K tile as it is loaded, with sin/cos computed in registers from
``positions * inv_freq`` (fp32; inside the loops, for the default positions, by the angle
addition of ``_cos_sin``). The head dim is handled as three segments: the two
rotated halves ``x1``, ``x2`` (``R/2`` channels each; for the interleaved layout they are
the even and odd channels, de-interleaved on load and re-interleaved on store) and the
pass-through channels ``R..D``. ``QK^T`` is the sum of one dot per segment, which is what
the rotation needs (the pairs of a rotation live in separate registers) and is invariant to
the channel order as long as Q and K use the same one.

Folds (see ``fused_rope/README.md``): ``softmax_scale * log2(e)`` multiplies the Q rotation,
so the softmax runs on ``exp2`` with no per-score multiply. The backward applies the same
fold in the same place: dQ leaves the kernel as ``softmax_scale * R(-theta) (dS K_rot)`` and
dK as ``ln 2 * R(-theta) (dS^T Q_folded)`` (the log2(e) carried by Q cancels the ln 2), where
dS is the gradient of the natural-log scores.

Causal masking is bottom-right aligned, as in FlashAttention-2: query ``i`` sees key ``j``
iff ``j <= i + NK - NQ`` (by index, whatever the positions). A query that sees no key
(possible when ``NQ > NK``) gets ``o = 0``, ``lse = -inf`` and zero gradients.

GPU ideas not tried here (they cannot be tested without a GPU): TMA descriptors for the
K/V stream, warp specialization, packing the heads of a GQA group into one forward program
so a K tile is rotated once for the group, and ``libdevice.fast_sinf``/``fast_cosf`` after an
explicit range reduction.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2

# FUSED_ROPE_AUTOTUNE=0 keeps one config per kernel: GPU test sweeps compile each
# (head dim, rope dim, layout, causal, dtype) combination once instead of once per config.
_AUTOTUNE = os.environ.get("FUSED_ROPE_AUTOTUNE", "1") != "0"


def _configs(tiles):
    """Autotune configs from ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; the last is the
    untuned one. The lists are short because every config is a compilation per combination
    of dtype, head dim, layout, causality and position mode. ptxas on sm_90 shows the kernels at
    255 registers from 128x64 tiles on, so 4-warp configs keep to 64-row tiles."""
    if _INTERPRET:  # the interpreter is slow: one small config, BLOCK_M != BLOCK_N on purpose
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in tiles
    ]
    return configs if _AUTOTUNE else configs[-1:]


def _prune_for(owner: str):
    """early_config_prune keeping the configs whose fp32 accumulators (``owner`` rows times
    the head dim) fit the registers: a D=256 head needs 64-row tiles."""

    def prune(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        kept = [c for c in configs if c.kwargs[owner] * block_d <= 128 * 128]
        return kept or configs[-1:]

    return {"early_config_prune": prune}


# Lengths and head counts are not specialized on (divisible by 16, equal to 1): every sequence
# length would otherwise compile its own variant.
_SIZES = ["q_pos_off", "GROUP", "NQ", "NK"]
_AUTOTUNE_KEY = ["NQ", "NK", "BLOCK_D", "HALF", "PASS", "CAUSAL", "INTERLEAVED", "POS_ARANGE"]


@triton.jit
def _delta_cos_sin(inv_freq, ROWS: tl.constexpr):
    """cos/sin ``[ROWS, HALF]`` of ``d * inv_freq`` for ``d = 0..ROWS-1``: the per-row part of
    the angle addition that ``_cos_sin`` uses for consecutive positions."""
    angle = tl.arange(0, ROWS).to(tl.float32)[:, None] * inv_freq[None, :]
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _cos_sin(
    POS,
    start,
    rows,
    row_mask,
    inv_freq,
    pos_off,
    cos_d,
    sin_d,
    POS_ARANGE: tl.constexpr,
    INCREMENTAL: tl.constexpr,
):
    """cos/sin ``[ROWS, HALF]`` of ``position * inv_freq`` (fp32) for ``rows = start + 0..ROWS-1``.

    Positions are loaded from ``POS``, or with POS_ARANGE are ``row + pos_off``. Inside the
    loops (INCREMENTAL) consecutive positions use the angle addition
    ``cos(b + d) = cos b cos d - sin b sin d`` with the ``d`` table of ``_delta_cos_sin``: a few
    FMAs per element instead of a full sin and cos, which would cost about as much as the
    tile's matmuls."""
    if POS_ARANGE and INCREMENTAL:
        base = inv_freq * (start + pos_off)
        cos_b = tl.cos(base)[None, :]
        sin_b = tl.sin(base)[None, :]
        cos = cos_d * cos_b - sin_d * sin_b
        sin = sin_d * cos_b + cos_d * sin_b
    else:
        if POS_ARANGE:
            pos = (rows + pos_off).to(tl.float32)
        else:
            pos = tl.load(POS + rows, mask=row_mask, other=0.0)
        angle = pos[:, None] * inv_freq[None, :]
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return cos, sin


@triton.jit
def _load_rotated(
    X,
    rows,
    row_mask,
    stride_n,
    stride_d,
    cos,
    sin,
    scale,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Loads rows of one head and returns its three segments rotated and scaled, in X's dtype:
    ``x1r [ROWS, HALF]``, ``x2r [ROWS, HALF]``, ``xpr [ROWS, PASS]`` (zero padding)."""
    ptrs = X + rows[:, None] * stride_n
    offs_h = tl.arange(0, HALF)
    if INTERLEAVED:
        ch = tl.arange(0, 2 * HALF)
        x = tl.load(
            ptrs + ch[None, :] * stride_d,
            mask=row_mask[:, None] & (ch[None, :] < ROPE_DIM),
            other=0.0,
        )
        x1, x2 = tl.split(tl.reshape(x.to(tl.float32), (ROWS, HALF, 2)))
    else:
        mask = row_mask[:, None] & (offs_h[None, :] < ROPE_DIM // 2)
        x1 = tl.load(ptrs + offs_h[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + (offs_h[None, :] + ROPE_DIM // 2) * stride_d, mask=mask, other=0.0).to(
            tl.float32
        )
    dtype = X.dtype.element_ty
    x1r = ((x1 * cos - x2 * sin) * scale).to(dtype)
    x2r = ((x2 * cos + x1 * sin) * scale).to(dtype)
    if HEAD_DIM > ROPE_DIM:
        offs_p = tl.arange(0, PASS)
        xp = tl.load(
            ptrs + (offs_p[None, :] + ROPE_DIM) * stride_d,
            mask=row_mask[:, None] & (offs_p[None, :] < HEAD_DIM - ROPE_DIM),
            other=0.0,
        )
        xpr = (xp.to(tl.float32) * scale).to(dtype)
    else:
        xpr = tl.zeros((ROWS, PASS), dtype=dtype)
    return x1r, x2r, xpr


@triton.jit
def _query_program(HQ, GROUP, CAUSAL: tl.constexpr):
    """``(pid_m, b, h, hk)`` of a query-major program (forward, dQ): its query tile, batch,
    query head and KV head (int64, for the pointer offsets)."""
    if CAUSAL:  # the last query tiles have the most keys: launching them first evens the tail
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % HQ
    return pid_m, (pid_bh // HQ).to(tl.int64), h.to(tl.int64), (h // GROUP).to(tl.int64)


@triton.jit
def _query_tile(
    Q,
    QPOS,
    INV_FREQ,
    start_m,
    NQ,
    q_pos_off,
    stride_qn,
    stride_qd,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    POS_ARANGE: tl.constexpr,
):
    """The rotated, scaled query tile of rows ``start_m ..`` (``q1, q2 [BLOCK_M, HALF]``,
    ``qp [BLOCK_M, PASS]``), its rows and mask, the frequencies, and the ``[BLOCK_N, HALF]``
    angle-step table the key loop advances by."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_mask = offs_m < NQ
    offs_h = tl.arange(0, HALF)
    inv_freq = tl.load(INV_FREQ + offs_h, mask=offs_h < ROPE_DIM // 2, other=0.0)
    cos, sin = _cos_sin(
        QPOS, start_m, offs_m, m_mask, inv_freq, q_pos_off, 0.0, 0.0, POS_ARANGE, False
    )
    q1, q2, qp = _load_rotated(
        Q, offs_m, m_mask, stride_qn, stride_qd, cos, sin, qk_scale,
        BLOCK_M, HEAD_DIM, ROPE_DIM, HALF, PASS, INTERLEAVED,
    )  # fmt: skip
    cos_d, sin_d = _delta_cos_sin(inv_freq, BLOCK_N)
    return offs_m, m_mask, inv_freq, q1, q2, qp, cos_d, sin_d


@triton.jit
def _store_rotated(
    X,
    rows,
    row_mask,
    stride_n,
    stride_d,
    g1,
    g2,
    gp,
    cos,
    sin,
    scale,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Stores ``scale * R g`` for the segments ``g`` (as ``_load_rotated``, in reverse).

    The backward passes the cos/sin of ``-theta``: rotating the gradients w.r.t. the rotated
    segments by ``-theta`` is the transpose of the forward rotation."""
    ptrs = X + rows[:, None] * stride_n
    dtype = X.dtype.element_ty
    d1 = ((g1 * cos - g2 * sin) * scale).to(dtype)
    d2 = ((g2 * cos + g1 * sin) * scale).to(dtype)
    offs_h = tl.arange(0, HALF)
    if INTERLEAVED:
        ch = tl.arange(0, 2 * HALF)
        d = tl.reshape(tl.join(d1, d2), (ROWS, 2 * HALF))
        tl.store(
            ptrs + ch[None, :] * stride_d, d, mask=row_mask[:, None] & (ch[None, :] < ROPE_DIM)
        )
    else:
        mask = row_mask[:, None] & (offs_h[None, :] < ROPE_DIM // 2)
        tl.store(ptrs + offs_h[None, :] * stride_d, d1, mask=mask)
        tl.store(ptrs + (offs_h[None, :] + ROPE_DIM // 2) * stride_d, d2, mask=mask)
    if HEAD_DIM > ROPE_DIM:
        offs_p = tl.arange(0, PASS)
        tl.store(
            ptrs + (offs_p[None, :] + ROPE_DIM) * stride_d,
            (gp * scale).to(dtype),
            mask=row_mask[:, None] & (offs_p[None, :] < HEAD_DIM - ROPE_DIM),
        )


@triton.jit
def _scores(a1, a2, ap, b1, b2, bp, HAS_PASS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``a @ b^T`` summed over the three segments: ``[rows of a, rows of b]`` fp32."""
    s = tl.dot(a1, tl.trans(b1), input_precision=INPUT_PRECISION)
    s = tl.dot(a2, tl.trans(b2), s, input_precision=INPUT_PRECISION)
    if HAS_PASS:
        s = tl.dot(ap, tl.trans(bp), s, input_precision=INPUT_PRECISION)
    return s


def _meta(head_dim: int, rope_dim: int, interleaved: bool, causal: bool, dtype: torch.dtype):
    """Constexprs shared by every kernel. tl.dot needs inner dims >= 16, hence the floors."""
    pass_dim = head_dim - rope_dim
    return dict(
        HEAD_DIM=head_dim,
        ROPE_DIM=rope_dim,
        HALF=max(16, triton.next_power_of_2(rope_dim // 2)),
        PASS=max(16, triton.next_power_of_2(pass_dim)) if pass_dim else 16,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        INTERLEAVED=interleaved,
        CAUSAL=causal,
        # fp32 inputs exist for tests: keep their dots in full fp32, not TF32
        INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


def _position_args(q_pos, k_pos, inv_freq, nq: int, nk: int) -> tuple:
    """(QPOS, KPOS, stride_qpb, stride_kpb, q_pos_off), and the POS_ARANGE flag: without
    position tensors the keys sit at 0..NK-1 and the queries at NK-NQ..NK-1 (the pointers
    are then never read)."""
    if q_pos is None:
        return (inv_freq, inv_freq, 0, 0, nk - nq), True
    batch_stride = lambda p: p.stride(0) if p.shape[0] > 1 else 0
    return (q_pos, k_pos, batch_stride(q_pos), batch_stride(k_pos), 0), False
