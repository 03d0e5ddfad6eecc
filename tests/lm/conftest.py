"""Fixtures of the harness tests."""

import json
from pathlib import Path

import pytest


@pytest.fixture
def qa_jsonl_dir(tmp_path: Path) -> Path:
    """A tiny question-answering dataset in the ``data=jsonl`` layout."""
    rows = [
        {"context": f"alice has {n} apples", "question": "how many apples", "answer": str(n)}
        for n in range(12)
    ]
    for split, part in (("train", rows[:8]), ("valid", rows[8:10]), ("test", rows[10:])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return tmp_path
