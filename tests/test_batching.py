"""Length-grouped micro-batches: hand-checked regrouping and when it is exact."""

import torch

from grouprl.rollout.train_batch import length_grouped, regrouping_is_exact


def test_rows_are_sorted_by_length_within_each_optimizer_step_only():
    lengths = torch.tensor([5, 50, 7, 40, 30, 6, 60, 8])
    parts = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7])]
    # GA = 2: steps are parts (0, 1) and (2, 3); rows never cross a step boundary.
    got = length_grouped(parts, lengths, grad_accum_steps=2)
    assert [p.tolist() for p in got] == [[1, 3], [2, 0], [6, 4], [7, 5]]
    # GA = 1: every part is its own step: nothing moves.
    assert [p.tolist() for p in length_grouped(parts, lengths, grad_accum_steps=1)] == [p.tolist() for p in parts]
    # A step spanning two generations (GA = 4, 2 parts per generation): the generation's parts regroup together.
    got = length_grouped(parts[:2], lengths, grad_accum_steps=4)
    assert [p.tolist() for p in got] == [[1, 3], [2, 0]]


def test_regrouping_is_exact_only_where_row_weights_ignore_the_micro_batch():
    assert regrouping_is_exact("dapo", 1.0, [3, 2])  # global token denominator: sizes may differ
    assert regrouping_is_exact("grpo", 1.0, [2, 2]) and not regrouping_is_exact("grpo", 1.0, [3, 2])
    assert not regrouping_is_exact("bnpo", 1.0, [2, 2])  # per-micro-batch token mean
    assert not regrouping_is_exact("dapo", 0.8, [2, 2])  # per-micro-batch entropy quantile


def test_long_shared_prompts_keep_their_rows_together():
    """Prompts longer than completions: the key orders by prompt (longest first), then completion length,
    so one prompt's rows are adjacent; short prompts: by total length."""
    from grouprl.core.types import TrainBatch
    from grouprl.rollout.train_batch import row_order_key

    def batch(prompts, completion_lengths):
        width, t = max(len(p) for p in prompts), max(completion_lengths)
        prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).bool()
        completion_mask = torch.arange(t).unsqueeze(0) < torch.tensor(completion_lengths).unsqueeze(1)
        n = len(prompts)
        return TrainBatch(
            prompt_ids, prompt_mask, completion_mask.long(), completion_mask, completion_mask, torch.zeros(n)
        )

    a, b, c = [5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6], [7, 7, 7]  # a and b: 6 tokens, c: 3 tokens
    long_prompts = batch([a, b, a, c, b, a], [3, 1, 2, 5, 4, 1])
    order = torch.sort(row_order_key(long_prompts), descending=True, stable=True).indices.tolist()
    # a's rows (completions 3, 2, 1), then b's (4, 1), then the shorter prompt c; a
    # before b is the tie-break by prompt id.
    assert order == [0, 2, 5, 4, 1, 3]
    short_prompts = batch([[1], [2], [1]], [4, 9, 6])
    assert torch.equal(row_order_key(short_prompts), torch.tensor([5, 10, 7]))
