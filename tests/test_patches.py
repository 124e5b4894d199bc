"""Scoped patches and probes that say what they decided (issue 18, items 5 and 6).

grouprl's changes to transformers' attention registry and to the model are active inside train(),
evaluate() and a generation (and the fast paths are actually taken there), and gone afterwards, even
after the trainer is deleted. Probes log their verdict once, with the reason, and genuine errors
inside a fast path propagate instead of turning it off.
"""

from __future__ import annotations

import contextlib
import gc
import logging

import pytest
import torch
from helpers import distinct_tokens, numbered_prompts, quiet_config
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import grouprl.generation.engine as engine
import grouprl.model.forward as model_forward
from grouprl import GRPOTrainer
from grouprl.core.types import SamplingParams
from grouprl.generation import cpu_products, shared_prefix
from grouprl.generation.engine import FastGenerator
from grouprl.model import packed_attention, prompt_packing
from grouprl.model.logprobs import completion_logprobs
from grouprl.model.packed_attention import sdpa_or_packed
from grouprl.model.patches import grouprl_patches, patches_active

ORIGINAL_LINEAR_FORWARD = torch.nn.Linear.forward


def snapshot(model: torch.nn.Module) -> dict:
    """Everything grouprl could leave changed: transformers' attention registry (class-wide and the shared instance's),
    nn.Linear's forward, the model's attention implementation, head and any instance-level forward on its modules."""
    return {
        "class-wide attention": dict(AttentionInterface._global_mapping),
        "instance attention": dict(ALL_ATTENTION_FUNCTIONS._local_mapping),
        "sdpa": ALL_ATTENTION_FUNCTIONS["sdpa"],
        "nn.Linear.forward": torch.nn.Linear.forward,
        "attention implementation": model.config._attn_implementation,
        "head": model.get_output_embeddings(),
        "modules with their own forward": sorted(name for name, m in model.named_modules() if "forward" in vars(m)),
    }


def assert_nothing_left(before: dict, model: torch.nn.Module) -> None:
    after = snapshot(model)
    assert after == before
    assert after["sdpa"] is sdpa_attention_forward
    assert torch.nn.Linear.forward is ORIGINAL_LINEAR_FORWARD
    assert shared_prefix.NAME not in ALL_ATTENTION_FUNCTIONS
    assert not patches_active()


@pytest.fixture
def fast_paths(monkeypatch):
    """Every fast path applies to the tiny model (it is all attention by the cost estimate, its prompts are short),
    and each counts the calls it serves."""
    monkeypatch.setattr(prompt_packing, "pairs_per_token", lambda model: 1e9)
    monkeypatch.setattr(engine, "SHARED_PREFIX_MIN_TOKENS", 0)
    calls = {
        "packed attention": 0,
        "packed attention with gradient": 0,
        "shared-prefix attention": 0,
        "weight-major products": 0,
        "registered inside": [],
    }
    real_packed, real_attend, real_linear = (
        packed_attention.packed_attention,
        shared_prefix.SharedPrefixCache.attend,
        cpu_products.weight_major_linear,
    )

    def packed(*args, **kwargs):
        calls["packed attention"] += 1
        calls["packed attention with gradient"] += torch.is_grad_enabled()  # the training pass, not a probe
        return real_packed(*args, **kwargs)

    def attend(self, *args, **kwargs):
        calls["shared-prefix attention"] += 1
        return real_attend(self, *args, **kwargs)

    def linear(*args, **kwargs):
        calls["weight-major products"] += 1
        return real_linear(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "packed_attention", packed)
    monkeypatch.setattr(shared_prefix.SharedPrefixCache, "attend", attend)
    monkeypatch.setattr(cpu_products, "weight_major_linear", linear)
    return calls


def recording_reward(calls):
    def reward(completion_ids, **kwargs):  # runs inside train()/evaluate(): is grouprl's sdpa registered there?
        calls["registered inside"].append(patches_active() and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_or_packed)
        return distinct_tokens(completion_ids)

    return reward


def test_train_and_evaluate_patch_inside_and_leave_nothing_behind(tiny_model_dir, tmp_path, fast_paths):
    """A CPU run on any machine (use_cpu=True): the weight-major products serve CPU decoding only, and the fast engine
    (shared-prefix attention) is generation_engine='auto''s choice on the CPU only."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config._attn_implementation == "sdpa"
    before = snapshot(model)
    args = quiet_config(
        tmp_path,
        per_device_train_batch_size=6,
        per_device_eval_batch_size=6,
        max_completion_length=6,
        max_steps=2,
        learning_rate=0.1,
        bf16=False,
        num_iterations=2,
        use_cpu=True,
    )
    trainer = GRPOTrainer(
        model,
        reward_funcs=recording_reward(fast_paths),
        args=args,
        train_dataset=numbered_prompts(12),
        eval_dataset=numbered_prompts(4),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    assert_nothing_left(before, model)  # building the trainer patches nothing

    trainer.train()
    # Inside: the registry held grouprl's sdpa, and each fast path served calls (old logprobs with num_iterations=2 and
    # the training pass: packed attention; the engine: shared-prefix decode and weight-major products).
    assert fast_paths["registered inside"] and all(fast_paths["registered inside"])
    assert fast_paths["packed attention with gradient"] > 0
    assert fast_paths["shared-prefix attention"] > 0 and fast_paths["weight-major products"] > 0
    assert_nothing_left(before, model)

    fast_paths["registered inside"].clear()
    trainer.evaluate()
    assert fast_paths["registered inside"] and all(fast_paths["registered inside"])
    assert_nothing_left(before, model)

    del trainer
    gc.collect()
    assert_nothing_left(before, model)


def test_a_generation_patches_only_while_it_runs(tiny_model_dir, fast_paths, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    before = snapshot(model)
    seen_inside = []
    real_decoding = shared_prefix.decoding

    @contextlib.contextmanager
    def decoding(m, cache):  # what the model looks like during the decode loop
        with real_decoding(m, cache):
            seen_inside.append((m.config._attn_implementation, shared_prefix.NAME in ALL_ATTENTION_FUNCTIONS))
            yield

    monkeypatch.setattr(engine, "decoding", decoding)
    sampler = FastGenerator(model, tokenizer, eos_token_ids=[], pad_token_id=tokenizer.pad_token_id)
    out = sampler.generate(
        [tokenizer("12+7=")["input_ids"], tokenizer("3+4=")["input_ids"]], 3, SamplingParams(max_new_tokens=5)
    )
    assert len(out) == 6 and all(len(c.token_ids) == 5 for c in out)
    assert seen_inside == [(shared_prefix.NAME, True)]  # one switch for the whole decode loop, not one per step
    assert fast_paths["shared-prefix attention"] > 0 and fast_paths["weight-major products"] > 0
    assert_nothing_left(before, model)


def test_the_context_nests_and_restores_an_entry_the_user_had_put_there(monkeypatch):
    def users_sdpa(*args, **kwargs):
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", users_sdpa)
    with grouprl_patches():
        with grouprl_patches():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_or_packed
        assert (
            ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_or_packed and patches_active()
        )  # only the outermost exit restores
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users_sdpa and not patches_active()
    with pytest.raises(ZeroDivisionError), grouprl_patches():
        raise ZeroDivisionError("an error inside the patched block")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users_sdpa and not patches_active()  # restored on an error too


def _rows(vocab: int):
    prompt_ids = torch.tensor([[0, 3, 5, 7], [0, 3, 5, 7], [2, 4, 6, 8]]) % vocab
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    completion_ids = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 7, 8]]) % vocab
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _verdicts(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grouprl" and text in r.getMessage()]


def test_packing_outside_the_context_attends_densely_with_the_same_values_and_gradients(tiny_model_dir, fast_paths):
    """Outside grouprl_patches the pack attends through its 4D mask (no registration to
    lose before a checkpointed backward)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = _rows(model.config.vocab_size)

    def run(pack: bool):
        model.zero_grad()
        out = completion_logprobs(model, *rows, temperature=1.0, pack_prompts=pack, with_entropy=False).logprobs
        (out * rows[3]).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (packed, packed_grads), (plain, plain_grads) = run(True), run(False)
    assert (
        fast_paths["packed attention"] == model.config.num_hidden_layers
    )  # the probe only (inside the context, no gradient)
    torch.testing.assert_close(packed[rows[3]], plain[rows[3]], rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_model_the_packing_probe_cannot_serve_is_logged_once_with_the_reason(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(prompt_packing, "pairs_per_token", lambda model: 1e9)

    def unsupported(*args, **kwargs):
        raise NotImplementedError("no packed attention for this layer (test)")

    monkeypatch.setattr(packed_attention, "packed_attention", unsupported)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = _rows(model.config.vocab_size)
    caplog.set_level(logging.INFO, logger="grouprl")
    with torch.no_grad(), grouprl_patches():
        first = completion_logprobs(model, *rows, temperature=1.0).logprobs
        second = completion_logprobs(model, *rows, temperature=1.0).logprobs
        plain = completion_logprobs(model, *rows, temperature=1.0, pack_prompts=False).logprobs
    assert torch.equal(first, plain) and torch.equal(second, plain)  # the plain pass, both times
    verdicts = _verdicts(caplog, "prompt packing is")
    assert len(verdicts) == 1
    assert "off" in verdicts[0] and "NotImplementedError: no packed attention for this layer (test)" in verdicts[0]
    assert [r.levelno for r in caplog.records if "prompt packing is" in r.getMessage()] == [logging.WARNING]


def test_packing_that_applies_is_logged_once_as_on(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(prompt_packing, "pairs_per_token", lambda model: 1e9)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    caplog.set_level(logging.INFO, logger="grouprl")
    with torch.no_grad(), grouprl_patches():
        for _ in range(2):
            completion_logprobs(model, *_rows(model.config.vocab_size), temperature=1.0)
    verdicts = _verdicts(caplog, "prompt packing is")
    assert len(verdicts) == 1 and "prompt packing is on" in verdicts[0]


def test_a_genuine_error_in_the_packed_path_propagates(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(prompt_packing, "pairs_per_token", lambda model: 1e9)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug, not a missing feature")

    monkeypatch.setattr(packed_attention, "packed_attention", broken)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad(), grouprl_patches(), pytest.raises(ZeroDivisionError, match="a bug"):
        completion_logprobs(model, *_rows(model.config.vocab_size), temperature=1.0)  # in the probe: not a silent "off"
    assert model not in prompt_packing._PROBED or not prompt_packing._PROBED[model]


def test_an_out_of_memory_error_in_a_probe_propagates(tiny_model_dir, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (test)")

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    monkeypatch.setattr(model_forward, "forward_keeping", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        model_forward.separable_head(model)


def _soft_capped_gemma2() -> Gemma2ForCausalLM:
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=0.5,
        attn_logit_softcapping=50.0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits far beyond the cap, so capping changes them
    return model


def test_head_and_shared_prefix_probes_log_once_why_a_model_is_not_served(caplog):
    model = _soft_capped_gemma2()
    caplog.set_level(logging.INFO, logger="grouprl")
    for _ in range(2):
        assert model_forward.separable_head(model) is None
        assert not shared_prefix.matches_standard_attention(model)
    head = _verdicts(caplog, "LM head")
    assert len(head) == 1 and "not separable" in head[0] and "post-processes" in head[0]
    decode = _verdicts(caplog, "shared-prefix decoding is")
    assert (
        len(decode) == 1 and "off" in decode[0] and "soft-capping" in decode[0]
    )  # the attention function's own refusal
    assert model.config._attn_implementation != shared_prefix.NAME and shared_prefix.NAME not in ALL_ATTENTION_FUNCTIONS


class _NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward has no logits_to_keep keyword (and counts its calls)."""

    def __init__(self, error: Exception | None = None):
        super().__init__()
        self.calls, self.error = 0, error

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return input_ids.float()


def test_logits_to_keep_is_dropped_only_for_a_forward_that_refuses_that_keyword(caplog):
    caplog.set_level(logging.INFO, logger="grouprl")
    model = _NoLogitsToKeep()
    kwargs = {"input_ids": torch.ones(1, 3, dtype=torch.long)}
    for _ in range(3):
        model_forward.forward_keeping(model, kwargs, 2)
    assert model.calls == 3  # the refused keyword never reached forward; retried once, then remembered
    assert len(_verdicts(caplog, "takes no logits_to_keep")) == 1

    broken = _NoLogitsToKeep(TypeError("unsupported operand type(s) for +: 'int' and 'str'"))  # the model's own bug
    with pytest.raises(TypeError, match="unsupported operand"):
        model_forward.forward_keeping(broken, kwargs, 2)
    assert broken.calls == 1  # the keyword refused at the call, then the model's own TypeError propagates


def test_a_type_error_inside_a_forward_that_takes_logits_to_keep_propagates_without_a_retry():
    class Model(torch.nn.Module):
        calls = 0

        def forward(self, input_ids, logits_to_keep=0):
            Model.calls += 1
            raise TypeError("forward() got an unexpected keyword argument 'pixel_values'")

    with pytest.raises(TypeError, match="pixel_values"):
        model_forward.forward_keeping(Model(), {"input_ids": torch.ones(1, 2)}, 1)
    assert Model.calls == 1
