"""Ctrl-C (SIGINT) and SIGTERM (what schedulers and preemption send) end a run with a checkpoint.

While the loop runs, `StopSignals` records the first such signal instead of letting it kill the process. The
loop reduces it with the step's statistics, so every process learns at the same point that one of them was asked
to stop (a launcher forwards the signal to each process, a scheduler may signal only some); the step in flight
finishes, a checkpoint is written, the main process prints how to resume, and every process raises
`SystemExit(128 + signal)`: 130 for SIGINT, 143 for SIGTERM, the exit codes shells and schedulers expect. A
second Ctrl-C aborts at once (a step stuck in a hung reward or generation): `StoppedAtOnce` (a KeyboardInterrupt)
unwinds the run from wherever it is, the loop saves the last completed step (loop.save_at_once) and turns it into
`SystemExit(130)` too; a checkpoint being written then stays incomplete, and an incomplete checkpoint is never
resumed from (checkpoint.py).

Handlers can only be installed from the main thread; elsewhere (a notebook's worker thread) the signals keep
their previous behaviour.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C while a run stops (module doc)."""


class StopSignals:
    """Within the block, SIGINT and SIGTERM set `received` (the first one's number) instead of stopping the
    process; `describe` is the step in flight, for the message printed when the signal arrives."""

    def __init__(self, describe: Callable[[], str] = lambda: "the current step", announce: bool = True):
        self.received = 0
        self.describe, self.announce = describe, announce
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame: Optional[Any]) -> None:
        if self.received:
            if number == signal.SIGINT:
                raise StoppedAtOnce("a second Ctrl-C: stopped at once, in the middle of the step")
            return  # a repeated SIGTERM: the checkpoint is on its way
        self.received = number
        if self.announce:
            print(
                f"\ngrouprl: {signal.Signals(number).name} received: finishing {self.describe()}, then writing a "
                "checkpoint (Ctrl-C again to stop at once: the last completed step is saved then).",
                file=sys.stderr,
                flush=True,
            )


def exit_code(number: int) -> int:
    """The conventional exit status of a process ended by signal `number`."""
    return 128 + number


def resume_hint(checkpoint: str, number: int, step: int) -> str:
    name = signal.Signals(number).name
    return (
        f"grouprl: stopped by {name} after step {step}; the run is saved in {checkpoint}. Resume with "
        f"trainer.train(resume_from_checkpoint={checkpoint!r}), or `grouprl train ... --resume_from_checkpoint "
        f"{checkpoint}` (or `true` for the latest checkpoint)."
    )
