"""Image prompts from a dataset: placing a row's images in its messages and running them through the processor.

The data format (TRL 1.16) and what a `PromptImages` holds are described in `multimodal.py`; this is
the dataset side, built on `data.PromptTokenizer`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Optional

import torch

from grouprl.data.prompts import (
    IMAGE_COLUMNS,
    PROMPT_COLUMN,
    DataRowError,
    PromptTokenizer,
    check_prompt,
    is_conversational,
    row_images,
    template_errors_name,
)
from grouprl.model.multimodal import PromptImages, is_processor

MESSAGE_ROLES = ("system", "user", "assistant", "tool")


def attach_images(messages: list[dict], images: list[Any], row: int) -> list[dict]:
    """TRL's prepare_multimodal_messages: every content becomes a list of blocks, and the images go
    into the first user message with string content (before its text) or into the empty
    ``{"type": "image"}`` blocks already there, in order. The input messages are not modified."""
    prepared, placed = [], False
    for i, message in enumerate(messages):
        if message["role"] not in MESSAGE_ROLES:
            raise DataRowError(
                f"Row {row}: message {i} has role {message['role']!r}; expected one of {', '.join(MESSAGE_ROLES)}."
            )
        content = message.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
            if message["role"] == "user" and not placed:
                blocks, placed = [{"type": "image"} for _ in images] + blocks, True
            message = {**message, "content": blocks}
        prepared.append(message)
    slots = [
        (m, k)
        for m, message in enumerate(prepared)
        if message["role"] != "tool" and isinstance(message.get("content"), list)
        for k, block in enumerate(message["content"])
        if block.get("type") == "image" and "image" not in block
    ]
    if len(slots) != len(images):
        raise DataRowError(
            f"Row {row}: {len(images)} image(s) in the image/images column but {len(slots)} empty image block(s) "
            "({'type': 'image'}) in the prompt's messages to put them in. Give a user message with string content "
            "(the images go before its text) or one {'type': 'image'} block per image."
        )
    for (m, k), image in zip(slots, images):
        content = list(prepared[m]["content"])
        content[k] = {**content[k], "image": image}
        prepared[m] = {**prepared[m], "content": content}
    return prepared


class MultimodalPromptTokenizer(PromptTokenizer):
    """Prompts through the model's processor: chat template and image processing, once per prompt."""

    def __init__(self, processor: Any, **kwargs: Any):
        super().__init__(processor.tokenizer, **kwargs)
        self.processor = processor
        self.image_token = getattr(processor, "image_token", None)

    def check(self, prompt: Any, row: int) -> None:
        check_prompt(prompt, row)
        if is_conversational(prompt) and getattr(self.processor, "chat_template", None) is None:
            raise DataRowError(
                f"Row {row} is conversational but the processor has no chat_template; set processor.chat_template."
            )

    def encode_row(self, row: dict, index: int) -> tuple[Any, list[int], PromptImages | None]:
        prompt, images = row[PROMPT_COLUMN], row_images(row, index)
        if not is_conversational(prompt):
            if images:
                raise DataRowError(
                    f"Row {index} has images but a plain-string prompt. Images need a conversational prompt "
                    "([{'role': 'user', 'content': ...}]): the processor's chat template places them. If the chat "
                    "template was applied to the dataset already, give the raw messages instead."
                )
            return super().encode_row(row, index)
        self.check(prompt, index)
        blocks = attach_images(prompt, images, index)
        ids, inputs = self.encode_messages(blocks, index)
        # reward functions see the messages with their image blocks (TRL), a text prompt as given; so does the log
        return (blocks if images else prompt), ids, inputs

    def encode_messages(
        self, messages: Any, row: int, tools: Optional[list[dict]] = None
    ) -> tuple[list[int], PromptImages | None]:
        """Token ids of messages whose image blocks hold their images, rendered by the processor, and the processor's
        outputs for the images (None without images). `tools`: as for `__call__`."""
        if not is_conversational(messages):
            return super().encode_messages(messages, row, tools)
        self.check(messages, row)
        images = [image for image in message_images(messages) if image is not None]
        continue_final = messages[-1]["role"] == "assistant"
        options = dict(
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            tools=tools or self.tools,
            **self.chat_template_kwargs,
        )
        with self.lock, template_errors_name(row, messages):
            out = self.processor.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_tensors="pt", **options
            )
            ids = out["input_ids"][0].tolist()
            self.check_fits(ids, messages, row)
            if not images:
                return ids, None
            # the ids before the processor expands each image placeholder (engines that expand them: vLLM)
            text = self.processor.apply_chat_template(messages, tokenize=False, **options)
        inputs = processor_outputs(out, f"Row {row}")
        inputs.images = images
        inputs.placeholder_ids = placeholder_encoding(self.processor.tokenizer, text)
        inputs.expanded_length = len(ids)
        return ids, inputs

    def prompt_text(self, prompt: Any, prompt_ids: list[int]) -> str:
        """The rendered prompt, each run of image tokens shown as one."""
        text = super().prompt_text(prompt, prompt_ids)
        if self.image_token:
            text = re.sub(f"(?:{re.escape(self.image_token)})+", lambda _: self.image_token, text)
        return text


def message_images(messages: list[dict]) -> list[Any]:
    """The image of each image block in the messages' content, in order (None for a block without its image)."""
    return [
        block.get("image")
        for message in messages
        if isinstance(message.get("content"), list)
        for block in message["content"]
        if isinstance(block, dict) and block.get("type") == "image"
    ]


def processor_outputs(out: Any, where: str, start: int = 0) -> PromptImages:
    """A processor's outputs for one conversation besides its token ids: per-token fields (from position `start`)
    and per-image ones. `where` names the input in the error for an output that is not a tensor."""
    shape = out["input_ids"].shape  # (1, P)
    inputs = PromptImages()
    for name, value in out.items():
        if name in ("input_ids", "attention_mask"):
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{where}: the processor returned {name!r} as {type(value).__name__}; grouprl batches tensors only."
            )
        if value.shape == shape:
            inputs.per_token[name] = value[0, start:]
        else:
            inputs.per_image[name] = value
    return inputs


def placeholder_encoding(tokenizer: Any, text: str) -> list[int]:
    """A rendered chat template's token ids with its image placeholders unexpanded: the text encoded with special
    tokens as a processor encodes it (none where the text starts with the BOS token)."""
    bos = tokenizer.bos_token
    return tokenizer(text, add_special_tokens=not (bos is not None and text.startswith(bos)))["input_ids"]


def make_prompt_tokenizer(processing_class: Any, **kwargs: Any) -> PromptTokenizer:
    """The prompt encoder for this processing class: through the processor if it is one."""
    return (
        MultimodalPromptTokenizer(processing_class, **kwargs)
        if is_processor(processing_class)
        else PromptTokenizer(processing_class, **kwargs)
    )


def rows_images(columns: dict[str, list[Any]], rows: Sequence[int]) -> list[list[Any]]:
    """(n,) the images of each row's prompt (empty lists for text prompts), from the image/images columns."""
    image_columns = {name: values for name, values in columns.items() if name in IMAGE_COLUMNS}
    return [row_images({name: values[b] for name, values in image_columns.items()}, b) for b in rows]


def check_multimodal_setup(dataset: Any, processing_class: Any, name: str = "train_dataset") -> None:
    """Images need the model's processor: fail before training, naming the column."""
    columns = getattr(dataset, "column_names", None) or []
    found = [c for c in IMAGE_COLUMNS if c in columns]
    if found and not is_processor(processing_class):
        raise ValueError(
            f"{name} has an {found[0]!r} column but processing_class is a {type(processing_class).__name__}, "
            "not a processor: images need the model's processor (transformers.AutoProcessor.from_pretrained(model)), "
            "which GRPOTrainer loads by itself when processing_class is left as None."
        )
