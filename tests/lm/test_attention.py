"""The attention variants of lm/attention.py against plain fp64 math, and their config checks."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from corope.naive import corope_attention_ref
from fused_rope.frequencies import rope_angles, rope_frequencies
from fused_rope.naive import apply_rope_ref, rope_attention_ref
from lm.attention import (
    ATTENTIONS,
    CoRopeAttention,
    RotaryFrequencies,
    build_attention,
    check_attention_config,
    nope_layers,
    scaling_dict,
    window_layers,
)
from lm.config import ATTENTION_SCHEMAS, ModelConfig
from lm.profiling import AttentionTimer
from tests.helpers import DEVICE, assert_close


def attn_cfg(name: str, **overrides):
    return OmegaConf.merge(OmegaConf.structured(ATTENTION_SCHEMAS[name]), overrides)


def causal_attention64(q, k, v):
    """fp64 softmax attention, GQA by repeating the KV heads."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def qkv(B=2, H=4, HKV=2, N=37, D=16, dtype=torch.float32):
    q = torch.randn(B, H, N, D, device=DEVICE, dtype=dtype)
    k = torch.randn(B, HKV, N, D, device=DEVICE, dtype=dtype)
    v = torch.randn(B, HKV, N, D, device=DEVICE, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("name", ["nope", "sinusoidal", "learned"])
def test_position_free_variants_are_causal_gqa_attention(name):
    attn = build_attention(attn_cfg(name), d_model=64, n_head=4, n_kv_head=2).to(DEVICE)
    q, k, v = qkv()
    assert_close(name, attn.attend(q, k, v), causal_attention64(q, k, v), atol=1e-5, rtol=1e-5)


def test_projection_layout_is_pinned():
    """The weights' layout, which checkpoints hold: q = x wq^T as [heads, head_dim]; wkv's
    first n_kv_head * head_dim rows make the keys, the rest the values; the heads' outputs
    concatenated in order go through wo. (Swapping k and v trains as well from scratch, so
    only this golden computation tells; a saved model would load and compute garbage.)"""
    B, N, C, H, HKV, D = 2, 11, 32, 4, 2, 8
    attn = build_attention(attn_cfg("nope"), d_model=C, n_head=H, n_kv_head=HKV).to(DEVICE)
    x = torch.randn(B, N, C, device=DEVICE)
    split = lambda t, h: t.view(B, N, h, D).transpose(1, 2)  # (B, h, N, D)
    q = split(x @ attn.wq.weight.T, H)
    kv = x @ attn.wkv.weight.T
    k, v = split(kv[..., : HKV * D], HKV), split(kv[..., HKV * D :], HKV)
    o = causal_attention64(q, k, v).transpose(1, 2).reshape(B, N, H * D)
    expected = o @ attn.wo.weight.T.double()
    assert_close("out", attn(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rope_dim", [None, 8])
def test_rope_torch_path(layout, rope_dim):
    cfg = attn_cfg("rope", impl="torch", layout=layout, rope_dim=rope_dim)
    attn = build_attention(cfg, d_model=64, n_head=4, n_kv_head=1).to(DEVICE)
    q, k, v = qkv(HKV=1)
    R = rope_dim or 16
    angles = rope_angles(torch.arange(q.shape[2]), rope_frequencies(R)[0]).double().to(DEVICE)
    ref = causal_attention64(
        apply_rope_ref(q.double(), angles, layout, R),
        apply_rope_ref(k.double(), angles, layout, R),
        v,
    )
    assert_close("rope", attn.attend(q, k, v), ref, atol=1e-5, rtol=1e-5)


def test_rope_torch_path_scales_q_and_k_by_yarns_attention_factor():
    """YaRN (factor 4): YaRN's frequencies, and q and k multiplied by its attention factor
    (mscale 1.139), as HF's scaled cos/sin do."""
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    attn = build_attention(attn_cfg("rope", impl="torch", scaling=scaling), 64, 4, 1).to(DEVICE)
    q, k, v = qkv(HKV=1)
    inv_freq, factor = rope_frequencies(16, 10000.0, scaling)
    assert factor > 1.1
    angles = rope_angles(torch.arange(q.shape[2]), inv_freq).double().to(DEVICE)
    rotated = (factor * apply_rope_ref(x.double(), angles, "half", 16) for x in (q, k))
    assert_close("yarn", attn.attend(q, k, v), causal_attention64(*rotated, v), 1e-5, 1e-5)


@pytest.mark.parametrize(
    "layout, rope_dim", [("half", None), ("interleaved", None), ("interleaved", 8)]
)
def test_rope_triton_path_matches_torch_path(layout, rope_dim):
    """Both paths take the layout and the rotated width (a review: the Triton path dropping
    the layout passed every lm test)."""
    q, k, v = qkv(N=63)
    out = {}
    for impl in ("torch", "triton"):
        cfg = attn_cfg(
            "rope",
            impl=impl,
            layout=layout,
            rope_dim=rope_dim,
            scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        )
        attn = build_attention(cfg, d_model=64, n_head=4, n_kv_head=2).to(DEVICE)
        out[impl] = attn.attend(q, k, v)
    assert_close("rope triton vs torch", out["triton"], out["torch"], atol=1e-4, rtol=1e-5)


def test_corope_triton_path_matches_torch_path():
    q, k, v = qkv(B=1, H=2, HKV=1, N=40, D=32)
    out = {}
    for impl in ("torch", "triton"):
        attn = build_attention(attn_cfg("corope", impl=impl), d_model=64, n_head=2, n_kv_head=1)
        out[impl] = attn.to(DEVICE).attend(q, k, v)
    assert_close("corope triton vs torch", out["triton"], out["torch"], atol=1e-4, rtol=1e-5)


def test_corope_torch_path_is_the_reference():
    from corope.naive import corope_attention_ref

    cfg = attn_cfg("corope", impl="torch", leader="mean", chunk_size=16)
    attn = build_attention(cfg, d_model=64, n_head=4, n_kv_head=2).to(DEVICE)
    q, k, v = qkv(N=45)
    ref = corope_attention_ref(q.double(), k.double(), v.double(), leader="mean")
    assert_close("corope", attn.attend(q, k, v), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dynamic", "xdrope"])  # xdrope: HunyuanOCR's name of it
def test_dynamic_ntk_recomputes_beyond_the_training_length(kind):
    scaling = {"type": kind, "factor": 4.0, "original_max_position_embeddings": 32}
    freqs = RotaryFrequencies(16, 10000.0, scaling)
    assert torch.equal(freqs.for_length(32)[0], rope_frequencies(16)[0])
    longer = freqs.for_length(128)[0]
    assert torch.equal(longer, rope_frequencies(16, scaling=scaling, seq_len=128)[0])
    assert (longer[1:] < freqs.inv_freq[1:]).all()


LONGROPE = {  # 16 rotated channels: 8 factors each
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.5, 11.0, 14.0],
    "original_max_position_embeddings": 32,
    "attention_factor": 1.0,  # Co-RoPE takes frequencies alone
}


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
@pytest.mark.parametrize("name", ["rope", "corope"])
def test_attend_takes_the_dynamic_frequencies_of_its_length(name, kind):
    """Dynamic NTK and LongRoPE past the training length: ``attend`` on 96 tokens rotates with
    the frequencies ``rope_frequencies`` gives for ``seq_len=96``, not the stored ones."""
    from corope.naive import corope_attention_ref

    scaling = (
        {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 32}
        if kind == "dynamic"
        else LONGROPE
    )
    attn = build_attention(attn_cfg(name, impl="torch", scaling=scaling), 64, 4, 2).to(DEVICE)
    q, k, v = qkv(N=96)
    inv_freq = rope_frequencies(16, scaling=scaling, seq_len=96)[0].to(DEVICE)
    assert not torch.equal(inv_freq, attn.freqs.inv_freq)  # the test can tell them apart
    if name == "rope":
        angles = rope_angles(torch.arange(96, device=DEVICE), inv_freq).double()
        q64, k64 = (apply_rope_ref(x.double(), angles, "half", 16) for x in (q, k))
        ref = causal_attention64(q64, k64, v)
    else:
        q64, k64, v64 = q.double(), k.double(), v.double()
        ref = corope_attention_ref(q64, k64, v64, inv_freq=inv_freq.double())
    assert_close(name, attn.attend(q, k, v), ref, atol=1e-5, rtol=1e-5)


def test_corope_detach_mileage_reaches_the_reference():
    """``attention.detach_mileage`` is passed on: the query gradient (whose leader head carries
    the gate path) is the reference's with the mileage held constant, and not without."""
    from corope.naive import corope_attention_ref

    q, k, v = (x.double().requires_grad_() for x in qkv(N=29))
    cot = torch.randn_like(q)
    cfg = attn_cfg("corope", impl="torch", detach_mileage=True)
    attn = build_attention(cfg, 64, 4, 2).to(DEVICE).double()
    (dq,) = torch.autograd.grad((attn.attend(q, k, v) * cot).sum(), q)
    want = {}
    for detach in (True, False):
        o = corope_attention_ref(q, k, v, detach_mileage=detach)
        (want[detach],) = torch.autograd.grad((o * cot).sum(), q)
    assert_close("dq", dq, want[True], atol=1e-10, rtol=1e-10)
    assert (want[True] - want[False]).abs().max() > 1e-3


def test_corope_checks_its_kernels_head_dims_for_the_device():
    """Head dim 16 (d_model 64 over 4 heads): the torch path takes it anywhere; the Triton
    kernels (``impl=triton``, or ``auto`` on CUDA) do not, and the check says so from the
    configs, before a layer is built or a step runs."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    model = OmegaConf.structured(ModelConfig(d_model=64, n_head=4, n_kv_head=2))
    auto = attn_cfg("corope", impl="auto")
    check_attention_config(auto, model, cpu)
    with pytest.raises(ValueError, match="got 16 .model.head_dim"):
        check_attention_config(auto, model, cuda)
    with pytest.raises(ValueError, match="got 48 .model.head_dim"):  # model.head_dim wins
        check_attention_config(auto, OmegaConf.merge(model, {"head_dim": 48}), cuda)
    check_attention_config(attn_cfg("corope", impl="torch"), model, cuda)
    CoRopeAttention.check_device(attn_cfg("corope", impl="triton"), 32, cpu)


@pytest.mark.parametrize("name", sorted(ATTENTION_SCHEMAS))
def test_query_scale_multiplies_the_queries_by_their_positions_scale(name):
    """``attention.query_scale``: the layer's output is ``attend`` of the queries times
    ``1 + beta ln(1 + floor(p / length))``; without the key, of the queries as projected."""
    cfg = attn_cfg(name, query_scale={"beta": 0.5, "length": 5})
    if name in ("rope", "corope"):
        cfg.impl = "torch"
    attn = build_attention(cfg, 64, 4, 2).to(DEVICE).double()
    x = torch.randn(2, 23, 64, device=DEVICE, dtype=torch.float64)
    q = attn.wq(x).view(2, 23, 4, 16).transpose(1, 2)
    k, v = attn.wkv(x).view(2, 23, 2, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
    steps = torch.arange(23, device=DEVICE) // 5
    q = q * (1 + 0.5 * torch.log1p(steps.double()))[:, None]
    expected = attn.wo(attn.attend(q, k, v).transpose(1, 2).reshape(2, 23, 64))
    assert_close(name, attn(x), expected, atol=1e-6, rtol=1e-6)
    assert build_attention(attn_cfg(name), 64, 4, 2).query_scale is None
    beta0 = attn_cfg(name, query_scale={"beta": 0.0, "length": 5})
    assert build_attention(beta0, 64, 4, 2).query_scale is None  # no multiply by ones


@pytest.mark.parametrize("name", ["rope", "corope"])
def test_nope_interval_leaves_every_kth_layer_without_rotation(name):
    """Llama 4's interleaving: layers k - 1, 2k - 1, ... are plain attention (no rotation, no
    frequencies), the others the configured one; ``query_scale.layers=nope`` scales the
    queries of the former alone, as Llama 4 does."""
    from lm.model import GPT

    model_cfg = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), {"d_model": 64, "n_layer": 5, "n_head": 4}
    )
    scale = {"beta": 0.5, "length": 4, "layers": "nope"}
    cfg = attn_cfg(name, impl="torch", nope_interval=2, query_scale=scale)
    model = GPT(model_cfg, cfg, vocab_size=11, max_len=32)
    kinds = [type(block.attn).__name__ for block in model.blocks]
    rotary = type(build_attention(attn_cfg(name), 64, 4, 2)).__name__
    assert kinds == [rotary, "Attention", rotary, "Attention", rotary]
    assert [block.attn.query_scale for block in model.blocks] == [None, (0.5, 4, 0)] * 2 + [None]
    assert nope_layers(attn_cfg(name, nope_interval=3), 9) == {2, 5, 8}
    assert nope_layers(attn_cfg(name), 9) == set()
    everywhere = attn_cfg(name, impl="torch", query_scale=scale | {"layers": "all"})
    assert all(b.attn.query_scale for b in GPT(model_cfg, everywhere, 11, 32).blocks)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"nope_interval": 1}, r"nope_interval needs an int in \[2, model.n_layer=4\].*got 1"),
        ({"nope_interval": 5}, r"got 5"),
        ({"nope_interval": 0}, r"got 0"),
        ({"query_scale": {"beta": 0.1, "length": 8, "layers": "nope"}}, r"has none"),
    ],
)
def test_bad_nope_settings_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        nope_layers(attn_cfg("rope", **overrides), 4)


@pytest.mark.parametrize("name", ["nope", "sinusoidal", "learned", "rope"])
def test_window_layers_attend_within_their_window(name):
    """``attention.window`` gives every layer but those of ``global_interval`` a causal
    sliding window (Gemma 3's local layers), which reaches the attention: the fp64 math with
    the window's mask, on both of RoPE's paths' common part (its torch path here)."""
    from lm.model import GPT

    model_cfg = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), {"d_model": 64, "n_layer": 5, "n_head": 4}
    )
    cfg = attn_cfg(
        name, window=6, global_interval=3, **({"impl": "torch"} if name == "rope" else {})
    )
    model = GPT(model_cfg, cfg, vocab_size=11, max_len=32)
    assert [block.attn.window for block in model.blocks] == [6, 6, None, 6, 6]
    assert window_layers(attn_cfg(name, window=4), 3) == {0: 4, 1: 4, 2: 4}
    assert window_layers(attn_cfg(name), 3) == {}
    if name == "rope":
        return  # its rotation: test_rope_window_reaches_both_paths
    attn = build_attention(cfg, 64, 4, 2, window=6).to(DEVICE)
    q, k, v = qkv()
    i, j = torch.arange(37, device=DEVICE)[:, None], torch.arange(37, device=DEVICE)[None, :]
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / 4
    s = s.masked_fill((j > i) | (j <= i - 6), float("-inf"))
    expected = s.softmax(-1) @ v.double().repeat_interleave(2, 1)
    assert_close("o", attn.attend(q, k, v), expected, atol=1e-5, rtol=1e-5)


def test_window_theta_is_the_windowed_layers_unscaled_base():
    """Gemma 3: the local (windowed) layers rotate at their own base without scaling, the
    global ones at theta with the schedule (linear 8 here)."""
    from lm.model import GPT

    model_cfg = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), {"d_model": 64, "n_layer": 3, "n_head": 4}
    )
    scaling = {"type": "linear", "factor": 8.0}
    cfg = attn_cfg(
        "rope", window=4, global_interval=3, theta=1e6, window_theta=1e4, scaling=scaling
    )
    freqs = [block.attn.freqs for block in GPT(model_cfg, cfg, vocab_size=11, max_len=32).blocks]
    assert [(f.theta, f.scaling) for f in freqs] == [(1e4, None)] * 2 + [
        (1e6, {"type": "linear", "factor": 8.0})
    ]
    local = rope_frequencies(16, 1e4)[0]
    assert torch.equal(freqs[0].inv_freq, local)
    assert torch.equal(freqs[2].inv_freq, rope_frequencies(16, 1e6, scaling)[0])


def test_rope_window_reaches_both_paths():
    """RoPE's Triton path (the fused kernel, in the interpreter on a CPU) and its torch path
    give the windowed attention of the rotated q and k."""
    attn = build_attention(attn_cfg("rope", impl="torch"), 64, 4, 2, window=5).to(DEVICE)
    q, k, v = qkv()
    expected = attn.attend(q, k, v)
    ref, _ = rope_attention_ref(q, k, v, window=5)
    assert_close("o", expected, ref, atol=1e-5, rtol=1e-5)
    full, _ = rope_attention_ref(q, k, v)
    assert (full - ref).abs().max() > 1e-3  # the window hides keys here
    attn.impl = "triton"
    assert_close("o", attn.attend(q, k, v), ref, atol=1e-5, rtol=1e-5)


def test_corope_window_reaches_both_paths():
    """Co-RoPE's Triton path (its kernels, in the interpreter on a CPU) and its torch path
    (the reference) give the windowed attention, which differs from the unwindowed one."""
    attn = build_attention(attn_cfg("corope", impl="torch"), 128, 4, 2, window=5).to(DEVICE)
    q, k, v = qkv(D=32)  # a head dim the kernels take
    expected = attn.attend(q, k, v)
    ref = corope_attention_ref(q, k, v, window=5)
    assert_close("o", expected, ref, atol=1e-5, rtol=1e-5)
    assert (corope_attention_ref(q, k, v) - ref).abs().max() > 1e-3  # the window hides keys
    attn.impl = "triton"
    assert_close("o", attn.attend(q, k, v), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"window": 0}, r"attention.window must be an int >= 1 or null, got 0"),
        ({"window": -3}, r"got -3"),
        ({"global_interval": 2}, r"global_interval=2 .* attention.window is null"),
        (
            {"window": 8, "global_interval": 1},
            r"global_interval needs an int in \[2, model.n_layer=4\]",
        ),
        ({"window": 8, "global_interval": 5}, r"got 5"),
        (
            {"window_theta": 1e4},
            r"window_theta=10000.0 is the RoPE base .* attention.window is null",
        ),
        ({"window": 8, "window_theta": 0.5}, r"attention.window_theta: theta must be > 1"),
    ],
)
def test_bad_window_settings_name_the_key(overrides, match):
    name = overrides.pop("name", "rope")
    with pytest.raises(ValueError, match=match):
        window_layers(attn_cfg(name, **overrides), 4)


def test_nope_interval_needs_two_layers():
    with pytest.raises(ValueError, match=r"needs model.n_layer >= 2 .*got 2"):
        nope_layers(attn_cfg("rope", nope_interval=2), 1)


@pytest.mark.parametrize(
    "query_scale, match",
    [
        ({"beta": 0.1, "length": 8, "layers": "rope"}, r"'all' or 'nope'"),
        ({"beta": 0.1, "length": 8, "offset": -1}, r"offset must be an int >= 0"),
        ({"layers": "nope"}, r"query_scale.layers=nope set but .*beta is null"),
        ({"offset": 1}, r"query_scale.offset=1 set but .*beta is null"),
    ],
)
def test_bad_query_scale_settings_name_the_key(query_scale, match):
    with pytest.raises(ValueError, match=match):
        build_attention(attn_cfg("nope", query_scale=query_scale), 64, 4, 2)


def test_query_scale_offset_counts_positions_from_it():
    """Llama 4 counts positions from 1 (``offset: 1``): its scale steps up one position
    before Ministral 3's, at p = length - 1."""
    cfg = attn_cfg("nope", query_scale={"beta": 1.0, "length": 4, "offset": 1})
    attn = build_attention(cfg, 64, 4, 2).to(DEVICE).double()
    q = torch.ones(1, 4, 9, 16, device=DEVICE, dtype=torch.float64)
    steps = (torch.arange(9, device=DEVICE) + 1) // 4  # 0 0 0 1 1 1 1 2 2
    expected = 1 + torch.log1p(steps.double())
    assert_close("scale", attn._scale_queries(q, 0)[0, 0, :, 0], expected, atol=1e-6, rtol=1e-6)


def test_layer_settings_are_checked_before_the_data_loads():
    model = OmegaConf.structured(ModelConfig(n_layer=2))
    with pytest.raises(ValueError, match="nope_interval"):
        check_attention_config(attn_cfg("rope", nope_interval=3), model, torch.device("cpu"))
    with pytest.raises(ValueError, match="has none"):
        scale = {"beta": 0.1, "length": 8, "layers": "nope"}
        check_attention_config(attn_cfg("rope", query_scale=scale), model, torch.device("cpu"))


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("rope", {"theta": 1.0}, r"^attention: theta must be > 1"),
        ("rope", {"scaling": {"type": "linear", "factor": 0.5}}, r"^attention: scaling\['factor'\]"),
        ("rope", {"impl": "trtion"}, r"^attention.impl must be one of"),
        ("rope", {"layout": "neox"}, r"^attention.layout must be"),
        ("corope", {"leader": "last"}, r"^attention.leader must be"),
        ("rope", {"learn_freq": True, "scaling": {"type": "dynamic", "factor": 2.0,
                  "original_max_position_embeddings": 64}}, r"learn_freq=true cannot learn"),
        # a windowed layer's own base is checked too
        ("rope", {"window": 8, "global_interval": 2, "theta": 0.5}, r"theta must be > 1"),
    ],
)  # fmt: skip
def test_a_layers_own_checks_run_before_the_data_loads(name, overrides, match):
    """What a layer refuses when built (its base, schedule, layout, impl, leader) is refused by
    check_attention_config, which runs before the data loads: it came after the dataset was
    built (a Hub corpus's download), some errors without the config's name (a review's find)."""
    model = OmegaConf.structured(ModelConfig(n_layer=4))
    with pytest.raises(ValueError, match=match):
        check_attention_config(attn_cfg(name, **overrides), model, torch.device("cpu"))


@pytest.mark.parametrize(
    "overrides",
    [
        {"scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
        {"theta": 1e6},
        {"global_interval": 2, "nope_interval": 2, "theta": 5e5},  # Command A's pattern
    ],
)
def test_window_theta_with_no_global_rotary_layer_refuses_a_theta_or_schedule(overrides):
    """With window_theta every windowed layer takes that base, unscaled: where no layer is
    global and rotary, attention.theta and scaling reach no layer, and rope_yarn trained plain
    RoPE under its name (a review's find). Without them set, or with a global rotary layer,
    window_theta is taken."""
    model = OmegaConf.structured(ModelConfig(n_layer=4))
    cpu = torch.device("cpu")
    cfg = attn_cfg("rope", window=8, window_theta=1e4, **overrides)
    with pytest.raises(ValueError, match=r"would reach no layer: with attention.window_theta"):
        check_attention_config(cfg, model, cpu)
    check_attention_config(attn_cfg("rope", window=8, window_theta=1e4), model, cpu)
    if "global_interval" not in overrides:
        check_attention_config(OmegaConf.merge(cfg, {"global_interval": 2}), model, cpu)


def test_query_scale_keeps_the_queries_dtype(monkeypatch):
    """The scale is cast to q's dtype before the product, as transformers does: bf16 queries
    stay bf16 (an fp32 scale would promote them) and reach attend rounded as theirs are."""
    attn = build_attention(attn_cfg("nope", query_scale={"beta": 0.5, "length": 4}), 32, 4, 2)
    attn = attn.to(DEVICE, torch.bfloat16)
    seen = []
    monkeypatch.setattr(attn, "attend", lambda q, k, v: seen.append(q) or q)
    x = torch.randn(1, 11, 32, device=DEVICE, dtype=torch.bfloat16)
    attn(x)
    q = attn.wq(x).view(1, 11, 4, 8).transpose(1, 2)
    steps = torch.arange(11, device=DEVICE) // 4
    expected = q * (1 + 0.5 * torch.log1p(steps.float())).to(torch.bfloat16)[:, None]
    assert seen[0].dtype == torch.bfloat16
    assert torch.equal(seen[0], expected)


def test_scaling_dict_drops_unset_keys():
    cfg = attn_cfg("rope", scaling={"type": "linear", "factor": 2.0})
    assert scaling_dict(cfg.scaling) == {"type": "linear", "factor": 2.0}
    assert scaling_dict(attn_cfg("rope").scaling) is None


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("rope", {"impl": "cuda"}, "attention.impl"),
        ("corope", {"impl": "fast"}, "attention.impl"),
        ("rope", {"rope_dim": 7}, "attention.rope_dim"),
        ("rope", {"layout": "diagonal"}, "attention.layout"),
        ("corope", {"leader": "last"}, "attention.leader"),
        (
            "corope",
            {"scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
            r"attention factor of 1.139.*attention.scaling.attention_factor=1.0",
        ),
        ("rope", {"scaling": {"factor": 4.0}}, r"attention.scaling.factor=4.0 set but .*type"),
        ("corope", {"scaling": {"alpha": 2.0}}, r"attention.scaling.alpha=2.0 set but .*type"),
        ("rope", {"scaling": {"type": "su"}}, r"'longrope' is missing the key\(s\) \['short_f"),
        ("nope", {"query_scale": {"length": 64}}, r"query_scale.length=64 set but .*beta"),
        ("rope", {"query_scale": {"beta": 0.1}}, r"attention.query_scale .*length=None"),
        ("corope", {"query_scale": {"beta": -0.1, "length": 8}}, r"query_scale .*beta must"),
        ("learned", {"query_scale": {"beta": 0.1, "length": 0}}, r"query_scale .*length=0"),
    ],
)
def test_bad_attention_settings_name_the_key(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        build_attention(attn_cfg(name, **overrides), 64, 4, 2)


@pytest.mark.parametrize("name", ["rope", "corope"])
def test_an_odd_head_dim_names_the_model_sizes(name):
    """d_model 60 over 4 heads: head dim 15, which a full rotation cannot take; the message
    names the sizes, not the rope_dim the user never set. An even rope_dim inside it runs."""
    with pytest.raises(
        ValueError, match=r"model.head_dim, or model.d_model / model.n_head\) must be even.*got 15"
    ):
        build_attention(attn_cfg(name), 60, 4, 2)
    build_attention(attn_cfg(name, rope_dim=14), 60, 4, 2)


def test_corope_takes_a_schedules_frequencies_when_its_factor_is_one():
    """YaRN with attention_factor=1.0: Co-RoPE gets YaRN's frequencies, nothing is dropped."""
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    attn = build_attention(
        attn_cfg("corope", scaling={**scaling, "attention_factor": 1.0}), 64, 4, 2
    )
    expected, factor = rope_frequencies(16, 10000.0, {**scaling, "attention_factor": 1.0})
    assert factor == 1.0 and torch.equal(attn.freqs.inv_freq, expected)
    assert not torch.equal(expected, rope_frequencies(16, 10000.0)[0])


@pytest.mark.parametrize("name", ["rope", "corope"])
def test_casting_the_module_keeps_the_frequencies_exact(name):
    """``.bfloat16()`` / ``.half()`` (inference in half precision) cast the weights but not
    the frequencies, which stay the fp32 schedule (bf16 ones were refused by the kernels and
    off by up to 2^-9 in the torch path); ``.double()`` widens them."""
    scaling = {"type": "linear", "factor": 2.0}
    attn = build_attention(attn_cfg(name, scaling=scaling), 64, 4, 2)
    expected = rope_frequencies(16, 10000.0, scaling)[0]
    for cast in (torch.nn.Module.bfloat16, torch.nn.Module.half):
        cast(attn)
        assert attn.wq.weight.dtype != torch.float32
        assert attn.freqs.inv_freq.dtype == torch.float32
        assert torch.equal(attn.freqs.inv_freq, expected)
    attn.double()
    assert torch.equal(attn.freqs.inv_freq, expected.double())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_learned_rope_frequencies(impl):
    """``learn_freq=true``: the schedule's frequencies as a parameter in log space, the same
    attention at initialisation, the float64 reference's gradient on both paths (the Triton
    one from q's and k's gradients), and fp32 values (and gradients) whatever the module is
    cast to."""
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
    fixed = build_attention(attn_cfg("rope", impl="torch", scaling=scaling), 64, 4, 2)
    learned = build_attention(
        attn_cfg("rope", impl=impl, scaling=scaling, learn_freq=True), 64, 4, 2
    )
    expected = rope_frequencies(16, 10000.0, scaling)[0]
    log_freq = learned.freqs.log_inv_freq
    assert isinstance(log_freq, torch.nn.Parameter) and log_freq.dtype == torch.float32
    assert torch.equal(log_freq, expected.log())
    assert [n for n, _ in learned.named_parameters()].count("freqs.log_inv_freq") == 1
    fixed, learned = fixed.to(DEVICE), learned.to(DEVICE)
    q, k, v = qkv()
    do = torch.randn_like(q)
    out = learned.attend(q, k, v)
    assert_close("o", out, fixed.attend(q, k, v), atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad((out * do).sum(), log_freq)
    # the float64 truth: attention of the reference's rotation by the learned frequencies
    leaf = log_freq.detach().clone().requires_grad_()
    angles = rope_angles(torch.arange(q.shape[2], device=DEVICE), leaf.exp()).double()
    rotate = lambda x: apply_rope_ref(x.double(), angles, "half", 16)
    ref = causal_attention64(rotate(q), rotate(k), v)
    (ref_grad,) = torch.autograd.grad((ref * do.double()).sum(), leaf)
    assert grad.abs().max() > 0
    assert_close("dlog_inv_freq", grad, ref_grad, atol=1e-5 * ref_grad.abs().max().item(),
                 rtol=1e-5)  # fmt: skip
    with torch.no_grad():
        log_freq.add_(0.01)
    log_freq.grad = grad.clone()  # Module._apply casts a gradient's data in place
    learned.bfloat16()
    assert learned.wq.weight.dtype == torch.bfloat16
    assert learned.freqs.log_inv_freq.dtype == torch.float32
    assert torch.equal(learned.freqs.log_inv_freq, expected.log().to(DEVICE) + 0.01)
    assert torch.equal(learned.freqs.log_inv_freq.grad, grad)  # an optimizer step still runs


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_learned_corope_frequencies(impl):
    """Co-RoPE's ``learn_freq=true``: the same attention at initialisation, and the float64
    reference's gradient of ``log_inv_freq`` on both paths (the Triton one from the backward
    kernel's frequency path)."""
    from corope.naive import corope_attention_ref

    fixed = build_attention(attn_cfg("corope", impl="torch"), 128, 4, 2).to(DEVICE)
    learned = build_attention(attn_cfg("corope", impl=impl, learn_freq=True), 128, 4, 2)
    learned = learned.to(DEVICE)
    log_freq = learned.freqs.log_inv_freq
    assert isinstance(log_freq, torch.nn.Parameter) and log_freq.shape == (16,)
    q, k, v = qkv(D=32)
    do = torch.randn_like(q)
    out = learned.attend(q, k, v)
    assert_close("o", out, fixed.attend(q, k, v), atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad((out * do).sum(), log_freq)
    leaf = log_freq.detach().double().requires_grad_()
    ref = corope_attention_ref(q.double(), k.double(), v.double(), inv_freq=leaf.exp())
    (ref_grad,) = torch.autograd.grad((ref * do.double()).sum(), leaf)
    assert grad.abs().max() > 0
    assert_close("dlog_inv_freq", grad, ref_grad, atol=1e-4 * ref_grad.abs().max().item(),
                 rtol=1e-5)  # fmt: skip


def test_learned_rope_frequencies_refuse_those_that_follow_the_length():
    dynamic = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    with pytest.raises(ValueError, match="cannot learn dynamic NTK's frequencies"):
        build_attention(attn_cfg("rope", scaling=dynamic, learn_freq=True), 64, 4, 2)
    with pytest.raises(ValueError, match="cannot learn LongRoPE's frequencies"):
        build_attention(attn_cfg("rope", scaling=LONGROPE, learn_freq=True), 64, 4, 2)


def test_unknown_attention_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown attention.name 'alibi'.*corope"):
        build_attention(OmegaConf.create({"name": "alibi"}), 64, 4, 2)
    assert set(ATTENTIONS) == set(ATTENTION_SCHEMAS)


@pytest.mark.parametrize("bad", [(64, 5, 1), (64, 4, 3)])
def test_bad_head_counts(bad):
    with pytest.raises(ValueError, match="model.n_"):
        build_attention(attn_cfg("nope"), *bad)


def test_timer_counts_forward_and_backward_and_changes_nothing():
    attn = build_attention(attn_cfg("rope", impl="torch"), 64, 4, 2).to(DEVICE)
    x = torch.randn(2, 33, 64, device=DEVICE, requires_grad=True)
    cot = torch.randn(2, 33, 64, device=DEVICE)
    (grad_plain,) = torch.autograd.grad((attn(x) * cot).sum(), x)
    timer = AttentionTimer(torch.device(DEVICE))
    timer.enabled = True
    attn.timer = timer
    out = attn(x)
    assert len(timer._stamps) == 2
    (grad_timed,) = torch.autograd.grad((out * cot).sum(), x)
    assert len(timer._stamps) == 4
    assert torch.equal(grad_timed, grad_plain)
    assert timer.pop_seconds() > 0 and timer._stamps == []


@pytest.mark.slow
def test_rope_attention_compiles_to_one_graph_before_any_eager_call(monkeypatch):
    """Whatever ran before, the attention module traces without a graph break
    (fullgraph=True raises on one): resolve_impl's once-per-variant log, whose call would
    break the graph, stays out of the trace, as does the config (held as plain values)."""
    import lm.attention

    monkeypatch.setattr(lm.attention, "_logged", set())  # as in a fresh process
    # with a query scale: its checks of the positions stay out of the trace too
    cfg = attn_cfg("rope", impl="torch", query_scale={"beta": 0.5, "length": 4})
    attn = build_attention(cfg, 32, 4, 2).to(DEVICE)
    x = torch.randn(2, 9, 32, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    assert_close("compiled rope", compiled(x), attn(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["rope", "corope"])
def test_rope_dim_past_the_head_dim_is_refused_when_the_layer_is_built(name):
    """d_model 64 over 4 heads: head dim 16; an even rope_dim above it is refused at build
    time, naming attention.rope_dim (not at the first forward, by the kernels' check)."""
    with pytest.raises(
        ValueError, match=r"attention.rope_dim must be even and in \[2, head_dim=16\]"
    ):
        build_attention(attn_cfg(name, rope_dim=18, impl="torch"), 64, 4, 2)
    build_attention(attn_cfg(name, rope_dim=16, impl="torch"), 64, 4, 2)
