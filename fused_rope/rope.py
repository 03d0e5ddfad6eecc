"""Standalone Triton RoPE: one launch rotates q and k; backward is the same kernel by -angle.

Math, layouts, the output-scale fold and the support matrix: ``fused_rope/README.md``.

Reads top-down: the ``@triton.jit`` kernels, the launcher ``rope_fwd`` (the backward is the
same launch with ``conjugate=True``), the autograd.Function of eager mode where autograd
records the call (eager calls it does not record launch directly), the torch custom ops that
torch.compile sees, then the public functions ``apply_rope`` and ``apply_rope_qk``.
"""

# No ``from __future__ import annotations``: torch.library.custom_op reads the real annotations.
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fused_rope._angle_grads import chain_positions, pair_cross, rows_grad
from fused_rope._device import num_sms
from fused_rope._intmath import cdiv, next_power_of_2
from fused_rope._trig import cos_sin_of_angle, fast_trig
from fused_rope._validation import (
    KERNEL_DTYPES,
    MAX_GRID_AXIS2,
    backward_launches_directly,
    check_angles,
    check_attention_factor,
    check_float_tensor,
    check_inv_freq,
    check_kernel_device,
    check_layout,
    check_no_tangent,
    check_rope_dim,
    check_same_device,
    check_scale,
    checked,
    interpreting,
    may_overlap,
    needs_autograd,
    on_input_device,
    runs_eagerly,
)

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_pairs(
    row, mask_row, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
    HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """The rotary pairs ``(x1, x2)`` (fp32 ``[BLOCK_H, BLOCK_N, HALF_P]``) of the rows ``row``
    ``[BLOCK_H, BLOCK_N, 1]``, and the mask of their channels. Interleaved: one contiguous
    load of the R rotated channels, then split into (even, odd) pairs in registers (strided
    loads of every other channel would not vectorize)."""
    offs_d = tl.arange(0, HALF_P)[None, None, :]
    if INTERLEAVED:
        offs_c = tl.arange(0, 2 * HALF_P)[None, None, :]
        mask = mask_row & (offs_c < R)
        x = tl.load(row + offs_c, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_N, HALF_P, 2)))
    else:
        mask = mask_row & (offs_d < R // 2)
        x1 = tl.load(row + offs_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + R // 2 + offs_d, mask=mask, other=0.0).to(tl.float32)
    return x1, x2, mask


@triton.jit
def _rotate_heads(
    x_ptr,
    y_ptr,
    a_ptr,
    stride_xh,
    stride_xn,
    stride_yh,
    stride_yn,
    stride_ah,
    stride_an,
    offs_n,
    mask_n,
    cos,
    sin,
    scale,
    h_lo,
    h_hi,
    D: tl.constexpr,
    R: tl.constexpr,
    HALF_P: tl.constexpr,
    PASS_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_PASS: tl.constexpr,
    ANGLE_GRAD: tl.constexpr,
):
    """Rotates the ``[BLOCK_N]`` positions ``offs_n`` of heads ``[h_lo, h_hi)`` of one batch
    element (an empty range does nothing). Returns ``[BLOCK_N, HALF_P]`` fp32: with
    ``ANGLE_GRAD``, ``sum_heads a1 y2 - a2 y1`` over the rows of ``a_ptr`` (the rotation's
    input when this launch is its backward: ``y`` is then its gradient, so the sum is the
    angles' gradient, ``fused_rope/_angle_grads.py``), from ``y`` in fp32, before its rounding
    to the output's dtype; zeros otherwise.

    ``x_ptr``/``y_ptr``/``a_ptr`` point at the batch element; ``cos``/``sin`` are
    ``[1, BLOCK_N, HALF_P]`` fp32. ``BLOCK_H`` heads are loaded per iteration so every thread
    has several independent 16-byte loads in flight (the kernel is bound by memory latency,
    not arithmetic).
    """
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF_P)
    # int64 rows: one batch element of a long sequence can exceed 2**31 elements.
    n64 = offs_n.to(tl.int64)[None, :, None]
    cross = tl.zeros([BLOCK_N, HALF_P], tl.float32)
    for h0 in tl.range(h_lo, h_hi, BLOCK_H):
        h = (h0 + offs_h).to(tl.int64)[:, None, None]
        mask_row = (h < h_hi) & mask_n[None, :, None]
        x_row = x_ptr + h * stride_xh + n64 * stride_xn  # [BLOCK_H, BLOCK_N, 1]
        y_row = y_ptr + h * stride_yh + n64 * stride_yn
        x1, x2, mask = _load_pairs(x_row, mask_row, BLOCK_H, BLOCK_N, R, HALF_P, INTERLEAVED)
        y1 = (x1 * cos - x2 * sin) * scale
        y2 = (x2 * cos + x1 * sin) * scale
        if INTERLEAVED:
            y = tl.reshape(tl.join(y1, y2), (BLOCK_H, BLOCK_N, 2 * HALF_P))
            tl.store(y_row + tl.arange(0, 2 * HALF_P)[None, None, :],
                     y.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        else:
            tl.store(y_row + offs_d[None, None, :], y1.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(
                y_row + (R // 2 + offs_d)[None, None, :], y2.to(y_ptr.dtype.element_ty), mask=mask
            )
        if ANGLE_GRAD:
            a_row = a_ptr + h * stride_ah + n64 * stride_an
            a1, a2, _ = _load_pairs(a_row, mask_row, BLOCK_H, BLOCK_N, R, HALF_P, INTERLEAVED)
            cross += tl.sum(a1 * y2 - a2 * y1, axis=0)
        if COPY_PASS:
            offs_p = R + tl.arange(0, PASS_P)[None, None, :]
            mask = mask_row & (offs_p < D)
            xp = tl.load(x_row + offs_p, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + offs_p, (xp * scale).to(y_ptr.dtype.element_ty), mask=mask)
    return cross


# pos0 changes at every decoding step: one compiled kernel for all of its values
@triton.jit(do_not_specialize=["pos0"])
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    angles_ptr,
    aq_ptr,
    ak_ptr,
    d_angles_ptr,
    stride_aqb,
    stride_aqh,
    stride_aqn,
    stride_akb,
    stride_akh,
    stride_akn,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_qob,
    stride_qoh,
    stride_qon,
    stride_kob,
    stride_koh,
    stride_kon,
    stride_ab,
    stride_an,
    N,
    q_shift,
    pos0,
    q_scale,
    k_scale,
    rotary_scale,
    H_Q: tl.constexpr,
    H_K: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    HALF_P: tl.constexpr,
    PASS_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    COPY_PASS: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    FROM_INV_FREQ: tl.constexpr,
    ANGLE_GRAD: tl.constexpr,
):
    """Program (n-tile, head chunk, b): positions ``[n0, n0 + BLOCK_N)`` of batch ``b`` in
    ``HEADS_PER_PROGRAM`` heads of the list "q's ``H_Q`` heads, then k's ``H_K``" (a chunk may
    hold heads of both; ``HEADS_PER_PROGRAM >= H_Q + H_K`` is one program for all of them).
    k has ``N`` rows at positions ``0..N-1``; q's row ``i`` sits at position ``q_shift + i``
    (q has ``N - q_shift`` rows: the last positions, as a query chunk continuing a KV cache).

    The last dimension of every tensor has unit stride (checked by the launcher), which lets
    loads vectorize. ``H_K = 0`` rotates q alone. ``stride_ab = 0`` shares angles over batches.
    ``FROM_INV_FREQ``: ``angles_ptr`` holds ``inv_freq`` ``[R/2]`` and the angles of the
    positions ``pos0..pos0+N-1`` are formed here, as the fp32 product ``rope_angles`` forms (no
    table, and no kernels to build one, which cost as much as this one at short sequences).
    ``ANGLE_GRAD`` (a backward: q, k hold the cotangents, ``aq``, ``ak`` the forward's inputs):
    also stores ``sum_heads a1 y2 - a2 y1`` of the program's heads (``_rotate_heads``) into
    ``d_angles`` ``[head chunks, B, N, R/2]`` fp32 at ``(pid_h, b)``.
    """
    pid_n = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_d = tl.arange(0, HALF_P)
    if FROM_INV_FREQ:
        w = tl.load(angles_ptr + offs_d, mask=offs_d < R // 2, other=0.0)
        theta = (pos0 + offs_n).to(tl.float32)[:, None] * w[None, :]
    else:
        # int64 rows: a [N, R/2] table passes 2**31 elements at N * R / 2 >= 2**31
        rows = offs_n.to(tl.int64)[:, None] * stride_an
        a_ptrs = angles_ptr + pid_b * stride_ab + rows + offs_d[None, :]
        theta = tl.load(a_ptrs, mask=mask_n[:, None] & (offs_d < R // 2)[None, :], other=0.0)
    # sin/cos once per (position, frequency) and program, in fp32, reused by all its heads.
    cos, sin = cos_sin_of_angle(theta, FAST_TRIG)
    # rotary_scale (the scaled schedules' attention factor) scales the rotated channels
    # alone, as scaled cos/sin do; once per (position, frequency), not per head.
    cos = (cos * rotary_scale)[None, :, :]
    sin = (sin * rotary_scale)[None, :, :]
    if CONJUGATE:
        sin = -sin  # R(-theta) = R(theta)^T: the backward of the rotation
    if HEADS_PER_PROGRAM >= H_Q + H_K:
        # Constant loop bounds when one program takes every head.
        q_lo, q_hi, k_lo, k_hi = 0, H_Q, 0, H_K
    else:
        h_lo = pid_h * HEADS_PER_PROGRAM
        h_hi = h_lo + HEADS_PER_PROGRAM
        q_lo, q_hi = tl.minimum(h_lo, H_Q), tl.minimum(h_hi, H_Q)
        k_lo, k_hi = tl.maximum(h_lo - H_Q, 0), tl.minimum(h_hi - H_Q, H_K)
    cross = _rotate_heads(
        q_ptr + pid_b * stride_qb, q_out_ptr + pid_b * stride_qob, aq_ptr + pid_b * stride_aqb,
        stride_qh, stride_qn, stride_qoh, stride_qon, stride_aqh, stride_aqn, offs_n - q_shift,
        mask_n & (offs_n >= q_shift), cos, sin, q_scale, q_lo, q_hi,
        D, R, HALF_P, PASS_P, BLOCK_N, BLOCK_HQ, INTERLEAVED, COPY_PASS, ANGLE_GRAD,
    )  # fmt: skip
    cross += _rotate_heads(
        k_ptr + pid_b * stride_kb, k_out_ptr + pid_b * stride_kob, ak_ptr + pid_b * stride_akb,
        stride_kh, stride_kn, stride_koh, stride_kon, stride_akh, stride_akn, offs_n, mask_n,
        cos, sin, k_scale, k_lo, k_hi,
        D, R, HALF_P, PASS_P, BLOCK_N, BLOCK_HK, INTERLEAVED, COPY_PASS, ANGLE_GRAD,
    )  # fmt: skip
    if ANGLE_GRAD:  # q's rows are k's last ones: both heads' sums land in the row's slot
        chunk = tl.program_id(1) * tl.num_programs(2) + pid_b
        out = d_angles_ptr + (chunk * N + offs_n.to(tl.int64))[:, None] * (R // 2) + offs_d[None, :]
        tl.store(out, cross, mask=mask_n[:, None] & (offs_d < R // 2)[None, :])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Launch shape: ``block_n`` positions per program, ``block_hq``/``block_hk`` heads per
    loop iteration, ``num_warps`` warps per program, and ``heads_per_program`` of the list
    "q's heads, then k's" per program (None: all of them, one program per position tile)."""

    block_n: int
    block_hq: int
    block_hk: int
    num_warps: int
    heads_per_program: int | None = None

    def __post_init__(self):
        for name in ("block_n", "block_hq", "block_hk", "num_warps"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"TileConfig.{name} must be >= 1, got {value}")
            if value & (value - 1):  # the kernel's tl.arange over each, and warps likewise
                raise ValueError(f"TileConfig.{name} must be a power of 2, got {value}")
        if self.heads_per_program is not None and self.heads_per_program < 1:
            raise ValueError(
                f"TileConfig.heads_per_program must be None or >= 1, got {self.heads_per_program}"
            )


def tile_config(
    batch: int, seq_len: int, heads_q: int, heads_k: int, rope_dim: int, device: torch.device
) -> TileConfig:
    """Heuristic launch shape (no autotuning: deterministic and free to trace), from a sweep of
    launch shapes on an H100 at the three benchmark shapes (``fused_rope/README.md``):

    * about 512 rotated pairs per loop iteration on 4 warps (4 pairs a thread);
    * one program for every head while that is at most two loop iterations (q's head block
      and k's), else one head block per program: a program's iterations run one after the
      other, each waiting for its own loads, so at (2, 32/8, 4096, 128) five iterations a
      program were 5% slower than one, while at 16 heads two iterations sharing one sin/cos
      were 1% faster than two programs;
    * fewer positions per program until the grid has 4 programs per SM.

    The interpreter runs programs one by one, so there it takes one program per 2048 pairs
    and every head.
    """
    half_p = next_power_of_2(rope_dim // 2)
    block_hq = min(next_power_of_2(max(heads_q, 1)), 8)
    block_hk = min(next_power_of_2(max(heads_k, 1)), 8)
    block_h = max(block_hq, block_hk)
    if device.type != "cuda":
        return TileConfig(max(1, min(64, 2048 // (half_p * block_h))), block_hq, block_hk, 4)
    iterations = cdiv(heads_q, block_hq) + cdiv(heads_k, block_hk)
    heads_per_program = None if iterations <= 2 else block_h
    chunks = 1 if heads_per_program is None else cdiv(heads_q + heads_k, block_h)
    block_n = max(1, 512 // (half_p * block_h))
    while block_n > 1 and batch * chunks * cdiv(seq_len, block_n) < 4 * num_sms(device):
        block_n //= 2
    num_warps = max(1, min(4, block_n * half_p * block_h // 128))
    return TileConfig(block_n, block_hq, block_hk, num_warps, heads_per_program)


def _launch(
    q: torch.Tensor,
    q_out: torch.Tensor,
    k: torch.Tensor | None,
    k_out: torch.Tensor | None,
    angles: torch.Tensor,
    layout: str,
    rope_dim: int,
    q_scale: float,
    k_scale: float,
    rotary_scale: float,
    conjugate: bool,
    config: TileConfig | None,
    position_offset: int = 0,
    inputs: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    kernel=None,
) -> torch.Tensor | None:
    """Rotates ``q`` (and ``k``) into ``q_out`` (``k_out``) by ``kernel``: ``_rope_kernel``
    (None; looked up at the call, so that a stand-in patched into the module reaches it) or,
    in a custom op's body, what ``wrap_triton`` makes of it. ``inputs``: a backward's launch
    (q, k the cotangents) that also forms the angles' gradient from the forward's inputs
    ``(q, k)``, returned as ``[head chunks, B, N, R/2]`` fp32 (sum it over the chunks).
    ``q_scale``/``k_scale`` scale the whole of q's/k's output, ``rotary_scale`` also its
    rotated channels."""
    kernel = _rope_kernel if kernel is None else kernel
    B, H_Q, NQ, D = q.shape
    if B > MAX_GRID_AXIS2:  # the batch is the grid's third axis: a launch per slice of it
        return _launch_batch_slices(q, q_out, k, k_out, angles, layout, rope_dim, q_scale,
                                    k_scale, rotary_scale, conjugate, config, position_offset,
                                    inputs, kernel)  # fmt: skip
    H_K = 0 if k is None else k.shape[1]
    N = NQ if k is None else k.shape[2]  # the positions: k's, with q's rows the last NQ
    a_q, a_k = (q, k) if inputs is None else inputs
    if k is None:  # the k loop runs zero times; any valid pointer and strides do
        k, k_out, a_k = q, q_out, a_q
    if angles.stride(-1) != 1:
        angles = angles.contiguous()  # [.., N, R/2] fp32 (or inv_freq): small next to q and k
    stride_ab = angles.stride(0) if angles.dim() == 3 and angles.shape[0] > 1 else 0
    cfg = config or tile_config(B, N, H_Q, H_K, rope_dim, q.device)
    # In place with unit scale, the pass-through channels already hold the result.
    copy_pass = rope_dim < D and not (q_out is q and q_scale == 1.0 and k_scale == 1.0)
    heads = cfg.heads_per_program or H_Q + H_K
    grid = (cdiv(N, cfg.block_n), cdiv(H_Q + H_K, max(heads, 1)), B)
    d_angles = None
    if inputs is not None:
        # every program stores all of its rows (zeros where no head of it reaches them)
        d_angles = torch.empty(grid[1], B, N, rope_dim // 2, device=q.device, dtype=torch.float32)
    if B == 0 or N == 0 or H_Q + H_K == 0:
        return d_angles  # a grid with a zero dimension is not a valid launch
    # Without the angles' gradient its slot is never stored to: q_out can fill it, but not in a
    # traced launch, where a failed mutation analysis (it then takes every tensor for written)
    # would clone the slot apart from q_out and write that clone back as the output
    grad_slot = d_angles
    if grad_slot is None:
        grad_slot = q_out if kernel is _rope_kernel else q_out.new_empty(0)
    kernel[grid](
        q, k, q_out, k_out, angles, a_q, a_k, grad_slot,
        a_q.stride(0), a_q.stride(1), a_q.stride(2), a_k.stride(0), a_k.stride(1), a_k.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        stride_ab, angles.stride(-2) if angles.dim() > 1 else 0,
        N, N - NQ, position_offset, float(q_scale), float(k_scale), float(rotary_scale),
        H_Q=H_Q, H_K=H_K, D=D, R=rope_dim,
        HALF_P=next_power_of_2(rope_dim // 2),
        PASS_P=next_power_of_2(max(D - rope_dim, 1)),
        BLOCK_N=cfg.block_n, BLOCK_HQ=cfg.block_hq, BLOCK_HK=cfg.block_hk,
        HEADS_PER_PROGRAM=heads,
        INTERLEAVED=layout == "interleaved", CONJUGATE=conjugate, COPY_PASS=copy_pass,
        # The angles' gradient is never rounded to q's dtype: libm's sin/cos for it (the
        # hardware's ~1e-6 error showed at 3x the reference's fp32 error in dinv_freq).
        FAST_TRIG=fast_trig(q) and inputs is None,
        FROM_INV_FREQ=angles.dim() == 1,
        ANGLE_GRAD=inputs is not None,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return d_angles


def _launch_batch_slices(q, q_out, k, k_out, angles, layout, rope_dim, q_scale, k_scale,
                         rotary_scale, conjugate, config, position_offset, inputs,
                         kernel):  # fmt: skip
    """``_launch`` for more batches than a grid axis takes: one launch per ``MAX_GRID_AXIS2``
    of them (the angles' gradient of each, ``[head chunks, slice, N, R/2]``, joined)."""
    per_batch = angles.dim() == 3 and angles.shape[0] > 1  # else shared by every batch
    d_angles = []
    for b in range(0, q.shape[0], MAX_GRID_AXIS2):
        rows = slice(b, b + MAX_GRID_AXIS2)
        sliced = [None if x is None else x[rows] for x in (q, q_out, k, k_out)]
        part = _launch(
            *sliced, angles[rows] if per_batch else angles, layout, rope_dim, q_scale,
            k_scale, rotary_scale, conjugate, config, position_offset,
            None if inputs is None else tuple(None if x is None else x[rows] for x in inputs),
            kernel,
        )  # fmt: skip
        d_angles.append(part)
    return None if inputs is None else torch.cat(d_angles, dim=1)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # Incoming gradients may have any strides; the kernel needs a contiguous last dimension.
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _empty_out(x: torch.Tensor) -> torch.Tensor:
    """The fake functions' output for input ``x``: the same allocation rule as ``rope_fwd``,
    so the strides torch.compile plans with are the strides the kernel writes."""
    return torch.empty_like(_unit_last_stride(x))


def rope_fwd(
    q: torch.Tensor,
    k: torch.Tensor | None,
    angles: torch.Tensor,
    layout: str,
    rope_dim: int,
    q_scale: float,
    k_scale: float,
    *,
    rotary_scale: float = 1.0,
    conjugate: bool = False,
    config: TileConfig | None = None,
    position_offset: int = 0,
    kernel=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unchecked launcher: ``(s_q R(theta) q, s_k R(theta) k)``; ``k`` may be None;
    ``rotary_scale`` also scales the rotated channels (``R`` becomes ``rotary_scale R``).
    ``angles``: fp32 ``[N, R/2]`` or ``[1 | B, N, R/2]``, or ``inv_freq`` ``[R/2]`` for the
    positions ``position_offset..position_offset+N-1``, ``N`` k's length (q's without k); q's
    ``NQ <= N`` rows take the last ``NQ`` positions.

    ``conjugate=True`` rotates by ``-theta``: the backward, with the SAME scales (seed 000's
    rule: ``y = s R x`` gives ``dx = s R^T dy``). Outputs come from ``torch.empty_like``: the
    input's strides when it is dense (e.g. a ``[B, N, H, D]`` buffer viewed as
    ``[B, H, N, D]``), contiguous otherwise.
    """
    return _rotated(q, k, angles, layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate,
                    config, position_offset, kernel=kernel)[:2]  # fmt: skip


def _rotated(q, k, angles, layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate, config,
             offset, inputs=None, kernel=None):  # fmt: skip
    """``rope_fwd``'s outputs and ``_launch``'s angles' gradient: ``(q_out, k_out,
    d_angles)`` (``d_angles`` None without ``inputs``)."""
    q = _unit_last_stride(q)
    k = None if k is None else _unit_last_stride(k)
    if inputs is not None:  # a double backward's: the first backward's cotangents, any strides
        inputs = tuple(None if x is None else _unit_last_stride(x) for x in inputs)
    q_out = torch.empty_like(q)
    k_out = None if k is None else torch.empty_like(k)
    d_angles = _launch(
        q, q_out, k, k_out, angles, layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate,
        config, offset, inputs, kernel,
    )  # fmt: skip
    return q_out, k_out, d_angles


# --------------------------------------------------------------------------------------------
# Autograd. Eager calls go through a plain autograd.Function: the custom-op dispatcher costs
# about twice as much host time per call, as much as the whole kernel at small shapes. Under
# torch.compile the custom ops below take over. Both save the angles (and q, k when the angles
# need a gradient: ``_angle_grads``), and both backward passes call their own forward with
# the conjugate rotation, so double backward works.
# --------------------------------------------------------------------------------------------


def _rows_cross(q, k, dq, dk, layout, rope_dim) -> torch.Tensor:
    """``pair_cross`` of q and k with their gradients, ``[B, N, R/2]``: q's rows add into
    k's last ones, the table rows that rotated them (``k`` None: q's alone)."""
    grad = pair_cross(q, dq, layout, rope_dim)  # [B, NQ, R/2]
    if k is None:
        return grad
    return pair_cross(k, dk, layout, rope_dim) + F.pad(grad, (0, 0, k.shape[2] - q.shape[2], 0))


def _angles_grad(cross, angles, conjugate, offset) -> torch.Tensor:
    """The gradient of ``angles`` (an angle table ``[.., N, R/2]``, or ``inv_freq`` ``[R/2]``
    for the positions ``offset..offset+N-1``) from ``cross`` ``[B, N, R/2]``, the table rows'
    ``x1 dx2 - x2 dx1`` summed over what they rotated; negated for the conjugate rotation."""
    if conjugate:
        cross = -cross
    if angles.dim() > 1:
        return rows_grad(cross, angles)
    pos = torch.arange(offset, offset + cross.shape[1], device=cross.device)
    return chain_positions(cross, pos, angles, (False, True))[1]


def _saved_inputs(ctx, q, k, angles, q_scale, k_scale, rotary_scale) -> None:
    """Saves the angles, with q and k only where the angles need a gradient (``_angles_grad``
    reads them), and the rotation's scales."""
    ctx.scales = (q_scale, k_scale, rotary_scale)
    ctx.angles_grad = angles.requires_grad
    ctx.save_for_backward(angles, *((q, k) if ctx.angles_grad else ()))


def _backward_rotation(ctx, rotate, dq_out, dk_out, layout, rope_dim, conjugate, offset):
    """``(dq, dk, d_angles)`` from the saved tensors (``_saved_inputs``): ``rotate(dq_out,
    dk_out, angles)`` rotates the cotangents back; ``conjugate`` is the forward's.

    The angles' gradient: in an eager backward that is not itself recorded (no double
    backward), the RoPE kernel forms it while it rotates the cotangents (one more read of q
    and k; ``_launch``'s ``inputs``). Otherwise, where the backward must be differentiable or
    traced, PyTorch does (``_rows_cross``), from gradients rotated in fp32: their rounding to a
    half dtype would cost it ~2e-4 of relative error in fp16, where autograd of the
    fp32-computing reference has ~1e-7 (the kernel sums before rounding too)."""
    # forward-over-reverse: the kernel would drop the tangent (a silent zero)
    cotangents = {"the cotangent of the rotated q (or x)": dq_out,
                  "the cotangent of the rotated k": dk_out}  # fmt: skip
    check_no_tangent("fused_rope.naive.apply_rope_ref", **cotangents)
    # unpacked once: non-reentrant activation checkpointing refuses a second unpack
    saved = ctx.saved_tensors
    angles, *inputs = saved
    if not ctx.angles_grad:
        return (*rotate(dq_out, dk_out, angles), None)
    q, k = inputs
    if backward_launches_directly(dq_out, dk_out, *saved):
        dq, dk, cross = _rotated(
            dq_out, dk_out, angles, layout, rope_dim, *ctx.scales, not conjugate, None, offset,
            (q, k),
        )  # fmt: skip
        return dq, dk, _angles_grad(cross.sum(0), angles, conjugate, offset)
    wide = lambda t: None if t is None else t.float()
    dq, dk = rotate(wide(dq_out), wide(dk_out), angles)
    cross = _rows_cross(q, k, dq, dk, layout, rope_dim)
    narrow = lambda t, like: None if t is None else t.to(like.dtype)
    return narrow(dq, dq_out), narrow(dk, dk_out), _angles_grad(cross, angles, conjugate, offset)


class _RopeFunction(torch.autograd.Function):
    # forward and setup_context apart: the style torch.func.grad / vjp accept
    @staticmethod
    def forward(q, k, angles, layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate, offset):
        return rope_fwd(
            q, k, angles, layout, rope_dim, q_scale, k_scale, rotary_scale=rotary_scale,
            conjugate=conjugate, position_offset=offset,
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, angles, layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate, offset = inputs
        _saved_inputs(ctx, q, k, angles, q_scale, k_scale, rotary_scale)
        ctx.args = (layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate, offset)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate, offset = ctx.args

        def rotate(dq, dk, angles):
            args = (dq, dk, angles, layout, rope_dim, q_scale, k_scale, rotary_scale,
                    not conjugate, offset)  # fmt: skip
            # The launch alone where the backward is eager and not recorded: Function.apply
            # costs host time (tens of us) an eager step pays per layer; else through the
            # Function, so that the backward can be differentiated again.
            if backward_launches_directly(dq, dk, angles):
                return _RopeFunction.forward(*args)
            return _RopeFunction.apply(*args)

        dq, dk, d_angles = _backward_rotation(
            ctx, rotate, dq_out, dk_out, layout, rope_dim, conjugate, offset
        )
        return dq, dk, d_angles, None, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Checks: the public functions' and, for calls through torch.ops, the custom ops'
# --------------------------------------------------------------------------------------------


def _check_rotated_tensors(q, k, *, q_name: str = "q", unit_stride: bool = True) -> int:
    """``q`` ``[B, HQ, NQ, D]`` (named ``q_name``) and ``k`` ``[B, HK, N, D]`` (or None): 4-d
    tensors of ``KERNEL_DTYPES``, one dtype, ``NQ <= N``; with ``unit_stride`` a contiguous
    last dimension (the public functions' contract; the ops copy one that is not, except the
    in-place op, which cannot). Returns the positions' count ``N`` (q's ``NQ`` without k)."""
    for name, x in ((q_name, q), ("k", k)):
        if x is None:
            continue
        check_float_tensor(x, name, ndim=4, dtypes=KERNEL_DTYPES)
        if unit_stride and x.stride(-1) != 1 and x.shape[-1] > 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride 1), got strides "
                f"{x.stride()} for shape {tuple(x.shape)}; call .contiguous() first"
            )
    if k is None:
        return q.shape[2]
    if (k.shape[0], k.shape[3]) != (q.shape[0], q.shape[3]) or q.shape[2] > k.shape[2]:
        raise ValueError(
            f"k must match q in batch and head dim and have at least q's length (q's rows "
            f"take k's last positions), got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    return k.shape[2]


def _check_angle_operand(t, name: str, batch: int, seq_len: int, rope_dim: int) -> None:
    """The kernels' angle argument ``t``: ``angles`` ``[N, R/2]`` or ``[1 | B, N, R/2]``, or
    ``inv_freq`` ``[R/2]`` (``name`` says which), fp32."""
    if name == "angles":
        check_angles(t, batch, seq_len, rope_dim)
    else:
        check_inv_freq(t, rope_dim)
    if t.dtype != torch.float32:
        raise TypeError(
            f"{name} must be float32 (the kernel's; in half precision, far positions are off by "
            f"whole radians), got {t.dtype}: pass {name}.float()"
        )


def _check_rotation_op(q, k, angles, layout, rope_dim, offset, *, in_place=False) -> None:
    """What the rotation kernel indexes by, checked in the rotation ops' bodies: a call
    through ``torch.ops`` (``torch.ops.fused_rope.rope``, ``rope_qk``, ``rope_``) skips the
    public functions' checks, and a short ``angles`` or a ``k`` shorter than ``q`` would be
    read past its end. ``angles``: a table (2 or 3 dimensions) or ``inv_freq`` (1). The
    in-place op (``in_place``) also needs a contiguous last dimension and elements that do
    not share memory."""
    n = _check_rotated_tensors(q, k, q_name="q" if k is not None else "x", unit_stride=in_place)
    check_layout(layout)
    R = check_rope_dim(rope_dim, q.shape[-1])
    check_float_tensor(angles, "angles")
    table = angles.dim() > 1
    _check_position_offset(offset, angles if table else None, n)
    _check_angle_operand(angles, "angles" if table else "inv_freq", q.shape[0], n, R)
    check_same_device(q=q, k=k, angles=angles)
    if in_place and may_overlap(q):
        raise ValueError(
            f"x's elements share memory (strides {q.stride()} for shape {tuple(q.shape)}): "
            "an in-place rotation would write them twice"
        )


def _check_rope_op(x, angles, layout, rope_dim, scale, rotary_scale, conjugate, offset):
    _check_rotation_op(x, None, angles, layout, rope_dim, offset)


def _check_rope_qk_op(q, k, angles, layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate,
                      offset):  # fmt: skip
    _check_rotation_op(q, k, angles, layout, rope_dim, offset)


def _check_rope_inplace_op(x, angles, layout, rope_dim, scale, rotary_scale, offset):
    _check_rotation_op(x, None, angles, layout, rope_dim, offset, in_place=True)


def _check_position_offset(position_offset, angles, seq_len: int):
    """``position_offset`` as an int (numpy's too; a SymInt as it is), checked: 0 with an angle
    table (whose rows are the positions), else >= 0 and, when not 0, keeping inv_freq's
    positions below 2**24 (fp32 holds them exactly there; offset 0 keeps its earlier contract,
    positions ``0..N-1`` whatever N)."""
    integral = isinstance(position_offset, (numbers.Integral, torch.SymInt))
    if isinstance(position_offset, bool) or not integral:
        raise TypeError(f"position_offset must be an int, got {type(position_offset).__name__}")
    if isinstance(position_offset, numbers.Integral):
        position_offset = int(position_offset)
    if position_offset == 0:
        return position_offset
    if angles is not None:
        raise ValueError(
            "position_offset shifts inv_freq's positions; with an angle table, pass the "
            f"table's rows for the input's positions instead (got position_offset="
            f"{position_offset} and angles)"
        )
    if position_offset < 0 or position_offset + seq_len > 2**24:
        raise ValueError(
            f"position_offset must be >= 0 with position_offset + N <= 2**24 (fp32 positions "
            f"are exact below it), got {position_offset} with N={seq_len}"
        )
    return position_offset


# --------------------------------------------------------------------------------------------
# Custom ops, what torch.compile traces (fullgraph), autograd registered. No device type is
# given, so the ops run on CUDA and, through the interpreter, on the CPU.
#
# rope_qk, which rope_attention's separate path and the harness's RoPE take, is a triton_op
# where Triton compiles: AOTAutograd traces into its body, whose launch goes through
# wrap_triton, so Inductor launches the kernel from its own wrapper code. As an opaque custom
# op each call of a compiled step paid the op's Python dispatch and Triton's launcher: host
# time that left a compiled RoPE model's step 28% behind NoPE's (lm/README.md, "torch.compile").
# In the interpreter tracing cannot see the interpreted kernel (wrap_triton hands it back, or,
# before PyTorch 2.13, refuses it): an opaque custom op there, with a fake function of its
# own. The single-tensor and in-place ops stay opaque: their launches pass one tensor in
# several of the kernel's slots (k's are q's), which a traced kernel's functionalization
# would take for separate tensors.
# --------------------------------------------------------------------------------------------

TRACEABLE_KERNEL = not interpreting()


@torch.library.custom_op("fused_rope::rope", mutates_args=())
@on_input_device
@checked(_check_rope_op)
def _rope_op(
    x: torch.Tensor,
    angles: torch.Tensor,
    layout: str,
    rope_dim: int,
    scale: float,
    rotary_scale: float,
    conjugate: bool,
    offset: int,
) -> torch.Tensor:
    return rope_fwd(
        x, None, angles, layout, rope_dim, scale, 1.0, rotary_scale=rotary_scale,
        conjugate=conjugate, position_offset=offset,
    )[0]  # fmt: skip


@_rope_op.register_fake
def _(x, angles, layout, rope_dim, scale, rotary_scale, conjugate, offset):
    return _empty_out(x)


def _rope_setup(ctx, inputs, output):
    x, angles, ctx.layout, ctx.rope_dim, ctx.scale, ctx.rotary_scale = inputs[:6]
    ctx.conjugate, ctx.offset = inputs[6:]
    _saved_inputs(ctx, x, None, angles, ctx.scale, 1.0, ctx.rotary_scale)


def _rope_backward(ctx, grad):
    rotate = lambda dx, _, angles: (
        _rope_op(dx, angles, ctx.layout, ctx.rope_dim, ctx.scale, ctx.rotary_scale,
                 not ctx.conjugate, ctx.offset),
        None,
    )  # fmt: skip
    dx, _, d_angles = _backward_rotation(
        ctx, rotate, grad, None, ctx.layout, ctx.rope_dim, ctx.conjugate, ctx.offset
    )
    return dx, d_angles, None, None, None, None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


@(torch.library.triton_op if TRACEABLE_KERNEL else torch.library.custom_op)(
    "fused_rope::rope_qk", mutates_args=()
)
@on_input_device
@checked(_check_rope_qk_op)
def _rope_qk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    angles: torch.Tensor,
    layout: str,
    rope_dim: int,
    q_scale: float,
    k_scale: float,
    rotary_scale: float,
    conjugate: bool,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # traceable under a tracer; the plain kernel in an eager call (the triton_op turns wrapping
    # off there: wrap_triton reads that switch, so it wraps at each call) and in the
    # interpreter (where PyTorch before 2.13's wrap_triton refuses the interpreted kernel)
    kernel = torch.library.wrap_triton(_rope_kernel) if TRACEABLE_KERNEL else _rope_kernel
    return rope_fwd(
        q, k, angles, layout, rope_dim, q_scale, k_scale, rotary_scale=rotary_scale,
        conjugate=conjugate, position_offset=offset, kernel=kernel,
    )  # fmt: skip


if not TRACEABLE_KERNEL:  # a triton_op's body is its own fake function

    @_rope_qk_op.register_fake
    def _(q, k, angles, layout, rope_dim, q_scale, k_scale, rotary_scale, conjugate, offset):
        return _empty_out(q), _empty_out(k)


def _rope_qk_setup(ctx, inputs, output):
    q, k, angles, ctx.layout, ctx.rope_dim, ctx.q_scale, ctx.k_scale = inputs[:7]
    ctx.rotary_scale, ctx.conjugate, ctx.offset = inputs[7:]
    _saved_inputs(ctx, q, k, angles, ctx.q_scale, ctx.k_scale, ctx.rotary_scale)


def _rope_qk_backward(ctx, dq_out, dk_out):
    rotate = lambda dq, dk, angles: _rope_qk_op(
        dq, dk, angles, ctx.layout, ctx.rope_dim, ctx.q_scale, ctx.k_scale, ctx.rotary_scale,
        not ctx.conjugate, ctx.offset,
    )  # fmt: skip
    dq, dk, d_angles = _backward_rotation(
        ctx, rotate, dq_out, dk_out, ctx.layout, ctx.rope_dim, ctx.conjugate, ctx.offset
    )
    return dq, dk, d_angles, None, None, None, None, None, None, None


_rope_qk_op.register_autograd(_rope_qk_backward, setup_context=_rope_qk_setup)


@torch.library.custom_op("fused_rope::rope_", mutates_args=("x",))
@on_input_device
@checked(_check_rope_inplace_op)
def _rope_inplace_op(
    x: torch.Tensor,
    angles: torch.Tensor,
    layout: str,
    rope_dim: int,
    scale: float,
    rotary_scale: float,
    offset: int,
) -> None:
    _launch(x, x, None, None, angles, layout, rope_dim, scale, 1.0, rotary_scale, False, None,
            offset)  # fmt: skip


@_rope_inplace_op.register_fake
def _(x, angles, layout, rope_dim, scale, rotary_scale, offset):
    return None


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _dispatch_rotation(q, k, angles, layout: str, R: int, scales: tuple[float, float, float],
                       offset):  # fmt: skip
    """The checked out-of-place rotation of q (and k, unless None) with ``scales = (q_scale,
    k_scale, rotary_scale)``: the custom op under a tracer (``runs_eagerly``), the
    autograd.Function where autograd records the call, else the launcher directly. Returns
    ``(q_out, k_out)``, ``k_out`` None without k."""
    q_scale, k_scale, rotary_scale = scales
    xs = (q,) if k is None else (q, k)
    if not runs_eagerly(*xs, angles):
        if k is None:
            return _rope_op(q, angles, layout, R, q_scale, rotary_scale, False, offset), None
        return _rope_qk_op(q, k, angles, layout, R, *scales, False, offset)
    if needs_autograd(*xs, angles):
        return _RopeFunction.apply(q, k, angles, layout, R, *scales, False, offset)
    return rope_fwd(
        q, k, angles, layout, R, q_scale, k_scale, rotary_scale=rotary_scale,
        position_offset=offset,
    )  # fmt: skip


def _kernel_angles(angles, inv_freq, batch: int, seq_len: int, rope_dim: int, **inputs):
    """The kernels' angle argument: ``angles`` ``[.., N, R/2]``, or ``inv_freq`` ``[R/2]`` for
    the positions from the offset (exactly one of them given), fp32,
    on the device of the named ``inputs`` (the first of which names a kernel-capable
    device)."""
    if (angles is None) == (inv_freq is None):
        given = "both" if angles is not None else "neither"
        raise ValueError(f"pass exactly one of angles and inv_freq, got {given}")
    name, t = ("angles", angles) if angles is not None else ("inv_freq", inv_freq)
    _check_angle_operand(t, name, batch, seq_len, rope_dim)
    # the reference has forward-mode derivatives; inv_freq reaches it through rope_angles
    reference = "fused_rope.naive.apply_rope_ref" + (
        "" if angles is not None else "(x, fused_rope.rope_angles(positions, inv_freq))"
    )
    check_no_tangent(reference, **{name: t})
    check_kernel_device(check_same_device(**inputs, **{name: t}), next(iter(inputs)))
    return t


@on_input_device
def apply_rope(
    x: torch.Tensor,
    angles: torch.Tensor | None = None,
    *,
    inv_freq: torch.Tensor | None = None,
    layout: str = "half",
    rope_dim: int | None = None,
    output_scale: float = 1.0,
    attention_factor: float = 1.0,
    inplace: bool = False,
    position_offset: int = 0,
) -> torch.Tensor:
    """Rotates the first ``rope_dim`` channels of ``x`` by ``angles`` (Triton); scales all of it.

    Args:
        x: ``[B, H, N, D]`` fp32/fp16/bf16, any strides with a contiguous last dimension.
        angles: fp32 ``[N, R/2]`` or ``[1 | B, N, R/2]``, ``R = rope_dim``
            (even, at most ``D``; default ``D``). Differentiable (learned frequencies, e.g.
            RoPE-Mixed's ``nd_rope_angles``): its gradient is ``x1 dx2 - x2 dx1`` summed over
            the heads (and the batch for a shared table) from the backward's ``dx``.
            For fp16/bf16 ``x`` on a GPU, ``|angles| < 2**24`` (16.7M radians: position
            times the fastest frequency), the range of the kernel's exact reduction.
        inv_freq: fp32 ``[R/2]``, instead of ``angles``, for the positions ``0..N-1`` (or
            from ``position_offset``): the kernel forms ``rope_angles(arange(position_offset,
            position_offset + N), inv_freq)`` itself (bitwise the same angles, without the
            kernels that would build the table). Differentiable, as ``angles``.
        layout: ``"half"`` pairs channel ``d`` with ``d + R/2``; ``"interleaved"`` pairs
            ``2d`` with ``2d + 1``.
        output_scale: multiplies the whole output (rotated and pass-through channels);
            the backward uses the same scale.
        attention_factor: multiplies the rotated channels alone: the factor that
            ``rope_frequencies`` returns with YaRN's and LongRoPE's frequencies, which Hugging
            Face's models multiply into cos and sin (so with ``rope_dim < D`` it is not an
            output scale: the pass-through channels keep their values). Times
            ``output_scale`` on the rotated channels.
        inplace: write the result into ``x``'s storage and return ``x``. Forward only:
            refused (``ValueError``) when grad mode is on and ``x`` (or ``angles``, or
            ``inv_freq``) requires grad, when elements of ``x`` may share memory, and for an
            inference tensor outside ``torch.inference_mode()``.
        position_offset: with ``inv_freq``, the positions are ``position_offset ..
            position_offset + N - 1`` (new tokens after a KV cache of that many), with no
            position tensor or angle table built per call. An int >= 0, with
            ``position_offset + N <= 2**24`` when not 0; must be 0 with ``angles`` (slice the
            table).

    Returns:
        ``[B, H, N, D]`` in ``x``'s dtype, laid out as ``torch.empty_like(x)`` lays it out:
        ``x``'s strides when ``x`` is dense, else dense in ``x``'s order of dimensions (a slice
        of a ``[B, N, 3 H, D]`` qkv buffer gives a ``[B, N, H, D]``-ordered output).
        Differentiable in ``x`` (backward: the same kernel rotating by ``-angles``) and in
        ``angles`` or ``inv_freq``, unless ``inplace``.
    """
    N = _check_rotated_tensors(x, None, q_name="x")
    check_layout(layout)
    B, _, _, D = x.shape
    R = check_rope_dim(rope_dim, D)
    position_offset = _check_position_offset(position_offset, angles, N)
    angles = _kernel_angles(angles, inv_freq, B, N, R, x=x)
    check_no_tangent("fused_rope.naive.apply_rope_ref", x=x)
    scale = check_scale(output_scale, "output_scale")
    factor = check_attention_factor(attention_factor)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    offset = position_offset
    if not inplace:
        return _dispatch_rotation(x, None, angles, layout, R, (scale, 1.0, factor), offset)[0]
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(
            "inplace=True overwrites x, but x requires grad and grad mode is on "
            f"(x is {'a leaf' if x.is_leaf else 'part of a graph'}); use inplace=False, "
            "or run under torch.no_grad() / torch.inference_mode()"
        )
    if torch.is_grad_enabled() and angles.requires_grad:
        raise ValueError(
            f"inplace=True has no backward, but {'angles' if angles.dim() > 1 else 'inv_freq'}"
            " requires grad and grad mode is on; use inplace=False to differentiate it, or "
            "pass it detached"
        )
    if may_overlap(x):
        raise ValueError(
            f"inplace=True needs x whose elements do not share memory (no broadcast or "
            f"overlapping dimensions), got strides {x.stride()} for shape {tuple(x.shape)}"
        )
    # (Dynamo cannot trace is_inference; a compiled graph runs PyTorch's own check on x.)
    if (
        not torch.compiler.is_compiling()
        and x.is_inference()
        and not torch.is_inference_mode_enabled()
    ):
        raise ValueError(
            "inplace=True on an inference tensor outside torch.inference_mode(), which PyTorch "
            "does not allow for its own in-place ops either; run it under inference_mode"
        )
    if runs_eagerly(x, angles):
        _launch(x, x, None, None, angles, layout, R, scale, 1.0, factor, False, None, offset)
        # Ops that saved x for their backward must see that it changed.
        torch.autograd.graph.increment_version(x)
    else:
        _rope_inplace_op(x, angles, layout, R, scale, factor, offset)
    return x


@on_input_device
def apply_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    angles: torch.Tensor | None = None,
    *,
    inv_freq: torch.Tensor | None = None,
    layout: str = "half",
    rope_dim: int | None = None,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    attention_factor: float = 1.0,
    position_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k by the same angles in one launch (Triton); sin/cos computed once.

    Args:
        q: ``[B, HQ, NQ, D]`` fp32/fp16/bf16, any strides with a contiguous last dimension,
            ``NQ <= N``: q's rows take k's last ``NQ`` positions (``NQ < N``: a query chunk
            or decoding step continuing a KV cache, aligned bottom-right as causal attention
            aligns it).
        k: ``[B, HK, N, D]``, same B, D and dtype as ``q``; ``HK`` may differ (GQA, MQA).
        angles: fp32 ``[N, R/2]`` or ``[1 | B, N, R/2]``, k's positions' angles; differentiable
            (see ``apply_rope``): q's and k's rows add up in the rows they share.
        inv_freq: fp32 ``[R/2]`` instead of ``angles``, for the positions ``0..N-1`` (see
            ``apply_rope``), or ``position_offset..position_offset+N-1``.
        layout, rope_dim: as ``apply_rope``.
        q_scale, k_scale: output scales of q and k (e.g. ``q_scale = softmax_scale`` folds the
            attention scale into q; backward uses the same scales).
        attention_factor: multiplies the rotated channels of both (see ``apply_rope``): YaRN's
            and LongRoPE's factor from ``rope_frequencies``, as Hugging Face applies it.
        position_offset: with ``inv_freq``, k's first position (see ``apply_rope``): a
            decoding step rotates its new rows with ``position_offset`` = the cached length.

    Returns:
        ``(q_out [B, HQ, NQ, D], k_out [B, HK, N, D])``, dtypes and strides as ``apply_rope``;
        differentiable in q, k and ``angles`` or ``inv_freq``.
    """
    N = _check_rotated_tensors(q, k)
    check_layout(layout)
    B, _, _, D = q.shape
    R = check_rope_dim(rope_dim, D)
    position_offset = _check_position_offset(position_offset, angles, N)
    angles = _kernel_angles(angles, inv_freq, B, N, R, q=q, k=k)
    check_no_tangent("fused_rope.naive.apply_rope_ref", q=q, k=k)
    scales = (
        check_scale(q_scale, "q_scale"),
        check_scale(k_scale, "k_scale"),
        check_attention_factor(attention_factor),
    )
    return _dispatch_rotation(q, k, angles, layout, R, scales, position_offset)
