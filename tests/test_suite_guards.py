"""The test suite's own guards (``tests/conftest.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_a_hung_test_fails_with_a_timeout(tmp_path):
    """A test that spins in Python past ``TEST_TIMEOUT_S`` (2 s here) fails with a TimeoutError
    naming it, and the session goes on to the next test."""
    (tmp_path / "test_hang.py").write_text(
        "def test_spins():\n    while True:\n        pass\n\n\ndef test_after():\n    pass\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         str(tmp_path / "test_hang.py")],
        cwd=ROOT, env={**os.environ, "TEST_TIMEOUT_S": "2"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "TimeoutError: " in run.stdout and "test_spins ran past 2 s" in run.stdout
    assert "1 failed, 1 passed" in run.stdout


def test_only_gpu_marked_tests_are_skipped_off_a_gpu(tmp_path):
    """Off a GPU the ``gpu`` marker skips its tests and nothing else: an unmarked test runs
    (a skip hook that skipped everything would leave CI green with no test run)."""
    (tmp_path / "test_marks.py").write_text(
        "import pytest\n\n\ndef test_plain():\n    pass\n\n\n"
        "@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), str(tmp_path / "test_marks.py")],
        cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 passed, 1 skipped" in run.stdout, run.stdout[-2000:]


def test_fresh_tensors_are_nan_during_tests():
    """``torch.empty``, ``empty_like`` and ``new_empty`` give NaN-filled floating-point
    tensors in tests, so an output element a kernel never writes fails its comparison."""
    x = torch.empty(3, 4)
    assert x.isnan().all()
    assert torch.empty_like(x).isnan().all() and x.new_empty(5).isnan().all()
