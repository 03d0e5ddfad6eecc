"""Properties of the Co-RoPE-GQA reference (corope/naive.py), the ground truth of the kernels.

Everything here runs in float64 on the CPU (or the GPU when present): these are identities
of the math, so the tolerances are float64 round-off, not kernel tolerances.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from corope.naive import corope_attention_ref, corope_inv_freq
from fused_rope.naive import apply_rope_ref
from tests.helpers import DEVICE, assert_close

F64 = dict(device=DEVICE, dtype=torch.float64)


def _qkv(B, HQ, HKV, N, D):
    return (
        torch.randn(B, HQ, N, D, **F64),
        torch.randn(B, HKV, N, D, **F64),
        torch.randn(B, HKV, N, D, **F64),
    )


def _rope_attention(q, k, v, rope_dim, theta, scale):
    """RoPE (split-half, positions 0..N-1) + causal softmax attention, float64, GQA by repeat."""
    N, D = q.shape[-2:]
    inv_freq = corope_inv_freq(rope_dim, theta, None, q.device).double()
    angles = torch.arange(N, **F64)[:, None] * inv_freq  # [N, R/2]
    qr = apply_rope_ref(q, angles, "half", rope_dim)
    kr = apply_rope_ref(k, angles, "half", rope_dim)
    G = q.shape[1] // k.shape[1]
    kr, vr = kr.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = scale * qr @ kr.transpose(-1, -2)
    causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ vr


@pytest.mark.parametrize(
    "B, HQ, HKV, N, D, rope_dim",
    [
        pytest.param(1, 2, 2, 9, 8, None, id="G1-N9-D8"),
        pytest.param(2, 4, 1, 17, 16, None, id="G4-N17-D16"),
        pytest.param(1, 6, 2, 13, 16, 8, id="G3-N13-D16-R8"),
    ],
)
def test_unit_gates_is_rope_attention(B, HQ, HKV, N, D, rope_dim):
    q, k, v = _qkv(B, HQ, HKV, N, D)
    out = corope_attention_ref(q, k, v, rope_dim=rope_dim, theta=500.0, unit_gates=True)
    ref = _rope_attention(q, k, v, rope_dim or D, 500.0, D**-0.5)
    assert_close("unit gates vs RoPE attention", out, ref, atol=1e-10, rtol=1e-12)


def _corope_written_out(q, k, v, w, scale, leader):
    """Co-RoPE-GQA element by element, in Python loops over float64 scalars, from the
    definitions (corope/README.md): an oracle for the gated path that shares no code with
    the reference. The leader's gate on key t for query i is ``sigmoid(s qL[i] . k[t])``, the
    mileage ``delta[i, j] = sum_{j < t <= i} z[i, t]``, key pair ``(k[d], k[d + R/2])``
    rotated by ``-delta w[d]`` (``w``: the R/2 frequencies, floats)."""
    B, HQ, N, D = q.shape
    HKV, half = k.shape[1], len(w)
    rope_dim, G = 2 * half, HQ // HKV
    o = torch.zeros_like(q)
    for b, g, i in itertools.product(range(B), range(HKV), range(N)):
        heads = range(g * G, (g + 1) * G)
        lead = q[b, g * G, i] if leader == "first" else sum(q[b, h, i] for h in heads) / G
        z = [1.0 / (1.0 + math.exp(-scale * float(lead @ k[b, g, t]))) for t in range(N)]
        for h in heads:
            scores = []
            for j in range(i + 1):
                delta = sum(z[t] for t in range(j + 1, i + 1))
                score = float(q[b, h, i, rope_dim:] @ k[b, g, j, rope_dim:])
                for d in range(half):
                    c, sn = math.cos(delta * w[d]), math.sin(delta * w[d])
                    k1, k2 = float(k[b, g, j, d]), float(k[b, g, j, d + half])
                    score += float(q[b, h, i, d]) * (k1 * c + k2 * sn)
                    score += float(q[b, h, i, d + half]) * (k2 * c - k1 * sn)
                scores.append(scale * score)
            top = max(scores)
            p = [math.exp(x - top) for x in scores]
            o[b, h, i] = sum(pj / sum(p) * v[b, g, j] for j, pj in enumerate(p))
    return o


@pytest.mark.parametrize("leader", ["first", "mean"])
def test_reference_matches_the_math_written_out(leader):
    """The gates (their scale, the leader), the mileage's range and the rotation's direction,
    against loops written from the definitions: the kernels are tested against the
    reference, so an error in both would pass every other test."""
    q, k, v = _qkv(2, 4, 2, 7, 8)
    # fp32 frequencies, as the reference (and the kernels) use them
    w = torch.tensor([50.0 ** (-2 * d / 6) for d in range(3)], device=DEVICE).float()
    out = corope_attention_ref(q, k, v, inv_freq=w, rope_dim=6, softmax_scale=0.7, leader=leader)
    expected = _corope_written_out(q, k, v, w.tolist(), 0.7, leader)
    assert_close("reference vs written out", out, expected, atol=1e-12, rtol=1e-10)


def test_rotated_key_dtype_rounds_only_the_rotated_key():
    q, k, v = _qkv(1, 4, 2, 23, 16)
    o, lse = corope_attention_ref(q, k, v, return_lse=True)
    same = corope_attention_ref(q, k, v, return_lse=True, rotated_key_dtype=q.dtype)
    assert all(torch.equal(a, b) for a, b in zip((o, lse), same, strict=True))
    # fp16 keeps 11 bits of each rotated key: scores move by a few 1e-4 at these magnitudes.
    _, lse16 = corope_attention_ref(q, k, v, return_lse=True, rotated_key_dtype=torch.float16)
    assert 0 < (lse16 - lse).abs().max() < 5e-3
    # Row 0 sees only key 0, which no phase rotates: its scores round k itself.
    k16 = k.clone()
    k16[:, :, 0] = k[:, :, 0].half().double()
    _, lse_k16 = corope_attention_ref(q, k16, v, return_lse=True)
    assert torch.equal(lse16[..., 0], lse_k16[..., 0])
    for bad in (torch.int32, "float16"):
        with pytest.raises(TypeError, match="rotated_key_dtype must be a floating torch.dtype"):
            corope_attention_ref(q, k, v, rotated_key_dtype=bad)


@pytest.mark.parametrize("leader", ["first", "mean"])
def test_chunk_size_invariance(leader):
    q, k, v = _qkv(1, 4, 2, 23, 16)
    full, lse_full = corope_attention_ref(q, k, v, leader=leader, chunk_size=23, return_lse=True)
    for chunk in (1, 5, 8):
        out, lse = corope_attention_ref(q, k, v, leader=leader, chunk_size=chunk, return_lse=True)
        assert_close(f"o, chunk {chunk}", out, full, atol=1e-12, rtol=1e-13)
        assert_close(f"lse, chunk {chunk}", lse, lse_full, atol=1e-12, rtol=1e-13)


def test_chunks_are_recomputed_in_the_backward_unless_the_call_is_one_small_chunk(monkeypatch):
    """Checkpointing (recomputing a chunk's tensors in the backward) bounds training memory to
    a chunk's; a call that is one chunk of at most _KEEP_ELEMENTS keeps its tensors instead.
    The gradients are the same bits either way."""
    import corope.naive as naive

    calls, real = [], naive.checkpoint

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(naive, "checkpoint", counted)
    leaves = [x.requires_grad_() for x in _qkv(1, 4, 2, 23, 16)]
    do = torch.randn(1, 4, 23, 16, dtype=torch.float64, device=DEVICE)

    def grads(**kw):
        return torch.autograd.grad(corope_attention_ref(*leaves, **kw), leaves, do)

    kept = grads()  # 2 groups x 23 x 23 x 8 elements: one small chunk
    assert calls == []
    assert grads(chunk_size=5) and len(calls) == 5  # chunks of 5 of the 23 rows
    monkeypatch.setattr(naive, "_KEEP_ELEMENTS", 2 * 23 * 23 * 8 - 1)
    recomputed = grads()  # one chunk, one element too large to keep
    assert len(calls) == 6
    for a, b in zip(kept, recomputed, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # nothing to recompute without autograd
        corope_attention_ref(*leaves, chunk_size=5)
    assert len(calls) == 6
    # learned frequencies alone need a gradient: still checkpointed (numpy's ints are ints)
    w = corope_inv_freq(16, 10000.0, None, DEVICE, torch.float64).clone().requires_grad_()
    frozen = [x.detach() for x in leaves]
    corope_attention_ref(*frozen, inv_freq=w, chunk_size=np.int64(5)).sum().backward()
    assert len(calls) == 11 and w.grad is not None
    with pytest.raises(TypeError, match="chunk_size must be an int or None, got float"):
        corope_attention_ref(*frozen, chunk_size=5.0)


def test_rows_are_the_full_references_rows():
    q, k, v = _qkv(1, 4, 2, 23, 16)
    full, lse_full = corope_attention_ref(q, k, v, leader="mean", return_lse=True)
    for rows in (range(23), range(0, 1), range(7, 19), range(20, 23)):
        out, lse = corope_attention_ref(
            q, k, v, leader="mean", rows=rows, chunk_size=5, return_lse=True
        )
        assert_close(f"o, rows {rows}", out, full[:, :, rows.start : rows.stop], 1e-12, 1e-13)
        assert_close(f"lse, rows {rows}", lse, lse_full[:, :, rows.start : rows.stop], 1e-12, 1e-13)
    for bad in (range(5, 5), range(0, 24), range(0, 10, 2), range(-1, 3)):
        with pytest.raises(ValueError, match="rows must be a range of step 1 with 0 <= start"):
            corope_attention_ref(q, k, v, rows=bad)
    with pytest.raises(TypeError, match="rows must be a range or None, got slice"):
        corope_attention_ref(q, k, v, rows=slice(0, 4))


@pytest.mark.parametrize("leader", ["first", "mean"])
def test_fewer_query_rows_are_the_last_positions(leader):
    """q of NQ < NK rows (a KV-cached decoding step: NQ = 1) gives the last NQ rows of the
    whole sequence's output, its gradients included: its gates and mileage run over all of
    k, which a cache holds."""
    q, k, v = (x.requires_grad_() for x in _qkv(2, 6, 2, 19, 16))
    do = torch.randn(2, 6, 19, 16, **F64)
    full, lse_full = corope_attention_ref(q, k, v, leader=leader, return_lse=True)
    for NQ in (1, 4, 19):
        q_last = q[:, :, -NQ:].detach().requires_grad_()
        out, lse = corope_attention_ref(q_last, k, v, leader=leader, chunk_size=3, return_lse=True)
        assert_close(f"o, last {NQ}", out, full[:, :, -NQ:], atol=1e-12, rtol=1e-12)
        assert_close(f"lse, last {NQ}", lse, lse_full[:, :, -NQ:], atol=1e-12, rtol=1e-12)
        got = torch.autograd.grad(out, (q_last, k, v), do[:, :, -NQ:])
        want = torch.autograd.grad(full[:, :, -NQ:], (q, k, v), do[:, :, -NQ:], retain_graph=True)
        for name, a, b in zip(
            ("dq", "dk", "dv"), got, (want[0][:, :, -NQ:], *want[1:]), strict=True
        ):
            assert_close(f"{name}, last {NQ}", a, b, atol=1e-12, rtol=1e-12)
    one = q[:, :, -1:].detach()
    rows = corope_attention_ref(q[:, :, -5:].detach(), k, v, leader=leader, rows=range(4, 5))
    assert_close(
        "rows of the last positions",
        rows,
        corope_attention_ref(one, k, v, leader=leader),
        1e-12,
        1e-12,
    )
    with pytest.raises(ValueError, match="q's 20 rows are the last of k's positions, so k needs"):
        corope_attention_ref(torch.randn(2, 6, 20, 16, **F64), k, v)


@pytest.mark.parametrize("leader", ["first", "mean"])
def test_gradcheck(leader):
    q, k, v = (x.requires_grad_() for x in _qkv(1, 4, 2, 6, 4))
    fn = lambda q, k, v: corope_attention_ref(q, k, v, leader=leader, theta=10.0, chunk_size=4)
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6)


def test_detach_mileage_changes_gradients_not_outputs():
    q, k, v = (x.requires_grad_() for x in _qkv(1, 4, 2, 11, 8))
    do = torch.randn(1, 4, 11, 8, **F64)
    o_full = corope_attention_ref(q, k, v, theta=10.0)
    g_full = torch.autograd.grad(o_full, (q, k, v), do)
    o_det = corope_attention_ref(q, k, v, theta=10.0, detach_mileage=True)
    g_det = torch.autograd.grad(o_det, (q, k, v), do)
    assert torch.equal(o_full, o_det)
    # v only enters through the softmax weights, which do not depend on the detach.
    assert_close("dv", g_det[2], g_full[2], atol=1e-12, rtol=1e-12)
    for name, a, b in (("dq", g_det[0], g_full[0]), ("dk", g_det[1], g_full[1])):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel > 1e-3, (
            f"{name} barely changed ({rel:.2e}): the mileage path carries no gradient"
        )


def test_mean_leader_with_one_head_per_group_is_first():
    q, k, v = _qkv(2, 3, 3, 10, 8)
    first, lse1 = corope_attention_ref(q, k, v, leader="first", return_lse=True)
    mean, lse2 = corope_attention_ref(q, k, v, leader="mean", return_lse=True)
    assert_close("o", mean, first, atol=1e-13, rtol=1e-13)
    assert_close("lse", lse2, lse1, atol=1e-13, rtol=1e-13)


def test_leaders_differ_for_groups():
    # Guards the test above against a reference that ignores the leader altogether.
    q, k, v = _qkv(1, 4, 1, 10, 8)
    first = corope_attention_ref(q, k, v, leader="first")
    mean = corope_attention_ref(q, k, v, leader="mean")
    assert (first - mean).abs().max().item() > 1e-3


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_bad_key_reaches_only_the_rows_that_see_it(bad):
    """A NaN or inf in key 8 reaches rows 8.. only: the gates are masked by a select (a product
    with the mask gave the earlier rows NaN * 0 = NaN gates, hence NaN outputs)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 16, device=DEVICE) for _ in range(3))
    k[0, 0, 8, 0] = bad
    o = corope_attention_ref(q, k, v)
    assert torch.isfinite(o[:, :, :8]).all()
    clean = corope_attention_ref(q, torch.nan_to_num(k, nan=0.0, posinf=0.0), v)
    assert torch.equal(o[:, :, :8], clean[:, :, :8])


def test_a_chunk_takes_only_the_keys_its_rows_see():
    """Each chunk of rows computes over the keys its rows see (none past its last row, none
    before its first row's window), as a kernel's query tile does: a NaN value at key 8, which
    the weights' zeros would carry into every row of a chunk that held it (P @ v), reaches
    the chunks of rows 8.. only, and with a window of 3 not the chunks from row 12 on."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))
    v[0, 0, 8, 0] = float("nan")
    o = corope_attention_ref(q, k, v, chunk_size=4)
    assert o[:, :, :8].isfinite().all() and not o[:, :, 8:12].isfinite().all()
    o = corope_attention_ref(q, k, v, chunk_size=4, window=3)
    assert o[:, :, :8].isfinite().all() and o[:, :, 12:].isfinite().all()


def test_fp64_frequencies_stay_fp64():
    """The float64 reference keeps float64 frequencies (it rounded them to fp32, which
    gradcheck with respect to inv_freq exposed)."""
    q, k, v = _qkv(1, 2, 1, 9, 8)
    w = torch.tensor([1.0, 0.37, 0.11, 0.013], **F64)
    assert not torch.equal(
        corope_attention_ref(q, k, v, inv_freq=w),
        corope_attention_ref(q, k, v, inv_freq=w.float().double()),
    )
    fn = lambda w: corope_attention_ref(q, k, v, inv_freq=w, theta=10.0)
    assert torch.autograd.gradcheck(fn, (w.clone().requires_grad_(),), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["detach_mileage", "unit_gates", "return_lse"])
def test_flags_must_be_bools(name):
    """A truthy string would have turned the option on."""
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        corope_attention_ref(*_qkv(1, 2, 1, 4, 8), **{name: "False"})


@pytest.mark.parametrize("nk", [0, 5])
def test_no_query_rows(nk):
    """NQ = 0 (with or without keys) gives empty outputs, as the kernel does."""
    q, k, v = _qkv(1, 2, 1, max(nk, 1), 8)
    leaves = [x.requires_grad_() for x in (q[:, :, :0], k[:, :, :nk], v[:, :, :nk])]
    o, lse = corope_attention_ref(*leaves, return_lse=True)
    assert o.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
    # differentiable, with zero gradients (new empty tensors had no graph: a review's find)
    grads = torch.autograd.grad(o.sum() + lse.sum(), leaves)
    assert all(torch.equal(g, torch.zeros_like(x)) for g, x in zip(grads, leaves, strict=True))


def test_reference_keeps_fp32_under_autocast():
    """Under bf16 autocast (the harness trains and generates under it) the reference still
    computes in fp32: its gate and score products ran in bf16, 2.3e-2 off at N = 512 where
    bf16-rounded inputs alone give 1.3e-3."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 32) for h in (4, 2, 2))
    for train in (False, True):
        leaves = [x.clone().requires_grad_(train) for x in (q, k, v)]
        expected = corope_attention_ref(*leaves)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = corope_attention_ref(*leaves, chunk_size=16)  # checkpointed chunks too
        assert got.dtype == torch.float32
        assert_close("o under autocast", got, expected, atol=1e-6, rtol=1e-6)
        if train:
            do = torch.randn_like(got)
            grads = torch.autograd.grad(got, leaves, do)
            for g, e in zip(grads, torch.autograd.grad(expected, leaves, do), strict=True):
                assert_close("grad under autocast", g, e, atol=1e-5, rtol=1e-5)
