"""GRPOConfig's fields, with their help texts: `GRPOFields`, what grpo_config.GRPOConfig builds on and its checks read.

Three groups, in the order of ``--help`` and docs/trl-compat.md after TrainingArguments' own fields:

- `ModelAndSamplingFields`: TRL's TrainingArguments defaults, the model, the data and the sampling;
- `LossAndLoggingFields`: TRL 1.16's loss, logging and tools fields (sections 1.5 to 1.7 of its GRPOConfig, in its
  declaration order), then the fields grouprl adds;
- `AsyncGenerationFields`: asynchronous generation (grouprl; named as TRL's ``trl.experimental.async_grpo``). With
  ``async_generation=True`` a generation worker in its own process (a local ``grouprl serve`` the trainer starts,
  or a server it is pointed at) samples the next prompt batches while the trainer trains on earlier ones; each
  sample carries the weight version that drew it, and a sample more than ``max_staleness`` versions old is
  dropped and its prompts regenerated (docs/async.md). ``compat/async_config.py`` presets them as TRL's
  ``AsyncGRPOConfig``.

Names, meanings and defaults follow TRL 1.16. What happens when a config is built (types coerced, checks, the
batch plan) is grpo_config.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from transformers import TrainingArguments

ASYNC_WORKERS = ("auto", "local", "server")


def _meta(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


@dataclass
class ModelAndSamplingFields:
    """TRL's overrides of TrainingArguments defaults, then the model, data, generation and vLLM fields."""

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
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata=_meta(
            "Under ZeRO-3 or FSDP on several processes, sample from a replica of the gathered weights (fast); False "
            "samples from the sharded model, every process in step (no process holds the whole model; slower)."
        ),
    )
    shuffle_dataset: bool = field(default=True, metadata=_meta("Shuffle the prompts (seeded by data_seed)."))
    pad_to_multiple_of: Optional[str] = field(
        default="auto",
        metadata=_meta(
            "An integer N pads the training batch's prompt and completion widths, and those of every training "
            "forward, to multiples of N (shared-prompt packing is then off; generation is not padded). 'auto' or "
            "'none': no padding (TRL pads only on AWS Neuron)."
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
        default=False,
        metadata=_meta(
            "Sample with transformers continuous batching (model.generate_batch) in place of generation_engine's "
            "sampler; refused with settings it would not apply (repetition_penalty, most generation_kwargs). It "
            "samples in the weights' dtype (transformers sizes its paged cache so): fp32 weights under bf16=True are "
            "sampled in fp32; load the model in bf16 (model_init_kwargs dtype) to sample in bf16."
        ),
    )
    transformers_continuous_batching_config: Optional[Union[dict, str]] = field(
        default=None,
        metadata=_meta(
            "transformers.generation.ContinuousBatchingConfig arguments (JSON on the CLI); without num_blocks or "
            "max_memory_percent the cache is sized for each generation's rows."
        ),
    )
    use_transformers_paged: bool = field(
        default=False,
        metadata=_meta("Deprecated (TRL): sets use_transformers_continuous_batching=True, with a FutureWarning."),
    )
    generation_engine: str = field(
        default="auto",
        metadata=_meta(
            "grouprl: 'engine' (fast in-process sampler: one prefill per prompt, finished rows leave the batch), "
            "'captured' (a static decode loop for the model families docs/install.md lists, sliding windows, "
            "mixtures of experts and Qwen3.5's linear attention included, and the text prompts of vision-language "
            "models built on them: KV buffers allocated once, sampling inside the step, replayed as one CUDA graph "
            "per step on CUDA, eager elsewhere; docs/benchmarks-gpu.md), "
            "'transformers' (model.generate), 'auto' (where the model and options allow it: on a CPU the engine, else "
            "the captured loop; on CUDA the captured loop; each measured faster there than what follows it; "
            "otherwise transformers generate; use_vllm=True picks vLLM), or 'server' (a `grouprl serve` server at "
            "vllm_server_base_url / vllm_server_host:vllm_server_port). Asynchronous generation's local worker "
            "samples with the same choice."
        ),
    )
    compile_decode_step: Optional[bool] = field(
        default=None,
        metadata=_meta(
            "grouprl: with the captured decode loop (generation_engine='captured', or 'auto' where it picks it), "
            "torch.compile its step's layer (one graph for all layers) and its sampling before the step is captured: "
            "the norms, RoPE, casts and sampling passes around the products in fewer kernels. Unset (default): on "
            "CUDA, where an H200 measured the 0.5B case's decode step at 1.67 ms against 2.29 and its GRPO step at "
            "0.86 s against 1.07 (docs/benchmarks-gpu.md), and should the compile fail the loop warns and runs the "
            "step as written; elsewhere off. True: on any device (a CPU needs a C++ compiler), a compile error stops "
            "the run. False: never. The first generation compiles (~9 s on an H200 for 24 layers), and so does each "
            "new prompt bucket, row count or sampling setting (evaluation's, say), up to 64 shapes: a run holds at "
            "most one shape per 64-token bucket of its prompts for training's rows and setting, and as many again "
            "for evaluation's. Each new shape is logged with its compile time, and generation/compile_s (seconds "
            "spent compiling in the step's generations, apart from the steps' time) and generation/compiled_graphs "
            "are logged metrics."
        ),
    )
    generation_server_retries: int = field(
        default=3,
        metadata=_meta(
            "grouprl: retries of a failed request to a generation server (connection error, timeout, 502/503/504), "
            "with backoff; each attempt waits up to vllm_server_timeout seconds."
        ),
    )
    generation_server_weight_transfer: str = field(
        default="http",
        metadata=_meta(
            "grouprl: how weights reach a grouprl server after each optimizer step: 'http' (safetensors over HTTP) or "
            "'broadcast' (torch.distributed broadcast over a group of the trainer's main process and the server, on "
            "vllm_group_port: gloo on CPU, NCCL on GPU)."
        ),
    )
    pack_shared_prompts: bool = field(
        default=True,
        metadata=_meta(
            "grouprl: in the training and scoring passes, run a prompt shared by several rows once, as one packed "
            "sequence [prompt, completion_1, ..., completion_k] (same values and gradients as the per-row pass; used "
            "where it is estimated to save a tenth or more of the cost on a CPU, half or more on a GPU, whose extra "
            "kernel launches cost more than the arithmetic saved below that, and a one-time check per model agrees). "
            "False runs every row on its own."
        ),
    )
    keep_freed_host_memory: bool = field(
        default=False,
        metadata=_meta(
            "grouprl: on CPU, let glibc keep freed blocks up to 32 MiB for reuse instead of returning them to the OS "
            "(W3's 128-token generation 5.0 -> 3.3 s). A process-wide setting made when train()/evaluate() starts and "
            "kept afterwards: glibc cannot report or restore its previous thresholds."
        ),
    )

    # ---- vLLM (TRL §1.4) ----
    use_vllm: bool = field(default=False, metadata=_meta("Generate with vLLM."))
    vllm_mode: str = field(
        default="colocate",
        metadata=_meta(
            "colocate or server. Server mode sends weights with the NCCL transfer of vLLM 0.22-0.31 (TRL 1.16's "
            "range); a newer vLLM is refused when the trainer is built (docs/scaling.md)."
        ),
    )
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
        default=True,
        metadata=_meta(
            "Correct sampler/trainer logprob mismatch: a separate sampler's, and an in-process one's where training "
            "computes below fp32 (docs/objectives.md)."
        ),
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask", metadata=_meta("token_truncate, token_mask, sequence_truncate or sequence_mask.")
    )
    vllm_importance_sampling_clip_max: float = field(default=3.0, metadata=_meta("Upper IS bound."))
    vllm_importance_sampling_clip_min: Optional[float] = field(default=None, metadata=_meta("Lower IS bound."))
    vllm_importance_sampling_cap: Optional[float] = field(
        default=None, metadata=_meta("Deprecated alias of vllm_importance_sampling_clip_max.")
    )


@dataclass
class LossAndLoggingFields:
    """The loss, logging and tool fields of TRL, then grouprl's extensions."""

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
        default=None,
        metadata=_meta(
            "Hub dataset repo (user/name) the completions/*.parquet logs are uploaded to every 2 minutes and at the "
            "end of training (needs log_completions=True; private with hub_private_repo)."
        ),
    )

    # ---- tools (TRL §1.7) ----
    max_tool_calling_iterations: Optional[int] = field(
        default=None,
        metadata=_meta(
            "Maximum tool-calling rounds per rollout (None = until the model stops calling tools or "
            "max_completion_length is used up)."
        ),
    )

    # ---- grouprl extensions (not in TRL) ----
    loss_kwargs: Optional[Union[dict, str]] = field(
        default=None,
        metadata=_meta(
            "Hyper-parameters of the loss_type's own objective (a loss added with grouprl.register_loss(..., "
            "params=...)); JSON on the CLI."
        ),
    )
    advantage_estimator: str = field(
        default="grpo",
        metadata=_meta(
            "How rewards become advantages: 'grpo' (group-relative, scale_rewards / multi_objective_aggregation) or a "
            "name added with "
            "grouprl.register_advantage."
        ),
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata=_meta(
            "DAPO dynamic sampling: drop groups whose rewards all tie and refill the generation batch from further "
            "generations."
        ),
    )
    max_dynamic_sampling_rounds: int = field(
        default=4,
        metadata=_meta(
            "With dynamic_sampling: at most this many extra generations per batch; if the batch is still not full, "
            "train on the groups found."
        ),
    )
    save_failure: str = field(
        default="stop",
        metadata=_meta(
            "grouprl: when a checkpoint cannot be written (a full disk, a read-only file system): 'stop' ends the run "
            "with the error, naming the file, the space needed and free and the last complete checkpoint; 'continue' "
            "logs that and trains on (the next checkpoint tries again). The partial files are removed either way."
        ),
    )
    reward_timeout: Optional[float] = field(
        default=None,
        metadata=_meta(
            "grouprl: seconds one call of a reward function may take; past it the run stops with the function named "
            "and the last completed step saved. None (TRL has no timeout): no limit, and a warning names a call "
            "still running after 300 s."
        ),
    )
    # Derived, but a field so that dataclasses.replace / to_dict round trips keep it (replace passes the resolved bf16).
    bf16_from_default: Optional[bool] = field(
        default=None,
        repr=False,
        metadata=_meta(
            "Set by the config, not meant to be passed: True when bf16 was left at TRL's default, which grouprl "
            "declines on a CPU "
            "without bf16 units (fp32 instead); an explicit bf16=True is kept."
        ),
    )


@dataclass
class AsyncGenerationFields:
    """Generation overlapped with training: the worker, the staleness bound, the queue and the weight syncs."""

    async_generation: bool = field(
        default=False,
        metadata=_meta(
            "grouprl: generate in a separate worker process while training (AsyncGRPOTrainer's mode): the trainer "
            "takes finished generations in prompt order from a bounded queue, samples older than max_staleness "
            "weight versions are dropped and regenerated, the sampler-mismatch correction (vllm_importance_sampling_*) "
            "weights the rest."
        ),
    )
    async_worker: str = field(
        default="auto",
        metadata=_meta(
            "grouprl, with async_generation: 'local' (start a `grouprl serve` worker from the policy's weights, "
            "stopped when training ends), 'server' (the server at vllm_server_base_url / vllm_server_host:"
            "vllm_server_port: `grouprl serve` or, with use_vllm=True, `vllm serve`), or 'auto' (a server when "
            "vllm_server_base_url, generation_engine='server' or use_vllm=True names one, else local)."
        ),
    )
    max_staleness: int = field(
        default=4,
        metadata=_meta(
            "With async_generation: the most optimizer steps a sample's weights may lag behind the weights it "
            "is trained on; older samples are dropped (counted in async/dropped_groups) and their prompts "
            "regenerated. 0 trains on samples from the current weights only."
        ),
    )
    max_inflight_tasks: int = field(
        default=-1,
        metadata=_meta(
            "With async_generation: the most completions requested from the worker and not yet finished; -1 "
            "(auto): max(max_staleness, 1) x the completions of one optimizer step."
        ),
    )
    queue_maxsize: int = field(
        default=1024,
        metadata=_meta(
            "With async_generation: the most finished completions waiting for the trainer (whole generation "
            "batches; one batch always fits)."
        ),
    )
    weight_sync_steps: int = field(
        default=1,
        metadata=_meta(
            "With async_generation: send the weights to the worker every this many optimizer steps (needs "
            "max_staleness >= weight_sync_steps - 1)."
        ),
    )
    generation_threads: Optional[int] = field(
        default=None,
        metadata=_meta(
            "grouprl, with async_generation and a local worker on the CPU: the worker's torch threads (default: half "
            "the cores, at least 1); training then uses the other cores, restored when train() ends."
        ),
    )
    request_timeout: float = field(
        default=600.0,
        metadata=_meta("With async_generation: seconds to wait for one generation request to the worker."),
    )
    weight_sync_timeout: float = field(
        default=1800.0,
        metadata=_meta("With async_generation: seconds to wait for one weight transfer to the worker."),
    )
    heartbeat_stale_after_s: float = field(
        default=300.0,
        metadata=_meta(
            "With async_generation: a worker that has not answered for this many seconds is treated as dead: "
            "a local worker is restarted once, otherwise training stops with an error naming it."
        ),
    )


# A dataclass collects fields from its last base to its first, so the groups are listed last section first:
# the order of the fields (and of --help and docs/trl-compat.md) is TrainingArguments', then TRL's, then async's.
@dataclass
class GRPOFields(AsyncGenerationFields, LossAndLoggingFields, ModelAndSamplingFields, TrainingArguments):
    """Every field of GRPOConfig, without what building a config does (grpo_config.py): what its checks read."""
