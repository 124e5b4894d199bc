"""`grouprl report OUTPUT_DIR`: one self-contained HTML page about a training run.

Reads what a run leaves in its output directory: ``metrics.jsonl`` (one JSON object per log
entry under TRL's metric names; evaluation entries carry ``eval_*`` keys and the last entry
``train_runtime``) and, when ``log_completions`` was on, ``completions/completions_*.parquet``.
Writes ``OUTPUT_DIR/report/index.html``: a summary, the health findings (the detectors of
`grouprl.train.health_detectors` run over each log entry), the charts and a sample of completions. Each chart is
embedded as a base64 PNG, so the page needs no other file and no network, and is also written as
``OUTPUT_DIR/report/<chart>.png``. A chart whose metrics the run did not log says so instead.
"""

from __future__ import annotations

import base64
import fnmatch
import glob
import html
import io
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

from grouprl.train.health_detectors import detect

PHASES = ("generate", "reward", "old_logprobs", "ref_logprobs", "forward", "backward", "optimizer")  # in step order


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    metrics: tuple[str, ...]  # metric names; "*" matches any part (rewards/*/mean)
    ylabel: str
    logged: str  # when the run logs these metrics (shown when it did not)
    stacked: bool = False  # an area per metric, stacked (the phase times add up to a step)


CHARTS = (
    Chart(
        "reward",
        "Reward per function",
        ("reward", "rewards/*/mean", "eval_reward"),
        "mean reward",
        "every step that draws samples",
    ),
    Chart(
        "completion_length",
        "Completion length",
        (
            "completions/mean_length",
            "completions/min_length",
            "completions/max_length",
            "completions/mean_terminated_length",
        ),
        "tokens",
        "every step that draws samples",
    ),
    Chart(
        "clipped_ratio",
        "Truncated completions",
        ("completions/clipped_ratio",),
        "fraction hitting max_completion_length",
        "every step that draws samples",
    ),
    Chart(
        "zero_std",
        "Groups without reward signal",
        ("frac_reward_zero_std",),
        "fraction of groups",
        "every step that draws samples",
    ),
    Chart("kl", "KL to the reference policy", ("kl",), "nats per token", "with beta > 0"),
    Chart("entropy", "Entropy", ("entropy",), "nats per token", "every step"),
    Chart(
        "clip_ratio",
        "Clip ratios",
        ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio"),
        "fraction of tokens",
        "every step",
    ),
    Chart("grad_norm", "Gradient norm", ("grad_norm",), "L2 norm before clipping", "every step"),
    Chart(
        "phase_time",
        "Seconds per step by phase",
        tuple(f"time/{phase}" for phase in PHASES) + ("time/*",),
        "seconds per optimizer step",
        "every step",
        stacked=True,
    ),
)
COMPLETION_ROWS = 4  # rows shown per logged completion table
TEXT_LIMIT = 600  # characters of a prompt / completion shown


@dataclass
class ReportFiles:
    html: str  # the self-contained page
    charts: dict[str, Optional[str]]  # chart key -> its PNG, None where the run did not log the chart's metrics


@dataclass
class RunLog:
    train: list[dict[str, Any]]  # training log entries, one per logged step
    evals: list[dict[str, Any]]
    final: Optional[dict[str, Any]]  # train_runtime, train_loss, ... (absent while training runs or after a crash)
    unreadable: int  # lines that are not JSON (a line cut short by a kill)


def read_metrics(output_dir: str) -> RunLog:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: point grouprl report at the output_dir of a grouprl training run "
            "(it writes metrics.jsonl at every logging step)."
        )
    by_step: dict[int, dict[str, Any]] = {}
    log = RunLog([], [], None, 0)
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                log.unreadable += 1
                continue
            if "train_runtime" in entry:
                log.final = entry
            elif any(key.startswith("eval_") for key in entry):
                log.evals.append(entry)
            else:
                by_step[entry.get("step", len(by_step))] = entry  # a repeated step (older resumes): the last one counts
    log.train = [by_step[step] for step in sorted(by_step)]
    return log


def _series(chart: Chart, log: RunLog) -> dict[str, list[tuple[float, float]]]:
    """name -> (step, value) points of every metric of the chart that the run logged."""
    entries = log.train + log.evals
    names = [
        n
        for pattern in chart.metrics
        for n in sorted({k for e in entries for k in e if fnmatch.fnmatchcase(k, pattern)})
    ]
    series = {}
    for name in dict.fromkeys(names):
        points = [(e["step"], float(e[name])) for e in entries if isinstance(e.get(name), (int, float)) and "step" in e]
        if points:
            series[name] = sorted(points)
    return series


def render_chart(chart: Chart, log: RunLog) -> Optional[bytes]:
    """The chart as PNG bytes, or None if the run logged none of its metrics."""
    series = _series(chart, log)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 3.3))
    if chart.stacked:
        steps = sorted({s for points in series.values() for s, _ in points})
        stacks = [[dict(points).get(s, 0.0) for s in steps] for points in series.values()]
        axis.stackplot(steps, *stacks, labels=[name.split("/", 1)[-1] for name in series], alpha=0.85)
        total = [(e["step"], e["step_time"]) for e in log.train if isinstance(e.get("step_time"), (int, float))]
        if total:
            axis.plot(*zip(*total), color="black", linewidth=1, linestyle="--", label="step_time")
    else:
        for name, points in series.items():
            axis.plot(
                *zip(*points),
                marker="o" if len(points) <= 40 else None,
                markersize=3,
                label=name,
                linestyle="--" if name.startswith("eval_") else "-",
            )
    axis.set_title(chart.title)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel(chart.ylabel)
    axis.grid(alpha=0.3)
    if len(series) > 1 or chart.stacked:
        axis.legend(fontsize=7, loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def read_completions(output_dir: str, rows: int = COMPLETION_ROWS) -> list[dict[str, Any]]:
    """The first `rows` rows of the first, middle and last completion tables (log_completions=True)."""
    files = sorted(glob.glob(os.path.join(output_dir, "completions", "completions_*.parquet")))
    if not files:
        return []
    import pyarrow.parquet as pq

    picked = list(dict.fromkeys([files[0], files[len(files) // 2], files[-1]]))
    return [row for path in picked for row in pq.read_table(path).slice(0, rows).to_pylist()]


def health_findings(log: RunLog) -> list[tuple[Any, list[int]]]:
    """(first finding, steps) per kind, from the detectors run over each training log entry."""
    seen: dict[str, tuple[Any, list[int]]] = {}
    for entry in log.train:
        step = entry.get("step", 0)
        for finding in detect(entry, step=step, warmup=True):  # warmup unknown here: a 0 lr at step 1 is not flagged
            seen.setdefault(finding.kind, (finding, []))[1].append(step)
    return list(seen.values())


def write_report(output_dir: str, out_dir: Optional[str] = None) -> ReportFiles:
    """Write the report (index.html and one PNG per chart) into `out_dir` (default OUTPUT_DIR/report)."""
    log = read_metrics(output_dir)
    out_dir = out_dir or os.path.join(output_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    figures, charts = [], {}
    for chart in CHARTS:
        png = render_chart(chart, log)
        charts[chart.key] = None if png is None else os.path.join(out_dir, f"{chart.key}.png")
        if png is None:
            figures.append(
                f'<figure class="chart missing" id="chart-{chart.key}"><figcaption>{html.escape(chart.title)}</figcaption>'
                f"<p>Not logged in this run: {html.escape(_names(chart.metrics))} (logged {html.escape(chart.logged)}).</p></figure>"
            )
            continue
        with open(charts[chart.key], "wb") as handle:
            handle.write(png)
        data = base64.b64encode(png).decode("ascii")
        figures.append(
            f'<figure class="chart" id="chart-{chart.key}"><img alt="{html.escape(chart.title)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(_names(chart.metrics))}</figcaption></figure>'
        )
    page = PAGE.format(
        title=html.escape(f"grouprl run report: {os.path.abspath(output_dir)}"),
        created=time.strftime("%Y-%m-%d %H:%M"),
        summary=_summary_html(log),
        health=_health_html(log),
        charts="\n".join(figures),
        completions=_completions_html(read_completions(output_dir)),
    )
    path = os.path.join(out_dir, "index.html")
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(page)
    os.replace(temporary, path)
    return ReportFiles(path, charts)


def _names(metrics: tuple[str, ...]) -> str:
    return ", ".join(
        dict.fromkeys(m for m in metrics if not m.startswith("time/")) or ["time/<phase> per step, step_time"]
    )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def _first_last(log: RunLog, name: str) -> str:
    values = [e[name] for e in log.train if isinstance(e.get(name), (int, float))]
    return f"{_fmt(values[0])} &rarr; {_fmt(values[-1])}" if values else "not logged"


def _summary_html(log: RunLog) -> str:
    last = log.train[-1].get("step", "?") if log.train else 0
    rows = [
        ("optimizer steps logged", f"{len(log.train)} entries, last at step {last}"),
        ("reward (first &rarr; last entry)", _first_last(log, "reward")),
        ("mean completion length", _first_last(log, "completions/mean_length")),
        ("truncated completions", _first_last(log, "completions/clipped_ratio")),
        ("evaluations", str(len(log.evals))),
    ]
    if log.final is not None:
        rows.append(("train_runtime (s)", _fmt(log.final.get("train_runtime"))))
    else:
        rows.append(("finished", "no final entry: the run is still going, or it stopped early"))
    if log.unreadable:
        rows.append(("unreadable lines skipped", str(log.unreadable)))
    return "\n".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in rows)


def _health_html(log: RunLog) -> str:
    findings = health_findings(log)
    if not findings:
        return "<p class=ok>No silent-failure pattern found in the logged metrics.</p>"
    items = [
        f"<li><b>{html.escape(f.title)}</b> ({html.escape(f.metric)}) in {len(steps)} of {len(log.train)} log entries "
        f"(steps {steps[0]}&ndash;{steps[-1]}): {html.escape(f.message)}</li>"
        for f, steps in findings
    ]
    return "<ul class=warn>" + "\n".join(items) + "</ul>"


def _completions_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>No completions were logged; train with log_completions=True to see a sample here.</p>"
    columns = list(dict.fromkeys(name for row in rows for name in row))
    head = "".join(f"<th>{html.escape(name)}</th>" for name in columns)
    body = []
    for row in rows:
        cells = []
        for name in columns:
            value = row.get(name)
            text = (
                _fmt(value)
                if not isinstance(value, str)
                else html.escape(value[:TEXT_LIMIT] + ("..." if len(value) > TEXT_LIMIT else ""))
            )
            cells.append(f"<td><pre>{text}</pre></td>" if name in ("prompt", "completion") else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table class=completions><tr>{head}</tr>\n" + "\n".join(body) + "</table>"


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
table {{ border-collapse: collapse; font-size: 13px; }} th, td {{ border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }}
.charts {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(640px, 1fr)); gap: 12px; }}
figure {{ margin: 0; border: 1px solid #eee; padding: 6px; }} figure img {{ width: 100%; }} figcaption {{ font-size: 12px; color: #555; }}
.missing p {{ color: #777; font-size: 13px; }} .warn li {{ margin-bottom: 6px; color: #8a4b00; }} .ok {{ color: #2d6a2d; }}
pre {{ white-space: pre-wrap; margin: 0; max-width: 520px; font-size: 12px; }}
</style></head><body>
<h1>{title}</h1><p>Written {created} by grouprl report.</p>
<h2>Summary</h2><table>{summary}</table>
<h2>Health</h2>{health}
<h2>Charts</h2><div class="charts">
{charts}
</div>
<h2>Sample of completions</h2>{completions}
</body></html>
"""
