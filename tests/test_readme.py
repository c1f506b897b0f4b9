"""The Python snippets of README.md and docs/*.md run as written (each block in a fresh namespace), and every
relative link of those pages (and of the generated pages at the root) resolves to a file and, with ``#anchor``,
to a heading of it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), i, code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]
# pages whose links are checked: the docs, and the generated reports at the root (BENCHMARKS.md, MODELS.md, ...)
LINK_PAGES = sorted({*PAGES, *ROOT.glob("*.md")})
# pages a make target generates (`--md PATH` in the Makefile): a link to one is right before it is first generated
GENERATED = {(ROOT / p).resolve() for p in re.findall(r"--md\s+(\S+)", (ROOT / "Makefile").read_text())}
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_readme_has_python_examples():
    assert any(page == "README.md" for page, _, _ in BLOCKS), "README.md shows no ```python blocks"


@pytest.mark.parametrize("page, index, code", BLOCKS, ids=[f"{page}-block{i}" for page, i, _ in BLOCKS])
def test_readme_block_runs(page, index, code, capsys):
    if "# readme-test: skip" in code:
        pytest.skip("block marked '# readme-test: skip': it needs a launcher (torchrun) or several processes")
    if "from transformers" in code or "import transformers" in code:
        pytest.importorskip("transformers", reason="this block needs the hf extra (transformers)")
    exec(compile(code, f"{page} block {index}", "exec"), {"__name__": "__readme__"})


def prose(text: str, spans: bool = False) -> str:
    """``text`` without fenced code blocks, and without inline code spans unless ``spans`` (links in code are
    not links; a heading's code span is part of its anchor)."""
    kept, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)
        elif fence is not None and marker and marker.group(1).startswith(fence):
            fence = None
        elif fence is None:
            kept.append(line if spans else re.sub(r"(`+).+?\1", "", line))
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a Markdown page: its headings' (duplicates numbered as GitHub does) and explicit ids."""
    text = page.read_text()
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(text, spans=True), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[tuple[str, Path | None, str]]:
    """(link as written, target file or None for this page, anchor) of every relative link of ``page``."""
    found = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found.append((target, (page.parent / path).resolve() if path else None, anchor))
    return found


def test_link_checker_sees_links_and_anchors(tmp_path):
    """The checker itself: a link in a code span or block is not a link; anchors follow GitHub's rule."""
    page = tmp_path / "p.md"
    page.write_text("# Top\n\n## The vision tower's cost: `x.y` K/V\n\n## Top\n\n[a](q.md#z) `[b](no.md)`\n\n"
                    "```\n[c](no.md)\n```\n")
    assert anchors(page) == {"top", "the-vision-towers-cost-xy-kv", "top-1"}
    assert links(page) == [("q.md#z", tmp_path / "q.md", "z")]


@pytest.mark.parametrize("page", LINK_PAGES, ids=[p.relative_to(ROOT).as_posix() for p in LINK_PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target, path, anchor in links(page):
        file = path or page
        if not file.exists():
            if file not in GENERATED:
                broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_docs_index_lists_every_page():
    index = ROOT / "docs" / "README.md"
    listed = {path for _, path, _ in links(index) if path is not None}
    missing = [p.name for p in PAGES if p.parent == index.parent and p != index and p not in listed]
    assert not missing, f"docs/README.md does not link {missing}"
