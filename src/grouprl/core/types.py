"""Typed data passed between the stages of one GRPO step, and the group layout they share.

Shapes use: B unique prompts on this process, N completions on this process (N = sum of
``PromptBatch.num_samples``), P prompt length (left-padded), T completion length (right-padded).
Rows are group-major: the completions of one prompt are consecutive. Mask polarity is the same
everywhere: ``True`` = this token is real / trained on.

`GroupLayout` says where the rows of a generation live: which completions of which group each
process holds. A generation batch is a list of groups (one prompt and its completions) in global,
group-major row order, dealt to the processes in contiguous shares of near-equal size. A share
boundary may cut a group: its head is sampled on one process and its tail on the next, and the group
keeps one global id, so its advantages are still computed over all of its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import accumulate
from typing import Any, Optional, TypeVar

import torch

# ---- the group layout ---------------------------------------------------------------------------
# Built once per generation. Every step that moves rows between "this process's share" and "whole
# groups" asks it instead of redoing the arithmetic: the prompt sampler (which prompts, how many
# samples each, on this process), the main-process dispatcher (whole groups sampled once, cut back
# into shares), dynamic sampling and GFPO's row filter (keep some groups or rows, deal the kept rows
# out again).
#
# Pure bookkeeping, no collectives: the caller gathers (distributed.py) and the layout says how the
# gathered pieces fit together. Rows are counted in global order; "group position" is a group's index
# in the layout (0..num_groups-1), "group id" its global id (stable across processes).

T = TypeVar("T")


@dataclass(frozen=True)
class GroupLayout:
    group_ids: tuple[int, ...]  # (groups,) global id of each group, in row order
    group_sizes: tuple[int, ...]  # (groups,) rows (completions) of each group
    bounds: tuple[int, ...]  # (processes + 1,) process p holds the global rows bounds[p]:bounds[p + 1]
    process_index: int = 0  # the process this layout is read from (its "own" rows)

    def __post_init__(self) -> None:
        if len(self.group_ids) != len(self.group_sizes):
            raise ValueError(f"GroupLayout: {len(self.group_ids)} group ids for {len(self.group_sizes)} group sizes.")
        if any(size < 1 for size in self.group_sizes):
            raise ValueError(f"GroupLayout: every group needs at least one row, got sizes {list(self.group_sizes)}.")
        if len(self.bounds) < 2 or self.bounds[0] != 0 or self.bounds[-1] != sum(self.group_sizes):
            raise ValueError(
                f"GroupLayout: bounds {list(self.bounds)} must run from 0 to the {sum(self.group_sizes)} rows."
            )
        if any(a > b for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"GroupLayout: bounds {list(self.bounds)} must not decrease.")
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(f"GroupLayout: process_index {self.process_index} outside 0..{self.num_processes - 1}.")

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def dealt(
        cls, group_ids: Sequence[int], group_sizes: Sequence[int], num_processes: int, process_index: int = 0
    ) -> GroupLayout:
        """Groups in this order, their rows dealt in contiguous shares: process p gets rows n*p//P .. n*(p+1)//P."""
        n = sum(group_sizes)
        bounds = tuple(n * p // num_processes for p in range(num_processes + 1))
        return cls(tuple(group_ids), tuple(group_sizes), bounds, process_index)

    @classmethod
    def for_generation(
        cls, generation_index: int, num_prompts: int, group_size: int, num_processes: int, process_index: int = 0
    ) -> GroupLayout:
        """The sampler's layout: `num_prompts` groups of `group_size`, ids numbered on from earlier generations."""
        first = generation_index * num_prompts
        return cls.dealt(range(first, first + num_prompts), [group_size] * num_prompts, num_processes, process_index)

    @classmethod
    def uncut(cls, sizes_per_process: Sequence[Sequence[int]], process_index: int = 0) -> GroupLayout:
        """Each process holds its own whole groups (sizes listed per process); ids 0.. in process order.

        For prompt batches built without a layout (by hand, or from TRL-style per-completion prompts):
        nothing says a group continues on the next process, so none is taken to.
        """
        sizes = [size for shares in sizes_per_process for size in shares]
        bounds = (0, *accumulate(sum(shares) for shares in sizes_per_process))
        return cls(tuple(range(len(sizes))), tuple(sizes), bounds, process_index)

    def redealt(self, group_ids: Sequence[int], group_sizes: Sequence[int]) -> GroupLayout:
        """Other groups dealt over the same processes, read from the same process."""
        return GroupLayout.dealt(group_ids, group_sizes, self.num_processes, self.process_index)

    # ---- reading the placement ---------------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    @property
    def num_rows(self) -> int:
        return self.bounds[-1]

    @property
    def local_rows(self) -> slice:
        """This process's rows of a global (gathered) row list."""
        return slice(self.bounds[self.process_index], self.bounds[self.process_index + 1])

    def rows(self, process: int) -> range:
        return range(self.bounds[process], self.bounds[process + 1])

    def group_starts(self) -> list[int]:
        return [0, *accumulate(self.group_sizes)][:-1]

    def row_groups(self) -> list[int]:
        """(rows,) group position of every global row."""
        return [g for g, size in enumerate(self.group_sizes) for _ in range(size)]

    def pieces(self, process: int | None = None) -> list[tuple[int, int]]:
        """(group position, rows there) of every group with rows on `process` (default: this one), in row order."""
        rows = self.rows(self.process_index if process is None else process)
        out = []
        for g, (start, size) in enumerate(zip(self.group_starts(), self.group_sizes)):
            here = min(start + size, rows.stop) - max(start, rows.start)
            if here > 0:
                out.append((g, here))
        return out

    def uniform_group_size(self) -> int:
        """The one size every group has (group-normalised advantages need it)."""
        sizes = set(self.group_sizes)
        if len(sizes) != 1:
            raise ValueError(
                f"the groups have different sizes {sorted(sizes)}; advantages are normalised over groups of one size."
            )
        return sizes.pop()

    # ---- moving values between shares and whole groups ---------------------------------------

    def deal(self, rows: Sequence[T]) -> list[list[T]]:
        """A global row list cut into the processes' shares."""
        if len(rows) != self.num_rows:
            raise ValueError(f"GroupLayout.deal: {len(rows)} rows for a layout of {self.num_rows}.")
        return [list(rows[self.bounds[p] : self.bounds[p + 1]]) for p in range(self.num_processes)]

    def join(self, per_process: Sequence[Sequence[T]]) -> list[T]:
        """One value per group from each process's per-piece values (the process holding a group's head gives it)."""
        if len(per_process) != self.num_processes:
            raise ValueError(
                f"GroupLayout.join: values from {len(per_process)} processes for a layout of {self.num_processes}."
            )
        found: dict[int, T] = {}
        for p, values in enumerate(per_process):
            pieces = self.pieces(p)
            if len(values) != len(pieces):
                raise ValueError(
                    f"GroupLayout.join: process {p} gave {len(values)} values for its {len(pieces)} groups."
                )
            for (g, _), value in zip(pieces, values):
                found.setdefault(g, value)
        return [found[g] for g in range(self.num_groups)]

    # ---- choosing rows -----------------------------------------------------------------------

    def select_groups(self, positions: Sequence[int]) -> GroupLayout:
        """The chosen groups (whole), their rows dealt out again over the processes."""
        return self.redealt([self.group_ids[g] for g in positions], [self.group_sizes[g] for g in positions])

    def select_rows(self, keep: Sequence[bool]) -> GroupLayout:
        """The kept rows (a (rows,) mask): groups shrink to their kept rows (empty ones go), dealt out again."""
        if len(keep) != self.num_rows:
            raise ValueError(f"GroupLayout.select_rows: a mask of {len(keep)} rows for a layout of {self.num_rows}.")
        kept = [0] * self.num_groups
        for g, k in zip(self.row_groups(), keep):
            kept[g] += bool(k)
        chosen = [g for g in range(self.num_groups) if kept[g]]
        return self.redealt([self.group_ids[g] for g in chosen], [kept[g] for g in chosen])

    def keeps_rows_in_place(self, keep: Sequence[bool]) -> bool:
        """Whether, after select_rows(keep), every process holds exactly its own kept rows (no row changes process)."""
        after = self.select_rows(keep)
        return all(sum(bool(keep[r]) for r in self.rows(p)) == len(after.rows(p)) for p in range(self.num_processes))


# ---- the data of one step ----------------------------------------------------------------------


@dataclass
class PromptBatch:
    """The unique prompts this process generates for, with their dataset rows."""

    prompts: list[Any]  # (B,) str (standard) or list of messages (conversational)
    prompt_ids: list[list[int]]  # (B,) tokenized once, chat template applied
    columns: dict[str, list[Any]]  # extra dataset columns, each (B,), forwarded to reward functions
    dataset_indices: list[int]  # (B,) row index in the dataset, for error messages
    group_ids: list[int]  # (B,) global group index; a group straddling processes has one id
    num_samples: list[int]  # (B,) completions this process samples for the prompt (G unless split)
    multimodal: list[Any] | None = None  # (B,) multimodal.PromptImages or None per prompt; None = no images at all
    prompts_given: bool = (
        True  # False: the rows had no 'prompt'; `prompts` holds empty user messages that reset() completes
    )
    # Where every process's rows of this generation live (GroupLayout above); None for a batch built by hand
    # (then each process's prompts are taken to be whole groups of their own).
    layout: Optional[GroupLayout] = None

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, indices: list[int], num_samples: list[int], layout: Optional[GroupLayout] = None) -> "PromptBatch":
        """The prompts at `indices` (in that order) with new sample counts and layout; a new batch."""
        return PromptBatch(
            prompts=[self.prompts[b] for b in indices],
            prompt_ids=[self.prompt_ids[b] for b in indices],
            columns={name: [values[b] for b in indices] for name, values in self.columns.items()},
            dataset_indices=[self.dataset_indices[b] for b in indices],
            group_ids=[self.group_ids[b] for b in indices],
            num_samples=list(num_samples),
            multimodal=None if self.multimodal is None else [self.multimodal[b] for b in indices],
            prompts_given=self.prompts_given,
            layout=layout,
        )

    def row_index(self) -> list[int]:
        """(N,) prompt index of each completion row."""
        return [b for b, n in enumerate(self.num_samples) for _ in range(n)]


@dataclass
class SamplingParams:
    """What a generation backend needs to sample; `extra` overrides the named fields (generation_kwargs)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Completion:
    """One sampled completion. `token_ids` keep the EOS; nothing after the first EOS is kept."""

    prompt_index: int  # index into the prompt list given to the backend
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (ended with EOS) or "length" (hit max_new_tokens)
    sampler_logprobs: Optional[list[float]] = None  # logprob of each sampled token under the sampling distribution
    # Multi-turn rollouts (tools, environments, rollout_func; grouprl.agents) also set:
    tool_mask: Optional[list[bool]] = (
        None  # per token: False = tool output / template glue (attended to, never trained on); None = all True
    )
    prompt_ids: Optional[list[int]] = None  # this rollout's own prompt when it differs from its PromptBatch entry
    messages: Optional[list[dict]] = (
        None  # assistant and tool messages of a conversational rollout, as reward functions get them
    )
    tool_calls: int = 0  # tool calls made (failed ones included)
    tool_failures: int = 0  # calls that returned an error to the model
    # this rollout's image inputs (multimodal.PromptImages) when a multi-turn rollout has images: its prompt's, then
    # those its tool results returned; None: its PromptBatch entry's
    images: Optional[Any] = None
    reward_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # per-completion extras for reward functions (environments, ...)

    @property
    def num_model_tokens(self) -> int:
        """Tokens the model sampled (tool output excluded): what length metrics count."""
        return len(self.token_ids) if self.tool_mask is None else sum(self.tool_mask)


@dataclass
class Rollout:
    """Prompts plus their N completions on this process, in group-major order."""

    prompts: PromptBatch
    completions: list[Completion]  # (N,)

    def __post_init__(self) -> None:
        expected = sum(self.prompts.num_samples)
        if len(self.completions) != expected:
            raise ValueError(f"Rollout: the backend returned {len(self.completions)} completions, expected {expected}.")

    @property
    def row_prompt(self) -> list[int]:
        return self.prompts.row_index()

    def prompt_rows(self, prompt_indices: list[int]) -> list[int]:
        """Row indices (into `completions`) of the given prompts' completions, in order."""
        wanted = set(prompt_indices)
        return [r for r, b in enumerate(self.row_prompt) if b in wanted]

    def select_prompts(self, prompt_indices: list[int]) -> "Rollout":
        """The rollout restricted to some prompts (whole groups), renumbered; the result has no layout."""
        new_index = {b: k for k, b in enumerate(prompt_indices)}
        prompts = self.prompts.subset(prompt_indices, [self.prompts.num_samples[b] for b in prompt_indices])
        row_prompt = self.row_prompt
        completions = [
            replace(self.completions[r], prompt_index=new_index[row_prompt[r]])
            for r in self.prompt_rows(prompt_indices)
        ]
        return Rollout(prompts, completions)

    @staticmethod
    def concat(parts: list["Rollout"]) -> "Rollout":
        """One rollout holding the prompts and completions of `parts`, in order."""
        prompts = PromptBatch([], [], {}, [], [], [])
        completions: list[Completion] = []
        for part in parts:
            offset = len(prompts)
            for name, values in part.prompts.columns.items():
                prompts.columns.setdefault(name, []).extend(values)
            for name in ("prompts", "prompt_ids", "dataset_indices", "group_ids", "num_samples"):
                getattr(prompts, name).extend(getattr(part.prompts, name))
            if part.prompts.multimodal is not None:
                prompts.multimodal = (prompts.multimodal or [None] * offset) + part.prompts.multimodal
            elif prompts.multimodal is not None:
                prompts.multimodal += [None] * len(part.prompts)
            completions.extend(replace(c, prompt_index=c.prompt_index + offset) for c in part.completions)
        return Rollout(prompts, completions)


@dataclass
class Rewards:
    """Rewards of the gathered (global) generation batch."""

    per_function: torch.Tensor  # (N_global, F) float; NaN = "not applicable" (the function returned None)
    names: list[str]  # (F,)
    weights: torch.Tensor  # (F,)

    def select(self, rows: list[int]) -> "Rewards":
        return Rewards(self.per_function[rows], self.names, self.weights)

    @staticmethod
    def concat(parts: list["Rewards"]) -> "Rewards":
        return Rewards(torch.cat([p.per_function for p in parts]), parts[0].names, parts[0].weights)

    @property
    def total(self) -> torch.Tensor:
        """(N_global,) weighted sum over applicable functions; NaN where no function applied."""
        weighted = self.per_function * self.weights.unsqueeze(0)
        total = torch.nansum(weighted, dim=1)
        unscorable = torch.isnan(self.per_function).all(dim=1)
        return total.masked_fill(unscorable, float("nan"))


PER_TOKEN_FIELDS = (
    "completion_ids",
    "completion_mask",
    "loss_mask",
    "old_logprobs",
    "sampler_logprobs",
    "ref_logprobs",
    "is_weights",
)

# TRL's name -> TrainBatch field, for code written against the dict TRL's _generate_and_score_completions
# returns and its compute_loss receives. `loss_mask` is grouprl's: TRL's completion_mask * tool_mask,
# with truncated completions dropped under mask_truncated_completions.
TRL_KEYS = {
    "prompt_ids": "prompt_ids",
    "prompt_mask": "prompt_mask",
    "completion_ids": "completion_ids",
    "completion_mask": "completion_mask",
    "advantages": "advantages",
    "old_per_token_logps": "old_logprobs",
    "ref_per_token_logps": "ref_logprobs",
    "sampling_per_token_logps": "sampler_logprobs",
    "importance_sampling_ratio": "is_weights",
    "num_items_in_batch": "num_loss_tokens",
    "loss_mask": "loss_mask",
}


def padded_width(width: int, multiple: Optional[int]) -> int:
    """`width` rounded up to a multiple of `multiple` (GRPOConfig.pad_to_multiple_of); itself when that is None."""
    return -(-width // multiple) * multiple if multiple else width


@dataclass
class TrainBatch:
    """Tensors the loss needs, for n rows (a generation batch or one micro-batch of it)."""

    prompt_ids: torch.Tensor  # (n, P) long, left-padded
    prompt_mask: torch.Tensor  # (n, P) bool
    completion_ids: torch.Tensor  # (n, T) long, right-padded
    completion_mask: torch.Tensor  # (n, T) bool, real completion tokens (EOS included)
    loss_mask: torch.Tensor  # (n, T) bool, tokens the loss trains on
    advantages: torch.Tensor  # (n,) float
    old_logprobs: Optional[torch.Tensor] = None  # (n, T) float, None = on-policy (ratio 1 with gradient)
    sampler_logprobs: Optional[torch.Tensor] = None  # (n, T) float, from the generation backend
    ref_logprobs: Optional[torch.Tensor] = None  # (n, T) float, reference policy (beta != 0)
    is_weights: Optional[torch.Tensor] = (
        None  # (n, T) float, sampler-mismatch correction rho (a row's value repeated for sequence modes)
    )
    num_loss_tokens: float = 0.0  # loss tokens of the whole generation batch over all processes (DAPO denominator)
    multimodal: list[Any] | None = (
        None  # (n,) each row's prompt images (multimodal.PromptImages or None), collated per forward
    )
    pad_to_multiple_of: Optional[int] = None  # GRPOConfig's: P and T (and every forward's widths) are multiples of it
    # what the loss's forward does with `sampler_logprobs` when nothing was computed before it (rollout/experience.py):
    # "measure" the sampler-vs-trainer gap (the sampling/* statistics), "correct" by it too (is weights), None: nothing
    sampler_in_forward: Optional[str] = None

    def __len__(self) -> int:
        """Rows (not keys: the TRL-style item access below is a view, not a full Mapping)."""
        return self.prompt_ids.shape[0]

    # TRL-style access: batch["advantages"], batch["old_per_token_logps"] = ..., "ref_per_token_logps" in batch.
    def __getitem__(self, key: str) -> Any:
        value = getattr(self, self._field(key))
        if value is None:
            raise KeyError(f"{key!r}: this batch has none (as in TRL, the key is present only when computed).")
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, self._field(key), value)

    def __contains__(self, key: object) -> bool:
        return key in TRL_KEYS and getattr(self, TRL_KEYS[key]) is not None

    def keys(self) -> list[str]:
        return [key for key in TRL_KEYS if key in self]

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    @staticmethod
    def _field(key: str) -> str:
        if key not in TRL_KEYS:
            raise KeyError(
                f"{key!r} is not a key of grouprl's TrainBatch; keys: {', '.join(TRL_KEYS)} (images travel in the "
                "`multimodal` attribute, not as pixel_values)."
            )
        return TRL_KEYS[key]

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        """Rows `rows` (indices), with padding trimmed to the longest selected prompt and completion."""
        picked = replace(self, **{name: getattr(self, name)[rows] for name in self._tensor_fields()})
        if self.multimodal is not None:
            picked.multimodal = [self.multimodal[r] for r in rows.tolist()]
        return picked.trimmed()

    def trimmed(self) -> "TrainBatch":
        """Drop prompt columns that are padding in every row (left) and completion columns likewise (right), down to
        a multiple of pad_to_multiple_of if it is set."""
        width = self.prompt_mask.shape[1]
        keep_prompt = self.prompt_mask.any(dim=0).nonzero()
        kept = width - int(keep_prompt[0]) if len(keep_prompt) else 0
        start = width - min(width, padded_width(kept, self.pad_to_multiple_of))
        keep_completion = self.completion_mask.any(dim=0).nonzero()
        end = int(keep_completion[-1]) + 1 if len(keep_completion) else 0
        end = min(self.completion_mask.shape[1], padded_width(end, self.pad_to_multiple_of))
        changes: dict[str, torch.Tensor] = {
            "prompt_ids": self.prompt_ids[:, start:],
            "prompt_mask": self.prompt_mask[:, start:],
        }
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                changes[name] = value[:, :end]
        return replace(self, **changes)

    def to(self, device: torch.device) -> "TrainBatch":
        return replace(self, **{name: getattr(self, name).to(device) for name in self._tensor_fields()})
