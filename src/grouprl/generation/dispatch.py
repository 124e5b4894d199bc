"""Asking a backend for groups of samples, and cutting whole groups back into the processes' shares.

`sample_groups` is the one place that turns "prompt b needs n_b samples" into backend calls: one
call per distinct sample count (usually one: G), each completion routed back to its prompt.

`sample_for_processes` serves a backend that only the main process may talk to (a generation
server, vLLM server): it samples every *whole* group in one request (G samples of one prompt, as TRL
does) and cuts the rows into the processes' shares by the generation's `GroupLayout`. The gathering
and the hand-back to the other processes are the caller's (rollout.py), so this module stays free of
collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grouprl.core.group_layout import GroupLayout
from grouprl.core.types import Completion, SamplingParams


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
    by_count: dict[int, list[int]] = {}
    for b, count in enumerate(counts):
        by_count.setdefault(count, []).append(b)
    per_prompt: list[list[Completion]] = [[] for _ in counts]
    for count, members in by_count.items():
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
    backend: Any, layout: GroupLayout, group_prompt_ids: Sequence[list[int]], params: SamplingParams
) -> list[list[Completion]]:
    """Every whole group of `layout` sampled at once (one prompt per group), then cut into each process's rows."""
    per_group = sample_groups(backend, group_prompt_ids, layout.group_sizes, params)
    return layout.deal([completion for group in per_group for completion in group])
