"""What a weight sync sends: plain transformers names and full tensors, LoRA merged, in size-bounded chunks."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.generation.weights import chunks, inference_weights


def test_plain_model_sends_its_parameters(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sent = dict(inference_weights(model))
    assert list(sent) == [name for name, _ in model.named_parameters()]
    assert all(torch.equal(sent[name], p) for name, p in model.named_parameters())


def test_lora_model_sends_merged_base_weights_and_stays_unmerged(tiny_model_dir):
    peft = pytest.importorskip("peft")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(input_ids=ids).logits
    sent = dict(inference_weights(model))
    assert list(sent) == [name for name, _ in base.named_parameters()]  # the served model's names, no adapter tensors
    merged = copy.deepcopy(model).merge_and_unload()
    for name, param in merged.named_parameters():
        assert torch.allclose(sent[name], param, atol=1e-6), name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(sent[q], dict(base.named_parameters())[q])  # the adapter's update is in it
    assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-6)  # unmerged again (merge + unmerge round off)


def test_chunks_stay_under_the_size_bound():
    weights = [(f"w{i}", torch.zeros(10)) for i in range(5)] + [("big", torch.zeros(100))]
    sizes = [sum(t.numel() * 4 for t in chunk.values()) for chunk in chunks(iter(weights), max_bytes=80)]
    assert sizes == [80, 80, 40, 400]  # 2 + 2 + 1 small tensors, the oversized one alone
