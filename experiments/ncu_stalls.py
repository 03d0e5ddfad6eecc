"""Where a kernel's warps wait: a summary of an ncu source-page export.

``ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv`` lists every
SASS instruction of every profiled kernel with its warp-state samples by stall reason. This
prints, per kernel whose name contains ``--kernel``: the samples by reason (``selected`` is a
warp issuing; the rest are why it could not), the instruction mix weighted by executions, the
loops (each backward branch's range of addresses: instructions, samples and their largest
reasons, an enclosing loop's figures including its inner loops'), and the instructions with
the most samples (the three largest reasons of each).

    python experiments/ncu_stalls.py source.csv --kernel _corope_fwd --top 30
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
from pathlib import Path


def kernels(path: Path) -> list[tuple[str, list[dict]]]:
    """``(name, rows)`` per kernel section of the export, each row a dict by column name."""
    out, header = [], None
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                out.append((row[1], []))
                header = None
            elif header is None:
                header = row
            else:
                out[-1][1].append(dict(zip(header, row, strict=False)))
    return out


def address(row: dict) -> int:
    return int(row["Address"], 16)


def loops(rows: list[dict]) -> list[tuple[int, int]]:
    """``(first, last)`` address of each loop: a branch to an address before its own
    (ncu prints branch targets as absolute addresses; a target below the kernel's first
    address is read as an offset from it). Any backward branch counts, so a jump back from
    code the compiler placed out of line also makes a row, and two back edges to one head
    make two."""
    base = min(address(r) for r in rows)
    found = set()
    for r in rows:
        branch = re.search(r"\bBRA(?:\.\w+)*\s+(?:`\()?0x([0-9a-f]+)", r["Source"])
        if branch:
            target = int(branch.group(1), 16)
            target = target + base if target < base else target
            if target < address(r):  # (a branch to itself ends a kernel: no loop)
                found.add((target, address(r)))
    return sorted(found)


def summary(name: str, rows: list[dict], top: int) -> str:
    reasons = [c for c in rows[0] if c.startswith("stall_") and "(Not Issued)" not in c]
    count = lambda r, c: int(r.get(c) or 0)  # noqa: E731
    samples = sum(count(r, "Warp Stall Sampling (All Samples)") for r in rows)
    executed = sum(count(r, "Instructions Executed") for r in rows)
    lines = [f"## {name}", "", f"{len(rows)} SASS instructions, {samples} samples, "
             f"{executed} warp instructions executed", "", "| reason | samples | share |",
             "|---|---|---|"]  # fmt: skip
    by_reason = collections.Counter({c[6:]: sum(count(r, c) for r in rows) for c in reasons})
    lines += [f"| {c} | {v} | {v / max(samples, 1):.1%} |" for c, v in by_reason.most_common()]
    mix = collections.Counter()
    for r in rows:
        op = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", r["Source"])
        if op:
            mix[op.group(1)] += count(r, "Instructions Executed")
    lines += ["", "Instruction mix: " + ", ".join(
        f"{op} {v / max(executed, 1):.1%}" for op, v in mix.most_common(16))]  # fmt: skip
    lines += ["", "| loop (addresses) | instructions | samples | share | executed | largest reasons |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for first, last in loops(rows):
        body = [r for r in rows if first <= address(r) <= last]
        got = sum(count(r, "Warp Stall Sampling (All Samples)") for r in body)
        largest = sorted(((sum(count(r, c) for r in body), c[6:]) for c in reasons),
                         reverse=True)[:3]  # fmt: skip
        lines.append(
            f"| {first:#x}-{last:#x} | {len(body)} | {got} | {got / max(samples, 1):.1%} | "
            f"{sum(count(r, 'Instructions Executed') for r in body)} | "
            + ", ".join(f"{c} {v / max(got, 1):.0%}" for v, c in largest if v)
            + " |"
        )
    lines += ["", "| address | samples | executed | instruction | largest reasons |",
              "|---|---|---|---|---|"]  # fmt: skip
    hot = sorted(rows, key=lambda r: -count(r, "Warp Stall Sampling (All Samples)"))[:top]
    for r in hot:
        largest = sorted(((count(r, c), c[6:]) for c in reasons), reverse=True)[:3]
        lines.append(
            f"| {r['Address'][-5:]} | {count(r, 'Warp Stall Sampling (All Samples)')} | "
            f"{count(r, 'Instructions Executed')} | `{r['Source'].strip()}` | "
            + ", ".join(f"{c} {v}" for v, c in largest if v)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--kernel", default="", help="substring of the kernel names to summarize")
    ap.add_argument("--top", type=int, default=20, help="hottest instructions to list")
    args = ap.parse_args()
    found = [(n, r) for n, r in kernels(args.csv) if args.kernel in n and r]
    if not found:
        raise SystemExit(f"no kernel whose name contains {args.kernel!r} in {args.csv}")
    print("\n\n".join(summary(n, r, args.top) for n, r in found))


if __name__ == "__main__":
    main()
