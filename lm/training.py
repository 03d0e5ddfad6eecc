"""The training loop: ``train(cfg) -> metrics``.

AdamW (weight decay on matrices only), linear warmup then cosine decay, gradient
clipping, bf16 autocast on CUDA, DDP under torchrun, micro-batches
(``train.grad_accum_steps``), ``torch.compile`` (``train.compile``). Rank 0 evaluates every
``train.eval_every`` steps and at the end, logs, and writes into the output directory:

    metrics.jsonl    one JSON object per log/eval event ({"step": ..., "train/loss": ...})
    run.json         the resolved config and the overrides, written when the run starts (after
                     its checks: a launch that is refused leaves the directory's run.json as
                     it was, where Hydra has already rewritten .hydra/)
    summary.json     the final metrics, speed and run facts (what experiments/collect.py reads)
    failed.json      only if the loop raised an error: the step, the error's type and message
    checkpoint.pt    model, optimizer, scheduler, step, RNG states, the resolved config and
                     the logger's run id (``train.resume=true``)

The training loss is the mean cross-entropy over the target tokens of the global batch
(under DDP too, where ranks hold different numbers of targets). A run refuses to start
over an existing checkpoint unless ``train.resume`` (the same config) or
``train.overwrite`` says what to do with it.

Speed (in ``summary.json`` and the logs), measured over the training steps after the
first (which pays for kernel compilation and warm-up; under CUDA graphs after the second, which
records them) and excluding evaluation:
``tokens_per_s`` (global), ``step_ms``, ``peak_mem_mib`` (the most CUDA memory allocated
during a step, weights and optimizer state included; under CUDA graphs, whose replays
allocate nothing, over the steps that warm up and record them too; null on the CPU), ``mfu``
(``lm.profiling.model_flops_per_token`` x tokens/s over the GPUs' peak bf16 rate; null on
the CPU and unknown GPUs), ``attn_time_frac`` (share of the step inside the attention op,
forward and backward: CUDA events on GPU, wall clock on CPU; ``train.time_attention``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from lm import distributed
from lm.attention import attention_class, check_attention_config, resolve_impl
from lm.checkpoint import (
    checkpoint_path,
    config_changes,
    load_checkpoint,
    read_jsonl,
    replace_atomically,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_json,
)
from lm.config import (
    ATTENTION_SCHEMAS,
    COMPILE_MODES,
    CUDAGRAPH_MODES,
    RUN_CONDUCT_KEYS,
    is_under,
    schema_defaults,
    unknown_keys,
)
from lm.data import build_dataset
from lm.data.base import IGNORE_INDEX, check_fraction, check_int
from lm.data.synthetic import SyntheticTask
from lm.data.text import resolve_path
from lm.determinism import deterministic_algorithms
from lm.evaluation import autocast, evaluate, metric_names
from lm.model import GPT
from lm.profiling import AttentionTimer, model_flops_per_token, peak_bf16_flops

log = logging.getLogger(__name__)

# A stop (SIGTERM: train.py's handler) that came while a record was being written, held until
# the record is in both metrics.jsonl and the logger: {"recording": bool, "exit": code or None}
_STOP: dict[str, Any] = {"recording": False, "exit": None}


def exit_between_records(stop: BaseException) -> None:
    """Raises ``stop`` (``SystemExit(code)`` for SIGTERM, ``KeyboardInterrupt()`` for Ctrl-C)
    now, or, from a signal handler that ran while ``_Run._record`` was writing, as soon as
    that record is in metrics.jsonl, the logger and logged.json (a signal between the two
    writes left a step in the file that wandb never got). Signal handlers run in the main
    thread, the trainer's, between its bytecodes."""
    if _STOP["recording"]:
        if _STOP["exit"] is None:  # the first signal's stop (its exit code)
            _STOP["exit"] = stop
        return
    raise stop


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based): linear warmup over
    ``warmup`` steps, then a cosine from 1 down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one rank's training step: a fixed function of the three (hashes of
    ints do not vary between processes, unlike those of strings)."""
    return hash((seed, step, rank)) & (2**63 - 1)


def build_optimizer(model: torch.nn.Module, cfg: Any, total_steps: int):
    """AdamW with decay on matrices only, and its warmup + cosine ``LambdaLR``."""
    params = [p for p in model.parameters() if p.requires_grad]
    embeddings = {id(p) for p in _embeddings(model)}
    no_decay = lambda p: p.dim() < 2 or id(p) in embeddings  # norms, biases, embedding tables
    groups = [
        {"params": [p for p in params if not no_decay(p)], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if no_decay(p)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
    return opt, sched


def _embeddings(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of every embedding table (tokens, learned positions)."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]


def _overrides() -> list[str]:
    """The command-line overrides of the run's config (Hydra's own, ``hydra.*``, aside)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _config_choice(group: str, default: str) -> str:
    """The config file Hydra chose for ``group`` (``rope_yarn`` where the attention's name is
    ``rope``); ``default`` outside Hydra."""
    if not HydraConfig.initialized():
        return default
    return str(HydraConfig.get().runtime.choices.get(group, default))


def _defines_the_run(key: str) -> bool:
    """Whether the dotted config ``key`` is part of what the run trains (not in
    ``RUN_CONDUCT_KEYS``)."""
    return not is_under(key, RUN_CONDUCT_KEYS)


def _run_name(out_dir: Path) -> str:
    """The logger's run name: the overrides that define the run (``attention=rope seed=1``),
    the same when it resumes; without any, the output directory's name."""
    keys = {o: o.split("=", 1)[0].lstrip("+~") for o in _overrides()}
    return " ".join(o for o, key in keys.items() if _defines_the_run(key)) or out_dir.name


def _output_dir(output_dir: str | None) -> Path:
    if output_dir is None:
        if not HydraConfig.initialized():
            raise ValueError("train(cfg) outside @hydra.main needs output_dir")
        output_dir = HydraConfig.get().runtime.output_dir
    return Path(output_dir)


DATA_PATH_KEYS = ("data.dir", "data.files")


def _data_paths(cfg: DictConfig) -> list[str]:
    """The data's folder and files (``DATA_PATH_KEYS``) made absolute as the run reads them
    (relative ones against the launch directory): a resume must read the same."""
    named = []
    for key in DATA_PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)  # absent, or missing: none
        named += [] if value is None else [value] if isinstance(value, str) else list(value)
    return [str(resolve_path(p)) for p in named]


def _check_no_checkpoint_elsewhere(path: Path, out_dir: Path) -> None:
    """``train.resume=true`` and no checkpoint at ``path``: the run would start at step 0 and
    replace ``out_dir``'s metrics. Refused if the directory's earlier run (its ``run.json``)
    saved its checkpoints under another ``train.ckpt_path`` and one is there: a changed
    ``ckpt_path`` must not start over beside the run it was meant to continue.

    Raises:
        FileNotFoundError: naming the earlier run's checkpoint.
    """
    try:
        earlier = json.loads((out_dir / "run.json").read_text())["config"]["train"]["ckpt_path"]
    except (OSError, ValueError, KeyError, TypeError):  # no earlier run, or a record without it
        return
    found = checkpoint_path(earlier, out_dir)
    if found != path and found.exists():
        raise FileNotFoundError(
            f"train.resume=true: no checkpoint at {path}, but this directory's earlier run saved "
            f"its checkpoints to {found} (train.ckpt_path={earlier}): resume with that "
            "train.ckpt_path, or start again with train.overwrite=true"
        )


def _lock_run(out_dir: Path, ckpt_path: Path) -> tuple[list, str]:
    """Exclusive ``flock`` locks on ``out_dir/run.lock`` and ``<checkpoint>.lock``, held while
    the returned files stay open (the process's end releases them): a second run started into
    the same directory, or onto the same checkpoint (from any directory), while this one
    writes there fails at start-up, before the trainer writes its files (Hydra has rewritten
    the directory's ``.hydra/`` by then). Returns the open files and "" or, when another
    process holds a lock, no files and a message naming it. Where ``flock`` is missing (not
    POSIX) the run goes on unlocked; where a lock file cannot be made or the file system
    refuses the lock, too, with a warning."""
    try:
        import fcntl
    except ImportError:
        return [], ""
    held = []
    for path in (out_dir / "run.lock", ckpt_path.with_name(ckpt_path.name + ".lock")):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = path.open("a")
        except OSError as error:  # the run's own writes will say more, on rank 0
            log.warning("run not locked (%s): %s", path, error)
            continue
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            for g in [f, *held]:
                g.close()
            return [], (
                f"another run is writing here ({path} is locked by a running process): wait "
                "for it to end or stop it before resuming, or use another hydra.run.dir"
            )
        except OSError as error:  # e.g. ENOLCK on a file system without locks
            log.warning("run not locked (%s): %s", path, error)
            f.close()
            continue
        held.append(f)
    return held, ""


def _checkpoint_to_resume(
    cfg: DictConfig, path: Path, out_dir: Path, world_size: int
) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (in ``out_dir``'s run, unless ``train.ckpt_path`` is
    absolute) that ``train.resume=true`` continues, or None to start at step 0 (no checkpoint
    there, or ``train.overwrite=true``).

    Raises:
        FileExistsError: ``path`` exists and neither train.resume nor train.overwrite is set.
        FileNotFoundError: train.resume, no checkpoint at ``path``, but one where the
            directory's earlier run saved them (``_check_no_checkpoint_elsewhere``).
        ValueError: the checkpoint's config differs from ``cfg`` (outside ``RUN_CONDUCT_KEYS``).
    """
    t = cfg.train
    if not path.exists():
        if t.resume:
            _check_no_checkpoint_elsewhere(path, out_dir)
            log.info("train.resume: no checkpoint at %s, starting from step 0", path)
        return None
    if t.overwrite:
        log.info("train.overwrite: starting from step 0; %s is removed", path)
        return None
    if not t.resume:
        raise FileExistsError(
            f"{path} holds the checkpoint of an earlier run: train.resume=true continues it, "
            "train.overwrite=true starts again and replaces it (and its metrics), or choose "
            "another output directory"
        )
    ckpt = load_checkpoint(path)
    if "config" not in ckpt:
        log.warning("%s holds no config (an older run): resuming it unchecked", path)
        return ckpt
    # The data's paths are compared resolved (below), where the checkpoint has them: the same
    # file named from another directory, or by its absolute path, is the same data.
    resolved = DATA_PATH_KEYS if "data_paths" in ckpt else ()
    changed, one_sided = config_changes(
        ckpt["config"],
        OmegaConf.to_container(cfg, resolve=True),
        lambda key: _defines_the_run(key) and not is_under(key, resolved),
        defaults=schema_defaults(ckpt["config"]),
    )
    if changed:
        raise ValueError(
            f"train.resume=true: {path} was trained with another config (saved -> now):\n  "
            + "\n  ".join(changed)
            + "\nResume with the same config, or start the new one in another output directory"
        )
    saved_world = ckpt.get("world_size", world_size)  # absent from older checkpoints
    if saved_world != world_size:
        raise ValueError(
            f"train.resume=true: {path} was trained on {saved_world} processes of "
            f"train.batch_size={cfg.train.batch_size} rows, this launch has {world_size}: the "
            f"global batch, and the rows each step reads, would change; launch {saved_world}"
        )
    paths = _data_paths(cfg)
    saved_paths = ckpt.get("data_paths", paths)  # absent from older checkpoints
    if saved_paths != paths:
        raise ValueError(
            f"train.resume=true: {path} was trained on the data at {saved_paths}, this launch "
            f"reads {paths} (relative data paths resolve against the directory train.py starts "
            "in): launch from where the run started, or give the paths it read"
        )
    if one_sided:
        log.warning(
            "resuming %s, whose config lacks or has keys this code's does not (a config field "
            "added or removed since): %s",
            path,
            "; ".join(one_sided),
        )
    return ckpt


def _check_attention_group(attention: DictConfig) -> None:
    """``attention.name`` names the attention of its config group's schema: ``attention=rope
    attention.name=nope`` would train NoPE and silently drop the group's theta and scaling,
    and ``attention.name=corope`` over RoPE's group would fail deep in the model."""
    schema = OmegaConf.get_type(attention)
    expected = ATTENTION_SCHEMAS[attention.name]
    if schema in ATTENTION_SCHEMAS.values() and schema is not expected:
        group = next(name for name, cls in ATTENTION_SCHEMAS.items() if cls is schema)
        raise ValueError(
            f"attention.name={attention.name} over the config group of {group} (its options are "
            f"{schema.__name__}'s): select the group instead (attention={attention.name})"
        )


def _check_sweep_ckpt_path(ckpt_path: str | None) -> None:
    """An absolute ``train.ckpt_path`` in a multirun would be one file for every job: each
    job would replace (``train.overwrite``) or resume (``train.resume``) the one before."""
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun and ckpt_path and Path(ckpt_path).is_absolute():
        raise ValueError(
            f"train.ckpt_path={ckpt_path} is absolute in a multirun: every job would write that "
            "file; give a path relative to the job's output directory"
        )


def _check_options(cfg: DictConfig) -> None:
    """ValueError (TypeError) naming the first loop or optimizer option out of range, an
    unknown attention, and keys no schema declares, before any data is loaded."""
    if unknown := unknown_keys(cfg):
        raise ValueError(
            f"unknown config keys {unknown} (added with '+'): no schema declares them, so the "
            "run would ignore them; check their spelling (lm/config.py, configs/)"
        )
    attention_class(cfg.attention)
    _check_attention_group(cfg.attention)
    _check_sweep_ckpt_path(cfg.train.ckpt_path)
    t, optim = cfg.train, cfg.optim
    for key in ("steps", "batch_size", "eval_batch_size", "grad_accum_steps"):
        check_int(f"train.{key}", t[key], 1)
    if t.batch_size % t.grad_accum_steps:
        raise ValueError(
            f"train.grad_accum_steps={t.grad_accum_steps} must divide train.batch_size="
            f"{t.batch_size} (the rows each process runs per step)"
        )
    for key in ("log_every", "eval_every", "ckpt_every"):  # 0 = only at the end
        check_int(f"train.{key}", t[key], 0)
    if t.max_minutes is not None:
        _check_positive("train.max_minutes", t.max_minutes)
    if t.resume and t.overwrite:
        raise ValueError("train.resume=true and train.overwrite=true: pick one")
    if t.compile_mode not in COMPILE_MODES:
        raise ValueError(
            f"train.compile_mode must be one of {COMPILE_MODES}, got {t.compile_mode!r}"
        )
    if t.compile_mode != "default" and not t.compile:
        # else a sweep over the modes would time one eager run under each name
        raise ValueError(
            f"train.compile_mode={t.compile_mode} needs train.compile=true (the model is not "
            "compiled)"
        )
    _check_positive("optim.lr", optim.lr, FP32_MAX)
    check_int("optim.warmup_steps", optim.warmup_steps, 0)
    check_fraction("optim.min_lr_ratio", optim.min_lr_ratio, 0.0, 1.0)
    if not optim.grad_clip >= 0:  # NaN too
        raise ValueError(f"optim.grad_clip must be >= 0 (0 = no clipping), got {optim.grad_clip}")
    if not (math.isfinite(optim.weight_decay) and optim.weight_decay >= 0):
        raise ValueError(f"optim.weight_decay must be >= 0, got {optim.weight_decay}")
    for key in ("beta1", "beta2"):  # 1 would divide Adam's bias correction by 0
        _check_below_one(f"optim.{key}", optim[key])
    _check_positive("optim.eps", optim.eps, FP32_MAX)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", t.device):
        raise ValueError(f"train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}")
    if t.cpu_threads is not None:  # null: torch's default
        check_int("train.cpu_threads", t.cpu_threads, 1)
    m = cfg.model
    for key in ("d_model", "n_layer", "n_head", "n_kv_head"):
        check_int(f"model.{key}", m[key], 1)
    if m.mlp_hidden is not None:  # null: 8/3 d_model
        check_int("model.mlp_hidden", m.mlp_hidden, 1)
    if m.get("head_dim") is not None:  # null: d_model / n_head
        check_int("model.head_dim", m.head_dim, 1)
    _check_below_one("model.dropout", m.dropout)
    for key in ("norm_eps", "init_std"):
        _check_positive(f"model.{key}", m[key])
    if cfg.attention.get("chunk_size") is not None:  # null: automatic
        check_int("attention.chunk_size", cfg.attention.chunk_size, 1)


def _check_below_one(name: str, value: float) -> None:
    """ValueError (TypeError) naming ``name`` unless ``value`` is a number in [0, 1)."""
    if check_fraction(name, value, 0.0, 1.0) == 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


# The optimizer multiplies fp32 parameters by its hyperparameters: past this, PyTorch fails at
# the first step without naming the option.
FP32_MAX = torch.finfo(torch.float32).max


def _check_positive(name: str, value: float, below: float = math.inf) -> None:
    """ValueError naming ``name`` unless ``value`` is a finite number above 0 (and below
    ``below``)."""
    if not (math.isfinite(value) and 0 < value < below):
        limit = f" below {below:.3g}" if below < math.inf else ""
        raise ValueError(f"{name} must be a positive number{limit}, got {value}")


def _is_number(value: Any) -> bool:
    """A real number a sweeper can rank by (not a bool, a string or None)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _eval_keys(dataset) -> list[str]:
    """The keys of ``evaluate``'s metrics: ``<split>/<metric>``."""
    return [f"{s}/{m}" for s in dataset.eval_splits() for m in metric_names(dataset.kind)]


def _summaries(dataset) -> dict[str, str]:
    """What wandb's run summary keeps per metric: the best loss, the final others."""
    return {key: "min" if key.endswith("/loss") else "last" for key in _eval_keys(dataset)}


def _clear_outcome(out_dir: Path) -> None:
    """Removes an earlier run's ``summary.json`` and ``failed.json`` (overwritten or resumed),
    so that either belongs to the run that last got that far: a run killed before its end
    has neither, and collect.py reads it from ``metrics.jsonl`` as stopped early."""
    for name in ("summary.json", "failed.json"):
        (out_dir / name).unlink(missing_ok=True)


def _hardware(info) -> dict[str, Any]:
    """What the run ran on, beyond its config: the number of processes (each takes
    ``train.batch_size`` rows) and the device's name (the GPU's, or ``cpu``): collect.py
    keeps runs that differ in them apart."""
    cuda = info.device.type == "cuda"
    name = torch.cuda.get_device_name(info.device) if cuda else info.device.type
    return {"world_size": info.world_size, "device_name": name}


def _write_run_record(out_dir: Path, run_config: dict, launch_dir: str, info) -> None:
    """``run.json``: what the run in ``out_dir`` is (its resolved config and overrides, the
    directory it started in, its ``_hardware``), for collect.py to read a run stopped before
    its summary. Written once the run has passed its checks, unlike Hydra's ``.hydra/``,
    which a refused launch into the same directory (another grid's job, a resume with another
    config) has already rewritten with its own."""
    # launch_dir: lm.trained rebuilds the data from it, for checkpoints without their own
    record = {
        "config": run_config,
        "overrides": _overrides(),
        "launch_dir": launch_dir,
        **_hardware(info),
    }
    write_json(out_dir / "run.json", record)


class _Jsonl:
    """``metrics.jsonl``; on resume it keeps only the records up to the checkpoint's step,
    less those of a train.max_minutes stop off the schedule, so the file reads as one
    uninterrupted run."""

    def __init__(self, path: Path, keep_until: int | None) -> None:
        self.path = path
        # The last step the file recorded before this run: the logger's service has it too
        self.recorded_through: int | None = None
        self.kept: list[dict] = []  # the records a resume keeps
        if keep_until is not None and path.exists():
            records = read_jsonl(path)
            self.recorded_through = max((r["step"] for r in records), default=None)
            kept = self.kept = [
                r
                for r in records
                if r["step"] <= keep_until and not r.get("stopped_early")  # _Run._record
            ]
            text = "".join(json.dumps(r) + "\n" for r in kept)
            replace_atomically(path, lambda tmp: tmp.write_text(text))
        elif path.exists():
            path.unlink()

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class _LoggedSteps:
    """``logged.json``: the last step of each kind of record (``"train"``, ``"eval"``) that
    the logger's service run (wandb's, by its id) holds, so that a resume into that run logs
    only what it lacks. metrics.jsonl cannot tell: every start cuts it back to the
    checkpoint's step (killed twice before the first kill's step, a resume logged those steps
    again), and a step's training and evaluation are two records (killed during an
    evaluation, the resume skipped that step's evaluation, its training record being in the
    file). Written only for a logger with a run id, and kept for that id: a start with
    another logger (none, say) leaves it for a later resume into that run. A resume of a run
    from before this file, or whose file cannot be read, takes the last step in its old
    metrics.jsonl for both kinds."""

    def __init__(self, path: Path, run_id: str | None, resumed: bool, recorded_through) -> None:
        self.path, self.run_id = path, run_id
        self.through: dict[str, int] = {}
        if resumed:
            stored = self._read()
            if stored.get("run_id") == run_id:
                self.through = stored["through"]
            elif recorded_through is not None:
                self.through = {"train": recorded_through, "eval": recorded_through}

    def _read(self) -> dict:
        try:
            stored = json.loads(self.path.read_text())
            if not all(isinstance(v, int) for v in stored["through"].values()):
                raise ValueError(f"steps that are not ints: {stored['through']}")
            return stored
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # a crash mid-write
            log.warning(
                "%s is unreadable (%s): the resume logs from metrics.jsonl", self.path, error
            )
            return {}

    def has(self, kind: str, step: int) -> bool:
        return step <= self.through.get(kind, 0)

    def add(self, kind: str, step: int) -> None:
        self.through[kind] = step
        if self.run_id is not None:
            text = json.dumps({"run_id": self.run_id, "through": self.through})
            replace_atomically(self.path, lambda tmp: tmp.write_text(text), sync=False)


def train(cfg: DictConfig, output_dir: str | None = None) -> dict[str, Any]:
    """Trains the model ``cfg`` describes; returns the summary metrics (also ``summary.json``).

    Args:
        cfg: the composed root config (``configs/train.yaml``, schema ``lm.config.TrainConfig``).
        output_dir: where logs and checkpoints go; default: Hydra's run directory.

    Raises:
        ValueError, TypeError: an option out of range (naming it), an unknown ``metric``, a DDP
            rank reading other tokens than rank 0 (every rank raises), or ``train.resume=true``
            with a config, a number of processes, data paths or tokens (the data's digest) other
            than the checkpoint's; before the trainer writes anything (Hydra has rewritten the
            directory's ``.hydra/`` records by then).
        FileExistsError: the output directory holds a checkpoint and neither
            ``train.resume`` nor ``train.overwrite`` is set; as early.
        FloatingPointError: a non-finite loss or gradient norm, naming the step; the last
            checkpoint (from an earlier step) is kept. Any error of the loop also writes
            ``failed.json``; a start removes an earlier run's ``summary.json`` and ``failed.json``.
    """
    _check_options(cfg)
    threads = torch.get_num_threads()  # train.cpu_threads: this run's only (a sweep's next
    try:  # job with null gets torch's default again)
        with deterministic_algorithms(cfg.train.deterministic):
            return _train(cfg, output_dir)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: DictConfig, output_dir: str | None) -> dict[str, Any]:
    """``train``'s run, its options checked."""
    info = distributed.setup(cfg.train.device)
    finished = False
    run = None
    locks = []
    try:
        out_dir = Path(distributed.broadcast(str(_output_dir(output_dir)), info))
        ckpt_path = checkpoint_path(cfg.train.ckpt_path, out_dir)
        # Rank 0 writes the run's files: it locks them, and every rank fails if it cannot.
        locks, taken = _lock_run(out_dir, ckpt_path) if info.rank == 0 else ([], "")
        if taken := distributed.broadcast(taken, info):
            raise FileExistsError(taken)
        # before the data loads
        ckpt = _checkpoint_to_resume(cfg, ckpt_path, out_dir, info.world_size)
        check_attention_config(cfg.attention, cfg.model, info.device)
        if info.device.type == "cpu" and cfg.train.cpu_threads is not None:
            torch.set_num_threads(cfg.train.cpu_threads)
        torch.manual_seed(cfg.seed)
        dataset = build_dataset(cfg.data)
        model = GPT(cfg.model, cfg.attention, dataset.vocab_size, dataset.max_len).to(info.device)
        run = _Run(cfg, info, out_dir, dataset, model, ckpt_path, ckpt)
        try:
            summary = run.loop()
            finished = True
            return summary
        except BaseException as error:
            # A killed run (KeyboardInterrupt, SystemExit) stopped early; only an error failed it
            if isinstance(error, Exception):
                run.write_failure(error)
            if run.logger is not None:
                run.logger.abort()
            raise
    finally:
        if info.world_size > 1:
            # The DDP wrapper holds the process group. Freed on this function's return, after
            # the group's destruction, it hung at times in gloo's teardown on a rank whose
            # peer had exited (2 of 40 two-rank CPU runs; CI's hang looked the same): free it first, while
            # every rank is alive. An error's traceback holds it too (the frames of DDP's
            # forward): their locals are cleared, their lines still print.
            if run is not None:
                run.ddp = None
            error = sys.exc_info()[1]
            if error is not None:
                traceback.clear_frames(error.__traceback__)
            gc.collect()
        for f in locks:
            f.close()
        distributed.teardown(synchronize=finished)


class _Run:
    """The state of one training run; ``loop()`` runs it to the end.

    Args:
        cfg: the root config; info: this process's ``distributed.DistInfo``.
        out_dir: the run's output directory (rank 0's on every rank).
        dataset, model: what to train on and what to train (on ``info.device``).
        ckpt_path: where the checkpoints go; ckpt: the checkpoint to resume from, or None.
    """

    def __init__(
        self,
        cfg: DictConfig,
        info,
        out_dir: Path,
        dataset,
        model: GPT,
        ckpt_path: Path,
        ckpt: dict[str, Any] | None,
    ) -> None:
        self.cfg, self.info, self.out_dir = cfg, info, out_dir
        self.dataset, self.model = dataset, model
        self.t = cfg.train
        self.opt, self.sched = build_optimizer(model, cfg.optim, self.t.steps)
        self.ckpt_path = ckpt_path
        self.run_config = OmegaConf.to_container(cfg, resolve=True)
        self.step = 0
        # Carried through checkpoints, so a resumed run reports the whole run's speed.
        self.state = {
            "best_val_loss": math.inf,
            # The split best_val_loss is measured on (the first eval split): a checkpoint of a
            # run that measured it on another (synthetic tasks before their valid split) starts
            # it again on resume rather than mixing the two.
            "best_val_split": dataset.eval_splits()[0],
            "train_s": 0.0,
            "attn_s": 0.0,
            # train_s of the steps whose attention was timed (train.time_attention may change
            # on resume): attn_time_frac's denominator
            "attn_train_s": 0.0,
            "timed_steps": 0,
            "timed_tokens": 0,
            # The largest CUDA memory allocated during a timed step (evaluation left out)
            "peak_mem_bytes": 0,
            # Training losses since the last log line: a resumed run logs the same averages.
            "pending_losses": [],
            # The logger's run (wandb's id): a resumed run logs into the same one.
            "logger_run_id": None,
        }
        self.last_ckpt_step: int | None = None
        # What every checkpoint records the run read: the data's paths and a digest of its tokens
        self.data_paths = _data_paths(cfg)
        # Where the config's relative paths resolve, which every checkpoint records for
        # lm.trained (run.json's is rewritten at every launch, and a resume may start
        # elsewhere): Hydra's original directory (with hydra.job.chdir=true the process is in
        # out_dir by now)
        self.launch_dir = str(resolve_path("."))
        self.data_fingerprint = self._same_data_on_every_rank(dataset.fingerprint())
        self.stopped_early = False
        if ckpt is not None:
            self._resume(ckpt)
        # A multirun's jobs share the process: dynamo's graphs of earlier jobs count toward its
        # recompile limit (8), past which it runs the forward eagerly, and their CUDA graphs
        # hold their memory pool, into an eager job too: forgotten.
        torch._dynamo.reset()
        model.activation_checkpointing = self.t.activation_checkpointing
        if self.t.compile:
            # nn.Module.compile: the same module and state_dict, its calls through
            # torch.compile; the first evaluations compile their shapes too (then dynamic).
            model.compile(mode=self.t.compile_mode)
        self._cudagraphs = (
            self.t.compile and self.t.compile_mode in CUDAGRAPH_MODES and info.device.type == "cuda"
        )
        self._untimed_steps = 2 if self._cudagraphs else 1
        # The timer's stamps would break the compiled graph at every attention layer
        timed = self.t.time_attention and not self.t.compile
        if self.t.time_attention and not timed and info.main:
            log.info("train.compile=true: attention is not timed (attn_time_frac is null)")
        self.timer = AttentionTimer(info.device) if timed else None
        for block in model.blocks:
            block.attn.timer = self.timer
        self._check_metric()  # before anything is written
        self.logger = None
        if info.main:
            out_dir.mkdir(parents=True, exist_ok=True)
            # The logger first: one that cannot start (a bad mode, no account) fails the
            # launch before the directory's earlier run loses any file.
            self.logger = instantiate(
                cfg.logger,
                run_dir=str(out_dir),
                name=_run_name(out_dir),
                group=cfg.name,
                tags=_overrides(),
                run_config=self.run_config,
                summaries=_summaries(dataset),
                run_id=self.state.get("logger_run_id"),  # absent from older checkpoints
                _recursive_=False,
                _convert_="all",  # run_config holds _target_ keys: keep them as data
            )
            # Resumed into the same service run (wandb's), the steps the killed run logged
            # after its checkpoint are there already: logged again, each would appear twice.
            resumed_run = self.logger.run_id is not None and (
                self.logger.run_id == self.state.get("logger_run_id")
            )
            if self.logger.run_id is not None:  # a start with none keeps the service run's id
                self.state["logger_run_id"] = self.logger.run_id
            _clear_outcome(out_dir)
            if self.t.overwrite:
                # Replaced now, not at the first save: a run killed before that save would
                # leave the old run's weights for a later resume to continue under its metrics.
                ckpt_path.unlink(missing_ok=True)
            _write_run_record(out_dir, self.run_config, self.launch_dir, info)
            self.jsonl = _Jsonl(out_dir / "metrics.jsonl", None if ckpt is None else self.step)
            self.logged = _LoggedSteps(
                out_dir / "logged.json", self.logger.run_id, resumed_run,
                self.jsonl.recorded_through,
            )  # fmt: skip
            if resumed_run:
                # A start without the service (logger=none) may have checkpointed steps that
                # its run lacks: they come from metrics.jsonl, each once.
                for record in self.jsonl.kept:
                    kind = "train" if "train/loss" in record else "eval"
                    if not self.logged.has(kind, record["step"]):
                        metrics = {k: v for k, v in record.items() if k != "step"}
                        self.logger.log(metrics, record["step"])
                        self.logged.add(kind, record["step"])
        # Last: a check above that fails leaves no DDP wrapper behind (see train()'s finally).
        self.ddp = (
            DistributedDataParallel(
                model, device_ids=[info.device] if info.device.type == "cuda" else None
            )
            if info.world_size > 1
            else model
        )

    def _same_data_on_every_rank(self, fingerprint: str | None) -> str | None:
        """The digest of the tokens, once every rank has checked that it reads rank 0's: each
        process reads its own copy of the data (a node's files may differ), and a rank that
        raised alone would leave the others waiting in their next collective."""
        digests = distributed.gather(fingerprint, self.info)
        other = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if other:
            raise ValueError(
                f"ranks {other} read other tokens than rank 0 from the same config (data "
                f"digests by rank: {', '.join(map(str, digests))}): give every process the "
                "same data files"
            )
        return fingerprint

    def _check_metric(self) -> None:
        """``metric`` (what train.py returns to sweepers) must be a key of the summary whose
        value will be a number in this run (on this device; a speed field with a timed step; the
        attention's share with the attention timed): a sweeper given a string, a list or None
        would rank runs by it, or fail at the end of the first."""
        # The summary's keys and kinds from the function that makes it, the evaluation's
        # values aside; the speed figures are None until a step is timed
        summary = self._summary(dict.fromkeys(_eval_keys(self.dataset), math.nan))
        numeric = [k for k, v in summary.items() if _is_number(v)]
        device = self.info.device
        # A step of this start is timed past its untimed first one(s) (counted from the step
        # it resumes at), or one of an earlier start was; attention's share where the timer
        # runs (not under train.compile, nor with train.time_attention=false) or ran
        timed_now = self.t.steps - self.step > self._untimed_steps
        timed = timed_now or self.state["timed_steps"] > 0
        speed = ["tokens_per_s", "step_ms"] if timed else []
        if timed and peak_bf16_flops(device) is not None:
            speed.append("mfu")
        if timed and device.type == "cuda":
            speed.append("peak_mem_mib")
        attention_timed = timed_now and self.timer is not None
        if attention_timed or self.state["attn_train_s"] > 0:
            speed.append("attn_time_frac")
        numeric += [k for k in speed if k not in numeric]
        if self.cfg.metric not in numeric:
            why = (
                "is not a key of the run's summary"
                if self.cfg.metric not in summary
                else "is a key of the run's summary that holds no number in this run (its "
                "device, steps and timing options)"
            )
            raise ValueError(f"metric={self.cfg.metric!r} {why}: pick one of {', '.join(numeric)}")

    def _resume(self, ckpt: dict[str, Any]) -> None:
        saved = ckpt.get("data_fingerprint", self.data_fingerprint)  # absent: older checkpoints
        if saved != self.data_fingerprint:
            raise ValueError(
                f"train.resume=true: {self.ckpt_path} was trained on other tokens than this "
                f"launch reads from the same config and paths (data digest {saved} -> "
                f"{self.data_fingerprint}): a data file changed, or the Python stdlib, or the "
                "Hub dataset's revision; resume with the data the run started on, or start the "
                "new data in another output directory"
            )
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        set_rng_state(ckpt["rng"])
        self.step = self.last_ckpt_step = ckpt["step"]
        split = self.state["best_val_split"]
        self.state = ckpt["state"]
        self.state.setdefault("peak_mem_bytes", 0)  # checkpoints from before the key
        self.state.setdefault("attn_train_s", self.state["train_s"])  # as they computed it
        # Checkpoints from before the key: the synthetic tasks' first split was then "test".
        before = "test" if isinstance(self.dataset, SyntheticTask) else split
        if self.state.setdefault("best_val_split", before) != split:
            log.warning(
                "resuming %s: its best_val_loss (%.4g) was measured on split %r, this run's "
                "first split is %r; best_val_loss starts again from this run's evaluations",
                self.ckpt_path,
                self.state["best_val_loss"],
                self.state["best_val_split"],
                split,
            )
            self.state.update(best_val_loss=math.inf, best_val_split=split)
        log.info("resumed from %s at step %d", self.ckpt_path, self.step)

    def _save(self, state_changes: dict | None = None) -> None:
        """The checkpoint, its trainer state updated by ``state_changes`` (the values a resume
        must start from, where they differ from this run's own)."""
        if self.info.main:
            save_checkpoint(
                self.ckpt_path,
                {
                    "model": self.model.state_dict(),
                    "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(),
                    "rng": rng_state(),
                    "step": self.step,
                    "state": {**self.state, **(state_changes or {})},
                    "config": self.run_config,
                    "world_size": self.info.world_size,
                    "data_paths": self.data_paths,
                    "data_fingerprint": self.data_fingerprint,
                    "launch_dir": self.launch_dir,
                },
            )
        self.last_ckpt_step = self.step

    def _record(self, metrics: dict[str, float], kind: str, off_schedule: bool = False) -> None:
        """``metrics``, a record of ``kind`` (``"train"`` or ``"eval"``) at this step, into
        metrics.jsonl and the logger (unless a resumed service run has it: ``self.logged``);
        ``off_schedule`` (a train.max_minutes stop's log or evaluation) marks the record for a
        resume to drop."""
        extra = {"stopped_early": True} if off_schedule else {}
        _STOP["recording"] = True
        try:
            self.jsonl.write({"step": self.step, **metrics, **extra})
            if not self.logged.has(kind, self.step):
                self.logger.log(metrics, self.step)
                self.logged.add(kind, self.step)
        finally:
            # A stop that came while recording ends the run now, even where the record failed
            # (whose error becomes its __context__): never a stale stop for the next run in
            # this process (a sweep's next job).
            _STOP["recording"] = False
            stop, _STOP["exit"] = _STOP["exit"], None
            if stop is not None:
                raise stop

    def _train_step(self) -> tuple[float, int]:
        """One optimizer step; returns (the global batch's loss, tokens in the global batch).

        The rank's rows run as ``train.grad_accum_steps`` micro-batches whose gradients add
        up to the whole batch's: the same step as one pass, up to rounding, in less memory.
        """
        t, info = self.t, self.info
        # Dropout's masks from a seed of (seed, step, rank): each rank draws its own (one seed
        # for all gave every rank the same masks), and a resumed run draws the masks of the
        # uninterrupted one on every rank (a checkpoint holds rank 0's RNG state only).
        torch.manual_seed(step_seed(self.cfg.seed, self.step, info.rank))
        x, y = self.dataset.train_batch(self.step, t.batch_size, info.rank, info.world_size)
        x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
        # The mean over the global batch's target tokens, as one process would compute it,
        # however they fall between the ranks and micro-batches (a flip-flop row has as many
        # as it has reads): each micro-batch's sum over the global count, times world_size as
        # DDP averages gradients.
        targets = distributed.all_sum((y != IGNORE_INDEX).sum(), info)
        self.opt.zero_grad(set_to_none=True)
        summed = torch.zeros((), device=info.device)
        micro_batches = zip(x.chunk(t.grad_accum_steps), y.chunk(t.grad_accum_steps), strict=True)
        for i, (x_micro, y_micro) in enumerate(micro_batches):
            # DDP all-reduces the accumulated gradients once, in the last micro-batch's backward
            last = i == t.grad_accum_steps - 1
            sync = last or self.ddp is self.model
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with autocast(info.device):
                    logits = self.ddp(x_micro)  # (batch_size / grad_accum_steps, L, V)
                part = F.cross_entropy(
                    logits.float().flatten(0, 1),
                    y_micro.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                (part / targets * info.world_size).backward()
            if self._cudagraphs and i == 0 and not last:
                # The backward graph's outputs live in its pool, and .grad took them: the next
                # micro-batch's replay would overwrite them before they are added to (the
                # later micro-batches add into these copies)
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad = p.grad.clone()
            summed += part.detach()
        loss_value = (distributed.all_sum(summed, info) / targets).item()
        if not math.isfinite(loss_value):
            self._fail(f"loss is {loss_value}")
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        if not math.isfinite(grad_norm):
            self._fail(f"gradient norm is {grad_norm}")
        self.grad_norm = grad_norm  # before clipping: logged with the loss
        self.opt.step()
        self.lr = self.sched.get_last_lr()[0]  # the rate this step used, before the schedule moves
        self.sched.step()
        self.step += 1
        return loss_value, x.numel() * info.world_size

    def _fail(self, what: str) -> None:
        kept = (
            f"the last good checkpoint is {self.ckpt_path} (step {self.last_ckpt_step})"
            if self.last_ckpt_step is not None
            else "no checkpoint was written yet"
        )
        raise FloatingPointError(f"{what} at step {self.step + 1}; stopping: {kept}")

    def _eval(self) -> dict[str, float]:
        if self.timer:  # the attention share is of the training steps only
            self.timer.enabled = False
        metrics = evaluate(self.model, self.dataset, self.t.eval_batch_size, self.info.device)
        if self.timer:
            self.timer.enabled = True
        first = self.dataset.eval_splits()[0]
        loss = metrics[f"{first}/loss"]
        # min() would keep an earlier loss over a NaN: a diverged run would rank by its past
        best = self.state["best_val_loss"]
        self.state["best_val_loss"] = loss if math.isnan(loss) else min(best, loss)
        return metrics

    def loop(self) -> dict[str, Any]:
        t, info = self.t, self.info
        if self.timer:
            self.timer.enabled = True
        bar = tqdm(
            total=t.steps,
            initial=self.step,
            disable=not (info.main and t.progress),
            desc="train",
            dynamic_ncols=True,
            mininterval=1.0,
        )
        first_step = self.step
        cuda = info.device.type == "cuda"
        losses = self.state.setdefault("pending_losses", [])
        eval_metrics: dict[str, float] = {}
        deadline = None if t.max_minutes is None else time.monotonic() + 60 * t.max_minutes
        with logging_redirect_tqdm():
            while self.step < t.steps:
                if cuda:  # the step's own peak, not an evaluation's or the first step's
                    torch.cuda.reset_peak_memory_stats(info.device)
                start = time.perf_counter()
                loss, tokens = self._train_step()  # its .item() calls synchronise the GPU
                seconds = time.perf_counter() - start
                attn_s = self.timer.pop_seconds() if self.timer else 0.0
                # The first step pays for compilation and warm-up; under CUDA graphs the second
                # records them (the third is the first replay)
                timed = self.step > first_step + self._untimed_steps
                if timed:
                    self.state["train_s"] += seconds
                    self.state["attn_s"] += attn_s
                    self.state["attn_train_s"] += seconds if self.timer else 0.0
                    self.state["timed_steps"] += 1
                    self.state["timed_tokens"] += tokens
                # A CUDA graph's replay allocates nothing (its tensors live in the graphs'
                # pool): there the steps that warm up and record the graphs hold the memory
                if cuda and (timed or self._cudagraphs):
                    peak = torch.cuda.max_memory_allocated(info.device)
                    self.state["peak_mem_bytes"] = max(self.state["peak_mem_bytes"], peak)
                losses.append(loss)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                if deadline is not None and self.step < t.steps:
                    # rank 0's clock decides, so every rank leaves the loop at the same step
                    self.stopped_early = distributed.broadcast(time.monotonic() >= deadline, info)
                last = self.step == t.steps or self.stopped_early
                scheduled_log = bool(t.log_every) and self.step % t.log_every == 0
                scheduled_eval = bool(t.eval_every) and self.step % t.eval_every == 0
                # A stop for train.max_minutes logs and evaluates off the schedule, for the
                # stopped run's summary; its checkpoint keeps what the schedule would have (the
                # losses still to log, best_val_loss without that evaluation) and the resume
                # drops its records, so a resumed run logs and reports the uninterrupted one's.
                resume_state = {}  # where this step's checkpoint differs from the run's state
                if self.stopped_early and not scheduled_log:
                    resume_state["pending_losses"] = list(losses)
                if self.stopped_early and not scheduled_eval:
                    resume_state["best_val_loss"] = self.state["best_val_loss"]
                if info.main and (scheduled_log or last):
                    speed = self._speed() if self.state["timed_steps"] else {}  # none timed yet
                    record = {
                        "train/loss": sum(losses) / len(losses),
                        "train/grad_norm": self.grad_norm,
                        "lr": self.lr,
                        **speed,
                    }
                    self._record(record, "train", self.stopped_early and not scheduled_log)
                    losses.clear()
                if last or scheduled_eval:
                    if info.main:
                        eval_metrics = self._eval()
                        self._record(
                            eval_metrics, "eval", self.stopped_early and not scheduled_eval
                        )
                    self.state["best_val_loss"] = distributed.broadcast(
                        self.state["best_val_loss"], info
                    )
                if last or (t.ckpt_every and self.step % t.ckpt_every == 0):
                    self._save(resume_state)
                if self.stopped_early:
                    log.info("train.max_minutes=%s reached at step %d", t.max_minutes, self.step)
                    break
        bar.close()
        if not info.main:
            return {}
        if not eval_metrics:  # resumed a finished run: evaluate the saved model
            eval_metrics = self._eval()
        return self._finish(eval_metrics)

    def _speed(self) -> dict[str, float | None]:
        """The speed figures (module docstring) over the timed steps; None where the device
        has no such figure, and before the first timed step."""
        s, info = self.state, self.info
        timed = s["timed_steps"] > 0
        tokens_per_s = s["timed_tokens"] / s["train_s"] if timed else None
        peak = peak_bf16_flops(info.device)
        mfu = None
        if peak is not None and timed:
            cfg = self.cfg.model
            seq_len = s["timed_tokens"] / (s["timed_steps"] * self.t.batch_size * info.world_size)
            attn = self.model.blocks[0].attn
            windows = [block.attn.window for block in self.model.blocks]
            flops = model_flops_per_token(
                self.model.matmul_params(), cfg.n_layer, attn.n_head * attn.head_dim, seq_len,
                windows,
            )  # fmt: skip
            mfu = flops * tokens_per_s / (peak * info.world_size)
        return {
            "tokens_per_s": tokens_per_s,
            "step_ms": 1e3 * s["train_s"] / s["timed_steps"] if timed else None,
            "attn_time_frac": s["attn_s"] / s["attn_train_s"] if s["attn_train_s"] else None,
            "mfu": mfu,
            "peak_mem_mib": s["peak_mem_bytes"] / 2**20
            if info.device.type == "cuda" and timed
            else None,
        }

    def _summary(self, eval_metrics: dict[str, float]) -> dict[str, Any]:
        """The run's summary: ``eval_metrics`` (``evaluate``'s), the speed and run facts."""
        first = self.dataset.eval_splits()[0]
        impl = self.cfg.attention.get("impl")
        return {
            **eval_metrics,
            "val_loss": eval_metrics[f"{first}/loss"],
            "best_val_loss": self.state["best_val_loss"],
            **self._speed(),
            "steps": self.step,
            "stopped_early": self.stopped_early,
            "params": sum(p.numel() for p in self.model.parameters()),
            "attention": self.cfg.attention.name,
            "attention_config": _config_choice("attention", self.cfg.attention.name),
            "attention_impl": resolve_impl(impl, self.info.device, self.cfg.attention.name)
            if impl
            else None,
            "data": self.cfg.data.name,
            "seed": self.cfg.seed,
            "device": str(self.info.device),
            **_hardware(self.info),
            "overrides": _overrides(),
        }

    def write_failure(self, error: Exception) -> None:
        """Rank 0 writes ``failed.json``: the last step completed, the error's type and message
        (collect.py lists such runs instead of averaging them in)."""
        if not self.info.main:
            return
        failure = {"step": self.step, "error": type(error).__name__, "message": str(error)}
        write_json(self.out_dir / "failed.json", failure)

    def _finish(self, eval_metrics: dict[str, float]) -> dict[str, Any]:
        summary = self._summary(eval_metrics)
        write_json(self.out_dir / "summary.json", summary)
        self.logger.finish(summary)
        log.info("final | %s", _final_line(summary, self.dataset.eval_splits(), self.dataset.kind))
        return summary


def _final_line(summary: dict[str, Any], splits: list[str], kind: str) -> str:
    """The key metrics on one line: per split loss and accuracy (tasks: error rate), speed."""
    quality = "acc" if kind == "lm" else "err"
    parts = [f"step {summary['steps']}"]
    parts += [
        f"{s} loss {summary[f'{s}/loss']:.4f} {quality} {summary[f'{s}/{quality}']:.4f}"
        for s in splits
    ]
    if summary["tokens_per_s"] is not None:
        parts.append(f"{summary['tokens_per_s']:.0f} tok/s, {summary['step_ms']:.1f} ms/step")
        if summary["mfu"] is not None:
            parts.append(f"MFU {100 * summary['mfu']:.1f}%")
        if summary["attn_time_frac"] is not None:
            parts.append(f"attention {100 * summary['attn_time_frac']:.0f}% of the step")
    return " | ".join(parts)
