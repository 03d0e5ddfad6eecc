"""The Python side of the decoding launchers, on the CPU: each call's cost with Triton's
launches replaced by no-ops.

A decoding step of a small model is bound by the host (``experiments/profile_decode.py``),
whose time on the GPU machine moves by up to 2x from run to run. What the launchers spend in
Python (argument checks, shapes, allocations) before Triton's launcher runs is the same on
any CPU, so this script measures it here, in microseconds a call: the RoPE kernel's
``apply_rope_qk`` of one new row (the harness's RoPE step: its angles built per call, as until
session 29, or formed in the kernel from ``position_offset``), ``corope.decode.corope_decode``
and the public ``corope_attention`` with one query row (B = 1, 8/2 heads, D = 64, 512 cached
keys); and ``fused_rope.rope_attention`` at the benchmark's Small-1K shape (4, 8, 1024, 64),
its fused kernels (``impl="fused"``) and the separate path (``impl="separate"``: the RoPE
kernel, then SDPA, which on the CPU is replaced too, by a no-op with a no-op gradient), forward
and forward+backward: the eager host time that ``bench_rope_attention``'s notes show beside
its CUDA-graph times; the fused forward+backward also through its custom ops, the path under a
tracer (and eagerly until session 50, when eager calls took an autograd.Function instead).
Triton's own launcher, which this leaves out, costs more on top of it. The calls are timed in
rounds, each round timing every call in turn.

``--gpu`` times the same calls on CUDA tensors with the kernels launched (Triton's launcher
included), next to one eager PyTorch op as the host's yardstick: each call's host time, the
calls issued back to back (their kernels take a few microseconds, so the GPU keeps up); and
``corope_attention``'s forward+backward at (1, 8/2, 512, 64) bf16, eagerly and through its
custom ops.

    python experiments/host_cost.py          # this CPU, launches stubbed
    python experiments/host_cost.py --gpu    # a GPU machine, launches real
    python experiments/host_cost.py --quick  # one round of a few calls: a smoke run
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

GPU = "--gpu" in sys.argv[1:]
QUICK = "--quick" in sys.argv[1:]
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors reach the launchers' checks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import corope.attention  # noqa: E402
import corope.decode  # noqa: E402
import fused_rope._attention_common  # noqa: E402
import fused_rope.attention  # noqa: E402
import fused_rope.attention_backward  # noqa: E402
import fused_rope.attention_forward  # noqa: E402
import fused_rope.rope  # noqa: E402
from corope import corope_attention  # noqa: E402
from fused_rope.attention import rope_attention  # noqa: E402
from fused_rope.frequencies import rope_angles  # noqa: E402


class _NoSdpa(torch.autograd.Function):
    """SDPA's stand-in on the CPU: an empty output of q's shape and empty gradients (the real
    one would compute attention on the CPU, seconds at Small-1K)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.inputs = q, k, v
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        return tuple(torch.empty_like(x) for x in ctx.inputs)


class _NoLaunch:
    """A Triton kernel's stand-in: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def us_per_call(calls: dict, runs: int = 1 if QUICK else 7) -> dict[str, float]:
    """Microseconds a call of each entry of ``calls`` (name -> ``(fn, n)``): the fastest of
    ``runs`` rounds, each round timing ``n`` calls of every entry in turn (the GPU machine's host
    speed drifts by up to 2x within a process: rounds put the entries under the same drift),
    after warm-up calls; on the GPU each timing ends with a synchronization, so no call's
    kernels are left out."""
    sync = torch.cuda.synchronize if GPU else (lambda: None)
    best = dict.fromkeys(calls, float("inf"))
    for round_ in range(runs):
        for name, (fn, n) in calls.items():
            for _ in range(n // 5 if round_ == 0 else 0):
                fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    if GPU and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device")
    if not GPU:
        stubbed = {
            fused_rope.rope: ["_rope_kernel"],
            corope.decode: ["_gate_sums_kernel", "_split_kernel", "_combine_kernel"],
            fused_rope.attention_forward: ["_rope_attn_fwd_kernel"],
            fused_rope._attention_common: ["_rotate_kernel", "_rope_table_kernel"],
            fused_rope.attention_backward: [
                "_bwd_preprocess_kernel", "_rope_attn_bwd_dkdv_kernel", "_rope_attn_bwd_dq_kernel"
            ],
        }  # fmt: skip
        for module, names in stubbed.items():
            for name in names:
                setattr(module, name, _NoLaunch())
        torch.nn.functional.scaled_dot_product_attention = (
            lambda q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False: _NoSdpa.apply(q, k, v)
        )  # fmt: skip
    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
    q, k_new = (torch.randn(1, h, 1, 64, device=device, dtype=dtype) for h in (8, 2))
    k, v = (torch.randn(1, 2, 512, 64, device=device, dtype=dtype) for _ in range(2))
    w = torch.rand(32, device=device)
    rope_qk = fused_rope.rope.apply_rope_qk
    calls = {
        # the harness's RoPE step until session 29: the new row's angles built, then the kernel
        "apply_rope_qk, one new row, its angles built": lambda: rope_qk(
            q, k_new, rope_angles(torch.arange(511, 512, device=device), w)
        ),
        "apply_rope_qk, one new row, inv_freq and position_offset": lambda: rope_qk(
            q, k_new, inv_freq=w, position_offset=511
        ),
        "corope_decode": lambda: corope.decode.corope_decode(q, k, v, w, 0.125, 64, "first"),
        "corope_attention, one query row": lambda: corope_attention(q, k, v),
    }
    # Small-1K of bench_rope_attention (fp16: the kernels' dtype; bf16 arithmetic is GPU-only)
    attn_dtype = torch.float16
    qa, ka, va = (torch.randn(4, 8, 1024, 64, device=device, dtype=attn_dtype) for _ in range(3))
    for impl in ("fused", "separate"):
        calls[f"rope_attention, Small-1K, impl={impl!r}, forward"] = lambda impl=impl: (
            rope_attention(qa, ka, va, impl=impl)
        )
    if GPU:
        calls["torch.add, one eager op (the yardstick)"] = lambda: torch.add(q, 1.0)
    timed = {name: (torch.no_grad()(fn), 1000) for name, fn in calls.items()}
    leaves = [x.detach().requires_grad_() for x in (qa, ka, va)]
    do = torch.randn_like(qa)
    steps = {
        impl: _forward_backward(lambda *x, impl=impl: rope_attention(*x, impl=impl), leaves, do)
        for impl in ("fused", "separate")
    }
    for impl, step in steps.items():
        timed[f"rope_attention, Small-1K, impl={impl!r}, forward+backward"] = step, 200
    # The fused kernels through their custom ops, as under a tracer and, until session 50,
    # eagerly: the ops' dispatch against the eager Function's
    name = "rope_attention, Small-1K, impl='fused', forward+backward, through the custom ops"
    timed[name] = _through_custom_ops(fused_rope.attention, steps["fused"]), 200
    if GPU:  # Co-RoPE's kernels have no CPU stand-ins here
        qc, kc, vc = (torch.randn(1, h, 512, 64, device=device, dtype=dtype) for h in (8, 2, 2))
        corope_leaves = [x.requires_grad_() for x in (qc, kc, vc)]
        corope_step = _forward_backward(corope_attention, corope_leaves, torch.randn_like(qc))
        name = "corope_attention, (1, 8/2, 512, 64), forward+backward"
        timed[name] = corope_step, 200
        timed[name + ", through the custom ops"] = (
            _through_custom_ops(corope.attention, corope_step),
            200,
        )
    if QUICK:
        timed = {name: (fn, 5) for name, (fn, _) in timed.items()}
    for name, us in us_per_call(timed).items():
        print(f"{name}: {us:.1f} us")


def _forward_backward(attention, leaves, do):
    """A call of ``attention(*leaves)`` and its backward from ``do``, gradients cleared."""

    def call():
        attention(*leaves).backward(do)
        for x in leaves:
            x.grad = None

    return call


def _through_custom_ops(module, fn):
    """``fn`` with ``module``'s attention taking its custom ops, as under a tracer
    (``runs_eagerly`` False there) and eagerly until session 50."""

    def call():
        eager, module.runs_eagerly = module.runs_eagerly, lambda *tensors: False
        try:
            return fn()
        finally:
            module.runs_eagerly = eager

    return call


if __name__ == "__main__":
    main()
