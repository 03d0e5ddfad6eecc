"""``rope_attention``: RoPE attention, fused into FlashAttention-2 Triton kernels
(``attention_forward.py``, ``attention_backward.py``, design in ``_attention_common.py``) or
the separate path (this package's RoPE kernel, then PyTorch's SDPA); input validation, the
dispatch between the two, and the torch custom ops that make the fused kernels traceable
(eager calls take the ops' autograd formula without their dispatch: ``_RopeAttentionFunction``).

Causal masking is bottom-right aligned, as in FlashAttention-2: query ``i`` sees key ``j``
iff ``j <= i + NK - NQ`` (by index, whatever the positions). A query that sees no key
(possible when ``NQ > NK``) gets ``o = 0``, ``lse = -inf`` and zero gradients.
"""

from __future__ import annotations

import contextlib

import torch

from fused_rope._angle_grads import chain_positions, pair_cross, rows_grad
from fused_rope._attention_common import rotated_width
from fused_rope._device import compute_capability, num_sms
from fused_rope._validation import (
    FP16_MAX,
    INT32_INDEX_LIMIT,
    MAX_GRID_AXIS1,
    autocast_inputs,
    backward_launches_directly,
    check_attention_factor,
    check_bool,
    check_float_tensor,
    check_kernel_device,
    check_layout,
    check_no_functorch,
    check_no_tangent,
    check_op_tensors,
    check_qkv,
    check_rope_dim,
    check_rotation_inputs,
    check_same_device,
    check_softmax_scale,
    check_window,
    checked,
    eager_function,
    element_span,
    needs_autograd,
    on_input_device,
    refuse_double_backward,
    runs_eagerly,
    under_functorch,
)
from fused_rope.attention_backward import (
    _DKDV_CONFIGS,
    _DQ_CONFIGS,
    _rope_attn_bwd_dkdv_kernel,
    _rope_attn_bwd_dq_kernel,
    rope_attention_bwd,
)
from fused_rope.attention_forward import (
    _FWD_CONFIGS,
    _rope_attn_fwd_kernel,
    hopper_forward_takes,
    rope_attention_fwd,
)
from fused_rope.frequencies import default_inv_freq, rope_angles
from fused_rope.sdpa import _lower_right_backend, sdpa_attention, window_hides_keys

MAX_HEAD_DIM = 256
# fp32 inputs take IEEE fp32 dots (CUDA cores, not tensor cores). At 256 channels the fused
# kernels spill 63-170 KB a thread block on sm_90 (ptxas, Triton 3.6: 64-row tiles) and each
# config compiles for half a minute or more: a test of two autotuned calls ran 400 s on an H100
# (session 33): fp32 heads wider than this go to SDPA.
MAX_FP32_HEAD_DIM = 128


def max_head_dim(dtype: torch.dtype) -> int:
    """The widest head the fused kernel takes in ``dtype``."""
    return MAX_FP32_HEAD_DIM if dtype == torch.float32 else MAX_HEAD_DIM


IMPLS = ("auto", "fused", "separate")
# What the refusals name: the PyTorch reference, which differentiates in every mode
_REFERENCE = "fused_rope.naive.rope_attention_ref"

# Each autotuned kernel with its full config list (pinned_config narrows the kernel's own).
_AUTOTUNED = (
    (_rope_attn_fwd_kernel, _FWD_CONFIGS),
    (_rope_attn_bwd_dkdv_kernel, _DKDV_CONFIGS),
    (_rope_attn_bwd_dq_kernel, _DQ_CONFIGS),
)
N_CONFIGS = min(len(configs) for _, configs in _AUTOTUNED)


@contextlib.contextmanager
def pinned_config(index: int):
    """Within the block every fused kernel runs config ``index`` of its autotune list, with
    no tuning (tests of each config, benchmarks that precompile configs in parallel)."""
    saved = [(kernel.configs, kernel.cache) for kernel, _ in _AUTOTUNED]
    try:
        for kernel, configs in _AUTOTUNED:
            kernel.configs, kernel.cache = [configs[index]], {}
        yield
    finally:
        for (kernel, _), (configs, cache) in zip(_AUTOTUNED, saved, strict=True):
            kernel.configs, kernel.cache = configs, cache


# --------------------------------------------------------------------------- custom ops


def _check_op_inputs(q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, rope_dim, window,
                     like_q=(), rows=()):  # fmt: skip
    """The fused kernels' contract for the tensors the custom ops pass them, as
    ``check_op_tensors`` says why; ``q_pos``, ``k_pos``: None or positions ``[1 | B, N]`` /
    angles ``[1 | B, N, R/2]`` of the queries' and the keys' N (their dtype and layout are
    ``_rope_tables``' to check)."""
    check_qkv(q, k, v)
    check_op_tensors(q, inv_freq, rope_dim, like_q=like_q, rows=rows, k=k, v=v)
    check_softmax_scale(softmax_scale, q.shape[-1])
    check_window(window or None, causal)
    B, _, NQ, _ = q.shape
    for name, pos, n in (("q_pos", q_pos, NQ), ("k_pos", k_pos, k.shape[2])):
        if pos is None:
            continue
        check_float_tensor(pos, name, ndim=(2, 3))
        if pos.shape[0] not in (1, B) or pos.shape[1] != n:
            raise ValueError(
                f"{name} must be positions [1 | B, {n}] or angles [1 | B, {n}, R/2] with "
                f"B = {B}, got {tuple(pos.shape)}"
            )
        check_same_device(q=q, **{name: pos})
    limit = _fused_limit(q, k, v, rope_dim, **dict(like_q))
    if limit is not None:
        raise ValueError(limit)


def _check_fwd_op(q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim,
                  attention_factor, window):  # fmt: skip
    _check_op_inputs(q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, rope_dim, window)


def _check_bwd_op(do, dlse, q, k, v, o, lse, inv_freq, q_pos, k_pos, causal, softmax_scale,
                  interleaved, rope_dim, attention_factor, window):  # fmt: skip
    _check_op_inputs(q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, rope_dim, window,
                     like_q=(("do", do), ("o", o)), rows=(("lse", lse), ("dlse", dlse)))  # fmt: skip


@torch.library.custom_op("fused_rope::rope_attention_fwd", mutates_args=())
@on_input_device
@checked(_check_fwd_op)
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    interleaved: bool,
    rope_dim: int,
    attention_factor: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_attention_fwd(
        q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim,
        attention_factor, window,
    )  # fmt: skip


@_fwd_op.register_fake
def _(q, k, v, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved, rope_dim, factor,
      window):  # fmt: skip
    B, HQ, NQ, _ = q.shape
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        q.new_empty((B, HQ, NQ), dtype=torch.float32),
    )


@torch.library.custom_op("fused_rope::rope_attention_bwd", mutates_args=())
@on_input_device
@checked(_check_bwd_op)
def _bwd_op(
    do: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    inv_freq: torch.Tensor,
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    interleaved: bool,
    rope_dim: int,
    attention_factor: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rope_attention_bwd(
        do,
        q,
        k,
        v,
        o,
        lse,
        dlse,
        inv_freq,
        q_pos,
        k_pos,
        causal,
        softmax_scale,
        interleaved,
        rope_dim,
        attention_factor,
        window,
    )


@_bwd_op.register_fake
def _(
    do, dlse, q, k, v, o, lse, inv_freq, q_pos, k_pos, causal, softmax_scale, interleaved,
    rope_dim, factor, window,
):  # fmt: skip
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, inv_freq, q_pos, k_pos, *args = inputs  # args: causal ... window
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, inv_freq, q_pos, k_pos)
    ctx.args = tuple(args)


def _rotation_grads(need, q, k, dq, dk, inv_freq, q_pos, k_pos, interleaved, rope_dim):
    """The gradients of ``inv_freq``, ``q_pos`` and ``k_pos`` (``need``: which) from q, k and
    their gradients (``_angle_grads``): the rows are angles ``[1 | B, N, R/2]``, positions
    ``[1 | B, N]`` or both None (positions ``0..NK-1``, queries at the last NQ)."""
    layout = "interleaved" if interleaved else "half"
    gq, gk = (pair_cross(x, dx, layout, rope_dim) for x, dx in ((q, dq), (k, dk)))
    if q_pos is not None and q_pos.dim() == 3:
        return None, rows_grad(gq, q_pos), rows_grad(gk, k_pos)
    if q_pos is None:
        NQ, NK = q.shape[2], k.shape[2]
        q_pos, k_pos = (torch.arange(a, NK, device=q.device) for a in (NK - NQ, 0))
    dq_pos, dq_freq = chain_positions(gq, q_pos, inv_freq, (need[1], need[0]))
    dk_pos, dk_freq = chain_positions(gk, k_pos, inv_freq, (need[2], need[0]))
    return dq_freq + dk_freq if need[0] else None, dq_pos, dk_pos


def _backward(ctx, do, dlse):
    # unpacked once: non-reentrant activation checkpointing refuses a second unpack
    saved = ctx.saved_tensors
    q, k, v, o, lse, inv_freq, q_pos, k_pos = saved
    # forward-over-reverse: the kernels would drop the tangent (a silent zero)
    check_no_tangent(_REFERENCE, **{"o's cotangent": do, "lse's cotangent": dlse})
    direct = backward_launches_directly(do, dlse, *saved)
    if do is None:
        do = torch.zeros_like(o)
    elif _head_span(do) >= INT32_INDEX_LIMIT:  # o is contiguous, so its cotangent can be too
        do = do.contiguous()
    if dlse is None:
        dlse = torch.zeros_like(lse)
    if direct:
        # the launcher without the op's dispatch (_RopeAttentionFunction); a backward that is
        # recorded (create_graph=True) takes the op, whose autograd refuses a second derivative
        dq, dk, dv = rope_attention_bwd(do, q, k, v, o, lse, dlse, inv_freq, q_pos, k_pos,
                                        *ctx.args)  # fmt: skip
    else:
        dq, dk, dv = _bwd_op(do, dlse, q, k, v, o, lse, inv_freq, q_pos, k_pos, *ctx.args)
    need = ctx.needs_input_grad[3:6]  # inv_freq, q_pos, k_pos
    rotation = (None, None, None)
    if any(need):
        _, _, interleaved, rope_dim, _, _ = ctx.args
        rotation = _rotation_grads(need, q, k, dq, dk, inv_freq, q_pos, k_pos, interleaved,
                                   rope_dim)  # fmt: skip
    return dq, dk, dv, *rotation, *(None for _ in ctx.args)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)
refuse_double_backward(_bwd_op, _REFERENCE)


# The eager path: the fused kernels with the ops' autograd, without the ops' dispatch
_RopeAttentionFunction = eager_function(
    "RopeAttentionFunction", rope_attention_fwd, _setup_context, _backward
)


# --------------------------------------------------------------------------- public API


def _as_rows(rows: torch.Tensor, batched_ndim: int = 2) -> torch.Tensor:
    """Positions ``[N]`` or ``[1 | B, N]`` as fp32 ``[1 | B, N]`` (``batched_ndim`` 2), angles
    ``[N, R/2]`` or ``[1 | B, N, R/2]`` as fp32 ``[1 | B, N, R/2]`` (3), contiguous: the kernels'
    formats."""
    rows = rows.float()
    return (rows[None] if rows.dim() < batched_ndim else rows).contiguous()


def _query_positions(positions, q_positions, nq: int, nk: int, device) -> torch.Tensor | None:
    """The queries' positions as ``rope_attention`` defines them: ``q_positions``, else the last
    NQ key positions (``NK-NQ..NK-1`` for the default ones); None for ``NQ == NK`` with the
    default positions (the RoPE kernel then forms the angles itself)."""
    if q_positions is not None:
        return q_positions
    if positions is not None:
        return positions[..., nk - nq :]
    return None if nq == nk else torch.arange(nk - nq, nk, device=device)


def _head_span(x: torch.Tensor) -> int:
    """``element_span`` of one (batch, head) of ``x [B, H, N, D]``: the fused kernels index
    within it in int32, so a head seen through a transpose of a long ``[B, N, H, D]`` buffer can
    be past ``INT32_INDEX_LIMIT``."""
    return element_span(x.shape[2:], x.stride()[2:])


def _fused_limit(q, k, v, rope_dim: int, **more) -> str | None:
    """Why the fused kernels cannot take ``q [B, HQ, NQ, D]``, ``k, v [B, HKV, NK, D]`` (and
    ``more`` tensors of q's shape: o and the cotangents), or None: a head dim past
    ``max_head_dim``, a (batch, head) past their int32 indexing, or more (batch, head) programs
    than a grid axis holds."""
    B, HQ, NQ, D = q.shape
    NK = k.shape[2]
    if D > max_head_dim(q.dtype):
        return (
            f"head dim must be at most {max_head_dim(q.dtype)} for {q.dtype} inputs in the "
            f"fused kernel, got {D}"
        )
    tensors = {"q": q, "k": k, "v": v, **more}
    spans = {name: _head_span(x) for name, x in tensors.items()}
    widest = "q"  # a loop, not max(key=): Dynamo traces neither max nor sorted by symbolic keys
    for name in tensors:
        if spans[name] > spans[widest]:
            widest = name
    x = tensors[widest]
    if spans[widest] >= INT32_INDEX_LIMIT:
        return (
            f"{widest} spans {spans[widest]} elements within one (batch, head) (shape "
            f"{tuple(x.shape)}, strides {tuple(x.stride())}), past the fused kernels' int32 "
            f"indexing ({INT32_INDEX_LIMIT}): make it contiguous if its strides leave gaps"
        )
    # The kernels also read rotated copies of q and k, and write o and the gradients, each
    # indexed per (batch, head) in int32: rows of rotated_width(D, R) >= D elements.
    rotated_span = max(NQ, NK) * rotated_width(D, rope_dim)
    if rotated_span >= INT32_INDEX_LIMIT:
        return (
            f"the fused kernels' rotated copies of q and k take {max(NQ, NK)} rows of "
            f"{rotated_width(D, rope_dim)} elements a (batch, head) (head dim {D}, rope_dim "
            f"{rope_dim}, padded for the rotation): {rotated_span}, past their int32 "
            f"indexing ({INT32_INDEX_LIMIT})"
        )
    if B * HQ > MAX_GRID_AXIS1:
        return (
            f"batch x query heads must be at most {MAX_GRID_AXIS1}, got {B} x {HQ}: split the batch"
        )
    return None


def _sdpa_has_lower_right_kernel(q, k, v) -> bool:
    """Whether PyTorch's SDPA runs bottom-right causal attention on these inputs with a kernel
    rather than a materialized mask, which the fused kernel avoids. False while
    ``torch.compile`` traces: dynamo cannot build the mask object in a graph."""
    if torch.compiler.is_compiling():
        return False
    return _lower_right_backend(q, k, v) != "math"


def _separate_blocker(return_lse: bool, causal: bool, nq: int, nk: int, window: int) -> str | None:
    """Why the separate path (RoPE, then PyTorch's SDPA) cannot take a call, or None: SDPA
    returns no lse, has no kernel that returns 0 for a causal query that sees no key (NQ > NK),
    and takes a bottom-right causal mask (NQ != NK) through a mask object that torch.compile
    cannot trace, unless a sliding window makes it a plain boolean mask
    (``window_hides_keys``)."""
    if return_lse:
        return "return_lse=True (SDPA returns no lse)"
    if causal and nq > nk:
        return f"causal NQ={nq} > NK={nk} (SDPA has no kernel for queries that see no key)"
    mask_object = not window_hides_keys(nq, nk, window)
    if causal and nq != nk and torch.compiler.is_compiling() and mask_object:
        return "causal NQ != NK under torch.compile (which cannot trace SDPA's bottom-right mask)"
    return None


# A prefill takes the fused kernel from this many queries on (below, SDPA's decoding kernels,
# which split the keys, win: 1.6-4.5x at NQ = 1, H100) ...
PREFILL_MIN_QUERIES = 16
# ... and when its query tiles (128 rows) times B * HQ give at least this many programs per SM:
# the fused kernel does not split a program's key sweep, so fewer programs leave SMs idle.
PREFILL_MIN_PROGRAMS_PER_SM = 0.5
# With the Gluon forward (Hopper), whose CTAs cost less, from any number of queries and this
# many programs per SM, each counted at D / 128 of one (a program's work grows with D): an
# H200, experiments/results/prefill_dispatch_h200.md (session 59)
GLUON_PREFILL_MIN_PROGRAMS_PER_SM = 0.45
# Square causal inference in the interleaved layout takes the Gluon forward from this many keys
# (_hopper_inference_wins: an H200, experiments/results/time_gluon_lengths_h200.md, session 60)
GLUON_INTERLEAVED_MIN_N = 8192


def fused_prefill_wins(B: int, HQ: int, NQ: int, sms: int, head_dim: int = 128,
                       gluon: bool = False) -> bool:  # fmt: skip
    """Whether a causal ``NQ < NK`` prefill (``B`` batches, ``HQ`` query heads of ``head_dim``
    channels) on a GPU of ``sms`` SMs has enough queries and query tiles for the fused kernel to
    beat SDPA's bottom-right kernel; ``gluon``: its forward is the Gluon one
    (``hopper_forward_takes``). Each rule fits every shape measured in its results file except
    the ties (within 7%; within 4% in fwd+bwd with Gluon): the Triton forward's
    ``experiments/results/prefill_dispatch_h100.md``, the Gluon forward's ``..._h200.md``."""
    programs = -(-NQ // 128) * B * HQ
    if gluon:
        return programs * head_dim >= GLUON_PREFILL_MIN_PROGRAMS_PER_SM * sms * 128
    return NQ >= PREFILL_MIN_QUERIES and programs >= PREFILL_MIN_PROGRAMS_PER_SM * sms


def _fused_prefill_fills_the_gpu(q, k, rope_dim, layout, softmax_scale) -> bool:
    """``fused_prefill_wins`` for ``q [B, HQ, NQ, D]``, ``k`` on their GPU (with the Gluon
    forward where it takes the call); False off CUDA."""
    if q.device.type != "cuda":
        return False
    B, HQ, NQ, D = q.shape
    gluon = _gluon_forward_takes(q, k, rope_dim, layout, softmax_scale)
    return fused_prefill_wins(B, HQ, NQ, num_sms(q.device), D, gluon)


def _gluon_forward_takes(q, k, rope_dim, layout, softmax_scale) -> bool:
    """``hopper_forward_takes`` for ``rope_attention``'s arguments (``softmax_scale`` None:
    the default)."""
    interleaved = layout == "interleaved"
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    return hopper_forward_takes(q, k, rope_dim, interleaved, scale)


def _sdpa_is_slowed_by_determinism(q: torch.Tensor) -> bool:
    """Whether ``torch.use_deterministic_algorithms(True)``, strict (``warn_only`` leaves SDPA
    as it is), keeps SDPA from cuDNN's attention, whose backward is not deterministic, on
    ``q``'s device: a Hopper GPU, where SDPA takes cuDNN first and where this was measured.
    SDPA then runs another backend, and the fused kernel (deterministic always: no atomic
    adds) is the faster path at every measured square causal shape
    (``experiments/deterministic_dispatch.py``, H200)."""
    return (
        q.device.type == "cuda"
        and torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
        and compute_capability(q.device)[0] == 9
    )


def _hopper_inference_wins(q, k, v, causal, rope_dim, layout, softmax_scale, rotation) -> bool:
    """Whether a call with nothing to differentiate runs faster through the fused path's Gluon
    forward on Hopper (``attention_forward_hopper.py``) than through RoPE then cuDNN: square
    causal attention from ``HOPPER_MIN_N`` (2K) keys on, default positions (an H200:
    0.88-0.99x the separate path's time at 4K, GQA-4K and 16K, sessions 55-56; 0.986x at 2K in
    fp16 and bf16 since session 58's cheaper tables, where it was 1.02-1.05x; ``README.md``),
    at D <= 128: at D = 256 its 64-key tiles take 1.17-1.19x the separate path's time (an
    H200, 4K and 16K, session 60), which prefills and windows still gain from. The interleaved
    layout from ``GLUON_INTERLEAVED_MIN_N`` keys on: its Q, read apart in the kernel, costs the
    Gluon forward 1.00-1.09x the separate path's time at 2K-4K, 0.96x at 8K and 0.90x at 16K
    (session 60; partial rotation 0.98-1.02x at 2K-4K and 0.90x at 16K, kept). With a
    gradient to take, the separate path stays: cuDNN's backward beats the fused one
    (1.35-1.48x forward+backward). So the path depends on grad mode: under a
    reentrant ``torch.utils.checkpoint`` the forward (no grad) takes this one and its
    recomputation the separate path, whose outputs differ by rounding."""
    return (
        not needs_autograd(q, k, v, *rotation.values())
        and causal
        and q.shape[2] == k.shape[2]  # a prefill (NQ < NK) follows the prefill rule
        and q.shape[3] <= 128
        and (layout != "interleaved" or k.shape[2] >= GLUON_INTERLEAVED_MIN_N)
        and all(
            rotation[name] is None for name in ("positions", "q_positions", "angles", "q_angles")
        )
        and _gluon_forward_takes(q, k, rope_dim, layout, softmax_scale)
    )


def _rope_then_sdpa(
    q, k, v, inv_freq, positions, q_positions, angles, q_angles, causal, scale, layout, rope_dim,
    factor, window,
):  # fmt: skip
    """The unfused path: this package's Triton RoPE over q and k, then PyTorch's best SDPA
    backend. Causal with ``NQ < NK`` (a prefill that continues a KV cache) uses SDPA's
    bottom-right mask (``causal_lower_right``), the fused kernel's alignment; a sliding window
    a boolean mask (``sdpa_attention``)."""
    from fused_rope.rope import apply_rope, apply_rope_qk  # task B's kernel module, on use

    NQ, NK = q.shape[2], k.shape[2]
    # Any strides; gradients for angles, positions and frequencies through the RoPE kernel's
    # autograd (and rope_angles'). Default positions: the RoPE kernel forms the angles itself,
    # where an angle table took three more small launches (arange, cast, product).
    rope = lambda pos: dict(inv_freq=inv_freq) if pos is None else dict(
        angles=rope_angles(pos, inv_freq)
    )  # fmt: skip
    if angles is not None:  # without q_angles, NQ <= NK (checked)
        k_rope = dict(angles=angles.float())  # the RoPE kernel takes fp32 angles
        q_rope = None if q_angles is None else dict(angles=q_angles.float())
    else:
        k_rope = rope(positions)
        q_rope = None
        if NQ > NK or q_positions is not None:
            q_rope = rope(_query_positions(positions, q_positions, NQ, NK, q.device))
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    common = dict(layout=layout, rope_dim=rope_dim, attention_factor=factor)
    if q_rope is None:
        # q's rows take k's last positions: one launch, sin/cos shared (a decoding step or a
        # prefill continuing a KV cache included).
        q_rot, k_rot = apply_rope_qk(q, k, **common, **k_rope)
    else:
        q_rot = apply_rope(q, **common, **q_rope)
        k_rot = apply_rope(k, **common, **k_rope)
    return sdpa_attention(q_rot, k_rot, v, causal=causal, scale=scale, window=window or None)


def _check_inputs(
    q,
    k,
    v,
    theta,
    inv_freq,
    positions,
    q_positions,
    angles,
    q_angles,
    causal,
    softmax_scale,
    attention_factor,
    layout,
    rope_dim,
    return_lse,
    impl,
    window,
):
    """Validates every argument; returns ``(rope_dim, impl, window)`` with "auto" resolved and
    the window as the kernels take it (0: none)."""
    device = check_qkv(q, k, v)
    B, HQ, NQ, D = q.shape
    NK = k.shape[2]
    if min(NQ, NK) == 0:
        raise ValueError(f"q and k need at least one position, got NQ={NQ}, NK={NK}")
    check_layout(layout)
    rope_dim = check_rope_dim(rope_dim, D)
    check_bool(causal, "causal")
    check_bool(return_lse, "return_lse")
    window = check_window(window, causal, keys=NK)
    check_softmax_scale(softmax_scale, D)
    check_attention_factor(attention_factor, FP16_MAX)  # the fused kernels' fp16 tables
    rotation = dict(
        inv_freq=inv_freq, positions=positions, q_positions=q_positions, angles=angles,
        q_angles=q_angles,
    )  # fmt: skip
    check_rotation_inputs(q, NK, rope_dim, **rotation)
    check_no_tangent(_REFERENCE, q=q, k=k, v=v, **rotation)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    blocker = _separate_blocker(return_lse, causal, NQ, NK, window)
    limit = _fused_limit(q, k, v, rope_dim)
    fused_fits = limit is None
    if impl == "auto":  # the faster path (README: measured on an H100 and an H200)
        # Causal NQ != NK (a prefill continuing a KV cache): the fused kernel where it has work
        # for every SM (0.65-0.81x the separate path's time forward there) or SDPA has no
        # bottom-right kernel; elsewhere RoPE then SDPA (cuDNN), 1.10-1.50x faster than the
        # fused kernel on square shapes, except under deterministic algorithms, where SDPA
        # leaves cuDNN and the fused kernel takes 0.50-0.87x its time forward+backward (H200).
        bottom_right = causal and NQ != NK
        # Not under torch.func, which the fused kernel's op refuses and the separate path takes.
        # (One expression: Dynamo 2.11 writes `True |= ...` for `|=` on a traced constant
        # when NQ is symbolic, a SyntaxError under torch.compile(dynamic=True).)
        # A sliding window: the fused kernel skips the key tiles outside it, where SDPA has no
        # window kernel and runs a boolean mask (over query chunks: max(window, 128) +
        # window - 1 pairs a query).
        fused_first = not under_functorch() and (
            (
                bottom_right
                and (
                    _fused_prefill_fills_the_gpu(q, k, rope_dim, layout, softmax_scale)
                    or not _sdpa_has_lower_right_kernel(q, k, v)
                )
            )
            or (causal and NQ == NK and _sdpa_is_slowed_by_determinism(q))
            or window > 0
            or _hopper_inference_wins(q, k, v, causal, rope_dim, layout, softmax_scale, rotation)
        )
        # Where the fused kernel cannot run, SDPA (for a prefill, with its bottom-right mask,
        # which may be a materialized one) beats an error; not under compile, which cannot
        # trace that mask (a blocker).
        impl = "separate" if blocker is None and (not fused_first or not fused_fits) else "fused"
    if impl == "separate" and blocker is not None:
        raise ValueError(
            f"impl='separate' runs RoPE then PyTorch's SDPA, which cannot take {blocker}: use "
            f"impl='auto' or 'fused'"
        )
    if impl == "fused" and not fused_fits:
        # The separate path is suggested only where it can take this call.
        instead = (
            "use impl='separate'" if blocker is None else f"impl='separate' cannot take {blocker}"
        )
        if D > max_head_dim(q.dtype):
            cast = "fp16 or bf16 inputs, or " if D <= MAX_HEAD_DIM else ""
            if blocker is None:
                remedy = f"use {cast}impl='separate'"
            else:
                remedy = f"{instead}: use {cast}fused_rope.naive.rope_attention_ref at small sizes"
            raise ValueError(f"{limit}; {remedy}")
        raise ValueError(f"{limit}; {instead}")
    check_kernel_device(device, "q", dot_dtype=q.dtype if impl == "fused" else None)
    if impl == "fused":  # the separate path's RoPE Function and SDPA support torch.func
        check_no_functorch("impl='separate' or fused_rope.naive.rope_attention_ref")
    return rope_dim, impl, window


@on_input_device
def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    theta: float = 10000.0,
    inv_freq: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    angles: torch.Tensor | None = None,
    q_angles: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    attention_factor: float = 1.0,
    layout: str = "half",
    rope_dim: int | None = None,
    return_lse: bool = False,
    impl: str = "auto",
    window: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention with RoPE on q and k: this package's Triton RoPE kernel then PyTorch's SDPA,
    or RoPE applied inside a FlashAttention-2 Triton kernel (``impl``).

    ``softmax(scale * R(q) R(k)^T + mask) v`` where ``R`` rotates the first ``rope_dim``
    channels by ``position * inv_freq`` and scales them by ``attention_factor`` (as
    ``fused_rope.naive.apply_rope_ref``).

    Args:
        q: ``[B, HQ, NQ, D]`` fp16, bf16 or fp32 (the fused kernel: ``D <= 256``, fp32
            ``D <= 128``, ``B * HQ <= 65535``; on the CPU, in the interpreter, fp16 or fp32).
        k, v: ``[B, HKV, NK, D]``, same dtype; ``HQ`` a multiple of ``HKV`` (GQA, MQA).
        theta: RoPE base, used when ``inv_freq`` is None.
        inv_freq: ``[rope_dim // 2]`` fp32/fp64 inverse frequencies (scaled schedules);
            overrides theta. Differentiable (learned frequencies), as are floating-point
            positions, ``angles`` and ``q_angles``: from q's and k's gradients, with no extra
            kernel (``fused_rope._angle_grads``).
        positions: the keys' positions, ``[NK]`` or ``[1 | B, NK]``, integer, fp32 or fp64
            (default ``0..NK-1``); the kernels take them in fp32, exact for integers below
            2**24 (larger ones round, as in ``rope_angles``).
        q_positions: ``[NQ]`` or ``[1 | B, NQ]``; default: the last NQ entries of ``positions``
            (for the default positions and ``NQ > NK``: ``NK-NQ..NK-1``).
        angles: the keys' rotation angles ``[NK, R/2]`` or ``[1 | B, NK, R/2]``, fp32 or fp64
            (taken in fp32), for the schedules that are not one position times ``inv_freq``:
            M-RoPE (``frequencies.mrope_angles``, Qwen2-VL, Qwen3-VL), N-D RoPE
            (``nd_rope_angles``). Replaces ``positions * inv_freq``: not with ``inv_freq``,
            ``positions`` or ``q_positions`` (theta is then unused).
        q_angles: the queries' ``[NQ, R/2]`` or ``[1 | B, NQ, R/2]``, with ``angles`` only;
            default: the last NQ rows of ``angles`` (``NQ > NK`` needs them).
        causal: query ``i`` sees key ``j`` iff ``j <= i + NK - NQ`` (bottom-right aligned,
            by index, as FlashAttention-2). A query that sees no key returns 0.
        window: a causal sliding window (Mistral, Gemma 2/3, GPT-OSS): query ``i`` sees only
            its last ``window`` keys, ``i + NK - NQ - window < j``, its own included
            (transformers' ``sliding_window``; FlashAttention's ``window_size=(window - 1,
            0)``); None (default) for none. The fused kernel skips the key tiles outside the
            window, so its cost grows with ``NQ * window``, not ``NQ * NK``; "auto" takes it
            where it can run (the separate path gives SDPA a boolean mask, over chunks of queries).
        softmax_scale: default ``1/sqrt(D)``.
        attention_factor: the factor ``rope_frequencies`` returns with YaRN's and LongRoPE's
            frequencies (Hugging Face multiplies it into cos and sin): it scales q's and k's
            rotated channels, so the rotated part of the scores by its square. Free: the RoPE
            kernel's cos and sin and the fused kernels' cos/sin tables carry it.
        layout: ``"half"`` (GPT-NeoX, Llama) or ``"interleaved"`` (GPT-J).
        rope_dim: rotated channels (even, default D); the rest pass through.
        return_lse: also return the natural-log log-sum-exp ``[B, HQ, NQ]`` fp32
            (``-inf`` for a query that sees no key); it is differentiable.
        impl: ``"fused"``: the fused kernel (on Hopper with Triton 3.6, its forward in Gluon
            where ``attention_forward.hopper_forward_takes``: 0.79-0.85x the Triton forward's
            time from 2K tokens on, H200). ``"separate"``: the Triton RoPE kernel over q and k
            (``fused_rope.rope``) then PyTorch's SDPA, with a bottom-right causal mask
            (``causal_lower_right``) when ``NQ < NK``; needs ``return_lse=False`` and, when
            causal, ``NQ <= NK``; under ``torch.compile``, which cannot trace SDPA's bottom-right
            mask, it raises for causal ``NQ != NK``. ``"auto"``: for a causal ``NQ < NK``
            prefill, the fused kernel where ``fused_prefill_wins`` (at least 16 queries and half
            a program per SM: 0.65-0.81x the separate path's forward time on an H100) or where
            SDPA has no bottom-right kernel (and always under ``torch.compile``), else
            "separate" (SDPA's decoding kernels win at a few queries); the fused kernel for
            ``return_lse=True``, causal ``NQ > NK``, and square causal attention on a Hopper
            GPU under strict ``torch.use_deterministic_algorithms(True)``, outside
            ``torch.func`` (the switch keeps SDPA from cuDNN:
            there the fused kernel took 0.50-0.87x the separate path's forward+backward time
            on an H200), and square causal attention from 2K tokens with default positions on
            a Hopper GPU when nothing is differentiated (no grad mode, or no input requiring
            grad) and the Gluon forward takes it (0.88-0.99x the separate path's time, H200);
            "separate" elsewhere (square causal attention: 1.10-1.50x faster
            than the fused kernel on an H100 and an H200), and where the fused kernel
            cannot run (``D > 256``, fp32 ``D > 128``, ``B * HQ > 65535``, a head of q, k or v
            spanning ``2**31`` elements or more), except for a prefill under compile. Where
            neither path can run (beyond the fused kernel with ``return_lse=True``, causal
            ``NQ > NK``, or a prefill under compile) it raises ``ValueError`` saying why
            neither can. See the README's benchmark.

    Returns:
        ``o [B, HQ, NQ, D]`` in q's dtype, or ``(o, lse)``. Under autocast q, k and v are
        first cast as SDPA casts them (fp32 and fp16/bf16 to autocast's dtype), so ``o`` is
        in autocast's dtype whichever path runs.
    """
    q, k, v = autocast_inputs(q, k, v)
    rope_dim, impl, window = _check_inputs(
        q,
        k,
        v,
        theta,
        inv_freq,
        positions,
        q_positions,
        angles,
        q_angles,
        causal,
        softmax_scale,
        attention_factor,
        layout,
        rope_dim,
        return_lse,
        impl,
        window,
    )
    B, HQ, NQ, D = q.shape
    NK = k.shape[2]
    if inv_freq is None:
        # Given angles, the kernels' tables load them and theta is unused, so not checked (as
        # in the reference): the default base's frequencies fill the unread argument
        base = theta if angles is None else 10000.0
        inv_freq = default_inv_freq(rope_dim, base, q.device)
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    scale = check_softmax_scale(softmax_scale, D)
    factor = float(attention_factor)
    if impl == "separate":
        return _rope_then_sdpa(
            q, k, v, inv_freq, positions, q_positions, angles, q_angles, causal, scale, layout,
            rope_dim, factor, window,
        )  # fmt: skip
    if angles is not None:  # the kernels' tables take angle rows as they take position rows
        q_pos = _as_rows(angles[..., NK - NQ :, :] if q_angles is None else q_angles, 3)
        k_pos = _as_rows(angles, 3)
    elif positions is None and q_positions is None:
        q_pos = k_pos = None  # one cos/sin table of positions min(0, NK-NQ)..NK-1 serves both
    else:
        q_pos = _as_rows(_query_positions(positions, q_positions, NQ, NK, q.device))
        k_pos = _as_rows(torch.arange(NK, device=q.device) if positions is None else positions)
    inputs = (
        q, k, v, inv_freq, q_pos, k_pos, causal, scale, layout == "interleaved", rope_dim, factor,
        window,
    )  # fmt: skip
    fwd = _RopeAttentionFunction.apply if runs_eagerly(*inputs[:6]) else _fwd_op
    o, lse = fwd(*inputs)
    return (o, lse) if return_lse else o
