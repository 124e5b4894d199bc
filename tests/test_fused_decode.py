"""Fused decode steps (generation/fused_decode.py): the same logits as the model's own forward for every
architecture they accept, LoRA adapters included; a model they would get wrong is caught by the probe and
decodes through its forward; generation samples the same tokens with and without them."""

import logging
import re

import pytest
import torch
from helpers import distinct_tokens, forward_logprobs, numbered_prompts, quiet_config
from transformers import (
    AutoModelForCausalLM,
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    Glm4Config,
    Glm4ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmConfig,
    GlmForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    HunYuanDenseV1Config,
    HunYuanDenseV1ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Ministral3Config,
    Ministral3ForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    OlmoHybridConfig,
    OlmoHybridForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PixtralVisionConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    SeedOssConfig,
    SeedOssForCausalLM,
    SiglipVisionConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from grouprl import GRPOTrainer
from grouprl.core.types import SamplingParams
from grouprl.generation import FastGenerator, TransformersGenerator, fused_decode, static_decode
from grouprl.generation.fused_decode import (
    ONE_ROPE,
    FusedDecoder,
    _fused_decode,
    fuses,
    packs_weights,
    probe,
    static_cache_only,
    static_decode_pair,
    structure_reason,
)
from grouprl.generation.shared_prefix import shared_decode
from grouprl.generation.static_decode import DECODE_STEPS, CapturedGenerator, captured_supports, run_steps

SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _llama():
    # llama3 rope scaling: cos/sin come from the model's own rotary embedding, whatever its type
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return LlamaForCausalLM(LlamaConfig(**SIZES, rope_scaling={**rope, "original_max_position_embeddings": 32}))


def _llama_with_biases():
    return LlamaForCausalLM(LlamaConfig(**SIZES, attention_bias=True, tie_word_embeddings=True))


def _qwen3():  # q/k RMSNorm per head before RoPE, an explicit head_dim
    return Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=32))


def _mistral():
    return MistralForCausalLM(MistralConfig(**SIZES, sliding_window=None))


def _sliding_mistral():  # every layer attends over the last 4 positions
    return MistralForCausalLM(MistralConfig(**SIZES, sliding_window=4))


def _gemma3():
    """Gemma 3: scaled embeddings, (1 + w) norms in fp32, four a layer and on q and k, tanh GELU, its own score
    scale, sliding layers of window 4 with their own RoPE beside a full one with another."""
    layers = ["sliding_attention", "full_attention"]
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    }
    config = Gemma3TextConfig(
        **SIZES, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, layer_types=layers, rope_parameters=rope
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # its norms start at zero, (1 + 0): weights of their own tell (1 + w) from w
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(std=0.3)
            if "gate_proj" in name:  # gates of a few units, where tanh's GELU and erf's differ most
                param.mul_(30.0)
    return model


def _phi3():  # q/k/v and gate/up each one stacked projection; RoPE on half of each head (partial_rotary_factor)
    config = Phi3Config(**SIZES, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Phi3ForCausalLM(config)


def _phi3_longrope(pretraining_length=64):
    """Phi-3.5 / Phi-4-mini's longrope: short factors while a forward's positions stay below the pretraining length,
    long ones for every position once one passes it (with an attention factor on cos/sin throughout)."""
    rope = dict(rope_type="longrope", short_factor=[1.0, 1.5, 2.0, 2.5], long_factor=[3.0, 5.0, 7.0, 9.0])
    config = Phi3Config(
        **SIZES,
        head_dim=16,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=pretraining_length,  # Phi3Config writes its own into rope_parameters
        rope_parameters={**rope, "original_max_position_embeddings": pretraining_length, "rope_theta": 10_000.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Phi3ForCausalLM(config)


def _granite():
    """Granite: its embeddings, each layer's outputs (before the residual adds) and its logits scaled by multipliers of
    its own, its scores by an attention multiplier instead of head_dim^-0.5."""
    multipliers = dict(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.05, logits_scaling=4.0)
    return GraniteForCausalLM(GraniteConfig(**SIZES, **multipliers, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _own_norms(model, part="norm"):
    """Norm weights of their own (around 1) for the parameters whose name holds `part`: a norm left out or misplaced
    changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if part in name:
                param.normal_(mean=1.0, std=0.3)
    return model


def _glm4():
    """GLM-4: RoPE on half of each head turning neighbouring pairs (not halves), the attention's and the MLP's outputs
    normed besides their inputs, q/k/v biases, stacked gate/up."""
    model = Glm4ForCausalLM(Glm4Config(**SIZES, head_dim=16, pad_token_id=0, eos_token_id=2))
    return _own_norms(model)


def _glm():  # GLM-4's first layout (GLM-4-9B-chat): Llama's norms, GLM's pairwise RoPE
    return GlmForCausalLM(GlmConfig(**SIZES, head_dim=16, pad_token_id=0, eos_token_id=2))


def _ernie4_5():  # ERNIE 4.5 (0.3B): Llama's layers with GLM's pairwise RoPE
    return Ernie4_5ForCausalLM(Ernie4_5Config(**SIZES, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _exaone4():
    """EXAONE 4: OLMo 2's output norms, per-head q/k norms, a sliding layer of window 4 beside a full one that skips
    RoPE."""
    layers = ["sliding_attention", "full_attention"]
    model = Exaone4ForCausalLM(
        Exaone4Config(**SIZES, sliding_window=4, layer_types=layers, pad_token_id=0, eos_token_id=2)
    )
    return _own_norms(model)


def _hunyuan():
    """HunYuan (dense): q and k normed per head after RoPE, not before; its NTK-alpha RoPE (a fixed base stretch,
    a RoPE type of its own since transformers 5.2x; 5.17 labels it dynamic, which the captured loop refuses)."""
    from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense as hunyuan

    alpha = hasattr(hunyuan.HunYuanDenseV1RotaryEmbedding, "compute_ntk_alpha_rope_parameters")
    config = HunYuanDenseV1Config(**SIZES, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    rope = dict(rope_type="default", rope_theta=10_000.0)
    config.rope_parameters = {**rope, "rope_type": "ntk_alpha", "alpha": 4.0} if alpha else rope
    model = HunYuanDenseV1ForCausalLM(config)
    return _own_norms(model, "layernorm")  # q/k norms of their own: before and after RoPE then differ


def _ministral3(original_length=64):
    """Ministral 3: YaRN RoPE, and queries scaled by 1 + beta log(1 + floor(position / original length)) (exactly 1
    below that length, `llama_4_scaling_beta`)."""
    rope = dict(rope_type="yarn", factor=2.0, beta_fast=32.0, beta_slow=1.0, llama_4_scaling_beta=2.0)
    rope.update(rope_theta=10_000.0, original_max_position_embeddings=original_length)
    config = Ministral3Config(**{**SIZES, "max_position_embeddings": 2 * original_length}, head_dim=16)
    config.rope_parameters = rope  # as given (the config's own checks would rewrite the factor)
    config.sliding_window, config.pad_token_id, config.bos_token_id, config.eos_token_id = None, 0, 1, 2
    return Ministral3ForCausalLM(config)


MOE = dict(num_experts_per_tok=2, head_dim=16)


def _qwen3_moe():  # routed experts (top 2 of 4, renormalised) in one layer, a dense MLP in the other
    config = Qwen3MoeConfig(
        **SIZES, **MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0]
    )
    return Qwen3MoeForCausalLM(config)


def _qwen2_moe():  # a shared expert beside the routed ones, gated by its own sigmoid; q/k/v biases
    config = Qwen2MoeConfig(**SIZES, **MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return Qwen2MoeForCausalLM(config)


def _glm4_moe():  # GLM-4.5: a dense first layer, then routed experts beside a shared one, grouped top-k with a bias
    experts = dict(n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1)
    config = Glm4MoeConfig(**SIZES, **MOE, **experts, n_group=2, topk_group=1, pad_token_id=0, eos_token_id=2)
    return Glm4MoeForCausalLM(config)


def _gpt_oss():
    """GPT-OSS: attention sinks, windows of 4 in every other layer, q/k/v/o biases, YaRN RoPE given once for both
    halves, experts with biases and a clamped gate."""
    rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0)
    config = GptOssConfig(
        **{**SIZES, **MOE},
        num_local_experts=4,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={**rope, "rope_theta": 150_000.0},
        pad_token_id=0,
        eos_token_id=2,
    )
    return GptOssForCausalLM(config)


def _olmoe():  # OLMoE: OLMo's whole-projection q/k norms (its inputs normed, as Llama's) and routed experts
    return OlmoeForCausalLM(OlmoeConfig(**SIZES, **MOE, num_experts=4, pad_token_id=0, eos_token_id=2))


def _mixtral():
    return MixtralForCausalLM(MixtralConfig(**SIZES, **MOE, num_local_experts=4, sliding_window=None))


# Qwen3.5: linear-attention layers (a gated delta rule: 4 value heads served by 2 key heads, a convolution of 4)
# beside gated attention with (1 + w) q/k norms and RoPE on a quarter of each head (multimodal RoPE's three axes)
QWEN3_5 = dict(
    **{**SIZES, "num_hidden_layers": 4},
    head_dim=32,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1]),
    pad_token_id=0,
    eos_token_id=2,
)


def _own_norm_weights(model):
    """Norm weights of their own: Qwen3.5's (1 + w) norms start at w = 0, where w and (1 + w) would look alike."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(mean=0.5 if name.endswith("linear_attn.norm.weight") else 0.0, std=0.3)
    return model


def _qwen3_5():
    return _own_norm_weights(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5)))


def _qwen3_5_moe():  # its MLPs routed experts (top 2 of 4) beside a gated shared expert
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return _own_norm_weights(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**QWEN3_5, **experts)))


def _olmo(config_class, model_class, **more):
    """OLMo 2 / 3: the attention's and the MLP's outputs normed, not their inputs; q and k normed over the whole
    projection, before it is split into heads."""
    model = model_class(config_class(**SIZES, head_dim=16, pad_token_id=0, eos_token_id=2, **more))
    return _own_norms(model)


def _olmo2():
    return _olmo(Olmo2Config, Olmo2ForCausalLM)


def _olmo3():  # a sliding layer of window 4 beside a full one, each with its RoPE (the full one's YaRN, as OLMo 3's)
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 5e5,
        },
    }
    layers = ["sliding_attention", "full_attention"]
    return _olmo(Olmo3Config, Olmo3ForCausalLM, sliding_window=4, layer_types=layers, rope_parameters=rope)


def _ministral():  # Ministral 8B: a sliding window of 4 in one layer, full attention in the other
    config = MinistralConfig(
        **SIZES, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    return MinistralForCausalLM(config)


def _seed_oss():  # Seed-OSS: q/k/v biases without an o bias
    return SeedOssForCausalLM(SeedOssConfig(**SIZES, head_dim=16, attention_bias=True, pad_token_id=0, eos_token_id=2))


def _smollm3():  # a NoPE layer (SmolLM3's every fourth): q and k not rotated
    return SmolLM3ForCausalLM(
        SmolLM3Config(**SIZES, no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )


ACCEPTED = {
    "llama (llama3 rope)": _llama,
    "llama with biases": _llama_with_biases,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "smollm3 (a NoPE layer)": _smollm3,
    "mistral (sliding window)": _sliding_mistral,
    "gemma3": _gemma3,
    "phi3 (partial RoPE)": _phi3,
    "phi3 (longrope)": _phi3_longrope,
    "qwen3_moe (a dense layer too)": _qwen3_moe,
    "qwen2_moe (a shared expert)": _qwen2_moe,
    "mixtral": _mixtral,
    "glm4_moe (partial RoPE, grouped routing)": _glm4_moe,
    "gpt_oss (sinks, windows, yarn)": _gpt_oss,
    "olmo2 (outputs normed)": _olmo2,
    "olmo3 (outputs normed, windows)": _olmo3,
    "olmoe (whole-projection q/k norms, experts)": _olmoe,
    "ministral (windows)": _ministral,
    "ministral3 (yarn, queries scaled past 64 positions)": _ministral3,
    "granite (multipliers)": _granite,
    "glm4 (pairwise partial RoPE, output norms)": _glm4,
    "glm (pairwise partial RoPE)": _glm,
    "ernie4_5 (pairwise RoPE)": _ernie4_5,
    "exaone4 (outputs normed, a window, a NoPE full layer)": _exaone4,
    "hunyuan (q/k normed after RoPE)": _hunyuan,
    "seed_oss (q/k/v biases)": _seed_oss,
    "qwen3_5 (gated delta rule, gated attention)": _qwen3_5,
    "qwen3_5_moe (gated delta rule, experts)": _qwen3_5_moe,
}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD, EOS = 0, 2  # the test models' padding and end-of-sequence ids


def _sharpened(model, factor):
    """Sharper attention and logits: a wrong step changes the tokens."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(factor)
    return model


def _greedy_and_generates(sampler, prompts, new_tokens, **generate_options):
    """(the sampler's greedy tokens, transformers generate's ended after EOS) for `prompts`, left-padded."""
    greedy = sampler.generate(prompts, 1, SamplingParams(max_new_tokens=new_tokens, top_k=1))
    width = max(map(len, prompts))
    want = sampler.model.generate(
        input_ids=torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=DEVICE),
        attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE),
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
        **generate_options,
    )[:, width:].tolist()
    return [c.token_ids for c in greedy], [row[: row.index(EOS) + 1] if EOS in row else row for row in want]


def _random_decode(model, steps=4, seed=0):
    """Both paths over the same left-padded prompts and fed tokens: (forward logits, fused logits)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (3, 7), generator=generator)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[2, :1] = 0
    fed = torch.randint(0, vocab, (steps, 6), generator=generator)  # 3 prompts x 2 samples per step
    with torch.no_grad():
        if static_cache_only(model):  # served over the static cache only
            return static_decode_pair(model, prompts, mask, fed)
        return shared_decode(model, prompts, mask, fed), _fused_decode(model, prompts, mask, fed)


@pytest.mark.parametrize("build", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_fused_steps_give_the_forward_logits(build):
    torch.manual_seed(0)
    model = build().eval()
    assert structure_reason(model) is None
    expected, got = _random_decode(model)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want.reshape(have.shape), atol=2e-5, rtol=1e-4)
    assert probe(model) is None


@pytest.mark.parametrize("build", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_the_captured_loop_decodes_each_accepted_family_as_its_forward(build, tiny_model_dir):
    """generation_engine='captured' runs the same fused step over a static cache, for every family the step accepts:
    greedy, its tokens are transformers generate's; sampled, each token's logprob is a separate forward's."""
    torch.manual_seed(0)
    model = _sharpened(build().eval().to(DEVICE), 4.0)
    assert captured_supports(model, {}, None, decode_step="fused") is None
    prompts = [[5, 9, 13, 2, 7, 30], [40, 41], [3, 3, 8, 60]]
    sampler = CapturedGenerator(
        model, PreTrainedTokenizerFast.from_pretrained(tiny_model_dir), [EOS], PAD, decode_step="fused"
    )
    got, want = _greedy_and_generates(sampler, prompts, 12)
    assert got == want
    for sample in sampler.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0)):
        expected = forward_logprobs(model, prompts[sample.prompt_index], sample.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(sample.sampler_logprobs), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("build", [_llama, _qwen3, _phi3_longrope], ids=["llama3 rope", "default rope", "longrope"])
def test_a_rope_table_holds_each_positions_own_values(build):
    """The static loop's steps gather RoPE's cos and sin from a table made once per call; each entry is bit for bit
    what a step computes at that position (each value depends on its own position only; longrope's below its
    pretraining length, 64 here), whatever positions the step's rows are at."""
    torch.manual_seed(0)
    decoder = FusedDecoder(build().eval())
    positions = torch.tensor([0, 5, 5, 63, 17, 40])
    cos, signed_sin = decoder._rope(positions)
    decoder.tabulate_rope(64)
    assert torch.equal(torch.cat(decoder._rope_at(positions, ONE_ROPE), dim=1), torch.cat([cos, signed_sin], dim=1))


@pytest.mark.parametrize(
    "build, limit",
    [
        (lambda: _phi3_longrope(pretraining_length=12), "the pretraining length of the model's longrope (12)"),
        (lambda: _ministral3(original_length=12), "12 positions, past which the model scales its queries by position"),
    ],
    ids=["longrope", "ministral3's query scaling"],
)
def test_a_call_past_the_steps_position_limit_goes_to_generate(tiny_model_dir, caplog, build, limit):
    """transformers rotates a longrope model's (Phi-3.5, Phi-4-mini) sequences with its short factors below the
    pretraining length, and on the step where generate's sequences pass it, drops the cache and encodes them again
    with the long ones; Ministral 3 scales its queries by position past its original length. The captured loop serves
    the calls that stay below it; a call whose prompt + new tokens could pass it goes to transformers generate, said
    once, and samples what generate does; without a fallback, an error says why."""
    torch.manual_seed(2)
    model = _sharpened(build().eval().to(DEVICE), 2.0)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    fallback = TransformersGenerator(model, tokenizer, [EOS], PAD)
    sampler = CapturedGenerator(model, tokenizer, [EOS], PAD, fallback=fallback, decode_step="fused")
    prompts = [[5, 9, 13, 4, 7, 30], [40, 41], [3, 3, 8, 60]]
    assert sampler.served_reason(prompts, SamplingParams(max_new_tokens=6)) is None  # 6 + 6 = 12 tokens at most
    got, want = _greedy_and_generates(sampler, prompts, 6)
    assert got == want and sampler.last_decode[0] > 0  # the loop's steps
    sampler.last_decode = (0, 0.0)
    answers = []
    generate = fallback.generate
    fallback.generate = lambda *args, **kwargs: answers.append(generate(*args, **kwargs)) or answers[-1]
    greedy = SamplingParams(max_new_tokens=16, top_k=1)
    with caplog.at_level(logging.INFO, logger="grouprl"):
        got = [sampler.generate(prompts, 1, greedy) for _ in range(2)]
    assert got == answers and sampler.last_decode == (0, 0.0)  # generate's samples, no step of the loop
    assert max(len(c.token_ids) for c in got[0]) > 7  # past position 12
    assert caplog.text.count(f"prompt + new tokens can pass {limit}") == 1
    with pytest.raises(ValueError, match=rf"prompt \+ new tokens can pass {re.escape(limit)}.* no fallback"):
        CapturedGenerator(model, tokenizer, [EOS], PAD, decode_step="fused").generate(
            prompts, 1, SamplingParams(max_new_tokens=16)
        )


def test_the_engine_decodes_past_ministral3s_position_limit_through_the_forward(tiny_model_dir):
    """The CPU engine's fused step serves calls within the limit only; past it, its steps run the model's forward,
    which scales the queries: each sampled token's logprob is a separate forward's."""
    torch.manual_seed(2)
    model = _ministral3(original_length=12).eval().to(DEVICE)
    engine = FastGenerator(model, PreTrainedTokenizerFast.from_pretrained(tiny_model_dir), [EOS], PAD)
    prompts = [[5, 9, 13, 4, 7, 30], [40, 41], [3, 3, 8, 60]]
    samples = engine.generate(prompts, 2, SamplingParams(max_new_tokens=16, temperature=1.0))
    assert max(len(s.token_ids) for s in samples) > 7  # past position 12
    for sample in samples:
        expected = forward_logprobs(model, prompts[sample.prompt_index], sample.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(sample.sampler_logprobs), expected, atol=1e-4, rtol=1e-4)


LORA = {
    "llama, every linear layer": (_llama, dict(target_modules="all-linear", lora_dropout=0.0)),
    # the delta rule's input and output projections, the gated attention's (q and its gate in one projection)
    "qwen3_5, every linear layer": (_qwen3_5, dict(target_modules="all-linear", lora_dropout=0.0)),
    # peft's target_parameters (TRL's GPT-OSS recipe): a wrapper a parameter, nested
    **{
        f"{name}, the experts' parameters": (
            build,
            dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        )
        for name, build in (("qwen3_moe", _qwen3_moe), ("gpt_oss", _gpt_oss))
    },
}


@pytest.mark.parametrize("build, targets", LORA.values(), ids=LORA.keys())
def test_lora_adapters_are_merged_for_the_step(build, targets):
    """The step applies each active adapter's delta (on the experts' parameters, peft's wrappers passed by meanwhile
    and as they were after each step: the training forward keeps its LoRA); with the adapters disabled, the base."""
    peft = pytest.importorskip("peft", reason="peft is an optional dependency (LoRA)")
    torch.manual_seed(0)
    model = peft.get_peft_model(build(), peft.LoraConfig(r=4, lora_alpha=8, **targets))
    with torch.no_grad():  # trained adapters: B is zero at initialisation, which would hide a missing merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    model.eval()
    base = model.get_base_model()
    assert structure_reason(base) is None
    expected, got = _random_decode(base)
    with model.disable_adapter():
        without_adapters, fused_without = _random_decode(base)
    assert (expected[0] - without_adapters[0]).abs().max() > 0.1  # the adapters change the logits ...
    for want, have in zip(expected + without_adapters, got + fused_without):  # ... the fused step follows them
        torch.testing.assert_close(have, want.reshape(have.shape), atol=2e-5, rtol=1e-4)
    wrappers = [m for m in base.modules() if hasattr(m, "parameter_name")]
    assert len(wrappers) == len(targets.get("target_parameters", [])) * sum(
        hasattr(layer.mlp, "experts") for layer in base.model.layers
    )
    assert not any(w.disable_adapters for w in wrappers)


def test_structures_it_cannot_run_are_named():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "not a Llama-family" in structure_reason(gpt2)
    softcapped = Gemma2ForCausalLM(Gemma2Config(**SIZES, head_dim=16, attn_logit_softcapping=50.0))
    assert structure_reason(softcapped) == "config.attn_logit_softcapping is set"
    assert "bfloat16" in structure_reason(_llama().to(torch.bfloat16))
    # gated delta rules laid out otherwise than Qwen3.5's (Qwen3-Next interleaves q/k/v/z in one projection)
    hybrid = dict(**SIZES, layer_types=["linear_attention", "full_attention"], head_dim=16, pad_token_id=0)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    for model, mixer in (
        (Qwen3NextForCausalLM(Qwen3NextConfig(**hybrid, **experts)), "Qwen3NextGatedDeltaNet"),
        (OlmoHybridForCausalLM(OlmoHybridConfig(**hybrid)), "OlmoHybridGatedDeltaNet"),
    ):
        assert structure_reason(model) == f"its linear-attention layers ({mixer}) are not Qwen3.5's gated delta rule"


def _gemma3_vision_language(image_token=95):
    """Gemma 3 4B and up: the Gemma 3 text decoder of `_gemma3` under a SigLIP tower, as
    Gemma3ForConditionalGeneration (which transformers loads for text too)."""
    text = _gemma3().config.to_dict()
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=image_token,
        boi_token_index=93,
        eoi_token_index=94,
    )
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(std=0.3)
            if param.ndim == 2 and "embed" not in name and "vision" not in name:
                param.mul_(4.0)
    return model


def _samples_keep_to_the_forward_without(sampler, prompts, suppressed):
    """Sampled, each token's logprob is a separate forward's with the `suppressed` token removed, which never comes."""
    model = sampler.model
    for sample in sampler.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0)):
        prompt = prompts[sample.prompt_index]
        assert suppressed not in sample.token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + sample.token_ids], device=DEVICE)).logits[0].float()
        logits = logits[len(prompt) - 1 : -1].index_fill(1, torch.tensor([suppressed], device=DEVICE), -float("inf"))
        expected = logits.log_softmax(-1).gather(1, torch.tensor(sample.token_ids, device=DEVICE)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sample.sampler_logprobs), expected.cpu(), atol=1e-4, rtol=1e-4)


def test_the_captured_loop_serves_a_vision_language_models_text_prompts(tiny_model_dir):
    """Text-only prompts to a vision-language model run through its language model in the captured loop, its image
    placeholder never sampled (transformers generate is told to suppress it, as TRL does): greedy, the tokens are
    generate's; sampled, each token's logprob is a separate forward's with the placeholder removed."""
    torch.manual_seed(0)
    image_token = 95
    model = _gemma3_vision_language(image_token).eval().to(DEVICE)
    with torch.no_grad():  # the placeholder as likely as a token greedy decoding picks: suppressing it matters
        model.lm_head.weight[image_token] = 2 * model.lm_head.weight[80]
    assert captured_supports(model, {}, None, decode_step="fused") is None
    prompts = [[5, 9, 13, 4, 7, 30], [40, 41], [3, 3, 8, 60]]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    sampler = CapturedGenerator(model, tokenizer, [EOS], PAD, suppress_token_ids=[image_token], decode_step="fused")
    unsuppressed = _greedy_and_generates(sampler, prompts, 12)[1]
    assert any(image_token in row for row in unsuppressed)  # greedy decoding would emit it
    got, want = _greedy_and_generates(sampler, prompts, 12, suppress_tokens=[image_token])
    assert got == want
    _samples_keep_to_the_forward_without(sampler, prompts, image_token)


def test_a_vision_language_model_without_a_twin_to_probe_is_refused_by_name():
    """Qwen2-VL's text config has no causal LM of its own to build the probe's fp32 twin from: the loop says so."""
    from vlm_models import tiny_qwen2_vl

    model, _ = tiny_qwen2_vl()
    for step in DECODE_STEPS:
        assert captured_supports(model, {}, None, decode_step=step) == (
            f"its fp32 twin's {step} step failed: NotImplementedError: no causal LM of its text config "
            "(Qwen2VLTextConfig) to build a twin from"
        )


def test_the_captured_loop_serves_ministral3s_vision_language_model_for_text_prompts(tiny_model_dir):
    """Ministral 3's checkpoints are Mistral3ForConditionalGeneration (a Pixtral tower): its text-only calls run
    through its language model in the captured loop, greedy as generate, its image placeholder never sampled."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    config = Mistral3Config(
        text_config=_ministral3().config.to_dict(),
        vision_config=PixtralVisionConfig(**vision, image_size=16, patch_size=4).to_dict(),
        image_token_index=95,
    )
    torch.manual_seed(0)
    model = _sharpened(Mistral3ForConditionalGeneration(config).eval().to(DEVICE), 4.0)
    assert captured_supports(model, {}, None, decode_step="fused") is None
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    sampler = CapturedGenerator(model, tokenizer, [EOS], PAD, suppress_token_ids=[95], decode_step="fused")
    for prompt in ([5, 9, 13, 4, 7, 30], [40, 41]):  # one at a time: the model's own positions, no padding
        got, want = _greedy_and_generates(sampler, [prompt], 12, suppress_tokens=[95])
        assert got == want


def test_the_captured_loop_serves_qwen3_5s_vision_language_model_for_text_prompts():
    """Qwen3.5's checkpoints load as Qwen3_5ForConditionalGeneration (grouprl and TRL load a model id whose config
    has a vision tower that way). Its text tokens take the same position on the three axes of its multimodal RoPE,
    so a text-only call runs through its hybrid language model in the captured loop: greedy, generate's tokens; sampled,
    a separate forward's logprobs."""
    from vlm_models import sharpen, tiny_qwen3_5

    model, processor = tiny_qwen3_5()
    model = _own_norm_weights(sharpen(model, 4.0)).eval().to(DEVICE)
    assert captured_supports(model, {}, None, decode_step="fused") is None
    tokenizer, eos = processor.tokenizer, model.generation_config.eos_token_id
    image_token = model.config.image_token_id
    prompts = [[5, 9, 13, 4, 7, 30], [40, 41], [3, 3, 8, 60]]
    sampler = CapturedGenerator(model, tokenizer, [eos], eos, suppress_token_ids=[image_token], decode_step="fused")
    greedy = [c.token_ids for c in sampler.generate(prompts, 1, SamplingParams(max_new_tokens=12, top_k=1))]
    for prompt, got in zip(prompts, greedy):  # one prompt at a time: no padding, the model's own positions
        want = model.generate(
            input_ids=torch.tensor([prompt], device=DEVICE), do_sample=False, max_new_tokens=12,
            suppress_tokens=[image_token], eos_token_id=eos, pad_token_id=eos,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert got == (want[: want.index(eos) + 1] if eos in want else want)
    _samples_keep_to_the_forward_without(sampler, prompts, image_token)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_routed_experts_give_the_forwards_logits_under_each_experts_implementation(implementation):
    """A layer of routed experts runs the model's own block in the step, so whichever of transformers' experts
    implementations the model is set to (the captured loop sets grouped_mm while it captures), the step's logits are
    the forward's under it."""
    torch.manual_seed(0)
    model = _qwen3_moe().eval()
    model.config._experts_implementation = implementation
    expected, got = _random_decode(model)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want.reshape(have.shape), atol=2e-5, rtol=1e-4)


def test_experts_multiply_in_the_products_dtype():
    """fp32 weights under bf16 autocast (the trainer's GPU setting): the step's experts run on bf16 copies, as its
    dense products do (transformers' grouped_mm multiplies in the weights' dtype, and on CUDA only bf16 needs no host
    sync, which a CUDA graph cannot hold); in fp32 they are read in place."""
    torch.manual_seed(0)
    model = _qwen3_moe().eval()
    assert FusedDecoder(model).layers[1].experts.weights == {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copies = FusedDecoder(model).layers[1].experts.weights
    assert {name: w.dtype for name, w in copies.items()} == {
        "experts.gate_up_proj": torch.bfloat16,
        "experts.down_proj": torch.bfloat16,
    }


def test_captured_steps_run_the_experts_without_host_syncs_and_restore_the_models_choice(tiny_model_dir, monkeypatch):
    """transformers' eager experts read on the host which experts were hit, which a CUDA graph cannot hold: while the
    loop records and replays its steps the experts run grouped_mm where they multiply in bf16 (torch's reads its
    offsets on the host in other dtypes), else batched_mm; the model's own choice is back afterwards."""
    torch.manual_seed(0)
    model = _qwen3_moe().eval()
    model.config._experts_implementation = "eager"
    seen = []

    def steps_without_a_graph(loop, steps, capture):  # this machine may have no CUDA: what is set, then run eagerly
        seen.append((capture, model.config._experts_implementation))
        return run_steps(loop, steps, capture=False)

    monkeypatch.setattr(static_decode, "run_steps", steps_without_a_graph)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    for capture, precision in ((True, torch.bfloat16), (True, torch.float32), (False, torch.bfloat16)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == torch.bfloat16):
            CapturedGenerator(model, tokenizer, [2], 0, capture=capture, decode_step="fused").generate(
                [[5, 9, 13]], 2, SamplingParams(max_new_tokens=8)
            )
    assert seen == [(True, "grouped_mm"), (True, "batched_mm"), (False, "eager")]
    assert model.config._experts_implementation == "eager"


def test_the_captured_loop_names_a_rope_whose_values_follow_the_batch():
    """Dynamic NTK RoPE rescales every position's frequencies by the longest sequence seen so far: no table made
    once per call holds that, so the captured loop refuses it by name and 'auto' samples with generate."""
    torch.manual_seed(0)
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}
    dynamic = LlamaForCausalLM(LlamaConfig(**SIZES, rope_parameters=rope))
    assert (
        captured_supports(dynamic, {}, None, decode_step="fused")
        == "its RoPE ('dynamic') recomputes cos/sin from the batch's positions"
    )


def test_a_model_that_computes_differently_is_caught_by_the_probe():
    """Gemma has Llama's module names and types but scales its embeddings and its norms by (1 + w): only the
    probe can tell, and it does."""
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(**SIZES, head_dim=16, hidden_activation="gelu_pytorch_tanh")).eval()
    reason = structure_reason(gemma) or probe(gemma)
    assert reason is not None


def test_probe_rejects_a_changed_layer_and_says_by_how_much():
    torch.manual_seed(0)
    model = _llama().eval()
    mlp = model.model.layers[1].mlp
    plain = type(mlp).forward
    mlp.forward = lambda x: 2.0 * plain(mlp, x)  # structure unchanged, arithmetic not
    reason = probe(model)
    assert reason is not None and "differ from its forward by up to" in reason


def test_probe_compares_in_fp32_when_the_forward_is_wrapped_in_autocast():
    """accelerator.prepare wraps a bf16 run's model.forward in autocast; the probe's reference must stay fp32
    (a regression: inside the trainer the probe compared bf16 logits with fp32 ones and refused every model)."""
    torch.manual_seed(0)
    model = _llama().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    assert probe(model) is None


@pytest.fixture
def tokenizer(tiny_model_dir):
    return PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)


def _generate(model, tokenizer, fuse, prompts, seed=0):
    generator = FastGenerator(
        model,
        tokenizer,
        [tokenizer.eos_token_id],
        tokenizer.pad_token_id,
        fuse_decode=fuse,
        sampling_method="multinomial",
    )
    torch.manual_seed(seed)
    return generator.generate(prompts, 4, SamplingParams(max_new_tokens=24, temperature=1.0))


def test_generation_samples_the_same_tokens_with_and_without_fused_steps(tiny_model_dir, tokenizer):
    """fp32, the same seed: every completion token and its logprob as decoding through the forward."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 + 3?", "Count: 1 2", "x")]
    plain = _generate(model, tokenizer, False, prompts)
    fused = _generate(model, tokenizer, True, prompts)
    assert fuses(model) and fused_decode._VERDICTS[model] is None
    assert [c.token_ids for c in fused] == [c.token_ids for c in plain]
    for a, b in zip(fused, plain):
        fused_logprobs, plain_logprobs = torch.tensor(a.sampler_logprobs), torch.tensor(b.sampler_logprobs)
        torch.testing.assert_close(fused_logprobs, plain_logprobs, atol=1e-4, rtol=1e-4)


def test_a_refused_model_still_generates_through_its_forward(tiny_model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    plain = type(mlp).forward
    mlp.forward = lambda x: plain(mlp, x) * 1.5
    prompts = [tokenizer("What is 2 + 3?")["input_ids"]]
    out = _generate(model, tokenizer, True, prompts)
    assert not fuses(model) and "differ from its forward" in fused_decode._VERDICTS[model]
    assert len(out) == 4 and all(c.token_ids for c in out)


@pytest.mark.parametrize("packing", ["as this CPU allows", "declined"])
@pytest.mark.parametrize(
    "build",
    [_llama, _phi3, _qwen3_moe, _gpt_oss, _qwen3_5],
    ids=["llama", "phi3 (partial RoPE)", "qwen3_moe", "gpt_oss", "qwen3_5"],
)
def test_bf16_autocast_steps_are_as_close_to_fp32_as_the_forwards(packing, build, monkeypatch):
    """Under bf16 autocast neither path matches fp32 exactly; the fused one must be no further from it. "declined"
    is the path of a CPU whose oneDNN runs no bf16 (AVX2-only): the bf16 weights multiplied unpacked. Here (the
    engine's fp32 cache) RoPE writes q and k into a buffer of their own: Phi-3's unrotated dimensions too."""
    if packing == "declined":
        monkeypatch.setattr(fused_decode, "packs_weights", lambda dtype, device: False)
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)  # logits of a real model's scale
    reference, _ = _random_decode(model, steps=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward_bf16, fused_bf16 = _random_decode(model, steps=6)
    forward_error = max(float((f.reshape(r.shape) - r).abs().max()) for f, r in zip(forward_bf16, reference))
    fused_error = max(float((f.reshape(r.shape) - r).abs().max()) for f, r in zip(fused_bf16, reference))
    scale = max(float(r.abs().max()) for r in reference)
    assert fused_error <= max(1.5 * forward_error, 0.02 * scale)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = FusedDecoder(model)
    products = [decoder.head, *(p for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    packed = packing != "declined" and packs_weights(torch.bfloat16, torch.device("cpu"))  # as the steps above ran
    assert decoder.packed == packed and all(w.is_mkldnn == packed for product in products for w, _ in product)


def test_training_generates_with_fused_steps(tiny_model_dir, tmp_path):
    """The trainer's default engine on CPU reaches the fused step (its verdict is reached and positive)."""

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = quiet_config(tmp_path, per_device_train_batch_size=6, max_completion_length=8, max_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_tokens, args=config, train_dataset=numbered_prompts())
    trainer.train()
    assert fused_decode._VERDICTS.get(trainer.model, "never asked") is None
