"""Client backend for a generation server: `grouprl serve`, or any server with vLLM's OpenAI
completions API for the sampling part.

Only the main process talks to the server (`main_process_only`: the dispatcher gathers every
process's prompts and scatters the completions). Requests use the standard library's HTTP client
with a per-request timeout and retries with backoff on connection errors, timeouts and 502/503/504,
so a dead server ends the run with an error naming the URL and the settings, never a hang.

Weight sync after each optimizer step (called on every process, since gathering sharded weights
is collective): `weight_transfer="http"` posts the weights as safetensors in chunks
(`/load_weights`); `"broadcast"` sends them over a 2-process torch.distributed group of the
trainer's main process and the server (gloo on CPU, NCCL on GPU), with only the names, dtypes and
shapes going over HTTP.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any, Optional

import torch
from accelerate import PartialState

from grouprl.core.distributed import run_on_main
from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.weights import chunks, inference_weights

RETRY_STATUS = {502, 503, 504}


class ServerError(ConnectionError):
    """The generation server could not be reached, or answered with an error."""


class RemoteGenerator:
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
    ):
        if weight_transfer not in ("http", "broadcast"):
            raise ValueError(f"weight_transfer={weight_transfer!r}: use 'http' or 'broadcast'.")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.timeout, self.retries = float(timeout), int(retries)
        self.weight_transfer, self.group_port, self.chunk_bytes = weight_transfer, group_port, chunk_bytes
        self.info: dict = {}
        self.model_name: Optional[str] = None
        self._group: Any = None
        if connect:
            self.info = run_on_main(self.wait_until_ready)
            self.model_name = self.info.get("model")

    # ---- HTTP ---------------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, *, raw: Optional[bytes] = None, retries: Optional[int] = None
    ) -> Any:
        """JSON response of one request, retried on connection errors, timeouts and 502/503/504."""
        url = self.base_url + path
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/octet-stream" if raw is not None else "application/json"}
        attempts = 1 + (self.retries if retries is None else retries)
        last: Exception = RuntimeError("no attempt made")
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(url, data=data, headers=headers, method=method), timeout=self.timeout
                ) as response:
                    return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:2000]
                if err.code not in RETRY_STATUS:
                    raise ServerError(f"generation server {method} {url} answered {err.code}: {detail}") from None
                last = err
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as err:
                last = err
        raise ServerError(
            f"generation server {method} {url} failed after {attempts} attempt(s): {getattr(last, 'reason', last)}. "
            f"Settings: vllm_server_timeout={self.timeout:g}s per request, generation_server_retries={self.retries}. "
            "Check that the server (`grouprl serve --model ...` or `vllm serve ...`) is running at that address, or "
            "raise these settings."
        )

    def wait_until_ready(self) -> dict:
        """Poll GET /health until it answers (at most `timeout` seconds); return its JSON (empty for vLLM)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with urllib.request.urlopen(
                    self.base_url + "/health", timeout=max(1.0, min(self.timeout, 10.0))
                ) as response:
                    body = response.read()
                try:
                    return json.loads(body) if body else {}
                except json.JSONDecodeError:
                    return {}
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as err:
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"no generation server answered at {self.base_url}/health within "
                        f"vllm_server_timeout={self.timeout:g}s ({getattr(err, 'reason', err)}). Start one first "
                        "(`grouprl serve --model PATH --port N`) and point vllm_server_base_url (or vllm_server_host / "
                        "vllm_server_port) at it."
                    ) from None
                time.sleep(min(1.0, max(deadline - time.monotonic(), 0.05)))

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

    def generate(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> list[Completion]:
        if not prompt_ids:
            return []
        response = self.request("POST", "/v1/completions", self.completion_request(prompt_ids, num_samples, params))
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

    def score(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Logprob of each token after the first under the server's current weights (echo, max_tokens 0)."""
        body = {"prompt": [list(token_ids)], "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": temperature}
        choice = self.request("POST", "/v1/completions", body)["choices"][0]
        return choice["logprobs"]["token_logprobs"][1:]

    # ---- weight sync --------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Send `model`'s weights to the server (call on every process; only the main one sends)."""
        weights = inference_weights(model)
        send = self._broadcast if self.weight_transfer == "broadcast" else self._post
        if PartialState().is_main_process:
            run_on_main(lambda: send(weights))
        else:
            for _ in weights:  # take part in the gathers of sharded weights
                pass
            run_on_main(lambda: None)

    def _post(self, weights: Any) -> None:
        pending: Optional[dict] = None
        for chunk in chunks(weights, self.chunk_bytes):
            if pending is not None:
                self._post_chunk(pending, last=False)
            pending = chunk
        if pending is not None:
            self._post_chunk(pending, last=True)

    def _post_chunk(self, tensors: dict[str, torch.Tensor], last: bool) -> None:
        from safetensors.torch import save

        self.request("POST", f"/load_weights?last={int(last)}", raw=save(tensors))

    def _broadcast(self, weights: Any) -> None:
        tensors = [(name, tensor.contiguous()) for name, tensor in weights]
        if self._group is None:
            self._group = self._join_group(device=tensors[0][1].device)
        meta = {
            "names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
        }
        self._while_posting(
            "/broadcast_weights", meta, lambda: [self._group.broadcast(t, 0).wait() for _, t in tensors]
        )

    def _join_group(self, device: torch.device) -> Any:
        from grouprl.generation.server_weights import new_pair_group

        backend = "nccl" if device.type == "cuda" else "gloo"
        host = _own_address(self.base_url)
        store = torch.distributed.TCPStore(
            host, self.group_port, 2, is_master=True, timeout=timedelta(seconds=self.timeout), wait_for_workers=False
        )
        group: list[Any] = []
        body = {"host": host, "port": self.group_port, "backend": backend, "timeout": self.timeout}
        self._while_posting(
            "/init_weight_broadcast",
            body,
            lambda: group.append(new_pair_group(store, rank=0, backend=backend, timeout=self.timeout)),
        )
        return group[0]

    def _while_posting(self, path: str, body: dict, work: Any) -> None:
        """POST `body` in a thread while this thread runs `work` (the collective the server joins)."""
        errors: list[Exception] = []

        def post() -> None:
            try:
                self.request("POST", path, body, retries=0)
            except Exception as err:  # re-raised below, after the collective
                errors.append(err)

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        work()
        thread.join(self.timeout)
        if errors:
            raise errors[0]


def _own_address(base_url: str) -> str:
    """This machine's address as seen from the server (the interface that routes to it)."""
    from urllib.parse import urlparse

    host = urlparse(base_url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "0.0.0.0"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 1))
        return probe.getsockname()[0]


def server_base_url(base_url: Optional[str], host: str, port: int) -> str:
    """TRL's rule: vllm_server_base_url wins over host / port."""
    if base_url:
        return base_url.rstrip("/")
    return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
