"""Where the fused RoPE attention forward loses to SDPA: its design, or Triton's FlashAttention?

The fused forward (``fused_rope/attention_forward.py``) rotates each Q tile in registers, reads
K rotated once a call by a small pass, and forms ``QK^T`` as one ``tl.dot`` per segment (the two
rotated halves, then the pass-through channels). Timed on one GPU in one process, causal:

* ``fused_forward``: ``rope_attention_fwd``, the forward launcher (cos/sin tables, the pass
  rotating k, the attention kernel); ``fused_kernel``: its attention kernel alone;
  ``tables+k_rotation``: the two small launches before it. ``baseline_forward``: the launcher
  of another copy of the package (``--baseline``), for an A/B.
* ``one_tile`` / ``one_tile_tma``: a FlashAttention-2 forward of the same structure (causal
  split into unmasked and diagonal tiles, exp2 softmax, heaviest programs first) with one
  ``[rows, W]`` tile for Q and K and one ``tl.dot`` for the scores, over Q and K rotated
  beforehand (kernel only): pointer loads, or Q, K, V and O through 2-d host TMA descriptors.
  The ceiling of a plain ``tl.dot`` FlashAttention-2 in Triton, with or without RoPE.
* ``one_tile_tma_qrot``: ``one_tile_tma`` rotating its Q tile in the kernel from q and the
  tables, as the fused kernel does; ``..._roundtrip``: the same, the rotated tile stored to a
  scratch buffer and loaded back (a loaded tile feeds wgmma from shared memory; one computed
  in registers is read back from shared memory into registers for every key tile).
* ``sdpa``: PyTorch's default SDPA without RoPE (cuDNN's attention on Hopper), the floor of
  issue 5, and ``sdpa_flash``: its FlashAttention-2 backend.

Square shapes, multiples of 128 (the ceiling kernels do not mask a last partial tile), every
channel rotated (half layout).

    python experiments/time_rope_attn_fwd_tiles.py --out experiments/results/time_rope_attn_fwd_tiles_h200.md
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_rope_attention import causal_flops  # noqa: E402
from experiments.results_io import environment, markdown_table, print_report  # noqa: E402
from experiments.timing import time_ms  # noqa: E402
from fused_rope import attention_forward  # noqa: E402
from fused_rope._attention_common import (  # noqa: E402
    _meta,
    _rope_tables,
    _rotated_segments,
    heads_per_section,
    query_fold,
)
from fused_rope.frequencies import rope_frequencies  # noqa: E402

SHAPES = {  # name -> (B, HQ, HKV, N, D)
    "Small-1K": (4, 8, 8, 1024, 64),
    "Llama7B-2K": (2, 32, 32, 2048, 128),
    "Llama7B-4K": (2, 32, 32, 4096, 128),
    "Long-16K": (1, 8, 8, 16384, 128),
    "GQA-4K": (2, 32, 8, 4096, 128),
}
TILES = [
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (64, 64, 4, 3),
]  # BLOCK_N <= BLOCK_M: the diagonal tile must not read past the last row


def _tma_hook(nargs):
    w = nargs["W"]
    nargs["Q"].block_shape = [nargs["BLOCK_M"], w]
    nargs["O"].block_shape = [nargs["BLOCK_M"], w]
    nargs["K"].block_shape = [nargs["BLOCK_N"], w]
    nargs["V"].block_shape = [nargs["BLOCK_N"], w]


def _configs(tma: bool):
    return [
        triton.Config(
            {"BLOCK_M": m, "BLOCK_N": n},
            num_warps=w,
            num_stages=s,
            pre_hook=_tma_hook if tma else None,
        )
        for m, n, w, s in TILES
    ]


@triton.jit
def _rotated_rows(X, rows, row_mask, COS, SIN, scale, W: tl.constexpr):
    """Rows ``[ROWS, W]`` of one head of ``X`` (half layout, every channel rotated), rotated
    and scaled in fp32, in X's dtype: column ``c`` is ``x[c] cos - x[c + W/2] sin`` in the
    first half and ``x[c] cos + x[c - W/2] sin`` in the second, cos/sin from ``[rows, W/2]``
    tables. The whole row is one tile, as the single-dot kernel needs it."""
    c = tl.arange(0, W)
    ptrs = X + rows[:, None] * W
    x = tl.load(ptrs + c[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    partner = tl.load(ptrs + ((c + W // 2) % W)[None, :], mask=row_mask[:, None], other=0.0)
    table = rows[:, None] * (W // 2) + (c % (W // 2))[None, :]
    cos = tl.load(COS + table, mask=row_mask[:, None], other=1.0).to(tl.float32)
    sin = tl.load(SIN + table, mask=row_mask[:, None], other=0.0).to(tl.float32)
    sin = tl.where(c[None, :] < W // 2, -sin, sin)
    return ((x * cos + partner.to(tl.float32) * sin) * scale).to(X.dtype.element_ty)


@triton.jit
def _tile(X, row, stride, BLOCK: tl.constexpr, W: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        x = X.load([row, 0])
    else:
        offs = row + tl.arange(0, BLOCK)
        x = tl.load(X + offs[:, None] * stride + tl.arange(0, W)[None, :])
    return x


@triton.jit
def _one_tile_kernel(
    Q, K, V, O, QRAW, QCOS, QSIN, QS, qk_scale, HQ, GROUP, N, W: tl.constexpr,
    TMA: tl.constexpr, Q_MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Q, O ``[B*HQ*N, W]``, K, V ``[B*HKV*N, W]`` (rows of heads stacked), Q folded.
    ``Q_MODE`` 0: Q loaded as it is; 1: rotated in the kernel from ``QRAW`` (unrotated,
    ``[B*HQ*N, W]``) with the tables ``QCOS, QSIN`` ``[N, W/2]``; 2: as 1, then stored to
    ``QS`` and loaded back (a loaded tile can feed wgmma from shared memory)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % HQ
    kv_bh = (pid_bh // HQ) * (HQ // GROUP) + h // GROUP
    start_m = pid_m * BLOCK_M
    q_row = pid_bh * N + start_m
    k_row = kv_bh * N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if Q_MODE == 0:
        q = _tile(Q, q_row, W, BLOCK_M, W, TMA)
    else:
        q = _rotated_rows(QRAW + pid_bh * N * W, offs_m, offs_m < N, QCOS, QSIN, qk_scale, W)
        if Q_MODE == 2:
            ptrs = QS + (q_row + tl.arange(0, BLOCK_M))[:, None] * W + tl.arange(0, W)[None, :]
            tl.store(ptrs, q)
            tl.debug_barrier()
            q = tl.load(ptrs)
    acc = tl.zeros((BLOCK_M, W), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for masked in tl.static_range(2):
        lo = start_m if masked else 0
        hi = start_m + BLOCK_M if masked else start_m
        for start_n in tl.range(lo, hi, BLOCK_N):
            k = _tile(K, k_row + start_n, W, BLOCK_N, W, TMA)
            s = tl.dot(q, tl.trans(k))
            if masked:
                offs_n = start_n + tl.arange(0, BLOCK_N)
                s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _tile(V, k_row + start_n, W, BLOCK_N, W, TMA)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    o = acc / l_i[:, None]
    if TMA:
        O.store([q_row, 0], o.to(O.dtype))
    else:
        offs = q_row + tl.arange(0, BLOCK_M)
        tl.store(O + offs[:, None] * W + tl.arange(0, W)[None, :], o.to(O.dtype.element_ty))


_ONE_TILE = triton.autotune(configs=_configs(False), key=["N", "W", "Q_MODE"])(_one_tile_kernel)
_ONE_TILE_TMA = triton.autotune(configs=_configs(True), key=["N", "W", "Q_MODE"])(_one_tile_kernel)


def _launch_one_tile(q_rot, k_rot, v, tma: bool, q_mode: int = 0, q=None, tables=None,
                     q_fold=1.0):  # fmt: skip
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, HQ, N, W = q_rot.shape
    q_scratch = torch.empty_like(q_rot) if q_mode == 2 else q_rot
    extra = (q_rot, q_rot, q_rot, q_scratch) if q_mode == 0 else (q, *tables, q_scratch)
    HKV = k_rot.shape[1]
    o = torch.empty_like(q_rot)
    flat = [t.reshape(-1, W) for t in (q_rot, k_rot, v, o)]
    if tma:
        flat = [TensorDescriptor.from_tensor(t, [64, W]) for t in flat]  # hook sets the block
    kernel = _ONE_TILE_TMA if tma else _ONE_TILE
    grid = lambda m: (triton.cdiv(N, m["BLOCK_M"]), B * HQ)
    kernel[grid](*flat, *extra, q_fold, HQ, HQ // HKV, N, W=W, TMA=tma, Q_MODE=q_mode)
    return o


def run(name: str, dtype: torch.dtype, baseline) -> list[dict]:
    B, HQ, HKV, N, D = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn((B, h, N, D), device="cuda", dtype=dtype, generator=gen) for h in (HQ, HKV, HKV)
    )
    scale = D**-0.5
    q_fold, score_scale = query_fold(scale, dtype)
    meta = _meta(D, D, False, True, dtype, score_scale)
    inv_freq = rope_frequencies(D, 10000.0)[0].to(device="cuda", dtype=torch.float32)

    def tables_and_rotation():  # what the forward launches before its attention kernel
        tables = _rope_tables(inv_freq, None, None, N, N, meta["HALF"], dtype)
        return _rotated_segments(k, tables[2], tables[3], tables[5], tables[7], 1.0, meta)

    q_cos, q_sin, k_cos, k_sin, sq, sk, q_off, k_off = _rope_tables(
        inv_freq, None, None, N, N, meta["HALF"], dtype
    )
    k_rot = _rotated_segments(k, k_cos, k_sin, sk, k_off, 1.0, meta)
    q_rot = _rotated_segments(q, q_cos, q_sin, sq, q_off, q_fold, meta)
    assert q_rot.shape[-1] == D, "the experiment's kernels take full rotation of a 2^k head"
    ref = torch.nn.functional.scaled_dot_product_attention(  # the same rotated inputs
        q_rot.float(), k_rot.float(), v.float(), is_causal=True, scale=1.0 / 1.4426950408889634,
        enable_gqa=HQ != HKV,
    )  # fmt: skip

    def sdpa(backend):
        def fn():
            if backend is None:
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=HQ != HKV
                )
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=HQ != HKV
                )

        return fn

    lse = torch.empty((B, HQ, N), device="cuda", dtype=torch.float32)
    o_fused = torch.empty_like(q)

    def fused_kernel():  # as rope_attention_fwd launches it, on the rotated keys made above
        grid = lambda m: (triton.cdiv(N, m["BLOCK_M"]) * B * HQ,)
        section = heads_per_section(
            N * (k_rot.shape[3] + D) * k.element_size() * HKV // HQ, "query"
        )
        attention_forward._rope_attn_fwd_kernel[grid](
            q, k_rot, v, o_fused, lse, q_cos, q_sin, q_fold, *q.stride(), *k_rot.stride()[:3],
            *v.stride(), *o_fused.stride(), sq, q_off, HQ, HQ // HKV, N, N, window=0,
            SECTION=section, **meta,
        )  # fmt: skip
        return o_fused

    def forward(module):
        return lambda: module.rope_attention_fwd(
            q, k, v, inv_freq, None, None, True, scale, False, D
        )[0]

    providers = {
        "sdpa": sdpa(None),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "fused_forward": forward(attention_forward),
        "fused_kernel": fused_kernel,
        "tables+k_rotation": tables_and_rotation,
        "one_tile": lambda: _launch_one_tile(q_rot, k_rot, v, False),
        "one_tile_tma": lambda: _launch_one_tile(q_rot, k_rot, v, True),
        "one_tile_tma_qrot": lambda: _launch_one_tile(
            q_rot, k_rot, v, True, 1, q, (q_cos, q_sin), q_fold
        ),
        "one_tile_tma_qrot_roundtrip": lambda: _launch_one_tile(
            q_rot, k_rot, v, True, 2, q, (q_cos, q_sin), q_fold
        ),
    }
    if baseline is not None:
        providers["baseline_forward"] = forward(baseline)
    rows = []
    for provider, fn in providers.items():
        try:
            out = fn()
            torch.cuda.synchronize()
            checked = not provider.startswith("sdpa") and provider != "tables+k_rotation"
            err = f"{(out.float() - ref).abs().max():.1e}" if checked else ""
            ms = time_ms(fn)[0]
            tuned = {
                "one_tile": _ONE_TILE,
                "one_tile_tma": _ONE_TILE_TMA,
                "one_tile_tma_qrot": _ONE_TILE_TMA,
                "one_tile_tma_qrot_roundtrip": _ONE_TILE_TMA,
                "fused_kernel": attention_forward._rope_attn_fwd_kernel,
            }.get(provider)
            config = getattr(tuned, "best_config", None)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
            ms, err, config = float("nan"), f"failed: {type(e).__name__}: {str(e)[-300:]}", None
        rows.append(
            {
                "shape": f"{name} ({B},{HQ}/{HKV},{N},{D})",
                "dtype": str(dtype).removeprefix("torch."),
                "provider": provider,
                "ms": ms,
                "tflops": causal_flops((B, HQ, HKV, N, N, D)) / ms / 1e9,
                "max_abs_err": err,
                "config": "" if config is None else str(config),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float16"])
    parser.add_argument(
        "--baseline",
        help="a package with an older attention_forward (a copy of fused_rope renamed, for an "
        "A/B in one process): its rope_attention_fwd is timed as baseline_forward",
    )
    args = parser.parse_args()
    baseline = (
        importlib.import_module(f"{args.baseline}.attention_forward") if args.baseline else None
    )
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for name in args.shapes:
            rows += run(name, dtype, baseline)
            print(rows[-1], flush=True)
    floor = {(r["shape"], r["dtype"]): r["ms"] for r in rows if r["provider"] == "sdpa"}
    for r in rows:
        r["x_sdpa"] = r["ms"] / floor[r["shape"], r["dtype"]]
    env = environment()
    text = (
        "# The fused RoPE attention forward against a plain FlashAttention-2 in Triton and SDPA\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}. "
        "Causal, forward; ms = median GPU time (CUDA graph); x_sdpa = ms / sdpa's ms.\n\n"
        + markdown_table(
            rows,
            ["shape", "dtype", "provider", "ms", "tflops", "x_sdpa", "max_abs_err", "config"],
        )
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
