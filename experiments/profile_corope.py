"""One warmed-up Co-RoPE forward and backward between ``cudaProfilerStart``/``Stop``, for ncu.

Autotuning and compilation run before the profiler starts, so ``ncu --profile-from-start off``
sees one launch of each Triton kernel (the forward, the backward's sweep and its gate tail) at
the configuration a real call uses, besides PyTorch's small copy and fill kernels of the two
launchers (``--kernel-name regex:_corope|_gate_tail`` leaves those out):

    ncu --profile-from-start off --clock-control none --set full --import-source yes \\
        -o /tmp/corope python experiments/profile_corope.py --case 1,32,8,128,4096
    ncu -i /tmp/corope.ncu-rep --page details          # stall reasons, issue rates, occupancy
    ncu -i /tmp/corope.ncu-rep --page source --csv --print-source sass   # stalls per instruction
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from corope.backward import corope_bwd  # noqa: E402
from corope.forward import corope_fwd  # noqa: E402
from experiments.time_corope import kernel_inputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="1,32,8,128,4096", help="B,HQ,HKV,D,N (bf16, causal)")
    ap.add_argument("--skip-backward", action="store_true", help="profile the forward only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_corope.py profiles GPU kernels; no CUDA device here")
    B, HQ, HKV, D, N = (int(x) for x in args.case.split(","))
    q, k, v, do, w, s = kernel_inputs(B, HQ, HKV, D, N)

    def step() -> None:
        o, lse = corope_fwd(q, k, v, w, s, D, "first")
        if not args.skip_backward:
            corope_bwd(do, q, k, v, o, lse, w, s, D, "first", False)

    step()  # compiles and autotunes outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one forward{'' if args.skip_backward else ' and backward'} at {args.case}")


if __name__ == "__main__":
    main()
