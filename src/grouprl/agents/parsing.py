"""One model turn's tokens -> the assistant message, with the tool calls it makes.

Two parsers, as in TRL:

* the tokenizer's own ``response_template`` (transformers response parsing), when it has one:
  ``tokenizer.parse_response(ids, prefix=..., tools=...)``;
* otherwise the ``<tool_call>`` blocks most open chat templates write, the content being the text before the first
  call; each block holds either JSON (Hermes, Qwen2.5, Qwen3: ``{"name": ..., "arguments": {...}}``) or the XML
  form of Qwen3.5 / Qwen3.6 / Qwen3-Coder (``<function=NAME>`` with a ``<parameter=KEY>`` block per argument,
  ``</function>``). An XML value is JSON where it parses as JSON (``3``, ``[1, 2]``), else text; an argument the
  tool's schema declares a string stays text (``"007"`` is not the number 7).

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
    return parse_hermes(decode_keeping_tool_markers(tokenizer, ids), tools)


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


XML_FUNCTION = re.compile(r"\s*<function=([^\n>]+)>(.*)</function>\s*", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^\n>]+)>(.*?)</parameter>", re.DOTALL)


def parse_hermes(text: str, tools: Optional[list[dict]] = None) -> dict:
    """Parse `<tool_call>` blocks (JSON or the XML function form) out of an assistant turn's text. `tools`: the
    tools' schemas, which say which XML arguments are strings."""
    plain = {"role": "assistant", "content": text}
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return plain
    bodies = TOOL_CALL.findall(text)
    if len(bodies) != text.count(TOOL_CALL_OPEN):
        return plain  # a call left open (cut by the length limit, or malformed)
    calls = []
    for body in bodies:
        call = _json_call(body) or _xml_call(body, tools)
        if call is None:
            return plain
        calls.append({"type": "function", "function": call})
    return {"role": "assistant", "content": text[:start].strip(), "tool_calls": calls}


def _json_call(body: str) -> Optional[dict]:
    """{"name", "arguments"} of a JSON call, or None if the body is not one."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # passed on as is: the call fails with a message the model can read
    return {"name": call["name"], "arguments": {} if arguments is None else arguments}


def _xml_call(body: str, tools: Optional[list[dict]]) -> Optional[dict]:
    """{"name", "arguments"} of a `<function=NAME><parameter=KEY>VALUE</parameter>...</function>` call, or None.
    Text between the parameters other than whitespace makes it malformed."""
    function = XML_FUNCTION.fullmatch(body)
    if function is None:
        return None
    name, inside = function.group(1).strip(), function.group(2)
    if XML_PARAMETER.sub("", inside).strip():
        return None
    strings = _string_parameters(tools, name)
    arguments = {}
    for key, value in XML_PARAMETER.findall(inside):
        key, value = key.strip(), value.removeprefix("\n").removesuffix("\n")  # the template's line breaks
        arguments[key] = value if key in strings else _json_or_text(value)
    return {"name": name, "arguments": arguments}


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _string_parameters(tools: Optional[list[dict]], name: str) -> set[str]:
    """The parameters the schema of tool `name` declares strings."""
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {key for key, spec in properties.items() if isinstance(spec, dict) and spec.get("type") == "string"}
    return set()


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
