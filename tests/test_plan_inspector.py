"""python -m verify plan: byte counts in the unit that shows them (a rank receiving 512 bytes does not read 0.000 MiB)."""

import argparse

import pytest

from verify.inspect_plan import _bytes, main


@pytest.mark.parametrize("n, want", [
    pytest.param(None, "-", id="none"), pytest.param(0, "0 B", id="zero"), pytest.param(512, "512 B", id="bytes"),
    pytest.param(1023, "1023 B", id="below-KiB"), pytest.param(2048, "2.00 KiB", id="KiB"),
    pytest.param(24576, "24.0 KiB", id="tens-of-KiB"), pytest.param(5 * 2**20 // 2, "2.50 MiB", id="MiB"),
    pytest.param(3 * 2**30, "3.00 GiB", id="GiB"), pytest.param(2**50, "1048576.0 GiB", id="huge"),
])
def test_bytes_unit(n, want):
    assert _bytes(n) == want


def test_readme_plan_shows_every_rank_bytes(capsys):
    args = argparse.Namespace(seqlens="5,2,5", pad=4, rows=None, cp=4, window=-1, layout="contiguous", heads="8:2",
                              dim=64, dtype="bfloat16", json=None)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "512 B" in out and "2.00 KiB" in out and "MiB" not in out, out
