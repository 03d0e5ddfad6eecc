"""Benchmark: attention with RoPE, every provider in one process on one GPU.

Providers (causal, fp16 and bf16, forward and forward+backward):

* ``rope_attention``: ``fused_rope.rope_attention`` as a user calls it (``impl="auto"``).
* ``fused``: the fused Triton kernel alone (``impl="fused"``, default positions).
* ``fused_pos_tensor``: the fused kernel given ``positions`` as a tensor (the same kernels;
  their cos/sin tables then come from the tensor and hold a row per batch row if it has one).
* ``rope_attention_mrope``: ``rope_attention`` given ``angles`` (M-RoPE: ``mrope_angles`` of
  three position axes, here all equal to the token index, so the same rotation; Qwen2-VL's
  sections scaled to the head): the cost of reading an angle table instead of forming
  ``position * inv_freq``.
* ``rope_attention_learned_freq``: ``rope_attention`` given an ``inv_freq`` that requires grad
  (learned frequencies): forward+backward includes their gradient (``fused_rope._angle_grads``).
* ``triton_rope+sdpa``: ``impl="separate"``, this project's Triton RoPE over q and k
  (``fused_rope.rope.apply_rope_qk``) then PyTorch's SDPA.
* ``sdpa_no_rope``: ``scaled_dot_product_attention`` without RoPE, the floor.

The ``Prefill`` shapes continue a KV cache (``NQ < NK``, queries at the last NQ positions,
the causal mask aligned at the bottom right: ``torch.nn.attention.bias.causal_lower_right``
for SDPA). Liger's rotation and ``torch.compile`` (which cannot trace that mask) run on the
square shapes only.
* ``eager_rope+sdpa``: Hugging Face's rotation (``rotate_half``, cos/sin tables in the dtype,
  computed once outside the timing as HF models do) then SDPA.
* ``liger_rope+sdpa``: Liger-Kernel's ``liger_rotary_pos_emb`` then SDPA (if installed; see
  ``bench_rope.py`` for its wheel).
* ``compile(rope+sdpa)``: ``torch.compile`` of the eager provider.

TFLOPS counts ``4*B*H*N^2*D/2`` for the causal forward (H = query heads; ``4*B*H*D`` times
the visible (query, key) pairs for a prefill) and 3.5 times that for forward+backward, as
``/work/shared/docs/anchors.md``; the targets table gives ``rope_attention``'s and the SDPA
floor's share of the tensor cores' dense peak on an H100/H200 (``of_peak``, ``floor_of_peak``:
operations over the unit's rate). Targets, per shape, dtype and pass:
``rope_attention <= 1.10 x sdpa_no_rope`` and ``<= 0.9 x min(liger, compile)``. Every provider
but the floor is compared with the eager provider run in fp32 on the same inputs: a max-abs
error over ``experiments.results_io.ACC_TOL`` makes its note "ACC FAIL" and its (shape, dtype,
pass) miss the targets. A forward+backward row also checks the provider's dq, dk and dv under
the timed cotangent by flash-attention's rule (``tests.helpers.check_against_baseline``:
within twice the errors of the eager provider in the dtype, against it in fp32).

    python experiments/bench_rope_attention.py                      # GPU, results/ files
    python experiments/bench_rope_attention.py --quick --out /tmp/b  # CPU smoke (interpreter)
    python experiments/bench_rope_attention.py --report "NVIDIA H200"  # rebuild results/ tables
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the import of any Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from experiments.results_io import (  # noqa: E402
    ACC_FAIL,
    QUICK_IGNORES,
    accuracy_failed,
    accuracy_note,
    add_output_arguments,
    environment,
    gpu_suffix,
    gradient_note,
    leaf_gradients,
    markdown_table,
    merged_environment,
    quick_and_output,
    read_rows,
    upsert_rows,
    warn_ignored,
)
from experiments.timing import input_sets, peak_extra_mib, time_ms  # noqa: E402
from fused_rope.attention import rope_attention  # noqa: E402
from fused_rope.frequencies import mrope_angles, rope_angles, rope_frequencies  # noqa: E402

OP = "rope_attention"
# name -> (B, HQ, HKV, NQ, NK, D)
SHAPES = {
    "Small-1K": (4, 8, 8, 1024, 1024, 64),
    "Llama7B-2K": (2, 32, 32, 2048, 2048, 128),
    "Llama7B-4K": (2, 32, 32, 4096, 4096, 128),
    "Long-16K": (1, 8, 8, 16384, 16384, 128),
    "GQA-4K": (2, 32, 8, 4096, 4096, 128),
    "Prefill-4K": (2, 32, 8, 1024, 4096, 128),
    "Prefill-16K": (1, 32, 8, 2048, 16384, 128),
}
QUICK_SHAPES = {
    "Tiny": (1, 2, 2, 64, 64, 32),
    "Tiny-GQA": (1, 4, 2, 48, 48, 32),
    "Tiny-Prefill": (1, 4, 2, 20, 48, 32),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("fwd", "fwd+bwd")
MAIN = "rope_attention"
# The tensor cores' dense fp16/bf16 rate of the H100 and H200 SXM (NVIDIA's datasheets: 989.4
# TFLOPS, without sparsity), by the device name torch reports: the operations-over-rate floor
# of every shape here. The PCIe and NVL parts, slower, are left out (no share given).
TENSOR_CORE_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H200": 989.4}


def shape_label(name: str, shape) -> str:
    B, HQ, HKV, NQ, NK, D = shape
    heads = f"{HQ}/{HKV}" if HQ != HKV else f"{HQ}"
    lengths = f"{NK}" if NQ == NK else f"{NQ}x{NK}"
    return f"{name} ({B},{heads},{lengths},{D})"


def causal_flops(shape) -> float:
    """Forward FLOPs of causal attention on ``shape``: ``4 * B * HQ * D`` per visible (query,
    key) pair, the mask at the bottom right when ``NQ < NK`` (a prefill)."""
    B, HQ, _, NQ, NK, D = shape
    visible_pairs = NQ * NK - NQ * (NQ - 1) / 2 if NQ != NK else NQ * NQ / 2
    return 4 * B * HQ * D * visible_pairs


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def sdpa_causal(q, k, v):
    """SDPA, causal with the mask at the bottom right (``is_causal`` when ``NQ == NK``)."""
    NQ, NK = q.shape[2], k.shape[2]
    mask = causal_lower_right(NQ, NK) if NQ != NK else None
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )


def eager_rope_sdpa(q, k, v, cos, sin):
    """Hugging Face's apply_rotary_pos_emb (cos/sin ``[1, 1, NK, D]`` in the dtype; the queries
    take the last NQ positions), then SDPA."""
    NQ = q.shape[2]
    q = q * cos[..., -NQ:, :] + rotate_half(q) * sin[..., -NQ:, :]
    k = k * cos + rotate_half(k) * sin
    return sdpa_causal(q, k, v)


def providers(cos, sin, device, square: bool) -> dict:
    """name -> fn(q, k, v) -> o, or a string saying why the provider cannot run."""
    N, D = cos.shape[-2:]
    positions = torch.arange(N, device=device)
    cos4, sin4 = cos[None, None], sin[None, None]
    inv_freq = rope_frequencies(D, device=device)[0]
    half = D // 2  # Qwen2-VL's sections [16, 24, 24] of 64 frequencies, scaled to the head
    sections = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    mrope = mrope_angles(positions.expand(3, N), inv_freq, sections)
    learned = inv_freq.clone().requires_grad_()  # its .grad accumulates over the timed calls
    out = {
        MAIN: lambda q, k, v: rope_attention(q, k, v),
        "rope_attention_mrope": lambda q, k, v: rope_attention(q, k, v, angles=mrope),
        "rope_attention_learned_freq": lambda q, k, v: rope_attention(q, k, v, inv_freq=learned),
        "fused": lambda q, k, v: rope_attention(q, k, v, impl="fused"),
        "fused_pos_tensor": lambda q, k, v: rope_attention(
            q, k, v, positions=positions, impl="fused"
        ),
        "triton_rope+sdpa": lambda q, k, v: rope_attention(q, k, v, impl="separate"),
        "sdpa_no_rope": sdpa_causal,
        "eager_rope+sdpa": lambda q, k, v: eager_rope_sdpa(q, k, v, cos4, sin4),
    }
    if not square:  # compile cannot trace the bottom-right mask; Liger rotates q, k alike
        out["liger_rope+sdpa"] = out["compile(rope+sdpa)"] = "square shapes only"
        return out
    if device.type != "cuda":
        out["liger_rope+sdpa"] = out["compile(rope+sdpa)"] = "needs CUDA"
        return out
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        def liger(q, k, v):
            q, k = liger_rotary_pos_emb(q, k, cos[None], sin[None])
            return sdpa_causal(q, k, v)

        out["liger_rope+sdpa"] = liger
    except ImportError:
        out["liger_rope+sdpa"] = "liger-kernel not installed"
    compiled = torch.compile(eager_rope_sdpa, dynamic=False)
    out["compile(rope+sdpa)"] = lambda q, k, v: compiled(q, k, v, cos4, sin4)
    return out


def run_shape(name, shape, dtype_name, env, device, quick, only=None) -> list[dict]:
    """Times every provider on ``shape``. ``ms`` is GPU time (``experiments.timing.time_ms``: a
    CUDA graph of many calls cycling through enough input copies to defeat L2); the note adds
    the eager time per call (``do_bench``: Python, autograd and launch overhead included)."""
    B, HQ, HKV, NQ, NK, D = shape
    dtype = DTYPES[dtype_name]
    torch._dynamo.reset()  # a fresh compile per case: no cache-size fallback to eager
    make = lambda h, n: torch.randn(B, h, n, D, device=device, dtype=dtype, requires_grad=True)
    n_sets = input_sets(B * (NQ * HQ + 2 * NK * HKV) * D * dtype.itemsize, device)
    sets = [(make(HQ, NQ), make(HKV, NK), make(HKV, NK)) for _ in range(n_sets)]
    grads = [t for s in sets for t in s]
    do = torch.randn(B, HQ, NQ, D, device=device, dtype=dtype)
    angles = rope_angles(torch.arange(NK, device=device), rope_frequencies(D)[0].to(device))
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # the eager providers' tables
    q, k, v = sets[0]
    # The reference: fp32 throughout, its tables not rounded to dtype; and the gradients'
    # baseline, the eager provider in the dtype
    cos32, sin32 = emb.cos()[None, None], emb.sin()[None, None]

    def reference(q, k, v):
        return eager_rope_sdpa(q, k, v, cos32, sin32)

    with torch.no_grad():
        ref = reference(q.float(), k.float(), v.float())
    grad_ref = leaf_gradients(reference, (q.float(), k.float(), v.float()), do.float())
    grad_base = leaf_gradients(
        lambda *a: eager_rope_sdpa(*a, cos[None, None], sin[None, None]), (q, k, v), do
    )
    fwd_flops = causal_flops(shape)
    rep = 20 if quick else 100
    rows = []
    for provider, fn in providers(cos, sin, device, NQ == NK).items():
        if only and provider not in only:
            continue
        base = dict(
            op=OP, provider=provider, shape=shape_label(name, shape), dtype=dtype_name, **env
        )
        if isinstance(fn, str):
            rows += [dict(base, mode=m, note=fn) for m in MODES]
            continue
        try:
            with torch.no_grad():
                err = (fn(q, k, v).float() - ref).abs().max().item()
            grad_check = gradient_note(leaf_gradients(fn, (q, k, v), do), grad_ref, grad_base)
            for mode in MODES:
                if mode == "fwd":
                    calls = [lambda fn=fn, a=a: fn(*a) for a in sets]
                    flops = fwd_flops
                else:
                    calls = [lambda fn=fn, a=a: fn(*a).backward(do) for a in sets]
                    flops = 3.5 * fwd_flops
                cycle = itertools.cycle(calls)
                with torch.set_grad_enabled(mode != "fwd"):
                    ms, p20, p80 = time_ms(
                        lambda c=cycle: next(c)(), grad_to_none=grads, rep_ms=rep
                    )
                    eager_ms = time_ms(calls[0], graph=False, grad_to_none=grads, rep_ms=rep)[0]
                    for t in grads:
                        t.grad = None  # the peak-memory call must not accumulate old gradients
                    peak = peak_extra_mib(calls[0], device)
                note = f"eager {eager_ms:.4f} ms/call"
                if provider != "sdpa_no_rope":  # the floor has no RoPE: not the same output
                    note = f"{accuracy_note(err, dtype_name)} vs fp32 eager; {note}"
                    if mode != "fwd":
                        failed = grad_check.startswith(ACC_FAIL)
                        first, rest = (grad_check, note) if failed else (note, grad_check)
                        note = f"{first}; {rest}"
                rows.append(
                    dict(
                        base, mode=mode, ms=ms, ms_p20=p20, ms_p80=p80, tflops=flops / ms / 1e9,
                        peak_mem_mib=peak, note=note,
                    )
                )  # fmt: skip
        except Exception as e:  # a provider that fails must not hide the others' rows
            note = f"failed: {type(e).__name__}: {e}"[:200]
            rows += [dict(base, mode=m, note=note) for m in MODES]
        for t in grads:
            t.grad = None
    return rows


def _compile_job(job: tuple) -> str:
    """Compiles one fused-kernel autotune config (or the torch.compile provider) for one shape
    class in a worker process, filling the on-disk Triton and Inductor caches."""
    kind, (B, HQ, HKV, NQ, NK, D), dtype_name, arg = job
    device = torch.device("cuda")
    dtype = DTYPES[dtype_name]
    if kind == "inductor":
        q, k, v = (torch.randn(B, h, NK, D, device=device, dtype=dtype, requires_grad=True)
                   for h in (HQ, HKV, HKV))  # fmt: skip
        cos = sin = torch.randn(1, 1, NK, D, device=device, dtype=dtype)
        torch.compile(eager_rope_sdpa, dynamic=False)(q, k, v, cos, sin).sum().backward()
        return f"inductor {dtype_name} N={NK}"
    import fused_rope.attention as attention

    positions, index = arg
    # the real head counts and head dim (ints equal to 1 or divisible by 16 specialize a kernel);
    # sequence lengths are not specialized on, so 128 positions compile the same binaries
    q, k, v = (torch.randn(B, h, 128, D, device=device, dtype=dtype, requires_grad=True)
               for h in (HQ, HKV, HKV))  # fmt: skip
    pos = torch.arange(128, device=device) if positions == "tensor" else None
    with attention.pinned_config(index):
        rope_attention(q, k, v, positions=pos, impl="fused").sum().backward()
        torch.cuda.synchronize()
    return f"config {index} {dtype_name} D={D} {positions}"


def precompile(shapes: dict, dtypes: list[str], workers: int, only=None) -> None:
    """Compiles every autotune config of the fused kernels, and the torch.compile provider, in
    ``workers`` processes before the timing: autotuning in the timing process then only
    benchmarks (compilation otherwise takes most of a run's time, one config after another).
    ``only``: the providers to be timed (None: all); those not timed are not compiled."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    import fused_rope.attention as attention

    classes = {(B, HQ, HKV, 128, 128, D) for B, HQ, HKV, _, _, D in shapes.values()}
    square = [s for s in shapes.values() if s[3] == s[4]]  # compile runs square shapes only
    timed = lambda provider: only is None or provider in only
    jobs = [("inductor", s, d, None) for s in square for d in dtypes if timed("compile(rope+sdpa)")]
    modes = [m for m, p in (("default", "fused"), ("tensor", "fused_pos_tensor")) if timed(p)]
    jobs += [
        ("config", s, d, (p, i))
        for s in sorted(classes)
        for d in dtypes
        for p in modes
        for i in range(attention.N_CONFIGS)
    ]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        for done in pool.map(_compile_job, jobs):
            print("compiled", done, flush=True)


def peak_fraction(row: dict) -> float | None:
    """``row``'s TFLOPS over its GPU's tensor-core peak (``TENSOR_CORE_TFLOPS``); None for
    another GPU or an untimed row."""
    peak = TENSOR_CORE_TFLOPS.get(row.get("gpu", ""))
    return None if peak is None or not row.get("tflops") else round(row["tflops"] / peak, 3)


def verdicts(rows: list[dict]) -> list[dict]:
    """One row per (shape, dtype, mode): rope_attention against the floor and the alternatives;
    any provider's wrong output (an "ACC FAIL" note) misses the targets, since a comparison
    with it is no result. ``commits``: those of the rows compared (the CSV keeps each
    provider's latest run, so a ratio may divide times of two commits)."""
    out = []
    keys = dict.fromkeys((r["shape"], r["dtype"], r["mode"]) for r in rows)
    for shape, dtype, mode in keys:
        cell = [r for r in rows if (r["shape"], r["dtype"], r["mode"]) == (shape, dtype, mode)]
        ms = {r["provider"]: r["ms"] for r in cell if r.get("ms")}
        by_provider = {r["provider"]: r for r in cell}
        if MAIN not in ms or "sdpa_no_rope" not in ms:
            continue
        compared = (MAIN, "sdpa_no_rope", "liger_rope+sdpa", "compile(rope+sdpa)", "fused",
                    "triton_rope+sdpa")  # fmt: skip
        commits = sorted({r.get("commit") or "?" for r in cell if r["provider"] in compared})
        vs_floor = ms[MAIN] / ms["sdpa_no_rope"]
        alts = [ms[p] for p in ("liger_rope+sdpa", "compile(rope+sdpa)") if p in ms]
        vs_alt = ms[MAIN] / min(alts) if alts else None
        missed = ["floor"] if vs_floor > 1.10 else []
        if vs_alt is not None and vs_alt > 0.9:
            missed.append("alternatives")
        wrong = [r["provider"] for r in cell if accuracy_failed(r)]
        if wrong:
            missed.append(f"accuracy: {', '.join(wrong)}")
        # a prefill has no Liger or compile row (they run square shapes only): floor target only
        met = "met" if vs_alt is not None else "met (floor; no alternative runs it)"
        out.append(
            dict(
                shape=shape,
                dtype=dtype,
                mode=mode,
                ms=ms[MAIN],
                floor_ms=ms["sdpa_no_rope"],
                vs_floor=round(vs_floor, 3),
                vs_best_alt=None if vs_alt is None else round(vs_alt, 3),
                of_peak=peak_fraction(by_provider[MAIN]),
                floor_of_peak=peak_fraction(by_provider["sdpa_no_rope"]),
                fused_vs_separate=round(ms["fused"] / ms["triton_rope+sdpa"], 3)
                if "fused" in ms and "triton_rope+sdpa" in ms
                else None,
                target=f"MISSED ({' and '.join(missed)})" if missed else met,
                commits=", ".join(commits),
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser)  # --quick: tiny shapes, fp16 only
    parser.add_argument("--shapes", nargs="*", default=None, help="subset of the shape names")
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--providers", nargs="*", default=None, help="subset of the providers (default: all)"
    )
    parser.add_argument(
        "--precompile",
        type=int,
        default=0,
        metavar="WORKERS",
        help="compile the kernels' autotune configs in this many processes first (GPU)",
    )
    parser.add_argument(
        "--report",
        metavar="GPU",
        default=None,
        help="time nothing: rewrite the markdown and PNG from the CSV rows of this GPU name "
        "(in --out; default experiments/results/, with --quick the quick runs' folder)",
    )
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # A quick run or report (a run without CUDA is quick; a report, timing nothing, only with
    # --quick) writes into the committed results only where --out names them.
    quick, out = quick_and_output(args, device, "bench_rope_attention", times=not args.report)
    shapes = QUICK_SHAPES if quick else SHAPES
    if args.shapes:
        unknown = [n for n in args.shapes if n not in shapes]
        if unknown:
            raise SystemExit(
                f"--shapes {unknown}: the {'quick' if quick else 'full'} run has {list(shapes)}"
            )
        shapes = {n: shapes[n] for n in args.shapes}
    if args.providers:  # checked before anything is set up
        known = providers(torch.zeros(1, 2), torch.zeros(1, 2), torch.device("cpu"), True)
        unknown = [p for p in args.providers if p not in known]
        if unknown:
            raise SystemExit(f"--providers {unknown}: the providers are {list(known)}")
    if args.report:
        warn_ignored(parser, args, ["shapes", "providers", "dtypes", "precompile"],
                     "a report times nothing: it tabulates every row of its GPU")  # fmt: skip
    elif quick:
        warn_ignored(parser, args, ["dtypes"], QUICK_IGNORES)
    dtypes = ["fp16"] if quick else args.dtypes
    if args.precompile and device.type == "cuda" and not args.report:
        precompile(shapes, dtypes, args.precompile, args.providers)
    env = environment()
    out.mkdir(parents=True, exist_ok=True)
    for name, shape in {} if args.report else shapes.items():
        for dtype_name in dtypes:
            rows = run_shape(name, shape, dtype_name, env, device, quick, args.providers)
            upsert_rows(rows, path=out / "benchmarks.csv")  # a cut-short run keeps its rows
            print(f"done {name} {dtype_name}", flush=True)

    # the tables cover every row of this op on this GPU, so runs split by --shapes add up
    gpu = args.report or env["gpu"]
    order = [shape_label(n, s) for n, s in {**SHAPES, **QUICK_SHAPES}.items()]
    csv_path = out / "benchmarks.csv"
    rows = read_rows(csv_path, OP, gpu, shape_order=order) if csv_path.exists() else []
    if not rows:
        raise SystemExit(f"no {OP} rows for GPU {gpu!r} in {out}")
    # the header names the machine and versions of the rows (runs split by --shapes add up)
    env = merged_environment(rows, env)
    summary = verdicts(rows)
    columns = ["shape", "dtype", "mode", "provider", "ms", "tflops", "peak_mem_mib", "commit",
               "note"]  # fmt: skip
    v_columns = [
        "shape",
        "dtype",
        "mode",
        "ms",
        "floor_ms",
        "vs_floor",
        "vs_best_alt",
        "of_peak",
        "floor_of_peak",
        "fused_vs_separate",
        "target",
        "commits",
    ]
    met = sum(v["target"].startswith("met") for v in summary)
    floor_met = sum(not v["target"].startswith("MISSED (floor") for v in summary)
    verdict = (
        f"verdict: {met}/{len(summary)} (shape, dtype, pass) meet the targets that apply "
        f"(<= 1.10 x SDPA without RoPE; <= 0.9 x best of Liger and torch.compile where they run); "
        f"the floor target alone: {floor_met}/{len(summary)}; rows over the accuracy tolerance: "
        f"{sum(map(accuracy_failed, rows))}"
    )
    text = (
        f"# {OP} benchmark\n\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
        f"commits {env['commit']}, {env['date']}. Causal; ms = median GPU time (CUDA graph).\n\n"
        f"{markdown_table(rows, columns)}\n## Targets\n\n{markdown_table(summary, v_columns)}"
        f"\n{verdict}\n"
    )
    suffix = gpu_suffix(out / "bench_rope_attention.md", gpu)  # another GPU's: kept
    (out / f"bench_rope_attention{suffix}.md").write_text(text)
    print(f"wrote {out / f'bench_rope_attention{suffix}.md'}")
    try:
        from experiments.plot_benchmarks import plot_op

        figures = {
            f"{OP}{suffix}.png": {},
            f"{OP}_vs_floor{suffix}.png": dict(relative_to="sdpa_no_rope", target=1.1),
        }
        for name, relative in figures.items():  # vs_floor: the targets' ratio, 1.10x drawn
            png = plot_op(OP, csv_path, out / name, "ms", gpu, shape_order=order, **relative)
            print("plot:", png)
    except Exception as e:  # matplotlib missing or no timed rows: the tables still stand
        print(f"no plot: {type(e).__name__}: {e}")
    print(markdown_table(summary, v_columns))
    print(verdict)


if __name__ == "__main__":
    main()
