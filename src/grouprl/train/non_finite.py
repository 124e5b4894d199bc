"""NaN / inf in a step: the error every process raises together, and what each finite() check says.

The advantages, each micro-batch's loss and the gradients are finite() checks of the step's statistics
(core/stats.py), reduced with them once per optimizer step, before the update (step_reduction.py), so
every process learns which process saw a NaN / inf and all raise the same `NonFiniteError`
(`non_finite_error`) together: none is left waiting in a collective. (A reward function returning one
raises `RewardFunctionError` naming the function, in rewards/scoring.py.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from grouprl.train.step_reduction import Failure, first_failure_of


class NonFiniteError(FloatingPointError):
    """NaN or inf in the advantages, the loss or the gradients; the run stopped before the update."""


def describe_non_finite(failure: Failure, step: int) -> str:
    """This process's sentence for a failed finite() check (stats.finite): where the NaN / inf is and what to
    try."""
    entry = failure.entry
    if failure.check == "advantages":
        advantages = entry.advantages.detach().cpu()
        bad = (~torch.isfinite(advantages)).nonzero().flatten().tolist()
        return (
            f"Advantages are not finite at step {step}: {len(bad)} of {len(advantages)} rows are NaN or inf "
            f"(first: row {bad[0]}). The rewards were finite, so the advantage computation produced them: check "
            "a custom RolloutMaker or group filter, and keep rewards in a moderate range."
        )
    if failure.check == "loss":
        culprits = [name for name, ok in (entry.loss_inputs or {}).items() if not bool(ok)]
        where = ", ".join(culprits) if culprits else "none of its inputs (a loss term overflowed)"
        return (
            f"The loss is {float(entry.loss)} at step {step}; non-finite inputs: {where}. The update was not "
            "applied. Usually weights or activations overflowed: lower learning_rate, keep max_grad_norm > 0, "
            "prefer bf16 to fp16; non-finite reference log-probabilities point at the reference model."
        )
    if failure.check == "gradients":
        return (
            f"The gradients are not finite at step {step} (grad_norm = {float(entry.grad_norm)}) although the "
            "loss was finite; the update was not applied. Lower learning_rate, keep max_grad_norm > 0, prefer "
            "bf16 to fp16, and check custom layers or backward hooks."
        )
    return f"{failure.check} is not finite at step {step}; the update was not applied."


def non_finite_error(
    failures: list[Failure], *, step: int, process_index: int, num_processes: int, gather: Callable[[Any], list[Any]]
) -> NonFiniteError:
    """The one error every process raises when a finite() check failed anywhere in this step. Each process
    describes its own first failure (the cause; what follows from it is left out); `gather` (a collective
    every process reaches, since every process got the same failures from the step's reduction) shares the
    sentences, so all raise the same message naming the processes."""
    own = first_failure_of(failures, process_index)
    sentences = gather(describe_non_finite(own, step) if own is not None else None)
    if num_processes == 1:
        return NonFiniteError(sentences[0])
    lines = [f"  process {p}: {sentence}" for p, sentence in enumerate(sentences) if sentence is not None]
    named = ", ".join(str(p) for p, sentence in enumerate(sentences) if sentence is not None)
    return NonFiniteError(
        f"Non-finite values on process {named} of {num_processes} at step {step}; every process stopped "
        "before the update:\n" + "\n".join(lines)
    )
