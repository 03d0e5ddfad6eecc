"""What a trained Co-RoPE model counts: its leader gates and mileage over one input, as PNG.

    python experiments/plot_mileage.py RUN_DIR                           # the run's own task, test:0
    python experiments/plot_mileage.py RUN_DIR --example ood_long:3 --query 40
    python experiments/plot_mileage.py RUN_DIR --input-file prog.txt --out prog.png

``RUN_DIR`` is a training run's directory or the path of a checkpoint in one: the model and its
dataset are rebuilt from the resolved config that ``checkpoint.pt`` stores (for older
checkpoints without one, from Hydra's ``.hydra/config.yaml`` beside it, which a later launch
into the directory may have rewritten). The input
is an example of an eval split of the run's task (``--example SPLIT:INDEX``, the model reads
all but its last token, so for counting the last input token is the printed variable), or a
file encoded with the run's tokenizer (``--input-file``: a counting program as words, a code
file as bytes for ``data=stdlib``).

For each Co-RoPE layer (all of them, or those ``attention.nope_interval`` leaves rotating,
under their own indices) and KV group, the group's leader query (``attention.leader``: its first query
head, or the mean of its heads) gives every earlier key a gate ``z[i, j] = sigmoid(s <qL_i,
k_j>)`` (``s = 1/sqrt(head_dim)``) and the distance from query ``i`` to key ``j`` is the
mileage ``delta[i, j] = sum_{j < t <= i} z[i, t]`` (``corope/README.md``). The figure has, per
layer and group, the gates of the chosen query token (``--query``, default the last) over the
keys up to it, and the mileage from it to each of them beside the plain distance ``i - j``
that RoPE would use; the x axis is the input's tokens. For inputs of at most ``--matrix-max``
tokens a second figure (``<out>_matrix.png``) draws every ``[N, N]`` causal gate matrix.
``<out>_gates.md`` tables the query's mean gate per key token (what a head counts: for a
counting program, gates near 1 on ``++`` and near 0 elsewhere mean the mileage counts the
increments).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

# Run as a script (`python experiments/plot_mileage.py`): the repository root is not on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corope.naive import check_corope_inputs, gates, leader_query, mileage  # noqa: E402
from experiments.results_io import markdown_table  # noqa: E402
from lm import trained  # noqa: E402
from lm.data.base import LMDataset  # noqa: E402
from lm.model import GPT  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def load_run(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[DictConfig, GPT, LMDataset]:
    """The config, the model (eval mode, on the CPU, in ``dtype``, through the Co-RoPE
    reference) and the dataset of a Co-RoPE run: ``path`` is the run directory or its
    checkpoint file."""
    cfg, model, dataset = trained.load_run(path, dtype=dtype, impl="torch")
    if cfg.attention.name != "corope":
        raise ValueError(f"run: {path} is a {cfg.attention.name!r} run; gates need corope")
    return cfg, model, dataset


@contextlib.contextmanager
def capture_attention(model: GPT) -> Iterator[list[tuple[torch.Tensor, ...]]]:
    """Inside the block, every forward appends per layer ``(q, k, v, o)``: the attention op's
    inputs ``q [B, H, N, D]``, ``k, v [B, HKV, N, D]`` and its output ``o [B, H, N, D]``."""
    captured: list[tuple[torch.Tensor, ...]] = []
    for block in model.blocks:
        attend = block.attn.attend

        def recording(q, k, v, _attend=attend):
            o = _attend(q, k, v)
            captured.append(tuple(t.detach() for t in (q, k, v, o)))
            return o

        block.attn.attend = recording  # an instance attribute shadows the method
    try:
        yield captured
    finally:
        for block in model.blocks:
            del block.attn.attend


def leader_gates(q: torch.Tensor, k: torch.Tensor, leader: str) -> torch.Tensor:
    """The causal gate matrix ``z [B, HKV, N, N]`` of each KV group's leader query.

    ``q [B, H, N, D]``, ``k [B, HKV, N, D]``; ``z[..., i, j] = sigmoid(s <qL_i, k_j>)`` for
    ``j <= i``, 0 above the diagonal, with the reference's scale ``s`` (``corope.naive``)."""
    _, s = check_corope_inputs(q, k, k, None, leader, None)
    B, H, N, D = q.shape
    qL = leader_query(q.view(B, k.shape[1], H // k.shape[1], N, D), leader)
    causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    return gates(qL, k, s, causal)


@torch.no_grad()
def gates_and_mileage(
    model: GPT, leader: str, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(z, delta, layers)``: ``z`` and ``delta`` ``[L, HKV, N, N]``, per Co-RoPE layer the
    leader gates and the mileage of the input ``ids [N]`` (one sequence); ``layers`` those
    layers' indices (``attention.nope_interval``'s layers, without rotation, have no gates)."""
    with capture_attention(model) as captured:
        model(ids[None])
    layers = [i for i, block in enumerate(model.blocks) if block.attn.rotary]
    z = torch.stack([leader_gates(*captured[i][:2], leader)[0] for i in layers])
    return z, mileage(z), layers


def token_labels(dataset: LMDataset, ids: list[int]) -> list[str]:
    """One printable label per token (bytes shown as ``repr`` without quotes)."""
    labels = []
    for i in ids:
        text = dataset.decode([i])
        labels.append(repr(text)[1:-1] if len(text) == 1 else text)
    return labels


def input_ids(dataset: LMDataset, example: str | None, input_file: Path | None) -> list[int]:
    """The tokens the model reads: an eval example without its last token, or a file."""
    if input_file is not None:
        ids = dataset.encode(input_file.read_text())
        if not ids:
            raise ValueError(f"--input-file: {input_file} encodes to no tokens")
        return ids
    split, _, index = (example or "").partition(":")
    if not hasattr(dataset, "eval_examples"):
        raise ValueError(
            f"--example needs a task; {type(dataset).__name__} is a corpus: use --input-file"
        )
    if split not in dataset.eval_splits() or not index.isdigit():
        raise ValueError(
            f"--example must be SPLIT:INDEX with SPLIT in {dataset.eval_splits()}, got {example!r}"
        )
    examples = dataset.eval_examples(split)
    if int(index) >= len(examples):
        raise ValueError(f"--example: {split} has {len(examples)} examples, got index {index}")
    return examples[int(index)].tokens[:-1].tolist()


def gates_by_token(z: torch.Tensor, layers: list[int], labels: list[str], query: int) -> str:
    """A markdown table: per key token (the distinct labels of keys ``0..query``, most
    frequent first, with their count) the mean gate that query ``query`` gives keys of that
    token, a column per layer (of ``layers``) and group (``z [L, HKV, N, N]``)."""
    names = _panel_names(z, layers)
    keys = labels[: query + 1]
    row = z[:, :, query, : query + 1].reshape(len(names), query + 1).double()
    rows = []
    for token in sorted(set(keys), key=lambda t: (-keys.count(t), t)):
        cols = torch.tensor([t == token for t in keys])
        shown = token.replace("|", "\\|")
        means = {n: f"{m:.3f}" for n, m in zip(names, row[:, cols].mean(1).tolist(), strict=True)}
        rows.append({"key token": f"`{shown}`", "count": int(cols.sum()), **means})
    return markdown_table(rows, ["key token", "count", *names])


def _panel_names(z: torch.Tensor, layers: list[int]) -> list[str]:
    """``L<layer> g<group>`` for each (layer, KV group) of ``z [L, HKV, ...]``, layer-major,
    ``layers`` the model's indices of its ``L`` layers."""
    return [f"L{l} g{g}" for l in layers for g in range(z.shape[1])]


def _ticks(ax, labels: list[str], fontsize: float) -> None:
    every = max(1, len(labels) // 120)
    positions = list(range(0, len(labels), every))
    ax.set_xticks(positions, [labels[p] for p in positions], rotation=90, fontsize=fontsize)


def draw_row(
    z: torch.Tensor,
    delta: torch.Tensor,
    layers: list[int],
    labels: list[str],
    query: int,
    path: Path,
) -> None:
    """Two panels over keys ``0..query`` sharing the token axis: the gates of query row
    ``query`` as a heatmap with a row per layer and group (``z [L, HKV, N, N]``), and the
    mileage from the query to each key per layer and group (``delta``) beside ``query - j``."""
    L, G = z.shape[:2]
    names = _panel_names(z, layers)
    keys = labels[: query + 1]
    fig, (ax_z, ax_d) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(min(40.0, 4.0 + 0.14 * len(keys)), 2.5 + 0.3 * L * G + 3.5),
        gridspec_kw={"height_ratios": [0.3 * L * G + 0.6, 3.5]},
    )
    rows = z[:, :, query, : query + 1].reshape(L * G, query + 1).float().numpy()
    image = ax_z.imshow(rows, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    ax_z.set_yticks(range(L * G), names, fontsize=7)
    # above the panel, so both panels keep the same width and the keys line up
    fig.colorbar(image, ax=ax_z, location="top", fraction=0.15, pad=0.02, label="gate")
    miles = delta[:, :, query, : query + 1].reshape(L * G, query + 1).float().numpy()
    cmap = plt.get_cmap("tab10" if L * G <= 10 else "tab20")
    for n, name in enumerate(names):
        ax_d.plot(miles[n], ".-", lw=1, ms=3, color=cmap(n % cmap.N), label=name)
    ax_d.plot(np.arange(query, -1, -1), ":", color="black", lw=1.5, label="i - j (RoPE)")
    ax_d.set_ylabel(f"distance from query {query}")
    ax_d.legend(fontsize=6, ncol=max(1, (L * G + 1) // 8))
    _ticks(ax_d, keys, 7 if len(keys) <= 80 else 5)
    ax_z.set_title(f"leader gates and mileage of query {query} ({labels[query]!r})", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_matrices(z: torch.Tensor, layers: list[int], labels: list[str], path: Path) -> None:
    """Every ``[N, N]`` causal gate matrix of ``z [L, HKV, N, N]`` (row = query, column =
    key; above the diagonal blank), ``layers`` the model's indices of its ``L`` layers."""
    L, G, N, _ = z.shape
    fig, axes = plt.subplots(L, G, figsize=(4.5 * G + 1, 4.2 * L), squeeze=False)
    mask = np.triu(np.ones((N, N), dtype=bool), 1)
    fontsize = 6 if N <= 48 else 4
    for l in range(L):
        for g in range(G):
            ax = axes[l, g]
            image = ax.imshow(
                np.ma.masked_where(mask, z[l, g].float().numpy()), cmap="viridis", vmin=0, vmax=1
            )
            ax.set_title(f"layer {layers[l]}, group {g}", fontsize=8)
            _ticks(ax, labels, fontsize)
            ax.set_yticks(range(N), labels, fontsize=fontsize)
            fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    """Draws the figures; returns ``{"ids", "labels", "query", "gates", "mileage", "layers",
    "paths"}`` (``gates`` and ``mileage`` ``[L, HKV, N, N]`` of the Co-RoPE layers ``layers``,
    ``paths`` the files written)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a Co-RoPE run directory or its checkpoint.pt")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--example", default="test:0", help="SPLIT:INDEX of the run's task (test:0)"
    )
    source.add_argument(
        "--input-file", type=Path, help="a text or code file, encoded by the run's tokenizer"
    )
    parser.add_argument(
        "--query", type=int, default=-1, help="the query token (default -1: the last)"
    )
    parser.add_argument("--max-tokens", type=int, help="keep only the first MAX_TOKENS tokens")
    parser.add_argument(
        "--matrix-max", type=int, default=96, help="gate matrices for inputs up to this length (96)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--out", type=Path, help="PNG path (default: <run dir>/mileage.png)")
    args = parser.parse_args(argv)

    cfg, model, dataset = load_run(args.run, DTYPES[args.dtype])
    try:
        ids = input_ids(dataset, None if args.input_file else args.example, args.input_file)
    except ValueError as e:
        parser.error(str(e))
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
        ids = ids[: args.max_tokens]
    if len(ids) > model.max_len:
        parser.error(
            f"the input has {len(ids)} tokens, more than the model's {model.max_len}: use --max-tokens"
        )
    if not -len(ids) <= args.query < len(ids):
        parser.error(f"--query must index the {len(ids)} input tokens, got {args.query}")
    query = args.query % len(ids)
    z, delta, layers = gates_and_mileage(model, cfg.attention.leader, torch.tensor(ids))
    labels = token_labels(dataset, ids)

    run_dir = args.run if args.run.is_dir() else args.run.parent
    out = args.out or run_dir / "mileage.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    draw_row(z, delta, layers, labels, query, out)
    table = out.with_name(out.stem + "_gates.md")
    table.write_text(
        f"Mean leader gate of query {query} ({labels[query]!r}) per key token, "
        f"`{' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
        + gates_by_token(z, layers, labels, query)
    )
    paths = [out, table]
    if len(ids) <= args.matrix_max:
        paths.append(out.with_name(out.stem + "_matrix.png"))
        draw_matrices(z, layers, labels, paths[-1])
    print(table.read_text(), end="")
    print("wrote " + ", ".join(map(str, paths)))
    return {
        "ids": ids,
        "labels": labels,
        "query": query,
        "gates": z,
        "mileage": delta,
        "layers": layers,
        "paths": paths,
    }


if __name__ == "__main__":
    main()
