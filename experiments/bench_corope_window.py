"""Sliding-window Co-RoPE: ``corope_attention(window=...)`` against the unwindowed kernels and
windowed RoPE attention, in one process on one GPU.

Causal, bf16, forward and forward+backward, for each (shape, window):

* ``corope, window``: ``corope_attention(q, k, v, window=W)``, whose kernels sweep only the
  key tiles inside a query tile's windows;
* ``corope, no window``: the same kernels over every earlier key (skipped where one
  forward+backward takes seconds: ``--max-full-n``);
* ``rope, window``: ``fused_rope.rope_attention(window=W)``, the fused RoPE kernel (what a
  windowed layer costs without the mileage).

The floor is the sin/cos floor of ``shared/docs/corope.md`` on the pairs a window keeps:
``2 * B * HKV * pairs * (R / 2)`` sin/cos at 4.2e12 a second for the forward, twice that for
forward+backward (a backward needs each phase once again; this one evaluates them twice, so
its own design's floor is three times the forward's). Each windowed forward is checked on
sampled rows against the float64 reference with flash-attention's rule (the note).

    python experiments/bench_corope_window.py --out experiments/results/bench_corope_window_h200.md
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from corope import corope_attention  # noqa: E402
from experiments.bench_corope import SINCOS_PER_S, rows_accuracy  # noqa: E402
from experiments.results_io import environment, markdown_table, print_report  # noqa: E402
from experiments.timing import peak_extra_mib, time_gpu_ms  # noqa: E402
from fused_rope.attention import rope_attention  # noqa: E402
from lm.profiling import causal_pairs  # noqa: E402

# name -> (B, HQ, HKV, N, D, window): issue 3's layer with Gemma 3's window (1024) and
# Mistral's (4096)
CASES = {
    "4K-w1024": (1, 32, 8, 4096, 128, 1024),
    "16K-w1024": (1, 32, 8, 16384, 128, 1024),
    "16K-w4096": (1, 32, 8, 16384, 128, 4096),
    "32K-w1024": (1, 32, 8, 32768, 128, 1024),
}
PROVIDERS = ("corope, window", "corope, no window", "rope, window")


def time_case(B, HQ, HKV, N, D, window, dtype, max_full_n) -> dict:
    """Median GPU ms of each provider and mode (NaN where skipped), the windowed kernels'
    forward+backward memory beyond q, k, v, o and their gradients, and the accuracy note."""
    like = dict(device="cuda", dtype=dtype, requires_grad=True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, **like) for h in (HQ, HKV, HKV))
    do = torch.randn_like(q)
    leaves = [q, k, v]
    run = {
        "corope, window": lambda: corope_attention(q, k, v, window=window),
        "corope, no window": lambda: corope_attention(q, k, v),
        "rope, window": lambda: rope_attention(q, k, v, window=window),
    }
    row = {}
    with torch.no_grad():
        row["note"] = rows_accuracy(run["corope, window"](), *(x.detach() for x in leaves),
                                    window=window)  # fmt: skip
    for name, mode in itertools.product(PROVIDERS, ("fwd", "fwd+bwd")):
        if name == "corope, no window" and N > max_full_n:
            row[f"{name} {mode}"] = float("nan")
            continue
        call = run[name] if mode == "fwd" else lambda f=run[name]: f().backward(do)
        with torch.set_grad_enabled(mode != "fwd"):
            row[f"{name} {mode}"] = time_gpu_ms(call, grad_to_none=leaves, rep_ms=60)[0][0]
    outputs = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()  # o, dq, dk, dv
    fwd_bwd = lambda: run["corope, window"]().backward(do)
    row["mem"] = peak_extra_mib(fwd_bwd, torch.device("cuda"), outputs)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="markdown file to write the table to")
    ap.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    ap.add_argument("--max-full-n", type=int, default=16384,
                    help="longest N at which the unwindowed kernels are timed")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_corope_window.py times GPU kernels; no CUDA device here")
    rows = []
    for name in args.cases:
        B, HQ, HKV, N, D, W = CASES[name]
        print(f"{name} ...", flush=True)
        t = time_case(B, HQ, HKV, N, D, W, torch.bfloat16, args.max_full_n)
        floor = 2 * B * HKV * causal_pairs(N, W) * (D / 2) / SINCOS_PER_S * 1e3
        for mode, floor_ms in (("fwd", floor), ("fwd+bwd", 2 * floor)):
            row = {"case (B, HQ/HKV, N, D, window)": f"{name} ({B}, {HQ}/{HKV}, {N}, {D}, {W})"}
            row["mode"] = mode
            for p in PROVIDERS:
                ms = t[f"{p} {mode}"]
                row[f"{p} ms"] = "skipped" if math.isnan(ms) else f"{ms:.3f}"
            full = t[f"corope, no window {mode}"]
            ratio = full / t[f"corope, window {mode}"]
            row["no window / window"] = "" if math.isnan(ratio) else f"{ratio:.1f}"
            row["sin/cos floor ms"] = f"{floor_ms:.3f}"
            row["window / floor"] = f"{t[f'corope, window {mode}'] / floor_ms:.2f}"
            row["MiB beyond q,k,v,o,grads"] = f"{t['mem']:.0f}" if mode == "fwd+bwd" else ""
            row["accuracy (sampled rows)"] = t["note"] if mode == "fwd" else ""
            rows.append(row)
    env = environment()
    text = (
        "# Sliding-window Co-RoPE (bf16, causal)\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
        f"{env['date']}. Median GPU ms (`experiments.timing.time_gpu_ms`: a CUDA graph of calls "
        "under 20 ms, `triton.testing.do_bench` over 60 ms of calls for longer ones, where a "
        "call over 30 ms is timed once after its warm-up and estimate calls; "
        "`experiments/bench_corope_window.py`); the floor is the "
        "sin/cos floor on the pairs the window keeps (forward+backward: twice the forward's)."
        "\n\n" + markdown_table(rows, list(rows[0]))
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
