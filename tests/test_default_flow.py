"""When the loop logs, evaluates and saves (train/default_flow.py) against transformers' own DefaultFlowCallback, called
as Trainer's loop calls it, over a table of strategies, intervals, run lengths, epoch sizes and callback stops."""

import itertools

import pytest
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import DefaultFlowCallback

from grouprl import GRPOConfig
from grouprl.train.default_flow import StepEnd, step_end


def trainers_flow(config, total, per_epoch, stop_at):
    """Trainer's loop: DefaultFlowCallback.on_step_end after every step (a later callback may stop training there),
    then on_epoch_end at an epoch's last step or where training stops; the flags are acted on and reset after each
    (Trainer._maybe_log_save_evaluate). One StepEnd per step trained."""
    flow, state, control = DefaultFlowCallback(), TrainerState(), TrainerControl()
    state.max_steps = total
    state.compute_steps(config, total)
    ends = []
    for step in range(1, total + 1):
        state.global_step, state.epoch = step, step / per_epoch
        control = flow.on_step_end(config, state, control)
        control.should_training_stop = control.should_training_stop or step == stop_at
        asked = [control.should_log, control.should_evaluate, control.should_save]
        control.should_log = control.should_evaluate = control.should_save = False
        if step % per_epoch == 0 or control.should_training_stop:
            control = flow.on_epoch_end(config, state, control)
            asked = [a or b for a, b in zip(asked, (control.should_log, control.should_evaluate, control.should_save))]
            control.should_log = control.should_evaluate = control.should_save = False
        ends.append(StepEnd(*asked))
        if control.should_training_stop:
            break
    return ends


def grouprls_flow(config, total, per_epoch, stop_at):
    ends = []
    for step in range(1, total + 1):
        ends.append(step_end(config, step, total, per_epoch, stopped=step == stop_at))
        if step == stop_at:
            break
    return ends


STRATEGIES = [
    # (save_strategy, save_steps, eval_strategy, eval_steps, eval_delay)
    ("steps", 2, "steps", 2, 0),
    ("steps", 3, "steps", 3, 0),
    ("steps", 0.5, "steps", 0.3, 0),
    ("steps", 1, "steps", 4, 4),
    ("steps", 2, "steps", 2, 5),
    ("epoch", 500, "epoch", None, 0),
    ("epoch", 500, "epoch", None, 1),
    ("no", 500, "no", None, 0),
    ("steps", 4, "epoch", None, 0),
    ("epoch", 500, "steps", 3, 0),
]


@pytest.mark.parametrize("save_strategy, save_steps, eval_strategy, eval_steps, eval_delay", STRATEGIES)
def test_the_loop_logs_evaluates_and_saves_where_trainer_does(
    tmp_path, save_strategy, save_steps, eval_strategy, eval_steps, eval_delay
):
    compared = 0
    for total, per_epoch, stop_at, logging, first in itertools.product(
        (3, 4, 7), (3, 5, 100), (None, 2), ("steps", "epoch"), (False, True)
    ):
        config = GRPOConfig(
            output_dir=str(tmp_path),
            max_steps=total,
            save_strategy=save_strategy,
            save_steps=save_steps,
            eval_strategy=eval_strategy,
            eval_steps=eval_steps,
            eval_delay=eval_delay,
            logging_strategy=logging,
            logging_steps=2,
            logging_first_step=first,
        )
        expected = trainers_flow(config, total, per_epoch, stop_at)
        assert grouprls_flow(config, total, per_epoch, stop_at) == expected, (total, per_epoch, stop_at, logging)
        compared += len(expected)
    assert compared > 100


def test_the_last_step_is_saved_and_evaluated():
    """The issue's cases by hand: save_steps=2 with max_steps=3 saves 2 and 3; eval_steps=2 evaluates at 2 and 3;
    save_strategy='epoch' with max_steps inside the first epoch saves at the last step."""
    config = GRPOConfig(output_dir="x", max_steps=3, save_steps=2, eval_strategy="steps", eval_steps=2)
    assert [(e.evaluate, e.save) for e in grouprls_flow(config, 3, 10, None)] == [
        (False, False),
        (True, True),
        (True, True),
    ]
    by_epoch = GRPOConfig(output_dir="x", max_steps=3, save_strategy="epoch")
    assert [e.save for e in grouprls_flow(by_epoch, 3, 10, None)] == [False, False, True]
