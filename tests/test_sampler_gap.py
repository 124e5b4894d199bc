"""The gap between a sampler's logprobs and the training forward's, measured in every run for every sampler that
returns them (TRL's sampling/* metrics), corrected where either computes below fp32, and a health finding when it is
far: a decode step that computes something else is caught at run time, under bf16 too."""

import logging

import pytest
import torch
from helpers import distinct_tokens, numbered_prompts, quiet_config

from grouprl import GRPOTrainer
from grouprl.generation.model_step import ModelStep

GAP = "sampling/sampling_logp_difference/mean"


def run(tiny_model_dir, tmp_path, **overrides):
    config = quiet_config(
        tmp_path,
        overrides,
        max_steps=1,
        per_device_train_batch_size=6,
        max_completion_length=12,
        learning_rate=0.0,
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir), reward_funcs=distinct_tokens, args=config, train_dataset=numbered_prompts()
    )
    trainer.train()
    return trainer.state.log_history[0]


@pytest.mark.parametrize("engine", ["engine", "captured"])
def test_every_in_process_sampler_logs_its_gap_to_the_trainer(tiny_model_dir, tmp_path, engine):
    """fp32, in this process: the gap is logged from the loss's own forward (no pass of its own), and it is rounding
    only; nothing to correct there (the ratios are 1 to within the gap). transformers generate returns no logprobs
    (as in TRL), so there is nothing to compare."""
    logged = run(tiny_model_dir, tmp_path, generation_engine=engine, bf16=False)
    assert 0.0 <= logged[GAP] < 1e-4 and logged["sampling/sampling_logp_difference/max"] < 1e-3
    assert abs(logged["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4


def test_under_bf16_the_in_process_sampler_is_corrected(tiny_model_dir, tmp_path, monkeypatch):
    """Under bf16 autocast the captured loop's logprobs differ from the training forward's by rounding: the
    correction's weights reach the loss (experience.py: 'correct'), not only the metrics."""
    from grouprl.train import micro_step

    seen = []
    weights_from_forward = micro_step.weights_from_forward
    monkeypatch.setattr(
        micro_step,
        "weights_from_forward",
        lambda logprobs, b, c: seen.append(b.sampler_in_forward) or weights_from_forward(logprobs, b, c),
    )
    logged = run(tiny_model_dir, tmp_path, generation_engine="captured", bf16=True, use_cpu=True)
    assert seen and set(seen) == {"correct"}
    assert logged[GAP] < 0.05


def test_a_planted_step_error_under_bf16_is_caught_at_run_time(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """The decode step (this Qwen2's: the fused one) giving three times its logits, as a forgotten logits scaling
    would, under bf16, planted after it was admitted (an error the fp32 probe did not see): the run's health check
    names the gap; the same run with the step intact does not."""
    from grouprl.generation.fused_step import FusedDecoder

    step = FusedDecoder.step
    runs = {}
    for planted in (False, True):
        if planted:
            monkeypatch.setattr(FusedDecoder, "step", lambda self, *args: step(self, *args) * 3.0)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="grouprl"):
            logged = run(tiny_model_dir, tmp_path / str(planted), generation_engine="captured", bf16=True, use_cpu=True)
        runs[planted] = (logged[GAP], "nats a token from the training forward's" in caplog.text)
    assert runs[False][1] is False and runs[True][1] is True, runs
    assert runs[True][0] > 10 * runs[False][0]


def test_a_bf16_models_probe_runs_on_an_fp32_twin_of_its_class(tiny_model_dir):
    """Admission does not trust a bf16 model by name: the probe builds its class from its config, shrunk, in fp32,
    where the step computes as the forward over 128 positions to rounding (tests/test_model_families.py plants
    errors there)."""
    from transformers import AutoModelForCausalLM

    from grouprl.generation import decode_probe

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    twin = decode_probe.twin(model)
    assert type(twin) is type(model) and twin.get_input_embeddings().weight.dtype == torch.float32
    assert twin.config.num_hidden_layers == 2 and twin.config.vocab_size <= decode_probe.VOCAB
    assert decode_probe.step_gap(twin, ModelStep, positions=128) < 1e-5
