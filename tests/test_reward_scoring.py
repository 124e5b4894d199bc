"""The reward call contract: kwargs, None, async, partials, callable objects, and clear errors."""

import asyncio
import functools
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
