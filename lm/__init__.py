"""The model and the training harness: ``lm.train(cfg)`` trains what ``configs/`` describes."""

from lm.training import train

__all__ = ["train"]
