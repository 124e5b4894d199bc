"""Dataset formats, prompt tokenization, the seeded resumable sampler and per-process slices."""

import os

import datasets
import pytest

from grouprl.core.types import GroupLayout
from grouprl.data.prompt_sampler import PromptSampler, RowReaders
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


def test_prompt_longer_than_context_is_rejected_with_row_and_a_true_fix(tokenizer):
    prompt = "1+1=" * 10
    length = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert 16 < length < 100
    # the prompt alone is longer than the model: shortening it is the fix (lowering max_completion_length is not)
    with pytest.raises(ValueError) as alone:
        PromptTokenizer(tokenizer, max_context=16, max_completion_length=8)(prompt, 3)
    message = str(alone.value)
    assert message.startswith(f"Row 3: the prompt is {length} tokens, at least the model's maximum length of 16 tokens")
    assert "Shorten this prompt to at most 8 tokens (grouprl does not truncate prompts)" in message
    assert "dataset.filter" in message and "max_completion_length to at most" not in message
    # prompt + completion too long: either fix, both with true numbers
    with pytest.raises(ValueError) as both:
        PromptTokenizer(tokenizer, max_context=length + 4, max_completion_length=8)(prompt, 5)
    message = str(both.value)
    assert (
        f"Row 5: the prompt is {length} tokens; with max_completion_length=8 it needs {length + 8} positions" in message
    )
    assert f"more than the model's maximum length of {length + 4} tokens" in message
    assert f"Shorten this prompt to at most {length - 4} tokens" in message
    assert "lower max_completion_length to at most 4." in message
    # max_completion_length alone fills the model
    with pytest.raises(
        ValueError, match=r"max_completion_length=16 alone fills .* Lower max_completion_length below 16"
    ):
        PromptTokenizer(tokenizer, max_context=16, max_completion_length=16)("1+1=", 0)
    assert PromptTokenizer(tokenizer, max_context=length + 8, max_completion_length=8)(prompt, 0)  # fits exactly


def bad_row_9(n=12):
    prompts = [f"{i}+{i % 5}=" for i in range(n)]
    prompts[9] = None
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": [str(i) for i in range(n)]})


def test_every_row_is_checked_before_training_and_the_message_says_what_to_do():
    with pytest.raises(ValueError) as err:
        check_dataset(bad_row_9())
    message = str(err.value)
    assert message.startswith(
        "Row 9: 'prompt' must be a string or a non-empty list of messages [{'role': ..., 'content': ...}], got "
        "NoneType: None."
    )
    assert "Fix row 9 of train_dataset, or drop such rows before training, e.g. train_dataset = " in message
    # the suggested fix works
    keep = message[message.index("lambda row:") : -2]
    fixed = bad_row_9().filter(eval(keep))
    check_dataset(fixed)
    assert len(fixed) == 11
    with pytest.raises(ValueError, match=r"Row 2: 'prompt' is an empty string.*Fix row 2 of eval_dataset"):
        check_dataset(datasets.Dataset.from_dict({"prompt": ["a", "b", ""]}), "eval_dataset")
    chats = [[{"role": "user", "content": "hi"}], [], [{"role": None, "content": "x"}]]
    with pytest.raises(ValueError, match=r"Row 1: 'prompt' must be .* got list: \[\]\. .*len\(row\['prompt'\]\) > 0"):
        check_dataset(datasets.Dataset.from_dict({"prompt": chats}))
    with pytest.raises(ValueError, match=r"Row 2: message 0 of 'prompt' has role None.*filter\(lambda row: all"):
        check_dataset(datasets.Dataset.from_dict({"prompt": chats[:1] + chats[2:]}).select([0, 0, 1]))


def test_rows_are_numbered_as_the_trainer_reads_them_and_large_datasets_are_checked_in_workers(monkeypatch):
    import grouprl.data.prompts as prompts_module

    data = datasets.Dataset.from_dict({"prompt": [str(i) if i != 137 else None for i in range(300)]})
    shuffled = data.shuffle(seed=1)  # an indices mapping: rows are numbered as shuffled[i] reads them
    bad = [i for i in range(300) if shuffled[i]["prompt"] is None][0]
    read = []
    monkeypatch.setattr(prompts_module, "_first_bad_row", lambda prompts: read.append(len(prompts)) or None)
    monkeypatch.setattr(prompts_module, "LARGE_DATASET", 100)
    monkeypatch.setattr(prompts_module, "CHECK_BATCH", 64)
    monkeypatch.setattr(prompts_module.os, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match=f"Row {bad}: 'prompt' must be a string"):
        check_dataset(shuffled)  # datasets' map, 2 worker processes
    check_dataset(datasets.Dataset.from_dict({"prompt": [str(i) for i in range(300)]}))  # no bad row in any worker
    assert read == []
    monkeypatch.undo()
    with pytest.raises(ValueError, match=f"Row {bad}: 'prompt' must be a string"):
        check_dataset(shuffled)  # read in this process
    good = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    check_dataset(good)
    monkeypatch.setattr(prompts_module, "_first_bad_row", lambda prompts: read.append(len(prompts)) or None)
    check_dataset(good)  # passed once: not read again
    assert read == []


def test_rows_of_a_stream_or_a_transform_are_checked_as_drawn_before_use():
    stream = bad_row_9().to_iterable_dataset()
    check_dataset(stream)  # a stream is not read ahead
    sampler = PromptSampler(stream, 3, shuffle=False, seed=0)
    assert sampler.next_generation()[0] == [0, 1, 2]
    assert sampler.next_generation()[0] == [3, 4, 5]
    assert sampler.next_generation()[0] == [6, 7, 8]
    with pytest.raises(ValueError) as err:
        sampler.next_generation()
    message = str(err.value)
    assert message.startswith("Row 9: 'prompt' must be a string or a non-empty list")
    assert "train_dataset = train_dataset.filter(lambda row: row['prompt'] is not None)" in message
    assert "train_dataset is an IterableDataset, checked row by row as drawn" in message
    assert "Training stopped before using this row." in message
    transformed = bad_row_9().with_transform(lambda batch: batch)  # the transform decides what a row holds
    check_dataset(transformed)
    sampler = PromptSampler(transformed, 12, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="Row 9: 'prompt' must be a string.*Fix row 9 of train_dataset"):
        sampler.next_generation()


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
    data = datasets.Dataset.from_dict({"prompt": [str(i) for i in range(10)], "answer": list(range(10))})
    plain = PromptSampler(data, 3, shuffle=True, seed=0)
    expected = draws(plain, 7)  # 3 generations per epoch: crosses two epoch boundaries
    workers = PromptSampler(data, 3, shuffle=True, seed=0, readers=RowReaders(2))
    assert workers.loader.num_workers == 2
    assert draws(workers, 7) == expected
    workers.release()
    resumed = PromptSampler(data, 3, shuffle=True, seed=0, readers=RowReaders(2))
    draws(resumed, 1)  # its workers have prefetched generations the restored position skips
    resumed.load_state_dict({"epoch": 0, "position": 2})
    assert draws(resumed, 5) == expected[2:]
    resumed.release()
    reading = PromptSampler(RowsWithReaderPid(6), 2, shuffle=False, seed=0, readers=RowReaders(2))
    pids = {row["pid"] for _, rows in draws(reading, 3) for row in rows}
    reading.release()  # (a loader left running costs seconds at pytest's exit)
    assert os.getpid() not in pids and len(pids) == 2  # read in the two worker processes
    pids = {
        row["pid"]
        for _, rows in draws(PromptSampler(RowsWithReaderPid(6), 2, shuffle=False, seed=0), 3)
        for row in rows
    }
    assert pids == {os.getpid()}


def reader_pids(sampler, count):
    return {row["pid"] for _, rows in draws(sampler, count) for row in rows}


def test_persistent_workers_read_every_epoch_and_stop_when_released():
    sampler = PromptSampler(RowsWithReaderPid(4), 2, shuffle=True, seed=0, readers=RowReaders(2, 1, persistent=True))
    assert (sampler.loader.prefetch_factor, sampler.loader.persistent_workers) == (1, True)
    first_epoch, second_epoch = reader_pids(sampler, 2), reader_pids(sampler, 2)
    assert first_epoch == second_epoch and len(first_epoch) == 2  # the same two processes
    sampler.release()
    for pid in first_epoch:  # shut down and joined
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert reader_pids(sampler, 2).isdisjoint(first_epoch)  # a later pass starts new ones
    sampler.release()
    fresh = PromptSampler(RowsWithReaderPid(4), 2, shuffle=True, seed=0, readers=RowReaders(2))
    assert reader_pids(fresh, 2).isdisjoint(reader_pids(fresh, 2))  # not persistent: new workers each epoch
    fresh.release()


def test_the_workers_start_method_is_the_one_asked_for():
    sampler = PromptSampler(RowsWithReaderPid(2), 2, shuffle=False, seed=0, readers=RowReaders(1, start_method="spawn"))
    assert sampler.loader.multiprocessing_context.get_start_method() == "spawn"
    ((_, rows),) = [sampler.next_generation()]
    sampler.release()
    assert [row["prompt"] for row in rows] == ["0", "1"] and rows[0]["pid"] != os.getpid()


def test_loader_settings_are_checked_by_name():
    from types import SimpleNamespace

    def readers(**settings):
        config = {
            "dataloader_num_workers": 2,
            "dataloader_prefetch_factor": None,
            "dataloader_persistent_workers": False,
            "dataloader_multiprocessing_context": None,
            **settings,
        }
        return RowReaders.of(SimpleNamespace(**config), datasets.Dataset.from_dict({"prompt": ["a"]}))

    assert readers(dataloader_prefetch_factor=4, dataloader_persistent_workers=True) == RowReaders(2, 4, True)
    with pytest.raises(ValueError, match="dataloader_prefetch_factor=0 must be an integer >= 1"):
        readers(dataloader_prefetch_factor=0)
    with pytest.raises(ValueError, match="dataloader_multiprocessing_context='thread' is not a start method"):
        readers(dataloader_multiprocessing_context="thread")
    stream = datasets.Dataset.from_dict({"prompt": ["a"]}).to_iterable_dataset()
    config = SimpleNamespace(
        dataloader_num_workers=2,
        dataloader_prefetch_factor=4,
        dataloader_persistent_workers=True,
        dataloader_multiprocessing_context="spawn",
    )
    assert RowReaders.of(config, stream) == RowReaders()  # a stream is read in this process, so none apply


def test_starting_a_loader_leaves_the_global_rng_alone():
    import torch

    data = datasets.Dataset.from_dict({"prompt": [str(i) for i in range(10)]})
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    sampler = PromptSampler(data, 3, shuffle=True, seed=0, readers=RowReaders(1))
    draws(sampler, 4)  # two loader starts (epoch 0, epoch 1)
    sampler.load_state_dict({"epoch": 0, "position": 1})
    draws(sampler, 1)
    sampler.release()
    assert torch.equal(torch.rand(3), expected)


def test_bad_worker_counts_and_streams():
    from grouprl.data.prompt_sampler import workers_for

    data = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    with pytest.raises(ValueError, match="dataloader_num_workers=-1 must be an integer >= 0"):
        PromptSampler(data, 1, shuffle=False, seed=0, readers=RowReaders(-1))
    assert workers_for(data.to_iterable_dataset(), 4) == 0 and workers_for(data, 4) == 4


# ---- through the trainer ---------------------------------------------------------------------------------

MISSING_MODEL = "/nonexistent/model"  # reaching the model loader would raise OSError instead


def test_trainer_refuses_a_bad_row_before_loading_anything(tmp_path):
    from helpers import distinct_tokens, quiet_config

    from grouprl import GRPOTrainer

    config = quiet_config(tmp_path, per_device_train_batch_size=6, max_completion_length=8, max_steps=4)
    with pytest.raises(ValueError, match=r"Row 9: 'prompt' must be a string .* Fix row 9 of train_dataset"):
        GRPOTrainer(model=MISSING_MODEL, reward_funcs=distinct_tokens, args=config, train_dataset=bad_row_9())
    eval_config = quiet_config(
        tmp_path, per_device_train_batch_size=6, max_completion_length=8, max_steps=4, eval_strategy="steps"
    )
    with pytest.raises(ValueError, match=r"Row 9: 'prompt' must be a string .* Fix row 9 of eval_dataset"):
        GRPOTrainer(
            model=MISSING_MODEL,
            reward_funcs=distinct_tokens,
            args=eval_config,
            train_dataset=bad_row_9().select(range(9)),
            eval_dataset=bad_row_9(),
        )


def test_trainer_stops_on_a_bad_streamed_row_before_using_it(tiny_model_dir, tmp_path):
    from helpers import distinct_tokens, quiet_config

    from grouprl import GRPOTrainer

    config = quiet_config(
        tmp_path, per_device_train_batch_size=6, max_completion_length=8, max_steps=5, shuffle_dataset=False
    )  # 2 prompts per step: row 9 is drawn for step 5
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=bad_row_9().to_iterable_dataset(),
    )
    with pytest.raises(ValueError, match=r"Row 9: 'prompt' must be a string .*checked row by row as drawn"):
        trainer.train()
    assert trainer.state.global_step == 4
