"""Environments: per-rollout objects whose public methods are the model's tools (TRL §5).

``environment_factory`` is a callable returning an environment, or a dict name -> callable; in
the dict form each dataset row picks its environment by its ``environment`` column, and only that
environment's tools appear in its prompt. An environment has

* ``reset(**row) -> str | None``: called once per rollout with the dataset row (the ``environment``
  column left out); a string is appended to the prompt's last message;
* public methods (no leading underscore): tools bound to that rollout's instance;
* optionally ``get_reward()`` (sync or async): an extra reward function, named after the class,
  weight 1, scoring the rollouts of exactly that class and None for the others.

Instances are pooled: one is made per environment at start-up (to read its tools) and more only
when a generation needs more rollouts of that environment at once; they are reset and reused.
The environment may own the data: dataset rows need no ``prompt`` (a dict factory's dataset may
hold only the ``environment`` column), and without a dataset at all (single factory) the rows are
placeholders; either way the prompt is an empty user message that ``reset()`` fills, and without a
dataset ``max_steps`` sets the length of training.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import datasets

from grouprl.agents.tools import Tool, make_tools

ENVIRONMENT_COLUMN = "environment"
EMPTY_PROMPT = [{"role": "user", "content": ""}]  # the prompt of a row without one; reset() appends the task to it
SPECIAL_METHODS = ("reset", "get_reward")


class Environments:
    """The factories, their pools of instances, and each environment's tools."""

    def __init__(self, environment_factory: Any, standalone_tools: list[Tool]):
        self.multi = isinstance(environment_factory, dict)
        self.factories: dict[Optional[str], Callable[[], Any]] = (
            environment_factory if self.multi else {None: environment_factory}
        )
        if not self.factories:
            raise ValueError("environment_factory is an empty dict; map at least one environment name to a factory.")
        self.pools: dict[Optional[str], list[Any]] = {}
        self.tools: dict[
            Optional[str], list[Tool]
        ] = {}  # per environment: standalone tools + its methods (schemas for prompts)
        self.reward_functions: list[Callable[..., Any]] = []
        self.latest: Optional[list[Any]] = None  # the instances of the latest checkout, in rollout order
        rewarded: list[type] = []
        for name, factory in self.factories.items():
            label = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            if not callable(factory):
                raise TypeError(
                    f"{label} must be callable (a class or a function returning an environment), got "
                    f"{type(factory).__name__}."
                )
            instance = factory()
            if not callable(getattr(instance, "reset", None)):
                raise TypeError(
                    f"{label} returned a {type(instance).__name__}, which has no reset() method; every environment "
                    "needs one."
                )
            self.tools[name] = standalone_tools + make_tools(public_methods(instance), where=f"{label} methods")
            clashes = sorted(
                {t.name for t in standalone_tools} & {t.name for t in self.tools[name][len(standalone_tools) :]}
            )
            if clashes:
                raise ValueError(
                    f"{label}: methods {clashes} have the names of tools passed in tools=; rename one of them."
                )
            self.pools[name] = [instance]
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in rewarded:
                rewarded.append(type(instance))
                self.reward_functions.append(environment_reward(type(instance)))

    def route(self, names: list[Any], rows: list[int]) -> None:
        """Check that every row's environment name is known (dict mode)."""
        for name, row in zip(names, rows):
            if name not in self.factories:
                raise ValueError(
                    f"Row {row} has environment={name!r}, which is not among the environments passed to "
                    f"environment_factory: {[n for n in self.factories]}. (With remove_unused_columns=True the "
                    "'environment' column is dropped; keep it.)"
                )

    def checkout(self, names: list[Optional[str]], fresh: bool = False) -> list[Any]:
        """One instance per rollout (names[i] = its environment), reusing pooled
        instances and growing pools as needed. `fresh`: new instances, not pooled (asynchronous
        generation: earlier rollouts' instances may still wait to be scored)."""
        if fresh:
            self.latest = [self.factories[name]() for name in names]
            return self.latest
        handed: dict[Optional[str], int] = {}
        instances = []
        for name in names:
            pool, index = self.pools[name], handed.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed[name] = index + 1
            instances.append(pool[index])
        self.latest = instances
        return instances


def public_methods(instance: Any) -> list[Callable[..., Any]]:
    """Bound public methods of an environment that become tools (reset and get_reward excluded)."""
    # Listed on the class: inspecting the instance would evaluate its properties.
    names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)]
    return [getattr(instance, n) for n in names if not n.startswith("_") and n not in SPECIAL_METHODS]


def environment_reward(env_type: type) -> Callable[..., Any]:
    """A reward function calling get_reward() on the rollouts of exactly `env_type`; None for the others."""
    if inspect.iscoroutinefunction(env_type.get_reward):

        async def reward(environments: list[Any], **kwargs: Any) -> list[Optional[float]]:
            return [await e.get_reward() if type(e) is env_type else None for e in environments]
    else:

        def reward(environments: list[Any], **kwargs: Any) -> list[Optional[float]]:
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    reward.__name__ = reward.__qualname__ = env_type.__name__
    return reward


def environment_dataset(
    train_dataset: Any, environments: Optional[Environments], *, max_steps: int, prompts_per_generation: int
) -> Any:
    """The dataset to train on: the user's, or, when the environment owns the
    data, placeholder rows of empty prompts."""
    if train_dataset is not None or environments is None:
        return train_dataset
    if environments.multi:
        raise ValueError(
            "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
            "`environment` column naming each row's environment (rows need no 'prompt': reset() supplies it). "
            "Pass such a dataset, or a single environment factory."
        )
    if max_steps <= 0:
        raise ValueError(
            "Without a train_dataset the environment owns the data (reset() supplies each prompt), so "
            "GRPOConfig.max_steps must be set (> 0) to say how long to train."
        )
    return datasets.Dataset.from_dict({"prompt": [EMPTY_PROMPT] * prompts_per_generation})
