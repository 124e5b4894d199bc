"""Asynchronous training loses nothing: a run killed with SIGKILL resumes from its checkpoint and trains on exactly
the prompts of an uninterrupted run, step for step; a killed worker is restarted once, a second death stops the
run with an error naming the worker and its exit code (never a hang)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS, "async_run.py")


def run(model_dir, out, *options, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, SCRIPT, str(model_dir), str(out), *options],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def trained_prompts(out):
    """step -> the prompts trained on at that step (a step re-run after a resume counts once: its last record)."""
    steps = {}
    for line in open(os.path.join(out, "trained.jsonl")):
        entry = json.loads(line)
        steps[entry["step"]] = entry["idx"]
    return steps


def process_shares(out):
    """([step -> prompts] of process 0, of process 1), and step -> the prompts of both together, of a 2-process run."""
    shares = [trained_prompts(out), {}]
    for line in open(os.path.join(out, "trained-1.jsonl")):
        entry = json.loads(line)
        shares[1][entry["step"]] = entry["idx"]
    return shares, {step: sorted(set(shares[0][step]) | set(shares[1][step])) for step in shares[0]}


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """step -> prompts of the run that nothing interrupts: what every interrupted run must train on (one run for
    the module's tests)."""
    whole = tmp_path_factory.mktemp("uninterrupted")
    finished = run(tiny_model_dir, whole)
    assert finished.returncode == 0, finished.stderr[-3000:]
    steps = trained_prompts(whole)
    assert sorted(steps) == list(range(8))
    return steps


@pytest.mark.e2e
def test_kill_and_resume_trains_on_the_prompts_of_an_uninterrupted_run(tiny_model_dir, tmp_path, uninterrupted):
    expected = uninterrupted

    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, SCRIPT, str(tiny_model_dir), str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    while not os.path.exists(out / "checkpoint-4" / "checkpoint_complete"):
        assert child.poll() is None and time.monotonic() < deadline, "the run ended before checkpoint-4"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not os.path.exists(out / "checkpoint-8")
    state = __import__("torch").load(out / "checkpoint-4" / "loop_state.pt", weights_only=False)
    assert state["async"]["slots"], "no batch was drawn ahead of training at the checkpoint"

    resumed = run(tiny_model_dir, out, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert trained_prompts(out) == expected  # none skipped, none repeated, the same order


@pytest.mark.e2e
def test_a_killed_worker_is_restarted(tiny_model_dir, tmp_path, uninterrupted):
    result = run(tiny_model_dir, tmp_path, "kill_worker_at=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished at step 8" in result.stdout
    assert trained_prompts(tmp_path) == uninterrupted  # the batches in flight at the kill are drawn again, in order
    log = open(tmp_path / "generation_worker.log").read()
    assert log.count("grouprl serve:") == 2  # started, then restarted once


@pytest.mark.e2e
def test_a_worker_that_dies_twice_stops_the_run_with_its_exit_code(tiny_model_dir, tmp_path):
    started = time.monotonic()
    result = run(tiny_model_dir, tmp_path, "kill_worker_at=2,4", timeout=240)
    assert result.returncode != 0
    assert "generation worker (`grouprl serve`, pid" in result.stderr
    assert "exited with code -9 after it was restarted once" in result.stderr
    assert time.monotonic() - started < 240


@pytest.mark.e2e
def test_two_processes_train_on_the_prompts_of_one(tiny_model_dir, tmp_path, uninterrupted):
    """The main process's producer samples for both processes; each trains on its share of every group."""
    from test_distributed import launch

    two = tmp_path / "two"
    result = launch(2, [SCRIPT, str(tiny_model_dir), str(two)], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    shares, together = process_shares(two)
    assert together == uninterrupted
    assert all(shares[0][step] and shares[1][step] for step in shares[0])  # both processes trained every step


@pytest.mark.e2e
@pytest.mark.parametrize("config_name", ["fsdp2", "zero3"])
def test_sharded_policy_feeds_its_async_worker(tiny_model_dir, tmp_path, uninterrupted, config_name):
    """FSDP2 / ZeRO-3 (every forward gathering) on 2 processes: the local worker starts from the policy's weights,
    gathered by both processes (the main process alone gathering them hung the run), and each publish gathers them
    again; both processes train on the prompts of the 1-process run, and the first step, sampled from the starting
    weights, has the trainer's logprobs."""
    from test_distributed import NO_DEEPSPEED, deepspeed_path, launch, sharding_config

    if config_name != "fsdp2" and deepspeed_path() is None:
        pytest.skip(NO_DEEPSPEED)
    out = tmp_path / "sharded"
    result = launch(
        2, [SCRIPT, str(tiny_model_dir), str(out)], timeout=400, config=sharding_config(config_name, tmp_path)
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert process_shares(out)[1] == uninterrupted
    logged = [entry for entry in json.load(open(out / "log_history.json")) if "loss" in entry]
    assert len(logged) == 8
    assert logged[0]["sampling/sampling_logp_difference/max"] < 1e-4, logged[0]
