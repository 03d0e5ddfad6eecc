"""Closed-form properties of the RoPE reference ``fused_rope.naive.apply_rope_ref`` (float64),
and ``rope_attention_ref`` against PyTorch's attention head by head."""

import math

import pytest
import torch
import torch.nn.functional as F

from fused_rope.frequencies import rope_angles, rope_frequencies
from fused_rope.naive import apply_rope_ref, rope_attention_ref
from tests.helpers import assert_close

LAYOUTS = ["half", "interleaved"]


def _angles(positions: torch.Tensor, rope_dim: int) -> torch.Tensor:
    # float64 product: fp32 angles round m*f and n*f separately, which breaks the exact
    # relative-position identity at the 1e-7 level.
    inv_freq, _ = rope_frequencies(rope_dim)
    return positions.double()[:, None] * inv_freq.double()


def _half_to_interleaved(D: int, R: int) -> torch.Tensor:
    """Channel order taking a half-layout vector to the interleaved layout: the half pair
    (d, d + R/2) lands on (2d, 2d + 1); pass-through channels stay put."""
    perm = torch.arange(D)
    perm[0:R:2] = torch.arange(R // 2)
    perm[1:R:2] = torch.arange(R // 2) + R // 2
    return perm


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotation_keeps_the_norm(layout):
    x = torch.randn(2, 3, 17, 64, dtype=torch.float64)
    angles = torch.randn(17, 32, dtype=torch.float64) * 100
    y = apply_rope_ref(x, angles, layout)
    assert_close("norm", y.norm(dim=-1), x.norm(dim=-1), atol=1e-12, rtol=1e-14)
    assert not torch.allclose(y, x)  # it did rotate


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_depend_only_on_relative_position(layout):
    D, N = 64, 40
    q = torch.randn(1, 1, 1, D, dtype=torch.float64).expand(1, 1, N, D)
    k = torch.randn(1, 1, 1, D, dtype=torch.float64).expand(1, 1, N, D)
    angles = _angles(torch.arange(N), D)
    scores = apply_rope_ref(q, angles, layout)[0, 0] @ apply_rope_ref(k, angles, layout)[0, 0].T
    # scores[m, n] is <rope(q, m), rope(k, n)>: constant along every diagonal m - n = const.
    for offset in (-N + 1, -7, 0, 5, N - 1):
        diag = torch.diagonal(scores, offset)
        assert_close(f"diagonal {offset}", diag, diag[:1].expand_as(diag), atol=1e-10, rtol=1e-12)
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 3)[0])


@pytest.mark.parametrize("rope_dim", [64, 32], ids=["full", "partial"])
def test_half_and_interleaved_agree_after_channel_permutation(rope_dim):
    D, N = 64, 23
    x = torch.randn(2, 2, N, D, dtype=torch.float64)
    angles = torch.randn(2, N, rope_dim // 2, dtype=torch.float64)
    perm = _half_to_interleaved(D, rope_dim)
    half = apply_rope_ref(x, angles, "half", rope_dim)
    inter = apply_rope_ref(x[..., perm], angles, "interleaved", rope_dim)
    assert_close("interleaved(Px) vs P half(x)", inter, half[..., perm], atol=1e-12, rtol=1e-14)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_scale_scales_everything(layout):
    x = torch.randn(2, 2, 9, 48, dtype=torch.float64)
    angles = torch.randn(9, 16, dtype=torch.float64)
    s = -0.37
    scaled = apply_rope_ref(x, angles, layout, rope_dim=32, output_scale=s)
    assert_close("scale", scaled, s * apply_rope_ref(x, angles, layout, rope_dim=32), 1e-14, 1e-14)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_rotation_passes_the_rest_through(layout):
    x = torch.randn(2, 3, 11, 80, dtype=torch.float64)
    angles = torch.randn(11, 24, dtype=torch.float64)
    y = apply_rope_ref(x, angles, layout, rope_dim=48, output_scale=2.0)
    assert torch.equal(y[..., 48:], 2.0 * x[..., 48:])
    full = apply_rope_ref(x[..., :48], angles, layout, output_scale=2.0)
    assert torch.equal(y[..., :48], full)


def test_quarter_turn_in_closed_form():
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    angles = torch.full((3, 4), math.pi / 2, dtype=torch.float64)
    y = apply_rope_ref(x, angles, "half")
    x1, x2 = x[..., :4], x[..., 4:]
    assert_close("quarter turn", y, torch.cat([-x2, x1], dim=-1), atol=1e-15, rtol=1e-15)
    assert torch.equal(apply_rope_ref(x, torch.zeros(3, 4, dtype=torch.float64)), x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotation_by_minus_angle_inverts(layout):
    x = torch.randn(2, 2, 13, 32, dtype=torch.float64)
    angles = torch.randn(2, 13, 16, dtype=torch.float64) * 50
    back = apply_rope_ref(apply_rope_ref(x, angles, layout), -angles, layout)
    assert_close("R(-a) R(a) x", back, x, atol=1e-12, rtol=1e-14)


def test_shared_angles_equal_per_batch_copies():
    x = torch.randn(3, 2, 7, 16, dtype=torch.float64)
    angles = torch.randn(7, 8, dtype=torch.float64)
    shared = apply_rope_ref(x, angles)
    per_batch = apply_rope_ref(x, angles.expand(3, 7, 8))
    assert torch.equal(shared, per_batch)


def test_attention_reference_reads_kv_head_h_over_the_group_size():
    """GQA's heads come in contiguous groups: query head h reads KV head h // (HQ / HKV)
    (``h % HKV`` would be another model). Checked head by head against SDPA on the rotated
    q and k, which also pins the default scale 1/sqrt(D) and the causal mask; lse against
    the explicit logsumexp. Every kernel test compares with this reference, so a wrong
    mapping here would be invisible to them (the kernel and its baseline would both be off)."""
    torch.manual_seed(0)
    B, HQ, HKV, N, D = 2, 6, 2, 9, 16
    q = torch.randn(B, HQ, N, D, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, N, D, dtype=torch.float64) for _ in range(2))
    o, lse = rope_attention_ref(q, k, v)
    angles = rope_angles(torch.arange(N), rope_frequencies(D)[0])
    q_rot, k_rot = apply_rope_ref(q, angles), apply_rope_ref(k, angles)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    for h in range(HQ):
        kv = h // (HQ // HKV)
        expect = F.scaled_dot_product_attention(q_rot[:, h], k_rot[:, kv], v[:, kv], is_causal=True)
        assert_close(f"o, head {h}", o[:, h], expect, 1e-12, 1e-12)
        s = (q_rot[:, h] @ k_rot[:, kv].transpose(-1, -2)) * D**-0.5
        expect_lse = torch.logsumexp(s.masked_fill(~causal, float("-inf")), dim=-1)
        assert_close(f"lse, head {h}", lse[:, h], expect_lse, 1e-12, 1e-12)


@pytest.mark.parametrize("NQ, NK", [(3, 5), (4, 2)])
def test_attention_reference_aligns_queries_bottom_right(NQ, NK):
    """Written out (float64, rope_dim < D): by default the queries sit at the last NQ key
    positions ``NK - NQ .. NK - 1`` (negative when NQ > NK) and query ``i`` sees key ``j``
    iff ``j <= i + NK - NQ``; the default scale is 1/sqrt(D) (D, not rope_dim); a query that
    sees no key outputs 0 with lse -inf. Explicit key positions with NQ > NK need
    q_positions. The kernels are tested against this reference, so these conventions are
    pinned here, independently of them."""
    torch.manual_seed(0)
    D, R = 8, 4
    q = torch.randn(1, 2, NQ, D, dtype=torch.float64)
    k, v = (torch.randn(1, 1, NK, D, dtype=torch.float64) for _ in range(2))
    o, lse = rope_attention_ref(q, k, v, rope_dim=R)
    inv_freq = rope_frequencies(R)[0].double()
    q_rot = apply_rope_ref(q, torch.arange(NK - NQ, NK)[:, None] * inv_freq, rope_dim=R)
    k_rot = apply_rope_ref(k, torch.arange(NK)[:, None] * inv_freq, rope_dim=R)
    sees = torch.arange(NK)[None, :] <= torch.arange(NQ)[:, None] + NK - NQ
    s = (q_rot @ k_rot.transpose(-1, -2) / math.sqrt(D)).masked_fill(~sees, float("-inf"))
    expect_lse = torch.logsumexp(s, dim=-1)
    assert torch.equal(lse.isinf(), expect_lse.isinf()) and lse.isinf().any() == (NQ > NK)
    seen = ~expect_lse.isinf()
    assert_close("lse", lse[seen], expect_lse[seen], 1e-12, 1e-12)
    expect_o = torch.where(seen[..., None], torch.softmax(s, dim=-1).nan_to_num() @ v, 0.0)
    assert_close("o", o, expect_o, 1e-12, 1e-12)
    if NQ > NK:
        with pytest.raises(ValueError, match="pass q_positions"):
            rope_attention_ref(q, k, v, positions=torch.arange(NK))


def _ref_qkv(b_kv=1, hkv=1, nk=12, d=16, d_v=16):
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    k = torch.randn(b_kv, hkv, nk, d, dtype=torch.float64)
    return q, k, torch.randn(b_kv, hkv, nk, d_v, dtype=torch.float64)


@pytest.mark.parametrize(
    "qkv, kwargs, match",
    [
        (_ref_qkv(b_kv=3), {}, r"k and v must be \[B=1, HKV, NK, D=16\]"),
        (_ref_qkv(d=8, d_v=8), {}, r"k and v must be \[B=1, HKV, NK, D=16\]"),
        (_ref_qkv(d_v=8), {}, r"k and v must be .* and equal"),
        (_ref_qkv(hkv=0), {}, "must be a multiple of k's 0 heads"),
        (_ref_qkv(), {"positions": torch.arange(13)}, r"positions must have shape \[12\]"),
        (_ref_qkv(), {"q_positions": torch.arange(7)}, r"q_positions must have shape \[8\]"),
        (_ref_qkv(), {"inv_freq": torch.ones(3)}, "inv_freq must have rope_dim // 2 = 8"),
        (_ref_qkv(), {"positions": torch.arange(12.0).half()}, "positions must be an integer"),
        (_ref_qkv(), {"causal": "False"}, "causal must be a bool"),  # a true string: it masked
        (_ref_qkv(), {"softmax_scale": -1.0}, "softmax_scale must be"),
        (_ref_qkv(), {"softmax_scale": float("nan")}, "softmax_scale must be"),
        (_ref_qkv(), {"softmax_scale": True}, "softmax_scale must be a number"),
        (_ref_qkv(), {"window": 0}, "window must be at least 1"),
        (_ref_qkv(), {"window": 3, "causal": False}, "needs causal=True"),
    ],
)
def test_attention_reference_refuses_what_rope_attention_refuses(qkv, kwargs, match):
    """The reference checks its inputs as ``rope_attention`` does (one shared check), and
    names the argument at fault: it broadcast a batch of 1 against k's 3 and blamed the
    angles for a wrong ``positions`` or ``inv_freq``."""
    with pytest.raises((ValueError, TypeError), match=match):
        rope_attention_ref(*qkv, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"angles": torch.zeros(5, 4).half()}, TypeError, "angles must have dtype in"),
        ({"output_scale": "2"}, TypeError, "output_scale must be a float, got str"),
        ({"attention_factor": float("nan")}, ValueError, "attention_factor must be finite"),
        ({"attention_factor": 0}, ValueError, "attention_factor must be positive, got 0.0"),
    ],
)
def test_rotation_reference_refuses_what_the_kernel_refuses(kwargs, error, match):
    """Half-precision angles (far positions' angles whole radians off) and scales that are not
    finite numbers: refused by name, as by ``apply_rope``; the reference took them before."""
    args = {"angles": torch.zeros(5, 4), **kwargs}
    with pytest.raises(error, match=match):
        apply_rope_ref(torch.randn(1, 2, 5, 8), **args)


def test_attention_reference_returns_lse_in_its_compute_dtype():
    """o in q's dtype, lse in the compute dtype (fp32 for half precision): the ground truth's
    lse is not rounded to bf16."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    o, lse = rope_attention_ref(q, q, q)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_attention_reference_moves_inv_freq_to_the_inputs_device():
    """``rope_frequencies`` makes CPU frequencies; the reference takes them for inputs on
    another device (meta here, a GPU in use) as it always did."""
    q, k, v = (torch.empty(1, 2, 5, 8, device="meta") for _ in range(3))
    o, lse = rope_attention_ref(q, k, v, inv_freq=rope_frequencies(8)[0])
    assert o.device.type == "meta" and o.shape == q.shape and lse.shape == (1, 2, 5)


def test_attention_reference_keeps_its_precision_under_autocast():
    """Under bf16 autocast the reference's products stay fp32 (fp64 for fp64 inputs)."""
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    expected = rope_attention_ref(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rope_attention_ref(q, k, v)
    for name, a, b in zip(("o", "lse"), got, expected, strict=True):
        assert a.dtype == torch.float32
        assert_close(name, a, b, atol=1e-6, rtol=1e-6)
