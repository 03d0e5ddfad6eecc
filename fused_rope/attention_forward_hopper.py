"""The fused RoPE attention forward on Hopper (sm_90), written in Gluon: warp-specialized, as
FlashAttention-3 splits the work, where Triton's ``tl.dot`` FlashAttention-2
(``attention_forward.py``) takes 1.14-1.19x cuDNN's time at 2K-4K tokens without any RoPE
(``README.md``, "Measured", sessions 36 and 55-56).

A CTA owns 128 query rows of one head:

* a loader partition (1 warp): TMA loads of K and V tiles of 128 keys (64 at D = 256:
  ``kv_tiles``) into a ring of ``STAGES`` buffers (2 at D = 256), each guarded by a ready and
  an empty mbarrier (K and V have separate ready barriers, so the scores start before V
  lands); without RoPE, the CTA's Q tiles too;
* two consumer partitions (a warpgroup each, 64 query rows each): ``S = Q K^T`` on wgmma from
  shared memory, the online softmax on exp2 in registers, ``O += P V`` with P from registers;
  each releases a K/V slot after its P V product (the empty barrier counts both). With RoPE
  each consumer first rotates its Q tile from ``q`` and the cos/sin tables, the softmax scale
  and log2(e) folded in (``query_fold``), into shared memory; K comes rotated by the fused
  path's pass (``_rotated_segments``).

The two consumers run unsynchronized, so one's products use the tensor cores while the other
is in its softmax (FlashAttention-3's ping-pong, left to the warp schedulers); ``OVERLAP``
issues the next tile's ``Q K^T`` before this tile's softmax (FlashAttention-3's
intra-warpgroup pipelining). The kernel writes the natural-log LSE that the Triton backward
(``attention_backward.py``) takes, so training pairs this forward with that backward.

Supported (``attention_forward.hopper_forward_takes``): fp16/bf16, D in {64, 128, 256}, either
layout, every channel rotated or a partial rotation whose segments fill the head, any NQ <= NK
(causal: aligned at the bottom right, a prefill that continues a KV cache; the descriptors'
boxes stop at each head's end, so the tiles past it read zeros and their stores are dropped,
and the scores past the keys' end are masked), tables shared by the batch or one per batch row
(positions per batch), a causal sliding window (the key tiles before a CTA's first window
skipped). Gluon has no interpreter: this module is imported only on a Hopper GPU, and its
tests are GPU-only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fused_rope._attention_common import _sectioned_program, heads_per_section
from fused_rope._intmath import cdiv
from fused_rope.attention_forward import HOPPER_CTA_ROWS as CTA_ROWS

ROWS = CTA_ROWS // 2  # query rows a consumer warpgroup (wgmma's M per warpgroup)
BLOCK_N = 128  # keys a K/V tile (64 was slower: session 55)
STAGES = 3  # 3 x 2 x 32 KB of K/V at D = 128 fits beside Q's 32 KB in 227 KB of shared memory
LN2 = gl.constexpr(math.log(2.0))
CONSUMER_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)
# Q's cos and sin from a table row every ROW_STEP rows (``_rotate_q_tile``; 1-4% faster than
# a row each from 2K tokens on, fp16: README, session 58)
ROW_STEP = 8
MAXNREG = 168  # 12 warps (3 warpgroups) in one CTA an SM: 65536 / 384 registers a thread
# Q's pairs rotated a pass (``_rotate_q_tile``): all of them up to D = 128
ROTATION_CHUNK = gl.constexpr(64)


@gluon.jit
def _as_box(tile):
    """A ``[rows, D]`` shared-memory tile seen as the ``[1, rows, D]`` box of the descriptors
    (``descriptors``: one (batch, head) a box, so TMA fills the rows past a sequence's end with
    zeros and drops the stores there, instead of reaching into the next head)."""
    return tile.reshape([1, tile.type.shape[0], tile.type.shape[1]])


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
            kv_empty, bh, q_pos, kv_bh, j0, n_tiles, ROPE: gl.constexpr):  # fmt: skip
    """Q's tiles (without RoPE), then key tiles ``j0 .. j0 + n_tiles`` into the ring."""
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    if not ROPE:  # with RoPE each consumer rotates its own Q tile into shared memory
        for c in gl.static_range(2):
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [bh, q_pos + c * ROWS, 0], q_ready.index(c), _as_box(q_smem.index(c))
            )
    for i in range(n_tiles):
        s = i % STAGES
        phase = (i // STAGES) & 1
        # a fresh mbarrier counts as having completed the phase before 0: the first pass
        # through the ring does not wait
        mbarrier.wait(kv_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [kv_bh, (j0 + i) * BLOCK_N, 0], k_ready.index(s), _as_box(k_smem.index(s))
        )
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [kv_bh, (j0 + i) * BLOCK_N, 0], v_ready.index(s), _as_box(v_smem.index(s))
        )


@gluon.jit
def _softmax_step(sc, m_i, l_i, row_pos, first_row, j, qk_scale, NK, WINDOW,
                  CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, BLOCK_N: gl.constexpr,
                  S_L: gl.constexpr, O_L: gl.constexpr):  # fmt: skip
    """Masks the scores of key tile ``j`` (causal: keys past each row's position ``row_pos``,
    the first of them ``first_row``; else keys past ``NK``, which TMA filled with zeros);
    returns P = exp2(qk_scale (S - max)) (fp32, S_L), the updated running max (of the unscaled
    scores) and sum, and the factor (O_L's rows) that rescales the accumulator. ``qk_scale``
    enters each score through one FFMA, as FlashAttention-3 folds it (with RoPE, Q carries the
    fold and ``qk_scale`` is 1). A causal row sees key 0, so every row's max is finite after
    tile 0 (rows past NQ included: their positions are past NK). ``WINDOWED``: a causal sliding
    window of ``WINDOW`` keys also masks keys at or before ``row_pos - WINDOW``; its sweep
    starts at the tile of the first row's window, where a later row may see no key yet, so a
    max of -inf is taken as 0 (P and the rescale factor 0, not NaN)."""
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_L))
    if CAUSAL:
        if j * BLOCK_N + BLOCK_N - 1 > first_row:  # the tile reaches past the first row's key
            sc = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(row_pos, 1), sc, -float("inf"))
        if WINDOWED:
            if j * BLOCK_N <= first_row + row_pos.shape[0] - 1 - WINDOW:  # a window starts after it
                start = gl.expand_dims(row_pos - WINDOW, 1)  # the last key before the window
                sc = gl.where(gl.expand_dims(cols, 0) > start, sc, -float("inf"))
    else:
        if j * BLOCK_N + BLOCK_N > NK:  # the last tile, past the keys' end
            sc = gl.where(gl.expand_dims(cols, 0) < NK, sc, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    m_use = m_new
    if WINDOWED:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2((m_i - m_use) * qk_scale)
    p = gl.exp2(sc * qk_scale - gl.expand_dims(m_use * qk_scale, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)


@gluon.jit
def _rotate_q_tile(q_smem, Q, COS, SIN, row, rows_left, first_pos, q_fold, rot_fold,
                   ROTARY: gl.constexpr,
                   INTERLEAVED: gl.constexpr, ROW_STEP: gl.constexpr):  # fmt: skip
    """Rows ``row .. row + ROWS`` of ``Q [B * HQ * NQ, D]`` rotated by the tables ``COS, SIN
    [rows, ROTARY / 2]`` at rows ``first_pos ..`` times ``rot_fold`` (the pass-through channels
    times ``q_fold``), into ``q_smem [ROWS, D]``
    in the segment layout of the rotated keys (``_rotated_segments``): the pairs' first
    channels, their second channels, then the ``D - ROTARY`` pass-through channels (each a
    power of two). A pair is channels ``(d, d + ROTARY / 2)`` of q ("half" layout) or ``(2 d,
    2 d + 1)`` (``INTERLEAVED``). The fused forward's Q, made once per CTA. Rows from
    ``rows_left`` on are past the sequence's end: zeros, neither Q nor the tables read.

    ``ROW_STEP = 0``: each row's cos and sin read from its own table row. ``ROW_STEP = s > 0``
    (tables whose row ``p`` holds position ``p``'s angles times one factor, which ``rot_fold``
    then divides out): row ``p = b + t`` (``b`` a multiple of ``s``, ``t < s``) from rows ``b``
    and ``t`` by the angle-addition formulas, in fp32. A CTA then reads ``ROWS / s`` rows of
    the tables plus ``s`` rows every CTA shares (cached), not ``ROWS``: at the start of a CTA
    the tables' bytes (fp32: twice Q's) wait in the same L2 queue as Q's and the first K and V
    tiles, while the tensor cores idle. The two rounded entries cost little: over 16K positions
    at D = 128 the RMS error of cos is 1.5e-4 against 1.2e-4 read directly from fp16 tables
    (bf16 inputs, whose rotated q rounds with an RMS of about 2e-3), 1.9e-8 against 1.5e-8
    from fp32 tables (fp16 inputs)."""
    ROWS: gl.constexpr = q_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[1]
    HALF: gl.constexpr = ROTARY // 2
    # pairs a pass: at D = 256 a whole half (128 pairs of a 64-row tile, and their cos and
    # sin) would take 256 registers a thread
    CHUNK: gl.constexpr = min(HALF, ROTATION_CHUNK)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(1, L)), 1)
    valid = r < rows_left
    x = Q + (row + r).to(gl.int64) * HEAD_DIM
    pos = first_pos + r
    for c0 in gl.static_range(0, HALF, CHUNK):
        c = c0 + gl.expand_dims(gl.arange(0, CHUNK, gl.SliceLayout(0, L)), 0)
        if INTERLEAVED:
            x1 = gl.load(x + 2 * c, mask=valid, other=0.0).to(gl.float32)
            x2 = gl.load(x + 2 * c + 1, mask=valid, other=0.0).to(gl.float32)
        else:
            x1 = gl.load(x + c, mask=valid, other=0.0).to(gl.float32)
            x2 = gl.load(x + HALF + c, mask=valid, other=0.0).to(gl.float32)
        if ROW_STEP == 0:
            t = pos * HALF + c
            cos = gl.load(COS + t, mask=valid, other=0.0).to(gl.float32)
            sin = gl.load(SIN + t, mask=valid, other=0.0).to(gl.float32)
        else:
            base = (pos - pos % ROW_STEP) * HALF + c
            step = (pos % ROW_STEP) * HALF + c
            cos_b = gl.load(COS + base, mask=valid, other=0.0).to(gl.float32)
            sin_b = gl.load(SIN + base, mask=valid, other=0.0).to(gl.float32)
            cos_t = gl.load(COS + step, mask=valid, other=0.0).to(gl.float32)
            sin_t = gl.load(SIN + step, mask=valid, other=0.0).to(gl.float32)
            cos = cos_b * cos_t - sin_b * sin_t
            sin = sin_b * cos_t + cos_b * sin_t
        cos = cos * rot_fold
        sin = sin * rot_fold
        q_smem.slice(c0, CHUNK, dim=1).store((x1 * cos - x2 * sin).to(q_smem.dtype))
        q_smem.slice(HALF + c0, CHUNK, dim=1).store((x2 * cos + x1 * sin).to(q_smem.dtype))
    if ROTARY < HEAD_DIM:  # the pass-through channels: the fold alone
        PASS: gl.constexpr = HEAD_DIM - ROTARY
        PASS_CHUNK: gl.constexpr = min(PASS, 2 * ROTATION_CHUNK)
        for p0 in gl.static_range(0, PASS, PASS_CHUNK):
            cp = p0 + gl.expand_dims(gl.arange(0, PASS_CHUNK, gl.SliceLayout(0, L)), 0)
            xp = gl.load(x + ROTARY + cp, mask=valid, other=0.0).to(gl.float32)
            q_smem.slice(ROTARY + p0, PASS_CHUNK, dim=1).store((xp * q_fold).to(q_smem.dtype))
    fence_async_shared()  # the generic stores before the tensor cores' (async proxy) reads


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, bh, q_pos,
              j0, n_tiles, qk_scale, Q, COS, SIN, LSE, q_fold, rot_fold, NQ, NK, HQ, TABLE_OFF,
              TABLE_STRIDE_B, WINDOW, CONSUMER: gl.constexpr, CAUSAL: gl.constexpr,
              WINDOWED: gl.constexpr, OVERLAP: gl.constexpr, ROPE: gl.constexpr,
              ROTARY: gl.constexpr, INTERLEAVED: gl.constexpr,
              ROW_STEP: gl.constexpr):  # fmt: skip
    """One warpgroup's 64 query rows over key tiles ``j0 .. j0 + n_tiles`` (ring slot ``i``
    holds tile ``j0 + i``)."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    K_WIDTH: gl.constexpr = 256 // dtype.primitive_bitwidth
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, K_WIDTH]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, K_WIDTH]
    )
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)

    q = q_smem.index(CONSUMER)
    first_q = q_pos + CONSUMER * ROWS  # this warpgroup's first query row
    rows = first_q + gl.arange(0, ROWS, gl.SliceLayout(1, S_L))
    # the rows' positions among the keys: causal attention aligned at the bottom right
    first_row = first_q + NK - NQ
    row_pos = rows + NK - NQ
    m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, S_L))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, O_L)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, S_L)
    if ROPE:
        batch_table = (bh // HQ).to(gl.int64) * TABLE_STRIDE_B  # 0 for one shared table
        _rotate_q_tile(q, Q, COS + batch_table, SIN + batch_table, bh * NQ + first_q,
                       NQ - first_q, TABLE_OFF + first_q, q_fold, rot_fold, ROTARY, INTERLEAVED,
                       ROW_STEP)  # fmt: skip
    else:
        mbarrier.wait(q_ready.index(CONSUMER), 0)

    if OVERLAP:
        # FlashAttention-3's intra-warpgroup pipelining: the softmax of tile j + 1 runs while
        # the tensor cores do tile j's P V product
        mbarrier.wait(k_ready.index(0), 0)
        sc = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
        sc = warpgroup_mma_wait(0, deps=[sc])
        p, m_i, l_i, alpha = _softmax_step(sc, m_i, l_i, row_pos, first_row, j0, qk_scale, NK,
                                           WINDOW, CAUSAL, WINDOWED, BLOCK_N, S_L,
                                           O_L)  # fmt: skip
        for j in range(n_tiles):
            s = j % STAGES
            # the last iteration's scores repeat its own tile (unused): one wgmma a CTA, and no
            # branch around an asynchronous product
            jn = gl.minimum(j + 1, n_tiles - 1)
            mbarrier.wait(k_ready.index(jn % STAGES), (jn // STAGES) & 1)
            sc = warpgroup_mma(q, k_smem.index(jn % STAGES).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)  # fmt: skip
            p16 = gl.convert_layout(p.to(dtype), P_L)
            mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
            acc = warpgroup_mma(p16, v_smem.index(s), acc, is_async=True)
            sc = warpgroup_mma_wait(1, deps=[sc])
            if j + 1 < n_tiles:
                p, m_i, l_i, alpha = _softmax_step(sc, m_i, l_i, row_pos, first_row, j0 + j + 1,
                                                   qk_scale, NK, WINDOW, CAUSAL, WINDOWED,
                                                   BLOCK_N, S_L, O_L)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(s), count=1)
            if j + 1 < n_tiles:
                acc = acc * alpha
    else:
        for j in range(n_tiles):
            s = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(s), phase)
            sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)  # fmt: skip
            sc = warpgroup_mma_wait(0, deps=[sc])
            p, m_i, l_i, alpha = _softmax_step(sc, m_i, l_i, row_pos, first_row, j0 + j,
                                               qk_scale, NK, WINDOW, CAUSAL, WINDOWED, BLOCK_N,
                                               S_L, O_L)  # fmt: skip
            acc = acc * alpha
            p16 = gl.convert_layout(p.to(dtype), P_L)
            mbarrier.wait(v_ready.index(s), phase)
            acc = warpgroup_mma(p16, v_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(s), count=1)

    if ROPE:  # the natural-log LSE the Triton backward takes: Q carried log2(e)
        gl.store(LSE + bh * NQ + rows, (m_i * qk_scale + gl.log2(l_i)) * LN2, mask=rows < NQ)
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, O_L)), 1)
    q.store(acc.to(dtype))  # Q's buffer is free: the output leaves through it
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [bh, first_q, 0], _as_box(q))  # rows past NQ: dropped
    tma.store_wait(0)


@gluon.jit
def attention_fwd_kernel(q_desc, k_desc, v_desc, o_desc, Q, COS, SIN, LSE, qk_scale, q_fold,
                         rot_fold, NQ,
                         NK, HQ, HKV, TABLE_OFF, TABLE_STRIDE_B, WINDOW, SECTION,
                         CAUSAL: gl.constexpr,
                         WINDOWED: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                         ROPE: gl.constexpr,
                         ROTARY: gl.constexpr, INTERLEAVED: gl.constexpr,
                         ROW_STEP: gl.constexpr):  # fmt: skip
    """q_desc, o_desc: [B * HQ, NQ, D] in boxes of [1, 64, D]; k_desc, v_desc: [B * HKV, NK, D]
    in boxes of [1, BLOCK_N, D] (``descriptors``); NQ <= NK, causal attention aligned at the
    bottom right (query i at key position NK - NQ + i). Grid (cdiv(NQ, 128) * B * HQ,), in the
    order of ``_sectioned_program`` (SECTION heads a section: ``heads_per_section``). Without
    ROPE: qk_scale = softmax_scale * log2(e); Q, COS, SIN, LSE, TABLE_* unused. With ROPE:
    the keys come rotated, Q (the pointer of q_desc's tensor) is rotated in the kernel by rows
    TABLE_OFF + i of COS, SIN [1 | B, rows, ROTARY / 2] (batch stride TABLE_STRIDE_B elements,
    0 for one table) times rot_fold (its pass-through channels times q_fold = softmax_scale *
    log2(e); rot_fold is q_fold over the tables' factor with ROW_STEP, else q_fold), qk_scale =
    1, and LSE [B * HQ * NQ] fp32 takes the natural-log LSE. WINDOWED (causal): query i sees
    only the WINDOW keys up to its own, and the key tiles before the CTA's first window are
    not loaded."""
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    block, bh = _sectioned_program(gl.cdiv(NQ, 2 * ROWS), SECTION, True)
    kv_bh = (bh // HQ) * HKV + (bh % HQ) // (HQ // HKV)
    q_pos = block * 2 * ROWS
    j0 = 0
    if CAUSAL:  # up to the CTA's last row's key (rows past NQ see no more: NK is the end)
        n_tiles = gl.cdiv(gl.minimum(q_pos + 2 * ROWS + NK - NQ, NK), BLOCK_N)
        if WINDOWED:  # from the tile of the first row's first key
            j0 = gl.maximum(q_pos + NK - NQ - WINDOW + 1, 0) // BLOCK_N
            n_tiles = n_tiles - j0
    else:
        n_tiles = gl.cdiv(NK, BLOCK_N)

    # the tiles as the tensor cores read them; TMA sees each as a [1, rows, D] box (_as_box)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_ready.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)  # both consumers release a slot

    # fmt: off
    gl.warp_specialize(
        [
            (_consumer, (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                         bh, q_pos, j0, n_tiles, qk_scale, Q, COS, SIN, LSE, q_fold, rot_fold,
                         NQ, NK,
                         HQ, TABLE_OFF, TABLE_STRIDE_B, WINDOW, 0, CAUSAL, WINDOWED, OVERLAP,
                         ROPE, ROTARY, INTERLEAVED, ROW_STEP)),
            (_consumer, (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                         bh, q_pos, j0, n_tiles, qk_scale, Q, COS, SIN, LSE, q_fold, rot_fold,
                         NQ, NK,
                         HQ, TABLE_OFF, TABLE_STRIDE_B, WINDOW, 1, CAUSAL, WINDOWED, OVERLAP,
                         ROPE, ROTARY, INTERLEAVED, ROW_STEP)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                       kv_empty, bh, q_pos, kv_bh, j0, n_tiles, ROPE)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )
    # fmt: on


def kv_tiles(head_dim: int) -> tuple[int, int]:
    """``(keys a K/V tile, ring stages)`` at ``head_dim``: ``(BLOCK_N, STAGES)`` up to 128
    channels; at 256, tiles of 64 keys in 2 stages (2 x 2 x 32 KB of K/V beside Q's 64 KB:
    128-key tiles would not fit twice, nor their scores beside the 128 registers a thread of
    the output)."""
    return (BLOCK_N, STAGES) if head_dim <= 128 else (64, 2)


def descriptors(q, k, v, o, block_n: int = BLOCK_N) -> tuple:
    """TMA descriptors of ``q, o [B, HQ, NQ, D]`` (boxes of ``[1, ROWS, D]``) and ``k, v
    [B, HKV, NK, D]`` (boxes of ``[1, block_n, D]``), contiguous, seen as ``[B * H, N, D]``: a
    box stops at its head's last row (TMA's zeros past it, stores dropped)."""
    d = q.shape[-1]
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def descriptor(t, rows):
        box = [1, rows, d]
        layout = gl.NVMMASharedLayout.get_default_for(box, gl_dtype)
        return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[2], d), box, layout)

    return descriptor(q, ROWS), descriptor(k, block_n), descriptor(v, block_n), descriptor(o, ROWS)


def launch(q, k, v, causal: bool, qk_scale: float, rope=None, stages: int | None = None,
           overlap: bool = True, row_step: int = 0, window: int = 0) -> torch.Tensor:  # fmt: skip
    """Runs ``attention_fwd_kernel`` on contiguous ``q [B, HQ, NQ, D]``, ``k, v [B, HKV, NK,
    D]``, ``NQ <= NK``; returns ``o`` like q. ``rope``: None, or a ``RopeArgs`` for the RoPE
    variant; ``stages``: the K/V ring's (None: ``kv_tiles``'); ``row_step``:
    ``_rotate_q_tile``'s ``ROW_STEP`` (with RoPE only); ``window``: a causal sliding window of
    that many keys (0: none)."""
    if row_step and (rope is None or ROWS % row_step):
        raise ValueError(f"row_step must divide {ROWS} and comes with rope, got {row_step}")
    if window and not causal:
        raise ValueError(f"a window needs causal attention, got window={window}, causal=False")
    B, HQ, NQ, D = q.shape
    o = torch.empty_like(q)
    r = rope or RopeArgs(q, q, q, 1.0, rotary=D)
    block_n, default_stages = kv_tiles(D)
    stages = stages or default_stages
    NK = k.shape[2]
    section = heads_per_section(NK * 2 * D * q.element_size() * k.shape[1] // HQ, "query")
    attention_fwd_kernel[(cdiv(NQ, CTA_ROWS) * B * HQ,)](
        *descriptors(q, k, v, o, block_n), q, r.cos, r.sin, r.lse, qk_scale, r.q_fold,
        r.q_fold / r.range_factor, NQ, NK, HQ,
        k.shape[1], r.table_off, r.table_stride_b, window, section, causal, window > 0, stages, overlap,
        rope is not None, r.rotary, r.interleaved, row_step, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return o


class RopeArgs(NamedTuple):
    """The RoPE variant's arguments of ``attention_fwd_kernel``: the tables ``cos, sin [1 | B,
    rows, rotary / 2]`` (row ``table_off + i`` of batch row ``b`` holds query ``i``'s angles;
    ``table_stride_b`` their batch stride, 0 for one batch row), ``lse [B, HQ, NQ]`` fp32 to
    fill, Q's fold ``q_fold``, the rotated channels ``rotary`` and their layout, and
    ``range_factor``: the tables' factor that Q's cos and sin by angle addition (``ROW_STEP``)
    carry twice, divided out of the rotated channels' fold (1 without)."""

    cos: torch.Tensor
    sin: torch.Tensor
    lse: torch.Tensor
    q_fold: float
    table_off: int = 0
    table_stride_b: int = 0
    rotary: int = 128
    interleaved: bool = False
    range_factor: float = 1.0


def rope_attention_fwd_hopper(q, k_rot, v, causal: bool, rope: RopeArgs,
                              range_factor: float | None = None,
                              window: int = 0) -> torch.Tensor:  # fmt: skip
    """The fused forward of ``rope_attention_fwd`` where ``hopper_forward_takes`` holds:
    ``q [B, HQ, NQ, D]``, ``k_rot`` (k rotated, ``_rotated_segments``, whose rows are then ``D``
    wide) and ``v [B, HKV, NK, D]``; ``rope`` the tables of ``_rope_tables`` and their
    indexing, Q's whole fold (``query_fold``: the scores take no other scale) and ``lse [B,
    HQ, NQ]`` to fill; ``range_factor``: the tables' attention factor where their row ``p``
    holds position ``p``'s angles (the default positions), which lets Q's cos and sin come from
    fewer rows (``_rotate_q_tile``); None for any other tables; ``window``: a causal sliding
    window of that many keys (0: none).
    Returns ``o [B, HQ, NQ, D]`` in q's dtype (and fills ``rope.lse``, natural log)."""
    # TMA takes 16-byte aligned rows; a contiguous view at an odd storage offset is copied
    q, v = (
        t
        if t.is_contiguous() and t.data_ptr() % 16 == 0
        else t.clone(memory_format=torch.contiguous_format)
        for t in (q, v)
    )
    row_step = ROW_STEP if range_factor is not None else 0
    if row_step:  # each cos and sin is then a product of two table entries: one factor too many
        rope = rope._replace(range_factor=range_factor)
    return launch(q, k_rot, v, causal, 1.0, rope, row_step=row_step, window=window)
