"""A small decoder-only transformer (nanoGPT's shape, Llama's parts).

Pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))`` with RMSNorm and a SwiGLU
MLP; the attention module comes from ``lm.attention`` by config, and so does the absolute
position encoding added at the input (sinusoidal / learned variants only).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lm.attention import (
    attention_class,
    build_attention,
    check_sinusoidal_base,
    nope_layers,
    window_layers,
)
from lm.data.base import check_int

if TYPE_CHECKING:
    from lm.generation import KVCache


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (B, N, hidden) each
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(
        self, cfg: Any, attn_cfg: Any, nope: bool = False, window: int | None = None
    ) -> None:
        super().__init__()
        hidden = cfg.mlp_hidden or 32 * math.ceil(8 * cfg.d_model / 3 / 32)
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = build_attention(
            attn_cfg, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.get("head_dim"), nope, window
        )
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        # x (B, N, C); with a cache, the keys and values go into its slot ``layer``
        x = x + self.drop(self.attn(self.norm1(x), cache, layer))
        return x + self.drop(self.mlp(self.norm2(x)))


def sinusoidal_table(max_len: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """``(max_len, d_model)``: sin in the even channels, cos in the odd ones (Vaswani et al.).
    ``base`` (``attention.base``) > 1: at 1 every channel pair turns at one frequency."""
    check_sinusoidal_base(base)
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return table.float()


class GPT(nn.Module):
    """Token ids ``(B, N)`` -> logits ``(B, N, vocab_size)``.

    Args:
        cfg: the ``model`` config (``lm.config.ModelConfig``).
        attn_cfg: the ``attention`` config; its name picks the module in ``lm.attention``.
        vocab_size: from the dataset.
        max_len: the longest sequence the model will see (sizes the absolute position tables).
    """

    def __init__(self, cfg: Any, attn_cfg: Any, vocab_size: int, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
        input_pe = attention_class(attn_cfg).input_pe
        self.pos_emb = nn.Embedding(max_len, cfg.d_model) if input_pe == "learned" else None
        if input_pe == "sinusoidal":
            table = sinusoidal_table(max_len, cfg.d_model, attn_cfg.base)
            self.register_buffer("pos_table", table, persistent=False)
        else:
            self.pos_table = None
        self.drop = nn.Dropout(cfg.dropout)
        # Recompute each block's activations in the backward instead of keeping them
        # (train.activation_checkpointing): the same gradients, one more forward a step
        self.activation_checkpointing = False
        nope = nope_layers(attn_cfg, cfg.n_layer)  # layers without rotation (Llama 4's)
        windows = window_layers(attn_cfg, cfg.n_layer)  # sliding-window layers (Gemma's local)
        self.blocks = nn.ModuleList(
            Block(cfg, attn_cfg, nope=i in nope, window=windows.get(i)) for i in range(cfg.n_layer)
        )
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.init_std)

    def forward(
        self, idx: torch.Tensor, cache: KVCache | None = None, logits_to_keep: int = 0
    ) -> torch.Tensor:
        """``idx (B, N)`` -> logits ``(B, N, V)``. With a ``cache`` (``lm.generation.KVCache``)
        the tokens continue the ``cache.length`` tokens it holds: they take the positions
        after them and attend to them too; their keys and values are appended to it.
        ``logits_to_keep = n > 0`` returns the logits of the last ``n`` positions only,
        ``(B, min(n, N), V)`` (transformers' name): a prefill that samples from its last row
        need not hold ``(B, N, V)``, the largest tensor of a long prompt's forward."""
        check_int("logits_to_keep", logits_to_keep, 0)
        N = idx.shape[1]
        start = 0 if cache is None else cache.length
        if start + N > self.max_len:
            raise ValueError(
                f"sequence length {start + N} exceeds the model's max_len {self.max_len}"
            )
        x = self.tok_emb(idx)  # (B, N, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb.weight[start : start + N]
        if self.pos_table is not None:
            x = x + self.pos_table[start : start + N].to(x.dtype)
        x = self.drop(x)
        recompute = self.activation_checkpointing and cache is None and torch.is_grad_enabled()
        for layer, block in enumerate(self.blocks):
            if recompute:  # non-reentrant: PyTorch's recommended mode, and what compile traces
                x = checkpoint(block, x, None, layer, use_reentrant=False)
            else:
                x = block(x, cache, layer)
        # The head before the commit: its logits, a prefill's largest tensor, may fail to fit,
        # and a cache advanced past them would take a retry's tokens at shifted positions
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(self.norm(x))  # (B, N, V)
        if cache is not None:
            cache.advance(N)
        return logits

    def matmul_params(self) -> int:
        """Parameters used in a matmul per token (the ``P`` of the FLOP count): all but the
        position table and, when untied, the token table (a lookup; the tied one is the head)."""
        n = sum(p.numel() for p in self.parameters())
        if not self.cfg.tie_embeddings:
            n -= self.tok_emb.weight.numel()
        if self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n
