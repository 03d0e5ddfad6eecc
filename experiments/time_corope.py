"""Quick timing of the Co-RoPE-GQA kernels alone (``corope_fwd``, ``corope_bwd``), bf16, causal.

The speed-work companion of ``bench_corope.py`` (which times every provider and writes the
shared CSV): this one launches the two kernels directly, with ``triton.testing.do_bench``
medians, for the shapes of issue 3, and prints one markdown table with the sin/cos floor
(``shared/docs/corope.md``). To compare two versions of the kernels in one GPU session, run
it once per version with ``PYTHONPATH`` pointing at each copy of the ``corope`` package and a
different ``--label``; ``--out DIR`` also writes the table to ``DIR/time_corope_<label>.md``.

    python experiments/time_corope.py --label after --out /tmp/t
    python experiments/time_corope.py --cases 1,8,2,64,4096 --label quick
    python experiments/time_corope.py --key-tiles 1 2 4 1000000   # backward split sweep
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import corope  # noqa: E402
import corope.backward  # noqa: E402
import corope.forward  # noqa: E402
from corope.backward import _key_tiles_per_program, corope_bwd  # noqa: E402
from corope.forward import corope_fwd  # noqa: E402
from corope.naive import corope_inv_freq  # noqa: E402
from experiments.results_io import markdown_table  # noqa: E402

SINCOS_PER_S = 4.2e12
# (B, HQ, HKV, D, N): the task's table shape and issue 3's target shape.
CASES = [
    (1, 8, 2, 64, 4096),
    (1, 8, 2, 64, 16384),
    (1, 32, 8, 128, 1024),
    (1, 32, 8, 128, 16384),
]


def floor_ms(B: int, HKV: int, N: int, R: int) -> float:
    """Forward special-function floor: one sin and one cos per causal pair, group, frequency."""
    return 2 * B * HKV * (N * N / 2) * (R / 2) / SINCOS_PER_S * 1e3


def time_case(B: int, HQ: int, HKV: int, D: int, N: int, rep_ms: int, key_tiles=()) -> dict:
    import triton.testing

    dev = torch.device("cuda")
    q = torch.randn(B, HQ, N, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    w = corope_inv_freq(D, 10000.0, None, dev)
    s = D**-0.5

    def fwd():
        return corope_fwd(q, k, v, w, s, D, "first")

    o, lse = fwd()

    def bwd(tiles=None):
        return corope_bwd(do, q, k, v, o, lse, w, s, D, "first", False,
                          key_tiles_per_program=tiles)  # fmt: skip

    t_f = triton.testing.do_bench(fwd, warmup=25, rep=rep_ms, return_mode="median")
    t_b = triton.testing.do_bench(bwd, warmup=25, rep=rep_ms, return_mode="median")
    fl = floor_ms(B, HKV, N, D)
    best = getattr(corope.forward._corope_fwd_kernel, "best_config", None)
    # The backward with the key sweep split into programs of `tiles` key tiles (the default
    # is corope.backward._key_tiles_per_program's choice; a large number means no split).
    split = {
        f"bwd_ms@{tiles}": "{:.3f}".format(
            triton.testing.do_bench(lambda t=tiles: bwd(t), warmup=25, rep=rep_ms,
                                    return_mode="median")
        )
        for tiles in key_tiles
    }  # fmt: skip
    # the tile the launcher fitted (its first choice unless shared memory was short)
    fitted = (torch.cuda.get_device_name(dev), HQ // HKV, D, D, q.dtype, "first", False, False)
    block_m, block_n, *_ = corope.backward._FITTED[("sweep", *fitted)]
    return {
        "shape": f"({B}, {HQ}/{HKV}, {D})",
        "N": N,
        "fwd_ms": f"{t_f:.3f}",
        "bwd_ms": f"{t_b:.3f}",
        "bwd_key_tiles": _key_tiles_per_program(B * HKV, N, block_m, block_n, dev),
        "fwd+bwd_ms": f"{t_f + t_b:.3f}",
        "floor_fwd_ms": f"{fl:.3f}",
        "fwd/floor": f"{t_f / fl:.2f}",
        "bwd/fwd": f"{t_b / t_f:.2f}",
        "fwd_config": "-"
        if best is None
        else (f"({best.kwargs['BLOCK_GM']}, {best.kwargs['BLOCK_N']}, {best.num_warps} warps)"),
    } | split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="current", help="name of the kernel version timed")
    ap.add_argument("--cases", nargs="*", help="B,HQ,HKV,D,N tuples (default: issue 3's)")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition budget")
    ap.add_argument("--out", type=Path, help="folder for time_corope_<label>.md")
    ap.add_argument(
        "--key-tiles",
        nargs="*",
        type=int,
        default=[],
        help="also time the backward at these key tiles per program (10**6: no split)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("time_corope.py times GPU kernels; no CUDA device here")
    cases = [tuple(int(x) for x in c.split(",")) for c in args.cases] if args.cases else CASES
    print(f"kernels from {Path(corope.__file__).parent} ({args.label})", flush=True)
    rows = []
    for case in cases:
        rows.append(time_case(*case, rep_ms=args.rep_ms, key_tiles=args.key_tiles))
        print(rows[-1], flush=True)
    text = f"### {args.label} ({torch.cuda.get_device_name()})\n\n" + markdown_table(
        rows, list(rows[0])
    )
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"time_corope_{args.label}.md").write_text(text)


if __name__ == "__main__":
    main()
