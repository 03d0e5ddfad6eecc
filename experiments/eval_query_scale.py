"""Evaluates trained runs again with Llama 4's query scale set at evaluation time.

    python experiments/eval_query_scale.py RUN_DIR [RUN_DIR ...] --betas 0,0.1,0.3,1 \\
        --length 512 --out experiments/results/query_scale_counting

Each run (a directory of ``train.py``, or its checkpoint) is loaded as trained
(``lm.trained.load_run``); then, for each ``beta``, every attention layer's queries at position
``p`` are multiplied by ``1 + beta ln(1 + floor(p / length))`` (``attention.query_scale``, as
if the run had been configured with it) and every eval split is evaluated. ``beta = 0`` is the
run as trained, unless it was trained with a query scale, which ``--betas`` then replaces.
With ``length`` the training length, the scale is 1 on every position training saw, so the
in-distribution splits do not move and the longer ones (``ood_long``, ``valid@2x``) show what
sharpening the far queries' attention does to a model that never saw it.

Writes ``query_scale.csv`` (a row per run and beta: every metric) and ``query_scale.md``
(``mean ± std`` over the runs of each attention, per beta and metric) into ``--out``, and
prints the table.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lm.attention import query_scale  # noqa: E402
from lm.evaluation import evaluate  # noqa: E402
from lm.trained import load_run  # noqa: E402


def set_query_scale(model: torch.nn.Module, beta: float, length: int) -> None:
    """Every attention layer of ``model`` scales its queries by ``(beta, length)``, checked as
    the config ``attention.query_scale`` is."""
    scale = query_scale(OmegaConf.create({"query_scale": {"beta": beta, "length": length}}))
    for block in model.blocks:
        block.attn.query_scale = scale


def evaluate_run(path: Path, betas: list[float], length: int, device: str, batch_size: int):
    """``[(variant, beta, metrics)]`` for one run, ``variant`` its attention's name (with
    ``+qs`` where it was trained with a query scale)."""
    cfg, model, dataset = load_run(path, device=device)
    variant = cfg.attention.name
    if cfg.attention.get("query_scale", {}).get("beta") is not None:
        qs = cfg.attention.query_scale
        variant += f"+qs(beta={qs.beta},length={qs.length})"
    rows = []
    for beta in betas:
        set_query_scale(model, beta, length)
        with torch.no_grad():
            rows.append((variant, beta, evaluate(model, dataset, batch_size, torch.device(device))))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or checkpoints")
    parser.add_argument("--betas", default="0,0.1,0.3,1", help="comma-separated, each >= 0")
    parser.add_argument("--length", type=int, required=True, help="where the scale steps up")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        betas = [float(b) for b in args.betas.split(",")]
    except ValueError:
        parser.error(f"--betas must be comma-separated numbers, got {args.betas!r}")
    args.out.mkdir(parents=True, exist_ok=True)

    table, names = [], []
    for path in args.runs:
        for variant, beta, metrics in evaluate_run(
            path, betas, args.length, args.device, args.batch_size
        ):
            table.append({"run": str(path), "variant": variant, "beta": beta, **metrics})
            names += [m for m in metrics if m not in names]
    with open(args.out / "query_scale.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["run", "variant", "beta", *names])
        writer.writeheader()
        writer.writerows(table)

    cells = defaultdict(list)
    for row in table:
        cells[row["variant"], row["beta"]].append(row)
    shown = [m for m in names if m.endswith("/err") or m.endswith("/loss")]
    lines = [
        f"Query scale set at evaluation (length {args.length}); mean ± std over runs.",
        "",
        "| variant | beta | runs | " + " | ".join(shown) + " |",
        "|---|---|---|" + "---|" * len(shown),
    ]
    for (variant, beta), rows in cells.items():
        stats = []
        for m in shown:
            values = torch.tensor([r[m] for r in rows], dtype=torch.float64)
            std = f" ± {values.std().item():.3f}" if len(values) > 1 else ""
            stats.append(f"{values.mean().item():.3f}{std}")
        lines.append(f"| {variant} | {beta:g} | {len(rows)} | " + " | ".join(stats) + " |")
    command = " ".join(["python experiments/eval_query_scale.py", *sys.argv[1:]])
    lines += ["", f"Made by `{command}`."]
    (args.out / "query_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
