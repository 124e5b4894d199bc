"""Vision-language models: image prompts through the processor, padding-proof batching, generation, training.

Three architectures, built locally (tests/vlm_models.py): Qwen2-VL (M-RoPE positions from image grids,
per-token mm_token_type_ids, pixel patches), LLaVA (CLIP vision tower, 1-D positions, one pixel
tensor per image) and Idefics3 (SmolVLM: one (1, images, C, H, W) tensor per prompt, zero-padded in a batch).
"""

import copy
import io
import math
import os

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from vlm_models import (
    BUILDERS,
    image,
    save_tiny_llava,
    sharpen,
    tiny_llava,
    tiny_qwen2_vl,
    trained_logprobs,
)

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.agents import encode_prompts
from grouprl.core.types import Completion, PromptBatch, Rollout, SamplingParams
from grouprl.data.multimodal_prompts import MultimodalPromptTokenizer, attach_images
from grouprl.data.prompts import PromptTokenizer
from grouprl.generation.hf import TransformersGenerator
from grouprl.generation.protocol import left_pad
from grouprl.generation.static_decode import CapturedGenerator
from grouprl.model.logprobs import completion_logprobs
from grouprl.model.multimodal import PromptImages, collate, continuation_inputs, with_tool_images
from grouprl.rollout.train_batch import pack_rollout


def user(text):
    return [{"role": "user", "content": text}]


def encoder(processor):
    return MultimodalPromptTokenizer(processor, max_context=None, max_completion_length=8)


# ---- data: images into messages, processor outputs per prompt -------------------------------------------


def test_attach_images_puts_them_before_the_first_user_text_and_fills_empty_blocks():
    a, b = image(1), image(2)
    messages = [
        {"role": "system", "content": "be brief"},
        *user("what is this?"),
        {"role": "assistant", "content": "ok"},
        *user("and?"),
    ]
    prepared = attach_images(messages, [a, b], row=0)
    assert prepared[0]["content"] == [{"type": "text", "text": "be brief"}]
    assert prepared[1]["content"] == [
        {"type": "image", "image": a},
        {"type": "image", "image": b},
        {"type": "text", "text": "what is this?"},
    ]
    assert prepared[3]["content"] == [{"type": "text", "text": "and?"}]  # only the first user message gets the images
    assert messages[1]["content"] == "what is this?"  # the dataset's messages are left alone
    placed = attach_images(
        [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}], [a], row=0
    )
    assert placed[0]["content"][1] == {"type": "image", "image": a}
    with pytest.raises(ValueError, match=r"Row 7: 2 image\(s\) .* but 1 empty image block"):
        attach_images([{"role": "user", "content": [{"type": "image"}]}], [a, b], row=7)
    with pytest.raises(ValueError, match="Row 3: message 0 has role 'robot'"):
        attach_images([{"role": "robot", "content": "x"}], [], row=3)


def test_processor_encodes_each_prompt_once_with_its_image_inputs():
    model, processor = tiny_qwen2_vl()
    # 4x4-pixel patches merged 2x2: a 16x16 image is 16 patches and 4 image tokens, a 16x24 one 24 and 6.
    prompt, ids, inputs = encoder(processor).encode_row(
        {"prompt": user("hi"), "images": [image(0), image(1, 16, 24)]}, 0
    )
    image_id = model.config.image_token_id
    assert [block["type"] for block in prompt[0]["content"]] == [
        "image",
        "image",
        "text",
    ]  # what reward functions see (TRL)
    assert sum(t == image_id for t in ids) == 10
    assert inputs.per_image["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert inputs.per_image["pixel_values"].shape[0] == 16 + 24
    assert inputs.per_token["mm_token_type_ids"].tolist() == [int(t == image_id) for t in ids]
    text_only = encoder(processor).encode_row({"prompt": user("hi"), "images": []}, 0)
    assert text_only[0] == user("hi") and text_only[2] is None and image_id not in text_only[1]
    with pytest.raises(ValueError, match="Row 5 has images but a plain-string prompt"):
        encoder(processor).encode_row({"prompt": "hi", "image": image(0)}, 5)
    with pytest.raises(ValueError, match="Row 2 has images but the prompts are tokenized by a tokenizer"):
        PromptTokenizer(processor.tokenizer, max_context=None, max_completion_length=8).encode_row(
            {"prompt": user("x"), "image": image(0)}, 2
        )


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_engines_that_process_images_get_the_images_and_one_placeholder_for_each(arch):
    """vLLM expands each image placeholder itself (an expanded one it expands again): a prompt goes to it with its
    images and its ids before the processor's expansion, which here is a run of image tokens per image."""
    from grouprl.generation.vllm import engine_prompts

    model, processor = BUILDERS[arch]()
    images = [image(0), image(1)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    _, ids, inputs = encoder(processor).encode_row({"prompt": messages, "images": images}, 0)
    image_id = model.config.image_token_id
    collapsed = [t for k, t in enumerate(ids) if t != image_id or k == 0 or ids[k - 1] != image_id]
    assert inputs.placeholder_ids == collapsed and collapsed.count(image_id) == 2 and len(ids) > len(collapsed)
    assert inputs.images == images
    _, text_ids, none = encoder(processor).encode_row({"prompt": user("hi")}, 1)
    assert engine_prompts([ids, text_ids], [inputs, none]) == [
        {"prompt_token_ids": collapsed, "multi_modal_data": {"image": images}},
        {"prompt_token_ids": text_ids},
    ]
    assert engine_prompts([text_ids], None) == [{"prompt_token_ids": text_ids}]
    # a conversation continued past the prompt (a completion, a tool's result): its ids follow the placeholders
    assert engine_prompts([ids + [7, 8]], [inputs])[0]["prompt_token_ids"] == collapsed + [7, 8]


def test_collate_left_aligns_per_token_fields_with_the_prompt_and_concatenates_image_fields():
    a = PromptImages(per_token={"types": torch.tensor([0, 1, 1])}, per_image={"pixels": torch.ones(2, 3)})
    b = PromptImages(per_token={"types": torch.tensor([1, 0])}, per_image={"pixels": torch.zeros(1, 3)})
    batched = collate(
        [a, None, b], prompt_width=4, total_width=6
    )  # prompts padded to 4 columns, then 2 completion columns
    assert batched["types"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]
    assert batched["pixels"].tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3]
    assert collate([None, None], 4, 6) == {}
    # Idefics3's (1, images, H, W)-like fields: padded with zeros at the end of the other dimensions, as its
    # processor pads a batch (one image of 1 x 2 against two of 2 x 1)
    one = PromptImages(per_image={"pixels": torch.tensor([[[[1.0, 2.0]]]])})
    two = PromptImages(per_image={"pixels": torch.tensor([[[[3.0], [4.0]], [[5.0], [6.0]]]])})
    assert collate([one, two], 1, 1)["pixels"].tolist() == [
        [[[1.0, 2.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]],
        [[[3.0, 0.0], [4.0, 0.0]], [[5.0, 0.0], [6.0, 0.0]]],
    ]
    with pytest.raises(ValueError, match="'pixels' of shapes .* different ranks"):
        collate([one, PromptImages(per_image={"pixels": torch.ones(2, 3)})], 1, 1)


def test_a_tools_images_follow_the_prompts_and_their_token_values_sit_in_the_completion():
    """A prompt of 3 tokens (an image at its second), a 2-token model turn, then a tool result of 3 tokens with an
    image token at its second; then a second tool image 1 token later (a text prompt's rollout starts from zeros)."""
    prompt = PromptImages(
        per_token={"types": torch.tensor([0, 1, 0])},
        per_image={"pixels": torch.ones(1, 2)},
        images=["p"],
        placeholder_ids=[5, 9],
        expanded_length=3,
    )
    tool = PromptImages(
        per_token={"types": torch.tensor([0, 1, 0])}, per_image={"pixels": torch.zeros(1, 2)}, images=["t"]
    )
    rollout = with_tool_images(prompt, [5, 6, 7], offset=2, part=tool)
    assert rollout.per_token["types"].tolist() == [0, 1, 0]
    assert rollout.completion_per_token["types"].tolist() == [0, 0, 0, 1, 0]
    assert rollout.per_image["pixels"].tolist() == [[1.0, 1.0], [0.0, 0.0]] and rollout.images == ["p", "t"]
    # training: per-token values over prompt and completion, completion padding after them
    assert collate([rollout, None], prompt_width=4, total_width=10)["types"].tolist() == [
        [0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
        [0] * 10,
    ]
    # the next turn's prompt is prompt + 5 completion tokens + 1 sampled token; the placeholder form (vLLM) is the
    # prompt's placeholders + the completion so far with the tool image as its placeholder
    turn = continuation_inputs(rollout, 6, [1, 2, 3, 4, 8])
    assert turn.per_token["types"].tolist() == [0, 1, 0, 0, 0, 0, 1, 0, 0] and turn.completion_per_token == {}
    assert turn.placeholder_ids == [5, 9, 1, 2, 3, 4, 8] and turn.expanded_length == 9
    # a text prompt: zeros over it, its ids as its own placeholder form
    text = with_tool_images(None, [5, 6], offset=1, part=tool)
    assert text.per_token["types"].tolist() == [0, 0] and text.completion_per_token["types"].tolist() == [0, 0, 1, 0]
    assert text.placeholder_ids == [5, 6] and text.expanded_length == 2
    again = with_tool_images(text, [5, 6], offset=5, part=tool)
    assert again.completion_per_token["types"].tolist() == [0, 0, 1, 0, 0, 0, 1, 0]
    assert again.images == ["t", "t"] and len(again.per_image["pixels"]) == 2
    with pytest.raises(ValueError, match="more than the rows' 3 completion positions"):
        collate([again], prompt_width=2, total_width=5)


def test_a_checkpoint_written_before_a_field_existed_still_unpickles_with_its_default():
    """A checkpoint's pending micro-batches hold their rows' PromptImages, pickled; one written before
    completion_per_token (or the vLLM fields) existed resumes with their defaults."""
    import pickle

    old = PromptImages(per_token={"types": torch.tensor([0, 1])}, per_image={"pixels": torch.ones(1, 2)})
    for name in ("completion_per_token", "images", "placeholder_ids", "expanded_length"):
        del old.__dict__[name]  # as a PromptImages of an older grouprl
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded.completion_per_token == {} and loaded.images == [] and loaded.expanded_length == 0
    assert loaded.per_token["types"].tolist() == [0, 1]
    assert collate([loaded], 3, 4)["types"].tolist() == [[0, 0, 1, 0]]


# ---- padding: a sample's logprobs do not depend on its batch ---------------------------------------------


class Misaligned(torch.nn.Module):
    """Negative control: a forward that gets a row's image inputs wrong, as a misaligned batch would."""

    def __init__(self, model, how):
        super().__init__()
        self.inner, self.how = model, how

    def forward(self, **kwargs):
        if self.how == "images in reverse row order":
            kwargs["pixel_values"] = kwargs["pixel_values"].flip(0)
        else:  # "text positions": 1-D positions over real tokens, blind to the images' M-RoPE grid positions
            kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return self.inner(**kwargs)


@pytest.mark.parametrize("arch", BUILDERS)
def test_a_samples_logprobs_are_the_same_batched_with_shorter_or_longer_prompts(arch):
    model, processor = BUILDERS[arch]()
    sharpen(model, 5.0).eval()
    encode = encoder(processor)
    rows = [  # the sample, a shorter text-only prompt, a longer prompt with two images
        {"prompt": user("look"), "images": [image(0, 16, 24)]},
        {"prompt": user("hi"), "images": []},
        {"prompt": user("compare these two pictures please"), "images": [image(1), image(2, 24, 16)]},
    ]
    encoded = [encode.encode_row(row, i) for i, row in enumerate(rows)]
    completions = [[65, 66, 67, 68], [70, 71, 72, 73, 74, 75, 76], [80]]

    def logprobs(indices, forward=model, bucket_by_length=False, multiple=None):  # False: one forward, padded together
        prompt_ids, prompt_mask = left_pad([encoded[i][1] for i in indices], 0)
        completion_ids, completion_mask = left_pad(
            [completions[i] for i in indices], 0
        )  # left-pad, then flip = right-pad
        completion_ids, completion_mask = completion_ids.flip(1), completion_mask.flip(1)
        completion_ids[completion_mask.bool()] = torch.cat([torch.tensor(completions[i]) for i in indices])
        if multiple:  # pad_to_multiple_of: more padding left of the prompts and right of the completions
            extra_p, extra_c = -prompt_ids.shape[1] % multiple, -completion_ids.shape[1] % multiple
            prompt_ids, prompt_mask = (torch.nn.functional.pad(t, (extra_p, 0)) for t in (prompt_ids, prompt_mask))
            completion_ids, completion_mask = (
                torch.nn.functional.pad(t, (0, extra_c)) for t in (completion_ids, completion_mask)
            )
        with torch.no_grad():
            out = completion_logprobs(
                forward,
                prompt_ids,
                prompt_mask.bool(),
                completion_ids,
                completion_mask.bool(),
                temperature=1.0,
                multimodal=[encoded[i][2] for i in indices],
                bucket_by_length=bucket_by_length,
                pad_to_multiple_of=multiple,
            )
        return out.logprobs[indices.index(0), : len(completions[0])]

    alone = logprobs([0])
    for batch in ([1, 0], [0, 2], [2, 1, 0]):
        torch.testing.assert_close(logprobs(batch), alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        logprobs([2, 1, 0], bucket_by_length=True), alone, atol=1e-5, rtol=1e-5
    )  # the default: length buckets
    for bucket_by_length in (False, True):  # image tokens keep their per-token fields under extra padding (TRL's 7)
        torch.testing.assert_close(
            logprobs([2, 1, 0], bucket_by_length=bucket_by_length, multiple=7), alone, atol=1e-5, rtol=1e-5
        )
    # The check can fail: the same batch with the images' positions or rows wrong gives other logprobs.
    control = Misaligned(model, "text positions" if arch == "qwen2_vl" else "images in reverse row order")
    assert (logprobs([2, 1, 0], control) - alone).abs().max() > 1e-3


@pytest.mark.parametrize("arch", BUILDERS)
def test_a_forward_without_images_on_sharded_weights_runs_the_vision_tower_on_the_probe(arch, monkeypatch):
    """On sharded weights every process must run the vision tower in every forward (model/multimodal.py): rows without
    images carry the probe's row, which changes none of their logprobs and puts the tower in the backward (zero
    gradients). On whole weights, or with images in the forward, no probe row is added."""
    import grouprl.model.logprobs as logprobs_module
    from grouprl.compat.trainer_parts import keep_vision_towers_in_step

    model, processor = BUILDERS[arch]()
    sharpen(model, 5.0)
    tower = getattr(model.model, {"llava": "vision_tower", "idefics3": "vision_model"}.get(arch, "visual"))
    calls = []
    tower.register_forward_hook(lambda module, args, output: calls.append(1))
    encode = encoder(processor)
    encoded = [encode.encode_row({"prompt": user(text)}, i) for i, text in enumerate(("hi", "a longer one"))]
    prompt_ids, prompt_mask = left_pad([ids for _, ids, _ in encoded], 0)
    completion_ids = torch.tensor([[65, 66, 67], [70, 71, 0]])
    completion_mask = completion_ids != 0

    def logprobs(multimodal=None):
        return completion_logprobs(
            model,
            prompt_ids,
            prompt_mask.bool(),
            completion_ids,
            completion_mask,
            temperature=1.0,
            multimodal=multimodal,
        ).logprobs

    whole = logprobs()
    assert calls == []
    monkeypatch.setattr(logprobs_module, "sharded_parameters", lambda model: True)
    monkeypatch.setattr("grouprl.compat.trainer_parts.sharded_parameters", lambda model: True)
    keep_vision_towers_in_step(encode, [model, None])
    probed = logprobs()
    assert calls == [1]
    torch.testing.assert_close(probed, whole, atol=1e-6, rtol=1e-6)
    model.zero_grad()
    probed.sum().backward()
    grads = [p.grad for p in tower.parameters()]
    # in the backward, with nothing to add (LLaVA's tower output is its next-to-last layer's: its last gets no grad)
    assert any(g is not None for g in grads) and all(g is None or not g.any() for g in grads)
    with_image = encode.encode_row({"prompt": user("look"), "images": [image(0)]}, 2)
    with torch.no_grad():
        completion_logprobs(
            model,
            torch.tensor([with_image[1]]),
            torch.ones(1, len(with_image[1]), dtype=torch.bool),
            completion_ids[:1],
            completion_mask[:1],
            temperature=1.0,
            multimodal=[with_image[2]],
        )
    assert calls == [1, 1]  # one tower call: the row's own image, no probe beside it


# ---- generation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", BUILDERS)
def test_generation_gives_each_sample_its_own_prompts_images(arch):
    model, processor = BUILDERS[arch]()
    sharpen(model)  # outputs that clearly depend on the images
    encode = encoder(processor)
    two = encode.encode_row({"prompt": user("a"), "images": [image(1), image(2)]}, 0)
    swapped = encode.encode_row({"prompt": user("a"), "images": [image(2), image(1)]}, 0)
    other = encode.encode_row({"prompt": user("something longer"), "images": [image(3)]}, 0)
    generator = TransformersGenerator(
        model, processor.tokenizer, [0], 0, suppress_token_ids=[model.config.image_token_id]
    )
    greedy = SamplingParams(max_new_tokens=8, top_k=1)

    def tokens(prompts, n):
        return [
            c.token_ids
            for c in generator.generate([p[1] for p in prompts], n, greedy, multimodal=[p[2] for p in prompts])
        ]

    alone = tokens([two], 1)[0]
    assert tokens([other, two], 2)[2:] == [alone, alone]  # batched, repeated G times, behind a longer prompt: unchanged
    assert tokens([swapped], 1)[0] != alone  # the images, in their order, reach the model


# ---- training end to end ------------------------------------------------------------------------------


def vlm_config(tmp_path, **overrides):
    values = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 6,
        "learning_rate": 0.05,
        "max_steps": 2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
        "bf16": False,
        "beta": 0.1,
        "log_completions": True,
        "num_completions_to_print": 0,
    }
    values.update(overrides)
    return GRPOConfig(**values)


def image_count_reward(prompts, completions, images, **kwargs):
    # Reward functions get TRL's arguments: prompts with their image blocks, and the images column.
    for prompt, row_images in zip(prompts, images):
        blocks = prompt[0]["content"] if row_images else []
        assert [b["image"] for b in blocks if b["type"] == "image"] == row_images
    return [len(c[0]["content"]) / 10 + len(row_images) for c, row_images in zip(completions, images)]


def test_qwen2_vl_trains_with_multi_image_prompts_reference_and_importance_sampling(tmp_path):
    model, processor = tiny_qwen2_vl()
    model.model.visual.requires_grad_(False)
    # 1 or 2 images of different sizes per prompt, and one prompt without any.
    rows = [
        {"prompt": user(f"describe {i}"), "images": [[image(i)], [image(i), image(i + 10, 16, 24)], []][i % 3]}
        for i in range(8)
    ]
    data = datasets.Dataset.from_list(rows)
    # steps_per_generation=2 > gradient_accumulation_steps=1: the second step reuses samples (old logprobs, IS ratio).
    config = vlm_config(tmp_path, steps_per_generation=2, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(model, image_count_reward, args=config, train_dataset=data, processing_class=processor)
    assert trainer.generation_backend.suppress_token_ids == [model.config.image_token_id, model.config.video_token_id]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    for name, param in model.named_parameters():
        changed = not torch.equal(param, before[name])
        assert changed == (".visual." not in name), (
            name
        )  # every trainable parameter moved; the frozen vision tower did not
    first, second = trainer.state.log_history[:2]
    assert "time/old_logprobs" in first and "time/ref_logprobs" in first and second["kl"] > 0

    table = pq.read_table(os.path.join(config.output_dir, "completions", "completions_00001.parquet")).to_pydict()
    originals = {image(i).tobytes() for i in range(20)} | {image(i, 16, 24).tobytes() for i in range(20)}
    for prompt, pngs in zip(table["prompt"], table["image"]):
        assert len(pngs) == prompt.count("<|vision_start|>")  # each row logs its prompt's images...
        assert all(Image.open(io.BytesIO(png)).tobytes() in originals for png in pngs)  # ...losslessly
    assert "<|image_pad|><|image_pad|>" not in table["prompt"][0]  # a run of image tokens is shown as one

    # The checkpoint after step 1 holds step 2's micro-batch, images included: resuming reproduces step 2 exactly.
    final = {name: p.detach().clone() for name, p in model.named_parameters()}
    fresh, _ = tiny_qwen2_vl(seed=1)
    fresh.model.visual.requires_grad_(False)
    resumed = GRPOTrainer(
        fresh,
        image_count_reward,
        args=vlm_config(tmp_path, steps_per_generation=2),
        train_dataset=data,
        processing_class=processor,
    )
    resumed.train(resume_from_checkpoint=os.path.join(config.output_dir, "checkpoint-1"))
    for name, param in fresh.named_parameters():
        assert torch.equal(param, final[name]), name


@pytest.mark.parametrize("feature", ["gfpo", "dynamic_sampling", "sync_ref_model"])
def test_every_trained_row_keeps_its_prompts_images_with_gfpo_dynamic_sampling_or_a_synced_reference(tmp_path, feature):
    """GFPO drops rows, dynamic sampling drops groups and joins rounds: each row trained on still carries its own
    prompt's images (as many image tokens in its prompt as its image grids give, the same pixels for every row of a
    prompt); a synced reference (which scores the images too) moves with the policy."""
    import re

    import grouprl.train.stages
    from grouprl import GFPOConfig, GFPOTrainer
    from grouprl.compat.gfpo import shortest_k_filter

    model, processor = tiny_qwen2_vl()
    model.model.visual.requires_grad_(False)
    rows = [
        {"prompt": user(f"describe {i}"), "images": [[image(i)], [image(i), image(i + 10, 16, 24)], []][i % 3]}
        for i in range(12)
    ]

    def reward(prompts, completions, images, **kwargs):  # even prompts tie under dynamic sampling
        ties = feature == "dynamic_sampling"
        text = [p[0]["content"][-1]["text"] if isinstance(p[0]["content"], list) else p[0]["content"] for p in prompts]
        return [
            1.0 if ties and int(t.split()[-1]) % 2 == 0 else len(c[0]["content"]) / 10 + len(i)
            for t, c, i in zip(text, completions, images)
        ]

    pixels, checked = {}, []
    backward = grouprl.train.stages.backward

    def record(run, loss, micro):
        for ids, mask, images in zip(micro.prompt_ids, micro.prompt_mask, micro.multimodal):
            number = int(re.search(r"describe (\d+)", processor.tokenizer.decode(ids[mask])).group(1))
            tokens = int((ids[mask] == model.config.image_token_id).sum())
            grids = images.per_image["image_grid_thw"] if images is not None else torch.zeros(0, 3)
            assert tokens == int(grids.prod(-1).sum()) // 4, number  # 2x2 patches merged into one token
            if images is not None:
                assert torch.equal(
                    pixels.setdefault(number, images.per_image["pixel_values"]), images.per_image["pixel_values"]
                )
            checked.append(number)
        return backward(run, loss, micro)

    options = {
        "dynamic_sampling": {"dynamic_sampling": True},
        "sync_ref_model": {"sync_ref_model": True, "ref_model_sync_steps": 1},
    }.get(feature, {})
    args = vlm_config(tmp_path, per_device_train_batch_size=6, num_generations=3, shuffle_dataset=False, **options)
    kwargs = {"args": args, "train_dataset": datasets.Dataset.from_list(rows), "processing_class": processor}
    if feature == "gfpo":
        kwargs["args"] = GFPOConfig(**{**args.to_dict(), "num_remains_in_group": 2})
        trainer = GFPOTrainer(model, reward, group_filter_func=shortest_k_filter, **kwargs)
    else:
        trainer = GRPOTrainer(model, reward, **kwargs)
    reference = [p.detach().clone() for p in trainer.ref_model.parameters()]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grouprl.train.stages, "backward", record)
        trainer.train()
    per_step = {"gfpo": 2 * 2, "dynamic_sampling": 2 * 3, "sync_ref_model": 2 * 3}[feature]
    assert len(checked) == 2 * per_step and {n % 3 for n in checked} == {0, 1, 2}  # no images, 1 image, 2 images
    if feature == "dynamic_sampling":  # the second prompt of each round of two is kept
        assert all(n % 2 == 1 for n in checked)
    moved = max((p - r).abs().max().item() for p, r in zip(trainer.ref_model.parameters(), reference))
    assert (moved > 0) == (feature == "sync_ref_model")


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
def test_llava_from_a_path_trains_a_lora_adapter_on_the_language_model(tmp_path, quantized):
    """Also QLoRA: the model's linear layers loaded in 4 bits, the adapters on the language model's."""
    peft = pytest.importorskip("peft")
    path = save_tiny_llava(tmp_path / "tiny-llava")
    data = datasets.Dataset.from_list([{"prompt": user(f"what is {i}?"), "image": image(i)} for i in range(8)])
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    quantization = {"model_init_kwargs": {"quantization_config": {"load_in_4bit": True}}} if quantized else {}
    config = vlm_config(tmp_path, log_multimodal=False, **quantization)
    trainer = GRPOTrainer(
        path,
        lambda completions, image, **k: [len(c[0]["content"]) / 10 for c in completions],
        args=config,
        train_dataset=data,
        peft_config=lora,
    )
    assert type(trainer.processing_class).__name__ == "LlavaProcessor"  # loaded with AutoProcessor
    policy = trainer.accelerator.unwrap_model(trainer.run.model)
    four_bit = [name for name, module in policy.named_modules() if type(module).__name__ == "Linear4bit"]
    assert any(".language_model." in name and name.endswith("q_proj.base_layer") for name in four_bit) == quantized
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    trainer.train()
    for name, param in policy.named_parameters():
        assert param.requires_grad == ("lora_" in name), name
        assert (not torch.equal(param, before[name])) == ("lora_B" in name or "lora_A" in name), (
            name
        )  # base and vision frozen
    assert trainer.state.log_history[1]["kl"] > 0.0  # reference = the base model (adapter off), which the adapter left
    metrics = trainer.evaluate(data.select(range(4)))  # evaluation runs the same image path
    assert metrics["eval_reward"] >= 0.0 and math.isfinite(metrics["eval_loss"])
    table = pq.read_table(os.path.join(config.output_dir, "completions", "completions_00002.parquet")).to_pydict()
    assert "image" not in table and table["prompt"][0].count("<image>") == 1  # log_multimodal=False: no images stored
    trainer.save_model()
    assert {"adapter_model.safetensors", "processor_config.json"} <= set(os.listdir(config.output_dir))


def content_length(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


@pytest.mark.parametrize("arch", BUILDERS)
def test_each_architecture_trains_every_parameter_on_image_prompts(tmp_path, arch):
    """TRL's test_train_vlm on each tiny architecture (Qwen3.5's language model is hybrid: a linear-attention layer
    and a full-attention one): one step moves every parameter, but those LLaVA never reads (its features are the
    vision tower's next-to-last layer's, as the real model's: the last layer and post_layernorm get no gradient)."""
    model, processor = BUILDERS[arch]()
    rows = [{"prompt": user(f"describe {i}"), "images": [image(i)]} for i in range(4)]
    config = vlm_config(tmp_path, max_steps=1, learning_rate=0.1, beta=0.0)
    trainer = GRPOTrainer(
        model,
        content_length,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=processor,
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    still = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    unread = [name for name in before if arch == "llava" and ("encoder.layers.1." in name or "post_layernorm" in name)]
    assert still == unread, still


def test_the_captured_loop_samples_text_prompts_and_generate_those_with_images(tmp_path, monkeypatch):
    """generation_engine='captured' on a vision-language model (LLaVA's Llama here; Gemma 3 4B and up on a GPU): a
    sampling call whose prompts are text only runs through its language model in the captured loop, a call with an
    image prompt through transformers generate with its images; the run trains."""
    model, processor = tiny_llava()
    calls = {"captured": 0, "images": 0}
    captured_sample, generate = CapturedGenerator._sample, TransformersGenerator.generate

    def counted_sample(self, *args, **kwargs):
        calls["captured"] += 1
        return captured_sample(self, *args, **kwargs)

    def counted_generate(self, *args, multimodal=None, **kwargs):
        calls["images"] += multimodal is not None and any(m is not None for m in multimodal)
        return generate(self, *args, multimodal=multimodal, **kwargs)

    monkeypatch.setattr(CapturedGenerator, "_sample", counted_sample)
    monkeypatch.setattr(TransformersGenerator, "generate", counted_generate)
    rows = [{"prompt": user(f"describe {i}"), "images": [image(i)] if i % 4 == 0 else []} for i in range(8)]
    config = vlm_config(tmp_path, generation_engine="captured", max_steps=4, per_device_train_batch_size=2)
    trainer = GRPOTrainer(
        model,
        content_length,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=processor,
    )
    assert trainer.generation_backend.engine.suppress_token_ids == [model.config.image_token_id]
    trainer.train()
    assert calls["captured"] > 0 and calls["images"] > 0, calls
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)


def sampling_rollout_func(form):
    """A rollout_func that samples each entry through the trainer's backend with its images, returning the prompt ids
    in `form`: as the processor expands them, or one placeholder per image (what vLLM takes)."""

    def rollout_func(prompts, trainer):
        ids, images = encode_prompts(trainer, prompts)
        completions = trainer.generation_backend.generate(ids, 1, trainer.run.rollouts.sampling, multimodal=images)
        return {
            "prompt_ids": ids if form == "expanded" else [m.placeholder_ids for m in images],
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": None,
        }

    return rollout_func


def one_forward_logprobs(model, processor, prompt, completion_ids):
    """The completion's logprobs from one forward over the processor's encoding of `prompt` (messages holding their
    images) followed by the completion."""
    inputs = processor.apply_chat_template(
        prompt, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True
    )
    n = len(completion_ids)
    ids = torch.cat([inputs["input_ids"], torch.tensor([completion_ids])], 1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    extra = {
        k: torch.cat([v, v.new_zeros(1, n)], 1) if v.shape == inputs["input_ids"].shape else v for k, v in extra.items()
    }
    device = next(model.parameters()).device  # the trainer's (CUDA where there is one)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **extra}
    with torch.no_grad():
        logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits[0, :-1].float().cpu()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[-n:, 0]


@pytest.mark.parametrize("form", ["expanded", "placeholders"])
def test_a_rollout_func_trains_image_prompts_with_their_images(tmp_path, form):
    model, processor = tiny_qwen2_vl()
    sharpen(model, 5.0)  # outputs that clearly depend on the images
    rows = [{"prompt": user(f"describe {i}"), "images": [image(i)]} for i in range(4)]
    config = vlm_config(tmp_path, max_steps=1, beta=0.0, shuffle_dataset=False)
    trainer = GRPOTrainer(
        model,
        image_count_reward,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=processor,
        rollout_func=sampling_rollout_func(form),
    )
    rollout = trainer.run.rollouts.sample()
    trained = trained_logprobs(model, rollout.prompts, rollout.completions)
    blank = Image.new("RGB", (16, 16))
    for row, completion in enumerate(rollout.completions):
        assert completion.prompt_ids == rollout.prompts.prompt_ids[completion.prompt_index]  # the expanded ids
        prompt = rollout.prompts.prompts[completion.prompt_index]  # the messages, holding the row's image
        n = len(completion.token_ids)
        expected = one_forward_logprobs(model, processor, prompt, completion.token_ids)
        assert torch.allclose(trained[row, :n], expected, atol=1e-4)
        without = [{**prompt[0], "content": [{**prompt[0]["content"][0], "image": blank}, *prompt[0]["content"][1:]]}]
        assert (one_forward_logprobs(model, processor, without, completion.token_ids) - expected).abs().max() > 1e-3
    # a prompt repeated for its samples (as a rollout_func receives it) goes through the processor once
    calls, tokenize = [], trainer.run.rollouts.tokenize
    tokenize.encode_messages = lambda *args, real=tokenize.encode_messages: calls.append(1) or real(*args)
    repeated = [copy.deepcopy(p) for p in rollout.prompts.prompts for _ in range(2)]
    ids, _ = encode_prompts(trainer, repeated)
    assert len(calls) == len(rollout.prompts.prompts) and ids == [
        i for i in rollout.prompts.prompt_ids for _ in range(2)
    ]
    del tokenize.encode_messages
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters() if ".visual." not in name)


def test_a_rollout_funcs_prompt_ids_that_do_not_match_the_images_are_named(tmp_path):
    model, processor = tiny_qwen2_vl()
    rows = [{"prompt": user(f"describe {i}"), "images": [image(i)]} for i in range(4)]

    def text_only(prompts, trainer):  # renders the text and drops the images
        ids = [processor.tokenizer(p[0]["content"][-1]["text"])["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [[5, 6]] * len(prompts), "logprobs": None}

    trainer = GRPOTrainer(
        model,
        image_count_reward,
        args=vlm_config(tmp_path, max_steps=1),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=processor,
        rollout_func=text_only,
    )
    with pytest.raises(
        ValueError,
        match=r"rollout_func text_only: completion 0 \(row \d+, an image prompt\): its "
        r"prompt_ids \(\d+ tokens\) are not the processor's encoding.*encode_prompts",
    ):
        trainer.run.rollouts.sample()

    image_token = model.config.image_token_id

    def image_in_completion(prompts, trainer):
        ids, _ = encode_prompts(trainer, prompts)
        return {"prompt_ids": ids, "completion_ids": [[5, image_token, 6]] * len(prompts), "logprobs": None}

    trainer.rollout_func = image_in_completion
    with pytest.raises(ValueError, match="has image tokens in its completion_ids"):
        trainer.run.rollouts.sample()


def test_images_without_a_processor_fail_before_training(tiny_model_dir, tmp_path):
    data = datasets.Dataset.from_list([{"prompt": user("x"), "image": image(0)} for _ in range(4)])
    with pytest.raises(
        ValueError, match="train_dataset has an 'image' column but processing_class is a .*not a processor"
    ):
        GRPOTrainer(
            tiny_model_dir,
            lambda completions, **k: [0.0] * len(completions),
            args=vlm_config(tmp_path, beta=0.0),
            train_dataset=data,
        )


def test_images_are_png_encoded_arrays_too():
    from grouprl.rollout.completion_log import png_bytes

    pixels = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png_bytes(pixels)))), pixels)


def test_rollout_selection_concatenation_and_packing_keep_each_prompts_images():
    # Dynamic sampling selects and concatenates rollouts; packing and micro-batching pick rows.
    a, b = PromptImages(per_image={"x": torch.zeros(1)}), PromptImages(per_image={"x": torch.ones(1)})
    batch = PromptBatch(["p0", "p1", "p2"], [[1], [2], [3]], {}, [0, 1, 2], [0, 1, 2], [2, 2, 2], [a, None, b])
    picked = Rollout(batch, [Completion(i // 2, [5], "", "stop") for i in range(6)]).select_prompts([2, 0])
    assert picked.prompts.multimodal == [b, a]
    text = Rollout(PromptBatch(["q"], [[4]], {}, [3], [3], [2]), [Completion(0, [5], "", "stop")] * 2)
    joined = Rollout.concat([text, picked, text])
    assert joined.prompts.multimodal == [None, b, a, None]
    packed = pack_rollout(joined, torch.zeros(8), 0, False)
    assert packed.multimodal == [None, None, b, b, a, a, None, None]
    assert packed.select(torch.tensor([4, 2])).multimodal == [a, b]
    assert pack_rollout(text, torch.zeros(2), 0, False).multimodal is None


def test_the_documented_example_trains(tmp_path, monkeypatch):
    pytest.importorskip("peft")  # the example trains a LoRA adapter
    page = os.path.join(os.path.dirname(__file__), "..", "docs", "vision_language.md")
    with open(page, encoding="utf-8") as handle:
        script = handle.read().split("```python\n", 1)[1].split("```", 1)[0]
    path = save_tiny_llava(tmp_path / "tiny-llava")
    for hub, local in (
        ('"Qwen/Qwen2.5-VL-3B-Instruct"', repr(path)),
        ('output_dir="vlm-GRPO"', 'output_dir="vlm-GRPO", max_steps=2, logging_steps=1'),
    ):
        assert script.count(hub) == 1, hub
        script = script.replace(hub, local)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(script, "docs/vision_language.md", "exec"), namespace)  # noqa: S102 (the page's own code)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2 and "rewards/color_reward/mean" in trainer.state.log_history[0]
    table = pq.read_table(tmp_path / "vlm-GRPO" / "completions" / "completions_00002.parquet").to_pydict()
    assert all(len(images) == 1 for images in table["image"])


def test_the_command_line_trains_a_vlm_from_a_dataset_with_images(tmp_path):
    from grouprl.cli import main

    path = save_tiny_llava(tmp_path / "tiny-llava")
    datasets.Dataset.from_list([{"prompt": user(f"what is {i}?"), "image": image(i)} for i in range(4)]).save_to_disk(
        str(tmp_path / "data")
    )
    out = tmp_path / "out"
    code = main(
        [
            "train",
            "--model_name_or_path",
            path,
            "--dataset_name",
            str(tmp_path / "data"),
            "--reward_funcs",
            "get_repetition_penalty_reward",
            "--output_dir",
            str(out),
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "6",
            "--max_steps",
            "1",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    assert {"model.safetensors", "processor_config.json"} <= set(os.listdir(out))  # the trained VLM and its processor
