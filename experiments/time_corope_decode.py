"""Timing of a decoding step's attention: the Co-RoPE decoding kernels, RoPE and NoPE.

A step of a small model is bound by the host, a step of a large batch or cache by the GPU,
so this script measures both, on one GPU in one process, bf16:

- GPU: ``corope.decode.corope_decode`` (one query row per head against a cache of ``NK``
  keys) in a CUDA graph, cycling through copies of the inputs that together pass three times
  the L2 cache (``timing.input_sets``), next to SDPA's decoding kernel on the same shapes (NoPE) and the
  bytes of the cache over the copy bandwidth (the floor: every key and value read once);
- host: the microseconds a call costs with the GPU idle (``B = 1``, 512 cached keys, each
  call synchronized), for the public ``corope_attention``, the decoding kernels alone,
  ``rope_attention`` with one query row, the Triton RoPE of one new row then SDPA (what the
  harness runs since it caches rotated keys), and SDPA alone.

``--versions`` takes copies of the repository whose ``corope/decode.py`` is timed next to the
checkout's (loaded in this process; the rest of the package is the checkout's), each row
with its largest difference from the checkout's output. ``--sweep`` times the checkout's
kernels with module constants of ``corope.decode`` set (``BLOCK_N``, ``PROGRAMS_PER_SM``,
``NUM_STAGES``, which rows of 512 bytes ignore), one setting per argument.

    python experiments/time_corope_decode.py --out /tmp/t
    python experiments/time_corope_decode.py --versions /tmp/old      # A/B in one process
    python experiments/time_corope_decode.py --sweep NUM_STAGES=1 BLOCK_N=128,PROGRAMS_PER_SM=4
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import corope.decode  # noqa: E402
from corope import corope_attention  # noqa: E402
from corope.naive import corope_inv_freq  # noqa: E402
from experiments.bench_rope import copy_bandwidth  # noqa: E402
from experiments.results_io import markdown_table  # noqa: E402
from experiments.time_corope import load_module, rel_diff  # noqa: E402
from experiments.timing import input_sets, time_ms  # noqa: E402
from fused_rope.attention import rope_attention  # noqa: E402
from fused_rope.frequencies import rope_angles  # noqa: E402
from fused_rope.rope import apply_rope_qk  # noqa: E402
from fused_rope.sdpa import sdpa_attention  # noqa: E402

# (B, HQ, HKV, D, NK): the harness's model=small at its decoding benchmark's shapes, and
# issue 3's head layout.
CASES = [
    (1, 8, 2, 64, 512),
    (8, 8, 2, 64, 4096),
    (8, 8, 2, 64, 16384),
    (1, 32, 8, 128, 32768),
    (8, 32, 8, 128, 8192),
]
DEVICE = torch.device("cuda")


def step_inputs(B: int, HQ: int, HKV: int, D: int, NK: int):
    """bf16 ``q [B, HQ, 1, D]``, ``k, v [B, HKV, NK, D]`` on the GPU."""
    q = torch.randn(B, HQ, 1, D, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, NK, D, device=DEVICE, dtype=torch.bfloat16) for _ in "kv")
    return q, k, v


def host_us(fn, calls: int = 300) -> float:
    """Microseconds a call of ``fn`` takes, each synchronized, the median of 5 runs."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(runs)[2]


def gpu_rows(
    versions: dict, case: tuple[int, ...], gbps: float, sweep: list[dict[str, int]]
) -> list[dict]:
    """Each version's, each swept launch shape's and SDPA's GPU time on ``case``
    ``(B, HQ, HKV, D, NK)``."""
    B, HQ, HKV, D, NK = case
    cache_bytes = 2 * B * HKV * NK * D * 2  # k and v, bf16
    # Copies of the inputs, cycled call after call, so that the cache is read from memory,
    # not from L2 (a 0.26 MB cache fits it 190 times over).
    sets = [step_inputs(B, HQ, HKV, D, NK) for _ in range(input_sets(cache_bytes, DEVICE))]
    q, k, v = sets[0]
    w, s = corope_inv_freq(D, 10000.0, None, q.device), D**-0.5
    common = dict(shape=f"B{B} {HQ}/{HKV} D{D} NK{NK}")
    common["floor_us"] = cache_bytes / gbps / 1e3

    def timed(fn) -> float:
        """GPU microseconds of ``fn(q, k, v)``, a different input copy each call."""
        cycle = itertools.cycle(sets)
        return time_ms(lambda: fn(*next(cycle)))[0] * 1e3

    rows, ref = [], None
    for name, module in versions.items():
        step = lambda q, k, v, m=module: m.corope_decode(q, k, v, w, s, D, "first")  # noqa: E731
        o = step(q, k, v)
        ref = o if ref is None else ref
        us = timed(step)
        rows.append(dict(common, provider=f"corope {name}", gpu_us=us, diff=rel_diff([ref], [o])))
    for setting in sweep:
        saved = {name: getattr(corope.decode, name) for name in setting}
        try:
            for name, value in setting.items():
                setattr(corope.decode, name, value)
            step = lambda q, k, v: corope.decode.corope_decode(q, k, v, w, s, D, "first")  # noqa: E731
            label = "corope " + ", ".join(f"{n}={x}" for n, x in setting.items())
            o = step(q, k, v)
            us = timed(step)
            rows.append(dict(common, provider=label, gpu_us=us, diff=rel_diff([ref], [o])))
        except OutOfResources as err:  # a setting past the SM's shared memory or registers
            rows.append(dict(common, provider=label, diff=f"out of resources: {err}"))
        finally:
            for name, value in saved.items():
                setattr(corope.decode, name, value)
    rows.append(dict(common, provider="sdpa (nope)", gpu_us=timed(sdpa_attention)))
    print(f"{common['shape']}: done", flush=True)
    return rows


def host_rows(versions: dict) -> list[dict]:
    B, HQ, HKV, D, NK = 1, 8, 2, 64, 512
    q, k, v = step_inputs(B, HQ, HKV, D, NK)
    w, s = corope_inv_freq(D, 10000.0, None, q.device), D**-0.5
    angles = rope_angles(torch.arange(NK - 1, NK, device=q.device), w)
    k_new = k[:, :, -1:]
    calls = {
        "corope_attention (public)": lambda: corope_attention(q, k, v),
        "corope::decode (the custom op)": lambda: torch.ops.corope.decode(
            q, k, v, w, s, D, "first"
        ),
        **{
            f"corope_decode {name} (kernels alone)": (
                lambda m=module: m.corope_decode(q, k, v, w, s, D, "first")
            )
            for name, module in versions.items()
        },
        "rope_attention, one query row": lambda: rope_attention(q, k, v),
        "apply_rope_qk of the new row + sdpa (no cache append)": lambda: sdpa_attention(
            *apply_rope_qk(q, k_new, angles)[:1], k, v
        ),
        "apply_rope_qk of the new row": lambda: apply_rope_qk(q, k_new, angles),
        "sdpa (nope)": lambda: sdpa_attention(q, k, v),
    }
    with torch.no_grad():
        return [dict(call=name, host_us=host_us(fn)) for name, fn in calls.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", nargs="*", type=Path, default=[], help="repository copies")
    ap.add_argument(
        "--sweep", nargs="*", default=[], help="settings to time, as NAME=VALUE,NAME=VALUE"
    )
    ap.add_argument("--out", type=Path, help="a directory for time_corope_decode.md")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("time_corope_decode.py times GPU kernels; no CUDA device here")
    versions = {"checkout": corope.decode}
    versions |= {
        str(root): load_module(root / "corope" / "decode.py", f"corope_decode_v{i}")
        for i, root in enumerate(args.versions)
    }
    gbps = copy_bandwidth(torch.device("cuda"), False)[1]
    with torch.no_grad():
        sweep = [
            {name: int(x) for name, x in (kv.split("=") for kv in arg.split(","))}
            for arg in args.sweep
        ]
        gpu = [row for case in CASES for row in gpu_rows(versions, case, gbps, sweep)]
    host = host_rows(versions)
    text = (
        f"# Decoding step attention, {torch.cuda.get_device_name()}, bf16\n\n"
        f"GPU time (CUDA graph), copy bandwidth {gbps:.4g} GB/s:\n\n"
        + markdown_table(gpu, ["shape", "provider", "gpu_us", "floor_us", "diff"])
        + "\n\nHost time per synchronized call (B = 1, 8/2 heads, D = 64, 512 cached keys):\n\n"
        + markdown_table(host, ["call", "host_us"])
    )
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "time_corope_decode.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
