"""Run health: early warnings for runs that learn nothing (the silent-failure detectors), and the state to stop safely.

Once per optimizer step the loop calls `RunHealth.start_step` (keep the last good state, mark where the
step's metrics begin) and `RunHealth.end_step` (run the detectors over the step's metrics). `HealthMonitor`
warns about each kind of finding once, counts the steps where it recurs and logs a summary at the end of
training; the report (report/sections.py) runs the same detectors (`detect`) over a finished run's log entries.

The detectors are pure functions over one optimizer step's metrics (TRL's names). Each returns `Finding`s: the
metric, its value, what it means and the likely fix.

    detector                      metric                                         fires when
    truncated completions         completions/clipped_ratio                      > 0.5
    groups without signal         frac_reward_zero_std                           > 0.5
    reward function never applies rewards/<name>/mean                            None for every row
    no reward at all              rewards/<name>/mean of every function         None for every row
    samples masked out            sampling/importance_sampling_masked_fraction,  > 0.5
                                  off_policy_mask/dropped_fraction
    sampler far from the trainer  sampling/sampling_logp_difference/mean         > 0.1 nats / token
    entropy collapse              entropy                                        < 0.01 nats / token
    learning rate 0               learning_rate                                  == 0 (not the first
                                                                                 step of a warmup)

Non-finite values stop the run before they reach the weights: every process raises the same
`NonFiniteError` (non_finite.py), and the loop saves the last good state first (last_good_state.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from transformers.utils import logging

from grouprl.core.metrics import MetricWindow
from grouprl.train.checkpoint import rng_state
from grouprl.train.last_good_state import LastGoodState

logger = logging.get_logger("grouprl")

MOST = 0.5  # "most completions / groups / tokens": more than half
COLLAPSED_ENTROPY = 0.01  # nats per token: sampling is (almost) deterministic
# nats per token between the sampler's logprobs and the trainer's: bf16 rounding alone measured 0.025-0.046 (the
# captured loop on SmolLM2-135M); a sampler computing something else (a stale copy, another temperature, a wrong step)
SAMPLER_GAP = 0.1


@dataclass(frozen=True)
class Finding:
    kind: str  # warned once per kind ("reward_none:<function>" per reward function, "reward_all_none")
    title: str  # a few words for the summary
    metric: str
    value: float
    message: str  # what it means and the likely fix


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
                "grouprl health warning at step %d: %s [%s = %.4g]. (Shown once; later steps are counted in the "
                "summary at the end of training.)",
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
                f"  - {seen.finding.title} ({seen.finding.metric}): in {seen.steps} of {self.steps_checked} steps "
                f"checked (steps {seen.first_step}-{seen.last_step})"
            )
        return "\n".join(lines)


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


# ---- the detectors ----------------------------------------------------------------------------------------------


def detect(
    stats: dict[str, Any], *, step: int, max_completion_length: Optional[int] = None, warmup: bool = False
) -> list[Finding]:
    """Every detector's findings for one step's metrics."""
    return [
        *truncated_completions(stats, max_completion_length=max_completion_length),
        *tied_groups(stats),
        *unscorable_reward_functions(stats),
        *masked_samples(stats),
        *distant_sampler(stats),
        *collapsed_entropy(stats),
        *zero_learning_rate(stats, step=step, warmup=warmup),
    ]


def _number(stats: dict[str, Any], name: str) -> Optional[float]:
    value = stats.get(name)
    return float(value) if isinstance(value, (int, float)) and not math.isnan(value) else None


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
            f"{value:.0%} of completions hit {limit} before ending, and truncated answers rarely earn reward, "
            "so the rewards carry little signal. Raise max_completion_length, ask for shorter answers in the "
            "prompt, or set mask_truncated_completions=True to train on finished completions only.",
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
            f"{value:.0%} of groups gave all their completions the same reward, so their advantages are 0 and "
            "they teach nothing (a loss near 0 is expected then). Late in a run whose reward rose, these are "
            "mostly prompts the model now always solves: progress, not a fault, though harder prompts would keep "
            "it learning. Otherwise make the reward finer-grained (partial credit) or the prompts closer to what "
            "the model can just solve, raise num_generations or temperature, or set dynamic_sampling=True.",
        )
    ]


def unscorable_reward_functions(stats: dict[str, Any]) -> list[Finding]:
    means = [name for name in stats if name.startswith("rewards/") and name.endswith("/mean")]
    unscorable = [name[len("rewards/") : -len("/mean")] for name in means if _number(stats, name) is None]
    if means and len(unscorable) == len(means):  # no function scored anything: one louder finding, not one each
        listed = ", ".join(f"'{function}'" for function in unscorable)
        return [
            Finding(
                "reward_all_none",
                "no reward at all: nothing is learned",
                "reward",
                math.nan,
                f"Every reward function ({listed}) returned None for every completion, so no completion has a "
                "reward: every advantage is 0, the loss is 0 and the model learns nothing, although the run goes on "
                "(frac_reward_zero_std reads 0 only because no group has rewards to compare). Check the dataset "
                "columns the functions read (passed as keyword arguments of the same name) and the completion "
                "format they expect (conversational completions are lists of messages), and make at least one "
                "function return a number for every completion (None only where it does not apply).",
            )
        ]
    return [
        Finding(
            f"reward_none:{function}",
            f"reward function '{function}' never applies",
            f"rewards/{function}/mean",
            math.nan,
            f"Reward function '{function}' returned None for every completion, so it adds nothing to "
            "the reward. Check the dataset columns it reads and the completion format it expects "
            "(conversational completions are lists of messages), or remove it from reward_funcs.",
        )
        for function in unscorable
    ]


def distant_sampler(stats: dict[str, Any], *, threshold: float = SAMPLER_GAP) -> list[Finding]:
    value = _number(stats, "sampling/sampling_logp_difference/mean")
    if value is None or value <= threshold:
        return []
    return [
        Finding(
            "sampler_gap",
            "the sampler's log-probabilities are far from the trainer's",
            "sampling/sampling_logp_difference/mean",
            value,
            f"The sampled tokens' log-probabilities under the generation backend are {value:.3g} nats a token from "
            f"the training forward's (bf16 rounding alone gives a few hundredths): the sampler computes another "
            "distribution than the one trained. Check that it gets the current weights and the same temperature; "
            "with generation_engine='captured' or 'auto', compare a run with generation_engine='transformers' "
            "(transformers generate, the model's own forward) and report the model type if the gap goes away. "
            "vllm_importance_sampling_correction (on by default) reweights the tokens meanwhile.",
        )
    ]


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
                f"The sampler-mismatch correction gave weight 0 to {value:.0%} of the loss tokens (sequences "
                "in sequence modes), so they train nothing: the generation engine's log-probabilities are far "
                "from the trainer's"
                + (f" (sampling/sampling_logp_difference/mean = {gap:.3g})" if gap is not None else "")
                + ". Check that the engine gets the current weights and uses the same temperature and dtype as "
                "training; or widen vllm_importance_sampling_clip_min / vllm_importance_sampling_clip_max, or "
                "use a *_truncate mode.",
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
                f"off_policy_mask_threshold dropped {value:.0%} of the sequences, so they train nothing: the "
                "samples are too far off-policy. Raise off_policy_mask_threshold, or lower num_iterations / "
                "steps_per_generation.",
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
            f"The policy's mean token entropy is {value:.2g} nats: sampling has become (almost) deterministic, "
            "so the completions of a group are near-identical and exploration has stopped. Lower "
            "learning_rate, add a KL penalty (beta > 0) or an entropy bonus (entropy_coef, "
            "use_adaptive_entropy), or raise temperature.",
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
            f"The learning rate is 0 at step {step}, so the optimizer step changes nothing. Check "
            "GRPOConfig.learning_rate and the schedule (lr_scheduler_type, lr_scheduler_kwargs, warmup_steps).",
        )
    ]
