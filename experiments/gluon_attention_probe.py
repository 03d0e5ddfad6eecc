"""Can a warp-specialized Hopper attention forward, written in Gluon, reach cuDNN's speed? A probe.

Issue 5's forward misses its floor (SDPA without RoPE, which is cuDNN's kernel on Hopper) at
Small-1K, Llama7B-2K and Llama7B-4K, and ``fused_rope/README.md`` (session 36) traced the gap
to the attention itself: a ``tl.dot`` FlashAttention-2 in Triton 3.6, with no RoPE at all,
takes 1.14-1.19x cuDNN's time there. Sessions 29-36 named the next step: warp roles (a
producer warp feeding K/V through TMA, consumer warpgroups doing the products and the
softmax, as FlashAttention-3 splits the work), which only Gluon or CUDA can express. This
script builds that forward in Gluon and times it against cuDNN, without RoPE and with Q
rotated in the kernel (``gluon_rope_attention``), before it goes into the package.

The kernel (``attention_fwd_kernel``), causal or not, ``q [B, HQ, N, D]``, ``k, v
[B, HKV, N, D]`` (GQA), fp16/bf16, ``D`` in {64, 128}, ``N`` a multiple of 128 (a probe: the
tiles are not masked at the sequence's end). A CTA owns 128 query rows of one head:

* a loader partition (1 warp): TMA loads of the CTA's two 64-row Q tiles, then K and V tiles
  of 128 keys into a ring of ``STAGES`` buffers, each guarded by a ready and an empty mbarrier
  (K and V have separate ready barriers, so the scores start before V lands);
* two consumer partitions (a warpgroup each, 64 query rows each): ``S = Q K^T`` on wgmma from
  shared memory, the online softmax on exp2 in registers, ``O += P V`` with P from registers;
  each releases a K/V slot after its P V product (the empty barrier counts both).

The two consumers run unsynchronized: while one is in its softmax the other's products can
use the tensor cores (FlashAttention-3's "ping-pong", left to the warp schedulers here rather
than ordered with named barriers). ``overlap`` (the ``gluon_overlap_*`` variants) adds
FlashAttention-3's intra-warpgroup pipelining: the next tile's ``Q K^T`` is issued before this
tile's softmax. With ``ROPE`` each consumer rotates its Q tile from ``q`` and the fused path's cos/sin tables into shared
memory (the softmax scale and log2(e) folded in), the keys come from the fused path's rotation
pass, and the kernel writes the natural-log LSE that the Triton backward takes.

    python experiments/gluon_attention_probe.py --out experiments/results      # GPU
    python experiments/gluon_attention_probe.py --offline                       # ptxas report
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if "--offline" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)  # compile for sm_90a, even from a CPU machine

import torch
import triton
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

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

ROWS = 64  # query rows a consumer warpgroup (wgmma's M per warpgroup)
CTA_ROWS = 2 * ROWS
BLOCK_N = 128  # keys a K/V tile
LOG2E = 1.0 / math.log(2.0)
LN2 = gl.constexpr(math.log(2.0))
CONSUMER_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)
MAXNREG = 168  # 12 warps (3 warpgroups) in one CTA an SM: 65536 / 384 registers a thread


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
            kv_empty, q_row, kv_row, n_tiles, ROPE: gl.constexpr):  # fmt: skip
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    if not ROPE:  # with RoPE each consumer rotates its own Q tile into shared memory
        for c in gl.static_range(2):
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc, [q_row + c * ROWS, 0], q_ready.index(c), q_smem.index(c)
            )
    for j in range(n_tiles):
        s = j % STAGES
        phase = (j // STAGES) & 1
        # a fresh mbarrier counts as having completed the phase before 0: the first pass
        # through the ring does not wait
        mbarrier.wait(kv_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s)
        )
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s)
        )


@gluon.jit
def _softmax_step(sc, m_i, l_i, row_pos, first_row, j, qk_scale, CAUSAL: gl.constexpr,
                  BLOCK_N: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):  # fmt: skip
    """Masks the scores of key tile ``j``; returns P = exp2(qk_scale (S - max)) (fp32, S_L), the
    updated running max (of the unscaled scores) and sum, and the factor (O_L's rows) that
    rescales the accumulator. ``qk_scale`` enters each score through one FFMA, as FlashAttention-3
    folds it (with RoPE, Q carries the fold and ``qk_scale`` is 1)."""
    if CAUSAL:
        if j * BLOCK_N + BLOCK_N - 1 > first_row:  # the tile reaches past the first row's key
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_L))
            sc = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(row_pos, 1), sc, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    alpha = gl.exp2((m_i - m_new) * qk_scale)
    p = gl.exp2(sc * qk_scale - gl.expand_dims(m_new * qk_scale, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)


@gluon.jit
def _rotate_q_tile(q_smem, Q, COS, SIN, row, first_pos, q_fold):
    """Rows ``row .. row + ROWS`` of ``Q [B * HQ * N, D]`` rotated ("half" layout, every channel)
    by the tables ``COS, SIN [N, D / 2]`` at positions ``first_pos ..``, times ``q_fold``, into
    ``q_smem [ROWS, D]``: the fused forward's Q, made once per CTA."""
    ROWS: gl.constexpr = q_smem.type.shape[0]
    HALF: gl.constexpr = q_smem.type.shape[1] // 2
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(1, L)), 1)
    c = gl.expand_dims(gl.arange(0, HALF, gl.SliceLayout(0, L)), 0)
    x = Q + (row + r).to(gl.int64) * (2 * HALF) + c
    x1 = gl.load(x).to(gl.float32)
    x2 = gl.load(x + HALF).to(gl.float32)
    t = (first_pos + r) * HALF + c
    cos = gl.load(COS + t).to(gl.float32) * q_fold
    sin = gl.load(SIN + t).to(gl.float32) * q_fold
    q_smem.slice(0, HALF, dim=1).store((x1 * cos - x2 * sin).to(q_smem.dtype))
    q_smem.slice(HALF, HALF, dim=1).store((x2 * cos + x1 * sin).to(q_smem.dtype))
    fence_async_shared()  # the generic stores before the tensor cores' (async proxy) reads


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row,
              q_pos, n_tiles, qk_scale, Q, COS, SIN, LSE, q_fold, CONSUMER: gl.constexpr,
              CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, ROPE: gl.constexpr):  # fmt: skip
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
    first_row = q_pos + CONSUMER * ROWS
    row_pos = first_row + gl.arange(0, ROWS, gl.SliceLayout(1, S_L))
    m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, S_L))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, O_L)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, S_L)
    if ROPE:
        _rotate_q_tile(q, Q, COS, SIN, q_row + CONSUMER * ROWS, first_row, q_fold)
    else:
        mbarrier.wait(q_ready.index(CONSUMER), 0)

    if OVERLAP:
        # FlashAttention-3's intra-warpgroup pipelining: the softmax of tile j + 1 runs while
        # the tensor cores do tile j's P V product
        mbarrier.wait(k_ready.index(0), 0)
        sc = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
        sc = warpgroup_mma_wait(0, deps=[sc])
        p, m_i, l_i, alpha = _softmax_step(sc, m_i, l_i, row_pos, first_row, 0, qk_scale, CAUSAL,
                                           BLOCK_N, S_L, O_L)  # fmt: skip
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
                p, m_i, l_i, alpha = _softmax_step(sc, m_i, l_i, row_pos, first_row, j + 1,
                                                   qk_scale, CAUSAL, BLOCK_N, S_L, O_L)  # fmt: skip
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
            p, m_i, l_i, alpha = _softmax_step(sc, m_i, l_i, row_pos, first_row, j, qk_scale,
                                               CAUSAL, BLOCK_N, S_L, O_L)  # fmt: skip
            acc = acc * alpha
            p16 = gl.convert_layout(p.to(dtype), P_L)
            mbarrier.wait(v_ready.index(s), phase)
            acc = warpgroup_mma(p16, v_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_empty.index(s), count=1)

    if ROPE:  # the natural-log LSE the Triton backward takes: Q carried log2(e)
        gl.store(LSE + q_row + CONSUMER * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, S_L)),
                 (m_i * qk_scale + gl.log2(l_i)) * LN2)  # fmt: skip
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, O_L)), 1)
    q.store(acc.to(dtype))  # Q's buffer is free: the output leaves through it
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + CONSUMER * ROWS, 0], q)
    tma.store_wait(0)


@gluon.jit
def attention_fwd_kernel(q_desc, k_desc, v_desc, o_desc, Q, COS, SIN, LSE, qk_scale, q_fold, N,
                         HQ, HKV, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                         OVERLAP: gl.constexpr, ROPE: gl.constexpr):  # fmt: skip
    """q_desc, o_desc: [B * HQ * N, D] in tiles of [64, D]; k_desc, v_desc: [B * HKV * N, D] in
    tiles of [BLOCK_N, D]. Grid (N / 128, B * HQ). Without ROPE: qk_scale = softmax_scale *
    log2(e), Q, COS, SIN, LSE unused. With ROPE: the keys come rotated, Q (the pointer of
    q_desc's tensor) is rotated in the kernel by COS, SIN [N, D / 2] times q_fold = softmax_scale
    * log2(e), qk_scale = 1, and LSE [B * HQ * N] fp32 takes the natural-log LSE."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    n_blocks = N // (2 * ROWS)
    block = n_blocks - 1 - gl.program_id(0)  # the longest key sweeps first
    bh = gl.program_id(1)
    kv_bh = (bh // HQ) * HKV + (bh % HQ) // (HQ // HKV)
    q_pos = block * 2 * ROWS
    q_row = bh * N + q_pos
    kv_row = kv_bh * N
    if CAUSAL:
        n_tiles = gl.cdiv(q_pos + 2 * ROWS, BLOCK_N)
    else:
        n_tiles = N // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
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
                         q_row, q_pos, n_tiles, qk_scale, Q, COS, SIN, LSE, q_fold, 0, CAUSAL,
                         OVERLAP, ROPE)),
            (_consumer, (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                         q_row, q_pos, n_tiles, qk_scale, Q, COS, SIN, LSE, q_fold, 1, CAUSAL,
                         OVERLAP, ROPE)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                       kv_empty, q_row, kv_row, n_tiles, ROPE)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )
    # fmt: on


def _descriptors(q, k, v, o, block_n=BLOCK_N):
    d = q.shape[-1]
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([ROWS, d], gl_dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl_dtype)
    flat = [t.reshape(-1, d) for t in (q, k, v, o)]
    return (
        TensorDescriptor.from_tensor(flat[0], [ROWS, d], q_layout),
        TensorDescriptor.from_tensor(flat[1], [block_n, d], kv_layout),
        TensorDescriptor.from_tensor(flat[2], [block_n, d], kv_layout),
        TensorDescriptor.from_tensor(flat[3], [ROWS, d], q_layout),
    )


def _launch(q, k, v, causal, stages, overlap, block_n, qk_scale, rope=None):
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    if n % CTA_ROWS or d not in (64, 128) or hq % hkv or not half:
        raise ValueError(f"probe shapes only: N % {CTA_ROWS} == 0, D in (64, 128), got {q.shape}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    o = torch.empty_like(q)
    cos, sin, lse, q_fold = rope if rope is not None else (q, q, q, 1.0)
    attention_fwd_kernel[(n // CTA_ROWS, b * hq)](
        *_descriptors(q, k, v, o, block_n), q, cos, sin, lse, qk_scale, q_fold, n, hq, hkv,
        causal, stages, overlap, rope is not None, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return o


def gluon_attention(q, k, v, *, causal=True, softmax_scale=None, stages=2, overlap=False,
                    block_n=BLOCK_N):  # fmt: skip
    """o [B, HQ, N, D] = softmax(q k^T * scale) v, q [B, HQ, N, D], k, v [B, HKV, N, D]."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _launch(q, k, v, causal, stages, overlap, block_n, scale * LOG2E)


def gluon_rope_attention(q, k, v, inv_freq, *, causal=True, stages=3, overlap=True,
                         block_n=BLOCK_N):  # fmt: skip
    """``rope_attention(q, k, v, inv_freq=inv_freq)``'s forward ("half" layout, every channel
    rotated, positions 0..N-1) with this kernel: the keys rotated by the fused path's pass
    (``_rotated_segments``), Q rotated and folded in the kernel. Returns ``(o, lse)``, lse
    ``[B, HQ, N]`` fp32 natural log, as ``rope_attention_fwd``."""
    from fused_rope._attention_common import _meta, _rope_tables, _rotated_segments, query_fold

    b, hq, n, d = q.shape
    q_fold, score_scale = query_fold(d**-0.5, q.dtype)
    if score_scale != 1.0:
        raise ValueError("the probe folds the whole softmax scale into Q")
    meta = _meta(d, d, False, causal, q.dtype, score_scale)
    q_cos, q_sin, k_cos, k_sin, _, stride_ktb, q_off, k_off = _rope_tables(
        inv_freq, None, None, n, n, meta["HALF"], q.dtype
    )
    if q_off or k_off or q_cos.shape[-1] * 2 != d:
        raise ValueError("the probe takes tables of positions 0..N-1 over the whole head")
    k_rot = _rotated_segments(k, k_cos, k_sin, stride_ktb, k_off, 1.0, meta)
    lse = torch.empty((b, hq, n), device=q.device, dtype=torch.float32)
    o = _launch(q, k_rot, v, causal, stages, overlap, block_n, 1.0, (q_cos, q_sin, lse, q_fold))
    return o, lse


def compile_offline(d, causal, stages, overlap, block_n=BLOCK_N, rope=False, dtype=torch.bfloat16):
    """The kernel compiled for sm_90a without a GPU: registers, spills, shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    t = torch.empty(CTA_ROWS * 2, d, dtype=dtype)
    descs = _descriptors(t[None], t[None], t[None], t[None], block_n)
    names = ["q_desc", "k_desc", "v_desc", "o_desc"]
    sig = {name: mangle_type(desc) for name, desc in zip(names, descs, strict=True)}
    ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    sig.update(Q=ptr, COS="*fp16", SIN="*fp16", LSE="*fp32", qk_scale="fp32", q_fold="fp32",
               N="i32", HQ="i32", HKV="i32", CAUSAL="constexpr", STAGES="constexpr",
               OVERLAP="constexpr", ROPE="constexpr")  # fmt: skip
    consts = {("CAUSAL",): causal, ("STAGES",): stages, ("OVERLAP",): overlap, ("ROPE",): rope}
    consts = {(list(sig).index(k[0]),): v for k, v in consts.items()}
    attrs = {(list(sig).index(name),): [["tt.divisibility", 16]]
             for name in ("Q", "COS", "SIN", "LSE", "N", "HQ", "HKV")}  # fmt: skip
    return triton.compile(
        GluonASTSource(attention_fwd_kernel, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "maxnreg": MAXNREG},
    )


def _offline_report() -> None:
    from experiments.ptxas_corope import report

    print("| D | RoPE | stages | overlap | keys a tile | registers | stack B | spill st / ld B "
          "| shared B |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for d in (64, 128):
        for rope in (False, True):
            for stages, overlap, block_n in _variants(d).values():
                k = compile_offline(d, True, stages, overlap, block_n, rope)
                print(f"| {d} | {rope} | {stages} | {overlap} | {block_n} | {report(k, False)} |")


def _variants(d: int) -> dict:
    return {k: v for k, v in VARIANTS.items() if d == 64 or v[0] < 4}


SHAPES = {  # issue 5's benchmark shapes: (B, HQ, HKV, N, D)
    "Small-1K": (4, 8, 8, 1024, 64),
    "Llama7B-2K": (2, 32, 32, 2048, 128),
    "Llama7B-4K": (2, 32, 32, 4096, 128),
    "Long-16K": (1, 8, 8, 16384, 128),
    "GQA-4K": (2, 32, 8, 4096, 128),
}
VARIANTS = {  # name: (stages, overlap, keys a tile)
    "gluon": (2, False, 128),
    "gluon_overlap_3st": (3, True, 128),
    "gluon_overlap_4st": (4, True, 128),  # D = 64 only: 4 stages of D = 128 overflow shared memory
}


def _in_dtype(q, k, v, causal, scale):
    """softmax(q k^T * scale) v with its products and softmax in q's dtype: the flash-attention
    rule's baseline (``tests.helpers.rope_attention_in_dtype`` without the rotation)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q * scale) @ k.transpose(-1, -2)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def check(out: Path | None) -> list[str]:
    """Each variant, and the fused-RoPE forward (its o and lse), against float64 at small shapes
    with flash-attention's rule (``tests.helpers.check_against_baseline``): errors at most twice
    those of the same math computed in PyTorch in the dtype."""
    from fused_rope import rope_frequencies
    from fused_rope.frequencies import rope_angles
    from fused_rope.naive import rope_attention_ref
    from tests.helpers import check_against_baseline, rope_attention_in_dtype

    lines = []

    def record(name, shape, causal, dtype, out, ref, baseline):
        ok, msg = check_against_baseline(out, ref, baseline)
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name:26s} {shape} causal={causal} "
                     f"{str(dtype)[6:]}: {msg}")  # fmt: skip

    for (b, hq, hkv, n, d), causal, dtype in [
        (shape, causal, dtype)
        for shape in [(1, 2, 2, 128, 64), (2, 4, 2, 384, 128), (1, 8, 1, 512, 64), (2, 2, 2, 1024, 128)]
        for causal in (True, False)
        for dtype in (torch.bfloat16, torch.float16)
    ]:  # fmt: skip
        shape = (b, hq, hkv, n, d)
        gen = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
                   for h in (hq, hkv, hkv))  # fmt: skip
        scale = d**-0.5
        ref = _in_dtype(q.double(), k.double(), v.double(), causal, scale)
        baseline = _in_dtype(q, k, v, causal, scale)
        for name, (stages, overlap, block_n) in _variants(d).items():
            o = gluon_attention(q, k, v, causal=causal, stages=stages, overlap=overlap,
                                block_n=block_n)  # fmt: skip
            record(name, shape, causal, dtype, o, ref, baseline)

        inv_freq = rope_frequencies(d, 10000.0)[0].to("cuda", torch.float32)
        angles = rope_angles(torch.arange(n, device="cuda"), inv_freq)
        o64, lse64 = rope_attention_ref(q.double(), k.double(), v.double(), inv_freq=inv_freq,
                                        causal=causal)  # fmt: skip
        o_b, _, lse32_b = rope_attention_in_dtype(q, k, v, q_angles=angles, k_angles=angles,
                                                  causal=causal, scale=scale, layout="half",
                                                  rope_dim=d)  # fmt: skip
        o, lse = gluon_rope_attention(q, k, v, inv_freq, causal=causal)
        record("gluon fused RoPE: o", shape, causal, dtype, o, o64, o_b)
        record("gluon fused RoPE: lse", shape, causal, dtype, lse, lse64, lse32_b)
    print("\n".join(lines), flush=True)
    if out is not None:
        (out / "gluon_attention_probe_check.txt").write_text("\n".join(lines) + "\n")
    return lines


def _fp32_attention(q, k, v):
    """Causal attention of q, k, v taken to fp32 (memory-efficient SDPA, which has no GQA: the
    KV heads are repeated): the benchmark's reference at shapes float64 cannot hold."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(g, 1) for t in (k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, is_causal=True)


def bench(shapes, dtypes) -> list[dict]:
    """Every provider at issue 5's shapes, causal forward (``bench_shape``)."""
    return [row for dtype in dtypes for name in shapes for row in bench_shape(name, dtype)]


def bench_shape(name: str, dtype: torch.dtype) -> list[dict]:
    """Every provider at one shape; the Gluon outputs checked against an fp32 reference (max
    error at most twice cuDNN's, or with RoPE, twice the Triton fused path's)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from experiments.timing import time_ms
    from fused_rope import apply_rope_qk, rope_attention, rope_frequencies

    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, hq, hkv, n, d = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
               for h in (hq, hkv, hkv))  # fmt: skip
    inv_freq = rope_frequencies(d, 10000.0)[0].to("cuda", torch.float32)
    gqa = hq != hkv
    ref = _fp32_attention(q, k, v)
    base = (sdpa(q, k, v, is_causal=True, enable_gqa=gqa).float() - ref).abs().max().item()
    q32, k32 = apply_rope_qk(q.float(), k.float(), inv_freq=inv_freq)
    ref_rope = _fp32_attention(q32, k32, v)
    del q32, k32
    fused = rope_attention(q, k, v, inv_freq=inv_freq, impl="fused")
    base_rope = (fused.float() - ref_rope).abs().max().item()

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)

    def rope_then_gluon():
        qr, kr = apply_rope_qk(q, k, inv_freq=inv_freq)
        return gluon_attention(qr, kr, v, stages=3, overlap=True)

    providers = {
        "sdpa (cuDNN), no RoPE": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=gqa),
        "sdpa flash, no RoPE": flash,
        **{
            f"{vn}, no RoPE": (lambda st=st, ov=ov, bn=bn: gluon_attention(
                q, k, v, stages=st, overlap=ov, block_n=bn))
            for vn, (st, ov, bn) in _variants(d).items()
        },  # fmt: skip
        "RoPE pass + gluon_overlap_3st": rope_then_gluon,
        "gluon fused RoPE (Q in kernel, K pass)": lambda: gluon_rope_attention(q, k, v, inv_freq)[0],
        "rope_attention auto (RoPE)": lambda: rope_attention(q, k, v, inv_freq=inv_freq),
        "rope_attention fused (RoPE)": lambda: rope_attention(q, k, v, inv_freq=inv_freq, impl="fused"),
    }  # fmt: skip
    rows, floor = [], None
    for provider, fn in providers.items():
        try:
            o = fn()
            torch.cuda.synchronize()
            err = ""
            if "gluon" in provider:
                r, bound, who = (ref, base, "cuDNN") if "no RoPE" in provider else (
                    ref_rope, base_rope, "Triton fused")  # fmt: skip
                e = (o.float() - r).abs().max().item()
                err = f"{e:.1e} ({'ok' if e <= 2 * bound else 'FAIL'}: {who} {bound:.1e})"
            ms = time_ms(fn)[0]
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            ms, err = float("nan"), f"failed: {type(e).__name__}: {str(e)[-200:]}"
        floor = ms if floor is None else floor
        flops = 4 * b * hq * n * n * d / 2  # causal: half the pairs
        rows.append({"shape": f"{name} ({b},{hq}/{hkv},{n},{d})", "dtype": str(dtype)[6:],
                     "provider": provider, "ms": ms, "tflops": flops / ms / 1e9,
                     "x_cudnn": ms / floor, "max_abs_err": err})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a, no GPU")
    parser.add_argument("--out", type=Path, help="folder for the markdown report")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"])
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    if args.offline:
        _offline_report()
        return
    from experiments.results_io import environment, markdown_table, print_report

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_check:
        check(args.out)
    rows = bench(args.shapes, [getattr(torch, name) for name in args.dtypes])
    env = environment()
    text = (
        "# A warp-specialized attention forward in Gluon against cuDNN (probe)\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}. "
        "Causal, forward; ms = median GPU time (CUDA graph); x_cudnn = ms / cuDNN's ms.\n\n"
        + markdown_table(rows, list(rows[0]))
    )
    print_report(text, None if args.out is None else args.out / "gluon_attention_probe.md")


if __name__ == "__main__":
    main()
