"""Planning prompt packs: which rows share a prompt, and into how many packs each group is cut.

The cost model counts token passes: a pack's tokens plus the attention pairs it scores, converted at
`pairs_per_token` (what one token through a layer's weights costs, in attention pairs). Pure
arithmetic on lengths and the model's shapes; the packs themselves are built in `pack_building.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PromptGroups(NamedTuple):
    rows: list[list[int]]  # row indices sharing one prompt, in row order, at most the row cap each
    prompt_lens: list[int]  # real prompt tokens of each group


def group_by_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_rows: int | None) -> PromptGroups:
    """Group rows whose prompts (real tokens only) are identical; groups larger than `max_rows` are split."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for row, (ids, mask) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
        by_prompt.setdefault(tuple(i for i, m in zip(ids, mask) if m), []).append(row)
    cap = max_rows or prompt_ids.shape[0]
    groups, lens = [], []
    for prompt, rows in by_prompt.items():
        for start in range(0, len(rows), cap):
            groups.append(rows[start : start + cap])
            lens.append(len(prompt))
    return PromptGroups(groups, lens)


def pack_cost(prompt_len: int, completion_lens: list[int], pairs_per_token: float, dense: bool = False) -> float:
    """Estimated cost, in token passes, of one packed sequence: its tokens plus the attention pairs scored.

    Dense (a 4D mask, and the plain pass): all L^2 pairs of the packed length. Otherwise
    (packed_attention): the prompt's P^2 and, for each completion, its C x (P + C) padded to the longest.
    """
    length = prompt_len + sum(completion_lens)
    if dense:
        return length + length * length / pairs_per_token
    longest = max(completion_lens, default=0)
    pairs = prompt_len * prompt_len + len(completion_lens) * longest * (prompt_len + longest)
    return length + pairs / pairs_per_token


def split_for_cost(
    groups: PromptGroups, completion_lens: list[int], pairs_per_token: float, dense: bool = False
) -> PromptGroups:
    """Split each group into the number of packs (1 .. its rows) with the lowest `pack_cost`.

    One pack runs the prompt once; with a dense mask its attention grows with the square of the packed
    length, so short prompts with long completions gain little from sharing, lose to the larger
    attention and end up split. One pack per row is the plain pass.
    """
    rows_out, lens_out = [], []
    for rows, p in zip(groups.rows, groups.prompt_lens):
        splits = [_even_parts(rows, s) for s in range(1, len(rows) + 1)]
        best = min(
            splits,
            key=lambda parts, p=p: sum(
                pack_cost(p, [completion_lens[r] for r in part], pairs_per_token, dense) for part in parts
            ),
        )
        rows_out.extend(best)
        lens_out.extend([p] * len(best))
    return PromptGroups(rows_out, lens_out)


def _even_parts(items: list[int], parts: int) -> list[list[int]]:
    """`items` cut into `parts` contiguous runs whose sizes differ by at most one (as torch.tensor_split)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def pairs_per_token(model: torch.nn.Module) -> float:
    """How many attention (query, key) pairs cost as much as one token through a layer's weights.

    Per layer a token costs ~2 FLOPs per weight, a pair ~4 per attention channel (QK^T and AV).
    On W1's model this predicts 3072 where timing plain vs packed passes gave ~2800.
    """
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    config = inner.config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        return 0.0
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    embeddings = {
        id(p)
        for m in (inner.get_input_embeddings(), inner.get_output_embeddings())
        if m is not None
        for p in m.parameters()
    }
    per_layer = sum(p.numel() for p in inner.parameters() if id(p) not in embeddings) / layers
    return per_layer / (2 * width)
