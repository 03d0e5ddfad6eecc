"""The test suite's own guards (``tests/conftest.py``)."""

import os
import subprocess
import sys
from pathlib import Path

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
