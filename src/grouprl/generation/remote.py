"""Client backend for a generation server: `grouprl serve`, or any server with vLLM's OpenAI
completions API for the sampling part.

Only the main process talks to the server (`main_process_only`: the dispatcher gathers every
process's prompts and scatters the completions). The HTTP part (timeouts, retries with backoff, waiting
for the server) is server_client.py's. A grouprl server says which weight version sampled each response;
`versions_seen` collects them for the requests a thread makes (asynchronous generation tags its samples
with them).

Weight sync after each optimizer step (called on every process, since gathering sharded weights
is collective): `weight_transfer="http"` posts the weights as safetensors in chunks
(`/load_weights`); `"broadcast"` sends them over a 2-process torch.distributed group of the
trainer's main process and the server (gloo on CPU, NCCL on GPU), with only the names, dtypes and
shapes going over HTTP. `send_weights` sends weights already gathered (a snapshot), naming their version.
"""

from __future__ import annotations

import base64
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
from accelerate import PartialState

from grouprl.core.distributed import run_on_main
from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.server_client import ServerClient, ServerError, own_address
from grouprl.generation.weights import chunks, inference_weights
from grouprl.model.multimodal import images_to_bytes


class RemoteGenerator(ServerClient):
    """A `GenerationBackend` that samples on a generation server."""

    main_process_only = True
    needs_importance_correction = True  # the server samples from its own copy of the weights

    def __init__(
        self,
        base_url: str,
        *,
        tokenizer: Any = None,
        timeout: float = 240.0,
        retries: int = 3,
        weight_transfer: str = "http",
        group_port: int = 51216,
        chunk_bytes: int = 256 * 2**20,
        connect: bool = True,
        weight_timeout: Optional[float] = None,
    ):
        if weight_transfer not in ("http", "broadcast"):
            raise ValueError(f"weight_transfer={weight_transfer!r}: use 'http' or 'broadcast'.")
        super().__init__(base_url, timeout=timeout, retries=retries)
        self.tokenizer = tokenizer
        self.weight_transfer, self.group_port, self.chunk_bytes = weight_transfer, group_port, chunk_bytes
        self.weight_timeout = weight_timeout  # per weight request (None: `timeout`)
        self.info: dict = {}
        self.model_name: Optional[str] = None
        self.sent_version: Optional[int] = None  # the version named in the last completed send_weights
        self._group: Any = None
        self._seen = threading.local()  # per thread: the list versions_seen collects into, if any
        if connect:
            self.info = run_on_main(self.wait_until_ready)
            self.model_name = self.info.get("model")

    @property
    def is_grouprl(self) -> bool:
        return self.info.get("server") == "grouprl"

    # ---- sampling -----------------------------------------------------------------------------

    def completion_request(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> dict:
        body = {
            "prompt": [list(p) for p in prompt_ids],
            "n": num_samples,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "min_p": params.min_p or 0.0,
            "repetition_penalty": params.repetition_penalty,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if self.model_name:
            body["model"] = self.model_name
        extra = dict(params.extra)
        if "min_new_tokens" in extra:
            extra["min_tokens"] = extra.pop("min_new_tokens")
        body.update(extra)  # generation_kwargs override the named fields, as in TRL
        return body

    def generate(
        self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams, multimodal: list[Any] | None = None
    ) -> list[Completion]:
        """`multimodal`: (prompts,) each prompt's `multimodal.PromptImages` or None; a grouprl server takes them."""
        if not prompt_ids:
            return []
        body = self.completion_request(prompt_ids, num_samples, params)
        if multimodal is not None:
            body["multimodal"] = self.images_field(multimodal)
        response = self.request("POST", "/v1/completions", body)
        seen = getattr(self._seen, "versions", None)
        if seen is not None:  # a grouprl server names the weights that sampled; others: the last version sent
            seen.append(response.get("weight_version", self.sent_version))
        choices = sorted(response["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompt_ids) * num_samples:
            raise ServerError(
                f"the generation server returned {len(choices)} completions for {len(prompt_ids)} prompts x "
                f"{num_samples}."
            )
        completions = []
        for row, choice in enumerate(choices):
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise ServerError(
                    "the generation server's completions carry no token_ids; grouprl needs them (vLLM: "
                    "return_token_ids)."
                )
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            text = choice.get("text")
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            finish = "stop" if choice.get("finish_reason") == "stop" else "length"
            completions.append(
                Completion(
                    row // num_samples,
                    list(token_ids),
                    text or "",
                    finish,
                    None if logprobs is None else list(logprobs),
                )
            )
        return completions

    def images_field(self, multimodal: list[Any]) -> list[Optional[str]]:
        """Each prompt's processor outputs (safetensors, base64), None for a prompt without images. The server samples
        from the very inputs the trainer scores with, so it needs no processor of its own."""
        if not self.is_grouprl:
            raise NotImplementedError(
                f"{self.base_url} is not a grouprl server, and grouprl sends image prompts to grouprl's own server "
                "only (`grouprl serve --model PATH`). With vLLM, use vllm_mode='colocate'; or sample in the "
                "training process (use_vllm=False, generation_engine='auto')."
            )
        return [None if m is None else base64.b64encode(images_to_bytes(m)).decode("ascii") for m in multimodal]

    @contextmanager
    def versions_seen(self) -> Iterator[list[Optional[int]]]:
        """The weight versions that answered this thread's generation requests inside the block, in order."""
        self._seen.versions = versions = []
        try:
            yield versions
        finally:
            self._seen.versions = None

    def score(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Logprob of each token after the first under the server's current weights (echo, max_tokens 0)."""
        body = {"prompt": [list(token_ids)], "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": temperature}
        choice = self.request("POST", "/v1/completions", body)["choices"][0]
        return choice["logprobs"]["token_logprobs"][1:]

    # ---- weight sync --------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Send `model`'s weights to the server (call on every process; only the main one sends)."""
        weights = inference_weights(model)
        if PartialState().is_main_process:
            run_on_main(lambda: self.send_weights(weights))
        else:
            for _ in weights:  # take part in the gathers of sharded weights
                pass
            run_on_main(lambda: None)

    def send_weights(self, weights: Any, version: Optional[int] = None) -> None:
        """Send (name, tensor) pairs to the server (main process); `version` names the update (None: the next)."""
        send = self._broadcast if self.weight_transfer == "broadcast" else self._post
        send(weights, version)
        self.sent_version = version

    def _post(self, weights: Any, version: Optional[int]) -> None:
        pending: Optional[dict] = None
        for chunk in chunks(weights, self.chunk_bytes):
            if pending is not None:
                self._post_chunk(pending, "last=0")
            pending = chunk
        if pending is not None:
            self._post_chunk(pending, "last=1" + ("" if version is None else f"&version={version}"))

    def _post_chunk(self, tensors: dict[str, torch.Tensor], query: str) -> None:
        from safetensors.torch import save

        self.request("POST", f"/load_weights?{query}", raw=save(tensors), timeout=self.weight_timeout)

    def _broadcast(self, weights: Any, version: Optional[int]) -> None:
        tensors = [(name, tensor.contiguous()) for name, tensor in weights]
        if self._group is None:
            self._group = self._join_group(device=tensors[0][1].device)
        meta = {
            "names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "version": version,
        }
        self.while_posting(
            "/broadcast_weights",
            meta,
            lambda: [self._group.broadcast(t, 0).wait() for _, t in tensors],
            timeout=self.weight_timeout,
        )

    def _join_group(self, device: torch.device) -> Any:
        from grouprl.generation.server_weights import new_pair_group

        backend = "nccl" if device.type == "cuda" else "gloo"
        host = own_address(self.base_url)
        store = torch.distributed.TCPStore(
            host, self.group_port, 2, is_master=True, timeout=timedelta(seconds=self.timeout), wait_for_workers=False
        )
        group: list[Any] = []
        body = {"host": host, "port": self.group_port, "backend": backend, "timeout": self.timeout}
        self.while_posting(
            "/init_weight_broadcast",
            body,
            lambda: group.append(new_pair_group(store, rank=0, backend=backend, timeout=self.timeout)),
        )
        return group[0]
