"""Co-RoPE-GQA fused backward: one query-major Triton kernel, no ``N x N`` tensor in memory.

The math (``corope/README.md``, ``shared/docs/corope.md``): per KV group, with the
leader's gates ``z[i, t]``, the mileage ``delta[i, j] = sum_{j < t <= i} z[i, t]``, the
phases ``phi = delta * w`` and the rotated keys ``Kr = Rot(-phi) k``,

* score path: ``dq[h, i] = s sum_j dS Kr``, ``dk[j] = s sum_{h, i} dS Rot(+phi) q[h, i]``;
* phase path: ``g[i, j] = s sum_h dS[h, i, j] sum_d w_d (q1 kr2 - q2 kr1)`` (because
  ``d kr1 / d phi = kr2`` and ``d kr2 / d phi = -kr1``);
* mileage path: ``dz[i, t] = sum_{j < t} g[i, j]``, an exclusive prefix sum along the keys;
* gate path: ``du = dz z (1 - z)``, ``dqL[i] = s sum_t du k[t]``, ``dk[t] += s sum_i du qL[i]``.

One program owns ``BLOCK`` query rows of one KV group and all ``G`` heads of the
group, and sweeps the key tiles from the diagonal down to tile 0, exactly as the
forward does, so that ``delta`` is the same running suffix sum of gates. The sin/cos
of a phase is computed once per (query, key, frequency) and per pass, shared by the
``G`` heads. Each key tile takes two passes over the frequency chunks: the first
builds the scores (``P`` needs every frequency), the second the gradients once
``dS`` is known. The backward therefore evaluates ``2 * R/2`` sines and ``2 * R/2``
cosines per causal pair and group, twice the forward's count.

The descending sweep has ``sum_{j >= t} g[i, j]`` at hand (a running suffix ``Sg``),
not the prefix the mileage path needs; with ``Gtot[i] = sum_j g[i, j]`` (known at the
end of the sweep), ``dz = Gtot - Sg``. So the sweep accumulates ``X = sum_t z' k[t]``
and ``Y = sum_t Sg z' k[t]`` (``z' = z (1 - z)``) for ``dqL = s (Gtot X - Y)``, adds the
``-Sg`` part of the keys' gate gradient as it goes, and a second, cheap loop over the
key tiles (gates only: one ``tl.dot`` and a sigmoid per tile) adds the ``Gtot`` part.

Precision, as in the forward: the gates' carry is fp64, and the phase is formed as
``(carry w mod 2 pi) + local w`` with the reduction in fp64 and ``local < BLOCK``, so the
per-pair sin/cos (the hardware's fast approximations for fp16/bf16 inputs, accurate
ones for fp32) never sees a large argument and the phase error does not grow with N.
Products of an fp32 intermediate
(P, dS, the gate terms) with a half-precision input split the intermediate into a
high and a low half (two tensor-core products), which keeps them at fp32 accuracy.

dq rows belong to one program, which adds to them in a fixed order (deterministic in
both modes); dk and dv receive contributions from every query tile at or after them
and are accumulated in fp32 with atomic adds. ``deterministic=True`` orders those
adds: per key tile an int32 counter says how many query tiles have added to it, and
query tile ``m`` waits until every earlier one has (query tiles run in ascending
order; since each sweeps downwards from its diagonal, tile ``m`` trails tile ``m - 1``
by about one key tile and the waits are short). Each fp32 buffer element then receives
its adds in one fixed order, so two runs give bitwise equal dk and dv. This relies on
the GPU starting programs in grid order (a program only waits on lower-numbered ones),
as the interpreter does and as ordered split-K reductions also assume.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from corope.forward import _cos_sin
from corope.naive import check_corope_inputs
from fused_rope._validation import (
    KERNEL_DTYPES,
    check_float_tensor,
    check_kernel_device,
    check_same_device,
)


@triton.jit
def _dot_split(a, b, PREC: tl.constexpr):
    """``a @ b`` for an fp32 ``a`` and a ``b`` in the inputs' dtype, to about fp32 accuracy.

    For half-precision ``b``, ``a`` is split into a high and a low half-precision part
    (two tensor-core products) rather than converting ``b`` to fp32: an fp32 operand of
    ``G * BLOCK x D`` would take three times its registers under tf32x3.
    """
    if b.dtype == tl.float32:
        return tl.dot(a, b, input_precision=PREC)
    hi = a.to(b.dtype)
    lo = (a - hi.to(tl.float32)).to(b.dtype)
    return tl.dot(hi, b) + tl.dot(lo, b)


@triton.jit
def _gates(K, ql, n, offs_m, m_ok, offs_d, d_ok, N, scale, stride_kn, stride_kd,
           BLOCK: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """Key tile ``n``: its offsets ``[BLOCK]``, mask, keys ``[BLOCK, D_PAD]`` and the
    leader's gates ``z = sigmoid(s qL k^T)`` ``[BLOCK, BLOCK]`` (0 past the diagonal)."""
    offs_n = n * BLOCK + tl.arange(0, BLOCK)
    n_ok = offs_n < N
    kt = tl.load(
        K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=n_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    causal = (offs_n[None, :] <= offs_m[:, None]) & m_ok[:, None]
    u = tl.dot(ql, tl.trans(kt.to(ql.dtype)), input_precision=PREC) * scale
    return offs_n, n_ok, kt, tl.where(causal, tl.sigmoid(u), 0.0)


@triton.jit
def _rotated_chunk(
    Q, K, W, d0, offs_n, n_ok, h3, i3, hi3_ok, carry, local,
    stride_qh, stride_qn, stride_qd, stride_kn, stride_kd,
    HALF: tl.constexpr, DC: tl.constexpr, BLOCK: tl.constexpr, FAST_TRIG: tl.constexpr,
):  # fmt: skip
    """Frequencies ``d0 .. d0 + DC`` of one (query tile, key tile).

    The phase is formed as the forward forms it, ``phi = (carry w mod 2 pi) + local w``:
    the carry reaches N, so its angle is reduced modulo 2 pi in fp64, and ``local <
    BLOCK``; the fp32 argument of the per-pair sin/cos thus stays below ``2 pi + BLOCK w``,
    where the fast hardware sin/cos is accurate, and the phase error does not grow with N.

    Returns ``w [DC]``, the offsets ``[DC]``, masks and the G heads' query columns ``q1,
    q2 [GP, BLOCK, DC]``, the rotation ``cs, sn [BLOCK, BLOCK, DC]`` (one sin/cos per
    pair and frequency, shared by the heads) and the rotated keys ``kr1, kr2 [BLOCK,
    BLOCK, DC]`` (``Rot(-phi) k``).
    """
    offs_c = d0 + tl.arange(0, DC)
    c_ok = offs_c < HALF
    w = tl.load(W + offs_c, mask=c_ok, other=0.0)
    ang = carry[:, None] * w[None, :]  # fp64
    two_pi = tl.full([BLOCK, DC], 6.283185307179586, tl.float64)
    inv_two_pi = tl.full([BLOCK, DC], 0.15915494309189535, tl.float64)
    ang = (ang - two_pi * tl.floor(ang * inv_two_pi)).to(tl.float32)
    cs, sn = _cos_sin(ang[:, None, :] + local[:, :, None] * w[None, None, :], FAST_TRIG)
    kc_ptr = K + offs_n[:, None] * stride_kn + offs_c[None, :] * stride_kd
    kc_mask = n_ok[:, None] & c_ok[None, :]
    k1 = tl.load(kc_ptr, mask=kc_mask, other=0.0).to(tl.float32)[None, :, :]
    k2 = tl.load(kc_ptr + HALF * stride_kd, mask=kc_mask, other=0.0).to(tl.float32)[None, :, :]
    kr1 = k1 * cs + k2 * sn
    kr2 = k2 * cs - k1 * sn
    qc_off = h3 * stride_qh + i3 * stride_qn + offs_c[None, None, :] * stride_qd
    qc_mask = hi3_ok & c_ok[None, None, :]
    q1 = tl.load(Q + qc_off, mask=qc_mask, other=0.0).to(tl.float32)
    q2 = tl.load(Q + qc_off + HALF * stride_qd, mask=qc_mask, other=0.0).to(tl.float32)
    return w, offs_c, c_ok, qc_mask, q1, q2, cs, sn, kr1, kr2


@triton.jit
def _corope_bwd_kernel(
    Q, K, V, O, DO, LSE, QL, W,
    DQ, DQL, DK_S, DK_G, DK_T, DV, LOCK, LOCK_T,
    softmax_scale, N, HKV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lb, stride_lh, stride_ln,
    stride_qlb, stride_qlh, stride_qln, stride_qld,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_lock,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    HALF: tl.constexpr, DC: tl.constexpr, DN_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    MILEAGE: tl.constexpr, DETERMINISTIC: tl.constexpr, PREC: tl.constexpr,
    FAST_TRIG: tl.constexpr,
):  # fmt: skip
    num_m = tl.cdiv(N, BLOCK)
    # Longest sweeps first for load balance; the ordered (deterministic) mode needs
    # ascending query tiles so that a program only ever waits on earlier programs.
    m = tl.program_id(0) if DETERMINISTIC else num_m - 1 - tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // HKV).to(tl.int64)  # batch offsets can pass 2**31 elements
    grp = bg % HKV
    h0 = grp * G
    scale = softmax_scale
    ROPE: tl.constexpr = 2 * HALF

    Q += b * stride_qb + h0 * stride_qh
    O += b * stride_ob + h0 * stride_oh
    DO += b * stride_dob + h0 * stride_doh
    LSE += b * stride_lb + h0 * stride_lh
    DQ += b * stride_dqb + h0 * stride_dqh
    K += b * stride_kb + grp * stride_kh
    V += b * stride_vb + grp * stride_vh
    QL += b * stride_qlb + grp * stride_qlh
    kv_off = b * stride_dkb + grp * stride_dkh
    DQL += kv_off
    DK_S += kv_off
    DK_G += kv_off
    DK_T += kv_off
    DV += kv_off
    LOCK += bg * stride_lock
    LOCK_T += bg * stride_lock

    offs_m = m * BLOCK + tl.arange(0, BLOCK)
    m_ok = offs_m < N
    # All G heads' rows of the tile as one [GP * BLOCK] axis (head-major), so that
    # dO V^T, P^T dO and the pass-through products are single tl.dot calls.
    r = tl.arange(0, GP * BLOCK)
    h_r = r // BLOCK
    i_r = m * BLOCK + r % BLOCK
    row_ok = (h_r < G) & (i_r < N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    # The same rows as a [GP, BLOCK, 1] grid, for the per-frequency 3-D/4-D products.
    h3 = tl.arange(0, GP)[:, None, None]
    i3 = offs_m[None, :, None]
    hi3_ok = (h3 < G) & (i3 < N)

    rd_mask = row_ok[:, None] & d_ok[None, :]
    # dO (and below the pass-through q) stay in registers in the inputs' dtype: their
    # [G * BLOCK, D] pointer grids would cost four times as many registers.
    do2 = tl.load(
        DO + h_r[:, None] * stride_doh + i_r[:, None] * stride_don + offs_d[None, :] * stride_dod,
        mask=rd_mask,
        other=0.0,
    )
    o2 = tl.load(
        O + h_r[:, None] * stride_oh + i_r[:, None] * stride_on + offs_d[None, :] * stride_od,
        mask=rd_mask,
        other=0.0,
    )
    drow = tl.sum(do2.to(tl.float32) * o2.to(tl.float32), axis=1)
    lse2 = (
        tl.load(LSE + h_r * stride_lh + i_r * stride_ln, mask=row_ok, other=0.0)
        * 1.4426950408889634
    )
    ql = tl.load(
        QL + offs_m[:, None] * stride_qln + offs_d[None, :] * stride_qld,
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DN_PAD > 0:
        offs_p = ROPE + tl.arange(0, DN_PAD)
        p_ok = offs_p < D
        qn2 = tl.load(
            Q + h_r[:, None] * stride_qh + i_r[:, None] * stride_qn + offs_p[None, :] * stride_qd,
            mask=row_ok[:, None] & p_ok[None, :],
            other=0.0,
        )

    # Gates of the keys in later tiles; fp64 like the forward's, as it grows to N.
    carry_z = tl.zeros([BLOCK], dtype=tl.float64)
    carry_g = tl.zeros([BLOCK], dtype=tl.float32)  # phase gradient of the later keys
    acc_x = tl.zeros([BLOCK, D_PAD], dtype=tl.float32)  # sum_t z' k[t]
    acc_y = tl.zeros([BLOCK, D_PAD], dtype=tl.float32)  # sum_t Sg z' k[t]
    for step in range(0, m + 1):
        n = m - step
        offs_n, n_ok, kt, z = _gates(
            K, ql, n, offs_m, m_ok, offs_d, d_ok, N, scale, stride_kn, stride_kd, BLOCK, PREC
        )
        # The forward's mileage: delta = carry + in-tile exclusive suffix sum of the gates.
        local = tl.cumsum(z, axis=1, reverse=True) - z

        # Pass 1: scores of the G heads, sin/cos per (i, j, d) shared by the heads.
        s3 = tl.zeros([GP, BLOCK, BLOCK], dtype=tl.float32)
        for d0 in range(0, HALF, DC):
            _w, _c, _cm, _qm, q1, q2, _cs, _sn, kr1, kr2 = _rotated_chunk(
                Q, K, W, d0, offs_n, n_ok, h3, i3, hi3_ok, carry_z, local,
                stride_qh, stride_qn, stride_qd, stride_kn, stride_kd, HALF, DC, BLOCK, FAST_TRIG,
            )  # fmt: skip
            s3 += tl.sum(q1[:, :, None, :] * kr1[None] + q2[:, :, None, :] * kr2[None], axis=3)
        s2 = tl.reshape(s3, [GP * BLOCK, BLOCK])
        if DN_PAD > 0:
            kn = tl.load(
                K + offs_n[:, None] * stride_kn + offs_p[None, :] * stride_kd,
                mask=n_ok[:, None] & p_ok[None, :],
                other=0.0,
            )
            s2 += tl.dot(qn2, tl.trans(kn), input_precision=PREC)
        valid = row_ok[:, None] & (offs_n[None, :] <= i_r[:, None])
        p = tl.where(valid, tl.exp2(s2 * (scale * 1.4426950408889634) - lse2[:, None]), 0.0)
        v2 = tl.load(
            V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        dp = tl.dot(do2, tl.trans(v2), input_precision=PREC)
        ds = p * (dp - drow[:, None])  # [GP * BLOCK, BLOCK], zero off the causal band
        ds3 = tl.reshape(ds, [GP, BLOCK, BLOCK])

        if DETERMINISTIC:
            # Query tiles add to key tile n in ascending order, from query tile n on.
            while tl.atomic_add(LOCK + n, 0, sem="acquire") != m - n:
                pass

        # Pass 2: gradients, recomputing the phases of pass 1.
        g_acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
        for d0 in range(0, HALF, DC):
            w, offs_c, c_ok, qc_mask, q1, q2, cs, sn, kr1, kr2 = _rotated_chunk(
                Q, K, W, d0, offs_n, n_ok, h3, i3, hi3_ok, carry_z, local,
                stride_qh, stride_qn, stride_qd, stride_kn, stride_kd, HALF, DC, BLOCK, FAST_TRIG,
            )  # fmt: skip
            ds4 = ds3[:, :, :, None]
            dq_ptr = DQ + h3 * stride_dqh + i3 * stride_dqn + offs_c[None, None, :] * stride_dqd
            dq1 = tl.sum(ds4 * kr1[None], axis=2) * scale
            dq2 = tl.sum(ds4 * kr2[None], axis=2) * scale
            tl.atomic_add(dq_ptr, dq1, mask=qc_mask, sem="relaxed")
            tl.atomic_add(dq_ptr + HALF * stride_dqd, dq2, mask=qc_mask, sem="relaxed")
            # Head sums of dS q, [BLOCK, BLOCK, DC]: dk = s sum_i Rot(+phi) of them.
            a1 = tl.sum(ds4 * q1[:, :, None, :], axis=0)
            a2 = tl.sum(ds4 * q2[:, :, None, :], axis=0)
            dk_ptr = DK_S + offs_n[:, None] * stride_dkn + offs_c[None, :] * stride_dkd
            kc_mask = n_ok[:, None] & c_ok[None, :]
            tl.atomic_add(
                dk_ptr, tl.sum(cs * a1 - sn * a2, axis=0) * scale, mask=kc_mask, sem="relaxed"
            )
            tl.atomic_add(
                dk_ptr + HALF * stride_dkd,
                tl.sum(sn * a1 + cs * a2, axis=0) * scale,
                mask=kc_mask,
                sem="relaxed",
            )
            if MILEAGE:
                g_acc += tl.sum(w[None, None, :] * (a1 * kr2 - a2 * kr1), axis=2)
        if DN_PAD > 0:
            dqn = _dot_split(ds, kn, PREC) * scale
            tl.atomic_add(
                DQ
                + h_r[:, None] * stride_dqh
                + i_r[:, None] * stride_dqn
                + offs_p[None, :] * stride_dqd,
                dqn,
                mask=row_ok[:, None] & p_ok[None, :],
                sem="relaxed",
            )
            dkn = _dot_split(tl.trans(ds), qn2, PREC) * scale
            tl.atomic_add(
                DK_S + offs_n[:, None] * stride_dkn + offs_p[None, :] * stride_dkd,
                dkn,
                mask=n_ok[:, None] & p_ok[None, :],
                sem="relaxed",
            )
        nd_ptr = offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
        nd_mask = n_ok[:, None] & d_ok[None, :]
        dv = _dot_split(tl.trans(p), do2, PREC)
        tl.atomic_add(DV + nd_ptr, dv, mask=nd_mask, sem="relaxed")

        if MILEAGE:
            gs = g_acc * scale
            sg = carry_g[:, None] + tl.cumsum(gs, axis=1, reverse=True)  # sum_{j >= t} g[i, j]
            carry_g += tl.sum(gs, axis=1)
            zp = z * (1.0 - z)
            szp = sg * zp
            acc_x += _dot_split(zp, kt, PREC)
            acc_y += _dot_split(szp, kt, PREC)
            dk_g = _dot_split(tl.trans(szp), ql, PREC) * -scale
            tl.atomic_add(DK_G + nd_ptr, dk_g, mask=nd_mask, sem="relaxed")
        if DETERMINISTIC:
            # Every thread's adds to tile n are issued before the counter moves on.
            tl.debug_barrier()
            tl.atomic_add(LOCK + n, 1, sem="release")
        carry_z += tl.sum(z, axis=1).to(tl.float64)

    if MILEAGE:
        gtot = carry_g
        dql = (gtot[:, None] * acc_x - acc_y) * scale
        tl.store(
            DQL + offs_m[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
            dql,
            mask=m_ok[:, None] & d_ok[None, :],
        )
        # The Gtot part of the keys' gate gradient: gates only, no phases.
        for step in range(0, m + 1):
            n = m - step
            offs_n, n_ok, _k, z = _gates(
                K, ql, n, offs_m, m_ok, offs_d, d_ok, N, scale, stride_kn, stride_kd, BLOCK, PREC
            )
            zpg = z * (1.0 - z) * gtot[:, None]
            dk_t = _dot_split(tl.trans(zpg), ql, PREC) * scale
            if DETERMINISTIC:
                while tl.atomic_add(LOCK_T + n, 0, sem="acquire") != m - n:
                    pass
            tl.atomic_add(
                DK_T + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
                dk_t,
                mask=n_ok[:, None] & d_ok[None, :],
                sem="relaxed",
            )
            if DETERMINISTIC:
                tl.debug_barrier()
                tl.atomic_add(LOCK_T + n, 1, sem="release")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _block_config(
    group: int, half: int, head_dim: int, dtype: torch.dtype, n: int
) -> tuple[int, int, int]:
    """(BLOCK, DC, num_warps): query and key tile size, frequencies per chunk, warps.

    GPU values from compiling for sm_90 and reading ptxas (``corope/PERF_NOTES.md``). A
    16 x 16 tile gives each of the 256 threads one (query, key) pair, so every reduction and
    atomic is paid per pair; 32 x 32 tiles with one frequency a chunk give four, which cuts
    the instructions per (pair, frequency) by 13-18% for fp16/bf16 at ``G <= 4``, ``D <= 128``
    (measured on an H200: 18-20% faster at N = 4K and 16K, but 8% slower at N = 1K, where
    the 16-row tiles give twice as many programs; hence only from N = 4096). Elsewhere 32-row tiles spill kilobytes
    (fp32, ``G = 8``) or exceed the shared memory (``D = 256``), so 16-row tiles stay, with
    8, 4 or 2 frequencies a chunk for 1, 2 or more heads a group. The interpreter runs each op
    once over whole numpy arrays, so there larger tiles are cheaper.
    """
    gp = triton.next_power_of_2(group)
    if _interpreted():
        return 32, min(16, triton.next_power_of_2(half)), 4
    if gp <= 4 and head_dim <= 128 and dtype in (torch.float16, torch.bfloat16) and n >= 4096:
        return 32, 1, 8
    return 16, min(8 if gp == 1 else 4 if gp == 2 else 2, triton.next_power_of_2(half)), 8


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of causal Co-RoPE-GQA attention with respect to q, k and v.

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
        deterministic: order the fp32 accumulation of dk and dv so that two runs give
            bitwise equal results (slightly slower: programs wait on earlier ones).

    Returns:
        ``(dq [B, HQ, N, D], dk [B, HKV, N, D], dv [B, HKV, N, D])`` in the inputs' dtype.
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
    check_float_tensor(inv_freq, "inv_freq", ndim=1, dtypes=(torch.float32,))
    if inv_freq.shape[0] != R // 2:
        raise ValueError(
            f"inv_freq must have rope_dim // 2 = {R // 2} entries, got {inv_freq.shape[0]}"
        )
    device = check_same_device(q=q, k=k, v=v, do=do, o=o, lse=lse, inv_freq=inv_freq)
    check_kernel_device(device, "q")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")

    if leader == "first":
        qL = q[:, ::G]  # a strided view: the kernel reads the leader head in place
    else:
        qL = q.unflatten(1, (HKV, G)).float().mean(2)
    inv_freq = inv_freq.contiguous()
    half = R // 2
    block, dc, num_warps = _block_config(G, half, D, q.dtype, N)
    num_tiles = triton.cdiv(N, block)
    f32 = dict(dtype=torch.float32, device=device)
    # Accumulated with atomic adds, hence zeroed; every other output is fully written.
    dq = torch.zeros(B, HQ, N, D, **f32)
    dk = torch.zeros(B, HKV, N, D, **f32)
    dv = torch.zeros(B, HKV, N, D, **f32)
    # dqL = s (Gtot X - Y) of every leader row, written once (unused without the mileage).
    dql = torch.empty(B, HKV, N, D, **f32) if not detach_mileage else dv
    if deterministic:
        # One buffer per kind of add, so that each element gets one add per (query
        # tile, key tile) and per buffer, in query-tile order; summed in a fixed order.
        dk_g, dk_t = torch.zeros_like(dk), torch.zeros_like(dk)
        lock = torch.zeros(B * HKV, num_tiles, dtype=torch.int32, device=device)
        lock_t = torch.zeros_like(lock)
    else:
        dk_g = dk_t = dk
        lock = lock_t = torch.zeros(1, 1, dtype=torch.int32, device=device)
    dn = D - R
    prec = "ieee" if q.dtype == torch.float32 else "tf32x3"
    _corope_bwd_kernel[(num_tiles, B * HKV)](
        q, k, v, o, do, lse, qL, inv_freq,
        dq, dql, dk, dk_g, dk_t, dv, lock, lock_t,
        s, N, HKV,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(),
        *lse.stride(), *qL.stride(), *dq.stride(), *dk.stride(), lock.stride(0),
        G=G, GP=triton.next_power_of_2(G), D=D, D_PAD=max(16, triton.next_power_of_2(D)),
        HALF=half, DC=dc, DN_PAD=max(16, triton.next_power_of_2(dn)) if dn else 0,
        BLOCK=block,
        MILEAGE=not detach_mileage, DETERMINISTIC=deterministic, PREC=prec,
        FAST_TRIG=not _interpreted() and q.dtype != torch.float32,
        num_warps=num_warps,
    )  # fmt: skip
    if deterministic:
        dk = dk + dk_g + dk_t
    if not detach_mileage:
        if leader == "first":
            dq[:, ::G] += dql
        else:
            dq.unflatten(1, (HKV, G)).add_(dql.unsqueeze(2) / G)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
