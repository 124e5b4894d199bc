"""The feature-combination table (combinations.py): every pair it marks not built is refused at construction, naming
both features, before any model loads; pairs it marks as working construct; docs/combinations.md is the table."""

import logging
import os
from itertools import combinations as pairs

import datasets
import pytest
from helpers import distinct_tokens, numbered_prompts, quiet_config
from PIL import Image
from transformers import AutoModelForCausalLM, AutoTokenizer

import grouprl.compat.trainer_parts
import grouprl.generation.factory
from grouprl import GFPOConfig, GFPOTrainer, GRPOTrainer
from grouprl.compat.gfpo import shortest_k_filter
from grouprl.config.combinations import (
    EXCLUSIVE,
    FEATURES,
    NOT_BUILT,
    TABLE,
    UNTESTED,
    WORKS,
    UnsupportedCombination,
    cell,
    check_combinations,
    combinations_markdown,
    rewrite_doc,
)
from grouprl.generation.factory import ShardedPolicySampler, build_backend
from grouprl.generation.hf import TransformersGenerator

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "combinations.md")


def test_every_declared_pair_names_known_features_and_says_why(monkeypatch):
    for pair, found in TABLE.items():
        assert len(pair) == 2 and pair <= set(FEATURES), pair
        assert found.status in (WORKS, NOT_BUILT, EXCLUSIVE) and found.note, pair  # untested: simply not declared
    monkeypatch.delitem(TABLE, frozenset(("tools", "sharded")))
    assert cell("tools", "sharded").status == UNTESTED
    with pytest.raises(KeyError, match="'telepathy' is not a feature"):
        cell("telepathy", "lora")


@pytest.mark.parametrize("a, b", list(pairs(FEATURES, 2)))
def test_the_check_refuses_exactly_the_pairs_marked_not_built(a, b):
    if cell(a, b).status != NOT_BUILT:
        check_combinations({a, b})  # works / untested: allowed
        return
    with pytest.raises(UnsupportedCombination) as raised:
        check_combinations({b, a})
    message = str(raised.value)
    assert FEATURES[a] in message and FEATURES[b] in message and cell(a, b).note in message
    assert isinstance(raised.value, NotImplementedError) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"generation_engine": "server"},
        {"use_vllm": True, "vllm_mode": "server"},
        {"use_vllm": True, "vllm_mode": "colocate"},
        {"async_generation": True},
        {"async_generation": True, "use_vllm": True, "vllm_mode": "server"},
    ],
)
def test_a_run_samples_in_one_place_so_no_exclusive_pair_is_ever_active(sampling, tmp_path, monkeypatch):
    from grouprl import GRPOConfig

    monkeypatch.setattr(grouprl.compat.trainer_parts, "sharded_weights", lambda: False)

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, **sampling)
    none = dict.fromkeys(("model", "train_dataset", "tools", "environment_factory", "rollout_func"), None)
    active = grouprl.compat.trainer_parts.active_features(
        args, **none, peft_config=None, quantization_config=None, generation_backend=None
    )
    assert len(active & {"in_process_sampling", "generation_server", "vllm_colocate"}) == 1, active
    assert not [pair for pair, found in TABLE.items() if found.status == EXCLUSIVE and pair <= active]


def test_the_docs_render_the_table():
    text = open(DOC, encoding="utf-8").read()
    assert combinations_markdown() in text, (
        "docs/combinations.md is stale: python -c 'from grouprl.config.combinations import rewrite_doc; rewrite_doc()'"
    )
    for a, b in pairs(FEATURES, 2):
        if cell(a, b).status == NOT_BUILT:
            assert f"| `{a}` | `{b}` | not built |" in text


def test_rewrite_doc_replaces_only_the_generated_part(tmp_path):
    from grouprl.config.combinations import TABLE_BEGIN, TABLE_END

    path = tmp_path / "doc.md"
    path.write_text(f"before\n{TABLE_BEGIN}\nSTALE TABLE\n{TABLE_END}\nafter\n")
    assert rewrite_doc(str(path)) and not rewrite_doc(str(path))
    text = path.read_text()
    assert (
        text.startswith("before\n")
        and text.endswith("after\n")
        and "STALE TABLE" not in text
        and combinations_markdown() in text
    )


# ---- the trainer: how each feature is turned on through GRPOTrainer's arguments ----


class Room:
    def reset(self, **row):
        return None


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: the first
        b: the second
    """
    return a * b


def with_images(n=6):
    return datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"what is {i}?"}] for i in range(n)],
            "image": [Image.new("RGB", (4, 4), (i, 0, 0)) for i in range(n)],
        }
    )


def lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])


def four_bit():
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True)


# feature -> (GRPOTrainer keyword arguments, GRPOConfig overrides); in-process sampling is what the defaults do.
RECIPES = {
    "tools": lambda: ({"tools": [multiply]}, {}),
    "environment_factory": lambda: ({"environment_factory": Room}, {}),
    "rollout_func": lambda: ({"rollout_func": lambda prompts, trainer: {}}, {}),
    "images": lambda: ({"train_dataset": with_images()}, {}),
    "in_process_sampling": lambda: ({}, {}),
    "generation_server": lambda: ({}, {"generation_engine": "server"}),
    "vllm_colocate": lambda: ({}, {"use_vllm": True}),
    "dynamic_sampling": lambda: ({}, {"dynamic_sampling": True}),
    "lora": lambda: ({"peft_config": lora()}, {}),
    "sync_ref_model": lambda: ({}, {"beta": 0.1, "sync_ref_model": True}),
    "quantized": lambda: ({"quantization_config": four_bit()}, {}),
    "sharded": lambda: ({}, {}),  # several processes with FSDP / ZeRO-3: faked below
    "lockstep_sampling": lambda: ({}, {"ds3_gather_for_generation": False}),  # with sharding, faked below
}


def build(tmp_path, monkeypatch, features):
    kwargs, overrides = {"train_dataset": numbered_prompts(6)}, {}
    for name in features:
        more_kwargs, more_overrides = RECIPES[name]()
        kwargs.update(more_kwargs)
        overrides.update(more_overrides)
    sharded = bool({"sharded", "lockstep_sampling"} & set(features))
    monkeypatch.setattr(grouprl.compat.trainer_parts, "sharded_weights", lambda: sharded)
    args = quiet_config(
        tmp_path, overrides, per_device_train_batch_size=3, max_completion_length=4, max_steps=1, bf16=False
    )
    return lambda model: GRPOTrainer(model, reward_funcs=distinct_tokens, args=args, **kwargs)


NOT_BUILT_PAIRS = [
    (a, b) for a, b in pairs(FEATURES, 2) if cell(a, b).status == NOT_BUILT and a in RECIPES and b in RECIPES
]


@pytest.mark.parametrize("a, b", NOT_BUILT_PAIRS)
def test_the_trainer_refuses_each_not_built_pair_before_loading_a_model(a, b, tmp_path, monkeypatch):
    make = build(tmp_path, monkeypatch, {a, b})
    with pytest.raises(UnsupportedCombination) as raised:
        make(str(tmp_path / "no-model-here"))  # refused before the model is looked for
    assert FEATURES[a] in str(raised.value) and FEATURES[b] in str(raised.value)


def test_a_sharded_quantized_policy_samples_in_step_and_a_replica_of_it_is_refused(
    tiny_model_dir, tmp_path, monkeypatch
):
    """FSDP / ZeRO-3 with a 4-bit policy: the unsharded replica would need its weights gathered dequantized, which is
    not built, so that sampling is refused naming the setting that samples from the sharded policy itself instead
    (tests/test_distributed.py trains both ways of a sharded QLoRA run: `*_qlora`, `*_lockstep_qlora`)."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, quantization_config=BitsAndBytesConfig(load_in_4bit=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(grouprl.generation.factory, "sharded_weights", lambda: True)
    args = quiet_config(tmp_path, {}, per_device_train_batch_size=3)
    with pytest.raises(ValueError, match="quantized policy.*ds3_gather_for_generation=False"):
        build_backend(model, tokenizer, [tokenizer.eos_token_id], args, max_num_seqs=8)
    args = quiet_config(tmp_path, {"ds3_gather_for_generation": False}, per_device_train_batch_size=3)
    backend = build_backend(model, tokenizer, [tokenizer.eos_token_id], args, max_num_seqs=8)
    assert isinstance(backend, TransformersGenerator) and backend.lockstep


def test_sampling_from_the_sharded_policy_runs_transformers_generate_in_step(tiny_model_dir, tmp_path, monkeypatch):
    """ds3_gather_for_generation=False under sharding: transformers generate with the processes in step ('auto'
    picks it); an engine that reads the weights directly is refused, naming both settings."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(grouprl.generation.factory, "sharded_weights", lambda: True)
    args = quiet_config(tmp_path, {"ds3_gather_for_generation": False}, per_device_train_batch_size=3)
    backend = build_backend(model, tokenizer, [tokenizer.eos_token_id], args, max_num_seqs=8)
    assert isinstance(backend, TransformersGenerator) and backend.lockstep
    for engine in ("engine", "captured"):
        args = quiet_config(
            tmp_path, {"ds3_gather_for_generation": False, "generation_engine": engine}, per_device_train_batch_size=3
        )
        with pytest.raises(ValueError, match=f"ds3_gather_for_generation=False .* generation_engine='{engine}'"):
            build_backend(model, tokenizer, [tokenizer.eos_token_id], args, max_num_seqs=8)
    args = quiet_config(tmp_path, {}, per_device_train_batch_size=3)
    backend = build_backend(model, tokenizer, [tokenizer.eos_token_id], args, max_num_seqs=8)
    assert isinstance(backend, ShardedPolicySampler)


def test_sampling_in_step_without_sharded_weights_is_named_as_changing_nothing(tiny_model_dir, tmp_path, caplog):
    args = quiet_config(
        tmp_path,
        {"ds3_gather_for_generation": False},
        max_steps=1,
        per_device_train_batch_size=3,
        max_completion_length=8,
    )
    with caplog.at_level(logging.WARNING, logger="grouprl"):
        trainer = GRPOTrainer(
            tiny_model_dir, reward_funcs=distinct_tokens, args=args, train_dataset=numbered_prompts(6)
        )
    assert "ds3_gather_for_generation=False changes nothing in this run" in caplog.text
    assert not getattr(trainer.generation_backend, "lockstep", False)


def test_gfpo_with_dynamic_sampling_is_refused(tiny_model_dir, tmp_path):
    args = GFPOConfig(
        output_dir=str(tmp_path),
        num_generations=3,
        num_remains_in_group=2,
        per_device_train_batch_size=3,
        max_steps=1,
        dynamic_sampling=True,
        report_to="none",
    )
    with pytest.raises(UnsupportedCombination, match=r"GFPO .* cannot be combined with dynamic_sampling=True"):
        GFPOTrainer(
            tiny_model_dir,
            distinct_tokens,
            args=args,
            train_dataset=numbered_prompts(6),
            group_filter_func=shortest_k_filter,
        )


CHEAP = {"in_process_sampling", "dynamic_sampling", "lora", "sync_ref_model"}
WORKING_PAIRS = [(a, b) for a, b in pairs(FEATURES, 2) if cell(a, b).status == WORKS and {a, b} <= CHEAP]


@pytest.mark.parametrize("a, b", WORKING_PAIRS)
def test_cheap_working_pairs_construct(a, b, tiny_model_dir, tmp_path, monkeypatch):
    trainer = build(tmp_path, monkeypatch, {a, b})(tiny_model_dir)
    for name in (a, b):  # each feature is really on
        assert {
            "dynamic_sampling": lambda: trainer.args.dynamic_sampling,
            "lora": lambda: hasattr(trainer.model, "peft_config"),
            "sync_ref_model": lambda: trainer.args.sync_ref_model and trainer.ref_model is not None,
            "in_process_sampling": lambda: trainer.generation_backend is not None,
        }[name](), name


def test_working_pairs_are_exercised():
    assert WORKING_PAIRS  # the walk above constructs at least one working pair
    expected = {frozenset(("dynamic_sampling", "in_process_sampling")), frozenset(("lora", "in_process_sampling"))}
    assert expected <= set(map(frozenset, WORKING_PAIRS))
