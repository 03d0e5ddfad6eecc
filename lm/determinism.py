"""PyTorch's deterministic algorithms for a block of code, restored afterwards: the harness's
``train.deterministic``, and the benchmarks that time what it costs."""

from __future__ import annotations

import contextlib
import os

import torch


@contextlib.contextmanager
def deterministic_algorithms(deterministic: bool):
    """With ``deterministic``, ``torch.use_deterministic_algorithms(True)`` (strict: an operator
    without a deterministic implementation raises, naming itself; Co-RoPE's backward and
    ``rope_attention``'s dispatch follow the switch) and cuBLAS's fixed workspace for the
    block; without, the block runs as the process is set. The switch and
    ``CUBLAS_WORKSPACE_CONFIG`` are the process's, and a block may run again in the same
    process (a multirun, the tests): both are restored."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    if deterministic:
        # cuBLAS repeats its results only with a fixed workspace (without the setting PyTorch
        # raises at a CUDA matmul). PyTorch sizes its workspace at its first cuBLAS call, so
        # a process's later runs keep that size (Hopper's default is this one).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        if previous[2] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
