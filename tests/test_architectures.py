"""Language models whose layers are not all full attention: hybrids (Qwen3.5: gated-delta-rule linear attention
beside full attention; Nemotron-H: Mamba-2 layers) and sliding windows (Gemma 3: sliding layers between full ones;
Mistral: every layer; GPT-OSS, with attention sinks and experts besides; Gemma 4, whose full-attention layers have
a head_dim of their own) and routed experts (Qwen3-MoE), built tiny here. Each sampler that takes them decodes what
the model's own forward says, a training forward scores a row the same alone or left-padded in a batch, and the
samplers that cannot serve them say so by name."""

import logging

import datasets
import pytest
import torch

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.core.types import SamplingParams
from grouprl.demo.tokenizer import EOS_TOKEN, build_tokenizer
from grouprl.generation import decode_probe
from grouprl.generation.engine import FastGenerator
from grouprl.generation.hf import TransformersGenerator
from grouprl.generation.model_step import ModelStep
from grouprl.generation.protocol import left_pad
from grouprl.generation.static_decode import CapturedGenerator, captured_supports, step_choice
from grouprl.model.logprobs import completion_logprobs

TOKENIZER = build_tokenizer()
EOS = TOKENIZER.convert_tokens_to_ids(EOS_TOKEN)
SIZES = dict(
    vocab_size=len(TOKENIZER),
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=EOS,
    eos_token_id=EOS,
    pad_token_id=EOS,
)


def qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    linear = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    layers = ["linear_attention", "full_attention"] * 2
    return Qwen3_5ForCausalLM(
        Qwen3_5TextConfig(**SIZES, num_hidden_layers=4, head_dim=16, layer_types=layers, **linear)
    )


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layers = ["sliding_attention", "full_attention"] * 2
    config = Gemma3TextConfig(**SIZES, num_hidden_layers=4, head_dim=16, sliding_window=6, layer_types=layers)
    return Gemma3ForCausalLM(config)


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**SIZES, num_hidden_layers=2, sliding_window=6))


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    layers = ["sliding_attention", "full_attention"] * 2
    experts = dict(num_local_experts=4, num_experts_per_tok=2)
    config = GptOssConfig(**SIZES, num_hidden_layers=4, head_dim=16, sliding_window=6, layer_types=layers, **experts)
    return GptOssForCausalLM(config)


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SIZES, num_hidden_layers=2, head_dim=16, **experts))


def gemma4():
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    layers = ["sliding_attention", "full_attention"] * 2
    per_layer_inputs = dict(vocab_size_per_layer_input=SIZES["vocab_size"], hidden_size_per_layer_input=8)  # tiny
    config = Gemma4TextConfig(
        **SIZES, num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=6, layer_types=layers,
        **per_layer_inputs,
    )  # fmt: skip
    return Gemma4ForCausalLM(config)


def nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return NemotronHForCausalLM(NemotronHConfig(**SIZES, num_hidden_layers=4, hybrid_override_pattern="M*M-"))


# the in-process samplers each takes (the others refuse it by name)
MODELS = {
    "qwen3_5": (qwen3_5, ("transformers", "captured")),  # its delta rule through the static cache's state buffers
    "gemma3": (gemma3, ("transformers", "engine", "captured")),
    "mistral": (mistral, ("transformers", "engine", "captured")),
    "gpt_oss": (gpt_oss, ("transformers", "engine", "captured")),  # attention sinks, sliding windows, experts
    "qwen3_moe": (qwen3_moe, ("transformers", "engine", "captured")),  # routed experts
    "gemma4": (gemma4, ("transformers", "engine", "captured")),  # layers of different head_dim (heterogeneous)
    "nemotron_h": (nemotron_h, ("transformers",)),  # Mamba-2 layers beside attention and MLP-only ones
}
PROMPTS = [TOKENIZER("a fairly long prompt with many words in it")["input_ids"], TOKENIZER("short")["input_ids"]]
NEW_TOKENS = 16  # well past the 6-token windows


def built(arch, sharpened=True):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MODELS[arch][0]()
    with torch.no_grad():  # larger weights: logits that depend clearly on the context
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name and sharpened:
                param.mul_(4.0)
    return model.eval()


def argmax_without_cache(model, prompt):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("arch", MODELS)
def test_greedy_decoding_follows_the_models_own_forward(arch):
    model = built(arch)
    expected = [argmax_without_cache(model, p) for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, top_k=1)
    samplers = {"transformers": TransformersGenerator, "engine": FastGenerator, "captured": CapturedGenerator}
    for name in MODELS[arch][1]:
        sampled = samplers[name](model, TOKENIZER, [EOS], EOS).generate(PROMPTS, 1, greedy)
        assert [c.token_ids for c in sampled] == expected, name


@pytest.mark.parametrize("arch", MODELS)
def test_a_rows_logprobs_are_the_same_alone_or_left_padded_in_a_batch(arch):
    model = built(arch)
    completions = [[65, 66, 67, 68, 69, 70, 71, 72], [75, 76]]

    def logprobs(indices):
        prompt_ids, prompt_mask = left_pad([PROMPTS[i] for i in indices], EOS)
        completion_ids = torch.full((len(indices), 8), EOS)
        completion_mask = torch.zeros(len(indices), 8, dtype=torch.bool)
        for row, i in enumerate(indices):
            completion_ids[row, : len(completions[i])] = torch.tensor(completions[i])
            completion_mask[row, : len(completions[i])] = True
        with torch.no_grad():
            out = completion_logprobs(
                model, prompt_ids, prompt_mask.bool(), completion_ids, completion_mask, temperature=1.0
            )
        return out.logprobs[indices.index(1), :2]  # the short prompt: the most padding when batched

    ids = torch.tensor([PROMPTS[1] + completions[1]])
    with torch.no_grad():
        plain = model(ids).logits[0, len(PROMPTS[1]) - 1 : -1].log_softmax(-1)
    expected = plain.gather(-1, torch.tensor(completions[1])[:, None])[:, 0]
    torch.testing.assert_close(logprobs([1]), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logprobs([0, 1]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.e2e
@pytest.mark.parametrize("arch", MODELS)
def test_it_trains_and_the_samplers_it_cannot_use_are_named(arch, tmp_path, caplog):
    model = built(arch, sharpened=False).train()
    rows = datasets.Dataset.from_list([{"prompt": f"{i} plus {i} is"} for i in range(4)])

    def config(engine):
        return GRPOConfig(
            output_dir=str(tmp_path / engine),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=8,
            learning_rate=0.05,
            max_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            bf16=False,
            generation_engine=engine,
        )

    def trainer(engine):
        return GRPOTrainer(
            model,
            lambda completion_ids, **kwargs: [float(sum(c) % 11) for c in completion_ids],  # differs between samples
            args=config(engine),
            train_dataset=rows,
            processing_class=TOKENIZER,
        )

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="grouprl"):
        auto = trainer("auto")
    samplers = MODELS[arch][1]
    if "engine" in samplers:  # CPUs' pick
        assert "generation_engine='auto' samples with" not in caplog.text
    else:  # where it cannot: the captured loop where that serves it, else transformers generate; and why
        pick = "'captured'" if "captured" in samplers else "transformers generate"
        assert f"generation_engine='auto' samples with {pick}, not 'engine': " in caplog.text
    auto.train()
    assert all(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    if "captured" in MODELS[arch][1]:  # what 'auto' picks on CUDA, here eager: it samples from the trained weights
        trainer("captured").train()
        assert step_choice(model)[1] is None  # the step's verdict, reached by training, is positive
    for engine in {"engine", "captured"} - set(MODELS[arch][1]):
        with pytest.raises(ValueError, match=f"generation_engine='{engine}' cannot be used: .*Use 'auto'"):
            trainer(engine)


def test_layers_that_differ_in_shape_run_the_models_own_step_not_the_fused_one():
    """Gemma 4's layers of two head_dims: its own forward runs them (the fused step has no row for it)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    layers = ["full_attention"] * 2  # no sliding window: the shapes are the first thing it cannot serve
    config = Gemma4TextConfig(
        **SIZES, num_hidden_layers=2, head_dim=16, global_head_dim=32, layer_types=layers, hidden_size_per_layer_input=8
    )
    if not getattr(config, "is_heterogeneous", False):
        pytest.skip("this transformers builds Gemma 4 with one head_dim for all layers (per_layer_config is newer)")
    model = Gemma4ForCausalLM(config).eval()
    assert captured_supports(model, {}, None) is None and step_choice(model)[0] == "model"
    assert decode_probe.step_gap(model, ModelStep, positions=128) < 1e-5
    assert captured_supports(model, {}, None, decode_step="fused") == (
        "its model type ('gemma4_text') has no row in fused_step.FAMILIES"
    )


EXPERTS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]  # GPT-OSS's experts are parameters, not modules


def experts_lora(trained):
    """GPT-OSS with LoRA on its expert parameters (peft's target_parameters); `trained`: B matrices not zero."""
    peft = pytest.importorskip("peft", reason="peft is an optional dependency (LoRA)")
    torch.manual_seed(0)
    return peft.get_peft_model(gpt_oss(), peft.LoraConfig(target_parameters=EXPERTS, init_lora_weights=not trained))


def lora_trainer(model, tmp_path, **overrides):
    args = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=8, learning_rate=0.05)
    args.update(max_steps=2, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, bf16=False)
    return GRPOTrainer(
        model,
        lambda completion_ids, **kwargs: [float(sum(c) % 11) for c in completion_ids],
        args=GRPOConfig(output_dir=str(tmp_path), beta=0.1, **args, **overrides),
        train_dataset=datasets.Dataset.from_list([{"prompt": f"{i} plus {i} is"} for i in range(8)]),
        processing_class=TOKENIZER,
    )


def first_kl(trainer):
    return next(entry["kl"] for entry in trainer.state.log_history if "kl" in entry)


def test_a_trained_lora_on_expert_parameters_is_its_own_reference(tmp_path):
    """beta > 0 with a pre-wrapped, trained adapter on GPT-OSS's experts: the reference is a frozen copy of it (a
    second target_parameters adapter, which peft allows since 0.20), so the first step's KL is zero."""
    model = experts_lora(trained=True)
    try:
        model.add_adapter("probe", model.peft_config["default"])
    except ValueError as error:
        pytest.skip(f"this peft refuses a second target_parameters adapter: {error}")
    model.delete_adapter("probe")
    trainer = lora_trainer(model, tmp_path)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    ref = [name for name in before if ".ref." in name]
    assert ref and all(torch.equal(before[n], before[n.replace(".ref.", ".default.")]) for n in ref)
    assert all(torch.equal(before[n], trainer.model.get_parameter(n)) for n in ref)
    assert first_kl(trainer) == pytest.approx(0.0, abs=1e-7)  # the initial adapter, not the base model


def test_where_peft_allows_one_expert_adapter_an_untrained_one_is_disabled_and_a_trained_one_named(
    tmp_path, monkeypatch
):
    """peft before 0.20 refuses a second target_parameters adapter (simulated here with its own error): an
    adapter that adds nothing yet is its own reference with adapters disabled; a trained one stops with the way out."""
    peft = pytest.importorskip("peft", reason="peft is an optional dependency (LoRA)")

    def refuse(self, name, config, **kwargs):
        raise ValueError("At the moment, only one LoRA adapter per model with `target_parameters` is allowed.")

    monkeypatch.setattr(peft.PeftModel, "add_adapter", refuse)
    trainer = lora_trainer(experts_lora(trained=False), tmp_path / "fresh")
    trainer.train()
    assert list(trainer.model.peft_config) == ["default"] and first_kl(trainer) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match=r"adapter 'default' is trained .* Upgrade peft .* or set beta=0.0"):
        lora_trainer(experts_lora(trained=True), tmp_path / "trained")


def test_the_captured_loop_samples_a_trained_lora_on_expert_parameters_as_the_forward(tmp_path):
    """TRL's GPT-OSS recipe, LoRA on the experts' parameters, trained with generation_engine='captured' (eager here,
    a CUDA graph on CUDA): after training, the loop's greedy tokens are the trained model's own forward's, so each
    generation samples the adapters as they are then."""
    trainer = lora_trainer(experts_lora(trained=True), tmp_path, generation_engine="captured")
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_B.default" in name}
    trainer.train()
    model = trainer.model.eval()
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters() if name in before)
    expected = [argmax_without_cache(model, p) for p in PROMPTS]
    expected = [row[: row.index(EOS) + 1] if EOS in row else row for row in expected]
    greedy = CapturedGenerator(model, TOKENIZER, [EOS], EOS).generate(
        PROMPTS, 1, SamplingParams(max_new_tokens=NEW_TOKENS, top_k=1)
    )
    assert [c.token_ids for c in greedy] == expected
