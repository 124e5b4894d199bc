"""Which generation backend a config asks for.

use_vllm=True, vllm_mode="server"    the server at vllm_server_base_url (or host:port): a grouprl
                                     server (`grouprl serve`, needs no vLLM) or `vllm serve`
use_vllm=True, vllm_mode="colocate"  vLLM inside each training process
generation_engine="server"           a grouprl server, named the grouprl way
generation_engine="engine"           the fast in-process engine (FastGenerator)
generation_engine="captured"         the static decode loop, one CUDA graph replayed per step on CUDA,
                                     its step compiled first on CUDA (compile_decode_step unset or True)
                                     (static_decode.py, CapturedGenerator)
generation_engine="auto"             where it applies and model.generate is transformers' own
                                     (engine.py): on a CPU the engine, else the captured loop
                                     (hybrids such as Qwen3.5); on CUDA the captured loop;
                                     otherwise transformers `generate` (`AUTO_ENGINES`: each was
                                     measured faster there than what follows it)
generation_engine="transformers"     transformers `generate`
use_transformers_continuous_batching transformers `generate_batch` (continuous_batching.py), in place of
                                     generation_engine's sampler

Under FSDP or ZeRO-3 on several processes, in-process sampling samples from an unsharded replica of the policy
(ShardedPolicySampler), or, with ds3_gather_for_generation=False, from the sharded policy itself with every process
in step (lockstep_backend).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.continuous_batching import ContinuousBatchingGenerator, continuous_batching_refusal
from grouprl.generation.engine import EngineUnlessGenerateOverridden, FastGenerator, engine_supports
from grouprl.generation.hf import TransformersGenerator
from grouprl.generation.protocol import GenerationBackend, backend_report
from grouprl.generation.remote import RemoteGenerator
from grouprl.generation.server_client import server_base_url
from grouprl.generation.static_decode import CapturedGenerator, captured_supports
from grouprl.generation.weights import load_weights, materialize, release_storage, replica_of
from grouprl.model.multimodal import image_token_ids
from grouprl.model.quantization import is_quantized

logger = logging.get_logger("grouprl")


def build_backend(
    model: PreTrainedModel, tokenizer: Any, eos_token_ids: list[int], args: Any, *, max_num_seqs: int
) -> GenerationBackend:
    if args.use_vllm and args.vllm_mode == "colocate":
        from grouprl.generation.vllm import VLLMColocateGenerator

        return VLLMColocateGenerator(
            model.config._name_or_path,
            tokenizer,
            args,
            max_num_seqs=max_num_seqs,
            suppress_token_ids=image_token_ids(model.config),
        )
    if args.use_vllm or args.generation_engine == "server":
        return connect_server(tokenizer, args)
    if sharded_weights() and not args.ds3_gather_for_generation:
        return lockstep_backend(model, tokenizer, eos_token_ids, args)
    if sharded_weights():
        if is_quantized(model):
            raise ValueError(
                "In-process sampling under FSDP / DeepSpeed ZeRO-3 samples from an unsharded replica loaded with the "
                "policy's gathered weights, and gathering a quantized policy's weights (dequantized, with its adapters "
                "merged) is not built. Set GRPOConfig.ds3_gather_for_generation=False: each process then samples "
                "from the sharded quantized policy itself, the processes in step."
            )
        return ShardedPolicySampler(lambda replica: in_process_backend(replica, tokenizer, eos_token_ids, args))
    return in_process_backend(model, tokenizer, eos_token_ids, args)


def lockstep_backend(
    model: PreTrainedModel, tokenizer: Any, eos_token_ids: list[int], args: Any
) -> TransformersGenerator:
    """Sampling from the sharded policy itself, the processes in step (ds3_gather_for_generation=False): no process
    ever holds the whole model, at the cost of gathering every layer's weights at every decode step. Only transformers
    generate runs the processes in step; the engines read the weights directly, which a sharded model does not hold."""
    if args.generation_engine not in ("auto", "transformers") or args.compile_decode_step:
        engine = f"generation_engine={args.generation_engine!r}"
        chosen = "compile_decode_step=True" if args.compile_decode_step else engine
        raise ValueError(
            f"GRPOConfig.ds3_gather_for_generation=False samples from the sharded model with transformers generate, "
            f"every process in step; {chosen} needs the whole model in each process. Leave generation_engine 'auto' "
            "(or 'transformers') and compile_decode_step unset, or set ds3_gather_for_generation=True."
        )
    return transformers_backend(model, tokenizer, eos_token_ids, args, synced_gpus=True)


def transformers_backend(
    model: PreTrainedModel, tokenizer: Any, eos_token_ids: list[int], args: Any, *, synced_gpus: bool = False
) -> TransformersGenerator:
    return TransformersGenerator(
        model,
        tokenizer,
        eos_token_ids,
        tokenizer.pad_token_id,
        cache_implementation=args.cache_implementation,
        suppress_token_ids=image_token_ids(model.config),
        synced_gpus=synced_gpus,
    )


def sampling_params(args: Any) -> SamplingParams:
    """What the config asks every completion to be sampled with (generation_kwargs override the named fields)."""
    return SamplingParams(
        max_new_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        extra=dict(args.generation_kwargs or {}),
    )


def continuous_batching_backend(
    model: PreTrainedModel, tokenizer: Any, eos_token_ids: list[int], args: Any
) -> ContinuousBatchingGenerator:
    """use_transformers_continuous_batching=True (or TRL's deprecated use_transformers_paged): transformers'
    generate_batch, in place of generation_engine's sampler; a setting it would not apply is refused here."""
    other = args.generation_engine != "auto" or args.compile_decode_step
    reason = (
        f"generation_engine={args.generation_engine!r} / compile_decode_step={args.compile_decode_step} ask for "
        "another sampler; leave them at 'auto' / unset"
        if other
        else continuous_batching_refusal(sampling_params(args))
    )
    if reason:
        raise ValueError(
            f"GRPOConfig.use_transformers_continuous_batching=True samples with transformers continuous batching, but "
            f"{reason}. Or set use_transformers_continuous_batching=False."
        )
    return ContinuousBatchingGenerator(
        model,
        tokenizer,
        eos_token_ids,
        tokenizer.pad_token_id,
        settings=args.transformers_continuous_batching_config,
        suppress_token_ids=image_token_ids(model.config),
    )


def in_process_backend(
    model: PreTrainedModel, tokenizer: Any, eos_token_ids: list[int], args: Any
) -> GenerationBackend:
    """The backend that samples from `model` in this process: generation_engine's (module doc)."""
    if args.use_transformers_continuous_batching:
        return continuous_batching_backend(model, tokenizer, eos_token_ids, args)
    requested, options = args.generation_engine, (args.generation_kwargs or {}, args.cache_implementation)
    transformers = transformers_backend(model, tokenizer, eos_token_ids, args)
    compile_step = args.compile_decode_step  # None: on CUDA, if it compiles (CapturedGenerator)
    engine, refusals = auto_choice(model, *options) if requested == "auto" else (requested, {})
    if compile_step and "captured" in refusals:
        raise ValueError(
            f"GRPOConfig.compile_decode_step=True needs the captured decode loop, which cannot sample here: "
            f"{refusals['captured']}. Leave compile_decode_step unset."
        )
    if compile_step and engine != "captured":
        raise ValueError(
            f"GRPOConfig.compile_decode_step=True compiles the captured decode loop, but generation_engine="
            f"{requested!r} samples with {engine!r} on {model_device(model).type}; set generation_engine='captured' "
            "or leave compile_decode_step unset."
        )
    if refusals:
        logger.info(f"grouprl: generation_engine='auto' samples with {sampler_words(engine)}, {refused(refusals)}.")
    if engine == "transformers":
        return transformers
    supports, in_process = IN_PROCESS_ENGINES[engine]
    reason = None if requested == "auto" else supports(model, *options)  # 'auto' picked one that serves it
    if reason:
        raise ValueError(
            f"GRPOConfig.generation_engine={engine!r} cannot be used: {reason}. Use 'auto' or 'transformers'."
        )
    # The captured loop passes the calls it cannot serve to transformers generate: a vision-language model's prompts
    # with images, a longrope model's sequences past its pretraining length (CapturedGenerator.served_reason)
    options = (
        dict(compile_step=compile_step, suppress_token_ids=image_token_ids(model.config), fallback=transformers)
        if engine == "captured"
        else {}
    )
    # These engines never call model.generate: while the user has replaced it, 'auto' calls it and an
    # explicit engine refuses (engine.EngineUnlessGenerateOverridden).
    backend = EngineUnlessGenerateOverridden(
        in_process(model, tokenizer, eos_token_ids, tokenizer.pad_token_id, **options),
        fallback=transformers if requested == "auto" else None,
        name=engine,
    )
    backend.check()  # an explicit engine with generate already replaced fails here, before training starts
    return backend


IN_PROCESS_ENGINES = {"engine": (engine_supports, FastGenerator), "captured": (captured_supports, CapturedGenerator)}

# What generation_engine='auto' tries on each device type, in order, the first that serves the model; each was
# measured faster there than what follows it (on CPUs the engine: docs/benchmarks.md; the captured loop, eager there:
# 1.4-1.9x transformers generate's tokens/s for a Qwen3 and a Qwen3.5 of 8 layers, docs/benchmarks-gpu.md; on an
# H200 the captured loop: 2.45 s a step against transformers generate's 9.16 for the Qwen2.5-0.5B shape, same page);
# after them, or on any other device, transformers generate.
AUTO_ENGINES = {"cpu": ("engine", "captured"), "cuda": ("captured",)}


def auto_choice(
    model: torch.nn.Module, generation_kwargs: dict, cache_implementation: Optional[str]
) -> tuple[str, dict[str, str]]:
    """What generation_engine='auto' samples `model` with: the first of its device's `AUTO_ENGINES` that serves it
    with these options, else 'transformers'; and why each one tried before it cannot."""
    refusals = {}
    for engine in AUTO_ENGINES.get(model_device(model).type, ()):
        reason = IN_PROCESS_ENGINES[engine][0](model, generation_kwargs, cache_implementation)
        if reason is None:
            return engine, refusals
        refusals[engine] = reason
    return "transformers", refusals


def sampler_words(engine: str) -> str:
    return "transformers generate" if engine == "transformers" else repr(engine)


def refused(refusals: dict[str, str]) -> str:
    """'not 'engine': why; not 'captured': why' (auto_choice's refusals)."""
    return "; ".join(f"not {engine!r}: {reason}" for engine, reason in refusals.items())


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's weights (CPU for a model without parameters)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def connect_server(tokenizer: Any, args: Any) -> GenerationBackend:
    """Wait for the server (vllm_server_timeout); grouprl's own server or, with use_vllm, `vllm serve`."""
    url = server_base_url(args.vllm_server_base_url, args.vllm_server_host, args.vllm_server_port)
    client = RemoteGenerator(
        url,
        tokenizer=tokenizer,
        timeout=args.vllm_server_timeout,
        retries=args.generation_server_retries,
        weight_transfer=args.generation_server_weight_transfer,
        group_port=args.vllm_group_port,
    )
    if client.is_grouprl:
        if args.vllm_structured_outputs_regex is not None:
            raise ValueError(
                "GRPOConfig.vllm_structured_outputs_regex needs a vLLM server; the server at "
                f"{url} is a grouprl server, which has no constrained decoding."
            )
        return client
    if not args.use_vllm:
        raise ValueError(
            f"generation_engine='server': the server at {url} is not a grouprl server (`grouprl serve`). "
            "For `vllm serve`, set use_vllm=True, vllm_mode='server'."
        )
    from grouprl.generation.vllm import VLLMServerGenerator

    return VLLMServerGenerator.from_fields(url, tokenizer, args, timeout=args.vllm_server_timeout)


class ShardedPolicySampler:
    """In-process sampling for a policy whose weights are sharded over the processes (FSDP, DeepSpeed ZeRO-3).

    Sampling from the sharded model itself cannot work: every forward through sharded layers is a collective, and
    each process decodes as many steps as its own rows need, so the processes would wait on each other forever.
    Each process samples instead from an unsharded replica of the policy (weights.replica_of), whose weights are
    gathered into it before each generation (`sync_weights`, which every process calls; built at the first) and
    freed once the generation is sampled (`release_until_sync`), as TRL gathers ZeRO-3's weights for its generation
    (ds3_gather_for_generation=True, the default; False samples from the sharded model, `lockstep_backend`). The
    generation engine (`build`) is chosen for the replica when the first weights arrive.

    Its samples count as a separate sampler's (`needs_importance_correction`): the replica's forward is not the
    sharded model's (FSDP's mixed precision casts the sharded parameters, the replica runs as an unsharded model
    does), so the old logprobs come from the training model and the sampler's go to the importance-sampling
    correction, as with vLLM.
    """

    needs_importance_correction = True

    def __init__(self, build: Callable[[torch.nn.Module], GenerationBackend]):
        self.build = build
        self.replica: Optional[torch.nn.Module] = None
        self.backend: Optional[GenerationBackend] = None

    def sync_weights(self, model: torch.nn.Module) -> None:
        if self.replica is None:
            self.replica = replica_of(model)
        elif self.released:
            materialize(self.replica, model)
        load_weights(self.replica, model)
        if self.backend is None:
            self.backend = self.build(self.replica)
        self.backend.sync_weights(self.replica)

    def generate(self, *args: Any, **kwargs: Any) -> list[Completion]:
        if self.backend is None or self.released:
            raise RuntimeError("ShardedPolicySampler.generate: call sync_weights first (it fills the replica).")
        return self.backend.generate(*args, **kwargs)

    def report(self) -> dict[str, float]:
        return backend_report(self.backend)

    def release_until_sync(self) -> None:
        """Free the replica's weights once a generation is sampled, until the next sync: training gets the memory
        back, as TRL's gathered ZeRO-3 weights are freed when its generation ends."""
        if self.replica is not None:
            release_storage(self.replica)

    @property
    def released(self) -> bool:
        """The replica's storage is freed (its tensors are on the meta device)."""
        return self.replica is not None and next(self.replica.parameters()).is_meta


def sharded_weights() -> bool:
    """True when several processes hold shards of the weights (DeepSpeed ZeRO-3 or FSDP): in-process sampling
    then samples from a replica (ShardedPolicySampler), or from the sharded model in step (lockstep_backend)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    state = AcceleratorState()
    zero3 = state.distributed_type == DistributedType.DEEPSPEED and state.deepspeed_plugin.zero_stage == 3
    return state.num_processes > 1 and (zero3 or state.distributed_type == DistributedType.FSDP)
