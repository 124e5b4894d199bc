"""Asynchronous generation for the length of one train() call: the worker, the producer, the CPU threads.

enter:  the main process starts the worker (a local `grouprl serve` from the policy's current weights, or
        connects to the server the config names, which is then sent the policy's weights first), every
        process builds the source RolloutMaker.draw_prompts takes generations from (async_rollouts.py),
        a resumed run's drawn-but-untrained prompt batches first; on a CPU with a local worker the
        trainer keeps the cores the worker does not use
during: the loop publishes the weights every weight_sync_steps optimizer steps (loop.py)
exit:   (also on errors) the producer stops, the local worker is stopped, the thread count restored
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from grouprl.core.distributed import run_on_main
from grouprl.generation.remote import RemoteGenerator
from grouprl.generation.server_client import server_base_url
from grouprl.generation.workers import LocalWorker, ServerWorker, policy_weights
from grouprl.rollout.async_rollouts import start_async_rollouts
from grouprl.train.training_run import TrainingRun


def uses_server(config: Any) -> bool:
    """async_worker: 'server', or 'auto' with a server named by the config; else a local worker."""
    if config.async_worker != "auto":
        return config.async_worker == "server"
    return bool(config.vllm_server_base_url) or config.use_vllm or config.generation_engine == "server"


@contextmanager
def async_generation(run: TrainingRun, tokenizer: Any) -> Iterator[Optional[Any]]:
    """With async_generation: yields the client of the worker (the main process's; None elsewhere), else None."""
    config = run.config
    if not config.async_generation:
        if run.async_resume and run.async_resume.get("slots"):
            raise ValueError(
                "The checkpoint was written with async_generation=True and holds prompt batches drawn but not trained "
                "on yet; resume it with async_generation=True, so that they are trained on first."
            )
        yield None
        return
    model = run.accelerator.unwrap_model(run.model)
    version = run.state.global_step
    parts: dict[str, Any] = {}
    threads = torch.get_num_threads()
    source = None
    try:
        # a local worker starts from the policy's weights, gathered by every process when they are sharded
        weights = None if uses_server(config) else policy_weights(model)
        run_on_main(
            lambda: parts.update(start_worker(config, model, tokenizer, run.rollouts.backend, version, weights))
        )
        if parts.get("threads"):
            torch.set_num_threads(max(1, threads - parts["threads"]))
        resume = run.async_resume or {
            "next_take": run.rollouts.generations_made,
            "next_number": run.rollouts.generations_made,
            "slots": [],
        }
        source = start_async_rollouts(
            run.rollouts,
            backend=parts.get("backend"),
            worker=parts.get("worker"),
            config=config,
            plan=run.plan,
            version=lambda: run.state.global_step,
            resume=resume,
        )
        run.async_resume = None
        run.rollouts.source = source
        if uses_server(config):  # a server's weights are not the policy's until sent
            source.publish(model, version)
        yield parts.get("backend")
    finally:
        run.rollouts.source = None
        if source is not None:
            source.stop()
        if parts.get("worker") is not None:
            parts["worker"].stop()
        torch.set_num_threads(threads)


def start_worker(
    config: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    backend: Any,
    version: int,
    weights: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, Any]:
    """The worker and its client (main process): a local `grouprl serve` started from `weights` (`policy_weights`),
    or the server the config names."""
    if uses_server(config):
        url = server_base_url(config.vllm_server_base_url, config.vllm_server_host, config.vllm_server_port)
        client = backend if isinstance(backend, RemoteGenerator) else None
        worker: Any = ServerWorker(url)
    else:
        on_cpu = next(model.parameters()).device.type == "cpu"
        threads = config.generation_threads or (max(1, torch.get_num_threads() // 2) if on_cpu else None)
        worker = LocalWorker(
            model,
            tokenizer,
            weights=weights,
            threads=threads,
            log_path=os.path.join(config.output_dir, "generation_worker.log"),
            startup_timeout=config.vllm_server_timeout,
            seed=config.seed,
            generation_engine=config.generation_engine,
        )
        url, client = worker.start(version), None
    if client is None:
        client = RemoteGenerator(
            url,
            tokenizer=tokenizer,
            retries=config.generation_server_retries,
            weight_transfer=config.generation_server_weight_transfer,
            group_port=config.vllm_group_port,
            connect=False,
        )
        client.info = client.wait_until_ready()
        client.model_name = client.info.get("model")
        if not client.is_grouprl:
            client = vllm_client(config, url, tokenizer)
    client.timeout, client.timeout_name = float(config.request_timeout), "request_timeout"
    client.weight_timeout = float(config.weight_sync_timeout)
    local = isinstance(worker, LocalWorker)
    return {"worker": worker, "backend": client, "threads": worker.threads if local and worker.threads else 0}


def vllm_client(config: Any, url: str, tokenizer: Any) -> Any:
    """A `vllm serve` worker: vLLM's NCCL weight transfer (one training process: its set-up is collective)."""
    from accelerate import PartialState

    from grouprl.generation.vllm import VLLMServerGenerator

    if PartialState().num_processes > 1:
        raise NotImplementedError(
            f"async_generation with a `vllm serve` worker ({url}) runs on one training process in this version of "
            "grouprl; use a `grouprl serve` worker (async_worker='local') or one training process."
        )
    return VLLMServerGenerator.from_fields(url, tokenizer, config, timeout=config.request_timeout)
