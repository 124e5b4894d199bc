"""Built-in rewards on the cases TRL's tests cover: valid, invalid, mixed, unparseable gold, boundaries, pickling."""

import importlib.util
import pickle
import threading

import pytest

from grouprl.rewards import (
    BUILTIN_REWARDS,
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="math-verify not installed"
)


def messages(*texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


# ---- think_format_reward ------------------------------------------------------------------------


def test_think_format_valid():
    valid = [
        "<think>This is my reasoning.</think>This is my answer.",
        "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
        "<think>\nThis is\nmy reasoning.\n</think>\nThis is my answer.",
        "<think>\nThis is <some tag> my reasoning.</think>\nThis is my answer.",
        "<think></think>\nThis is my answer.",
    ]
    assert think_format_reward(messages(*valid)) == [1.0] * 5
    assert think_format_reward(valid) == [1.0] * 5  # plain-string completions too


def test_think_format_invalid():
    invalid = [
        "<think>\nThis is my reasoning.\nThis is my answer.",  # never closed
        "<think>This is my reasoning.\nThis is my answer.",
        "This is my reasoning. This is my answer.",  # no tags
        "This is my reasoning.\nThis is my answer.",
        "This is my reasoning.</think>\nThis is my answer.",  # no opening tag
        "This is my reasoning.</think>This is my answer.",
        "This<think>is my reasoning.</think>\nThis is my answer.",  # opening tag not first
        "<think>This is<think>my reasoning.</think></think>This is my answer.",  # nested
        "<think>This is</think>\nmy\n<think>reasoning.</think>\nThis is my answer.",  # two blocks
    ]
    assert think_format_reward(messages(*invalid)) == [0.0] * 9


def test_think_format_mixed():
    mixed = ["<think>A</think>B", "<think>\nA\n</think>\nB", "<think>A\nB", "A B"]
    assert think_format_reward(messages(*mixed)) == [1.0, 1.0, 0.0, 0.0]


# ---- get_soft_overlong_punishment ---------------------------------------------------------------


@pytest.mark.parametrize("length,expected", [(50, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0), (110, -1.0)])
def test_soft_overlong_punishment(length, expected):
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert reward(completion_ids=[[1] * length]) == [pytest.approx(expected)]


def test_soft_overlong_zero_cache_and_names():
    reward = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=0)
    assert reward([[1] * 10, [1] * 11]) == [0.0, -1.0]
    assert reward.__name__ == "soft_overlong_punishment_reward"
    assert pickle.loads(pickle.dumps(reward))([[1] * 11]) == [-1.0]


# ---- get_repetition_penalty_reward --------------------------------------------------------------


def test_repetition_penalty_none_full_partial():
    reward = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    # [1,2,3,4]: 3 distinct of 3 bigrams -> 0; [5]*5: 1 of 4 -> -0.75; [1,2,1,2]: 2 of 3 -> -1/3
    assert reward(completion_ids=[[1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2, 1, 2]]) == [0.0, -0.75, pytest.approx(-1 / 3)]


def test_repetition_penalty_short_inputs_scaling_and_ngram_size():
    default = get_repetition_penalty_reward()  # trigrams
    assert default([[], [1], [1, 1]]) == [0.0, 0.0, 0.0]  # fewer tokens than ngram_size
    assert default([[7, 7, 7]]) == [0.0]  # a single trigram is not a repetition
    assert get_repetition_penalty_reward(ngram_size=1, max_penalty=-2.0)([[3, 3, 3, 3]]) == [-1.5]  # 1 - 1/4, x2
    assert get_repetition_penalty_reward(ngram_size=4, max_penalty=-1.0)([[1, 2, 3, 1, 2, 3]]) == [0.0]


def test_repetition_penalty_rejects_bad_settings_ignores_kwargs_pickles():
    with pytest.raises(ValueError, match="must not be positive"):
        get_repetition_penalty_reward(max_penalty=0.5)
    with pytest.raises(ValueError, match="ngram_size must be > 0"):
        get_repetition_penalty_reward(ngram_size=0)
    reward = get_repetition_penalty_reward(ngram_size=2)
    assert reward(completion_ids=[[5, 5, 5]], prompts=["p"], completions=["c"], trainer_state=None) == [-0.5]
    clone = pickle.loads(pickle.dumps(reward))
    assert clone([[5, 5, 5]]) == [-0.5] and clone.__name__ == "repetition_penalty_reward"


# ---- accuracy_reward ----------------------------------------------------------------------------


@needs_math_verify
def test_accuracy_correct_wrong_and_no_latex():
    answer = r"\boxed{\frac{63}{400}}"
    assert accuracy_reward(messages(answer, answer), [r"\frac{63}{400}", "63/400"]) == [1.0, 1.0]
    assert accuracy_reward(messages(r"\boxed{\frac{64}{400}}"), [r"\frac{63}{400}"]) == [0.0]
    assert accuracy_reward(messages(r"\boxed{3}"), ["6"]) == [0.0]
    assert accuracy_reward([r"so \boxed{6}", "the answer is 6"], ["6", "6"]) == [1.0, 0.0]  # strings; unmarked answer


@needs_math_verify
def test_accuracy_unparseable_gold_is_none_and_logs_parses():
    columns = {}
    rewards = accuracy_reward(
        messages("Answer is forty two.", r"Some other content. \boxed{43}."),
        ["Answer is forty two.", "Answer is forty three."],
        log_extra=columns.__setitem__,
    )
    assert rewards == [None, None]
    assert columns["gold_parsed"] == ["[unparseable]"] * 2 and columns["answer_parsed"] == ["[skipped]"] * 2
    assert columns["solution"] == ["Answer is forty two.", "Answer is forty three."]


@needs_math_verify
def test_accuracy_in_worker_thread():
    results, errors = [], []

    def target():
        try:
            results.extend(accuracy_reward(messages(r"\boxed{\frac{1}{3}}"), [r"\frac{1}{3}"]))
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    assert not errors and results == [1.0]


# ---- reasoning_accuracy_reward ------------------------------------------------------------------


@needs_math_verify
def test_reasoning_accuracy_cases():
    gold = r"\frac{63}{400}"
    assert reasoning_accuracy_reward(
        messages(r"<think> R </think> \boxed{\frac{63}{400}}", r"R </think> \boxed{\frac{63}{400}}"), [gold, gold]
    ) == [1.0, 1.0]
    assert reasoning_accuracy_reward(
        messages(r"<S> R </REASONING_END> \boxed{\frac{63}{400}}"), [gold], reasoning_delimiters=["</REASONING_END>"]
    ) == [1.0]
    assert reasoning_accuracy_reward(messages(r"<think> R </think> \boxed{\frac{64}{400}}"), [gold]) == [0.0]
    only_inside = messages(
        r"<think> My answer is \boxed{42} </think> Some other text.",
        r"<think> The answer is \boxed{42} </think> Here's a wrong answer: \boxed{43}.",
    )
    assert reasoning_accuracy_reward(only_inside, [r"\boxed{42}", r"\boxed{42}"]) == [0.0, 0.0]
    incomplete = messages(
        r"<think> Incomplete reasoning without closing tag", r"Correct answer \frac{63}{400} but no reasoning"
    )
    assert reasoning_accuracy_reward(incomplete, [gold, gold]) == [0.0, 0.0]
    assert reasoning_accuracy_reward(messages(r"<think> R </think> \boxed{42}"), ["forty two"]) == [None]


# ---- get_cosine_scaled_reward -------------------------------------------------------------------

THIRD, HALF = messages(r"\boxed{\frac{1}{3}}")[0], messages(r"\boxed{\frac{1}{2}}")[0]
GOLD = [r"\frac{1}{3}", r"\frac{1}{3}"]


@needs_math_verify
@pytest.mark.parametrize(
    "completions,lengths,expected",
    [
        ([THIRD, THIRD], [25, 75], [0.92678, 0.57322]),  # correct: shorter is better
        ([HALF, HALF], [25, 75], [-0.92678, -0.57322]),  # wrong: longer is punished less
        ([THIRD, HALF], [50, 50], [0.75, -0.75]),  # midpoint
        ([THIRD, THIRD], [0, 100], [1.0, 0.5]),  # boundaries, correct
        ([HALF, HALF], [0, 100], [-1.0, -0.5]),  # boundaries, wrong
        ([THIRD, HALF], [200, 200], [0.5, -0.5]),  # clamped past max_len
    ],
)
def test_cosine_scaled_reward(completions, lengths, expected):
    reward = get_cosine_scaled_reward(max_len=100)
    assert reward(completions, GOLD, [[1] * n for n in lengths]) == [pytest.approx(e, abs=1e-4) for e in expected]


@needs_math_verify
def test_cosine_scaled_unparseable_custom_bounds_pickle():
    reward = get_cosine_scaled_reward(max_len=100)
    assert reward(messages(r"\boxed{42}"), ["forty two"], [[1] * 50]) == [None]
    custom = get_cosine_scaled_reward(max_len=100, min_value_correct=0.0, max_value_correct=2.0)
    assert custom([THIRD], GOLD[:1], [[1] * 50]) == [pytest.approx(1.0)]
    clone = pickle.loads(pickle.dumps(reward))
    assert clone([THIRD], GOLD[:1], [[1] * 50]) == [pytest.approx(0.75)] and clone.__name__ == "cosine_scaled_reward"


def test_every_builtin_pickles():
    for name, fn in BUILTIN_REWARDS.items():
        assert pickle.loads(pickle.dumps(fn)) is not None, name
