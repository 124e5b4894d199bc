"""The sampler's draw: inverse CDF (the default) against the exact distribution, and its failure modes."""

import pytest
import torch
from chi_square import chi_square_rejects

from grouprl.generation.sampling import CDF_BLOCK, cdf_block, cumulative_distribution, sample_tokens


def _draw_counts(logits: torch.Tensor, n: int, method: str, seed: int = 0, chunk: int = 20_000) -> torch.Tensor:
    generator, counts = torch.Generator().manual_seed(seed), torch.zeros(logits.shape[-1], dtype=torch.long)
    for start in range(0, n, chunk):
        tokens, _ = sample_tokens(logits.expand(min(chunk, n - start), -1), generator=generator, method=method)
        counts += torch.bincount(tokens, minlength=logits.shape[-1])
    return counts


# 60 tokens: one block; 2,503 (a prime): two blocks of CDF_BLOCK and a shorter one, which only the two-level draw has
@pytest.mark.parametrize("method, vocab", [("inverse_cdf", 60), ("multinomial", 60), ("inverse_cdf", 2503)])
def test_draws_follow_the_processed_distribution(method, vocab):
    torch.manual_seed(0)
    logits = torch.randn(1, vocab) * (2 if vocab < 100 else 4)  # a top token of ~0.1 either way, for the power check
    logits[0, [3, 17, 59]] = -float("inf")  # filtered by top-k/top-p: never drawn
    counts = _draw_counts(logits, 200_000, method)
    probs = logits[0].softmax(-1)
    assert counts[[3, 17, 59]].sum() == 0
    assert not chi_square_rejects(counts, probs)
    top, second = probs.topk(2).indices
    shifted = probs.clone()
    shifted[top], shifted[second] = (
        probs[top] * 0.95,
        probs[second] + probs[top] * 0.05,
    )  # 5% of the top token's mass moved
    assert chi_square_rejects(counts, shifted)  # the test has the power to see that


def test_tiny_probabilities_keep_their_share():
    """150,000 tokens of probability ~2e-8 after one of ~0.997: each is below half an ulp of the running sum in
    float32, so a float32 CDF gives them widths of 0 or several times their probability."""
    logits = torch.full((1, 150_001), -17.7)
    logits[0, 0] = 0.0
    probs = logits.softmax(-1)
    widths = cumulative_distribution(probs).diff(dim=-1)[0]  # the chance each tail token is drawn
    assert torch.allclose(widths, probs[0, 1:].double(), rtol=1e-6, atol=0)
    float32_widths = probs.float().cumsum(-1).diff(dim=-1)[0]  # what float32 would have done
    assert float((float32_widths == 0).float().mean()) > 0.5 and float(float32_widths.max()) > 2 * float(probs[0, 1])


@pytest.mark.parametrize("vocab", [3 * CDF_BLOCK, 3301])  # blocks that divide it; a prime, with a shorter last block
def test_the_draw_finds_the_token_its_uniform_number_points_at(monkeypatch, vocab):
    """The two-level draw (a block by the blocks' masses, then a token inside it) against the slow reference, one
    float64 CDF over the whole vocabulary: a uniform number at the middle of a token's interval draws that token, in
    every block, across a block of filtered tokens and in the last, shorter block."""
    torch.manual_seed(0)
    size = cdf_block(vocab)
    logits = torch.randn(1, vocab) * 2
    logits[0, size : 2 * size] = -float("inf")  # a whole block filtered
    logits[0, ::7] = -float("inf")
    probs = logits[0].softmax(-1).double()
    cdf = probs.cumsum(0)
    # tokens wide enough that the blocks' fp32 masses (~1e-7 of the total) cannot move u out of their middle
    positive = (probs > 1e-5).nonzero().squeeze(1)
    targets = torch.cat([positive[::5], positive[-1:]])
    assert bool((targets >= 2 * size).any()) and bool((targets < size).any())
    uniforms = (cdf[targets] - probs[targets] / 2) / cdf[-1]
    monkeypatch.setattr(torch, "rand_like", lambda x, **k: uniforms[:, None].to(x.dtype))
    tokens, logprobs = sample_tokens(logits.expand(len(targets), -1))
    assert tokens.tolist() == targets.tolist()
    given, _ = sample_tokens(logits.expand(len(targets), -1), uniforms=uniforms[:, None])  # the caller's numbers
    assert given.tolist() == targets.tolist()
    torch.testing.assert_close(logprobs.double(), probs[targets].log(), rtol=0, atol=1e-5)


def test_blocks_divide_the_vocabulary_where_they_can():
    assert cdf_block(60) == 60 and cdf_block(2048) == 2048
    assert cdf_block(151_936) == 1_187  # Qwen2.5: 128 blocks
    assert cdf_block(128_256) == 1_002 and cdf_block(49_152) == 1_024  # Llama 3, SmolLM2
    assert cdf_block(3301) == CDF_BLOCK  # a prime: the last block is shorter


def test_same_seed_same_tokens_and_logprobs():
    logits = torch.randn(8, 100)
    first = sample_tokens(logits, generator=torch.Generator().manual_seed(3))
    second = sample_tokens(logits, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert torch.allclose(first[1], torch.log_softmax(logits, -1).gather(1, first[0][:, None]).squeeze(1), atol=1e-6)


def test_a_draw_at_the_top_of_the_range_never_picks_a_filtered_token(monkeypatch):
    """u = the largest double below 1 times the total can round up to the total;
    the trailing -inf tokens must stay out."""
    logits = torch.tensor([[0.3, 1.2, 0.1, -float("inf"), -float("inf")]])
    monkeypatch.setattr(torch, "rand_like", lambda x, **k: torch.ones_like(x))  # the extreme draw, u = 1
    tokens, _ = sample_tokens(logits)
    assert tokens.tolist() == [2]


def test_a_draw_at_the_top_of_a_shorter_last_block_stays_in_the_vocabulary(monkeypatch):
    """The last block's places past the vocabulary hold 0: where its fp32 mass rounds above its float64 scan, the top
    draw must still land on the last real token, never past the vocabulary."""
    torch.manual_seed(0)
    logits = torch.randn(64, 3301)  # a prime: blocks of CDF_BLOCK and a shorter last one
    monkeypatch.setattr(torch, "rand_like", lambda x, **k: torch.ones_like(x))
    tokens, _ = sample_tokens(logits)
    assert tokens.tolist() == [3300] * 64


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="unknown method 'gumbel'.*inverse_cdf"):
        sample_tokens(torch.zeros(1, 3), method="gumbel")
