"""GRPOConfig.pad_to_multiple_of (TRL's): the training batch's prompt and completion widths, and every training
forward's, are multiples of it; the values and the loss are those of the unpadded run."""

import pytest
import torch
from helpers import GradientRecorder, distinct_tokens, quiet_config, scripted_backend
from helpers import numbered_prompts as prompts
from transformers import AutoModelForCausalLM

from grouprl import GRPOTrainer
from grouprl.core.types import Completion, PromptBatch, Rollout
from grouprl.model.logprobs import completion_logprobs
from grouprl.rollout.train_batch import pack_rollout


def rollout():
    """Two prompts (3 and 5 tokens), two completions each (2, 7 and 4, 1 tokens)."""
    batch = PromptBatch(
        prompts=["a", "b"],
        prompt_ids=[[5, 6, 7], [8, 9, 10, 11, 12]],
        columns={},
        dataset_indices=[0, 1],
        group_ids=[0, 1],
        num_samples=[2, 2],
    )
    lengths = [2, 7, 4, 1]
    completions = [
        Completion(r // 2, list(range(20 + r, 20 + r + n)), "", "length", [-0.5] * n, tool_mask=[True] * n)
        for r, n in enumerate(lengths)
    ]
    return Rollout(batch, completions)


def test_train_batch_widths_are_multiples_and_micro_batches_keep_them():
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    plain = pack_rollout(rollout(), advantages, pad_token_id=0, mask_truncated=False)
    padded = pack_rollout(rollout(), advantages, pad_token_id=0, mask_truncated=False, pad_to_multiple_of=4)
    assert plain.prompt_ids.shape == (4, 5) and plain.completion_ids.shape == (4, 7)
    assert padded.prompt_ids.shape == (4, 8) and padded.completion_ids.shape == (4, 8)
    # the same rows, with more padding: left of the prompts, right of the completions
    assert torch.equal(padded.prompt_ids[:, 3:], plain.prompt_ids) and not padded.prompt_mask[:, :3].any()
    assert torch.equal(padded.prompt_mask[:, 3:], plain.prompt_mask)
    for name in ("completion_ids", "completion_mask", "loss_mask", "sampler_logprobs"):
        assert torch.equal(getattr(padded, name)[:, :7], getattr(plain, name)), name
    assert not padded.completion_mask[:, 7:].any() and not padded.loss_mask[:, 7:].any()
    # a micro-batch is trimmed to its longest rows, then rounded up again
    shapes = {
        rows: [
            tuple(b.select(torch.tensor(rows)).prompt_ids.shape)
            + tuple(b.select(torch.tensor(rows)).completion_ids.shape[1:])
            for b in (plain, padded)
        ]
        for rows in ((0, 3), (0,), (1,))
    }
    assert shapes == {(0, 3): [(2, 5, 2), (2, 8, 4)], (0,): [(1, 3, 2), (1, 4, 4)], (1,): [(1, 3, 7), (1, 4, 8)]}


def test_every_forward_is_padded_and_the_logprobs_do_not_change(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    advantages = torch.zeros(4)
    plain = pack_rollout(rollout(), advantages, pad_token_id=0, mask_truncated=False)
    padded = pack_rollout(rollout(), advantages, pad_token_id=0, mask_truncated=False, pad_to_multiple_of=8)
    widths = []
    hook = model.register_forward_pre_hook(  # a training pass may hand the model its tokens looked up (inputs_embeds)
        lambda m, args, kwargs: widths.append(kwargs.get("input_ids", kwargs.get("inputs_embeds")).shape[:2]),
        with_kwargs=True,
    )
    try:
        expected = completion_logprobs(
            model, plain.prompt_ids, plain.prompt_mask, plain.completion_ids, plain.completion_mask, temperature=0.7
        )
        first = len(widths)
        got = completion_logprobs(
            model,
            padded.prompt_ids,
            padded.prompt_mask,
            padded.completion_ids,
            padded.completion_mask,
            temperature=0.7,
            rows_per_chunk=2,
            pad_to_multiple_of=8,
        )
    finally:
        hook.remove()
    assert widths[first:] and all(shape[1] % 8 == 0 for shape in widths[first:]), widths
    assert any(shape[1] % 8 for shape in widths[:first])  # unpadded: the rows' own lengths
    real = padded.completion_mask
    torch.testing.assert_close(
        got.logprobs[:, :7][real[:, :7]], expected.logprobs[plain.completion_mask], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        got.entropy[:, :7][real[:, :7]], expected.entropy[plain.completion_mask], rtol=1e-5, atol=1e-5
    )


def train_one_step(tiny_model_dir, tmp_path, **overrides):
    shapes = []

    class Recording(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            shapes.append((tuple(inputs["prompt_ids"].shape), tuple(inputs["completion_ids"].shape)))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = quiet_config(
        tmp_path,
        overrides,
        per_device_train_batch_size=6,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        learning_rate=0.1,
        max_steps=1,
        bf16=False,
        beta=0.1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    recorder = GradientRecorder(model.named_parameters())  # lr 0: the step's gradients, compared exactly
    trainer = Recording(
        model,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=scripted_backend(tiny_model_dir),
        optimizers=(recorder, None),
    )
    trainer.train()
    return shapes, trainer.state.log_history[0], recorder.steps[0]


@pytest.mark.parametrize("multiple", [8, 5])
def test_training_with_padding_matches_training_without(tiny_model_dir, tmp_path, multiple):
    plain_shapes, plain_log, plain_grads = train_one_step(tiny_model_dir, tmp_path / "plain")
    shapes, log, grads = train_one_step(tiny_model_dir, tmp_path / "padded", pad_to_multiple_of=multiple)
    assert len(shapes) == len(plain_shapes) == 2
    assert all(p % multiple == 0 and c % multiple == 0 for (_, p), (_, c) in shapes), shapes
    assert any(p % multiple or c % multiple for (_, p), (_, c) in plain_shapes), plain_shapes
    for key in ("loss", "kl", "entropy", "completions/mean_length"):
        assert log[key] == pytest.approx(plain_log[key], rel=1e-4, abs=1e-6), key
    assert grads.keys() == plain_grads.keys()
    for name, value in grads.items():
        torch.testing.assert_close(value, plain_grads[name], rtol=1e-4, atol=1e-6)
