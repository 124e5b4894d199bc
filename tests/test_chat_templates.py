"""Training templates for chat templates that are not prefix-preserving (grouprl.agents.training_templates).

Qwen3's real chat template (tests/data/qwen3_chat_template.jinja, the text trl-internal-testing/tiny-Qwen3ForCausalLM
carries) is rendered with the demo tokenizer (byte-level, so any text tokenizes). The checks: grouprl's Qwen3 training
template renders every prompt exactly as Qwen3's does, differs from it only where Qwen3 is not prefix-preserving, is
prefix-preserving for tool results, is swapped in visibly for tool-calling GRPO (which then trains end to end), and an
unrecognised template that is not prefix-preserving is refused with what to do.
"""

import logging
import random
from pathlib import Path

import datasets
import pytest
import torch
from helpers import ScriptedBackend, max_difference, parameters
from transformers import AutoTokenizer

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.agents import check_tool_template, tool_suffix_ids
from grouprl.agents.chat import NotPrefixPreserving
from grouprl.agents.training_templates import training_template_for
from grouprl.demo.tokenizer import IM_END, build_tokenizer

DATA = Path(__file__).parent / "data"
QWEN3 = (DATA / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
QWEN2_5 = (DATA / "qwen2_5_chat_template.jinja").read_text(encoding="utf-8")
EMPTY_THINK = "<think>\n\n</think>\n\n"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN3
    return tokenizer


@pytest.fixture(scope="module")
def training():
    found = training_template_for(QWEN3)
    assert found is not None and found.family == "Qwen3"
    return found.text


def render(tok, messages, template, tokenize=False, **kwargs):
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=tokenize, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out) if tokenize else out


def call(name="multiply", **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments or {"a": 6, "b": 7}}}


# ---- random conversations -----------------------------------------------------------------------------------------


def random_assistant(rng, calls=None):
    """An assistant turn with or without reasoning (as reasoning_content or inline <think>) and tool calls."""
    message = {
        "role": "assistant",
        "content": rng.choice(
            ["", "ok", "\nThe answer.", "<think>\nhmm\n</think>\n\n42", "<think>x</think>", "</think>bare close"]
        ),
    }
    if rng.random() < 0.3:
        message["reasoning_content"] = rng.choice(["", "because", "\nsteps\n"])
    if calls if calls is not None else rng.random() < 0.5:
        message["tool_calls"] = [
            call(a=rng.randint(0, 9), b=2)
            if rng.random() < 0.7
            else {"type": "function", "function": {"name": "multiply", "arguments": '{"a": 1, "b": 2}'}}
            for _ in range(rng.choice([1, 2]))
        ]
    return message


def random_message(rng):
    role = rng.choice(["system", "user", "user", "assistant", "tool"])
    if role == "assistant":
        return random_assistant(rng)
    if role == "user":  # a user text that is a tool response does not count as Qwen3's "last query"
        return {
            "role": "user",
            "content": rng.choice(["6 times 7?", "<tool_response>\n3\n</tool_response>", "and now?"]),
        }
    if role == "tool":
        return {"role": "tool", "name": "multiply", "content": rng.choice(["42", ""])}
    return {"role": "system", "content": "Be brief."}


def random_options(rng):
    options = {"tools": TOOLS if rng.random() < 0.5 else None}
    if rng.random() < 0.6:
        options["enable_thinking"] = rng.choice([True, False])
    return options


def is_real_query(message):
    content = message.get("content")
    return (
        message["role"] == "user"
        and isinstance(content, str)
        and not (content.startswith("<tool_response>") and content.endswith("</tool_response>"))
    )


def ends_with_reasoning_free_call(messages):
    """Qwen3's non-prefix-preserving case: the last message is a tool-calling assistant turn,
    after a real query, with no reasoning."""
    last = messages[-1]
    if last["role"] != "assistant" or not last.get("tool_calls") or not any(is_real_query(m) for m in messages[:-1]):
        return False
    reasoning = last.get("reasoning_content")
    if not isinstance(reasoning, str):
        content = last["content"]
        reasoning = (
            content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n") if "</think>" in content else ""
        )
    return not reasoning


# ---- the training template against Qwen3's -------------------------------------------------------------------------


def test_qwen3_is_recognised_by_its_exact_text_only():
    assert (
        training_template_for(QWEN3 + "\n").family == "Qwen3"
    )  # surrounding whitespace (a saved chat_template.jinja) is ignored
    assert (
        training_template_for(QWEN3.replace("Tools", "Functions")) is None
    )  # any edit inside: not the template it was checked against
    assert (
        training_template_for(QWEN2_5) is None
        and training_template_for(None) is None
        and training_template_for({"default": QWEN3}) is None
    )


PROMPTS = {
    "user": [{"role": "user", "content": "6 times 7?"}],
    "system and user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6 times 7?"}],
    "earlier reasoning, new query": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "6 times 7?"},
    ],
    "earlier inline thinking, new query": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "6 times 7?"},
    ],
    "tool round without reasoning": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "6 times 7?"},
        {"role": "assistant", "content": "", "tool_calls": [call()]},
        {"role": "tool", "name": "multiply", "content": "42"},
    ],
    "tool round with reasoning, two results": [
        {"role": "user", "content": "6 times 7, twice?"},
        {"role": "assistant", "content": "<think>\nmultiply twice\n</think>\n\n", "tool_calls": [call(), call()]},
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "tool", "name": "multiply", "content": "42"},
    ],
    "two tool rounds": [
        {"role": "user", "content": "6 times 7?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call()]},
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "assistant", "content": "", "reasoning_content": "again", "tool_calls": [call(a=1)]},
        {"role": "tool", "name": "multiply", "content": "6"},
    ],
}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_thinking": False},
        {"enable_thinking": True},
        {"tools": TOOLS},
        {"tools": TOOLS, "enable_thinking": False},
    ],
    ids=lambda o: ",".join(o) or "defaults",
)
@pytest.mark.parametrize("name", list(PROMPTS))
def test_training_template_renders_prompts_token_for_token_as_qwen3(tok, training, name, options):
    prompt = PROMPTS[name]
    original = render(tok, prompt, QWEN3, tokenize=True, add_generation_prompt=True, **options)
    assert render(tok, prompt, training, tokenize=True, add_generation_prompt=True, **options) == original


def test_training_template_renders_random_prompts_as_qwen3(tok, training):
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        messages = [random_message(rng) for _ in range(rng.randint(1, 6))]
        if messages[-1]["role"] == "assistant":  # a prompt to continue: the final message is completed, not closed
            messages[-1].pop("tool_calls", None)
            messages[-1]["content"] = "The answer is"
            kwargs = {"continue_final_message": True}
        else:
            kwargs = {"add_generation_prompt": True}
        kwargs.update(random_options(rng))
        assert render(tok, messages, training, tokenize=True, **kwargs) == render(
            tok, messages, QWEN3, tokenize=True, **kwargs
        ), messages
        checked += 1
    assert checked == 400


def test_training_template_differs_from_qwen3_only_where_qwen3_is_not_prefix_preserving(tok, training):
    """Any conversation, any ending: the same text, except a conversation ending with a reasoning-free
    tool-calling turn, which Qwen3 gives an empty think block that it takes away once tools answer;
    the training template never writes it."""
    rng = random.Random(1)
    differing = 0
    for _ in range(1500):
        messages = [random_message(rng) for _ in range(rng.randint(1, 7))]
        options = {"add_generation_prompt": rng.random() < 0.5, **random_options(rng)}
        original, ours = render(tok, messages, QWEN3, **options), render(tok, messages, training, **options)
        if options["add_generation_prompt"]:
            generation_prompt = "<|im_start|>assistant\n" + (
                EMPTY_THINK if options.get("enable_thinking") is False else ""
            )
            assert original.endswith(generation_prompt) and ours.endswith(generation_prompt)
            original, ours = original[: -len(generation_prompt)], ours[: -len(generation_prompt)]
        if ends_with_reasoning_free_call(messages):
            # Qwen3 writes the empty block while the turn is last; the training template writes the
            # turn as Qwen3 does once a tool answers it.
            assert original.rpartition("<|im_start|>assistant\n")[2].startswith(EMPTY_THINK)
            answered = render(
                tok,
                messages + [{"role": "tool", "name": "multiply", "content": "RESULT"}],
                QWEN3,
                tools=options["tools"],
            )
            assert ours == answered.rpartition("<|im_start|>user\n<tool_response>\nRESULT")[0], messages
            differing += 1
        else:
            assert ours == original, messages
    assert differing > 30  # the case is exercised, not just never generated


def test_training_template_is_prefix_preserving_where_qwen3_is_not(tok, training):
    """History + a tool-calling turn, then tool results (and maybe more turns): the
    turn and all before it render the same."""
    rng = random.Random(2)
    qwen3_broken = 0
    for _ in range(300):
        history = [random_message(rng) for _ in range(rng.randint(0, 4))] + [{"role": "user", "content": "6 times 7?"}]
        turn = random_assistant(rng, calls=True)
        results = [
            {"role": "tool", "name": "multiply", "content": str(rng.randint(0, 99))} for _ in range(rng.choice([1, 2]))
        ]
        more = [random_assistant(rng)] if rng.random() < 0.3 else []
        options = random_options(rng)
        for template in (training, QWEN3):
            before = render(tok, history + [turn], template, **options)
            after = render(tok, history + [turn] + results + more, template, add_generation_prompt=True, **options)
            if template is training:
                assert after.startswith(before), (history, turn)
                ids_before = render(tok, history + [turn], template, tokenize=True, **options)
                ids_after = render(
                    tok,
                    history + [turn] + results + more,
                    template,
                    tokenize=True,
                    add_generation_prompt=True,
                    **options,
                )
                assert ids_after[: len(ids_before)] == ids_before
            else:
                assert after.startswith(before) == (not ends_with_reasoning_free_call(history + [turn]))
                qwen3_broken += not after.startswith(before)
    assert qwen3_broken > 50


# ---- the swap at start-up, and the refusal ---------------------------------------------------------------------------


def test_qwen3_swaps_in_the_training_template_visibly(tok, training, caplog):
    im_end = tok.convert_tokens_to_ids(IM_END)
    with caplog.at_level(logging.INFO, logger="grouprl.agents.chat"):
        template = check_tool_template(tok, stop_ids={im_end}, chat_template_kwargs={})
    assert template == training
    assert "Qwen3 training template (grouprl/agents/chat_templates/qwen3_training.jinja)" in caplog.text
    assert tok.chat_template == QWEN3  # the tokenizer (prompts, saved checkpoints) keeps its own
    results = [
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "tool", "name": "multiply", "content": "6"},
    ]
    expected = (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>"
        "\n<|im_start|>assistant\n"
    )
    for kwargs, tail in (({}, ""), ({"enable_thinking": False}, EMPTY_THINK)):
        suffix = tool_suffix_ids(tok, results, stop_ids={im_end}, chat_template_kwargs=kwargs, chat_template=template)
        assert tok.decode(suffix) == expected + tail
    with pytest.raises(NotPrefixPreserving):  # what the swap avoids
        tool_suffix_ids(tok, results, stop_ids={im_end}, chat_template_kwargs={})


def test_prefix_preserving_templates_are_kept_as_they_are(training, caplog):
    for template in (
        QWEN2_5,
        training,
    ):  # Qwen2.5 needs no swap; nor does a tokenizer given grouprl's template by the user
        tokenizer = build_tokenizer()
        tokenizer.chat_template = template
        with caplog.at_level(logging.INFO, logger="grouprl.agents.chat"):
            assert (
                check_tool_template(
                    tokenizer, stop_ids={tokenizer.convert_tokens_to_ids(IM_END)}, chat_template_kwargs={}
                )
                is None
            )
    assert "training template" not in caplog.text


def test_unknown_template_that_is_not_prefix_preserving_is_refused_with_what_to_do():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN3.replace(
        "You may call one or more functions", "You may call functions"
    )  # an edited Qwen3
    with pytest.raises(ValueError, match="not prefix-preserving") as caught:
        check_tool_template(tokenizer, stop_ids={tokenizer.convert_tokens_to_ids(IM_END)}, chat_template_kwargs={})
    message = str(caught.value)
    assert "training templates for Qwen3, recognised by the exact text" in message
    assert "processing_class whose chat_template" in message
    assert (
        repr("<|im_start|>assistant\n<think>\n\n</think>")[1:-1] in message
    )  # where the renderings part: the dropped block


# ---- end to end: tool-calling GRPO with Qwen3's template -------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_model_dir(tmp_path_factory):
    from grouprl.demo.model import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("qwen3") / "model", seed=0, max_position_embeddings=2048)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = QWEN3
    tokenizer.save_pretrained(path)
    return path


def test_tool_calling_grpo_trains_with_the_qwen3_template(qwen3_model_dir, tmp_path, caplog):
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir)
    assert tok.chat_template.strip() == QWEN3.strip()
    im_end = tok.convert_tokens_to_ids(IM_END)

    def turn(text):
        return tok(text, add_special_tokens=False)["input_ids"] + [im_end]

    # Sample 0 thinks, then calls the tool (Qwen3's format: newlines inside <tool_call>); sample 1 calls it without
    # thinking (as in TRL's tests); sample 2 answers directly. After a tool response every sample answers.
    tool_call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    first = [
        turn("<think>\nI should multiply.\n</think>\n\n" + tool_call),
        turn(tool_call),
        turn("<think>\neasy\n</think>\n\n42"),
    ]
    answer = turn("<think>\n\n</think>\n\n42")
    glue = tok(
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    script = lambda prompt, s: answer if "<tool_response>" in tok.decode(prompt) else first[s]  # noqa: E731

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]  # calls earn more messages: the group's advantages differ

    rows = {
        "prompt": [
            [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": f"{i} times 7?"}]
            for i in range(4)
        ]
    }
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=400,
        learning_rate=0.05,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
    )
    with caplog.at_level(logging.INFO, logger="grouprl.agents.chat"):
        trainer = GRPOTrainer(
            model=qwen3_model_dir,
            reward_funcs=reward,
            args=args,
            tools=[multiply],
            train_dataset=datasets.Dataset.from_dict(rows),
            generation_backend=ScriptedBackend(script, im_end, tok),
        )
    assert "Qwen3 training template" in caplog.text

    rollout = trainer.run.rollouts.sample()
    c = rollout.completions[0]
    # The prompt is Qwen3's own rendering, tools included.
    assert c.prompt_ids == render(
        tok, rows["prompt"][0], QWEN3, tokenize=True, add_generation_prompt=True, tools=[multiply]
    )
    assert c.token_ids == first[0] + glue + answer
    assert c.tool_mask == [True] * len(first[0]) + [False] * len(glue) + [True] * len(answer)
    assert c.messages[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    ]
    assert c.messages[1] == {"role": "tool", "name": "multiply", "content": "42"}
    assert [x.tool_calls for x in rollout.completions[:3]] == [1, 1, 0]
    batch = trainer.run.rollouts.make_train_batch(rollout, torch.zeros(len(rollout.completions)))
    n = len(c.token_ids)
    assert batch.loss_mask[0, :n].tolist() == c.tool_mask  # the tool output is in the context, not in the loss

    before = parameters(trainer.model)
    trainer.train()
    assert max_difference(before, parameters(trainer.model)) > 0
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == pytest.approx(2 / 3) and log["tools/failure_frequency"] == 0.0
    assert log["loss"] is not None


# ---- end to end: Qwen3.5's template and its XML tool calls -----------------------------------------------------------


def qwen3_5_template():
    """Qwen3.5's chat template (non-thinking), as TRL 1.16 carries it (it recognises the model by this text); read
    from TRL's wheel, which test_trl_script installs into the test cache."""
    from test_trl_script import trl_install

    return (trl_install() / "trl" / "chat_templates" / "qwen3_5_nothink.jinja").read_text(encoding="utf-8")


@pytest.mark.e2e
def test_tool_calling_grpo_parses_qwen3_5s_xml_calls(tmp_path):
    from grouprl.demo.model import save_tiny_model

    template = qwen3_5_template()
    path = save_tiny_model(tmp_path / "model", seed=0, max_position_embeddings=4096)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = template
    tok.save_pretrained(path)
    im_end = tok.convert_tokens_to_ids(IM_END)

    def turn(text):
        return tok(text, add_special_tokens=False)["input_ids"] + [im_end]

    # Qwen3.5 writes a call as XML, each argument on lines of its own; sample 0 calls, sample 1 answers.
    call = (
        "<tool_call>\n<function=multiply>\n<parameter=a>\n6\n</parameter>\n<parameter=b>\n7\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    first, answer = [turn(call), turn("42")], turn("It is 42.")
    script = lambda prompt, s: answer if "<tool_response>" in tok.decode(prompt) else first[s]  # noqa: E731
    backend = ScriptedBackend(script, im_end, tok)
    rows = {"prompt": [[{"role": "user", "content": f"{i} times 7?"}] for i in range(2)]}
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=GRPOConfig(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=600,
            learning_rate=0.05,
            max_steps=1,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            shuffle_dataset=False,
        ),
        tools=[multiply],
        train_dataset=datasets.Dataset.from_dict(rows),
        generation_backend=backend,
    )
    rollout = trainer.run.rollouts.sample()
    c = rollout.completions[0]
    called = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    assert c.messages[0]["tool_calls"] == [called] and c.messages[1] == {
        "role": "tool",
        "name": "multiply",
        "content": "42",
    }
    assert [x.tool_calls for x in rollout.completions] == [1, 0, 1, 0]
    # The turn after the tool's result is prompted with Qwen3.5's own rendering of the conversation so far.
    conversation = rows["prompt"][0] + [{"role": "assistant", "content": "", "tool_calls": [called]}, c.messages[1]]
    continued = [ids for ids, _ in backend.calls if "<tool_response>" in tok.decode(ids[0])][0][0]
    assert tok.decode(continued) == tok.apply_chat_template(
        conversation, tools=[multiply], tokenize=False, add_generation_prompt=True
    )
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == pytest.approx(0.5) and log["tools/failure_frequency"] == 0.0
