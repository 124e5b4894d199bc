"""The RolloutMaker GRPOTrainer samples with: the prompt sampler, the prompt tokenizer, the agent (tools /
environments / rollout_func), the sampling settings and the completion log."""

from __future__ import annotations

from typing import Any, Optional

from grouprl.agents import AgentSpec
from grouprl.agents.environments import EMPTY_PROMPT
from grouprl.agents.multiturn import TurnSettings
from grouprl.compat.trainer_rewards import RewardParts
from grouprl.config.grpo_config import BatchPlan, GRPOConfig
from grouprl.core.types import SamplingParams
from grouprl.data.multimodal_prompts import make_prompt_tokenizer
from grouprl.data.prompt_sampler import PromptSampler
from grouprl.rollout.completion_log import CompletionLog, RecentCompletions
from grouprl.rollout.sampler import RolloutMaker, RolloutSettings


def build_rollouts(
    args: GRPOConfig,
    plan: BatchPlan,
    *,
    accelerator: Any,
    backend: Any,
    model_config: Any,
    processing_class: Any,
    tokenizer: Any,
    eos_token_ids: list[int],
    rewards: RewardParts,
    train_dataset: Any,
    agents: Optional[AgentSpec],
    environments_own_prompts: bool,
    rollout_func_trainer: Any,
) -> RolloutMaker:
    """The sampler of prompts, the prompt tokenizer, the agent (tools / environments / rollout_func) and the
    RolloutMaker. `rollout_func_trainer` is what a rollout_func receives as its trainer argument (TRL's API)."""
    sampler = PromptSampler(
        train_dataset,
        plan.prompts_per_generation,
        shuffle=args.shuffle_dataset,
        seed=args.seed if args.data_seed is None else args.data_seed,
        num_workers=args.dataloader_num_workers,
    )
    max_context = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    tokenize = make_prompt_tokenizer(
        processing_class,
        max_context=max_context,
        max_completion_length=args.max_completion_length,
        chat_template_kwargs=args.chat_template_kwargs,
        tools=[t.schema for t in agents.tools] if agents else None,
    )
    agent = (
        agents.build(
            tokenize,
            TurnSettings(
                tokenizer=tokenizer,
                stop_ids=set(eos_token_ids),
                max_completion_length=args.max_completion_length,
                max_tool_calling_iterations=args.max_tool_calling_iterations,
                chat_template_kwargs=args.chat_template_kwargs or {},
            ),
            trainer=rollout_func_trainer,
        )
        if agents
        else None
    )
    return RolloutMaker(
        accelerator=accelerator,
        backend=backend,
        sampler=sampler,
        tokenize=tokenize,
        reward_functions=rewards.reward_functions,
        reward_weights=rewards.reward_weights,
        sampling=SamplingParams(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            extra=dict(args.generation_kwargs or {}),
        ),
        settings=RolloutSettings(
            num_generations=args.num_generations,
            scale_rewards=args.scale_rewards,
            advantage_estimator=args.advantage_estimator,
            multi_objective_aggregation=args.multi_objective_aggregation,
            mask_truncated_completions=args.mask_truncated_completions,
            remove_unused_columns=args.remove_unused_columns,
            pad_token_id=tokenizer.pad_token_id,
            pad_to_multiple_of=args.pad_to_multiple_of,
            default_prompt=EMPTY_PROMPT if environments_own_prompts else None,
        ),
        completion_log=CompletionLog(
            args.output_dir, args.num_completions_to_print, args.log_unique_prompts, args.log_multimodal
        )
        if args.log_completions
        else None,
        agent=agent,
        recent=RecentCompletions(plan.completions_per_generation, args.log_multimodal),
    )  # a TRL subclass's _generate / _calculate_rewards are set as its hooks when a run starts
