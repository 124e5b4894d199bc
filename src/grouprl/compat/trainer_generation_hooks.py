"""TRL's generation and reward override points, and the adapters that let grouprl's sampler call them.

    _generate(prompts) -> TRL's 8-tuple                                           (called when overridden)
    _calculate_rewards(inputs, prompts, completions, completion_ids_list) -> (N_global, F)  (when overridden)

grouprl samples and scores through its RolloutMaker (rollout/sampler.py), whose `generate_hook` and
`reward_hook` are the adapters below: they call an overridden method with TRL's arguments and turn its
result back into grouprl's types, and return None when nobody overrides it, so grouprl's own path skips
the conversion to and from TRL's lists. The defaults of both methods work too (callable from an override
through ``super()``).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from grouprl.agents.custom import REQUIRED_KEYS, rollout_output
from grouprl.core.distributed import gather_rows, global_sum
from grouprl.core.types import Completion, PromptBatch, Rollout
from grouprl.data.prompts import is_conversational
from grouprl.model.multimodal import text_tokenizer
from grouprl.rewards.scoring import score_completions
from grouprl.rollout.sampler import completion_inputs, reward_columns

if TYPE_CHECKING:
    from grouprl.core.metrics import MetricWindow
    from grouprl.rollout.sampler import RolloutMaker


class GenerationOverridePoints:
    """Expects ``self.run`` (training_run.TrainingRun), ``self.accelerator``, ``self.state``, ``self.eos_token_ids``,
    ``self._tokenizer`` and ``self.overrides`` (trainer_hooks.OverridePoints)."""

    def _generate(self, prompts: list) -> tuple:
        """Completions for `prompts` (one entry per completion to sample, each prompt repeated consecutively for its
        completions), as TRL's tuple: (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields,
        images, tool_images). Text prompts; images are not passed through this call. With a rollout_func, as in TRL,
        its output (checked: ValueError naming missing keys) is the tuple, and nothing else is sampled."""
        if getattr(self, "rollout_func", None) is not None:
            return self._rollout_func_tuple(prompts)
        batch = _prompt_batch(self.run.rollouts, prompts)
        generated = self.run.rollouts.generate_default(batch)
        rollout = Rollout(batch, generated)
        masks = [c.tool_mask for c in generated]
        sampler = [c.sampler_logprobs for c in generated]
        extra_names = sorted({name for c in generated for name in c.reward_kwargs})
        return (
            [
                list(c.prompt_ids if c.prompt_ids is not None else batch.prompt_ids[b])
                for c, b in zip(generated, rollout.row_prompt)
            ],
            [list(c.token_ids) for c in generated],
            None
            if all(m is None for m in masks)
            else [
                [int(x) for x in (m if m is not None else [True] * len(c.token_ids))] for m, c in zip(masks, generated)
            ],
            completion_inputs(rollout),
            None if any(s is None for s in sampler) else [list(s) for s in sampler],
            {name: [c.reward_kwargs.get(name) for c in generated] for name in extra_names},
            None,
            [],
        )

    def _rollout_func_tuple(self, prompts: list) -> tuple:
        """TRL's 8-tuple from `self.rollout_func(prompts, self)`: env_mask is the tool mask, the other keys extra
        fields (reward keyword arguments); completions decoded, as messages for conversational prompts."""
        output = rollout_output(self.rollout_func, copy.deepcopy(prompts), self)
        completion_ids = [list(ids) for ids in output["completion_ids"]]
        texts = text_tokenizer(self.processing_class).batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if is_conversational(prompts[0]) else texts
        extra = {key: values for key, values in output.items() if key not in (*REQUIRED_KEYS, "env_mask")}
        prompt_ids, logprobs = [list(ids) for ids in output["prompt_ids"]], output["logprobs"]
        return prompt_ids, completion_ids, output.get("env_mask"), completions, logprobs, extra, None, []

    def _calculate_rewards(
        self, inputs: list, prompts: list, completions: list, completion_ids_list: list
    ) -> torch.Tensor:
        """(N_global, F) rewards of this process's completions, gathered from every process (NaN where a function
        returned None). `inputs`: one dataset row per completion (its extra columns become keyword arguments)."""
        maker, window = self._scoring if getattr(self, "_scoring", None) else (self.run.rollouts, self.run.window)
        names = [
            name for name in (inputs[0] if inputs else {}) if name not in ("prompt", "completion", "completion_ids")
        ]
        local = score_completions(
            maker.reward_functions,
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids_list,
            columns={name: [row.get(name) for row in inputs] for name in names},
            trainer_state=self.state,
            log_metric=window.add,
            log_extra=maker.completion_extras.__setitem__,
        )
        return gather_rows(self.accelerator, local)

    def _generate_through_override(self, prompts: PromptBatch) -> list[Completion]:
        """RolloutMaker.generate_hook (set only when _generate is overridden): its output as Completions."""
        rows = prompts.row_index()
        output = self._generate([copy.deepcopy(prompts.prompts[b]) for b in rows])
        name = f"{type(self).__name__}._generate"
        if not isinstance(output, tuple) or len(output) != 8:
            raise TypeError(
                f"{name} must return TRL's 8-tuple (prompt_ids, completion_ids, tool_mask, completions, logprobs, "
                f"extra_fields, images, tool_images), got {type(output).__name__}."
            )
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, _, _ = output
        for label, values in (
            ("prompt_ids", prompt_ids),
            ("completion_ids", completion_ids),
            ("completions", completions),
            ("tool_mask", tool_mask),
            ("logprobs", logprobs),
        ):
            if values is not None and len(values) != len(rows):
                raise ValueError(
                    f"{name}: {label} has {len(values)} entries for the {len(rows)} prompts it was given "
                    "(one per completion)."
                )
        stop_ids = set(self.eos_token_ids)
        generated = []
        for r, b in enumerate(rows):
            ids = [int(t) for t in completion_ids[r]]
            given = completions[r] if completions is not None else None  # text, or the messages reward functions get
            generated.append(
                Completion(
                    prompt_index=b,
                    token_ids=ids,
                    text=given if isinstance(given, str) else self._tokenizer.decode(ids, skip_special_tokens=True),
                    finish_reason="stop" if ids and ids[-1] in stop_ids else "length",
                    sampler_logprobs=None
                    if logprobs is None or logprobs[r] is None
                    else [float("nan") if x is None else float(x) for x in logprobs[r]],
                    tool_mask=None if tool_mask is None else [bool(x) for x in tool_mask[r]],
                    prompt_ids=[int(t) for t in prompt_ids[r]],
                    messages=given if isinstance(given, list) else None,
                    reward_kwargs={
                        key: (values[r] if isinstance(values, list) else values)
                        for key, values in (extra_fields or {}).items()
                    },
                )
            )
        return generated

    def _rewards_through_override(
        self, maker: "RolloutMaker", rollout: Rollout, window: "MetricWindow"
    ) -> torch.Tensor:
        """RolloutMaker.reward_hook (set only when _calculate_rewards is overridden): it, called with TRL's
        arguments."""
        columns = reward_columns(rollout)
        prompts = [rollout.prompts.prompts[b] for b in rollout.row_prompt]
        inputs = [
            {"prompt": prompt, **{name: values[r] for name, values in columns.items()}}
            for r, prompt in enumerate(prompts)
        ]
        maker.completion_extras = {}
        self._scoring = (maker, window)
        try:
            result = self._calculate_rewards(
                inputs, prompts, completion_inputs(rollout), [c.token_ids for c in rollout.completions]
            )
        finally:
            self._scoring = None
        expected = (int(global_sum(self.accelerator, len(rollout.completions))), len(maker.reward_functions))
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != expected:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise ValueError(
                f"{type(self).__name__}._calculate_rewards must return the rewards of every process's completions, a "
                f"tensor of shape {expected} (completions x reward functions), got {got}."
            )
        return result.detach().float().cpu()


def _prompt_batch(rollouts: "RolloutMaker", prompts: list) -> PromptBatch:
    """A PromptBatch from TRL-style per-completion prompts: consecutive equal prompts are one prompt's completions."""
    unique: list[Any] = []
    counts: list[int] = []
    for prompt in prompts:
        if unique and prompt == unique[-1]:
            counts[-1] += 1
        else:
            unique.append(prompt)
            counts.append(1)
    encoded = [rollouts.tokenize.encode_row({"prompt": prompt}, index) for index, prompt in enumerate(unique)]
    return PromptBatch(
        prompts=[e[0] for e in encoded],
        prompt_ids=[e[1] for e in encoded],
        columns={},
        dataset_indices=list(range(len(unique))),
        group_ids=list(range(len(unique))),
        num_samples=counts,
    )
