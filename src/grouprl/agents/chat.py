"""Chat-template pieces of a multi-turn rollout, as token ids.

The tokens that follow a model turn when tool results come back (end-of-turn glue, the tool
role header, the results, the next assistant header) are the *difference* between two renderings
of a small conversation: with and without the tool messages (and the generation prompt). They
are appended to the sampled tokens as they are, so the sequence the model is trained on is exactly
prompt + sampled tokens + these tokens; nothing sampled is ever decoded and re-encoded (TRL §5,
user-pain-points row 33).

The rendering without tools is cut right after its last end-of-turn token (any stop id), since a
model turn ends with that token; what a template writes after it (ChatML's newline) belongs to the
suffix. This needs a *prefix-preserving* template: earlier messages render the same whatever
follows. `check_tool_template` tests that, and that the template renders tool calls and tool
messages at all, once at start-up. When the tokenizer carries the exact template of a family
grouprl has a training template for (training_templates.py: Qwen3), the suffixes are rendered with
that one instead, and `check_tool_template` returns it; prompts keep the tokenizer's template.

Tool results with images (content blocks ``{"type": "image", "image": ...}``, TRL's multimodal tool responses) are
rendered through the model's processor instead (`tool_suffix_with_images`): the same difference of two renderings,
with each image expanded to its image tokens, plus the processor's outputs for the images.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from grouprl.agents.parsing import TOOL_CALL_OPEN
from grouprl.agents.training_templates import known_families, training_template_for
from grouprl.data.multimodal_prompts import message_images, placeholder_encoding, processor_outputs
from grouprl.model.multimodal import PromptImages

logger = logging.getLogger(__name__)


class NotPrefixPreserving(ValueError):
    pass


def render_ids(
    tokenizer: Any,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    chat_template_kwargs: dict,
    chat_template: Optional[str] = None,
) -> list[int]:
    """Token ids of a conversation, rendered with `chat_template` (None: the tokenizer's own)."""
    template = {"chat_template": chat_template} if chat_template is not None else {}
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, **template, **chat_template_kwargs
    )
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _dummy_turn(tool_name: str, arguments: Optional[dict] = None) -> list[dict]:
    call = {"type": "function", "function": {"name": tool_name, "arguments": arguments or {}}}
    return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]


def tool_suffix_ids(
    tokenizer: Any,
    tool_messages: list[dict],
    *,
    stop_ids: set[int],
    chat_template_kwargs: dict,
    chat_template: Optional[str] = None,
) -> list[int]:
    """Token ids to append after a model turn that ended with tool calls, given the tools' messages."""
    # The real tool name, not a placeholder: some templates derive the tool header from the call.
    before = _dummy_turn(tool_messages[0]["name"])
    render = dict(chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
    prefix = render_ids(tokenizer, before, add_generation_prompt=False, **render)
    full = render_ids(tokenizer, before + tool_messages, add_generation_prompt=True, **render)
    return full[_suffix_start(prefix, full, stop_ids) :]


def tool_suffix_with_images(
    processor: Any,
    tool_messages: list[dict],
    *,
    stop_ids: set[int],
    chat_template_kwargs: dict,
    chat_template: Optional[str] = None,
) -> tuple[list[int], PromptImages, list[int]]:
    """`tool_suffix_ids` for tool results with images, rendered by the processor: the suffix's token ids (each image
    expanded to its image tokens), its processor outputs (per-token values over the suffix, the images' tensors and
    the images themselves) and the suffix with each image as the template's placeholder (for engines that expand
    placeholders themselves: vLLM)."""
    before = _dummy_turn(tool_messages[0]["name"])
    options = dict(chat_template_kwargs, **({"chat_template": chat_template} if chat_template is not None else {}))

    def render(messages: list[dict], add_generation_prompt: bool) -> dict:
        return processor.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            add_generation_prompt=add_generation_prompt,
            **options,
        )

    def placeholders(messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **options
        )
        return placeholder_encoding(processor.tokenizer, text)

    try:
        full = render(before + tool_messages, True)
    except ValueError as err:  # processors check that the text has a placeholder for each image
        raise ValueError(f"{images_not_rendered(processor, tool_messages)} (the processor: {err})") from err
    ids = full["input_ids"][0].tolist()
    start = _suffix_start(render(before, False)["input_ids"][0].tolist(), ids, stop_ids)
    part = processor_outputs(full, f"The results of tool(s) {sorted({m['name'] for m in tool_messages})}", start)
    part.images = message_images(tool_messages)
    if getattr(processor, "image_token_id", None) not in (None, *ids[start:]):
        raise ValueError(images_not_rendered(processor, tool_messages))
    unexpanded = placeholders(before + tool_messages, True)
    return ids[start:], part, unexpanded[_suffix_start(placeholders(before, False), unexpanded, stop_ids) :]


def images_not_rendered(processor: Any, tool_messages: list[dict]) -> str:
    names = sorted({m["name"] for m in tool_messages})
    return (
        f"The results of tool(s) {names} hold {len(message_images(tool_messages))} image(s), but the chat template "
        f"rendered them without an image placeholder ({getattr(processor, 'image_token', None)!r}): it writes a tool "
        "message's content as text, so the model would not see the images. Use a chat template that renders image "
        "blocks in tool messages (processor.chat_template), or return text from the tools."
    )


def _suffix_start(prefix: list[int], full: list[int], stop_ids: set[int]) -> int:
    """Where a tool suffix starts in `full`: after `prefix` cut at its last stop token (module doc)."""
    ends = [i for i, token in enumerate(prefix) if token in stop_ids]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise NotPrefixPreserving(
            "The chat template is not prefix-preserving: a conversation renders differently once tool messages follow "
            "it, so tool results cannot be appended as tokens."
        )
    return len(prefix)


def check_tool_template(
    tokenizer: Any, *, stop_ids: set[int], chat_template_kwargs: dict, chat_template: Optional[str] = None
) -> Optional[str]:
    """Fail at start-up, with what to do, if this tokenizer cannot run tool-calling rollouts.

    `chat_template`: the template prompts are rendered with when it is not the tokenizer's own (a vision-language
    model's processor's). Returns the template to render tool results with: None for that template, or grouprl's
    training template for its family when that template is a known original that is not prefix-preserving.
    """
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError(
            "tools / environment_factory need a chat template that renders tool calls; the tokenizer has none."
        )
    name, key, value, content = "tool_name_7f3a", "tool_key_2b9c", "tool_value_5d1e", "tool_content_8c4f"
    messages = _dummy_turn(name, {key: value}) + [{"role": "tool", "name": name, "content": content}]
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, chat_template=template, **chat_template_kwargs
        )
    except Exception as err:  # jinja raises its own error types
        raise ValueError(
            "The chat template cannot render a tool-calling conversation (user -> assistant with tool_calls -> tool): "
            f"{err}"
        ) from err
    missing = [
        part
        for part, sentinel in (("the tool name", name), ("the call's arguments", value), ("the tool result", content))
        if sentinel not in rendered
    ]
    if missing:
        raise ValueError(
            f"The chat template drops {', '.join(missing)} of a tool-calling conversation; use a template that "
            "supports tools."
        )
    if getattr(tokenizer, "response_template", None) is None and TOOL_CALL_OPEN not in rendered:
        raise ValueError(
            'grouprl parses tool calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
            "(Hermes / Qwen format) or <tool_call><function=...>...</function></tool_call> (Qwen3.5) unless the "
            "tokenizer has a response_template; this chat template writes calls differently. Set "
            "tokenizer.response_template (transformers response parsing) for its format."
        )
    try:
        tool_suffix_ids(
            tokenizer,
            messages[2:],
            stop_ids=stop_ids,
            chat_template_kwargs=chat_template_kwargs,
            chat_template=template,
        )
        return None
    except NotPrefixPreserving:
        pass
    training = training_template_for(template)
    if training is None:
        raise NotPrefixPreserving(_not_prefix_preserving_message(tokenizer, messages, chat_template_kwargs, template))
    # Our own template must pass the check it stands in for; failing it is a grouprl bug, said as such.
    try:
        tool_suffix_ids(
            tokenizer,
            messages[2:],
            stop_ids=stop_ids,
            chat_template_kwargs=chat_template_kwargs,
            chat_template=training.text,
        )
    except NotPrefixPreserving as err:
        raise RuntimeError(
            f"grouprl's {training.family} training template ({training.path}) is not prefix-preserving: a grouprl bug."
        ) from err
    logger.info(
        "tools: the tokenizer's chat template is %s's, which is not prefix-preserving (%s); tool results are rendered "
        "with grouprl's %s training template (%s), which renders prompts identically. Prompts and saved checkpoints "
        "keep the tokenizer's template.",
        training.family,
        training.flaw,
        training.family,
        training.path,
    )
    return training.text


def _not_prefix_preserving_message(
    tokenizer: Any, messages: list[dict], chat_template_kwargs: dict, template: str
) -> str:
    """The error for a template grouprl cannot fix, showing where the two renderings part."""
    alone = tokenizer.apply_chat_template(messages[:2], tokenize=False, chat_template=template, **chat_template_kwargs)
    followed = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template, **chat_template_kwargs
    )
    at = next((i for i, (a, b) in enumerate(zip(alone, followed)) if a != b), min(len(alone), len(followed)))
    start = max(0, at - 40)
    return (
        "The chat template is not prefix-preserving: it renders a tool-calling assistant turn differently once a tool "
        f"message follows it (from character {at}: {alone[start : at + 40]!r} when the turn is last, "
        f"{followed[start : at + 40]!r} once a tool answers), so tool results cannot be appended to the sampled "
        f"tokens. grouprl has prefix-preserving training templates for {known_families()}, recognised by the exact "
        "text of their original template; this template is not one of them. Pass a processing_class whose "
        "chat_template renders every message the same whatever follows it (tokenizer.chat_template = <your template>; "
        "GRPOTrainer(..., processing_class=tokenizer)); prompts are rendered with it too."
    )
