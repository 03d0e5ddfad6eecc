"""Inverse frequencies, context-extension schedules and rotation angles.

Angles are the one thing every RoPE kernel consumes: fp32 ``[N, R/2]`` or
``[B, N, R/2]`` (``R = rope_dim``), slot ``d`` rotating channel pair ``d``. Every
function here ends in such a tensor, whatever the positions look like (1-D,
per batch, M-RoPE's ``t/h/w`` axes, or N-dimensional coordinates).

Frequencies are computed in float64 and rounded once to fp32. Angles are an
elementwise fp32 product ``position * inv_freq``, never a matrix product: on a
GPU a matmul may run in TF32 (10-bit mantissa), which rounds position 10_000 to a
multiple of 8 and so moves its fastest angle by up to 4 radians.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence

import torch

from fused_rope._validation import (
    FREQ_DTYPES,
    as_device,
    check_bool,
    check_finite_on_cpu,
    check_float_tensor,
    check_position_tensor,
    check_same_device,
    is_finite,
    runs_eagerly,
)

# Per scaling type: (required keys, optional keys) besides "type"/"rope_type", "rope_theta" and
# the keys any type may carry (_check_shared_keys).
_SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    # HunYuan's checkpoints also carry the other keys, which transformers ignores for it.
    "ntk_alpha": (
        ("alpha",),
        (
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
        ),
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    ),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        (
            "factor",
            "attention_factor",
            "max_position_embeddings",
            "short_mscale",
            "long_mscale",
        ),
    ),
    "proportional": ((), ("factor", "partial_rotary_factor")),
}
SCALING_TYPES = tuple(_SCALING_KEYS)
# The range of each numeric key, checked wherever the key is present (_check_present_keys),
# read or not: a key that loses to another (YaRN's mscale to attention_factor, LongRoPE's
# factor to max_position_embeddings) or that a type carries unread (HunYuan's yarn keys) is
# still a claim about the model, and "garbage" or NaN there is an error in the config.
# (minimum, strict): the number must be > minimum (>= when not strict); each schedule then
# checks its own tighter bounds (a factor >= 1).
_NUMBER_KEYS = {
    "factor": (0.0, True),
    "alpha": (0.0, True),
    "beta_fast": (0.0, True),
    "beta_slow": (0.0, True),
    "mscale": (0.0, False),
    "mscale_all_dim": (0.0, False),
    "attention_factor": (0.0, True),
    "low_freq_factor": (0.0, True),
    "high_freq_factor": (0.0, True),
    "short_mscale": (0.0, True),
    "long_mscale": (0.0, True),
}
_INT_KEYS = ("original_max_position_embeddings", "max_position_embeddings")
# Qwen2-VL / Qwen2.5-VL checkpoints store {"type": "mrope", "mrope_section": [...]}; transformers'
# configs of those models turn that type into "default" (M-RoPE changes positions, not inv_freq).
# Phi-3's first long-context checkpoints name LongRoPE "su", which transformers reads as such.
# HunyuanOCR's (HunYuan-VL) "xdrope" is "dynamic" with sections of positions per axis.
_TYPE_ALIASES = {"mrope": "default", "su": "longrope", "xdrope": "dynamic"}


def _is_number(value) -> bool:
    """A finite real number: Python's or numpy's (``numbers.Real``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and is_finite(value)


def _number(
    params: Mapping,
    key: str,
    kind: str,
    *,
    minimum: float = 0.0,
    strict: bool = True,
    maximum: float = math.inf,
):
    """``params[key]`` as a finite number above ``minimum`` (``>=`` when not ``strict``) and
    at most ``maximum``."""
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"scaling[{key!r}] for type {kind!r} must be a number, got {value!r} of type "
            f"{type(value).__name__}"
        )
    low_ok = is_finite(value) and (value > minimum or (not strict and value == minimum))
    if not (low_ok and value <= maximum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        bound += f" and <= {maximum}" if maximum < math.inf else ""
        raise ValueError(
            f"scaling[{key!r}] for type {kind!r} must be a finite number {bound}, got {value!r}"
        )
    return float(value)


def _flag(params: Mapping, key: str, kind: str, default: bool) -> bool:
    """``params[key]`` (``default`` when absent), which must be a bool."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise TypeError(f"scaling[{key!r}] for type {kind!r} must be a bool, got {value!r}")
    return value


def _positive_int(params: Mapping, key: str, kind: str) -> int:
    # never None: _scaling_type drops the keys a config leaves null
    return _optional_positive_int(params[key], f"scaling[{key!r}] for type {kind!r}")


def _optional_positive_int(value, name: str) -> int | None:
    """``value`` as an int >= 1, or None: TypeError for another kind of value (a float, a
    bool), ValueError for an int below 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a positive int, got {value!r} of type {type(value).__name__}"
        )
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_rope_dim(rope_dim) -> None:
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, numbers.Integral):
        raise TypeError(f"rope_dim must be an int, got {type(rope_dim).__name__}")
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even int, got {rope_dim}")


def _check_theta(theta) -> None:
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real):
        raise TypeError(
            f"theta must be a real number, got {theta!r} of type {type(theta).__name__}"
        )
    if not _is_number(theta):  # inf, NaN
        raise ValueError(
            f"theta must be a finite real number, got {theta!r} of type {type(theta).__name__}"
        )
    # theta ** (-2d / R) decreases with d only for theta > 1 (theta = 1: every slot turns at one
    # frequency), and YaRN divides by log(theta).
    if theta <= 1:
        raise ValueError(f"theta must be > 1, got {theta!r}")


def _check_shared_keys(params: dict, rope_dim: int, kind: str, head_dim: int | None) -> None:
    """Check and remove from ``params`` the keys of transformers 5 ``rope_parameters`` that any
    type may carry and that leave ``inv_freq`` as it is.

    ``partial_rotary_factor`` is the fraction of the head that rotates: the caller's
    ``rope_dim`` must already be ``int(head_dim * partial_rotary_factor)``, which is checked
    where ``head_dim`` is given (else only the factor's range). ``mrope_section`` (checked to
    sum to ``rope_dim // 2``, which also catches a ``rope_dim`` that forgot the partial factor)
    and ``mrope_interleaved`` are the ``sections`` and ``interleaved`` of ``mrope_angles``.
    """
    fraction = None
    if "partial_rotary_factor" in params:
        fraction = _number(params, "partial_rotary_factor", kind, maximum=1.0)
        if kind != "proportional":  # whose frequencies it sets
            del params["partial_rotary_factor"]
    if head_dim is not None:
        # proportional takes the whole head and zeroes the slots past the fraction itself;
        # without the key (transformers 4 kept it on the config) rope_dim may be any part
        if kind == "proportional":
            expected, rule = head_dim, "the whole head for type 'proportional'"
        elif fraction is not None:
            expected = int(head_dim * fraction)
            rule = f"int(head_dim * partial_rotary_factor), with partial_rotary_factor={fraction}"
        else:
            expected, rule = min(rope_dim, head_dim), "a part of the head"
        if rope_dim != expected:
            raise ValueError(
                f"rope_dim must be {'at most ' if fraction is None else ''}{expected} for "
                f"head_dim={head_dim} ({rule}), got {rope_dim}"
            )
    # The context a checkpoint was trained to (Ministral 3 keeps it here); only longrope,
    # which lists it, reads it.
    if kind != "longrope" and "max_position_embeddings" in params:
        _positive_int(params, "max_position_embeddings", kind)  # unread, but a claim
        del params["max_position_embeddings"]
    if "llama_4_scaling_beta" in params:
        raise ValueError(
            "scaling['llama_4_scaling_beta'] is a per-position scale of the queries (Ministral "
            "3, Mistral 4), not of the frequencies: remove the key here and multiply the "
            "queries by fused_rope.llama4_attn_scale(positions, beta, "
            "scaling['original_max_position_embeddings'])"
        )
    # Qwen3-Omni's configs also carry "interleaved", which transformers lets through unread.
    for key in ("mrope_interleaved", "interleaved"):
        _flag(params, key, kind, False)
        params.pop(key, None)
    # xdrope_section: HunYuan-VL's older name, which transformers refuses when the two differ.
    sections = {
        key: tuple(_check_sections(params.pop(key), rope_dim // 2, f"scaling[{key!r}]"))
        for key in ("mrope_section", "xdrope_section")
        if key in params
    }
    if len(set(sections.values())) > 1:
        raise ValueError(f"scaling's mrope_section and xdrope_section differ, got {sections}")


def _scaling_type(scaling: Mapping | None) -> tuple[str, str, dict]:
    """``(key, kind, params)``: the key that names the type (``"rope_type"`` or ``"type"``),
    the schedule it resolves to, and the other keys (None counts as absent)."""
    if scaling is None:
        scaling = {}  # still checked against head_dim
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be None or a mapping, got {type(scaling).__name__}")
    nested = [k for k, v in scaling.items() if isinstance(v, Mapping)]
    if nested:
        raise ValueError(
            f"scaling holds mappings under {nested}: rope_parameters per layer type "
            "(transformers 5's Gemma 3 and others); pass the one of the layers at hand, e.g. "
            f"scaling=rope_parameters[{nested[0]!r}]"
        )
    params = {k: v for k, v in scaling.items() if v is not None}
    # transformers takes "type" only where "rope_type" is absent (standardize_rope_params:
    # setdefault("rope_type", get("type"))), so rope_type wins and a differing type is ignored.
    key = "rope_type" if "rope_type" in params else "type"
    kind = params.get(key, "default")
    params.pop("type", None)
    params.pop("rope_type", None)
    if isinstance(kind, str):
        kind = _TYPE_ALIASES.get(kind, kind)
    if not isinstance(kind, str) or kind not in _SCALING_KEYS:
        raise ValueError(
            f"scaling[{key!r}] must be one of {SCALING_TYPES + tuple(_TYPE_ALIASES)}, got {kind!r}"
        )
    if kind == "dynamic" and "alpha" in params:
        # HunYuan's NTK-alpha: transformers turns "dynamic" with a non-zero alpha into its
        # static "ntk_alpha" (and reads a zero alpha as none).
        if params["alpha"] == 0 and not isinstance(params["alpha"], bool):
            del params["alpha"]
        else:
            kind = "ntk_alpha"
    return key, kind, params


def scaling_type(scaling: Mapping | None) -> str:
    """The schedule ``rope_frequencies`` applies for ``scaling``, one of ``SCALING_TYPES``:
    its ``"rope_type"`` (or ``"type"``) with the aliases resolved (``"mrope"`` is
    ``"default"``, ``"su"`` ``"longrope"``, ``"xdrope"`` ``"dynamic"``) and ``"dynamic"``
    with a non-zero ``alpha`` as ``"ntk_alpha"``. Only ``"dynamic"`` and ``"longrope"`` depend
    on ``seq_len``."""
    return _scaling_type(scaling)[1]


def _parse_scaling(
    scaling: Mapping | None, theta: float, rope_dim: int, head_dim: int | None = None
) -> tuple[str, dict]:
    """The scaling type and its parameters; keys set to None count as absent (but see yarn's
    ``truncate``)."""
    key, kind, params = _scaling_type(scaling)
    scaling = scaling or {}
    if kind == "yarn" and "truncate" in scaling and scaling["truncate"] is None:
        # None counts as absent elsewhere, as in transformers, but its yarn reads
        # get("truncate", True) and tests `if truncate:`, so there None turns truncation off.
        params["truncate"] = False
    # transformers 5 keeps rope_theta inside rope_parameters; accept it when it agrees.
    if "rope_theta" in params and params.pop("rope_theta") != theta:
        raise ValueError(
            f"scaling['rope_theta']={scaling['rope_theta']!r} disagrees with theta={theta!r}"
        )
    _check_shared_keys(params, rope_dim, kind, head_dim)
    required, optional = _SCALING_KEYS[kind]
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(
            f"scaling of type {kind!r} is missing the key(s) {missing}, got {dict(scaling)}"
        )
    unknown = sorted(set(params) - set(required) - set(optional))
    if unknown:
        raise ValueError(
            f"scaling of type {kind!r} got unknown key(s) {unknown}; "
            f"it takes {list(required)} and optionally {list(optional)}"
        )
    _check_present_keys(params, kind)
    return kind, params


def _check_present_keys(params: dict, kind: str) -> None:
    """Every numeric key of ``params`` in its range (``_NUMBER_KEYS``, ``_INT_KEYS``) and
    ``truncate`` a bool, whether or not the schedule reads it."""
    for key in params:
        if key in _NUMBER_KEYS:
            minimum, strict = _NUMBER_KEYS[key]
            _number(params, key, kind, minimum=minimum, strict=strict)
        elif key in _INT_KEYS:
            _positive_int(params, key, kind)
        elif key == "truncate":
            _flag(params, key, kind, True)


def _ladder_exponent(rope_dim: int) -> torch.Tensor:
    """``2d / R`` for ``d < R/2`` in float64."""
    return torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim


def _unscaled(inv: torch.Tensor, p: dict, rope_dim: int, theta: float, seq_len: int | None):
    return inv, 1.0


def _linear(inv: torch.Tensor, p: dict, rope_dim: int, theta: float, seq_len: int | None):
    return inv / _number(p, "factor", "linear", minimum=1.0, strict=False), 1.0


def _ntk_base(theta: float, stretch: float, rope_dim: int, kind: str) -> float:
    """NTK-aware base ``theta * stretch ** (R / (R - 2))``."""
    if rope_dim <= 2:
        raise ValueError(
            f"{kind} NTK scaling needs rope_dim > 2 (base exponent R/(R-2)), got {rope_dim}"
        )
    return theta * stretch ** (rope_dim / (rope_dim - 2))


def _dynamic(inv: torch.Tensor, p: dict, rope_dim: int, theta: float, seq_len: int | None):
    factor = _number(p, "factor", "dynamic", minimum=1.0, strict=False)
    original = _positive_int(p, "original_max_position_embeddings", "dynamic")
    length = original if seq_len is None else max(seq_len, original)
    base = _ntk_base(theta, factor * length / original - (factor - 1), rope_dim, "dynamic")
    return base ** -_ladder_exponent(rope_dim), 1.0


def _ntk_alpha(inv: torch.Tensor, p: dict, rope_dim: int, theta: float, seq_len: int | None):
    alpha = _number(p, "alpha", "ntk_alpha")
    base = _ntk_base(theta, alpha, rope_dim, "ntk_alpha")
    if not base > 1:  # the ladder falls with d only above 1 (as theta's)
        raise ValueError(
            f"scaling['alpha']={alpha!r} for type 'ntk_alpha' takes theta={theta!r} to a base "
            f"theta * alpha ** (R / (R - 2)) = {base!r}, which must be > 1"
        )
    return base ** -_ladder_exponent(rope_dim), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv: torch.Tensor, p: dict, rope_dim: int, theta: float, seq_len: int | None):
    factor = _number(p, "factor", "yarn", minimum=1.0, strict=False)
    original = _positive_int(p, "original_max_position_embeddings", "yarn")
    beta_fast = _number(p, "beta_fast", "yarn") if "beta_fast" in p else 32.0
    beta_slow = _number(p, "beta_slow", "yarn") if "beta_slow" in p else 1.0
    if beta_fast < beta_slow:
        raise ValueError(
            f"scaling['beta_fast']={beta_fast} must be >= scaling['beta_slow']={beta_slow}"
        )
    truncate = _flag(p, "truncate", "yarn", True)
    if "attention_factor" in p:
        attention_factor = _number(p, "attention_factor", "yarn")
    else:
        mscale = _number(p, "mscale", "yarn", strict=False) if "mscale" in p else 0.0
        mscale_all = (
            _number(p, "mscale_all_dim", "yarn", strict=False) if "mscale_all_dim" in p else 0.0
        )
        # transformers uses the DeepSeek ratio only when both are set and non-zero.
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)

    def slot_of(rotations: float) -> float:
        """The (fractional) slot whose wavelength fits ``rotations`` times into ``original``."""
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = slot_of(beta_fast), slot_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv * (1 - ramp) + inv / factor * ramp, attention_factor


def _llama3(inv: torch.Tensor, p: dict, rope_dim: int, theta: float, seq_len: int | None):
    factor = _number(p, "factor", "llama3", minimum=1.0, strict=False)
    low_ff = _number(p, "low_freq_factor", "llama3")
    high_ff = _number(p, "high_freq_factor", "llama3")
    if high_ff < low_ff:
        raise ValueError(
            f"scaling['high_freq_factor']={high_ff} must be >= scaling['low_freq_factor']={low_ff}"
        )
    original = _positive_int(p, "original_max_position_embeddings", "llama3")
    wavelen = 2 * math.pi / inv
    if high_ff == low_ff:  # no band to blend in (Llama 4 Scout: both 1): a step
        medium = inv / factor
    else:
        smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
        medium = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > original / low_ff, inv / factor, medium)
    return torch.where(wavelen < original / high_ff, inv, out), 1.0


def _proportional(inv: torch.Tensor, p: dict, rope_dim: int, theta: float, seq_len: int | None):
    # rope_dim is the whole head: the first int(partial_rotary_factor * R // 2) slots rotate at
    # theta ** (-2d / R), the rest not at all (frequency 0), as transformers' proportional.
    rotated = int(p.get("partial_rotary_factor", 1.0) * rope_dim // 2)
    factor = _number(p, "factor", "proportional") if "factor" in p else 1.0
    return torch.where(torch.arange(rope_dim // 2) < rotated, inv, 0.0) / factor, 1.0


def _longrope(inv: torch.Tensor, p: dict, rope_dim: int, theta: float, seq_len: int | None):
    original = _positive_int(p, "original_max_position_embeddings", "longrope")
    if original < 2:
        raise ValueError(
            f"scaling['original_max_position_embeddings'] for type 'longrope' must be >= 2 "
            f"(its log divides the attention factor), got {original}"
        )
    ext = {}
    for key in ("short_factor", "long_factor"):
        values = p[key]
        if (
            isinstance(values, (str, bytes))
            or not isinstance(values, Sequence)
            or len(values) != rope_dim // 2
            or not all(_is_number(v) and v > 0 for v in values)
        ):
            raise ValueError(
                f"scaling[{key!r}] for type 'longrope' must be a list of rope_dim // 2 = "
                f"{rope_dim // 2} positive numbers, got {values!r}"
            )
        ext[key] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    long = seq_len is not None and seq_len > original
    mscales = [key for key in ("short_mscale", "long_mscale") if key in p]
    if len(mscales) == 1:
        raise ValueError(
            f"scaling of type 'longrope' with {mscales[0]!r} needs the other of 'short_mscale' "
            "and 'long_mscale' too (Phi-3.5-MoE's attention factors, short and long context)"
        )
    # Phi-3.5-MoE: they are the attention factor (transformers' Phimoe multiplies cos and sin
    # by the one its length picks). Its frequencies switch to long_factor past L0 here, as in
    # Microsoft's code; transformers 5.24's Phimoe keeps short_factor at every length.
    if mscales:
        short, long_ = (_number(p, key, "longrope") for key in ("short_mscale", "long_mscale"))
        attention_factor = long_ if long else short
    elif "attention_factor" in p:
        attention_factor = _number(p, "attention_factor", "longrope")
    else:
        if "factor" in p:
            factor = _number(p, "factor", "longrope")
        elif "max_position_embeddings" in p:
            factor = _positive_int(p, "max_position_embeddings", "longrope") / original
        else:
            raise ValueError(
                "scaling of type 'longrope' needs 'attention_factor', 'factor' or "
                "'max_position_embeddings' (Phi-3: factor = max / original context)"
            )
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return inv / ext["long_factor" if long else "short_factor"], attention_factor


_SCHEDULES = {
    "default": _unscaled,
    "linear": _linear,
    "dynamic": _dynamic,
    "ntk_alpha": _ntk_alpha,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
    "proportional": _proportional,
}


def rope_frequencies(
    rope_dim: int,
    theta: float = 10000.0,
    scaling: Mapping | None = None,
    *,
    seq_len: int | None = None,
    head_dim: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of RoPE, with the context-extension schedules checkpoints use.

    Unscaled: ``inv_freq[d] = theta ** (-2d / R)`` (RoFormer, Su et al. 2021). ``scaling``
    is None or a mapping with ``"rope_type"`` (or the older ``"type"``, ignored when both are
    there, as transformers does) and the keys below, named as in Hugging Face configs
    (``rope_scaling`` / ``rope_parameters``). Keys set to None count as absent, except yarn's
    ``truncate``. Any type also accepts the keys of transformers 5 ``rope_parameters`` that
    leave ``inv_freq`` as it is: ``rope_theta`` (when it equals ``theta``),
    ``partial_rotary_factor`` (in ``(0, 1]``; ``rope_dim`` must already be
    ``int(head_dim * partial_rotary_factor)``), and M-RoPE's ``mrope_section`` (summing to
    ``R/2``) and ``mrope_interleaved`` (or Qwen3-Omni's ``interleaved``), which are for
    ``mrope_angles``; type ``"mrope"``
    (Qwen2-VL's checkpoints) means ``"default"``. ``L0`` is
    ``original_max_position_embeddings``, ``f`` is ``factor``:

    * ``"default"``: unscaled.
    * ``"linear"`` (position interpolation, Chen et al. 2023; kaiokendev):
      ``inv_freq / f``. Keys: ``factor``.
    * ``"dynamic"`` (dynamic NTK, bloc97/emozilla; transformers' ``dynamic``): theta becomes
      ``theta * (f L / L0 - (f - 1)) ** (R / (R - 2))`` with ``L = max(seq_len, L0)``
      (``L0`` when ``seq_len`` is None: unscaled). Keys: ``factor``, ``L0`` (transformers
      reads it from ``config.max_position_embeddings``); with a non-zero ``alpha`` it is
      ``"ntk_alpha"``. Recompute as ``seq_len`` changes:
      this function is stateless, a function of ``seq_len`` alone, where transformers' models
      keep the frequencies of the longest length seen until the length drops below ``L0``
      (a 6000-token call after a 10000-token one gets 6000's frequencies here, 10000's
      there).
    * ``"ntk_alpha"`` (HunYuan; transformers' name for ``"dynamic"`` with a non-zero
      ``alpha``, which is how the checkpoints store it): theta becomes
      ``theta * alpha ** (R / (R - 2))`` at every length (``alpha > 0``, the base > 1).
      Keys: ``alpha``;
      ``factor``, ``L0``, ``beta_fast``, ``beta_slow``, ``mscale`` and ``mscale_all_dim``,
      which HunYuan's configs carry, are accepted and, as in transformers, not read. Type
      ``"xdrope"`` (HunyuanOCR) means ``"dynamic"``, and its ``xdrope_section`` is checked
      as ``mrope_section``. Only the frequencies: XD-RoPE's multi-axis positions give the
      two halves of a rotated pair different axes (transformers doubles each section, so
      channels ``d`` and ``d + R/2`` take their angles from different axes), which is not
      a rotation: ``xdrope_angles`` gives both halves' angles and the two rotations that
      make it; text positions (every axis equal) are plain RoPE.
    * ``"yarn"`` (Peng et al. 2023; DeepSeek-V2/V3, Qwen2.5/Qwen3 long context, gpt-oss):
      slot ``d`` blends
      ``inv_freq`` (extrapolation) into ``inv_freq / f`` (interpolation) by a ramp that is 0
      below the slot turning ``beta_fast`` (32) times over ``L0`` and 1 above the one turning
      ``beta_slow`` (1) times (ramp ends floored/ceiled when ``truncate``: default True when
      the key is absent, but an explicit None is false, as in transformers).
      ``attention_factor`` defaults to ``0.1 ln f + 1``, or with ``mscale`` and
      ``mscale_all_dim`` both set and non-zero to ``(0.1 mscale ln f + 1) /
      (0.1 mscale_all_dim ln f + 1)`` (transformers' rule). Keys: ``factor``, ``L0``;
      optional ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
      ``attention_factor``, ``truncate``. The DeepSeek family's attention (DeepSeek-V2/V3,
      Kimi-K2, MiniCPM3, ...) also multiplies its softmax scale by ``(0.1 mscale_all_dim ln f
      + 1) ** 2`` when ``mscale_all_dim`` is set: the model's rule, not the frequencies'
      (1.8739 for DeepSeek-V3's factor 40): fold it into ``softmax_scale``.
    * ``"llama3"`` (Llama 3.1): wavelengths ``2 pi / inv_freq`` shorter than
      ``L0 / high_freq_factor`` keep ``inv_freq``, longer than ``L0 / low_freq_factor`` get
      ``inv_freq / f``, and in between ``(1 - s) inv_freq / f + s inv_freq`` with
      ``s = (L0 / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
      Keys: ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``L0``.
    * ``"longrope"`` (Ding et al. 2024; Phi-3/3.5): ``inv_freq / ext`` with ``ext =
      long_factor`` when ``seq_len > L0`` else ``short_factor`` (``R/2`` numbers each);
      ``attention_factor`` defaults to ``sqrt(1 + ln f / ln L0)`` (1 when ``f <= 1``), ``f``
      being ``factor`` or ``max_position_embeddings / L0``; with ``short_mscale`` and
      ``long_mscale`` (Phi-3.5-MoE) it is the one of the two that ``seq_len`` picks. Type
      ``"su"`` (Phi-3's first checkpoints) means ``"longrope"``. Keys: ``short_factor``,
      ``long_factor``, ``L0``, and one of ``factor``, ``max_position_embeddings``,
      ``attention_factor`` and ``short_mscale`` with ``long_mscale``.
    * ``"proportional"`` (Gemma 4's full-attention layers): ``R`` is the whole head dim; the
      first ``int(partial_rotary_factor * R // 2)`` slots keep ``theta ** (-2d / R)``, the
      others get frequency 0 (they do not rotate); all divided by ``f``. Keys: optional
      ``factor`` (default 1) and ``partial_rotary_factor`` (default 1).

    ``max_position_embeddings`` is accepted by every type (only longrope reads it), and
    ``llama_4_scaling_beta`` (Ministral 3, Mistral 4: a per-position scale of the queries, not
    a frequency schedule) is refused, so that it is not dropped unseen: remove it and apply
    ``llama4_attn_scale`` to the queries.

    Args:
        rope_dim: ``R``, the rotated channels per head (positive, even).
        theta: the base, a real number > 1 (Python's or numpy's).
        scaling: see above; ``None`` or type ``"default"`` for plain RoPE.
        seq_len: the current sequence length (max position + 1), an int (Python's, numpy's
            or a 0-d integer tensor); only
            ``dynamic`` and ``longrope`` depend on it, the other types ignore it.
        head_dim: the model's head size, optional: given, ``rope_dim`` is checked to be
            ``int(head_dim * partial_rotary_factor)`` where ``scaling`` holds that key (the
            whole head for ``proportional``; at most ``head_dim`` otherwise), which catches a
            ``rope_dim`` that forgot a partial rotation (GLM-4.5's 0.5: 64 frequencies on the
            128 ladder instead of 32 on the 64 one, all valid numbers).
        device: where ``inv_freq`` goes (default CPU).

    Returns:
        ``(inv_freq, attention_factor)``: ``inv_freq`` fp32 ``[R/2]``; ``attention_factor``
        a float that transformers multiplies into cos and sin, i.e. into the rotated channels
        of q and k: pass it as ``attention_factor=`` to ``apply_rope``, ``apply_rope_qk``,
        ``rope_attention`` or the references (an output scale such as ``q_scale`` would also
        scale the pass-through channels of a partial rotation).
    """
    _check_rope_dim(rope_dim)
    _check_theta(theta)
    if (
        isinstance(seq_len, torch.Tensor)
        and seq_len.dim() == 0
        and not (seq_len.is_floating_point() or seq_len.is_complex() or seq_len.dtype == torch.bool)
    ):
        seq_len = int(seq_len)  # max(position_ids) + 1
    seq_len = _optional_positive_int(seq_len, "seq_len")
    head_dim = _optional_positive_int(head_dim, "head_dim")
    device = as_device(device)
    kind, params = _parse_scaling(scaling, theta, rope_dim, head_dim)
    inv = float(theta) ** -_ladder_exponent(rope_dim)
    try:
        inv, attention_factor = _SCHEDULES[kind](inv, params, rope_dim, float(theta), seq_len)
    except OverflowError as error:  # Python's float arithmetic on huge keys
        raise ValueError(
            f"scaling {params} of type {kind!r} (theta={theta!r}, seq_len={seq_len}) overflows "
            f"a float64 ({error})"
        ) from None
    inv32 = inv.to(torch.float32)
    _check_schedule_result(inv, inv32, float(attention_factor), kind, params, theta)
    return inv32.to(device), float(attention_factor)


def _check_schedule_result(inv, inv32, attention_factor: float, kind: str, params, theta) -> None:
    """The fp64 frequencies ``inv`` and their fp32 ``inv32`` (``[R/2]``, on the CPU) finite,
    none rounded to 0 from a positive value, and ``attention_factor`` finite and > 0: extreme
    keys (a factor of 1e308, 1e-300) give infinite or vanished frequencies, whose angles are
    NaN or 0 at every position. Skipped under a tracer, whose tensors hold no values."""
    if not runs_eagerly(inv):
        return
    bad = ~inv32.isfinite() | ((inv32 == 0) & (inv > 0))
    if bool(bad.any()) or not (math.isfinite(attention_factor) and attention_factor > 0):
        slot = int(bad.nonzero()[0]) if bool(bad.any()) else None
        what = (
            f"frequency {float(inv[slot])!r} at slot {slot}, which fp32 holds as "
            f"{float(inv32[slot])!r}"
            if slot is not None
            else f"attention factor {attention_factor!r}"
        )
        raise ValueError(
            f"scaling {params} of type {kind!r} with theta={theta!r} gives the {what}: the "
            f"frequencies must be finite fp32 numbers (0 only where the schedule sets it) and "
            f"the attention factor finite and > 0"
        )


def default_inv_freq(rope_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """The unscaled ``inv_freq`` ``[rope_dim // 2]`` fp32 on ``device``, made once per
    (rope_dim, theta, device) and shared: kernels that default to it then do no host-to-device
    copy per call, which also keeps them capturable in CUDA graphs. Treat it as read-only.
    It is never an inference tensor, even when first asked for under ``torch.inference_mode()``.
    A shared tensor that was changed in place or made to require grad is refused at the next
    call (``RuntimeError``; the cache is cleared, so the calls after it get fresh tensors): the
    change would otherwise reach every call that defaults to it, silently.
    Under a tracer it is computed in the graph instead (``runs_eagerly``): Dynamo does not
    trace caches, and under a dispatch mode (FakeTensorMode, make_fx's) the cache would keep
    that mode's fake or proxy tensor for every later call."""
    if not runs_eagerly():
        return rope_frequencies(rope_dim, theta, device=device)[0]
    # Before the cache: 64.0 or True would find the entry of 64 or 1, and a bool or a string
    # must not pass float() as a number
    _check_rope_dim(rope_dim)
    _check_theta(theta)
    device = as_device(device)
    if device.type == "cuda" and device.index is None:
        # "cuda" is the current GPU: keyed by its index, not by the GPU current at the first call
        device = torch.device("cuda", torch.cuda.current_device())
    inv_freq = _cached_inv_freq(int(rope_dim), float(theta), device)
    if inv_freq._version or inv_freq.requires_grad:
        _cached_inv_freq.cache_clear()
        change = "made to require grad" if inv_freq.requires_grad else "changed in place"
        raise RuntimeError(
            f"the shared default inv_freq (rope_dim={rope_dim}, theta={theta}, {device}) was "
            f"{change} after an earlier call returned it; it is read-only: clone it to learn or "
            f"change frequencies (or pass inv_freq=rope_frequencies(...)[0]). The calls between "
            f"that change and this one used the changed tensor; later calls get a fresh one"
        )
    return inv_freq


@functools.lru_cache(maxsize=64)
def _cached_inv_freq(rope_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # The first call for a key may run under torch.inference_mode(); a tensor made there is an
    # inference tensor, which autograd refuses to save for backward in every later call.
    with torch.inference_mode(False):
        return rope_frequencies(rope_dim, theta, device=device)[0]


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotation angles ``angles[..., n, d] = positions[..., n] * inv_freq[d]`` in fp32.

    An elementwise product, exact up to the one fp32 rounding of each angle (a TF32
    matmul would not be).

    Args:
        positions: ``[N]`` or ``[B, N]``, integer or floating point (cast to fp32, exact
            for integers below 2**24).
        inv_freq: ``[R/2]`` floating point, on ``positions``' device.

    Returns:
        fp32 ``[N, R/2]`` or ``[B, N, R/2]``.
    """
    check_position_tensor(positions, "positions", ndim=(1, 2))
    check_float_tensor(inv_freq, "inv_freq", ndim=1, dtypes=FREQ_DTYPES)
    check_finite_on_cpu(inv_freq, "inv_freq")
    check_same_device(positions=positions, inv_freq=inv_freq)
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    check_finite_on_cpu(angles, "positions * inv_freq in fp32")
    return angles


def _check_sections(sections, half: int, name: str = "sections") -> list[int]:
    if isinstance(sections, (str, bytes, torch.Tensor)) or not isinstance(sections, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {type(sections).__name__}")
    kinds = [
        type(s).__name__
        for s in sections
        if isinstance(s, bool) or not isinstance(s, numbers.Integral)
    ]
    if kinds:
        raise TypeError(f"{name} must be a list of ints, got elements of type {kinds[0]}")
    sections = [int(s) for s in sections]  # numpy's ints too
    if not sections or min(sections) < 0 or sum(sections) != half:
        raise ValueError(
            f"{name} must be non-negative ints summing to rope_dim // 2 = {half}, got {sections}"
        )
    return sections


def _slot_axes(sections: list[int], interleaved: bool) -> list[int]:
    """The position axis each frequency slot ``d < R/2`` takes its position from.

    Contiguous (Qwen2-VL M-RoPE): axis 0 owns the first ``sections[0]`` slots, axis 1 the
    next ``sections[1]``, and so on. Interleaved (Qwen3-VL / Qwen3.5, transformers'
    ``recomposition_frequencies``): with ``K = len(sections)``, slot ``d`` belongs to axis
    ``a = d % K`` when ``a >= 1`` and ``d < K * sections[a]``, else to axis 0.
    """
    if not interleaved:
        return [a for a, size in enumerate(sections) for _ in range(size)]
    k = len(sections)
    axes = [d % k if d % k and d < k * sections[d % k] else 0 for d in range(sum(sections))]
    counts = [axes.count(a) for a in range(k)]
    if counts != sections:
        hint = (
            "; drop the trailing zero sections (llama.cpp's IMROPE [11, 11, 10, 0] is "
            "[11, 11, 10] over the first three position axes)"
            if sections[-1] == 0
            else ""
        )
        raise ValueError(
            f"sections {sections} cannot be interleaved over {sum(sections)} slots: axis "
            f"a >= 1 takes slots a, a + K, ... below K * sections[a], which gives {counts}{hint}"
        )
    return axes


def mrope_angles(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    sections: Sequence[int],
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Multi-axis RoPE angles (M-RoPE, Qwen2-VL; interleaved MRoPE, Qwen3-VL).

    ``angles[..., n, d] = positions[axis(d), ..., n] * inv_freq[d]``: each frequency slot
    takes its position from one axis (``t, h, w`` for Qwen2-VL). Contiguous sections
    (default): the first ``sections[0]`` slots follow axis 0, the next ``sections[1]``
    axis 1, etc. ``interleaved=True``: slots cycle over the axes, ``d`` following axis
    ``d % K`` while ``d < K * sections[d % K]`` and axis 0 otherwise (``K = len(sections)``,
    the rule of transformers' Qwen3-VL/Qwen3.5; sections it cannot realise raise).

    Args:
        positions: ``[K, N]`` or ``[K, B, N]``, integer or floating point,
            ``K = len(sections)`` (e.g. 4 for contiguous ``[11, 11, 10, 0]``, the last
            axis unused).
        inv_freq: ``[R/2]`` floating point, on ``positions``' device.
        sections: ``K`` non-negative ints summing to ``R/2`` (Qwen2-VL ``[16, 24, 24]``,
            Qwen3-VL ``[24, 20, 20]``).

    Returns:
        fp32 ``[N, R/2]`` or ``[B, N, R/2]``; with all axes equal, ``rope_angles``' result.
    """
    check_position_tensor(positions, "positions", ndim=(2, 3))
    check_float_tensor(inv_freq, "inv_freq", ndim=1, dtypes=FREQ_DTYPES)
    check_finite_on_cpu(inv_freq, "inv_freq")
    check_same_device(positions=positions, inv_freq=inv_freq)
    check_bool(interleaved, "interleaved")
    sections = _check_sections(sections, inv_freq.shape[0])
    if positions.shape[0] != len(sections):
        raise ValueError(
            f"positions must have one axis per section ({len(sections)}) in dimension 0, "
            f"got shape {tuple(positions.shape)}"
        )
    axes = torch.tensor(
        _slot_axes(sections, interleaved), dtype=torch.long, device=positions.device
    )
    per_slot = positions.to(torch.float32)[axes].movedim(0, -1)  # [..., N, R/2]
    angles = per_slot * inv_freq.to(torch.float32)
    check_finite_on_cpu(angles, "positions * inv_freq in fp32")
    return angles


def xdrope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, sections: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """XD-RoPE angles (HunyuanOCR / HunYuan-VL, transformers' ``HunYuanVLRotaryEmbedding``):
    the angles of the first and of the second channel of each rotated pair, which differ.

    transformers gives axis ``a`` the ``2 * sections[a]`` consecutive channels after those of
    the axes before it, over all ``R`` rotated channels of the ``"half"`` layout, channel ``c``
    turning at ``inv_freq[c % (R/2)]``. So the pair ``(d, d + R/2)`` can take its two channels'
    angles ``a, b`` from two axes, and its map ``(x1 cos a - x2 sin a, x2 cos b + x1 sin b)`` is
    not a rotation (it is where every axis holds one position, the text tokens). Each of its
    two outputs is that of a rotation: rotate once by ``first`` and once by ``second`` and take
    the first ``R/2`` rotated channels from the one and the rest from the other::

        first, second = xdrope_angles(pos, inv_freq, [16, 16, 16, 16])  # R = 128
        x1 = apply_rope(x, first)
        x2 = apply_rope(x, second)
        x_rot = torch.cat([x1[..., :64], x2[..., 64:]], dim=-1)

    (with ``attention_factor`` and ``rope_dim`` as for plain RoPE; the pass-through channels are
    in both). The fused attention kernels rotate by one table, so XD-RoPE takes the rotation
    first, then attention without RoPE (``scaled_dot_product_attention``).

    Args:
        positions: ``[K, N]`` or ``[K, B, N]``, integer or floating point, one row per axis.
        inv_freq: ``[R/2]`` floating point, on ``positions``' device.
        sections: ``K`` non-negative ints summing to ``R/2`` (transformers' ``mrope_section``,
            the checkpoints' ``xdrope_section``: HunyuanOCR's ``[16, 16, 16, 16]``).

    Returns:
        ``(first, second)``, fp32 ``[N, R/2]`` or ``[B, N, R/2]`` each: ``mrope_angles`` of
        the contiguous sections that the channel ranges give each half.
    """
    check_float_tensor(inv_freq, "inv_freq", ndim=1, dtypes=FREQ_DTYPES)
    sections = _check_sections(sections, inv_freq.shape[0])
    half = sum(sections)
    starts = [2 * sum(sections[:a]) for a in range(len(sections))]
    # axis a's channels [start, start + 2 s) clipped to each half of [0, R)
    first = [
        max(0, min(s + 2 * n, half) - min(s, half)) for s, n in zip(starts, sections, strict=True)
    ]
    second = [2 * n - f for n, f in zip(sections, first, strict=True)]
    return (
        mrope_angles(positions, inv_freq, first),
        mrope_angles(positions, inv_freq, second),
    )


NDROPE_LAYOUTS = ("sections", "axial", "mixed")


def nd_rope_frequencies(
    rope_dim: int,
    n_axes: int,
    theta: float = 10000.0,
    *,
    layout: str = "sections",
    sections: Sequence[int] | None = None,
    interleaved: bool = False,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Per-axis frequencies ``[n_axes, 1, R/2]`` for ``nd_rope_angles`` (one group).

    ``"sections"`` and ``"mixed"`` start from the 1-D ladder ``w[d] = theta ** (-2d / R)``:

    * ``"sections"`` (M-RoPE's split of one ladder): each slot ``d`` belongs to one axis,
      ``freqs[p, 0, d] = w[d] if axis(d) == p else 0``, with ``axis`` as in
      ``mrope_angles(..., sections, interleaved=interleaved)``. ``sections`` defaults to
      an even split, earlier axes taking the remainder (``R/2 = 64``, 3 axes:
      ``[22, 21, 21]``).
    * ``"axial"`` (the vision towers of Qwen2-VL to Qwen3-VL, GLM-4V: transformers'
      ``VisionRotaryEmbedding`` of ``R / n_axes`` channels, one per axis, concatenated):
      axis ``p`` takes the ``R / (2 n_axes)`` slots of block ``p``, each axis its own ladder
      ``theta ** (-2j / (R / n_axes))``, ``j`` the slot within the block; ``R / 2`` a
      multiple of ``n_axes``. With ``layout="half"`` rotations it is those models' RoPE.
    * ``"mixed"`` (RoPE-Mixed, Heo et al. 2024, generalised to ``n_axes``): every slot
      mixes all axes, ``freqs[:, 0, d] = w[d] * u_d`` with ``u_d`` a random unit vector
      (from ``generator``); meant as the initialisation of learnable frequencies.

    Returns:
        fp32 ``[n_axes, 1, R/2]``.
    """
    _check_rope_dim(rope_dim)
    _check_theta(theta)
    check_bool(interleaved, "interleaved")
    if isinstance(n_axes, bool) or not isinstance(n_axes, numbers.Integral):
        raise TypeError(f"n_axes must be an int, got {type(n_axes).__name__}")
    if n_axes <= 0:
        raise ValueError(f"n_axes must be positive, got {n_axes}")
    if layout not in NDROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {NDROPE_LAYOUTS}, got {layout!r}")
    half = rope_dim // 2
    ladder = float(theta) ** -_ladder_exponent(rope_dim)
    if layout != "sections" and (sections is not None or interleaved):
        raise ValueError("sections and interleaved apply to layout='sections' only")
    if layout != "mixed" and generator is not None:
        raise ValueError(f"generator draws layout='mixed' only, got layout={layout!r}")
    if layout == "mixed":
        u = torch.randn(n_axes, half, dtype=torch.float64, generator=generator)
        freqs = ladder * u / u.norm(dim=0, keepdim=True)
    elif layout == "axial":
        if half % n_axes:
            raise ValueError(
                f"layout='axial' splits the rope_dim // 2 = {half} slots into n_axes = {n_axes} "
                "equal blocks: rope_dim // 2 must be a multiple of n_axes"
            )
        block = half // n_axes
        axis_ladder = float(theta) ** -(torch.arange(block, dtype=torch.float64) / block)
        slots = torch.arange(half)
        on_axis = slots // block == torch.arange(n_axes)[:, None]  # [n_axes, R/2]
        freqs = torch.where(on_axis, axis_ladder[slots % block], 0.0)
    else:
        if sections is None:
            if n_axes > half:
                raise ValueError(
                    f"n_axes = {n_axes} is more than the rope_dim // 2 = {half} slots: an even "
                    f"split leaves axes without a slot, whose positions would do nothing; "
                    f"pass sections (a zero names an axis left out on purpose)"
                )
            sections = [half // n_axes + (a < half % n_axes) for a in range(n_axes)]
        sections = _check_sections(sections, half)
        if len(sections) != n_axes:
            raise ValueError(f"sections must have n_axes = {n_axes} entries, got {sections}")
        axes = torch.tensor(_slot_axes(sections, interleaved))
        freqs = torch.where(axes == torch.arange(n_axes)[:, None], ladder, 0.0)
    return freqs[:, None].to(device=as_device(device), dtype=torch.float32)


def nd_rope_angles(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """N-dimensional RoPE angles with frequency groups (nd-rotary-encodings' form).

    ``angles[..., d] = sum_g sum_p positions[..., p] * freqs[p, g, d]``, accumulated in
    fp32 one elementwise product at a time (no matmul, so no TF32). A slot whose
    frequency is non-zero for a single ``(p, g)`` gets the exactly rounded product, as
    in ``rope_angles``. Differentiable in ``positions`` (floating) and ``freqs``.

    Args:
        positions: ``[..., P]`` (``[N, P]`` or ``[B, N, P]`` for the kernels), integer or
            floating point.
        freqs: ``[P, G, R/2]`` floating point, on ``positions``' device (``G`` groups,
            summed; e.g. from ``nd_rope_frequencies``).

    Returns:
        fp32 ``[..., R/2]``.
    """
    check_position_tensor(positions, "positions")
    check_float_tensor(freqs, "freqs", ndim=3, dtypes=FREQ_DTYPES)
    check_finite_on_cpu(freqs, "freqs")
    check_same_device(positions=positions, freqs=freqs)
    if 0 in freqs.shape[:2]:
        raise ValueError(
            f"freqs must have at least one axis and one group, got shape {tuple(freqs.shape)}"
        )
    if positions.dim() == 0 or positions.shape[-1] != freqs.shape[0]:
        raise ValueError(
            f"positions' last dimension must match freqs' first (P = {freqs.shape[0]}), "
            f"got positions {tuple(positions.shape)} and freqs {tuple(freqs.shape)}"
        )
    pos = positions.to(torch.float32)
    f = freqs.to(torch.float32)
    angles = None
    for p in range(f.shape[0]):
        for g in range(f.shape[1]):
            term = pos[..., p, None] * f[p, g]
            angles = term if angles is None else angles + term
    check_finite_on_cpu(angles, "the sum of positions * freqs in fp32")
    return angles
