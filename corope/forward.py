"""Co-RoPE-GQA forward in Triton: one streaming pass, O(N) memory (design: corope/README.md).

One program owns ``BLOCK_M`` query positions of one KV group and ALL ``G`` query heads of
that group, packed as ``COLS = G_PAD * BLOCK_M`` rows (head-major) of the softmax tiles
``[COLS, BLOCK_N]``, so that the gate logits (``q @ k^T``) and ``O += P @ V`` are single
tensor-core products. It sweeps the key tiles from the diagonal DOWN to tile 0, so the mileage
of a key is a running suffix sum of the gates:

    delta[i, j] = carry[i] + local[i, j]
    carry[i]    = sum of z[i, t] over the tiles already swept (t above the current tile), fp64
    local[i, j] = exclusive suffix sum of z[i, t] inside the current tile  (0 <= local < BLOCK_N)

The phase ``delta * w`` is formed as ``(carry * w mod 2 pi) + local * w``: the large part is
reduced in fp64 once per (query, frequency) and tile, so the per-pair fast sin/cos (one per
(query, key, frequency), shared by the G heads) only sees arguments below ``2 pi + BLOCK_N w``
and the phase error does not grow with N.

The rotary scores are tensor-core products too: for each query row and chunk of
``FREQ_CHUNK`` frequencies, the tile's keys rotated by ``-delta w`` (``[BLOCK_N, 2 * 8]``,
computed once for the group, rounded to q's dtype) times the row's queries of all heads
(``[2 * 8, HP]``, the group padded to ``product_heads(G)``). The CUDA cores are left with the
phase, the sin/cos and the rotation."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from fused_rope._intmath import cdiv, next_power_of_2
from fused_rope._trig import cos_sin
from fused_rope._validation import INT32_INDEX_LIMIT, check_rope_dim, element_span, interpreting

_INTERPRET = interpreting()

LOG2E = 1.4426950408889634
# Frequencies per tensor-core product in the forward (its K axis is their 2 * 8 channels).
FREQ_CHUNK = tl.constexpr(8)
# Least head axis of that product: with one column Triton 3.6 computes it wrong on an H100
# (experiments/triton_batched_dot_one_column.py reproduces it alone).
MIN_PRODUCT_HEADS = tl.constexpr(2)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)


def product_heads(G: int) -> int:
    """The head axis of the forward's score product: the group padded to a power of two of at
    least ``MIN_PRODUCT_HEADS`` (the padded heads' queries are zeros)."""
    return max(MIN_PRODUCT_HEADS.value, next_power_of_2(G))


def freq_pad(rope_dim: int) -> int:
    """The forward's rotary frequencies padded to a power of two of at least one
    ``FREQ_CHUNK`` (the padded frequencies have zero pairs), so no chunk reads past a row."""
    return max(FREQ_CHUNK.value, next_power_of_2(rope_dim // 2))


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        # The interpreter runs every config it is given; one small one keeps the CPU tests quick.
        return [triton.Config({"BLOCK_GM": 64, "BLOCK_N": 32}, num_warps=4)]
    # BLOCK_GM = HP * BLOCK_M (HP = product_heads(G)): the (row, head) columns of the score
    # product, which bound its accumulators ([BLOCK_M, BLOCK_N, HP]) while HP <= BLOCK_GM; a
    # wider group takes one row a program.
    # maxnreg: the kernel waits on latency at two CTAs an SM (255 registers); at G = 4,
    # (16, 64) fits 168 registers without spilling (offline, sm_90a): three CTAs an SM.
    # (32, 64) at 128 registers (four CTAs) and 32-key tiles at three to six CTAs were no
    # faster on an H100 (experiments/results/time_corope_configs_h100.md).
    return [
        triton.Config({"BLOCK_GM": gm, "BLOCK_N": bn}, num_warps=4, num_stages=1, maxnreg=regs)
        for gm, bn, regs in (
            (16, 64, 168),
            (16, 64, 128),
            (32, 64, None),
            (32, 64, 168),
            (32, 128, None),
            (64, 64, None),
        )
    ]


@triton.jit
def store_carry_angles(ang_ptrs, carry, w64, f_ok):
    """Stores ``(carry * w) mod 2 pi`` at ``ang_ptrs`` ``[HALF_PAD, BLOCK_M]`` (fp32), for a
    frequency loop to load: ``carry`` ``[BLOCK_M]`` fp64, ``w64`` ``[HALF_PAD, 1]`` fp64,
    ``f_ok`` ``[HALF_PAD, 1]``: the frequencies that exist (the rest are not stored).

    Reduced in fp64 (a float literal would enter as fp32, hence the fp64 constants): the
    per-pair phase built from it stays below ``2 pi + BLOCK_N * w``, where the fast sin/cos is
    accurate, however large the carry. Done once a key tile by the whole program, where each
    thread holding a row would otherwise repeat the chain every frequency (the backward,
    whose second frequency loop is not pipelined, lost 9-18% by the same change). The
    barriers: no thread overwrites the previous tile's angles while another still reads them,
    and none reads before all are written.
    """
    two_pi = tl.full([1, 1], 6.283185307179586, tl.float64)
    inv_two_pi = tl.full([1, 1], 0.15915494309189535, tl.float64)
    ang = carry[None, :] * w64
    ang = ang - two_pi * tl.floor(ang * inv_two_pi)
    tl.debug_barrier()
    tl.store(ang_ptrs, ang.to(tl.float32), mask=f_ok)
    tl.debug_barrier()


FWD_CONFIGS = _configs()


def distinct_tiles(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The autotuner's early prune: the first of the configs that launch the same tile for
    this group. ``BLOCK_M = BLOCK_GM // HP`` is at least one row, so from HP = 32 on two
    ``BLOCK_GM`` give one tile, which would be compiled and timed twice."""
    hp = max(MIN_PRODUCT_HEADS.value, {**named_args, **kwargs}["G_PAD"])
    kept, seen = [], set()
    for config in configs:
        tile = (max(1, config.kwargs["BLOCK_GM"] // hp), config.kwargs["BLOCK_N"],
                config.num_warps, config.num_stages, config.maxnreg)  # fmt: skip
        if tile not in seen:
            seen.add(tile)
            kept.append(config)
    return kept


@triton.autotune(
    configs=FWD_CONFIGS,
    key=["G_PAD", "HEAD_DIM", "ROPE_DIM", "N_BUCKET", "WINDOWED"],
    prune_configs_by={"early_config_prune": distinct_tiles},
)
@triton.jit(do_not_specialize=["window"])  # no compile variant per window length
def _corope_fwd_kernel(
    Q, K, V, QC, KC, W, ANG, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_cqb, stride_cqh,  # QC: [B, HKV, N_PAD, HP, R_PAD] contiguous, q's dtype
    stride_ckb, stride_ckh,  # KC: [B, HKV, N_PAD, R_PAD] contiguous, fp32
    stride_ab,  # ANG: [B * HKV, N_ROWS * HALF_PAD] contiguous
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    HKV, NQ, NK, gate_scale, qk_scale,
    window,  # a sliding window's keys (WINDOWED), else unused
    N_BUCKET,  # autotune key only: the keys a row sweeps (NK or the window), a power of two >= 512
    WINDOWED: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    LEADER_MEAN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    BLOCK_GM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # The score product's head axis (product_heads): Triton 3.6 computes a 1-column product
    # (G = 1) wrongly on an H100, where 2 and 4 columns are right.
    HP: tl.constexpr = max(MIN_PRODUCT_HEADS, G_PAD)
    BLOCK_M: tl.constexpr = max(1, BLOCK_GM // HP)
    COLS: tl.constexpr = G_PAD * BLOCK_M
    HALF: tl.constexpr = ROPE_DIM // 2
    R_PAD: tl.constexpr = 2 * HALF_PAD
    # Frequencies per tensor-core product: their rotated key pairs are its K = 16 axis.
    DC: tl.constexpr = FREQ_CHUNK
    # Longest key sweeps first, over all groups (the grid is 1-D, groups fastest).
    num_m = tl.cdiv(NQ, BLOCK_M)
    n_bg = tl.num_programs(0) // num_m  # B * HKV
    pid_bg = tl.program_id(0) % n_bg
    pid_m = num_m - 1 - tl.program_id(0) // n_bg
    # int64: batch and head offsets can pass 2**31 elements (within a group: check_index_span)
    b = (pid_bg // HKV).to(tl.int64)
    g = (pid_bg % HKV).to(tl.int64)
    h0 = g * G  # the group's first query head
    m0 = pid_m * BLOCK_M
    # q's rows are the last NQ of the NK positions: row i is at position i + shift.
    shift = NK - NQ

    # Rows of the softmax tiles: c = hh * BLOCK_M + ii is head g * G + hh at row m0 + ii.
    cols = tl.arange(0, COLS)
    cols_h = cols // BLOCK_M
    cols_i = m0 + cols % BLOCK_M
    col_ok = (cols_h < G) & (cols_i < NQ)
    offs_d = tl.arange(0, HEAD_DIM)
    # [COLS, D]: the queries of the tile's rows
    q_rows = tl.load(
        Q + b * stride_qb + h0 * stride_qh + cols_h[:, None] * stride_qh
        + cols_i[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=col_ok[:, None], other=0.0,
    )  # fmt: skip
    if ROPE_DIM < HEAD_DIM:
        q_pass = tl.where(offs_d[None, :] >= ROPE_DIM, q_rows, tl.zeros_like(q_rows))

    offs_i = m0 + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, G_PAD)
    offs_hp = tl.arange(0, HP)
    offs_c = tl.arange(0, DC)
    offs_k2 = tl.arange(0, 2 * DC)
    # QC rows of this program, [BLOCK_M, 2 * DC, HP] at chunk 0: (q1, q2) of a frequency
    # side by side along the product's K axis, which is contiguous in memory (a head's
    # channels), so the load reaches the product's operand layout without a second trip
    # through shared memory (heads contiguous instead: 16-bit stores and loads a chunk).
    qc_ptrs = (
        QC + b * stride_cqb + g * stride_cqh
        + (offs_i[:, None, None] * HP + offs_hp[None, None, :]) * R_PAD
        + offs_k2[None, :, None]
    )  # fmt: skip
    qc_ok = (offs_i < NQ)[:, None, None]

    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    kc_base = KC + b * stride_ckb + g * stride_ckh

    m_i = tl.full([COLS], float("-inf"), tl.float32)
    l_i = tl.zeros([COLS], tl.float32)
    acc = tl.zeros([COLS, HEAD_DIM], tl.float32)
    # fp64: the carry reaches NK, and its phase carry * w is reduced modulo 2 pi exactly.
    carry = tl.zeros([BLOCK_M], tl.float64)
    # This program's slot of ANG: the carry's reduced angle of every (frequency, row) of the
    # current key tile, [HALF_PAD, BLOCK_M] (store_carry_angles).
    offs_f = tl.arange(0, HALF_PAD)
    f_ok = (offs_f < HALF)[:, None]
    w64 = tl.load(W + offs_f[:, None], mask=f_ok, other=0.0).to(tl.float64)
    ang_row = ANG + pid_bg.to(tl.int64) * stride_ab + m0 * HALF_PAD + tl.arange(0, BLOCK_M)
    ang_ptrs = ang_row[None, :] + offs_f[:, None] * BLOCK_M

    n_tiles = (tl.minimum(NK, shift + m0 + BLOCK_M) + BLOCK_N - 1) // BLOCK_N
    # The sweep stops at the tile of the first key the tile's rows see: the window's start
    # for its first row (a sliding window), else key 0.
    first_tile = 0
    if WINDOWED:
        first_tile = tl.maximum(shift + m0 - window + 1, 0) // BLOCK_N
    for step in range(0, n_tiles - first_tile):
        offs_j = (n_tiles - 1 - step) * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = offs_j < NK
        k = tl.load(
            k_base + offs_j[:, None] * stride_kn + offs_d[None, :] * stride_kd,
            mask=key_ok[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        v = tl.load(
            v_base + offs_j[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=key_ok[:, None],
            other=0.0,
        )

        # Gate logits of every head; the leader's are the first head's or the heads' mean
        # (a sum of exact products, so "mean" needs no separate averaged query).
        u = tl.reshape(
            tl.dot(q_rows, tl.trans(k), input_precision=DOT_PRECISION), [G_PAD, BLOCK_M, BLOCK_N]
        )
        if LEADER_MEAN:
            u_lead = tl.sum(u, axis=0) / G
        else:
            u_lead = tl.sum(tl.where(offs_h[:, None, None] == 0, u, 0.0), axis=0)
        # Keys before a row's window need no mask here: their gates reach only the mileages
        # of keys further back (the sweep descends), which the scores' mask hides.
        causal = (offs_j[None, :] <= shift + offs_i[:, None]) & key_ok[None, :]  # [BM, BN]
        z = tl.where(causal, tl.sigmoid(u_lead * gate_scale), 0.0)
        local = tl.cumsum(z, axis=1, reverse=True) - z

        store_carry_angles(ang_ptrs, carry, w64, f_ok)
        kc_ptrs = kc_base + offs_j[:, None] * R_PAD + offs_k2[None, :]  # [BLOCK_N, 2 * DC]

        # Scores of the rotary channels, one tensor-core product per query row and chunk of
        # DC frequencies: [BLOCK_N keys, 2 DC] (the key rotated by -delta w, computed once for
        # the group) @ [2 DC, HP heads] (the row's queries).
        s3 = tl.zeros([BLOCK_M, BLOCK_N, HP], tl.float32)
        # Two chunks an iteration: the second's sin/cos issue while the first's wait on their
        # loads and product (-4 to -6%, H100; 16 frequencies a chunk instead: +4 to +21%;
        # four chunks: +2 to +16%). The loads run one iteration ahead (num_stages=2; three
        # stages held 11 KB more shared memory and were 1-5% slower, H100).
        for c in tl.range(0, tl.cdiv(HALF, DC), num_stages=2, loop_unroll_factor=2):
            d = c * DC + offs_c
            w = tl.load(W + d, mask=d < HALF, other=0.0)
            # [BLOCK_M, DC]: the rows' reduced carry angles of the chunk's frequencies
            ang = tl.load(
                ang_row[:, None] + d[None, :] * BLOCK_M, mask=(d < HALF)[None, :], other=0.0
            )
            k1, k2 = tl.split(
                tl.reshape(
                    tl.load(kc_ptrs + c * 2 * DC, mask=key_ok[:, None], other=0.0),
                    [BLOCK_N, DC, 2],
                )
            )
            cos_p, sin_p = cos_sin(
                ang[:, None, :] + local[:, :, None] * w[None, None, :], FAST_TRIG
            )
            kr1 = k1[None, :, :] * cos_p + k2[None, :, :] * sin_p
            kr2 = k2[None, :, :] * cos_p - k1[None, :, :] * sin_p
            kr = tl.reshape(tl.join(kr1, kr2), [BLOCK_M, BLOCK_N, 2 * DC]).to(QC.dtype.element_ty)
            qc = tl.load(qc_ptrs + c * 2 * DC, mask=qc_ok, other=0.0)
            s3 = tl.dot(kr, qc, s3, input_precision=DOT_PRECISION)
        # [COLS, BLOCK_N]: the head blocks past G_PAD are zeros, so their sum is exact.
        s = tl.sum(tl.reshape(tl.permute(s3, (2, 0, 1)), [HP // G_PAD, COLS, BLOCK_N]), axis=0)
        if ROPE_DIM < HEAD_DIM:
            s += tl.dot(q_pass, tl.trans(k), input_precision=DOT_PRECISION)
        s = s * qk_scale
        mask = (offs_j[None, :] <= shift + cols_i[:, None]) & key_ok[None, :]
        if WINDOWED:
            mask &= offs_j[None, :] > shift + cols_i[:, None] - window
        s = tl.where(mask, s, float("-inf"))

        # Online softmax in base 2 along the keys. A row can be fully masked in a tile (the
        # first when BLOCK_M > BLOCK_N, the last ones past its window's start): its max stays
        # what it was (-inf before any key it sees, replaced by 0 in the exponents only).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
        # Summed in fp64: fp32 tile sums would each round, a random walk of ~1e-4 at N = 64K.
        carry += tl.sum(z.to(tl.float64), axis=1)

    o_ptrs = (
        O + b * stride_ob + h0 * stride_oh + cols_h[:, None] * stride_oh
        + cols_i[:, None] * stride_on + offs_d[None, :] * stride_od
    )  # fmt: skip
    tl.store(o_ptrs, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=col_ok[:, None])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    lse_ptrs = LSE + b * stride_lb + h0 * stride_lh + cols_h * stride_lh + cols_i * stride_ln
    tl.store(lse_ptrs, lse, mask=col_ok)


@contextlib.contextmanager
def pinned_config(index: int):
    """Within the block the forward runs config ``index`` of ``FWD_CONFIGS`` with no tuning
    (a test of each config: autotune only ever runs the fastest). Not thread-safe: it swaps
    the kernel's config list."""
    kernel = _corope_fwd_kernel
    saved = kernel.configs, kernel.cache
    try:
        kernel.configs, kernel.cache = [FWD_CONFIGS[index]], {}
        yield
    finally:
        kernel.configs, kernel.cache = saved


def check_rotation(inv_freq: torch.Tensor, rope_dim: int, head_dim: int) -> None:
    """The launchers' check of the rotation's size (``ValueError``): ``rope_dim`` even and in
    ``(0, D]`` (``fused_rope``'s ``check_rope_dim``: the kernels and copies read the first ``R``
    channels of every row), and ``R/2`` frequencies, which the kernels read (a shorter tensor
    would be read past its end)."""
    check_rope_dim(rope_dim, head_dim)
    if inv_freq.numel() != rope_dim // 2:
        raise ValueError(
            f"inv_freq must have rope_dim / 2 = {rope_dim // 2} elements, got {inv_freq.numel()}"
        )


def interleaved_pairs(
    x: torch.Tensor, rope_dim: int, n_pad: int, r_pad: int, g_pad: int, dtype=None
) -> torch.Tensor:
    """The rotary channels of ``x`` ``[B, HKV, G, N, D]`` as ``[B, HKV, n_pad, g_pad, r_pad]``
    (``[B, HKV, n_pad, r_pad]`` when ``g_pad`` is 1), in ``dtype`` (default x's), zero-padded:
    channel ``2 d + h`` holds ``x[..., h * R/2 + d]``, so a frequency's pair is adjacent along
    the forward's tensor-core K axis, which is the contiguous one."""
    B, HKV, G, N, D = x.shape
    check_rope_dim(rope_dim, D)
    for name, value, least in (
        ("n_pad", n_pad, N),
        ("r_pad", r_pad, rope_dim),
        ("g_pad", g_pad, G),
    ):
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    half = rope_dim // 2
    out = torch.zeros(B, HKV, n_pad, g_pad, r_pad, device=x.device, dtype=dtype or x.dtype)
    pairs = x[..., :rope_dim].unflatten(-1, (2, half)).transpose(-1, -2).flatten(-2)
    out[:, :, :N, :G, :rope_dim] = pairs.transpose(2, 3)
    return out.squeeze(3) if g_pad == 1 else out


def check_index_span(G: int, queries: dict, keys: dict) -> None:
    """Raises ``ValueError`` where the kernels' int32 offsets would overflow. They add batch and
    head-group offsets in int64 but index within one KV group in int32 (fewer registers in the
    loops): a query-shaped ``[B, HQ, N, D]`` tensor spans ``G`` heads there, a key-shaped
    ``[B, HKV, N, D]`` one a single head, and the launchers' own contiguous buffers at most
    ``product_heads(G) * N * D`` elements (N padded to 8; the forward's query copy pads the
    group's heads). ``queries``, ``keys``: name -> tensor."""
    for heads, tensors in ((G, queries), (1, keys)):
        for name, x in tensors.items():
            _, _, N, D = x.shape
            span = element_span((heads, N, D), x.stride()[1:])
            if span >= INT32_INDEX_LIMIT:
                raise ValueError(
                    f"{name} spans {span} elements within one KV group (heads {heads}, N={N}, "
                    f"D={D}, strides {tuple(x.stride())}), past the kernels' int32 indexing "
                    f"(2**31): make it contiguous, or use a shorter sequence or smaller groups"
                )
    _, _, N, D = next(iter(queries.values())).shape
    heads = product_heads(G)
    if heads * cdiv(N, 8) * 8 * D >= INT32_INDEX_LIMIT:
        padded = f" (G padded from {G})" if heads != G else ""
        raise ValueError(
            f"a KV group's G * N * D = {heads} * {N} * {D} elements{padded} pass the kernels' "
            f"int32 indexing (2**31): use a shorter sequence or smaller groups"
        )


def corope_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    softmax_scale: float,
    rope_dim: int,
    leader: str,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward kernel; unchecked: ``corope_attention`` validates first
    (shapes that do not match read and write out of range; the public API is ``corope``'s).

    Args:
        q: ``[B, HQ, NQ, D]``, the last ``NQ`` of k's positions (``NQ = NK`` in training;
            fewer: a chunk that continues a KV cache); k, v: ``[B, HKV, NK, D]``; any strides
            (copied to a contiguous last dim when needed), fp16, bf16 or fp32, on CUDA (or
            the CPU under ``TRITON_INTERPRET=1``). ``D`` in ``SUPPORTED_HEAD_DIMS``.
        inv_freq: ``[R/2]`` frequencies (any float dtype; used in fp32).
        softmax_scale: ``s``; scales the gate logits and the scores.
        rope_dim: ``R``, even, ``<= D``.
        leader: ``"first"`` or ``"mean"``.
        window: a causal sliding window of keys (``i + NK - NQ - window < j``), 0 for none;
            the sweep skips the key tiles before it, so its cost grows with ``NQ * window``.

    Returns:
        ``o`` ``[B, HQ, NQ, D]`` in q's dtype and ``lse`` ``[B, HQ, NQ]`` fp32, the natural-log
        log-sum-exp of the scaled scores over the keys each row sees (``j <= i + NK - NQ``,
        within the window).

    Besides o and lse, the launch allocates the rotary channels of q (in q's dtype, the group
    padded to ``product_heads(G)`` heads) and of k (fp32), interleaved by
    ``interleaved_pairs``, and a scratch of ``B * HKV * NQ * freq_pad(R)`` fp32 (NQ
    rounded up to the largest tile's rows) where each program keeps its rows' reduced carry
    angles of the current key tile.
    """
    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    G = HQ // HKV
    check_rotation(inv_freq, rope_dim, D)
    if NQ > NK:
        raise ValueError(f"q's rows are the last of k's positions: NQ={NQ} must be <= NK={NK}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    check_index_span(G, dict(q=q), dict(k=k, v=v))
    g_pad = next_power_of_2(G)
    hp = product_heads(G)
    half_pad = freq_pad(rope_dim)
    # positions padded to a multiple of 8 (zeros)
    qc = interleaved_pairs(q.unflatten(1, (HKV, G)), rope_dim, cdiv(NQ, 8) * 8,
                           2 * half_pad, hp)  # fmt: skip
    kc = interleaved_pairs(k.unsqueeze(2), rope_dim, cdiv(NK, 8) * 8, 2 * half_pad, 1,
                           torch.float32)  # fmt: skip
    # Rows rounded up to the largest BLOCK_M any config takes (powers of two, so every other
    # BLOCK_M divides it).
    m_max = max(1, max(c.kwargs["BLOCK_GM"] for c in _corope_fwd_kernel.configs) // hp)
    ang = torch.empty(B * HKV, cdiv(NQ, m_max) * m_max * half_pad, device=q.device,
                      dtype=torch.float32)  # fmt: skip
    w = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, HQ, NQ), device=q.device, dtype=torch.float32)
    if NQ == 0 or B == 0 or HQ == 0:
        return o, lse
    grid = lambda meta: (cdiv(NQ, max(1, meta["BLOCK_GM"] // hp)) * B * HKV,)
    _corope_fwd_kernel[grid](
        q, k, v, qc, kc, w, ang, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *qc.stride()[:2], *kc.stride()[:2],
        ang.stride(0), *o.stride(), *lse.stride(),
        HKV, NQ, NK, softmax_scale, softmax_scale * LOG2E, window,
        max(512, next_power_of_2(min(NK, window) if window else NK)),
        WINDOWED=window > 0, G=G, G_PAD=g_pad, HEAD_DIM=D, ROPE_DIM=rope_dim, HALF_PAD=half_pad,
        LEADER_MEAN=leader == "mean",
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # The hardware sin/cos for fp32 too, unlike fast_trig: the per-pair phases are reduced
        # below 2 pi + BLOCK_N * w, where its ~1e-6 error is under the fp32 phase's own rounding
        # (test_phase_precision_64k_gpu), and libm's made the fp32 forward's compile 2-3x longer
        # (sm_90a offline, D = 256: 8-24 s a config, 6 configs autotuned, against 3-8 s).
        FAST_TRIG=not _INTERPRET,
    )  # fmt: skip
    return o, lse


__all__ = [
    "FWD_CONFIGS",
    "SUPPORTED_HEAD_DIMS",
    "check_index_span",
    "corope_fwd",
    "freq_pad",
    "interleaved_pairs",
    "pinned_config",
    "product_heads",
]
