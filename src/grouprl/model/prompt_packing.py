"""Prompt-grouped packing: run a prompt shared by several rows once, not once per row.

GRPO scores G completions of every prompt. The plain pass (`logprobs.completion_logprobs`) runs
each row as [prompt, completion], so a ~400-token prompt shared by 8 rows costs 8 prompt passes,
forward and backward. Here the rows of one prompt become one packed sequence

    [prompt, completion_1, completion_2, ..., completion_k, padding]

with positions 0..P-1 for the prompt and P..P+T_j-1 for each completion, and a 4D attention mask in
which a completion token sees the prompt and, causally, its own completion only. Every token then
has exactly the keys, values and position it has in its own row, so the hidden states, logprobs and
gradients are those of the plain pass up to float rounding.

With sdpa models the attention scores only the visible pairs (packed_attention.py: the prompt
causally, each completion against [prompt, itself]), and the packs of a micro-batch sit one after
another in a single row (`concatenated_rows`): no padding, one forward. Eager models take the same
visibility as an ordinary (rows, 1, L, L) mask (dense: all L^2 pairs; there each pack gets a row of its
own, rows of similar length batched together); sdpa packs carry a placeholder in its place.
`split_for_cost` (below) estimates the cost of a pack and packs a prompt's rows into as many
sequences as is cheapest; where that saves under 10% (50% off CPUs: `worth_packing`) the plain pass runs.

Used only where it reproduces the plain pass: the model's own attention takes custom 4D masks
(sdpa, eager), every layer attends fully (no sliding windows), the LM head is separable, no
multimodal inputs, no MoE aux loss, and a one-time probe per model agrees with the plain pass. The
probe's verdict is logged once per model (and attention implementation), with the reason when packing
is off; a model error other than "this model cannot run it" propagates.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers.utils import logging

from grouprl.model.forward import (
    capture_head_input,
    describe,
    forward_keeping,
    head_logprobs,
    head_weight_and_inputs,
    in_row_order,
    is_unsupported,
    length_buckets,
    separable_head,
)
from grouprl.model.layer_configs import layer_configs
from grouprl.model.loading import recomputes_layers
from grouprl.model.packed_attention import LAYOUT_KWARG, PackLayout, build_layout
from grouprl.model.patches import grouprl_patches, patches_active

# ---- planning: which rows share a prompt, and into how many packs each group is cut ----------------------
# The cost model counts token passes: a pack's tokens plus the attention pairs it scores, converted at
# `pairs_per_token` (what one token through a layer's weights costs, in attention pairs). Pure arithmetic on
# lengths and the model's shapes.


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


_PAIRS_PER_TOKEN: weakref.WeakKeyDictionary[torch.nn.Module, float] = weakref.WeakKeyDictionary()


def pairs_per_token(model: torch.nn.Module) -> float:
    """How many attention (query, key) pairs cost as much as one token through a layer's weights; counted once a
    model (a pass over its parameters).

    Per layer a token costs ~2 FLOPs per weight, a pair ~4 per attention channel (QK^T and AV).
    On W1's model this predicts 3072 where timing plain vs packed passes gave ~2800.
    """
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    if inner not in _PAIRS_PER_TOKEN:
        _PAIRS_PER_TOKEN[inner] = _count_pairs_per_token(inner)
    return _PAIRS_PER_TOKEN[inner]


def _count_pairs_per_token(inner: torch.nn.Module) -> float:
    config = inner.config
    layers = getattr(config, "num_hidden_layers", None)
    if not layers or not getattr(config, "num_attention_heads", None):
        return 0.0
    widths = [  # attention channels a layer (Gemma 4's layers differ in head_dim)
        layer.num_attention_heads * (getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads)
        for layer in layer_configs(config)
    ]
    width = sum(widths) / len(widths)
    embeddings = {
        id(p)
        for m in (inner.get_input_embeddings(), inner.get_output_embeddings())
        if m is not None
        for p in m.parameters()
    }
    per_layer = sum(p.numel() for p in inner.parameters() if id(p) not in embeddings) / layers
    return per_layer / (2 * width)


# ---- building a pack: prompts and their completions as sequences, with what each token sees -------------
# A pack is [prompt, completion_1, ..., completion_k] with positions 0..P-1 for the prompt and
# P..P+T_j-1 for each completion; a completion token sees the prompt and, causally, its own
# completion only. Packs sit either one per row of a (packs, L) batch, padded to the longest
# (`concatenate=False`), or one after another in a single row (`concatenate=True`): no padding and one
# forward for all of them, which only packed_attention can serve (it attends within each pack by
# index). The visibility comes both as a dense (rows, 1, L, L) mask (eager models, and any call
# outside `grouprl_patches`) and as packed_attention's index layout (sdpa models inside it). Which rows
# go into which pack is planned above; the pass itself is below.


class Pack(NamedTuple):
    input_ids: torch.Tensor  # (rows, L)
    position_ids: torch.Tensor  # (rows, L)
    attention_mask: torch.Tensor  # (rows, 1, L, L) True where a query (dim 2) may attend a key (dim 3); see dense_mask
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
    dense_mask: bool = True,
) -> Pack:
    """Pack each prompt with its completions (token lists); completions come out in the order given.

    `dense_mask=False` (packs that packed_attention serves, `_sparse_attention`): the (L, L) mask is a broadcast
    placeholder that holds no memory; such a pass must also recompute inside grouprl_patches (`packed_logprobs`).

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
    ids, positions, owner, part = (torch.tensor(x, device=device) for x in (ids, positions, owner, part))
    if dense_mask:
        # Made where the model runs: on a GPU a dozen elementwise passes over it take microseconds, where made on
        # the host and copied they took 0.17 s a 6,288-token row on a 2-core CPU (0.27 s at 8,240; bench_pack_host).
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        owner_q, owner_k, part_q, part_k = owner[:, :, None], owner[:, None, :], part[:, :, None], part[:, None, :]
        visible = causal & (owner_k >= 0) & (owner_k == owner_q) & ((part_k == 0) | (part_k == part_q))
        visible |= torch.eye(length, dtype=torch.bool, device=device)  # padding queries see themselves
    else:  # held from forward to backward by gradient checkpointing: 40 MB a 6,288-token row, 68 MB at 8,240
        visible = torch.ones((), dtype=torch.bool, device=device).expand(rows, length, length)
    earliest = min(start % length + len(p) - 1 for start, p in zip(prompt_starts, prompts))
    layout = build_layout(prompt_starts, [len(p) for p in prompts], spans, device)
    return Pack(ids, positions, visible[:, None], torch.tensor(source, device=device), length - earliest, layout)


logger = logging.get_logger("grouprl")

MIN_SAVING = 0.9  # pack only where the estimated cost is at most this share of the plain pass's (on a CPU)
# On a GPU each pack row's pass through a layer launches ~1.8x the kernels the plain pass launches for all its rows
# (packed attention's gathers and their backward; bench/bench_train_ops.py), and at small sizes those launches, not
# the arithmetic, set the time. The H200 run: the 0.5B case packed (estimated 0.86 of the plain cost) took 1.44 s a
# training pass where a plain forward + backward of the same rows took 0.26 s; the 1.5B case, not packed (0.96), ran
# at 26.6% of the card's peak. So there packing waits for a large saving, the long shared prompts it is for (the
# 1,024-token case: 0.29).
MIN_SAVING_ACCELERATOR = 0.5


def worth_packing(packed_cost: float, plain_cost: float, device: torch.device) -> bool:
    """Whether the packed pass's estimated cost is a small enough share of the plain pass's on `device`."""
    return packed_cost <= (MIN_SAVING if device.type == "cpu" else MIN_SAVING_ACCELERATOR) * plain_cost


# Longest row of packs placed one after another: one forward, whose layers gradient checkpointing recomputes one at a
# time in backward, so the cap bounds that recomputation's activations (an MLP's intermediate is L x its width).
# The 8,192 were chosen when such a row also held a dense (L, L) mask (64 MiB); sparse packs now hold a placeholder.
CONCATENATED_ROW_TOKENS = 8192
# On a GPU each row is a model forward of its own, launched kernel by kernel. The H200 run (bench_train_ops.py, the
# 0.5B shape, 1,024-token shared prompt + 48, 64 x 256 completions, ~25,000 packed tokens, median of 3): in rows of
# 8,192 tokens (4 forwards) the training pass took 1.17 s, slower than the plain pass's 0.94 s; in one row 0.83 s, at
# a peak of 8.5 GB (4.6 GB in four rows, 11.7 GB plain).
CONCATENATED_ROW_TOKENS_ACCELERATOR = 32768


def row_token_cap(device: torch.device) -> int:
    """Longest row of concatenated packs on `device` (CONCATENATED_ROW_TOKENS on a CPU, the accelerators' elsewhere)."""
    return CONCATENATED_ROW_TOKENS if device.type == "cpu" else CONCATENATED_ROW_TOKENS_ACCELERATOR


_MASK_STYLE = {"sdpa": "bool", "eager": "additive"}  # attention implementations that take a custom 4D mask


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP / accelerate wrappers


def _model_mask(model: torch.nn.Module, visible: torch.Tensor) -> torch.Tensor:
    if _MASK_STYLE[_unwrapped(model).config._attn_implementation] == "bool":
        return visible
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(
        ~visible, torch.finfo(torch.float32).min
    )


def _sparse_attention(model: torch.nn.Module) -> bool:
    """Whether packs attend through packed_attention (visible pairs only) rather than the dense 4D mask.

    That takes an sdpa model and `grouprl_patches()` active, which registers `sdpa_or_packed` as "sdpa".
    Outside it a pack attends through the dense mask (same values). A sparse pass carries a placeholder
    mask instead (40-68 MB saved a pack row), so gradient checkpointing must recompute its layers inside
    the block too: `RecomputedUnderPatches` stops a backward run outside it, with the reason.
    """
    return _unwrapped(model).config._attn_implementation == "sdpa" and patches_active()


def _scores_short_lived(model: torch.nn.Module) -> bool:
    """Whether what attention keeps for backward lives briefly: no gradient, or every layer recomputed in backward
    (gradient checkpointing, which transformers applies in training mode only)."""
    if not torch.is_grad_enabled():
        return True
    return recomputes_layers(_unwrapped(model))


def packed_logprobs(
    model: torch.nn.Module,
    head: torch.nn.Module,
    pack: Pack,
    completion_ids: torch.Tensor,
    temperature: float,
    *,
    entropy: str,
    explicit_scores: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (rows, T) [and entropies] of `completion_ids` (rows in the pack's order) from one packed forward.

    sdpa models inside grouprl_patches() attend through packed_attention (visible pairs only), others
    through the 4D mask. `explicit_scores` picks packed_attention's arithmetic (None: explicit products
    where they are kept only briefly, `_scores_short_lived`; False: sdpa's kernel).
    """
    weight, (kwargs,) = head_weight_and_inputs(
        model, head, [_packed_inputs(model, pack, explicit_scores)], frozenset({LAYOUT_KWARG})
    )  # before the body runs (its doc)
    return _packed_pass(model, head, weight, kwargs, pack, completion_ids, temperature, entropy)


def _packed_inputs(model: torch.nn.Module, pack: Pack, explicit_scores: bool | None = None) -> dict[str, Any]:
    """The model's keyword arguments for `pack`'s forward (packed_logprobs's doc)."""
    kwargs = {
        "input_ids": pack.input_ids,
        "attention_mask": _model_mask(model, pack.attention_mask),
        "position_ids": pack.position_ids,
        "use_cache": False,
    }
    if _sparse_attention(model):
        explicit = _scores_short_lived(model) if explicit_scores is None else explicit_scores
        kwargs[LAYOUT_KWARG] = pack.layout._replace(explicit_scores=explicit)
    return kwargs


def _packed_pass(
    model: torch.nn.Module,
    head: torch.nn.Module,
    weight: torch.Tensor | None,
    kwargs: dict[str, Any],
    pack: Pack,
    completion_ids: torch.Tensor,
    temperature: float,
    entropy: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """packed_logprobs's forward and head, with the head's `weight` and the model's `kwargs` as
    forward.head_weight_and_inputs gave them."""
    with capture_head_input(head) as captured:
        forward_keeping(model, kwargs, pack.keep)
    states = captured[0]  # (packs, keep, H): the last `keep` positions
    if LAYOUT_KWARG in kwargs and states.requires_grad and recomputes_layers(_unwrapped(model)):
        states = RecomputedUnderPatches.apply(states)
    packs, length = pack.input_ids.shape
    offset = length - states.shape[1]
    flat = states.reshape(packs * states.shape[1], states.shape[2])
    local = pack.source - offset * (pack.source // length + 1)  # rebase (packs * L) indices onto (packs * keep)
    hidden = flat[local]  # (rows, T, H)
    return head_logprobs(hidden, head.forward, completion_ids, temperature, entropy=entropy, weight=weight)


class RecomputedUnderPatches(torch.autograd.Function):
    """Identity on a packed pass's final states whose backward, the first of the pass's to run, checks that
    grouprl_patches() is still active: the layers recomputed next attend through packed_attention only there, and
    elsewhere would attend through the pass's placeholder mask (build_pack's `dense_mask=False`)."""

    @staticmethod
    def forward(ctx, states: torch.Tensor) -> torch.Tensor:
        return states.view_as(states)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if not patches_active():
            raise RuntimeError(
                "grouprl: the backward of a packed shared-prompt pass ran outside grouprl_patches(), where its "
                "checkpointed layers would be recomputed without packed attention. Call backward inside the block "
                "the forward ran in (GRPOTrainer.train() holds it for the whole run), or set "
                "pack_shared_prompts=False."
            )
        return grad


# --- when to use it ------------------------------------------------------------------------------

_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, bool]] = weakref.WeakKeyDictionary()


def packing_head(model: torch.nn.Module, plain: Callable[..., torch.Tensor]) -> torch.nn.Module | None:
    """The LM head to use with packing, or None where packing would not reproduce the plain pass.

    `plain(model, prompt_ids, prompt_mask, completion_ids, completion_mask)` computes the plain
    pass's logprobs for the one-time probe.
    """
    config = getattr(_unwrapped(model), "config", None)
    impl = getattr(config, "_attn_implementation", None)
    verdicts = _PROBED.setdefault(model, {})
    if impl not in verdicts:
        head = separable_head(model)  # None for sharded (FSDP / ZeRO-3) models too
        reason = _static_reason(config, impl) or (
            "the LM head is not separable" if head is None else _probe(model, head, plain)
        )
        verdicts[impl] = reason is None
        name = type(_unwrapped(model)).__name__
        if reason is None:
            logger.info(
                f"grouprl: prompt packing is on for {name} ({impl} attention): rows sharing a prompt run it once."
            )
        else:
            logger.log(
                logging.WARNING if reason.startswith("the probe") else logging.INFO,
                f"grouprl: prompt packing is off for {name} ({impl} attention): {reason}. Rows run one by one.",
            )
    return separable_head(model) if verdicts[impl] else None


def _static_reason(config, impl: str | None) -> str | None:
    """Why the configuration alone rules packing out, or None."""
    if impl not in _MASK_STYLE:
        return f"its attention implementation {impl!r} takes no custom 4D mask (sdpa and eager do)"
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])):
        return "some layers do not attend fully (sliding windows or other layer types)"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "it uses sliding-window attention"
    return None


@torch.no_grad()
def _probe(model: torch.nn.Module, head: torch.nn.Module, plain: Callable[..., torch.Tensor]) -> str | None:
    """Three rows, two sharing a left-padded prompt, ragged completions: None if packed equals plain, else why not."""
    vocab = head.weight.shape[0]
    device = head.weight.device
    prompt_ids = torch.tensor([[0, 3, 5, 7], [0, 3, 5, 7], [2, 4, 6, 8]], device=device) % vocab
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], device=device, dtype=torch.bool)
    completion_ids = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 7, 8]], device=device) % vocab
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], device=device, dtype=torch.bool)
    # A wrong mask moves logprobs by O(1); rounding in the model's own dtype (autocast off) by far less.
    tolerance = 1e-4 if head.weight.dtype == torch.float32 else 5e-2
    try:  # inside grouprl_patches (no gradient here, nothing recomputes later): the sparse attention is probed
        with torch.autocast(device.type, enabled=False), grouprl_patches():
            expected = plain(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
            pack = build_pack([[3, 5, 7], [2, 4, 6, 8]], [[[1, 2, 3], [4, 5]], [[6, 7, 8]]], 3, device)
            pack = pack._replace(input_ids=pack.input_ids % vocab)
            # sdpa's kernel on both sides: the probe checks what each token sees. The explicit products round
            # differently in bf16 (as eager attention does), which 30 layers can amplify far past any tolerance on
            # such made-up tokens (SmolLM2 under bf16 autocast: plain sdpa vs plain eager differ by 3 nats here).
            got, _ = packed_logprobs(model, head, pack, completion_ids, 1.0, entropy="none", explicit_scores=False)
    except Exception as err:
        if not is_unsupported(err):
            raise
        return f"the probe's packed pass failed: {describe(err)}"
    got, expected = got[completion_mask].float(), expected[completion_mask].float()
    if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance):
        gap = float((got - expected).abs().max())
        return f"the probe's packed logprobs differ from the plain pass's by up to {gap:.3g}"
    return None


# --- the pass ------------------------------------------------------------------------------------


def concatenated_rows(
    packed_lens: list[int], group_rows: list[int], max_rows: int | None, max_tokens: int
) -> list[list[int]]:
    """Packs (in order) cut into consecutive rows of at most `max_tokens` tokens (`row_token_cap`) and `max_rows`
    completions; a pack longer than the cap gets a row of its own."""
    batches: list[list[int]] = []
    tokens = completions = 0
    for g, (length, rows) in enumerate(zip(packed_lens, group_rows)):
        full = tokens + length > max_tokens or (max_rows is not None and completions + rows > max_rows)
        if not batches or full:
            batches.append([])
            tokens = completions = 0
        batches[-1].append(g)
        tokens, completions = tokens + length, completions + rows
    return batches


def shared_prompt_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    *,
    rows_per_chunk: int | None,
    entropy: str,
    plain: Callable[..., torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(n, T) logprobs [and entropies] with shared prompts packed, or None where packing does not apply.

    Applies when some prompt is shared by several rows, sharing it is estimated to save at least
    1 - MIN_SAVING of the cost on a CPU, 1 - MIN_SAVING_ACCELERATOR elsewhere (`split_for_cost`,
    `worth_packing`), masks are the usual left-padded prompt and
    right-padded completion, and `packing_head` accepts the model. Positions beyond a row's
    completion hold 0.
    """
    n, completion_len = completion_ids.shape
    prompt_lens, completion_lens = prompt_mask.sum(dim=1), completion_mask.sum(dim=1)
    width = prompt_mask.shape[1]
    left_padded = torch.equal(
        prompt_mask.bool(), torch.arange(width, device=prompt_mask.device) >= (width - prompt_lens)[:, None]
    )
    right_padded = torch.equal(
        completion_mask.bool(), torch.arange(completion_len, device=completion_mask.device) < completion_lens[:, None]
    )
    if not (left_padded and right_padded) or int(prompt_lens.min()) == 0:
        return None
    prompt_lens, completion_lens = prompt_lens.tolist(), completion_lens.tolist()
    ratio = pairs_per_token(model)
    if ratio <= 0:
        return None
    dense = not _sparse_attention(model)
    groups = split_for_cost(group_by_prompt(prompt_ids, prompt_mask, rows_per_chunk), completion_lens, ratio, dense)
    plain_cost = sum(pack_cost(prompt_lens[r], [completion_lens[r]], ratio, dense=True) for r in range(n))
    packed_cost = sum(
        pack_cost(p, [completion_lens[r] for r in rows], ratio, dense)
        for p, rows in zip(groups.prompt_lens, groups.rows)
    )
    if len(groups.rows) == n or not worth_packing(packed_cost, plain_cost, prompt_ids.device):
        return None
    head = packing_head(model, plain)
    if head is None:
        return None
    packed_lens = [p + sum(completion_lens[r] for r in rows) for p, rows in zip(groups.prompt_lens, groups.rows)]
    group_rows = [len(rows) for rows in groups.rows]
    if dense:  # one pack per row of the batch, rows of similar length together
        batches = length_buckets(packed_lens, rows_per_chunk, rows=group_rows)
    else:  # packs one after another in a row: no padding, one forward for many packs
        batches = concatenated_rows(packed_lens, group_rows, rows_per_chunk, row_token_cap(prompt_ids.device))
    ids, comp = prompt_ids.tolist(), completion_ids.tolist()
    packs = []  # (rows, completion width, pack) of each forward
    for bucket in batches:
        rows = [r for g in bucket for r in groups.rows[g]]
        t = max(max(completion_lens[r] for r in rows), 1)
        prompts = [ids[groups.rows[g][0]][width - groups.prompt_lens[g] :] for g in bucket]
        completions = [[comp[r][: completion_lens[r]] for r in groups.rows[g]] for g in bucket]
        pack = build_pack(prompts, completions, t, prompt_ids.device, concatenate=not dense, dense_mask=dense)
        packs.append((rows, t, pack))
    weight, inputs = head_weight_and_inputs(
        model, head, [_packed_inputs(model, pack) for _, _, pack in packs], frozenset({LAYOUT_KWARG})
    )  # once for every forward, before their bodies run (its doc)
    logps_parts, entropy_parts, order = [], [], []
    for (rows, t, pack), kwargs in zip(packs, inputs):
        index = torch.tensor(rows, device=prompt_ids.device)
        logps, entropies = _packed_pass(
            model, head, weight, kwargs, pack, completion_ids[index, :t], temperature, entropy
        )
        valid = completion_mask[index, :t].bool()
        logps_parts.append(torch.nn.functional.pad(logps.masked_fill(~valid, 0.0), (0, completion_len - t)))
        if entropies is not None:
            entropy_parts.append(torch.nn.functional.pad(entropies.masked_fill(~valid, 0.0), (0, completion_len - t)))
        order.extend(rows)
    return in_row_order(logps_parts, order), (in_row_order(entropy_parts, order) if entropy_parts else None)
