"""Byte-level BPE tokenizers that stand in for the tokenizers of TRL's tiny test models.

TRL's tests hard-code a few token ids of the real tokenizers (Qwen's ``<|endoftext|>`` = 151643,
``<|im_end|>`` = 151645, ``<tool_call>`` = 151657, ...) and, in the tool-calling and environment tests, whole
completions as Qwen token ids. A stand-in therefore keeps each family's vocabulary size, puts its
special tokens at their real ids and, for Qwen, lays out the first 256 ids in the GPT-2 byte order
Qwen uses and places the handful of word pieces those completions use at their real ids. Every
other id is an unreachable filler word, so decoding any id gives text and encoding uses bytes.

The chat template of each stand-in is read from the installed ``trl`` package (TRL recognises
models by comparing chat templates byte for byte), so nothing of TRL's is stored here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins of the bytes, in the order byte-level BPE vocabularies list them
    (printable ASCII and Latin-1 first, then the remaining bytes shifted past 255)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    symbol_of = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbol_of:
            symbol_of[b] = chr(256 + shifted)
            shifted += 1
    return [symbol_of[b] for b in printable] + [symbol_of[b] for b in range(256) if b not in printable]


def _to_symbols(text: str) -> str:
    """`text` written in the byte alphabet (how byte-level BPE stores multi-character tokens)."""
    table = {b: s for b, s in zip(sorted(range(256), key=_byte_rank), byte_alphabet())}
    return "".join(table[b] for b in text.encode("utf-8"))


def _byte_rank(b: int) -> int:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    return (
        printable.index(b)
        if b in printable
        else len(printable) + [x for x in range(256) if x not in printable].index(b)
    )


def _filler(n: int) -> str:
    """A unique letters-only word for id `n` (decodes to readable junk, never to a special token)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    word = ""
    n += 1
    while n:
        n, r = divmod(n - 1, 26)
        word = letters[r] + word
    return "Ġzq" + word  # a leading space and a prefix no real piece below uses


@dataclass
class TokenizerSpec:
    vocab_size: int  # ids 0 .. vocab_size-1 (specials included)
    specials: dict[int, str]  # id -> special token
    pieces: dict[int, str] = field(default_factory=dict)  # id -> plain text piece at a fixed id
    bytes_at: int = 0  # first id of the 256 byte symbols
    bos: str | None = None
    eos: str = ""
    pad: str | None = None
    unk: str | None = None
    add_bos: bool = False  # prepend bos when encoding (Llama 3, Gemma)
    chat_template: str | None = None  # file name under trl/chat_templates
    tokenizer_class: str = "PreTrainedTokenizerFast"
    extra_config: dict = field(default_factory=dict)


def build(spec: TokenizerSpec) -> Tokenizer:
    vocab: dict[str, int] = {}
    for i, symbol in enumerate(byte_alphabet()):
        vocab[symbol] = spec.bytes_at + i
    for token_id, text in spec.pieces.items():
        vocab[_to_symbols(text)] = token_id
    for token_id, token in spec.specials.items():
        vocab[token] = token_id
    taken = set(vocab.values())
    filler = 0
    for token_id in range(spec.vocab_size):
        if token_id not in taken:
            vocab[_filler(filler)] = token_id
            filler += 1
    assert len(vocab) == spec.vocab_size, "two tokens share a string"
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.specials.values()])
    if spec.add_bos and spec.bos:
        from tokenizers import processors

        bos_id = vocab[spec.bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, bos_id)]
        )
    return tokenizer


def chat_template(name: str | None) -> str | None:
    if name is None:
        return None
    return resources.files("trl").joinpath("chat_templates", name).read_text(encoding="utf-8")


def save(spec: TokenizerSpec, directory) -> None:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja as a Hub checkpoint has them."""
    import json
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build(spec).save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": spec.tokenizer_class,
        "eos_token": spec.eos,
        "bos_token": spec.bos,
        "pad_token": spec.pad,
        "unk_token": spec.unk,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": spec.add_bos,
        **spec.extra_config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    template = chat_template(spec.chat_template)
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)


# --- families -------------------------------------------------------------------------------------

_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
QWEN_FIRST_SPECIAL = 151643

# Word pieces TRL's tool-calling tests write as raw Qwen ids (see their fake `generate`).
QWEN_PIECES = {
    4913: '{"',
    606: "name",
    788: '":',
    330: ' "',
    64648: "multiply",
    22785: "_tool",
    497: '",',
    16370: "arguments",
    5212: ' {"',
    11248: "}}\n",
    7692: "async",
    93054: "_multiply",
    1513: " don",
    944: "'t",
    1414: " know",
    894: " any",
    5392: " tool",
    17453: "Done",
    # and those of its environment tests (environment_factory: an `increment` counter, a `shout` echo)
    35744: "increment",
    9520: "step",
    450: "de",
    13477: "crement",
    2765: " won",
    16252: " increment",
    927: "sh",
    411: "out",
    1318: "text",
    6023: "hi",
    95642: '"}}\n',
}


def qwen(template: str, vocab_size: int | None = None) -> TokenizerSpec:
    """Qwen's tokenizer; `vocab_size` below the real 151669 gives a compact variant (same strings, specials
    moved to the end of the smaller vocabulary, no fixed word pieces) for models whose tests never name ids."""
    first_special = QWEN_FIRST_SPECIAL if vocab_size is None else vocab_size - len(_QWEN_SPECIALS)
    specials = {first_special + i: t for i, t in enumerate(_QWEN_SPECIALS)}
    return TokenizerSpec(
        vocab_size=first_special + len(_QWEN_SPECIALS),
        specials=specials,
        pieces=QWEN_PIECES if vocab_size is None else {},
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=template,
        tokenizer_class="Qwen2Tokenizer",
        extra_config={"errors": "replace", "split_special_tokens": False},
    )


# Qwen3.5's vocabulary: its specials (Qwen's, in Qwen's order) from id 248044, and the word pieces TRL's
# multimodal tool test writes as raw Qwen3.5 ids (a call in Qwen3.5's XML form, then "I don't know any tool").
QWEN3_5_FIRST_SPECIAL = 248044
QWEN3_5_PIECES = {
    1628: "function",
    13744: "=",
    30091: "screenshot",
    22076: "_tool",
    510: "</",
    1459: " don",
    914: "'t",
    1366: " know",
    866: " any",
    5224: " tool",
    16936: "Done",
}


def qwen3_5(template: str) -> TokenizerSpec:
    """Qwen3.5's tokenizer at its real size (its tool test names ids up to 248059)."""
    spec = qwen(template)
    spec.vocab_size = QWEN3_5_FIRST_SPECIAL + len(_QWEN_SPECIALS)
    spec.specials = {QWEN3_5_FIRST_SPECIAL + i: t for i, t in enumerate(_QWEN_SPECIALS)}
    spec.pieces = QWEN3_5_PIECES
    return spec


def llama3(template: str) -> TokenizerSpec:
    specials = {128000 + i: f"<|reserved_special_token_{i}|>" for i in range(256)}
    named = {
        128000: "<|begin_of_text|>",
        128001: "<|end_of_text|>",
        128004: "<|finetune_right_pad_id|>",
        128006: "<|start_header_id|>",
        128007: "<|end_header_id|>",
        128008: "<|eom_id|>",
        128009: "<|eot_id|>",
        128010: "<|python_tag|>",
    }
    specials.update(named)
    return TokenizerSpec(
        vocab_size=128256,
        specials=specials,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        add_bos=True,
        chat_template=template,
    )


def gemma(
    template: str,
    vocab_size: int = 256000,
    extra: dict[int, str] | None = None,
    turn_at: int = 106,
    extra_config: dict | None = None,
) -> TokenizerSpec:
    """Gemma's tokenizer: <pad>/<eos>/<bos>/<unk>/<mask> at 0-4, the turn markers at `turn_at` and the next id."""
    specials = {
        0: "<pad>",
        1: "<eos>",
        2: "<bos>",
        3: "<unk>",
        4: "<mask>",
        turn_at: "<start_of_turn>",
        turn_at + 1: "<end_of_turn>",
    }
    specials.update(extra or {})
    return TokenizerSpec(
        vocab_size=vocab_size,
        specials=specials,
        bytes_at=300,
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
        chat_template=template,
        extra_config=extra_config or {},
    )


# Gemma 3's vision tokens, as its tokenizer_config names them (Gemma3Processor reads these attributes).
GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def gemma3(template: str, vocab_size: int) -> TokenizerSpec:
    """Gemma 3's tokenizer: Gemma's specials with its turn markers at 105/106 (Gemma 2: 106/107) and the
    three image tokens as the last ids of a compact vocabulary (real: 255999, 256000, 262144 of 262208)."""
    images = {vocab_size - 3 + offset: token for offset, token in enumerate(GEMMA3_IMAGE_TOKENS.values())}
    return gemma(
        template,
        vocab_size,
        extra=images,
        turn_at=105,
        extra_config={**GEMMA3_IMAGE_TOKENS, "processor_class": "Gemma3Processor"},
    )


def llava_next_mistral(template: str, vocab_size: int) -> TokenizerSpec:
    """The tokenizer of LLaVA-NeXT (Mistral 7B): Llama's <unk>/<s>/</s> at 0-2, bos added, <image> as the last id
    of a compact vocabulary (real: 32000 of 32064)."""
    return TokenizerSpec(
        vocab_size=vocab_size,
        specials={0: "<unk>", 1: "<s>", 2: "</s>", vocab_size - 1: "<image>"},
        bytes_at=3,
        bos="<s>",
        eos="</s>",
        pad="<unk>",
        unk="<unk>",
        add_bos=True,
        chat_template=template,
        extra_config={"image_token": "<image>", "processor_class": "LlavaNextProcessor"},
    )
