"""The static decode loop (generation_engine="captured") run eagerly, on whatever device is here: against
transformers generate token for token, a separate forward pass, the model's distribution, and itself.

On CUDA the same steps replay a captured graph; tests/test_gpu.py checks that path against these eager ones."""

from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from chi_square import chi_square_rejects
from helpers import distinct_tokens, forward_logprobs, numbered_prompts, quiet_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.core.types import SamplingParams
from grouprl.generation import decode_probe, static_decode
from grouprl.generation.model_step import ModelStep
from grouprl.generation.static_decode import DECODE_STEPS, CapturedGenerator, captured_supports, step_choice
from grouprl.generation.static_kv_cache import StaticKVCache, bytes_per_row, repeated

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(DEVICE)
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def prompts_of(tokenizer):
    """Three prompts of different lengths: left padding and the prompt bucket both matter."""
    return [tokenizer(text)["input_ids"] for text in ("12+7=", "3+4=", "what is 123 + 456 + 789 =")]


def generator(model, tokenizer, eos, **kwargs):
    return CapturedGenerator(model, tokenizer, eos, tokenizer.pad_token_id, capture=False, **kwargs)


@pytest.fixture(params=DECODE_STEPS)
def decode_step(request):
    """The model's own forward (ModelStep) and the hand-written step (FusedDecoder), each."""
    return request.param


def transformers_generate(model, tokenizer, prompts, g, **sampling):
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)
    out = model.generate(
        input_ids=ids, attention_mask=mask, num_return_sequences=g, pad_token_id=tokenizer.pad_token_id, **sampling
    )
    return out[:, width:].tolist()


@pytest.mark.parametrize("bucket", [1, 64])
def test_seeded_samples_equal_transformers_generate(model_and_tokenizer, bucket, decode_step):
    """No EOS, transformers' multinomial draw: the random stream is consumed as generate consumes it, so the same
    seed gives the same tokens, with temperature, top-k and top-p, and prompts padded to a bucket or not."""
    model, tokenizer = model_and_tokenizer
    prompts = prompts_of(tokenizer)
    ours = generator(
        model, tokenizer, decode_step=decode_step, eos=[], prompt_bucket=bucket, sampling_method="multinomial"
    )
    sampling = {"temperature": 0.9, "top_k": 50, "top_p": 0.95}
    torch.manual_seed(0)
    got = ours.generate(prompts, 4, SamplingParams(max_new_tokens=10, **sampling))
    torch.manual_seed(0)
    want = transformers_generate(
        model, tokenizer, prompts, 4, do_sample=True, max_new_tokens=10, min_new_tokens=10, **sampling
    )
    assert [c.token_ids for c in got] == want
    assert [c.prompt_index for c in got] == [0] * 4 + [1] * 4 + [2] * 4
    assert ours.last_decode[0] == 9  # every step after the prefill's token ran


def test_greedy_with_repetition_penalty_equals_transformers_generate(model_and_tokenizer, decode_step):
    """The penalty reads the history buffer (prompt and decoded tokens by cache column); prompts of one length,
    since transformers also penalises the padding of shorter ones (sampling.py)."""
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer("12+7=")["input_ids"], tokenizer("13+8=")["input_ids"]]
    assert len(prompts[0]) == len(prompts[1])
    got = generator(model, tokenizer, decode_step=decode_step, eos=[]).generate(
        prompts, 1, SamplingParams(max_new_tokens=16, top_k=1, repetition_penalty=1.5)
    )
    want = transformers_generate(
        model, tokenizer, prompts, 1, do_sample=False, max_new_tokens=16, min_new_tokens=16, repetition_penalty=1.5
    )
    assert [c.token_ids for c in got] == want
    unpenalised = generator(model, tokenizer, decode_step=decode_step, eos=[]).generate(
        prompts, 1, SamplingParams(max_new_tokens=16, top_k=1)
    )
    assert [c.token_ids for c in unpenalised] != want  # the penalty changed the tokens: the test can tell


@pytest.mark.parametrize("rows_finish", [False, True])
def test_sampler_logprobs_equal_a_separate_forward(model_and_tokenizer, rows_finish, decode_step):
    """Each returned logprob is the sampled token's under the processed (temperature 0.7) distribution of a
    fresh forward over prompt + completion; with a quarter of the vocabulary as EOS rows finish at many steps,
    record nothing after their EOS and stop with finish_reason 'stop'."""
    model, tokenizer = model_and_tokenizer
    prompts = prompts_of(tokenizer)
    eos = list(range(0, 60)) if rows_finish else []
    torch.manual_seed(1)
    completions = generator(model, tokenizer, decode_step=decode_step, eos=eos, prompt_bucket=8).generate(
        prompts, 6, SamplingParams(max_new_tokens=12, temperature=0.7)
    )
    lengths = {len(c.token_ids) for c in completions}
    assert (len(lengths) > 3) if rows_finish else (lengths == {12})
    for c in completions:
        ended = [i for i, t in enumerate(c.token_ids) if t in eos]
        assert ended in ([], [len(c.token_ids) - 1]) and (c.finish_reason == "stop") == bool(ended)
        logps = forward_logprobs(model, prompts[c.prompt_index], c.token_ids, temperature=0.7)
        assert torch.allclose(logps, torch.tensor(c.sampler_logprobs), atol=1e-4)


def test_decode_steps_follow_the_models_distribution(model_and_tokenizer):
    """The inverse-CDF draw through a decode step (not only the prefill's): among 8000 samples, those whose first
    token is the most common one; their second tokens against softmax of the model's logits after that token
    (chi-square, p < 1e-3 rejects; seeded, so deterministic: seed 0's draws land at p = 3e-4, a chance 1 in 1000
    seeds have; measured, none of seeds 1-59 rejects)."""
    model, tokenizer = model_and_tokenizer
    prompt = tokenizer("12+7=")["input_ids"]
    torch.manual_seed(1)
    completions = generator(model, tokenizer, []).generate(
        [prompt], 8000, SamplingParams(max_new_tokens=2, temperature=0.1)
    )
    firsts = torch.tensor([c.token_ids[0] for c in completions])
    first = int(firsts.mode().values)
    seconds = torch.tensor([c.token_ids[1] for c in completions if c.token_ids[0] == first])
    assert len(seconds) > 500
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [first]], device=DEVICE)).logits[0, -1].double().cpu()
    counts = torch.bincount(seconds, minlength=logits.numel()).double()
    assert not chi_square_rejects(counts, (logits / 0.1).softmax(-1))
    assert chi_square_rejects(counts, (logits / 0.11).softmax(-1))  # a 10% wrong temperature is noticed


def row_bytes(model, prompts, new_tokens, bucket=64):
    """What the loop plans a row of this call to need (cache and loop buffers), from a prefill of the prompts."""
    from transformers import DynamicCache

    width = -(-max(map(len, prompts)) // bucket) * bucket
    prefill = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompts[0]], device=DEVICE), past_key_values=prefill, use_cache=True)
    return bytes_per_row(prefill, width, new_tokens, torch.float32) + static_decode.loop_bytes_per_row(
        model, width, new_tokens
    )


def test_a_static_caches_row_holds_what_is_planned_for_it(model_and_tokenizer):
    """bytes_per_row, which sizes the waves, against the buffers a StaticKVCache allocates, counted."""
    from transformers import DynamicCache

    model, tokenizer = model_and_tokenizer
    prompts = torch.tensor([tokenizer("what is 123 + 456 =")["input_ids"]] * 2, device=DEVICE)
    prefill = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompts, past_key_values=prefill, use_cache=True)
    cache = StaticKVCache(prefill, torch.ones_like(prompts), repeated(2, 3, DEVICE), 40, torch.float32)
    held = sum(kv.nbytes for kv in cache.key_values) + cache.valid.nbytes + cache.bias.nbytes
    assert held == 6 * bytes_per_row(prefill, prompts.shape[1], 40, torch.float32)


@pytest.mark.parametrize("method", ["inverse_cdf", "multinomial"])
def test_rows_that_do_not_fit_decode_in_waves_with_the_tokens_of_one_pass(
    model_and_tokenizer, decode_step, method, caplog
):
    """A memory budget of 5 rows for a call of 12: three waves (5, 5, 2), said once; with the inverse-CDF draw
    (each row's numbers drawn at the call's start) every token and logprob is one pass's, rows finishing at many
    steps; multinomial draws in waves what it draws, so its tokens may differ, but every row is sampled."""
    import logging

    model, tokenizer = model_and_tokenizer
    prompts, params = prompts_of(tokenizer), SamplingParams(max_new_tokens=16, temperature=0.9)
    eos = list(range(0, 40))
    per_row = row_bytes(model, prompts, 16)
    runs = {}
    for budget in (None, int(5.5 * per_row / static_decode.MEMORY_HEADROOM)):
        sampler = generator(
            model, tokenizer, eos, decode_step=decode_step, sampling_method=method, memory_budget=budget
        )
        torch.manual_seed(3)
        with caplog.at_level(logging.INFO, logger="grouprl"):
            runs[budget] = sampler.generate(prompts, 4, params)
    one_pass, waves = runs.values()
    assert caplog.text.count("decodes 12 rows in waves of 5") == 1
    assert len(waves) == 12 and [c.prompt_index for c in waves] == [c.prompt_index for c in one_pass]
    if method == "inverse_cdf":
        assert [c.token_ids for c in waves] == [c.token_ids for c in one_pass]
        assert len({len(c.token_ids) for c in one_pass}) > 3  # rows finish at many steps
        for got, want in zip(waves, one_pass):
            torch.testing.assert_close(got.sampler_logprobs, want.sampler_logprobs, rtol=0, atol=1e-6)


def test_a_wave_out_of_memory_runs_again_as_two(model_and_tokenizer, monkeypatch, caplog):
    """CUDA's out-of-memory error (faked: any cache of more than 3 rows) halves the wave (12 -> 6 -> 3) and the call
    samples one pass's tokens; a single row out of memory is an error naming the fields to lower."""
    import logging

    model, tokenizer = model_and_tokenizer
    prompts, params = prompts_of(tokenizer), SamplingParams(max_new_tokens=10, temperature=0.9)
    torch.manual_seed(4)
    want = generator(model, tokenizer, []).generate(prompts, 4, params)
    built = []

    def cache_of_at_most(rows):
        def build(prefill, mask, prompt_of_row, *args):
            built.append(len(prompt_of_row))
            if len(prompt_of_row) > rows:
                raise torch.OutOfMemoryError("CUDA out of memory (faked)")
            return StaticKVCache(prefill, mask, prompt_of_row, *args)

        return build

    monkeypatch.setattr(static_decode, "StaticKVCache", cache_of_at_most(3))
    torch.manual_seed(4)
    with caplog.at_level(logging.WARNING, logger="grouprl"):
        got = generator(model, tokenizer, []).generate(prompts, 4, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert built == [12, 6, 3, 3, 3, 3] and "decodes waves of 3 from here on" in caplog.text
    monkeypatch.setattr(static_decode, "StaticKVCache", cache_of_at_most(0))
    with pytest.raises(ValueError, match="one row of 64 prompt columns and 10 new tokens.*max_completion_length"):
        generator(model, tokenizer, []).generate(prompts, 4, params)


def test_a_row_larger_than_the_memory_is_refused_before_decoding(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    sampler = generator(model, tokenizer, [], memory_budget=1000)
    with pytest.raises(ValueError, match=r"needs \d\.\d\d GiB of static cache .* and 0\.00 GiB is free on"):
        sampler.generate(prompts_of(tokenizer), 2, SamplingParams(max_new_tokens=8))


def test_min_new_tokens_holds_eos_back(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    eos = list(range(0, 60))
    torch.manual_seed(2)
    completions = generator(model, tokenizer, eos).generate(
        prompts_of(tokenizer), 8, SamplingParams(max_new_tokens=12, extra={"min_new_tokens": 5})
    )
    assert all(len(c.token_ids) >= 5 for c in completions)
    assert any(c.finish_reason == "stop" for c in completions)


def test_the_loop_stops_once_every_row_finished(model_and_tokenizer):
    """Finished rows keep stepping (static shapes) until the host's periodic check sees every row done."""
    model, tokenizer = model_and_tokenizer
    eos = list(range(0, 200))  # most of the vocabulary: every row ends within a few steps
    torch.manual_seed(3)
    ours = generator(model, tokenizer, eos)
    completions = ours.generate(prompts_of(tokenizer), 4, SamplingParams(max_new_tokens=200))
    assert all(c.finish_reason == "stop" for c in completions)
    steps = ours.last_decode[0]
    assert steps < 199 and steps % 16 == 0  # stopped at a check, long before max_new_tokens


def test_the_compiled_step_samples_as_the_eager_one(model_and_tokenizer, decode_step):
    """compile_step=True (GRPOConfig.compile_decode_step): the step traced whole by torch.compile and run by
    inductor's kernels. Drawing its random numbers as eager code does (inductor's fallback_random), the same seed
    gives the eager loop's tokens with every sampling field and rows that finish; the logprobs agree; the compile's
    seconds are reported apart (`report`); a second call with the same shapes compiles nothing more. Inductor's
    on-disk graph cache is off here: an entry written under another instruction-set limit (CI runs this file again
    held to AVX2) crashed when served (torch 2.13)."""
    import torch._inductor.config as inductor
    from torch._dynamo.utils import counters

    model, tokenizer = model_and_tokenizer
    prompts, eos = prompts_of(tokenizer), list(range(0, 40))
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3)
    runs = {}
    with patch.object(inductor, "fallback_random", True), patch.object(inductor, "fx_graph_cache", False):
        for compiled in (False, True):
            torch.manual_seed(0)
            sampler = generator(model, tokenizer, decode_step=decode_step, eos=eos, compile_step=compiled)
            runs[compiled] = sampler.generate(prompts, 3, params)
        report = sampler.report()  # the compiling step timed apart, a metric of the batch
        assert report["compile_s"] > 0 and report["compiled_graphs"] == 1
        sampler.generate(prompts, 3, params)
        assert sampler.report() == {"compile_s": 0.0, "compiled_graphs": 1.0}
        graphs = counters["stats"]["unique_graphs"]
        torch.manual_seed(1)
        generator(model, tokenizer, decode_step=decode_step, eos=eos, compile_step=True).generate(prompts, 3, params)
        assert counters["stats"]["unique_graphs"] == graphs
    assert [c.token_ids for c in runs[True]] == [c.token_ids for c in runs[False]]
    assert any(c.finish_reason == "stop" for c in runs[True]) and any(c.finish_reason == "length" for c in runs[True])
    for compiled, eager in zip(runs[True], runs[False]):
        torch.testing.assert_close(compiled.sampler_logprobs, eager.sampler_logprobs, rtol=1e-4, atol=1e-5)


def test_one_compiled_layer_serves_every_layer():
    """compile_decode_step compiles a layer once for all of a model's layers (a graph for the first, which has no
    previous MLP output to add, one for the rest) and the sampling once: three graphs for 6 layers, and none more
    for another model of the same widths, where a graph of the whole step unrolled every layer (17.9 s to compile
    24 layers on a 2-core CPU; 4.8 s so)."""
    import torch._inductor.config as inductor
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grouprl.generation import static_decode

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")
    params = SamplingParams(max_new_tokens=5, temperature=0.9)
    torch._dynamo.reset()  # no graph of an earlier test's shapes
    for layers, new_graphs in ((6, 3), (3, 0)):
        config = Qwen2Config(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(DEVICE).eval()
        graphs = counters["stats"]["unique_graphs"]
        with patch.object(inductor, "fx_graph_cache", False):
            out = CapturedGenerator(model, tokenizer, [], 0, capture=False, compile_step=True).generate(
                [[5, 6, 7], [8, 9]], 2, params
            )
        assert [len(c.token_ids) for c in out] == [5] * 4
        assert counters["stats"]["unique_graphs"] - graphs == new_graphs
    static_decode.compiled_regions.cache_clear()


def test_the_compiled_step_writes_one_column_not_the_whole_cache(model_and_tokenizer, monkeypatch):
    """A step writes its keys and values into one column of each layer's buffer. Given the buffer and views of it as
    separate inputs, inductor copied the whole buffer twice a layer to do that (a loop over all its elements in the
    generated code): the step must hand the compiled graph the buffer alone."""
    import torch._inductor.config as inductor
    from torch._inductor.utils import run_and_get_code

    from grouprl.generation import static_decode

    model, tokenizer = model_and_tokenizer
    sizes = []
    build = StaticKVCache.__init__

    def recording(self, *args, **kwargs):
        build(self, *args, **kwargs)
        sizes.append(self.key_values[0].numel())

    monkeypatch.setattr(StaticKVCache, "__init__", recording)
    static_decode.compiled_regions.cache_clear()  # a fresh compile, so its code is generated here
    with patch.object(inductor, "fx_graph_cache", False):
        _, code = run_and_get_code(
            generator(model, tokenizer, [], compile_step=True).generate,
            prompts_of(tokenizer),
            2,
            SamplingParams(max_new_tokens=6),
        )
    static_decode.compiled_regions.cache_clear()
    code = "\n".join(code)
    assert "index_copy" in code or "index_put" in code  # the generated step (the write is in it)
    whole = sizes[0]
    assert f"{whole}L" not in code and f"xnumel = {whole}" not in code, f"a loop over all {whole} cache elements"


def assert_rounds_as_the_forward(gaps):
    """The eager loop's |logprob gaps| to the training forward under bf16 autocast (test below): within 5e-7 but at a
    few positions (on CUDA likewise; measured on an H200: 13 gaps of 5e-7 and one of 3e-5 in 108)."""
    assert int((gaps > 1e-5).sum()) <= 3, gaps
    assert gaps.mean() < 1e-4


def test_the_compiled_step_under_bf16_autocast_keeps_to_the_training_forward(model_and_tokenizer, decode_step):
    """fp32 weights under bf16 autocast, as the trainer generates with bf16=True. The eager loop rounds where the
    training forward's autocast rounds (the products' inputs, RoPE's output before attention, which runs in bf16, the
    KV cache included), so its logprobs are the training forward's at nearly every position: a one-row product and
    the forward's many-row one differ now and then by an ulp of bf16 (measured on this CPU, seeds 0-3: 1-2 of 108
    positions off by 3e-5 to 0.0024, the rest within 5e-7; an fp32 cache and attention left every position off, a
    mean of 0.00042). Inductor keeps elementwise work in fp32 where eager code rounds, so the
    compiled step does not sample the eager loop's very tokens; its gap stays that of one bf16 rounding (measured:
    mean 0.00033, largest 0.0014), the sampler correction's mismatch. The device's autocast dtype: bf16 (CPU, CUDA)."""
    import torch._inductor.config as inductor

    model, tokenizer = model_and_tokenizer
    prompts, params = prompts_of(tokenizer), SamplingParams(max_new_tokens=12, temperature=0.8)
    gaps = {}
    with patch.object(inductor, "fx_graph_cache", False), torch.autocast(DEVICE, dtype=torch.bfloat16):
        for compiled in (False, True):
            torch.manual_seed(0)
            completions = generator(model, tokenizer, decode_step=decode_step, eos=[], compile_step=compiled).generate(
                prompts, 3, params
            )
            forward = [forward_logprobs(model, prompts[c.prompt_index], c.token_ids, 0.8) for c in completions]
            gaps[compiled] = torch.cat([torch.tensor(c.sampler_logprobs) - f for c, f in zip(completions, forward)])
    gaps = {compiled: gap.abs() for compiled, gap in gaps.items()}
    assert len(gaps[True]) == len(gaps[False]) == 9 * 12
    assert_rounds_as_the_forward(gaps[False])
    assert gaps[True].mean() < 1e-3 and gaps[True].max() < 0.005


@pytest.mark.parametrize("transposed", [False, True])
def test_either_mlp_orientation_keeps_to_the_training_forward(model_and_tokenizer, transposed, monkeypatch):
    """Under bf16 autocast the step's gate/up weights are cast and stacked into one product, computed as x @ W^T
    (CPUs) or as W @ x^T, each half of the output contiguous (CUDA: fused_step.mlp_transposed_pays_off). Both are
    the same products of the same bf16 operands: each keeps the eager loop's bound to the training forward's
    logprobs (test above), and on this CPU the two sample the same tokens (measured: largest gap 5e-7 either way)."""
    from grouprl.generation import fused_step

    monkeypatch.setattr(fused_step, "mlp_transposed_pays_off", lambda device: transposed)
    monkeypatch.setattr(fused_step, "packs_weights", lambda dtype, device: False)  # as on CUDA
    model, tokenizer = model_and_tokenizer
    prompts, params = prompts_of(tokenizer), SamplingParams(max_new_tokens=12, temperature=0.8)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        decoder = fused_step.FusedDecoder(model)
        torch.manual_seed(0)
        completions = generator(model, tokenizer, []).generate(prompts, 3, params)
        forward = [forward_logprobs(model, prompts[c.prompt_index], c.token_ids, 0.8) for c in completions]
    assert decoder.mlp_transposed == transposed and all(len(layer.gate_up) == 1 for layer in decoder.layers)
    gaps = torch.cat([torch.tensor(c.sampler_logprobs) - f for c, f in zip(completions, forward)]).abs()
    assert len(gaps) == 9 * 12
    assert_rounds_as_the_forward(gaps)
    if DEVICE == "cpu":  # a GPU's GEMM kernels for the two orientations may differ by an ulp, and so the tokens
        monkeypatch.setattr(fused_step, "mlp_transposed_pays_off", lambda device: not transposed)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            torch.manual_seed(0)
            other = generator(model, tokenizer, []).generate(prompts, 3, params)
        assert [c.token_ids for c in other] == [c.token_ids for c in completions]


@pytest.mark.parametrize("asked", [True, None])
def test_a_step_that_cannot_compile_stops_or_runs_as_written(model_and_tokenizer, monkeypatch, caplog, asked):
    """torch.compile's failure (no C++ compiler, an operator it lacks, ...): asked for (compile_decode_step=True), it
    stops the run naming the field that turns it off; by default (unset, where it compiles: CUDA, faked here) the loop
    says so once and samples as written, the eager loop's very tokens, and tries no more compiles."""
    import logging

    import torch._dynamo.exc

    from grouprl.generation import static_decode

    attempts = []

    def failing(fn, **kwargs):
        def compiled(*args):
            attempts.append(fn.__name__)
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found")

        return compiled

    monkeypatch.setattr(torch, "compile", failing)
    monkeypatch.setattr(static_decode, "compiles_by_default", lambda device: True)
    static_decode.compiled_regions.cache_clear()
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    try:
        sampler = generator(model, tokenizer, [], compile_step=asked)
        if asked:
            with pytest.raises(
                RuntimeError, match="compile_decode_step=True.*no C.. compiler found.*compile_decode_step=False"
            ):
                sampler.generate(prompts_of(tokenizer), 1, params)
            return
        with caplog.at_level(logging.WARNING, logger="grouprl"):
            runs = []
            for _ in range(2):
                torch.manual_seed(0)
                runs.append([c.token_ids for c in sampler.generate(prompts_of(tokenizer), 2, params)])
        torch.manual_seed(0)
        eager = [c.token_ids for c in generator(model, tokenizer, [], compile_step=False).generate(
            prompts_of(tokenizer), 2, params
        )]  # fmt: skip
        assert runs == [eager, eager] and len(attempts) == 1 and sampler.compile_step is False
        assert caplog.text.count("could not compile its decode step (TorchDynamoException: no C++ compiler") == 1
    finally:
        static_decode.compiled_regions.cache_clear()  # the next test compiles for real


def test_the_step_compiles_by_default_on_cuda_only():
    """compile_decode_step unset: compiled where it was measured faster (an H200), not on a CPU, where inductor's C++
    build costs seconds a shape and needs a compiler."""
    from grouprl.generation.static_decode import compiles_by_default

    assert compiles_by_default(torch.device("cuda", 0)) and not compiles_by_default(torch.device("cpu"))


def test_static_cache_attention_equals_repeated_heads():
    """Grouped-query attention over the static buffers (query heads grouped by key/value head) against the plain
    computation with each key/value head repeated for its queries, masked columns excluded."""
    torch.manual_seed(0)
    rows, kv_heads, heads, columns, dim = 3, 2, 6, 10, 8
    keys, values = torch.randn(rows, kv_heads, columns, dim), torch.randn(rows, kv_heads, columns, dim)
    valid = torch.rand(rows, columns) > 0.3
    valid[:, 0] = True
    prefill = SimpleNamespace(layers=[SimpleNamespace(keys=keys, values=values)])
    cache = StaticKVCache(prefill, valid.long(), torch.arange(rows), new_tokens=1, kv_dtype=torch.float32)
    assert cache.key_values[0].shape[2] == 16  # 11 columns, allocated as a multiple of 16 (never valid beyond 11)
    assert torch.equal(cache.valid[:, :columns], valid) and not cache.valid[:, columns:].any()
    query = torch.randn(rows, heads, 1, dim)
    got = cache.layer(0).attend(query, 0.5)
    keys, values = keys.repeat_interleave(heads // kv_heads, 1), values.repeat_interleave(heads // kv_heads, 1)
    scores = (query @ keys.transpose(-1, -2)) * 0.5
    scores = scores.masked_fill(~valid[:, None, None, :], -float("inf"))
    want = (scores.softmax(-1) @ values).transpose(1, 2)
    assert torch.allclose(got, want, atol=1e-5)


def test_lora_policy_samples_with_its_adapter(model_and_tokenizer, decode_step):
    """A peft LoRA policy: the decode step reads base + adapter (merged for the call), as the model's forward."""
    peft = pytest.importorskip("peft")
    model, tokenizer = model_and_tokenizer
    policy = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(model.config._name_or_path).to(DEVICE),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False),
    )
    assert captured_supports(policy, {}, None) is None
    prompts = prompts_of(tokenizer)
    got = generator(policy, tokenizer, decode_step=decode_step, eos=[]).generate(
        prompts, 1, SamplingParams(max_new_tokens=8, top_k=1)
    )
    want = transformers_generate(policy, tokenizer, prompts, 1, do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert [c.token_ids for c in got] == want
    with policy.disable_adapter():
        base = transformers_generate(policy, tokenizer, prompts, 1, do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert base != want  # the adapter changes the samples: the test can tell


def test_declines_what_it_cannot_run(model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert captured_supports(model, {}, None) is None
    assert "generation_kwargs" in captured_supports(model, {"num_beams": 2}, None)
    assert "cache_implementation" in captured_supports(model, {}, "static")


def test_bf16_weights_are_admitted_by_their_fp32_twin_not_by_name(model_and_tokenizer, monkeypatch):
    """A bf16 model's step is judged on an fp32 twin of its class and config: a step that computes differently there
    (RoPE one position ahead) is refused, whatever the model type says."""
    model, _ = model_and_tokenizer
    bf16 = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, dtype=torch.bfloat16)
    monkeypatch.setattr(decode_probe, "_VERDICTS", {})
    assert captured_supports(bf16, {}, None, decode_step="model") is None
    forward = ModelStep._forward
    monkeypatch.setattr(ModelStep, "_forward", lambda self, tokens, at, view: forward(self, tokens, at + 1, view))
    monkeypatch.setattr(decode_probe, "_VERDICTS", {})
    assert "differs from its forward" in captured_supports(bf16, {}, None, decode_step="model")


def test_training_with_the_captured_engine_learns(tmp_path, tiny_model_dir, monkeypatch):
    """generation_engine='captured' end to end: the trainer samples through it and the weights move; what the loop
    reports of its compiles is logged with each step (planted here: compiling on a CPU takes a C++ build)."""
    from grouprl import GRPOTrainer

    compiles = iter([{"compile_s": 1.5, "compiled_graphs": 1.0}, {"compile_s": 0.0, "compiled_graphs": 1.0}])
    monkeypatch.setattr(CapturedGenerator, "report", lambda self: next(compiles))

    config = quiet_config(
        tmp_path,
        generation_engine="captured",
        max_steps=2,
        per_device_train_batch_size=6,
        max_completion_length=8,
        learning_rate=0.1,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir), reward_funcs=distinct_tokens, args=config, train_dataset=numbered_prompts()
    )
    assert type(trainer.generation_backend.engine).__name__ == "CapturedGenerator"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logged = [(h["generation/compile_s"], h["generation/compiled_graphs"]) for h in trainer.state.log_history[:2]]
    assert logged == [(1.5, 1.0), (0.0, 1.0)]


def test_a_vision_language_model_without_a_twin_to_probe_is_refused_by_name():
    """Qwen2-VL's text config has no causal LM of its own to build the probe's fp32 twin from: the loop says so."""
    from vlm_models import tiny_qwen2_vl

    model, _ = tiny_qwen2_vl()
    assert captured_supports(model, {}, None) == (
        "its fp32 twin's model step failed: NotImplementedError: no causal LM of its text config "
        "(Qwen2VLTextConfig) to build a twin from"
    )


def test_the_captured_loop_serves_ministral3s_vision_language_model_for_text_prompts(tiny_model_dir):
    """Ministral 3's checkpoints are Mistral3ForConditionalGeneration (a Pixtral tower, YaRN RoPE, queries scaled by
    position past the original length): its text-only calls run its language model's own forward in the captured
    loop, greedy as generate past that length, its image placeholder never sampled."""
    from decoding import greedy_and_generates, sharpened
    from transformers import Ministral3Config, Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    rope = dict(rope_type="yarn", factor=2.0, beta_fast=32.0, beta_slow=1.0, llama_4_scaling_beta=2.0)
    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    text = Ministral3Config(**sizes, num_key_value_heads=2, max_position_embeddings=24, head_dim=16)
    text.rope_parameters = {**rope, "rope_theta": 10_000.0, "original_max_position_embeddings": 12}  # as given
    text.sliding_window, text.pad_token_id, text.bos_token_id, text.eos_token_id = None, 0, 1, 2
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    config = Mistral3Config(
        text_config=text.to_dict(),
        vision_config=PixtralVisionConfig(**vision, image_size=16, patch_size=4).to_dict(),
        image_token_index=95,
    )
    torch.manual_seed(0)
    model = sharpened(Mistral3ForConditionalGeneration(config).eval().to(DEVICE), 4.0)
    assert step_choice(model) == ("model", None)
    sampler = CapturedGenerator(model, AutoTokenizer.from_pretrained(tiny_model_dir), [2], 0, suppress_token_ids=[95])
    for prompt in ([5, 9, 13, 4, 7, 30], [40, 41]):  # one at a time: the model's own positions, no padding
        got, want = greedy_and_generates(sampler, [prompt], 12, suppress_tokens=[95])
        assert got == want and len(prompt) + len(got[0]) > 12  # past the original length


def test_the_captured_loop_serves_qwen3_5s_vision_language_model_for_text_prompts():
    """Qwen3.5's checkpoints load as Qwen3_5ForConditionalGeneration. Its text tokens take the same position on the
    three axes of its multimodal RoPE, so a text-only call runs its hybrid language model's own forward (its gated
    delta rule over the static cache's states) in the captured loop: greedy, generate's tokens; sampled, a separate
    forward's logprobs."""
    from decoding import samples_keep_to_the_forward_without
    from vlm_models import sharpen, tiny_qwen3_5

    model, processor = tiny_qwen3_5()
    model = sharpen(model, 4.0)
    with torch.no_grad():  # norm weights of their own: Qwen3.5's (1 + w) norms start at w = 0
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(mean=0.5 if name.endswith("linear_attn.norm.weight") else 0.0, std=0.3)
    model = model.eval().to(DEVICE)
    assert step_choice(model) == ("model", None)
    tokenizer, eos = processor.tokenizer, model.generation_config.eos_token_id
    image_token = model.config.image_token_id
    prompts = [[5, 9, 13, 4, 7, 30], [40, 41], [3, 3, 8, 60]]
    sampler = CapturedGenerator(model, tokenizer, [eos], eos, suppress_token_ids=[image_token])
    greedy = [c.token_ids for c in sampler.generate(prompts, 1, SamplingParams(max_new_tokens=12, top_k=1))]
    for prompt, got in zip(prompts, greedy):  # one prompt at a time: no padding, the model's own positions
        want = model.generate(
            input_ids=torch.tensor([prompt], device=DEVICE), do_sample=False, max_new_tokens=12,
            suppress_tokens=[image_token], eos_token_id=eos, pad_token_id=eos,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert got == (want[: want.index(eos) + 1] if eos in want else want)
    samples_keep_to_the_forward_without(sampler, prompts, image_token)
