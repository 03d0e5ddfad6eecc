"""Shared pieces of the fused RoPE attention kernels (``attention_forward.py``,
``attention_backward.py``): autotune config lists, the cos/sin tables and the kernel that
builds them, the pass that rotates K (and, for the backward, Q) once a call, the Triton
helpers that load and rotate tiles and form the scores, and the launchers' argument helpers.

The loops would rotate each key tile again for every query tile (and each query tile for
every key tile in the dK/dV pass), so the launchers rotate k (forward) and q, k (backward)
once a call into scratch buffers (``_rotated_segments``, ``_rotate_kernel``) that the loops
only load (``_load_segments``): 1.3-1.6x faster than rotating in the loops
(``fused_rope/README.md``, "Measured"). The forward rotates its own Q tile once a program,
and the backward's dQ and dK leave rotated by ``-theta``. cos/sin come from tables of
``positions * inv_freq`` that the launcher builds once a call (``_rope_tables``: ``[N, R/2]``
or ``[B, N, R/2]``, fp32, or fp16 for bf16 inputs; for the default positions a few MB that
stay in L2). The head dim is handled as three segments: the two
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

Tried and not kept: V read through a TMA descriptor (forward, H200: 1-4% slower at 2K to
16K tokens). One tile for the rotated Q and K, so one dot for the scores, with K and V through
TMA descriptors (session 36: up to 11% slower; a Q tile computed in registers feeds the
tensor cores from registers, re-read every key tile). Triton 3.6's Hopper warp specialization
aborts on the forward's key loop (``fused_rope/README.md``).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from fused_rope._intmath import cdiv, next_power_of_2
from fused_rope._trig import cos_sin_of_angle
from fused_rope._validation import interpreting

_INTERPRET = interpreting()
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2

# FUSED_ROPE_AUTOTUNE=0 keeps one config per kernel: GPU test sweeps compile each
# (head dim, rope dim, layout, causal, dtype) combination once instead of once per config.
_AUTOTUNE = os.environ.get("FUSED_ROPE_AUTOTUNE", "1") != "0"


def _configs(tiles):
    """Autotune configs from ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; the last is the
    untuned one. The lists are short because every config is a compilation per combination
    of dtype, head dim, layout and causality. ptxas on sm_90 shows the kernels at
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
_SIZES = ["GROUP", "NQ", "NK", "window", "SECTION"]
# window: a sliding window skips most key tiles, so it changes the best tile; one tuning per
# window size (a model has one or two)
_AUTOTUNE_KEY = ["NQ", "NK", "window", "BLOCK_D", "HALF", "PASS", "CAUSAL", "INTERLEAVED"]


@triton.jit
def _visible(keep, i, j, offset, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """``keep`` and whether query ``i`` sees key ``j`` (broadcast against each other:
    ``offs_m[:, None]`` and ``offs_n[None, :]``, or transposed): ``j <= i + offset`` (causal,
    bottom-right aligned) and ``j > i + offset - window`` (a sliding window of ``window``
    keys, the query's own included)."""
    if CAUSAL:
        keep = keep & (j <= i + offset)
    if WINDOWED:
        keep = keep & (j > i + offset - window)
    return keep


@triton.jit
def _key_ranges(
    start_m,
    offset,
    NK,
    window,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``(lo, full_lo, full_end, hi)`` for the query tile ``[start_m, start_m + BLOCK_M)`` of a
    query-major loop (forward, dQ): the key tiles ``[full_lo, full_end)`` are seen whole by every
    query of the tile (no mask arithmetic); ``[lo, full_lo)`` (the window's edge) and
    ``[full_end, hi)`` (the diagonal, and keys past NK) need the mask; keys outside
    ``[lo, hi)`` are seen by none of the tile's queries."""
    if CAUSAL:
        hi = tl.maximum(tl.minimum(NK, start_m + BLOCK_M + offset), 0)
        # keys <= start_m + offset are visible to every query of the tile
        full_end = tl.minimum(tl.maximum(start_m + offset + 1, 0), NK) // BLOCK_N * BLOCK_N
    else:
        hi = NK
        full_end = NK // BLOCK_N * BLOCK_N
    lo = 0
    full_lo = 0
    if WINDOWED:  # causal only: keys > start_m + offset - window are in the first query's window
        lo = tl.maximum(start_m + offset - window + 1, 0) // BLOCK_N * BLOCK_N
        # ... and keys >= start_m + BLOCK_M + offset - window in every query's window
        edge = tl.maximum(start_m + BLOCK_M + offset - window, 0)
        full_lo = tl.minimum(tl.cdiv(edge, BLOCK_N) * BLOCK_N, full_end)  # >= lo
    return lo, full_lo, full_end, hi


@triton.jit
def _load_cos_sin(COS, SIN, rows, row_mask, HALF: tl.constexpr):
    """cos/sin ``[ROWS, HALF]`` (fp32) of the ``rows``' angles, from ``[rows, HALF]`` tables
    (``_rope_tables``; masked rows get the identity rotation)."""
    offs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    cos = tl.load(COS + offs, mask=row_mask[:, None], other=1.0).to(tl.float32)
    sin = tl.load(SIN + offs, mask=row_mask[:, None], other=0.0).to(tl.float32)
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
def _load_segments(
    X,
    rows,
    row_mask,
    stride_n,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
):
    """``x1r, x2r, xpr`` (as ``_load_rotated`` returns them) of rows of a buffer that
    ``_rotate_kernel`` wrote: the segments side by side, ``[.., HALF | HALF | PASS]``."""
    ptrs = X + rows[:, None] * stride_n
    offs_h = tl.arange(0, HALF)[None, :]
    x1 = tl.load(ptrs + offs_h, mask=row_mask[:, None], other=0.0)
    x2 = tl.load(ptrs + HALF + offs_h, mask=row_mask[:, None], other=0.0)
    if HEAD_DIM > ROPE_DIM:
        xp = tl.load(
            ptrs + 2 * HALF + tl.arange(0, PASS)[None, :], mask=row_mask[:, None], other=0.0
        )
    else:
        xp = tl.zeros((ROWS, PASS), dtype=x1.dtype)
    return x1, x2, xp


@triton.jit(do_not_specialize=["row_off", "H", "N"])  # no recompiling per length (_SIZES)
def _rotate_kernel(
    X,
    OUT,
    COS,
    SIN,
    scale,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_xd,
    stride_tb,
    row_off,
    H,
    N,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
):
    """Rows of ``HEADS`` heads of one batch of ``X [B, H, N, D]``, rotated and scaled by
    ``_load_rotated``, into ``OUT [B, H, N, W]`` with the segments side by side
    (``_load_segments``). The heads share the rows' cos and sin, loaded once: the tables
    (fp32 for fp16 inputs) hold twice the bytes of the rows they rotate."""
    groups = tl.cdiv(H, HEADS)
    b = (tl.program_id(1) // groups).to(tl.int64)
    h0 = ((tl.program_id(1) % groups) * HEADS).to(tl.int64)  # int64: the pointer offsets
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < N
    COS += b * stride_tb + row_off * HALF
    SIN += b * stride_tb + row_off * HALF
    cos, sin = _load_cos_sin(COS, SIN, rows, mask, HALF)
    width = 2 * HALF + (PASS if HEAD_DIM > ROPE_DIM else 0)
    offs_h = tl.arange(0, HALF)[None, :]
    for h in range(h0, tl.minimum(h0 + HEADS, H)):
        x1, x2, xp = _load_rotated(
            X + b * stride_xb + h * stride_xh, rows, mask, stride_xn, stride_xd,
            cos, sin, scale, BLOCK, HEAD_DIM, ROPE_DIM, HALF, PASS, INTERLEAVED,
        )  # fmt: skip
        out = OUT + ((b * H + h) * N + rows[:, None]) * width
        tl.store(out + offs_h, x1, mask=mask[:, None])
        tl.store(out + HALF + offs_h, x2, mask=mask[:, None])
        if HEAD_DIM > ROPE_DIM:
            tl.store(out + 2 * HALF + tl.arange(0, PASS)[None, :], xp, mask=mask[:, None])


# heads a program of ``_rotate_kernel`` rotates with one load of the tables (2: 0.3-1.5 us
# faster than 1 at issue 5's shapes on an H200; 4 and 8 no better: README, session 58)
ROTATE_HEADS = 2


def _rotated_segments(x, cos, sin, stride_tb: int, row_off: int, scale: float, meta: dict):
    """``x [B, H, N, D]`` rotated by the tables ``cos, sin`` (``_rope_tables``) and scaled
    by ``scale``, in ``x``'s dtype, as ``[B, H, N, W]`` with the segments side by side
    (``W = 2 HALF + PASS``, no ``PASS`` without pass-through channels): exactly the tiles
    ``_load_rotated`` forms, for kernels that would otherwise rotate a tile many times."""
    B, H, N, D = x.shape
    half, pas = meta["HALF"], meta["PASS"]
    width = rotated_width(meta["HEAD_DIM"], meta["ROPE_DIM"])
    out = torch.empty((B, H, N, width), device=x.device, dtype=x.dtype)
    block = 16 if _INTERPRET else 64
    heads = min(ROTATE_HEADS, H)
    _rotate_kernel[(cdiv(N, block), B * cdiv(H, heads))](
        x, out, cos, sin, scale, *x.stride(), stride_tb, row_off, H, N,
        meta["HEAD_DIM"], meta["ROPE_DIM"], half, pas, meta["INTERLEAVED"], block, heads,
    )  # fmt: skip
    return out


# L2 bytes that a section of heads' streamed operands may take (``heads_per_section``), by the
# axis its programs run along. An H200 (``experiments/results/time_grid_order_h200.md``, session
# 61): the query-major kernels (forwards, dQ), which stream K and V, ran fastest with 8 MiB (32
# MiB: up to 4% slower, one section of every head up to 9%; an H100's or H200's 50 MB of L2 is
# two partitions); the dK/dV pass, which streams Q and dO of a whole group, with 32 MiB (with 8,
# a GQA-4 group at 4K keys fills a section alone, and its key tiles launched in order took 1.1x
# the time).
L2_SECTION_BYTES = {"query": 8 * 2**20, "key": 32 * 2**20}


def heads_per_section(bytes_per_head: int, major: str) -> int:
    """Heads whose programs a ``_sectioned_program`` grid launches together: the largest
    power of two of them whose streamed operands (``bytes_per_head`` each: the K and V that
    a query head's programs read, or the Q and dO of a KV head's group) fit in
    ``L2_SECTION_BYTES[major]`` (``major``: "query" or "key", the programs' axis), at least 1.
    Each program then finds in L2 what its section's other programs read."""
    budget = L2_SECTION_BYTES[major]
    return 1 << max((budget // max(bytes_per_head, 1)).bit_length() - 1, 0)


@triton.jit
def _sectioned_program(n_blocks, SECTION, DESCENDING: tl.constexpr):
    """``(block, bh)``, int32, of ``program_id(0)`` in a 1-D grid of ``n_blocks`` tiles for
    each of ``num_programs(0) / n_blocks`` heads: section after section of ``SECTION`` heads
    (``heads_per_section``; the last may have fewer), and in each the heads fastest and the
    tiles in order (``DESCENDING``: from the last). So every head's longest causal sweep
    launches before any shorter one, and the short sweeps fill the last wave: with the tiles
    fastest, the longest sweeps of the last heads launched last and ran alone at the end (a
    list-scheduling model of 132 SMs: 84 against 75 tile times at 64 heads of 16 tiles)."""
    pid = tl.program_id(0)
    first = pid // (SECTION * n_blocks) * SECTION  # the section's first head
    heads = tl.minimum(SECTION, tl.num_programs(0) // n_blocks - first)
    r = pid - first * n_blocks
    block = r // heads
    if DESCENDING:
        block = n_blocks - 1 - block
    return block, first + r % heads


@triton.jit
def _query_program(NQ, HQ, GROUP, SECTION, BLOCK_M: tl.constexpr):
    """``(pid_m, b, h, hk)`` of a query-major program (forward, dQ) in a grid of
    ``cdiv(NQ, BLOCK_M) * B * HQ`` programs (``_sectioned_program``, the last query tiles,
    which have the most keys, first): its query tile, batch, query head and KV head (int64,
    for the pointer offsets)."""
    pid_m, pid_bh = _sectioned_program(tl.cdiv(NQ, BLOCK_M), SECTION, True)
    h = pid_bh % HQ
    return pid_m, (pid_bh // HQ).to(tl.int64), h.to(tl.int64), (h // GROUP).to(tl.int64)


@triton.jit
def _query_tile(
    Q,
    QCOS,
    QSIN,
    start_m,
    NQ,
    stride_qn,
    stride_qd,
    qk_scale,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """The rotated, scaled query tile of rows ``start_m ..`` (``q1, q2 [BLOCK_M, HALF]``,
    ``qp [BLOCK_M, PASS]``), with its rows and their mask."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_mask = offs_m < NQ
    cos, sin = _load_cos_sin(QCOS, QSIN, offs_m, m_mask, HALF)
    q1, q2, qp = _load_rotated(
        Q, offs_m, m_mask, stride_qn, stride_qd, cos, sin, qk_scale,
        BLOCK_M, HEAD_DIM, ROPE_DIM, HALF, PASS, INTERLEAVED,
    )  # fmt: skip
    return offs_m, m_mask, q1, q2, qp


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

    The backward passes ``cos, -sin`` (the rotation by ``-theta``): rotating the gradients
    w.r.t. the rotated segments by ``-theta`` is the transpose of the forward rotation."""
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
def _scores(
    a1,
    a2,
    ap,
    b1,
    b2,
    bp,
    HAS_PASS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SCORE_SCALE: tl.constexpr,
):
    """``SCORE_SCALE * a @ b^T`` summed over the three segments: ``[rows of a, rows of b]``
    fp32 (``SCORE_SCALE``: the part of the fold Q cannot carry, ``query_fold``)."""
    s = tl.dot(a1, tl.trans(b1), input_precision=INPUT_PRECISION)
    s = tl.dot(a2, tl.trans(b2), s, input_precision=INPUT_PRECISION)
    if HAS_PASS:
        s = tl.dot(ap, tl.trans(bp), s, input_precision=INPUT_PRECISION)
    if SCORE_SCALE != 1.0:
        s = s * SCORE_SCALE
    return s


def query_fold(softmax_scale: float, dtype: torch.dtype) -> tuple[float, float]:
    """``(q_fold, score_scale)``: the factor the rotated Q carries and the power of two the
    fp32 scores are multiplied by, whose product is ``softmax_scale * log2(e)``.

    The whole fold goes into Q (``score_scale = 1``, no per-score multiply) except for fp16
    inputs with ``softmax_scale * log2(e) > 1`` (``softmax_scale > 0.69``: a scale folded into
    the weights, T5-style, or a large temperature), where Q rounded to fp16 after the fold
    could overflow a value below fp16's largest: Q then carries at most 1 and the scores take
    the rest, a power of two so that their multiply is exact (and one kernel variant serves a
    range of scales)."""
    fold = softmax_scale * _LOG2E
    if dtype != torch.float16 or fold <= 1.0:
        return fold, 1.0
    score_scale = 2.0 ** math.ceil(math.log2(fold))
    return fold / score_scale, score_scale


def segment_dims(head_dim: int, rope_dim: int) -> tuple[int, int]:
    """``(HALF, PASS)``: the widths of a rotated half and of the pass-through segment in the
    kernels' tiles, powers of two of at least 16 (``tl.dot``'s inner dims)."""
    pass_dim = head_dim - rope_dim
    return max(16, next_power_of_2(rope_dim // 2)), max(16, next_power_of_2(pass_dim or 1))


def rotated_width(head_dim: int, rope_dim: int) -> int:
    """``W``, the row width of the rotated copies of q and k (``_rotated_segments``): at least
    ``head_dim``, so their rows, not the inputs', bound the kernels' int32 offsets."""
    half, pas = segment_dims(head_dim, rope_dim)
    return 2 * half + (pas if head_dim > rope_dim else 0)


def _meta(
    head_dim: int,
    rope_dim: int,
    interleaved: bool,
    causal: bool,
    dtype: torch.dtype,
    score_scale: float,
    window: int = 0,
):
    """Constexprs shared by every kernel. tl.dot needs inner dims >= 16, hence the floors.
    ``score_scale``: ``query_fold``'s; ``window``: the sliding window's keys (0: none)."""
    half, pas = segment_dims(head_dim, rope_dim)
    return dict(
        SCORE_SCALE=score_scale,
        HEAD_DIM=head_dim,
        ROPE_DIM=rope_dim,
        HALF=half,
        PASS=pas,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        INTERLEAVED=interleaved,
        CAUSAL=causal,
        WINDOWED=window > 0,
        # fp32 inputs exist for tests: keep their dots in full fp32, not TF32
        INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


def _table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The cos/sin tables' dtype for inputs of ``dtype``: fp16 for bf16 inputs, whose rotated
    q and k are rounded to bf16 (8 times coarser than fp16 near 1, so the table's rounding adds
    little), fp32 otherwise (fp16 tables would add about one fp16 rounding to the rotated fp16
    q and k). Half the bytes matter: in an A/B with fp16 inputs, fp16 tables were 13-18%
    faster than fp32 ones (``fused_rope/README.md``), a gain bf16 inputs get at no cost in
    accuracy."""
    return torch.float16 if dtype == torch.bfloat16 else torch.float32


# _rope_table_kernel's sources of the angles
FROM_RANGE = tl.constexpr(0)
FROM_POSITIONS = tl.constexpr(1)
FROM_ANGLES = tl.constexpr(2)


@triton.jit(do_not_specialize=["rows", "first"])
def _rope_table_kernel(
    ROWS, INV_FREQ, COS, SIN, rows, first, half_rope, factor, SOURCE: tl.constexpr,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Rows of ``_rope_tables``' tables for batch row ``program_id(1)``: the angles
    ``position * inv_freq`` (fp32, as ``rope_angles``) of positions ``first + row``
    (``SOURCE`` ``FROM_RANGE``) or loaded from ``ROWS [1 | B, rows]`` (``FROM_POSITIONS``), or
    the angles loaded from ``ROWS [1 | B, rows, half_rope]`` (``FROM_ANGLES``); accurate cos and
    sin times ``factor`` (the attention factor; the padding columns keep angle 0's 1 and 0),
    stored in the tables' dtype."""
    b = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < rows
    cols = tl.arange(0, HALF)
    col_ok = cols < half_rope
    if SOURCE == FROM_ANGLES:
        angle = tl.load(
            ROWS + (b * rows + offs)[:, None] * half_rope + cols[None, :],
            mask=mask[:, None] & col_ok[None, :],
            other=0.0,
        )
    else:
        if SOURCE == FROM_POSITIONS:
            pos = tl.load(ROWS + b * rows + offs, mask=mask, other=0.0)
        else:
            pos = (offs + first).to(tl.float32)
        angle = pos[:, None] * tl.load(INV_FREQ + cols, mask=col_ok, other=0.0)[None, :]
    cos, sin = cos_sin_of_angle(angle, False)  # accurate: a table serves every tile
    cos = tl.where(col_ok[None, :], cos * factor, cos)
    sin = sin * factor
    out = (b * rows + offs)[:, None] * HALF + cols[None, :]
    tl.store(COS + out, cos.to(COS.dtype.element_ty), mask=mask[:, None])
    tl.store(SIN + out, sin.to(SIN.dtype.element_ty), mask=mask[:, None])


def _rope_tables(
    inv_freq, q_pos, k_pos, nq: int, nk: int, half: int, dtype: torch.dtype, factor: float = 1.0
) -> tuple:
    """The kernels' cos/sin tables and how they index them: ``(QCOS, QSIN, KCOS, KSIN,
    stride_qtb, stride_ktb, q_row_off, k_row_off)``. Query row ``i`` of batch ``b`` finds its
    angles at row ``q_row_off + i`` of batch ``b`` (batch stride ``stride_qtb``, 0 for one
    batch row), key ``j`` likewise. Each table is ``[1 | B, rows, half]`` in the
    ``_table_dtype`` of the inputs' ``dtype``, the columns past ``R/2`` at angle 0; cos and sin
    times ``factor``, the attention factor of YaRN and LongRoPE (as Hugging Face's tables), so
    the rotated channels of q and k carry it, and their gradients' back-rotations too.

    Without position tensors the keys sit at ``0..NK-1`` and the queries at ``NK-NQ..NK-1``:
    one table from position ``min(0, NK-NQ)`` serves both. Position tensors (fp32
    ``[1 | B, N]``, contiguous, as ``rope_attention`` passes them) get a table each, and so do
    angle tensors (fp32 ``[1 | B, N, R/2]``, contiguous: M-RoPE and other schedules that are
    not one position times ``inv_freq``)."""
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos must both be tensors or both be None")
    half_rope = inv_freq.shape[0]
    for name, pos in (("q_pos", q_pos), ("k_pos", k_pos)):
        if pos is None:
            continue
        angles = pos.dim() == 3 and pos.shape[-1] == half_rope
        if pos.dtype != torch.float32 or not pos.is_contiguous() or not (angles or pos.dim() == 2):
            raise ValueError(
                f"{name} must be contiguous fp32 positions [1 | B, N] or angles [1 | B, N, "
                f"{half_rope}], got {pos.dtype} {tuple(pos.shape)}"
            )
    if q_pos is not None and q_pos.dim() != k_pos.dim():
        raise ValueError("q_pos and k_pos must both be positions or both be angles")
    dtype = _table_dtype(dtype)

    def table(pos, rows, first):
        batch = 1 if pos is None else pos.shape[0]
        cos = torch.empty((batch, rows, half), device=inv_freq.device, dtype=dtype)
        sin = torch.empty_like(cos)
        # 16 rows a program: a 64-row program's accurate sin/cos took 7.7 us at 2K rows
        # (32 programs; README, session 58)
        block = 16
        source = FROM_RANGE if pos is None else FROM_POSITIONS if pos.dim() == 2 else FROM_ANGLES
        _rope_table_kernel[(cdiv(rows, block), batch)](
            inv_freq if pos is None else pos, inv_freq, cos, sin, rows, first, half_rope,
            float(factor), source.value, half, block,
        )  # fmt: skip
        return cos, sin

    if q_pos is None:
        first = min(0, nk - nq)
        cos, sin = table(None, nk - first, first)
        return cos, sin, cos, sin, 0, 0, nk - nq - first, -first
    batch_stride = lambda t: t.stride(0) if t.shape[0] > 1 else 0
    q_cos, q_sin = table(q_pos, nq, 0)
    k_cos, k_sin = table(k_pos, nk, 0)
    return q_cos, q_sin, k_cos, k_sin, batch_stride(q_cos), batch_stride(k_cos), 0, 0
