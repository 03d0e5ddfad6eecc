"""A Hugging Face transformers model's RoPE and attention through ``rope_attention``.

``fuse_rope_attention(model)`` replaces the forward of each attention module of a supported
class (``FAMILIES``: Llama, Arcee, Gemma, Gemma 3, Granite, Mistral, Mixtral,
Ministral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, OLMo 2, Phi-3, Cohere, Cohere 2 (its sliding
layers; the full ones have no RoPE), GLM, GLM-4, GLM-4-MoE, and the checkpoints built on
them) with one that
takes the projections, unrotated, to ``rope_attention``: the rotation happens in its kernels
(the fused FlashAttention kernel or the Triton RoPE kernel before SDPA, by ``impl``), with the
model's own frequencies (its rotary embedding's ``inv_freq``, or Gemma 3's of the layer's
type; dynamic NTK's and LongRoPE's as they follow the length), attention factor (YaRN's,
LongRoPE's) and layout (Cohere's and GLM's interleaved pairs). ``unfuse_rope_attention``
puts the stock forwards back.

Which calls take the new path: causal ones (not ``is_causal=False``, in the call, the layer
or the config) of a model whose attention is SDPA (``attn_implementation="sdpa"``,
transformers' default where SDPA exists; a model of another attention is patched, but none
of its calls takes the path) that build no attention mask, or only a sliding window's (no
padding, no packed sequences without a cache: a text model called with no position ids and
no attention mask or one of ones, whose windowed layers' masks ``rope_attention``'s
``window`` replaces, ``PlainCalls``; under ``torch.compile`` transformers builds every mask,
so compiled calls take the stock forward but in those windowed layers), with no attention
dropout in training, no attention weights asked for, and a cache that is empty at the layer
or none (training, scoring, and a generation's prefill). A prefill stores its keys rotated, as the
stock forward does (one RoPE kernel over k), so the decoding steps after it, which take the
stock forward, see the cache they expect. Every other call takes the stock forward: its
result is transformers' own. Pass ``use_cache=False`` where nothing decodes after the
forward (scoring, training: transformers' models make a cache by default, in training mode
too), so that no keys are rotated for a cache.

This module imports nothing from transformers: it knows the supported forwards by their
classes' names and modules (``transformers.models.*``: a namesake defined elsewhere is
refused) and the signatures of transformers 5 (``hidden_states, position_embeddings,
attention_mask``, then ``cache`` from 5.24 on, ``past_key_values`` before: tested with 5.24
and 5.17), and refuses other versions' modules by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from fused_rope.attention import IMPLS, rope_attention
from fused_rope.frequencies import rope_angles
from fused_rope.rope import apply_rope


def _heads(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[B, N, H * D]`` -> ``[B, H, N, D]`` (a view)."""
    return x.view(*x.shape[:-1], -1, module.head_dim).transpose(1, 2)


def _project(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[B, H, N, D]`` before the rotation: Llama, Mistral, Qwen2."""
    return tuple(_heads(module, p(hidden)) for p in (module.q_proj, module.k_proj, module.v_proj))


def _project_head_norm(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3: q and k normalized over each head's channels, before the rotation."""
    shape = (*hidden.shape[:-1], -1, module.head_dim)
    q = module.q_norm(module.q_proj(hidden).view(shape)).transpose(1, 2)
    k = module.k_norm(module.k_proj(hidden).view(shape)).transpose(1, 2)
    return q, k, _heads(module, module.v_proj(hidden))


def _project_head_norm_if_used(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cohere, GLM-4-MoE: Qwen3's head norms where the config's ``use_qk_norm`` says so (Cohere's
    are layer norms with a weight per head), else Llama's projections."""
    return (_project_head_norm if module.use_qk_norm else _project)(module, hidden)


def _project_flat_norm(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """OLMo 2: q and k normalized over all heads' channels, before the rotation."""
    q = _heads(module, module.q_norm(module.q_proj(hidden)))
    k = _heads(module, module.k_norm(module.k_proj(hidden)))
    return q, k, _heads(module, module.v_proj(hidden))


def _project_fused_qkv(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Phi-3: one projection for q, k and v."""
    q_size = module.config.num_attention_heads * module.head_dim
    kv_size = module.num_key_value_heads * module.head_dim
    qkv = module.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
    return tuple(_heads(module, x) for x in qkv)


def _no_window(module: nn.Module) -> None:
    """Llama's forward passes no window (a model's sliding layers, Qwen2-MoE's, get it from
    their mask alone)."""
    return None


def _config_window(module: nn.Module) -> int | None:
    """Mistral's, Mixtral's and Phi-3's forward passes the config's window to every layer."""
    return module.config.sliding_window or None


def _layer_window(module: nn.Module) -> int | None:
    """Qwen2's, Qwen3's, Ministral's and Gemma 3's forward passes the layer's (None on full
    layers): the config's on a sliding layer, read at the call as the masks read it (the
    layer's own copy dates from its construction)."""
    return module.config.sliding_window if module.sliding_window else None


def _every_layer(module: nn.Module) -> bool:
    """Every layer of the family rotates its q and k."""
    return True


def _windowed_layers(module: nn.Module) -> bool:
    """Cohere 2: the sliding layers rotate; the full ones take no position encoding (NoPE)."""
    return module.sliding_window is not None


class Family(NamedTuple):
    """How a class's stock forward forms q, k, v ``[B, H, N, D]`` before the rotation, the
    sliding window it passes to the attention, whether it rotates the first ``2 *
    len(inv_freq)`` channels alone (``partial``: Phi-3's and GLM's ``partial_rotary_factor``)
    or requires them to be the whole head, the channels it pairs (``layout``: ``"half"``,
    transformers' ``rotate_half`` of Llama, or ``"interleaved"``, Cohere's and GLM's), and
    which of its layers rotate at all (``rotates``; the others are left unpatched)."""

    project: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, ...]]
    window: Callable[[nn.Module], int | None]
    partial: bool = False
    layout: str = "half"
    rotates: Callable[[nn.Module], bool] = _every_layer


# The attention classes whose stock forward is "project, rotate by position_embeddings, update
# the cache, attend causally, o_proj", by class name. Each is tested against its model
# (tests/fused_rope/test_hf.py): a class of the same forward may still rotate otherwise (GLM's
# interleaved partial rotation, Cohere's interleaved one), so none is taken by its shape alone.
FAMILIES: dict[str, Family] = {
    "LlamaAttention": Family(_project, _no_window),
    "ArceeAttention": Family(_project, _no_window),
    "GemmaAttention": Family(_project, _no_window),
    # Gemma 3: local and global layers of their own frequencies (_rotary_frequencies)
    "Gemma3Attention": Family(_project_head_norm, _layer_window),
    "GraniteAttention": Family(_project, _no_window),  # scaling: config.attention_multiplier
    "Qwen2MoeAttention": Family(_project, _no_window),
    "MistralAttention": Family(_project, _config_window),
    "MixtralAttention": Family(_project, _config_window),
    "MinistralAttention": Family(_project, _layer_window),
    "Qwen2Attention": Family(_project, _layer_window),
    "Qwen3Attention": Family(_project_head_norm, _layer_window),
    "Qwen3MoeAttention": Family(_project_head_norm, _layer_window),
    "Olmo2Attention": Family(_project_flat_norm, _no_window),
    # Phi-3, Phi-3.5, Phi-4-mini (LongRoPE, and 3/4 of the head rotated)
    "Phi3Attention": Family(_project_fused_qkv, _config_window, partial=True),
    "CohereAttention": Family(_project_head_norm_if_used, _no_window, layout="interleaved"),
    # Cohere 2 (Command R7B, Command A): Cohere's rotation on the sliding layers alone
    "Cohere2Attention": Family(
        _project, _layer_window, layout="interleaved", rotates=_windowed_layers
    ),
    # GLM and GLM-4: the first half of each head, interleaved (partial_rotary_factor 0.5)
    "GlmAttention": Family(_project, _no_window, partial=True, layout="interleaved"),
    "Glm4Attention": Family(_project, _no_window, partial=True, layout="interleaved"),
    "Glm4MoeAttention": Family(_project_head_norm_if_used, _no_window, partial=True),
}
# transformers 5's attention forward, its cache named as from 5.24 on or before (5.17's);
# 4.x's named it past_key_value and updated it otherwise
_SIGNATURES = {
    ("hidden_states", "position_embeddings", "attention_mask", name): name
    for name in ("cache", "past_key_values")
}


def _rotary_frequencies(rotary: nn.Module, module: nn.Module) -> tuple[torch.Tensor, float]:
    """The frequencies ``[R/2]`` and attention factor that ``rotary`` gives ``module``'s
    rotation: its ``inv_freq`` and ``attention_scaling``, or, where it holds a set for each
    layer type (Gemma 3's sliding and full layers: ``{layer_type}_inv_freq``), the set of the
    module's ``layer_type``. Read at each call: dynamic NTK's and LongRoPE's change with the
    length."""
    if not hasattr(rotary, "layer_types"):
        return rotary.inv_freq, rotary.attention_scaling
    kind = module.layer_type
    return getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling")


# The keyword with which PlainCalls marks a plain call: the text model passes its keywords to
# each decoder layer, which passes them to its attention (transformers 5)
PLAIN_CALL = "fused_rope_plain_call"


class PlainCalls:
    """Marks the plain calls of a text model (the rotary embedding's parent), whose windowed
    layers' masks ``rope_attention``'s ``window`` computes without a mask.

    A plain call is given no position ids (no packed sequences) and no attention mask, or a
    ``[B, N]`` one of ones (the tokenizer's, without padding; read once a call, as
    transformers reads it to skip the causal mask, but not while a CUDA graph is captured):
    every mask transformers then builds for a layer with a sliding window is the causal one
    cut to that window (built wherever the window binds, since SDPA has no window), and a layer
    without a window gets none in eager mode. A forward pre-hook adds ``PLAIN_CALL=True`` to
    such a call's keywords, which reach every attention module with the layer's other
    keywords: no state outside the call (threads, a call interrupted), and a layer recomputed
    under gradient checkpointing sees the keywords it saw. Installed only where a patched
    layer has a window and the text model's forward names ``attention_mask`` and
    ``position_ids`` and takes keywords (``installs``)."""

    def __init__(self, text_model: nn.Module):
        self.signature = inspect.signature(text_model.forward)
        self.handle = text_model.register_forward_pre_hook(self._mark, with_kwargs=True)

    @staticmethod
    def installs(text_model: nn.Module) -> bool:
        parameters = inspect.signature(text_model.forward).parameters
        return {"attention_mask", "position_ids"} <= set(parameters) and any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
        )

    def _mark(self, module, args, kwargs):
        if getattr(module.config, "_attn_implementation", None) != "sdpa":
            return None  # no keyword of ours for another attention's functions
        arguments = self.signature.bind_partial(*args, **kwargs).arguments
        mask, tokens = arguments.get("attention_mask"), arguments.get("input_ids")
        if tokens is None:
            tokens = arguments.get("inputs_embeds")
        no_padding = mask is None or (
            isinstance(mask, torch.Tensor)
            and tokens is not None
            and mask.shape == tokens.shape[:2]  # not longer: no prefix, no cached keys
            and not torch.compiler.is_compiling()  # a traced call reads no values
            and not (mask.is_cuda and torch.cuda.is_current_stream_capturing())
            and bool(mask.all())
        )
        if no_padding and arguments.get("position_ids") is None:
            return args, {**kwargs, PLAIN_CALL: True}
        return None

    def remove(self) -> None:
        self.handle.remove()


class RopeAttentionForward:
    """The forward of an attention module patched by ``fuse_rope_attention``: its arguments
    and return value are the stock forward's, ``(output [B, N, hidden], None)`` on the
    ``rope_attention`` path (no attention weights). ``plain``: the text model's
    ``PlainCalls`` (None where it has none), whose mark says that a windowed layer's mask is
    its window alone."""

    def __init__(self, module: nn.Module, rotary: nn.Module, impl: str, plain: PlainCalls | None):
        self.module, self.rotary, self.impl, self.plain = module, rotary, impl, plain
        self.family = FAMILIES[type(module).__name__]
        self.stock = type(module).forward.__get__(module)
        self.signature = inspect.signature(self.stock)
        self.cache_name = _SIGNATURES[tuple(self.signature.parameters)[:4]]

    def __call__(self, *args, **kwargs):
        plain = kwargs.pop(PLAIN_CALL, False)  # PlainCalls' mark, not for the stock forward
        arguments = self.signature.bind(*args, **kwargs).arguments
        extra = arguments.get("kwargs", {})
        module, cache = self.module, arguments.get(self.cache_name)
        if cache is None:  # the name transformers 5.24 deprecates, still taken
            cache = extra.get("past_key_values")
        mask, window = arguments.get("attention_mask"), self.family.window(module)
        fusable = (
            getattr(module.config, "_attn_implementation", None) == "sdpa"
            # no mask, or a windowed layer's that is its causal window alone
            and (mask is None or (window is not None and plain))
            # SDPA runs bidirectionally without a mask where the call, the layer or the
            # config says so (embedding models, LLM2Vec's encoders)
            and extra.get("is_causal", getattr(module, "is_causal", True)) is not False
            and getattr(module.config, "is_causal", True) is not False
            and not (module.training and module.attention_dropout > 0)
            and not extra.get("output_attentions", False)
            and (cache is None or cache.get_seq_length(module.layer_idx) == 0)
        )
        if not fusable:
            return self.stock(*args, **kwargs)
        hidden = arguments["hidden_states"]
        q, k, v = self.family.project(module, hidden)
        positions = extra.get("position_ids")
        if positions is None:  # no cache at the layer: the sequence starts at 0
            positions = torch.arange(hidden.shape[1], device=hidden.device)
        # transformers computes cos and sin from the fp32 frequencies whatever the model's
        # dtype (the rotary embedding may sit on another device of a split model)
        inv_freq, factor = _rotary_frequencies(self.rotary, module)
        inv_freq, factor = inv_freq.to(q.device, torch.float32), float(factor)
        rope_dim = 2 * inv_freq.numel()  # the first rope_dim channels rotate, as transformers'
        layout = self.family.layout
        if cache is not None:  # what the stock forward stores: the keys rotated
            angles = rope_angles(positions, inv_freq)
            k_rotated = apply_rope(
                k, angles, layout=layout, rope_dim=rope_dim, attention_factor=factor
            )
            if self.cache_name == "cache":  # as the stock forward calls it
                cache.update(k_rotated, v, module.layer_idx, kwargs=extra)
            else:
                cache.update(k_rotated, v, module.layer_idx)
        o = rope_attention(
            q, k, v, inv_freq=inv_freq, positions=positions, softmax_scale=module.scaling,
            attention_factor=factor, layout=layout, rope_dim=rope_dim,
            window=window, impl=self.impl,
        )  # fmt: skip
        return module.o_proj(o.transpose(1, 2).reshape(*hidden.shape[:-1], -1)), None


def _rotary_embedding(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model's one rotary embedding (transformers computes cos and sin once, at the top;
    Gemma 3's holds a set of frequencies for each layer type) and the module holding it, the
    text model whose forward builds the layers' masks."""
    found = [
        (n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")
    ]
    if len(found) != 1:
        names = [f"{n} ({type(m).__name__})" for n, m in found]
        raise ValueError(
            f"model must hold exactly one rotary embedding, whose frequencies every layer "
            f"takes, got {len(found)}: {names}"
        )
    name, rotary = found[0]
    return rotary, model.get_submodule(name.rpartition(".")[0])


def fuse_rope_attention(model: nn.Module, *, impl: str = "auto") -> list[str]:
    """Routes the attention modules of ``model`` (a transformers model of a class in
    ``FAMILIES``) through ``rope_attention``; see the module's docstring for which calls.

    Args:
        model: a transformers model (``LlamaForCausalLM``, ``Qwen3Model``, ...).
        impl: ``rope_attention``'s ``impl``: ``"auto"``, ``"fused"`` or ``"separate"``.

    Returns:
        the qualified names of the patched modules. Patching again replaces the patch
        (a new ``impl``).

    Raises ``TypeError`` for a model that is not an ``nn.Module``, ``ValueError`` for a bad
    ``impl``, a model with no attention module of a supported class, with several rotary
    embeddings, whose frequencies do not rotate the whole head (outside the families of a
    partial rotation: Phi-3, GLM), whose attention forward is not transformers 5's, or whose
    attention class only shares a supported one's name (defined outside transformers).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    modules = [
        (n, m)
        for n, m in model.named_modules()
        if type(m).__name__ in FAMILIES and FAMILIES[type(m).__name__].rotates(m)
    ]
    if not modules:
        classes = sorted(
            {type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__}
        )
        raise ValueError(
            f"model has no attention module that rotates, of a supported class "
            f"{sorted(FAMILIES)}, got attention classes {classes}"
        )
    rotary, text_model = _rotary_embedding(model)
    for name, module in modules:
        cls = type(module)
        if not cls.__module__.startswith("transformers.models."):  # a namesake's own forward
            raise ValueError(
                f"{name}: {cls.__name__} is defined in {cls.__module__}, not in transformers' "
                "models, so its forward may not be the one this module replaces"
            )
        parameters = tuple(inspect.signature(cls.forward).parameters)[1:5]
        if parameters not in _SIGNATURES:
            raise ValueError(
                f"{name}: {cls.__name__}.forward takes {parameters}, not one of transformers "
                f"5's {sorted(_SIGNATURES)}"
            )
        inv_freq = _rotary_frequencies(rotary, module)[0]
        rope_dim = 2 * inv_freq.numel()
        partial = FAMILIES[type(module).__name__].partial
        if rope_dim > module.head_dim or (rope_dim != module.head_dim and not partial):
            raise ValueError(
                f"{name}: the rotary embedding's {inv_freq.numel()} frequencies rotate "
                f"{rope_dim} channels, not the head's {module.head_dim}"
                + ("" if partial else f" ({type(module).__name__} rotates the whole head)")
            )
    unfuse_rope_attention(model)  # patching again replaces the patch, and its hook
    windowed = any(FAMILIES[type(m).__name__].window(m) is not None for _, m in modules)
    plain = PlainCalls(text_model) if windowed and PlainCalls.installs(text_model) else None
    for _, module in modules:
        module.forward = RopeAttentionForward(module, rotary, impl, plain)
    return [name for name, _ in modules]


def unfuse_rope_attention(model: nn.Module) -> list[str]:
    """Puts back the stock forward of each module that ``fuse_rope_attention`` patched, and
    takes its hook off the text model; returns their qualified names (none: an empty list)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    restored = []
    for name, module in model.named_modules():
        patched = module.__dict__.get("forward")
        if isinstance(patched, RopeAttentionForward):
            if patched.plain is not None:  # the modules share one; a second removal is a no-op
                patched.plain.remove()
            del module.forward
            restored.append(name)
    return restored


__all__ = [
    "FAMILIES",
    "Family",
    "PlainCalls",
    "RopeAttentionForward",
    "fuse_rope_attention",
    "unfuse_rope_attention",
]
