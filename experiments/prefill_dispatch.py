"""Which path ``rope_attention(impl="auto")`` should take for a causal prefill (``NQ < NK``).

A prefill that continues a KV cache can run the fused kernel or the separate path (the Triton
RoPE kernel, then SDPA with the bottom-right mask). This script times both, in one process, from
decoding (``NQ = 1``) to long prefills, forward and forward+backward, and prints which path
``fused_prefill_wins`` (the rule ``auto`` follows, with the Gluon forward where
``hopper_forward_takes``) picks next to the faster one. The fused kernel
does not split a program's key sweep, so it needs enough query tiles to fill the GPU; SDPA's
kernels split the keys when the queries are few.

    python experiments/prefill_dispatch.py --out experiments/results/prefill_dispatch_h100.md
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from experiments.results_io import environment, markdown_table, print_report  # noqa: E402
from experiments.timing import input_sets, time_ms  # noqa: E402
from fused_rope.attention import fused_prefill_wins, rope_attention  # noqa: E402
from fused_rope.attention_forward import hopper_forward_takes  # noqa: E402

# (B, HQ, HKV, D) and the key lengths each is measured at
HEADS = [
    ((1, 32, 8, 128), (4096, 16384)),
    ((8, 32, 8, 128), (4096,)),
    ((4, 8, 8, 64), (4096, 16384)),
]
QUERIES = (1, 16, 64, 128, 256, 512, 1024)


def time_paths(B: int, HQ: int, HKV: int, D: int, NQ: int, NK: int, dtype) -> dict:
    """Median GPU ms of the fused and the separate path, forward and forward+backward, for
    ``q [B, HQ, NQ, D]``, ``k, v [B, HKV, NK, D]``, cycling through enough input copies to
    defeat L2."""
    size = (B * HQ * NQ + 2 * B * HKV * NK) * D * dtype.itemsize
    n_sets = input_sets(size, torch.device("cuda"))
    sets = [
        (torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype, requires_grad=True),
         *(torch.randn(B, HKV, NK, D, device="cuda", dtype=dtype, requires_grad=True)
           for _ in range(2)))
        for _ in range(n_sets)
    ]  # fmt: skip
    grads = [t for s in sets for t in s]
    do = torch.randn(B, HQ, NQ, D, device="cuda", dtype=dtype)
    row = {}
    for impl, mode in itertools.product(("fused", "separate"), ("fwd", "fwd+bwd")):
        if mode == "fwd":
            calls = [lambda a=a, i=impl: rope_attention(*(t.detach() for t in a), impl=i)
                     for a in sets]  # fmt: skip
        else:
            calls = [lambda a=a, i=impl: rope_attention(*a, impl=i).backward(do) for a in sets]
        cycle = itertools.cycle(calls)
        row[f"{impl} {mode}"] = time_ms(lambda c=cycle: next(c)(), grad_to_none=grads, rep_ms=60)[0]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="markdown file to write the table to")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_dispatch.py times GPU kernels; no CUDA device here")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for (B, HQ, HKV, D), nks in HEADS:
        for NK, NQ in itertools.product(nks, QUERIES):
            t = time_paths(B, HQ, HKV, D, NQ, NK, torch.float16)
            row = {"B, HQ/HKV, D": f"{B}, {HQ}/{HKV}, {D}", "NK": NK, "NQ": NQ}
            for mode in ("fwd", "fwd+bwd"):
                fused, separate = t[f"fused {mode}"], t[f"separate {mode}"]
                row[f"{mode} fused"] = f"{fused:.4f}"
                row[f"{mode} separate"] = f"{separate:.4f}"
                row[f"{mode} fused / separate"] = f"{fused / separate:.2f}"
            q = torch.empty(B, HQ, NQ, D, device="cuda", dtype=torch.float16)
            k = torch.empty(B, HKV, NK, D, device="cuda", dtype=torch.float16)
            gluon = hopper_forward_takes(q, k, D, False, D**-0.5)
            wins = fused_prefill_wins(B, HQ, NQ, sms, D, gluon)
            row["auto takes"] = "fused" if wins else "separate"
            rows.append(row)
            print(row, flush=True)
    env = environment()
    text = (
        f"# Prefills: the fused kernel against the separate path\n\n{env['gpu']} ({sms} SMs), "
        f"torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, {env['date']}; "
        'fp16, causal, NQ < NK; ms: median GPU time (CUDA graph). "auto takes": '
        "`fused_prefill_wins`. Written by `experiments/prefill_dispatch.py`.\n\n"
        + markdown_table(rows, list(rows[0]))
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
