"""The benchmark scripts' ``--quick`` smoke runs (CPU: the Triton interpreter), so that a change
to a kernel's signature or to the results helpers cannot leave a benchmark broken until its
next GPU run. Each must exit 0, write its CSV rows, keep an earlier run's rows in its markdown,
and pass its own accuracy check; a wrong output must fail that check."""

from __future__ import annotations

import argparse
import copy
import csv
import os
import subprocess
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import corope.forward
from experiments import bench_rope, bench_rope_attention, results_io
from experiments.results_io import (
    ACC_FAIL,
    RESULTS,
    accuracy_failed,
    accuracy_note,
    output_dir,
    quick_and_output,
    upsert_rows,
)
from fused_rope._validation import interpreter_blocker
from tests.helpers import DEVICE, assert_close_to_baseline

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, op, markdown",
    [
        ("bench_corope.py", "corope", "bench_corope.md"),
        ("bench_rope.py", "rope_qk", "bench_rope.md"),
        ("bench_rope_attention.py", "rope_attention", "bench_rope_attention.md"),
        ("bench_decode.py", "decode", "bench_decode.md"),
    ],
)
def test_benchmark_quick_run(script, op, markdown, tmp_path):
    # The scripts run in the interpreter even on a GPU machine, whose preinstalled Triton and
    # numpy may be a pair the interpreter cannot run (the dev extra's pin is bypassed there).
    if (blocker := interpreter_blocker()) is not None:
        pytest.skip(blocker)
    # Without CUDA each script turns on the interpreter itself, before it imports Triton: the
    # variable is left out here so that the script's own setup is what runs.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg")
    # a row of an earlier run (another shape, as ``--shapes`` splits a run): the markdown is
    # rebuilt from the CSV, so it must keep this row
    earlier = dict(op=op, provider="earlier", mode="fwd", shape="earlier-shape", dtype="fp16",
                   gpu="cpu", torch="t", triton="t", commit="c", date="d", note="earlier run")  # fmt: skip
    upsert_rows([earlier], tmp_path / "benchmarks.csv")
    run = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with (tmp_path / "benchmarks.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["op"] == op]
    assert rows and all(r["ms"] or r["note"] for r in rows), rows
    text = (tmp_path / markdown).read_text()
    assert "earlier-shape" in text and "earlier run" in text, text
    assert ACC_FAIL not in text, text
    if op == "decode":  # cached decoding checked against the uncached forward
        assert {(r["provider"], r["mode"]) for r in rows if r["ms"]} >= {
            (variant, mode)
            for variant in ("rope", "corope", "nope")
            for mode in ("prefill", "decode step")
        }, rows
        steps = [r for r in rows if r["mode"] == "decode step"]
        assert all(r["note"].startswith("acc ok;") for r in steps), steps
    elif op == "corope":
        forwards = [r for r in rows if (r["provider"], r["mode"]) == ("corope_triton", "fwd")]
        assert forwards and all(r["note"].startswith("acc ok;") for r in forwards), forwards
    else:  # every timed provider's output checked (rope_attention's floor has no RoPE)
        checked = [r for r in rows if r["ms"] and r["provider"] != "sdpa_no_rope"]
        assert checked and all(r["note"].startswith("max err") for r in checked), checked
    if op == "rope_attention":
        assert "rows over the accuracy tolerance: 0" in text, text


@pytest.mark.slow
def test_host_cost_quick_run_stubs_every_launch():
    """``host_cost.py``'s CPU mode replaces the kernels by no-ops: the RoPE launcher bound its
    kernel as a default argument at import, so the stand-in never reached it and the run sat
    in the interpreter for hours (a review's find). A quick run times every call in seconds."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "host_cost.py"), "--quick"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    timed = [line for line in run.stdout.splitlines() if line.endswith(" us")]
    assert len(timed) == 9 and any("forward+backward" in line for line in timed), run.stdout


def test_a_quick_run_never_writes_into_the_committed_results(tmp_path):
    """A quick run (which a CPU forces) without --out writes to a temporary folder: in
    experiments/results/ it replaced the committed GPU tables with a smoke test's."""
    assert output_dir(None, quick=False, script="bench_corope") == RESULTS
    quick = output_dir(None, quick=True, script="bench_corope")
    assert RESULTS not in quick.parents and quick != RESULTS
    assert output_dir(tmp_path, quick=True, script="bench_corope") == tmp_path


def test_a_report_is_quick_with_quick_alone_and_then_never_in_the_committed_results(tmp_path):
    """A report (timing nothing) on a CPU rebuilds the committed tables (no GPU needed); with
    --quick it is the quick runs' report, in their temporary folder, unless --out names one."""
    cpu = torch.device("cpu")

    def chosen(quick, out=None, times=False):
        args = Namespace(quick=quick, out=out)
        return quick_and_output(args, cpu, "bench_rope_attention", times=times)

    assert chosen(quick=False) == (False, RESULTS)
    assert chosen(quick=True) == (True, output_dir(None, True, "bench_rope_attention"))
    assert RESULTS not in chosen(quick=True)[1].parents
    assert chosen(quick=True, out=RESULTS) == (True, RESULTS)  # named: the user's choice
    assert chosen(quick=False, times=True)[0]  # a timing run without CUDA is quick
    with pytest.raises(ValueError, match="script"):
        output_dir(None, True, "../results")


def test_bench_rope_attention_quick_report_leaves_the_committed_report(tmp_path, monkeypatch):
    """``--report GPU --quick`` without --out rewrote experiments/results/'s markdown and plots
    (from the committed CSV): it now rebuilds the quick runs' folder's; ``--report GPU`` alone
    still rewrites the committed one, also on a CPU."""
    committed, temp = tmp_path / "results", tmp_path / "tmp"
    monkeypatch.setattr(results_io, "RESULTS", committed)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    quick = temp / "bench_rope_attention_quick"
    rows = [dict(op="rope_attention", provider=p, mode="fwd", shape="Tiny (1,2,64,32)",
                 dtype="fp16", ms=1.0, gpu="cpu") for p in ("rope_attention", "sdpa_no_rope")]  # fmt: skip
    for folder in (committed, quick):
        upsert_rows(rows, folder / "benchmarks.csv")
    argv = ["bench_rope_attention.py", "--report", "cpu"]
    monkeypatch.setattr(sys, "argv", [*argv, "--quick"])
    bench_rope_attention.main()
    assert sorted(p.name for p in committed.iterdir()) == ["benchmarks.csv", "benchmarks.csv.lock"]
    assert "Tiny (1,2,64,32)" in (quick / "bench_rope_attention.md").read_text()
    monkeypatch.setattr(sys, "argv", argv)
    bench_rope_attention.main()
    assert (committed / "bench_rope_attention.md").is_file()


def test_plot_draws_rows_without_the_metric_as_no_bar(tmp_path):
    """bandwidth is the default metric once any row has it; an eager row without it used to
    stop the figure ('could not convert string to float')."""
    from experiments.plot_benchmarks import plot_op

    csv_path = tmp_path / "b.csv"
    common = dict(op="rope_qk", mode="fwd", shape="s", dtype="fp16", gpu="g", commit="c")
    upsert_rows([dict(common, provider="triton", ms=1.0, gbps=900.0),
                 dict(common, provider="eager", ms=3.0)], csv_path)  # fmt: skip
    out = plot_op("rope_qk", csv_path, tmp_path / "p.png")
    assert out.stat().st_size > 1000


def test_upsert_replaces_a_row_whose_key_has_an_empty_field(tmp_path):
    """A None key field is the empty string the file holds (it used to compare as "None" and
    append a second row); of two given rows with one key the later wins; a "|" in a value
    does not split a markdown cell."""
    from experiments.results_io import markdown_table

    path = tmp_path / "b.csv"
    row = dict(op="o", provider="p", mode="fwd", shape="s", dtype=None, gpu="g", ms=1.0)
    upsert_rows([row], path)
    upsert_rows([dict(row, ms=2.0), dict(row, ms=3.0)], path)
    with path.open() as f:
        assert [r["ms"] for r in csv.DictReader(f)] == ["3"]
    assert markdown_table([{"a": "x|y"}], ["a"]).splitlines()[-1] == "| x\\|y |"


def test_accuracy_note_flags_errors_over_the_tolerance():
    """The documented errors pass (RoPE's eager bf16 3.6e-2, fp16 4.9e-3); a larger one, or NaN,
    is an "ACC FAIL"."""
    assert not accuracy_failed({"note": accuracy_note(3.6e-2, "bf16")})
    assert not accuracy_failed({"note": accuracy_note(4.9e-3, "fp16")})
    for err in (1e-2, float("nan")):
        assert accuracy_failed({"note": accuracy_note(err, "fp16")})


def _perturbed(fn, by=0.05):
    """``fn`` with every output off by ``by``: a fast but wrong kernel."""

    def wrong(*args):
        out = fn(*args)
        return tuple(o + by for o in out) if isinstance(out, tuple) else out + by

    return wrong


def test_bench_rope_flags_a_wrong_output(monkeypatch):
    """A provider whose outputs are 0.05 off gets "ACC FAIL" rows and a failed verdict, however
    fast it is."""
    real = bench_rope.providers
    monkeypatch.setattr(
        bench_rope, "providers", lambda *a: {"triton": _perturbed(real(*a)["eager"])}
    )
    shape = bench_rope.QUICK_SHAPES[0]
    rows = bench_rope.run_case(shape, "fp16", 1.0, {}, torch.device("cpu"), quick=True)
    assert rows and all(r["note"].startswith(ACC_FAIL) for r in rows), rows
    assert bench_rope.verdict(rows, 1.0)[-1].startswith("VERDICT: FAIL")


def test_bench_corope_flags_a_wrong_output():
    """bench_corope's sampled-row check: the kernel's output passes; 0.05 off, at the start,
    the middle or the end of the sequence, it is an "ACC FAIL" naming the rows."""
    from experiments import bench_corope

    q, k, v = (torch.randn(1, h, 40, 32, device=DEVICE) for h in (2, 1, 1))
    o = bench_corope.corope_attention(q, k, v)
    assert bench_corope.rows_accuracy(o, q, k, v) == "acc ok"
    for row, block in ((0, 0), (20, 20), (39, 32)):  # the blocks of N = 40: 0+, 20+, 32+
        wrong = o.clone()
        wrong[:, :, row] += 0.05
        note = bench_corope.rows_accuracy(wrong, q, k, v)
        assert note.startswith(f"{ACC_FAIL} rows {block}+"), note


def test_bench_corope_flags_wrong_gradients(monkeypatch):
    """bench_corope's forward+backward row: the kernel's dq, dk, dv pass by the 2x rule; a
    kernel whose backward is 0.05 off is "ACC FAIL" there (dq first) while its forward row
    passes. No gradient was checked before (a review's find)."""
    from experiments import bench_corope

    real = bench_corope.corope_attention
    monkeypatch.setattr(bench_corope, "time_gpu_ms", lambda fn, **kw: ((2.0, 1.0, 3.0), 2.0, "cpu"))
    shape, N = bench_corope.QUICK_SHAPES[0], bench_corope.QUICK_NS[0]

    def kernel_rows():
        rows = bench_corope.run_case(shape, N, torch.float32, {}, torch.device(DEVICE), True)
        return {r["mode"]: r.get("note") for r in rows if r["provider"] == "corope_triton"}

    notes = kernel_rows()
    assert notes["fwd"] == "acc ok; cpu" and notes["fwd+bwd"].startswith("dq, dk, dv within"), notes
    monkeypatch.setattr(bench_corope, "corope_attention",
                        lambda *a: _WrongBackward.apply(real(*a)))  # fmt: skip
    notes = kernel_rows()
    assert notes["fwd"] == "acc ok; cpu" and notes["fwd+bwd"].startswith(f"{ACC_FAIL} dq: "), notes


def test_bench_corope_checks_a_windowed_output_against_the_windowed_reference():
    """bench_corope_window's accuracy note: a windowed output passes against the reference with
    the same window, and the unwindowed output (which differs where the window hides keys)
    fails it."""
    from experiments import bench_corope

    q, k, v = (torch.randn(1, h, 40, 32, device=DEVICE) for h in (2, 1, 1))
    o = bench_corope.corope_attention(q, k, v, window=6)
    assert bench_corope.rows_accuracy(o, q, k, v, window=6) == "acc ok"
    full = bench_corope.corope_attention(q, k, v)
    assert bench_corope.rows_accuracy(full, q, k, v, window=6).startswith(ACC_FAIL)


def test_bench_window_checks_sampled_rows_against_the_windowed_reference():
    """bench_window's accuracy note: the fused kernel's windowed output passes on every sampled
    block (so the blocks' rows sit at their own positions in the reference), the unwindowed
    output fails (rows 6 and 7 of the first block already lose keys), and a row 0.05 off fails
    naming its block. It
    compared the rivals with the kernel under test before, with no tolerance (a review)."""
    from experiments import bench_window

    q, k, v = (torch.randn(1, h, 40, 32, device=DEVICE) for h in (4, 2, 2))
    o = bench_window.rope_attention(q, k, v, impl="fused", window=6)
    assert bench_window.rows_accuracy(o, q, k, v, window=6) == "acc ok"
    full = bench_window.rope_attention(q, k, v, impl="fused")
    assert bench_window.rows_accuracy(full, q, k, v, window=6).startswith(f"{ACC_FAIL} rows 0+")
    wrong = o.clone()
    wrong[:, :, 35] += 0.05
    assert bench_window.rows_accuracy(wrong, q, k, v, window=6).startswith(f"{ACC_FAIL} rows 32+")


def test_bench_rope_attention_flags_a_wrong_output(monkeypatch):
    """rope_attention 0.05 off the fp32 reference: "ACC FAIL" rows, and its (shape, dtype,
    pass) miss the targets although it is as fast as the floor."""
    real = bench_rope_attention.providers

    def providers(*args):
        out = real(*args)
        return {"rope_attention": _perturbed(out["eager_rope+sdpa"]),
                "sdpa_no_rope": out["sdpa_no_rope"]}  # fmt: skip

    monkeypatch.setattr(bench_rope_attention, "providers", providers)
    shape = bench_rope_attention.QUICK_SHAPES["Tiny"]
    rows = bench_rope_attention.run_shape("Tiny", shape, "fp16", {}, torch.device("cpu"), True)
    main = [r for r in rows if r["provider"] == "rope_attention"]
    assert main and all(r["note"].startswith(ACC_FAIL) for r in main), main
    targets = [v["target"] for v in bench_rope_attention.verdicts(rows)]
    assert targets and all("accuracy: rope_attention" in t for t in targets), targets


class _WrongBackward(torch.autograd.Function):
    """The identity forward, a backward 0.05 off: a kernel whose gradients alone are wrong."""

    @staticmethod
    def forward(ctx, o):
        return o.clone()

    @staticmethod
    def backward(ctx, do):
        return do + 0.05


def test_bench_rope_attention_flags_wrong_gradients(monkeypatch):
    """A provider with the right output and a backward 0.05 off: its forward row passes, its
    forward+backward row is "ACC FAIL" (dq first) and that (shape, dtype, pass) misses the
    targets. Only the output was checked before, for both rows (a review's find)."""
    real = bench_rope_attention.providers

    def providers(*args):
        out = real(*args)
        eager = out["eager_rope+sdpa"]
        return {"rope_attention": lambda q, k, v: _WrongBackward.apply(eager(q, k, v)),
                "sdpa_no_rope": out["sdpa_no_rope"]}  # fmt: skip

    monkeypatch.setattr(bench_rope_attention, "providers", providers)
    monkeypatch.setattr(bench_rope_attention, "time_ms", lambda fn, **kw: (2.0, 1.0, 3.0))
    shape = bench_rope_attention.QUICK_SHAPES["Tiny"]
    rows = bench_rope_attention.run_shape("Tiny", shape, "fp16", {}, torch.device("cpu"), True)
    notes = {r["mode"]: r["note"] for r in rows if r["provider"] == "rope_attention"}
    assert not notes["fwd"].startswith(ACC_FAIL), notes
    assert notes["fwd+bwd"].startswith(f"{ACC_FAIL} dq: "), notes
    targets = {v["mode"]: v["target"] for v in bench_rope_attention.verdicts(rows)}
    assert "accuracy: rope_attention" in targets["fwd+bwd"], targets
    assert "accuracy" not in targets["fwd"], targets


@pytest.mark.parametrize("name", ["Tiny-GQA", "Tiny-Prefill"])
def test_sdpa_backends_runs_the_benchmark_shapes(name):
    """``sdpa_backends.run_shape`` takes ``bench_rope_attention``'s (B, HQ, HKV, NQ, NK, D)
    shapes: the default backend is timed and named, and a prefill's mask is at the bottom
    right (the last query sees every key), as the benchmark's floor."""
    from experiments.sdpa_backends import attention, run_shape

    shape = bench_rope_attention.QUICK_SHAPES[name]
    rows = run_shape(name, shape, "fp16", torch.device("cpu"))
    default = rows[0]
    assert default["backend"] == "default" and default["note"].startswith("ran: "), rows
    assert float(default["fwd_ms"]) > 0 and float(default["fwd+bwd_ms"]) > 0, rows
    B, HQ, HKV, NQ, NK, D = shape
    q, k, v = (torch.randn(B, h, n, D) for h, n in ((HQ, NQ), (HKV, NK), (HKV, NK)))
    last = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, -1:], k, v, enable_gqa=HQ != HKV
    )
    torch.testing.assert_close(attention(None)(q, k, v)[:, :, -1:], last)


def test_time_corope_loads_a_version_with_its_own_forward(tmp_path):
    """``time_corope.py --versions``: a version's backward that imports a name only the
    version's forward has must load, and the checkout's module must be back afterwards."""
    from experiments.time_corope import load_version

    (tmp_path / "corope").mkdir()
    forward = (ROOT / "corope" / "forward.py").read_text() + "\nVERSION_ONLY = 1\n"
    (tmp_path / "corope" / "forward.py").write_text(forward)
    backward = (ROOT / "corope" / "backward.py").read_text()
    line = "from corope.forward import check_index_span\n"
    assert line in backward
    backward = backward.replace(line, "from corope.forward import VERSION_ONLY, check_index_span\n")
    (tmp_path / "corope" / "backward.py").write_text(backward)
    fwd, bwd = load_version(tmp_path, 0)
    assert bwd.VERSION_ONLY == 1 and bwd.check_index_span is fwd.check_index_span
    assert sys.modules["corope.forward"] is corope.forward
    assert not hasattr(corope.forward, "VERSION_ONLY")


def test_rope_attention_verdicts_name_the_missed_target():
    """bench_rope_attention's target column: met, or which of the two targets missed; a
    prefill (no Liger or compile row) is judged on the floor alone."""
    from experiments.bench_rope_attention import verdicts

    def rows(shape, main, floor, liger=None):
        ms = {"rope_attention": main, "sdpa_no_rope": floor, "liger_rope+sdpa": liger}
        return [dict(shape=shape, dtype="bf16", mode="fwd", provider=p, ms=t)
                for p, t in ms.items() if t is not None]  # fmt: skip

    cells = (
        rows("a", 1.0, 0.95, liger=1.2)
        + rows("b", 1.2, 1.0, liger=1.0)
        + rows("c", 1.05, 1.0, liger=1.1)
        + rows("d", 1.05, 1.0)
        + rows("e", 1.2, 1.0)
    )
    targets = {v["shape"]: v["target"] for v in verdicts(cells)}
    assert targets == {
        "a": "met",
        "b": "MISSED (floor and alternatives)",
        "c": "MISSED (alternatives)",
        "d": "met (floor; no alternative runs it)",
        "e": "MISSED (floor)",
    }
    # Each provider's latest run stays in the CSV: a ratio across two commits says so.
    for row, commit in zip(cells[:3], ("abc", "abc", "def"), strict=True):
        row["commit"] = commit
    assert {v["shape"]: v["commits"] for v in verdicts(cells)}["a"] == "abc, def"


def test_sincos_rate_polynomial_matches_fp64():
    """``experiments/sincos_rate.py``'s FMA-pipe sin/cos: within 3e-6 of fp64 over the phases
    the Co-RoPE forward forms with 64-key tiles (up to ``2 pi + 64 w``, w <= 1), at a length
    that is not a multiple of its block; a strided input is read as such."""
    from experiments.sincos_rate import run_cos_sin_fma
    from tests.helpers import DEVICE

    x = torch.linspace(-1.0, 80.0, 100_003, device=DEVICE)
    c, s = run_cos_sin_fma(x)
    c, s, x = c.cpu(), s.cpu(), x.cpu()
    x64 = x.double()
    assert (c.double() - x64.cos()).abs().max().item() < 3e-6
    assert (s.double() - x64.sin()).abs().max().item() < 3e-6
    c2, _ = run_cos_sin_fma(x[::2].to(DEVICE))
    assert torch.equal(c2.cpu(), c[::2])
    with pytest.raises(ValueError, match="x must be a 1-D float32"):
        run_cos_sin_fma(x.double())


def test_time_corope_configs_parses_tiles():
    """``time_corope_configs.py --extra``: a tile becomes a forward config of 4 warps unless a
    fourth number gives them (registers 0: no cap); anything but three or four integers is
    refused with the tile's text."""
    import argparse

    from experiments.time_corope_configs import parse_tile

    config = parse_tile("32,64,168")
    assert (config.kwargs, config.num_warps, config.maxnreg) == (
        {"BLOCK_GM": 32, "BLOCK_N": 64}, 4, 168)  # fmt: skip
    assert parse_tile("16,32,0").maxnreg is None
    assert parse_tile("64,64,0,8").num_warps == 8
    for bad in ("32,64", "32,64,168,8,2", "32,64,x"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"'{bad}'"):
            parse_tile(bad)


def test_read_rows_keeps_one_gpu_orders_by_shape_and_reads_empty_timings_as_none(tmp_path):
    """A markdown of one GPU shows that GPU's rows only, in the script's shape order (shapes
    it does not list last), a timing left empty as None (not 0 ms); merged_environment joins
    the distinct values of split runs."""
    from experiments.results_io import merged_environment, read_rows

    path = tmp_path / "b.csv"
    common = dict(op="o", provider="p", mode="fwd", dtype="fp16", torch="2.9", commit="c")
    upsert_rows([dict(common, shape="other", gpu="H100", ms=1.0, date="d2"),
                 dict(common, shape="big", gpu="H100", ms=2.0, date="d1"),
                 dict(common, shape="small", gpu="H100", ms=None, note="OOM", date="d1"),
                 dict(common, shape="small", gpu="A100", ms=9.0, date="d1"),
                 dict(common, op="x", shape="small", gpu="H100", ms=8.0, date="d1")], path)  # fmt: skip
    rows = read_rows(path, "o", "H100", shape_order=["small", "big"])
    assert [(r["shape"], r["ms"]) for r in rows] == [("small", None), ("big", 2.0), ("other", 1.0)]
    assert rows[0]["tflops"] is None
    assert merged_environment(rows, ["gpu", "torch", "date"]) == {
        "gpu": "H100", "torch": "2.9", "date": "d1, d2"}  # fmt: skip


def test_upsert_that_fails_midway_leaves_the_previous_csv(tmp_path, monkeypatch):
    """Rows are written beside the CSV and moved over it (lm.checkpoint.replace_atomically): a
    run killed mid-write (a time limit) leaves the previous file whole and no temporary."""
    from experiments import results_io

    path = tmp_path / "b.csv"
    row = dict(op="o", provider="p", mode="fwd", shape="s", dtype="fp16", gpu="g", ms=1.0)
    upsert_rows([row], path)
    before = path.read_text()
    fmt = results_io._fmt

    def dying_fmt(value):
        if value == "boom":
            raise KeyboardInterrupt
        return fmt(value)

    monkeypatch.setattr(results_io, "_fmt", dying_fmt)
    with pytest.raises(KeyboardInterrupt):
        upsert_rows([dict(row, shape="t"), dict(row, shape="u", note="boom")], path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.csv", "b.csv.lock"]


def _upsert_forty(op: str, path: Path) -> None:
    for i in range(40):
        row = dict(op=op, provider="p", mode="fwd", shape=f"N{i}", dtype="bf16", gpu="g", ms=1.0)
        upsert_rows([row], path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks its writers")
def test_two_benchmarks_upserting_at_once_keep_every_row(tmp_path):
    """Two processes upserting rows into one CSV: every row of both stays. Without the lock
    each read-modify-write lost the other's rows (46 of 80 left), and a shared temporary
    name made one's move fail (a review's find)."""
    import multiprocessing

    path = tmp_path / "benchmarks.csv"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_upsert_forty, args=(op, path)) for op in ("a", "b")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert [writer.exitcode for writer in writers] == [0, 0]
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["op"], r["shape"]) for r in rows) == sorted(
        (op, f"N{i}") for op in ("a", "b") for i in range(40)
    )


def test_timing_helpers_on_fakes(monkeypatch):
    """experiments/timing.py without a GPU: quantiles are the median, 20th and 80th
    percentiles; the CPU timing leaves out a warm-up call; input_sets covers three times the
    L2 cache; peak_extra_mib is the peak over what was allocated before, less the excluded."""
    import time
    import types

    from experiments import timing

    # inclusive percentiles: 1 + 0.2 * 10 and 1 + 0.8 * 10 of the times 1 .. 11
    assert timing._quantiles([float(t) for t in range(11, 0, -1)]) == (6.0, 3.0, 9.0)
    assert timing._quantiles([5.0]) == (5.0, 5.0, 5.0)

    calls = []

    def fn():
        calls.append(None)
        if len(calls) == 1:
            time.sleep(0.3)  # a first call that compiles

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    median, p20, p80 = timing.time_ms(fn)
    assert len(calls) == 4 and p20 <= median <= p80 < 100.0

    cuda = torch.device("cuda")
    assert timing.input_sets(1000, torch.device("cpu")) == 1
    props = types.SimpleNamespace(L2_cache_size=50 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert timing.input_sets(10 * 2**20, cuda) == 15
    assert timing.input_sets(10**9, cuda) == 1

    assert timing.peak_extra_mib(fn, torch.device("cpu")) is None
    memory = {"allocated": 3 * 2**20, "peak": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: memory.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: memory["peak"])
    grow = lambda: memory.update(peak=memory["allocated"] + 5 * 2**20)  # noqa: E731
    assert timing.peak_extra_mib(grow, cuda, exclude_bytes=2**20) == 4.0


def test_corope_large_logits_explains_the_recomputed_weights(tmp_path):
    """``experiments/corope_large_logits.py``'s claim (corope/README.md, Tests): softmax weights
    recomputed from logits rounded otherwise than the saved lse lose accuracy as the logits
    grow, and not with their own lse; and its kernel measurement holds the 2x rule at the
    default scale."""
    from experiments import corope_large_logits as study

    small, large = (study.plain_attention_weights(scale, seed=0) for scale in (0.125, 0.9))
    assert small["other order, eager lse"] < 1.2 * small["eager"]
    assert large["other order, eager lse"] > 1.4 * large["eager"]
    assert large["other order, own lse"] < 1.2 * large["eager"]
    # The suite's rule, with its floor of 8 fp32 roundings of rel-RMSE: the bare ratio at this
    # 17-row shape, where both errors are near 1e-7, reached 2.15 for dk on an H200 (session 46)
    grads, baseline, truth = study.kernel_grads(
        (1, 2, 1, 17, 32, "mean", False), 32**-0.5, 0, torch.device(DEVICE)
    )
    for name, g, b, t in zip(("dq", "dk", "dv"), grads, baseline, truth, strict=True):
        assert_close_to_baseline(name, g, t, b)
    study.main(["--no-kernel", "--scales", "0.9", "--seeds", "1", "--out", str(tmp_path / "r.md")])
    assert "| 0.9 |" in (tmp_path / "r.md").read_text()


# ---- Published numbers: units, byte and FLOP counts, ratios, floors (a mutation review found
# ---- each of these could be wrong with every test above still passing).


def test_bench_rope_cycles_enough_input_copies_to_defeat_l2(monkeypatch):
    """``cycled_sets`` (the benchmark's and ``--tune``'s inputs): the given q and k first, then
    fresh copies, together three times the L2 cache (the tuner timed one set, in L2)."""
    import types

    from experiments import bench_rope

    q, k = torch.randn(1, 4, 64, 64), torch.randn(1, 1, 64, 64)  # 80 KiB read a call
    assert bench_rope.cycled_sets(q, k, torch.device("cpu")) == [(q, k)]
    props = types.SimpleNamespace(L2_cache_size=2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    sets = bench_rope.cycled_sets(q, k, torch.device("cuda"))
    assert len(sets) == 39 and sets[0] == (q, k)  # ceil(3 MiB / 80 KiB)
    assert all(a.shape == q.shape and b.shape == k.shape and not torch.equal(a, q)
               for a, b in sets[1:])  # fmt: skip


def test_cpu_time_ms_is_the_median_of_the_timed_runs_in_milliseconds(monkeypatch):
    """``time_ms`` without CUDA: the warm-up call is left out, each run is converted from
    seconds to milliseconds (not microseconds), and the reported value is the median of the
    runs, not their mean (a slow outlier must not move it); ``_quantiles`` likewise on skewed
    data."""
    from experiments import timing

    assert timing._quantiles([1.0, 1.0, 1.0, 1.0, 10.0])[0] == 1.0  # the mean is 2.8
    clock = {"now": 100.0}
    durations = iter([0.5, 0.001, 0.002, 0.009])  # s: warm-up (a compile), then three runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])

    def fn():
        clock["now"] += next(durations)

    median, p20, p80 = timing.time_ms(fn)
    assert median == pytest.approx(2.0)  # ms; the mean would be 4, microseconds 2000
    assert p20 <= median <= p80


def test_cuda_time_ms_returns_median_p20_p80_in_that_order(monkeypatch):
    """``time_ms`` on CUDA (faked: no GPU needed): the eager path asks ``do_bench`` for the
    median, 20th and 80th percentiles and returns them in that order (the CSV's ms, ms_p20,
    ms_p80); the graph path returns the median of ``do_bench_cudagraph``'s replays."""
    import triton.testing

    from experiments import timing

    by_quantile = {0.5: 5.0, 0.2: 2.0, 0.8: 8.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        triton.testing, "do_bench", lambda fn, quantiles, **kw: [by_quantile[q] for q in quantiles]
    )
    replays = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 9.0, 30.0]  # skewed: mean 5.0
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: list(replays))
    assert timing.time_ms(lambda: None, graph=False) == (5.0, 2.0, 8.0)
    assert timing.time_ms(lambda: None, graph=True)[0] == 1.0


def test_time_gpu_ms_replays_short_calls_in_a_graph_and_times_long_ones_eagerly(monkeypatch):
    """``time_gpu_ms`` (CUDA faked): a call under ``graph_below_ms`` eagerly gets the graph's
    quantiles (its eager median beside them), a longer one keeps ``do_bench``'s without a
    capture, and a call the graph cannot capture raises (a failed capture can leave CUDA's
    generator unusable for the next case: falling back would only move the failure)."""
    import triton.testing

    from experiments import timing

    eager = {"ms": 5.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, quantiles, **kw: [eager["ms"], eager["ms"], eager["ms"]])  # fmt: skip
    captured = []

    def graph(fn, **kw):
        captured.append(fn)
        return [1.0] * 10

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", graph)
    assert timing.time_gpu_ms(lambda: None) == ((1.0, 1.0, 1.0), 5.0, "graph")
    eager["ms"] = 25.0
    assert timing.time_gpu_ms(lambda: None) == ((25.0, 25.0, 25.0), 25.0, "eager")
    assert len(captured) == 1
    assert timing.time_gpu_ms(lambda: None, graph_below_ms=30.0)[2] == "graph"

    def uncapturable(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", uncapturable)
    eager["ms"] = 5.0
    with pytest.raises(RuntimeError, match="capturing"):
        timing.time_gpu_ms(lambda: None)


def test_upsert_keeps_one_row_per_dtype_and_replaces_only_the_rerun_dtype(tmp_path):
    """dtype is part of a row's key: a run writing fp16 and bf16 rows of one (op, provider,
    mode, shape, gpu) keeps both, and a rerun of bf16 alone replaces the bf16 row only."""
    from experiments.results_io import read_rows

    path = tmp_path / "b.csv"
    row = dict(op="o", provider="p", mode="fwd", shape="s", gpu="g")
    upsert_rows([dict(row, dtype="fp16", ms=1.0), dict(row, dtype="bf16", ms=2.0)], path)
    upsert_rows([dict(row, dtype="bf16", ms=3.0)], path)
    assert sorted((r["dtype"], r["ms"]) for r in read_rows(path, "o", "g")) == [
        ("bf16", 3.0), ("fp16", 1.0)]  # fmt: skip


def test_timings_keep_six_significant_digits_through_the_csv(tmp_path):
    """The CSV (and so every markdown table and ratio rebuilt from it) holds a timing to six
    significant digits: 0.0123456 ms is not published as 0.0123."""
    from experiments.results_io import markdown_table, read_rows

    path = tmp_path / "b.csv"
    upsert_rows([dict(op="o", provider="p", mode="fwd", shape="s", dtype="fp16", gpu="g",
                      ms=0.0123456, tflops=123.456)], path)  # fmt: skip
    (row,) = read_rows(path, "o", "g")
    assert (row["ms"], row["tflops"]) == (0.0123456, 123.456)
    assert "| 0.0123456 |" in markdown_table([row], ["ms"])


def test_accuracy_tolerance_is_two_ulps_at_magnitude_four_to_eight_for_bf16_too():
    """ACC_TOL: 2 * 2^-5 for bf16 (2 * 2^-8 for fp16). An error just over it fails, one at it
    passes; a looser bf16 tolerance would let a wrong bf16 kernel publish its speed."""
    assert not accuracy_failed({"note": accuracy_note(2 * 2.0**-5, "bf16")})
    assert accuracy_failed({"note": accuracy_note(0.07, "bf16")})
    assert not accuracy_failed({"note": accuracy_note(2 * 2.0**-8, "fp16")})
    assert accuracy_failed({"note": accuracy_note(0.0079, "fp16")})


def test_bench_rope_counts_bytes_read_and_written_and_reports_percent_of_copy(monkeypatch):
    """bench_rope's GB/s: q and k read once and written once per pass (2 x their bytes for the
    forward, twice that for forward+backward) over the median ms time_ms returns; ms, p20 and
    p80 go to their own columns; the note's "% of copy bw" is gbps / copy_gbps."""
    real = bench_rope.providers
    monkeypatch.setattr(bench_rope, "providers", lambda *a: {"triton": real(*a)["eager"]})
    monkeypatch.setattr(bench_rope, "time_ms", lambda fn, **kw: (0.5, 0.4, 0.6))
    B, HQ, HK, N, D = shape = bench_rope.QUICK_SHAPES[0]
    qk_bytes = B * (HQ + HK) * N * D * 2  # fp16
    fwd_gbps = 2 * qk_bytes / 0.5 / 1e6
    rows = bench_rope.run_case(shape, "fp16", 4 * fwd_gbps, {}, torch.device("cpu"), quick=True)
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["fwd"]["gbps"] == pytest.approx(fwd_gbps)
    assert by_mode["fwd+bwd"]["gbps"] == pytest.approx(2 * fwd_gbps)
    assert [by_mode["fwd"][c] for c in ("ms", "ms_p20", "ms_p80")] == [0.5, 0.4, 0.6]
    assert "; 25% of copy bw;" in by_mode["fwd"]["note"]
    assert "; 50% of copy bw;" in by_mode["fwd+bwd"]["note"]


def test_bench_rope_copy_bandwidth_counts_read_and_write(monkeypatch):
    """The copy floor every rope_qk row is compared with: bytes read + written (2 x the
    buffer) over the median ms, in GB/s."""
    monkeypatch.setattr(bench_rope, "time_ms", lambda fn, **kw: (2.0, 1.0, 3.0))
    ms, gbps = bench_rope.copy_bandwidth(torch.device("cpu"), quick=True)
    assert ms == 2.0
    assert gbps == pytest.approx(2 * (1 << 20) * 2 / 2.0 / 1e6)  # 2 MiB of fp16, read + write


def test_bench_rope_verdict_misses_a_faster_rival_and_a_large_shape_under_80_percent_copy():
    """bench_rope's verdict: a rival (Liger, torch.compile) at most as slow as triton is a
    MISS and a slower one is not; triton under 80% of the copy bandwidth at a large shape is
    a MISS, at 85% it is not; with every rival and large shape measured and met: PASS."""

    def case(shape, tri_gbps, liger_ms=2.0, compile_ms=2.0):
        common = dict(shape=shape, dtype="bf16", mode="fwd", note="max err 1e-3")
        return [dict(common, provider="triton", ms=1.0, gbps=tri_gbps),
                dict(common, provider="liger", ms=liger_ms, gbps=None),
                dict(common, provider="torch.compile", ms=compile_ms, gbps=None)]  # fmt: skip

    large = sorted(bench_rope.shape_id(s) for s in bench_rope.LARGE)
    met = [row for shape in large for row in case(shape, 850.0)]
    assert bench_rope.verdict(met, 1000.0)[-1].startswith("VERDICT: PASS")
    lines = bench_rope.verdict(case(large[0], 850.0, liger_ms=0.9) + case(large[1], 750.0), 1000.0)
    misses = [line for line in lines if line.startswith("MISS")]
    assert len(misses) == 2 and lines[-1].startswith("VERDICT: FAIL (2 misses)"), lines
    assert f"MISS {large[0]} bf16 fwd: liger 0.9000 ms <= triton 1.0000 ms" in misses
    assert any(m.startswith(f"MISS {large[1]} bf16 fwd: triton 750 GB/s < 80%") for m in misses)


def test_rope_attention_causal_flops_count_the_visible_pairs_of_query_heads():
    """TFLOPS' numerator: 4 * B * HQ * D per visible (query, key) pair, HQ the query heads
    (GQA's shared KV heads do not reduce the work); a square causal shape counts N^2 / 2
    pairs (anchors.md's convention), a prefill the pairs of its bottom-right mask."""
    from experiments.bench_rope_attention import QUICK_SHAPES, SHAPES, causal_flops

    assert causal_flops((2, 4, 4, 8, 8, 16)) == 4 * 2 * 4 * 16 * 8 * 8 / 2
    assert causal_flops((2, 4, 1, 8, 8, 16)) == causal_flops((2, 4, 4, 8, 8, 16))
    for B, HQ, HKV, NQ, NK, D in [
        QUICK_SHAPES["Tiny-Prefill"],
        SHAPES["Prefill-4K"],
        (1, 2, 1, 1, 9, 8),
    ]:
        pairs = torch.ones(NQ, NK, dtype=torch.bool).tril(NK - NQ).sum().item()  # lower right
        assert causal_flops((B, HQ, HKV, NQ, NK, D)) == 4 * B * HQ * D * pairs


def test_rope_attention_tflops_are_flops_over_ms_and_3_5x_for_the_backward(monkeypatch):
    """run_shape's tflops column: causal_flops / ms / 1e9 for the forward and 3.5 times the
    forward's FLOPs for forward+backward (anchors.md), over the median ms time_ms returns."""
    from experiments.bench_rope_attention import causal_flops

    real = bench_rope_attention.providers
    monkeypatch.setattr(bench_rope_attention, "providers",
                        lambda *a: {"sdpa_no_rope": real(*a)["sdpa_no_rope"]})  # fmt: skip
    monkeypatch.setattr(bench_rope_attention, "time_ms", lambda fn, **kw: (2.0, 1.0, 3.0))
    shape = bench_rope_attention.QUICK_SHAPES["Tiny-GQA"]
    rows = bench_rope_attention.run_shape("Tiny-GQA", shape, "fp16", {}, torch.device("cpu"), True)
    tflops = {r["mode"]: r["tflops"] for r in rows}
    assert tflops["fwd"] == pytest.approx(causal_flops(shape) / 2.0 / 1e9)
    assert tflops["fwd+bwd"] == pytest.approx(3.5 * causal_flops(shape) / 2.0 / 1e9)
    assert all((r["ms"], r["ms_p20"], r["ms_p80"]) == (2.0, 1.0, 3.0) for r in rows)


def test_rope_attention_verdicts_compare_with_the_best_alternative_and_fused_over_separate():
    """vs_best_alt is rope_attention's time over the *fastest* of Liger and torch.compile
    (here compile), and fused_vs_separate is fused's time over triton_rope+sdpa's."""
    from experiments.bench_rope_attention import verdicts

    ms = {"rope_attention": 0.95, "sdpa_no_rope": 1.0, "liger_rope+sdpa": 2.0,
          "compile(rope+sdpa)": 1.0, "fused": 1.0, "triton_rope+sdpa": 2.0}  # fmt: skip
    (v,) = verdicts([dict(shape="s", dtype="bf16", mode="fwd", provider=p, ms=t)
                     for p, t in ms.items()])  # fmt: skip
    assert (v["vs_floor"], v["vs_best_alt"], v["fused_vs_separate"]) == (0.95, 0.95, 0.5)
    assert v["target"] == "MISSED (alternatives)"
    assert v["of_peak"] is None  # no GPU named: no peak to divide by


def test_rope_attention_verdicts_give_the_share_of_the_tensor_core_peak():
    """of_peak and floor_of_peak: rope_attention's and SDPA's TFLOPS over the H100/H200 dense
    fp16/bf16 peak (989.4), from each row's own TFLOPS."""
    from experiments.bench_rope_attention import verdicts

    cell = [dict(shape="s", dtype="bf16", mode="fwd", provider=p, ms=1.0, tflops=t,
                 gpu="NVIDIA H200") for p, t in (("rope_attention", 494.7), ("sdpa_no_rope", 600))]  # fmt: skip
    (v,) = verdicts(cell)
    assert (v["of_peak"], v["floor_of_peak"]) == (0.5, round(600 / 989.4, 3))
    # a PCIe H100 (756 TFLOPS dense) is not given the SXM's peak
    (v,) = verdicts([dict(r, gpu="NVIDIA H100 PCIe") for r in cell])
    assert v["of_peak"] is None


def test_corope_sincos_floor_counts_causal_pairs_and_doubles_for_the_backward(monkeypatch):
    """bench_corope's floor (corope.md): sin and cos of R/2 phases per causal (query, key) pair
    (N^2 / 2 pairs) of each (batch, KV head) at 4.2e12 per second, in ms: 33 ms at the issue's
    16K shape; the fwd+bwd floor row is twice the forward's (the backward recomputes them)."""
    from experiments import bench_corope

    assert bench_corope.sincos_floor_ms(1, 8, 16384, 128) == pytest.approx(
        2 * 8 * (16384**2 / 2) * 64 / 4.2e12 * 1e3)  # fmt: skip
    assert 32 < bench_corope.sincos_floor_ms(1, 8, 16384, 128) < 34
    # run_case with the kernels and the timer stubbed: only the rows' arithmetic is checked
    monkeypatch.setattr(bench_corope, "corope_attention", lambda q, k, v: q * 1.0)
    monkeypatch.setattr(bench_corope, "corope_attention_ref", lambda q, k, v: q * 1.0)
    monkeypatch.setattr(bench_corope, "rows_accuracy", lambda *a: "acc ok")
    monkeypatch.setattr(bench_corope, "leaf_gradients", lambda *a: [])
    monkeypatch.setattr(bench_corope, "gradient_note", lambda *a: "not checked here")
    monkeypatch.setattr(bench_corope, "timer", lambda fn, **kw: ((1.0, 1.0, 1.0), "stub", False))
    B, HQ, HKV, D = shape = bench_corope.QUICK_SHAPES[0]
    rows = bench_corope.run_case(shape, 64, torch.float16, {}, torch.device("cpu"), True)
    floor = {r["mode"]: r["ms"] for r in rows if r["provider"] == "sincos_floor"}
    assert floor == {"fwd": bench_corope.sincos_floor_ms(B, HKV, 64, D),
                     "fwd+bwd": 2 * bench_corope.sincos_floor_ms(B, HKV, 64, D)}  # fmt: skip


def test_bench_corope_backward_row_is_the_graphs_difference_for_short_calls(monkeypatch):
    """A backward alone cannot be captured apart from its forward, so it is timed eagerly; where
    the forward and the forward+backward were CUDA graphs, its row is their difference (an eager
    backward of 1 ms beside a 0.2 ms forward+backward read as nonsense on the H200), and where
    they were not, the eager time stays."""
    import itertools

    from experiments import bench_corope

    for name in ("corope_attention", "corope_attention_ref", "rope_attention"):
        monkeypatch.setattr(bench_corope, name, lambda q, k, v, **kw: q * 1.0)
    monkeypatch.setattr(bench_corope, "rows_accuracy", lambda *a: "acc ok")
    monkeypatch.setattr(bench_corope, "leaf_gradients", lambda *a: [])
    monkeypatch.setattr(bench_corope, "gradient_note", lambda *a: "grads ok")

    def fake(how):
        graphed = itertools.chain([1.0, 3.0], itertools.repeat(0.5))  # fwd, fwd+bwd, then SDPA's

        hows = itertools.chain(how, itertools.repeat("graph")) if isinstance(how, list) else None

        def time_gpu_ms(fn, graph_below_ms=20.0, **kw):
            if graph_below_ms == 0.0:
                return (7.0, 6.0, 8.0), 7.0, "eager"
            t = next(graphed)
            return (t, t, t), 9.0, next(hows) if hows else how

        return time_gpu_ms

    shape = bench_corope.QUICK_SHAPES[0]
    cases = (("graph", 2.0, "fwd+bwd - fwd, both in CUDA graphs; eager 7 ms"),
             ("eager", 7.0, "timed eagerly"),
             (["graph", "eager"], 7.0, "timed eagerly"))  # a graphed forward alone: eager  # fmt: skip
    for how, expected, note in cases:
        monkeypatch.setattr(bench_corope, "time_gpu_ms", fake(how))
        rows = bench_corope.run_case(shape, 64, torch.float16, {}, torch.device("cpu"), True)
        (bwd,) = [r for r in rows if (r["provider"], r["mode"]) == ("corope_triton", "bwd")]
        assert bwd["ms"] == expected and bwd["note"].startswith(note), bwd


def test_bench_decode_times_three_prefills_and_the_steps_after_the_warm_up(monkeypatch):
    """time_decoding (a fake model and clock): the warm-up run's prefill and its two steps
    are left out; the three prefills after it and the ``steps`` steps of the last run are
    returned, in ms."""
    import types

    from experiments import bench_decode

    clock = {"now": 0.0}
    prefill_s = iter([1.0, 0.010, 0.020, 0.030])  # warm-up, then the three timed
    step_s = iter([0.5, 0.5, 0.001, 0.002, 0.003])  # two warm-up steps, then three

    class Model:
        blocks = [types.SimpleNamespace(attn=types.SimpleNamespace(window=None))] * 2

        def __call__(self, ids, cache):
            clock["now"] += next(prefill_s if ids.shape[1] > 1 else step_s)

    monkeypatch.setattr(
        bench_decode, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"])
    )
    prefill, steps, cache_bytes = bench_decode.time_decoding(Model(), 1, 4, 3, torch.device("cpu"))
    assert prefill == pytest.approx([10.0, 20.0, 30.0])
    assert steps == pytest.approx([1.0, 2.0, 3.0])
    assert cache_bytes == 0  # the fake model stores no keys


def test_bench_decode_checks_cached_logits_against_the_uncached_forward():
    """check_decoding on a bf16 NoPE model (CPU SDPA): the cached steps pass against the fp32
    uncached forward; a model whose cached steps are 0.05 off is "ACC FAIL" (the benchmark
    timed decoding without looking at what it decoded before)."""
    from experiments import bench_decode

    model = bench_decode.build_model(
        "nope", bench_decode.QUICK, 40, torch.device("cpu"), torch.bfloat16
    )
    cpu = torch.device("cpu")
    reference = copy.deepcopy(model).float()
    assert bench_decode.check_decoding(model, reference, 2, 16, 3, cpu) == "acc ok"

    class OffWhenCached(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.blocks = inner, inner.blocks

        def forward(self, idx, cache=None):
            out = self.inner(idx, cache)
            return out + 0.05 if cache is not None and idx.shape[1] == 1 else out

    note = bench_decode.check_decoding(OffWhenCached(model), reference, 2, 16, 3, cpu)
    assert note.startswith(f"{ACC_FAIL} (cached vs uncached logits)"), note


def test_bench_decode_quick_run_with_a_window(tmp_path):
    """``--quick --window 3``: every attention with and without the window; a windowed
    cache's buffers have 2 * 3 rows, the others 16 prompt tokens + 2 steps (2 layers, keys and
    values, 1 KV head of 32 channels: 3072 and 9216 bytes in fp32, half that in the bf16 the
    script takes on CUDA)."""
    script = Path(__file__).resolve().parents[1] / "experiments" / "bench_decode.py"
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--window", "3", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = (tmp_path / "bench_decode.md").read_text()
    for variant in ("rope", "corope", "nope"):
        assert f"| {variant} | " in report and f"| {variant}, window 3 | " in report
    lines = [line for line in report.splitlines() if "decode step" in line]
    assert len(lines) == 6
    for line in lines:
        cache = (3072 if "window 3" in line else 9216) // (2 if torch.cuda.is_available() else 1)
        assert f"cache {cache / 2**20:.3g} MiB" in line, line


def test_bench_decode_floor_reads_the_weights_and_every_layers_keys_and_values():
    """A decoding step's floor: bf16 weights plus the cached keys *and* values of every layer
    (2 x layers x B x HKV x P x D x 2 bytes), over the copy bandwidth, in ms."""
    import types

    from experiments.bench_decode import floor_ms

    attn = types.SimpleNamespace(n_kv_head=2, head_dim=64)
    model = types.SimpleNamespace(
        parameters=lambda: [torch.zeros(1000), torch.zeros(24)],
        blocks=[types.SimpleNamespace(attn=attn)] * 8,
    )
    expected = (1024 * 2 + 2 * 8 * 3 * 2 * 512 * 64 * 2) / 1000.0 / 1e6
    assert floor_ms(model, 3, 512, 1000.0) == pytest.approx(expected)


def test_plot_relative_to_draws_each_time_over_the_base_providers(tmp_path, monkeypatch):
    """``--relative-to``: a bar is the provider's ms over the base provider's on the same
    (mode, dtype, shape): 1.5 for a provider 1.5x slower, not its inverse."""
    import matplotlib.axes

    from experiments.plot_benchmarks import plot_op

    heights = {}
    real_bar = matplotlib.axes.Axes.bar

    def bar(self, xs, values, width, label=None, **kw):
        heights[label] = list(values)
        return real_bar(self, xs, values, width, label=label, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    csv_path = tmp_path / "b.csv"
    common = dict(op="o", mode="fwd", shape="s", dtype="bf16", gpu="g")
    upsert_rows([dict(common, provider="floor", ms=2.0), dict(common, provider="main", ms=3.0)],
                csv_path)  # fmt: skip
    plot_op("o", csv_path, tmp_path / "p.png", relative_to="floor", target=1.1)
    assert heights == {"floor": [1.0], "main": [1.5]}


def test_percentiles_of_few_runs_stay_within_the_measured_times():
    """p20 and p80 of three CPU runs lie between their fastest and slowest (the exclusive
    method extrapolated a negative p20 from 1, 7 and 8 ms)."""
    from experiments import timing

    median, p20, p80 = timing._quantiles([1.0, 7.0, 8.0])
    assert median == 7.0 and 1.0 <= p20 <= median <= p80 <= 8.0


def test_bench_rope_verdict_without_a_triton_row_is_a_miss_not_an_error():
    """A case that only other providers measured (an earlier run's rows) is reported."""
    row = dict(shape="s", dtype="bf16", mode="fwd", provider="earlier", ms=1.0, note="")
    assert "MISS s bf16 fwd: no triton row" in bench_rope.verdict([row], 1000.0)


def test_rows_of_uncommitted_code_say_so(monkeypatch):
    """The commit field: HEAD's hash, with ``+dirty`` where tracked files differ from HEAD."""
    import subprocess

    from experiments import results_io

    monkeypatch.delenv("GIT_COMMIT", raising=False)
    for status, expected in ((" M fused_rope/rope.py", "abc1234+dirty"), ("", "abc1234")):

        def run(args, status=status, **kwargs):
            out = status if "status" in args else "abc1234\n"
            return subprocess.CompletedProcess(args, 0, stdout=out)

        monkeypatch.setattr(results_io.subprocess, "run", run)
        assert results_io.environment()["commit"] == expected


def test_deterministic_dispatch_reports_the_path_auto_takes(monkeypatch):
    """``deterministic_dispatch.py``'s "auto takes" column asks ``rope_attention``'s own input
    checks (stubbed switch: both answers on any device), and its ``--projected`` inputs are the
    harness's views: q ``[B, HQ, N, D]`` and k, v ``[B, HKV, N, D]`` of one projection."""
    import fused_rope.attention as attention
    from experiments import deterministic_dispatch

    q, kv = torch.randn(2, 40, 4, 32, device=DEVICE), torch.randn(2, 40, 2, 2, 32, device=DEVICE)
    inputs = deterministic_dispatch.qkv((q, kv), projected=True)
    assert [tuple(x.shape) for x in inputs] == [(2, 4, 40, 32), (2, 2, 40, 32), (2, 2, 40, 32)]
    assert torch.equal(inputs[2][1, 0, 7], kv[1, 7, 1, 0])
    for slowed in (True, False):
        monkeypatch.setattr(attention, "_sdpa_is_slowed_by_determinism", lambda q, s=slowed: s)
        assert deterministic_dispatch._auto_path(inputs) == ("fused" if slowed else "separate")


def test_a_report_of_another_gpu_is_kept(tmp_path):
    """A benchmark run on one GPU writes its report and plots beside another GPU's committed
    report, under the GPU's short name, instead of replacing it (an H100 run replaced the H200
    report the README cites); its own GPU's report, or none, is written in place."""
    report = tmp_path / "bench_rope_attention.md"
    assert results_io.gpu_suffix(report, "NVIDIA H200") == ""
    report.write_text("# rope_attention benchmark\n\nNVIDIA H200, torch 2.11.0, triton 3.6.0\n")
    assert results_io.gpu_suffix(report, "NVIDIA H200") == ""
    assert results_io.gpu_suffix(report, "NVIDIA H100 80GB HBM3") == "_h100"
    assert results_io.gpu_suffix(report, "NVIDIA A100-SXM4-80GB") == "_a100"
    assert results_io.gpu_suffix(report, "cpu") == "_cpu"
    # The model's report is a sibling's (another H100): the whole name, not an overwrite.
    h100 = tmp_path / "bench_rope_attention_h100.md"
    h100.write_text("# rope_attention benchmark\n\nNVIDIA H100 80GB HBM3, torch 2.11.0\n")
    assert results_io.gpu_suffix(report, "NVIDIA H100 80GB HBM3") == "_h100"
    assert results_io.gpu_suffix(report, "NVIDIA H100 PCIe") == "_nvidia_h100_pcie"


def test_bench_rope_report_embeds_its_own_plot(tmp_path):
    """A report written under a GPU's name embeds the plot of that name (it embedded
    bench_rope.png, another GPU's)."""
    md = tmp_path / "bench_rope_h100.md"
    env = dict(gpu="NVIDIA H100", torch="2.11", triton="3.6", commit="abc", date="today")
    bench_rope.write_markdown(md, [], 3000.0, env, [])
    assert "![bench_rope](bench_rope_h100.png)" in md.read_text()


def test_options_a_run_ignores_are_named(capsys):
    """An option set away from its default that the run ignores (a quick run's fixed cases, a
    report that times nothing) is named on stderr; options left at their defaults are not."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--min-n", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    results_io.warn_ignored(parser, parser.parse_args(["--min-n", "4096"]), ["min_n", "steps"],
                            results_io.QUICK_IGNORES)  # fmt: skip
    assert capsys.readouterr().err == f"--min-n ignored: {results_io.QUICK_IGNORES}\n"
    results_io.warn_ignored(parser, parser.parse_args([]), ["min_n", "steps"], "why")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("N, window", [(1, 1), (7, 1), (7, 3), (7, 7), (7, 20), (64, 16)])
def test_causal_pairs_are_the_pairs_a_window_mask_keeps(N, window):
    """The flops of the window benchmark and of the harness's MFU: the pairs the reference's
    window mask leaves visible."""
    from lm.profiling import causal_pairs

    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    assert causal_pairs(N, window) == int(((j <= i) & (j > i - window)).sum())
    assert causal_pairs(N) == N * (N + 1) // 2


@pytest.mark.parametrize(
    "prefix, config_class, keys",
    [
        ("Llama", "LlamaConfig", {}),
        # a local layer whose 4-key window binds at 12 tokens, and a global one
        ("Gemma3", "Gemma3TextConfig",
         dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    ],
    ids=["llama", "gemma3"],
)  # fmt: skip
def test_bench_hf_paths_set_up_and_put_back_the_model(prefix, config_class, keys, monkeypatch):
    """bench_hf.py's paths: "no RoPE" leaves the rotation out (in the model's own module),
    "auto" takes fused_rope.hf's forward in every layer (the windowed one too) and gives the
    stock logits, and the stock model comes back after each."""
    transformers = pytest.importorskip("transformers", reason="bench_hf.py times its models")
    import fused_rope.hf
    from experiments.bench_hf import path

    windows = []  # each rope_attention call's window

    def counted(*args, rope_attention=fused_rope.hf.rope_attention, **kwargs):
        windows.append(kwargs["window"])
        return rope_attention(*args, **kwargs)

    monkeypatch.setattr(fused_rope.hf, "rope_attention", counted)

    config = getattr(transformers, config_class)(
        vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, **keys,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")._from_config(
        config, attn_implementation="sdpa"
    )
    model = model.to(DEVICE)
    attention = model.model.layers[0].self_attn
    x = torch.randint(0, 50, (1, 12), device=DEVICE)

    def logits():
        return model(x, use_cache=False).logits

    stock = logits()
    with path(model, "no RoPE"):
        no_rope = logits()
    with path(model, "auto"):
        assert "forward" in attention.__dict__
        auto = logits()
    assert (no_rope - stock).abs().max() > 1e-3  # positions change the logits
    torch.testing.assert_close(auto, stock, atol=1e-5, rtol=1e-5)
    assert windows == [keys.get("sliding_window"), None]
    assert torch.equal(logits(), stock) and "forward" not in attention.__dict__
