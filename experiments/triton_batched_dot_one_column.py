"""Reproducer: a batched ``tl.dot`` whose right operand has one column comes out wrong.

The Co-RoPE forward (``corope/forward.py``) computes its rotary scores as one batched
tensor-core product per query row, ``[M, BLOCK_N, K] @ [M, K, HP] -> [M, BLOCK_N, HP]``
with ``HP`` the group's heads. With ``HP = 1`` (G = 1) it came out wrong on an H100 with
Triton 3.6 (o off by up to 2.6 where bf16 gives 1e-2; ``corope/PERF_NOTES.md``, session 12,
item 4), hence ``MIN_PRODUCT_HEADS = 2``. This script runs the same product shape alone,
accumulated over chunks of K as the forward does, for HP in 1, 2, 4, and prints each one's
error against an fp64 product. On the H100 (Triton 3.6) HP = 1 is off by ~1.6x the product's
largest value and HP = 2, 4 are exact to fp32 rounding; the interpreter gets all three right
(``experiments/results/triton_batched_dot_one_column_h100.md``).

    python experiments/triton_batched_dot_one_column.py        # GPU (or the interpreter)
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():  # must precede the import of any Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _batched_dot_kernel(A, B, C, CHUNKS: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
                        K: tl.constexpr, HP: tl.constexpr):  # fmt: skip
    """``C[m] = sum_c A[c, m] @ B[c, m]``: A ``[CHUNKS, M, N, K]``, B ``[CHUNKS, M, K, HP]``,
    C ``[M, N, HP]`` fp32, all contiguous; one program."""
    om = tl.arange(0, M)[:, None, None]
    on = tl.arange(0, N)[None, :, None]
    ok = tl.arange(0, K)[None, None, :]
    okb = tl.arange(0, K)[None, :, None]
    oh = tl.arange(0, HP)[None, None, :]
    acc = tl.zeros([M, N, HP], tl.float32)
    for c in tl.range(0, CHUNKS):
        a = tl.load(A + c * M * N * K + om * N * K + on * K + ok)
        b = tl.load(B + c * M * K * HP + om * K * HP + okb * HP + oh)
        acc = tl.dot(a, b, acc)
    tl.store(C + om * N * HP + on * HP + oh, acc)


def max_error(hp: int, dtype: torch.dtype, m: int, n: int, k: int, chunks: int, device) -> float:
    """Max-abs error of the kernel's product against fp64, relative to the product's max."""
    torch.manual_seed(0)
    a = torch.randn(chunks, m, n, k, device=device).to(dtype)
    b = torch.randn(chunks, m, k, hp, device=device).to(dtype)
    c = torch.empty(m, n, hp, device=device, dtype=torch.float32)
    _batched_dot_kernel[(1,)](a, b, c, chunks, m, n, k, hp, num_warps=4)
    ref = (a.double() @ b.double()).sum(0)
    return ((c.double() - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=32, help="batch (query rows)")
    parser.add_argument("--n", type=int, default=64, help="rows of A (keys)")
    parser.add_argument("--k", type=int, default=16, help="contraction (2 x 8 frequencies)")
    parser.add_argument("--chunks", type=int, default=8, help="products accumulated")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "interpreter"
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    dtypes = [torch.float32] if device.type == "cpu" else [torch.bfloat16, torch.float16]
    print("| dtype | HP | max-abs error / max |")
    print("|---|---|---|")
    for dtype in dtypes:
        for hp in (1, 2, 4):
            err = max_error(hp, dtype, args.m, args.n, args.k, args.chunks, device)
            print(f"| {str(dtype).removeprefix('torch.')} | {hp} | {err:.2e} |")


if __name__ == "__main__":
    main()
