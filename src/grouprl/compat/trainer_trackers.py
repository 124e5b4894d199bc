"""The report_to trackers (wandb, trackio, tensorboard, ...), started by GRPOTrainer.train() through accelerate."""

from __future__ import annotations

from typing import Any

from grouprl.config.grpo_config import GRPOConfig


def init_trackers(accelerator: Any, args: GRPOConfig) -> None:
    """Start the report_to trackers unless they are open already (from an earlier train() call)."""
    if args.report_to and not accelerator.trackers:
        accelerator.init_trackers(args.project, config=tracker_config(args), init_kwargs=tracker_init_kwargs(args))


def tracker_init_kwargs(args: GRPOConfig) -> dict[str, Any]:
    """Run name (and trackio's Space) for the trackers that take them; args.project names the project."""
    kwargs: dict[str, Any] = {}
    if args.run_name:
        kwargs = {"wandb": {"name": args.run_name}, "trackio": {"name": args.run_name}}
    if args.trackio_space_id:
        kwargs.setdefault("trackio", {})["space_id"] = args.trackio_space_id
    return kwargs


def tracker_config(args: GRPOConfig) -> dict[str, Any]:
    return {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}
