"""Run health: each silent-failure detector on a tiny run, warn-once-then-summary, and the NaN / inf stops
that save the last good state (rewards, advantages, loss, gradients)."""

import json
import math
import os

import datasets
import pytest
import torch
from helpers import ScriptedBackend, cpu_parameters, max_difference, parameters
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl import GRPOConfig, GRPOTrainer, NonFiniteError, RewardFunctionError
from grouprl.train.health import HealthMonitor, detect


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def make_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=8,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def prompts(n=24):
    return datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(n)]})


def finishing_backend(tokenizer, length=3):
    """Every completion ends with EOS after `length` tokens that differ per sample (no truncation, distinct rewards)."""
    eos = tokenizer.eos_token_id
    return ScriptedBackend(
        lambda ids, s: [(ids[-1] + 5 * s + k) % 200 + 3 for k in range(length + s)] + [eos], eos, tokenizer
    )


def health_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("grouprl health warning")]


# ---- detectors: pure functions --------------------------------------------------------------------------


def test_detectors_by_hand():
    healthy = {
        "completions/clipped_ratio": 0.5,
        "frac_reward_zero_std": 0.5,
        "rewards/f/mean": 0.3,
        "entropy": 0.01,
        "learning_rate": 1e-6,
        "sampling/importance_sampling_masked_fraction": 0.5,
        "off_policy_mask/dropped_fraction": 0.5,
    }
    assert detect(healthy, step=3) == []  # every threshold is strict: "most" = more than half
    sick = {
        "completions/clipped_ratio": 0.9,
        "frac_reward_zero_std": 0.75,
        "rewards/f/mean": 0.3,
        "rewards/g/mean": None,
        "entropy": 0.001,
        "learning_rate": 0.0,
        "sampling/importance_sampling_masked_fraction": 0.6,
        "off_policy_mask/dropped_fraction": 0.7,
    }
    found = {f.kind: f for f in detect(sick, step=3, max_completion_length=256)}
    assert sorted(found) == [
        "entropy",
        "is_masked",
        "off_policy_masked",
        "reward_none:g",
        "truncated",
        "zero_lr",
        "zero_std",
    ]
    assert found["truncated"].message.startswith("90% of completions hit max_completion_length=256")
    assert found["zero_std"].metric == "frac_reward_zero_std" and found["zero_std"].value == 0.75
    assert "Reward function 'g' returned None for every completion" in found["reward_none:g"].message
    # a warmup starts at lr 0: not flagged on step 1, flagged after it
    assert not [f for f in detect({"learning_rate": 0.0}, step=1, warmup=True)]
    assert [f.kind for f in detect({"learning_rate": 0.0}, step=2, warmup=True)] == ["zero_lr"]
    assert (
        detect({"completions/clipped_ratio": None, "entropy": float("nan")}, step=1) == []
    )  # nothing logged: nothing to say


def test_monitor_warns_once_then_summarises(caplog):
    monitor = HealthMonitor()
    for step in range(1, 6):
        monitor.observe(
            detect({"completions/clipped_ratio": 1.0, "entropy": 0.0 if step >= 4 else 1.0}, step=step), step
        )
    assert len(health_warnings(caplog)) == 2  # one per kind, not one per step
    summary = monitor.summary()
    assert "most completions truncated (completions/clipped_ratio): in 5 of 5 steps checked (steps 1-5)" in summary
    assert "entropy collapsed (entropy): in 2 of 5 steps checked (steps 4-5)" in summary
    assert summary.startswith("grouprl health summary (5 step(s) checked)")


# ---- one tiny run per detector --------------------------------------------------------------------------


def test_truncation_warned_once_with_summary(tiny_model_dir, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    never_ends = ScriptedBackend(
        lambda ids, s: [(ids[-1] + k % (s + 1)) % 200 + 3 for k in range(20)], tokenizer.eos_token_id, tokenizer
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=3, max_completion_length=4),
        train_dataset=prompts(),
        generation_backend=never_ends,
    )
    trainer.train()
    warnings = health_warnings(caplog)
    assert (
        len(warnings) == 1 and "at step 1: 100% of completions hit max_completion_length=4 before ending" in warnings[0]
    )
    assert "mask_truncated_completions=True" in warnings[0] and "[completions/clipped_ratio = 1]" in warnings[0]
    assert "most completions truncated (completions/clipped_ratio): in 3 of 3 steps checked (steps 1-3)" in caplog.text


def test_zero_std_groups(tiny_model_dir, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **k: [1.0] * len(completions),
        args=make_config(tmp_path),
        train_dataset=prompts(),
        generation_backend=finishing_backend(tokenizer),
    )
    trainer.train()
    (warning,) = health_warnings(caplog)
    assert "100% of groups gave all their completions the same reward" in warning and "dynamic_sampling=True" in warning


def test_reward_function_returning_none_for_every_row(tiny_model_dir, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def needs_solution(completions, **kwargs):
        return [None] * len(completions)

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[distinct_tokens, needs_solution],
        args=make_config(tmp_path),
        train_dataset=prompts(),
        generation_backend=finishing_backend(tokenizer),
    )
    trainer.train()
    (warning,) = health_warnings(caplog)
    assert "Reward function 'needs_solution' returned None for every completion" in warning
    assert "[rewards/needs_solution/mean = nan]" in warning


def test_importance_sampling_masking_most_tokens(tiny_model_dir, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = finishing_backend(tokenizer)
    backend.sampler_logprobs = lambda ids, s, tokens: [-50.0] * len(tokens)  # rho = e^{~45} > clip_max everywhere
    config = make_config(tmp_path, vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=3.0)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=backend,
    )
    trainer.train()
    masked, distant = health_warnings(caplog)  # both findings: most tokens masked, and why (the gap)
    assert "The sampler-mismatch correction gave weight 0 to 100% of the loss tokens" in masked
    assert "nats a token from the training forward's" in distant
    assert trainer.state.log_history[0]["sampling/importance_sampling_masked_fraction"] == 1.0


def test_entropy_collapse(tiny_model_dir, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = make_config(tmp_path, temperature=0.01)  # logits / 0.01: the sampling distribution is (nearly) one-hot
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=finishing_backend(tokenizer),
    )
    trainer.train()
    (warning,) = health_warnings(caplog)
    assert "The policy's mean token entropy is" in warning and "sampling has become (almost) deterministic" in warning


def test_learning_rate_zero_and_not_warmup(tiny_model_dir, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    warming = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "w", warmup_steps=2, lr_scheduler_type="linear"),
        train_dataset=prompts(),
        generation_backend=finishing_backend(tokenizer),
    )
    warming.train()
    assert warming.state.log_history[0]["learning_rate"] == 0.0 and health_warnings(caplog) == []  # warmup's first step
    frozen = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "z", learning_rate=0.0),
        train_dataset=prompts(),
        generation_backend=finishing_backend(tokenizer),
    )
    frozen.train()
    (warning,) = health_warnings(caplog)
    assert "at step 1: The learning rate is 0 at step 1, so the optimizer step changes nothing" in warning


# ---- NaN / inf: stop, naming where, after saving the last good state --------------------------------------


@pytest.fixture(scope="module")
def clean_runs(tiny_model_dir, tmp_path_factory):
    """Weights after 2 and after 4 steps of a run without any fault, on the CPU (checkpoints load there)."""
    out = {}
    for steps in (2, 4):
        trainer = GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            train_dataset=prompts(),
            args=make_config(tmp_path_factory.mktemp(f"clean{steps}"), max_steps=steps),
        )
        trainer.train()
        out[steps] = cpu_parameters(trainer.model)
    return out


def checkpoint_weights(path):
    return parameters(AutoModelForCausalLM.from_pretrained(path))  # loadable with from_pretrained (on the CPU)


def test_nan_reward_on_step_3_stops_with_function_name_and_checkpoint_2(tiny_model_dir, tmp_path, clean_runs):
    def flaky_reward(completion_ids, trainer_state, **kwargs):
        rewards = distinct_tokens(completion_ids)
        return [float("nan")] + rewards[1:] if trainer_state.global_step == 2 else rewards

    config = make_config(tmp_path, max_steps=4)  # save_strategy="no": the checkpoint comes from the NaN stop alone
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=flaky_reward, args=config, train_dataset=prompts())
    with pytest.raises(RewardFunctionError) as failure:
        trainer.train()
    message = str(failure.value)
    checkpoint = os.path.join(config.output_dir, "checkpoint-2")
    assert "Reward function 'flaky_reward' returned nan for row 0" in message
    assert f"The last good state (after step 2) is saved in {checkpoint}" in message
    assert sorted(os.listdir(config.output_dir)) == ["checkpoint-2", "metrics.jsonl"]
    assert max_difference(checkpoint_weights(checkpoint), clean_runs[2]) == 0.0
    # the checkpoint is the exact state after step 2: resuming with a sound reward ends where the clean run does
    resumed = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert max_difference(cpu_parameters(resumed.model), clean_runs[4]) == 0.0


@pytest.mark.parametrize("where", ["loss", "gradients", "advantages"])
def test_nan_stops_before_the_update_and_saves_step_2(tiny_model_dir, tmp_path, clean_runs, where):
    config = make_config(tmp_path, max_steps=4)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    model = trainer.accelerator.unwrap_model(trainer.run.model)

    def poison(value):  # NaN during step 3 (global_step is 2 until its optimizer step)
        return value * float("nan") if trainer.state.global_step == 2 else value

    if where == "loss":  # NaN hidden states in the training forward (generation runs without grad)
        model.model.norm.register_forward_hook(
            lambda module, args, output: poison(output) if torch.is_grad_enabled() else output
        )
    if where == "gradients":
        model.model.layers[0].mlp.down_proj.weight.register_hook(poison)
    if where == "advantages":  # the built-in advantages are finite by construction; a custom advantage hook may not be
        compute = trainer.run.rollouts.global_advantages

        def poisoned_advantages(*args):
            advantages, stats = compute(*args)
            return poison(advantages), stats

        trainer.run.rollouts.global_advantages = poisoned_advantages
    with pytest.raises(NonFiniteError) as failure:
        trainer.train()
    message = str(failure.value)
    expected = {
        "loss": "The loss is nan at step 3; non-finite inputs: policy log-probabilities. The update was not applied.",
        "gradients": (
            "The gradients are not finite at step 3 (grad_norm = nan) although the loss was finite; "
            "the update was not applied."
        ),
        "advantages": "Advantages are not finite at step 3: 6 of 6 rows are NaN or inf (first: row 0)",
    }[where]
    assert expected in message
    assert "The last good state (after step 2) is saved in" in message
    assert max_difference(cpu_parameters(model), clean_runs[2]) == 0.0  # the NaN update was never applied
    assert max_difference(checkpoint_weights(os.path.join(config.output_dir, "checkpoint-2")), clean_runs[2]) == 0.0


def test_nan_in_the_first_step_has_nothing_to_save(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **k: [math.inf] * len(completions),
        args=make_config(tmp_path),
        train_dataset=prompts(),
    )
    with pytest.raises(RewardFunctionError, match="returned inf for row 0(.|\n)*stopped before its first update"):
        trainer.train()
    assert not [name for name in os.listdir(tmp_path / "out") if name.startswith("checkpoint")]


# ---- progress and phase times ----------------------------------------------------------------------


def test_progress_bar_and_per_step_phase_times(tiny_model_dir, tmp_path, capsys):
    config = make_config(
        tmp_path, max_steps=4, steps_per_generation=2, per_device_train_batch_size=3, disable_tqdm=False
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    trainer.train()
    bar = capsys.readouterr().err.split("\r")[-1]
    assert "4/4" in bar and "reward=" in bar and "len=" in bar and ("step/s" in bar or "s/step" in bar)
    entries = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][:-1]
    phases = ("generate", "reward", "forward", "backward", "optimizer")
    for entry in entries:
        assert all(entry[f"time/{p}"] >= 0 for p in phases)
        assert (
            sum(entry[f"time/{p}"] for p in phases) <= entry["step_time"]
        )  # seconds of this optimizer step, not per call
    # one generation feeds 2 steps: the second step of each pair spends nothing on generating or scoring
    assert [entry["time/generate"] > 0 for entry in entries] == [True, False, True, False]
    assert [entry["time/reward"] > 0 for entry in entries] == [True, False, True, False]
    quiet = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "q", max_steps=1),
        train_dataset=prompts(),
    )
    quiet.train()
    assert "grouprl:" not in capsys.readouterr().err  # disable_tqdm=True: no bar
