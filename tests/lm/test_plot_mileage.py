"""experiments/plot_mileage.py: a Co-RoPE checkpoint's leader gates and mileage, as drawn, are
the ones the model's attention used."""

import pytest
import torch
from omegaconf import OmegaConf

from experiments.plot_mileage import capture_attention, load_run, main
from fused_rope.naive import apply_rope_ref
from lm.checkpoint import save_checkpoint
from lm.data import build_dataset
from lm.model import GPT
from tests.helpers import assert_close, errors
from tests.lm.harness import TINY, compose_cfg

# Two layers, two KV groups of two query heads: a leader that is not every head.
MODEL = [*TINY, "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.d_model=128"]
COUNTING = ["data=counting", "data.max_statements=6", "data.seq_len=32", "data.eval_samples=4"]


def save_run(run_dir, *overrides: str, stored_config: bool = False) -> None:
    """A run directory as train.py leaves it: the model at initialisation (0 steps) in
    ``checkpoint.pt`` (with its resolved config if ``stored_config``, as train.py now saves
    it; older checkpoints lack it) and the composed config in ``.hydra/config.yaml``."""
    cfg = compose_cfg(*MODEL, *COUNTING, *overrides)
    dataset = build_dataset(cfg.data)
    model = GPT(cfg.model, cfg.attention, dataset.vocab_size, dataset.max_len)
    state = {"model": model.state_dict(), "step": 0}
    if stored_config:
        state["config"] = OmegaConf.to_container(cfg, resolve=True)
    save_checkpoint(run_dir / "checkpoint.pt", state)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")


def attention_row(q, k, v, delta_row, attn, i: int, g: int) -> torch.Tensor:
    """Row ``i`` of KV group ``g``'s heads, ``[B, G, D]``, recomputed from a mileage row
    ``delta_row [i + 1]``: keys rotated by ``-delta[i, j] w``, then softmax attention."""
    G = q.shape[1] // k.shape[1]
    inv_freq, _ = attn.freqs.for_length(q.shape[2])
    angles = -delta_row[:, None] * inv_freq.to(delta_row.dtype)  # [i + 1, R/2]
    kr = apply_rope_ref(k[:, g : g + 1, : i + 1], angles, "half", attn.rope_dim)[:, 0]
    scores = torch.einsum("bgd,bnd->bgn", q[:, g * G : (g + 1) * G, i], kr) * q.shape[-1] ** -0.5
    return scores.softmax(-1) @ v[:, g, : i + 1]


@pytest.mark.parametrize("leader", ["first", "mean"])
@pytest.mark.parametrize("query", [-1, 7])
def test_drawn_mileage_reproduces_the_models_attention(tmp_path, leader, query):
    save_run(tmp_path, "attention=corope", f"attention.leader={leader}")
    drawn = main(
        [str(tmp_path), "--example", "test:1", "--query", str(query), "--dtype", "float64"]
    )
    names = ["mileage.png", "mileage_gates.md", "mileage_matrix.png"]
    assert [p.name for p in drawn["paths"]] == names
    assert all(p.stat().st_size > 10_000 for p in drawn["paths"] if p.suffix == ".png")

    _, model, dataset = load_run(tmp_path, torch.float64)
    ids = torch.tensor(drawn["ids"])
    assert drawn["ids"] == dataset.eval_examples("test")[1].tokens[:-1].tolist()
    assert drawn["labels"][-2:] == ["print", dataset.decode(drawn["ids"][-1:])]
    with capture_attention(model) as captured, torch.no_grad():
        model(ids[None])
    i = drawn["query"]
    assert i == (len(ids) - 1 if query == -1 else query)
    z, delta = drawn["gates"], drawn["mileage"]
    assert z.shape == delta.shape == (2, 2, len(ids), len(ids))
    for layer, (q, k, v, o) in enumerate(captured):
        attn = model.blocks[layer].attn
        for g in range(2):
            row = delta[layer, g, i, : i + 1]
            ref = o[:, 2 * g : 2 * g + 2, i]  # what the model's Co-RoPE attention computed
            assert_close(
                f"L{layer} g{g}", attention_row(q, k, v, row, attn, i, g), ref, 1e-10, 1e-10
            )
            # the check can fail: a mileage that counts key j's own gate is off by z[i, j]
            inclusive = row + z[layer, g, i, : i + 1]
            assert errors(attention_row(q, k, v, inclusive, attn, i, g), ref)[1] > 1e-6


def test_gate_table_is_the_mean_gate_per_key_token(tmp_path):
    save_run(tmp_path, "attention=corope")
    program = tmp_path / "prog.txt"
    program.write_text("x ++ ; pass ; x ++ ; print x")
    drawn = main([str(tmp_path), "--input-file", str(program), "--query", "6"])
    z, labels = drawn["gates"], drawn["labels"]
    table = (tmp_path / "mileage_gates.md").read_text().splitlines()
    assert table[2] == "| key token | count | L0 g0 | L0 g1 | L1 g0 | L1 g1 |"
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table[4:]]
    # keys 0..6 are `x ++ ; pass ; x ++`: most frequent first, ties by name
    assert [r[:2] for r in rows] == [["`++`", "2"], ["`;`", "2"], ["`x`", "2"], ["`pass`", "1"]]
    for row in rows:
        keys = [j for j in range(7) if f"`{labels[j]}`" == row[0]]
        expected = z[:, :, 6, keys].double().mean(-1).flatten()
        assert torch.allclose(
            torch.tensor([float(c) for c in row[2:]], dtype=torch.float64), expected, atol=6e-4
        )


def test_the_checkpoints_own_config_wins_over_a_rewritten_hydra_config(tmp_path):
    """A refused relaunch into the run's directory rewrites ``.hydra/config.yaml`` (here to a
    RoPE run of another width); the model is rebuilt from the config in the checkpoint."""
    save_run(tmp_path, "attention=corope", "attention.leader=mean", stored_config=True)
    rewritten = compose_cfg(*MODEL, *COUNTING, "attention=rope", "model.d_model=64")
    OmegaConf.save(rewritten, tmp_path / ".hydra" / "config.yaml")
    cfg, _, _ = load_run(tmp_path)  # the checkpoint's weights fit the model it builds
    assert (cfg.attention.name, cfg.attention.leader, cfg.model.d_model) == ("corope", "mean", 128)


def test_rejects_a_run_that_is_not_corope(tmp_path):
    save_run(tmp_path, "attention=rope")
    with pytest.raises(ValueError, match="'rope' run; gates need corope"):
        main([str(tmp_path)])


def test_draws_only_the_corope_layers_of_a_run_with_nope_layers(tmp_path):
    """``attention.nope_interval=2``: layer 1 has no rotation and no gates; the figures and
    the table show layer 0 alone, under its own index."""
    save_run(tmp_path, "attention=corope", "attention.nope_interval=2")
    drawn = main([str(tmp_path), "--out", str(tmp_path / "m.png")])
    assert drawn["layers"] == [0] and drawn["gates"].shape[0] == 1
    header = (tmp_path / "m_gates.md").read_text().splitlines()[2]
    assert "L0 g0" in header and "L1" not in header


def test_input_file_and_bad_arguments(tmp_path, capsys):
    save_run(tmp_path, "attention=corope")
    program = tmp_path / "prog.txt"
    program.write_text("x ++ ; pass ; y = 0 ; x ++ ; print x")
    drawn = main([str(tmp_path), "--input-file", str(program), "--out", str(tmp_path / "p.png")])
    assert drawn["labels"] == program.read_text().split() and drawn["query"] == 13
    assert (tmp_path / "p.png").exists() and (tmp_path / "p_matrix.png").exists()
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--example", "nosuch:0"])
    assert (
        "--example must be SPLIT:INDEX with SPLIT in ['valid', 'test', 'ood_long']"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--query", "99"])
    assert "--query must index" in capsys.readouterr().err
