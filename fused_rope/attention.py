"""RoPE fused into FlashAttention-2: forward and backward Triton kernels.

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

import contextlib
import math
import os

import torch
import triton
import triton.language as tl

from fused_rope._validation import (
    KERNEL_DTYPES,
    check_float_tensor,
    check_inv_freq,
    check_kernel_device,
    check_layout,
    check_rope_dim,
    check_same_device,
)
from fused_rope.frequencies import default_inv_freq, rope_angles

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
MAX_HEAD_DIM = 256
IMPLS = ("auto", "fused", "separate")


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
_FWD_CONFIGS = _configs(
    [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 32, 8, 3),
        (128, 128, 8, 2),
        (64, 32, 4, 3),
        (64, 64, 4, 2),
    ]
)
# dK/dV programs own a key tile (BLOCK_N) and stream query tiles (BLOCK_M); dQ the reverse.
_DKDV_CONFIGS = _configs(
    [
        (32, 128, 8, 2),
        (64, 128, 8, 2),
        (64, 64, 8, 2),
        (32, 64, 8, 3),
        (16, 64, 4, 3),
        (32, 64, 4, 2),
    ]
)
_DQ_CONFIGS = _configs(
    [
        (128, 32, 8, 2),
        (128, 64, 8, 2),
        (128, 32, 8, 3),
        (64, 64, 8, 2),
        (64, 32, 4, 3),
        (64, 32, 4, 2),
    ]
)


# --------------------------------------------------------------------------- kernels


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


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q1,
    q2,
    qp,
    K,
    V,
    KPOS,
    inv_freq,
    cos_d,
    sin_d,
    offs_m,
    lo,
    hi,
    offset,
    NK,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    MASKED: tl.constexpr,
    POS_ARANGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online softmax over key tiles ``[lo, hi)``; only MASKED calls pay for the mask."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NK
        cos, sin = _cos_sin(
            KPOS, start_n, offs_n, n_mask, inv_freq, 0, cos_d, sin_d, POS_ARANGE, True
        )
        k1, k2, kp = _load_rotated(
            K,
            offs_n,
            n_mask,
            stride_kn,
            stride_kd,
            cos,
            sin,
            1.0,
            BLOCK_N,
            HEAD_DIM,
            ROPE_DIM,
            HALF,
            PASS,
            INTERLEAVED,
        )
        s = _scores(q1, q2, qp, k1, k2, kp, HEAD_DIM > ROPE_DIM, INPUT_PRECISION)
        if MASKED:
            keep = n_mask[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + offset)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:  # a row with no visible key so far keeps m = -inf; exp2 must not see -inf - -inf
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=n_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=_prune_for("BLOCK_M"))
@triton.jit(do_not_specialize=_SIZES)
def _rope_attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    INV_FREQ,
    QPOS,
    KPOS,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_qpb,
    stride_kpb,
    q_pos_off,
    HQ,
    GROUP,
    NQ,
    NK,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    POS_ARANGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, b, h, hk = _query_program(HQ, GROUP, CAUSAL)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    O += b * stride_ob + h * stride_oh
    QPOS += b * stride_qpb
    KPOS += b * stride_kpb
    offset = NK - NQ

    start_m = pid_m * BLOCK_M
    offs_m, m_mask, inv_freq, q1, q2, qp, cos_d, sin_d = _query_tile(
        Q, QPOS, INV_FREQ, start_m, NQ, q_pos_off, stride_qn, stride_qd, qk_scale,
        BLOCK_M, BLOCK_N, HEAD_DIM, ROPE_DIM, HALF, PASS, INTERLEAVED, POS_ARANGE,
    )  # fmt: skip

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    if CAUSAL:
        hi = tl.maximum(tl.minimum(NK, start_m + BLOCK_M + offset), 0)
        # keys <= start_m + offset are visible to every query of the tile: no mask there
        full_end = tl.minimum(tl.maximum(start_m + offset + 1, 0), NK) // BLOCK_N * BLOCK_N
    else:
        hi = NK
        full_end = NK // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q1,
        q2,
        qp,
        K,
        V,
        KPOS,
        inv_freq,
        cos_d,
        sin_d,
        offs_m,
        0,
        full_end,
        offset,
        NK,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        False,
        POS_ARANGE,
        CAUSAL,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        BLOCK_D,
        INTERLEAVED,
        INPUT_PRECISION,
        BLOCK_N,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q1,
        q2,
        qp,
        K,
        V,
        KPOS,
        inv_freq,
        cos_d,
        sin_d,
        offs_m,
        full_end,
        hi,
        offset,
        NK,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        True,
        POS_ARANGE,
        CAUSAL,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        BLOCK_D,
        INTERLEAVED,
        INPUT_PRECISION,
        BLOCK_N,
    )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + (b * HQ + h) * NQ + offs_m, lse, mask=m_mask)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(
        O + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        o.to(O.dtype.element_ty),
        mask=m_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
    )


@triton.jit
def _bwd_preprocess_kernel(
    O,
    DO,
    LSE,
    DLSE,
    DELTA,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    HQ,
    NQ,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``Delta = rowsum(dO * O) - dLSE`` (the lse cotangent enters dS exactly as -Delta does);
    also turns ``lse`` into the log2 domain, with ``+inf`` for rows that saw no key so the
    backward's ``exp2(s - lse)`` is 0 there."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = (pid_bh % HQ).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < NQ) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(
        O
        + b * stride_ob
        + h * stride_oh
        + offs_m[:, None] * stride_on
        + offs_d[None, :] * stride_od,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO
        + b * stride_dob
        + h * stride_doh
        + offs_m[:, None] * stride_don
        + offs_d[None, :] * stride_dod,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    row = (b * HQ + h) * NQ + offs_m
    m_mask = offs_m < NQ
    dlse = tl.load(DLSE + row, mask=m_mask, other=0.0)
    tl.store(DELTA + row, tl.sum(o * do, 1) - dlse, mask=m_mask)
    lse2 = tl.load(LSE + row, mask=m_mask, other=0.0) * 1.4426950408889634
    tl.store(LSE + row, tl.where(lse2 == float("-inf"), float("inf"), lse2), mask=m_mask)


@triton.jit
def _dkdv_inner(
    dk1,
    dk2,
    dkp,
    dv,
    k1,
    k2,
    kp,
    v,
    Q,
    DO,
    LSE2,
    DELTA,
    QPOS,
    inv_freq,
    cos_d,
    sin_d,
    q_pos_off,
    offs_n,
    lo,
    n_tiles,
    qk_scale,
    offset,
    NQ,
    h0,
    GROUP,
    NQ_HEAD,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_doh,
    stride_don,
    stride_dod,
    MASKED: tl.constexpr,
    POS_ARANGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Accumulates dK, dV of one key tile over ``n_tiles`` query tiles from ``lo``, for every
    query head of the GQA group. The heads loop outside so that the loop over query tiles is
    the innermost one, the loop Triton software-pipelines."""
    offs_d = tl.arange(0, BLOCK_D)
    for g in range(0, GROUP):
        h = (h0 + g).to(tl.int64)
        for t in tl.range(0, n_tiles):
            start_m = lo + t * BLOCK_M
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_mask = offs_m < NQ
            cos, sin = _cos_sin(
                QPOS, start_m, offs_m, m_mask, inv_freq, q_pos_off, cos_d, sin_d, POS_ARANGE, True
            )
            q1, q2, qp = _load_rotated(
                Q + h * stride_qh,
                offs_m,
                m_mask,
                stride_qn,
                stride_qd,
                cos,
                sin,
                qk_scale,
                BLOCK_M,
                HEAD_DIM,
                ROPE_DIM,
                HALF,
                PASS,
                INTERLEAVED,
            )
            do = tl.load(
                DO + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                mask=m_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0,
            )
            # rows past NQ: do = 0 and Delta = 0, so they add nothing to dK, dV
            lse2 = tl.load(LSE2 + h * NQ_HEAD + offs_m, mask=m_mask, other=0.0)
            delta = tl.load(DELTA + h * NQ_HEAD + offs_m, mask=m_mask, other=0.0)
            s_t = _scores(k1, k2, kp, q1, q2, qp, HEAD_DIM > ROPE_DIM, INPUT_PRECISION)
            p_t = tl.exp2(s_t - lse2[None, :])
            if MASKED:
                p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + offset, p_t, 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            ds_t = (p_t * (dp_t - delta[None, :])).to(q1.dtype)
            dk1 = tl.dot(ds_t, q1, dk1, input_precision=INPUT_PRECISION)
            dk2 = tl.dot(ds_t, q2, dk2, input_precision=INPUT_PRECISION)
            if HEAD_DIM > ROPE_DIM:
                dkp = tl.dot(ds_t, qp, dkp, input_precision=INPUT_PRECISION)
    return dk1, dk2, dkp, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=_prune_for("BLOCK_N"))
@triton.jit(do_not_specialize=_SIZES)
def _rope_attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    INV_FREQ,
    QPOS,
    KPOS,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    stride_qpb,
    stride_kpb,
    q_pos_off,
    HKV,
    GROUP,
    NQ,
    NK,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    POS_ARANGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    h0 = hk * GROUP
    HQ = HKV * GROUP
    Q += b * stride_qb
    DO += b * stride_dob
    LSE2 += b * HQ * NQ
    DELTA += b * HQ * NQ
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    QPOS += b * stride_qpb
    KPOS += b * stride_kpb
    offset = NK - NQ

    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < NK
    offs_h = tl.arange(0, HALF)
    inv_freq = tl.load(INV_FREQ + offs_h, mask=offs_h < ROPE_DIM // 2, other=0.0)
    cos, sin = _cos_sin(KPOS, start_n, offs_n, n_mask, inv_freq, 0, 0.0, 0.0, POS_ARANGE, False)
    k1, k2, kp = _load_rotated(
        K,
        offs_n,
        n_mask,
        stride_kn,
        stride_kd,
        cos,
        sin,
        1.0,
        BLOCK_N,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        INTERLEAVED,
    )
    cos_d, sin_d = _delta_cos_sin(inv_freq, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    v = tl.load(
        V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
        mask=n_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )

    dk1 = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    dk2 = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    dkp = tl.zeros((BLOCK_N, PASS), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if CAUSAL:
        # queries before start_n - offset see none of this tile; from start_n + BLOCK_N - 1 -
        # offset on they see all of it; the band between needs the mask
        lo = tl.maximum(start_n - offset, 0)
        band_end = tl.maximum(tl.minimum(start_n + BLOCK_N - 1 - offset, NQ), lo)
        n_masked = tl.cdiv(band_end - lo, BLOCK_M)
    else:
        lo = 0
        n_masked = 0
    free_lo = lo + n_masked * BLOCK_M
    n_free = tl.cdiv(tl.maximum(NQ - free_lo, 0), BLOCK_M)
    dk1, dk2, dkp, dv = _dkdv_inner(
        dk1,
        dk2,
        dkp,
        dv,
        k1,
        k2,
        kp,
        v,
        Q,
        DO,
        LSE2,
        DELTA,
        QPOS,
        inv_freq,
        cos_d,
        sin_d,
        q_pos_off,
        offs_n,
        lo,
        n_masked,
        qk_scale,
        offset,
        NQ,
        h0,
        GROUP,
        NQ,
        stride_qh,
        stride_qn,
        stride_qd,
        stride_doh,
        stride_don,
        stride_dod,
        True,
        POS_ARANGE,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        BLOCK_D,
        INTERLEAVED,
        INPUT_PRECISION,
        BLOCK_M,
    )
    dk1, dk2, dkp, dv = _dkdv_inner(
        dk1,
        dk2,
        dkp,
        dv,
        k1,
        k2,
        kp,
        v,
        Q,
        DO,
        LSE2,
        DELTA,
        QPOS,
        inv_freq,
        cos_d,
        sin_d,
        q_pos_off,
        offs_n,
        free_lo,
        n_free,
        qk_scale,
        offset,
        NQ,
        h0,
        GROUP,
        NQ,
        stride_qh,
        stride_qn,
        stride_qd,
        stride_doh,
        stride_don,
        stride_dod,
        False,
        POS_ARANGE,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        BLOCK_D,
        INTERLEAVED,
        INPUT_PRECISION,
        BLOCK_M,
    )

    DK += b * stride_dkb + hk * stride_dkh
    DV += b * stride_dvb + hk * stride_dvh
    # Q carried softmax_scale * log2(e); ln 2 turns dS^T Q_folded into softmax_scale dS^T Q_rot
    # sin/cos of -theta, recomputed here rather than kept live in registers across the loop
    cos, sin = _cos_sin(KPOS, start_n, offs_n, n_mask, -inv_freq, 0, 0.0, 0.0, POS_ARANGE, False)
    _store_rotated(
        DK,
        offs_n,
        n_mask,
        stride_dkn,
        stride_dkd,
        dk1,
        dk2,
        dkp,
        cos,
        sin,
        0.6931471805599453,
        BLOCK_N,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        INTERLEAVED,
    )
    tl.store(
        DV + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty),
        mask=n_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
    )


@triton.jit
def _dq_inner(
    dq1,
    dq2,
    dqp,
    q1,
    q2,
    qp,
    do,
    lse2,
    delta,
    K,
    V,
    KPOS,
    inv_freq,
    cos_d,
    sin_d,
    offs_m,
    lo,
    hi,
    offset,
    NK,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    MASKED: tl.constexpr,
    POS_ARANGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Accumulates dQ (w.r.t. the rotated segments) over key tiles ``[lo, hi)``."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NK
        cos, sin = _cos_sin(
            KPOS, start_n, offs_n, n_mask, inv_freq, 0, cos_d, sin_d, POS_ARANGE, True
        )
        k1, k2, kp = _load_rotated(
            K,
            offs_n,
            n_mask,
            stride_kn,
            stride_kd,
            cos,
            sin,
            1.0,
            BLOCK_N,
            HEAD_DIM,
            ROPE_DIM,
            HALF,
            PASS,
            INTERLEAVED,
        )
        v = tl.load(
            V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=n_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )
        s = _scores(q1, q2, qp, k1, k2, kp, HEAD_DIM > ROPE_DIM, INPUT_PRECISION)
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            keep = n_mask[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + offset)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(k1.dtype)
        dq1 = tl.dot(ds, k1, dq1, input_precision=INPUT_PRECISION)
        dq2 = tl.dot(ds, k2, dq2, input_precision=INPUT_PRECISION)
        if HEAD_DIM > ROPE_DIM:
            dqp = tl.dot(ds, kp, dqp, input_precision=INPUT_PRECISION)
    return dq1, dq2, dqp


@triton.autotune(configs=_DQ_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=_prune_for("BLOCK_M"))
@triton.jit(do_not_specialize=_SIZES)
def _rope_attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
    INV_FREQ,
    QPOS,
    KPOS,
    qk_scale,
    softmax_scale,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqn,
    stride_dqd,
    stride_qpb,
    stride_kpb,
    q_pos_off,
    HQ,
    GROUP,
    NQ,
    NK,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    POS_ARANGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, b, h, hk = _query_program(HQ, GROUP, CAUSAL)
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    QPOS += b * stride_qpb
    KPOS += b * stride_kpb
    offset = NK - NQ

    start_m = pid_m * BLOCK_M
    offs_m, m_mask, inv_freq, q1, q2, qp, cos_d, sin_d = _query_tile(
        Q, QPOS, INV_FREQ, start_m, NQ, q_pos_off, stride_qn, stride_qd, qk_scale,
        BLOCK_M, BLOCK_N, HEAD_DIM, ROPE_DIM, HALF, PASS, INTERLEAVED, POS_ARANGE,
    )  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    do = tl.load(
        DO + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
        mask=m_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    row = (b * HQ + h) * NQ + offs_m
    lse2 = tl.load(LSE2 + row, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + row, mask=m_mask, other=0.0)

    dq1 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    dq2 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    dqp = tl.zeros((BLOCK_M, PASS), dtype=tl.float32)
    if CAUSAL:
        hi = tl.maximum(tl.minimum(NK, start_m + BLOCK_M + offset), 0)
        full_end = tl.minimum(tl.maximum(start_m + offset + 1, 0), NK) // BLOCK_N * BLOCK_N
    else:
        hi = NK
        full_end = NK // BLOCK_N * BLOCK_N
    dq1, dq2, dqp = _dq_inner(
        dq1,
        dq2,
        dqp,
        q1,
        q2,
        qp,
        do,
        lse2,
        delta,
        K,
        V,
        KPOS,
        inv_freq,
        cos_d,
        sin_d,
        offs_m,
        0,
        full_end,
        offset,
        NK,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        False,
        POS_ARANGE,
        CAUSAL,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        BLOCK_D,
        INTERLEAVED,
        INPUT_PRECISION,
        BLOCK_N,
    )
    dq1, dq2, dqp = _dq_inner(
        dq1,
        dq2,
        dqp,
        q1,
        q2,
        qp,
        do,
        lse2,
        delta,
        K,
        V,
        KPOS,
        inv_freq,
        cos_d,
        sin_d,
        offs_m,
        full_end,
        hi,
        offset,
        NK,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        True,
        POS_ARANGE,
        CAUSAL,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        BLOCK_D,
        INTERLEAVED,
        INPUT_PRECISION,
        BLOCK_N,
    )

    DQ += b * stride_dqb + h * stride_dqh
    # dS K_rot is the gradient w.r.t. the natural-log scores' Q_rot / softmax_scale
    cos, sin = _cos_sin(
        QPOS, start_m, offs_m, m_mask, -inv_freq, q_pos_off, 0.0, 0.0, POS_ARANGE, False
    )
    _store_rotated(
        DQ,
        offs_m,
        m_mask,
        stride_dqn,
        stride_dqd,
        dq1,
        dq2,
        dqp,
        cos,
        sin,
        softmax_scale,
        BLOCK_M,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        INTERLEAVED,
    )


# --------------------------------------------------------------------------- launchers


# Each autotuned kernel with its full config list (pinned_config narrows the kernel's own).
_AUTOTUNED = (
    (_rope_attn_fwd_kernel, _FWD_CONFIGS),
    (_rope_attn_bwd_dkdv_kernel, _DKDV_CONFIGS),
    (_rope_attn_bwd_dq_kernel, _DQ_CONFIGS),
)
N_CONFIGS = min(len(configs) for _, configs in _AUTOTUNED)


@contextlib.contextmanager
def pinned_config(index: int):
    """Within the block every fused kernel runs config ``index`` of its autotune list, with
    no tuning (tests of each config, benchmarks that precompile configs in parallel)."""
    saved = [(kernel.configs, kernel.cache) for kernel, _ in _AUTOTUNED]
    try:
        for kernel, configs in _AUTOTUNED:
            kernel.configs, kernel.cache = [configs[index]], {}
        yield
    finally:
        for (kernel, _), (configs, cache) in zip(_AUTOTUNED, saved, strict=True):
            kernel.configs, kernel.cache = configs, cache


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


def rope_attention_fwd(
    q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim
):
    """Launches the forward. Positions are fp32 ``[1 | B, N]`` contiguous, or both None for the
    default positions. Returns ``o [B, HQ, NQ, D]`` in q's dtype and ``lse [B, HQ, NQ]`` fp32 (natural log)."""
    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, HQ, NQ), device=q.device, dtype=torch.float32)
    meta = _meta(D, rope_dim, interleaved, causal, q.dtype)
    (qp, kp, *pos_strides), pos_arange = _position_args(q_pos, k_pos, inv_freq, NQ, NK)
    grid = lambda m: (triton.cdiv(NQ, m["BLOCK_M"]), B * HQ)
    _rope_attn_fwd_kernel[grid](
        q,
        k,
        v,
        o,
        lse,
        inv_freq,
        qp,
        kp,
        softmax_scale * _LOG2E,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(o),
        *pos_strides,
        HQ,
        HQ // HKV,
        NQ,
        NK,
        POS_ARANGE=pos_arange,
        **meta,
    )
    return o, lse


def rope_attention_bwd(
    do, q, k, v, o, lse, dlse, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim
):
    """Launches the backward: preprocess, dK/dV (key-major, no atomics: each program loops
    over the query heads of its KV head's group) and dQ (query-major).
    Returns ``dq, dk, dv`` shaped like ``q, k, v``."""
    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    meta = _meta(D, rope_dim, interleaved, causal, q.dtype)
    delta = torch.empty((B, HQ, NQ), device=q.device, dtype=torch.float32)
    lse2 = lse.clone()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.float().contiguous()
    pre_block = 64 if not _INTERPRET else 32
    _bwd_preprocess_kernel[(triton.cdiv(NQ, pre_block), B * HQ)](
        o,
        do,
        lse2,
        dlse,
        delta,
        *_strides(o),
        *_strides(do),
        HQ,
        NQ,
        HEAD_DIM=D,
        BLOCK_D=meta["BLOCK_D"],
        BLOCK_M=pre_block,
    )
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    (qp, kp, *pos_strides), pos_arange = _position_args(q_pos, k_pos, inv_freq, NQ, NK)
    qk_scale = softmax_scale * _LOG2E
    _rope_attn_bwd_dkdv_kernel[lambda m: (triton.cdiv(NK, m["BLOCK_N"]), B * HKV)](
        q,
        k,
        v,
        do,
        lse2,
        delta,
        dk,
        dv,
        inv_freq,
        qp,
        kp,
        qk_scale,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(do),
        *_strides(dk),
        *_strides(dv),
        *pos_strides,
        HKV,
        HQ // HKV,
        NQ,
        NK,
        POS_ARANGE=pos_arange,
        **meta,
    )
    _rope_attn_bwd_dq_kernel[lambda m: (triton.cdiv(NQ, m["BLOCK_M"]), B * HQ)](
        q,
        k,
        v,
        do,
        lse2,
        delta,
        dq,
        inv_freq,
        qp,
        kp,
        qk_scale,
        softmax_scale,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(do),
        *_strides(dq),
        *pos_strides,
        HQ,
        HQ // HKV,
        NQ,
        NK,
        POS_ARANGE=pos_arange,
        **meta,
    )
    return dq, dk, dv


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("fused_rope::rope_attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    interleaved: bool,
    rope_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_attention_fwd(
        q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim
    )


@_fwd_op.register_fake
def _(q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim):
    B, HQ, NQ, _ = q.shape
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        q.new_empty((B, HQ, NQ), dtype=torch.float32),
    )


@torch.library.custom_op("fused_rope::rope_attention_bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    inv_freq: torch.Tensor,
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    interleaved: bool,
    rope_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rope_attention_bwd(
        do,
        q,
        k,
        v,
        o,
        lse,
        dlse,
        inv_freq,
        q_pos,
        k_pos,
        causal,
        softmax_scale,
        interleaved,
        rope_dim,
    )


@_bwd_op.register_fake
def _(
    do, dlse, q, k, v, o, lse, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim
):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, inv_freq, q_pos, k_pos)
    ctx.args = (causal, softmax_scale, interleaved, rope_dim)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, inv_freq, q_pos, k_pos = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dk, dv = _bwd_op(do, dlse, q, k, v, o, lse, inv_freq, q_pos, k_pos, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public API


def _check_positions(pos, name: str, batch: int, length: int, device: torch.device):
    if pos is None:
        return
    if not isinstance(pos, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(pos).__name__}")
    if pos.dtype == torch.bool or pos.is_complex():
        raise TypeError(f"{name} must have an integer or floating dtype, got {pos.dtype}")
    if (
        pos.dim() not in (1, 2)
        or pos.shape[-1] != length
        or (pos.dim() == 2 and pos.shape[0] != batch)
    ):
        expected = f"[{length}] or [{batch}, {length}]"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(pos.shape)}")
    if pos.device != device:
        raise ValueError(f"{name} is on {pos.device} but q is on {device}")


def _as_rows(pos: torch.Tensor) -> torch.Tensor:
    """fp32 ``[1 | B, N]`` contiguous, the kernels' position format."""
    pos = pos.float()
    return (pos[None] if pos.dim() == 1 else pos).contiguous()


def _query_positions(positions, q_positions, nq: int, nk: int, device) -> torch.Tensor | None:
    """The queries' positions as ``rope_attention`` defines them: ``q_positions``, else the last
    NQ key positions (``NK-NQ..NK-1`` for the default ones); None for ``NQ == NK`` with the
    default positions (the RoPE kernel then forms the angles itself)."""
    if q_positions is not None:
        return q_positions
    if positions is not None:
        return positions[..., nk - nq :]
    return None if nq == nk else torch.arange(nk - nq, nk, device=device)


def _lower_right_backend(q, k, v) -> str:
    """The SDPA kernel that ``torch.nn.attention.bias.causal_lower_right`` dispatches these
    inputs to: ``"flash"`` (FlashAttention-2, whose causal mask is bottom-right),
    ``"efficient"`` (the memory-efficient kernel) or ``"math"`` (a materialized ``NQ x NK``
    mask, O(NQ NK) memory)."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    params = SDPAParams(q, k, v, None, 0.0, False, q.shape[1] != k.shape[1])
    if can_use_flash_attention(params):
        return "flash"
    return "efficient" if can_use_efficient_attention(params) else "math"


def _sdpa_has_lower_right_kernel(q, k, v) -> bool:
    """Whether PyTorch's SDPA runs bottom-right causal attention on these inputs with a kernel
    rather than a materialized mask, which the fused kernel avoids. False while
    ``torch.compile`` traces: dynamo cannot build the mask object in a graph."""
    if torch.compiler.is_compiling():
        return False
    return _lower_right_backend(q, k, v) != "math"


def _rope_then_sdpa(q, k, v, inv_freq, positions, q_positions, causal, scale, layout, rope_dim):
    """The unfused path: this package's Triton RoPE over q and k, then PyTorch's best SDPA
    backend. Causal with ``NQ < NK`` (a prefill that continues a KV cache) uses SDPA's
    bottom-right mask (``causal_lower_right``), the fused kernel's alignment."""
    from torch.nn.attention.bias import causal_lower_right

    from fused_rope.rope import apply_rope, apply_rope_qk  # task B's kernel module, on use

    NQ, NK = q.shape[2], k.shape[2]
    # As in the fused kernel: no gradient for positions or frequencies, any strides. Default
    # positions: the RoPE kernel forms the angles itself, where an angle table took three
    # more small launches (arange, cast, product).
    inv_freq = inv_freq.detach()
    rope = lambda pos: dict(inv_freq=inv_freq) if pos is None else dict(
        angles=rope_angles(pos.detach(), inv_freq)
    )  # fmt: skip
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    if NQ == NK and q_positions is None:  # q and k share the angles: one launch
        q_rot, k_rot = apply_rope_qk(q, k, layout=layout, rope_dim=rope_dim, **rope(positions))
    else:
        q_pos = _query_positions(positions, q_positions, NQ, NK, q.device)
        q_rot = apply_rope(q, layout=layout, rope_dim=rope_dim, **rope(q_pos))
        k_rot = apply_rope(k, layout=layout, rope_dim=rope_dim, **rope(positions))
    mask = causal_lower_right(NQ, NK) if causal and NQ != NK else None
    HQ, HKV = q.shape[1], k.shape[1]
    if mask is not None and HQ != HKV and _lower_right_backend(q_rot, k_rot, v) == "efficient":
        # causal_lower_right hands the memory-efficient kernel k and v as they are, without
        # the GQA head expansion of its other branches (torch 2.5-2.13): give it every head.
        k_rot, v = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k_rot, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q_rot,
        k_rot,
        v,
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=q_rot.shape[1] != k_rot.shape[1],
    )


def _check_inputs(
    q,
    k,
    v,
    theta,
    inv_freq,
    positions,
    q_positions,
    causal,
    softmax_scale,
    layout,
    rope_dim,
    return_lse,
    impl,
):
    """Validates every argument; returns ``(rope_dim, impl)`` with "auto" resolved."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(x, name, ndim=4, dtypes=KERNEL_DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = check_same_device(q=q, k=k, v=v)
    B, HQ, NQ, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or v.shape != k.shape:
        raise ValueError(
            f"k and v must be [B={B}, HKV, NK, D={D}] and equal, got k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    HKV, NK = k.shape[1], k.shape[2]
    if HKV == 0 or HQ % HKV:
        raise ValueError(f"q's {HQ} heads must be a multiple of k's {HKV} heads (GQA)")
    if min(NQ, NK) == 0:
        raise ValueError(f"q and k need at least one position, got NQ={NQ}, NK={NK}")
    check_layout(layout)
    rope_dim = check_rope_dim(rope_dim, D)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float))
        and math.isfinite(softmax_scale)
        and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if inv_freq is None:
        if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
            raise ValueError(f"theta must be a positive finite number, got {theta!r}")
    else:
        check_inv_freq(inv_freq, rope_dim)
        check_same_device(q=q, inv_freq=inv_freq)
    _check_positions(positions, "positions", B, NK, device)
    _check_positions(q_positions, "q_positions", B, NQ, device)
    if q_positions is None and positions is not None and NQ > NK:
        raise ValueError(
            f"NQ={NQ} > NK={NK}: queries cannot take the last NQ key positions; pass q_positions"
        )
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    # SDPA returns no lse, and a causal query that sees no key (NQ > NK) has no SDPA kernel
    # that returns the fused kernel's 0 for it.
    separate_applies = not return_lse and (NQ <= NK or not causal)
    fused_fits = D <= MAX_HEAD_DIM and B * HQ <= 65535  # the grid's second axis: B x HQ
    if impl == "auto":  # the faster path wherever it applies (README: measured on H100 and H200)
        bottom_right = causal and NQ != NK
        fast = separate_applies and (not bottom_right or _sdpa_has_lower_right_kernel(q, k, v))
        # Where the fused kernel cannot run, SDPA's materialized mask beats an error (not
        # under compile, which cannot trace that mask).
        fallback = separate_applies and not fused_fits and not torch.compiler.is_compiling()
        impl = "separate" if fast or fallback else "fused"
    if impl == "separate" and separate_applies and causal and NQ != NK:
        if torch.compiler.is_compiling():
            raise ValueError(
                "impl='separate' with causal NQ != NK needs SDPA's bottom-right mask object, "
                "which torch.compile cannot trace; use impl='auto' or 'fused' under compile"
            )
    if impl == "separate" and not separate_applies:
        raise ValueError(
            f"impl='separate' runs PyTorch's SDPA, which returns no lse and has no kernel for "
            f"causal queries that see no key: it needs return_lse=False and NQ <= NK when "
            f"causal, got return_lse={return_lse}, NQ={NQ}, NK={NK}, causal={causal}"
        )
    if impl == "fused" and not fused_fits:
        if D > MAX_HEAD_DIM:
            raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {D}")
        raise ValueError(f"batch x query heads must be at most 65535, got {B} x {HQ}")
    check_kernel_device(device, "q")
    return rope_dim, impl


def rope_attention(
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
    return_lse: bool = False,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention with RoPE on q and k: this package's Triton RoPE kernel then PyTorch's SDPA,
    or RoPE applied inside a FlashAttention-2 Triton kernel (``impl``).

    ``softmax(scale * R(q) R(k)^T + mask) v`` where ``R`` rotates the first ``rope_dim``
    channels by ``position * inv_freq`` (as ``fused_rope.naive.apply_rope_ref``).

    Args:
        q: ``[B, HQ, NQ, D]`` fp16, bf16 or fp32 (the fused kernel: ``D <= 256``,
            ``B * HQ <= 65535``).
        k, v: ``[B, HKV, NK, D]``, same dtype; ``HQ`` a multiple of ``HKV`` (GQA, MQA).
        theta: RoPE base, used when ``inv_freq`` is None.
        inv_freq: ``[rope_dim // 2]`` inverse frequencies (scaled schedules); overrides theta.
        positions: the keys' positions, ``[NK]`` or ``[B, NK]``, integer or float
            (default ``0..NK-1``).
        q_positions: ``[NQ]`` or ``[B, NQ]``; default: the last NQ entries of ``positions``
            (for the default positions and ``NQ > NK``: ``NK-NQ..NK-1``).
        causal: query ``i`` sees key ``j`` iff ``j <= i + NK - NQ`` (bottom-right aligned,
            by index, as FlashAttention-2). A query that sees no key returns 0.
        softmax_scale: default ``1/sqrt(D)``.
        layout: ``"half"`` (GPT-NeoX, Llama) or ``"interleaved"`` (GPT-J).
        rope_dim: rotated channels (even, default D); the rest pass through.
        return_lse: also return the natural-log log-sum-exp ``[B, HQ, NQ]`` fp32
            (``-inf`` for a query that sees no key); it is differentiable.
        impl: ``"fused"``: the fused kernel. ``"separate"``: the Triton RoPE kernel over q and k
            (``fused_rope.rope``) then PyTorch's SDPA, with a bottom-right causal mask
            (``causal_lower_right``) when ``NQ < NK``; needs ``return_lse=False`` and, when
            causal, ``NQ <= NK``. ``"auto"``: "separate" where it applies and, for ``NQ < NK``
            causal, where SDPA has a kernel for the bottom-right mask (FlashAttention-2's or the
            memory-efficient one, not a materialized ``NQ x NK`` mask); else the fused kernel,
            unless the fused kernel cannot run (``D > 256``, ``B * HQ > 65535``). "separate"
            was the faster path at every benchmarked shape, dtype and pass on an H100 and an
            H200 (see the README). Under ``torch.compile``, which cannot trace SDPA's
            bottom-right mask, causal ``NQ != NK`` takes the fused kernel with "auto" (so its
            result may differ from eager mode's in the last bits) and raises with "separate".

    Returns:
        ``o [B, HQ, NQ, D]`` in q's dtype, or ``(o, lse)``.
    """
    rope_dim, impl = _check_inputs(
        q,
        k,
        v,
        theta,
        inv_freq,
        positions,
        q_positions,
        causal,
        softmax_scale,
        layout,
        rope_dim,
        return_lse,
        impl,
    )
    B, HQ, NQ, D = q.shape
    NK = k.shape[2]
    if inv_freq is None:
        inv_freq = default_inv_freq(rope_dim, float(theta), q.device)
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)
    if impl == "separate":
        return _rope_then_sdpa(
            q, k, v, inv_freq, positions, q_positions, causal, scale, layout, rope_dim
        )
    if positions is None and q_positions is None:
        q_pos = k_pos = None  # the kernels generate 0..NK-1 and NK-NQ..NK-1 themselves
    else:
        q_pos = _as_rows(_query_positions(positions, q_positions, NQ, NK, q.device))
        k_pos = _as_rows(torch.arange(NK, device=q.device) if positions is None else positions)
    o, lse = _fwd_op(
        q, k, v, inv_freq, q_pos, k_pos, causal, scale, layout == "interleaved", rope_dim
    )
    return (o, lse) if return_lse else o
