"""Which path ``rope_attention(impl="auto")`` should take under deterministic algorithms.

``torch.use_deterministic_algorithms(True)`` (the harness's ``train.deterministic=true``) makes
SDPA leave cuDNN's attention, whose backward is not deterministic: the separate path (the Triton
RoPE kernel, then SDPA) then runs another backend. The fused kernel is deterministic either way
(its backward has a dK/dV pass and a dQ pass, no atomic adds). This script times both paths and
SDPA without RoPE, in one process, with the switch off and on, forward and forward+backward, at
``bench_rope_attention.py``'s square shapes and the harness's ``experiment=speed`` shape, and
prints each mode's faster path next to the one ``auto`` takes.

    python experiments/deterministic_dispatch.py --out experiments/results/deterministic_dispatch_h200.md
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
from fused_rope.attention import rope_attention  # noqa: E402
from fused_rope.sdpa import sdpa_attention  # noqa: E402
from lm.determinism import deterministic_algorithms  # noqa: E402

# name -> (B, HQ, HKV, N, D): bench_rope_attention.py's square shapes, and the harness's
# experiment=speed model (8 heads over 2 KV heads of 64 channels) at 2K tokens, batch 16
SHAPES = {
    "Small-1K": (4, 8, 8, 1024, 64),
    "Llama7B-2K": (2, 32, 32, 2048, 128),
    "Llama7B-4K": (2, 32, 32, 4096, 128),
    "Long-16K": (1, 8, 8, 16384, 128),
    "GQA-4K": (2, 32, 8, 4096, 128),
    "speed-2K": (16, 8, 2, 2048, 64),
}
PATHS = ("fused", "separate", "sdpa_no_rope")


def leaves(B: int, HQ: int, HKV: int, N: int, D: int, dtype, projected: bool):
    """Random tensors requiring grad: ``q [B, HQ, N, D]``, ``k, v [B, HKV, N, D]``; or, with
    ``projected``, the harness's projection outputs ``[B, N, HQ, D]`` and ``[B, N, 2, HKV,
    D]`` (``lm.attention``), which ``qkv`` views as q, k and v."""
    like = dict(device="cuda", dtype=dtype, requires_grad=True)
    if projected:
        return torch.randn(B, N, HQ, D, **like), torch.randn(B, N, 2, HKV, D, **like)
    return tuple(torch.randn(B, h, N, D, **like) for h in (HQ, HKV, HKV))


def qkv(tensors, projected: bool):
    """q, k, v of ``leaves``' tensors: themselves, or the harness's strided views."""
    if not projected:
        return tensors
    q, kv = tensors
    return (q.transpose(1, 2), *kv.permute(2, 0, 3, 1, 4).unbind(0))


def time_paths(B: int, HQ: int, HKV: int, N: int, D: int, dtype, on: bool,
               projected: bool = False) -> dict:  # fmt: skip
    """Median GPU ms of each path, forward and forward+backward, causal, for ``q [B, HQ, N,
    D]``, ``k, v [B, HKV, N, D]`` (``projected``: strided views, as the harness passes them),
    cycling through enough input copies to defeat L2."""
    size = (B * HQ + 2 * B * HKV) * N * D * dtype.itemsize
    sets = [
        leaves(B, HQ, HKV, N, D, dtype, projected)
        for _ in range(input_sets(size, torch.device("cuda")))
    ]
    grads = [t for s in sets for t in s]
    do = torch.randn(B, HQ, N, D, device="cuda", dtype=dtype)
    run = {
        "fused": lambda q, k, v: rope_attention(q, k, v, impl="fused"),
        "separate": lambda q, k, v: rope_attention(q, k, v, impl="separate"),
        "sdpa_no_rope": lambda q, k, v: sdpa_attention(q, k, v),
    }
    row = {}
    with deterministic_algorithms(on):
        row["auto takes"] = _auto_path(qkv(sets[0], projected))
        for path, mode in itertools.product(PATHS, ("fwd", "fwd+bwd")):
            if mode == "fwd":
                calls = [lambda a=a, f=run[path]: f(*qkv([t.detach() for t in a], projected))
                         for a in sets]  # fmt: skip
            else:
                calls = [lambda a=a, f=run[path]: f(*qkv(a, projected)).backward(do)
                         for a in sets]  # fmt: skip
            cycle = itertools.cycle(calls)
            row[f"{path} {mode}"] = time_ms(
                lambda c=cycle: next(c)(), grad_to_none=grads, rep_ms=60
            )[0]
    return row


def _auto_path(inputs) -> str:
    """The path ``impl="auto"`` takes for these inputs now (it resolves ``auto`` in its input
    checks; called with q, k, v only, as the timed calls are)."""
    from fused_rope.attention import _check_inputs

    q, k, v = inputs
    return _check_inputs(
        q, k, v, theta=10000.0, inv_freq=None, positions=None, q_positions=None, angles=None,
        q_angles=None, causal=True, softmax_scale=None, attention_factor=1.0, layout="half",
        rope_dim=None, return_lse=False, impl="auto", window=None,
    )[1]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="markdown file to write the table to")
    ap.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument(
        "--projected",
        action="store_true",
        help="q, k, v as strided views of projection outputs, as the harness passes them",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("deterministic_dispatch.py times GPU kernels; no CUDA device here")
    rows = []
    for name, dtype, on in itertools.product(
        args.shapes, (torch.float16, torch.bfloat16), (False, True)
    ):
        B, HQ, HKV, N, D = SHAPES[name]
        t = time_paths(B, HQ, HKV, N, D, dtype, on, args.projected)
        row = {
            "shape (B, HQ/HKV, N, D)": f"{name} ({B}, {HQ}/{HKV}, {N}, {D})",
            "dtype": str(dtype).removeprefix("torch."),
            "deterministic": on,
        }
        for mode in ("fwd", "fwd+bwd"):
            fused, separate = t[f"fused {mode}"], t[f"separate {mode}"]
            row[f"{mode} fused"] = f"{fused:.4f}"
            row[f"{mode} separate"] = f"{separate:.4f}"
            row[f"{mode} sdpa_no_rope"] = f"{t[f'sdpa_no_rope {mode}']:.4f}"
            row[f"{mode} faster"] = "fused" if fused < separate else "separate"
        row["auto takes"] = t["auto takes"]
        rows.append(row)
        print(row, flush=True)
    env = environment()
    layout = "strided views of projections (`lm.attention`)" if args.projected else "contiguous"
    text = (
        "# rope_attention's paths with deterministic algorithms off and on\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
        f"{env['date']}; causal, NQ = NK; q, k, v {layout}; ms: median GPU time (CUDA "
        "graph). `deterministic`: "
        "`torch.use_deterministic_algorithms(True)` (strict) with "
        "`CUBLAS_WORKSPACE_CONFIG=:4096:8`. `separate`: the Triton RoPE kernel, then SDPA; "
        "`sdpa_no_rope`: SDPA alone. Written by `experiments/deterministic_dispatch.py`.\n\n"
        + markdown_table(rows, list(rows[0]))
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
