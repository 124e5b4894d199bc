"""The hand-written decode step (generation/fused_step.py): for every row of FAMILIES, the same logprobs as the
model's own forward over 128 positions, through the static cache (the captured loop) and the shared-prefix cache
(the CPU engine), LoRA adapters included; what it cannot run it names; a planted error is caught by the probe; the
samplers sample with it as through the forward."""

import logging

import pytest
import torch
from decoding import DEVICE, EOS, PAD, greedy_and_generates, samples_keep_to_the_forward_without, sharpened
from helpers import distinct_tokens, forward_logprobs, numbered_prompts, quiet_config
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SiglipVisionConfig,
)

from grouprl import GRPOTrainer
from grouprl.core.types import SamplingParams
from grouprl.generation import FastGenerator, cpu_products, decode_probe, fused_step, static_decode
from grouprl.generation.fused_step import FAMILIES, ONE_ROPE, FusedDecoder, fuses, structure_reason
from grouprl.generation.shared_prefix import SAMPLES, shared_decode, shared_prefill
from grouprl.generation.static_decode import CapturedGenerator, captured_supports, run_steps, step_choice

SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
POSITIONS = 128


def _llama():
    # llama3 rope scaling: cos/sin come from the model's own rotary embedding, whatever its type
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return LlamaForCausalLM(LlamaConfig(**SIZES, rope_scaling={**rope, "original_max_position_embeddings": 32}))


def _llama_with_biases():
    return LlamaForCausalLM(LlamaConfig(**SIZES, attention_bias=True, tie_word_embeddings=True))


def _qwen2():  # q/k/v biases
    return Qwen2ForCausalLM(Qwen2Config(**SIZES))


def _qwen3_moe():  # routed experts (top 2 of 4, renormalised) in one layer, a dense MLP in the other; q/k norms
    config = Qwen3MoeConfig(
        **SIZES,
        num_experts_per_tok=2,
        head_dim=16,
        num_experts=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    )
    return Qwen3MoeForCausalLM(config)


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


BUILDERS = {  # a test model for each row of FAMILIES (test_every_family_has_a_test_model)
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3_moe": _qwen3_moe,
    "gemma3_text": _gemma3,
}
ACCEPTED = {**BUILDERS, "llama with biases, tied head": _llama_with_biases}


def test_every_family_has_a_test_model():
    """Adding a row to FAMILIES takes a test model here (and nothing else in the tests)."""
    assert sorted(BUILDERS) == sorted(FAMILIES)
    for model_type, build in BUILDERS.items():
        assert build().config.model_type == model_type


@pytest.mark.parametrize("build", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_fused_steps_give_the_forwards_logprobs_over_128_positions(build):
    """Over the static cache (the captured loop's), sliding windows sliding; fp32 differs by summation order only."""
    torch.manual_seed(0)
    model = build().eval()
    assert structure_reason(model) is None
    assert decode_probe.step_gap(model, FusedDecoder, POSITIONS) < 1e-5


def _shared_prefix_pair(model, steps=6, seed=0):
    """(the forward's, the fused step's) logits over the shared-prefix cache (the CPU engine's), 2 samples a prompt."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (3, 7), generator=generator)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[2, :1] = 0
    fed = torch.randint(0, model.config.vocab_size, (steps, 3 * SAMPLES), generator=generator)
    with torch.no_grad():
        expected = shared_decode(model, prompts, mask, fed)
        cache = shared_prefill(model, model.config, prompts, mask, SAMPLES, steps)
        decoder, positions, got = FusedDecoder(model), mask.repeat_interleave(SAMPLES, 0).sum(dim=1), []
        for tokens in fed:
            got.append(decoder.step(tokens, positions, cache))
            positions = positions + 1
    return [e.reshape(g.shape) for e, g in zip(expected, got)], got


@pytest.mark.parametrize("build", [_llama, _qwen2, _llama_with_biases], ids=["llama", "qwen2", "llama with biases"])
def test_fused_steps_give_the_forwards_logits_over_the_shared_prefix_cache(build):
    torch.manual_seed(0)
    for want, have in zip(*_shared_prefix_pair(build().eval())):
        torch.testing.assert_close(have, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_the_captured_loop_decodes_each_family_as_its_forward(build, tiny_model_dir):
    """Greedy, the fused step's tokens are transformers generate's; sampled, each token's logprob is a separate
    forward's."""
    torch.manual_seed(0)
    model = sharpened(build().eval().to(DEVICE), 4.0)
    assert captured_supports(model, {}, None, decode_step="fused") is None
    prompts = [[5, 9, 13, 2, 7, 30], [40, 41], [3, 3, 8, 60]]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    sampler = CapturedGenerator(model, tokenizer, [EOS], PAD, decode_step="fused")
    got, want = greedy_and_generates(sampler, prompts, 12)
    assert got == want
    for sample in sampler.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0)):
        expected = forward_logprobs(model, prompts[sample.prompt_index], sample.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(sample.sampler_logprobs), expected, atol=1e-4, rtol=1e-4)


def test_the_table_picks_each_samplers_step():
    """The captured loop runs the fused step for the rows with a `gpu` measurement, its own forward for the others;
    the CPU engine fuses the rows with a `cpu` one."""
    torch.manual_seed(0)
    for model_type, build in BUILDERS.items():
        model = build().eval()
        assert step_choice(model)[0] == ("fused" if FAMILIES[model_type].gpu else "model"), model_type
        assert fuses(model) == (FAMILIES[model_type].cpu is not None), model_type


@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama3 rope", "default rope"])
def test_a_rope_table_holds_each_positions_own_values(build):
    """The static loop's steps gather RoPE's cos and sin from a table made once per call; each entry is bit for bit
    what a step computes at that position, whatever positions the step's rows are at."""
    torch.manual_seed(0)
    decoder = FusedDecoder(build().eval())
    positions = torch.tensor([0, 5, 5, 63, 17, 40])
    cos, signed_sin = decoder._rope(positions, ONE_ROPE)
    decoder.tabulate_rope(64)
    assert torch.equal(torch.cat(decoder._rope_at(positions, ONE_ROPE), dim=1), torch.cat([cos, signed_sin], dim=1))


LORA = {
    "llama, every linear layer": (_llama, dict(target_modules="all-linear", lora_dropout=0.0)),
    # peft's target_parameters: a wrapper a parameter, nested
    "qwen3_moe, the experts' parameters": (
        _qwen3_moe,
        dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    ),
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
    with_adapters = decode_probe.step_logprobs(base, FusedDecoder, 16)
    with model.disable_adapter():
        without = decode_probe.step_logprobs(base, FusedDecoder, 16)
    assert (with_adapters[1] - without[1]).abs().max() > 0.1  # the adapters change the forward ...
    for got, want in (with_adapters, without):  # ... and the fused step follows them
        assert (got - want).abs().max() < 1e-5
    wrappers = [m for m in base.modules() if hasattr(m, "parameter_name")]
    routed = sum(hasattr(layer.mlp, "experts") for layer in base.model.layers)
    assert len(wrappers) == len(targets.get("target_parameters", [])) * routed
    assert not any(w.disable_adapters for w in wrappers)


def test_structures_it_cannot_run_are_named():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert structure_reason(gpt2) == "its model type ('gpt2') has no row in fused_step.FAMILIES"
    assert structure_reason(MistralForCausalLM(MistralConfig(**SIZES))) == (
        "its model type ('mistral') has no row in fused_step.FAMILIES"
    )
    softcapped = Gemma3ForCausalLM(Gemma3TextConfig(**SIZES, head_dim=16, final_logit_softcapping=30.0))
    assert structure_reason(softcapped) == "config.final_logit_softcapping is set"
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}
    dynamic = LlamaForCausalLM(LlamaConfig(**SIZES, rope_parameters=rope))
    assert structure_reason(dynamic) == f"its RoPE ('dynamic') is none of {fused_step.ROPE_TYPES}"
    replaced = _llama().eval()
    mlp = replaced.model.layers[1].mlp
    mlp.forward = lambda x: 2.0 * type(mlp).forward(mlp, x)  # structure unchanged, arithmetic not
    assert structure_reason(replaced) == (
        "the forward of its module layers.1.mlp is replaced on the instance, which the step cannot follow"
    )
    # asked for, the fused step is refused with its reason; unasked, such models run their own forward
    assert captured_supports(gpt2, {}, None, decode_step="fused") == structure_reason(gpt2)
    assert step_choice(Gemma2ForCausalLM(Gemma2Config(**SIZES, head_dim=16)))[0] == "model"


def _plant(plant, monkeypatch):
    if plant == "RoPE one position ahead":
        rope = FusedDecoder._rope
        monkeypatch.setattr(FusedDecoder, "_rope", lambda self, positions, kind: rope(self, positions + 1, kind))
    elif plant == "a norm weight 1% off":
        norm_pair = FusedDecoder._norm_pair

        def off(self, norm):
            weight, eps = norm_pair(self, norm)
            return weight * 1.01, eps

        monkeypatch.setattr(FusedDecoder, "_norm_pair", off)
    else:
        gather = FusedDecoder._gather

        def wider(self, *args):
            layer = gather(self, *args)
            return layer._replace(window=layer.window and layer.window + 1)

        monkeypatch.setattr(FusedDecoder, "_gather", wider)


@pytest.mark.parametrize("plant", ["RoPE one position ahead", "a norm weight 1% off", "a window one too wide"])
def test_the_probe_refuses_a_planted_error_in_the_step(plant, monkeypatch):
    """Were the step to compute otherwise than the forward, each plant moves the fp32 twin's gap past the tolerance,
    and the verdict says by how much."""
    torch.manual_seed(0)
    _plant(plant, monkeypatch)
    monkeypatch.setattr(decode_probe, "_VERDICTS", {})
    reason = decode_probe.verdict(_gemma3().eval(), "fused", FusedDecoder)
    assert reason is not None and "fused step differs from its forward by" in reason


def _gemma3_vision_language(image_token=95):
    """Gemma 3 4B and up: the Gemma 3 text decoder of `_gemma3` under a SigLIP tower, as
    Gemma3ForConditionalGeneration (which transformers loads for text too)."""
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = Gemma3Config(
        text_config=_gemma3().config.to_dict(),
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


def test_the_captured_loop_serves_gemma3s_vision_language_model_with_the_fused_step(tiny_model_dir):
    """Text-only prompts to Gemma 3's vision-language model run through its language model with the fused step (its
    text config's row), its image placeholder never sampled (transformers generate is told to suppress it, as TRL
    does): greedy, the tokens are generate's; sampled, each token's logprob is a separate forward's."""
    torch.manual_seed(0)
    image_token = 95
    model = _gemma3_vision_language(image_token).eval().to(DEVICE)
    with torch.no_grad():  # the placeholder as likely as a token greedy decoding picks: suppressing it matters
        model.lm_head.weight[image_token] = 2 * model.lm_head.weight[80]
    assert step_choice(model) == ("fused", None)
    prompts = [[5, 9, 13, 4, 7, 30], [40, 41], [3, 3, 8, 60]]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    sampler = CapturedGenerator(model, tokenizer, [EOS], PAD, suppress_token_ids=[image_token])
    unsuppressed = greedy_and_generates(sampler, prompts, 12)[1]
    assert any(image_token in row for row in unsuppressed)  # greedy decoding would emit it
    got, want = greedy_and_generates(sampler, prompts, 12, suppress_tokens=[image_token])
    assert got == want
    samples_keep_to_the_forward_without(sampler, prompts, image_token)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_routed_experts_give_the_forwards_logprobs_under_each_experts_implementation(implementation):
    """A layer of routed experts runs the model's own block in the step, so whichever of transformers' experts
    implementations the model is set to (the captured loop sets grouped_mm while it captures), the step's logprobs
    are the forward's under it."""
    torch.manual_seed(0)
    model = _qwen3_moe().eval()
    model.config._experts_implementation = implementation
    assert decode_probe.step_gap(model, FusedDecoder, 16) < 1e-5


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


def test_the_engine_samples_the_same_tokens_with_and_without_fused_steps(tokenizer, tiny_model_dir):
    """fp32, the same seed: every completion token and its logprob as decoding through the forward."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 + 3?", "Count: 1 2", "x")]
    plain = _generate(model, tokenizer, False, prompts)
    fused = _generate(model, tokenizer, True, prompts)
    assert fuses(model) and fused_step._VERDICTS[model] is None
    assert [c.token_ids for c in fused] == [c.token_ids for c in plain]
    for a, b in zip(fused, plain):
        torch.testing.assert_close(
            torch.tensor(a.sampler_logprobs), torch.tensor(b.sampler_logprobs), atol=1e-4, rtol=1e-4
        )


def test_a_refused_model_generates_through_its_forward(tokenizer, tiny_model_dir, caplog):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x: type(mlp).forward(mlp, x) * 1.5
    with caplog.at_level(logging.INFO, logger="grouprl"):
        out = _generate(model, tokenizer, True, [tokenizer("What is 2 + 3?")["input_ids"]])
    assert not fuses(model) and "replaced on the instance" in caplog.text
    for sample in out:
        expected = forward_logprobs(model, tokenizer("What is 2 + 3?")["input_ids"], sample.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(sample.sampler_logprobs), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("packing", ["as this CPU allows", "declined"])
@pytest.mark.parametrize("build", [_llama, _qwen3_moe, _gemma3], ids=["llama", "qwen3_moe", "gemma3"])
def test_bf16_autocast_steps_are_as_close_to_fp32_as_the_forwards(packing, build, monkeypatch):
    """Under bf16 autocast neither path matches fp32 exactly; the fused one must be no further from it. "declined"
    is the path of a CPU whose oneDNN runs no bf16 (AVX2-only): the bf16 weights multiplied unpacked."""
    if packing == "declined":
        monkeypatch.setattr(fused_step, "packs_weights", lambda dtype, device: False)
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)  # logits of a real model's scale
    reference = decode_probe.step_logprobs(model, FusedDecoder, 12)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_bf16, forward_bf16 = decode_probe.step_logprobs(model, FusedDecoder, 12)
    forward_error, fused_error = (
        float((forward_bf16 - reference).abs().max()),
        float((fused_bf16 - reference).abs().max()),
    )
    assert fused_error <= max(1.5 * forward_error, 0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = FusedDecoder(model)
    products = [decoder.head, *(p for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    packed = packing != "declined" and cpu_products.packs_weights(torch.bfloat16, torch.device("cpu"))
    assert decoder.packed == packed and all(w.is_mkldnn == packed for product in products for w, _ in product)


def test_training_generates_with_fused_steps(tiny_model_dir, tmp_path):
    """The trainer's default engine on CPU reaches the fused step (its verdict is reached and positive)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = quiet_config(tmp_path, per_device_train_batch_size=6, max_completion_length=8, max_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_tokens, args=config, train_dataset=numbered_prompts())
    trainer.train()
    assert fused_step._VERDICTS.get(trainer.model, "never asked") is None
