"""The reward call contract: kwargs, None, async, partials, callable objects, and clear errors."""

import asyncio
import functools
import inspect
import math
import time

import numpy as np
import pytest

from grouprl.rewards.scoring import RewardFunctionError, prepare_reward_functions, reward_name, score_completions

PROMPTS = ["a", "b", "c"]
COMPLETIONS = ["x", "yy", "zzz"]


def score(funcs, **extra):
    return score_completions(
        prepare_reward_functions(funcs),
        prompts=PROMPTS,
        completions=COMPLETIONS,
        completion_ids=[[1], [2, 2], [3, 3, 3]],
        columns={"answer": ["1", "2", "3"]},
        **extra,
    )


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_contract_kwargs_are_passed():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra, **kwargs):
        seen.update(prompts=prompts, answer=answer, ids=completion_ids, state=trainer_state)
        return [0.0] * len(completions)

    score([spy], trainer_state="STATE")
    assert seen == {"prompts": PROMPTS, "answer": ["1", "2", "3"], "ids": [[1], [2, 2], [3, 3, 3]], "state": "STATE"}


def test_none_becomes_nan_and_numpy_accepted():
    out = score([lambda completions, **k: [None, 1, 2.5], lambda completions, **k: np.array([1.0, 2.0, 3.0])])
    assert math.isnan(out[0, 0]) and out[1:, 0].tolist() == [1.0, 2.5]
    assert out[:, 1].tolist() == [1.0, 2.0, 3.0]


class Scorer:
    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)


def test_names_partials_and_callable_objects():
    partial = functools.partial(length_reward)
    assert [reward_name(f) for f in (length_reward, partial, Scorer())] == ["length_reward", "length_reward", "Scorer"]
    assert score([partial, Scorer()]).tolist() == [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]


def test_async_functions_run_concurrently():
    async def slow_a(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow_b(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)

    start = time.perf_counter()
    out = score([slow_a, length_reward, slow_b])
    elapsed = time.perf_counter() - start
    assert out[:, 0].tolist() == [1.0] * 3 and out[:, 2].tolist() == [2.0] * 3
    assert elapsed < 0.55, f"two 0.3 s async rewards took {elapsed:.2f} s: not concurrent"


def test_sync_functions_run_concurrently_with_each_other_and_async_ones():
    """A slow sync checker does not serialise the step: 2 sync + 1 async, each 0.3 s, take ~0.3 s; order is kept."""

    def sleepy(value):
        def reward(completions, **kwargs):
            time.sleep(0.3)
            return [value] * len(completions)

        reward.__name__ = f"sleepy_{value}"
        return reward

    async def slow_async(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [9.0] * len(completions)

    start = time.perf_counter()
    out = score([sleepy(1.0), slow_async, sleepy(2.0), length_reward])
    elapsed = time.perf_counter() - start
    assert out[0].tolist() == [1.0, 9.0, 2.0, 1.0]
    assert elapsed < 0.55, f"three 0.3 s rewards took {elapsed:.2f} s: not concurrent"


def test_function_that_only_works_in_the_main_thread_is_retried_there_and_kept_there():
    import threading

    calls = []

    def main_thread_only(completions, **kwargs):  # like math_verify.parse with its default signal-based timeout
        calls.append(threading.current_thread() is threading.main_thread())
        if not calls[-1]:
            raise ValueError("signal only works in main thread of the main interpreter")
        return [1.0] * len(completions)

    functions = prepare_reward_functions([length_reward, main_thread_only])

    def run():
        return score_completions(
            functions,
            prompts=PROMPTS,
            completions=COMPLETIONS,
            completion_ids=[[1], [2, 2], [3, 3, 3]],
            columns={},
        )

    assert run()[:, 1].tolist() == [1.0] * 3
    assert calls == [False, True] and functions[1].main_thread_only
    assert run()[:, 1].tolist() == [1.0] * 3 and calls[2:] == [True]  # no second failed attempt


def test_logging_from_several_threads_is_kept():
    logged = []

    def make(name):
        def reward(completions, log_metric, log_extra, **kwargs):
            for k in range(200):
                log_metric(name, float(k))
            log_extra(name, list(completions))
            return [0.0] * len(completions)

        reward.__name__ = name
        return reward

    extras = {}
    score([make("a"), make("b"), make("c")], log_metric=lambda n, v: logged.append(n), log_extra=extras.__setitem__)
    assert sorted(set(logged)) == ["a", "b", "c"] and len(logged) == 600
    assert sorted(extras) == ["a", "b", "c"]


def test_first_failing_function_in_list_order_is_reported():
    def ok(completions, **kwargs):
        return [0.0] * len(completions)

    def bad_one(completions, **kwargs):
        raise RuntimeError("one")

    def bad_two(completions, **kwargs):
        time.sleep(0.05)
        raise RuntimeError("two")

    with pytest.raises(RewardFunctionError, match="'bad_one' raised RuntimeError: one"):
        score([ok, bad_one, bad_two])


def test_wrong_length_names_function():
    with pytest.raises(RewardFunctionError, match="'short' returned 2 values for 3 completions"):

        def short(completions, **kwargs):
            return [1.0, 2.0]

        score([short])


def test_non_number_names_function_and_row():
    def texty(completions, **kwargs):
        return [1.0, "good", 0.0]

    with pytest.raises(RewardFunctionError, match=r"'texty' returned 'good' \(str\) for row 1"):
        score([texty])


def test_nan_names_function_and_row():
    def nanny(completions, **kwargs):
        return [1.0, 2.0, float("nan")]

    with pytest.raises(RewardFunctionError, match="'nanny' returned nan for row 2"):
        score([nanny])


def test_raising_function_names_first_failing_row():
    def picky(completions, **kwargs):
        return [1.0 / (len(c) - 2) for c in completions]  # fails on "yy"

    with pytest.raises(RewardFunctionError, match=r"'picky' raised ZeroDivisionError.*row 1") as err:
        score([picky])
    assert "'yy'" in str(err.value)


def test_async_raising_names_function():
    async def broken(completions, **kwargs):
        raise KeyError("gold")

    with pytest.raises(RewardFunctionError, match="'broken' raised KeyError"):
        score([broken])

    async def picky_async(completions, **kwargs):
        if "zzz" in completions:
            raise ValueError("too long")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"'picky_async' raised ValueError: too long on row 2"):
        score([picky_async])


def test_log_metric_reaches_callback():
    logged = []

    def with_metric(completions, log_metric, **kwargs):
        log_metric("custom/len", 7.0)
        return [0.0] * len(completions)

    score([with_metric], log_metric=lambda name, value: logged.append((name, value)))
    assert logged == [("custom/len", 7.0)]


def test_bad_reward_funcs_argument():
    with pytest.raises(ValueError, match="at least one reward function"):
        prepare_reward_functions([])
    with pytest.raises(TypeError, match="not a callable"):
        prepare_reward_functions([3])
    with pytest.raises(TypeError, match="reward model .*load_reward_functions"):
        prepare_reward_functions("some/reward-model")


def test_row_no_function_scores_is_warned_with_its_arguments_as_trl(caplog):
    """TRL's test_warning_raised_all_rewards_none captures this through a logger of its own package: the
    record must reach the root handlers (propagate) with TRL's wording."""

    def none_for_b(prompts, **kwargs):
        return [None if p == "b" else 1.0 for p in prompts]

    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):
        out = score([none_for_b, lambda completions, **k: [None] * 3])
    assert out[1].isnan().all() and not out[0].isnan().all()
    (record,) = [r for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    message = record.getMessage()
    assert message.startswith(
        "All reward functions returned None for the following kwargs: {'answer': '2', 'prompt': 'b', "
        "'completion': 'yy'}"
    )
    assert "1 of 3 completions got no reward" in message and "trainer_state" not in message
    caplog.clear()
    with caplog.at_level("WARNING"):
        score(
            [length_reward, lambda completions, **k: [None] * 3]
        )  # one function scores every row: nothing to warn about
    assert "All reward functions returned None" not in caplog.text


# ---- bools, the keyword contract checked when the trainer is built, all-None rewards -------------------------


def test_bools_count_as_one_and_zero_as_in_trl():
    import torch

    out = score(
        [
            lambda completions, answer, **k: [c == "x" for c in completions],  # the common [c == a for ...]
            lambda completions, **k: np.array([len(c) > 1 for c in completions]),  # numpy bools
            lambda completions, **k: [np.bool_(True), torch.tensor(False), None],
        ]
    )
    assert out[:, 0].tolist() == [1.0, 0.0, 0.0]
    assert out[:, 1].tolist() == [0.0, 1.0, 1.0]
    assert out[:2, 2].tolist() == [1.0, 0.0] and math.isnan(out[2, 2])


def test_training_with_bool_rewards(tiny_model_dir, tmp_path):
    from helpers import numbered_prompts, quiet_config

    from grouprl import GRPOTrainer

    def long_enough(completion_ids, **kwargs):
        return [len(ids) > 4 for ids in completion_ids]

    config = quiet_config(tmp_path, per_device_train_batch_size=6, max_completion_length=8, max_steps=2)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=long_enough, args=config, train_dataset=numbered_prompts())
    trainer.train()
    means = [entry["rewards/long_enough/mean"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(means) == 2 and all(0.0 <= m <= 1.0 for m in means)


MISSING_MODEL = "/nonexistent/model"  # reaching the model loader would raise OSError instead


def test_function_without_kwargs_is_refused_when_the_trainer_is_built(tmp_path):
    import datasets
    from helpers import quiet_config

    from grouprl import GRPOTrainer

    def exact(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
    config = quiet_config(tmp_path, per_device_train_batch_size=6, max_completion_length=8, max_steps=1)
    with pytest.raises(TypeError) as err:  # before any model is loaded (that would be an OSError)
        GRPOTrainer(model=MISSING_MODEL, reward_funcs=[length_reward, exact], args=config, train_dataset=data)
    message = str(err.value)
    assert message.startswith(
        "reward_funcs[1]: Reward function 'exact' does not accept the keyword argument(s) 'prompts', "
        "'completion_ids', 'trainer_state', 'log_metric', 'log_extra', which it will be called with"
    )
    assert "Add **kwargs to its parameters (e.g. def exact(completions, answer, **kwargs): ...)" in message


def test_functions_and_reward_models_that_take_every_keyword_are_accepted(tmp_path):
    import datasets
    import torch
    from helpers import quiet_config

    from grouprl.compat.trainer_parts import collect_reward_sources

    def spelled_out(prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra):
        return [0.0] * len(completions)

    def anything(*args, **kwargs):
        return [0.0] * len(kwargs["completions"])

    def picky(completions, answer, **kwargs):
        return [0.0] * len(completions)

    def passes_on_what_it_takes(fn):  # a decorator: its own signature is the one called
        @functools.wraps(fn)
        def wrapper(**kwargs):
            return fn(**{k: v for k, v in kwargs.items() if k in inspect.signature(fn).parameters})

        return wrapper

    @passes_on_what_it_takes
    def decorated(completions):
        return [0.0] * len(completions)

    data = datasets.Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"]})
    config = quiet_config(tmp_path, per_device_train_batch_size=6)
    accepted = [
        spelled_out,
        anything,
        functools.partial(picky),
        Scorer(),
        decorated,
        "some/reward-model",  # reward models: loaded later, called as TRL calls them
        torch.nn.Linear(1, 1),
    ]
    funcs, _, weights = collect_reward_sources(config, accepted, None, None, data)
    assert funcs == accepted and weights == [1.0] * len(accepted)
    # remove_unused_columns=True: 'answer' is not passed, so a function need not take it
    only_trl = quiet_config(tmp_path, per_device_train_batch_size=6, remove_unused_columns=True)
    collect_reward_sources(
        only_trl,
        [lambda prompts, completions, completion_ids, trainer_state, log_metric, log_extra: []],
        None,
        None,
        data,
    )
    renamed = data.rename_column("answer", "solution")  # a column it does not name: refused, named
    with pytest.raises(TypeError, match=r"'spelled_out' does not accept the keyword argument\(s\) 'solution',"):
        collect_reward_sources(config, [spelled_out], None, None, renamed)


def test_keyword_failure_during_training_is_named_not_blamed_on_row_0():
    def no_extras(prompts, completions, completion_ids, trainer_state, log_metric, log_extra):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError) as err:  # 'answer' arrives, e.g. from a column only known later
        score([no_extras])
    message = str(err.value)
    assert "'no_extras' does not accept the keyword argument(s) 'answer'" in message and "Add **kwargs" in message
    assert "row 0" not in message


def test_all_none_rewards_warn_once_naming_the_functions(tiny_model_dir, tmp_path, caplog):
    from helpers import numbered_prompts, quiet_config

    from grouprl import GRPOTrainer
    from grouprl.train.health import detect

    (finding,) = detect({"rewards/f/mean": None, "rewards/g/mean": float("nan"), "reward": None}, step=1)
    assert finding.kind == "reward_all_none" and "Every reward function ('f', 'g') returned None" in finding.message

    def needs_solution(completions, **kwargs):
        return [None] * len(completions)

    def needs_gold(completions, **kwargs):
        return [None] * len(completions)

    config = quiet_config(tmp_path, per_device_train_batch_size=6, max_completion_length=8, max_steps=3)
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=[needs_solution, needs_gold], args=config, train_dataset=numbered_prompts()
    )
    with caplog.at_level("WARNING"):
        output = trainer.train()
    assert output.training_loss == 0.0
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("grouprl health warning") and "returned None" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings  # once per run, not once per step nor once per function
    (warning,) = warnings
    assert "Every reward function ('needs_solution', 'needs_gold') returned None for every completion" in warning
    assert "the model learns nothing" in warning and "make at least one function return a number" in warning
    assert "no reward at all" in caplog.records[-1].getMessage()  # the end-of-training summary counts it


def scored_within(funcs, timeout):
    return score_completions(
        prepare_reward_functions(funcs, timeout=timeout),
        prompts=PROMPTS,
        completions=COMPLETIONS,
        completion_ids=[[1], [2, 2], [3, 3, 3]],
        columns={"answer": ["1", "2", "3"]},
    )


def test_a_hung_reward_stops_at_reward_timeout_naming_the_function():
    """A sync function that never returns (in the calling thread's place, it would hold the run for ever) and an
    async one: each stops the call at the timeout, named; a quick function beside them is unaffected."""
    release = __import__("threading").Event()

    def hangs(completions, **kwargs):
        release.wait(60)
        return [0.0] * len(completions)

    async def hangs_async(completions, **kwargs):
        await asyncio.sleep(60)

    try:
        for hung, name in ((hangs, "Reward function 'hangs'"), (hangs_async, "the async reward functions")):
            started = time.monotonic()
            with pytest.raises(RewardFunctionError, match=rf"{name} did not return within reward_timeout=0.3 s"):
                scored_within([hung, length_reward], 0.3)
            assert time.monotonic() - started < 5
    finally:
        release.set()
    assert scored_within([length_reward], 0.3)[:, 0].tolist() == [1.0, 2.0, 3.0]


def test_a_slow_reward_without_a_timeout_is_named_in_a_warning(monkeypatch, caplog):
    from grouprl.rewards import scoring

    monkeypatch.setattr(scoring, "SLOW_CALL_S", 0.05)

    def slow(completions, **kwargs):
        time.sleep(0.3)
        return [1.0] * len(completions)

    with caplog.at_level("WARNING", logger="grouprl"):
        assert score([slow, length_reward])[:, 0].tolist() == [1.0, 1.0, 1.0]
    assert "reward function(s) slow still running after 0.05 s" in caplog.text  # not the quick one beside it
