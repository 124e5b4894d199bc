"""The report's charts: which metrics each draws, and the PNG of one chart."""

from __future__ import annotations

import fnmatch
import io
from dataclasses import dataclass
from typing import Optional

from grouprl.report.run_log import RunLog

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


def chart_series(chart: Chart, log: RunLog) -> dict[str, list[tuple[float, float]]]:
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
    series = chart_series(chart, log)
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
