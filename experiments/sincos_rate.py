"""How many sin/cos pairs a second the GPU computes: special-function units against FMA pipes.

The Co-RoPE forward's floor (``shared/docs/corope.md``) counts one sin and one cos per
(query, key, frequency) at 16 a clock an SM. This script measures that rate where nothing
else limits it, and the rate of a polynomial sin/cos on the FMA pipes (``cos_sin_fma``
below), which could take part of the work off the special-function units; each kernel
evaluates ``ITERS`` phases per element and rotates a pair by them, as the forward's chunk
loop does (phase, sin/cos, two products of the rotation), and programs may alternate:

* ``sfu``: ``cos_sin`` (the hardware's fast approximations, as the kernels use them);
* ``fma``: ``cos_sin_fma`` (no special-function instruction);
* ``mix 1/P``: one program in ``P`` takes ``cos_sin_fma``, the others ``cos_sin``.

It prints (and with ``--out`` writes ``sincos_rate.md``) the time, sines and cosines a
second, the same a clock an SM at the 1.98 GHz of the floor's count (both counted, as the
floor counts them: its 16 a clock an SM), and each variant's largest error against fp64 (of
its fp32 sums over the phases, relative to the largest sum). Session 19 (``corope/PERF_NOTES.md``) has the H100's numbers and what they say.

    python experiments/sincos_rate.py --out experiments/results    # GPU (the interpreter: errors only, no rates)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the import of any Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from experiments.results_io import markdown_table  # noqa: E402
from fused_rope._trig import INV_TWO_PI, TWO_PI_HI, cos_sin  # noqa: E402

# cos_sin_fma: y = x - 2 pi k in [-pi, pi] (k = rint(x / 2 pi), by adding and subtracting
# 1.5 * 2**23), then polynomials in y for the half angle h = y / 2 (least squares on
# Chebyshev nodes of [-pi/2, pi/2]): S = sqrt2 sin h = y (sqrt2/2 + y^2 P(y^2)) and
# C = sqrt2 cos h = sqrt2 + y^2 Q(y^2), and the double angle sin y = S C, cos y = C^2 - 1
# (the sqrt2 in both makes each one instruction): 14 FMA-pipe instructions a pair, against
# the special-function path's 3 (one scaling multiply, two MUFU). Error: the sin polynomial
# ~1.5e-6 (near |y| = 1.2), the one-constant reduction about as much again at 80 radians
# (k * (2 pi - fp32(2 pi)) ~ 2e-6), 4e-6 at 134 (a 128-key tile's largest phase).
ROUND_MAGIC = tl.constexpr(12582912.0)
SQRT2 = tl.constexpr(1.4142135381698608)
HALF_SQRT2 = tl.constexpr(0.7071067690849304)
SIN_P = (-0.029460985213518143, 0.0003673432220239192, -2.0421484805410728e-06)
COS_Q = (-0.1767764538526535, 0.003682607552036643, -3.0616967706009746e-05,
         1.2810258454010182e-07)  # fmt: skip
P1, P2, P3 = (tl.constexpr(c) for c in SIN_P)
Q1, Q2, Q3, Q4 = (tl.constexpr(c) for c in COS_Q)


@triton.jit
def _full(x, c):
    """``c`` as a tensor like ``x`` (the interpreter's fma takes tensors only)."""
    return tl.full(x.shape, c, tl.float32)


@triton.jit
def cos_sin_fma(x):
    """``(cos x, sin x)`` for fp32 ``x`` up to about a hundred radians, FMA pipes only;
    absolute error below 3e-6 up to 80 radians, 4e-6 at 134."""
    k = tl.fma(x, _full(x, INV_TWO_PI), _full(x, ROUND_MAGIC)) - ROUND_MAGIC
    y = tl.fma(k, _full(x, -TWO_PI_HI), x)
    y2 = y * y
    p = tl.fma(tl.fma(y2, _full(x, P3), _full(x, P2)), y2, _full(x, P1))
    s = y * tl.fma(y2, p, _full(x, HALF_SQRT2))
    q = tl.fma(tl.fma(tl.fma(y2, _full(x, Q4), _full(x, Q3)), y2, _full(x, Q2)), y2, _full(x, Q1))
    c = tl.fma(y2, q, _full(x, SQRT2))
    return tl.fma(c, c, _full(x, -1.0)), s * c


@triton.jit
def _cos_sin_fma_kernel(X, C, S, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    c, s = cos_sin_fma(x)
    tl.store(C + offs, c, mask=offs < n)
    tl.store(S + offs, s, mask=offs < n)


def run_cos_sin_fma(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos_sin_fma`` of a 1-D fp32 tensor ``x`` (any length), as ``(cos x, sin x)``."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"x must be a 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    x = x.contiguous()  # the kernel reads it with unit stride
    c, s = torch.empty_like(x), torch.empty_like(x)
    _cos_sin_fma_kernel[(triton.cdiv(x.numel(), 1024),)](x, c, s, x.numel(), BLOCK=1024)
    return c, s


@triton.jit
def _rotations(x, ITERS: tl.constexpr, FMA: tl.constexpr, FAST: tl.constexpr):
    """``sum_t Rot(-(x + t / 100)) (x / 2, x / 4)``, both components added, for ``x``
    ``[BLOCK]`` fp32: per element and ``t`` a phase, a sin/cos and a rotation."""
    a1 = tl.zeros(x.shape, tl.float32)
    a2 = tl.zeros(x.shape, tl.float32)
    k1 = x * 0.5
    k2 = x * 0.25
    for t in range(ITERS):
        if FMA:
            c, s = cos_sin_fma(x + t * 0.01)
        else:
            c, s = cos_sin(x + t * 0.01, FAST)
        a1 += k1 * c + k2 * s
        a2 += k2 * c - k1 * s
    return a1 + a2


@triton.jit
def _rate_kernel(X, OUT, ITERS: tl.constexpr, PERIOD: tl.constexpr, BLOCK: tl.constexpr,
                 FAST: tl.constexpr):  # fmt: skip
    """Program ``p`` rotates ``X[p * BLOCK:][:BLOCK]`` into ``OUT``, by ``cos_sin_fma`` where
    ``p % PERIOD == 0`` (``PERIOD`` 1: every program; 0: none), else by ``cos_sin``."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    if PERIOD == 0:
        out = _rotations(x, ITERS, False, FAST)
    elif pid % PERIOD == 0:
        out = _rotations(x, ITERS, True, FAST)
    else:
        out = _rotations(x, ITERS, False, FAST)
    tl.store(OUT + offs, out)


def reference(x: torch.Tensor, iters: int) -> torch.Tensor:
    """What ``_rate_kernel`` computes, in fp64 from the kernel's fp32 phases (so that the
    error column holds the sin/cos error and the fp32 sums' rounding, not the phases')."""
    total = torch.zeros_like(x, dtype=torch.float64)
    for t in range(iters):
        phase = (x + torch.tensor(t * 0.01, dtype=torch.float32)).double()
        c, s = phase.cos(), phase.sin()
        x64 = x.double()
        total += (x64 / 2 * c + x64 / 4 * s) + (x64 / 4 * c - x64 / 2 * s)
    return total


CLOCK_HZ = 1.98e9  # the H100/H200 clock behind corope.md's floor (16 a clock an SM)
VARIANTS = [("sfu", 0), ("fma", 1), ("mix 1/4", 4), ("mix 1/8", 8), ("mix 1/16", 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for sincos_rate.md")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    # GPU: 64 programs an SM of 1024 elements, 2048 phases each (~10 ms a variant).
    block, iters, programs = (1024, 2048, 132 * 64) if gpu else (64, 4, 8)
    x = torch.rand(programs * block, device=dev) * 60
    # The error check on the first 16 programs (both kinds, in every mix), fp64 on the CPU.
    sample = slice(0, 16 * block)
    ref = reference(x[sample].cpu(), iters)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 1
    rows = []
    for name, period in VARIANTS:
        for warps in (4, 8):
            out = torch.empty_like(x)

            def run(out=out, period=period, warps=warps):
                _rate_kernel[(programs,)](x, out, ITERS=iters, PERIOD=period, BLOCK=block,
                                          FAST=gpu, num_warps=warps)  # fmt: skip

            run()
            err = ((out[sample].cpu().double() - ref).abs().max() / ref.abs().max()).item()
            ms = triton.testing.do_bench(run, warmup=10, rep=200, return_mode="median") if gpu \
                else float("nan")  # fmt: skip
            per_s = 2 * programs * block * iters / (ms * 1e-3)  # a sine and a cosine each
            rows.append({
                "variant": name, "warps": warps, "ms": f"{ms:.3f}",
                "sin_cos_per_s": f"{per_s:.3e}",
                "per_clock_per_sm_at_1.98GHz": f"{per_s / CLOCK_HZ / sms:.1f}",
                "max_rel_err_vs_fp64": f"{err:.1e}",
            })  # fmt: skip
            print(rows[-1], flush=True)
    device = torch.cuda.get_device_name() if gpu else "interpreter (CPU)"
    text = (
        f"# sin/cos rate ({device}, Triton {triton.__version__})\n\n"
        f"`python experiments/sincos_rate.py`: {programs} programs x {block} elements x "
        f"{iters} phases a program; median of `triton.testing.do_bench`.\n\n"
        + markdown_table(rows, list(rows[0]))
    )
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sincos_rate.md").write_text(text)


if __name__ == "__main__":
    main()
