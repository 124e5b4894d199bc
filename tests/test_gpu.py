"""On a CUDA GPU (marker gpu; skipped, with the reason, elsewhere): the trainer trains there in bf16 with each
generation engine, and the training pass's log-probabilities on the GPU equal the CPU's.
bench/gpu/check.sh runs these with the rest of the suite's GPU-relevant part."""

import gc
import math

import pytest
import torch
from helpers import distinct_tokens, forward_logprobs, numbered_prompts, quiet_config
from transformers import AutoModelForCausalLM

from grouprl import GRPOTrainer
from grouprl.model.logprobs import completion_logprobs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("engine", ["auto", "engine", "captured", "transformers", "captured+compile"])
def test_bf16_training_runs_on_the_gpu_with_every_engine(tiny_model_dir, tmp_path, engine):
    config = quiet_config(
        tmp_path,
        per_device_train_batch_size=6,
        max_completion_length=8,
        max_steps=3,
        bf16=True,
        generation_engine=engine.split("+")[0],
        compile_decode_step=engine.endswith("+compile"),
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=numbered_prompts()
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.accelerator.device.type == "cuda" and trainer.accelerator.mixed_precision == "bf16"
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters()), "no weight moved"


def test_training_logprobs_on_the_gpu_equal_the_cpu_ones(tiny_model_dir, monkeypatch):
    """fp32, same rows: the packed-prompt pass on CUDA gives the CPU's values (kernels differ: 1e-4). The tiny model's
    shared prompts are packed on both devices whatever the cost estimate says."""
    from grouprl.model import prompt_packing

    monkeypatch.setattr(prompt_packing, "pairs_per_token", lambda model: 1e9)
    monkeypatch.setattr(prompt_packing, "worth_packing", lambda packed, plain, device: True)
    packs = []
    build_pack = prompt_packing.build_pack
    monkeypatch.setattr(prompt_packing, "build_pack", lambda *a, **k: packs.append(a[-1]) or build_pack(*a, **k))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (4, 6), generator=g).repeat_interleave(2, 0)  # 4 prompts x 2 samples
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    prompt_mask[:2, :2] = False  # a left-padded prompt
    completion_ids = torch.randint(3, vocab, (8, 5), generator=g)
    completion_mask = torch.ones_like(completion_ids, dtype=torch.bool)
    completion_mask[3, 3:] = False  # a finished completion

    def logprobs(device: str) -> torch.Tensor:
        rows = (t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask))
        with torch.no_grad():
            return completion_logprobs(model.to(device), *rows, temperature=1.0).logprobs.cpu()

    on_cpu = logprobs("cpu")
    torch.testing.assert_close(logprobs("cuda"), on_cpu, rtol=1e-4, atol=1e-4)
    devices = [torch.device(d).type for d in packs]  # the first pass's packs include the one-time probe's
    assert "cpu" in devices and devices[-1] == "cuda", devices  # both passes packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compile_step", [False, True])
def test_the_captured_graph_decodes_as_the_eager_loop(tiny_model_dir, dtype, compile_step):
    """The static decode loop replaying its CUDA graph (of the compiled step, or of the step as written) against the
    same loop run eagerly (tests/test_static_decode.py checks the eager loop against transformers): greedy tokens
    equal; sampled tokens' logprobs equal a separate forward's (fp32); rows finish (a quarter of the vocabulary is
    EOS) and stop at their EOS."""
    from transformers import AutoTokenizer

    from grouprl.core.types import SamplingParams
    from grouprl.generation.static_decode import CapturedGenerator

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in ("12+7=", "3+4=", "what is 123 + 456 =")]
    greedy = SamplingParams(max_new_tokens=40, top_k=1)
    runs = {}
    for capture in (True, False):
        engine = CapturedGenerator(
            model, tokenizer, [], tokenizer.pad_token_id, capture=capture, compile_step=compile_step and capture
        )
        runs[capture] = [c.token_ids for c in engine.generate(prompts, 2, greedy)]
        assert engine.last_decode[0] == 39
    assert runs[True] == runs[False]
    if dtype != torch.float32:
        return
    eos = list(range(0, 60))
    engine = CapturedGenerator(model, tokenizer, eos, tokenizer.pad_token_id, capture=True, compile_step=compile_step)
    torch.manual_seed(0)
    completions = engine.generate(prompts, 8, SamplingParams(max_new_tokens=24, temperature=0.7))
    assert any(c.finish_reason == "stop" for c in completions) and len({len(c.token_ids) for c in completions}) > 2
    for c in completions:
        logps = forward_logprobs(model, prompts[c.prompt_index], c.token_ids, temperature=0.7)
        torch.testing.assert_close(logps, torch.tensor(c.sampler_logprobs), rtol=1e-3, atol=1e-3)


def test_the_captured_graph_in_waves_samples_the_tokens_of_one_pass(tiny_model_dir):
    """A memory budget of about a third of the rows: each wave records and replays its own graph, and every row
    samples one pass's tokens (its uniform numbers drawn at the call's start), rows finishing at many steps."""
    from test_static_decode import row_bytes
    from transformers import AutoTokenizer

    from grouprl.core.types import SamplingParams
    from grouprl.generation import static_decode

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in ("12+7=", "3+4=", "what is 123 + 456 =")]
    params = SamplingParams(max_new_tokens=24, temperature=0.9)
    budget = int(4.5 * row_bytes(model, prompts, 24) / static_decode.MEMORY_HEADROOM)
    runs = []
    for memory_budget in (None, budget):
        engine = static_decode.CapturedGenerator(
            model, tokenizer, list(range(0, 40)), tokenizer.pad_token_id, capture=True, memory_budget=memory_budget
        )
        torch.manual_seed(5)
        runs.append(engine.generate(prompts, 4, params))
    assert [c.token_ids for c in runs[1]] == [c.token_ids for c in runs[0]]
    assert len({len(c.token_ids) for c in runs[0]}) > 3


def test_generation_calls_leave_no_memory_behind(tiny_model_dir):
    """Every call warms up and records on one side stream: cuBLAS keeps a workspace per stream it ran on, and a new
    stream a call (CUDA's pool has 32) left one more 32 MiB workspace allocated after each of the first 32 calls."""
    from transformers import AutoTokenizer

    from grouprl.core.types import SamplingParams
    from grouprl.generation.static_decode import CapturedGenerator

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in ("12+7=", "3+4=")]
    engine = CapturedGenerator(model, tokenizer, [], tokenizer.pad_token_id, capture=True)
    allocated = []
    for _ in range(4):
        engine.generate(prompts, 4, SamplingParams(max_new_tokens=12))
        gc.collect()  # a call's objects in reference cycles are freed here, not counted as kept
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[1:] == allocated[:1] * 3, [a - allocated[0] for a in allocated]


COMPILED = [(arch, True, False) for arch in ("qwen3_5", "qwen3_moe", "gpt_oss", "gemma3")]


@pytest.mark.parametrize(
    "arch, compile_step, autocast", [("qwen3_5", False, True), ("qwen3_5", False, False), *COMPILED]
)
def test_a_models_graph_decodes_as_its_eager_loop(arch, compile_step, autocast):
    """Qwen3.5's linear-attention layers (their states updated in place, delta_rule.py) inside the replayed graph, of
    the step as written (fp32, and under bf16 autocast as the trainer generates) or compiled (fp32: inductor keeps
    fp32 where eager bf16 code rounds); and compiled, as CUDA's default has it, the experts (Qwen3-MoE; GPT-OSS with
    its sinks and windows) and Gemma 3's windows: greedy tokens equal the eager loop's."""
    from test_architectures import EOS, PROMPTS, TOKENIZER, built

    from grouprl.core.types import SamplingParams
    from grouprl.generation.static_decode import CapturedGenerator

    model = built(arch).cuda()
    greedy = SamplingParams(max_new_tokens=24, top_k=1)
    runs = {}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        for capture in (True, False):
            compiled = compile_step and capture
            engine = CapturedGenerator(model, TOKENIZER, [], EOS, capture=capture, compile_step=compiled)
            runs[capture] = [c.token_ids for c in engine.generate(PROMPTS, 2, greedy)]
            assert engine.last_decode[0] == 23
    assert runs[True] == runs[False]
