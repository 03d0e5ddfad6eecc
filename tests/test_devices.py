"""The public kernel functions launch on their inputs' GPU, not the current one
(``fused_rope._validation.on_input_device``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from corope import corope_attention
from fused_rope import apply_rope, apply_rope_qk, rope_attention
from fused_rope._validation import on_input_device

LAUNCHERS = [apply_rope, apply_rope_qk, rope_attention, corope_attention]


class _OnGpu(torch.Tensor):
    """A CPU tensor that reports itself on a GPU (the guard reads only these two)."""

    # plain class attributes shadow Tensor's properties, so an instance's own "device" (set by
    # _on_gpu) is read in turn; without the class one, Tensor's property would win
    is_cuda = True
    device = torch.device("cuda", 1)


def _on_gpu(index: int) -> torch.Tensor:
    x = torch.Tensor._make_subclass(_OnGpu, torch.ones(2))
    x.__dict__["device"] = torch.device("cuda", index)
    return x


def test_on_input_device_runs_on_the_first_tensors_gpu(monkeypatch):
    """cuda:0 current (mocked CUDA; the real thing is ``test_gpu_launchers_run_on_a_second_gpu``):
    a first argument on cuda:1, positional or by keyword, runs ``fn`` inside
    ``torch.cuda.device(cuda:1)``; one on cuda:0 or the CPU runs it as it is."""
    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    seen = []

    def fn(q, k=None, *, scale=1):
        seen.append((list(entered), k, scale))
        return scale

    guarded = on_input_device(fn)
    assert guarded(_on_gpu(1), 3, scale=2) == 2
    assert seen.pop() == ([torch.device("cuda", 1)], 3, 2)
    entered.clear()
    guarded(q=_on_gpu(1), k=4)
    assert seen.pop() == ([torch.device("cuda", 1)], 4, 1)
    entered.clear()
    guarded(_on_gpu(0), 5)
    guarded(torch.ones(2), 6)
    assert seen == [([], 5, 1), ([], 6, 1)]


GUARD_CODE = on_input_device(lambda x: x).__code__


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
def test_public_launchers_are_guarded(launcher):
    """Each public function that launches kernels goes through the guard."""
    assert launcher.__code__ is GUARD_CODE


@pytest.mark.parametrize(
    "op",
    ["fused_rope::rope", "fused_rope::rope_qk", "fused_rope::rope_", "fused_rope::rope_attention_fwd",
     "fused_rope::rope_attention_bwd", "corope::attention", "corope::decode",
     "corope::attention_backward"],
)  # fmt: skip
def test_custom_ops_are_guarded(op):
    """The custom ops' bodies, which compiled graphs call (under any backend), are guarded too."""
    from torch._library.custom_ops import OPDEFS

    assert OPDEFS[op]._init_fn.__code__ is GUARD_CODE


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_gpu_launchers_run_on_a_second_gpu():
    """Inputs on cuda:1 while cuda:0 is current: RoPE, RoPE attention (fused and auto) and
    Co-RoPE, forward and backward, launch every Triton kernel with cuda:1 current (peer
    access could hide a launch on cuda:0), give what they give with cuda:1 current (up to
    the backwards' atomics), and leave cuda:0 current."""
    import triton

    gen = torch.Generator(device="cuda:1").manual_seed(0)
    q, k, v = (
        torch.randn(1, h, 256, 64, device="cuda:1", dtype=torch.float16, generator=gen)
        for h in (4, 2, 2)
    )
    cotangents = {
        t.shape: torch.randn(t.shape, device="cuda:1", dtype=torch.float16, generator=gen)
        for t in (q, k)
    }
    inv_freq = (10000.0 ** -(torch.arange(0, 64, 2, device="cuda:1") / 64)).float()

    def run():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        outs = []
        for o in (
            apply_rope(qs, inv_freq=inv_freq),
            *apply_rope_qk(qs, ks, inv_freq=inv_freq),
            rope_attention(qs, ks, vs, impl="fused"),
            rope_attention(qs, ks, vs),
            corope_attention(qs, ks, vs),
        ):
            grads = torch.autograd.grad(o, (qs, ks, vs), cotangents[o.shape], allow_unused=True)
            outs += [o.detach(), *(g for g in grads if g is not None)]
        torch.cuda.synchronize("cuda:1")
        return outs

    devices = []
    hook = lambda *args: devices.append(torch.cuda.current_device())  # noqa: E731
    previous = torch.cuda.current_device()
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        with torch.cuda.device(1):
            expected = run()
        torch.cuda.set_device(0)
        devices.clear()
        got = run()
        assert torch.cuda.current_device() == 0
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
        torch.cuda.set_device(previous)
    assert devices and set(devices) == {1}
    for a, b in zip(got, expected, strict=True):
        assert a.device == torch.device("cuda", 1)
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_device_facts_are_memoized_and_trace_without_warnings(monkeypatch):
    """``compute_capability`` and ``num_sms`` ask CUDA once per device (mocked here) and trace
    under ``torch.compile(fullgraph=True)`` without Dynamo's warning about ``lru_cache``
    wrappers (which ``functools.cache`` drew at every compiled call of ``auto``'s rules)."""
    import warnings

    from fused_rope import _device

    asked = []
    monkeypatch.setattr(_device, "_CAPABILITY", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: asked.append(d) or (9, 0))
    cuda = torch.device("cuda", 0)
    assert _device.compute_capability(cuda) == (9, 0)
    assert _device.compute_capability(cuda) == (9, 0)
    assert asked == [cuda]

    def f(x):
        return x * 2 if _device.compute_capability(cuda) == (9, 0) else x

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(
            torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2)), 2 * torch.ones(2)
        )
