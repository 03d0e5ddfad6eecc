"""configs/ as a user composes it: every attention variant and data source builds and runs a
forward pass; bad overrides fail at start-up with the key's name."""

import datetime
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

import lm.distributed
from fused_rope.frequencies import rope_frequencies
from lm.attention import build_attention
from lm.config import launch_time, rank_suffix, rank_zero_only, register_configs, unknown_keys
from lm.data import build_dataset
from lm.model import GPT
from lm.training import _config_choice
from tests.helpers import assert_close
from tests.lm.harness import CONFIGS, TINY, compose_cfg

ATTENTION_FILES = sorted(p.stem for p in (CONFIGS / "attention").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
SMALL_DATA = {
    "counting": ["data.max_statements=8", "data.seq_len=40", "data.eval_samples=8"],
    "selective_copy": ["data.eval_samples=8"],
    "flipflop": ["data.eval_samples=8", "data.num_instructions=16", "data.seq_len=40"],
    "stdlib": ["data.max_bytes=1000000", "data.seq_len=32", "data.eval_samples=4"],
}


def forward_one_batch(cfg) -> torch.Tensor:
    dataset = build_dataset(cfg.data)
    model = GPT(cfg.model, cfg.attention, dataset.vocab_size, dataset.max_len)
    x, y = dataset.train_batch(0, 2)
    logits = model(x)
    assert logits.shape == (*x.shape, dataset.vocab_size)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_output_dirs_of_runs_started_in_the_same_second_differ():
    """``hydra.run.dir`` and ``hydra.sweep.dir`` are stamped to the microsecond, under the
    date's folder."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        first, second = (compose("train", return_hydra_config=True).hydra for _ in range(2))
    today = datetime.date.today().isoformat()
    for key in ("run", "sweep"):
        a, b = Path(first[key].dir), Path(second[key].dir)
        assert a != b and a.parent.name == b.parent.name == today, (a, b)


def torchrun_env(monkeypatch, port: int, rank: int) -> None:
    """The environment torchrun gives rank ``rank`` of 2 whose agent keeps its store at
    ``port``."""
    env = {"WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env |= {"TORCHELASTIC_RUN_ID": "launch-1", "TORCHELASTIC_RESTART_COUNT": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    lm.distributed.launch_time.cache_clear()


@pytest.fixture
def agent_store():
    """A store as torchrun's agent keeps one, in this process; launch_time's cache cleared
    after the test."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True)
    yield store
    lm.distributed.launch_time.cache_clear()


def test_torchrun_ranks_resolve_rank_0s_output_dir(monkeypatch, agent_store):
    """Each rank of a torchrun launch composes the run directory that rank 0 does: rank 0's
    instant, written into the agent's store, not the rank's own clock (rank 1 composes 2 s
    later here: its own clock would name another directory, as another host's clock could)."""
    register_configs()
    dirs = []
    for rank in (0, 1):
        torchrun_env(monkeypatch, agent_store.port, rank)
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            hydra = compose("train", return_hydra_config=True).hydra
            dirs.append((hydra.run.dir, hydra.sweep.dir))
        if rank == 0:
            time.sleep(2)
    assert dirs[0] == dirs[1], dirs
    assert datetime.date.today().isoformat() in dirs[0][0] and dirs[0][0].startswith("outputs/")
    # A restart of the launch (torchrun --max-restarts): its rank 0 finds the launch's time,
    # which stays, so the restarted ranks run (and train.resume=true resumes) in its directory.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lm.distributed.launch_time.cache_clear()
    monkeypatch.setenv("RANK", "0")
    assert launch_time("%H-%M-%S-%f") == dirs[0][0].rsplit("/", 1)[1]
    # Another launch has a key of its own: nothing there until its rank 0 writes it.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-launch")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(lm.distributed, "LAUNCH_TIME_TIMEOUT_S", 0.5)
    lm.distributed.launch_time.cache_clear()
    with pytest.raises(TimeoutError, match="rank 1 got no launch time"):
        launch_time("%H")


def test_a_rank_without_rank_0s_launch_time_fails_naming_the_way_out(monkeypatch, agent_store):
    torchrun_env(monkeypatch, agent_store.port, rank=1)
    monkeypatch.setattr(lm.distributed, "LAUNCH_TIME_TIMEOUT_S", 0.5)
    with pytest.raises(TimeoutError, match=r"rank 1 got no launch time .*hydra\.run\.dir="):
        launch_time("%H")


def test_launch_time_outside_torchrun_is_this_processs_clock(monkeypatch):
    """One process, or ranks without torchrun's agent store (the store opted out with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): Hydra's ``now``."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert not lm.distributed.shares_torchrun_store()
    before = datetime.datetime.now().replace(microsecond=0)
    stamp = datetime.datetime.strptime(launch_time("%Y-%m-%d %H:%M:%S"), "%Y-%m-%d %H:%M:%S")
    assert before <= stamp <= datetime.datetime.now()
    with pytest.raises(RuntimeError, match="needs a multi-process torchrun launch"):
        lm.distributed.launch_time()
    with pytest.raises(TypeError, match="pattern"):
        launch_time(3)


def test_default_is_rope_on_flipflop(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = compose_cfg()
    assert (cfg.attention.name, cfg.data.name, cfg.logger.mode) == ("rope", "flipflop", "offline")


def test_wandb_mode_follows_the_environment(monkeypatch):
    """WANDB_MODE picks wandb's mode (an explicit mode in wandb.init would override it);
    logger.mode on the command line still wins."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert compose_cfg().logger.mode == "disabled"
    assert compose_cfg("logger.mode=online").logger.mode == "online"


@pytest.mark.parametrize("attention", ATTENTION_FILES)
def test_every_attention_config_trains_a_step(attention):
    cfg = compose_cfg(f"attention={attention}", *TINY, "data=counting", *SMALL_DATA["counting"])
    loss = forward_one_batch(cfg)
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    "preset, kind", [("rope_linear", "linear"), ("rope_ntk", "dynamic"), ("rope_yarn", "yarn"),
                     ("rope_llama3", "llama3")],
)  # fmt: skip
def test_scaling_presets_set_the_schedule(preset, kind):
    """Each preset names its schedule; those that have a training length take data.seq_len."""
    scaling = compose_cfg(f"attention={preset}", "data.seq_len=96").attention.scaling
    assert scaling.type == kind
    expected = None if kind == "linear" else 96
    assert scaling.original_max_position_embeddings == expected


def test_a_scaling_schedule_can_be_swept_from_the_plain_preset():
    swept = compose_cfg(
        "attention=rope", "attention.scaling.type=linear", "attention.scaling.factor=2"
    )
    assert (swept.attention.scaling.type, swept.attention.scaling.factor) == ("linear", 2.0)


def test_ntk_alpha_is_a_static_schedule_of_the_harness():
    """``attention.scaling.type=ntk_alpha attention.scaling.alpha=...`` (HunYuan's) gives
    rope_frequencies' frequencies, fixed (not recomputed per length), and can be learned."""
    cfg = compose_cfg("attention=rope", *TINY, "attention.scaling.type=ntk_alpha",
                      "attention.scaling.alpha=8", "attention.learn_freq=true")  # fmt: skip
    attn = build_attention(cfg.attention, cfg.model.d_model, cfg.model.n_head, cfg.model.n_kv_head)
    expected = rope_frequencies(attn.rope_dim, 10000.0, {"type": "ntk_alpha", "alpha": 8.0})[0]
    assert not attn.freqs.dynamic
    # exp of the learned log frequencies: a rounding apart
    assert_close("inv_freq", attn.freqs.for_length(10**6)[0], expected, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("data", sorted(SMALL_DATA))
def test_builtin_data_sources(data):
    cfg = compose_cfg(f"data={data}", *TINY, *SMALL_DATA[data])
    assert torch.isfinite(forward_one_batch(cfg))


def test_jsonl_source(qa_jsonl_dir):
    cfg = compose_cfg("data=jsonl", f"data.dir={qa_jsonl_dir}", *TINY)
    assert torch.isfinite(forward_one_batch(cfg))


def test_text_source(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 40)
    cfg = compose_cfg("data=text", f"data.files=[{text}]", "data.seq_len=32", *TINY)
    assert torch.isfinite(forward_one_batch(cfg))


@pytest.mark.parametrize("data", ["wikitext103", "tinystories"])
def test_hub_sources_offline_name_the_dataset(data, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no cached copy either
    cfg = compose_cfg(f"data={data}")
    with pytest.raises((RuntimeError, ValueError, ConnectionError)) as info:
        build_dataset(cfg.data)
    assert f"data={data}" in str(info.value) and "data=stdlib" in str(info.value)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_presets_compose(experiment):
    cfg = compose_cfg(f"experiment={experiment}")
    assert cfg.name == experiment


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_layers=2", "n_layers"),
        ("train.stepz=10", "stepz"),
        ("attention.thetaa=500", "thetaa"),
        ("optim.learning_rate=1", "learning_rate"),
        ("data.num_variables=3", "num_variables"),
        ("model.n_head=four", "n_head"),
    ],
)
def test_misspelled_or_mistyped_key_fails_naming_it(override, key):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as info:
        compose_cfg(override)
    assert key in str(info.value) + str(info.value.__cause__)


def test_keys_added_with_plus_that_no_schema_declares_are_found():
    """Hydra's ``+`` adds a key to a structured node (where a plain override fails): every such
    key, at any depth, is reported; the presets' own keys are not."""
    cfg = compose_cfg("attention=corope", "+model.n_layers=4", "+attention.scaling.factr=2",
                      "+logger.projct=x", "+top=1")  # fmt: skip
    assert sorted(unknown_keys(cfg)) == [
        "attention.scaling.factr",
        "logger.projct",
        "model.n_layers",
        "top",
    ]
    for experiment in EXPERIMENTS:
        assert unknown_keys(compose_cfg(f"experiment={experiment}")) == [], experiment


@pytest.mark.parametrize("group", ["attention", "data", "logger", "model", "optim"])
def test_a_groups_options_are_its_yaml_files(group):
    """The schemas live in ``schema/<group>``: ``--help`` and a wrong option's error list
    the group's yaml files only, and every file composes onto a schema dataclass."""
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    files = sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        assert loader.get_group_options(group) == files
        assert loader.get_group_options(f"schema/{group}")
    for name in files:
        schema = OmegaConf.get_type(compose_cfg(f"{group}={name}")[group])
        assert schema.__module__.startswith("lm.") and schema.__name__.endswith("Config")


def test_unknown_attention_lists_the_options():
    with pytest.raises(HydraException) as info:
        compose_cfg("attention=alibi")
    message = str(info.value)
    assert "attention/alibi" in message and "corope" in message


def test_summary_names_the_attention_config_file():
    """summary.json's ``attention`` is the module (``rope`` for every RoPE preset);
    ``attention_config`` is the file Hydra chose, which tells the presets apart."""
    register_configs()
    assert _config_choice("attention", "rope") == "rope"  # outside Hydra: the default
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=["attention=rope_yarn"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        assert cfg.attention.name == "rope"
        assert _config_choice("attention", cfg.attention.name) == "rope_yarn"
    finally:
        HydraConfig.instance().cfg = None


@pytest.mark.parametrize("rank, suffix", [(None, ""), ("0", ""), ("3", "_rank3")])
def test_each_torchrun_rank_but_the_first_logs_to_its_own_file(monkeypatch, rank, suffix):
    """The ranks share rank 0's run directory: rank r > 0 logs to train_rank<r>.log and
    writes no .hydra/ (hydra.output_subdir null); one process and rank 0 as before."""
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert rank_suffix() == suffix
    assert rank_zero_only(".hydra") == (None if suffix else ".hydra")
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    assert cfg.hydra.output_subdir == (None if suffix else ".hydra")
    handler = OmegaConf.to_container(cfg.hydra.job_logging.handlers.file)
    assert handler["filename"].endswith("${hydra.job.name}${rank_suffix:}.log")
