"""The last good state: what the loop saves when a step fails (NaN / inf, a failing reward function).

That state is exact: the model, optimizer and scheduler do not change until the optimizer step, which a
failing step never reaches, and `RunHealth.start_step` (health.py) kept the rest (RNG, sampler position,
buffered micro-batches, metric window, entropy controller) as it was when the step began. So the
checkpoint equals the one a save after the previous step would have written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from grouprl.train.checkpoint import COMPLETE_MARKER


@dataclass
class LastGoodState:
    step: int
    loop_state: dict[str, Any]  # without the reference weights: they change only after the optimizer step
    rng: dict[str, Any]


def save_last_good(
    good: Optional[LastGoodState],
    *,
    step: int,
    loop_state: Callable[[], dict[str, Any]],
    output_dir: str,
    writes: bool,
    write: Callable[[int, dict[str, Any], Optional[dict[str, Any]]], Any],
) -> str:
    """Checkpoint the state before the failing step (or, if the failure came after its optimizer step,
    e.g. in evaluation, the state after it); returns a sentence saying where it is. `write(step, loop_state, rng)`
    writes a checkpoint; `writes`: this process writes (the main one)."""
    if good is not None and good.step == step:  # the failing step had not updated anything yet
        step, state, rng = good.step, {**loop_state(), **good.loop_state}, good.rng
    else:
        state, rng = loop_state(), None
    if step == 0:
        return "The run stopped before its first update, so there was no trained state to save."
    path = os.path.join(output_dir, f"checkpoint-{step}")
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)) and writes:
        try:
            write(step, state, rng)
        except Exception as save_error:  # noqa: BLE001 - the original error matters more; say why nothing was saved
            return f"Saving the last good state (step {step}) failed too: {type(save_error).__name__}: {save_error}"
    return (
        f"The last good state (after step {step}) is saved in {path}: fix the cause, then resume with "
        "trainer.train(resume_from_checkpoint=True) or grouprl train ... --resume_from_checkpoint true."
    )
