"""MkDocs hook: links from the docs to files of the repository outside docs/.

The pages are written to read well on GitHub too, where `../examples/quickstart.yaml` or
`../benchmarks/study/e5/grad_share.png` are plain relative links. In the site, such a target that exists
in the repository is published under `_repo/` (images show, configs and scripts open as files); a
Markdown file outside docs/ (README.md, benchmarks/RESULTS.md) becomes its repository path in code type.
A target that does not exist is left alone, so that `mkdocs build --strict` fails on it.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
PREFIX = "_repo"
_targets: set[str] = set()


def _outside(page_src: str, target: str) -> str | None:
    """The repository-relative path of ``target`` (linked from docs page ``page_src``) when it lies
    outside docs/ and exists; else None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    rel = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_src), path))
    if rel.startswith("docs/") or rel.startswith(".."):
        return None
    return rel if (REPO / rel).exists() else None


def _rewrite(match: re.Match, page_src: str) -> str:
    bang, text, target = match.groups()
    rel = _outside(page_src, target)
    if rel is None:
        return match.group(0)
    if rel.endswith(".md") or (REPO / rel).is_dir():
        return f"{text} (`{rel}`)" if text.strip("`") != rel else f"`{rel}`"
    _targets.add(rel)
    up = "../" * page_src.count("/")
    return f"{bang}[{text}]({up}{PREFIX}/{rel})"


def on_config(config, **kwargs):
    global REPO
    REPO = Path(config["config_file_path"]).resolve().parent
    return config


def on_files(files, config, **kwargs):
    for page in [f for f in files if f.src_uri.endswith(".md")]:
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for match in LINK.finditer(text):
            rel = _outside(page.src_uri, match.group(3))
            if rel and not rel.endswith(".md") and (REPO / rel).is_file():
                _targets.add(rel)
    for rel in sorted(_targets):
        files.append(File.generated(config, f"{PREFIX}/{rel}", abs_src_path=str(REPO / rel)))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    return LINK.sub(lambda m: _rewrite(m, page.file.src_uri), markdown)
