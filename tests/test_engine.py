"""The fast generation engine against transformers generate, a separate forward pass, and itself."""

import pytest
import torch
from chi_square import chi_square_rejects
from helpers import forward_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grouprl.core.types import SamplingParams
from grouprl.generation.engine import FastGenerator, engine_supports
from grouprl.generation.sampling import process_logits
from grouprl.generation.shared_prefix import matches_standard_attention


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True, params=["shared-prefix attention", "repeated prompt cache"])
def prefix_mode(request, monkeypatch):
    """Every engine test runs with both decode paths (the prompts here are shorter than the engine's threshold)."""
    import grouprl.generation.engine as engine

    monkeypatch.setattr(engine, "SHARED_PREFIX_MIN_TOKENS", 0 if request.param == "shared-prefix attention" else 10**9)
    return request.param


def _prompts(tokenizer):
    return [tokenizer("12+7=")["input_ids"], tokenizer("3+4=")["input_ids"]]


def _hf_generate(model, tokenizer, prompts, g, **sampling):
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        num_return_sequences=g,
        pad_token_id=tokenizer.pad_token_id,
        **sampling,
    )
    return out[:, width:].tolist()


@pytest.mark.parametrize("share_prefix", [True, False])
def test_same_seed_same_tokens_as_transformers(model_and_tokenizer, share_prefix):
    """No EOS -> no row leaves the batch -> with transformers' draw the random stream
    is consumed exactly as generate does."""
    model, tokenizer = model_and_tokenizer
    prompts = _prompts(tokenizer)
    engine = FastGenerator(
        model,
        tokenizer,
        eos_token_ids=[],
        pad_token_id=tokenizer.pad_token_id,
        share_prefix=share_prefix,
        sampling_method="multinomial",
    )
    torch.manual_seed(0)
    ours = engine.generate(prompts, 4, SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95))
    torch.manual_seed(0)
    theirs = _hf_generate(
        model, tokenizer, prompts, 4, max_new_tokens=10, min_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95
    )
    assert [c.token_ids for c in ours] == theirs
    assert [c.prompt_index for c in ours] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert matches_standard_attention(model)  # the prompt's KV was read once per prompt, not copied per sample


def test_shared_prefix_attention_declines_models_it_does_not_reproduce():
    """Gemma2 soft-caps attention scores and alternates sliding-window layers: the one-time probe must say no,
    and the engine then decodes with the regular cache (same tokens as transformers)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        attn_logit_softcapping=1.0,
        sliding_window=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    assert not matches_standard_attention(model)


def test_first_tokens_follow_the_models_distribution(model_and_tokenizer):
    """The default inverse-CDF draw through the whole engine: first-token frequencies of many samples against
    softmax of the model's next-token logits (chi-square, p < 1e-3 rejects; the seed makes it deterministic)."""
    model, tokenizer = model_and_tokenizer
    prompt = tokenizer("12+7=")["input_ids"]
    engine = FastGenerator(model, tokenizer, eos_token_ids=[], pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    completions = engine.generate([prompt], 4000, SamplingParams(max_new_tokens=1, temperature=0.2))
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in completions]), minlength=logits.numel()).double()
    assert not chi_square_rejects(counts, (logits / 0.2).softmax(-1))
    assert chi_square_rejects(counts, (logits / 0.22).softmax(-1))  # the test notices a 10% wrong temperature


def test_processing_matches_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    history = torch.randint(0, 50, (4, 6))
    ours = process_logits(
        logits,
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        history=history,
        history_mask=torch.ones_like(history, dtype=torch.bool),
    )
    theirs = logits.clone()
    for processor in (
        RepetitionPenaltyLogitsProcessor(1.3),
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(20),
        TopPLogitsWarper(0.8),
        MinPLogitsWarper(0.05),
    ):
        theirs = processor(history, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(ours)
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-6)


def test_repetition_penalty_ignores_padding():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    history = torch.tensor([[0, 2]])
    out = process_logits(
        logits, temperature=1.0, repetition_penalty=2.0, history=history, history_mask=torch.tensor([[False, True]])
    )
    assert out.tolist() == [[1.0, 2.0, 1.5]]  # token 0 is padding: not penalised


@pytest.mark.parametrize("rows_finish", [False, True])
def test_sampler_logprobs_equal_a_separate_forward(model_and_tokenizer, rows_finish):
    """With rows_finish, a quarter of the vocabulary is EOS: rows leave the KV cache at many steps, and the
    survivors' logprobs (read from the compacted cache) must still equal a fresh forward pass."""
    model, tokenizer = model_and_tokenizer
    prompts = _prompts(tokenizer)
    eos = list(range(0, 60)) if rows_finish else list(model.generation_config.eos_token_id)
    engine = FastGenerator(model, tokenizer, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    completions = engine.generate(prompts, 6 if rows_finish else 3, SamplingParams(max_new_tokens=12, temperature=0.7))
    if rows_finish:
        assert len(set(engine.decode_batch_sizes)) > 3  # rows left at several different steps
    for c in completions:
        logps = forward_logprobs(model, prompts[c.prompt_index], c.token_ids, temperature=0.7)
        assert torch.allclose(logps, torch.tensor(c.sampler_logprobs), atol=1e-5)


def test_finished_rows_leave_the_batch(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    eos = list(range(0, 60))  # a quarter of the vocabulary ends a sequence: lengths vary a lot
    engine = FastGenerator(model, tokenizer, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(3)
    completions = engine.generate(_prompts(tokenizer), 8, SamplingParams(max_new_tokens=16))
    sizes = engine.decode_batch_sizes
    assert sizes[0] == 16 and sizes == sorted(sizes, reverse=True) and sizes[-1] < 16
    for c in completions:
        ended = [i for i, t in enumerate(c.token_ids) if t in eos]
        assert ended in ([], [len(c.token_ids) - 1])  # nothing after the first EOS
        assert (c.finish_reason == "stop") == bool(ended)
        assert len(c.sampler_logprobs) == len(c.token_ids)
    assert len({len(c.token_ids) for c in completions}) > 1


def test_prefix_sharing_gives_the_same_samples_with_eos(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    eos = list(range(0, 60))
    runs = []
    for share in (True, False):
        engine = FastGenerator(
            model, tokenizer, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id, share_prefix=share
        )
        torch.manual_seed(5)
        runs.append([c.token_ids for c in engine.generate(_prompts(tokenizer), 6, SamplingParams(max_new_tokens=12))])
    assert runs[0] == runs[1]


def test_engine_declines_what_it_cannot_do(model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert engine_supports(model, {}, None) is None
    assert "num_beams" in engine_supports(model, {"num_beams": 2}, None)
    assert "cache_implementation" in engine_supports(model, {}, "static")


def test_chunked_logprobs_equal_naive_in_value_and_gradient(monkeypatch):
    import grouprl.model.forward as lp

    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 40) * 2).requires_grad_()
    tokens = torch.randint(0, 40, (3, 5))
    weights = torch.randn(3, 5)

    def naive():
        logp_all = torch.log_softmax(logits.float() / 0.7, dim=-1)
        return logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)

    expected_logps, expected_entropy = naive()
    (grad_expected,) = torch.autograd.grad((expected_logps * weights).sum() + expected_entropy.sum(), logits)
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", 40 * 4)  # 4 positions per chunk: several chunks, one partial
    monkeypatch.setattr(lp, "MIN_CHUNK_POSITIONS", 1)
    logps, entropy = lp.logits_logprobs(logits, tokens, 0.7, entropy="grad")
    (grad,) = torch.autograd.grad((logps * weights).sum() + entropy.sum(), logits)
    assert torch.allclose(logps, expected_logps, atol=1e-6) and torch.allclose(entropy, expected_entropy, atol=1e-5)
    assert torch.allclose(grad, grad_expected, atol=1e-6)
    logps, entropy = lp.logits_logprobs(logits, tokens, 0.7)  # entropy as a metric: no gradient through it
    assert not entropy.requires_grad and torch.allclose(entropy, expected_entropy, atol=1e-5)
    (grad_logps_only,) = torch.autograd.grad((logps * weights).sum(), logits)
    (expected_logps_only,) = torch.autograd.grad((naive()[0] * weights).sum(), logits)
    assert torch.allclose(grad_logps_only, expected_logps_only, atol=1e-6)
