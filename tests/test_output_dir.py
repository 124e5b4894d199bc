"""An output_dir belongs to one run (train/output_dir.py): the lock against a second live run, a dead run's lock taken
over, and an earlier run's record and checkpoints set aside so a new run never overwrites them or resumes them."""

import json
import os
import socket
import subprocess
import sys
import time

import datasets
import pytest

from grouprl import GRPOConfig, GRPOTrainer, OutputDirInUse
from grouprl.train import output_dir
from grouprl.train.output_dir import LOCK, RunLock


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def make_config(path, **overrides):
    values = dict(
        output_dir=str(path),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=6,
        learning_rate=0.1,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return GRPOConfig(**values)


PROMPTS = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(12)]})


def write_lock(path, host, pid, age_s=0.0):
    lock = path / LOCK
    lock.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-12-01 10:00:00"}))
    touched = time.time() - age_s
    os.utime(lock, (touched, touched))


@pytest.fixture
def live_process():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield sleeper.pid
    sleeper.kill()
    sleeper.wait()


def dead_pid():
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    return finished.pid


def test_a_live_run_on_this_host_holds_the_directory(tmp_path, live_process):
    write_lock(tmp_path, socket.gethostname(), live_process)
    with pytest.raises(OutputDirInUse, match=rf"in use by a run still going: process {live_process} on .*another"):
        RunLock(str(tmp_path)).acquire()


def test_a_dead_runs_lock_is_taken_over_with_a_warning_and_released_at_the_end(tmp_path, caplog):
    pid = dead_pid()
    write_lock(tmp_path, socket.gethostname(), pid)
    lock = RunLock(str(tmp_path))
    with caplog.at_level("WARNING", logger="grouprl"):
        lock.acquire()
    assert f"locked by a run that is gone (process {pid}" in caplog.text
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_another_hosts_lock_counts_while_it_is_touched(tmp_path, monkeypatch):
    write_lock(tmp_path, "other-host", 1, age_s=10)
    with pytest.raises(OutputDirInUse, match="process 1 on other-host"):
        RunLock(str(tmp_path)).acquire()
    write_lock(tmp_path, "other-host", 1, age_s=output_dir.STALE_AFTER_S + 1)
    lock = RunLock(str(tmp_path))
    lock.acquire()
    lock.release()


def test_the_holder_keeps_its_lock_fresh_and_releases_only_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(output_dir, "REFRESH_S", 0.05)
    lock = RunLock(str(tmp_path))
    lock.acquire()
    stale = time.time() - 1000
    os.utime(tmp_path / LOCK, (stale, stale))
    time.sleep(0.3)
    assert time.time() - os.path.getmtime(tmp_path / LOCK) < 5  # touched again by the holder's thread
    write_lock(tmp_path, "other-host", 7)  # taken over meanwhile (the holder was thought dead): not ours to remove
    lock.release()
    assert json.loads((tmp_path / LOCK).read_text())["host"] == "other-host"


def test_train_refuses_a_directory_a_live_run_holds_and_writes_nothing(tiny_model_dir, tmp_path, live_process):
    write_lock(tmp_path, socket.gethostname(), live_process)
    trainer = GRPOTrainer(
        tiny_model_dir, reward_funcs=distinct_tokens, args=make_config(tmp_path), train_dataset=PROMPTS
    )
    with pytest.raises(OutputDirInUse):
        trainer.train()
    assert sorted(os.listdir(tmp_path)) == [LOCK]


def test_a_new_run_sets_the_earlier_runs_checkpoints_aside_and_resumes_its_own(tiny_model_dir, tmp_path, caplog):
    """Run A leaves checkpoints 2 and 4; a fresh run B (2 steps) into the same directory moves A's record and
    checkpoints to previous_runs/run-1 (nothing overwritten) and writes its own checkpoint-2; a later automatic resume
    continues B's checkpoint, not A's later one; the lock is gone after each run."""
    train = lambda steps, **kw: GRPOTrainer(  # noqa: E731
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=steps, save_strategy="steps", save_steps=2),
        train_dataset=PROMPTS,
    ).train(**kw)
    train(4)
    earlier = {n: (tmp_path / n / "trainer_state.json").read_text() for n in ("checkpoint-2", "checkpoint-4")}
    with caplog.at_level("WARNING", logger="grouprl"):
        train(2)
    moved = tmp_path / "previous_runs" / "run-1"
    assert f"moved to {moved}" in caplog.text
    assert sorted(os.listdir(moved)) == ["checkpoint-2", "checkpoint-4", "metrics.jsonl"]
    assert {n: (moved / n / "trainer_state.json").read_text() for n in earlier} == earlier
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == ["checkpoint-2"]
    resumed = train(3, resume_from_checkpoint=True)
    assert resumed.global_step == 3
    steps = [json.loads(line).get("step") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s is not None][:3] == [1, 2, 3]  # B's record, continued
    assert not (tmp_path / LOCK).exists()


def test_evaluate_then_train_sets_the_earlier_run_aside_in_one_place(tiny_model_dir, tmp_path):
    GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, save_strategy="steps", save_steps=2),
        train_dataset=PROMPTS,
    ).train()
    trainer = GRPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=1, eval_strategy="no", per_device_eval_batch_size=6),
        train_dataset=PROMPTS,
        eval_dataset=PROMPTS.select(range(2)),
    )
    trainer.evaluate()
    assert (tmp_path / "checkpoint-2").is_dir()  # evaluation alone leaves the checkpoints for a resume
    trainer.train()
    assert sorted(os.listdir(tmp_path / "previous_runs")) == ["run-1"]
    assert sorted(os.listdir(tmp_path / "previous_runs" / "run-1")) == ["checkpoint-2", "metrics.jsonl"]
