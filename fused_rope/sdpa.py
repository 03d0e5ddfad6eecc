"""PyTorch's ``scaled_dot_product_attention`` with this package's conventions, no Triton:
GQA, and causal attention of ``NQ < NK`` queries aligned bottom-right (q's rows are the last
``NQ`` of k's positions). ``rope_attention``'s separate path runs it after the Triton RoPE,
and the harness (``lm.attention``) for NoPE, the input encodings and its PyTorch RoPE path,
in training and in cached decoding steps alike.
"""

from __future__ import annotations

import torch
from torch.nn.attention.bias import causal_lower_right

from fused_rope._validation import check_window


def _lower_right_backend(q, k, v) -> str:
    """The SDPA kernel that ``torch.nn.attention.bias.causal_lower_right`` dispatches these
    inputs to: ``"flash"`` (FlashAttention-2, whose causal mask is bottom-right),
    ``"efficient"`` (the memory-efficient kernel) or ``"math"`` (a materialized ``NQ x NK``
    mask, O(NQ NK) memory)."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    params = SDPAParams(q, k, v, None, 0.0, False, q.shape[1] != k.shape[1])
    if can_use_flash_attention(params):
        return "flash"
    return "efficient" if can_use_efficient_attention(params) else "math"


# The query rows of a chunk of a window's mask, at least: a chunk's mask spans its rows and
# the window before them, so a row computes C + window - 1 pairs for the window's: twice them
# for windows from this size on; smaller chunks would waste fewer but give SDPA tiny problems
WINDOW_CHUNK = 128


def window_hides_keys(nq: int, nk: int, window: int | None) -> bool:
    """Whether ``sdpa_attention`` takes a causal sliding window of ``window`` keys (None or 0:
    none) as a boolean mask: where, among the keys it keeps (the last ``window + NQ - 1``),
    some query's window hides some. A single query (a decoding step) sees every key kept."""
    return bool(window) and window < min(nk, window + nq - 1)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """PyTorch's ``scaled_dot_product_attention`` with ``rope_attention``'s conventions and
    no position encoding: GQA, and causal with ``NQ < NK`` aligned bottom-right (q's rows are
    the last ``NQ`` of k's positions: a prefill or a decoding step that continues a KV cache).
    q ``[B, HQ, NQ, D]``, k and v ``[B, HKV, NK, D]`` -> ``[B, HQ, NQ, D]``; ``scale``
    defaults to ``1/sqrt(D)``; ``window`` (causal only): query ``i`` sees only its last
    ``window`` keys, ``j > i + NK - NQ - window`` (SDPA has no sliding-window kernel: a
    boolean mask, over the queries in chunks of ``max(window, WINDOW_CHUNK)`` rows, each with
    the keys its windows reach, so that the pairs computed grow with ``NQ * window`` (twice
    it from windows of ``WINDOW_CHUNK`` on), not ``NQ * NK``; ``rope_attention``'s fused
    kernel skips the hidden key tiles).

    ``NQ != NK`` goes through ``causal_lower_right``, which dispatches to the flash,
    memory-efficient or math kernel, never to cuDNN's: a plain mask (or none, at ``NQ =
    1``) takes cuDNN on an H100 (torch 2.11), which builds a plan for every new shape, 42 ms
    a call where flash takes 0.08 ms, so a cache growing by a token per step replanned at
    every step (``experiments/bench_decode.py``)."""
    # [::3]: B and D, which SDPA would broadcast (B = 1) or fail on in its own words
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or k.shape[::3] != q.shape[::3]:
        raise ValueError(
            f"q must be [B, HQ, NQ, D] and k, v [B, HKV, NK, D] of one shape, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    HQ, HKV, NQ, NK = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if HKV == 0 or HQ % HKV or (causal and NQ > NK):
        raise ValueError(
            f"q's heads must be a multiple of k's and, causal, q's rows at most k's: got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}"
        )
    window = check_window(window, causal)
    if window and window + NQ - 1 < NK:
        # No query sees the keys before the last window + NQ - 1. A cached decoding step (NQ =
        # 1) then sees every key left, so it takes the bottom-right causal path below, not a
        # boolean mask, with which SDPA would take cuDNN's kernel and plan every new cache
        # length anew (above)
        k, v = (x[:, :, NK - (window + NQ - 1) :] for x in (k, v))
        NK = k.shape[2]
    if window_hides_keys(NQ, NK, window):
        if NQ <= max(window, WINDOW_CHUNK):
            return _window_masked(q, k, v, window, scale)
        return _window_chunked(q, k, v, window, scale)
    mask = causal_lower_right(NQ, NK) if causal and NQ != NK else None
    # causal_lower_right hands the memory-efficient kernel k and v as they are, without the
    # GQA head expansion of its other branches (torch 2.5-2.13): give it every head.
    if mask is not None and HQ != HKV and _lower_right_backend(q, k, v) == "efficient":
        k, v = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    return _sdpa(q, k, v, mask, causal and mask is None, scale)


def _window_chunked(q, k, v, window: int, scale: float | None) -> torch.Tensor:
    """``sdpa_attention``'s window over the queries in chunks of ``C = max(window,
    WINDOW_CHUNK)`` rows, each with the ``C + window - 1`` keys its windows reach: one SDPA
    call with the chunks in the batch, so the work grows with ``NQ * (C + window)`` and the
    chunk count stays symbolic under torch.compile (a Python loop over chunks specialized the
    graph to each length, and its slices' backward zero-filled whole gradients per chunk).
    Needs ``NQ + window - 1 >= NK`` (``sdpa_attention`` slices the keys no query sees)."""
    B, HQ, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    C = max(window, WINDOW_CHUNK)
    K = C + window - 1  # the keys of a chunk
    n = (NQ + C - 1) // C
    # Padded, query row i of chunk c (q's row c * C + i) sits at key row c * C + i + window - 1
    # (left: the keys its window would reach before the first); rows and keys past the end
    # are zeros, which only the padded rows see
    left, pad = window - 1 - (NK - NQ), n * C - NQ
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    q = q.view(B, HQ, n, C, D).transpose(1, 2).reshape(B * n, HQ, C, D)
    k, v = (
        torch.nn.functional.pad(x, (0, 0, left, pad))
        .unfold(2, K, C)  # [B, HKV, n, D, K]
        .permute(0, 2, 1, 4, 3)
        .reshape(B * n, HKV, K, D)
        for x in (k, v)
    )
    i = torch.arange(C, device=q.device)[:, None]
    r = torch.arange(K, device=q.device)[None, :]
    first = torch.arange(n, device=q.device)[:, None, None] * C  # each chunk's first key row
    # query i of a chunk sees key rows i .. i + window - 1, none of the left padding
    mask = (r >= i) & (r < i + window) & (first + r >= left)  # [n, C, K]
    mask = mask[None, :, None].expand(B, n, 1, C, K).reshape(B * n, 1, C, K)
    o = _sdpa_masked(q, k, v, mask, scale)  # [B * n, HQ, C, D]
    return o.view(B, n, HQ, C, D).transpose(1, 2).reshape(B, HQ, n * C, D)[:, :, :NQ]


def _window_masked(q, k, v, window: int, scale: float | None) -> torch.Tensor:
    """``sdpa_attention``'s window as one boolean ``[NQ, NK]`` mask, bottom-right."""
    NQ, NK = q.shape[2], k.shape[2]
    i = torch.arange(NQ, device=q.device)[:, None] + (NK - NQ)
    j = torch.arange(NK, device=q.device)[None, :]
    return _sdpa_masked(q, k, v, (j <= i) & (j > i - window), scale)


def _sdpa_masked(q, k, v, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """PyTorch's SDPA with a boolean mask, k and v given every head of q: with a mask, SDPA's
    GQA runs only in its math kernel, the memory-efficient one takes every head."""
    if q.shape[1] != k.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return _sdpa(q, k, v, mask, False, scale)


def _sdpa(q, k, v, mask, is_causal: bool, scale: float | None) -> torch.Tensor:
    """PyTorch's SDPA, with its GQA where k and v have fewer heads than q."""
    # enable_gqa must be a bool, which a head-count comparison is not under
    # torch.compile(dynamic=True) (a SymBool); a branch on it is guarded into one.
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, **gqa
    )
