"""Benchmark: Co-RoPE-GQA attention, every provider in one process, bf16, causal.

Providers: this project's fused Triton kernels (``corope.corope_attention``: fwd, bwd,
fwd+bwd); the PyTorch reference (``corope.corope_attention_ref``, row-chunked, skipped where
its work is too large to time); RoPE attention on the same shapes, the fastest way this project
has (``fused_rope.rope_attention(impl="separate")``: the Triton RoPE kernel over q and k, then
``scaled_dot_product_attention`` with GQA); and the sin/cos floor of ``shared/docs/corope.md``: ``2 * B * HKV * (N^2 / 2) * (R / 2)`` sin/cos at
4.2e12 per second (H100/H200 special-function units; the backward recomputes the phases, so
its floor is at least as large again).

``ms`` is GPU time (``experiments.timing.time_gpu_ms``): a forward or forward+backward under
20 ms is replayed in a CUDA graph, since at short N the host's launches would bound
``do_bench``'s time; longer calls and the reference are timed by ``do_bench``. The backward
alone cannot be captured apart from its forward: where both of those were graphs, its row is
their difference, else ``do_bench``'s time. Each row's note gives the eager time per call or
says it was timed eagerly.

``peak_mem_mib`` of the kernel's fwd+bwd row is the memory allocated during one call beyond
the inputs and beyond o, dq, dk and dv (the target: at most 2 GiB at N = 32K); other rows
report everything allocated during the call. Every kernel forward is checked on sampled rows
against a float64 reference with flash-attention's rule as the tests apply it
(``tests.helpers.check_against_baseline``: max-abs error and relative RMSE at most twice those
of the fp32 reference rounded to the kernel's dtype, plus the rounding margin on the max-abs error); the
row's note says "acc ok" or "ACC FAIL". The forward+backward row checks dq, dk and dv by the
same rule wherever the reference is timed (its O(N^2) work bounds it; past that, says so).

    python experiments/bench_corope.py                      # GPU: results into experiments/results/
    python experiments/bench_corope.py --quick --out /tmp/c  # smoke run, also on the CPU (interpreter)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the import of any Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from corope import corope_attention, corope_attention_ref  # noqa: E402
from experiments.results_io import (  # noqa: E402
    QUICK_IGNORES,
    accuracy_failed,
    add_output_arguments,
    environment,
    gpu_suffix,
    gradient_note,
    leaf_gradients,
    markdown_table,
    quick_and_output,
    read_rows,
    sampled_rows_note,
    upsert_rows,
    warn_ignored,
)
from experiments.timing import peak_extra_mib, time_gpu_ms  # noqa: E402
from fused_rope.attention import rope_attention  # noqa: E402

OP = "corope"
SHAPES = [(1, 8, 2, 64), (1, 32, 8, 128)]  # (B, HQ, HKV, D)
NS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SHAPES, QUICK_NS = [(1, 2, 1, 32)], [64]
SINCOS_PER_S = 4.2e12
REF_MAX_PAIRS = 1 << 34  # B * HKV * N^2 * R/2 beyond which the reference is not timed
ANCHOR_REF_FWD_BWD_MS = 604.0  # corope.md: public reference, (1, 32/8, 128), N = 1024, H200


def shape_id(B, HQ, HKV, N, D) -> str:
    return f"B{B}-HQ{HQ}-HKV{HKV}-N{N}-D{D}"


def timer(
    fn, grad_to_none=None, quick=False, graph_below_ms=20.0
) -> tuple[tuple[float, float, float], str, bool]:
    """((median, 20th, 80th percentile) ms per call, how it was timed: a note, whether in a
    CUDA graph)."""
    timing, eager_ms, how = time_gpu_ms(
        fn, grad_to_none=grad_to_none, rep_ms=20 if quick else 100, graph_below_ms=graph_below_ms
    )
    if how == "graph":
        return timing, f"eager {eager_ms:.4g} ms/call", True
    return timing, "timed eagerly" if how == "eager" else how, False


def sincos_floor_ms(B, HKV, N, R) -> float:
    return 2 * B * HKV * (N * N / 2) * (R / 2) / SINCOS_PER_S * 1e3


def rows_accuracy(o, q, k, v, window=None) -> str:
    """``sampled_rows_note`` of ``o`` against the Co-RoPE reference of the sampled rows.
    ``window``: the sliding window ``o`` was computed with."""
    return sampled_rows_note(
        o, lambda i0, i1, cd: corope_attention_ref(
            q.to(cd), k.to(cd), v.to(cd), rows=range(i0, i1), window=window
        ),
    )  # fmt: skip


def run_case(shape, N, dtype, env, device, quick) -> list[dict]:
    B, HQ, HKV, D = shape
    sid = shape_id(B, HQ, HKV, N, D)
    dname = str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float16", "fp16")
    # The same inputs in every run and process (torch seeds a fresh process at random), so a
    # row's accuracy note is reproducible: at the quick run's fp16 (1, 2/1, 32), N = 64, about
    # 1 seed in 200 puts the last rows' rel-RMSE at 2.05-2.2x the fp32-math baseline's, which
    # rounds only o, where the kernel also rounds the rotated keys and P (tests/corope).
    torch.manual_seed(0)
    q = torch.randn(B, HQ, N, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, HKV, N, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, HKV, N, D, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)
    leaves = [q, k, v]
    base = dict(env, op=OP, shape=sid, dtype=dname)
    rows = []

    def add(provider, mode, timed, note=None, **extra):
        """A timed row; its note: ``note``, then how it was timed."""
        (ms, p20, p80), how, _ = timed
        note = how if note is None else f"{note}; {how}"
        rows.append(dict(base, provider=provider, mode=mode, ms=ms, ms_p20=p20, ms_p80=p80,
                         note=note, **extra))  # fmt: skip

    # The fused kernels.
    with torch.no_grad():
        o = corope_attention(q, k, v)
        note = rows_accuracy(o, q.detach(), k.detach(), v.detach())
        fwd = timer(lambda: corope_attention(q, k, v), quick=quick)
        add("corope_triton", "fwd", fwd, note=note)
    # The backward alone, eagerly: its kernels run on the stream of the forward, made outside
    # the timing, so a CUDA graph on another stream would not capture them.
    backward = functools.partial(corope_attention(q, k, v).backward, do, retain_graph=True)
    bwd = timer(backward, grad_to_none=leaves, quick=quick, graph_below_ms=0.0)
    # Its graph holds the leaves' gradient accumulators, made on the default stream: alive, they
    # break the capture of every later backward on the graph's stream.
    del backward
    fwd_bwd = lambda: corope_attention(q, k, v).backward(do)
    both = timer(fwd_bwd, grad_to_none=leaves, quick=quick)
    if fwd[2] and both[2]:  # short calls: the eager backward is the host's time, not the GPU's
        bwd = ((both[0][0] - fwd[0][0], None, None),
               f"fwd+bwd - fwd, both in CUDA graphs; eager {bwd[0][0]:.4g} ms/call", False)  # fmt: skip
    add("corope_triton", "bwd", bwd)
    add("corope_triton", "fwd+bwd", both)
    for x in leaves:
        x.grad = None
    outputs_bytes = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()  # o,dq,dk,dv
    rows[-1]["peak_mem_mib"] = peak_extra_mib(fwd_bwd, device, outputs_bytes)
    kernel_row = rows[-1]
    timed_how = kernel_row["note"]
    kernel_row["note"] = f"gradients not checked: N past the reference's bound; {timed_how}"

    # The reference, where its O(N^2 R) work is small enough to time.
    pairs = B * HKV * N * N * D // 2
    if pairs <= REF_MAX_PAIRS:
        try:
            # The kernel's dq, dk, dv by flash-attention's rule: against the float64
            # reference, within twice the errors of the fp32 one rounded to the dtype
            ref64, ref32 = (
                leaf_gradients(corope_attention_ref, [x.to(cd) for x in (q, k, v)], do.to(cd))
                for cd in (torch.float64, torch.float32)
            )
            grads = gradient_note(
                leaf_gradients(corope_attention, (q, k, v), do), ref64,
                [g.to(q.dtype) for g in ref32],
            )  # fmt: skip
            kernel_row["note"] = f"{grads}; {timed_how}"
            with torch.no_grad():
                # eagerly, as the anchor's 604 ms was: its many launches are part of its cost
                add("corope_ref", "fwd", timer(lambda: corope_attention_ref(q, k, v), quick=quick,
                                               graph_below_ms=0.0),
                    peak_mem_mib=peak_extra_mib(lambda: corope_attention_ref(q, k, v), device))  # fmt: skip
            ref_fb = lambda: corope_attention_ref(q, k, v).backward(do)
            add("corope_ref", "fwd+bwd", timer(ref_fb, grad_to_none=leaves, quick=quick,
                                               graph_below_ms=0.0),
                peak_mem_mib=peak_extra_mib(ref_fb, device))  # fmt: skip
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            done = {r["mode"] for r in rows if r["provider"] == "corope_ref"}
            for mode in ("fwd", "fwd+bwd"):  # the passes that ran out, the forward's too
                if mode not in done:
                    rows.append(dict(base, provider="corope_ref", mode=mode, note="out of memory"))
    else:
        rows.append(
            dict(base, provider="corope_ref", mode="fwd", note=f"skipped: {pairs:.2e} pairs")
        )

    # RoPE attention: the Triton RoPE kernel, then SDPA; and the sin/cos floor.
    rope_sdpa = lambda: rope_attention(q, k, v, impl="separate")
    with torch.no_grad():
        add("rope_sdpa", "fwd", timer(rope_sdpa, quick=quick), "Triton RoPE + SDPA")
    add("rope_sdpa", "fwd+bwd", timer(
        lambda: rope_sdpa().backward(do), grad_to_none=leaves, quick=quick
    ), "Triton RoPE + SDPA")  # fmt: skip
    floor = sincos_floor_ms(B, HKV, N, D)
    rows.append(dict(base, provider="sincos_floor", mode="fwd", ms=floor, note="4.2e12 sin/cos/s"))
    rows.append(dict(base, provider="sincos_floor", mode="fwd+bwd", ms=2 * floor,
                     note="backward recomputes the phases: >= 2x the forward"))  # fmt: skip
    return rows


def _ms(rows, shape, provider, mode):
    r = next(
        (r for r in rows if (r["shape"], r["provider"], r["mode"]) == (shape, provider, mode)), None
    )
    return None if r is None else r["ms"]


def verdict(rows: list[dict]) -> list[str]:
    """The targets of issue 3 for (1, 32/8, 128); missing shapes read "not measured"."""
    big = lambda N: shape_id(1, 32, 8, N, 128)
    lines, ok = [], True

    def check(name, value, limit, unit="ms"):
        nonlocal ok
        if value is None:
            lines.append(f"  {name}: not measured")
            ok = False
            return
        passed = value <= limit
        ok &= passed
        lines.append(
            f"  {name}: {value:.4g} {unit} (target <= {limit:.4g} {unit}) {'ok' if passed else 'MISSED'}"
        )

    check(
        "N=1024 fwd+bwd",
        _ms(rows, big(1024), "corope_triton", "fwd+bwd"),
        ANCHOR_REF_FWD_BWD_MS / 200,
    )
    floor = sincos_floor_ms(1, 8, 16384, 128)
    check(
        "N=16384 fwd vs 1.4x sin/cos floor",
        _ms(rows, big(16384), "corope_triton", "fwd"),
        1.4 * floor,
    )
    check("N=16384 fwd+bwd", _ms(rows, big(16384), "corope_triton", "fwd+bwd"), 150.0)
    r32 = next((r for r in rows if r["shape"] == big(32768) and r["provider"] == "corope_triton"
                and r["mode"] == "fwd+bwd"), None)  # fmt: skip
    mem = None if r32 is None else r32["peak_mem_mib"]
    check("N=32768 fwd+bwd memory beyond q,k,v,o,grads", mem, 2048.0, "MiB")
    failed = [r for r in rows if accuracy_failed(r)]
    if failed:
        ok = False
        lines.append(f"  accuracy: {len(failed)} rows failed the 2x rule")
    else:
        lines.append(
            "  accuracy: every measured kernel forward, and backward where the reference runs, "
            "within 2x of the fp32 reference"
        )
    return lines + [f"VERDICT: {'all targets met' if ok else 'targets missed or not measured'}"]


def write_markdown(path: Path, rows, env, lines) -> None:
    # Rows come from the CSV, where runs split by --shape / --min-n / --max-n may be of
    # different commits: each row names its own.
    cols = ["shape", "dtype", "mode", "provider", "ms", "ms_p20", "ms_p80", "peak_mem_mib",
            "commit", "note"]  # fmt: skip
    text = (
        f"# Co-RoPE-GQA benchmark\n\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
        f"last run at commit {env['commit']}, {env['date']}. Written by "
        f"`experiments/bench_corope.py`.\n\n"
        + markdown_table(rows, cols) + "\n```\n" + "\n".join(lines) + "\n```\n"
    )  # fmt: skip
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--max-n", type=int, default=max(NS), help="largest N to run")
    parser.add_argument("--min-n", type=int, default=min(NS), help="smallest N to run")
    parser.add_argument(
        "--shape",
        choices=["all", "small", "large"],
        default="all",
        help="small: (1, 8/2, D=64); large: (1, 32/8, D=128)",
    )
    args = parser.parse_args()
    if args.min_n > args.max_n:
        parser.error(f"--min-n {args.min_n} is above --max-n {args.max_n}: no N to run")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick, args.out = quick_and_output(args, device, "bench_corope")
    if quick:
        warn_ignored(parser, args, ["shape", "min_n", "max_n"], QUICK_IGNORES)
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # interpreter: no bf16
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "benchmarks.csv"
    upsert_rows([], csv_path)  # the file exists even if no case runs (the verdict: not measured)
    shapes = {"all": SHAPES, "small": SHAPES[:1], "large": SHAPES[1:]}[args.shape]
    for shape in QUICK_SHAPES if quick else shapes:
        for N in QUICK_NS if quick else [n for n in NS if args.min_n <= n <= args.max_n]:
            print(f"{shape_id(shape[0], shape[1], shape[2], N, shape[3])} ...", flush=True)
            # Written case by case: a run cut short (a time limit at 32K) keeps its rows.
            upsert_rows(run_case(shape, N, dtype, env, device, quick), csv_path)
    # Verdict and markdown over every row of this op and GPU in the CSV, so that runs split
    # by --shape / --min-n / --max-n add up to one table.
    rows = read_rows(csv_path, OP, env["gpu"])
    lines = verdict(rows)
    suffix = gpu_suffix(args.out / "bench_corope.md", env["gpu"])  # another GPU's: kept
    write_markdown(args.out / f"bench_corope{suffix}.md", rows, env, lines)
    print(f"wrote {args.out / f'bench_corope{suffix}.md'}")
    try:
        from experiments.plot_benchmarks import plot_op

        png = args.out / f"bench_corope{suffix}.png"
        plot_op(OP, csv_path=csv_path, out=png, gpu=env["gpu"], metric="ms")
    except Exception as e:  # plotting is a convenience; the CSV and markdown are the record
        print(f"plot skipped: {e!r}")
    print()
    print(
        markdown_table(rows, ["shape", "dtype", "mode", "provider", "ms", "peak_mem_mib", "note"])
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
