"""The Gluon forward at lengths it did not take before session 59: N not a multiple of its
128-row tiles, prefills that continue a KV cache (NQ < NK, causal at the bottom right), and
causal sliding windows; and at D = 256, the interleaved layout and partial rotation (``--layout``,
``--rope-dim``; session 60).

Inference (no autograd), causal, default positions, one process on one GPU; ms = median GPU
time of a CUDA graph of calls (``experiments/timing.py``):

* ``fused, Gluon``: ``rope_attention(impl="fused")``, whose forward is the Gluon kernel where
  ``hopper_forward_takes`` holds; ``fused, Triton``: the same with ``GLUON_ENABLED = False``;
* ``auto``: ``rope_attention``'s own choice; ``separate``: RoPE then PyTorch's SDPA;
* ``sdpa, no RoPE``: the floor of issue 5 (for a prefill, SDPA's bottom-right mask); not
  timed with a window, for which SDPA has no kernel (``bench_window.py`` times that).

The note gives the largest difference between the Gluon and Triton outputs; their accuracy
against float64 is the tests' job (``tests/fused_rope/test_attention.py::test_gpu_hopper_forward``).

    python experiments/time_gluon_lengths.py --out experiments/results/time_gluon_lengths_h200.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.results_io import environment, markdown_table, print_report  # noqa: E402
from experiments.timing import time_ms  # noqa: E402
from fused_rope import attention_forward, rope_attention  # noqa: E402

SHAPES = {  # name: (B, HQ, HKV, NQ, NK, D, window)
    "2K-1": (2, 32, 32, 2047, 2047, 128, None),
    "2K+72": (2, 32, 32, 2120, 2120, 128, None),
    "GQA-4K-100": (2, 32, 8, 3996, 3996, 128, None),
    "16K-1": (1, 8, 8, 16383, 16383, 128, None),
    "GQA-8K": (1, 32, 8, 8192, 8192, 128, None),
    "Prefill-4K": (2, 32, 8, 1024, 4096, 128, None),
    "Prefill-16K": (1, 32, 8, 2048, 16384, 128, None),
    "Prefill-ragged": (2, 32, 8, 1000, 5000, 128, None),
    "Prefill-64x8K": (4, 32, 8, 64, 8192, 128, None),
    "Window-8K-1K": (2, 32, 8, 8192, 8192, 128, 1024),
    "Window-16K-4K": (1, 32, 8, 16384, 16384, 128, 4096),
    "Window-prefill": (2, 32, 8, 1000, 9000, 128, 2048),
    # D = 256 (Gemma 3 12B's heads; its local layers' 1024-key window), since session 60
    "D256-4K": (2, 16, 8, 4096, 4096, 256, None),
    "D256-16K": (1, 16, 8, 16384, 16384, 256, None),
    "D256-Prefill-8K": (1, 16, 8, 2048, 8192, 256, None),
    "D256-Window-8K-1K": (1, 16, 8, 8192, 8192, 256, 1024),
}


def _providers(q, k, v, window, rotation) -> dict:
    """Each provider's call; ``rotation``: ``rope_attention``'s ``layout`` and ``rope_dim``."""
    nq, nk = q.shape[2], k.shape[2]
    mask = causal_lower_right(nq, nk) if nq != nk else None

    def fused(gluon: bool):
        def run():
            attention_forward.GLUON_ENABLED, old = gluon, attention_forward.GLUON_ENABLED
            try:
                return rope_attention(q, k, v, impl="fused", window=window, **rotation)
            finally:
                attention_forward.GLUON_ENABLED = old

        return run

    def sdpa():
        gqa = q.shape[1] != k.shape[1]
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=gqa
            )
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=gqa
        )

    providers = {
        "fused, Gluon": fused(True),
        "fused, Triton": fused(False),
        "auto": lambda: rope_attention(q, k, v, window=window, **rotation),
    }
    if window is None:
        providers.update({
            "separate": lambda: rope_attention(q, k, v, impl="separate", **rotation),
            "sdpa, no RoPE": sdpa,
        })  # fmt: skip
    return providers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--layout", default="half", choices=["half", "interleaved"])
    parser.add_argument("--rope-dim", type=int, default=None, help="rotated channels (default D)")
    parser.add_argument("--out", type=Path, default=None, help="markdown report to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("a CUDA GPU is needed")
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.shapes:
        b, hq, hkv, nq, nk, d, window = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, generator=gen)
                for _ in range(2))  # fmt: skip
        rotation = dict(layout=args.layout, rope_dim=args.rope_dim)
        label = f"{name} ({b},{hq}/{hkv},{nq}x{nk},{d}" + (f", window {window}" if window else "")
        if args.layout != "half" or args.rope_dim:
            label += f", {args.layout}, rope_dim {args.rope_dim or d}"
        label += ")"
        with torch.no_grad():
            providers = _providers(q, k, v, window, rotation)
            outputs = {p: providers[p]() for p in ("fused, Gluon", "fused, Triton")}
            diff = (outputs["fused, Gluon"].float() - outputs["fused, Triton"].float()).abs().max()
            times = {p: time_ms(fn)[0] for p, fn in providers.items()}
        floor = times.get("sdpa, no RoPE")
        for provider, ms in times.items():
            rows.append({
                "shape": label, "dtype": args.dtype, "provider": provider, "ms": ms,
                "x_floor": ms / floor if floor else None,
                "note": f"max |Gluon - Triton| {diff:.1e}" if provider == "fused, Gluon" else "",
            })  # fmt: skip
        print(f"{label}: " + ", ".join(f"{p} {t:.4f}" for p, t in times.items()), flush=True)
    env = environment()
    text = (
        "# The Gluon forward at ragged lengths, prefills and sliding windows\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}; "
        "causal inference, ms = median GPU time (CUDA graph), x_floor = ms / SDPA without "
        "RoPE.\n\n" + markdown_table(rows, ["shape", "dtype", "provider", "ms", "x_floor", "note"])
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
