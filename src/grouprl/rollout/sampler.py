"""One generation: prompts -> completions -> rewards -> advantages -> TrainBatch.

This is the "experience" half of a GRPO step. It samples G completions for each of the
generation's prompts (this process's slice), scores them with the reward functions, gathers the
rewards from every process so that each group is normalised whole, and packs this process's
rows into padded tensors with a loss mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from accelerate import Accelerator

from grouprl.agents import Agent, tool_call_stats
from grouprl.core.advantages import estimate_advantages
from grouprl.core.distributed import (
    gather_objects,
    gather_rows,
    global_sum,
    keep_row_values,
    keep_rows,
    layout_of,
    run_on_main,
)
from grouprl.core.metrics import MetricWindow, completion_length_stats, reward_stats
from grouprl.core.types import Completion, GroupLayout, PromptBatch, Rewards, Rollout, SamplingParams, TrainBatch
from grouprl.data.multimodal_prompts import rows_images
from grouprl.data.prompt_sampler import GenerationInputs, PromptSampler
from grouprl.data.prompts import IMAGE_COLUMNS, PromptTokenizer, is_conversational, local_prompt_batch
from grouprl.generation.protocol import GenerationBackend, backend_report, sample_for_processes, sample_groups
from grouprl.rewards.scoring import RewardFunction, score_completions
from grouprl.rollout.completion_log import CompletionLog, RecentCompletions
from grouprl.rollout.train_batch import pack_rollout, row_prompt_ids


@dataclass
class RolloutSettings:
    num_generations: int
    scale_rewards: str
    multi_objective_aggregation: str
    mask_truncated_completions: bool
    remove_unused_columns: bool
    pad_token_id: int
    # The prompt of rows without one (environments own the data); None: required
    default_prompt: Optional[list[dict]] = None
    advantage_estimator: str = "grpo"  # a name in core.advantages.ADVANTAGE_ESTIMATORS
    pad_to_multiple_of: Optional[int] = None  # GRPOConfig's: train batch widths are multiples of it (train_batch.py)


@dataclass
class RolloutMaker:
    """Everything one generation needs; built once by the trainer."""

    accelerator: Accelerator
    backend: GenerationBackend
    sampler: PromptSampler
    tokenize: PromptTokenizer
    reward_functions: list[RewardFunction]
    reward_weights: torch.Tensor  # (F,)
    sampling: SamplingParams
    settings: RolloutSettings
    generations_made: int = 0
    tokens_seen: int = 0
    completion_extras: dict[str, list[Any]] = field(default_factory=dict)  # log_extra columns of the last generation
    completion_log: Optional[CompletionLog] = None  # set when log_completions is on
    synced_step: Optional[int] = None  # optimizer step whose weights the backend samples from
    agent: Optional[Agent] = None  # multi-turn rollouts (tools, environments, rollout_func); None: single-turn
    recent: Optional[RecentCompletions] = None  # TRL's trainer._logs: the latest generation batch's rows
    # A TRL subclass's _generate / _calculate_rewards, adapted (set when a run starts, only where overridden)
    generate_hook: Optional[Callable[[PromptBatch], Optional[list[Completion]]]] = None
    reward_hook: Optional[Callable[["RolloutMaker", Rollout, MetricWindow], Optional[torch.Tensor]]] = None
    # Which rows of the global batch train, given this process's rollout and the global rewards: a (N_global,) bool
    # mask (GFPO's group filter); None keeps every row. Advantages are then computed over the kept rows only.
    row_filter: Optional[Callable[[Rollout, Rewards], torch.Tensor]] = None
    # Asynchronous generation (async_rollouts.AsyncRollouts): where the next generations come from, sampled ahead
    # by a worker process; None: sampled here, when drawn
    source: Any = None

    def sync_weights(self, model: torch.nn.Module, step: int) -> None:
        """Hand the policy's weights to the backend before sampling, at most once per optimizer step (as TRL). An
        asynchronous worker gets them from the loop after each optimizer step instead (train/loop.py)."""
        if self.source is None and self.synced_step != step:
            self.backend.sync_weights(model)
            self.synced_step = step

    def release_sampler(self) -> None:
        """Once a generation is sampled: free what the backend holds only to sample (a sharded policy's replica,
        factory.ShardedPolicySampler), which the next sync fills again."""
        release = getattr(self.backend, "release_until_sync", None)
        if self.source is None and release is not None:
            release()
            self.synced_step = None

    def draw_prompts(self) -> GenerationInputs:
        """The next generation's prompts on this process, as the rows TRL's override points receive (with asynchronous
        generation: the next one the worker finished, in prompt order, its completions attached)."""
        if self.source is not None:
            return self.source.take()
        indices, rows = self.sampler.next_generation()
        inputs = self.prompt_inputs(indices, rows, self.generations_made)
        self.generations_made += 1
        return inputs

    def prompt_inputs(self, indices: list[int], rows: list[dict], generation_index: int) -> GenerationInputs:
        """This process's share of a generation of `rows` (one prompt per group of G), laid out over the processes."""
        layout = GroupLayout.for_generation(
            generation_index,
            len(rows),
            self.settings.num_generations,
            self.accelerator.num_processes,
            self.accelerator.process_index,
        )
        prompts = local_prompt_batch(
            indices,
            rows,
            layout,
            tokenize=self.tokenize,
            remove_unused_columns=self.settings.remove_unused_columns,
            default_prompt=self.settings.default_prompt,
        )
        return GenerationInputs.of(prompts, dict(zip(indices, rows)), self.settings.remove_unused_columns)

    def sample(self, inputs: Optional[GenerationInputs] = None) -> Rollout:
        """Completions for `inputs` (default: the next prompts drawn); those a worker already sampled, if it did."""
        inputs = inputs if inputs is not None else self.draw_prompts()
        if getattr(inputs, "sampled", None) is not None:
            return inputs.sampled
        return Rollout(inputs.prompt_batch, self.generate(inputs.prompt_batch))

    @property
    def sampler_is_separate(self) -> bool:
        """The completions come from another copy of the weights (a server, vLLM, an asynchronous worker), whose
        logprobs the trainer corrects for."""
        return self.source is not None or getattr(self.backend, "needs_importance_correction", True)

    def sampler_report(self) -> dict[str, float]:
        """The sampler's statistics since the last call: an asynchronous source's async/* ones, or the in-process
        backend's own (a `report()` method, if it has one: the captured loop's compiles)."""
        return self.source.report() if self.source is not None else backend_report(self.backend)

    def generate(self, prompts: PromptBatch) -> list[Completion]:
        if self.generate_hook is not None and (overridden := self.generate_hook(prompts)) is not None:
            return overridden
        return self.generate_default(prompts)

    def generate_default(self, prompts: PromptBatch) -> list[Completion]:
        if self.agent is not None:
            return self.agent.generate(self.backend, prompts, self.sampling)
        return generate_for(self.backend, prompts, self.sampling)

    def score(
        self, rollout: Rollout, trainer_state: Any, window: MetricWindow
    ) -> tuple[Rollout, Rewards, torch.Tensor]:
        """The rows that train on this process, the global batch's rewards, and this process's advantages (N,);
        logs reward/length metrics.

        With a `row_filter` (GFPO) only the kept rows go on: the returned rollout is a new one holding this
        process's share of them (the given one is left as it was) and the rewards and advantages cover them only.
        """
        self.log_lengths(rollout, window)
        # An overridden _calculate_rewards first
        scored = self.reward_hook(self, rollout, window) if self.reward_hook is not None else None
        if scored is None:
            scored = gather_rows(self.accelerator, self.reward_table(rollout, trainer_state, window))  # (N_global, F)
        rewards = Rewards(scored, [f.name for f in self.reward_functions], self.reward_weights)
        layout, group_size = layout_of(rollout.prompts), self.settings.num_generations
        keep = self.row_filter(rollout, rewards) if self.row_filter is not None else None  # (N_global,) bool
        if keep is not None:
            rollout = keep_rows(rollout, layout, keep)
            self.completion_extras = {
                name: keep_row_values(values, layout, keep) for name, values in self.completion_extras.items()
            }
            rewards = Rewards(rewards.per_function[keep], rewards.names, rewards.weights)
            layout = rollout.prompts.layout
            group_size = layout.uniform_group_size()
        advantages, stats = self.global_advantages(rewards, group_size)
        window.add_all(reward_stats(rewards.per_function, rewards.names, stats["total"], stats["group_std"]))
        # Completions no reward function scored are reported by score_completions, with their row (TRL's warning).
        local = advantages[layout.local_rows]
        if self.completion_log is not None:
            self.record_completions(rollout, rewards, local, layout)
        if self.recent is not None:
            self.record_recent(rollout, rewards, advantages)
        return rollout, rewards, local

    def reward_table(self, rollout: Rollout, trainer_state: Any, window: MetricWindow) -> torch.Tensor:
        """(n_local, F) rewards of this process's completions; log_extra columns land in completion_extras."""
        self.completion_extras = {}
        return score_completions(
            self.reward_functions,
            prompts=[rollout.prompts.prompts[b] for b in rollout.row_prompt],
            completions=completion_inputs(rollout),
            completion_ids=[c.token_ids for c in rollout.completions],
            columns=reward_columns(rollout),
            trainer_state=trainer_state,
            log_metric=window.add,
            log_extra=self.completion_extras.__setitem__,
        )

    def log_lengths(self, rollout: Rollout, window: MetricWindow) -> None:
        """completions/* (and tools/*) metrics and the running num_tokens, over everything the model generated."""
        lengths = torch.tensor([c.num_model_tokens for c in rollout.completions])  # tool output is not the model's
        stopped = torch.tensor([c.finish_reason == "stop" for c in rollout.completions])
        window.add_all(
            completion_length_stats(gather_rows(self.accelerator, lengths), gather_rows(self.accelerator, stopped))
        )
        if self.agent is not None and self.agent.has_tools:
            calls = gather_rows(
                self.accelerator, torch.tensor([[c.tool_calls, c.tool_failures] for c in rollout.completions])
            )
            window.add_all(tool_call_stats(calls[:, 0], calls[:, 1]))
        prompt_tokens = sum(len(p) for p in row_prompt_ids(rollout))
        self.tokens_seen += int(global_sum(self.accelerator, prompt_tokens + int(lengths.sum())))
        window.add("num_tokens", self.tokens_seen)

    def record_completions(
        self, rollout: Rollout, rewards: Rewards, advantages: torch.Tensor, layout: GroupLayout
    ) -> None:
        batch, rows = rollout.prompts, layout.local_rows
        texts = {b: self.tokenize.prompt_text(batch.prompts[b], batch.prompt_ids[b]) for b in set(rollout.row_prompt)}
        self.completion_log.record(
            self.accelerator,
            prompts=[texts[b] for b in rollout.row_prompt],
            completions=[c.text for c in rollout.completions],
            rewards={name: rewards.per_function[rows, k] for k, name in enumerate(rewards.names)},
            advantages=advantages,
            extras=self.completion_extras,
            images=logged_images(rollout, self.tools_may_return_images),
        )

    def record_recent(self, rollout: Rollout, rewards: Rewards, advantages: torch.Tensor) -> None:
        """TRL's trainer._logs: prompts and completions as reward functions saw them, global rewards and advantages."""
        batch = rollout.prompts
        images = logged_images(rollout, self.tools_may_return_images)
        self.recent.record(
            self.accelerator,
            prompts=[batch.prompts[b] for b in rollout.row_prompt],
            completions=completion_inputs(rollout),
            rewards={name: rewards.per_function[:, k] for k, name in enumerate(rewards.names)},
            advantages=advantages,
            extras=self.completion_extras,
            images=images,
        )

    @property
    def tools_may_return_images(self) -> bool:
        """Whether a rollout may hold images its tools returned: tools, and a vision-language model's processor."""
        return self.agent is not None and self.agent.has_tools and self.agent.settings.processor is not None

    def global_advantages(
        self, rewards: Rewards, group_size: Optional[int] = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Advantages (N_global,) of gathered rewards (groups of `group_size`, default G), and group_advantages'
        statistics."""
        return estimate_advantages(
            self.settings.advantage_estimator,
            rewards.per_function,
            rewards.weights,
            group_size=group_size or self.settings.num_generations,
            scale_rewards=self.settings.scale_rewards,
            aggregation=self.settings.multi_objective_aggregation,
        )

    def make_train_batch(self, rollout: Rollout, advantages: torch.Tensor) -> TrainBatch:
        settings = self.settings
        batch = pack_rollout(
            rollout, advantages, settings.pad_token_id, settings.mask_truncated_completions, settings.pad_to_multiple_of
        )
        # Built complete, with the loss-token count of every process
        return replace(batch, num_loss_tokens=global_sum(self.accelerator, float(batch.loss_mask.sum())))


def completion_inputs(rollout: Rollout) -> list[Any]:
    """(N,) completions as reward functions get them: text, or for conversational prompts the assistant (and
    tool) messages."""
    conversational = is_conversational(rollout.prompts.prompts[0])
    return [
        (c.messages or [{"role": "assistant", "content": c.text}]) if conversational else c.text
        for c in rollout.completions
    ]


def reward_columns(rollout: Rollout) -> dict[str, list[Any]]:
    """Keyword columns for reward functions, each (N,): the dataset's extra columns, then per-completion extras."""
    batch, completions = rollout.prompts, rollout.completions
    return {
        **{name: [values[b] for b in rollout.row_prompt] for name, values in batch.columns.items()},
        **{
            name: [c.reward_kwargs.get(name) for c in completions]
            for name in {k for c in completions for k in c.reward_kwargs}
        },
    }


def generate_for(backend: GenerationBackend, prompts: PromptBatch, params: SamplingParams) -> list[Completion]:
    """Ask the backend for each prompt's num_samples completions; return them in row order.

    Prompts on a process usually all need G samples; a group cut by a process boundary needs fewer
    (protocol.sample_groups sends one call per distinct count). A backend that only the main process
    may use (`main_process_only`: a server) samples whole groups there for every process.
    """
    if getattr(backend, "main_process_only", False):
        return generate_on_main_process(backend, prompts, params)
    per_prompt = sample_groups(backend, prompts.prompt_ids, prompts.num_samples, params, prompts.multimodal)
    return [replace(c, prompt_index=b) for b, completions in enumerate(per_prompt) for c in completions]


def generate_on_main_process(
    backend: GenerationBackend, prompts: PromptBatch, params: SamplingParams
) -> list[Completion]:
    """This process's completions (row order of `prompts`), sampled as whole groups by the main process for everyone.

    An exception there is raised on every process (run_on_main), so no process waits in a collective for ever.
    """
    layout = layout_of(prompts)
    # the main process needs every group's prompt, and its processor outputs where it has images (a server is sent
    # those, not the images themselves, which stay behind): one gather
    outputs = [None if m is None else replace(m, images=[]) for m in prompts.multimodal or [None] * len(prompts)]
    entries = list(zip(prompts.prompt_ids, outputs))
    groups = layout.join(gather_objects(entries))
    group_prompts = [ids for ids, _ in groups]
    group_images = [images for _, images in groups] if any(images is not None for _, images in groups) else None
    shares = run_on_main(lambda: sample_for_processes(backend, layout, group_prompts, params, group_images))
    return [replace(c, prompt_index=b) for c, b in zip(shares[layout.process_index], prompts.row_index())]


def logged_images(rollout: Rollout, tools_may_return_images: bool = False) -> Optional[list[list[Any]]]:
    """(n,) each row's images, its prompt's then those its tools returned, where the data has an image column or
    the tools may return images, else None. Decided by the columns and the setup, the same on every process, and not
    by whether this process's rows have images: logging gathers them, and a process that skipped the gather would
    leave the others waiting for it."""
    batch = rollout.prompts
    if not tools_may_return_images and not any(name in batch.columns for name in IMAGE_COLUMNS):
        return None
    prompt_images = rows_images(batch.columns, rollout.row_prompt)
    return [c.images.images if c.images is not None else p for c, p in zip(rollout.completions, prompt_images)]
