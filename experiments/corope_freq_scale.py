"""Co-RoPE's bf16 forward error as the frequencies grow, against the fp64 reference.

The kernels reduce each row's carried phase in fp64 once a key tile; the per-pair phase the
hardware sin/cos then see reaches ``2 pi + BLOCK_N * w``, about 134 radians at the ladder's
``w = 1``, and more for larger (learned or user-given) frequencies, where ``sin.approx``
loses accuracy. This measures whether that shows: the kernel's error beside the reference's
own in bf16 (the flash-attention rule's baseline), for ``inv_freq`` times 1 ... 256.

    python experiments/corope_freq_scale.py --out experiments/results
"""

import argparse
from pathlib import Path

import torch

from corope import corope_attention, corope_attention_ref
from experiments.results_io import environment, gpu_suffix
from fused_rope.frequencies import rope_frequencies
from tests.helpers import errors

SCALES = (1, 4, 16, 64, 256)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the markdown")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA: the hardware sin/cos is the question")
    torch.manual_seed(0)
    B, HQ, HKV, N, D = 1, 8, 2, 1024, 64
    q, k, v = (torch.randn(B, h, N, D, device="cuda") for h in (HQ, HKV, HKV))
    ladder = rope_frequencies(D)[0].cuda()
    env = environment()
    lines = [
        "# Co-RoPE's bf16 forward error as the frequencies grow",
        "",
        f"{env['gpu']}, commit {env['commit']}: (B, HQ/HKV, N, D) = ({B}, {HQ}/{HKV}, {N}, {D}); "
        "errors against the fp64 reference (max-abs / relative RMSE).",
        "",
        "| inv_freq x | kernel, bf16 | reference in bf16 |",
        "|---|---|---|",
    ]
    for scale in SCALES:
        w = ladder * scale
        ref = corope_attention_ref(q.double(), k.double(), v.double(), inv_freq=w.double())
        qb, kb, vb = (x.bfloat16() for x in (q, k, v))
        got, base = (
            errors(corope_attention(qb, kb, vb, inv_freq=w), ref),
            errors(corope_attention_ref(qb, kb, vb, inv_freq=w), ref),
        )
        lines.append(f"| {scale} | {got[0]:.3g} / {got[1]:.3g} | {base[0]:.3g} / {base[1]:.3g} |")
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = (
        args.out
        / f"corope_freq_scale{gpu_suffix(args.out / 'corope_freq_scale.md', env['gpu'])}.md"
    )
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
