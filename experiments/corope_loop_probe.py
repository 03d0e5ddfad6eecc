"""Is the Co-RoPE forward's frequency loop faster when written in Gluon? A probe, not a kernel.

``corope/README.md`` puts the forward at 2.05x its sin/cos floor and latency-bound, and says
the levers left need control of layouts (Gluon or CUDA). This script measures that claim on
the loop alone. Both versions do the forward's per-chunk work for every causal (query, key)
pair of ``(1, HKV, N)`` and every frequency, with the rest of the kernel left out (no gates,
no carry, no softmax, no P @ V):

    phase = ca[row, d] + loc[row, key] * w[d]       (loc: a stand-in for the in-tile mileage)
    kr    = (k1 cos + k2 sin, k2 cos - k1 sin)      rounded to bf16, pairs adjacent (2d + h)
    S    += kr @ q_row                              a batched tensor-core product per row

* ``triton``: the loop as ``corope/forward.py`` writes it (``tl.dot`` on a 3-D tile), the
  layouts left to the compiler.
* ``gluon``: the same loop with the layouts chosen: the key pairs are loaded straight into the
  product's A-operand layout (a thread holds the two halves of its pairs), sin/cos and the
  rotation run there, and the product takes the result with no layout conversion.

It prints each version's time next to the sin/cos floor (``2 pairs x R/2`` sin/cos at the
rate ``experiments/sincos_rate.py`` measured, 3.85e12/s on an H100) and writes a markdown
table. The full forward at (1, 32/8, 128), N = 16K takes 67-68 ms against the 32.7 ms floor
(4.2e12/s).

    python experiments/corope_loop_probe.py --n 16384 --out experiments/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from fused_rope._trig import cos_sin  # noqa: E402

ROWS = 8  # query rows a program (the forward's BLOCK_M at G = 4: 32 packed rows)
BLOCK_N = 64  # keys a tile
HP = 8  # heads padded to the product's N (the forward pads G = 4 to 4; mma_v2's N is 8)
FREQ_CHUNK = 8  # frequencies a product (K = 16 channels)
WARPS = 4


@gluon.jit
def _cos_sin(x):
    c = gl.inline_asm_elementwise(
        "cos.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
    )
    s = gl.inline_asm_elementwise(
        "sin.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
    )
    return c, s


@gluon.jit
def gluon_loop_kernel(KP, QC, CA, W, OUT, N, R_HALF: gl.constexpr, ROWS: gl.constexpr,
                      BLOCK_N: gl.constexpr, HP: gl.constexpr, FREQ_CHUNK: gl.constexpr):  # fmt: skip
    """KP fp32 [HKV, N, 2 R_HALF] (channel 2d + h), QC bf16 [HKV, N, HP, 2 R_HALF],
    CA fp32 [HKV, N, R_HALF], W fp32 [R_HALF], OUT fp32 [HKV, N, HP]."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    C16: gl.constexpr = 2 * FREQ_CHUNK
    n_rows = N // ROWS
    pid = gl.program_id(0)
    group = pid // n_rows
    m = n_rows - 1 - pid % n_rows  # longest sweeps first
    row0 = m * ROWS

    # [ROWS, BLOCK_N, C16] key pairs in the A layout, one address for every row (a warp's two
    # rows share the loaded registers)
    kr_ = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, A_L)))
    kj = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, A_L)))
    kc = gl.arange(0, C16, layout=gl.SliceLayout(0, gl.SliceLayout(1, A_L)))
    k_off = (
        gl.expand_dims(gl.expand_dims(kr_, 1), 2) * 0
        + gl.expand_dims(gl.expand_dims(kj, 0), 2) * (2 * R_HALF)
        + gl.expand_dims(gl.expand_dims(kc, 0), 1)
    )
    k_base = KP + group.to(gl.int64) * N * (2 * R_HALF)

    # [ROWS, C16, HP] queries in the B layout
    qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, B_L)))
    qk = gl.arange(0, C16, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_L)))
    qh = gl.arange(0, HP, layout=gl.SliceLayout(0, gl.SliceLayout(1, B_L)))
    q_off = (
        gl.expand_dims(gl.expand_dims(qr, 1), 2) * (HP * 2 * R_HALF)
        + gl.expand_dims(gl.expand_dims(qk, 0), 2)
        + gl.expand_dims(gl.expand_dims(qh, 0), 1) * (2 * R_HALF)
    )
    q_base = QC + (group.to(gl.int64) * N + row0) * (HP * 2 * R_HALF)

    acc = gl.zeros([ROWS, BLOCK_N, HP], gl.float32, MMA)
    n_tiles = (row0 + ROWS - 1) // BLOCK_N + 1
    for t in range(n_tiles):
        tile = n_tiles - 1 - t
        k_tile = k_base + tile * BLOCK_N * (2 * R_HALF)
        for c in range(R_HALF // FREQ_CHUNK):
            kp = gl.load(k_tile + k_off + c * C16)  # fp32 [ROWS, BLOCK_N, C16]
            k1, k2 = gl.split(gl.reshape(kp, [ROWS, BLOCK_N, FREQ_CHUNK, 2]))
            L8: gl.constexpr = k1.type.layout
            # the in-tile mileage's stand-in: [ROWS, BLOCK_N, 1]
            lr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L8)))
            lj = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, L8)))
            loc = (BLOCK_N - gl.expand_dims(lj, 0)).to(gl.float32) * 0.5 + gl.expand_dims(lr, 1).to(
                gl.float32
            ) * 0.01
            # the carry angles [ROWS, 1, FREQ_CHUNK] and the frequencies [1, 1, FREQ_CHUNK]
            cr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(1, L8)))
            cd = gl.arange(0, FREQ_CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(1, L8)))
            ca = gl.load(
                CA
                + (group.to(gl.int64) * N + row0 + gl.expand_dims(cr, 1)) * R_HALF
                + c * FREQ_CHUNK
                + gl.expand_dims(cd, 0)
            )
            wd = gl.arange(0, FREQ_CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(0, L8)))
            w = gl.load(W + c * FREQ_CHUNK + wd)
            phase = gl.expand_dims(ca, 1) + gl.expand_dims(loc, 2) * gl.expand_dims(
                gl.expand_dims(w, 0), 0
            )
            cs, sn = _cos_sin(phase)
            kr1 = (k1 * cs + k2 * sn).to(gl.bfloat16)
            kr2 = (k2 * cs - k1 * sn).to(gl.bfloat16)
            a = gl.reshape(gl.join(kr1, kr2), [ROWS, BLOCK_N, C16])
            a = gl.convert_layout(a, A_L, assert_trivial=True)
            b = gl.load(q_base + q_off + c * C16)
            acc = mma_v2(a, b, acc)
    tot = gl.sum(acc, axis=1)  # [ROWS, HP]
    orr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(1, MMA)))
    oh = gl.arange(0, HP, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
    gl.store(
        OUT + (group.to(gl.int64) * N + row0 + gl.expand_dims(orr, 1)) * HP + gl.expand_dims(oh, 0),
        tot,
    )


@triton.jit
def triton_loop_kernel(KP, QC, CA, W, OUT, N, R_HALF: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, HP: tl.constexpr, FREQ_CHUNK: tl.constexpr):  # fmt: skip
    """``gluon_loop_kernel``'s work with the layouts left to Triton."""
    C16: tl.constexpr = 2 * FREQ_CHUNK
    n_rows = N // ROWS
    pid = tl.program_id(0)
    group = pid // n_rows
    row0 = (n_rows - 1 - pid % n_rows) * ROWS
    rr = tl.arange(0, ROWS)
    jj = tl.arange(0, BLOCK_N)
    cc = tl.arange(0, C16)
    dd = tl.arange(0, FREQ_CHUNK)
    hh = tl.arange(0, HP)
    k_base = KP + group.to(tl.int64) * N * (2 * R_HALF)
    q_base = QC + (group.to(tl.int64) * N + row0) * (HP * 2 * R_HALF)
    q_off = (
        rr[:, None, None] * (HP * 2 * R_HALF) + cc[None, :, None] + hh[None, None, :] * (2 * R_HALF)
    )
    loc = (BLOCK_N - jj[None, :]).to(tl.float32) * 0.5 + rr[:, None].to(tl.float32) * 0.01
    acc = tl.zeros([ROWS, BLOCK_N, HP], tl.float32)
    n_tiles = (row0 + ROWS - 1) // BLOCK_N + 1
    for t in range(n_tiles):
        k_tile = k_base + (n_tiles - 1 - t) * BLOCK_N * (2 * R_HALF)
        for c in range(R_HALF // FREQ_CHUNK):
            kp = tl.load(k_tile + jj[:, None] * (2 * R_HALF) + c * C16 + cc[None, :])
            k1, k2 = tl.split(tl.reshape(kp, [BLOCK_N, FREQ_CHUNK, 2]))
            ca = tl.load(CA + (group.to(tl.int64) * N + row0 + rr[:, None]) * R_HALF
                         + c * FREQ_CHUNK + dd[None, :])  # fmt: skip
            w = tl.load(W + c * FREQ_CHUNK + dd)
            phase = ca[:, None, :] + loc[:, :, None] * w[None, None, :]
            cs, sn = cos_sin(phase, True)
            kr1 = (k1[None] * cs + k2[None] * sn).to(tl.bfloat16)
            kr2 = (k2[None] * cs - k1[None] * sn).to(tl.bfloat16)
            a = tl.reshape(tl.join(kr1, kr2), [ROWS, BLOCK_N, C16])
            acc = tl.dot(a, tl.load(q_base + q_off + c * C16), acc)
    tot = tl.sum(acc, axis=1)
    tl.store(OUT + (group.to(tl.int64) * N + row0 + rr[:, None]) * HP + hh[None, :], tot)


def make_inputs(hkv: int, n: int, r_half: int, device: str, seed: int = 0):
    """Random key pairs, queries, carry angles (a few radians) and RoPE frequencies."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    kp = torch.randn(hkv, n, 2 * r_half, generator=g).to(device)
    qc = torch.randn(hkv, n, HP, 2 * r_half, generator=g).to(device, torch.bfloat16)
    ca = (torch.rand(hkv, n, r_half, generator=g) * 6.28).to(device)
    w = (10000.0 ** (-torch.arange(r_half, dtype=torch.float64) / r_half)).float().to(device)
    return kp, qc, ca, w


def run(kernel, kp, qc, ca, w, rows: int = ROWS) -> torch.Tensor:
    """OUT fp32 [HKV, N, HP]: each row's scores summed over its keys' tiles and the tile."""
    hkv, n, c = kp.shape
    if n % rows or n % BLOCK_N:
        raise ValueError(f"N must be a multiple of {BLOCK_N}, got {n}")
    out = torch.empty(hkv, n, HP, device=kp.device)
    kernel[(hkv * (n // rows),)](
        kp, qc, ca, w, out, n, R_HALF=c // 2, ROWS=rows, BLOCK_N=BLOCK_N, HP=HP,
        FREQ_CHUNK=FREQ_CHUNK, num_warps=WARPS,
    )  # fmt: skip
    return out


def reference(kp, qc, ca, w, rows: int = ROWS) -> torch.Tensor:
    """The probe's sum in fp64 with the rotated keys rounded to bf16, as the kernel does."""
    hkv, n, c = kp.shape
    r_half = c // 2
    out = torch.zeros(hkv, n, HP, dtype=torch.float64)
    k1, k2 = kp.double().cpu().view(hkv, n, r_half, 2).unbind(-1)
    q = qc.double().cpu()  # [hkv, n, HP, c]
    j = torch.arange(BLOCK_N, dtype=torch.float64)
    for row in range(n):
        last = (row // rows * rows + rows - 1) // BLOCK_N
        keys = slice(0, (last + 1) * BLOCK_N)
        loc = (BLOCK_N - j).repeat(last + 1) * 0.5 + (row % rows) * 0.01  # [keys]
        ph = ca[:, row].double().cpu()[:, None, :] + loc[None, :, None] * w.double().cpu()
        cs, sn = torch.cos(ph), torch.sin(ph)
        a1, a2 = k1[:, keys] * cs + k2[:, keys] * sn, k2[:, keys] * cs - k1[:, keys] * sn
        kr = torch.stack((a1, a2), -1).flatten(-2).to(torch.bfloat16).double()  # [hkv, keys, c]
        out[:, row] = torch.einsum("gkc,ghc->gh", kr, q[:, row])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--sincos-rate", type=float, default=3.85e12)
    ap.add_argument("--forward", action="store_true", help="time corope_attention's forward too")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kernels = {"gluon": gluon_loop_kernel, "triton": triton_loop_kernel}
    kp, qc, ca, w = make_inputs(2, 256, 64, "cuda")
    for rows in args.rows:
        want = reference(kp, qc, ca, w, rows)
        for name, kernel in kernels.items():
            got = run(kernel, kp, qc, ca, w, rows).double().cpu()
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(f"{name}, rows={rows}: max error {err:.2e} of the largest sum")
            if err > 1e-3:
                raise SystemExit("the probe computes something else")
    kp, qc, ca, w = make_inputs(args.hkv, args.n, 64, "cuda")
    lines = [
        "| version | rows a program | ms | sin/cos floor ms | x floor |",
        "|---|---|---|---|---|",
    ]
    for rows in args.rows:
        n_pairs = args.hkv * sum(
            ((m * rows + rows - 1) // BLOCK_N + 1) * BLOCK_N * rows for m in range(args.n // rows)
        )
        floor_ms = n_pairs * 128 / args.sincos_rate * 1e3
        for name, kernel in kernels.items():
            ms = triton.testing.do_bench(
                lambda k=kernel, r=rows: run(k, kp, qc, ca, w, r),
                warmup=50,
                rep=300,
                return_mode="median",  # as every other script reports
            )
            lines.append(f"| {name} | {rows} | {ms:.2f} | {floor_ms:.2f} | {ms / floor_ms:.2f} |")
            print(lines[-1], flush=True)
    if args.forward:
        from corope import corope_attention

        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, 4 * args.hkv, args.n, 128, device="cuda", generator=gen)
        k = torch.randn(1, args.hkv, args.n, 128, device="cuda", generator=gen)
        q, k, v = q.bfloat16(), k.bfloat16(), torch.randn_like(k).bfloat16()
        floor_ms = args.hkv * args.n * (args.n + 1) / 2 * 128 / args.sincos_rate * 1e3
        with torch.no_grad():
            ms = triton.testing.do_bench(
                lambda: corope_attention(q, k, v), warmup=5, rep=500, return_mode="median"
            )
        lines.append(
            f"| corope_attention forward | - | {ms:.2f} | {floor_ms:.2f} | {ms / floor_ms:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "corope_loop_probe.md").write_text(text + "\n")


def compile_offline(kernel, rows: int = ROWS):
    """Compile for sm_90a here (no GPU) and print registers, spills and the loops' sizes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from experiments.ptxas_corope import report

    sig = {"KP": "*fp32", "QC": "*bf16", "CA": "*fp32", "W": "*fp32", "OUT": "*fp32", "N": "i32"}
    consts = dict(R_HALF=64, ROWS=rows, BLOCK_N=BLOCK_N, HP=HP, FREQ_CHUNK=FREQ_CHUNK)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    k = triton.compile(
        (GluonASTSource if kernel is gluon_loop_kernel else ASTSource)(kernel, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": WARPS},
    )
    print(report(k, loops=True))
    return k


if __name__ == "__main__":
    if "--offline" in sys.argv:
        for kernel in (gluon_loop_kernel, triton_loop_kernel):
            for rows in (4, 8, 16):
                print(kernel.__name__, rows, end=": ")
                compile_offline(kernel, rows)
    else:
        main()
