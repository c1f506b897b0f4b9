"""The benchmark report's goals table: each figure, its goal and the bound the same run measures."""

from __future__ import annotations

import pytest

from bench.report import goal_figures, goals_table


def _res() -> dict:
    mode = lambda s, x: {"seconds": s, "exchange_seconds": x, "speedup_over_allgather": 2.0 / s}  # noqa: E731
    return {
        "peers": {"rows": [{"workload": "one-doc", "single_seconds": [4.2, 4.0, 4.1], "configs": {
            "blockdiag auto": {"median_seconds": 4.5, "median_ratio": 1.1},
            "ring-attention-pytorch": {"median_seconds": 20.5},
        }}]},
        "exchange": {"rows": [{"cp": 4, "S": 32768, "modes": {"allgather": mode(2.0, 0.5), "halo": mode(1.6, 0.1)}}]},
    }


def test_bounds_come_from_the_same_run():
    figures = {key: (value, bound) for key, _, value, bound in goal_figures(_res())}
    # ring / auto, bounded by ring / single device (median of the rounds: 4.1 s)
    assert figures["ring_over_auto_one_doc"] == (pytest.approx(20.5 / 4.5), pytest.approx(20.5 / 4.1))
    # needed-only speedup, bounded by the all-gather step without its exchange
    assert figures["needed_only_speedup_cp4"] == (pytest.approx(2.0 / 1.6), pytest.approx(2.0 / 1.5))
    assert figures["cp2_one_doc_auto_over_single"] == (1.1, None)


def test_goals_table_shows_goal_and_bound():
    title, header, rows = goals_table(_res())
    assert header == ["figure", "measured", "goal", "bound on this machine"]
    ring = next(r for r in rows if r[0].startswith("ring-attention"))
    assert ring[1:] == [f"{20.5 / 4.5:.2f}x", "NOT met (>= 7.00x)", f"{20.5 / 4.1:.2f}x"]
    assert next(r for r in rows if r[0].startswith("CP 2 one"))[2:] == ["met (<= 1.10x)", "-"]
    assert goals_table({}) is None
