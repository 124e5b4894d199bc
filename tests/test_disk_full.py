"""A full disk or a read-only file system mid-run (train/checkpoint.py, core/metrics.py): a checkpoint or model that
does not fit is removed whole and named with the space needed and free, the last complete checkpoint is kept and
named, save_failure='continue' trains on, and metrics.jsonl never ends in half a line. On a small tmpfs where this
process may mount one (root), else only the part that needs no mount."""

import json
import os
import subprocess

import datasets
import pytest
import torch
from transformers import TrainerCallback

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.train import checkpoint
from grouprl.train.checkpoint import SaveFailed


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


PROMPTS = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(12)]})


def make_trainer(model_dir, output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=6,
        learning_rate=0.1,
        max_steps=3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return GRPOTrainer(model_dir, reward_funcs=distinct_tokens, args=GRPOConfig(**values), train_dataset=PROMPTS)


def tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.fixture
def small_disk(tmp_path):
    """mount(size_bytes) -> a directory on a tmpfs of that size (unmounted after the test)."""
    mounted = []

    def mount(size_bytes):
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"mounting a small tmpfs needs root (or CAP_SYS_ADMIN): {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="module")
def checkpoint_bytes(tiny_model_dir, tmp_path_factory):
    """How much one checkpoint of the tiny run takes (measured, not guessed)."""
    out = tmp_path_factory.mktemp("measure")
    make_trainer(tiny_model_dir, out, max_steps=1).train()
    return tree_bytes(out / "checkpoint-1")


def no_partial_files(path):
    return not [n for n in os.listdir(path) if n.startswith((".tmp-", ".deleting-"))]


def test_a_failing_write_removes_the_partial_checkpoint_and_names_the_file(tiny_model_dir, tmp_path, monkeypatch):
    """No mount needed: torch.save fails on loop_state.pt as torch's zip writer does on a full disk."""
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if str(f).endswith(checkpoint.LOOP_STATE) and "checkpoint-2" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1263040 vs 1262932")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    trainer = make_trainer(tiny_model_dir, tmp_path)
    with pytest.raises(SaveFailed) as failed:
        trainer.train()
    message = str(failed.value)
    assert message.startswith("Writing checkpoint-2 failed at loop_state.pt (RuntimeError: [enforce fail")
    assert "MiB is free" in message and f"the last complete checkpoint is {tmp_path / 'checkpoint-1'}" in message
    assert sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n) == ["checkpoint-1"]
    assert no_partial_files(tmp_path)


def test_a_first_checkpoint_that_does_not_fit_stops_with_the_space_named(tiny_model_dir, small_disk, checkpoint_bytes):
    disk = small_disk(checkpoint_bytes // 2)
    with pytest.raises(SaveFailed, match=r"Writing checkpoint-1 failed at .*no complete checkpoint exists yet"):
        make_trainer(tiny_model_dir, disk).train()
    assert no_partial_files(disk) and not [n for n in os.listdir(disk) if n.startswith("checkpoint-")]
    assert [json.loads(line)["step"] for line in (disk / "metrics.jsonl").read_text().splitlines()] == [1]


def test_save_failure_continue_trains_on_and_keeps_the_checkpoint_that_fit(
    tiny_model_dir, small_disk, checkpoint_bytes, caplog
):
    disk = small_disk(int(checkpoint_bytes * 1.6))
    with caplog.at_level("WARNING", logger="grouprl"):
        result = make_trainer(tiny_model_dir, disk, save_failure="continue").train()
    assert result.global_step == 3
    assert "Writing checkpoint-2 failed" in caplog.text and "Training goes on (save_failure='continue')" in caplog.text
    assert sorted(n for n in os.listdir(disk) if n.startswith("checkpoint-")) == ["checkpoint-1"]
    assert os.path.exists(disk / "checkpoint-1" / checkpoint.COMPLETE_MARKER) and no_partial_files(disk)
    assert [json.loads(line).get("step") for line in (disk / "metrics.jsonl").read_text().splitlines()][:3] == [1, 2, 3]


def test_save_model_on_a_full_disk_leaves_no_half_model(tiny_model_dir, small_disk, tmp_path, checkpoint_bytes):
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=1, save_strategy="no")
    trainer.train()
    disk = small_disk(checkpoint_bytes // 8)
    with pytest.raises(SaveFailed, match=r"Writing the model failed at the model's weights .*MiB is free"):
        trainer.save_model(str(disk / "model"))
    assert os.listdir(disk / "model") == []  # no config.json without weights


def test_a_read_only_file_system_mid_run_is_named_and_the_log_stays_whole(tiny_model_dir, small_disk):
    disk = small_disk(64 * 2**20)

    class RemountReadOnly(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)

    trainer = make_trainer(tiny_model_dir, disk, save_strategy="no")
    trainer.add_callback(RemountReadOnly())
    with pytest.raises(OSError, match=r"Writing a log entry to .*metrics.jsonl failed \(Read-only file system\)"):
        trainer.train()
    assert [json.loads(line)["step"] for line in (disk / "metrics.jsonl").read_text().splitlines()] == [1]
