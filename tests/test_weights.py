"""What a weight sync sends: plain transformers names and full tensors, LoRA merged, in size-bounded chunks; and the
unsharded replica that in-process sampling under sharding loads them into."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.generation.factory import ShardedPolicySampler
from grouprl.generation.weights import chunks, inference_weights, load_weights, replica_of


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replica_computes_as_the_policy_and_keeps_its_own_weights(tiny_model_dir, dtype):
    """A replica built from the policy's config and loaded with its weights gives its logits exactly (its RoPE buffers
    copied, the tied head tied again, the policy's dtype); training the policy leaves it alone until the next load."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    replica = replica_of(model)
    load_weights(replica, model)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    assert torch.equal(replica(input_ids=ids).logits, model(input_ids=ids).logits)
    assert next(replica.parameters()).dtype == dtype and not replica.training
    assert (replica.get_output_embeddings().weight is replica.get_input_embeddings().weight) == (
        model.config.tie_word_embeddings
    )
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)
    assert not torch.equal(replica(input_ids=ids).logits, model(input_ids=ids).logits)
    load_weights(replica, model)
    assert torch.equal(replica(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_lora_policys_replica_is_its_merged_model(tiny_model_dir):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    replica = replica_of(model)
    load_weights(replica, model)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert type(replica) is type(model.get_base_model())  # a plain model: no adapters, nothing to unmerge
    assert torch.allclose(replica(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_a_weight_the_replica_lacks_is_named(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    replica = replica_of(model)
    replica.model.layers = replica.model.layers[:1]
    with pytest.raises(RuntimeError, match=r"'model\.layers\.1\..*does not fit its unsharded replica"):
        load_weights(replica, model)


def test_the_sharded_sampler_frees_its_replica_between_generations_and_fills_it_again(tiny_model_dir):
    """ShardedPolicySampler: the replica's weights live from a sync to the end of the generation
    (`release_until_sync`, which the loop calls once a generation is sampled); the next sync fills them with the
    policy's weights again."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    built = []
    sampler = ShardedPolicySampler(
        lambda replica: built.append(replica) or SimpleNamespace(sync_weights=lambda m: None)
    )
    sampler.sync_weights(model)
    replica = sampler.replica
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(replica(input_ids=ids).logits, model(input_ids=ids).logits)
    sampler.release_until_sync()
    assert all(t.is_meta for t in [*replica.parameters(), *replica.buffers()])
    with pytest.raises(RuntimeError, match="call sync_weights first"):
        sampler.generate([[5]], 1, None)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    sampler.sync_weights(model)
    assert sampler.replica is replica and built == [replica]  # the same modules and engine, storage again
    assert torch.equal(replica(input_ids=ids).logits, model(input_ids=ids).logits)
    assert replica.get_output_embeddings().weight is replica.get_input_embeddings().weight
