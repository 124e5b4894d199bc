"""GRPOConfig's first fields: TRL's TrainingArguments defaults, the model, the data and the sampling.

TRL 1.16's names, defaults and help texts (sections 1.1 to 1.4 of its GRPOConfig), in its declaration
order, which ``--help`` and docs/trl-compat.md follow. ``GRPOConfig`` inherits them as a mixin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


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
    ds3_gather_for_generation: bool = field(default=True, metadata=_meta("Gather ZeRO-3 weights for generation."))
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
            "grouprl: 'engine' (fast in-process sampler: one prefill per prompt, finished rows leave the batch), "
            "'captured' (a static decode loop, Llama-family models: KV buffers allocated once, sampling inside the "
            "step, replayed as one CUDA graph per step on CUDA, eager elsewhere; docs/benchmarks-gpu.md), "
            "'transformers' (model.generate), 'auto' (where the model and options allow it: the engine on a CPU, the "
            "captured loop on CUDA, each measured fastest there; otherwise transformers generate; use_vllm=True "
            "picks vLLM), or 'server' (a `grouprl serve` server at vllm_server_base_url / "
            "vllm_server_host:vllm_server_port)."
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
            "where it is estimated to save a tenth or more of the cost and a one-time check per model agrees). False "
            "runs every row on its own."
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
