"""GRPOConfig as a transformers.TrainingArguments: every inherited field honoured
(effect visible), inert, or refused by name."""

import dataclasses
import json
import logging
import os

import pytest
import torch
from helpers import distinct_tokens, quiet_config
from helpers import numbered_prompts as prompts
from transformers import (
    AutoModelForCausalLM,
    EarlyStoppingCallback,
    HfArgumentParser,
    TrainerCallback,
    TrainingArguments,
)

import grouprl.compat.trainer
import grouprl.compat.trainer_parts
import grouprl.train.loop
from grouprl import GRPOConfig, GRPOTrainer
from grouprl.config.training_arguments import HONOURED, INERT, REFUSED, compat_table


def make_config(tmp_path, **overrides):
    return quiet_config(
        tmp_path, overrides, per_device_train_batch_size=6, max_completion_length=6, learning_rate=0.05, max_steps=2
    )


def test_every_training_argument_has_one_status():
    names = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    groups = [set(HONOURED), set(INERT), set(REFUSED)]
    assert not (groups[0] & groups[1]) and not (groups[0] & groups[2]) and not (groups[1] & groups[2])
    assert names <= groups[0] | groups[1] | groups[2], sorted(names - (groups[0] | groups[1] | groups[2]))
    assert issubclass(GRPOConfig, TrainingArguments)
    rows = {name: status for name, status, _ in compat_table(GRPOConfig)}
    assert (
        rows["torch_compile"] == "refused unless default"
        and rows["eval_on_start"] == "honoured"
        and rows["beta"] == "GRPO field"
    )


@pytest.mark.parametrize(
    "name,value",
    [
        ("torch_compile", True),
        ("neftune_noise_alpha", 5.0),
        ("auto_find_batch_size", True),
        ("label_smoothing_factor", 0.1),
        ("hub_strategy", "checkpoint"),
        ("include_for_metrics", ["loss"]),
    ],
)
def test_refused_fields_are_named_with_a_reason(name, value):
    with pytest.raises(
        ValueError, match=rf"GRPOConfig\.{name}=.* is not supported by grouprl: .+Leave {name} at its default"
    ):
        GRPOConfig(**{name: value})


def test_inert_fields_are_accepted():
    config = GRPOConfig(do_train=True, do_eval=True, do_predict=True, dataloader_pin_memory=False, local_rank=0)
    assert config.do_train and config.do_predict


def test_misspelt_field_names_the_closest():
    with pytest.raises(TypeError, match=r"GRPOConfig has no field 'num_generation'\. Did you mean 'num_generations'\?"):
        GRPOConfig(num_generation=4)
    with pytest.raises(TypeError, match=r"has no field 'zzz_unknown'\. Every field"):
        GRPOConfig(zzz_unknown=1)


def test_training_arguments_machinery():
    parser = HfArgumentParser(GRPOConfig)
    (config,) = parser.parse_args_into_dataclasses(
        args=[
            "--output_dir",
            "x",
            "--logging_strategy",
            "epoch",
            "--eval_on_start",
            "true",
            "--ddp_timeout",
            "60",
            "--optim",
            "adafactor",
            "--warmup_ratio",
            "0.1",
        ]
    )
    assert (config.logging_strategy, config.eval_on_start, config.ddp_timeout, config.optim) == (
        "epoch",
        True,
        60,
        "adafactor",
    )
    assert config.warmup_steps == 0.1
    as_json = json.loads(config.to_json_string())
    assert as_json["logging_strategy"] == "epoch" and as_json["num_generations"] == 8 and as_json["loss_type"] == "dapo"
    assert config.world_size == 1 and config.process_index == 0 and config.device.type in ("cpu", "cuda")
    with config.main_process_first():
        pass
    # TRL resolves the generation batch in the config
    assert (
        GRPOConfig(
            per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4
        ).generation_batch_size,
        GRPOConfig(per_device_train_batch_size=4, generation_batch_size=16, num_generations=4).steps_per_generation,
    ) == (8, 4)


@pytest.mark.parametrize("optim,expected", [("adamw_torch", "AdamW"), ("adafactor", "Adafactor"), ("sgd", "SGD")])
def test_any_transformers_optimizer_name(tiny_model_dir, tmp_path, optim, expected):
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, optim=optim, max_steps=1),
        train_dataset=prompts(),
    )
    assert (
        type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__name__
        == expected
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_logging_strategy_eval_on_start_and_eval_delay(tiny_model_dir, tmp_path):
    # 4 prompts, 2 per generation, 1 optimizer step per generation: 2 steps per epoch
    config = make_config(
        tmp_path,
        max_steps=4,
        logging_strategy="epoch",
        eval_strategy="steps",
        eval_steps=1,
        eval_delay=3,
        eval_on_start=True,
        per_device_eval_batch_size=3,
    )
    trainer = GRPOTrainer(
        tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts(4), eval_dataset=prompts(2)
    )
    trainer.train()
    train_steps = [
        e["step"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e and "eval_reward" not in e
    ]
    eval_steps = [e["step"] for e in trainer.state.log_history if "eval_reward" in e]
    assert train_steps == [2, 4]
    assert eval_steps == [0, 3, 4]


def test_logging_strategy_no_logs_no_steps(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, logging_strategy="no"),
        train_dataset=prompts(),
    )
    trainer.train()
    assert [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e] == []


def test_save_only_model_checkpoints_cannot_resume(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, save_strategy="steps", save_steps=1, save_only_model=True)
    GRPOTrainer(tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts()).train()
    checkpoint = os.path.join(config.output_dir, "checkpoint-2")
    assert os.path.exists(os.path.join(checkpoint, "trainer_state.json"))
    assert not os.path.exists(os.path.join(checkpoint, "training_state.pt"))
    AutoModelForCausalLM.from_pretrained(checkpoint)  # the model is there
    resumed = GRPOTrainer(
        tiny_model_dir, reward_funcs=distinct_tokens, args=make_config(tmp_path, max_steps=3), train_dataset=prompts()
    )
    with pytest.raises(ValueError, match="save_only_model=True.*cannot resume"):
        resumed.train(resume_from_checkpoint=checkpoint)


def step_shaped_reward(completion_ids, trainer_state, **kwargs):
    """Constant within a call; over steps its evaluation peaks at step 2 (-100 |step - 2|)."""
    return [-100.0 * abs(trainer_state.global_step - 2)] * len(completion_ids)


class StopAfter(TrainerCallback):
    """Ends training after optimizer step `step`, as a preempted run would have stopped there."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def best_tracking_config(tmp_path, **overrides):
    return make_config(
        tmp_path,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        per_device_eval_batch_size=3,
        load_best_model_at_end=True,
        metric_for_best_model="reward",
        **overrides,
    )


def best_tracking_trainer(tiny_model_dir, config, callbacks):
    return GRPOTrainer(
        tiny_model_dir,
        reward_funcs=[distinct_tokens, step_shaped_reward],
        args=config,
        train_dataset=prompts(),
        eval_dataset=prompts(2),
        callbacks=callbacks,
    )


def test_load_best_model_at_end_keeps_and_loads_the_best_checkpoint(tiny_model_dir, tmp_path):
    config = best_tracking_config(tmp_path, save_total_limit=1)
    config.max_steps = 4
    assert config.greater_is_better is True  # transformers: True unless the name ends in "loss"
    trainer = best_tracking_trainer(tiny_model_dir, config, [])
    trainer.train()
    best = os.path.join(config.output_dir, "checkpoint-2")
    assert (trainer.state.best_global_step, trainer.state.best_model_checkpoint) == (2, best)
    assert sorted(os.listdir(config.output_dir)).count("checkpoint-2") == 1 and os.path.exists(
        os.path.join(config.output_dir, "checkpoint-4")
    )
    assert not os.path.exists(os.path.join(config.output_dir, "checkpoint-3"))  # rotated away; the best one is spared
    final = dict(trainer.model.named_parameters())
    at_best = dict(AutoModelForCausalLM.from_pretrained(best).named_parameters())
    at_last = dict(
        AutoModelForCausalLM.from_pretrained(os.path.join(config.output_dir, "checkpoint-4")).named_parameters()
    )
    assert all(torch.equal(final[n].detach(), at_best[n].detach()) for n in at_best)
    assert any(not torch.equal(at_best[n], at_last[n]) for n in at_best)


def test_save_strategy_best_writes_only_new_bests(tiny_model_dir, tmp_path):
    config = make_config(
        tmp_path,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="best",
        per_device_eval_batch_size=3,
        metric_for_best_model="reward",
    )
    GRPOTrainer(
        tiny_model_dir,
        reward_funcs=[distinct_tokens, step_shaped_reward],
        args=config,
        train_dataset=prompts(),
        eval_dataset=prompts(2),
    ).train()
    assert sorted(n for n in os.listdir(config.output_dir) if n.startswith("checkpoint-")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]


def test_early_stopping_callback_stops_the_run(tiny_model_dir, tmp_path):
    trainer = best_tracking_trainer(
        tiny_model_dir, best_tracking_config(tmp_path), [EarlyStoppingCallback(early_stopping_patience=2)]
    )
    trainer.train()
    # eval reward -100, 0, -100, -200: the best is at step 2, then two evaluations without improvement
    assert trainer.state.global_step == 4
    assert trainer.state.best_metric == pytest.approx(
        max(e["eval_reward"] for e in trainer.state.log_history if "eval_reward" in e)
    )


def test_a_resumed_run_keeps_the_best_checkpoint_it_had(tiny_model_dir, tmp_path):
    config = best_tracking_config(tmp_path, save_total_limit=1)
    config.max_steps = 4
    best_tracking_trainer(tiny_model_dir, config, [StopAfter(3)]).train()  # eval rewards -100, 0, -100
    resumed = best_tracking_trainer(tiny_model_dir, config, [])
    resumed.train(resume_from_checkpoint=True)  # step 4's -200 is no new best
    best = os.path.join(config.output_dir, "checkpoint-2")
    at_step_2 = [e["eval_reward"] for e in resumed.state.log_history if "eval_reward" in e and e["step"] == 2]
    assert (resumed.state.best_metric, resumed.state.best_global_step, resumed.state.best_model_checkpoint) == (
        at_step_2[0],
        2,
        best,
    )
    assert sorted(n for n in os.listdir(config.output_dir) if n.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    at_best = dict(AutoModelForCausalLM.from_pretrained(best).named_parameters())
    final = dict(resumed.model.named_parameters())
    assert all(torch.equal(final[n].detach(), at_best[n].detach()) for n in at_best)


@pytest.mark.parametrize("restore", [True, False])
def test_early_stopping_patience_survives_a_resume_when_asked(tiny_model_dir, tmp_path, restore):
    config = best_tracking_config(tmp_path, restore_callback_states_from_checkpoint=restore)
    first = best_tracking_trainer(tiny_model_dir, config, [EarlyStoppingCallback(2), StopAfter(3)])
    first.train()  # eval rewards -100, 0, -100: one evaluation without improvement so far
    with open(os.path.join(config.output_dir, "checkpoint-3", "trainer_state.json")) as file:
        stored = json.load(file)["stateful_callbacks"]
    assert stored["EarlyStoppingCallback"]["attributes"] == {"early_stopping_patience_counter": 1}
    assert set(stored) == {"EarlyStoppingCallback", "TrainerControl"}  # StopAfter is no ExportableState
    early_stopping = EarlyStoppingCallback(2)
    resumed = best_tracking_trainer(tiny_model_dir, config, [early_stopping])
    resumed.train(resume_from_checkpoint=True)
    # step 4 (-200) is the second evaluation without improvement; afresh, step 5 (-300) is
    assert resumed.state.global_step == (4 if restore else 5)
    (callback,) = [c for c in resumed.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)]
    assert callback.early_stopping_patience_counter == 2 and (callback is not early_stopping) == restore


def test_a_stored_callback_the_resumed_run_lacks_is_named(tiny_model_dir, tmp_path, caplog):
    config = best_tracking_config(tmp_path, restore_callback_states_from_checkpoint=True)
    config.max_steps = 1
    best_tracking_trainer(tiny_model_dir, config, [EarlyStoppingCallback(2)]).train()
    config.max_steps = 2
    with caplog.at_level(logging.WARNING, logger="grouprl"):
        best_tracking_trainer(tiny_model_dir, config, []).train(resume_from_checkpoint=True)
    assert "callbacks this run does not have (EarlyStoppingCallback)" in caplog.text


def test_metric_for_best_model_must_be_logged(tiny_model_dir, tmp_path):
    config = make_config(
        tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=3, metric_for_best_model="accuracy"
    )
    trainer = GRPOTrainer(
        tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts(), eval_dataset=prompts(2)
    )
    with pytest.raises(
        KeyError, match="metric_for_best_model='accuracy': the evaluation logged no 'eval_accuracy'.*eval_reward"
    ):
        trainer.train()


@pytest.mark.parametrize("setting", [True, "non_padding", "no"])
def test_include_num_input_tokens_seen_logs_the_tokens_seen(tiny_model_dir, tmp_path, setting):
    config = make_config(
        tmp_path,
        max_steps=2,
        logging_steps=1,
        include_num_input_tokens_seen=setting,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=3,
    )
    trainer = GRPOTrainer(
        tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts(), eval_dataset=prompts(2)
    )
    trainer.train()
    steps = [e for e in trainer.state.log_history if "loss" in e]
    evaluations = [e for e in trainer.state.log_history if "eval_reward" in e]
    assert len(steps) == 2 and len(evaluations) == 1
    if setting == "no":
        assert not any("num_input_tokens_seen" in e for e in trainer.state.log_history)
        return
    # TRL's count: every prompt and completion token trained on, as num_tokens logs it
    assert [e["num_input_tokens_seen"] for e in steps] == [e["num_tokens"] for e in steps]
    assert steps[1]["num_input_tokens_seen"] > steps[0]["num_input_tokens_seen"] > 0
    assert all(e["train_tokens_per_second"] > 0 for e in steps)
    assert evaluations[0]["num_input_tokens_seen"] == steps[1]["num_input_tokens_seen"]


def test_log_level_sets_the_loggers(tiny_model_dir, tmp_path):
    GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, log_level="error"),
        train_dataset=prompts(),
    )
    assert (
        logging.getLogger("grouprl").level == logging.ERROR and logging.getLogger("transformers").level == logging.ERROR
    )
    GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, log_level="info"),
        train_dataset=prompts(),
    )
    assert logging.getLogger("grouprl").level == logging.INFO
    logging.getLogger("grouprl").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.WARNING)


def test_empty_cache_steps_and_full_determinism(tiny_model_dir, tmp_path, monkeypatch):
    cleared, determinism = [], []
    monkeypatch.setattr(grouprl.train.loop, "clear_device_cache", lambda: cleared.append(1))
    monkeypatch.setattr(grouprl.compat.trainer_parts, "enable_full_determinism", lambda seed: determinism.append(seed))
    config = make_config(tmp_path, max_steps=4, torch_empty_cache_steps=2, full_determinism=True, seed=7)
    GRPOTrainer(tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts()).train()
    assert len(cleared) == 2 and determinism == [7]


def test_ddp_settings_reach_accelerate(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, ddp_find_unused_parameters=True, ddp_bucket_cap_mb=5, ddp_timeout=123)
    trainer = GRPOTrainer(tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    assert (
        trainer.accelerator.ddp_handler.find_unused_parameters is True
        and trainer.accelerator.ddp_handler.bucket_cap_mb == 5
    )
    assert trainer.accelerator.init_handler.timeout.total_seconds() == 123


def test_iterable_dataset_refuses_dispatch_batches(tiny_model_dir, tmp_path):
    stream = prompts().to_iterable_dataset()
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(
            tiny_model_dir,
            reward_funcs=distinct_tokens,
            train_dataset=stream,
            args=make_config(tmp_path, accelerator_config={"dispatch_batches": True}),
        )
    # TRL's test sets no max_steps: the dispatch_batches error still comes first, as TRL raises it
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(
            tiny_model_dir,
            reward_funcs=distinct_tokens,
            train_dataset=stream,
            args=make_config(tmp_path, accelerator_config={"dispatch_batches": True}, max_steps=-1),
        )
    trainer = GRPOTrainer(
        tiny_model_dir, reward_funcs=distinct_tokens, train_dataset=stream, args=make_config(tmp_path)
    )
    assert trainer.args.accelerator_config.dispatch_batches is False


def test_compat_doc_lists_every_field_as_the_code_says(tmp_path):
    from grouprl.config.compat_doc import rewrite_doc

    doc = os.path.join(os.path.dirname(__file__), "..", "docs", "trl-compat.md")
    copy = tmp_path / "trl-compat.md"
    copy.write_text(open(doc, encoding="utf-8").read(), encoding="utf-8")
    assert not rewrite_doc(str(copy)), (
        "docs/trl-compat.md is out of date: regenerate it (see the marker comment in the file)"
    )
    listed = {line.split("`")[1] for line in copy.read_text(encoding="utf-8").splitlines() if line.startswith("| `")}
    assert listed >= {f.name for f in dataclasses.fields(GRPOConfig) if f.init}


def test_hub_settings_reach_push_to_hub(tiny_model_dir, tmp_path, monkeypatch):
    from huggingface_hub import HfApi, ModelCard
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    pushed = []
    monkeypatch.setattr(
        PreTrainedModel, "push_to_hub", lambda self, repo_id, **kw: pushed.append(("model", repo_id, kw))
    )
    monkeypatch.setattr(
        PreTrainedTokenizerBase, "push_to_hub", lambda self, repo_id, **kw: pushed.append(("tokenizer", repo_id, kw))
    )
    uploads = []
    monkeypatch.setattr(HfApi, "upload_file", lambda self, **kw: uploads.append((self.token, kw)))
    config = make_config(tmp_path, hub_model_id="me/run", hub_token="hf_x", hub_private_repo=True, hub_revision="exp")
    GRPOTrainer(tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts()).push_to_hub(
        dataset_name="me/data"
    )
    assert {kind for kind, _, _ in pushed} == {"model", "tokenizer"}
    for _, repo_id, kwargs in pushed:
        assert repo_id == "me/run" and (kwargs["token"], kwargs["private"], kwargs["revision"]) == ("hf_x", True, "exp")
    # the model card (TRL's script passes dataset_name) goes with the same token and revision
    [(token, upload)] = uploads
    assert token == "hf_x" and (upload["repo_id"], upload["revision"], upload["path_in_repo"]) == (
        "me/run",
        "exp",
        "README.md",
    )
    assert ModelCard.load(upload["path_or_fileobj"]).data.datasets == ["me/data"]


def test_liger_kernel_is_refused_by_the_trainer_not_the_config(tiny_model_dir, tmp_path):
    # As TRL: GRPOConfig(use_liger_kernel=True) builds; the trainer refuses it before loading the model, and names
    # TRL's own objection (a LoRA adapter on lm_head) when the peft_config has one.
    from peft import LoraConfig

    config = make_config(tmp_path, use_liger_kernel=True)
    assert config.use_liger_kernel is True
    advice = r"GRPOConfig\.use_liger_kernel=True is not supported by grouprl: .+Leave use_liger_kernel at its default"
    with pytest.raises(ValueError, match=advice) as plain:
        GRPOTrainer(tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    assert "lm_head" not in str(plain.value)
    with pytest.raises(ValueError, match=advice + r".+adapter on `lm_head`"):
        GRPOTrainer(
            tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=config,
            train_dataset=prompts(),
            peft_config=LoraConfig(target_modules=["q_proj", "v_proj", "lm_head"]),
        )
    rows = {name: note for name, _, note in compat_table(GRPOConfig)}
    assert "refused when GRPOTrainer is built" in rows["use_liger_kernel"]
