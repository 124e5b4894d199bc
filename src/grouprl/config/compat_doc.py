"""The field table of docs/trl-compat.md: every GRPOConfig field and what grouprl does with it.

Rendered from ``GRPOConfig`` and the tables of ``training_arguments.py``; a test checks that the
committed document matches (regenerate it with the command in the marker comment).
"""

from __future__ import annotations

from typing import Any

from grouprl.config.grpo_config import NOT_YET_BUILT, GRPOConfig
from grouprl.config.training_arguments import compat_table

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
            status, note = "refused unless default", f"{not_yet_built[name][1]} is not built yet"
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
