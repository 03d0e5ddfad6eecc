"""Composing configs/ as ``python train.py`` does, for the harness tests."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lm.config import register_configs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# The smallest model and run that exercise every code path (head dim 32: the smallest the
# Co-RoPE kernels take, for the GPU run of the same tests).
TINY = [
    "model.d_model=64",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_kv_head=1",
    "train.batch_size=4",
    "train.eval_batch_size=16",
    "train.progress=false",
    "logger=none",
]


def compose_cfg(*overrides: str) -> DictConfig:
    """The root config composed with ``overrides``, as on the command line."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def wandb_offline_records(run_file: Path):
    """The protobuf records of an offline wandb run file (``offline-run-*/run-*.wandb``).

    Recent wandb versions keep an offline run's summary and config only in this file
    (a LevelDB-style log: a 7-byte file header, 32 KiB blocks, records split into chunks
    with a 7-byte header: crc32, little-endian length, kind 1 full / 2 first / 3 middle /
    4 last); reading it checks what ``wandb sync`` would upload.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    block, data = 32768, run_file.read_bytes()
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record
