"""The report page's sections as HTML: the summary table, the health findings, a sample of completions."""

from __future__ import annotations

import html
from typing import Any

from grouprl.report.run_log import RunLog
from grouprl.train.health import detect

TEXT_LIMIT = 600  # characters of a prompt / completion shown


def health_findings(log: RunLog) -> list[tuple[Any, list[int]]]:
    """(first finding, steps) per kind, from the detectors run over each training log entry."""
    seen: dict[str, tuple[Any, list[int]]] = {}
    for entry in log.train:
        step = entry.get("step", 0)
        for finding in detect(entry, step=step, warmup=True):  # warmup unknown here: a 0 lr at step 1 is not flagged
            seen.setdefault(finding.kind, (finding, []))[1].append(step)
    return list(seen.values())


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def _first_last(log: RunLog, name: str) -> str:
    values = [e[name] for e in log.train if isinstance(e.get(name), (int, float))]
    return f"{_fmt(values[0])} &rarr; {_fmt(values[-1])}" if values else "not logged"


def summary_html(log: RunLog) -> str:
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
    if log.earlier_runs:
        rows.append(("earlier runs in metrics.jsonl", f"{log.earlier_runs}, left out: this page shows the last run"))
    return "\n".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in rows)


def health_html(log: RunLog) -> str:
    findings = health_findings(log)
    if not findings:
        return "<p class=ok>No silent-failure pattern found in the logged metrics.</p>"
    items = [
        f"<li><b>{html.escape(f.title)}</b> ({html.escape(f.metric)}) in {len(steps)} of {len(log.train)} logged "
        f"steps (steps {steps[0]}&ndash;{steps[-1]}): {html.escape(f.message)}</li>"
        for f, steps in findings
    ]
    return "<ul class=warn>" + "\n".join(items) + "</ul>"


def completions_html(rows: list[dict[str, Any]]) -> str:
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
