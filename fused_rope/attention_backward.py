"""The fused RoPE attention backward: a preprocess (``Delta``, lse in base 2), a key-major dK/dV
kernel over the query heads of a KV head's group and a query-major dQ kernel, each un-rotating
its gradient at the end (``_attention_common.py`` has the design and the shared helpers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_rope._attention_common import (
    _AUTOTUNE_KEY,
    _INTERPRET,
    _SIZES,
    _configs,
    _key_ranges,
    _load_cos_sin,
    _load_segments,
    _meta,
    _prune_for,
    _query_program,
    _rope_tables,
    _rotated_segments,
    _scores,
    _sectioned_program,
    _store_rotated,
    _strides,
    _visible,
    heads_per_section,
    query_fold,
)
from fused_rope._intmath import cdiv

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
        (128, 64, 8, 3),
        (128, 64, 8, 2),
        (128, 32, 8, 3),
        (64, 64, 8, 2),
        (64, 32, 4, 3),
        (64, 32, 4, 2),
    ]
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
    offs_n,
    n_mask,
    lo,
    n_tiles,
    offset,
    window,
    NQ,
    h0,
    GROUP,
    NQ_HEAD,
    stride_qh,
    stride_qn,
    stride_doh,
    stride_don,
    stride_dod,
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
            q1, q2, qp = _load_segments(
                Q + h * stride_qh,
                offs_m,
                m_mask,
                stride_qn,
                BLOCK_M,
                HEAD_DIM,
                ROPE_DIM,
                HALF,
                PASS,
            )
            do = tl.load(
                DO + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                mask=m_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0,
            )
            # rows past NQ: do = 0 and Delta = 0, so they add nothing to dK, dV
            lse2 = tl.load(LSE2 + h * NQ_HEAD + offs_m, mask=m_mask, other=0.0)
            delta = tl.load(DELTA + h * NQ_HEAD + offs_m, mask=m_mask, other=0.0)
            s_t = _scores(k1, k2, kp, q1, q2, qp, HEAD_DIM > ROPE_DIM, INPUT_PRECISION, SCORE_SCALE)
            p_t = tl.exp2(s_t - lse2[None, :])
            if MASKED:  # transposed: keys are rows
                keep = _visible(
                    n_mask[:, None], offs_m[None, :], offs_n[:, None], offset, window, CAUSAL,
                    WINDOWED,
                )  # fmt: skip
                p_t = tl.where(keep, p_t, 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            ds_t = (p_t * (dp_t - delta[None, :])).to(q1.dtype)
            dk1 = tl.dot(ds_t, q1, dk1, input_precision=INPUT_PRECISION)
            dk2 = tl.dot(ds_t, q2, dk2, input_precision=INPUT_PRECISION)
            if HEAD_DIM > ROPE_DIM:
                dkp = tl.dot(ds_t, qp, dkp, input_precision=INPUT_PRECISION)
    return dk1, dk2, dkp, dv


@triton.autotune(configs=_DKDV_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=_prune_for("BLOCK_N"))
@triton.jit(do_not_specialize=[*_SIZES, "k_row_off"])
def _rope_attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    KCOS,
    KSIN,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
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
    stride_ktb,
    k_row_off,
    HKV,
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
    # the first key tiles see the most queries: the grid launches them first
    pid_n, pid_bh = _sectioned_program(tl.cdiv(NK, BLOCK_N), SECTION, False)
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
    KCOS += b * stride_ktb + k_row_off * HALF
    KSIN += b * stride_ktb + k_row_off * HALF
    offset = NK - NQ

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < NK
    k1, k2, kp = _load_segments(
        K, offs_n, n_mask, stride_kn, BLOCK_N, HEAD_DIM, ROPE_DIM, HALF, PASS
    )
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
    if WINDOWED:  # causal only
        # queries before start_n - offset + window have all the tile's keys in their window;
        # from start_n + BLOCK_N - 1 - offset + window on, none: the band between is masked
        free_end = tl.maximum(tl.minimum(start_n - offset + window, NQ), free_lo)
        n_free = (free_end - free_lo) // BLOCK_M
        tail_lo = free_lo + n_free * BLOCK_M
        tail_end = tl.maximum(tl.minimum(start_n + BLOCK_N - 1 - offset + window, NQ), tail_lo)
        n_tail = tl.cdiv(tail_end - tail_lo, BLOCK_M)
    else:
        n_free = tl.cdiv(tl.maximum(NQ - free_lo, 0), BLOCK_M)
        tail_lo = 0
        n_tail = 0
    # The diagonal band of query tiles (masked), those that see the whole key tile, then the
    # window's edge (masked; windowed only).
    for part in tl.static_range(3):  # a constexpr
        if WINDOWED or part < 2:
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
                offs_n,
                n_mask,
                lo if part == 0 else (free_lo if part == 1 else tail_lo),
                n_masked if part == 0 else (n_free if part == 1 else n_tail),
                offset,
                window,
                NQ,
                h0,
                GROUP,
                NQ,
                stride_qh,
                stride_qn,
                stride_doh,
                stride_don,
                stride_dod,
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
                BLOCK_M,
            )

    DK += b * stride_dkb + hk * stride_dkh
    DV += b * stride_dvb + hk * stride_dvh
    # Q carried softmax_scale * log2(e) / SCORE_SCALE; ln 2 * SCORE_SCALE turns dS^T Q_folded
    # into softmax_scale dS^T Q_rot
    # the rotation by -theta is (cos, -sin)
    cos, sin = _load_cos_sin(KCOS, KSIN, offs_n, n_mask, HALF)
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
        -sin,
        0.6931471805599453 * SCORE_SCALE,
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
    """Accumulates dQ (w.r.t. the rotated segments) over key tiles ``[lo, hi)``."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NK
        k1, k2, kp = _load_segments(
            K, offs_n, n_mask, stride_kn, BLOCK_N, HEAD_DIM, ROPE_DIM, HALF, PASS
        )
        v = tl.load(
            V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=n_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )
        s = _scores(q1, q2, qp, k1, k2, kp, HEAD_DIM > ROPE_DIM, INPUT_PRECISION, SCORE_SCALE)
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            keep = _visible(
                n_mask[None, :], offs_m[:, None], offs_n[None, :], offset, window, CAUSAL, WINDOWED
            )
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(k1.dtype)
        dq1 = tl.dot(ds, k1, dq1, input_precision=INPUT_PRECISION)
        dq2 = tl.dot(ds, k2, dq2, input_precision=INPUT_PRECISION)
        if HEAD_DIM > ROPE_DIM:
            dqp = tl.dot(ds, kp, dqp, input_precision=INPUT_PRECISION)
    return dq1, dq2, dqp


@triton.autotune(configs=_DQ_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by=_prune_for("BLOCK_M"))
@triton.jit(do_not_specialize=[*_SIZES, "q_row_off"])
def _rope_attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
    QCOS,
    QSIN,
    softmax_scale,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
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
    DO += b * stride_dob + h * stride_doh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    QCOS += b * stride_qtb + q_row_off * HALF
    QSIN += b * stride_qtb + q_row_off * HALF
    offset = NK - NQ

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_mask = offs_m < NQ
    q1, q2, qp = _load_segments(
        Q, offs_m, m_mask, stride_qn, BLOCK_M, HEAD_DIM, ROPE_DIM, HALF, PASS
    )
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
    lo, full_lo, full_end, hi = _key_ranges(
        start_m, offset, NK, window, CAUSAL, WINDOWED, BLOCK_M, BLOCK_N
    )
    # The window's edge (masked; windowed only), the key tiles every query of the tile sees (no
    # mask arithmetic), then the diagonal ones (masked), as in the forward.
    for part in tl.static_range(3):  # a constexpr
        if WINDOWED or part > 0:
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

    DQ += b * stride_dqb + h * stride_dqh
    # dS K_rot is the gradient w.r.t. the natural-log scores' Q_rot / softmax_scale
    cos, sin = _load_cos_sin(QCOS, QSIN, offs_m, m_mask, HALF)
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
        -sin,
        softmax_scale,
        BLOCK_M,
        HEAD_DIM,
        ROPE_DIM,
        HALF,
        PASS,
        INTERLEAVED,
    )


def rope_attention_bwd(
    do, q, k, v, o, lse, dlse, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim,
    attention_factor=1.0, window=0,
):  # fmt: skip
    """Launches the backward: preprocess, dK/dV (key-major, no atomics: each program loops
    over the query heads of its KV head's group) and dQ (query-major); the forward's
    ``attention_factor`` in the tables that rotate q and k and back-rotate dq and dk; the
    forward's ``window`` (0: none).
    Returns ``dq, dk, dv`` shaped like ``q, k, v``."""
    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    q_fold, score_scale = query_fold(softmax_scale, q.dtype)
    meta = _meta(D, rope_dim, interleaved, causal, q.dtype, score_scale, window)
    delta = torch.empty((B, HQ, NQ), device=q.device, dtype=torch.float32)
    lse2 = lse.clone()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.float().contiguous()
    pre_block = 64 if not _INTERPRET else 32
    _bwd_preprocess_kernel[(cdiv(NQ, pre_block), B * HQ)](
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
    q_cos, q_sin, k_cos, k_sin, stride_qtb, stride_ktb, q_row_off, k_row_off = _rope_tables(
        inv_freq, q_pos, k_pos, NQ, NK, meta["HALF"], q.dtype, attention_factor
    )
    # q (with the forward's fold) and k rotated once: the kernels' loops would rotate every
    # tile once per program that streams it
    q_rot = _rotated_segments(q, q_cos, q_sin, stride_qtb, q_row_off, q_fold, meta)
    k_rot = _rotated_segments(k, k_cos, k_sin, stride_ktb, k_row_off, 1.0, meta)
    _rope_attn_bwd_dkdv_kernel[lambda m: (cdiv(NK, m["BLOCK_N"]) * B * HKV,)](
        q_rot,
        k_rot,
        v,
        do,
        lse2,
        delta,
        dk,
        dv,
        k_cos,
        k_sin,
        *q_rot.stride()[:3],
        *k_rot.stride()[:3],
        *_strides(v),
        *_strides(do),
        *_strides(dk),
        *_strides(dv),
        stride_ktb,
        k_row_off,
        HKV,
        HQ // HKV,
        NQ,
        NK,
        window,
        heads_per_section(NQ * (q_rot.shape[3] + D) * q.element_size() * HQ // HKV, "key"),
        **meta,
    )
    _rope_attn_bwd_dq_kernel[lambda m: (cdiv(NQ, m["BLOCK_M"]) * B * HQ,)](
        q_rot,
        k_rot,
        v,
        do,
        lse2,
        delta,
        dq,
        q_cos,
        q_sin,
        softmax_scale,
        *q_rot.stride()[:3],
        *k_rot.stride()[:3],
        *_strides(v),
        *_strides(do),
        *_strides(dq),
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
    return dq, dk, dv
