"""The README's Python snippets run as written (each block in a fresh namespace)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_examples():
    assert BLOCKS, "README.md shows no ```python blocks"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(index, capsys):
    code = BLOCKS[index]
    if "# readme-test: skip" in code:
        pytest.skip("block marked '# readme-test: skip': it needs a launcher (torchrun) or several processes")
    if "from transformers" in code or "import transformers" in code:
        pytest.importorskip("transformers", reason="this block needs the hf extra (transformers)")
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "__readme__"})
