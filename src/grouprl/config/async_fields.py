"""GRPOConfig's asynchronous-generation fields (grouprl; named as TRL's ``trl.experimental.async_grpo``).

With ``async_generation=True`` a generation worker in its own process (a local ``grouprl serve`` the trainer
starts, or a server it is pointed at) samples the next prompt batches while the trainer trains on earlier
ones; each sample carries the weight version that drew it, and a sample more than ``max_staleness`` versions
old is dropped and its prompts regenerated (docs/async.md). ``GRPOConfig`` inherits these as a mixin, after
TRL's own fields; ``compat/async_config.py`` presets them as TRL's ``AsyncGRPOConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

ASYNC_WORKERS = ("auto", "local", "server")


def _meta(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


@dataclass
class AsyncGenerationFields:
    """Generation overlapped with training: the worker, the staleness bound, the queue and the weight syncs."""

    async_generation: bool = field(
        default=False,
        metadata=_meta(
            "grouprl: generate in a separate worker process while training (AsyncGRPOTrainer's mode): the trainer "
            "takes finished generations in prompt order from a bounded queue, samples older than max_staleness "
            "weight versions are dropped and regenerated, the sampler-mismatch correction (vllm_importance_sampling_*) "
            "weights the rest."
        ),
    )
    async_worker: str = field(
        default="auto",
        metadata=_meta(
            "grouprl, with async_generation: 'local' (start a `grouprl serve` worker from the policy's weights, "
            "stopped when training ends), 'server' (the server at vllm_server_base_url / vllm_server_host:"
            "vllm_server_port: `grouprl serve` or, with use_vllm=True, `vllm serve`), or 'auto' (a server when "
            "vllm_server_base_url, generation_engine='server' or use_vllm=True names one, else local)."
        ),
    )
    max_staleness: int = field(
        default=4,
        metadata=_meta(
            "With async_generation: the most optimizer steps a sample's weights may lag behind the weights it "
            "is trained on; older samples are dropped (counted in async/dropped_groups) and their prompts "
            "regenerated. 0 trains on samples from the current weights only."
        ),
    )
    max_inflight_tasks: int = field(
        default=-1,
        metadata=_meta(
            "With async_generation: the most completions requested from the worker and not yet finished; -1 "
            "(auto): max(max_staleness, 1) x the completions of one optimizer step."
        ),
    )
    queue_maxsize: int = field(
        default=1024,
        metadata=_meta(
            "With async_generation: the most finished completions waiting for the trainer (whole generation "
            "batches; one batch always fits)."
        ),
    )
    weight_sync_steps: int = field(
        default=1,
        metadata=_meta(
            "With async_generation: send the weights to the worker every this many optimizer steps (needs "
            "max_staleness >= weight_sync_steps - 1)."
        ),
    )
    generation_threads: Optional[int] = field(
        default=None,
        metadata=_meta(
            "grouprl, with async_generation and a local worker on the CPU: the worker's torch threads (default: half "
            "the cores, at least 1); training then uses the other cores, restored when train() ends."
        ),
    )
    request_timeout: float = field(
        default=600.0,
        metadata=_meta("With async_generation: seconds to wait for one generation request to the worker."),
    )
    weight_sync_timeout: float = field(
        default=1800.0,
        metadata=_meta("With async_generation: seconds to wait for one weight transfer to the worker."),
    )
    heartbeat_stale_after_s: float = field(
        default=300.0,
        metadata=_meta(
            "With async_generation: a worker that has not answered for this many seconds is treated as dead: "
            "a local worker is restarted once, otherwise training stops with an error naming it."
        ),
    )
