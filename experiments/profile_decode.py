"""Where a decoding step's time goes: the host's Python (cProfile) and the GPU's kernels.

``bench_decode.py`` times whole steps of the harness's ``model=small``; a step of so small a
model is bound by the host, and there RoPE's and Co-RoPE's steps took 2.5-3.4x NoPE's
(``results/bench_decode.md``). This script prefills ``P`` tokens for a batch of ``B`` and runs
``--steps`` decoding steps per attention twice: once under cProfile (the functions that take
the host's time, each step synchronized as in the benchmark) and once under
``torch.profiler`` (every kernel's GPU time). It prints both tables and writes them to
``--out``.

    python experiments/profile_decode.py --batch 8 --prompt 16384 --out /tmp/p
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from experiments.bench_decode import SMALL, VARIANTS, VOCAB, build_model, sync  # noqa: E402
from lm.generation import KVCache  # noqa: E402


@torch.no_grad()
def profile_steps(variant: str, B: int, P: int, steps: int, top: int) -> str:
    """The host's ``top`` functions by total time over ``steps`` steps, then the kernels."""
    device = torch.device("cuda")
    model = build_model(variant, SMALL, P + 3 * steps + 4, device, torch.bfloat16)
    prompt = torch.randint(0, VOCAB, (B, P), device=device)
    ids = torch.randint(0, VOCAB, (B, 1), device=device)
    cache = KVCache.for_model(model, P + 3 * steps + 4)
    model(prompt, cache)
    for _ in range(steps):  # compiles and autotunes the step's kernels
        model(ids, cache)
    sync(device)

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        model(ids, cache)
        sync(device)
    profiler.disable()
    host = io.StringIO()
    pstats.Stats(profiler, stream=host).sort_stats("tottime").print_stats(top)

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(steps):
            model(ids, cache)
        sync(device)
    kernels = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)
    return f"## {variant}, B={B}, P={P}, {steps} steps\n\n### host\n{host.getvalue()}\n" + (
        f"### GPU\n{kernels}\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=25, help="rows of each table")
    ap.add_argument("--out", type=Path, help="a directory for profile_decode.txt")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py profiles GPU decoding; no CUDA device here")
    text = "\n".join(
        profile_steps(v, args.batch, args.prompt, args.steps, args.top) for v in args.variants
    )
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_decode.txt").write_text(text)


if __name__ == "__main__":
    main()
