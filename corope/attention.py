"""The public Co-RoPE-GQA attention: input checks, torch custom ops, autograd.

``corope::attention`` (forward: ``o, lse``) and ``corope::attention_backward`` (``dq, dk, dv``
and, for learned frequencies, ``dinv_freq``)
are ``torch.library`` custom ops with fake (meta) implementations, so
``torch.compile(fullgraph=True)`` traces through them; ``register_autograd`` ties the
backward op to the forward. Eager calls run the same autograd formula through an
autograd.Function instead (``fused_rope._validation.eager_function``), without the ops'
dispatch. The kernels run in the Triton interpreter on the CPU when ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from corope.backward import corope_bwd
from corope.decode import corope_decode
from corope.forward import SUPPORTED_HEAD_DIMS, corope_fwd
from corope.naive import check_corope_inputs, corope_inv_freq
from fused_rope._validation import (
    KERNEL_DTYPES,
    MAX_GRID_AXIS1,
    autocast_inputs,
    backward_launches_directly,
    check_bool,
    check_kernel_device,
    check_no_functorch,
    check_no_tangent,
    check_op_tensors,
    check_window,
    checked,
    eager_function,
    on_input_device,
    refuse_double_backward,
    runs_eagerly,
)

# What the refusals name: the PyTorch reference, which differentiates in every mode
_REFERENCE = "corope.corope_attention_ref"


def _check_head_dim(D: int) -> None:
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {SUPPORTED_HEAD_DIMS}, got {D}")


def _check_op_inputs(q, k, v, inv_freq, softmax_scale, rope_dim, leader, window=0,
                     queries_last=True, like_q=(), rows=()):  # fmt: skip
    """The kernels' contract for the tensors the custom ops pass them, as
    ``fused_rope._validation.check_op_tensors`` says why: the public function's shape rules
    (``check_corope_inputs``; ``queries_last``: NQ <= NK, the forward's), a head dim the
    kernels take, and a causal window of ``window`` keys (0: none)."""
    check_corope_inputs(q, k, v, rope_dim, leader, softmax_scale, queries_last=queries_last)
    _check_head_dim(q.shape[-1])
    check_op_tensors(q, inv_freq, rope_dim, like_q=like_q, rows=rows, k=k, v=v)
    check_window(window or None, causal=True)


def _check_attention_op(q, k, v, inv_freq, softmax_scale, rope_dim, leader, detach_mileage,
                        deterministic, window):  # fmt: skip
    _check_op_inputs(q, k, v, inv_freq, softmax_scale, rope_dim, leader, window)


def _check_decode_op(q, k, v, inv_freq, softmax_scale, rope_dim, leader):
    _check_op_inputs(q, k, v, inv_freq, softmax_scale, rope_dim, leader)


def _check_attention_backward_op(do, q, k, v, o, lse, inv_freq, softmax_scale, rope_dim, leader,
                                 detach_mileage, deterministic, freq_grad, window):  # fmt: skip
    _check_op_inputs(q, k, v, inv_freq, softmax_scale, rope_dim, leader, window,
                     queries_last=False, like_q=(("do", do), ("o", o)), rows=(("lse", lse),))  # fmt: skip


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    softmax_scale: float,
    rope_dim: int,
    leader: str,
    detach_mileage: bool,
    deterministic: bool,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of ``corope::attention`` and of the eager path (``_CoropeAttentionFunction``)."""
    # detach_mileage and deterministic only matter to the backward; they are arguments here
    # so that the autograd context receives them.
    return corope_fwd(q, k, v, inv_freq, softmax_scale, rope_dim, leader, window)


_attention_op = torch.library.custom_op("corope::attention", mutates_args=())(
    on_input_device(checked(_check_attention_op)(_attention))
)


@_attention_op.register_fake
def _(q, k, v, inv_freq, softmax_scale, rope_dim, leader, detach_mileage, deterministic, window):
    B, HQ, N, _ = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    return o, q.new_empty((B, HQ, N), dtype=torch.float32)


@torch.library.custom_op("corope::decode", mutates_args=())
@on_input_device
@checked(_check_decode_op)
def _decode_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    softmax_scale: float,
    rope_dim: int,
    leader: str,
) -> torch.Tensor:
    return corope_decode(q, k, v, inv_freq, softmax_scale, rope_dim, leader)


@_decode_op.register_fake
def _(q, k, v, inv_freq, softmax_scale, rope_dim, leader):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("corope::attention_backward", mutates_args=())
@on_input_device
@checked(_check_attention_backward_op)
def _attention_backward_op(
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
    deterministic: bool,
    freq_grad: bool,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dw = corope_bwd(
        do, q, k, v, o, lse, inv_freq, softmax_scale, rope_dim, leader, detach_mileage,
        deterministic, freq_grad=freq_grad, window=window,
    )  # fmt: skip
    # an op returns tensors: an empty one where the frequencies need no gradient
    return dq, dk, dv, inv_freq.new_empty(0) if dw is None else dw


@_attention_backward_op.register_fake
def _(
    do, q, k, v, o, lse, inv_freq, softmax_scale, rope_dim, leader, detach_mileage,
    deterministic, freq_grad, window,
):  # fmt: skip
    # corope_bwd returns contiguous gradients, whatever the inputs' strides.
    grads = tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    return *grads, inv_freq.new_empty(rope_dim // 2 if freq_grad else 0)


def _setup_context(ctx, inputs, output):
    q, k, v, inv_freq, softmax_scale, rope_dim, leader, detach_mileage, deterministic, window = (
        inputs
    )
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, inv_freq)
    ctx.args = (softmax_scale, rope_dim, leader, detach_mileage, deterministic)
    ctx.window = window


def _backward(ctx, do, dlse):
    # lse is an auxiliary output for the backward; gradients through it are not supported.
    if do is None:  # o's gradient is undefined (zero): so are all of these
        return (None,) * 10
    # forward-over-reverse: the kernels would drop the tangent (a silent zero)
    check_no_tangent(_REFERENCE, **{"o's cotangent": do})
    # unpacked once: non-reentrant activation checkpointing refuses a second unpack
    saved = ctx.saved_tensors
    q, k, v, o, lse, inv_freq = saved
    freq_grad = ctx.needs_input_grad[3]
    if backward_launches_directly(do, *saved):
        # the launcher without the op's dispatch (_CoropeAttentionFunction); a backward that is
        # recorded (create_graph=True) takes the op, whose autograd refuses a second derivative
        dq, dk, dv, dw = corope_bwd(
            do, q, k, v, o, lse, inv_freq, *ctx.args, freq_grad=freq_grad, window=ctx.window
        )
    else:
        dq, dk, dv, dw = _attention_backward_op(
            do, q, k, v, o, lse, inv_freq, *ctx.args, freq_grad, ctx.window
        )
    return dq, dk, dv, dw if freq_grad else None, None, None, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)
refuse_double_backward(_attention_backward_op, _REFERENCE)


# The eager path: the kernels with the ops' autograd, without the ops' dispatch
_CoropeAttentionFunction = eager_function(
    "CoropeAttentionFunction", _attention, _setup_context, _backward
)


@on_input_device
def corope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    theta: float = 10000.0,
    inv_freq: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    rope_dim: int | None = None,
    leader: str = "first",
    detach_mileage: bool = False,
    deterministic: bool | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal Co-RoPE-GQA attention with fused Triton kernels, differentiable in q, k, v and
    ``inv_freq``.

    Same function as ``corope.corope_attention_ref`` (the math is in ``corope/README.md``).

    Args:
        q: ``[B, HQ, NQ, D]``, k's last ``NQ`` positions; head ``h`` belongs to KV group
            ``h // (HQ // HKV)``. ``NQ = NK`` in training; ``NQ < NK`` continues a KV cache
            (a chunk of a prefill, or a decoding step at ``NQ = 1``, which takes the
            decoding kernels of ``corope.decode``, split over the cache's keys) and has no
            gradient: grad mode must be off or q, k, v and ``inv_freq`` must not require
            grad.
        k, v: ``[B, HKV, NK, D]`` with ``HQ % HKV == 0``. fp16, bf16 or fp32, one dtype and one
            CUDA device for all three (the CPU only under ``TRITON_INTERPRET=1``, fp16/fp32);
            ``D`` in ``SUPPORTED_HEAD_DIMS`` (32, 64, 128, 256). Any strides.
        theta: RoPE base; ``w[d] = theta ** (-2d / R)``.
        inv_freq: ``[R/2]`` fp32/fp64 frequencies overriding ``theta``
            (``fused_rope.rope_frequencies``); learned where it requires grad (the backward
            kernel then forms its gradient, in fp32).
        softmax_scale: ``s`` (default ``1 / sqrt(D)``), scaling both gates and scores.
        rope_dim: ``R``, even, at most ``D`` (default ``D``); channels ``R:`` are a plain dot.
        leader: ``"first"`` or ``"mean"``: which query computes the group's gates.
        detach_mileage: hold the mileage constant in the backward (an ablation).
        deterministic: ask the backward kernel for its deterministic mode (its atomic adds
            in one fixed order, kept by copies and per-key-tile counters: bitwise-repeatable
            gradients; ``corope/README.md``, "Deterministic mode").
            ``None`` (the default) follows ``torch.are_deterministic_algorithms_enabled()``,
            as PyTorch's own operators do under ``torch.use_deterministic_algorithms(True)``.
        window: a causal sliding window (as ``fused_rope.rope_attention``'s): query ``i`` sees
            only its last ``window`` keys, ``i + NK - NQ - window < j``, its own included.
            The mileage of a key it sees sums the gates of the keys between them, all inside
            the window. The kernels skip the key tiles before it, so a forward and backward
            cost ``O(N * window)``, not ``O(N^2)``. ``None``: every earlier key.

    Returns:
        ``o`` ``[B, HQ, NQ, D]`` in q's dtype (contiguous). Under autocast q, k and v are
        first cast as SDPA casts them (fp32 and fp16/bf16 to autocast's dtype), so ``o`` is
        in autocast's dtype, as attention through SDPA would be.

    Raises:
        ValueError: with autograd, ``B * HKV > 65535`` (the backward's grid), or ``NQ < NK``.
    """
    q, k, v = autocast_inputs(q, k, v)
    R, s = check_corope_inputs(q, k, v, rope_dim, leader, softmax_scale, queries_last=True)
    NQ, NK = q.shape[2], k.shape[2]
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"q, k, v must be one of {[str(d) for d in KERNEL_DTYPES]} for the kernels, got "
            f"{q.dtype} (corope_attention_ref runs float64)"
        )
    check_bool(detach_mileage, "detach_mileage")
    window = check_window(window, causal=True, keys=NK)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    check_bool(deterministic, "deterministic")
    w = corope_inv_freq(R, theta, inv_freq, q.device)  # checks inv_freq first
    check_no_tangent(_REFERENCE, q=q, k=k, v=v, inv_freq=inv_freq)
    check_no_functorch(_REFERENCE)
    check_kernel_device(q.device, "q", dot_dtype=q.dtype)
    _check_head_dim(q.shape[-1])
    differentiable = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, w))
    if differentiable and q.shape[0] * k.shape[1] > MAX_GRID_AXIS1:  # the backward's B x HKV
        raise ValueError(
            f"the backward kernels take at most {MAX_GRID_AXIS1} (batch, KV head) groups, got "
            f"B x HKV = {q.shape[0]} x {k.shape[1]}: split the batch, or differentiate "
            "corope_attention_ref"
        )
    if NQ < NK and differentiable:
        raise ValueError(
            f"queries that continue a KV cache (NQ={NQ} < NK={NK}) have no backward kernel: "
            "run them under torch.no_grad() / torch.inference_mode(), or differentiate "
            "corope_attention_ref"
        )
    if NQ == 1 < NK:
        if window:
            # The step's mileages sum gates of the keys between, all in the window: the
            # window's keys alone give the same output.
            k, v = k[:, :, NK - window :], v[:, :, NK - window :]
        if runs_eagerly(q, k, v, w):
            # The kernels without the op's dispatch: a decoding step is bound by the host
            # (H100: 208 against 175 us a synchronized call, time_corope_decode.py).
            return corope_decode(q, k, v, w, s, R, leader)
        return _decode_op(q, k, v, w, s, R, leader)
    forward = _CoropeAttentionFunction.apply if runs_eagerly(q, k, v, w) else _attention_op
    o, _ = forward(q, k, v, w, s, R, leader, detach_mileage, deterministic, window)
    return o
