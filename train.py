"""Train a small decoder with a swappable attention: ``python train.py attention=corope``.

Configs in ``configs/`` (root: ``configs/train.yaml``); the loop is ``lm.training.train``.
Returns ``cfg.metric`` from the run's summary, so Hydra sweepers (Optuna) can optimise it.
"""

import faulthandler
import signal

if __name__ == "__main__" and hasattr(signal, "SIGUSR1"):  # SIGUSR1 is POSIX only
    # `kill -USR1 <pid>` prints every thread's stack to stderr and the run goes on: where a
    # hung process (a DDP rank at a collective, say) waits. Registered before the imports
    # below, which take seconds: until then SIGUSR1 would end the process.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from lm.config import register_configs  # noqa: E402
from lm.training import exit_between_records, train  # noqa: E402

register_configs()


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return train(cfg).get(cfg.metric)


def _terminate(signum, frame):
    """SIGTERM (a scheduler's stop, ``run_parallel``'s timeout, a preemption) ends the run as
    Ctrl-C does: through its error path, which closes the logger's run (wandb then sends what
    it buffered; killed by the default handler, the steps since its last flush were lost).
    A second SIGTERM kills at once: a DDP rank blocked in a collective cannot run this handler,
    and its peers' exit would leave it waiting."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    exit_between_records(SystemExit(128 + signum))  # a record in progress ends first


def _interrupt(signum, frame):
    """Ctrl-C (SIGINT): ``KeyboardInterrupt``, as Python's own handler raises, but after a
    record in progress; a second Ctrl-C interrupts at once."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    exit_between_records(KeyboardInterrupt())


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _interrupt)
    main()
