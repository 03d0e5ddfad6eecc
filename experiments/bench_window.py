"""Sliding-window RoPE attention: ``rope_attention(window=...)``'s fused kernels against the
ways PyTorch offers, in one process on one GPU.

Causal, bf16, forward and forward+backward, for each (shape, window):

* ``fused``: ``rope_attention(impl="fused", window=W)``, which skips the key tiles outside
  every window of a tile (what ``impl="auto"`` takes);
* ``separate``: this package's Triton RoPE, then SDPA with a boolean window mask over chunks
  of queries, each with the keys their windows reach (``impl="separate"``: SDPA has no
  sliding-window kernel, so it runs its memory-efficient one with the mask);
* ``flex``: the Triton RoPE, then ``torch.compile``'s ``flex_attention`` with a sliding-window
  block mask (PyTorch's own answer to windows);
* ``fused, no window`` and ``sdpa, no RoPE, no window``: the full causal attention the window
  saves work against.

TFLOPS count the visible (query, key) pairs only (4 D flops a pair forward, 2.5 times that
backward, as FlashAttention counts), so a provider that does no wasted work on hidden pairs
keeps the TFLOPS of full causal attention: the floor of a windowed call is its share of
visible pairs times full causal attention's time, at the same TFLOPS.

Each windowed provider's forward is checked on sampled query rows against the float64
reference (``fused_rope.naive.rope_attention_ref`` with the window) by flash-attention's rule
(``tests.helpers.check_against_baseline``: within twice the errors of PyTorch attention in
bf16, ``tests.helpers.rope_attention_in_dtype``): the table's accuracy column, "ACC FAIL" for a provider that misses it.

    python experiments/bench_window.py --out experiments/results/bench_window_h200.md
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from experiments.results_io import (  # noqa: E402
    environment,
    markdown_table,
    print_report,
    sampled_rows_note,
)
from experiments.timing import input_sets, time_ms  # noqa: E402
from fused_rope.attention import rope_attention  # noqa: E402
from fused_rope.frequencies import default_inv_freq, rope_angles  # noqa: E402
from fused_rope.naive import rope_attention_ref  # noqa: E402
from fused_rope.rope import apply_rope_qk  # noqa: E402
from fused_rope.sdpa import sdpa_attention  # noqa: E402
from lm.profiling import causal_pairs  # noqa: E402
from tests.helpers import rope_attention_in_dtype  # noqa: E402

# name -> (B, HQ, HKV, N, D, window): a Llama-like GQA layer with Gemma 3's window (1024) and
# Mistral's (4096)
CASES = {
    "GQA-4K-w1024": (2, 32, 8, 4096, 128, 1024),
    "GQA-16K-w1024": (1, 32, 8, 16384, 128, 1024),
    "GQA-16K-w4096": (1, 32, 8, 16384, 128, 4096),
}
# flex last: a failed CUDA-graph capture of its compiled graph may leave the GPU unusable
PROVIDERS = ("fused", "separate", "fused, no window", "sdpa, no RoPE, no window", "flex")
WINDOWED = ("fused", "separate", "flex")


def _flex(B: int, HQ: int, N: int, window: int):
    """RoPE (the Triton kernel), then compiled ``flex_attention`` with a sliding-window block
    mask (query ``i`` sees keys ``i - window < j <= i``)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sliding(b, h, i, j):
        return (j <= i) & (j > i - window)

    mask = create_block_mask(sliding, B=None, H=None, Q_LEN=N, KV_LEN=N, device="cuda")
    # one compiled function per grad mode: inference and training graphs differ. They share
    # flex_attention's code object, so its compilations for every case and mode count against
    # one recompile limit (8 by default; hit at the third case, after which flex ran unfused)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    attend = {grad: torch.compile(flex_attention, dynamic=False) for grad in (False, True)}

    def run(q, k, v):
        inv_freq = default_inv_freq(q.shape[-1], 10000.0, q.device)
        q, k = apply_rope_qk(q, k, inv_freq=inv_freq)
        grad = torch.is_grad_enabled() and q.requires_grad
        return attend[grad](q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return run


def rows_accuracy(o: torch.Tensor, q, k, v, window: int) -> str:
    """``sampled_rows_note`` of the windowed causal output ``o`` against the RoPE reference, the
    baseline PyTorch attention in ``o``'s dtype (``tests.helpers.rope_attention_in_dtype``:
    its q, k and probabilities rounded as a kernel's are; the fp32 reference rounded once
    would hold every kernel to half its error, and all three providers sat at 2.0x it at
    16K with a 4096-key window)."""
    # the rows' queries and every key up to the last of them: the causal mask, aligned at the
    # bottom right, then puts row i0 + r at position i0 + r
    rows = lambda i0, i1: (q[:, :, i0:i1], k[:, :, :i1], v[:, :, :i1])

    def reference(i0: int, i1: int, cd: torch.dtype) -> torch.Tensor:
        return rope_attention_ref(*(x.to(cd) for x in rows(i0, i1)), window=window)[0]

    def baseline(i0: int, i1: int) -> torch.Tensor:
        D = q.shape[-1]
        angles = rope_angles(
            torch.arange(i1, device=q.device), default_inv_freq(D, 10000.0, q.device)
        )
        return rope_attention_in_dtype(
            *rows(i0, i1), q_angles=angles[i0:i1], k_angles=angles, causal=True,
            scale=D**-0.5, layout="half", rope_dim=D, window=window,
        )[0]  # fmt: skip

    return sampled_rows_note(o, reference, baseline)


def time_case(B: int, HQ: int, HKV: int, N: int, D: int, window: int, dtype) -> dict:
    """Median GPU ms of each provider, forward and forward+backward, cycling through enough
    input copies to defeat L2; and each windowed provider's accuracy note (``rows_accuracy``)."""
    like = dict(device="cuda", dtype=dtype, requires_grad=True)
    size = (B * HQ + 2 * B * HKV) * N * D * dtype.itemsize
    sets = [
        tuple(torch.randn(B, h, N, D, **like) for h in (HQ, HKV, HKV))
        for _ in range(input_sets(size, torch.device("cuda")))
    ]
    grads = [t for s in sets for t in s]
    do = torch.randn(B, HQ, N, D, device="cuda", dtype=dtype)
    run = {
        "fused": lambda q, k, v: rope_attention(q, k, v, impl="fused", window=window),
        "separate": lambda q, k, v: rope_attention(q, k, v, impl="separate", window=window),
        "flex": _flex(B, HQ, N, window),
        "fused, no window": lambda q, k, v: rope_attention(q, k, v, impl="fused"),
        "sdpa, no RoPE, no window": lambda q, k, v: sdpa_attention(q, k, v),
    }
    row = {}
    with torch.no_grad():
        first = [t.detach() for t in sets[0]]
        for name in WINDOWED:
            try:
                row[f"{name} acc"] = rows_accuracy(run[name](*first), *first, window)
            except Exception as e:  # noqa: BLE001 - a rival that fails is reported, not fatal
                print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                row[f"{name} acc"] = f"failed: {type(e).__name__}"
    for name, mode in itertools.product(PROVIDERS, ("fwd", "fwd+bwd")):
        if mode == "fwd":
            calls = [lambda a=a, f=run[name]: f(*[t.detach() for t in a]) for a in sets]
        else:
            calls = [lambda a=a, f=run[name]: f(*a).backward(do) for a in sets]
        cycle = itertools.cycle(calls)

        def timed(graph: bool, c=cycle) -> float:
            return time_ms(lambda: next(c)(), graph=graph, grad_to_none=grads, rep_ms=60)[0]

        try:
            row[f"{name} {mode}"] = timed(True)
        except Exception as e:  # noqa: BLE001 - a compiled graph a CUDA graph cannot capture
            print(f"{name} {mode}: not in a CUDA graph ({type(e).__name__}): {str(e)[:300]}")
            try:
                row[f"{name} {mode}"] = timed(False)
                row["eager"] = row.get("eager", ()) + (f"{name} {mode}",)
            except Exception as e:  # noqa: BLE001 - a rival that fails is reported, not fatal
                print(f"{name} {mode} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                row[f"{name} {mode}"] = float("nan")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="markdown file to write the table to")
    ap.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_window.py times GPU kernels; no CUDA device here")
    dtype = torch.bfloat16
    rows = []
    for name in args.cases:
        B, HQ, HKV, N, D, W = CASES[name]
        t = time_case(B, HQ, HKV, N, D, W, dtype)
        flops = {"fwd": 4 * B * HQ * D, "fwd+bwd": 3.5 * 4 * B * HQ * D}
        for mode in ("fwd", "fwd+bwd"):
            row = {"case (B, HQ/HKV, N, D, window)": f"{name} ({B}, {HQ}/{HKV}, {N}, {D}, {W})"}
            row["mode"] = mode
            for p in PROVIDERS:
                pairs = causal_pairs(N, None if "no window" in p else W)
                ms = t[f"{p} {mode}"]
                row[f"{p} ms (TFLOPS)"] = f"{ms:.3f} ({flops[mode] * pairs / ms / 1e9:.0f})"
            full = t[f"sdpa, no RoPE, no window {mode}"]
            floor = full * causal_pairs(N, W) / causal_pairs(N, None)
            row["floor ms"] = f"{floor:.3f}"
            row["fused / floor"] = f"{t[f'fused {mode}'] / floor:.2f}"
            row["accuracy (sampled rows, fwd)"] = (
                "; ".join(f"{p}: {t[f'{p} acc']}" for p in WINDOWED) if mode == "fwd" else ""
            )
            rows.append(row)
        if "eager" in t:
            print(f"{name}: timed eagerly: {', '.join(t['eager'])}", flush=True)
    env = environment()
    text = (
        "# Sliding-window RoPE attention (bf16, causal)\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
        f"{env['date']}. Median GPU ms; TFLOPS on the visible pairs; the floor is full causal "
        "SDPA without RoPE scaled to the window's share of pairs.\n\n"
        + markdown_table(rows, list(rows[0]))
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
