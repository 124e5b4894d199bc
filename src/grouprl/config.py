"""GRPOConfig: a ``transformers.TrainingArguments`` with TRL 1.16's GRPO fields.

Same names, same meanings, same defaults as ``trl.GRPOConfig`` (including TRL's overrides of the
TrainingArguments defaults: learning_rate=1e-6, logging_steps=10, gradient_checkpointing=True,
bf16=True unless fp16, remove_unused_columns=False), so ``HfArgumentParser``, TRL's ``TrlParser``,
YAML files and ``to_dict()`` / ``to_json_string()`` work as with TRL's.

Nothing is silently ignored: an inherited field grouprl does not honour is refused by name when set
(``training_arguments.py``), and a GRPO field whose feature is not built yet raises
NotImplementedError when set (``NOT_YET_BUILT``). As TRL, ``generation_batch_size`` and
``steps_per_generation`` are resolved for this launch's process count; ``BatchPlan`` holds every
derived size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import torch
from transformers import TrainingArguments

from .algorithms.advantages import ADVANTAGE_ESTIMATORS
from .algorithms.losses import LOSSES
from .training_arguments import refused_settings

SCALE_REWARDS = ("group", "batch", "none")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
EVAL_STRATEGIES = ("no", "steps", "epoch")
DICT_FIELDS = (
    "model_init_kwargs",
    "generation_kwargs",
    "chat_template_kwargs",
    "lr_scheduler_kwargs",
    "gradient_checkpointing_kwargs",
    "transformers_continuous_batching_config",
    "loss_kwargs",
)

# field -> (the value that means "off", what the feature is). Setting any other value raises
# NotImplementedError until the feature lands; the entry is then removed.
NOT_YET_BUILT: dict[str, tuple[Any, str]] = {
    "use_transformers_continuous_batching": (False, "transformers continuous batching"),
    "use_transformers_paged": (False, "transformers continuous batching"),
    "log_completions_hub_repo": (None, "pushing completion logs to the Hub"),
    "ds3_gather_for_generation": (True, "generation without gathering ZeRO-3 weights"),
    # TRL pads for AWS Neuron's fixed shapes ('auto' = 128 there, no padding elsewhere); grouprl trims every micro-batch to
    # its longest prompt and completion instead, and does not target Neuron.
    "pad_to_multiple_of": (None, "padding the training batch's sequence lengths to a multiple (grouprl trims each micro-batch "
                                 "to its longest row)"),
}


def _meta(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


@dataclass
class GRPOConfig(TrainingArguments):
    """Configuration of a GRPO run: ``transformers.TrainingArguments`` plus TRL 1.16's GRPO fields.

    Field names, meanings and defaults follow TRL 1.16 (its overrides of TrainingArguments included).
    What grouprl does with each inherited TrainingArguments field is in ``grouprl.training_arguments``
    and docs/trl-compat.md: honoured, accepted without effect, or refused by name when set.
    """

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [f for f in DICT_FIELDS if f not in TrainingArguments._VALID_DICT_FIELDS]

    # ---- TrainingArguments fields whose defaults TRL changes ----
    learning_rate: float = field(default=1e-6, metadata=_meta("Peak learning rate (TRL's GRPO default: 1e-6)."))
    logging_steps: float = field(default=10, metadata=_meta("Log every N optimizer steps (a float < 1 is a fraction of the total)."))
    gradient_checkpointing: bool = field(default=True, metadata=_meta("Recompute activations in backward to save memory (TRL's default: True)."))
    bf16: Optional[bool] = field(default=None, metadata=_meta("bf16 mixed precision (default: True unless fp16; declined on CPUs without native bf16)."))
    remove_unused_columns: Optional[bool] = field(default=False, metadata=_meta("If True, drop dataset columns other than prompt/image/images before they reach reward functions."))
    lr_scheduler_kwargs: Optional[Union[dict, str]] = field(default=None, metadata=_meta("Extra scheduler kwargs (JSON on the CLI)."))
    # transformers < 5 fields that scripts still pass (absent from TrainingArguments 5.x).
    logging_dir: Optional[str] = field(default=None, metadata=_meta("Tracker log directory (tensorboard). Default: output_dir/runs."))
    warmup_ratio: Optional[float] = field(default=None, metadata=_meta("Warmup as a fraction of total steps (older TrainingArguments name; sets warmup_steps)."))

    # ---- model / reference model (TRL §1.1) ----
    model_init_kwargs: Optional[Union[dict, str]] = field(default=None, metadata=_meta("kwargs for from_pretrained when model is a string (JSON on the CLI)."))
    trust_remote_code: bool = field(default=False, metadata=_meta("Allow custom code from model repositories."))
    router_aux_loss_coef: Optional[float] = field(default=None, metadata=_meta("MoE load-balancing loss weight."))
    disable_dropout: bool = field(default=False, metadata=_meta("Turn off dropout in the policy."))
    cast_lm_head_to_fp32: bool = field(default=False, metadata=_meta("Run the LM head in fp32."))
    beta: float = field(default=0.0, metadata=_meta("KL coefficient; 0 means no reference model."))
    sync_ref_model: bool = field(default=False, metadata=_meta("Periodically mix the policy into the reference model."))
    ref_model_mixup_alpha: float = field(default=0.6, metadata=_meta("alpha in ref = alpha*policy + (1-alpha)*ref."))
    ref_model_sync_steps: int = field(default=512, metadata=_meta("Mix every N optimizer steps."))

    # ---- data (TRL §1.2) ----
    num_generations: int = field(default=8, metadata=_meta("G: completions sampled per prompt (>= 2)."))
    num_generations_eval: Optional[int] = field(default=None, metadata=_meta("G used in evaluation (default: num_generations)."))
    max_completion_length: int = field(default=512, metadata=_meta("Maximum new tokens per completion."))
    ds3_gather_for_generation: bool = field(default=True, metadata=_meta("Gather ZeRO-3 weights for generation."))
    shuffle_dataset: bool = field(default=True, metadata=_meta("Shuffle the prompts (seeded by data_seed)."))
    pad_to_multiple_of: Optional[str] = field(default="auto", metadata=_meta("'auto' or 'none': no padding (TRL pads only on AWS Neuron). An integer N (pad to a multiple of N) is refused: not built."))

    # ---- generation (TRL §1.3) ----
    generation_batch_size: Optional[int] = field(default=None, metadata=_meta("Completions generated at once across all processes."))
    steps_per_generation: Optional[int] = field(default=None, metadata=_meta("Micro-batches served by one generation (default: gradient_accumulation_steps)."))
    temperature: float = field(default=1.0, metadata=_meta("Sampling temperature; training logprobs use the same temperature."))
    top_p: float = field(default=1.0, metadata=_meta("Nucleus sampling threshold."))
    top_k: int = field(default=0, metadata=_meta("Top-k sampling (0 disables)."))
    min_p: Optional[float] = field(default=None, metadata=_meta("Min-p sampling."))
    repetition_penalty: float = field(default=1.0, metadata=_meta("Repetition penalty (1.0 disables)."))
    generation_kwargs: Optional[Union[dict, str]] = field(default=None, metadata=_meta("Extra generation kwargs; override the ones above (JSON on the CLI)."))
    chat_template_kwargs: Optional[Union[dict, str]] = field(default=None, metadata=_meta("Extra apply_chat_template kwargs (JSON on the CLI)."))
    cache_implementation: Optional[str] = field(default=None, metadata=_meta("transformers generate cache implementation."))
    use_transformers_continuous_batching: bool = field(default=False, metadata=_meta("Use transformers continuous batching."))
    transformers_continuous_batching_config: Optional[Union[dict, str]] = field(default=None, metadata=_meta("Continuous batching config."))
    use_transformers_paged: bool = field(default=False, metadata=_meta("Deprecated alias of use_transformers_continuous_batching."))
    generation_engine: str = field(default="auto", metadata=_meta("grouprl: 'engine' (fast in-process sampler: one prefill per prompt, finished rows leave the batch), 'transformers' (model.generate), 'auto' (on a CPU: the engine when the model and options allow it; on a GPU or other accelerator: transformers generate, as the engine is measured on CPUs only; use_vllm=True picks vLLM), or 'server' (a `grouprl serve` server at vllm_server_base_url / vllm_server_host:vllm_server_port)."))
    generation_server_retries: int = field(default=3, metadata=_meta("grouprl: retries of a failed request to a generation server (connection error, timeout, 502/503/504), with backoff; each attempt waits up to vllm_server_timeout seconds."))
    generation_server_weight_transfer: str = field(default="http", metadata=_meta("grouprl: how weights reach a grouprl server after each optimizer step: 'http' (safetensors over HTTP) or 'broadcast' (torch.distributed broadcast over a group of the trainer's main process and the server, on vllm_group_port: gloo on CPU, NCCL on GPU)."))

    # ---- vLLM (TRL §1.4) ----
    use_vllm: bool = field(default=False, metadata=_meta("Generate with vLLM."))
    vllm_mode: str = field(default="colocate", metadata=_meta("colocate or server."))
    vllm_model_impl: str = field(default="vllm", metadata=_meta("vllm or transformers."))
    vllm_enable_sleep_mode: bool = field(default=False, metadata=_meta("Colocate: sleep between generations."))
    vllm_structured_outputs_regex: Optional[str] = field(default=None, metadata=_meta("Regex-constrained decoding."))
    vllm_server_base_url: Optional[str] = field(default=None, metadata=_meta("Server URL (overrides host/port)."))
    vllm_server_host: str = field(default="0.0.0.0", metadata=_meta("Server host."))
    vllm_server_port: int = field(default=8000, metadata=_meta("Server port."))
    vllm_server_timeout: float = field(default=240.0, metadata=_meta("Seconds to wait for the server at start-up, and for each request."))
    vllm_group_port: int = field(default=51216, metadata=_meta("Weight-update rendezvous port."))
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_meta("Colocate: vLLM memory fraction."))
    vllm_max_model_length: Optional[int] = field(default=None, metadata=_meta("Colocate: context length."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_meta("Colocate: tensor parallel size."))
    vllm_importance_sampling_correction: bool = field(default=True, metadata=_meta("Correct sampler/trainer logprob mismatch."))
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata=_meta("token_truncate, token_mask, sequence_truncate or sequence_mask."))
    vllm_importance_sampling_clip_max: float = field(default=3.0, metadata=_meta("Upper IS bound."))
    vllm_importance_sampling_clip_min: Optional[float] = field(default=None, metadata=_meta("Lower IS bound."))
    vllm_importance_sampling_cap: Optional[float] = field(default=None, metadata=_meta("Deprecated alias of vllm_importance_sampling_clip_max."))

    # ---- loss (TRL §1.5) ----
    num_iterations: int = field(default=1, metadata=_meta("mu: optimization passes over each generation batch."))
    epsilon: float = field(default=0.2, metadata=_meta("Lower clip range: ratio >= 1 - epsilon."))
    epsilon_high: Optional[float] = field(default=None, metadata=_meta("Upper clip range (default: epsilon); DAPO suggests 0.28."))
    delta: Optional[float] = field(default=None, metadata=_meta("Two-sided clipping cap on the unclipped ratio."))
    loss_type: str = field(default="dapo", metadata=_meta("grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo."))
    importance_sampling_level: str = field(default="token", metadata=_meta("token or sequence (GSPO)."))
    sapo_temperature_pos: float = field(default=1.0, metadata=_meta("SAPO gate temperature for positive advantages."))
    sapo_temperature_neg: float = field(default=1.05, metadata=_meta("SAPO gate temperature for non-positive advantages."))
    vespo_k_pos: float = field(default=2.0, metadata=_meta("VESPO k for A >= 0."))
    vespo_lambda_pos: float = field(default=3.0, metadata=_meta("VESPO lambda for A >= 0."))
    vespo_k_neg: float = field(default=3.0, metadata=_meta("VESPO k for A < 0."))
    vespo_lambda_neg: float = field(default=2.0, metadata=_meta("VESPO lambda for A < 0."))
    reward_weights: Optional[list[float]] = field(default=None, metadata=_meta("One weight per reward function (default: all 1)."))
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata=_meta("sum_then_normalize or normalize_then_sum (GDPO)."))
    scale_rewards: str = field(default="group", metadata=_meta("group (or true), batch, none (or false)."))
    mask_truncated_completions: bool = field(default=False, metadata=_meta("Exclude completions that hit max_completion_length from the loss."))
    top_entropy_quantile: float = field(default=1.0, metadata=_meta("Train only on the top-rho highest-entropy tokens."))
    entropy_coef: float = field(default=0.0, metadata=_meta("Entropy bonus coefficient."))
    use_adaptive_entropy: bool = field(default=False, metadata=_meta("Adaptive entropy controller."))
    entropy_coef_min: float = field(default=0.0, metadata=_meta("Controller lower bound."))
    entropy_coef_max: float = field(default=1.0, metadata=_meta("Controller upper bound."))
    entropy_coef_delta: float = field(default=0.005, metadata=_meta("Controller step."))
    entropy_target: float = field(default=0.2, metadata=_meta("Controller target entropy (nats)."))
    off_policy_mask_threshold: Optional[float] = field(default=None, metadata=_meta("Drop negative-advantage sequences that drifted more than this."))
    use_bias_correction_kl: bool = field(default=True, metadata=_meta("Multiply the per-token KL by the importance ratio."))

    # ---- logging (TRL §1.6) ----
    log_completions: bool = field(default=False, metadata=_meta("Log a table of completions."))
    log_multimodal: bool = field(default=True, metadata=_meta("Include images in completion logs."))
    num_completions_to_print: Optional[int] = field(default=None, metadata=_meta("Rows of the completion table to print."))
    log_unique_prompts: bool = field(default=False, metadata=_meta("Deduplicate prompts in tracker tables."))
    log_completions_hub_repo: Optional[str] = field(default=None, metadata=_meta("Hub dataset repo for completion logs."))

    # ---- tools (TRL §1.7) ----
    max_tool_calling_iterations: Optional[int] = field(default=None, metadata=_meta("Maximum tool-calling rounds per rollout (None = until the model stops calling tools or max_completion_length is used up)."))

    # ---- grouprl extensions (not in TRL) ----
    loss_kwargs: Optional[Union[dict, str]] = field(default=None, metadata=_meta(
        "Hyper-parameters of the loss_type's own objective (a loss added with grouprl.register_loss(..., params=...)); JSON on the CLI."))
    advantage_estimator: str = field(default="grpo", metadata=_meta(
        "How rewards become advantages: 'grpo' (group-relative, scale_rewards / multi_objective_aggregation) or a name added with "
        "grouprl.register_advantage."))
    dynamic_sampling: bool = field(default=False, metadata=_meta(
        "DAPO dynamic sampling: drop groups whose rewards all tie and refill the generation batch from further generations."))
    max_dynamic_sampling_rounds: int = field(default=4, metadata=_meta(
        "With dynamic_sampling: at most this many extra generations per batch; if the batch is still not full, train on the groups found."))
    # Derived, but a field so that dataclasses.replace / to_dict round trips keep it (replace passes the resolved bf16).
    bf16_from_default: Optional[bool] = field(default=None, repr=False, metadata=_meta(
        "Set by the config, not meant to be passed: True when bf16 was left at TRL's default, which grouprl declines on a CPU "
        "without bf16 units (fp32 instead); an explicit bf16=True is kept."))

    def __new__(cls, *args: Any, **kwargs: Any) -> "GRPOConfig":
        # Runs before the dataclass __init__, so a misspelt field gets a "did you mean" instead of
        # Python's bare "unexpected keyword argument" (the HF course writes num_generation=...).
        unknown = set(kwargs) - {f.name for f in fields(cls) if f.init}
        if unknown:
            raise TypeError(unknown_field_message(cls, sorted(unknown)[0]))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        # TRL's default; the trainer may decline it on CPUs without bf16 units. A copy (dataclasses.replace, a to_dict round
        # trip) passes the resolved bf16 with the original's flag, which holds while bf16 still has the default's value.
        if self.bf16 is None:
            self.bf16_from_default = True
        else:
            self.bf16_from_default = bool(self.bf16_from_default) and self.bf16 == (not self.fp16)
        if self.bf16 is None:
            self.bf16 = not self.fp16
        if self.report_to is None:
            self.report_to = "none"
        if isinstance(self.report_to, str) and "," in self.report_to:  # the CLI's comma-separated form
            self.report_to = [t.strip() for t in self.report_to.split(",") if t.strip()]
        for name in DICT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as err:
                    raise ValueError(f"GRPOConfig.{name} must be a dict or a JSON object string, got {value!r}: {err}") from None
        refused = refused_settings(self)  # on the values as given, before transformers derives others from them
        if refused:
            raise ValueError("\n".join(refused))
        for old, new in (("gradient_checkpointing", "activation_checkpointing"), ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if getattr(self, new, "absent") is None:  # TRL's name stays the primary one: no deprecation warning for its default
                setattr(self, new, getattr(self, old))
        super().__post_init__()
        if self.report_to == ["none"]:
            self.report_to = []
        self.scale_rewards = _normalize_scale_rewards(self.scale_rewards)
        self.pad_to_multiple_of = _normalize_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.warmup_ratio is not None:
            self.warmup_steps = self.warmup_ratio
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        self.validate()
        # TRL resolves the generation batch here, for the process count of this launch; what the user
        # set is kept so that plan_batches can derive it again for any process count.
        self.batch_spec = (self.generation_batch_size, self.steps_per_generation)
        # accelerate's launcher sets WORLD_SIZE; on CPUs transformers' own count says 1 unless use_cpu=True.
        plan = plan_batches(self, max(self.world_size, int(os.environ.get("WORLD_SIZE", "1"))))
        self.generation_batch_size, self.steps_per_generation = plan.completions_per_generation, plan.steps_per_generation

    def _validate_args(self) -> None:
        # transformers refuses bf16 without a bf16-capable accelerator unless use_cpu=True. grouprl trains
        # on the CPU when there is no accelerator and decides there whether bf16 pays (trainer._make_accelerator).
        wanted = self.bf16
        if wanted and not self.use_cpu and no_accelerator():
            self.bf16 = False
        try:
            super()._validate_args()
        finally:
            self.bf16 = wanted

    def validate(self) -> None:
        """Check every field that can be checked without knowing the model or the process count."""
        if self.loss_type not in LOSSES:
            raise ValueError(f"GRPOConfig.loss_type={self.loss_type!r} is not one of {', '.join(map(repr, LOSSES))}; "
                             "add your own with grouprl.register_loss(name, objective, aggregate) before building the config.")
        unknown = sorted(set(self.loss_kwargs or {}) - set(LOSSES[self.loss_type].params))
        if unknown:
            raise ValueError(f"GRPOConfig.loss_kwargs: loss_type={self.loss_type!r} has no hyper-parameter {unknown[0]!r}; its "
                             f"hyper-parameters are {sorted(LOSSES[self.loss_type].params) or 'none'} (register_loss(..., params=...)).")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"GRPOConfig.advantage_estimator={self.advantage_estimator!r} is not one of "
                             f"{', '.join(map(repr, ADVANTAGE_ESTIMATORS))}; add your own with grouprl.register_advantage(name, fn).")
        _check_choice("importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))
        _check_choice("multi_objective_aggregation", self.multi_objective_aggregation, ("sum_then_normalize", "normalize_then_sum"))
        _check_choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        _check_choice("eval_strategy", self.eval_strategy, EVAL_STRATEGIES)
        _check_choice("vllm_mode", self.vllm_mode, ("colocate", "server"))
        _check_choice("generation_engine", self.generation_engine, ("auto", "engine", "transformers", "server"))
        _check_choice("generation_server_weight_transfer", self.generation_server_weight_transfer, ("http", "broadcast"))
        if self.generation_server_retries < 0 or self.vllm_server_timeout <= 0:
            raise ValueError("GRPOConfig: generation_server_retries must be >= 0 and vllm_server_timeout > 0 (seconds).")
        _check_choice(
            "vllm_importance_sampling_mode",
            self.vllm_importance_sampling_mode,
            ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
        )
        if self.num_generations < 2:
            raise ValueError(
                f"GRPOConfig.num_generations={self.num_generations}: GRPO needs at least 2 completions per prompt "
                "to compare them (advantages are relative to the group). Use num_generations >= 2, e.g. 8."
            )
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "num_iterations", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(f"GRPOConfig.max_tool_calling_iterations={self.max_tool_calling_iterations} must be >= 0 (None = no limit).")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ValueError(f"GRPOConfig.steps_per_generation={self.steps_per_generation} must be >= 1.")
        if self.temperature <= 0:
            raise ValueError(f"GRPOConfig.temperature={self.temperature} must be > 0 (training logprobs are divided by it).")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"GRPOConfig.top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0:
            raise ValueError(f"GRPOConfig.top_k={self.top_k} must be >= 0 (0 disables top-k).")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError("GRPOConfig.epsilon and epsilon_high must be >= 0.")
        if self.num_train_epochs <= 0 and self.max_steps <= 0:
            raise ValueError("GRPOConfig: set num_train_epochs > 0 or max_steps > 0; as given, training would run 0 steps.")
        if self.bf16 and self.fp16:
            raise ValueError("GRPOConfig: bf16 and fp16 are both True; pick one mixed-precision mode.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"GRPOConfig.save_total_limit={self.save_total_limit} must be >= 1 or None.")
        if self.logging_steps <= 0:
            raise ValueError(f"GRPOConfig.logging_steps={self.logging_steps} must be > 0.")
        if self.save_strategy == "steps" and self.save_steps <= 0:
            raise ValueError(f"GRPOConfig.save_steps={self.save_steps} must be > 0 with save_strategy='steps'.")
        if self.log_completions_hub_repo is not None and not self.log_completions:
            raise ValueError("GRPOConfig.log_completions_hub_repo requires log_completions=True.")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"GRPOConfig: vllm_importance_sampling_clip_min ({lo}) must be < vllm_importance_sampling_clip_max ({hi}).")
        if self.vllm_importance_sampling_mode.endswith("truncate") and lo is None and hi is None:
            raise ValueError(
                f"GRPOConfig.vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} clips the importance weights: "
                "set vllm_importance_sampling_clip_min and/or vllm_importance_sampling_clip_max."
            )
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"GRPOConfig.top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1 keeps every token).")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"GRPOConfig.entropy_coef_min ({self.entropy_coef_min}) must be <= entropy_coef_max ({self.entropy_coef_max}).")
        if self.sapo_temperature_pos <= 0 or self.sapo_temperature_neg <= 0:
            raise ValueError("GRPOConfig.sapo_temperature_pos and sapo_temperature_neg must be > 0.")
        if self.delta is not None and self.delta <= 0:
            raise ValueError(f"GRPOConfig.delta={self.delta} must be > 0 (it caps the ratio; suggested > 1 + epsilon).")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise ValueError(f"GRPOConfig.off_policy_mask_threshold={self.off_policy_mask_threshold} must be >= 0.")
        if self.sync_ref_model and self.beta == 0.0:
            raise ValueError(
                "GRPOConfig.sync_ref_model=True needs a reference model, but beta=0.0 means none is used. Set beta > 0 (e.g. 0.04) "
                "or sync_ref_model=False."
            )
        if self.ref_model_sync_steps < 1 or not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError("GRPOConfig: ref_model_sync_steps must be >= 1 and ref_model_mixup_alpha in [0, 1].")
        if self.max_dynamic_sampling_rounds < 0:
            raise ValueError(f"GRPOConfig.max_dynamic_sampling_rounds={self.max_dynamic_sampling_rounds} must be >= 0.")
        if self.reward_weights is not None and not all(isinstance(w, (int, float)) for w in self.reward_weights):
            raise ValueError(f"GRPOConfig.reward_weights must be a list of numbers, got {self.reward_weights!r}.")
        if self.accelerator_config is not None and getattr(self.accelerator_config, "split_batches", False):
            raise ValueError("GRPOConfig.accelerator_config.split_batches=True would split each process's batch across processes and "
                             "break num_generations groups; leave split_batches=False and set per_device_train_batch_size instead.")
        for name, (off_value, feature) in NOT_YET_BUILT.items():
            if getattr(self, name) != off_value:
                raise NotImplementedError(
                    f"GRPOConfig.{name}={getattr(self, name)!r}: {feature} is not available in this version of grouprl yet. "
                    f"Leave {name} at its default ({self.__dataclass_fields__[name].default!r})."
                )

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def entropy_bonus_enabled(self) -> bool:
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    def dubious_combinations(self) -> list[str]:
        """Warnings for settings that run but probably do not do what was meant (TRL's, plus a few)."""
        found = []
        sequence = self.importance_sampling_level == "sequence"
        if self.loss_type == "luspo" and not sequence:
            found.append("loss_type='luspo' is meant for importance_sampling_level='sequence'; with 'token' each token's loss "
                         "is multiplied by its sequence length.")
        if self.loss_type == "vespo" and sequence:
            found.append("loss_type='vespo' computes its own sequence-level weight from token log-ratios; "
                         "importance_sampling_level='sequence' only changes the logged ratios. Use 'token'.")
        if sequence and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            found.append(f"importance_sampling_level='sequence' with loss_type={self.loss_type!r}: this loss sums per-token terms, "
                         "which weights each sequence by its completion length instead of optimising the per-sequence objective. "
                         "GSPO uses loss_type='grpo'.")
        if self.loss_type == "cispo" and self.epsilon_high is None:
            found.append(f"loss_type='cispo' caps the importance weight at epsilon_high (an absolute value), which is unset and "
                         f"falls back to epsilon={self.epsilon}, so every weight is capped below 1. MiniMax-M1 suggests epsilon_high=5.0.")
        if self.delta is not None and self.delta <= 1.0 + self.effective_epsilon_high:
            found.append(f"delta={self.delta} is not above 1 + epsilon_high ({1.0 + self.effective_epsilon_high}): it caps ratios "
                         "inside the trust region too. INTELLECT-2 suggests a delta above 1 + epsilon_high.")
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            found.append(f"entropy_coef={self.entropy_coef} is outside [entropy_coef_min, entropy_coef_max]; the adaptive "
                         "controller will move it back inside.")
        return found


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"GRPOConfig.{name}={getattr(value, 'value', value)!r} is not one of {', '.join(map(repr, choices))}.")


def _normalize_scale_rewards(value: Any) -> str:
    aliases = {True: "group", False: "none", "true": "group", "false": "none", "True": "group", "False": "none"}
    value = aliases.get(value, value) if isinstance(value, (bool, str)) else value
    if value not in SCALE_REWARDS:
        raise ValueError(f"GRPOConfig.scale_rewards={value!r} must be one of 'group' (or True), 'batch', 'none' (or False).")
    return value


def _normalize_pad_to_multiple_of(value: Any) -> Optional[int]:
    # "auto" means 128 on AWS Neuron in TRL, which grouprl does not target: no padding.
    if value is None or (isinstance(value, str) and value.lower() in ("auto", "none", "null")):
        return None
    try:
        multiple = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"GRPOConfig.pad_to_multiple_of={value!r} must be a positive integer, 'auto' or 'none'.") from None
    if multiple < 1:
        raise ValueError(f"GRPOConfig.pad_to_multiple_of={value!r} must be a positive integer.")
    return multiple


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

    def optimizer_steps_per_epoch(self, num_prompts: int) -> int:
        generations = num_prompts // self.prompts_per_generation
        return max(1, generations * self.micro_steps_per_generation // self.gradient_accumulation_steps)

    def describe(self, num_prompts: Optional[int] = None) -> str:
        ratio = self.micro_steps_per_generation / self.gradient_accumulation_steps
        per_gen = f"{ratio:g} optimizer step(s) per generation" if ratio >= 1 else f"{1 / ratio:g} generations per optimizer step"
        lines = [
            "grouprl batch plan",
            f"  generation: {self.prompts_per_generation} prompts x {self.num_generations} completions = "
            f"{self.completions_per_generation} completions ({self.completions_per_process} per process, {self.num_processes} process(es))",
            f"  micro-batches: {self.steps_per_generation} of {self.per_device_batch_size} completions per process, "
            f"replayed {self.num_iterations}x (num_iterations)",
            f"  optimizer step: {self.gradient_accumulation_steps} micro-batch(es) = {self.completions_per_optimizer_step} completions; {per_gen}",
            f"  old logprobs: {'computed (samples are reused off-policy)' if self.old_logprobs_needed else 'not needed (on-policy)'}",
        ]
        if num_prompts is not None:
            lines.append(f"  epoch: {num_prompts} prompts -> {self.optimizer_steps_per_epoch(num_prompts)} optimizer steps")
        return "\n".join(lines)


def plan_batches(config: GRPOConfig, num_processes: int = 1) -> BatchPlan:
    """Derive the batch plan exactly as TRL does (§1.3, §2.13); reject impossible combinations."""
    per_step = config.per_device_train_batch_size * num_processes
    g = config.num_generations
    # What the user set (GRPOConfig resolves both fields for its own process count and keeps the given pair).
    generation_batch_size, steps_per_generation = getattr(config, "batch_spec", (config.generation_batch_size, config.steps_per_generation))
    if generation_batch_size is not None and steps_per_generation is not None and generation_batch_size != per_step * steps_per_generation:
        raise ValueError(
            "GRPOConfig: set either generation_batch_size or steps_per_generation, not both "
            f"(got generation_batch_size={generation_batch_size}, steps_per_generation={steps_per_generation}, which disagree for "
            f"{per_step} completions per micro-step across processes); one is derived from the other."
        )
    if generation_batch_size is not None:
        if generation_batch_size % per_step != 0:
            raise ValueError(
                f"GRPOConfig.generation_batch_size={generation_batch_size} must be divisible by "
                f"per_device_train_batch_size ({config.per_device_train_batch_size}) x processes ({num_processes}) = {per_step}. "
                f"Valid values include {', '.join(str(per_step * k) for k in range(1, 5))}."
            )
        steps_per_generation = generation_batch_size // per_step
    else:
        steps_per_generation = steps_per_generation or config.gradient_accumulation_steps
    generation_batch = per_step * steps_per_generation
    if generation_batch % g != 0:
        valid_g = [d for d in range(2, generation_batch + 1) if generation_batch % d == 0]
        fits = [b for b in range(1, 4 * g + 1) if (b * num_processes * steps_per_generation) % g == 0][:4]
        raise ValueError(
            f"The generation batch ({config.per_device_train_batch_size} per_device_train_batch_size x {num_processes} processes x "
            f"{steps_per_generation} steps_per_generation = {generation_batch} completions) must be divisible by "
            f"num_generations={g}, so that every prompt gets all its completions in the same generation. "
            f"Valid num_generations for this batch: {valid_g or 'none (increase the batch)'}; "
            f"or keep num_generations={g} and use per_device_train_batch_size in {fits}, "
            "or raise steps_per_generation / gradient_accumulation_steps."
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


def interval_due(strategy: str, step: int, every: int, steps_per_epoch: Optional[int]) -> bool:
    """TrainingArguments' IntervalStrategy at an optimizer step: "steps" every `every` steps, "epoch" at each epoch's end, "no" never."""
    if strategy == "steps":
        return step % every == 0
    if strategy == "epoch":
        return bool(steps_per_epoch) and step % steps_per_epoch == 0
    return False


def resolve_steps(value: float, total_steps: int) -> int:
    """TrainingArguments convention: a value in (0, 1) is a fraction of the total optimizer steps."""
    if 0 < value < 1:
        return max(1, math.ceil(value * total_steps))
    return int(value)


def unknown_field_message(cls: type, name: str) -> str:
    """`name` is not a field of `cls`: the message names the closest real field(s)."""
    import difflib

    candidates = [f.name for f in fields(cls) if f.init]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{cls.__name__} has no field {name!r}.{hint} Every field is listed by `grouprl train --help` and in docs/trl-compat.md."


def no_accelerator() -> bool:
    """True when torch sees no accelerator (CUDA, XPU, MPS, ...): training runs on the CPU."""
    current = getattr(torch, "accelerator", None)
    return current.current_accelerator() is None if current is not None else not torch.cuda.is_available()
