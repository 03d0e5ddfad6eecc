"""Co-RoPE-GQA forward in Triton: one streaming pass, O(N) memory (design: corope/README.md).

One program owns ``BLOCK_M`` query positions of one KV group and ALL ``G`` query heads of
that group, packed as ``BLOCK_GM = G_PAD * BLOCK_M`` columns (head-major) of key-major tiles
``[BLOCK_N, BLOCK_GM]``, so that the gate logits (``k @ q^T``) and ``O^T += V^T @ P^T`` are
single tensor-core products. It sweeps the key tiles from the diagonal DOWN to tile 0, so the
mileage of a key is a running suffix sum of the gates:

    delta[i, j] = carry[i] + local[i, j]
    carry[i]    = sum of z[i, t] over the tiles already swept (t above the current tile), fp64
    local[i, j] = exclusive suffix sum of z[i, t] inside the current tile  (0 <= local < BLOCK_N)

The phase ``delta * w`` is formed as ``(carry * w mod 2 pi) + local * w``: the large part is
reduced in fp64 once per (query, frequency) and tile, so the per-pair fast sin/cos (one per
(query, key, frequency), shared by the G heads) only sees arguments below ``2 pi + BLOCK_N w``
and the phase error does not grow with N.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        # The interpreter runs every config it is given; one small one keeps the CPU tests quick.
        return [triton.Config({"BLOCK_GM": 64, "BLOCK_N": 32}, num_warps=4)]
    return [
        triton.Config({"BLOCK_GM": gm, "BLOCK_N": bn}, num_warps=nw, num_stages=1)
        # Few configs: each is compiled per (G_PAD, D, R, dtype) key. ptxas (sm_90a, bf16,
        # D = 128, G = 4): 221 registers and no spill at (64, 64, 8); 255 and a few bytes at 4 warps.
        for gm, bn, nw in ((64, 64, 4), (64, 64, 8), (128, 64, 8))
    ]


def _prune(configs, named_args, **kwargs):
    # BLOCK_M = BLOCK_GM / G_PAD >= 8 puts the head bits of a column index in the registers of
    # the MMA layout: a thread holds all G heads of its (key, query) pairs, so no thread
    # recomputes another's sin/cos. BLOCK_M >= 1 is required.
    g_pad = kwargs.get("G_PAD", named_args.get("G_PAD"))
    for min_rows in (8, 1):
        kept = [c for c in configs if c.kwargs["BLOCK_GM"] >= min_rows * g_pad]
        if kept:
            return kept
    return [triton.Config({"BLOCK_GM": g_pad, "BLOCK_N": 64}, num_warps=4)]


@triton.jit
def _cos_sin(x, FAST_TRIG: tl.constexpr):
    # The hardware approximations (one special-function op each) are accurate to ~1e-6 for the
    # small arguments they get here; the interpreter has only the libm versions.
    if FAST_TRIG:
        return libdevice.fast_cosf(x), libdevice.fast_sinf(x)
    return tl.cos(x), tl.sin(x)


@triton.autotune(
    configs=_configs(),
    key=["G_PAD", "HEAD_DIM", "ROPE_DIM"],  # and the tensors' dtypes, which autotune adds
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _corope_fwd_kernel(
    Q, K, V, QT, KT, W, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tqb, stride_tqh, stride_tqd, stride_tqn,
    stride_tkb, stride_tkh, stride_tkd, stride_tkn,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    HKV, N, gate_scale, qk_scale,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    LEADER_MEAN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    BLOCK_GM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_GM // G_PAD
    HALF: tl.constexpr = ROPE_DIM // 2
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // HKV
    g = pid_bg % HKV
    m0 = pid_m * BLOCK_M

    # Tiles are key-major: [BLOCK_N keys, BLOCK_GM packed query columns], column
    # c = hh * BLOCK_M + ii is head g * G + hh at position m0 + ii. In the MMA accumulator
    # layout the high column bits (the head) sit in registers, so each thread holds every
    # head of its (key, query) pairs and the per-pair sin/cos is computed once for all G.
    cols = tl.arange(0, BLOCK_GM)
    cols_h = cols // BLOCK_M
    cols_i = m0 + cols % BLOCK_M
    col_ok = (cols_h < G) & (cols_i < N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_t = tl.load(
        Q + b * stride_qb + (g * G + cols_h)[None, :] * stride_qh
        + cols_i[None, :] * stride_qn + offs_d[:, None] * stride_qd,
        mask=col_ok[None, :], other=0.0,
    )  # [D, BLOCK_GM]
    if ROPE_DIM < HEAD_DIM:
        q_pass = tl.where(offs_d[:, None] >= ROPE_DIM, q_t, tl.zeros_like(q_t))

    # The same columns as [G_PAD, BLOCK_M], for the per-frequency loads of the query.
    offs_h = tl.arange(0, G_PAD)
    offs_i = m0 + tl.arange(0, BLOCK_M)
    qcol_ok = (offs_h < G)[:, None] & (offs_i < N)[None, :]
    qt_base = QT + b * stride_tqb + (g * G + offs_h)[:, None] * stride_tqh + offs_i[None, :] * stride_tqn

    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    kt_base = KT + b * stride_tkb + g * stride_tkh

    m_i = tl.full([BLOCK_GM], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_GM], tl.float32)
    acc = tl.zeros([HEAD_DIM, BLOCK_GM], tl.float32)  # o transposed
    # fp64: the carry reaches N, and its phase carry * w is reduced modulo 2 pi exactly.
    carry = tl.zeros([BLOCK_M], tl.float64)
    two_pi = tl.full([BLOCK_M], 6.283185307179586, tl.float64)
    inv_two_pi = tl.full([BLOCK_M], 0.15915494309189535, tl.float64)

    # Key tiles from the one holding the last key any of these rows sees, down to tile 0.
    n_tiles = (tl.minimum(N, m0 + BLOCK_M) + BLOCK_N - 1) // BLOCK_N
    for step in range(0, n_tiles):
        offs_j = (n_tiles - 1 - step) * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = offs_j < N
        k = tl.load(
            k_base + offs_j[:, None] * stride_kn + offs_d[None, :] * stride_kd,
            mask=key_ok[:, None], other=0.0,
        )  # [BLOCK_N, D]
        v = tl.load(
            v_base + offs_j[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=key_ok[:, None], other=0.0,
        )

        # Gate logits of every head; the leader's are the first head's or the heads' mean
        # (a sum of exact products, so "mean" needs no separate averaged query).
        u = tl.reshape(
            tl.dot(k, q_t, input_precision=DOT_PRECISION), [BLOCK_N, G_PAD, BLOCK_M]
        )
        if LEADER_MEAN:
            u_lead = tl.sum(u, axis=1) / G
        else:
            u_lead = tl.sum(tl.where(offs_h[None, :, None] == 0, u, 0.0), axis=1)
        causal = (offs_j[:, None] <= offs_i[None, :]) & key_ok[:, None]  # [BLOCK_N, BLOCK_M]
        z = tl.where(causal, tl.sigmoid(u_lead * gate_scale), 0.0)
        local = tl.cumsum(z, axis=0, reverse=True) - z

        s3 = tl.zeros([BLOCK_N, G_PAD, BLOCK_M], tl.float32)
        for d in range(HALF):
            w = tl.load(W + d)
            # carry * w reduced modulo 2 pi in fp64: the fp32 phase below stays below
            # 2 pi + BLOCK_N * w, where the fast sin/cos is accurate.
            ang = carry * w
            ang = (ang - two_pi * tl.floor(ang * inv_two_pi)).to(tl.float32)
            # The softmax scale and log2(e) folded into the query.
            q1 = tl.load(qt_base + d * stride_tqd, mask=qcol_ok, other=0.0).to(tl.float32)
            q2 = tl.load(qt_base + (d + HALF) * stride_tqd, mask=qcol_ok, other=0.0).to(tl.float32)
            q1 = q1 * qk_scale
            q2 = q2 * qk_scale
            k1 = tl.load(kt_base + d * stride_tkd + offs_j * stride_tkn, mask=key_ok, other=0.0)
            k2 = tl.load(kt_base + (d + HALF) * stride_tkd + offs_j * stride_tkn, mask=key_ok, other=0.0)
            k1 = k1.to(tl.float32)[:, None]
            k2 = k2.to(tl.float32)[:, None]
            cos_p, sin_p = _cos_sin(ang[None, :] + local * w, FAST_TRIG)
            # The key rotated by -delta * w: computed once, used by all G heads.
            kr1 = k1 * cos_p + k2 * sin_p
            kr2 = k2 * cos_p - k1 * sin_p
            s3 += kr1[:, None, :] * q1[None, :, :] + kr2[:, None, :] * q2[None, :, :]
        s = tl.reshape(s3, [BLOCK_N, BLOCK_GM])
        if ROPE_DIM < HEAD_DIM:
            s += tl.dot(k, q_pass, input_precision=DOT_PRECISION) * qk_scale
        mask = (offs_j[:, None] <= cols_i[None, :]) & key_ok[:, None]
        s = tl.where(mask, s, float("-inf"))

        # Online softmax in base 2 along the keys (axis 0). A column can be fully masked in
        # the first tile when BLOCK_M > BLOCK_N; its max stays -inf and is replaced by 0.
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha[None, :] + tl.dot(
            tl.trans(v), p.to(v.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new
        # Summed in fp64: fp32 tile sums would each round, a random walk of ~1e-4 at N = 64K.
        carry += tl.sum(z.to(tl.float64), axis=0)

    o_ptrs = (
        O + b * stride_ob + (g * G + cols_h)[None, :] * stride_oh
        + cols_i[None, :] * stride_on + offs_d[:, None] * stride_od
    )
    tl.store(o_ptrs, (acc / l_i[None, :]).to(O.dtype.element_ty), mask=col_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    lse_ptrs = LSE + b * stride_lb + (g * G + cols_h) * stride_lh + cols_i * stride_ln
    tl.store(lse_ptrs, lse, mask=col_ok)


def corope_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    softmax_scale: float,
    rope_dim: int,
    leader: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward kernel; inputs are assumed validated (``corope.attention``).

    Args:
        q: ``[B, HQ, N, D]``; k, v: ``[B, HKV, N, D]``; any strides (copied to a contiguous
            last dim when needed), fp16, bf16 or fp32, on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``). ``D`` in ``SUPPORTED_HEAD_DIMS``.
        inv_freq: ``[R/2]`` frequencies (any float dtype; used in fp32).
        softmax_scale: ``s``; scales the gate logits and the scores.
        rope_dim: ``R``, even, ``<= D``.
        leader: ``"first"`` or ``"mean"``.

    Returns:
        ``o`` ``[B, HQ, N, D]`` in q's dtype and ``lse`` ``[B, HQ, N]`` fp32, the natural-log
        log-sum-exp of the scaled scores over ``j <= i``.

    Besides o and lse, the launch allocates transposed copies of q and k (``[B, H, D, N]``,
    so that one frequency's column over consecutive positions is a contiguous load).
    """
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    G = HQ // HKV
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    qt = q.transpose(-1, -2).contiguous()
    kt = k.transpose(-1, -2).contiguous()
    w = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, HQ, N), device=q.device, dtype=torch.float32)
    if N == 0 or B == 0 or HQ == 0:
        return o, lse
    g_pad = triton.next_power_of_2(G)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_GM"] // g_pad), B * HKV)
    _corope_fwd_kernel[grid](
        q, k, v, qt, kt, w, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *qt.stride(), *kt.stride(), *o.stride(),
        *lse.stride(),
        HKV, N, softmax_scale, softmax_scale * LOG2E,
        G=G, G_PAD=g_pad, HEAD_DIM=D, ROPE_DIM=rope_dim, LEADER_MEAN=leader == "mean",
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FAST_TRIG=not _INTERPRET,
    )
    return o, lse


__all__ = ["SUPPORTED_HEAD_DIMS", "corope_fwd"]
