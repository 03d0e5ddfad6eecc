"""lm/model.py: causality for every attention, the input position encodings, tying."""

import pytest
import torch
from omegaconf import OmegaConf

from lm.config import ATTENTION_SCHEMAS, ModelConfig
from lm.generation import KVCache
from lm.model import GPT, sinusoidal_table
from tests.helpers import DEVICE, assert_close


def make_model(attention: str, **model_overrides) -> GPT:
    model_cfg = OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        {"d_model": 32, "n_head": 4, "n_kv_head": 2, **model_overrides},
    )
    attn_cfg = OmegaConf.merge(
        OmegaConf.structured(ATTENTION_SCHEMAS[attention]),
        {"impl": "torch"} if attention in ("rope", "corope") else {},
    )
    return GPT(model_cfg, attn_cfg, vocab_size=11, max_len=40).to(DEVICE)


@pytest.mark.parametrize("attention", sorted(ATTENTION_SCHEMAS))
def test_logits_are_causal(attention):
    """Changing the tokens after position t leaves the logits up to t unchanged."""
    model = make_model(attention)
    x = torch.randint(0, 11, (2, 29), device=DEVICE)
    y = x.clone()
    y[:, 17:] = (y[:, 17:] + 1) % 11
    lx, ly = model(x), model(y)
    assert lx.shape == (2, 29, 11)
    torch.testing.assert_close(lx[:, :17], ly[:, :17], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lx[:, 17:], ly[:, 17:])


@pytest.mark.parametrize("attention", sorted(ATTENTION_SCHEMAS))
def test_only_absolute_encodings_tell_apart_a_constant_sequence(attention):
    """One token repeated: every value vector is the same, so whatever the attention weights,
    relative encodings (and none) give every row the same logits; the absolute encodings
    added at the input make the rows differ."""
    model = make_model(attention)
    logits = model(torch.full((1, 12), 3, device=DEVICE))[0]
    same = torch.allclose(logits[1:], logits[:1].expand(11, -1), atol=1e-5)
    assert same == (attention not in ("sinusoidal", "learned"))


@pytest.mark.parametrize("attention", sorted(ATTENTION_SCHEMAS))
def test_every_parameter_gets_a_gradient(attention):
    """One backward reaches every parameter, each block's norms included: a branch wired to
    the wrong norm (the MLP reading norm1) leaves the other without a gradient."""
    model = make_model(attention)
    model(torch.randint(0, 11, (2, 13), device=DEVICE)).logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


@torch.no_grad()
def test_block_is_prenorm_attention_then_swiglu():
    """A block computes ``h = x + attn(rmsnorm(x) g1)``, then ``h + W_down (silu(y W_gate)
    * (y W_up))`` with ``y = rmsnorm(h) g2`` and the gate's rows first in ``w_gate_up``: the
    MLP's layout and activation are pinned, as the attention's projections are
    (``test_projection_layout_is_pinned``), since a swapped one trains as well from scratch
    but computes something else from a saved checkpoint (a review: gate and up swapped, GELU
    for SiLU, passed every lm test)."""
    model = make_model("rope").double()
    block = model.blocks[0]
    for norm in (block.norm1, block.norm2):
        norm.weight.uniform_(0.5, 1.5)

    def rmsnorm(x, norm):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight

    x = torch.randn(2, 9, 32, dtype=torch.float64, device=DEVICE)
    h = x + block.attn(rmsnorm(x, block.norm1))
    y = rmsnorm(h, block.norm2)
    w_gate, w_up = block.mlp.w_gate_up.weight.chunk(2)
    gate = y @ w_gate.T
    expected = h + (gate * torch.sigmoid(gate) * (y @ w_up.T)) @ block.mlp.w_down.weight.T
    assert_close("block", block(x), expected, atol=1e-12, rtol=1e-12)


def test_input_position_encodings():
    assert make_model("rope").pos_emb is None and make_model("rope").pos_table is None
    assert make_model("learned").pos_emb.weight.shape == (40, 32)
    table = make_model("sinusoidal").pos_table
    torch.testing.assert_close(table, sinusoidal_table(40, 32).to(DEVICE))
    assert torch.allclose(table[0, 0::2], torch.zeros(16, device=DEVICE))  # sin(0)
    assert torch.allclose(table[0, 1::2], torch.ones(16, device=DEVICE))  # cos(0)


@pytest.mark.parametrize(
    "base, error", [(1.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                    (float("nan"), ValueError), ("1e4", TypeError), (True, TypeError)]
)  # fmt: skip
def test_sinusoidal_base_must_be_a_finite_number_above_one(base, error):
    """0 and negative bases made the table NaN (a NaN loss at step 1), 1 made it constant."""
    with pytest.raises(error, match="base must be a"):
        sinusoidal_table(40, 32, base)


def test_sinusoidal_table_follows_the_configured_base():
    """Channel 2i holds sin(p / base^(2i/C)) and channel 2i+1 its cos, with the attention
    config's base; the model adds row p to the token embedding at position p."""
    model = make_model("sinusoidal")
    cfg = OmegaConf.merge(OmegaConf.structured(ATTENTION_SCHEMAS["sinusoidal"]), {"base": 500.0})
    table = GPT(model.cfg, cfg, vocab_size=11, max_len=40).pos_table
    p = torch.arange(40, dtype=torch.float64)[:, None]
    angle = p / 500.0 ** (torch.arange(16, dtype=torch.float64) * 2 / 32)
    torch.testing.assert_close(table[:, 0::2].double(), angle.sin(), atol=1e-7, rtol=0)
    torch.testing.assert_close(table[:, 1::2].double(), angle.cos(), atol=1e-7, rtol=0)
    model.eval()
    idx = torch.randint(0, 11, (1, 7), device=DEVICE)
    with torch.no_grad():
        plain = model.tok_emb(idx)
        seen = []
        hook = model.drop.register_forward_hook(lambda m, args, out: seen.append(args[0]))
        model(idx)
        hook.remove()
    torch.testing.assert_close(seen[0], plain + model.pos_table[:7])


def test_projections_into_the_residual_stream_start_smaller():
    """GPT-2's init: the attention output and MLP down projections have standard deviation
    init_std / sqrt(2 n_layer), every other matrix and table init_std."""
    model = make_model("learned", d_model=128, n_layer=4, init_std=0.05)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        residual = name.endswith(("attn.wo.weight", "mlp.w_down.weight"))
        want = 0.05 / (8**0.5) if residual else 0.05
        assert abs(p.std().item() / want - 1) < 0.1, (name, p.std().item(), want)


def test_tied_embeddings_and_matmul_params():
    tied, untied = make_model("nope"), make_model("nope", tie_embeddings=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    assert sum(p.numel() for p in untied.parameters()) == n_tied + 11 * 32
    assert tied.matmul_params() == untied.matmul_params() == n_tied  # the head counts once
    learned = make_model("learned")
    assert learned.matmul_params() == n_tied


def test_too_long_input_names_max_len():
    with pytest.raises(ValueError, match="max_len 40"):
        make_model("nope")(torch.zeros(1, 41, dtype=torch.long, device=DEVICE))


def test_optimizer_decays_matrices_but_no_embedding_table():
    from lm.config import OptimConfig
    from lm.training import build_optimizer

    model = make_model("learned")
    opt, _ = build_optimizer(model, OmegaConf.structured(OptimConfig), total_steps=10)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert len(tables) == 2  # tokens and learned positions
    assert not decayed & {id(t) for t in tables}
    vectors = {id(p) for p in model.parameters() if p.dim() < 2}  # the norms' gains
    assert vectors and not decayed & vectors
    assert decayed  # the attention and MLP matrices still decay


@pytest.mark.parametrize("attention", ["rope", "corope"])
def test_head_dim_sets_the_heads_width_apart_from_d_model(attention):
    """model.head_dim 12 with d_model 32 and 4 heads: the attention is 48 channels wide (32
    does not divide into 4 heads of 12), the rotation covers the 12, the model stays causal;
    a checkpoint's config from before the key builds with d_model / n_head."""
    model = make_model(attention, head_dim=12)
    attn = model.blocks[0].attn
    assert (attn.head_dim, attn.rope_dim) == (12, 12)
    assert attn.wq.weight.shape == (48, 32) and attn.wo.weight.shape == (32, 48)
    x = torch.randint(0, 11, (2, 13), device=DEVICE)
    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 1) % 11
    torch.testing.assert_close(model(x)[:, :9], model(y)[:, :9], atol=1e-5, rtol=1e-5)
    old_cfg = OmegaConf.create({"d_model": 32, "n_layer": 1, "n_head": 4, "n_kv_head": 2,
                                "mlp_hidden": None, "dropout": 0.0, "norm_eps": 1e-6,
                                "tie_embeddings": True, "init_std": 0.02})  # fmt: skip
    attn_cfg = OmegaConf.merge(
        OmegaConf.structured(ATTENTION_SCHEMAS[attention]), {"impl": "torch"}
    )
    assert GPT(old_cfg, attn_cfg, vocab_size=11, max_len=40).blocks[0].attn.head_dim == 8


def test_mlp_hidden_defaults_to_8_3_of_d_model_rounded_up_to_32():
    """SwiGLU's hidden width: ``mlp_hidden`` when set, else 8/3 d_model rounded up to a
    multiple of 32 (d_model 32: 85.3 -> 96; 64: 170.7 -> 192)."""
    for d_model, hidden in ((32, 96), (64, 192)):
        mlp = make_model("nope", d_model=d_model).blocks[0].mlp
        assert (mlp.w_gate_up.out_features, mlp.w_down.in_features) == (2 * hidden, hidden)
    assert make_model("nope", mlp_hidden=50).blocks[0].mlp.w_down.in_features == 50


def test_learned_positions_add_row_p_at_position_p_up_to_max_len():
    """The learned table's row p is added at position p, for inputs as long as max_len."""
    model = make_model("learned").eval()
    idx = torch.randint(0, 11, (2, 40), device=DEVICE)
    with torch.no_grad():
        seen = []
        hook = model.drop.register_forward_hook(lambda m, args, out: seen.append(args[0]))
        model(idx)
        hook.remove()
        torch.testing.assert_close(seen[0], model.tok_emb(idx) + model.pos_emb.weight)


def test_dropout_covers_the_input_and_both_branches_of_every_block():
    """model.dropout applies to the embeddings and to the attention's and the MLP's outputs
    before each residual add: 1 + 2 n_layer dropout calls a forward, each dropping values in
    training mode and none in eval mode."""
    model = make_model("rope", dropout=0.5).train()
    calls = []
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(
                lambda m, args, out: calls.append(bool((out == 0).any() and m.training))
            )
    x = torch.randint(0, 11, (2, 9), device=DEVICE)
    model(x)
    assert calls == [True] * (1 + 2 * model.cfg.n_layer)
    calls.clear()
    model.eval()(x)
    assert calls == [False] * (1 + 2 * model.cfg.n_layer)


def test_activation_checkpointing_leaves_a_cached_forward_alone():
    """Checkpointing recomputes blocks without the cache, so a cached call, even with autograd
    on (frozen weights: the cache takes no grad), runs them with it: its chunk continues the
    cached tokens as the full forward computes it."""
    model = make_model("rope").requires_grad_(False)
    model.activation_checkpointing = True
    x = torch.randint(0, 11, (2, 9), device=DEVICE)
    full = model(x)
    cache = KVCache.for_model(model, 9)
    model(x[:, :5], cache)
    torch.testing.assert_close(model(x[:, 5:], cache), full[:, 5:], atol=1e-5, rtol=1e-5)
