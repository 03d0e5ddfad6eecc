"""lm/evaluation.py: the definitions of the held-out metrics, on hand-made rows."""

import math
import types
import warnings

import pytest
import torch
import torch.nn as nn

from lm.data import IGNORE_INDEX
from lm.evaluation import autocast, evaluate, evaluate_split

CPU = torch.device("cpu")
V = 5


class NextTokenTable(nn.Module):
    """Fixed logits per input token whose argmax is always ``(token + 1) % V``."""

    def __init__(self) -> None:
        super().__init__()
        table = torch.randn(V, V)
        for t in range(V):
            table[t, (t + 1) % V] = table[t].max() + 1.0
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x]  # (B, L, V)


def expected_loss(model: NextTokenTable, pairs: list[tuple[int, int]]) -> float:
    """The mean cross-entropy over the (input token, target) pairs, in float64."""
    logp = torch.log_softmax(model.table.double(), dim=-1)
    return -sum(logp[t, y].item() for t, y in pairs) / len(pairs)


def test_task_metrics_are_token_and_sequence_rates_over_the_target_tokens():
    """loss and acc are per target token, seq_acc per row with a target (all of its answer
    tokens right), err = 1 - seq_acc; rows without a target and ignored positions count
    nowhere, and the sums run over every batch. A row with 3 of 3 answers right and one with
    1 of 2 (in two batches, beside a row with no target): seq_acc 1/2 (not 1, as "any answer
    token right" would give, nor 1/3 counting the empty row), acc 4/5, loss = the summed
    cross-entropy / 5 target tokens (not / 2 rows, nor the mean of the two batches' means:
    the batches hold 3 and 2 targets)."""
    I = IGNORE_INDEX
    model = NextTokenTable()
    all_right = ([0, 1, 2, 3], [I, 2, 3, 4])  # 1 -> 2, 2 -> 3 and 3 -> 4: hits
    no_target = ([4, 4, 4, 4], [I, I, I, I])
    one_right = ([1, 2, 3, 0], [I, I, 4, 2])  # 3 -> 4 a hit, 0 -> 1 not the 2 wanted
    batches = [
        tuple(torch.tensor(rows) for rows in zip(all_right, no_target, strict=True)),
        tuple(torch.tensor([rows]) for rows in one_right),
    ]
    metrics = evaluate_split(model, batches, "task", CPU)
    assert set(metrics) == {"loss", "acc", "seq_acc", "err"}
    assert metrics["seq_acc"] == 0.5 and metrics["err"] == 0.5
    assert metrics["acc"] == 0.8
    pairs = [(1, 2), (2, 3), (3, 4), (3, 4), (0, 2)]
    assert metrics["loss"] == pytest.approx(expected_loss(model, pairs), rel=1e-6)
    batch_means = (expected_loss(model, pairs[:3]) + expected_loss(model, pairs[3:])) / 2
    assert metrics["loss"] != pytest.approx(batch_means, rel=1e-3)


def test_lm_metrics_and_evaluate_keys_per_split():
    """A language corpus reports loss, acc and ppl = exp(loss) (no seq_acc); ``evaluate``
    names them ``<split>/<metric>`` for every split and puts the model back in train mode."""
    model = NextTokenTable().train()
    x = torch.tensor([[0, 1, 2, 3], [3, 3, 1, 0]])
    y = torch.tensor([[1, 2, 3, 4], [4, 0, 2, 1]])  # hits everywhere but 3 -> 0
    dataset = types.SimpleNamespace(
        kind="lm",
        eval_splits=lambda: ["valid", "test"],
        eval_batches=lambda split, batch_size: iter([(x, y)] if split == "valid" else [(x, x)]),
    )
    metrics = evaluate(model, dataset, batch_size=2, device=CPU)
    assert model.training
    assert sorted(metrics) == sorted(
        f"{s}/{m}" for s in ("valid", "test") for m in ("loss", "acc", "ppl")
    )
    pairs = [(int(t), int(u)) for t, u in zip(x.flatten(), y.flatten(), strict=True)]
    assert metrics["valid/acc"] == 7 / 8
    assert metrics["valid/loss"] == pytest.approx(expected_loss(model, pairs), rel=1e-6)
    for split in ("valid", "test"):
        assert metrics[f"{split}/ppl"] == pytest.approx(math.exp(metrics[f"{split}/loss"]))
    assert metrics["test/acc"] == 0.0 and metrics["test/loss"] != metrics["valid/loss"]


class ModeRecorder(NextTokenTable):
    """NextTokenTable that records whether it ran in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return super().forward(x)


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_runs_in_eval_mode_and_restores_the_mode(training):
    """Dropout must be off while evaluating, and the model comes back in the mode it had."""
    model = ModeRecorder().train(training)
    x = torch.tensor([[0, 1, 2]])
    dataset = types.SimpleNamespace(
        kind="lm", eval_splits=lambda: ["valid"], eval_batches=lambda s, b: iter([(x, x)])
    )
    evaluate(model, dataset, batch_size=1, device=CPU)
    assert model.modes == [False] and model.training == training


def test_a_diverged_model_gets_a_finite_ppl_and_a_split_without_targets_is_an_error():
    """ppl = exp(loss) saturates at exp(700) rather than overflowing (a diverged run's
    evaluation must still be written); a split whose every target is ignored is an error."""
    model = NextTokenTable()
    model.table.mul_(1e4)  # the wrong tokens' logits are ~1e4 below the argmax
    x, y = torch.tensor([[0, 1]]), torch.tensor([[2, 3]])  # targets that are not the argmax
    metrics = evaluate_split(model, [(x, y)], "lm", CPU)
    assert metrics["loss"] > 710 and metrics["ppl"] == math.exp(700.0)
    with pytest.raises(ValueError, match="no target tokens"):
        evaluate_split(model, [(x, torch.full_like(y, IGNORE_INDEX))], "task", CPU)


@pytest.mark.parametrize("kind", ["language", "LM", None])
def test_an_unknown_kind_is_refused_before_the_batches_run(kind):
    """A kind that is neither "lm" nor "task" got the task metrics silently (a review's find)."""

    def batches():
        raise AssertionError("a batch ran")
        yield

    with pytest.raises(ValueError, match="kind must be 'lm' or 'task'"):
        evaluate_split(NextTokenTable(), batches(), kind, CPU)


def test_err_is_one_minus_seq_acc():
    """A single row with every answer right: seq_acc 1, err 0 (at seq_acc 1/2 the two agree)."""
    I = IGNORE_INDEX
    x, y = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[I, 2, 3, 4]])
    metrics = evaluate_split(NextTokenTable(), [(x, y)], "task", CPU)
    assert metrics["seq_acc"] == 1.0 and metrics["err"] == 0.0


class Bf16Table(NextTokenTable):
    """bf16 logits, as the model gives under CUDA's autocast."""

    def forward(self, x):
        return super().forward(x).bfloat16()


def test_bf16_logits_are_scored_in_fp32():
    """The cross-entropy of bf16 logits (CUDA autocast) is computed in fp32, not bf16."""
    model = Bf16Table()
    model.table.copy_(model.table.bfloat16().float())  # the logits the loss sees, exactly
    x = torch.tensor([[0, 1, 2, 3], [3, 3, 1, 0]])
    y = torch.tensor([[1, 2, 3, 4], [4, 0, 2, 1]])
    metrics = evaluate_split(model, [(x, y)], "lm", CPU)
    pairs = [(int(t), int(u)) for t, u in zip(x.flatten(), y.flatten(), strict=True)]
    assert metrics["loss"] == pytest.approx(expected_loss(model, pairs), rel=1e-6)


def test_the_loss_sums_in_fp64_over_batches():
    """A first batch of loss 2^24 (one token) then one of log 2: in fp32 the second would
    vanish from the sum (its spacing at 2^24 is 2); the mean over the 2 tokens keeps it."""
    model = NextTokenTable()
    model.table.zero_()
    model.table[0, 1] = 2.0**24  # input 0, target 0: loss 2^24 exactly; input 1: log V
    x = torch.tensor([[0]]), torch.tensor([[1]])
    batches = [(x[0], torch.tensor([[0]])), (x[1], torch.tensor([[0]]))]
    metrics = evaluate_split(model, batches, "lm", CPU)
    assert metrics["loss"] == pytest.approx((2.0**24 + math.log(V)) / 2, rel=1e-12)


def test_autocast_is_bf16_on_cuda_and_nothing_on_the_cpu():

    with warnings.catch_warnings():  # CPU-only torch warns that it disables autocast
        warnings.simplefilter("ignore")
        cuda = autocast(torch.device("cuda"))
    assert isinstance(cuda, torch.autocast) and cuda.fast_dtype == torch.bfloat16
    assert not isinstance(autocast(CPU), torch.autocast)
