"""The Co-RoPE forward at each of its autotune configs, pinned, and at extra ones.

The autotuner reports only the config it keeps; this script times ``corope_fwd`` (bf16,
causal, first leader) under every config of ``corope.forward.FWD_CONFIGS`` and every
``--extra`` tile, one at a time (``pinned_config``), on the same inputs, and prints one
markdown table: time, the largest difference of ``o`` from the first config's (over its
largest value), and the sin/cos floor. ``--out DIR`` writes it to
``DIR/time_corope_configs_<label>.md``.

    python experiments/time_corope_configs.py --extra 32,32,168 16,32,128 --label h100
    python experiments/time_corope_configs.py --only-extra --extra 32,64,144 --cases 1,8,2,64,4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from corope import forward  # noqa: E402
from experiments.results_io import markdown_table  # noqa: E402
from experiments.time_corope import (  # noqa: E402
    CASES,
    describe_config,
    floor_ms,
    kernel_inputs,
    parse_case,
)


def parse_tile(text: str) -> triton.Config:
    """``"BLOCK_GM,BLOCK_N,REGISTERS[,WARPS]"`` (registers 0: no cap; 4 warps unless given) as
    a forward config."""
    try:
        gm, bn, regs, *warps = (int(x) for x in text.split(","))
        if len(warps) > 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a tile is BLOCK_GM,BLOCK_N,REGISTERS[,WARPS] (three or four integers), got {text!r}"
        ) from None
    return triton.Config(
        {"BLOCK_GM": gm, "BLOCK_N": bn}, num_warps=warps[0] if warps else 4, num_stages=1,
        maxnreg=regs or None,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", type=parse_case,
                    help="B,HQ,HKV,D,N tuples (default: time_corope's)")  # fmt: skip
    ap.add_argument("--extra", nargs="*", type=parse_tile, default=[],
                    help="more tiles, BLOCK_GM,BLOCK_N,REGISTERS[,WARPS] (0 registers: no cap)")  # fmt: skip
    ap.add_argument("--only-extra", action="store_true", help="skip the autotune list's configs")
    ap.add_argument("--label", default="current")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition budget")
    ap.add_argument("--out", type=Path, help="folder for time_corope_configs_<label>.md")
    args = ap.parse_args()
    if args.only_extra and not args.extra:
        ap.error("--only-extra needs --extra tiles")
    if not torch.cuda.is_available():
        raise SystemExit("time_corope_configs.py times GPU kernels; no CUDA device here")
    first = len(forward.FWD_CONFIGS)
    # pinned_config indexes this list, which is also the autotuner's: the extras leave it
    # when the runs are done.
    forward.FWD_CONFIGS.extend(args.extra)
    try:
        rows = time_configs(
            args, range(first if args.only_extra else 0, first + len(args.extra)), first
        )
    finally:
        del forward.FWD_CONFIGS[first:]
    text = (f"### forward configs, pinned: {args.label} ({torch.cuda.get_device_name()})\n\n"
            + markdown_table(rows, list(rows[0])))  # fmt: skip
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"time_corope_configs_{args.label}.md").write_text(text)


def time_configs(args: argparse.Namespace, indices: range, first: int) -> list[dict]:
    """One row per (case, config index): the forward's median time at that config, pinned."""
    import triton.testing

    cases = args.cases or CASES
    rows = []
    for B, HQ, HKV, D, N in cases:
        q, k, v, _, w, s = kernel_inputs(B, HQ, HKV, D, N)

        def run(q=q, k=k, v=v, w=w, s=s, D=D):
            return forward.corope_fwd(q, k, v, w, s, D, "first")

        reference = None
        for index in indices:
            with forward.pinned_config(index):
                o = run()[0].float()
                ms = triton.testing.do_bench(run, warmup=25, rep=args.rep_ms,
                                             return_mode="median")  # fmt: skip
            reference = o if reference is None else reference
            diff = ((o - reference).abs().max() / reference.abs().max()).item()
            rows.append({
                "shape": f"({B}, {HQ}/{HKV}, {D})", "N": N,
                "config": describe_config(forward.FWD_CONFIGS[index]),
                "extra": "yes" if index >= first else "",
                "fwd_ms": f"{ms:.3f}", "fwd/floor": f"{ms / floor_ms(B, HKV, N, D):.2f}",
                "max_rel_diff": f"{diff:.1e}",
            })  # fmt: skip
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
