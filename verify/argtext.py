"""Parsing the command lines' comma-separated values (``--cp 1,2,4``, ``--layouts a,b``), shared by every CLI."""

from __future__ import annotations

__all__ = ["csv_list"]


def csv_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: the items of a comma-separated option, blanks dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]
