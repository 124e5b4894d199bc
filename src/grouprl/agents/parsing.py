"""One model turn's tokens -> the assistant message, with the tool calls it makes.

Two parsers, as in TRL:

* the tokenizer's own ``response_template`` (transformers response parsing), when it has one:
  ``tokenizer.parse_response(ids, prefix=..., tools=...)``;
* otherwise the Hermes / Qwen2.5 / Qwen3 format that most open chat templates use: each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and the content is the text before
  the first call.

A turn whose calls are malformed (invalid JSON, no name, an unclosed ``<tool_call>``) is plain
text: it calls nothing and triggers no tool turn (TRL's fallback), rather than failing the step.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_MARKERS = (TOOL_CALL_OPEN, "</tool_call>")


def parse_turn(tokenizer: Any, ids: list[int], prefix: list[int], tools: Optional[list[dict]]) -> dict:
    """{"role": "assistant", "content": str} plus "tool_calls" (function-call dicts) if the turn calls tools."""
    if getattr(tokenizer, "response_template", None) is not None:
        return _parse_with_template(tokenizer, ids, prefix, tools)
    return parse_hermes(decode_keeping_tool_markers(tokenizer, ids))


def decode_keeping_tool_markers(tokenizer: Any, ids: list[int]) -> str:
    """The turn's text without special tokens (end of turn, padding), except the tool-call markers.

    Some tokenizers register `<tool_call>` / `</tool_call>` as special tokens; decoding with
    skip_special_tokens=True would then drop the markers and every call would go unseen.
    """
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {
        i for i, token in added.items() if getattr(token, "special", False) and token.content not in TOOL_CALL_MARKERS
    }
    special |= set(getattr(tokenizer, "all_special_ids", ())) - {
        i for i, t in added.items() if t.content in TOOL_CALL_MARKERS
    }
    return tokenizer.decode([i for i in ids if i not in special], skip_special_tokens=False)


def parse_hermes(text: str) -> dict:
    """Parse `<tool_call>{json}</tool_call>` blocks out of an assistant turn's text."""
    plain = {"role": "assistant", "content": text}
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return plain
    bodies = TOOL_CALL.findall(text)
    if len(bodies) != text.count(TOOL_CALL_OPEN):
        return plain  # a call left open (cut by the length limit, or malformed)
    calls = []
    for body in bodies:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return plain
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return plain
        arguments = call.get("arguments")
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # passed on as is: the call fails with a message the model can read
        calls.append(
            {
                "type": "function",
                "function": {"name": call["name"], "arguments": {} if arguments is None else arguments},
            }
        )
    return {"role": "assistant", "content": text[:start].strip(), "tool_calls": calls}


def _parse_with_template(tokenizer: Any, ids: list[int], prefix: list[int], tools: Optional[list[dict]]) -> dict:
    try:
        parsed = tokenizer.parse_response(ids, prefix=prefix, tools=tools)
        if not isinstance(parsed, dict):
            raise TypeError("parse_response returned no message")
        message = {"role": "assistant", "content": _content(parsed.get("content"), tokenizer.eos_token)}
        calls = parsed.get("tool_calls")
        if calls:
            message["tool_calls"] = [_normalise_call(call) for call in calls]
        return message
    except (ValueError, TypeError, KeyError, AttributeError):
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def _content(content: Any, eos_token: Optional[str]) -> str:
    if not isinstance(content, str):
        return ""
    return content.removesuffix(eos_token) if eos_token else content


def _normalise_call(call: Any) -> dict:
    """Flat {"name", "arguments"} or nested {"type", "function": {...}} -> nested, arguments defaulting to {}."""
    if not isinstance(call, dict):
        raise TypeError(f"tool call {call!r} is not a dict")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise TypeError(f"tool call {call!r} has no function name")
    arguments = function.get("arguments")
    return {
        "type": call.get("type", "function"),
        "function": {"name": function["name"], "arguments": {} if arguments is None else arguments},
    }
