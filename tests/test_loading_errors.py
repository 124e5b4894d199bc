"""Mistakes in what the trainer loads are named by their real cause: a model directory without tokenizer files, a
local model path that does not exist, an output_dir that cannot be written."""

import os
import shutil

import datasets
import pytest

from grouprl import GRPOConfig, GRPOTrainer


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def build(model, output_dir, **kwargs):
    args = GRPOConfig(
        output_dir=str(output_dir),
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=4,
        max_steps=1,
        report_to="none",
        bf16=False,
    )
    prompts = datasets.Dataset.from_dict({"prompt": ["13+32=", "1+1="]})
    return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts, **kwargs)


def test_a_model_directory_without_tokenizer_files_is_named(tiny_model_dir, tmp_path):
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_model_dir, name), bare / name)
    # transformers 5 builds an empty tokenizer from it without an error; every prompt would tokenize to nothing
    with pytest.raises(ValueError) as caught:
        build(str(bare), tmp_path / "out")
    message = str(caught.value)
    assert f"The tokenizer loaded from {str(bare)!r} is empty" in message
    assert f"{str(bare)!r} has no tokenizer files" in message
    assert "processing_class=AutoTokenizer.from_pretrained(" in message and "tokenizer.save_pretrained" in message
    from transformers import AutoTokenizer

    trainer = build(str(bare), tmp_path / "out", processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    assert trainer.processing_class("13+32=")["input_ids"]  # what the message says to do works


def test_a_local_model_path_that_does_not_exist_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError) as caught:
        build("./no/such/dir", tmp_path / "out")
    message = str(caught.value)
    assert f"The model path './no/such/dir' looks like a local directory, but {tmp_path / 'no/such/dir'}" in message
    assert "does not exist (HF_HUB_OFFLINE is set, so the Hub is not reachable either)" in message
    assert "Check the path" in message and "owner/name" in message
    assert "repo id" not in message.lower()
    # owner/name could be a Hub id: when its first part is a local directory, the failure says a local one was meant
    (tmp_path / "models").mkdir()
    with pytest.raises(OSError, match=r"there is no local directory .*models/tiny-qwn \(the directory 'models' exists"):
        build("models/tiny-qwn", tmp_path / "out")


def test_an_output_dir_that_cannot_be_written_is_named_before_the_model_loads(tmp_path, monkeypatch):
    taken = tmp_path / "results"
    taken.write_text("an earlier run's log\n")
    # the model path does not exist either: output_dir is checked first, before any model loads
    with pytest.raises(ValueError) as caught:
        build("./no/such/model", taken)
    assert str(caught.value) == (
        f"GRPOConfig.output_dir={str(taken)!r} is a file, not a directory: checkpoints, metrics.jsonl and the model "
        f"are written into a directory at that path. Choose another output_dir, or move the file {taken} away."
    )
    with pytest.raises(ValueError, match=rf"output_dir=.*cannot be created: {taken} is a file, not a directory"):
        build("./no/such/model", taken / "run-1")
    # a read-only parent (as root, permissions do not stop writes, so the answer of os.access is simulated)
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path))
    with pytest.raises(ValueError, match=rf"cannot be created: its parent directory {tmp_path} is not writable"):
        build("./no/such/model", tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()  # the check creates nothing
