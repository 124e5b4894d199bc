"""The forward pass the two logprob passes (`logprobs.py`: plain; `prompt_packing.py`: packed) share.

- **The model body up to its LM head.** `forward_keeping` asks for the logits of the last positions only
  (`logits_to_keep`), or every position for a model whose forward does not take that keyword; within
  `capture_head_input` the LM head records its input (the final hidden states) and returns an empty
  logits tensor, so the head can be applied in chunks afterwards; `separable_head` says whether that is
  exact for a model (checked once per model, and logged).
- **The head reduced to the selected tokens' logprobs (and entropies), without full logits**
  (`head_logprobs`, `logits_logprobs`). The head is applied in checkpointed chunks of positions, each
  chunk reduced at once to the selected token's logprob (and the entropy), so autograd keeps the
  (rows, tokens, hidden) states only and backward recomputes one chunk's logits at a time; for a plain
  nn.Linear head the logits' gradient is formed by hand (`_LinearHeadLogprobs`). Under autocast the head's weight
  is cast before the body runs (`product_weight`), once a pass; the pass's lookups of a trained input embedding,
  tied or not, are made by one autograd node with that cast (`head_weight_and_inputs`), so a weight's gradients meet
  in one tensor.
- **The length buckets both passes run rows in** (`length_buckets`): rows sorted by length and run in
  groups, each trimmed to its own longest row, so a short completion does not pay for the longest one
  of its micro-batch; each extra bucket costs one more forward (`BUCKET_OVERHEAD_TOKENS`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.modules import module as nn_module
from transformers.utils import logging

logger = logging.get_logger("grouprl")

# Exceptions by which a model says "I cannot run this": a probe that meets one keeps the plain path
# (and logs why). Anything else (an out-of-memory error, a bug in a reward or user hook, an
# interrupt) is a genuine error and propagates.
UNSUPPORTED_BY_MODEL = (NotImplementedError, TypeError, ValueError, IndexError, RuntimeError)


def is_unsupported(err: BaseException) -> bool:
    """Whether `err`, raised by a probe's model call, means the model does not support the fast path."""
    return isinstance(err, UNSUPPORTED_BY_MODEL) and not isinstance(err, torch.OutOfMemoryError)


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# --- logits of the last positions only ------------------------------------------------------------

_NO_LOGITS_TO_KEEP: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose forward refused the keyword


def _refuses_logits_to_keep(err: TypeError) -> bool:
    """True for exactly Python's "got an unexpected keyword argument 'logits_to_keep'" error."""
    text = str(err)
    return "unexpected keyword argument" in text and "'logits_to_keep'" in text


def forward_keeping(model: torch.nn.Module, kwargs: dict, keep: int):
    """`model(**kwargs, logits_to_keep=keep)`; a model whose forward has no such keyword computes every position.

    Only the TypeError that names `logits_to_keep` as an unexpected keyword means that (remembered per
    model, logged once); any other TypeError is the model's own and propagates.
    """
    if model in _NO_LOGITS_TO_KEEP:
        return model(**kwargs)
    try:
        return model(**kwargs, logits_to_keep=keep)
    except TypeError as err:
        if not _refuses_logits_to_keep(err):
            raise
    _NO_LOGITS_TO_KEEP.add(model)
    logger.info(
        f"grouprl: {type(model).__name__}.forward takes no logits_to_keep; its logits are computed at every position."
    )
    return model(**kwargs)


# --- the LM head's input --------------------------------------------------------------------------


@contextlib.contextmanager
def capture_head_input(head: torch.nn.Module | None) -> Iterator[list]:
    """Within the block, the model's head records its input and returns an empty (…, 0) logits tensor.

    A per-call change to one module, undone in `finally`: an instance-level forward already there
    (e.g. the fp32 head of cast_lm_head_to_fp32) is put back as it was.
    """
    captured: list[torch.Tensor] = []
    if head is None:
        yield captured
        return

    def record(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(hidden)
        return hidden[..., :0]

    own = head.__dict__.get("forward")
    head.forward = record
    try:
        yield captured
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


# --- is the head separable? -----------------------------------------------------------------------

_SEPARABLE: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def sharded_parameters(model: torch.nn.Module) -> bool:
    """True when the model's weights are sharded over the processes (FSDP2's DTensors, DeepSpeed ZeRO-3's
    partitions): each of its forwards then gathers weights from every process, so every process must run as many
    forwards as the others."""
    return any(type(p).__name__ == "DTensor" or hasattr(p, "ds_id") for p in model.parameters())


def separable_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head if logits == head(final hidden state) exactly, else None.

    Checked once per model by comparing both paths on a short input, so models that post-process
    logits (soft-capping, scaling) are recognised without a list of architectures; the verdict is
    logged once. Sharded models (FSDP, DeepSpeed ZeRO-3) gather the head's weight only inside their
    own forward: not separable.
    """
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or type(model).__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine"):
        return None
    weight = getattr(head, "weight", None)
    if weight is None or sharded_parameters(head) or weight.dim() != 2:
        return None
    if model not in _SEPARABLE:
        reason = _head_mismatch(model, head)
        _SEPARABLE[model] = reason is None
        if reason is None:
            logger.info(
                f"grouprl: {type(inner).__name__}'s LM head is applied in chunks by grouprl (no full logits held)."
            )
        else:
            logger.info(
                f"grouprl: {type(inner).__name__}'s LM head is not separable ({reason}); its logits come from its own "
                "forward, reduced in chunks."
            )
    return head if _SEPARABLE[model] else None


@torch.no_grad()
def _head_mismatch(model: torch.nn.Module, head: torch.nn.Module) -> str | None:
    """None if head(captured hidden states) reproduces the model's logits on a 4-token probe, else why not."""
    probe = torch.arange(1, 5, device=head.weight.device).unsqueeze(0) % head.weight.shape[0]
    kwargs = {"input_ids": probe, "attention_mask": torch.ones_like(probe), "use_cache": False}
    try:
        with capture_head_input(head) as captured:
            forward_keeping(model, kwargs, 2)
        expected = forward_keeping(model, kwargs, 2).logits.float()
        got = head(captured[0]).float()
    except Exception as err:
        if not is_unsupported(err):
            raise
        return f"the probe forward failed: {describe(err)}"
    if got.shape != expected.shape:
        return f"head(hidden) has shape {tuple(got.shape)}, the model's logits {tuple(expected.shape)}"
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        return f"the model post-processes the head's logits (max difference {float((got - expected).abs().max()):.3g})"
    return None


def cache_keyword(target: object) -> str:
    """The keyword the forward of `target` (a model, a peft wrapper, or `functools.partial(cls.forward, model)`)
    takes its KV cache by: transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in
    5.40); models it has not migrated, and older transformers, take `past_key_values`."""
    model = target.args[0] if isinstance(target, functools.partial) and target.args else target
    if callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    try:
        parameters = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


# --- the head reduced to the selected tokens' logprobs, in chunks of positions --------------------

# fp32 logits per chunk of positions (64 MiB): the chunk and its temporaries are the training pass's largest tensors
# (in bf16 the product's own buffers add about twice the chunk). Large vocabularies still get MIN_CHUNK_POSITIONS
# positions: with fewer rows the product runs slower (W3, 151,936 tokens: 12% slower head at 110 positions).
CHUNK_ELEMENTS = 1 << 24
MIN_CHUNK_POSITIONS = 256


def positions_per_chunk(vocab: int) -> int:
    return max(MIN_CHUNK_POSITIONS, CHUNK_ELEMENTS // max(vocab, 1))


# --- reductions of one chunk of positions ---------------------------------------------------------


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


def product_weight(head: torch.nn.Module | None) -> torch.Tensor | None:
    """A trainable plain nn.Linear head's weight cast to the dtype its products run in (fp32 under bf16 autocast:
    bf16), for `head_logprobs`, or None where there is no cast to make. Made before the model's body runs: of the
    nodes ready to run, autograd runs the one made last first, so this cast's backward, which converts the head's
    gradient to fp32 for the weight's .grad, runs after every layer's. Through the layers' backward, where a training
    pass peaks, the gradient is held in the product dtype (0.27 GB for Qwen2.5-0.5B's 151,936 x 896 head); cast
    inside the head, its backward handed the weight the fp32 gradient (0.54 GB) at once."""
    if not _trains_plain_head(head):
        return None
    dtype = product_dtype(head.weight)
    return None if dtype == head.weight.dtype else head.weight.to(dtype)


def _trains_plain_head(head: torch.nn.Module | None) -> bool:
    """Whether this pass trains `head`'s weight through a plain nn.Linear's own product (head_logprobs's own path)."""
    return (
        type(head) is torch.nn.Linear
        and "forward" not in vars(head)
        and torch.is_grad_enabled()
        and head.weight.requires_grad
    )


def product_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype matrix products multiply `weight` in here: autocast's for an fp32 tensor under autocast, else its
    own."""
    device = weight.device.type
    if weight.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


# --- a pass's embedding lookups, and a tied head's weight, as one node --------------------------------------
#
# The LM head's weight for a training pass, and the model's inputs to go with it: one autograd node makes every
# lookup of a trained input embedding in the pass (its length buckets' forwards), and where the head's weight is also
# the embedding's (tied embeddings: Qwen2.5 up to 3B, Llama 3.2, SmolLM2), the head's weight too, so the weight's
# gradients meet in one tensor of its dtype.
#
# Left to autograd, the end of backward held three copies of a tied weight's size at once: the lookup's gradient
# (embedding_dense_backward makes all of vocab x hidden, however few tokens the batch has), the head's gradient, and
# their sum, which the engine makes out of place (for Qwen2.5-0.5B's 151,936 x 896 weight, 3 x 0.54 GB in fp32); and
# an untied embedding looked up in several buckets had a dense gradient made for each, summed out of place too.
# Here the node's backward adds the lookups' gradients at the batch's tokens only, into:
# - under bf16 autocast (fp32 weights; the head's weight cast to bf16 before the body runs, `product_weight`) the
#   head's gradient converted to fp32: the bf16 gradient and one fp32 copy at most (0.27 + 0.54 GB);
# - without autocast (fp32 or bf16 weights: the head uses the weight itself) the head's gradient where it lies: one
#   copy;
# - untied, one zeroed gradient (a single lookup is left to autograd: its gradient is that one tensor already).
# Made once a pass, before every bucket's body, the node's backward runs after every bucket's layers' backward, so
# the head's gradient stays in its products' dtype through all of them. Where a pass's activations are small against
# its vocabulary (few rows, checkpointed layers, a small model with a large vocabulary), the end of backward is the
# pass's peak.
#
# The gradients are the ones autograd forms, bit for bit on a CPU in fp32 with one bucket: each token's rows are
# summed in the batch's order, as embedding_dense_backward sums them, then added to the head's (tests/test_logprobs.py).
# bf16 rows are summed in fp32 and rounded once, as a GPU's embedding backward sums them (a CPU's rounds after every
# row); the head's bf16 gradients of several buckets are summed in bf16, as autocast's own cast, made once in an
# autocast region, sums them. Used only where the lookup is exactly `F.embedding` of an `nn.Embedding` with nothing
# else attached (no hooks but transformers' own, no max_norm, scale_grad_by_freq or sparse gradients), whose weight
# is whole outside the model's forward (not sharded), and the model takes only token ids, a mask and positions;
# elsewhere the model looks its tokens up itself, as before.

# the keywords of a text-only training forward; any other input (images, token types, ...) keeps the model's own lookup
_PLAIN_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "output_router_logits"})


def head_weight_and_inputs(
    model: torch.nn.Module,
    head: torch.nn.Module | None,
    forwards: list[dict[str, Any]],
    plain_inputs: frozenset[str] = frozenset(),
) -> tuple[torch.Tensor | None, list[dict[str, Any]]]:
    """`product_weight(head)` and the keyword arguments of a pass's forwards (its length buckets), the lookups of a
    trained input embedding made by one node (the comment above): each forward's keywords then carry its tokens'
    `inputs_embeds` in place of `input_ids`, and for a head tied to the embedding the same node gives the head's
    weight as its products take it (cast, or the weight itself). Call it once a pass, before the model's body runs:
    the weight's gradients then meet, and leave the products' dtype, after every forward's layers' backward.
    `plain_inputs`: other keywords the pass may carry that do not change the lookup (the packed pass's attention
    layout)."""
    embedding = _plain_embedding(model)
    tied = embedding is not None and _trains_plain_head(head) and embedding.weight is head.weight
    if (
        embedding is None
        or not (torch.is_grad_enabled() and embedding.weight.requires_grad)
        or (not tied and len(forwards) == 1)  # one lookup of its own: autograd's gradient is the same tensor
        or any(not set(kwargs) <= _PLAIN_INPUTS | plain_inputs for kwargs in forwards)
    ):
        return product_weight(head), forwards
    dtype = product_dtype(embedding.weight) if tied else None
    ids = [kwargs["input_ids"] for kwargs in forwards]
    outputs = _Lookups.apply(embedding.weight, dtype, embedding.padding_idx, *ids)
    weight, embeds = (outputs[0], outputs[1:]) if tied else (product_weight(head), outputs)
    return weight, [
        {**{k: v for k, v in kwargs.items() if k != "input_ids"}, "inputs_embeds": looked_up}
        for kwargs, looked_up in zip(forwards, embeds)
    ]


def _plain_embedding(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """The model's input embedding if its lookup is exactly F.embedding, can be made before the model's body runs
    and the model takes `inputs_embeds` in place of its tokens, else None."""
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    get_embedding = getattr(inner, "get_input_embeddings", None)
    embedding = get_embedding() if callable(get_embedding) else None
    if type(embedding) is not torch.nn.Embedding:
        return None
    if type(embedding.weight) is not torch.nn.Parameter or hasattr(embedding.weight, "ds_id"):
        return None  # sharded (FSDP2's DTensor, DeepSpeed ZeRO-3's partition): whole only inside the model's forward
    try:
        parameters = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):  # a forward whose signature Python cannot read
        return None
    if "inputs_embeds" not in parameters:
        return None  # a model of the user's own that takes token ids only
    if (
        embedding.max_norm is not None
        or embedding.scale_grad_by_freq
        or embedding.sparse
        or "forward" in vars(embedding)
    ):
        return None
    hooks = [*embedding._forward_pre_hooks.values(), *embedding._forward_hooks.values()]
    if any(not _makes_output_require_grad(hook) for hook in hooks) or _global_module_hooks():
        return None  # a hook would not see a lookup made here
    return embedding


def _makes_output_require_grad(hook: Any) -> bool:
    """transformers' enable_input_require_grads hook (gradient checkpointing registers it): it makes the lookup's
    output require grad, which the lookups node's outputs do already (the weight is trained)."""
    return getattr(hook, "__qualname__", "").endswith("enable_input_require_grads.<locals>.make_inputs_require_grads")


def _global_module_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


class _Lookups(torch.autograd.Function):
    """(weight, the head's products' dtype or None, padding index, token ids of each forward) -> (for a tied head
    (a dtype given): the weight in that dtype, then) each forward's embeddings; backward: the head's gradient in the
    weight's dtype, or zeros, with the lookups' gradients added at the batch's tokens (the comment above)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype | None, padding_idx: int | None, *ids: torch.Tensor):
        ctx.save_for_backward(*ids)
        ctx.padding_idx, ctx.weight_dtype, ctx.weight_shape = padding_idx, weight.dtype, weight.shape
        ctx.tied = dtype is not None
        embeds = tuple(F.embedding(tokens, weight, padding_idx) for tokens in ids)
        if not ctx.tied:
            return embeds
        # in the weight's own dtype, the weight itself (a view: no copy)
        return weight.view_as(weight) if dtype == weight.dtype else weight.to(dtype), *embeds

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ids = ctx.saved_tensors
        grad_cast, grad_embeds = (grads[0], grads[1:]) if ctx.tied else (None, grads)
        if grad_cast is None:
            grad = torch.zeros(ctx.weight_shape, dtype=ctx.weight_dtype, device=ids[0].device)
        elif grad_cast.dtype != ctx.weight_dtype:
            grad = grad_cast.to(ctx.weight_dtype)  # a new tensor: ours to add into
        elif grad_cast._base is None and grad_cast.is_contiguous():
            # the head's gradient in the weight's dtype already: added into where it lies. The cast weight goes to
            # the head's products alone (head_logprobs), whose backward makes this tensor for this node only
            grad = grad_cast
        else:
            grad = grad_cast.clone()
        looked_up = [(tokens, rows) for tokens, rows in zip(ids, grad_embeds) if rows is not None]
        if looked_up:
            tokens = [t.reshape(-1) for t, _ in looked_up]
            rows = [r.reshape(t.numel(), -1) for t, r in looked_up]
            tokens, rows = (tokens[0], rows[0]) if len(looked_up) == 1 else (torch.cat(tokens), torch.cat(rows))
            if ctx.padding_idx is not None:  # F.embedding gives the padding token no gradient
                kept = tokens != ctx.padding_idx
                tokens, rows = tokens[kept], rows[kept]
            # each token's rows summed in fp32 at least, in one order whatever the threads, then rounded and added
            # once (the comment above)
            distinct, slot = torch.unique(tokens, return_inverse=True)
            sum_dtype = torch.promote_types(rows.dtype, torch.float32)
            sums = sum_rows_by_slot(rows.to(sum_dtype), slot, distinct.numel())
            grad.index_put_((distinct,), sums.to(grad.dtype), accumulate=True)  # distinct rows: one addition each
        return grad, None, None, *(None for _ in ids)


def sum_rows_by_slot(rows: torch.Tensor, slot: torch.Tensor, slots: int) -> torch.Tensor:
    """(n, d) rows, each row's slot in [0, slots) -> (slots, d): the rows of each slot summed, the same bits on every
    run. On a CPU index_put_'s accumulation splits the rows among threads, so its sums change with the threads'
    timing (a seeded run then drifts apart after some steps) while index_add_ adds in the rows' order; on CUDA it is
    the other way round (index_add_ adds atomically, index_put_ sorts first)."""
    sums = rows.new_zeros(slots, rows.shape[1])
    if rows.device.type == "cuda":
        return sums.index_put_((slot,), rows, accumulate=True)
    return sums.index_add_(0, slot, rows)


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
        if grad_logps is None:
            grad_logps = normaliser.new_zeros(normaliser.shape)
        # The chunks' work returns before the weight's gradient is converted to the weight's dtype, so the weight's
        # product-dtype copy and the chunk buffers are freed by then: the two (vocab, hidden) gradients are the
        # largest tensors of the training pass's backward, and nothing else of the head's peaks with them.
        grad_hidden, grad_weight, grad_bias = _head_gradients(
            hidden, weight, bias, tokens, normaliser, expected, grad_logps, grad_entropy,
            ctx.temperature, ctx.step, ctx.compute_dtype, ctx.needs_input_grad[:3],
        )  # fmt: skip
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
        )


def _head_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tokens: torch.Tensor,
    normaliser: torch.Tensor,
    expected: torch.Tensor,
    grad_logps: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    step: int,
    dtype: torch.dtype,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`_LinearHeadLogprobs`'s gradients for the hidden states (their dtype), the weight (the products' `dtype`)
    and the bias (fp32), each None where `needs` (hidden, weight, bias) says so or there is no bias; chunk by chunk of
    `step` positions (its doc)."""
    need_hidden, need_weight, need_bias = needs
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
    return grad_hidden, grad_weight, grad_bias


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
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like `logits_logprobs(head(hidden), ...)` without ever holding head(hidden) for all positions.

    `hidden` (n, T, H) are the final hidden states predicting `tokens` (n, T); `head` maps (m, H)
    to (m, V) logits (the model's LM head). Gradients flow to `hidden` and the head's parameters.
    `weight`: the head's weight as `product_weight` gave it before the model's body ran (its doc), if it did.
    """
    n, t, size = hidden.shape
    linear = _plain_linear(head)
    if linear is not None:
        logps, entropies = _LinearHeadLogprobs.apply(
            hidden.reshape(n * t, size),
            linear.weight if weight is None else weight,
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


# --- length buckets -------------------------------------------------------------------------------

BUCKET_OVERHEAD_TOKENS = 64  # what one extra forward costs, in padded tokens (measured: small on CPU)


def length_buckets(
    lengths: list[int],
    max_rows: int | None,
    overhead: int = BUCKET_OVERHEAD_TOKENS,
    rows: list[int] | None = None,
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


def in_row_order(parts: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    """Concatenate per-bucket results whose rows are `order` (original row indices) back into row order."""
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(parts)[inverse.to(parts[0].device)]
