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
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from transformers import TrainingArguments

# The checks and the batch plan live in their own modules; re-exported here, where the rest of grouprl imports them.
from grouprl.config.batch_plan import BatchPlan, interval_due, plan_batches, resolve_steps
from grouprl.config.checks import (
    EVAL_STRATEGIES,
    NOT_YET_BUILT,
    SAVE_STRATEGIES,
    SCALE_REWARDS,
    dubious_combinations,
    no_accelerator,
    normalize_pad_to_multiple_of,
    normalize_scale_rewards,
    unknown_field_message,
    validate_config,
)
from grouprl.config.training_arguments import refused_settings

__all__ = [
    "BatchPlan",
    "DICT_FIELDS",
    "EVAL_STRATEGIES",
    "GRPOConfig",
    "NOT_YET_BUILT",
    "SAVE_STRATEGIES",
    "SCALE_REWARDS",
    "interval_due",
    "no_accelerator",
    "plan_batches",
    "resolve_steps",
    "unknown_field_message",
]

DICT_FIELDS = (
    "model_init_kwargs",
    "generation_kwargs",
    "chat_template_kwargs",
    "lr_scheduler_kwargs",
    "gradient_checkpointing_kwargs",
    "transformers_continuous_batching_config",
    "loss_kwargs",
)


def _meta(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


@dataclass
class GRPOConfig(TrainingArguments):
    """Configuration of a GRPO run: ``transformers.TrainingArguments`` plus TRL 1.16's GRPO fields.

    Field names, meanings and defaults follow TRL 1.16 (its overrides of TrainingArguments included).
    What grouprl does with each inherited TrainingArguments field is in ``grouprl.config.training_arguments``
    and docs/trl-compat.md: honoured, accepted without effect, or refused by name when set.
    """

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        f for f in DICT_FIELDS if f not in TrainingArguments._VALID_DICT_FIELDS
    ]

    # ---- TrainingArguments fields whose defaults TRL changes ----
    learning_rate: float = field(default=1e-6, metadata=_meta("Peak learning rate (TRL's GRPO default: 1e-6)."))
    logging_steps: float = field(
        default=10, metadata=_meta("Log every N optimizer steps (a float < 1 is a fraction of the total).")
    )
    gradient_checkpointing: bool = field(
        default=True, metadata=_meta("Recompute activations in backward to save memory (TRL's default: True).")
    )
    bf16: Optional[bool] = field(
        default=None,
        metadata=_meta("bf16 mixed precision (default: True unless fp16; declined on CPUs without native bf16)."),
    )
    remove_unused_columns: Optional[bool] = field(
        default=False,
        metadata=_meta(
            "If True, drop dataset columns other than prompt/image/images before they reach reward functions."
        ),
    )
    lr_scheduler_kwargs: Optional[Union[dict, str]] = field(
        default=None, metadata=_meta("Extra scheduler kwargs (JSON on the CLI).")
    )
    # transformers < 5 fields that scripts still pass (absent from TrainingArguments 5.x).
    logging_dir: Optional[str] = field(
        default=None, metadata=_meta("Tracker log directory (tensorboard). Default: output_dir/runs.")
    )
    warmup_ratio: Optional[float] = field(
        default=None,
        metadata=_meta("Warmup as a fraction of total steps (older TrainingArguments name; sets warmup_steps)."),
    )

    # ---- model / reference model (TRL §1.1) ----
    model_init_kwargs: Optional[Union[dict, str]] = field(
        default=None, metadata=_meta("kwargs for from_pretrained when model is a string (JSON on the CLI).")
    )
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
    num_generations_eval: Optional[int] = field(
        default=None, metadata=_meta("G used in evaluation (default: num_generations).")
    )
    max_completion_length: int = field(default=512, metadata=_meta("Maximum new tokens per completion."))
    ds3_gather_for_generation: bool = field(default=True, metadata=_meta("Gather ZeRO-3 weights for generation."))
    shuffle_dataset: bool = field(default=True, metadata=_meta("Shuffle the prompts (seeded by data_seed)."))
    pad_to_multiple_of: Optional[str] = field(
        default="auto",
        metadata=_meta(
            "'auto' or 'none': no padding (TRL pads only on AWS Neuron). An integer N (pad to a multiple of N) is refused: not built."
        ),
    )

    # ---- generation (TRL §1.3) ----
    generation_batch_size: Optional[int] = field(
        default=None, metadata=_meta("Completions generated at once across all processes.")
    )
    steps_per_generation: Optional[int] = field(
        default=None, metadata=_meta("Micro-batches served by one generation (default: gradient_accumulation_steps).")
    )
    temperature: float = field(
        default=1.0, metadata=_meta("Sampling temperature; training logprobs use the same temperature.")
    )
    top_p: float = field(default=1.0, metadata=_meta("Nucleus sampling threshold."))
    top_k: int = field(default=0, metadata=_meta("Top-k sampling (0 disables)."))
    min_p: Optional[float] = field(default=None, metadata=_meta("Min-p sampling."))
    repetition_penalty: float = field(default=1.0, metadata=_meta("Repetition penalty (1.0 disables)."))
    generation_kwargs: Optional[Union[dict, str]] = field(
        default=None, metadata=_meta("Extra generation kwargs; override the ones above (JSON on the CLI).")
    )
    chat_template_kwargs: Optional[Union[dict, str]] = field(
        default=None, metadata=_meta("Extra apply_chat_template kwargs (JSON on the CLI).")
    )
    cache_implementation: Optional[str] = field(
        default=None, metadata=_meta("transformers generate cache implementation.")
    )
    use_transformers_continuous_batching: bool = field(
        default=False, metadata=_meta("Use transformers continuous batching.")
    )
    transformers_continuous_batching_config: Optional[Union[dict, str]] = field(
        default=None, metadata=_meta("Continuous batching config.")
    )
    use_transformers_paged: bool = field(
        default=False, metadata=_meta("Deprecated alias of use_transformers_continuous_batching.")
    )
    generation_engine: str = field(
        default="auto",
        metadata=_meta(
            "grouprl: 'engine' (fast in-process sampler: one prefill per prompt, finished rows leave the batch), 'transformers' (model.generate), 'auto' (on a CPU: the engine when the model and options allow it; on a GPU or other accelerator: transformers generate, as the engine is measured on CPUs only; use_vllm=True picks vLLM), or 'server' (a `grouprl serve` server at vllm_server_base_url / vllm_server_host:vllm_server_port)."
        ),
    )
    generation_server_retries: int = field(
        default=3,
        metadata=_meta(
            "grouprl: retries of a failed request to a generation server (connection error, timeout, 502/503/504), with backoff; each attempt waits up to vllm_server_timeout seconds."
        ),
    )
    generation_server_weight_transfer: str = field(
        default="http",
        metadata=_meta(
            "grouprl: how weights reach a grouprl server after each optimizer step: 'http' (safetensors over HTTP) or 'broadcast' (torch.distributed broadcast over a group of the trainer's main process and the server, on vllm_group_port: gloo on CPU, NCCL on GPU)."
        ),
    )
    pack_shared_prompts: bool = field(
        default=True,
        metadata=_meta(
            "grouprl: in the training and scoring passes, run a prompt shared by several rows once, as one packed sequence [prompt, completion_1, ..., completion_k] (same values and gradients as the per-row pass; used where it is estimated to save a tenth or more of the cost and a one-time check per model agrees). False runs every row on its own."
        ),
    )
    keep_freed_host_memory: bool = field(
        default=False,
        metadata=_meta(
            "grouprl: on CPU, let glibc keep freed blocks up to 32 MiB for reuse instead of returning them to the OS (W3's 128-token generation 5.0 -> 3.3 s). A process-wide setting made when train()/evaluate() starts and kept afterwards: glibc cannot report or restore its previous thresholds."
        ),
    )

    # ---- vLLM (TRL §1.4) ----
    use_vllm: bool = field(default=False, metadata=_meta("Generate with vLLM."))
    vllm_mode: str = field(default="colocate", metadata=_meta("colocate or server."))
    vllm_model_impl: str = field(default="vllm", metadata=_meta("vllm or transformers."))
    vllm_enable_sleep_mode: bool = field(default=False, metadata=_meta("Colocate: sleep between generations."))
    vllm_structured_outputs_regex: Optional[str] = field(default=None, metadata=_meta("Regex-constrained decoding."))
    vllm_server_base_url: Optional[str] = field(default=None, metadata=_meta("Server URL (overrides host/port)."))
    vllm_server_host: str = field(default="0.0.0.0", metadata=_meta("Server host."))
    vllm_server_port: int = field(default=8000, metadata=_meta("Server port."))
    vllm_server_timeout: float = field(
        default=240.0, metadata=_meta("Seconds to wait for the server at start-up, and for each request.")
    )
    vllm_group_port: int = field(default=51216, metadata=_meta("Weight-update rendezvous port."))
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_meta("Colocate: vLLM memory fraction."))
    vllm_max_model_length: Optional[int] = field(default=None, metadata=_meta("Colocate: context length."))
    vllm_tensor_parallel_size: int = field(default=1, metadata=_meta("Colocate: tensor parallel size."))
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata=_meta("Correct sampler/trainer logprob mismatch.")
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask", metadata=_meta("token_truncate, token_mask, sequence_truncate or sequence_mask.")
    )
    vllm_importance_sampling_clip_max: float = field(default=3.0, metadata=_meta("Upper IS bound."))
    vllm_importance_sampling_clip_min: Optional[float] = field(default=None, metadata=_meta("Lower IS bound."))
    vllm_importance_sampling_cap: Optional[float] = field(
        default=None, metadata=_meta("Deprecated alias of vllm_importance_sampling_clip_max.")
    )

    # ---- loss (TRL §1.5) ----
    num_iterations: int = field(default=1, metadata=_meta("mu: optimization passes over each generation batch."))
    epsilon: float = field(default=0.2, metadata=_meta("Lower clip range: ratio >= 1 - epsilon."))
    epsilon_high: Optional[float] = field(
        default=None, metadata=_meta("Upper clip range (default: epsilon); DAPO suggests 0.28.")
    )
    delta: Optional[float] = field(default=None, metadata=_meta("Two-sided clipping cap on the unclipped ratio."))
    loss_type: str = field(default="dapo", metadata=_meta("grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo."))
    importance_sampling_level: str = field(default="token", metadata=_meta("token or sequence (GSPO)."))
    sapo_temperature_pos: float = field(default=1.0, metadata=_meta("SAPO gate temperature for positive advantages."))
    sapo_temperature_neg: float = field(
        default=1.05, metadata=_meta("SAPO gate temperature for non-positive advantages.")
    )
    vespo_k_pos: float = field(default=2.0, metadata=_meta("VESPO k for A >= 0."))
    vespo_lambda_pos: float = field(default=3.0, metadata=_meta("VESPO lambda for A >= 0."))
    vespo_k_neg: float = field(default=3.0, metadata=_meta("VESPO k for A < 0."))
    vespo_lambda_neg: float = field(default=2.0, metadata=_meta("VESPO lambda for A < 0."))
    reward_weights: Optional[list[float]] = field(
        default=None, metadata=_meta("One weight per reward function (default: all 1).")
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize", metadata=_meta("sum_then_normalize or normalize_then_sum (GDPO).")
    )
    scale_rewards: str = field(default="group", metadata=_meta("group (or true), batch, none (or false)."))
    mask_truncated_completions: bool = field(
        default=False, metadata=_meta("Exclude completions that hit max_completion_length from the loss.")
    )
    top_entropy_quantile: float = field(
        default=1.0, metadata=_meta("Train only on the top-rho highest-entropy tokens.")
    )
    entropy_coef: float = field(default=0.0, metadata=_meta("Entropy bonus coefficient."))
    use_adaptive_entropy: bool = field(default=False, metadata=_meta("Adaptive entropy controller."))
    entropy_coef_min: float = field(default=0.0, metadata=_meta("Controller lower bound."))
    entropy_coef_max: float = field(default=1.0, metadata=_meta("Controller upper bound."))
    entropy_coef_delta: float = field(default=0.005, metadata=_meta("Controller step."))
    entropy_target: float = field(default=0.2, metadata=_meta("Controller target entropy (nats)."))
    off_policy_mask_threshold: Optional[float] = field(
        default=None, metadata=_meta("Drop negative-advantage sequences that drifted more than this.")
    )
    use_bias_correction_kl: bool = field(
        default=True, metadata=_meta("Multiply the per-token KL by the importance ratio.")
    )

    # ---- logging (TRL §1.6) ----
    log_completions: bool = field(default=False, metadata=_meta("Log a table of completions."))
    log_multimodal: bool = field(default=True, metadata=_meta("Include images in completion logs."))
    num_completions_to_print: Optional[int] = field(
        default=None, metadata=_meta("Rows of the completion table to print.")
    )
    log_unique_prompts: bool = field(default=False, metadata=_meta("Deduplicate prompts in tracker tables."))
    log_completions_hub_repo: Optional[str] = field(
        default=None, metadata=_meta("Hub dataset repo for completion logs.")
    )

    # ---- tools (TRL §1.7) ----
    max_tool_calling_iterations: Optional[int] = field(
        default=None,
        metadata=_meta(
            "Maximum tool-calling rounds per rollout (None = until the model stops calling tools or max_completion_length is used up)."
        ),
    )

    # ---- grouprl extensions (not in TRL) ----
    loss_kwargs: Optional[Union[dict, str]] = field(
        default=None,
        metadata=_meta(
            "Hyper-parameters of the loss_type's own objective (a loss added with grouprl.register_loss(..., params=...)); JSON on the CLI."
        ),
    )
    advantage_estimator: str = field(
        default="grpo",
        metadata=_meta(
            "How rewards become advantages: 'grpo' (group-relative, scale_rewards / multi_objective_aggregation) or a name added with "
            "grouprl.register_advantage."
        ),
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata=_meta(
            "DAPO dynamic sampling: drop groups whose rewards all tie and refill the generation batch from further generations."
        ),
    )
    max_dynamic_sampling_rounds: int = field(
        default=4,
        metadata=_meta(
            "With dynamic_sampling: at most this many extra generations per batch; if the batch is still not full, train on the groups found."
        ),
    )
    # Derived, but a field so that dataclasses.replace / to_dict round trips keep it (replace passes the resolved bf16).
    bf16_from_default: Optional[bool] = field(
        default=None,
        repr=False,
        metadata=_meta(
            "Set by the config, not meant to be passed: True when bf16 was left at TRL's default, which grouprl declines on a CPU "
            "without bf16 units (fp32 instead); an explicit bf16=True is kept."
        ),
    )

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
                    raise ValueError(
                        f"GRPOConfig.{name} must be a dict or a JSON object string, got {value!r}: {err}"
                    ) from None
        refused = refused_settings(self)  # on the values as given, before transformers derives others from them
        if refused:
            raise ValueError("\n".join(refused))
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if (
                getattr(self, new, "absent") is None
            ):  # TRL's name stays the primary one: no deprecation warning for its default
                setattr(self, new, getattr(self, old))
        super().__post_init__()
        if self.report_to == ["none"]:
            self.report_to = []
        self.scale_rewards = normalize_scale_rewards(self.scale_rewards)
        self.pad_to_multiple_of = normalize_pad_to_multiple_of(self.pad_to_multiple_of)
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
        self.generation_batch_size, self.steps_per_generation = (
            plan.completions_per_generation,
            plan.steps_per_generation,
        )

    def _validate_args(self) -> None:
        # transformers refuses bf16 without a bf16-capable accelerator unless use_cpu=True. grouprl trains
        # on the CPU when there is no accelerator and decides there whether bf16 pays (accelerator_setup.make_accelerator).
        wanted = self.bf16
        if wanted and not self.use_cpu and no_accelerator():
            self.bf16 = False
        try:
            super()._validate_args()
        finally:
            self.bf16 = wanted

    def validate(self) -> None:
        """Check every field that can be checked without knowing the model or the process count (config_checks.py)."""
        validate_config(self)

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def entropy_bonus_enabled(self) -> bool:
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    def dubious_combinations(self) -> list[str]:
        """Warnings for settings that run but probably do not do what was meant (TRL's, plus a few)."""
        return dubious_combinations(self)
