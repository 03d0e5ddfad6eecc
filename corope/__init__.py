"""Co-RoPE-GQA: contextual-mileage rotary attention with fused Triton kernels.

``corope_attention`` runs the kernels (fp16/bf16/fp32, CUDA or the Triton interpreter);
``corope_attention_ref`` is the PyTorch ground truth they are tested against.
"""

from corope.attention import corope_attention
from corope.naive import corope_attention_ref

__all__ = ["corope_attention", "corope_attention_ref"]
