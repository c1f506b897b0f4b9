"""The Python snippets of README.md and docs/*.md run as written (each block in a fresh namespace)."""

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


def test_readme_has_python_examples():
    assert any(page == "README.md" for page, _, _ in BLOCKS), "README.md shows no ```python blocks"


@pytest.mark.parametrize("page, index, code", BLOCKS, ids=[f"{page}-block{i}" for page, i, _ in BLOCKS])
def test_readme_block_runs(page, index, code, capsys):
    if "# readme-test: skip" in code:
        pytest.skip("block marked '# readme-test: skip': it needs a launcher (torchrun) or several processes")
    if "from transformers" in code or "import transformers" in code:
        pytest.importorskip("transformers", reason="this block needs the hf extra (transformers)")
    exec(compile(code, f"{page} block {index}", "exec"), {"__name__": "__readme__"})
