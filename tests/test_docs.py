"""The README stays short (at most 250 lines), every ```python block in it runs as written (the
decoding example on the embedded model, shared with tests/models through the draftcert cache), and
every relative link in README.md and docs/*.md points to a file that exists (and, for `#anchor`
links into markdown, to a heading that exists); every file under tests/ opens with a docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

# [text](target) or ![alt](target); the target ends at whitespace or ')' (an optional "title" follows)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where brackets are not links."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> '-'."""
    h = re.sub(r"`", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    heads = [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", _prose(page.read_text()), re.M)]
    return {_slug(h) for h in heads}


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, https:, mailto: are not ours


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}); move detail to docs/"


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(heading above it, code) of every ```python block of a markdown page, in order; a block
    indented inside a list item is dedented, and a `#` line inside any fenced block is code."""
    blocks, heading, fence, code, is_python = [], "", None, [], False
    for line in text.splitlines(keepends=True):
        if fence is None:
            if FENCE.match(line):
                fence, code = line[: len(line) - len(line.lstrip())], []  # the fence's indent
                is_python = line.strip() in ("```python", "~~~python")
            elif re.match(r"^#{1,6}\s", line):
                heading = line.strip("# \n")
        elif FENCE.match(line) and line.strip() in ("```", "~~~"):
            if is_python:
                blocks.append((heading, "".join(code)))
            fence = None
        else:
            code.append(line[len(fence):] if line.startswith(fence) else line.lstrip())
    return blocks


README_BLOCKS = python_blocks((ROOT / "README.md").read_text())


def test_the_readme_has_its_python_examples():
    headings = [h for h, _ in README_BLOCKS]
    assert "In ten lines" in headings and "Decoding in Python" in headings, headings


def test_python_blocks_finds_every_block():
    page = ("# A\n```python\nx = 1\n```\n## B\n```bash\n# not a heading\nls\n```\n```python\ny = 2\n\nz = 3\n```\n"
            "* a list\n\n  ```python\n  w = 'inside a list item'\n  ```\n")
    assert python_blocks(page) == [("A", "x = 1\n"), ("B", "y = 2\n\nz = 3\n"), ("B", "w = 'inside a list item'\n")]


@pytest.mark.parametrize("heading,code", README_BLOCKS, ids=[h for h, _ in README_BLOCKS])
def test_readme_python_block_runs(heading, code, capsys):
    """Each block executed as a user would paste it (its own asserts included), in a fresh namespace.
    One torch thread: on a shared machine two spinning OpenMP threads made decoding 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(code, f"README.md ({heading})", "exec"), {"__name__": "__readme__"})
    except (RuntimeError, ValueError) as e:  # models.ModelUnavailable is a ValueError
        if "could not download" in str(e):  # as tests/models/test_embedded.py: no PyPI, no cached wheel
            pytest.skip(f"embedded model unavailable: {e}")
        raise
    finally:
        torch.set_num_threads(before)
    if heading == "Decoding in Python":  # it printed the text and the statistics
        out = capsys.readouterr().out
        assert "tokens per target forward" in out and out.strip().count("\n") >= 1


def _broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        for target in _relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no heading #{anchor})")
    return broken


def test_every_relative_link_resolves():
    broken = _broken_links(_pages())
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path):
    """The check can fail: a missing file and a missing heading are found; links inside code,
    absolute URLs and links that resolve are not reported."""
    (tmp_path / "other.md").write_text("# Other page\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](missing.md) [b](#nowhere) [c](#title) [d](https://x.org)\n"
                    "[g](other.md#other-page) [h](other.md#gone)\n"
                    "```\n[e](also-missing.md)\n```\n`[f](inline.md)`\n")
    assert _broken_links([page]) == [
        "page.md: missing.md (no such file)",
        "page.md: #nowhere (no heading #nowhere)",
        "page.md: other.md#gone (no heading #gone)",
    ]


def test_docs_pages_are_linked_from_the_readme():
    """Every page under docs/ can be reached from the README."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _relative_links(ROOT / "README.md")}
    orphans = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"docs pages not linked from README.md: {orphans}"


def test_every_test_file_says_what_it_checks():
    """Each module under tests/ opens with a docstring (what it checks, or what it provides)."""
    bare = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("*.py"))
            if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, f"test modules without a top docstring: {bare}"
