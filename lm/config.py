"""Structured configs: one dataclass per config group, registered in Hydra's ConfigStore.

Every yaml file of a group ``<group>`` starts with ``defaults: [/schema/<group>/<name>@_here_,
_self_]``, so Hydra merges it onto its schema and a misspelled key (``model.n_layers=2``) or a
wrong type fails at start-up with the key's name. The schemas live in their own groups
(``schema/attention``, ...), so they are not among a group's options (``attention=...``).
``register_configs()`` must run before Hydra composes (``train.py`` and the tests call it); it
also registers the resolvers of ``configs/train.yaml``'s ``hydra`` node: ``${launch_time:...}``
(the output directories' names), ``${rank_suffix:}`` and ``${rank_zero_only:...}`` (each
torchrun rank's own log file; ``.hydra/`` from rank 0 alone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

# Settings of how a run is carried out and watched, not of what it trains (the kernels and the
# PyTorch path of attention.impl compute the same model, as do micro-batches and compile, up to
# rounding and dropout's masks): a resumed run may change them while the rest of its config must
# equal the checkpoint's, and the wandb run's name leaves them out, as do experiments/collect.py's
# cells, but for the keys that change the speed (its SPEED_KEYS). Each covers the keys under it.
RUN_CONDUCT_KEYS = (
    "name",
    "metric",
    "logger",
    "attention.impl",
    "attention.chunk_size",
    "train.log_every",
    "train.eval_every",
    "train.ckpt_every",
    "train.eval_batch_size",
    "train.grad_accum_steps",
    "train.resume",
    "train.overwrite",
    "train.max_minutes",
    "train.progress",
    "train.device",
    "train.cpu_threads",
    "train.time_attention",
    "train.compile",
    "train.compile_mode",
    "train.activation_checkpointing",
    "train.ckpt_path",
    "train.deterministic",
)


# torch.compile's modes, and those that capture CUDA graphs (on a CUDA device)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", *CUDAGRAPH_MODES)


def is_under(key: str, keys: tuple[str, ...] | list[str]) -> bool:
    """Whether the dotted config ``key`` is one of ``keys`` or under one (``logger.mode``
    under ``logger``)."""
    return any(key == k or key.startswith(k + ".") for k in keys)


@dataclass
class RopeScalingConfig:
    """``fused_rope.rope_frequencies``'s ``scaling`` dict; ``type: null`` = no scaling.

    Only the keys that are set (not null) are passed on, so each type takes the defaults of
    ``rope_frequencies`` for the rest.
    """

    type: str | None = None  # linear | dynamic | ntk_alpha | yarn | llama3 | longrope
    factor: float | None = None
    alpha: float | None = None  # ntk_alpha's (HunYuan): theta * alpha ** (R / (R - 2))
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    truncate: bool | None = None
    # LongRoPE (Phi-3): rope_dim // 2 divisors of the frequencies each, the short ones up to
    # original_max_position_embeddings tokens, the long ones past it
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None
    short_mscale: float | None = None  # Phi-3.5-MoE's attention factors, short and long
    long_mscale: float | None = None
    max_position_embeddings: int | None = None  # LongRoPE's factor: this / the original length


@dataclass
class QueryScaleConfig:
    """Attention temperature tuning (Llama 4, Ministral 3, Mistral 4): the queries at position
    ``p`` times ``1 + beta ln(1 + floor((p + offset) / length))``
    (``fused_rope.llama4_attn_scale``); ``beta: null`` = none. Ministral 3's
    ``llama_4_scaling_beta`` is ``beta`` and its ``original_max_position_embeddings`` is
    ``length`` (offset 0); Llama 4's ``attn_scale`` is ``beta``, its ``floor_scale``
    ``length``, with offset 1 and ``layers: nope``."""

    beta: float | None = None
    length: int | None = None  # the scale is 1 below this position, then steps up each length
    layers: str = "all"  # all | nope: only the layers without rotation (Llama 4's rule)
    offset: int = 0  # added to the positions: Llama 4 counts from 1 (offset 1), Ministral from 0


@dataclass
class AttentionConfig:
    """Fields every attention variant has; ``name`` picks the module in ``lm.attention``."""

    name: str = MISSING
    query_scale: QueryScaleConfig = field(default_factory=QueryScaleConfig)
    # A causal sliding window: each query sees its last `window` keys, its own included
    # (transformers' sliding_window: Mistral, Gemma 2/3, GPT-OSS); null = every key
    window: int | None = None
    # With a window, every global_interval-th layer (layers k - 1, 2k - 1, ...) sees every key:
    # Gemma 3's 1 in 6, Gemma 2's and GPT-OSS's 1 in 2; null = every layer windowed (Mistral)
    global_interval: int | None = None


@dataclass
class NopeAttentionConfig(AttentionConfig):
    name: str = "nope"


@dataclass
class SinusoidalAttentionConfig(AttentionConfig):
    name: str = "sinusoidal"
    base: float = 10000.0


@dataclass
class LearnedAttentionConfig(AttentionConfig):
    name: str = "learned"


@dataclass
class RopeAttentionConfig(AttentionConfig):
    name: str = "rope"
    impl: str = "auto"  # auto (triton on CUDA, torch on CPU) | triton | torch
    theta: float = 10000.0
    rope_dim: int | None = None  # rotated channels per head; null = the head dim
    layout: str = "half"  # half (GPT-NeoX, Llama) | interleaved (GPT-J)
    scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # Learn the frequencies (in log space, from the schedule's), one set per layer
    learn_freq: bool = False
    # Every nope_interval-th layer (layers k - 1, 2k - 1, ...) attends without rotation (NoPE),
    # as Llama 4 and Command A interleave 1 in 4; null = every layer rotates
    nope_interval: int | None = None
    # The RoPE base of the layers with attention.window, unscaled (Gemma 3's
    # rope_local_base_freq: 10000, its global layers 1e6 with linear scaling); null = theta
    window_theta: float | None = None


@dataclass
class CoRopeAttentionConfig(AttentionConfig):
    name: str = "corope"
    impl: str = "auto"
    theta: float = 10000.0
    rope_dim: int | None = None
    leader: str = "first"  # first | mean: which query of a GQA group computes the gates
    detach_mileage: bool = False
    chunk_size: int | None = None  # query rows per chunk of the PyTorch path (null = automatic)
    scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # Learn the frequencies (in log space, from the schedule's), one set per layer
    learn_freq: bool = False
    # Every nope_interval-th layer (layers k - 1, 2k - 1, ...) attends without rotation (NoPE),
    # as Llama 4 and Command A interleave 1 in 4; null = every layer rotates
    nope_interval: int | None = None


ATTENTION_SCHEMAS: dict[str, type] = {
    "nope": NopeAttentionConfig,
    "sinusoidal": SinusoidalAttentionConfig,
    "learned": LearnedAttentionConfig,
    "rope": RopeAttentionConfig,
    "corope": CoRopeAttentionConfig,
}


@dataclass
class ModelConfig:
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # grouped-query attention: n_head % n_kv_head == 0
    head_dim: int | None = None  # channels a head; null = d_model / n_head
    mlp_hidden: int | None = None  # SwiGLU hidden width; null = 8/3 d_model rounded up to 32
    tie_embeddings: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-6
    init_std: float = 0.02


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1  # matrices only; norms, biases and embeddings get none
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = off


@dataclass
class LoopConfig:
    steps: int = 300
    batch_size: int = 32  # per process; the global batch is batch_size * world_size
    # Micro-batches a step runs each process's rows in (dividing batch_size): the gradients
    # add up to the whole batch's, so it trades speed for memory and trains the same model.
    # Evaluation is not split: eval_batch_size bounds its memory.
    grad_accum_steps: int = 1
    eval_every: int = 100  # and always at the end; 0 = only at the end
    eval_batch_size: int = 64
    log_every: int = 10
    ckpt_every: int = 100  # and always at the end; 0 = only at the end
    # Wall-clock budget of this process's training loop: past it the run evaluates, saves and
    # writes summary.json (with stopped_early) as at its last step; resume=true goes on to
    # `steps`. null = no limit. For GPU blocks where every job must finish in time.
    max_minutes: float | None = None
    # Continue from ckpt_path if it exists, with the same config (cadences, device, logger and
    # attention.impl aside; lm.config.RUN_CONDUCT_KEYS): another config fails naming the keys.
    resume: bool = False
    # Start from step 0 even where ckpt_path holds a checkpoint, replacing it and the run's
    # metrics. With neither resume nor overwrite, an existing checkpoint fails the start.
    overwrite: bool = False
    # A relative path is under the run's output directory (each sweep job has its own).
    ckpt_path: str | None = None  # null = <output dir>/checkpoint.pt
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Intra-op threads when training on the CPU (null = torch's default, one per core). One
    # thread: a tiny model gains little from more, and a shared CPU loses a lot to them.
    cpu_threads: int | None = 1
    time_attention: bool = True  # time spent in the attention op (see lm/profiling.py)
    # torch.compile the model (the first step and the first evaluations compile); the same
    # model up to rounding (and dropout's masks), so a run-conduct key. Attention is not timed.
    compile: bool = False
    # torch.compile's mode under train.compile=true (COMPILE_MODES): reduce-overhead replays
    # each step's forward and backward as CUDA graphs, removing the host's launch cost, which
    # bounds the steps of small models on a GPU (lm/README.md, "torch.compile").
    compile_mode: str = "default"
    # Keep only each block's input and recompute the block in the backward: activation memory
    # of one block instead of every layer's, for one more forward a step; the same gradients,
    # so a run-conduct key.
    activation_checkpointing: bool = False
    progress: bool = True  # tqdm progress bar on rank 0
    # torch.use_deterministic_algorithms(True) for the run: bitwise-repeatable steps on the GPU
    # too (Co-RoPE's backward takes its deterministic mode), or a RuntimeError naming the
    # operator that has no deterministic implementation. Slower; the same model up to rounding.
    deterministic: bool = False


@dataclass
class LoggerConfig:
    """``_target_`` is instantiated with the remaining fields (``hydra.utils.instantiate``)."""

    _target_: str = MISSING


@dataclass
class WandbLoggerConfig(LoggerConfig):
    _target_: str = "lm.loggers.WandbLogger"
    project: str = "fused-rope"
    entity: str | None = None
    mode: str = "offline"  # offline (no account, no network) | online | disabled


@dataclass
class NoLoggerConfig(LoggerConfig):
    _target_: str = "lm.loggers.NullLogger"


@dataclass
class TrainConfig:
    """The root config (``configs/train.yaml``)."""

    name: str = "default"  # experiment name: the wandb group, set by configs/experiment/*
    seed: int = 0  # model init and dropout; the data has its own data.seed
    metric: str = "best_val_loss"  # the key of train()'s dict that train.py returns to sweepers
    attention: Any = MISSING
    model: ModelConfig = MISSING
    data: Any = MISSING
    optim: OptimConfig = MISSING
    train: LoopConfig = field(default_factory=LoopConfig)
    logger: Any = MISSING


def schema_defaults(config: dict) -> dict:
    """``{"model": {...}, "attention": {...}}``: the defaults of the model schema and of the
    schema of ``config``'s attention (none where its name is unknown), as plain nested dicts:
    what a run saved before one of their fields existed had implicitly (``load_run`` fills such
    a run's config with them too)."""
    groups = {"model": ModelConfig}
    name = (config.get("attention") or {}).get("name")
    if name in ATTENTION_SCHEMAS:
        groups["attention"] = ATTENTION_SCHEMAS[name]
    return {g: OmegaConf.to_container(OmegaConf.structured(schema)) for g, schema in groups.items()}


def unknown_keys(cfg: Any, prefix: str = "") -> list[str]:
    """The dotted keys of the composed ``cfg`` that its schemas do not declare: Hydra's ``+``
    adds them to a structured node (``+model.n_layers=4``, where the key is ``n_layer``), and
    the run would record them in its config and ignore them."""
    schema = OmegaConf.get_type(cfg)
    names = {f.name for f in fields(schema)} if is_dataclass(schema) else None
    found = []
    for key in cfg.keys():
        if names is not None and key not in names:
            found.append(f"{prefix}{key}")
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not (child._is_none() or child._is_missing()):
            found += unknown_keys(child, f"{prefix}{key}.")
    return found


def launch_time(pattern: str) -> str:
    """``${launch_time:<strftime pattern>}``, the stamp of ``hydra.run.dir`` and
    ``hydra.sweep.dir``: Hydra's ``${now:<pattern>}`` (this process's clock) in one process;
    on every rank of a torchrun launch, rank 0's instant (``lm.distributed.launch_time``), so
    that all ranks resolve the one run directory where rank 0 writes the run, and no rank
    creates a directory of its own."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a strftime pattern (str), got {type(pattern).__name__}")
    from lm import distributed  # imports torch: only where a directory is named

    shared = distributed.shares_torchrun_store()
    return (distributed.launch_time() if shared else datetime.now()).strftime(pattern)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def rank_suffix() -> str:
    """``${rank_suffix:}``: ``""`` in one process and on rank 0 of a torchrun launch,
    ``"_rank<r>"`` on rank ``r > 0``. The ranks share rank 0's run directory, where the others
    log to ``train_rank<r>.log`` rather than into rank 0's ``train.log``."""
    return f"_rank{_rank()}" if _rank() > 0 else ""


def rank_zero_only(value: Any) -> Any:
    """``${rank_zero_only:<value>}``: the value in one process and on rank 0, None on the other
    ranks (``hydra.output_subdir``: rank 0 alone writes the run's ``.hydra`` copy of the
    config)."""
    return value if _rank() == 0 else None


def register_configs() -> None:
    """Registers every schema and the resolvers of ``configs/train.yaml``; idempotent."""
    from lm.data.config import DATA_SCHEMAS

    # Cached per config and pattern, as Hydra's ``now``: a sweep's jobs get its directory.
    OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("rank_suffix", rank_suffix, replace=True)
    OmegaConf.register_new_resolver("rank_zero_only", rank_zero_only, replace=True)

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="schema/model", name="decoder", node=ModelConfig)
    cs.store(group="schema/optim", name="adamw", node=OptimConfig)
    cs.store(group="schema/logger", name="wandb", node=WandbLoggerConfig)
    cs.store(group="schema/logger", name="none", node=NoLoggerConfig)
    for key, schema in ATTENTION_SCHEMAS.items():
        cs.store(group="schema/attention", name=key, node=schema)
    for key, schema in DATA_SCHEMAS.items():
        cs.store(group="schema/data", name=key, node=schema)
