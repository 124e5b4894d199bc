"""Whether a decode step computes as the model's forward: measured on a twin of the model, not trusted by name.

`twin(model)` builds `type(model)` (a vision-language model: the causal LM of its text config) from its config shrunk
to a few layers (one of each layer type, at least 2), a small vocabulary, narrow MLPs, at most 4 experts and sliding
windows / attention chunks of `WINDOW` tokens (so that a probe's sequences slide past them), in fp32 with random
weights. `step_gap(model, make_step, positions)` decodes `positions` tokens a row with the step `make_step` builds,
over the static cache the loop uses (4 rows: 2 left-padded prompts, 2 samples each), and compares every position's
log-probabilities with one full forward of the whole sequences: the largest gap in nats over the vocabulary.

`verdict(model, kind, make_step)` is what admission reads: the twin's gap within `TOLERANCE` over `POSITIONS`, decided
once per model class and config. In fp32 the step differs from the forward by summation order only (~1e-7 nats on
the tests' models); a RoPE off by one position, a norm weight 1% off or a window one too wide moves it by 1e-3 and
more (tests/test_model_step.py plants each). Lower-precision weights are judged by their fp32 twin, where rounding
cannot hide a different computation; their run-time gap is the sampler-vs-trainer statistic every run logs.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

from grouprl.generation.static_kv_cache import StaticKVCache, repeated
from grouprl.model.forward import cache_keyword, describe, is_unsupported
from grouprl.model.layer_configs import layer_kinds
from grouprl.model.logprobs import position_ids_from_mask

POSITIONS = 40  # decode steps a row at admission (tests: 128)
TOLERANCE = 1e-4  # nats, fp32
WINDOW = 8  # a twin's sliding window / attention chunk, so that the probe's sequences pass it
VOCAB = 256
WIDTH = 64  # a twin's MLP and experts' widths
EXPERTS = 4
PROMPT = 6  # a probe prompt's tokens (the first row's 2 of them padding)
SAMPLES = 2

_VERDICTS: dict[tuple[str, str, str], Optional[str]] = {}


def twin(model: torch.nn.Module, *, seed: int = 0) -> torch.nn.Module:
    """`type(model)` from its config shrunk (module doc), fp32, random weights, in eval mode, on the model's device."""
    config = copy.deepcopy(model.config)
    text = config.get_text_config()
    if text is config:
        cls = type(model)
    elif type(text) in AutoModelForCausalLM._model_mapping:
        cls = AutoModelForCausalLM._model_mapping[type(text)]
    else:
        raise NotImplementedError(f"no causal LM of its text config ({type(text).__name__}) to build a twin from")
    shrink(text)
    device = model.get_input_embeddings().weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        built = cls(text).to(device=device, dtype=torch.float32)
    return built.eval()


def shrink(config: Any) -> None:
    """A text config made tiny in place, keeping what makes it its family (module doc)."""
    kinds = layer_kinds(config)
    keep = sorted({kinds.index(kind) for kind in kinds} | {0, 1}) if len(kinds) > 1 else [0]
    if getattr(config, "layer_types", None):
        config.layer_types = [kinds[i] for i in keep]
    config.num_hidden_layers = len(keep)
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, min(getattr(config, name), WIDTH))
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, min(getattr(config, name), EXPERTS))
    for name in ("num_experts_per_tok", "moe_topk", "top_k"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, min(getattr(config, name), 2))
    for name in ("sliding_window", "attention_chunk_size"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, min(getattr(config, name), WINDOW))
    config.vocab_size = min(config.vocab_size, VOCAB)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= config.vocab_size or isinstance(value, list):
            setattr(config, name, 0)


def step_gap(
    model: torch.nn.Module, make_step: Callable[[torch.nn.Module], Any], positions: int = POSITIONS, seed: int = 0
) -> float:
    """The largest gap, in nats, between the log-probabilities `make_step(model)`'s decode steps give at each of
    `positions` steps and those of one forward over the whole sequences (module doc). Raises what the step raises."""
    got, want = step_logprobs(model, make_step, positions, seed)
    return float((got - want).abs().max())


@torch.no_grad()
def step_logprobs(
    model: torch.nn.Module, make_step: Callable[[torch.nn.Module], Any], positions: int = POSITIONS, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the steps', the forward's) fp32 log-probabilities, each (rows, positions, vocab), for `step_gap`; under the
    caller's autocast, if any."""
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(vocab, (2, PROMPT), generator=generator).to(device)
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    fed = torch.randint(vocab, (2 * SAMPLES, positions), generator=generator).to(device)
    forward = functools.partial(type(model).forward, model)  # the class's: accelerate's wrapper would autocast
    prefill = DynamicCache(config=model.config)
    forward(
        input_ids=prompts,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=True,
        **{cache_keyword(model): prefill},
    )
    step = make_step(model)
    cache = StaticKVCache(prefill, mask, repeated(2, SAMPLES, device), positions, step.dtype, step.windows)
    start = mask.sum(dim=1).repeat_interleave(SAMPLES, 0)
    logits = []
    with step.active(PROMPT + positions):
        for index in range(positions):
            cache.open_column()
            logits.append(step.step(fed[:, index], start + index, cache))
            cache.column.add_(1)
    got = torch.stack(logits, dim=1).float().log_softmax(-1)
    rows_mask = F.pad(mask.repeat_interleave(SAMPLES, 0), (0, positions), value=1)
    ids = torch.cat([prompts.repeat_interleave(SAMPLES, 0), fed], dim=1)
    full = forward(input_ids=ids, attention_mask=rows_mask, position_ids=position_ids_from_mask(rows_mask)).logits
    return got, full[:, PROMPT:].float().log_softmax(-1)


def verdict(
    model: torch.nn.Module, kind: str, make_step: Callable[[torch.nn.Module], Any], positions: int = POSITIONS
) -> Optional[str]:
    """None if `make_step`'s steps compute as the forward on `model`'s fp32 twin over `positions` steps (module
    doc), else why not; decided once per model class, config and step kind."""
    key = (type(model).__qualname__, model.config.to_json_string(use_diff=False), kind)
    if key not in _VERDICTS:
        device = model.get_input_embeddings().weight.device
        try:
            with torch.autocast(device.type, enabled=False):  # fp32: asked inside a bf16-autocast generation too
                gap = step_gap(twin(model), make_step, positions)
        except Exception as err:
            if not is_unsupported(err) and not isinstance(err, (AttributeError, KeyError)):
                raise
            _VERDICTS[key] = f"its fp32 twin's {kind} step failed: {describe(err)[:300]}"
        else:
            _VERDICTS[key] = (
                None
                if gap <= TOLERANCE
                else f"its fp32 twin's {kind} step differs from its forward by {gap:.3g} nats (allowed {TOLERANCE:g})"
            )
    return _VERDICTS[key]
