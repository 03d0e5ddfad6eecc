"""Causal self-attention variants, one ``nn.Module`` each, registered by name.

Every variant shares the projections (grouped-query: ``n_head`` query heads share
``n_kv_head`` key/value heads) and differs in ``attend(q, k, v)``, where position
information enters (or not):

    nope        no position information at all
    sinusoidal  no position inside attention; the model adds a sinusoidal table at the input
    learned     no position inside attention; the model adds a learned table at the input
    rope        q and k rotated by their positions (RoPE), then plain causal attention
    corope      Co-RoPE-GQA: keys rotated by a content-gated mileage (corope/README.md)

``impl`` (rope, corope): ``torch`` is the PyTorch reference path, ``triton`` the kernels,
``auto`` takes Triton on CUDA and PyTorch elsewhere; the choice is logged once.

``attend`` takes queries for the last ``NQ`` of the ``NK`` key positions (``NQ = NK`` in
training). Decoding continues a ``lm.generation.KVCache`` through ``attend_cached``, so that a
cached call computes what a forward over the sequence so far computes at its rows: RoPE caches
its keys rotated (each rotated once, at its position); Co-RoPE caches them as projected and
rotates them all at each call, since the new query's gates set every key's mileage, and so
does RoPE with dynamic NTK or LongRoPE, whose frequencies follow the sequence's length
(``lm/generation.py`` says where it departs from the forward). A windowed layer's cache holds
only the keys its next queries see.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from fused_rope._validation import interpreting
from fused_rope.frequencies import rope_angles, rope_frequencies, scaling_type
from fused_rope.query_scale import llama4_attn_scale, scale_unchecked
from fused_rope.sdpa import sdpa_attention
from lm.config import ATTENTION_SCHEMAS, QueryScaleConfig

if TYPE_CHECKING:
    from lm.generation import KVCache

log = logging.getLogger(__name__)

IMPLS = ("auto", "triton", "torch")
_logged: set[tuple[str, str, str]] = set()


def _as_dict(cfg: Any) -> dict:
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, dict):
        return dict(cfg)
    return dict(vars(cfg))


def scaling_dict(scaling: Any) -> dict | None:
    """The config's scaling node as ``rope_frequencies``'s dict: null fields dropped,
    None when no type is set. A field set without a type is refused: it would train the
    unscaled model under the field's name (a sweep over ``attention.scaling.factor``)."""
    if scaling is None:
        return None
    d = {k: v for k, v in _as_dict(scaling).items() if v is not None}
    if d.get("type") is None and d:
        fields = ", ".join(f"attention.scaling.{k}={v}" for k, v in d.items())
        raise ValueError(
            f"{fields} set but attention.scaling.type is null (no scaling); set a type "
            f"(linear, dynamic, ntk_alpha, yarn, llama3, longrope) or leave the fields null"
        )
    return d or None


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention.impl must be one of {IMPLS}, got {impl!r}")


def check_impl_device(impl: str | None, device: torch.device) -> None:
    """``attention.impl=triton`` runs the Triton kernels: on CUDA, or on the CPU in Triton's
    interpreter (``TRITON_INTERPRET=1``); refused elsewhere at start-up, not at the first
    forward pass."""
    if impl == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"attention.impl=triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU, "
            f"slowly), got {device.type}; use attention.impl=auto or torch"
        )


def check_sinusoidal_base(base, name: str = "base") -> None:
    """The sinusoidal table's ``base`` is a finite number > 1 (at 1 every channel pair turns at
    one frequency); errors name it ``name``."""
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(base).__name__}")
    if not (math.isfinite(base) and base > 1):
        raise ValueError(f"{name} must be a finite number > 1, got {base!r}")


def check_attention_config(attn_cfg: Any, model_cfg: Any, device: torch.device) -> None:
    """Refuses, before data or weights load, an attention configuration that the model
    (``model_cfg``) or ``device`` cannot run: ``impl=triton`` off CUDA without the interpreter,
    what the attention class's own ``check_device`` refuses, and the layer settings
    ``nope_layers`` refuses (from the configs: no layer is built)."""
    check_impl_device(attn_cfg.get("impl"), device)
    m = model_cfg
    head_dim = resolve_head_dim(m.d_model, m.n_head, m.get("head_dim"))
    attention_class(attn_cfg).check_device(attn_cfg, head_dim, device)
    nope = nope_layers(attn_cfg, m.n_layer)
    windows = window_layers(attn_cfg, m.n_layer)
    resolve_query_scale(attn_cfg)
    if attention_class(attn_cfg).input_pe == "sinusoidal":  # the model's table, not a layer's
        check_sinusoidal_base(attn_cfg.base, "attention.base")
    _check_window_theta_leaves_a_layer(attn_cfg, m.n_layer, nope, windows)
    # One layer of each kind the model will have (its checks: base, schedule, layout, impl,
    # leader), before the data loads; a few small matrices on the CPU
    for kind in sorted({(i in nope, windows.get(i)) for i in range(m.n_layer)}, key=str):
        try:
            build_attention(attn_cfg, m.d_model, m.n_head, m.n_kv_head, m.get("head_dim"), *kind)
        except (TypeError, ValueError) as error:
            if str(error).startswith("attention."):
                raise
            raise type(error)(f"attention: {error}") from None


def _check_window_theta_leaves_a_layer(
    cfg: Any, n_layer: int, nope: set[int], windows: dict[int, int]
) -> None:
    """``attention.window_theta`` gives the windowed layers their own unscaled base; where no
    layer is both global and rotary (every layer windowed, or every global one NoPE, as in
    Command A), ``theta`` and ``scaling`` reach no layer: refused where they are set, since
    the run would train another schedule under their names (YaRN's factor dropped)."""
    node = _as_dict(cfg)
    if node.get("window_theta") is None or set(range(n_layer)) - nope - set(windows):
        return
    unused = []
    if scaling_dict(node.get("scaling")) is not None:
        unused.append(f"attention.scaling.type={node['scaling']['type']}")
    if node.get("theta") != getattr(ATTENTION_SCHEMAS[node["name"]], "theta", None):
        unused.append(f"attention.theta={node.get('theta')}")
    if unused:
        raise ValueError(
            f"{' and '.join(unused)} would reach no layer: with attention.window_theta every "
            "rotary layer is windowed and takes window_theta, unscaled (global_interval null, "
            "or every global layer NoPE by nope_interval): drop them (the windowed layers' "
            "base is window_theta), or give the model a global rotary layer"
        )


def resolve_head_dim(d_model: int, n_head: int, head_dim: int | None) -> int:
    """``head_dim``, or ``d_model // n_head`` where it is None (``model.head_dim: null``)."""
    return d_model // n_head if head_dim is None else head_dim


def resolve_impl(impl: str, device: torch.device, variant: str) -> str:
    """``auto`` -> ``triton`` on CUDA, ``torch`` elsewhere; logs the choice once per variant."""
    check_impl(impl)
    resolved = impl if impl != "auto" else ("triton" if device.type == "cuda" else "torch")
    key = (variant, impl, resolved)
    # Not while torch.compile traces: a logging call breaks the graph (logged when run eagerly)
    if key not in _logged and not torch.compiler.is_compiling():
        _logged.add(key)
        log.info("attention %s: impl=%s -> %s on %s", variant, impl, resolved, device.type)
    return resolved


def resolve_query_scale(cfg: Any, rotary: bool = False) -> tuple[float, int, int] | None:
    """``(beta, length, offset)`` of ``attention.query_scale`` for a layer that rotates its
    queries and keys (``rotary``) or not, checked; None where ``beta`` is null or 0 (a config
    from before the key has none), or where ``layers`` is ``nope`` and the layer rotates."""
    unset = asdict(QueryScaleConfig())  # the schema's defaults: a config from before the key
    node = unset | (_as_dict(cfg).get("query_scale") or {})
    beta, length, layers, offset = (node[k] for k in ("beta", "length", "layers", "offset"))
    if layers not in ("all", "nope"):
        raise ValueError(f"attention.query_scale.layers must be 'all' or 'nope', got {layers!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"attention.query_scale.offset must be an int >= 0, got {offset!r}")
    if beta is None:
        unused = {k: v for k, v in node.items() if v != unset.get(k)}
        if unused:
            fields = ", ".join(f"attention.query_scale.{k}={v}" for k, v in unused.items())
            raise ValueError(
                f"{fields} set but attention.query_scale.beta is null (no query scale); set "
                "beta or leave them as they are"
            )
        return None
    try:
        llama4_attn_scale(torch.zeros(1, dtype=torch.long), beta, length)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"attention.query_scale (beta={beta!r}, length={length!r}): {e}; length is the "
            "position where the scale first steps up (Ministral 3's "
            "original_max_position_embeddings)"
        ) from None
    if beta == 0 or (rotary and layers == "nope"):
        return None
    return float(beta), int(length), offset


def _every_kth_layer(cfg: Any, key: str, n_layer: int, what: str) -> set[int]:
    """Layers ``k - 1, 2k - 1, ...`` for ``attention.<key> = k`` (none for null), refusing an
    interval of 1 or past ``n_layer`` (no such layer: a sweep would train another model under
    its name); ``what``: what those layers do, for the message."""
    k = _as_dict(cfg).get(key)
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= n_layer):
        need = f"an int in [2, model.n_layer={n_layer}]" if n_layer >= 2 else "model.n_layer >= 2"
        raise ValueError(f"attention.{key} needs {need} ({what}) or null, got {k!r}")
    return set() if k is None else set(range(k - 1, n_layer, k))


def window_layers(cfg: Any, n_layer: int) -> dict[int, int]:
    """``{layer: window}`` for the layers that attend within ``attention.window`` keys: every
    layer but those of ``attention.global_interval`` (Gemma's global layers), none without a
    window. Refused: a window that is not an int >= 1, and an interval or window_theta without
    a window. Co-RoPE takes a window too: the mileage of a key a query sees sums the gates of
    the keys between them, all inside the window."""
    node = _as_dict(cfg)
    window = node.get("window")
    if window is None:
        for key, what in (("global_interval", "picks the layers that see every key"),
                          ("window_theta", "is the RoPE base of the windowed layers")):  # fmt: skip
            if node.get(key) is not None:
                raise ValueError(
                    f"attention.{key}={node[key]} {what}, but attention.window is null (no "
                    "layer has a window): set it"
                )
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"attention.window must be an int >= 1 or null, got {window!r}")
    if node.get("window_theta") is not None:
        try:
            rope_frequencies(2, node["window_theta"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"attention.window_theta: {e}") from None
    every = _every_kth_layer(cfg, "global_interval", n_layer, "every k-th layer sees every key")
    return {i: window for i in range(n_layer) if i not in every}


def nope_layers(cfg: Any, n_layer: int) -> set[int]:
    """The layers ``attention.nope_interval`` (rope, corope) leaves without rotation:
    ``k - 1, 2k - 1, ...`` for an interval ``k`` (Llama 4's ``no_rope_layer_interval``), none
    for null. Refused: an interval of 1 (that is ``attention=nope``) or past ``n_layer`` (no
    such layer: a sweep would train the rotary model under its name), and
    ``query_scale.layers=nope`` on a rotary model without such layers (it would scale
    nothing); for an attention without rotation every layer is one."""
    node = _as_dict(cfg)
    what = "every k-th layer without rotation; 1 is attention=nope"
    layers = _every_kth_layer(cfg, "nope_interval", n_layer, what)
    scale = node.get("query_scale") or {}
    scales_nothing = scale.get("layers") == "nope" and scale.get("beta") and not layers
    if scales_nothing and attention_class(cfg).rotary:
        raise ValueError(
            "attention.query_scale.layers=nope scales the layers without rotation, and this "
            "model has none: set attention.nope_interval, or layers=all"
        )
    return layers


class Attention(nn.Module):
    """Causal GQA self-attention without position information (``nope``).

    Subclasses override ``attend``; ``input_pe`` tells the model which absolute position
    encoding to add to the token embeddings (None: none). Every variant takes
    ``attention.query_scale``: the queries scaled by their position (``llama4_attn_scale``)
    before ``attend`` (Co-RoPE's leader queries set the gates from them too).
    """

    input_pe: str | None = None
    rotary = False  # whether q and k are rotated (attention.query_scale.layers=nope skips it)

    def __init__(
        self,
        cfg: Any,
        d_model: int,
        n_head: int,
        n_kv_head: int,
        head_dim: int | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.window = window  # a causal sliding window of keys (window_layers'), or None
        if head_dim is None and d_model % n_head:
            raise ValueError(
                f"model.d_model={d_model} must be a multiple of model.n_head={n_head}, "
                f"or set model.head_dim"
            )
        if n_kv_head < 1 or n_head % n_kv_head:
            raise ValueError(
                f"model.n_head={n_head} must be a multiple of model.n_kv_head={n_kv_head}"
            )
        self.n_head, self.n_kv_head = n_head, n_kv_head
        # Gemma's and Qwen3's head width is not d_model / n_head; the projections carry it.
        self.head_dim = resolve_head_dim(d_model, n_head, head_dim)
        self.wq = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.wkv = nn.Linear(d_model, 2 * n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(n_head * self.head_dim, d_model, bias=False)
        self.query_scale = resolve_query_scale(cfg, self.rotary)  # (beta, length, offset)
        self.timer = None  # an lm.profiling.AttentionTimer, set by the trainer

    @classmethod
    def check_device(cls, cfg: Any, head_dim: int, device: torch.device) -> None:
        """Refuses, before the first step, a configuration ``cfg`` (heads of ``head_dim``
        channels) this attention cannot run on ``device`` (``impl=auto`` runs the Triton
        kernels on CUDA, the torch path elsewhere)."""

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        B, N, _ = x.shape  # (B, N, C)
        q = self.wq(x).view(B, N, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, N, D)
        kv = self.wkv(x).view(B, N, 2, self.n_kv_head, self.head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, HKV, N, D) each
        if self.query_scale is not None:
            q = self._scale_queries(q, 0 if cache is None else cache.length)
        if cache is not None:  # inference: the timer is of training steps
            cache.check_window(layer, self.window)  # it holds the keys this layer sees
            o = self.attend_cached(q, k, v, cache, layer)
        elif self.timer:
            o = self.timer.around(self.attend, q, k, v)
        else:
            o = self.attend(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(B, N, -1))  # (B, N, C)

    def _scale_queries(self, q: torch.Tensor, first: int) -> torch.Tensor:
        """q ``(B, H, N, D)`` at positions ``first..first + N - 1`` times their scale (of the
        position plus ``offset``), cast to q's dtype first as transformers' Ministral 3 does."""
        beta, length, offset = self.query_scale
        first += offset
        positions = torch.arange(first, first + q.shape[2], device=q.device)
        # checked when the layer was built (resolve_query_scale)
        return q * scale_unchecked(positions, beta, length).to(q.dtype)[:, None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``(B, H, NQ, D)`` at the last ``NQ`` positions, k and v ``(B, HKV, NK, D)`` ->
        ``(B, H, NQ, D)``."""
        return sdpa_attention(q, k, v, window=self.window)

    def attend_cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        """q ``(B, H, N, D)``, k and v ``(B, HKV, N, D)`` of the ``N`` tokens after the
        ``cache.length`` that ``cache`` has seen: stores k and v in slot ``layer`` and attends
        to every position held (all, or a windowed layer's last ones) -> ``(B, H, N, D)``. Here
        the cache holds the keys as projected and ``attend`` sees them all."""
        k, v = cache.append(layer, k, v)  # (B, HKV, held + N, D) each
        return self.attend(q, k, v)


class SinusoidalAttention(Attention):
    input_pe = "sinusoidal"


class LearnedAttention(Attention):
    input_pe = "learned"


# The schedules whose frequencies follow the sequence's length, by their names in messages:
# dynamic NTK ("xdrope" too) and LongRoPE (short factors up to the original length, long ones
# past it)
_LENGTH_SCHEDULES = {"dynamic": "dynamic NTK", "longrope": "LongRoPE"}


class RotaryFrequencies(nn.Module):
    """``inv_freq`` of ``rope_frequencies(rope_dim, theta, scaling)``; for dynamic NTK and
    LongRoPE it is recomputed for each sequence length (the schedule depends on it). A buffer that follows
    the model's device but stays fp32 when the model is cast to half precision (fp64 with an
    fp64 model): bf16 frequencies would be off by up to 2^-9 of each, phase errors that grow
    with the position.

    ``learn=True``: the frequencies are a parameter, ``log_inv_freq`` (R/2,), initialised from
    the schedule and learned in log space, so that AdamW's steps change each frequency by a
    like fraction (in linear space a step of the learning rate's size would swamp the lowest
    frequencies, 1e-4 at theta = 10^4); fp32 whatever the model is cast to. Not with dynamic
    NTK or LongRoPE, whose frequencies follow the sequence length."""

    def __init__(self, rope_dim: int, theta: float, scaling: dict | None, learn: bool = False):
        super().__init__()
        self.rope_dim, self.theta, self.scaling = rope_dim, theta, scaling
        self.dynamic = scaling_type(scaling) in _LENGTH_SCHEDULES
        inv_freq, self.attention_factor = rope_frequencies(rope_dim, theta, scaling)
        self.learn = learn
        if not learn:
            self.register_buffer("inv_freq", inv_freq, persistent=False)  # (R/2,)
            return
        if self.dynamic:
            raise ValueError(
                f"attention.learn_freq=true cannot learn "
                f"{_LENGTH_SCHEDULES[scaling_type(scaling)]}'s frequencies, which are "
                f"recomputed for each sequence length; pick another attention.scaling.type"
            )
        self.log_inv_freq = nn.Parameter(inv_freq.log())

    def _apply(self, fn, recurse=True):
        if self.learn:  # .to(), .cuda(): the device; a half dtype would round what was learned
            param = self.log_inv_freq
            # .data: Module._apply swaps the data of the parameter and of its gradient in place
            kept, kept_grad = param.data, None if param.grad is None else param.grad.data
            super()._apply(fn, recurse)
            param = self.log_inv_freq
            if param.dtype != kept.dtype:  # the values (and gradient) as they were, moved
                if kept.is_meta:  # to_empty(): no values to keep, only the dtype
                    param.data = param.data.to(kept.dtype)
                else:
                    param.data = kept.to(param.device)
                if kept_grad is not None:
                    param.grad = kept_grad.to(param.device)
            return self
        super()._apply(fn, recurse)  # .to(), .cuda(), .bfloat16(), ...: device and dtype
        if self.inv_freq.dtype not in (torch.float32, torch.float64):  # recomputed, not upcast
            inv_freq = rope_frequencies(self.rope_dim, self.theta, self.scaling)[0]
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def for_length(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """``(inv_freq (R/2,), attention_factor)`` for sequences of ``seq_len`` tokens."""
        if self.learn:
            return self.log_inv_freq.exp(), self.attention_factor
        if not self.dynamic:
            return self.inv_freq, self.attention_factor
        inv_freq, factor = rope_frequencies(
            self.rope_dim, self.theta, self.scaling, seq_len=seq_len
        )
        return inv_freq.to(self.inv_freq.device), factor


def _rope_dim(cfg: Any, head_dim: int) -> int:
    if cfg.rope_dim is None and head_dim % 2:
        raise ValueError(
            f"the head dim (model.head_dim, or model.d_model / model.n_head) must be even for a "
            f"rotation of all its channels, got {head_dim}; or set attention.rope_dim to an even "
            f"part of it"
        )
    rope_dim = head_dim if cfg.rope_dim is None else cfg.rope_dim
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(
            f"attention.rope_dim must be even and in [2, head_dim={head_dim}], got {cfg.rope_dim}"
        )
    return rope_dim


class RopeAttention(Attention):
    """RoPE on q and k (positions ``0..N-1``), then causal SDPA. The attention factor of the
    scaled schedules (YaRN's mscale) multiplies q's and k's rotated channels, as Hugging
    Face's scaled cos/sin do (``attention_factor`` of the kernels and the reference)."""

    rotary = True

    def __init__(self, cfg: Any, *dims: int | None) -> None:
        super().__init__(cfg, *dims)
        check_impl(cfg.impl)
        if cfg.layout not in ("half", "interleaved"):
            raise ValueError(
                f"attention.layout must be 'half' or 'interleaved', got {cfg.layout!r}"
            )
        # Plain values, not the config: torch.compile traces them without a graph break
        self.impl, self.layout = cfg.impl, cfg.layout
        self.rope_dim = _rope_dim(cfg, self.head_dim)
        theta, scaling = cfg.theta, scaling_dict(cfg.scaling)
        if self.window is not None and cfg.get("window_theta") is not None:
            # Gemma 3's local layers: their own base, unscaled (rope_local_base_freq)
            theta, scaling = cfg.window_theta, None
        self.freqs = RotaryFrequencies(self.rope_dim, theta, scaling, cfg.learn_freq)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        inv_freq, factor = self.freqs.for_length(k.shape[2])
        if resolve_impl(self.impl, q.device, "rope") == "triton":
            from fused_rope.attention import rope_attention

            return rope_attention(
                q,
                k,
                v,
                inv_freq=inv_freq,
                attention_factor=factor,
                layout=self.layout,
                rope_dim=self.rope_dim,
                window=self.window,
            )
        q, k = self._rotate(q, k, 0, inv_freq, factor, triton=False)
        return sdpa_attention(q, k, v, window=self.window)

    def attend_cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        """The new rows of q and k rotated once, at their positions, and the keys cached
        rotated: the rotation's work no longer grows with the cache (rotating every cached
        key at each step took 1.4x the attention's GPU time at B = 8 with 16K cached tokens).
        A chunk of several rows runs SDPA too, where ``rope_attention`` would have picked
        its fused kernel for a long chunk (it would rotate the cached keys again), except a
        windowed layer's prefill past its window into an empty cache on the Triton path. Dynamic
        NTK's and LongRoPE's frequencies follow the length, so they keep the keys as projected
        and rotate the held ones at their positions at each call."""
        length = cache.length + q.shape[2]  # the sequence's tokens, these N included
        inv_freq, factor = self.freqs.for_length(length)
        triton = resolve_impl(self.impl, q.device, "rope") == "triton"
        if triton and self.window is not None and cache.length == 0 and q.shape[2] > self.window:
            # A windowed layer's prefill past its window: the training path, whose fused
            # kernel skips the keys outside the window, where SDPA has no window kernel (a
            # boolean mask over chunks of queries); the keys are rotated once more for the cache
            o = self.attend(q, k, v)
            if not self.freqs.dynamic:
                k = self._rotate_keys(k, 0, inv_freq, factor)
            cache.append(layer, k, v)
            return o
        if self.freqs.dynamic:
            k, v = cache.append(layer, k, v)  # (B, HKV, held + N, D): the last held + N tokens
            q, k = self._rotate(q, k, length - k.shape[2], inv_freq, factor, triton)
        else:
            q, k = self._rotate(q, k, cache.length, inv_freq, factor, triton)
            k, v = cache.append(layer, k, v)  # (B, HKV, held + N, D) each, the keys rotated
        return sdpa_attention(q, k, v, window=self.window)

    def _rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        first: int,
        inv_freq: torch.Tensor,
        factor: float,
        triton: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated and scaled by the attention factor: k's rows at positions
        ``first, first + 1, ...``, q's at the last ``NQ`` of them; the Triton RoPE kernel
        (``triton``) or the PyTorch reference."""
        NQ, NK = q.shape[2], k.shape[2]
        layout, R = self.layout, self.rope_dim
        if triton:  # the kernel forms the angles of first.. itself: no tensors built per step
            from fused_rope.rope import apply_rope_qk

            return apply_rope_qk(
                q, k, inv_freq=inv_freq, position_offset=first, layout=layout, rope_dim=R,
                attention_factor=factor,
            )  # fmt: skip
        angles = rope_angles(torch.arange(first, first + NK, device=q.device), inv_freq)
        from fused_rope.naive import apply_rope_ref

        q = apply_rope_ref(q, angles[NK - NQ :], layout, R, attention_factor=factor)
        return q, apply_rope_ref(k, angles, layout, R, attention_factor=factor)

    def _rotate_keys(
        self, k: torch.Tensor, first: int, inv_freq: torch.Tensor, factor: float
    ) -> torch.Tensor:
        """k alone, as ``_rotate`` rotates it with the Triton RoPE kernel."""
        from fused_rope.rope import apply_rope

        return apply_rope(
            k, inv_freq=inv_freq, position_offset=first, layout=self.layout,
            rope_dim=self.rope_dim, attention_factor=factor,
        )  # fmt: skip


class CoRopeAttention(Attention):
    """Co-RoPE-GQA. The frequencies follow the same scaling options as RoPE (and, with
    ``learn_freq``, are learned as RoPE's are: ``RotaryFrequencies``), but not their
    attention factor (Co-RoPE's softmax scale also sets the gates' temperature, so the two
    cannot be read the same way): a schedule whose factor is not 1 (YaRN's mscale) is refused
    rather than dropped; ``attention.scaling.attention_factor=1.0`` takes its frequencies
    alone."""

    rotary = True

    def __init__(self, cfg: Any, *dims: int | None) -> None:
        super().__init__(cfg, *dims)
        check_impl(cfg.impl)
        if cfg.leader not in ("first", "mean"):
            raise ValueError(f"attention.leader must be 'first' or 'mean', got {cfg.leader!r}")
        self.impl, self.leader, self.chunk_size = cfg.impl, cfg.leader, cfg.chunk_size
        self.detach_mileage = cfg.detach_mileage
        self.rope_dim = _rope_dim(cfg, self.head_dim)
        scaling = scaling_dict(cfg.scaling)
        self.freqs = RotaryFrequencies(self.rope_dim, cfg.theta, scaling, cfg.learn_freq)
        if self.freqs.attention_factor != 1.0:
            raise ValueError(
                f"attention.scaling of type {cfg.scaling.type!r} gives an attention factor of "
                f"{self.freqs.attention_factor:.4g}, which Co-RoPE does not apply (its softmax "
                "scale is also the gates' temperature): set attention.scaling.attention_factor="
                "1.0 to take the schedule's frequencies alone"
            )

    @classmethod
    def check_device(cls, cfg: Any, head_dim: int, device: torch.device) -> None:
        from corope.forward import SUPPORTED_HEAD_DIMS

        if resolve_impl(cfg.impl, device, "corope") == "triton":
            if head_dim not in SUPPORTED_HEAD_DIMS:
                raise ValueError(
                    f"Co-RoPE's Triton kernels take head dims {SUPPORTED_HEAD_DIMS}, got "
                    f"{head_dim} (model.head_dim, or model.d_model / model.n_head); set one "
                    f"of those, or take its PyTorch path, slower (attention.impl=torch; "
                    f"sample.py --impl torch)"
                )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._corope(q, k, v, k.shape[2])

    def attend_cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        """As ``Attention.attend_cached``, with dynamic NTK's frequencies of the sequence's
        length, which a windowed layer's held keys fall short of."""
        length = cache.length + q.shape[2]
        k, v = cache.append(layer, k, v)  # (B, HKV, held + N, D) each
        return self._corope(q, k, v, length)

    def _corope(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int
    ) -> torch.Tensor:
        """``attend`` of q ``(B, H, NQ, D)`` over the last ``NK`` keys of a sequence of
        ``length`` tokens (the frequencies' length) -> ``(B, H, NQ, D)``."""
        inv_freq, _ = self.freqs.for_length(length)  # the factor is 1 (checked above)
        kwargs = dict(
            inv_freq=inv_freq,
            rope_dim=self.rope_dim,
            leader=self.leader,
            detach_mileage=self.detach_mileage,
            window=self.window,
        )
        # The kernels take q and k of one length (training, a prefill) or, without autograd,
        # the queries of a cached chunk (a decoding step: one row); with autograd, such a
        # chunk runs the reference.
        NQ, NK = q.shape[2], k.shape[2]
        kernels = NQ == NK or not torch.is_grad_enabled()
        if resolve_impl(self.impl, q.device, "corope") == "triton" and kernels:
            from corope import corope_attention

            return corope_attention(q, k, v, **kwargs)
        from corope.naive import corope_attention_ref

        return corope_attention_ref(q, k, v, chunk_size=self.chunk_size, **kwargs)


ATTENTIONS: dict[str, type[Attention]] = {
    "nope": Attention,
    "sinusoidal": SinusoidalAttention,
    "learned": LearnedAttention,
    "rope": RopeAttention,
    "corope": CoRopeAttention,
}


def attention_class(cfg: Any) -> type[Attention]:
    """The module class for ``cfg.name``; ValueError naming the known ones otherwise."""
    name = cfg.name
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention.name {name!r}; known: {sorted(ATTENTIONS)}")
    return ATTENTIONS[name]


def build_attention(
    cfg: Any,
    d_model: int,
    n_head: int,
    n_kv_head: int,
    head_dim: int | None = None,
    nope: bool = False,
    window: int | None = None,
) -> Attention:
    """The attention module ``cfg`` names, for a model of width ``d_model``, with heads of
    ``head_dim`` channels (None: ``d_model // n_head``); ``nope``: the plain ``Attention``
    (no rotation) in its place, for the layers of ``nope_layers``; ``window``: its sliding
    window, for the layers of ``window_layers``."""
    cls = Attention if nope else attention_class(cfg)
    return cls(cfg, d_model, n_head, n_kv_head, head_dim, window)
