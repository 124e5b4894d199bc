"""What one optimizer step runs through, measured with sys.setprofile as a design review would: no call from a lower
layer into a higher one (the layers of pyproject.toml's import contract), and a ceiling on the files it enters. And
the TRL override points: a subclass's version of each, calling super(), runs at its point of the step."""

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import distinct_tokens, numbered_prompts, quiet_config
from transformers import TrainerCallback

from grouprl import GRPOTrainer
from grouprl.core.overrides import OVERRIDE_POINTS

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src" / "grouprl") + os.sep
# Files of the package one optimizer step (with its generation) enters, the speed machinery included. The
# target of issue 34 was 35; issue 62 split the fused decode module by job (fused_step.py, cpu_products.py) and its
# private copies of layer_kinds and base_model gave way to model/layer_configs.py's and model/adapters.py's: 37. This
# ceiling only keeps the count from growing while modules are merged by job.
MAX_STEP_FILES = 37


def layer_ranks() -> dict[str, int]:
    """Sub-package -> its rank in the layers contract (0: the highest layer)."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")  # a reader of pyproject.toml
    with open(ROOT / "pyproject.toml", "rb") as handle:
        layers = tomllib.load(handle)["tool"]["importlinter"]["contracts"][0]["layers"]
    return {
        name.strip().split(".")[1]: rank
        for rank, entry in enumerate(layers)
        for name in entry.replace("|", ":").split(":")
    }


def layer_of(path: str):
    relative = path[len(SRC) :] if path.startswith(SRC) else None
    return relative.split(os.sep)[0] if relative and os.sep in relative else None


class TraceSecondStep(TrainerCallback):
    """Profiles the second optimizer step (the first has one-off work): files entered, calls up a layer."""

    def __init__(self):
        self.files, self.calls_up, self.ranks = Counter(), Counter(), layer_ranks()

    def profile(self, frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(SRC):
            return
        callee = frame.f_code.co_filename
        self.files[callee[len(SRC) :]] += 1
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        low, high = layer_of(caller), layer_of(callee)
        if low in self.ranks and high in self.ranks and self.ranks[low] > self.ranks[high]:
            self.calls_up[
                (f"{caller[len(SRC) :]}:{frame.f_back.f_code.co_name}", f"{callee[len(SRC) :]}:{frame.f_code.co_name}")
            ] += 1

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            sys.setprofile(self.profile)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            sys.setprofile(None)


def train_two_steps(model_dir, tmp_path, trainer_class=GRPOTrainer, callbacks=(), eval_dataset=None, **overrides):
    config = quiet_config(
        tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=6, max_steps=2, **overrides
    )
    trainer = trainer_class(
        model=model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=numbered_prompts(),
        eval_dataset=eval_dataset,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer


def test_one_step_calls_no_higher_layer_and_enters_few_files(tiny_model_dir, tmp_path):
    trace = TraceSecondStep()
    try:
        train_two_steps(tiny_model_dir, tmp_path, callbacks=[trace])
    finally:
        sys.setprofile(None)
    assert trace.files["train/stages.py"] > 0 and trace.files["rollout/experience.py"] > 0, "the step was not traced"
    assert not trace.calls_up, f"calls from a lower layer into a higher one: {dict(trace.calls_up)}"
    assert len(trace.files) <= MAX_STEP_FILES, " ".join(sorted(trace.files))


def test_the_trace_sees_a_call_up_a_layer():
    """The check above can fail: a core function calling into train/ is reported."""
    trace = TraceSecondStep()
    from grouprl.core import stats
    from grouprl.train import stages

    class Frame:  # a call of stages.log made from a function of core/stats.py
        f_code = stages.log.__code__
        f_back = type("Back", (), {"f_code": stats.metrics.__code__})()

    trace.profile(Frame, "call", None)
    assert list(trace.calls_up) == [("core/stats.py:metrics", "train/stages.py:log")]


def _spy(name: str, calls: list):
    """A GRPOTrainer subclass whose `name` records its call and returns super()'s result."""

    def method(self, *args, **kwargs):
        calls.append(name)
        return getattr(super(Spy, self), name)(*args, **kwargs)

    Spy = type(f"Spy_{name.strip('_')}", (GRPOTrainer,), {name: method})
    return Spy


@pytest.mark.parametrize("name", OVERRIDE_POINTS)
def test_each_override_point_runs_its_subclass_version_which_reaches_super(tiny_model_dir, tmp_path, name):
    calls: list = []
    settings = {"logging_steps": 1}
    if name == "get_high_entropy_mask":
        settings["top_entropy_quantile"] = 0.5
    if name == "get_off_policy_mask":
        settings.update(off_policy_mask_threshold=0.5, num_iterations=2)
    if name == "evaluate":
        settings.update(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    eval_dataset = numbered_prompts() if name == "evaluate" else None
    trainer = train_two_steps(tiny_model_dir, tmp_path, _spy(name, calls), eval_dataset=eval_dataset, **settings)
    assert calls and set(calls) == {name}, f"{name} was not called through the subclass"
    assert trainer.state.global_step == 2
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2
