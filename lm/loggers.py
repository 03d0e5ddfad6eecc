"""Experiment loggers, built by ``hydra.utils.instantiate(cfg.logger, ...)`` on rank 0.

``metrics.jsonl`` and ``summary.json`` are written by the trainer whatever the logger;
a logger only mirrors them to a tracking service. Its ``run_id`` (None: no service) goes
into the checkpoint, and the trainer passes it back as ``run_id`` when the run resumes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class NullLogger:
    """``logger=none``: logs nowhere; takes (and ignores) ``WandbLogger``'s arguments."""

    run_id = None

    def __init__(self, **_: Any) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass

    def abort(self) -> None:
        pass


class WandbLogger:
    """One wandb run per training run (so per multirun job), resumed runs included.

    Args:
        project, entity, mode: wandb's; ``mode="offline"`` needs no account nor network
            (``wandb sync <run_dir>/wandb/offline-run-*`` uploads later; a resumed run
            adds an offline directory with the same run id).
        run_dir: the Hydra output directory; wandb writes under ``run_dir/wandb``.
        name: the run's name; group: the experiment name; tags: the command-line overrides.
        run_config: the resolved config.
        summaries: metric name -> ``"min"``/``"max"``/``"last"``: what the run summary keeps.
        run_id: the id of the wandb run to continue (a resumed training run's); None: a
            new run with a new id. ``self.run_id`` is the run's id either way, but None in
            wandb's disabled mode (``mode="disabled"``, which ``configs/logger/wandb.yaml``
            takes from ``WANDB_MODE``), which sends nothing: as with ``logger=none``, a later
            start with the service logs the steps this one did not send.
    """

    def __init__(
        self,
        project: str,
        mode: str,
        run_dir: str,
        name: str,
        group: str,
        tags: list[str],
        run_config: dict,
        summaries: dict[str, str],
        entity: str | None = None,
        run_id: str | None = None,
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            dir=run_dir,
            name=name,
            group=group,
            tags=[t[:64] for t in tags],
            config=run_config,
            id=run_id,
            resume="allow",  # continue the run of that id if there is one
        )
        # disabled: a stand-in run whose id names no run the service holds
        self.run_id = None if self.run.settings.mode == "disabled" else self.run.id
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        for key, summary in summaries.items():
            self.run.define_metric(key, step_metric="step", summary=summary)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "step": step})

    def finish(self, summary: dict[str, Any]) -> None:
        """Adds the final metrics to the run summary and closes the run."""
        self.run.summary.update({f"final/{k}": v for k, v in summary.items()})
        offline = self.run.settings.mode == "offline"
        run_dir = Path(self.run.dir).parent
        self.run.finish()
        if offline:
            log.info("wandb offline run in %s (upload: wandb sync %s)", run_dir, run_dir)

    def abort(self) -> None:
        """Closes the run marked as failed (the training raised)."""
        self.run.finish(exit_code=1)
