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


def test_the_vision_figure_is_judged_at_most_its_goal():
    res = {"vision": {"cp": 2, "images": 8, "patches": 2816, "seconds": {"replicated": 5.0, "sharded": 2.5},
                      "loss": {"replicated": 1.5, "sharded": 1.5}, "sharded_over_replicated": 0.5}}
    figures = {key: (value, bound) for key, _, value, bound in goal_figures(res)}
    assert figures["vision_shard_over_replicated_cp2"] == (0.5, None)
    row = next(r for r in goals_table(res)[2] if r[0].startswith("CP 2 vision-language"))
    assert row[1:3] == ["0.50x", "met (<= 0.60x)"]
    res["vision"]["sharded_over_replicated"] = 0.7
    assert next(r for r in goals_table(res)[2] if r[0].startswith("CP 2 vision"))[2] == "NOT met (<= 0.60x)"


def test_the_figure_draws_a_run_with_attention_variants(tmp_path):
    """The variants section is a table: the figure of a run that has it draws, and the table names its calls."""
    pytest.importorskip("matplotlib", reason="the figure needs matplotlib (the bench extra)")
    from bench.report import plot, tables

    seconds = {"plain": 0.010, "sinks": 0.011, "softcap blocks": 0.012}
    res = {"variants": {"dtype": "float32", "heads": [4, 2], "head_dim": 16, "softcap": 30.0, "chosen": "blocks",
                        "rows": [{"S": 256, "window": -1, "seconds": seconds, "masked_over_blocks": 1.5,
                                  "over_plain": {n: s / 0.010 for n, s in seconds.items()}}]}}
    plot(res, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").exists()
    title, header, rows = next(t for t in tables(res) if t[0].startswith("Attention variants"))
    assert header == ["S", "window", "plain ms", "sinks", "softcap blocks", "masked / blocks"]
    assert rows[0][:4] == ["256", "none", "10", "11 (1.10x)"]


def test_the_consensus_section_shows_its_collective_against_an_all_gather():
    """The consensus section adds the per-call cost of the check's all-reduce beside an all-gather of the same
    fingerprints; results written before it ran (no ``collectives``) still give the section's first table."""
    from bench.report import tables

    res = {"consensus": {"cp": 4, "S": 8192, "seconds": {"on": 0.021, "off": 0.015, "step": 1.0}, "batch_fn_ratio": 1.4,
                         "added_over_step": 0.006, "collectives": {"all_reduce": {"cpu_ms": 0.5, "wall_ms": 1.5},
                                                                   "all_gather": {"cpu_ms": 1.5, "wall_ms": 3.0}}}}
    titles = [t[0] for t in tables(res)]
    collective = [t for t in tables(res) if t[0].startswith("The consensus check's collective, CP 4")]
    assert len(collective) == 1 and collective[0][2] == [["all_reduce", "0.500", "1.500", "1.00x"],
                                                         ["all_gather", "1.500", "3.000", "3.00x"]]
    del res["consensus"]["collectives"]
    assert [t[0] for t in tables(res)] == [t for t in titles if not t.startswith("The consensus check's collective")]
