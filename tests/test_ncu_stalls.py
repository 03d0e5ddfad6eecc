"""experiments/ncu_stalls.py on a hand-written ncu source-page export (no GPU, no ncu)."""

import csv

import pytest

from experiments.ncu_stalls import kernels, summary
from experiments.ncu_stalls import loops as ncu_loops

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_wait", "stall_selected", "stall_long_sb", "stall_wait (Not Issued)"]  # fmt: skip


def _export(path):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "other_kernel"])
        w.writerow(HEADER)
        w.writerow(["0x7f2a4d7a0010", "FADD R1, R2, R3", "5", "4", "5", "0", "0", "5"])
        w.writerow(["Kernel Name", "_corope_fwd_kernel"])
        w.writerow(HEADER)
        w.writerow(["0x7f2a4d7a7f00", "  MUFU.SIN R1, R2", "30", "100", "20", "10", "0", "20"])
        w.writerow(["0x7f2a4d7a7f10", "  @!P0 LDG.E.128 R4, desc[UR4][R6.64]", "70", "100", "0", "10",
                    "60", "0"])  # fmt: skip
        w.writerow(["0x7f2a4d7a7f20", "  FFMA R1, R1, R2, R3", "0", "200", "0", "0", "0", "0"])


def test_summary_counts_reasons_mix_and_hot_instructions(tmp_path):
    path = tmp_path / "source.csv"
    _export(path)
    found = kernels(path)
    assert [name for name, _ in found] == ["other_kernel", "_corope_fwd_kernel"]
    text = summary(*found[1], top=1)
    # 100 samples: long_sb 60, wait 20, selected 20; the "(Not Issued)" column is not a reason.
    assert "| long_sb | 60 | 60.0% |" in text and "| wait | 20 | 20.0% |" in text
    assert "Not Issued" not in text
    # Mix weighted by executions, the predicate stripped: FFMA 200 of 400.
    assert "FFMA 50.0%, MUFU 25.0%, LDG 25.0%" in text
    # Only the hottest instruction, with its largest reasons.
    rows = [line for line in text.splitlines() if "`" in line]
    assert len(rows) == 1 and "LDG.E.128" in rows[0] and "long_sb 60, selected 10" in rows[0]
    assert rows[0].startswith("| a7f10 | 70 | 100 |")


def test_unknown_kernel_is_an_error(tmp_path, monkeypatch):
    from experiments import ncu_stalls

    path = tmp_path / "source.csv"
    _export(path)
    monkeypatch.setattr("sys.argv", ["ncu_stalls.py", str(path), "--kernel", "_nope"])
    with pytest.raises(SystemExit, match="no kernel whose name contains '_nope'"):
        ncu_stalls.main()


def test_loops_nest_and_take_absolute_or_relative_targets(tmp_path):
    """Two loops, one inside the other: the inner loop's samples are in both rows; a branch
    target printed as an offset from the kernel's start is read as one; a forward branch and a
    branch to itself are no loops."""
    path = tmp_path / "source.csv"
    base = 0x7F2A4D7A0000
    rows = [
        (0x00, "MOV R1, R2", 1, 0),
        (0x10, "FFMA R1, R1, R2, R3", 10, 10),  # outer loop starts
        (0x20, "MUFU.SIN R4, R1", 30, 0),  # inner loop starts
        (0x30, f"@P0 BRA 0x{base + 0x20:x}", 5, 5),  # inner back edge, absolute target
        (0x40, "@P1 BRA 0x60", 0, 0),  # forward branch
        (0x50, "@P2 BRA.U 0x10", 4, 0),  # outer back edge, an offset, a modifier
        (0x60, "EXIT", 0, 0),
        (0x70, f"BRA 0x{base + 0x70:x}", 0, 0),  # the branch to itself after EXIT: no loop
    ]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "_corope_fwd_kernel"])
        w.writerow(HEADER)
        for at, text, wait, long_sb in rows:
            w.writerow([f"0x{base + at:x}", text, wait + long_sb, "1", wait, "0", long_sb, "0"])
    ((name, found),) = kernels(path)
    assert ncu_loops(found) == [(base + 0x10, base + 0x50), (base + 0x20, base + 0x30)]
    text = summary(name, found, top=1)
    # 65 samples in all: the outer loop 20+30+10+0+4 = 64, the inner 30+10 = 40.
    assert (
        f"| {base + 0x10:#x}-{base + 0x50:#x} | 5 | 64 | 98.5% | 5 | wait 77%, long_sb 23% |"
        in text
    )
    assert (
        f"| {base + 0x20:#x}-{base + 0x30:#x} | 2 | 40 | 61.5% | 2 | wait 88%, long_sb 12% |"
        in text
    )
