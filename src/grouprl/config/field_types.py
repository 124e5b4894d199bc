"""GRPOConfig's field types, checked when a config is built (in Python as on the command line).

``HfArgumentParser`` turns every command-line string into its field's type; a config built in Python gets no such
conversion, so ``learning_rate="fast"`` would pass and fail deep inside the optimizer, and ``beta="0.04"`` at the
first step. Every field typed ``int``, ``float`` or ``bool`` (or ``Optional`` of one) is checked here:

- a value of the right type passes (an ``int`` for a ``float`` field too, as Python allows);
- a string that reads as a value of the field's type (``"1e-5"``, ``"8"``, ``"true"``) is converted, with one
  warning per field: what the command line does, and what a YAML file gives for ``1e-5`` (YAML 1.1 reads it as a
  string), so a config loaded from YAML keeps working, while the warning says the value was not a number;
- anything else (``"fast"``, ``2.5`` for an integer, ``True`` for a number, a list) raises a ValueError naming the
  field, the value and the expected type.
"""

from __future__ import annotations

import functools
import numbers
import typing
from dataclasses import fields
from typing import Any

from transformers.utils import logging

logger = logging.get_logger("grouprl")

TRUE_STRINGS = ("true", "yes", "y", "1", "on")
FALSE_STRINGS = ("false", "no", "n", "0", "off")
_warned: set[str] = set()  # one conversion warning per field and process


@functools.lru_cache(maxsize=None)
def scalar_field_types(cls: type) -> dict[str, type]:
    """field name -> int, float or bool, for the fields of `cls` typed so (Optional[...] included)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be resolved: check the fields whose type is a class
        hints = {f.name: f.type for f in fields(cls)}
    found = {}
    for f in fields(cls):
        kind = hints.get(f.name)
        options = [t for t in typing.get_args(kind) if t is not type(None)] if typing.get_args(kind) else [kind]
        if f.init and len(options) == 1 and options[0] in (int, float, bool):
            found[f.name] = options[0]
    return found


def coerce_field_types(config: Any) -> None:
    """Check (and convert, see the module's doc) every int / float / bool field of `config`."""
    name_of = type(config).__name__
    for name, kind in scalar_field_types(type(config)).items():
        value = getattr(config, name)
        converted = _converted(value, kind)
        if converted is _REFUSED:
            raise ValueError(
                f"{name_of}.{name}={value!r} must be {_expected(kind)}, got {_described(value)}. "
                f"{_example(name, kind, type(config).__dataclass_fields__[name].default)}"
            )
        if converted is not value:
            if name not in _warned and not isinstance(value, (bool, numbers.Integral)):
                _warned.add(name)
                logger.warning(
                    f"{name_of}.{name}={value!r} is a {type(value).__name__}, not {_expected(kind)}; using "
                    f"{converted!r} (as the command line converts its flags). Pass {converted!r} to silence this."
                )
            setattr(config, name, converted)


_REFUSED = object()


def _converted(value: Any, kind: type) -> Any:
    """`value` as `kind`: itself when it already is one, a conversion, or _REFUSED."""
    if value is None:
        return value  # None is the default of every Optional field; transformers' own checks handle the others
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, numbers.Integral) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in TRUE_STRINGS + FALSE_STRINGS:
            return value.strip().lower() in TRUE_STRINGS
        return _REFUSED
    if isinstance(value, bool):
        return _REFUSED  # True is an int to Python, never a meant number
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return _REFUSED
        if kind is float:
            return number
        value = number
    if kind is float:
        return value if isinstance(value, numbers.Real) else _REFUSED
    if isinstance(value, numbers.Integral):
        return value
    if isinstance(value, numbers.Real) and float(value).is_integer():
        return int(value)
    return _REFUSED


def _expected(kind: type) -> str:
    return {int: "an integer", float: "a number (float)", bool: "a bool (True or False)"}[kind]


def _described(value: Any) -> str:
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"{type(value).__name__} {value!r}"


def _example(name: str, kind: type, default: Any) -> str:
    usual = default is not None and _converted(default, kind) is default
    example = repr(default) if usual else {int: "8", float: "0.5", bool: "True"}[kind]
    return f"Pass e.g. {name}={example} (on the command line: --{name} {example.lower()})."
