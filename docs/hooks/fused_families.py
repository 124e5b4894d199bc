"""mkdocs hook: renders generation/fused_step.py's FAMILIES table where a page holds the marker below, so the docs'
list of the hand-written step's model types is the code's."""

import sys
from pathlib import Path

MARKER = "<!-- fused-step-families -->"
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # this checkout's grouprl, not an installed one


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    from grouprl.generation.fused_step import FAMILIES, Family

    flags = [name for name in Family._fields if name not in ("cpu", "gpu")]
    lines = ["| model type | CPU engine | captured loop | " + " | ".join(flags) + " |", "|---" * (3 + len(flags)) + "|"]
    for model_type, row in FAMILIES.items():
        cells = [row.cpu or "its forward", row.gpu or "its forward", *("yes" if getattr(row, f) else "" for f in flags)]
        lines.append(f"| `{model_type}` | " + " | ".join(cells) + " |")
    return markdown.replace(MARKER, "\n".join(lines))
