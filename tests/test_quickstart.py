"""TRL's GRPO quick start, unchanged except for the import line and local model/data, trains."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

QUICKSTART = textwrap.dedent("""
    from datasets import Dataset
    from grouprl import GRPOConfig, GRPOTrainer          # was: from trl import GRPOConfig, GRPOTrainer

    # was: dataset = load_dataset(...)
    dataset = Dataset.from_dict({"prompt": ["The sky is", "Once upon a time", "def add(a, b):", "Hello"]})

    # Dummy reward function: count the number of unique characters in the completions
    def reward_num_unique_chars(completions, **kwargs):
        return [len(set(c)) for c in completions]

    training_args = GRPOConfig(output_dir="quickstart-GRPO")
    trainer = GRPOTrainer(
        model=MODEL_PATH,                                 # was: "Qwen/Qwen2-0.5B-Instruct"
        reward_funcs=reward_num_unique_chars,
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()
""")


@pytest.mark.e2e
@pytest.mark.slow
def test_trl_quickstart_runs_with_trl_metric_names(long_context_model_dir, tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(QUICKSTART.replace("MODEL_PATH", repr(long_context_model_dir)))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    entries = [json.loads(line) for line in open(tmp_path / "quickstart-GRPO" / "metrics.jsonl")]
    logged = entries[0]  # defaults: 4 prompts x 3 epochs = 12 steps, logged every 10
    assert logged["step"] == 10
    for name in (
        "loss",
        "grad_norm",
        "learning_rate",
        "reward",
        "reward_std",
        "rewards/reward_num_unique_chars/mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "frac_reward_zero_std",
        "entropy",
        "num_tokens",
        "clip_ratio/region_mean",
        "step_time",
        "epoch",
    ):
        assert name in logged, name
    assert entries[-1]["step"] == 12 and "train_loss" in entries[-1]
    assert "grouprl batch plan" not in result.stderr  # logged at INFO: shown with log_level="info", not by default
