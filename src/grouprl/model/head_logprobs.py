"""Selected-token logprobs (and entropies) from final hidden states and an LM head, without full logits.

The head is applied in checkpointed chunks of positions, each chunk reduced at once to the selected
token's logprob (and the entropy), so autograd keeps the (rows, tokens, hidden) states only and
backward recomputes one chunk's logits at a time; for a plain nn.Linear head the logits' gradient is
formed by hand (`_LinearHeadLogprobs`). Tensors in, tensors out: no model forward here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint

# fp32 logits per chunk of positions (64 MiB): the chunk and its temporaries are the training pass's largest tensors
# (in bf16 the product's own buffers add about twice the chunk). Large vocabularies still get MIN_CHUNK_POSITIONS
# positions: with fewer rows the product runs slower (W3, 151,936 tokens: 12% slower head at 110 positions).
CHUNK_ELEMENTS = 1 << 24
MIN_CHUNK_POSITIONS = 256


def positions_per_chunk(vocab: int) -> int:
    return max(MIN_CHUNK_POSITIONS, CHUNK_ELEMENTS // max(vocab, 1))


# --- reductions of one chunk of positions --------------------------------------------------------


def _reduce(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, ...]:
    """(m, V) logits, (m,) tokens -> fp32 (m,) logprob of each token [, (m,) entropy]."""
    scaled = logits.float() / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)
    logps = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - normaliser
    if not with_entropy:
        return (logps,)
    probs = torch.softmax(scaled, dim=-1)
    return logps, normaliser - (probs * scaled).sum(dim=-1)


def _chunked(
    inputs: torch.Tensor,
    tokens: torch.Tensor,
    to_logits: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    *,
    entropy: str,
    differentiable: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Selected-token logprobs of `to_logits(inputs)` over (m, ...) positions, in chunks, and entropies.

    `entropy` is "none", "value" (no gradient) or "grad" (part of the objective: the entropy bonus).
    With gradient each chunk is checkpointed: backward recomputes that chunk's logits instead of
    autograd holding them. torch.split, not slicing: one SplitBackward concatenates the chunk
    gradients once, where each slice's backward would write a zero-filled full-size gradient
    (measured 40 s on W3).
    """
    vocab = to_logits(inputs[:0]).shape[-1]
    step = positions_per_chunk(vocab)

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


class _ChunkBuffers:
    """The (chunk, vocab) buffers of one call, reused by its chunks: each is larger than glibc's 32 MiB mmap
    limit on a real vocabulary, so a fresh one per chunk came as new pages from the OS, faulted in again
    every time (an exp into a fresh buffer took 26 ms, in place 8 ms, for 341 x 49,152)."""

    def __init__(self, positions: int, weight: torch.Tensor):
        shape, device = (positions, weight.shape[0]), weight.device
        self.logits = torch.empty(shape, dtype=torch.float32, device=device)
        self.scratch = torch.empty(shape, dtype=torch.float32, device=device)
        # the product in the weight's dtype when that is not fp32 (also the bf16 copy of the logits' gradient)
        self.product = None if weight.dtype == torch.float32 else torch.empty(shape, dtype=weight.dtype, device=device)

    def scaled_logits(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
    ) -> torch.Tensor:
        """fp32 logits / temperature of the product in `weight`'s dtype, in this call's buffer (overwritten by the
        next chunk, so safe to modify in place)."""
        rows = x.shape[0]
        z = self.logits[:rows]
        product = z if self.product is None else self.product[:rows]
        x = x.to(weight.dtype)
        if bias is None:
            torch.mm(x, weight.t(), out=product)
        else:
            torch.addmm(bias, x, weight.t(), out=product)
        if product is not z:
            z.copy_(product)
        return z.div_(temperature) if temperature != 1.0 else z


def product_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype matrix products multiply `weight` in here: autocast's for an fp32 tensor under autocast, else its
    own."""
    device = weight.device.type
    if weight.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _chunk_statistics(
    z: torch.Tensor, tokens: torch.Tensor, with_entropy: bool, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(m, V) fp32 logits (overwritten), (m,) tokens -> logprob of each token, log-normaliser, E_p[z] (or None).
    `scratch`: an (m, V) fp32 buffer it may overwrite.

    With one (m, V) temporary besides `z` (torch.logsumexp and a separate softmax pass would take three):
    this chunk's logits are the largest tensors of the training pass, so its peak memory is set here.
    """
    top = z.amax(dim=-1)
    shifted = z.sub_(top.unsqueeze(-1))  # z - max <= 0: exp cannot overflow
    weights = torch.exp(shifted, out=scratch)
    total = weights.sum(dim=-1)
    log_total = total.log()
    logp = shifted.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_total
    mean_z = top + weights.mul_(shifted).sum(dim=-1) / total if with_entropy else None
    return logp, top + log_total, mean_z


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
    (log-normaliser, E_p[z]) and the hidden states. Under autocast the products run in the dtype autocast
    would have used, with the weight cast once per call (autocast's own cast, inside this function,
    is made again for every chunk: 23 casts of SmolLM2's 49,152 x 576 head, 0.84 s, in a W5 step).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, with_entropy):
        step = positions_per_chunk(weight.shape[0])
        logps, normalisers, expected = [], [], []
        dtype = product_dtype(weight)
        w, b = weight.to(dtype), (bias.to(dtype) if bias is not None else None)
        buffers = _ChunkBuffers(min(step, hidden.shape[0]), w)
        for x, t in zip(hidden.split(step), tokens.split(step)):
            with torch.autocast(weight.device.type, enabled=False):
                z = buffers.scaled_logits(x, w, b, temperature)
            logp, normaliser, mean_z = _chunk_statistics(z, t, with_entropy, buffers.scratch[: x.shape[0]])
            logps.append(logp)
            normalisers.append(normaliser)
            if with_entropy:
                expected.append(mean_z)
        logps, normaliser = torch.cat(logps), torch.cat(normalisers)
        expected = torch.cat(expected) if with_entropy else normaliser.new_zeros(0)
        ctx.save_for_backward(hidden, weight, bias, tokens, normaliser, expected)
        ctx.temperature, ctx.step, ctx.compute_dtype = temperature, step, dtype
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
        # Summed over the chunks in the products' dtype, as autograd through autocast sums a weight's gradients
        # (an fp32 sum took a conversion and an add of the whole (V, H) product per chunk: 0.6 s of a W5 step)
        grad_weight = None
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if need_bias and bias is not None
            else None
        )
        buffers = _ChunkBuffers(min(step, hidden.shape[0]), w)
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            x, g_logp = hidden[rows].to(dtype), grad_logps[rows].unsqueeze(-1)
            z = buffers.scaled_logits(x, w, b, temperature)
            if grad_entropy is None:  # G = -p * g_logp
                grad_z = z.sub_(normaliser[rows].unsqueeze(-1)).exp_().mul_(-g_logp)
            else:  # G = -p * (g_logp + g_entropy * (z - E_p[z]))
                centred = z.sub_(expected[rows].unsqueeze(-1))
                shift = (expected[rows] - normaliser[rows]).unsqueeze(-1)
                p = torch.add(centred, shift, out=buffers.scratch[: x.shape[0]]).exp_()
                grad_z = centred.mul_(grad_entropy[rows].unsqueeze(-1)).add_(g_logp).mul_(p).neg_()
            grad_z.scatter_add_(-1, tokens[rows].unsqueeze(-1), g_logp)  # + g_logp at the selected token
            grad_z = grad_z.div_(temperature) if temperature != 1.0 else grad_z
            grad_logits = grad_z if buffers.product is None else buffers.product[: x.shape[0]].copy_(grad_z)
            if need_hidden:
                grad_hidden[rows] = (grad_logits @ w).to(hidden.dtype)
            if need_weight and grad_weight is None:
                grad_weight = grad_logits.t() @ x
            elif need_weight:
                grad_weight.addmm_(grad_logits.t(), x)
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(dim=0)
        if need_weight and grad_weight is None:  # no positions
            grad_weight = torch.zeros_like(weight)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
        )


def _plain_linear(head: Callable) -> torch.nn.Linear | None:
    """The nn.Linear whose own forward `head` is (so its product can be differentiated by hand), else None."""
    module = getattr(head, "__self__", None)
    if (
        type(module) is torch.nn.Linear
        and getattr(head, "__func__", None) is torch.nn.Linear.forward
        and "forward" not in vars(module)
    ):
        return module
    return None


def logits_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, *, entropy: str = "value"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logprob of `tokens` (n, T) under softmax(logits / temperature) in fp32, and the entropy (see `_chunked`)."""
    return head_logprobs(logits, lambda x: x, tokens, temperature, entropy=entropy)


def head_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    temperature: float,
    *,
    entropy: str = "value",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like `logits_logprobs(head(hidden), ...)` without ever holding head(hidden) for all positions.

    `hidden` (n, T, H) are the final hidden states predicting `tokens` (n, T); `head` maps (m, H)
    to (m, V) logits (the model's LM head). Gradients flow to `hidden` and the head's parameters.
    """
    n, t, size = hidden.shape
    linear = _plain_linear(head)
    if linear is not None:
        logps, entropies = _LinearHeadLogprobs.apply(
            hidden.reshape(n * t, size),
            linear.weight,
            linear.bias,
            tokens.reshape(n * t),
            temperature,
            entropy != "none",
        )
        if entropy == "none":
            return logps.view(n, t), None
        return logps.view(n, t), (entropies if entropy == "grad" else entropies.detach()).view(n, t)
    differentiable = torch.is_grad_enabled() and (hidden.requires_grad or _has_trainable_parameters(head))
    logps, entropies = _chunked(
        hidden.reshape(n * t, size),
        tokens.reshape(n * t),
        head,
        temperature,
        entropy=entropy,
        differentiable=differentiable,
    )
    return logps.view(n, t), (entropies.view(n, t) if entropies is not None else None)


def _has_trainable_parameters(head: Callable) -> bool:
    module = getattr(head, "__self__", None)
    return isinstance(module, torch.nn.Module) and any(p.requires_grad for p in module.parameters())
