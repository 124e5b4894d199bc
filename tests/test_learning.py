"""Learning happens: GRPO with a verifiable reward raises the bundled model's arithmetic accuracy."""

import argparse
import json
import os

import pytest

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
