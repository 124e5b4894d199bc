"""TRL 1.16's override points on GRPOTrainer, the record of which ones a subclass replaces, and the refusal of
the TRL methods grouprl never calls.

A TRL user subclasses ``GRPOTrainer`` and overrides methods of TRL's trainer. When a run starts, the trainer
records which of these are not its own (``_recorded_overrides``, core/overrides.py); the step's stages
(train/stages.py) call those with TRL's arguments at the same points of a step and use what they return, and
run grouprl's own stages everywhere else:

    training_step(model, inputs, num_items_in_batch)        every micro-step; `inputs` = the generation batch (rows)
      _prepare_inputs(generation_batch) -> micro-batch      buffers a generation's micro-batches (eval: one batch)
        _generate_and_score_completions(inputs) -> batch    one generation batch: completions, rewards, advantages
          _generate(prompts) -> TRL's 8-tuple               (called when overridden)
          _calculate_rewards(inputs, prompts, completions, completion_ids_list) -> (N_global, F)  (when overridden)
      compute_loss(model, inputs) -> _compute_loss(model, inputs) -> loss
        _get_per_token_logps_and_entropies(...)             (called when overridden; text models)
        get_high_entropy_mask(entropies, mask, threshold)   (top_entropy_quantile < 1)
        get_off_policy_mask(advantages, logps, behaviour_logps, mask, threshold)  (off_policy_mask_threshold set)
    log(logs, start_time)                                   every log entry (training, evaluation, end of training)
    evaluate()                                              scheduled evaluations during training

``log`` is in trainer_surface.py, ``evaluate`` in trainer.py; the others are here. The loop does not call these
methods: each one here is grouprl's own stage with TRL's signature, what an override reaches through ``super()``;
from there the chain goes on through the subclass's other overrides (stages.py).

Batches are grouprl ``TrainBatch`` objects, which also answer TRL's dict keys (``batch["advantages"]``,
``batch["old_per_token_logps"] = ...``; see ``types.TRL_KEYS``). The three "when overridden" methods have
working defaults too (callable from an override through ``super()``), but grouprl's own path skips the
conversion to and from TRL's lists when nobody overrides them: grouprl's RolloutMaker (rollout/sampler.py)
samples and scores itself, and its `generate_hook` / `reward_hook` are set to the adapters here (which call an
overridden ``_generate`` / ``_calculate_rewards`` with TRL's arguments and turn the result back into grouprl's
types) only when those are overridden; the objective runs grouprl's own logprob pass directly unless
``_get_per_token_logps_and_entropies`` is overridden.

Methods of TRL's trainer (and of transformers.Trainer under it) that grouprl cannot honour are refused when a
subclass defines them (``__init_subclass__``; the list is ``UNSUPPORTED_OVERRIDES``), with the grouprl extension
point to use instead: an override is never silently skipped.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional

import torch

from grouprl.agents.custom import REQUIRED_KEYS, rollout_output
from grouprl.core.distributed import gather_rows, global_sum
from grouprl.core.entropy import high_entropy_mask
from grouprl.core.masks import off_policy_sequence_mask
from grouprl.core.overrides import OVERRIDE_POINTS, Overrides
from grouprl.core.types import Completion, PromptBatch, Rollout, TrainBatch
from grouprl.data.prompts import is_conversational
from grouprl.model.logprobs import completion_logprobs
from grouprl.model.multimodal import text_tokenizer
from grouprl.rewards.scoring import score_completions
from grouprl.rollout.sampler import completion_inputs, reward_columns
from grouprl.train import stages

if TYPE_CHECKING:
    from grouprl.core.metrics import MetricWindow
    from grouprl.rollout.sampler import RolloutMaker


class OverridePoints:
    """GRPOTrainer's TRL override points (see the module docstring). Expects ``self.run`` (training_run.TrainingRun),
    ``self.accelerator``, ``self.args``, ``self.model``, ``self.state``, ``self.eos_token_ids``,
    ``self.processing_class`` and ``self._tokenizer``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if vars(cls).get("_grouprl_surface"):  # GRPOTrainer itself: its versions are grouprl's own stages
            cls._grouprl_own = {name: getattr(cls, name) for name in OVERRIDE_POINTS}
            return
        refuse_unsupported_overrides(cls)

    def overrides(self, name: str) -> bool:
        """Whether `name` is not grouprl's own here: defined by a subclass, or patched onto the class or the
        instance."""
        surface = next(c for c in type(self).__mro__ if vars(c).get("_grouprl_surface"))  # GRPOTrainer
        own = surface.__dict__.get("_grouprl_own", {}).get(name)
        return name in vars(self) or getattr(type(self), name) is not own

    def _recorded_overrides(self) -> Overrides:
        """Which of TRL's override points this trainer replaces, bound to it (taken when train() or evaluate()
        starts, so a method patched onto the trainer after construction counts)."""
        methods = {name: getattr(self, name) for name in OVERRIDE_POINTS if self.overrides(name)}
        return Overrides(methods, owner=type(self).__name__)

    def _send_telemetry(self) -> None:
        """grouprl sends no telemetry (TRL pings the Hub from here); kept so an override that silences it runs."""

    # ---- one micro-step ------------------------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-step, as TRL: ``_prepare_inputs(inputs)`` -> ``compute_loss`` -> backward; returns the detached
        (gradient-accumulation-scaled) loss. `inputs` is this process's generation batch (``GenerationInputs``, a
        list of dataset rows), the same for every micro-step trained on that generation."""
        return stages.own_training_step(self.run, inputs)

    def _prepare_inputs(self, generation_batch: Any) -> TrainBatch:
        """Training: the next buffered micro-batch, generating (``_generate_and_score_completions``) when the buffer
        is empty; the batch is shuffled and cut into steps_per_generation micro-batches, replayed num_iterations
        times. Evaluation (model in eval mode): ``_generate_and_score_completions(generation_batch)`` itself."""
        return stages.own_prepare_inputs(self.run, generation_batch)

    def _generate_and_score_completions(self, inputs: Any) -> TrainBatch:
        """One generation batch made ready to train on: completions for `inputs` (each row a completion to sample),
        rewards, advantages, and (training) the old / reference logprobs and sampler weights it needs. Returns a
        ``TrainBatch`` (TRL's dict keys work on it)."""
        return stages.own_generate_and_score(self.run, inputs)

    def compute_loss(
        self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The loss of a micro-batch (``_compute_loss``); as TRL, outputs cannot be returned."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        return stages.own_compute_loss(self.run, model, inputs)

    def _compute_loss(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """Training: the GRPO loss of the micro-batch, scaled for gradient accumulation, metrics logged. Evaluation:
        the policy loss at ratio 1, without KL."""
        return stages.own_policy_loss(self.run, inputs)

    # ---- inside the loss: the pieces the objective (micro_step.py) asks the trainer for --------------------

    def _get_per_token_logps_and_entropies(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: Optional[int] = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(logps (B, logits_to_keep), entropies or None, MoE aux loss or None) of the last `logits_to_keep` tokens
        of `input_ids` (prompt left-padded, completion right-padded), at the training temperature. Text models
        only."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise NotImplementedError(
                f"_get_per_token_logps_and_entropies: grouprl passes images to the model its own way, not as "
                f"{', '.join(given)}; call it with text inputs only."
            )
        k = int(logits_to_keep)
        out = completion_logprobs(
            model,
            input_ids[:, :-k],
            attention_mask[:, :-k].bool(),
            input_ids[:, -k:],
            attention_mask[:, -k:].bool(),
            temperature=self.args.temperature,
            rows_per_chunk=batch_size,
            with_entropy=compute_entropy,
            entropy_grad=compute_entropy and torch.is_grad_enabled(),
            with_aux_loss=compute_aux_loss,
            pack_prompts=self.args.pack_shared_prompts,
        )
        return out.logprobs, out.entropy, out.aux_loss

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """(B, T) bool: the valid tokens whose entropy is at least the `threshold` quantile over every process
        (entropy.high_entropy_mask)."""
        return high_entropy_mask(entropies, mask, threshold, self.accelerator)

    # DeepSeek-V3.2's off-policy sequence mask with TRL's arguments, static as TRL's: (B, 1) in mask's dtype
    get_off_policy_mask = staticmethod(off_policy_sequence_mask)

    # ---- generation and rewards, and the adapters that let grouprl's sampler call them ---------------------

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


# ---- the methods of TRL's GRPOTrainer (and of transformers.Trainer under it) that grouprl never calls: a subclass
# that defines one is refused when the class is defined (OverridePoints.__init_subclass__)
_GENERATION = (
    "grouprl samples through a GenerationBackend: pass generation_backend=... (grouprl.generation.protocol), "
    "a rollout_func, or override _generate (honoured)"
)
_TOOLS = (
    "tool calls run in grouprl.agents (tools=, environment_factory=); for your own multi-turn loop pass a "
    "rollout_func or override _generate (honoured)"
)
_DATA = (
    "grouprl draws the prompts with grouprl.data.prompts.PromptSampler (shuffle_dataset, data_seed): order, "
    "filter or repeat the rows of the dataset you pass instead"
)
_EVAL = (
    "evaluation (grouprl.train.evaluation) runs through _prepare_inputs and compute_loss, which are honoured: "
    "override those, evaluate(), or use TrainerCallback.on_evaluate"
)
_CHECKPOINT = (
    "checkpoints are written and restored by grouprl.train.checkpoint (model, optimizer, scheduler, sampler "
    "position, buffered batches, RNG); add your own files from a TrainerCallback.on_save"
)
_OPTIMIZER = "pass optimizers=(optimizer, lr_scheduler) to GRPOTrainer (either may be None for the default)"
_LOOP = (
    "the loop is grouprl.train.loop.train: use TrainerCallback events, or override training_step / log / "
    "compute_loss (honoured)"
)
_LOSS = (
    "losses are grouprl.core.losses (loss_type and its settings): override _compute_loss (honoured) to change "
    "the objective"
)
_REWARD_LOGGING = (
    "reward functions' log_extra / log_metric write to grouprl's completion table and metric window: override log "
    "(honoured) to change what gets logged"
)
_PRECISION = (
    "mixed precision is accelerate's autocast (bf16 / fp16 in GRPOConfig); wrap your own code in "
    "trainer.accelerator.autocast()"
)

# Methods of TRL's GRPOTrainer / transformers.Trainer that grouprl does not call -> what to use instead.
UNSUPPORTED_OVERRIDES: dict[str, str] = {
    "_generate_single_turn": _GENERATION,
    "_move_model_to_vllm": _GENERATION,
    "_sync_fsdp_params_to_vllm": _GENERATION,
    "_tokenize_prompts": "prompts are tokenized by grouprl (chat template, chat_template_kwargs): pre-render them in "
    "the dataset or override _generate (honoured), which receives the raw prompts",
    "_tool_call_loop": _TOOLS,
    "_get_tool_suffix_ids": _TOOLS,
    "get_train_dataloader": _DATA,
    "_get_train_sampler": _DATA,
    "get_eval_dataloader": _DATA,
    "_get_eval_sampler": _DATA,
    "get_test_dataloader": _DATA,
    "_set_signature_columns_if_needed": _DATA,
    "_remove_unused_columns": _DATA,
    "prediction_step": _EVAL,
    "evaluation_loop": _EVAL,
    "prediction_loop": _EVAL,
    "_save_checkpoint": _CHECKPOINT,
    "_save_optimizer_and_scheduler": _CHECKPOINT,
    "_save_rng_state": _CHECKPOINT,
    "_load_from_checkpoint": _CHECKPOINT,
    "_load_optimizer_and_scheduler": _CHECKPOINT,
    "_load_rng_state": _CHECKPOINT,
    "_rotate_checkpoints": _CHECKPOINT,
    "create_optimizer": _OPTIMIZER,
    "create_scheduler": _OPTIMIZER,
    "create_optimizer_and_scheduler": _OPTIMIZER,
    "get_decay_parameter_names": _OPTIMIZER,
    "_inner_training_loop": _LOOP,
    "_maybe_log_save_evaluate": _LOOP,
    "optimizer_step": _LOOP,
    "floating_point_ops": "grouprl counts 6 x trained tokens x non-embedding parameters into state.total_flos",
    "get_gamma_weights": _LOSS,
    "_log_completion_extra": _REWARD_LOGGING,
    "_log_metric": _REWARD_LOGGING,
    "compute_loss_context_manager": _PRECISION,
    "autocast_smart_context_manager": _PRECISION,
    "_wrap_model": "accelerate prepares the model (DDP / FSDP / DeepSpeed from the accelerate config and GRPOConfig)",
}


def refuse_unsupported_overrides(cls: type) -> None:
    """Raise TypeError if `cls` itself defines a method grouprl never calls, naming what to use instead."""
    refused = [name for name in UNSUPPORTED_OVERRIDES if name in vars(cls)]
    if refused:
        reasons = "\n".join(f"  - {name}: {UNSUPPORTED_OVERRIDES[name]}." for name in refused)
        raise TypeError(
            f"{cls.__name__} overrides {', '.join(refused)}, which grouprl's GRPOTrainer never calls, so the "
            f"override would be silently skipped. Use instead:\n{reasons}"
        )
