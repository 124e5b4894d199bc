"""use_transformers_continuous_batching (TRL's field): transformers' generate_batch as the sampler, on whatever device
is here: its draws against the model's processed distribution, EOS and lengths, LoRA, what it refuses, a failed
request, the cache it sizes, and a training run that learns with it."""

import warnings

import pytest
import torch
from chi_square import chi_square_rejects
from helpers import numbered_prompts, quiet_config, sample_through_the_backend
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.core.types import SamplingParams
from grouprl.generation.continuous_batching import ContinuousBatchingGenerator

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 1500 one-token rows in pages of 256 tokens would make transformers' sdpa mask hold 1500 x 256 x 8192 entries
SHORT_PAGES = {"page_size": 16}


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(DEVICE), AutoTokenizer.from_pretrained(
        tiny_model_dir
    )


def first_token_counts(generator, model, prompt, params, rows):
    completions = generator.generate([prompt], rows, params)
    assert len(completions) == rows and all(c.prompt_index == 0 for c in completions)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in completions]), minlength=model.config.vocab_size)
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device=DEVICE)).logits[0, -1].double().cpu()
    return counts.double(), logits


def processed(logits, temperature, top_k):
    scaled = logits / temperature
    kept = scaled.topk(top_k).indices
    masked = torch.full_like(scaled, float("-inf"))
    masked[kept] = scaled[kept]
    return masked.softmax(-1)


def test_draws_follow_the_processed_distribution(model_and_tokenizer):
    """3000 first tokens of one prompt at temperature 0.1 and top-k 30 against softmax of the model's logits so
    processed (chi-square, p < 1e-3 rejects; seeded): accepted, while a 10% wrong temperature or no top-k is noticed
    (the random model's logits are nearly flat: a low temperature gives the test its power)."""
    model, tokenizer = model_and_tokenizer
    generator = ContinuousBatchingGenerator(model, tokenizer, [], tokenizer.pad_token_id, settings=SHORT_PAGES)
    torch.manual_seed(0)
    prompt = tokenizer("12+7=")["input_ids"]
    params = SamplingParams(max_new_tokens=1, temperature=0.1, top_k=30)
    counts, logits = first_token_counts(generator, model, prompt, params, 3000)
    assert not chi_square_rejects(counts, processed(logits, 0.1, 30))
    assert chi_square_rejects(counts, processed(logits, 0.11, 30))
    assert chi_square_rejects(counts, (logits / 0.1).softmax(-1))


def test_rows_stop_at_their_eos_and_keep_nothing_after_it(model_and_tokenizer):
    """A quarter of the vocabulary as EOS: rows finish at many steps, each ends at its first EOS ('stop') or runs to
    max_new_tokens ('length'); each completion goes back to its prompt (prompts of different lengths)."""
    model, tokenizer = model_and_tokenizer
    eos = list(range(0, 70))
    generator = ContinuousBatchingGenerator(model, tokenizer, eos, tokenizer.pad_token_id)
    prompts = [tokenizer(text)["input_ids"] for text in ("12+7=", "what is 123 + 456 =")]
    torch.manual_seed(1)
    completions = generator.generate(prompts, 24, SamplingParams(max_new_tokens=10))
    assert [c.prompt_index for c in completions] == [0] * 24 + [1] * 24
    assert len({len(c.token_ids) for c in completions}) > 3
    for c in completions:
        ended = [i for i, t in enumerate(c.token_ids) if t in eos]
        assert ended in ([], [len(c.token_ids) - 1]) and (c.finish_reason == "stop") == bool(ended)
        assert ended or len(c.token_ids) == 10


def test_a_lora_policy_samples_with_its_adapter(model_and_tokenizer):
    """A peft LoRA policy (adapter initialised away from zero): 3000 draws at temperature 0.1 follow the adapted
    model's distribution, not the base model's."""
    peft = pytest.importorskip("peft")
    model, tokenizer = model_and_tokenizer
    policy = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(model.config._name_or_path).to(DEVICE),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False),
    )
    generator = ContinuousBatchingGenerator(policy, tokenizer, [], tokenizer.pad_token_id, settings=SHORT_PAGES)
    torch.manual_seed(2)
    prompt = tokenizer("3+4=")["input_ids"]
    params = SamplingParams(max_new_tokens=1, temperature=0.1)
    counts, logits = first_token_counts(generator, policy, prompt, params, 3000)
    assert not chi_square_rejects(counts, (logits / 0.1).softmax(-1))
    with policy.disable_adapter(), torch.no_grad():
        base = policy(torch.tensor([prompt], device=DEVICE)).logits[0, -1].double().cpu()
    assert chi_square_rejects(counts, (base / 0.1).softmax(-1))


def test_the_cache_is_sized_for_the_rows_unless_the_config_sizes_it(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = [[1] * 200, [1] * 10, [1] * 10]
    sized = ContinuousBatchingGenerator(model, tokenizer, [], 0).batching_config(rows, 100)
    assert sized.num_blocks == 2 + 1 + 1  # pages of 256 tokens: 300, 110 and 110 tokens
    own = ContinuousBatchingGenerator(model, tokenizer, [], 0, settings={"max_memory_percent": 0.2, "page_size": 64})
    assert own.batching_config(rows, 100).num_blocks is None and own.batching_config(rows, 100).page_size == 64
    with pytest.raises(ValueError, match="transformers_continuous_batching_config=.*not_a_field"):
        ContinuousBatchingGenerator(model, tokenizer, [], 0, settings={"not_a_field": 1})


def test_a_request_that_fails_stops_the_run_with_its_error(model_and_tokenizer, monkeypatch):
    """generate_batch logs a failed request and returns without it; the backend raises instead of training on less."""
    model, tokenizer = model_and_tokenizer
    generator = ContinuousBatchingGenerator(model, tokenizer, [], tokenizer.pad_token_id)
    real = model.generate_batch

    def losing_one(inputs, **kwargs):
        results = real(inputs, **kwargs)
        results.pop(next(iter(results)))
        return results

    monkeypatch.setattr(model, "generate_batch", losing_one)
    with pytest.raises(RuntimeError, match="sampled 2 of 3 rows"):
        generator.generate([tokenizer("1+1=")["input_ids"]], 3, SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"generation_kwargs": {"num_beams": 2}}, "num_beams"),
        ({"generation_kwargs": {"min_new_tokens": 2}}, "min_new_tokens"),
        ({"generation_engine": "engine"}, "generation_engine='engine'"),
    ],
)
def test_settings_it_would_not_apply_are_refused_when_the_trainer_is_built(tiny_model_dir, tmp_path, overrides, named):
    args = quiet_config(
        tmp_path, {"use_transformers_continuous_batching": True, **overrides}, per_device_train_batch_size=3
    )
    with pytest.raises(ValueError, match="use_transformers_continuous_batching=True") as raised:
        GRPOTrainer(tiny_model_dir, reward_funcs=low_tokens, args=args, train_dataset=numbered_prompts(6))
    assert named in str(raised.value)


def test_generation_kwargs_at_values_that_change_nothing_are_accepted(tiny_model_dir, tmp_path):
    neutral = {"repetition_penalty": 1.0, "num_beams": 1, "min_new_tokens": 0, "no_repeat_ngram_size": 0}
    args = quiet_config(
        tmp_path,
        {"use_transformers_continuous_batching": True, "generation_kwargs": neutral},
        per_device_train_batch_size=3,
        max_steps=1,
        max_completion_length=4,
    )
    trainer = GRPOTrainer(tiny_model_dir, reward_funcs=low_tokens, args=args, train_dataset=numbered_prompts(6))
    assert isinstance(trainer.generation_backend, ContinuousBatchingGenerator)
    trainer.train()  # generate_batch takes them
    assert trainer.state.global_step == 1


def test_trls_deprecated_name_turns_it_on_with_a_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = GRPOConfig(output_dir=str(tmp_path), use_transformers_paged=True, per_device_train_batch_size=8)
    assert config.use_transformers_continuous_batching
    assert any(w.category is FutureWarning and "use_transformers_paged" in str(w.message) for w in caught)


def low_tokens(completion_ids, **kwargs):
    """The share of a completion's tokens below id 100: what the run below learns to raise."""
    return [sum(token < 100 for token in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.mark.e2e
def test_a_run_with_continuous_batching_learns(tiny_model_dir, tmp_path):
    """8 GRPO steps sampled through generate_batch raise the mean reward (seeded: 0.35 -> 0.57 here)."""
    args = quiet_config(
        tmp_path,
        {"use_transformers_continuous_batching": True},
        max_steps=8,
        per_device_train_batch_size=12,
        num_generations=4,
        max_completion_length=8,
        learning_rate=0.05,
        bf16=False,
    )
    trainer = GRPOTrainer(tiny_model_dir, reward_funcs=low_tokens, args=args, train_dataset=numbered_prompts(24))
    assert isinstance(trainer.generation_backend, ContinuousBatchingGenerator)
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert len(rewards) == 8 and sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.1, rewards


@pytest.mark.e2e
def test_continuous_batching_samples_fp32_weights_under_bf16_mixed_precision(tiny_model_dir, tmp_path):
    """TRL's defaults, fp32 weights and bf16=True: transformers sizes the paged cache in the weights' dtype while
    accelerate's wrapper computes in bf16 autocast, so the sampler runs the forward without the wrapper (a first cache
    write failed otherwise), and the training forward keeps it."""
    args = quiet_config(
        tmp_path,
        {"use_transformers_continuous_batching": True},
        max_steps=2,
        per_device_train_batch_size=6,
        max_completion_length=6,
        bf16=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # where bf16 is emulated, the explicit bf16=True warns that it is slow
        trainer = GRPOTrainer(tiny_model_dir, reward_funcs=low_tokens, args=args, train_dataset=numbered_prompts(12))
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert next(model.parameters()).dtype == torch.float32 and hasattr(model, "_original_forward")
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.run.rollouts.generations_made == 2
    assert model.forward != model._original_forward  # the training forward is bf16 autocast's again
    with torch.no_grad():
        hidden = model.model(torch.tensor([[5, 6, 7]], device=model.device)).last_hidden_state
        assert hidden.dtype == torch.float32  # the plain forward (fp32) ...
        wrapped = model(torch.tensor([[5, 6, 7]], device=model.device)).logits
    assert not torch.equal(wrapped, model.lm_head(hidden))  # ... differs from the wrapper's rounded one


@pytest.mark.e2e
@pytest.mark.parametrize("feature", ["gfpo", "dynamic_sampling", "sync_ref_model", "qlora", "rollout_func"])
def test_continuous_batching_samples_for_the_other_features(tiny_model_dir, tmp_path, feature):
    """Two steps sampled through generate_batch with GFPO (each group filtered), dynamic sampling (tied prompts drawn
    again), a synced reference (moved by the policy), QLoRA (the 4-bit policy with its adapters sampling) or a
    rollout_func (sampling through trainer.generation_backend)."""
    from grouprl import GFPOConfig, GFPOTrainer
    from grouprl.compat.gfpo import shortest_k_filter

    def varied(prompts, completion_ids, **kwargs):  # differs within a group, unless dynamic sampling ties odd prompts
        ties = feature == "dynamic_sampling"
        return [
            1.0 if ties and int(p.split("+")[0]) % 2 else float(sum(ids) % 7) for p, ids in zip(prompts, completion_ids)
        ]

    options = {
        "dynamic_sampling": {"dynamic_sampling": True, "shuffle_dataset": False},
        "sync_ref_model": {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1},
        "qlora": {"model_init_kwargs": {"quantization_config": {"load_in_4bit": True}}},
    }.get(feature, {})
    args = quiet_config(
        tmp_path,
        {"use_transformers_continuous_batching": True, **options},
        max_steps=2,
        per_device_train_batch_size=6,
        max_completion_length=6,
        learning_rate=0.05,
        bf16=False,
    )
    kwargs = {"reward_funcs": varied, "train_dataset": numbered_prompts(12)}
    seen = []
    if feature == "gfpo":

        def shortest(group_completions, group_rewards, **more):
            seen.append([len(group) for group in group_completions])
            return shortest_k_filter(group_completions, group_rewards, **more)

        args = GFPOConfig(**{**args.to_dict(), "num_remains_in_group": 2})
        trainer = GFPOTrainer(tiny_model_dir, args=args, group_filter_func=shortest, **kwargs)
    else:
        if feature == "rollout_func":

            def rollout_func(prompts, trainer):
                seen.append(trainer.generation_backend)
                return sample_through_the_backend(prompts, trainer)

            kwargs["rollout_func"] = rollout_func
        if feature == "qlora":
            peft = pytest.importorskip("peft")
            pytest.importorskip("bitsandbytes")
            kwargs["peft_config"] = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        trainer = GRPOTrainer(tiny_model_dir, args=args, **kwargs)
    assert isinstance(trainer.generation_backend, ContinuousBatchingGenerator)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    reference = [p.detach().clone() for p in trainer.ref_model.parameters()] if trainer.ref_model else None
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(entry["completions/mean_length"] > 0 for entry in logged)
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(("lora_" in name) == (feature == "qlora") for name in changed)
    if feature == "gfpo":
        assert seen == [[3, 3]] * 2  # each step's 2 groups of 3, filtered to 2 each
    if feature == "dynamic_sampling":  # a round of 2 prompts keeps 1 group at most (odd prompts tie): 2 rounds or more
        assert all(entry["dynamic_sampling/completions_drawn"] in (12.0, 18.0, 24.0, 30.0) for entry in logged)
    if feature == "sync_ref_model":
        assert max((p - r).abs().max().item() for p, r in zip(trainer.ref_model.parameters(), reference)) > 0
    if feature == "rollout_func":
        assert len(seen) == 2 and all(isinstance(backend, ContinuousBatchingGenerator) for backend in seen)
