"""Training runs on 2 CPU processes (gloo) for tests/test_stats_reduction.py: what each process saw locally, and
what the main process logged, so the test can check the logged statistics against the reduction over all processes.

    accelerate launch --num_processes 2 tests/stats_worker.py OUT_DIR MODEL_DIR SCENARIO

Scenarios:
    stats  2 optimizer steps on one generation (num_iterations=2: the second step's policy ratio is not 1), with sampler
           logprobs that differ per process (so the sampler IS statistics differ per process). Each process records its
           local policy_loss statistics (and loss-token count) and its local sampler IS statistics.
    nan    the loss turns NaN on process 1 only, in step 2. Each process records the error it raised (or none).
Each process writes OUT_DIR/<scenario>-rank<r>.pt.
"""

from __future__ import annotations

import os
import sys

import datasets
import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer

import grouprl.rollout.experience
import grouprl.train.micro_step
from grouprl import GRPOConfig, GRPOTrainer, NonFiniteError
from grouprl.core.types import Completion

NUM_GENERATIONS = 4


class ProcessDependentSampler:
    """Completions decided by the prompt, with sampler logprobs that depend on the process (a separate engine):
    process 1's are higher, so its importance ratios are lower, and the global minimum is not the main process's."""

    needs_importance_correction = True

    def __init__(self, tokenizer):
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id

    def sync_weights(self, model):
        pass

    def generate(self, prompt_ids, num_samples, params):
        rank = PartialState().process_index
        out = []
        for p, ids in enumerate(prompt_ids):
            for s in range(num_samples):
                tokens = [(ids[-1] + 7 * s + k) % 200 + 3 for k in range(2 + (s + len(ids)) % 5)] + [self.eos]
                logprobs = [-5.0 + 0.7 * rank - 0.3 * ((k + s) % 3) for k in range(len(tokens))]
                out.append(
                    Completion(
                        p,
                        tokens,
                        self.tokenizer.decode(tokens, skip_special_tokens=True),
                        "stop",
                        sampler_logprobs=logprobs,
                    )
                )
        return out


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids)) + sum(ids) % 5) for ids in completion_ids]


def run(scenario: str, out_dir: str, model_dir: str) -> None:
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GRPOConfig(
        output_dir=os.path.join(out_dir, scenario),
        per_device_train_batch_size=12 // processes,
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=8,
        learning_rate=0.5,
        max_steps=2 if scenario == "stats" else 3,
        num_iterations=2 if scenario == "stats" else 1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
        gradient_checkpointing=False,
        max_grad_norm=0,
        lr_scheduler_type="constant",
        loss_type="grpo",
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=1e6,
    )
    dataset = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(12)]})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        optimizers=(torch.optim.SGD(model.parameters(), lr=config.learning_rate), None),
        generation_backend=ProcessDependentSampler(tokenizer) if scenario == "stats" else None,
    )
    rank = trainer.accelerator.process_index
    result: dict = {"processes": processes, "loss_stats": [], "is_stats": [], "error": None}
    if scenario == "stats":
        policy_loss, importance = (
            grouprl.train.micro_step.policy_loss,
            grouprl.rollout.experience.sampler_importance_weights,
        )

        def recording_policy_loss(loss_type, logprobs, old, advantages, mask, **kwargs):
            loss, stats = policy_loss(loss_type, logprobs, old, advantages, mask, **kwargs)
            result["loss_stats"].append({"tokens": float(mask.sum()), **{k: float(v) for k, v in stats.items()}})
            return loss, stats

        def recording_importance(*args, **kwargs):
            rho, stats = importance(*args, **kwargs)
            result["is_stats"].append(dict(stats))
            return rho, stats

        grouprl.train.micro_step.policy_loss = recording_policy_loss
        grouprl.rollout.experience.sampler_importance_weights = recording_importance
        # collectives made while computing each micro-batch's loss and statistics
        # (the reduction waits for the step's end)
        calls = {"collectives": 0}
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_gather_object"):

            def counted(*args, _original=getattr(torch.distributed, name), **kwargs):
                calls["collectives"] += 1
                return _original(*args, **kwargs)

            setattr(torch.distributed, name, counted)
        compute_loss = trainer.compute_loss
        result["loss_collectives"] = []

        def counted_compute_loss(model, inputs, *args, **kwargs):
            before = calls["collectives"]
            loss = compute_loss(model, inputs, *args, **kwargs)
            result["loss_collectives"].append(calls["collectives"] - before)
            return loss

        trainer.compute_loss = counted_compute_loss
    else:
        inner = trainer.accelerator.unwrap_model(trainer.run.model)

        def poison(
            module, args, output
        ):  # process 1 only, in step 2 (global_step 1 until its update), training forward only
            if rank == 1 and trainer.state.global_step == 1 and torch.is_grad_enabled():
                return output * float("nan")
            return output

        inner.model.norm.register_forward_hook(poison)
    try:
        trainer.train()
    except NonFiniteError as error:
        result["error"] = str(error)
    result["step_collectives"] = trainer.run.collectives.collectives  # the loop's reductions of the statistics
    result["log_history"] = trainer.state.log_history
    result["global_step"] = trainer.state.global_step
    torch.save(result, os.path.join(out_dir, f"{scenario}-rank{rank}.pt"))


if __name__ == "__main__":
    out_dir, model_dir, scenario = sys.argv[1:]
    run(scenario, out_dir, model_dir)
