"""``llama4_attn_scale`` in closed form, against transformers' ``get_llama_4_attn_scale``, and
the recipe its docstring gives against a whole Ministral 3 attention layer of transformers."""

from __future__ import annotations

import math

import pytest
import torch

from fused_rope import llama4_attn_scale, rope_attention_ref, rope_frequencies
from tests.helpers import DEVICE, assert_close


def test_scale_is_one_below_the_original_context_then_steps_up_each_of_it():
    positions = torch.tensor([0, 1, 4095, 4096, 8191, 8192, 12288, 40959, 40960, 10**6])
    positions = positions.to(DEVICE)
    scale = llama4_attn_scale(positions, 0.1, 4096)
    steps = [0, 0, 0, 1, 1, 2, 3, 9, 10, 244]
    expected = torch.tensor([1 + 0.1 * math.log(1 + s) for s in steps], dtype=torch.float64)
    assert scale.dtype == torch.float32 and scale.device == positions.device
    assert_close("scale", scale.cpu(), expected, atol=1e-7, rtol=1e-7)
    assert torch.equal(llama4_attn_scale(positions, 0.0, 4096), torch.ones(10, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64])
def test_scale_keeps_the_positions_shape_and_divides_exactly(dtype):
    # 3 * 4096 - 1 and 3 * 4096: the step falls exactly between them in every dtype
    positions = torch.tensor([[12287, 12288], [0, 5]], dtype=dtype)
    scale = llama4_attn_scale(positions, 0.5, 4096)
    expected = torch.tensor([[1 + 0.5 * math.log(3), 1 + 0.5 * math.log(4)], [1.0, 1.0]])
    assert scale.shape == (2, 2)
    assert_close("scale", scale, expected, atol=1e-7, rtol=1e-7)


@pytest.mark.parametrize(
    "dtype, positions, length",
    [
        (torch.int16, [5, 30000], 32768),  # L0 past int16: it wrapped to -32768
        (torch.uint8, [5, 200], 300),  # ... to 44
        (torch.uint8, [5, 200], 256),  # ... to 0: a division by zero
        (torch.int32, [5, 100], 2**33 + 1),  # ... to 1
        (torch.uint16, [5, 60000], 65536),  # unsigned: PyTorch had no >= nor floor division
        (torch.uint32, [5, 2**31], 2**32),
    ],
)
def test_narrow_integer_positions_are_divided_in_int64(dtype, positions, length):
    """A review's find: the division took L0 in the positions' dtype, where it wraps."""
    scale = llama4_attn_scale(torch.tensor(positions, dtype=dtype), 0.1, length)
    assert torch.equal(scale, torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_positions_past_fp32s_integers_are_divided_exactly(dtype):
    """p = 2**24 + 3 * 16384 - 1 is one short of a multiple of L0 = 16384; in fp32 it rounds up
    to the multiple (transformers divides in fp32), here it stays one step below, integers
    and fp64 positions alike."""
    p = 2**24 + 3 * 16384 - 1
    scale = llama4_attn_scale(torch.tensor([p, p + 1], dtype=dtype, device=DEVICE), 1.0, 16384)
    steps = torch.tensor([p // 16384, (p + 1) // 16384], dtype=torch.float64)  # 1026, 1027
    assert_close("scale", scale.cpu(), 1 + torch.log1p(steps), atol=1e-7, rtol=1e-7)


def test_an_original_context_of_one_steps_at_every_position():
    """L0 = 1, the smallest accepted: ``1 + beta * ln(1 + p)``."""
    positions = torch.tensor([0, 1, 2, 999])
    expected = 1 + 0.25 * torch.log1p(positions.double())
    assert_close("scale", llama4_attn_scale(positions, 0.25, 1), expected, atol=1e-7, rtol=1e-7)
    with pytest.raises(ValueError, match=r"original_max_position_embeddings must be in \[1"):
        llama4_attn_scale(positions, 0.25, 0)


def test_fractional_positions_are_floored():
    scale = llama4_attn_scale(torch.tensor([9.99, 10.0, 10.5]), 1.0, 10)
    assert_close("scale", scale, torch.tensor([1.0, 1 + math.log(2), 1 + math.log(2)]), 1e-7, 1e-7)


@pytest.mark.parametrize("module", ["ministral3", "mistral4"])
def test_scale_matches_transformers(module):
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    if not hasattr(modeling, "get_llama_4_attn_scale"):
        pytest.skip(f"this transformers has no {module} (pyproject allows transformers >= 4.45)")
    positions = torch.arange(0, 300_000, 997)[None]  # [1, N]: position_ids
    theirs = modeling.get_llama_4_attn_scale(positions, 0.1, 16384)  # [1, 1, N, 1]
    ours = llama4_attn_scale(positions, 0.1, 16384)
    # theirs divides in fp32 and takes log(1 + x): one fp32 ulp of the scale apart at most
    assert_close("scale", ours, theirs[:, 0, :, 0], atol=2.4e-7, rtol=1e-7)


def test_ministral3_attention_is_the_frequencies_plus_the_query_scale():
    """A Ministral 3 attention layer of transformers (fp64, random weights, positions out to
    five times L0) against the recipe: ``rope_frequencies`` of its rope_parameters without
    ``llama_4_scaling_beta``, q scaled by ``llama4_attn_scale``, ``rope_attention_ref``."""
    models = pytest.importorskip("transformers.models")
    if not hasattr(models, "ministral3"):
        pytest.skip("this transformers has no Ministral 3 (pyproject allows transformers >= 4.45)")
    from transformers.models.ministral3 import Ministral3Config
    from transformers.models.ministral3.modeling_ministral3 import (
        Ministral3Attention,
        Ministral3RotaryEmbedding,
    )

    L0, beta, H, HKV, D, C, N = 8, 0.3, 4, 2, 16, 64, 40
    params = {
        "type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": L0,
        "max_position_embeddings": 4 * L0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,  # an attention factor that is not 1
        "llama_4_scaling_beta": beta,
    }
    config = Ministral3Config(
        hidden_size=C,
        num_attention_heads=H,
        num_key_value_heads=HKV,
        head_dim=D,
        intermediate_size=C,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=4 * L0,
        rope_parameters=dict(params),
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Ministral3Attention(config, 0).double()
    x = torch.randn(2, N, C, dtype=torch.float64)
    positions = torch.arange(N)[None].expand(2, -1)
    cos_sin = Ministral3RotaryEmbedding(config).double()(x, positions)
    theirs = layer(x, cos_sin, None, positions)[0]

    with pytest.raises(ValueError, match="llama4_attn_scale"):
        rope_frequencies(D, 10000.0, params)
    beta = params.pop("llama_4_scaling_beta")
    inv_freq, factor = rope_frequencies(D, 10000.0, params, head_dim=D)
    assert factor != 1.0
    heads = lambda w, n: (x @ w.weight.T).view(2, N, n, D).transpose(1, 2)  # noqa: E731
    q, k, v = heads(layer.q_proj, H), heads(layer.k_proj, HKV), heads(layer.v_proj, HKV)
    q = q * llama4_attn_scale(torch.arange(N), beta, L0).double()[:, None]
    o, _ = rope_attention_ref(q, k, v, inv_freq=inv_freq.double(), attention_factor=factor)
    ours = layer.o_proj(o.transpose(1, 2).reshape(2, N, H * D))
    # fp32 inv_freq here, transformers' fp64 after .double(): angles apart by ~1e-7 relative
    assert_close("attention output", ours, theirs, atol=1e-5, rtol=1e-5)
    # the scale matters here: without it the outputs of the far rows differ
    plain = heads(layer.q_proj, H)
    o_plain, _ = rope_attention_ref(
        plain, k, v, inv_freq=inv_freq.double(), attention_factor=factor
    )
    assert (layer.o_proj(o_plain.transpose(1, 2).reshape(2, N, H * D)) - theirs).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.arange(4), 0.1, 0), ValueError, "original_max_position_embeddings"),
        ((torch.arange(4), 0.1, 2**62), ValueError, "original_max_position_embeddings"),
        ((torch.arange(4), 0.1, 8.0), TypeError, "original_max_position_embeddings"),
        ((torch.arange(4), 0.1, True), TypeError, "original_max_position_embeddings"),
        ((torch.arange(4), -0.1, 8), ValueError, "beta"),
        ((torch.arange(4), float("nan"), 8), ValueError, "beta"),
        ((torch.arange(4), float("inf"), 8), ValueError, "beta"),
        ((torch.arange(4), "0.1", 8), TypeError, "beta"),
        ((torch.arange(4), True, 8), TypeError, "beta"),
        ((torch.arange(-1, 3), 0.1, 8), ValueError, "positions must be finite and >= 0, got -1"),
        ((torch.tensor([1.0, float("nan")]), 0.1, 8), ValueError, "got nan"),
        ((torch.tensor([1.0, float("inf")]), 0.1, 8), ValueError, "got inf"),
        ((torch.arange(4).half(), 0.1, 8), TypeError, "positions"),
        ((torch.ones(4, dtype=torch.bool), 0.1, 8), TypeError, "positions"),
        (([0, 1, 2], 0.1, 8), TypeError, "positions"),
        # divided as int64, where they would wrap to negative values (a review's find)
        (
            (torch.tensor([3, 2**63 + 5], dtype=torch.uint64), 0.1, 8),
            ValueError,
            "uint64 positions must be below 2\\*\\*63 .*, got 9223372036854775813",
        ),
    ],
)
def test_bad_arguments_are_refused(args, error, match):
    with pytest.raises(error, match=match):
        llama4_attn_scale(*args)
