"""The agent hook of the rollout stage: tools, environments, or a custom rollout function.

GRPOTrainer turns its ``tools`` / ``environment_factory`` / ``rollout_func`` arguments into an
`AgentSpec` before any model is loaded (so bad tools and environments fail first), and into an
`Agent` once the tokenizer is there. `RolloutMaker` then calls ``agent.generate(backend, prompts,
sampling)`` instead of sampling single-turn completions.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from grouprl.agents.chat import check_tool_template
from grouprl.agents.custom import custom_rollouts
from grouprl.agents.environments import ENVIRONMENT_COLUMN, Environments
from grouprl.agents.multiturn import Transcript, TurnSettings, continue_with_tools, generate_rows
from grouprl.agents.tools import Tool, make_tools
from grouprl.core.types import Completion, PromptBatch, SamplingParams
from grouprl.data.prompts import PromptTokenizer, is_conversational
from grouprl.generation.protocol import GenerationBackend


@dataclass
class AgentSpec:
    """GRPOTrainer's agent arguments, validated (tool schemas built, environments probed)."""

    tools: list[Tool]  # standalone tools, offered to every rollout
    environments: Optional[Environments]
    rollout_func: Optional[Callable[..., Any]]

    @classmethod
    def from_arguments(cls, tools: Any, environment_factory: Any, rollout_func: Any) -> Optional["AgentSpec"]:
        if not tools and environment_factory is None and rollout_func is None:
            return None
        if (
            rollout_func is not None
        ):  # with tools or environment_factory it is refused by the combination table (combinations.py)
            if not callable(rollout_func):
                raise TypeError(
                    f"rollout_func must be a function (prompts, trainer) -> dict, got {type(rollout_func).__name__}."
                )
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise TypeError(f"tools must be a list of functions, got {type(tools).__name__}.")
        standalone = make_tools(list(tools or []))
        environments = Environments(environment_factory, standalone) if environment_factory is not None else None
        return cls(standalone, environments, rollout_func)

    @property
    def reward_functions(self) -> list[Callable[..., Any]]:
        """Environment-owned rewards (get_reward), each added with weight 1 after the user's reward_funcs."""
        return self.environments.reward_functions if self.environments else []

    @property
    def has_tools(self) -> bool:
        return bool(self.tools) or (self.environments is not None and any(self.environments.tools.values()))

    def build(self, tokenize: PromptTokenizer, settings: TurnSettings, trainer: Any) -> "Agent":
        if self.has_tools:
            # a processor renders the prompts with its own template: tool results are rendered with it too
            conversation = getattr(settings.processor, "chat_template", None)
            template = check_tool_template(
                settings.tokenizer,
                stop_ids=settings.stop_ids,
                chat_template_kwargs=settings.chat_template_kwargs,
                chat_template=conversation,
            )
            settings = replace(settings, tool_chat_template=template if template is not None else conversation)
        return Agent(self, tokenize, settings, trainer)


class Agent:
    """Samples multi-turn rollouts for a PromptBatch, completions in the same row order as single-turn sampling."""

    def __init__(self, spec: AgentSpec, tokenize: PromptTokenizer, settings: TurnSettings, trainer: Any):
        self.spec, self.tokenize, self.settings, self.trainer = spec, tokenize, settings, trainer
        self.has_tools = spec.has_tools

    def generate(
        self, backend: GenerationBackend, prompts: PromptBatch, params: SamplingParams, fresh_environments: bool = False
    ) -> list[Completion]:
        """Each row's rollout; `fresh_environments`: new environment instances instead of pooled ones (asynchronous
        generation scores a rollout after later ones were sampled)."""
        tokenizer = self.settings.tokenizer
        if self.spec.rollout_func is not None:
            # the trainer's rollout_func attribute, as TRL reads it (the argument, unless reassigned since)
            rollout_func = getattr(self.trainer, "rollout_func", None) or self.spec.rollout_func
            return custom_rollouts(
                rollout_func, prompts, self.trainer, tokenizer=tokenizer, stop_ids=self.settings.stop_ids
            )
        if not is_conversational(prompts.prompts[0]):
            raise ValueError(
                f"Row {prompts.dataset_indices[0]}: tools and environment_factory need conversational prompts (a list "
                "of messages), since the chat template renders the tools and their results; got a plain string."
            )
        rows = prompts.row_index()
        instances: list[Any] = []
        if self.spec.environments is None:
            toolbox = {t.name: t for t in self.spec.tools}
            images = prompts.multimodal or [None] * len(prompts)
            transcripts = [Transcript(prompts.prompt_ids[b], toolbox, self.tokenize.tools, images[b]) for b in rows]
        else:
            transcripts, instances = self.reset_environments(prompts, rows, fresh_environments)
        first = generate_rows(backend, [t.prompt_ids for t in transcripts], params, [t.images for t in transcripts])
        for transcript, completion in zip(transcripts, first):
            transcript.add_model_turn(completion, self.settings)
        if self.has_tools:
            continue_with_tools(backend, transcripts, params, self.settings)
        completions = [t.completion(b, tokenizer) for t, b in zip(transcripts, rows)]
        for completion, instance in zip(completions, instances):
            completion.reward_kwargs["environments"] = instance  # reward functions get the list `environments`
        return completions

    def reset_environments(
        self, prompts: PromptBatch, rows: list[int], fresh: bool = False
    ) -> tuple[list[Transcript], list[Any]]:
        """One environment instance per rollout, reset with its row; prompts with the
        observation and that environment's tools."""
        environments = self.spec.environments
        if environments.multi:
            if ENVIRONMENT_COLUMN not in prompts.columns:
                raise ValueError(
                    "environment_factory is a dict, so every dataset row needs an 'environment' column naming its "
                    "environment (with remove_unused_columns=True that column is dropped; keep it)."
                )
            names = [prompts.columns[ENVIRONMENT_COLUMN][b] for b in rows]
            environments.route(names, [prompts.dataset_indices[b] for b in rows])
        else:
            names = [None] * len(rows)
        instances = environments.checkout(names, fresh=fresh)
        standalone = {t.name for t in self.spec.tools}
        transcripts = []
        # a group's rollouts whose reset() said the same encode their prompt once, and so share its prefill (and, for
        # an image prompt, one set of processor outputs: the sampler then takes them as one prompt of n samples)
        encoded: dict[tuple, tuple[list[int], Any]] = {}
        for b, name, instance in zip(rows, names, instances):
            row = {k: copy.deepcopy(v[b]) for k, v in prompts.columns.items()}
            if (
                prompts.prompts_given
            ):  # a row without a prompt gets none in reset(), as in TRL: the placeholder is not its data
                row = {"prompt": copy.deepcopy(prompts.prompts[b]), **row}
            if environments.multi:
                row.pop(ENVIRONMENT_COLUMN)  # a routing field, not an input of reset()
            observation = instance.reset(**row)
            prompt = prompts.prompts[b]
            if observation is not None:
                if not isinstance(observation, str):
                    raise TypeError(
                        f"{type(instance).__name__}.reset() returned a {type(observation).__name__}; it must return a "
                        "string (appended to the prompt's last message) or None."
                    )
                prompt = prompt[:-1] + [{**prompt[-1], "content": with_observation(prompt[-1]["content"], observation)}]
            tools = environments.tools[name]
            schemas = [t.schema for t in tools] or None
            toolbox = {t.name: t if t.name in standalone else replace(t, fn=getattr(instance, t.name)) for t in tools}
            # an image prompt's messages hold their images, which the processor encodes again with the observation
            key = (b, name, observation)
            if key not in encoded:
                encoded[key] = self.tokenize.encode_messages(prompt, prompts.dataset_indices[b], tools=schemas)
            ids, images = encoded[key]
            transcripts.append(Transcript(ids, toolbox, schemas, images))
        return transcripts, instances


def with_observation(content: Any, observation: str) -> Any:
    """A message's content with reset()'s observation appended: to its text, or as a text block (image prompts)."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": observation}]
    return content + observation


def tool_call_stats(calls: torch.Tensor, failures: torch.Tensor) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per completion) and
    tools/failure_frequency (failed / calls, 0 without calls)."""
    total = float(calls.sum())
    return {
        "tools/call_frequency": total / max(len(calls), 1),
        "tools/failure_frequency": float(failures.sum()) / total if total else 0.0,
    }
