"""Per-token logprobs (and entropies) of completion tokens under the temperature-scaled policy.

GRPO's importance ratio compares the policy's probability of each *sampled* token with the
probability it had when sampled; sampling used logits / temperature, so training must too
(TRL PR #3029). Three things keep this pass lean:

- **No (rows, tokens, vocab) logits.** The model runs up to its final hidden states; the LM head is
  applied here in checkpointed chunks of positions, each chunk reduced at once to the selected
  token's logprob (and the entropy). Autograd keeps the (rows, tokens, hidden) states only, and
  backward recomputes one chunk's logits at a time; for a plain nn.Linear head it also forms the
  logits' gradient by hand (`_LinearHeadLogprobs`). Models whose head cannot be applied separately
  (sharded by FSDP / ZeRO-3, or logits post-processed after the head) fall back to asking the model
  for the completion logits, still reduced in checkpointed chunks.
- **Only completion positions** are projected (`logits_to_keep`).
- **Length buckets.** Rows are sorted by length and run in buckets, each trimmed to its own
  longest prompt and completion, so a short completion does not pay for the longest one.

Positions are derived from the attention mask (left-padded prompts), the same way `generate`
derives them, so a sequence's logprobs do not depend on its batch's padding or bucket.
Vision-language rows add their image inputs, collated per bucket (`multimodal.forward_inputs`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..multimodal import forward_inputs


class TokenLogprobs(NamedTuple):
    logprobs: torch.Tensor  # (n, T) logprob of each completion token, with gradient if enabled
    entropy: torch.Tensor | None  # (n, T) entropy of the next-token distribution, or None
    aux_loss: torch.Tensor | None  # scalar MoE router load-balancing loss, or None


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L) positions counting only real tokens; padding gets position 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


CHUNK_ELEMENTS = 1 << 25  # fp32 logits per chunk of positions (128 MiB), bounds the temporaries below
BUCKET_OVERHEAD_TOKENS = 64  # what one extra forward costs, in padded tokens (measured: small on CPU)
PACK_SHARED_PROMPTS = True  # run a prompt shared by several rows once where that is cheaper (prompt_packing)


# --- reductions of one chunk of positions --------------------------------------------------------


def _reduce(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """(m, V) logits, (m,) tokens -> fp32 (m,) logprob of each token [, (m,) entropy]."""
    scaled = logits.float() / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)
    logps = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - normaliser
    if not with_entropy:
        return (logps,)
    probs = torch.softmax(scaled, dim=-1)
    return logps, normaliser - (probs * scaled).sum(dim=-1)


def _chunked(
    inputs: torch.Tensor, tokens: torch.Tensor, to_logits: Callable[[torch.Tensor], torch.Tensor], temperature: float,
    *, entropy: str, differentiable: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Selected-token logprobs of `to_logits(inputs)` over (m, ...) positions, in chunks, and entropies.

    `entropy` is "none", "value" (no gradient) or "grad" (part of the objective: the entropy bonus).
    With gradient each chunk is checkpointed: backward recomputes that chunk's logits instead of
    autograd holding them. torch.split, not slicing: one SplitBackward concatenates the chunk
    gradients once, where each slice's backward would write a zero-filled full-size gradient
    (measured 40 s on W3).
    """
    vocab = to_logits(inputs[:0]).shape[-1]
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))

    def reduce(x: torch.Tensor, t: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, ...]:
        return _reduce(to_logits(x), t, temperature, with_entropy)

    with_entropy = entropy != "none"
    logps, entropies = [], []
    for chunk, chunk_tokens in zip(inputs.split(step), tokens.split(step)):
        if differentiable:
            outs = torch.utils.checkpoint.checkpoint(reduce, chunk, chunk_tokens, with_entropy, use_reentrant=False)
        else:
            outs = reduce(chunk, chunk_tokens, with_entropy)
        logps.append(outs[0])
        if with_entropy:  # one pass over the chunk's logits gives both; a metric-only entropy is detached
            entropies.append(outs[1] if entropy == "grad" else outs[1].detach())
    return torch.cat(logps), (torch.cat(entropies) if entropies else None)


def _scaled_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> tuple[torch.Tensor, torch.dtype]:
    """(fp32 logits / temperature, the dtype the product ran in); a fresh tensor, safe to modify in place."""
    raw = F.linear(x, weight, bias)
    z = raw.float()
    return (z.div_(temperature) if temperature != 1.0 else z), raw.dtype


class _LinearHeadLogprobs(torch.autograd.Function):
    """Selected-token logprobs and entropies of softmax((hidden @ W^T + b) / T), in chunks of positions,
    with a hand-written backward.

    The generic path (`_chunked`) checkpoints each chunk and lets autograd differentiate the
    reductions, which re-runs and differentiates half a dozen elementwise passes over (chunk, vocab)
    logits: on W3's 151,936-token vocabulary those passes took as long as the head's matrix products.
    Here backward recomputes a chunk's logits once and forms d(loss)/d(logits) directly:

        d logp / d z = onehot(token) - p           d entropy / d z = -p * (z - E_p[z])

    (z = logits / T, p = softmax(z)), in place, then the two products for the hidden states and the
    head's weight. Only a chunk's logits are ever held; the forward saves (positions,) statistics
    (log-normaliser, E_p[z]) and the hidden states. Under autocast the recompute uses the dtype the
    forward's product ran in, as autograd would have.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, with_entropy):
        step = max(1, CHUNK_ELEMENTS // weight.shape[0])
        logps, normalisers, expected = [], [], []
        compute_dtype = None
        for x, t in zip(hidden.split(step), tokens.split(step)):
            z, compute_dtype = _scaled_logits(x, weight, bias, temperature)
            normaliser = torch.logsumexp(z, dim=-1)
            logps.append(z.gather(-1, t.unsqueeze(-1)).squeeze(-1) - normaliser)
            normalisers.append(normaliser)
            if with_entropy:
                expected.append((z - normaliser.unsqueeze(-1)).exp_().mul_(z).sum(dim=-1))  # E_p[z]
        logps, normaliser = torch.cat(logps), torch.cat(normalisers)
        expected = torch.cat(expected) if with_entropy else normaliser.new_zeros(0)
        ctx.save_for_backward(hidden, weight, bias, tokens, normaliser, expected)
        ctx.temperature, ctx.step, ctx.compute_dtype = temperature, step, compute_dtype or weight.dtype
        ctx.set_materialize_grads(False)
        return logps, (normaliser - expected if with_entropy else normaliser.new_zeros(0))

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, tokens, normaliser, expected = ctx.saved_tensors
        temperature, step, dtype = ctx.temperature, ctx.step, ctx.compute_dtype
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_logps is None:
            grad_logps = normaliser.new_zeros(normaliser.shape)
        w, b = weight.to(dtype), (bias.to(dtype) if bias is not None else None)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias and bias is not None else None
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            x, g_logp = hidden[rows].to(dtype), grad_logps[rows].unsqueeze(-1)
            z, _ = _scaled_logits(x, w, b, temperature)
            if grad_entropy is None:  # G = -p * g_logp
                grad_z = z.sub_(normaliser[rows].unsqueeze(-1)).exp_().mul_(-g_logp)
            else:  # G = -p * (g_logp + g_entropy * (z - E_p[z]))
                centred = z.sub_(expected[rows].unsqueeze(-1))
                p = (centred + (expected[rows] - normaliser[rows]).unsqueeze(-1)).exp_()
                grad_z = centred.mul_(grad_entropy[rows].unsqueeze(-1)).add_(g_logp).mul_(p).neg_()
            grad_z.scatter_add_(-1, tokens[rows].unsqueeze(-1), g_logp)  # + g_logp at the selected token
            grad_logits = (grad_z.div_(temperature) if temperature != 1.0 else grad_z).to(dtype)
            if need_hidden:
                grad_hidden[rows] = (grad_logits @ w).to(hidden.dtype)
            if grad_weight is not None and dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), x)
            elif grad_weight is not None:
                grad_weight += (grad_logits.t() @ x).float()
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(dim=0)
        return (grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None)


def _plain_linear(head: Callable) -> torch.nn.Linear | None:
    """The nn.Linear whose own forward `head` is (so its product can be differentiated by hand), else None."""
    module = getattr(head, "__self__", None)
    if type(module) is torch.nn.Linear and getattr(head, "__func__", None) is torch.nn.Linear.forward and "forward" not in vars(module):
        return module
    return None


def logits_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, *, entropy: str = "value"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logprob of `tokens` (n, T) under softmax(logits / temperature) in fp32, and the entropy (see `_chunked`)."""
    return head_logprobs(logits, lambda x: x, tokens, temperature, entropy=entropy)


def head_logprobs(
    hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, temperature: float,
    *, entropy: str = "value",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like `logits_logprobs(head(hidden), ...)` without ever holding head(hidden) for all positions.

    `hidden` (n, T, H) are the final hidden states predicting `tokens` (n, T); `head` maps (m, H)
    to (m, V) logits (the model's LM head). Gradients flow to `hidden` and the head's parameters.
    """
    n, t, size = hidden.shape
    linear = _plain_linear(head)
    if linear is not None:
        logps, entropies = _LinearHeadLogprobs.apply(hidden.reshape(n * t, size), linear.weight, linear.bias, tokens.reshape(n * t),
                                                     temperature, entropy != "none")
        if entropy == "none":
            return logps.view(n, t), None
        return logps.view(n, t), (entropies if entropy == "grad" else entropies.detach()).view(n, t)
    differentiable = torch.is_grad_enabled() and (hidden.requires_grad or _has_trainable_parameters(head))
    logps, entropies = _chunked(hidden.reshape(n * t, size), tokens.reshape(n * t), head, temperature, entropy=entropy, differentiable=differentiable)
    return logps.view(n, t), (entropies.view(n, t) if entropies is not None else None)


def _has_trainable_parameters(head: Callable) -> bool:
    module = getattr(head, "__self__", None)
    return isinstance(module, torch.nn.Module) and any(p.requires_grad for p in module.parameters())


# --- the model pass ------------------------------------------------------------------------------


def length_buckets(
    lengths: list[int], max_rows: int | None, overhead: int = BUCKET_OVERHEAD_TOKENS, rows: list[int] | None = None,
) -> list[list[int]]:
    """Partition items into buckets of similar length minimising padded tokens + overhead per bucket.

    Items are sorted longest first; an exact dynamic programme over contiguous runs of that order
    picks the cut points (n is a micro-batch, so O(n^2) is nothing). No bucket holds more than
    `max_rows` rows, an item counting `rows[i]` rows (1 each by default; a packed sequence of
    several completions counts them all).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    sizes = rows or [1] * n
    cap = max_rows or sum(sizes)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of bucketing the first j items of `order`
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        held = 0
        for i in range(j - 1, -1, -1):  # bucket = order[i:j], its longest item is order[i]
            held += sizes[order[i]]
            if held > cap:
                break
            cost = best[i] + (j - i) * lengths[order[i]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j] : j])
        j = cut[j]
    return buckets[::-1]


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,  # (n, P) left-padded
    prompt_mask: torch.Tensor,  # (n, P) bool
    completion_ids: torch.Tensor,  # (n, T) right-padded
    completion_mask: torch.Tensor,  # (n, T) bool
    *,
    temperature: float,
    rows_per_chunk: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    with_aux_loss: bool = False,
    bucket_by_length: bool = True,
    multimodal: Sequence[Any] | None = None,  # (n,) each row's multimodal.PromptImages or None (VLMs)
    pack_prompts: bool | None = None,  # None: PACK_SHARED_PROMPTS
) -> TokenLogprobs:
    """Logprobs (n, T) of the completion tokens, their entropies (n, T) or None, the MoE aux loss or None.

    Runs the model on length buckets of at most `rows_per_chunk` rows (one bucket of all rows when
    `bucket_by_length` is False). Positions beyond a row's completion hold 0. The entropy is detached
    unless `entropy_grad`. With `with_aux_loss` the model returns its router load-balancing loss
    (averaged over buckets). With `pack_prompts`, rows sharing a prompt run it once (`prompt_packing`).
    """
    n, completion_len = completion_ids.shape
    if completion_len == 0 or n == 0:
        empty = completion_ids.new_zeros((n, completion_len), dtype=torch.float32)
        return TokenLogprobs(empty, empty if with_entropy else None, None)
    entropy_mode = "grad" if entropy_grad else ("value" if with_entropy else "none")
    if (PACK_SHARED_PROMPTS if pack_prompts is None else pack_prompts) and multimodal is None and not with_aux_loss:
        # imported here: prompt_packing builds on this module
        from .prompt_packing import shared_prompt_logprobs

        packed = shared_prompt_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
            rows_per_chunk=rows_per_chunk, entropy=entropy_mode, plain=_plain_logprobs,
        )
        if packed is not None:
            return TokenLogprobs(packed[0], packed[1] if with_entropy else None, None)
    prompt_lens = prompt_mask.sum(dim=1).tolist()
    completion_lens = completion_mask.sum(dim=1).tolist()
    if bucket_by_length:
        buckets = length_buckets([p + c for p, c in zip(prompt_lens, completion_lens)], rows_per_chunk)
    else:
        chunk = rows_per_chunk or n
        buckets = [list(range(s, min(s + chunk, n))) for s in range(0, n, chunk)]
    logps_parts, entropy_parts, aux_parts, order = [], [], [], []
    for rows in buckets:
        p = max(max(prompt_lens[r] for r in rows), 1)
        t = max(max(completion_lens[r] for r in rows), 1)
        index = torch.tensor(rows, device=prompt_ids.device)
        images = {} if multimodal is None else forward_inputs(model, [multimodal[r] for r in rows], p, p + t, prompt_ids.device)
        logps, entropy, aux = _bucket_logprobs(
            model, prompt_ids[index, -p:], prompt_mask[index, -p:], completion_ids[index, :t], completion_mask[index, :t],
            temperature, entropy=entropy_mode, with_aux_loss=with_aux_loss, extra=images,
        )
        logps_parts.append(F.pad(logps, (0, completion_len - t)))
        if entropy is not None:
            entropy_parts.append(F.pad(entropy, (0, completion_len - t)))
        if aux is not None:
            aux_parts.append(aux)
        order.extend(rows)
    logps, entropy = in_row_order(logps_parts, order), (in_row_order(entropy_parts, order) if with_entropy else None)
    aux_loss = torch.stack(aux_parts).mean() if aux_parts else None
    return TokenLogprobs(logps, entropy, aux_loss)


def in_row_order(parts: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    """Concatenate per-bucket results whose rows are `order` (original row indices) back into row order."""
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(parts)[inverse.to(parts[0].device)]


def _plain_logprobs(model: torch.nn.Module, *rows: torch.Tensor) -> torch.Tensor:
    return completion_logprobs(model, *rows, temperature=1.0, with_entropy=False, pack_prompts=False).logprobs


def _bucket_logprobs(
    model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    completion_mask: torch.Tensor, temperature: float, *, entropy: str, with_aux_loss: bool, extra: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    completion_len = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (n, P + T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask), "use_cache": False,
              **(extra or {})}
    if with_aux_loss:
        kwargs["output_router_logits"] = True
    head = separable_head(model)
    with _capture_head_input(head) as captured:
        output = _forward(model, kwargs, completion_len)
    aux = getattr(output, "aux_loss", None) if with_aux_loss else None
    # Position t predicts token t + 1: drop the last one, keep the T before it.
    if head is not None:
        hidden = captured[0][:, -(completion_len + 1) : -1, :]
        logps, entropies = head_logprobs(hidden, head.forward, completion_ids, temperature, entropy=entropy)
    else:
        logits = output.logits[:, -(completion_len + 1) : -1, :]
        logps, entropies = logits_logprobs(logits, completion_ids, temperature, entropy=entropy)
    return logps, entropies, aux


def _forward(model: torch.nn.Module, kwargs: dict, completion_len: int):
    try:
        return model(**kwargs, logits_to_keep=completion_len + 1)
    except TypeError:  # models without `logits_to_keep` compute every position
        return model(**kwargs)


# --- applying the LM head ourselves --------------------------------------------------------------

_SEPARABLE: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def separable_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head if logits == head(final hidden state) exactly, else None.

    Checked once per model by comparing both paths on a short input, so models that post-process
    logits (soft-capping, scaling) are recognised without a list of architectures. Sharded models
    (FSDP, DeepSpeed ZeRO-3) gather the head's weight only inside their own forward: not separable.
    """
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or type(model).__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine"):
        return None
    weight = getattr(head, "weight", None)
    if weight is None or hasattr(weight, "ds_id") or type(weight).__name__ == "DTensor" or weight.dim() != 2:
        return None
    if model not in _SEPARABLE:
        _SEPARABLE[model] = _head_reproduces_logits(model, head)
    return head if _SEPARABLE[model] else None


@torch.no_grad()
def _head_reproduces_logits(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    probe = torch.arange(1, 5, device=head.weight.device).unsqueeze(0) % head.weight.shape[0]
    kwargs = {"input_ids": probe, "attention_mask": torch.ones_like(probe), "use_cache": False}
    try:
        with _capture_head_input(head) as captured:
            _forward(model, kwargs, 2)
        expected = _forward(model, kwargs, 2).logits.float()
        return torch.allclose(head(captured[0]).float(), expected, rtol=1e-4, atol=1e-4)
    except Exception:  # any model that cannot run this probe keeps the plain path
        return False


@contextlib.contextmanager
def _capture_head_input(head: torch.nn.Module | None) -> Iterator[list]:
    """Within the block, the model's head records its input and returns an empty (…, 0) logits tensor."""
    captured: list[torch.Tensor] = []
    if head is None:
        yield captured
        return

    def record(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(hidden)
        return hidden[..., :0]

    own = head.__dict__.get("forward")  # an instance-level forward (e.g. the fp32 head) is kept and restored
    head.forward = record
    try:
        yield captured
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
