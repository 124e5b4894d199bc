"""GFPO: each group's filter call sees its own completions, the top-k are kept, advantages use kept rows only."""

import datasets
import pytest
import torch
from helpers import ScriptedBackend
from transformers import AutoTokenizer

from grouprl import GFPOConfig, GFPOTrainer
from grouprl.core.filters import group_filter_scores, reward_per_token_filter, shortest_k_filter, top_k_in_groups

G, K = 4, 2


def test_top_k_in_groups_keeps_highest_scores_stably():
    scores = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 2.0, 0.0]])
    assert top_k_in_groups(scores, 2).view(2, 4).tolist() == [[False, True, False, True], [True, False, True, False]]
    assert top_k_in_groups(torch.zeros(1, 4), 2).tolist() == [True, True, False, False]  # ties: earlier first


def test_ready_filters():
    groups = [["aaaa", "a", "aa"]]
    assert shortest_k_filter(groups, [[0, 0, 0]]) == [[-4.0, -1.0, -2.0]]  # characters without ids
    assert shortest_k_filter(groups, [[0, 0, 0]], group_completion_ids=[[[1], [1, 2, 3], [1, 2]]]) == [
        [-1.0, -3.0, -2.0]
    ]
    assert reward_per_token_filter(groups, [[2.0, 1.0, 1.0]], group_completion_ids=[[[1] * 4, [1], [1, 1]]]) == [
        [0.5, 1.0, 0.5]
    ]
    conversational = [[[{"role": "assistant", "content": "abc"}], [{"role": "assistant", "content": "a"}]]]
    assert shortest_k_filter(conversational, [[0, 0]]) == [[-3.0, -1.0]]


def test_filter_output_is_checked():
    with pytest.raises(ValueError, match="'bad' returned 2 scores for group 0, which has 3"):

        def bad(group_completions, group_rewards):
            return [[1.0, 2.0]]

        group_filter_scores(bad, [["a", "b", "c"]], [[0.0] * 3], [[[1]] * 3])
    with pytest.raises(ValueError, match="one list of scores per group"):
        group_filter_scores(lambda group_completions, group_rewards: 1.0, [["a", "b"]], [[0.0] * 2], [[[1]] * 2])


def test_config_and_trainer_validation(tmp_path):
    with pytest.raises(ValueError, match="num_remains_in_group=4 must be at least 2 .* smaller than num_generations=4"):
        GFPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, num_remains_in_group=4)
    with pytest.raises(ValueError, match="num_remains_in_group=1 must be at least 2"):
        GFPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, num_remains_in_group=1)
    data = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    config = GFPOConfig(
        output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, num_remains_in_group=2
    )
    with pytest.raises(ValueError, match="needs a group_filter_func"):
        GFPOTrainer(
            "/nonexistent/model",
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=config,
            train_dataset=data,
        )
    odd = GFPOConfig(
        output_dir=str(tmp_path),
        num_generations=4,
        per_device_train_batch_size=6,
        steps_per_generation=2,
        num_remains_in_group=3,
    )
    with pytest.raises(ValueError, match="cannot be split into steps_per_generation=2"):
        GFPOTrainer(
            "/nonexistent/model",
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=odd,
            train_dataset=data,
            group_filter_func=shortest_k_filter,
        )


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def test_gfpo_keeps_k_shortest_of_each_own_group_and_normalises_over_them(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id

    def script(prompt_ids, sample):  # lengths differ within a group, in a different order for each prompt
        length = 1 + (sample * 5 + 3 * prompt_ids[0]) % 7
        return [(prompt_ids[0] * 11 + sample * 3 + j) % 50 + 20 for j in range(length)] + [eos]

    backend = ScriptedBackend(script, eos, tokenizer)
    seen_groups = []

    def spy_filter(group_completions, group_rewards, group_completion_ids):
        seen_groups.append((group_completions, group_rewards, group_completion_ids))
        return shortest_k_filter(group_completions, group_rewards, group_completion_ids)

    config = GFPOConfig(
        output_dir=str(tmp_path / "out"),
        num_generations=G,
        num_remains_in_group=K,
        per_device_train_batch_size=6,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        learning_rate=1e-3,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
        shuffle_dataset=False,
    )
    data = datasets.Dataset.from_dict({"prompt": [f"{i}{i}+{i}=" for i in range(9)]})
    trainer = GFPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=data,
        generation_backend=backend,
        group_filter_func=spy_filter,
    )
    captured, batches = [], []
    score, make_batch = trainer.run.rollouts.score, trainer.run.rollouts.make_train_batch

    def capture_score(rollout, *args):
        drawn = len(rollout.completions)
        kept, rewards, advantages = score(rollout, *args)
        assert len(rollout.completions) == drawn  # the sampled rollout is left whole; the kept rows are a new one
        captured.append((kept, rewards, advantages))
        return kept, rewards, advantages

    def capture_batch(rollout, advantages):
        batches.append(make_batch(rollout, advantages))
        return batches[-1]

    trainer.run.rollouts.score, trainer.run.rollouts.make_train_batch = capture_score, capture_batch
    trainer.train()

    assert len(seen_groups) == 2 and len(captured) == 2  # 2 generations of 3 groups each
    for (group_completions, group_rewards, group_ids), (rollout, rewards, advantages), call in zip(
        seen_groups, captured, backend.calls
    ):
        prompt_ids, _ = call
        assert len(group_ids) == 3
        for g, prompt in enumerate(prompt_ids):
            # the filter saw this group's own completions (TRL's last version shifted the window)
            assert group_ids[g] == [script(prompt, s) for s in range(G)]
            assert group_completions[g] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in group_ids[g]]
            assert group_rewards[g] == distinct_tokens(group_ids[g])
        # every kept completion is among the k shortest of its own group
        assert rollout.prompts.num_samples == [K] * 3 and len(rollout.completions) == 3 * K
        for completion in rollout.completions:
            lengths = sorted(len(ids) for ids in group_ids[completion.prompt_index])
            assert len(completion.token_ids) <= lengths[K - 1]
        # advantages: group-normalised over the kept rows only
        kept = rewards.per_function[:, 0].view(3, K)
        expected = (kept - kept.mean(dim=1, keepdim=True)) / (kept.std(dim=1, keepdim=True) + 1e-4)
        assert torch.allclose(advantages, expected.view(-1), atol=1e-5)
        assert rewards.per_function.shape == (3 * K, 1)
    assert all(len(b) == 3 * K for b in batches)  # dropped rows left the batch
    assert trainer.state.global_step == 2


def test_evaluation_samples_every_completion_without_filtering(tiny_model_dir, tmp_path):
    """Evaluation builds its own sampler (no row filter): all G completions of every eval prompt are scored."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id
    backend = ScriptedBackend(
        lambda prompt_ids, sample: [20 + sample + j for j in range(1 + sample)] + [eos], eos, tokenizer
    )
    calls = []

    def spy_filter(group_completions, group_rewards, group_completion_ids):
        calls.append(len(group_completions))
        return shortest_k_filter(group_completions, group_rewards, group_completion_ids)

    config = GFPOConfig(
        output_dir=str(tmp_path / "out"),
        num_generations=G,
        num_remains_in_group=K,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        max_completion_length=8,
        max_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
        report_to="none",
    )
    data = datasets.Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(4)]})
    trainer = GFPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=data,
        eval_dataset=data,
        generation_backend=backend,
        group_filter_func=spy_filter,
    )
    make_batch = trainer.run.rollouts.make_train_batch
    metrics = trainer.evaluate()
    assert calls == []  # the filter never ran in evaluation
    assert trainer.run.rollouts.row_filter is not None and trainer.run.rollouts.make_train_batch == make_batch
    # samples 0..3 have 2..5 distinct tokens (EOS included): all G scored give a mean reward of 3.5, the 2 shortest 2.5
    assert metrics["eval_reward"] == pytest.approx(3.5)
    assert sum(len(prompts) * n for prompts, n in backend.calls) == 4 * G


@pytest.mark.parametrize("feature", ["lora", "qlora", "sync_ref_model"])
def test_gfpo_keeps_the_shortest_rows_with_lora_quantization_or_a_synced_reference(tiny_model_dir, tmp_path, feature):
    """Every row trained on is one of the K shortest of its own group, each prompt's K rows once; LoRA and QLoRA move
    the adapters only; a synced reference ends as the mix of the policy into the starting weights."""
    import grouprl.train.stages

    peft = pytest.importorskip("peft")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id

    def script(prompt_ids, sample):
        length = 1 + (sample * 5 + 3 * prompt_ids[0]) % 7
        return [(prompt_ids[0] * 11 + sample * 3 + j) % 50 + 20 for j in range(length)] + [eos]

    trained = []
    backward = grouprl.train.stages.backward

    def record(run, loss, micro):
        for prompt, mask, row, real in zip(
            micro.prompt_ids, micro.prompt_mask, micro.completion_ids, micro.completion_mask
        ):
            trained.append((prompt[mask].tolist(), row[real].tolist()))
        return backward(run, loss, micro)

    options = {
        "sync_ref_model": dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.25)
    }
    config = GFPOConfig(
        output_dir=str(tmp_path / "out"),
        num_generations=G,
        num_remains_in_group=K,
        per_device_train_batch_size=6,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        learning_rate=0.05,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        shuffle_dataset=False,
        model_init_kwargs={"quantization_config": {"load_in_4bit": True}} if feature == "qlora" else None,
        **options.get(feature, {}),
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if "lora" in feature else None
    trainer = GFPOTrainer(
        tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": [f"{i}{i}+{i}=" for i in range(9)]}),
        generation_backend=ScriptedBackend(script, eos, tokenizer),
        group_filter_func=shortest_k_filter,
        peft_config=lora,
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    reference_before = {name: p.detach().clone() for name, p in (trainer.ref_model or trainer.model).named_parameters()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grouprl.train.stages, "backward", record)
        trainer.train()
    prompts = {tuple(prompt) for prompt, _ in trained}
    assert len(trained) == 3 * K and len(prompts) == 3  # 3 groups of G, K rows of each
    for prompt in prompts:
        rows = sorted(len(ids) for p, ids in trained if tuple(p) == prompt)
        group = sorted(len(script(list(prompt), s)) for s in range(G))
        assert rows == group[:K], (rows, group)
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(("lora_" in name) == (feature != "sync_ref_model") for name in changed)
    if feature == "sync_ref_model":
        policy = dict(trainer.model.named_parameters())
        for name, param in trainer.ref_model.named_parameters():
            expected = 0.25 * policy[name] + 0.75 * reference_before[name]
            assert torch.allclose(param, expected, atol=1e-6), name
