"""Which sampler runs: beam-search generation_kwargs go through transformers generate with repeated prompts,
and a model.generate the user replaced (patched, set on the instance, overridden in a subclass) is called, as in TRL."""

from unittest.mock import patch

import datasets
import pytest
import torch
from helpers import parameters, quiet_config
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.utils import GenerationMixin

from grouprl import GRPOTrainer
from grouprl.core.types import SamplingParams
from grouprl.generation.engine import EngineUnlessGenerateOverridden, FastGenerator, generate_override
from grouprl.generation.hf import TransformersGenerator
from grouprl.generation.static_decode import CapturedGenerator


def text_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def config(tmp_path, **overrides):
    return quiet_config(
        tmp_path,
        overrides,
        per_device_train_batch_size=3,
        max_completion_length=8,
        learning_rate=0.1,
        max_steps=1,
        bf16=False,
    )


def prompts(n=6):
    return datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(n)]})


def test_beam_search_generation_kwargs_train_through_generate(tiny_model_dir, tmp_path):
    """TRL's test_train_with_generation_kwargs: num_beams=2 < num_generations=3 used to fail in generate
    ("num_return_sequences (3) has to be smaller or equal to num_beams (2)")."""
    args = config(tmp_path, generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=text_length, args=args, train_dataset=prompts())
    assert isinstance(trainer.generation_backend, TransformersGenerator)  # the engine cannot beam-search
    trainer.train()
    assert trainer.state.log_history[0]["completions/mean_length"] > 0


def test_transformers_generator_repeats_prompts_instead_of_num_return_sequences(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generator = TransformersGenerator(model, tokenizer, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    seen = []
    original = model.generate

    def spy(**kwargs):
        seen.append(kwargs)
        return original(**kwargs)

    model.generate = spy
    prompt_ids = [tokenizer("1+1=")["input_ids"], tokenizer("12+7=")["input_ids"]]
    completions = generator.generate(prompt_ids, 3, SamplingParams(max_new_tokens=4, extra={"num_beams": 2}))
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1]
    (call,) = seen
    assert "num_return_sequences" not in call and call["num_beams"] == 2
    rows = call["input_ids"].tolist()
    assert rows[0] == rows[1] == rows[2] and rows[3] == rows[4] == rows[5] and rows[0] != rows[3]
    with pytest.raises(ValueError, match="num_return_sequences=2.*num_generations"):
        generator.generate(prompt_ids, 3, SamplingParams(max_new_tokens=4, extra={"num_return_sequences": 2}))


def scripted_generate(eos, pad, calls):
    """TRL's test_training_with_mask_truncated_completions stand-in: one truncated completion, one that ends
    early (padded after EOS) and one whose EOS is the last allowed token."""

    def fake_generate(input_ids, **kwargs):
        calls.append(input_ids.shape[0])
        completions = torch.tensor(
            [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, eos, pad, pad, pad, pad], [16, 17, 18, 19, 20, 21, 22, eos]]
        )
        return torch.cat([input_ids, completions.repeat(input_ids.shape[0] // 3, 1).to(input_ids.device)], dim=1)

    return fake_generate


def test_patched_generation_mixin_generate_is_called(tiny_model_dir, tmp_path):
    """TRL's test_training_with_mask_truncated_completions patches GenerationMixin.generate. The fast engine never
    called it, so the random tiny model's own samples (none ends within 8
    tokens) were all masked and nothing trained."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = []
    with patch("transformers.generation.utils.GenerationMixin.generate") as mock_generate:
        mock_generate.side_effect = scripted_generate(tokenizer.eos_token_id, tokenizer.pad_token_id, calls)
        trainer = GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=text_length,
            train_dataset=prompts(),
            args=config(tmp_path, mask_truncated_completions=True),
        )
        before = parameters(trainer.model)
        trainer.train()
    assert calls == [3]  # one generation: 1 prompt repeated 3 times, as TRL calls generate
    entry = trainer.state.log_history[0]
    assert entry["completions/clipped_ratio"] == pytest.approx(1 / 3)
    assert entry["completions/mean_length"] == pytest.approx((8 + 4 + 8) / 3)
    after = parameters(trainer.model)
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])


def test_generate_patched_on_the_instance_after_construction_is_called(tiny_model_dir, tmp_path):
    """TRL's tool tests patch trainer.model.generate after the trainer is built."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=text_length, train_dataset=prompts(), args=config(tmp_path)
    )
    calls = []
    with patch.object(
        trainer.model, "generate", side_effect=scripted_generate(tokenizer.eos_token_id, tokenizer.pad_token_id, calls)
    ):
        trainer.train()
    assert calls == [3]
    assert trainer.state.log_history[0]["completions/clipped_ratio"] == pytest.approx(1 / 3)
    assert generate_override(trainer.model) is None  # the patch is gone: the engine samples again


def test_engine_asked_for_explicitly_refuses_a_replaced_generate(tiny_model_dir, tmp_path):
    with patch.object(GenerationMixin, "generate", lambda self, **kwargs: None):
        with pytest.raises(ValueError, match="generation_engine='engine'.*GenerationMixin.generate is patched.*'auto'"):
            GRPOTrainer(
                model=tiny_model_dir,
                reward_funcs=text_length,
                train_dataset=prompts(),
                args=config(tmp_path, generation_engine="engine"),
            )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=text_length,
        train_dataset=prompts(),
        args=config(tmp_path, generation_engine="engine"),
    )
    assert isinstance(trainer.generation_backend, EngineUnlessGenerateOverridden)
    trainer.model.generate = lambda **kwargs: None  # replaced after construction: refused at the first generation
    with pytest.raises(ValueError, match="generate is set on the Qwen2ForCausalLM instance"):
        trainer.train()


def test_generate_override_names_what_replaced_generate(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert generate_override(model) is None

    class Constrained(type(model)):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    assert generate_override(Constrained(model.config)) == f"{Constrained.__qualname__} overrides generate"
    with patch.object(GenerationMixin, "generate", lambda self, **kwargs: None):
        assert generate_override(model) == "transformers' GenerationMixin.generate is patched"
    assert generate_override(model) is None
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert generate_override(wrapped) is None  # PeftModel.generate calls the base model's own
    wrapped.get_base_model().generate = lambda **kwargs: None
    assert generate_override(wrapped) == "generate is set on the Qwen2ForCausalLM instance"


@pytest.mark.parametrize(
    "device, engine, expected",
    [
        ("cpu", "auto", FastGenerator),  # measured fastest on CPUs
        ("cuda", "auto", CapturedGenerator),  # measured fastest on an H200 (docs/benchmarks-gpu.md)
        ("mps", "auto", TransformersGenerator),  # measured nowhere else: transformers generate
        ("cuda", "engine", FastGenerator),  # an explicit choice is honoured on any device
        ("cpu", "captured", CapturedGenerator),
        ("cuda", "transformers", TransformersGenerator),
    ],
)
def test_auto_picks_the_engine_measured_fastest_on_the_device(
    tiny_model_dir, tmp_path, monkeypatch, device, engine, expected
):
    from grouprl.generation import factory

    monkeypatch.setattr(factory, "model_device", lambda model: torch.device(device))  # faked: weights stay on the CPU
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=text_length,
        args=config(tmp_path, generation_engine=engine),
        train_dataset=prompts(),
    )
    backend = trainer.generation_backend
    if expected is TransformersGenerator:
        assert type(backend) is TransformersGenerator
    else:  # an in-process engine; under 'auto' it falls back to model.generate once that is replaced
        assert type(backend) is EngineUnlessGenerateOverridden and type(backend.engine) is expected
        assert (backend.fallback is not None) == (engine == "auto")


def test_compile_decode_step_needs_the_captured_loop(tiny_model_dir, tmp_path, monkeypatch):
    """compile_decode_step compiles the captured loop's step: asked with another engine it is refused, by the config
    when the engine is named and by the backend when 'auto' resolves to another; unset, nothing is refused; with the
    captured loop (here 'auto' on a faked CUDA device) the loop gets the setting as it is."""
    from grouprl import GRPOConfig
    from grouprl.generation import factory

    with pytest.raises(ValueError, match="compile_decode_step=True.*generation_engine='transformers'"):
        GRPOConfig(output_dir=str(tmp_path), generation_engine="transformers", compile_decode_step=True)
    with pytest.raises(ValueError, match="compile_decode_step=True.*use_vllm=True"):
        GRPOConfig(output_dir=str(tmp_path), use_vllm=True, compile_decode_step=True)

    def build(**fields):
        return GRPOTrainer(
            model=tiny_model_dir, reward_funcs=text_length, args=config(tmp_path, **fields), train_dataset=prompts()
        )

    with pytest.raises(ValueError, match="compile_decode_step=True.*samples with 'engine' on cpu"):
        build(compile_decode_step=True)
    assert GRPOConfig(output_dir=str(tmp_path)).compile_decode_step is None
    build()  # unset: the CPU's engine, nothing refused
    monkeypatch.setattr(factory, "model_device", lambda model: torch.device("cuda"))  # weights stay on the CPU
    for asked in (True, None, False):  # None: the loop compiles on CUDA, and runs as written should that fail
        backend = build(compile_decode_step=asked).generation_backend
        assert type(backend.engine) is CapturedGenerator and backend.engine.compile_step is asked
