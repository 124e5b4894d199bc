"""Ctrl-C and SIGTERM, sent for real to training processes: the step in flight finishes, a checkpoint is written,
the resume command is printed, the process exits with 128 + the signal (train/stop_signals.py); a second Ctrl-C
stops at once. On 1 process and on 2 (accelerate launch, the signal sent to the launcher)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from checkpoint_run import make_trainer
from conftest import free_port
from helpers import max_difference, parameters

import grouprl
from grouprl.launch import resolve_accelerate_config
from grouprl.train.checkpoint import COMPLETE_MARKER, list_checkpoints

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS, "train_until_signalled.py")


def environment() -> dict:
    source = os.path.dirname(os.path.dirname(os.path.abspath(grouprl.__file__)))
    path = os.pathsep.join([TESTS, source, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def logged_steps(out) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


def start_and_wait(command: list[str], out, steps: int = 3) -> subprocess.Popen:
    child = subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while logged_steps(out) < steps:
        if child.poll() is not None or time.time() > deadline:
            child.kill()
            pytest.fail(f"the run never logged {steps} steps:\n{child.communicate()[0][-3000:]}")
        time.sleep(0.05)
    return child


@pytest.mark.e2e
@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_checkpoints_then_exits_and_the_run_resumes_exactly(tiny_model_dir, tmp_path, number):
    out = tmp_path / "signalled"
    child = start_and_wait([sys.executable, SCRIPT, str(tiny_model_dir), str(out)], out)
    child.send_signal(number)
    output = child.communicate(timeout=120)[0]
    assert child.returncode == 128 + number, output[-3000:]
    checkpoints = list_checkpoints(str(out))
    assert len(checkpoints) == 1, output[-3000:]  # the one the signal wrote (no scheduled one in 10,000 steps)
    step = int(checkpoints[0].rsplit("-", 1)[1])
    assert step >= 3 and logged_steps(out) == step  # the step in flight finished and was logged
    name = signal.Signals(number).name
    assert f"{name} received: finishing step" in output
    assert f"stopped by {name} after step {step}; the run is saved in {checkpoints[0]}" in output
    assert "resume_from_checkpoint" in output and "Traceback" not in output

    resumed = make_trainer(tiny_model_dir, out, max_steps=step + 2, save_steps=10_000, lr_scheduler_type="constant")
    resumed.train(resume_from_checkpoint=True)
    uninterrupted = make_trainer(
        tiny_model_dir, tmp_path / "full", max_steps=step + 2, save_steps=10_000, lr_scheduler_type="constant"
    )
    uninterrupted.train()
    assert resumed.state.global_step == step + 2
    assert max_difference(parameters(resumed.model), parameters(uninterrupted.model)) == 0.0


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["--linger", "--hang"], ids=["while_stopping", "in_a_hung_reward"])
def test_a_second_ctrl_c_stops_at_once_with_the_last_completed_step_saved(tiny_model_dir, tmp_path, where):
    """The first Ctrl-C cannot finish a step whose reward hangs; the second stops at once and saves the last step
    that completed (the state kept at the hung step's start), which resumes."""
    out = tmp_path / "aborted"
    child = start_and_wait([sys.executable, SCRIPT, str(tiny_model_dir), str(out), where], out)
    child.send_signal(signal.SIGINT)
    before = []  # the second Ctrl-C goes once the first one is announced: the run is stopping then
    for line in child.stdout:
        before.append(line)
        if "SIGINT received: finishing step" in line:
            break
    child.send_signal(signal.SIGINT)
    output = "".join(before) + child.communicate(timeout=60)[0]
    assert child.returncode == 130, output[-3000:]  # whether torch._dynamo was imported by then or not (loop.train)
    assert "grouprl: a second Ctrl-C: stopped at once, in the middle of the step. The last good state" in output
    checkpoints = list_checkpoints(str(out))
    assert len(checkpoints) == 1, output[-3000:]
    if where == "--hang":
        assert checkpoints[0].endswith("checkpoint-3"), output[-3000:]  # step 4 never completed
    resumed = make_trainer(tiny_model_dir, out, max_steps=int(checkpoints[0].rsplit("-", 1)[1]) + 1)
    resumed.train(resume_from_checkpoint=checkpoints[0])


@pytest.mark.e2e
def test_sigterm_to_a_two_process_launch_checkpoints_every_process(tiny_model_dir, tmp_path):
    """The launcher forwards SIGTERM to both processes; they agree on the step (the signal is reduced with the
    step's statistics), and the checkpoint holds both processes' state."""
    out = tmp_path / "two"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    launcher += [
        resolve_accelerate_config("multi_gpu"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
    ]
    child = start_and_wait([*launcher, SCRIPT, str(tiny_model_dir), str(out)], out)
    child.send_signal(signal.SIGTERM)
    output = child.communicate(timeout=120)[0]
    checkpoints = list_checkpoints(str(out))
    assert len(checkpoints) == 1, output[-5000:]
    assert os.path.exists(os.path.join(checkpoints[0], COMPLETE_MARKER))
    loop_state = torch.load(os.path.join(checkpoints[0], "loop_state.pt"), weights_only=False)
    assert len(loop_state["processes"]) == 2
    step = int(checkpoints[0].rsplit("-", 1)[1])
    assert f"stopped by SIGTERM after step {step}" in output
    trainer_state = json.loads(open(os.path.join(checkpoints[0], "trainer_state.json")).read())
    assert trainer_state["global_step"] == step
