"""Asynchronous generation with the rest of grouprl: tools and environments (multi-turn rollouts sampled on the
worker), rollout_func (its trainer.generation_backend is the worker), GFPO, dynamic sampling, LoRA (merged weights
reach the worker), the reference-model sync.

The tiny random model never calls a tool by itself, so the tool tests script the first turn on the client side
(the worker samples everything after the tool results), as tests/test_agents.py does with the in-process engine.
"""

from time import sleep

import datasets
import pytest
from helpers import ScriptedBackend, distinct_tokens
from test_agents import Counter, answered, call_text, multiply, suffix, turn
from test_agents import tok as tok  # noqa: F401  (test_agents.py's module-scoped fixture)
from test_async import PROMPTS, async_config, step_entries

from grouprl import GFPOConfig, GFPOTrainer, GRPOTrainer
from grouprl.compat.gfpo import shortest_k_filter
from grouprl.demo.tokenizer import IM_END
from grouprl.generation.remote import RemoteGenerator
from grouprl.train import async_generation

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def conversations(n=8):
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i} times 7?"}] for i in range(n)]})


def script_first_turns(monkeypatch, tok, first_turn):  # noqa: F811
    """The worker client answers every conversation's first turn with `first_turn` (token ids); the worker
    samples the turns after tool results. Returns the list of real requests' prompts."""
    real, later = RemoteGenerator.generate, []

    def generate(self, prompt_ids, num_samples, params):
        if answered(tok, prompt_ids[0]):
            later.append(prompt_ids)
            return real(self, prompt_ids, num_samples, params)
        scripted = ScriptedBackend(lambda p, s: first_turn, tok.convert_tokens_to_ids(IM_END), tok)
        return scripted.generate(prompt_ids, num_samples, params)

    monkeypatch.setattr(RemoteGenerator, "generate", generate)
    return later


def agent_config(tmp_path, length, **overrides):
    """Room for the scripted first turn, the tool results and a few tokens of the worker's answer."""
    return async_config(
        tmp_path,
        max_completion_length=length + 6,
        max_steps=2,
        per_device_train_batch_size=6,
        num_generations=3,
        shuffle_dataset=False,
        **overrides,
    )


@pytest.mark.e2e
def test_tools_run_in_async_rollouts(tool_model_dir, tok, tmp_path, monkeypatch):  # noqa: F811
    first = turn(tok, call_text("multiply", a=6, b=7))
    later = script_first_turns(monkeypatch, tok, first)
    trainer = GRPOTrainer(
        model=tool_model_dir,
        reward_funcs=distinct_tokens,
        tools=[multiply],
        train_dataset=conversations(),
        args=agent_config(tmp_path, len(first + suffix(tok, 42))),
    )
    seen = []
    original = GRPOTrainer._generate_and_score_completions

    def keep(self, inputs):
        seen.append(inputs.sampled)
        return original(self, inputs)

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", keep)
    trainer.train()
    assert later, "the worker sampled no turn after the tool results"
    for rollout in seen:
        for completion in rollout.completions:
            head = first + suffix(tok, 42)
            assert completion.token_ids[: len(head)] == head  # the tool's result, as the template renders it
            assert completion.tool_mask[len(first) : len(head)] == [False] * (len(head) - len(first))
    entries = step_entries(trainer)
    assert len(entries) == 2 and all(e["tools/call_frequency"] == 1.0 for e in entries)


@pytest.mark.e2e
def test_environments_in_async_rollouts(tool_model_dir, tok, tmp_path, monkeypatch):  # noqa: F811
    first = turn(tok, call_text("increment", step=2))
    script_first_turns(monkeypatch, tok, first)
    trainer = GRPOTrainer(
        model=tool_model_dir,
        environment_factory=Counter,
        train_dataset=conversations(),
        args=agent_config(tmp_path, len(first + suffix(tok, 2))),
    )
    trainer.train()
    entries = step_entries(trainer)
    assert len(entries) == 2
    assert all(e["rewards/Counter/mean"] == 2.0 for e in entries), [
        {k: v for k, v in e.items() if "ewar" in k or "tool" in k} for e in entries
    ]  # each rollout incremented its counter


@pytest.mark.e2e
def test_rollout_func_samples_on_the_worker(tiny_model_dir, tmp_path, monkeypatch):
    backends = []
    # the trainer's thread pauses right after the rollouts are set up: a producer sampling already would call the
    # rollout_func with the in-process backend, which switches the trainer's model to eval mode under the loop
    real_start = async_generation.start_async_rollouts
    monkeypatch.setattr(async_generation, "start_async_rollouts", lambda *a, **k: (real_start(*a, **k), sleep(2))[0])

    def rollout_func(prompts, trainer):
        backend = trainer.generation_backend
        backends.append(backend)
        ids = trainer.processing_class(prompts[0])["input_ids"]
        completions = backend.generate([ids] * len(prompts), 1, trainer.run.rollouts.sampling)
        return {
            "prompt_ids": [ids] * len(prompts),
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": [c.sampler_logprobs for c in completions],
        }

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        rollout_func=rollout_func,
        train_dataset=PROMPTS,
        args=async_config(tmp_path, max_steps=2),
    )
    trainer.train()
    assert backends and all(isinstance(b, RemoteGenerator) and b.is_grouprl for b in backends)
    assert trainer.generation_backend is not backends[0]  # the worker's client only while training
    assert len(step_entries(trainer)) == 2


@pytest.mark.e2e
def test_gfpo_in_async_mode(tiny_model_dir, tmp_path):
    args = GFPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        num_remains_in_group=2,
        max_completion_length=8,
        learning_rate=0.02,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        async_generation=True,
        generation_threads=1,
    )
    trainer = GFPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=args,
        train_dataset=PROMPTS,
        group_filter_func=shortest_k_filter,
    )
    trainer.train()
    assert len(step_entries(trainer)) == 2


@pytest.mark.e2e
def test_dynamic_sampling_in_async_mode(tiny_model_dir, tmp_path):
    def ties_on_even_prompts(prompts, completion_ids, **kwargs):
        # groups of even-numbered prompts all get 1: tied, dropped, refilled from further generations
        return [1.0 if int(p.split("+")[0]) % 2 == 0 else float(len(set(c))) for p, c in zip(prompts, completion_ids)]

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=ties_on_even_prompts,
        train_dataset=PROMPTS,
        args=async_config(tmp_path, max_steps=3, dynamic_sampling=True, max_staleness=1),
    )
    trainer.train()
    entries = step_entries(trainer)
    assert len(entries) == 3 and all(e["async/staleness_max"] <= 1 for e in entries)
    assert any(e["dynamic_sampling/generation_rounds"] > 1 for e in entries)


@pytest.mark.e2e
@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
def test_lora_merged_weights_reach_the_worker(tiny_model_dir, tmp_path, quantized):
    """QLoRA too: the worker gets the 4-bit base dequantized with the adapters' update added."""
    from peft import LoraConfig

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        train_dataset=PROMPTS,
        peft_config=LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        args=async_config(tmp_path, max_staleness=0, learning_rate=0.2, max_steps=3),
        quantization_config={"load_in_4bit": True} if quantized else None,
    )
    trainer.train()
    entries = step_entries(trainer)
    assert len(entries) == 3
    # the worker samples with the merged adapters of each step: the trainer sees no mismatch at all; a QLoRA policy's
    # adapters compute in bf16 where bf16 is native (as TRL's), which the fp32 update sent leaves ~5e-3 apart (an
    # update left out: ~0.5)
    tolerance = 0.05 if quantized else 1e-4
    assert all(e["sampling/sampling_logp_difference/max"] < tolerance for e in entries)
    assert entries[-1]["loss"] != 0.0


@pytest.mark.e2e
def test_image_prompts_sample_on_the_worker_with_their_processor_outputs(tmp_path):
    """A vision-language model (Idefics3; prompts of one image and of two): the worker, started from the policy, loads
    it as one, is sent each prompt's processor outputs and samples with them from the weights the trainer sent; its
    logprobs are the trainer's but for the image placeholders it never samples (their mass under the policy, a few
    thousandths of a nat here: test_server.py)."""
    from vlm_models import image, save_tiny_idefics3

    path = save_tiny_idefics3(tmp_path / "idefics3")
    pictures = [[image(i, 32, 32)] if i % 2 else [image(i, 32, 32), image(i + 1, 32, 32)] for i in range(8)]
    prompts = [[{"role": "user", "content": f"What is in picture {i}?"}] for i in range(8)]
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=lambda completions, **kwargs: [len(set(c[0]["content"])) for c in completions],
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts, "images": pictures}),
        args=async_config(tmp_path, max_staleness=0, max_steps=3, per_device_train_batch_size=4, num_generations=2),
    )
    trainer.train()
    entries = step_entries(trainer)
    assert len(entries) == 3
    assert all(e["sampling/sampling_logp_difference/max"] < 1e-2 for e in entries), entries


@pytest.mark.e2e
def test_sync_ref_model_in_async_mode(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        train_dataset=PROMPTS,
        args=async_config(tmp_path, max_steps=2, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1),
    )
    trainer.train()
    entries = step_entries(trainer)
    assert len(entries) == 2 and all("kl" in e for e in entries)
