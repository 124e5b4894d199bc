"""grouprl report: the HTML page parses, holds every chart as an embedded PNG, and says what a run did not log."""

import base64
import json
import struct
from html.parser import HTMLParser
from pathlib import Path

import datasets
import pytest

from grouprl import GRPOConfig, GRPOTrainer, write_report
from grouprl.cli import main
from grouprl.report.charts import CHARTS


class ReportPage(HTMLParser):
    """figure id -> (class, [img src]); the text of the page; table rows."""

    def __init__(self, text):
        super().__init__()
        self.figures, self.rows, self.chunks, self._figure = {}, 0, [], None
        self.feed(text)
        self.text = " ".join(self.chunks)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self._figure = attrs["id"]
            self.figures[self._figure] = (attrs.get("class"), [])
        elif tag == "img" and self._figure:
            self.figures[self._figure][1].append(attrs["src"])
        elif tag == "tr":
            self.rows += 1

    def handle_endtag(self, tag):
        if tag == "figure":
            self._figure = None

    def handle_data(self, data):
        self.chunks.append(data.strip())


def png_size(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_report_of_a_tiny_run_has_every_chart(tiny_model_dir, tmp_path):
    config = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=8,
        learning_rate=0.1,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        beta=0.04,
        log_completions=True,
        num_completions_to_print=0,
    )  # beta: KL is logged
    data = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(12)]})
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completion_ids, **k: [float(len(set(c))) for c in completion_ids],
        args=config,
        train_dataset=data,
    )
    trainer.train()
    report = write_report(config.output_dir)
    page = ReportPage(Path(report.html).read_text(encoding="utf-8"))
    assert set(page.figures) == {f"chart-{chart.key}" for chart in CHARTS}
    for chart in CHARTS:
        css_class, sources = page.figures[f"chart-{chart.key}"]
        assert css_class == "chart" and len(sources) == 1, chart.key
        prefix = "data:image/png;base64,"
        assert sources[0].startswith(prefix)
        embedded = base64.b64decode(sources[0][len(prefix) :])
        assert (
            embedded == Path(report.charts[chart.key]).read_bytes()
        )  # the same chart as the PNG file next to the page
        assert png_size(embedded) == (640, 330)
    assert "most completions truncated" in page.text  # the health findings (8-token completions of a random model)
    assert page.rows >= 1 + 3 * 4  # summary rows + a header and 4 completions of the first, middle and last tables
    assert any(f"{i}+{i % 5}=" in page.text for i in range(12))  # sampled prompts are shown


def test_report_says_what_was_not_logged_and_skips_a_cut_line(tmp_path, capsys):
    entries = [
        {
            "step": s,
            "reward": 0.1 * s,
            "completions/clipped_ratio": 0.9,
            "grad_norm": 1.0,
            "entropy": 2.0,
            "time/generate": 0.5,
            "time/backward": 0.2,
            "step_time": 0.8,
        }
        for s in (1, 2, 3)
    ]
    with open(tmp_path / "metrics.jsonl", "w") as handle:
        handle.writelines(json.dumps(e) + "\n" for e in entries)
        handle.write('{"step": 4, "rew')  # the line a kill cut short
    assert main(["report", str(tmp_path)]) == 0
    assert "report/index.html (5 of 9 charts drawn" in capsys.readouterr().out
    page = ReportPage((tmp_path / "report" / "index.html").read_text(encoding="utf-8"))
    css_class, sources = page.figures["chart-kl"]
    assert css_class == "chart missing" and sources == []
    assert "Not logged in this run: kl (logged with beta > 0)." in page.text
    assert "unreadable lines skipped 1" in page.text
    assert "90% of completions hit max_completion_length before ending" in page.text
    assert "No completions were logged; train with log_completions=True" in page.text


def test_report_needs_a_run_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist: point grouprl report at the output_dir"):
        write_report(str(tmp_path))


def test_a_second_run_into_the_same_output_dir_starts_its_own_record(tiny_model_dir, tmp_path, caplog):
    """A new (not resumed) run sets the earlier run's metrics.jsonl and completions aside, saying where; its own
    record then holds its steps only, and the report reads that one run."""
    prompts = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(12)]})

    def train(steps):
        config = GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=6,
            num_generations=3,
            max_completion_length=6,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            log_completions=True,
            bf16=False,
        )
        rewards = lambda completion_ids, **kwargs: [float(len(set(ids))) for ids in completion_ids]  # noqa: E731
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=rewards, args=config, train_dataset=prompts).train()

    train(3)
    first = (tmp_path / "metrics.jsonl").read_text()
    with caplog.at_level("WARNING", logger="grouprl"):
        train(2)
    moved = tmp_path / "previous_runs" / "run-1"
    assert (moved / "metrics.jsonl").read_text() == first  # nothing lost
    assert (moved / "completions").is_dir()
    assert f"they are moved to {moved} and this run starts its own" in caplog.text
    steps = [json.loads(line).get("step") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s is not None][:2] == [1, 2] and max(s for s in steps if s is not None) == 2
    assert main(["report", str(tmp_path)]) == 0
    assert "earlier runs" not in ReportPage((tmp_path / "report" / "index.html").read_text(encoding="utf-8")).text


def test_the_report_reads_only_the_last_of_runs_appended_to_one_file(tmp_path, capsys):
    """A metrics.jsonl holding two runs (as grouprl wrote them before it set earlier records aside): the report
    reads the last run only, and says so."""
    first = [{"step": s, "reward": 0.375 if s == 1 else 0.5, "loss": 0.1} for s in (1, 2, 3, 4)]
    second = [{"step": s, "reward": 0.25 if s == 1 else 0.1875, "loss": 0.2} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in first + second))
    from grouprl.report.run_log import read_metrics

    log = read_metrics(str(tmp_path))
    assert [e["reward"] for e in log.train] == [0.25, 0.1875] and log.earlier_runs == 1
    assert main(["report", str(tmp_path)]) == 0
    page = ReportPage((tmp_path / "report" / "index.html").read_text(encoding="utf-8"))
    assert "earlier runs in metrics.jsonl 1, left out: this page shows the last run" in page.text
