"""Run health: early warnings for runs that learn nothing, and a safe stop on NaN / inf.

Silent failures. Each detector is a pure function over one optimizer step's metrics (TRL's names)
that returns `Finding`s: the metric, its value, what it means and the likely fix. `HealthMonitor`
warns about each kind once, counts the steps where it recurs and logs a summary at the end.

    detector                      metric                                         fires when
    truncated completions         completions/clipped_ratio                      > 0.5
    groups without signal         frac_reward_zero_std                           > 0.5
    reward function never applies rewards/<name>/mean                            None for every row
    samples masked out            sampling/importance_sampling_masked_fraction,  > 0.5
                                  off_policy_mask/dropped_fraction
    entropy collapse              entropy                                        < 0.01 nats / token
    learning rate 0               learning_rate                                  == 0 (not the first
                                                                                 step of a warmup)

Non-finite values stop the run before they reach the weights: the advantages, each micro-batch's
loss and the gradients are finite() checks of the step's statistics (stats.py), reduced with them
once per optimizer step, before the update, so every process learns which process saw a NaN / inf
and all raise the same `NonFiniteError` (`non_finite_error`) together: none is left waiting in a
collective. (A reward function returning one raises `RewardFunctionError` naming the function, in
rewards/scoring.py.) The loop then saves the last good state first (`save_last_good`). That state is exact:
the model, optimizer and scheduler do not change until the optimizer step, which a failing step
never reaches, and `RunHealth.start_step` kept the rest (RNG, sampler position, buffered
micro-batches, metric window, entropy controller) as it was when the step began. So the
checkpoint equals the one a save after the previous step would have written.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from transformers.utils import logging

from grouprl.core.metrics import MetricWindow
from grouprl.train.checkpoint import COMPLETE_MARKER, rng_state
from grouprl.train.step_reduction import Failure, first_failure_of

logger = logging.get_logger("grouprl")

MOST = 0.5  # "most completions / groups / tokens": more than half
COLLAPSED_ENTROPY = 0.01  # nats per token: sampling is (almost) deterministic


class NonFiniteError(FloatingPointError):
    """NaN or inf in the advantages, the loss or the gradients; the run stopped before the update."""


@dataclass(frozen=True)
class Finding:
    kind: str  # warned once per kind ("reward_none:<function>" per reward function)
    title: str  # a few words for the summary
    metric: str
    value: float
    message: str  # what it means and the likely fix


def _number(stats: dict[str, Any], name: str) -> Optional[float]:
    value = stats.get(name)
    return float(value) if isinstance(value, (int, float)) and not math.isnan(value) else None


# ---- detectors: pure functions over one step's metrics --------------------------------------------


def truncated_completions(
    stats: dict[str, Any], *, max_completion_length: Optional[int] = None, threshold: float = MOST
) -> list[Finding]:
    value = _number(stats, "completions/clipped_ratio")
    if value is None or value <= threshold:
        return []
    limit = f"max_completion_length={max_completion_length}" if max_completion_length else "max_completion_length"
    return [
        Finding(
            "truncated",
            "most completions truncated",
            "completions/clipped_ratio",
            value,
            f"{value:.0%} of completions hit {limit} before ending, and truncated answers rarely earn reward, so the rewards "
            "carry little signal. Raise max_completion_length, ask for shorter answers in the prompt, or set "
            "mask_truncated_completions=True to train on finished completions only.",
        )
    ]


def tied_groups(stats: dict[str, Any], *, threshold: float = MOST) -> list[Finding]:
    value = _number(stats, "frac_reward_zero_std")
    if value is None or value <= threshold:
        return []
    return [
        Finding(
            "zero_std",
            "most groups without reward signal",
            "frac_reward_zero_std",
            value,
            f"{value:.0%} of groups gave all their completions the same reward, so their advantages are 0 and they teach "
            "nothing (a loss near 0 is expected then). Make the reward finer-grained (partial credit) or the prompts closer "
            "to what the model can just solve, raise num_generations or temperature, or set dynamic_sampling=True.",
        )
    ]


def unscorable_reward_functions(stats: dict[str, Any]) -> list[Finding]:
    findings = []
    for name in stats:
        if name.startswith("rewards/") and name.endswith("/mean") and _number(stats, name) is None:
            function = name[len("rewards/") : -len("/mean")]
            findings.append(
                Finding(
                    f"reward_none:{function}",
                    f"reward function '{function}' never applies",
                    name,
                    math.nan,
                    f"Reward function '{function}' returned None for every completion, so it adds nothing to the reward. Check "
                    "the dataset columns it reads and the completion format it expects (conversational completions are lists "
                    "of messages), or remove it from reward_funcs.",
                )
            )
    return findings


def masked_samples(stats: dict[str, Any], *, threshold: float = MOST) -> list[Finding]:
    findings = []
    value = _number(stats, "sampling/importance_sampling_masked_fraction")
    if value is not None and value > threshold:
        gap = _number(stats, "sampling/sampling_logp_difference/mean")
        findings.append(
            Finding(
                "is_masked",
                "sampler correction masks most samples",
                "sampling/importance_sampling_masked_fraction",
                value,
                f"The sampler-mismatch correction gave weight 0 to {value:.0%} of the loss tokens (sequences in sequence modes), "
                "so they train nothing: the generation engine's log-probabilities are far from the trainer's"
                + (f" (sampling/sampling_logp_difference/mean = {gap:.3g})" if gap is not None else "")
                + ". Check that the engine gets the current weights and uses the same temperature and dtype as training; or "
                "widen vllm_importance_sampling_clip_min / vllm_importance_sampling_clip_max, or use a *_truncate mode.",
            )
        )
    value = _number(stats, "off_policy_mask/dropped_fraction")
    if value is not None and value > threshold:
        findings.append(
            Finding(
                "off_policy_masked",
                "off-policy mask drops most sequences",
                "off_policy_mask/dropped_fraction",
                value,
                f"off_policy_mask_threshold dropped {value:.0%} of the sequences, so they train nothing: the samples are too far "
                "off-policy. Raise off_policy_mask_threshold, or lower num_iterations / steps_per_generation.",
            )
        )
    return findings


def collapsed_entropy(stats: dict[str, Any], *, threshold: float = COLLAPSED_ENTROPY) -> list[Finding]:
    value = _number(stats, "entropy")
    if value is None or value >= threshold:
        return []
    return [
        Finding(
            "entropy",
            "entropy collapsed",
            "entropy",
            value,
            f"The policy's mean token entropy is {value:.2g} nats: sampling has become (almost) deterministic, so the "
            "completions of a group are near-identical and exploration has stopped. Lower learning_rate, add a KL penalty "
            "(beta > 0) or an entropy bonus (entropy_coef, use_adaptive_entropy), or raise temperature.",
        )
    ]


def zero_learning_rate(stats: dict[str, Any], *, step: int, warmup: bool = False) -> list[Finding]:
    value = _number(stats, "learning_rate")
    if value is None or value != 0.0 or (warmup and step <= 1):  # a warmup starts at 0 on its first step
        return []
    return [
        Finding(
            "zero_lr",
            "learning rate 0",
            "learning_rate",
            value,
            f"The learning rate is 0 at step {step}, so the optimizer step changes nothing. Check GRPOConfig.learning_rate "
            "and the schedule (lr_scheduler_type, lr_scheduler_kwargs, warmup_steps).",
        )
    ]


def detect(
    stats: dict[str, Any], *, step: int, max_completion_length: Optional[int] = None, warmup: bool = False
) -> list[Finding]:
    """Every detector's findings for one step's metrics."""
    return [
        *truncated_completions(stats, max_completion_length=max_completion_length),
        *tied_groups(stats),
        *unscorable_reward_functions(stats),
        *masked_samples(stats),
        *collapsed_entropy(stats),
        *zero_learning_rate(stats, step=step, warmup=warmup),
    ]


# ---- warn once, then summarise ---------------------------------------------------------------------


@dataclass
class _Seen:
    finding: Finding  # the first one
    first_step: int
    last_step: int
    steps: int = 1


class HealthMonitor:
    """Warns about each kind of finding the first time it appears; counts the rest for `summary`."""

    def __init__(self) -> None:
        self.seen: dict[str, _Seen] = {}
        self.steps_checked = 0

    def observe(self, findings: list[Finding], step: int) -> list[Finding]:
        """Record one step's findings; warn about (and return) the kinds not seen before."""
        self.steps_checked += 1
        new = []
        for finding in findings:
            seen = self.seen.get(finding.kind)
            if seen is not None:
                seen.steps, seen.last_step = seen.steps + 1, step
                continue
            self.seen[finding.kind] = _Seen(finding, step, step)
            new.append(finding)
            logger.warning(
                "grouprl health warning at step %d: %s [%s = %.4g]. (Shown once; later steps are counted in the summary "
                "at the end of training.)",
                step,
                finding.message,
                finding.metric,
                finding.value,
            )
        return new

    def summary(self) -> Optional[str]:
        if not self.seen:
            return None
        lines = [f"grouprl health summary ({self.steps_checked} step(s) checked):"]
        for seen in self.seen.values():
            lines.append(
                f"  - {seen.finding.title} ({seen.finding.metric}): {seen.steps} step(s), "
                f"steps {seen.first_step}-{seen.last_step}"
            )
        return "\n".join(lines)


# ---- the loop's hooks ---------------------------------------------------------------------------------


@dataclass
class LastGoodState:
    step: int
    loop_state: dict[str, Any]  # without the reference weights: they change only after the optimizer step
    rng: dict[str, Any]


class RunHealth:
    """Per-run state of the hooks: the monitor, the last good state, where this step's metrics begin."""

    def __init__(self) -> None:
        self.monitor = HealthMonitor()
        self.last_good: Optional[LastGoodState] = None
        self._mark: dict[str, int] = {}

    def start_step(self, step: int, loop_state: dict[str, Any], window: MetricWindow) -> None:
        self.last_good = LastGoodState(step, loop_state, rng_state())
        self._mark = window.mark()

    def end_step(
        self,
        window: MetricWindow,
        *,
        step: int,
        warn: bool,
        max_completion_length: Optional[int] = None,
        warmup: bool = False,
    ) -> dict[str, Any]:
        """After the optimizer step: close the phase timers, run the detectors (`warn`: this process reports, the
        metrics being global); returns the step's metrics."""
        window.close_step()
        stats = window.summary(since=self._mark)
        if warn:
            self.monitor.observe(
                detect(stats, step=step, max_completion_length=max_completion_length, warmup=warmup), step
            )
        return stats

    def finish(self) -> None:
        summary = self.monitor.summary()
        if summary:
            logger.warning(summary)


# ---- non-finite values: what each finite() check says -----------------------------------------------


def describe_non_finite(failure: Failure, step: int) -> str:
    """This process's sentence for a failed finite() check (stats.finite): where the NaN / inf is and what to try."""
    entry = failure.entry
    if failure.check == "advantages":
        advantages = entry.advantages.detach().cpu()
        bad = (~torch.isfinite(advantages)).nonzero().flatten().tolist()
        return (
            f"Advantages are not finite at step {step}: {len(bad)} of {len(advantages)} rows are NaN or inf "
            f"(first: row {bad[0]}). The rewards were finite, so the advantage computation produced them: check a custom "
            "RolloutMaker or group filter, and keep rewards in a moderate range."
        )
    if failure.check == "loss":
        culprits = [name for name, ok in (entry.loss_inputs or {}).items() if not bool(ok)]
        where = ", ".join(culprits) if culprits else "none of its inputs (a loss term overflowed)"
        return (
            f"The loss is {float(entry.loss)} at step {step}; non-finite inputs: {where}. The update was not applied. "
            "Usually weights or activations overflowed: lower learning_rate, keep max_grad_norm > 0, prefer bf16 to fp16; "
            "non-finite reference log-probabilities point at the reference model."
        )
    if failure.check == "gradients":
        return (
            f"The gradients are not finite at step {step} (grad_norm = {float(entry.grad_norm)}) although the loss was "
            "finite; the update was not applied. Lower learning_rate, keep max_grad_norm > 0, prefer bf16 to fp16, and check "
            "custom layers or backward hooks."
        )
    return f"{failure.check} is not finite at step {step}; the update was not applied."


def non_finite_error(
    failures: list[Failure], *, step: int, process_index: int, num_processes: int, gather: Callable[[Any], list[Any]]
) -> NonFiniteError:
    """The one error every process raises when a finite() check failed anywhere in this step. Each process describes
    its own first failure (the cause; what follows from it is left out); `gather` (a collective every process reaches,
    since every process got the same failures from the step's reduction) shares the sentences, so all raise the same
    message naming the processes."""
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


def save_last_good(
    good: Optional[LastGoodState],
    *,
    step: int,
    loop_state: Callable[[], dict[str, Any]],
    output_dir: str,
    writes: bool,
    write: Callable[[int, dict[str, Any], Optional[dict[str, Any]]], Any],
) -> str:
    """Checkpoint the state before the failing step (or, if the failure came after its optimizer step,
    e.g. in evaluation, the state after it); returns a sentence saying where it is. `write(step, loop_state, rng)`
    writes a checkpoint; `writes`: this process writes (the main one)."""
    if good is not None and good.step == step:  # the failing step had not updated anything yet
        step, state, rng = good.step, {**loop_state(), **good.loop_state}, good.rng
    else:
        state, rng = loop_state(), None
    if step == 0:
        return "The run stopped before its first update, so there was no trained state to save."
    path = os.path.join(output_dir, f"checkpoint-{step}")
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)) and writes:
        try:
            write(step, state, rng)
        except Exception as save_error:  # noqa: BLE001 - the original error matters more; say why nothing was saved
            return f"Saving the last good state (step {step}) failed too: {type(save_error).__name__}: {save_error}"
    return (
        f"The last good state (after step {step}) is saved in {path}: fix the cause, then resume with "
        "trainer.train(resume_from_checkpoint=True) or grouprl train ... --resume_from_checkpoint true."
    )
