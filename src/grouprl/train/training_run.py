"""TrainingRun: everything one training run holds between steps, and the state that makes a resume exact.

The loop and the parts of its step (loop.py, run_checkpoints.py) work on it; the stages they
call get only what they use of it (`evaluation_parts`, `sampling`, the model, the batch), never the run.
`loop_state` is what a checkpoint keeps beyond the model, optimizer and scheduler: the sampler position,
the buffered micro-batches, the metric window and the controllers' state.
`deepspeed_engine` is the engine DeepSpeed wrapped the model in (or None), which the step and the checkpoints
drive instead of the model where there is one.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from accelerate import Accelerator

from grouprl.config.grpo_config import BatchPlan, GRPOConfig
from grouprl.core.distributed import global_sum
from grouprl.core.entropy import EntropyController
from grouprl.core.metrics import JsonlWriter, MetricWindow, PhaseTimer
from grouprl.core.overrides import NO_OVERRIDES, Overrides
from grouprl.data.prompt_sampler import GenerationInputs
from grouprl.model.patches import release_free_host_memory
from grouprl.model.reference import Reference
from grouprl.rollout.experience import Sampling
from grouprl.rollout.sampler import RolloutMaker
from grouprl.train.callbacks import CallbackHandler
from grouprl.train.health import RunHealth
from grouprl.train.micro_step import Objective
from grouprl.train.step_reduction import Collectives, StepLedger


@dataclass
class TrainingRun:
    """The parts of a run the loop works with; built by GRPOTrainer."""

    config: GRPOConfig
    plan: BatchPlan
    accelerator: Accelerator
    model: torch.nn.Module  # prepared by accelerate
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rollouts: RolloutMaker
    state: Any  # transformers.TrainerState
    total_steps: int
    steps_per_epoch: Optional[int]
    micro_steps_per_epoch: Optional[int]  # an epoch's micro-batches (None: a stream); its last step may take fewer
    objective: Objective  # the loss's settings, built once from the config
    reference: Optional[Reference] = None  # beta != 0
    entropy_controller: Optional[EntropyController] = None  # entropy bonus on
    window: MetricWindow = field(default_factory=MetricWindow)
    ledger: StepLedger = field(default_factory=StepLedger)  # the stages' statistics of the current optimizer step
    pending: deque = field(default_factory=deque)  # micro-batches (TrainBatch) not yet trained on
    # micro-batches of the current optimizer step (TRL's current_gradient_accumulation_steps): the loss divides by it
    accumulation_steps: int = field(init=False)
    # trainer.evaluate() may run during training (eval_strategy != "no" or there is an eval set)
    evaluates: bool = False
    step_losses: list[float] = field(default_factory=list)
    health: RunHealth = field(default_factory=RunHealth)  # detectors, last good state (health.py)
    callbacks: CallbackHandler = field(default_factory=CallbackHandler)  # the user's TrainerCallbacks
    overrides: Overrides = NO_OVERRIDES  # a GRPOTrainer subclass's TRL override points (stages.py)
    eval_dataset: Any = None  # what evaluation during training samples from
    inputs: Optional[GenerationInputs] = None  # the generation batch the buffered micro-batches come from
    progress: Any = None  # the tqdm bar while training (log lines are written through it)
    updating: bool = (
        False  # between the optimizer step and the step's end: a stop now leaves nothing consistent to save
    )
    # (time.time(), state.num_input_tokens_seen) when the current train() call began: its tokens per second
    session_start: Optional[tuple[float, int]] = None
    flos: float = 0.0  # this process's floating-point operations not yet added to state.total_flos
    evaluation_pass: Any = None  # set while evaluating: the eval RolloutMaker and metric window (eval_mode.py)
    # a checkpoint's asynchronous-generation book (async_slots.SlotBook.state_dict), until train() starts with it
    async_resume: Optional[dict[str, Any]] = None
    collectives: Collectives = field(init=False)  # the step's reductions over the processes (from the accelerator)
    # tokens trained on since the last store_flos (a tensor: no host sync)
    trained_tokens: Any = field(init=False, default=0.0)
    _flos_per_token: Optional[float] = field(init=False, default=None)

    def fire(self, event: str, **extra: Any) -> Any:
        """Call a TrainerCallback event on every callback; returns the shared TrainerControl."""
        return self.callbacks.fire(event, self.config, self.state, **extra)

    def publish(self, values: dict[str, Any]) -> dict[str, Any]:
        """One log entry (a training step's or an evaluation's) at the current step: log_history, the
        report_to trackers (numbers only, NaN left out) and the callbacks' on_log. Returns the entry."""
        entry = {**values, "epoch": self.state.epoch, "step": self.state.global_step}
        self.state.log_history.append(entry)
        numbers = {
            k: v
            for k, v in entry.items()
            if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
        }
        self.accelerator.log(numbers, step=self.state.global_step)
        self.fire("on_log", logs=entry)
        return entry

    def echo(self, entry: dict[str, Any], line: Optional[str]) -> None:
        """A published log entry to output_dir/metrics.jsonl and, if given, a console line (main process)."""
        if not self.accelerator.is_main_process:
            return
        JsonlWriter(os.path.join(self.config.output_dir, "metrics.jsonl")).write(entry)
        if line is None:
            return
        if self.progress is not None and not self.progress.disable:
            self.progress.write(line)
        else:
            print(line, flush=True)

    def before_backward(self) -> None:
        """Called between a micro-batch's forward and its backward: on a CPU model the free pages of the host heap go
        back to the OS (patches.release_free_host_memory), so the forward's freed temporaries do not add to the
        step's peak, which comes in backward. Only there: pages handed back fault in again when reused (2-4 us a
        page here), and trimming also after generation and after the update cost W5 ~1.5 s a step in faults."""
        if self.accelerator.device.type == "cpu":
            release_free_host_memory()

    def count_flos(self, micro: Any) -> None:
        """Count a micro-batch's tokens for the training flos (6 x tokens x non-embedding parameters,
        transformers' estimate)."""
        self.trained_tokens = self.trained_tokens + micro.prompt_mask.sum() + micro.completion_mask.sum()

    def store_flos(self) -> None:
        """Add every process's counted flos to state.total_flos (as Trainer.store_flos)."""
        if self._flos_per_token is None:
            model = self.accelerator.unwrap_model(self.model)
            try:
                parameters = model.num_parameters(exclude_embeddings=True)
            except (AttributeError, TypeError):
                parameters = sum(p.numel() for p in model.parameters())
            self._flos_per_token = 6 * parameters
        self.flos += self._flos_per_token * float(self.trained_tokens)
        self.trained_tokens = 0.0
        self.state.total_flos += global_sum(self.accelerator, self.flos)
        self.flos = 0.0

    def __post_init__(self) -> None:
        self.collectives = Collectives.of(self.accelerator)
        self.accumulation_steps = self.plan.gradient_accumulation_steps

    def sampling(self) -> Sampling:
        """What the generation stage (experience.score_generation) uses of the run."""
        return Sampling(self.rollouts, self.config, self.plan, self.accelerator, self.state, self.window, self.timer)

    @property
    def timer(self) -> PhaseTimer:
        return PhaseTimer(self.window)

    def loop_state(self, with_reference: bool = True) -> dict[str, Any]:
        # asynchronous generation: the sampler's position and the batches drawn ahead of training, read together
        drawn = self.rollouts.source.state_dict() if self.rollouts.source is not None else None
        state = {
            "sampler": drawn["sampler"] if drawn else self.rollouts.sampler.state_dict(),
            "async": drawn["book"] if drawn else self.async_resume,
            "pending": list(self.pending),
            "generations_made": self.rollouts.generations_made,
            "tokens_seen": self.rollouts.tokens_seen,
            "step_losses": list(self.step_losses),
            "window": {k: list(v) for k, v in self.window.values.items()},
            "entropy_controller": self.entropy_controller.state_dict() if self.entropy_controller else None,
            "inputs": self.inputs,
        }
        if with_reference:  # a copy of a whole model: only when writing a checkpoint
            state["reference_model"] = self.reference_state()
        return state

    def reference_state(self) -> Optional[dict[str, torch.Tensor]]:
        """The reference's weights when they change (sync_ref_model), else None. A collective for a ZeRO-3 reference:
        every process calls it."""
        return self.reference.state_dict() if self.reference and self.config.sync_ref_model else None

    def load_loop_state(self, state: dict[str, Any]) -> None:
        self.rollouts.sampler.load_state_dict(state["sampler"])
        self.async_resume = state.get("async")
        self.pending = deque(state["pending"])
        self.inputs = state.get("inputs")
        self.rollouts.generations_made = state["generations_made"]
        self.rollouts.tokens_seen = state["tokens_seen"]
        self.step_losses = list(state["step_losses"])
        self.window.clear()
        for name, values in state["window"].items():
            self.window.values[name].extend(values)
        if self.entropy_controller is not None and state.get("entropy_controller"):
            self.entropy_controller.load_state_dict(state["entropy_controller"])
        if self.reference is not None:
            self.reference.load_state_dict(state.get("reference_model"))


def deepspeed_engine(accelerator: Any) -> Any:
    """The DeepSpeed engine accelerate wrapped the model in, or None."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine
