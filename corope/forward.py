"""Co-RoPE-GQA forward in Triton: one streaming pass, O(N) memory (design: corope/README.md).

One program owns ``BLOCK_M`` query positions of one KV group and ALL ``G`` query heads of
that group, packed as ``COLS = G_PAD * BLOCK_M`` columns (head-major; the config's
``BLOCK_GM`` unless the group is wider) of key-major tiles ``[BLOCK_N, COLS]``, so that the
gate logits (``k @ q^T``) and ``O^T += V^T @ P^T`` are single tensor-core products. It sweeps
the key tiles from the diagonal DOWN to tile 0, so the mileage of a key is a running suffix
sum of the gates:

    delta[i, j] = carry[i] + local[i, j]
    carry[i]    = sum of z[i, t] over the tiles already swept (t above the current tile), fp64
    local[i, j] = exclusive suffix sum of z[i, t] inside the current tile  (0 <= local < BLOCK_N)

The phase ``delta * w`` is formed as ``(carry * w mod 2 pi) + local * w``: the large part is
reduced in fp64 once per (query, frequency) and tile, so the per-pair fast sin/cos (one per
(query, key, frequency), shared by the G heads) only sees arguments below ``2 pi + BLOCK_N w``
and the phase error does not grow with N.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from fused_rope._trig import cos_sin

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        # The interpreter runs every config it is given; one small one keeps the CPU tests quick.
        return [triton.Config({"BLOCK_GM": 64, "BLOCK_N": 32}, num_warps=4)]
    return [
        triton.Config({"BLOCK_GM": gm, "BLOCK_N": bn}, num_warps=nw, num_stages=1)
        # Few configs: each is compiled per (G_PAD, D, R, dtype) key. With 8 warps, a 64-key
        # tile puts the MMA layout's warps as [4, 2] and splits the heads over two warps (each
        # computes the pairs' sin/cos: twice the special-function work); 128 keys give [8, 1]
        # and no duplication (ptxas, sm_90, bf16, G = 4, D = 64 or 128: 252-254 registers, no
        # spill). Autotune chose (64, 128, 8) on an H200 at G = 4, D = 64 and 128 without the
        # frequency-loop pipelining (corope/PERF_NOTES.md, v1). (64, 128, 4): 4 keys a thread
        # share each frequency's per-thread work; timed alone on an H100 it was the fastest at
        # 3 of issue 3's 4 shapes (-5.6% at (1, 32/8, 128), N = 16K; PERF_NOTES, session 6).
        for gm, bn, nw in ((64, 64, 4), (64, 64, 8), (128, 64, 8), (64, 128, 8), (64, 128, 4))
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


@triton.autotune(
    configs=FWD_CONFIGS,
    # and the tensors' dtypes, which autotune adds. N_BUCKET: the best tile changes with N
    # (H100, (1, 8/2, 64): (64, 128, 8 warps) at N = 4K, (64, 64, 4 warps) 15% less time at 16K),
    # and a choice made at the first N seen was kept for every other.
    key=["G_PAD", "HEAD_DIM", "ROPE_DIM", "N_BUCKET"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _corope_fwd_kernel(
    Q, K, V, QT, KT, W, ANG, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tqb, stride_tqh, stride_tqd,  # QT: [B, HQ, R/2, N_PAD, 2] contiguous
    stride_tkb, stride_tkh, stride_tkd,  # KT: [B, HKV, R/2, N_PAD, 2] contiguous
    stride_ab,  # ANG: [B * HKV, N_ROWS * HALF_PAD] contiguous
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    HKV, N, gate_scale, qk_scale,
    N_BUCKET,  # autotune key only: N rounded up to a power of two (at least 512)
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
    # _prune gives autotuned launches a tile at least G_PAD columns wide; a single config
    # (pinned_config, the interpreter's) is not pruned, and a wider group takes one row.
    BLOCK_M: tl.constexpr = max(1, BLOCK_GM // G_PAD)
    COLS: tl.constexpr = G_PAD * BLOCK_M
    HALF: tl.constexpr = ROPE_DIM // 2
    # Longest key sweeps first, over all groups (the grid is 1-D, groups fastest): launched
    # in program order, the short sweeps then fill the last wave's gaps, where query tiles in
    # ascending order left the longest sweeps for the end.
    num_m = tl.cdiv(N, BLOCK_M)
    n_bg = tl.num_programs(0) // num_m  # B * HKV
    pid_bg = tl.program_id(0) % n_bg
    pid_m = num_m - 1 - tl.program_id(0) // n_bg
    # int64: batch and head offsets can pass 2**31 elements (within a group: check_index_span)
    b = (pid_bg // HKV).to(tl.int64)
    g = (pid_bg % HKV).to(tl.int64)
    h0 = g * G  # the group's first query head
    m0 = pid_m * BLOCK_M

    # Tiles are key-major: [BLOCK_N keys, COLS packed query columns], column
    # c = hh * BLOCK_M + ii is head g * G + hh at position m0 + ii. In the MMA accumulator
    # layout the high column bits (the head) sit in registers, so each thread holds every
    # head of its (key, query) pairs and the per-pair sin/cos is computed once for all G.
    cols = tl.arange(0, COLS)
    cols_h = cols // BLOCK_M
    cols_i = m0 + cols % BLOCK_M
    col_ok = (cols_h < G) & (cols_i < N)
    offs_d = tl.arange(0, HEAD_DIM)
    # q_t: [D, COLS], the columns of the tile
    q_t = tl.load(
        Q + b * stride_qb + h0 * stride_qh + cols_h[None, :] * stride_qh
        + cols_i[None, :] * stride_qn + offs_d[:, None] * stride_qd,
        mask=col_ok[None, :], other=0.0,
    )  # fmt: skip
    if ROPE_DIM < HEAD_DIM:
        q_pass = tl.where(offs_d[:, None] >= ROPE_DIM, q_t, tl.zeros_like(q_t))

    # The same columns as [G_PAD, BLOCK_M], for the per-frequency loads of the query.
    offs_h = tl.arange(0, G_PAD)
    offs_i = m0 + tl.arange(0, BLOCK_M)
    qcol_ok = ((offs_h < G)[:, None] & (offs_i < N)[None, :])[:, :, None]
    # QT holds (q1, q2) of a frequency side by side: one 8-byte load per column and frequency.
    qt_base = (
        QT + b * stride_tqb + h0 * stride_tqh + offs_h[:, None, None] * stride_tqh
        + offs_i[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    )  # fmt: skip

    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    kt_base = KT + b * stride_tkb + g * stride_tkh

    m_i = tl.full([COLS], float("-inf"), tl.float32)
    l_i = tl.zeros([COLS], tl.float32)
    acc = tl.zeros([HEAD_DIM, COLS], tl.float32)  # o transposed
    # fp64: the carry reaches N, and its phase carry * w is reduced modulo 2 pi exactly.
    carry = tl.zeros([BLOCK_M], tl.float64)
    # This program's slot of ANG: the carry's reduced angle of every (frequency, row) of the
    # current key tile, [HALF_PAD, BLOCK_M] (store_carry_angles); ang_row points at frequency
    # 0's row, frequency d is d * BLOCK_M further.
    offs_f = tl.arange(0, HALF_PAD)
    f_ok = (offs_f < HALF)[:, None]
    w64 = tl.load(W + offs_f[:, None], mask=f_ok, other=0.0).to(tl.float64)
    ang_row = ANG + pid_bg.to(tl.int64) * stride_ab + m0 * HALF_PAD + tl.arange(0, BLOCK_M)
    ang_ptrs = ang_row[None, :] + offs_f[:, None] * BLOCK_M

    # Key tiles from the one holding the last key any of these rows sees, down to tile 0.
    n_tiles = (tl.minimum(N, m0 + BLOCK_M) + BLOCK_N - 1) // BLOCK_N
    for step in range(0, n_tiles):
        offs_j = (n_tiles - 1 - step) * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = offs_j < N
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
        u = tl.reshape(tl.dot(k, q_t, input_precision=DOT_PRECISION), [BLOCK_N, G_PAD, BLOCK_M])
        if LEADER_MEAN:
            u_lead = tl.sum(u, axis=1) / G
        else:
            u_lead = tl.sum(tl.where(offs_h[None, :, None] == 0, u, 0.0), axis=1)
        causal = (offs_j[:, None] <= offs_i[None, :]) & key_ok[:, None]  # [BLOCK_N, BLOCK_M]
        z = tl.where(causal, tl.sigmoid(u_lead * gate_scale), 0.0)
        local = tl.cumsum(z, axis=0, reverse=True) - z

        store_carry_angles(ang_ptrs, carry, w64, f_ok)
        offs_pair = offs_j[:, None] * 2 + tl.arange(0, 2)[None, :]

        s3 = tl.zeros([BLOCK_N, G_PAD, BLOCK_M], tl.float32)
        # num_stages=3: Triton streams the loop's loads (w, the angles, the query and key
        # pairs) into shared memory two frequencies ahead (cp.async) and reads them in the
        # layout each use needs, with no conversion (corope/PERF_NOTES.md, session 9).
        for d in tl.range(HALF, num_stages=3):
            w = tl.load(W + d)
            ang_d = tl.load(ang_row + d * BLOCK_M)
            # fp32 columns with the softmax scale and log2(e) already folded in (launcher).
            # No `other`: a masked-out column (padded head, position >= N) only feeds its own
            # scores, softmax statistics and o column, none of which is stored.
            q1, q2 = tl.split(tl.load(qt_base + d * stride_tqd, mask=qcol_ok))
            k1, k2 = tl.split(
                tl.load(kt_base + d * stride_tkd + offs_pair, mask=key_ok[:, None], other=0.0)
            )
            cos_p, sin_p = cos_sin(ang_d[None, :] + local * w, FAST_TRIG)
            # The key rotated by -delta * w: computed once, used by all G heads.
            kr1 = k1[:, None] * cos_p + k2[:, None] * sin_p
            kr2 = k2[:, None] * cos_p - k1[:, None] * sin_p
            # Two separate accumulations: each compiles to one FMA per element, where
            # `s3 += a * b + c * d` would cost a multiply, an FMA and an add.
            s3 += kr1[:, None, :] * q1[None, :, :]
            s3 += kr2[:, None, :] * q2[None, :, :]
        s = tl.reshape(s3, [BLOCK_N, COLS])
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
        O + b * stride_ob + h0 * stride_oh + cols_h[None, :] * stride_oh
        + cols_i[None, :] * stride_on + offs_d[:, None] * stride_od
    )  # fmt: skip
    tl.store(o_ptrs, (acc / l_i[None, :]).to(O.dtype.element_ty), mask=col_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    lse_ptrs = LSE + b * stride_lb + h0 * stride_lh + cols_h * stride_lh + cols_i * stride_ln
    tl.store(lse_ptrs, lse, mask=col_ok)


@contextlib.contextmanager
def pinned_config(index: int):
    """Within the block the forward runs config ``index`` of ``FWD_CONFIGS`` with no tuning
    (a test of each config: autotune only ever runs the fastest). A single config skips
    ``_prune``, so at large groups it may run a tile the autotuner never would. Not
    thread-safe: it swaps the kernel's config list."""
    kernel = _corope_fwd_kernel
    saved = kernel.configs, kernel.cache
    try:
        kernel.configs, kernel.cache = [FWD_CONFIGS[index]], {}
        yield
    finally:
        kernel.configs, kernel.cache = saved


def rotary_pairs(x: torch.Tensor, rope_dim: int, n_pad: int) -> torch.Tensor:
    """The rotary pairs ``(x1, x2)`` of ``x`` ``[B, H, N, D]`` side by side in fp32,
    ``[B, H, R/2, n_pad, 2]`` (positions ``N:n_pad`` uninitialised): one frequency's pairs
    over consecutive positions are contiguous, so a kernel loads a pair with one 8-byte load
    and converts nothing."""
    B, H, N, D = x.shape
    if rope_dim % 2 or not 0 < rope_dim <= D:
        raise ValueError(f"rope_dim must be even and in (0, {D}], got {rope_dim}")
    if n_pad < N:
        raise ValueError(f"n_pad must be at least N = {N}, got {n_pad}")
    half = rope_dim // 2
    pairs = torch.empty(B, H, half, n_pad, 2, device=x.device, dtype=torch.float32)
    pairs[:, :, :, :N] = x[..., :rope_dim].unflatten(-1, (2, half)).permute(0, 1, 4, 2, 3)
    return pairs


def check_index_span(G: int, queries: dict, keys: dict) -> None:
    """Raises ``ValueError`` where the kernels' int32 offsets would overflow. They add batch and
    head-group offsets in int64 but index within one KV group in int32 (fewer registers in the
    loops): a query-shaped ``[B, HQ, N, D]`` tensor spans ``G`` heads there, a key-shaped
    ``[B, HKV, N, D]`` one a single head, and the launchers' own buffers (contiguous fp32, N
    padded to 8) ``G * N * D`` elements. ``queries``, ``keys``: name -> tensor."""
    limit = 2**31
    for heads, tensors in ((G, queries), (1, keys)):
        for name, x in tensors.items():
            _, _, N, D = x.shape
            span = 1 + sum(
                (n - 1) * st for n, st in zip((heads, N, D), x.stride()[1:], strict=True)
            )
            if span >= limit:
                raise ValueError(
                    f"{name} spans {span} elements within one KV group (heads {heads}, N={N}, "
                    f"D={D}, strides {tuple(x.stride())}), past the kernels' int32 indexing "
                    f"(2**31): make it contiguous, or use a shorter sequence or smaller groups"
                )
    _, _, N, D = next(iter(queries.values())).shape
    if G * triton.cdiv(N, 8) * 8 * D >= limit:
        raise ValueError(
            f"a KV group's G * N * D = {G} * {N} * {D} elements pass the kernels' int32 indexing "
            f"(2**31): use a shorter sequence or smaller groups"
        )


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

    Besides o and lse, the launch allocates the rotary pairs of q (scaled) and k in fp32
    (``rotary_pairs``) and a scratch of ``B * HKV * N * next_power_of_2(R / 2)`` fp32 (N
    rounded up to the largest tile's rows) where each program keeps its rows' reduced carry
    angles of the current key tile.
    """
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    G = HQ // HKV
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    check_index_span(G, dict(q=q), dict(k=k, v=v))
    # Positions padded to a multiple of 8 so that every stride is a multiple of 16 elements,
    # which lets the kernel's pair loads be 8-byte vectors. The padding is never read.
    n_pad = triton.cdiv(N, 8) * 8
    # q pre-scaled: the kernel loads each query pair once per key tile and frequency, so the
    # scale would otherwise be paid ~N / BLOCK_N times per element (in place: no second
    # fp32 copy of q at the peak).
    qt = rotary_pairs(q, rope_dim, n_pad).mul_(softmax_scale * LOG2E)
    kt = rotary_pairs(k, rope_dim, n_pad)
    g_pad = triton.next_power_of_2(G)
    half_pad = triton.next_power_of_2(rope_dim // 2)
    # Rows rounded up to the largest BLOCK_M = BLOCK_GM / G_PAD any config can take (powers of
    # two, so every other BLOCK_M divides it; _prune's fallback has BLOCK_M = 1).
    m_max = max(1, max(c.kwargs["BLOCK_GM"] for c in _corope_fwd_kernel.configs) // g_pad)
    ang = torch.empty(B * HKV, triton.cdiv(N, m_max) * m_max * half_pad, device=q.device,
                      dtype=torch.float32)  # fmt: skip
    w = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, HQ, N), device=q.device, dtype=torch.float32)
    if N == 0 or B == 0 or HQ == 0:
        return o, lse
    grid = lambda meta: (triton.cdiv(N, max(1, meta["BLOCK_GM"] // g_pad)) * B * HKV,)
    _corope_fwd_kernel[grid](
        q, k, v, qt, kt, w, ang, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *qt.stride()[:3], *kt.stride()[:3],
        ang.stride(0), *o.stride(), *lse.stride(),
        HKV, N, softmax_scale, softmax_scale * LOG2E, max(512, triton.next_power_of_2(N)),
        G=G, G_PAD=g_pad, HEAD_DIM=D, ROPE_DIM=rope_dim, HALF_PAD=half_pad,
        LEADER_MEAN=leader == "mean",
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FAST_TRIG=not _INTERPRET,
    )  # fmt: skip
    return o, lse


__all__ = [
    "FWD_CONFIGS",
    "SUPPORTED_HEAD_DIMS",
    "check_index_span",
    "corope_fwd",
    "pinned_config",
    "rotary_pairs",
]
