"""A decode loop whose every step has the same shapes and tensor addresses, captured once as a CUDA graph.

On a GPU a decode step of a small model is bound by launching its few hundred kernels from Python, not by
the card (measured on an H200 for the Qwen2.5-0.5B shape: 27.5 ms a step through transformers' dynamic
cache; reading the weights once takes ~0.2 ms). A step that never changes shape can be recorded once and
replayed as one graph launch. This loop makes every step alike:

- the prompts are left-padded to a multiple of `prompt_bucket` tokens, so calls with prompts of similar
  length share shapes;
- the keys and values of every layer live in buffers allocated once per call for prompt + new tokens
  (`StaticKVCache`, the prompt's part copied in from one prefill per prompt); the column a step writes is a
  device tensor that the step advances itself, and a (rows, columns) mask says which columns are real;
- a step (the model's own forward or the fused one: "Models" below; the training weights read in place where their
  dtype is the products') computes the logits, samples with TRL's fields (sampling.py: repetition penalty,
  temperature, top-k, top-p, min-p), records the token and its logprob under the processed distribution,
  and marks rows that emitted an EOS as finished; finished rows keep stepping and record padding;
- the host reads only whether every row has finished, every `CHECK_EVERY` steps;
- a call whose rows' caches would not fit the free memory (`free_memory`; `bytes_per_row` reads a row's need from the
  prefill's own layers) decodes them in waves of as many rows as fit, and a wave that meets CUDA's out-of-memory
  error is run again as two halves. Every row's uniform numbers for the inverse-CDF draw are drawn at the start of
  the call, so a seed samples the same tokens in any waves; one row too big for the memory is a clear error.

On CUDA the first `WARMUP_STEPS` steps run eagerly (on a side stream, as capturing requires), the next is
captured (`torch.cuda.CUDAGraph`) and replayed for the rest; the graph is recorded again each call, since
the call's buffers are new. Elsewhere the same step runs eagerly, which is how the CPU tests check it.

With `compile_step` (GRPOConfig.compile_decode_step; unset, on CUDA) the step's layer and its sampling are
`torch.compile`d (inductor, each one whole graph; `compiled_regions`) before the step is captured: a replayed graph
still runs one kernel per operator, a few microseconds each, and the compiled regions fuse the norms, RoPE, casts
and sampling's elementwise passes around the products. One compiled layer serves all of a model's layers. The first
call compiles (once per process, sampling setting and shape: the graphs hold the sampling fields as constants, and
each prompt bucket and row count is a static graph of its own, up to `MAX_COMPILED_SHAPES`). Products then take
`F.linear` (no packed CPU weights). Measured on an H200 (docs/benchmarks-gpu.md, 2026-11-30): the 0.5B case's decode
step 1.67 ms against 2.29 eager, its GRPO step 0.86 s against 1.07, its first step 9 s longer (the compile).

Models: the step is the model's own forward (model_step.ModelStep) for every model type whose forward decodes over
the static cache, and the hand-written fused_step.FusedDecoder for the rows of fused_step.FAMILIES that keep it here
(`step_choice`);
either is admitted once its steps compute as the forward on the model's fp32 twin (decode_probe.py), whatever the
dtype. Mixture-of-experts layers run without host syncs while captured (`capturable_experts`); a vision-language
model's text-only prompts are served (its prompts with images go to `fallback`); a quantized (QLoRA) layer keeps its
own forward.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.utils import logging

from grouprl.core.types import Completion, SamplingParams
from grouprl.generation import decode_probe
from grouprl.generation.engine import in_process_sampler_reason
from grouprl.generation.fused_step import FusedDecoder, family_of, structure_reason
from grouprl.generation.model_step import ModelStep, model_step_reason
from grouprl.generation.protocol import GenerationBackend, cut_at_eos, left_pad
from grouprl.generation.sampling import SAMPLING_METHODS, sample_next
from grouprl.generation.static_kv_cache import StaticKVCache, bytes_per_row, column_count, repeated
from grouprl.model.adapters import base_model
from grouprl.model.forward import cache_keyword
from grouprl.model.logprobs import position_ids_from_mask
from grouprl.model.patches import grouprl_patches

logger = logging.get_logger("grouprl")

PROMPT_BUCKET = 64
CHECK_EVERY = 16  # decode steps between the host's reads of "has every row finished?"
WARMUP_STEPS = 2  # eager steps before capturing (lazy initialisations in the kernels' libraries happen there)
DECODE_STEPS = ("model", "fused")  # CapturedGenerator(decode_step=...): None picks by fused_step.FAMILIES' gpu column
MAX_COMPILED_SHAPES = 64  # compiled step's graphs a process may hold (dynamo's default limit is 8)
MEMORY_HEADROOM = 0.9  # the share of the free memory a call's waves plan to fill
# a row's transient copies of its logits while a token is sampled (fp32 logits, processed and probabilities, top-p's
# sort with its int64 order and cumulative sum, the repetition penalty's counts): bytes per vocabulary entry
SAMPLING_BYTES_PER_TOKEN = 48


def captured_supports(
    model: torch.nn.Module,
    generation_kwargs: dict,
    cache_implementation: Optional[str],
    decode_step: Optional[str] = None,
) -> Optional[str]:
    """None if CapturedGenerator can serve this model and options, else the reason it cannot. A vision-language
    model is served for its text-only prompts if its language model is (prompts with images: its `fallback`)."""
    reason = in_process_sampler_reason(model, generation_kwargs, cache_implementation, text_of_vision_language=True)
    return reason or step_choice(model, decode_step)[1]


def step_choice(model: torch.nn.Module, requested: Optional[str] = None) -> tuple[str, Optional[str]]:
    """The decode step the loop runs `model` with ('model': its own forward, ModelStep; 'fused': FusedDecoder), and
    None, or the reason it cannot run it. `requested` None: 'fused' for the model types whose row of
    fused_step.FAMILIES keeps it for this loop (its `gpu` column) and whose structure it runs, else 'model'. Either is
    admitted only once its steps computed as the forward on the model's fp32 twin (decode_probe.verdict), whatever
    the model's dtype."""
    base = base_model(model)
    family = family_of(base)[1]
    fused_candidate = requested == "fused" or (requested is None and family is not None and family.gpu is not None)
    structure = structure_reason(base) if fused_candidate else None
    kind = requested or ("fused" if fused_candidate and structure is None else "model")
    if kind == "fused":
        return kind, structure or decode_probe.verdict(base, kind, FusedDecoder)
    reason = model_step_reason(base) or model_rope_reason(base)
    return kind, reason or decode_probe.verdict(base, kind, ModelStep)


def model_rope_reason(model: torch.nn.Module) -> Optional[str]:
    """Why ModelStep cannot be captured for this model's RoPE: one that reads the batch's largest position on the
    host at every step (transformers' dynamic_rope_update, for 'dynamic' and 'longrope')."""
    for module in model.modules():
        rope = getattr(module, "rope_type", None) if "Rotary" in type(module).__name__ else None
        for kind in rope.values() if isinstance(rope, dict) else [rope]:
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                return f"its RoPE ({kind!r}) reads the batch's largest position on the host at every step"
    return None


def bucketed(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


class DecodeLoop:
    """The state of one call's decode steps, all on the device and updated in place by `step` (module doc)."""

    def __init__(
        self,
        decoder: FusedDecoder | ModelStep,
        cache: StaticKVCache,
        prompt_tokens: torch.Tensor,  # (rows, prompt columns), left-padded
        first: torch.Tensor,  # (rows,) the tokens sampled from the prefill's logits
        first_logprobs: torch.Tensor,
        positions: torch.Tensor,  # (rows,) the position of `first`
        params: SamplingParams,
        eos: torch.Tensor,
        pad_token_id: int,
        sampling_method: str,
        compiled: bool = False,
        suppressed: torch.Tensor | None = None,  # token ids never sampled (a vision-language model's placeholders)
        uniforms: torch.Tensor | None = None,  # (rows, new tokens) float64: the inverse-CDF draws' numbers
    ):
        self.decoder, self.cache, self.params, self.eos = decoder, cache, params, eos
        self.suppressed, self.uniforms = suppressed, uniforms
        self.pad_token_id, self.sampling_method = pad_token_id, sampling_method
        self.min_new_tokens = int(params.extra.get("min_new_tokens", 0))
        rows, new_tokens, device = first.shape[0], params.max_new_tokens, first.device
        self.tokens, self.positions = first.clone(), positions.clone()
        self.done = is_eos(first, eos)
        self.step_index = torch.ones(1, dtype=torch.long, device=device)  # the new token this step samples
        self.out_tokens = torch.full((rows, new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(rows, new_tokens, device=device)
        self.out_tokens[:, 0], self.out_logprobs[:, 0] = first, first_logprobs
        self.history = torch.full_like(cache.valid, pad_token_id, dtype=torch.long)  # the token of each column
        self.history[:, : prompt_tokens.shape[1]] = prompt_tokens
        self.record_step = type(self).record  # (self, logits); compiled, its compiled twin, and the decoder's layer
        if compiled and isinstance(decoder, FusedDecoder):
            decoder.layer_step, self.record_step = compiled_regions()
        elif compiled:
            decoder.forward, self.record_step = compiled_model_step()

    def step(self) -> None:
        """Feed the last sampled tokens, sample the next ones; no host sync."""
        cache = self.cache
        cache.open_column()
        self.history.index_copy_(1, cache.column, self.tokens[:, None])
        self.record_step(self, self.decoder.step(self.tokens, self.positions, cache))

    def record(self, logits: torch.Tensor) -> None:
        """Sample the next tokens from the step's logits and record them, their logprobs and finished rows."""
        cache = self.cache
        if self.suppressed is not None:
            logits = logits.index_fill(1, self.suppressed, -float("inf"))
        if self.min_new_tokens:
            blocked = logits.index_fill(1, self.eos, -float("inf"))
            logits = torch.where(self.step_index < self.min_new_tokens, blocked, logits)
        uniforms = None if self.uniforms is None else self.uniforms.index_select(1, self.step_index)
        tokens, logprobs = sample_next(logits, self.params, self.history, cache.valid, self.sampling_method, uniforms)
        tokens = torch.where(self.done, self.pad_token_id, tokens)
        self.out_tokens.index_copy_(1, self.step_index, tokens[:, None])
        self.out_logprobs.index_copy_(1, self.step_index, logprobs[:, None].float())
        self.done |= is_eos(tokens, self.eos)
        self.tokens.copy_(tokens)
        self.positions.add_(1)
        self.step_index.add_(1)
        cache.column.add_(1)


def random_states() -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def restore_random_states(states: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(states[0])
    if states[1]:
        torch.cuda.set_rng_state_all(states[1])


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    return (tokens[:, None] == eos[None, :]).any(dim=1)


def compiles_by_default(device: torch.device) -> bool:
    """Where compile_decode_step, left unset, compiles the step: CUDA, where it was measured faster (module doc). A
    CPU compiles only when asked: inductor's C++ build takes seconds a shape there and needs a compiler."""
    return device.type == "cuda"


@functools.cache
def compiled_regions() -> tuple[Callable[..., Any], Callable[..., None]]:
    """`FusedDecoder._layer` and `DecodeLoop.record` compiled by inductor, each one whole graph (module doc), shared by
    every call of the process, so a shape compiles once. A layer is compiled once for all of a model's layers (a
    graph for the first, which has no previous MLP output to add, and one for the others), not unrolled in a graph
    of the whole step: on this project's 2-core CPU a graph of the whole step took 17.9 s to compile for 24 layers
    (4.7 s for 2), the compiled layer 4.8 s for 24. A region torch.compile cannot compile raises `StepCompileError`."""
    # Static shapes: a dynamic recompile's guards failed to build on CUDA (torch 2.11, "list index out of range"
    # for a size symbol inductor's 32-bit indexing check introduced), and a replayed graph needs fixed shapes anyway.
    # a layer: the first (no previous MLP output to add), the others, and another kind besides (Gemma 3's sliding
    # layers, Qwen3-MoE's dense ones)
    return _reporting(FusedDecoder._layer, graphs_per_shape=3), _reporting(DecodeLoop.record, graphs_per_shape=1)


@functools.cache
def compiled_model_step() -> tuple[Callable[..., Any], Callable[..., None]]:
    """ModelStep's forward and `DecodeLoop.record` compiled by inductor, each one whole graph, shared by every call
    of the process (`compiled_regions`' rules); the forward unrolls the model's layers in one graph."""
    return _reporting(ModelStep._forward, graphs_per_shape=1), _reporting(DecodeLoop.record, graphs_per_shape=1)


def _reporting(function: Callable[..., Any], graphs_per_shape: int) -> Callable[..., Any]:
    compiled = torch.compile(function, fullgraph=True, dynamic=False)

    def run(*args: Any) -> Any:
        try:
            # each prompt bucket and row count is a graph of its own: allow a run that many before dynamo's limit
            with torch._dynamo.config.patch(recompile_limit=graphs_per_shape * MAX_COMPILED_SHAPES):
                return compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as err:
            raise StepCompileError(f"{type(err).__name__}: {str(err).strip()[:500]}") from err

    return run


class StepCompileError(RuntimeError):
    """torch.compile could not compile the decode step; `reason` says why. Asked for (compile_decode_step=True) it stops
    the run; by default (unset) the loop warns and runs the step as written from then on."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"GRPOConfig.compile_decode_step=True: torch.compile could not compile the captured loop's decode step "
            f"({reason}). Set compile_decode_step=False to run the step as written."
        )


@contextlib.contextmanager
def capturable_experts(model: torch.nn.Module, capture: bool, dtype: torch.dtype) -> Iterator[None]:
    """While decode steps are recorded as a CUDA graph, a mixture-of-experts model's experts run an implementation of
    transformers' that never syncs with the host: its eager one reads which experts the batch hit (a capture cannot
    hold that). `grouped_mm` where they multiply in bf16 (`dtype`; torch's grouped_mm reads its offsets on the host
    in any other dtype), else `batched_mm`, which copies the weights of every expert each row picked."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "is_transposed") and hasattr(m, "config")}
    previous = {key: config._experts_implementation for key, config in configs.items()}
    try:
        for config in configs.values() if capture else ():
            config._experts_implementation = "grouped_mm" if dtype == torch.bfloat16 else "batched_mm"
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation = previous[key]


@functools.cache
def capture_stream(device: int) -> "torch.cuda.Stream":
    """The one side stream on which every call warms up and records its step. cuBLAS keeps a workspace (32 MiB on
    Hopper) for each stream it ran on, for the process's life: a new `torch.cuda.Stream()` a call cycles through
    CUDA's pool of 32 streams, so calls left up to 32 such workspaces allocated (~1 GB; an H200 profile's second
    step held three, 99 MiB, one for each generation call so far)."""
    return torch.cuda.Stream(device=device)


def run_steps(loop: DecodeLoop, steps: int, capture: bool) -> int:
    """Run `steps` decode steps (fewer once every row has finished); returns how many ran. With `capture`, the
    steps after the warm-up replay one recorded CUDA graph."""
    ran, step = 0, loop.step
    if capture and steps > WARMUP_STEPS:
        side = capture_stream(torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        ran = WARMUP_STEPS
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):  # records without running
            step()
        step = graph.replay
    while ran < steps:
        if ran % CHECK_EVERY == 0 and bool(loop.done.all()):
            break
        step()
        ran += 1
    return ran


class WaveCall(NamedTuple):
    """What every wave of a call shares: the prefill of all its prompts and each row's first token."""

    decoder: FusedDecoder | ModelStep
    prefill: DynamicCache
    prompt_mask: torch.Tensor  # (prompts, prompt columns)
    prompt_of_row: torch.Tensor  # (rows,)
    prompt_tokens: torch.Tensor  # (rows, prompt columns)
    first: torch.Tensor  # (rows,) the tokens sampled from the prefill's logits
    first_logprobs: torch.Tensor
    positions: torch.Tensor  # (rows,) the position of `first`
    uniforms: torch.Tensor | None  # (rows, new tokens): the inverse-CDF draws' numbers
    eos: torch.Tensor
    kind: str  # step_choice's
    compiled: bool
    params: SamplingParams


def free_memory(device: torch.device) -> Optional[int]:
    """The bytes a call may still allocate on `device`: CUDA's free memory and what torch's allocator holds unused;
    a Linux host's MemAvailable; None where neither is known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def loop_bytes_per_row(model: torch.nn.Module, prompt_columns: int, new_tokens: int) -> int:
    """The bytes one row of a DecodeLoop holds besides its cache: the token history and the results, and while a
    step runs, the sampling's copies of its logits and the attention's scores (materialised by the math kernels)."""
    columns = column_count(prompt_columns, new_tokens)
    config = model.config.get_text_config()
    vocab = model.get_input_embeddings().weight.shape[0]
    heads = getattr(config, "num_attention_heads", None) or 1
    return columns * 8 + new_tokens * 12 + vocab * SAMPLING_BYTES_PER_TOKEN + heads * columns * 8


def one_row_too_big(
    row_bytes: int, budget: Optional[int], prompt_columns: int, new_tokens: int, device: torch.device
) -> ValueError:
    free = "too little" if budget is None else f"{budget / 2**30:.2f} GiB"
    return ValueError(
        f"CapturedGenerator: one row of {prompt_columns} prompt columns and {new_tokens} new tokens needs "
        f"{row_bytes / 2**30:.2f} GiB of static cache and sampling buffers, and {free} is free on {device}. "
        "Lower max_completion_length or shorten the prompts, free device memory (gradient checkpointing, a "
        "smaller batch), or sample with generation_engine='transformers' or vLLM."
    )


class CapturedGenerator:
    """A `GenerationBackend` that samples from the training model in this process through the static decode loop
    (module doc): replayed as a CUDA graph on CUDA, eager elsewhere.

    A vision-language model's text-only prompts run through its language model here, its placeholder tokens
    (`suppress_token_ids`) never sampled, as transformers generate is told. A call the loop cannot serve goes to
    `fallback` (transformers generate; `served_reason`): one with images.

    `decode_step`: 'model' (the model's own forward, ModelStep), 'fused' (FusedDecoder) or None (`step_choice`: the
    fused step where its row of fused_step.FAMILIES keeps it here, else the model's).

    `compile_step`: True compiles the step (module doc) on any device and stops on a compile error; None (the
    trainer's default) compiles on CUDA and, should the compile fail, warns once and runs the step as written.

    `memory_budget`: the bytes a call's static caches may take (None: the device's free memory at the call,
    `free_memory`). A call whose rows do not fit decodes them in waves (module doc).
    """

    needs_importance_correction = False  # samples come from the trained weights themselves

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        eos_token_ids: list[int],
        pad_token_id: int,
        *,
        prompt_bucket: int = PROMPT_BUCKET,
        capture: Optional[bool] = None,
        sampling_method: str = "inverse_cdf",
        compile_step: Optional[bool] = False,
        suppress_token_ids: Sequence[int] = (),
        fallback: Optional[GenerationBackend] = None,
        decode_step: Optional[str] = None,
        memory_budget: Optional[int] = None,
    ):
        if decode_step not in (None, *DECODE_STEPS):
            raise ValueError(
                f"CapturedGenerator: decode_step must be one of {DECODE_STEPS} or None, got {decode_step!r}."
            )
        if sampling_method not in SAMPLING_METHODS:
            raise ValueError(
                f"CapturedGenerator: sampling_method must be one of {SAMPLING_METHODS}, got {sampling_method!r}."
            )
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.prompt_bucket, self.capture, self.sampling_method = prompt_bucket, capture, sampling_method
        self.compile_step, self.decode_step = compile_step, decode_step
        self.suppress_token_ids, self.fallback = list(suppress_token_ids), fallback
        self.memory_budget = memory_budget
        self._wave_plans: set[tuple[int, int]] = set()  # (rows, rows a wave) logged
        self.last_decode = (0, 0.0)  # (decode steps, seconds) of the last call, for benchmarks
        self.compile_seconds = 0.0  # spent compiling new shapes since the last `report`
        self._fell_back: set[str] = set()  # reasons already logged
        self._compiled_shapes: set[tuple] = set()  # (step, prompt bucket, rows, sampling) compiled in this process
        self._step: Optional[tuple[torch.nn.Module, str, Optional[str]]] = None  # (model, step_choice's answer)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model
        if self.fallback is not None:
            self.fallback.sync_weights(model)

    def step_choice(self) -> tuple[str, Optional[str]]:
        """`step_choice` for the model sampled from, asked once per model (its structure does not change with its
        weights; the admission probe sets attention implementations, which a call should not pay for)."""
        if self._step is None or self._step[0] is not self.model:
            self._step = (self.model, *step_choice(self.model, self.decode_step))
        return self._step[1], self._step[2]

    def served_reason(
        self, prompt_ids: list[list[int]], params: SamplingParams, multimodal: list[Any] | None = None
    ) -> Optional[str]:
        """None if the loop serves this call, else why it goes to `fallback`."""
        if multimodal is not None and any(m is not None for m in multimodal):
            return "prompts with images are sampled by transformers generate"
        return None

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams, multimodal: list[Any] | None = None
    ) -> list[Completion]:
        """`multimodal`: (prompts,) each prompt's images or None. A call the loop cannot serve goes to `fallback`
        (`served_reason`), said once a reason."""
        reason = self.served_reason(prompt_ids, params, multimodal)
        if reason is not None:
            if self.fallback is None:
                raise ValueError(f"CapturedGenerator cannot sample this call: {reason}; and it has no fallback.")
            if reason not in self._fell_back:
                logger.info(f"grouprl: the captured decode loop passes a call to transformers generate: {reason}.")
                self._fell_back.add(reason)
            extra = {} if multimodal is None else {"multimodal": multimodal}
            return self.fallback.generate(prompt_ids, num_samples, params, **extra)
        unsupported = set(params.extra) - {"min_new_tokens"}
        if unsupported:
            raise ValueError(
                f"CapturedGenerator does not support generation_kwargs {sorted(unsupported)}; use "
                "generation_engine='transformers'."
            )
        if not prompt_ids:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            with grouprl_patches(self.model):
                seeds = random_states() if self.compile_step is None else None
                try:
                    tokens, logprobs = self._sample(prompt_ids, num_samples, params)
                except StepCompileError as err:
                    if seeds is None:
                        raise
                    logger.warning(
                        f"grouprl: the captured loop could not compile its decode step ({err.reason}); it runs the "
                        "step as written from now on. Set compile_decode_step=False to skip the attempt."
                    )
                    self.compile_step = False
                    restore_random_states(seeds)  # a seeded run samples as if it had never tried
                    tokens, logprobs = self._sample(prompt_ids, num_samples, params)
        finally:
            self.model.train(was_training)
        eos = set(self.eos_token_ids)
        completions = []
        for row, (ids, lps) in enumerate(zip(tokens, logprobs)):
            ids, finish = cut_at_eos(ids, eos)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completions.append(Completion(row // num_samples, ids, text, finish, lps[: len(ids)]))
        return completions

    def _sample(
        self, prompt_ids: list[list[int]], g: int, params: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]]]:
        base = base_model(self.model)
        device = base.get_input_embeddings().weight.device
        ids, mask = left_pad(prompt_ids, self.pad_token_id)
        width = bucketed(ids.shape[1], self.prompt_bucket)
        ids = F.pad(ids, (width - ids.shape[1], 0), value=self.pad_token_id).to(device)
        mask = F.pad(mask, (width - mask.shape[1], 0), value=0).to(device)
        prefill = DynamicCache(config=base.config)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            **{cache_keyword(self.model): prefill},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        compiled = compiles_by_default(device) if self.compile_step is None else self.compile_step
        kind, reason = self.step_choice()
        if reason is not None:
            raise ValueError(f"CapturedGenerator cannot run the {kind!r} decode step for this model: {reason}.")
        step_class = FusedDecoder if kind == "fused" else ModelStep
        decoder = step_class(base, pack=not compiled)  # the weights as they are now; in place where no cast
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        logits = logits.repeat_interleave(g, 0)
        if self.suppress_token_ids:
            logits = logits.index_fill(1, self.suppressed(device), -float("inf"))
        if params.extra.get("min_new_tokens", 0) > 0:
            logits = logits.index_fill(1, eos, -float("inf"))
        rows = len(logits)
        # a uniform number for every row's every token, drawn at once: a row samples the same tokens in any wave
        uniforms = None
        if self.sampling_method == "inverse_cdf":
            uniforms = torch.rand(rows, params.max_new_tokens, dtype=torch.float64, device=device)
        prompt_tokens = ids.repeat_interleave(g, 0)
        first, first_logprobs = sample_next(
            logits,
            params,
            prompt_tokens,
            mask.bool().repeat_interleave(g, 0),
            self.sampling_method,
            None if uniforms is None else uniforms[:, :1],
        )
        del logits
        call = WaveCall(
            decoder,
            prefill,
            mask,
            repeated(len(prompt_ids), g, device),
            prompt_tokens,
            first,
            first_logprobs,
            mask.sum(dim=1).repeat_interleave(g, 0),
            uniforms,
            eos,
            kind,
            compiled,
            params,
        )
        capture = device.type == "cuda" if self.capture is None else self.capture
        # every position a row reaches is below the longest prompt + new tokens
        longest = max(map(len, prompt_ids)) + params.max_new_tokens
        with decoder.active(longest), capturable_experts(base, capture, decoder.dtype):
            return self._decode_in_waves(call, capture)

    def suppressed(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.suppress_token_ids, dtype=torch.long, device=device)

    def _decode_in_waves(self, call: "WaveCall", capture: bool) -> tuple[list[list[int]], list[list[float]]]:
        """The call's rows decoded in waves of as many rows as the free memory holds (all of them, where it holds
        them); a wave that meets CUDA's out-of-memory error is run again as two. Each row's numbers were drawn for
        it (`uniforms`), so the waves sample the tokens one pass would."""
        rows, params = len(call.first), call.params
        width = call.prompt_mask.shape[1]
        row_bytes = bytes_per_row(
            call.prefill, width, params.max_new_tokens, call.decoder.dtype, call.decoder.windows
        ) + loop_bytes_per_row(base_model(self.model), width, params.max_new_tokens)
        budget = self.memory_budget if self.memory_budget is not None else free_memory(call.first.device)
        size = rows if budget is None else min(rows, int(budget * MEMORY_HEADROOM) // row_bytes)
        if size < 1:
            raise one_row_too_big(row_bytes, budget, width, params.max_new_tokens, call.first.device)
        if size < rows and (rows, size) not in self._wave_plans:
            self._wave_plans.add((rows, size))
            logger.info(
                f"grouprl: the captured loop decodes {rows} rows in waves of {size}: a row's static cache and "
                f"sampling buffers take {row_bytes / 2**20:.1f} MiB ({width} prompt columns + "
                f"{params.max_new_tokens} new tokens), and the call may take {budget / 2**30:.2f} GiB "
                f"({'memory_budget' if self.memory_budget is not None else 'the free memory'})."
            )
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        steps, seconds, start = 0, 0.0, 0
        while start < rows:
            wave = slice(start, min(rows, start + size))
            try:
                wave_tokens, wave_logprobs, ran, took = self._decode_wave(call, wave, capture)
            except torch.OutOfMemoryError as err:
                if size == 1:
                    raise one_row_too_big(row_bytes, budget, width, params.max_new_tokens, call.first.device) from err
                wave_tokens = None  # the failed wave's tensors are freed before it runs again
            if wave_tokens is None:
                size = -(-size // 2)
                logger.warning(
                    f"grouprl: the captured loop ran out of device memory decoding {wave.stop - wave.start} rows at "
                    f"once; it decodes waves of {size} from here on in this call."
                )
                continue
            tokens += wave_tokens
            logprobs += wave_logprobs
            steps, seconds, start = steps + ran, seconds + took, wave.stop
        self.last_decode = (steps, seconds)  # the compiling steps apart
        return tokens, logprobs

    def _decode_wave(
        self, call: "WaveCall", wave: slice, capture: bool
    ) -> tuple[list[list[int]], list[list[float]], int, float]:
        """Rows `wave` of the call decoded to the end: (tokens, logprobs, decode steps, their seconds)."""
        params, decoder = call.params, call.decoder
        cache = StaticKVCache(
            call.prefill,
            call.prompt_mask,
            call.prompt_of_row[wave],
            params.max_new_tokens,
            decoder.dtype,
            decoder.windows,
        )
        device = call.first.device
        loop = DecodeLoop(
            decoder,
            cache,
            call.prompt_tokens[wave],
            call.first[wave],
            call.first_logprobs[wave],
            call.positions[wave],
            params,
            call.eos,
            self.pad_token_id,
            self.sampling_method,
            compiled=call.compiled,
            suppressed=self.suppressed(device) if self.suppress_token_ids else None,
            uniforms=None if call.uniforms is None else call.uniforms[wave],
        )
        rows = wave.stop - wave.start
        shape = (call.kind, call.prompt_mask.shape[1], rows, repr(params))
        compiles = call.compiled and shape not in self._compiled_shapes and params.max_new_tokens > 1
        if compiles:  # a new shape's first step compiles it: timed apart from the steps (a metric, and said)
            started = time.perf_counter()
            loop.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self._compiled_shapes.add(shape)
            seconds = time.perf_counter() - started
            self.compile_seconds += seconds
            logger.info(
                f"grouprl: the captured loop compiled its {call.kind!r} decode step for {rows} rows of "
                f"{shape[1]}-token prompts in {seconds:.1f} s (compiled shape {len(self._compiled_shapes)} of at "
                f"most {MAX_COMPILED_SHAPES})."
            )
        started = time.perf_counter()
        ran = run_steps(loop, params.max_new_tokens - 1 - compiles, capture)
        tokens, logprobs = loop.out_tokens.tolist(), loop.out_logprobs.tolist()  # the one read of the results
        return tokens, logprobs, ran, time.perf_counter() - started

    def report(self) -> dict[str, float]:
        """The generation/* statistics since the last report: seconds spent compiling new shapes of the step, and the
        compiled shapes this sampler holds (none while it compiles nothing)."""
        if not self._compiled_shapes:
            return {}
        seconds, self.compile_seconds = self.compile_seconds, 0.0
        return {"compile_s": seconds, "compiled_graphs": float(len(self._compiled_shapes))}
