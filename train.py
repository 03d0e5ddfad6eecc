"""Train a small decoder with a swappable attention: ``python train.py attention=corope``.

Configs in ``configs/`` (root: ``configs/train.yaml``); the loop is ``lm.training.train``.
Returns ``cfg.metric`` from the run's summary, so Hydra sweepers (Optuna) can optimise it.
"""

import atexit
import faulthandler
import os
import signal
import sys

_INTERRUPTED = []  # holds True once Ctrl-C has ended the run


def _exit_by_sigint() -> None:
    """Ends a run that Ctrl-C stopped by SIGINT itself, as a shell expects of it (a loop of runs
    then stops too). Python does this for an uncaught ``KeyboardInterrupt``, but an import of
    ``fused_rope`` on the H200 machine (Python 3.12, PyTorch 2.11) clears its flag, and the run
    exited with status 1. Registered before any other exit handler, so it runs after them all."""
    if _INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    atexit.register(_exit_by_sigint)
    if hasattr(signal, "SIGUSR1"):  # SIGUSR1 is POSIX only
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
    try:
        main()
    except KeyboardInterrupt:
        _INTERRUPTED.append(True)
        raise
