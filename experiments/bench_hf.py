"""A transformers model with its stock attention and with ``fused_rope.hf``'s, in one process
on one GPU.

The model (``--model``): ``llama``, Llama 3 8B's layers (hidden 4096, 32 query heads and 8
key-value heads of 128, MLP 14336); or ``gemma3``, Gemma 3 12B's (hidden 3840, 16 query heads
and 8 key-value heads of 256, MLP 15360, local layers with a 1024-key window and base 1e4,
every sixth layer global with base 1e6); ``--layers`` of them (default 4; 6 for Gemma 3: five
local and one global), a 32000-token vocabulary, bf16 weights, SDPA, ``use_cache=False``. For
each sequence length, batch 1, the median time of

* ``stock``: transformers' forward (RoPE in PyTorch on q and k, then SDPA);
* ``no RoPE``: the stock forward with the rotation left out (its ``apply_rotary_pos_emb`` made
  the identity): the floor that RoPE's cost is measured against;
* ``auto`` and ``fused``: after ``fuse_rope_attention(model, impl=...)``.

Forward (no autograd: scoring) and forward+backward (the loss against random labels, then
its backward through every weight: training), timed eagerly (``do_bench``; a model's step is
long enough that the host does not bound it). The loss of each path against the stock one is
the accuracy column (bf16: rounding differences of order 1e-3).

    python experiments/bench_hf.py --out experiments/results/bench_hf_h200.md
    python experiments/bench_hf.py --model gemma3 --lengths 4096 16384 \
        --out experiments/results/bench_hf_gemma3_h200.md
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from experiments.results_io import environment, markdown_table, print_report  # noqa: E402
from experiments.timing import time_ms  # noqa: E402
from fused_rope.hf import fuse_rope_attention, unfuse_rope_attention  # noqa: E402

PATHS = ("stock", "no RoPE", "auto", "fused")
MODELS = {  # name: (transformers' config class, model prefix, title, config keys, layers)
    "llama": ("LlamaConfig", "Llama", "Llama 3 8B", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ), 4),
    "gemma3": ("Gemma3TextConfig", "Gemma3", "Gemma 3 12B", dict(
        hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    ), 6),
}  # fmt: skip


def make_model(name: str, layers: int):
    """``name``'s layers (``MODELS``), random weights, bf16 on the GPU, in training mode (no
    dropout)."""
    import transformers

    config_class, prefix, _, keys, _ = MODELS[name]
    if "layer_types" in keys:  # the pattern repeated over the layers
        keys = {**keys, "layer_types": (keys["layer_types"] * layers)[:layers]}
    config = getattr(transformers, config_class)(
        vocab_size=32000, num_hidden_layers=layers, max_position_embeddings=32768, **keys
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")._from_config(
        config, attn_implementation="sdpa"
    )
    return model.to("cuda", torch.bfloat16).train()


@contextlib.contextmanager
def path(model, name: str):
    """The model set up for one path, put back after."""
    modeling = sys.modules[type(model).__module__]  # the module whose rotation the layers call
    stock_rotation = modeling.apply_rotary_pos_emb
    if name == "no RoPE":
        modeling.apply_rotary_pos_emb = lambda q, k, cos, sin, *args, **kwargs: (q, k)
    elif name in ("auto", "fused"):
        fuse_rope_attention(model, impl=name)
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = stock_rotation
        unfuse_rope_attention(model)


def time_length(model, n: int) -> list[dict]:
    """One row per pass: each path's median ms and loss difference from the stock path's."""
    ids = torch.randint(0, 32000, (1, n), device="cuda")

    def loss():
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    def forward():
        with torch.no_grad():
            return loss()

    rows = {"fwd": {"N": n, "pass": "fwd"}, "fwd+bwd": {"N": n, "pass": "fwd+bwd"}}
    losses = {}
    params = list(model.parameters())
    for name in PATHS:
        with path(model, name):
            losses[name] = forward().item()
            rows["fwd"][f"{name} ms"] = time_ms(forward, graph=False, rep_ms=300)[0]
            rows["fwd+bwd"][f"{name} ms"] = time_ms(
                lambda: loss().backward(), graph=False, grad_to_none=params, rep_ms=300
            )[0]
    for row in rows.values():
        floor = row["no RoPE ms"]
        row["RoPE's cost, stock"] = f"{row['stock ms'] / floor - 1:+.1%}"
        row["RoPE's cost, auto"] = f"{row['auto ms'] / floor - 1:+.1%}"
        row["auto / stock"] = round(row["auto ms"] / row["stock ms"], 3)
    rows["fwd"]["loss - stock (auto, fused)"] = (
        f"{losses['auto'] - losses['stock']:+.1e}, {losses['fused'] - losses['stock']:+.1e}"
    )
    return list(rows.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="markdown file to write the table to")
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--model", choices=list(MODELS), default="llama")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's (MODELS)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_hf.py times a model on a GPU; no CUDA device here")
    _, _, title, _, default_layers = MODELS[args.model]
    layers = args.layers or default_layers
    model = make_model(args.model, layers)
    rows = [row for n in args.lengths for row in time_length(model, n)]
    columns = ["N", "pass", *(f"{p} ms" for p in PATHS), "RoPE's cost, stock",
               "RoPE's cost, auto", "auto / stock", "loss - stock (auto, fused)"]  # fmt: skip
    env = environment()
    text = (
        f"# transformers {title} ({layers} layers), stock and fused_rope.hf\n\n"
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
        f"{env['date']}; bf16, batch 1, median ms (do_bench).\n\n" + markdown_table(rows, columns)
    )
    print_report(text, args.out)


if __name__ == "__main__":
    main()
