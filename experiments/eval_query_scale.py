"""Evaluates trained runs again with Llama 4's query scale set at evaluation time.

    python experiments/eval_query_scale.py RUN_DIR [RUN_DIR ...] --betas 0.1,0.3,1 \\
        --out experiments/results/query_scale_counting

Each run (a directory of ``train.py``, or its checkpoint) is loaded (``lm.trained.load_run``)
and evaluated on every eval split as trained (beta ``trained``), then once for each ``beta``
with every attention layer's queries at position ``p`` multiplied by
``1 + beta ln(1 + floor((p + offset) / length))`` (``attention.query_scale``, as if the run
had been configured with it, replacing the scale it was trained with, if any); ``--layers
nope``: only the layers without rotation (``attention.nope_interval``'s, as Llama 4), the
others unscaled (refused for a run without such layers). ``length`` is
``--length``, or by default the run's ``data.seq_len``: then the scale is 1 on every position
training saw, the in-distribution splits do not move, and the longer ones (``ood_long``,
``valid@2x``) show what sharpening the far queries' attention does to a model that never saw
it.

Writes ``query_scale.csv`` (a row per run and beta: every metric; written as each run
finishes) and ``query_scale.md`` (``mean ± std`` over the runs of each variant, per beta and
metric) into ``--out``, and prints the table. A variant is the runs' attention, with the
attention, model and data settings that differ between runs of that attention (the seed
aside).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lm.attention import resolve_query_scale  # noqa: E402
from lm.checkpoint import flatten_config  # noqa: E402
from lm.evaluation import evaluate  # noqa: E402
from lm.trained import load_run  # noqa: E402

DESCRIBED = ("attention", "model", "data")  # the config groups whose settings name a variant


def set_query_scale(
    model: torch.nn.Module, beta: float, length: int, layers: str, offset: int = 0
) -> None:
    """``model``'s attention layers scale their queries by ``(beta, length, offset)``: all of
    them, or with ``layers="nope"`` those without rotation (the others not at all; refused
    where every layer rotates); checked as the config ``attention.query_scale`` is."""
    if layers == "nope" and all(block.attn.rotary for block in model.blocks):
        raise ValueError("--layers nope: every layer of this run rotates (no nope_interval)")
    node = {"query_scale": {"beta": beta, "length": length, "layers": layers, "offset": offset}}
    for block in model.blocks:
        block.attn.query_scale = resolve_query_scale(node, block.attn.rotary)


def variant_names(configs: list[dict]) -> list[str]:
    """Each run's attention name, followed by the ``key=value`` settings of ``DESCRIBED`` in
    which it differs from another run of the same attention."""
    flat = [flatten_config({g: c[g] for g in DESCRIBED}) for c in configs]
    names = []
    for run in flat:
        peers = [f for f in flat if f["attention.name"] == run["attention.name"]]
        differing = sorted(k for k in run if any(repr(p.get(k)) != repr(run[k]) for p in peers))
        names.append(" ".join([run["attention.name"], *(f"{k}={run[k]}" for k in differing)]))
    return names


def parse_betas(text: str) -> list[float]:
    """``"0.1,0.3"`` -> ``[0.1, 0.3]``; ValueError unless each is a finite number >= 0."""
    betas = [float(b) for b in text.split(",")]
    for beta in betas:
        if not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"each beta must be finite and >= 0, got {beta}")
    return betas


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or checkpoints")
    parser.add_argument("--betas", default="0.1,0.3,1", help="comma-separated, each >= 0")
    parser.add_argument("--length", type=int, help="where the scale steps up (a run's seq_len)")
    parser.add_argument(
        "--layers",
        choices=("all", "nope"),
        default="all",
        help="scale every layer, or only those without rotation",
    )
    parser.add_argument("--offset", type=int, default=0, help="added to the positions (Llama 4: 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        betas = parse_betas(args.betas)
    except ValueError as e:
        parser.error(f"--betas {args.betas!r}: {e}")
    if args.length is not None and args.length < 1:
        parser.error(f"--length must be a positive int, got {args.length}")
    if args.offset < 0:
        parser.error(f"--offset must be >= 0, got {args.offset}")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    loaded = [load_run(path, device=device) for path in args.runs]
    configs = [OmegaConf.to_container(cfg, resolve=True) for cfg, _, _ in loaded]
    rows, metric_names = [], []
    with open(args.out / "query_scale.csv", "w", newline="") as f:
        writer = None
        for path, variant, (cfg, model, dataset) in zip(
            args.runs, variant_names(configs), loaded, strict=True
        ):
            length = args.length or cfg.data.seq_len
            for beta in ["trained", *betas]:
                if beta != "trained":
                    set_query_scale(model, beta, length, args.layers, args.offset)
                metrics = evaluate(model, dataset, args.batch_size, device)
                set_here = beta != "trained"  # the trained row keeps the run's own scale
                row = {"run": str(path), "variant": variant, "beta": beta,
                       "length": length if set_here else "",
                       "layers": args.layers if set_here else "",
                       "offset": args.offset if set_here else ""}  # fmt: skip
                rows.append(row | metrics)
                if writer is None:
                    metric_names = list(metrics)
                    writer = csv.DictWriter(f, [*row, *metric_names])
                    writer.writeheader()
                writer.writerow(rows[-1])
            f.flush()

    cells = defaultdict(list)
    for row in rows:
        cells[row["variant"], row["beta"]].append(row)
    shown = [m for m in metric_names if m.endswith("/err") or m.endswith("/loss")]
    lines = [
        f"Query scale set at evaluation on {args.layers} layers, offset {args.offset}; mean ± "
        "std over runs (beta `trained`: as trained).",
        "",
        "| variant | beta | length | runs | " + " | ".join(shown) + " |",
        "|---|---|---|---|" + "---|" * len(shown),
    ]
    for (variant, beta), cell in cells.items():
        stats = []
        for m in shown:
            values = torch.tensor([r[m] for r in cell], dtype=torch.float64)
            std = f" ± {values.std().item():.3f}" if len(values) > 1 else ""
            stats.append(f"{values.mean().item():.3f}{std}")
        lengths = ",".join(sorted({str(r["length"]) for r in cell}))
        lines.append(
            f"| {variant} | {beta} | {lengths} | {len(cell)} | " + " | ".join(stats) + " |"
        )
    command = " ".join(["python experiments/eval_query_scale.py", *(argv or sys.argv[1:])])
    lines += ["", f"Made by `{command}`."]
    (args.out / "query_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
