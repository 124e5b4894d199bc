"""Tests of the demo assets: tokenizer, arithmetic task/reward, tiny model recipe, committed checkpoint."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

try:  # run from a checkout without `pip install -e .`
    import grouprl  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.demo.evaluation import HELDOUT_SEED, greedy_accuracy, sampled_accuracy, stop_rate
from grouprl.demo.model import DEMO_MODEL_DIR, build_tiny_model, save_tiny_model, tiny_qwen2_config
from grouprl.demo.task import arithmetic_reward, make_arithmetic_dataset
from grouprl.demo.tokenizer import build_tokenizer

TRICKY_TEXT = "  12+7=19\n\nuser:  a\tb  \r\n<|im_start|>assistant\n 3 <|im_end|>\n<|endoftext|> é ∑  "


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def test_tokenizer_special_tokens_and_size() -> None:
    tok = build_tokenizer()
    assert tok.eos_token == "<|endoftext|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert len(set(ids)) == 3 and tok.unk_token_id not in ids
    assert 100 <= len(tok) <= 400
    # Special tokens are single ids, role names are merged, digits stay single characters.
    assert tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"] == [
        ids[1],
        tok.convert_tokens_to_ids("user"),
        ord("\n"),
    ]
    assert tok("12+7=", add_special_tokens=False)["input_ids"] == [ord(c) for c in "12+7="]


def test_tokenizer_is_deterministic() -> None:
    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert a(TRICKY_TEXT)["input_ids"] == b(TRICKY_TEXT)["input_ids"]


def test_tokenizer_roundtrip_in_memory() -> None:
    tok = build_tokenizer()
    ids = tok(TRICKY_TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TRICKY_TEXT
    assert (
        tok.decode(tok("a  b\n\n c", add_special_tokens=False)["input_ids"], skip_special_tokens=True) == "a  b\n\n c"
    )


def test_tokenizer_roundtrip_after_reload_from_qwen2_dir(tiny_dir: str) -> None:
    # The dir holds a qwen2 config.json, so AutoTokenizer may rebuild the tokenizer with Qwen2's own
    # pre-tokenizer: ids and decoding must still match the in-memory tokenizer exactly.
    assert (Path(tiny_dir) / "config.json").exists()
    reloaded, original = AutoTokenizer.from_pretrained(tiny_dir), build_tokenizer()
    ids = reloaded(TRICKY_TEXT, add_special_tokens=False)["input_ids"]
    assert ids == original(TRICKY_TEXT, add_special_tokens=False)["input_ids"]
    assert reloaded.decode(ids) == TRICKY_TEXT
    assert reloaded.get_vocab() == original.get_vocab()
    assert reloaded.eos_token == reloaded.pad_token == "<|endoftext|>"
    assert reloaded.chat_template == original.chat_template


def test_chat_template_renders_chatml(tiny_dir: str) -> None:
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+7="}]
    for tok in (build_tokenizer(), AutoTokenizer.from_pretrained(tiny_dir)):
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
            "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
        )
        full = messages + [{"role": "assistant", "content": "19"}]
        assert tok.apply_chat_template(full, tokenize=False) == (
            "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n12+7=<|im_end|>\n"
            "<|im_start|>assistant\n19<|im_end|>\n"
        )
        assert tok.apply_chat_template(full, continue_final_message=True, tokenize=False) == (
            "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n19"
        )


# --------------------------------------------------------------------------------------------------
# Task and reward
# --------------------------------------------------------------------------------------------------


def test_arithmetic_reward_standard() -> None:
    completions = ["19", " 19<|endoftext|>", "19 is the answer", "18", "-19", "nineteen", "", "1 9", "190"]
    answers = ["19"] * len(completions)
    assert arithmetic_reward(completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_arithmetic_reward_conversational_and_extra_kwargs() -> None:
    completions = [
        [{"role": "assistant", "content": "7"}],
        [{"role": "assistant", "content": "8"}],
        [{"role": "assistant", "content": "x7"}],
    ]
    rewards = arithmetic_reward(
        completions,
        answer=["7", "7", "7"],
        prompts=[[{"role": "user", "content": "3+4="}]] * 3,
        completion_ids=[[55], [56], [120, 55]],
        trainer_state=None,
    )
    assert rewards == [1.0, 0.0, 0.0]
    assert arithmetic_reward(["0", "5"], answer=[0, "5"]) == [1.0, 1.0]  # int answers are fine too


def test_arithmetic_reward_is_a_plain_picklable_function() -> None:
    assert arithmetic_reward.__name__ == "arithmetic_reward"
    assert pickle.loads(pickle.dumps(arithmetic_reward)) is arithmetic_reward


@pytest.mark.parametrize("conversational", [False, True])
def test_make_arithmetic_dataset(conversational: bool) -> None:
    ds = make_arithmetic_dataset(50, seed=3, conversational=conversational)
    assert len(ds) == 50 and set(ds.column_names) == {"prompt", "answer"}
    assert ds.to_list() == make_arithmetic_dataset(50, seed=3, conversational=conversational).to_list()
    assert ds["prompt"] != make_arithmetic_dataset(50, seed=4, conversational=conversational)["prompt"]
    for prompt, answer in zip(ds["prompt"], ds["answer"]):
        if conversational:
            assert isinstance(prompt, list) and len(prompt) == 1 and prompt[0]["role"] == "user"
            text = prompt[0]["content"]
        else:
            text = prompt
        assert isinstance(text, str) and isinstance(answer, str) and text.endswith("=")
        a, b = text[:-1].split("+")
        assert 0 <= int(a) <= 49 and 0 <= int(b) <= 49
        assert int(answer) == int(a) + int(b)
    # The reward accepts the dataset's own answers.
    assert arithmetic_reward(ds["answer"], ds["answer"]) == [1.0] * 50


# --------------------------------------------------------------------------------------------------
# Tiny model recipe
# --------------------------------------------------------------------------------------------------


def test_tiny_config_and_model_are_deterministic() -> None:
    tok = build_tokenizer()
    config = tiny_qwen2_config(tok)
    assert config.model_type == "qwen2"
    assert config.vocab_size == len(tok)
    assert config.eos_token_id == config.pad_token_id == tok.eos_token_id
    m1, m2 = build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=0)
    assert m1.dtype == torch.float32
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    m3 = build_tiny_model(tok, seed=1, hidden_size=32)
    assert m3.config.hidden_size == 32


def test_save_tiny_model_loads_and_generates(tiny_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen2"
    assert sorted(model.generation_config.eos_token_id) == sorted(
        tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    )
    enc = tok(["1+2=", "12+30="], return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 2 and enc["input_ids"].shape[1] < out.shape[1] <= enc["input_ids"].shape[1] + 4


# --------------------------------------------------------------------------------------------------
# Committed checkpoint
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_model() -> tuple[torch.nn.Module, object]:
    assert (DEMO_MODEL_DIR / "model.safetensors").exists(), "run `python -m grouprl.demo.pretrain --regenerate`"
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR), AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def test_demo_checkpoint_is_small() -> None:
    size = sum(f.stat().st_size for f in DEMO_MODEL_DIR.iterdir() if f.is_file())
    assert size < 3 * 1024 * 1024


@pytest.mark.parametrize("conversational", [False, True])
def test_demo_checkpoint_learned_format_but_not_the_task(demo_model, conversational: bool) -> None:
    # Pretrained on noisy answers: it answers with a number and stops, and samples (temperature 1)
    # the right sum often but far from always, which leaves room for GRPO to improve it.
    model, tok = demo_model
    data = make_arithmetic_dataset(64, seed=HELDOUT_SEED, conversational=conversational)
    acc = sampled_accuracy(model, tok, data, num_samples=4, temperature=1.0, seed=0)
    assert 0.1 <= acc <= 0.75
    assert stop_rate(model, tok, data, seed=0) >= 0.95
    assert greedy_accuracy(model, tok, data) >= acc  # the correct sum is the mode of its answers
