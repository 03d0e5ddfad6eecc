"""The Co-RoPE decoding kernels (corope/decode.py) through corope_attention with one query row.

The output is checked with flash-attention's rule against the float64 reference on the same
(rounded) inputs; the baseline is the reference in the inputs' dtype (fp32 math on half
inputs, o rounded to half), as for the forward. Outputs come from torch.empty, which
tests/conftest.py fills with NaN: an element the kernels never write fails.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

import corope.decode
from corope import corope_attention, corope_attention_ref, forward
from corope.decode import BLOCK_N, decode_splits
from fused_rope.frequencies import rope_frequencies
from tests.helpers import DEVICE, ON_GPU, assert_close_to_baseline

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _check_step(B, HQ, HKV, NK, D, rope_dim=None, leader="first", dtype=F32, **kwargs):
    q = torch.randn(B, HQ, 1, D, device=DEVICE).to(dtype)
    k, v = (torch.randn(B, HKV, NK, D, device=DEVICE).to(dtype) for _ in "kv")
    kw = dict(rope_dim=rope_dim, leader=leader, **kwargs)
    with torch.no_grad():
        o = corope_attention(q, k, v, **kw)
    o64 = corope_attention_ref(q.double(), k.double(), v.double(), **kw)
    assert o.dtype == dtype and o.shape == q.shape and o.is_contiguous()
    assert_close_to_baseline("o", o, o64, corope_attention_ref(q, k, v, **kw))


# NK around the key blocks (two keys: NK = 1 is a whole sequence, the training kernels'; a
# block, a block and one, several, and long: on the CPU's one SM, 2 splits of 2 blocks at
# NK = 200 and 130, 8 of 33 (the last of 27) at NK = 16451, and 7 of 3 (the last of 2, its
# block partial) at NK = 1250);
# every group size of the training kernels' tests; partial rotation with a pass-through part.
CASES = [
    pytest.param(1, 4, 1, 2, 64, None, "first", F32, id="G4-NK2-D64-f32"),
    pytest.param(2, 4, 2, BLOCK_N, 64, None, "mean", F32, id="B2-G2-NK64-D64-mean-f32"),
    pytest.param(1, 8, 1, BLOCK_N + 1, 128, 96, "first", F32, id="G8-NK65-D128-R96-f32"),
    pytest.param(1, 3, 3, 200, 32, 20, "mean", F16, id="G1-NK200-D32-R20-mean-f16"),
    pytest.param(2, 16, 2, 130, 64, None, "first", F16, id="B2-G8-NK130-D64-f16"),
    pytest.param(1, 1, 1, 257 * BLOCK_N + 3, 32, None, "mean", F32, id="G1-NK16451-D32-f32"),
    pytest.param(1, 3, 1, 1250, 64, 48, "first", F32, id="G3-NK1250-D64-R48-f32"),
    # the mean leader with G > 1 over several splits: the gate sums of the earlier splits
    # take the mean too (a review's mutant, the first head there, passed every case above)
    pytest.param(1, 4, 1, 200, 32, None, "mean", F32, id="G4-NK200-D32-mean-f32"),
]
GPU_CASES = [
    pytest.param(1, 32, 8, 16384, 128, None, "first", BF16, id="G4-NK16384-D128-bf16"),
    pytest.param(8, 8, 2, 4096, 64, None, "mean", BF16, id="B8-G4-NK4096-D64-mean-bf16"),
    pytest.param(1, 16, 1, 1000, 64, 48, "first", F16, id="G16-NK1000-D64-R48-f16"),
    pytest.param(2, 4, 2, 777, 256, None, "first", BF16, id="G2-NK777-D256-bf16"),
    pytest.param(1, 2, 2, 3000, 128, None, "mean", F32, id="G1-NK3000-D128-mean-f32"),
    pytest.param(1, 4, 2, 700, 256, None, "mean", F32, id="G2-NK700-D256-mean-f32"),
]


@pytest.mark.parametrize("B, HQ, HKV, NK, D, rope_dim, leader, dtype", CASES)
def test_decoding_step_matches_reference(B, HQ, HKV, NK, D, rope_dim, leader, dtype):
    _check_step(B, HQ, HKV, NK, D, rope_dim, leader, dtype)


def test_one_block_a_split_past_the_carry_loops_chunk(monkeypatch):
    """Every block its own program: 258 splits, more than the 256 gate sums the carry loop
    reads at a time (the cases above run several blocks a split, as on the CPU's one SM)."""
    monkeypatch.setattr(corope.decode, "PROGRAMS_PER_SM", 10**6)
    assert decode_splits(258, 1, 1) == (258, 1)
    _check_step(1, 2, 1, 257 * BLOCK_N + 3, 32, leader="first")


@pytest.mark.parametrize("n_blocks", [1, 2, 7, 64, 258, 5000])
@pytest.mark.parametrize("groups", [1, 3, 16, 2000])
@pytest.mark.parametrize("sms", [1, 132])
def test_decode_splits_cover_every_block_once(n_blocks, groups, sms):
    """Consecutive runs of blocks_per_split blocks, the last possibly shorter, none empty."""
    n_splits, per_split = decode_splits(n_blocks, groups, sms)
    assert 1 <= n_splits <= n_blocks and per_split >= 1
    assert (n_splits - 1) * per_split < n_blocks <= n_splits * per_split


@pytest.mark.gpu
@pytest.mark.parametrize("B, HQ, HKV, NK, D, rope_dim, leader, dtype", GPU_CASES)
def test_decoding_step_matches_reference_gpu(B, HQ, HKV, NK, D, rope_dim, leader, dtype):
    _check_step(B, HQ, HKV, NK, D, rope_dim, leader, dtype)


def test_decoding_step_takes_the_options():
    """inv_freq (a scaled schedule), a custom scale, strided inputs."""
    from fused_rope.frequencies import rope_frequencies

    inv_freq, _ = rope_frequencies(32, 10000.0, {"rope_type": "linear", "factor": 4.0})
    kw = dict(inv_freq=inv_freq.to(DEVICE), softmax_scale=0.2)
    _check_step(1, 4, 2, 90, 32, **kw)
    base = torch.randn(1, 90, 8, 32, device=DEVICE)  # [B, N, heads, D]: strided head views
    q, k, v = base[:, -1:, :4].transpose(1, 2), base[:, :, 4:6].transpose(1, 2), base[:, :, 6:]
    v = v.transpose(1, 2)
    with torch.no_grad():
        o = corope_attention(q, k, v, **kw)
    o64 = corope_attention_ref(q.double(), k.double(), v.double(), **kw)
    assert_close_to_baseline("o", o, o64, corope_attention_ref(q, k, v, **kw))


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape",
    [
        ((1, 2, 3, 32), (1, 1, 8, 32), (1, 1, 8, 32)),  # three query rows: o's rows 1, 2 unwritten
        ((1, 2, 1, 32), (1, 1, 8, 32), (1, 1, 9, 32)),  # v not k's shape
        ((2, 2, 1, 32), (1, 1, 8, 32), (1, 1, 8, 32)),  # another batch
        ((1, 3, 1, 32), (1, 2, 8, 32), (1, 2, 8, 32)),  # HQ not a multiple of HKV
        ((1, 2, 1, 32), (1, 0, 8, 32), (1, 0, 8, 32)),  # no KV head
        ((1, 2, 1, 32), (1, 1, 0, 32), (1, 1, 0, 32)),  # no key: a ZeroDivisionError before
    ],
)
def test_decode_launcher_refuses_shapes_its_kernels_cannot_take(q_shape, k_shape, v_shape):
    """``corope_decode`` is exported: a shape its kernels would read or write out of range, or
    leave rows of o unwritten for, is a ValueError before any launch."""
    q, k, v = (torch.randn(s, device=DEVICE) for s in (q_shape, k_shape, v_shape))
    inv_freq = rope_frequencies(32)[0].to(DEVICE)
    with pytest.raises(ValueError, match=r"corope_decode takes q \[B, HQ, 1, D\]"):
        corope.decode.corope_decode(q, k, v, inv_freq, 32**-0.5, 32, "first")


@pytest.mark.parametrize(
    "half, rope_dim, match",
    [
        (4, 32, "inv_freq must have rope_dim / 2 = 16 elements, got 4"),  # read past its end
        (
            32,
            64,
            "rope_dim must be even, positive and at most the head dim 32, got 64",
        ),  # past each row's end
        (8, 15, "rope_dim must be even, positive and at most the head dim 32, got 15"),
    ],
)
def test_decode_launcher_refuses_a_rotation_its_kernels_would_read_past(half, rope_dim, match):
    """As ``corope_fwd`` does (a review's find: a short inv_freq was read past its end, and
    rope_dim > D past each row's)."""
    q, k = torch.randn(1, 2, 1, 32, device=DEVICE), torch.randn(1, 1, 40, 32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        corope.decode.corope_decode(
            q, k, k, torch.rand(half, device=DEVICE), 0.2, rope_dim, "first"
        )


def test_decode_op_passes_opcheck():
    q = torch.randn(1, 4, 1, 32, device=DEVICE)
    k, v = (torch.randn(1, 2, 70, 32, device=DEVICE) for _ in "kv")
    w = torch.rand(16, device=DEVICE)
    torch.library.opcheck(torch.ops.corope.decode, (q, k, v, w, 0.25, 32, "mean"))


def test_decoding_step_traces_under_compile():
    q = torch.randn(1, 4, 1, 32, device=DEVICE)
    k, v = (torch.randn(1, 2, 70, 32, device=DEVICE) for _ in "kv")
    step = torch.compile(lambda q, k, v: corope_attention(q, k, v), fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(step(q, k, v), corope_attention(q, k, v))


def test_decoding_step_traces_through_the_op_under_fake_tensors_and_make_fx():
    """Eager calls skip the custom op's dispatch; fake tensors and tracers must still reach the
    op (a Triton launch on them fails)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.randn(1, 4, 1, 32, device=DEVICE)
    k, v = (torch.randn(1, 2, 70, 32, device=DEVICE) for _ in "kv")
    with FakeTensorMode() as mode:
        o = corope_attention(*(mode.from_tensor(x) for x in (q, k, v)))
    assert o.shape == q.shape
    graph = make_fx(lambda q, k, v: corope_attention(q, k, v))(q, k, v)
    assert "corope.decode" in graph.code


def _stored(x, layout, n_max):
    """``x`` ``[B, H, N, D]`` as a view with another storage, as inference keeps it: "cache",
    the first ``N`` positions of a ``[B, n_max, H, D]`` buffer seen through ``.transpose(1, 2)``
    (a cache allocated for ``n_max`` tokens, or a projection's ``[B, N, H, D]`` output), its
    unused tail NaN so that a kernel reading past ``N`` fails; "channels", every other element
    of a ``[B, H, N, 2 D]`` buffer (a last dim of stride 2, which the launchers copy)."""
    B, H, N, D = x.shape
    if layout == "cache":
        buf = torch.full((B, n_max, H, D), float("nan"), device=x.device, dtype=x.dtype)
        buf[:, :N] = x.transpose(1, 2)
        return buf[:, :N].transpose(1, 2)
    if layout == "channels":
        buf = torch.full((B, H, N, 2 * D), float("nan"), device=x.device, dtype=x.dtype)
        buf[..., ::2] = x
        return buf[..., ::2]
    return x


@pytest.mark.parametrize(
    "seed", [pytest.param(s, marks=pytest.mark.gpu) if s >= 2 else s for s in range(32)]
)
def test_random_configurations(seed):
    """Inference options drawn at random, together, through the public corope_attention: a
    decoding step (NQ = 1, the split kernels) or a chunk that continues the cache (1 < NQ <= NK,
    the training forward from row NK - NQ), cache lengths anywhere or at block edges, batch,
    group size (padded or not), 1 or 2 KV heads, head dim, any even rotary width, leader, theta
    or a scaled inv_freq (fp32 or fp64), softmax scale, dtype, the storage of q and of the
    k/v cache (contiguous, a strided cache buffer, channel-strided), the no-grad mode, and on
    the GPU one of the training forward's autotune configs drawn and pinned (D <= 128; it
    applies to the chunks, not to the decoding steps' split kernels). Two small draws in the
    interpreter."""
    rng = random.Random(seed)
    D = rng.choice([32, 64, 128, 256] if ON_GPU else [32, 64])
    HKV, G = rng.choice([1, 2]), rng.choice([1, 2, 3, 4, 5, 8, 16] if ON_GPU else [1, 2, 3])
    B = rng.randint(1, 3) if G * HKV <= 8 else rng.randint(1, 2)
    n_max = 3000 if ON_GPU else 100
    # Uniform lengths seldom land on the 64-key blocks' edges, where the masks change.
    NK = rng.choice(
        [rng.randint(1, n_max), BLOCK_N * rng.randint(1, n_max // BLOCK_N) + rng.randint(-1, 1)]
    )
    rope_dim = rng.choice([None, 2 * rng.randint(1, D // 2)])
    R = rope_dim or D
    # The float64 reference holds [B, HKV, NQ, NK, R/2] phases (and as many sin, cos and
    # rotated keys): a chunk's NQ keeps them near 300 MB. NK = 1 is a whole sequence.
    nq_cap = min(NK, int(300e6 / 8 / (B * HKV * NK * R // 2)))
    NQ = 1 if nq_cap < 2 or rng.random() < 0.5 else rng.randint(2, nq_cap)
    dtype = rng.choice([BF16, F16, F32] if ON_GPU else [F32, F16])
    theta = 10.0 ** rng.uniform(2, 6)
    kw = dict(rope_dim=rope_dim, leader=rng.choice(["first", "mean"]), theta=theta)
    if rng.random() < 0.3:
        # a context-extension schedule (position interpolation), as checkpoints configure
        factor = rng.uniform(1.0, 8.0)
        inv_freq, _ = rope_frequencies(R, theta, {"rope_type": "linear", "factor": factor})
        kw["inv_freq"] = inv_freq.to(DEVICE, rng.choice([torch.float32, torch.float64]))
    # relative to the default 1 / sqrt(D): the logits' spread, whatever the head dim
    kw["softmax_scale"] = rng.choice([None, rng.uniform(0.25, 2.5) * D**-0.5])
    q = torch.randn(B, G * HKV, NQ, D, device=DEVICE).to(dtype)
    k, v = (torch.randn(B, HKV, NK, D, device=DEVICE).to(dtype) for _ in "kv")
    o64 = corope_attention_ref(q.double(), k.double(), v.double(), **kw)
    # In half precision the kernels round the rotated keys (and the softmax weights) to the
    # dtype for the tensor cores (corope/README.md), which the plain baseline (fp32 math, o
    # rounded once) does not: on one output row of few heads that alone took the kernel past
    # twice its error in 22 and 39 of 200 fp16 draws (D = 32, 64 keys, G = 2 and 1; RMSE up
    # to 3.8x), the kernel equal to a float64 model of those roundings up to o's own. So the
    # baseline rounds the rotated keys as well (those draws: at most 1.98x, none failed).
    rounded = dict(rotated_key_dtype=dtype) if dtype != F32 else {}
    baseline = corope_attention_ref(q, k, v, **rounded, **kw)

    layout = rng.choice(["contiguous", "cache", "channels"])
    n_cache = NK + rng.randint(0, 100)  # the cache's allocated tokens
    k, v = _stored(k, layout, n_cache), _stored(v, layout, n_cache)
    q = _stored(q, rng.choice(["contiguous", "cache", "channels"]), NQ)
    # every way to run without autograd that corope_attention accepts for NQ < NK
    mode = rng.choice([torch.no_grad, torch.inference_mode, contextlib.nullcontext])
    config = rng.randrange(len(forward.FWD_CONFIGS)) if ON_GPU and D <= 128 and NQ > 1 else None
    with mode(), forward.pinned_config(config) if config is not None else contextlib.nullcontext():
        o = corope_attention(q, k, v, **kw)
    assert o.dtype == dtype and o.shape == q.shape and o.is_contiguous()
    assert_close_to_baseline("o", o, o64, baseline)


class _RecordsKwargs:
    """Stands in for a kernel: records each launch's keyword arguments and launches nothing
    (what the interpreter ignores, the dots' padding and precision, only a GPU compile
    checks)."""

    def __init__(self):
        self.kwargs = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


@pytest.mark.parametrize(
    "G, D, rope_dim, dtype, pads, precision",
    [
        # tl.dot's dims are at least 16: 2 heads, a 8-wide half and 16 other channels padded
        (2, 32, 16, F32, (16, 32, 16, 16), "ieee"),
        (1, 64, 64, F16, (16, 64, 32, 16), "tf32"),  # no pass-through channels: 16 all the same
        (8, 128, 96, BF16, (16, 128, 64, 32), "tf32"),
        (24, 256, 200, F32, (32, 256, 128, 64), "ieee"),
    ],
)
def test_decode_launch_pads_its_dots_and_keeps_fp32_exact(
    monkeypatch, G, D, rope_dim, dtype, pads, precision
):
    """The split kernel's padded widths (heads, head dim, rotated half, the rest) and its
    dots' precision: IEEE fp32 for fp32 inputs (TF32 would round their products to 10
    bits), TF32 for half inputs (whose dots are in half)."""
    kernels = {name: _RecordsKwargs() for name in ("_gate_sums_kernel", "_split_kernel")}
    for name, stand_in in kernels.items():
        monkeypatch.setattr(corope.decode, name, stand_in)
    monkeypatch.setattr(corope.decode, "_combine_kernel", _RecordsKwargs())
    q = torch.randn(1, 2 * G, 1, D, device=DEVICE).to(dtype)
    k, v = (torch.randn(1, 2, 70, D, device=DEVICE).to(dtype) for _ in "kv")
    inv_freq = torch.rand(rope_dim // 2, device=DEVICE)
    corope.decode.corope_decode(q, k, v, inv_freq, D**-0.5, rope_dim, "first")
    (split,) = kernels["_split_kernel"].kwargs
    assert (split["G_PAD"], split["D_PAD"], split["HALF_PAD"], split["PASS_PAD"]) == pads
    assert split["DOT_PRECISION"] == precision and split["ROPE_DIM"] == rope_dim
    (gates,) = kernels["_gate_sums_kernel"].kwargs
    assert (gates["G"], gates["G_PAD"], gates["D_PAD"]) == (G, pads[0], pads[1])
