"""Statistics with declared reductions (stats.py, step_reduction.py).

Unit tests reduce hand-made entries of two simulated processes (each process's packed tensors are combined as the
all-reduce would combine them) against hand-computed values. The 2-process tests train on 2 real CPU processes
(gloo, tests/stats_worker.py) and check what the main process logged against every process's local values.
"""

import math
import os
from dataclasses import dataclass

import pytest
import torch
from test_distributed import launch

from grouprl.core.stats import MAX, MEAN, MIN, Stat, finite, largest, mean, metrics, smallest, total
from grouprl.train.micro_step import LossStats, objective_stats
from grouprl.train.non_finite import NonFiniteError, describe_non_finite, non_finite_error
from grouprl.train.step_reduction import Collectives, first_failure_of, reduce_step

WORKER = os.path.join(os.path.dirname(__file__), "stats_worker.py")


@dataclass(frozen=True)
class Example:
    tokens: float = None
    rows: float = None
    token_mean: float = mean("token_mean", weight="tokens")
    process_mean: float = mean("process_mean")
    count: float = total("count")
    low: float = smallest("low")
    high: float = largest("high")
    advantages: torch.Tensor = finite("advantages")


class Recorded(Collectives):
    """One simulated process: remembers the tensors it would all-reduce (and returns them unchanged)."""

    def __init__(self, process_index):
        super().__init__(num_processes=2, process_index=process_index)
        self.sent = {}

    def all_reduce(self, tensor, op):
        self.sent[op] = tensor.clone()
        self.collectives += 1
        return tensor


class Combined(Collectives):
    """The other simulated process: its all-reduce combines its tensors with the recorded process's."""

    def __init__(self, process_index, other: Recorded):
        super().__init__(num_processes=2, process_index=process_index)
        self.other = other

    def all_reduce(self, tensor, op):
        self.collectives += 1
        theirs = self.other.sent[op]
        return tensor + theirs if op == "sum" else torch.maximum(tensor, theirs)


def reduce_as(process_index, mine, theirs):
    """What process `process_index` gets from reduce_step (and its Collectives)
    when the other process recorded `theirs`."""
    recorded = Recorded(1 - process_index)
    reduce_step(theirs, recorded)
    combined = Combined(process_index, recorded)
    return reduce_step(mine, combined), combined


def reduce_two(entries0, entries1):
    return reduce_as(0, entries0, entries1)


def test_declared_reductions_hand_computed_over_two_processes():
    p0 = [
        Example(tokens=3.0, token_mean=0.5, process_mean=1.0, count=2.0, low=0.25, high=4.0, advantages=torch.zeros(3))
    ]
    p1 = [
        Example(tokens=1.0, token_mean=0.1, process_mean=3.0, count=5.0, low=0.75, high=9.0, advantages=torch.zeros(2))
    ]
    (reduced, failures), collectives = reduce_two(p0, p1)
    assert failures == []
    assert metrics(reduced[0]) == pytest.approx(
        {
            "token_mean": (0.5 * 3 + 0.1 * 1) / 4,  # 0.4, weighted by tokens (an unweighted mean would be 0.3)
            "process_mean": 2.0,
            "count": 7.0,
            "low": 0.25,  # min over both processes, not their mean 0.5
            "high": 9.0,
        }
    )
    assert collectives.collectives == 2 and collectives.host_syncs == 2  # one SUM and one MAX, each read once


def test_nan_values_are_left_out_and_an_empty_reduction_is_nan():
    p0 = [Example(tokens=2.0, token_mean=math.nan, process_mean=math.nan, low=math.nan, high=math.nan)]
    p1 = [Example(tokens=2.0, token_mean=0.2, process_mean=4.0, low=0.5, high=math.nan)]
    (reduced, _), _ = reduce_two(p0, p1)
    values = metrics(reduced[0])
    assert values["token_mean"] == pytest.approx(0.2) and values["process_mean"] == 4.0 and values["low"] == 0.5
    assert math.isnan(values["high"])  # no process had a value


def test_each_entry_is_reduced_separately_in_recording_order():
    p0 = [Example(process_mean=1.0, low=1.0), Example(process_mean=10.0, low=-2.0)]
    p1 = [Example(process_mean=3.0, low=0.0), Example(process_mean=20.0, low=5.0)]
    (reduced, _), _ = reduce_two(p0, p1)
    assert [metrics(r) for r in reduced] == [{"process_mean": 2.0, "low": 0.0}, {"process_mean": 15.0, "low": -2.0}]


def test_a_finite_check_names_every_process_that_failed():
    p0 = [Example(advantages=torch.tensor([0.0, 1.0]))]
    p1 = [Example(advantages=torch.tensor([0.0, math.inf, math.nan]))]
    (_, failures), _ = reduce_two(p0, p1)
    assert [(f.check, f.processes) for f in failures] == [("advantages", (1,))]
    (_, failures), _ = reduce_as(1, p1, p0)  # seen from the failing process: its own entry, to describe
    assert failures[0].processes == (1,) and failures[0].entry is p1[0]


def test_one_process_reduces_without_collectives():
    collectives = Collectives()
    reduced, failures = reduce_step([Example(tokens=2.0, token_mean=0.5, low=3.0, count=1.0)], collectives)
    assert metrics(reduced[0]) == {"token_mean": 0.5, "count": 1.0, "low": 3.0} and failures == []
    assert collectives.collectives == 0 and collectives.host_syncs == 2


def test_loss_statistics_declare_min_max_and_token_weighted_means():
    tokens = torch.tensor(8.0)
    declared = objective_stats(
        {
            "clip_ratio/low_min": 0.1,
            "clip_ratio/high_max": 0.2,
            "policy_ratio/min": 0.9,
            "policy_ratio/max": 1.1,
            "clip_ratio/low_mean": 0.3,
            "kl": 0.4,
            "policy_loss": 0.5,
        },
        tokens,
        2.0,
        sequence_level=False,
    )
    assert {name: stat.reduce for name, stat in declared.items()} == {
        "clip_ratio/low_min": MIN,
        "clip_ratio/high_max": MAX,
        "policy_ratio/min": MIN,
        "policy_ratio/max": MAX,
        "clip_ratio/low_mean": MEAN,
        "kl": MEAN,
        "policy_loss": MEAN,
    }
    assert declared["clip_ratio/low_mean"].weight is tokens and declared["policy_loss"].weight == 1.0
    per_sequence = objective_stats({"clip_ratio/low_mean": 0.3, "kl": 0.4}, tokens, 2.0, sequence_level=True)
    assert per_sequence["clip_ratio/low_mean"].weight == 2.0 and per_sequence["kl"].weight is tokens
    with pytest.raises(ValueError, match="Stat.reduce must be one of"):
        Stat(1.0, "median")
    # two processes: token-weighted entropy, min of mins
    stats = [
        LossStats(tokens=torch.tensor(t), entropy=torch.tensor(e), objective={"policy_ratio/min": Stat(m, MIN)})
        for t, e, m in ((6.0, 1.0, 0.8), (2.0, 3.0, 0.6))
    ]
    (reduced, _), _ = reduce_two([stats[0]], [stats[1]])
    assert metrics(reduced[0]) == pytest.approx({"entropy": 1.5, "policy_ratio/min": 0.6})


def test_non_finite_error_is_the_same_on_every_process_and_names_the_failing_one():
    p0 = [LossStats(loss=torch.tensor(1.0), loss_inputs={"advantages": torch.tensor(True)})]
    p1 = [
        LossStats(
            loss=torch.tensor(math.nan),
            loss_inputs={"advantages": torch.tensor(True), "policy log-probabilities": torch.tensor(False)},
        )
    ]
    (_, failures0), _ = reduce_as(0, p0, p1)
    (_, failures1), _ = reduce_as(1, p1, p0)
    assert (
        [(f.check, f.processes) for f in failures0] == [("loss", (1,))] == [(f.check, f.processes) for f in failures1]
    )
    sentence = describe_non_finite(first_failure_of(failures1, 1), 4)  # only process 1 can describe its tensors
    assert first_failure_of(failures0, 0) is None
    # `gather` stands for gather_objects: [process 0's sentence, process 1's]
    error0 = non_finite_error(failures0, step=4, process_index=0, num_processes=2, gather=lambda mine: [mine, sentence])
    error1 = non_finite_error(failures1, step=4, process_index=1, num_processes=2, gather=lambda mine: [None, mine])
    assert isinstance(error0, NonFiniteError) and str(error0) == str(error1)
    assert str(error0) == (
        "Non-finite values on process 1 of 2 at step 4; every process stopped before the update:\n"
        "  process 1: The loss is nan at step 4; non-finite inputs: policy log-probabilities. The update was not "
        "applied. Usually weights or activations overflowed: lower learning_rate, keep max_grad_norm > 0, prefer bf16 "
        "to fp16; non-finite reference log-probabilities point at the reference model."
    )


# ---- 2 real processes ---------------------------------------------------------------------------------------------


def _two_processes(tiny_model_dir, tmp_path, scenario, timeout=240):
    result = launch(2, [WORKER, str(tmp_path), str(tiny_model_dir), scenario], timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [torch.load(tmp_path / f"{scenario}-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.e2e
def test_two_processes_log_min_max_and_sampler_statistics_over_every_process(tiny_model_dir, tmp_path):
    rank0, rank1 = _two_processes(tiny_model_dir, tmp_path, "stats")
    assert rank0["processes"] == 2
    entries = [e for e in rank0["log_history"] if "loss" in e and "train_runtime" not in e]
    assert len(entries) == 2
    # (b) the sampler IS statistics of the one generation (step 1) cover both processes, whose values differ
    is0, is1 = rank0["is_stats"][0], rank1["is_stats"][0]
    name = "sampling/importance_sampling_ratio/"
    assert (
        is1[name + "min"] < is0[name + "min"] and is0[name + "max"] != is1[name + "max"]
    )  # the main process's own min is not the answer
    logged = entries[0]
    assert logged[name + "min"] == pytest.approx(min(is0[name + "min"], is1[name + "min"]), rel=1e-5)
    assert logged[name + "max"] == pytest.approx(max(is0[name + "max"], is1[name + "max"]), rel=1e-5)
    assert logged[name + "mean"] == pytest.approx((is0[name + "mean"] + is1[name + "mean"]) / 2, rel=1e-5)
    gap = "sampling/sampling_logp_difference/max"
    assert logged[gap] == pytest.approx(max(is0[gap], is1[gap]), rel=1e-5)
    # (a) step 2 trains the same samples after an update: each process's ratios differ, and min / max are over all rows
    local0, local1 = rank0["loss_stats"][1], rank1["loss_stats"][1]
    assert (
        local0["policy_ratio/min"] != local1["policy_ratio/min"]
        and local0["policy_ratio/max"] != local1["policy_ratio/max"]
    )
    step2 = entries[1]
    assert step2["policy_ratio/min"] == pytest.approx(
        min(local0["policy_ratio/min"], local1["policy_ratio/min"]), rel=1e-5
    )
    assert step2["policy_ratio/max"] == pytest.approx(
        max(local0["policy_ratio/max"], local1["policy_ratio/max"]), rel=1e-5
    )
    assert step2["policy_ratio/min"] != pytest.approx(
        (local0["policy_ratio/min"] + local1["policy_ratio/min"]) / 2, rel=1e-6
    )
    weighted = (local0["policy_ratio/mean"] * local0["tokens"] + local1["policy_ratio/mean"] * local1["tokens"]) / (
        local0["tokens"] + local1["tokens"]
    )
    assert step2["policy_ratio/mean"] == pytest.approx(weighted, rel=1e-5)  # TRL's global mean over loss tokens
    # no collective while a micro-batch's loss and statistics are computed (there were 9 per micro-step); the loop
    # reduces everything in one SUM and one MAX all-reduce per optimizer step
    assert rank0["loss_collectives"] == [0, 0] == rank1["loss_collectives"]
    assert rank0["step_collectives"] == 2 * 2 == rank1["step_collectives"]
    for key in ("clip_ratio/low_min", "clip_ratio/high_max"):
        reduce = min if key.endswith("min") else max
        values = [v for v in (local0[key], local1[key]) if not math.isnan(v)]
        assert step2[key] == pytest.approx(reduce(values), rel=1e-5) if values else math.isnan(step2[key])


@pytest.mark.e2e
def test_a_nan_on_the_second_process_stops_both_with_the_same_error(tiny_model_dir, tmp_path):
    rank0, rank1 = _two_processes(tiny_model_dir, tmp_path, "nan", timeout=240)  # a hang would time out
    assert rank0["error"] is not None and rank0["error"] == rank1["error"]
    message = rank0["error"]
    assert (
        "Non-finite values on process" in message
        and "of 2 at step 2; every process stopped before the update" in message
    )
    assert "process 1: The loss is nan at step 2; non-finite inputs: policy log-probabilities." in message
    assert (
        "process 0: The loss" not in message
    )  # process 0's loss was finite (its gradients were not: DDP averaged the NaN in)
    assert rank0["global_step"] == rank1["global_step"] == 1  # neither applied the NaN update
