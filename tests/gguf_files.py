"""A tiny Llama checkpoint written as a GGUF file with the `gguf` package (no download).

The file holds what llama.cpp's converter would write for a Llama model: the hyper-parameters under
``llama.*``, a byte-level BPE tokenizer (every byte one token, two chat markers, one merge) with a
chat template, and fp32 tensors under llama.cpp's names, the query and key projections reordered as
llama.cpp stores them (rotary halves interleaved per head), which transformers undoes on loading.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

GGUF_NAME = "tiny-llama.f32.gguf"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the byte-level BPE alphabet), in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norms, so a misplaced norm weight shows in the logits
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def interleave_rotary_halves(weight: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's storage order of a query/key projection: each head's two rotary halves interleaved."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).numpy()


def write_tiny_gguf(directory: str) -> tuple[str, LlamaForCausalLM]:
    """Write GGUF_NAME into `directory`; return (its name, the model whose weights it holds)."""
    import gguf

    tokens = byte_alphabet() + ["<|im_start|>", "<|im_end|>", "\u0120t"]
    merges = ["\u0120 t"]
    model = tiny_llama(len(tokens))
    config = model.config
    writer = gguf.GGUFWriter(os.path.join(directory, GGUF_NAME), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_pad_token_id(257)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    state = model.state_dict()
    layer_names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in layer_names.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                array = interleave_rotary_halves(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                array = interleave_rotary_halves(weight, config.num_key_value_heads)
            else:
                array = weight.numpy()
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(array))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUF_NAME, model
