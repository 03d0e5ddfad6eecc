"""Decoding speed of the harness's model with a KV cache: RoPE, Co-RoPE and NoPE.

The model is ``model=small`` (d_model 512, 8 layers, 8 query heads sharing 2 KV heads, head
dim 64; bytes as tokens) in bf16 with random weights: speed does not depend on them. Per
(attention, batch B, prompt length P): the prefill (one forward of the prompt into a fresh
``lm.generation.KVCache``) and the decoding step (one token per sequence through the cached
model, the median of ``--steps`` steps, each synchronized). RoPE runs its Triton kernels
(``rope_attention`` for the prompt; a step rotates its new row with the Triton RoPE kernel,
then SDPA reads the cache of rotated keys); Co-RoPE prefills
with ``corope_attention`` and decodes with it too (one query row: the decoding kernels of
``corope/decode.py``, its gates and mileage over every cached key), NoPE is SDPA.
``--window W`` adds each attention with a sliding window of ``W`` keys in every layer, whose
cache holds a layer's last ``W - 1`` tokens (``lm.generation.KVCache``); each row's note gives
the cache's bytes.

Each case's output is checked on two of its sequences (one where B = 1; the fp32 forward of 8
uncached 16K sequences took over 130 GiB in SDPA's math path): the logits of the last of
``--steps`` cached decoding steps against the same model's uncached forward of the whole
sequence, by flash-attention's rule
(``tests.helpers.check_against_baseline``: within twice the errors of the uncached forward in
the model's dtype, against an fp32 copy of the model); the decode row's note starts with
"ACC FAIL" where it misses it.

The floor of a step is the bytes it must read from memory, the bf16 weights and the cached
keys and values of every layer, over the measured copy bandwidth; eager decoding of a model
this small is bound by the host's kernel launches, which the table shows against it.

    python experiments/bench_decode.py                  # GPU: results/bench_decode.md + CSV rows
    python experiments/bench_decode.py --quick --out /tmp/d   # smoke run, also on the CPU
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the import of any Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from experiments.bench_rope import copy_bandwidth  # noqa: E402
from experiments.results_io import (  # noqa: E402
    ACC_FAIL,
    QUICK_IGNORES,
    add_output_arguments,
    environment,
    gpu_suffix,
    markdown_table,
    merged_environment,
    print_report,
    quick_and_output,
    read_rows,
    upsert_rows,
    warn_ignored,
)
from lm.config import ATTENTION_SCHEMAS, ModelConfig  # noqa: E402
from lm.generation import KVCache  # noqa: E402
from lm.model import GPT  # noqa: E402
from tests.helpers import check_against_baseline  # noqa: E402

OP = "decode"
VARIANTS = ("rope", "corope", "nope")
BATCHES = (1, 8)
PROMPTS = (512, 4096, 16384)
SMALL = {"d_model": 512, "n_layer": 8, "n_head": 8, "n_kv_head": 2}
QUICK = {"d_model": 64, "n_layer": 2, "n_head": 2, "n_kv_head": 1}
VOCAB = 256


def build_model(
    variant: str, model: dict, max_len: int, device, dtype, window: int | None = None
) -> GPT:
    """``model=small`` (or ``model``'s sizes) with attention ``variant``, every layer
    windowed at ``window`` keys (None: no window), in eval mode."""
    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), model)
    attn_cfg = OmegaConf.structured(ATTENTION_SCHEMAS[variant])  # impl auto: Triton on CUDA
    attn_cfg.window = window
    return GPT(model_cfg, attn_cfg, VOCAB, max_len).to(device, dtype).eval()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_decoding(
    model: GPT, B: int, P: int, steps: int, device
) -> tuple[list[float], list[float], int]:
    """(the ms of each of 3 prefills, the ms of each of ``steps`` decoding steps after the
    last, the bytes of the last run's cache) after a warm-up run."""
    prompt = torch.randint(0, VOCAB, (B, P), device=device)
    step_ids = torch.randint(0, VOCAB, (B, 1), device=device)
    prefill_ms, step_ms = [], []
    for run in range(4):  # run 0 warms up
        cache = KVCache.for_model(model, P + max(steps, 2))  # 2 warm-up steps
        sync(device)
        t0 = time.perf_counter()
        model(prompt, cache)
        sync(device)
        prefill_ms.append((time.perf_counter() - t0) * 1e3)
        for _ in range(2 if run == 0 else steps if run == 3 else 0):
            t0 = time.perf_counter()
            model(step_ids, cache)
            sync(device)
            step_ms.append((time.perf_counter() - t0) * 1e3)
    return prefill_ms[1:], step_ms[2:], cache.nbytes()


@torch.no_grad()
def check_decoding(model: GPT, reference: GPT, B: int, P: int, steps: int, device) -> str:
    """The note of the output check (module docstring) on ``min(B, 2)`` sequences: "acc ok" or
    ``ACC FAIL`` and why. ``reference``: ``model`` in fp32."""
    tokens = torch.randint(0, VOCAB, (min(B, 2), P + steps), device=device)
    cache = KVCache.for_model(model, P + steps)
    model(tokens[:, :P], cache)
    for t in range(P, P + steps):
        cached = model(tokens[:, t : t + 1], cache)[:, -1]
    uncached = model(tokens)[:, -1]
    passed, msg = check_against_baseline(cached, reference(tokens)[:, -1], uncached)
    return "acc ok" if passed else f"{ACC_FAIL} (cached vs uncached logits): {msg}"


def quantiles(ms: list[float]) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile)."""
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else ms * 9
    return statistics.median(ms), q[1], q[7]


def floor_ms(model: GPT, B: int, P: int, gbps: float) -> float:
    """A step's bytes read (bf16 weights, every layer's cached k and v) over ``gbps``."""
    weights = sum(p.numel() for p in model.parameters()) * 2
    HKV, D = model.blocks[0].attn.n_kv_head, model.blocks[0].attn.head_dim
    kv = 2 * len(model.blocks) * B * HKV * P * D * 2
    return (weights + kv) / gbps / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--steps", type=int, default=32, help="decoding steps timed per case")
    parser.add_argument(
        "--window", type=int, help="also time every attention with this sliding window"
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.window is not None and args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick, args.out = quick_and_output(args, device, "bench_decode")
    if quick:
        warn_ignored(parser, args, ["steps"], QUICK_IGNORES)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "benchmarks.csv"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = environment()
    gbps = copy_bandwidth(device, quick)[1]
    sizes = QUICK if quick else SMALL
    batches, prompts, steps = ((1,), (16,), 2) if quick else (BATCHES, PROMPTS, args.steps)
    print(f"results into {args.out}; copy bandwidth {gbps:.4g} GB/s", flush=True)
    windows = (None,) if args.window is None else (None, args.window)
    for variant, window in ((v, w) for w in windows for v in VARIANTS):
        max_len = max(prompts) + max(steps, 2)
        model = build_model(variant, sizes, max_len, device, dtype, window)
        reference = copy.deepcopy(model).float()  # the output check's, once a model
        provider = variant if window is None else f"{variant}, window {window}"
        for B in batches:
            for P in prompts:
                prefill_ms, step_ms, cache_bytes = time_decoding(model, B, P, steps, device)
                accuracy = check_decoding(model, reference, B, P, steps, device)
                prefill, step = quantiles(prefill_ms), quantiles(step_ms)
                common = {"op": OP, "provider": provider, "shape": f"B{B}-P{P}", **env}
                common["dtype"] = "bf16" if dtype == torch.bfloat16 else "fp32"
                floor = floor_ms(model, B, P if window is None else min(P, window), gbps)
                cache = f"cache {cache_bytes / 2**20:.3g} MiB"
                timing = lambda q: dict(zip(("ms", "ms_p20", "ms_p80"), q, strict=True))
                rows = [
                    {**common, "mode": "prefill", **timing(prefill), "note": "3 prefills"},
                    {
                        **common,
                        "mode": "decode step",
                        **timing(step),
                        "note": f"{accuracy}; {B / step[0] * 1e3:.0f} tok/s; floor "
                        f"{floor * 1e3:.0f} us; {cache}",
                    },
                ]
                print(
                    f"{provider} B={B} P={P}: prefill {prefill[0]:.2f} ms, step {step[0]:.3f} "
                    f"ms, {cache}; {accuracy}"
                )
                upsert_rows(rows, csv_path)  # case by case: a run cut short keeps its rows
        del model, reference
    rows = read_rows(csv_path, OP, env["gpu"])
    cols = ["shape", "mode", "provider", "ms", "ms_p20", "ms_p80", "note", "commit"]
    # Every run's rows of this GPU (runs split by --window add up): their commits and dates
    runs = merged_environment(rows, ["torch", "triton", "commit", "date"])
    text = (
        f"# Decoding with a KV cache\n\n{env['gpu']}, torch {runs['torch']}, triton "
        f"{runs['triton']}, commits {runs['commit']}, {runs['date']}; copy bandwidth "
        f"{gbps:.4g} GB/s (the last run's). Written by `experiments/bench_decode.py` (its "
        f"docstring says what is timed).\n\n" + markdown_table(rows, cols)
    )
    # Another GPU's committed report is kept (bench_decode.md of an H100, _h200 beside it)
    print_report(
        text, args.out / f"bench_decode{gpu_suffix(args.out / 'bench_decode.md', env['gpu'])}.md"
    )


if __name__ == "__main__":
    main()
