"""Frequency schedules against transformers, exactness of the angles, M-RoPE and N-d angles.

transformers computes its frequencies in fp32 (``theta ** fp32_exponent``); ours are
computed in fp64 and rounded once, so the two differ by a few fp32 ulps per element
(measured <= 5e-7 relative). They are compared elementwise as the ratio ours / theirs,
so the smallest frequencies count as much as the largest.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fused_rope.frequencies as frequencies
from fused_rope.frequencies import (
    _cached_inv_freq,
    default_inv_freq,
    mrope_angles,
    nd_rope_angles,
    nd_rope_frequencies,
    rope_angles,
    rope_frequencies,
    scaling_type,
    xdrope_angles,
)
from fused_rope.naive import apply_rope_ref
from fused_rope.rope import apply_rope
from tests.helpers import DEVICE, assert_close

FREQ_RTOL = 2e-6  # relative, per element: fp32 rounding of transformers' pow, ~10 ulps


def _assert_ratio_one(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    """``out / ref`` is 1 within ``rtol`` where ``ref`` is not 0; ``out`` is 0 where it is
    (proportional RoPE's slots that do not rotate)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    zero = ref == 0
    assert torch.equal(out[zero], ref[zero]), f"{name}: frequencies that should be 0 are not"
    ratio = out[~zero] / ref[~zero]
    assert_close(name, ratio, torch.ones_like(ratio), atol=rtol, rtol=rtol)


def _assert_scalar(name: str, out: float, ref: float) -> None:
    assert_close(name, torch.tensor(float(out)), torch.tensor(float(ref)), atol=1e-12, rtol=1e-12)


def _hf_frequencies(rope_dim, theta, scaling, seq_len=None, partial_rotary_factor=1.0):
    """transformers' own (inv_freq, attention_factor) for our ``scaling`` dict.

    Keys that transformers reads from the model config instead of ``rope_parameters``
    move there: the original context of dynamic NTK is ``max_position_embeddings``;
    longrope's ``max_position_embeddings`` is the config's.
    """
    transformers = pytest.importorskip("transformers")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    params = dict(scaling)
    kind = params.pop("type")
    if kind == "dynamic":
        max_pos = params.pop("original_max_position_embeddings")
    elif kind == "longrope":
        max_pos = params.pop(
            "max_position_embeddings", 2 * params["original_max_position_embeddings"]
        )
    else:  # the extended context, so that transformers' consistency checks stay quiet
        max_pos = int(
            params.get("factor", 1) * params.get("original_max_position_embeddings", 4096)
        )
    head_dim = round(rope_dim / partial_rotary_factor)
    rope_parameters = {"rope_type": kind, "rope_theta": theta, **params}
    if partial_rotary_factor != 1.0:
        rope_parameters["partial_rotary_factor"] = partial_rotary_factor
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=rope_parameters,
    )
    kwargs = {} if seq_len is None else {"seq_len": seq_len}
    inv_freq, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu", **kwargs)
    return inv_freq, attention_factor


def _hf_classes(module: str, config_name: str, rotary_name: str):
    """transformers' config class and rotary-embedding module of one model, or a skip."""
    models = pytest.importorskip(f"transformers.models.{module}")
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    config_cls, rotary_cls = (
        getattr(models, config_name, None),
        getattr(modeling, rotary_name, None),
    )
    if config_cls is None or rotary_cls is None:
        import transformers

        pytest.skip(
            f"transformers {transformers.__version__} predates {config_name} / {rotary_name}, "
            "the oracle of this case (pyproject allows transformers >= 4.45)"
        )
    return config_cls, rotary_cls


def _factors(n: int, low: float, high: float, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(n, generator=g, dtype=torch.float64)).tolist()


# (rope_dim, theta, scaling, seq_len, partial_rotary_factor of transformers' config)
HF_CASES = [
    pytest.param(64, 10000.0, {"type": "linear", "factor": 2.0}, None, 1.0, id="linear-R64-f2"),
    pytest.param(128, 500000.0, {"type": "linear", "factor": 8}, None, 1.0, id="linear-R128-f8"),
    pytest.param(64, 10000.0, {"type": "linear", "factor": 4.0}, None, 0.5, id="linear-partial"),
    pytest.param(
        64,
        10000.0,
        {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2048},
        5000,
        1.0,
        id="dynamic-R64-L5000",
    ),
    pytest.param(
        128,
        1e6,
        {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 4096},
        100_000,
        1.0,
        id="dynamic-R128-L100k",
    ),
    pytest.param(
        64,
        10000.0,
        {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2048},
        1000,
        1.0,
        id="dynamic-short",
    ),
    pytest.param(
        64,
        10000.0,
        {"type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 2048},
        None,
        1.0,
        id="dynamic-no-seq-len",
    ),
    pytest.param(
        64,
        10000.0,
        {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        None,
        1.0,
        id="yarn-deepseek-v3",
    ),
    pytest.param(
        64,
        10000.0,
        {
            "type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.5,
        },
        None,
        1.0,
        id="yarn-mscale-ratio",
    ),
    pytest.param(
        128,
        1e6,
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        None,
        1.0,
        id="yarn-qwen2.5",
    ),
    pytest.param(
        64,
        150000.0,
        {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        None,
        1.0,
        id="yarn-gpt-oss-no-truncate",
    ),
    pytest.param(  # transformers tests `if truncate:`, so an explicit None does not truncate
        64,
        150000.0,
        {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "truncate": None,
        },
        None,
        1.0,
        id="yarn-truncate-none",
    ),
    pytest.param(  # a short original context puts beta_fast's slot below 0: the clamp to 0
        64,
        10000.0,
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        None,
        1.0,
        id="yarn-fast-slot-clamped",
    ),
    pytest.param(  # both slots round to one: transformers widens the ramp (no 0 / 0)
        64,
        10000.0,
        {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 700.0,
            "beta_slow": 700.0,
        },
        None,
        1.0,
        id="yarn-zero-width-ramp",
    ),  # fmt: skip
    pytest.param(  # mscale_all_dim without mscale (0 counts as unset): the plain YaRN factor
        64,
        10000.0,
        {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.0,
            "mscale_all_dim": 1.0,
        },
        None,
        1.0,
        id="yarn-mscale-all-dim-alone",
    ),  # fmt: skip
    pytest.param(  # a small theta and a long context put beta_slow's slot past R/2 - 1: the clamp
        64,
        500.0,
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        None,
        1.0,
        id="yarn-slow-slot-clamped",
    ),
    pytest.param(
        64,
        500.0,
        {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
            "truncate": False,
        },
        None,
        1.0,
        id="yarn-slow-slot-clamped-no-truncate",
    ),
    pytest.param(
        96,
        10000.0,
        {
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.25,
        },
        None,
        0.75,
        id="yarn-betas-attention-factor-partial",
    ),
    pytest.param(
        64,
        10000.0,
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "mscale": 2.0},
        None,
        1.0,
        id="yarn-mscale-alone-ignored",
    ),
    pytest.param(
        128,
        500000.0,
        {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        None,
        1.0,
        id="llama3.1",
    ),
    pytest.param(
        64,
        500000.0,
        {
            "type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        None,
        1.0,
        id="llama3.2",
    ),
    pytest.param(
        128,
        10000.0,
        {
            "type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 2048,
        },
        None,
        1.0,
        id="llama3-other-band",
    ),
    pytest.param(
        128,
        500000.0,
        {
            "type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        None,
        1.0,
        id="llama4-scout-no-band",
    ),
    pytest.param(
        256,
        1000000.0,
        {"type": "proportional", "partial_rotary_factor": 0.25},
        None,
        1.0,
        id="proportional-gemma4",
    ),
    pytest.param(
        128,
        10000.0,
        {"type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0},
        None,
        1.0,
        id="proportional-factor",
    ),
    pytest.param(
        96,
        10000.0,
        {
            "type": "longrope",
            "short_factor": _factors(48, 1.0, 2.0, 1),
            "long_factor": _factors(48, 1.0, 60.0, 2),
            "original_max_position_embeddings": 4096,
            "max_position_embeddings": 131072,
        },
        None,
        1.0,
        id="longrope-phi3-short",
    ),
    pytest.param(
        96,
        10000.0,
        {
            "type": "longrope",
            "short_factor": _factors(48, 1.0, 2.0, 1),
            "long_factor": _factors(48, 1.0, 60.0, 2),
            "original_max_position_embeddings": 4096,
            "max_position_embeddings": 131072,
        },
        5000,
        1.0,
        id="longrope-phi3-long",
    ),
    # transformers takes long_factor only when seq_len > original_max_position_embeddings
    pytest.param(
        96,
        10000.0,
        {
            "type": "longrope",
            "short_factor": _factors(48, 1.0, 2.0, 1),
            "long_factor": _factors(48, 1.0, 60.0, 2),
            "original_max_position_embeddings": 4096,
            "max_position_embeddings": 131072,
        },
        4096,
        1.0,
        id="longrope-phi3-at-original",
    ),
    pytest.param(
        96,
        10000.0,
        {
            "type": "longrope",
            "short_factor": _factors(48, 1.0, 2.0, 1),
            "long_factor": _factors(48, 1.0, 60.0, 2),
            "original_max_position_embeddings": 4096,
            "max_position_embeddings": 131072,
        },
        4097,
        1.0,
        id="longrope-phi3-original-plus-one",
    ),
    pytest.param(
        64,
        10000.0,
        {
            "type": "longrope",
            "short_factor": _factors(32, 0.5, 1.5, 3),
            "long_factor": _factors(32, 1.0, 20.0, 4),
            "original_max_position_embeddings": 2048,
            "factor": 8.0,
        },
        4096,
        1.0,
        id="longrope-factor",
    ),
    pytest.param(
        64,
        10000.0,
        {
            "type": "longrope",
            "short_factor": _factors(32, 0.5, 1.5, 3),
            "long_factor": _factors(32, 1.0, 20.0, 4),
            "original_max_position_embeddings": 2048,
            "attention_factor": 1.1,
        },
        4096,
        1.0,
        id="longrope-attention-factor",
    ),
]


@pytest.mark.parametrize("rope_dim, theta, scaling, seq_len, partial", HF_CASES)
def test_rope_frequencies_match_transformers(rope_dim, theta, scaling, seq_len, partial):
    hf_inv, hf_factor = _hf_frequencies(rope_dim, theta, scaling, seq_len, partial)
    inv, factor = rope_frequencies(rope_dim, theta, scaling, seq_len=seq_len, device=DEVICE)
    assert inv.dtype == torch.float32 and inv.shape == (rope_dim // 2,)
    assert inv.device.type == torch.device(DEVICE).type
    _assert_ratio_one("inv_freq / transformers'", inv, hf_inv, FREQ_RTOL)
    _assert_scalar("attention_factor", factor, hf_factor)


# Hunyuan-A13B's rope_scaling (type "dynamic"): NTK-alpha, with YaRN keys its model does not read.
_HUNYUAN_A13B = {
    "rope_theta": 10000.0,
    "alpha": 1000.0,
    "factor": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


_PHI4_MINI = {  # Phi-4-mini's shape: head_dim 128 of which 96 rotate, longrope
    "hidden_size": 3072,
    "num_attention_heads": 24,
    "partial_rotary_factor": 0.75,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": _factors(48, 1.0, 2.0, 5),
        "long_factor": _factors(48, 1.0, 60.0, 6),
    },
}


@pytest.mark.parametrize(
    "module, config_name, rotary_name, config_kwargs, seq_len, keys",
    [
        pytest.param(
            "phi3",
            "Phi3Config",
            "Phi3RotaryEmbedding",
            {},
            None,
            ["partial_rotary_factor"],
            id="phi3",
        ),
        pytest.param(
            "phi3",
            "Phi3Config",
            "Phi3RotaryEmbedding",
            _PHI4_MINI,
            None,
            ["type", "partial_rotary_factor"],
            id="phi4-mini-longrope-short",
        ),
        pytest.param(
            "phi3",
            "Phi3Config",
            "Phi3RotaryEmbedding",
            _PHI4_MINI,
            5000,
            ["type", "partial_rotary_factor"],
            id="phi4-mini-longrope-long",
        ),
        pytest.param(
            "gpt_neox",
            "GPTNeoXConfig",
            "GPTNeoXRotaryEmbedding",
            {},
            None,
            ["partial_rotary_factor"],
            id="gpt-neox",
        ),
        pytest.param(
            "qwen2_vl",
            "Qwen2VLTextConfig",
            "Qwen2VLRotaryEmbedding",
            {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
            None,
            ["type", "mrope_section"],
            id="qwen2-vl",
        ),
        pytest.param(
            "qwen3_vl",
            "Qwen3VLTextConfig",
            "Qwen3VLTextRotaryEmbedding",
            {
                "max_position_embeddings": 786432,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 5e6,
                    "factor": 3.0,
                    "original_max_position_embeddings": 262144,
                    "mrope_section": [24, 20, 20],
                    "mrope_interleaved": True,
                },
            },
            None,
            ["mrope_section", "mrope_interleaved"],
            id="qwen3-vl-yarn",
        ),
        pytest.param(
            "glm4v",
            "Glm4vTextConfig",
            "Glm4vTextRotaryEmbedding",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                    "mrope_section": [8, 12, 12],
                }
            },
            None,
            ["partial_rotary_factor", "mrope_section"],
            id="glm-4v-partial",
        ),
        pytest.param(
            "hunyuan_v1_dense",
            "HunYuanDenseV1Config",
            "HunYuanDenseV1RotaryEmbedding",
            {
                "hidden_size": 256,
                "num_attention_heads": 2,
                "head_dim": 128,
                "rope_parameters": {**_HUNYUAN_A13B, "rope_type": "dynamic"},
            },
            None,
            ["alpha", "beta_fast", "mscale_all_dim"],
            id="hunyuan-ntk-alpha",
        ),
        pytest.param(
            "hunyuan_vl",
            "HunYuanVLTextConfig",
            "HunYuanVLRotaryEmbedding",
            {
                "hidden_size": 256,
                "num_attention_heads": 2,
                "head_dim": 128,
                "rope_parameters": {
                    **_HUNYUAN_A13B,
                    "type": "xdrope",
                    "xdrope_section": [16, 16, 16, 16],
                },
            },
            None,
            ["alpha", "mrope_section"],
            id="hunyuan-ocr-xdrope",
        ),
    ],
)
def test_transformers_rope_parameters_are_accepted(
    module, config_name, rotary_name, config_kwargs, seq_len, keys
):
    """A real config's rope_parameters, as transformers 5 stores them, give its model's
    frequencies, with ``rope_dim`` the model's rotated width."""
    config_cls, rotary_cls = _hf_classes(module, config_name, rotary_name)
    config = config_cls(**config_kwargs)
    if not hasattr(config, "rope_parameters"):
        import transformers

        pytest.skip(
            f"transformers {transformers.__version__} stores no rope_parameters (they came with "
            "transformers 5), the subject of this test (pyproject allows transformers >= 4.45)"
        )
    rotary = rotary_cls(config)
    hf_inv, hf_factor = rotary.inv_freq, rotary.attention_scaling
    if seq_len is not None:
        rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
        init = rope_utils.ROPE_INIT_FUNCTIONS[rotary.rope_type]
        hf_inv, hf_factor = init(config, "cpu", seq_len=seq_len)
    scaling = dict(config.rope_parameters)
    assert set(keys) <= set(scaling), scaling  # the keys this case is about
    if scaling["rope_type"] == "longrope":  # without factor, transformers reads the config's
        scaling["max_position_embeddings"] = config.max_position_embeddings
    rope_dim = 2 * hf_inv.shape[0]
    inv, factor = rope_frequencies(rope_dim, scaling["rope_theta"], scaling, seq_len=seq_len)
    _assert_ratio_one("inv_freq / transformers'", inv, hf_inv, FREQ_RTOL)
    _assert_scalar("attention_factor", factor, hf_factor)


def test_hunyuan_ocr_checkpoint_scaling_gives_its_model_frequencies():
    """HunyuanOCR's rope_scaling as its checkpoint stores it (type ``"xdrope"``, legacy
    ``xdrope_section``, NTK-alpha and unread YaRN keys) gives transformers' HunYuan-VL
    frequencies; transformers' config renames both keys before its model sees them."""
    config_cls, rotary_cls = _hf_classes(
        "hunyuan_vl", "HunYuanVLTextConfig", "HunYuanVLRotaryEmbedding"
    )
    checkpoint = {**_HUNYUAN_A13B, "type": "xdrope", "xdrope_section": [16, 16, 16, 16]}
    config = config_cls(
        hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=dict(checkpoint)
    )
    rotary = rotary_cls(config)
    inv, factor = rope_frequencies(128, 10000.0, checkpoint, head_dim=128)
    _assert_ratio_one("inv_freq / transformers'", inv, rotary.inv_freq, FREQ_RTOL)
    _assert_scalar("attention_factor", factor, rotary.attention_scaling)


@pytest.mark.parametrize(
    "scaling, kind",
    [
        (None, "default"),
        ({"type": "mrope", "mrope_section": [16, 24, 24]}, "default"),
        ({"type": "su"}, "longrope"),
        ({"type": "xdrope", "factor": 2.0}, "dynamic"),
        ({"type": "dynamic", "alpha": 0}, "dynamic"),
        ({"type": "dynamic", "alpha": None}, "dynamic"),
        ({"type": "xdrope", "alpha": 1000.0}, "ntk_alpha"),
        ({"type": "linear", "rope_type": "yarn"}, "yarn"),  # rope_type wins, as transformers
    ],
)
def test_scaling_type_resolves_aliases(scaling, kind):
    assert scaling_type(scaling) == kind


@pytest.mark.parametrize(
    "sections", [[16, 16, 16, 16], [10, 20, 18, 16], [0, 30, 2, 32], [32, 0, 0, 32], [5, 5, 5, 49]]
)
def test_xdrope_angles_rotate_as_transformers_hunyuan_vl(sections):
    """XD-RoPE's pairs take their two channels' angles from different axes (not a rotation):
    the recipe of ``xdrope_angles``' docstring, in the reference and in the Triton kernel,
    gives what transformers' HunYuan-VL rotary embedding and ``apply_rotary_pos_emb`` give,
    at random positions per axis (image tokens), where one ``mrope_angles`` table does not."""
    config_cls, rotary_cls = _hf_classes(
        "hunyuan_vl", "HunYuanVLTextConfig", "HunYuanVLRotaryEmbedding"
    )
    checkpoint = {**_HUNYUAN_A13B, "type": "xdrope", "xdrope_section": sections}
    config = config_cls(
        hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=dict(checkpoint)
    )
    rotary = rotary_cls(config)
    positions = torch.randint(0, 2000, (4, 2, 37))
    x = torch.randn(2, 3, 37, 128)
    cos, sin = rotary(x, positions)  # [B, N, 128] each
    x1, x2 = x.chunk(2, dim=-1)
    theirs = x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]
    # transformers' own frequencies (rope_frequencies' match them to fp32 rounding, tested
    # above, which at positions near 2000 would move the angles by more than this tolerance)
    inv, factor = rotary.inv_freq, rotary.attention_scaling
    first, second = xdrope_angles(positions, inv, sections)
    rotate = {
        "reference": lambda angles: apply_rope_ref(x, angles, attention_factor=factor),
        "kernel": lambda angles: apply_rope(x.to(DEVICE), angles.to(DEVICE),
                                            attention_factor=factor).cpu(),
    }  # fmt: skip
    for name, rot in rotate.items():
        ours = torch.cat([rot(first)[..., :64], rot(second)[..., 64:]], dim=-1)
        assert_close(f"XD-RoPE, {name}", ours, theirs, atol=2e-5, rtol=1e-5)
    one_table = mrope_angles(positions, inv, sections)  # is not XD-RoPE
    assert (apply_rope_ref(x, one_table, attention_factor=factor) - theirs).abs().max() > 0.1


@pytest.mark.parametrize("rope_dim", [4, 64, 128])
def test_ntk_alpha_is_a_fixed_stretch_of_the_base(rope_dim):
    """``theta * alpha ** (R / (R - 2))`` at every ``seq_len`` (the formula, without
    transformers); ``"dynamic"`` with a non-zero ``alpha`` is it, with a zero ``alpha``
    plain dynamic NTK."""
    theta, alpha = 10000.0, 1000.0
    base = theta * alpha ** (rope_dim / (rope_dim - 2))
    expected = (base ** -(torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)).float()
    for seq_len in (None, 10, 10**6):
        for scaling in (
            {"rope_type": "ntk_alpha", "alpha": alpha},
            {**_HUNYUAN_A13B, "type": "dynamic"},
        ):
            inv, factor = rope_frequencies(rope_dim, theta, scaling, seq_len=seq_len)
            assert torch.equal(inv, expected) and factor == 1.0
    slower = rope_frequencies(rope_dim, theta, {"type": "ntk_alpha", "alpha": 0.5})[0]
    assert (slower[1:] > rope_frequencies(rope_dim, theta)[0][1:]).all()  # alpha < 1: faster
    dynamic = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    assert torch.equal(
        rope_frequencies(rope_dim, theta, {**dynamic, "alpha": 0}, seq_len=100)[0],
        rope_frequencies(rope_dim, theta, dynamic, seq_len=100)[0],
    )


@pytest.mark.parametrize(
    "seq_len, factors",
    [(None, "short_factor"), (2047, "short_factor"), (2048, "short_factor"),
     (2049, "long_factor"), (8192, "long_factor")],
)  # fmt: skip
def test_longrope_takes_long_factor_only_beyond_the_original_context(seq_len, factors):
    """``inv_freq[d] = 1 / (factor[d] * theta ** (2d / R))`` with ``short_factor`` up to and
    including ``seq_len == original_max_position_embeddings`` and ``long_factor`` past it,
    as transformers' ``seq_len > original_max_position_embeddings`` (computed here from the
    formula, so that it holds without transformers too)."""
    rope_dim, theta = 64, 10000.0
    scaling = {
        "type": "longrope",
        "short_factor": _factors(32, 0.5, 1.5, 7),
        "long_factor": _factors(32, 2.0, 20.0, 8),  # > every short factor: never equal
        "original_max_position_embeddings": 2048,
        "factor": 8.0,
    }
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
    expected = 1.0 / (torch.tensor(scaling[factors], dtype=torch.float64) * theta**exponent)
    inv, attention_factor = rope_frequencies(rope_dim, theta, scaling, seq_len=seq_len)
    _assert_ratio_one(f"inv_freq / {factors}'s", inv, expected, FREQ_RTOL)
    # the attention factor depends on the factor alone, not on seq_len
    assert attention_factor == pytest.approx(math.sqrt(1 + math.log(8.0) / math.log(2048)))


@pytest.mark.parametrize("seq_len, mscale", [(None, 1.1), (2048, 1.1), (2049, 1.2431631)])
def test_longrope_short_and_long_mscale_are_the_attention_factor(seq_len, mscale):
    """Phi-3.5-MoE's ``short_mscale`` / ``long_mscale``: the attention factor that ``seq_len``
    picks (transformers' Phimoe multiplies cos and sin by it), over any ``attention_factor``;
    the frequencies as without them. Type "su" (Phi-3's first checkpoints) is "longrope"."""
    scaling = {
        "type": "longrope",
        "short_factor": _factors(32, 0.5, 1.5, 7),
        "long_factor": _factors(32, 2.0, 20.0, 8),
        "original_max_position_embeddings": 2048,
        "factor": 8.0,
    }
    mscales = {"short_mscale": 1.1, "long_mscale": 1.2431631, "attention_factor": 3.0}
    inv, factor = rope_frequencies(64, 1e4, {**scaling, **mscales}, seq_len=seq_len)
    assert factor == mscale
    assert torch.equal(inv, rope_frequencies(64, 1e4, scaling, seq_len=seq_len)[0])
    su = rope_frequencies(64, 1e4, {**scaling, "type": "su"}, seq_len=seq_len)
    longrope = rope_frequencies(64, 1e4, scaling, seq_len=seq_len)
    assert torch.equal(su[0], longrope[0]) and su[1] == longrope[1]
    with pytest.raises(ValueError, match="needs the other of 'short_mscale' and 'long_mscale'"):
        rope_frequencies(64, 1e4, {**scaling, "long_mscale": 1.2}, seq_len=seq_len)
    # both are checked, whichever seq_len picks
    with pytest.raises(TypeError, match="long_mscale"):
        rope_frequencies(64, 1e4, {**scaling, **mscales, "long_mscale": "x"}, seq_len=seq_len)
    with pytest.raises(ValueError, match="long_mscale"):
        rope_frequencies(64, 1e4, {**scaling, **mscales, "long_mscale": -1.0}, seq_len=seq_len)


def test_scaled_schedules_change_the_frequencies():
    """Guards the comparison above against schedules that silently fall back to plain RoPE."""
    for rope_dim, theta, scaling, seq_len, _ in (case.values for case in HF_CASES):
        plain, _ = rope_frequencies(rope_dim, theta)
        inv, _ = rope_frequencies(rope_dim, theta, scaling, seq_len=seq_len)
        original = scaling.get("original_max_position_embeddings")
        unscaled = scaling["type"] == "dynamic" and (seq_len is None or seq_len <= original)
        assert torch.equal(inv, plain) == unscaled, scaling


@pytest.mark.parametrize("rope_dim, theta", [(2, 10000.0), (64, 10000.0), (128, 1e6), (80, 5e6)])
def test_plain_frequencies_are_the_rounded_float64_ladder(rope_dim, theta):
    inv, factor = rope_frequencies(rope_dim, theta)
    ref = torch.tensor([math.pow(theta, -2 * d / rope_dim) for d in range(rope_dim // 2)])
    assert inv.dtype == torch.float32 and factor == 1.0
    _assert_ratio_one("inv_freq / math.pow", inv, ref, 1.2e-7)  # one fp32 rounding


def test_default_inv_freq_first_made_in_inference_mode_works_with_autograd():
    """The shared tensor must not be an inference tensor, or every later call that autograd
    saves it for (any op with an input requiring grad) fails."""
    _cached_inv_freq.cache_clear()  # so that this test makes the first entry
    with torch.inference_mode():
        first = default_inv_freq(64, 10000.0, DEVICE)
    inv = default_inv_freq(64, 10000.0, DEVICE)
    assert inv is first and not inv.is_inference()
    assert torch.equal(inv, rope_frequencies(64, 10000.0, device=DEVICE)[0])
    x = torch.ones(32, device=DEVICE, requires_grad=True)
    (x * inv).sum().backward()  # mul saves inv for the gradient of x
    assert torch.equal(x.grad, inv)


def test_default_inv_freq_checks_before_its_cache_and_keys_cuda_by_the_current_gpu(monkeypatch):
    """64.0 found the cached entry of 64 and passed; "cuda" was one key for every GPU, so a
    call with another GPU current got the first GPU's tensor (a review's find)."""
    default_inv_freq(64, 10000.0, "cpu")
    for rope_dim in (64.0, True):
        with pytest.raises(TypeError, match="rope_dim must be an int"):
            default_inv_freq(rope_dim, 10000.0, "cpu")
    keys = []
    monkeypatch.setattr(
        frequencies, "_cached_inv_freq", lambda *key: keys.append(key) or torch.ones(32)
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    default_inv_freq(64, 10000.0, "cuda")
    default_inv_freq(64, 10000.0, torch.device("cuda", 1))
    assert [key[2] for key in keys] == [torch.device("cuda", 3), torch.device("cuda", 1)]


@pytest.mark.parametrize("change", ["in place", "requires grad"])
def test_default_inv_freq_refuses_its_shared_tensor_once_changed(change):
    """A caller that changed the shared tensor (a session's own test made it a learned leaf)
    silently changed every later call that defaulted to it: refused at the next call, which
    drops the entry, so the call after it gets the unchanged frequencies again."""
    _cached_inv_freq.cache_clear()
    shared = default_inv_freq(64, 10000.0, DEVICE)
    if change == "in place":
        shared.mul_(2)
    else:
        shared.requires_grad_()
    with pytest.raises(RuntimeError, match="shared default inv_freq .* was (changed|made)"):
        default_inv_freq(64, 10000.0, DEVICE)
    fresh = default_inv_freq(64, 10000.0, DEVICE)
    assert fresh is not shared and not fresh.requires_grad
    assert torch.equal(fresh, rope_frequencies(64, 10000.0, device=DEVICE)[0])


def test_default_inv_freq_first_asked_for_under_fake_tensors_stays_real():
    """A call under FakeTensorMode (or make_fx's tracer) gets that mode's tensor and must not
    leave it in the cache for the real calls after it."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    _cached_inv_freq.cache_clear()
    with FakeTensorMode():
        assert isinstance(default_inv_freq(64, 10000.0, DEVICE), FakeTensor)
    inv = default_inv_freq(64, 10000.0, DEVICE)
    assert type(inv) is torch.Tensor
    assert torch.equal(inv, rope_frequencies(64, 10000.0, device=DEVICE)[0])


def test_dynamic_depends_on_seq_len_only_beyond_the_original_context():
    scaling = {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 1024}
    plain, _ = rope_frequencies(64)
    for seq_len in (None, 1, 1024):
        assert torch.equal(rope_frequencies(64, scaling=scaling, seq_len=seq_len)[0], plain)
    longer = [rope_frequencies(64, scaling=scaling, seq_len=n)[0] for n in (2048, 8192)]
    assert longer[0][0] == plain[0] == 1.0  # slot 0 has exponent 0 whatever the base
    assert (longer[1][1:] < longer[0][1:]).all() and (longer[0][1:] < plain[1:]).all()


def test_scaling_spellings_agree():
    base = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    base["original_max_position_embeddings"] = 8192
    ref = rope_frequencies(128, 500000.0, {"type": "llama3", **base})
    for scaling in (
        {"rope_type": "llama3", **base},
        {"type": "llama3", "rope_type": "llama3", **base},
        {"rope_type": "llama3", "rope_theta": 500000.0, **base},  # transformers 5 rope_parameters
        {"type": "llama3", "beta_fast": None, **base},  # unset keys (None) count as absent
        {"type": "linear", "rope_type": "llama3", **base},  # rope_type wins, as in transformers
        {"rope_type": "llama3", "partial_rotary_factor": 0.5, **base},  # R is already partial
        {"rope_type": "llama3", "mrope_section": [16, 24, 24], "mrope_interleaved": False, **base},
    ):
        inv, factor = rope_frequencies(128, 500000.0, scaling)
        assert torch.equal(inv, ref[0]) and factor == ref[1]
    plain = rope_frequencies(64)
    for scaling in (
        None,
        {},
        {"type": None},
        {"type": "default"},
        {"rope_type": "default"},
        {"type": "mrope", "mrope_section": [8, 12, 12]},  # Qwen2-VL's checkpoints
        {"type": "mrope", "rope_type": "default", "mrope_section": [8, 12, 12]},  # its config
        {"rope_type": "default", "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        {"rope_type": "default", "partial_rotary_factor": 0.25, "rope_theta": 10000.0},
    ):
        assert torch.equal(rope_frequencies(64, scaling=scaling)[0], plain[0])


def test_numpy_scalars_are_numbers():
    """Values read through numpy (np.float32, np.int64) count as the Python numbers they hold."""
    scaling = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
    ref = rope_frequencies(64, 1e4, scaling)
    for theta in (np.float32(1e4), np.float64(1e4), np.int64(10000)):
        numpy_scaling = {
            **scaling,
            "factor": np.float32(8.0),
            "original_max_position_embeddings": np.int64(4096),
            "rope_theta": theta,
        }
        inv, factor = rope_frequencies(64, theta, numpy_scaling)
        assert torch.equal(inv, ref[0]) and factor == ref[1]


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
LLAMA3 = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0] * 32,
    "long_factor": [2.0] * 32,
    "original_max_position_embeddings": 4096,
    "factor": 4.0,
}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rope_dim": 63}, ValueError, "rope_dim"),
        ({"rope_dim": 0}, ValueError, "rope_dim"),
        ({"rope_dim": -4}, ValueError, "rope_dim"),
        ({"rope_dim": 64.0}, TypeError, "rope_dim"),
        ({"rope_dim": True}, TypeError, "rope_dim"),
        ({"theta": 0.0}, ValueError, "theta"),
        ({"theta": -1.0}, ValueError, "theta"),
        ({"theta": float("inf")}, ValueError, "theta"),
        ({"theta": "10000"}, TypeError, "theta must be a real number, got '10000' of type str"),
        ({"theta": float("nan")}, ValueError, "theta must be a finite real number, got nan"),
        ({"theta": 1.0}, ValueError, "theta must be > 1"),  # every slot at one frequency
        ({"theta": 0.5}, ValueError, "theta must be > 1"),  # an increasing ladder
        ({"theta": np.float32(0.5)}, ValueError, "theta must be > 1"),
        ({"theta": 1.0, "scaling": YARN}, ValueError, "theta"),  # YaRN divides by log(theta)
        ({"seq_len": 0}, ValueError, "seq_len"),
        ({"seq_len": 2.5}, TypeError, "seq_len"),
        ({"scaling": "yarn"}, TypeError, "scaling"),
        ({"scaling": {"type": "ntk"}}, ValueError, "'ntk'"),
        ({"scaling": {"type": ["yarn"]}}, ValueError, "type"),
        ({"scaling": {"type": "linear", "rope_type": "ntk"}}, ValueError, "'rope_type'"),
        ({"scaling": {"rope_type": "mrope", "factor": 2.0}}, ValueError, "factor"),
        ({"scaling": {"partial_rotary_factor": 0}}, ValueError, "partial_rotary_factor"),
        ({"scaling": {"partial_rotary_factor": 1.5}}, ValueError, "partial_rotary_factor"),
        ({"scaling": {"partial_rotary_factor": "0.5"}}, TypeError, "partial_rotary_factor"),
        ({"scaling": {"mrope_section": [16, 24, 24]}}, ValueError, r"mrope_section.*= 32"),
        ({"scaling": {"mrope_section": "16,8,8"}}, TypeError, "mrope_section"),
        ({"scaling": {"mrope_interleaved": "yes"}}, TypeError, "mrope_interleaved"),
        (
            {"scaling": {"type": "linear", "factor": 2.0, "rope_theta": 1e6}},
            ValueError,
            "rope_theta",
        ),
        ({"scaling": {"type": "linear"}}, ValueError, "factor"),
        ({"scaling": {"type": "linear", "factor": 0.5}}, ValueError, "factor"),
        ({"scaling": {"type": "linear", "factor": "2"}}, TypeError, "factor"),
        ({"scaling": {"type": "linear", "factor": 2.0, "facter": 3}}, ValueError, "facter"),
        ({"scaling": {"type": "default", "factor": 2.0}}, ValueError, "factor"),
        ({"scaling": {"type": "dynamic", "factor": 2.0}}, ValueError, "original_max_position"),
        ({"scaling": {"type": "dynamic", "alpha": -2.0}}, ValueError, "alpha"),
        ({"scaling": {"type": "dynamic", "alpha": 1e-5}}, ValueError, "must be > 1"),
        ({"scaling": {"type": "dynamic", "alpha": "1000"}}, TypeError, "alpha"),
        ({"scaling": {"type": "ntk_alpha", "factor": 1.0}}, ValueError, "alpha"),
        ({"scaling": {"type": "dynamic", "alpha": 9.0, "low_freq_factor": 1}}, ValueError, "low"),
        ({"rope_dim": 2, "scaling": {"type": "ntk_alpha", "alpha": 9.0}}, ValueError, "rope_dim"),
        (
            {"scaling": {"type": "xdrope", "alpha": 9.0, "xdrope_section": [8, 8, 8, 6]}},
            ValueError,
            "xdrope_section",
        ),
        (
            {
                "scaling": {
                    "type": "xdrope",
                    "alpha": 9.0,
                    "xdrope_section": [8, 8, 8, 8],
                    "mrope_section": [16, 16],
                }
            },
            ValueError,
            "differ",
        ),
        (
            {"rope_dim": 2, "scaling": {**YARN, "type": "dynamic"}},
            ValueError,
            "rope_dim > 2",
        ),
        ({"scaling": {**YARN, "original_max_position_embeddings": 2048.0}}, TypeError, "original"),
        ({"scaling": {**YARN, "original_max_position_embeddings": 0}}, ValueError, "original"),
        ({"scaling": {**YARN, "beta_fast": 1, "beta_slow": 32}}, ValueError, "beta_fast"),
        ({"scaling": {**YARN, "beta_slow": -1}}, ValueError, "beta_slow"),
        ({"scaling": {**YARN, "truncate": "yes"}}, TypeError, "truncate"),
        ({"scaling": {**YARN, "attention_factor": 0}}, ValueError, "attention_factor"),
        ({"scaling": {**YARN, "low_freq_factor": 1.0}}, ValueError, "low_freq_factor"),
        ({"scaling": {**LLAMA3, "high_freq_factor": 0.5}}, ValueError, "high_freq_factor"),
        ({"scaling": {**LLAMA3, "llama_4_scaling_beta": 0.1}}, ValueError, "queries"),
        ({"scaling": {"type": "proportional", "factor": 0}}, ValueError, "factor"),
        ({"scaling": {**YARN, "factor": 0.5}}, ValueError, "factor"),
        ({"scaling": {**YARN, "type": "dynamic", "factor": 0.5}}, ValueError, "factor"),
        ({"scaling": {**LLAMA3, "factor": 0.5}}, ValueError, "factor"),
        ({"scaling": {"mrope_section": [-1, 17, 16]}}, ValueError, "non-negative"),
        ({"scaling": {**LLAMA3, "low_freq_factor": 0.0}}, ValueError, "low_freq_factor"),
        (
            {"scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
            ValueError,
            "low",
        ),
        ({"scaling": {**LONGROPE, "short_factor": [1.0] * 31}}, ValueError, "short_factor"),
        ({"scaling": {**LONGROPE, "long_factor": [1.0] * 31 + [0.0]}}, ValueError, "long_factor"),
        ({"scaling": {**LONGROPE, "long_factor": "1.0"}}, ValueError, "long_factor"),
        (
            {"scaling": {k: v for k, v in LONGROPE.items() if k != "factor"}},
            ValueError,
            "max_position_embeddings",
        ),
        ({"scaling": {**LONGROPE, "original_max_position_embeddings": 1}}, ValueError, "original"),
        # Extreme keys: infinite or vanished frequencies (NaN or 0 angles at every position)
        # and Python's OverflowError, which named no key (a review's finds)
        ({"scaling": {"type": "proportional", "factor": 1e-300}}, ValueError, "holds as inf"),
        ({"scaling": {"type": "linear", "factor": 1e308}}, ValueError, "holds as 0.0"),
        (
            {"scaling": {**LONGROPE, "short_factor": [1e-300] + [1.0] * 31}},
            ValueError,
            "slot 0, which fp32 holds as inf",
        ),
        ({"scaling": {"type": "ntk_alpha", "alpha": 1e300}}, ValueError, "'alpha'.*overflows"),
        (
            {"scaling": {**YARN, "original_max_position_embeddings": 10**400}},
            ValueError,
            "type 'yarn'.*overflows",
        ),
        # A key that another one overrides, or that its type does not read, is checked too
        ({"scaling": {**LONGROPE, "attention_factor": 1.1, "factor": "x"}}, TypeError, "factor"),
        (
            {"scaling": {**LONGROPE, "max_position_embeddings": "x"}},
            TypeError,
            "max_position_embeddings",
        ),
        (
            {
                "scaling": {
                    **LONGROPE,
                    "short_mscale": 1.0,
                    "long_mscale": 1.2,
                    "attention_factor": math.nan,
                }
            },
            ValueError,
            "attention_factor",
        ),
        ({"scaling": {**YARN, "attention_factor": 1.0, "mscale": "x"}}, TypeError, "'mscale'"),
        (
            {"scaling": {"type": "ntk_alpha", "alpha": 1e3, "beta_fast": math.nan}},
            ValueError,
            "beta_fast",
        ),
        (
            {"scaling": {"type": "linear", "factor": 2.0, "max_position_embeddings": "x"}},
            TypeError,
            "max_position_embeddings",
        ),
        ({"seq_len": torch.tensor(True)}, TypeError, "seq_len"),
        ({"seq_len": torch.tensor(3 + 0j)}, TypeError, "seq_len"),
        ({"device": "foo"}, ValueError, "device is not a device: 'foo'"),
        ({"device": 3.0}, TypeError, "device must be"),
    ],
)
def test_rope_frequencies_rejects_bad_arguments(kwargs, error, match):
    kwargs = {"rope_dim": 64, **kwargs}
    with pytest.raises(error, match=match):
        rope_frequencies(**kwargs)


@pytest.mark.parametrize(
    "positions_dtype", [torch.int64, torch.int32, torch.float32, torch.float64]
)
@pytest.mark.parametrize("shape", [(63,), (2, 500)], ids=["N63", "B2-N500"])
def test_rope_angles_are_the_exactly_rounded_product(shape, positions_dtype):
    """fp32(p) * fp32(w) is computed exactly in fp64 (24 + 24 bits < 53), so the angle must
    equal that product rounded once to fp32 (a TF32 matmul would move position 100_000 by up
    to 32, hence its fastest angle by up to 32 rad)."""
    inv, _ = rope_frequencies(128, 500000.0, device=DEVICE)
    positions = torch.randint(0, 1 << 20, shape, device=DEVICE).to(positions_dtype)
    positions.view(-1)[:3] = torch.tensor([0, 100_000, (1 << 20) - 1])
    angles = rope_angles(positions, inv)
    assert angles.dtype == torch.float32 and angles.shape == (*shape, 64)
    ref = (positions.double()[..., None] * inv.double()).float()
    assert torch.equal(angles, ref)


def test_rope_angles_fractional_positions_and_gradient():
    inv = rope_frequencies(32, device=DEVICE)[0].requires_grad_()
    positions = (torch.rand(3, 17, device=DEVICE) * 1000).requires_grad_()
    angles = rope_angles(positions, inv)
    assert torch.equal(angles, positions[..., None].detach() * inv.detach())
    cot = torch.randn_like(angles)
    angles.backward(cot)
    assert_close("d positions", positions.grad, (cot * inv.detach()).sum(-1), atol=1e-3, rtol=1e-6)
    ref = (cot.double() * positions.detach().double()[..., None]).sum((0, 1))
    assert_close("d inv_freq", inv.grad, ref, atol=1e-2, rtol=1e-6)


@pytest.mark.parametrize(
    "positions, inv_freq, error, match",
    [
        ([0, 1, 2], torch.ones(4), TypeError, "positions"),
        (torch.ones(3, dtype=torch.bool), torch.ones(4), TypeError, "positions"),
        (torch.ones(3, dtype=torch.complex64), torch.ones(4), TypeError, "positions"),
        (torch.ones(2, 3, 4), torch.ones(4), ValueError, "positions"),
        (torch.ones(()), torch.ones(4), ValueError, "positions"),
        (torch.arange(3), torch.ones(4, dtype=torch.int64), TypeError, "inv_freq"),
        (torch.arange(3), torch.ones(2, 4), ValueError, "inv_freq"),
        (torch.arange(3), torch.ones(4, device="meta"), ValueError, "device"),
        # NaN angles, then NaN in every output they reach, without an error (a review's find)
        (torch.tensor([0.0, math.inf]), torch.ones(4), ValueError, "positions must be finite"),
        (torch.arange(3), torch.tensor([1.0, math.nan]), ValueError, "inv_freq must be finite"),
        # finite inputs whose fp32 product is not (positions cast to fp32 overflow)
        (torch.tensor([1e300], dtype=torch.float64), torch.ones(2), ValueError, "in fp32 must"),
        (torch.tensor([1e30]), torch.tensor([1e10]), ValueError, "in fp32 must be finite"),
    ],
)
def test_rope_angles_rejects_bad_arguments(positions, inv_freq, error, match):
    with pytest.raises(error, match=match):
        rope_angles(positions, inv_freq)


# ----------------------------------------------------------------------------- M-RoPE


def _axes_by_loop(sections: list[int], interleaved: bool) -> list[int]:
    """The slot -> axis map written out as transformers' Qwen2-VL / Qwen3-VL code reads: the
    contiguous sections one after another; interleaved, every slot axis 0's, then for each
    later axis ``a`` the slots of the slice ``a : K * sections[a] : K`` its
    (``apply_interleaved_mrope``'s assignment, not the implementation's expression)."""
    if interleaved:
        k = len(sections)
        axes = [0] * sum(sections)
        for a in range(1, k):
            axes[a : k * sections[a] : k] = [a] * len(range(a, k * sections[a], k))
        return axes
    axes = []
    for d in range(sum(sections)):
        axes.append(next(a for a in range(len(sections)) if d < sum(sections[: a + 1])))
    return axes


@pytest.mark.parametrize(
    "sections, interleaved",
    [
        ([16, 24, 24], False),
        ([11, 11, 10, 0], False),
        ([2, 0, 5, 1], False),
        ([24, 20, 20], True),
        ([11, 11, 10], True),
        ([3, 3, 2], True),
        ([12, 11, 9], True),  # strided, not round-robin: slot 30 is t's, 31 is h's
    ],
)
@pytest.mark.parametrize("batched", [False, True], ids=["N", "B-N"])
def test_mrope_angles_match_an_explicit_loop(sections, interleaved, batched):
    half = sum(sections)
    inv = torch.rand(half, device=DEVICE)
    shape = (len(sections), 2, 63) if batched else (len(sections), 63)
    positions = torch.randint(0, 100_000, shape, device=DEVICE)
    angles = mrope_angles(positions, inv, sections, interleaved=interleaved)
    assert angles.dtype == torch.float32 and angles.shape == (*shape[1:], half)
    axes = _axes_by_loop(sections, interleaved)
    assert [axes.count(a) for a in range(len(sections))] == sections
    ref = torch.empty(*shape[1:], half, dtype=torch.float64, device=DEVICE)
    for d, a in enumerate(axes):
        ref[..., d] = positions[a].double() * inv[d].double()
    assert torch.equal(angles, ref.float())


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_angles_with_equal_axes_are_rope_angles(interleaved):
    inv, _ = rope_frequencies(128, 1e6, device=DEVICE)
    positions = torch.randint(0, 32768, (2, 500), device=DEVICE)
    angles = mrope_angles(positions.expand(3, 2, 500), inv, [24, 20, 20], interleaved=interleaved)
    assert torch.equal(angles, rope_angles(positions, inv))


def _hf_rotary(module: str, config_name: str, rotary_name: str, rope_parameters: dict, head_dim):
    config_cls, rotary_cls = _hf_classes(module, config_name, rotary_name)
    config = config_cls(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", **rope_parameters},
    )
    return rotary_cls(config)


@pytest.mark.parametrize(
    "module, config_name, rotary_name, theta, sections, interleaved, head_dim, partial",
    [
        pytest.param(
            "qwen2_vl",
            "Qwen2VLTextConfig",
            "Qwen2VLRotaryEmbedding",
            1e6,
            [16, 24, 24],
            False,
            128,
            1.0,
            id="qwen2-vl",
        ),
        pytest.param(
            "qwen3_vl",
            "Qwen3VLTextConfig",
            "Qwen3VLTextRotaryEmbedding",
            5e6,
            [24, 20, 20],
            True,
            128,
            1.0,
            id="qwen3-vl",
        ),
        pytest.param(
            "qwen3_5",
            "Qwen3_5TextConfig",
            "Qwen3_5TextRotaryEmbedding",
            1e7,
            [11, 11, 10],
            True,
            256,
            0.25,
            id="qwen3.5-partial",
        ),
    ],
)
def test_mrope_angles_match_transformers(
    module, config_name, rotary_name, theta, sections, interleaved, head_dim, partial
):
    params = {"rope_theta": theta, "mrope_section": sections, "mrope_interleaved": interleaved}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    rotary = _hf_rotary(module, config_name, rotary_name, params, head_dim)
    positions = torch.randint(0, 20_000, (3, 2, 63))
    cos, sin = rotary(torch.zeros(1), positions)
    if cos.dim() == 4:
        # transformers 4.x: the rotary module returns every axis, [3, B, N, R], and
        # apply_multimodal_rotary_pos_emb picks each section's axis (contiguous sections)
        assert not interleaved, "transformers interleaves inside its rotary module"
        cos, sin = (
            torch.cat([m[i % 3] for i, m in enumerate(x.split(sections * 2, dim=-1))], dim=-1)
            for x in (cos, sin)
        )
    inv = rotary.inv_freq
    assert_close("inv_freq", inv, rope_frequencies(2 * inv.shape[0], theta)[0], 1e-6, 1e-6)
    angles = mrope_angles(positions, inv, sections, interleaved=interleaved)
    # transformers returns [cos(angles), cos(angles)] for the "half" layout
    assert_close("cos", cos, angles.cos().repeat(1, 1, 2), atol=1e-6, rtol=1e-6)
    assert_close("sin", sin, angles.sin().repeat(1, 1, 2), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "positions_shape, sections, interleaved, error, match",
    [
        ((3, 10), [16, 16, 16], False, ValueError, "sections"),
        ((3, 10), [16, 24, -8], False, ValueError, "sections"),
        ((3, 10), [-8, 40, 32], False, ValueError, "non-negative"),
        ((3, 10), [], False, ValueError, "sections"),
        ((3, 10), torch.tensor([16, 24, 24]), False, TypeError, "sections"),
        ((3, 10), [16.0, 24, 24], False, TypeError, "sections must be a list of ints, got.*float"),
        ((4, 10), [16, 24, 24], False, ValueError, "one axis per section"),
        ((10,), [16, 24, 24], False, ValueError, "positions"),
        ((3, 10), [16, 24, 24], True, ValueError, "cannot be interleaved"),
        ((4, 10), [22, 22, 20, 0], True, ValueError, "trailing zero"),
    ],
)
def test_mrope_angles_rejects_bad_arguments(positions_shape, sections, interleaved, error, match):
    positions = torch.zeros(positions_shape, dtype=torch.int64)
    with pytest.raises(error, match=match):
        mrope_angles(positions, torch.ones(64), sections, interleaved=interleaved)


def test_mrope_angles_refuse_non_finite_positions_and_frequencies():
    positions = torch.zeros(3, 10)
    with pytest.raises(ValueError, match="inv_freq must be finite, got nan"):
        mrope_angles(positions, torch.full((32,), math.nan), [16, 8, 8])
    positions[1, 4] = 1e30
    with pytest.raises(ValueError, match="positions \\* inv_freq in fp32 must be finite"):
        mrope_angles(positions, torch.full((32,), 1e10), [16, 8, 8])
    positions[1, 4] = math.inf
    with pytest.raises(ValueError, match="positions must be finite, got inf"):
        mrope_angles(positions, torch.ones(32), [16, 8, 8])


def test_angle_builders_take_empty_frequencies():
    """No rotated slot (rope_dim 0 of a head): ``[..., N, 0]`` angles from every builder; the
    M-RoPE slot index was a float tensor then, an IndexError (a review's find)."""
    positions = torch.arange(4)
    assert mrope_angles(positions[None], torch.ones(0), [0]).shape == (4, 0)
    assert rope_angles(positions, torch.ones(0)).shape == (4, 0)
    assert nd_rope_angles(positions[:, None], torch.ones(1, 1, 0)).shape == (4, 0)


def test_mrope_sections_take_numpy_ints():
    """Sections computed with numpy (np.int64, np.int32) act as the Python ints they equal."""
    positions = torch.randint(0, 50, (3, 10))
    expected = mrope_angles(positions, torch.ones(32), [16, 8, 8])
    sections = [np.int64(16), 8, np.int32(8)]
    assert torch.equal(mrope_angles(positions, torch.ones(32), sections), expected)


# ----------------------------------------------------------------------------- N-d RoPE


@pytest.mark.parametrize("shape", [(63,), (2, 500)], ids=["N63", "B2-N500"])
def test_nd_rope_angles_with_one_axis_are_rope_angles(shape):
    inv, _ = rope_frequencies(64, 10000.0, device=DEVICE)
    positions = torch.randint(0, 200_000, shape, device=DEVICE)
    angles = nd_rope_angles(positions[..., None], inv[None, None])
    assert torch.equal(angles, rope_angles(positions, inv))


@pytest.mark.parametrize(
    "rope_dim, sections, interleaved",
    [
        (128, None, False),
        (128, [16, 24, 24], False),
        (128, [24, 20, 20], True),
        (64, [11, 11, 10, 0], False),
        (64, [11, 11, 10], True),
    ],
)
def test_nd_rope_sections_layout_is_mrope(rope_dim, sections, interleaved):
    n_axes = 3 if sections is None else len(sections)
    freqs = nd_rope_frequencies(
        rope_dim, n_axes, 1e6, sections=sections, interleaved=interleaved, device=DEVICE
    )
    assert freqs.shape == (n_axes, 1, rope_dim // 2) and freqs.dtype == torch.float32
    sections = sections or [22, 21, 21]  # the documented even split of 64 slots
    inv, _ = rope_frequencies(rope_dim, 1e6, device=DEVICE)
    axes = torch.tensor(_axes_by_loop(sections, interleaved), device=DEVICE)
    one_hot = axes == torch.arange(n_axes, device=DEVICE)[:, None]
    assert torch.equal(freqs[:, 0], torch.where(one_hot, inv, 0.0))
    positions = torch.randint(0, 50_000, (n_axes, 2, 63), device=DEVICE)
    angles = nd_rope_angles(positions.movedim(0, -1), freqs)
    assert torch.equal(angles, mrope_angles(positions, inv, sections, interleaved=interleaved))


def test_nd_rope_angles_sum_axes_and_groups():
    """Dense frequencies (every slot mixes every axis and group) against fp64."""
    positions = torch.rand(2, 63, 3, device=DEVICE) * 4096 - 2048
    freqs = torch.randn(3, 2, 40, device=DEVICE)
    angles = nd_rope_angles(positions, freqs)
    ref = torch.einsum("bnp,pgd->bnd", positions.double(), freqs.double())
    bound = (positions.double().abs()[..., :, None, None] * freqs.double().abs()).sum((-3, -2))
    # six fp32 products and five sums: each a rounding of at most 2**-24 of the partial sum
    assert ((angles.double() - ref).abs() <= 8 * 2**-24 * bound + 1e-30).all()
    assert angles.shape == (2, 63, 40) and angles.dtype == torch.float32


def test_nd_rope_angles_gradients():
    positions = (torch.rand(5, 17, 2, device=DEVICE) * 100).requires_grad_()
    freqs = torch.randn(2, 3, 8, device=DEVICE, requires_grad=True)
    angles = nd_rope_angles(positions, freqs)
    cot = torch.randn_like(angles)
    angles.backward(cot)
    f_sum = freqs.detach().double().sum(1)  # [P, R/2]
    ref_pos = torch.einsum("bnd,pd->bnp", cot.double(), f_sum)
    ref_f = torch.einsum("bnd,bnp->pd", cot.double(), positions.detach().double())
    assert_close("d positions", positions.grad, ref_pos, atol=1e-4, rtol=1e-6)
    for g in range(3):  # groups are summed, so every group gets the same gradient
        assert_close(f"d freqs group {g}", freqs.grad[:, g], ref_f, atol=1e-2, rtol=1e-6)


@pytest.mark.parametrize(
    "rope_dim, scaling, head_dim, match",
    [
        (128, {"rope_type": "default", "partial_rotary_factor": 0.5}, 128, "must be 64 "),
        (64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
              "partial_rotary_factor": 0.75}, 64, "must be 48 "),
        (64, {"rope_type": "proportional", "partial_rotary_factor": 0.25}, 128, "must be 128 "),
        (160, None, 128, "must be at most 128 "),
        (64, None, 0, "head_dim must be a positive int, got 0"),
        (64, None, 64.0, "head_dim must be a positive int, got 64.0 of type float"),
    ],
)  # fmt: skip
def test_head_dim_catches_a_rope_dim_that_forgot_the_partial_rotation(
    rope_dim, scaling, head_dim, match
):
    """GLM-4.5's partial_rotary_factor 0.5 in its rope_parameters: rope_dim 128 of a 128 head
    gives 64 valid-looking frequencies on the wrong ladder; with head_dim it is refused, and the
    right rope_dim passes."""
    error = TypeError if isinstance(head_dim, float) else ValueError  # a kind, or a value
    with pytest.raises(error, match=match):
        rope_frequencies(rope_dim, 1e4, scaling, head_dim=head_dim)
    if isinstance(head_dim, int) and head_dim > 0:
        fraction = (scaling or {}).get("partial_rotary_factor", 1.0)
        good = head_dim if (scaling or {}).get("rope_type") == "proportional" else None
        good = good or int(head_dim * fraction)
        inv, _ = rope_frequencies(good, 1e4, scaling, head_dim=head_dim)
        assert inv.shape == (good // 2,)


def test_per_layer_type_rope_parameters_are_named_in_the_error():
    """transformers 5 keeps Gemma 3's rope_parameters per layer type: the error says which
    mapping to pass."""
    nested = {"full_attention": {"rope_type": "linear", "factor": 8.0},
              "sliding_attention": {"rope_type": "default"}}  # fmt: skip
    with pytest.raises(ValueError, match=r"scaling=rope_parameters\['full_attention'\]"):
        rope_frequencies(64, 1e6, nested)
    assert rope_frequencies(64, 1e6, nested["full_attention"])[0].shape == (32,)


def test_nd_rope_axial_layout_is_the_vision_towers_rope():
    """layout="axial" against transformers' Qwen2-VL vision RoPE (an axis a block of the
    slots, each its own ladder over ``R / n_axes`` channels), cos and sin of random (h, w)
    positions; and the blocks' structure for 3 axes."""
    config_cls, rotary_cls = _hf_classes(
        "qwen2_vl", "Qwen2VLVisionConfig", "Qwen2VLVisionRotaryEmbedding"
    )
    config = config_cls()
    head_dim = config.embed_dim // config.num_heads
    positions = torch.randint(0, 64, (50, 2))
    cos, sin = rotary_cls(config)(torch.zeros(1), positions)
    theta = config.rope_parameters["rope_theta"]
    angles = nd_rope_angles(positions, nd_rope_frequencies(head_dim, 2, theta, layout="axial"))
    for name, ours, theirs in (("cos", angles.cos(), cos), ("sin", angles.sin(), sin)):
        # "half" rotations pair slot d with d + R/2: both halves of theirs are the slots
        assert_close(name, torch.cat([ours, ours], dim=-1), theirs, atol=1e-4, rtol=1e-5)
    freqs = nd_rope_frequencies(48, 3, 100.0, layout="axial")[:, 0].double()
    block = 8
    for axis in range(3):
        on = slice(axis * block, (axis + 1) * block)
        ladder = 100.0 ** -(torch.arange(block, dtype=torch.float64) / block)
        _assert_ratio_one(f"axis {axis}", freqs[axis, on], ladder, 1e-7)
        assert (freqs[axis].count_nonzero() == block).item()


def test_nd_rope_mixed_layout():
    gen = torch.Generator().manual_seed(1)
    freqs = nd_rope_frequencies(64, 2, 100.0, layout="mixed", generator=gen)
    again = nd_rope_frequencies(64, 2, 100.0, layout="mixed", generator=gen.manual_seed(1))
    other = nd_rope_frequencies(64, 2, 100.0, layout="mixed", generator=gen.manual_seed(2))
    assert freqs.shape == (2, 1, 32) and torch.equal(freqs, again) and not torch.equal(freqs, other)
    inv, _ = rope_frequencies(64, 100.0)
    # each slot's frequency vector has the ladder's magnitude, in a random direction
    _assert_ratio_one("|freqs| / ladder", freqs[:, 0].double().norm(dim=0), inv, 1e-6)
    assert (freqs[:, 0] != 0).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"n_axes": 0}, ValueError, "n_axes"),
        ({"n_axes": 2.0}, TypeError, "n_axes"),
        ({"rope_dim": 63}, ValueError, "rope_dim"),
        ({"theta": -1.0}, ValueError, "theta"),
        ({"theta": 1.0}, ValueError, "theta"),
        ({"layout": "cubic"}, ValueError, "layout"),
        ({"layout": "axial"}, ValueError, "multiple of n_axes"),
        ({"layout": "axial", "sections": [22, 21, 21]}, ValueError, "sections"),
        ({"sections": [32, 32]}, ValueError, "n_axes"),
        ({"sections": [16, 16, 16]}, ValueError, "sections"),
        ({"layout": "mixed", "sections": [32, 16, 16]}, ValueError, "sections"),
        ({"sections": [16, 24, 24], "interleaved": True}, ValueError, "interleaved"),
        # axes that the even split leaves without a slot, and a generator that draws nothing
        ({"rope_dim": 4}, ValueError, "n_axes = 3 is more than the rope_dim // 2 = 2"),
        ({"generator": torch.Generator()}, ValueError, "generator draws layout='mixed' only"),
        ({"device": "foo"}, ValueError, "device is not a device"),
    ],
)
def test_nd_rope_frequencies_rejects_bad_arguments(kwargs, error, match):
    kwargs = {"rope_dim": 128, "n_axes": 3, **kwargs}
    with pytest.raises(error, match=match):
        nd_rope_frequencies(**kwargs)


@pytest.mark.parametrize(
    "positions, freqs, error, match",
    [
        (torch.zeros(10, 2), torch.ones(3, 1, 8), ValueError, "last dimension"),
        (torch.zeros(10, 3), torch.ones(2, 1, 8), ValueError, "last dimension"),
        (torch.zeros(()), torch.ones(1, 1, 8), ValueError, "last dimension"),
        (torch.zeros(10, 3), torch.ones(3, 8), ValueError, "freqs"),
        (torch.zeros(10, 3), torch.ones(3, 0, 8), ValueError, "group"),
        (torch.zeros(10, 3), torch.ones(3, 1, 8, dtype=torch.int32), TypeError, "freqs"),
        (torch.zeros(10, 3, dtype=torch.bool), torch.ones(3, 1, 8), TypeError, "positions"),
        (torch.zeros(10, 3), torch.ones(3, 1, 8, device="meta"), ValueError, "device"),
        (torch.full((10, 3), math.nan), torch.ones(3, 1, 8), ValueError, "positions must be fin"),
        (torch.zeros(10, 3), torch.full((3, 1, 8), -math.inf), ValueError, "freqs must be finite"),
    ],
)
def test_nd_rope_angles_rejects_bad_arguments(positions, freqs, error, match):
    with pytest.raises(error, match=match):
        nd_rope_angles(positions, freqs)


def test_keys_a_checkpoint_carries_beside_its_schedule():
    """Ministral 3's YaRN rope_parameters carry max_position_embeddings (read by longrope
    only: the frequencies are those without it), Qwen3-Omni's an "interleaved" flag beside
    mrope_interleaved; seq_len may be a numpy int or the 0-d tensor max(position_ids) + 1."""
    yarn = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384}
    inv, factor = rope_frequencies(128, 1e6, yarn)
    inv2, factor2 = rope_frequencies(128, 1e6, {**yarn, "max_position_embeddings": 262144})
    assert torch.equal(inv, inv2) and factor == factor2
    omni = {  # Qwen3-Omni's thinker
        "rope_type": "default",
        "mrope_section": [24, 20, 20],
        "interleaved": True,
        "mrope_interleaved": True,
    }
    assert torch.equal(rope_frequencies(128, 1e6, omni)[0], rope_frequencies(128, 1e6)[0])
    with pytest.raises(TypeError, match="interleaved"):
        rope_frequencies(128, 1e6, {**omni, "interleaved": "yes"})
    dynamic = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    by_int = rope_frequencies(32, scaling=dynamic, seq_len=100)[0]
    for seq_len in (np.int64(100), torch.tensor(99) + 1):
        assert torch.equal(rope_frequencies(32, scaling=dynamic, seq_len=seq_len)[0], by_int)


def test_angle_builders_refuse_half_precision_and_loose_flags():
    """fp16 / bf16 frequencies or positions put far positions whole radians off (the kernels
    refuse them too); a string is not a bool."""
    inv = rope_frequencies(16)[0]
    positions = torch.arange(40)
    with pytest.raises(TypeError, match="inv_freq"):
        rope_angles(positions, inv.half())
    with pytest.raises(TypeError, match="half precision"):
        rope_angles(positions.bfloat16(), inv)
    with pytest.raises(TypeError, match="half precision"):
        rope_angles(positions.half(), inv)
    with pytest.raises(TypeError, match="interleaved"):
        mrope_angles(positions.expand(3, 40), inv, [4, 2, 2], interleaved="False")


def test_angles_are_fp32_products_of_fp32_positions_and_frequencies():
    """rope_angles multiplies in fp32, as the kernels do: fp64 frequencies or fractional fp64
    positions give the angles of their fp32 roundings, bit for bit (an fp64 product differs
    in the last place at positions near 5000)."""
    inv64 = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    positions = torch.arange(4990, 5000, dtype=torch.float64) + 0.1
    expected = rope_angles(positions.float(), inv64.float())
    assert torch.equal(rope_angles(positions, inv64), expected)


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_a_factor_of_one_is_no_scaling(kind):
    """linear, and dynamic NTK within its original length, at factor 1 are the unscaled
    ladder (a schedule left at its neutral value in a sweep), not an error."""
    scaling = {"type": kind, "factor": 1.0}
    if kind == "dynamic":
        scaling["original_max_position_embeddings"] = 32
    got, factor = rope_frequencies(64, 10000.0, scaling, seq_len=32)
    want, _ = rope_frequencies(64, 10000.0)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert factor == 1.0


def test_longrope_takes_factor_before_max_position_embeddings():
    """A checkpoint with both (they may disagree): the attention factor is of ``factor``."""
    _, factor = rope_frequencies(64, 1e4, {**LONGROPE, "max_position_embeddings": 131072})
    assert factor == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(4096)))


def test_partial_rotary_factor_truncates_as_transformers():
    """``int(head_dim * fraction)``, as transformers: 0.35 of 128 is 44 channels, not 45."""
    inv, _ = rope_frequencies(44, 1e4, {"partial_rotary_factor": 0.35}, head_dim=128)
    assert inv.shape == (22,)


def test_angle_builders_defaults():
    """``mrope_angles`` lays the axes out contiguously (Qwen2-VL) unless asked to interleave;
    ``nd_rope_frequencies``'s theta is RoPE's 10000."""
    pos, inv_freq = torch.arange(15).reshape(3, 5), rope_frequencies(64)[0]
    contiguous = mrope_angles(pos, inv_freq, [16, 8, 8], interleaved=False)
    assert torch.equal(mrope_angles(pos, inv_freq, [16, 8, 8]), contiguous)
    assert torch.equal(nd_rope_frequencies(64, 1)[0, 0], rope_frequencies(64)[0])
