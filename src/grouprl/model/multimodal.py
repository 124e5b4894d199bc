"""Vision-language models: the processor's outputs per prompt, and their batching into model inputs.

(Reading image prompts from a dataset and running them through the processor is
`multimodal_prompts.py`; this module is what the model passes need, and imports no data code.)

Data (TRL 1.16): a row's images are its ``images`` column (a list) or its ``image`` column (one
image); the prompt must be conversational. Images become ``{"type": "image"}`` blocks placed before
the text of the first user message whose content is a string (or fill the image blocks the
messages already have, in order). The model's processor (``ProcessorMixin``) renders the chat
template and processes the images once per prompt. Its outputs other than the token ids are kept
per prompt in a `PromptImages`, split in two kinds:

- *per-token* fields (``mm_token_type_ids``, ``token_type_ids``): one value per prompt token;
  they are left-padded exactly like the prompt ids and extended with zeros over the completion,
  so an image token and its type never come apart (TRL 1.4 padded them on opposite sides,
  user-pain-points row 39);
- *per-image* fields (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...): concatenated
  along their first dimension in row order, which is how a processor batches them.

Rows carry their own `PromptImages` through generation, scoring and every logprob pass, and any
chunk of rows is collated on the spot (`collate`), so no pixel tensor ever has to be split by
image counts. Models with multimodal rotary positions (M-RoPE: Qwen2-VL, Qwen2.5-VL, ...) compute
their positions from the image grids and the attention mask themselves; every other model gets
positions counted over real tokens, as for text.

On several processes the processes must run the same modules: on sharded weights (FSDP2, DeepSpeed ZeRO-3) every
forward gathers the weights of each module it runs from every process, and under DDP every backward reduces the
gradients of each trained module's parameters. A forward whose rows have no image skips the vision tower, so a
process whose rows have none would wait forever for the others' vision-tower gathers, or pair its collectives with
the wrong module's and abort. Such a forward carries one more row, a `VisionProbe` (a prompt with one blank image,
encoded by the processor when the trainer is built), whose outputs are dropped and whose logprobs join the graph
times zero, so its backward gives the vision tower (zero) gradients and runs their reductions too (the model's
PROBE_ATTRIBUTE, read by model/logprobs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch


@dataclass
class PromptImages:
    """The processor's outputs for one prompt, besides its token ids."""

    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (P,), aligned with the prompt ids
    per_image: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (images or patches, ...)
    # For engines that process images themselves (vLLM): the prompt's images as given, and its token ids with each
    # image still the chat template's placeholder (the engine expands it, as the processor did for the prompt ids,
    # which are `expanded_length` long).
    images: list[Any] = field(default_factory=list)
    placeholder_ids: list[int] = field(default_factory=list)
    expanded_length: int = 0
    # Tool results with images (agents/multiturn.py) put image tokens in the completion: their per-token values over
    # the completion's first tokens (zeros past them); their images follow the prompt's in `per_image` and `images`.
    completion_per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (C,)

    def __setstate__(self, state: dict) -> None:
        """Unpickled from a checkpoint (its pending micro-batches) written before a field existed: that field's
        default, so such a checkpoint still resumes."""
        missing = [f for f in fields(self) if f.name not in state]
        self.__dict__.update({f.name: f.default if f.default is not MISSING else f.default_factory() for f in missing})
        self.__dict__.update(state)


@dataclass
class VisionProbe:
    """One prompt with one image: the extra row of a forward without images on several processes (module doc)."""

    prompt_ids: list[int]
    images: PromptImages


PROBE_ATTRIBUTE = "grouprl_vision_probe"


def set_vision_probe(model: torch.nn.Module, probe: VisionProbe) -> None:
    """Give a vision-language model its probe (on the module a DeepSpeed engine or DDP wraps, too)."""
    for module in (model, getattr(model, "module", None)):
        if module is not None:
            setattr(module, PROBE_ATTRIBUTE, probe)


def is_processor(processing_class: Any) -> bool:
    from transformers import ProcessorMixin

    return isinstance(processing_class, ProcessorMixin)


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer inside a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def is_vision_language_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def image_token_ids(config: Any) -> list[int]:
    """Placeholder ids the sampler must never emit: a sampled one would have no image features behind it."""
    return [
        i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)) if i is not None
    ]


def collate(inputs: Sequence[PromptImages | None], prompt_width: int, total_width: int) -> dict[str, torch.Tensor]:
    """Model inputs for rows whose prompts are left-padded to `prompt_width` inside sequences of `total_width`.

    Per-token fields end where each row's prompt ends (column prompt_width - 1), and their completion values (tool
    results with images) start there, zeros elsewhere;
    per-image fields are concatenated in row order, padded with zeros along their other dimensions where the rows'
    sizes differ, as a processor pads a batch (Idefics3 / SmolVLM: (1, images, C, H, W) per prompt, whose model
    drops the all-zero images). Rows without images (None) add nothing.
    """
    present = [m for m in inputs if m is not None]
    batched: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(k for m in present for k in m.per_image):
        parts = [m.per_image[name] for m in present if name in m.per_image]
        if len({p.ndim for p in parts}) > 1:
            shapes = sorted({tuple(p.shape) for p in parts})
            raise ValueError(
                f"Cannot batch the processor's {name!r} of shapes {shapes}: the prompts' images come in tensors of "
                "different ranks; this processor's outputs are not supported yet."
            )
        batched[name] = torch.cat(zero_padded(parts))
    for name in dict.fromkeys(k for m in present for k in (*m.per_token, *m.completion_per_token)):
        first = next(
            fields[name] for m in present for fields in (m.per_token, m.completion_per_token) if name in fields
        )
        values = torch.zeros((len(inputs), total_width), dtype=first.dtype)
        for r, m in enumerate(inputs):
            if m is not None and name in m.per_token:
                values[r, prompt_width - len(m.per_token[name]) : prompt_width] = m.per_token[name]
            if m is not None and name in m.completion_per_token:
                after = m.completion_per_token[name]
                if len(after) > total_width - prompt_width:
                    raise ValueError(
                        f"collate: {name!r} has {len(after)} completion values, more than the rows' "
                        f"{total_width - prompt_width} completion positions."
                    )
                values[r, prompt_width : prompt_width + len(after)] = after
        batched[name] = values
    return batched


def with_tool_images(
    images: PromptImages | None, prompt_ids: Sequence[int], offset: int, part: PromptImages
) -> PromptImages:
    """A rollout's image inputs once a tool result with images sits at completion position `offset`: `part` holds
    that result's processor outputs (per-token values over its tokens, its images). `images`: the inputs so far
    (None: a text prompt, whose placeholder form is its ids). A new PromptImages; the arguments are not changed."""
    if images is None:
        images = PromptImages(placeholder_ids=list(prompt_ids), expanded_length=len(prompt_ids))
    per_token = dict(images.per_token)
    after = dict(images.completion_per_token)
    for name, values in part.per_token.items():
        per_token.setdefault(name, values.new_zeros(len(prompt_ids)))
        before = after.get(name, values.new_zeros(0))[:offset]
        after[name] = torch.cat([before, before.new_zeros(offset - len(before)), values.to(before.dtype)])
    per_image = dict(images.per_image)
    for name, value in part.per_image.items():
        per_image[name] = torch.cat(zero_padded([per_image[name], value])) if name in per_image else value
    return PromptImages(
        per_token=per_token,
        per_image=per_image,
        images=[*images.images, *part.images],
        placeholder_ids=images.placeholder_ids,
        expanded_length=images.expanded_length,
        completion_per_token=after,
    )


def continuation_inputs(
    images: PromptImages, completion_length: int, completion_placeholder_ids: Sequence[int]
) -> PromptImages:
    """The inputs of a prompt continued by the first `completion_length` completion tokens, taken as one prompt (the
    next turn of a multi-turn rollout): per-token values over all of it; for engines that expand placeholders
    themselves, the completion so far with each tool image as its placeholder (`completion_placeholder_ids`)."""
    per_token = {}
    for name in dict.fromkeys((*images.per_token, *images.completion_per_token)):
        prompt = images.per_token[name]
        after = images.completion_per_token.get(name, prompt.new_zeros(0))[:completion_length]
        per_token[name] = torch.cat([prompt, after, after.new_zeros(completion_length - len(after))])
    return PromptImages(
        per_token=per_token,
        per_image=images.per_image,
        images=images.images,
        placeholder_ids=[*images.placeholder_ids, *completion_placeholder_ids],
        expanded_length=images.expanded_length + completion_length,
    )


def images_to_bytes(images: PromptImages) -> bytes:
    """A prompt's processor outputs as safetensors bytes (what a generation server is sent with the prompt's ids)."""
    from safetensors.torch import save

    tensors = {f"per_token/{k}": v for k, v in images.per_token.items()}
    tensors.update({f"per_image/{k}": v for k, v in images.per_image.items()})
    return save({k: v.contiguous() for k, v in tensors.items()})


def images_from_bytes(data: bytes) -> PromptImages:
    """`images_to_bytes`'s inverse; ValueError for bytes that are not such a file."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(data)
    except SafetensorError as err:
        raise ValueError(str(err)) from None
    images = PromptImages()
    for name, value in tensors.items():
        kind, _, field_name = name.partition("/")
        if kind not in ("per_token", "per_image"):
            raise ValueError(f"{name!r} is not a processor output (per_token/... or per_image/...)")
        getattr(images, kind)[field_name] = value
    return images


def zero_padded(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parts, each padded with zeros at the end of every dimension but the first to the largest part's size."""
    largest = [max(sizes) for sizes in zip(*(p.shape[1:] for p in parts))]
    padded = []
    for part in parts:
        if list(part.shape[1:]) == largest:
            padded.append(part)
            continue
        grown = part.new_zeros((part.shape[0], *largest))
        grown[(slice(None), *(slice(0, n) for n in part.shape[1:]))] = part
        padded.append(grown)
    return padded


def computes_own_positions(model: torch.nn.Module) -> bool:
    """True for models with multimodal rotary positions (M-RoPE), which derive them from image grids."""
    return any(hasattr(module, "get_rope_index") for module in model.modules())


def forward_inputs(
    model: torch.nn.Module,
    inputs: Sequence[PromptImages | None],
    prompt_width: int,
    total_width: int,
    device: torch.device,
) -> dict[str, Any]:
    """Extra keyword arguments of a forward over these rows: their image inputs, and position_ids=None
    where the model builds M-RoPE positions itself (given the attention mask, padding is skipped)."""
    if all(m is None for m in inputs):
        return {}
    extra: dict[str, Any] = {k: v.to(device) for k, v in collate(inputs, prompt_width, total_width).items()}
    if computes_own_positions(model):
        extra["position_ids"] = None
    return extra
