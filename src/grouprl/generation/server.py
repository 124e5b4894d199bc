"""`grouprl serve`: a generation server hosting grouprl's samplers (`--generation_engine`, as the trainer picks them:
on a CPU the fast engine, else the captured decode loop; on CUDA the captured decode loop; transformers generate for
a vision-language model and where those cannot serve the model), with weight updates from a trainer.

This module is the app and its start-up; the choices it returns are built in `server_choices.py`,
the weights it receives are loaded by `server_weights.py`.

Endpoints (FastAPI; `pip install 'grouprl[serve]'`):

    GET  /health              {"status": "ok", "server": "grouprl", "model": ..., "weight_version": k}
                              (k counts weight updates from --weight_version, or is the version an update named)
    GET  /v1/models           OpenAI model list
    POST /v1/completions      OpenAI completions with token-id prompts (vLLM's extensions: token_ids
                              in each choice, top_k / min_p / repetition_penalty / min_tokens);
                              `n` samples per prompt, choices prompt-major; `logprobs: 0` returns the
                              sampled tokens' logprobs under the processed sampling distribution
                              (vLLM's processed_logprobs); `echo: true, max_tokens: 0` scores the
                              prompt instead (logprob of each prompt token, the first is null);
                              the response's "weight_version" is the version that sampled it;
                              `multimodal` (grouprl's): each prompt's processor outputs for a
                              vision-language model, sampled with transformers generate
    POST /load_weights        body = safetensors bytes of some named weights; loads them (?last=1 ends an
                              update; ?version=k names its version)
    POST /init_weight_broadcast  {"host", "port", "backend", "timeout"}: join a 2-process group
                              (trainer rank 0, server rank 1) for broadcasts (gloo on CPU, nccl on GPU)
    POST /broadcast_weights   {"names", "dtypes", "shapes", "version"}: receive those tensors by broadcast, load
                              them (version optional)

Requests run one at a time (a lock): the engine holds one model, and a weight update must not
land in the middle of a generation.
"""

import argparse
import base64
import threading
from typing import Any, Optional, Union

import torch

from grouprl.core.types import SamplingParams
from grouprl.generation.factory import IN_PROCESS_ENGINES, auto_choice, refused
from grouprl.generation.hf import TransformersGenerator
from grouprl.generation.server_choices import sample_choice, score_choice, token_prompts, with_logprobs
from grouprl.generation.server_weights import WeightReceiver
from grouprl.model.multimodal import image_token_ids, images_from_bytes, is_vision_language_config

# Request fields accepted without effect here: formatting switches of vLLM's API.
INERT_FIELDS = {"return_token_ids", "return_tokens_as_token_ids", "stream", "user", "model"}
SERVER_ENGINES = ("auto", "engine", "captured", "transformers")  # `grouprl serve --generation_engine`


def server_sampler(
    model: torch.nn.Module, tokenizer: Any, eos_token_ids: list[int], pad_token_id: int, engine: str = "auto"
) -> tuple[Any, str]:
    """What samples the server's requests, and that in words. A vision-language model's: transformers generate (it
    takes the image inputs and suppresses their placeholders). A text model's: `engine`; 'auto' is the trainer's pick
    for the model's device (factory.auto_choice: the fast engine on a CPU, else the captured loop; the captured loop on
    CUDA) where that serves the model, else transformers generate, the reasons said."""
    if engine not in SERVER_ENGINES:
        raise ValueError(f"grouprl serve --generation_engine must be one of {SERVER_ENGINES}, got {engine!r}.")
    transformers = TransformersGenerator(
        model, tokenizer, eos_token_ids, pad_token_id, suppress_token_ids=image_token_ids(model.config)
    )
    if is_vision_language_config(model.config) or engine == "transformers":
        return transformers, "transformers generate"
    chosen, refusals = auto_choice(model, {}, None) if engine == "auto" else (engine, {})
    why = f" ({refused(refusals)})" if refusals else ""
    if chosen == "transformers":
        return transformers, f"transformers generate{why}"
    supports, sampler = IN_PROCESS_ENGINES[chosen]
    reason = None if engine == "auto" else supports(model, {}, None)  # 'auto' picked one that serves it
    if reason is None:
        options = {"fallback": transformers} if chosen == "captured" else {}  # CapturedGenerator.served_reason
        return sampler(model, tokenizer, eos_token_ids, pad_token_id, **options), f"generation_engine {chosen!r}{why}"
    raise ValueError(f"grouprl serve --generation_engine {engine}: {reason}. Use auto or transformers.")


def require_server_libraries() -> tuple[Any, Any]:
    try:
        import fastapi
        import uvicorn
    except ImportError:
        raise ImportError("grouprl serve needs FastAPI and uvicorn: pip install 'grouprl[serve]'.") from None
    return fastapi, uvicorn


def create_app(
    model: torch.nn.Module,
    tokenizer: Any,
    eos_token_ids: list[int],
    model_name: str,
    weight_version: int = 0,
    engine: str = "auto",
) -> Any:
    """The server's app; `engine`: which sampler serves text models (`server_sampler`)."""
    fastapi, _ = require_server_libraries()
    from fastapi import HTTPException, Request
    from pydantic import BaseModel, ConfigDict

    class CompletionRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        prompt: Union[list[int], list[list[int]], str, list[str]]
        n: int = 1
        max_tokens: Optional[int] = 16
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = -1
        min_p: Optional[float] = 0.0
        repetition_penalty: float = 1.0
        min_tokens: int = 0
        logprobs: Optional[int] = None
        echo: bool = False
        seed: Optional[int] = None
        # grouprl's extension: each prompt's processor outputs (safetensors, base64) or None (vision-language models)
        multimodal: Optional[list[Optional[str]]] = None

    class BroadcastInit(BaseModel):
        host: str
        port: int
        backend: str = "gloo"
        timeout: float = 240.0

    class BroadcastUpdate(BaseModel):
        names: list[str]
        dtypes: list[str]
        shapes: list[list[int]]
        version: Optional[int] = None

    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
    vision = is_vision_language_config(model.config)
    generator, app_sampler = server_sampler(model, tokenizer, eos_token_ids, pad_token_id, engine)
    weights = WeightReceiver(model, version=weight_version)
    lock = threading.Lock()
    app = fastapi.FastAPI(title="grouprl generation server")
    app.state.sampler = app_sampler

    def bad_request(message: str) -> HTTPException:
        return HTTPException(status_code=400, detail=message)

    @app.get("/health")
    def health() -> dict:
        return {
            "status": "ok",
            "server": "grouprl",
            "model": model_name,
            "weight_version": weights.version,
            "sampler": app_sampler,
        }

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "grouprl"}]}

    @app.post("/v1/completions")
    def completions(request: CompletionRequest) -> dict:
        unsupported = sorted(set(request.model_extra or {}) - INERT_FIELDS)
        if unsupported:
            raise bad_request(
                f"unsupported request fields {unsupported}; grouprl serve samples with n, max_tokens, temperature, "
                "top_p, top_k, min_p, repetition_penalty, min_tokens, logprobs (0), echo (with max_tokens 0), seed, "
                "multimodal."
            )
        prompts = token_prompts(request.prompt, tokenizer)
        if request.n < 1 or request.logprobs not in (None, 0):
            raise bad_request(
                "n must be >= 1 and logprobs None or 0 (the sampled token's logprob; no top alternatives)."
            )
        with lock:
            version = weights.version
            if request.seed is not None:
                torch.manual_seed(request.seed)
            if request.echo:
                if request.max_tokens not in (0, None):
                    raise bad_request("echo is only supported with max_tokens=0 (scoring the prompt).")
                choices = [score_choice(i, ids, model, tokenizer, request.temperature) for i, ids in enumerate(prompts)]
            else:
                params = SamplingParams(
                    max_new_tokens=request.max_tokens or 16,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    top_k=max(request.top_k, 0),
                    min_p=request.min_p or None,
                    repetition_penalty=request.repetition_penalty,
                    extra={"min_new_tokens": request.min_tokens} if request.min_tokens else {},
                )
                images = prompt_images(request.multimodal, len(prompts))
                if images is None:
                    sampled = generator.generate(prompts, request.n, params)
                else:
                    sampled = generator.generate(prompts, request.n, params, multimodal=images)
                if vision and request.logprobs is not None:  # generate gives none: one scoring forward
                    sampled = with_logprobs(
                        model,
                        prompts,
                        sampled,
                        params,
                        images,
                        suppress_token_ids=generator.suppress_token_ids,
                        eos_token_ids=generator.eos_token_ids,
                    )
                choices = [
                    sample_choice(i, c, prompts[c.prompt_index], request.logprobs is not None)
                    for i, c in enumerate(sampled)
                ]
        usage_prompt = sum(len(p) for p in prompts)
        usage_completion = sum(len(c.get("token_ids") or []) for c in choices)
        return {
            "id": f"cmpl-{version}",
            "object": "text_completion",
            "model": model_name,
            "weight_version": version,  # the weights that sampled these choices (the lock held them still)
            "choices": choices,
            "usage": {
                "prompt_tokens": usage_prompt,
                "completion_tokens": usage_completion,
                "total_tokens": usage_prompt + usage_completion,
            },
        }

    def prompt_images(encoded: Optional[list[Optional[str]]], count: int) -> Optional[list[Any]]:
        if encoded is None:
            return None
        if not vision:
            raise bad_request(f"multimodal: {model_name} is not a vision-language model; send text prompts only.")
        if len(encoded) != count:
            raise bad_request(f"multimodal has {len(encoded)} entries for {count} prompts; give one per prompt.")
        try:
            return [None if e is None else images_from_bytes(base64.b64decode(e)) for e in encoded]
        except ValueError as err:
            raise bad_request(f"multimodal: not base64 safetensors of processor outputs ({err}).") from None

    @app.post("/load_weights")
    async def load_weights(request: Request) -> dict:
        from safetensors.torch import load as load_safetensors

        body = await request.body()
        try:
            tensors = load_safetensors(body)
        except Exception as err:
            raise bad_request(f"the body is not a safetensors file: {err}") from None
        with lock:
            try:
                count = weights.load(tensors)
            except ValueError as err:
                raise bad_request(str(err)) from None
            if request.query_params.get("last", "1") == "1":
                weights.advance(request.query_params.get("version"))
        return {"loaded": count, "weight_version": weights.version}

    @app.post("/init_weight_broadcast")
    def init_weight_broadcast(request: BroadcastInit) -> dict:
        try:
            weights.join_group(request.host, request.port, request.backend, request.timeout)
        except (RuntimeError, ValueError) as err:
            raise bad_request(
                f"could not join the weight broadcast group at {request.host}:{request.port}: {err}"
            ) from None
        return {"joined": True}

    @app.post("/broadcast_weights")
    def broadcast_weights(request: BroadcastUpdate) -> dict:
        with lock:
            try:
                count = weights.receive(request.names, request.dtypes, request.shapes)
            except ValueError as err:
                raise bad_request(str(err)) from None
            weights.advance(request.version)
        return {"loaded": count, "weight_version": weights.version}

    return app


def serve(args: argparse.Namespace) -> None:
    _, uvicorn = require_server_libraries()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from grouprl.model.loading import eos_token_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.parent_pid:
        exit_with(args.parent_pid)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    loader = AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM
    model = loader.from_pretrained(args.model, dtype=dtype, trust_remote_code=args.trust_remote_code).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    torch.manual_seed(args.seed)
    app = create_app(
        model, tokenizer, eos_token_ids(tokenizer, model), args.model, args.weight_version, args.generation_engine
    )
    print(f"grouprl serve: {args.model} on {device}, {app.state.sampler}, http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def exit_with(parent_pid: int) -> None:
    """End this process once `parent_pid` has ended (a trainer killed with SIGKILL leaves no worker behind)."""
    import os
    import time

    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass  # alive, owned by someone else
            if os.getppid() != parent_pid:
                os._exit(0)  # re-parented: the trainer is gone
            time.sleep(1.0)

    threading.Thread(target=watch, name="grouprl-parent-watch", daemon=True).start()
