"""The parts of one optimizer step, in the order the loop (loop.py) runs them.

    backward                per micro-batch, after its loss (stages.py)
    clip_gradients          max_grad_norm; the norm before clipping
    reduce_statistics       every statistic of the step over every process, once; NaN / inf anywhere stops all
    apply_update            optimizer step, then the LR schedule
    end_of_step_updates     the controllers that act once per step: entropy coefficient, TR-DPO reference sync

Nothing here reads the host value of a tensor before `reduce_statistics`: one sync per step.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from grouprl.core.distributed import gather_objects
from grouprl.core.stats import finite, largest, mean
from grouprl.model.reference import mix_into_reference
from grouprl.train.non_finite import non_finite_error
from grouprl.train.step_reduction import reduce_step
from grouprl.train.training_run import TrainingRun


@dataclass(frozen=True)
class StepStats:
    """The loop's own statistics of an optimizer step."""

    loss: Any = mean("loss")  # this process's summed micro-batch losses; logged as the mean over processes
    # the clipped-over norm: NaN / inf stops every process (None under fp16 scaling)
    grad_norm: Any = finite("gradients")
    # the number of a SIGINT / SIGTERM a process received (0: none): every process learns it (stop_signals.py)
    stop_signal: Any = largest(None)


def backward(run: TrainingRun, loss: torch.Tensor, micro: Any) -> None:
    """Backward of one micro-batch's (GA-scaled) loss; counts its tokens for the flos."""
    run.before_backward()
    engine = deepspeed_engine(run.accelerator)
    with run.timer.phase("backward"):
        if engine is None:
            run.accelerator.backward(loss)
        else:  # the loss is already divided by the accumulation steps; accelerate's wrapper would step every time
            engine.backward(loss, scale_wrt_gas=False)
    run.count_flos(micro)


def deepspeed_engine(accelerator: Any) -> Any:
    """The DeepSpeed engine accelerate wrapped the model in, or None."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine


@contextmanager
def accumulating(run: TrainingRun, last: bool) -> Iterator[None]:
    """The scope of one micro-batch of the step. grouprl accumulates gradients itself (accelerate's accumulation is
    1 step): DDP all-reduces them only in the last micro-batch; DeepSpeed is told whether it is the boundary."""
    engine = deepspeed_engine(run.accelerator)
    if engine is not None:
        engine.set_gradient_accumulation_boundary(last)
        yield
    elif last:
        yield
    else:
        with run.accelerator.no_sync(run.model):
            yield


def as_loss(value: Any, device: torch.device) -> torch.Tensor:
    """training_step's result (TRL: a detached tensor; an override may return a number) as a 0-dim tensor."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), device=device)


def clip_gradients(run: TrainingRun) -> Optional[torch.Tensor]:
    """Clip to max_grad_norm; returns the norm before clipping (a tensor: read once the step is reduced). None under
    DeepSpeed, which clips inside its step (the config's gradient_clipping, max_grad_norm by default): its norm is
    read after the update (update_norm)."""
    if deepspeed_engine(run.accelerator) is not None:
        return None
    params = [p for p in run.model.parameters() if p.requires_grad]
    max_norm = run.config.max_grad_norm if run.config.max_grad_norm > 0 else float("inf")
    norm = run.accelerator.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a replicated DTensor
        norm = norm.full_tensor()
    return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))


def reduce_statistics(run: TrainingRun, step_stats: StepStats) -> list[Any]:
    """Every statistic of this optimizer step, over every process, in one reduction; raises the same
    NonFiniteError on every process if any process saw a NaN / inf (before the update). Returns the reduced
    entries, step_stats last."""
    run.ledger.record(step_stats)
    reduced, failures = reduce_step(run.ledger.take(), run.collectives)
    if failures:
        raise non_finite_error(
            failures,
            step=run.state.global_step + 1,
            process_index=run.accelerator.process_index,
            num_processes=run.accelerator.num_processes,
            gather=gather_objects,
        )
    return reduced


def apply_update(run: TrainingRun) -> float:
    """Optimizer step, then schedule; returns the learning rate used."""
    learning_rate = run.scheduler.get_last_lr()[0]
    run.fire("on_pre_optimizer_step")
    engine = deepspeed_engine(run.accelerator)
    if engine is None:
        run.optimizer.step()
    else:  # reduces the accumulated gradients, clips, steps and zeroes them
        engine.step()
    run.fire("on_optimizer_step")
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return learning_rate


def update_norm(run: TrainingRun, clipped_norm: Optional[torch.Tensor]) -> float:
    """The step's gradient norm before clipping: clip_gradients', or DeepSpeed's from its step."""
    if clipped_norm is not None:
        return float(clipped_norm)
    norm = deepspeed_engine(run.accelerator).get_global_grad_norm()
    return float("nan") if norm is None else float(norm)


def end_of_step_updates(run: TrainingRun, reduced: list[Any]) -> None:
    """Controllers that act once per optimizer step: the entropy coefficient (from the step's reduced entropy
    sums), the TR-DPO reference sync, the weights of an asynchronous generation worker."""
    controller, accelerator = run.entropy_controller, run.accelerator
    source, step = run.rollouts.source, run.state.global_step
    if source is not None and step % run.config.weight_sync_steps == 0:
        source.publish(accelerator.unwrap_model(run.model), step)
    if controller is not None:
        total = sum(getattr(entry, "entropy_sum", None) or 0.0 for entry in reduced)
        count = sum(getattr(entry, "entropy_count", None) or 0.0 for entry in reduced)
        run.window.add("entropy_coef", controller.end_step(total, count))
    if run.config.sync_ref_model and run.state.global_step % run.config.ref_model_sync_steps == 0:
        mix_into_reference(run.reference.model, accelerator.unwrap_model(run.model), run.config.ref_model_mixup_alpha)
