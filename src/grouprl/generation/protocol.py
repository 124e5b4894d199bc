"""The one interface the loop uses to sample completions, and how callers ask a backend for groups of samples.

A backend turns token-id prompts into `Completion`s: sampled token ids with the EOS kept and
nothing after it, the decoded text, why generation stopped, and (if the backend has them) the
logprob of each sampled token under the sampling distribution. The loop never knows which backend
it talks to: transformers `generate`, the fast in-process engine, a generation server or vLLM.

`sample_groups` is the one place that turns "prompt b needs n_b samples" into backend calls: one
call per distinct sample count (usually one: G), each completion routed back to its prompt; a lockstep
backend (sampling from sharded weights) gets one call with every row instead, on every process.

`sample_for_processes` serves a backend that only the main process may talk to (a generation
server, vLLM server): it samples every *whole* group in one request (G samples of one prompt, as TRL
does) and cuts the rows into the processes' shares by the generation's `GroupLayout`. The gathering
and the hand-back to the other processes are the caller's (rollout/sampler.py), so this module stays
free of collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from grouprl.core.types import Completion, GroupLayout, SamplingParams


@runtime_checkable
class GenerationBackend(Protocol):
    """What the training loop samples completions with: `generate` and `sync_weights`.

    Any object with these two methods qualifies (``GRPOTrainer(..., generation_backend=obj)``); no base
    class is needed. Two optional class attributes change how the loop uses it:

    - ``needs_importance_correction`` (default True): False for a backend that samples from the training
      weights in the same process, whose sampler logprobs need no correction.
    - ``main_process_only`` (default False): True for a backend only the main process may call (a server);
      the loop then gathers every process's prompts, the main process samples whole groups and each
      process takes its rows by the generation's GroupLayout (`sample_for_processes`). `sync_weights` is
      still called on every process (gathering sharded weights is collective).

    - ``lockstep`` (default False): True for a backend whose ``generate`` is a collective (it samples from weights
      sharded over the processes): every process then makes exactly one call per generation, with every row it
      needs as a prompt of its own (``num_samples`` 1), and makes it even with no rows (``sample_groups``).

    An optional method, ``release_until_sync()``, frees what the backend holds only to sample; the loop calls it
    once a generation is sampled, and the next ``sync_weights`` comes before the next ``generate``. Another,
    ``report() -> dict[str, float]``, gives statistics since its last call, logged under ``generation/`` with the
    batch's (the captured loop's: ``compile_s``, ``compiled_graphs``); its keys must be fields of
    ``rollout.experience.ExperienceStats``.
    """

    def generate(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> list[Completion]:
        """Sample `num_samples` completions for each prompt; return them prompt-major (len = prompts x num_samples).

        Backends that serve vision-language models also take `multimodal=` (prompts,): each prompt's
        `multimodal.PromptImages` or None; it is passed only when some prompt has images.
        """
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the backend sample from `model`'s current weights (a no-op for in-process backends)."""
        ...


def backend_report(backend: Any) -> dict[str, float]:
    """A backend's optional `report()` (GenerationBackend's doc); {} for one without it, or for None."""
    report = getattr(backend, "report", None)
    return report() if callable(report) else {}


def sample_groups(
    backend: Any,
    prompt_ids: Sequence[list[int]],
    counts: Sequence[int],
    params: SamplingParams,
    multimodal: Sequence[Any] | None = None,
) -> list[list[Completion]]:
    """`counts[b]` completions of each prompt b, as one list per prompt (in the backend's order within it).

    `multimodal`: each prompt's processed images, passed as `multimodal=` (backends without it cannot serve VLMs).
    """
    if getattr(backend, "lockstep", False):  # one call on every process, whatever its rows (GenerationBackend)
        calls = [([b for b, count in enumerate(counts) for _ in range(count)], 1)]
    else:
        by_count: dict[int, list[int]] = {}
        for b, count in enumerate(counts):
            by_count.setdefault(count, []).append(b)
        calls = [(members, count) for count, members in by_count.items()]
    per_prompt: list[list[Completion]] = [[] for _ in counts]
    for members, count in calls:
        ids = [prompt_ids[b] for b in members]
        if multimodal is None:
            completions = backend.generate(ids, count, params)
        else:
            completions = backend.generate(ids, count, params, multimodal=[multimodal[b] for b in members])
        if len(completions) != len(members) * count:
            raise RuntimeError(
                f"{type(backend).__name__}.generate returned {len(completions)} completions for {len(members)} prompts "
                f"x {count}."
            )
        for completion in completions:
            per_prompt[members[completion.prompt_index]].append(completion)
    return per_prompt


def sample_for_processes(
    backend: Any,
    layout: GroupLayout,
    group_prompt_ids: Sequence[list[int]],
    params: SamplingParams,
    group_images: Sequence[Any] | None = None,
) -> list[list[Completion]]:
    """Every whole group of `layout` sampled at once (one prompt per group), then cut into each process's rows.
    `group_images`: each group's prompt's `multimodal.PromptImages` or None; None when no prompt has images."""
    per_group = sample_groups(backend, group_prompt_ids, layout.group_sizes, params, group_images)
    return layout.deal([completion for group in per_group for completion in group])


def cut_at_eos(token_ids: list[int], eos_token_ids: set[int]) -> tuple[list[int], str]:
    """Keep tokens up to and including the first EOS; report 'stop' if one was found, else 'length'."""
    for position, token in enumerate(token_ids):
        if token in eos_token_ids:
            return token_ids[: position + 1], "stop"
    return token_ids, "length"


def left_pad(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) token ids and (B, P) long attention mask, left-padded so each prompt ends next to its completion."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, p in enumerate(prompt_ids):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask
