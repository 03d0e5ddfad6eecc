"""lm/generation.py: a cached step computes what the whole forward computes, for every
attention; sampling; the checks of the arguments."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from lm.config import ATTENTION_SCHEMAS, ModelConfig
from lm.generation import KVCache, generate, sample_next
from lm.model import GPT
from tests.helpers import DEVICE, ON_GPU, assert_close_to_baseline

VOCAB, MAX_LEN = 13, 96
# LongRoPE over the test models' 16-channel heads (8 frequencies), original length 8
LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.5, 11.0, 14.0],
    "original_max_position_embeddings": 8,
    "factor": 4.0,
}
# Every attention, and RoPE with dynamic NTK, whose frequencies change with the length
# (original length 8: the steps below run past it).
VARIANTS = {name: {} for name in ATTENTION_SCHEMAS} | {
    "rope_ntk": {
        "scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    },
    # RoPE caches its keys rotated: an attention factor (YaRN's), the interleaved layout and
    # partial rotation must reach the cached keys as they reach the forward's.
    "rope_yarn": {
        "scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    },
    "rope_interleaved": {"layout": "interleaved", "rope_dim": 8},
    # Co-RoPE takes dynamic NTK's frequencies of the keys' length, cached or not
    "corope_ntk": {
        "scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
    },
    # the queries' scale follows their positions: a cached chunk's rows are at cache.length..
    "nope_qscale": {"query_scale": {"beta": 0.5, "length": 4}},
    "rope_qscale": {"query_scale": {"beta": 0.5, "length": 4}},
    "corope_qscale": {"query_scale": {"beta": 0.5, "length": 4}},
    # layer 1 of 2 without rotation (caching its keys as projected), scaled as Llama 4's are
    "rope_nope": {
        "nope_interval": 2,
        "query_scale": {"beta": 0.5, "length": 4, "layers": "nope", "offset": 1},
    },
    "corope_nope": {"nope_interval": 2},
    # a sliding window shorter than the sequences (cached steps see only their last keys),
    # layer 1 of 2 global (Gemma's pattern), the local layer at its own base
    "rope_window": {"window": 5, "global_interval": 2, "window_theta": 100.0},
    "nope_window": {"window": 3},
    "corope_window": {"window": 4, "global_interval": 2},
    # dynamic NTK's frequencies follow the sequence's length, not the windowed cache's keys
    "rope_window_ntk": {
        "window": 3,
        "scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8},
    },
    "corope_window_ntk": {
        "window": 3,
        "scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8},
    },
    # LongRoPE's frequencies switch from the short factors to the long ones past 8 tokens
    "rope_longrope": {"scaling": LONGROPE},
    "corope_longrope": {"scaling": LONGROPE | {"attention_factor": 1.0}},
}


def follows_length(variant: str) -> bool:
    """Whether the variant's frequencies follow the sequence's length (dynamic NTK,
    LongRoPE): its cache is exact in the first layer only (see the test of it)."""
    return variant.endswith(("_ntk", "_longrope"))


def make_model(
    variant: str, dtype=torch.float64, impl="torch", n_layer=None, d_model=64, **attn
) -> GPT:
    """A 2-layer GPT of ``variant`` in eval mode; 1 layer unless asked where the frequencies
    follow the length (``follows_length``)."""
    name = variant.split("_")[0]
    if n_layer is None:
        n_layer = 1 if follows_length(variant) else 2
    model_cfg = OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        {"d_model": d_model, "n_layer": n_layer, "n_head": 4, "n_kv_head": 2},
    )
    attn_cfg = OmegaConf.merge(
        OmegaConf.structured(ATTENTION_SCHEMAS[name]),
        VARIANTS[variant] | ({"impl": impl} if name in ("rope", "corope") else {}) | attn,
    )
    torch.manual_seed(0)
    model = GPT(model_cfg, attn_cfg, vocab_size=VOCAB, max_len=MAX_LEN)
    return model.to(DEVICE, dtype).eval()


def chunk_ends(chunks: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(chunks).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends, strict=True))


def forward_logits(model: GPT, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``(B, N, V)``: the rows ``start:end`` of each chunk from a forward over ``x[:, :end]``,
    the sequence a cached call of that chunk continues."""
    return torch.cat([model(x[:, :end])[:, start:end] for start, end in chunk_ends(chunks)], 1)


def cached_logits(model: GPT, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """``(B, N, V)`` from feeding ``x`` through a ``KVCache`` in chunks of these sizes."""
    cache, out = KVCache.for_model(model, x.shape[1]), []
    for start, end in chunk_ends(chunks):
        out.append(model(x[:, start:end], cache))
        assert cache.length == end
    assert cache.length == x.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("chunks", [[5] + [1] * 18, [1, 4, 3, 3, 7, 2, 3]])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_cached_steps_compute_the_forward_of_the_sequence_so_far(variant, chunks):
    """Prefill then single tokens (decoding), or uneven chunks: each chunk's logits equal
    those of a forward over the sequence up to its end (fp64: to rounding); for the static
    encodings, those of the whole forward."""
    model = make_model(variant)
    x = torch.randint(0, VOCAB, (2, 23), device=DEVICE)
    expected = forward_logits(model, x, chunks)
    torch.testing.assert_close(cached_logits(model, x, chunks), expected, atol=1e-10, rtol=1e-10)
    if not follows_length(variant):
        torch.testing.assert_close(model(x), expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("variant", ["nope", "rope"])
@torch.no_grad()
def test_cached_steps_take_sdpas_bottom_right_mask(variant, monkeypatch):
    """A cached step (NQ < NK) reaches SDPA through ``causal_lower_right``, whose flash and
    memory-efficient kernels serve any length; a plain mask (or none at NQ = 1) took cuDNN's
    kernel on an H100, which plans every new shape anew: 42 ms a step."""
    from torch.nn.attention.bias import CausalBias

    calls, real = [], CausalBias._dispatch

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(CausalBias, "_dispatch", staticmethod(spy))
    model = make_model(variant, torch.float32)
    cached_logits(model, torch.randint(0, VOCAB, (1, 7), device=DEVICE), [5, 1, 1])
    assert calls == [(1, 6), (1, 6), (1, 7), (1, 7)]  # 2 layers, 2 steps; prefill: is_causal


@torch.no_grad()
def test_windowed_cached_steps_take_the_windows_keys_bottom_right(monkeypatch):
    """A cached step of a windowed layer attends to the window's last keys alone, through
    ``causal_lower_right`` as an unwindowed step does, not through a boolean mask over the
    cache (a review's find: with it SDPA would take cuDNN's kernel, which plans each new
    length anew); its global layer (global_interval 2) takes the whole cache."""
    from torch.nn.attention.bias import CausalBias

    calls, real = [], CausalBias._dispatch

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(CausalBias, "_dispatch", staticmethod(spy))
    model = make_model("rope_window", torch.float32)  # window 5: layer 0 windowed, 1 global
    cached_logits(model, torch.randint(0, VOCAB, (1, 9), device=DEVICE), [7, 1, 1])
    assert calls == [(1, 5), (1, 8), (1, 5), (1, 9)]


@torch.no_grad()
def test_a_windowed_rope_prefill_takes_the_fused_kernel(monkeypatch):
    """Under ``impl=triton`` a windowed layer's prefill into an empty cache runs
    ``rope_attention`` (its fused kernel skips the keys outside the window, where SDPA has no
    window kernel), the global layer and the decoding steps do not."""
    import fused_rope.attention

    calls, real = [], fused_rope.attention.rope_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[2], k.shape[2], kwargs["window"]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fused_rope.attention, "rope_attention", spy)
    model = make_model("rope_window", torch.float32, "triton")  # layer 0: window 5
    cached_logits(model, torch.randint(0, VOCAB, (1, 9), device=DEVICE), [7, 1, 1])
    assert calls == [(7, 7, 5)]


@pytest.mark.parametrize(
    "variant, impl",
    [
        ("rope", "torch"),
        ("rope", "triton"),
        ("rope_interleaved", "triton"),
        ("rope_ntk", "torch"),
        ("rope_ntk", "triton"),
        ("rope_window_ntk", "torch"),
        ("rope_longrope", "torch"),
    ],
)
@torch.no_grad()
def test_rope_rotates_each_key_once_unless_its_frequencies_follow_the_length(
    variant, impl, monkeypatch
):
    """RoPE caches its keys rotated: a step rotates its own row of q and k, not every cached
    key again. Dynamic NTK's and LongRoPE's frequencies follow the length, so they rotate them
    all (with a window of 3, the 2 held and its own)."""
    import fused_rope.naive
    import fused_rope.rope

    rows = []  # the key rows of each rotation, in order (q's rotation is not counted)
    ref, qk = fused_rope.naive.apply_rope_ref, fused_rope.rope.apply_rope_qk

    def spy_ref(x, *args, **kwargs):
        if x.shape[1] == 2:  # the keys: 2 KV heads (q has 4)
            rows.append(x.shape[2])
        return ref(x, *args, **kwargs)

    def spy_qk(q, k, *args, **kwargs):
        rows.append(k.shape[2])
        return qk(q, k, *args, **kwargs)

    monkeypatch.setattr(fused_rope.naive, "apply_rope_ref", spy_ref)
    monkeypatch.setattr(fused_rope.rope, "apply_rope_qk", spy_qk)
    model = make_model(variant, torch.float32, impl)
    cached_logits(model, torch.randint(0, VOCAB, (1, 7), device=DEVICE), [5, 1, 1])
    per_layer = {"rope_window_ntk": [5, 3, 3]}.get(
        variant, [5, 6, 7] if follows_length(variant) else [5, 1, 1]
    )
    assert rows == [n for n in per_layer for _ in model.blocks]


@torch.no_grad()
def test_dynamic_ntk_caches_deeper_layers_at_the_frequencies_of_their_time():
    """Past the original length (8) dynamic NTK's frequencies follow the sequence length, so
    a forward over the prefix recomputes every earlier position's hidden states with the new
    ones, which a cache cannot: its layer-2 keys were computed from layer-1 outputs of
    shorter lengths. The cached rows are exact up to position 7 and close after (1e-5 here);
    ``generate(use_cache=False)`` decodes exactly."""
    model = make_model("rope_ntk", n_layer=2)
    x = torch.randint(0, VOCAB, (2, 23), device=DEVICE)
    steps = [1] * 23
    expected, cached = forward_logits(model, x, steps), cached_logits(model, x, steps)
    torch.testing.assert_close(cached[:, :8], expected[:, :8], atol=1e-10, rtol=1e-10)
    assert not torch.allclose(cached[:, 8:], expected[:, 8:], atol=1e-7, rtol=0)
    torch.testing.assert_close(cached, expected, atol=1e-3, rtol=0)
    # and the whole forward's rows are not the prefixes' past the original length
    assert not torch.allclose(model(x)[:, 8:], expected[:, 8:], atol=1e-6)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generate_with_the_cache_is_generate_without(variant):
    """Greedy and seeded sampling give the same tokens with and without the cache; the model
    is back in training mode after."""
    model = make_model(variant).train()
    prompt = torch.randint(0, VOCAB, (3, 6), device=DEVICE)
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.3, "top_k": 5}):
        runs = [
            generate(
                model,
                prompt,
                15,
                generator=torch.Generator(DEVICE).manual_seed(7),
                use_cache=use_cache,
                **kwargs,
            )
            for use_cache in (True, False)
        ]
        assert runs[0].shape == (3, 21) and runs[0].dtype == torch.int64
        assert torch.equal(runs[0][:, :6], prompt)
        assert torch.equal(runs[0], runs[1])
    assert model.training


def test_generate_runs_the_model_in_eval_mode():
    """Dropout off while decoding (the test models have none, so the mode is what shows)."""
    model = make_model("rope").train()
    modes = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: modes.append(module.training))
    generate(model, torch.randint(0, VOCAB, (1, 3), device=DEVICE), 4, temperature=0)
    assert modes == [False] * 4 and model.training
    # the mode is restored, not set: a model given in eval mode stays in it
    generate(model.eval(), torch.randint(0, VOCAB, (1, 3), device=DEVICE), 1, temperature=0)
    assert not model.training


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_fills_max_len_exactly(use_cache):
    """A prompt plus new tokens of exactly ``max_len`` runs (one more is refused)."""
    model = make_model("rope")
    prompt = torch.randint(0, VOCAB, (1, MAX_LEN - 3), device=DEVICE)
    assert generate(model, prompt, 3, use_cache=use_cache).shape == (1, MAX_LEN)
    with pytest.raises(ValueError, match=f"exceeds the model's max_len {MAX_LEN}"):
        generate(model, prompt, 4, use_cache=use_cache)


@torch.no_grad()
def test_logits_to_keep_gives_the_last_rows():
    """``logits_to_keep = n`` gives the last ``n`` rows of the logits (all of them past N),
    with or without a cache; anything but an int >= 0 is refused by name."""
    model = make_model("rope")
    x = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    full = model(x)
    for n in (1, 4, 9, 20):
        torch.testing.assert_close(model(x, logits_to_keep=n), full[:, -n:], atol=1e-12, rtol=1e-12)
    cache = KVCache.for_model(model, 9)
    model(x[:, :5], cache, logits_to_keep=1)
    torch.testing.assert_close(model(x[:, 5:], cache, logits_to_keep=2), full[:, -2:])
    with pytest.raises(ValueError, match="logits_to_keep must be >= 0, got -1"):
        model(x, logits_to_keep=-1)
    with pytest.raises(TypeError, match="logits_to_keep must be an int, got bool"):
        model(x, logits_to_keep=True)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_computes_the_last_rows_logits_only(use_cache):
    """A prefill samples from its last row: the head sees one row a step, so a long prompt's
    ``(B, P, V)`` logits, the largest tensor of its forward, are never made (a review's
    find), with the cache or without it (where every step runs the whole sequence)."""
    model = make_model("rope")
    rows = []
    model.lm_head.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[1]))
    generate(model, torch.randint(0, VOCAB, (2, 12), device=DEVICE), 3, use_cache=use_cache)
    assert rows == [1, 1, 1]


@pytest.mark.parametrize("use_cache", [True, False])
def test_zero_new_tokens_return_the_prompt(use_cache):
    """``max_new_tokens=0`` gives the prompt back, a one-token prompt included (the cache is
    sized for the prompt and the new tokens but the last)."""
    model = make_model("rope")
    for n in (1, 3):
        prompt = torch.randint(0, VOCAB, (2, n), device=DEVICE)
        assert torch.equal(generate(model, prompt, 0, use_cache=use_cache), prompt)


def test_greedy_takes_the_argmax_of_each_step():
    model = make_model("corope")
    prompt = torch.randint(0, VOCAB, (2, 4), device=DEVICE)
    out = generate(model, prompt, 6, temperature=0)
    with torch.no_grad():
        logits = model(out[:, :-1])  # row t predicts token t + 1
    assert torch.equal(out[:, 4:], logits[:, 3:].argmax(-1))


def test_sampling_follows_the_distribution_top_k_and_seed():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64, device=DEVICE)
    logits = probs.log().expand(20000, 4)
    gen = torch.Generator(DEVICE).manual_seed(0)
    counts = torch.bincount(sample_next(logits, generator=gen), minlength=4) / 20000
    torch.testing.assert_close(counts, probs.float(), atol=0.015, rtol=0)
    top2 = torch.bincount(sample_next(logits, top_k=2, generator=gen), minlength=4) / 20000
    torch.testing.assert_close(
        top2, torch.tensor([0.625, 0.375, 0, 0]).to(top2), atol=0.015, rtol=0
    )
    # temperature 2 flattens: p ** (1/2), renormalised
    flat = (probs.sqrt() / probs.sqrt().sum()).float()
    hot = torch.bincount(sample_next(logits, 2.0, generator=gen), minlength=4) / 20000
    torch.testing.assert_close(hot, flat, atol=0.015, rtol=0)
    assert torch.equal(
        sample_next(logits[:3], 0.0), torch.zeros(3, dtype=torch.long, device=DEVICE)
    )
    # a temperature near 0 draws the argmax (logits / 1e-40 overflowed to NaN weights); a
    # numpy temperature is a number too
    cold = sample_next(logits[:50], 1e-40, generator=gen)
    assert torch.equal(cold, torch.zeros(50, dtype=torch.long, device=DEVICE))
    assert sample_next(logits[:5], np.float32(0.5), generator=gen).shape == (5,)
    a, b = (
        sample_next(logits[:50], generator=torch.Generator(DEVICE).manual_seed(3)) for _ in "ab"
    )
    assert torch.equal(a, b)


def test_top_k_keeps_exactly_k_ids_and_sample_next_checks_its_arguments():
    ties = torch.tensor([[1.0, 1.0, 1.0, 0.0]], device=DEVICE).expand(500, 4)
    gen = torch.Generator(DEVICE).manual_seed(0)
    assert len(sample_next(ties, top_k=1, generator=gen).unique()) == 1
    assert len(sample_next(ties, top_k=2, generator=gen).unique()) == 2
    # at a temperature so high that the scaled logits all round to 0, top_k still keeps the
    # k most likely ids (it once chose among the rounded ties by index)
    ranked = torch.tensor([[-5.0, -4.0, -3.0, 4.0, 5.0]], device=DEVICE).expand(500, 5)
    drawn = sample_next(ranked, 1e39, top_k=2, generator=gen).unique().tolist()
    assert sorted(drawn) == [3, 4]
    # all but one id: the least likely is still dropped (at 1e39 the others are uniform)
    drawn = sample_next(ranked, 1e39, top_k=4, generator=gen).unique().tolist()
    assert sorted(drawn) == [1, 2, 3, 4]
    logits = torch.zeros(2, 5, device=DEVICE)
    for bad, error, match in (
        ({"logits": logits[0]}, ValueError, r"logits must be a floating-point tensor \(B, V\)"),
        ({"logits": logits.long()}, ValueError, "logits must be a floating-point"),
        ({"temperature": -1.0}, ValueError, "temperature must be finite and >= 0, got -1.0"),
        ({"temperature": float("inf")}, ValueError, "temperature must be finite and >= 0"),
        ({"top_k": 0}, ValueError, "top_k must be >= 1, got 0"),
    ):
        with pytest.raises(error, match=match):
            sample_next(**({"logits": logits} | bad))


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_generate_runs_a_compiled_model_eagerly(how):
    """A compiled model (``torch.compile(model)``'s wrapper, or ``model.compile()`` as the
    trainer does) decodes eagerly: compiling every cache length anew would cost more than it
    saves (``model.compile()`` once took 52 s for 12 tokens, 14 graphs)."""
    from torch._dynamo.utils import counters

    model = make_model("rope")
    prompt = torch.randint(0, VOCAB, (2, 5), device=DEVICE)
    expected = generate(model, prompt, 4, temperature=0)
    if how == "torch.compile":
        model = torch.compile(model)
    else:
        model.compile()
    counters.clear()
    assert torch.equal(generate(model, prompt, 4, temperature=0), expected)
    assert counters["frames"]["total"] == 0, dict(counters["frames"])


def test_stop_token_ends_each_sequence_then_the_loop():
    """A sequence that generates ``stop_token`` repeats it from there, the others go on as
    they would without it (the same draws: every row draws at every step), and decoding ends
    at the step where the last one stopped."""
    model = make_model("rope")
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(DEVICE)

    def run(**kw):
        gen = torch.Generator(DEVICE).manual_seed(5)
        return generate(model, prompt, 30, temperature=1.5, generator=gen, **kw)

    full = run()
    new = full[:, 4:].tolist()
    in_all = [t for t in range(VOCAB) if all(t in row for row in new)]
    in_some = [t for t in range(VOCAB) if t not in in_all and any(t in row for row in new)]
    assert in_all and in_some  # both cases occur with this seed
    for stop in in_all[:2] + in_some[:2]:
        firsts = [row.index(stop) if stop in row else None for row in new]
        out = run(stop_token=stop)
        n = 30 if None in firsts else max(firsts) + 1
        assert out.shape == (3, 4 + n) and (n < 30) == (stop in in_all)
        for r, first in enumerate(firsts):
            kept = n if first is None else first + 1
            assert out[r, 4:].tolist() == new[r][:kept] + [stop] * (n - kept)
    unseen = [t for t in range(VOCAB) if all(t not in row for row in new)]
    for stop in unseen[:1]:  # a stop that never comes: all the steps, as without one
        assert torch.equal(run(stop_token=stop), full)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"model": torch.nn.Linear(2, 2)}, TypeError, "model must be an lm.model.GPT"),
        ({"prompt": [[1, 2]]}, TypeError, "prompt must be a torch.Tensor"),
        ({"prompt": torch.ones(2, 3)}, ValueError, r"prompt must be int64 token ids \(B, P\)"),
        ({"prompt": torch.ones(3, dtype=torch.long)}, ValueError, "prompt must be int64"),
        ({"prompt": torch.ones(2, 0, dtype=torch.long)}, ValueError, "B, P >= 1"),
        (
            {"prompt": torch.full((1, 3), VOCAB)},
            ValueError,
            rf"prompt ids must be in \[0, {VOCAB}\)",
        ),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be >= 0, got -1"),
        ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens must be an int, got float"),
        (
            {"max_new_tokens": MAX_LEN - 2},
            ValueError,
            f"= {MAX_LEN + 1} exceeds the model's max_len {MAX_LEN}",
        ),
        ({"temperature": -0.5}, ValueError, "temperature must be finite and >= 0, got -0.5"),
        ({"temperature": float("nan")}, ValueError, "temperature must be finite and >= 0"),
        ({"temperature": "hot"}, TypeError, "temperature must be a float, got str"),
        ({"top_k": 0}, ValueError, "top_k must be >= 1, got 0"),
        ({"top_k": True}, TypeError, "top_k must be an int, got bool"),
        ({"generator": 7}, TypeError, "generator must be a torch.Generator, got int"),
        ({"stop_token": VOCAB}, ValueError, rf"stop_token must be in \[0, {VOCAB - 1}\]"),
        ({"stop_token": 1.0}, TypeError, "stop_token must be an int, got float"),
        ({"use_cache": "no"}, TypeError, "use_cache must be a bool, got str"),
    ],
)
def test_generate_refuses_bad_arguments_by_name(kwargs, error, match):
    args = {
        "model": make_model("nope"),
        "prompt": torch.ones(1, 3, dtype=torch.long),
        "max_new_tokens": 2,
    }
    args["prompt"] = args["prompt"].to(DEVICE)
    args.update(
        {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    )
    with pytest.raises(error, match=match):
        generate(**args)


def test_generate_refuses_a_prompt_on_another_device():
    with pytest.raises(ValueError, match=f"prompt is on meta, the model on {DEVICE}"):
        generate(make_model("nope"), torch.ones(1, 2, dtype=torch.long, device="meta"), 1)


@pytest.mark.skipif(not ON_GPU, reason="needs a second device type")
def test_generate_refuses_a_generator_on_another_device():
    prompt = torch.ones(1, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=f"generator is on cpu, the model on {DEVICE}"):
        generate(make_model("nope"), prompt, 1, generator=torch.Generator("cpu"))


def test_cache_refuses_overflow_mismatches_and_gradients():
    cache = KVCache(n_layer=2, capacity=5)
    k = torch.randn(1, 2, 3, 8)
    keys, values = cache.append(0, k, k + 1)
    assert torch.equal(keys, k) and torch.equal(values, k + 1)
    with pytest.raises(ValueError, match=r"advance\(3\) needs every layer to have appended 3 "):
        cache.advance(3)  # layer 1 has not
    cache.append(1, k, k)
    cache.advance(3)
    with pytest.raises(ValueError, match="holds 3 of its capacity 5 tokens and cannot take 3"):
        cache.append(0, k, k)
    with pytest.raises(ValueError, match=r"layer 0's cache holds \[B, HKV, \*, D\]"):
        cache.append(0, k[..., :1, :4], k[..., :1, :4])
    for call in (lambda layer: cache.append(layer, k, k), cache.held,
                 lambda layer: cache.check_window(layer, None)):  # fmt: skip
        with pytest.raises(ValueError, match=r"layer must be in \[0, 1\], got 2"):
            call(2)
        with pytest.raises(ValueError, match=r"layer must be in \[0, 1\], got -1"):
            call(-1)  # read layer 1 before
        with pytest.raises(TypeError, match="layer must be an int, got bool"):
            call(True)
    with pytest.raises(ValueError, match="k and v must be"):
        cache.append(1, k, k[:, :1])
    with pytest.raises(ValueError, match="floating point of one dtype and device"):
        cache.append(1, k, k.double())
    with pytest.raises(ValueError, match="floating point of one dtype and device"):
        cache.append(1, k.long(), k.long())
    with pytest.raises(ValueError, match="is for inference"):
        cache.append(1, k.requires_grad_(), k)
    with pytest.raises(ValueError, match="cannot count 3 more"):
        cache.advance(3)
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        KVCache(2, 0)
    with pytest.raises(TypeError, match="n_layer must be an int"):
        KVCache(2.0, 4)


@pytest.mark.parametrize("window", [1, 3])
def test_windowed_cache_holds_the_last_keys_in_a_buffer_of_twice_the_window(window):
    """A windowed layer's slot returns the tokens it held, its last ``window - 1`` at most, then
    the new ones, in order, through decoding steps that move the held rows to the front of its
    ``2 * window`` rows and chunks longer than them; a layer without a window holds all."""
    cache = KVCache(2, 40, windows=[window, None])
    gen = torch.Generator().manual_seed(0)
    keys_so_far = values_so_far = torch.empty(1, 2, 0, 4)
    for n in [1, 4, 1, 1, 1, 1, 9, 1, 2, 1, 1, 1, 1]:
        k, v = torch.randn(2, 1, 2, n, 4, generator=gen)
        keys_so_far = torch.cat([keys_so_far, k], 2)
        values_so_far = torch.cat([values_so_far, v], 2)
        first = max(0, cache.length - (window - 1))  # the first token held
        keys, values = cache.append(0, k, v)
        tail = cache._staged[0][3]  # a chunk longer than the buffer: its last keys, copied
        if tail is not None:  # (views would keep the whole chunk alive until advance)
            assert all(t.untyped_storage().nbytes() == t.nbytes for t in tail)
        assert torch.equal(keys, keys_so_far[:, :, first:])
        assert torch.equal(values, values_so_far[:, :, first:])
        keys, values = cache.append(1, k, v)
        assert torch.equal(keys, keys_so_far) and torch.equal(values, values_so_far)
        cache.advance(n)
        assert cache.held(0) == min(cache.length, window - 1) and cache.held(1) == cache.length
    assert cache._k[0].shape[2] == 2 * window and cache._k[1].shape[2] == 40
    assert KVCache(1, 5, windows=[4]).windows == [4]  # 5 rows: the capacity, not 2 * window
    with pytest.raises(ValueError, match=r"windows must hold one entry a layer \(2\), got 1"):
        KVCache(2, 5, windows=[3])
    with pytest.raises(ValueError, match=r"windows\[1\] must be >= 1, got 0"):
        KVCache(2, 5, windows=[3, 0])
    with pytest.raises(TypeError, match=r"windows\[0\] must be an int"):
        KVCache(2, 5, windows=[3.0, None])
    with pytest.raises(TypeError, match="windows must be a sequence of ints or None, got 3"):
        KVCache(2, 5, windows=3)


@pytest.mark.parametrize("variant", ["rope", "rope_window", "corope_window"])
@torch.no_grad()
def test_a_failed_cached_call_leaves_the_cache_as_it_was(variant, monkeypatch):
    """A cached forward that fails in its last layer or in the head (out of memory, say)
    after the first layer appended leaves every slot as it was: the retried steps, a long
    chunk among them (past a windowed layer's buffer), compute the forward of the sequence.
    Reviews found the first layer's keys stored twice, and a crash without a window, when
    appends moved the slots before ``advance``, and the cache advanced before the head ran
    (a retry took the tokens at shifted positions: logits 0.17 off)."""
    model = make_model(variant)
    x = torch.randint(0, VOCAB, (2, 30), device=DEVICE)
    chunks = [6, 1, 1, 12, 1, 1, 1]
    expected = forward_logits(model, x, chunks)
    failing = [(model.blocks[-1].attn, "attend_cached"), (model.lm_head, "forward")]
    cache, out = KVCache.for_model(model, x.shape[1]), []
    for start, end in chunk_ends(chunks):
        for module, name in failing:  # every step fails at each place once first
            monkeypatch.setattr(module, name, lambda *a: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                model(x[:, start:end], cache)
            monkeypatch.undo()
        out.append(model(x[:, start:end], cache))
    torch.testing.assert_close(torch.cat(out, 1), expected, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match=r"advance\(2\) needs every layer to have appended 2"):
        cache.append(0, *(torch.zeros(2, 2, 1, 16, dtype=torch.float64, device=DEVICE),) * 2)
        cache.advance(2)


@torch.no_grad()
def test_a_failed_first_call_does_not_fix_the_caches_batch(monkeypatch):
    """A first call that fails after a layer appended commits nothing, so its batch does not
    bind the cache: a retry with fewer rows (what one does after running out of memory) is
    taken, and computes the forward (a review's find: the retry was refused)."""
    model = make_model("rope")
    x = torch.randint(0, VOCAB, (8, 10), device=DEVICE)
    cache = KVCache.for_model(model, 10)
    monkeypatch.setattr(model.blocks[-1].attn, "attend_cached", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(x, cache)
    monkeypatch.undo()
    logits = model(x[:2, :6], cache)
    assert cache.length == 6
    torch.testing.assert_close(logits, model(x[:2, :6]), atol=1e-10, rtol=1e-10)


@torch.no_grad()
def test_a_cache_that_drops_keys_a_layer_sees_is_refused():
    """A cache built with a smaller window than a layer's, or with one for a layer without a
    window, would drop keys the layer attends to: refused by name (a review's find: the
    logits were silently off by 0.17). A larger window holds more keys than needed: taken."""
    x = torch.zeros(1, 4, dtype=torch.long, device=DEVICE)
    model = make_model("rope_window")  # window 5 in layer 0, layer 1 global
    for windows, layer in (([3, None], 0), ([5, 5], 1)):
        with pytest.raises(ValueError, match=f"layer {layer}'s cache keeps its last"):
            model(x, KVCache(2, 8, windows))
    model(x, KVCache(2, 8, [6, None]))


@torch.no_grad()
def test_generate_holds_a_windowed_layers_last_keys_only(monkeypatch):
    """``generate`` builds its cache with each layer's window (``KVCache.for_model``): a
    windowed layer of window 5 holds 4 tokens after 30, a global one all 30."""
    import lm.generation

    caches = []
    monkeypatch.setattr(
        lm.generation.KVCache, "advance",
        lambda self, n, real=KVCache.advance: (caches.append(self), real(self, n))[1],
    )  # fmt: skip
    model = make_model("rope_window", torch.float32)  # window 5: layer 0 windowed, 1 global
    generate(model, torch.zeros(1, 20, dtype=torch.long, device=DEVICE), 10, temperature=0)
    cache = caches[-1]
    assert cache.length == 29 and (cache.held(0), cache.held(1)) == (4, 29)


@torch.no_grad()
def test_model_refuses_a_cached_sequence_past_max_len():
    model = make_model("learned")
    cache = KVCache.for_model(model, MAX_LEN + 4)
    model(torch.zeros(1, MAX_LEN - 2, dtype=torch.long, device=DEVICE), cache)
    with pytest.raises(
        ValueError, match=f"sequence length {MAX_LEN + 1} exceeds the model's max_len"
    ):
        model(torch.zeros(1, 3, dtype=torch.long, device=DEVICE), cache)


@pytest.mark.parametrize("steps", ["tokens", "chunks"])
@pytest.mark.parametrize(
    "variant",
    ["rope", "rope_interleaved", "rope_window", "rope_window_ntk", "corope", "corope_window"],
)
@torch.no_grad()
def test_triton_decoding_is_as_close_as_the_torch_path(variant, steps):
    """A prefill and cached steps by the kernels (RoPE: the Triton RoPE of the new rows, then
    SDPA over the rotated cache; Co-RoPE: the forward kernel for the prompt and for a chunk
    of several rows, the decoding kernels for one row) stay within flash-attention's rule of
    the PyTorch path run the same way, both against the fp64 forward (head dim 32). On the
    GPU under bf16 autocast, 45 tokens then 30 more; on the CPU in fp32 through the
    interpreter, 9 then 4 or 6 more."""
    if steps == "tokens":
        chunks = [45] + [1] * 30 if ON_GPU else [9] + [1] * 4
    else:
        chunks = [45, 7, 1, 13, 9] if ON_GPU else [9, 3, 1, 2]
    P, N = chunks[0], sum(chunks)
    x = torch.randint(0, VOCAB, (2, N), device=DEVICE)
    ref = forward_logits(make_model(variant, d_model=128), x, chunks)
    got = {}
    for impl in ("torch", "triton"):
        model = make_model(variant, torch.float32, impl, d_model=128)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ON_GPU):
            got[impl] = cached_logits(model, x, chunks)  # bf16 logits on the GPU
    for name, rows in (("prefill", slice(0, P)), ("decode", slice(P, N))):
        out, base = got["triton"][:, rows], got["torch"][:, rows]
        assert_close_to_baseline(f"{variant} {name}", out, ref[:, rows], base)
