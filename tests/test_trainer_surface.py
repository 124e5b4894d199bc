"""TRL's public surface and override points on GRPOTrainer: return types, files, log entries, and that a subclass's
override changes the run (or is refused when the class is defined)."""

import json
import math
import os
from collections import deque
from unittest.mock import Mock, patch

import datasets
import pytest
import torch
from accelerate.tracking import GeneralTracker
from helpers import parameters, quiet_config, scripted_backend
from huggingface_hub import ModelCard
from transformers import AutoTokenizer, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_utils import TrainOutput

from grouprl import GRPOTrainer
from grouprl.data.prompt_sampler import GenerationInputs


def make_config(tmp_path, **overrides):
    return quiet_config(
        tmp_path,
        overrides,
        per_device_train_batch_size=6,
        max_completion_length=8,
        learning_rate=0.1,
        max_steps=2,
        bf16=False,
    )


def prompts(n=12):
    return datasets.Dataset.from_dict(
        {"prompt": [f"{i}+{i % 5}=" for i in range(n)], "answer": [str(i + i % 5) for i in range(n)]}
    )


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


# ---- get_high_entropy_mask / get_off_policy_mask: hand-computed values --------------------------------------


def entropy_mask(entropies, mask, threshold, other_process=None):
    """GRPOTrainer.get_high_entropy_mask on a stand-in trainer whose accelerator gathers `other_process`'s valid
    entropies after this one's (padding with the -1 sentinel, as accelerate pads), like TRL's own unit test."""
    trainer = Mock(spec=GRPOTrainer)
    trainer.accelerator = Mock()
    others = torch.tensor(other_process if other_process is not None else [], dtype=torch.float32)
    width = max(int(mask.bool().sum()), len(others))

    def pad(values, dim, pad_index):
        return torch.cat([values, torch.full((width - len(values),), pad_index)])

    trainer.accelerator.pad_across_processes = pad
    trainer.accelerator.gather = lambda local: (
        torch.cat([local, pad(others, 0, -1.0)]) if other_process is not None else local
    )
    return GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold)


ENTROPIES = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


@pytest.mark.parametrize(
    "threshold, expected",
    [
        # 10 valid entropies 0.1..1.0; quantile q interpolates linearly at position 9q of the sorted values
        (
            0.8,
            [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]],
        ),  # position 7.2: 0.8 + 0.2 * 0.1 = 0.82 -> 0.9, 1.0 (1.1, 1.2 are padding)
        (0.5, [[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0]]),  # position 4.5: 0.55 -> 0.6 .. 1.0
        (0.0, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),  # the minimum: every valid token
        (1.0, [[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]]),  # the maximum valid entropy (1.0) only
    ],
)
def test_get_high_entropy_mask_hand_computed(threshold, expected):
    torch.testing.assert_close(entropy_mask(ENTROPIES, MASK, threshold), torch.tensor(expected, dtype=torch.bool))


def test_get_high_entropy_mask_no_valid_token_and_other_processes():
    assert not entropy_mask(ENTROPIES, torch.zeros_like(MASK), 0.5).any()
    # another process holds 2.0 and 3.0: 12 values, position 0.8 * 11 = 8.8
    # -> 0.9 + 0.8 * 0.1 = 0.98: only 1.0 here (not 0.9)
    only_max = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(entropy_mask(ENTROPIES, MASK, 0.8, other_process=[2.0, 3.0]), only_max)
    # position 0.5 * 11 = 5.5 -> 0.65: 0.7 .. 1.0 are kept, 0.6 no longer
    expected = torch.tensor([[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(entropy_mask(ENTROPIES, MASK, 0.5, other_process=[2.0, 3.0]), expected)


def test_get_off_policy_mask_hand_computed():
    mask = torch.ones(3, 4)
    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])
    sampling = torch.zeros(3, 4)
    current = torch.tensor([[-2.0] * 4, [-0.5] * 4, [-2.0] * 4])  # mean drift log pi_old - log pi = 2, 0.5, 2
    keep = GRPOTrainer.get_off_policy_mask(advantages, current, sampling, mask, 1.0)
    torch.testing.assert_close(
        keep, torch.tensor([[1.0], [1.0], [0.0]])
    )  # positive advantage kept; drift 0.5 <= 1 kept
    # padding is left out of the mean: (2 + 2) / 2 = 2 > 1 drops, (0.5 + 0.5) / 2 keeps, whatever the padded values are
    padded = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    far = torch.tensor([[-2.0, -2.0, -1e4, 1e4]])
    near = torch.tensor([[-0.5, -0.5, -1e4, 1e4]])
    assert GRPOTrainer.get_off_policy_mask(torch.tensor([[-1.0]]), far, torch.zeros(1, 4), padded, 1.0).item() == 0.0
    assert GRPOTrainer.get_off_policy_mask(torch.tensor([[-1.0]]), near, torch.zeros(1, 4), padded, 1.0).item() == 1.0
    # a token the sampler did not score (NaN) adds 0: (2 + 0) / 2 = 1 <= 1 keeps;
    # advantages may be (B,); bool mask -> bool
    unscored = torch.tensor([[0.0, float("nan")]])
    keep = GRPOTrainer.get_off_policy_mask(
        torch.tensor([-1.0]), torch.tensor([[-2.0, -2.0]]), unscored, torch.ones(1, 2, dtype=torch.bool), 1.0
    )
    assert keep.dtype == torch.bool and keep.tolist() == [[True]]


# ---- train() / log_history / reporting ---------------------------------------------------------------------


def rewards_by_step():
    """Two reward functions whose values are known in advance: the optimizer step at generation time, and 0."""

    def step_number(completions, trainer_state, **kwargs):
        return [float(trainer_state.global_step)] * len(completions)

    def always_zero(completions, **kwargs):
        return [0.0] * len(completions)

    return [step_number, always_zero]


def test_train_returns_train_output_and_the_summary_merges_unlogged_steps(tiny_model_dir, tmp_path):
    """logging_steps=2 over 3 steps: step 2 is logged; the summary entry (TRL's last log_history entry) carries step 3's
    GRPO metrics (rewards computed at global_step 2), not Trainer's loss / grad_norm / learning_rate."""
    seen_tokens = []

    class CountsTokens(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen_tokens.append(int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = make_config(tmp_path, max_steps=3, logging_steps=2, reward_weights=[0.7, 0.3])
    trainer = CountsTokens(
        model=tiny_model_dir,
        reward_funcs=rewards_by_step(),
        args=config,
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    output = trainer.train()
    assert isinstance(output, TrainOutput) and output.global_step == 3
    assert set(output.metrics) >= {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
        "epoch",
    }
    assert output.training_loss == output.metrics["train_loss"]
    assert output.metrics["train_steps_per_second"] == pytest.approx(3 / output.metrics["train_runtime"], rel=0.01)
    assert output.metrics["train_samples_per_second"] == pytest.approx(
        3 * 6 / output.metrics["train_runtime"], rel=0.01
    )
    non_embedding = trainer.model.num_parameters(exclude_embeddings=True)
    assert (
        len(seen_tokens) == 3
        and output.metrics["total_flos"] == 6 * non_embedding * sum(seen_tokens) == trainer.state.total_flos
    )
    periodic, summary = trainer.state.log_history
    assert periodic["step"] == 2 and periodic["reward"] == pytest.approx(
        0.7 * 0.5
    )  # steps 1-2: rewards 0 and 1, weight 0.7
    assert periodic["rewards/step_number/mean"] == pytest.approx(0.5) and "loss" in periodic and "grad_norm" in periodic
    assert summary == {**output.metrics, "step": 3}
    assert summary["reward"] == pytest.approx(0.7 * 2.0) and summary["rewards/step_number/mean"] == 2.0  # step 3 only
    assert summary["rewards/always_zero/mean"] == 0.0 and "rewards/always_zero/std" in summary
    assert "loss" not in summary and "grad_norm" not in summary and "learning_rate" not in summary
    lines = [json.loads(line) for line in open(os.path.join(config.output_dir, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [2, 3] and lines[-1]["train_loss"] == output.training_loss


def test_summary_has_no_step_metrics_when_the_last_step_was_logged(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path),
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    trainer.train()
    assert (
        "reward" in trainer.state.log_history[-2] and "reward" not in trainer.state.log_history[-1]
    )  # as TRL: nothing left


def test_adaptive_entropy_coef_follows_the_controller(tiny_model_dir, tmp_path):
    """Target 15 nats (above any entropy here): the coefficient rises by entropy_coef_delta once per optimizer step,
    gradient accumulation or not (TRL's test_train_with_adaptive_entropy_gradient_accumulation)."""
    config = make_config(
        tmp_path,
        max_steps=3,
        logging_steps=2,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=3,
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_target=15.0,
        entropy_coef_delta=0.005,
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    assert trainer.entropy_coef == 0.01 and trainer._last_world_entropy == math.inf
    trainer.train()
    assert trainer.entropy_coef == pytest.approx(0.01 + 0.005 * 3)
    assert trainer.state.log_history[0]["entropy_coef"] == pytest.approx((0.015 + 0.02) / 2)  # steps 1-2
    assert trainer.state.log_history[-1]["entropy_coef"] == pytest.approx(0.025)  # step 3, in the summary
    assert "policy_loss" in trainer.state.log_history[-1]
    trainer.entropy_coef = 0.5
    assert trainer.run.entropy_controller.coef == 0.5


def test_log_metrics_save_metrics_save_state(tiny_model_dir, tmp_path, capsys):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=1),
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    metrics = trainer.train().metrics
    trainer.log_metrics("train", metrics)
    printed = capsys.readouterr().out
    assert "***** train metrics *****" in printed and "train_loss" in printed
    out = trainer.args.output_dir
    trainer.save_metrics("train", metrics)
    assert json.load(open(os.path.join(out, "train_results.json"))) == pytest.approx(metrics)
    trainer.save_metrics("eval", {"eval_reward": 1.5})
    trainer.save_metrics("test", {"test_reward": 2.5}, combined=False)
    assert json.load(open(os.path.join(out, "all_results.json"))) == pytest.approx({**metrics, "eval_reward": 1.5})
    assert json.load(open(os.path.join(out, "test_results.json"))) == {"test_reward": 2.5}
    trainer.save_state()
    state = TrainerState.load_from_json(os.path.join(out, "trainer_state.json"))
    assert (
        state.global_step == 1
        and state.log_history == trainer.state.log_history
        and state.total_flos == trainer.state.total_flos
    )


def test_create_model_card_offline(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = make_config(tmp_path, hub_model_id="someone/tiny-grpo")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    trainer.create_model_card(model_name="tiny-grpo", dataset_name="someone/prompts", tags="math")
    card = ModelCard.load(os.path.join(config.output_dir, "README.md"))
    assert (
        card.data.model_name == "tiny-grpo"
        and card.data.datasets == ["someone/prompts"]
        and card.data.library_name == "transformers"
    )
    assert (
        set(card.data.tags) == {"grouprl", "grpo", "math"} and card.data.base_model is None
    )  # a local folder is no base model id
    assert "someone/tiny-grpo" in card.text and "GRPO" in card.text and "2402.03300" in card.text
    trainer.model.config._name_or_path = "someone/base-model"  # a Hub id
    trainer.create_model_card()
    assert ModelCard.load(os.path.join(config.output_dir, "README.md")).data.base_model == "someone/base-model"


def test_attributes_mirror_trl(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    config = make_config(
        tmp_path,
        beta=0.0,
        top_k=7,
        min_p=0.05,
        repetition_penalty=1.1,
        epsilon=0.3,
        reward_weights=[0.7, 0.3],
        importance_sampling_level="sequence",
        mask_truncated_completions=True,
        top_entropy_quantile=0.5,
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[distinct_tokens, tiny_reward_model_dir],
        args=config,
        train_dataset=prompts(),
    )
    assert trainer.reward_weights.dtype == torch.float32 and trainer.reward_weights.tolist() == pytest.approx(
        [0.7, 0.3]
    )
    assert (
        trainer.reward_processing_classes[0] is None
        and trainer.reward_processing_classes[1] is trainer.reward_funcs[1].tokenizer
    )
    assert trainer.reward_func_names == ["distinct_tokens", "tiny-rm"]
    expected = dict(
        num_generations=3,
        num_generations_eval=3,
        beta=0.0,
        loss_type="dapo",
        temperature=1.0,
        top_p=1.0,
        top_k=7,
        min_p=0.05,
        repetition_penalty=1.1,
        use_vllm=False,
        vllm_mode="colocate",
        max_completion_length=8,
        epsilon_low=0.3,
        epsilon_high=0.3,
        num_iterations=1,
        scale_rewards="group",
        importance_sampling_level="sequence",
        mask_truncated_completions=True,
        top_entropy_quantile=0.5,
        entropy_coef=0.0,
        aux_loss_enabled=False,
        shuffle_dataset=True,
        log_completions=False,
    )
    assert {name: getattr(trainer, name) for name in expected} == expected
    assert trainer.hub_model_id == "out"  # output_dir's name, as Trainer derives the repository name
    trainer.args.hub_model_id = "someone/x"
    assert trainer.hub_model_id == "someone/x"
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    assert trainer.model_wrapped is trainer.run.model and isinstance(trainer.control, TrainerControl)


def test_logs_buffer_and_trackers_and_end(tiny_model_dir, tmp_path):
    """TRL's trainer._logs holds the last generation batch (log_extra columns included); log entries reach the
    trackers after train() too, and end() finishes them."""

    class Tracker(GeneralTracker):
        name, requires_logging_directory, main_process_only = "fake", False, True

        def __init__(self):
            super().__init__()
            self.logged, self.finished = [], False

        @property
        def tracker(self):
            return self

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, values))

        def finish(self):
            self.finished = True

    def tagged(completions, log_extra, **kwargs):
        log_extra("test_column", [c[:2] for c in completions])
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=tagged,
        args=make_config(tmp_path),
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    trainer._logs["images"] = deque(maxlen=0)  # what scripts do to keep images out; the trainer keeps using the dict
    tracker = Tracker()
    trainer.accelerator.trackers.append(tracker)
    trainer.train()
    logs = trainer._logs
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == 6  # the last generation batch
    assert list(logs["extra"]["test_column"]) == [c[:2] for c in logs["completion"]]
    assert list(logs["rewards"]["tagged"]) == [float(len(c)) for c in logs["completion"]]
    assert set(logs["prompt"]) <= set(prompts()["prompt"]) and len(logs["images"]) == 0
    assert [step for step, _ in tracker.logged] == [1, 2, 2] and not tracker.finished  # two steps and the summary
    trainer.log({"after": 1.0})
    assert tracker.logged[-1][1]["after"] == 1.0
    trainer.end()
    assert tracker.finished


# ---- get_train_dataloader and training_step's inputs --------------------------------------------------------


def test_training_step_gets_the_generation_batch_rows_like_trl(tiny_model_dir, tmp_path):
    """TRL's test_prepare_input_called_with_correct_data: spg=4, G=4, 6 per device, num_iterations=2, no shuffle:
    training_step sees the same 24-row generation batch (6 prompts x 4) for 8 micro-steps, then the next one."""
    config = make_config(
        tmp_path,
        gradient_accumulation_steps=3,
        steps_per_generation=4,
        num_generations=4,
        per_device_train_batch_size=6,
        num_iterations=2,
        shuffle_dataset=False,
        max_steps=4,
        max_completion_length=4,
        logging_steps=10,
    )
    data = prompts()
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=data,
        generation_backend=scripted_backend(tiny_model_dir),
    )
    rows = [dict(row) for row in data]
    first = [row for row in rows[:6] for _ in range(4)]
    second = [row for row in rows[6:12] for _ in range(4)]
    loader = trainer.get_train_dataloader()
    assert len(loader) == 2 * 4 * 2 and list(loader) == [first] * 8 + [second] * 8
    with patch.object(GRPOTrainer, "training_step", wraps=trainer.training_step) as spy:
        trainer.train()
    assert spy.call_count == 12  # 4 optimizer steps x 3 micro-steps
    assert [call.args[1] for call in spy.call_args_list] == [first] * 8 + [second] * 4
    assert spy.call_args_list[0].args[0] is trainer.model_wrapped
    assert isinstance(spy.call_args_list[0].args[1], GenerationInputs)


# ---- overrides that change the run -------------------------------------------------------------------------


def train_and_diff(trainer):
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    return max((before[name] - after[name]).abs().max().item() for name in before)


def test_overridden_calculate_rewards_is_used_for_training_and_evaluation(tiny_model_dir, tmp_path):
    calls = []

    class Negated(GRPOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            calls.append((inputs, prompts, completions, completion_ids_list))
            return -2.0 * super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    config = make_config(tmp_path, max_steps=1, per_device_eval_batch_size=6)
    trainer = Negated(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        eval_dataset=prompts(2),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    trainer.train()
    inputs, given_prompts, completions, completion_ids = calls[0]
    assert len(inputs) == len(given_prompts) == len(completions) == len(completion_ids) == 6
    assert inputs[0]["prompt"] == given_prompts[0] and "answer" in inputs[0] and isinstance(completions[0], str)
    expected = -2.0 * sum(len(set(ids)) for ids in completion_ids) / 6
    assert expected < 0 and trainer.state.log_history[0]["reward"] == pytest.approx(expected)
    assert list(trainer._logs["rewards"]["distinct_tokens"]) == [-2.0 * len(set(ids)) for ids in completion_ids]
    metrics = trainer.evaluate()
    assert len(calls) == 2 and metrics["eval_reward"] < 0


def test_overridden_get_high_entropy_mask_is_used(tiny_model_dir, tmp_path):
    """A mask that keeps no token: nothing trains (the default keeps the top half and the weights move)."""
    thresholds = []

    class KeepsNothing(GRPOTrainer):
        def get_high_entropy_mask(self, entropies, mask, threshold):
            thresholds.append(threshold)
            return torch.zeros_like(mask, dtype=torch.bool)

    config = make_config(tmp_path / "a", top_entropy_quantile=0.5, max_steps=1)
    moved = train_and_diff(
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=config,
            train_dataset=prompts(),
            generation_backend=scripted_backend(tiny_model_dir),
        )
    )
    config = make_config(tmp_path / "b", top_entropy_quantile=0.5, max_steps=1)
    still = train_and_diff(
        KeepsNothing(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=config,
            train_dataset=prompts(),
            generation_backend=scripted_backend(tiny_model_dir),
        )
    )
    assert moved > 1e-4 and still == 0.0 and thresholds == [0.5]


def test_overridden_get_off_policy_mask_is_used(tiny_model_dir, tmp_path):
    shapes = []

    class DropsAll(GRPOTrainer):
        @staticmethod
        def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
            shapes.append((tuple(advantages.shape), off_policy_threshold))
            return torch.zeros(advantages.shape[0], 1, dtype=mask.dtype, device=mask.device)  # the model's device

    config = make_config(
        tmp_path, off_policy_mask_threshold=0.5, num_iterations=2, max_steps=2
    )  # reused samples: pi_old exists
    trainer = DropsAll(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    trainer.train()
    assert shapes and shapes[0] == ((6, 1), 0.5)
    assert [entry["off_policy_mask/dropped_fraction"] for entry in trainer.state.log_history[:2]] == [1.0, 1.0]


def test_overridden_generate_and_score_completions_and_compute_loss(tiny_model_dir, tmp_path):
    class NoAdvantage(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            assert "old_per_token_logps" not in batch and batch["num_items_in_batch"] > 0
            batch["advantages"] = torch.zeros_like(batch["advantages"])
            return batch

    class ZeroLoss(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs) * 0.0

    for trainer_class in (NoAdvantage, ZeroLoss):
        config = make_config(tmp_path / trainer_class.__name__, max_steps=1)
        trainer = trainer_class(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=config,
            train_dataset=prompts(),
            generation_backend=scripted_backend(tiny_model_dir),
        )
        assert train_and_diff(trainer) == 0.0, trainer_class.__name__


def test_overridden_generate_replaces_generation(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    fixed = [5, 6, tokenizer.eos_token_id]
    seen = []

    class Fixed(GRPOTrainer):
        def _generate(self, prompts):
            prompt_ids = super()._generate(prompts)[0]
            texts = [tokenizer.decode(fixed, skip_special_tokens=True)] * len(prompts)
            return (
                prompt_ids,
                [list(fixed)] * len(prompts),
                None,
                texts,
                None,
                {"origin": ["override"] * len(prompts)},
                None,
                [],
            )

    def reward(completion_ids, origin, **kwargs):
        seen.append((completion_ids, origin))
        return [1.0] * len(completion_ids)

    trainer = Fixed(
        model=tiny_model_dir,
        reward_funcs=reward,
        args=make_config(tmp_path, max_steps=1),
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    trainer.train()
    assert seen == [([fixed] * 6, ["override"] * 6)]
    entry = trainer.state.log_history[0]
    assert entry["completions/mean_length"] == 3.0 and entry["completions/clipped_ratio"] == 0.0


def test_generate_default_returns_trls_tuple_and_checks_rollout_func(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path),
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = trainer._generate(
        ["1+1="] * 3 + ["2+2="] * 3
    )
    assert (
        len(prompt_ids) == len(completion_ids) == len(completions) == 6
        and prompt_ids[0] == prompt_ids[2] != prompt_ids[3]
    )
    assert tool_mask is None and logprobs is None and extra == {} and images is None and tool_images == []
    assert completions[0] == trainer._tokenizer.decode(completion_ids[0], skip_special_tokens=True)

    def incomplete(prompts, trainer):
        return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[2]] * len(prompts)}

    other = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "b"),
        train_dataset=prompts(),
        rollout_func=incomplete,
    )
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        other._generate(["1+1="] * 3)
    assert other.rollout_func is incomplete  # TRL's attribute


def test_generate_with_rollout_func_needs_only_trls_attributes():
    # TRL's own dispatch tests build the trainer with object.__new__ and set what TRL's _generate reads; with a
    # rollout_func, grouprl's _generate needs nothing else either (no sampler: the function's output is the tuple).
    from types import SimpleNamespace

    trainer = object.__new__(GRPOTrainer)
    trainer.tools = None  # TRL's tests set it; on a built trainer it is a read-only view (test_agents.py)
    trainer.processing_class = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: ["decoded"] * len(ids))
    trainer.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]}
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        trainer._generate(["prompt"])
    seen = []

    def rollout(prompts, trainer):
        seen.append((prompts, trainer))
        return {
            "prompt_ids": [[1]],
            "completion_ids": [[2, 3]],
            "logprobs": [[-0.1, -0.2]],
            "env_mask": [[1, 0]],
            "answer": ["42"],
        }

    trainer.rollout_func = rollout
    prompt = [{"role": "user", "content": "hi"}]
    assert trainer._generate([prompt]) == (
        [[1]],
        [[2, 3]],
        [[1, 0]],
        [[{"role": "assistant", "content": "decoded"}]],
        [[-0.1, -0.2]],
        {"answer": ["42"]},
        None,
        [],
    )
    assert seen == [([prompt], trainer)] and seen[0][0][0] is not prompt  # a copy, as TRL passes


def test_overridden_per_token_logps_and_log_and_training_step(tiny_model_dir, tmp_path):
    calls = {"logps": [], "steps": 0}

    class Custom(GRPOTrainer):
        def _get_per_token_logps_and_entropies(
            self,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=None,
            compute_entropy=False,
            compute_aux_loss=False,
            **kwargs,
        ):
            calls["logps"].append((input_ids.shape[1] - logits_to_keep, compute_entropy))
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss
            )
            return logps, None if entropies is None else torch.zeros_like(entropies), aux

        def log(self, logs, start_time=None):
            logs["custom"] = self.state.global_step * 10
            super().log(logs, start_time)

        def training_step(self, model, inputs, num_items_in_batch=None):
            calls["steps"] += 1
            return super().training_step(model, inputs, num_items_in_batch)

    config = make_config(
        tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=3, per_device_eval_batch_size=6
    )
    trainer = Custom(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        eval_dataset=prompts(2),
        generation_backend=scripted_backend(tiny_model_dir),
    )
    trainer.train()
    assert calls["steps"] == 4 and all(entropy for _, entropy in calls["logps"]) and len(calls["logps"]) == 4
    assert [entry["entropy"] for entry in trainer.state.log_history[:2]] == [0.0, 0.0]  # the override's entropies
    trainer.evaluate()
    assert [entry["custom"] for entry in trainer.state.log_history] == [
        10,
        20,
        20,
        20,
    ]  # 2 steps, the summary, the evaluation
    assert trainer.state.log_history[-1]["eval_entropy"] == 0.0


def test_overrides_tells_grouprl_methods_from_replaced_ones():
    class Sub(GRPOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    plain, sub = object.__new__(GRPOTrainer), object.__new__(Sub)  # no construction needed to ask
    assert (
        not plain.overrides("_calculate_rewards")
        and sub.overrides("_calculate_rewards")
        and not sub.overrides("_generate")
    )
    plain._generate = lambda prompts: None  # patched onto an instance
    assert plain.overrides("_generate")
    with patch.object(GRPOTrainer, "_get_per_token_logps_and_entropies"):  # or onto the class
        assert object.__new__(GRPOTrainer).overrides("_get_per_token_logps_and_entropies")


# ---- refusals at class definition ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, advice",
    [
        ("_generate_single_turn", "generation_backend"),
        ("_tool_call_loop", "rollout_func"),
        ("get_train_dataloader", "PromptSampler"),
        ("_get_train_sampler", "shuffle_dataset"),
        ("prediction_step", "on_evaluate"),
        ("_save_checkpoint", "on_save"),
        ("create_optimizer", r"optimizers=\(optimizer, lr_scheduler\)"),
        ("get_gamma_weights", "_compute_loss"),
        ("_log_metric", "override log"),
    ],
)
def test_unsupported_override_is_refused_when_the_class_is_defined(method, advice):
    with pytest.raises(
        TypeError, match=rf"(?s)Sub overrides {method}, which grouprl's GRPOTrainer never calls.*{method}: .*{advice}"
    ):
        type("Sub", (GRPOTrainer,), {method: lambda self, *args, **kwargs: None})


def test_honoured_overrides_define_fine():
    honoured = (
        "training_step",
        "_prepare_inputs",
        "_generate_and_score_completions",
        "compute_loss",
        "_compute_loss",
        "_generate",
        "_calculate_rewards",
        "_get_per_token_logps_and_entropies",
        "get_high_entropy_mask",
        "log",
        "evaluate",
        "_send_telemetry",
    )
    sub = type("Sub", (GRPOTrainer,), {name: lambda self, *args, **kwargs: None for name in honoured})
    assert issubclass(sub, GRPOTrainer)


def test_callbacks_see_control_through_the_trainer(tiny_model_dir, tmp_path):
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=3),
        train_dataset=prompts(),
        callbacks=[Stop()],
        generation_backend=scripted_backend(tiny_model_dir),
    )
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.control.should_training_stop


@pytest.mark.parametrize("log_multimodal", [True, False])
def test_vlm_logs_images_only_with_log_multimodal(tmp_path, log_multimodal):
    from vlm_models import image, tiny_qwen2_vl

    model, processor = tiny_qwen2_vl()
    data = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"what is {i}?"}], "image": image(i)} for i in range(4)]
    )
    config = make_config(
        tmp_path,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        log_multimodal=log_multimodal,
    )
    trainer = GRPOTrainer(
        model,
        lambda completions, **k: [1.0] * len(completions),
        args=config,
        train_dataset=data,
        processing_class=processor,
    )
    trainer.train()
    assert len(trainer._logs["prompt"]) == 4
    if log_multimodal:  # each row's prompt images, as TRL keeps them: the images of that row's prompt
        assert len(trainer._logs["images"]) == 4
        originals = {image(i).tobytes() for i in range(4)}
        for prompt, row in zip(trainer._logs["prompt"], trainer._logs["images"]):
            blocks = [block["image"] for block in prompt[0]["content"] if block["type"] == "image"]
            assert len(row) == 1 and row[0].tobytes() == blocks[0].tobytes() and row[0].tobytes() in originals
    else:
        assert len(trainer._logs["images"]) == 0

    class CustomLogps(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )

    with pytest.raises(
        NotImplementedError, match="overrides _get_per_token_logps_and_entropies, which grouprl can call only for text"
    ):
        CustomLogps(
            model,
            lambda completions, **k: [1.0] * len(completions),
            args=config,
            train_dataset=data,
            processing_class=processor,
        )
