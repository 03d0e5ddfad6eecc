"""Co-RoPE-GQA fused backward: one query-major Triton kernel, no ``N x N`` tensor in memory.

The math (``corope/README.md``, ``shared/docs/corope.md``): per KV group, with the
leader's gates ``z[i, t]``, the mileage ``delta[i, j] = sum_{j < t <= i} z[i, t]``, the
phases ``phi = delta * w`` and the rotated keys ``Kr = Rot(-phi) k``,

* score path: ``dq[h, i] = s sum_j dS Kr``, ``dk[j] = s sum_{h, i} dS Rot(+phi) q[h, i]``;
* phase path: ``g[i, j] = s sum_h dS[h, i, j] sum_d w_d (q1 kr2 - q2 kr1)`` (because
  ``d kr1 / d phi = kr2`` and ``d kr2 / d phi = -kr1``);
* mileage path: ``dz[i, t] = sum_{j < t} g[i, j]``, an exclusive prefix sum along the keys;
* gate path: ``du = dz z (1 - z)``, ``dqL[i] = s sum_t du k[t]``, ``dk[t] += s sum_i du qL[i]``;
* frequency path (learned frequencies, ``freq_grad``): ``dw[d] = sum_{i, j} delta[i, j]
  s sum_h dS (q1 kr2 - q2 kr1)_d``, the phase path's per-frequency terms weighted by the
  mileage instead of summed with ``w``; each program stores its share, the launcher sums them.

One program owns ``BLOCK_M`` query rows of one KV group and all ``G`` heads of the
group (or a slice of them, one launch a slice, where shared memory is short), and
sweeps key tiles of ``BLOCK_N`` from the diagonal down to tile 0, exactly as the
forward does, so that ``delta`` is the same running suffix sum of gates. Short
sequences have too few query tiles to fill the GPU, so there the sweep is split: a
program takes ``key_tiles`` consecutive key tiles of one query tile, and starts its
carry from the gates of the tiles above its range (a pre-pass of gates only). Each key
tile takes two passes over the frequencies, one frequency an iteration: the first
builds the scores (``P`` needs every frequency), the second the gradients once ``dS``
is known. The backward therefore evaluates ``2 * R/2`` sines and ``2 * R/2`` cosines
per causal pair and group, twice the forward's count.

Layout (what makes it fast; ``corope/PERF_NOTES.md``, "Backward v2"): the per-pair
tiles are ``[BLOCK_M queries, GP heads, BLOCK_N keys]`` in the accumulator layout of
one tensor-core product (``_gates``), in which a thread holds 2 query rows, 8 keys and
every head of them. So a pair's sin/cos is computed once for the group, the head sums
``a = sum_h dS q_h`` (shared by dk and the phase gradient) and the phase gradient ``g``
are in-thread, and dq's sum over the keys is in-thread up to 2 shuffle levels; only
dk's sum over the queries crosses lanes (and, in the narrow tiles, warps: the 64-row
tiles add one partial a warp, in the deterministic mode each into a copy of its own). dq
and dk are added per frequency
with fp32 atomics, both halves of a rotary pair in one add, into buffers stored
positions-fastest so that those adds are vector adds into whole sectors.

The descending sweep has ``sum_{j >= t} g[i, j]`` over its own keys at hand (a running
suffix ``Sg``), not the prefix the mileage path needs. With ``T_s[i]`` the sum of ``g[i, j]``
over the keys of split ``s`` (written at the end of its sweep) and ``C_s = sum_{s' <= s}
T_s'``, a key ``t`` of split ``s`` has ``dz = C_s - Sg``. So the sweep adds the ``-Sg`` part
of the gate gradient (``-s sum_t Sg z' k[t]`` to ``dqL``, ``z' = z (1 - z)``, and ``-s sum_i
Sg z' qL[i]`` to the keys) as it goes, and a second, cheap kernel (``_gate_tail_kernel``:
gates only, one ``tl.dot`` and a sigmoid per tile) adds the ``C`` part once every split is
done. Unsplit, ``C`` is the row's total ``Gtot``.

Precision, as in the forward: the gates' carry is fp64, and the phase is formed as
``(carry w mod 2 pi) + local w`` with the reduction in fp64 and ``local < BLOCK_N``, so the
per-pair sin/cos (the hardware's fast approximations for fp16/bf16 inputs, accurate
ones for fp32) never sees a large argument and the phase error does not grow with N.
Products of an fp32 intermediate
(P, dS, the gate terms) with a half-precision input split the intermediate into a
high and a low half (two tensor-core products), which keeps them at fp32 accuracy.

dq, dk and dv are accumulated in fp32 with atomic adds: dk and dv receive
contributions from every query tile that sees them, dq from every split of its query
tile; so by default two runs may differ in the last bits. ``deterministic=True`` gives
each split its own copy of dq (its rows then get one program's adds, in a fixed order;
the copies are summed afterwards, in a fixed order) and orders the dk and dv adds. The
query tiles form chains of consecutive tiles, each chain adding into copies of dk and dv
of its own (dk's score part one copy a warp's rows where the 64-row tiles add a partial a
warp; all summed afterwards, in a fixed order); per chain and key tile an int32 counter
says how many of the chain's query tiles have added to it, and query tile ``m`` waits
until every earlier one of its chain that sees the key tile has (a split of tile ``m``
sweeps the key tiles that the same split of tile ``m - 1`` swept, downwards, trailing it).
The chains are as short as the copies' memory bound (``DETERMINISTIC_COPY_BYTES``) allows,
which depends on ``B * HKV * N * D``: 2 tiles at (1, 32/8, 128), N = 1K; 16 of 32 at the
harness's (16, 8/2, 64), N = 2K; one chain of every tile at issue 3's 16K shape, whose copies
a warp would not fit (the mode takes 1.15-1.47x the default's time: ``PERF_NOTES.md``,
sessions 38 to 40).
Each fp32 buffer element then receives its adds in one fixed order, so two runs give bitwise
equal dk and dv. This relies on the GPU starting programs in grid order (a program only
waits on lower-numbered ones), as the interpreter does and as ordered split-K reductions
also assume.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from corope.forward import check_index_span
from corope.naive import check_corope_inputs
from fused_rope._device import num_sms
from fused_rope._intmath import cdiv, next_power_of_2
from fused_rope._trig import cos_sin, fast_trig
from fused_rope._validation import (
    KERNEL_DTYPES,
    check_bool,
    check_float_tensor,
    check_inv_freq,
    check_kernel_device,
    check_rope_dim,
    check_same_device,
    check_window,
    interpreting,
)


def rotary_pairs(x: torch.Tensor, rope_dim: int, n_pad: int) -> torch.Tensor:
    """The rotary pairs ``(x1, x2)`` of ``x`` ``[B, H, N, D]`` side by side in fp32,
    ``[B, H, R/2, n_pad, 2]`` (positions ``N:n_pad`` uninitialised): one frequency's pairs
    over consecutive positions are contiguous, so a kernel loads a pair with one 8-byte load
    and converts nothing."""
    B, H, N, D = x.shape
    check_rope_dim(rope_dim, D)
    if n_pad < N:
        raise ValueError(f"n_pad must be at least N = {N}, got {n_pad}")
    half = rope_dim // 2
    pairs = torch.empty(B, H, half, n_pad, 2, device=x.device, dtype=torch.float32)
    pairs[:, :, :, :N] = x[..., :rope_dim].unflatten(-1, (2, half)).permute(0, 1, 4, 2, 3)
    return pairs


@triton.jit
def _dot_split(a, b, PREC: tl.constexpr):
    """``a @ b`` where one operand is an fp32 intermediate and the other may be in the
    inputs' half-precision dtype, to about fp32 accuracy.

    The fp32 operand is split into a high and a low half-precision part (two tensor-core
    products) rather than converting the other to fp32: an fp32 operand of ``G * BLOCK_M x
    D`` would take three times its registers under tf32x3.
    """
    if a.dtype == b.dtype:
        return tl.dot(a, b, input_precision=PREC)
    if b.dtype == tl.float32:
        hi = b.to(a.dtype)
        return tl.dot(a, hi) + tl.dot(a, (b - hi.to(tl.float32)).to(a.dtype))
    hi = a.to(b.dtype)
    return tl.dot(hi, b) + tl.dot((a - hi.to(tl.float32)).to(b.dtype), b)


@triton.jit
def _gates(K, ql, n, offs_m, m_ok, offs_d, d_ok, N, scale, stride_kn, stride_kd, window,
           BLOCK_M: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr,
           PREC: tl.constexpr, WINDOWED: tl.constexpr):  # fmt: skip
    """Key tile ``n``: its offsets and mask ``[BLOCK_N]`` and the leader's gates
    ``z = sigmoid(s qL k^T)`` ``[BLOCK_M, BLOCK_N]`` (0 past the diagonal, and before the
    sliding window of ``window`` keys where ``WINDOWED``).

    The logits are one product against ``GP`` copies of the tile's keys, ``[BLOCK_M, GP *
    BLOCK_N]``, which is what fixes the layout of every per-pair tile of the kernel: in the
    product's accumulator layout the high column bits (the copy, later the head) are
    registers, so a thread holds all ``GP`` heads of its (query, key) pairs and computes
    each pair's sin/cos once for the group. The copies are equal; their max is exact.
    """
    r = tl.arange(0, GP * BLOCK_N)
    offs_r = n * BLOCK_N + r % BLOCK_N
    k_rep = tl.load(
        K + offs_r[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=(offs_r < N)[:, None] & d_ok[None, :],
        other=0.0,
    )
    u = tl.dot(ql, tl.trans(k_rep.to(ql.dtype)), input_precision=PREC)
    u = tl.max(tl.reshape(u, [BLOCK_M, GP, BLOCK_N]), axis=1) * scale
    offs_n = n * BLOCK_N + tl.arange(0, BLOCK_N)
    return (
        offs_n,
        offs_n < N,
        tl.where(_seen(offs_m, m_ok, offs_n, window, WINDOWED), tl.sigmoid(u), 0.0),
    )


@triton.jit
def _seen(offs_m, m_ok, offs_n, window, WINDOWED: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]``: whether query ``offs_m`` sees key ``offs_n`` (causal, and within
    its last ``window`` keys where ``WINDOWED``)."""
    seen = (offs_n[None, :] <= offs_m[:, None]) & m_ok[:, None]
    if WINDOWED:
        seen &= offs_n[None, :] > offs_m[:, None] - window
    return seen


@triton.jit
def _split_pair(x):
    """The two fp32 halves of an int64 holding a rotary pair ``(x1, x2)`` side by side."""
    x1 = x.to(tl.int32).to(tl.float32, bitcast=True)
    return x1, (x >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _load_heads(ptr, stride_h, m_ok, G: tl.constexpr, GP: tl.constexpr):
    """The G heads' rotary pairs ``q1, q2`` ``[BLOCK_M, GP]`` fp32 from ``ptr + h * stride_h``
    (``ptr`` ``[BLOCK_M]`` int64 pairs), 0 for padded heads.

    One ``[BLOCK_M]`` load per head: the compiler places a load of fewer elements than
    threads directly in its consumer's layout, whereas a ``[BLOCK_M, GP]`` load would be
    converted through shared memory (a barrier) every frequency. The selects cost nothing:
    the head index of a register is a compile-time constant.
    """
    offs_h = tl.arange(0, GP)[None, :]
    x1, x2 = _split_pair(tl.load(ptr, mask=m_ok, other=0))
    q1 = tl.where(offs_h == 0, x1[:, None], 0.0)
    q2 = tl.where(offs_h == 0, x2[:, None], 0.0)
    for hh in tl.static_range(1, G):
        x1, x2 = _split_pair(tl.load(ptr + hh * stride_h, mask=m_ok, other=0))
        q1 = tl.where(offs_h == hh, x1[:, None], q1)
        q2 = tl.where(offs_h == hh, x2[:, None], q2)
    return q1, q2


@triton.jit
def _frequency(QP, KP, W, d, offs_m, m_ok, offs_n, n_ok, carry, local, two_pi, inv_two_pi,
               stride_pqh, stride_pqd, stride_pkd,
               G: tl.constexpr, GP: tl.constexpr, FAST_TRIG: tl.constexpr):  # fmt: skip
    """Frequency ``d`` of one (query tile, key tile): ``w`` (scalar), the G heads' query
    pair ``q1, q2 [BLOCK_M, GP]``, the rotation ``cs, sn [BLOCK_M, BLOCK_N]`` (one sin/cos
    per pair, shared by the heads) and the rotated keys ``kr1, kr2 [BLOCK_M, BLOCK_N]``
    (``Rot(-phi) k``). ``QP``, ``KP``: the fp32 rotary pairs of q and k, one int64 each.

    The phase is formed as the forward forms it, ``phi = (carry w mod 2 pi) + local w``:
    the carry reaches N, so its angle is reduced modulo 2 pi in fp64 (``two_pi`` and
    ``inv_two_pi`` are fp64 tensors), and ``local < BLOCK_N``; the fp32 argument of the
    per-pair sin/cos stays small, where the fast hardware sin/cos is accurate.
    """
    w = tl.load(W + d)
    ang = carry * w
    ang = (ang - two_pi * tl.floor(ang * inv_two_pi)).to(tl.float32)
    cs, sn = cos_sin(ang[:, None] + local * w, FAST_TRIG)
    k1, k2 = _split_pair(tl.load(KP + d * stride_pkd + offs_n, mask=n_ok, other=0))
    k1 = k1[None, :]
    k2 = k2[None, :]
    q1, q2 = _load_heads(QP + d * stride_pqd + offs_m, stride_pqh, m_ok, G, GP)
    return w, q1, q2, cs, sn, k1 * cs + k2 * sn, k2 * cs - k1 * sn


@triton.jit
def _program_range(N, key_tiles, n_splits, chain, window, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DETERMINISTIC: tl.constexpr, WINDOWED: tl.constexpr,
                   SWEEP_M: tl.constexpr):  # fmt: skip
    """Program ``(m, split)`` of axis 0 and its key tiles ``[lo, hi)``: query tile ``m``, key
    tiles ``[first + split * key_tiles, first + (split + 1) * key_tiles)`` of its causal range
    (empty for the splits past it), and its chain ``c`` (deterministic mode; 0 otherwise).

    ``first`` is 0, or where ``WINDOWED`` the tile of the first key that the sweep's query tile
    holding these rows sees (the window's start for its first row). ``SWEEP_M``, the sweep's
    rows a tile (a multiple of BLOCK_M), anchors the splits: the gate tail, on fewer rows,
    takes the sweep's key tiles of each split (those past its rows' diagonals have no gates),
    as its per-split sums ``TG`` need.

    By default, longest sweeps first for load balance. The ordered (deterministic) mode cuts
    the query tiles into chains of ``chain`` consecutive tiles, each adding to dk and dv in a
    copy of its own, and needs a program to wait only on earlier programs of its chain: the
    chains' first tiles come first, then their second tiles, and so on, so that the query
    tiles running side by side belong to different chains (the last chain's last programs may
    be past the last query tile: empty)."""
    num_m = tl.cdiv(N, BLOCK_M)
    split = tl.program_id(0) % n_splits
    p = tl.program_id(0) // n_splits
    if DETERMINISTIC:
        chains = tl.cdiv(num_m, chain)
        c = p % chains
        m = c * chain + p // chains
    else:
        c = tl.full([], 0, tl.int32)
        m = num_m - 1 - p
    n_tiles = (tl.minimum(N, (m + 1) * BLOCK_M) + BLOCK_N - 1) // BLOCK_N
    first = 0
    if WINDOWED:
        first = tl.maximum(m * BLOCK_M // SWEEP_M * SWEEP_M - window + 1, 0) // BLOCK_N
    lo = tl.minimum(first + split * key_tiles, n_tiles)
    hi = tl.where(m < num_m, tl.minimum(lo + key_tiles, n_tiles), lo)
    return m, split, lo, hi, n_tiles, c


@triton.jit
def _wait_for_earlier_query_tiles(LOCK, n, m, c, chain, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr):  # fmt: skip
    """Spins until every query tile of chain ``c`` before ``m`` that sees key tile ``n`` has
    added to it (``LOCK[n]``, the chain's counter, counts them)."""
    first = tl.maximum(c * chain, n * BLOCK_N // BLOCK_M)
    while tl.atomic_add(LOCK + n, 0, sem="acquire") != m - first:
        pass


@triton.jit(do_not_specialize=["chain", "window"])  # no compile variant per chain or window
def _corope_bwd_kernel(
    Q, K, V, O, DO, LSE, QL, W, QP, KP,
    DQ, DQL, DK_S, DK_G, DV, TG, LOCK, DW,
    softmax_scale, N, HKV, group, key_tiles, n_splits, chain, window,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lb, stride_lh, stride_ln,
    stride_qlb, stride_qlh, stride_qln, stride_qld,
    stride_pqb, stride_pqh, stride_pqd,  # QP: [B, HQ, R/2, N] int64, unit stride along N
    stride_pkb, stride_pkh, stride_pkd,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_tgb, stride_tgs,  # TG: [B * HKV, n_splits, N] fp32
    stride_lock,
    stride_dwb,  # DW: [B * HKV, query tiles * n_splits, R/2] fp64
    stride_dq_split, stride_dql_split,  # DQ's and DQL's copies a split (0: one, shared)
    stride_dk_chain,  # DK_S's, DK_G's and DV's copies a chain (0: one, shared)
    stride_dk_part,  # DK_S's copies a row group (DK_PARTS; 0: one, shared)
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    HALF: tl.constexpr, DN_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MILEAGE: tl.constexpr, DETERMINISTIC: tl.constexpr, PREC: tl.constexpr,
    FAST_TRIG: tl.constexpr, DK_PARTS: tl.constexpr, PASS1_STAGES: tl.constexpr,
    FREQ_GRAD: tl.constexpr, HALF_P: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    m, split, lo, hi, n_tiles, c = _program_range(
        N, key_tiles, n_splits, chain, window, BLOCK_M, BLOCK_N, DETERMINISTIC, WINDOWED, BLOCK_M
    )
    if lo == hi:
        return  # a split past the query tile's causal range (TG is zeroed by the launcher)
    bg = tl.program_id(1)
    # int64: batch and head offsets can pass 2**31 elements (within a group: check_index_span)
    b = (bg // HKV).to(tl.int64)
    grp = (bg % HKV).to(tl.int64)
    # The group's first head; Q, O, DQ, ... are views that start at the slice's first head.
    h0 = grp * group
    scale = softmax_scale
    ROPE: tl.constexpr = 2 * HALF

    Q += b * stride_qb + h0 * stride_qh
    O += b * stride_ob + h0 * stride_oh
    DO += b * stride_dob + h0 * stride_doh
    LSE += b * stride_lb + h0 * stride_lh
    DQ += b * stride_dqb + h0 * stride_dqh + split.to(tl.int64) * stride_dq_split
    K += b * stride_kb + grp * stride_kh
    V += b * stride_vb + grp * stride_vh
    QL += b * stride_qlb + grp * stride_qlh
    QP += b * stride_pqb + h0 * stride_pqh
    KP += b * stride_pkb + grp * stride_pkh
    kv_off = b * stride_dkb + grp * stride_dkh
    DQL += kv_off + split.to(tl.int64) * stride_dql_split
    chain_off = kv_off + c.to(tl.int64) * stride_dk_chain
    DK_S += chain_off
    DK_G += chain_off
    DV += chain_off
    TG += bg.to(tl.int64) * stride_tgb + split.to(tl.int64) * stride_tgs
    LOCK += bg * stride_lock + c * tl.cdiv(N, BLOCK_N)
    DW += bg.to(tl.int64) * stride_dwb + (m * n_splits + split) * HALF

    # The per-pair tiles are [BLOCK_M queries, GP heads, BLOCK_N keys] (layout: `_gates`);
    # the queries' (row, head) grid is [BLOCK_M, GP].
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < N
    offs_h = tl.arange(0, GP)
    qh_ok = m_ok[:, None] & (offs_h < G)[None, :]
    # The same rows as one head-major [GP * BLOCK_M] axis, for the tensor-core products.
    r = tl.arange(0, GP * BLOCK_M)
    h_r = r // BLOCK_M
    i_r = m * BLOCK_M + r % BLOCK_M
    row_ok = (h_r < G) & (i_r < N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    rd_mask = row_ok[:, None] & d_ok[None, :]
    md_mask = m_ok[:, None] & d_ok[None, :]
    if DN_PAD > 0:
        offs_p = ROPE + tl.arange(0, DN_PAD)
        p_ok = offs_p < D

    drow = tl.sum(
        tl.load(
            DO + offs_m[:, None, None] * stride_don + offs_h[None, :, None] * stride_doh
            + offs_d[None, None, :] * stride_dod,
            mask=qh_ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
        ).to(tl.float32)
        * tl.load(
            O + offs_m[:, None, None] * stride_on + offs_h[None, :, None] * stride_oh
            + offs_d[None, None, :] * stride_od,
            mask=qh_ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
        ).to(tl.float32),
        axis=2,
    )  # fmt: skip
    lse2 = (
        tl.load(LSE + offs_m[:, None] * stride_ln + offs_h[None, :] * stride_lh, mask=qh_ok,
                other=0.0)
        * 1.4426950408889634
    )  # fmt: skip

    two_pi = tl.full([BLOCK_M], 6.283185307179586, tl.float64)
    inv_two_pi = tl.full([BLOCK_M], 0.15915494309189535, tl.float64)
    # Gates of the keys in later tiles; fp64 like the forward's, as it grows to N. A split
    # starts from the gates of the tiles above it (gates only: one product a tile).
    carry_z = tl.zeros([BLOCK_M], dtype=tl.float64)
    ql = tl.load(
        QL + offs_m[:, None] * stride_qln + offs_d[None, :] * stride_qld, mask=md_mask, other=0.0
    )
    for step in range(0, n_tiles - hi):
        _offs_n, _n_ok, z = _gates(
            K, ql, n_tiles - 1 - step, offs_m, m_ok, offs_d, d_ok, N, scale, stride_kn,
            stride_kd, window, BLOCK_M, GP, BLOCK_N, PREC, WINDOWED,
        )  # fmt: skip
        carry_z += tl.sum(z, axis=1).to(tl.float64)
    carry_g = tl.zeros([BLOCK_M], dtype=tl.float32)  # phase gradient of the split's later keys
    freq = tl.arange(0, HALF_P)
    # FREQ_GRAD: the program's share of dL/dw, summed in fp64 over its key tiles (a long
    # serial sum; each tile's own sum is a tree in fp32)
    dw = tl.zeros([HALF_P], dtype=tl.float64)
    for step in range(0, hi - lo):
        n = hi - 1 - step
        # Row operands are reloaded per key tile (cache hits) rather than held: with
        # BLOCK_M = 64 rows they would take registers the frequency loops need.
        ql = tl.load(
            QL + offs_m[:, None] * stride_qln + offs_d[None, :] * stride_qld,
            mask=md_mask,
            other=0.0,
        )
        offs_n, n_ok, z = _gates(
            K, ql, n, offs_m, m_ok, offs_d, d_ok, N, scale, stride_kn, stride_kd, window,
            BLOCK_M, GP, BLOCK_N, PREC, WINDOWED,
        )  # fmt: skip
        # The forward's mileage: delta = carry + in-tile exclusive suffix sum of the gates.
        local = tl.cumsum(z, axis=1, reverse=True) - z

        # Pass 1: scores of the G heads.
        s3 = tl.zeros([BLOCK_M, GP, BLOCK_N], dtype=tl.float32)
        # PASS1_STAGES (_pass1_stages) > 1: the q, k and w loads stream into shared memory
        # that many frequencies ahead, less one (cp.async), as in the forward. Two
        # frequencies an iteration, so that one's sin/cos issue while the other's wait on
        # their loads (H200: -3% backward time at (1, 32/8, 128) N = 16K, -8% at (1, 8/2,
        # 64) 4K; the second loop unrolled, or pipelined, lost 4-10%).
        for d in tl.range(HALF, num_stages=PASS1_STAGES, loop_unroll_factor=2):
            _w, q1, q2, _cs, _sn, kr1, kr2 = _frequency(
                QP, KP, W, d, offs_m, m_ok, offs_n, n_ok, carry_z, local, two_pi, inv_two_pi,
                stride_pqh, stride_pqd, stride_pkd, G, GP, FAST_TRIG,
            )  # fmt: skip
            # The forward's scores (and so lse) come from the rotated keys rounded to the
            # inputs' dtype, its tensor cores' operands: P is recomputed from the same keys
            # (unrounded, half-precision P drifted from lse with the logits' size: dv off by
            # 342 at fp16 logits of ~1e3, against 0.2 for a rounded-key reference).
            kr1 = kr1.to(K.dtype.element_ty).to(tl.float32)
            kr2 = kr2.to(K.dtype.element_ty).to(tl.float32)
            # Two accumulations: one FMA per element each.
            s3 += q1[:, :, None] * kr1[:, None, :]
            s3 += q2[:, :, None] * kr2[:, None, :]
        if DN_PAD > 0:
            qn2 = tl.load(
                Q + h_r[:, None] * stride_qh + i_r[:, None] * stride_qn
                + offs_p[None, :] * stride_qd,
                mask=row_ok[:, None] & p_ok[None, :],
                other=0.0,
            )  # fmt: skip
            kn = tl.load(
                K + offs_n[:, None] * stride_kn + offs_p[None, :] * stride_kd,
                mask=n_ok[:, None] & p_ok[None, :],
                other=0.0,
            )
            sn2 = tl.dot(qn2, tl.trans(kn), input_precision=PREC)
            s3 += tl.permute(tl.reshape(sn2, [GP, BLOCK_M, BLOCK_N]), (1, 0, 2))
        valid = qh_ok[:, :, None] & _seen(offs_m, m_ok, offs_n, window, WINDOWED)[:, None, :]
        p3 = tl.where(valid, tl.exp2(s3 * (scale * 1.4426950408889634) - lse2[:, :, None]), 0.0)
        do_ptrs = DO + h_r[:, None] * stride_doh + i_r[:, None] * stride_don
        do_ptrs += offs_d[None, :] * stride_dod
        do2 = tl.load(do_ptrs, mask=rd_mask, other=0.0)
        v2 = tl.load(
            V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        dp = tl.dot(do2, tl.trans(v2), input_precision=PREC)
        dp3 = tl.permute(tl.reshape(dp, [GP, BLOCK_M, BLOCK_N]), (1, 0, 2))
        # dS with the softmax scale folded in: every gradient below is linear in s dS.
        ds3 = p3 * (dp3 - drow[:, :, None]) * scale

        if DETERMINISTIC:
            # The chain's query tiles add to key tile n in ascending order.
            _wait_for_earlier_query_tiles(LOCK, n, m, c, chain, BLOCK_M, BLOCK_N)

        # Pass 2: gradients, recomputing the phases of pass 1. Reductions over the keys
        # (dq) and over the heads (a1, a2) stay mostly in a thread; over the queries (dk)
        # they cross lanes (and warps where DK_PARTS is 1).
        g_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # The (x1, x2) halves of a rotary pair, as a last axis of 2.
        pair = tl.arange(0, 2) * HALF
        dq_ptr = DQ + (offs_m[:, None] * stride_dqn + offs_h[None, :] * stride_dqh)[:, :, None]
        dq_ptr += pair[None, None, :] * stride_dqd
        dk_ptr = (DK_S + offs_n[:, None] * stride_dkn + pair[None, :] * stride_dkd)[None, :, :]
        if DETERMINISTIC:  # a copy a row group
            dk_ptr += (tl.arange(0, DK_PARTS).to(tl.int64) * stride_dk_part)[:, None, None]
        else:  # one, shared (pointers broadcast at the add: a per-group offset cost 3%, H200)
            dk_ptr = tl.broadcast_to(dk_ptr, [DK_PARTS, BLOCK_N, 2])
        dk_mask = tl.broadcast_to(n_ok[None, :, None], [DK_PARTS, BLOCK_N, 2])
        if FREQ_GRAD:
            mileage = carry_z.to(tl.float32)[:, None] + local  # delta of the tile's pairs
        for d in range(HALF):
            w, q1, q2, cs, sn, kr1, kr2 = _frequency(
                QP, KP, W, d, offs_m, m_ok, offs_n, n_ok, carry_z, local, two_pi, inv_two_pi,
                stride_pqh, stride_pqd, stride_pkd, G, GP, FAST_TRIG,
            )  # fmt: skip
            # Both halves of a pair in one add: every atomic add costs a layout conversion
            # through shared memory (a barrier), so there are two a frequency, not four.
            dq = tl.join(
                tl.sum(ds3 * kr1[:, None, :], axis=2), tl.sum(ds3 * kr2[:, None, :], axis=2)
            )
            tl.atomic_add(dq_ptr + d * stride_dqd, dq, mask=qh_ok[:, :, None], sem="relaxed")
            # Head sums of s dS q: dk = sum_i Rot(+phi) of them.
            a1 = tl.sum(ds3 * q1[:, :, None], axis=1)
            a2 = tl.sum(ds3 * q2[:, :, None], axis=1)
            # dk's sum over the queries stops at DK_PARTS groups of rows, each added on its
            # own (deterministic: into a copy of its own): with a warp's rows a group, the sum
            # stays in registers and shuffles, where a sum across warps would cost shared
            # memory and three more barriers a frequency.
            dk = tl.sum(
                tl.reshape(
                    tl.join(cs * a1 - sn * a2, sn * a1 + cs * a2),
                    [DK_PARTS, BLOCK_M // DK_PARTS, BLOCK_N, 2],
                ),
                axis=1,
            )
            tl.atomic_add(dk_ptr + d * stride_dkd, dk, mask=dk_mask, sem="relaxed")
            # s dS dphi / dphi summed over the heads; phi = delta w
            dphase = a1 * kr2 - a2 * kr1
            if MILEAGE:
                g_acc += w * dphase
            if FREQ_GRAD:
                dw += tl.where(freq == d, tl.sum(dphase * mileage).to(tl.float64), 0.0)
        ds2 = tl.reshape(tl.permute(ds3, (1, 0, 2)), [GP * BLOCK_M, BLOCK_N])
        if DN_PAD > 0:
            tl.atomic_add(
                DQ + h_r[:, None] * stride_dqh + i_r[:, None] * stride_dqn
                + offs_p[None, :] * stride_dqd,
                _dot_split(ds2, kn, PREC),
                mask=row_ok[:, None] & p_ok[None, :],
                sem="relaxed",
            )  # fmt: skip
            tl.atomic_add(
                DK_S + offs_n[:, None] * stride_dkn + offs_p[None, :] * stride_dkd,
                _dot_split(tl.trans(ds2), qn2, PREC),
                mask=n_ok[:, None] & p_ok[None, :],
                sem="relaxed",
            )
        # Key-side products, [BLOCK_N, D]: the fp32 tile is the first operand and the rows
        # are the second in their loaded layout. Not the transposed form trans(rows) @ tile
        # (M = D, a warpgroup product): Triton 3.6 on sm_90 miscompiles its transposed
        # shared-memory operand (compute-sanitizer: out-of-range shared reads; wrong dv).
        nd_ptr = offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
        nd_mask = n_ok[:, None] & d_ok[None, :]
        p2 = tl.reshape(tl.permute(p3, (1, 0, 2)), [GP * BLOCK_M, BLOCK_N])
        # dO loaded again (L2 hits): each product takes its operand through shared memory in
        # a layout of its own, and a second use of the first load would keep both copies
        # ([GP * BLOCK_M, D], 64 KB each at G = 4, D = 128) alive through pass 2, which held
        # the kernel to one CTA per SM (corope/PERF_NOTES.md, session 9).
        do2 = tl.load(do_ptrs, mask=rd_mask, other=0.0)
        tl.atomic_add(DV + nd_ptr, _dot_split(tl.trans(p2), do2, PREC), mask=nd_mask,
                      sem="relaxed")  # fmt: skip

        if MILEAGE:
            # sum_{j >= t} g over the split's keys
            sg = carry_g[:, None] + tl.cumsum(g_acc, axis=1, reverse=True)
            carry_g += tl.sum(g_acc, axis=1)
            # The -Sg part of du = (C - Sg) z (1 - z); the C part is `_gate_tail_kernel`'s.
            szp = sg * z * (1.0 - z) * -scale
            kt = tl.load(
                K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            tl.atomic_add(
                DQL + offs_m[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
                _dot_split(szp, kt, PREC),
                mask=md_mask,
                sem="relaxed",
            )
            tl.atomic_add(DK_G + nd_ptr, _dot_split(tl.trans(szp), ql, PREC), mask=nd_mask,
                          sem="relaxed")  # fmt: skip
        if DETERMINISTIC:
            # Every thread's adds to tile n are issued before the counter moves on.
            tl.debug_barrier()
            tl.atomic_add(LOCK + n, 1, sem="release")
        carry_z += tl.sum(z, axis=1).to(tl.float64)

    if MILEAGE:
        # The split's total phase gradient per row (summed over head slices: one launch each).
        tl.atomic_add(TG + offs_m, carry_g, mask=m_ok, sem="relaxed")
    if FREQ_GRAD:
        tl.store(DW + freq, dw, mask=freq < HALF)  # summed over programs by the launcher


@triton.jit(do_not_specialize=["chain", "window"])  # no compile variant per chain or window
def _gate_tail_kernel(
    QL, K, TG, DQL, DK_T, LOCK_T,
    softmax_scale, N, HKV, key_tiles, n_splits, chain, window,
    stride_qlb, stride_qlh, stride_qln, stride_qld,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_tgb, stride_tgs,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_lock, stride_dql_split, stride_dk_chain,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DETERMINISTIC: tl.constexpr, PREC: tl.constexpr, WINDOWED: tl.constexpr,
    SWEEP_M: tl.constexpr,
):  # fmt: skip
    """The ``C`` part of the gate gradient, gates only, no phases: for key ``t`` in split
    ``s``, ``du[i, t] += C_s[i] z (1 - z)`` with ``C_s = sum_{s' <= s} TG[s']`` (the phase
    gradient of every key below the split's end), into ``dqL`` and the keys' ``dk``.

    Together with the sweep's ``-Sg`` part this is ``du = dz z (1 - z)`` with ``dz[i, t] =
    sum_{j < t} g[i, j]``. The sweep's programs, tiles and order (and, deterministic, the same
    chains and per-key-tile counters)."""
    m, split, lo, hi, _n_tiles, ch = _program_range(
        N, key_tiles, n_splits, chain, window, BLOCK_M, BLOCK_N, DETERMINISTIC, WINDOWED, SWEEP_M
    )
    if lo == hi:
        return
    bg = tl.program_id(1)
    b = (bg // HKV).to(tl.int64)
    grp = (bg % HKV).to(tl.int64)
    QL += b * stride_qlb + grp * stride_qlh
    K += b * stride_kb + grp * stride_kh
    TG += bg.to(tl.int64) * stride_tgb
    kv_off = b * stride_dkb + grp * stride_dkh
    DQL += kv_off + split.to(tl.int64) * stride_dql_split
    DK_T += kv_off + ch.to(tl.int64) * stride_dk_chain
    LOCK_T += bg * stride_lock + ch * tl.cdiv(N, BLOCK_N)
    scale = softmax_scale

    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < N
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    md_mask = m_ok[:, None] & d_ok[None, :]
    ql = tl.load(
        QL + offs_m[:, None] * stride_qln + offs_d[None, :] * stride_qld, mask=md_mask, other=0.0
    )
    dql = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    # C_s, in the order the unsplit sum would take
    c = tl.zeros([BLOCK_M], dtype=tl.float32)
    tg_ptr = TG + offs_m
    for _s in range(0, split + 1):
        c += tl.load(tg_ptr, mask=m_ok, other=0.0)
        tg_ptr += stride_tgs  # a pointer step: no int32 product to overflow
    zpc_scale = (c * scale)[:, None]
    for n in range(lo, hi):
        # GP = 1: no copies of the keys, the layout of the sweep's tiles is not needed.
        offs_n, n_ok, z = _gates(
            K, ql, n, offs_m, m_ok, offs_d, d_ok, N, scale, stride_kn, stride_kd, window,
            BLOCK_M, 1, BLOCK_N, PREC, WINDOWED,
        )  # fmt: skip
        zpc = z * (1.0 - z) * zpc_scale
        kt = tl.load(
            K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        dql += _dot_split(zpc, kt, PREC)
        dk_t = _dot_split(tl.trans(zpc), ql, PREC)
        if DETERMINISTIC:
            # The chain's query tiles add to key tile n in ascending order, as in the sweep.
            _wait_for_earlier_query_tiles(LOCK_T, n, m, ch, chain, BLOCK_M, BLOCK_N)
        tl.atomic_add(
            DK_T + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
            dk_t,
            mask=n_ok[:, None] & d_ok[None, :],
            sem="relaxed",
        )
        if DETERMINISTIC:
            tl.debug_barrier()
            tl.atomic_add(LOCK_T + n, 1, sem="release")
    tl.atomic_add(
        DQL + offs_m[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
        dql,
        mask=md_mask,
        sem="relaxed",
    )


def padded_channels(channels: int) -> int:
    """The width of the kernels' channel tiles (the head, ``D_PAD``; the pass-through
    channels, ``DN_PAD``): the next power of two, at least 64; the padded channels are masked
    loads of zeros. With 32, products over them read out of range on sm_90 (Triton 3.6): the
    pass-through score product in shared memory (compute-sanitizer), and the "mean" leader's
    fp32 gate product ``qL @ k^T`` at D = 32 (H100: an illegal memory access, or non-finite
    dq and dk, at every group size with bf16 and fp16 inputs)."""
    return max(64, next_power_of_2(channels))


def _block_config(group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): query rows and keys of a tile, warps, for programs that
    take ``group`` heads (at most SLICE_HEADS: ``_launch_configs``).

    ``BLOCK_M = 64`` rows on 4 warps is one warpgroup of Hopper's tensor-core product, whose
    accumulator layout (``_gates``) gives each thread 2 rows and ``BLOCK_N / 4`` keys of
    every head: the dq reduction over keys is then mostly in-thread and the heads' sums
    fully. ``BLOCK_N = 32`` keys of at most 4 heads (SLICE_HEADS), 128 columns, bound the
    registers, and ``dO`` (``GP * BLOCK_M x D``, in shared memory for two products) is kept
    to 64 KB, and to 32 KB at D = 256 (where 64 KB took 240 KB of shared memory in all, over
    sm_90's 227 KB; measured while both of dO's copies lived through pass 2, before e7b60c8,
    so larger tiles may fit now), by fewer rows. With fewer rows the products are not
    warpgroup ones and the heads of a pair may be split over warps: correct, slower. On the
    GPU, fp32 inputs take exact fp32 products, which are FMA loops whose code grows with the
    tile: 16 x 16 tiles on 8 warps keep ptxas' stack small. ptxas, sm_90:
    ``corope/PERF_NOTES.md``, "Backward v2". The interpreter, whose cost is per tile, runs the
    half-precision rule for every dtype.
    """
    if dtype == torch.float32 and not interpreting():
        return 16, 16, 8
    gp = next_power_of_2(group)
    row_bytes = gp * padded_channels(head_dim) * dtype.itemsize
    do_bytes = 65536 if head_dim <= 128 else 32768
    return max(16, min(64, do_bytes // row_bytes)), 32, 4


def _dk_parts(block_m: int, num_warps: int) -> int:
    """Row groups whose dk partials the sweep adds separately: one a warp where the tile's
    rows are split over the warps 16 each (the 64-row tiles' warpgroup product; H100, bf16:
    0.4-5% less backward time, 5% at the 16K target shape; the deterministic mode, each
    group into a copy of its own: H200, 6-13%; PERF_NOTES.md), else 1. The narrower tiles'
    rows do not follow the warps (their sum would be converted through shared memory
    anyway)."""
    return num_warps if block_m == 16 * num_warps else 1


# Pipelining stages of the loops that set none themselves (Triton's default is 3): the key-tile
# loop, whose tensor-core operands the pipeliner would otherwise stage through shared memory
# (sm_90a, bf16: 80 -> 112 KiB a CTA at G = 4, D = 128; 48 -> 136 KiB at G = 4, D = 256,
# where it leaves room for one CTA an SM instead of two).
SWEEP_NUM_STAGES = 1


def _pass1_stages(half: int) -> int:
    """Software-pipelining stages of the first frequency loop (``half = R / 2`` frequencies).
    H100, bf16, each A/B in one process (time_corope_stages_h100.md): at R = 128, 3 stages
    take 2-8% less backward time than none ((1, 32/8, 128), N = 1K to 16K); at R = 64, 6%
    more ((1, 8/2, 64), N = 4K). Unmeasured R: pipelined from R = 128 on, not below. The
    second loop lost 5-7% with 3 stages at R = 128 and is not pipelined."""
    return 3 if half >= 64 else 1


def swept_tiles(seq_len: int, block_m: int, block_n: int, window: int = 0) -> int:
    """The most key tiles a query tile of ``block_m`` rows sweeps: every one, or with a sliding
    window of ``window`` keys those its rows' ``block_m + window - 1`` keys span."""
    key_tiles = cdiv(seq_len, block_n)
    if not window:
        return key_tiles
    return min(key_tiles, (block_m + window - 2) // block_n + 2)


def _tiles_of_query_tile(m: int, seq_len: int, block_m: int, block_n: int, window: int) -> int:
    """The key tiles query tile ``m`` sweeps (``_program_range``'s ``n_tiles - first``)."""
    first = max(m * block_m - window + 1, 0) // block_n if window else 0
    return cdiv(min(seq_len, (m + 1) * block_m), block_n) - first


@cache
def _key_tiles_per_program(
    groups: int, seq_len: int, block_m: int, block_n: int, device: torch.device, window: int = 0
) -> int:
    """Key tiles a program sweeps: enough programs for about 8 per SM (2 fit on an SM at once
    where their shared memory allows: every bf16 tile needs 80 KiB or less, offline, since dO
    is loaded once per product and the launch sets SWEEP_NUM_STAGES; checked on the GPU with
    two CTAs an SM, PERF_NOTES session 10; and chunks of equal length balance the causal
    triangle's unequal rows), at least 2 tiles each. ``groups`` = B * HKV. One program per
    query tile (all its key tiles) where the query tiles alone give that many programs (long
    sequences), and in the interpreter, whose cost is per program.

    Short sequences have too few query tiles to fill the GPU (N = 1K, (1, 32/8, 128): 128
    programs of one 4-warp CTA for 132 SMs, the longest sweeping 32 key tiles); a split
    costs only its start (the gates of the key tiles above it, one product a tile). A sliding
    window of ``window`` keys (0: none) bounds each sweep (``swept_tiles``)."""
    key_tiles = swept_tiles(seq_len, block_m, block_n, window)
    query_tiles = cdiv(seq_len, block_m)
    if interpreting() or device.type != "cuda":
        return key_tiles
    target = 8 * num_sms(device)
    if groups * query_tiles >= target:
        return key_tiles
    work = groups * sum(
        _tiles_of_query_tile(m, seq_len, block_m, block_n, window) for m in range(query_tiles)
    )
    return min(key_tiles, max(2, cdiv(work, target)))


# The deterministic mode's copies of each kind take at most this many bytes: those of dq and dqL
# (one a split of the key sweep; fewer splits where they would take more), and those of dk, dv
# and the two gate parts of dk (one a chain of query tiles; longer chains where they would take
# more; dk's score part takes a copy a warp where a chain's copies fit with them). Both serve
# short sequences, whose copies are small: 80 MiB a split's copy and 112 MiB a chain's at B = 16,
# (8/2, 64), N = 2K, which splits in two and takes 2 chains of 16 query tiles.
DETERMINISTIC_COPY_BYTES = 1 << 28


def _copy_stride(copies: torch.Tensor) -> int:
    """The stride from one copy to the next in ``copies [n, ...]`` (a split's or a chain's): 0
    where there is one copy, shared (its adds are atomic, in no fixed order)."""
    return copies.stride(0) if copies.shape[0] > 1 else 0


def _items_a_copy(items: int, copy_bytes: int, at_least: int = 1) -> int:
    """The deterministic mode's grouping of ``items`` (key tiles or query tiles) into groups
    that each take a copy of ``copy_bytes``: ``at_least`` items a group, or more where that
    many groups' copies would take more than DETERMINISTIC_COPY_BYTES (one group of every
    item at least). Key tiles: the splits of a sweep and their copies of dq and dqL
    (``at_least``: the default's split). Query tiles: the chains and their copies of dk and
    dv, as short as the bound allows, since a chain's tiles add to a key tile one after
    another (PERF_NOTES.md, sessions 38 and 39)."""
    copies = max(1, DETERMINISTIC_COPY_BYTES // copy_bytes)
    return max(at_least, cdiv(items, copies))


# The most heads of a group that one program takes; wider groups are swept in slices of this
# many heads, one launch a slice. A program holding every head of a wider group needs a
# narrower tile (dO, [GP * BLOCK_M, D], sits in shared memory): with the (32, 16) tile of G = 8
# and the (16, 16) tile of G = 16 the backward took 95 and 110 ms at HQ = 32, D = 128, N = 4K,
# against 34 ms with G = 4's (64, 32), while slices of 4 heads recompute the sin/cos once a
# slice, which is G = 4's cost per head: sliced, 32.9 and 32.3 ms (H100, bf16; PERF_NOTES,
# session 11).
SLICE_HEADS = 4


def _launch_configs(group: int, head_dim: int, dtype: torch.dtype):
    """``(BLOCK_M, BLOCK_N, num_warps, heads)`` to try in order: programs that take ``heads``
    of the group's ``group`` heads (one launch a slice, the last slice the remainder; their
    contributions to dk, dv and the leader's gate gradient summed by the same atomic adds,
    exact as those are linear in the heads), ``heads`` at most SLICE_HEADS, with
    ``_block_config``'s tile for that many heads, then fewer query rows, then slices half as
    wide. What does not fit in shared memory fails at launch, before it writes, and the next
    is tried (the sweep zeroes its accumulators at each attempt: a remainder slice could fail
    after the first slice's adds): fp32 products (fp32 inputs; the ``"mean"`` leader's fp32
    query) take twice the shared memory of the half-precision rule's estimate.
    """
    heads = min(group, SLICE_HEADS)
    while heads:
        block_m, block_n, num_warps = _block_config(heads, head_dim, dtype)
        rows = block_m
        while rows >= 16:
            yield rows, block_n, num_warps, heads
            rows //= 2
        heads //= 2


# (kernel, device kind, G, D, rope_dim, dtype, leader, detach_mileage, deterministic,
# freq_grad[, tile])
# -> the first launch configuration that fitted, so that a failing one is compiled once per
# process. The device kind is part of the key: shared memory per block differs between GPU
# models.
_FITTED: dict[tuple, tuple[int, ...]] = {}


def _first_fitting(key: tuple, candidates, launch):
    """``launch(*c)`` for the first of ``candidates`` that fits in shared memory (one that does
    not raises ``OutOfResources`` before it runs, having written nothing), remembered under
    ``key``. Returns ``(c, launch's result)``."""
    if key in _FITTED:
        return _FITTED[key], launch(*_FITTED[key])
    for config in candidates:
        try:
            result = launch(*config)
        except OutOfResources:
            continue
        _FITTED[key] = config
        return config, result
    raise RuntimeError(f"no backward tile fits in shared memory for key {key}")


def corope_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    inv_freq: torch.Tensor,
    softmax_scale: float,
    rope_dim: int,
    leader: str,
    detach_mileage: bool,
    deterministic: bool = False,
    key_tiles_per_program: int | None = None,
    freq_grad: bool = False,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of causal Co-RoPE-GQA attention with respect to q, k, v and the frequencies.

    Args:
        do: ``[B, HQ, N, D]`` cotangent of the output.
        q: ``[B, HQ, N, D]``; head ``h`` belongs to KV group ``h // (HQ // HKV)``.
        k, v: ``[B, HKV, N, D]``.
        o: ``[B, HQ, N, D]`` the forward's output.
        lse: ``[B, HQ, N]`` fp32, the forward's natural-log log-sum-exp of the scaled scores.
        inv_freq: ``[R/2]`` fp32 frequencies ``w``.
        softmax_scale: ``s``, scaling both the gates and the scores.
        rope_dim: ``R``, even, at most D; channels ``R:`` are a plain dot product.
        leader: ``"first"`` or ``"mean"``, as in the forward.
        detach_mileage: drop the phase, mileage and gate paths (delta held constant).
        deterministic: order the fp32 accumulation of dk and dv, and give each split of a
            query tile's sweep its own copy of dq, so that two runs give bitwise equal
            results (slower: programs wait on earlier ones of their chain of query tiles;
            the copies of dq a split and of dk and dv a chain, summed afterwards, take at
            most DETERMINISTIC_COPY_BYTES each: a program takes more key tiles than
            ``key_tiles_per_program``, and a chain more query tiles, where they would take
            more).
        key_tiles_per_program: split each query tile's key sweep into programs of this many
            key tiles (``None``: ``_key_tiles_per_program``'s choice; tests and tuning set it).
            The splits' row sums take ``B * HKV * cdiv(N / BLOCK_N, this) * N * 4`` bytes:
            small by default, 8 GiB at N = 64K, B * HKV = 16 and 1 tile a program; with
            ``deterministic``, each split also takes a copy of dq and dqL, ``4 * B * (HQ +
            HKV) * N * D`` bytes, and each chain copies of dk, dv and dk's two gate parts,
            ``16 * B * HKV * N * D`` bytes (8 without the mileage: no gate parts), and 12
            more where dk's score part takes a copy a warp (the 64-row tiles, where a
            chain's copies fit the bound with them).
        freq_grad: also form the gradient with respect to ``inv_freq`` (learned
            frequencies); it holds with ``detach_mileage`` too (the phase is ``delta * w``).
        window: the forward's causal sliding window of keys (``i - window < j <= i``), 0 or
            None for none; each query tile sweeps only
            the key tiles its rows' windows touch, and the splits divide that range.

    Returns:
        ``(dq [B, HQ, N, D], dk [B, HKV, N, D], dv [B, HKV, N, D])`` in the inputs' dtype, and
        ``dinv_freq [R/2]`` fp32 (None without ``freq_grad``).
    """
    for name, t in (("do", do), ("o", o)):
        check_float_tensor(t, name, ndim=4)
    R, s = check_corope_inputs(q, k, v, rope_dim, leader, softmax_scale)
    check_float_tensor(q, "q", dtypes=KERNEL_DTYPES)
    for name, t in (("do", do), ("o", o)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    G = HQ // HKV
    check_float_tensor(lse, "lse", ndim=3, dtypes=(torch.float32,))
    if lse.shape != (B, HQ, N):
        raise ValueError(f"lse must be [B, HQ, N] = {(B, HQ, N)}, got {tuple(lse.shape)}")
    check_inv_freq(inv_freq, R, dtypes=(torch.float32,))
    device = check_same_device(q=q, k=k, v=v, do=do, o=o, lse=lse, inv_freq=inv_freq)
    check_kernel_device(device, "q", dot_dtype=q.dtype)
    check_bool(deterministic, "deterministic")
    check_bool(freq_grad, "freq_grad")
    if window is None or (type(window) is int and window == 0):
        window = 0  # no window (the kernels' convention)
    else:
        window = check_window(window, causal=True)
    if key_tiles_per_program is not None:
        if type(key_tiles_per_program) is not int:
            raise TypeError(
                "key_tiles_per_program must be an int or None, got "
                f"{type(key_tiles_per_program).__name__}"
            )
        if key_tiles_per_program < 1:
            raise ValueError(f"key_tiles_per_program must be >= 1, got {key_tiles_per_program}")
    check_index_span(G, dict(q=q, o=o, do=do), dict(k=k, v=v))

    if q.numel() == 0 or k.numel() == 0:  # no launch to make
        dw = torch.zeros(R // 2, dtype=torch.float32, device=device) if freq_grad else None
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dw
    if leader == "first":
        qL = q[:, ::G]  # a strided view: the kernel reads the leader head in place
    else:
        qL = q.unflatten(1, (HKV, G)).float().mean(2)
    inv_freq = inv_freq.contiguous()
    half = R // 2
    f32 = dict(dtype=torch.float32, device=device)

    def accumulator(heads: int, copies: int | None = None) -> torch.Tensor:
        """``[B, heads, N, D]`` fp32 (``[copies, B, heads, N, D]`` given ``copies``), stored
        positions-fastest (``[..., B, heads, D, N]`` in memory).
        The sweep adds to dq and dk once a frequency, one channel of many rows or keys at a
        time: with the positions contiguous a warp's add is a few 16-byte vector adds into
        whole sectors (when N is a multiple of 16, which the launcher specialises on; else
        scalar adds into the same sectors), where the row-major layout sent each of
        its 32 elements to a cache line of its own (sm_90, G = 4, D = 128: 24 sector
        writes a warp and frequency instead of 192, offline)."""
        lead = () if copies is None else (copies,)
        return torch.empty(*lead, B, heads, D, N, **f32).transpose(-1, -2)

    # The rotary pairs (x1, x2) of q and k side by side in fp32, [B, H, R/2, N] int64 views:
    # the frequency loops load a pair with one 8-byte load and convert nothing (their
    # instructions -8% at G = 4, for B * (HQ + HKV) * N * R * 4 bytes while the kernel runs).
    qp, kp = (rotary_pairs(x, R, N).view(torch.int64).squeeze(-1) for x in (q, k))
    dn = D - R

    # The deterministic mode's buffers for dk's gate parts (none without the mileage)
    gate_parts = deterministic and not detach_mileage

    def sweep(block_m, block_n, num_warps, heads):
        """Launches the sweep; returns what the gate tail needs. Every accumulator is its own,
        zeroed (atomic adds): a launch that does not fit fails before it writes, but a later
        slice's failure (a fallback) comes after the earlier slices' adds."""
        num_m, key_tiles = cdiv(N, block_m), cdiv(N, block_n)
        swept = swept_tiles(N, block_m, block_n, window)  # the longest sweep of a query tile
        per_program = key_tiles_per_program or _key_tiles_per_program(
            B * HKV, N, block_m, block_n, device, window
        )
        # dk and dv: the query tiles add to the same keys, atomically into one copy, or,
        # deterministic, each chain of query tiles into a copy of its own, in the chain's
        # order, with one buffer per kind of add to dk (scores, and with the mileage the
        # sweep's and the tail's gate parts) so that each element gets one add per (query
        # tile, key tile) and buffer; all summed in a fixed order afterwards.
        chain, parts = num_m, _dk_parts(block_m, num_warps)
        if deterministic:
            per_program = _items_a_copy(swept, 4 * B * (HQ + HKV) * N * D, per_program)
            # A chain's copies: dv, dk's score part once a row group (its adds in a fixed
            # order within a group; one copy, summed across warps, where a chain's copies
            # would not fit), and with the mileage dk's two gate parts.
            kinds, one_copy = (3 if gate_parts else 1), 4 * B * HKV * N * D
            if (kinds + parts) * one_copy > DETERMINISTIC_COPY_BYTES:
                parts = 1
            chain = _items_a_copy(num_m, (kinds + parts) * one_copy)
        n_splits, chains = cdiv(swept, per_program), cdiv(num_m, chain)
        # dk's score part: [parts * chains, ...], row group p's copies [p * chains, (p + 1) *
        # chains) (by default one copy that every group adds to); dk: the first group's.
        dk_s = accumulator(HKV, parts * chains if deterministic else 1).zero_()
        dv, dk = accumulator(HKV, chains).zero_(), dk_s[:chains]
        dk_g = dk_t = dk
        if gate_parts:
            dk_g, dk_t = accumulator(HKV, chains).zero_(), accumulator(HKV, chains).zero_()
        # dq, and the leader rows' gate gradient dqL (its -Sg part added per key tile during
        # the sweep, its C part by the gate tail; untouched without the mileage). The splits
        # of a query tile add to the same rows: atomically into one copy, or, deterministic,
        # each into a copy of its own (one program's adds, in its order), summed in a fixed
        # order afterwards.
        copies = n_splits if deterministic else 1
        dq = accumulator(HQ, copies).zero_()
        dql = dv[:1] if detach_mileage else accumulator(HKV, copies).zero_()
        split_strides = [_copy_stride(x) for x in (dq, dql)]
        # Each split's phase gradient per row, for the gate tail; summed over head slices.
        # (Without the mileage the kernel does not touch it.)
        tg = torch.zeros(B * HKV, n_splits if not detach_mileage else 1, N, **f32)
        # Deterministic mode's counters (per chain and key tile: how many of the chain's query
        # tiles have added to it; one set for the sweep, one for the gate tail), zeroed for
        # each launch.
        locks = torch.zeros(2, B * HKV, chains * key_tiles if deterministic else 1,
                            dtype=torch.int32, device=device)  # fmt: skip
        # With freq_grad, each program's share of dinv_freq, one set per head slice (the
        # programs of an empty split leave zeros); without, the kernel gets tg in its place
        # and does not touch it.
        dw_parts = None
        if freq_grad:
            dw_parts = torch.zeros(cdiv(G, heads), B * HKV, num_m * n_splits, half,
                                   dtype=torch.float64, device=device)  # fmt: skip
        for h in range(0, G, heads):
            if h:
                locks.zero_()
            sl = slice(h, None)  # the kernel reads heads h .. h + n - 1 of each group
            n = min(heads, G - h)
            dw = tg if dw_parts is None else dw_parts[h // heads]
            _corope_bwd_kernel[(chains * chain * n_splits, B * HKV)](
                q[:, sl], k, v, o[:, sl], do[:, sl], lse[:, sl], qL, inv_freq, qp[:, sl], kp,
                dq[0, :, sl], dql[0], dk[0], dk_g[0], dv[0], tg, locks[0], dw,
                s, N, HKV, G, per_program, n_splits, chain, window,
                *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(),
                *lse.stride(), *qL.stride(), *qp.stride()[:3], *kp.stride()[:3],
                *dq.stride()[1:], *dk.stride()[1:], *tg.stride()[:2], locks.stride(1),
                dw.stride(-3), *split_strides, _copy_stride(dk),
                _copy_stride(dk_s) * chains,
                G=n, GP=next_power_of_2(n), D=D,
                D_PAD=d_pad, HALF=half,
                DN_PAD=padded_channels(dn) if dn else 0,
                BLOCK_M=block_m, BLOCK_N=block_n,
                MILEAGE=not detach_mileage, DETERMINISTIC=deterministic, PREC=prec,
                FAST_TRIG=fast_trig(q),
                DK_PARTS=parts,
                PASS1_STAGES=_pass1_stages(half),
                FREQ_GRAD=freq_grad, HALF_P=next_power_of_2(half), WINDOWED=window > 0,
                num_warps=num_warps, num_stages=SWEEP_NUM_STAGES,
            )  # fmt: skip
        return tg, locks[1], per_program, n_splits, chains, dw_parts, dq, dql, dk_s, dk_g, dk_t, dv

    prec = "ieee" if q.dtype == torch.float32 else "tf32x3"
    d_pad = padded_channels(D)
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = (kind, G, D, R, q.dtype, leader, detach_mileage, deterministic, freq_grad)
    config, swept = _first_fitting(("sweep", *key), _launch_configs(G, D, q.dtype), sweep)
    tg, locks_t, per_program, n_splits, chains, dw_parts, dq, dql, dk_s, dk_g, dk_t, dv = swept
    del swept  # each copy is freed once summed
    if not detach_mileage:
        sweep_m, block_n, num_warps, _heads = config

        def tail(block_m):
            # Any row count works: the splits are key-tile ranges (a window's anchored at the
            # sweep's query tiles: SWEEP_M), TG is per row, and the sweep's chains (of its
            # query tiles) become as many chains, or fewer, of these.
            chain = cdiv(cdiv(N, block_m), chains)
            _gate_tail_kernel[(cdiv(cdiv(N, block_m), chain) * chain * n_splits, B * HKV)](
                qL, k, tg, dql[0], dk_t[0], locks_t, s, N, HKV, per_program, n_splits, chain,
                window, *qL.stride(), *k.stride(), *tg.stride()[:2], *dk_t.stride()[1:],
                locks_t.stride(0), _copy_stride(dql), _copy_stride(dk_t),
                D=D, D_PAD=d_pad, BLOCK_M=block_m,
                BLOCK_N=block_n, DETERMINISTIC=deterministic, PREC=prec,
                WINDOWED=window > 0, SWEEP_M=sweep_m, num_warps=num_warps,
                num_stages=SWEEP_NUM_STAGES,
            )  # fmt: skip

        # Its own shared-memory fallback (fewer rows): the "mean" leader's fp32 qL at D = 256
        # does not fit at the sweep's 64 rows when the sweep itself does.
        rows = [(r,) for r in (64, 32, 16) if r <= sweep_m]
        _first_fitting(("tail", *key, config), rows, tail)
    if gate_parts:
        dk_s[:chains].add_(dk_g).add_(dk_t)  # the first row group's copies
        del dk_g, dk_t
    dq, dql, dk, dv = (x[0] if x.shape[0] == 1 else x.sum(0) for x in (dq, dql, dk_s, dv))
    del dk_s
    if not detach_mileage:
        if leader == "first":
            dq[:, ::G] += dql
        else:
            dq.unflatten(1, (HKV, G)).add_(dql.unsqueeze(2) / G)
    # Row-major copies in the inputs' dtype (one pass each; `.to` would keep the accumulators'
    # strides, and return them as they are for fp32 inputs).
    dq, dk, dv = (
        torch.empty(x.shape, dtype=x.dtype, device=device).copy_(t)
        for t, x in ((dq, q), (dk, k), (dv, v))
    )
    return dq, dk, dv, None if dw_parts is None else dw_parts.sum((0, 1, 2)).float()
