"""Can a warp-specialized Hopper attention forward, written in Gluon, reach cuDNN's speed? A probe.

Issue 5's forward misses its floor (SDPA without RoPE, which is cuDNN's kernel on Hopper) at
Small-1K, Llama7B-2K and Llama7B-4K, and ``fused_rope/README.md`` (session 36) traced the gap
to the attention itself: a ``tl.dot`` FlashAttention-2 in Triton 3.6, with no RoPE at all,
takes 1.14-1.19x cuDNN's time there. Sessions 29-36 named the next step: warp roles (a
producer warp feeding K/V through TMA, consumer warpgroups doing the products and the
softmax, as FlashAttention-3 splits the work), which only Gluon or CUDA can express. Sessions
55-56 built that forward in Gluon (now ``fused_rope/attention_forward_hopper.py``, which has its
design); this script checks it against float64 at small shapes, without RoPE in three pipeline
variants (stages, FlashAttention-3's overlap) and with RoPE (``rope_attention(impl="fused")``,
which runs it on Hopper), and times it against cuDNN, SDPA's FlashAttention-2, RoPE then the
kernel, and the Triton forward. GPU only (Gluon has no interpreter); ``--offline`` compiles it
for sm_90a from any machine (Triton 3.6) and reports registers, spills and shared memory.

    python experiments/gluon_attention_probe.py --out experiments/results      # GPU
    python experiments/gluon_attention_probe.py --offline                       # ptxas report
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if "--offline" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)  # compile for sm_90a, even from a CPU machine

import torch
import triton

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from fused_rope.attention_forward_hopper import (  # noqa: E402 - after the path
    CTA_ROWS,
    MAXNREG,
    RopeArgs,
    attention_fwd_kernel,
    descriptors,
    kv_tiles,
    launch,
)

LOG2E = 1.0 / math.log(2.0)


def gluon_attention(q, k, v, *, causal=True, softmax_scale=None, stages=2, overlap=False):
    """o [B, HQ, NQ, D] = softmax(q k^T * scale) v, q [B, HQ, NQ, D], k, v [B, HKV, NK, D]
    (NQ <= NK; causal at the bottom right): the package's Gluon kernel without RoPE."""
    b, hq, n, d = q.shape
    half = q.dtype in (torch.float16, torch.bfloat16)
    if n > k.shape[2] or d not in (64, 128) or hq % k.shape[1] or not half:
        raise ValueError(f"probe shapes only: NQ <= NK, D in (64, 128), got {q.shape}")
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    q, k, v = (t.contiguous() for t in (q, k, v))
    return launch(q, k, v, causal, scale * LOG2E, stages=stages, overlap=overlap)


def gluon_rope_attention(q, k, v, inv_freq, *, causal=True):
    """``rope_attention(impl="fused", return_lse=True)``, which runs the Gluon forward on Hopper
    (checked: the call must qualify), at the check's short sequences too (production takes it
    from ``HOPPER_MIN_N`` tokens on)."""
    from fused_rope import attention_forward, rope_attention

    d = q.shape[-1]
    min_n, attention_forward.HOPPER_MIN_N = attention_forward.HOPPER_MIN_N, CTA_ROWS
    try:
        if not attention_forward.hopper_forward_takes(q, k, d, False, d**-0.5):
            raise ValueError(f"the Gluon forward does not take {tuple(q.shape)} {q.dtype} here")
        return rope_attention(q, k, v, inv_freq=inv_freq, causal=causal, impl="fused",
                              return_lse=True)  # fmt: skip
    finally:
        attention_forward.HOPPER_MIN_N = min_n


def triton_rope_attention(q, k, v, inv_freq):
    """``rope_attention(impl="fused")`` with the Gluon forward turned off: Triton's forward."""
    from fused_rope import attention_forward, rope_attention

    enabled, attention_forward.GLUON_ENABLED = attention_forward.GLUON_ENABLED, False
    try:
        return rope_attention(q, k, v, inv_freq=inv_freq, impl="fused")
    finally:
        attention_forward.GLUON_ENABLED = enabled


def compile_offline(d, causal, stages, overlap, rope=False, dtype=torch.bfloat16, row_step=8,
                    rotary=None, interleaved=False, windowed=False):  # fmt: skip
    """The kernel compiled for sm_90a without a GPU: registers, spills, shared memory.
    ``rotary``: the rotated channels (default all ``d``), ``interleaved`` their layout;
    ``windowed``: the sliding-window variant."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    t = torch.empty(CTA_ROWS * 2, d, dtype=dtype)
    descs = descriptors(*[t[None, None]] * 4, kv_tiles(d)[0])
    names = ["q_desc", "k_desc", "v_desc", "o_desc"]
    sig = {name: mangle_type(desc) for name, desc in zip(names, descs, strict=True)}
    ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    sig.update(Q=ptr, COS="*fp16", SIN="*fp16", LSE="*fp32", qk_scale="fp32", q_fold="fp32",
               rot_fold="fp32",
               NQ="i32", NK="i32", HQ="i32", HKV="i32", TABLE_OFF="i32", TABLE_STRIDE_B="i32",
               WINDOW="i32", SECTION="i32", CAUSAL="constexpr", WINDOWED="constexpr",
               STAGES="constexpr",
               OVERLAP="constexpr", ROPE="constexpr", ROTARY="constexpr", INTERLEAVED="constexpr",
               ROW_STEP="constexpr")  # fmt: skip
    consts = {("CAUSAL",): causal, ("WINDOWED",): windowed, ("STAGES",): stages,
              ("OVERLAP",): overlap, ("ROPE",): rope,
              ("ROTARY",): rotary or d, ("INTERLEAVED",): interleaved,
              ("ROW_STEP",): row_step if rope else 0}  # fmt: skip
    consts = {(list(sig).index(k[0]),): v for k, v in consts.items()}
    attrs = {(list(sig).index(name),): [["tt.divisibility", 16]]
             for name in ("Q", "COS", "SIN", "LSE", "NQ", "NK", "HQ", "HKV")}  # fmt: skip
    return triton.compile(
        GluonASTSource(attention_fwd_kernel, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "maxnreg": MAXNREG},
    )


def _offline_report() -> None:
    from experiments.ptxas_corope import report

    print("| D | RoPE | stages | overlap | keys a tile | registers | stack B | spill st / ld B "
          "| shared B |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for d in (64, 128):
        for rope in (False, True):
            for stages, overlap in _variants(d).values():
                k = compile_offline(d, True, stages, overlap, rope)
                print(
                    f"| {d} | {rope} | {stages} | {overlap} | {kv_tiles(d)[0]} | {report(k, False)} |"
                )


def _variants(d: int) -> dict:
    return {k: v for k, v in VARIANTS.items() if d == 64 or v[0] < 4}


SHAPES = {  # issue 5's benchmark shapes: (B, HQ, HKV, N, D)
    "Small-1K": (4, 8, 8, 1024, 64),
    "Llama7B-2K": (2, 32, 32, 2048, 128),
    "Llama7B-4K": (2, 32, 32, 4096, 128),
    "Long-16K": (1, 8, 8, 16384, 128),
    "GQA-4K": (2, 32, 8, 4096, 128),
}
VARIANTS = {  # name: (stages, overlap); keys a tile: 128 (64 was slower)
    "gluon": (2, False),
    "gluon_overlap_3st": (3, True),  # the package's
    "gluon_overlap_4st": (4, True),  # D = 64 only: 4 stages of D = 128 overflow shared memory
}


def _in_dtype(q, k, v, causal, scale):
    """softmax(q k^T * scale) v with its products and softmax in q's dtype: the flash-attention
    rule's baseline (``tests.helpers.rope_attention_in_dtype`` without the rotation)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q * scale) @ k.transpose(-1, -2)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def check(out: Path | None) -> list[str]:
    """Each variant, and the fused-RoPE forward (its o and lse), against float64 at small shapes
    with flash-attention's rule (``tests.helpers.check_against_baseline``): errors at most twice
    those of the same math computed in PyTorch in the dtype."""
    from fused_rope import rope_frequencies
    from fused_rope.frequencies import rope_angles
    from fused_rope.naive import rope_attention_ref
    from tests.helpers import check_against_baseline, rope_attention_in_dtype

    lines = []

    def record(name, shape, causal, dtype, out, ref, baseline):
        ok, msg = check_against_baseline(out, ref, baseline)
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name:26s} {shape} causal={causal} "
                     f"{str(dtype)[6:]}: {msg}")  # fmt: skip

    for (b, hq, hkv, n, d), causal, dtype in [
        (shape, causal, dtype)
        for shape in [(1, 2, 2, 128, 64), (2, 4, 2, 384, 128), (1, 8, 1, 512, 64), (2, 2, 2, 1024, 128)]
        for causal in (True, False)
        for dtype in (torch.bfloat16, torch.float16)
    ]:  # fmt: skip
        shape = (b, hq, hkv, n, d)
        gen = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
                   for h in (hq, hkv, hkv))  # fmt: skip
        scale = d**-0.5
        ref = _in_dtype(q.double(), k.double(), v.double(), causal, scale)
        baseline = _in_dtype(q, k, v, causal, scale)
        for name, (stages, overlap) in _variants(d).items():
            o = gluon_attention(q, k, v, causal=causal, stages=stages, overlap=overlap)
            record(name, shape, causal, dtype, o, ref, baseline)

        inv_freq = rope_frequencies(d, 10000.0)[0].to("cuda", torch.float32)
        angles = rope_angles(torch.arange(n, device="cuda"), inv_freq)
        o64, lse64 = rope_attention_ref(q.double(), k.double(), v.double(), inv_freq=inv_freq,
                                        causal=causal)  # fmt: skip
        o_b, _, lse32_b = rope_attention_in_dtype(q, k, v, q_angles=angles, k_angles=angles,
                                                  causal=causal, scale=scale, layout="half",
                                                  rope_dim=d)  # fmt: skip
        from fused_rope import attention_forward_hopper as hopper

        for row_step in (0, hopper.ROW_STEP):  # Q's cos and sin from every row, or fewer
            hopper.ROW_STEP, old = row_step, hopper.ROW_STEP
            try:
                o, lse = gluon_rope_attention(q, k, v, inv_freq, causal=causal)
            finally:
                hopper.ROW_STEP = old
            tag = f"gluon fused RoPE, row_step {row_step}"
            record(f"{tag}: o", shape, causal, dtype, o, o64, o_b)
            record(f"{tag}: lse", shape, causal, dtype, lse, lse64, lse32_b)
    print("\n".join(lines), flush=True)
    if out is not None:
        (out / "gluon_attention_probe_check.txt").write_text("\n".join(lines) + "\n")
    return lines


def _fp32_attention(q, k, v):
    """Causal attention of q, k, v taken to fp32 (memory-efficient SDPA, which has no GQA: the
    KV heads are repeated): the benchmark's reference at shapes float64 cannot hold."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(g, 1) for t in (k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, is_causal=True)


def bench(shapes, dtypes) -> list[dict]:
    """Every provider at issue 5's shapes, causal forward (``bench_shape``)."""
    return [row for dtype in dtypes for name in shapes for row in bench_shape(name, dtype)]


def bench_shape(name: str, dtype: torch.dtype) -> list[dict]:
    """Every provider at one shape; the Gluon outputs checked against an fp32 reference (max
    error at most twice cuDNN's, or with RoPE, twice the Triton fused path's)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fused_rope import apply_rope_qk, rope_attention, rope_frequencies

    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, hq, hkv, n, d = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
               for h in (hq, hkv, hkv))  # fmt: skip
    inv_freq = rope_frequencies(d, 10000.0)[0].to("cuda", torch.float32)
    gqa = hq != hkv
    ref = _fp32_attention(q, k, v)
    base = (sdpa(q, k, v, is_causal=True, enable_gqa=gqa).float() - ref).abs().max().item()
    q32, k32 = apply_rope_qk(q.float(), k.float(), inv_freq=inv_freq)
    ref_rope = _fp32_attention(q32, k32, v)
    del q32, k32
    fused = triton_rope_attention(q, k, v, inv_freq)
    base_rope = (fused.float() - ref_rope).abs().max().item()

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)

    def rope_then_gluon():
        qr, kr = apply_rope_qk(q, k, inv_freq=inv_freq)
        return gluon_attention(qr, kr, v, stages=3, overlap=True)

    providers = {
        "sdpa (cuDNN), no RoPE": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=gqa),
        "sdpa flash, no RoPE": flash,
        **{
            f"{vn}, no RoPE": (lambda st=st, ov=ov: gluon_attention(q, k, v, stages=st,
                                                                    overlap=ov))
            for vn, (st, ov) in _variants(d).items()
        },  # fmt: skip
        "RoPE pass + gluon_overlap_3st": rope_then_gluon,
        "rope_attention fused, gluon forward (RoPE)": lambda: gluon_rope_attention(q, k, v, inv_freq)[0],
        "rope_attention fused, Triton forward (RoPE)": lambda: triton_rope_attention(q, k, v, inv_freq),
        "rope_attention auto (RoPE)": lambda: rope_attention(q, k, v, inv_freq=inv_freq),
    }  # fmt: skip

    def error(provider, o):
        if "gluon" not in provider:
            return ""
        r, bound, who = (ref, base, "cuDNN") if "no RoPE" in provider else (
            ref_rope, base_rope, "Triton fused")  # fmt: skip
        e = (o.float() - r).abs().max().item()
        return f"{e:.1e} ({'ok' if e <= 2 * bound else 'FAIL'}: {who} {bound:.1e})"

    flops = 4 * b * hq * n * n * d / 2  # causal: half the pairs
    rows = []
    for provider, ms, x_cudnn, err in _timed(providers, error):
        rows.append({"shape": f"{name} ({b},{hq}/{hkv},{n},{d})", "dtype": str(dtype)[6:],
                     "provider": provider, "ms": ms, "tflops": flops / ms / 1e9,
                     "x_cudnn": x_cudnn, "max_abs_err": err})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def _timed(providers: dict, check) -> list[tuple]:
    """``(provider, ms, ms / the first provider's ms, check(provider, output))`` for each of
    ``providers`` (name -> fn), timed with ``time_ms``; a provider that raises is a row with NaN
    ms and its error."""
    from experiments.timing import time_ms

    out, first = [], None
    for provider, fn in providers.items():
        try:
            result = fn()
            torch.cuda.synchronize()
            note = check(provider, result)
            ms = time_ms(fn)[0]
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            ms, note = float("nan"), f"failed: {type(e).__name__}: {str(e)[-200:]}"
        first = ms if first is None else first
        out.append((provider, ms, ms / first, note))
    return out


def components(shapes, dtypes) -> list[dict]:
    """The fused RoPE forward's parts on the Gluon path, each timed alone, with the options this
    file's variants leave fixed (``components_of_shape``), at every shape and dtype."""
    return [row for dtype in dtypes for name in shapes for row in components_of_shape(name, dtype)]


def components_of_shape(name: str, dtype: torch.dtype) -> list[dict]:
    """At one shape: the cos/sin table, the k pass with ``heads`` a program
    (``_attention_common.ROTATE_HEADS``), the kernel with Q rotated inside from a table row per
    row or every ``row_step`` rows; cuDNN and the kernel without RoPE for scale. Each kernel
    variant's o is compared with ``row_step`` 0's."""
    from fused_rope import _attention_common as common
    from fused_rope import rope_frequencies
    from fused_rope.attention_forward import query_fold

    b, hq, hkv, n, d = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
               for h in (hq, hkv, hkv))  # fmt: skip
    inv_freq = rope_frequencies(d, 10000.0)[0].to("cuda", torch.float32)
    q_fold, _ = query_fold(d**-0.5, dtype)
    meta = common._meta(d, d, False, True, dtype, 1.0)

    def tables():
        return common._rope_tables(inv_freq, None, None, n, n, d // 2, dtype)

    cos, sin = tables()[:2]
    k_rot = common._rotated_segments(k, cos, sin, 0, 0, 1.0, meta)
    lse = torch.empty(b, hq, n, device="cuda")
    ref = launch(q, k_rot, v, True, 1.0, RopeArgs(cos, sin, lse, q_fold, rotary=d), row_step=0)

    def k_pass(heads):
        common.ROTATE_HEADS, old = heads, common.ROTATE_HEADS
        try:
            return common._rotated_segments(k, cos, sin, 0, 0, 1.0, meta)
        finally:
            common.ROTATE_HEADS = old

    def q_inside(row_step):
        return launch(
            q, k_rot, v, True, 1.0, RopeArgs(cos, sin, lse, q_fold, rotary=d), row_step=row_step
        )

    providers = {
        "sdpa (cuDNN), no RoPE": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=hq != hkv),
        "gluon, no RoPE": lambda: gluon_attention(q, k, v, stages=3, overlap=True),
        "cos/sin table": tables,
        **{f"k pass, {h} heads a program": (lambda h=h: k_pass(h)) for h in (1, 2, 4, 8)},
        **{f"gluon, Q rotated inside, row_step {rs}": (lambda rs=rs: q_inside(rs))
           for rs in (0, 8)},
    }  # fmt: skip

    def diff(provider, out):
        if "Q rotated" not in provider:
            return ""
        return f"{(out.float() - ref.float()).abs().max().item():.1e}"

    rows = []
    for provider, ms, x_cudnn, note in _timed(providers, diff):
        rows.append({"shape": f"{name} ({b},{hq}/{hkv},{n},{d})", "dtype": str(dtype)[6:],
                     "part": provider, "ms": ms, "x_cudnn": x_cudnn,
                     "max_diff_vs_package": note})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a, no GPU")
    parser.add_argument("--out", type=Path, help="folder for the markdown report")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"])
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--components", action="store_true",
                        help="time the RoPE forward's parts and options alone")  # fmt: skip
    args = parser.parse_args()
    if args.offline:
        _offline_report()
        return
    from experiments.results_io import environment, markdown_table, print_report

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_check:
        check(args.out)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    if args.components:
        rows = components(args.shapes, dtypes)
        env = environment()
        text = (
            "# The Gluon RoPE forward's parts, each alone (probe)\n\n"
            f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}. "
            "Causal; ms = median GPU time (CUDA graph); x_cudnn = ms / cuDNN's ms.\n\n"
            + markdown_table(rows, list(rows[0]))
        )
        out = None if args.out is None else args.out / "gluon_rope_components.md"
        print_report(text, out)
        return
    rows = bench(args.shapes, dtypes)
    env = environment()
    text = (
        "# A warp-specialized attention forward in Gluon against cuDNN (probe)\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}. "
        "Causal, forward; ms = median GPU time (CUDA graph); x_cudnn = ms / cuDNN's ms.\n\n"
        + markdown_table(rows, list(rows[0]))
    )
    print_report(text, None if args.out is None else args.out / "gluon_attention_probe.md")


if __name__ == "__main__":
    main()
