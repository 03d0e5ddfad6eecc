"""Why the fp32 Co-RoPE backward exceeds flash-attention's 2x rule at large logits.

A backward that recomputes the softmax weights as ``P = exp(s - lse)``, with ``lse`` saved by
the forward (every FlashAttention-style backward), gets each weight's relative error from the
difference between the recomputed logit ``s`` and the logits ``lse`` was summed from. Eager
PyTorch computes ``lse`` from the very logits it exponentiates, so a dominant pair's rounding
error cancels in ``s - lse``; a backward whose logits are rounded differently (another order of
the score sum, another fold of the scale) keeps an error of about one unit in the last place of
``|s|``, which grows with the softmax scale while the eager baseline's does not.

Two tables, against float64:

1. plain causal attention in PyTorch (no kernel): the relative RMSE of ``P`` for eager fp32,
   for ``P`` recomputed from logits summed in another order (one serial sum against the
   baseline's matrix product) with the eager ``lse``, and recomputed in the eager order;
2. the Co-RoPE backward kernel (``corope.backward.corope_bwd``, fp32, fed the fp32 reference's
   ``o`` and ``lse`` as the tests do): its gradients' relative RMSE over the fp32 reference's,
   the largest over ``--seeds`` seeds, at the shapes of ``corope/README.md`` (Tests).

Without CUDA the kernel runs in the Triton interpreter (a few minutes); ``--no-kernel`` skips it.

    python experiments/corope_large_logits.py [--scales 0.125 0.3 0.6 0.9] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from corope.backward import corope_bwd  # noqa: E402
from corope.naive import corope_attention_ref, corope_inv_freq  # noqa: E402
from experiments.results_io import RESULTS, environment, markdown_table, print_report  # noqa: E402

# (B, HQ, HKV, N, D, leader, detach_mileage): the two cases of corope/README.md's table
KERNEL_CASES = {
    "G = 8": (1, 16, 2, 64, 64, "mean", True),
    "G = 1": (1, 1, 1, 65, 32, "first", False),
}


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def plain_attention_weights(scale: float, seed: int, n: int = 65, d: int = 32) -> dict[str, float]:
    """Relative RMSE of causal ``P`` (``[n, n]``, unit normal q, k ``[n, d]``) against float64
    for the three ways of forming it (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    masked = ~torch.ones(n, n, dtype=torch.bool).tril()
    p64 = torch.softmax((scale * (q.double() @ k.double().T)).masked_fill(masked, -torch.inf), -1)
    eager = scale * (q @ k.T)
    serial = torch.zeros(n, n)
    for c in range(d):  # one serial sum per score, as a kernel's loop over the channels
        serial = serial + q[:, c, None] * k[None, :, c]
    serial = scale * serial

    def lse(s):
        return torch.logsumexp(s.masked_fill(masked, -torch.inf), -1, keepdim=True)

    def weights(s, lse):
        return torch.exp(s - lse).masked_fill(masked, 0.0)

    return {
        "eager": rel_rmse(weights(eager, lse(eager)), p64),
        "other order, eager lse": rel_rmse(weights(serial, lse(eager)), p64),
        "other order, own lse": rel_rmse(weights(serial, lse(serial)), p64),
    }


def _reference_grads(q, k, v, do, dtype, **kw):
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    o, lse = corope_attention_ref(q, k, v, return_lse=True, **kw)
    return (o.detach(), lse.detach(), *torch.autograd.grad(o, (q, k, v), do.to(dtype)))


def kernel_grads(case, scale: float, seed: int, device: torch.device):
    """``(kernel, baseline, truth)``: the kernel's dq, dk, dv, the fp32 reference's and float64
    autograd's through the reference, at ``case`` with inputs drawn from ``seed``."""
    B, HQ, HKV, N, D, leader, detach = case
    kw = dict(leader=leader, detach_mileage=detach, softmax_scale=scale)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, h, N, D, generator=gen).to(device) for h in (HQ, HKV, HKV, HQ))
    truth = _reference_grads(q, k, v, do, torch.float64, **kw)[2:]
    o, lse, *baseline = _reference_grads(q, k, v, do, torch.float32, **kw)
    w = corope_inv_freq(D, 10000.0, None, device)
    grads = corope_bwd(do, q, k, v, o, lse, w, scale, D, leader, detach, False)
    return grads[:3], tuple(baseline), truth


def kernel_ratios(case, scale: float, seeds: int, device: torch.device) -> list[float]:
    """The largest over ``seeds`` of the kernel's rel-RMSE over the fp32 reference's, for dq,
    dk and dv, both against float64 autograd through the reference."""
    worst = [0.0, 0.0, 0.0]
    for seed in range(seeds):
        grads, baseline, truth = kernel_grads(case, scale, seed, device)
        for i in range(3):
            ratio = rel_rmse(grads[i], truth[i]) / rel_rmse(baseline[i], truth[i])
            worst[i] = max(worst[i], ratio)
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.125, 0.3, 0.6, 0.9])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-kernel", action="store_true", help="the plain-attention table only")
    parser.add_argument("--out", type=Path, help="markdown file (default: experiments/results/)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or any(not s > 0 for s in args.scales):
        parser.error(f"--seeds must be >= 1 and --scales > 0, got {args.seeds}, {args.scales}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    rows = []
    for scale in args.scales:
        errs = [plain_attention_weights(scale, seed) for seed in range(args.seeds)]
        mean = {name: sum(e[name] for e in errs) / len(errs) for name in errs[0]}
        row = {"softmax_scale": scale, **{name: f"{e:.2e}" for name, e in mean.items()}}
        for lse in ("eager", "own"):
            row[f"ratio, {lse} lse"] = f"{mean[f'other order, {lse} lse'] / mean['eager']:.2f}"
        rows.append(row)
    env = environment()
    text = (
        f"# Softmax weights recomputed from a saved lse, fp32 ({env['gpu']}, torch "
        f"{env['torch']}, triton {env['triton']}, {env['commit']}, {env['date']})\n\n"
        f"Plain causal attention (65 x 65, d = 32, unit normal q and k), rel-RMSE of P against "
        f"float64, mean of {args.seeds} seeds:\n\n" + markdown_table(rows, list(rows[0]))
    )
    if not args.no_kernel:
        krows = []
        for scale in args.scales:
            row = {"softmax_scale": scale}
            for label, case in KERNEL_CASES.items():
                ratios = kernel_ratios(case, scale, args.seeds, device)
                row[f"{label}: dq / dk / dv"] = " / ".join(f"{r:.2f}" for r in ratios)
            krows.append(row)
            print(row, flush=True)
        mode = "GPU" if device.type == "cuda" else "Triton interpreter"
        text += (
            f"\nThe Co-RoPE backward kernel ({mode}, fp32), rel-RMSE over the fp32 reference's, "
            f"the largest of {args.seeds} seeds (the 2x rule allows 2):\n\n"
            + markdown_table(krows, list(krows[0]))
        )
    out = (
        args.out or RESULTS / f"corope_large_logits_{'gpu' if device.type == 'cuda' else 'cpu'}.md"
    )
    print_report(text, out)


if __name__ == "__main__":
    main()
