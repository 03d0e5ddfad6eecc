"""Co-RoPE-GQA in PyTorch: the ground truth the Triton kernels are tested against.

The math is ``corope/README.md`` (from ``shared/docs/corope.md``): the distance between
query ``i`` and key ``j`` is the mileage ``delta[i, j] = sum_{j < t <= i} z[i, t]``, where
``z[i, t] = sigmoid(s <qL[i], k[t]>)`` are the gates of the group's leader query, and the
score of every head of the group is ``s <q[i], Rot(-delta[i, j] w) k[j]>``.

The reference processes queries in chunks of rows: a chunk of ``M`` rows holds ``M x N' x
R/2`` phases, ``N'`` the keys its rows see (from its first row's window start, if any, to its
last row): causal chunks take about half the work of all keys, windowed ones ``O(M (M +
window))`` (one thread of this project's CPU, forward+backward of (4, 4/2, N = 512, D = 64):
2.38 -> 1.21 s causal, 2.44 -> 0.31 s with a window of 64). Under autograd each chunk is
recomputed in the backward (``torch.utils.checkpoint``), so memory stays ``O(chunk * N * R)``
in training too; a call small enough to be one chunk of at most ``_KEEP_ELEMENTS`` keeps its
tensors instead.
"""

from __future__ import annotations

import numbers

import torch
from torch.utils.checkpoint import checkpoint

from fused_rope._validation import (
    check_bool,
    check_float_tensor,
    check_inv_freq,
    check_rope_dim,
    check_softmax_scale,
    check_window,
    under_functorch,
)
from fused_rope.frequencies import default_inv_freq
from fused_rope.naive import full_precision

LEADERS = ("first", "mean")

# Elements of the largest per-chunk tensor ([B, HKV, M, N, R/2]) when chunk_size is None: few,
# large chunks on a GPU (fewer launches); on the CPU smaller ones, whose tensors stay nearer
# its caches: at 2**21 a forward+backward of (4, 4/2 heads, N = 512, D = 64) took 2.38 s on
# one thread against 6.2 s at 2**25 (2**18-2**20 no faster; session 37).
_CHUNK_ELEMENTS = {"cpu": 1 << 21}
_CHUNK_ELEMENTS_ELSEWHERE = 1 << 25
# A call whose rows are one chunk of at most this many elements keeps the chunk's tensors for
# the backward (about ten of them: 80 MB in fp32) rather than recomputing them: the default
# CPU flip-flop job's layer (32 x 1/2 heads, N = 64, D = 32; 2**21 elements) took 72 ms a
# forward+backward checkpointed and 46 ms without, on one thread (session 38).
_KEEP_ELEMENTS = 1 << 21


def corope_inv_freq(
    rope_dim: int,
    theta: float,
    inv_freq: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``w[d] = theta ** (-2d / R)`` in fp32 (``rope_frequencies``'), or the given ``inv_freq``
    (checked: ``[R/2]`` fp32/fp64 on ``device``) in ``dtype``: fp32 for the kernels, the
    compute dtype for the reference, so that fp64 frequencies stay fp64 there. The default is
    ``default_inv_freq``'s shared tensor: treat it as read-only (an in-place change would
    reach every later call that defaults to it)."""
    if inv_freq is None:
        return default_inv_freq(rope_dim, theta, device).to(dtype)
    check_inv_freq(inv_freq, rope_dim)
    if inv_freq.device != device:
        raise ValueError(f"inv_freq is on {inv_freq.device} but q is on {device}")
    return inv_freq.to(dtype)


def check_corope_inputs(q, k, v, rope_dim, leader, softmax_scale, queries_last=False):
    """Validates the arguments shared by the reference and the kernels; returns (R, s).
    ``queries_last``: q may have fewer rows than k (the last keys' positions), as in decoding;
    otherwise q and k have one length."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(t, name, ndim=4)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    B, HQ, N, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k must be [B={B}, HKV, NK, D={D}] to match q {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if queries_last and k.shape[2] < N:
        raise ValueError(
            f"q's {N} rows are the last of k's positions, so k needs at least {N}, got "
            f"{k.shape[2]} (q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    if not queries_last and k.shape[2] != N:
        raise ValueError(
            f"k must be [B={B}, HKV, N={N}, D={D}] to match q {tuple(q.shape)}, got "
            f"{tuple(k.shape)} (the backward kernels take q and k of one length; "
            "corope_attention_ref also takes fewer query rows, the last positions, as a "
            "decoding step does)"
        )
    HKV = k.shape[1]
    if HKV == 0 or HQ == 0 or HQ % HKV:
        raise ValueError(
            f"q's head count {HQ} must be a positive multiple of k's head count {HKV} (each KV "
            "group needs a leader query)"
        )
    if not isinstance(leader, str):  # a 0-d numpy array of "first" compares equal to it
        raise TypeError(f"leader must be a str, one of {LEADERS}, got {type(leader).__name__}")
    if leader not in LEADERS:
        raise ValueError(f"leader must be one of {LEADERS}, got {leader!r}")
    R = check_rope_dim(rope_dim, D)
    return R, check_softmax_scale(softmax_scale, D)


def leader_query(qg: torch.Tensor, leader: str) -> torch.Tensor:
    """The query that computes a group's gates: ``qg [B, HKV, G, N, D]`` (the query heads
    grouped by KV head) to ``qL [B, HKV, N, D]``, the group's first head or the heads' mean."""
    return qg[:, :, 0] if leader == "first" else qg.mean(dim=2)


def gates(qL: torch.Tensor, k: torch.Tensor, s: float, causal: torch.Tensor) -> torch.Tensor:
    """``z [B, HKV, M, N] = sigmoid(s <qL_i, k_j>)`` where ``causal [M, N]`` is true, else 0;
    ``qL [B, HKV, M, D]`` (rows of the leader query), ``k [B, HKV, N, D]``."""
    # A select, not a product with the mask: a NaN or inf in a later key must not reach the
    # outputs of the rows that do not see it (NaN * 0 is NaN), as it does not in the kernels.
    # Only the gates and scores are guarded so: a NaN in v reaches every row of a chunk whose
    # keys hold it through the weights' zeros (P @ v), as it reaches every row of a kernel's
    # query tile that loads it, and one in k the earlier rows' gradients, here as in the
    # kernels and in FlashAttention.
    return torch.where(causal, torch.sigmoid(s * qL @ k.transpose(-1, -2)), 0.0)


def mileage(z: torch.Tensor) -> torch.Tensor:
    """``delta [..., M, N]`` from causal gates ``z [..., M, N]``: ``delta[i, j] = sum_{t > j}
    z[i, t]``, the distance by which Co-RoPE rotates key ``j`` for query ``i``."""
    # An exclusive suffix sum (z = 0 past the diagonal), so the distances near the diagonal
    # stay small numbers and keep their precision.
    return z.flip(-1).cumsum(-1).flip(-1) - z


def _chunk_rows(
    q: torch.Tensor,  # [B, HKV, G, M, D] the rows at positions i0 .. i0 + M - 1, every head
    qL: torch.Tensor,  # [B, HKV, M, D] the leader's rows
    k: torch.Tensor,  # [B, HKV, N, D]
    v: torch.Tensor,  # [B, HKV, N, D]
    w: torch.Tensor,  # [R/2]
    i0: int,  # the position of the first row, counted from k's first
    s: float,
    R: int,
    detach_mileage: bool,
    unit_gates: bool,
    rotated_key_dtype: torch.dtype | None = None,
    window: int = 0,  # a sliding window's keys (0: every earlier key)
):
    M, N = q.shape[-2], k.shape[-2]
    rows = torch.arange(i0, i0 + M, device=q.device)
    keys = torch.arange(N, device=q.device)[None, :]
    causal = keys <= rows[:, None]  # [M, N]
    if window:
        causal &= keys > rows[:, None] - window
    if unit_gates:
        z = causal.to(q.dtype).expand(*qL.shape[:2], M, N)
    else:
        z = gates(qL, k, s, causal)  # [B, HKV, M, N]
    delta = mileage(z)
    if detach_mileage:
        delta = delta.detach()
    phi = delta[..., None] * w  # [B, HKV, M, N, R/2]
    cos, sin = phi.cos(), phi.sin()
    k1, k2 = k[..., None, :, : R // 2], k[..., None, :, R // 2 : R]  # [B, HKV, 1, N, R/2]
    kr1 = k1 * cos + k2 * sin  # the key rotated by -phi
    kr2 = k2 * cos - k1 * sin
    if rotated_key_dtype is not None:
        kr1, kr2 = (x.to(rotated_key_dtype).to(k.dtype) for x in (kr1, kr2))
    q1, q2 = q[..., : R // 2], q[..., R // 2 : R]  # [B, HKV, G, M, R/2]
    scores = torch.einsum("bghmd,bgmnd->bghmn", q1, kr1) + torch.einsum(
        "bghmd,bgmnd->bghmn", q2, kr2
    )
    if R < q.shape[-1]:
        scores = scores + q[..., R:] @ k[:, :, None, :, R:].transpose(-1, -2)
    scores = (s * scores).masked_fill(~causal, float("-inf"))  # [B, HKV, G, M, N]
    lse = torch.logsumexp(scores, dim=-1)  # [B, HKV, G, M]
    p = torch.exp(scores - lse[..., None])
    o = p @ v[:, :, None]  # [B, HKV, G, M, D]
    return o, lse


@full_precision
def corope_attention_ref(
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
    unit_gates: bool = False,
    chunk_size: int | None = None,
    return_lse: bool = False,
    rotated_key_dtype: torch.dtype | None = None,
    rows: range | None = None,
    window: int | None = None,
):
    """Causal Co-RoPE-GQA attention, differentiable through q, k and v.

    Args:
        q: ``[B, HQ, NQ, D]``; head ``h`` belongs to KV group ``h // (HQ // HKV)``. Its rows
            are the last ``NQ`` positions ``NK - NQ .. NK - 1``: ``NQ = NK`` is a whole
            sequence, fewer rows continue a KV cache (a decoding step is ``NQ = 1``).
        k, v: ``[B, HKV, NK, D]`` with ``HQ % HKV == 0`` and ``NK >= NQ``.
        theta: RoPE base; ``w[d] = theta ** (-2d / R)``.
        inv_freq: ``[R/2]`` frequencies overriding ``theta`` (the scaled schedules of
            ``fused_rope.rope_frequencies``).
        softmax_scale: ``s``, default ``1 / sqrt(D)``; it scales both the gates and the scores.
        rope_dim: ``R``, even, at most ``D`` (default ``D``); channels ``R:`` are a plain dot product.
        leader: ``"first"`` (the group's first query head computes the gates) or ``"mean"``
            (the mean of the group's query heads).
        detach_mileage: hold the mileage constant in the backward (an ablation).
        unit_gates: force every gate to 1, which makes this exactly RoPE attention
            (split-half layout, positions ``0..N-1``); a check of the math.
        chunk_size: query rows per chunk (default: as many as keep the largest chunk tensor
            near 2**21 elements on the CPU, 2**25 elsewhere).
        return_lse: also return the per-row log-sum-exp of the scores.
        rotated_key_dtype: round the rotated key ``Rot(-phi) k`` to this dtype before the
            score products, as a half-precision kernel that feeds it to the tensor cores does
            (the baseline of such a kernel's scores; default: no rounding).
        rows: compute only these rows of q (a ``range`` of step 1, ``0 <= start < stop <= NQ``),
            in O(len(rows) * NK) memory: how long sequences are checked on sampled rows.
        window: a causal sliding window: query ``i`` sees only its last ``window`` keys,
            ``i - window < j <= i`` (positions), its own included. The mileage of a key it
            sees sums the gates of keys between the two, all inside the window, so a window
            changes which keys are seen, not their distances. ``None``: every earlier key.

    Returns:
        ``o`` ``[B, HQ, M, D]`` in q's dtype, and with ``return_lse`` the natural-log
        log-sum-exp ``[B, HQ, M]`` in fp32 (fp64 for fp64 inputs), where ``M`` is ``NQ`` or
        ``len(rows)``. Computed in fp32 (fp64 for fp64 inputs).
    """
    R, s = check_corope_inputs(q, k, v, rope_dim, leader, softmax_scale, queries_last=True)
    window = check_window(window, causal=True, keys=k.shape[2])  # as corope_attention's
    for name, flag in (
        ("detach_mileage", detach_mileage),
        ("unit_gates", unit_gates),
        ("return_lse", return_lse),
    ):
        check_bool(flag, name)
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
            raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        chunk_size = int(chunk_size)
    if rotated_key_dtype is not None and (
        not isinstance(rotated_key_dtype, torch.dtype) or not rotated_key_dtype.is_floating_point
    ):
        raise TypeError(
            f"rotated_key_dtype must be a floating torch.dtype or None, got {rotated_key_dtype!r}"
        )
    B, HQ, N, D = q.shape
    if rows is None:
        rows = range(N)
    elif not isinstance(rows, range):
        raise TypeError(f"rows must be a range or None, got {type(rows).__name__}")
    elif rows.step != 1 or not 0 <= rows.start < rows.stop <= N:
        raise ValueError(
            f"rows must be a range of step 1 with 0 <= start < stop <= {N}, got {rows!r}"
        )
    HKV, NK = k.shape[1], k.shape[2]
    first_position = NK - N  # of q's row 0
    G = HQ // HKV
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    w = corope_inv_freq(R, theta, inv_freq, q.device, cd)
    qg = q.to(cd).view(B, HKV, G, N, D)
    kf, vf = k.to(cd), v.to(cd)
    qL = leader_query(qg, leader)  # [B, HKV, N, D]
    if chunk_size is None:
        budget = _CHUNK_ELEMENTS.get(q.device.type, _CHUNK_ELEMENTS_ELSEWHERE)
        chunk_size = max(1, budget // max(1, B * HKV * NK * max(R // 2, 1)))
    # Checkpointed chunks: their N x chunk x R/2 tensors are recomputed in the backward, not
    # kept, unless the call is one small chunk. Not under torch.func, which does not support
    # checkpoint's saved-tensor hooks.
    one_small_chunk = (
        chunk_size >= len(rows) and B * HKV * len(rows) * NK * max(R // 2, 1) <= _KEEP_ELEMENTS
    )
    recompute = (
        torch.is_grad_enabled()
        and any(t.requires_grad for t in (q, k, v, w))  # w: learned frequencies
        and not under_functorch()
        and not one_small_chunk
    )
    outs, lses = [], []
    for i0 in range(rows.start, rows.stop, chunk_size):
        i1 = min(rows.stop, i0 + chunk_size)
        # The keys the chunk's rows see: none past its last row (causal), none before its first
        # row's window. A hidden key adds only zeros (gate 0, weight exp(-inf)) and no visible
        # key's mileage, so the slice changes the work (half of it for a causal chunk, all but
        # the window's keys for a windowed one), and the result only by the order of its sums.
        lo = max(0, first_position + i0 - window + 1) if window else 0
        hi = first_position + i1
        args = (
            qg[:, :, :, i0:i1],
            qL[:, :, i0:i1],
            kf[:, :, lo:hi],
            vf[:, :, lo:hi],
            w,
            first_position + i0 - lo,
            s,
            R,
            detach_mileage,
            unit_gates,
            rotated_key_dtype,
            window,
        )
        o, lse = (
            checkpoint(_chunk_rows, *args, use_reentrant=False) if recompute else _chunk_rows(*args)
        )
        outs.append(o)
        lses.append(lse)
    M = len(rows)
    if M == 0:  # NQ = 0: no chunk ran. Empty slices keep q, k and v in the outputs' graph
        # (zero gradients, as the kernels give, where new tensors had no graph at all)
        o = q[:, :, :0] + (k[:, :, :0].sum() + v[:, :, :0].sum()).to(q.dtype)
        lse = q[:, :, :0, 0].to(cd)
        return (o, lse) if return_lse else o
    o = torch.cat(outs, dim=-2).reshape(B, HQ, M, D).to(q.dtype)
    if return_lse:
        return o, torch.cat(lses, dim=-1).reshape(B, HQ, M)
    return o
