"""The best checkpoint by an evaluation metric, as transformers' Trainer keeps it.

``metric_for_best_model`` names an evaluation metric (``reward`` means ``eval_reward``);
``greater_is_better`` its direction (transformers' default: False for names ending in ``loss``).
After each evaluation ``state.best_metric`` / ``state.best_global_step`` follow the best value, the
checkpoint written at that step becomes ``state.best_model_checkpoint`` (spared by
save_total_limit), ``save_strategy="best"`` writes a checkpoint exactly when a new best appears, and
``load_best_model_at_end`` loads it after training. ``EarlyStoppingCallback`` reads the same state.
"""

from __future__ import annotations

from typing import Any


def metric_key(metric_for_best_model: str) -> str:
    return metric_for_best_model if metric_for_best_model.startswith("eval_") else f"eval_{metric_for_best_model}"


def record_evaluation(config: Any, state: Any, metrics: dict[str, Any]) -> bool:
    """Update the best metric from an evaluation's metrics; True when this evaluation is a new best."""
    if config.metric_for_best_model is None:
        return False
    key = metric_key(config.metric_for_best_model)
    if key not in metrics:
        raise KeyError(
            f"GRPOConfig.metric_for_best_model={config.metric_for_best_model!r}: the evaluation logged no {key!r}. "
            f"It logged: {', '.join(sorted(k for k in metrics if k.startswith('eval_')))}. Name one of those."
        )
    value = float(metrics[key])
    improved = state.best_metric is None or (
        value > state.best_metric if config.greater_is_better else value < state.best_metric
    )
    if improved:
        state.best_metric, state.best_global_step = value, state.global_step
    return improved
