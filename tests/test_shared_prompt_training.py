"""Prompt-grouped packing (algorithms/prompt_packing.py) reproduces the plain per-row pass."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.model import packed_attention, prompt_packing
from grouprl.model.logprobs import completion_logprobs, length_buckets
from grouprl.model.patches import grouprl_patches
from grouprl.model.prompt_packing import (
    PromptGroups,
    build_pack,
    group_by_prompt,
    pack_cost,
    pairs_per_token,
    split_for_cost,
)

PAD = 0


def _rows(vocab: int):
    """Ragged left-padded prompts (A shared by 4 rows, B by 2, C alone), ragged right-padded completions (one empty)."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(1, vocab, (k,), generator=g).tolist() for k in (7, 4, 9))
    prompts = [a, b, a, c, b, a, a]
    completions = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in (5, 3, 6, 1, 6, 2, 0)]
    width, length = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.bool)
    completion_ids = torch.tensor([c + [PAD] * (length - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in completions], dtype=torch.bool)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.fixture(autouse=True)
def cheap_attention(monkeypatch):
    """Tiny models are all attention by the cost estimate; pretend it is free so every shared prompt packs."""
    monkeypatch.setattr(prompt_packing, "pairs_per_token", lambda model: 1e9)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # random weights large enough that attention patterns matter
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def _plain_logprobs(model, *rows):
    return completion_logprobs(model, *rows, temperature=1.0, pack_prompts=False).logprobs


def _run(model, rows, pack: bool, **kwargs):
    """Forward and backward inside grouprl_patches, as in training (checkpointing
    recomputes through packed_attention)."""
    model.zero_grad()
    with grouprl_patches():
        out = completion_logprobs(model, *rows, temperature=0.7, pack_prompts=pack, **kwargs)
        mask = rows[3]
        loss = (out.logprobs * mask).sum() + ((out.entropy * mask).sum() if kwargs.get("entropy_grad") else 0.0)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
@pytest.mark.parametrize("rows_per_chunk", [None, 2])
def test_values_and_gradients_match_the_plain_pass(model, checkpointing, rows_per_chunk, monkeypatch):
    """Also: packed_attention (visible pairs only) serves every packed layer call,
    and checkpointing recomputes through it."""
    rows = _rows(model.config.vocab_size)
    # The one-time probe (prompt_packing._probe: a packed pass without gradient, so never recomputed) runs at this
    # model's first packed pass, in whichever case a process runs first (pytest-xdist deals the cases out in any
    # order). Settled here, before the counting, so the counts below are those of the passes under test alone.
    assert prompt_packing.packing_head(model, _plain_logprobs) is not None, "the probe refused the tiny model"
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    model.train()
    attention_calls = []
    real_attention = packed_attention.packed_attention
    monkeypatch.setattr(
        packed_attention, "packed_attention", lambda *a, **k: attention_calls.append(1) or real_attention(*a, **k)
    )
    try:
        calls = []
        real = prompt_packing._packed_pass
        prompt_packing._packed_pass = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            packed, packed_grads = _run(model, rows, True, entropy_grad=True, rows_per_chunk=rows_per_chunk)
        finally:
            prompt_packing._packed_pass = real
        plain, plain_grads = _run(model, rows, False, entropy_grad=True, rows_per_chunk=rows_per_chunk)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert calls, "the packed path was not taken"
    assert len(attention_calls) == len(calls) * model.config.num_hidden_layers * (2 if checkpointing else 1)
    mask = rows[3]
    torch.testing.assert_close(packed.logprobs[mask], plain.logprobs[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.entropy[mask], plain.entropy[mask], rtol=1e-5, atol=1e-5)
    assert (packed.logprobs[~mask] == 0).all()
    assert packed_grads.keys() == plain_grads.keys() and len(plain_grads) > 5
    for name, grad in plain_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_sparse_pass_holds_no_dense_mask_and_refuses_a_backward_outside_the_patches(model, monkeypatch):
    """Packs that packed_attention serves carry a broadcast placeholder for the (L, L) mask (one byte, where a
    6,288-token row's mask was 40 MB held until backward); their recomputed layers attend correctly only inside
    grouprl_patches, so a backward outside it stops with the reason instead of recomputing through the placeholder."""
    rows = _rows(model.config.vocab_size)
    assert prompt_packing.packing_head(model, _plain_logprobs) is not None
    masks = []
    real = prompt_packing.build_pack
    monkeypatch.setattr(prompt_packing, "build_pack", lambda *a, **k: masks.append(real(*a, **k)) or masks[-1])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        with grouprl_patches():
            out = completion_logprobs(model, *rows, temperature=1.0, pack_prompts=True)
        assert masks and all(m.attention_mask.untyped_storage().nbytes() == 1 for m in masks)
        with pytest.raises(RuntimeError, match="outside grouprl_patches.*pack_shared_prompts=False"):
            (out.logprobs * rows[3]).sum().backward()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        model.zero_grad()


def test_bf16_autocast_matches_within_bf16_rounding(model):
    rows = _rows(model.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        packed = completion_logprobs(model, *rows, temperature=1.0, pack_prompts=True).logprobs
        plain = completion_logprobs(model, *rows, temperature=1.0, pack_prompts=False).logprobs
    mask = rows[3]
    torch.testing.assert_close(packed[mask], plain[mask], rtol=0, atol=5e-2)


def test_a_packed_bf16_pass_sums_the_tied_weights_gradients_in_one_node(model, monkeypatch):
    """The packed pass under bf16 autocast looks the tokens up through the tied node (forward.head_weight_and_inputs:
    the demo model ties its embeddings), with the gradients autograd gives when the model looks them up itself."""
    from grouprl.model import forward

    rows = _rows(model.config.vocab_size)
    nodes = []
    tied_node = forward._Lookups.apply
    monkeypatch.setattr(forward._Lookups, "apply", lambda *a: nodes.append(1) or tied_node(*a))

    def grads(tied: bool) -> dict[str, torch.Tensor]:
        if not tied:
            monkeypatch.setattr(
                prompt_packing,
                "head_weight_and_inputs",
                lambda m, head, forwards, plain: (forward.product_weight(head), forwards),
            )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _run(model.train(), rows, True)[1]

    try:
        fused, apart = grads(tied=True), grads(tied=False)
    finally:
        model.eval()
    assert nodes == [1]
    assert fused.keys() == apart.keys() and all(torch.equal(fused[name], apart[name]) for name in fused)


def test_bf16_weights_pass_the_probe_and_pack(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    rows = _rows(model.config.vocab_size)
    with torch.no_grad():
        packed = prompt_packing.shared_prompt_logprobs(
            model,
            *rows,
            1.0,
            rows_per_chunk=None,
            entropy="none",
            plain=lambda m, *r: completion_logprobs(m, *r, temperature=1.0, pack_prompts=False).logprobs,
        )
        plain = completion_logprobs(model, *rows, temperature=1.0, pack_prompts=False).logprobs
    assert packed is not None
    torch.testing.assert_close(packed[0][rows[3]], plain[rows[3]], rtol=0, atol=5e-2)


def test_no_shared_prompt_and_eager_attention_fall_back_or_match(tiny_model_dir):
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    rows = _rows(eager.config.vocab_size)
    with torch.no_grad():
        packed = completion_logprobs(eager, *rows, temperature=1.0, pack_prompts=True).logprobs
        plain = completion_logprobs(eager, *rows, temperature=1.0, pack_prompts=False).logprobs
        unique = [r[[0, 1, 3]] for r in rows]  # three distinct prompts: nothing to share
        assert (
            prompt_packing.shared_prompt_logprobs(eager, *unique, 1.0, rows_per_chunk=None, entropy="none", plain=None)
            is None
        )
    torch.testing.assert_close(packed[rows[3]], plain[rows[3]], rtol=1e-5, atol=1e-5)


def test_a_model_failing_the_probe_keeps_the_plain_pass(model, monkeypatch):
    monkeypatch.setattr(prompt_packing, "_PROBED", type(prompt_packing._PROBED)())
    monkeypatch.setattr(prompt_packing, "_probe", lambda *a: "the probe disagrees (test)")
    rows = _rows(model.config.vocab_size)
    assert (
        prompt_packing.shared_prompt_logprobs(model, *rows, 1.0, rows_per_chunk=None, entropy="none", plain=None)
        is None
    )


def test_grouping_and_buckets():
    ids = torch.tensor([[0, 5, 6], [5, 5, 6], [0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    # padding is not part of the prompt; [5, 5, 6] differs from [5, 6]
    assert group_by_prompt(ids, mask, None) == ([[0, 2], [1], [3]], [2, 3, 3])
    assert group_by_prompt(ids, mask, 1).rows == [[0], [2], [1], [3]]
    # no bucket holds more than 3 rows; the long pack goes alone, the short ones together
    assert length_buckets([100, 10, 12], 3, rows=[3, 1, 2]) == [[0], [2, 1]]


def test_pack_layout_by_hand():
    pack = build_pack([[11, 12]], [[[21, 22, 23], [31]]], 3, torch.device("cpu"))
    assert pack.input_ids.tolist() == [[11, 12, 21, 22, 23, 31]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 4, 2]]
    # token 0 of each completion is predicted at the prompt's end (1); the rest by the previous token
    assert pack.source.tolist() == [[1, 2, 3], [1, 1, 1]]
    visible = pack.attention_mask[0, 0].int().tolist()
    assert visible[5] == [1, 1, 0, 0, 0, 1]  # the second completion sees the prompt and itself, not the first
    assert visible[4] == [1, 1, 1, 1, 1, 0]
    assert pack.keep == 5


@pytest.mark.parametrize("dense", [False, True])
def test_split_for_cost_packs_long_prompts(dense):
    # W2-like: a 400-token prompt with 4 x 128 completions is cheapest as one pack, with either attention
    assert split_for_cost(PromptGroups([[0, 1, 2, 3]], [400]), [128] * 4, 3072.0, dense).rows == [[0, 1, 2, 3]]


def test_pack_cost_counts_the_pairs_each_attention_scores():
    # dense 4D mask: all (13 + 2 * 128)^2 pairs; packed_attention: 13^2 for the prompt, 2 x 128 x (13 + 128)
    assert pack_cost(13, [128, 128], 100.0, dense=True) == pytest.approx(269 + 269**2 / 100)
    assert pack_cost(13, [128, 128], 100.0) == pytest.approx(269 + (13**2 + 2 * 128 * 141) / 100)
    assert pack_cost(13, [128, 5], 100.0) == pack_cost(13, [128, 128], 100.0) - 123  # completions padded to the longest


def test_short_prompts_split_under_dense_attention_and_do_not_pack():
    # W1-like short prompt, dense mask: one pack's attention costs more than the 3 prompt copies it saves;
    # two packs of two gain under 1%, far from the MIN_SAVING that packing needs
    short = split_for_cost(PromptGroups([[0, 1, 2, 3]], [13]), [128] * 4, 3072.0, dense=True)
    assert short.rows == [[0, 1], [2, 3]]
    plain = 4 * pack_cost(13, [128], 3072.0, dense=True)
    assert 0.99 * plain < sum(pack_cost(13, [128, 128], 3072.0, dense=True) for _ in short.rows) < plain
    # packed attention: one pack is cheapest, but saves only ~7% (the prompt is 13 of 141 tokens): under MIN_SAVING
    one = split_for_cost(PromptGroups([[0, 1, 2, 3]], [13]), [128] * 4, 3072.0)
    assert one.rows == [[0, 1, 2, 3]]
    assert prompt_packing.MIN_SAVING * plain < pack_cost(13, [128] * 4, 3072.0) < plain
    # costly attention (tiny ratio), dense: the short prompt stays per row
    assert split_for_cost(PromptGroups([[0, 1, 2, 3]], [13]), [128] * 4, 10.0, dense=True).rows == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "hidden, layers, heads, kv_heads, intermediate, prompt, new, share, on_cpu, on_gpu",
    [
        # the GPU benchmark's cases (bench/gpu/bench_generation.py PLAN): 8 prompts x 8 completions
        (896, 24, 14, 2, 4864, 48, 256, 0.86, True, False),  # 0.5B, 48-token prompts: packed, 1.44 s on the H200
        (896, 24, 14, 2, 4864, 1072, 256, 0.29, True, True),  # 0.5B, 1024-token shared prompt + 48
        (1536, 28, 12, 2, 8960, 48, 1024, 0.96, False, False),  # 1.5B: plain, 26.6% of the H200's peak
    ],
)
def test_gpus_pack_only_for_a_large_saving(
    hidden, layers, heads, kv_heads, intermediate, prompt, new, share, on_cpu, on_gpu
):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        ratio = pairs_per_token(Qwen2ForCausalLM(config))
    plain = 64 * pack_cost(prompt, [new], ratio, dense=True)
    groups = split_for_cost(PromptGroups([list(range(8))], [prompt]), [new] * 8, ratio)
    assert groups.rows == [list(range(8))]  # one pack per prompt is the cheapest split
    packed = 8 * pack_cost(prompt, [new] * 8, ratio)
    assert packed / plain == pytest.approx(share, abs=0.005)
    assert prompt_packing.worth_packing(packed, plain, torch.device("cpu")) is on_cpu
    assert prompt_packing.worth_packing(packed, plain, torch.device("cuda")) is on_gpu


def test_shared_prompt_pass_asks_about_the_batch_device(monkeypatch, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    asked = []
    monkeypatch.setattr(prompt_packing, "worth_packing", lambda packed, plain, device: asked.append(device) or False)
    with grouprl_patches():
        out = completion_logprobs(model, *_rows(model.config.vocab_size), temperature=1.0)
    assert asked == [torch.device("cpu")]  # and refused: the plain pass ran
    assert out.logprobs.shape == (7, 6)


def test_pairs_per_token_from_the_flop_count(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    width, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    weights = 2 * c.hidden_size * width + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    # the module's own function (the fixture patches only the module attribute); biases and norms add a little
    assert pairs_per_token(model) == pytest.approx(weights / (2 * width), rel=0.05)


def test_training_step_is_the_same_with_and_without_packing(tiny_model_dir, tmp_path, monkeypatch):
    """Real GRPO steps (gradient checkpointing on, KL to the reference, old
    logprobs): same loss, KL and gradient norm."""
    import datasets

    from grouprl import GRPOConfig, GRPOTrainer

    calls = []  # the packed forwards that train (the probe's and the old logprobs' run without gradient)
    real = prompt_packing._packed_pass
    monkeypatch.setattr(
        prompt_packing, "_packed_pass", lambda *a, **k: calls.append(torch.is_grad_enabled()) or real(*a, **k)
    )
    data = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(4)]})

    def run(pack: bool, name: str) -> list[dict]:
        args = GRPOConfig(
            pack_shared_prompts=pack,
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=6,
            num_generations=3,
            max_completion_length=8,
            learning_rate=1e-3,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            beta=0.04,
            num_iterations=2,
            bf16=False,
        )
        trainer = GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=lambda completion_ids, **kw: [float(len(set(c))) for c in completion_ids],
            args=args,
            train_dataset=data,
        )
        trainer.train()
        return trainer.state.log_history

    packed = run(True, "packed")
    assert any(calls), "the packed path was not taken"
    plain = run(False, "plain")
    assert plain[0]["grad_norm"] > 1e-3 and plain[1]["kl"] > 1e-8  # step 2 reuses step 1's batch: old logprobs, KL
    for step in (0, 1):
        for key in ("loss", "grad_norm", "kl", "entropy"):
            assert packed[step][key] == pytest.approx(plain[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_explicit_attention_products_only_where_layers_are_recomputed(tiny_model_dir):
    """The explicit products keep (queries x keys) probabilities for backward: only where each layer is recomputed
    (gradient checkpointing in training) or nothing is kept (no gradient)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    assert not prompt_packing._scores_short_lived(model)  # every layer's probabilities would stay until backward
    with torch.no_grad():
        assert prompt_packing._scores_short_lived(model)
    from grouprl.model.loading import enable_checkpointing

    enable_checkpointing(model, {"use_reentrant": False})
    assert prompt_packing._scores_short_lived(model)
    model.eval()  # transformers checkpoints in training mode only
    assert not prompt_packing._scores_short_lived(model)


def test_concatenated_rows_respect_the_token_cap_and_the_row_cap():
    # packs of 60, 30, 50 and 120 tokens: 60 + 30 fit, 50 starts a row, the oversized one gets its own
    assert prompt_packing.concatenated_rows([60, 30, 50, 120], [2, 2, 2, 4], None, 100) == [[0, 1], [2], [3]]
    assert prompt_packing.concatenated_rows([10, 10, 10], [2, 2, 2], 4, 100) == [[0, 1], [2]]  # at most 4 completions


def test_rows_of_packs_are_longer_on_an_accelerator():
    """On a GPU a row is a forward of its own: the H200's 25,000 packed tokens ran faster in one row than in four."""
    assert prompt_packing.row_token_cap(torch.device("cpu")) == prompt_packing.CONCATENATED_ROW_TOKENS == 8192
    assert prompt_packing.row_token_cap(torch.device("meta")) == prompt_packing.CONCATENATED_ROW_TOKENS_ACCELERATOR
    on_gpu = prompt_packing.row_token_cap(torch.device("cuda"))
    assert prompt_packing.concatenated_rows([6300] * 4, [16] * 4, None, on_gpu) == [[0, 1, 2, 3]]


def test_explicit_attention_products_see_checkpointing_through_a_peft_wrapper(tiny_model_dir):
    peft = pytest.importorskip("peft")
    from grouprl.model.loading import enable_checkpointing

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    enable_checkpointing(model, {"use_reentrant": False})
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])).train()
    assert prompt_packing._scores_short_lived(wrapped)
