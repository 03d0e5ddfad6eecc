"""Suite-wide setup.

* Without CUDA the Triton kernels run in the interpreter: ``TRITON_INTERPRET`` must
  be set before any module that defines a ``@triton.jit`` kernel is imported, which
  is why it happens here, at collection time, before the test modules load.
* Every test is seeded.
* The process's first fp32 ``cos``/``sin`` on the CPU runs once before any test: with
  torch 2.13's CPU build on 2 threads, that first call is in about one process out of
  three up to 1.5e-4 off for arguments near 2e4 (later calls are within 4e-8 of float64;
  with 1 thread it never happens), which made transformers' M-RoPE oracle flaky.
* Freshly allocated floating-point tensors (``torch.empty``/``empty_like``/
  ``new_empty``) are filled with NaN during tests, so an output element a kernel
  never writes shows up as NaN and fails the comparison. Not while a tracer allocates
  (fake or functional tensors: a triton_op's body traced into a compiled graph), where
  the fill would be an in-place copy that the graph cannot hold; Inductor's own
  allocations are not filled either way.
* On the GPU, each test hands its cached blocks back to the driver when it ends: the
  test processes share one GPU under xdist, and PyTorch's caching allocator would
  otherwise keep each process's largest test's memory for the rest of the run (in
  session 33 fifteen processes held all 80 GB, and the last tests ran out of memory).
* A test still running after ``TEST_TIMEOUT_S`` seconds (default 1200; pytest's
  ``faulthandler_timeout`` dumps every thread's stack at 900) fails with a TimeoutError,
  where it would hang CI: a deterministic kernel's wait for a program that never adds
  spins forever, and in the interpreter that spin is Python, which SIGALRM interrupts. (On
  a GPU such a kernel blocks inside CUDA, out of the signal's reach.)
"""

import os
import signal

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.helpers import ON_GPU  # noqa: E402

_warm = torch.linspace(0.0, 2e4, 8192)
_warm.cos(), _warm.sin()  # see the module docstring: the first call may be inaccurate


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    if ON_GPU:
        torch.cuda.empty_cache()


def _nan_filled(fn):
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        traced = isinstance(out, (FakeTensor, FunctionalTensor))
        if out.is_floating_point() and out.numel() > 0 and not traced:
            out.fill_(float("nan"))
        return out

    return wrapper


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _nan_filled(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _nan_filled(torch.Tensor.new_empty))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = int(os.environ.get("TEST_TIMEOUT_S", "1200"))
    if not hasattr(signal, "SIGALRM") or limit <= 0:  # not POSIX, or turned off
        yield
        return

    def timed_out(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past {limit} s (TEST_TIMEOUT_S): hung?")

    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(
        reason="needs CUDA: bf16 arithmetic, large shapes, compiled kernels"
    )
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
