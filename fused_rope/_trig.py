"""sin and cos inside the Triton kernels of this project.

``cos_sin`` is for arguments of at most a few tens of radians: with ``FAST`` the hardware's
approximations (one special-function instruction each; absolute error about 1e-6 at such
arguments), otherwise libm's accurate versions (the interpreter has only those).
``cos_sin_of_angle`` takes any fp32 angle (a RoPE angle ``position * inv_freq`` reaches a
million radians at long context): with ``FAST`` it first subtracts a multiple of 2 pi
(``reduce_angle``), so that the fast versions see a few radians at most; libm's reduce exactly
by themselves. ``fast_trig`` is the launchers' one choice between them.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fused_rope._validation import interpreting


def fast_trig(x: torch.Tensor) -> bool:
    """Whether a kernel whose inputs and outputs are ``x``'s dtype takes the hardware sin/cos
    (``FAST``): for fp16/bf16 on a GPU, where their ~1e-6 absolute error is far below the
    output's rounding. fp32 keeps libm's, and so does the interpreter (it has only those)."""
    return x.is_cuda and not interpreting() and x.dtype != torch.float32


INV_TWO_PI = tl.constexpr(0.15915494309189535)
# 2 pi split as HI + LO: HI = fp32(2 pi) and LO = fp32(2 pi - HI). For an integer k and an
# fp32 angle x with |x| < 2**24, fma(-k, HI, x) is exact: k * HI and x are multiples of 2**-21
# once |x| >= 4 (HI's last bit is 2**-21; below 4, k is 0 or 1 and x a multiple of 2**-22),
# and the difference is below 8 in magnitude, so it has at most 24 significant bits.
# Leaving out 2 pi - HI - LO (7e-15) costs k * 7e-15 radians: 1e-9 at a million radians.
TWO_PI_HI = tl.constexpr(6.2831854820251465)
TWO_PI_LO = tl.constexpr(-1.7484555314695172e-07)


@triton.jit
def cos_sin(x, FAST: tl.constexpr):
    """``(cos x, sin x)`` for fp32 ``x`` of at most a few tens of radians."""
    if FAST:
        return libdevice.fast_cosf(x), libdevice.fast_sinf(x)
    return tl.cos(x), tl.sin(x)


@triton.jit
def reduce_angle(x):
    """``x - 2 pi k`` (to about 2**-22 radians) for fp32 ``x``, ``|x| < 2**24``, with ``k`` the
    integer nearest the fp32 product ``x / 2 pi``: that product's rounding can put ``k`` one off
    for large ``x``, so the result lies within ``[-pi, pi]`` only up to that slack (at most 3.3
    in magnitude for ``|x| <= 1e6``, 4.6 near ``2**24``), where the fast sin/cos are still
    accurate to about 1e-6."""
    k = tl.floor(x * INV_TWO_PI + 0.5)
    # tl.fma, not `a * b + c`: the compiler need not contract the latter into the single
    # rounding that makes the first step exact. (The interpreter's fma wants tensor operands.)
    hi = tl.full(x.shape, -TWO_PI_HI, tl.float32)
    lo = tl.full(x.shape, -TWO_PI_LO, tl.float32)
    return tl.fma(k, lo, tl.fma(k, hi, x))


@triton.jit
def cos_sin_of_angle(x, FAST: tl.constexpr):
    """``(cos x, sin x)`` for any fp32 angle ``x`` (``|x| < 2**24`` with ``FAST``, which
    reduces it first with ``reduce_angle``)."""
    if FAST:
        x = reduce_angle(x)
    return cos_sin(x, FAST)


__all__ = ["cos_sin", "cos_sin_of_angle", "fast_trig", "reduce_angle"]
