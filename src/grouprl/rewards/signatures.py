"""Whether a reward function can be called as TRL calls it: with every keyword argument it will get.

Checked when the trainer is built (`check_keywords`); a keyword known only at run time (a rollout_func's extra
field) is named by the same message when the call fails (scoring.py).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Sequence

# The keyword arguments every reward function gets, besides the dataset's columns (TRL's contract).
REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


def reward_name(fn: Any) -> str:
    """TRL's naming: __name__, partials unwrapped, class instances by class name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def unaccepted_keywords(fn: Any, names: Sequence[str], *, follow_wrapped: bool = False) -> list[str]:
    """The keyword arguments among `names` that `fn` cannot take: [] when it takes ``**kwargs``, or when its signature
    cannot be read (a builtin, some C extensions). `follow_wrapped`: read the signature of the function a decorator
    (functools.wraps) wraps instead of the decorator's own, which may pass on only what the function takes."""
    try:
        parameters = inspect.signature(fn, follow_wrapped=follow_wrapped).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return []
    accepted = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [name for name in names if name not in accepted]


def keywords_message(fn: Any, name: str, missing: Sequence[str]) -> str:
    """Why a reward function cannot be called as TRL calls it, and the fix (add ``**kwargs``)."""
    try:
        shown = [str(p) for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    except (TypeError, ValueError):
        shown = []
    example = f" (e.g. def {name}({', '.join(shown + ['**kwargs'])}): ...)" if name.isidentifier() else ""
    return (
        f"Reward function '{name}' does not accept the keyword argument(s) {', '.join(map(repr, missing))}, which it "
        "will be called with: every reward function gets prompts, completions, completion_ids, trainer_state, "
        "log_metric, log_extra and the dataset's columns as keyword arguments (TRL's contract). Add **kwargs to its "
        f"parameters{example} to take the ones it does not use."
    )


def check_keywords(fn: Any, names: Sequence[str], where: str = "reward_funcs") -> None:
    """Refuse, when the trainer is built, a reward function that cannot take every keyword in `names`."""
    missing = unaccepted_keywords(fn, names)
    if missing:
        raise TypeError(f"{where}: {keywords_message(fn, reward_name(fn), missing)}")
