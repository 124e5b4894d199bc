"""Checks of the asynchronous-generation fields (grpo_fields.py), run with the rest of GRPOConfig's checks."""

from __future__ import annotations

from grouprl.config.grpo_fields import ASYNC_WORKERS, GRPOFields


def check_async_fields(config: GRPOFields) -> None:
    if config.async_worker not in ASYNC_WORKERS:
        raise ValueError(
            f"GRPOConfig.async_worker={config.async_worker!r} is not one of {', '.join(map(repr, ASYNC_WORKERS))}."
        )
    for name, least in (("max_staleness", 0), ("queue_maxsize", 1), ("weight_sync_steps", 1)):
        if getattr(config, name) < least:
            raise ValueError(f"GRPOConfig.{name}={getattr(config, name)} must be >= {least}.")
    if config.max_inflight_tasks != -1 and config.max_inflight_tasks < 1:
        raise ValueError(
            f"GRPOConfig.max_inflight_tasks={config.max_inflight_tasks} must be >= 1, or -1 (auto: max(max_staleness, "
            "1) x the completions of one optimizer step)."
        )
    if config.generation_threads is not None and config.generation_threads < 1:
        raise ValueError(f"GRPOConfig.generation_threads={config.generation_threads} must be >= 1 (None: automatic).")
    for name in ("request_timeout", "weight_sync_timeout", "heartbeat_stale_after_s"):
        if getattr(config, name) <= 0:
            raise ValueError(f"GRPOConfig.{name}={getattr(config, name)} must be > 0 (seconds).")
    if config.max_staleness < config.weight_sync_steps - 1:
        # between two syncs the worker samples with weights up to weight_sync_steps - 1 versions old: every
        # such sample would be dropped, and its regeneration too
        raise ValueError(
            f"GRPOConfig.max_staleness={config.max_staleness} is below weight_sync_steps - 1 = "
            f"{config.weight_sync_steps - 1}: the worker's weights are that many versions old just before a sync, so "
            "its samples could never be trained on. Raise max_staleness or lower weight_sync_steps."
        )
