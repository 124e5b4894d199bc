"""Tiny vision-language models built locally (no hub): Qwen2-VL and LLaVA (CLIP vision + Llama).

Each builder returns ``(model, processor)``: a randomly initialised model of a few thousand
parameters and a real transformers processor (PIL image processor with explicit sizes, the demo's
byte-level BPE tokenizer plus the architecture's image tokens, and a chat template that emits them).
The processor expands each image placeholder to as many image tokens as the vision tower yields,
exactly as with a Hub checkpoint.

Images are small numpy-made RGB arrays, so tests need no files.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grouprl.demo.tokenizer import EOS_TOKEN, IM_END, IM_START, TOOL_CALLS, _vocab_and_merges

# ChatML with content blocks: an image block renders as `image_markup`, a text block as its text.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'image' %}{{- IMAGE_MARKUP }}"
    "{%- elif block['type'] == 'text' %}{{- block['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# The same with tools (the tiny models' short contexts: the system turn names them), Hermes-style calls, and content
# blocks in every role, tool results included: a tool that returns an image shows it to the model.
TOOL_CHAT_TEMPLATE = (
    "{%- macro render(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- else %}{%- for block in content %}"
    "{%- if block['type'] == 'image' %}{{- IMAGE_MARKUP }}"
    "{%- elif block['type'] == 'text' %}{{- block['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\ntools: ' + (tools | map(attribute='function') | map(attribute='name') | join(', ')) }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + render(message['content'] or '') }}" + TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + render(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def with_tool_template(processor):
    """The processor (and its tokenizer) rendering tools and image blocks in tool results (TOOL_CHAT_TEMPLATE)."""
    template = TOOL_CHAT_TEMPLATE.replace("IMAGE_MARKUP", repr(processor.tokenizer.image_markup))
    processor.chat_template = processor.tokenizer.chat_template = template
    return processor


def end_turns_at_im_end(model, tokenizer) -> int:
    """Make the chat template's end-of-turn token, <|im_end|>, end generation too, as Qwen's and SmolVLM's generation
    configs do (the tiny models end at EOS only; multi-turn rollouts need the turns' end); its id."""
    end_of_turn = tokenizer.convert_tokens_to_ids(IM_END)
    model.generation_config.eos_token_id = [model.generation_config.eos_token_id, end_of_turn]
    return end_of_turn


def build_vlm_tokenizer(image_tokens: tuple[str, ...], image_markup: str) -> PreTrainedTokenizerFast:
    vocab, merges = _vocab_and_merges()
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END, *image_tokens],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE.replace("IMAGE_MARKUP", repr(image_markup))
    tokenizer.image_markup = image_markup  # what the chat template writes for an image block
    return tokenizer


@contextlib.contextmanager
def _seeded(seed: int):
    """Seeded for the block; the caller's global RNG state is restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _image_only(processor_class):
    """The processor without its video processor, whose base class needs torchvision (not installed here)."""

    class ImageOnly(processor_class):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    ImageOnly.__name__ = processor_class.__name__
    return ImageOnly


QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _tiny_qwen_vl(
    model_class, config_class, processor_class, text: dict, vision: dict, seed: int, model_from: str | None
):
    """A Qwen-family VLM (M-RoPE positions from image grids, per-token mm_token_type_ids, pixel patches): 4x4-pixel
    patches merged 2x2, so a 16x16 image is 4 image tokens, 16x24 is 6."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_vlm_tokenizer(QWEN_VISION_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = config_class(
        text_config={
            "vocab_size": len(tokenizer),
            "bos_token_id": eos,
            "eos_token_id": eos,
            "pad_token_id": eos,
            **text,
        },
        vision_config={"patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, **vision},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    if model_from is not None:
        model = model_class.from_pretrained(model_from)
    else:
        with _seeded(seed):
            model = model_class(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32
    )
    processor = _image_only(processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    return model, processor


def _qwen_text(max_position_embeddings: int, **more) -> dict:
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
        **more,
    }


def tiny_qwen2_vl(seed: int = 0, model_from: str | None = None, max_position_embeddings: int = 256):
    """Qwen2-VL. `model_from`: the model loaded from a directory `save_tiny_qwen2_vl` wrote (built here, it cannot be
    under DeepSpeed ZeRO-3)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    return _tiny_qwen_vl(
        Qwen2VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLProcessor,
        _qwen_text(max_position_embeddings, rope_parameters=rope),
        {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2},
        seed,
        model_from,
    )


def tiny_qwen2_5_vl(seed: int = 0):
    """Qwen2.5-VL: Qwen2-VL's layout with a windowed vision tower (one window layer, one full)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
    return _tiny_qwen_vl(
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLConfig,
        Qwen2_5_VLProcessor,
        _qwen_text(256, rope_parameters=rope),
        {**vision, "window_size": 16, "fullatt_block_indexes": [1]},
        seed,
        None,
    )


def tiny_qwen3_5(seed: int = 0):
    """Qwen3.5: a hybrid language model (a gated-delta-rule linear-attention layer, then a full-attention one) with
    interleaved M-RoPE on part of each head, and Qwen3-VL's processor."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    }
    linear = {
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    }
    text = _qwen_text(256, head_dim=16, layer_types=["linear_attention", "full_attention"], rope_parameters=rope)
    return _tiny_qwen_vl(
        Qwen3_5ForConditionalGeneration,
        Qwen3_5Config,
        Qwen3VLProcessor,
        {**text, **linear},
        {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 64,
        },
        seed,
        None,
    )


def tiny_llama_config(vocab_size: int, eos: int, hidden_size: int = 32, **more):
    """The language model of the tiny VLMs: 2 layers, 4 query / 2 key-value heads, EOS for BOS and padding."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        **more,
    )


def tiny_llava(seed: int = 0):
    """LLaVA: a 1-layer CLIP vision tower on 16x16 images (4x4 patches: 16 image tokens) and a tiny Llama."""
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.llava.image_processing_pil_llava import (
        LlavaImageProcessorPil,
    )

    tokenizer = build_vlm_tokenizer(("<image>",), "<image>")
    eos, image_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids("<image>")
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
            projection_dim=16,
        ),
        text_config=tiny_llama_config(len(tokenizer), eos),
        image_token_id=image_id,
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    with _seeded(seed):
        model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )
    return model, processor


def tiny_idefics3(seed: int = 0, hidden_size: int = 32):
    """Idefics3 (SmolVLM's architecture): a 1-layer SigLIP-style vision tower on 32x32 images (8x8 patches, merged
    2x2: 4 image tokens, between `<fake_token_around_image><global-img>` and `<fake_token_around_image>`) and a tiny
    Llama. `hidden_size` 128 gives the text model heads of 32 (vLLM's CPU attention needs >= 32). vLLM's CPU build
    serves this architecture without torchvision (its LLaVA and Qwen2-VL modules import it)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.configuration_idefics3 import (
        Idefics3VisionConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tokenizer = build_vlm_tokenizer(
        ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"), "<image>"
    )
    eos, image_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids("<image>")
    text = tiny_llama_config(len(tokenizer), eos, hidden_size, tie_word_embeddings=True)
    vision = Idefics3VisionConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=image_id,
        scale_factor=2,
        tie_word_embeddings=True,
    )
    with _seeded(seed):
        model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 32}, max_image_size={"longest_edge": 32}, do_image_splitting=False
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=tokenizer.chat_template
    )
    return model, processor


# every tiny architecture, by the name the parametrized tests give it
BUILDERS = {
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": tiny_qwen2_5_vl,
    "qwen3_5": tiny_qwen3_5,
    "llava": tiny_llava,
    "idefics3": tiny_idefics3,
}


def save_tiny_idefics3(path, hidden_size: int = 32) -> str:
    """The tiny Idefics3 and its processor saved like a Hub checkpoint."""
    model, processor = tiny_idefics3(hidden_size=hidden_size)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def save_tiny_qwen2_vl(path) -> str:
    """The tiny Qwen2-VL's weights (seed 0), for tiny_qwen2_vl(model_from=path), and its tokenizer (what `grouprl
    serve` loads besides the model)."""
    model, processor = tiny_qwen2_vl()
    model.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    return str(path)


def save_tiny_llava(path) -> str:
    """The tiny LLaVA and its processor saved like a Hub checkpoint
    (AutoModelForImageTextToText / AutoProcessor load it)."""
    model, processor = tiny_llava()
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def image(seed: int, height: int = 16, width: int = 16) -> Image.Image:
    """A random RGB image (deterministic in `seed`)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def sharpen(model: torch.nn.Module, factor: float = 20.0) -> torch.nn.Module:
    """Scale every weight matrix but the embeddings, so a random tiny model's outputs depend clearly on its
    images: generation tests can then tell which images a prompt was given from its greedy completion."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(factor)
    return model


def trained_logprobs(model, prompts, completions):
    """(rows, T) the completions' logprobs as training computes them: packed into a train batch, each row with its
    rollout's image inputs."""
    from grouprl.core.types import Rollout
    from grouprl.model.logprobs import completion_logprobs
    from grouprl.rollout.train_batch import pack_rollout

    batch = pack_rollout(Rollout(prompts, completions), torch.zeros(len(completions)), 0, mask_truncated=False)
    device = next(model.parameters()).device  # the trainer's (CUDA where there is one)
    with torch.no_grad():
        return completion_logprobs(
            model,
            batch.prompt_ids.to(device),
            batch.prompt_mask.to(device),
            batch.completion_ids.to(device),
            batch.completion_mask.to(device),
            temperature=1.0,
            multimodal=batch.multimodal,
        ).logprobs.cpu()
