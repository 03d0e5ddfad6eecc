"""Which ``scaled_dot_product_attention`` backend is the floor of issue 5's benchmark.

``bench_rope_attention.py`` measures ``rope_attention`` against SDPA without RoPE as PyTorch
dispatches it. This script times that default next to each backend forced with
``torch.nn.attention.sdpa_kernel`` (flash, cuDNN, memory-efficient), causal, on the benchmark's
shapes (a prefill's mask at the bottom right, as the benchmark's floor), forward and forward+backward, fp16 and bf16, and says which backend the
default ran (the one whose output it matches bit for bit). The default's times are the floor a
fused RoPE attention kernel has to meet.

    python experiments/sdpa_backends.py --out experiments/results/sdpa_backends_h100.md  # GPU
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from experiments.bench_rope_attention import (  # noqa: E402
    DTYPES,
    SHAPES,
    causal_flops,
    sdpa_causal,
)
from experiments.results_io import environment, markdown_table, print_report  # noqa: E402
from experiments.timing import input_sets, time_ms  # noqa: E402

BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def attention(backend):
    """The benchmark's floor (``bench_rope_attention.sdpa_causal``: causal, the mask at the
    bottom right) of ``q [B, HQ, NQ, D]``, ``k, v [B, HKV, NK, D]`` on ``backend`` (None: the
    one PyTorch picks)."""

    def fn(q, k, v):
        if backend is None:
            return sdpa_causal(q, k, v)
        with sdpa_kernel([backend]):
            return sdpa_causal(q, k, v)

    return fn


def run_shape(name: str, shape, dtype_name: str, device: torch.device) -> list[dict]:
    """One row per backend for ``shape`` (``(B, HQ, HKV, NQ, NK, D)``, as ``SHAPES``; ``name``
    labels the rows) in ``dtype_name``: median GPU ms and TFLOPS forward and forward+backward
    (``experiments.timing.time_ms``: CUDA graphs over enough input copies to defeat L2), and on
    the default's row the backend it ran."""
    B, HQ, HKV, NQ, NK, D = shape
    dtype = DTYPES[dtype_name]
    n_sets = input_sets(B * (NQ * HQ + 2 * NK * HKV) * D * dtype.itemsize, device)
    sets = [
        tuple(torch.randn(B, h, n, D, device=device, dtype=dtype, requires_grad=True)
              for h, n in ((HQ, NQ), (HKV, NK), (HKV, NK)))
        for _ in range(n_sets)
    ]  # fmt: skip
    grads = [t for s in sets for t in s]
    do = torch.randn(B, HQ, NQ, D, device=device, dtype=dtype)
    fwd_flops = causal_flops(shape)
    rows, outputs = [], {}
    for backend_name, backend in BACKENDS.items():
        fn = attention(backend)
        row = dict(shape=name, dtype=dtype_name, backend=backend_name)
        try:
            with torch.no_grad():
                outputs[backend_name] = fn(*sets[0])
            for mode in ("fwd", "fwd+bwd"):
                if mode == "fwd":
                    calls = [lambda fn=fn, a=a: fn(*a) for a in sets]
                else:
                    calls = [lambda fn=fn, a=a: fn(*a).backward(do) for a in sets]
                cycle = itertools.cycle(calls)
                with torch.set_grad_enabled(mode != "fwd"):
                    ms = time_ms(lambda c=cycle: next(c)(), grad_to_none=grads, rep_ms=60)[0]
                for t in grads:
                    t.grad = None
                flops = fwd_flops if mode == "fwd" else 3.5 * fwd_flops
                row[f"{mode}_ms"] = f"{ms:.4f}"
                row[f"{mode}_tflops"] = f"{flops / ms / 1e9:.0f}"
        except RuntimeError as e:  # a backend that does not take this shape
            row["note"] = f"not available: {str(e).splitlines()[0][:80]}"
        rows.append(row)
    default = outputs.get("default")
    if default is not None:
        same = [b for b, o in outputs.items() if b != "default" and torch.equal(o, default)]
        rows[0]["note"] = "ran: " + (", ".join(same) if same else "none of the forced backends")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", type=Path, help="markdown file to write the table to")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sdpa_backends.py times GPU attention; no CUDA device here")
    device = torch.device("cuda")
    env = environment()
    rows = []
    for name in args.shapes:
        for dtype_name in DTYPES:
            rows += run_shape(name, SHAPES[name], dtype_name, device)
            print(rows[-len(BACKENDS)], flush=True)
    columns = ["shape", "dtype", "backend", "fwd_ms", "fwd_tflops", "fwd+bwd_ms",
               "fwd+bwd_tflops", "note"]  # fmt: skip
    text = (
        f"# SDPA backends, causal\n\n{env['gpu']}, torch {env['torch']}, cuDNN "
        f"{torch.backends.cudnn.version()}, commit {env['commit']}, {env['date']}. ms: median GPU "
        "time (CUDA graph). Written by `experiments/sdpa_backends.py`.\n\n"
        + markdown_table(rows, columns)
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
