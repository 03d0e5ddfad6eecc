"""The order in which the fused attention kernels launch their programs: A/B in one process.

Each fused kernel (the Gluon and Triton forwards, the Triton backward's dK/dV and dQ passes)
runs one program per (tile, head). Until session 61 the grid's tiles were fastest: every tile
of head 0 (the longest causal sweep first), then head 1, ... so the longest sweeps of the last
heads launched last and ran alone at the end. Now (``_sectioned_program``) the heads are
fastest within sections of ``heads_per_section`` heads whose streamed K and V (or Q and dO) fit
in ``L2_SECTION_BYTES``: every head's longest sweep launches before any shorter one. The orders,
set through ``L2_SECTION_BYTES``, which the launchers read at every call:

* ``tiles fastest``: sections of one head, the order before session 61;
* ``sections``: the package's budgets (8 MiB for the query-major kernels, 32 MiB for dK/dV);
* ``sections of M MiB``: M MiB for both (``--section-mib``);
* ``one section``: every head in one section (the heads fastest, no regard for L2).

Timed for each order, causal, default positions (ms = median GPU time of a CUDA graph,
``experiments/timing.py``): ``fused fwd`` (inference, ``impl="fused"``: the Gluon forward where
``hopper_forward_takes`` holds, from 1K keys here: ``HOPPER_MIN_N`` is lowered for the run),
``Triton fwd`` (the same with ``GLUON_ENABLED = False``), ``fused fwd+bwd`` (the forward and the
Triton backward, random cotangent); and once, the floor of issue 5: SDPA without RoPE, forward
and forward+backward. Each order retunes the Triton kernels (their autotune caches are cleared).

    python experiments/time_grid_order.py --out experiments/results/time_grid_order_h200.md
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.results_io import environment, markdown_table, print_report  # noqa: E402
from experiments.timing import time_ms  # noqa: E402
from fused_rope import _attention_common, attention_forward, rope_attention  # noqa: E402
from fused_rope.attention import _AUTOTUNED  # noqa: E402

SHAPES = {  # name: (B, HQ, HKV, N, D); issue 5's table, then lengths and heads around it
    "Small-1K": (4, 8, 8, 1024, 64),
    "Llama7B-2K": (2, 32, 32, 2048, 128),
    "Llama7B-4K": (2, 32, 32, 4096, 128),
    "Long-16K": (1, 8, 8, 16384, 128),
    "GQA-4K": (2, 32, 8, 4096, 128),
    "2K-1": (2, 32, 32, 2047, 128),
    "GQA-8K": (1, 32, 8, 8192, 128),
    "D256-4K": (2, 16, 8, 4096, 256),
}


def _orders(section_mib: list[int]) -> dict:
    """``{name: L2_SECTION_BYTES}`` of the orders timed: ``section_mib`` budgets that both
    axes take, after the package's own."""
    both = lambda budget: {"query": budget, "key": budget}
    sections = {f"sections of {mib} MiB": both(mib * 2**20) for mib in section_mib}
    return {
        "tiles fastest": both(0),
        "sections": dict(_attention_common.L2_SECTION_BYTES),
        **sections,
        "one section": both(2**40),  # more heads a section than any grid has
    }


@contextlib.contextmanager
def _order(budgets: dict):
    """The launchers' grid order for the block, the Triton kernels retuned under it."""
    saved = _attention_common.L2_SECTION_BYTES
    _attention_common.L2_SECTION_BYTES = budgets
    for kernel, _ in _AUTOTUNED:
        kernel.cache = {}
    try:
        yield
    finally:
        _attention_common.L2_SECTION_BYTES = saved


@contextlib.contextmanager
def _gluon(enabled: bool):
    """The Gluon forward on or off, and taking calls from 1K keys."""
    saved = attention_forward.GLUON_ENABLED, attention_forward.HOPPER_MIN_N
    attention_forward.GLUON_ENABLED, attention_forward.HOPPER_MIN_N = enabled, 1024
    try:
        yield
    finally:
        attention_forward.GLUON_ENABLED, attention_forward.HOPPER_MIN_N = saved


def _fused(gluon: bool):
    """``rope_attention(impl="fused")`` with the Gluon forward on or off."""

    def attend(q, k, v):
        with _gluon(gluon):
            return rope_attention(q, k, v, impl="fused")

    return attend


def _inference(fn, q, k, v):
    def run():
        with torch.no_grad():
            return fn(q, k, v)

    return run


def _training(fn, q, k, v, do):
    """``fn``'s forward and backward, and the inputs whose gradients to drop between calls."""

    def run():
        fn(q, k, v).backward(do)

    return run, [q, k, v]


def _sdpa(q, k, v):
    gqa = q.shape[1] != k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument(
        "--section-mib",
        nargs="*",
        type=int,
        default=[],
        help="more section budgets to time, MiB (both axes)",
    )
    parser.add_argument("--out", type=Path, default=None, help="markdown report to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("a CUDA GPU is needed")
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.shapes:
        b, hq, hkv, n, d = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, hq, n, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, generator=gen)
                for _ in range(2))  # fmt: skip
        do = torch.randn_like(q)
        label = f"{name} ({b},{hq}/{hkv},{n},{d})"
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        floor_fwd = time_ms(_inference(_sdpa, q, k, v))[0]
        train, grads = _training(_sdpa, q, k, v, do)
        floor_train = time_ms(train, grad_to_none=grads)[0]
        floors = {"fwd": floor_fwd, "fwd+bwd": floor_train}
        for pass_, ms in floors.items():
            rows.append({"shape": label, "order": "-", "provider": f"sdpa {pass_}, no RoPE",
                         "ms": ms, "x_floor": 1.0})  # fmt: skip
        for order, budget in _orders(args.section_mib).items():
            with _order(budget):
                train, grads = _training(_fused(True), q, k, v, do)
                times = {
                    "fused fwd": (time_ms(_inference(_fused(True), q, k, v))[0], "fwd"),
                    "Triton fwd": (time_ms(_inference(_fused(False), q, k, v))[0], "fwd"),
                    "fused fwd+bwd": (time_ms(train, grad_to_none=grads)[0], "fwd+bwd"),
                }
            for provider, (ms, pass_) in times.items():
                rows.append({"shape": label, "order": order, "provider": provider, "ms": ms,
                             "x_floor": ms / floors[pass_]})  # fmt: skip
            print(f"{label} {order}: " + ", ".join(f"{p} {t:.4f}" for p, (t, _) in times.items()),
                  flush=True)  # fmt: skip
    env = environment()
    text = (
        "# The fused kernels' grid order: tiles fastest, sections of heads, one section\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
        f"{args.dtype}; causal, ms = median GPU time (CUDA graph), x_floor = ms / SDPA without "
        "RoPE in the same pass.\n\n"
        + markdown_table(rows, ["shape", "order", "provider", "ms", "x_floor"])
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
