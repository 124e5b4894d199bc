"""The batch plan: every size derived from the config and the process count, as TRL derives them.

Also the TrainingArguments convention for step counts given as a fraction of the run (``resolve_steps``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from grouprl.config.grpo_fields import GRPOFields


@dataclass(frozen=True)
class BatchPlan:
    """Sizes derived from the config and the process count; printed at start-up.

    Vocabulary: a *generation* samples `completions_per_generation` completions (G for each of
    `prompts_per_generation` prompts) across all processes; it is cut into `steps_per_generation`
    micro-batches per process and replayed `num_iterations` times; an optimizer step consumes
    `gradient_accumulation_steps` micro-batches.
    """

    num_processes: int
    num_generations: int
    per_device_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    num_iterations: int
    completions_per_generation: int  # global, = generation_batch_size
    prompts_per_generation: int  # unique prompts per generation, global

    @property
    def completions_per_process(self) -> int:
        return self.completions_per_generation // self.num_processes

    @property
    def micro_steps_per_generation(self) -> int:
        return self.steps_per_generation * self.num_iterations

    @property
    def completions_per_optimizer_step(self) -> int:
        return self.per_device_batch_size * self.gradient_accumulation_steps * self.num_processes

    @property
    def old_logprobs_needed(self) -> bool:
        """TRL §2.6: old logprobs are computed unless the batch is provably on-policy at its only use."""
        return self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) != 0

    def micro_steps_per_epoch(self, num_prompts: int) -> int:
        """An epoch's micro-batches: each whole generation of its prompts, replayed (the rest of the prompts wait
        for the next epoch's shuffle, as TRL's RepeatSampler drops an incomplete generation)."""
        return num_prompts // self.prompts_per_generation * self.micro_steps_per_generation

    def optimizer_steps_per_epoch(self, num_prompts: int) -> int:
        """As transformers' Trainer: an epoch's last optimizer step takes the micro-batches left over, fewer than
        gradient_accumulation_steps when the epoch's count is not a multiple of it."""
        return max(1, math.ceil(self.micro_steps_per_epoch(num_prompts) / self.gradient_accumulation_steps))

    def micro_batches_in_step(self, step: int, micro_steps_per_epoch: Optional[int]) -> int:
        """Micro-batches of optimizer step `step` (0-based): gradient_accumulation_steps, except an epoch's last
        step, which takes what is left of the epoch (TRL's `current_gradient_accumulation_steps`; the loss divides
        by it). Without epochs (an iterable dataset) every step takes gradient_accumulation_steps."""
        ga = self.gradient_accumulation_steps
        if not micro_steps_per_epoch:
            return ga
        steps_per_epoch = math.ceil(micro_steps_per_epoch / ga)
        if step % steps_per_epoch < steps_per_epoch - 1:
            return ga
        return micro_steps_per_epoch - (steps_per_epoch - 1) * ga

    def describe(self, num_prompts: Optional[int] = None) -> str:
        ratio = self.micro_steps_per_generation / self.gradient_accumulation_steps
        per_gen = (
            f"{ratio:g} optimizer step(s) per generation"
            if ratio >= 1
            else f"{1 / ratio:g} generations per optimizer step"
        )
        lines = [
            "grouprl batch plan",
            f"  generation: {self.prompts_per_generation} prompts x {self.num_generations} completions = "
            f"{self.completions_per_generation} completions ({self.completions_per_process} per process, "
            f"{self.num_processes} process(es))",
            f"  micro-batches: {self.steps_per_generation} of {self.per_device_batch_size} completions per process, "
            f"replayed {self.num_iterations}x (num_iterations)",
            f"  optimizer step: {self.gradient_accumulation_steps} micro-batch(es) = "
            f"{self.completions_per_optimizer_step} completions; {per_gen}",
            "  old logprobs: "
            f"{'computed (samples are reused off-policy)' if self.old_logprobs_needed else 'not needed (on-policy)'}",
        ]
        if num_prompts is not None:
            steps, micro = self.optimizer_steps_per_epoch(num_prompts), self.micro_steps_per_epoch(num_prompts)
            last = self.micro_batches_in_step(steps - 1, micro)
            partial = (
                f" (the last takes the {last} micro-batch(es) left)"
                if micro and last != self.gradient_accumulation_steps
                else ""
            )
            lines.append(f"  epoch: {num_prompts} prompts -> {steps} optimizer steps{partial}")
        return "\n".join(lines)


def plan_batches(config: GRPOFields, num_processes: int = 1) -> BatchPlan:
    """Derive the batch plan exactly as TRL does (§1.3, §2.13); reject impossible combinations."""
    per_step = config.per_device_train_batch_size * num_processes
    g = config.num_generations
    # What the user set (GRPOConfig resolves both fields for its own process count and keeps the given pair).
    generation_batch_size, steps_per_generation = getattr(
        config, "batch_spec", (config.generation_batch_size, config.steps_per_generation)
    )
    if (
        generation_batch_size is not None
        and steps_per_generation is not None
        and generation_batch_size != per_step * steps_per_generation
    ):
        raise ValueError(
            "GRPOConfig: set either generation_batch_size or steps_per_generation, not both "
            f"(got generation_batch_size={generation_batch_size}, steps_per_generation={steps_per_generation}, which "
            f"disagree for {per_step} completions per micro-step across processes); one is derived from the other."
        )
    if generation_batch_size is not None:
        if generation_batch_size % per_step != 0:
            raise ValueError(
                f"GRPOConfig.generation_batch_size={generation_batch_size} must be divisible by "
                f"per_device_train_batch_size ({config.per_device_train_batch_size}) x processes ({num_processes}) = "
                f"{per_step}. Valid values include {', '.join(str(per_step * k) for k in range(1, 5))}."
            )
        steps_per_generation = generation_batch_size // per_step
    else:
        steps_per_generation = steps_per_generation or config.gradient_accumulation_steps
    generation_batch = per_step * steps_per_generation
    if generation_batch % g != 0:
        valid_g = [d for d in range(2, generation_batch + 1) if generation_batch % d == 0]
        fits = [b for b in range(1, 4 * g + 1) if (b * num_processes * steps_per_generation) % g == 0][:4]
        raise ValueError(
            f"The generation batch ({config.per_device_train_batch_size} per_device_train_batch_size x {num_processes} "
            f"processes x {steps_per_generation} steps_per_generation = {generation_batch} completions) must be "
            f"divisible by num_generations={g}, so that every prompt gets all its completions in the same generation. "
            f"Valid num_generations for this batch: {valid_g or 'none (increase the batch)'}; or keep "
            f"num_generations={g} and use per_device_train_batch_size in {fits}, or raise steps_per_generation / "
            "gradient_accumulation_steps."
        )
    return BatchPlan(
        num_processes=num_processes,
        num_generations=g,
        per_device_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        steps_per_generation=steps_per_generation,
        num_iterations=config.num_iterations,
        completions_per_generation=generation_batch,
        prompts_per_generation=generation_batch // g,
    )


def resolve_steps(value: float, total_steps: int) -> int:
    """TrainingArguments convention: a value in (0, 1) is a fraction of the total optimizer steps."""
    if 0 < value < 1:
        return max(1, math.ceil(value * total_steps))
    return int(value)
