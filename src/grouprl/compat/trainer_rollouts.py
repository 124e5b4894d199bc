"""The RolloutMaker GRPOTrainer samples with: the prompt sampler, the prompt tokenizer, the agent (tools /
environments / rollout_func), the sampling settings, the completion log, and the trainer's generation and
reward override points as its hooks (trainer_generation_hooks.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from grouprl.agents import AgentSpec
from grouprl.agents.environments import EMPTY_PROMPT
from grouprl.agents.multiturn import TurnSettings
from grouprl.config.grpo_config import GRPOConfig
from grouprl.core.types import SamplingParams
from grouprl.data.multimodal_prompts import make_prompt_tokenizer
from grouprl.data.prompt_sampler import PromptSampler
from grouprl.rollout.completion_log import CompletionLog, RecentCompletions
from grouprl.rollout.sampler import RolloutMaker, RolloutSettings

if TYPE_CHECKING:
    from grouprl.compat.trainer import GRPOTrainer


def build_rollouts(
    trainer: "GRPOTrainer",
    args: GRPOConfig,
    *,
    backend: Any,
    train_dataset: Any,
    tokenizer: Any,
    agents: Optional[AgentSpec],
    environments_own_prompts: bool,
) -> RolloutMaker:
    """The sampler of prompts, the prompt tokenizer, the agent (tools / environments / rollout_func) and the
    RolloutMaker."""
    plan = trainer.plan
    if args.async_generation and trainer.overrides("_generate"):
        raise NotImplementedError(
            f"{type(trainer).__name__} overrides _generate, which async_generation=True cannot call: the worker "
            "process samples the completions. Override _generate_and_score_completions or _calculate_rewards "
            "instead, or train with async_generation=False."
        )
    sampler = PromptSampler(
        train_dataset,
        plan.prompts_per_generation,
        shuffle=args.shuffle_dataset,
        seed=args.seed if args.data_seed is None else args.data_seed,
        num_workers=args.dataloader_num_workers,
    )
    max_context = getattr(trainer.model.config.get_text_config(), "max_position_embeddings", None)
    tokenize = make_prompt_tokenizer(
        trainer.processing_class,
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
                stop_ids=set(trainer.eos_token_ids),
                max_completion_length=args.max_completion_length,
                max_tool_calling_iterations=args.max_tool_calling_iterations,
                chat_template_kwargs=args.chat_template_kwargs or {},
            ),
            trainer=trainer,
        )
        if agents
        else None
    )
    return RolloutMaker(
        accelerator=trainer.accelerator,
        backend=backend,
        sampler=sampler,
        tokenize=tokenize,
        reward_functions=trainer.reward_functions,
        reward_weights=trainer.reward_weights,
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
            default_prompt=EMPTY_PROMPT if environments_own_prompts else None,
        ),
        completion_log=CompletionLog(
            args.output_dir, args.num_completions_to_print, args.log_unique_prompts, args.log_multimodal
        )
        if args.log_completions
        else None,
        agent=agent,
        recent=RecentCompletions(plan.completions_per_generation, args.log_multimodal),
        generate_hook=trainer._generate_through_override,
        reward_hook=trainer._rewards_through_override,
    )
