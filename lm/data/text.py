"""Local plain-text files as a byte-level corpus: ``data=text data.files=[a.txt,b.txt]``.

The files are read in the given order into one stream (each followed by <eos>); the
last ``valid_fraction`` of the stream is the validation split ("valid@1x", "valid@2x",
"valid@4x"), the rest the training split. Relative paths are taken from the directory
the run was started in (Hydra's original working directory).
"""

from pathlib import Path

from hydra.utils import to_absolute_path

from lm.data.base import check_fraction
from lm.data.config import TextConfig
from lm.data.corpus import ByteCorpus, byte_stream


def resolve_path(path: str) -> Path:
    """``path`` made absolute against the directory the run was started in."""
    return Path(to_absolute_path(str(path)))


class TextCorpus(ByteCorpus):
    def __init__(self, cfg: TextConfig):
        if not cfg.files:
            raise ValueError("data.files is empty: use data=text data.files=[a.txt,b.txt]")
        valid = check_fraction("data.valid_fraction", cfg.valid_fraction, 0.0, 1.0)
        paths = [resolve_path(f) for f in cfg.files]
        for path in paths:
            if not path.is_file():
                raise FileNotFoundError(f"data.files: {path} is not a file (expected plain text)")
        stream = byte_stream(p.read_bytes() for p in paths)
        split = len(stream) - round(valid * len(stream))
        super().__init__(
            stream[:split], {"valid": stream[split:]}, cfg.seq_len, cfg.eval_samples, cfg.seed
        )
