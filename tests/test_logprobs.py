"""Chunked LM-head logprobs and length buckets: equal to the naive full-logits computation."""

import os
import sys
from unittest.mock import patch

import pytest
import torch
from helpers import torch_threads
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM

import grouprl.model.forward as model_forward
import grouprl.model.logprobs as lp


def naive_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """One forward over the whole padded batch, full (n, L, V) logits, plain log_softmax."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1).long()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=lp.position_ids_from_mask(mask)).logits
    logits = logits[:, prompt_ids.shape[1] - 1 : -1].float() / temperature
    logp_all = logits.log_softmax(-1)
    logps = logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps * completion_mask, entropy * completion_mask


def ragged_batch(vocab, seed=0):
    """6 rows: prompts of 2..7 tokens (left-padded), completions of 1..9 tokens (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, completion_lens = [2, 7, 3, 5, 7, 4], [9, 1, 4, 9, 2, 6]
    n, p, t = 6, max(prompt_lens), max(completion_lens)
    prompt_ids = torch.randint(1, vocab, (n, p), generator=g)
    completion_ids = torch.randint(1, vocab, (n, t), generator=g)
    prompt_mask = torch.arange(p).flip(0).unsqueeze(0) < torch.tensor(prompt_lens).unsqueeze(1)
    completion_mask = torch.arange(t).unsqueeze(0) < torch.tensor(completion_lens).unsqueeze(1)
    return prompt_ids * prompt_mask, prompt_mask, completion_ids * completion_mask, completion_mask


@pytest.fixture
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def parameter_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("head_path", ["hand-written backward", "autograd over checkpointed chunks"])
@pytest.mark.parametrize("bucket_by_length", [True, False])
def test_chunked_head_logprobs_equal_naive_in_value_and_gradient(model, monkeypatch, bucket_by_length, head_path):
    batch = ragged_batch(model.config.vocab_size)
    weights = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1))
    expected_logps, expected_entropy = naive_logprobs(model, *batch, 0.7)
    expected_grads = parameter_grads(model, (expected_logps * weights).sum() + expected_entropy.sum())

    head = model.get_output_embeddings()
    if head_path == "hand-written backward":  # the head is a plain nn.Linear: _LinearHeadLogprobs
        seen = []
        real_logits = model_forward._ChunkBuffers.scaled_logits
        monkeypatch.setattr(  # the positions of each chunk's head product
            model_forward._ChunkBuffers,
            "scaled_logits",
            lambda self, x, *a: seen.append(x.shape[0]) or real_logits(self, x, *a),
        )
    else:  # a head with its own forward: generic path
        seen = []
        real_forward = head.forward
        monkeypatch.setattr(head, "forward", lambda x: seen.append(x.shape[0]) or real_forward(x))
    monkeypatch.setattr(model_forward, "CHUNK_ELEMENTS", model.config.vocab_size * 4)  # 4 positions per chunk
    monkeypatch.setattr(model_forward, "MIN_CHUNK_POSITIONS", 1)
    model_forward._SEPARABLE.clear()
    out = lp.completion_logprobs(model, *batch, temperature=0.7, entropy_grad=True, bucket_by_length=bucket_by_length)
    assert lp.separable_head(model) is head
    masked_logps, masked_entropy = out.logprobs * batch[3], out.entropy * batch[3]
    assert torch.allclose(masked_logps, expected_logps, atol=1e-5)
    assert torch.allclose(masked_entropy, expected_entropy, atol=1e-4)
    grads = parameter_grads(model, (masked_logps * weights).sum() + masked_entropy.sum())
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3)
    # The head only ever saw chunks of <= 4 positions (the probe uses 3): no (rows, tokens, vocab) logits.
    assert seen and max(seen) <= 4


@pytest.mark.parametrize("entropy", ["none", "value", "grad"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_hand_written_head_backward_equals_autograd(monkeypatch, entropy, temperature, bias):
    """_LinearHeadLogprobs against log_softmax over full logits in float64: values, and the gradients of hidden
    states, weight and bias for an arbitrary upstream gradient of both outputs, over several chunks."""
    monkeypatch.setattr(
        model_forward, "CHUNK_ELEMENTS", 50 * 3
    )  # vocab 50: 3 positions per chunk, 11 positions -> 4 chunks
    monkeypatch.setattr(model_forward, "MIN_CHUNK_POSITIONS", 1)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=bias)
    hidden = torch.randn(1, 11, 8, generator=g, requires_grad=True)
    tokens = torch.randint(0, 50, (1, 11), generator=g)
    up_logps, up_entropy = torch.randn(1, 11, generator=g), torch.randn(1, 11, generator=g)

    logps, entropies = lp.head_logprobs(hidden, head.forward, tokens, temperature, entropy=entropy)
    loss = (logps * up_logps).sum() + ((entropies * up_entropy).sum() if entropy == "grad" else 0)
    params = [hidden, head.weight] + ([head.bias] if bias else [])
    got = torch.autograd.grad(loss, params)

    wide = [p.detach().double().requires_grad_() for p in params]
    logits = torch.nn.functional.linear(wide[0], wide[1], wide[2] if bias else None) / temperature
    logp_all = logits.log_softmax(-1)
    want_logps = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    want_entropy = -(logp_all.exp() * logp_all).sum(-1)
    want_loss = (want_logps * up_logps).sum() + ((want_entropy * up_entropy).sum() if entropy == "grad" else 0)
    want = torch.autograd.grad(want_loss, wide)

    assert torch.allclose(logps.double(), want_logps, atol=1e-5)
    if entropy == "none":
        assert entropies is None
    else:
        assert torch.allclose(entropies.double(), want_entropy, atol=1e-5)
        assert entropies.requires_grad == (entropy == "grad")
    for name, a, b in zip(["hidden", "weight", "bias"], got, want):
        assert torch.allclose(a.double(), b, atol=1e-5), name


def test_hand_written_head_backward_skips_a_frozen_head():
    """A frozen head (LoRA, or a frozen embedding) gets no gradient product; the hidden states still do."""
    head = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    tokens = torch.randint(0, 50, (2, 5))
    logps, _ = lp.head_logprobs(hidden, head.forward, tokens, 1.0, entropy="none")
    logps.sum().backward()
    want = torch.func.grad(
        lambda h: torch.nn.functional.linear(h, head.weight).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).sum()
    )(hidden.detach())
    assert head.weight.grad is None and torch.allclose(hidden.grad, want, atol=1e-5)


def test_hand_written_head_backward_in_bf16_matches_autograd_in_bf16():
    """bf16 weights: the recompute and the gradient products run in bf16 as autograd's would (to bf16 tolerance)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 64, bias=False).to(torch.bfloat16)
    hidden = torch.randn(3, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 64, (3, 4))
    logps, _ = lp.head_logprobs(hidden, head.forward, tokens, 0.8, entropy="none")
    got = torch.autograd.grad(logps.sum(), [hidden, head.weight])
    logits = torch.nn.functional.linear(hidden, head.weight).float() / 0.8
    want_logps = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    want = torch.autograd.grad(want_logps.sum(), [hidden, head.weight])
    assert torch.allclose(logps, want_logps, atol=1e-5)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_head_backward_never_holds_the_weights_copy_with_both_of_its_gradients(monkeypatch):
    """fp32 head under bf16 autocast: the backward sums the weight's gradient in bf16 over the chunks, with a bf16
    copy of the weight, then converts the sum to fp32. The copy (and the chunk buffers) must be gone by then: three
    (vocab, hidden) tensors at once were the head's backward peak (the 0.5B case: 1.60 GB, now 1.05 GB)."""
    vocab, width = 4096, 512
    monkeypatch.setattr(model_forward, "CHUNK_ELEMENTS", 64 * vocab)  # chunks of 64 positions: small buffers
    monkeypatch.setattr(model_forward, "MIN_CHUNK_POSITIONS", 1)
    head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(2, 300, width, requires_grad=True)
    tokens = torch.randint(0, vocab, (2, 300))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from bench_head_memory import LiveStorageBytes

    counter = LiveStorageBytes()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logps, entropies = lp.head_logprobs(hidden, head.forward, tokens, 1.0)
        (logps.sum() + entropies.sum()).backward()
    matrix = vocab * width
    assert head.weight.grad.dtype == torch.float32
    assert counter.peak >= matrix * (2 + 4), "the bf16 sum and its fp32 conversion do coexist once"
    assert counter.peak < matrix * (2 + 2 + 4), "the bf16 weight, its bf16 gradient and the fp32 one coexisted"


SMALL_VOCAB, SMALL_WIDTH = 4096, 32  # small_qwen2_pass's model


def small_qwen2(tied: bool = True, pad_token_id=None) -> torch.nn.Module:
    """A small Qwen2 (vocab 4,096 x 32, 2 layers) in train mode, seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=SMALL_VOCAB, hidden_size=SMALL_WIDTH, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=64,
        pad_token_id=pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).train()


def small_qwen2_pass(
    cast: str, batch: tuple, *, tied: bool = True, pad_token_id=None, hook=None, precision: str = "autocast"
) -> tuple[dict, dict[str, torch.Tensor]]:
    """bench_head_memory.pass_peaks (`cast`: its HEAD_CASTS) of `small_qwen2`, checkpointed as the trainer runs it,
    on the test's device; `hook`: a forward hook on its input embedding; `precision`: fp32 weights under bf16
    autocast, fp32 alone or bf16 weights (the bench's PRECISIONS)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from bench_head_memory import pass_peaks

    device = "cuda" if torch.cuda.is_available() else "cpu"  # autograd's order is the same on every device
    model = small_qwen2(tied, pad_token_id).to(device, torch.bfloat16 if precision == "bf16" else torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hook is not None:
        model.get_input_embeddings().register_forward_hook(hook)
    return pass_peaks(model, tuple(t.to(device) for t in batch), cast, autocast=precision == "autocast")


@pytest.mark.parametrize("tied", [False, True])
def test_the_layers_backward_holds_the_heads_gradient_in_bf16(tied):
    """Under bf16 autocast (fp32 weights, as bf16=True trains) the head's weight is cast before the model's body runs
    (forward.product_weight), so autograd converts the head's gradient to fp32 only after the layers' backward, where
    a training pass peaks (the 0.5B case on an H200); cast after the body (autocast's own cast, inside the head), its
    fp32 gradient was held from the head's backward on. Measured here as the tensor bytes alive during the layers'
    backward, checkpointed as the trainer runs them: lower by the fp32 gradient's half. The gradients are the same,
    bit for bit."""
    early, early_grads = small_qwen2_pass("before the body", ragged_batch(SMALL_VOCAB), tied=tied)
    late, late_grads = small_qwen2_pass("in the head", ragged_batch(SMALL_VOCAB), tied=tied)
    assert late["layers_backward_peak"] - early["layers_backward_peak"] >= SMALL_VOCAB * SMALL_WIDTH * (4 - 2)
    assert all(torch.equal(early_grads[name], late_grads[name]) for name in early_grads)


def tied_pass(cast: str, pad_token_id=None, hook=None, precision="autocast") -> tuple[dict, dict[str, torch.Tensor]]:
    """small_qwen2_pass with tied embeddings, over a batch with token 0 in real positions."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch(SMALL_VOCAB)
    prompt_ids[:, -1] = 0  # token 0 in every row's last prompt position: real tokens, not padding
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    return small_qwen2_pass(cast, batch, pad_token_id=pad_token_id, hook=hook, precision=precision)


@pytest.mark.parametrize("pad_token_id", [None, 0])
def test_a_tied_weights_two_gradients_meet_in_one_fp32_tensor(pad_token_id):
    """Tied embeddings under bf16 autocast: the lookup and the head's cast are one node
    (forward.head_weight_and_inputs), whose backward adds the lookup's gradient into the head's fp32 one at the
    batch's tokens. Left to autograd, the end of backward held the lookup's dense gradient, the head's fp32 gradient
    and their sum at once. The same gradients, bit for bit on a CPU, the padding token's embedding included (with
    pad_token_id=0, F.embedding gives token 0's lookups no gradient, though the batch has it in real positions)."""
    fused, fused_grads = tied_pass("tied node", pad_token_id)
    apart, apart_grads = tied_pass("before the body", pad_token_id)
    matrix = SMALL_VOCAB * SMALL_WIDTH * 4  # the fp32 weight's bytes
    assert apart["backward_end_peak"] - fused["backward_end_peak"] >= 1.25 * matrix  # measured: 1.45
    assert fused["backward_end_peak"] >= 1.5 * matrix  # the bf16 gradient and its fp32 conversion, at once
    for name, grad in fused_grads.items():
        if grad.device.type == "cpu":
            assert torch.equal(grad, apart_grads[name]), name
        else:  # a GPU's embedding backward sums a token's rows in an order of its own
            torch.testing.assert_close(grad, apart_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("pad_token_id", [None, 0])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_tied_weight_without_autocast_takes_both_gradients_in_one_tensor(precision, pad_token_id):
    """Tied embeddings without autocast (fp32 weights, the default on a CPU without native bf16; or weights loaded
    in bf16): the head's gradient comes in the weight's dtype, and the node adds the lookup's gradient into it where
    it lies. Left to autograd, the end of backward held the lookup's dense gradient, the head's and their sum: three
    copies of the weight where one is left. The same gradients as autograd's: bit for bit in fp32 on a CPU."""
    fused, fused_grads = tied_pass("tied node", pad_token_id, precision=precision)
    apart, apart_grads = tied_pass("before the body", pad_token_id, precision=precision)
    matrix = SMALL_VOCAB * SMALL_WIDTH * (4 if precision == "fp32" else 2)  # the weight's bytes
    assert apart["backward_end_peak"] - fused["backward_end_peak"] >= 1.75 * matrix
    for name, grad in fused_grads.items():
        assert grad.dtype == apart_grads[name].dtype, name
        if grad.device.type == "cpu" and precision == "fp32":
            assert torch.equal(grad, apart_grads[name]), name
        else:  # a GPU's embedding backward sums a token's rows in an order of its own; bf16 rounds the sums
            torch.testing.assert_close(grad, apart_grads[name], msg=name)


@pytest.mark.parametrize("tied", [False, True])
def test_a_pass_of_several_buckets_casts_the_head_once_and_converts_its_gradient_once(tied):
    """A training pass over several length buckets (several forwards) casts the head's weight to bf16 once, before
    every bucket's body, so the head's gradient stays in bf16 through every bucket's layers' backward and becomes fp32
    once, at the end. Cast per bucket, each bucket's fp32 gradient (for a tied weight, with its lookup's added) was
    made after its own layers' backward and held through the next bucket's. An untied embedding's lookups are one
    node too: each bucket's lookup made a dense vocab x hidden gradient, which autograd then summed out of place."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from bench_head_memory import LiveStorageBytes

    model = small_qwen2(tied)
    shape = (SMALL_VOCAB, SMALL_WIDTH)

    class HeadSized(LiveStorageBytes):
        """Also: the head-sized tensors made, by dtype, and the most fp32 ones alive at once."""

        def __init__(self):
            super().__init__()
            self.made, self.most_fp32 = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = set(self.alive)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.made += [entry[3] for key, entry in self.alive.items() if key not in before and entry[2] == shape]
            alive = sum(1 for entry in self.alive.values() if entry[2] == shape and entry[3] == torch.float32)
            self.most_fp32 = max(self.most_fp32, alive)
            return out

    batch = ragged_batch(SMALL_VOCAB)
    assert lp.separable_head(model) is model.lm_head  # its one-time check (forwards of its own) settled first
    counter = HeadSized()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lp.completion_logprobs(model, *batch, temperature=1.0, bucket_by_length=False, rows_per_chunk=2)
        forward_made = list(counter.made)
        (out.logprobs * batch[3]).sum().backward()
    assert forward_made == [torch.bfloat16], "the head's weight is cast once for the pass's three buckets"
    # each weight's gradient one fp32 tensor: the head's and, untied, the embedding's (its lookups' summed in one)
    assert counter.most_fp32 == (1 if tied else 2)
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with patch.object(lp, "head_weight_and_inputs", lambda model, head, forwards: (None, forwards)):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autograd's own: casts and lookups in every bucket
            out = lp.completion_logprobs(model, *batch, temperature=1.0, bucket_by_length=False, rows_per_chunk=2)
        (out.logprobs * batch[3]).sum().backward()
    for name, param in model.named_parameters():
        if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
            # the head's bf16 gradients summed over the buckets in bf16, as autocast's cast (made once in an autocast
            # region, and cached) sums them; autograd's own here cast per bucket, and summed in fp32
            torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=2**-7 * float(param.grad.abs().max()))
        else:
            assert torch.equal(grads[name], param.grad), name


def test_the_tied_node_sums_a_tokens_bf16_rows_in_fp32():
    """bf16 weights: each token's lookup rows, over all of a pass's forwards, are summed in fp32 and rounded once,
    then added to the head's gradient (as a GPU's embedding backward sums them); the CPU's own embedding backward
    rounds after every row, which over a thousand rows of one token is off in the first digits."""
    torch.manual_seed(0)
    weight = torch.randn(10, 8, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.zeros(4, 250, dtype=torch.long)
    ids[0, :3] = torch.tensor([3, 7, 3])
    rows, head_grad = torch.randn(4, 250, 8, dtype=torch.bfloat16), torch.randn(10, 8, dtype=torch.bfloat16)
    cast, *embeds = model_forward._Lookups.apply(weight, torch.bfloat16, None, ids[:1], ids[1:])
    assert cast.dtype == torch.bfloat16 and cast.data_ptr() == weight.data_ptr()  # the weight itself: no copy
    torch.autograd.backward([cast, *embeds], [head_grad.clone(), rows[:1], rows[1:]])  # two forwards' lookups
    sums = torch.zeros(10, 8).index_add_(0, ids.reshape(-1), rows.reshape(-1, 8).float())
    assert torch.equal(weight.grad, head_grad + sums.bfloat16())


def test_the_tied_nodes_gradient_has_the_same_bits_under_any_threads():
    """A seeded run repeats exactly whatever the thread count: each token's rows are summed in the rows' order. On a
    CPU index_put_'s accumulation splits the rows among the threads and its sums change from call to call (the demo's
    runs drifted apart after some steps); a planted index_put_ fails here on a machine with 2 or more cores."""
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (128, 60))  # a batch's tokens: few distinct, each in many rows
    rows = torch.randn(128, 60, 64)
    grads = []
    for count in (1, 2, 3, 2, 4, 2, 2, 2):
        weight = torch.zeros(100, 64, requires_grad=True)
        with torch_threads(count):
            cast, embeds = model_forward._Lookups.apply(weight, torch.float32, None, ids)
            torch.autograd.backward([cast, embeds], [torch.zeros(100, 64), rows])
        grads.append(weight.grad)
    assert all(torch.equal(grad, grads[0]) for grad in grads)
    in_order = torch.zeros(100, 64, dtype=torch.float64).index_add_(0, ids.reshape(-1), rows.reshape(-1, 64).double())
    torch.testing.assert_close(grads[0], in_order.float(), rtol=1e-6, atol=1e-5)


def test_a_sharded_tied_weight_keeps_the_models_own_lookup():
    """A weight whole only inside the model's forward (DeepSpeed ZeRO-3 partitions it, FSDP2 makes it a DTensor)
    cannot be looked up before the body runs: the model looks its tokens up itself."""
    model = small_qwen2()
    assert model_forward._plain_embedding(model) is model.model.embed_tokens
    model.lm_head.weight.ds_id = 0  # as DeepSpeed marks the parameters it partitions
    assert model_forward._plain_embedding(model) is None


def test_a_hooked_embedding_keeps_its_own_lookup():
    """A forward hook on the input embedding (other than transformers' own, which makes the output require grad)
    must see the lookup: the model then looks its tokens up itself, and the hook sees the pass's (the forwards
    without grad are the head's check, forward.separable_head)."""
    calls = []
    peaks, _ = tied_pass("tied node", hook=lambda module, args, output: calls.append(torch.is_grad_enabled()))
    assert calls.count(True) == 1
    apart, _ = tied_pass("before the body")
    assert peaks["backward_end_peak"] == apart["backward_end_peak"]


def test_head_path_holds_no_full_logits_in_memory(tiny_model_dir, monkeypatch):
    """Autograd keeps the hidden states, not fp32 logits: saved tensors shrink by about vocab/hidden."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = ragged_batch(model.config.vocab_size)

    def saved_bytes(separable: bool) -> int:
        model_forward._SEPARABLE.clear()
        if not separable:
            model_forward._SEPARABLE[model] = False
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp.completion_logprobs(model, *batch, temperature=1.0, bucket_by_length=False)
        return total

    assert saved_bytes(True) < saved_bytes(False)


def test_models_that_post_process_logits_use_the_plain_path():
    """Gemma2 soft-caps its logits after the head: the one-time probe must notice and fall back."""
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=0.5,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # logits far beyond the cap, so capping changes them
    assert lp.separable_head(model) is None
    batch = ragged_batch(64)
    out = lp.completion_logprobs(model, *batch, temperature=1.0)
    expected, _ = naive_logprobs(model, *batch, 1.0)
    assert torch.allclose(out.logprobs * batch[3], expected, atol=1e-5)


def test_length_buckets_minimise_padding_plus_overhead():
    # Two clear length clusters: with a small per-bucket overhead they are split, longest first.
    assert lp.length_buckets([100, 10, 98, 12, 11, 99], max_rows=None, overhead=5) == [[0, 5, 2], [3, 4, 1]]
    # A large overhead makes one bucket cheaper than two.
    assert lp.length_buckets([100, 10, 98, 12, 11, 99], max_rows=None, overhead=1000) == [[0, 5, 2, 3, 4, 1]]
    # max_rows caps every bucket.
    capped = lp.length_buckets([5] * 7, max_rows=3, overhead=1)
    assert len(capped) == 3 and max(len(b) for b in capped) == 3 and sorted(sum(capped, [])) == list(range(7))
