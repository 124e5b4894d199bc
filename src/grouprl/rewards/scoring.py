"""Calling reward functions with TRL's contract, and checking what they return.

Contract (TRL 1.16 §2.5): every reward function is called with keyword arguments ``prompts``,
``completions``, ``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric`` and every
extra dataset column, each a per-completion list, and returns one value per completion: a number,
or ``None`` for "not applicable" (stored as NaN and left out of sums and means); ``True`` / ``False`` count as
1.0 / 0.0, as in TRL. A function that cannot take every keyword argument it will get (no ``**kwargs``) is
refused when the trainer is built (signatures.py).

Concurrency: async reward functions (coroutine functions, partials of them, objects with
``async __call__``) run concurrently on a background event loop; meanwhile the sync ones run
concurrently too, the first in the calling thread and the others in worker threads, so a slow
checker or a reward model does not serialise the others. (TRL runs sync functions one after the
other.) A function that fails in a worker thread is retried in the calling thread and, if it works
there (code that is not thread-safe, e.g. signal-based timeouts), stays there from then on.
Results are put back in the order of ``reward_funcs``. A function that raises,
returns the wrong count, a non-number or NaN stops the run with a `RewardFunctionError` naming the
function and the first offending row.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from transformers.utils import logging

from grouprl.rewards.signatures import REWARD_KEYWORDS, keywords_message, reward_name, unaccepted_keywords

logger = logging.get_logger("grouprl")

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardFunctionError(ValueError):
    """A reward function failed or returned something that is not one number (or None) per completion."""


@dataclass
class RewardFunction:
    fn: Callable[..., Any]
    name: str
    is_async: bool
    main_thread_only: bool = False  # set once the function failed in a worker thread but works in the main one
    timeout: Optional[float] = None  # GRPOConfig.reward_timeout: seconds one call may take


def _is_async(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    # a callable object counts as async when its __call__ is a coroutine function
    call = fn.__call__ if callable(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def prepare_reward_functions(reward_funcs: Any, timeout: Optional[float] = None) -> list[RewardFunction]:
    """Validate the user's reward_funcs (one or a list) and wrap them with their names (and the calls' timeout)."""
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if len(funcs) == 0:
        raise ValueError("GRPOTrainer needs at least one reward function in reward_funcs.")
    prepared = []
    for i, fn in enumerate(funcs):
        if isinstance(fn, (str, torch.nn.Module)):
            raise TypeError(
                f"reward_funcs[{i}] is a reward model ({fn if isinstance(fn, str) else type(fn).__name__}); load it "
                "first with grouprl.rewards.models.load_reward_functions (GRPOTrainer does this for you)."
            )
        if not callable(fn):
            raise TypeError(
                f"reward_funcs[{i}] is a {type(fn).__name__}, not a callable; pass a function f(prompts, completions, "
                "**kwargs) -> list[float]."
            )
        prepared.append(RewardFunction(fn=fn, name=reward_name(fn), is_async=_is_async(fn), timeout=timeout))
    return prepared


class _BackgroundLoop:
    """One daemon thread running an asyncio loop, shared by all async reward functions."""

    _loop: Optional[asyncio.AbstractEventLoop] = None
    _lock = threading.Lock()

    @classmethod
    def run(cls, coroutine: Any) -> Any:
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="grouprl-rewards", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, cls._loop)


def score_completions(
    functions: Sequence[RewardFunction],
    *,
    prompts: list[Any],  # (N,)
    completions: list[Any],  # (N,)
    completion_ids: list[list[int]],  # (N,)
    columns: dict[str, list[Any]],  # each (N,)
    trainer_state: Any = None,
    log_metric: Optional[Callable[[str, float], None]] = None,
    log_extra: Optional[Callable[[str, list], None]] = None,
) -> torch.Tensor:
    """Call every reward function once on all N completions; return (N, F) float32 with NaN for None."""
    n = len(completions)
    lock = threading.Lock()  # functions in several threads may log at once

    def locked(callback: Optional[Callable]) -> Callable:
        def call(*args: Any) -> None:
            if callback is not None:
                with lock:
                    callback(*args)

        return call

    kwargs = dict(columns)
    kwargs.update(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        trainer_state=trainer_state,
        log_metric=locked(log_metric),
        log_extra=locked(log_extra),
    )
    async_indices = [i for i, f in enumerate(functions) if f.is_async]
    sync_indices = [i for i, f in enumerate(functions) if not f.is_async]

    async def gather_async() -> list[Any]:
        return await asyncio.gather(*(functions[i].fn(**kwargs) for i in async_indices), return_exceptions=True)

    def call_sync(index: int) -> Any:
        try:
            return functions[index].fn(**kwargs)
        except Exception as err:  # noqa: BLE001 - reported below with the failing row
            return _Failure(err)

    pending = _BackgroundLoop.run(gather_async()) if async_indices else None
    outputs: dict[int, Any] = {}
    timeout = functions[0].timeout if functions else None
    # in the calling thread: what must run there, else (without a timeout, which needs the call elsewhere) the first
    here = [i for i in sync_indices if functions[i].main_thread_only] or ([] if timeout else sync_indices[:1])
    elsewhere = [i for i in sync_indices if i not in here]
    started, running = time.monotonic(), _Running({f.name for f in functions})
    watchdog = threading.Timer(SLOW_CALL_S, running.warn, args=(n,))
    watchdog.daemon = True
    watchdog.start()

    def tracked(index: int) -> Any:
        try:
            return call_sync(index)
        finally:
            running.done(functions[index].name)

    try:
        futures = {i: _in_daemon_thread(tracked, i) for i in elsewhere}
        outputs.update({i: tracked(i) for i in here})
        outputs.update({i: _result(future, functions[i], started, n) for i, future in futures.items()})
        results = _result(pending, functions[async_indices[0]], started, n, async_indices) if pending else []
    finally:
        watchdog.cancel()
    for i in elsewhere:
        if isinstance(outputs[i], _Failure):
            # Code that is not thread-safe (signal-based timeouts such as math-verify's defaults, shared
            # tokenizers, ...) works in the main thread, as it would in TRL: retry there, and keep it there.
            outputs[i] = call_sync(i)
            if not isinstance(outputs[i], _Failure):
                functions[i].main_thread_only = True
                logger.warning(
                    "Reward function '%s' failed in a worker thread but works in the main thread; it runs there from "
                    "now on (in sequence with the other sync reward functions).",
                    functions[i].name,
                )
    if pending is not None:
        for index, result in zip(async_indices, results):
            outputs[index] = _Failure(result) if isinstance(result, Exception) else result
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
    for index, f in enumerate(functions):  # the first failing function in reward_funcs order
        if isinstance(outputs[index], _Failure):
            error = outputs[index].error
            raise _locate_failure(f, kwargs, n, error) from error

    scores = torch.empty((n, len(functions)), dtype=torch.float32)
    for index, f in enumerate(functions):
        scores[:, index] = _check_output(f.name, outputs[index], n, prompts)
    _warn_unscorable(scores, kwargs)
    return scores


SLOW_CALL_S = 300.0  # a reward call still running this long is named in a warning (reward_timeout unset)


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """fn(*args) in a daemon thread: one that hangs past reward_timeout cannot keep the process from exiting."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(err)

    threading.Thread(target=run, name="grouprl-reward", daemon=True).start()
    return future


def _result(future: Any, f: RewardFunction, started: float, n: int, async_indices: Optional[list[int]] = None) -> Any:
    """The call's result, waiting at most until reward_timeout seconds after the scoring started."""
    if f.timeout is None:
        return future.result()
    try:
        return future.result(timeout=max(0.0, started + f.timeout - time.monotonic()))
    except FutureTimeout:
        future.cancel()
        which = "the async reward functions" if async_indices else f"Reward function '{f.name}'"
        raise RewardFunctionError(
            f"{which} did not return within reward_timeout={f.timeout:g} s on a batch of {n} completions (a hung "
            "HTTP call, sandbox or judge?). Give its own calls a timeout, or raise GRPOConfig.reward_timeout."
        ) from None


class _Running:
    """The reward functions of one scoring call not finished yet, for the slow-call warning (read from a timer)."""

    def __init__(self, names: set[str]):
        self.names, self.lock = names, threading.Lock()

    def done(self, name: str) -> None:
        with self.lock:
            self.names.discard(name)

    def warn(self, n: int) -> None:
        with self.lock:
            names = sorted(self.names)
        if names:
            logger.warning(
                f"grouprl: reward function(s) {', '.join(names)} still running after {SLOW_CALL_S:g} s on a batch of "
                f"{n} completions; with no reward_timeout set the run waits for them. Set GRPOConfig.reward_timeout "
                "to stop a run whose reward hangs (the last step is saved then)."
            )


# Arguments that are not the row's data, left out of the unscorable-row warning (as TRL does).
NOT_ROW_DATA = REWARD_KEYWORDS


def _warn_unscorable(scores: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """TRL's warning when no reward function scored a completion, showing the first such row's arguments."""
    unscorable = torch.isnan(scores).all(dim=1)
    count = int(unscorable.sum())
    if not count:
        return
    row, n = int(unscorable.nonzero()[0]), len(scores)
    shown = {k: v[row] for k, v in kwargs.items() if k not in NOT_ROW_DATA and isinstance(v, list) and len(v) == n}
    shown.update(prompt=kwargs["prompts"][row], completion=kwargs["completions"][row])
    logger.warning(
        "All reward functions returned None for the following kwargs: %s\n%d of %d completions got no reward from any "
        "function; they get advantage 0 and are left out of their group's mean and std. Make sure at least one reward "
        "function returns a number for every completion.",
        "{" + ", ".join(f"{k!r}: {_short(v, 200)}" for k, v in shown.items()) + "}",
        count,
        n,
    )


@dataclass(frozen=True)
class _Failure:
    error: Exception


def _check_output(name: str, values: Any, n: int, prompts: list[Any]) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    elif hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy arrays
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(
            f"Reward function '{name}' returned {type(values).__name__}; it must return a list with one number (or "
            f"None) per completion ({n} here)."
        )
    if len(values) != n:
        raise RewardFunctionError(
            f"Reward function '{name}' returned {len(values)} values for {n} completions; it must return exactly one "
            "value per completion (None if it does not apply)."
        )
    result = torch.empty(n, dtype=torch.float32)
    for row, value in enumerate(values):
        if value is None:
            result[row] = float("nan")
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (bool, np.bool_)):  # TRL: True / False are 1.0 / 0.0 (e.g. [c == a for ...])
            result[row] = float(value)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"Reward function '{name}' returned {value!r} ({type(value).__name__}) for row {row} "
                f"(prompt: {_short(prompts[row])}); rewards must be numbers or None."
            )
        if not math.isfinite(float(value)) or abs(float(value)) > FLOAT32_MAX:  # rewards are stored as float32
            raise RewardFunctionError(
                f"Reward function '{name}' returned {value} for row {row} (prompt: {_short(prompts[row])}); "
                "rewards must be finite float32 numbers (|reward| <= 3.4e38). Return None if the function does not "
                "apply to a completion."
            )
        result[row] = float(value)
    return result


def _locate_failure(f: RewardFunction, kwargs: dict[str, Any], n: int, err: Exception) -> RewardFunctionError:
    """Re-run the failing function one row at a time to name the first row that raises (a function that cannot take
    its keyword arguments fails on every row: that is said instead)."""
    missing = unaccepted_keywords(f.fn, list(kwargs), follow_wrapped=True)
    if isinstance(err, TypeError) and missing:
        return RewardFunctionError(f"{keywords_message(f.fn, f.name, missing)} ({type(err).__name__}: {err})")
    per_row_keys = [k for k, v in kwargs.items() if isinstance(v, list) and len(v) == n]
    for row in range(n):
        row_kwargs = {k: ([v[row]] if k in per_row_keys else v) for k, v in kwargs.items()}
        try:
            result = f.fn(**row_kwargs)
            if f.is_async:
                _BackgroundLoop.run(result).result()
        except Exception as row_err:  # noqa: BLE001
            return RewardFunctionError(
                f"Reward function '{f.name}' raised {type(row_err).__name__}: {row_err} on row {row} "
                f"(prompt: {_short(kwargs['prompts'][row])}, completion: {_short(kwargs['completions'][row])})."
            )
    return RewardFunctionError(
        f"Reward function '{f.name}' raised {type(err).__name__}: {err} (on the batch of {n} completions)."
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
