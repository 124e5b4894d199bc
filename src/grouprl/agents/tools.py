"""Tools the model may call: schemas from type hints and docstrings, and one turn's execution.

A tool is a sync or async Python function, or a bound method of an environment. Its JSON schema
(which the chat template renders into the prompt) comes from `transformers.utils.get_json_schema`,
so it needs a type hint on every argument and a Google-style docstring with an ``Args:`` section.

Execution (TRL §5): each call is ``{"type": "function", "function": {"name", "arguments"}}``.
Sync tools run in call order in the calling thread; async ones run concurrently on a background
event loop, all rollouts' calls of the turn together (TRL gathers one rollout at a time). An
unknown name, arguments that do not fit the signature, a call of another type, or an exception in
the tool becomes the result ``{"error": "..."}``, which the model reads, and counts as a failure. A result that
is a list is content blocks; an image block given by ``path`` or ``url`` is loaded here (one that cannot be read
fails the call).
Results keep the order of the calls.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from transformers.utils import get_json_schema

from grouprl.rewards.scoring import _BackgroundLoop


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    is_async: bool
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: Any  # str(result), or a list of content blocks returned as such
    failed: bool

    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


def make_tools(functions: Sequence[Callable[..., Any]], where: str = "tools") -> list[Tool]:
    """Validated tools with their schemas; `where` names the argument in error messages."""
    tools: list[Tool] = []
    for i, fn in enumerate(functions):
        if not callable(fn):
            raise TypeError(
                f"{where}[{i}] is a {type(fn).__name__}, not a function; tools are Python functions with type hints "
                "and docstrings."
            )
        name = getattr(fn, "__name__", type(fn).__name__)
        try:
            schema = get_json_schema(fn)
        except (
            Exception
        ) as err:  # transformers raises several types (DocstringParsingException, TypeHintParsingException, ...)
            raise ValueError(
                f"{where}[{i}] ({name}): cannot build its JSON schema: {err} A tool needs a type hint on every "
                "argument and a Google-style docstring: a description, then an 'Args:' section with one line per "
                "argument."
            ) from err
        tools.append(Tool(name=name, fn=fn, is_async=inspect.iscoroutinefunction(fn), schema=schema))
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"{where}: several tools are named {duplicates}; the model calls tools by name, so names must be unique."
        )
    return tools


def execute_tool_calls(calls: Sequence[Sequence[dict]], toolboxes: Sequence[dict[str, Tool]]) -> list[list[ToolResult]]:
    """Run the calls of several rollouts (calls[i] with toolboxes[i]); results[i][j] answers calls[i][j]."""
    results: list[list[Any]] = [[None] * len(rollout_calls) for rollout_calls in calls]
    waiting: list[tuple[int, int, str, Any]] = []  # (rollout, call, tool name, coroutine)
    for i, (rollout_calls, tools) in enumerate(zip(calls, toolboxes)):
        for j, call in enumerate(rollout_calls):
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name", "unknown") if isinstance(function, dict) else "unknown"
            try:
                if (
                    not isinstance(call, dict)
                    or call.get("type", "function") != "function"
                    or not isinstance(function, dict)
                ):
                    raise ValueError(f"unsupported tool call {call!r}; expected a function call")
                if name not in tools:
                    raise ValueError(f"unknown tool {name!r}; available tools: {sorted(tools)}")
                arguments = function.get("arguments") or {}
                if not isinstance(arguments, dict):
                    raise TypeError(f"the arguments of {name!r} must be a JSON object, got {arguments!r}")
                outcome = tools[name].fn(
                    **arguments
                )  # a bad argument raises TypeError here, before any coroutine exists
            except Exception as err:  # noqa: BLE001 - the model reads the error and the call counts as failed
                results[i][j] = _failure(name, err)
                continue
            if tools[name].is_async:
                waiting.append((i, j, name, outcome))
            else:
                results[i][j] = _success(name, outcome)
    if waiting:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(coroutine for *_, coroutine in waiting), return_exceptions=True)

        for (i, j, name, _), outcome in zip(waiting, _BackgroundLoop.run(gather()).result()):
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
            results[i][j] = _failure(name, outcome) if isinstance(outcome, Exception) else _success(name, outcome)
    return results


def _success(name: str, value: Any) -> ToolResult:
    # A list is taken as content blocks (TRL: multimodal tool results); anything else is shown as text.
    if not isinstance(value, list):
        return ToolResult(name, str(value), failed=False)
    try:
        return ToolResult(name, [with_loaded_image(block) for block in value], failed=False)
    except Exception as err:  # noqa: BLE001 - an image that cannot be read fails the call, which the model reads
        return _failure(name, err)


def with_loaded_image(block: Any) -> Any:
    """An image block given by file path or URL ({"type": "image", "path" / "url": ...}) with its image loaded, as
    {"type": "image", "image": <PIL image>}: every sampler and the completion log take the image itself."""
    if not isinstance(block, dict) or block.get("type") != "image" or block.get("image") is not None:
        return block
    source = block.get("path") or block.get("url")
    if source is None:
        return block  # no image at all: multiturn.check_image_results names the tool
    from transformers.image_utils import load_image

    return {"type": "image", "image": load_image(source)}


def _failure(name: str, error: Exception) -> ToolResult:
    return ToolResult(name, str({"error": str(error)}), failed=True)
