"""Shared test helpers: the device the suite runs on, and the one tolerance helper.

Two measures for every comparison: the max-abs error and the relative RMSE
(``||out - ref|| / ||ref||``), after flash-linear-attention's ``assert_close``.
For attention outputs and gradients, flash-attention's rule: the kernel's error
against a float64 reference is at most ``factor`` (2) times the error that plain
PyTorch, run in the kernel's dtype, makes against the same reference, plus (on the
max-abs error) flash-attention's margin of twice the dtype's rounding noise.
"""

from __future__ import annotations

import contextlib

import torch

# Without CUDA, kernels run in the Triton interpreter on CPU tensors (tests/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


@contextlib.contextmanager
def deterministic_algorithms(on: bool = True, warn_only: bool = False):
    """``torch.use_deterministic_algorithms(on, warn_only=warn_only)`` inside the block, the
    previous setting restored after (a failing test must not leave the switch on)."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max-abs error, relative RMSE) of ``out`` against ``ref``, computed in float64."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}")
    diff = out64 - ref64
    if not torch.isfinite(out64).all():
        return float("inf"), float("inf")
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    rel_rmse = (diff.norm() / ref64.norm().clamp_min(1e-30)).item() if diff.numel() else 0.0
    return max_abs, rel_rmse


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
    """Fails unless max-abs error <= atol and relative RMSE <= rtol (NaN and inf fail)."""
    max_abs, rel_rmse = errors(out, ref)
    msg = f"{name}: max-abs {max_abs:.3e} (atol {atol:.1e}), rel-RMSE {rel_rmse:.3e} (rtol {rtol:.1e})"
    assert max_abs <= atol and rel_rmse <= rtol, msg


def rounding_noise(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest error of one rounding to ``dtype`` at ``ref``'s magnitudes: flash-attention's
    ``(ref + 0.3 - 0.3 - ref).abs().max()`` in ``dtype``, or half a unit in the last place at
    ``ref``'s largest magnitude where that is more. (Flash-attention's measure is made for
    values near 1: at large magnitudes it can round back exactly, as it did, under 5e-6, for
    fp32 frequency gradients up to 852, whose unit in the last place is 6.1e-5.)"""
    r = ref.detach().to(dtype)
    if not r.numel():
        return 0.0
    flash = (r + 0.3 - 0.3 - r).abs().max().item()
    return max(flash, torch.finfo(dtype).eps / 2 * r.abs().max().item())


# How far (relative RMSE) a baseline in each dtype may sit from the float64 reference before
# the two are taken to compute different things: rounding alone stays below. fp32 attention
# baselines sit near 1e-7, but Co-RoPE's long sums do not: its frequencies' gradient (N^2
# terms a frequency) 1.3-1.9e-3 at N = 304-4096, the N = 64K phases 2.1e-3 (H200, session 43).
# fp16/bf16 baselines compute in fp32 and round once (2e-4 / 2e-3).
BASELINE_RMSE_LIMIT = {
    torch.float64: 1e-6,
    torch.float32: 5e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}


def check_against_baseline(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor,
    factor: float = 2.0,
    atol_floor: float = 1e-5,
    compute_dtype: torch.dtype | None = None,
) -> tuple[bool, str]:
    """Flash-attention's rule, as (passed, message); ``assert_close_to_baseline`` asserts it.

    ``ref`` is the float64 reference; ``baseline`` is the same math run in PyTorch in
    the kernel's dtype. Both error measures of ``out`` must stay within ``factor``
    times those of ``baseline``, plus, for the max-abs error, flash-attention's margin of
    twice the rounding noise of ``out``'s dtype at ``ref``'s magnitudes (at least
    ``atol_floor``, for results that are exact), and for the relative RMSE ``atol_floor`` or
    8 roundings of ``out``'s dtype, whichever is smaller (fp32: 9.5e-7).
    The baseline itself must sit within ``BASELINE_RMSE_LIMIT`` of the reference, the limit of
    ``compute_dtype`` (default the baseline's dtype): a gradient of fp32 inputs (RoPE's angles)
    of attention computed in bf16 is as far from the reference as bf16 makes it.

    The margin matters in half precision, where this project's baselines compute in fp32
    and round once (their error is that rounding), while a kernel also rounds its
    tensor-core operands: on a row with few keys one element can then reach 2.4 times the
    baseline's max-abs error (Co-RoPE backward, fp16, a row of 2 keys) with the RMSE at
    1.1 times.
    """
    k_abs, k_rmse = errors(out, ref)
    b_abs, b_rmse = errors(baseline, ref)
    compute_dtype = compute_dtype or baseline.dtype
    limit = BASELINE_RMSE_LIMIT.get(compute_dtype, BASELINE_RMSE_LIMIT[torch.bfloat16])
    if not b_rmse <= limit:
        # a reference that computes something else (a wrong default, head mapping, mask)
        # is as far from the kernel as from the baseline, and the ratio alone would pass
        return False, (
            f"the {compute_dtype} baseline is {b_rmse:.1e} (rel-RMSE) from the reference, "
            f"over {limit:.0e}: the reference and the baseline compute different things"
        )
    margin = max(atol_floor, 2 * rounding_noise(ref, out.dtype))
    # The rel-RMSE bound's floor (for exact baselines) at most 8 roundings of out's dtype: at
    # 1e-5, fp32 would let a systematic error 100 roundings large pass.
    rmse_floor = min(atol_floor, 8 * torch.finfo(out.dtype).eps)
    msg = (
        f"kernel max-abs {k_abs:.3e} rel-RMSE {k_rmse:.3e}; "
        f"PyTorch same dtype max-abs {b_abs:.3e} rel-RMSE {b_rmse:.3e} "
        f"(factor {factor}, max-abs margin {margin:.1e})"
    )
    if not k_abs <= factor * b_abs + margin:
        return False, f"max-abs over the bound; {msg}"
    if not k_rmse <= factor * b_rmse + rmse_floor:
        return False, f"rel-RMSE over the bound; {msg}"
    return True, msg


def assert_close_to_baseline(
    name: str,
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor,
    factor: float = 2.0,
    atol_floor: float = 1e-5,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Fails unless ``out`` passes flash-attention's rule (``check_against_baseline``)."""
    passed, msg = check_against_baseline(out, ref, baseline, factor, atol_floor, compute_dtype)
    assert passed, f"{name}: {msg}"


def rope_attention_in_dtype(
    q, k, v, *, q_angles, k_angles, causal, scale, layout, rope_dim, factor=1.0, window=None
):
    """The flash-attention rule's baseline for RoPE attention: RoPE computed in fp32 and cast to
    q's dtype (``apply_rope_ref``), then an explicit ``softmax(scale * q k^T) v`` whose matmuls,
    softmax and logsumexp run in that dtype, as a kernel's tensor-core operands do.

    q: ``[B, HQ, NQ, D]``; k, v: ``[B, HKV, NK, D]``; q_angles ``[NQ, R/2]``, k_angles
    ``[NK, R/2]`` (or with a batch dimension); ``factor``: the attention factor; ``window``: a
    causal sliding window. Returns ``o [B, HQ, NQ, D]``, the dtype's ``lse [B, HQ, NQ]`` and
    that lse taken in fp32 of the dtype's scores (the kernels return lse in fp32).
    """
    from fused_rope.naive import apply_rope_ref

    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    q_rot = apply_rope_ref(q, q_angles, layout, rope_dim, attention_factor=factor)
    k_rot = apply_rope_ref(k, k_angles, layout, rope_dim, attention_factor=factor)
    k_rot = k_rot.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    s = (q_rot * scale) @ k_rot.transpose(-1, -2)
    if causal:
        i = torch.arange(NQ, device=q.device)[:, None]
        j = torch.arange(NK, device=q.device)[None, :]
        hidden = j > i + NK - NQ
        if window is not None:
            hidden |= j <= i + NK - NQ - window
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key output 0
    # The kernels return lse in fp32: its value is held to the dtype's scores' logsumexp taken
    # in fp32 (rounding it to the dtype would allow twice that rounding); the gradients keep
    # the dtype's logsumexp.
    return p @ v, lse, torch.logsumexp(s.detach().float(), dim=-1)
