"""RoPE as a library: frequency schedules, PyTorch references and Triton kernels.

Public API:
    rope_frequencies, rope_angles, mrope_angles, xdrope_angles, nd_rope_frequencies,
    nd_rope_angles
    llama4_attn_scale                 (Llama 4 / Mistral's position-dependent query scale)
    apply_rope, apply_rope_qk        (Triton, autograd, torch.compile-able)
    rope_attention                    (RoPE fused into FlashAttention-2, Triton)
    apply_rope_ref, rope_attention_ref (the PyTorch references)
"""

from fused_rope.attention import rope_attention
from fused_rope.frequencies import (
    SCALING_TYPES,
    mrope_angles,
    nd_rope_angles,
    nd_rope_frequencies,
    rope_angles,
    rope_frequencies,
    scaling_type,
    xdrope_angles,
)
from fused_rope.naive import apply_rope_ref, rope_attention_ref
from fused_rope.query_scale import llama4_attn_scale
from fused_rope.rope import apply_rope, apply_rope_qk

__all__ = [
    "SCALING_TYPES",
    "apply_rope",
    "apply_rope_qk",
    "apply_rope_ref",
    "llama4_attn_scale",
    "mrope_angles",
    "nd_rope_angles",
    "nd_rope_frequencies",
    "rope_angles",
    "rope_attention",
    "rope_attention_ref",
    "rope_frequencies",
    "scaling_type",
    "xdrope_angles",
]
