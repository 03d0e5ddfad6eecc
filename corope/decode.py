"""Co-RoPE-GQA decoding: one new query row per head against a KV cache, in Triton.

A decoding step has one query row, at the last position ``NK - 1``, per head. The training
forward would give each KV group a single program that walks the cache in order, leaving the
GPU idle; the PyTorch reference takes about 30 small kernels a layer, which bound a step by
the host. Here the cache's keys, in blocks of ``BLOCK_N``, are split into runs of consecutive
blocks that programs take in parallel (split-K, as FlashDecoding; ``decode_splits`` sizes
the runs for about ``PROGRAMS_PER_SM`` programs per SM), in three launches:

1. ``_gate_sums_kernel`` (a program per (group, split)): the leader's gates
   ``z[t] = sigmoid(s <qL, k[t]>)`` of the split's keys, summed.
2. ``_split_kernel`` (the same grid): a key's mileage ``delta[j] = sum_{t > j} z[t]`` is the
   gate sums of the splits after its own (added in fp64), plus those of the blocks after its
   own in the split (the loop runs from the split's last block to its first, adding each
   block's sum to the carry), plus the suffix sum inside its block; then the phases, the
   rotated keys, every head's scores and an online softmax over the split's blocks, whose
   partials (row max, sum of ``exp``, unnormalised output) it stores.
3. ``_combine_kernel`` (a program per (group, head)): the partials merged into ``o``.

The phase is formed as in the training forward: ``(carry w mod 2 pi)`` reduced in fp64 once
per block and frequency, plus ``local w`` with ``local < BLOCK_N``, so the per-pair sin/cos
sees small arguments and the phase error does not grow with the cache. The rotated keys and
the softmax weights are rounded to the inputs' dtype before their products, as the training
forward rounds them, so a half-precision cache takes tensor-core products (the group padded
to 16 rows) and fp32 takes IEEE ones. Times against SDPA's decoding kernel and the bytes
floor: ``corope/README.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corope.forward import check_index_span, check_rotation
from fused_rope._attention_common import segment_dims
from fused_rope._device import num_sms
from fused_rope._intmath import cdiv, next_power_of_2
from fused_rope._trig import cos_sin, fast_trig

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys a program
PROGRAMS_PER_SM = 8  # the splits of the keys aim at this many programs per SM
NUM_STAGES = 2  # software pipelining of a split's loop over its blocks
# tl.dot's least M, N and K: the heads, the rotary halves and the pass-through channels
# are padded to it (zero rows and columns).
MIN_DOT = 16


@triton.jit
def _leader_query(q_group, stride_qh, offs_d, G: tl.constexpr, G_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, LEADER_MEAN: tl.constexpr):  # fmt: skip
    """``qL`` ``[D_PAD]`` fp32: the group's first query head, or the mean of its ``G``."""
    offs_h = tl.arange(0, G_PAD)
    heads = tl.load(
        q_group + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=(offs_h < G)[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    ).to(tl.float32)
    if LEADER_MEAN:
        return tl.sum(heads, axis=0) / G
    return tl.sum(tl.where((offs_h == 0)[:, None], heads, 0.0), axis=0)


@triton.jit
def _block_gates(q_lead, k_group, stride_kn, blk, NK, gate_scale, HEAD_DIM: tl.constexpr,
                 D_PAD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The gates ``sigmoid(s <qL, k>)`` of block ``blk``'s keys: ``(z [BLOCK], the keys' row
    pointers [BLOCK, 1], the keys that exist [BLOCK])``, with ``z = 0`` past the cache."""
    offs_d = tl.arange(0, D_PAD)
    offs_j = blk * BLOCK + tl.arange(0, BLOCK)
    key_ok = offs_j < NK
    k_rows = k_group + offs_j[:, None] * stride_kn
    k = tl.load(k_rows + offs_d[None, :], mask=key_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    z = tl.where(key_ok, tl.sigmoid(tl.sum(k * q_lead[None, :], axis=1) * gate_scale), 0.0)
    return z, k_rows, key_ok


@triton.jit
def _gate_sums_kernel(
    Q, K, ZSUM,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn,
    HKV, NK, n_blocks, n_splits, blocks_per_split, gate_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    LEADER_MEAN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``ZSUM[bg, sp]`` fp64: the leader's gates over split ``sp``'s keys, summed per block in
    fp32 and across its blocks in fp64."""
    # A 1-D grid (group-major): its 2**31 - 1 programs bound no realistic cache, where a
    # second grid axis (at most 65535) would stop at 4M cached tokens.
    bg = tl.program_id(0) // n_splits
    sp = tl.program_id(0) % n_splits
    b = (bg // HKV).to(tl.int64)
    g = (bg % HKV).to(tl.int64)
    q_lead = _leader_query(Q + b * stride_qb + g * G * stride_qh, stride_qh, tl.arange(0, D_PAD),
                           G, G_PAD, HEAD_DIM, LEADER_MEAN)  # fmt: skip
    k_group = K + b * stride_kb + g * stride_kh
    first = sp * blocks_per_split
    total = tl.zeros([1], tl.float64)
    for blk in range(first, tl.minimum(first + blocks_per_split, n_blocks)):
        z, _, _ = _block_gates(q_lead, k_group, stride_kn, blk, NK, gate_scale, HEAD_DIM, D_PAD,
                               BLOCK)  # fmt: skip
        total += tl.sum(z, axis=0).to(tl.float64)
    tl.store(ZSUM + bg * n_splits + sp + tl.arange(0, 1), total)


@triton.jit
def _split_kernel(
    Q, K, V, W, ZSUM, M_PART, L_PART, O_PART,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    HKV, NK, n_blocks, n_splits, blocks_per_split, gate_scale, qk_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    ROPE_DIM: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
    LEADER_MEAN: tl.constexpr, FAST_TRIG: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK: tl.constexpr, SUM_CHUNK: tl.constexpr,
):  # fmt: skip
    """Split ``sp``'s softmax partials for the ``G`` heads of group ``bg``: ``M_PART`` and
    ``L_PART`` ``[bg, sp, G]`` (base-2 row max and sum of ``exp2``), ``O_PART``
    ``[bg, sp, G, HEAD_DIM]`` (the unnormalised output), all fp32; the grid as
    ``_gate_sums_kernel``'s. The split's blocks run from its last to its first, so that the
    carry (the gates of every later key) grows by each block's sum."""
    bg = tl.program_id(0) // n_splits
    sp = tl.program_id(0) % n_splits
    b = (bg // HKV).to(tl.int64)
    g = (bg % HKV).to(tl.int64)
    HALF: tl.constexpr = ROPE_DIM // 2
    offs_d = tl.arange(0, D_PAD)
    q_group = Q + b * stride_qb + g * G * stride_qh
    k_group = K + b * stride_kb + g * stride_kh
    v_group = V + b * stride_vb + g * stride_vh

    # The carry: the gates of every split after this one, summed in fp64 (it reaches NK).
    carry = tl.zeros([SUM_CHUNK], tl.float64)
    for c0 in range(sp + 1, n_splits, SUM_CHUNK):
        offs_c = c0 + tl.arange(0, SUM_CHUNK)
        carry += tl.load(ZSUM + bg * n_splits + offs_c, mask=offs_c < n_splits, other=0.0)
    carry = tl.sum(carry, axis=0)

    # The group's queries, loaded once: the leader's for the gates, every head's halves and
    # pass-through channels for the scores [G_PAD, BLOCK].
    q_lead = _leader_query(q_group, stride_qh, offs_d, G, G_PAD, HEAD_DIM, LEADER_MEAN)
    offs_f = tl.arange(0, HALF_PAD)
    f_ok = offs_f < HALF
    offs_h = tl.arange(0, G_PAD)
    h_ok = offs_h < G
    q_heads = q_group + offs_h[:, None] * stride_qh
    mask_q = h_ok[:, None] & f_ok[None, :]
    q1 = tl.load(q_heads + offs_f[None, :], mask=mask_q, other=0.0)
    q2 = tl.load(q_heads + HALF + offs_f[None, :], mask=mask_q, other=0.0)
    offs_p = ROPE_DIM + tl.arange(0, PASS_PAD)
    p_ok = offs_p < HEAD_DIM
    if ROPE_DIM < HEAD_DIM:
        qn = tl.load(q_heads + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    w = tl.load(W + offs_f, mask=f_ok, other=0.0)
    two_pi = tl.full([HALF_PAD], 6.283185307179586, tl.float64)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    first = sp * blocks_per_split
    last = tl.minimum(first + blocks_per_split, n_blocks) - 1
    for i in range(0, last - first + 1):
        blk = last - i
        z, k_rows, key_ok = _block_gates(q_lead, k_group, stride_kn, blk, NK, gate_scale,
                                         HEAD_DIM, D_PAD, BLOCK)  # fmt: skip
        local = tl.cumsum(z, axis=0, reverse=True) - z  # [BLOCK]: the gates after j in the block

        # The rotary halves, k rotated by -(carry + local) w: the carry's angle reduced in fp64.
        ang = carry * w.to(tl.float64)
        ang = (ang - two_pi * tl.floor(ang / two_pi)).to(tl.float32)
        cos_p, sin_p = cos_sin(ang[None, :] + local[:, None] * w[None, :], FAST_TRIG)
        mask_k = key_ok[:, None] & f_ok[None, :]
        k1 = tl.load(k_rows + offs_f[None, :], mask=mask_k, other=0.0).to(tl.float32)
        k2 = tl.load(k_rows + HALF + offs_f[None, :], mask=mask_k, other=0.0).to(tl.float32)
        # The rotated keys in the inputs' dtype, as the training forward rounds them: a half
        # precision cache takes tensor-core products, fp32 IEEE ones.
        kr1 = (k1 * cos_p + k2 * sin_p).to(Q.dtype.element_ty)
        kr2 = (k2 * cos_p - k1 * sin_p).to(Q.dtype.element_ty)
        s = tl.dot(q1, tl.trans(kr1), input_precision=DOT_PRECISION)
        s = tl.dot(q2, tl.trans(kr2), s, input_precision=DOT_PRECISION)
        if ROPE_DIM < HEAD_DIM:
            kn = tl.load(k_rows + offs_p[None, :], mask=key_ok[:, None] & p_ok[None, :],
                         other=0.0)  # fmt: skip
            s = tl.dot(qn, tl.trans(kn), s, input_precision=DOT_PRECISION)
        s = tl.where(key_ok[None, :], s * qk_scale, float("-inf"))

        # Online softmax in base 2; every block has at least one key, so m is finite after the
        # first (and exp2(-inf) = 0 drops the empty start).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_group + (blk * BLOCK + tl.arange(0, BLOCK))[:, None] * stride_vn
                    + offs_d[None, :], mask=key_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
                    other=0.0)  # fmt: skip
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v,
                                            input_precision=DOT_PRECISION)  # fmt: skip
        m_i = m_new
        carry += tl.sum(z, axis=0).to(tl.float64)  # as the gate sums: fp32 a block, then fp64
    # int64: B * HKV * n_splits * G * D can pass 2**31 for a large batch of long caches
    part = (bg * n_splits + sp).to(tl.int64) * G + offs_h
    tl.store(M_PART + part, m_i, mask=h_ok)
    tl.store(L_PART + part, l_i, mask=h_ok)
    tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=h_ok[:, None] & (offs_d < HEAD_DIM)[None, :])  # fmt: skip


@triton.jit
def _combine_kernel(
    M_PART, L_PART, O_PART, O,
    stride_ob, stride_oh,
    HKV, n_splits,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """``O[b, g * G + h, 0]``: head ``h``'s splits merged, ``sum exp2(m_s - m) o_s`` over
    ``sum exp2(m_s - m) l_s`` with ``m`` the largest ``m_s``."""
    bg = tl.program_id(0)
    h = tl.program_id(1)
    b = (bg // HKV).to(tl.int64)
    g = (bg % HKV).to(tl.int64)
    offs_c = tl.arange(0, CHUNK)
    m = tl.full([CHUNK], float("-inf"), tl.float32)
    for c0 in range(0, n_splits, CHUNK):
        ok = c0 + offs_c < n_splits
        part = (bg * n_splits + c0 + offs_c).to(tl.int64) * G + h
        m = tl.maximum(m, tl.load(M_PART + part, mask=ok, other=float("-inf")))
    m_all = tl.max(m, axis=0)
    offs_d = tl.arange(0, D_PAD)
    acc = tl.zeros([D_PAD], tl.float32)
    l_all = tl.zeros([CHUNK], tl.float32)
    for c0 in range(0, n_splits, CHUNK):
        ok = c0 + offs_c < n_splits
        part = (bg * n_splits + c0 + offs_c).to(tl.int64) * G + h
        scale = tl.where(ok, tl.exp2(tl.load(M_PART + part, mask=ok, other=0.0) - m_all), 0.0)
        l_all += scale * tl.load(L_PART + part, mask=ok, other=0.0)
        o_s = tl.load(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(scale[:, None] * o_s, axis=0)
    out = acc / tl.sum(l_all, axis=0)
    o_ptrs = O + b * stride_ob + (g * G + h) * stride_oh + offs_d
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_splits(n_blocks: int, groups: int, sms: int) -> tuple[int, int]:
    """``(n_splits, blocks_per_split)``: the cache's ``n_blocks`` key blocks of each of
    ``groups`` (batch x KV head) groups in consecutive runs of ``blocks_per_split``, one
    program each, about ``PROGRAMS_PER_SM`` programs per SM of the GPU's ``sms``, none empty
    (the last may be shorter)."""
    splits = min(n_blocks, max(1, cdiv(PROGRAMS_PER_SM * sms, groups)))
    per_split = cdiv(n_blocks, splits)
    return cdiv(n_blocks, per_split), per_split


def corope_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    softmax_scale: float,
    rope_dim: int,
    leader: str,
) -> torch.Tensor:
    """Launches the decoding kernels; checks the shapes alone (``ValueError``: q, k, v, the
    rotation's width and inv_freq's length): dtypes, devices and values are
    ``corope_attention``'s to validate (the public API is ``corope``'s).

    Args:
        q: ``[B, HQ, 1, D]``, the query row at position ``NK - 1``; k, v: ``[B, HKV, NK, D]``,
            the cache (unrotated keys); any strides (copied to a contiguous last dim when
            needed), fp16, bf16 or fp32, on CUDA (or the CPU under ``TRITON_INTERPRET=1``).
        inv_freq: ``[R/2]`` frequencies; softmax_scale: ``s``, which scales the gate logits
            and the scores; rope_dim: ``R``, even, ``<= D``; leader: ``"first"`` or ``"mean"``.

    Returns:
        ``o`` ``[B, HQ, 1, D]`` in q's dtype, contiguous.

    Besides ``o``, the launch allocates a gate sum (fp64) and the softmax partials,
    ``G * (D + 2)`` fp32, per split and group: ``max(B * HKV, about PROGRAMS_PER_SM * SMs)``
    of them (a split per group at least), so a few MB unless the batch's groups alone pass
    that count (B * HKV = 8192 at G = 8, D = 128: 34 MB).
    """
    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    # The checks of this launcher (a few host operations): its kernels write o's first row of
    # each head alone, index k and v by q's batch and head dim, and read R/2 frequencies and
    # the first R channels of every row.
    shapes_ok = v.shape == k.shape and (k.shape[0], k.shape[3]) == (B, D)
    if NQ != 1 or not shapes_ok or HKV == 0 or HQ % HKV or NK == 0:
        raise ValueError(
            f"corope_decode takes q [B, HQ, 1, D] and k, v [B, HKV, NK, D] with HQ % HKV == 0 "
            f"and NK >= 1 (the step's own key is the last), "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            "corope.corope_attention checks and dispatches any shape"
        )
    check_rotation(inv_freq, rope_dim, D)
    G = HQ // HKV
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    check_index_span(G, dict(q=q), dict(k=k, v=v))
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    if B == 0 or HQ == 0:
        return o
    n_blocks = cdiv(NK, BLOCK_N)
    # The interpreter runs programs one by one: there, as on a GPU of one SM.
    sms = num_sms(q.device) if q.is_cuda else 1
    n_splits, per_split = decode_splits(n_blocks, B * HKV, sms)
    g_pad = max(MIN_DOT, next_power_of_2(G))
    d_pad = max(MIN_DOT, next_power_of_2(D))
    half_pad, pass_pad = segment_dims(D, rope_dim)  # the rotated halves' and the rest's
    shape = dict(G=G, G_PAD=g_pad, HEAD_DIM=D, D_PAD=d_pad, LEADER_MEAN=leader == "mean")
    # One allocation (a decoding step is bound by the host): the fp64 gate sums
    # [B * HKV, n_splits], then m, l [.., G] and o [.., G, D] of the partials, flat, each from
    # a 16-byte boundary.
    n_parts = B * HKV * n_splits
    n_pad = cdiv(n_parts, 4) * 4
    scratch = torch.empty(n_pad * (2 + 2 * G) + n_parts * G * D, device=q.device,
                          dtype=torch.float32)  # fmt: skip
    zsum, m_part, l_part, o_part = scratch.split([2 * n_pad, n_pad * G, n_pad * G, n_parts * G * D])
    zsum = zsum.view(torch.float64)
    w = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    grid = (n_parts,)
    splits = (HKV, NK, n_blocks, n_splits, per_split, softmax_scale)
    # 2 warps a program at D <= 64 and 4 above (H100, corope/README.md: 2 beat 4 by 13-17%
    # at D = 64 from 4K keys, 4 beat 2 by 11-16% at D = 128).
    warps = 2 if D <= 64 else 4
    # Rows of 512 bytes (fp32 at D = 128, D = 256) overflowed shared memory with the split
    # loop's pipelined copies (H100: 237-256 KB of 227 at three stages): one stage there (two
    # not measured). The gate sums keep Triton's default (3 on Hopper): their loop holds one
    # key tile.
    stages = NUM_STAGES if D * q.element_size() < 512 else 1
    _gate_sums_kernel[grid](
        q, k, zsum, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        *splits, BLOCK=BLOCK_N, num_warps=warps, **shape,
    )  # fmt: skip
    _split_kernel[grid](
        q, k, v, w, zsum, m_part, l_part, o_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *splits, softmax_scale * LOG2E,
        ROPE_DIM=rope_dim, HALF_PAD=half_pad, PASS_PAD=pass_pad,
        FAST_TRIG=fast_trig(q),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK=BLOCK_N, SUM_CHUNK=256, num_warps=warps, num_stages=stages, **shape,
    )  # fmt: skip
    _combine_kernel[(B * HKV, G)](
        m_part, l_part, o_part, o, o.stride(0), o.stride(1), HKV, n_splits,
        G=G, HEAD_DIM=D, D_PAD=d_pad, CHUNK=64,
    )  # fmt: skip
    return o


__all__ = ["BLOCK_N", "corope_decode", "decode_splits"]
