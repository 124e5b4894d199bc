"""Building a prompt pack: prompts and their completions as sequences, with what each token sees.

A pack is [prompt, completion_1, ..., completion_k] with positions 0..P-1 for the prompt and
P..P+T_j-1 for each completion; a completion token sees the prompt and, causally, its own
completion only. Packs sit either one per row of a (packs, L) batch, padded to the longest
(`concatenate=False`), or one after another in a single row (`concatenate=True`): no padding and one
forward for all of them, which only packed_attention can serve (it attends within each pack by
index). The visibility comes both as a dense (rows, 1, L, L) mask (eager models, and any call
outside `grouprl_patches`) and as packed_attention's index layout (sdpa models inside it). Which rows
go into which pack is planned in `pack_planning.py`; the pass itself is `prompt_packing.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grouprl.model.packed_attention import PackLayout, build_layout


class Pack(NamedTuple):
    input_ids: torch.Tensor  # (rows, L)
    position_ids: torch.Tensor  # (rows, L)
    attention_mask: torch.Tensor  # (rows, 1, L, L) True where a query (dim 2) may attend a key (dim 3)
    source: torch.Tensor  # (completions, T) flat index into (rows * L) of the state predicting each completion token
    keep: int  # positions at the end of each row whose states are needed (`logits_to_keep`)
    layout: PackLayout  # the same visibility as index tensors, for packed_attention


def build_pack(
    prompts: list[list[int]],
    completions: list[list[list[int]]],
    completion_len: int,
    device: torch.device,
    *,
    concatenate: bool = False,
) -> Pack:
    """Pack each prompt with its completions (token lists); completions come out in the order given.

    `source[r, t]` is where the state predicting completion token t of completion r sits: the prompt's last
    position for t = 0, the completion's position t - 1 after that; beyond the completion's length it
    points at the prompt's last position (a real state whose result is then masked out).
    """
    sizes = [len(p) + sum(len(c) for c in cs) for p, cs in zip(prompts, completions)]
    length = sum(sizes) if concatenate else max(sizes)
    rows = 1 if concatenate else len(prompts)
    # Built as lists, turned into tensors once (cheap for many rows). owner: the pack of each token (-1: padding);
    # part: 0 for its prompt, j >= 1 for its completion j.
    ids, positions, owner, part = ([[] for _ in range(rows)] for _ in range(4))
    source, spans, prompt_starts = [], [], []
    for b, (prompt, pack_rows) in enumerate(zip(prompts, completions)):
        row = 0 if concatenate else b
        base, p = row * length + len(ids[row]), len(prompt)  # flat (rows * L) index of the prompt's first token
        prompt_starts.append(base)
        ids[row] += prompt
        positions[row] += range(p)
        owner[row] += [b] * p
        part[row] += [0] * p
        spans.append([])
        for j, tokens in enumerate(pack_rows, start=1):
            t, start = len(tokens), row * length + len(ids[row])
            spans[-1].append((start, t))
            ids[row] += tokens
            positions[row] += range(p, p + t)
            owner[row] += [b] * t
            part[row] += [j] * t
            last_prompt = base + p - 1
            source.append(
                [last_prompt] + [start + i for i in range(t - 1)] + [last_prompt] * (completion_len - max(t, 1))
            )
    for row in range(rows):
        pad = length - len(ids[row])
        ids[row] += [0] * pad
        positions[row] += [0] * pad
        owner[row] += [-1] * pad
        part[row] += [-1] * pad
    ids, positions, owner, part = (torch.tensor(x) for x in (ids, positions, owner, part))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    owner_q, owner_k, part_q, part_k = owner[:, :, None], owner[:, None, :], part[:, :, None], part[:, None, :]
    visible = causal & (owner_k >= 0) & (owner_k == owner_q) & ((part_k == 0) | (part_k == part_q))
    visible |= torch.eye(length, dtype=torch.bool)  # padding queries see themselves: no empty softmax
    earliest = min(start % length + len(p) - 1 for start, p in zip(prompt_starts, prompts))
    layout = build_layout(prompt_starts, [len(p) for p in prompts], spans, device)
    return Pack(
        ids.to(device),
        positions.to(device),
        visible[:, None].to(device),
        torch.tensor(source).to(device),
        length - earliest,
        layout,
    )
