"""When the loop logs, evaluates and checkpoints after an optimizer step: transformers' DefaultFlowCallback's rules.

Trainer asks its DefaultFlowCallback at each step's end (the `*_strategy="steps"` intervals, `logging_first_step`,
and where `max_steps` ends training: an evaluation unless that step had one, and a checkpoint with
save_strategy="steps" whatever `save_steps`), then at each epoch's end, which it also fires where training stops
inside an epoch (the "epoch" strategies). `step_end` is both, pure; the loop adds what callbacks ask and
save_strategy="best"'s checkpoint (decided by the evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grouprl.config.grpo_config import GRPOConfig, resolve_steps


@dataclass(frozen=True)
class StepEnd:
    log: bool
    evaluate: bool
    save: bool


def step_end(config: GRPOConfig, step: int, total_steps: int, steps_per_epoch: Optional[int], stopped: bool) -> StepEnd:
    """What the default flow asks for after optimizer step `step` of `total_steps` (`stopped`: a callback ends
    training here)."""
    logging_every = resolve_steps(config.logging_steps, total_steps)
    eval_every = resolve_steps(
        config.eval_steps if config.eval_steps is not None else config.logging_steps, total_steps
    )
    save_every = resolve_steps(config.save_steps, total_steps)
    last = step >= total_steps
    # on_step_end
    log = (config.logging_first_step and step == 1) or (
        config.logging_strategy == "steps" and step % logging_every == 0
    )
    evaluate = config.eval_strategy == "steps" and step >= config.eval_delay and (step % eval_every == 0 or last)
    save = config.save_strategy == "steps" and ((save_every > 0 and step % save_every == 0) or last)
    # on_epoch_end: an epoch's last step, or where training stops
    if last or stopped or (steps_per_epoch and step % steps_per_epoch == 0):
        epoch = step / steps_per_epoch if steps_per_epoch else 0.0
        log = log or config.logging_strategy == "epoch"
        evaluate = evaluate or (config.eval_strategy == "epoch" and epoch >= config.eval_delay)
        save = save or config.save_strategy == "epoch"
    return StepEnd(log=bool(log), evaluate=evaluate, save=save)
