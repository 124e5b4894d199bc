"""TrainerCallback support: events in transformers' order, the objects they get, control flags, clear errors."""

import os

import datasets
import pytest
from transformers import TrainerCallback, TrainerControl

from grouprl import GFPOConfig, GFPOTrainer, GRPOConfig, GRPOTrainer


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def make_config(tmp_path, config_class=GRPOConfig, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=6,
        learning_rate=0.01,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return config_class(**values)


def prompts(n=12):
    return datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(n)]})


class Recorder(TrainerCallback):
    """Records (event, global_step) for every event, and the keyword arguments of each."""

    def __init__(self):
        self.events, self.kwargs = [], {}

    def __getattribute__(self, name):
        if name.startswith("on_"):

            def record(args, state, control, **kwargs):
                self.events.append((name, state.global_step))
                self.kwargs.setdefault(name, []).append(kwargs)

            return record
        return super().__getattribute__(name)


def test_events_fire_in_trainer_order(tiny_model_dir, tmp_path):
    """GA=2, 3 steps per epoch, 4 steps, log and save every 2: the sequence transformers' Trainer produces."""
    recorder = Recorder()
    config = make_config(
        tmp_path, gradient_accumulation_steps=2, max_steps=4, logging_steps=2, save_strategy="steps", save_steps=2
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts(), callbacks=[recorder]
    )
    assert trainer.run.steps_per_epoch == 3
    trainer.train()

    def step(n, *after):
        return [
            ("on_step_begin", n - 1),
            ("on_substep_end", n - 1),
            ("on_pre_optimizer_step", n - 1),
            ("on_optimizer_step", n - 1),
            ("on_step_end", n),
            *[(event, n) for event in after],
        ]

    expected = [
        ("on_init_end", 0),
        ("on_train_begin", 0),
        ("on_epoch_begin", 0),
        *step(1),
        *step(2, "on_log", "on_save"),
        *step(3, "on_epoch_end"),
        ("on_epoch_begin", 3),
        *step(4, "on_log", "on_save", "on_epoch_end"),
        ("on_log", 4),
        ("on_train_end", 4),
    ]  # the end-of-training summary is logged (on_log) before on_train_end
    assert recorder.events == expected
    for kwargs in recorder.kwargs["on_step_end"]:
        assert kwargs["model"] is trainer.model and kwargs["optimizer"] is trainer.optimizer
        assert kwargs["lr_scheduler"] is trainer.lr_scheduler and kwargs["processing_class"] is trainer.processing_class
    logs = [kwargs["logs"] for kwargs in recorder.kwargs["on_log"]]
    assert [entry["step"] for entry in logs] == [2, 4, 4] and all(
        "loss" in entry and "reward" in entry for entry in logs[:2]
    )
    assert "train_loss" in logs[-1]  # the end-of-training summary
    assert sorted(os.listdir(config.output_dir)).count("checkpoint-2") == 1


class Steering(TrainerCallback):
    """Asks for a log and a checkpoint at step 1 and stops training at step 2 (of 5)."""

    def on_step_end(self, args, state, control, **kwargs):
        control.should_log = control.should_save = state.global_step == 1
        control.should_training_stop = state.global_step == 2


def test_control_flags_log_save_and_stop(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, max_steps=5, logging_steps=100)  # neither a log nor a save would be scheduled
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts(), callbacks=[Steering]
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1]
    assert os.path.isdir(os.path.join(config.output_dir, "checkpoint-1"))
    assert not os.path.exists(os.path.join(config.output_dir, "checkpoint-2"))


class ReplacesControl(TrainerCallback):
    """Returns a new TrainerControl (transformers lets a callback replace the control object)."""

    def on_step_end(self, args, state, control, **kwargs):
        return TrainerControl(should_training_stop=True)


def test_returned_control_replaces_the_current_one(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=3),
        train_dataset=prompts(),
        callbacks=[ReplacesControl()],
    )
    trainer.train()
    assert trainer.state.global_step == 1


class EvaluateAtStep2(TrainerCallback):
    def __init__(self):
        self.metrics = []

    def on_step_end(self, args, state, control, **kwargs):
        control.should_evaluate = state.global_step == 2

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append((state.global_step, metrics))


def test_on_evaluate_gets_metrics_and_should_evaluate_runs_evaluation(tiny_model_dir, tmp_path):
    callback = EvaluateAtStep2()
    config = make_config(tmp_path, max_steps=3, eval_strategy="no", per_device_eval_batch_size=6)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        eval_dataset=prompts(3),
        callbacks=[callback],
    )
    trainer.train()
    assert [step for step, _ in callback.metrics] == [2]
    assert {"eval_reward", "eval_loss", "eval_runtime"} <= set(callback.metrics[0][1])
    trainer.evaluate()  # a direct call fires the event too
    assert len(callback.metrics) == 2


def test_add_pop_remove_and_gfpo(tiny_model_dir, tmp_path):
    recorder = Recorder()
    config = make_config(tmp_path, GFPOConfig, num_remains_in_group=2, max_steps=1)
    trainer = GFPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        callbacks=[Steering],
        group_filter_func=lambda group_completions, group_rewards, **kw: group_rewards,
    )
    trainer.add_callback(recorder)
    assert isinstance(trainer.pop_callback(Steering), Steering)
    assert trainer.pop_callback(Steering) is None
    trainer.add_callback(Steering)
    trainer.remove_callback(Steering)
    assert trainer.callback_handler.callbacks == [recorder]
    trainer.train()
    assert ("on_train_end", 1) in recorder.events


def test_bad_callbacks_are_named(tiny_model_dir, tmp_path):
    with pytest.raises(
        TypeError, match=r"callbacks: builtin_function_or_method has no on_step_end, on_log method.*TrainerCallback"
    ):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path),
            train_dataset=prompts(),
            callbacks=[len],
        )

    # A callback reading a field no GRPOConfig has: the error names the callback, the
    # event and the field, not a deep trace.
    class ReadsUnknownField(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            return args.no_such_training_argument

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path),
        train_dataset=prompts(),
        callbacks=[ReadsUnknownField()],
    )
    with pytest.raises(
        AttributeError, match=r"ReadsUnknownField.on_train_begin reads GRPOConfig.no_such_training_argument"
    ):
        trainer.train()
