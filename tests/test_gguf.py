"""Training from a GGUF checkpoint: loaded dense, trained, saved as an ordinary transformers checkpoint.

The GGUF file is a tiny Llama this test writes itself with the `gguf` package (tests/gguf_files.py),
so nothing is downloaded.
"""

import importlib.util
import os

import datasets
import pytest
import torch
from gguf_files import write_tiny_gguf
from helpers import max_difference, parameters, quiet_config
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf")
    name, model = write_tiny_gguf(str(directory))
    return str(directory), name, model


def letter_count(completions, **kwargs):
    """Reward with signal on a random model: how many distinct characters a completion has."""
    return [float(len(set(c if isinstance(c, str) else c[0]["content"]))) for c in completions]


def prompts():
    return datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"add {i} and {i + 2}"}] for i in range(6)]}
    )


def config(tmp_path, **overrides):
    return quiet_config(
        tmp_path,
        overrides,
        per_device_train_batch_size=3,
        max_completion_length=8,
        max_steps=2,
        learning_rate=5e-2,
        beta=0.0,
        save_strategy="steps",
        save_steps=2,
    )


def test_gguf_directory_trains_and_saves_an_ordinary_checkpoint(gguf_dir, tmp_path):
    from grouprl import GRPOTrainer

    directory, name, original = gguf_dir
    args = config(tmp_path, model_init_kwargs={"gguf_file": name})
    trainer = GRPOTrainer(model=directory, reward_funcs=letter_count, args=args, train_dataset=prompts())
    # loaded dense and exactly as written (the GGUF's rotary reordering undone)
    assert max_difference(parameters(trainer.model), parameters(original)) == 0.0
    assert trainer.processing_class.eos_token == "<|im_end|>"  # the tokenizer came from the GGUF file too
    trainer.train()
    trained = parameters(trainer.model)
    assert max_difference(trained, parameters(original)) > 1e-4  # training changed the weights
    saved = str(tmp_path / "final")
    trainer.save_model(saved)
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")
    for path in (saved, checkpoint):
        assert not any(f.endswith(".gguf") for f in os.listdir(path))
        assert os.path.exists(os.path.join(path, "model.safetensors"))
        reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # no gguf_file
        assert (
            getattr(reloaded, "hf_quantizer", None) is None and "quantization_config" not in reloaded.config.to_dict()
        )
        assert max_difference(parameters(reloaded), trained) == 0.0
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template is not None


def test_gguf_loaded_instance_saves_as_ordinary_checkpoint(gguf_dir, tmp_path):
    """A model the user loaded from GGUF (as a TRL script would) also saves: transformers alone refuses it."""
    from grouprl import GRPOTrainer

    directory, name, _ = gguf_dir
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(str(tmp_path / "refused"))
    args = config(tmp_path, max_steps=1, save_strategy="no")
    trainer = GRPOTrainer(
        model=model, reward_funcs=letter_count, args=args, train_dataset=prompts(), processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32)
    assert max_difference(parameters(reloaded), parameters(trainer.model)) == 0.0


def test_cli_gguf_file_flag(gguf_dir, tmp_path):
    from grouprl.cli import main

    directory, name, _ = gguf_dir
    prompts().save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "out"
    code = main(
        [
            "train",
            "--model_name_or_path",
            directory,
            "--gguf_file",
            name,
            "--dataset_name",
            str(tmp_path / "data"),
            "--reward_funcs",
            "get_repetition_penalty_reward",
            "--output_dir",
            str(out),
            "--num_generations",
            "3",
            "--per_device_train_batch_size",
            "3",
            "--max_completion_length",
            "6",
            "--max_steps",
            "1",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert reloaded.config.vocab_size == 259


def test_missing_gguf_package_is_named(gguf_dir, tmp_path, monkeypatch):
    from grouprl import GRPOTrainer

    directory, name, _ = gguf_dir
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *a: None if module == "gguf" else real(module, *a))
    with pytest.raises(ImportError, match=r"model_init_kwargs\['gguf_file'\].*pip install gguf"):
        GRPOTrainer(
            model=directory,
            reward_funcs=letter_count,
            args=config(tmp_path, model_init_kwargs={"gguf_file": name}),
            train_dataset=prompts(),
        )


def test_packed_gguf_blocks_are_refused_by_name(gguf_dir, tmp_path):
    from transformers import GgufConfig

    from grouprl import GRPOTrainer

    directory, name, _ = gguf_dir
    kept_packed = GgufConfig(dequantize=False)
    with pytest.raises(ValueError, match="dequantize=False"):
        GRPOTrainer(
            model=directory,
            reward_funcs=letter_count,
            train_dataset=prompts(),
            args=config(tmp_path, model_init_kwargs={"gguf_file": name, "quantization_config": kept_packed}),
        )
