"""Dataset formats, prompt tokenization, the seeded resumable sampler and per-process slices."""

import datasets
import pytest

from grouprl.core.group_layout import GroupLayout
from grouprl.data.prompt_sampler import PromptSampler
from grouprl.data.prompts import PromptTokenizer, check_dataset, local_prompt_batch
from grouprl.demo.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_empty_and_missing_prompt_and_wrong_type():
    with pytest.raises(ValueError, match="empty"):
        check_dataset(datasets.Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="no 'prompt' column.*question"):
        check_dataset(datasets.Dataset.from_dict({"question": ["1+1="]}))
    with pytest.raises(TypeError, match="datasets.Dataset"):
        check_dataset([{"prompt": "x"}])


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([{"content": "hi"}], "message 0 .* 'role' and 'content'"),
        ([], "non-empty list of messages"),
        (5, "must be a string or a non-empty list"),
        ([{"role": 1, "content": "x"}], "roles are strings"),
    ],
)
def test_malformed_prompts_name_the_row(tokenizer, prompt, match):
    tokenize = PromptTokenizer(tokenizer, max_context=None, max_completion_length=8)
    with pytest.raises(ValueError, match="Row 7: .*" + match):
        tokenize(prompt, 7)


def test_standard_prompt_is_tokenized_as_is(tokenizer):
    tokenize = PromptTokenizer(tokenizer, max_context=None, max_completion_length=8)
    ids = tokenize("12 + 7 =", 0)
    assert tokenizer.decode(ids) == "12 + 7 ="


def test_conversational_prompt_uses_chat_template_once(tokenizer):
    tokenize = PromptTokenizer(tokenizer, max_context=None, max_completion_length=8)
    messages = [{"role": "user", "content": "12+7="}]
    ids = tokenize(messages, 0)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")


def test_prompt_longer_than_context_is_rejected_with_row(tokenizer):
    tokenize = PromptTokenizer(tokenizer, max_context=16, max_completion_length=8)
    with pytest.raises(
        ValueError, match=r"Row 3: the prompt has \d+ tokens.*context is 16.*max_completion_length to at most"
    ):
        tokenize("1+1=" * 10, 3)


def test_sampler_is_seeded_covers_epoch_and_resumes():
    data = datasets.Dataset.from_dict({"prompt": [str(i) for i in range(10)]})
    sampler = PromptSampler(data, 3, shuffle=True, seed=0)
    epoch0 = [sampler.next_generation()[0] for _ in range(3)]  # 3 generations of 3; 1 prompt dropped
    assert len(set(sum(epoch0, []))) == 9
    state = sampler.state_dict()
    following = [sampler.next_generation()[0] for _ in range(2)]
    again = PromptSampler(data, 3, shuffle=True, seed=0)
    assert [again.next_generation()[0] for _ in range(3)] == epoch0
    again.load_state_dict(state)
    assert [again.next_generation()[0] for _ in range(2)] == following
    assert following[0] != epoch0[0] or following[1] != epoch0[1]  # a new permutation in epoch 1


def test_sampler_without_shuffle_is_in_order():
    data = datasets.Dataset.from_dict({"prompt": [str(i) for i in range(4)]})
    sampler = PromptSampler(data, 2, shuffle=False, seed=0)
    assert [sampler.next_generation()[0] for _ in range(3)] == [[0, 1], [2, 3], [0, 1]]


def test_iterable_sampler_resumes_by_position():
    data = datasets.Dataset.from_dict({"prompt": [str(i) for i in range(7)]}).to_iterable_dataset()
    sampler = PromptSampler(data, 2, shuffle=False, seed=0)
    first = [sampler.next_generation()[1] for _ in range(2)]
    state = sampler.state_dict()
    rest = [sampler.next_generation()[1] for _ in range(2)]
    assert [r["prompt"] for g in first for r in g] == ["0", "1", "2", "3"]
    assert [r["prompt"] for r in rest[0]] == ["4", "5"] and [r["prompt"] for r in rest[1]] == [
        "0",
        "1",
    ]  # row 6 dropped
    resumed = PromptSampler(data, 2, shuffle=False, seed=0)
    resumed.load_state_dict(state)
    assert resumed.next_generation()[1] == rest[0]


def test_process_slices_split_groups(tokenizer):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, {"prompt": "c", "answer": "3"}]
    tokenize = PromptTokenizer(tokenizer, max_context=None, max_completion_length=4)
    slices = [
        local_prompt_batch(
            [0, 1, 2],
            rows,
            GroupLayout.for_generation(5, 3, 4, num_processes=2, process_index=p),
            tokenize=tokenize,
            remove_unused_columns=False,
        )
        for p in range(2)
    ]
    # 12 completions, 6 per process: process 0 gets a x4 + b x2, process 1 gets b x2 + c x4
    assert slices[0].prompts == ["a", "b"] and slices[0].num_samples == [4, 2]
    assert slices[1].prompts == ["b", "c"] and slices[1].num_samples == [2, 4]
    assert slices[0].group_ids[1] == slices[1].group_ids[0] == 16  # the straddling group keeps one id
    assert slices[1].columns == {"answer": ["2", "3"]}
    removed = local_prompt_batch(
        [0],
        rows[:1],
        GroupLayout.for_generation(0, 1, 2, num_processes=1),
        tokenize=tokenize,
        remove_unused_columns=True,
    )
    assert removed.columns == {}


def test_rows_without_prompt_only_where_environments_supply_it(tokenizer):
    routing = datasets.Dataset.from_dict({"environment": ["a", "b"]})
    with pytest.raises(ValueError, match="no 'prompt' column"):
        check_dataset(routing)
    check_dataset(routing, prompt_required=False)
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_factory` is provided"):
        check_dataset(None)
    tokenize = PromptTokenizer(tokenizer, max_context=None, max_completion_length=4)
    rows = list(routing)
    with pytest.raises(ValueError, match="Row 1 has no 'prompt'.*environment_factory"):
        local_prompt_batch(
            [1],
            rows[1:],
            GroupLayout.for_generation(0, 1, 2, num_processes=1),
            tokenize=tokenize,
            remove_unused_columns=False,
        )
    placeholder = [{"role": "user", "content": ""}]
    batch = local_prompt_batch(
        [0, 1],
        rows,
        GroupLayout.for_generation(0, 2, 2, num_processes=1),
        tokenize=tokenize,
        remove_unused_columns=False,
        default_prompt=placeholder,
    )
    assert (
        batch.prompts == [placeholder, placeholder] and batch.prompts[0] is not placeholder and not batch.prompts_given
    )
    assert batch.columns == {"environment": ["a", "b"]}
    assert batch.prompt_ids[0] == tokenize(placeholder, 0)


class RowsWithReaderPid:
    """A map-style dataset whose rows say which process read them."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import os

        return {"prompt": str(i), "pid": os.getpid()}


def draws(sampler, count):
    return [sampler.next_generation() for _ in range(count)]


def test_worker_processes_read_the_same_rows_in_the_same_order_and_resume():
    import os

    data = datasets.Dataset.from_dict({"prompt": [str(i) for i in range(10)], "answer": list(range(10))})
    plain = PromptSampler(data, 3, shuffle=True, seed=0)
    expected = draws(plain, 7)  # 3 generations per epoch: crosses two epoch boundaries
    workers = PromptSampler(data, 3, shuffle=True, seed=0, num_workers=2)
    assert workers.loader.num_workers == 2
    assert draws(workers, 7) == expected
    workers.release()
    resumed = PromptSampler(data, 3, shuffle=True, seed=0, num_workers=2)
    draws(resumed, 1)  # its workers have prefetched generations the restored position skips
    resumed.load_state_dict({"epoch": 0, "position": 2})
    assert draws(resumed, 5) == expected[2:]
    resumed.release()
    reading = PromptSampler(RowsWithReaderPid(6), 2, shuffle=False, seed=0, num_workers=2)
    pids = {row["pid"] for _, rows in draws(reading, 3) for row in rows}
    reading.release()  # (a loader left running costs seconds at pytest's exit)
    assert os.getpid() not in pids and len(pids) == 2  # read in the two worker processes
    pids = {
        row["pid"]
        for _, rows in draws(PromptSampler(RowsWithReaderPid(6), 2, shuffle=False, seed=0), 3)
        for row in rows
    }
    assert pids == {os.getpid()}


def test_starting_a_loader_leaves_the_global_rng_alone():
    import torch

    data = datasets.Dataset.from_dict({"prompt": [str(i) for i in range(10)]})
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    sampler = PromptSampler(data, 3, shuffle=True, seed=0, num_workers=1)
    draws(sampler, 4)  # two loader starts (epoch 0, epoch 1)
    sampler.load_state_dict({"epoch": 0, "position": 1})
    draws(sampler, 1)
    sampler.release()
    assert torch.equal(torch.rand(3), expected)


def test_bad_worker_counts_and_streams():
    from grouprl.data.row_loading import workers_for

    data = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    with pytest.raises(ValueError, match="dataloader_num_workers=-1 must be an integer >= 0"):
        PromptSampler(data, 1, shuffle=False, seed=0, num_workers=-1)
    assert workers_for(data.to_iterable_dataset(), 4) == 0 and workers_for(data, 4) == 4
