"""Run health, as the loop sees it: early warnings for runs that learn nothing, and the state to stop safely.

Once per optimizer step the loop calls `RunHealth.start_step` (keep the last good state, mark where the
step's metrics begin) and `RunHealth.end_step` (run the detectors of health_detectors.py over the step's
metrics). `HealthMonitor` warns about each kind of finding once, counts the steps where it recurs and
logs a summary at the end of training.

Non-finite values stop the run before they reach the weights: every process raises the same
`NonFiniteError` (non_finite.py), and the loop saves the last good state first (last_good_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from transformers.utils import logging

from grouprl.core.metrics import MetricWindow
from grouprl.train.checkpoint import rng_state
from grouprl.train.health_detectors import Finding, detect
from grouprl.train.last_good_state import LastGoodState

logger = logging.get_logger("grouprl")


@dataclass
class _Seen:
    finding: Finding  # the first one
    first_step: int
    last_step: int
    steps: int = 1


class HealthMonitor:
    """Warns about each kind of finding the first time it appears; counts the rest for `summary`."""

    def __init__(self) -> None:
        self.seen: dict[str, _Seen] = {}
        self.steps_checked = 0

    def observe(self, findings: list[Finding], step: int) -> list[Finding]:
        """Record one step's findings; warn about (and return) the kinds not seen before."""
        self.steps_checked += 1
        new = []
        for finding in findings:
            seen = self.seen.get(finding.kind)
            if seen is not None:
                seen.steps, seen.last_step = seen.steps + 1, step
                continue
            self.seen[finding.kind] = _Seen(finding, step, step)
            new.append(finding)
            logger.warning(
                "grouprl health warning at step %d: %s [%s = %.4g]. (Shown once; later steps are counted in the "
                "summary at the end of training.)",
                step,
                finding.message,
                finding.metric,
                finding.value,
            )
        return new

    def summary(self) -> Optional[str]:
        if not self.seen:
            return None
        lines = [f"grouprl health summary ({self.steps_checked} step(s) checked):"]
        for seen in self.seen.values():
            lines.append(
                f"  - {seen.finding.title} ({seen.finding.metric}): in {seen.steps} of {self.steps_checked} steps "
                f"checked (steps {seen.first_step}-{seen.last_step})"
            )
        return "\n".join(lines)


class RunHealth:
    """Per-run state of the hooks: the monitor, the last good state, where this step's metrics begin."""

    def __init__(self) -> None:
        self.monitor = HealthMonitor()
        self.last_good: Optional[LastGoodState] = None
        self._mark: dict[str, int] = {}

    def start_step(self, step: int, loop_state: dict[str, Any], window: MetricWindow) -> None:
        self.last_good = LastGoodState(step, loop_state, rng_state())
        self._mark = window.mark()

    def end_step(
        self,
        window: MetricWindow,
        *,
        step: int,
        warn: bool,
        max_completion_length: Optional[int] = None,
        warmup: bool = False,
    ) -> dict[str, Any]:
        """After the optimizer step: close the phase timers, run the detectors (`warn`: this process reports, the
        metrics being global); returns the step's metrics."""
        window.close_step()
        stats = window.summary(since=self._mark)
        if warn:
            self.monitor.observe(
                detect(stats, step=step, max_completion_length=max_completion_length, warmup=warmup), step
            )
        return stats

    def finish(self) -> None:
        summary = self.monitor.summary()
        if summary:
            logger.warning(summary)
