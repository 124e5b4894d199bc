"""The training run of the kill / resume tests, shared by the test process and its subprocess."""

import datasets

from grouprl import GRPOConfig, GRPOTrainer


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def make_trainer(model_dir, output_dir, reward_funcs=distinct_tokens, **overrides):
    """6 steps, a checkpoint every 2, one generation per 3 steps (so checkpoints fall inside a generation)."""
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=3,
        steps_per_generation=3,
        num_generations=3,
        max_completion_length=8,
        learning_rate=0.1,
        max_steps=6,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
    )
    values.update(overrides)
    prompts = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(18)]})
    return GRPOTrainer(
        model=str(model_dir), reward_funcs=reward_funcs, args=GRPOConfig(**values), train_dataset=prompts
    )
