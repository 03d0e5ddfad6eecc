"""Speed measures of a training run: the attention op's share of the step, and MFU.

Attention time: ``AttentionTimer.around`` wraps the core of every attention call
(position encoding + attention, after the projections) between two identity autograd
functions that record a timestamp in the forward *and* in the backward, so the total
counts both passes. On CUDA the stamps are CUDA events (asynchronous, exact on the
stream); on the CPU they are ``time.perf_counter`` readings, exact too because CPU ops
run synchronously. Attention layers run one after another in both passes, so the stamps
alternate start, end, start, end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name()
# (first match wins, so the more specific names come first). Vendor datasheets, no sparsity.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
]


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's peak dense bf16 FLOP/s, or None on the CPU and for GPUs not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


class _Stamp(torch.autograd.Function):
    """Identity on its tensors; records a stamp in the forward and another in the backward."""

    @staticmethod
    def forward(ctx, timer: AttentionTimer, *xs: torch.Tensor):
        timer.stamp()
        ctx.timer = timer
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.timer.stamp()
        return (None, *grads)


class AttentionTimer:
    """Sums the time spent inside ``around(...)`` regions, forward and backward."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = False
        self._stamps: list = []

    def stamp(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._stamps.append(event)
        else:
            self._stamps.append(time.perf_counter())

    def around(self, fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``fn(q, k, v)`` with stamps before and after, in both passes."""
        if not self.enabled:
            return fn(q, k, v)
        q, k, v = _Stamp.apply(self, q, k, v)
        (o,) = _Stamp.apply(self, fn(q, k, v))
        return o

    def pop_seconds(self) -> float:
        """Seconds inside the regions since the last call (waits for the GPU); clears the stamps."""
        stamps, self._stamps = self._stamps, []
        if len(stamps) % 2:
            raise RuntimeError("attention timer: unpaired stamp (a backward still pending?)")
        if self.cuda:
            torch.cuda.synchronize()
            return (
                sum(s.elapsed_time(e) for s, e in zip(stamps[::2], stamps[1::2], strict=True)) / 1e3
            )
        return sum(e - s for s, e in zip(stamps[::2], stamps[1::2], strict=True))


def causal_pairs(seq_len: float, window: float | None = None) -> float:
    """The (query, key) pairs causal attention over ``seq_len`` tokens computes: ``N (N + 1)
    / 2``, or within a sliding ``window`` of keys (the query's own included)."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) / 2
    return window * (window + 1) / 2 + (seq_len - window) * window


def model_flops_per_token(
    n_params: int,
    n_layer: int,
    d_attn: int,
    seq_len: float,
    windows: Sequence[int | None] = (),
) -> float:
    """Training FLOPs per token: ``6 P`` for the weight matmuls (forward + backward) plus the
    causal attention scores and weighted sum, ``6 L d_attn N`` (the PaLM appendix's
    ``12 L d N`` halved by the causal mask). ``P`` excludes the embedding table; ``d_attn`` is
    ``n_head * head_dim``; ``windows``: each layer's sliding window (None: every key; empty:
    none has one), which scales its attention term by the share of the causal pairs it keeps.
    Co-RoPE's gates (one more score matrix per KV head) are not counted, so its MFU is a
    slight underestimate."""
    windows = list(windows) or [None] * n_layer
    if len(windows) != n_layer:
        raise ValueError(f"windows must have one entry per layer ({n_layer}), got {len(windows)}")
    full = causal_pairs(seq_len)
    layers = sum(causal_pairs(seq_len, w) / full for w in windows)
    return 6.0 * n_params + 6.0 * layers * d_attn * seq_len
