"""Generate text with a trained model: ``python sample.py <run dir or checkpoint.pt>``.

Rebuilds the model and the dataset of the run from the config its checkpoint holds
(``lm.trained.load_run``: the data must be where the run found it, for the tokenizer and
lengths; a ``triton`` run runs its PyTorch path off CUDA), then continues a prompt with
``lm.generation.generate`` (a KV cache; on CUDA Co-RoPE decodes through its decoding kernels,
elsewhere through its PyTorch reference, one query row per step; ``--no-cache`` runs the
whole sequence at each step instead). Without ``--prompt`` the prompt is the first example of the run's
first evaluation split, up to where its answer starts (a task) or its first half (a
corpus), and the expected continuation is printed beside it. A continuation ends at the
data's end-of-sequence token (``<eos>`` of the corpora and the jsonl tasks) unless
``--stop none``.

    python sample.py outputs/2026-11-27/08-00-00 --tokens 20 --temperature 0
    python sample.py runs/ff/003-synth_flipflop_corope_seed0 --prompt "w 1 i 0 r" --tokens 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lm.data.base import IGNORE_INDEX, LMDataset
from lm.generation import check_sampling, generate
from lm.trained import load_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="a run's output directory or its checkpoint file")
    p.add_argument("--prompt", help="text to continue (default: the first evaluation example)")
    p.add_argument(
        "--tokens",
        type=int,
        help="tokens to generate (default: the expected continuation's length: a task's answer, "
        "a corpus window's next tokens up to 32; with --prompt, 32)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    p.add_argument("--samples", type=int, default=1, help="continuations of the prompt")
    p.add_argument(
        "--stop",
        choices=("eos", "none"),
        default="eos",
        help="eos (default): a continuation ends at the data's end-of-sequence token, where it "
        "has one; none: always --tokens tokens",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="run the whole sequence at every step instead of a KV cache: exact where the "
        "cache is only close (dynamic NTK scaling past its original length, lm.generation)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the sampling (default 0)")
    p.add_argument("--device", default="auto", help="auto (cuda if there), cpu, cuda, cuda:1")
    p.add_argument(
        "--impl",
        choices=("auto", "triton", "torch"),
        help="overrides the run's attention.impl (rope, corope); torch: the PyTorch path, for "
        "a model whose shapes the kernels do not take",
    )
    return p.parse_args(argv)


def default_prompt(dataset: LMDataset) -> tuple[list[int], list[int]]:
    """``(prompt, expected)`` ids from the first example of the first evaluation split: a
    task's input up to its first answer and that answer (its consecutive target tokens); a
    corpus window's first half and its next tokens, at most 32."""
    x, y = next(dataset.eval_batches(dataset.eval_splits()[0], 1))  # (1, L) each
    x, y = x[0], y[0]
    if dataset.kind == "task":
        first = int((y != IGNORE_INDEX).nonzero()[0, 0])
        end = first + 1
        while end < len(y) and y[end] != IGNORE_INDEX:
            end += 1
        # x[t] predicts y[t]: the prompt ends where the first target is predicted
        return x[: first + 1].tolist(), y[first:end].tolist()
    half = max(1, x.shape[0] // 2)
    return x[:half].tolist(), x[half : half + 32].tolist()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.samples < 1:
        raise SystemExit(f"--samples must be >= 1, got {args.samples}")
    if args.tokens is not None and args.tokens < 0:
        raise SystemExit(f"--tokens must be >= 0, got {args.tokens}")
    try:  # before the run loads, naming the flag
        check_sampling(args.temperature, args.top_k)
    except ValueError as error:  # "temperature must ...", "top_k must ..."
        raise SystemExit(f"--{str(error).replace('top_k', 'top-k')}") from None
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise SystemExit(
            f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch has no CUDA device")
    _, model, dataset = load_run(args.run, device=device, impl=args.impl)
    if args.prompt is None:
        ids, expected = default_prompt(dataset)
    else:
        ids, expected = dataset.encode(args.prompt), None
        if not ids:
            raise SystemExit("--prompt encodes to no tokens")
    if len(ids) >= model.max_len:
        raise SystemExit(
            f"the prompt has {len(ids)} tokens and the model's max_len is {model.max_len}: "
            "no room for a new one"
        )
    tokens = args.tokens
    if tokens is None:
        tokens = 32 if expected is None else len(expected)
    if len(ids) + tokens > model.max_len:
        tokens = model.max_len - len(ids)
        print(
            f"(--tokens cut to {tokens}: the model's max_len is {model.max_len})", file=sys.stderr
        )
    prompt = torch.tensor([ids] * args.samples, device=device)
    generator = torch.Generator(device).manual_seed(args.seed)
    out = generate(
        model,
        prompt,
        tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=generator,
        use_cache=not args.no_cache,
        stop_token=dataset.eos_id if args.stop == "eos" else None,
    )
    print(f"prompt:    {dataset.decode(ids)}")
    if expected is not None:
        print(f"expected:  {dataset.decode(expected)}")
    for row in out:
        new = row[len(ids) :].tolist()
        if args.stop == "eos" and dataset.eos_id in new:  # up to its first stop, not the fill
            new = new[: new.index(dataset.eos_id) + 1]
        print(f"generated: {dataset.decode(new)}")


if __name__ == "__main__":
    try:
        main()
    # a wrong path, prompt, argument or config: the message, no trace
    except (FileNotFoundError, ValueError, KeyError) as e:
        sys.exit(f"sample.py: {e}")
