"""mkdocs hook: renders GRPOConfig's field tables (type, default, help) into reference/grpo_config.md.

The tables come from ``dataclasses.fields(GRPOConfig)`` at build time (grouprl.config.compat_doc), so the
reference cannot fall behind the code. The page holds the marker below where the tables go.
"""

import sys
from pathlib import Path

MARKER = "<!-- grpo-config-fields -->"
# This checkout's src first, so the site documents the code next to it, not another installed grouprl.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    from grouprl.config.compat_doc import reference_markdown

    return markdown.replace(MARKER, reference_markdown())
