"""Learning happens: GRPO with a verifiable reward raises the bundled model's arithmetic accuracy."""

import argparse
import json
import os

import pytest
from helpers import torch_threads

from grouprl.demo.run import DEFAULTS, run_demo


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_raises_heldout_accuracy(tmp_path):
    """20 GRPO steps of the demo: sampled accuracy on held-out problems rises clearly (seeded)."""
    args = argparse.Namespace(
        **{**DEFAULTS, "output_dir": str(tmp_path / "demo"), "max_steps": 20, "eval_rows": 128, "model": None}
    )
    summary = run_demo(args)
    assert summary["heldout_sampled_accuracy_after"] > summary["heldout_sampled_accuracy_before"] + 0.08, summary
    rewards = [json.loads(line).get("reward") for line in open(tmp_path / "demo" / "metrics.jsonl")]
    rewards = [r for r in rewards if r is not None]
    assert rewards[-1] > rewards[0] + 0.05, rewards
    assert os.path.exists(tmp_path / "demo" / "reward_curve.png")
    assert os.path.exists(tmp_path / "demo" / "report" / "index.html")
    assert json.load(open(tmp_path / "demo" / "summary.json")) == summary


@pytest.mark.e2e
def test_a_seeded_demo_repeats_exactly_under_two_threads(tmp_path):
    """The same seed, three runs under 2 threads: the same trained weights to the bit and the same log. (Before the
    tied embedding's gradient was summed in the rows' order, such runs on a busy 2-core machine drifted apart after
    some steps: held-out accuracy 0.787, 0.831, 0.754.) Another thread count is another run: the CPU's BLAS splits an
    fp32 product's sums by the threads (docs/quickstart.md)."""
    runs = []
    for run in range(3):
        out = tmp_path / f"run{run}"
        args = argparse.Namespace(
            **{**DEFAULTS, "output_dir": str(out), "max_steps": 24, "eval_rows": 32, "model": None}
        )
        with torch_threads(2):
            summary = run_demo(args)
        losses = [json.loads(line).get("loss") for line in open(out / "metrics.jsonl")]
        weights = open(out / "model" / "model.safetensors", "rb").read()
        runs.append((weights, losses, summary["heldout_sampled_accuracy_after"]))
    assert all(run == runs[0] for run in runs[1:]), [(hash(w), acc) for w, _, acc in runs]
