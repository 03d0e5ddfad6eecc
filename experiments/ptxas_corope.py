"""Registers, spills and loop sizes of the Co-RoPE kernels, without a GPU.

Compiles a kernel of ``corope.forward`` or ``corope.backward`` for sm_90 (``triton.compile``
with the specialisation a real launch gets: 16-divisible pointers and strides, unit strides
as the constant 1) and runs Triton's bundled ``ptxas-blackwell -v`` on the PTX (the plain
``ptxas`` bundled with Triton is older than the PTX version it emits). With ``--loops`` it
also disassembles the cubin (``cuobjdump -sass``) and gives the instruction count of every
loop (a backward branch closes one), innermost loops being the short ones: the numbers
``corope/PERF_NOTES.md`` compares versions by. bf16, with the mileage; ``--leader mean``
compiles the mean leader (an fp32 ``qL`` in the backward: more shared memory). ``--mix``
prints each loop's instructions by opcode, those of the loops it holds left out (the forward
at one shape and config: which pipes a key tile keeps busy, ``corope/PERF_NOTES.md``
session 30).
The compiler is the ``triton`` on ``sys.path``: for the GPU image's version, install that
wheel with ``pip install --no-deps --target DIR`` and put ``DIR`` first on ``PYTHONPATH``.

    python experiments/ptxas_corope.py                          # forward, every (shape, config)
    python experiments/ptxas_corope.py --kernel backward --loops
    python experiments/ptxas_corope.py --kernel gate_tail
    python experiments/ptxas_corope.py --mix 4,128,128 32,64,168   # G,D,R and BLOCK_GM,BLOCK_N,cap
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, even from a CPU machine
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from corope import backward, forward  # noqa: E402

# Pointer arguments of the kernels and their element types (inputs bf16).
POINTERS = {
    **dict.fromkeys(("Q", "K", "V", "O", "DO", "QL", "QC"), "*bf16"),
    **dict.fromkeys(
        ("KC", "ANG", "W", "LSE", "DQ", "DQL", "DK_S", "DK_G", "DK_T", "DV", "TG"),
        "*fp32",
    ),
    "DW": "*fp64",
    **dict.fromkeys(("QP", "KP"), "*i64"),
    **dict.fromkeys(("LOCK", "LOCK_T"), "*i32"),
}
FLOATS = {"gate_scale", "qk_scale", "softmax_scale"}
# Strides that are 1 in a launch (Triton's launcher turns an int argument equal to 1 into the
# constant 1; leaving that out makes ptxas report spills that a real launch does not have).
# stride_lock is 1 outside the deterministic mode (one counter a group). The backward's fp32
# accumulators are stored positions-fastest, so their unit strides are along N.
UNIT_STRIDES = {
    "stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dod", "stride_ln",
    "stride_qld", "stride_dqn", "stride_dkn", "stride_lock",
}  # fmt: skip
# Integer arguments compiled as multiples of 16, as a launch at every benchmark shape has them
# (Triton's launcher specialises on it; the backward's vector atomic adds depend on N's).
DIVISIBLE_INTS = {"N", "NQ", "NK", "N_BUCKET"}
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# (G, D, R) shapes
SHAPES = [(4, 64, 64), (4, 128, 128), (1, 128, 128), (2, 128, 128), (8, 128, 128),
          (16, 128, 128), (4, 128, 64), (4, 256, 256)]  # fmt: skip


def compile_sm90(fn, consts: dict, warps: int, stages: int, leader: str = "first",
                 maxnreg: int | None = None):  # fmt: skip
    """``fn`` compiled for sm_90 with ``consts`` as its constexprs, the launch's ``warps``,
    ``stages`` (``num_stages``: it changes the shared memory and the registers) and register
    cap, and the launch's specialisation of the other arguments (the backward's ``QL`` is fp32
    for the mean leader)."""
    pointers = POINTERS | ({"QL": "*fp32"} if leader == "mean" else {})
    sig, attrs, consts = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in UNIT_STRIDES:
            sig[name], consts[name] = "constexpr", 1
        elif name in pointers:
            sig[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") or name in DIVISIBLE_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(fn, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg},
    )


def sass_of(kernel) -> tuple[str, str]:
    """(``ptxas -v``'s log, ``cuobjdump -sass``'s listing) of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run(
            [str(TOOLS / "ptxas-blackwell"), "-v", "--gpu-name", "sm_90a", str(ptx), "-o",
             str(cubin)],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
        sass = subprocess.run(
            [str(TOOLS / "cuobjdump"), "-sass", str(cubin)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return log, sass


def report(kernel, loops: bool) -> str:
    """``registers | stack B | spill st / ld B | shared B`` (and the loop sizes) of a compiled
    kernel; shared memory above sm_90's 232448 bytes a block fails at launch."""
    log, sass = sass_of(kernel)
    regs = re.search(r"Used (\d+) registers", log).group(1)
    stack = re.search(r"(\d+) bytes stack frame", log).group(1)
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
    row = f"{regs} | {stack} | {stores} / {loads} | {kernel.metadata.shared}"
    return row + (f" | {', '.join(loop_sizes(sass))}" if loops else "")


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, text)`` of every instruction of a ``cuobjdump -sass`` listing."""
    return [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]


def loop_spans(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """``(first, last)`` addresses of each loop, in code order: a branch to a lower address
    closes a loop from its target (not the closing self-loop, a trap)."""
    spans = []
    for at, text in code:
        branch = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < at:
            spans.append((int(branch.group(1), 16), at))
    return spans


def loop_sizes(sass: str) -> list[str]:
    """``instructions (spill loads and stores, barriers)`` of each loop of a ``cuobjdump -sass``
    listing, in code order, a loop's count including the loops it holds."""
    code = instructions(sass)
    sizes = []
    for lo, hi in loop_spans(code):
        body = [t for a, t in code if lo <= a <= hi]
        spills = sum(1 for t in body if re.search(r"\b(LDL|STL)\b", t))
        bars = sum(1 for t in body if re.search(r"\bBAR\b", t))
        sizes.append(f"{len(body)} ({spills}, {bars})")
    return sizes


def loop_mix(sass: str) -> list[Counter]:
    """Each loop's instructions by opcode (``MUFU``, ``FFMA``, ...; predicates and modifiers
    dropped), the instructions of the loops nested in it left out."""
    code = instructions(sass)
    spans = loop_spans(code)
    mixes = []
    for lo, hi in spans:
        inner = [s for s in spans if s != (lo, hi) and lo <= s[0] and s[1] <= hi]
        mixes.append(
            Counter(
                re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
                for at, text in code
                if lo <= at <= hi and not any(a <= at <= b for a, b in inner)
            )
        )
    return mixes


def forward_kernel(g: int, d: int, r: int, config, leader: str):
    """The forward compiled for sm_90 at ``(G, D, R) = (g, d, r)`` with an autotune
    ``config``."""
    consts = dict(G=g, G_PAD=g, HEAD_DIM=d, ROPE_DIM=r, HALF_PAD=forward.freq_pad(r),
                  LEADER_MEAN=leader == "mean", DOT_PRECISION="tf32", FAST_TRIG=True,
                  BLOCK_GM=config.kwargs["BLOCK_GM"], BLOCK_N=config.kwargs["BLOCK_N"])  # fmt: skip
    return compile_sm90(forward._corope_fwd_kernel.fn, consts, config.num_warps,
                        config.num_stages, maxnreg=config.maxnreg)  # fmt: skip


def config_tile(config) -> tuple[int, int, int, int]:
    """``(BLOCK_GM, BLOCK_N, warps, register cap)`` of a forward config (no cap: 255)."""
    kw = config.kwargs
    return kw["BLOCK_GM"], kw["BLOCK_N"], config.num_warps, config.maxnreg or 255


def forward_rows(loops: bool, leader: str):
    for g, d, r in SHAPES:
        for config in forward._configs():  # the autotuner's (not the interpreter's)
            kernel = forward_kernel(g, d, r, config, leader)
            yield f"{g}, {d}, {r}", config_tile(config), report(kernel, loops)


def print_mix(shape: str, tile: str, leader: str) -> None:
    """The forward's loops at ``shape`` ``"G,D,R"`` and the autotune config ``tile``
    ``"BLOCK_GM,BLOCK_N,cap"``, by opcode (``loop_mix``), innermost first, with the
    special-function (MUFU) share: a warp's MUFU holds its scheduler's pipe 8 clocks, so a
    loop whose MUFU are more than 1/8 of its instructions is bound by that pipe before issue."""
    g, d, r = (int(x) for x in shape.split(","))
    want = tuple(int(x) for x in tile.split(","))
    configs = [c for c in forward._configs() if config_tile(c)[:2] + config_tile(c)[3:] == want]
    if not configs:
        choices = sorted({config_tile(c)[:2] + config_tile(c)[3:] for c in forward._configs()})
        raise SystemExit(f"--mix: no forward config {want}; the list has {choices}")
    _, sass = sass_of(forward_kernel(g, d, r, configs[0], leader))
    print(f"forward, G, D, R = {shape}, config {config_tile(configs[0])}")
    for i, mix in enumerate(loop_mix(sass)):
        total, mufu = sum(mix.values()), mix["MUFU"]
        top = ", ".join(f"{op} {n}" for op, n in mix.most_common(16))
        print(f"loop {i}: {total} instructions, MUFU {mufu} (x8 = {8 * mufu} pipe clocks): {top}")


def backward_rows(loops: bool, tail: bool, leader: str):
    # The launches' first configurations; groups wider than backward.SLICE_HEADS run the same
    # kernel as G = SLICE_HEADS (one launch a slice), so they share its row ("4/8/16, ...").
    # The gate tail depends on neither the heads nor R: one row per tile and D.
    launches = {}
    for g, d, r in SHAPES:
        config = next(backward._launch_configs(g, d, torch.bfloat16))
        key = (config, d, r) if not tail else ((*config[:3], 1), d, d)
        launches.setdefault(key, []).append(g)
    for ((block_m, block_n, warps, heads), d, r), groups in launches.items():
        d_pad = max(16, triton.next_power_of_2(d))
        if tail:
            consts = dict(D=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n,
                          DETERMINISTIC=False, PREC="tf32x3")  # fmt: skip
            kernel = compile_sm90(
                backward._gate_tail_kernel, consts, warps, backward.SWEEP_NUM_STAGES, leader
            )
        else:
            dn = d - r
            consts = dict(G=heads, GP=triton.next_power_of_2(heads), D=d, D_PAD=d_pad, HALF=r // 2,
                          DN_PAD=max(64, triton.next_power_of_2(dn)) if dn else 0,
                          BLOCK_M=block_m, BLOCK_N=block_n, MILEAGE=True, DETERMINISTIC=False,
                          PREC="tf32x3", FAST_TRIG=True,
                          DK_PARTS=backward._dk_parts(block_m, warps),
                          PASS1_STAGES=backward._pass1_stages(r // 2),
                          FREQ_GRAD=False, HALF_P=triton.next_power_of_2(r // 2))  # fmt: skip
            kernel = compile_sm90(
                backward._corope_bwd_kernel, consts, warps, backward.SWEEP_NUM_STAGES, leader
            )
        yield (
            f"{'/'.join(map(str, sorted(set(groups))))}, {d}, {r}",
            (block_m, block_n, warps),
            report(kernel, loops),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("forward", "backward", "gate_tail"), default="forward")
    ap.add_argument("--loops", action="store_true", help="also the instructions of each loop")
    ap.add_argument("--leader", choices=("first", "mean"), default="first")
    ap.add_argument("--mix", nargs=2, metavar=("G,D,R", "BLOCK_GM,BLOCK_N,CAP"),
                    help="the forward's loops by opcode at one shape and config")  # fmt: skip
    args = ap.parse_args()
    if args.mix:
        print_mix(*args.mix, args.leader)
        return
    if args.kernel == "forward":
        rows = forward_rows(args.loops, args.leader)
        tile = "config (BLOCK_GM, BLOCK_N, warps, register cap)"
    else:
        rows = backward_rows(args.loops, args.kernel == "gate_tail", args.leader)
        tile = "tile (BLOCK_M, BLOCK_N, warps)"
    extra = " | loops: instructions (spill ld/st, barriers)" if args.loops else ""
    print(f"| G, D, R | {tile} | registers | stack B | spill st / ld B | shared B{extra} |")
    print("|---|---|---|---|---|---" + ("|---|" if args.loops else "|"))
    for shape, config, row in rows:
        print(f"| {shape} | {config} | {row} |", flush=True)


if __name__ == "__main__":
    main()
