"""The fused Co-RoPE-GQA forward (corope/forward.py) and the public corope_attention.

Outputs and log-sum-exps are checked with flash-attention's rule against the float64
reference run on the same (rounded) inputs. The "PyTorch in the kernel's dtype" baseline:
for fp32 inputs, the reference in fp32. For fp16/bf16 inputs the reference already computes
in fp32 internally (it upcasts) and rounds o to the input dtype, so the baseline is "fp32 math
on the half-precision inputs, o rounded to half": the best a PyTorch implementation can do in
that dtype, and a stricter bar than a pure half-precision run. lse is fp32 in both; in half
precision its baseline also rounds the rotated key to the input dtype, as the kernel's
tensor-core score product does (_check_forward).

All outputs come from torch.empty*, which tests/conftest.py fills with NaN: an element the
kernel never writes fails the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corope import attention as attention_module
from corope import corope_attention, corope_attention_ref, forward
from corope.forward import corope_fwd
from corope.naive import corope_inv_freq
from fused_rope.frequencies import rope_frequencies
from tests.helpers import (
    DEVICE,
    ON_GPU,
    assert_close,
    assert_close_to_baseline,
    deterministic_algorithms,
    errors,
)


def _inputs(B, HQ, HKV, N, D, dtype):
    q = torch.randn(B, HQ, N, D, device=DEVICE).to(dtype)
    k = torch.randn(B, HKV, N, D, device=DEVICE).to(dtype)
    v = torch.randn(B, HKV, N, D, device=DEVICE).to(dtype)
    return q, k, v


def _check_forward(B, HQ, HKV, N, D, rope_dim=None, leader="first", dtype=torch.float32, NQ=None):
    """The launcher against the reference; ``NQ < N``: q holds the last NQ positions only."""
    q, k, v = _inputs(B, HQ, HKV, N, D, dtype)
    q = q[:, :, N - (NQ or N) :]
    R = rope_dim or D
    o, lse = corope_fwd(q, k, v, corope_inv_freq(R, 10000.0, None, q.device), D**-0.5, R, leader)
    kw = dict(rope_dim=rope_dim, leader=leader, return_lse=True)
    o64, lse64 = corope_attention_ref(q.double(), k.double(), v.double(), **kw)
    o_base, lse_base = corope_attention_ref(q, k, v, **kw)
    if dtype != torch.float32:
        # The kernel's tensor-core score product takes the rotated key in the input dtype (as a
        # RoPE attention takes its rotated q and k): lse, fp32, is held to that rounding. A much
        # looser bar than the fp32-math baseline (at (1, 4/1, 64), N = 64: max-abs 4e-7 -> 3e-4
        # in fp16, 5e-7 -> 2e-3 in bf16), so it applies to lse only; o keeps the plain baseline.
        _, lse_base = corope_attention_ref(q, k, v, rotated_key_dtype=dtype, **kw)
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == (B, HQ, NQ or N)
    assert_close_to_baseline("o", o, o64, o_base)
    assert_close_to_baseline("lse", lse, lse64, lse_base)


# Interpreter-sized cases (a few seconds each on the CPU); the GPU runs them too.
CASES = [
    pytest.param(1, 1, 1, 1, 64, None, "first", torch.float32, id="G1-N1-D64-f32"),
    pytest.param(1, 2, 1, 63, 128, None, "mean", torch.float32, id="G2-N63-D128-mean-f32"),
    pytest.param(1, 4, 1, 64, 64, None, "first", torch.float16, id="G4-N64-D64-f16"),
    pytest.param(1, 8, 1, 40, 64, None, "mean", torch.float32, id="G8-N40-D64-mean-f32"),
    pytest.param(1, 4, 2, 63, 64, 32, "mean", torch.float16, id="G2-N63-D64-R32-mean-f16"),
    pytest.param(1, 6, 2, 37, 64, 48, "first", torch.float32, id="G3-N37-D64-R48-f32"),
    pytest.param(2, 4, 2, 33, 128, None, "first", torch.float32, id="B2-G2-N33-D128-f32"),
    # Rotary halves that are not a multiple of the 8-frequency chunk (the last chunk masked):
    pytest.param(1, 4, 2, 45, 64, 20, "first", torch.float16, id="G2-N45-D64-R20-f16"),
    pytest.param(1, 3, 1, 37, 32, 6, "mean", torch.float32, id="G3-N37-D32-R6-mean-f32"),
    # A group wider than the interpreter's tile (G_PAD = 128 > BLOCK_GM = 64): one row a tile.
    pytest.param(1, 128, 1, 5, 32, None, "mean", torch.float32, id="G128-N5-D32-mean-f32"),
    pytest.param(
        1, 2, 1, 500, 32, None, "first", torch.float32, id="G2-N500-D32-f32", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("B, HQ, HKV, N, D, rope_dim, leader, dtype", CASES)
def test_forward_matches_reference(B, HQ, HKV, N, D, rope_dim, leader, dtype):
    _check_forward(B, HQ, HKV, N, D, rope_dim, leader, dtype)


BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# Queries that continue a KV cache (NQ < NK: a chunk of a prefill): rows within one query
# tile and across several, chunks that start inside a key tile, both leaders, rope_dim < D.
CHUNK_CASES = [
    pytest.param(1, 4, 2, 2, 3, 64, None, "mean", F32, id="G2-NQ2-NK3-D64-mean-f32"),
    pytest.param(1, 4, 2, 5, 70, 64, None, "first", F32, id="G2-NQ5-NK70-D64-f32"),
    pytest.param(1, 8, 1, 17, 40, 64, 48, "mean", F16, id="G8-NQ17-NK40-D64-R48-mean-f16"),
    pytest.param(2, 2, 1, 63, 130, 32, None, "first", F32, id="B2-G2-NQ63-NK130-D32-f32"),
]
CHUNK_GPU_CASES = [
    pytest.param(1, 32, 8, 300, 4096, 128, None, "first", BF16, id="G4-NQ300-NK4096-D128-bf16"),
    pytest.param(1, 8, 2, 17, 1000, 64, 48, "mean", BF16, id="G4-NQ17-NK1000-D64-R48-mean-bf16"),
    pytest.param(2, 16, 2, 129, 777, 256, None, "first", F16, id="B2-G8-NQ129-NK777-D256-f16"),
]


@pytest.mark.parametrize("B, HQ, HKV, NQ, NK, D, rope_dim, leader, dtype", CHUNK_CASES)
def test_forward_continues_a_cache(B, HQ, HKV, NQ, NK, D, rope_dim, leader, dtype):
    _check_forward(B, HQ, HKV, NK, D, rope_dim, leader, dtype, NQ=NQ)


@pytest.mark.gpu
@pytest.mark.parametrize("B, HQ, HKV, NQ, NK, D, rope_dim, leader, dtype", CHUNK_GPU_CASES)
def test_forward_continues_a_cache_gpu(B, HQ, HKV, NQ, NK, D, rope_dim, leader, dtype):
    _check_forward(B, HQ, HKV, NK, D, rope_dim, leader, dtype, NQ=NQ)


def test_public_chunk_is_the_rows_of_the_whole_forward():
    """corope_attention on the last NQ rows (no grad) equals those rows of the full forward
    up to the kernels' rounding: the same kernel, only the rows differ."""
    q, k, v = _inputs(1, 4, 2, 50, 64, torch.float32)
    with torch.no_grad():
        whole = corope_attention(q, k, v, leader="mean")
        chunk = corope_attention(q[:, :, 41:], k, v, leader="mean")
    assert_close("o", chunk, whole[:, :, 41:], atol=1e-6, rtol=1e-5)


# GPU cases: group sizes 1, 2, 4, 8 at N = 4096 / 500 / 63 / 64, every head dim, rope_dim < D,
# both leaders, all three dtypes, plus N = 1, non-power-of-two and large groups.
GPU_CASES = [
    case
    for G in (1, 2, 4, 8)
    for case in (
        pytest.param(1, 2 * G, 2, 4096, 128, None, "first", BF16, id=f"G{G}-N4096-D128-bf16"),
        pytest.param(1, 2 * G, 2, 500, 64, None, "mean", BF16, id=f"G{G}-N500-D64-mean-bf16"),
        pytest.param(1, 2 * G, 2, 63, 128, 64, "first", BF16, id=f"G{G}-N63-D128-R64-bf16"),
        pytest.param(2, 2 * G, 2, 64, 64, None, "mean", F32, id=f"B2-G{G}-N64-D64-mean-f32"),
    )
] + [
    pytest.param(1, 8, 8, 1, 128, None, "first", BF16, id="G1-N1-D128-bf16"),
    pytest.param(1, 8, 2, 1000, 128, 20, "mean", BF16, id="G4-N1000-D128-R20-mean-bf16"),
    pytest.param(1, 3, 3, 777, 64, 6, "first", BF16, id="G1-N777-D64-R6-bf16"),
    pytest.param(1, 8, 2, 1000, 128, None, "first", F16, id="G4-N1000-D128-f16"),
    pytest.param(1, 6, 2, 777, 128, 96, "mean", BF16, id="G3-N777-D128-R96-mean-bf16"),
    pytest.param(1, 4, 2, 300, 256, None, "first", BF16, id="G2-N300-D256-bf16"),
    pytest.param(1, 4, 1, 300, 32, None, "mean", BF16, id="G4-N300-D32-mean-bf16"),
    pytest.param(1, 16, 1, 300, 64, None, "mean", BF16, id="G16-N300-D64-mean-bf16"),
    pytest.param(1, 32, 1, 300, 64, None, "first", BF16, id="G32-N300-D64-bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B, HQ, HKV, N, D, rope_dim, leader, dtype", GPU_CASES)
def test_forward_matches_reference_gpu(B, HQ, HKV, N, D, rope_dim, leader, dtype):
    _check_forward(B, HQ, HKV, N, D, rope_dim, leader, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(forward.FWD_CONFIGS)))
def test_every_config_gpu(index):
    """Config ``index`` of the autotune list, which otherwise runs only the fastest one: a
    group of 4 and of 1 (a zero head pads the product), partial rotation with an odd count of
    frequency chunks (R = 48: 3), N not a multiple of a tile."""
    with forward.pinned_config(index):
        _check_forward(1, 8, 2, 777, 128, None, "first", BF16)
        _check_forward(1, 2, 2, 300, 64, 48, "mean", torch.float16)


def test_distinct_tiles_prunes_configs_with_the_same_tile():
    """From 32 heads a group's tile is one row whatever BLOCK_GM asks: the autotuner gets each
    tile once (the first config that gives it). Narrower groups keep every config."""
    import triton

    def config(gm, bn, regs=None):
        return triton.Config({"BLOCK_GM": gm, "BLOCK_N": bn}, num_warps=4, maxnreg=regs)

    configs = [config(16, 64, 168), config(32, 64), config(32, 64, 168), config(64, 64)]
    assert forward.distinct_tiles(configs, {}, G_PAD=4) == configs
    assert forward.distinct_tiles(configs, {}, G_PAD=16) == configs
    assert forward.distinct_tiles(configs, {"G_PAD": 32}) == [configs[0], configs[1], configs[3]]
    assert forward.distinct_tiles(configs, {}, G_PAD=64) == configs[:2]


def _reference_rows(q, k, v, rows, dtype=torch.float64):
    """The reference's o for query rows ``rows`` only, computed in ``dtype``."""
    return corope_attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), rows=rows)


def _check_sampled_rows(N, HQ, HKV, D, dtype, row_blocks):
    q, k, v = _inputs(1, HQ, HKV, N, D, dtype)
    o = corope_attention(q, k, v)
    for i0 in row_blocks:
        rows = range(i0, min(N, i0 + 8))
        o64 = _reference_rows(q, k, v, rows)
        # Baseline: the same reference rows in fp32 on the same inputs, rounded to the dtype.
        base = _reference_rows(q, k, v, rows, torch.float32).to(dtype)
        assert_close_to_baseline(f"rows {i0}+", o[:, :, rows.start : rows.stop], o64, base)


@pytest.mark.gpu
def test_long_sequence_sampled_rows_gpu():
    N = 16384
    _check_sampled_rows(N, 8, 2, 128, torch.bfloat16, (0, 1000, 8191, N - 8))


@pytest.mark.gpu
@pytest.mark.slow
def test_phase_precision_64k_gpu(capsys):
    """At N = 64K the mileage reaches ~N and the fp32 reference loses phase accuracy; the
    kernel (fp64 carry, reduced phase) must pass the 2x rule, and from row 32K be at least 8x
    more accurate than the fp32 reference (26x and 57x measured: an fp32 carry would sit at
    the reference's error). Prints the README's numbers."""
    N, D = 65536, 128
    q, k, v = _inputs(1, 2, 1, N, D, torch.float32)
    o = corope_attention(q, k, v)
    measured = []
    for i0 in (1024, 32768, N - 8):
        rows = range(i0, i0 + 8)
        o64 = _reference_rows(q, k, v, rows)
        base = _reference_rows(q, k, v, rows, torch.float32)
        out = o[:, :, rows.start : rows.stop]
        measured.append((i0, errors(out, o64), errors(base, o64)))
        assert_close_to_baseline(f"rows {i0}+", out, o64, base)
    for i0, (_, k_rmse), (_, b_rmse) in measured[1:]:
        assert k_rmse <= b_rmse / 8, f"rows {i0}+: kernel {k_rmse:.2e}, fp32 reference {b_rmse:.2e}"
    with capsys.disabled():
        for i0, (k_abs, k_rmse), (b_abs, b_rmse) in measured:
            print(
                f"\n[corope N=64K fp32] rows {i0}..{i0 + 7}: kernel max-abs {k_abs:.2e} "
                f"rel-RMSE {k_rmse:.2e}; fp32 reference max-abs {b_abs:.2e} rel-RMSE {b_rmse:.2e}"
            )


# ------------------------------------------------------------------ the public function


def test_public_matches_reference_with_options():
    """inv_freq override (a scaled schedule), custom scale, non-contiguous inputs."""
    B, HQ, HKV, N, D = 1, 4, 2, 21, 64
    base = torch.randn(B, N, HQ + 2 * HKV, D, device=DEVICE)
    q, k, _ = base.transpose(1, 2).split([HQ, HKV, HKV], dim=1)  # strided views
    v = torch.randn(B, HKV, D, N, device=DEVICE).transpose(-1, -2)  # last dim not contiguous
    inv_freq, _ = rope_frequencies(32, 10000.0, {"rope_type": "linear", "factor": 4.0})
    kw = dict(inv_freq=inv_freq.to(DEVICE), softmax_scale=0.2, rope_dim=32, leader="mean")
    out = corope_attention(q, k, v, **kw)
    o64 = corope_attention_ref(q.double(), k.double(), v.double(), **kw)
    assert_close_to_baseline("o", out, o64, corope_attention_ref(q, k, v, **kw))
    assert not torch.equal(out, corope_attention(q, k, v, rope_dim=32, leader="mean"))


@pytest.mark.parametrize("channels_strided", [False, True], ids=["dense", "channels-strided"])
@pytest.mark.parametrize("detach_mileage", [False, True])
def test_autograd_through_public_function(detach_mileage, channels_strided):
    """The public function's autograd by the 2x rule, the options carried to the backward
    included (``detach_mileage`` reaches it through the custom op's saved arguments); q, k, v
    and the cotangent also as ``[B, H, D, N]`` buffers seen transposed (channel stride N)."""
    strided = lambda x: x.mT.contiguous().mT if channels_strided else x
    q, k, v = (strided(x).requires_grad_() for x in _inputs(1, 4, 2, 19, 64, torch.float32))
    do = strided(torch.randn_like(q))
    kw = dict(leader="mean", detach_mileage=detach_mileage)

    def grads(attention, cast):
        leaves = [cast(x).detach().requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad(attention(*leaves, **kw), leaves, cast(do))

    same = lambda x: x
    kernel = grads(corope_attention, same)
    refs, baseline = (
        grads(corope_attention_ref, torch.Tensor.double),
        grads(corope_attention_ref, same),
    )
    for name, g, r, b in zip(("dq", "dk", "dv"), kernel, refs, baseline, strict=True):
        assert_close_to_baseline(name, g, r, b)


def test_backward_options_reach_the_kernel(monkeypatch):
    """``leader``, ``detach_mileage`` and ``deterministic`` arrive at ``corope_bwd`` as given
    (on the CPU both backward modes give the same numbers, so only the call can tell),
    ``deterministic`` by default as ``torch.use_deterministic_algorithms`` sets it, and
    ``freq_grad`` where ``inv_freq`` requires grad."""
    import corope.attention as attention_module

    calls, real = [], attention_module.corope_bwd

    def spy(*args, **kwargs):
        calls.append((*args[-3:], kwargs["freq_grad"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "corope_bwd", spy)
    q, k, v = (x.requires_grad_() for x in _inputs(1, 2, 1, 16, 32, torch.float32))
    learned = corope_inv_freq(32, 10000.0, None, q.device).clone().requires_grad_()
    for kw in ({}, dict(leader="mean", detach_mileage=True, deterministic=True),
               dict(inv_freq=learned)):  # fmt: skip
        corope_attention(q, k, v, **kw).sum().backward()
    expected = [("first", False, False, False), ("mean", True, True, False)]
    assert calls == [*expected, ("first", False, False, True)]
    assert learned.grad is not None and learned.grad.abs().max() > 0

    calls.clear()
    with deterministic_algorithms():
        for kw in ({}, dict(deterministic=False)):  # an explicit choice wins over the switch
            corope_attention(q, k, v, **kw).sum().backward()
    assert calls == [("first", False, True, False), ("first", False, False, False)]
    with pytest.raises(TypeError, match="deterministic"):
        corope_attention(q, k, v, deterministic=1)


@pytest.mark.parametrize("dynamic", [None, True])
def test_compile_fullgraph_traces_custom_op(dynamic):
    # aot_eager runs the fake implementations and the registered autograd through the
    # compiler's tracing without generating code, so it also works in the interpreter. The
    # deterministic backward makes bitwise equality the right check (on a GPU the default
    # one's atomic adds may land in another order). dynamic=True makes the head dim and the
    # float defaults (theta) symbolic, which the input checks must trace. Learned frequencies
    # too: the backward op's fourth output; and a sliding window, an argument of both ops.
    q, k, v = (x.requires_grad_() for x in _inputs(1, 2, 1, 17, 64, torch.float32))
    w = corope_inv_freq(64, 500.0, None, q.device).clone().requires_grad_()
    leaves = (q, k, v, w)

    def fn(q, k, v, w):
        o = corope_attention(q, k, v, deterministic=True)
        learned = corope_attention(q, k, v, inv_freq=w, deterministic=True, window=6)
        return o.square().sum() + learned.sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    g_eager = torch.autograd.grad(fn(*leaves), leaves)
    g_comp = torch.autograd.grad(compiled(*leaves), leaves)
    for a, b in zip(g_comp, g_eager, strict=True):
        assert torch.equal(a, b)


def test_eager_calls_launch_the_kernels_without_the_custom_ops(monkeypatch):
    """Eager calls run the kernels through ``_CoropeAttentionFunction``, without the custom
    ops' dispatch (host time an eager step pays per layer), with the ops' results bitwise
    (the deterministic backward), learned frequencies and a window included."""
    q, k, v = (x.requires_grad_() for x in _inputs(1, 4, 2, 21, 32, torch.float32))
    w = corope_inv_freq(32, 500.0, None, q.device).clone().requires_grad_()
    leaves = (q, k, v, w)

    def run():
        o = corope_attention(q, k, v, inv_freq=w, deterministic=True, window=9)
        return (o, *torch.autograd.grad(o.square().sum(), leaves))

    eager = run()
    assert type(eager[0].grad_fn).__name__ == "CoropeAttentionFunctionBackward"
    monkeypatch.setattr(attention_module, "runs_eagerly", lambda *t: False)  # as under a tracer
    for name, a, b in zip(("o", "dq", "dk", "dv", "dinv_freq"), eager, run(), strict=True):
        assert torch.equal(a, b), name
    monkeypatch.undo()
    refuse = lambda *a: pytest.fail("an eager call went through a custom op")
    monkeypatch.setattr(attention_module, "_attention_op", refuse)
    monkeypatch.setattr(attention_module, "_attention_backward_op", refuse)
    run()


class _NoGradient(torch.autograd.Function):
    """The identity, with an undefined (None) gradient: o's cotangent then arrives as None."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None


def test_an_undefined_cotangent_gives_no_gradient():
    """o's cotangent may arrive as None (an op after it gives no gradient): q, k, v then get
    none, where the backward crashed on the None (a review's find)."""
    q, k, v = (x.requires_grad_() for x in _inputs(1, 2, 1, 9, 32, torch.float32))
    o = corope_attention(q, k, v)
    (_NoGradient.apply(o).sum() + q.sum()).backward()
    assert torch.equal(q.grad, torch.ones_like(q)) and k.grad is None and v.grad is None


def test_a_decoding_step_with_subclass_frequencies_takes_the_op():
    """A tensor subclass among a decoding step's tensors, the frequencies included, sends it
    through the custom op: launching Triton on one failed (a review's find). TwoTensor runs the
    op on each of its two tensors, so each gives the plain result."""
    from torch.testing._internal.two_tensor import TwoTensor

    q, k, v = _inputs(1, 2, 1, 9, 32, torch.float32)
    q = q[:, :, -1:]
    w = corope_inv_freq(32, 10000.0, None, q.device)
    with torch.no_grad():
        got, want = corope_attention(q, k, v, inv_freq=TwoTensor(w, w)), corope_attention(q, k, v)
    torch.testing.assert_close(got.a, want)
    torch.testing.assert_close(got.b, want)


def test_a_forward_mode_tangent_on_a_cotangent_is_refused():
    """Forward-over-reverse (a dual cotangent in a plain backward): the kernels would drop the
    tangent, a silent zero (a review's find): refused, naming the reference."""
    q, k, v = (x.requires_grad_() for x in _inputs(1, 2, 1, 9, 32, torch.float32))
    o = corope_attention(q, k, v)
    with torch.autograd.forward_ad.dual_level():
        do = torch.autograd.forward_ad.make_dual(torch.randn_like(o), torch.randn_like(o))
        with pytest.raises(NotImplementedError, match="o's cotangent.*corope_attention_ref"):
            torch.autograd.grad(o, q, do)


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    q, k, v = (x.requires_grad_() for x in _inputs(2, 8, 2, 300, 128, torch.bfloat16))
    do = torch.randn_like(q)
    fn = lambda q, k, v: corope_attention(q, k, v, leader="mean") * 2.0
    o_eager = fn(q, k, v)
    g_eager = torch.autograd.grad(o_eager, (q, k, v), do)
    compiled = torch.compile(fn, fullgraph=True)
    o_comp = compiled(q, k, v)
    g_comp = torch.autograd.grad(o_comp, (q, k, v), do)
    assert_close("o", o_comp, o_eager, atol=0.0, rtol=0.0)
    for name, a, b in zip(("dq", "dk", "dv"), g_comp, g_eager, strict=True):
        # The same kernels on the same inputs: compiled and eager agree up to the order of the
        # backward's atomic adds and the round-off of the surrounding elementwise ops.
        assert_close(name, a, b, atol=1e-2, rtol=1e-2)


def _small(dtype=torch.float32, HQ=4, HKV=2, N=8, D=64):
    return _inputs(1, HQ, HKV, N, D, dtype)


@pytest.mark.parametrize(
    "make, kwargs, exc, words",
    [
        (lambda: _small(HQ=3), {}, ValueError, "multiple"),
        (lambda: _small(), {"rope_dim": 33}, ValueError, "rope_dim"),
        (lambda: _small(), {"rope_dim": 128}, ValueError, "rope_dim"),
        (lambda: _small(D=48), {}, ValueError, "head dim"),
        (lambda: _small(dtype=torch.float64), {}, TypeError, "float64"),
        (lambda: (_small(N=9)[0], *_small()[1:]), {}, ValueError, "k needs at least 9"),
        (
            lambda: (_small(N=3)[0].requires_grad_(), *_small()[1:]),
            {},
            ValueError,
            r"\(NQ=3 < NK=8\) have no backward kernel: run them under torch.no_grad",
        ),
        (
            lambda: (_small(N=1)[0].requires_grad_(), *_small()[1:]),
            {},
            ValueError,
            r"\(NQ=1 < NK=8\) have no backward kernel: run them under torch.no_grad",
        ),
        (lambda: (_small()[0], _small()[1].half(), _small()[2]), {}, TypeError, "dtype"),
        (lambda: (_small()[0][0], *_small()[1:]), {}, ValueError, "dimensions"),
        (lambda: (_small()[0].long(), *_small()[1:]), {}, TypeError, "floating"),
        (lambda: _small(), {"leader": "last"}, ValueError, "leader"),
        (lambda: _small(), {"leader": np.array("first")}, TypeError, "leader must be a str"),
        (
            lambda: (_small()[0].to_sparse(), *_small()[1:]),
            {},
            TypeError,
            "q must be a dense",
        ),
        (lambda: _small(), {"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        (lambda: _small(), {"inv_freq": torch.ones(5, device=DEVICE)}, ValueError, "inv_freq"),
        (
            lambda: _small(),
            {"inv_freq": torch.ones(32, device=DEVICE).half()},
            TypeError,
            "inv_freq must have",
        ),
        (  # learned frequencies make the call differentiable: a cache's chunk has no backward
            lambda: (_small(N=3)[0], *_small()[1:]),
            {"inv_freq": torch.ones(32, device=DEVICE).requires_grad_()},
            ValueError,
            r"\(NQ=3 < NK=8\) have no backward kernel",
        ),
        (lambda: _small(), {"inv_freq": [1.0] * 32}, TypeError, "inv_freq must be a torch.Tensor"),
        (
            lambda: _small(),
            {"inv_freq": torch.ones(32, device="meta")},
            ValueError,
            "inv_freq is on meta but q is on",
        ),
        (lambda: _small(), {"detach_mileage": "False"}, TypeError, "detach_mileage must be a bool"),
        (lambda: _small(), {"deterministic": 1}, TypeError, "deterministic must be a bool"),
        (lambda: _small(HQ=0, HKV=1), {}, ValueError, "positive multiple"),
        (lambda: _small(D=33), {}, ValueError, r"head dim .* must be even .*got 33"),
    ],
    ids=[
        "HQ-not-multiple",
        "odd-rope-dim",
        "rope-dim-over-D",
        "D48",
        "float64",
        "q-longer-than-k",
        "rows-continuing-a-cache",
        "decode-step-with-grad",
        "dtype-mismatch",
        "3d-q",
        "int-q",
        "bad-leader",
        "numpy-leader",
        "sparse-q",
        "negative-scale",
        "inv-freq-length",
        "inv-freq-fp16",
        "learned-inv-freq-continuing-a-cache",
        "inv-freq-list",
        "inv-freq-other-device",
        "detach-mileage-str",
        "deterministic-int",
        "HQ0",
        "odd-D",
    ],
)
def test_bad_inputs_raise(make, kwargs, exc, words):
    q, k, v = make()
    with pytest.raises(exc, match=words):
        corope_attention(q, k, v, **kwargs)


@pytest.mark.gpu
def test_mixed_devices_refused_gpu():
    q, k, v = _small()
    with pytest.raises(ValueError, match="device"):
        corope_attention(q, k.cpu(), v)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 products: a CPU question")
def test_bf16_refused_in_the_interpreter():
    with pytest.raises(TypeError, match="q is bfloat16 on the CPU: Triton's interpreter"):
        corope_attention(*(x.bfloat16() for x in _small()))


@pytest.mark.skipif(ON_GPU, reason="CPU tensors are refused only when the interpreter is off")
def test_cpu_refused_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        corope_attention(*_small())


# 3e38: finite in fp32, but not times log2(e), as the kernels hold it (a review's find)
@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, True, 3e38])
def test_softmax_scale_must_be_a_positive_finite_number(scale):
    q = torch.randn(1, 2, 8, 32, device=DEVICE)
    k = torch.randn(1, 1, 8, 32, device=DEVICE)
    with pytest.raises((ValueError, TypeError), match="softmax_scale"):
        corope_attention(q, k, k, softmax_scale=scale)


def test_backward_op_fake_matches_real_strides_for_transposed_inputs():
    # The harness feeds q, k, v as [B, N, H, D] buffers viewed as [B, H, N, D]; the fake
    # (meta) backward must promise the strides the real one returns, or compiled training breaks.
    from corope.attention import _attention_backward_op

    B, N, D = 1, 16, 32
    q = torch.randn(B, N, 2, D, device=DEVICE).transpose(1, 2)
    k = torch.randn(B, N, 1, D, device=DEVICE).transpose(1, 2)
    v = torch.randn(B, N, 1, D, device=DEVICE).transpose(1, 2)
    w = corope_inv_freq(D, 10000.0, None, q.device)
    o, lse = corope_fwd(q, k, v, w, D**-0.5, D, "first")
    args = (torch.randn_like(o), q, k, v, o, lse, w, D**-0.5, D, "first", False, False)
    for freq_grad in (False, True):  # dinv_freq: [R/2], or empty where none is asked for
        for window in (0, 5):  # 0: none
            torch.library.opcheck(
                _attention_backward_op, (*args, freq_grad, window), test_utils=("test_faketensor",)
            )


def test_index_span_past_int32_is_refused():
    # The kernels index within one KV group in int32 (batch and group offsets are int64): a
    # group of 32 query heads at N = 2**19, D = 128 spans 2**31 elements, as does a [B, N, H,
    # D] view of one head's keys just past that length. Meta tensors: shapes and strides only.
    G, N, D = 32, 2**19, 128
    meta = dict(device="meta", dtype=torch.bfloat16)
    k_ok = torch.empty(1, 1, N, D, **meta)
    forward.check_index_span(G, dict(q=torch.empty(1, G, N - 8, D, **meta)), dict(k=k_ok))
    with pytest.raises(ValueError, match=r"^q spans 2147483648 elements within one KV group"):
        forward.check_index_span(G, dict(q=torch.empty(1, G, N, D, **meta)), dict(k=k_ok))
    # one head of a [B, N + 1, 32, D] key tensor: its rows are G * D apart
    k_wide = torch.empty(1, N + 1, G, D, **meta).transpose(1, 2)[:, :1]
    q_small = torch.empty(1, 1, N + 1, D, **meta)
    with pytest.raises(ValueError, match=r"^k spans \d+ elements within one KV group"):
        forward.check_index_span(1, dict(q=q_small), dict(k=k_wide))
    # the launchers' own buffers: G * N * D with N padded to 8 and the group of 17 heads to 32
    q_17 = torch.empty(1, 17, N - 7, D, **meta)
    with pytest.raises(ValueError, match=r"G \* N \* D = 32 \* 524281 \* 128 .*padded from 17"):
        forward.check_index_span(17, dict(q=q_17), dict(k=k_ok))


def test_launcher_refuses_inv_freq_of_the_wrong_length():
    # The kernel reads rope_dim / 2 frequencies: a shorter inv_freq would be read past its end.
    q = torch.randn(1, 2, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="inv_freq must have rope_dim / 2 = 16 elements, got 8"):
        corope_fwd(q, q[:, :1], q[:, :1], torch.ones(8), 0.1, 32, "first")


def test_interleaved_pairs_layout():
    """The forward's operand copies: channel 2 d + h holds x[..., h R/2 + d], channels last, and
    the padding (positions, heads, channels) is zero, which the kernel's chunks rely on."""
    x = torch.randn(2, 3, 2, 5, 8, dtype=torch.bfloat16)  # [B, HKV, G, N, D]
    out = forward.interleaved_pairs(x, 6, 8, 16, 4)
    assert out.dtype == torch.bfloat16
    assert out.shape == (2, 3, 8, 4, 16)
    for d in range(3):
        for h in range(2):
            assert torch.equal(out[:, :, :5, :2, 2 * d + h], x[..., h * 3 + d].permute(0, 1, 3, 2))
    assert not out[:, :, 5:].any() and not out[:, :, :, 2:].any() and not out[..., 6:].any()
    k = forward.interleaved_pairs(x[:, :, :1], 6, 8, 16, 1, torch.float32)
    assert k.shape == (2, 3, 8, 16) and k.dtype == torch.float32
    assert torch.equal(k[:, :, :5, :6], out[:, :, :5, 0, :6].float())
    with pytest.raises(
        ValueError, match="rope_dim must be even, positive and at most the head dim"
    ):
        forward.interleaved_pairs(x, 5, 8, 16, 4)
    for args, name in (((4, 16, 4), "n_pad must be at least 5"),
                       ((8, 4, 4), "r_pad must be at least 6"),
                       ((8, 16, 1), "g_pad must be at least 2")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            forward.interleaved_pairs(x, 6, *args)


def test_torch_func_is_refused():
    """PyTorch refuses a custom op's autograd under torch.func: refused here first, naming
    torch.autograd and the reference, rather than PyTorch's message about a Function."""
    q, k, v = (torch.randn(1, 2, 8, 32, device=DEVICE) for _ in range(3))
    with pytest.raises(NotImplementedError, match="torch.func.*corope_attention_ref"):
        torch.func.grad(lambda x: corope_attention(x, k, v).sum())(q)
    # the reference it names runs there (without its checkpointed chunks)
    got = torch.func.grad(lambda x: corope_attention_ref(x, k, v).square().sum())(q)
    x = q.clone().requires_grad_()
    corope_attention_ref(x, k, v).square().sum().backward()
    torch.testing.assert_close(got, x.grad)


def test_a_gradient_of_the_gradients_is_refused_naming_the_reference():
    """create_graph=True gives first-order gradients; a backward through them is refused with
    the reference named, which differentiates twice (PyTorch's message named only an op
    without an autograd formula; a review's find)."""
    q, k, v = (torch.randn(1, 2, 8, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    for attention in (corope_attention, corope_attention_ref):
        (dq,) = torch.autograd.grad(attention(q, k, v).square().sum(), q, create_graph=True)
        if attention is corope_attention:
            with pytest.raises(NotImplementedError, match="gradient of the gradients use corope"):
                dq.sum().backward()
        else:
            dq.sum().backward()
            assert k.grad is not None and k.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["forward_ad", "jvp"])
def test_forward_mode_ad_is_refused(mode):
    """The custom op has no forward-mode derivative and PyTorch would drop the tangent (a
    silent zero): a tangent on q is refused, naming the reference that has one."""
    q, k, v = (torch.randn(1, 2, 8, 32, device=DEVICE) for _ in range(3))
    with pytest.raises(NotImplementedError, match="forward-mode.*corope_attention_ref"):
        if mode == "jvp":
            torch.func.jvp(lambda x: corope_attention(x, k, v), (q,), (torch.ones_like(q),))
        else:
            with torch.autograd.forward_ad.dual_level():
                corope_attention(torch.autograd.forward_ad.make_dual(q, torch.ones_like(q)), k, v)
    w = corope_inv_freq(32, 10000.0, None, q.device)
    with torch.autograd.forward_ad.dual_level():  # the frequencies' tangent, dropped before
        dual = torch.autograd.forward_ad.make_dual(w, torch.ones_like(w))
        with pytest.raises(NotImplementedError, match="inv_freq carries a forward-mode"):
            corope_attention(q, k, v, inv_freq=dual)


def test_more_groups_than_the_backward_grid_takes_are_refused_with_autograd(monkeypatch):
    """The backward's grid has B x HKV on its second axis (CUDA: at most 65535; lowered here):
    with autograd that is refused before the forward runs; without, the forward's 1-D grid
    takes it."""
    import corope.attention

    monkeypatch.setattr(corope.attention, "MAX_GRID_AXIS1", 1)
    q, k, v = (torch.randn(1, h, 8, 32, device=DEVICE) for h in (4, 2, 2))
    with pytest.raises(
        ValueError, match=r"at most 1 \(batch, KV head\) groups, got B x HKV = 1 x 2"
    ):
        corope_attention(q.requires_grad_(), k, v)
    with torch.no_grad():
        torch.testing.assert_close(corope_attention(q, k, v), corope_attention_ref(q, k, v))


def test_backward_grid_limit_counts_kv_heads_inclusively(monkeypatch):
    """B x HKV = 2 at a (lowered) limit of 2 runs with autograd; HQ = 4 does not count."""
    monkeypatch.setattr(attention_module, "MAX_GRID_AXIS1", 2)
    q, k, v = (x.requires_grad_() for x in _inputs(1, 4, 2, 8, 32, torch.float32))
    corope_attention(q, k, v).sum().backward()
    assert q.grad is not None


def test_a_single_position_is_differentiable():
    """NQ = NK = 1 is training, not a decoding step: it takes the differentiable kernels."""
    q, k, v = (x.requires_grad_() for x in _inputs(1, 4, 2, 1, 32, torch.float32))
    do = torch.randn_like(q)
    o = corope_attention(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = corope_attention_ref(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    assert_close("o", o, ref, atol=1e-5, rtol=1e-5)
    # one key: the softmax is 1 whatever the scores, so dq and dk are 0 up to rounding
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad.float(), atol=1e-5, rtol=1e-5)


def test_eager_decoding_steps_skip_the_custom_op(monkeypatch):
    q, k, v = _inputs(1, 4, 2, 1, 32, torch.float32)
    k, v = (torch.randn(1, 2, 9, 32, device=q.device) for _ in range(2))
    with torch.no_grad():
        want = corope_attention(q, k, v)
        monkeypatch.setattr(
            attention_module, "_decode_op", lambda *a: pytest.fail("an eager step took the op")
        )
        assert torch.equal(corope_attention(q, k, v), want)
