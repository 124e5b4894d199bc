"""GRPOConfig's fields as documentation: the table of docs/trl-compat.md and the API reference's tables.

The compatibility table is rendered from ``GRPOConfig`` and the tables of ``training_arguments.py``; a test
checks that the committed document matches (regenerate it with the command in the marker comment). The
reference tables (type, default, help of every field) are rendered when the docs site is built
(docs/hooks/config_reference.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from transformers import TrainingArguments

from grouprl.config.grpo_config import NOT_YET_BUILT, GRPOConfig
from grouprl.config.grpo_fields import AsyncGenerationFields, LossAndLoggingFields, ModelAndSamplingFields
from grouprl.config.training_arguments import compat_table


def _names(cls: Any) -> frozenset[str]:
    return frozenset(spec.name for spec in dataclasses.fields(cls))


ASYNC_FIELDS = _names(AsyncGenerationFields)

# Fields TRL 1.16's GRPOConfig does not have (besides the asynchronous-generation ones, all grouprl's).
EXTENSIONS = frozenset(
    {
        "generation_engine",
        "compile_decode_step",
        "generation_server_retries",
        "generation_server_weight_transfer",
        "pack_shared_prompts",
        "keep_freed_host_memory",
        "loss_kwargs",
        "advantage_estimator",
        "dynamic_sampling",
        "max_dynamic_sampling_rounds",
        "bf16_from_default",
        "save_failure",
        "reward_timeout",
    }
    | ASYNC_FIELDS
)

TABLE_BEGIN = (
    "<!-- fields:begin (generated: python -c "
    "\"from grouprl.config.compat_doc import rewrite_doc; rewrite_doc('docs/trl-compat.md')\") -->"
)
TABLE_END = "<!-- fields:end -->"


def compat_markdown(config_cls: Any, not_yet_built: dict[str, Any]) -> str:
    """The field table of docs/trl-compat.md."""
    lines = ["| field | status | what grouprl does |", "|---|---|---|"]
    for name, status, note in compat_table(config_cls):
        if name in not_yet_built:
            status, note = "not built yet", f"{not_yet_built[name][1]}: refused unless left at its default"
        elif name in EXTENSIONS:
            status = "grouprl extension"
        lines.append(f"| `{name}` | {status} | {note.replace('|', '/')} |")
    return "\n".join(lines)


def rewrite_doc(path: str) -> bool:
    """Replace the table between the markers in `path`; True if it changed."""
    text = open(path, encoding="utf-8").read()
    head, _, rest = text.partition(TABLE_BEGIN)
    _, _, tail = rest.partition(TABLE_END)
    updated = f"{head}{TABLE_BEGIN}\n{compat_markdown(GRPOConfig, NOT_YET_BUILT)}\n{TABLE_END}{tail}"
    if updated != text:
        open(path, "w", encoding="utf-8").write(updated)
    return updated != text


# (title, what the section holds) of the reference's field tables, in page order.
SECTIONS = (
    ("Training", "inherited from `transformers.TrainingArguments`, with TRL's GRPO defaults"),
    ("Model and sampling", "TRL's GRPO fields: model loading, generation, vLLM, the sampler correction"),
    ("Loss, rewards, logging and tools", "TRL's GRPO fields"),
    ("grouprl extensions", "fields TRL does not have"),
    ("Asynchronous generation", "grouprl: a generation worker in its own process"),
)


# Which fields each section lists, checked in this order (the first match wins: extensions before their base).
_SECTION_FIELDS = (
    ("Asynchronous generation", ASYNC_FIELDS),
    ("grouprl extensions", EXTENSIONS),
    ("Training", _names(TrainingArguments)),
    ("Model and sampling", _names(ModelAndSamplingFields)),
    ("Loss, rewards, logging and tools", _names(LossAndLoggingFields)),
)


def field_section(name: str) -> str:
    """The reference section a GRPOConfig field is listed under."""
    for title, names in _SECTION_FIELDS:
        if name in names:
            return title
    raise ValueError(f"GRPOConfig field {name!r} belongs to no reference section; add it to compat_doc.py.")


def type_name(annotation: Any) -> str:
    """A field's annotation as a reader writes it: `int`, `Optional[str]`, `OptimizerNames | str`."""
    if isinstance(annotation, str):
        text = annotation
    elif isinstance(annotation, type):
        text = annotation.__name__
    else:
        text = str(annotation)
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", text)  # a class by its name: ParallelismConfig, not its module path


def default_text(spec: dataclasses.Field) -> str:
    if spec.default is not dataclasses.MISSING:
        value = spec.default
    elif spec.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = spec.default_factory()  # type: ignore[misc]
    else:
        return "required"
    return repr(getattr(value, "value", value))  # enums (SchedulerType, ...) by the value a user writes


def _cell(text: str, code: bool = False) -> str:
    # Markdown tables split rows at "|" except inside a code span, where an escape would show as a backslash.
    text = " ".join(text.split())
    return f"`{text}`" if code else text.replace("|", "\\|")


def reference_markdown(config_cls: Any = GRPOConfig) -> str:
    """Every field of `config_cls` with its type, default and help, one table per section."""
    rows: dict[str, list[str]] = {title: [] for title, _ in SECTIONS}
    for spec in dataclasses.fields(config_cls):
        if not spec.init:
            continue
        help_text = (spec.metadata or {}).get("help", "")
        rows[field_section(spec.name)].append(
            f"| `{spec.name}` | {_cell(type_name(spec.type), code=True)} | {_cell(default_text(spec), code=True)} "
            f"| {_cell(help_text)} |"
        )
    parts = []
    for title, about in SECTIONS:
        parts += [f"## {title}", "", f"{len(rows[title])} fields, {about}.", ""]
        parts += ["| field | type | default | meaning |", "|---|---|---|---|", *rows[title], ""]
    return "\n".join(parts)
