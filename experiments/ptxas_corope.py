"""Registers and spills of the Co-RoPE forward kernel per tile config, without a GPU.

Compiles ``corope.forward._corope_fwd_kernel`` for sm_90 (``triton.compile`` with the
specialisation a real launch gets: 16-divisible pointers and strides, unit strides as the
constant 1) and runs Triton's bundled ``ptxas-blackwell -v`` on the PTX (the plain ``ptxas``
bundled with Triton 3.6 is older than the PTX version it emits). bf16, first-head leader.

    python experiments/ptxas_corope.py            # prints one markdown row per (G, D, R, config)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, even from a CPU machine
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from corope.forward import _corope_fwd_kernel  # noqa: E402

# (G_PAD, D, R) and (BLOCK_GM, BLOCK_N, warps)
SHAPES = [(4, 64, 64), (4, 128, 128), (1, 128, 128), (2, 128, 128), (8, 128, 128),
          (16, 128, 128), (4, 128, 64), (4, 256, 256)]  # fmt: skip
CONFIGS = [(64, 64, 4), (64, 128, 4), (64, 128, 8)]
UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_tkn", "stride_ln"}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"


def resources(g_pad: int, d: int, r: int, block_gm: int, block_n: int, warps: int) -> str:
    fn = _corope_fwd_kernel.fn
    sig, attrs, consts = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ("Q", "K", "V", "O", "KT"):
            sig[name] = "*bf16"
        elif name in ("QT", "W", "LSE"):
            sig[name] = "*fp32"
        elif name in UNIT_STRIDES:
            sig[name], consts[name] = "constexpr", 1
            continue
        elif name.startswith("stride") or name in ("HKV", "N", "N_BUCKET"):
            sig[name] = "i32"
        elif name in ("gate_scale", "qk_scale"):
            sig[name] = "fp32"
        else:
            continue  # constexprs, below
        if sig[name].startswith("*") or name.startswith("stride") or name == "N_BUCKET":
            attrs[(i,)] = [["tt.divisibility", 16]]
    consts.update(G=g_pad, G_PAD=g_pad, HEAD_DIM=d, ROPE_DIM=r, LEADER_MEAN=False,
                  DOT_PRECISION="tf32", FAST_TRIG=True, BLOCK_GM=block_gm, BLOCK_N=block_n)  # fmt: skip
    sig.update({name: "constexpr" for name in consts})
    kernel = triton.compile(
        ASTSource(fn, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": 1},
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run(
            [str(PTXAS), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", log).group(1)
    stack = re.search(r"(\d+) bytes stack frame", log).group(1)
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
    return f"{regs} | {stack} | {stores} / {loads}"


def main() -> None:
    print(
        "| G_PAD, D, R | config (BLOCK_GM, BLOCK_N, warps) | registers | stack B | spill st / ld B |"
    )
    print("|---|---|---|---|---|")
    for g_pad, d, r in SHAPES:
        for cfg in CONFIGS:
            if cfg[0] < 8 * g_pad and g_pad <= 8:
                continue  # pruned by the autotuner (fewer than 8 query rows)
            row = resources(g_pad, d, r, *cfg)
            print(f"| {g_pad}, {d}, {r} | {cfg} | {row} |", flush=True)


if __name__ == "__main__":
    main()
