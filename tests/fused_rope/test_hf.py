"""``fused_rope.hf``: transformers models whose RoPE and attention run in ``rope_attention``,
against the same models' stock forward (transformers is the oracle), in float64 for the
reference and in fp32 for the baseline of flash-attention's rule."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

import fused_rope.hf
from fused_rope.hf import fuse_rope_attention, unfuse_rope_attention
from tests.helpers import DEVICE, assert_close, assert_close_to_baseline

transformers = pytest.importorskip("transformers", reason="transformers is the oracle")
if int(transformers.__version__.split(".")[0]) < 5:  # pyproject allows transformers >= 4.45
    pytest.skip(
        f"fused_rope.hf takes transformers 5's attention forward, not {transformers.__version__}'s",
        allow_module_level=True,
    )

VOCAB = 50
# the transformers classes' prefix (LlamaConfig, LlamaForCausalLM) and the keys that make the
# model differ from Llama's
FAMILIES = {
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {"sliding_window": 64}),
    "qwen2": ("Qwen2", {"attention_bias": True}),
    "qwen2_sliding": (
        "Qwen2",
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3", {}),
    "olmo2": ("Olmo2", {}),
    "arcee": ("Arcee", {}),
    "gemma": ("Gemma", {}),
    "granite": (
        "Granite",
        {"attention_multiplier": 0.3, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
    ),
    "mixtral": (
        "Mixtral",
        {"sliding_window": 64, "num_local_experts": 2, "num_experts_per_tok": 1},
    ),
    "ministral": ("Ministral", {}),
    "qwen2_moe": (
        "Qwen2Moe",
        {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 32},
    ),
    # a quarter of the head passes through unrotated (Phi-4-mini rotates 3/4 of it)
    "phi3": (
        "Phi3",
        {"partial_rotary_factor": 0.75, "sliding_window": 64, "pad_token_id": 0},
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32},
    ),
    # a sliding layer and a full one, each rotating by frequencies of its own (bases 1e4, 1e6)
    "gemma3": (
        "Gemma3",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64,
         "query_pre_attn_scalar": 24},
    ),
    # the interleaved layout; per-head layer norms of q and k
    "cohere": ("Cohere", {"use_qk_norm": True, "pad_token_id": None}),
    # Cohere's rotation on the sliding layer; the full one has no RoPE (left unpatched)
    "cohere2": (
        "Cohere2",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64,
         "pad_token_id": None, "eos_token_id": None, "bos_token_id": None},
    ),
    # the first half of each head rotated, interleaved
    "glm": ("Glm", {"pad_token_id": None}),
    "glm4": ("Glm4", {"pad_token_id": None}),
    # the first half of each head rotated, in halves; per-head RMS norms of q and k
    "glm4_moe": (
        "Glm4Moe",
        {"use_qk_norm": True, "n_routed_experts": 2, "num_experts_per_tok": 1,
         "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
         "topk_group": 1, "pad_token_id": None},
    ),
}  # fmt: skip
# a family whose config class is not named after its model classes
CONFIG_CLASSES = {"Gemma3": "Gemma3TextConfig"}


def make_model(family="llama", attn_implementation="sdpa", **config):
    """A 2-layer model of ``family`` with random weights: 4 query heads, 2 key-value heads
    of 16 channels, fp32, eval mode."""
    prefix, keys = FAMILIES[family]
    config = getattr(transformers, CONFIG_CLASSES.get(prefix, f"{prefix}Config"))(
        **{
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 128,
        } | keys | config,
    )  # fmt: skip
    torch.manual_seed(0)
    # the MoE experts' eager loop: their grouped matmul refuses float64, the reference's dtype
    model = getattr(transformers, f"{prefix}ForCausalLM")._from_config(
        config, attn_implementation=attn_implementation, experts_implementation="eager"
    )
    for p in model.parameters():  # norms start at 1, biases at 0: random, so that they count
        if p.ndim == 1:
            p.data.normal_(1.0 if p.abs().max() == 1 else 0.0, 0.2)
    return model.to(DEVICE).eval()


@pytest.fixture
def calls(monkeypatch):
    """The ``(impl, window)`` of each call the patched forwards made to ``rope_attention``."""
    count = []

    def counted(*args, **kwargs):
        count.append((kwargs["impl"], kwargs["window"]))
        return rope_attention(*args, **kwargs)

    rope_attention = fused_rope.hf.rope_attention
    monkeypatch.setattr(fused_rope.hf, "rope_attention", counted)
    return count


def logits_and_grads(model, x, cotangent, attention_mask=None):
    """The logits ``[B, N, V]`` of ``x`` and the gradients of ``<logits, cotangent>`` with
    respect to the input embeddings and the first layer's key projection (Phi-3's q, k, v
    one)."""
    model.zero_grad()
    embeddings = model.get_input_embeddings()(x).detach().requires_grad_()
    logits = model(inputs_embeds=embeddings, attention_mask=attention_mask, use_cache=False).logits
    (logits * cotangent.to(logits.dtype)).sum().backward()
    attention = model.model.layers[0].self_attn
    k_proj = attention.k_proj if hasattr(attention, "k_proj") else attention.qkv_proj  # Phi-3
    return logits, embeddings.grad, k_proj.weight.grad


def rotating_layers(model) -> list[int]:
    """The layers whose attention rotates q and k: all but Cohere 2's full layers (NoPE)."""
    types = getattr(model.config, "layer_types", None)
    if type(model).__name__.startswith("Cohere2"):
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return list(range(model.config.num_hidden_layers))


def check_against_transformers(model, x, calls, impl="auto"):
    """The patched model's logits and gradients against the stock model's in float64, with
    the stock model's in fp32 as the baseline; ``rope_attention`` called once a layer. The
    patched model runs first, on a copy no forward has run: dynamic NTK's stock forward
    changes the rotary embedding's frequencies, so a patch that kept those it was given would
    pass after one."""
    cotangent = torch.randn(*x.shape, VOCAB, device=DEVICE)
    patched = copy.deepcopy(model)
    layers = [f"model.layers.{i}.self_attn" for i in rotating_layers(model)]
    assert fuse_rope_attention(patched, impl=impl) == layers
    fused = logits_and_grads(patched, x, cotangent)
    reference = logits_and_grads(copy.deepcopy(model).double(), x, cotangent)
    baseline = logits_and_grads(model, x, cotangent)
    assert [impl_called for impl_called, _ in calls] == [impl] * len(layers)
    for name, out, ref, base in zip(
        ("logits", "d embeddings", "d k_proj"), fused, reference, baseline, strict=True
    ):
        assert_close_to_baseline(name, out, ref, base)


# the sliding window each family's stock forward passes, layer by layer (it binds nowhere at
# 21 tokens: the mask would be made, and the stock forward taken)
WINDOWS = {
    "mistral": [64, 64],
    "mixtral": [64, 64],
    "phi3": [64, 64],
    "ministral": [4096, 4096],
    "qwen2_sliding": [None, 64],
    "gemma3": [64, None],
    "cohere2": [64],  # its sliding layer alone
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_matches_its_stock_forward(family, calls):
    check_against_transformers(
        make_model(family), torch.randint(0, VOCAB, (2, 21), device=DEVICE), calls
    )
    assert [window for _, window in calls] == WINDOWS.get(family, [None, None])


@pytest.mark.parametrize(
    "family", ["mistral", "qwen2_sliding", "phi3", "gemma3", "ministral", "cohere2"]
)
def test_sliding_windows_that_bind_take_rope_attention(family, calls):
    """A call with no mask and no position ids, whose windowed layers get a mask from
    transformers once their window binds (8 keys of 21): ``rope_attention``'s window gives
    the stock model's logits and gradients, for every layer."""
    model = make_model(family, sliding_window=8)
    check_against_transformers(model, torch.randint(0, VOCAB, (2, 21), device=DEVICE), calls)
    windows = WINDOWS.get(family)
    assert [window for _, window in calls] == [8 if w else None for w in windows]


def test_a_mask_of_ones_counts_as_no_mask(calls):
    """The tokenizer's attention mask without padding (all ones, as a trainer passes it) lets
    the windowed layers take ``rope_attention`` where their window binds, as no mask does."""
    x = torch.randint(0, VOCAB, (2, 21), device=DEVICE)
    model = make_model("mistral", sliding_window=8)
    stock = model(x, attention_mask=torch.ones_like(x), use_cache=False).logits
    fuse_rope_attention(model)
    fused = model(x, attention_mask=torch.ones_like(x), use_cache=False).logits
    assert calls == [("auto", 8)] * 2
    assert_close("logits", fused, stock, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_through_the_same_path(reentrant, calls):
    """Under gradient checkpointing a layer runs again in the backward, after the model's
    call: it must take the path it took in the forward (non-reentrant checkpointing checks
    that the recomputation saves what the forward saved), the windowed one for a plain call,
    the stock one for a padded call, and the gradients must be the stock model's."""
    x = torch.randint(0, VOCAB, (2, 21), device=DEVICE)
    padding = torch.ones_like(x)
    padding[0, :4] = 0
    model = make_model("mistral", sliding_window=8).train()
    # transformers 5.24's name for it, and 5.17's (deprecated in 5.24)
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable({"use_reentrant": reentrant})
    cotangent = torch.randn(*x.shape, VOCAB, device=DEVICE)
    for mask, expected_calls in ((None, 4), (padding, 0)):  # 4: two layers, recomputed
        stock = logits_and_grads(model, x, cotangent, attention_mask=mask)
        fuse_rope_attention(model)
        fused = logits_and_grads(model, x, cotangent, attention_mask=mask)
        unfuse_rope_attention(model)
        assert len(calls) == expected_calls
        calls.clear()
        for name, out, ref in zip(("logits", "d embeddings", "d k_proj"), fused, stock,
                                  strict=True):  # fmt: skip
            assert_close(name, out, ref, atol=1e-5, rtol=1e-5)


def test_a_config_window_changed_after_construction_is_the_one_taken(calls):
    """transformers builds the masks from the config's window at each call; the layers' own
    copy of it dates from their construction, so the patched forward reads the config's."""
    x = torch.randint(0, VOCAB, (2, 21), device=DEVICE)
    model = make_model("gemma3", sliding_window=8)
    model.config.sliding_window = 4
    stock = model(x, use_cache=False).logits
    fuse_rope_attention(model)
    assert_close("logits", model(x, use_cache=False).logits, stock, atol=1e-5, rtol=1e-5)
    assert [window for _, window in calls] == [4, None]


def test_a_patched_model_pickles(calls):
    """``torch.save`` of a patched model (its forwards and the text model's hook) and the
    loaded copy's calls."""
    model = make_model("mistral", sliding_window=8)
    fuse_rope_attention(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randint(0, VOCAB, (2, 21), device=DEVICE)
    assert torch.equal(loaded(x, use_cache=False).logits, model(x, use_cache=False).logits)
    assert len(calls) == 4


def test_a_compiled_model_traces_its_hook_whole(calls):
    """``torch.compile(fullgraph=True)`` traces a patched model, the text model's hook
    included. Compiled, transformers builds every layer's mask: the windowed layers of a plain
    call take ``rope_attention``, whose window is their mask, the others the stock forward."""
    x = torch.randint(0, VOCAB, (2, 21), device=DEVICE)
    for family, windows in (("mistral", [8, 8]), ("qwen2_sliding", [8])):
        model = make_model(family, sliding_window=8)
        stock = model(x, use_cache=False).logits
        fuse_rope_attention(model)
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        assert_close("logits", compiled(x, use_cache=False).logits, stock, atol=1e-5, rtol=1e-5)
        assert [window for _, window in calls] == windows
        calls.clear()


@pytest.mark.parametrize("impl", ["fused", "separate"])
def test_both_implementations_match(impl, calls):
    check_against_transformers(
        make_model("qwen3"), torch.randint(0, VOCAB, (1, 70), device=DEVICE), calls, impl
    )


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "linear", "factor": 2.0},
        # past its original context (max_position_embeddings, 16 here), dynamic NTK's
        # frequencies follow the length: read from the rotary embedding at each call
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=lambda p: p["rope_type"],
)
def test_scaled_schedules_take_the_models_frequencies_and_attention_factor(rope_parameters, calls):
    """YaRN's attention factor scales cos and sin in transformers; here the rotated channels."""
    max_len = 16 if rope_parameters["rope_type"] == "dynamic" else 128
    model = make_model(
        "llama", max_position_embeddings=max_len,
        rope_parameters={"rope_theta": 10000.0} | rope_parameters,
    )  # fmt: skip
    if rope_parameters["rope_type"] == "yarn":
        assert model.model.rotary_emb.attention_scaling != 1.0
    check_against_transformers(model, torch.randint(0, VOCAB, (2, 40), device=DEVICE), calls)


def test_phi3s_longrope_past_its_original_context(calls):
    """Phi-3.5 / Phi-4-mini: LongRoPE's long factors past the original context (16 here),
    its attention factor, on 12 of the 16 channels of each head."""
    factors = torch.linspace(1.0, 6.0, 6).tolist()
    model = make_model(
        "phi3", max_position_embeddings=64, original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 6,
            "long_factor": factors, "original_max_position_embeddings": 16,
        },
    )  # fmt: skip
    assert model.model.rotary_emb.attention_scaling != 1.0
    check_against_transformers(model, torch.randint(0, VOCAB, (2, 40), device=DEVICE), calls)


def cache_of(output):
    """A forward's cache: ``cache`` from transformers 5.24 on, ``past_key_values`` before."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def step(model, x, cache):
    """A forward continuing ``cache`` (its argument's name as ``cache_of``'s)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(x, **{name: cache})


@pytest.mark.parametrize("family", ["qwen2", "cohere", "gemma3", "cohere2"])
def test_a_prefill_fills_the_cache_the_decoding_steps_expect(family, calls):
    """A prefill takes ``rope_attention`` and stores its keys rotated, as the stock forward
    does (in the family's layout, by the layer's frequencies); the decoding steps after it
    take the stock forward and give the stock logits."""
    model = make_model(family)
    x = torch.randint(0, VOCAB, (2, 12), device=DEVICE)
    stock = model(x[:, :9], use_cache=True)
    stock_step = step(model, x[:, 9:], cache_of(stock)).logits
    stock_tokens = model.generate(x, max_new_tokens=5, do_sample=False)
    layers = len(fuse_rope_attention(model))
    fused = model(x[:, :9], use_cache=True)
    assert len(calls) == layers
    fused_step = step(model, x[:, 9:], cache_of(fused)).logits
    assert len(calls) == layers  # the step saw a cache with keys: the stock forward
    assert_close("prefill", fused.logits, stock.logits, atol=1e-5, rtol=1e-6)
    for layer, (ours, theirs) in enumerate(
        zip(cache_of(fused).layers, cache_of(stock).layers, strict=True)
    ):
        assert_close(f"keys {layer}", ours.keys, theirs.keys, atol=1e-5, rtol=1e-6)
        assert_close(f"values {layer}", ours.values, theirs.values, atol=1e-5, rtol=1e-6)
    assert_close("step", fused_step, stock_step, atol=1e-5, rtol=1e-6)
    assert torch.equal(model.generate(x, max_new_tokens=5, do_sample=False), stock_tokens)
    assert len(calls) == 2 * layers  # generate's prefill


@pytest.fixture
def counting_attention():
    """An attention implementation of one's own, registered with transformers: SDPA's, counted
    (its mask is SDPA's, so only the implementation's name tells it from SDPA)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    count = []

    def counted(*args, **kwargs):
        count.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    transformers.AttentionInterface.register("counting_sdpa", counted)
    return count


def test_calls_with_a_mask_dropout_or_another_attention_take_the_stock_forward(
    calls, counting_attention
):
    """Padding (also where a window binds), packed sequences (position ids that restart, with
    a window that binds), attention dropout in training, bidirectional attention (asked for by
    the call, the layers or the config), the eager implementation (which always makes a
    mask) and one's own attention give transformers' own result."""
    x = torch.randint(0, VOCAB, (2, 21), device=DEVICE)
    padding = torch.ones_like(x)
    padding[0, :4] = 0
    encoder = make_model()
    for layer in encoder.model.layers:
        layer.self_attn.is_causal = False  # LLM2Vec's conversion of a decoder
    packed = torch.cat([torch.arange(11), torch.arange(10)]).expand(2, -1)
    cases = [
        (make_model(), {"attention_mask": padding}),
        (make_model("mistral", sliding_window=8), {"attention_mask": padding}),
        (make_model("mistral", sliding_window=8), {"position_ids": packed.to(DEVICE)}),
        (make_model("llama", attn_implementation="eager"), {}),
        (make_model("llama", attention_dropout=0.5).train(), {}),
        (make_model(), {"is_causal": False}),
        (make_model("qwen2", is_causal=False), {}),
        (encoder, {}),
        (make_model("llama", attn_implementation="counting_sdpa"), {}),
    ]
    for model, kwargs in cases:
        torch.manual_seed(1)
        stock = model(x, use_cache=False, **kwargs).logits
        fuse_rope_attention(model)
        torch.manual_seed(1)
        assert torch.equal(model(x, use_cache=False, **kwargs).logits, stock)
    assert calls == [] and counting_attention == [1] * 4  # its two layers, stock then patched


def test_unfuse_puts_back_the_stock_forward(calls):
    model = make_model()
    x = torch.randint(0, VOCAB, (1, 10), device=DEVICE)
    stock = model(x, use_cache=False).logits
    fuse_rope_attention(model, impl="separate")
    names = fuse_rope_attention(model)  # patching again replaces the patch
    model(x, use_cache=False)
    assert calls == [("auto", None)] * 2
    assert unfuse_rope_attention(model) == names and unfuse_rope_attention(model) == []
    assert torch.equal(model(x, use_cache=False).logits, stock) and len(calls) == 2


def test_bad_models_and_arguments_are_refused():
    model = make_model()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        fuse_rope_attention("llama")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        unfuse_rope_attention(3)
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'fused', 'separate'\)"):
        fuse_rope_attention(model, impl="flash")
    with pytest.raises(ValueError, match="no attention module that rotates, of a supported"):
        fuse_rope_attention(torch.nn.Linear(2, 2))
    nope = make_model("cohere2", layer_types=["full_attention"] * 2)  # no layer has RoPE
    with pytest.raises(ValueError, match="rotates.* got attention classes .'Cohere2Attention'"):
        fuse_rope_attention(nope)
    two = make_model()
    two.second_rotary = copy.deepcopy(two.model.rotary_emb)  # transformers 4's Gemma 3 had two
    with pytest.raises(ValueError, match="exactly one rotary embedding.* got 2"):
        fuse_rope_attention(two)
    partial = make_model()
    partial.model.rotary_emb.inv_freq = partial.model.rotary_emb.inv_freq[:4]
    with pytest.raises(ValueError, match="4 frequencies rotate 8 channels, not the head's 16"):
        fuse_rope_attention(partial)

    class LlamaAttention(torch.nn.Module):  # transformers 4's forward
        def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
            pass

    old = make_model()
    old.model.layers[0].self_attn = LlamaAttention()
    with pytest.raises(ValueError, match="LlamaAttention is defined in tests.fused_rope.test_hf"):
        fuse_rope_attention(old)  # a namesake's forward may be anything
    LlamaAttention.__module__ = "transformers.models.llama.modeling_llama"
    with pytest.raises(ValueError, match="model.layers.0.self_attn: LlamaAttention.forward takes"):
        fuse_rope_attention(old)
    # nothing was patched by the refused calls
    assert all("forward" not in m.__dict__ for m in old.modules())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "gemma3", "cohere", "cohere2", "glm", "mistral"]
)
@pytest.mark.parametrize("impl", ["fused", "separate"])
def test_bf16_models_at_a_longer_sequence(family, impl, calls):
    """On the GPU, in bf16 (the stock baseline rounds its cos and sin to bf16), 1000 tokens
    (Gemma 3's, Cohere 2's and Mistral's 64-key windows bind: their masks replaced by the
    window)."""
    model = make_model(family).to(torch.bfloat16)
    x = torch.randint(0, VOCAB, (2, 1000), device=DEVICE)
    check_against_transformers(model, x, calls, impl)


@pytest.mark.gpu
def test_a_cuda_graph_captures_a_call_with_a_mask_of_ones(calls):
    """A mask of ones is read (on the host) to tell a plain call, except while a CUDA graph
    is captured, where a read would end the capture: that call takes the stock forward and
    the graph replays what the eager call gives."""
    model = make_model("mistral", sliding_window=8).to(torch.bfloat16)
    fuse_rope_attention(model)
    x = torch.randint(0, VOCAB, (2, 21), device=DEVICE)
    mask = torch.ones_like(x)
    with torch.no_grad():
        eager = model(x, attention_mask=mask, use_cache=False).logits
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture asks
            model(x, attention_mask=mask, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(x, attention_mask=mask, use_cache=False).logits
        graph.replay()
    assert len(calls) == 4  # the eager call and the warm-up took rope_attention, the capture not
    assert_close("logits", captured.float(), eager.float(), atol=3e-2, rtol=3e-2)
