"""Agent building blocks without a trainer: tool schemas and execution, tool-call parsing, chat-template suffixes."""

import asyncio
import time

import pytest

from grouprl.agents import check_tool_template, execute_tool_calls, make_tools, parse_hermes, tool_suffix_ids
from grouprl.demo.tokenizer import IM_END, TOOL_CHAT_TEMPLATE, build_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def broken(x: int) -> int:
    """Always raises.

    Args:
        x: ignored
    """
    raise RuntimeError("tool exploded")


async def slow_double(x: int) -> int:
    """Double x after a pause.

    Args:
        x: the number
    """
    await asyncio.sleep(0.3)
    return 2 * x


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def test_tool_schema_from_type_hints_and_docstring():
    (tool,) = make_tools([add])
    assert tool.name == "add" and not tool.is_async
    parameters = tool.schema["function"]["parameters"]
    assert parameters["properties"] == {
        "a": {"type": "integer", "description": "the first number"},
        "b": {"type": "integer", "description": "the second number"},
    }
    assert parameters["required"] == ["a", "b"]
    assert make_tools([slow_double])[0].is_async


def test_tool_without_docstring_or_duplicated_is_rejected_by_name():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match=r"tools\[1\] \(undocumented\).*docstring"):
        make_tools([add, undocumented])
    with pytest.raises(ValueError, match="several tools are named \\['add'\\]"):
        make_tools([add, add])
    with pytest.raises(TypeError, match=r"tools\[0\] is a int"):
        make_tools([3])


def test_failures_become_error_results_in_call_order():
    toolbox = {t.name: t for t in make_tools([add, broken, slow_double])}
    calls = [
        [
            call("add", a=2, b=3),
            call("nope"),
            call("add", a=1),
            call("broken", x=1),
            call("slow_double", x=4),
            {"type": "retrieval", "function": {"name": "add"}},
            call("add", a=1, b=2, c=3),
        ]
    ]
    (results,) = execute_tool_calls(calls, [toolbox])
    assert [r.content for r in results][0] == "5" and results[4].content == "8"
    assert [r.failed for r in results] == [False, True, True, True, False, True, True]
    assert "unknown tool 'nope'" in results[1].content and "tool exploded" in results[3].content
    assert (
        results[2].content.startswith("{'error': ") and "missing 1 required positional argument" in results[2].content
    )
    assert results[0].message() == {"role": "tool", "name": "add", "content": "5"}


def test_an_image_block_given_by_path_is_loaded_and_an_unreadable_one_fails_the_call(tmp_path):
    from PIL import Image

    picture = Image.new("RGB", (8, 6), (200, 30, 30))
    picture.save(tmp_path / "shot.png")

    def screenshot(which: str) -> list:
        """Take a screenshot.

        Args:
            which: the file name
        """
        return [{"type": "text", "text": "the screen:"}, {"type": "image", "path": str(tmp_path / which)}]

    toolbox = {t.name: t for t in make_tools([screenshot])}
    (results,) = execute_tool_calls(
        [[call("screenshot", which="shot.png"), call("screenshot", which="gone.png")]], [toolbox]
    )
    text, shown = results[0].content
    assert text == {"type": "text", "text": "the screen:"} and not results[0].failed
    assert shown["type"] == "image" and shown["image"].tobytes() == picture.tobytes()
    assert results[1].failed and "gone.png" in results[1].content


def test_async_tools_of_every_rollout_run_concurrently():
    toolbox = {t.name: t for t in make_tools([slow_double])}
    calls = [
        [call("slow_double", x=1), call("slow_double", x=2)],
        [call("slow_double", x=3)],
        [call("slow_double", x=4)],
    ]
    started = time.perf_counter()
    results = execute_tool_calls(calls, [toolbox] * 3)
    elapsed = time.perf_counter() - started
    assert [[r.content for r in rs] for rs in results] == [["2", "4"], ["6"], ["8"]]
    assert elapsed < 0.9, f"4 calls of 0.3 s took {elapsed:.2f} s: they ran one after another"


@pytest.mark.parametrize(
    "text, expected_calls, expected_content",
    [
        ("42", None, "42"),
        (
            'Let me see.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
            [call("add", a=1, b=2)],
            "Let me see.",
        ),
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "f"}</tool_call>',
            [call("add", a=1), call("f")],
            "",
        ),
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>', [call("add", a=5)], ""),
        (
            '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
            None,
            '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', None, '<tool_call>{"arguments": {}}</tool_call>'),
        (
            '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name"',
            None,
            '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name"',
        ),
    ],
)
def test_hermes_parser(text, expected_calls, expected_content):
    message = parse_hermes(text)
    assert message["role"] == "assistant" and message["content"] == expected_content
    assert message.get("tool_calls") == expected_calls


# the schema of a tool `lookup(code: str, count: int)`: `code` stays text even where it reads as a number
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}, "count": {"type": "integer"}}},
    },
}


@pytest.mark.parametrize(
    "text, expected_calls, expected_content",
    [
        # Qwen3.5's rendering of a call: each value on lines of its own
        (
            "Let me look.\n\n<tool_call>\n<function=lookup>\n<parameter=code>\n007\n</parameter>\n"
            "<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>",
            [call("lookup", code="007", count=3)],
            "Let me look.",
        ),
        ("<tool_call>\n<function=screenshot>\n</function>\n</tool_call>", [call("screenshot")], ""),
        (  # untyped values: JSON where they parse, text (several lines kept) where not
            "<tool_call>\n<function=f>\n<parameter=x>\n[1, 2]\n</parameter>\n<parameter=note>\nline one\n"
            "line two\n</parameter>\n</function>\n</tool_call>\n<tool_call><function=g><parameter=y>true"
            "</parameter></function></tool_call>",
            [call("f", x=[1, 2], note="line one\nline two"), call("g", y=True)],
            "",
        ),
        (  # malformed: text beside the parameters, or no closing </function>
            "<tool_call>\n<function=f>\nstray <parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
            None,
            None,
        ),
        ("<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</tool_call>", None, None),
    ],
)
def test_xml_tool_calls_are_parsed_with_their_schemas_types(text, expected_calls, expected_content):
    message = parse_hermes(text, [LOOKUP])
    assert message.get("tool_calls") == expected_calls
    assert message["content"] == (text if expected_content is None else expected_content)


def test_tool_suffix_is_the_template_difference_after_the_end_of_turn(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    messages = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "7"}]
    suffix = tool_suffix_ids(tokenizer, messages, stop_ids={im_end, tokenizer.eos_token_id}, chat_template_kwargs={})
    expected_text = (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>"
        "\n<|im_start|>assistant\n"
    )
    assert suffix == tokenizer(expected_text, add_special_tokens=False)["input_ids"]


def test_template_checks_name_the_problem(tokenizer):
    stop = {tokenizer.eos_token_id}
    check_tool_template(tokenizer, stop_ids=stop, chat_template_kwargs={})
    plain = build_tokenizer()  # ChatML without tool support: tool calls are silently dropped
    with pytest.raises(ValueError, match="drops the tool name, the call's arguments"):
        check_tool_template(plain, stop_ids=stop, chat_template_kwargs={})
    other_format = build_tokenizer()
    other_format.chat_template = TOOL_CHAT_TEMPLATE.replace("<tool_call>", "[CALL]").replace("</tool_call>", "[/CALL]")
    with pytest.raises(ValueError, match="response_template"):
        check_tool_template(other_format, stop_ids=stop, chat_template_kwargs={})
    shifting = build_tokenizer()  # renders the last message differently from earlier ones: not prefix-preserving
    shifting.chat_template = TOOL_CHAT_TEMPLATE.replace(
        "'<|im_start|>assistant\\n' + (message['content'] or '')",
        "'<|im_start|>assistant\\n' + ('' if loop.last else 'Earlier: ') + (message['content'] or '')",
    )
    assert shifting.chat_template != TOOL_CHAT_TEMPLATE
    with pytest.raises(ValueError, match="not prefix-preserving"):
        check_tool_template(shifting, stop_ids=set(), chat_template_kwargs={})


def test_tool_calls_are_seen_when_the_tokenizer_marks_their_tags_special():
    # Some tokenizers register <tool_call> as a special token; decoding without special tokens drops the tags.
    from transformers import AddedToken

    from grouprl.agents.parsing import parse_turn

    tok = build_tokenizer()
    tok.add_tokens(
        [AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)], special_tokens=True
    )
    text = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(IM_END)]
    assert "<tool_call>" not in tok.decode(ids, skip_special_tokens=True)  # the case being guarded against
    message = parse_turn(tok, ids, prefix=[], tools=None)
    assert message["tool_calls"] == [call("add", a=3, b=4)] and message["content"] == ""
