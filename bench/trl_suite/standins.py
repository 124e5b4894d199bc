"""Builds offline stand-ins of the Hub models and datasets TRL's GRPO tests load, in cache layouts.

Models go into a Hugging Face hub cache (``<root>/hub/models--<org>--<name>/snapshots/<rev>/``) and
datasets into a ``datasets`` cache (``<root>/datasets/<org>___<name>/<config>/0.0.0/<hash>/``), so
with ``HF_HOME=<root>`` and ``HF_HUB_OFFLINE=1`` the tests' own ids (``"trl-internal-testing/zen"``,
``"trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"``) resolve with no patching of the code under test.

Models are randomly initialised with the tiny sizes TRL's own tiny checkpoints use (hidden size 8,
two layers) and the real vocabulary sizes; tokenizers come from ``standin_tokenizers``. The zen
datasets are the Zen of Python split into prompt / completion as TRL's are (the order of the first
12 prompts is asserted by a test). Vision-language models (``build_vlm_models``) are saved with their
real processor class (image processor, tokenizer with the architecture's image tokens, chat template).

Run with the Python of the environment that has ``trl`` installed (its chat templates are read):
``python -m bench.trl_suite.standins <root>`` (or let ``run_suite.py`` do it). Parts already listed in
``<root>/standins.json`` are kept; only missing ones are built.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from . import standin_tokenizers as tok

ORG = "trl-internal-testing"

# The Zen of Python as (prompt, completion): the first 17 lines are `train`, the last 2 `test`.
ZEN = [
    ("Beautiful is better than", " ugly."),
    ("Explicit is", " better than implicit."),
    ("Simple is better", " than complex."),
    ("Complex", " is better than complicated."),
    ("Flat is better than", " nested."),
    ("Sparse is better", " than dense."),
    ("Readability", " counts."),
    ("Special cases aren't special", " enough to break the rules."),
    ("Although practicality beats", " purity."),
    ("Errors should never", " pass silently."),
    ("Unless explicitly", " silenced."),
    ("In the face of ambiguity, refuse", " the temptation to guess."),
    ("There should be one-- and preferably", " only one --obvious way to do it."),
    ("Although that way may not be", " obvious at first unless you're Dutch."),
    ("Now is better", " than never."),
    ("Although never is often better than", " *right* now."),
    ("If the implementation is hard to explain,", " it's a bad idea."),
    ("If the implementation is easy to explain,", " it may be a good idea."),
    ("Namespaces are one honking great idea --", " let's do more of those!"),
]
TRAIN_ROWS = 17


def _revision(name: str) -> str:
    return hashlib.sha1(f"grouprl-standin:{name}".encode()).hexdigest()


def snapshot_dir(root: Path, repo_id: str, kind: str = "models") -> Path:
    """Creates the hub-cache entry of `repo_id` (refs/main -> a fixed revision) and returns its snapshot folder."""
    org, name = repo_id.split("/")
    repo = root / "hub" / f"{kind}--{org}--{name}"
    revision = _revision(repo_id)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


# --- text models ----------------------------------------------------------------------------------

SMALL = dict(hidden_size=8, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _token_ids(spec: tok.TokenizerSpec) -> dict[str, int]:
    ids = {text: token_id for token_id, text in spec.specials.items()}
    return {
        "bos_token_id": ids.get(spec.bos) if spec.bos else None,
        "eos_token_id": ids[spec.eos],
        "pad_token_id": ids.get(spec.pad) if spec.pad else None,
    }


def _save_model(
    root: Path, repo_id: str, model, spec: tok.TokenizerSpec, generation_eos: list[int] | None = None
) -> None:
    from transformers import GenerationConfig

    path = snapshot_dir(root, repo_id)
    model.save_pretrained(path, safe_serialization=True)
    ids = _token_ids(spec)
    GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=generation_eos or ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    ).save_pretrained(path)
    tok.save(spec, path)


def _causal_lm(config_class, model_class, spec, seed, **overrides):
    import torch

    config = config_class(
        vocab_size=spec.vocab_size, max_position_embeddings=32768, **{**SMALL, **_token_ids(spec), **overrides}
    )
    torch.manual_seed(seed)
    return model_class(config)


def _sequence_classifier(config_class, model_class, spec, seed, **overrides):
    import torch

    config = config_class(
        vocab_size=spec.vocab_size,
        max_position_embeddings=32768,
        num_labels=1,
        **{**SMALL, **_token_ids(spec), **overrides},
    )
    torch.manual_seed(seed)
    return model_class(config)


# Vocabulary of the stand-in policies whose tests never name token ids. On CPU a GRPO step costs in
# proportion to the vocabulary (log-probabilities, sampling), and the real 151k-256k vocabularies made one
# test take minutes on two shared cores. 32768 keeps the chance that a random model emits EOS within a
# few hundred 8-token completions small, which `test_training_with_mask_truncated_completions_all_masked`
# relies on. Kept real: the Qwen3-MoE policy (the tool-calling tests script completions as Qwen ids) and
# the reward models (no vocabulary-sized output).
COMPACT_VOCAB = 32768


def _eos_ids(spec: tok.TokenizerSpec, *tokens: str) -> list[int]:
    ids = {text: token_id for token_id, text in spec.specials.items()}
    return [ids[t] for t in tokens]


def build_text_models(root: Path) -> list[str]:
    import transformers as tf

    qwen25, qwen3 = tok.qwen("qwen2_5.jinja", COMPACT_VOCAB), tok.qwen("qwen3.jinja", COMPACT_VOCAB)
    qwen25_full, qwen3_full = tok.qwen("qwen2_5.jinja"), tok.qwen("qwen3.jinja")
    llama = tok.llama3("llama3_2.jinja")
    gemma2 = tok.gemma("gemma.jinja", vocab_size=COMPACT_VOCAB)
    built = []

    def add(name, model, spec, generation_eos=None):
        _save_model(root, f"{ORG}/{name}", model, spec, generation_eos)
        built.append(f"{ORG}/{name}")

    add(
        "tiny-Qwen2ForCausalLM-2.5",
        _causal_lm(tf.Qwen2Config, tf.Qwen2ForCausalLM, qwen25, 0, tie_word_embeddings=True),
        qwen25,
        _eos_ids(qwen25, "<|im_end|>", "<|endoftext|>"),
    )
    add(
        "tiny-Qwen2ForSequenceClassification-2.5",
        _sequence_classifier(
            tf.Qwen2Config, tf.Qwen2ForSequenceClassification, qwen25_full, 1, tie_word_embeddings=True
        ),
        qwen25_full,
    )
    add(
        "tiny-Qwen3ForCausalLM",
        _causal_lm(tf.Qwen3Config, tf.Qwen3ForCausalLM, qwen3, 2, head_dim=4, tie_word_embeddings=False),
        qwen3,
        _eos_ids(qwen3, "<|im_end|>", "<|endoftext|>"),
    )
    add(
        "tiny-Qwen3ForSequenceClassification",
        _sequence_classifier(tf.Qwen3Config, tf.Qwen3ForSequenceClassification, qwen3_full, 3, head_dim=4),
        qwen3_full,
    )
    add(
        "tiny-Qwen3MoeForCausalLM",
        _causal_lm(
            tf.Qwen3MoeConfig,
            tf.Qwen3MoeForCausalLM,
            qwen3_full,
            4,
            head_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        ),
        qwen3_full,
        _eos_ids(qwen3_full, "<|im_end|>", "<|endoftext|>"),
    )
    add(
        "tiny-Gemma2ForCausalLM",
        _causal_lm(tf.Gemma2Config, tf.Gemma2ForCausalLM, gemma2, 5, head_dim=4, tie_word_embeddings=True),
        gemma2,
        [1, 107],
    )
    add(
        "tiny-LlamaForSequenceClassification-3.2",
        _sequence_classifier(tf.LlamaConfig, tf.LlamaForSequenceClassification, llama, 6, tie_word_embeddings=True),
        llama,
    )
    return built


# Architectures TRL's `test_train` (and its MoE PEFT and remote-code tests) load by name. TRL's tiny checkpoints
# carry each family's own tokenizer; these take the compact Qwen2.5 one (the tests feed standard prompts, so no
# chat template is rendered): what they check is that each architecture trains.
RESIZED = dict(hidden_size=32, intermediate_size=64, head_dim=8)  # Mamba-2's heads need a wider stream than 8


def _cohere2(tf, spec):
    layers = ["sliding_attention", "full_attention"]
    return _causal_lm(tf.Cohere2Config, tf.Cohere2ForCausalLM, spec, 7, sliding_window=4, layer_types=layers)


def _glm4_moe(tf, spec):
    experts = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1)
    return _causal_lm(tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, spec, 8, first_k_dense_replace=1, **experts)


def _gpt_oss(tf, spec):  # attention sinks, sliding windows, experts stacked as parameters (LoRA: target_parameters)
    layers = ["sliding_attention", "full_attention"]
    experts = dict(num_local_experts=4, num_experts_per_tok=2)
    return _causal_lm(
        tf.GptOssConfig, tf.GptOssForCausalLM, spec, 9, head_dim=4, sliding_window=4, layer_types=layers, **experts
    )


def _nemotron_h(tf, spec):  # Mamba-2, attention and MLP-only layers
    return _causal_lm(
        tf.NemotronHConfig,
        tf.NemotronHForCausalLM,
        spec,
        10,
        **RESIZED,
        num_hidden_layers=3,
        hybrid_override_pattern="M*-",
    )


REMOTE_CONFIG = """from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
"""
REMOTE_MODELING = """from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
"""


def _save_remote_code(root: Path, repo_id: str) -> None:
    """A Qwen2 checkpoint whose config names classes of its own, in files of its own (loaded only with
    trust_remote_code=True)."""
    path = snapshot_dir(root, repo_id)
    (path / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (path / "modeling_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="remote",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))


ARCHITECTURE_BUILDERS = {
    f"{ORG}/tiny-Cohere2ForCausalLM": _cohere2,
    f"{ORG}/tiny-Glm4MoeForCausalLM": _glm4_moe,
    f"{ORG}/tiny-GptOssForCausalLM": _gpt_oss,
    f"{ORG}/tiny-NemotronHForCausalLM-nano": _nemotron_h,
    f"{ORG}/tiny-RemoteForCausalLM": lambda tf, spec: _causal_lm(tf.Qwen2Config, tf.Qwen2ForCausalLM, spec, 11),
}


def build_architecture_models(root: Path, built: list[str] | tuple = ()) -> list[str]:
    """Builds the stand-ins of ARCHITECTURE_BUILDERS not in `built`; returns all of them."""
    import transformers as tf

    spec = tok.qwen("qwen2_5.jinja", COMPACT_VOCAB)
    built = list(built)
    for repo_id, build in ARCHITECTURE_BUILDERS.items():
        if repo_id not in built:
            _save_model(root, repo_id, build(tf, spec), spec, _eos_ids(spec, "<|im_end|>", "<|endoftext|>"))
            if repo_id.endswith("RemoteForCausalLM"):
                _save_remote_code(root, repo_id)
            built.append(repo_id)
    return built


# --- vision-language models -----------------------------------------------------------------------

# Gemma 3: a 2-layer SigLIP tower on 16x16 images (4x4-pixel patches: a 4x4 grid, average-pooled 2x2 to
# mm_tokens_per_image=4 image tokens) and a 2-layer Gemma 3 text model over a 16384-token vocabulary
# (about 0.3M parameters, most of them the embeddings). TRL's tiny checkpoint has 224x224 images, 256
# image tokens and the real 262k vocabulary; only the sizes differ, the layout of a prompt does not.
GEMMA3_VOCAB = 16384
GEMMA3_IMAGE_SIZE = 16
GEMMA3_IMAGE_TOKENS = 4


def _save_vlm(path: Path, model, spec: tok.TokenizerSpec, generation_eos: list[int]) -> None:
    from transformers import GenerationConfig

    model.save_pretrained(path, safe_serialization=True)
    ids = _token_ids(spec)
    GenerationConfig(
        bos_token_id=ids["bos_token_id"], eos_token_id=generation_eos, pad_token_id=ids["pad_token_id"]
    ).save_pretrained(path)


def _save_processor(path: Path, processor) -> None:
    """Saves the processor (its tokenizer files replace those `tok.save` wrote, same content plus the processor's
    keys), less the keys loading from a local folder adds to the tokenizer's config."""
    processor.save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    saved = {k: v for k, v in json.loads(config_file.read_text()).items() if k not in ("is_local", "local_files_only")}
    config_file.write_text(json.dumps(saved, indent=2))


def _vlm_snapshot(root: Path, repo_id: str, spec: tok.TokenizerSpec):
    """The stand-in's folder with its tokenizer saved: (folder, that tokenizer loaded back, its special-token ids)."""
    import transformers as tf

    path = snapshot_dir(root, repo_id)
    tok.save(spec, path)
    return path, tf.AutoTokenizer.from_pretrained(path), _token_ids(spec)


def _gemma3_for_conditional_generation(root: Path) -> str:
    import torch
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    repo_id = f"{ORG}/tiny-Gemma3ForConditionalGeneration"
    spec = tok.gemma3("gemma3.jinja", GEMMA3_VOCAB)
    path, tokenizer, special = _vlm_snapshot(root, repo_id, spec)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in tok.GEMMA3_IMAGE_TOKENS.items()}
    config = tf.Gemma3Config(
        text_config=tf.Gemma3TextConfig(
            vocab_size=GEMMA3_VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            max_position_embeddings=32768,
            **special,
        ),
        vision_config=tf.SiglipVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=GEMMA3_IMAGE_SIZE,
            patch_size=4,
            vision_use_head=False,
        ),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(7)
    model = tf.Gemma3ForConditionalGeneration(config)  # projector zero-initialised, as in TRL's checkpoint
    _save_vlm(path, model, spec, _eos_ids(spec, "<eos>", "<end_of_turn>"))
    image_processor = Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE})
    processor = tf.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=GEMMA3_IMAGE_TOKENS,
    )
    _save_processor(path, processor)
    return repo_id


# LLaVA-NeXT (Mistral): a 2-layer CLIP tower on 16x16 crops (4x4-pixel patches, 16 features a crop after the
# CLS is dropped) with "anyres" grid pinpoints scaled down as the crops are (real: 336-pixel crops, 14-pixel
# patches): a 32x32 image is its 16x16 thumbnail plus a 2x2 grid of crops, 88 image tokens. Text: a 2-layer
# Mistral over a 16384-token vocabulary. vision_feature_layer=-2 as the real model, which leaves the tower's
# last layer and post_layernorm unused (TRL's test checks exactly that).
LLAVA_NEXT_VOCAB = 16384
LLAVA_NEXT_CROP = 16
LLAVA_NEXT_PINPOINTS = [[16, 32], [32, 16], [32, 32], [48, 16], [16, 48]]


def _llava_next_for_conditional_generation(root: Path) -> str:
    import torch
    import transformers as tf
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    repo_id = f"{ORG}/tiny-LlavaNextForConditionalGeneration"
    spec = tok.llava_next_mistral("llava_next.jinja", LLAVA_NEXT_VOCAB)
    path, tokenizer, special = _vlm_snapshot(root, repo_id, spec)
    config = tf.LlavaNextConfig(
        vision_config=tf.CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=LLAVA_NEXT_CROP,
            patch_size=4,
            projection_dim=16,
        ),
        text_config=tf.MistralConfig(
            vocab_size=LLAVA_NEXT_VOCAB,
            max_position_embeddings=32768,
            **{**SMALL, "hidden_size": 16, "head_dim": 4},
            **special,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=(LLAVA_NEXT_CROP // 4) ** 2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(8)
    model = tf.LlavaNextForConditionalGeneration(config)
    _save_vlm(path, model, spec, _eos_ids(spec, "</s>"))
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": LLAVA_NEXT_CROP},
        crop_size={"height": LLAVA_NEXT_CROP, "width": LLAVA_NEXT_CROP},
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
    )
    processor = tf.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )
    _save_processor(path, processor)
    return repo_id


# The Qwen vision-language family (Qwen2-VL, Qwen2.5-VL, Qwen3.5 and its MoE): 4x4-pixel patches merged 2x2, so a
# 32x32 image is 16 image tokens (real: 14- or 16-pixel patches); a 2-layer language model of hidden size 32 (M-RoPE
# needs a few rotary dimensions per section); saved with the real processor classes, video processor included
# (it needs torchvision). Compact Qwen vocabularies, but Qwen3.5's real one: its tool test names ids up to 248059.
QWEN_VL_VOCAB = 16384
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
QWEN_PATCHES = dict(patch_size=4, temporal_patch_size=2, merge_size=2)


def _qwen_vl(
    root: Path, repo_id: str, spec, names: tuple[str, str, str, str, str], text: dict, vision: dict, seed: int
):
    """`names`: the model, config, processor, image processor and video processor classes (transformers')."""
    import torch
    import transformers as tf

    model_class, config_class, processor_class, image_class, video_class = (getattr(tf, n) for n in names)
    path, tokenizer, special = _vlm_snapshot(root, repo_id, spec)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    config = config_class(
        text_config={"vocab_size": spec.vocab_size, "max_position_embeddings": 32768, **QWEN_TEXT, **special, **text},
        vision_config={"patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, **vision},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = model_class(config)
    _save_vlm(path, model, spec, _eos_ids(spec, "<|im_end|>", "<|endoftext|>"))
    pixels = {"min_pixels": 8 * 8, "max_pixels": 64 * 64}
    processor = processor_class(
        image_processor=image_class(**QWEN_PATCHES, **pixels),
        tokenizer=tokenizer,
        video_processor=video_class(**QWEN_PATCHES),
        chat_template=tokenizer.chat_template,
    )
    _save_processor(path, processor)
    return repo_id


MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
# Qwen3.5: a hybrid language model (a gated-delta-rule linear-attention layer, then a full-attention one) with
# interleaved M-RoPE on half of each head
QWEN3_5_TEXT = dict(
    head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={**MROPE, "mrope_interleaved": True, "partial_rotary_factor": 0.5},
)
QWEN3_5_VISION = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, num_position_embeddings=64
)
QWEN2_VL = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2VLConfig",
    "Qwen2VLProcessor",
    "Qwen2VLImageProcessor",
    "Qwen2VLVideoProcessor",
)
QWEN2_5_VL = (
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2_5_VLConfig",
    "Qwen2_5_VLProcessor",
    "Qwen2VLImageProcessor",
    "Qwen2VLVideoProcessor",
)
QWEN3_5 = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5Config",
    "Qwen3VLProcessor",
    "Qwen2VLImageProcessor",
    "Qwen3VLVideoProcessor",
)
QWEN3_5_MOE = (
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeConfig",
    "Qwen3VLProcessor",
    "Qwen2VLImageProcessor",
    "Qwen3VLVideoProcessor",
)


def _qwen2_vl(root: Path) -> str:
    return _qwen_vl(
        root,
        f"{ORG}/tiny-Qwen2VLForConditionalGeneration",
        tok.qwen("qwen2_5_vl.jinja", QWEN_VL_VOCAB),
        QWEN2_VL,
        {"rope_parameters": MROPE},
        {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2},
        9,
    )


def _qwen2_5_vl(root: Path) -> str:
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
    return _qwen_vl(
        root,
        f"{ORG}/tiny-Qwen2_5_VLForConditionalGeneration",
        tok.qwen("qwen2_5_vl.jinja", QWEN_VL_VOCAB),
        QWEN2_5_VL,
        {"rope_parameters": MROPE},
        {**vision, "window_size": 16, "fullatt_block_indexes": [1]},
        10,
    )


def _qwen3_5(root: Path) -> str:
    return _qwen_vl(
        root,
        f"{ORG}/tiny-Qwen3_5ForConditionalGeneration-NoThink",
        tok.qwen3_5("qwen3_5_nothink.jinja"),
        QWEN3_5,
        QWEN3_5_TEXT,
        QWEN3_5_VISION,
        11,
    )


def _qwen3_5_moe(root: Path) -> str:
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    return _qwen_vl(
        root,
        f"{ORG}/tiny-Qwen3_5MoeForConditionalGeneration-3.6",
        tok.qwen("qwen3_6.jinja", QWEN_VL_VOCAB),
        QWEN3_5_MOE,
        {**QWEN3_5_TEXT, **experts},
        QWEN3_5_VISION,
        12,
    )


VLM_BUILDERS = {
    f"{ORG}/tiny-Gemma3ForConditionalGeneration": _gemma3_for_conditional_generation,
    f"{ORG}/tiny-LlavaNextForConditionalGeneration": _llava_next_for_conditional_generation,
    f"{ORG}/tiny-Qwen2VLForConditionalGeneration": _qwen2_vl,
    f"{ORG}/tiny-Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl,
    f"{ORG}/tiny-Qwen3_5ForConditionalGeneration-NoThink": _qwen3_5,
    f"{ORG}/tiny-Qwen3_5MoeForConditionalGeneration-3.6": _qwen3_5_moe,
}


def build_vlm_models(root: Path, built: list[str] | tuple = ()) -> list[str]:
    """Builds the vision-language stand-ins not in `built` (one by one: a cache built before one was added gets
    just that one); returns all of them."""
    built = list(built)
    for repo_id, build in VLM_BUILDERS.items():
        if repo_id not in built:
            built.append(build(root))
    return built


# --- datasets -------------------------------------------------------------------------------------


def _image(seed: int, size: int = 32):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def zen_rows(config: str) -> dict[str, list[dict]]:
    splits = {"train": ZEN[:TRAIN_ROWS], "test": ZEN[TRAIN_ROWS:]}
    out = {}
    for split, rows in splits.items():
        if config == "standard_prompt_only":
            out[split] = [{"prompt": p} for p, _ in rows]
        elif config == "conversational_prompt_only":
            out[split] = [{"prompt": [{"role": "user", "content": p}]} for p, _ in rows]
        else:
            raise ValueError(config)
    return out


def zen_image_rows(images_per_row: int) -> dict[str, list[dict]]:
    out = {}
    for split, rows in {"train": ZEN[:TRAIN_ROWS], "test": ZEN[TRAIN_ROWS:]}.items():
        out[split] = []
        for i, (prompt, _) in enumerate(rows):
            blocks = [{"type": "image", "text": None}] * images_per_row + [{"type": "text", "text": prompt}]
            row = {"prompt": [{"role": "user", "content": blocks}]}
            pictures = [_image(1000 * images_per_row + 10 * i + k) for k in range(images_per_row)]
            if images_per_row == 1:
                row["image"] = pictures[0]
            else:
                row["images"] = pictures
            out[split].append(row)
    return out


DATASETS = {
    ("zen", "standard_prompt_only"): lambda: zen_rows("standard_prompt_only"),
    ("zen", "conversational_prompt_only"): lambda: zen_rows("conversational_prompt_only"),
    ("zen-image", "conversational_prompt_only"): lambda: zen_image_rows(1),
    ("zen-multi-image", "conversational_prompt_only"): lambda: zen_image_rows(2),
}


def build_dataset(root: Path, name: str, config: str, rows: dict[str, list[dict]]) -> None:
    """Writes the splits as parquet, then prepares them with `datasets`' own builder under the repo id,
    so the prepared copy lands exactly where offline `load_dataset(repo_id, config)` looks."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    repo_id = f"{ORG}/{name}"
    raw = root / "raw" / name / config
    raw.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, split_rows in rows.items():
        path = raw / f"{split}.parquet"
        datasets.Dataset.from_list(split_rows).to_parquet(str(path))
        files[split] = [str(path)]
    # Prepared under the bare name (the builder refuses local files for a repo id), then moved to the
    # folder offline loading of the repo id reads: <org>___<name>/<config>/0.0.0/<hash>.
    builder = Parquet(
        cache_dir=str(root / "prepare"),
        dataset_name=name,
        config_name=config,
        data_files=files,
        hash=_revision(f"{repo_id}/{config}")[:16],
        version="0.0.0",
    )
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)
    wanted = root / "datasets" / f"{ORG}___{name}" / config / "0.0.0" / prepared.name
    if wanted.exists():
        shutil.rmtree(wanted)
    wanted.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(prepared), str(wanted))
    info = json.loads((wanted / "dataset_info.json").read_text())
    info["config_name"] = config  # the prepared folder's config id carries a hash of data_files
    (wanted / "dataset_info.json").write_text(json.dumps(info))


def build_datasets(root: Path) -> list[str]:
    built = []
    for (name, config), make in DATASETS.items():
        build_dataset(root, name, config, make())
        built.append(f"{ORG}/{name}:{config}")
    return built


STAMP = "standins.json"


def build_all(root: Path) -> dict:
    """Builds what the stamp does not list yet: everything the first time; on a cache built before the
    vision-language stand-ins (or one of them) were added, just those."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / STAMP
    report = json.loads(stamp.read_text()) if stamp.exists() else {}
    for part, build in (("models", build_text_models), ("datasets", build_datasets)):
        if part not in report:
            report[part] = build(root)
            stamp.write_text(json.dumps(report, indent=2))
    if set(ARCHITECTURE_BUILDERS) - set(report.get("architecture_models", [])):
        report["architecture_models"] = build_architecture_models(root, report.get("architecture_models", []))
        stamp.write_text(json.dumps(report, indent=2))
    if set(VLM_BUILDERS) - set(report.get("vlm_models", [])):
        report["vlm_models"] = build_vlm_models(root, report.get("vlm_models", []))
        stamp.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    print(json.dumps(build_all(Path(sys.argv[1])), indent=2))
