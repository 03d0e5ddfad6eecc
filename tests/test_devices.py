"""The public kernel functions launch on their inputs' GPU, not the current one
(``fused_rope._validation.on_input_device``)."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from corope import corope_attention
from fused_rope import apply_rope, apply_rope_qk, rope_attention
from fused_rope._validation import on_input_device

LAUNCHERS = [apply_rope, apply_rope_qk, rope_attention, corope_attention]


class _OnSecondGpu(torch.Tensor):
    """A CPU tensor that reports itself on ``cuda:1`` (the guard reads only these two)."""

    is_cuda = True
    device = torch.device("cuda", 1)


def test_on_input_device_runs_on_the_first_tensors_gpu(monkeypatch):
    """Eager, a tensor on cuda:1 while cuda:0 is current: ``fn`` runs inside
    ``torch.cuda.device(cuda:1)``; a tensor on the current device or the CPU, without it.
    (Mocked CUDA: the real thing is ``test_gpu_launchers_run_on_a_second_gpu``.)"""
    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    seen = []
    guarded = on_input_device(lambda x, *args, scale=1: seen.append((list(entered), args, scale)))
    guarded(torch.Tensor._make_subclass(_OnSecondGpu, torch.ones(2)), 3, scale=2)
    assert seen == [([torch.device("cuda", 1)], (3,), 2)]
    entered.clear()
    guarded(torch.ones(2), 3)
    assert seen[-1] == ([], (3,), 1)


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda f: f.__name__)
def test_public_launchers_are_guarded(launcher):
    """Each public function that launches kernels goes through the guard."""
    assert inspect.unwrap(launcher) is not launcher


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_gpu_launchers_run_on_a_second_gpu():
    """Inputs on cuda:1 while cuda:0 is current: RoPE, RoPE attention (fused and auto) and
    Co-RoPE, forward and backward, give what they give with cuda:1 current (up to the
    backwards' atomics), and leave cuda:0 current."""
    gen = torch.Generator(device="cuda:1").manual_seed(0)
    q, k, v = (
        torch.randn(1, h, 256, 64, device="cuda:1", dtype=torch.float16, generator=gen)
        for h in (4, 2, 2)
    )
    do = torch.randn(q.shape, device="cuda:1", dtype=torch.float16, generator=gen)
    inv_freq = (10000.0 ** -(torch.arange(0, 64, 2, device="cuda:1") / 64)).float()

    def run():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        outs = [apply_rope(qs.detach(), inv_freq=inv_freq)]
        outs += list(apply_rope_qk(qs.detach(), ks.detach(), inv_freq=inv_freq))
        for o in (
            rope_attention(qs, ks, vs, impl="fused"),
            rope_attention(qs, ks, vs),
            corope_attention(qs, ks, vs),
        ):
            outs += [o.detach(), *torch.autograd.grad(o, (qs, ks, vs), do)]
        torch.cuda.synchronize("cuda:1")
        return outs

    with torch.cuda.device(1):
        expected = run()
    torch.cuda.set_device(0)
    got = run()
    assert torch.cuda.current_device() == 0
    for a, b in zip(got, expected, strict=True):
        assert a.device == torch.device("cuda", 1)
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
