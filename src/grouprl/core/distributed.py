"""Cross-process helpers. Every process holds a contiguous share of a generation batch's rows, in
process order (GroupLayout in types.py says which), so concatenating along dim 0 restores the global
group-major order."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from accelerate import Accelerator, PartialState

from grouprl.core.types import GroupLayout, PromptBatch, Rollout


def gather_rows(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equally-sized per-process tensors along dim 0 (no-op on one process)."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.gather(tensor.to(accelerator.device)).cpu()


def global_sum(accelerator: Accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return float(value)
    total = accelerator.reduce(torch.tensor([float(value)], device=accelerator.device), reduction="sum")
    return float(total.item())


def global_mean(accelerator: Accelerator, value: float) -> float:
    return global_sum(accelerator, value) / accelerator.num_processes


def gather_objects(value: Any) -> list[Any]:
    """[value of process 0, value of process 1, ...] on every process (pickled; for small Python objects)."""
    state = PartialState()
    if state.num_processes == 1:
        return [value]
    gathered = [None] * state.num_processes
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def broadcast_from_main(value: Any) -> Any:
    """The main process's `value` on every process (pickled; other processes pass None)."""
    state = PartialState()
    if state.num_processes == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def run_on_main(fn: Callable[[], Any]) -> Any:
    """Run `fn` on the main process only and hand its result to every process.

    An exception on the main process is re-raised on every process (as RuntimeError on the
    others), so a failure there (an unreachable server, say) stops the whole job instead of
    leaving the other processes waiting forever in the next collective.
    """
    state = PartialState()
    result, error = None, None
    if state.is_main_process:
        try:
            result = fn()
        except Exception as err:  # handed to the other processes, then raised here too
            error = err
    if state.num_processes > 1:
        result, message = broadcast_from_main((result, None if error is None else f"{type(error).__name__}: {error}"))
        if message is not None and error is None:
            raise RuntimeError(f"the main process failed: {message}")
    if error is not None:
        raise error
    return result


def layout_of(prompts: PromptBatch) -> GroupLayout:
    """The batch's group layout; for a batch built without one, each process's prompts as whole groups of its own."""
    if prompts.layout is not None:
        return prompts.layout
    state = PartialState()
    return GroupLayout.uncut(gather_objects(list(prompts.num_samples)), state.process_index)


def whole_groups(rollout: Rollout, layout: GroupLayout) -> Rollout:
    """The global generation batch on every process: each process's share gathered, cut groups joined."""
    if layout.num_processes == 1:
        return rollout
    return join_rollouts(layout, gather_objects(rollout))


def keep_rows(rollout: Rollout, layout: GroupLayout, keep: Sequence[bool]) -> Rollout:
    """This process's share of the rows a global (rows,) mask keeps, laid out by layout.select_rows(keep).

    Rows change process only when the kept rows no longer split evenly along the old shares; then the
    rollout is gathered whole and dealt out again.
    """
    if layout.keeps_rows_in_place(keep):
        return keep_own_rows(layout, rollout, keep)
    whole = whole_groups(rollout, layout)
    kept_whole = keep_own_rows(GroupLayout.dealt(layout.group_ids, layout.group_sizes, 1), whole, keep)
    return own_rollout(layout.select_rows(keep), kept_whole)


def keep_row_values(values: list[Any], layout: GroupLayout, keep: Sequence[bool]) -> list[Any]:
    """keep_rows for a per-row list of this process (e.g. a reward function's logged extras)."""
    if layout.keeps_rows_in_place(keep):
        return [v for v, k in zip(values, keep[layout.local_rows]) if k]
    everything = [v for part in gather_objects(values) for v in part]
    return [v for v, k in zip(everything, keep) if k][layout.select_rows(keep).local_rows]


# ---- rollouts under a layout -------------------------------------------------------------------


def join_rollouts(layout: GroupLayout, parts: Sequence[Rollout]) -> Rollout:
    """The whole-groups rollout from every process's share (process order): cut groups joined, rows in global order."""
    for p, part in enumerate(parts):
        if part.prompts.num_samples != [n for _, n in layout.pieces(p)]:
            raise ValueError(
                f"process {p}'s rollout holds {part.prompts.num_samples} rows per prompt; its layout share is "
                f"{[n for _, n in layout.pieces(p)]}."
            )
    everything = Rollout.concat(list(parts))  # one prompt entry per piece
    piece_group = [g for p in range(layout.num_processes) for g, _ in layout.pieces(p)]
    first_piece = {}
    for i, g in enumerate(piece_group):
        first_piece.setdefault(g, i)
    prompts = everything.prompts.subset(
        [first_piece[g] for g in range(layout.num_groups)], list(layout.group_sizes), layout
    )
    prompts.prompts_given = all(part.prompts.prompts_given for part in parts)
    row_groups = layout.row_groups()
    return Rollout(prompts, [replace(c, prompt_index=row_groups[r]) for r, c in enumerate(everything.completions)])


def own_rollout(layout: GroupLayout, whole: Rollout) -> Rollout:
    """This process's share of a whole-groups rollout laid out by `layout` (its groups in layout order)."""
    if whole.prompts.num_samples != list(layout.group_sizes):
        raise ValueError(
            f"own_rollout: the rollout's groups hold {whole.prompts.num_samples} rows; the layout says "
            f"{list(layout.group_sizes)}."
        )
    pieces = layout.pieces()
    prompts = whole.prompts.subset([g for g, _ in pieces], [n for _, n in pieces], layout)
    local_index = {g: i for i, (g, _) in enumerate(pieces)}
    row_groups = layout.row_groups()
    completions = [
        replace(whole.completions[r], prompt_index=local_index[row_groups[r]])
        for r in layout.rows(layout.process_index)
    ]
    return Rollout(prompts, completions)


def keep_own_rows(layout: GroupLayout, share: Rollout, keep: Sequence[bool]) -> Rollout:
    """This process's kept rows when `keep` (global mask) moves no row to another process (keeps_rows_in_place)."""
    after = layout.select_rows(keep)
    local_keep = list(keep[layout.local_rows])
    counts = [0] * len(share.prompts)
    for b, k in zip(share.row_prompt, local_keep):
        counts[b] += bool(k)
    chosen = [b for b, n in enumerate(counts) if n]
    prompts = share.prompts.subset(chosen, [counts[b] for b in chosen], after)
    new_index = {b: i for i, b in enumerate(chosen)}
    kept = [
        replace(c, prompt_index=new_index[b]) for c, b, k in zip(share.completions, share.row_prompt, local_keep) if k
    ]
    return Rollout(prompts, kept)
