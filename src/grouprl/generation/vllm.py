"""vLLM backends (`pip install 'grouprl[vllm]'`), kept thin over vLLM's public API.

- `VLLMColocateGenerator`: an in-process `vllm.LLM` per training process (TRL's colocate mode):
  `distributed_executor_backend="external_launcher"`, sampled-token logprobs in
  `processed_logprobs` mode, optional sleep mode (level 2) between generations, weights loaded
  with `LLM.apply_model(model.load_weights)` after each optimizer step.
- `VLLMServerGenerator`: upstream `vllm serve` (dev mode, `--weight-transfer-config
  '{"backend":"nccl"}'`). Sampling is grouprl's `RemoteGenerator` (vLLM's OpenAI completions
  API, the protocol grouprl's own server speaks and its tests exercise); only the weight sync is
  vLLM's: `/init_weight_transfer_engine` + `NCCLWeightTransferEngine.trainer_init` once, then
  `/start_weight_update`, `/update_weights` with a packed NCCL broadcast, `/finish_weight_update`,
  `/reset_prefix_cache` per sync.

Neither class has been run by grouprl's test suite: vLLM does not install on its CPU machines
(tests/test_vllm.py runs where vLLM is importable). What is shared with the grouprl server
(request building, response parsing, dispatch across processes, weight naming for LoRA and
sharded models) is tested there.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from accelerate import PartialState

from grouprl.core.distributed import run_on_main
from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.remote import RemoteGenerator
from grouprl.generation.server_client import own_address
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


def vllm_sampling_params(vllm: Any, num_samples: int, params: SamplingParams, regex: Optional[str]) -> Any:
    extra = dict(params.extra)
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


class VLLMColocateGenerator:
    """One `vllm.LLM` inside each training process, sharing its GPU."""

    main_process_only = False
    needs_importance_correction = True

    def __init__(self, model_path: str, tokenizer: Any, config: Any, max_num_seqs: int):
        self.vllm = require_vllm("GRPOConfig.use_vllm=True (vllm_mode='colocate')")
        state = PartialState()
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
        if self.sleep:
            self.llm.sleep(level=2)  # weights dropped until the first sync
            self.weights_asleep = True

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model
        if self.sleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False
        weights = inference_weights(model)
        self.llm.apply_model(lambda served: served.load_weights(weights=weights))
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> list[Completion]:
        if self.weights_asleep and self.model is not None:  # a second generation in the same optimizer step
            self.sync_weights(self.model)
        if self.sleep:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(ids)} for ids in prompt_ids],
                vllm_sampling_params(self.vllm, num_samples, params, self.regex),
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
        require_vllm("use_vllm=True, vllm_mode='server' against `vllm serve` (its NCCL weight transfer)")
        super().__init__(base_url, tokenizer=tokenizer, timeout=timeout, retries=retries, group_port=group_port)
        self.regex = regex
        self.model_name = run_on_main(lambda: self.request("GET", "/v1/models")["data"][0]["id"])

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
