"""The benchmark scripts' ``--quick`` smoke runs (CPU: the Triton interpreter), so that a change
to a kernel's signature or to the results helpers cannot leave a benchmark broken until its
next GPU run. Each must exit 0, write its CSV rows, keep an earlier run's rows in its markdown,
and pass its own accuracy check; a wrong output must fail that check."""

from __future__ import annotations

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
from tests.helpers import DEVICE

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
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg")
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
    if op == "decode":  # its accuracy: tests/lm/test_generation.py
        assert {(r["provider"], r["mode"]) for r in rows if r["ms"]} >= {
            (variant, mode)
            for variant in ("rope", "corope", "nope")
            for mode in ("prefill", "decode step")
        }, rows
    elif op == "corope":
        forwards = [r for r in rows if (r["provider"], r["mode"]) == ("corope_triton", "fwd")]
        assert forwards and all(r["note"] == "acc ok" for r in forwards), forwards
    else:  # every timed provider's output checked (rope_attention's floor has no RoPE)
        checked = [r for r in rows if r["ms"] and r["provider"] != "sdpa_no_rope"]
        assert checked and all(r["note"].startswith("max err") for r in checked), checked
    if op == "rope_attention":
        assert "rows over the accuracy tolerance: 0" in text, text


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
    assert [p.name for p in committed.iterdir()] == ["benchmarks.csv"]
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
    assert [p.name for p in tmp_path.iterdir()] == ["b.csv"]


def test_timing_helpers_on_fakes(monkeypatch):
    """experiments/timing.py without a GPU: quantiles are the median, 20th and 80th
    percentiles; the CPU timing leaves out a warm-up call; input_sets covers three times the
    L2 cache; peak_extra_mib is the peak over what was allocated before, less the excluded."""
    import time
    import types

    from experiments import timing

    assert timing._quantiles([float(t) for t in range(11, 0, -1)]) == (6.0, 2.4, 9.6)
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
    ratios = study.kernel_ratios(
        (1, 2, 1, 17, 32, "mean", False), 32**-0.5, 1, torch.device(DEVICE)
    )
    assert all(0 < r <= 2 for r in ratios), ratios
    study.main(["--no-kernel", "--scales", "0.9", "--seeds", "1", "--out", str(tmp_path / "r.md")])
    assert "| 0.9 |" in (tmp_path / "r.md").read_text()
