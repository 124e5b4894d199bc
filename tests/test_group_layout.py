"""GroupLayout: which rows of which group each process holds, with placements computed by hand.

The running example: 3 prompts x G=4 = 12 rows over 2 processes, 6 rows each. Global rows 0-3 are
group 0, 4-7 group 1, 8-11 group 2; process 0 holds rows 0-5 (group 0 whole, the head of group 1),
process 1 rows 6-11 (the tail of group 1, group 2 whole).
"""

import pytest
import torch

from grouprl.core.distributed import join_rollouts, keep_own_rows, keep_rows, own_rollout, whole_groups
from grouprl.core.types import Completion, GroupLayout, PromptBatch, Rollout, SamplingParams
from grouprl.generation.protocol import sample_for_processes, sample_groups


def layouts(**kwargs):
    return [GroupLayout.for_generation(7, 3, 4, num_processes=2, process_index=p, **kwargs) for p in range(2)]


def share(layout: GroupLayout) -> Rollout:
    """The rollout a process samples under `layout`: completion text "g<group id>s<sample index in its group>"."""
    pieces = layout.pieces()
    starts = layout.group_starts()
    prompts = PromptBatch(
        [f"p{layout.group_ids[g]}" for g, _ in pieces],
        [[layout.group_ids[g]] for g, _ in pieces],
        {"answer": [layout.group_ids[g] * 10 for g, _ in pieces]},
        [g for g, _ in pieces],
        [layout.group_ids[g] for g, _ in pieces],
        [n for _, n in pieces],
        layout=layout,
    )
    groups = layout.row_groups()
    local = {g: i for i, (g, _) in enumerate(pieces)}
    completions = [
        Completion(local[groups[r]], [r], f"g{layout.group_ids[groups[r]]}s{r - starts[groups[r]]}", "stop")
        for r in layout.rows(layout.process_index)
    ]
    return Rollout(prompts, completions)


def texts(rollout: Rollout) -> list[str]:
    return [c.text for c in rollout.completions]


def test_sampler_layout_places_rows_by_hand():
    first, second = layouts()
    assert first.group_ids == (21, 22, 23)  # generation 7 of 3 prompts: ids continue from earlier generations
    assert first.bounds == (0, 6, 12) and first.local_rows == slice(0, 6) and second.local_rows == slice(6, 12)
    assert first.pieces() == [(0, 4), (1, 2)]  # group 0 whole, 2 rows of group 1
    assert second.pieces() == [(1, 2), (2, 4)]  # the other 2 rows of group 1, group 2 whole
    assert first.row_groups() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert first.deal(list(range(12))) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert first.join([["a", "b1"], ["b2", "c"]]) == ["a", "b1", "c"]  # the group's head gives its value
    # 3 processes: 4 rows each, every group on one process
    three = GroupLayout.for_generation(0, 3, 4, num_processes=3, process_index=1)
    assert three.pieces() == [(1, 4)] and three.local_rows == slice(4, 8)


def test_gather_joins_cut_groups_and_gives_each_process_its_rows_back():
    parts = [share(layout) for layout in layouts()]
    assert texts(parts[0]) == ["g21s0", "g21s1", "g21s2", "g21s3", "g22s0", "g22s1"]
    whole = join_rollouts(layouts()[0], parts)
    assert whole.prompts.prompts == ["p21", "p22", "p23"] and whole.prompts.num_samples == [4, 4, 4]
    assert whole.prompts.columns == {"answer": [210, 220, 230]}
    assert (
        whole.row_prompt == [0] * 4 + [1] * 4 + [2] * 4
        and [c.prompt_index for c in whole.completions] == whole.row_prompt
    )
    assert texts(whole) == [f"g{21 + g}s{s}" for g in range(3) for s in range(4)]
    for layout, part in zip(layouts(), parts):  # own_rollout undoes the join
        mine = own_rollout(layout, whole)
        assert texts(mine) == texts(part) and mine.prompts.num_samples == part.prompts.num_samples
        assert mine.prompts.prompts == part.prompts.prompts and mine.prompts.layout == layout
        assert [c.prompt_index for c in mine.completions] == mine.row_prompt
    with pytest.raises(ValueError, match="process 1's rollout holds"):
        join_rollouts(layouts()[0], [parts[0], parts[0]])


def test_selecting_groups_0_and_2_deals_their_rows_again():
    first, second = (layout.select_groups([0, 2]) for layout in layouts())
    assert first.group_ids == (21, 23) and first.group_sizes == (4, 4) and first.bounds == (0, 4, 8)
    assert first.pieces() == [(0, 4)] and second.pieces() == [(1, 4)]  # each process now holds one whole group
    whole = join_rollouts(layouts()[0], [share(layout) for layout in layouts()]).select_prompts([0, 2])
    assert texts(own_rollout(first, whole)) == ["g21s0", "g21s1", "g21s2", "g21s3"]
    assert texts(own_rollout(second, whole)) == ["g23s0", "g23s1", "g23s2", "g23s3"]
    # selecting groups 0 and 1 re-cuts: 8 rows, 4 each, group 1 no longer cut
    assert layouts()[1].select_groups([0, 1]).pieces() == [(1, 4)]


def test_selecting_rows_keeps_them_in_place_only_when_the_shares_stay_even():
    first = layouts()[0]
    # 2 rows of each group: process 0 keeps rows 0, 2 (group 0) and 4 (group 1), process 1 rows 7 (group 1), 8, 9
    keep = torch.zeros(12, dtype=torch.bool)
    keep[[0, 2, 4, 7, 8, 9]] = True
    after = first.select_rows(keep)
    assert after.group_sizes == (2, 2, 2) and after.bounds == (0, 3, 6) and after.pieces() == [(0, 2), (1, 1)]
    assert first.keeps_rows_in_place(keep)
    kept = [keep_own_rows(layout, share(layout), keep) for layout in layouts()]
    assert texts(kept[0]) == ["g21s0", "g21s2", "g22s0"] and texts(kept[1]) == ["g22s3", "g23s0", "g23s1"]
    assert kept[0].prompts.num_samples == [2, 1] and kept[1].prompts.num_samples == [1, 2]
    # process 0 keeping 4 rows and process 1 two: 3 each afterwards, so row 4 (group 1) moves to process 1
    uneven = torch.zeros(12, dtype=torch.bool)
    uneven[[0, 1, 2, 4, 8, 9]] = True
    assert not first.keeps_rows_in_place(uneven)
    moved = first.select_rows(uneven)
    assert moved.group_sizes == (3, 1, 2) and moved.pieces() == [(0, 3)]
    assert GroupLayout.dealt(moved.group_ids, moved.group_sizes, 2, 1).pieces() == [(1, 1), (2, 2)]


def test_one_process_keep_rows_returns_a_new_rollout_and_leaves_the_old_one():
    layout = GroupLayout.for_generation(0, 2, 3, num_processes=1)
    rollout = share(layout)
    keep = torch.tensor([True, False, True, False, True, True])
    kept = keep_rows(rollout, layout, keep)
    assert texts(kept) == ["g0s0", "g0s2", "g1s1", "g1s2"] and kept.prompts.num_samples == [2, 2]
    assert len(rollout.completions) == 6 and rollout.prompts.num_samples == [3, 3]  # not shrunk in place
    assert kept.prompts.layout.group_sizes == (2, 2) and kept.prompts.layout.uniform_group_size() == 2
    assert whole_groups(rollout, layout) is rollout  # one process: nothing to gather


def test_layout_refuses_inconsistent_shapes():
    with pytest.raises(ValueError, match="bounds"):
        GroupLayout((0,), (4,), (0, 3))
    with pytest.raises(ValueError, match="at least one row"):
        GroupLayout.dealt([0, 1], [4, 0], 2)
    with pytest.raises(ValueError, match="different sizes"):
        GroupLayout.dealt([0, 1], [4, 2], 2).uniform_group_size()
    with pytest.raises(ValueError, match="5 rows for a layout of 12"):
        layouts()[0].deal([0] * 5)
    uncut = GroupLayout.uncut([[4, 2], [3]], process_index=1)
    assert uncut.bounds == (0, 6, 9) and uncut.pieces() == [(2, 3)] and uncut.pieces(0) == [(0, 4), (1, 2)]


class CountingBackend:
    """Completion i of prompt p has token ids [p[0], i]; records its calls."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, num_samples, params):
        self.calls.append((len(prompt_ids), num_samples))
        return [Completion(b, [ids[0], i], "", "stop") for b, ids in enumerate(prompt_ids) for i in range(num_samples)]


class LockstepBackend(CountingBackend):
    """Completion i of the row r (a prompt of its own) has token ids [row's prompt id, r]."""

    lockstep = True

    def generate(self, prompt_ids, num_samples, params):
        assert num_samples == 1
        self.calls.append((len(prompt_ids), num_samples))
        return [Completion(r, [ids[0], r], "", "stop") for r, ids in enumerate(prompt_ids)]


def test_a_lockstep_backend_gets_one_call_with_every_row_even_with_none():
    """A backend sampling from sharded weights (every process in step) is called once per generation on every process:
    mixed sample counts (a cut group) and no prompts at all each make exactly one call, every row a prompt of its own,
    and each completion goes back to its prompt."""
    backend, params = LockstepBackend(), SamplingParams(max_new_tokens=4)
    per_prompt = sample_groups(backend, [[1], [2], [3]], [4, 2, 4], params)
    assert backend.calls == [(10, 1)]
    assert [[c.token_ids for c in group] for group in per_prompt] == [
        [[1, r] for r in range(4)],
        [[2, 4], [2, 5]],
        [[3, r] for r in range(6, 10)],
    ]
    assert sample_groups(backend, [], [], params) == [] and backend.calls == [(10, 1), (0, 1)]


def test_dispatch_samples_whole_groups_once_and_cuts_them_by_the_layout():
    backend, params = CountingBackend(), SamplingParams(max_new_tokens=4)
    shares = sample_for_processes(backend, layouts()[0], [[21], [22], [23]], params)
    assert backend.calls == [(3, 4)]  # one request: every group whole
    assert [[c.token_ids for c in s] for s in shares] == [
        [[21, 0], [21, 1], [21, 2], [21, 3], [22, 0], [22, 1]],
        [[22, 2], [22, 3], [23, 0], [23, 1], [23, 2], [23, 3]],
    ]
    backend = CountingBackend()
    per_prompt = sample_groups(
        backend, [[1], [2], [3]], [4, 2, 4], params
    )  # a share with a cut group: one call per count
    assert sorted(backend.calls) == [(1, 2), (2, 4)]
    assert [[c.token_ids for c in group] for group in per_prompt] == [
        [[1, i] for i in range(4)],
        [[2, 0], [2, 1]],
        [[3, i] for i in range(4)],
    ]
