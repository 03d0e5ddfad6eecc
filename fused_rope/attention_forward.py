"""The fused RoPE attention forward: FlashAttention-2 with q rotated once per query tile in
registers and k rotated once per call by a small pass (``_attention_common.py`` has the design
and the shared helpers).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fused_rope._attention_common import (
    _AUTOTUNE_KEY,
    _SIZES,
    _configs,
    _key_ranges,
    _load_segments,
    _meta,
    _prune_for,
    _query_program,
    _query_tile,
    _rope_tables,
    _rotated_segments,
    _scores,
    _strides,
    _visible,
    heads_per_section,
    query_fold,
    rotated_width,
)
from fused_rope._device import compute_capability
from fused_rope._intmath import cdiv

_FWD_CONFIGS = _configs(
    [
        (128, 128, 8, 3),
        (128, 64, 8, 3),
        (128, 32, 8, 3),
        (128, 128, 8, 2),
        (64, 32, 4, 3),
        (64, 64, 4, 2),
    ]
)


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
    offs_m,
    lo,
    hi,
    offset,
    NK,
    window,
    stride_kn,
    stride_vn,
    stride_vd,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SCORE_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online softmax over key tiles ``[lo, hi)``; only MASKED calls pay for the mask."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NK
        k1, k2, kp = _load_segments(
            K, offs_n, n_mask, stride_kn, BLOCK_N, HEAD_DIM, ROPE_DIM, HALF, PASS
        )
        s = _scores(q1, q2, qp, k1, k2, kp, HEAD_DIM > ROPE_DIM, INPUT_PRECISION, SCORE_SCALE)
        if MASKED:
            keep = _visible(
                n_mask[None, :], offs_m[:, None], offs_n[None, :], offset, window, CAUSAL, WINDOWED
            )
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if MASKED:
            # A row with no visible key so far keeps m = -inf (a window's first tile can hide
            # every key from a row that sees keys in the next one: a maximum of 0 taken there
            # would leave its probabilities unnormalized, and those of scores below -24 would
            # round to 0 in fp16), but exp2 must not see -inf - -inf.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
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
@triton.jit(do_not_specialize=[*_SIZES, "q_row_off"])
def _rope_attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    QCOS,
    QSIN,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_qtb,
    q_row_off,
    HQ,
    GROUP,
    NQ,
    NK,
    window,
    SECTION,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SCORE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, b, h, hk = _query_program(NQ, HQ, GROUP, SECTION, BLOCK_M)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    O += b * stride_ob + h * stride_oh
    QCOS += b * stride_qtb + q_row_off * HALF
    QSIN += b * stride_qtb + q_row_off * HALF
    offset = NK - NQ

    start_m = pid_m * BLOCK_M
    offs_m, m_mask, q1, q2, qp = _query_tile(
        Q, QCOS, QSIN, start_m, NQ, stride_qn, stride_qd, qk_scale,
        BLOCK_M, HEAD_DIM, ROPE_DIM, HALF, PASS, INTERLEAVED,
    )  # fmt: skip

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    lo, full_lo, full_end, hi = _key_ranges(
        start_m, offset, NK, window, CAUSAL, WINDOWED, BLOCK_M, BLOCK_N
    )
    # The window's edge (masked; windowed only), the key tiles every query of the tile sees (no
    # mask arithmetic), then the diagonal ones (masked).
    for part in tl.static_range(3):  # a constexpr
        if WINDOWED or part > 0:
            acc, l_i, m_i = _fwd_inner(
                acc,
                l_i,
                m_i,
                q1,
                q2,
                qp,
                K,
                V,
                offs_m,
                lo if part == 0 else (full_lo if part == 1 else full_end),
                full_lo if part == 0 else (full_end if part == 1 else hi),
                offset,
                NK,
                window,
                stride_kn,
                stride_vn,
                stride_vd,
                part != 1,
                CAUSAL,
                WINDOWED,
                HEAD_DIM,
                ROPE_DIM,
                HALF,
                PASS,
                BLOCK_D,
                INPUT_PRECISION,
                SCORE_SCALE,
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


# The Triton release whose Gluon the Hopper forward was written and tested against: Gluon is
# experimental and its API moves between releases, so other versions take the Triton forward.
GLUON_TRITON_VERSION = "3.6."
# FUSED_ROPE_GLUON=0 at import, or GLUON_ENABLED = False at run time, turns the Hopper forward
# off (A/B runs, or a Triton build it fails on). A module constant, not an environment read
# per call: torch.compile traces "auto"'s dispatch, which reads it.
GLUON_ENABLED = os.environ.get("FUSED_ROPE_GLUON", "1") != "0"
HOPPER_CTA_ROWS = 128  # query rows a CTA of the Gluon forward (two warpgroups of 64)
# Below 2K tokens the Triton forward is the faster (an H200, Small-1K: the Gluon one takes
# 1.03x its time; 0.79-0.85x from 2K on: README, sessions 55-56).
HOPPER_MIN_N = 2048


def gluon_forward_available(device: torch.device) -> bool:
    """Whether the Gluon forward (``attention_forward_hopper.py``) can run on ``device``: a
    Hopper GPU (sm_90; not ROCm, whose "cuda" devices can report 9.0 too), the Triton release
    it was tested with, and ``GLUON_ENABLED``."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and GLUON_ENABLED
        and triton.__version__.startswith(GLUON_TRITON_VERSION)
        and compute_capability(device) == (9, 0)
    )


def hopper_forward_takes(q, k, rope_dim: int, interleaved: bool, softmax_scale: float) -> bool:
    """Whether the Gluon forward takes ``q [B, HQ, NQ, D]``, ``k [B, HKV, NK, D]`` with these
    options (any positions and tables, either layout): fp16/bf16, D in {64, 128, 256}, rotated
    channels whose segments fill the head (``rotated_width``: every channel, or a power of two
    of at least 32 with a power-of-two rest, as 64 of 128), ``NQ <= NK`` (any lengths) with at
    least ``HOPPER_MIN_N`` keys, any causal sliding window, the whole softmax scale folded
    into Q, and a GPU that has it (``gluon_forward_available``)."""
    NQ, D = q.shape[2:]
    return (
        q.numel() > 0  # TMA descriptors of an empty tensor fail before an empty grid is skipped
        and q.dtype in (torch.float16, torch.bfloat16)
        and D in (64, 128, 256)
        and rotated_width(D, rope_dim) == D  # k_rot's rows are D wide, as v's
        and NQ <= k.shape[2]
        and k.shape[2] >= HOPPER_MIN_N
        and query_fold(softmax_scale, q.dtype)[1] == 1.0
        and gluon_forward_available(q.device)
    )


def rope_attention_fwd(
    q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim,
    attention_factor=1.0, window=0,
):  # fmt: skip
    """Launches the forward. ``q_pos``, ``k_pos``: fp32 positions ``[1 | B, N]`` or angles
    ``[1 | B, N, R/2]``, contiguous, or both None for the default positions (``_rope_tables``);
    ``attention_factor`` scales the rotated channels (the tables' cos and sin); ``window``: a
    causal sliding window of that many keys (0: none). On Hopper the calls that
    ``hopper_forward_takes`` run the Gluon forward (``attention_forward_hopper.py``) after the
    same tables and k pass.
    Returns ``o [B, HQ, NQ, D]`` in q's dtype and ``lse [B, HQ, NQ]`` fp32 (natural log)."""
    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    q_fold, score_scale = query_fold(softmax_scale, q.dtype)
    meta = _meta(D, rope_dim, interleaved, causal, q.dtype, score_scale, window)
    q_cos, q_sin, k_cos, k_sin, stride_qtb, stride_ktb, q_row_off, k_row_off = _rope_tables(
        inv_freq, q_pos, k_pos, NQ, NK, meta["HALF"], q.dtype, attention_factor
    )
    # k rotated once: the key loop would rotate every key tile once per query tile
    k_rot = _rotated_segments(k, k_cos, k_sin, stride_ktb, k_row_off, 1.0, meta)
    lse = torch.empty((B, HQ, NQ), device=q.device, dtype=torch.float32)
    if hopper_forward_takes(q, k, rope_dim, interleaved, softmax_scale):
        from fused_rope.attention_forward_hopper import RopeArgs, rope_attention_fwd_hopper

        rope = RopeArgs(q_cos, q_sin, lse, q_fold, q_row_off, stride_qtb, rope_dim, interleaved)
        # default positions: table row p holds position p (its first row is position 0 where
        # NQ <= NK, which the Gluon path has)
        range_factor = attention_factor if q_pos is None and attention_factor != 0 else None
        return rope_attention_fwd_hopper(q, k_rot, v, causal, rope, range_factor, window), lse
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    grid = lambda m: (cdiv(NQ, m["BLOCK_M"]) * B * HQ,)
    _rope_attn_fwd_kernel[grid](
        q,
        k_rot,
        v,
        o,
        lse,
        q_cos,
        q_sin,
        q_fold,
        *_strides(q),
        *k_rot.stride()[:3],
        *_strides(v),
        *_strides(o),
        stride_qtb,
        q_row_off,
        HQ,
        HQ // HKV,
        NQ,
        NK,
        window,
        heads_per_section(NK * (k_rot.shape[3] + D) * k.element_size() * HKV // HQ, "query"),
        **meta,
    )
    return o, lse
