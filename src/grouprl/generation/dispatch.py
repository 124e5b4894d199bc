"""Generation for a backend that only the main process talks to (a generation server, vLLM server).

Every process holds a slice of the global generation batch; a group may be cut by a process
boundary. The processes send their prompts to the main process, which asks the backend for each
*whole* group (G samples of one prompt in one request, as TRL does), cuts every group's
completions back into the processes' slices in global row order, and hands each process its own.
"""

from __future__ import annotations

from typing import Any

from accelerate import PartialState

from ..distributed import gather_objects, run_on_main
from ..types import Completion, PromptBatch, SamplingParams


def generate_on_main_process(backend: Any, prompts: PromptBatch, params: SamplingParams) -> list[Completion]:
    """This process's completions (row order of `prompts`), sampled by the main process for everyone."""
    if prompts.multimodal is not None:
        raise NotImplementedError(f"{type(backend).__name__} samples text prompts only; prompts with images need an in-process "
                                  "backend (generation_engine='auto' or 'transformers').")
    state = PartialState()
    local = list(zip(prompts.group_ids, prompts.prompt_ids, prompts.num_samples))
    everyone = gather_objects(local)  # [process] -> [(group id, prompt ids, samples wanted here)]
    slices = run_on_main(lambda: _sample_and_cut(backend, everyone, params))
    mine = slices[state.process_index]
    for completion, b in zip(mine, prompts.row_index()):
        completion.prompt_index = b
    return mine


def _sample_and_cut(backend: Any, everyone: list[list[tuple[int, list[int], int]]], params: SamplingParams) -> list[list[Completion]]:
    groups: dict[int, list] = {}  # group id -> [prompt ids, total samples], in global order
    for part in everyone:
        for group_id, prompt_ids, count in part:
            groups.setdefault(group_id, [prompt_ids, 0])[1] += count
    by_count: dict[int, list[int]] = {}  # one request per distinct group size (usually one: G)
    for group_id, (_, total) in groups.items():
        by_count.setdefault(total, []).append(group_id)
    sampled: dict[int, list[Completion]] = {}
    for total, members in by_count.items():
        completions = backend.generate([groups[g][0] for g in members], total, params)
        if len(completions) != len(members) * total:
            raise RuntimeError(f"{type(backend).__name__}.generate returned {len(completions)} completions for {len(members)} prompts x {total}.")
        for completion in completions:
            sampled.setdefault(members[completion.prompt_index], []).append(completion)
    taken = {g: 0 for g in groups}
    slices = []
    for part in everyone:  # processes in order: each takes the next `count` samples of its groups
        mine = []
        for group_id, _, count in part:
            mine.extend(sampled[group_id][taken[group_id] : taken[group_id] + count])
            taken[group_id] += count
        slices.append(mine)
    return slices
