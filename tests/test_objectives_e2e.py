"""End-to-end runs of the objective family on tiny local models: every loss type, the reference model
(full and LoRA), sampler importance sampling, entropy options, MoE aux loss, fp32 head, and the
invariances of the update under micro-batching and under steps_per_generation > GA."""

import logging
import os
import sys

import datasets
import pytest
import torch
from helpers import GradientRecorder, ScriptedBackend, cpu_parameters, max_difference, odd_prompts_tie, parameters
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.core.losses import LOSSES
from grouprl.model.logprobs import completion_logprobs

peft = pytest.importorskip("peft")


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def varied(completion_ids, **kwargs):  # keeps a spread between completions however the policy moves
    return [float(sum(ids) % 7) for ids in completion_ids]


def make_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=8,
        learning_rate=0.05,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
        gradient_checkpointing=False,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def prompts(n=12):
    return datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(n)]})


def scripted(tokenizer, sampler_logprobs=None):
    eos = tokenizer.eos_token_id

    def script(prompt_ids, sample):  # different lengths per sample, some without EOS
        body = [(prompt_ids[-1] + 7 * sample + k) % 200 + 3 for k in range(1 + (sample * 3 + len(prompt_ids)) % 6)]
        return body + ([eos] if sample % 3 else [])

    return ScriptedBackend(script, eos, tokenizer, sampler_logprobs=sampler_logprobs)


def history(trainer, name):
    return [e[name] for e in trainer.state.log_history if e.get(name) is not None]


LOSS_OPTIONS = {
    "grpo": {},
    "bnpo": {},
    "dr_grpo": {},
    "dapo": {},
    "cispo": {"epsilon_high": 5.0},
    "sapo": {},
    "luspo": {"importance_sampling_level": "sequence"},
    "vespo": {},
}


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_every_loss_type_trains_end_to_end(tiny_model_dir, tmp_path, loss_type):
    config = make_config(tmp_path, loss_type=loss_type, num_iterations=2, **LOSS_OPTIONS[loss_type])
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) == len(before), f"parameters that did not train: {set(before) - set(changed)}"
    losses = history(trainer, "loss")
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    expected_metric = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean", "sapo": "policy_ratio/mean"}.get(
        loss_type, "clip_ratio/region_mean"
    )
    assert history(trainer, expected_metric)


def test_gspo_sequence_level_trains_off_policy(tiny_model_dir, tmp_path):
    config = make_config(
        tmp_path, loss_type="grpo", importance_sampling_level="sequence", num_iterations=2, max_steps=4, epsilon=0.02
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    trainer.train()
    assert max(history(trainer, "clip_ratio/region_mean")) > 0.0


def test_num_iterations_ratios_differ_from_one_and_clipping_fires(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, num_iterations=2, max_steps=4, epsilon=0.05)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    trainer.train()
    assert trainer.plan.old_logprobs_needed
    assert max(history(trainer, "policy_ratio/max")) > 1.0 and min(history(trainer, "policy_ratio/min")) < 1.0
    assert max(history(trainer, "clip_ratio/region_mean")) > 0.0


def test_one_iteration_on_policy_ratios_are_exactly_one(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=distinct_tokens, args=make_config(tmp_path), train_dataset=prompts()
    )
    trainer.train()
    assert set(history(trainer, "policy_ratio/max")) == {1.0} and set(history(trainer, "clip_ratio/region_mean")) == {
        0.0
    }


# ---- reference model and KL ---------------------------------------------------------------------


def test_beta_with_a_separate_reference_model(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, beta=0.1, max_steps=3),
        train_dataset=prompts(),
    )
    reference_before = parameters(trainer.ref_model)
    policy_before = parameters(trainer.model)
    assert max_difference(reference_before, policy_before) == 0.0
    trainer.train()
    assert max_difference(parameters(trainer.model), policy_before) > 0  # the policy trains
    assert max_difference(parameters(trainer.ref_model), reference_before) == 0.0  # the reference does not
    kl = history(trainer, "kl")
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 0.0  # identical at the start, apart afterwards


def test_reference_of_a_model_instance_is_a_copy_taken_at_init(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, beta=0.1, max_steps=1),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )
    assert trainer.ref_model is not model and not any(p.requires_grad for p in trainer.ref_model.parameters())
    trainer.train()
    initial = parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir))  # loaded on the CPU: compare there
    assert max_difference(cpu_parameters(trainer.ref_model), initial) == 0.0


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_sync_ref_model_mixes_the_policy_into_the_reference(tiny_model_dir, tmp_path, dynamic_sampling):
    """Also with dynamic sampling, whose extra rounds of sampling leave the reference alone (odd prompts tie)."""

    config = make_config(
        tmp_path,
        beta=0.1,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.25,
        max_steps=1,
        dynamic_sampling=dynamic_sampling,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=odd_prompts_tie,
        args=config,
        train_dataset=prompts(),
        generation_backend=scripted(AutoTokenizer.from_pretrained(tiny_model_dir)),
    )
    reference_before = parameters(trainer.ref_model)
    trainer.train()
    policy, reference = parameters(trainer.model), parameters(trainer.ref_model)
    for name in reference:
        expected = 0.25 * policy[name] + 0.75 * reference_before[name]
        assert torch.allclose(reference[name], expected, atol=1e-6), name
    assert max_difference(reference, reference_before) > 0
    if dynamic_sampling:
        assert history(trainer, "dynamic_sampling/completions_drawn") == [12.0]  # (0 1) then (2 3): 0 and 2 kept


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _split(params):
    lora = {k: v for k, v in params.items() if "lora_" in k}
    return lora, {k: v for k, v in params.items() if "lora_" not in k}


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_lora_trains_adapters_only(tiny_model_dir, tmp_path, beta):
    config = make_config(tmp_path, beta=beta, max_steps=3, learning_rate=0.1)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=varied,
        args=config,
        train_dataset=prompts(),
        peft_config=peft.LoraConfig(**LORA),
    )
    assert trainer.ref_model is None  # the reference is the base model: adapters disabled
    lora_before, base_before = _split(parameters(trainer.model))
    trainer.train()
    lora_after, base_after = _split(parameters(trainer.model))
    assert max_difference(base_before, base_after) == 0.0
    changed = [k for k in lora_before if not torch.equal(lora_before[k], lora_after[k])]
    assert any("lora_B" in k for k in changed) and any("lora_A" in k for k in changed)
    if beta:
        kl = history(trainer, "kl")
        assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 0.0


def test_lora_with_trl_defaults_gradient_checkpointing_and_bf16(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, beta=0.1, max_steps=2, gradient_checkpointing=True, bf16=True)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=varied,
        args=config,
        train_dataset=prompts(),
        peft_config=peft.LoraConfig(**LORA),
    )
    lora_before, base_before = _split(parameters(trainer.model))
    trainer.train()
    lora_after, base_after = _split(parameters(trainer.model))
    assert max_difference(base_before, base_after) == 0.0 and max_difference(lora_before, lora_after) > 0


def test_pre_wrapped_peft_model_with_beta_keeps_a_frozen_reference_adapter(tiny_model_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = peft.get_peft_model(
        base, peft.LoraConfig(**LORA, init_lora_weights=False)
    )  # a non-zero ("trained") adapter
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=varied,
        args=make_config(tmp_path, beta=0.1, max_steps=2),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    ref = [k for k in before if ".ref." in k]
    default = [k for k in before if ".default." in k]
    assert ref and all(torch.equal(before[k], after[k]) for k in ref)
    assert all(
        torch.equal(before[k.replace(".ref.", ".default.")], before[k]) for k in ref
    )  # a copy of the initial adapter
    assert any(not torch.equal(before[k], after[k]) for k in default)
    assert all(torch.equal(before[k], after[k]) for k in before if "lora_" not in k)
    assert all(p.requires_grad == (".default." in n) for n, p in trainer.model.named_parameters())
    assert history(trainer, "kl")[0] == pytest.approx(0.0, abs=1e-7)  # ref adapter == initial adapter, not the base


def test_lora_save_model_writes_the_adapter(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=1),
        train_dataset=prompts(),
        peft_config=peft.LoraConfig(**LORA),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    files = set(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    loaded = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path / "adapter")
    )
    trained = {k: v for k, v in cpu_parameters(trainer.model).items() if "lora_" in k}  # `loaded` is on the CPU
    assert max_difference(trained, {k: v for k, v in parameters(loaded).items() if k in trained}) == 0.0


def test_lora_resume_continues_exactly(tiny_model_dir, tmp_path):
    common = dict(max_steps=2, save_strategy="steps", save_steps=1)
    full = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "a", **common),
        train_dataset=prompts(),
        peft_config=peft.LoraConfig(**LORA),
    )
    full.train()
    resumed = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "b", **common),
        train_dataset=prompts(),
        peft_config=peft.LoraConfig(**LORA),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-1"))
    assert max_difference(parameters(full.model), parameters(resumed.model)) == 0.0


def test_missing_peft_gives_a_clear_import_error(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'grouprl\[peft\]'"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path),
            train_dataset=prompts(),
            peft_config=object(),
        )


def test_sync_ref_model_is_refused_with_lora(tiny_model_dir, tmp_path):
    with pytest.raises(NotImplementedError, match="sync_ref_model"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, beta=0.1, sync_ref_model=True),
            train_dataset=prompts(),
            peft_config=peft.LoraConfig(**LORA),
        )


# ---- sampler importance sampling (any backend that returns sampler logprobs) ---------------------


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampler_importance_sampling_from_a_scripted_backend(tiny_model_dir, tmp_path, mode):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = scripted(tokenizer, sampler_logprobs=lambda ids, s, tokens: [-5.0 - 0.01 * k for k in range(len(tokens))])
    config = make_config(
        tmp_path,
        max_steps=1,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.01,
        vllm_importance_sampling_clip_max=1e6,
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=backend,
    )
    before = parameters(trainer.model)
    assert not trainer.plan.old_logprobs_needed  # on-policy by the plan, but the sampler's logprobs need pi_old
    trainer.train()
    entry = trainer.state.log_history[0]
    for name in (
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/max",
    ):
        assert entry[name] is not None, name
    assert entry["sampling/sampling_logp_difference/mean"] > 0
    assert max_difference(before, parameters(trainer.model)) > 0


@pytest.mark.parametrize("declared_in_process", [False, True])
def test_a_separate_sampler_without_logprobs_is_named_once(tiny_model_dir, tmp_path, caplog, declared_in_process):
    """A backend that counts as a separate sampler (needs_importance_correction, the protocol's default) but returns
    no logprobs trains uncorrected: said once, with the three ways out; a backend declared in-process is not told."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = scripted(tokenizer)
    if declared_in_process:
        backend.needs_importance_correction = False
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=2),
        train_dataset=prompts(),
        generation_backend=backend,
    )
    transformers_logging.warning_once.cache_clear()  # once per process: an earlier test may have been told
    with caplog.at_level(logging.WARNING, logger="grouprl"):
        trainer.train()
    told = [r.getMessage() for r in caplog.records if "came without the sampled tokens' logprobs" in r.getMessage()]
    assert len(told) == (0 if declared_in_process else 1), told
    if told:
        assert "needs_importance_correction = False" in told[0]
        assert "vllm_importance_sampling_correction=False" in told[0]
    assert "sampling/importance_sampling_ratio/mean" not in trainer.state.log_history[0]


def test_sampler_weights_outside_the_band_remove_every_token(tiny_model_dir, tmp_path):
    """The sampler claims each token had probability e^-50: rho = e^{~45} > C_max everywhere, so token_mask zeroes
    the whole policy loss and nothing trains: proof the weights reach the loss."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = scripted(tokenizer, sampler_logprobs=lambda ids, s, tokens: [-50.0] * len(tokens))
    config = make_config(
        tmp_path, max_steps=1, vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=3.0
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=backend,
    )
    before = parameters(trainer.model)
    trainer.train()
    assert trainer.state.log_history[0]["sampling/importance_sampling_ratio/max"] == 0.0
    assert max_difference(before, parameters(trainer.model)) == 0.0


def test_vespo_needs_a_token_level_sampler_correction(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = scripted(tokenizer, sampler_logprobs=lambda ids, s, tokens: [-1.0] * len(tokens))
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, loss_type="vespo"),
        train_dataset=prompts(),
        generation_backend=backend,
    )
    with pytest.raises(ValueError, match="vespo.*token_truncate"):
        trainer.train()


def test_off_policy_mask_uses_the_sampler_logprobs(tiny_model_dir, tmp_path):
    """Sampler logprobs far above the policy's: every negative-advantage sequence
    drifted more than 0.5 and is dropped."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = scripted(tokenizer, sampler_logprobs=lambda ids, s, tokens: [0.0] * len(tokens))
    config = make_config(
        tmp_path, max_steps=1, off_policy_mask_threshold=0.5, vllm_importance_sampling_correction=False
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=backend,
    )
    trainer.train()
    dropped = history(trainer, "off_policy_mask/dropped_fraction")[0]
    assert 0.0 < dropped < 1.0


def test_off_policy_mask_and_top_entropy_train(tiny_model_dir, tmp_path):
    config = make_config(tmp_path, num_iterations=2, off_policy_mask_threshold=0.5, top_entropy_quantile=0.2)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    before = parameters(trainer.model)
    trainer.train()
    assert max_difference(before, parameters(trainer.model)) > 0


# ---- entropy bonus ------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo"])
def test_entropy_bonus_scale(tiny_model_dir, tmp_path, loss_type):
    """(policy_loss - loss) / entropy == entropy_coef: the bonus is the plain mean entropy for every loss type."""
    config = make_config(tmp_path, loss_type=loss_type, entropy_coef=0.1, max_steps=1, logging_steps=1)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    trainer.train()
    entry = trainer.state.log_history[0]
    assert (entry["policy_loss"] - entry["loss"]) / entry["entropy"] == pytest.approx(0.1, rel=1e-4)
    assert entry["entropy_coef"] == 0.1


def test_entropy_gets_a_gradient_only_when_asked(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool)
    assert not completion_logprobs(model, ids, mask, ids, mask, temperature=1.0).entropy.requires_grad
    assert completion_logprobs(model, ids, mask, ids, mask, temperature=1.0, entropy_grad=True).entropy.requires_grad


def test_adaptive_entropy_coefficient_steps_once_per_optimizer_step(tiny_model_dir, tmp_path):
    """Target 15 nats is above any entropy of this model: the coefficient rises
    by delta every optimizer step (GA = 2)."""
    config = make_config(
        tmp_path,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=3,
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_coef_delta=0.005,
        entropy_target=15.0,
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    trainer.train()
    assert history(trainer, "entropy_coef") == pytest.approx([0.01 + 0.005 * step for step in (1, 2, 3)])
    assert trainer.run.entropy_controller.coef == pytest.approx(0.025)


def test_adaptive_entropy_state_survives_resume(tiny_model_dir, tmp_path):
    common = dict(
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_target=15.0,
    )
    full = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "a", **common),
        train_dataset=prompts(),
    )
    full.train()
    state = torch.load(tmp_path / "a" / "out" / "checkpoint-2" / "loop_state.pt", weights_only=False)
    assert state["entropy_controller"]["coef"] == pytest.approx(0.02)
    resumed = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "b", **common),
        train_dataset=prompts(),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    assert resumed.run.entropy_controller.coef == pytest.approx(full.run.entropy_controller.coef) == pytest.approx(0.03)
    assert max_difference(parameters(full.model), parameters(resumed.model)) == 0.0


# ---- model options ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cast_lm_head_to_fp32(tiny_model_dir, tmp_path, dtype):
    config = make_config(
        tmp_path, cast_lm_head_to_fp32=True, beta=0.1, bf16=True, model_init_kwargs={"dtype": dtype}, max_steps=1
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    assert (
        trainer.model.lm_head.weight.dtype == torch.float32 and trainer.ref_model.lm_head.weight.dtype == torch.float32
    )
    assert trainer.ref_model.lm_head.forward.__self__ is trainer.ref_model.lm_head  # the copy patched its own head
    device = trainer.accelerator.device  # where the trainer put the model
    ids, mask = torch.tensor([[5, 6, 7]], device=device), torch.ones(1, 3, dtype=torch.bool, device=device)
    with trainer.accelerator.autocast():
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits
    assert logits.dtype == torch.float32
    trainer.train()
    assert torch.isfinite(torch.tensor(history(trainer, "loss"))).all()


def test_cast_lm_head_refuses_a_head_adapter(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="LM head"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, cast_lm_head_to_fp32=True),
            train_dataset=prompts(),
            peft_config=peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]),
        )


@pytest.fixture(scope="module")
def tiny_moe_dir(tiny_model_dir, tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        router_aux_loss_coef=0.02,
    )
    path = tmp_path_factory.mktemp("moe") / "model"
    MixtralForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_moe_router_aux_loss(tiny_moe_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_moe_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=1),
        train_dataset=prompts(),
    )
    assert trainer.run.objective.aux_loss_coef == 0.02  # None: the model config's value
    before = parameters(trainer.model)
    trainer.train()
    assert history(trainer, "aux_loss")[0] > 0.0
    gate = [k for k in before if "gate" in k and "experts" not in k]
    assert gate and all(not torch.equal(before[k], parameters(trainer.model)[k]) for k in gate)
    off = GRPOTrainer(
        model=tiny_moe_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "b", max_steps=1, router_aux_loss_coef=0.0),
        train_dataset=prompts(),
    )
    assert off.run.objective.aux_loss_coef == 0.0


def test_router_aux_loss_on_a_dense_model_is_an_error(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, router_aux_loss_coef=0.1),
            train_dataset=prompts(),
        )


def test_dubious_combinations_are_logged(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grouprl"), pytest.raises(OSError):
        GRPOTrainer(
            model="/nonexistent/model",
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, loss_type="luspo"),
            train_dataset=prompts(),
        )
    assert "luspo' is meant for importance_sampling_level='sequence'" in caplog.text


@pytest.mark.parametrize("loss_type", ["bnpo", "cispo", "dapo", "dr_grpo"])
def test_sequence_level_with_token_summed_loss_warns_in_trl_words(tmp_path, caplog, loss_type):
    """TRL's test_warning_raised_sequence_level_with_token_summed_loss: captured through another package's logger,
    so the record has to propagate to the root handlers."""
    args = make_config(tmp_path, loss_type=loss_type, importance_sampling_level="sequence")
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"), pytest.raises(OSError):
        GRPOTrainer(model="/nonexistent/model", reward_funcs=distinct_tokens, args=args, train_dataset=prompts())
    assert "weights each sequence by its completion length" in caplog.text and f"loss_type='{loss_type}'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"), pytest.raises(OSError):
        GRPOTrainer(
            model="/nonexistent/model",
            reward_funcs=distinct_tokens,
            train_dataset=prompts(),
            args=make_config(tmp_path, loss_type="grpo", importance_sampling_level="sequence"),
        )
    assert "weights each sequence" not in caplog.text


# ---- invariances of the update -----------------------------------------------------------------


def one_step(model_dir, tmp_path, loss_type, optimizer="sgd", **overrides):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    options = dict(
        max_steps=1,
        num_generations=4,
        loss_type=loss_type,
        max_grad_norm=0,
        lr_scheduler_type="constant",
        **LOSS_OPTIONS[loss_type],
    )
    options.update(overrides)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = (
        torch.optim.SGD(model.parameters(), lr=1.0)
        if optimizer == "sgd"
        else GradientRecorder(model.named_parameters())
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, **options),
        train_dataset=prompts(),
        processing_class=tokenizer,
        optimizers=(opt, None),
        generation_backend=scripted(tokenizer),
    )
    trainer.train()
    return cpu_parameters(trainer.model), trainer, opt  # on the CPU, as the models the callers compare it with


INVARIANT = {  # bnpo's token mean is per micro-batch by definition, so it is not split-invariant
    **{name: {} for name in sorted(LOSSES) if name != "bnpo"},
    "grpo+sequence": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "dapo+beta": {"loss_type": "dapo", "beta": 0.2},
    "dapo+delta+off_policy_mask": {"loss_type": "dapo", "delta": 1.5, "off_policy_mask_threshold": 0.1},
}


@pytest.mark.parametrize("case", list(INVARIANT))
def test_one_micro_batch_equals_gradient_accumulation(tiny_model_dir, tmp_path, case):
    """The SGD (lr = 1) update from 8 completions as one micro-batch equals 2 accumulated micro-batches of 4."""
    options = dict(INVARIANT[case])
    loss_type = options.pop("loss_type", case)
    whole, _, _ = one_step(tiny_model_dir, tmp_path / "a", loss_type, per_device_train_batch_size=8, **options)
    split, trainer, _ = one_step(
        tiny_model_dir,
        tmp_path / "b",
        loss_type,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        **options,
    )
    assert trainer.plan.steps_per_generation == 2
    base = parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert max_difference(whole, base) > 1e-4  # the step did something
    assert max_difference(whole, split) < 1e-6


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_steps_per_generation_above_grad_accum_keeps_the_gradient_scale(tiny_model_dir, tmp_path, loss_type):
    """One generation of 8 completions in 2 micro-batches of 4: as 1 optimizer step (spg = GA = 2), or as 2 optimizer
    steps (spg = 2 > GA = 1). With lr = 0 every step sees the same weights, so the mean gradient of the 2 steps must
    equal the gradient of the 1 step. (TRL's old DAPO denominator, D = all generation tokens, halved it.)"""
    _, one, recorder_one = one_step(
        tiny_model_dir,
        tmp_path / "a",
        loss_type,
        "record",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    _, two, recorder_two = one_step(
        tiny_model_dir,
        tmp_path / "b",
        loss_type,
        "record",
        per_device_train_batch_size=4,
        steps_per_generation=2,
        max_steps=2,
    )
    assert one.plan.steps_per_generation == 2 and two.plan.gradient_accumulation_steps == 1
    assert two.plan.old_logprobs_needed and len(recorder_two.steps) == 2 and len(recorder_one.steps) == 1
    reference = recorder_one.steps[0]
    for name, grad in reference.items():
        mean = (recorder_two.steps[0][name] + recorder_two.steps[1][name]) / 2
        # atol 1e-6: the 2-step run's old logprobs come from a pass whose rows are packed differently
        # (prompt_packing), so its ratio is 1 only to float rounding (~1e-7 on gradients of ~1)
        assert torch.allclose(mean, grad, rtol=1e-4, atol=1e-6), name
    assert max(g.abs().max().item() for g in reference.values()) > 1e-4


# ---- dynamic sampling ---------------------------------------------------------------------------


def test_dynamic_sampling_trains_only_on_groups_with_signal(tiny_model_dir, tmp_path, monkeypatch):
    """Only prompts q0, q4, q8, ... get rewards that differ; all others tie. Each batch must hold only those."""
    import grouprl.train.stages

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = datasets.Dataset.from_dict({"prompt": [f"q{i}=" for i in range(24)], "index": list(range(24))})

    def reward(completion_ids, index, **kwargs):
        return [float(len(ids)) if i % 4 == 0 else 1.0 for ids, i in zip(completion_ids, index)]

    seen = []
    original = grouprl.train.stages.backward

    def spy(run, loss, micro):  # every micro-batch trained on
        seen.append(micro)
        return original(run, loss, micro)

    monkeypatch.setattr(grouprl.train.stages, "backward", spy)
    config = make_config(
        tmp_path,
        per_device_train_batch_size=8,
        num_generations=4,
        shuffle_dataset=False,
        dynamic_sampling=True,
        max_dynamic_sampling_rounds=8,
        max_steps=2,
    )
    backend = scripted(tokenizer)
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, args=config, train_dataset=data, generation_backend=backend
    )
    trainer.train()
    for micro in seen:
        texts = {tokenizer.decode(row[mask]) for row, mask in zip(micro.prompt_ids, micro.prompt_mask)}
        assert texts and all(int(text[1:-1]) % 4 == 0 for text in texts), texts
        assert len(micro) == 8 and (micro.advantages != 0).any()
    # generations of 2 prompts: (q0 q1) (q2 q3) (q4 q5) fill the first batch with q0, q4;
    # then (q6 q7) (q8 q9) (q10 q11) (q12 q13)
    assert history(trainer, "dynamic_sampling/completions_drawn") == [24.0, 32.0]
    assert history(trainer, "dynamic_sampling/kept_groups") == [2.0, 2.0]
    assert len(backend.calls) == 7


def test_dynamic_sampling_gives_up_after_the_bound(tiny_model_dir, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = make_config(
        tmp_path,
        per_device_train_batch_size=8,
        num_generations=4,
        dynamic_sampling=True,
        max_dynamic_sampling_rounds=2,
        max_steps=1,
    )
    backend = scripted(tokenizer)
    with caplog.at_level(logging.WARNING, logger="grouprl"):
        trainer = GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=lambda completions, **k: [1.0] * len(completions),
            args=config,
            train_dataset=prompts(),
            generation_backend=backend,
        )
        trainer.train()
    assert len(backend.calls) == 3  # the first generation and 2 extra rounds
    assert "every group of 3 generation(s) had tied rewards" in caplog.text
    assert history(trainer, "dynamic_sampling/kept_groups") == [0.0]


# ---- length-aware micro-batches -----------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_length_grouped_micro_batches_give_the_same_update(tiny_model_dir, tmp_path, monkeypatch, loss_type):
    """8 completions of varied lengths in 4 accumulated micro-batches of 2: rows sorted by length into the
    micro-batches (the default) must give the SGD update of the plain shuffled cut, with less padding."""
    import grouprl.rollout.experience

    padded = {}
    real_select = grouprl.core.types.TrainBatch.select

    def counting_select(self, rows):
        micro = real_select(self, rows)
        padded[key] = padded.get(key, 0) + micro.completion_ids.numel()
        return micro

    monkeypatch.setattr(grouprl.core.types.TrainBatch, "select", counting_select)
    key = "grouped"
    grouped, _, _ = one_step(
        tiny_model_dir, tmp_path / "a", loss_type, per_device_train_batch_size=2, gradient_accumulation_steps=4
    )
    key = "plain"
    monkeypatch.setattr(grouprl.rollout.experience, "regrouping_is_exact", lambda *a: False)
    plain, _, _ = one_step(
        tiny_model_dir, tmp_path / "b", loss_type, per_device_train_batch_size=2, gradient_accumulation_steps=4
    )
    assert padded["grouped"] < padded["plain"]  # the regrouping did regroup
    assert max_difference(grouped, parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir))) > 1e-4
    assert max_difference(grouped, plain) < 1e-6
