"""The training harness as a user runs it: train.py end to end, resume, DDP, sweeps + collect,
failures with clear messages."""

import contextlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lm.distributed
import lm.model
import lm.training
from fused_rope.frequencies import rope_frequencies
from lm.checkpoint import load_checkpoint, read_jsonl, save_checkpoint, write_json
from lm.data import build_dataset
from lm.data.base import IGNORE_INDEX, LMDataset
from lm.loggers import NullLogger
from lm.model import GPT
from lm.training import lr_lambda, step_seed, train
from tests.lm.harness import TINY, compose_cfg, wandb_offline_records

ROOT = Path(__file__).resolve().parents[1]
# A counting task a 1-layer model runs through in well under a second per step.
SMALL = TINY + ["data=counting", "data.max_statements=8", "data.seq_len=40", "data.eval_samples=16"]


def train_killed_at_step(cfg, output_dir, step: int) -> None:
    """Runs ``train(cfg)`` into ``output_dir`` and kills it (a KeyboardInterrupt, as Ctrl-C or
    a time limit would) when it asks for the training batch of ``step``."""
    original = LMDataset.train_batch

    def killed(self, at, *args, **kwargs):
        if at == step:
            raise KeyboardInterrupt("simulated kill")
        return original(self, at, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LMDataset, "train_batch", killed)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, output_dir=str(output_dir))


def cli_env() -> dict[str, str]:
    """The environment of the train.py processes the tests start: quiet, one thread each."""
    return {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}


def run_cli(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python *args`` from ``cwd`` (the repository root: relative paths in ``args`` are
    under it). Past ``timeout`` seconds the command has hung:
    every ``train.py`` process of it (torchrun's ranks too) prints its threads' stacks
    (train.py's SIGUSR1 handler), the whole process tree is killed, and the test fails with
    the stacks, so that a hang says where it waits and leaves no rank behind."""
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=cli_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = process_tree(proc.pid)
        for pid in filter(trainer_process, tree):
            # One process at a time: ranks share stderr, and dumps written at once interleave.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(1)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{' '.join(args[:4])} ... hung for {timeout} s; its stacks:\n{stderr[-20000:]}\n"
            f"stdout:\n{stdout[-2000:]}"
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (Linux: read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'
            fields = stat.read_text().rpartition(")")[2].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def trainer_process(pid: int) -> bool:
    """Whether ``pid`` runs train.py itself: a python whose script is train.py (any path to
    it), not torchrun (``-m torch.distributed.run`` or its console script), whom SIGUSR1 would
    end."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    launcher = "torch.distributed.run" in argv or any(Path(a).name == "torchrun" for a in argv)
    return not launcher and any(Path(a).name == "train.py" for a in argv[1:])


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["train/loss"])
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if "train/loss" in r
    ]


def wandb_run_record(run_file: Path):
    """The ``run`` record of an offline wandb run file: its id, name, config."""
    return next(
        r.run for r in wandb_offline_records(run_file) if r.WhichOneof("record_type") == "run"
    )


@pytest.mark.slow
def test_train_py_end_to_end_with_wandb_offline(tmp_path):
    args = [
        *SMALL,
        "logger=wandb",
        "logger.mode=offline",  # whatever WANDB_MODE says
        "train.steps=6",
        "train.eval_every=3",
        "train.log_every=2",
        f"hydra.run.dir={tmp_path}",
    ]
    run = run_cli("train.py", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "final | step 6 | valid loss" in run.stdout + run.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and 0.0 <= summary["test/err"] <= 1.0
    assert summary["val_loss"] == summary["valid/loss"] != summary["test/loss"]
    assert summary["attention_impl"] == ("triton" if torch.cuda.is_available() else "torch")
    assert summary["tokens_per_s"] > 0 and 0.0 < summary["attn_time_frac"] < 1.0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if "test/loss" in r] == [3, 6]
    assert [r["step"] for r in records if "train/loss" in r] == [2, 4, 6]
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 6
    # The offline wandb run holds the summary (final metrics, the best test loss) and config.
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    logged, config = {}, {}
    for record in wandb_offline_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "summary":
            logged.update(
                {
                    u.key or "/".join(u.nested_key): json.loads(u.value_json)
                    for u in record.summary.update
                }
            )
        if kind == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
    assert logged["final/test/err"] == summary["test/err"]
    best = min(r["test/loss"] for r in records if "test/loss" in r)
    assert logged["test/loss"]["min"] == pytest.approx(best)
    assert config["data"]["name"] == "counting" and config["data"]["max_statements"] == 8
    # Named after the overrides that define the run (not those of how it is run, nor hydra.*).
    first = wandb_run_record(run_file)
    watching = ("logger", "train.progress", "train.eval_batch_size")
    assert first.display_name == " ".join(
        o for o in SMALL + ["train.steps=6"] if o.split("=")[0] not in watching
    )

    # Resuming (here a finished run: it evaluates the saved model) logs into the same run;
    # with hydra.job.chdir, run.json still records the launch directory (not the run's).
    resumed = run_cli("train.py", *args, "train.resume=true", "hydra.job.chdir=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "run.json").read_text())["launch_dir"] == str(ROOT)
    run_files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 2
    for run_file in run_files:
        record = wandb_run_record(run_file)
        assert (record.run_id, record.display_name) == (first.run_id, first.display_name)


# log_every=2 with ckpt_every=3: the checkpoint falls between two log lines, so the losses
# logged after the resume must include those of the steps before the kill.
@pytest.mark.parametrize("log_every", [1, 2])
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, log_every):
    """A run killed and resumed from its checkpoint logs the losses and ends with the metrics
    of the uninterrupted run, bit for bit: the checkpoint restores the weights, optimizer,
    schedule and the pending log and best_val_loss state. With dropout on, the resumed steps
    must also draw the uninterrupted run's masks: each step reseeds from step_seed(seed, step,
    rank), so the masks follow from the step (the RNG state the checkpoint saves would give
    them too in one process, but no longer decides them)."""
    cfg = compose_cfg(
        *SMALL,
        "train.device=cpu",  # bitwise reproducibility is a CPU promise (GPU kernels may use atomics)
        "model.dropout=0.1",
        "train.steps=8",
        "train.ckpt_every=3",
        f"train.log_every={log_every}",
        "train.eval_every=4",
    )
    full = train(cfg, output_dir=str(tmp_path / "full"))
    train_killed_at_step(cfg, tmp_path / "cut", 5)
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["step"] == 3
    cfg.train.resume = True
    resumed = train(cfg, output_dir=str(tmp_path / "cut"))

    assert train_losses(tmp_path / "cut") == train_losses(tmp_path / "full")
    assert len(train_losses(tmp_path / "full")) == 8 // log_every
    for key in ("test/loss", "ood_long/loss", "best_val_loss"):
        assert resumed[key] == full[key], key


@pytest.mark.parametrize("attention", ["rope", "corope"])
def test_learned_frequencies_train_and_resume(attention, tmp_path):
    """``attention.learn_freq=true``: every layer's frequencies move from the schedule's, the
    checkpoint holds them, and a resumed run ends where the uninterrupted one does."""
    cfg = compose_cfg(
        *SMALL, f"attention={attention}", "attention.learn_freq=true", "train.device=cpu",
        "train.steps=6", "train.ckpt_every=3", "train.eval_every=0",
    )  # fmt: skip
    full = train(cfg, output_dir=str(tmp_path / "full"))
    state = load_checkpoint(tmp_path / "full" / "checkpoint.pt")["model"]
    learned = [v for k, v in state.items() if k.endswith("attn.freqs.log_inv_freq")]
    assert len(learned) == cfg.model.n_layer
    head_dim = cfg.model.d_model // cfg.model.n_head
    start = rope_frequencies(head_dim, cfg.attention.theta)[0].log()
    assert all(x.dtype == torch.float32 and not torch.equal(x, start) for x in learned)
    train_killed_at_step(cfg, tmp_path / "cut", 5)
    cfg.train.resume = True
    resumed = train(cfg, output_dir=str(tmp_path / "cut"))
    assert train_losses(tmp_path / "cut") == train_losses(tmp_path / "full")
    assert resumed["test/loss"] == full["test/loss"]


class RecordingLogger:
    """A logger service's stand-in: every ``log`` call's step and metrics (the speed aside)
    go into ``logged``, shared by the runs of a test; a resumed run continues the run id its
    checkpoint holds."""

    logged: list[tuple[int, dict]] = []

    def __init__(self, run_id=None, **_):
        self.run_id = run_id or "run-1"

    def log(self, metrics, step):
        speed = ("tokens_per_s", "step_ms", "attn_time_frac", "mfu", "peak_mem_mib")
        self.logged.append((step, {k: v for k, v in metrics.items() if k not in speed}))

    def finish(self, summary):
        pass

    def abort(self):
        pass


def _uninterrupted_logged_run(out_dir, monkeypatch):
    """``(cfg, logged)``: a run of 8 steps (checkpoints every 3, logs every step, evaluations
    every 4) into ``out_dir``, and what a RecordingLogger got from it (emptied for the test's
    next runs, which log to it too)."""
    monkeypatch.setattr(lm.training, "instantiate", lambda _, **kwargs: RecordingLogger(**kwargs))
    monkeypatch.setattr(RecordingLogger, "logged", [])
    cfg = compose_cfg(*SMALL, "train.device=cpu", "train.steps=8", "train.ckpt_every=3",
                      "train.log_every=1", "train.eval_every=4")  # fmt: skip
    train(cfg, output_dir=str(out_dir))
    full, RecordingLogger.logged[:] = list(RecordingLogger.logged), []
    return cfg, full


def test_resume_logs_each_step_once_into_the_same_service_run(tmp_path, monkeypatch):
    """The killed run logged steps 4 and 5 past its checkpoint (step 3) to the service; the
    resumed run recomputes them into metrics.jsonl but does not log them again, so the
    service's run holds each step once, with the uninterrupted run's values."""
    cfg, full = _uninterrupted_logged_run(tmp_path / "full", monkeypatch)
    train_killed_at_step(cfg, tmp_path / "cut", 5)
    assert max(step for step, _ in RecordingLogger.logged) == 5
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["step"] == 3
    cfg.train.resume = True
    train(cfg, output_dir=str(tmp_path / "cut"))
    assert RecordingLogger.logged == full
    assert train_losses(tmp_path / "cut") == train_losses(tmp_path / "full")

    # A run resumed into a new service run (the killed one had none) logs every step there.
    cfg.train.resume = False
    monkeypatch.setattr(lm.training, "instantiate", lambda _, **kwargs: NullLogger())
    train_killed_at_step(cfg, tmp_path / "new", 5)
    monkeypatch.setattr(lm.training, "instantiate", lambda _, **kwargs: RecordingLogger(**kwargs))
    RecordingLogger.logged[:] = []
    cfg.train.resume = True
    train(cfg, output_dir=str(tmp_path / "new"))
    assert RecordingLogger.logged == [(step, metrics) for step, metrics in full if step > 3]


def test_a_start_without_a_logger_keeps_the_service_runs_id_for_the_next(tmp_path, monkeypatch):
    """Killed after step 5 (checkpoint at 3), resumed with logger=none past the checkpoint of
    step 6 and killed again, then resumed with the service: that checkpoint kept the service
    run's id, so the last start continues that run with the steps it lacks (6 to 8). It had
    saved None, and the service opened a new run that lacked step 6 (a review's find)."""
    cfg, full = _uninterrupted_logged_run(tmp_path / "full", monkeypatch)
    train_killed_at_step(cfg, tmp_path / "cut", 5)
    cfg.train.resume = True
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm.training, "instantiate", lambda _, **kwargs: NullLogger())
        train_killed_at_step(cfg, tmp_path / "cut", 7)
    ckpt = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert ckpt["step"] == 6 and ckpt["state"]["logger_run_id"] == "run-1"

    def new_run_unless_resumed(_, run_id=None, **kwargs):
        return RecordingLogger(run_id=run_id or "run-2", **kwargs)

    monkeypatch.setattr(lm.training, "instantiate", new_run_unless_resumed)
    train(cfg, output_dir=str(tmp_path / "cut"))
    assert RecordingLogger.logged == full


def test_resume_logs_what_the_service_run_lacks_after_a_kill_in_an_evaluation_or_two_kills(
    tmp_path, monkeypatch
):
    """Killed in step 4's evaluation (its training record logged already), the resume logs that
    evaluation; killed after step 5, then again after step 4 of the resume (metrics.jsonl cut
    back to the checkpoint's step 3 each time), the next resume logs no step twice. Either way
    the service's run holds the uninterrupted run's records, each once (logged.json; the last
    step of metrics.jsonl lost the evaluation and, after two kills, logged step 5 twice)."""
    cfg, full = _uninterrupted_logged_run(tmp_path / "full", monkeypatch)

    def killed_in_evaluation(*args, **kwargs):
        raise KeyboardInterrupt("simulated kill")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm.training, "evaluate", killed_in_evaluation)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, output_dir=str(tmp_path / "eval"))
    assert [step for step, _ in RecordingLogger.logged] == [1, 2, 3, 4]
    cfg.train.resume = True
    train(cfg, output_dir=str(tmp_path / "eval"))
    assert RecordingLogger.logged == full

    for between in ("recording", "none"):  # the second start logs to the service, or nowhere
        RecordingLogger.logged[:] = []
        cfg.train.resume = False
        train_killed_at_step(cfg, tmp_path / between, 5)
        cfg.train.resume = True
        with pytest.MonkeyPatch.context() as patch:
            if between == "none":
                patch.setattr(lm.training, "instantiate", lambda _, **kwargs: NullLogger())
            train_killed_at_step(cfg, tmp_path / between, 4)
        train(cfg, output_dir=str(tmp_path / between))
        assert RecordingLogger.logged == full
        assert train_losses(tmp_path / between) == train_losses(tmp_path / "full")


def test_an_unreadable_logged_json_falls_back_to_metrics_jsonl(tmp_path, caplog):
    """``logged.json`` is replaced without a sync: left empty by a crash, a resume warns and
    takes metrics.jsonl's last step (as for a run from before the file) rather than failing."""
    path = tmp_path / "logged.json"
    for text in ("", '{"run_id": "run-1"}', '{"run_id": "run-1", "through": {"train": "5"}}'):
        path.write_text(text)
        logged = lm.training._LoggedSteps(path, "run-1", True, 5)
        assert logged.has("train", 5) and logged.has("eval", 5) and not logged.has("eval", 6)
        assert "unreadable" in caplog.text
        caplog.clear()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_to_the_process_group_leaves_every_logged_step_in_wandb(tmp_path, signum):
    """SIGTERM to the run's process group (a scheduler's stop, ``run_parallel``'s timeout, a
    preemption; wandb's service process gets it too) ends train.py through its error path,
    which closes the wandb run: the offline run file holds every step metrics.jsonl has (the
    default handler lost the service's buffer, and a resume then skipped those steps). Ctrl-C
    (SIGINT to the foreground process group) likewise."""
    args = [*SMALL, "logger=wandb", "logger.mode=offline", "train.steps=100000",
            "train.log_every=1", "train.progress=false", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=cli_env(),
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 20):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        os.killpg(proc.pid, signum)
        # Python ends an uncaught KeyboardInterrupt by SIGINT itself, as a shell expects
        expected = 128 + signum if signum == signal.SIGTERM else -signum
        assert proc.wait(timeout=60) == expected, proc.stderr.read()[-5000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    logged = [r["step"] for r in read_jsonl(metrics) if "train/loss" in r]
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    in_wandb = [
        json.loads(item.value_json)
        for record in wandb_offline_records(run_file)
        if record.WhichOneof("record_type") == "history"
        for item in record.history.item
        if (item.key or "/".join(item.nested_key)) == "step"
    ]
    assert len(logged) >= 20 and logged == in_wandb


def test_a_stop_during_a_record_waits_for_the_record(tmp_path):
    """SIGTERM's and Ctrl-C's handlers (``exit_between_records``) called while a step's record
    is being written, here from inside the logger's call: the record reaches metrics.jsonl,
    the logger and logged.json, then the run stops as the handler asked (the race that left a
    step in metrics.jsonl that wandb never got); outside a record it stops at once."""

    class Logger:
        run_id = "run-1"

        def log(self, metrics, step):
            lm.training.exit_between_records(stop)  # the signal, mid-record
            logged.append(step)

    for stop in (SystemExit(143), KeyboardInterrupt()):  # SIGTERM's, Ctrl-C's
        written, logged = [], []
        trainer = types.SimpleNamespace(
            step=7, jsonl=types.SimpleNamespace(write=written.append), logger=Logger(),
            logged=lm.training._LoggedSteps(tmp_path / "logged.json", "run-1", False, None),
        )  # fmt: skip
        with pytest.raises(type(stop)) as raised:
            lm.training._Run._record(trainer, {"train/loss": 1.0}, "train")
        assert raised.value is stop and written == [{"step": 7, "train/loss": 1.0}]
        assert logged == [7]
        assert json.loads((tmp_path / "logged.json").read_text())["through"] == {"train": 7}
        with pytest.raises(type(stop)):
            lm.training.exit_between_records(stop)
    trainer.logger = NullLogger()  # a record without a stop ends normally
    lm.training._Run._record(trainer, {"train/loss": 2.0}, "train")

    class FailingLogger(Logger):  # a stop, then the record fails: the stop ends the run
        def log(self, metrics, step):
            lm.training.exit_between_records(SystemExit(143))
            lm.training.exit_between_records(KeyboardInterrupt())  # the first stop counts
            raise RuntimeError("service down")

    trainer.logger, trainer.step = FailingLogger(), 8
    with pytest.raises(SystemExit) as raised:
        lm.training._Run._record(trainer, {"train/loss": 3.0}, "train")
    assert raised.value.code == 143 and isinstance(raised.value.__context__, RuntimeError)
    trainer.logger = NullLogger()  # no stale stop is left for the next record (a sweep's job)
    lm.training._Run._record(trainer, {"train/loss": 4.0}, "train")


@pytest.mark.parametrize(
    "where", ["run directory", "checkpoint elsewhere", "the first run's checkpoint"]
)
def test_a_second_run_into_a_running_runs_files_fails_at_start_up(where, tmp_path):
    """While a run holds its locks (its directory's and its checkpoint's), a second run into
    the same directory, or onto the first run's checkpoint from another directory (the first
    saving it in its own directory, or elsewhere), fails before it writes anything; once the
    first ends, the second starts."""
    first_dir = tmp_path / "first"
    ckpt = {"checkpoint elsewhere": tmp_path / "shared" / "model.pt",
            "the first run's checkpoint": first_dir / "checkpoint.pt"}.get(where)  # fmt: skip
    extra = [f"train.ckpt_path={ckpt}"] if ckpt is not None else []
    second_dir = first_dir if where == "run directory" else tmp_path / "second"
    held, taken = lm.training._lock_run(first_dir, ckpt or first_dir / "checkpoint.pt")
    assert held and taken == ""
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0", *extra)
    try:
        with pytest.raises(FileExistsError, match="another run is writing here"):
            train(cfg, output_dir=str(second_dir))
        assert not (second_dir / "metrics.jsonl").exists()
    finally:
        for f in held:
            f.close()
    assert train(cfg, output_dir=str(second_dir))["steps"] == 2


def test_resume_with_another_ckpt_path_beside_the_runs_checkpoint_fails(tmp_path):
    """train.ckpt_path may change on resume, but a resume that finds no checkpoint at the new
    path while the directory's earlier run saved one under its own would start at step 0 and
    replace that run's metrics: refused, naming the checkpoint; the run's files are untouched
    (the refused run leaves only its empty lock file, other.pt.lock)."""
    common = [*SMALL, "train.steps=6", "train.ckpt_every=2", "train.eval_every=0"]
    train_killed_at_step(compose_cfg(*common), tmp_path, 4)

    def run_files():
        return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix != ".lock"}

    written = run_files()
    moved = compose_cfg(*common, "train.resume=true", "train.ckpt_path=other.pt")
    with pytest.raises(FileNotFoundError, match=r"saved its checkpoints to .*checkpoint\.pt"):
        train(moved, output_dir=str(tmp_path))
    assert run_files() == written
    # Without that checkpoint (a run killed before its first save), the resume starts over.
    (tmp_path / "checkpoint.pt").unlink()
    assert train(moved, output_dir=str(tmp_path))["steps"] == 6
    assert load_checkpoint(tmp_path / "other.pt")["step"] == 6


@pytest.mark.parametrize("grad_accum_steps", [1, 4])
def test_gradient_is_that_of_the_mean_loss_over_the_target_tokens(
    tmp_path, monkeypatch, grad_accum_steps
):
    """The gradient AdamW receives (no clipping) is autograd's of F.cross_entropy's mean over
    the batch's target tokens, ignored positions excluded: not a sum over the positions or a
    mean over the rows. Flip-flop rows hold different numbers of targets, so a division by
    the rows, the positions or any fixed count gives another gradient (AdamW's updates and the
    logged loss would barely show it); so would a micro-batch's mean over its own targets.
    One process: the DDP scaling (x world_size) is 1."""
    models, batches, checked, forward_rows = [], [], [], []
    build_optimizer, train_batch = lm.training.build_optimizer, LMDataset.train_batch
    step = torch.optim.AdamW.step

    def recording_build_optimizer(model, *args, **kwargs):
        models.append(model)
        model.register_forward_pre_hook(lambda _, args: forward_rows.append(len(args[0])))
        return build_optimizer(model, *args, **kwargs)

    def recording_train_batch(self, *args, **kwargs):
        batches.append(train_batch(self, *args, **kwargs))
        return batches[-1]

    def checking_step(self, *args, **kwargs):
        (model,), (x, y) = models, batches[-1]
        assert forward_rows == [len(x) // grad_accum_steps] * grad_accum_steps
        params = [p for group in self.param_groups for p in group["params"]]
        with torch.enable_grad():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
            expected = torch.autograd.grad(loss, params, allow_unused=True)
        for p, e in zip(params, expected, strict=True):
            torch.testing.assert_close(
                p.grad, e if e is not None else torch.zeros_like(p), rtol=1e-4, atol=1e-7
            )
        checked.append(int((y != IGNORE_INDEX).sum()))
        forward_rows.clear()
        return step(self, *args, **kwargs)

    monkeypatch.setattr(lm.training, "build_optimizer", recording_build_optimizer)
    monkeypatch.setattr(LMDataset, "train_batch", recording_train_batch)
    monkeypatch.setattr(torch.optim.AdamW, "step", checking_step)
    cfg = compose_cfg(
        *TINY,
        "data=flipflop",
        "data.num_instructions=8",
        "data.seq_len=16",
        "data.eval_samples=16",
        "train.device=cpu",
        "train.time_attention=false",
        "optim.grad_clip=0",
        "train.steps=3",
        "train.eval_every=0",
        f"train.grad_accum_steps={grad_accum_steps}",
    )
    train(cfg, output_dir=str(tmp_path))
    assert len(checked) == 3
    rows = cfg.train.batch_size
    assert all(rows != n < rows * cfg.data.seq_len for n in checked) and len(set(checked)) > 1


def test_logged_train_loss_is_the_mean_of_the_steps_since_the_last_log(tmp_path, monkeypatch):
    """With log_every=2 each train/loss line is the mean of its two steps' losses, not the
    last step's, and the average starts again after each line."""
    losses = []
    train_step = lm.training._Run._train_step

    def recording_train_step(self):
        loss, tokens = train_step(self)
        losses.append(loss)
        return loss, tokens

    monkeypatch.setattr(lm.training._Run, "_train_step", recording_train_step)
    cfg = compose_cfg(*SMALL, "train.steps=4", "train.log_every=2", "train.eval_every=0")
    train(cfg, output_dir=str(tmp_path))
    assert len(losses) == 4 and len(set(losses)) == 4
    logged = train_losses(tmp_path)
    assert [s for s, _ in logged] == [2, 4]
    assert [loss for _, loss in logged] == pytest.approx(
        [(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2], rel=1e-12
    )


def test_speed_leaves_out_the_first_step(tmp_path, monkeypatch):
    """The first step (compilation, warm-up) is not timed: with a first step of 100 s and
    three of 1 s, step_ms is 1000 and tokens_per_s one step's tokens."""
    import types

    readings = iter([0.0, 100.0, 100.0, 101.0, 101.0, 102.0, 102.0, 103.0])
    clock = types.SimpleNamespace(monotonic=lambda: 0.0, perf_counter=lambda: next(readings))
    monkeypatch.setattr(lm.training, "time", clock)  # the training loop's clock only
    cfg = compose_cfg(*SMALL, "train.steps=4", "train.eval_every=0", "train.ckpt_every=0")
    summary = train(cfg, output_dir=str(tmp_path))
    assert summary["step_ms"] == pytest.approx(1000.0)
    assert summary["tokens_per_s"] == pytest.approx(cfg.train.batch_size * cfg.data.seq_len)


def test_a_failed_write_leaves_the_previous_checkpoint_and_json(tmp_path):
    """save_checkpoint and write_json write beside the file and move the result over it: a
    write that dies midway (disk full, a kill) leaves the previous file whole, never a
    truncated one at the path, and a write that raises removes its temporary file."""
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(3)})

    def dying_save(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04partial")
        raise OSError("disk full")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "save", dying_save)
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(path, {"step": 2, "w": torch.zeros(3)})
    ckpt = load_checkpoint(path)
    assert ckpt["step"] == 1 and torch.equal(ckpt["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary left

    summary = tmp_path / "summary.json"
    write_json(summary, {"steps": 1})
    write_text = Path.write_text

    def dying_write_text(self, data, *args, **kwargs):
        write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError("disk full")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "write_text", dying_write_text)
        with pytest.raises(OSError, match="disk full"):
            write_json(summary, {"steps": 2, "val_loss": 1.5})
    assert json.loads(summary.read_text()) == {"steps": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "summary.json"]


def test_cuda_device_without_cuda_is_refused_by_name(monkeypatch):
    """train.device=cuda on a machine (or a torch build) without CUDA fails naming the
    option, not with torch's internal AttributeError from set_device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"train.device='{device}'.*no CUDA"):
            lm.distributed.setup(device)
    assert lm.distributed.setup("auto").device.type == "cpu"


def test_step_seed_differs_by_rank_and_step_and_not_by_process():
    """Dropout's per-step seed: every (step, rank) its own, the same in another process (a
    resumed run, another rank) whatever its hash randomisation."""
    assert len({step_seed(0, s, r) for s in range(50) for r in range(8)}) == 400
    assert step_seed(1, 3, 0) != step_seed(0, 3, 0)
    script = "from lm.training import step_seed; print(step_seed(7, 11, 3))"
    for hash_seed in ("1", "123"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert int(run.stdout.strip()) == step_seed(7, 11, 3), run.stderr[-2000:]


def test_resume_after_a_torn_metrics_line(tmp_path):
    """A kill (or a full disk) mid-append leaves metrics.jsonl with a last line cut short:
    the resume leaves it out, with a warning, rewrites the file atomically and logs what the
    uninterrupted run logs. A bad line before the last is named, not skipped."""
    cfg = compose_cfg(
        *SMALL, "train.device=cpu", "train.steps=6", "train.ckpt_every=3", "train.eval_every=3"
    )
    train(cfg, output_dir=str(tmp_path / "full"))
    train_killed_at_step(cfg, tmp_path / "cut", 5)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 5, "train/lo')
    cfg.train.resume = True
    with pytest.warns(UserWarning, match="left out its last line, cut short"):
        train(cfg, output_dir=str(tmp_path / "cut"))
    assert train_losses(tmp_path / "cut") == train_losses(tmp_path / "full")
    assert not list(metrics.parent.glob("metrics.jsonl.*.tmp"))

    metrics.write_text('{"step": 1}\n{"step": 2, "tr\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON record"):
        read_jsonl(metrics)


def test_max_minutes_stops_evaluates_and_resumes_to_the_same_run(tmp_path, monkeypatch):
    """train.max_minutes ends the loop at the step where the budget runs out, with the final
    evaluation, checkpoint and summary; resume=true then finishes the run exactly."""
    import types

    import lm.training

    cfg = compose_cfg(
        *SMALL, "train.device=cpu", "train.steps=8", "train.eval_every=0", "train.ckpt_every=0"
    )
    full = train(cfg, output_dir=str(tmp_path / "full"))

    ticks = iter(range(0, 10**6, 30))  # a clock that advances 30 s per reading
    fake_time = types.SimpleNamespace(
        perf_counter=lm.training.time.perf_counter, monotonic=lambda: next(ticks)
    )
    monkeypatch.setattr(lm.training, "time", fake_time)
    cfg.train.max_minutes = 1.2  # 72 s: read at 30, 60, 90 s, so the loop stops after step 3
    cut = train(cfg, output_dir=str(tmp_path / "cut"))
    assert cut["steps"] == 3 and cut["stopped_early"] is True
    assert "test/loss" in cut and "ood_long/acc" in cut
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["step"] == 3
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["stopped_early"] is True

    cfg.train.max_minutes, cfg.train.resume = None, True
    resumed = train(cfg, output_dir=str(tmp_path / "cut"))
    assert resumed["steps"] == 8 and resumed["stopped_early"] is False
    for key in ("test/loss", "ood_long/loss"):  # the same weights as the uninterrupted run
        assert resumed[key] == full[key], key


def test_a_max_minutes_stop_off_the_schedule_resumes_to_the_same_logs(tmp_path, monkeypatch):
    """A stop after step 3 with logs and evaluations every 2 steps logs and evaluates for the
    stopped run, but the resumed run logs the averages and reports the best_val_loss of the
    uninterrupted run: the checkpoint keeps step 3's loss pending and best_val_loss without
    step 3's evaluation, and the resume drops the stop's records."""
    import types

    import lm.training

    cfg = compose_cfg(
        *SMALL, "train.device=cpu", "train.steps=8", "train.eval_every=2", "train.log_every=2",
        "train.ckpt_every=0",
    )  # fmt: skip
    full = train(cfg, output_dir=str(tmp_path / "full"))
    ticks = iter(range(0, 10**6, 30))  # a clock that advances 30 s per reading
    fake_time = types.SimpleNamespace(
        perf_counter=lm.training.time.perf_counter, monotonic=lambda: next(ticks)
    )
    monkeypatch.setattr(lm.training, "time", fake_time)
    cfg.train.max_minutes = 1.2  # the loop stops after step 3
    cut = train(cfg, output_dir=str(tmp_path / "cut"))
    assert cut["steps"] == 3 and "test/loss" in cut
    stop = [r for r in read_jsonl(tmp_path / "cut" / "metrics.jsonl") if r["step"] == 3]
    assert len(stop) == 2 and all(r["stopped_early"] for r in stop)  # a log and an evaluation
    cfg.train.max_minutes, cfg.train.resume = None, True
    resumed = train(cfg, output_dir=str(tmp_path / "cut"))
    assert train_losses(tmp_path / "cut") == train_losses(tmp_path / "full")
    assert resumed["best_val_loss"] == full["best_val_loss"]
    steps = [r["step"] for r in read_jsonl(tmp_path / "cut" / "metrics.jsonl")]
    assert steps == [r["step"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")]


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    from lm.model import GPT

    forward, calls = GPT.forward, []

    def nan_at_fifth_training_step(self, idx):
        logits = forward(self, idx)
        if self.training:
            calls.append(1)
            if len(calls) == 5:
                return logits * float("nan")
        return logits

    monkeypatch.setattr(GPT, "forward", nan_at_fifth_training_step)
    cfg = compose_cfg(*SMALL, "train.steps=8", "train.ckpt_every=2", "train.eval_every=0")
    with pytest.raises(
        FloatingPointError, match=r"loss is nan at step 5; .*checkpoint.pt \(step 4\)"
    ):
        train(cfg, output_dir=str(tmp_path))
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 4
    failed = json.loads((tmp_path / "failed.json").read_text())
    assert failed["step"] == 4 and failed["error"] == "FloatingPointError"
    assert "loss is nan at step 5" in failed["message"]
    assert not (tmp_path / "summary.json").exists()

    monkeypatch.setattr(GPT, "forward", forward)
    cfg.train.resume = True  # the resumed run ends well: the failure was an earlier run's
    train(cfg, output_dir=str(tmp_path))
    assert not (tmp_path / "failed.json").exists() and (tmp_path / "summary.json").exists()


def test_a_run_killed_after_an_overwrite_leaves_no_summary(tmp_path):
    """The summary and the checkpoint of the run that train.overwrite replaces go when the new
    run starts, so a kill leaves no result to pass for the new run's (and a killed run has not
    failed), and no weights for a later resume to continue under the new run's metrics."""
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0")
    train(cfg, output_dir=str(tmp_path))
    assert (tmp_path / "summary.json").exists()
    cfg.train.overwrite = True
    train_killed_at_step(cfg, tmp_path, 0)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "failed.json").exists()
    assert not (tmp_path / "checkpoint.pt").exists()
    assert json.loads((tmp_path / "run.json").read_text())["config"]["train"]["overwrite"]


@pytest.mark.parametrize("saved_split", [None, "valid"])
def test_resume_keeps_best_val_loss_of_one_split(tmp_path, caplog, saved_split):
    """A checkpoint from before the synthetic tasks' valid split (no best_val_split: its
    best_val_loss is a test loss) starts best_val_loss again on resume, with a warning; one
    measured on the same split keeps it."""
    cfg = compose_cfg(*SMALL, "train.steps=4", "train.eval_every=1", "train.ckpt_every=2")
    train_killed_at_step(cfg, tmp_path, 3)
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["state"]["best_val_split"] == "valid"
    ckpt["state"]["best_val_loss"] = -1.0  # a loss no split could give: the older measure
    if saved_split is None:
        del ckpt["state"]["best_val_split"]
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    cfg.train.resume = True
    with caplog.at_level(logging.WARNING, logger="lm.training"):
        summary = train(cfg, output_dir=str(tmp_path))
    if saved_split is None:
        assert "measured on split 'test'" in caplog.text
        records = read_jsonl(tmp_path / "metrics.jsonl")
        after = [r["valid/loss"] for r in records if r["step"] > 2 and "valid/loss" in r]
        assert len(after) == 2 and summary["best_val_loss"] == min(after)
    else:
        assert summary["best_val_loss"] == -1.0 and "measured on split" not in caplog.text


def test_missing_data_file_fails_naming_it(tmp_path):
    missing = tmp_path / "nowhere"
    cfg = compose_cfg(*TINY, "data=jsonl", f"data.dir={missing}")
    with pytest.raises((FileNotFoundError, ValueError), match="nowhere"):
        train(cfg, output_dir=str(tmp_path / "out"))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.n_layers=2", "n_layers"),
        ("+model.n_layers=2", "unknown config keys ['model.n_layers'] (added with '+')"),
        ("attention=alibi", "attention/alibi"),
        ("train.max_minutes=0", "train.max_minutes must be a positive number"),
        ("train.eval_batch_size=0", "train.eval_batch_size must be >= 1, got 0"),
        ("train.log_every=-1", "train.log_every must be >= 0, got -1"),
        ("optim.grad_clip=-1", "optim.grad_clip must be >= 0 (0 = no clipping), got -1.0"),
        ("metric=test/error", "metric='test/error' is not a key of the run's summary"),
        # a key whose value is no number: train.py returned "rope" to sweepers (a review's find)
        ("metric=attention", "metric='attention' is a key of the run's summary that holds no"),
    ],
)
def test_train_py_rejects_bad_overrides_at_start_up(override, expected, tmp_path):
    run = run_cli("train.py", override, f"hydra.run.dir={tmp_path}")
    assert run.returncode != 0
    assert expected in run.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.steps=0"], "train.steps must be >= 1, got 0"),
        (["train.batch_size=0"], "train.batch_size must be >= 1, got 0"),
        (["train.grad_accum_steps=0"], "train.grad_accum_steps must be >= 1, got 0"),
        (
            ["train.batch_size=6", "train.grad_accum_steps=4"],
            "train.grad_accum_steps=4 must divide train.batch_size=6",
        ),
        (["train.eval_every=-1"], "train.eval_every must be >= 0, got -1"),
        (["train.ckpt_every=-2"], "train.ckpt_every must be >= 0, got -2"),
        (["optim.lr=0"], "optim.lr must be a positive number below 3.4e+38, got 0.0"),
        # past fp32: it failed at step 0, "cannot be converted to type float without overflow"
        (["optim.lr=1e300"], "optim.lr must be a positive number below 3.4e+38, got 1e+300"),
        (["optim.warmup_steps=-1"], "optim.warmup_steps must be >= 0, got -1"),
        (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio must be in [0.0, 1.0], got 1.5"),
        (["optim.min_lr_ratio=-0.1"], "optim.min_lr_ratio must be in [0.0, 1.0], got -0.1"),
        (["train.resume=true", "train.overwrite=true"], "train.overwrite=true: pick one"),
        (["train.cpu_threads=0"], "train.cpu_threads must be >= 1, got 0"),
        (["train.compile=true", "train.compile_mode=fast"], "train.compile_mode must be one of"),
        # a sweep over the modes would have timed one eager run under each name
        (["train.compile_mode=reduce-overhead"], "needs train.compile=true"),
        (["train.device=gpu"], "train.device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["optim.weight_decay=-5"], "optim.weight_decay must be >= 0, got -5.0"),
        (["optim.beta1=1.5"], "optim.beta1 must be in [0.0, 1.0], got 1.5"),
        (["optim.beta2=1.0"], "optim.beta2 must be in [0, 1), got 1.0"),
        (["optim.eps=-1"], "optim.eps must be a positive number below 3.4e+38, got -1.0"),
        (["model.mlp_hidden=0"], "model.mlp_hidden must be >= 1, got 0"),
        (["model.head_dim=0"], "model.head_dim must be >= 1, got 0"),
        (["model.dropout=1.5"], "model.dropout must be in [0.0, 1.0], got 1.5"),
        (["model.init_std=-1"], "model.init_std must be a positive number, got -1.0"),
        (["model.n_layer=0"], "model.n_layer must be >= 1, got 0"),
        (["attention=corope", "attention.chunk_size=0"], "attention.chunk_size must be >= 1"),
        # another attention's name over a group: NoPE trained, the group's theta dropped
        (["attention=rope", "attention.name=nope"], "attention.name=nope over the config group"),
        (["attention=sinusoidal", "attention.name=learned"], "(attention=learned)"),
        (["attention=rope", "attention.name=corope"], "its options are RopeAttentionConfig's"),
    ],
)
def test_bad_loop_options_fail_before_the_data_is_loaded(
    overrides, expected, tmp_path, monkeypatch
):
    def no_data(cfg):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr(lm.training, "build_dataset", no_data)
    with pytest.raises(ValueError) as info:
        train(compose_cfg(*SMALL, *overrides), output_dir=str(tmp_path))
    assert expected in str(info.value)
    assert not any(tmp_path.iterdir())


def test_the_sinusoidal_base_is_named_and_refused_before_the_data_loads(tmp_path, monkeypatch):
    """The model's table (built after the data) took it unnamed: "base must be ..." (a
    review's find)."""

    def no_data(cfg):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr(lm.training, "build_dataset", no_data)
    cfg = compose_cfg(*SMALL, "attention=sinusoidal", "attention.base=-1")
    with pytest.raises(ValueError, match="attention.base must be a finite number > 1, got -1.0"):
        train(cfg, output_dir=str(tmp_path))


@pytest.mark.parametrize(
    "overrides, metric",
    [
        (["train.time_attention=false"], "attn_time_frac"),
        (["train.compile=true"], "attn_time_frac"),  # compiled: attention is not timed
        (["train.steps=1"], "tokens_per_s"),  # the first step is not timed
        (["train.steps=1"], "step_ms"),
    ],
)
def test_a_metric_the_run_will_leave_null_is_refused(overrides, metric, tmp_path):
    """A summary field that this run's options leave null is no metric: train.py returned None
    to the sweeper at the end (a review's find); refused at the start."""
    with pytest.raises(ValueError, match=f"metric='{metric}' is a key .* no number in this run"):
        train(compose_cfg(*SMALL, *overrides, f"metric={metric}"), output_dir=str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_resume_with_no_step_left_to_time_refuses_a_speed_metric(tmp_path):
    """The untimed first step is each start's: a resume at step 1 of 2 times none, so its
    summary's speed would be null (a review's find: the check counted train.steps whole)."""
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.ckpt_every=1", "metric=step_ms")
    train_killed_at_step(cfg, tmp_path, 1)
    cfg.train.resume = True
    with pytest.raises(ValueError, match="metric='step_ms' is a key .* no number in this run"):
        train(cfg, output_dir=str(tmp_path))


def test_speed_metrics_are_numbers_once_a_step_is_timed(tmp_path):
    summary = train(compose_cfg(*SMALL, "train.steps=2", "metric=attn_time_frac"),
                    output_dir=str(tmp_path))  # fmt: skip
    assert all(summary[k] > 0 for k in ("attn_time_frac", "tokens_per_s", "step_ms"))


def test_a_compiled_job_starts_from_empty_dynamo_caches(tmp_path, monkeypatch):
    """A multirun's jobs share one process: a compiled job resets dynamo before it compiles,
    else the graphs of the jobs before it count toward dynamo's recompile limit (8), and the
    ninth job ran eagerly while its record said train.compile=true (a review's find)."""
    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))
    monkeypatch.setattr(GPT, "compile", lambda self, **kwargs: calls.append(("compile", kwargs)))
    cfg = compose_cfg(*SMALL, "train.device=cpu", "train.steps=1", "train.compile=true")
    train(cfg, output_dir=str(tmp_path))
    assert calls == ["reset", ("compile", {"mode": "default"})]
    calls.clear()
    mode = compose_cfg(*SMALL, "train.device=cpu", "train.steps=1", "train.compile=true",
                       "train.compile_mode=reduce-overhead", "train.overwrite=true")  # fmt: skip
    train(mode, output_dir=str(tmp_path))
    assert calls == ["reset", ("compile", {"mode": "reduce-overhead"})]
    calls.clear()  # an eager job too: earlier jobs' CUDA graphs would keep their memory pool
    train(compose_cfg(*SMALL, "train.device=cpu", "train.steps=1", "train.overwrite=true"),
          output_dir=str(tmp_path))  # fmt: skip
    assert calls == ["reset"]


@pytest.mark.slow
def test_an_absolute_ckpt_path_is_refused_in_a_multirun(tmp_path):
    """Every job of ``-m`` would write one absolute checkpoint path: each job would replace or
    resume the one before. A relative path is each job's own (under its directory)."""
    sweep = run_cli("train.py", "-m", "seed=0,1", f"train.ckpt_path={tmp_path / 'ckpt.pt'}",
                    *SMALL, "train.steps=1", f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert sweep.returncode != 0
    assert "is absolute in a multirun: every job would write that file" in sweep.stderr
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_nan_evaluation_is_the_best_val_loss(tmp_path, monkeypatch):
    """An evaluation whose loss is NaN makes best_val_loss NaN, which a sweeper sees: min()
    kept the earlier loss and ranked a diverged run by its past (a review's find)."""
    real, calls = lm.training.evaluate, []

    def nan_second(*args, **kwargs):
        metrics = real(*args, **kwargs)
        calls.append(1)
        return {**metrics, "valid/loss": math.nan} if len(calls) == 2 else metrics

    monkeypatch.setattr(lm.training, "evaluate", nan_second)
    cfg = compose_cfg(*SMALL, "train.device=cpu", "train.steps=3", "train.eval_every=1")
    summary = train(cfg, output_dir=str(tmp_path))
    assert len(calls) >= 3 and math.isnan(summary["best_val_loss"])


def test_resume_with_another_config_fails_naming_the_keys(tmp_path):
    """Only how the run is carried out and watched may change on resume; anything it trains
    (model, data, optimizer, seed, steps) must match the checkpoint's config."""
    common = [*SMALL, "train.steps=2", "train.eval_every=0"]
    train(compose_cfg(*common), output_dir=str(tmp_path))
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    changed = compose_cfg(*common, "train.resume=true", "model.d_model=32", "optim.lr=1e-2")
    with pytest.raises(ValueError) as info:
        train(changed, output_dir=str(tmp_path))
    message = str(info.value)
    listed = [line.strip() for line in message.splitlines() if line.startswith("  ")]
    assert listed == ["model.d_model: 64 -> 32", "optim.lr: 0.003 -> 0.01"]  # not train.resume
    assert "Resume with the same config" in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == written

    watched_otherwise = compose_cfg(
        *common,
        "train.resume=true",
        "train.log_every=1",
        "train.eval_every=1",
        "train.ckpt_every=1",
        "train.eval_batch_size=8",
        "train.grad_accum_steps=2",
        "train.max_minutes=5",
        "train.device=cpu",
        "attention.impl=torch",
        "metric=test/err",
    )
    assert train(watched_otherwise, output_dir=str(tmp_path))["steps"] == 2


def test_resume_may_change_corope_chunks(tmp_path):
    """attention.chunk_size sets the memory Co-RoPE's PyTorch path takes, not the model: a run
    out of memory resumes with smaller chunks (a review's find: it was refused)."""
    common = [*SMALL, "attention=corope", "train.steps=2", "train.eval_every=0"]
    train(compose_cfg(*common), output_dir=str(tmp_path))
    smaller = compose_cfg(*common, "train.resume=true", "attention.chunk_size=4")
    assert train(smaller, output_dir=str(tmp_path))["steps"] == 2


def test_resume_on_another_number_of_processes_fails(tmp_path):
    """train.batch_size is per process: a resume on another number of processes would train
    on another global batch, and other rows, under the same config."""
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0")
    train(cfg, output_dir=str(tmp_path))
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["world_size"] == 1
    ckpt["world_size"] = 2  # as a two-process run saves it
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    cfg.train.resume = True
    with pytest.raises(ValueError, match="trained on 2 processes of train.batch_size=.*has 1"):
        train(cfg, output_dir=str(tmp_path))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == written


def test_resume_from_another_directory_with_relative_data_paths_fails(tmp_path, monkeypatch):
    """data.files=[corpus.txt] is read from the launch directory: a resume launched elsewhere
    would read another file of that name, so it is refused naming both (the file by its
    absolute path, which the config check compares resolved, resumes); run.json records the
    launch directory, also where hydra.job.chdir moved the process since."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "corpus.txt").write_text(f"text of {name} " * 400)
    common = [*TINY, "data=text", "data.files=[corpus.txt]", "data.seq_len=32",
              "train.steps=2", "train.eval_every=0"]  # fmt: skip
    monkeypatch.chdir(tmp_path / "a")
    train(compose_cfg(*common), output_dir=str(tmp_path / "run"))
    assert json.loads((tmp_path / "run" / "run.json").read_text())["launch_dir"] == str(
        tmp_path / "a"
    )
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(ValueError, match=r"a/corpus.txt'\], this launch reads \[.*b/corpus.txt"):
        train(compose_cfg(*common, "train.resume=true"), output_dir=str(tmp_path / "run"))
    absolute = f"data.files=[{tmp_path / 'a' / 'corpus.txt'}]"
    resumed = train(compose_cfg(*common, absolute, "train.resume=true"), str(tmp_path / "run"))
    assert resumed["steps"] == 2  # the same file by its absolute path: the same data


def test_resume_refuses_other_tokens_at_the_same_path(tmp_path):
    """The same config and file path, but the file edited since the checkpoint: the run would
    go on training on other data, so the resume is refused before anything is written (the
    checkpoint's digest of the tokens differs); with the file as it was, it resumes."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the first text " * 300)
    cfg = compose_cfg(*TINY, "data=text", f"data.files=[{corpus}]", "data.seq_len=32",
                      "train.steps=4", "train.ckpt_every=2", "train.eval_every=0")  # fmt: skip
    train_killed_at_step(cfg, tmp_path / "run", 3)
    written = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    corpus.write_text("the other text " * 300)
    cfg.train.resume = True
    with pytest.raises(ValueError, match="trained on other tokens than this launch reads"):
        train(cfg, output_dir=str(tmp_path / "run"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == written
    corpus.write_text("the first text " * 300)
    assert train(cfg, output_dir=str(tmp_path / "run"))["steps"] == 4


def test_resume_of_a_checkpoint_without_a_data_digest(tmp_path, monkeypatch):
    """Checkpoints written before the digest have none: they resume (from their step, not from
    0), and the next save adds it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the first text " * 300)
    cfg = compose_cfg(*TINY, "data=text", f"data.files=[{corpus}]", "data.seq_len=32",
                      "train.steps=4", "train.ckpt_every=2", "train.eval_every=0")  # fmt: skip
    train_killed_at_step(cfg, tmp_path, 3)
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    digest = ckpt.pop("data_fingerprint")
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    cfg.train.resume = True
    asked, original = [], LMDataset.train_batch

    def recorded(self, step, *args, **kwargs):
        asked.append(step)
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(LMDataset, "train_batch", recorded)
    assert train(cfg, output_dir=str(tmp_path))["steps"] == 4
    assert asked == [ckpt["step"], 3] and ckpt["step"] == 2
    assert load_checkpoint(tmp_path / "checkpoint.pt")["data_fingerprint"] == digest


def test_a_logger_that_cannot_start_leaves_the_earlier_run_intact(tmp_path, monkeypatch):
    """The logger starts before the launch clears the directory's earlier outcome (or, with
    train.overwrite, its checkpoint): a logger that fails (wandb without an account, a bad
    mode) leaves the finished run as it was."""
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0")
    train(cfg, output_dir=str(tmp_path))
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert "summary.json" in written

    def failing_logger(*args, **kwargs):
        raise RuntimeError("no account")

    monkeypatch.setattr(lm.training, "instantiate", failing_logger)
    for option in ("train.resume=true", "train.overwrite=true"):
        with pytest.raises(RuntimeError, match="no account"):
            train(compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0", option),
                  output_dir=str(tmp_path))  # fmt: skip
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == written


def test_attention_share_counts_only_the_steps_it_timed(tmp_path, monkeypatch):
    """A run killed with train.time_attention=false and resumed with it on: attn_time_frac is
    the attention's share of the timed steps' time, not of every step's (which read as 0.075
    where a whole timed run measured 0.20)."""
    common = [*SMALL, "train.steps=6", "train.ckpt_every=1", "train.eval_every=0"]
    train_killed_at_step(compose_cfg(*common, "train.time_attention=false"), tmp_path, 4)
    state = load_checkpoint(tmp_path / "checkpoint.pt")["state"]
    assert state["attn_train_s"] == state["attn_s"] == 0.0 < state["train_s"]
    resumed = train(compose_cfg(*common, "train.resume=true"), output_dir=str(tmp_path))
    state = load_checkpoint(tmp_path / "checkpoint.pt")["state"]
    assert 0.0 < state["attn_train_s"] < state["train_s"]
    assert resumed["attn_time_frac"] == pytest.approx(state["attn_s"] / state["attn_train_s"])


def test_resume_of_a_checkpoint_without_config_warns(tmp_path, caplog):
    """Checkpoints of older runs hold no config: they resume, unchecked, with a warning."""
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0")
    train(cfg, output_dir=str(tmp_path))
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    del ckpt["config"]
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    cfg.train.resume = True
    with caplog.at_level(logging.WARNING, logger="lm.training"):
        assert train(cfg, output_dir=str(tmp_path))["steps"] == 2
    assert "checkpoint.pt holds no config" in caplog.text


def test_resume_across_a_config_field_added_or_removed_warns(tmp_path, caplog):
    """A field this code's schemas have and the older run's config lacks takes its default
    (what the older run had implicitly): unchanged it resumes silently, set otherwise it is a
    change and fails. A key only the older config has (a field the code lost) is not a change
    of the run: it resumes, naming the key in a warning; a differing value of a key both have
    still fails."""
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0")
    train(cfg, output_dir=str(tmp_path))
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    del ckpt["config"]["model"]["norm_eps"]  # a field this code has and the older run lacked
    del ckpt["config"]["attention"]["query_scale"]
    ckpt["config"]["model"]["retired_option"] = 3  # and one the older code had
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    cfg.train.resume = True
    with caplog.at_level(logging.WARNING, logger="lm.training"):
        assert train(cfg, output_dir=str(tmp_path))["steps"] == 2
    assert "lacks or has keys this code's does not" in caplog.text
    assert "model.retired_option: 3 -> (absent)" in caplog.text
    assert "norm_eps" not in caplog.text and "query_scale" not in caplog.text
    scaled = compose_cfg(
        *SMALL, "train.steps=2", "train.eval_every=0", "train.resume=true",
        "attention.query_scale.beta=0.3", "attention.query_scale.length=16",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"attention.query_scale.beta: None -> 0.3"):
        train(scaled, output_dir=str(tmp_path))
    ckpt["config"]["model"]["n_layer"] += 1
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    with pytest.raises(ValueError, match="model.n_layer: 2 -> 1"):
        train(cfg, output_dir=str(tmp_path))


def test_rerun_over_a_checkpoint_needs_resume_or_overwrite(tmp_path):
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0")
    train(cfg, output_dir=str(tmp_path))
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"] == load_checkpoint(tmp_path / "checkpoint.pt")["config"]
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir()}  # run.json among them
    with pytest.raises(
        FileExistsError, match=r"checkpoint\.pt .*train\.resume=true.*train\.overwrite=true"
    ):
        train(cfg, output_dir=str(tmp_path))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == written

    cfg.train.overwrite, cfg.train.steps = True, 1  # a new run: its config may differ
    assert train(cfg, output_dir=str(tmp_path))["steps"] == 1
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 1
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 1]


def test_relative_ckpt_path_is_under_each_runs_output_dir(tmp_path, monkeypatch):
    """Two jobs of a sweep with train.ckpt_path=ckpt/last.pt keep a checkpoint each."""
    monkeypatch.chdir(tmp_path)  # the launch directory
    cfg = compose_cfg(*SMALL, "train.steps=1", "train.eval_every=0", "train.ckpt_path=ckpt/last.pt")
    for job in ("0", "1"):
        train(cfg, output_dir=str(tmp_path / "sweep" / job))
    for job in ("0", "1"):
        assert load_checkpoint(tmp_path / "sweep" / job / "ckpt" / "last.pt")["step"] == 1
    assert not (tmp_path / "ckpt").exists()


def test_ddp_syncs_gradients_in_the_last_micro_batch_only(tmp_path, monkeypatch):
    """With train.grad_accum_steps=3, each step's first two micro-batches run under DDP's
    no_sync() and the last does not: the gradients are all-reduced once a step, not once a
    micro-batch (the 2-rank tests check the numbers, which syncing every micro-batch would
    not change). A stand-in for DDP records it, as rank 0 of 2."""
    calls = []

    class RecordingDDP(torch.nn.Module):
        def __init__(self, module, device_ids=None):
            super().__init__()
            self.module, self.syncing = module, True

        def forward(self, x):
            calls.append("sync" if self.syncing else "no_sync")
            return self.module(x)

        @contextlib.contextmanager
        def no_sync(self):
            self.syncing = False
            try:
                yield
            finally:
                self.syncing = True

    cpu = torch.device("cpu")
    monkeypatch.setattr(lm.training, "DistributedDataParallel", RecordingDDP)
    monkeypatch.setattr(lm.distributed, "setup", lambda device: lm.distributed.DistInfo(0, 2, cpu))
    monkeypatch.setattr(lm.distributed, "all_sum", lambda value, info: value.detach().clone())
    monkeypatch.setattr(lm.distributed, "broadcast", lambda obj, info: obj)
    monkeypatch.setattr(lm.distributed, "gather", lambda obj, info: [obj] * info.world_size)
    cfg = compose_cfg(*SMALL, "train.steps=2", "train.eval_every=0", "train.batch_size=3",
                      "train.grad_accum_steps=3", "train.device=cpu")  # fmt: skip
    train(cfg, output_dir=str(tmp_path))
    assert calls == ["no_sync", "no_sync", "sync"] * 2


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.slow
@pytest.mark.parametrize(
    "data, ddp_options, device, loss_rel, norm_rel",
    [
        (SMALL[len(TINY) :], [], "cpu", 1e-5, 1e-4),  # counting: one answer token a row
        # flip-flop: a row has as many answer tokens as reads (1 to 7 here), so the ranks'
        # shares of the batch, and each rank's micro-batches, hold different numbers of targets
        (["data=flipflop", "data.num_instructions=8", "data.seq_len=16",
          "data.eval_samples=16"], ["train.grad_accum_steps=2", "train.compile=true"], "cpu",
         1e-5, 1e-4),
        # NCCL under bf16 autocast: the two runs' matrix products may round differently (other
        # row counts, other kernels); two H200s gave 4e-5 (losses) and 2e-4 (norms) at most
        pytest.param(SMALL[len(TINY) :], [], "cuda", 1e-3, 1e-3,
                     marks=[pytest.mark.gpu, TWO_GPUS]),
    ],
    ids=["counting", "flipflop-micro-batches-compiled", "counting-two-gpus"],
)  # fmt: skip
def test_ddp_two_processes_match_one_process(
    tmp_path, data, ddp_options, device, loss_rel, norm_rel
):
    """Rank r trains on rows r::2 of the global batch: 2 ranks x 2 rows = 1 process x 4 rows,
    the same losses and updates (the loss is a mean over the global batch's target tokens),
    also where each rank runs its rows one at a time (train.grad_accum_steps=2: DDP syncs the
    last micro-batch only) through the compiled model; on the CPU (gloo) exactly, on two GPUs
    (NCCL) to bf16's rounding, where a gradient not averaged over the ranks, or averaged twice,
    would be off by far more."""
    common = [
        *TINY,
        *data,
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        f"train.device={device}",
    ]
    ddp = run_cli(
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        "train.py",
        *common,
        "train.batch_size=2",
        *ddp_options,
        f"hydra.run.dir={tmp_path / 'ddp'}",
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = run_cli("train.py", *common, "train.batch_size=4", f"hydra.run.dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2
    ddp_losses, one_losses = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "one")
    assert [s for s, _ in ddp_losses] == [1, 2, 3, 4]
    assert [loss for _, loss in ddp_losses] == pytest.approx(
        [loss for _, loss in one_losses], rel=loss_rel
    )
    # The gradients too: AdamW would hide a uniformly mis-scaled gradient from the losses.
    norms = [
        [r["train/grad_norm"] for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "lr" in r]
        for d in ("ddp", "one")
    ]
    assert len(norms[0]) == 4 and norms[0] == pytest.approx(norms[1], rel=norm_rel)
    # tokens_per_s counts the global batch's tokens, every rank's
    timed = [load_checkpoint(tmp_path / d / "checkpoint.pt")["state"] for d in ("ddp", "one")]
    assert timed[0]["timed_tokens"] == timed[1]["timed_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def test_ddp_ranks_reading_other_tokens_all_fail(tmp_path, device):
    """Each rank reads its own copy of the data: where rank 1's file differs from rank 0's
    (here through its RANK in the path), every rank raises, before any step, rather than one
    raising and the other waiting for it in a collective (gloo on the CPU, NCCL on GPUs)."""
    for rank in (0, 1):
        (tmp_path / f"corpus{rank}.txt").write_text(f"the text of rank {rank} " * 300)
    files = f"data.files=[{tmp_path}/corpus${{oc.env:RANK}}.txt]"
    ddp = run_cli("-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py",
                  *TINY, "data=text", files, "data.seq_len=32", "train.steps=2",
                  f"train.device={device}", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert ddp.returncode != 0
    # Both ranks raise, and each names both digests
    message = re.findall(
        r"ranks \[1\] read other tokens than rank 0 .*: (\w+), (\w+)\)", ddp.stderr
    )
    assert len(message) == 2 and message[0] == message[1], ddp.stderr[-3000:]
    assert message[0][0] != message[0][1]
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.slow
def test_ddp_ranks_write_one_default_run_dir(tmp_path):
    """Without hydra.run.dir, the ranks of a torchrun launch resolve Hydra's default directory
    (outputs/<date>/<time>, under the directory it is started in) from rank 0's clock: one
    directory, which holds the run, and none of a rank of its own. (torchrun's static
    rendezvous, with --master-port, keeps a store too; not launched here, where a port picked
    ahead could be taken by the time torchrun binds it.) Rank 0 alone writes .hydra/ and
    train.log there."""
    args = [*SMALL, "train.steps=2", "train.eval_every=0", "train.device=cpu"]
    ddp = run_cli("-m", "torch.distributed.run", "--nproc_per_node=2", str(ROOT / "train.py"),
                  *args, cwd=tmp_path)  # fmt: skip
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    (run_dir,) = tmp_path.glob("outputs/*/*")
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    # rank 0 alone writes .hydra/ and train.log; rank 1 logs to a file of its own
    assert sorted(p.name for p in run_dir.glob("*hydra*")) == [".hydra"]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "final |" in (run_dir / "train.log").read_text()
    assert "final |" not in (run_dir / "train_rank1.log").read_text()


@pytest.mark.slow
def test_a_hung_run_prints_its_stacks(tmp_path):
    """train.py's SIGUSR1 prints where each thread is, and run_cli's timeout collects it from
    every rank and leaves no process behind (a run far longer than its timeout stands in for
    a hang). The timeout lets both ranks reach the training loop: on the H200 machine their
    imports took over 15 s, and faulthandler's 100 frames of a deep import stop short of
    train.py's."""
    args = [*SMALL, "train.steps=100000", "train.device=cpu", f"hydra.run.dir={tmp_path}"]
    with pytest.raises(pytest.fail.Exception, match="hung for 40 s") as hung:
        run_cli("-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py",
                *args, timeout=40)  # fmt: skip
    # Each rank's main thread, once: its stack ends at train.py's module level
    assert len(re.findall(r'train\.py", line \d+ in <module>', str(hung.value))) == 2, hung.value
    assert not [pid for pid in process_tree(os.getpid())[1:] if trainer_process(pid)]


@pytest.mark.slow
def test_multirun_and_collect(tmp_path):
    sweep = run_cli(
        "train.py",
        "-m",
        "attention=rope,nope",
        "seed=0,1",
        *SMALL,
        "train.steps=3",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert len(list(tmp_path.glob("*/summary.json"))) == 4
    collect = run_cli("experiments/collect.py", str(tmp_path))
    assert collect.returncode == 0, collect.stderr[-3000:]
    table = (tmp_path / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| attention=")]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| attention=nope", "2"],
        ["| attention=rope", "2"],
    ]
    assert all("±" in r for r in rows) and "Every run: data=counting data.eval_samples=16" in table
    assert "test/err" in table and (tmp_path / "results.png").stat().st_size > 1000


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["rope", "corope"])
def test_gpu_triton_path_trains_like_the_torch_path(attention, tmp_path):
    """On CUDA, ``impl=auto`` takes the kernels; the first steps' losses match the PyTorch
    path's (bf16 autocast both), and the speed fields are filled in."""
    common = [
        *SMALL,
        f"attention={attention}",
        "train.steps=5",
        "train.log_every=1",
        "train.eval_every=0",
    ]
    kernel = train(compose_cfg(*common), output_dir=str(tmp_path / "auto"))
    reference = train(
        compose_cfg(*common, "attention.impl=torch"), output_dir=str(tmp_path / "torch")
    )
    assert kernel["attention_impl"] == "triton" and reference["attention_impl"] == "torch"
    losses = [loss for _, loss in train_losses(tmp_path / "auto")]
    assert losses == pytest.approx([loss for _, loss in train_losses(tmp_path / "torch")], rel=2e-2)
    assert kernel["peak_mem_mib"] > 0 and 0.0 < kernel["attn_time_frac"] < 1.0
    assert kernel["mfu"] is None or 0.0 < kernel["mfu"] < 1.0


@pytest.mark.parametrize("killed", [False, True])
def test_deterministic_algorithms_hold_for_the_run_only(tmp_path, monkeypatch, killed):
    """``train.deterministic=true`` turns ``torch.use_deterministic_algorithms`` on while the
    run trains (Co-RoPE's backward follows that switch), and the process's own setting is back
    once the run returns, or is killed, as is ``CUBLAS_WORKSPACE_CONFIG``."""
    seen, original = [], LMDataset.train_batch

    def spy(self, at, *args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        if killed and at == 2:
            raise KeyboardInterrupt("simulated kill")
        return original(self, at, *args, **kwargs)

    monkeypatch.setattr(LMDataset, "train_batch", spy)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cfg = compose_cfg(*SMALL, "train.deterministic=true", "train.steps=3", "train.eval_every=0")
    try:
        with pytest.raises(KeyboardInterrupt) if killed else contextlib.nullcontext():
            train(cfg, output_dir=str(tmp_path))
        assert seen and all(seen)
        assert not torch.are_deterministic_algorithms_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    finally:  # a regression here must not leave the switch on for the tests that follow
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["rope", "corope"])
def test_gpu_deterministic_mode_refused_by_no_operator(attention, tmp_path):
    """``train.deterministic=true`` on CUDA: no operator of either path refuses the strict
    mode (one without a deterministic implementation would raise), and two runs of one config
    give bitwise-equal losses and weights. What the switch changes does not show here: this
    small run repeats without it too; Co-RoPE's kernels alone do not at 512 tokens (B = 4,
    4/2 heads, D = 64, bf16: dq, dk, dv differ run to run by default and repeat in the
    deterministic mode, H200, session 37), which
    ``tests/corope/test_backward.py::test_backward_deterministic_gpu`` holds."""
    common = [*SMALL, f"attention={attention}", "train.deterministic=true", "train.steps=8",
              "train.log_every=1", "train.eval_every=0"]  # fmt: skip
    for name in ("a", "b"):
        train(compose_cfg(*common), output_dir=str(tmp_path / name))
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
    a, b = (load_checkpoint(tmp_path / name / "checkpoint.pt")["model"] for name in "ab")
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("attention", ["rope", "corope"])
def test_activation_checkpointing_recomputes_each_block_and_trains_the_same_model(
    attention, tmp_path, monkeypatch
):
    """train.activation_checkpointing=true runs each block's forward again in the backward
    (non-reentrant checkpointing, which the attention kernels' backwards support) and trains
    the model the run without it trains: the same losses and gradient norms, dropout's masks
    included (checkpointing replays the RNG), with two micro-batches a step; evaluations and
    generation recompute nothing."""
    calls = []
    forward = lm.model.Block.forward

    def counted(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(lm.model.Block, "forward", counted)
    common = [*SMALL, f"attention={attention}", "model.n_layer=2", "model.dropout=0.1",
              "train.steps=3", "train.log_every=1", "train.eval_every=3",
              "train.grad_accum_steps=2"]  # fmt: skip
    runs = {}
    for flag in ("false", "true"):
        calls.clear()
        train(compose_cfg(*common, f"train.activation_checkpointing={flag}"),
              output_dir=str(tmp_path / flag))  # fmt: skip
        runs[flag] = sum(calls)  # the blocks' forwards with grad: training's
    assert runs == {"false": 3 * 2 * 2, "true": 2 * 3 * 2 * 2}  # steps x micro-batches x layers
    logged = {
        flag: [r[key] for r in read_jsonl(tmp_path / flag / "metrics.jsonl") if "train/loss" in r
               for key in ("train/loss", "train/grad_norm")]
        for flag in runs
    }  # fmt: skip
    assert len(logged["true"]) == 6 and logged["true"] == pytest.approx(logged["false"], rel=1e-6)


@pytest.mark.parametrize(
    "device, attention, options",
    [
        pytest.param("cpu", "rope", [], marks=pytest.mark.slow),
        pytest.param("cuda", "rope", [], marks=pytest.mark.gpu),
        pytest.param("cuda", "corope", [], marks=pytest.mark.gpu),
        pytest.param("cuda", "rope", ["train.compile_mode=reduce-overhead"], marks=pytest.mark.gpu),
        # CUDA graphs, with two micro-batches a step: the first one's gradients, held in .grad
        # while the second replays the graphs, must not be overwritten by that replay
        *(pytest.param("cuda", attention, ["train.compile_mode=reduce-overhead",
                                           "train.grad_accum_steps=2"], marks=pytest.mark.gpu)
          for attention in ("rope", "corope")),
        # the blocks recomputed in the backward: checkpointing traced with the kernels' ops
        *(pytest.param("cuda", attention, ["train.activation_checkpointing=true"],
                       marks=pytest.mark.gpu) for attention in ("rope", "corope")),
    ],
)  # fmt: skip
def test_compiled_run_trains_the_eager_runs_model(device, attention, options, tmp_path):
    """train.compile=true traces each forward into one graph (no break: the attention modules
    hold plain values, not the config), trains and evaluates the eager run's model (its losses,
    up to rounding) and writes a checkpoint that an eager run resumes (the same state_dict
    keys); so does its CUDA-graph mode."""
    from torch._dynamo.utils import counters

    common = [
        *SMALL,
        f"attention={attention}",
        f"train.device={device}",
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=2",
        "train.ckpt_every=2",
    ]
    eager = train(compose_cfg(*common), output_dir=str(tmp_path / "eager"))
    torch._dynamo.reset()
    counters.clear()
    compiled = compose_cfg(*common, "train.compile=true", *options)
    train_killed_at_step(compiled, tmp_path / "compiled", 3)
    assert counters["stats"]["unique_graphs"] >= 1  # it compiled
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["inductor"]["cudagraph_skips"] == 0  # where asked, CUDA graphs ran
    resumed = train(
        compose_cfg(*common, "train.resume=true"), output_dir=str(tmp_path / "compiled")
    )
    assert resumed["steps"] == eager["steps"] == 4
    losses = [loss for _, loss in train_losses(tmp_path / "compiled")]
    rel = 1e-4 if device == "cpu" else 2e-2  # bf16 autocast on CUDA
    assert losses == pytest.approx([loss for _, loss in train_losses(tmp_path / "eager")], rel=rel)
    # The first steps' losses barely move; the gradients' norms would show a lost micro-batch
    norms = [
        [
            r["train/grad_norm"]
            for r in read_jsonl(tmp_path / d / "metrics.jsonl")
            if "train/loss" in r
        ]
        for d in ("eager", "compiled")
    ]
    assert norms[1] == pytest.approx(norms[0], rel=rel)
    evaluations = [  # step 2's evaluation: the compiled model's in the compiled run
        [r for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "valid/loss" in r]
        for d in ("eager", "compiled")
    ]
    assert [r["step"] for r in evaluations[1]] == [2, 4]
    assert evaluations[1][0]["valid/loss"] == pytest.approx(
        evaluations[0][0]["valid/loss"], rel=rel
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options", [[], ["train.compile=true", "train.compile_mode=reduce-overhead"]]
)
def test_peak_memory_is_the_training_steps_not_the_evaluations(tmp_path, options):
    """peak_mem_mib is the most memory a timed training step allocated: evaluations of
    8192-row batches between the steps leave it as it is without them; under CUDA graphs too
    (whose replays allocate nothing: the steps that warm up and record them count), where
    the evaluations' graphs share the training graphs' memory pool."""
    common = [*SMALL, "train.steps=4", "train.eval_every=1", *options]
    light = train(compose_cfg(*common), output_dir=str(tmp_path / "light"))
    heavy = train(
        compose_cfg(*common, "data.eval_samples=8192", "train.eval_batch_size=8192"),
        output_dir=str(tmp_path / "heavy"),
    )
    assert 0 < heavy["peak_mem_mib"] <= 1.05 * light["peak_mem_mib"]


def test_lr_lambda_warms_up_then_decays_to_the_floor():
    """Values written out (the other lr test compares against lr_lambda itself)."""
    assert [lr_lambda(s, 4, 10, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_lambda(4, 4, 10, 0.1) == 1.0  # the cosine starts at 1 after the warmup
    assert lr_lambda(7, 4, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way
    assert lr_lambda(10, 4, 10, 0.1) == pytest.approx(0.1)
    assert lr_lambda(50, 4, 10, 0.1) == pytest.approx(0.1)  # past the end: the floor


def test_grad_clip_bounds_the_applied_gradient(tmp_path, monkeypatch):
    """optim.grad_clip caps the gradient norm AdamW receives; the logged norm is the one
    before clipping (above the cap here), and grad_clip=0 leaves the gradients as they are."""
    seen = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        grads = [
            p.grad for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        seen.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    common = [*SMALL, "train.steps=3", "train.log_every=1", "train.eval_every=0"]
    train(compose_cfg(*common, "optim.grad_clip=1e-3"), output_dir=str(tmp_path / "clip"))
    assert len(seen) == 3 and max(seen) <= 1e-3 * (1 + 1e-5)
    logged = [r["train/grad_norm"] for r in read_jsonl(tmp_path / "clip" / "metrics.jsonl")
              if "lr" in r]  # fmt: skip
    assert min(logged) > 1e-2
    seen.clear()
    train(compose_cfg(*common, "optim.grad_clip=0"), output_dir=str(tmp_path / "off"))
    assert min(seen) > 1e-2


def test_logged_lr_is_the_rate_of_the_step_and_log_every_zero_logs_at_the_end(tmp_path):
    cfg = compose_cfg(
        *SMALL, "train.steps=3", "train.log_every=0", "optim.warmup_steps=4", "optim.lr=1.0"
    )
    train(cfg, output_dir=str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in logged] == [3]  # log_every=0: only the last step
    assert logged[0]["lr"] == pytest.approx(lr_lambda(2, 4, 3, cfg.optim.min_lr_ratio))


def test_writes_are_flushed_to_disk_before_the_move_and_an_interrupt_leaves_no_temporary(
    tmp_path, monkeypatch
):
    """The temporary file is fsync'ed before os.replace moves it over the target (else a
    power loss after the move can leave an empty file); a KeyboardInterrupt mid-write (Ctrl-C,
    a time limit) removes the temporary file as an error does."""
    import lm.checkpoint

    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(lm.checkpoint.os, "fsync", lambda fd: (calls.append("fsync"), fsync(fd)))
    monkeypatch.setattr(
        lm.checkpoint.os, "replace", lambda a, b: (calls.append("replace"), replace(a, b))
    )
    write_json(tmp_path / "run.json", {"step": 1})
    assert calls == ["fsync", "replace"]

    def interrupted_save(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"PK\x03\x04partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "checkpoint.pt", {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_config_changes_name_keys_nested_at_any_depth():
    from lm.checkpoint import config_changes

    saved = {"model": {"scaling": {"factor": 2.0, "type": "yarn"}}, "seed": 0}
    now = {"model": {"scaling": {"factor": 4.0}, "head_dim": None}, "seed": 0}  # null: no change
    assert config_changes(saved, now, lambda key: True) == (
        ["model.scaling.factor: 2.0 -> 4.0"],
        ["model.scaling.type: 'yarn' -> (absent)"],
    )
    # a default for a key saved lacks: compared with it, so a value other than it is a change
    defaults = {"model": {"head_dim": None, "norm_eps": 1e-6}}
    now["model"] |= {"norm_eps": 1e-6, "head_dim": 24}
    assert config_changes(saved, now, lambda key: True, defaults) == (
        ["model.head_dim: None -> 24", "model.scaling.factor: 2.0 -> 4.0"],
        ["model.scaling.type: 'yarn' -> (absent)"],
    )


def test_broadcast_and_all_sum_go_through_the_process_group(monkeypatch):
    """With several ranks, broadcast returns rank 0's object (not this rank's) and all_sum
    the reduced value, leaving its input untouched; one rank calls no collective."""
    from lm.distributed import DistInfo, all_sum, broadcast

    def fake_broadcast(box, src):
        assert src == 0
        box[0] = "rank 0's"

    def fake_all_reduce(t):
        t.mul_(2)  # the sum over two ranks holding the same value

    monkeypatch.setattr(lm.distributed.dist, "broadcast_object_list", fake_broadcast)
    monkeypatch.setattr(lm.distributed.dist, "all_reduce", fake_all_reduce)
    cpu = torch.device("cpu")
    value = torch.tensor(3.0)
    assert broadcast("mine", DistInfo(1, 2, cpu)) == "rank 0's"
    assert all_sum(value, DistInfo(1, 2, cpu)).item() == 6.0 and value.item() == 3.0
    assert broadcast("mine", DistInfo(0, 1, cpu)) == "mine"
    assert all_sum(value, DistInfo(0, 1, cpu)).item() == 3.0


def test_wandb_in_disabled_mode_is_no_service_run(tmp_path):
    """logger.mode=disabled (WANDB_MODE=disabled sets it: tests/lm/test_config.py) sends
    nothing: its logger has no run id, as logger=none, so the checkpoint keeps the service
    run's id and logged.json marks no step as sent (the stand-in run's id had marked them, and
    a resume with the service skipped them: a review's find)."""
    from lm.loggers import WandbLogger

    logger = WandbLogger(project="p", mode="disabled", run_dir=str(tmp_path), name="n",
                         group="g", tags=[], run_config={}, summaries={})  # fmt: skip
    assert logger.run_id is None
    logger.finish({})


def test_wandb_logger_passes_the_run_options(monkeypatch):
    """WandbLogger against a stand-in ``wandb`` module (no account, no network): tags are cut
    to wandb's 64 characters, a resumed run's id is passed on, metrics carry their step and
    the summary its final/ prefix."""
    import types

    from lm.loggers import WandbLogger

    calls = []

    class Run:
        id = "abc123"
        dir = "/tmp/run/files"
        settings = types.SimpleNamespace(mode="offline")
        summary: dict = {}

        def define_metric(self, *args, **kwargs):
            calls.append(("define_metric", args, kwargs))

        def log(self, metrics):
            calls.append(("log", metrics))

        def finish(self, exit_code=0):
            calls.append(("finish", exit_code))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    long_tag = "model.d_model=64," + "x" * 80
    logger = WandbLogger(project="p", mode="offline", run_dir="/tmp/run", name="n", group="g",
                         tags=[long_tag, "seed=1"], run_config={"seed": 1},
                         summaries={"valid/loss": "min"}, run_id="abc123")  # fmt: skip
    (_, init_kwargs), *defines = calls
    assert init_kwargs["tags"] == [long_tag[:64], "seed=1"]
    assert (init_kwargs["id"], init_kwargs["resume"]) == ("abc123", "allow")
    assert logger.run_id == "abc123"
    assert ("define_metric", ("valid/loss",), {"step_metric": "step", "summary": "min"}) in defines
    logger.log({"train/loss": 1.5}, step=7)
    assert calls[-1] == ("log", {"train/loss": 1.5, "step": 7})
    logger.finish({"valid/loss": 1.25})
    assert logger.run.summary == {"final/valid/loss": 1.25} and calls[-1] == ("finish", 0)


def test_triton_impl_off_cuda_is_refused_at_start_up(tmp_path, monkeypatch):
    """``attention.impl=triton`` on the CPU without Triton's interpreter fails before the run
    writes anything, naming the option (it failed at the first forward pass, naming q, after
    a resumed run's summary.json had been removed); with the interpreter it runs."""
    cfg = compose_cfg(*SMALL, "train.device=cpu", "train.steps=2", "train.eval_every=0")
    train(cfg, output_dir=str(tmp_path))
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix != ".lock"}
    cfg.train.resume, cfg.attention.impl = True, "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention.impl=triton needs a CUDA device"):
        train(cfg, output_dir=str(tmp_path))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix != ".lock"} == written


def test_corope_head_dim_its_kernels_lack_is_refused_at_start_up(tmp_path, monkeypatch):
    """Co-RoPE's Triton kernels take head dims 32-256; a model of another (16 here) is refused
    before the run writes anything, naming the model's keys (it failed at step 0, naming D)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # impl=triton on the CPU, on a GPU machine too
    cfg = compose_cfg(*SMALL, "attention=corope", "attention.impl=triton", "train.device=cpu",
                      "model.d_model=64", "model.n_head=4", "model.n_kv_head=2")  # fmt: skip
    with pytest.raises(
        ValueError, match=r"head dims \(32, 64, 128, 256\), got 16 \(model.head_dim"
    ):
        train(cfg, output_dir=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ".lock"] == []


def test_cpu_threads_hold_for_their_run_only(tmp_path):
    """``train.cpu_threads`` sets torch's threads for its run; the next run in the process
    (a sweep's job with ``null``) has the threads there were before (it kept the last run's)."""
    before = torch.get_num_threads()
    cfg = compose_cfg(*SMALL, "train.device=cpu", "train.steps=1", "train.eval_every=0",
                      f"train.cpu_threads={before + 1}")  # fmt: skip
    train(cfg, output_dir=str(tmp_path))
    assert torch.get_num_threads() == before


def test_val_loss_is_the_first_eval_splits_and_best_val_loss_its_minimum(tmp_path):
    """``val_loss`` (a sweep's selection) is the first eval split's loss, valid's, not test's;
    ``best_val_loss`` the least of valid's logged losses."""
    cfg = compose_cfg(*SMALL, "train.device=cpu", "train.steps=4", "train.eval_every=2")
    summary = train(cfg, output_dir=str(tmp_path))
    assert summary["val_loss"] == summary["valid/loss"] != summary["test/loss"]
    valid = [r["valid/loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "valid/loss" in r]
    assert len(valid) == 2 and summary["best_val_loss"] == min(valid)


@pytest.mark.parametrize("head_dim, window", [(None, None), (24, None), (None, 5)])
def test_mfu_counts_the_attention_width_n_head_times_head_dim(
    tmp_path, monkeypatch, head_dim, window
):
    """MFU's attention term is ``6 L (n_head head_dim) N`` per token: with ``model.head_dim``
    that is not ``d_model`` (a peak rate stubbed in, so that the CPU has an MFU); a layer with
    a sliding window counts the pairs it keeps (it counted every causal pair: 64x too many at
    a window of 64 over 8K tokens, a review's find)."""
    import lm.training as training
    from lm.profiling import model_flops_per_token

    monkeypatch.setattr(training, "peak_bf16_flops", lambda device: 1e12)
    cfg = compose_cfg(*SMALL, "train.device=cpu", "train.steps=3", "train.eval_every=0",
                      f"model.head_dim={'null' if head_dim is None else head_dim}",
                      f"attention.window={'null' if window is None else window}")  # fmt: skip
    summary = train(cfg, output_dir=str(tmp_path))
    width = cfg.model.n_head * (head_dim or cfg.model.d_model // cfg.model.n_head)
    dataset = build_dataset(cfg.data)
    model = GPT(cfg.model, cfg.attention, dataset.vocab_size, dataset.max_len)
    seq_len = cfg.data.seq_len  # the counting rows' length, padding included
    windows = [window] * cfg.model.n_layer
    flops = model_flops_per_token(model.matmul_params(), cfg.model.n_layer, width, seq_len, windows)
    assert summary["mfu"] == pytest.approx(flops * summary["tokens_per_s"] / 1e12, rel=1e-6)
    if window is not None:  # fewer flops than without the window
        assert flops < model_flops_per_token(
            model.matmul_params(), cfg.model.n_layer, width, seq_len
        )
