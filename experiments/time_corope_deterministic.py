"""Co-RoPE's deterministic backward alone, A/B against other versions of the kernels (GPU, bf16).

For each case and kernel version (the checkout's, then each copy given with ``--versions``, loaded
as ``time_corope.py --versions`` loads them): the backward's ``do_bench`` median in the default
mode and in the deterministic mode (``corope_bwd(..., deterministic=True)``, what
``torch.use_deterministic_algorithms(True)`` selects), whether two deterministic calls give
bitwise equal dq, dk and dv, and how far they are from the checkout's (the largest difference
over the largest value: the fp32 adds of another order). Every version gets the same inputs and
the checkout's forward outputs. Prints a markdown table, and writes it to ``--out`` if given.

    python experiments/time_corope_deterministic.py --versions /tmp/v_old /tmp/v_new \
        --cases 1,8,2,64,4096 16,8,2,64,2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import corope.backward  # noqa: E402
import corope.forward  # noqa: E402
from experiments.time_corope import kernel_inputs, load_version, parse_case, rel_diff  # noqa: E402

CASES = [(1, 8, 2, 64, 4096), (1, 32, 8, 128, 1024), (16, 8, 2, 64, 2048), (1, 8, 2, 64, 16384)]


def time_case(case, versions, rep_ms: int) -> list[dict]:
    """One row per ``(label, backward module)`` of ``versions`` at ``case = (B, HQ, HKV, D, N)``."""
    import triton.testing

    B, HQ, HKV, D, N = case
    q, k, v, do, w, s = kernel_inputs(B, HQ, HKV, D, N)
    o, lse = corope.forward.corope_fwd(q, k, v, w, s, D, "first")
    rows, reference = [], None
    for label, module in versions:

        def bwd(deterministic, module=module):
            return module.corope_bwd(do, q, k, v, o, lse, w, s, D, "first", False, deterministic)

        first, second = bwd(True)[:3], bwd(True)[:3]
        reference = first if reference is None else reference
        t_default, t_ordered = (
            triton.testing.do_bench(lambda d=d: bwd(d), warmup=25, rep=rep_ms,
                                    return_mode="median")
            for d in (False, True)
        )  # fmt: skip
        rows.append(
            {
                "shape": f"({B}, {HQ}/{HKV}, {D})",
                "N": N,
                "version": label,
                "bwd_ms": f"{t_default:.3f}",
                "bwd_deterministic_ms": f"{t_ordered:.3f}",
                "deterministic/default": f"{t_ordered / t_default:.3f}",
                "repeats_bitwise": all(map(torch.equal, first, second)),
                "max_rel_diff": f"{rel_diff(reference, first):.1e}",
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", type=parse_case, default=CASES,
                    help="B,HQ,HKV,D,N each (default: the short shapes of issue 3 and the harness)")  # fmt: skip
    ap.add_argument("--versions", nargs="*", type=Path, default=[],
                    help="copies of the repository (or of its corope folder) to time beside it")  # fmt: skip
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition budget")
    ap.add_argument("--out", type=Path, help="markdown file for the table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("time_corope_deterministic.py needs a CUDA GPU")
    versions = [("checkout", corope.backward)]
    versions += [(str(root), load_version(root, i)[1]) for i, root in enumerate(args.versions)]
    rows = []
    for case in args.cases:
        rows += time_case(case, versions, args.rep_ms)
        torch.cuda.empty_cache()
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(str(x) for x in row.values()) + " |" for row in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(f"{torch.cuda.get_device_name()}, bf16, causal, ms\n\n{table}\n")


if __name__ == "__main__":
    main()
