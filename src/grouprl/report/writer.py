"""The report page: its charts as embedded PNGs (also written next to it) and its sections, in one HTML file."""

from __future__ import annotations

import base64
import html
import os
import time
from dataclasses import dataclass
from typing import Optional

from grouprl.report.charts import CHARTS, Chart, render_chart
from grouprl.report.run_log import read_completions, read_metrics
from grouprl.report.sections import completions_html, health_html, summary_html


@dataclass
class ReportFiles:
    html: str  # the self-contained page
    charts: dict[str, Optional[str]]  # chart key -> its PNG, None where the run did not log the chart's metrics


def write_report(output_dir: str, out_dir: Optional[str] = None) -> ReportFiles:
    """Write the report (index.html and one PNG per chart) into `out_dir` (default OUTPUT_DIR/report)."""
    log = read_metrics(output_dir)
    out_dir = out_dir or os.path.join(output_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    figures, charts = [], {}
    for chart in CHARTS:
        png = render_chart(chart, log)
        charts[chart.key] = None if png is None else os.path.join(out_dir, f"{chart.key}.png")
        if png is not None:
            with open(charts[chart.key], "wb") as handle:
                handle.write(png)
        figures.append(_figure_html(chart, png))
    page = PAGE.format(
        title=html.escape(f"grouprl run report: {os.path.abspath(output_dir)}"),
        created=time.strftime("%Y-%m-%d %H:%M"),
        summary=summary_html(log),
        health=health_html(log),
        charts="\n".join(figures),
        completions=completions_html(read_completions(output_dir)),
    )
    path = os.path.join(out_dir, "index.html")
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(page)
    os.replace(temporary, path)
    return ReportFiles(path, charts)


def _figure_html(chart: Chart, png: Optional[bytes]) -> str:
    """The chart embedded as a base64 PNG, or what it would show and when the run logs it."""
    names = html.escape(_names(chart.metrics))
    if png is None:
        return (
            f'<figure class="chart missing" id="chart-{chart.key}"><figcaption>{html.escape(chart.title)}</figcaption>'
            f"<p>Not logged in this run: {names} (logged {html.escape(chart.logged)}).</p></figure>"
        )
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure class="chart" id="chart-{chart.key}"><img alt="{html.escape(chart.title)}" '
        f'src="data:image/png;base64,{data}"><figcaption>{names}</figcaption></figure>'
    )


def _names(metrics: tuple[str, ...]) -> str:
    return ", ".join(
        dict.fromkeys(m for m in metrics if not m.startswith("time/")) or ["time/<phase> per step, step_time"]
    )


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }}
.charts {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(640px, 1fr)); gap: 12px; }}
figure {{ margin: 0; border: 1px solid #eee; padding: 6px; }} figure img {{ width: 100%; }}
figcaption {{ font-size: 12px; color: #555; }}
.missing p {{ color: #777; font-size: 13px; }}
.warn li {{ margin-bottom: 6px; color: #8a4b00; }} .ok {{ color: #2d6a2d; }}
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
