"""RoPE fused into FlashAttention (fused_rope.attention) against RoPE + float64 attention.

Every case checks o, lse and dq, dk, dv (random cotangents for o and for lse) with
flash-attention's rule: the kernel's error against the float64 reference is at most twice
the error of PyTorch in the kernel's dtype. That baseline is ``rope_attention_in_dtype``: RoPE
computed in fp32 and cast to the dtype (apply_rope_ref), then an explicit
``softmax(scale * q k^T) v`` whose matmuls, softmax and logsumexp run in the dtype; the
lse value (fp32 from the kernels) is held to the logsumexp of the dtype's scores in fp32.

On CPU (Triton interpreter) a covering subset runs in fp32/fp16 at small shapes; on a GPU
``test_gpu_product`` runs the full product of the options in fp16 and bf16 with each kernel's
untuned config, and ``test_gpu_every_config`` runs every autotune config.
"""

from __future__ import annotations

import math
import random
import types

import pytest
import torch
import triton
import triton.language as tl
from torch.utils.checkpoint import checkpoint
from triton.runtime.errors import OutOfResources

import fused_rope.sdpa
from fused_rope import attention as attention_module
from fused_rope import attention_forward
from fused_rope._attention_common import _sectioned_program
from fused_rope.attention import max_head_dim, rope_attention
from fused_rope.frequencies import mrope_angles, rope_angles, rope_frequencies
from fused_rope.naive import rope_attention_ref
from fused_rope.sdpa import sdpa_attention
from tests.helpers import (
    DEVICE,
    ON_GPU,
    assert_close,
    assert_close_to_baseline,
    deterministic_algorithms,
    rope_attention_in_dtype,
)


@pytest.fixture(autouse=True)
def _untuned():
    """On a GPU every new shape would autotune, compiling every config for every combination
    of options: the sweeps run the untuned config; test_gpu_every_config covers the others."""
    if not ON_GPU:
        yield
        return
    with attention_module.pinned_config(-1):
        yield


def _mrope_sections(half: int) -> list[int]:
    """Three M-RoPE axes (t, h, w) over ``half`` frequency slots, the first taking the
    remainder; also valid interleaved (Qwen3-VL)."""
    return [half - 2 * (half // 3), half // 3, half // 3]


def _mrope(inv_freq, B, N, generator=None):
    """M-RoPE angles ``[B, N, R/2]`` of random (t, h, w) positions, the slots interleaved over
    the axes as Qwen3-VL's."""
    pos = torch.randint(0, 4 * N, (3, B, N), device=inv_freq.device, generator=generator)
    return mrope_angles(pos, inv_freq, _mrope_sections(inv_freq.shape[0]), interleaved=True)


def _loss(o, lse, do, dlse):
    # rows with no visible key have lse = -inf and get no lse cotangent
    return (o.float() * do).sum() + (lse.float().nan_to_num(0.0, neginf=0.0) * dlse).sum()


def _check_case(
    B,
    HQ,
    HKV,
    NQ,
    NK,
    D,
    *,
    dtype,
    causal=True,
    layout="half",
    rope_dim=None,
    positions="default",
    q_positions=False,
    theta=10000.0,
    inv_freq=None,
    softmax_scale=None,
    attention_factor=1.0,
    transposed=False,
    strided_channels=False,
    impl="fused",
    learn=False,
    window=None,
):
    """Runs one configuration and checks o, lse, dq, dk, dv with the flash-attention rule.

    positions: "default" (None), "shared" ([NK], shuffled offsets), "batch" ([B, NK]) or
        "mrope" (``angles`` [B, NK, R/2] of random 3-axis M-RoPE positions, ``_mrope``).
    q_positions: pass explicit (random) query positions (with "mrope": ``q_angles``).
    transposed: q, k, v are [B, N, H, D] tensors seen through .transpose(1, 2).
    strided_channels: q, k, v and the cotangent are [B, H, D, N] tensors seen through
        .transpose(-1, -2): the channels' stride is N, not 1 (the kernels take any strides).
    impl: rope_attention's; the fused kernel returns lse (checked), "separate" and "auto" not.
    learn: the rotation's inputs require grad and their gradients are checked too: the angles
        (with "mrope"), else ``inv_freq`` and the explicit positions as fp32.
    window: rope_attention's causal sliding window.
    """

    def make(h, n, dtype=dtype):
        if transposed:
            return torch.randn(B, n, h, D, device=DEVICE, dtype=dtype).transpose(1, 2)
        if strided_channels:
            return torch.randn(B, h, D, n, device=DEVICE, dtype=dtype).transpose(-1, -2)
        return torch.randn(B, h, n, D, device=DEVICE, dtype=dtype)

    q, k, v = make(HQ, NQ), make(HKV, NK), make(HKV, NK)
    R = rope_dim or D
    freqs = (inv_freq if inv_freq is not None else rope_frequencies(R, theta)[0]).to(DEVICE)
    kw = dict(
        causal=causal, layout=layout, rope_dim=rope_dim, softmax_scale=softmax_scale,
        attention_factor=attention_factor, window=window,
    )  # fmt: skip
    leaf = lambda x: x if x is None or not learn else x.float().requires_grad_()
    if positions == "mrope":
        kw.update(angles=leaf(_mrope(freqs, B, NK)))
        kw.update(q_angles=leaf(_mrope(freqs, B, NQ)) if q_positions else None)
        rotation = {name: kw[name] for name in ("angles", "q_angles") if kw[name] is not None}
        q_last = lambda: kw["angles"][:, NK - NQ :] if kw["q_angles"] is None else kw["q_angles"]
        angles = lambda: (q_last(), kw["angles"])
    else:
        pos = {
            "default": None,
            "shared": torch.randperm(4 * NK, device=DEVICE)[:NK],
            "batch": torch.randint(0, 4 * NK, (B, NK), device=DEVICE),
        }[positions]
        qpos = torch.randint(0, 4 * NK, (B, NQ), device=DEVICE) if q_positions else None
        if learn:  # theta's frequencies, made a tensor to differentiate
            freqs, pos, qpos = leaf(freqs), leaf(pos), leaf(qpos)
            inv_freq = freqs
        kw.update(positions=pos, q_positions=qpos, theta=theta, inv_freq=inv_freq)
        rotation = dict(inv_freq=freqs, positions=pos, q_positions=qpos)
        rotation = {name: x for name, x in rotation.items() if x is not None and learn}
        kpos = pos if pos is not None else torch.arange(NK, device=DEVICE)
        if qpos is None:
            qpos = kpos[..., NK - NQ :] if NQ <= NK else torch.arange(NK - NQ, NK, device=DEVICE)
        angles = lambda: (rope_angles(qpos, freqs), rope_angles(kpos, freqs))
    if not learn:
        rotation = {}

    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    with_lse = impl == "fused"
    out = rope_attention(*inputs, return_lse=with_lse, impl=impl, **kw)
    o, lse = out if with_lse else (out, torch.zeros(B, HQ, NQ, device=DEVICE))
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (B, HQ, NQ) and lse.dtype == torch.float32
    do = make(HQ, NQ, torch.float32)
    dlse = torch.randn(lse.shape, device=DEVICE) if with_lse else torch.zeros_like(lse)
    leaves = [*inputs, *rotation.values()]
    grads = torch.autograd.grad(_loss(o, lse, do, dlse), leaves)

    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o64, lse64 = rope_attention_ref(*inputs64, **kw)
    leaves = [*inputs64, *rotation.values()]
    grads64 = torch.autograd.grad(_loss(o64, lse64, do.double(), dlse.double()), leaves)

    inputs_b = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    q_ang, k_ang = angles()
    o_b, lse_b, lse32_b = rope_attention_in_dtype(
        *inputs_b,
        q_angles=q_ang,
        k_angles=k_ang,
        causal=causal,
        scale=softmax_scale or D**-0.5,
        layout=layout,
        rope_dim=R,
        factor=attention_factor,
        window=window,
    )
    leaves = [*inputs_b, *rotation.values()]
    grads_b = torch.autograd.grad(_loss(o_b, lse_b, do, dlse), leaves)

    empty = torch.isneginf(lse64)
    assert torch.all(o[empty] == 0), "rows without a visible key must output 0"
    assert_close_to_baseline("o", o, o64, o_b)
    if with_lse:
        assert torch.equal(torch.isneginf(lse), empty), "rows without a key must have lse=-inf"
        finite = lambda t: t.masked_fill(empty, 0.0)
        assert_close_to_baseline("lse", finite(lse), finite(lse64), finite(lse32_b))
    names = ("dq", "dk", "dv", *(f"d{name}" for name in rotation))
    for name, g, g64, gb in zip(names, grads, grads64, grads_b, strict=True):
        expected_dtype = dtype if name in ("dq", "dk", "dv") else g64.dtype  # rotation: fp32
        assert g.shape == g64.shape and g.dtype == expected_dtype, name
        assert_close_to_baseline(name, g, g64, gb, compute_dtype=dtype)


# ------------------------------------------------------------- interpreter-sized subset

CPU_CASES = [
    # (B, HQ, HKV, NQ, NK, D, options)
    pytest.param(2, 2, 2, 63, 63, 64, dict(), id="B2-H2-N63-D64-causal"),
    pytest.param(1, 4, 1, 40, 100, 32, dict(layout="interleaved"), id="MQA4-NQ40-NK100-inter"),
    pytest.param(
        1, 8, 2, 100, 40, 32, dict(rope_dim=16, learn=True), id="GQA4-NQ100-NK40-partial16-learn"
    ),
    pytest.param(
        2,
        8,
        1,
        33,
        33,
        32,
        dict(causal=False, positions="batch", q_positions=True, learn=True),
        id="B2-MQA8-N33-noncausal-batchpos-qpos-learn",
    ),
    pytest.param(
        2,
        2,
        1,
        50,
        63,
        96,
        dict(layout="interleaved", rope_dim=64, positions="shared"),
        id="GQA2-D96-inter-partial64-sharedpos",
    ),
    pytest.param(1, 1, 1, 500, 500, 32, dict(), id="B1-H1-N500-D32-causal"),
    pytest.param(
        1, 2, 1, 30, 500, 32, dict(causal=False, rope_dim=20), id="NQ30-NK500-noncausal-partial20"
    ),
    pytest.param(
        2, 4, 2, 45, 70, 32, dict(positions="mrope", learn=True), id="GQA2-NQ45-NK70-mrope-learn"
    ),
    pytest.param(
        1,
        2,
        1,
        40,
        33,
        64,
        dict(positions="mrope", q_positions=True, layout="interleaved", rope_dim=40, learn=True),
        id="NQ40-NK33-mrope-qangles-inter-partial40-learn",
    ),
    pytest.param(
        1,
        2,
        2,
        48,
        48,
        128,
        dict(layout="interleaved", transposed=True),
        id="D128-inter-transposed",
    ),
    pytest.param(
        1,
        4,
        2,
        37,
        37,
        32,
        dict(strided_channels=True, learn=True),
        id="GQA2-N37-channels-strided-learn",
    ),
    # sliding windows: narrower than a tile (interpreter tiles: 32 queries x 16 keys), a few
    # tiles wide, off the tiles' multiples, with a prefill (NQ < NK) and with queries that see
    # no key (NQ > NK)
    pytest.param(1, 4, 2, 100, 100, 32, dict(window=5), id="GQA2-N100-window5"),
    pytest.param(
        2,
        2,
        1,
        90,
        90,
        32,
        dict(window=37, positions="batch", learn=True),
        id="B2-GQA2-N90-window37-batchpos-learn",
    ),  # fmt: skip
    pytest.param(
        1,
        2,
        2,
        40,
        100,
        64,
        dict(window=33, layout="interleaved", rope_dim=32),
        id="NQ40-NK100-window33-inter-partial32",
    ),  # fmt: skip
    pytest.param(1, 2, 1, 100, 40, 32, dict(window=1), id="NQ100-NK40-window1"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B, HQ, HKV, NQ, NK, D, opts", CPU_CASES)
def test_matches_reference(B, HQ, HKV, NQ, NK, D, opts, dtype):
    _check_case(B, HQ, HKV, NQ, NK, D, dtype=dtype, **opts)


@pytest.mark.parametrize("impl", ["fused", "separate"])
@pytest.mark.parametrize("rope_dim", [None, 20], ids=["full", "partial"])
def test_attention_factor_scales_the_rotated_channels(rope_dim, impl):
    """YaRN's and LongRoPE's attention factor, as Hugging Face applies it (cos and sin scaled):
    q's and k's rotated channels, not the pass-through ones; o, lse and every gradient against
    the reference, with learned frequencies and a query chunk continuing a cache."""
    inv_freq = rope_frequencies(rope_dim or 32, 10000.0, {"rope_type": "yarn", "factor": 8.0,
                                "original_max_position_embeddings": 16})[0]  # fmt: skip
    for dtype in (torch.float32, torch.float16):
        _check_case(
            1, 4, 2, 30, 45, 32, dtype=dtype, rope_dim=rope_dim, inv_freq=inv_freq.to(DEVICE),
            attention_factor=1.2079, impl=impl, learn=True,
        )  # fmt: skip


def test_inv_freq_theta_and_scale():
    """inv_freq overrides theta; theta and softmax_scale reach the kernel."""
    scaled = rope_frequencies(32, 500000.0)[0] / 4.0
    _check_case(
        1, 2, 1, 40, 40, 32, dtype=torch.float32, inv_freq=scaled.to(DEVICE), softmax_scale=0.3
    )
    _check_case(1, 2, 1, 40, 40, 32, dtype=torch.float32, theta=100.0, layout="interleaved")


@pytest.mark.parametrize("impl", ["fused", "separate"])
@pytest.mark.parametrize("batch", [False, True])
def test_angles_of_positions_give_the_positions_result(batch, impl):
    """``angles = rope_angles(positions, inv_freq)`` rotates exactly as the positions do: the
    fused kernels' tables load the angles where they would form the same fp32 products, and
    the separate path rotates by them; outputs and gradients are bitwise equal."""
    q = torch.randn(2, 4, 30, 32, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(2, 2, 45, 32, device=DEVICE, requires_grad=True) for _ in range(2))
    inv_freq = rope_frequencies(24, 500000.0, device=DEVICE)[0]
    pos = torch.randint(0, 1000, (2, 45) if batch else (45,), device=DEVICE)
    q_pos = torch.randint(0, 1000, (2, 30) if batch else (30,), device=DEVICE)
    common = dict(rope_dim=24, layout="interleaved", causal=False, impl=impl)
    a = rope_attention(q, k, v, positions=pos, q_positions=q_pos, inv_freq=inv_freq, **common)
    b = rope_attention(q, k, v, angles=rope_angles(pos, inv_freq),
                       q_angles=rope_angles(q_pos, inv_freq), **common)  # fmt: skip
    do = torch.randn_like(a)
    grads_a = torch.autograd.grad((a * do).sum(), (q, k, v))
    grads_b = torch.autograd.grad((b * do).sum(), (q, k, v))
    for name, x, y in zip(("o", "dq", "dk", "dv"), (a, *grads_a), (b, *grads_b), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("impl", ["fused", "separate"])
def test_positions_and_angles_of_batch_one_are_shared_by_the_batch(impl):
    """Hugging Face's ``position_ids`` shape: positions ``[1, NK]`` and ``q_positions [1, NQ]``,
    angles ``[1, NK, R/2]`` and ``q_angles [1, NQ, R/2]`` serve every batch as ``[NK]``,
    ``[NQ]``, ``[NK, R/2]``, ``[NQ, R/2]`` do: outputs and gradients bitwise equal, the angles'
    gradients summed over the batch into their ``[1, .., R/2]``."""
    q = torch.randn(3, 4, 30, 32, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(3, 2, 45, 32, device=DEVICE, requires_grad=True) for _ in range(2))
    inv_freq = rope_frequencies(24, 500000.0, device=DEVICE)[0]
    pos, q_pos = (torch.randint(0, 1000, (n,), device=DEVICE) for n in (45, 30))
    common = dict(rope_dim=24, layout="interleaved", causal=False, impl=impl)
    do = torch.randn_like(q)
    for rows in ("positions", "angles"):
        results = []
        for batch_one in (False, True):
            shape = (lambda x: x[None]) if batch_one else (lambda x: x)
            if rows == "positions":
                given = ()
                kw = dict(positions=shape(pos), q_positions=shape(q_pos), inv_freq=inv_freq)
            else:
                given = tuple(
                    shape(rope_angles(p, inv_freq)).requires_grad_() for p in (pos, q_pos)
                )
                kw = dict(angles=given[0], q_angles=given[1])
            o = rope_attention(q, k, v, **kw, **common)
            grads = torch.autograd.grad((o * do).sum(), (q, k, v, *given))
            results.append((o, *grads[:3], *(g.squeeze(0) for g in grads[3:])))
        names = ("o", "dq", "dk", "dv", "dangles", "dq_angles")
        for name, x, y in zip(names, *results, strict=False):
            assert torch.equal(x, y), (rows, name)


def test_inv_freq_overrides_theta():
    q, k, v = (torch.randn(1, 2, 20, 32, device=DEVICE) for _ in range(3))
    inv_freq = rope_frequencies(32, 10.0)[0].to(DEVICE)
    for impl in ("fused", "separate"):
        a = rope_attention(q, k, v, inv_freq=inv_freq, theta=1e6, impl=impl)
        b = rope_attention(q, k, v, theta=10.0, impl=impl)
        assert torch.equal(a, b), impl
        assert not torch.allclose(a, rope_attention(q, k, v, theta=1e6, impl=impl)), impl


def test_default_positions_match_explicit():
    """Default positions share one cos/sin table between queries and keys (row offsets);
    explicit ones get a table each."""
    q = torch.randn(2, 4, 40, 64, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(2, 2, 70, 64, device=DEVICE, requires_grad=True) for _ in range(2))
    do = torch.randn(2, 4, 40, 64, device=DEVICE)
    o1 = rope_attention(q, k, v, layout="interleaved", impl="fused")
    o2 = rope_attention(
        q,
        k,
        v,
        layout="interleaved",
        positions=torch.arange(70, device=DEVICE),
        q_positions=torch.arange(30, 70, device=DEVICE),
        impl="fused",
    )
    g1 = torch.autograd.grad((o1 * do).sum(), (q, k, v))
    g2 = torch.autograd.grad((o2 * do).sum(), (q, k, v))
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o1, *g1), (o2, *g2), strict=True):
        assert_close(name, a, b, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "NQ, NK, positions", [(30, 70, None), (70, 30, None), (30, 70, "batch")], ids=str
)
def test_rope_tables_hold_the_angles_of_every_row(NQ, NK, positions, dtype):
    """The fused kernels' cos/sin tables (``_rope_tables``): query ``i`` and key ``j`` find
    ``cos/sin(position * inv_freq)`` at their rows (queries at ``NK-NQ+i`` by default, negative
    for ``NQ > NK``), padding columns hold angle 0, and the table's dtype rounds them once."""
    from fused_rope._attention_common import _rope_tables, _table_dtype

    inv_freq = rope_frequencies(40, device=DEVICE)[0].float()  # R/2 = 20, padded to 32
    if positions is None:
        q_pos = torch.arange(NK - NQ, NK, device=DEVICE)[None].float()
        k_pos = torch.arange(NK, device=DEVICE)[None].float()
        args = (None, None)
    else:
        k_pos = torch.randint(0, 10**6, (3, NK), device=DEVICE).float()
        q_pos = torch.randint(0, 10**6, (3, NQ), device=DEVICE).float()
        args = (q_pos, k_pos)
    qc, qs, kc, ks, sqb, skb, q_off, k_off = _rope_tables(inv_freq, *args, NQ, NK, 32, dtype)
    want = torch.float32 if dtype == torch.float16 else torch.float16  # _table_dtype says why
    assert qc.dtype == _table_dtype(dtype) == want and qc.shape[-1] == 32
    ulp = 2e-7 if qc.dtype == torch.float32 else 2**-11  # fp32: ~2 ulp near 1; fp16: 1 ulp
    for cos, sin, stride, off, pos in ((qc, qs, sqb, q_off, q_pos), (kc, ks, skb, k_off, k_pos)):
        # what a kernel reads for batch row b, row i: element b * stride + (off + i) * 32 + col
        assert stride == (0 if pos.shape[0] == 1 else cos.stride(0))
        got_cos, got_sin = (t[:, off : off + pos.shape[1]].float() for t in (cos, sin))
        angle = rope_angles(pos, inv_freq)
        # against the exact values rounded once to the table's dtype
        for name, got, want in (("cos", got_cos, angle.cos()), ("sin", got_sin, angle.sin())):
            want = want.to(cos.dtype).float()
            assert_close(name, got[..., :20], want, atol=ulp, rtol=ulp)
        assert got_cos[..., 20:].eq(1).all() and got_sin[..., 20:].eq(0).all()


@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize("rope_dim", [24, 32], ids=["partial", "full"])
def test_rotation_pass_with_heads_a_program_matches_the_reference(heads, rope_dim, monkeypatch):
    """The pass that rotates q or k once a call (``_rotated_segments``), a program rotating
    ``heads`` heads of one batch with one load of the tables: every head of every batch (H = 5,
    not a multiple of 2 or 8; per-batch positions, so each batch reads its own table rows)
    equals the reference rotation rounded once to the dtype, the pass-through channels after it."""
    from fused_rope import _attention_common as common
    from fused_rope.naive import apply_rope_ref

    monkeypatch.setattr(common, "ROTATE_HEADS", heads)
    B, H, N, D = 2, 5, 37, 32
    gen = torch.Generator(device=DEVICE).manual_seed(heads)
    x = torch.randn(B, H, N, D, device=DEVICE, generator=gen, dtype=torch.float16)
    inv_freq = rope_frequencies(rope_dim, device=DEVICE)[0].float()
    pos = torch.randint(0, 5000, (B, N), device=DEVICE, generator=gen).float()
    meta = common._meta(D, rope_dim, False, True, x.dtype, 1.0, 0)
    _, _, cos, sin, _, stride_tb, _, row_off = common._rope_tables(
        inv_freq, pos, pos, N, N, meta["HALF"], x.dtype
    )
    got = common._rotated_segments(x, cos, sin, stride_tb, row_off, 0.5, meta)
    angles = rope_angles(pos, inv_freq).double()
    want = apply_rope_ref(x.double(), angles, rope_dim=rope_dim, output_scale=0.5)
    half = rope_dim // 2
    segments = (got[..., :half], got[..., meta["HALF"] : meta["HALF"] + half])
    if rope_dim < D:
        segments += (got[..., 2 * meta["HALF"] : 2 * meta["HALF"] + D - rope_dim],)
    assert_close("rotated", torch.cat(segments, -1).double(), want, atol=2e-3, rtol=2e-3)


@triton.jit
def _sectioned_program_kernel(BLOCKS, HEADS, n_blocks, SECTION, DESCENDING: tl.constexpr):
    block, bh = _sectioned_program(n_blocks, SECTION, DESCENDING)
    tl.store(BLOCKS + tl.program_id(0), block)
    tl.store(HEADS + tl.program_id(0), bh)


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize(
    "heads, n_blocks, section", [(1, 1, 1), (4, 7, 1), (3, 5, 2), (6, 4, 4), (5, 3, 8), (9, 2, 4)]
)
def test_sectioned_program_launches_each_tile_once_section_by_section(
    heads, n_blocks, section, descending
):
    """``_sectioned_program``'s order of the grid: every (tile, head) exactly once; heads in
    sections of ``section`` (the last one shorter where they do not divide); in a section the
    heads fastest and the tiles in order (descending: the longest causal sweeps first)."""
    total = heads * n_blocks
    blocks, bhs = (torch.full((total,), -1, dtype=torch.int32, device=DEVICE) for _ in range(2))
    _sectioned_program_kernel[(total,)](blocks, bhs, n_blocks, section, descending)
    want = []
    for first in range(0, heads, section):
        tiles = range(n_blocks - 1, -1, -1) if descending else range(n_blocks)
        want += [(t, h) for t in tiles for h in range(first, min(first + section, heads))]
    assert list(zip(blocks.tolist(), bhs.tolist(), strict=True)) == want


@pytest.mark.parametrize("major", ["query", "key"])
@pytest.mark.parametrize("divisor, heads", [(1 / 4, 1), (1, 1), (3, 2), (32, 32), (2**20, 2**20)])
def test_heads_per_section_fill_the_budget_in_a_power_of_two(divisor, heads, major):
    """Heads of ``1 / divisor`` of the axis' L2 budget each: the most that fit, a power of
    two, at least one; heads of no bytes count as one byte each."""
    from fused_rope._attention_common import L2_SECTION_BYTES, heads_per_section

    budget = L2_SECTION_BYTES[major]
    assert heads_per_section(int(budget / divisor), major) == heads
    assert heads_per_section(0, major) == 1 << (budget.bit_length() - 1)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_kernels_in_sections_of_heads_match_the_reference(causal, monkeypatch):
    """With sections of 2 heads (an L2 budget of two heads' streamed operands: every kernel
    streams 60 keys or queries of 64 fp32 values a head here, D = 32), 3 heads of 2 batches
    and 60 queries (several tiles), so the last section of each grid is shorter: forward,
    lse and gradients as the reference."""
    from fused_rope import _attention_common as common

    per_head = 60 * 64 * 4
    monkeypatch.setattr(common, "L2_SECTION_BYTES", {"query": 2 * per_head, "key": 2 * per_head})
    assert common.heads_per_section(per_head, "query") == 2
    _check_case(2, 3, 3, 60, 60, 32, dtype=torch.float32, causal=causal)


def test_rope_tables_refuse_positions_the_kernels_cannot_index():
    from fused_rope._attention_common import _rope_tables

    inv_freq = rope_frequencies(32, device=DEVICE)[0].float()
    pos = torch.arange(8, device=DEVICE, dtype=torch.float32)[None]
    with pytest.raises(ValueError, match="both be tensors"):
        _rope_tables(inv_freq, None, pos, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="k_pos must be contiguous fp32"):
        _rope_tables(inv_freq, pos, pos.expand(2, 8).t().contiguous().t(), 8, 8, 16, torch.float32)


SEPARATE_CASES = [  # (NQ, NK, options): square, prefill (bottom-right mask), query positions
    pytest.param(50, 50, {"layout": "half", "positions": "batch"}, id="square-batch-positions"),
    pytest.param(50, 50, {"layout": "interleaved", "rope_dim": 16}, id="square-interleaved"),
    pytest.param(20, 50, {}, id="prefill"),
    pytest.param(20, 50, {"layout": "interleaved", "positions": "shared"}, id="prefill-positions"),
    pytest.param(50, 50, {"q_positions": True}, id="q-positions"),
    pytest.param(50, 20, {"causal": False, "rope_dim": 16}, id="nomask-nq-gt-nk"),
    pytest.param(20, 50, {"positions": "mrope"}, id="prefill-mrope"),
    pytest.param(
        50,
        20,
        {"causal": False, "positions": "mrope", "q_positions": True},
        id="nomask-nq-gt-nk-mrope-q-angles",
    ),
]


@pytest.mark.parametrize("hkv", [4, 1])
@pytest.mark.parametrize("NQ, NK, opts", SEPARATE_CASES)
def test_separate_path(NQ, NK, opts, hkv):
    """impl='separate' (Triton RoPE + SDPA) by the 2x rule, output and gradients, fp32: the same
    positions, query positions and bottom-right causal mask as the fused kernel."""
    pytest.importorskip("fused_rope.rope")
    _check_case(2, 4, hkv, NQ, NK, 32, dtype=torch.float32, impl="separate", **opts)


AUTO_CASES = [  # (HQ, HKV, NQ, NK, options): which path "auto" takes is in the name
    pytest.param(4, 2, 37, 37, {}, "separate", id="square-separate"),
    pytest.param(
        4,
        1,
        37,
        37,
        {"causal": False, "layout": "interleaved", "rope_dim": 16},
        "separate",
        id="nomask-interleaved-partial-separate",
    ),  # fmt: skip
    pytest.param(
        2,
        2,
        37,
        37,
        {"positions": "batch", "softmax_scale": 0.3},
        "separate",
        id="positions-scale-separate",
    ),  # fmt: skip
    pytest.param(4, 2, 20, 37, {}, "prefill", id="prefill"),
    pytest.param(4, 2, 37, 20, {}, "fused", id="causal-nq-gt-nk-fused"),
    pytest.param(4, 2, 37, 20, {"causal": False}, "separate", id="nomask-nq-gt-nk-separate"),
    pytest.param(2, 1, 37, 37, {"q_positions": True}, "separate", id="q-positions-separate"),
    pytest.param(2, 1, 37, 37, {"return_lse": True}, "fused", id="lse-fused"),
    pytest.param(4, 2, 37, 37, {"window": 9}, "fused", id="window-fused"),
    pytest.param(4, 2, 20, 37, {"window": 9}, "fused", id="prefill-window-fused"),
    # a window that holds every key a query sees causally is no window
    pytest.param(4, 2, 37, 37, {"window": 37}, "separate", id="window-NK-separate"),
]


@pytest.mark.parametrize("HQ, HKV, NQ, NK, opts, path", AUTO_CASES)
def test_auto_takes_the_expected_path_and_agrees_with_fused(HQ, HKV, NQ, NK, opts, path):
    """impl="auto" gives exactly the output and gradients of the path it should take, and the
    fused kernel's numbers: one function, whatever the dispatch. "prefill": the fused kernel
    where it fills the GPU or SDPA has no kernel for the bottom-right mask (the interpreter,
    whose SDPA would materialize the mask), else the separate path."""
    q = torch.randn(2, HQ, NQ, 32, device=DEVICE)
    k, v = (torch.randn(2, HKV, NK, 32, device=DEVICE) for _ in range(2))
    if path == "prefill":
        fused = attention_module._fused_prefill_fills_the_gpu(q, k, 32, "half", None)
        fused = fused or not attention_module._sdpa_has_lower_right_kernel(q, k, v)
        path = "fused" if fused else "separate"
    do = torch.randn_like(q)
    kw = dict(opts)
    if kw.pop("positions", None) == "batch":
        kw["positions"] = torch.randint(0, 300, (2, NK), device=DEVICE).float() / 3
    if kw.pop("q_positions", False):
        kw["q_positions"] = torch.randint(0, 300, (2, NQ), device=DEVICE)

    def run(impl):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = rope_attention(*inputs, impl=impl, **kw)
        o = out[0] if isinstance(out, tuple) else out
        return (o, *torch.autograd.grad((o * do).sum(), inputs))

    auto, expected = run("auto"), run(path)
    fused = expected if path == "fused" else run("fused")
    for name, a, b, c in zip(("o", "dq", "dk", "dv"), auto, expected, fused, strict=True):
        assert torch.equal(a, b), f"{name}: auto did not take the {path} path"
        assert_close(name, a, c, atol=2e-5, rtol=1e-5)


def test_separate_path_strided_inputs_and_learned_frequencies():
    """The separate path takes what the fused kernel takes: a strided last dimension, and
    frequencies and positions that require grad, whose gradients both paths get as the
    float64 reference does (through its fp32 angles); fractional positions (interpolated), so
    that a path rounding them shows."""
    q = torch.randn(1, 2, 30, 64, device=DEVICE, requires_grad=True)[..., ::2]  # stride 2
    k, v = (torch.randn(1, 1, 30, 32, device=DEVICE) for _ in range(2))
    inv_freq = rope_frequencies(32, device=DEVICE)[0].requires_grad_()
    positions = (torch.arange(30.0, device=DEVICE) * 0.75 + 0.5).requires_grad_()
    do = torch.randn(1, 2, 30, 32, device=DEVICE)
    leaves = (q, inv_freq, positions)
    ref = rope_attention_ref(q.double(), k.double(), v.double(), inv_freq=inv_freq,
                             positions=positions)[0]  # fmt: skip
    expected = (ref, *torch.autograd.grad((ref * do.double()).sum(), leaves))
    for impl in ("separate", "fused"):
        o = rope_attention(q, k, v, impl=impl, inv_freq=inv_freq, positions=positions)
        got = (o, *torch.autograd.grad((o * do).sum(), leaves))
        for name, a, b in zip(("o", "dq", "dinv_freq", "dpositions"), got, expected, strict=True):
            # sums over every position: relative to their size
            atol = 1e-5 * max(1.0, b.abs().max().item())
            assert_close(f"{impl} {name}", a, b, atol=atol, rtol=1e-5)


def test_size_limits_bind_only_the_fused_kernel():
    q, k, v = _qkv(d=264, hq=1, hkv=1, nq=2, nk=2)
    assert rope_attention(q, k, v).shape == q.shape  # "auto" takes the separate path


@pytest.mark.parametrize("scale, magnitude", [(1.0, 5e4), (8.0, 6e3)])
def test_fp16_scale_above_the_fold_limit_keeps_the_query_finite(scale, magnitude):
    """fp16 with softmax_scale * log2(e) > 1: Q rounded to fp16 after the whole fold would
    overflow at |q| = magnitude (scale * log2(e) * magnitude > 65504), where fp16 PyTorch's
    ``q * scale`` does not; the fused kernel's Q carries at most 1 of the fold and the scores
    the rest (``query_fold``). o, lse and the gradients by the rule."""
    torch.manual_seed(0)
    B, H, N, D, R = 1, 2, 40, 32, 16
    q = torch.randn(B, H, N, D, device=DEVICE)
    q[:, :, ::3, -1] = magnitude  # a pass-through channel: the rotation cannot overflow
    k, v = torch.randn(B, H, N, D, device=DEVICE), torch.randn(B, H, N, D, device=DEVICE)
    k[..., -1] *= 1e-3  # moderate scores
    inputs = [x.half().requires_grad_() for x in (q, k, v)]
    o, lse = rope_attention(*inputs, softmax_scale=scale, rope_dim=R, impl="fused",
                            return_lse=True)  # fmt: skip
    # Small cotangents: dk of the large channel is ~ scale * magnitude * |do|, and at unit
    # cotangents it exceeds fp16's range in the baseline (the comparison would be meaningless).
    do, dlse = 0.1 * torch.randn_like(o), 0.1 * torch.randn_like(lse)
    grads = torch.autograd.grad(_loss(o, lse, do, dlse), inputs)
    inputs64 = [x.detach().double().requires_grad_() for x in inputs]
    o64, lse64 = rope_attention_ref(*inputs64, softmax_scale=scale, rope_dim=R)
    grads64 = torch.autograd.grad(_loss(o64, lse64, do.double(), dlse.double()), inputs64)
    inputs_b = [x.detach().clone().requires_grad_() for x in inputs]
    angles = rope_angles(torch.arange(N, device=DEVICE), rope_frequencies(R, device=DEVICE)[0])
    o_b, lse_b, lse32_b = rope_attention_in_dtype(
        *inputs_b, q_angles=angles, k_angles=angles, causal=True, scale=scale, layout="half",
        rope_dim=R,
    )  # fmt: skip
    grads_b = torch.autograd.grad(_loss(o_b, lse_b, do, dlse), inputs_b)
    assert all(torch.isfinite(x).all() for x in (o_b, lse_b, *grads_b))  # the baseline holds
    for name, out, ref, base in zip(
        ("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), (o64, lse64, *grads64),
        (o_b, lse32_b, *grads_b), strict=True,
    ):  # fmt: skip
        assert_close_to_baseline(name, out, ref, base)


@pytest.mark.parametrize("impl", ["fused", "separate", "auto"])
def test_forward_mode_ad_is_refused(impl):
    """The custom ops have no forward-mode derivative and PyTorch would drop the tangent (a
    silent zero): a tangent on k is refused on every path, naming the reference."""
    q, k, v = (torch.randn(1, 2, 8, 32, device=DEVICE) for _ in range(3))
    with pytest.raises(NotImplementedError, match="forward-mode.*rope_attention_ref"):
        torch.func.jvp(lambda x: rope_attention(q, x, v, impl=impl), (k,), (torch.ones_like(k),))
    # the constant inputs too: the reference differentiates them, the kernels would drop them
    inv_freq, positions = rope_frequencies(32)[0].to(DEVICE), torch.arange(8.0, device=DEVICE)
    with torch.autograd.forward_ad.dual_level():
        for name in ("inv_freq", "positions", "q_positions"):
            given = {"inv_freq": inv_freq, "positions": positions, "q_positions": positions}
            given[name] = torch.autograd.forward_ad.make_dual(
                given[name], torch.ones_like(given[name])
            )
            with pytest.raises(NotImplementedError, match=f"{name} carries a forward-mode"):
                rope_attention(q, k, v, impl=impl, **given)
        angles = rope_angles(positions, inv_freq)
        for name in ("angles", "q_angles"):
            given = {"angles": angles, "q_angles": angles}
            given[name] = torch.autograd.forward_ad.make_dual(angles, torch.ones_like(angles))
            with pytest.raises(NotImplementedError, match=f"{name} carries a forward-mode"):
                rope_attention(q, k, v, impl=impl, **given)


def test_torch_func_grad():
    """The fused kernel's custom op cannot run under torch.func (PyTorch refuses its autograd
    there): refused with the ways that work; the separate path (the RoPE Function, then SDPA)
    runs and gives torch.autograd's gradient."""
    q, k, v = (torch.randn(1, 2, 8, 32, device=DEVICE) for _ in range(3))
    loss = lambda impl: lambda x: rope_attention(x, k, v, impl=impl).square().sum()
    with pytest.raises(NotImplementedError, match="torch.func.*impl='separate'"):
        torch.func.grad(loss("fused"))(q)
    got = torch.func.grad(loss("separate"))(q)
    x = q.clone().requires_grad_()
    loss("separate")(x).backward()
    torch.testing.assert_close(got, x.grad)


def test_a_gradient_of_the_fused_kernels_gradients_is_refused_naming_the_reference():
    """create_graph=True gives first-order gradients; a backward through them is refused with
    the reference named, which differentiates twice (PyTorch's message named only an op
    without an autograd formula; a review's find)."""
    q, k, v = (torch.randn(1, 2, 8, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    for fused in (True, False):
        o = rope_attention(q, k, v, impl="fused") if fused else rope_attention_ref(q, k, v)[0]
        (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
        if fused:
            with pytest.raises(
                NotImplementedError, match="use fused_rope.naive.rope_attention_ref"
            ):
                dq.sum().backward()
        else:
            dq.sum().backward()
            assert k.grad is not None and k.grad.abs().sum() > 0


def test_eager_calls_launch_the_kernels_without_the_custom_ops(monkeypatch):
    """Eager calls run the fused kernels through ``_RopeAttentionFunction``: the custom ops'
    dispatch cost 118-224 us of a 1.0-1.1 ms forward+backward at Small-1K (H200 host, session
    50: experiments/results/host_cost_gpu_h200.md). Its o, lse and gradients are
    the ops' bitwise, for cotangents on o and lse, on lse alone (o's then None) and on o alone,
    with learned frequencies and positions; a recorded backward (create_graph=True) takes the
    backward op, whose autograd refuses a second derivative (the test above)."""
    q, k, v = (torch.randn(2, 4, 37, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    freqs = rope_frequencies(32, device=DEVICE)[0].requires_grad_()
    pos = (torch.arange(37, device=DEVICE) * 1.5).requires_grad_()
    leaves = (q, k, v, freqs, pos)
    weights = {"o and lse": (1.0, 1.0), "lse": (0.0, 1.0), "o": (1.0, 0.0)}

    def run(w_o, w_lse):
        o, lse = rope_attention(
            q, k[:, :2], v[:, :2], inv_freq=freqs, positions=pos, impl="fused", return_lse=True
        )
        loss = (lse.sum() if w_lse else 0) + ((o.float() ** 2).sum() if w_o else 0)
        return (o, lse, *torch.autograd.grad(loss, leaves, allow_unused=True))

    eager = {name: run(*w) for name, w in weights.items()}
    assert type(eager["o"][0].grad_fn).__name__ == "RopeAttentionFunctionBackward"
    monkeypatch.setattr(attention_module, "runs_eagerly", lambda *t: False)  # as under a tracer
    through_ops = {name: run(*w) for name, w in weights.items()}
    names = ("o", "lse", "dq", "dk", "dv", "dinv_freq", "dpositions")
    for case in weights:
        for name, a, b in zip(names, eager[case], through_ops[case], strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (case, name)
    monkeypatch.undo()
    refuse = lambda *a: pytest.fail("an eager call went through a custom op")
    monkeypatch.setattr(attention_module, "_fwd_op", refuse)
    monkeypatch.setattr(attention_module, "_bwd_op", refuse)
    run(1.0, 1.0)


def test_a_backward_reading_a_tensor_subclass_takes_the_op():
    """A tensor subclass among the inputs (here k; q plain) sends the forward through the custom
    op (``runs_eagerly``), and its backward too: the backward decides from every tensor it
    reads, not from q alone, which launched Triton on the subclass (a review's find). The
    result is the plain inputs' (TwoTensor runs the op on each of its two tensors)."""
    from torch.testing._internal.two_tensor import TwoTensor

    q, k, v = (torch.randn(1, 2, 12, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    plain = torch.autograd.grad(rope_attention(q, k, v, impl="fused").sum(), (q, k, v))
    two_k = TwoTensor(k.detach(), k.detach()).requires_grad_()
    o = rope_attention(q, two_k, v, impl="fused")
    dq, dk, dv = torch.autograd.grad(o.sum(), (q, two_k, v))
    for name, got, want in (("dq", dq, plain[0]), ("dk", dk, plain[1]), ("dv", dv, plain[2])):
        for part in (got.a, got.b) if isinstance(got, TwoTensor) else (got,):
            torch.testing.assert_close(part, want, msg=name)


def test_a_forward_mode_tangent_on_a_cotangent_is_refused():
    """Forward-over-reverse (a dual cotangent in a plain backward): the kernels would drop the
    tangent, a silent zero (a review's find): refused, naming the reference."""
    q, k, v = (torch.randn(1, 2, 8, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    outs = rope_attention(q, k, v, impl="fused", return_lse=True)
    for name, out in zip(("o", "lse"), outs, strict=True):
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(torch.ones_like(out), torch.ones_like(out))
            with pytest.raises(NotImplementedError, match=f"{name}'s cotangent.*attention_ref"):
                torch.autograd.grad(out, q, dual, retain_graph=True)


@pytest.mark.parametrize("leaf", ["tensor", "parameter"])  # a Parameter takes the custom op
@pytest.mark.parametrize("impl", ["fused", "separate"])
def test_backward_under_non_reentrant_checkpointing(impl, leaf):
    """torch.utils.checkpoint(use_reentrant=False) lets each saved tensor be unpacked once:
    the fused backward unpacked them twice and failed (a review's find, in Co-RoPE's). The
    checkpointed gradients, learned positions' included, are the plain ones up to rounding."""
    wrap = torch.nn.Parameter if leaf == "parameter" else lambda x: x.requires_grad_()
    leaves = [wrap(x) for x in (*_qkv(nq=6), torch.arange(8.0, device=DEVICE))]
    f = lambda q, k, v, pos: rope_attention(
        q, k, v, positions=pos, impl=impl, return_lse=impl == "fused"
    )
    out = lambda o: o if isinstance(o, torch.Tensor) else o[0] + o[1][..., None]
    with deterministic_algorithms():  # SDPA's backward on a GPU adds with atomics otherwise
        plain = torch.autograd.grad(out(f(*leaves)).sum(), leaves)
        ckpt = torch.autograd.grad(out(checkpoint(f, *leaves, use_reentrant=False)).sum(), leaves)
    # up to the order of a sum: the positions' two contributions (queries', keys') added in
    # another order put the custom op's positions gradient 1 ulp off on an H200
    for a, b in zip(ckpt, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-22, atol=1e-6)


def test_backward_is_deterministic():
    q, k, v = (torch.randn(1, 4, 50, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    k2, v2 = k[:, :1].detach().requires_grad_(), v[:, :1].detach().requires_grad_()
    do = torch.randn(1, 4, 50, 32, device=DEVICE)
    f = lambda: (rope_attention(q, k2, v2, impl="fused") * do).sum()  # no atomics anywhere
    g1 = torch.autograd.grad(f(), (q, k2, v2))
    g2 = torch.autograd.grad(f(), (q, k2, v2))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


# ------------------------------------------------------------- validation


def _qkv(dtype=torch.float32, hq=4, hkv=2, nq=8, nk=8, d=32, device=DEVICE):
    return (
        torch.randn(1, hq, nq, d, device=device, dtype=dtype),
        torch.randn(1, hkv, nk, d, device=device, dtype=dtype),
        torch.randn(1, hkv, nk, d, device=device, dtype=dtype),
    )


def _angles(n=8, batch=None, half=16):
    """Angles ``[n, half]`` (``[batch, n, half]``) for ``_qkv``'s inputs (``rope_dim`` 32)."""
    pos = torch.arange(n, device=DEVICE)
    inv_freq = rope_frequencies(32, device=DEVICE)[0]
    angles = rope_angles(pos if batch is None else pos.expand(batch, n), inv_freq)
    return angles[..., :half]


BAD_INPUTS = [
    (
        "angles with positions",
        lambda q, k, v: (
            q,
            k,
            v,
            {"angles": _angles(), "positions": torch.arange(8, device=DEVICE)},
        ),
        ValueError,
        r"angles replace positions \* inv_freq: pass angles or positions, not both",
    ),
    (
        "angles with inv_freq",
        lambda q, k, v: (q, k, v, {"angles": _angles(), "inv_freq": _angles()[0] + 1.0}),
        ValueError,
        "pass angles or inv_freq, not both",
    ),
    (
        "q_angles alone",
        lambda q, k, v: (q, k, v, {"q_angles": _angles()}),
        ValueError,
        "q_angles needs angles",
    ),
    (
        "angles width",
        lambda q, k, v: (q, k, v, {"angles": _angles(half=8)}),
        ValueError,
        "angles has last dimension 8, expected rope_dim // 2 = 16",
    ),
    (
        "angles length",
        lambda q, k, v: (q, k, v, {"angles": _angles(n=5)}),
        ValueError,
        "angles has 5 positions but the input has N=8",
    ),
    (
        "angles batch",
        lambda q, k, v: (q, k, v, {"angles": _angles(batch=2)}),
        ValueError,
        "angles has batch 2 but the input has B=1",
    ),
    (
        "q_angles length",
        lambda q, k, v: (q, k, v, {"angles": _angles(), "q_angles": _angles(n=7)}),
        ValueError,
        "q_angles has 7 positions but the input has N=8",
    ),
    (
        "angles NQ > NK",
        lambda q, k, v: (q, k[:, :, :4], v[:, :, :4], {"angles": _angles(n=4)}),
        ValueError,
        "NQ=8 > NK=4: queries cannot take the last NQ rows of angles; pass q_angles",
    ),
    (
        "bf16 angles",
        lambda q, k, v: (q, k, v, {"angles": _angles().bfloat16()}),
        TypeError,
        r"angles must have dtype in \['torch.float32', 'torch.float64'\], got torch.bfloat16",
    ),
    (
        "integer angles",
        lambda q, k, v: (q, k, v, {"angles": _angles().long()}),
        TypeError,
        "angles must be a floating-point tensor",
    ),
    ("q as list", lambda q, k, v: ([1.0], k, v, {}), TypeError, "q must be a torch.Tensor"),
    ("int k", lambda q, k, v: (q, k.long(), v, {}), TypeError, "k must be a floating-point"),
    (
        "fp64",
        lambda q, k, v: (q.double(), k.double(), v.double(), {}),
        TypeError,
        "q must have dtype",
    ),
    ("mixed dtype", lambda q, k, v: (q, k.half(), v, {}), TypeError, "share a dtype"),
    ("mixed v dtype", lambda q, k, v: (q, k, v.half(), {}), TypeError, "share a dtype"),
    (
        "empty keys",
        lambda q, k, v: (q, k[:, :, :0], v[:, :, :0], {}),
        ValueError,
        "at least one position, got NQ=8, NK=0",
    ),  # fmt: skip
    ("3-d q", lambda q, k, v: (q[0], k, v, {}), ValueError, "q must have 4 dimensions"),
    ("k/v mismatch", lambda q, k, v: (q, k, v[:, :, :4], {}), ValueError, "k and v must be"),
    (
        "head dim mismatch",
        lambda q, k, v: (q, k[..., :16], v[..., :16], {}),
        ValueError,
        "k and v must be",
    ),
    ("heads", lambda q, k, v: (q[:, :3], k, v, {}), ValueError, "multiple of k's 2 heads"),
    ("layout", lambda q, k, v: (q, k, v, {"layout": "neox"}), ValueError, "layout must be one of"),
    (
        "odd rope_dim",
        lambda q, k, v: (q, k, v, {"rope_dim": 7}),
        ValueError,
        "rope_dim must be even",
    ),
    (
        "big rope_dim",
        lambda q, k, v: (q, k, v, {"rope_dim": 64}),
        ValueError,
        "rope_dim must be even",
    ),
    ("theta", lambda q, k, v: (q, k, v, {"theta": -1.0}), ValueError, "theta must be > 1"),
    ("theta 1", lambda q, k, v: (q, k, v, {"theta": 1.0}), ValueError, "theta must be > 1"),
    (
        "scale",
        lambda q, k, v: (q, k, v, {"softmax_scale": 0.0}),
        ValueError,
        "softmax_scale must be",
    ),
    ("causal", lambda q, k, v: (q, k, v, {"causal": 1}), TypeError, "causal must be a bool"),
    (
        "return_lse str",
        lambda q, k, v: (q, k, v, {"return_lse": "no"}),
        TypeError,
        "return_lse must be a bool",
    ),
    (
        "theta bool",
        lambda q, k, v: (q, k, v, {"theta": True}),
        TypeError,
        "theta must be a real number, got True",
    ),
    ("scale bool", lambda q, k, v: (q, k, v, {"softmax_scale": True}), TypeError, "must be a num"),
    (
        "scale past fp32",
        lambda q, k, v: (q, k, v, {"softmax_scale": 1e39}),
        ValueError,
        "softmax_scale must be positive and below 1.25183e\\+38",
    ),
    (
        "attention_factor inf",
        lambda q, k, v: (q, k, v, {"attention_factor": float("inf")}),
        ValueError,
        "attention_factor must be finite",
    ),
    (
        "attention_factor past fp16",
        lambda q, k, v: (q, k, v, {"attention_factor": 70000.0}),
        ValueError,
        "attention_factor must be finite, of magnitude below 65504",
    ),
    (
        "attention_factor negative",  # cancels in q.k: accepted, it hid a sign mistake
        lambda q, k, v: (q, k, v, {"attention_factor": -1.0}),
        ValueError,
        "attention_factor must be positive, got -1.0",
    ),
    (
        "attention_factor str",
        lambda q, k, v: (q, k, v, {"attention_factor": "1.2"}),
        TypeError,
        "attention_factor must be a float, got str",
    ),
    (
        "inv_freq fp16",
        lambda q, k, v: (q, k, v, {"inv_freq": torch.ones(16, device=q.device).half()}),
        TypeError,
        "inv_freq must have dtype",
    ),
    (
        "inv_freq len",
        lambda q, k, v: (q, k, v, {"inv_freq": torch.ones(3, device=q.device)}),
        ValueError,
        "inv_freq must have rope_dim // 2 = 16",
    ),
    (
        "positions shape",
        lambda q, k, v: (q, k, v, {"positions": torch.arange(7, device=q.device)}),
        ValueError,
        r"positions must have shape \[8\] or \[1, 8\]",
    ),
    (
        "positions bool",
        lambda q, k, v: (q, k, v, {"positions": torch.ones(8, dtype=torch.bool)}),
        TypeError,
        "positions must be an integer, fp32 or fp64 tensor",
    ),
    (
        # fp16 holds integers exactly only up to 2048: refused on every path (the fused one
        # took them before, the separate one did not)
        "positions fp16",
        lambda q, k, v: (q, k, v, {"positions": torch.arange(8, device=q.device).half()}),
        TypeError,
        "positions must be an integer, fp32 or fp64 tensor",
    ),
    (
        "q_positions bf16",
        lambda q, k, v: (q, k, v, {"q_positions": torch.arange(8, device=q.device).bfloat16()}),
        TypeError,
        "q_positions must be an integer, fp32 or fp64 tensor",
    ),
    (
        "q_positions batch",
        lambda q, k, v: (q, k, v, {"q_positions": torch.zeros(2, 8, device=q.device)}),
        ValueError,
        r"q_positions must have shape",
    ),
    (
        "NQ > NK with positions",
        lambda q, k, v: (
            torch.cat([q, q], 2),
            k,
            v,
            {"positions": torch.arange(8, device=q.device)},
        ),
        ValueError,
        "pass q_positions",
    ),
    ("impl", lambda q, k, v: (q, k, v, {"impl": "cudnn"}), ValueError, "impl must be"),
    (
        "separate causal NQ > NK",
        lambda q, k, v: (q, k[:, :, :4], v[:, :, :4], {"impl": "separate"}),
        ValueError,
        "no kernel for queries that see no key",
    ),
    (
        "separate lse",
        lambda q, k, v: (q, k, v, {"impl": "separate", "return_lse": True}),
        ValueError,
        "returns no lse",
    ),
    ("sparse k", lambda q, k, v: (q, k.to_sparse(), v, {}), TypeError, "k must be a dense"),
    ("window 0", lambda q, k, v: (q, k, v, {"window": 0}), ValueError, "window must be at least 1"),
    (
        "window float",
        lambda q, k, v: (q, k, v, {"window": 4.0}),
        TypeError,
        "window must be an int",
    ),
    (
        "window bool",
        lambda q, k, v: (q, k, v, {"window": True}),
        TypeError,
        "window must be an int",
    ),
    (
        "window non-causal",
        lambda q, k, v: (q, k, v, {"window": 4, "causal": False}),
        ValueError,
        "window=4 needs causal=True",
    ),
]


@pytest.mark.parametrize("make, exc, match", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_validation(make, exc, match):
    q, k, v, kw = make(*_qkv())
    with pytest.raises(exc, match=match):
        rope_attention(q, k, v, **kw)


@pytest.mark.parametrize("impl", ["auto", "fused", "separate"])
def test_non_finite_angles_are_refused_on_the_cpu(impl):
    """As positions and inv_freq are (a review's find); on a GPU not read back (the check would
    wait for the device at every call): NaN reaches the outputs, as in the reference."""
    q, k, v = _qkv()
    angles, q_angles = _angles(), _angles()
    angles[3, 2] = float("nan")
    q_angles[0, 0] = -math.inf
    for kw, name, value in ((dict(angles=angles), "angles", "nan"),
                            (dict(angles=_angles(), q_angles=q_angles), "q_angles", "-inf")):  # fmt: skip
        if ON_GPU:
            assert rope_attention(q, k, v, impl=impl, **kw).isnan().any()
        else:
            with pytest.raises(ValueError, match=f"{name} must be finite, got {value}"):
                rope_attention(q, k, v, impl=impl, **kw)


@pytest.mark.parametrize("nq", [8, 5])  # square: auto takes the separate path; prefill: fused
@pytest.mark.parametrize("impl", ["auto", "fused", "separate"])
def test_autocast_casts_the_inputs_as_sdpa_does_on_every_path(impl, nq):
    """Under autocast every impl computes what it computes on inputs in autocast's dtype and
    returns that dtype (a review's find: the fused kernel, which autocast does not reach,
    returned fp32 where the separate path's SDPA returned fp16, so auto's dtype followed the
    shape); the gradients reach the fp32 leaves in their dtype."""
    q, k, v = (x.requires_grad_() for x in _qkv(nq=nq))
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.float16):
        o = rope_attention(q, k, v, impl=impl)
    assert o.dtype == torch.float16
    want = rope_attention(q.half(), k.half(), v.half(), impl=impl)
    assert torch.equal(o, want)
    o.float().sum().backward()
    assert all(x.grad.dtype == torch.float32 and x.grad.isfinite().all() for x in (q, k, v))


@pytest.mark.parametrize("impl", ["auto", "fused", "separate"])
def test_theta_is_unused_with_angles(impl):
    """Given angles, theta plays no part and is not checked, as in the reference (a review's
    find: the kernels' path checked it)"""
    q, k, v = _qkv()
    want = rope_attention(q, k, v, angles=_angles(), impl=impl)
    torch.testing.assert_close(
        rope_attention(q, k, v, angles=_angles(), theta=-5.0, impl=impl), want
    )
    torch.testing.assert_close(rope_attention_ref(q, k, v, angles=_angles(), theta=-5.0)[0], want)


def test_validation_size_limits():
    q, k, v = _qkv(dtype=torch.float16, d=264, hq=1, hkv=1, nq=2, nk=2)
    with pytest.raises(ValueError, match="at most 256 for torch.float16 .* 264; use impl='sep"):
        rope_attention(q, k, v, impl="fused")
    q, k, v = _qkv(d=136, hq=1, hkv=1, nq=2, nk=2)
    with pytest.raises(ValueError, match="at most 128 for torch.float32 .* or bf16 inputs, or imp"):
        rope_attention(q, k, v, impl="fused")
    q, k, v = _qkv(d=264, hq=1, hkv=1, nq=2, nk=2)  # past every dtype's limit: no cast offered
    with pytest.raises(ValueError, match="at most 128 for torch.float32 .* 264; use impl='sep"):
        rope_attention(q, k, v, impl="fused")
    q, k, v = (x.expand(65536, -1, -1, -1) for x in _qkv(d=16, hq=1, hkv=1, nq=2, nk=2))
    with pytest.raises(ValueError, match="at most 65535, got 65536 x 1: split the batch; use imp"):
        rope_attention(q, k, v, impl="fused")
    with pytest.raises(ValueError, match="split the batch; impl='separate' cannot take return_ls"):
        rope_attention(q, k, v, impl="fused", return_lse=True)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's bf16 products: a CPU question")
def test_bf16_refused_in_the_interpreter_where_the_fused_kernel_would_run_it():
    """The interpreter's bf16 products come out ~1e9 off: refused, not returned. The separate
    path (the RoPE kernel has no products, then PyTorch's SDPA) is right in bf16 and runs."""
    q, k, v = (x.bfloat16() for x in _qkv(device="cpu"))
    with pytest.raises(TypeError, match="q is bfloat16 on the CPU: Triton's interpreter"):
        rope_attention(q, k, v, impl="fused")
    ref = rope_attention(*(x.float() for x in (q, k, v)), impl="separate")
    assert (rope_attention(q, k, v, impl="separate").float() - ref).abs().max() < 0.05


@pytest.mark.skipif(ON_GPU, reason="CPU tensors are refused only when the interpreter is off")
def test_cpu_tensor_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need a CUDA tensor"):
        rope_attention(*_qkv(device="cpu"))


@pytest.mark.parametrize("offset", range(16))
def test_causal_band_at_every_offset_within_a_key_tile(offset):
    """The causal kernels split each tile's keys into ones every query sees and a masked
    band, at ``NK - NQ`` modulo the key tile (16 in the interpreter): one offset per residue,
    so a band that starts or ends a key off shows (a review's mutant, the unmasked part one
    key too long, passed every other case)."""
    _check_case(1, 1, 1, 20, 20 + offset, 16, dtype=torch.float32)


# ------------------------------------------------------------- GPU: full product, bf16, compile

GPU_GROUPS = [(8, 8), (8, 2), (8, 1), (4, 1)]  # GQA ratio 1, 4, 8 (single KV head), MQA of 4
GPU_LENGTHS = [(500, 500), (63, 500), (500, 63), (1024, 1024)]
# Each (dtype, D) pair and each kernel option below is a compilation, so dtype and head dim
# alternate over the grid instead of multiplying it (other head dims: test_gpu_other_head_dims).
GPU_PRECISIONS = [(torch.float16, 128), (torch.bfloat16, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("positions", ["default", "shared", "batch"])
@pytest.mark.parametrize("rope", ["full", "partial"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("NQ, NK", GPU_LENGTHS, ids=[f"NQ{a}-NK{b}" for a, b in GPU_LENGTHS])
@pytest.mark.parametrize("HQ, HKV", GPU_GROUPS, ids=[f"H{a}-KV{b}" for a, b in GPU_GROUPS])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "nomask"])
def test_gpu_product(causal, HQ, HKV, NQ, NK, layout, rope, positions):
    """Every combination of the options; "batch" positions come with explicit q positions,
    "shared" ones with NQ > NK too (the default query positions need NQ <= NK)."""
    index = GPU_GROUPS.index((HQ, HKV)) + GPU_LENGTHS.index((NQ, NK))
    dtype, D = GPU_PRECISIONS[index % 2]
    _check_case(
        2,
        HQ,
        HKV,
        NQ,
        NK,
        D,
        dtype=dtype,
        causal=causal,
        layout=layout,
        rope_dim=D // 2 if rope == "partial" else None,
        positions=positions,
        q_positions=positions == "batch" or (positions == "shared" and NQ > NK),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize(
    "D, rope_dim",
    [(32, None), (64, None), (96, None), (96, 64), (128, None), (256, None), (256, 64)],
)
def test_gpu_other_head_dims(D, rope_dim, dtype):
    """Head dims 32 to 256, partial rotation, in each dtype (fp32: IEEE products, which TF32
    would fail by the fp32 baseline's rule)."""
    # fp32 heads past 128 channels are SDPA's under "auto" (the fused kernel refuses them)
    impl = "auto" if D > max_head_dim(dtype) else "fused"
    _check_case(2, 4, 2, 300, 300, D, dtype=dtype, rope_dim=rope_dim, impl=impl)
    _check_case(
        1, 4, 1, 100, 700, D, dtype=dtype, rope_dim=rope_dim, causal=False,
        layout="interleaved", impl=impl,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fused", "separate"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_attention_factor_of_a_partial_rotation(dtype, impl):
    """Phi-4-mini's shape of LongRoPE: 96 of 128 channels rotate, their scores scaled by the
    square of the attention factor; both paths, real sizes, the flash-attention rule."""
    inv_freq = rope_frequencies(96, 10000.0)[0] / torch.linspace(1.0, 40.0, 48)
    _check_case(
        2, 24, 8, 700, 700, 128, dtype=dtype, rope_dim=96, inv_freq=inv_freq.to(DEVICE),
        attention_factor=1.1902, impl=impl,
    )  # fmt: skip


# ------------------------------------------------------------- the Gluon forward (Hopper)


NEEDS_GLUON = pytest.mark.skipif(
    not (ON_GPU and attention_forward.gluon_forward_available(torch.device(DEVICE))),
    reason="the Gluon forward runs on Hopper with Triton 3.6",
)


def _hopper_calls(monkeypatch) -> list:
    """A list that records each call of the Gluon forward (``attention_forward_hopper``), which
    takes the tests' short sequences too (production: from ``HOPPER_MIN_N`` tokens on)."""
    from fused_rope import attention_forward_hopper

    monkeypatch.setattr(attention_forward, "HOPPER_MIN_N", attention_forward.HOPPER_CTA_ROWS)

    calls, real = [], attention_forward_hopper.rope_attention_fwd_hopper

    def spy(q, *args):
        calls.append(q.shape)
        return real(q, *args)

    monkeypatch.setattr(attention_forward_hopper, "rope_attention_fwd_hopper", spy)
    return calls


def test_gluon_forward_needs_hopper_and_the_tested_triton(monkeypatch):
    """``gluon_forward_available``: sm_90 only, Triton 3.6 only (Gluon's API moves between
    releases), off with ``GLUON_ENABLED = False``, never on the CPU."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention_forward, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(attention_forward.triton, "__version__", "3.6.0")
    monkeypatch.setattr(attention_forward, "GLUON_ENABLED", True)
    assert attention_forward.gluon_forward_available(cuda)
    assert not attention_forward.gluon_forward_available(torch.device("cpu"))
    monkeypatch.setattr(attention_forward, "GLUON_ENABLED", False)
    assert not attention_forward.gluon_forward_available(cuda)
    monkeypatch.setattr(attention_forward, "GLUON_ENABLED", True)
    monkeypatch.setattr(attention_forward.triton, "__version__", "3.7.0")
    assert not attention_forward.gluon_forward_available(cuda)
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm's "cuda" devices: not Hopper
    assert not attention_forward.gluon_forward_available(cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention_forward.triton, "__version__", "3.6.0")
    for capability in [(8, 0), (9, 1), (10, 0)]:
        monkeypatch.setattr(attention_forward, "compute_capability", lambda d, c=capability: c)
        assert not attention_forward.gluon_forward_available(cuda)


def test_hopper_forward_takes_only_what_it_supports(monkeypatch):
    """``hopper_forward_takes`` on a Hopper GPU (assumed): each option the Gluon kernel does not
    have sends the call to the Triton forward, as does a scale fp16 cannot fold whole."""
    monkeypatch.setattr(attention_forward, "gluon_forward_available", lambda device: True)
    q, k = torch.empty(1, 4, 2048, 128, dtype=torch.float16), torch.empty(1, 2, 2048, 128)
    k = k.half()

    def takes(q=q, k=k, rope_dim=128, interleaved=False, scale=128**-0.5):
        return attention_forward.hopper_forward_takes(q, k, rope_dim, interleaved, scale)

    assert takes()
    assert takes(q=q.bfloat16(), k=k.bfloat16())
    assert takes(q=q[..., :64], k=k[..., :64], rope_dim=64)
    assert not takes(q=q.float(), k=k.float())
    assert not takes(q=q[..., :96], k=k[..., :96], rope_dim=96)  # D
    wide_q, wide_k = (torch.cat([x, x], dim=-1) for x in (q, k))  # D = 256: 64-key tiles
    assert takes(q=wide_q, k=wide_k, rope_dim=256) and takes(q=wide_q, k=wide_k, rope_dim=128)
    assert takes(rope_dim=64)  # partial rotation whose segments fill the head
    assert takes(q=q[..., :64], k=k[..., :64], rope_dim=32)
    assert not takes(rope_dim=32)  # segments of 16 + 16 + 128 channels: 160 > 128
    assert not takes(rope_dim=96)
    assert takes(interleaved=True)
    assert takes(interleaved=True, rope_dim=64)
    assert not takes(k=k[:, :, :128])  # NQ > NK: rows that see no key
    assert takes(q=q[:, :, :1])  # NQ < NK, any length: a prefill that continues a cache
    assert takes(q=q[:, :, :1000])
    assert not takes(q=q[:, :, :1024], k=k[:, :, :1024])  # short: the Triton forward is faster
    monkeypatch.setattr(attention_forward, "HOPPER_MIN_N", 128)
    assert takes(q=q[:, :, :1024], k=k[:, :, :1024])
    assert takes(q=q[:, :, :200], k=k[:, :, :200])  # N not a multiple of 128
    assert not takes(q=q[:, :, :100], k=k[:, :, :100])  # fewer keys than HOPPER_MIN_N
    assert not takes(q=q[:0], k=k[:0])  # an empty batch: the Triton forward launches nothing
    assert not takes(scale=1.0)  # fp16: the scores would take a power of two
    assert takes(q=q.bfloat16(), k=k.bfloat16(), scale=1.0)
    monkeypatch.setattr(attention_forward, "gluon_forward_available", lambda device: False)
    assert not takes()


def test_auto_takes_the_gluon_forward_for_long_causal_inference_only(monkeypatch):
    """``rope_attention``'s "auto" on a Hopper GPU (assumed): the fused path (Gluon forward)
    for square causal attention from 2K keys on when nothing is differentiated; RoPE then
    SDPA when a gradient may follow, for shorter or non-causal attention, or positions."""
    monkeypatch.setattr(attention_forward, "gluon_forward_available", lambda device: True)
    q, k = torch.empty(1, 4, 4096, 64, dtype=torch.float16), torch.empty(1, 2, 4096, 64)
    k = k.half()
    none = dict(inv_freq=None, positions=None, q_positions=None, angles=None, q_angles=None)

    def wins(q=q, k=k, causal=True, rotation=none, rope_dim=64, layout="half"):
        return attention_module._hopper_inference_wins(
            q, k, k, causal, rope_dim, layout, None, rotation
        )

    assert wins()
    assert not wins(q=q.requires_grad_())
    with torch.no_grad():
        assert wins(q=q.requires_grad_())
    q.requires_grad_(False)
    assert not wins(k=k.clone().requires_grad_())
    assert not wins(rotation={**none, "inv_freq": torch.ones(32, requires_grad=True)})
    assert not wins(causal=False)
    assert wins(q=q[:, :, :2048], k=k[:, :, :2048])  # HOPPER_MIN_N
    assert wins(q=q[:, :, :3000], k=k[:, :, :3000])  # any length
    assert not wins(q=q[:, :, :1000])  # a prefill (NQ < NK): the prefill rule decides
    assert not wins(q=q[:, :, :1024], k=k[:, :, :1024])
    assert not wins(rotation={**none, "positions": torch.arange(4096)})
    # D = 256: the Gluon forward takes it, but RoPE then SDPA is faster for square attention
    wide_q, wide_k = torch.empty(1, 4, 4096, 256).half(), torch.empty(1, 2, 4096, 256).half()
    assert attention_forward.hopper_forward_takes(wide_q, wide_k, 256, False, 256**-0.5)
    assert not wins(q=wide_q, k=wide_k, rope_dim=256)
    # the interleaved layout: from GLUON_INTERLEAVED_MIN_N (8K) keys
    long_q, long_k = torch.empty(1, 4, 8192, 64).half(), torch.empty(1, 2, 8192, 64).half()
    assert not wins(layout="interleaved")
    assert wins(q=long_q, k=long_k, layout="interleaved")


@pytest.mark.gpu
@NEEDS_GLUON
@pytest.mark.parametrize(
    "B, HQ, HKV, NQ, NK, D, dtype, opts",
    [
        (2, 8, 2, 1024, 1024, 128, torch.float16, dict()),
        (2, 8, 8, 384, 384, 64, torch.bfloat16, dict(causal=False)),
        (1, 8, 1, 512, 512, 128, torch.bfloat16, dict(positions="shared")),
        (2, 4, 4, 256, 256, 64, torch.float16, dict(attention_factor=1.19, transposed=True)),
        (1, 4, 2, 640, 640, 128, torch.bfloat16, dict(causal=False, softmax_scale=0.3)),
        (1, 4, 2, 384, 384, 128, torch.float16, dict(positions="shared", q_positions=True)),
        (1, 4, 2, 300, 300, 128, torch.float16, dict()),
        (2, 4, 4, 500, 500, 64, torch.bfloat16, dict(attention_factor=1.19)),
        (2, 4, 1, 200, 700, 64, torch.bfloat16, dict()),
        (1, 4, 2, 1, 333, 128, torch.float16, dict()),
        (1, 4, 4, 130, 521, 128, torch.float16, dict(causal=False)),
        (1, 4, 2, 63, 1000, 128, torch.bfloat16, dict(positions="shared", q_positions=True)),
        (2, 4, 2, 256, 256, 64, torch.bfloat16, dict(positions="batch")),
        (3, 4, 1, 100, 300, 128, torch.float16, dict(positions="batch", q_positions=True)),
        (1, 4, 2, 300, 300, 128, torch.bfloat16, dict(rope_dim=64, attention_factor=1.19)),
        (2, 4, 4, 256, 256, 64, torch.float16, dict(layout="interleaved")),
        (1, 4, 1, 200, 400, 128, torch.float16, dict(layout="interleaved", rope_dim=64)),
        (1, 4, 2, 256, 256, 64, torch.bfloat16, dict(rope_dim=32, causal=False)),
        (1, 4, 2, 700, 700, 128, torch.float16, dict(window=100)),
        (2, 4, 1, 200, 900, 64, torch.bfloat16, dict(window=64)),
        (1, 4, 4, 300, 300, 64, torch.float16, dict(window=1)),
        (1, 4, 2, 520, 520, 128, torch.bfloat16, dict(window=200, positions="batch")),
        (1, 4, 2, 300, 300, 256, torch.bfloat16, dict()),
        (2, 4, 4, 256, 256, 256, torch.float16, dict(causal=False)),
        (1, 4, 1, 200, 700, 256, torch.float16, dict(rope_dim=128, attention_factor=1.19)),
        (1, 4, 2, 520, 520, 256, torch.bfloat16, dict(window=200, layout="interleaved")),
    ],
    ids=[
        "GQA4-fp16-D128",
        "nomask-bf16-D64",
        "MQA-shared-positions",
        "factor-strided",
        "scale",
        "query-positions",
        "N300",
        "N500-factor",
        "prefill-200x700",
        "one-row-333",
        "nomask-130x521",
        "prefill-query-positions",
        "batch-positions",
        "prefill-batch-positions",
        "partial-64of128-factor",
        "interleaved",
        "interleaved-partial-prefill",
        "partial-32of64-nomask",
        "window-100",
        "prefill-window-64",
        "window-1",
        "window-200-batch-positions",
        "D256-N300",
        "D256-nomask",
        "D256-partial-prefill-factor",
        "D256-window-interleaved",
    ],  # fmt: skip
)
def test_gpu_hopper_forward(B, HQ, HKV, NQ, NK, D, dtype, opts, monkeypatch):
    """The fused path with the Gluon forward (and the Triton backward on its LSE): o, lse and
    every gradient by the flash-attention rule; the spy proves the Gluon kernel ran. The
    query positions give q and k different tables (q rotated in the kernel by its own, k by
    the pass), positions per batch a table row per batch row; partial rotation (the
    pass-through channels times the fold alone, also where Q's cos and sin carry the attention
    factor twice by angle addition) and the interleaved layout (q's pairs read
    apart into the keys' segment layout); sliding windows (rows of the later warpgroup whose
    first key tiles are all outside their window, a window of one key); D = 256 (64-key tiles,
    Q rotated in column chunks). Lengths that are not multiples of the tiles (the last CTA's rows past NQ, a
    warpgroup with none, key tiles past NK), and NQ < NK (causal at the bottom right, the
    table's rows from NK - NQ on)."""
    calls = _hopper_calls(monkeypatch)
    _check_case(B, HQ, HKV, NQ, NK, D, dtype=dtype, **opts)
    assert calls, "the Gluon forward did not run"


@pytest.mark.gpu
@NEEDS_GLUON
def test_gpu_hopper_forward_leaves_what_it_lacks_to_triton(monkeypatch):
    """Partial rotation whose segments do not fill the head (32 of 128 channels: 16 + 16 +
    128 wide) takes the Triton forward, still correct."""
    calls = _hopper_calls(monkeypatch)
    _check_case(2, 4, 2, 256, 256, 128, dtype=torch.bfloat16, rope_dim=32)
    assert not calls


@pytest.mark.gpu
@NEEDS_GLUON
@pytest.mark.parametrize("n", [2048, 4096])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_auto_inference_from_2k_runs_the_gluon_forward(dtype, n, monkeypatch):
    """Under no_grad, "auto" at 2K and 4K causal takes the Gluon forward: o by the
    flash-attention rule against float64."""
    calls = _hopper_calls(monkeypatch)
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    q, k, v = (torch.randn(1, h, n, 128, device=DEVICE, dtype=dtype, generator=gen)
               for h in (4, 1, 1))  # fmt: skip
    with torch.no_grad():
        o = rope_attention(q, k, v)
    assert calls, "auto did not take the Gluon forward"
    o64, _ = rope_attention_ref(q.double(), k.double(), v.double())
    angles = rope_angles(torch.arange(n, device=DEVICE), rope_frequencies(128)[0].to(DEVICE))
    o_b, _, _ = rope_attention_in_dtype(
        q, k, v, q_angles=angles, k_angles=angles, causal=True, scale=128**-0.5, layout="half",
        rope_dim=128,
    )  # fmt: skip
    assert_close_to_baseline("o", o, o64, o_b)


def test_auto_inference_rule_traces_under_compile(monkeypatch):
    """``_hopper_inference_wins`` (the Gluon check stubbed true: no Hopper here) traces under
    torch.compile(fullgraph=True), grad mode and requires_grad included, to the eager answer."""
    monkeypatch.setattr(attention_forward, "gluon_forward_available", lambda device: True)
    none = dict(inv_freq=None, positions=None, q_positions=None, angles=None, q_angles=None)

    def f(q, k):
        wins = attention_module._hopper_inference_wins(q, k, k, True, 64, "half", None, none)
        return q * 2 if wins else q

    q, k = torch.ones(1, 2, 4096, 64, dtype=torch.bfloat16), torch.ones(1, 1, 4096, 64)
    k = k.bfloat16()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(q.requires_grad_(), k), 2 * q)
    assert torch.equal(compiled(q, k), q)  # q requires grad: the separate path's answer


@pytest.mark.gpu
@NEEDS_GLUON
def test_gpu_hopper_forward_copies_a_misaligned_input(monkeypatch):
    """A contiguous q, k and v at an odd storage offset (TMA needs 16-byte aligned rows) give
    the aligned inputs' o and lse bitwise, through the Gluon forward."""
    calls = _hopper_calls(monkeypatch)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    shapes = [(1, 4, 256, 64), (1, 2, 256, 64), (1, 2, 256, 64)]
    aligned = [torch.randn(s, device=DEVICE, dtype=torch.bfloat16, generator=gen) for s in shapes]
    misaligned = []
    for x in aligned:
        buffer = torch.empty(x.numel() + 1, device=DEVICE, dtype=x.dtype)
        misaligned.append(buffer[1:].view(x.shape).copy_(x))
    assert misaligned[0].data_ptr() % 16 and misaligned[0].is_contiguous()
    o, lse = rope_attention(*aligned, impl="fused", return_lse=True)
    o_m, lse_m = rope_attention(*misaligned, impl="fused", return_lse=True)
    assert len(calls) == 2
    assert torch.equal(o, o_m) and torch.equal(lse, lse_m)


@pytest.mark.gpu
@NEEDS_GLUON
def test_gpu_auto_inference_at_4k_under_compile(monkeypatch):
    """torch.compile(fullgraph=True) of "auto" at 4K causal under no_grad: the Gluon forward
    runs (its rule traced), bitwise the eager call's output."""
    calls = _hopper_calls(monkeypatch)
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    q, k, v = (torch.randn(1, h, 4096, 64, device=DEVICE, dtype=torch.float16, generator=gen)
               for h in (2, 1, 1))  # fmt: skip
    compiled = torch.compile(lambda q, k, v: rope_attention(q, k, v), fullgraph=True)
    with torch.no_grad():
        eager = rope_attention(q, k, v)
        traced = compiled(q, k, v)
    assert len(calls) == 2
    assert torch.equal(eager, traced)


@pytest.fixture
def separate_calls(monkeypatch):
    """A list that records each call of the separate path (Triton RoPE, then SDPA)."""
    calls, real = [], attention_module._rope_then_sdpa

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "_rope_then_sdpa", spy)
    return calls


@pytest.mark.parametrize("fills", [True, False])
@pytest.mark.parametrize("has_kernel", [True, False])
def test_auto_prefill_dispatch(has_kernel, fills, separate_calls, monkeypatch):
    """A causal NQ < NK prefill: "auto" runs the separate path exactly when SDPA has a kernel
    for the bottom-right mask and the fused kernel would not fill the GPU (both stubbed, so
    every answer is seen on any device), and is right either way."""
    monkeypatch.setattr(attention_module, "_sdpa_has_lower_right_kernel", lambda *a: has_kernel)
    monkeypatch.setattr(attention_module, "_fused_prefill_fills_the_gpu", lambda *a: fills)
    _check_case(1, 4, 2, 20, 37, 32, dtype=torch.float32, impl="auto")
    assert len(separate_calls) == (1 if has_kernel and not fills else 0)


@pytest.mark.parametrize("slowed", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_auto_under_deterministic_algorithms(causal, slowed, separate_calls, monkeypatch):
    """Square attention: "auto" takes the fused kernel exactly when it is causal and SDPA is
    kept from cuDNN by deterministic algorithms (stubbed, so both answers are seen on any
    device), and is right either way."""
    monkeypatch.setattr(attention_module, "_sdpa_is_slowed_by_determinism", lambda q: slowed)
    _check_case(1, 4, 2, 37, 37, 32, dtype=torch.float32, causal=causal, impl="auto")
    assert len(separate_calls) == (0 if causal and slowed else 1)


@pytest.mark.parametrize("slowed", [True, False])
def test_auto_under_deterministic_algorithms_traces_under_compile(slowed, monkeypatch):
    """The deterministic dispatch (stubbed) under torch.compile(fullgraph=True): "auto" traces
    into the path it takes eagerly, bitwise (the two paths' outputs differ in their last
    bits, which tells them apart)."""
    monkeypatch.setattr(attention_module, "_sdpa_is_slowed_by_determinism", lambda q: slowed)
    q, k, v = _qkv(torch.float32, nq=20, nk=20, d=32)
    f = lambda q, k, v: rope_attention(q, k, v)
    traced = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    fused, separate = (rope_attention(q, k, v, impl=i) for i in ("fused", "separate"))
    assert not torch.equal(fused, separate)  # the paths round differently: told apart
    assert torch.equal(traced, fused if slowed else separate)


def test_sdpa_is_slowed_by_determinism_follows_the_strict_switch_on_hopper(monkeypatch):
    """The stub's truth: the strict switch of torch.use_deterministic_algorithms (warn_only
    leaves SDPA on cuDNN), on a Hopper GPU only (on the CPU SDPA has no cuDNN kernel to leave;
    on other GPUs it does not take cuDNN first). Every branch on any machine: a CUDA device
    and its capability stand in. Restores the switch."""
    capability = {}
    monkeypatch.setattr(attention_module, "compute_capability", lambda d: (capability["major"], 0))
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))  # the function reads .device
    for on, warn_only in ((True, False), (True, True), (False, False)):
        with deterministic_algorithms(on, warn_only):
            strict = on and not warn_only
            for major in (9, 8, 10):
                capability["major"] = major
                slowed = attention_module._sdpa_is_slowed_by_determinism(on_cuda)
                assert slowed == (strict and major == 9), (on, warn_only, major)
            capability["major"] = 9  # a CPU tensor beside a Hopper GPU: not slowed
            assert not attention_module._sdpa_is_slowed_by_determinism(torch.zeros(1, 1, 4, 32))


@pytest.mark.parametrize("nq", [37, 20])  # 20: a causal prefill, NQ < NK
def test_auto_under_torch_func_takes_the_separate_path(nq, separate_calls, monkeypatch):
    """Under torch.func, which the fused kernel's custom op refuses, "auto" keeps the separate
    path even where deterministic algorithms (NQ == NK) or a prefill on a GPU it fills or
    without SDPA's bottom-right kernel (NQ < NK) would take the fused kernel (stubbed)."""
    monkeypatch.setattr(attention_module, "_sdpa_is_slowed_by_determinism", lambda q: True)
    monkeypatch.setattr(attention_module, "_fused_prefill_fills_the_gpu", lambda *a: True)
    q, k, v = _qkv(torch.float32, nq=nq, nk=37, d=32)
    grad = torch.func.grad(lambda q: rope_attention(q, k, v).square().sum())(q)
    assert len(separate_calls) == 1
    (expected,) = torch.autograd.grad(
        rope_attention(q.requires_grad_(), k, v, impl="separate").square().sum(), q
    )
    assert_close("dq", grad, expected, atol=1e-6, rtol=1e-5)


# (B, HQ, NQ, sms) -> fused: the shapes of experiments/results/prefill_dispatch_h100.md where
# one path was more than 7% faster, on the H100's 132 SMs.
PREFILL_WINS = [
    ((1, 32, 1, 132), False),
    ((1, 32, 128, 132), False),
    ((1, 32, 512, 132), True),
    ((8, 32, 1, 132), False),
    ((8, 32, 15, 132), False),  # enough programs, too few queries: PREFILL_MIN_QUERIES
    ((8, 32, 16, 132), True),
    ((4, 8, 256, 132), False),
    ((4, 8, 512, 132), True),
]


@pytest.mark.parametrize("shape, fused", PREFILL_WINS)
def test_fused_prefill_wins_matches_the_measured_faster_path(shape, fused):
    assert attention_module.fused_prefill_wins(*shape) == fused


# (B, HQ, NQ, sms, D) -> fused, with the Gluon forward: the shapes of
# experiments/results/prefill_dispatch_h200.md where one path was more than 7% faster forward
PREFILL_WINS_GLUON = [
    ((1, 32, 16, 132, 128), False),
    ((1, 32, 128, 132, 128), False),
    ((1, 32, 256, 132, 128), True),  # 64 programs of 128 channels
    ((8, 32, 1, 132, 128), True),  # one query: no PREFILL_MIN_QUERIES
    ((4, 8, 256, 132, 64), False),  # 64 programs of 64 channels
    ((4, 8, 512, 132, 64), True),
]


@pytest.mark.parametrize("shape, fused", PREFILL_WINS_GLUON)
def test_fused_prefill_wins_with_the_gluon_forward(shape, fused):
    assert attention_module.fused_prefill_wins(*shape, gluon=True) == fused


def test_prefill_rule_asks_whether_the_gluon_forward_takes_the_call(monkeypatch):
    """``_fused_prefill_fills_the_gpu`` on a CUDA device (mocked: 132 SMs): the Gluon rule
    where ``hopper_forward_takes``, the Triton forward's where it does not."""
    from fused_rope import _device

    monkeypatch.setattr(_device, "_SMS", {torch.device("cuda", 0): 132})
    monkeypatch.setattr(attention_module, "num_sms", _device.num_sms)
    q = torch.empty(1, 32, 256, 128, device="meta")
    taken = []
    monkeypatch.setattr(
        attention_module, "hopper_forward_takes", lambda *a: taken.append(a[2:]) or True
    )

    def fills(q):
        cuda_q = type("CudaView", (), {"device": torch.device("cuda", 0), "shape": q.shape})()
        return attention_module._fused_prefill_fills_the_gpu(cuda_q, q, 128, "interleaved", 0.1)

    assert fills(q)  # 64 programs: the Gluon rule
    assert taken == [(128, True, 0.1)]
    monkeypatch.setattr(attention_module, "hopper_forward_takes", lambda *a: False)
    assert not fills(q)  # the Triton forward's rule: 0.5 a SM


@pytest.mark.parametrize("dtype, D", [(torch.float16, 264), (torch.float32, 136)])
def test_auto_prefill_the_fused_kernel_cannot_run_takes_sdpa(dtype, D, separate_calls, monkeypatch):
    """A head beyond the fused kernel (fp32: past 128 channels): "auto" runs SDPA with its
    bottom-right mask rather than raising, even where SDPA has no kernel for that mask (a
    materialized one)."""
    monkeypatch.setattr(attention_module, "_sdpa_has_lower_right_kernel", lambda *a: False)
    _check_case(1, 2, 1, 5, 9, D, dtype=dtype, impl="auto")
    assert len(separate_calls) == 1
    with pytest.raises(ValueError, match=f"head dim must be at most {max_head_dim(dtype)}"):
        rope_attention(*_qkv(dtype, nq=5, nk=9, d=D), impl="fused")


@pytest.mark.parametrize(
    "nq, nk, kw, why",
    [(2, 2, {"return_lse": True}, "return_lse=True"), (9, 5, {}, "causal NQ=9 > NK=5")],
)
def test_auto_beyond_both_paths_raises_naming_the_reference(nq, nk, kw, why):
    """An fp32 head past 128 channels where SDPA cannot run either (it returns no lse and has
    no kernel for causal queries that see no key): "auto" raises, and the message does not send
    the user to impl='separate'."""
    q, k, v = _qkv(d=136, hq=1, hkv=1, nq=nq, nk=nk)
    match = (
        rf"cannot take {why} .*: use fp16 or bf16 inputs, or fused_rope.naive.rope_attention_ref"
    )
    for impl in ("auto", "fused"):
        with pytest.raises(ValueError, match=match):
            rope_attention(q, k, v, impl=impl, **kw)


def test_a_head_past_int32_indexing_is_refused_by_fused_and_auto_takes_sdpa(
    separate_calls, monkeypatch
):
    """The fused kernels index within one (batch, head) in int32: a q seen through a transpose
    whose head spans INT32_INDEX_LIMIT elements (lowered here, so a small tensor reaches it) is
    refused by "fused", and a prefill that "auto" would give the fused kernel (stubbed) runs
    the separate path instead."""
    monkeypatch.setattr(attention_module, "INT32_INDEX_LIMIT", 2000)
    monkeypatch.setattr(attention_module, "_fused_prefill_fills_the_gpu", lambda *a: True)
    q = torch.randn(1, 20, 4, 32, device=DEVICE).transpose(1, 2)  # head span 19 * 128 + 32
    _, k, v = _qkv(nq=20, nk=37)  # head span 37 * 32
    with pytest.raises(ValueError, match="q spans 2464 elements.*int32 indexing"):
        rope_attention(q, k, v, impl="fused")
    out = rope_attention(q, k, v)
    assert len(separate_calls) == 1
    assert torch.equal(out, rope_attention(q, k, v, impl="separate"))


def test_rotated_copies_past_int32_indexing_are_refused_by_fused_and_auto_takes_sdpa(
    separate_calls, monkeypatch
):
    """The fused kernels' rotated copies of q and k have rows padded for the rotation (D = 40:
    two halves of 32), so they pass int32 indexing before q, k and v do: 37 rows of 64
    elements against a (lowered) limit of 2000, where the inputs span 37 * 40 = 1480. A prefill
    that "auto" would give the fused kernel (stubbed) runs the separate path instead."""
    monkeypatch.setattr(attention_module, "INT32_INDEX_LIMIT", 2000)
    monkeypatch.setattr(attention_module, "_fused_prefill_fills_the_gpu", lambda *a: True)
    q, k, v = _qkv(nq=20, nk=37, d=40)
    with pytest.raises(ValueError, match="37 rows of 64 elements.*2368, past their int32"):
        rope_attention(q, k, v, impl="fused")
    out = rope_attention(q, k, v)
    assert len(separate_calls) == 1
    assert torch.equal(out, rope_attention(q, k, v, impl="separate"))
    monkeypatch.setattr(attention_module, "INT32_INDEX_LIMIT", 2369)
    rope_attention(q, k, v, impl="fused")  # one element under the limit: runs


def test_a_cotangent_past_int32_indexing_is_made_contiguous(monkeypatch):
    """do comes from whatever follows the attention: one whose head spans INT32_INDEX_LIMIT elements
    reaches the fused backward contiguous, and the gradients are those of a contiguous do."""
    monkeypatch.setattr(attention_module, "INT32_INDEX_LIMIT", 2000)  # q, k, v span 37 * 32 = 1184
    seen, real = [], attention_module.rope_attention_bwd

    def spy(do, *args):
        seen.append(do.is_contiguous())
        return real(do, *args)

    monkeypatch.setattr(attention_module, "rope_attention_bwd", spy)
    q, k, v = (x.requires_grad_() for x in _qkv(nq=37, nk=37))
    do = torch.randn(1, 37, 4, 32, device=DEVICE).transpose(1, 2)  # head span 4640
    grads = torch.autograd.grad(rope_attention(q, k, v, impl="fused"), (q, k, v), do)
    o = rope_attention(q, k, v, impl="fused")
    expected = torch.autograd.grad(o, (q, k, v), do.contiguous())
    assert seen == [True, True]
    for a, b in zip(grads, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("NQ", [1, 5, 37])
def test_sdpa_attention_is_the_reference_without_rotation(NQ, causal):
    """``sdpa_attention`` (the separate path's SDPA call, and the harness's for a cached
    decoding step) is attention with q's rows at the last positions, GQA, bottom-right."""
    f64 = dict(device=DEVICE, dtype=torch.float64)
    q, k, v = torch.randn(2, 4, NQ, 16, **f64), *torch.randn(2, 2, 2, 37, 16, **f64).unbind(0)
    ref, _ = rope_attention_ref(q, k, v, inv_freq=torch.zeros(8, **f64), causal=causal)
    out = sdpa_attention(q, k, v, causal=causal, scale=0.3)
    ref_scaled, _ = rope_attention_ref(
        q, k, v, inv_freq=torch.zeros(8, **f64), causal=causal, softmax_scale=0.3
    )
    assert_close("o", out, ref_scaled, atol=1e-12, rtol=1e-12)
    assert_close("o", sdpa_attention(q, k, v, causal=causal), ref, 1e-12, 1e-12)


@pytest.mark.parametrize("window", [1, 6, 36, 37, 80])
@pytest.mark.parametrize("NQ", [1, 5, 37])
def test_sdpa_attention_window_is_the_reference_without_rotation(NQ, window):
    """``sdpa_attention``'s sliding window (the separate path's, and the harness's in training
    and in cached decoding steps): the reference's mask, bottom-right, GQA."""
    f64 = dict(device=DEVICE, dtype=torch.float64)
    q, k, v = torch.randn(2, 4, NQ, 16, **f64), *torch.randn(2, 2, 2, 37, 16, **f64).unbind(0)
    ref, _ = rope_attention_ref(q, k, v, inv_freq=torch.zeros(8, **f64), window=window)
    assert_close("o", sdpa_attention(q, k, v, window=window), ref, 1e-12, 1e-12)
    if window < 37:  # the window hides keys: not plain causal attention
        plain, _ = rope_attention_ref(q, k, v, inv_freq=torch.zeros(8, **f64))
        assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [4, 7])
@pytest.mark.parametrize("window", [1, 3, 9, 40])
@pytest.mark.parametrize("NQ, NK", [(37, 37), (30, 45), (9, 60), (28, 28)])
def test_sdpa_attention_window_in_chunks_of_queries(NQ, NK, window, chunk, monkeypatch):
    """A window's mask over the queries in chunks (``WINDOW_CHUNK``, made small here; at
    least the window), each with the keys its windows reach, in one batched call: the
    reference's output and gradients, bottom-right, GQA, also where the chunks pad the
    queries (37 rows) or fill them exactly (28)."""
    import fused_rope.sdpa

    monkeypatch.setattr(fused_rope.sdpa, "WINDOW_CHUNK", chunk)
    calls = []
    for name in ("_window_masked", "_window_chunked"):
        real = getattr(fused_rope.sdpa, name)
        spy = lambda *args, real=real, name=name: (calls.append(name), real(*args))[1]  # noqa: E731
        monkeypatch.setattr(fused_rope.sdpa, name, spy)
    f64 = dict(device=DEVICE, dtype=torch.float64)
    q = torch.randn(2, 4, NQ, 16, **f64, requires_grad=True)
    k, v = (torch.randn(2, 2, NK, 16, **f64, requires_grad=True) for _ in range(2))
    do = torch.randn(2, 4, NQ, 16, **f64)
    out = sdpa_attention(q, k, v, window=window, scale=0.3)
    ref, _ = rope_attention_ref(
        q, k, v, inv_freq=torch.zeros(8, **f64), window=window, softmax_scale=0.3
    )
    assert_close("o", out, ref, 1e-12, 1e-12)
    grads = torch.autograd.grad(out, (q, k, v), do)
    # (window 1: dq is 0, each query's single weight being 1; so no relative measure)
    torch.testing.assert_close(grads, torch.autograd.grad(ref, (q, k, v), do), rtol=0, atol=1e-12)
    if window >= min(NK, window + NQ - 1):  # no query's window hides a key it could see
        assert calls == []
    else:
        assert calls == ["_window_chunked" if NQ > max(window, chunk) else "_window_masked"]


def test_sdpa_attention_window_compiles_once_for_every_length(monkeypatch):
    """The chunks of a window's mask stay one graph under torch.compile(dynamic=True) for
    every query length past one chunk (a Python loop over the chunks specialized the graph
    to each length, and fullgraph failed at the recompile limit: a review's find)."""
    import fused_rope.sdpa

    monkeypatch.setattr(fused_rope.sdpa, "WINDOW_CHUNK", 4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(
        lambda q, k, v: sdpa_attention(q, k, v, window=3), backend=backend, fullgraph=True,
        dynamic=True,
    )  # fmt: skip
    for N in (9, 12, 17, 23, 30):
        q, k, v = (torch.randn(1, h, N, 8, device=DEVICE) for h in (4, 2, 2))
        ref, _ = rope_attention_ref(q, k, v, inv_freq=torch.zeros(4, device=DEVICE), window=3)
        assert_close("o", f(q, k, v), ref, 1e-5, 1e-5)
    assert len(graphs) == 1


def test_window_skips_the_key_tiles_outside_it():
    """The fused forward does not load the key tiles outside a query tile's windows (its cost
    grows with NQ * window): NaN values there reach no query tile whose windows begin past
    them, while masking them would give 0 * NaN."""
    NQ, W, poisoned = 160, 8, 40
    q, k, v = _qkv(hq=2, hkv=1, nq=NQ, nk=NQ)
    v[:, :, :poisoned] = float("nan")
    o = rope_attention(q, k, v, window=W, impl="fused")
    block_m, block_n = (attention_module._FWD_CONFIGS[-1].kwargs[b] for b in ("BLOCK_M", "BLOCK_N"))
    first_clean = next(  # the first query tile whose key loop starts past the poisoned keys
        m for m in range(0, NQ, block_m) if (m - W + 1) // block_n * block_n >= poisoned
    )
    assert first_clean < NQ, "the case must have query tiles past the poison"
    # the reference's product with every key's value: the poison as 0 (outside these windows)
    ref, _ = rope_attention_ref(q[:, :, first_clean:], k, v.nan_to_num(0.0), window=W)
    assert torch.isfinite(o[:, :, first_clean:]).all(), "a tile outside the window was loaded"
    assert_close("o", o[:, :, first_clean:], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_window_rows_whose_scores_are_all_very_negative(dtype):
    """A window's first key tile can hide every key from some rows of a query tile that see
    keys in the next one; their running maximum must stay -inf there. A maximum of 0 taken
    instead left probabilities 2**s unnormalized: with every visible score below -24 (log2
    units) they rounded to 0 in fp16 and the rows returned 0 (a first version did)."""
    NQ, D = 100, 32
    e = torch.nn.functional.normalize(torch.randn(D, device=DEVICE), dim=0)
    near_e = lambda: e + 0.1 * torch.randn(1, 1, NQ, D, device=DEVICE)
    # q and k of 16 times opposite directions: scores about -16**2 / sqrt(D) = -45 (natural)
    q, k = (16.0 * near_e()).to(dtype), (-16.0 * near_e()).to(dtype)
    v = torch.randn(1, 1, NQ, D, device=DEVICE, dtype=dtype)
    no_rotation = dict(inv_freq=torch.zeros(D // 2, device=DEVICE), window=7)
    o = rope_attention(q, k, v, impl="fused", **no_rotation)
    ref, lse = rope_attention_ref(q.double(), k.double(), v.double(), **no_rotation)
    assert lse.max() < -24 * math.log(2), "the case must have every visible score below -24"
    zero = torch.zeros(NQ, D // 2, device=DEVICE)
    baseline = rope_attention_in_dtype(
        q, k, v, q_angles=zero, k_angles=zero, causal=True, scale=D**-0.5, layout="half",
        rope_dim=D, window=7,
    )[0]  # fmt: skip
    # the flash-attention rule (a fixed 1e-6 rel-RMSE failed the fp32 kernel on an H200 at
    # 1.3e-6: scores of 45 in fp32 keep errors of 3e-6 in their exponent)
    assert_close_to_baseline("o", o, ref, baseline)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((2, 4, 5, 16), (2, 3, 9, 16), (2, 3, 9, 16)), "q's heads must be a multiple of k's"),
        (((2, 4, 9, 16), (2, 2, 5, 16), (2, 2, 5, 16)), "causal, q's rows at most k's"),
        (((2, 4, 5, 16), (2, 2, 9, 16), (2, 2, 8, 16)), "k, v .* of one shape"),
        (((4, 5, 16), (2, 2, 9, 16), (2, 2, 9, 16)), r"q must be \[B, HQ, NQ, D\]"),
        (
            ((2, 4, 5, 16), (1, 2, 9, 16), (1, 2, 9, 16)),
            r"q must be \[B, HQ, NQ, D\]",
        ),  # no broadcast
    ],
)
def test_sdpa_attention_refuses_bad_shapes(shapes, match):
    with pytest.raises(ValueError, match=match):
        sdpa_attention(*(torch.randn(s, device=DEVICE) for s in shapes))


def test_lower_right_gqa_on_the_efficient_kernel_gets_every_head(monkeypatch):
    """causal_lower_right passes k and v to SDPA's memory-efficient kernel without expanding
    GQA heads; where that kernel is the one (stubbed here), the separate path repeats them, and
    the result is unchanged."""
    monkeypatch.setattr(fused_rope.sdpa, "_lower_right_backend", lambda *a: "efficient")
    from torch.nn.attention.bias import CausalBias

    heads, real = [], CausalBias._dispatch

    def spy(q, k, v, *args, **kwargs):  # where SDPA hands a bottom-right mask to its kernels
        heads.append((q.shape[1], k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(CausalBias, "_dispatch", staticmethod(spy))
    _check_case(1, 4, 2, 20, 37, 32, dtype=torch.float32, impl="separate")
    assert heads and all(h == (4, 4, 4, False) for h in heads), heads


def test_sdpa_kernel_check_is_false_under_compile(monkeypatch):
    """dynamo cannot build SDPA's bottom-right mask object: while compiling, the check says
    no kernel whatever SDPA has (stubbed as FlashAttention-2's here)."""
    monkeypatch.setattr(attention_module, "_lower_right_backend", lambda *a: "flash")
    q, k, v = _qkv(nq=4)
    check = attention_module._sdpa_has_lower_right_kernel
    assert check(q, k, v)
    f = lambda q: q + 1 if check(q, k, v) else q - 1
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(q), q - 1)


def test_auto_prefill_under_compile_beyond_the_fused_kernel_raises(monkeypatch):
    """Under compile a prefill cannot take SDPA's bottom-right mask, so one the fused kernel
    cannot run (an fp32 head past 128 channels) raises the fused kernel's error rather than
    the separate path's."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    match = r"at most 128 for torch.float32 .*; impl='separate' cannot take causal NQ != NK under"
    with pytest.raises(ValueError, match=match):
        rope_attention(*_qkv(nq=5, nk=9, d=136))


# The first does not fill an H100 or H200 (48 programs for 132 SMs: SDPA's kernel), the second
# does (2 * 32 * 5 = 320 programs: the fused kernel).
PREFILLS = [(8, 2, 300, 1000, 128, {}), (32, 8, 600, 4096, 64, {"positions": "shared"})]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("HQ, HKV, NQ, NK, D, opts", PREFILLS)
def test_gpu_prefill_both_paths(HQ, HKV, NQ, NK, D, opts, dtype, separate_calls):
    """A prefill that continues a KV cache (causal, NQ < NK) in half precision: "auto" takes the
    path of fused_prefill_wins, and the separate path runs SDPA's bottom-right FlashAttention-2
    kernel; both pass the flash-attention rule."""
    q = torch.empty(2, HQ, NQ, D, device=DEVICE, dtype=dtype)
    k = torch.empty(2, HKV, NK, D, device=DEVICE, dtype=dtype)
    assert attention_module._lower_right_backend(q, k, k) == "flash"
    fused = attention_module._fused_prefill_fills_the_gpu(q, k, D, "half", None)
    assert fused == (NQ == 600), "the case no longer tests the path it was chosen for"
    _check_case(2, HQ, HKV, NQ, NK, D, dtype=dtype, impl="auto", **opts)
    assert len(separate_calls) == (0 if fused else 1), f"auto did not take the {fused=} path"
    _check_case(2, HQ, HKV, NQ, NK, D, dtype=dtype, impl="separate", layout="interleaved",
                q_positions=True, **opts)  # fmt: skip


@pytest.mark.gpu
def test_gpu_deterministic_algorithms_take_the_fused_kernel_and_repeat(separate_calls):
    """Under torch.use_deterministic_algorithms(True) (strict: an operator without a
    deterministic kernel would raise), "auto" on square causal bf16 attention is the fused
    kernel on a Hopper GPU (the separate path elsewhere), and two runs give the same bits.
    Restores the switch."""
    q = torch.randn(2, 8, 700, 64, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 700, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)

    def run(impl):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = rope_attention(*inputs, impl=impl)
        return (o, *torch.autograd.grad(o, inputs, do))

    with deterministic_algorithms():
        first, again, fused = run("auto"), run("auto"), run("fused")
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert len(separate_calls) == (0 if hopper else 2)
    for name, a, b, c in zip(("o", "dq", "dk", "dv"), first, again, fused, strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs"
        if hopper:
            assert torch.equal(a, c), f"{name}: auto did not take the fused kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_sliding_window(dtype):
    """Mistral's and Gemma's shapes of a sliding window, autotuned: GQA, a window of a few
    hundred keys over 2K (square, interleaved partial rotation) and a prefill that continues
    a cache past the window."""
    with attention_module.pinned_config(0):  # the largest tiles
        _check_case(2, 8, 2, 2048, 2048, 128, dtype=dtype, window=500)
    _check_case(
        1, 8, 1, 700, 1900, 64, dtype=dtype, window=333, layout="interleaved", rope_dim=32,
        positions="batch",
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_long_sequence(dtype):
    _check_case(1, 4, 1, 4096, 4096, 128, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
@pytest.mark.parametrize("index", range(attention_module.N_CONFIGS))
def test_gpu_every_config(index, dtype):
    """Config ``index`` of each kernel's autotune list (tile shapes change the masking paths).
    Causal masking starts and ends its band at ``NK - NQ`` modulo the tiles (16 to 128): the
    offsets around each tile size, both signs, so a band one key or query off shows; sliding
    windows narrower and wider than the tiles, off their multiples, square and a prefill."""
    with attention_module.pinned_config(index):
        _check_case(2, 4, 2, 300, 700, 128, dtype=dtype)
        for window in (1, 17, 63, 129, 250):
            _check_case(1, 4, 2, 600, 600, 64, dtype=dtype, window=window)
            _check_case(1, 2, 1, 300, 700, 128, dtype=dtype, window=window)
        for offset in sorted({b + d for b in (16, 32, 64, 128) for d in (-2, -1, 1, 2)}):
            _check_case(1, 2, 1, 70, 70 + offset, 64, dtype=dtype)
            _check_case(1, 2, 1, 70 + offset, 70, 64, dtype=dtype)
        _check_case(
            2,
            4,
            1,
            700,
            300,
            128,
            dtype=dtype,
            causal=False,
            rope_dim=64,
            positions="batch",
            q_positions=True,
        )


def _random_case(rng: random.Random) -> tuple[tuple, dict, int]:
    """One draw of every option ``_check_case`` takes: ``(B, HQ, HKV, NQ, NK, D)``, its
    keywords, and the autotune config to pin. On the CPU (the interpreter) small shapes in
    fp32/fp16 and the fused kernel's one config."""
    D = rng.choice([32, 64, 96, 128, 256] if ON_GPU else [32, 64])
    HKV, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4, 8])
    n_max = 1500 if ON_GPU else 80
    NQ, NK = rng.randint(1, n_max), rng.randint(1, n_max)
    positions = rng.choice(["default", "shared", "batch", "mrope"])
    kw = dict(
        dtype=rng.choice(
            [torch.float16, torch.bfloat16, torch.float32]
            if ON_GPU
            else [torch.float32, torch.float16]
        ),
        causal=rng.random() < 0.7,
        layout=rng.choice(["half", "interleaved"]),
        rope_dim=rng.choice([None, 2 * rng.randint(1, D // 2)]),
        positions=positions,
        # the default query positions (the last NQ of the keys') need NQ <= NK
        q_positions=positions in ("batch", "mrope") and rng.random() < 0.5 or NQ > NK,
        theta=10.0 ** rng.uniform(2, 6),
        softmax_scale=rng.choice([None, rng.uniform(0.03, 0.5)]),
        transposed=rng.random() < 0.3,
        impl=rng.choice(["fused", "fused", "auto", "separate"]),
        learn=rng.random() < 0.3,
    )
    if kw["impl"] == "separate" and kw["causal"] and NQ > NK:
        kw["impl"] = "auto"  # SDPA has no kernel for causal queries that see no key
    if D > max_head_dim(kw["dtype"]):  # fp32 past 128 channels: SDPA's (test_gpu_other_head_dims)
        kw["dtype"] = rng.choice([torch.float16, torch.bfloat16])
    # 256-channel heads fit only the 64-row tiles of each list's last config
    config = rng.randrange(attention_module.N_CONFIGS) if D <= 128 else -1
    return (rng.randint(1, 3), HKV * group, HKV, NQ, NK, D), kw, config


@pytest.mark.parametrize(
    "seed", [pytest.param(s, marks=pytest.mark.gpu) if s >= 3 else s for s in range(48)]
)
def test_random_configurations(seed):
    """Options drawn at random, together (the grids above vary a few at a time): lengths
    that are not tile multiples and NQ != NK, GQA and MQA, partial rotation of any even width,
    positions, layouts, a random theta and softmax scale, transposed storage, each ``impl``,
    and on the GPU each autotune config pinned in turn. Three draws in the interpreter."""
    shape, kw, config = _random_case(random.Random(seed))
    if not ON_GPU:
        _check_case(*shape, **kw)
        return
    try:
        with attention_module.pinned_config(config):
            _check_case(*shape, **kw)
    except OutOfResources:
        # A tile too large for this head's padded segments (partial rotation pads each half
        # and the pass-through channels to powers of two), which autotuning skips: the
        # untuned config, which fits every supported head.
        with attention_module.pinned_config(-1):
            _check_case(*shape, **kw)


@pytest.mark.parametrize("dynamic", [None, True])
def test_torch_compile_fullgraph_traces_the_custom_ops(monkeypatch, dynamic):
    """Fake-tensor and autograd registrations: fullgraph tracing (aot_eager, any device) gives
    the eager gradients, for default and for explicit positions, angles and learned
    frequencies; with dynamic=True too (the sizes and the float defaults symbolic, which the
    input checks and dispatch must trace)."""
    q, k, v = (torch.randn(1, 4, 40, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    pos = torch.arange(40, device=DEVICE) * 2
    angles = _mrope(rope_frequencies(32, device=DEVICE)[0], 1, 40).requires_grad_()
    freqs = rope_frequencies(32, 500.0, device=DEVICE)[0].requires_grad_()
    leaves = (q, k, v, angles, freqs)

    def f(q, k, v, angles, freqs):
        o, lse = rope_attention(q, k[:, :2], v[:, :2], return_lse=True, layout="interleaved")
        o2 = rope_attention(q, k[:, :1], v[:, :1], positions=pos, rope_dim=16, impl="fused")
        o3 = rope_attention(q, k[:, :1], v[:, :1], positions=pos, rope_dim=16)  # the RoPE op
        # a prefill: "auto" takes the fused kernel under compile (no bottom-right SDPA mask)
        o4 = rope_attention(q[:, :, :15], k[:, :2], v[:, :2])
        o5 = rope_attention(q, k[:, :2], v[:, :2], angles=angles, impl="fused")
        o6 = rope_attention(q, k[:, :2], v[:, :2], angles=angles)  # the RoPE op
        o7 = rope_attention(q, k[:, :1], v[:, :1], inv_freq=freqs, impl="fused")
        o8 = rope_attention(q, k[:, :1], v[:, :1], inv_freq=freqs)  # the RoPE op
        o = (o.float() ** 2).sum() + lse.sum() + (o2 * o2).sum() + o3.square().sum()
        o = o + o4.square().sum() + o5.square().sum() + o6.square().sum()
        return o + o7.square().sum() + o8.square().sum()

    # the prefill's eager dispatch as under compile (a GPU could take SDPA's kernel for it)
    monkeypatch.setattr(attention_module, "_sdpa_has_lower_right_kernel", lambda *a: False)
    eager = torch.autograd.grad(f(*leaves), leaves)
    traced = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)(*leaves)
    names = ("dq", "dk", "dv", "dangles", "dinv_freq")
    for name, a, b in zip(names, eager, torch.autograd.grad(traced, leaves), strict=True):
        if name in ("dangles", "dinv_freq"):
            # Sums over rows: an eager backward forms the RoPE op's share in its kernel, a
            # traced one in PyTorch (fused_rope.rope._backward_rotation), in another order
            # (seen on an H200: equal to print precision, not bitwise)
            assert_close(name, b, a, atol=1e-5 * a.abs().max().item(), rtol=1e-6)
        else:
            assert torch.equal(a, b), name


def test_separate_prefill_under_compile_is_refused():
    q, k, v = _qkv(nq=4)
    f = lambda q, k, v: rope_attention(q, k, v, impl="separate")
    with pytest.raises(Exception, match="cannot trace SDPA's bottom-right mask"):  # dynamo wraps it
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)


def test_separate_windowed_prefill_compiles():
    """With a sliding window the separate path's mask is a boolean tensor, which compiles: not
    refused as the bottom-right mask object is (a review's find)."""
    q, k, v = _qkv(nq=20, nk=50)
    f = lambda q, k, v: rope_attention(q, k, v, impl="separate", window=7)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert_close("o", out, f(q, k, v), atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    q, k, v = (
        torch.randn(2, 8, 256, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )

    def f(q, k, v):
        o, lse = rope_attention(q, k[:, :2], v[:, :2], return_lse=True, layout="interleaved")
        return (o.float() ** 2).sum() + lse.sum()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v))
    # inductor may round the cotangent 2*o differently: bf16-level agreement, not bitwise
    for name, a, b in zip(("dq", "dk", "dv"), eager, compiled, strict=True):
        assert_close(name, b, a, atol=2e-2, rtol=1e-2)


def test_causal_alignment_is_bottom_right():
    """With NQ < NK the last query sees every key and the first sees NK - NQ + 1 of them."""
    q, k, v = (torch.randn(1, 1, n, 32, device=DEVICE) for n in (4, 10, 10))
    o = rope_attention(q, k, v)
    o_full = rope_attention(q, k, v, causal=False)
    assert torch.allclose(o[:, :, -1], o_full[:, :, -1], atol=1e-5)
    first = rope_attention(
        q[:, :, :1],
        k[:, :, :7],
        v[:, :, :7],
        causal=False,
        q_positions=torch.tensor([6], device=DEVICE),
    )
    assert torch.allclose(o[:, :, :1], first, atol=1e-5)


@pytest.mark.parametrize(
    "head_dim, rope_dim, dims",
    [
        (16, 0, (16, 16)),  # no rotation: the halves are empty, padded all the same
        (32, 32, (16, 16)),  # a half of 16, no pass-through channels
        (64, 48, (32, 16)),  # halves of 24 and 16 others, padded to powers of two
        (96, 64, (32, 32)),
        (256, 256, (128, 16)),
        (256, 2, (16, 256)),
    ],
)
def test_segment_dims_are_powers_of_two_of_at_least_16(head_dim, rope_dim, dims):
    """``(HALF, PASS)``: tl.dot's inner dims, which the interpreter does not check (a GPU
    compile refuses a dot narrower than 16)."""
    from fused_rope._attention_common import segment_dims

    assert segment_dims(head_dim, rope_dim) == dims


def test_kernel_meta_takes_ieee_dots_for_fp32_and_a_window_of_one():
    """fp32 inputs (the tests') take IEEE fp32 dots, not TF32's 10-bit products, which the
    interpreter does not have; a window of one key is a window."""
    from fused_rope._attention_common import _meta

    meta = _meta(96, 64, False, True, torch.float32, 0.125, window=1)
    assert meta["INPUT_PRECISION"] == "ieee" and meta["WINDOWED"]
    assert (meta["HALF"], meta["PASS"], meta["BLOCK_D"], meta["SCORE_SCALE"]) == (
        32,
        32,
        128,
        0.125,
    )
    for dtype in (torch.float16, torch.bfloat16):
        meta = _meta(128, 128, True, False, dtype, 1.0)
        assert meta["INPUT_PRECISION"] == "tf32" and not meta["WINDOWED"]
        assert (meta["INTERLEAVED"], meta["CAUSAL"]) == (True, False)


def test_autotune_pruning_keeps_the_tiles_whose_accumulators_fit():
    """``owner`` rows times the padded head dim at most 128 * 128 fp32 accumulators, read from
    the constexprs (keyword arguments) or the named arguments; the last, untuned config when
    none fits."""
    import triton

    from fused_rope._attention_common import _prune_for

    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": 64}) for m in (256, 128, 64)]
    prune = _prune_for("BLOCK_M")["early_config_prune"]

    def rows(kept):
        return [c.kwargs["BLOCK_M"] for c in kept]

    assert rows(prune(configs, {}, BLOCK_D=64)) == [256, 128, 64]
    assert rows(prune(configs, {}, BLOCK_D=128)) == [128, 64]
    assert rows(prune(configs, {"BLOCK_D": 256})) == [64]
    assert rows(prune(configs[:2], {}, BLOCK_D=256)) == [128]
    by_keys = _prune_for("BLOCK_N")["early_config_prune"]
    assert rows(by_keys(configs, {}, BLOCK_D=256)) == [256, 128, 64]  # BLOCK_N = 64 rows


def test_separate_refuses_causal_one_more_query_than_keys():
    q, k, v = _qkv(nq=5, nk=4)
    with pytest.raises(ValueError, match="causal NQ=5 > NK=4"):
        rope_attention(q, k, v, impl="separate")


def test_fused_prefill_wins_at_exactly_half_a_program_per_sm():
    # 1 query tile x 66 heads = 66 programs = 0.5 * 132 SMs: the fused kernel
    assert attention_module.fused_prefill_wins(1, 66, 16, 132)
    assert not attention_module.fused_prefill_wins(1, 65, 16, 132)


def test_auto_takes_the_fused_kernel_for_a_window_of_one(separate_calls):
    q, k, v = _qkv(nq=37, nk=37)
    out = rope_attention(q, k, v, window=1)
    assert len(separate_calls) == 0
    assert torch.equal(out, rope_attention(q, k, v, window=1, impl="fused"))


def test_a_head_spanning_exactly_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(attention_module, "INT32_INDEX_LIMIT", 2464)
    q = torch.randn(1, 20, 4, 32, device=DEVICE).transpose(1, 2)  # head span 2464
    _, k, v = _qkv(nq=20, nk=37)
    with pytest.raises(ValueError, match="q spans 2464 elements.*int32 indexing"):
        rope_attention(q, k, v, impl="fused")


def test_rotated_copies_of_exactly_the_limit_are_refused(monkeypatch):
    monkeypatch.setattr(attention_module, "INT32_INDEX_LIMIT", 2368)
    q, k, v = _qkv(nq=20, nk=37, d=40)  # 37 rows of 64: 2368
    with pytest.raises(ValueError, match="37 rows of 64 elements.*2368, past their int32"):
        rope_attention(q, k, v, impl="fused")


def test_batch_times_heads_at_the_grid_limit_runs(monkeypatch):
    monkeypatch.setattr(attention_module, "MAX_GRID_AXIS1", 4)
    q, k, v = _qkv(hq=4, nq=4, nk=4)
    assert rope_attention(q, k, v, impl="fused").shape == q.shape  # B x HQ = 4: at the limit
    monkeypatch.setattr(attention_module, "MAX_GRID_AXIS1", 3)
    with pytest.raises(ValueError, match="at most 3, got 1 x 4"):
        rope_attention(q, k, v, impl="fused")


@pytest.mark.parametrize("impl", ["fused", "separate"])
def test_fp64_inv_freq_gives_the_fp32_result(impl):
    q, k, v = _qkv()
    inv_freq = rope_frequencies(32, device=DEVICE)[0]
    want = rope_attention(q, k, v, inv_freq=inv_freq.float(), impl=impl)
    torch.testing.assert_close(rope_attention(q, k, v, inv_freq=inv_freq.double(), impl=impl), want)


@pytest.mark.parametrize("impl", ["fused", "separate"])
def test_fp64_angles_give_the_fp32_result(impl):
    q, k, v = _qkv(nq=8, nk=8)
    want = rope_attention(q, k, v, angles=_angles(), impl=impl)
    got = rope_attention(q, k, v, angles=_angles().double(), q_angles=_angles().double(), impl=impl)
    torch.testing.assert_close(got, want)
