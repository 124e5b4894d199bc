"""Asynchronous generation as the rollout stage sees it: the source `RolloutMaker.draw_prompts` takes the next
generation batch from instead of the prompt sampler, while a worker process samples ahead.

    AsyncRollouts.take() (every process)    the next finished generation in prompt order, sampled at most
                                            max_staleness versions ago (the main process's producer waits for
                                            it; every process gets it and keeps its own rows, by the
                                            generation's GroupLayout, as generate_on_main_process does)
                                            -> GenerationInputs whose `sampled` Rollout is ready to score
    AsyncRollouts.publish(model, version)   the policy's weights (every process: sharded weights are gathered
                                            collectively), copied by the main process for the worker
    AsyncRollouts.report()                  the async/* statistics of the generations taken since the last call

Rewards are scored by the trainer when it takes a generation (async reward functions keep working); the
sampler's logprobs come with the completions, so experience.py computes the old logprobs and the
sampler-mismatch weights for them as for any separate sampler.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from grouprl.core.distributed import run_on_main
from grouprl.core.types import Completion, GroupLayout, Rollout
from grouprl.data.prompt_sampler import GenerationInputs
from grouprl.data.prompts import local_prompt_batch
from grouprl.generation.protocol import sample_groups
from grouprl.generation.weights import inference_weights
from grouprl.rollout.async_producer import Limits, Producer
from grouprl.rollout.async_slots import Slot, SlotBook


class AsyncRollouts:
    """The trainer's side of asynchronous generation (one per train() call); the producer lives on the main process."""

    def __init__(self, maker: Any, book: SlotBook, producer: Optional[Producer], version: Callable[[], int]):
        self.maker, self.book, self.producer, self.version = maker, book, producer, version
        self.reports: list[dict[str, float]] = []

    def take(self) -> GenerationInputs:
        finished, report = run_on_main(lambda: self.producer.take(self.version()))
        slot = finished.slot
        inputs = self.maker.prompt_inputs(slot.indices, slot.rows, slot.number)
        prompts = inputs.prompt_batch
        share = prompts.layout.deal(finished.completions)[prompts.layout.process_index]
        inputs.sampled = Rollout(prompts, [replace(c, prompt_index=b) for c, b in zip(share, prompts.row_index())])
        self.maker.generations_made = slot.number + 1
        self.reports.append(report)
        return inputs

    def publish(self, model: torch.nn.Module, version: int) -> None:
        weights = inference_weights(model)  # every process iterates: gathers of sharded weights are collective
        if self.producer is None:
            for _ in weights:
                pass
            return
        # a copy: the trainer goes on changing its weights while the producer sends these
        self.producer.publish(version, [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights])

    def report(self) -> dict[str, float]:
        """Means / maxima / sums of the generations taken since the last report (one training batch's)."""
        reports, self.reports = self.reports, []
        if not reports:
            return {}
        staleness = [r["staleness"] for r in reports]
        return {
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "dropped_groups": sum(r["dropped_groups"] for r in reports),
            "queue_size": reports[-1]["queue_size"],
            "trainer_wait_s": sum(r["trainer_wait_s"] for r in reports),
            "generator_wait_s": sum(r["generator_wait_s"] for r in reports),
        }

    def state_dict(self) -> dict[str, Any]:
        """The prompt sampler's position and the slots drawn but not taken, read together (the producer draws)."""
        lock = self.producer.cond if self.producer is not None else threading.Lock()
        with lock:
            return {"sampler": self.maker.sampler.state_dict(), "book": self.book.state_dict()}

    def stop(self) -> None:
        if self.producer is not None:
            self.producer.stop()


def start_async_rollouts(
    maker: Any,
    *,
    backend: Any,
    worker: Any,
    config: Any,
    plan: Any,
    version: Callable[[], int],
    resume: Optional[dict[str, Any]] = None,
) -> AsyncRollouts:
    """The source for `maker` (every process); on the main process a producer that samples on `worker` from the
    first take on."""
    book = SlotBook(
        config.max_staleness, plan.steps_per_generation * config.num_iterations / plan.gradient_accumulation_steps
    )
    if resume is not None:
        book.load_state_dict(resume)
    book.start(version())
    producer = None
    if worker is not None:
        per_slot = plan.completions_per_generation
        auto = max(config.max_staleness, 1) * plan.completions_per_optimizer_step
        limits = Limits(
            in_flight=max(config.max_inflight_tasks if config.max_inflight_tasks > 0 else auto, per_slot),
            queue=max(config.queue_maxsize, per_slot),
            heartbeat_s=config.heartbeat_stale_after_s,
        )
        producer = Producer(
            book,
            draw=maker.sampler.next_generation,
            sample=lambda slot: sample_slot(maker, backend, slot),
            backend=backend,
            worker=worker,
            limits=limits,
            completions_per_slot=per_slot,
        )
    return AsyncRollouts(maker, book, producer, version)


def sample_slot(maker: Any, backend: Any, slot: Slot) -> list[Completion]:
    """Every group of `slot` sampled whole on the worker, group-major (no collectives: one process asks)."""
    layout = GroupLayout.for_generation(slot.number, len(slot.rows), maker.settings.num_generations, 1, 0)
    prompts = local_prompt_batch(
        slot.indices,
        slot.rows,
        layout,
        tokenize=maker.tokenize,
        remove_unused_columns=maker.settings.remove_unused_columns,
        default_prompt=maker.settings.default_prompt,
    )
    if maker.agent is not None:
        return maker.agent.generate(backend, prompts, maker.sampling, fresh_environments=True)
    per_prompt = sample_groups(backend, prompts.prompt_ids, prompts.num_samples, maker.sampling, prompts.multimodal)
    return [replace(c, prompt_index=b) for b, completions in enumerate(per_prompt) for c in completions]
