"""Quick timing of the Co-RoPE-GQA kernels alone (``corope_fwd``, ``corope_bwd``), bf16, causal.

The speed-work companion of ``bench_corope.py`` (which times every provider and writes the
shared CSV): this one launches the two kernels directly, with ``triton.testing.do_bench``
medians, for the shapes of issue 3, and prints one markdown table with the sin/cos floor
(``shared/docs/corope.md``), and the backward that also forms the frequencies' gradient
(``bwd_learned_freq_ms``: learned frequencies, ``freq_grad=True``) and the backward in its
deterministic mode (``bwd_deterministic_ms``: dk and dv added in a fixed order, what
``torch.use_deterministic_algorithms(True)`` selects). ``--out DIR`` also writes the table to
``DIR/time_corope_<label>.md``.

To compare versions of the kernels, copy the repository (or just its ``corope`` folder) once
per version, edit the copies, and pass them with ``--versions``: their ``corope/forward.py``
and ``corope/backward.py`` are loaded in this process next to the checkout's (a version's
backward imports ``corope.forward`` as the version's forward; the rest of the package,
``fused_rope`` included, is the checkout's), run on the same inputs, and each row
says how far the version's outputs and gradients are from the checkout's (the largest
difference over the largest value of each tensor).

    python experiments/time_corope.py --label after --out /tmp/t
    python experiments/time_corope.py --cases 1,8,2,64,4096 --label quick
    python experiments/time_corope.py --key-tiles 1 2 4 1000000   # backward split sweep
    python experiments/time_corope.py --versions /tmp/v_stages /tmp/v_dk   # A/B in one process
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import corope  # noqa: E402
import corope.backward  # noqa: E402
import corope.forward  # noqa: E402
from corope.naive import corope_inv_freq  # noqa: E402
from experiments.results_io import markdown_table  # noqa: E402

SINCOS_PER_S = 4.2e12
# (B, HQ, HKV, D, N): the task's table shape and issue 3's target shape.
CASES = [
    (1, 8, 2, 64, 4096),
    (1, 8, 2, 64, 16384),
    (1, 32, 8, 128, 1024),
    (1, 32, 8, 128, 16384),
]


def floor_ms(B: int, HKV: int, N: int, R: int) -> float:
    """Forward special-function floor: one sin and one cos per causal pair, group, frequency."""
    return 2 * B * HKV * (N * N / 2) * (R / 2) / SINCOS_PER_S * 1e3


def describe_config(config) -> str:
    """A forward ``triton.Config`` as ``(BLOCK_GM, BLOCK_N, warps, registers)`` text."""
    return (f"({config.kwargs['BLOCK_GM']}, {config.kwargs['BLOCK_N']}, {config.num_warps} "
            f"warps, {config.maxnreg or 255} registers)")  # fmt: skip


def load_module(path: Path, name: str) -> ModuleType:
    """The Python file at ``path`` loaded as a module of its own, named ``name``."""
    if not path.is_file():
        raise SystemExit(f"--versions: {path} does not exist")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_version(root: Path, index: int) -> tuple[ModuleType, ModuleType]:
    """``corope/forward.py`` and ``corope/backward.py`` of the copy at ``root``, as modules of
    their own. While the copy's backward loads, ``sys.modules["corope.forward"]`` is the copy's
    forward, so its ``import corope.forward`` / ``from corope.forward import ...`` get the copy's
    (what it shares with it may differ from the checkout's); ``from corope import forward`` and
    every other import of the package resolve to the checkout's."""
    modules = []
    saved = sys.modules["corope.forward"]
    try:
        for name in ("forward", "backward"):
            module = load_module(root / "corope" / f"{name}.py", f"corope_{name}_v{index}")
            modules.append(module)
            sys.modules["corope.forward"] = module  # for the backward's imports
    finally:
        sys.modules["corope.forward"] = saved
    return modules[0], modules[1]


def kernel_inputs(B: int, HQ: int, HKV: int, D: int, N: int):
    """Random bf16 ``q [B, HQ, N, D]``, ``k, v [B, HKV, N, D]``, a cotangent ``do`` like q, the
    default frequencies ``w [D/2]`` and the scale ``s = D^-1/2``, on the GPU: the arguments
    ``corope_fwd`` and ``corope_bwd`` take (full rotation, first leader)."""
    dev = torch.device("cuda")
    q = torch.randn(B, HQ, N, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16)
    return q, k, v, torch.randn_like(q), corope_inv_freq(D, 10000.0, None, dev), D**-0.5


def rel_diff(xs, ys) -> float:
    """Largest ``max |x - y| / max |x|`` over pairs of tensors."""
    return max(
        ((x.float() - y.float()).abs().max() / x.float().abs().max().clamp_min(1e-30)).item()
        for x, y in zip(xs, ys, strict=True)
    )


def time_case(B: int, HQ: int, HKV: int, D: int, N: int, rep_ms: int, key_tiles=(),
              versions=()) -> list[dict]:  # fmt: skip
    """One row per kernel version: the checkout's, then each ``(label, forward, backward)``
    module pair of ``versions``, on the same inputs."""
    import triton.testing

    q, k, v, do, w, s = kernel_inputs(B, HQ, HKV, D, N)
    dev = q.device
    fl = floor_ms(B, HKV, N, D)
    rows, reference = [], None
    for label, fwd_mod, bwd_mod in (("checkout", corope.forward, corope.backward), *versions):

        def fwd(fwd_mod=fwd_mod):
            return fwd_mod.corope_fwd(q, k, v, w, s, D, "first")

        o, lse = fwd()

        def bwd(tiles=None, learn=False, ordered=False, bwd_mod=bwd_mod, o=o, lse=lse):
            learned = {"freq_grad": True} if learn else {}  # versions before session 36 lack it
            return bwd_mod.corope_bwd(do, q, k, v, o, lse, w, s, D, "first", False, ordered,
                                      key_tiles_per_program=tiles, **learned)  # fmt: skip

        outputs = (o, lse, *bwd()[:3])  # dq, dk, dv (session 36 added dinv_freq, None here)
        if reference is None:
            reference = outputs
        t_f = triton.testing.do_bench(fwd, warmup=25, rep=rep_ms, return_mode="median")
        t_b = triton.testing.do_bench(bwd, warmup=25, rep=rep_ms, return_mode="median")
        # the backward that also forms dinv_freq (learned frequencies), where the version has it
        learns = "freq_grad" in inspect.signature(bwd_mod.corope_bwd).parameters
        t_learn = "-"
        if learns:
            t_learn = "{:.3f}".format(
                triton.testing.do_bench(lambda: bwd(learn=True), warmup=25, rep=rep_ms,
                                        return_mode="median")
            )  # fmt: skip
        t_ordered = triton.testing.do_bench(lambda: bwd(ordered=True), warmup=25, rep=rep_ms,
                                            return_mode="median")  # fmt: skip
        best = getattr(fwd_mod._corope_fwd_kernel, "best_config", None)
        # The backward with the key sweep split into programs of `tiles` key tiles (the
        # default is the backward's _key_tiles_per_program choice; a large number: no split).
        split = {
            f"bwd_ms@{tiles}": "{:.3f}".format(
                triton.testing.do_bench(lambda t=tiles: bwd(t), warmup=25, rep=rep_ms,
                                        return_mode="median")
            )
            for tiles in key_tiles
        }  # fmt: skip
        # the tile the launcher fitted (its first choice unless shared memory was short)
        fitted = (torch.cuda.get_device_name(dev), HQ // HKV, D, D, q.dtype, "first", False,
                  False)  # fmt: skip
        # (the keys of versions from session 36 on end with freq_grad)
        sweep = ("sweep", *fitted)
        block_m, block_n, *_ = next(
            tile
            for key, tile in bwd_mod._FITTED.items()
            if key[: len(sweep)] == sweep and key[len(sweep) :] in ((), (False,))
        )
        tiles_default = bwd_mod._key_tiles_per_program(B * HKV, N, block_m, block_n, dev)
        config = "-" if best is None else describe_config(best)
        rows.append(
            {
                "version": label,
                "shape": f"({B}, {HQ}/{HKV}, {D})",
                "N": N,
                "fwd_ms": f"{t_f:.3f}",
                "bwd_ms": f"{t_b:.3f}",
                "bwd_learned_freq_ms": t_learn,
                "bwd_deterministic_ms": f"{t_ordered:.3f}",
                "bwd_key_tiles": tiles_default,
                "fwd+bwd_ms": f"{t_f + t_b:.3f}",
                "floor_fwd_ms": f"{fl:.3f}",
                "fwd/floor": f"{t_f / fl:.2f}",
                "bwd/fwd": f"{t_b / t_f:.2f}",
                "fwd_config": config,
                # o, lse, dq, dk, dv against the checkout's (bf16 outputs, fp32 atomics)
                "max_rel_diff": f"{rel_diff(reference, outputs):.1e}",
            }
            | split
        )
    return rows


def parse_case(text: str) -> tuple[int, ...]:
    """``"B,HQ,HKV,D,N"`` as five positive ints (an argparse type)."""
    try:
        case = tuple(int(x) for x in text.split(","))
    except ValueError:
        case = ()
    if len(case) != 5 or min(case) < 1:
        raise argparse.ArgumentTypeError(
            f"a case is B,HQ,HKV,D,N (five positive ints), got {text!r}"
        )
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="current", help="name of the kernel version timed")
    ap.add_argument("--cases", nargs="*", type=parse_case,
                    help="B,HQ,HKV,D,N tuples (default: issue 3's)")  # fmt: skip
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition budget")
    ap.add_argument("--out", type=Path, help="folder for time_corope_<label>.md")
    ap.add_argument(
        "--key-tiles",
        nargs="*",
        type=int,
        default=[],
        help="also time the backward at these key tiles per program (10**6: no split)",
    )
    ap.add_argument(
        "--versions",
        nargs="*",
        type=Path,
        default=[],
        help="copies of the repository whose corope/forward.py and backward.py to time too",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("time_corope.py times GPU kernels; no CUDA device here")
    cases = args.cases or CASES
    versions = [(str(root), *load_version(root, i)) for i, root in enumerate(args.versions)]
    print(f"kernels from {Path(corope.__file__).parent} ({args.label})", flush=True)
    rows = []
    for case in cases:
        rows += time_case(*case, rep_ms=args.rep_ms, key_tiles=args.key_tiles, versions=versions)
        print(*rows[-1 - len(versions) :], sep="\n", flush=True)
    text = f"### {args.label} ({torch.cuda.get_device_name()})\n\n" + markdown_table(
        rows, list(rows[0])
    )
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"time_corope_{args.label}.md").write_text(text)


if __name__ == "__main__":
    main()
