"""The model and the training harness: ``lm.train(cfg)`` trains what ``configs/`` describes.

``train`` is imported on first use, so that light modules (``lm.config``, which
``experiments/collect.py`` reads) do not load torch and the trainer with the package."""

__all__ = ["train"]


def __getattr__(name: str):
    if name == "train":
        from lm.training import train

        return train
    raise AttributeError(f"module 'lm' has no attribute {name!r}")
