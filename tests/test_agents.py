"""Tools, multi-turn rollouts, environments and rollout_func through GRPOTrainer, with a scripted backend
that calls tools on cue: token-exact sequences, tool masks, limits, metrics, routing and TRL's errors."""

import re

import datasets
import pytest
import torch
from helpers import ScriptedBackend, multiply
from transformers import AutoTokenizer

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.demo.tokenizer import IM_END


class Counter:
    """An environment: a counter the model increments; its reward is the final count."""

    def __init__(self):
        self.count, self.resets = 0, []

    def reset(self, **row):
        self.count = 0
        self.resets.append(row)
        return " Count up."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.count += step
        return self.count

    def get_reward(self):
        return float(self.count)


class Echo:
    """A second environment with another tool and no reward of its own."""

    def __init__(self):
        self.heard = []

    def reset(self, **row):
        return None

    def shout(self, text: str) -> str:
        """Repeat text loudly.

        Args:
            text: what to repeat
        """
        self.heard.append(text)
        return text.upper()


@pytest.fixture(scope="module")
def tok(tool_model_dir):
    return AutoTokenizer.from_pretrained(tool_model_dir)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def turn(tok, text):
    """A model turn: the text's tokens and the end-of-turn token."""
    return ids(tok, text) + [tok.convert_tokens_to_ids(IM_END)]


def call_text(name, **arguments):
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def suffix(tok, *results):
    """The template glue after a tool-calling turn, written out by hand (ChatML, Qwen2.5 style)."""
    blocks = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    return ids(tok, f"\n<|im_start|>user{blocks}<|im_end|>\n<|im_start|>assistant\n")


def answered(tok, prompt_ids):
    """Whether the conversation so far already holds a tool response (then the model answers)."""
    return "<tool_response>" in tok.decode(prompt_ids)


class ScriptedFirstTurn:
    """A generation backend whose conversations' first turn is `first` (token ids: the model calling a tool, which the
    tiny random model never does) and whose turns after the tool results `real` samples; `on_continuation(prompt_ids,
    completions)` sees each of those calls as it returns."""

    def __init__(self, tok, first, real, on_continuation=lambda prompt_ids, completions: None):
        self.tok, self.first, self.real, self.on_continuation = tok, first, real, on_continuation
        self.needs_importance_correction = getattr(real, "needs_importance_correction", False)

    def sync_weights(self, model):
        self.real.sync_weights(model)

    def generate(self, prompt_ids, num_samples, params):
        if not answered(self.tok, prompt_ids[0]):
            scripted = ScriptedBackend(lambda p, s: self.first, self.tok.convert_tokens_to_ids(IM_END), self.tok)
            return scripted.generate(prompt_ids, num_samples, params)
        completions = self.real.generate(prompt_ids, num_samples, params)
        self.on_continuation(prompt_ids, completions)
        return completions


def calling_agent(tok, kind):
    """(the GRPOTrainer argument of `kind`, tools or environment_factory; a first turn that calls its tool; the
    template glue around that tool's result)."""
    if kind == "tools":
        return {"tools": [multiply]}, turn(tok, call_text("multiply", a=6, b=7)), suffix(tok, 42)
    return {"environment_factory": Counter}, turn(tok, call_text("increment", step=2)), suffix(tok, 2)


def dataset(n=4, **columns):
    rows = {"prompt": [[{"role": "user", "content": f"{i} times 7?"}] for i in range(n)], **columns}
    return datasets.Dataset.from_dict(rows)


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=256,
        learning_rate=0.05,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def make_trainer(tool_model_dir, tmp_path, script, tok, reward_funcs=constant_reward, train_dataset=None, **kwargs):
    args = kwargs.pop("args", None) or config(tmp_path)
    backend = ScriptedBackend(script, tok.convert_tokens_to_ids(IM_END), tok)
    trainer = GRPOTrainer(
        model=tool_model_dir,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset() if train_dataset is None else train_dataset,
        generation_backend=backend,
        **kwargs,
    )
    return trainer, backend


# ---- token-exact multi-turn sequences --------------------------------------------------------------------------


# The model's final answer spelled byte by byte: "user" is one merged token in this tokenizer, so any decode ->
# re-encode of the sequence would change these ids.
SPELLED_USER = [ord(c) for c in "user"]


def test_sequence_is_prompt_plus_sampled_tokens_plus_template_suffix(tool_model_dir, tmp_path, tok):
    first = turn(tok, call_text("multiply", a=6, b=7))
    final = SPELLED_USER + [tok.convert_tokens_to_ids(IM_END)]
    trainer, backend = make_trainer(
        tool_model_dir, tmp_path, lambda p, s: final if answered(tok, p) else first, tok, tools=[multiply]
    )
    rollout = trainer.run.rollouts.sample()
    glue = suffix(tok, 42)
    prompt = rollout.prompts.prompt_ids[0]
    assert tok.decode(prompt).count('"name": "multiply"') == 1  # the tool schema is rendered into the prompt
    c = rollout.completions[0]
    assert c.token_ids == first + glue + final
    assert c.tool_mask == [True] * len(first) + [False] * len(glue) + [True] * len(final)
    assert (c.tool_calls, c.tool_failures, c.finish_reason) == (1, 0, "stop")
    assert c.messages[1] == {"role": "tool", "name": "multiply", "content": "42"} and c.messages[2]["content"] == "user"
    assert c.messages[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    ]
    # The second turn was prompted with exactly the tokens so far, one continuation per rollout group member.
    assert backend.calls[1][0][0] == prompt + first + glue
    batch = trainer.run.rollouts.make_train_batch(rollout, torch.zeros(len(rollout.completions)))
    n = len(c.token_ids)
    assert batch.completion_ids[0, :n].tolist() == c.token_ids
    assert (
        batch.completion_mask[0, :n].all() and not batch.completion_mask[0, n:].any()
    )  # tool tokens stay in the attention
    assert batch.loss_mask[0, :n].tolist() == c.tool_mask and not batch.loss_mask[0, n:].any()
    assert batch.num_loss_tokens == sum(sum(x.tool_mask) for x in rollout.completions)


def test_rollback_and_truncation_at_the_length_limit(tool_model_dir, tmp_path, tok):
    first = turn(tok, call_text("multiply", a=6, b=7))
    glue = suffix(tok, 42)
    script = lambda p, s: turn(tok, "42") if answered(tok, p) else first  # noqa: E731
    # No room for a single model token after the results: the rollout ends with its call (which ran and counts).
    trainer, backend = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        tools=[multiply],
        args=config(tmp_path, max_completion_length=len(first) + len(glue)),
    )
    c = trainer.run.rollouts.sample().completions[0]
    assert c.token_ids == first and all(c.tool_mask) and c.tool_calls == 1 and c.messages[-1]["tool_calls"]
    assert len(backend.calls) == 1
    # Room for 2 tokens: the continuation is cut so the whole completion is exactly max_completion_length.
    trainer, backend = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        tools=[multiply],
        args=config(tmp_path, max_completion_length=len(first) + len(glue) + 2),
    )
    c = trainer.run.rollouts.sample().completions[0]
    assert c.token_ids == first + glue + turn(tok, "42")[:2] and c.finish_reason == "length"
    assert len(c.token_ids) == trainer.args.max_completion_length


def test_max_tool_calling_iterations_bounds_the_rounds(tool_model_dir, tmp_path, tok):
    first = turn(tok, call_text("multiply", a=2, b=3))
    trainer, backend = make_trainer(
        tool_model_dir,
        tmp_path,
        lambda p, s: first,
        tok,
        tools=[multiply],
        args=config(tmp_path, max_tool_calling_iterations=2, max_completion_length=400),
    )
    c = trainer.run.rollouts.sample().completions[0]
    assert c.tool_calls == 2 and [m["role"] for m in c.messages] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert c.token_ids == first + suffix(tok, 6) + first + suffix(tok, 6) + first
    assert len(backend.calls) == 3  # the first turn and two tool rounds (identical continuations sampled together)


# ---- metrics and training ----------------------------------------------------------------------------------------


async def async_multiply(a: int, b: int) -> int:
    """Multiply two integers, asynchronously.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@pytest.mark.parametrize("tool", [multiply, async_multiply])
def test_call_and_failure_frequencies_lengths_and_training(tool_model_dir, tmp_path, tok, tool):
    good = turn(tok, call_text(tool.__name__, a=6, b=7))
    bad = turn(tok, call_text("divide", a=6, b=7))  # no such tool: an error result, a failed call
    direct = turn(tok, "42")
    answer = turn(tok, "42")
    script = lambda p, s: answer if answered(tok, p) else [good, bad, direct][s]  # noqa: E731
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    trainer, _ = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        reward_funcs=reward,
        tools=[tool],
        args=config(tmp_path, beta=0.1, per_device_eval_batch_size=3),
    )
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == pytest.approx(2 / 3) and log["tools/failure_frequency"] == pytest.approx(
        1 / 2
    )
    model_tokens = [
        len(good) + len(answer),
        len(bad) + len(answer),
        len(direct),
    ]  # tool output is not the model's length
    assert log["completions/mean_length"] == pytest.approx(sum(model_tokens) / 3)
    assert log["completions/max_length"] == max(model_tokens) and log["completions/min_length"] == min(model_tokens)
    prompt_tokens = [len(trainer.run.rollouts.tokenize(row["prompt"], i)) for i, row in enumerate(dataset(2))]
    assert log["num_tokens"] == 3 * sum(prompt_tokens) + 2 * sum(
        model_tokens
    )  # prompts and model tokens, not tool output
    assert [m["role"] for m in seen[0]] == ["assistant", "tool", "assistant"] and seen[2] == [
        {"role": "assistant", "content": "42"}
    ]
    assert "unknown tool 'divide'" in seen[1][1]["content"]
    assert log["kl"] is not None and log["loss"] is not None
    metrics = trainer.evaluate(dataset(2))
    assert metrics["eval_tools/call_frequency"] == pytest.approx(2 / 3)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "kind, sampler",
    [("tools", "fast"), ("tools", "continuous_batching"), ("environment_factory", "continuous_batching")],
)
def test_real_backend_continues_after_tool_results(tool_model_dir, tmp_path, tok, kind, sampler):
    """The default sampler (FastGenerator), or transformers' continuous batching, is prompted with prompt + tokens +
    suffix and keeps the budget."""
    from grouprl.generation.continuous_batching import ContinuousBatchingGenerator

    agent, first, glue = calling_agent(tok, kind)
    trainer = GRPOTrainer(
        model=tool_model_dir,
        reward_funcs=constant_reward,
        train_dataset=dataset(),
        args=config(
            tmp_path,
            max_completion_length=len(first) + len(glue) + 5,
            use_transformers_continuous_batching=sampler == "continuous_batching",
        ),
        **agent,
    )
    real = trainer.run.rollouts.backend
    assert isinstance(real, ContinuousBatchingGenerator) == (sampler == "continuous_batching")
    continuations = []
    trainer.run.rollouts.backend = ScriptedFirstTurn(tok, first, real, lambda ids, _: continuations.append(ids))
    trainer.train()
    rollout = trainer.run.rollouts.sample()
    assert len(continuations) == 2 and all(tok.decode(p).endswith(tok.decode(first + glue)) for p in continuations[-1])
    for c in rollout.completions:
        assert c.token_ids[: len(first) + len(glue)] == first + glue
        assert 0 < sum(c.tool_mask) - len(first) <= 5 and len(c.token_ids) <= trainer.args.max_completion_length


# ---- environments -------------------------------------------------------------------------------------------------


def test_environment_tools_reset_reward_and_pool(tool_model_dir, tmp_path, tok):
    calls_counter = turn(tok, call_text("increment", step=2))
    script = lambda p, s: turn(tok, "done") if answered(tok, p) else (calls_counter if s == 0 else turn(tok, "no"))  # noqa: E731
    made = []

    def factory():
        made.append(Counter())
        return made[-1]

    environments_seen = []

    def reward(environments, **kwargs):
        environments_seen.append(environments)
        return [0.0] * len(environments)

    trainer, _ = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        reward_funcs=reward,
        environment_factory=factory,
        train_dataset=dataset(answer=["0", "7", "14", "21"]),
        args=config(tmp_path, max_steps=2, reward_weights=[0.5]),
    )
    assert trainer.reward_func_names == ["reward", "Counter"] and trainer.run.rollouts.reward_weights.tolist() == [
        0.5,
        1.0,
    ]
    # TRL's attributes, as read-only views: the probed instance's tool methods (reset / get_reward are not tools)
    assert trainer.tools == [made[0].increment] and trainer._env_tools == {None: [made[0].increment]}
    assert trainer._environment_pool == {None: [made[0]]} and trainer.environments is None  # no generation yet
    assert trainer.environment_factories == {None: factory}
    rollout = trainer.run.rollouts.sample()
    envs = [c.reward_kwargs["environments"] for c in rollout.completions]
    assert len({id(e) for e in envs}) == 6 and [e.count for e in envs] == [2, 0, 0, 2, 0, 0]
    assert trainer.environments == envs and trainer._environment_pool[None] == made  # this generation's, in row order
    assert envs[3].resets[-1] == {"prompt": [{"role": "user", "content": "1 times 7?"}], "answer": "7"}
    # The observation is appended to the last message, and the environment's method is the tool in the prompt.
    expected_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "1 times 7? Count up."}],
        tools=[made[0].increment],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert rollout.completions[3].prompt_ids == list(expected_prompt)
    _, rewards, _ = trainer.run.rollouts.score(rollout, trainer.state, trainer.run.window)
    assert rewards.per_function[:, 1].tolist() == [2.0, 0.0, 0.0, 2.0, 0.0, 0.0]
    assert environments_seen[-1] == envs
    trainer.train()  # two more generations: the pool is reused, not grown
    assert len(made) == 6


def test_environments_routed_by_column_with_their_own_tools(tool_model_dir, tmp_path, tok):
    def script(prompt, s):
        text = tok.decode(prompt)
        if answered(tok, prompt):
            return turn(tok, "ok")
        return turn(
            tok, call_text("increment", step=1) if '"name": "increment"' in text else call_text("shout", text="hi")
        )

    trainer, _ = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        environment_factory={"counter": Counter, "echo": Echo},
        train_dataset=dataset(environment=["counter", "echo", "counter", "echo"]),
    )
    # TRL's views: each environment's own tools; trainer.tools their union (TRL's order)
    assert [[f.__name__ for f in tools] for tools in trainer._env_tools.values()] == [["increment"], ["shout"]]
    assert [f.__name__ for f in trainer.tools] == ["increment", "shout"]
    assert {name: len(pool) for name, pool in trainer._environment_pool.items()} == {"counter": 1, "echo": 1}
    rollout = trainer.run.rollouts.sample()
    envs = [c.reward_kwargs["environments"] for c in rollout.completions]
    assert [type(e).__name__ for e in envs] == ["Counter"] * 3 + ["Echo"] * 3
    assert [e.count for e in envs[:3]] == [1, 1, 1] and [e.heard for e in envs[3:]] == [["hi"]] * 3
    assert all(c.tool_failures == 0 for c in rollout.completions)
    assert '"name": "shout"' not in tok.decode(rollout.completions[0].prompt_ids)
    assert '"name": "increment"' not in tok.decode(rollout.completions[3].prompt_ids)
    assert "environment" not in envs[0].resets[-1]  # a routing column, not passed to reset()
    _, rewards, _ = trainer.run.rollouts.score(rollout, trainer.state, trainer.run.window)
    counter_reward = rewards.per_function[:, rewards.names.index("Counter")]
    assert (
        counter_reward[:3].tolist() == [1.0, 1.0, 1.0] and torch.isnan(counter_reward[3:]).all()
    )  # None for Echo rollouts


def test_environment_owned_data_and_reward(tool_model_dir, tmp_path, tok):
    class Puzzle(Counter):
        def reset(self, **row):
            self.count = 0
            return "Count to 3."

    script = lambda p, s: turn(tok, "ok") if answered(tok, p) else turn(tok, call_text("increment", step=s))  # noqa: E731
    trainer = GRPOTrainer(
        model=tool_model_dir,
        environment_factory=Puzzle,
        args=config(tmp_path),  # no dataset, no reward_funcs
        generation_backend=ScriptedBackend(script, tok.convert_tokens_to_ids(IM_END), tok),
    )
    assert trainer.run.rollouts.sample().completions[0].prompt_ids == list(
        tok.apply_chat_template(
            [{"role": "user", "content": "Count to 3."}],
            tools=[Puzzle().increment],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    trainer.train()
    log = trainer.state.log_history[0]
    # The 6 rollouts have the same prompt, so they are sampled together (samples 0..5 increment by 0..5).
    assert log["rewards/Puzzle/mean"] == pytest.approx(2.5) and log["tools/call_frequency"] == 1.0


def test_dataset_of_environment_names_only(tool_model_dir, tmp_path, tok):
    """TRL's test_environment_owned_reward_mixed_environments / test_train_with_multiple_environments: a dict factory
    and a dataset holding only the routing column; each prompt is an empty user message that reset() completes."""
    made = []

    def counter():
        made.append(Counter())
        return made[-1]

    def script(prompt, s):
        if answered(tok, prompt):
            return turn(tok, "ok")
        return turn(
            tok, call_text("increment", step=2) if '"name": "increment"' in tok.decode(prompt) else "nothing to do"
        )

    routing = datasets.Dataset.from_dict({"environment": ["counter", "echo", "counter", "echo"]})
    trainer, _ = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        reward_funcs=None,
        train_dataset=routing,
        environment_factory={"counter": counter, "echo": Echo},
    )
    assert trainer.reward_func_names == ["Counter"]  # the environment owns the reward; Echo rollouts get None
    rollout = trainer.run.rollouts.sample()
    assert made[0].resets[-1] == {}  # no placeholder prompt and no routing column among reset()'s arguments, as in TRL
    expected = tok.apply_chat_template(
        [{"role": "user", "content": " Count up."}],
        tools=[made[0].increment],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert rollout.completions[0].prompt_ids == list(expected)
    assert rollout.completions[3].prompt_ids == list(
        tok.apply_chat_template(
            [{"role": "user", "content": ""}],
            tools=[Echo().shout],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    _, rewards, _ = trainer.run.rollouts.score(rollout, trainer.state, trainer.run.window)
    assert rewards.per_function[:3, 0].tolist() == [2.0, 2.0, 2.0] and torch.isnan(rewards.per_function[3:, 0]).all()
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    with pytest.raises(ValueError, match="no 'prompt' column"):  # without environments a prompt stays required
        make_trainer(tool_model_dir, tmp_path, script, tok, train_dataset=routing)


# ---- rollout_func -------------------------------------------------------------------------------------------------


def test_rollout_func_output_is_trained_on_as_given(tool_model_dir, tmp_path, tok):
    eos = tok.convert_tokens_to_ids(IM_END)
    received = []

    def rollout_func(prompts, trainer):
        received.append((prompts, trainer))
        n = len(prompts)
        return {
            "prompt_ids": [[5, 6, 7]] * n,
            "completion_ids": [[10, 11, 12, eos]] * n,
            "logprobs": [[-1.0, -2.0, -3.0, -0.5]] * n,
            "env_mask": [[1, 0, 0, 1]] * n,
            "turns": list(range(n)),
        }

    def reward(turns, **kwargs):
        return [float(t) for t in turns]

    trainer, _ = make_trainer(tool_model_dir, tmp_path, None, tok, reward_funcs=reward, rollout_func=rollout_func)
    rollout = trainer.run.rollouts.sample()
    prompts, given_trainer = received[0]
    assert (
        given_trainer is trainer and len(prompts) == 6 and prompts[0] == prompts[2] != prompts[3]
    )  # one entry per completion
    _, rewards, advantages = trainer.run.rollouts.score(rollout, trainer.state, trainer.run.window)
    assert rewards.per_function[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    batch = trainer.run.rollouts.make_train_batch(rollout, advantages)
    assert batch.prompt_ids[0].tolist() == [5, 6, 7] and batch.completion_ids[0].tolist() == [10, 11, 12, eos]
    assert batch.loss_mask[0].tolist() == [True, False, False, True] and batch.sampler_logprobs[0].tolist() == [
        -1.0,
        -2.0,
        -3.0,
        -0.5,
    ]
    trainer.train()


def test_trls_agent_attributes_without_environments(tool_model_dir, tmp_path, tok):
    trainer, _ = make_trainer(tool_model_dir, tmp_path, lambda p, s: turn(tok, "x"), tok, tools=[multiply])
    assert trainer.tools == [multiply] and trainer.environments is None and trainer.environment_factories is None
    assert trainer.rollout_func is None
    with pytest.raises(AttributeError, match="no environment_factory"):
        _ = trainer._env_tools
    with pytest.raises(AttributeError, match="tools is read-only"):
        trainer.tools = []

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [[1]] * len(prompts), "completion_ids": [[2]] * len(prompts), "logprobs": None}

    def replacement(prompts, trainer):
        return {**rollout_func(prompts, trainer), "completion_ids": [[3]] * len(prompts)}

    trainer, _ = make_trainer(tool_model_dir, tmp_path / "b", None, tok, rollout_func=rollout_func)
    assert trainer.tools == [] and trainer.rollout_func is rollout_func
    trainer.rollout_func = replacement  # as in TRL, the sampler calls the trainer's attribute
    assert [c.token_ids for c in trainer.run.rollouts.sample().completions] == [[3]] * 6


def test_rollout_func_missing_keys_named(tool_model_dir, tmp_path, tok):
    trainer, _ = make_trainer(
        tool_model_dir,
        tmp_path,
        None,
        tok,
        rollout_func=lambda prompts, trainer: {"prompt_ids": [], "completion_ids": []},
    )
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        trainer.run.rollouts.sample()


# ---- with dynamic sampling and LoRA --------------------------------------------------------------------------------


def number_of(tok, prompt_ids):
    """The N of a "N times 7?" prompt, from its tokens."""
    return int(re.search(r"(\d+) times 7", tok.decode(prompt_ids)).group(1))


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["tools", "environment_factory", "rollout_func"])
@pytest.mark.parametrize("policy", ["full", "lora", "qlora", "sync_ref"])
def test_multi_turn_rows_survive_dynamic_sampling_with_each_kind_of_policy(tool_model_dir, tmp_path, tok, kind, policy):
    """Only the groups of prompts 0, 4, 8, 12 call a tool (one sample in three), so only they differ in reward and
    dynamic sampling keeps them alone; every row trained on is then its rollout, token for token, with the tool
    output masked out of the loss. With LoRA, and QLoRA (a 4-bit base), only the adapters move; a synced reference
    moves with the policy."""
    import grouprl.train.stages

    tool = "increment" if kind == "environment_factory" else "multiply"
    call = turn(tok, call_text("increment", step=2) if tool == "increment" else call_text("multiply", a=6, b=7))
    glue, answer = suffix(tok, 2 if tool == "increment" else 42), turn(tok, "42")
    direct = [turn(tok, "42"), turn(tok, "42"), turn(tok, "7")]

    def expected(number, sample):  # (completion ids, loss mask) of a prompt's sample
        if number % 4 == 0 and sample == 0:
            return call + glue + answer, [True] * len(call) + [False] * len(glue) + [True] * len(answer)
        return direct[sample], [True] * len(direct[sample])

    def script(prompt_ids, sample):
        if answered(tok, prompt_ids):
            return answer
        return call if number_of(tok, prompt_ids) % 4 == 0 and sample == 0 else direct[sample]

    def rollout_func(prompts, trainer):
        numbers = [int(re.search(r"(\d+) times", p[-1]["content"]).group(1)) for p in prompts]
        rows = [expected(n, i % 3) for i, n in enumerate(numbers)]  # G=3 consecutive entries per prompt
        return {
            "prompt_ids": [ids(tok, p[-1]["content"]) for p in prompts],
            "completion_ids": [r[0] for r in rows],
            "logprobs": None,
            "env_mask": [r[1] for r in rows],
            "called": [float(not all(r[1])) for r in rows],
        }

    def reward(completions, **kwargs):  # tool calls make 3 messages, a direct answer 1
        if kind == "rollout_func":
            return kwargs["called"]
        return [float(len(c)) if kind == "tools" else 0.0 for c in completions]

    trained = {}
    backward = grouprl.train.stages.backward

    def record(run, loss, micro):
        for prompt, mask, row, real, loss_mask in zip(
            micro.prompt_ids, micro.prompt_mask, micro.completion_ids, micro.completion_mask, micro.loss_mask
        ):
            trained.setdefault(number_of(tok, prompt[mask]), []).append((row[real].tolist(), loss_mask[real].tolist()))
        return backward(run, loss, micro)

    agent = {"tools": {"tools": [multiply]}, "environment_factory": {"environment_factory": Counter}}.get(kind, {})
    if kind == "rollout_func":
        agent = {"rollout_func": rollout_func}
    lora = policy in ("lora", "qlora")
    peft = pytest.importorskip("peft") if lora else None
    options = {
        "qlora": {"model_init_kwargs": {"quantization_config": {"load_in_4bit": True}}},
        "sync_ref": {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1},
    }.get(policy, {})
    trainer, _ = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        reward_funcs=reward,
        train_dataset=dataset(16, number=list(range(16))),
        args=config(tmp_path, dynamic_sampling=True, max_dynamic_sampling_rounds=8, max_steps=2, **options),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None,
        **agent,
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    reference = [p.detach().clone() for p in trainer.ref_model.parameters()] if policy == "sync_ref" else []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grouprl.train.stages, "backward", record)
        trainer.train()
    # 2 prompts a round: (0 1) (2 3) (4 5) fill step 1 with 0 and 4; (6 7) (8 9) (10 11) (12 13) step 2 with 8, 12
    assert sorted(trained) == [0, 4, 8, 12]
    for number, rows in trained.items():
        assert sorted(rows) == sorted(expected(number, s) for s in range(3)), number
    drawn = [e["dynamic_sampling/completions_drawn"] for e in trainer.state.log_history if "loss" in e]
    assert drawn == [18.0, 24.0]
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(("lora_" in name) == lora for name in changed)
    if reference:
        assert max((p - r).abs().max().item() for p, r in zip(trainer.ref_model.parameters(), reference)) > 0


# ---- errors TRL raises, and ours -------------------------------------------------------------------------------------


def test_agent_errors(tool_model_dir, tmp_path, tok):
    script = lambda p, s: turn(tok, "x")  # noqa: E731
    with pytest.raises(ValueError, match="No reward source provided"):
        make_trainer(tool_model_dir, tmp_path, script, tok, reward_funcs=None, tools=[multiply])
    with pytest.raises(ValueError, match="No reward source provided"):
        make_trainer(tool_model_dir, tmp_path, script, tok, reward_funcs=None, environment_factory=Echo)
    with pytest.raises(ValueError, match="max_steps must be set"):
        GRPOTrainer(model=tool_model_dir, environment_factory=Counter, args=config(tmp_path, max_steps=-1))
    with pytest.raises(ValueError, match="requires a `train_dataset` with an `environment` column"):  # TRL's words
        GRPOTrainer(model=tool_model_dir, environment_factory={"a": Counter}, args=config(tmp_path))
    with pytest.raises(ValueError, match="cannot be combined"):
        make_trainer(tool_model_dir, tmp_path, script, tok, tools=[multiply], rollout_func=lambda p, t: {})
    with pytest.raises(ValueError, match=r"environment_factory methods\[0\] \(increment\)"):

        class Undocumented(Counter):
            def increment(self, step):
                return step

        make_trainer(tool_model_dir, tmp_path, script, tok, environment_factory=Undocumented)
    trainer, _ = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        environment_factory={"counter": Counter},
        train_dataset=dataset(environment=["counter", "nope", "counter", "nope"]),
    )
    with pytest.raises(ValueError, match="Row 1 has environment='nope'"):
        trainer.run.rollouts.sample()
    trainer, _ = make_trainer(
        tool_model_dir,
        tmp_path,
        script,
        tok,
        tools=[multiply],
        train_dataset=datasets.Dataset.from_dict({"prompt": ["6 times 7?"] * 4}),
    )
    with pytest.raises(ValueError, match="need conversational prompts"):
        trainer.run.rollouts.sample()


def test_template_without_tool_support_fails_at_start(tmp_path, tok):
    from grouprl.demo.model import save_tiny_model

    path = save_tiny_model(tmp_path / "plain", seed=0, max_position_embeddings=1024)  # ChatML that drops tool calls
    with pytest.raises(ValueError, match="drops the tool name"):
        GRPOTrainer(
            model=path, reward_funcs=constant_reward, tools=[multiply], train_dataset=dataset(), args=config(tmp_path)
        )


def test_cli_tools_and_environment_factory(tool_model_dir, tmp_path, monkeypatch):
    """grouprl train --tools pkg.func --environment_factory pkg.Class: the
    environment's get_reward is the only reward."""
    import json

    from grouprl.cli import main

    (tmp_path / "my_agent.py").write_text(
        "class Tally:\n"
        "    def reset(self, **row):\n        self.n = 0\n        return None\n"
        "    def bump(self, k: int) -> int:\n        '''Add k.\n\n        Args:\n            k: amount\n        '''\n"
        "        self.n += k\n        return self.n\n"
        "    def get_reward(self):\n        return float(self.n)\n\n"
        "def double(x: int) -> int:\n    '''Double x.\n\n    Args:\n        x: a number\n    '''\n    return 2 * x\n"
    )
    monkeypatch.chdir(tmp_path)
    dataset(4).to_json(str(tmp_path / "train.jsonl"))
    out = tmp_path / "out"
    code = main(
        [
            "train",
            "--model_name_or_path",
            tool_model_dir,
            "--dataset_name",
            str(tmp_path / "train.jsonl"),
            "--tools",
            "my_agent.double",
            "--environment_factory",
            "my_agent.Tally",
            "--output_dir",
            str(out),
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "8",
            "--max_steps",
            "1",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    entry = json.loads(open(out / "metrics.jsonl").readline())
    assert entry["rewards/Tally/mean"] == 0.0 and "tools/call_frequency" in entry


def test_calculator_example_runs(tmp_path, monkeypatch):
    """examples/calculator_tool.py end to end at a toy size (the README numbers come from its defaults)."""
    import importlib.util
    import json
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "calculator_tool.py")
    spec = importlib.util.spec_from_file_location("calculator_tool", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.calculator("37*8") == "296" and example.calculator("(1+2)/4") == "0.75"
    with pytest.raises(ValueError, match="unsupported"):
        example.calculator("__import__('os')")
    tool_turn = [
        {"role": "assistant", "content": "", "tool_calls": [{}]},
        {"role": "tool", "content": "296"},
        {"role": "assistant", "content": "296"},
    ]
    assert example.final_answer_reward(
        [tool_turn, [{"role": "assistant", "content": "295"}], tool_turn[:2]], ["296"] * 3
    ) == [1.0, 0.0, 0.0]
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "calculator_tool.py",
            "--output_dir",
            str(tmp_path),
            "--pretrain_steps",
            "8",
            "--pretrain_batch",
            "8",
            "--max_steps",
            "1",
            "--prompts_per_step",
            "2",
            "--num_generations",
            "2",
            "--eval_rows",
            "4",
        ],
    )
    example.main()
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["grpo_steps"] == 1 and 0.0 <= summary["tool_use_rate_after"] <= 1.0
