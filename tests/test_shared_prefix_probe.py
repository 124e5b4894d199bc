"""The shared-prefix decode probe: it accepts rounding noise at the model's own noise level and logit scale, and
rejects a wrong attention (a regression: fp32 SmolLM2-135M's noise of 4.6e-4 on near-zero logits, and every bf16
model, switched the fast path off)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.generation import shared_prefix
from grouprl.generation.shared_prefix import logit_tolerance, probe


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_tolerance_is_twice_the_models_own_noise_and_at_least_a_thousandth_of_the_scale():
    expected = torch.tensor([[0.01, -20.0, 3.0]])
    assert logit_tolerance(expected, noise=0.0) == pytest.approx(1e-4 + 1e-3 * 20.0)
    assert logit_tolerance(expected, noise=3.0) == pytest.approx(1e-4 + 6.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_accepts_the_shared_cache_on_a_model_with_large_logits(model, dtype):
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(300.0)  # logits of a real model's size (tens to hundreds)
    assert probe(model.to(dtype)) is None
    assert model.config._attn_implementation == "sdpa"  # the eager comparison pass leaves the model as it was


def test_probe_rejects_a_wrong_attention_and_says_by_how_much(model, monkeypatch):
    right = shared_prefix.SharedPrefixCache.attend

    def off_by_a_tenth(self, layer_idx, query, scale):
        return right(self, layer_idx, query, scale) * 1.1

    monkeypatch.setattr(shared_prefix.SharedPrefixCache, "attend", off_by_a_tenth)
    reason = probe(model)
    assert reason is not None and "differ from a regular cache's by up to" in reason and "noise" in reason
