"""TRL 1.16's override points on GRPOTrainer: the loop runs through them, so a subclass's versions take effect.

A TRL user subclasses ``GRPOTrainer`` and overrides methods of TRL's trainer. grouprl calls the same
methods, with TRL's arguments, at the same points of a step, and uses what they return:

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

Batches are grouprl ``TrainBatch`` objects, which also answer TRL's dict keys (``batch["advantages"]``,
``batch["old_per_token_logps"] = ...``; see ``types.TRL_KEYS``). The three "when overridden" methods have
working defaults too (callable from an override through ``super()``), but grouprl's own path skips the
conversion to and from TRL's lists when nobody overrides them.

Methods of TRL's trainer (and of transformers.Trainer under it) that grouprl cannot honour are refused when a
subclass defines them (``__init_subclass__``), with the grouprl extension point to use instead: an override is
never silently skipped.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional

import torch

from grouprl.core.distributed import gather_rows, global_sum
from grouprl.core.masks import off_policy_mask
from grouprl.core.types import Completion, PromptBatch, Rollout, TrainBatch
from grouprl.data.generation_inputs import GenerationInputs
from grouprl.model.logprobs import completion_logprobs
from grouprl.rewards.scoring import score_completions
from grouprl.rollout import experience
from grouprl.rollout.sampler import completion_inputs, reward_columns
from grouprl.train import evaluation, loop
from grouprl.train import micro_step as objective

if TYPE_CHECKING:
    from grouprl.core.metrics import MetricWindow
    from grouprl.rollout.sampler import RolloutMaker

_GENERATION = (
    "grouprl samples through a GenerationBackend: pass generation_backend=... (grouprl.generation.protocol), "
    "a rollout_func, or override _generate (honoured)"
)
_TOOLS = (
    "tool calls run in grouprl.agents (tools=, environment_factory=); for your own multi-turn loop pass a rollout_func "
    "or override _generate (honoured)"
)
_DATA = (
    "grouprl draws the prompts with grouprl.data.prompts.PromptSampler (shuffle_dataset, data_seed): order, filter or repeat the "
    "rows of the dataset you pass instead"
)
_EVAL = (
    "evaluation (grouprl.train.evaluation) runs through _prepare_inputs and compute_loss, which are honoured: override those, "
    "evaluate(), or use TrainerCallback.on_evaluate"
)
_CHECKPOINT = (
    "checkpoints are written and restored by grouprl.train.checkpoint (model, optimizer, scheduler, sampler position, "
    "buffered batches, RNG); add your own files from a TrainerCallback.on_save"
)
_OPTIMIZER = "pass optimizers=(optimizer, lr_scheduler) to GRPOTrainer (either may be None for the default)"
_LOOP = "the loop is grouprl.train.loop.train: use TrainerCallback events, or override training_step / log / compute_loss (honoured)"
_LOSS = "losses are grouprl.core.losses (loss_type and its settings): override _compute_loss (honoured) to change the objective"
_REWARD_LOGGING = (
    "reward functions' log_extra / log_metric write to grouprl's completion table and metric window: override log "
    "(honoured) to change what gets logged"
)
_PRECISION = "mixed precision is accelerate's autocast (bf16 / fp16 in GRPOConfig); wrap your own code in trainer.accelerator.autocast()"

# Methods of TRL's GRPOTrainer / transformers.Trainer that grouprl does not call -> what to use instead.
UNSUPPORTED_OVERRIDES: dict[str, str] = {
    "_generate_single_turn": _GENERATION,
    "_move_model_to_vllm": _GENERATION,
    "_sync_fsdp_params_to_vllm": _GENERATION,
    "_tokenize_prompts": "prompts are tokenized by grouprl (chat template, chat_template_kwargs): pre-render them in the dataset or "
    "override _generate (honoured), which receives the raw prompts",
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

# Methods grouprl calls only when a subclass (or a patch) replaces them; their defaults convert to TRL's lists.
CALLED_WHEN_OVERRIDDEN = ("_generate", "_calculate_rewards", "_get_per_token_logps_and_entropies")


class OverridePoints:
    """GRPOTrainer's TRL override points (see the module docstring). Expects ``self.run`` (loop.TrainingRun),
    ``self.accelerator``, ``self.args``, ``self.model``, ``self.state``, ``self.eos_token_ids``, ``self.processing_class``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if vars(cls).get("_grouprl_surface"):  # GRPOTrainer itself: its versions are the ones the loop uses
            return
        refused = [name for name in UNSUPPORTED_OVERRIDES if name in vars(cls)]
        if refused:
            reasons = "\n".join(f"  - {name}: {UNSUPPORTED_OVERRIDES[name]}." for name in refused)
            raise TypeError(
                f"{cls.__name__} overrides {', '.join(refused)}, which grouprl's GRPOTrainer never calls, so the override would "
                f"be silently skipped. Use instead:\n{reasons}"
            )

    def overrides(self, name: str) -> bool:
        """Whether `name` is not grouprl's own here: defined by a subclass, or patched onto the class or the instance."""
        own = getattr(OverridePoints, name)
        return name in vars(self) or getattr(type(self), name) is not own

    # ---- one micro-step ----------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-step, as TRL: ``_prepare_inputs(inputs)`` -> ``compute_loss`` -> backward; returns the detached
        (gradient-accumulation-scaled) loss. `inputs` is this process's generation batch (``GenerationInputs``, a list of
        dataset rows), the same for every micro-step trained on that generation."""
        micro = self._prepare_inputs(inputs)
        return loop.train_micro_batch(self.run, micro)

    def _prepare_inputs(self, generation_batch: Any) -> TrainBatch:
        """Training: the next buffered micro-batch, generating (``_generate_and_score_completions``) when the buffer is
        empty; the batch is shuffled and cut into steps_per_generation micro-batches, replayed num_iterations times.
        Evaluation (model in eval mode): ``_generate_and_score_completions(generation_batch)`` itself."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        run = self.run
        if not run.pending:
            batch = self._generate_and_score_completions(generation_batch)
            if not isinstance(batch, TrainBatch):
                raise TypeError(
                    f"{type(self).__name__}._generate_and_score_completions must return the grouprl TrainBatch its "
                    f"super() returned (it takes TRL's keys: batch['advantages'] = ...), got {type(batch).__name__}."
                )
            run.pending.extend(
                experience.split_generation(
                    batch, run.plan, loss_type=self.args.loss_type, top_entropy_quantile=self.args.top_entropy_quantile
                )
            )
            self.state.num_input_tokens_seen = run.rollouts.tokens_seen
        return run.pending.popleft().to(self.accelerator.device)

    def _generate_and_score_completions(self, inputs: Any) -> TrainBatch:
        """One generation batch made ready to train on: completions for `inputs` (each row a completion to sample),
        rewards, advantages, and (training) the old / reference logprobs and sampler weights it needs. Returns a
        ``TrainBatch`` (TRL's dict keys work on it)."""
        if not isinstance(inputs, GenerationInputs) or inputs.prompt_batch is None:
            raise TypeError(
                f"_generate_and_score_completions needs the generation batch grouprl passed to training_step / "
                f"_prepare_inputs (a grouprl GenerationInputs), got {type(inputs).__name__}; pass it on unchanged."
            )
        run = self.run
        if not self.model.training:
            return evaluation.eval_batch(
                run.evaluation_pass, inputs, accelerator=self.accelerator, trainer_state=self.state
            )
        batch, stats = experience.score_generation(
            run.sampling(), run.model, inputs, hooks=self, reference=run.reference
        )
        run.ledger.record(stats)  # reduced with the rest of the optimizer step's statistics (loop.py)
        return batch

    def compute_loss(
        self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The loss of a micro-batch (``_compute_loss``); as TRL, outputs cannot be returned."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        return self._compute_loss(model, inputs)

    def _compute_loss(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """Training: the GRPO loss of the micro-batch, scaled for gradient accumulation, metrics logged
        (objective.micro_batch_loss). Evaluation: the policy loss at ratio 1, without KL (evaluation.eval_loss)."""
        run = self.run
        if not self.model.training:
            return evaluation.eval_loss(
                run.model,
                inputs,
                run.objective,
                evaluation_pass=run.evaluation_pass,
                hooks=self,
                accelerator=self.accelerator,
                rows_per_chunk=self.args.per_device_eval_batch_size,
            )
        controller = run.entropy_controller
        loss, stats = objective.micro_batch_loss(
            run.model,
            inputs,
            run.objective,
            hooks=self,
            device=self.accelerator.device,
            autocast=self.accelerator.autocast(),
            timer=run.timer,
            entropy_coef=controller.applied_coef() if controller is not None else None,
        )
        run.ledger.record(stats)  # reduced with the rest of the optimizer step's statistics (loop.py)
        return loss

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
        """(logps (B, logits_to_keep), entropies or None, MoE aux loss or None) of the last `logits_to_keep` tokens of
        `input_ids` (prompt left-padded, completion right-padded), at the training temperature. Text models only."""
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
        """(B, T) bool: the valid tokens (mask) whose entropy is at least the `threshold` quantile of the entropies of every
        valid token on every process (threshold = 1 - top_entropy_quantile). No valid token: all False."""
        local = entropies[mask.bool()].detach().float()
        padded = self.accelerator.pad_across_processes(
            local, dim=0, pad_index=-1.0
        )  # entropies are >= 0: -1 marks padding
        gathered = self.accelerator.gather(padded)
        gathered = gathered[gathered >= 0]
        if gathered.numel() == 0:
            return torch.zeros_like(mask, dtype=torch.bool)
        cutoff = torch.quantile(gathered, float(threshold))
        return (entropies >= cutoff) & mask.bool()

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """DeepSeek-V3.2's off-policy sequence mask, (B, 1) in mask's dtype: 1 keeps a sequence, 0 drops it (negative
        advantage and a mean log-ratio log pi_behaviour - log pi_theta over its valid tokens above the threshold; tokens
        the sampler did not score (NaN) count as 0). `advantages`: (B,) or (B, 1)."""
        if advantages.dim() == 2 and advantages.shape[1] == 1:
            advantages = advantages.squeeze(1)
        if advantages.dim() != 1:
            raise ValueError(f"get_off_policy_mask: advantages must be (B,) or (B, 1), got {tuple(advantages.shape)}.")
        keep = off_policy_mask(
            per_token_logps, sampling_per_token_logps, advantages, mask, threshold=off_policy_threshold
        )
        return keep.to(mask.dtype)

    # ---- generation and rewards -----------------------------------------------------------------

    def _generate(self, prompts: list) -> tuple:
        """Completions for `prompts` (one entry per completion to sample, each prompt repeated consecutively for its
        completions), as TRL's tuple: (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields,
        images, tool_images). Text prompts; images are not passed through this call."""
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

    def _send_telemetry(self) -> None:
        """grouprl sends no telemetry (TRL pings the Hub from here); kept so an override that silences it runs."""

    # ---- adapters between grouprl's stages and the overridden methods ----------------------------

    def _generate_through_override(self, prompts: PromptBatch) -> Optional[list[Completion]]:
        """RolloutMaker.generate_hook: an overridden _generate's output as Completions (None: not overridden)."""
        if not self.overrides("_generate"):
            return None
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
                    f"{name}: {label} has {len(values)} entries for the {len(rows)} prompts it was given (one per completion)."
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
    ) -> Optional[torch.Tensor]:
        """RolloutMaker.reward_hook: an overridden _calculate_rewards called with TRL's arguments (None: not overridden)."""
        if not self.overrides("_calculate_rewards"):
            return None
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
