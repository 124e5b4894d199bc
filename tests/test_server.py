"""`grouprl serve` in a subprocess, and training through it
(generation_engine='server' / TRL's use_vllm server mode)."""

import time

import datasets
import pytest
import torch
from conftest import free_port
from helpers import odd_prompts_tie, sample_through_the_backend
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.core.types import SamplingParams
from grouprl.generation.remote import RemoteGenerator, ServerError
from grouprl.model.logprobs import completion_logprobs


@pytest.fixture
def server(grouprl_server):
    if grouprl_server[1].poll() is not None:
        pytest.skip("the shared grouprl server was killed by an earlier test")
    return grouprl_server


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def config(tmp_path, url, **overrides):
    values = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "learning_rate": 0.05,
        "max_steps": 3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
        "bf16": False,
        "generation_engine": "server",
        "vllm_server_base_url": url,
        "vllm_server_timeout": 30,
    }
    values.update(overrides)
    return GRPOConfig(**values)


PROMPTS = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(16)]})
FIXED = ([5, 17, 42, 9], [33, 7, 61, 2, 90])  # (prompt, completion) scored by both sides after each sync


def trainer_logprobs(model, fixed=FIXED):
    prompt, completion = torch.tensor([fixed[0]]), torch.tensor([fixed[1]])
    with torch.no_grad():
        out = completion_logprobs(
            model,
            prompt,
            torch.ones_like(prompt, dtype=torch.bool),
            completion,
            torch.ones_like(completion, dtype=torch.bool),
            temperature=1.0,
            with_entropy=False,
        )
    return out.logprobs[0].tolist()


@pytest.mark.parametrize(
    "weight_transfer, lora", [("http", False), ("broadcast", False), ("http", "lora"), ("http", "qlora")]
)
def test_training_through_the_server_keeps_its_weights_in_sync(server, tiny_model_dir, tmp_path, weight_transfer, lora):
    """With LoRA the server gets the base weights with the adapters merged in, and the trainer scores with the
    adapters applied unmerged: the two agree. With QLoRA (a 4-bit base) the server gets the base dequantized with the
    adapters' update added; the adapters' bf16 products, where bf16 is native (as TRL casts them), keep the two
    ~5e-3 apart, where an update left out leaves them ~0.5 apart."""
    url, _ = server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    peft = pytest.importorskip("peft") if lora else None
    if lora == "qlora":
        pytest.importorskip("bitsandbytes")
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config(tmp_path, url, generation_server_weight_transfer=weight_transfer),
        train_dataset=PROMPTS,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None,
        quantization_config={"load_in_4bit": True} if lora == "qlora" else None,
    )
    backend = trainer.generation_backend
    assert isinstance(backend, RemoteGenerator) and backend.is_grouprl
    pairs = []
    send = backend.sync_weights

    def sync_and_compare(model):
        send(model)
        pairs.append((backend.score(FIXED[0] + FIXED[1])[-len(FIXED[1]) :], trainer_logprobs(model)))

    backend.sync_weights = sync_and_compare
    trainer.train()
    assert len(pairs) == 3  # before each of the 3 generations, once per optimizer step
    tolerance = 0.05 if lora == "qlora" else 1e-5
    for served, trained in pairs:
        assert served == pytest.approx(trained, abs=tolerance)
    assert max(abs(a - b) for a, b in zip(pairs[0][1], pairs[-1][1])) > 1e-3  # the weights did move
    logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
    assert len(logged) == 3
    # the server sampled from the weights the trainer scores with: importance ratios of 1
    assert all(e["sampling/sampling_logp_difference/max"] < (0.05 if lora == "qlora" else 1e-4) for e in logged)
    assert all(e["sampling/importance_sampling_ratio/min"] > (0.95 if lora == "qlora" else 0.999) for e in logged)


@pytest.mark.parametrize("kind", ["tools", "environment_factory"])
def test_tool_calls_continue_on_the_server_from_the_trainers_weights(server, tool_model_dir, tmp_path, kind):
    """Tools (or an environment's) with a generation server: after a (scripted) first turn calls the tool, the server
    samples the rest of the conversation, prompted with it token for token, from the weights the trainer has at that
    step."""
    from test_agents import ScriptedFirstTurn, calling_agent
    from test_agents import dataset as conversations

    url, _ = server
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    agent, first, glue = calling_agent(tok, kind)
    trainer = GRPOTrainer(
        model=tool_model_dir,
        reward_funcs=distinct_tokens,
        args=config(
            tmp_path,
            url,
            max_steps=2,
            per_device_train_batch_size=6,
            num_generations=3,
            max_completion_length=len(first) + len(glue) + 6,
        ),
        train_dataset=conversations(),
        processing_class=tok,
        **agent,
    )
    served = trainer.run.rollouts.backend
    assert isinstance(served, RemoteGenerator)
    continued, weights = [], []  # weights: the trainer's logprobs of FIXED at each continuation

    def compare(prompt_ids, completions):  # as the server returns them: the trainer has the weights it sampled with
        for c in completions:
            context = prompt_ids[c.prompt_index]
            continued.append((context, c.sampler_logprobs, trainer_logprobs(trainer.model, (context, c.token_ids))))
        weights.append(trainer_logprobs(trainer.model))

    trainer.run.rollouts.backend = ScriptedFirstTurn(tok, first, served, compare)
    trainer.train()
    assert len(continued) == 2 * 6  # every rollout of both steps was continued on the server
    for context, served_logprobs, trained_logprobs in continued:
        assert tok.decode(context).endswith(tok.decode(first + glue))
        assert served_logprobs == pytest.approx(trained_logprobs, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(weights[0], weights[-1])) > 1e-3  # checked before and after an update


def test_rollout_func_samples_from_the_server_after_its_weight_sync(server, tiny_model_dir, tmp_path):
    """TRL syncs the weights before calling rollout_func: the server it samples from has the trainer's weights at
    every step (sampler and trainer logprobs agree while the weights move)."""
    url, _ = server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backends = []

    def rollout_func(prompts, trainer):
        backends.append(trainer.generation_backend)
        return sample_through_the_backend(prompts, trainer)

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        rollout_func=rollout_func,
        args=config(tmp_path, url),
        train_dataset=PROMPTS,
        processing_class=tokenizer,
    )
    trainer.train()
    assert len(backends) == 3 and all(isinstance(b, RemoteGenerator) for b in backends)
    logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
    assert len(logged) == 3 and all(e["sampling/sampling_logp_difference/max"] < 1e-4 for e in logged)
    assert logged[0]["loss"] != logged[-1]["loss"]


@pytest.mark.parametrize("feature", ["gfpo", "dynamic_sampling", "sync_ref_model"])
def test_server_samples_from_the_trainers_weights_with_gfpo_dynamic_sampling_or_a_synced_reference(
    server, tiny_model_dir, tmp_path, feature
):
    """Each step's completions come from the weights the trainer has (GFPO filters them, dynamic sampling draws
    several rounds of them, a synced reference moves beside them): sampler and trainer logprobs agree every step."""
    from grouprl import GFPOConfig, GFPOTrainer
    from grouprl.compat.gfpo import shortest_k_filter

    url, _ = server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    args = config(tmp_path, url, shuffle_dataset=False)
    kwargs = {"reward_funcs": distinct_tokens, "train_dataset": PROMPTS, "processing_class": tokenizer}
    if feature == "gfpo":
        args = GFPOConfig(**{**args.to_dict(), "num_remains_in_group": 2})
        filtered = []

        def shortest(group_completions, group_rewards, **more):
            filtered.append([len(group) for group in group_completions])
            return shortest_k_filter(group_completions, group_rewards, **more)

        trainer = GFPOTrainer(tiny_model_dir, args=args, group_filter_func=shortest, **kwargs)
    else:
        options = {
            "dynamic_sampling": {"dynamic_sampling": True},
            "sync_ref_model": {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1},
        }[feature]
        kwargs["reward_funcs"] = odd_prompts_tie if feature == "dynamic_sampling" else distinct_tokens
        trainer = GRPOTrainer(tiny_model_dir, args=config(tmp_path, url, shuffle_dataset=False, **options), **kwargs)
    reference = [p.detach().clone() for p in trainer.ref_model.parameters()] if trainer.ref_model else None
    trainer.train()
    logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
    assert len(logged) == 3 and all(e["sampling/sampling_logp_difference/max"] < 1e-4 for e in logged)
    if feature == "gfpo":
        assert filtered == [[4, 4]] * 3  # each step's 2 groups of 4 server completions, filtered to 2 each
    if feature == "dynamic_sampling":  # a round of 2 prompts keeps 1 at most (odd prompts tie): 2 rounds or more
        assert all(e["dynamic_sampling/completions_drawn"] in (16.0, 24.0, 32.0, 40.0, 48.0) for e in logged)
    if feature == "sync_ref_model":
        moved = max((p - r).abs().max().item() for p, r in zip(trainer.ref_model.parameters(), reference))
        assert moved > 0 and all(e["kl"] > 0 for e in logged[1:])


def test_trl_server_mode_fields_reach_a_grouprl_server(server, tiny_model_dir, tmp_path):
    url, _ = server
    port = int(url.rsplit(":", 1)[1])
    args = config(
        tmp_path,
        None,
        generation_engine="auto",
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=port,
        max_steps=1,
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=args, train_dataset=PROMPTS)
    assert isinstance(trainer.generation_backend, RemoteGenerator) and trainer.generation_backend.base_url == url
    trainer.train()
    assert trainer.state.global_step == 1


def test_completions_api(server):
    url, _ = server
    client = RemoteGenerator(url)
    completions = client.generate([[5, 6, 7], [8, 9]], 3, SamplingParams(max_new_tokens=4, temperature=0.7, top_k=20))
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1]
    for c in completions:
        assert 1 <= len(c.token_ids) <= 4 and len(c.sampler_logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.sampler_logprobs)
    with pytest.raises(ServerError, match="answered 400.*unsupported request fields \\['best_of'\\]"):
        client.generate([[5]], 1, SamplingParams(max_new_tokens=2, extra={"best_of": 2}))

    from grouprl.model.multimodal import PromptImages, images_from_bytes, images_to_bytes

    images = [PromptImages(per_image={"pixel_values": torch.zeros(1, 3)})]
    with pytest.raises(ServerError, match="answered 400.*multimodal: .* is not a vision-language model"):
        client.generate([[5]], 1, SamplingParams(max_new_tokens=2), multimodal=images)
    with pytest.raises(ValueError, match="per_token/... or per_image/"):
        from safetensors.torch import save

        images_from_bytes(save({"weights": torch.zeros(1)}))
    with pytest.raises(ValueError):
        images_from_bytes(b"not safetensors")
    assert images_from_bytes(images_to_bytes(images[0])).per_image["pixel_values"].shape == (1, 3)
    elsewhere = RemoteGenerator(url, connect=False)  # a server that did not say it is grouprl's (vLLM's)
    with pytest.raises(NotImplementedError, match="not a grouprl server.*vllm_mode='colocate'"):
        elsewhere.generate([[5]], 1, SamplingParams(max_new_tokens=2), multimodal=images)


@pytest.mark.e2e
def test_image_prompts_sample_on_the_server_with_their_processor_outputs(tmp_path):
    """generation_engine='server' with a vision-language model (Idefics3; prompts of one image and of two): each
    prompt's processor outputs go to the server, which samples with them (transformers generate, image placeholders
    suppressed) and scores its samples with them, from the synced weights: its logprobs are the trainer's but for the
    suppressed placeholders."""
    from conftest import serving
    from vlm_models import image, save_tiny_idefics3

    path = save_tiny_idefics3(tmp_path / "idefics3")
    pictures = [[image(i, 32, 32)] if i % 2 else [image(i, 32, 32), image(i + 1, 32, 32)] for i in range(8)]
    prompts = [[{"role": "user", "content": f"What is in picture {i}?"}] for i in range(8)]
    data = datasets.Dataset.from_dict({"prompt": prompts, "images": pictures})
    with serving(path) as (url, _):
        trainer = GRPOTrainer(
            model=path,
            reward_funcs=lambda completions, **kwargs: [len(set(c[0]["content"])) for c in completions],
            args=config(tmp_path, url, num_generations=2, per_device_train_batch_size=4),
            train_dataset=data,
        )
        trainer.train()
    logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
    # the server samples with the image placeholders suppressed and says so in its logprobs (the processed
    # distribution: test_a_vlm_servers_logprobs_are_...): the gap is their mass under the policy (0.0016-0.0045 nats)
    assert len(logged) == 3 and all(e["sampling/sampling_logp_difference/max"] < 1e-2 for e in logged), logged


@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_a_vlm_servers_logprobs_are_those_of_the_distribution_generate_sampled_from(repetition_penalty):
    """With images the server samples with transformers generate, which gives no logprobs, and scores its samples in
    one forward: through generate's own processing (top-k, top-p, min-p, temperature, the repetition penalty over the
    tokens so far, suppressed image tokens, EOS held back until min_tokens), so the importance-sampling correction
    compares the trainer with the distribution each token was drawn from. Reference: generate's processed scores."""
    from vlm_models import image, sharpen, tiny_qwen2_vl

    from grouprl.core.types import Completion
    from grouprl.data.multimodal_prompts import MultimodalPromptTokenizer
    from grouprl.generation.server_choices import with_logprobs
    from grouprl.model.multimodal import collate

    model, processor = tiny_qwen2_vl()
    sharpen(model, 3.0).eval()
    encode = MultimodalPromptTokenizer(processor, max_context=None, max_completion_length=12)
    _, prompt, images = encode.encode_row({"prompt": [{"role": "user", "content": "look"}], "images": [image(1)]}, 0)
    eos, suppressed = model.generation_config.eos_token_id, [model.config.image_token_id]
    params = SamplingParams(
        max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=repetition_penalty
    )
    params.extra["min_new_tokens"] = 3
    torch.manual_seed(0)
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        **collate([images], len(prompt), len(prompt)),
        do_sample=True,
        max_new_tokens=12,
        min_new_tokens=3,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=repetition_penalty,
        suppress_tokens=suppressed,
        eos_token_id=eos,
        pad_token_id=eos,
        return_dict_in_generate=True,
        output_scores=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    expected = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.scores, tokens)]
    (scored,) = with_logprobs(
        model,
        [prompt],
        [Completion(0, tokens, "", "length")],
        params,
        [images],
        suppress_token_ids=suppressed,
        eos_token_ids=[eos],
    )
    torch.testing.assert_close(torch.tensor(scored.sampler_logprobs), torch.tensor(expected), atol=1e-4, rtol=1e-4)
    # The check can fail: the temperature alone (what the server used to return) scores the same tokens otherwise.
    plain = with_logprobs(model, [prompt], [Completion(0, tokens, "", "length")], SamplingParams(12, 0.8), [images])
    assert (torch.tensor(plain[0].sampler_logprobs) - torch.tensor(expected)).abs().max() > 1e-2


def test_the_server_picks_its_sampler_as_the_trainer_does(tiny_model_dir):
    """`grouprl serve --generation_engine`: 'auto' is the trainer's pick for the model's device (the fast engine on
    a CPU, the captured loop on CUDA) where it serves the model, else transformers generate with the reason; an
    explicit engine that cannot serve the model stops the server naming why; a vision-language model samples with
    generate, which takes its images."""
    from test_architectures import nemotron_h, qwen3_5
    from vlm_models import tiny_llava

    from grouprl.generation.engine import FastGenerator
    from grouprl.generation.hf import TransformersGenerator
    from grouprl.generation.server import server_sampler
    from grouprl.generation.static_decode import CapturedGenerator

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pick = {"cpu": (FastGenerator, "engine"), "cuda": (CapturedGenerator, "captured")}[model.device.type]
    for engine, (kind, named) in {
        "auto": pick,
        "engine": (FastGenerator, "engine"),
        "captured": (CapturedGenerator, "captured"),
    }.items():
        sampler, described = server_sampler(model, tokenizer, [0], 0, engine)
        assert type(sampler) is kind and described == f"generation_engine {named!r}"
    sampler, described = server_sampler(model, tokenizer, [0], 0, "transformers")
    assert type(sampler) is TransformersGenerator and described == "transformers generate"
    hybrid = qwen3_5()  # linear-attention layers: the engine cannot drop its rows, the captured loop serves it
    sampler, described = server_sampler(hybrid, tokenizer, [0], 0, "auto")
    assert type(sampler) is CapturedGenerator and described.startswith("generation_engine 'captured'")
    if model.device.type == "cpu":  # the engine tried first, and why not said
        assert "(not 'engine': the model has non-attention layers" in described
    mamba = nemotron_h()  # Mamba-2 layers: neither serves it
    sampler, described = server_sampler(mamba, tokenizer, [0], 0, "auto")
    assert (
        type(sampler) is TransformersGenerator
        and "not 'captured': its layers of type ['mlp'] are neither attention nor linear attention" in described
    )
    with pytest.raises(ValueError, match=r"--generation_engine captured: its layers of type \[.mlp.\] are neither"):
        server_sampler(mamba, tokenizer, [0], 0, "captured")
    vlm, processor = tiny_llava()
    sampler, _ = server_sampler(vlm, processor.tokenizer, [0], 0, "captured")
    assert type(sampler) is TransformersGenerator and sampler.suppress_token_ids == [vlm.config.image_token_id]


@pytest.mark.e2e
def test_a_server_started_with_the_captured_loop_samples_through_it(tiny_model_dir):
    """`grouprl serve --generation_engine captured` (eager on a CPU): /health names the sampler, and its greedy
    completions are the captured loop's here, with their logprobs."""
    from conftest import serving

    from grouprl.generation.static_decode import CapturedGenerator

    with serving(tiny_model_dir, "--generation_engine", "captured") as (url, _):
        client = RemoteGenerator(url)
        assert client.info["sampler"] == "generation_engine 'captured'"  # its /health at connection
        greedy = SamplingParams(max_new_tokens=6, top_k=1)
        served = client.generate([[5, 6, 7], [8, 9]], 2, greedy)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    local = CapturedGenerator(model, tokenizer, [tokenizer.eos_token_id], tokenizer.pad_token_id, capture=False)
    expected = local.generate([[5, 6, 7], [8, 9]], 2, greedy)
    assert [c.token_ids for c in served] == [c.token_ids for c in expected]
    for got, want in zip(served, expected):
        torch.testing.assert_close(got.sampler_logprobs, want.sampler_logprobs, atol=1e-5, rtol=1e-5)


def test_unreachable_server_fails_fast_with_the_settings(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """A wait says what it waits for while it lasts (every WAIT_NOTE_S), then fails with the settings named."""
    from grouprl.generation import server_client

    monkeypatch.setattr(server_client, "WAIT_NOTE_S", 0.0)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    caplog.set_level("WARNING", logger="grouprl")
    with pytest.raises(ServerError, match="no generation server answered.*vllm_server_timeout=1s"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=config(tmp_path, url, vllm_server_timeout=1),
            train_dataset=PROMPTS,
        )
    assert time.monotonic() - started < 15
    assert f"waiting for a generation server at {url}/health" in caplog.text
    client = RemoteGenerator(url, timeout=1, retries=2, connect=False)
    with pytest.raises(
        ServerError, match="failed after 3 attempt.*vllm_server_timeout=1s.*generation_server_retries=2"
    ):
        client.generate([[5]], 2, SamplingParams(max_new_tokens=2))


def test_killed_server_gives_a_clear_error(server):
    """Last in this file (and after test_distributed.py): it kills the shared session server."""
    url, process = server
    client = RemoteGenerator(url, timeout=2, retries=1)
    assert client.generate([[5, 6]], 1, SamplingParams(max_new_tokens=2))
    process.kill()
    process.wait()
    started = time.monotonic()
    with pytest.raises(ServerError, match="failed after 2 attempt"):
        client.generate([[5, 6]], 1, SamplingParams(max_new_tokens=2))
    assert time.monotonic() - started < 10
