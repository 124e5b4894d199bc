"""log_completions: parquet under output_dir/completions/, log_extra / log_metric, console table, tracker tables."""

import math
import os
import sys
import types

import datasets
import pyarrow.parquet as pq
import pytest

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.rollout.completion_log import send_to_trackers


def make_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=6,
        learning_rate=0.1,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        bf16=False,
        log_completions=True,
        num_completions_to_print=2,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def length_reward(completions, log_extra, log_metric, **kwargs):
    log_extra("chars", [len(c) for c in completions])
    log_metric("custom/mean_chars", sum(len(c) for c in completions) / len(completions))
    return [float(len(c)) for c in completions]


def sometimes_none(completions, **kwargs):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def test_completions_parquet_has_the_table_after_a_tiny_run(tiny_model_dir, tmp_path, capsys):
    data = datasets.Dataset.from_dict({"prompt": [f"{i}+1=" for i in range(6)]})
    trainer = GRPOTrainer(
        tiny_model_dir, reward_funcs=[length_reward, sometimes_none], args=make_config(tmp_path), train_dataset=data
    )
    trainer.train()
    folder = os.path.join(trainer.args.output_dir, "completions")
    assert sorted(os.listdir(folder)) == ["completions_00001.parquet", "completions_00002.parquet"]
    table = pq.read_table(os.path.join(folder, "completions_00002.parquet")).to_pydict()
    assert list(table) == ["step", "prompt", "completion", "length_reward", "sometimes_none", "advantage", "chars"]
    assert len(table["completion"]) == 6 and set(table["step"]) == {2}
    assert set(table["prompt"]) <= {f"{i}+1=" for i in range(6)} and len(set(table["prompt"])) == 2
    assert table["length_reward"] == [float(len(c)) for c in table["completion"]]
    assert table["chars"] == [len(c) for c in table["completion"]]
    assert table["sometimes_none"][1] is None and table["sometimes_none"][0] == 1.0
    assert all(isinstance(a, float) and not math.isnan(a) for a in table["advantage"])
    assert "custom/mean_chars" in trainer.state.log_history[0]  # log_metric reaches the log
    printed = capsys.readouterr().out
    assert printed.count("│ 2    │") == 2  # num_completions_to_print rows of step 2


def test_log_extra_with_wrong_length_is_named(tiny_model_dir, tmp_path):
    def bad_extra(completions, log_extra, **kwargs):
        log_extra("oops", [1, 2])
        return [0.0] * len(completions)

    data = datasets.Dataset.from_dict({"prompt": [f"{i}+1=" for i in range(6)]})
    trainer = GRPOTrainer(tiny_model_dir, reward_funcs=bad_extra, args=make_config(tmp_path), train_dataset=data)
    with pytest.raises(ValueError, match=r"log_extra\('oops', values\): got 2 values for 6 completions"):
        trainer.train()


class FakeAccelerator:
    def __init__(self, names):
        self.trackers = [types.SimpleNamespace(name=n) for n in names]
        self.logged = []

    def get_tracker(self, name, unwrap=False):
        return types.SimpleNamespace(log=lambda values, step: self.logged.append((name, values, step)))


def test_tracker_tables_only_for_active_wandb_or_trackio(monkeypatch):
    pytest.importorskip("pandas")
    tables = []
    fake_wandb = types.SimpleNamespace(Table=lambda dataframe: tables.append(("wandb", dataframe)) or "W")
    fake_trackio = types.SimpleNamespace(
        Table=lambda dataframe: tables.append(("trackio", dataframe)) or "T",
        log=lambda values, step: tables.append(("trackio-log", values, step)),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "trackio", fake_trackio)
    table = {"step": [1, 1], "prompt": ["p", "p"], "completion": ["a", "b"], "advantage": [1.0, -1.0]}

    none = FakeAccelerator(["tensorboard"])
    send_to_trackers(none, table, 1, unique_prompts=False)
    assert tables == [] and none.logged == []

    both = FakeAccelerator(["wandb", "trackio"])
    send_to_trackers(both, table, 3, unique_prompts=True)
    assert both.logged == [("wandb", {"completions": "W"}, 3)]
    assert len(tables[0][1]) == 1  # log_unique_prompts: one row per prompt
    assert tables[-1] == ("trackio-log", {"completions": "T"}, 3)
