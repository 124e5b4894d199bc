"""Building a prompt pack: a prompt and its completions as one sequence, with what each token sees.

A pack is [prompt, completion_1, ..., completion_k, padding] with positions 0..P-1 for the prompt
and P..P+T_j-1 for each completion; a completion token sees the prompt and, causally, its own
completion only. The visibility comes both as a dense (packs, 1, L, L) mask (eager models) and as
packed_attention's index layout (sdpa models inside grouprl_patches). Which rows go into which
pack is planned in `pack_planning.py`; the pass itself is `prompt_packing.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grouprl.model.packed_attention import PackLayout, build_layout


class Pack(NamedTuple):
    input_ids: torch.Tensor  # (packs, L)
    position_ids: torch.Tensor  # (packs, L)
    attention_mask: torch.Tensor  # (packs, 1, L, L) True where a query (dim 2) may attend a key (dim 3)
    source: torch.Tensor  # (rows, T) flat index into (packs * L) of the state predicting each completion token
    keep: int  # positions at the end of the pack whose states are needed (`logits_to_keep`)
    layout: PackLayout  # the same visibility as index tensors, for packed_attention


def build_pack(
    prompts: list[list[int]], completions: list[list[list[int]]], completion_len: int, device: torch.device
) -> Pack:
    """Pack each prompt with its completions (token lists); rows come out in the order given.

    `source[r, t]` is where the state predicting completion token t of row r sits: the prompt's last
    position for t = 0, the completion's position t - 1 after that; beyond the row's length it
    points at the prompt's last position (a real state whose result is then masked out).
    """
    length = max(len(p) + sum(len(c) for c in cs) for p, cs in zip(prompts, completions))
    # Built as lists, turned into tensors once (cheap for many rows)
    ids, positions, segment, source, spans = [], [], [], [], []
    for b, (prompt, rows) in enumerate(zip(prompts, completions)):
        p = len(prompt)
        pack_ids, pack_positions, pack_segment = list(prompt), list(range(p)), [0] * p
        spans.append([])
        for j, tokens in enumerate(rows, start=1):
            t, start = len(tokens), len(pack_ids)
            spans[-1].append((start, t))
            pack_ids += tokens
            pack_positions += range(p, p + t)
            pack_segment += [j] * t
            last_prompt = b * length + p - 1
            source.append(
                [last_prompt]
                + [b * length + start + i for i in range(t - 1)]
                + [last_prompt] * (completion_len - max(t, 1))
            )
        pad = length - len(pack_ids)
        ids.append(pack_ids + [0] * pad)
        positions.append(pack_positions + [0] * pad)
        segment.append(pack_segment + [-1] * pad)  # 0 prompt, j >= 1 completion j, -1 padding
    ids, positions, segment = torch.tensor(ids), torch.tensor(positions), torch.tensor(segment)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    seg_q, seg_k = segment[:, :, None], segment[:, None, :]
    visible = causal & (seg_k >= 0) & ((seg_k == 0) | (seg_k == seg_q))
    visible |= torch.eye(length, dtype=torch.bool)  # padding queries see themselves: no empty softmax
    keep = length - min(len(p) for p in prompts) + 1
    layout = build_layout([len(p) for p in prompts], spans, length, device)
    return Pack(
        ids.to(device), positions.to(device), visible[:, None].to(device), torch.tensor(source).to(device), keep, layout
    )
