"""The Triton RoPE kernel (``fused_rope.rope``) against the PyTorch reference.

Accuracy uses flash-attention's rule (``assert_close_to_baseline``): the kernel's error against
the float64 reference is at most twice the error of the reference run on the kernel's dtype
(fp32 math, rounded to the dtype), forward and backward. On the CPU the kernels run in the
Triton interpreter (fp32/fp16, small shapes); on a GPU the same tests also run bf16 and large
shapes (``gpu`` marker).
"""

import random

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from torch.utils.checkpoint import checkpoint

import fused_rope._validation
import fused_rope.rope as rope_module
from fused_rope._trig import reduce_angle
from fused_rope._validation import check_kernel_device, interpreter_blocker, interpreting
from fused_rope.frequencies import rope_angles, rope_frequencies
from fused_rope.naive import apply_rope_ref
from fused_rope.rope import TileConfig, apply_rope, apply_rope_qk, rope_fwd, tile_config
from tests.helpers import DEVICE, ON_GPU, assert_close_to_baseline

gpu = pytest.mark.gpu
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, marks=gpu, id="bf16"),
]


def _angles(batch: int, seq_len: int, rope_dim: int, per_batch: bool) -> torch.Tensor:
    """fp32 angles of random positions up to 5000 (large arguments exercise sin/cos)."""
    inv_freq, _ = rope_frequencies(rope_dim)
    shape = (batch, seq_len) if per_batch else (seq_len,)
    positions = torch.randint(0, 5000, shape, device=DEVICE)
    return rope_angles(positions, inv_freq.to(DEVICE))


def _ref_and_baseline(x, angles, layout, rope_dim, scale, dy=None, factor=1.0):
    """(float64 reference, reference on x's dtype) of the output, or of dx when ``dy`` is given;
    ``factor`` is the attention factor."""
    results = []
    for xx, aa in ((x.double(), angles.double()), (x, angles)):
        xx = xx.detach().requires_grad_(dy is not None)
        y = apply_rope_ref(xx, aa, layout, rope_dim, scale, attention_factor=factor)
        if dy is None:
            results.append(y)
        else:
            (dx,) = torch.autograd.grad(y, xx, dy.to(y.dtype))
            results.append(dx)
    return results


def _check(name, out, x, angles, layout, rope_dim, scale, dy=None, factor=1.0):
    ref, baseline = _ref_and_baseline(x, angles, layout, rope_dim, scale, dy, factor)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close_to_baseline(name, out, ref, baseline)


# (B, H, N, D, rope_dim): N not a multiple of any tile; 48 pairs (D = 96) and 24 pairs
# (rope_dim = 48, with 32 pass-through channels) are not powers of two (masked lanes).
SHAPES = [
    pytest.param(2, 4, 63, 64, None, id="B2-H4-N63-D64"),
    pytest.param(1, 2, 500, 32, None, id="B1-H2-N500-D32"),
    pytest.param(2, 3, 63, 96, None, id="B2-H3-N63-D96"),
    pytest.param(2, 2, 63, 64, 32, id="B2-H2-N63-D64-R32"),
    pytest.param(1, 3, 37, 80, 48, id="B1-H3-N37-D80-R48"),
    # 24 pass-through channels: not a power of two, so the pass-through tile's mask cuts
    pytest.param(1, 3, 37, 72, 48, id="B1-H3-N37-D72-R48"),
    pytest.param(2, 32, 4096, 128, None, marks=gpu, id="B2-H32-N4096-D128"),
    pytest.param(1, 8, 16384, 128, 64, marks=gpu, id="B1-H8-N16384-D128-R64"),
]


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("B, H, N, D, R", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference(B, H, N, D, R, layout, dtype):
    x = torch.randn(B, H, N, D, device=DEVICE, dtype=dtype)
    angles = _angles(B, N, R or D, per_batch=False)
    scale = 0.125 if R else 1.0
    out = apply_rope(x, angles, layout=layout, rope_dim=R, output_scale=scale)
    _check("apply_rope", out, x, angles, layout, R, scale)


# (B, HQ, HK, N, D): GQA ratios 1, 4, 8 and a single KV head.
QK_SHAPES = [
    pytest.param(2, 4, 4, 63, 64, id="B2-HQ4-HK4-N63-D64"),
    pytest.param(1, 8, 2, 63, 32, id="B1-HQ8-HK2-N63-D32"),
    pytest.param(2, 8, 1, 70, 64, id="B2-HQ8-HK1-N70-D64"),
    pytest.param(2, 32, 8, 4096, 128, marks=gpu, id="B2-HQ32-HK8-N4096-D128"),
    pytest.param(1, 8, 8, 16384, 128, marks=gpu, id="B1-HQ8-HK8-N16384-D128"),
]


@pytest.mark.parametrize("per_batch", [False, True], ids=["shared-angles", "per-batch-angles"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("B, HQ, HK, N, D", QK_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_forward_and_backward(B, HQ, HK, N, D, layout, per_batch, dtype):
    q = torch.randn(B, HQ, N, D, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(B, HK, N, D, device=DEVICE, dtype=dtype, requires_grad=True)
    angles = _angles(B, N, D, per_batch)
    q_scale, k_scale = D**-0.5 * 1.4426950408889634, 0.75
    q_out, k_out = apply_rope_qk(q, k, angles, layout=layout, q_scale=q_scale, k_scale=k_scale)
    _check("q_out", q_out, q, angles, layout, None, q_scale)
    _check("k_out", k_out, k, angles, layout, None, k_scale)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    _check("dq", q.grad, q, angles, layout, None, q_scale, dy=dq_out)
    _check("dk", k.grad, k, angles, layout, None, k_scale, dy=dk_out)


# (B, HQ, HK, NQ, N, D, R): q's rows are k's last NQ positions (a decoding step, a chunk that
# continues a cache).
LAST_ROWS_SHAPES = [
    pytest.param(2, 4, 2, 1, 63, 64, None, id="B2-HQ4-HK2-NQ1-N63-D64"),
    pytest.param(1, 3, 1, 20, 37, 80, 48, id="B1-HQ3-HK1-NQ20-N37-D80-R48"),
    pytest.param(2, 32, 8, 1, 4096, 128, None, marks=gpu, id="B2-HQ32-HK8-NQ1-N4096-D128"),
    pytest.param(1, 8, 2, 300, 4096, 128, None, marks=gpu, id="B1-HQ8-HK2-NQ300-N4096-D128"),
]


@pytest.mark.parametrize("per_batch", [False, True], ids=["shared-angles", "per-batch-angles"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("B, HQ, HK, NQ, N, D, R", LAST_ROWS_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_queries_take_the_last_positions(B, HQ, HK, NQ, N, D, R, layout, per_batch, dtype):
    """q with fewer rows than k: its rows are rotated by the angles of k's last NQ positions,
    forward and backward; with ``inv_freq`` bitwise as with the table of positions 0..N-1."""
    q = torch.randn(B, HQ, NQ, D, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(B, HK, N, D, device=DEVICE, dtype=dtype, requires_grad=True)
    angles = _angles(B, N, R or D, per_batch)
    q_angles = angles[..., N - NQ :, :]
    q_out, k_out = apply_rope_qk(q, k, angles, layout=layout, rope_dim=R, q_scale=0.5)
    _check("q_out", q_out, q, q_angles, layout, R, 0.5)
    _check("k_out", k_out, k, angles, layout, R, 1.0)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    _check("dq", q.grad, q, q_angles, layout, R, 0.5, dy=dq_out)
    _check("dk", k.grad, k, angles, layout, R, 1.0, dy=dk_out)
    inv_freq = rope_frequencies(R or D)[0].to(DEVICE)
    table = rope_angles(torch.arange(N, device=DEVICE), inv_freq)
    by_table, by_freq = (
        apply_rope_qk(q.detach(), k.detach(), layout=layout, rope_dim=R, **rope)
        for rope in (dict(angles=table), dict(inv_freq=inv_freq))
    )
    assert all(torch.equal(a, b) for a, b in zip(by_table, by_freq, strict=True))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize(
    "B, HQ, HK, N, D, R",
    [
        pytest.param(2, 4, 2, 63, 64, None, id="B2-HQ4-HK2-N63-D64"),
        pytest.param(1, 3, 1, 37, 80, 48, id="B1-HQ3-HK1-N37-D80-R48"),
        pytest.param(2, 32, 8, 4096, 128, None, marks=gpu, id="B2-HQ32-HK8-N4096-D128"),
    ],
)
@pytest.mark.parametrize("offset", [0, 4093], ids=["from-0", "offset"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inv_freq_gives_the_angle_table_bitwise(B, HQ, HK, N, D, R, layout, dtype, offset):
    """``inv_freq=`` (angles formed in the kernel for positions ``offset..offset+N-1``) against
    the table of ``rope_angles(arange(offset, offset + N), inv_freq)``: the same fp32 angles, so
    the same bits, forward and backward, for apply_rope_qk and apply_rope."""
    inv_freq = rope_frequencies(R or D, 500.0)[0].to(DEVICE)
    table = rope_angles(torch.arange(offset, offset + N, device=DEVICE), inv_freq)
    q, k = (torch.randn(B, h, N, D, device=DEVICE, dtype=dtype) for h in (HQ, HK))
    outs, grads = [], []
    for rope in (dict(angles=table), dict(inv_freq=inv_freq, position_offset=offset)):
        qq, kk = (x.detach().requires_grad_() for x in (q, k))
        q_out, k_out = apply_rope_qk(qq, kk, layout=layout, rope_dim=R, q_scale=0.5, **rope)
        torch.autograd.backward((q_out, k_out), (q_out.detach() * 3, k_out.detach() - 1))
        x_out = apply_rope(q, layout=layout, rope_dim=R, output_scale=0.5, **rope)
        # launched without the autograd.Function (nothing recorded), and in place
        with torch.no_grad():
            q_plain, k_plain = apply_rope_qk(q, k, layout=layout, rope_dim=R, q_scale=0.5, **rope)
            x_inplace = apply_rope(q.clone(), layout=layout, rope_dim=R, output_scale=0.5,
                                   inplace=True, **rope)  # fmt: skip
        outs.append((q_out, k_out, x_out, q_plain, k_plain, x_inplace))
        grads.append((qq.grad, kk.grad))
    names = ("q_out", "k_out", "x_out", "q_plain", "k_plain", "x_inplace", "dq", "dk")
    for name, a, b in zip(names, outs[0] + grads[0], outs[1] + grads[1], strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(outs[1][3], outs[1][0]) and torch.equal(outs[1][5], outs[1][2])
    _check("x_out", outs[1][2], q, table, layout, R, 0.5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("R", [24, 32], ids=["partial", "full"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_factor_scales_the_rotated_channels_alone(R, layout, dtype):
    """YaRN's and LongRoPE's attention factor multiplies cos and sin (Hugging Face's scaled
    tables): the rotated channels, not the pass-through ones, in apply_rope (out of place and
    in place) and apply_rope_qk, forward and backward (q, k and inv_freq), against the
    reference; the rotated channels equal an output scale of the factor, the pass-through
    channels the unscaled input (with output_scale, both are scaled)."""
    B, HQ, HK, NQ, N, D, factor, offset = 2, 3, 1, 9, 21, 32, 1.2431631, 6
    q = torch.randn(B, HQ, NQ, D, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(B, HK, N, D, device=DEVICE, dtype=dtype, requires_grad=True)
    inv_freq = rope_frequencies(R, 500.0, device=DEVICE)[0].requires_grad_()
    angles = rope_angles(torch.arange(offset, offset + N, device=DEVICE), inv_freq.detach())
    rope = dict(inv_freq=inv_freq, position_offset=offset, layout=layout, rope_dim=R)
    q_out, k_out = apply_rope_qk(q, k, q_scale=0.5, attention_factor=factor, **rope)
    _check("q_out", q_out, q, angles[N - NQ :], layout, R, 0.5, factor=factor)
    _check("k_out", k_out, k, angles, layout, R, 1.0, factor=factor)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk, dinv = torch.autograd.grad((q_out, k_out), (q, k, inv_freq), (dq_out, dk_out))
    _check("dq", dq, q, angles[N - NQ :], layout, R, 0.5, dy=dq_out, factor=factor)
    _check("dk", dk, k, angles, layout, R, 1.0, dy=dk_out, factor=factor)

    def reference_dinv(cast):
        table = rope_angles(torch.arange(offset, offset + N, device=DEVICE), inv_freq)
        outs = (
            apply_rope_ref(cast(x), cast(a), layout, R, s, attention_factor=factor)
            for x, a, s in ((q, table[N - NQ :], 0.5), (k, table, 1.0))
        )
        loss = sum((o.float() * g).sum() for o, g in zip(outs, (dq_out, dk_out), strict=True))
        return torch.autograd.grad(loss, inv_freq)[0]

    if dtype == torch.float32:
        # (In half precision both errors are fp32 summation noise over ~500 terms, in orders
        # that differ; test_gradients_of_angles_and_frequencies holds those dtypes to the rule.)
        assert_close_to_baseline(
            "dinv_freq", dinv, reference_dinv(lambda x: x.double()), reference_dinv(lambda x: x)
        )
    x = k.detach()
    plain = dict(rope, inv_freq=inv_freq.detach())
    y = apply_rope(x, attention_factor=factor, **plain)
    _check("x_out", y, x, angles, layout, R, 1.0, factor=factor)
    assert torch.equal(apply_rope(x.clone(), attention_factor=factor, inplace=True, **plain), y)
    scaled = apply_rope(x, output_scale=factor, **plain)
    torch.testing.assert_close(y[..., :R], scaled[..., :R], rtol=2e-3, atol=1e-5)
    assert torch.equal(y[..., R:], x[..., R:])
    both = apply_rope(x, output_scale=0.5, attention_factor=factor, **plain)
    assert torch.equal(both[..., R:], x[..., R:] * 0.5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_partial_rotation_and_scale(layout, dtype):
    B, H, N, D, R = 2, 3, 63, 64, 32
    x = torch.randn(B, H, N, D, device=DEVICE, dtype=dtype, requires_grad=True)
    angles = _angles(B, N, R, per_batch=True)
    y = apply_rope(x, angles, layout=layout, rope_dim=R, output_scale=-1.7)
    dy = torch.randn_like(y)
    y.backward(dy)
    _check("dx", x.grad, x, angles, layout, R, -1.7, dy=dy)


@pytest.mark.parametrize(
    "cfg",
    [
        TileConfig(1, 2, 1, 1),
        TileConfig(8, 2, 4, 2),
        TileConfig(4, 8, 2, 4),
        TileConfig(4, 2, 2, 2, heads_per_program=3),
        TileConfig(2, 1, 1, 1, heads_per_program=1),
    ],
    ids=["BN1-BHQ2-BHK1", "BN8-BHQ2-BHK4", "BN4-BHQ8-BHK2", "BN4-BH2-HPP3", "BN2-BH1-HPP1"],
)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_launch_shapes_other_than_the_heuristic(cfg, layout):
    # Several head iterations with a partial last one (5 = 2 + 2 + 1 heads), as on a GPU where
    # tile_config picks small position tiles; the interpreter's own choice is one big tile.
    # Three heads a program: the chunks are q 0-2, q 3-4 with k 0, and k 1-2.
    B, HQ, HK, N, D, R = 2, 5, 3, 21, 48, 32
    q = torch.randn(B, HQ, N, D, device=DEVICE)
    k = torch.randn(B, HK, N, D, device=DEVICE)
    angles = _angles(B, N, R, per_batch=True)
    q_out, k_out = rope_fwd(q, k, angles, layout, R, 0.5, 2.0, config=cfg)
    _check("q_out", q_out, q, angles, layout, R, 0.5)
    _check("k_out", k_out, k, angles, layout, R, 2.0)
    # q alone (H_K = 0): chunks over q's heads only.
    dq, _ = rope_fwd(q_out, None, angles, layout, R, 0.5, 1.0, conjugate=True, config=cfg)
    _check("dq", dq, q, angles, layout, R, 0.5, dy=q_out)


@pytest.mark.parametrize("from_inv_freq", [False, True], ids=["angles", "inv_freq"])
def test_angle_gradient_summed_over_head_chunks(monkeypatch, from_inv_freq):
    """A launch whose programs take three heads each (q 0-2, q 3-4 with k 0, k 1-2; a GPU's
    choice for many heads, the interpreter's is one chunk) writes one angle-gradient slab a
    chunk, which the backward sums: the angles' (and inv_freq's) gradient by the 2x rule."""
    import fused_rope.rope as rope_module

    chunked = TileConfig(4, 2, 2, 2, heads_per_program=3)
    monkeypatch.setattr(rope_module, "tile_config", lambda *args: chunked)
    q, k = torch.randn(2, 5, 21, 32, device=DEVICE), torch.randn(2, 3, 21, 32, device=DEVICE)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    inv_freq = rope_frequencies(32, device=DEVICE)[0]
    angles = rope_angles(torch.randint(0, 5000, (21,), device=DEVICE), inv_freq)
    leaf = (inv_freq if from_inv_freq else angles).clone().requires_grad_()

    def grad(rotate, cast):
        x = cast(leaf).detach().requires_grad_()
        q_out, k_out = rotate(cast(q), cast(k), x)
        return torch.autograd.grad((q_out * cast(dq)).sum() + (k_out * cast(dk)).sum(), x)[0]

    def kernel(q, k, x):
        return apply_rope_qk(q, k, inv_freq=x) if from_inv_freq else apply_rope_qk(q, k, x)

    def reference(q, k, x):
        a = rope_angles(torch.arange(21, device=DEVICE), x) if from_inv_freq else x
        return apply_rope_ref(q, a), apply_rope_ref(k, a)

    same = lambda t: t
    assert_close_to_baseline(
        "d_rotation", grad(kernel, same), grad(reference, torch.Tensor.double),
        grad(reference, same),
    )  # fmt: skip


def test_tile_config_rejects_empty_tiles():
    with pytest.raises(ValueError, match="heads_per_program"):
        TileConfig(1, 1, 1, 1, heads_per_program=0)
    with pytest.raises(ValueError, match="block_n"):
        TileConfig(0, 1, 1, 1)
    with pytest.raises(ValueError, match="block_hq must be a power of 2, got 3"):
        TileConfig(4, 3, 1, 4)  # a review's find: Triton's tl.arange refused it, unnamed


@triton.jit
def _reduce_angle_kernel(X, Y, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, reduce_angle(tl.load(X + offs)))


def test_reduce_angle_is_exact_to_a_few_ulp():
    # x - 2 pi k by two FMAs (fused_rope/_trig.py) against float64, over fp32 angles up to
    # 2**24: the first FMA is exact, so the error is that of LO and of the final rounding.
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(4096, generator=gen) * 2.0**e for e in (2, 10, 20, 24)])
    x = (x * torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)).to(DEVICE)
    y = torch.empty_like(x)
    _reduce_angle_kernel[(x.numel() // 1024,)](x, y, BLOCK=1024)
    x64, y64 = x.double().cpu(), y.double().cpu()
    k = torch.round((x64 - y64) / (2 * torch.pi))  # the multiple of 2 pi the kernel removed
    assert (y64 - (x64 - k * 2 * torch.pi)).abs().max() < 2**-20
    assert y64.abs().max() < 5.0  # pi, up to the slack of k for the largest angles


@pytest.mark.parametrize("dtype", DTYPES)
def test_angles_of_a_million_radians(dtype):
    # Positions up to 2**20 with the fastest frequency 1: the kernel reduces the angle modulo
    # 2 pi before sin/cos (on a GPU the hardware's approximations for fp16/bf16, which are
    # accurate only near zero), so it must stay as accurate as at small positions.
    B, H, N, D = 2, 2, 40, 64
    x = torch.randn(B, H, N, D, device=DEVICE, dtype=dtype)
    positions = torch.randint(2**19, 2**20, (B, N), device=DEVICE)
    angles = rope_angles(positions, rope_frequencies(D)[0].to(DEVICE))
    assert angles.max() > 5e5
    _check("y", apply_rope(x, angles), x, angles, "half", None, 1.0)


def test_gradient_with_a_strided_last_dimension():
    x = torch.randn(2, 3, 40, 32, device=DEVICE, requires_grad=True)
    angles = _angles(2, 40, 32, per_batch=True)
    y = apply_rope(x, angles, layout="interleaved", output_scale=3.0)
    dy = torch.randn(2, 3, 32, 40, device=DEVICE).transpose(-1, -2)  # last-dim stride 40
    y.backward(dy)
    _check("dx", x.grad, x, angles, "interleaved", None, 3.0, dy=dy)


def test_gradient_of_an_unused_output_is_zero():
    q = torch.randn(1, 2, 33, 32, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 1, 33, 32, device=DEVICE, requires_grad=True)
    q_out, _ = apply_rope_qk(q, k, _angles(1, 33, 32, per_batch=False))
    q_out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))
    assert q.grad.abs().sum() > 0


def test_second_derivative_through_the_backward_op():
    x = torch.randn(1, 2, 17, 16, device=DEVICE, dtype=torch.float64)
    x = x.float().requires_grad_()
    angles = _angles(1, 17, 16, per_batch=False)
    y = apply_rope(x, angles, output_scale=0.5)
    dy = torch.randn_like(y, requires_grad=True)
    (dx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    # dx = 0.5 R(-a) dy is linear in dy: its gradient against w is 0.5 R(a) w.
    w = torch.randn_like(dx)
    (ddy,) = torch.autograd.grad(dx, dy, w)
    _check("d(dx)/d(dy)", ddy, w, angles, "half", None, 0.5)


def test_a_plain_backward_rotates_without_the_function(monkeypatch):
    """An eager backward that is not recorded rotates the cotangents with the launch alone
    (Function.apply's bookkeeping is host time an eager step pays per layer); a recorded one
    (create_graph=True) goes through the Function, so that it can be differentiated again
    (the test above). Either way q's and k's gradients are the reference's, scales and
    the attention factor included."""
    applied, apply = [], rope_module._RopeFunction.apply
    monkeypatch.setattr(
        rope_module._RopeFunction, "apply", lambda *a: applied.append(1) or apply(*a)
    )
    q = torch.randn(1, 4, 5, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    angles = _angles(1, 9, 12, per_batch=False)
    # the cotangents require grad: a recorded backward's gradients then do too
    dq_out, dk_out = (torch.randn_like(x, requires_grad=True) for x in (q, k))
    common = dict(layout="interleaved", rope_dim=12, attention_factor=1.5)

    def grads(q_out, k_out, create_graph=False):
        loss = (q_out * dq_out).sum() + (k_out * dk_out).sum()
        return torch.autograd.grad(loss, (q, k), create_graph=create_graph)

    q_ref = apply_rope_ref(q.double(), angles[-5:].double(), output_scale=0.5, **common)
    k_ref = apply_rope_ref(k.double(), angles.double(), output_scale=2.0, **common)
    expected = grads(q_ref, k_ref)
    for create_graph, backward_calls in ((False, 0), (True, 1)):
        out = apply_rope_qk(q, k, angles, q_scale=0.5, k_scale=2.0, **common)
        applied.clear()
        got = grads(*out, create_graph=create_graph)
        assert len(applied) == backward_calls
        for name, g, e in zip(("dq", "dk"), got, expected, strict=True):
            assert g.requires_grad == create_graph, name
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_a_forward_mode_tangent_on_a_cotangent_is_refused():
    """Forward-over-reverse (a dual cotangent in a plain backward): the kernel would drop the
    tangent, a silent zero (a review's find): refused, naming the reference."""
    x = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    angles = _angles(1, 9, 16, per_batch=False)
    y = apply_rope(x, angles)
    with torch.autograd.forward_ad.dual_level():
        dy = torch.autograd.forward_ad.make_dual(torch.randn_like(y), torch.randn_like(y))
        with pytest.raises(NotImplementedError, match="cotangent of the rotated q.*apply_rope_ref"):
            torch.autograd.grad(y, x, dy)


def test_a_tensor_subclass_anywhere_takes_the_custom_ops():
    """A tensor subclass among the tensors a call reads, the angles included, sends the
    forward and the backward through the custom ops (``runs_eagerly``): launching Triton on
    one failed ("data pointer on an invalid python storage"; reviews' finds). TwoTensor runs
    the ops on each of its two tensors, so each gives the plain result."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = torch.randn(1, 2, 9, 16, device=DEVICE)
    angles = _angles(1, 9, 16, per_batch=False)
    with torch.no_grad():
        got, want = apply_rope(x, TwoTensor(angles, angles)), apply_rope(x, angles)
    torch.testing.assert_close(got.a, want)
    torch.testing.assert_close(got.b, want)

    class FirstOfTwo(torch.autograd.Function):
        """Takes a TwoTensor's first tensor: the cotangent reaching the RoPE backward is a
        TwoTensor built from a plain one."""

        @staticmethod
        def forward(ctx, t):
            return t.a.clone()

        @staticmethod
        def backward(ctx, grad):
            return TwoTensor(grad, grad)

    dy = torch.randn_like(x)
    a_plain, a_two = (angles.clone().requires_grad_() for _ in range(2))
    (apply_rope(x, a_plain) * dy).sum().backward()
    x_two = TwoTensor(x.clone(), x.clone()).requires_grad_()
    (FirstOfTwo.apply(apply_rope(x_two, a_two)) * dy).sum().backward()
    torch.testing.assert_close(a_two.grad.a, a_plain.grad)
    torch.testing.assert_close(a_two.grad.b, a_plain.grad)


def test_transposed_input_needs_no_copy_and_keeps_its_layout():
    B, N, H, D = 2, 63, 4, 64
    buf_q = torch.randn(B, N, H, D, device=DEVICE)
    buf_k = torch.randn(B, N, 2, D, device=DEVICE)
    q, k = buf_q.transpose(1, 2), buf_k.transpose(1, 2)  # [B, H, N, D] views, not contiguous
    angles = _angles(B, N, D, per_batch=True)
    q_out, k_out = apply_rope_qk(q, k, angles, layout="interleaved")
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    _check("q_out", q_out, q, angles, "interleaved", None, 1.0)
    _check("k_out", k_out, k, angles, "interleaved", None, 1.0)


def test_strided_slices_of_a_fused_qkv_buffer():
    B, N, H, D = 2, 50, 3, 32
    qkv = torch.randn(B, N, 3, H, D + 8, device=DEVICE)[..., 4 : 4 + D]  # padded rows
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    angles = _angles(B, N, D, per_batch=False).expand(B, N, D // 2)  # stride-0 batch
    q_out, k_out = apply_rope_qk(q, k, angles)
    _check("q_out", q_out, q, angles, "half", None, 1.0)
    _check("k_out", k_out, k, angles, "half", None, 1.0)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("R", [None, 32], ids=["full", "partial"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_inplace_rotates_the_storage(layout, R, scale):
    B, N, H, D = 2, 63, 3, 64
    buf = torch.randn(B, N, H, D, device=DEVICE, dtype=torch.float16)
    x = buf.transpose(1, 2)
    original = x.clone()
    angles = _angles(B, N, R or D, per_batch=True)
    version = x._version
    out = apply_rope(x, angles, layout=layout, rope_dim=R, output_scale=scale, inplace=True)
    assert out is x and x._version > version
    _check("inplace", buf.transpose(1, 2), original, angles, layout, R, scale)
    expected = apply_rope(original, angles, layout=layout, rope_dim=R, output_scale=scale)
    assert torch.equal(x, expected)


def test_inplace_refuses_when_autograd_needs_the_input():
    angles = _angles(1, 9, 16, per_batch=False)
    leaf = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="inplace=True overwrites x.*a leaf"):
        apply_rope(leaf, angles, inplace=True)
    with pytest.raises(ValueError, match="inplace=True overwrites x.*part of a graph"):
        apply_rope(leaf * 2, angles, inplace=True)
    with pytest.raises(ValueError, match="broadcast"):
        apply_rope(
            torch.randn(1, 1, 9, 16, device=DEVICE).expand(1, 2, 9, 16), angles, inplace=True
        )
    with torch.no_grad():  # no graph is recorded: allowed, even on a leaf
        expected = apply_rope(leaf, angles)
        assert apply_rope(leaf, angles, inplace=True) is leaf
    assert torch.equal(leaf.detach(), expected)


def test_inplace_refuses_targets_it_cannot_write_safely():
    """Rows that overlap in memory (each row's second half is the next row's first) and an
    inference tensor outside inference mode (PyTorch's own in-place ops refuse it); a slice
    of a qkv buffer (not dense, but no element shared) is written."""
    angles = _angles(1, 9, 16, per_batch=False)
    base = torch.randn(9 * 8 + 8, device=DEVICE)
    overlapping = base.as_strided((1, 1, 9, 16), (0, 0, 8, 1))
    with pytest.raises(ValueError, match="do not share memory"):
        apply_rope(overlapping, angles, inplace=True)
    with torch.inference_mode():
        frozen = torch.randn(1, 2, 9, 16, device=DEVICE)
    with pytest.raises(ValueError, match="inference tensor outside"):
        apply_rope(frozen, angles, inplace=True)
    with torch.inference_mode():
        expected = apply_rope(frozen, angles)
        assert torch.equal(apply_rope(frozen, angles, inplace=True), expected)
    qkv = torch.randn(1, 9, 3 * 2, 16, device=DEVICE)
    k = qkv[:, :, 2:4].transpose(1, 2)
    expected = apply_rope(k, angles)
    apply_rope(k, angles, inplace=True)
    assert torch.equal(qkv[:, :, 2:4].transpose(1, 2), expected)


def test_inplace_write_is_seen_by_autograd_of_other_ops():
    # x needs no grad itself, but w * x saved it for dw: the version bump makes autograd refuse.
    w = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    x = torch.randn(1, 2, 9, 16, device=DEVICE)
    y = (w * x).sum()
    apply_rope(x, _angles(1, 9, 16, per_batch=False), inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("source", ["shared", "batch", "inv_freq"])
@pytest.mark.parametrize("with_k", [False, True], ids=["q", "qk"])
def test_gradients_of_angles_and_frequencies(with_k, source, layout, dtype):
    """``angles`` (shared by the batch or per batch) and ``inv_freq`` (positions from an
    offset) get the reference's gradients: ``pair_cross`` of the inputs and the backward's
    gradients, summed over the heads, q's rows into k's last ones, and the batch for a shared
    table; the flash-attention rule against the reference in the inputs' dtype."""
    B, HQ, HK, NQ, N, D, R, offset = 2, 3, 2, 7, 12, 32, 24, 5
    q = torch.randn(B, HQ, NQ if with_k else N, D, device=DEVICE, dtype=dtype)
    k = torch.randn(B, HK, N, D, device=DEVICE, dtype=dtype) if with_k else None
    inv_freq = rope_frequencies(R, 500.0, device=DEVICE)[0]
    if source == "inv_freq":
        leaf = inv_freq.requires_grad_()
        table = lambda: rope_angles(torch.arange(offset, offset + N, device=DEVICE), leaf)
        kw = dict(inv_freq=leaf, position_offset=offset)
    else:
        leaf = _angles(B, N, R, per_batch=source == "batch").requires_grad_()
        table, kw = lambda: leaf, dict(angles=leaf)
    dq_out = torch.randn(q.shape, device=DEVICE, dtype=dtype)
    dk_out = None if k is None else torch.randn(k.shape, device=DEVICE, dtype=dtype)
    common = dict(layout=layout, rope_dim=R)

    def loss(q_out, k_out):
        k_term = 0.0 if k is None else (k_out.float() * dk_out).sum()
        return (q_out.float() * dq_out).sum() + k_term

    def reference(cast):
        angles = table()
        q_out = apply_rope_ref(cast(q), cast(angles)[..., N - q.shape[2] :, :], output_scale=0.5,
                               **common)  # fmt: skip
        k_out = None if k is None else apply_rope_ref(cast(k), cast(angles), **common)
        return torch.autograd.grad(loss(q_out, k_out), leaf)[0]

    if k is None:
        out = apply_rope(q, output_scale=0.5, **common, **kw), None
    else:
        out = apply_rope_qk(q, k, q_scale=0.5, **common, **kw)
    grad = torch.autograd.grad(loss(*out), leaf)[0]
    assert grad.shape == leaf.shape and grad.dtype == torch.float32
    ref = reference(lambda x: x.double())
    assert_close_to_baseline(f"d{source}", grad, ref, reference(lambda x: x))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_angle_gradients_of_the_kernel_and_of_a_recorded_backward_agree(layout):
    """A plain backward takes the angles' gradient from the RoPE kernel; a backward that is
    itself recorded (``create_graph=True``) forms it in PyTorch, differentiably. Both agree,
    and the second derivative (through q) is the float64 reference's, by the 2x rule against
    the reference in fp32."""
    q = torch.randn(2, 3, 7, 32, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 12, 32, device=DEVICE, requires_grad=True)
    angles = _angles(2, 12, 24, per_batch=False).requires_grad_()
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    common = dict(layout=layout, rope_dim=24)
    kernel = lambda q, k, a: apply_rope_qk(q, k, a, q_scale=0.5, **common)
    reference = lambda q, k, a: (
        apply_rope_ref(q, a[-q.shape[2] :], output_scale=0.5, **common),
        apply_rope_ref(k, a, **common),
    )  # fmt: skip

    def angles_grad(rotate, q, k, angles, create_graph):
        q_out, k_out = rotate(q, k, angles)
        loss = (q_out * dq_out).sum() + (k_out * dk_out).sum()
        return torch.autograd.grad(loss, angles, create_graph=create_graph)[0]

    plain = angles_grad(kernel, q, k, angles, False)
    recorded = angles_grad(kernel, q, k, angles, True)
    assert recorded.requires_grad and not plain.requires_grad
    torch.testing.assert_close(plain, recorded.detach(), atol=1e-5, rtol=1e-5)
    second = lambda rotate, q, k, a: torch.autograd.grad(
        angles_grad(rotate, q, k, a, True).square().sum(), q
    )[0]  # fmt: skip
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    assert_close_to_baseline(
        "d2", second(kernel, q, k, angles), second(reference, q64, k64, angles.double()),
        second(reference, q, k, angles),
    )  # fmt: skip


@pytest.mark.parametrize("cotangent", ["sum", "strided"])
def test_double_backward_through_cotangents_of_any_strides(cotangent):
    """The first backward rotates the cotangent as it comes: ``y.sum()``'s is expanded (every
    stride 0), a slice's has a last stride of 2. Its own backward, which forms the angles'
    gradient from that cotangent in the kernel, takes it densely (it read past it before)."""
    x = torch.randn(2, 3, 5, 16, device=DEVICE, requires_grad=True)
    angles = _angles(1, 5, 16, per_batch=False).requires_grad_()
    v = torch.randn(2, 3, 5, 16, device=DEVICE)
    g = torch.randn(2, 3, 5, 32, device=DEVICE)[..., ::2] if cotangent == "strided" else None

    def second(rotate, x, a):
        y = rotate(x, a)
        if g is None:
            dx = torch.autograd.grad(y.sum(), x, create_graph=True)[0]
        else:  # the cotangent as given, strides included
            dx = torch.autograd.grad(y, x, g.to(y.dtype), create_graph=True)[0]
        return torch.autograd.grad((dx * v.to(dx.dtype)).sum(), a)[0]

    x64, a64 = (t.detach().double().requires_grad_() for t in (x, angles))
    assert_close_to_baseline(
        "d_angles", second(apply_rope, x, angles), second(apply_rope_ref, x64, a64),
        second(apply_rope_ref, x, angles),
    )  # fmt: skip


def test_inplace_rotation_refuses_angles_that_require_grad():
    x = torch.randn(1, 2, 9, 16, device=DEVICE)
    angles = _angles(1, 9, 16, per_batch=False).requires_grad_()
    with pytest.raises(ValueError, match="inplace=True has no backward, but angles requires"):
        apply_rope(x, angles, inplace=True)
    inv_freq = rope_frequencies(16, device=DEVICE)[0].requires_grad_()
    with pytest.raises(ValueError, match="inplace=True has no backward, but inv_freq requires"):
        apply_rope(x, inv_freq=inv_freq, inplace=True)
    with torch.no_grad():
        assert torch.equal(apply_rope(x.clone(), angles, inplace=True), apply_rope(x, angles))


def test_angle_tables_of_any_strides_are_read_as_such():
    """A column slice of a wider table (row stride 16, not 8) and a transposed table (column
    stride 9) give the reference's rotation of those angles."""
    x = torch.randn(1, 2, 9, 16, device=DEVICE)
    wide = rope_angles(torch.arange(9, device=DEVICE), rope_frequencies(32)[0].to(DEVICE))
    transposed = torch.randn(8, 9, device=DEVICE).T
    for angles in (wide[:, :8], transposed):
        ref = apply_rope_ref(x.double(), angles.double(), "half", 16)
        torch.testing.assert_close(apply_rope(x, angles).double(), ref, atol=1e-5, rtol=0)


def test_angle_rows_past_int32_offsets_are_read_where_they_are():
    """A table whose rows lie 2**31 elements and more from its start (row stride 2**30; 16 GiB of
    address space, a few pages touched): the kernel's row offsets are int64. In int32 the last
    row wrapped around to the 7s stored 2**32 elements before it."""
    try:  # a storage, not torch.empty, which the suite fills with NaN (16 GiB touched)
        store = torch.UntypedStorage((2**32 + 8) * 4, device=DEVICE)
    except (RuntimeError, MemoryError) as error:  # strict overcommit, or a small GPU
        pytest.skip(f"16 GiB of address space refused: {error}")

    def view(offset, size, stride):
        return torch.empty(0, device=DEVICE).set_(store, offset, size, stride)

    view(0, (4,), (1,)).fill_(7.0)
    angles = view(2**31, (3, 4), (2**30, 1))
    angles.copy_(torch.rand(3, 4, device=DEVICE) * 6)
    x = torch.randn(1, 2, 3, 8, device=DEVICE)
    ref = apply_rope_ref(x.double(), angles.double(), "half", 8)
    torch.testing.assert_close(apply_rope(x, angles).double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope", ["table", "per_batch", "inv_freq"])
def test_batches_past_a_grid_axis_launch_in_slices(monkeypatch, rope):
    """More batches than CUDA's grid takes on its third axis (65535; 2 here): a launch per
    slice of them, whose outputs and gradients (q's, k's, the angles' or inv_freq's) are the
    one launch's, bitwise."""
    import fused_rope.rope as rope_module

    q = torch.randn(5, 2, 7, 16, device=DEVICE)
    k = torch.randn(5, 1, 9, 16, device=DEVICE)
    inv_freq = rope_frequencies(12)[0].to(DEVICE)
    table = _angles(5, 9, 12, per_batch=rope == "per_batch")
    results = []
    for max_batch in (65535, 2):
        monkeypatch.setattr(rope_module, "MAX_GRID_AXIS2", max_batch)
        qq, kk = (x.clone().requires_grad_() for x in (q, k))
        given = (inv_freq if rope == "inv_freq" else table).clone().requires_grad_()
        kw = dict(inv_freq=given, position_offset=3) if rope == "inv_freq" else dict(angles=given)
        q_out, k_out = apply_rope_qk(qq, kk, rope_dim=12, q_scale=0.5, **kw)
        torch.autograd.backward((q_out, k_out), (torch.ones_like(q_out), k_out.detach()))
        results.append((q_out, k_out, qq.grad, kk.grad, given.grad))
    for name, a, b in zip(("q_out", "k_out", "dq", "dk", "dangles"), *results, strict=True):
        assert torch.equal(a, b), name


def test_angles_of_batch_one_are_shared_by_the_batch():
    """Angles ``[1, N, R/2]`` rotate every batch as ``[N, R/2]`` do (kernel and reference):
    outputs and gradients bitwise equal, the angles' gradient summed into ``[1, N, R/2]``."""
    q = torch.randn(3, 2, 7, 16, device=DEVICE)
    k = torch.randn(3, 1, 9, 16, device=DEVICE)
    table = _angles(3, 9, 12, per_batch=False)
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    results = []
    for angles in (table, table[None]):
        qq, kk, aa = (x.clone().requires_grad_() for x in (q, k, angles))
        q_out, k_out = apply_rope_qk(qq, kk, aa, rope_dim=12, q_scale=0.5)
        torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
        ref = apply_rope_ref(k, aa.detach(), rope_dim=12)
        results.append((q_out, k_out, qq.grad, kk.grad, aa.grad.reshape(table.shape), ref))
    for name, a, b in zip(("q_out", "k_out", "dq", "dk", "dangles", "ref"), *results, strict=True):
        assert torch.equal(a, b), name


def test_position_offset_takes_numpy_ints():
    x = torch.randn(1, 2, 5, 16, device=DEVICE)
    inv_freq = rope_frequencies(16)[0].to(DEVICE)
    expected = apply_rope(x, inv_freq=inv_freq, position_offset=4)
    assert torch.equal(apply_rope(x, inv_freq=inv_freq, position_offset=np.int64(4)), expected)


def test_custom_ops_pass_torch_library_opcheck():
    x = torch.randn(1, 2, 9, 16, device=DEVICE)
    k = torch.randn(1, 1, 9, 16, device=DEVICE)
    angles = _angles(1, 9, 16, per_batch=False)
    ops = torch.ops.fused_rope
    # (..., scale(s), rotary_scale, conjugate, offset)
    torch.library.opcheck(ops.rope, (x.requires_grad_(), angles, "half", 16, 0.5, 1.0, False, 0))
    torch.library.opcheck(
        ops.rope_qk, (x, k.requires_grad_(), angles, "interleaved", 16, 2.0, 1.0, 1.0, False, 0)
    )
    torch.library.opcheck(ops.rope_, (x.detach().clone(), angles, "half", 16, 0.5, 1.3, 0))
    # q of fewer rows than k: its rows are k's last positions
    torch.library.opcheck(
        ops.rope_qk, (x[:, :, 5:], k, angles[:, :4], "half", 8, 2.0, 1.0, 1.3, False, 0)
    )
    # Gradients reach the ops with any strides: fake and real outputs must agree on them.
    strided = torch.randn(1, 2, 16, 9, device=DEVICE).transpose(-1, -2).requires_grad_()
    torch.library.opcheck(ops.rope, (strided, angles, "interleaved", 16, 0.5, 1.0, True, 0))
    # inv_freq with the positions from an offset
    inv_freq = rope_frequencies(16)[0].to(DEVICE)
    torch.library.opcheck(ops.rope_qk, (x, k, inv_freq, "half", 16, 2.0, 1.0, 1.0, False, 7))
    torch.library.opcheck(ops.rope, (x, inv_freq, "interleaved", 16, 0.5, 1.0, False, 7))
    # angles and frequencies that need a gradient: q and k are saved for it
    torch.library.opcheck(
        ops.rope_qk, (x, k, angles.requires_grad_(), "half", 16, 2.0, 1.0, 1.3, False, 0)
    )
    torch.library.opcheck(ops.rope, (x, inv_freq.requires_grad_(), "half", 16, 0.5, 1.0, True, 7))


def _compile_case(dtype):
    B, HQ, HK, N, D = (2, 8, 2, 500, 64) if DEVICE == "cuda" else (1, 2, 1, 40, 32)
    q = torch.randn(B, HQ, N, D, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(B, HK, N, D, device=DEVICE, dtype=dtype, requires_grad=True)
    angles = _angles(B, N, D, per_batch=False)
    inv_freq = rope_frequencies(D)[0].to(DEVICE)

    def fn(q, k, angles):
        q_out, k_out = apply_rope_qk(q, k, angles, q_scale=0.3)
        partial = angles[:, : D // 4]  # a strided view of the angles: first R/2 frequencies
        single = apply_rope(k_out * 2, partial, layout="interleaved", rope_dim=D // 2)
        # positions from an offset (a decoding step's), formed in the kernel, through both
        # ops; linear terms, so that their gradients (conjugate rotations of ones) are not
        # rounded in between
        shifted = apply_rope(q, inv_freq=inv_freq, position_offset=N + 3)
        sq, sk = apply_rope_qk(
            q, k, inv_freq=inv_freq, position_offset=2 * N + 5, k_scale=0.7, attention_factor=1.2
        )
        total = q_out.float().square().sum() + single.float().sum()
        return (total + shifted.float().sum() + sq.float().sum() - sk.float().sum()) * 1.5

    return fn, (q, k, angles)


def _check_compiled(backend, dtype, dynamic=None):
    torch._dynamo.reset()
    fn, args = _compile_case(dtype)
    q, k, _ = args
    eager = fn(*args)
    dq, dk = torch.autograd.grad(eager, (q, k))
    # fullgraph: fails on a graph break
    compiled = torch.compile(fn, fullgraph=True, backend=backend, dynamic=dynamic)(*args)
    cdq, cdk = torch.autograd.grad(compiled, (q, k))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)
    torch.testing.assert_close(cdq, dq, rtol=tol, atol=tol)
    torch.testing.assert_close(cdk, dk, rtol=tol, atol=tol)


@pytest.mark.parametrize("dynamic", [None, True])
def test_fullgraph_trace_without_inductor(dynamic):
    """Dynamo + AOTAutograd trace through the custom ops (fake and autograd registrations),
    also with symbolic sizes and float arguments (dynamic=True)."""
    _check_compiled("aot_eager", torch.float32, dynamic)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_compile_fullgraph_inductor(dtype):
    _check_compiled("inductor", dtype)


@gpu
def test_inductor_launches_the_qk_rotation_itself():
    """Under Inductor the q, k rotation is no opaque op call: ``rope_qk`` is a triton_op, so
    the generated code of the forward and of the backward launches the Triton kernel itself,
    without the op's Python dispatch and Triton's launcher, host time a compiled RoPE model's
    step paid per layer (``lm/README.md``). Values as in eager to bf16's rounding: Inductor
    compiles the kernel with options of its own (on an H200, 26 of 307200 elements one ulp
    apart)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    inv_freq = rope_frequencies(64)[0].to(DEVICE)
    q = torch.randn(2, 8, 300, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 300, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    cotangents = torch.randn_like(q), torch.randn_like(k)

    def rotate(q, k):
        return apply_rope_qk(q, k, inv_freq=inv_freq, attention_factor=1.1)

    def run(rotate):
        out = rotate(q, k)
        return torch.autograd.grad(out, (q, k), cotangents), out

    (grads, outs), codes = run_and_get_code(run, torch.compile(rotate, fullgraph=True))
    eager_grads, eager_outs = run(rotate)
    code = "\n".join(codes)
    assert code.count("_rope_kernel") >= 2 and "fused_rope.rope_qk" not in code
    for got, expected in zip((*outs, *grads), (*eager_outs, *eager_grads), strict=True):
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0)


@pytest.mark.parametrize(
    "backend, dynamic",
    [("aot_eager", None), ("aot_eager", True), pytest.param("inductor", None, marks=gpu)],
)
def test_inplace_under_torch_compile(backend, dynamic):
    """In place under compile, with symbolic sizes and strides too (``may_overlap``)."""
    torch._dynamo.reset()
    dtype = torch.bfloat16 if backend == "inductor" else torch.float32
    angles = _angles(2, 50, 32, per_batch=False)

    inv_freq = rope_frequencies(32)[0].to(DEVICE)

    def fn(x, y):
        apply_rope(x, angles, output_scale=0.5, inplace=True)
        apply_rope(y, inv_freq=inv_freq, position_offset=77, inplace=True)
        return x * 1

    x = torch.randn(2, 3, 50, 32, device=DEVICE, dtype=dtype)
    y = torch.randn_like(x)
    expected = apply_rope(x.clone(), angles, output_scale=0.5)
    expected_y = apply_rope(y.clone(), inv_freq=inv_freq, position_offset=77)
    with torch.no_grad():
        out = torch.compile(fn, fullgraph=True, backend=backend, dynamic=dynamic)(x, y)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    torch.testing.assert_close(y, expected_y, rtol=0, atol=0)


def test_position_offset_under_compile_follows_its_value():
    """A compiled graph takes the offset as a value (dynamic: one graph for every offset, as a
    decoding loop needs), forward and backward."""
    torch._dynamo.reset()
    inv_freq = rope_frequencies(32)[0].to(DEVICE)
    q = torch.randn(1, 2, 3, 32, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 1, 5, 32, device=DEVICE)

    def fn(q, k, offset):
        q_out, k_out = apply_rope_qk(q, k, inv_freq=inv_freq, position_offset=offset)
        return q_out.square().sum() + k_out.sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for offset in (7, 1000, 31):
        eager = fn(q, k, offset)
        (dq,) = torch.autograd.grad(eager, q)
        got = compiled(q, k, offset)
        (cdq,) = torch.autograd.grad(got, q)
        torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(cdq, dq, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(fn(q, k, 7), fn(q, k, 31))  # the offset changes the result


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no-grad"])
def test_forward_mode_tangents_are_refused(grad_mode):
    """The kernels have no forward-mode derivative: a tangent (forward_ad, torch.func.jvp) is
    refused by name, never dropped, with grad mode on or off."""
    from torch.autograd import forward_ad

    inv_freq = rope_frequencies(16)[0].to(DEVICE)
    x = torch.randn(1, 2, 4, 16, device=DEVICE)
    with torch.set_grad_enabled(grad_mode), forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="k carries a forward-mode tangent"):
            apply_rope_qk(x, dual, inv_freq=inv_freq, position_offset=3)
        with pytest.raises(NotImplementedError, match="x carries a forward-mode tangent"):
            apply_rope(dual, inv_freq=inv_freq)
        # the frequencies or angles, constants to the kernels, would lose theirs too
        w = forward_ad.make_dual(inv_freq, torch.ones_like(inv_freq))
        with pytest.raises(NotImplementedError, match="inv_freq carries a forward-mode"):
            apply_rope(x, inv_freq=w)
        angles = rope_angles(torch.arange(4, device=DEVICE), w)
        with pytest.raises(NotImplementedError, match="angles carries a forward-mode"):
            apply_rope_qk(x, x, angles)
    with pytest.raises(NotImplementedError, match="forward-mode tangent.*apply_rope_ref"):
        torch.func.jvp(lambda t: apply_rope(t, inv_freq=inv_freq), (x,), (torch.ones_like(x),))


def test_numpy_scalars_are_numbers():
    """numpy ints and floats pass where Python's do (as numbers.Integral / numbers.Real)."""
    inv, _ = rope_frequencies(np.int64(16))
    torch.testing.assert_close(inv, rope_frequencies(16)[0])
    x = _x(1, 2, 3, 16)
    angles = rope_angles(torch.arange(3, device=DEVICE), inv.to(DEVICE))
    torch.testing.assert_close(
        apply_rope(x, angles, output_scale=np.float32(2.0)), apply_rope(x, angles, output_scale=2.0)
    )


def test_torch_func_grad_and_vjp():
    """torch.func.grad and vjp reach the kernels through the autograd.Function (forward and
    setup_context apart, as functorch requires) and match the reference's gradients; vmap has
    no rule and is refused by PyTorch, not run wrongly."""
    inv_freq = rope_frequencies(16)[0].to(DEVICE)
    angles = rope_angles(torch.arange(3, 8, device=DEVICE), inv_freq)
    q, k = _x(2, 4, 5, 16), _x(2, 2, 5, 16)
    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def loss(fn):
        return lambda q, k: sum((a * b).sum() for a, b in zip(fn(q, k), (dq, dk), strict=True))

    kernel = lambda q, k: apply_rope_qk(q, k, inv_freq=inv_freq, position_offset=3)
    ref = lambda q, k: (apply_rope_ref(q, angles), apply_rope_ref(k, angles))
    got = torch.func.grad(loss(kernel), argnums=(0, 1))(q, k)
    want = torch.func.grad(loss(ref), argnums=(0, 1))(q, k)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    out, vjp_fn = torch.func.vjp(lambda x: apply_rope(x, angles), q)
    torch.testing.assert_close(out, apply_rope_ref(q, angles), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vjp_fn(dq)[0], want[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="vmap"):
        torch.func.vmap(lambda x: apply_rope(x, angles))(q[None])


# --------------------------------------------------------------------------------------------
# Validation: every bad input gets ValueError/TypeError naming the argument.
# --------------------------------------------------------------------------------------------


def _x(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, device=device).to(dtype)


A = lambda n=8, half=8, device=DEVICE, **kw: torch.zeros(n, half, device=device, **kw)  # [N, R/2]
BAD_INPUTS = [
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), rope_dim=7), ValueError,
                 "rope_dim must be even.*got 7", id="odd-rope-dim"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), rope_dim=18), ValueError,
                 "rope_dim .*at most the head dim 16, got 18", id="rope-dim-too-large"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 15), A(half=7)), ValueError,
                 r"head dim .* must be even .*\(rope_dim=None\), got 15", id="odd-head-dim"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), rope_dim=8.0), TypeError,
                 "rope_dim must be an int", id="float-rope-dim"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(n=9)), ValueError,
                 "angles has 9 positions but the input has N=8", id="angles-wrong-N"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(half=4)), ValueError,
                 "angles has last dimension 4, expected rope_dim // 2 = 8", id="angles-wrong-R"),
    pytest.param(lambda: apply_rope(_x(2, 2, 8, 16), torch.zeros(3, 8, 8, device=DEVICE)),
                 ValueError, "angles has batch 3 but the input has B=2", id="angles-wrong-B"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(dtype=torch.float16)), TypeError,
                 "angles must be float32.*got torch.float16", id="angles-fp16"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), torch.zeros(8, 8, dtype=torch.int64,
                 device=DEVICE)), TypeError, "angles must be a floating-point tensor",
                 id="angles-int"),
    pytest.param(lambda: apply_rope(torch.ones(1, 2, 8, 16, dtype=torch.int32, device=DEVICE),
                 A()), TypeError, "x must be a floating-point tensor, got dtype torch.int32",
                 id="x-int"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16, dtype=torch.float64), A()), TypeError,
                 "x must have dtype in .*got torch.float64", id="x-fp64"),
    pytest.param(lambda: apply_rope(_x(2, 8, 16), A()), ValueError,
                 "x must have 4 dimensions, got shape \\(2, 8, 16\\)", id="x-3d"),
    pytest.param(lambda: apply_rope([[1.0]], A()), TypeError,
                 "x must be a torch.Tensor, got list", id="x-list"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), layout="neox"), ValueError,
                 "layout must be one of .*got 'neox'", id="unknown-layout"),
    pytest.param(lambda: apply_rope(_x(1, 2, 16, 8).transpose(-1, -2), A()), ValueError,
                 "x must have a contiguous last dimension", id="x-last-dim-strided"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(device="meta")), ValueError,
                 "angles is on meta but x is on", id="different-devices"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), output_scale="2"), TypeError,
                 "output_scale must be a float, got str", id="scale-str"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), output_scale=float("nan")),
                 ValueError, "output_scale must be finite", id="scale-nan"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), attention_factor=True), TypeError,
                 "attention_factor must be a float, got bool", id="factor-bool"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), attention_factor=1e39), ValueError,
                 "attention_factor must be finite, of magnitude below 3.40282e", id="factor-fp32"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 1, 8, 16), A(),
                                       attention_factor=float("nan")),
                 ValueError, "attention_factor must be finite", id="qk-factor-nan"),
    # 0 erased the rotated channels; a negative factor cancels in attention (a review's find)
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), attention_factor=0.0), ValueError,
                 "attention_factor must be positive, got 0.0", id="factor-zero"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 1, 8, 16), A(),
                                       attention_factor=-1.0),
                 ValueError, "attention_factor must be positive, got -1.0", id="qk-factor-neg"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), inplace=1), TypeError,
                 "inplace must be a bool, got int", id="inplace-int"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(2, 2, 8, 16), A()), ValueError,
                 "k must match q in batch and head dim", id="qk-different-B"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 9, 16), _x(1, 2, 8, 16), A()), ValueError,
                 "at least q's length .*\\(1, 2, 8, 16\\)", id="qk-q-longer-than-k"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 2, 8, 32), A()), ValueError,
                 "k must match q", id="qk-different-D"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 2, 8, 16, dtype=torch.float16),
                 A()), TypeError, "k must have q's dtype torch.float32, got torch.float16",
                 id="qk-different-dtype"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 2, 8, 16, device="meta"), A()),
                 ValueError, "k is on meta but q is on", id="qk-different-devices"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 2, 8, 16), A(), k_scale=None),
                 TypeError, "k_scale must be a float, got NoneType", id="k-scale-none"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16)), ValueError,
                 "pass exactly one of angles and inv_freq, got neither", id="no-angles"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 2, 8, 16), A(),
                 inv_freq=torch.ones(8, device=DEVICE)), ValueError,
                 "exactly one of angles and inv_freq, got both", id="angles-and-inv-freq"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), inv_freq=torch.ones(4, device=DEVICE)),
                 ValueError, "inv_freq must have rope_dim // 2 = 8 entries, got 4",
                 id="inv-freq-wrong-R"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), inv_freq=torch.ones(1, 8, device=DEVICE)),
                 ValueError, "inv_freq must have 1 dimension", id="inv-freq-2d"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), inv_freq=torch.ones(8, device=DEVICE,
                 dtype=torch.float64)), TypeError, "inv_freq must be float32.*torch.float64",
                 id="inv-freq-fp64"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), inv_freq=torch.ones(8, device="meta")),
                 ValueError, "inv_freq is on meta but x is on", id="inv-freq-other-device"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), inv_freq=torch.ones(8, device=DEVICE),
                 position_offset=2.0), TypeError, "position_offset must be an int, got float",
                 id="offset-float"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 2, 8, 16),
                 inv_freq=torch.ones(8, device=DEVICE), position_offset=True), TypeError,
                 "position_offset must be an int, got bool", id="offset-bool"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), inv_freq=torch.ones(8, device=DEVICE),
                 position_offset=-1), ValueError, "position_offset must be >= 0.*got -1",
                 id="offset-negative"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 2, 8, 16),
                 inv_freq=torch.ones(8, device=DEVICE), position_offset=2**24 - 7), ValueError,
                 "position_offset \\+ N <= 2\\*\\*24.*got 16777209 with N=8",
                 id="offset-past-fp32-positions"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), output_scale=float("inf")), ValueError,
                 "output_scale", id="scale-inf"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), torch.zeros(8, 0, device=DEVICE),
                 rope_dim=0), ValueError, "rope_dim", id="rope-dim-zero"),
    pytest.param(lambda: apply_rope(_x(1, 2, 8, 16), A(), position_offset=3), ValueError,
                 "with an angle table, pass the table's rows", id="offset-with-angles"),
    pytest.param(lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 2, 8, 16), A(),
                 position_offset=2**30), ValueError, "position_offset shifts inv_freq's",
                 id="qk-offset-with-angles"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, match", BAD_INPUTS)
def test_bad_input_is_named_in_the_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("qk", [False, True])
def test_angles_backward_under_non_reentrant_checkpointing(qk):
    """torch.utils.checkpoint(use_reentrant=False) lets each saved tensor be unpacked once:
    the backward of learned angles unpacked them twice and failed (a review's find). The
    checkpointed gradients are the plain ones."""
    leaves = [_x(1, 2, 8, 16).requires_grad_(), _x(1, 1, 8, 16).requires_grad_(),
              torch.randn(8, 8, device=DEVICE, requires_grad=True)]  # fmt: skip
    f = lambda q, k, a: (
        sum(o.sum() for o in apply_rope_qk(q, k, a)) if qk else apply_rope(q, a).sum() + k.sum()
    )
    plain = torch.autograd.grad(f(*leaves), leaves)
    ckpt = torch.autograd.grad(checkpoint(f, *leaves, use_reentrant=False), leaves)
    assert all(torch.equal(a, b) for a, b in zip(ckpt, plain, strict=True))


def test_non_finite_angles_are_refused_on_the_cpu():
    """As positions and inv_freq are (a review's find: angles alone gave NaN outputs); on a
    GPU not read back (the check would wait for the device): NaN reaches the outputs."""
    angles = A()
    angles[3, 2] = float("nan")
    for call in (
        lambda: apply_rope(_x(1, 2, 8, 16), angles),
        lambda: apply_rope_qk(_x(1, 2, 8, 16), _x(1, 1, 8, 16), angles)[1],
    ):
        if ON_GPU:
            assert call()[:, :, 3].isnan().any()
        else:
            with pytest.raises(ValueError, match="angles must be finite, got nan"):
                call()


def test_cpu_tensor_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="x is on cpu: the Triton kernels need a CUDA tensor"):
        apply_rope(x, torch.zeros(8, 8))
    with pytest.raises(ValueError, match="q is on cpu"):
        apply_rope_qk(x, x, torch.zeros(8, 8))


@pytest.mark.parametrize(
    "triton_version, numpy_version, blocked",
    [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.0rc1", False),
     ("3.9.0", "2.5.1", False), ("3.5.1", "2.4.0", True), ("3.6.0+git1a2b", "1.26.4", False)],
)  # fmt: skip
def test_interpreter_blocker_names_the_broken_pair(triton_version, numpy_version, blocked):
    reason = interpreter_blocker(triton_version, numpy_version)
    assert (reason is not None) == blocked
    if blocked:
        assert triton_version in reason and numpy_version in reason and "numpy<2.4" in reason


@pytest.mark.parametrize(
    "value", ["1", "true", "TRUE", "on", "yes", "y", "0", "off", "no", "", "2"]
)
def test_interpreting_reads_the_variable_as_triton_does(value, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() == triton.knobs.runtime.interpret


def test_cpu_tensor_with_a_broken_interpreter_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.4.0")
    with pytest.raises(RuntimeError, match=r"x is on the CPU.*install 'numpy<2.4'"):
        check_kernel_device(torch.device("cpu"), "x")


def test_interpreter_switched_on_after_import_is_named(monkeypatch):
    """A review's find: TRITON_INTERPRET=1 set after the kernels were imported (Triton reads it
    at import) made Triton fail with "0 active drivers"."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_rope._validation, "_INTERPRETING_AT_IMPORT", False)
    monkeypatch.setattr(fused_rope._validation, "interpreter_blocker", lambda: None)
    with pytest.raises(RuntimeError, match="set after the kernels were imported"):
        check_kernel_device(torch.device("cpu"), "x")


def test_empty_inputs():
    angles = torch.zeros(0, 8, device=DEVICE)
    assert apply_rope(torch.randn(2, 3, 0, 16, device=DEVICE), angles).shape == (2, 3, 0, 16)
    q = torch.randn(0, 3, 5, 16, device=DEVICE)
    q_out, k_out = apply_rope_qk(q, q[:, :1], torch.zeros(5, 8, device=DEVICE))
    assert q_out.shape == (0, 3, 5, 16) and k_out.shape == (0, 1, 5, 16)
    no_heads = torch.randn(2, 0, 5, 16, device=DEVICE)
    assert apply_rope(no_heads, torch.zeros(5, 8, device=DEVICE)).shape == (2, 0, 5, 16)


@pytest.mark.parametrize("qk", [False, True])
def test_empty_sequence_gives_learned_frequencies_a_zero_gradient(qk):
    """N = 0 with a learnable ``inv_freq``: the backward's chain through the positions takes
    an empty position vector (its reshape to ``[-1, 0, 1]`` raised before)."""
    x = torch.randn(2, 3, 0, 16, device=DEVICE, requires_grad=True)
    inv_freq = rope_frequencies(16, device=DEVICE)[0].requires_grad_()
    outs = (
        apply_rope_qk(x, x[:, :1], inv_freq=inv_freq) if qk else (apply_rope(x, inv_freq=inv_freq),)
    )
    sum(o.sum() for o in outs).backward()
    assert torch.equal(inv_freq.grad, torch.zeros_like(inv_freq))
    assert x.grad.shape == x.shape


# Compiles the kernel for sm_90 in a subprocess without TRITON_INTERPRET (works without a GPU)
# and lists its global stores: 16-byte vectors only, or the kernel lost its vectorization.
_PTX_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fused_rope.rope import _rope_kernel

out = {}
for dtype, layout, D, R, heads, from_inv_freq, angle_grad in json.loads(sys.argv[1]):
    sig, attrs = {}, {}
    for i, name in enumerate(_rope_kernel.arg_names):
        if name.endswith("_ptr"):
            sig[name] = "*fp32" if name in ("angles_ptr", "d_angles_ptr") else "*" + dtype
        elif name.startswith("stride") or name in ("N", "q_shift", "pos0"):
            sig[name] = "i32"
        elif name.endswith("_scale"):
            sig[name] = "fp32"
        if name.endswith("_ptr") or (name.startswith("stride") and name != "stride_an"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    consts = dict(H_Q=32, H_K=8, D=D, R=R, HALF_P=R // 2, PASS_P=max(D - R, 1), BLOCK_N=4,
                  BLOCK_HQ=8, BLOCK_HK=8, HEADS_PER_PROGRAM=heads,
                  INTERLEAVED=layout == "interleaved", CONJUGATE=False, COPY_PASS=R < D,
                  FAST_TRIG=dtype != "fp32", FROM_INV_FREQ=from_inv_freq,
                  ANGLE_GRAD=angle_grad)
    sig.update({name: "constexpr" for name in consts})
    kernel = triton.compile(ASTSource(_rope_kernel, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kernel.asm["ptx"]
    out[f"{dtype}-{layout}-D{D}-R{R}-heads{heads}-inv_freq{from_inv_freq}-grad{angle_grad}"] = [
        re.findall(r"st\.global[.\w]*", ptx), len(re.findall(r"sin\.approx", ptx))
    ]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90_with_16_byte_stores():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    # heads per program: 40 = all of q's 32 and k's 8; 8 = one loop iteration a program. Then:
    # the angles formed from inv_freq; the backward that also forms the angles' gradient.
    cases = [["fp16", "half", 128, 128, 40, False, False],
             ["bf16", "interleaved", 128, 128, 8, False, False],
             ["fp16", "interleaved", 192, 64, 40, False, False],
             ["fp32", "half", 64, 64, 8, False, False],
             ["bf16", "half", 128, 128, 40, True, False],
             ["bf16", "interleaved", 128, 128, 40, False, True]]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _PTX_SCRIPT, json.dumps(cases)],
        capture_output=True, text=True, env=env, cwd=root, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    stores = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(stores) == len(cases)
    for case, (found, fast_sines) in stores.items():
        # the angles' gradient (fp32, one row a program per position) may take 8-byte stores
        allowed = {"st.global.v4.b32"} | ({"st.global.v2.b32"} if "gradTrue" in case else set())
        assert "st.global.v4.b32" in found and set(found) <= allowed, f"{case}: {set(found)}"
        # fp16/bf16 take the hardware sin/cos after the reduction; fp32 keeps libm's
        assert (fast_sines > 0) == (not case.startswith("fp32")), f"{case}: {fast_sines} sin.approx"


def test_launch_integer_helpers_match_tritons():
    """fused_rope._intmath replaces triton.cdiv and triton.next_power_of_2 on the host (each a
    ConstexprFunction, about 4 us a call): the same values."""
    import triton

    from fused_rope._intmath import cdiv, next_power_of_2

    for n in [*range(0, 300), 1023, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 8, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.mark.parametrize("inplace", [False, True])
def test_tracers_reach_the_custom_ops(inplace):
    """Eager calls launch the kernel directly; fake tensors and make_fx must reach the custom
    ops instead (a launch on a fake tensor fails; one under a tracer is missing from its
    graph), as torch.compile does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.randn(1, 4, 3, 32, device=DEVICE)
    k = torch.randn(1, 2, 5, 32, device=DEVICE)
    inv_freq = rope_frequencies(32)[0].to(DEVICE)
    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        q_out, k_out = apply_rope_qk(fq, fk, inv_freq=mode.from_tensor(inv_freq))
        x_out = apply_rope(fk, inv_freq=mode.from_tensor(inv_freq), inplace=inplace)
    assert q_out.shape == q.shape and k_out.shape == k.shape and x_out.shape == k.shape

    def rotate(q, k):
        x = apply_rope(k.clone(), inv_freq=inv_freq, inplace=inplace)
        return (*apply_rope_qk(q, k, inv_freq=inv_freq), x)

    code = make_fx(rotate)(q, k).code
    op = "fused_rope.rope_.default" if inplace else "fused_rope.rope.default"
    assert "fused_rope.rope_qk.default" in code and op in code, code


def _drawn_storage(rng: random.Random, shape: tuple, dtype: torch.dtype):
    """Random values of ``shape`` ``[B, H, N, D]`` in a drawn storage, as ``(buffer, view)``
    with ``view(buffer)`` the tensor: contiguous; a ``[B, N, H, D]`` buffer seen through
    ``.transpose(1, 2)`` (a model's projections); or one part of a fused ``[B, N, 3, H, D +
    pad]`` qkv buffer from a channel offset (rows padded, an odd offset misaligns the
    pointer, no dense order: the output is allocated densely). ``view`` applies to any
    buffer of that shape, so an in-place call can be checked outside the view too."""
    B, H, N, D = shape
    kind = rng.choice(["contiguous", "transposed", "qkv"])
    if kind == "contiguous":
        return torch.randn(shape, device=DEVICE).to(dtype), lambda buf: buf
    if kind == "transposed":
        return torch.randn(B, N, H, D, device=DEVICE).to(dtype), lambda buf: buf.transpose(1, 2)
    part, pad = rng.randrange(3), rng.randint(1, 8)
    lo = rng.randint(0, pad)
    buf = torch.randn(B, N, 3, H, D + pad, device=DEVICE).to(dtype)
    return buf, lambda buf: buf[:, :, part, :, lo : lo + D].transpose(1, 2)


@pytest.mark.parametrize("seed", [pytest.param(s, marks=gpu) if s >= 3 else s for s in range(40)])
def test_random_configurations(seed):
    """Options drawn at random, together (the grids above vary a few at a time): apply_rope or
    apply_rope_qk, B, heads (HQ and HK independent), lengths (NQ <= N for q), head dims that
    are not powers of two, any even rotary width, layout, dtype, theta and positions up to
    1e5, the angles (shared, per batch, a stride-0 batch, a NaN-padded wider table, or
    ``inv_freq`` from an offset), scales of either sign, strided storage of inputs and
    cotangents, in place (under no_grad) or with the backward of a random cotangent. Three
    small fp32/fp16 draws in the interpreter."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    qk = rng.random() < 0.5
    B = rng.randint(1, 3)
    HQ, HK = rng.randint(1, 8 if ON_GPU else 3), rng.randint(1, 8 if ON_GPU else 3)
    N = rng.randint(1, 3000 if ON_GPU else 70)
    NQ = rng.choice([N, 1, rng.randint(1, N)]) if qk else N
    D = rng.choice([16, 32, 64, 72, 80, 96, 128, 136, 192, 256] if ON_GPU else [2, 8, 24, 48])
    if B * (HQ + HK) * N * D > 2**24:
        B = 1  # float64 copies of at most ~130 MB each: the test processes share the GPU
    R = rng.choice([None, 2 * rng.randint(1, D // 2)])
    layout = rng.choice(["half", "interleaved"])
    # bf16 on the GPU only: the interpreter (Triton 3.9) casts fp32 to bf16 by truncation, not
    # to nearest, which doubles the rounding error and fails the rule in most bf16 draws
    dtype = rng.choice([torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
    scales = [rng.choice([1.0, rng.choice([-1, 1]) * rng.uniform(0.05, 2.0)]) for _ in range(2)]
    inplace = not qk and rng.random() < 0.3

    # Angles of random positions up to 1e5 (with inv_freq: offset..offset+N-1), tens of
    # thousands of radians at the fastest frequency. ``table`` is what the reference reads.
    inv_freq = rope_frequencies(R or D, 10.0 ** rng.uniform(2, 6))[0].to(DEVICE)
    angle_kind = rng.choice(["shared", "batch", "stride-0 batch", "padded", "inv_freq"])
    rope = {}
    if angle_kind == "inv_freq":
        offset = rng.choice([0, rng.randint(1, 10**5)])
        table = rope_angles(torch.arange(offset, offset + N, device=DEVICE), inv_freq)
        rope = dict(inv_freq=inv_freq, position_offset=offset)
    else:
        per_batch = angle_kind in ("batch", "padded")
        positions = torch.randint(0, 10**5, (B, N) if per_batch else (N,), device=DEVICE)
        table = rope_angles(positions, inv_freq)
        if angle_kind == "stride-0 batch":
            table = table.expand(B, N, -1)
        elif angle_kind == "padded":
            # a column slice of a wider table: a read past R/2 columns would bring NaN in
            wide = torch.full((B, N, table.shape[-1] + 5), float("nan"), device=DEVICE)
            table = wide[..., : table.shape[-1]].copy_(table)
        rope = dict(angles=table)

    heads, rows = ([HQ, HK], [NQ, N]) if qk else ([HQ], [N])
    stored = [_drawn_storage(rng, (B, h, n, D), dtype) for h, n in zip(heads, rows, strict=True)]
    before = [buf.clone() for buf, _ in stored]
    xs = [view(buf) for buf, view in stored]
    # q's rows are k's last NQ positions
    x_angles = [table[..., N - n :, :] for n in rows]
    names, scales = (["q", "k"], scales) if qk else (["x"], scales[:1])
    if inplace:
        # into a copy of the buffer: only the view changes, bitwise as out of place
        buf, view = stored[0]
        written = buf.clone()
        target = view(written)
        with torch.no_grad():
            out = apply_rope(target, layout=layout, rope_dim=R, output_scale=scales[0],
                             inplace=True, **rope)  # fmt: skip
            expected = apply_rope(xs[0], layout=layout, rope_dim=R, output_scale=scales[0], **rope)
        assert out is target
        _check("x inplace", target, xs[0], x_angles[0], layout, R, scales[0])
        assert torch.equal(target, expected)
        inside = torch.zeros(buf.shape, dtype=torch.bool, device=DEVICE)
        view(inside).fill_(True)
        assert torch.equal(written[~inside], buf[~inside]), "written outside the view"
        return

    grad = rng.random() < 0.8  # else no graph: the launcher runs directly
    xs = [x.detach().requires_grad_(grad) for x in xs]
    if qk:
        outs = apply_rope_qk(*xs, layout=layout, rope_dim=R, q_scale=scales[0],
                             k_scale=scales[1], **rope)  # fmt: skip
    else:
        outs = [apply_rope(xs[0], layout=layout, rope_dim=R, output_scale=scales[0], **rope)]
    for name, out, x, a, s in zip(names, outs, xs, x_angles, scales, strict=True):
        _check(f"{name}_out", out, x, a, layout, R, s)
        assert out.stride() == torch.empty_like(x).stride(), name  # the documented layout
    # the inputs are only read
    assert all(torch.equal(buf, b) for (buf, _), b in zip(stored, before, strict=True))
    if not grad:
        return
    # cotangents in drawn storages of their own
    dys = [view(buf) for buf, view in (_drawn_storage(rng, o.shape, dtype) for o in outs)]
    torch.autograd.backward(outs, dys)
    for name, x, a, s, dy in zip(names, xs, x_angles, scales, dys, strict=True):
        _check(f"d{name}", x.grad, x, a, layout, R, s, dy=dy)


def test_qk_offset_limit_counts_k_positions():
    # q one decoding row, k 8 rows: k's last position is offset + 7 = 2**24
    with pytest.raises(ValueError, match="position_offset \\+ N <= 2\\*\\*24.*with N=8"):
        apply_rope_qk(_x(1, 2, 1, 16), _x(1, 2, 8, 16), inv_freq=torch.ones(8, device=DEVICE),
                      position_offset=2**24 - 7)  # fmt: skip


@pytest.mark.parametrize(
    "args, expected",
    [
        # two loop iterations (q's heads, k's): every head in one program; 1024 programs fill
        # 4 a SM
        ((1, 4096, 8, 8, 32), TileConfig(4, 8, 8, 4)),
        # more iterations: one head block (at most 8 heads) a program
        ((1, 64, 16, 2, 64), TileConfig(1, 8, 2, 2, heads_per_program=8)),
        # 16 positions a program give 400 programs, under 4 a SM (132): halved to 8
        ((1, 6400, 1, 1, 64), TileConfig(8, 1, 1, 2)),
    ],
)
def test_tile_config_on_a_gpu(args, expected, monkeypatch):
    monkeypatch.setattr(rope_module, "num_sms", lambda device: 132)
    assert tile_config(*args, torch.device("cuda")) == expected


def test_tile_config_in_the_interpreter_counts_the_wider_head_block():
    # 2048 pairs a program: 8 positions of 32 pairs times k's 8 heads, though q has 1
    assert tile_config(1, 64, 1, 8, 64, torch.device("cpu")) == TileConfig(8, 1, 8, 4)


def test_one_batch_past_the_grid_axis_launches_in_slices(monkeypatch):
    calls, real = [], rope_module._launch_batch_slices
    monkeypatch.setattr(rope_module, "MAX_GRID_AXIS2", 4)
    monkeypatch.setattr(rope_module, "_launch_batch_slices", lambda *a: calls.append(1) or real(*a))
    x = _x(5, 2, 7, 16)
    inv_freq = rope_frequencies(16)[0].to(DEVICE)
    apply_rope(x, inv_freq=inv_freq)
    assert calls == [1]
