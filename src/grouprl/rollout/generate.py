"""One generation's sampling call: each prompt's completions from the backend, in row order.

In-process backends sample on every process; a backend only the main process may use (a server)
samples whole groups there for every process.
"""

from __future__ import annotations

from dataclasses import replace

from grouprl.core.distributed import gather_objects, layout_of, run_on_main
from grouprl.core.types import Completion, PromptBatch, SamplingParams
from grouprl.generation.dispatch import sample_for_processes, sample_groups
from grouprl.generation.protocol import GenerationBackend


def generate_for(backend: GenerationBackend, prompts: PromptBatch, params: SamplingParams) -> list[Completion]:
    """Ask the backend for each prompt's num_samples completions; return them in row order.

    Prompts on a process usually all need G samples; a group cut by a process boundary needs fewer
    (dispatch.sample_groups sends one call per distinct count). A backend that only the main process
    may use (`main_process_only`: a server) samples whole groups there for every process.
    """
    if getattr(backend, "main_process_only", False):
        return generate_on_main_process(backend, prompts, params)
    per_prompt = sample_groups(backend, prompts.prompt_ids, prompts.num_samples, params, prompts.multimodal)
    return [replace(c, prompt_index=b) for b, completions in enumerate(per_prompt) for c in completions]


def generate_on_main_process(
    backend: GenerationBackend, prompts: PromptBatch, params: SamplingParams
) -> list[Completion]:
    """This process's completions (row order of `prompts`), sampled as whole groups by the main process for everyone.

    An exception there is raised on every process (run_on_main), so no process waits in a collective for ever.
    """
    if prompts.multimodal is not None:
        raise NotImplementedError(
            f"{type(backend).__name__} samples text prompts only; prompts with images need an in-process "
            "backend (generation_engine='auto' or 'transformers')."
        )
    layout = layout_of(prompts)
    group_prompts = layout.join(gather_objects(prompts.prompt_ids))  # the main process needs every group's prompt
    shares = run_on_main(lambda: sample_for_processes(backend, layout, group_prompts, params))
    return [replace(c, prompt_index=b) for c, b in zip(shares[layout.process_index], prompts.row_index())]
