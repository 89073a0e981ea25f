"""The docs site builds with `mkdocs build --strict`: a broken link, a page missing from the nav or an API
entry that no longer exists fails the test run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
pytest.importorskip("material")


def _build(tmp_path: Path, docs_dir: Path | None = None) -> subprocess.CompletedProcess:
    config = ROOT / "mkdocs.yml"
    if docs_dir is not None:  # the same config over a copy of the pages
        text = config.read_text().replace("docs_dir: docs", f"docs_dir: {docs_dir}")
        config = ROOT / f".mkdocs-test-{os.getpid()}.yml"
        config.write_text(text)
    try:
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                               "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=ROOT,
                              timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    finally:
        if docs_dir is not None:
            config.unlink()


def test_site_builds_strict(tmp_path):
    out = _build(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    assert (site / "getting-started" / "index.html").is_file() and (site / "config" / "index.html").is_file()
    api = (site / "api" / "index.html").read_text()
    assert "compute_advantages" in api and "register_workflow" in api
    # docstrings use one style the API page renders: no raw Sphinx roles (:func:`x`) on any page
    raw = {str(p.relative_to(site)): re.findall(r":(?:mod|func|class|meth|data|attr|exc|obj):(?:`|<code>)", p.read_text())
           for p in site.rglob("*.html")}
    assert {page: found[:3] for page, found in raw.items() if found} == {}
    # a repository file a page links to outside docs/ is published with the site
    assert (site / "_repo" / "benchmarks" / "study" / "e5" / "grad_share.png").is_file()


def test_every_page_is_in_the_nav():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nnav:\n")[1].join(["nav:\n", ""]))["nav"]

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)
    assert sorted(pages(nav)) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


def test_a_broken_link_fails_the_build(tmp_path):
    import shutil

    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    with open(docs / "data.md", "a") as f:
        f.write("\n[a page that is not there](no-such-page.md)\n")
    out = _build(tmp_path, docs)
    assert out.returncode != 0 and "no-such-page.md" in out.stdout + out.stderr


def test_docstrings_use_no_sphinx_roles():
    """The docstring style of src/ is Google style with ``code`` literals, which mkdocstrings renders; a Sphinx
    role (:func:`x`, :class:`y`) would show raw on the API page."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "src").rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r":(?:mod|func|class|meth|data|attr|exc|obj):`", line)]
    assert found == []
