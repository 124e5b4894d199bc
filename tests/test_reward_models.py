"""Reward models: a tiny locally built sequence-classification model scores completions, alone and mixed."""

import datasets
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2ForSequenceClassification

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.demo.model import tiny_qwen2_config
from grouprl.demo.tokenizer import build_tokenizer
from grouprl.rewards.models import RewardModel, load_reward_functions, match_processing_classes


@pytest.fixture
def reward_model_dir(tiny_reward_model_dir):
    return tiny_reward_model_dir


def make_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=6,
        learning_rate=0.1,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def prompts(n=6, conversational=False):
    texts = [f"{i}+{i % 5}=" for i in range(n)]
    return datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": t}] for t in texts] if conversational else texts}
    )


def test_scores_at_last_non_pad_token_in_micro_batches(reward_model_dir):
    rm = load_reward_functions([reward_model_dir], [None], batch_size=2)[0]
    assert isinstance(rm, RewardModel) and rm.__name__ == "tiny-rm"
    prompts_, completions = ["1+1=", "12+30=", "7+0="], ["2", "42 and some more text", ""]
    together = rm(prompts_, completions)  # padded to the longest text, 2 per forward pass
    alone = [rm([p], [c])[0] for p, c in zip(prompts_, completions)]  # no padding at all
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(v, 5) for v in together)) == 3


def test_conversational_samples_use_the_reward_tokenizer_chat_template(reward_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    rm = RewardModel(AutoModelForSequenceClassification.from_pretrained(reward_model_dir), tokenizer)
    prompt, completion = [{"role": "user", "content": "1+1="}], [{"role": "assistant", "content": "2"}]
    rendered = rm.render(prompt, completion)
    assert rendered == tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    assert "<|im_start|>assistant\n2<|im_end|>" in rendered
    assert rm([prompt], [completion]) == pytest.approx(rm([rendered], [""]), abs=1e-6)


def test_train_with_reward_model_alone(tiny_model_dir, reward_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward_model_dir, args=make_config(tmp_path), train_dataset=prompts()
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    entry = trainer.state.log_history[0]
    assert entry["rewards/tiny-rm/std"] > 0  # the model tells completions apart
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert not any(p.requires_grad for p in trainer.reward_funcs[0].model.parameters())


def test_train_with_reward_model_instance_mixed_with_function(tiny_model_dir, reward_model_dir, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)

    def short(completions, **kwargs):
        return [-float(len(c[0]["content"])) for c in completions]

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[model, short],
        args=make_config(tmp_path, reward_weights=[1.0, 0.1]),
        train_dataset=prompts(conversational=True),
        reward_processing_classes=[tokenizer, None],
    )
    assert trainer.reward_func_names == ["tiny-rm", "short"]
    trainer.train()
    entry = trainer.state.log_history[0]
    assert {"rewards/tiny-rm/mean", "rewards/short/mean", "reward"} <= set(entry)


def test_mismatched_processing_classes_are_rejected_before_loading(tmp_path):
    tokenizer = build_tokenizer()
    with pytest.raises(
        ValueError, match=r"number of reward processing classes \(1\) must match the number of reward functions \(2\)"
    ):
        GRPOTrainer(
            model="/nonexistent/model",
            reward_funcs=["/nonexistent/rm-a", "/nonexistent/rm-b"],
            args=make_config(tmp_path),
            train_dataset=prompts(),
            reward_processing_classes=[tokenizer],
        )
    assert match_processing_classes(["a"], tokenizer) == [tokenizer]  # a single one is wrapped
    assert match_processing_classes(["a", "b"], [tokenizer, tokenizer]) == [tokenizer, tokenizer]
    assert match_processing_classes(["a", "b"], None) == [None, None]


def test_bad_reward_model_entries(reward_model_dir):
    with pytest.raises(TypeError, match="must be a model id / path or a transformers PreTrainedModel"):
        load_reward_functions([torch.nn.Linear(2, 1)], [None])
    with pytest.raises(OSError, match="Could not load the reward model '/nonexistent/rm'"):
        load_reward_functions(["/nonexistent/rm"], [None])
    config = tiny_qwen2_config(build_tokenizer(), hidden_size=32, num_hidden_layers=1, intermediate_size=64)
    config.num_labels = 2
    two_labels = Qwen2ForSequenceClassification(config)
    with pytest.raises(ValueError, match="num_labels=2"):
        load_reward_functions([two_labels], [build_tokenizer()])
    with pytest.raises(ValueError, match="cannot find a tokenizer"):
        load_reward_functions([two_labels], [None])
