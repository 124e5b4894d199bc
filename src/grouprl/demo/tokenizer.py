"""A tiny, deterministic byte-level BPE tokenizer for the demo model.

Why hand-built instead of trained: the demo must work offline and be bit-for-bit reproducible, and
the arithmetic task only needs a handful of symbols. The vocabulary is

* the 256 byte-level symbols (so *any* text round-trips exactly, whitespace included),
* a few merges that turn the ChatML role names into single tokens (shorter chat prompts),
* three special tokens: ``<|endoftext|>`` (eos and pad), ``<|im_start|>`` and ``<|im_end|>``.

Digits are deliberately *not* merged: every number is spelled digit by digit, which keeps the
vocabulary tiny and makes the answer a short, learnable token sequence.

All merges stay inside runs of ASCII letters. That matters because ``AutoTokenizer`` in
transformers 5 rebuilds a ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer`` (its own
pre-tokenizer regex + ``ByteLevel(use_regex=False)``). Letter-only merges give identical ids under
both the GPT-2 style ``ByteLevel`` regex used here and Qwen's regex, so the in-memory tokenizer and
the reloaded one agree (checked in ``tests/test_demo_assets.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# Words that become single tokens. Only ASCII letters (see module docstring for why).
MERGED_WORDS = ("user", "assistant", "system")

# ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then an open assistant turn if
# asked. `continue_final_message` needs nothing special: transformers renders the full conversation
# and cuts it right after the final message's content.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# ChatML with tools, in the Hermes / Qwen2.5 format: tool schemas listed in a system turn, calls written
# by the assistant as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and consecutive tool
# results grouped into one user turn of `<tool_response>` blocks. Earlier messages render the same
# whatever follows (prefix-preserving), which multi-turn training relies on (grouprl.agents).
_SYSTEM_TURN = (
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
# An assistant message's tool calls, each written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
TOOL_CALLS = (
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) %}"
    "{{- '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + args + '}</tool_call>' }}"
    "{%- endfor %}"
)
_MESSAGES_WITH_TOOLS = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}" + TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message['content'] | string) + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\nTo call a function, write "
    '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>. '
    "Functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}" + _SYSTEM_TURN + _MESSAGES_WITH_TOOLS
)
# The same conversation format, but the system turn only names the tools ("tools: calculator"): for tiny
# models with short contexts, which learn a tool's use from examples rather than from its schema.
COMPACT_TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- 'tools: ' + (tools | map(attribute='function') | map(attribute='name') | join(', ')) + '<|im_end|>\\n' }}"
    + _SYSTEM_TURN
    + _MESSAGES_WITH_TOOLS
)


def byte_to_unicode() -> dict[int, str]:
    """Map every byte to a printable unicode character (the GPT-2 byte-level alphabet).

    Printable Latin-1 bytes map to themselves; the remaining bytes (control characters, space,
    ...) are shifted to code points from 256 upwards so that no symbol is whitespace or invisible.
    This is the convention ``tokenizers``' ByteLevel pre-tokenizer and decoder expect.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def _vocab_and_merges(merged_words: Sequence[str] = MERGED_WORDS) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte alphabet (ids 0..255, in byte order) followed by left-to-right merges of `merged_words`."""
    alphabet = byte_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    for word in merged_words:
        # "user" -> (u,s) (us,e) (use,r): every prefix becomes a token, the last one is the word.
        for i in range(1, len(word)):
            left, right = word[:i], word[i]
            if (left, right) not in merges:
                merges.append((left, right))
            vocab.setdefault(word[: i + 1], len(vocab))
    return vocab, merges


def build_tokenizer(extra_words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Build the demo tokenizer (deterministic: same vocabulary and ids on every call).

    Returns a transformers fast tokenizer with eos = pad = ``<|endoftext|>``, no bos token and a
    ChatML ``chat_template``. Padding side stays the default (right); generation code asks for left
    padding explicitly. `extra_words` (ASCII letters only) become single tokens too, after the role names.
    """
    if any(not word.isascii() or not word.isalpha() for word in extra_words):
        raise ValueError(f"extra_words must be ASCII letters only (see the module docstring), got {list(extra_words)}.")
    vocab, merges = _vocab_and_merges((*MERGED_WORDS, *extra_words))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # ByteLevel on both ends: text -> bytes -> symbols and back, so whitespace is preserved exactly.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
