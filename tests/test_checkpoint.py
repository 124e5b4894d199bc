"""Crash-safe checkpoints: SIGKILL in the middle of a save, then an exact resume; rotation; leftovers."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from checkpoint_run import make_trainer
from helpers import max_difference, parameters
from transformers import AutoModelForCausalLM, TrainerState

import grouprl
from grouprl.train import checkpoint
from grouprl.train.checkpoint import latest_checkpoint, list_checkpoints, resolve_resume_path, save_checkpoint

TESTS = os.path.dirname(os.path.abspath(__file__))


def saved_weights(path):
    return parameters(AutoModelForCausalLM.from_pretrained(path))


@pytest.mark.e2e
def test_sigkill_while_saving_then_resume_equals_uninterrupted_run(tiny_model_dir, tmp_path):
    full = make_trainer(tiny_model_dir, tmp_path / "full")
    full.train()

    out = tmp_path / "killed"
    source = os.path.dirname(os.path.dirname(os.path.abspath(grouprl.__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([TESTS, source, os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }  # same threads, same floating-point sums as this process
    child = subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "train_until_killed.py"), str(tiny_model_dir), str(out), "4"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 120
    while not (out / "saving").exists():  # the child is inside checkpoint-4's save, weights written, the rest not yet
        if child.poll() is not None or time.time() > deadline:
            child.kill()
            pytest.fail(
                f"the training subprocess never reached the save of step 4:\n{child.communicate()[0].decode()[-3000:]}"
            )
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL
    # the killed run's lock stays behind; the resumed run takes it over (its process is gone)
    assert sorted(os.listdir(out)) == [
        ".grouprl-run.lock",
        ".tmp-checkpoint-4",
        "checkpoint-2",
        "metrics.jsonl",
        "saving",
    ]
    assert os.path.exists(out / ".tmp-checkpoint-4" / "model.safetensors")  # killed half-way through the save
    assert latest_checkpoint(str(out)) == str(out / "checkpoint-2")  # the previous checkpoint is the one to resume

    resumed = make_trainer(tiny_model_dir, out)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert max_difference(parameters(full.model), parameters(resumed.model)) == 0.0
    assert max_difference(saved_weights(tmp_path / "full" / "checkpoint-4"), saved_weights(out / "checkpoint-4")) == 0.0
    assert not [name for name in os.listdir(out) if name.startswith(".")]  # the killed save's leftovers are gone


class TinyModel(torch.nn.Linear):
    def save_pretrained(self, path, **kwargs):
        torch.save(self.state_dict(), os.path.join(path, "model.pt"))


def tiny_state():
    model = TinyModel(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return dict(
        model=model,
        tokenizer=None,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=TrainerState(),
        loop_state={},
    )


def steps_of(output_dir):
    return [int(path.rsplit("-", 1)[1]) for path in list_checkpoints(str(output_dir))]


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path, caplog):
    parts = tiny_state()
    for step in (2, 4, 6):
        save_checkpoint(str(tmp_path), step, **parts, save_total_limit=2)
    assert steps_of(tmp_path) == [4, 6]
    # resumed from an older checkpoint: the new checkpoint-3 is kept although higher steps exist
    save_checkpoint(str(tmp_path), 3, **parts, save_total_limit=2)
    assert steps_of(tmp_path) == [3, 6]
    assert "checkpoint-6 has a higher step than the checkpoint-3 just written" in caplog.text
    save_checkpoint(str(tmp_path), 5, **parts, save_total_limit=1)
    assert steps_of(tmp_path) == [5]


def test_kill_while_deleting_an_old_checkpoint_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    parts = tiny_state()
    save_checkpoint(str(tmp_path), 2, **parts)
    real_rmtree = checkpoint.shutil.rmtree

    def dies_mid_delete(path, *args, **kwargs):
        if os.path.basename(path).startswith(checkpoint.DELETING_PREFIX):
            os.remove(
                os.path.join(path, checkpoint.TRAINING_STATE)
            )  # part of the files are gone, then the process dies
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", dies_mid_delete)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 4, **parts, save_total_limit=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert steps_of(tmp_path) == [4]  # the half-deleted checkpoint-2 is not a checkpoint any more
    assert resolve_resume_path(True, str(tmp_path)) == str(tmp_path / "checkpoint-4")
    save_checkpoint(str(tmp_path), 6, **parts, save_total_limit=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-6"]  # leftovers removed by the next save


def test_incomplete_directories_are_not_checkpoints(tmp_path):
    save_checkpoint(str(tmp_path), 2, **tiny_state())
    os.makedirs(tmp_path / "checkpoint-8")  # no completion marker (copied half-way, or another tool's)
    assert resolve_resume_path(True, str(tmp_path)) == str(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match="checkpoint-8' is not a complete grouprl checkpoint"):
        resolve_resume_path(str(tmp_path / "checkpoint-8"), str(tmp_path))


def truncate(path):
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


def test_a_damaged_checkpoint_is_named_and_resume_true_falls_back_to_the_previous_one(tiny_model_dir, tmp_path, caplog):
    out = tmp_path / "run"
    make_trainer(tiny_model_dir, out, max_steps=4).train()  # checkpoint-2 and checkpoint-4
    newest = out / "checkpoint-4"
    truncate(newest / checkpoint.TRAINING_STATE)  # a copy cut short / a full disk

    # named: the checkpoint and the file, with what to do, before anything is loaded
    with pytest.raises(checkpoint.UnreadableCheckpoint) as caught:
        make_trainer(tiny_model_dir, out, max_steps=4).train(resume_from_checkpoint=str(newest))
    message = str(caught.value)
    assert f"Checkpoint {newest} cannot be loaded: its file training_state.pt cannot be read" in message
    assert "Resume from an earlier checkpoint" in message and "restore the file" in message
    with pytest.raises(checkpoint.UnreadableCheckpoint, match="training_state.pt"):
        checkpoint.load_training_state(str(newest))  # the loader itself names the file too

    # resume_from_checkpoint=True: the damaged newest one is skipped with a warning, the previous one is used
    resumed = make_trainer(tiny_model_dir, out, max_steps=4)
    resumed.train(resume_from_checkpoint=True)
    assert f"skipping {newest}: its file training_state.pt cannot be read" in caplog.text
    assert f"Resumed from {out / 'checkpoint-2'} at step 2" in caplog.text
    assert resumed.state.global_step == 4

    # a damaged weights file is named the same way; with nothing readable left, True says so
    truncate(out / "checkpoint-4" / "model.safetensors")
    truncate(out / "checkpoint-2" / checkpoint.LOOP_STATE)
    with pytest.raises(
        checkpoint.UnreadableCheckpoint, match=r"checkpoint-4 cannot be loaded: its file model\.safetensors"
    ):
        resolve_resume_path(str(out / "checkpoint-4"), str(out))
    with pytest.raises(ValueError, match=r"no checkpoint in .* can be read: .*checkpoint-4 \(model\.safetensors.*"):
        resolve_resume_path(True, str(out))


def _moved_class_values():
    from grouprl.core.types import GroupLayout
    from grouprl.data.prompt_sampler import GenerationInputs

    return [
        ("grouprl.data.generation_inputs", GenerationInputs, lambda: GenerationInputs([{"prompt": "1+1="}])),
        ("grouprl.core.group_layout", GroupLayout, lambda: GroupLayout.uncut([[2, 3]])),
    ]


@pytest.mark.parametrize("index", [0, 1])
def test_a_checkpoint_naming_a_class_by_its_former_module_still_loads(tmp_path, monkeypatch, index):
    """loop_state.pt pickles classes by module path; one written before GenerationInputs and GroupLayout moved
    (modules merged by job) loads into today's classes."""
    import types

    from grouprl.train.checkpoint_files import MOVED_MODULES, load_pickle

    old, cls, make = _moved_class_values()[index]
    assert MOVED_MODULES[old] == cls.__module__
    value = make()
    former = types.ModuleType(old)
    setattr(former, cls.__name__, cls)
    with monkeypatch.context() as patch:  # pickle the class as an earlier grouprl named it
        patch.setitem(sys.modules, old, former)
        patch.setattr(cls, "__module__", old)
        torch.save({"inputs": value}, tmp_path / "loop_state.pt")
    assert old.encode() in (tmp_path / "loop_state.pt").read_bytes()
    loaded = load_pickle(str(tmp_path / "loop_state.pt"))["inputs"]
    assert type(loaded) is cls and loaded == value


def test_resuming_another_models_or_plans_checkpoint_says_what_differs(tiny_model_dir, tmp_path, caplog):
    """Another model's checkpoint: one error naming the shape that differs, not state-dict size mismatches; another
    batch plan: an error naming the fields; a changed schedule field: resumed, and the change logged."""
    from grouprl.demo.model import save_tiny_model

    make_trainer(tiny_model_dir, tmp_path / "run", max_steps=2).train()
    checkpoint_2 = str(tmp_path / "run" / "checkpoint-2")
    wider = save_tiny_model(tmp_path / "wider", seed=0, num_hidden_layers=3)
    with pytest.raises(
        ValueError, match=r"another model than this run's \(num_hidden_layers 2 in the checkpoint, 3 here"
    ):
        make_trainer(wider, tmp_path / "run", max_steps=4).train(resume_from_checkpoint=checkpoint_2)
    with pytest.raises(ValueError, match=r"another batch plan \(per_device_train_batch_size 3 -> 6, "):
        make_trainer(tiny_model_dir, tmp_path / "run", max_steps=4, per_device_train_batch_size=6).train(
            resume_from_checkpoint=checkpoint_2
        )
    with caplog.at_level("WARNING", logger="grouprl"):
        resumed = make_trainer(tiny_model_dir, tmp_path / "run", max_steps=4, learning_rate=0.05).train(
            resume_from_checkpoint=checkpoint_2
        )
    assert resumed.global_step == 4
    assert "with changed settings: max_steps 2 -> 4, learning_rate 0.1 -> 0.05" in caplog.text
