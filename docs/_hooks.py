"""MkDocs hook: links from a page to a file of the repository outside ``docs/`` (source code,
a distribution's README, an example config) must name a file that exists, or the build fails;
they become HTML links into the checkout, relative to the built page (``site/`` at the root),
which MkDocs leaves alone (it checks the links between pages itself)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    """Check and rewrite every ``[text](../path)`` link of ``page``."""
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    source = docs / page.file.src_path
    built = Path(config["site_dir"]).resolve() / page.file.dest_path

    def rewrite(match: re.Match[str]) -> str:
        text, path, anchor = match.groups()
        target = (source.parent / path).resolve()
        if root not in target.parents or not target.is_file():
            raise PluginError(f"{page.file.src_path}: the link {path} names no file")
        return f'<a href="{os.path.relpath(target, built.parent)}{anchor or ""}">{text}</a>'

    return LINK.sub(rewrite, markdown)
