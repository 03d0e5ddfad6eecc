"""Benchmark: rotating q and k with RoPE, every provider in one process.

Providers: this project's Triton kernel (``fused_rope.rope.apply_rope_qk``, one launch, sin/cos from
fp32 angles in the kernel; ``triton(inv_freq)``: given ``inv_freq``, it also forms the angles of
positions 0..N-1); the eager Hugging Face rotation (``q * cos + rotate_half(q) * sin``
in the input dtype, cos/sin precomputed once as HF models do); ``torch.compile`` of that
rotation; Liger-Kernel's ``liger_rotary_pos_emb`` (row says "not installed" when missing; the
``liger-kernel`` wheel is pure Python, so a GPU machine without it takes it from the wheelhouse:
``python3 -m pip download --no-deps --only-binary=:all: -d .whl liger-kernel``).

Bandwidth counts the bytes that must move: q and k read once and written once (forward), and
twice that for forward+backward (the backward reads dq_out, dk_out and writes dq, dk). cos/sin
or angles are not counted (they are tiny next to q and k). The device-to-device copy bandwidth
(``dst.copy_(src)`` of 1 GiB, bytes read + written) is measured first, and every row reports its
percentage of it. Every provider's output is checked against the fp32 reference: a max-abs
error over ``experiments.results_io.ACC_TOL`` makes the row's note "ACC FAIL" and the verdict
FAIL. ``peak_mem_mib`` is the memory allocated during one call beyond what was
allocated before it (outputs, gradients and workspace).

    python experiments/bench_rope.py                       # GPU: writes experiments/results/
    python experiments/bench_rope.py --quick --out /tmp/r  # smoke run (CPU: the interpreter)
    python experiments/bench_rope.py --tune                # GPU: sweep the launch shape
    python experiments/bench_rope.py --tune --shapes B2-HQ32-HK8-N4096-D128  # one shape (~1 min)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the import of Triton (it reads it then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.plot_benchmarks import plot_op  # noqa: E402
from experiments.results_io import (  # noqa: E402
    accuracy_failed,
    accuracy_note,
    add_output_arguments,
    environment,
    gpu_suffix,
    markdown_table,
    merged_environment,
    quick_and_output,
    read_rows,
    upsert_rows,
)
from experiments.timing import input_sets, peak_extra_mib, time_ms  # noqa: E402
from fused_rope.frequencies import rope_angles, rope_frequencies  # noqa: E402
from fused_rope.rope import TileConfig, apply_rope_qk, rope_fwd, tile_config  # noqa: E402

OP = "rope_qk"
# (B, HQ, HK, N, D)
SHAPES = [(4, 8, 8, 1024, 64), (2, 32, 8, 4096, 128), (1, 8, 8, 16384, 128)]
LARGE = {(2, 32, 8, 4096, 128), (1, 8, 8, 16384, 128)}
QUICK_SHAPES = [(1, 2, 1, 64, 32)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("fwd", "fwd+bwd")
COPY_TARGET = 0.80


def shape_id(shape) -> str:
    B, HQ, HK, N, D = shape
    return f"B{B}-HQ{HQ}-HK{HK}-N{N}-D{D}"


def copy_bandwidth(device, quick: bool) -> tuple[float, float]:
    """(ms, GB/s) of a device-to-device copy, bytes read + written."""
    n = (1 << 20) if quick else (1 << 29)  # fp16 elements: 2 MiB or 1 GiB
    src = torch.randn(n, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), graph=False, rep_ms=20 if quick else 100)[0]
    return ms, 2 * src.numel() * src.element_size() / ms / 1e6


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb: cos/sin ``[1, 1, N, D]`` in the input dtype."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def providers(angles, inv_freq, cos, sin, device):
    """name -> (fn(q, k) -> (q_out, k_out)) or a string saying why it cannot run.
    ``triton(inv_freq)``: the same kernel forming the angles of positions 0..N-1 itself."""
    cos4, sin4 = cos[None, None], sin[None, None]
    out = {
        "triton": lambda q, k: apply_rope_qk(q, k, angles),
        "triton(inv_freq)": lambda q, k: apply_rope_qk(q, k, inv_freq=inv_freq),
        "eager": lambda q, k: hf_rope(q, k, cos4, sin4),
    }
    if device.type == "cuda":
        compiled = torch.compile(hf_rope, dynamic=False)
        out["torch.compile"] = lambda q, k: compiled(q, k, cos4, sin4)
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            out["liger"] = lambda q, k: liger_rotary_pos_emb(q, k, cos[None], sin[None])
        except ImportError:
            out["liger"] = "not installed"
    else:
        out["torch.compile"] = out["liger"] = "needs CUDA"
    return out


def inputs(shape, dtype, device):
    B, HQ, HK, N, D = shape
    q = torch.randn(B, HQ, N, D, device=device, dtype=dtype)
    k = torch.randn(B, HK, N, D, device=device, dtype=dtype)
    inv_freq = rope_frequencies(D)[0].to(device)
    angles = rope_angles(torch.arange(N, device=device), inv_freq)  # [N, D/2] fp32
    emb = torch.cat((angles, angles), dim=-1)  # HF's [N, D] table
    return q, k, angles, inv_freq, emb.cos().to(dtype), emb.sin().to(dtype)


def cycled_sets(q, k, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(q, k)`` and enough random copies that calls cycling through them defeat L2
    (``experiments.timing.input_sets``: what a call reads, q and k)."""
    n_sets = input_sets((q.numel() + k.numel()) * q.element_size(), device)
    return [(q, k)] + [(torch.randn_like(q), torch.randn_like(k)) for _ in range(n_sets - 1)]


def max_error(fn, q, k, angles) -> float:
    """Largest |out - fp32 reference| over q and k (sanity check of every provider)."""
    from fused_rope.naive import apply_rope_ref

    with torch.no_grad():
        outs = fn(q, k)
    return max(
        (o.float() - apply_rope_ref(x.float(), angles)).abs().max().item()
        for o, x in zip(outs, (q, k), strict=True)
    )


def run_case(shape, dtype_name, copy_gbps, env, device, quick) -> list[dict]:
    """Times every provider on ``shape``. ``ms`` is GPU time (a CUDA graph of many calls that
    cycle through enough input copies to defeat L2); the note adds the eager time per call
    (``do_bench``: Python, autograd and launch overhead included)."""
    dtype = DTYPES[dtype_name]
    q, k, angles, inv_freq, cos, sin = inputs(shape, dtype, device)
    torch._dynamo.reset()  # a fresh compile per case: no cache-size fallback to eager
    rows = []
    moved = 2 * (q.numel() + k.numel()) * q.element_size()
    sets = cycled_sets(q, k, device)
    rep = 20 if quick else 100
    for name, fn in providers(angles, inv_freq, cos, sin, device).items():
        for mode in MODES:
            row = dict(
                env, op=OP, provider=name, mode=mode, shape=shape_id(shape), dtype=dtype_name
            )
            if isinstance(fn, str):
                rows.append(dict(row, note=fn))
                continue
            if mode == "fwd":
                calls = [lambda fn=fn, a=a: fn(*a) for a in sets]
                grads = None
            else:
                grads = [t.detach().requires_grad_() for a in sets for t in a]
                cots = [(torch.randn_like(a[0]), torch.randn_like(a[1])) for a in sets]
                calls = [
                    lambda fn=fn, qg=qg, kg=kg, c=c: torch.autograd.backward(fn(qg, kg), c)
                    for qg, kg, c in zip(grads[0::2], grads[1::2], cots, strict=True)
                ]
            cycle = itertools.cycle(calls)
            ms, p20, p80 = time_ms(lambda c=cycle: next(c)(), grad_to_none=grads, rep_ms=rep)
            eager_ms = time_ms(calls[0], graph=False, grad_to_none=grads, rep_ms=rep)[0]
            for g in grads or ():
                g.grad = None  # the peak-memory call must not accumulate into old gradients
            peak = peak_extra_mib(calls[0], device)
            gbps = moved * (1 if mode == "fwd" else 2) / ms / 1e6
            acc = accuracy_note(max_error(fn, q, k, angles), dtype_name)
            rows.append(
                dict(
                    row, ms=ms, ms_p20=p20, ms_p80=p80, gbps=gbps, peak_mem_mib=peak,
                    note=f"{acc}; {100 * gbps / copy_gbps:.0f}% of copy bw; "
                    f"eager {eager_ms:.4f} ms/call",
                )
            )  # fmt: skip
    return rows


def verdict(rows: list[dict], copy_gbps: float) -> list[str]:
    """One line per failed target or wrong output, then the overall verdict last. ``rows``
    hold timings as floats (``read_rows``); a row without ``ms`` was not timed."""
    timed = [r for r in rows if r.get("ms") is not None]
    cases = sorted({(r["shape"], r["dtype"], r["mode"]) for r in timed})
    # a fast provider is no result when its output is wrong
    lines = [
        f"MISS {r['shape']} {r['dtype']} {r['mode']}: {r['provider']} {r['note']}"
        for r in timed
        if accuracy_failed(r)
    ]
    for case in cases:
        by = {r["provider"]: r for r in timed if (r["shape"], r["dtype"], r["mode"]) == case}
        tri = by.get("triton")
        if tri is None:  # rows of other providers only (an earlier run's): nothing to judge
            lines.append(f"MISS {' '.join(case)}: no triton row")
            continue
        for rival in ("liger", "torch.compile"):
            if rival in by and by[rival]["ms"] <= tri["ms"]:
                lines.append(
                    f"MISS {' '.join(case)}: {rival} {by[rival]['ms']:.4f} ms <= "
                    f"triton {tri['ms']:.4f} ms"
                )
        large = any(shape_id(s) == case[0] for s in LARGE)
        if large and tri["gbps"] < COPY_TARGET * copy_gbps:
            lines.append(
                f"MISS {' '.join(case)}: triton {tri['gbps']:.0f} GB/s < "
                f"{COPY_TARGET:.0%} of copy {copy_gbps:.0f} GB/s"
            )
    measured = {r["provider"] for r in timed} | {r["shape"] for r in timed}
    missing = sorted({"liger", "torch.compile", *map(shape_id, LARGE)} - measured)
    if lines:
        status = f"FAIL ({len(lines)} misses)"
    else:
        status = "INCOMPLETE" if missing else "PASS"
    caveat = f"; not measured: {', '.join(missing)}" if missing else ""
    lines.append(
        f"VERDICT: {status}: target >= {COPY_TARGET:.0%} of copy bandwidth at the large shapes "
        f"and faster than Liger and torch.compile at every shape, every output within "
        f"the accuracy tolerance{caveat}"
    )
    return lines


def write_markdown(path: Path, rows, copy_gbps, env, lines) -> None:
    """The table of ``rows`` (every run's, from the CSV: each row names its commit), the
    verdict ``lines`` and the plot (``path``'s stem + ``.png``, beside it); ``env`` merges the
    rows' versions and dates."""
    cols = ["shape", "dtype", "mode", "provider", "ms", "ms_p20", "ms_p80", "gbps",
            "peak_mem_mib", "commit", "note"]  # fmt: skip
    text = (
        f"# RoPE on q and k: `{OP}`\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commits {env['commit']}, "
        f"{env['date']}. Generated by `experiments/bench_rope.py`.\n\n"
        f"Device copy bandwidth (`copy_` of fp16 buffers, read + write): **{copy_gbps:.4g} GB/s**. "
        "GB/s counts q and k read once and written once per pass (forward+backward: two "
        "passes). `triton` computes sin/cos from fp32 angles in the kernel; the other "
        "providers get cos/sin tables precomputed in the input dtype (as HF models).\n\n"
        + markdown_table(rows, cols)
        + "\n"
        + "\n".join(f"- {line}" for line in lines)
        + f"\n\n![bench_rope]({path.stem}.png)\n"
    )
    path.write_text(text)


def tune_shape(shape, device, dtype=torch.bfloat16) -> None:
    """Times the Triton forward over a grid of launch shapes (every head in one program, or one
    head block per program); prints the five fastest next to the heuristic's choice
    (``fused_rope.rope.tile_config``), with their GB/s. Each config's calls cycle through
    input copies that defeat L2, as the benchmark's do (one set fitting in L2 timed the cache:
    a review's find)."""
    B, HQ, HK, N, D = shape
    q, k, angles, *_ = inputs(shape, dtype, device)
    moved = 2 * (q.numel() + k.numel()) * q.element_size()
    sets = cycled_sets(q, k, device)

    def run(cfg) -> float:
        cycle = itertools.cycle(sets)
        return time_ms(lambda: rope_fwd(*next(cycle), angles, "half", D, 1.0, 1.0, config=cfg))[0]

    base = tile_config(B, N, HQ, HK, D, device)
    configs = set()
    for bn, bh, nw, one_block in itertools.product((1, 2, 4, 8), (4, 8, 16), (2, 4, 8), (0, 1)):
        bhq, bhk = min(bh, triton.next_power_of_2(HQ)), min(bh, triton.next_power_of_2(HK))
        configs.add(TileConfig(bn, bhq, bhk, nw, max(bhq, bhk) if one_block else None))
    results = sorted(((run(cfg), cfg) for cfg in configs), key=lambda t: t[0])
    ms = run(base)
    print(
        f"{shape_id(shape)} {dtype} fwd: heuristic {base}: {ms:.4f} ms {moved / ms / 1e6:.0f} GB/s"
    )
    for ms, cfg in results[:5]:
        print(f"    {ms:.4f} ms {moved / ms / 1e6:.0f} GB/s  {cfg}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--tune", action="store_true", help="sweep the kernel's launch shape")
    parser.add_argument(
        "--shapes",
        nargs="*",
        choices=[shape_id(s) for s in SHAPES],
        help="a subset of the shapes (default: all; --quick has its own)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = [s for s in SHAPES if not args.shapes or shape_id(s) in args.shapes]
    if args.tune:
        if device.type != "cuda":  # the full-size shapes in the interpreter would take hours
            parser.error("--tune sweeps the kernel's launch shape on a GPU; no CUDA device here")
        for shape in chosen:
            tune_shape(shape, device)
        return
    quick, args.out = quick_and_output(args, device, "bench_rope")
    env = environment()
    copy_ms, copy_gbps = copy_bandwidth(device, quick)
    print(f"copy bandwidth: {copy_gbps:.4g} GB/s ({env['gpu']})")
    shapes = QUICK_SHAPES if quick else chosen
    dtypes = ["fp16"] if device.type == "cpu" else list(DTYPES)  # interpreter: no bf16
    rows = []
    for shape in shapes:
        for dtype_name in dtypes:
            rows += run_case(shape, dtype_name, copy_gbps, env, device, quick)
    rows.append(
        dict(env, op="copy", provider="torch.copy_", mode="fwd",
             shape="2MiB" if quick else "1GiB", dtype="fp16", ms=copy_ms, gbps=copy_gbps)
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "benchmarks.csv"
    upsert_rows(rows, csv_path)
    # verdict and markdown over every row of this op and GPU in the CSV, so that runs split by
    # --shapes add up to one table (as the plot, which reads the CSV)
    order = [shape_id(s) for s in SHAPES + QUICK_SHAPES]
    op_rows = read_rows(csv_path, OP, env["gpu"], shape_order=order)
    lines = verdict(op_rows, copy_gbps)
    suffix = gpu_suffix(args.out / "bench_rope.md", env["gpu"])  # another GPU's: kept
    md = args.out / f"bench_rope{suffix}.md"
    write_markdown(md, op_rows, copy_gbps, merged_environment(op_rows, env), lines)
    plot_op(OP, csv_path=csv_path, out=args.out / f"bench_rope{suffix}.png", gpu=env["gpu"])
    print(f"wrote {md}")
    print()
    print(markdown_table(op_rows, ["shape", "dtype", "mode", "provider", "ms", "gbps", "note"]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
