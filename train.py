"""Train a small decoder with a swappable attention: ``python train.py attention=corope``.

Configs in ``configs/`` (root: ``configs/train.yaml``); the loop is ``lm.training.train``.
Returns ``cfg.metric`` from the run's summary, so Hydra sweepers (Optuna) can optimise it.
"""

import hydra
from omegaconf import DictConfig

from lm.config import register_configs
from lm.training import train

register_configs()


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return train(cfg).get(cfg.metric)


if __name__ == "__main__":
    main()
