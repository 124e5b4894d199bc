"""The documentation site: it builds with `mkdocs build --strict`, and the pages that must follow the code do.

- the site builds (no broken link, anchor or API reference) and its GRPOConfig reference lists every field;
- docs/trl-compat.md names every GRPOConfig field and every public GRPOTrainer method;
- docs/troubleshooting.md has an entry for every health warning and every error class users meet;
- docs/extending.md's custom loss, advantage estimator and reward function train a tiny model as written.
"""

import ast
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import quiet_config

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.core.advantages import ADVANTAGE_ESTIMATORS
from grouprl.core.losses import LOSSES
from grouprl.generation.protocol import GenerationBackend

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SITE_MODULES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def python_blocks_by_section(text: str) -> dict[str, list[str]]:
    """The ```python blocks of a markdown page, under the `## ` heading they appear in."""
    sections: dict[str, list[str]] = {}
    heading, block = None, None
    for line in text.splitlines():
        if block is not None:
            if line.startswith("```"):
                sections.setdefault(heading, []).append("\n".join(block))
                block = None
            else:
                block.append(line)
        elif line.startswith("```python"):
            block = []
        elif line.startswith("## "):
            heading = line[3:].strip()
    return sections


def test_site_builds_strict_with_every_config_field(tmp_path):
    missing = [name for name in SITE_MODULES if importlib.util.find_spec(name.split(".")[0]) is None]
    assert not missing, (
        f"cannot build the docs site: {', '.join(missing)} not installed. They are in the dev extra: "
        "pip install -e '.[dev]' (or '.[docs]')."
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    reference = (site / "reference" / "grpo_config.html").read_text(encoding="utf-8")
    names = [spec.name for spec in dataclasses.fields(GRPOConfig) if spec.init]
    absent = [name for name in names if f"<code>{name}</code>" not in reference]
    assert not absent, f"the GRPOConfig reference page lacks {absent}"
    # type and default cells render as code, unescaped (transformers annotates output_dir `str | None`)
    assert "<td><code>output_dir</code></td>\n<td><code>str | None</code></td>\n<td><code>None</code></td>" in reference
    architecture = (site / "architecture.html").read_text(encoding="utf-8")
    from grouprl.generation.fused_step import FAMILIES

    assert all(f"<td><code>{model_type}</code></td>" in architecture for model_type in FAMILIES)
    trainer = (site / "reference" / "grpo_trainer.html").read_text(encoding="utf-8")
    for method in ("train", "evaluate", "save_model", "compute_loss"):
        assert f'id="grouprl.GRPOTrainer.{method}"' in trainer, f"GRPOTrainer.{method} is not in the API reference"


def test_trl_compat_names_every_config_field_and_trainer_method():
    text = page("trl-compat.md")
    fields_part, _, trainer_part = text.partition("## GRPOTrainer")
    fields = [spec.name for spec in dataclasses.fields(GRPOConfig) if spec.init]
    assert not [name for name in fields if f"| `{name}` |" not in fields_part]
    public = [name for name in dir(GRPOTrainer) if not name.startswith("_")]
    assert {"train", "evaluate", "save_model", "overrides"} <= set(public)
    unnamed = [name for name in public if not re.search(rf"`{name}[`(]", trainer_part)]
    assert not unnamed, f"docs/trl-compat.md does not name GRPOTrainer.{unnamed}: add a row with its status"
    statuses = {"honoured", "grouprl extension", "not built", "accepted, no effect", "refused unless default"}
    rows = [line.split(" | ")[1] for line in trainer_part.splitlines() if line.startswith("| `")]
    assert rows and set(rows) <= statuses


def health_findings() -> list[tuple[str, str]]:
    """(kind, title) of every Finding the detectors build; for an f-string, its text before the first value."""
    import grouprl.train.health as detectors

    def literal(node: ast.expr) -> str:
        if isinstance(node, ast.Constant):
            return node.value
        assert isinstance(node, ast.JoinedStr) and isinstance(node.values[0], ast.Constant)
        return node.values[0].value

    tree = ast.parse(Path(detectors.__file__).read_text(encoding="utf-8"))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Finding"
    ]
    return [(literal(call.args[0]), literal(call.args[1])) for call in calls]


def test_troubleshooting_covers_every_health_warning_and_error():
    text = page("troubleshooting.md")
    findings = health_findings()
    assert len(findings) == 9
    for kind, title in findings:
        assert f"(`{kind}" in text, f"health warning kind {kind!r} has no entry in docs/troubleshooting.md"
        assert title.lower() in text.lower(), f"health warning title {title!r} is not in docs/troubleshooting.md"
    for error in ("NonFiniteError", "RewardFunctionError", "ServerError", "WorkerDied", "UnsupportedCombination"):
        assert f"`{error}`" in text or f"{error}:" in text, f"{error} has no entry in docs/troubleshooting.md"


@pytest.fixture
def extending_examples():
    """docs/extending.md's code, run as written: registers its loss and estimator (removed afterwards)."""
    blocks = python_blocks_by_section(page("extending.md"))
    namespace: dict = {}
    try:
        for section in ("A custom loss", "A custom advantage estimator", "A reward function", "A generation backend"):
            assert blocks.get(section), f"docs/extending.md has no python block under '## {section}'"
            for block in blocks[section]:
                exec(compile(block, f"docs/extending.md ({section})", "exec"), namespace)
        yield namespace
    finally:
        LOSSES.pop("truncated_pg", None)
        ADVANTAGE_ESTIMATORS.pop("leave_one_out", None)


def test_extending_examples_train_a_tiny_model(extending_examples, tiny_model_dir, tmp_path):
    assert extending_examples["config"].advantage_estimator == "leave_one_out"  # the last usage block ran
    assert isinstance(extending_examples["HttpBackend"]("http://localhost:1", tokenizer=None), GenerationBackend)
    reward = extending_examples["close_to_target_length"]
    assert reward(["abc", "abcdef", "x"], target_length=[3, 3, None]) == [1.0, 0.0, None]
    dataset = Dataset.from_dict(
        {"prompt": [f"count to {i}:" for i in range(12)], "target_length": [3 + i % 5 for i in range(12)]}
    )
    config = quiet_config(
        tmp_path,
        per_device_train_batch_size=6,
        max_completion_length=8,
        learning_rate=0.05,
        max_steps=2,
        loss_type="truncated_pg",
        loss_kwargs={"truncation": 1.5},
        advantage_estimator="leave_one_out",
    )
    trainer = GRPOTrainer(tiny_model_dir, reward_funcs=reward, args=config, train_dataset=dataset)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == 2
    # The custom objective ran: its statistic is logged (on-policy, every weight is 1, so nothing is truncated).
    assert all(entry["truncated_pg/truncated_fraction"] == 0.0 for entry in steps)
    assert all("mean_completion_chars" in entry for entry in steps)  # the reward's log_metric
    # The custom estimator ran: the last generation's advantages are its leave-one-out values of the rewards.
    rewards = list(trainer._logs["rewards"]["close_to_target_length"])
    advantages = list(trainer._logs["advantages"])
    assert len(rewards) == len(advantages) == 6
    expected = []
    for start in range(0, 6, 3):
        group = rewards[start : start + 3]
        expected += [r - (sum(group) - r) / 2 for r in group]
    assert advantages == pytest.approx(expected, abs=1e-5)
    assert any(abs(a) > 1e-3 for a in advantages), "the rewards tied: the check above would not tell estimators apart"
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
