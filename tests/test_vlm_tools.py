"""Tools and environments with vision-language models: image prompts through multi-turn rollouts, and tools that
return images (TRL's multimodal tool responses), seen by the next turn and by training.

The first turn is scripted (a tiny random model never calls a tool); the turns after the tool results are sampled
by the trainer's own backend. Every check compares with the processor run over the whole conversation, which is
what a model would be given if the rollout had been written out and processed in one go.
"""

import io
import json
import os
import re

import datasets
import pyarrow.parquet as pq
import pytest
import torch
from helpers import ScriptedBackend
from PIL import Image
from vlm_models import (
    BUILDERS,
    CHAT_TEMPLATE,
    end_turns_at_im_end,
    image,
    sharpen,
    tiny_qwen2_vl,
    trained_logprobs,
    with_tool_template,
)

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.core.types import PromptBatch
from grouprl.data.multimodal_prompts import placeholder_encoding
from grouprl.demo.tokenizer import IM_END
from grouprl.model.multimodal import collate, image_token_ids

TOOL_IMAGE_SEED = 7
OBSERVATION = " Look closely."


def look() -> list:
    """Show the picture the question is about."""
    return shown(image(TOOL_IMAGE_SEED))


def shown(picture) -> list:
    return [{"type": "image", "image": picture}, {"type": "text", "text": "here it is"}]


def zoomed(picture):
    """The top-left quarter of a picture, enlarged to its size."""
    return picture.crop((0, 0, picture.width // 2, picture.height // 2)).resize(picture.size)


class Zoom:
    """An environment holding its row's picture (reset() gets the row's images column), whose tool shows a corner of
    it enlarged: the zoom-in tool of "thinking with images"; reset() adds an observation to the prompt."""

    def reset(self, images=(), **row):
        self.picture = images[0] if images else image(TOOL_IMAGE_SEED)
        return OBSERVATION

    def look(self) -> list:
        """Zoom in on the picture the question is about."""
        return shown(zoomed(self.picture))


def tool_image(row, kind):
    """The picture `look` shows for this row."""
    if kind == "tools":
        return image(TOOL_IMAGE_SEED)
    return zoomed(row["images"][0] if row["images"] else image(TOOL_IMAGE_SEED))


def user(text):
    return [{"role": "user", "content": text}]


CALL = {"type": "function", "function": {"name": "look", "arguments": {}}}
CALL_TEXT = "<tool_call>" + json.dumps({"name": "look", "arguments": {}}) + "</tool_call>"


class FirstTurnCalls:
    """The first turn of each conversation calls `look`; the turns after a tool result are sampled by `real`, whose
    prompts and image inputs are kept in `continuations`."""

    def __init__(self, tokenizer, real):
        self.tokenizer, self.real, self.continuations, self.answers, self.first_turns = tokenizer, real, [], [], []
        self.needs_importance_correction = getattr(real, "needs_importance_correction", False)
        self.call = tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"] + [
            tokenizer.convert_tokens_to_ids(IM_END)
        ]

    def sync_weights(self, model):
        self.real.sync_weights(model)

    def generate(self, prompt_ids, num_samples, params, multimodal=None):
        if "<tool_response>" not in self.tokenizer.decode(prompt_ids[0]):
            self.first_turns.append((len(prompt_ids), num_samples))
            scripted = ScriptedBackend(lambda p, s: self.call, self.call[-1], self.tokenizer)
            return scripted.generate(prompt_ids, num_samples, params)
        self.continuations.append((prompt_ids, multimodal))
        answers = self.real.generate(prompt_ids, num_samples, params, multimodal=multimodal)
        self.answers += answers
        return answers


def vlm_tool_run(tmp_path, arch, prompt_images, kind):
    model, processor = BUILDERS[arch]()
    sharpen(model, 5.0)  # outputs that clearly depend on the images
    with_tool_template(processor)
    end_turns_at_im_end(model, processor.tokenizer)
    rows = [{"prompt": user(f"what is {i}?"), "images": [image(i)] * prompt_images} for i in range(2)]
    config = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=160,
        learning_rate=0.05,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
        shuffle_dataset=False,
        log_completions=True,
        num_completions_to_print=0,
    )
    agent = {"tools": [look]} if kind == "tools" else {"environment_factory": Zoom}
    trainer = GRPOTrainer(
        model,
        lambda completions, **kw: [float(sum(map(ord, c[-1]["content"])) % 13) for c in completions],
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=processor,
        **agent,
    )
    backend = FirstTurnCalls(processor.tokenizer, trainer.run.rollouts.backend)
    trainer.run.rollouts.backend = backend
    return trainer, model, processor, rows, backend


def conversation(row, kind):
    """The conversation up to the second turn, as messages: the prompt (with the observation an environment adds),
    the call, the tool's result."""
    blocks = [{"type": "image", "image": im} for im in row["images"]] + [
        {"type": "text", "text": row["prompt"][0]["content"]}
    ]
    if kind == "environment_factory":
        blocks.append({"type": "text", "text": OBSERVATION})
    return [
        {"role": "user", "content": blocks},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "name": "look", "content": shown(tool_image(row, kind))},
    ]


def schemas_of(trainer, kind):
    """The tool schemas the prompts render: the trainer's tools, or the environment's."""
    spec = trainer.run.rollouts.agent.spec
    tools = spec.tools if kind == "tools" else spec.environments.tools[None]
    return [t.schema for t in tools]


def encoded_prompts(trainer, rows, prompt_images):
    """The rows as the trainer encodes them: each prompt sampled twice."""
    encoded = [trainer.run.rollouts.tokenize.encode_row(row, i) for i, row in enumerate(rows)]
    prompts = PromptBatch(
        prompts=[e[0] for e in encoded],
        prompt_ids=[e[1] for e in encoded],
        columns={"images": [row["images"] for row in rows]},  # as the trainer's batches (environments' reset gets it)
        dataset_indices=list(range(len(rows))),
        group_ids=list(range(len(rows))),
        num_samples=[2] * len(rows),
        multimodal=[e[2] for e in encoded] if prompt_images else None,
    )
    return prompts, encoded


def one_forward(model, processor, messages, schemas, completion, suppressed=()):
    """Logprobs of a rollout's completion tokens from one forward over the processor's inputs of `messages` (the
    conversation up to the last turn) followed by that turn's sampled tokens; `suppressed` tokens never sampled."""
    inputs = processed(processor, messages, schemas)
    answer = completion.token_ids[len(inputs["input_ids"][0]) - len(completion.prompt_ids) :]
    inputs = {k: extended(v, len(answer)) if v.shape == inputs["input_ids"].shape else v for k, v in inputs.items()}
    inputs["input_ids"][0, -len(answer) :] = torch.tensor(answer)
    inputs["attention_mask"][0, -len(answer) :] = 1
    with torch.no_grad():
        device = next(model.parameters()).device  # the trainer's (CUDA where there is one)
        logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits[0, :-1].float().cpu()
    logits[:, list(suppressed)] = -float("inf")
    scores = logits.log_softmax(-1).gather(-1, inputs["input_ids"][0, 1:, None])[:, 0]
    return scores[-len(completion.token_ids) :]


def extended(values, length):
    return torch.cat([values, values.new_zeros(1, length)], 1)


def processed(processor, messages, schemas):
    return processor.apply_chat_template(
        messages, tools=schemas, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    "arch, prompt_images, kind",
    [
        ("qwen2_vl", 1, "tools"),
        ("qwen2_vl", 0, "tools"),
        ("qwen2_vl", 1, "environment_factory"),
        ("qwen3_5", 1, "tools"),
        ("llava", 1, "tools"),
        ("idefics3", 1, "environment_factory"),
    ],
)
def test_a_tools_image_reaches_the_next_turn_and_training_as_the_processor_gives_it(
    tmp_path, arch, prompt_images, kind
):
    trainer, model, processor, rows, backend = vlm_tool_run(tmp_path, arch, prompt_images, kind)
    schemas = schemas_of(trainer, kind)
    prompts, encoded = encoded_prompts(trainer, rows, prompt_images)
    completions = trainer.run.rollouts.agent.generate(backend, prompts, trainer.run.rollouts.sampling)
    # the first turn: each prompt once with its two samples (an environment's rollouts whose reset() said the same
    # share their prompt's encoding, so its prefill)
    assert backend.first_turns == [(2, 2)]

    # The next turn is prompted with what the processor makes of the whole conversation so far: the same ids, the
    # tool's image after the prompt's, the per-token fields over the completion too.
    continued = [(ids, m) for prompt_ids, images in backend.continuations for ids, m in zip(prompt_ids, images)]
    assert len(continued) == 4  # each rollout's next turn
    for r, (prompt_ids, images) in enumerate(continued):
        row = rows[r // 2]
        expected = processed(processor, conversation(row, kind), schemas)
        assert prompt_ids == expected["input_ids"][0].tolist()
        inputs = collate([images], len(prompt_ids), len(prompt_ids))
        assert sorted(inputs) == sorted(k for k in expected if k not in ("input_ids", "attention_mask"))
        for name, value in inputs.items():
            want = expected[name].to(value.dtype)
            if value.shape != want.shape:  # Idefics3's (prompts, images, ...): the tool's images come as another
                value, want = value.flatten(0, 1), want.flatten(0, 1)  # prompt's, which the model flattens alike
            torch.testing.assert_close(value, want, msg=name)
        text = processor.apply_chat_template(
            conversation(row, kind), tools=schemas, tokenize=False, add_generation_prompt=True
        )
        assert images.placeholder_ids == placeholder_encoding(processor.tokenizer, text)  # for vLLM
        assert images.images == [*row["images"], tool_image(row, kind)] and images.expanded_length == len(prompt_ids)

    # Training scores every completion token with the rollout's images: as one forward over the processor's inputs
    # of the conversation followed by the sampled answer, row by row, gives them.
    for c in completions:
        assert c.tool_calls == 1 and [m["role"] for m in c.messages] == ["assistant", "tool", "assistant"]
    trained = trained_logprobs(model, prompts, completions)

    for r, completion in enumerate(completions):
        assert completion.prompt_ids == encoded[r // 2][1] or kind == "environment_factory"
        expected = one_forward(model, processor, conversation(rows[r // 2], kind), schemas, completion)
        torch.testing.assert_close(trained[r, : len(completion.token_ids)], expected, atol=1e-4, rtol=1e-4)
    # The check can fail: the same conversation with another picture from the tool scores otherwise.
    messages = conversation(rows[0], kind)
    messages[-1]["content"][0]["image"] = image(TOOL_IMAGE_SEED + 1)
    other = one_forward(model, processor, messages, schemas, completions[0])
    assert (other - trained[0, : len(completions[0].token_ids)]).abs().max() > 1e-3

    # And the run trains end to end: every rollout called the tool once, the language model moved.
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.0
    # the completion log shows each row's images: its prompt's, then the tool's
    table = pq.read_table(os.path.join(trainer.args.output_dir, "completions", "completions_00001.parquet"))
    for pngs, prompt in zip(table.to_pydict()["image"], table.to_pydict()["prompt"]):
        row = rows[int(prompt.split("what is ")[1][0])]
        shown_images = [Image.open(io.BytesIO(png)).tobytes() for png in pngs]
        assert shown_images == [im.tobytes() for im in [*row["images"], tool_image(row, kind)]]
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "lm_head" in n or "embed" in n)


@pytest.mark.parametrize("tokenizer_template", [None, "without tools"])
def test_tool_results_are_rendered_with_the_processors_template(tmp_path, tokenizer_template):
    """A processor's chat template renders the prompts, so it renders text tool results too, whatever its tokenizer's
    own template is (none, or one that cannot render tools, as some checkpoints ship)."""

    def look() -> str:
        """Describe the picture the question is about."""
        return "a red square"

    model, processor = tiny_qwen2_vl()
    with_tool_template(processor)
    end_turns_at_im_end(model, processor.tokenizer)
    plain = CHAT_TEMPLATE.replace("IMAGE_MARKUP", repr(processor.tokenizer.image_markup))  # renders no tools
    processor.tokenizer.chat_template = None if tokenizer_template is None else plain
    rows = [{"prompt": user(f"what is {i}?"), "images": [image(i)]} for i in range(2)]
    trainer = GRPOTrainer(
        model,
        lambda completions, **kw: [float(len(c[-1]["content"])) for c in completions],
        args=GRPOConfig(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=120,
            report_to="none",
            bf16=False,
            shuffle_dataset=False,
        ),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=processor,
        tools=[look],
    )
    backend = FirstTurnCalls(processor.tokenizer, trainer.run.rollouts.backend)
    prompts, _ = encoded_prompts(trainer, rows, 1)
    trainer.run.rollouts.agent.generate(backend, prompts, trainer.run.rollouts.sampling)
    continued = [ids for prompt_ids, _ in backend.continuations for ids in prompt_ids]
    assert len(continued) == 4
    schemas = [t.schema for t in trainer.run.rollouts.agent.spec.tools]
    for r, prompt_ids in enumerate(continued):
        messages = conversation(rows[r // 2], "tools")
        messages[-1]["content"] = "a red square"
        assert prompt_ids == processed(processor, messages, schemas)["input_ids"][0].tolist()


def look_at(index: int) -> list:
    """Show one of several pictures.

    Args:
        index: which picture
    """
    return [{"type": "text", "text": f"picture {index}:"}, {"type": "image", "image": image(20 + index, 16, 24)}]


def calls(*indices):
    return [{"type": "function", "function": {"name": "look_at", "arguments": {"index": i}}} for i in indices]


def test_two_tool_images_in_one_turn_then_another_round_keep_their_order(tmp_path):
    """One turn calls look_at twice (two images in one tool turn), the next calls it once more: the turn after is
    prompted, and training scores the rollout, with the prompt's image then the tools' in call order, as the processor
    gives the whole conversation."""
    model, processor = tiny_qwen2_vl(max_position_embeddings=1024)
    sharpen(model, 5.0)
    with_tool_template(processor)
    end_of_turn = end_turns_at_im_end(model, processor.tokenizer)
    trainer = GRPOTrainer(
        model,
        lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=400,
            max_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            bf16=False,
        ),
        train_dataset=datasets.Dataset.from_list([{"prompt": user("which is red?"), "images": [image(0)]}]),
        processing_class=processor,
        tools=[look_at],
    )

    def text_of(tool_calls):
        return "".join(
            "<tool_call>"
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "</tool_call>"
            for c in tool_calls
        )

    def script(prompt_ids, sample):
        rounds = processor.tokenizer.decode(prompt_ids).count("<tool_response>")
        turn = {0: text_of(calls(1, 2)), 2: text_of(calls(3))}.get(rounds)
        return processor.tokenizer(turn, add_special_tokens=False)["input_ids"] + [end_of_turn]

    real, seen = trainer.run.rollouts.backend, []

    class Scripted:
        needs_importance_correction = False

        def generate(self, prompt_ids, num_samples, params, multimodal=None):
            if processor.tokenizer.decode(prompt_ids[0]).count("<tool_response>") == 3:
                seen.extend(zip(prompt_ids, multimodal))
                return real.generate(prompt_ids, num_samples, params, multimodal=multimodal)
            return ScriptedBackend(script, end_of_turn, processor.tokenizer).generate(prompt_ids, num_samples, params)

    row = {"prompt": user("which is red?"), "images": [image(0)]}
    prompts, _ = encoded_prompts(trainer, [row], prompt_images=1)
    completions = trainer.run.rollouts.agent.generate(Scripted(), prompts, trainer.run.rollouts.sampling)
    schemas = schemas_of(trainer, "tools")
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image(0)}, {"type": "text", "text": "which is red?"}]},
        {"role": "assistant", "content": "", "tool_calls": calls(1, 2)},
        {"role": "tool", "name": "look_at", "content": look_at(1)},
        {"role": "tool", "name": "look_at", "content": look_at(2)},
        {"role": "assistant", "content": "", "tool_calls": calls(3)},
        {"role": "tool", "name": "look_at", "content": look_at(3)},
    ]
    expected = processed(processor, messages, schemas)
    assert len(seen) == 2 and all(c.tool_calls == 3 for c in completions)
    for prompt_ids, images in seen:
        assert prompt_ids == expected["input_ids"][0].tolist()
        assert images.images == [image(0), *(image(20 + i, 16, 24) for i in (1, 2, 3))]
        inputs = collate([images], len(prompt_ids), len(prompt_ids))
        for name in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
            torch.testing.assert_close(inputs[name], expected[name].to(inputs[name].dtype), msg=name)
    trained = trained_logprobs(model, prompts, completions)
    for r, completion in enumerate(completions):
        reference = one_forward(model, processor, messages, schemas, completion)
        torch.testing.assert_close(trained[r, : len(completion.token_ids)], reference, atol=1e-4, rtol=1e-4)


@pytest.mark.e2e
def test_a_generation_server_samples_the_turn_after_a_tool_image_with_it(tmp_path):
    """generation_engine='server' (`grouprl serve`): the turn after a tool's image is sampled on the server with the
    processor outputs of the whole conversation, so its logprobs are those of one forward over them."""
    from conftest import serving
    from vlm_models import save_tiny_qwen2_vl

    from grouprl.generation.remote import RemoteGenerator

    trainer, model, processor, rows, _ = vlm_tool_run(tmp_path, "qwen2_vl", 1, "tools")
    with serving(save_tiny_qwen2_vl(tmp_path / "served")) as (url, _):
        server = RemoteGenerator(url)
        server.sync_weights(model)  # the trainer's (sharpened) weights
        backend = FirstTurnCalls(processor.tokenizer, server)
        prompts, _ = encoded_prompts(trainer, rows, prompt_images=1)
        completions = trainer.run.rollouts.agent.generate(backend, prompts, trainer.run.rollouts.sampling)
    schemas = schemas_of(trainer, "tools")
    placeholders = image_token_ids(model.config)  # the server samples with them suppressed, and says so
    for r, (completion, answer) in enumerate(zip(completions, backend.answers)):
        messages = conversation(rows[r // 2], "tools")
        expected = one_forward(model, processor, messages, schemas, completion, placeholders)
        sampled = torch.tensor(answer.sampler_logprobs)
        torch.testing.assert_close(sampled, expected[-len(sampled) :], atol=1e-4, rtol=1e-4)
    # The check can fail: without the tool's image the server's turn scores otherwise.
    messages = conversation(rows[0], "tools")
    messages[-1]["content"][0] = {"type": "text", "text": "no picture"}
    blind = one_forward(model, processor, messages, schemas, completions[0], placeholders)
    assert (
        blind[-len(backend.answers[0].token_ids) :] - torch.tensor(backend.answers[0].sampler_logprobs)
    ).abs().max() > 1e-3


def test_a_tool_image_for_a_text_model_is_refused_naming_the_tool(tool_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    call = tok(CALL_TEXT, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(IM_END)]
    trainer = GRPOTrainer(
        model=tool_model_dir,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=128,
            max_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=datasets.Dataset.from_dict({"prompt": [user("what is it?")] * 2}),
        generation_backend=ScriptedBackend(lambda p, s: call, call[-1], tok),
        tools=[look],
    )
    with pytest.raises(ValueError, match="Tool 'look' returned an image, but the model is trained with a tokenizer"):
        trainer.train()


@pytest.mark.parametrize("arch", BUILDERS)
def test_a_template_that_writes_a_tools_images_as_text_is_named(arch):
    """A chat template that renders a tool message's content as text would show the model the images' Python repr:
    the first such result stops the run, saying what to change (whether or not the processor checks it itself)."""
    from grouprl.agents.chat import tool_suffix_with_images
    from grouprl.demo.tokenizer import TOOL_CHAT_TEMPLATE

    _, processor = BUILDERS[arch]()
    processor.chat_template = TOOL_CHAT_TEMPLATE  # tool content as `content | string`
    end_of_turn = processor.tokenizer.convert_tokens_to_ids(IM_END)
    expected = rf"\['look'\] hold 1 image\(s\).*without an image placeholder \('{re.escape(processor.image_token)}'\)"
    with pytest.raises(ValueError, match=expected):
        tool_suffix_with_images(
            processor,
            [{"role": "tool", "name": "look", "content": look()}],
            stop_ids={end_of_turn},
            chat_template_kwargs={},
        )
