"""Evaluation: evaluate() before/without train, eval_strategy during training, num_generations_eval, dicts; the end
of training as Trainer's default flow ends it (its last checkpoint and evaluation, training_args.bin)."""

import json
import os

import datasets
import pytest
import torch
from helpers import ScriptedBackend, max_difference, parameters
from transformers import AutoTokenizer

from grouprl import GRPOConfig, GRPOTrainer


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def make_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        per_device_eval_batch_size=6,
        num_generations=3,
        max_completion_length=6,
        learning_rate=0.1,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        bf16=False,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def prompts(n, start=0):
    return datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(start, start + n)]})


def test_evaluate_without_train_returns_eval_metrics(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path),
        train_dataset=prompts(12),
        eval_dataset=prompts(5, start=20),
    )
    metrics = trainer.evaluate()
    for name in (
        "eval_reward",
        "eval_reward_std",
        "eval_rewards/distinct_tokens/mean",
        "eval_rewards/distinct_tokens/std",
        "eval_frac_reward_zero_std",
        "eval_completions/mean_length",
        "eval_loss",
        "eval_entropy",
        "eval_runtime",
        "eval_samples_per_second",
        "eval_steps_per_second",
    ):
        assert isinstance(metrics[name], float), name
    assert 1.0 <= metrics["eval_reward"] <= 7.0
    assert (
        trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]
        and trainer.state.log_history[-1]["step"] == 0
    )
    assert metrics == {
        **metrics,
        **{k: v for k, v in trainer.evaluate().items() if "runtime" not in k and "per_second" not in k},
    }
    lines = [json.loads(line) for line in open(os.path.join(trainer.args.output_dir, "metrics.jsonl"))]
    assert "eval_reward" in lines[0]
    assert trainer.state.global_step == 0


def test_eval_strategy_steps_with_num_generations_eval(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = ScriptedBackend(
        lambda ids, s: [ids[-1] % 50 + 3 + s, tokenizer.eos_token_id], tokenizer.eos_token_id, tokenizer
    )
    config = make_config(
        tmp_path, eval_strategy="steps", eval_steps=1, num_generations_eval=2, per_device_eval_batch_size=4
    )
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(12),
        eval_dataset=prompts(5, start=20),
        generation_backend=backend,
    )
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_reward" in e]
    assert [e["step"] for e in evals] == [1, 2]
    eval_calls = [(len(p), n) for p, n in backend.calls if n == 2]
    assert eval_calls == [(2, 2), (2, 2), (1, 2)] * 2  # 5 prompts in batches of 4 completions / 2 per prompt
    assert all(n == 3 for p, n in backend.calls if n != 2)


def test_evaluation_does_not_change_training(tiny_model_dir, tmp_path):
    plain = GRPOTrainer(
        tiny_model_dir, reward_funcs=distinct_tokens, args=make_config(tmp_path / "a"), train_dataset=prompts(12)
    )
    plain.train()
    with_eval = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "b", eval_strategy="steps", eval_steps=1),
        train_dataset=prompts(12),
        eval_dataset=prompts(4, start=20),
    )
    with_eval.train()
    assert max_difference(parameters(plain.model), parameters(with_eval.model)) == 0.0


def test_dict_of_eval_datasets_and_override(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path),
        train_dataset=prompts(12),
        eval_dataset={"easy": prompts(2), "hard": prompts(2, start=40)},
    )
    metrics = trainer.evaluate()
    assert {"eval_easy_reward", "eval_hard_reward", "eval_easy_loss", "eval_hard_runtime"} <= set(metrics)
    other = trainer.evaluate(eval_dataset=prompts(2, start=60), metric_key_prefix="test")
    assert "test_reward" in other and not any(k.startswith("eval") for k in other)


def test_eval_setup_errors_before_model_load(tmp_path):
    with pytest.raises(ValueError, match="eval_strategy='steps' needs an eval_dataset"):
        GRPOTrainer(
            "/nonexistent/model",
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, eval_strategy="steps"),
            train_dataset=prompts(12),
        )
    with pytest.raises(ValueError, match=r"eval batch .* must be divisible by num_generations_eval=4"):
        GRPOTrainer(
            "/nonexistent/model",
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, num_generations_eval=4, eval_strategy="epoch"),
            train_dataset=prompts(12),
            eval_dataset=prompts(4),
        )
    with pytest.raises(ValueError, match="no 'prompt' column"):
        GRPOTrainer(
            "/nonexistent/model",
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, eval_strategy="steps"),
            train_dataset=prompts(12),
            eval_dataset={"x": datasets.Dataset.from_dict({"question": ["a"]})},
        )


def test_stored_eval_dataset_is_checked_when_evaluated(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, num_generations_eval=4),
        train_dataset=prompts(12),
        eval_dataset=prompts(4),
    )  # eval_strategy "no": only stored, as in TRL
    with pytest.raises(ValueError, match="must be divisible by num_generations_eval=4"):
        trainer.evaluate()


def test_the_last_step_is_saved_and_evaluated_as_trainer_does(tiny_model_dir, tmp_path):
    """save_steps=2, eval_steps=2, max_steps=3: checkpoints 2 and 3 and evaluations at 2 and 3, as TRL leaves them (its
    Trainer's default flow), so an automatic resume finds the last step."""
    config = make_config(
        tmp_path, max_steps=3, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2
    )
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(12),
        eval_dataset=prompts(3, start=20),
    )
    trainer.train()
    assert sorted(n for n in os.listdir(config.output_dir) if n.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-3",
    ]
    evaluations = [e for e in trainer.state.log_history if "eval_reward" in e]
    assert [e["step"] for e in evaluations] == [2, 3]
    # eval_num_tokens: the run's count at the evaluation, as TRL logs it (evaluation adds nothing to it)
    counts = {e["step"]: e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e}
    assert [e["eval_num_tokens"] for e in evaluations] == [counts[2], counts[3]]
    assert counts[2] < counts[3] == trainer.state.num_input_tokens_seen
    # Trainer's training_args.bin beside every checkpoint's state and the saved model
    loaded = torch.load(os.path.join(config.output_dir, "checkpoint-3", "training_args.bin"), weights_only=False)
    assert isinstance(loaded, GRPOConfig) and (loaded.save_steps, loaded.max_steps) == (2, 3)
    trainer.save_model(str(tmp_path / "model"))
    assert torch.load(tmp_path / "model" / "training_args.bin", weights_only=False).eval_steps == 2
